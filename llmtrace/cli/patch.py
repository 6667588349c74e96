"""`llmtrace patch`: the activation-patching sweep (llmtrace.run.patching), as a heatmap, JSON or an HTML page."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.options import (ForceOpt, JsonOpt, LangOpt, OneDeviceLoadFlags, check_lang, flag_groups, html_target,
                                  load_for_cli, write_output)
from llmtrace.cli.outputs import check_outputs
from llmtrace.errors import UsageError

PATCH_HELP = """The activation-patching sweep: which layer and position carry the answer.

Runs the corrupt prompt once for every layer and every position, with the clean prompt's activation (--at, a
residual-stream point) patched in there, and measures m = logit(--answer) − logit(--against) at the last position.
Each cell shows the recovery (m − m_corrupt) / (m_clean − m_corrupt): 1 where the patch restores the clean run's
answer, 0 where it changes nothing. This is ROME's causal tracing and TransformerLens's activation patching.

\b
The two prompts must have the same number of tokens; --answer and --against
must each be one token. A leading space is usually part of a word's token:
" Paris", not "Paris". The prompts are read as plain text (no chat template).

Examples:

\b
  llmtrace patch --clean "The Eiffel Tower is in the city of" \\
      --corrupt "The Colosseum is in the city of" \\
      --answer " Paris" --against " Rome"
  llmtrace patch --clean … --corrupt … --answer " Paris" --against " Rome" \\
      --at resid_pre --json sweep.json
  llmtrace patch --clean … --corrupt … --answer " Paris" --against " Rome" \\
      --html sweep.html
  llmtrace patch --clean … --corrupt … --answer " Paris" --against " Rome" \\
      --html sweep-zh.html --lang zh     # the page in Chinese

One cell equals `llmtrace generate CORRUPT -n 0 --patch L.AT@P --from CLEAN` (the same run, alone).

--method attribution estimates every cell from one forward and one backward pass (attribution patching: the clean
minus the corrupt activation, times the metric's gradient at the corrupt run), and each head's effect too; --check
also runs the exact patches and reports how the estimates agree with them (Pearson's r, the top-10 overlap):

\b
  llmtrace patch --clean … --corrupt … --answer " Paris" --against " Rome" \\
      --method attribution --check
"""


@app.command(help=PATCH_HELP)
@flag_groups
def patch(
    clean: Annotated[str, typer.Option("--clean", metavar="TEXT", help="The prompt whose activations are patched in.",
                                       show_default=False)],
    corrupt: Annotated[str, typer.Option("--corrupt", metavar="TEXT", help="The prompt that runs, patched.",
                                         show_default=False)],
    answer: Annotated[str, typer.Option("--answer", metavar="TEXT", help="The clean prompt's answer (one token).",
                                        show_default=False)],
    against: Annotated[str, typer.Option("--against", metavar="TEXT", help="The corrupt prompt's answer (one token).",
                                         show_default=False)],
    at: Annotated[Optional[str], typer.Option("--at", help="Where to patch: a residual-stream point of the layer "
                  "(resid_pre, resid_mid, resid_post). Default: the layer's output.",
                  show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", help="exact: one run per cell; attribution: every cell "
                      "estimated from one forward and one backward pass, (clean − corrupt) · gradient, with each "
                      "head's estimate too.")] = "exact",
    check: Annotated[bool, typer.Option("--check", help="With --method attribution: also run the exact patches and "
                                        "report how the estimates agree (Pearson's r, the top-k overlap).")] = False,
    load: OneDeviceLoadFlags = None,
    json_out: JsonOpt = None,
    html: Annotated[Optional[str], typer.Option("--html", metavar="FILE", help="Also write the heatmap as a "
                                                "self-contained HTML page.", show_default=False,
                                                callback=html_target)] = None,
    lang: LangOpt = "en",
    force: ForceOpt = False,
) -> None:
    check_lang(lang, html)
    if at is not None:  # no torch: every family keeps Llama's residual-stream points (the model's own are checked after)
        from llmtrace.model.llama_points import llama_points

        known = llama_points().names(layer=True, residual=True, editable=True)
        if at not in known:
            raise UsageError(f"--at {at!r} is not a residual-stream point; one of {', '.join(known)}")
    for flag, text in (("--clean", clean), ("--corrupt", corrupt), ("--answer", answer), ("--against", against)):
        if text == "":
            raise UsageError(f"{flag} is empty; give some text")
    if method not in ("exact", "attribution"):
        raise UsageError(f"--method {method!r} is not one of exact, attribution")
    if check and method != "attribution":
        raise UsageError("--check compares attribution patching's estimates with the exact sweep: give --method "
                         "attribution")
    check_outputs({"--json": json_out, "--html": html}, {"the model (-m)": load.model}, force=force)
    model_ = load_for_cli(load.options())

    from llmtrace.api import patch_sweep
    from llmtrace.trace.records import model_record

    if method == "attribution":
        from llmtrace.run.attribution_patching import attribution_sweep

        event = attribution_sweep(model_.loaded, clean, corrupt, answer, against, at=at, check=check,
                                  on_progress=_progress())
    else:
        event = patch_sweep(model_, clean, corrupt, answer, against, at=at, on_progress=_progress())
    event["model"] = model_record(model_.loaded)
    if json_out:
        import json

        from llmtrace.trace.events import SCHEMA_ID

        write_output(json_out, json.dumps({"schema": SCHEMA_ID, "events": [event]}, ensure_ascii=False) + "\n")
    if html:
        from llmtrace.report.patch import write_patch_html

        n = write_patch_html(event, html, lang)
        print(f"wrote {html} ({n / 1e3:.0f} kB)", file=sys.stderr)
    if json_out != "-" or sys.stderr.isatty():
        from llmtrace.console import make_console
        from llmtrace.render.patch import render_patch

        render_patch(event, make_console(stderr=json_out == "-"))


def _progress():
    """Progress on stderr, one line rewritten in place on a terminal (the sweep takes seconds to minutes)."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        print(f"\rpatching: position {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    return show
