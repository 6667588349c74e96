"""`llmtrace serve`: the learner's page, live on this machine (Starlette on uvicorn: pip install 'llmtrace[serve]')."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.options import DeviceOpt, DtypeOpt, LangOpt, ThreadsOpt

SERVE_HELP = """Serve the learner's page on this machine: type a prompt, watch it generate token by token, move the
sampler's sliders, ablate a head and see what changed, all on the real model.

At start it prints one line with the URL, holding a fresh random token (http://127.0.0.1:8321/?token=...), and opens
the browser (unless --no-browser, or stdout is not a terminal). Every request needs that token; the server binds
127.0.0.1 unless --host says otherwise, refuses a Host header that is not its own (DNS rebinding) and any other
origin, opens no path a request names, and bounds each request (--max-new-tokens, the body, one run per model at a
time: the others queue). Ctrl-C stops it. The API (POST /api/generate, ...) is in the README.

Needs the optional extra serve: pip install 'llmtrace[serve]', or pip install -e '.[serve]' in a clone.

Examples:

  llmtrace serve

  llmtrace serve -m ./my-model.gguf --port 8400 --no-browser
"""


@app.command(help=SERVE_HELP)
def serve(
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", "-m", metavar="MODEL", help="A model to serve (repeatable; default: the default model). Requests "
        "may name only these.", show_default=False)] = None,
    host: Annotated[str, typer.Option("--host", help="The address to bind. Anything but loopback prints a warning; "
                                      "the token is needed all the same.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="The port (0: any free one).")] = 8321,
    no_browser: Annotated[bool, typer.Option("--no-browser", help="Do not open a browser.")] = False,
    allow_pull: Annotated[bool, typer.Option("--allow-pull", help="Requests may also name models of the registry "
                                             "(fetched and loaded on first use).")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="The most tokens one run may ask for.")] = 256,
    lang: LangOpt = "en",
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        from llmtrace.errors import LlmtraceError
        from llmtrace.extras import needs_extra

        raise LlmtraceError(needs_extra("llmtrace serve", "serve")) from None
    if not 0 <= port < 65536:
        raise typer.BadParameter("must be 0..65535", param_hint="--port")
    if max_new_tokens < 1:
        raise typer.BadParameter("must be ≥ 1", param_hint="--max-new-tokens")
    from llmtrace.serve.main import run_server

    run_server(model or [None], host=host, port=port, open_browser=not no_browser and sys.stdout.isatty(),
               allow_pull=allow_pull, max_new_tokens=max_new_tokens, lang=lang,
               load_options={"device": device, "dtype": dtype, "threads": threads})
