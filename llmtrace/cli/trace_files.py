"""`llmtrace schema` and `llmtrace show`: the event contract, and saved traces rendered without a model."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from llmtrace.cli.app import app


@app.command(help="Print the JSON Schema of trace events (llmtrace.trace/1).\n\nExample:\n\n  llmtrace schema > trace.schema.json")
def schema() -> None:
    from llmtrace.events import schema_path

    sys.stdout.write(schema_path().read_text(encoding="utf-8"))


@app.command(help=(
    "Render a saved trace (--json document or --jsonl stream) as the terminal view. No model is loaded.\n\n"
    "Examples:\n\n  llmtrace generate \"Hello\" --json run.json && llmtrace show run.json\n\n"
    "  llmtrace generate \"Hello\" --jsonl - | llmtrace show -"
))
def show(
    trace: Annotated[str, typer.Argument(help="The trace file, or - for stdin.")],
) -> None:
    from llmtrace.render import make_console, render_events
    from llmtrace.events import load_trace

    events = load_trace(trace)
    console = make_console()
    first = next((e for e in events if e.get("event") == "explain" and e.get("section") == "model"), None)
    if first is not None:  # a trace written by `explain` or `lens`
        from llmtrace.cli.explain import render_explain, render_lens

        (render_lens if first.get("command") == "lens" else render_explain)(events, console)
        return
    render_events(events, console)
