"""`llmtrace attribute`: direct logit attribution (llmtrace.run.attribution), as bars, JSON or an HTML page."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.options import (ChatOpt, FileOpt, ForceOpt, JsonOpt, OneDeviceLoadFlags, PromptArg, SystemOpt,
                                  flag_groups, html_target, load_for_cli, write_output)
from llmtrace.cli.outputs import check_outputs
from llmtrace.errors import UsageError

ATTRIBUTE_HELP = """Direct logit attribution: which heads, feed-forwards and experts wrote a token's logit.

The residual stream after the last layer is a sum of parts: the embedding, each attention head's output through its
slice of the output projection, each feed-forward's output (each chosen expert's, times its router weight), each
linear-attention head's. With the final norm's scale frozen at this prompt's value (and a sandwich norm's, Gemma's,
likewise), the logit of --target at the last position is the sum of the parts' direct contributions, exactly.

\b
--target and --against must each be one token; a leading space is usually
part of a word's token: " Paris", not "Paris".

Examples:

\b
  llmtrace attribute "The capital of France is" --target " Paris"
  llmtrace attribute "The capital of France is" --target " Paris" \\
      --against " London" --top 20
  llmtrace attribute "The capital of France is" --target " Paris" \\
      --json dla.json --html dla.html
"""


@app.command(help=ATTRIBUTE_HELP)
@flag_groups
def attribute(
    prompt: PromptArg = None,
    file: FileOpt = None,
    target: Annotated[Optional[str], typer.Option("--target", metavar="TEXT", help="The token whose logit is split "
                                                  "(one token).", show_default=False)] = None,
    against: Annotated[Optional[str], typer.Option("--against", metavar="TEXT", help="Split logit(target) − "
                                                   "logit(against) instead (one token).", show_default=False)] = None,
    position: Annotated[int, typer.Option("--position", help="The prompt position whose logit is split (negative "
                                          "from the end).")] = -1,
    top: Annotated[int, typer.Option("--top", help="Parts shown, largest first.")] = 12,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    load: OneDeviceLoadFlags = None,
    json_out: JsonOpt = None,
    html: Annotated[Optional[str], typer.Option("--html", metavar="FILE", help="Also write every part as a "
                                                "self-contained HTML page.", show_default=False,
                                                callback=html_target)] = None,
    force: ForceOpt = False,
) -> None:
    from llmtrace.cli.text_input import read_prompt

    if target is None or target == "":
        raise UsageError("--target is missing; give the token whose logit is split, e.g. --target \" Paris\"")
    if against == "":
        raise UsageError("--against is empty; give one token, or leave it out")
    if top < 1:
        raise UsageError(f"--top must be ≥ 1, not {top}")
    text = read_prompt(prompt, file)
    check_outputs({"--json": json_out, "--html": html}, {"the prompt file (--file)": file, "the model (-m)": load.model},
                  force=force)
    model_ = load_for_cli(load.options())
    r = model_.attribute(text, target=target, against=against, position=position, chat=chat, system=system)
    from llmtrace.trace.records import model_record

    event = r.record() | {"prompt": text, "model": model_record(model_.loaded)}
    if json_out:
        import json

        write_output(json_out, json.dumps(event, ensure_ascii=False) + "\n")  # one object (not a trace document)
    if html:
        from llmtrace.report.attribution import write_attribution_html

        n = write_attribution_html(event, html)
        print(f"wrote {html} ({n / 1e3:.0f} kB)", file=sys.stderr)
    if json_out != "-" or sys.stderr.isatty():
        from llmtrace.console import make_console
        from llmtrace.render.attribution import render_attribution

        render_attribution(event, make_console(stderr=json_out == "-"), top)
