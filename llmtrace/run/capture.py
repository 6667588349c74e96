"""Activations over a corpus (`llmtrace capture`, `llmtrace.capture`): the full tensors of a few points at every token
of a text, written as safetensors shards for training sparse autoencoders, probes or lenses; `read_capture` reads them
back as one (tokens, width) tensor per point.

The text is tokenized once and cut into chunks of `ctx` tokens as `llmtrace eval` cuts it (run.eval_score: BOS
first where the tokenizer adds one). A shard holds `shard_chunks` consecutive chunks; `batch` chunks run as the rows
of one pass. Each pass is the model's own forward with one hook on the asked points only (the layers that report
nothing are not hooked, attention keeps its fused kernel, nothing is recorded), and it stops after the last layer a
point is asked from when no point after the layers is asked.

A directory holds `manifest.json` (the plan: the text's hash, the model, the points with their axes and widths, ctx,
dtype, the shards) and `shard-00000.safetensors`, …, each holding, for its tokens in order, one (tokens, width)
tensor per point (the point's axes after B and T flattened), `ids` (the token ids), `positions` (each token's
position in its chunk) and `chunks` (its chunk's number). A shard is written whole or not at all (a temporary file
renamed), so a run cut short leaves finished shards only; `resume=True` checks the plan is the same and writes the
missing shards, which come out byte for byte as an uninterrupted run's (the same passes over the same chunks).
`workers` local processes (or Ray actors, `ray=`) each load the model once and write the shards they are handed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from llmtrace.errors import BadValue, LlmtraceError, UsageError

FORMAT = "llmtrace.capture/1"
MANIFEST = "manifest.json"
DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
SAME_ON_RESUME = ("format", "text_sha256", "n_text_tokens", "ctx", "bos", "dtype", "points", "chunks",
                  "shard_chunks", "batch", "model")


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


@dataclass
class CaptureResult:
    """What a capture wrote: its directory, the shards written by this run and those already there (resumed), the
    tokens captured, the seconds, and whether it stopped before the end (`stop_after`, Ctrl-C)."""

    directory: Path
    manifest: dict
    written: list[int]
    skipped: list[int]
    tokens: int
    seconds: float
    interrupted: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# ----------------------------------------------------------------------------------------------------------------
# the plan


def plan(lm, text: str, points: Union[str, list[str]], ctx: int, dtype: str = "float16", chunks: Optional[int] = None,
         shard_chunks: int = 16, batch: int = 1) -> tuple[dict, list[int]]:
    """(the manifest of this capture, the text's ids): every value checked before a pass runs."""
    from llmtrace.run.eval_score import Chunking, chunk_count, encode_text, text_sha256
    from llmtrace.run.hookpoints import select
    from llmtrace.run.research import points_of

    if dtype not in DTYPES:
        raise BadValue("dtype", f" {dtype!r} is not one of {', '.join(DTYPES)}")
    for name, value in (("ctx", ctx), ("shard_chunks", shard_chunks), ("batch", batch)):
        if value < 1:
            raise BadValue(name, f" must be ≥ 1, not {value}")
    if chunks is not None and chunks < 1:
        raise BadValue("chunks", f" must be ≥ 1, not {chunks}")
    names = [n.strip() for n in points.split(",")] if isinstance(points, str) else list(points)
    if not names or any(not n for n in names):
        raise BadValue("points", " is empty; name the points to keep, e.g. 6.resid_post (model.points() lists them)")
    table = points_of(lm)
    wanted = select(table, names, None, lm.config.n_layers, field="points")
    dims = lm.config.dims()
    out_points = {}
    for p in wanted:
        if p.axes[:2] != ("B", "T") or "S" in p.axes or p.point == "last":
            raise BadValue("points", f" {p.name!r} has axes ({', '.join(p.axes)}): a capture keeps one vector per "
                                     f"token (B, T, ...), not a point over key slots or states")
        width = 1
        for a in p.axes[2:]:
            width *= dims[a]
        out_points[p.name] = {"layer": p.layer, "point": p.point, "where": p.where, "axes": list(p.axes),
                              "width": width}
    ids = encode_text(lm.tokenizer, text, ctx, lm.config.max_seq_len)
    chunking = Chunking(ctx, lm.tokenizer.bos_id if lm.tokenizer.add_bos else None)
    n = chunk_count(len(ids), ctx, chunks)
    shards = [[s, min(s + shard_chunks, n)] for s in range(0, n, shard_chunks)]
    manifest = {"format": FORMAT, "model": lm.name, "text_sha256": text_sha256(text), "n_text_tokens": len(ids),
                "ctx": ctx, "bos": chunking.bos, "dtype": dtype, "points": out_points, "chunks": n,
                "shard_chunks": shard_chunks, "batch": batch, "tokens": n * ctx,
                "shards": [{"file": shard_name(i), "chunks": c} for i, c in enumerate(shards)]}
    return manifest, ids


def _check_directory(out: Path, manifest: dict, resume: bool) -> list[int]:
    """The shards already written (resume), after checking the directory may be written."""
    out = Path(out)
    have = out / MANIFEST
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} is a file; -o names a directory for the shards")
    if not resume:
        if out.exists() and any(out.iterdir()):
            what = "a capture (resume=True goes on with it)" if have.exists() else "other files"
            raise UsageError(f"{out} already holds {what}; give an empty or new directory")
        return []
    if not have.exists():
        raise UsageError(f"resume: {out} holds no capture ({MANIFEST} is missing)")
    old = json.loads(have.read_text(encoding="utf-8"))
    for key in SAME_ON_RESUME:
        if old.get(key) != manifest.get(key):
            raise UsageError(f"resume: the capture in {out} was made with another {key} "
                             f"({_short(old.get(key))} there, {_short(manifest.get(key))} now)")
    return [i for i, s in enumerate(manifest["shards"]) if (out / s["file"]).exists()]


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 40 else s[:37] + "..."


# ----------------------------------------------------------------------------------------------------------------
# the passes


def shard_tensors(lm, manifest: dict, ids: list[int], shard: int) -> dict[str, torch.Tensor]:
    """The tensors of one shard (see the module's docstring), computed with the model's hook on the asked points."""
    from llmtrace.run.eval_score import Chunking

    model = lm.model
    chunking = Chunking(manifest["ctx"], manifest["bos"])
    first, end = manifest["shards"][shard]["chunks"]
    points = manifest["points"]
    dtype = DTYPES[manifest["dtype"]]
    wanted = {(p["layer"], p["point"]): name for name, p in points.items()}
    layers = sorted({p["layer"] for p in points.values() if p["layer"] is not None})
    after_layers = {p.name for p in model.declared_points().after}
    after = any(p["layer"] is None and p["point"] in after_layers for p in points.values())
    attention = sorted({p["layer"] for p in points.values() if p["where"] == "attn"})
    last = None if after or not layers else layers[-1]
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in points}

    def keep(layer, name, x):
        key = wanted.get((layer, name))
        if key is not None:
            kept[key].append(x.detach().reshape(x.size(0) * x.size(1), -1).to("cpu", dtype))

    chunk_ids = list(range(first, end))
    device = lm.device
    with torch.no_grad(), model.hooked(keep, layers, attention=attention, spell_out=False):
        for b in range(0, len(chunk_ids), manifest["batch"]):
            rows = [chunking.ids(ids, i) for i in chunk_ids[b:b + manifest["batch"]]]
            idx = torch.tensor(rows, dtype=torch.long, device=device)  # (B, ctx)
            run_pass(model, idx, last)
    ctx = manifest["ctx"]
    out = {name: torch.cat(v).contiguous() for name, v in kept.items()}
    out["ids"] = torch.tensor([t for i in chunk_ids for t in chunking.ids(ids, i)], dtype=torch.long)
    out["positions"] = torch.arange(ctx, dtype=torch.long).repeat(len(chunk_ids))
    out["chunks"] = torch.tensor(chunk_ids, dtype=torch.long).repeat_interleave(ctx)
    return out


def run_pass(model, idx: torch.Tensor, last_layer: Optional[int]) -> None:
    """The model's forward over idx (B, T) from slot 0 without a cache; with `last_layer`, only up to that layer (what
    comes after reports nothing a capture asked for)."""
    if last_layer is None:
        model(idx)
        return
    x = model.embed_tokens(idx)
    inputs = model.layer_inputs(idx, None, 0, dtype=x.dtype)
    model.run_layers(x, inputs, range(last_layer + 1))


def write_shard(lm, manifest: dict, ids: list[int], shard: int, out: Path) -> int:
    """Compute shard `shard` and write it whole (a temporary file renamed); the tokens it holds."""
    from safetensors.torch import save

    from llmtrace.fsutil import atomic_path

    tensors = shard_tensors(lm, manifest, ids, shard)
    data = save(tensors, metadata={"format": FORMAT})  # one key: safetensors writes a map in no fixed order
    with atomic_path(Path(out) / manifest["shards"][shard]["file"]) as tmp:
        tmp.write_bytes(data)
    return int(tensors["ids"].numel())


# ----------------------------------------------------------------------------------------------------------------
# the run


def capture_corpus(model, text: str, points: Union[str, list[str]], ctx: int, out: Union[str, Path],
                   dtype: str = "float16", chunks: Optional[int] = None, shard_chunks: int = 16, batch: int = 1,
                   resume: bool = False, workers: int = 1, ray: Optional[str] = None, threads: Optional[int] = None,
                   stop_after: Optional[int] = None,
                   on_shard: Optional[Callable[[int, int, int], None]] = None) -> CaptureResult:
    """Capture `points` over `text` into the directory `out` (see the module's docstring). `model`: a loaded model
    (llmtrace.Model or LoadedModel); with `workers` > 1 or `ray`, each process loads it again from its path.
    `stop_after`: write that many shards, then stop as an interruption would (resume goes on). `on_shard(done,
    total, tokens)` after each shard."""
    lm = getattr(model, "loaded", model)
    if workers < 1:
        raise BadValue("workers", f" must be ≥ 1, not {workers}")
    manifest, ids = plan(lm, text, points, ctx, dtype, chunks, shard_chunks, batch)
    out = Path(out)
    done = _check_directory(out, manifest, resume)
    out.mkdir(parents=True, exist_ok=True)
    from llmtrace.fsutil import write_text_atomic

    write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    todo = [i for i in range(len(manifest["shards"])) if i not in done]
    if stop_after is not None:
        todo = todo[:stop_after]
    t0 = time.perf_counter()
    written, tokens = [], 0
    interrupted = stop_after is not None and len(todo) < len(manifest["shards"]) - len(done)
    try:
        for shard, n in _run(lm, manifest, ids, todo, out, workers, ray, threads):
            written.append(shard)
            tokens += n
            if on_shard is not None:
                on_shard(len(done) + len(written), len(manifest["shards"]), tokens)
    except KeyboardInterrupt:
        interrupted = True
    return CaptureResult(out, manifest, written, done, tokens, time.perf_counter() - t0, interrupted)


def _run(lm, manifest, ids, todo, out, workers, ray, threads):
    if not todo:
        return
    if ray is not None:
        yield from _on_ray(lm, manifest, ids, todo, out, workers, ray, threads)
    elif workers > 1:
        yield from _on_processes(lm, manifest, ids, todo, out, workers, threads)
    else:
        for shard in todo:
            yield shard, write_shard(lm, manifest, ids, shard, out)


def portable(lm) -> dict:
    """How another process loads the same model: its file or directory, device, dtype, GGUF blocks kept or not."""
    return {"spec": str(lm.path), "device": str(lm.device), "dtype": str(lm.dtype).replace("torch.", ""),
            "keep_quantized": bool(lm.config.extra.get("keep_quantized"))}


_WORKER: dict = {}


def _init_worker(spec: dict, manifest: dict, ids: list[int], out: str, threads: Optional[int]) -> None:
    from llmtrace.checkpoint.load import load_model

    if threads:
        torch.set_num_threads(threads)
    _WORKER.update(lm=load_model(spec["spec"], device=spec["device"], dtype=spec["dtype"],
                                 keep_quantized=spec["keep_quantized"]), manifest=manifest, ids=ids, out=out)


def _worker_shard(shard: int) -> tuple[int, int]:
    w = _WORKER
    return shard, write_shard(w["lm"], w["manifest"], w["ids"], shard, Path(w["out"]))


def _on_processes(lm, manifest, ids, todo, out, workers, threads):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker, initargs=(portable(lm), manifest, ids, str(out), threads))
    try:
        futures = [ex.submit(_worker_shard, s) for s in todo]
        for f in as_completed(futures):
            yield f.result()
        ex.shutdown(wait=True)
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        raise


class CaptureActor:
    """A Ray actor: loads the model once, then writes the shards it is sent (to a directory every node sees)."""

    def __init__(self, spec: dict, manifest: dict, ids: list[int], out: str, threads: Optional[int]):
        _init_worker(spec, manifest, ids, out, threads)

    def shard(self, shard: int) -> tuple[int, int]:
        return _worker_shard(shard)


def _on_ray(lm, manifest, ids, todo, out, workers, address, threads):
    from llmtrace.run.ray_cluster import start_ray

    ray = start_ray(address)
    from ray.util import ActorPool

    actor = ray.remote(num_cpus=threads or 1)(CaptureActor)
    actors = [actor.remote(portable(lm), manifest, ids, str(out), threads) for _ in range(workers)]
    try:
        yield from ActorPool(actors).map_unordered(lambda a, s: a.shard.remote(s), todo)
    finally:
        for a in actors:
            ray.kill(a)


# ----------------------------------------------------------------------------------------------------------------
# reading


def read_capture(directory: Union[str, Path], points: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
    """A capture's tensors: {point: (tokens, width)} for each point (or those named), with "ids", "positions" and
    "chunks" (tokens,), every shard's rows in chunk order. An unfinished capture is an error that says --resume."""
    from safetensors.torch import load_file

    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        raise LlmtraceError(f"{directory} holds no capture ({MANIFEST} is missing)")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT:
        raise LlmtraceError(f"{path} is not a {FORMAT} manifest")
    missing = [s["file"] for s in manifest["shards"] if not (directory / s["file"]).exists()]
    if missing:
        raise LlmtraceError(f"the capture in {directory} is unfinished: {len(missing)} of {len(manifest['shards'])} "
                            f"shards are missing (a capture resumed writes them)")
    names = list(manifest["points"]) if points is None else list(points)
    unknown = [n for n in names if n not in manifest["points"]]
    if unknown:
        raise BadValue("points", f" {unknown[0]!r} is not in this capture; it holds {', '.join(manifest['points'])}")
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in names + ["ids", "positions", "chunks"]}
    for s in manifest["shards"]:
        shard = load_file(str(directory / s["file"]))
        for n in parts:
            parts[n].append(shard[n])
    return {n: torch.cat(v) if v else torch.empty(0) for n, v in parts.items()}
