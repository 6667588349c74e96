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

The file: safetensors, `J.0` … `J.{L-1}` (D, D) float32, metadata {format, model, ctx, chunks, positions, text}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from llmtrace.errors import BadValue, LlmtraceError, UsageError
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
        workers: int = 1, threads: Optional[int] = None, stop_after: Optional[int] = None,
        on_chunk: Optional[Callable[[int, int], None]] = None) -> dict:
    """Fit J_l over `text` cut into chunks of `ctx` tokens (as `llmtrace eval` cuts it) and write the lens file `out`.
    A state file beside it (`out`.partial) holds the sums after each chunk; `resume` goes on from it. `workers` local
    processes each fit some chunks. `stop_after` chunks: stop as an interruption would. Returns the file's metadata
    with `done` (chunks) and `interrupted`."""
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

    for i, part in _sums(lm, ids, chunking, todo, workers, threads):
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


def _sums(lm, ids, chunking, todo, workers, threads):
    """(chunk, its (L, D, D) sum) in chunk order, from this process or `workers` processes."""
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


# ----------------------------------------------------------------------------------------------------------------
# reading out


def read_lens(path: Union[str, Path], lm=None) -> dict[int, torch.Tensor]:
    """{layer: J_l (D, D)} from a lens file, checked against the model `lm` when given."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such lens file (a Jacobian lens fit writes one)")
    meta = json.loads(_metadata(path).get("jlens", "{}"))
    if meta.get("format") != FORMAT:
        raise LlmtraceError(f"{path} is not a Jacobian lens file of llmtrace ({FORMAT})")
    tensors = load_file(str(path))
    lens = {int(k.split(".")[1]): v for k, v in tensors.items() if k.startswith("J.")}
    if lm is not None and (meta.get("layers") != lm.config.n_layers or meta.get("d_model") != lm.config.d_model):
        raise LlmtraceError(f"{path} was fitted on {meta.get('model')} ({meta.get('layers')} layers, width "
                            f"{meta.get('d_model')}); this model has {lm.config.n_layers} layers, width "
                            f"{lm.config.d_model}")
    return lens


def readout(lm, prompt, lens: dict[int, torch.Tensor], chat: bool = False) -> torch.Tensor:
    """softmax(W_U · norm(J_l · h_l)) for every layer l and position of one prompt: (L, T, V) float32 (the model's
    own head: its final norm, LM head and soft-cap)."""
    from llmtrace.run.research import run_with_cache

    model = lm.model
    _, cache = run_with_cache(lm, prompt, names="*.resid_post", chat=chat)
    rows = []
    with torch.no_grad():
        for layer in range(lm.config.n_layers):
            h = cache[f"{layer}.resid_post"]  # (1, T, D)
            J = lens[layer].to(h.device, h.dtype)
            mapped = (h @ J.T).to(model.embed.weight.dtype)  # J_l · h for every position
            rows.append(model.head(mapped)[0].float().softmax(-1))
    return torch.stack(rows)
