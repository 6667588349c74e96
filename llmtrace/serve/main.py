"""Starting the server: load the models on the Python API, make the token, print the URL, run uvicorn until Ctrl-C."""

from __future__ import annotations

import asyncio
import secrets
import socket
import sys
from typing import Optional

from llmtrace.serve.runs import Limits, Served, looks_like_path

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def served_model(spec: Optional[str], model, limits: Limits) -> Served:
    """A loaded model as the server names it: its registry name, or for a file or a directory the name the trace
    gives it (the file's stem): a page and a request never see a path."""
    name = spec if spec and not looks_like_path(spec) else model.loaded.name
    return Served(name=name, model=model, slots=asyncio.Semaphore(limits.concurrent_per_model))


def run_server(specs: list[Optional[str]], *, host: str, port: int, open_browser: bool, allow_pull: bool,
               max_new_tokens: int, lang: str, load_options: dict) -> None:
    import uvicorn

    from llmtrace.api import load
    from llmtrace.serve.app import make_app

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        from llmtrace.errors import LlmtraceError

        sock.close()
        raise LlmtraceError(f"cannot listen on {host}:{port} ({e.strerror}); choose another port, or port 0 for any "
                            f"free one") from None  # before any model loads: a port in use is said at once

    limits = Limits(max_new_tokens=max_new_tokens)
    opts = {k: v for k, v in load_options.items() if v is not None}
    served: dict[str, Served] = {}
    for spec in specs:
        model = load(spec, **opts)
        s = served_model(spec, model, limits)
        served[s.name] = s

    def pull(name: str) -> Served:  # --allow-pull: a registry name, loaded once
        if name not in served:
            served[name] = served_model(name, load(name, **opts), limits)
        return served[name]

    if host not in LOOPBACK:
        print(f"warning: serving on {host}, not only this machine: anyone who can reach it and has the token can "
              f"run the model", file=sys.stderr)
    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(24)
    app = make_app(served, token, host=host, port=port, limits=limits, allow_pull=allow_pull, lang=lang, load=pull)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/?token={token}"
    print(f"llmtrace serve: {', '.join(served)} at {url}  (Ctrl-C stops it)", flush=True)
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
