"""Evaluating over a corpus (`llmtrace eval`): perplexity, and with two sides llama.cpp's KL-divergence statistics,
over a whole text.

    evaluate(model, text, ctx=512)                    -> EvalResult   one side: PPL ± its uncertainty
    evaluate(a, text, b=Side(...))                    -> EvalResult   A the base, B under test: KLD, Δp, same top, …
    evaluate(a, text, save_base="base.safetensors")   then  evaluate(b, text, base="base.safetensors")
    evaluate(a, text, save_base="base.safetensors", base_top_k=64)     a smaller base; its KLD a lower bound

The text is tokenized once (BOS first where the tokenizer adds one) and cut into chunks of `ctx` tokens, the way
llama.cpp's llama-perplexity cuts it (eval_score.py says which positions are scored); `chunks` stops early. Chunks
run `batch` at a time, as the rows of one pass, on this process, on `workers` local processes, or on Ray actors
(eval_workers.py). Each chunk gives a record of sums and per-position values; the summary adds them in chunk order
(eval_stats.py), so an interrupted run resumed (`resume=`), or one split over processes, ends on the same figures.

Events (trace.schema.json): `eval` (what is evaluated, how), one `chunk` per chunk, `eval_summary` at the end (also
after an interruption, with `interrupted: true`; a resumed run drops it and goes on).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from llmtrace.errors import BadValue, LlmtraceError, UsageError
from llmtrace.run.eval_score import DEFAULT_TOLERANCE
from llmtrace.run.eval_stats import running_line, summarize_layers, summarize_one, summarize_two

DEFAULT_CTX = 512
DEFAULT_BATCH_TOKENS = 2048  # llama-perplexity's default -b: that many tokens' chunks per pass
# what a resumed run must share with the run it continues
SAME_ON_RESUME = ("text_sha256", "ctx", "chunks", "batch", "layers", "tolerance", "base", "top_k")


@dataclass
class Progress:
    """Where a run is, for a listener: `done` chunks finished of `total` (a resumed run's earlier chunks counted),
    `position` the same with the batch in flight counted in part (a step per layer of its pass, one per chunk
    scored), the rate of this run in scored tokens per second and the time left, both measured (Counter; None until
    there is something to measure), and the running figures over every chunk so far (eval_stats.running_line; None
    until the first chunk)."""

    done: int
    total: int
    position: float
    tokens_per_s: Optional[float]
    eta_s: Optional[float]
    running: Optional[dict]


@dataclass
class EvalResult:
    """What one evaluation found: the header (`eval` event), the chunk records in chunk order, the summary."""

    header: dict
    chunks: list[dict]
    summary: dict
    interrupted: bool = False
    base_written: Optional[str] = None  # save_base: the file written
    notes: list[str] = field(default_factory=list)

    def to_jsonl_events(self) -> list[dict]:
        return [self.header] + self.chunks + [self.summary]

    def to_json(self) -> dict:
        """One document: the header's fields, `chunks` and `summary`."""
        return {k: v for k, v in self.header.items() if k != "event"} | {"chunks": [
            {k: v for k, v in c.items() if k != "event"} for c in self.chunks], "summary": {
                k: v for k, v in self.summary.items() if k != "event"}}


# ----------------------------------------------------------------------------------------------------------------
# the text


def check_settings(ctx: int, chunks: Optional[int], batch: Optional[int], base_top_k: Optional[int],
                   workers: int) -> None:
    """The values that need no model, before anything is read."""
    if ctx < 4:
        raise BadValue("ctx", f" must be ≥ 4 (half of each chunk is scored), not {ctx}")
    if chunks is not None and chunks < 1:
        raise BadValue("chunks", f" must be ≥ 1, not {chunks}")
    if batch is not None and batch < 1:
        raise BadValue("batch", f" must be ≥ 1, not {batch}")
    if base_top_k is not None and base_top_k < 1:
        raise BadValue("base_top_k", f" must be ≥ 1, not {base_top_k}")
    if workers < 1:
        raise BadValue("workers", f" must be ≥ 1, not {workers}")


# ----------------------------------------------------------------------------------------------------------------
# the run


def evaluate(model, text: str, *, b=None, base: Union[str, Path, None] = None, ctx: int = DEFAULT_CTX,
             chunks: Optional[int] = None, batch: Optional[int] = None, save_base: Union[str, Path, None] = None,
             base_top_k: Optional[int] = None, layers: bool = False, tolerance: float = DEFAULT_TOLERANCE,
             workers: int = 1, ray: Optional[str] = None, threads: Optional[int] = None,
             resume: Optional[list[dict]] = None, ids_from: Optional[str] = None,
             on_start: Optional[Callable[[dict, list[dict]], None]] = None,
             on_chunk: Optional[Callable[[dict, Progress], None]] = None,
             on_progress: Optional[Callable[[Progress], None]] = None,
             say: Optional[Callable[[str], None]] = None) -> EvalResult:
    """Score `text` in chunks of `ctx` tokens, as llama.cpp's llama-perplexity does.

    `model`: side A (a spec, a run.compare.Side, or a loaded model). `b`: side B, for the two-sided statistics (A is
    the base, B the model under test). `base`: a base file written by `save_base=`; `model` is then the model under
    test (side B) and A's figures come from the file. `chunks`: at most this many. `batch`: chunks per pass (default:
    as llama-perplexity's default batch of 2,048 tokens holds them, 2048 // ctx, at least 1).
    `save_base`: write A's log-probabilities per scored position to this file: each whole row as 16 bits (exact),
    or with `base_top_k` K only its top K and the rest's mass (a KLD that is a lower bound; eval_base.py). `layers`
    (two sides): where the error enters, layer by layer (compare's relative error; `tolerance` marks a divergence);
    MoE routing. `workers` > 1: that many local processes; `ray`: a Ray address ("local" for a cluster of this
    machine), `workers` actors. `threads`: torch threads of each worker. `resume`: the events of an interrupted run
    (its file's lines): its chunks are kept, the rest are scored. `on_start(header, chunks kept from resume)` hears
    the `eval` event before the first chunk; `on_chunk(record, Progress)` hears each chunk in chunk order, as soon as
    it is scored; `on_progress(Progress)` hears every move (each layer of a pass, each chunk); `say(message)` what is
    happening. Ctrl-C (KeyboardInterrupt) ends the run early: the result holds the chunks done, and `interrupted` is
    True."""
    from llmtrace.run.eval_workers import Job, run_job
    from llmtrace.run.ray_cluster import require_ray

    check_settings(ctx, chunks, batch, base_top_k, workers)
    if ray is not None:
        require_ray()  # before anything is read
    if base is not None and b is not None:
        raise UsageError("give side B or a base file, not both: with a base file, the model is the one under test")
    if resume and save_base is not None:
        raise BadValue("save_base", " needs every chunk's log-probabilities: run it whole, not resumed")
    if base_top_k is not None and save_base is None:
        raise BadValue("base_top_k", " is the form of a base file written: give save_base too", also=("save_base",))
    if layers and b is None:
        raise BadValue("layers", " compares two sides run here: give side B (a base file holds no layers)")
    say = say or (lambda _m: None)
    batch = batch if batch is not None else max(1, DEFAULT_BATCH_TOKENS // ctx)
    job = Job.build(model, b, base, ctx, chunks, batch, save_base, base_top_k, layers, tolerance, threads, ids_from,
                    text, say)
    header = job.header(text)
    done = check_resume(resume, header) if resume else []
    records = {c["chunk"]: c for c in done}
    todo = [i for i in range(header["chunks"]) if i not in records]
    if on_start is not None:
        on_start(header, [records[i] for i in sorted(records)])
    counter = Counter(header["chunks"], len(done), header["scored_per_chunk"])
    listen = on_progress or (lambda _p: None)

    def on_step(group: list[int], step: int, steps: int) -> None:
        listen(counter.moving(len(group) * step / steps, step == 0))

    interrupted = False
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(base_writer(job, save_base, header)) if save_base is not None else None
        try:
            for rec in run_job(job, todo, workers, ray, say, on_step):
                kept = rec.pop("_base", None)
                if writer is not None:
                    writer.add(rec["chunk"], kept)
                records[rec["chunk"]] = rec
                p = counter.finished([records[i] for i in sorted(records)])
                if on_chunk is not None:
                    on_chunk(rec, p)
                listen(p)
        except KeyboardInterrupt:
            interrupted = True
        chunk_list = [records[i] for i in sorted(records)]
        result = EvalResult(header=header, chunks=chunk_list,
                            summary=summary_event(header, chunk_list, interrupted), interrupted=interrupted)
        if writer is not None and not interrupted:
            writer.finish()
            result.base_written = str(save_base)
    return result


class Counter:
    """Where a run is, and its rate and time left, measured. The clock starts when this run's first pass starts (its
    first step heard; where only whole chunks are heard, as from workers, when the first arrives), so that loading
    the models does not count. The rate is the work done since then (chunks, the batch in flight counted by its
    steps: a pass's layers and its chunks scored) in scored tokens, over the time it took; the time left, the work
    to go at that rate. `clock`: seconds (time.perf_counter; a test sets its own)."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, total: int, before: int, scored: int):
        self.total, self.scored = total, scored
        self.done = self.batch_from = before
        self.position = float(before)
        self.t0: Optional[float] = None
        self.p0 = 0.0
        self.running: Optional[dict] = None

    def moving(self, in_flight: float, starts: bool) -> Progress:
        """A step of the batch in flight: `in_flight` chunks of it, in part; `starts`: its pass starts."""
        now = self.clock()
        if self.t0 is None:
            self.t0, self.p0 = now, self.position
        if starts:
            self.batch_from = self.done
        return self._progress(now, self.batch_from + in_flight)

    def finished(self, ordered: list[dict]) -> Progress:
        """A chunk finished; `ordered` every chunk so far."""
        now = self.clock()
        self.done += 1
        if self.t0 is None:  # no step was heard: the first chunk's start is not known, so it does not count
            self.t0, self.p0 = now, float(self.done)
        self.running = running_line(ordered)
        return self._progress(now, float(self.done))

    def _progress(self, now: float, position: float) -> Progress:
        self.position = min(max(self.position, position), float(self.total))  # the batch's steps may run ahead
        rate = eta = None
        if now > self.t0 and self.position > self.p0:
            rate = (self.position - self.p0) * self.scored / (now - self.t0)
            eta = (self.total - self.position) * self.scored / rate
        return Progress(done=self.done, total=self.total, position=self.position, tokens_per_s=rate, eta_s=eta,
                        running=self.running)


def base_writer(job, path, header: dict):
    """The writer of the base file `path` (eval_base.BaseWriter), its header from the run's."""
    from llmtrace.run.eval_base import BaseWriter, tokenizer_hash

    facts = header["a"]
    base_header = {"model": {k: facts[k] for k in ("model", "arch", "n_layers", "d_model", "vocab_size")},
                   "tokenizer": tokenizer_hash(job.tok), "text_sha256": header["text_sha256"], "ctx": header["ctx"],
                   "chunks": header["chunks"], "form": header["base_form"], "top_k": header["top_k"],
                   "bos": job.chunking.bos}
    n = header["chunks"] * header["ctx"]
    return BaseWriter(path, base_header, job.tokens[:n], header["chunks"] * header["scored_per_chunk"],
                      facts["vocab_size"])


def summary_event(header: dict, chunks: list[dict], interrupted: bool) -> dict:
    """The `eval_summary` event: over every chunk done, in chunk order."""
    ev: dict[str, Any] = {"event": "eval_summary", "chunks": len(chunks)}
    if not chunks:
        return ev | {"tokens_scored": 0, "interrupted": interrupted}
    two = header["b"] is not None
    ev |= summarize_two(chunks) if two else summarize_one(chunks)
    lay = summarize_layers(chunks, header["a"]["n_layers"]) if header["layers"] else None
    if lay is not None:
        ev["layers"] = lay
    return ev | {"interrupted": interrupted}


def check_resume(events: list[dict], header: dict) -> list[dict]:
    """The chunks of an interrupted run's events, refusing a run of other settings; its summaries are dropped."""
    if not events or events[0].get("event") != "eval":
        raise UsageError("the file to resume is not an eval run's events (its first line is not an `eval` event)")
    old = events[0]
    for k in SAME_ON_RESUME:
        if old.get(k) != header.get(k):
            raise UsageError(f"the run to resume was made with {k} {old.get(k)!r}, this one with {header.get(k)!r}: "
                             f"resume it with the same settings")
    for side in ("a", "b"):
        was, now = old.get(side) or {}, header.get(side) or {}
        if (was.get("model"), was.get("dtype")) != (now.get("model"), now.get("dtype")):
            raise UsageError(f"the run to resume had side {side.upper()} {was.get('model')} ({was.get('dtype')}); "
                             f"this one {now.get('model')} ({now.get('dtype')})")
    chunks = [e for e in events if e.get("event") == "chunk"]
    return list({c["chunk"]: c for c in chunks}.values())


def read_events(path: Union[str, Path]) -> list[dict]:
    """The events of an eval JSONL file; a last line cut short (a killed run) is dropped."""
    from llmtrace.fsutil import read_user_file

    raw = read_user_file(Path(path), "the file to resume").decode("utf-8", "replace")
    out = []
    lines = raw.splitlines()
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if k == len(lines) - 1:
                break
            raise LlmtraceError(f"{path}: line {k + 1} is not JSON") from None
    return out
