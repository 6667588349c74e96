"""explain on a short gated convolution layer (model.kinds.short_conv: LFM2), beside its steps table: the causal
convolution worked on one channel at the last token, and the window of Lc−1 inputs it leaves, on the pass's own
numbers.

For channel d at the last token t, with v = B ⊙ x (conv_bx) and the channel's kernel w_d (Lc taps):
    z_t,d = Σ_j w_d,j · v_(t−Lc+1+j),d        (a position before the prompt reads 0: the pass starts from no window)
    y_t,d = C_t,d · z_t,d                     the output gate
and the window the layer keeps after the pass, its whole memory for that channel: v_(t−Lc+2..t),d. Each computed in
float64 beside the value the pass kept.
"""

from __future__ import annotations

from typing import Optional

import torch

from llmtrace.model.kinds.short_conv import CONV_BX, CONV_C, CONV_GATED, CONV_OUT, CONV_WINDOW


def _r(x) -> float:
    return float(f"{float(x):.6g}")


def _kernel(model, layer: int, op) -> Optional[torch.Tensor]:
    """(D, Lc) the layer's depthwise kernel, float64; None where the run holds it otherwise."""
    try:
        w = model.get_parameter(f"layers.{layer}.{op.weights[0]}")
    except AttributeError:
        return None
    return w.detach().double().cpu() if w.is_floating_point() else None


def conv_section(cap, model, maths, channel: Optional[int] = None) -> Optional[dict]:
    """One channel's convolution at the last token (module docstring): by default the channel whose convolution
    output is largest there."""
    layer = cap.layer
    w = _kernel(model, layer, maths.op(layer, CONV_OUT.name))
    v, z, c = (cap.points.get(p.name) for p in (CONV_BX, CONV_OUT, CONV_C))
    if w is None or v is None or z is None or c is None:
        return None
    v, z, c = v.double().cpu(), z.double().cpu(), c.double().cpu()  # (T, D) each
    T, D = v.shape
    L, t = w.size(1), T - 1
    d = int(z[t].abs().argmax()) if channel is None else channel
    rows = []
    for j in range(L):
        p = t - L + 1 + j
        x = float(v[p, d]) if p >= 0 else 0.0
        rows.append({"position": p, "input": _r(x), "weight": _r(w[d, j]), "product": _r(x * float(w[d, j]))})
    total = sum(float(w[d, j]) * (float(v[t - L + 1 + j, d]) if t - L + 1 + j >= 0 else 0.0) for j in range(L))
    gated = float(c[t, d]) * total
    window = cap.points.get(CONV_WINDOW.name)
    kept = window[d].double().cpu() if window is not None else None  # (Lc-1,) the window after the pass
    want = torch.tensor([float(v[p, d]) if p >= 0 else 0.0 for p in range(t - L + 2, t + 1)], dtype=torch.float64)
    return {"event": "explain", "section": "convolution", "layer": layer, "seed_step": "s6.3", "channel": d,
            "position": t, "kernel": L, "width": D, "rows": rows, "sum": _r(total), "pass": _r(z[t, d]),
            "check": _r(abs(total - float(z[t, d]))), "gate": _r(c[t, d]), "gated": _r(gated),
            "gated_pass": _r(cap.points[CONV_GATED.name][t, d]),
            "window": [_r(x) for x in want.tolist()],
            "window_check": None if kept is None else _r((kept - want).abs().max())}
