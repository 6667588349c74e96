"""`llmtrace report`: a saved trace as one self-contained HTML page, and the `--html` option of the run commands."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.options import ForceOpt, LangOpt, html_target, write_html
from llmtrace.cli.outputs import check_outputs

REPORT_HELP = """Render a saved trace (--json or --jsonl of generate, explain or lens) as one HTML page; a saved
comparison (compare, diff) or patching sweep (patch) as the page its --html writes.

The page is a single file that loads nothing from the network: open it from disk in any browser. Its sections
follow the seed table: the run, the pipeline s1-s12 (shapes with named axes), the walk-through (one token through
the pass on the trace's values: --trace full), tokens, each step (top-k and the sampler funnel), the what-if
sampler (sliders on each step's kept logits), attention, the logit lens, the KV cache and the residual stream; an
explain page also carries every table the terminal explain prints. A section the trace has no values for says
which flags would record them. --lang zh writes the page in Simplified Chinese. No model is loaded; the model's
tokenizer is read, when it is at hand, for the BPE merges.

Examples:

  llmtrace generate "Quantum mechanics is" -n 32 --trace full --layers 0,-1 --json run.json

  llmtrace report run.json -o report.html

  llmtrace lens "The capital of France is" --positions all --jsonl lens.jsonl

  llmtrace report lens.jsonl -o lens.html

  llmtrace generate -p "The capital of France is" -p "Hi" -n 8 --json batch.json

  llmtrace report batch.json -o row1.html --row 1      # a batch: one page per row

  llmtrace report run.json -o report-zh.html --lang zh   # the page in Simplified Chinese

  llmtrace generate "Once upon a time" -n 16 --html story.html

  llmtrace report cmp.jsonl -o cmp.html       # a saved compare --jsonl: the page compare --html writes
"""


def declared_schema(path: str) -> Optional[str]:
    """The schema a JSON document names at its start ({"schema": ...}), without parsing the whole file."""
    if path == "-":
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(200).decode("utf-8", "replace")
    except OSError:
        return None
    m = re.match(r'\s*\{\s*"schema"\s*:\s*"([^"]*)"', head)
    return m.group(1) if m else None


MERGES_HOW = "give the model with -m PATH (its .gguf file or HF directory) to draw it"


def tokenizer_for(events: list[dict], model: Optional[str] = None):
    """The tokenizer of `model`, else of the model the trace names, if it can be read here: (tokenizer, note). The
    note, when there is one, says why not and how to draw the merge story all the same."""
    head = next((e for e in events if e.get("event") == "run"), None) or next(
        (e for e in events if e.get("event") == "explain" and e.get("section") == "model"), None)
    name = model or (head["model"].get("name") if head else None)
    if not name:
        return None, f"the trace names no model, so the merge story cannot be drawn; {MERGES_HOW}"
    if model is None and not _known(name):  # a model loaded from a file: named by its stem, found by its path
        path = head["model"].get("path")
        if not path or not Path(path).exists():
            gone = f" and its file {path} is not here" if path else ""
            return None, (f"the trace names its model {name!r}, which is no model known here (a model loaded from "
                          f"a file is named by the file){gone}, so its tokenizer was not read; {MERGES_HOW}")
        name = path
    try:
        from llmtrace.checkpoint.tokenizer_only import load_tokenizer

        return load_tokenizer(name), None
    except Exception as e:  # not in the cache, not reachable: the page is made without the merge story
        return None, f"the tokenizer of {name} could not be read here ({' '.join(str(e).split())[:120]}); {MERGES_HOW}"


def _known(name: str) -> bool:
    """Whether -m NAME would find a model: a registry name, a hub id, or a path that is there."""
    from llmtrace.registry.models_toml import load_registry

    return name in load_registry() or name.count("/") == 1 or Path(name).exists()


@app.command(help=REPORT_HELP)
def report(
    trace: Annotated[str, typer.Argument(help="The trace file (JSON document or JSONL stream), or - for stdin.")],
    output: Annotated[str, typer.Option("--output", "-o", help="The HTML file to write.", callback=html_target)],
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="The model whose tokenizer draws the BPE merge story (default: the one the trace "
        "names; give the path for a model loaded from a file).", show_default=False)] = None,
    merges: Annotated[bool, typer.Option("--merges/--no-merges",
                                         help="Read the model's tokenizer for the BPE merge story.")] = True,
    row: Annotated[int, typer.Option("--row", help="For a trace of several prompts (generate -p … -p …): the row "
                                     "the page shows, 0-based.")] = 0,
    lang: LangOpt = "en",
    force: ForceOpt = False,
) -> None:
    from llmtrace.api import read_trace
    from llmtrace.report.data import check_schema
    from llmtrace.errors import LlmtraceError
    from llmtrace.trace.reader import trace_kind

    check_outputs({"-o": output}, {"the trace to render": trace, "the model (-m)": model}, force=force)
    events = read_trace(trace).events
    if trace_kind(events, trace) not in ("generate", "explain", "lens"):  # compare, diff, patch: their --html page
        write_html(events, output, None, row=row)
        return
    try:
        check_schema(events, declared_schema(trace))
    except LlmtraceError as e:
        raise LlmtraceError(f"{trace}: {e}") from None
    tok, note = tokenizer_for(events, model) if merges else (None, "the merge story was left out (--no-merges)")
    if merges and tok is None:  # said here too: a page is not the place to learn that a flag was missing
        print(f"warning: the page has no BPE merge story: {note}", file=sys.stderr)
    write_html(events, output, tok, merges_note=note, row=row, lang=lang)
