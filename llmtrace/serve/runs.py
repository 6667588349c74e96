"""What a request may ask of the server, checked as the CLI checks it, and the runs themselves on the Python API.

A request body is JSON with the keywords of `Model.generate` / `explain` / `lens` / `compare` that make sense over
HTTP (no file names: `dump`, `save_tensors`, `compile` are refused, as is any path) plus `prompt` and `model`, one of
the models the server was started with (or, with --allow-pull, a registry name). Each run goes through the same
options values (`GenerateOptions`, ...) that check themselves, so a bad value gives the CLI's one-line message, here
as a JSON error. `History` keeps the last runs' pages and, for re-sampling, their steps' logits (resample.py).
"""

from __future__ import annotations

import asyncio
import json
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from llmtrace.errors import BadValue, LlmtraceError, UsageError, one_line
from llmtrace.trace.writers import dumps

# The keywords a request may give, per kind of run (beside "prompt" and "model").
GENERATE_KEYS = {"max_new_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty", "seed", "ignore_eos", "chat", "system", "stop", "trace",
                 "layers", "show_top", "ablate", "scale", "top_n_sigma", "xtc_probability", "xtc_threshold",
                 "dry_multiplier", "mirostat", "sampler_order"}
EXPLAIN_KEYS = {"layer", "head", "top", "chat", "system", "ablate", "scale"}
LENS_KEYS = {"positions", "layers", "top", "chat", "system", "ablate", "scale"}
PATCH_KEYS = {"clean", "corrupt", "answer", "against", "at"}
COMPARE_KEYS = {"b_model", "max_new_tokens", "chat", "system", "tolerance", "b_ablate", "b_scale"}
INTERVENTIONS = ("ablate", "scale")  # the keywords that are interventions, parsed apart (interventions())
KEYS = {"generate": GENERATE_KEYS, "explain": EXPLAIN_KEYS, "lens": LENS_KEYS, "patch": PATCH_KEYS,
        "compare": COMPARE_KEYS}


@dataclass
class Limits:
    """What one request may ask: the body's size, the tokens a run generates, the prompt's length, the runs a model
    makes at once (the others wait their turn, told their place) and how many wait."""

    body_bytes: int = 64 * 1024
    max_new_tokens: int = 256
    prompt_chars: int = 16_000
    concurrent_per_model: int = 1
    queued_per_model: int = 8
    kept_logits_bytes: int = 256 * 2**20  # the logits kept for re-sampling steps, all runs together (resample.py)


class Cancelled(Exception):
    """The client went away: the run stops at its next event."""


@dataclass
class Served:
    """One model the server runs: the loaded Model, one lock per concurrent run, and who waits."""

    name: str
    model: Any  # llmtrace.api.Model
    slots: asyncio.Semaphore
    waiting: int = 0  # requests waiting for a slot
    active: int = 0  # runs holding one
    lock: threading.Lock = field(default_factory=threading.Lock)


def looks_like_path(name: str) -> bool:
    return any(c in name for c in "/\\") or name.startswith((".", "~")) or name.endswith((".gguf", ".safetensors"))


def pick_model(body: dict, served: dict[str, Served], allow_pull: bool, load: Callable[[str], Served]) -> Served:
    """The model a request names (its "model"; the first one served when it names none). A path is refused, never
    opened; a name the server was not started with is refused unless --allow-pull allows registry names."""
    name = body.get("model")
    if name is None:
        return next(iter(served.values()))
    if not isinstance(name, str) or not name:
        raise BadValue("model", " must be the name of a model this server runs")
    if name in served:
        return served[name]
    if looks_like_path(name):
        raise BadValue("model", f" {name!r} looks like a path: a request may only name a model the server was "
                                f"started with ({', '.join(served)}); paths are never opened")
    if allow_pull:
        from llmtrace.registry.models_toml import load_registry

        if name in load_registry():
            return load(name)
    raise BadValue("model", f" {name!r} is not served here; the models are: {', '.join(served)}")


def options_of(kind: str, body: dict, limits: Limits) -> tuple[Any, Any]:
    """(prompt, the options value) of a request, checked: unknown keywords, a path, limits, then the options' own
    checks (BadValue naming the keyword, as the API raises it)."""
    from llmtrace.api import ExplainOptions, GenerateOptions, LensOptions

    if not isinstance(body, dict):
        raise BadValue("body", " must be a JSON object")
    unknown = sorted(set(body) - KEYS[kind] - {"prompt", "model"})
    if unknown:
        raise BadValue(unknown[0], f" is not an option of {kind} here; it takes: prompt, model, "
                                   f"{', '.join(sorted(KEYS[kind]))}")
    if kind == "patch":  # the sweep: two prompts of as many tokens, two one-token answers (api.patch_sweep checks)
        given = {k: body.get(k) for k in PATCH_KEYS if k in body}
        for k in ("clean", "corrupt", "answer", "against"):
            if not isinstance(given.get(k), str) or not given[k]:
                raise BadValue(k, " must be a non-empty text")
        if len(given["clean"]) + len(given["corrupt"]) > limits.prompt_chars:
            raise BadValue("clean", f" and corrupt are longer than this server takes ({limits.prompt_chars:,})")
        return None, given
    check_json_types(kind, body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadValue("prompt", " must be a non-empty text")
    if len(prompt) > limits.prompt_chars:
        raise BadValue("prompt", f" is {len(prompt):,} characters; this server takes at most {limits.prompt_chars:,}")
    if kind == "compare":
        return prompt, compare_options(body, limits)
    given = {k: v for k, v in body.items() if k not in ("prompt", "model") and k not in INTERVENTIONS}
    given["interventions"] = interventions(body)
    if kind == "generate":
        check_tokens(given.setdefault("max_new_tokens", min(32, limits.max_new_tokens)), limits)
        return prompt, GenerateOptions.of(**given, for_report=True)
    cls = ExplainOptions if kind == "explain" else LensOptions
    return prompt, cls(**given)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value can be the Python value of type HINT (an options field's annotation)."""
    import collections.abc
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        return any(_fits(value, a) for a in args)
    if origin in (list, tuple, collections.abc.Sequence) and args:
        text_ok = args[0] is str and isinstance(value, str)  # stop="." as well as stop=[".", "!"]
        return text_ok or (isinstance(value, list) and all(_fits(v, args[0]) for v in value))
    return True  # Any, dicts, the options' own objects: their checks say what is wrong


def _wanted(hint: Any) -> str:
    import typing

    words = {bool: "true or false", int: "a whole number", float: "a number", str: "a text", type(None): "null"}
    if hint in words:
        return words[hint]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (list, tuple) or (args and len(args) == 1):
        if not args:
            return "a list"
        return ("a text or " if args[0] is str else "") + f"a list of {_wanted(args[0]).removeprefix('a ')}s"
    return " or ".join(dict.fromkeys(_wanted(a) for a in args))


JSON_KINDS = {list: "a list", dict: "an object"}  # a value of these is named by its kind, any other by itself


def check_json_types(kind: str, body: dict) -> None:
    """Each keyword's JSON type against the options' own annotations, so that `"temperature": "hot"` is named as the
    CLI names a bad value (BadValue), not met later as a TypeError of Python's ("must be real number, not str")."""
    import typing

    from llmtrace.api import ExplainOptions, GenerateOptions, LensOptions
    from llmtrace.run.sampler import SamplerConfig

    classes = {"generate": (GenerateOptions, SamplerConfig), "explain": (ExplainOptions,), "lens": (LensOptions,)}
    hints: dict[str, Any] = {}
    for cls in classes.get(kind, ()):
        hints |= typing.get_type_hints(cls)
    hints["sampler_order"] = hints.get("order")
    for key, value in body.items():
        hint = hints.get(key)
        if hint is not None and not _fits(value, hint):
            given = json.dumps(value)[:40] if not isinstance(value, (list, dict)) else JSON_KINDS[type(value)]
            raise BadValue(key, f" must be {_wanted(hint)}, not {given}")


def check_tokens(n: Any, limits: Limits) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= limits.max_new_tokens:
        raise BadValue("max_new_tokens", f" must be a whole number from 0 to {limits.max_new_tokens} on this server")


def compare_options(body: dict, limits: Limits) -> dict:
    """compare's keywords (run/compare.py checks the rest): side B is side A with `b_ablate`, `b_scale` (the CLI's
    --b-ablate, --b-scale) and, where the server runs several models, `b_model`; -n A's greedy tokens also read."""
    from llmtrace.api import check_system
    from llmtrace.run.compare import DEFAULT_TOLERANCE

    n = body.get("max_new_tokens", 0)
    check_tokens(n, limits)
    chat, system, tolerance = body.get("chat", False), body.get("system"), body.get("tolerance", DEFAULT_TOLERANCE)
    if not isinstance(chat, bool):
        raise BadValue("chat", " must be true or false")
    check_system(chat, system)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise BadValue("tolerance", " must be a number > 0")
    ivs = interventions(body, prefix="b_")
    if not ivs and body.get("b_model") is None:
        raise BadValue("b_ablate", " (or b_scale, b_model) must change side B: else both sides are the same run")
    return {"max_new_tokens": n, "chat": chat, "system": system, "tolerance": float(tolerance), "interventions": ivs,
            "b_model": body.get("b_model")}


def interventions(body: dict, prefix: str = "") -> list:
    """"ablate": ["3.h2", "0.attn"], "scale": ["3.h2=0.5"]: the CLI's specs, parsed by the same functions (compare's
    side B: "b_ablate", "b_scale")."""
    from llmtrace.run.interventions import parse_ablate, parse_scale

    out = []
    for key, parse in ((prefix + "ablate", parse_ablate), (prefix + "scale", parse_scale)):
        specs = body.get(key) or []
        if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
            raise BadValue(key, ' must be a list of specs such as ["3.h2"]')
        out += [parse(s) for s in specs]
    return out


@dataclass
class Job:
    """One request's run: the model, the kind, the prompt and the checked options, and its id."""

    served: Served
    kind: str
    prompt: Optional[str]
    options: Any
    run_id: str
    other: Optional[Served] = None  # compare's side B, when it names another model the server runs


class History:
    """The server's memory of its last runs: each run's page (its events and tokenizer, or a comparison's document),
    the last PAGES of them, and what re-sampling a generate run's steps needs (resample.Kept, bounded in bytes)."""

    PAGES = 16

    def __init__(self, limits: Limits):
        from llmtrace.serve.resample import Kept

        self.pages: dict[str, dict] = {}
        self.kept = Kept(limits.kept_logits_bytes)
        self.lock = threading.Lock()

    def keep(self, run_id: str, page: dict) -> None:
        with self.lock:
            self.pages[run_id] = page
            while len(self.pages) > self.PAGES:  # the oldest run goes, with what it kept for re-sampling
                oldest = next(iter(self.pages))
                del self.pages[oldest]
                self.kept.drop(oldest)

    def forget(self, run_id: str) -> None:
        self.kept.drop(run_id)


@contextlib.contextmanager
def held(*served: Optional[Served]):
    """The locks of the models a run uses, taken in one order (by name), so that two runs never wait on each other."""
    with contextlib.ExitStack() as stack:
        for s in sorted({s.name: s for s in served if s is not None}.values(), key=lambda s: s.name):
            stack.enter_context(s.lock)
        yield


def run_in_thread(job: Job, history: History, sink: Callable[[dict], None], alive: Callable[[], None]
                  ) -> Optional[dict]:
    """One run on the API, its events to `sink` as they are made (generate), or all at the end (explain, lens,
    compare, patch); `alive()` raises Cancelled once the client has gone. Returns the run's page record, if any."""
    model = job.served.model
    with held(job.served, job.other):
        if job.kind == "patch":  # one event, the sweep's, with the model it ran on (what `patch --json` writes)
            from llmtrace.api import patch_sweep
            from llmtrace.trace.records import model_record

            ev = patch_sweep(model, **job.options)
            ev["model"] = model_record(model.loaded)
            sink(ev)
            return None
        if job.kind == "compare":  # what `compare --jsonl` writes, when the comparison is done
            from llmtrace.trace.comparison import jsonl_events

            doc = compare_in_thread(job, alive)
            for ev in jsonl_events(doc):
                sink(ev)
            return {"compare": doc}
        if job.kind == "generate":
            trace = generate_kept(job, history, sink)
        else:
            run = model.explain_with if job.kind == "explain" else model.lens_with
            trace = run(job.prompt, job.options)
            for ev in trace.events:
                sink(ev)
        return {"events": trace.events, "tokenizer": model.tokenizer}


def generate_kept(job: Job, history: History, sink: Callable[[dict], None]):
    """generate, its sampler keeping each step's logits and draw for re-sampling (resample.KeepingSampler)."""
    from llmtrace.serve.resample import KeepingSampler, KeptRun

    prepared = job.served.model.prepare_generate(job.prompt, job.options)
    kept = KeptRun(model=job.served.name, config=prepared.sampler.config, show_top=prepared.trace.topk)
    history.kept.start(job.run_id, kept)
    prepared.sampler = KeepingSampler(prepared.sampler, history.kept, job.run_id)

    def keep_step(ev: dict) -> None:
        if ev.get("event") == "step":
            kept.events[ev["step"]] = ev

    return prepared.run(sinks=[sink, keep_step], keep_events=True)


def compare_in_thread(job: Job, alive: Callable[[], None]) -> dict:
    """The loaded model against itself under side B's settings (or against another model served here), on the
    Python API: the comparison's JSON object."""
    from llmtrace.api import compare
    from llmtrace.run.compare import Side

    options = {k: v for k, v in job.options.items() if k not in ("interventions", "b_model")}
    side_b = Side(loaded=(job.other or job.served).model.loaded, interventions=tuple(job.options["interventions"]))
    return compare(job.served.model, side_b, job.prompt, progress=lambda _message: alive(), **options).to_json()


def line(ev: dict) -> str:
    """An event as one line of the stream: the same text a --jsonl file holds."""
    line = getattr(ev, "line", None)  # a tensor event's, as bytes (trace.recorder.TensorEvent)
    return (line.decode() if line is not None else dumps(ev)) + "\n"


def error_body(e: Exception) -> dict:
    """The one line the CLI prints, without its "error: ", as a JSON error body: the message, never the Python class
    (a library's exception that no check foresaw is its text on one line, as the CLI quotes one)."""
    return {"error": str(e) if isinstance(e, (BadValue, UsageError, LlmtraceError)) else one_line(e)}


def queue_line(position: int) -> str:
    """A line of the stream that is not a trace event: the run waits behind `position` others (0: it starts)."""
    return dumps({"event": "queue", "position": position}) + "\n"


async def stream(job: Job, limits: Limits, history: History):
    """The run's lines as they are made: its place in the queue while it waits, then every event. Runs in a worker
    thread; when the client goes away (the generator is closed), the run stops at its next event."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()
    served = job.served

    def alive() -> None:
        if cancelled.is_set():
            raise Cancelled()

    def sink(ev: dict) -> None:
        alive()
        loop.call_soon_threadsafe(queue.put_nowait, line(ev))

    def work() -> None:
        try:
            page = run_in_thread(job, history, sink, alive)
            if page is not None:  # a patch sweep has no page
                history.keep(job.run_id, page)
        except Cancelled:
            history.forget(job.run_id)
        except Exception as e:  # one error line, as JSON, and the server lives on
            history.forget(job.run_id)
            loop.call_soon_threadsafe(queue.put_nowait, dumps({"event": "error", **error_body(e)}) + "\n")
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    served.waiting += 1
    waiting = True
    try:
        ahead = served.active + served.waiting - 1 - (limits.concurrent_per_model - 1)
        if ahead > 0:  # told once: its place in the queue
            yield queue_line(ahead)
        async with served.slots:
            served.waiting -= 1
            waiting = False
            served.active += 1
            try:
                yield dumps({"event": "run_id", "id": job.run_id}) + "\n"
                task = loop.run_in_executor(None, work)
                try:
                    while (item := await queue.get()) is not None:
                        yield item
                finally:
                    cancelled.set()
                    await asyncio.shield(task)
            finally:
                served.active -= 1
    finally:
        if waiting:
            served.waiting -= 1
