"""Any declared operation (model.maths) applied to tensors, in float64: the declaration's own check.

`apply(op, args, weights, out_shape, ...)` computes a point from its operands as the declaration says: it calls the
evaluator its kind declares (model.maths.OpKind.evaluate: model.ops for the kinds every model uses, a kind of layer's
own file for its own), written from the formula and not from the model's code, so that a test can lay each declared
operation beside the value the forward pass reported (tests/test_maths.py, for every family) and `explain` can show
"computed" beside "in the trace". Tensors keep the batch axis, as a capture holds them: (B, T, ...); k_repeated may
be the (B, Hkv, G, S, Dh) view.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from llmtrace.model.maths import Op, op_kind

ACTS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def apply(o: Op, args: list, weights: list, out_shape: tuple, *, positions: Optional[torch.Tensor] = None,
          padding: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The point `o` makes from `args` (its operands' tensors, in order) and `weights` (its weights' tensors), in
    float64, shaped `out_shape`. `positions` (B, T) or (T,): each token's position (RoPE); `padding` (B, S): False at
    pad slots (the mask). None for an operation that makes no tensor to check (the slots a cache write names)."""
    fn = op_kind(o.kind).evaluate
    if fn is None:
        return None
    x = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    w = [t.double() for t in weights]
    y = fn(o, x, w, out_shape, positions=positions, padding=padding)
    return None if y is None else y.reshape(out_shape)


def per_value_head(x: torch.Tensor, group: int, order: str) -> torch.Tensor:
    """(B, T, Hk, Dk) -> (B, T, Hv, Dk): value head j reads key head j // group ("grouped") or j % Hk ("tiled")."""
    return x.repeat(1, 1, group, 1) if order == "tiled" else x.repeat_interleave(group, dim=2)


def max_error(computed: torch.Tensor, recorded: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference (−∞ against −∞ counts as none) and the largest relative one (against the
    recorded value's largest magnitude)."""
    # in numpy: the same float64 operations as torch's, at a tenth of the cost per call on the few entries a card
    # holds (every card of a traced pass is checked here: trace.cards)
    a = computed.detach().double().cpu().numpy()
    b = recorded.detach().double().cpu().numpy()
    with np.errstate(invalid="ignore"):  # inf − inf: nan, as torch gives it
        same_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
        d = np.where(same_inf, 0.0, np.abs(a - b))
    absolute = float(d.max()) if d.size else 0.0
    finite = np.isfinite(b)
    scale = float(np.abs(b[finite]).max()) if finite.any() else 1.0
    return absolute, absolute / max(scale, 1e-30) if math.isfinite(absolute) else math.inf


def declared_weight(model, layer: int, o: Op) -> Optional[torch.Tensor]:
    """The first weight `o` reads in `layer` of `model`, in float64 on the host (explain's worked sections); None
    where the run holds it otherwise (quantized or packed)."""
    try:
        w = model.get_parameter(f"layers.{layer}.{o.weights[0]}")
    except AttributeError:
        return None
    return w.detach().double().cpu() if w.is_floating_point() else None
