"""The server's application: the learner's page and the API it uses, behind the rules that keep it local.

    GET  /                     the page (report.serve_page): a prompt, the options, Run; the learner's page of each run
    GET  /api/models           the models served, and the limits
    POST /api/generate         a run's events as application/x-ndjson, exactly the lines of `generate --jsonl`, streamed
    POST /api/explain, /lens   the same for explain and lens
    POST /api/compare          one model under two settings (side B: b_ablate, b_scale, b_model), the events of
                               `compare --jsonl`, when the comparison is done
    POST /api/patch            the activation-patching sweep's event
    POST /api/resample         one step of a finished generate run drawn again by the run's Sampler under other
                               settings, on the logits that step produced (serve/resample.py): its step event
    GET  /api/page?run=ID      the learner's page (the report) of a finished run, by the id the stream gave; the
                               comparison page of a compare run

Every request needs the server's token (`?token=` or `Authorization: Bearer`; 401 without), a Host header that names
this server (the bound address or localhost: a DNS-rebinding page is refused) and, when the browser says where it
comes from, this server's own origin (403 for any other). A request names no path: a model is one the server was
started with. Bodies, tokens per run and the queue are bounded (runs.Limits).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
from typing import Any, Callable, Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmtrace.errors import UsageError
from llmtrace.serve.runs import KEYS, History, Job, Limits, Served, error_body, options_of, pick_model, stream
from llmtrace.units import plural

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the token is in the page's URL: never sent on
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}


def allowed_hosts(host: str, port: int) -> set[str]:
    names = {host, "localhost", "127.0.0.1", "[::1]"}
    return {n for name in names for n in (name, f"{name}:{port}")}


class Guard:
    """ASGI middleware: the Host, the origin and the token of every request, and the body's declared size."""

    def __init__(self, app, token: str, hosts: set[str], body_bytes: int):
        self.app, self.token, self.hosts, self.body_bytes = app, token, hosts, body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            status, message = refusal
            return await JSONResponse({"error": message}, status, headers=SECURITY_HEADERS)(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, scope, headers: dict[str, str]) -> Optional[tuple[int, str]]:
        host = headers.get("host", "")
        if host not in self.hosts:
            return 421, f"Host {host!r} is not this server (DNS rebinding is refused)"
        origin = headers.get("origin")
        if origin is not None and origin not in {f"http://{host}", f"https://{host}"}:
            return 403, "cross-origin requests are refused"
        if headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
            return 403, "cross-site requests are refused"
        given = ""
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        else:
            from urllib.parse import parse_qs

            given = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token") or [""])[0]
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return 401, "this server needs its token: open the URL it printed (…/?token=…)"
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.body_bytes):
            return 413, f"the request body is larger than {self.body_bytes:,} bytes"
        return None


class BodyTooLarge(UsageError):
    """A request body over the server's limit (HTTP 413)."""


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, read up to `limit` bytes (a body without a length is counted as it comes). A body that is
    too large or not JSON is a UsageError: its message is the answer, as the CLI's is."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the request body is larger than {limit:,} bytes")
        chunks.append(chunk)
    try:
        return json.loads((b"".join(chunks) or b"{}").decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError("the request body is not JSON (it is not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"the request body is not JSON ({e.msg})") from None


def make_app(served: dict[str, Served], token: str, *, host: str = "127.0.0.1", port: int = 8321,
             limits: Optional[Limits] = None, allow_pull: bool = False, lang: str = "en",
             load: Optional[Callable[[str], Served]] = None) -> Starlette:
    """The application over `served` (name -> Served), guarded by `token`."""
    limits = limits or Limits()
    history = History(limits)  # the pages of the last runs, and what re-sampling their steps needs
    pull = load or (lambda name: None)

    def refused(e: Exception) -> Response:  # BadValue, UsageError, a body too large or not JSON, a wrong type
        return JSONResponse(error_body(e), 413 if isinstance(e, BodyTooLarge) else 400, headers=SECURITY_HEADERS)

    async def page(request: Request) -> Response:
        from llmtrace.report.serve_page import serve_page

        return HTMLResponse(serve_page(list(served), limits, lang), headers=SECURITY_HEADERS)

    async def models(request: Request) -> Response:
        out = [{"name": name, **{k: s.model.loaded.config.__dict__[k] for k in ("n_layers", "n_heads", "n_kv_heads")}}
               for name, s in served.items()]
        return JSONResponse({"models": out, "limits": limits.__dict__}, headers=SECURITY_HEADERS)

    async def run(request: Request) -> Response:
        kind = request.path_params["kind"]
        if kind not in KEYS:
            return JSONResponse({"error": f"no API {kind!r}; the runs are {', '.join(KEYS)}, and resample"}, 404,
                                headers=SECURITY_HEADERS)
        try:
            body = await read_json(request, limits.body_bytes)
            s = await asyncio.to_thread(pick_model, body if isinstance(body, dict) else {}, served, allow_pull, pull)
            prompt, options = options_of(kind, body, limits)
            other = None
            if kind == "compare" and options["b_model"] is not None:  # side B on another model: one served here
                other = await asyncio.to_thread(pick_model, {"model": options["b_model"]}, served, allow_pull, pull)
        except Exception as e:  # the caller's request, never the server's end
            return refused(e)
        if s.waiting >= limits.queued_per_model:
            waits = 'waits' if s.waiting == 1 else 'wait'
            busy = f"{plural(s.waiting, 'run')} already {waits} for {s.name}; try again later"
            return JSONResponse({"error": busy}, 429,
                                headers=SECURITY_HEADERS)
        job = Job(s, kind, prompt, options, secrets.token_hex(8), other)
        return StreamingResponse(stream(job, limits, history), media_type="application/x-ndjson",
                                 headers=SECURITY_HEADERS)

    async def resample(request: Request) -> Response:
        from llmtrace.serve.resample import NoSuchRun, resample_request

        try:
            body = await read_json(request, limits.body_bytes)
            answer = await asyncio.to_thread(resample_request, body, history.kept, served)
        except NoSuchRun as e:  # never made, or gone to make room
            return JSONResponse({"error": str(e)}, 404, headers=SECURITY_HEADERS)
        except Exception as e:
            return refused(e)
        return JSONResponse(answer, headers=SECURITY_HEADERS)

    async def report(request: Request) -> Response:
        r = history.pages.get(request.query_params.get("run", ""))
        want = request.query_params.get("lang", lang)
        if r is None:
            return JSONResponse({"error": f"no such run (the server keeps the last {history.PAGES})"}, 404,
                                headers=SECURITY_HEADERS)
        if want not in ("en", "zh"):
            return JSONResponse({"error": "lang must be en or zh"}, 400, headers=SECURITY_HEADERS)
        if "compare" in r:  # the comparison page
            from llmtrace.report.compare import render_compare_page

            return HTMLResponse(await asyncio.to_thread(render_compare_page, r["compare"], want), headers=SECURITY_HEADERS)
        from llmtrace.report.write import build

        html = await asyncio.to_thread(build, r["events"], r["tokenizer"], None, 0, want)
        return HTMLResponse(html, headers=SECURITY_HEADERS)

    routes = [Route("/", page), Route("/api/models", models), Route("/api/page", report),
              Route("/api/resample", resample, methods=["POST"]), Route("/api/{kind:str}", run, methods=["POST"])]
    app = Starlette(routes=routes)

    async def unknown_kind(request, exc):  # /api/anything-else
        return JSONResponse({"error": "not found"}, 404, headers=SECURITY_HEADERS)

    app.add_exception_handler(404, unknown_kind)
    guarded = Guard(app, token, allowed_hosts(host, port), limits.body_bytes)
    guarded.routes = app.routes  # for tests that look
    return guarded
