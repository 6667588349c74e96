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
    "Render a saved trace (--json document or --jsonl stream) as the terminal view. No model is loaded.\n\n"
    "Every event is checked against the schema first; a problem is one line naming the line (JSONL) or the event "
    "number (JSON) and the field. A JSONL stream cut off mid-line (a run that was killed) shows its complete lines, "
    "with a warning on stderr.\n\n"
    "Examples:\n\n  llmtrace generate \"Hello\" --json run.json && llmtrace show run.json\n\n"
    "  llmtrace generate \"Hello\" --jsonl - | llmtrace show -\n\n"
    "  jq . run.json > pretty.json && llmtrace show pretty.json"
))
def show(
    trace: Annotated[str, typer.Argument(help="The trace file, or - for stdin.")],
) -> None:
    from llmtrace.api import read_trace
    from llmtrace.console import make_console
    from llmtrace.render.generate import render_events

    events = read_trace(trace).events
    console = make_console()
    first = next((e for e in events if e["event"] == "explain" and e["section"] == "model"), None)
    try:
        if first is not None:  # a trace written by `explain` or `lens`
            from llmtrace.render.explain import render_explain, render_lens

            (render_lens if first["command"] == "lens" else render_explain)(events, console)
            return
        render_events(events, console)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        # the schema check passed, so this is a renderer that wants more than the schema promises: a bug of ours
        raise LlmtraceError(f"{trace}: an event that the schema accepts could not be shown ({type(e).__name__}: "
                            f"{e}); please report this") from e
