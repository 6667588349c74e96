"""`llmtrace schema` and `llmtrace show`: the event contract, and saved traces rendered without a model."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from llmtrace.cli.app import app
from llmtrace.errors import LlmtraceError


@app.command(help="Print the JSON Schema of trace events (llmtrace.trace/1).\n\nExample:\n\n  llmtrace schema > trace.schema.json")
def schema() -> None:
    from llmtrace.trace.events import schema_path

    sys.stdout.write(schema_path().read_text(encoding="utf-8"))


@app.command(help=(
    "Render a saved file of llmtrace's (--json document or --jsonl stream of generate, explain, lens, compare, diff or "
    "patch) as the command that wrote it shows it in the terminal. No model is loaded.\n\n"
    "Every event is checked against the schema first; a problem is one line naming the line (JSONL) or the event "
    "number (JSON) and the field. A JSONL stream cut off mid-line (a run that was killed) shows its complete lines, "
    "with a warning on stderr. Anything else (a file llmtrace did not write) is refused with one line, exit 2.\n\n"
    "Examples:\n\n  llmtrace generate \"Hello\" --json run.json && llmtrace show run.json\n\n"
    "  llmtrace generate \"Hello\" --jsonl - | llmtrace show -\n\n"
    "  llmtrace compare \"Hello\" --b-dtype bfloat16 --json cmp.json && llmtrace show cmp.json\n\n"
    "  jq . run.json > pretty.json && llmtrace show pretty.json"
))
def show(
    trace: Annotated[str, typer.Argument(help="The file, or - for stdin.")],
) -> None:
    from llmtrace.api import read_trace
    from llmtrace.console import make_console
    from llmtrace.trace.reader import trace_kind

    events = read_trace(trace).events
    kind = trace_kind(events, trace)
    console = make_console()
    try:
        _render(kind, events, console)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        # the schema check passed, so this is a renderer that wants more than the schema promises: a bug of ours
        raise LlmtraceError(f"{trace}: an event that the schema accepts could not be shown ({type(e).__name__}: "
                            f"{e}); please report this") from e


def _render(kind: str, events: list[dict], console) -> None:
    """The terminal view of the command that wrote the events."""
    if kind in ("explain", "lens"):
        from llmtrace.render.explain import render_explain, render_lens

        (render_lens if kind == "lens" else render_explain)(events, console)
    elif kind in ("compare", "diff"):
        from llmtrace.render.compare import render_compare
        from llmtrace.trace.comparison import document

        render_compare(document(events), console)
    elif kind == "patch":
        from llmtrace.render.patch import render_patch

        render_patch(next(e for e in events if e["event"] == "patch"), console)
    else:
        from llmtrace.render.generate import render_events

        render_events(events, console)
