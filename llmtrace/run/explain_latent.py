"""explain on a multi-head latent attention layer (model.kinds.mla: DeepSeek V2/V3), beside its steps table: what
its cache keeps per token against MHA and GQA with the same heads, and why the up-projection can be absorbed, worked
on the pass's own numbers.

For query head h at the last token t and every slot s (notation of model/kinds/mla.py):
    up-projected (what llmtrace runs, as transformers):   k_nope,h,s = c_s · W_kb,h      score_s = q_nope,h · k_nope,h,s
    absorbed (DeepSeek's inference code, llama.cpp):      q̃_h = W_kb,h q_nope,h (R)     score_s = q̃_h · c_s
and for the output, with P the softmax row of head h:
    up-projected:  o_h = Σ_s P_s (c_s W_vb,hᵀ)          absorbed:  o_h = (Σ_s P_s c_s) W_vb,hᵀ
each side in float64 from the captured latents c_kv and queries q_nope and the layer's own W_kb, W_vb; the output
beside the value the pass computed. The cost per decode step: the up-projection of every cached slot, against one
query mapped into the latent space and one output mapped out of it.
"""

from __future__ import annotations

from typing import Optional

import torch

from llmtrace.model.kinds.mla import C_KV, K_NOPE, MLA_OUT, Q_NOPE, V_UP
from llmtrace.model.llama_points import PROBS

SHOWN = 6  # slots and dims shown


def _r(x) -> float:
    return float(f"{float(x):.6g}")


def _rl(t: torch.Tensor) -> list:
    return [_r(v) for v in t.reshape(-1).tolist()]


def _weight(model, layer: int, op) -> Optional[torch.Tensor]:
    """The (H, ·, ·) stack an up-projection reads, float64; None where the run holds it otherwise (quantized)."""
    try:
        w = model.get_parameter(f"layers.{layer}.{op.weights[0]}")
    except AttributeError:
        return None
    return w.detach().double().cpu() if w.is_floating_point() else None


def cache_rows(n_heads: int, width: int, element_size: int) -> list[dict]:
    """What a layer would cache per token with G KV heads of K and V `width` numbers together, G = H, H/2, ..., 1
    (MHA at G = H, GQA below, MQA at 1)."""
    out, g = [], n_heads
    while g >= 1:
        out.append({"kv_heads": g, "numbers": g * width, "bytes": g * width * element_size})
        if g % 2:
            break
        g //= 2
    if out[-1]["kv_heads"] != 1:
        out.append({"kv_heads": 1, "numbers": width, "bytes": width * element_size})
    return out


def latent_section(cap, model, maths, head: int = 0) -> dict:
    """The MLA layer's memory and its absorbed form, worked for one head at the last token (module docstring)."""
    layer = cap.layer
    mla = model.attention_of(layer)
    H, R, Dr, Dn, Dv = mla.n_heads, mla.r, mla.dr, mla.dn, mla.dv
    es = cap.kv_element_size
    out = {"event": "explain", "section": "latent_cache", "layer": layer, "seed_step": "s6.4-s6.5", "head": head,
           "sizes": {"H": H, "R": R, "Dr": Dr, "Dn": Dn, "Dv": Dv}, "element_size": es,
           "latent_numbers": R + Dr, "latent_bytes": (R + Dr) * es,
           "cache_rows": cache_rows(H, Dn + Dr + Dv, es), "form": "up_projected"}
    w_kb = _weight(model, layer, maths.op(layer, K_NOPE.name))  # (H, R, Dn)
    w_vb = _weight(model, layer, maths.op(layer, V_UP.name))  # (H, Dv, R)
    c, q = cap.points.get(C_KV.name), cap.points.get(Q_NOPE.name)
    if w_kb is None or w_vb is None or c is None or q is None:
        return out | {"worked": None}
    c, t = c.double().cpu(), len(cap.ids) - 1  # c (S, R): this pass's latents, every slot (the cache starts empty)
    S = c.size(0)
    qn = q[t, head].double().cpu()  # (Dn,)
    k_nope = c @ w_kb[head]  # (S, Dn): every slot's key, up-projected
    up = k_nope @ qn  # (S,) the position-free half of the scores, up-projected
    q_latent = w_kb[head] @ qn  # (R,) the query mapped into the latent space once
    absorbed = c @ q_latent  # (S,)
    p = cap.points[PROBS.name][head, t].double().cpu()  # (S,) the pass's softmax row
    o_up = p @ (c @ w_vb[head].T)  # (Dv,) every slot's value, up-projected, then weighted
    o_abs = (p @ c) @ w_vb[head].T  # (Dv,) the latents weighted first, then one up-projection
    o_pass = cap.points[MLA_OUT.name][t, head].double().cpu()  # (Dv,)
    return out | {"worked": {
        "position": t, "slots": S, "q_latent_width": R,
        "scores_up": _rl(up[:SHOWN]), "scores_absorbed": _rl(absorbed[:SHOWN]),
        "scores_diff": _r((up - absorbed).abs().max()),
        "out_up": _rl(o_up[:SHOWN]), "out_absorbed": _rl(o_abs[:SHOWN]), "out_pass": _rl(o_pass[:SHOWN]),
        "out_diff": _r((o_up - o_abs).abs().max()), "out_pass_diff": _r((o_up - o_pass).abs().max()),
        # multiply-adds × 2 of one decode step over S cached slots, for the up-projection and for the absorbed form
        "flops_up": 2 * S * R * H * (Dn + Dv), "flops_absorbed": 2 * H * R * (Dn + Dv)}}
