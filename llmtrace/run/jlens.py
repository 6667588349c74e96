"""The Jacobian lens (`llmtrace lens --fit-jacobian`, `llmtrace lens --jacobian`): what layer l's residual stream
says, read through the average Jacobian from it to the last layer's (Anthropic, "Verbalizable Representations Form a
Global Workspace in Language Models", 2026).

    J_l = mean over a corpus's positions t of ∂h_L[t] / ∂h_l[t]        (D, D); h_l layer l's resid_post
    lens_l(h) = softmax(W_U · norm(J_l · h))                           the model's own head: final norm, LM head

J = I is the logit lens; J_{L-1} is I exactly (the last layer's output is h_L).

Fitting. A chunk of T tokens runs as T copies (a batch of T rows): in copy t the gradient may flow along position t
only (every layer's output at the other positions is detached, which changes no value). In a causal model h_L[t]
depends on h_l[t] through position t alone (a later position cannot reach back, an earlier one does not depend on
h_l[t]), so this keeps every path of ∂h_L[t]/∂h_l[t] and drops every other. One backward pass per output dimension i,
with the cotangent e_i at position t of copy t for every t, gives row i of Σ_t ∂h_L[t]/∂h_l[t] for every layer at once:
D backward passes a chunk. The sums are float64, added chunk by chunk in chunk order, so a fit split over workers
(each returning its chunks' sums) is the same as one process's, and a fit resumed from its state file (the sums, the
chunks done, written whole after each chunk) goes on where it stopped.

The file (format "llmtrace.jlens/1"): safetensors, `J.0` … `J.{L-1}` (D, D) float32, and one metadata key, "jlens",
a JSON object {format, model, ctx, chunks, text_sha256, layers, d_model, positions}. The reference package's file
(anthropics/jacobian-lens `jlens`, which TransformerLens reads and writes too) is read as well: a torch.save dict
{J: {layer: (D, D)}, n_prompts, source_layers, d_model[, metadata]} over layers 0 … L-2, read without unpickling
(checkpoint/torch_zip.py). Its estimator differs from this fit's: it sums ∂h_L[t']/∂h_l[t] over the targets t' ≥ t
(and skips each prompt's first 16 positions), where this fit keeps t' = t; the readout is the same formula.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from llmtrace.errors import BadValue, LlmtraceError, UsageError
from llmtrace.units import noun
from llmtrace.model.llama_points import RESID_POST, RESID_PRE

FORMAT = "llmtrace.jlens/1"


def chunk_jacobians(lm, ids: list[int]) -> torch.Tensor:
    """Σ over the chunk's positions t of ∂h_L[t]/∂h_l[t], for every layer l: (L, D, D) float64 (row i: output dim i)."""
    model = lm.model
    L, D = lm.config.n_layers, lm.config.d_model
    T = len(ids)
    device = model.embed.weight.device
    own = torch.eye(T, dtype=torch.bool, device=device)[:, :, None]  # (T copies, T, 1): copy t's own position
    outs: dict[int, torch.Tensor] = {}

    def hook(layer, name, x):
        if layer == 0 and name == RESID_PRE.name:  # the leaf the graph grows from (the weights stay frozen)
            return x.detach().requires_grad_(True)
        if name == RESID_POST.name:
            x = torch.where(own, x, x.detach())  # copy t: the gradient flows along position t only
            x.retain_grad()
            outs[layer] = x
            return x
        return None

    idx = torch.tensor([ids] * T, dtype=torch.long, device=device)  # (T, T): T copies of the chunk
    with torch.enable_grad(), model.hooked(hook, spell_out=False):
        model(idx)
    h_last = outs[L - 1]  # (T, T, D)
    out = torch.zeros(L, D, D, dtype=torch.float64)
    pick = torch.arange(T, device=device)
    for i in range(D):
        for x in outs.values():
            x.grad = None
        cot = torch.zeros_like(h_last)
        cot[pick, pick, i] = 1.0  # e_i at position t of copy t
        h_last.backward(cot, retain_graph=i < D - 1)
        for layer, x in outs.items():
            out[layer, i] = x.grad[pick, pick].double().sum(0).cpu()  # Σ_t ∂h_L[t, i]/∂h_l[t]
    return out


def _state_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def fit(model, text: str, ctx: int, out: Union[str, Path], chunks: Optional[int] = None, resume: bool = False,
        workers: int = 1, ray: Optional[str] = None, threads: Optional[int] = None, stop_after: Optional[int] = None,
        on_chunk: Optional[Callable[[int, int], None]] = None) -> dict:
    """Fit J_l over `text` cut into chunks of `ctx` tokens (as `llmtrace eval` cuts it) and write the lens file `out`.
    A state file beside it (`out`.partial) holds the sums after each chunk; `resume` goes on from it. `workers` local
    processes (or Ray actors on the cluster at `ray`: "local", "auto", "ray://host:10001") each fit some chunks and
    send back their sums. `stop_after` chunks: stop as an interruption would. Returns the file's metadata with `done`
    (chunks) and `interrupted`."""
    from safetensors.torch import load_file, save

    from llmtrace.fsutil import atomic_path
    from llmtrace.run.eval_score import Chunking, chunk_count, encode_text, text_sha256

    lm = getattr(model, "loaded", model)
    if ctx < 2:
        raise BadValue("ctx", f" must be ≥ 2, not {ctx}")
    if workers < 1:
        raise BadValue("workers", f" must be ≥ 1, not {workers}")
    out = Path(out)
    ids = encode_text(lm.tokenizer, text, ctx, lm.config.max_seq_len)
    chunking = Chunking(ctx, lm.tokenizer.bos_id if lm.tokenizer.add_bos else None)
    n = chunk_count(len(ids), ctx, chunks)
    meta = {"format": FORMAT, "model": lm.name, "ctx": ctx, "chunks": n, "text_sha256": text_sha256(text),
            "layers": lm.config.n_layers, "d_model": lm.config.d_model}
    state = _state_path(out)
    L, D = lm.config.n_layers, lm.config.d_model
    total, done = torch.zeros(L, D, D, dtype=torch.float64), 0
    if resume:
        if not state.exists():
            raise UsageError(f"resume: there is no interrupted fit of {out} ({state.name} is missing)")
        saved = load_file(str(state))
        old = json.loads(_metadata(state)["fit"])
        if {k: old.get(k) for k in meta} != meta:
            raise UsageError(f"resume: {state.name} is a fit with other settings (ctx, chunks, text or model)")
        total, done = saved["sum"], old["done"]
    elif out.exists() or state.exists():
        raise UsageError(f"{out if out.exists() else state} already exists; write the lens to another file (or resume "
                         f"an interrupted fit)")
    todo = list(range(done, n if stop_after is None else min(n, done + stop_after)))

    def save_state(k: int) -> None:
        with atomic_path(state) as tmp:
            tmp.write_bytes(save({"sum": total}, metadata={"fit": json.dumps(meta | {"done": k})}))

    for i, part in _sums(lm, ids, chunking, todo, workers, ray, threads):
        total += part
        done = i + 1
        save_state(done)
        if on_chunk is not None:
            on_chunk(done, n)
    if done < n:
        return meta | {"done": done, "interrupted": True}
    positions = n * ctx
    tensors = {f"J.{layer}": (total[layer] / positions).float().contiguous() for layer in range(L)}
    with atomic_path(out) as tmp:
        tmp.write_bytes(save(tensors, metadata={"jlens": json.dumps(meta | {"positions": positions})}))
    state.unlink(missing_ok=True)
    return meta | {"positions": positions, "done": n, "interrupted": False}


def _metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


def _sums(lm, ids, chunking, todo, workers, ray, threads):
    """(chunk, its (L, D, D) sum) in chunk order, from this process, `workers` processes or `workers` Ray actors."""
    if ray is not None and todo:
        yield from _on_ray(lm, ids, chunking, todo, workers, ray, threads)
        return
    if workers <= 1 or len(todo) <= 1:
        for i in todo:
            yield i, chunk_jacobians(lm, chunking.ids(ids, i))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from llmtrace.run.capture import portable

    ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker, initargs=(portable(lm), threads))
    try:
        futures = [ex.submit(_worker_chunk, chunking.ids(ids, i)) for i in todo]
        for i, f in zip(todo, futures):  # in chunk order, whichever finishes first
            yield i, f.result()
        ex.shutdown(wait=True)
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        raise


_WORKER: dict = {}


def _init_worker(spec: dict, threads: Optional[int]) -> None:
    from llmtrace.checkpoint.load import load_model

    if threads:
        torch.set_num_threads(threads)
    _WORKER["lm"] = load_model(spec["spec"], device=spec["device"], dtype=spec["dtype"],
                               keep_quantized=spec["keep_quantized"])


def _worker_chunk(ids: list[int]) -> torch.Tensor:
    return chunk_jacobians(_WORKER["lm"], ids)


class FitActor:
    """A Ray actor: loads the model once, then returns the Jacobian sums of the chunks it is sent."""

    def __init__(self, spec: dict, threads: Optional[int]):
        _init_worker(spec, threads)

    def chunk(self, ids: list[int]) -> torch.Tensor:
        return _worker_chunk(ids)


def _on_ray(lm, ids, chunking, todo, workers, address, threads):
    from llmtrace.run.capture import portable
    from llmtrace.run.ray_cluster import start_ray

    ray = start_ray(address)
    from ray.util import ActorPool

    actor = ray.remote(num_cpus=threads or 1)(FitActor)
    actors = [actor.remote(portable(lm), threads) for _ in range(workers)]
    try:  # map, not map_unordered: the sums come back in chunk order, to be added in it
        yield from zip(todo, ActorPool(actors).map(lambda a, i: a.chunk.remote(chunking.ids(ids, i)), todo))
    finally:
        for a in actors:
            ray.kill(a)


# ----------------------------------------------------------------------------------------------------------------
# reading out


REFERENCE = "jlens"  # the format of Anthropic's reference package, which TransformerLens reads and writes too


def lens_info(path: Union[str, Path]) -> dict:
    """What a lens file says of its fit: llmtrace's metadata (format, model, ctx, chunks, positions, text_sha256,
    layers, d_model), or for the reference package's `.pt` {format: "jlens", d_model, n_prompts, source_layers,
    metadata: its own, if any}."""
    return _read(Path(path))[1]


def _read(path: Path) -> tuple[dict[int, torch.Tensor], dict]:
    from llmtrace.checkpoint.torch_zip import is_torch_zip, read_torch_zip

    if not path.exists():
        raise UsageError(f"{path}: no such lens file (a Jacobian lens fit writes one)")
    if is_torch_zip(path):
        obj = read_torch_zip(path)
        obj = obj if isinstance(obj, dict) else {}
        J, n = obj.get("J"), obj.get("n_prompts")
        if J is None and isinstance(obj.get("jacobian_sum"), dict) and isinstance(obj.get("n_done"), int) \
                and obj["n_done"] > 0:  # the reference's fit checkpoint: the sums over n_done prompts
            n = obj["n_done"]
            J = {k: v.float() / n if isinstance(v, torch.Tensor) else v for k, v in obj["jacobian_sum"].items()}
        if not isinstance(J, dict) or not J or not all(isinstance(k, int) and isinstance(v, torch.Tensor)
                                                       for k, v in J.items()):
            raise LlmtraceError(f"{path} is a torch.save file but not a Jacobian lens of the reference format (a "
                                f"dict whose J maps each layer to its matrix)")
        d = obj.get("d_model", next(iter(J.values())).size(-1))
        if any(v.shape != (d, d) for v in J.values()):
            raise LlmtraceError(f"{path}: its matrices are not all ({d}, {d}), the width it gives")
        meta = {"format": REFERENCE, "d_model": d, "n_prompts": n, "source_layers": sorted(J)}
        extra = dict(obj["metadata"]) if isinstance(obj.get("metadata"), dict) else {}
        if "target_layer" in obj:
            extra.setdefault("target_layer", obj["target_layer"])
        if extra:
            meta["metadata"] = extra
        return {k: v.float() for k, v in J.items()}, meta
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = json.loads(_metadata(path).get("jlens", "{}"))
    except (SafetensorError, OSError, ValueError):
        meta = {}
    if meta.get("format") != FORMAT:
        raise LlmtraceError(f"{path} is not a Jacobian lens file: neither llmtrace's ({FORMAT}) nor the reference "
                            f"package's (torch.save, keys J, n_prompts, source_layers, d_model)")
    tensors = load_file(str(path))
    return {int(k.split(".")[1]): v for k, v in tensors.items() if k.startswith("J.")}, meta


def read_lens(path: Union[str, Path], lm=None) -> dict[int, torch.Tensor]:
    """{layer: J_l (D, D) float32} from a lens file: llmtrace's (safetensors) or the reference package's (`.pt`,
    read without unpickling), checked against the model `lm` when given. With `lm`, a reference lens, which leaves
    out the last layer (its J is I), gets it."""
    path = Path(path)
    lens, meta = _read(path)
    if lm is None:
        return lens
    L, D = lm.config.n_layers, lm.config.d_model
    if meta["format"] == FORMAT:
        if meta.get("layers") != L or meta.get("d_model") != D:
            raise LlmtraceError(f"{path} was fitted on {meta.get('model')} ({meta.get('layers')} layers, width "
                                f"{meta.get('d_model')}); this model has {L} layers, width {D}")
        return lens
    if meta["d_model"] != D or max(lens) >= L:
        raise LlmtraceError(f"{path} is a lens of width {meta['d_model']} over layers up to {max(lens)}; this model "
                            f"has {L} layers, width {D}")
    target = meta.get("metadata", {}).get("target_layer", L - 1)
    if target != L - 1:
        raise LlmtraceError(f"{path} maps each layer to layer {target}'s output, not the last layer's ({L - 1}): "
                            f"the lens reads through the model's head only from the last layer")
    missing = [layer for layer in range(L - 1) if layer not in lens]
    if missing:
        raise LlmtraceError(f"{path} has no matrix for {noun(len(missing), 'layer')} "
                            f"{', '.join(map(str, missing[:8]))}{', …' if len(missing) > 8 else ''}: llmtrace reads "
                            f"a lens of every layer")
    lens.setdefault(L - 1, torch.eye(D))  # the last layer's output is h_L itself
    return lens


def readout(lm, prompt, lens: dict[int, torch.Tensor], chat: bool = False) -> torch.Tensor:
    """softmax(W_U · norm(J_l · h_l)) for every layer l and position of one prompt: (L, T, V) float32 (the model's
    own head: its final norm, LM head and soft-cap)."""
    return torch.stack([probs for probs, _ in _layers(lm, prompt, lens, chat)])


def readout_top(lm, prompt, lens: dict[int, torch.Tensor], k: int, chat: bool = False) -> dict[str, torch.Tensor]:
    """The top `k` of each layer and position through the Jacobian lens and through the logit lens (J = I), from one
    pass: {"jlens_p", "jlens_id", "logit_p", "logit_id"}, each (L, T, k)."""
    out: dict[str, list] = {"jlens_p": [], "jlens_id": [], "logit_p": [], "logit_id": []}
    for probs, plain in _layers(lm, prompt, lens, chat, logit_lens=True):
        for name, q in (("jlens", probs), ("logit", plain)):
            p, i = q.topk(k, dim=-1)
            out[f"{name}_p"].append(p)
            out[f"{name}_id"].append(i)
    return {name: torch.stack(v) for name, v in out.items()}


def _layers(lm, prompt, lens, chat, logit_lens=False):
    """(J-lens probs, logit-lens probs or None) of each layer in order, each (T, V), from one cached pass."""
    from llmtrace.run.research import run_with_cache

    model = lm.model
    _, cache = run_with_cache(lm, prompt, names="*.resid_post", chat=chat)
    with torch.no_grad():
        for layer in range(lm.config.n_layers):
            h = cache[f"{layer}.resid_post"]  # (1, T, D)
            if layer not in lens:
                raise LlmtraceError(f"the lens has no matrix for layer {layer}")
            J = lens[layer].to(h.device, h.dtype)
            mapped = (h @ J.T).to(model.embed.weight.dtype)  # J_l · h for every position
            probs = model.head(mapped)[0].float().softmax(-1)
            plain = model.head(h.to(model.embed.weight.dtype))[0].float().softmax(-1) if logit_lens else None
            yield probs, plain
