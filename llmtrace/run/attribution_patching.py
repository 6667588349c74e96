"""Attribution patching (`llmtrace patch --method attribution`): the patching sweep's effects estimated from one
forward and one backward pass (Nanda 2023, "Attribution patching"; nnsight's AtP).

Patching activation a at a point from the clean run into the corrupt run moves the metric m = logit(answer) −
logit(against) at the last position by about its first-order term

    effect(a) ≈ (a_clean − a_corrupt) · ∂m/∂a |corrupt run

so the corrupt run, its gradient with respect to every point of the grid, and the clean run's activations give the
whole grid at once:
  - the residual stream (the sweep's `at` point, default the layer's output) at every (layer, position): the dot
    product over the width D at that position, the grid of `llmtrace patch`;
  - each head (the hookable per-head output before the output projection, as the model declares it per layer,
    `model.heads_points()`: `attn_out`, a linear-attention layer's value heads `delta_out`, a Mamba2 layer's read-out)
    at every (layer, head), patched at every position: the dot product over positions and the head's width; a layer
    whose mixer has no heads (a short convolution) has no head cells.
The gradient flows through the model's own forward (torch.enable_grad): the stream entering layer 0 is made a leaf
that requires a gradient (the weights stay frozen), each point of the grid keeps its gradient (`retain_grad`), one
backward pass from m fills them all.

`exact_heads` patches each head alone (every position) and runs the corrupt prompt again, L·H passes: the exact grid
the head estimates are checked against; the residual grid's exact values are the sweep's (run.patching).
`agreement` is what the estimates and the exact effects share: Pearson's correlation and the overlap of their top k
cells by magnitude.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

from llmtrace.model.llama_points import RESID_PRE
from llmtrace.run.patching import patch_sweep as exact_sweep, prompt_pair


def _r(x: float) -> float:
    return float(f"{x:.6g}")


def _metric(logits: torch.Tensor, answer: int, against: int) -> torch.Tensor:
    last = logits[0, -1].float()
    return last[answer] - last[against]


def _run(model, ids: list[int], at: str, grad: bool) -> tuple[torch.Tensor, dict]:
    """One pass over ids: (the metric's logits, {(layer, point): tensor}) for the grid's points; with `grad`, the
    tensors keep their gradients for a backward pass from the metric."""
    keep: dict = {}
    L = model.config.n_layers
    grid = {(i, at) for i in range(L)} | {(i, h) for i, h in enumerate(model.heads_points()) if h is not None}

    def hook(layer, name, x):
        if layer is None:
            return None
        out = None
        if grad and layer == 0 and name == RESID_PRE.name:  # the leaf every gradient flows back to
            out = x = x.detach().requires_grad_(True)
        if (layer, name) in grid:
            if grad:
                x.retain_grad()
            keep[(layer, name)] = x
        return out

    idx = torch.tensor([ids], dtype=torch.long, device=model.embed.weight.device)
    with torch.set_grad_enabled(grad), model.hooked(hook, spell_out=False):
        logits = model(idx)
    return logits, keep


def estimate(lm, clean_ids: list[int], corrupt_ids: list[int], answer: int, against: int, at: str) -> dict:
    """{"clean", "corrupt": the metrics, "resid": (L, T) estimates, "heads": (L, H) estimates} in float64."""
    model = lm.model
    L = lm.config.n_layers
    with torch.no_grad():
        clean_logits, clean = _run(model, clean_ids, at, grad=False)
    logits, corrupt = _run(model, corrupt_ids, at, grad=True)
    m = _metric(logits, answer, against)
    m.backward()
    resid = torch.stack([((clean[(i, at)] - corrupt[(i, at)]) * corrupt[(i, at)].grad)[0].double().sum(-1)
                         for i in range(L)])  # (L, T)
    heads = []
    for i, point in enumerate(model.heads_points()):
        if point is None:  # a mixer without heads (a short convolution): no head cells in this layer
            heads.append(torch.zeros(0, dtype=torch.float64))
            continue
        key = (i, point)
        d = (clean[key] - corrupt[key]) * corrupt[key].grad  # (1, T, H, Dh)
        heads.append(d[0].double().sum(dim=(0, 2)))  # (H,)
    width = max(1, max(h.numel() for h in heads))
    head_grid = torch.full((L, width), float("nan"), dtype=torch.float64)
    for i, h in enumerate(heads):
        head_grid[i, : h.numel()] = h.detach().cpu()
    return {"clean": float(_metric(clean_logits, answer, against)), "corrupt": float(m.detach()),
            "resid": resid.detach().cpu(), "heads": head_grid.detach()}


@torch.no_grad()
def exact_heads(lm, clean_ids: list[int], corrupt_ids: list[int], answer: int, against: int) -> torch.Tensor:
    """(L, H) metric − corrupt metric of each head patched alone from the clean run (every position): L·H passes."""
    model = lm.model
    L = lm.config.n_layers
    _, clean = _run(model, clean_ids, RESID_PRE.name, grad=False)
    idx = torch.tensor([corrupt_ids], dtype=torch.long, device=model.embed.weight.device)
    m0 = float(_metric(model(idx), answer, against))
    points = model.heads_points()
    widths = [0 if p is None else clean[(i, p)].size(2) for i, p in enumerate(points)]
    out = torch.full((L, max(1, max(widths))), float("nan"), dtype=torch.float64)
    for i, point in enumerate(points):
        for h in range(widths[i]):
            def patch(layer, name, x, i=i, h=h, point=point):
                if layer == i and name == point:
                    x = x.clone()
                    x[:, :, h] = clean[(i, point)][:, :, h]
                    return x
                return None

            with model.hooked(patch, layers=[i], spell_out=False):
                out[i, h] = float(_metric(model(idx), answer, against)) - m0
    return out


def agreement(est: torch.Tensor, exact: torch.Tensor, k: int = 10) -> dict:
    """Pearson's r between the estimates and the exact effects (the cells both hold), and how many of the top k
    cells by |effect| they share."""
    keep = ~(est.isnan() | exact.isnan())
    a, b = est[keep].double(), exact[keep].double()
    k = min(k, a.numel())
    a0, b0 = a - a.mean(), b - b.mean()
    denom = math.sqrt(float((a0 * a0).sum()) * float((b0 * b0).sum()))
    r = float((a0 * b0).sum()) / denom if denom > 0 else float("nan")
    top_a = set(a.abs().topk(k).indices.tolist())
    top_b = set(b.abs().topk(k).indices.tolist())
    return {"pearson": _r(r), "top_k": k, "overlap": len(top_a & top_b), "cells": int(a.numel())}


def attribution_sweep(lm, clean: str, corrupt: str, answer: str, against: str, at: Optional[str] = None,
                      check: bool = False, top_k: int = 10, encode=None, on_progress=None) -> dict:
    """The sweep's `patch` event with `method` "attribution": its `cells` (layer, position) hold the estimated metric
    (corrupt metric + estimate) and recovery; `heads` the (layer, head) estimates. With `check`, the exact sweep and
    the exact head patches run too, and `agreement` holds each grid's Pearson's r and top-k overlap, `exact` their
    effects."""
    pair = prompt_pair(lm, clean, corrupt, answer, against, at, encode)
    a_id, b_id, clean_ids, corrupt_ids, at = pair["answer_id"], pair["against_id"], pair["clean_ids"], \
        pair["corrupt_ids"], pair["at"]
    t0 = time.perf_counter()
    est = estimate(lm, clean_ids, corrupt_ids, a_id, b_id, at)
    seconds = time.perf_counter() - t0
    ev = exact_sweep(lm, clean, corrupt, answer, against, at=at, encode=encode, on_progress=on_progress) if check \
        else None
    m_clean, m_corrupt = est["clean"], est["corrupt"]
    span = m_clean - m_corrupt
    tok = lm.tokenizer
    L, T = est["resid"].shape
    cells = [{"layer": i, "position": p, "metric": _r(m_corrupt + e),
              "recovery": _r(e / span) if span != 0 else None, "estimate": _r(e)}
             for i in range(L) for p, e in enumerate(est["resid"][i].tolist())]
    heads = [{"layer": i, "head": h, "estimate": _r(e)} for i in range(L)
             for h, e in enumerate(est["heads"][i].tolist()) if not math.isnan(e)]
    out = {"event": "patch", "method": "attribution", "at": at, "clean": clean, "corrupt": corrupt,
           "answer": {"text": answer, "id": a_id, "piece": tok.piece(a_id)},
           "against": {"text": against, "id": b_id, "piece": tok.piece(b_id)},
           "metric": "logit(answer) - logit(against) at the last position; cells: the corrupt metric + the "
                     "attribution estimate (clean - corrupt activation) · gradient at the corrupt run",
           "clean_tokens": [tok.piece(i) for i in clean_ids], "corrupt_tokens": [tok.piece(i) for i in corrupt_ids],
           "clean_texts": [tok.decode([i]) for i in clean_ids], "corrupt_texts": [tok.decode([i]) for i in corrupt_ids],
           "n_layers": L, "n_positions": T, "clean_metric": _r(m_clean), "corrupt_metric": _r(m_corrupt),
           "cells": cells, "heads": heads, "seconds": round(seconds, 3)}
    if check:
        exact_resid = torch.tensor([[c["metric"] for c in ev["cells"] if c["layer"] == i] for i in range(L)],
                                   dtype=torch.float64) - ev["corrupt_metric"]
        t1 = time.perf_counter()
        exact_h = exact_heads(lm, clean_ids, corrupt_ids, a_id, b_id)
        out["exact_seconds"] = round(ev["seconds"] + time.perf_counter() - t1, 3)
        out["agreement"] = {"resid": agreement(est["resid"], exact_resid, top_k),
                            "heads": agreement(est["heads"], exact_h, top_k)}
        for c in cells:
            c["exact"] = _r(float(exact_resid[c["layer"], c["position"]]))
        for h in heads:
            h["exact"] = _r(float(exact_h[h["layer"], h["head"]]))
    return out
