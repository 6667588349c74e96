"""A batch's matrix products through oneDNN, with the weights packed once (issue 51 item 4).

Beside the model, as model/compiled.py is: the model's maths is unchanged, only the kernel that multiplies changes.

Why. A decode step of B rows multiplies a (B, K) block by every (N, K) weight matrix. At B = 1 that reads the weights
and is bound by memory; at B = 16 it is bound by the arithmetic, and there torch's float32 product (MKL's sgemm on
this AMD EPYC, one core) takes 1.35-1.56 ms for (16, 576) x (576, 3,072) and 28-30 ms for the 49,152-row head, where
oneDNN on its own packed layout, in the blocks of 192 below, takes 1.09 and 15.5 ms (benchmarks/RESULTS.md, "B = 16
against the loop, third pass"). At B = 16 the two give the same bits: MKL sums in blocks of 192 too.

What it costs. A packed copy of every float32 matrix the batch multiplies (the layout is oneDNN's own, so the copy
cannot share the model's storage): as many bytes again as the model's matrices, made once (0.55 s of one core for
SmolLM2-135M) and kept by whoever holds the `PackedProducts` (the batch loop keeps it with the loaded model). A weight
changed in place after packing (its version counter moved) is packed again the next time the products are turned on.

`packed_products(model)` is None where it does not apply: not on the CPU, not float32, or torch built without oneDNN.
"""

from __future__ import annotations

import contextlib
import types
from typing import Optional

import torch
import torch.nn as nn

PACK_ROWS = 16  # the rows oneDNN is told to expect when it lays a weight out (the batch it was measured at)
# oneDNN sums each output over all K inputs in one running float32 sum, whose rounding error grows with K: against
# float64 it lands 2-4x farther than torch's own product (K = 1536: 1.5e-4 against 5.2e-5 on random (16, K) blocks). Cut
# into blocks of 192 inputs, each summed by oneDNN and the blocks' sums added, it lands where MKL's does (5.2e-5),
# still faster; so each weight is packed as its K / 192 blocks of columns.
K_BLOCK = 192


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> (..., N): the same x Wᵀ + b as nn.Linear, by oneDNN on the packed blocks of W's columns, each
    block's product added in turn (the bias with the first)."""
    blocks = self._packed_blocks
    *lead, K = x.shape
    xs = x.reshape(-1, len(blocks), K_BLOCK).transpose(0, 1).contiguous()  # (K / 192, M, 192), one copy
    y = torch.ops.mkldnn._linear_pointwise(xs[0], blocks[0], self.bias, "none", [], "")  # (M, N)
    for xb, w in zip(xs[1:], blocks[1:]):
        y += torch.ops.mkldnn._linear_pointwise(xb, w, None, "none", [], "")
    return y.view(*lead, y.size(-1))


def pack(w: torch.Tensor) -> list[torch.Tensor]:
    """A weight (N, K) as oneDNN's packed copies of its column blocks [0, 192), [192, 384), ..."""
    with torch.no_grad():
        return [torch.ops.mkldnn._reorder_linear_weight(w[:, i : i + K_BLOCK].contiguous(), PACK_ROWS)
                for i in range(0, w.size(1), K_BLOCK)]


class PackedProducts:
    """Every float32 nn.Linear of a model with its weight packed for oneDNN; `active()` runs them on it."""

    def __init__(self, model: nn.Module):
        self.linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32
                        and m.in_features % K_BLOCK == 0]  # (a width not a multiple of 192 keeps torch's product)
        self.packed: dict[int, tuple[int, list]] = {}  # id(linear) -> (the weight's version, its packed blocks)
        self.refresh()

    def refresh(self) -> None:
        """Pack each weight not packed yet, or changed in place since (its version counter moved)."""
        for m in self.linears:
            w = m.weight
            got = self.packed.get(id(m))
            if got is None or got[0] != w._version:
                self.packed[id(m)] = (w._version, pack(w.detach()))

    @contextlib.contextmanager
    def active(self):
        """Within the block each of these linears multiplies by its packed weight; on exit they are as before."""
        self.refresh()
        for m in self.linears:
            m._packed_blocks = self.packed[id(m)][1]
            m.forward = types.MethodType(_packed_forward, m)
        try:
            yield self
        finally:
            for m in self.linears:
                del m.forward
                del m._packed_blocks


def packed_products(model: nn.Module) -> Optional[PackedProducts]:
    """The model's products packed for oneDNN, or None where that does not apply (see the module's docstring)."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype != torch.float32:
        return None
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return None
    return PackedProducts(model)


def matrix_bytes(model: nn.Module) -> int:
    """What packing would add: the bytes of the model's float32 nn.Linear weights (a tied head counted once)."""
    seen, total = set(), 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.float32 and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel() * 4
    return total
