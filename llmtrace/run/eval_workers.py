"""Where the chunks of `llmtrace eval` run: this process, N local processes, or Ray actors on a cluster.

A `Job` is what every scorer needs: the sides (run.compare.Side specs, loaded where the chunks run), the token ids,
the chunking, and the options. `run_job` hands out groups of chunks (the chunks i with the same i // batch, so that
a chunk shares its pass with the same neighbours wherever it runs) and yields the chunk records in chunk order.

Local processes start by `spawn` (concurrent.futures); each loads the models once. Ray actors do the same on the
nodes of a cluster (run/ray_cluster.py; "local" starts one on this machine, on loopback): each actor loads the models
once, from the spec it is given (a registry name each node pulls, or a path that exists on each node), and scores the
groups Ray's ActorPool sends it. The driver merges the records by chunk number: the figures are the same as one process's,
given the same torch thread count per scorer (a matrix product's sums may be split by threads).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

from llmtrace.errors import BadValue, UsageError
from llmtrace.run.compare import Side, check_comparable, check_ids, read_config
from llmtrace.run.eval_score import Chunking, Scorer
from llmtrace.run.ray_cluster import start_ray


def as_side(x) -> tuple[Side, Any]:
    """(Side, its loaded model or None) for a spec, a Side or a loaded model."""
    if x is None or isinstance(x, str):
        return Side(model=x), None
    if isinstance(x, Side):
        return x, x.loaded
    return Side(loaded=x), x


@dataclass
class Job:
    """Everything the scorers need; `portable()` is what crosses to another process (specs, not models)."""

    side_a: Optional[Side]  # None: side A is a base file
    side_b: Optional[Side]
    tokens: list[int]
    chunking: Chunking
    n_chunks: int
    batch: int
    layers: bool
    tolerance: float
    top_k: Optional[int]  # a top-K base file's K (written or read); None: exact, or no base file
    keep: Optional[int]  # save_base: keep A's whole rows (0) or its top K (K); None: nothing
    threads: Optional[int]
    facts: dict = field(default_factory=dict)  # each side's header record
    base: Any = None  # eval_base.BaseFile
    tok: Any = None
    loaded: dict = field(default_factory=dict)  # "a", "b": loaded models, in the process that scores

    @classmethod
    def build(cls, model, b, base, ctx, chunks, batch, save_base, base_top_k, layers, tolerance, threads, ids_from,
              text, say: Callable[[str], None]) -> "Job":
        """The job of one evaluation: the sides named, the text's ids checked against both tokenizers and the base
        file, before a weight is read where no process of this machine scores."""
        from llmtrace.run.eval_score import chunk_count, encode_text

        if base is not None:
            side_a, lm_a, (side_b, lm_b) = None, None, as_side(model)
        else:
            (side_a, lm_a), (side_b, lm_b) = as_side(model), (as_side(b) if b is not None else (None, None))
        if side_b is not None and side_b.interventions and side_a is not None and side_a.interventions:
            raise UsageError("eval applies interventions to side B only: side A is the reference")
        tok, cfg = _tokenizer_and_config(side_b if side_a is None else side_a, lm_b if side_a is None else lm_a)
        ids = encode_text(tok, text, ctx, cfg.max_seq_len)
        if side_a is not None and side_b is not None:
            tok_b, cfg_b = _tokenizer_and_config(side_b, lm_b)
            check_comparable(cfg, cfg_b)
            ids = check_ids(tok, tok_b, ids, tok_b.encode(text, parse_special=False), ids_from)
            if ctx > cfg_b.max_seq_len:
                raise BadValue("ctx", f" {ctx} exceeds side B's context window of {cfg_b.max_seq_len} tokens")
        chunking = Chunking(ctx, tok.bos_id if tok.add_bos else None)
        keep = None if save_base is None else (base_top_k or 0)
        job = cls(side_a, side_b, ids, chunking, chunk_count(len(ids), ctx, chunks), batch, layers, tolerance,
                  base_top_k if save_base is not None else None, keep, threads, tok=tok)
        job.loaded = {k: v for k, v in (("a", lm_a), ("b", lm_b)) if v is not None}
        job.facts = {"a": _facts(side_a, lm_a) if side_a is not None else {},
                     "b": _facts(side_b, lm_b) if side_b is not None else None}
        if base is not None:
            job.open_base(base, text)
        return job

    def open_base(self, path, text: str) -> None:
        from llmtrace.run.eval_score import text_sha256
        from llmtrace.run.eval_base import open_base, tokenizer_hash

        self.base = open_base(path)
        self.base.check(self.facts["b"], tokenizer_hash(self.tok), text_sha256(text),
                        self.chunking.ctx, self.n_chunks)
        if self.base.tokens[:self.n_chunks * self.chunking.ctx] != self.tokens[:self.n_chunks * self.chunking.ctx]:
            raise UsageError(f"{path}: its token ids differ from this tokenizer's ids of the text")
        self.facts["a"] = dict(self.base.header["model"]) | {"base": str(path)}
        self.top_k = self.base.top_k

    def header(self, text: str) -> dict:
        """The `eval` event."""
        from llmtrace.run.eval_score import EVAL_SCHEMA, text_sha256

        c = self.chunking
        return {"event": "eval", "schema": EVAL_SCHEMA, "a": self.facts["a"], "b": self.facts["b"],
                "base": self.facts["a"].get("base"), "text_sha256": text_sha256(text), "n_tokens": len(self.tokens),
                "ctx": c.ctx, "first_scored": c.first, "scored_per_chunk": c.scored, "bos": c.bos,
                "chunks": self.n_chunks, "batch": self.batch, "layers": self.layers, "tolerance": self.tolerance,
                "top_k": self.top_k, "base_form": self.base_form()}

    def base_form(self) -> Optional[str]:
        """The form of the base file written or read ("exact" or "top_k"), None without one."""
        if self.base is not None:
            return self.base.form
        return None if self.keep is None else "top_k" if self.keep else "exact"

    def portable(self) -> "Job":
        """This job without its loaded models and base file: what a worker process receives."""
        for side in (self.side_a, self.side_b):
            if side is not None and side.loaded is not None:
                raise UsageError("workers load the model themselves: give a model spec, not a loaded model")
        return replace(self, loaded={}, base=None, tok=None)

    def scorer(self) -> Scorer:
        """The scorer of this process, the models loaded on first use."""
        if not self.loaded:
            from llmtrace.checkpoint.devices import set_threads

            if self.threads is not None:
                set_threads(self.threads)
        for key, side in (("a", self.side_a), ("b", self.side_b)):
            if side is not None and key not in self.loaded:
                self.loaded[key] = side.load()
        lm_a, lm_b = self.loaded.get("a"), self.loaded.get("b")
        edits = None
        if self.side_b is not None and self.side_b.interventions:
            from llmtrace.run.interventions import prepare

            edits = prepare(lm_b, list(self.side_b.interventions), [self.chunking.ctx])
        return Scorer(lm_a=lm_a, lm_b=lm_b, edits_b=edits, layers=self.layers, tolerance=self.tolerance,
                      keep=self.keep)

    def base_rows(self, group: list[int]) -> Optional[list]:
        return [self.base.rows(i, self.chunking.scored) for i in group] if self.base is not None else None


def _tokenizer_and_config(side: Side, lm):
    if lm is not None:
        return lm.tokenizer, lm.config
    from llmtrace.checkpoint.tokenizer_only import load_tokenizer

    return load_tokenizer(side.model), read_config(side.model)


def _facts(side: Optional[Side], lm) -> dict:
    """A side's header record: the model, its shape, how it runs."""
    from llmtrace.registry.models_toml import default_model

    if lm is not None:
        c, name = lm.config, lm.name
        from llmtrace.trace.records import dtype_name

        dtype = dtype_name(lm.dtype)
    else:
        c, name = read_config(side.model), side.model or default_model()
        from llmtrace.checkpoint.devices import pick_device, pick_dtype
        from llmtrace.trace.records import dtype_name

        dtype = "bfloat16" if side.fast else dtype_name(pick_dtype(side.dtype, pick_device(side.device)))
    rec = {"model": name, "arch": c.arch, "n_layers": c.n_layers, "d_model": c.d_model, "vocab_size": c.vocab_size,
           "dtype": dtype}
    if side is not None and side.fast:
        rec["fast"] = True
    if side is not None and side.keep_quantized:
        rec["keep_quantized"] = True
    if side is not None and side.interventions:
        from llmtrace.run.interventions import record

        rec["interventions"] = [record(iv) for iv in side.interventions]
    return rec


# ----------------------------------------------------------------------------------------------------------------
# running the groups


def groups_of(todo: list[int], batch: int) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for i in todo:
        out.setdefault(i // batch, []).append(i)
    return list(out.values())


def run_job(job: Job, todo: list[int], workers: int, ray: Optional[str], say,
            on_step: Optional[Callable[[list[int], int, int], None]] = None) -> Iterator[dict]:
    """The chunk records of chunks `todo`, in chunk order, each as soon as it is scored. `on_step(group, done,
    total)` hears a batch move within its pass (this process only: workers report whole groups)."""
    groups = groups_of(todo, job.batch)
    if not groups:
        return
    if ray is not None:
        yield from _on_ray(job, groups, workers, ray, say)
    elif workers > 1:
        yield from _on_processes(job, groups, workers, say)
    else:
        if any(side is not None and side.loaded is None for side in (job.side_a, job.side_b)):
            say("loading the model" + ("s" if job.side_a is not None and job.side_b is not None else ""))
        scorer = job.scorer()
        for g in groups:
            step = (lambda d, t, g=g: on_step(g, d, t)) if on_step is not None else None
            yield from scorer.scored(job.tokens, job.chunking, g, job.base_rows(g), step)


_WORKER: dict = {}  # a worker process's job and scorer


def _init_worker(job: Job) -> None:
    _WORKER["job"] = job
    _WORKER["scorer"] = job.scorer()


def _score_group(group: list[int], base_rows) -> list[dict]:
    job = _WORKER["job"]
    return _WORKER["scorer"].score(job.tokens, job.chunking, group, base_rows)


def _on_processes(job: Job, groups: list[list[int]], workers: int, say) -> Iterator[dict]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    portable = job.portable()
    say(f"starting {workers} worker processes (each loads the model once)")
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker, initargs=(portable,))
    try:
        futures = [ex.submit(_score_group, g, job.base_rows(g)) for g in groups]
        for f in futures:
            yield from f.result()
        ex.shutdown(wait=True)
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        raise


class EvalActor:
    """A Ray actor: loads the models once, then scores the groups it is sent."""

    def __init__(self, job: Job):
        self.job = job
        self.scorer = job.scorer()

    def score(self, group: list[int], base_rows) -> list[dict]:
        return self.scorer.score(self.job.tokens, self.job.chunking, group, base_rows)


def _on_ray(job: Job, groups: list[list[int]], workers: int, address: str, say) -> Iterator[dict]:
    ray = start_ray(address)
    from ray.util import ActorPool

    portable = job.portable()
    threads = job.threads or 1
    actor = ray.remote(num_cpus=threads)(EvalActor)
    say(f"starting {workers} Ray actors (each loads the model once)")
    actors = [actor.remote(portable) for _ in range(workers)]
    pool = ActorPool(actors)
    try:
        for records in pool.map(lambda a, g: a.score.remote(g, job.base_rows(g)), groups):
            yield from records
    finally:
        for a in actors:
            ray.kill(a)
