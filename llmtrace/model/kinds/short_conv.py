"""The short gated convolution (LFM2's `Lfm2ShortConv`): a sequence mixer with no attention, whose whole memory is the
last Lc−1 inputs of each channel.

For each token, with x̂ the layer's normed input (T, D) and Lc the kernel length (3 in the released LFM2 models):

    b, c, u = x̂ W_B, x̂ W_C, x̂ W_x      three projections of width D (one matrix, rows B, then C, then x)
    v       = b ⊙ u                     the input gate
    z_t     = Σ_j w_j ⊙ v_(t−Lc+1+j)    a causal depthwise convolution: channel d mixes its own last Lc values of v,
                                        no activation; the Lc−1 values before this pass are its memory (zeros at
                                        first)
    y       = c ⊙ z                     the output gate
    out     = y W_out

Order enters only through the convolution (the layer has no RoPE and no scores). Its memory (s6.8) is constant: D ×
(Lc−1) numbers, whatever the length of the sequence, against 2·Hkv·Dh more numbers each token in an attention layer.
transformers keeps Lc inputs per channel in its cache (one more than the kernel reads); llmtrace keeps the Lc−1 it
reads, the number llama.cpp keeps.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.model.llama_points import O_PROJ
from llmtrace.model.maths import LayerPlan, Op, OpKind, declare, op
from llmtrace.model.memory import Memory
from llmtrace.model.points import Point, Source, Weight
from llmtrace.model.transformer import LayerInput, Module
from llmtrace.model.recompute import declared_weight
from llmtrace.units import sig6

KIND = "short_conv"
KERNEL = 3  # Lc where the config part says none: conv_L_cache of every released LFM2 (transformers' default)

CONV_B = Point("conv_b", "s6.1", ("T", "D"), about="X·W_B: the input gate")
CONV_C = Point("conv_c", "s6.1", ("T", "D"), about="X·W_C: the output gate")
CONV_X = Point("conv_x", "s6.1", ("T", "D"), about="X·W_x: the input")
CONV_BX = Point("conv_bx", "s6.2", ("T", "D"), about="B ⊙ x: the gated input the convolution reads")
CONV_WINDOW = Point("conv_window", "s6.8", ("D", "Lc-1"), state=True,
                    about="the last Lc−1 gated inputs of each channel after this pass: the layer's whole memory")
CONV_OUT = Point("conv_out", "s6.3", ("T", "D"), about="the causal depthwise convolution over each channel's last Lc "
                 "gated inputs: where this layer sees order (no RoPE)", input=CONV_BX.name)
CONV_GATED = Point("conv_gated", "s6.5", ("T", "D"), editable=True, about="C ⊙ the convolution: the layer's output "
                   "before W_out")
OUT = replace(O_PROJ, about="C ⊙ conv, times W_out (attention: the heads, times Wo)")

POINTS = (CONV_B, CONV_C, CONV_X, CONV_BX, CONV_WINDOW, CONV_OUT, CONV_GATED, OUT)

# The seed steps its points sit under, with this kind's own headings (English, Chinese).
HEADINGS = {
    "summary": ("a short gated convolution: a window of the last inputs, no KV cache", "短门控卷积：保留最近输入的窗口，没有 KV 缓存"),
    "s6.1": ("pre-norm and the B, C, x projections", "预归一化与 B、C、x 投影"),
    "s6.2": ("the input gate B ⊙ x", "输入门 B ⊙ x"),
    "s6.3": ("causal depthwise convolution", "因果逐通道卷积"),
    "s6.5": ("the output gate C ⊙ conv", "输出门 C ⊙ conv"),
    "s6.6": ("output projection + residual", "输出投影 + 残差"),
    "s6.8": ("the convolution window kept", "保留的卷积窗口"),
}


class ShortConv(Module):
    """B·x, a causal depthwise convolution of length Lc over each channel, C·, W_out (module docstring). Its memory is
    the layer's LayerState in the cache: the last Lc−1 gated inputs, (D, Lc−1), overwritten by each pass."""

    KIND = KIND
    WHERE = "attn"
    POINTS = POINTS
    HEADINGS = HEADINGS

    def __init__(self, config, kernel: Optional[int] = None):
        super().__init__()
        D = config.d_model
        kernel = kernel or int(config.parts.get(KIND, {}).get("kernel", KERNEL))  # Lc: its config part's, unless given
        self.width, self.kernel = D, kernel
        self.w_in = nn.Linear(D, 3 * D, bias=False)  # (3D, D): W_B rows, then W_C, then W_x
        self.conv = nn.Parameter(torch.empty(D, kernel))  # (D, Lc): one kernel per channel
        self.w_out = nn.Linear(D, D, bias=False)  # (D, D)

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("w_in.weight", ("3*D", "D"), "s6.1", "matrix",
                       (Source("in_proj.weight", "in_proj.weight", "3*D", "W_B|W_C|W_x"),)),
                Weight("conv", ("D", str(self.kernel)), "s6.3", "conv",
                       (Source("conv.weight", "conv.weight", "D", "w_conv", hf_transform=("squeeze1",)),)),
                Weight("w_out.weight", ("D", "D"), "s6.6", "matrix",
                       (Source("out_proj.weight", "out_proj.weight", "D", "W_out"),)))

    def memory(self) -> Memory:
        """s6.8 the last Lc−1 gated inputs of each channel, without the batch axis: the same size at every step. Kept in
        the model's dtype, as transformers and llama.cpp keep it."""
        return Memory("window", constant={"conv": (self.width, self.kernel - 1)}, constant_float32=False)

    EXPLAIN = ("convolution",)  # one channel's convolution and the window it leaves (below); s6.8 its window

    def explain(self, key: str, cap, model, maths, head: Optional[int]) -> Optional[dict]:
        """explain's section `key` of this layer (one of EXPLAIN), from the pass's capture."""
        return conv_section(cap, model, maths)
    FLOPS_NOTE = ("no T×T term: each token reads only the last Lc inputs of its channel",
                  "没有 T×T 项：每个词元只读取它那个通道最近的 Lc 个输入")

    def flops(self, n_tokens: int) -> list[tuple]:
        """Multiply-add FLOPs (2 per multiply-add) of the mixer over n tokens, as rows: no T×T term."""
        T, D, L = n_tokens, self.width, self.kernel
        return [("in", ("B, C, x projections", "B、C、x 投影"), "2·T·D·3D", 2 * T * D * 3 * D),
                ("gates", ("B ⊙ x and C ⊙ y", "B ⊙ x 与 C ⊙ y"), "2·T·D", 2 * T * D),
                ("conv", ("causal convolution", "因果卷积"), "2·T·D·Lc", 2 * T * D * L),
                ("out", ("output projection", "输出投影"), "2·T·D·D", 2 * T * D * D)]

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        """Each point's operation (model.maths), in the forward's order; the window is `carried` from the last pass."""
        D = self.width
        conv = dict(kernel=self.kernel, act=None, carried=[CONV_WINDOW.name])
        return {CONV_B.name: op("matmul", [x], ["w_in.weight"], rows=[0, D]),
                CONV_C.name: op("matmul", [x], ["w_in.weight"], rows=[D, 2 * D]),
                CONV_X.name: op("matmul", [x], ["w_in.weight"], rows=[2 * D, 3 * D]),
                CONV_BX.name: op("mul", [CONV_B.name, CONV_X.name]),
                CONV_WINDOW.name: op("conv1d", [CONV_BX.name, CONV_WINDOW.name], ["conv"], output="state", **conv),
                CONV_OUT.name: op("conv1d", [CONV_BX.name, CONV_WINDOW.name], ["conv"], output="y", **conv),
                CONV_GATED.name: op("mul", [CONV_C.name, CONV_OUT.name]),
                OUT.name: op("matmul", [CONV_GATED.name], ["w_out.weight"])}

    def forward(self, x: torch.Tensor, io: LayerInput) -> torch.Tensor:
        B, T, D = x.shape
        if io.padding is not None:  # a pad slot's input is zero, as transformers' apply_mask_to_padding_states
            x = (x * io.padding[:, :, None]).to(x.dtype)
        b, c, u = self.w_in(x).split_with_sizes([D, D, D], dim=-1)  # s6.1: (B, T, D) each
        b, c, u = self.point(CONV_B.name, b), self.point(CONV_C.name, c), self.point(CONV_X.name, u)
        v = self.point(CONV_BX.name, b * u)  # s6.2 the input gate: (B, T, D)
        z = self.point(CONV_OUT.name, self.convolve(v, io))  # s6.3: (B, T, D)
        y = self.point(CONV_GATED.name, c * z)  # the output gate: (B, T, D)
        return self.point(OUT.name, self.w_out(y))  # s6.6: (B, T, D)

    def convolve(self, v: torch.Tensor, io: LayerInput) -> torch.Tensor:
        """s6.3 each channel's causal convolution over this pass's values and the Lc−1 before it (the window in the
        cache, zeros without one); the window is left holding the last Lc−1: (B, T, D) -> (B, T, D)."""
        B, T, D = v.shape
        x = v.transpose(1, 2)  # (B, D, T)
        before: Optional[torch.Tensor] = io.cache["conv"] if io.cache is not None else None
        before = x.new_zeros(B, D, self.kernel - 1) if before is None else before.to(x.dtype)
        x = torch.cat([before, x], dim=-1)  # (B, D, Lc-1+T)
        window = x[:, :, -(self.kernel - 1):]  # (B, D, Lc-1)
        if io.cache is not None:
            io.cache.write("conv", window)
        self.point(CONV_WINDOW.name, window)
        return F.conv1d(x, self.conv.unsqueeze(1), groups=D).transpose(1, 2)  # (B, T, D)


# -- its operation (model.maths.OpKind): the gates, element by element ---------------------------------------------

declare(
    __name__,
    OpKind("mul", "y = a ⊙ b", lambda o, name, x, c, say: f"{name} = {x[0]} ⊙ {x[1]}", {},
           lambda o, x, w, shape, **_: x[0] * x[1]),
)


# ----------------------------------------------------------------------------------------------------------------
# explain's own section of a short convolution layer ("convolution", its EXPLAIN key; run.explain calls
# ShortConv.explain)
#
# explain on a short gated convolution layer (model.kinds.short_conv: LFM2), beside its steps table: the causal
# convolution worked on one channel at the last token, and the window of Lc−1 inputs it leaves, on the pass's own
# numbers.
#
# For channel d at the last token t, with v = B ⊙ x (conv_bx) and the channel's kernel w_d (Lc taps):
#     z_t,d = Σ_j w_d,j · v_(t−Lc+1+j),d        (a position before the prompt reads 0: the pass starts from no window)
#     y_t,d = C_t,d · z_t,d                     the output gate
# and the window the layer keeps after the pass, its whole memory for that channel: v_(t−Lc+2..t),d. Each computed in
# float64 beside the value the pass kept.

def conv_section(cap, model, maths, channel: Optional[int] = None) -> Optional[dict]:
    """One channel's convolution at the last token (module docstring): by default the channel whose convolution
    output is largest there."""
    layer = cap.layer
    w = declared_weight(model, layer, maths.op(layer, CONV_OUT.name))
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
        rows.append({"position": p, "input": sig6(x), "weight": sig6(w[d, j]), "product": sig6(x * float(w[d, j]))})
    total = sum(float(w[d, j]) * (float(v[t - L + 1 + j, d]) if t - L + 1 + j >= 0 else 0.0) for j in range(L))
    gated = float(c[t, d]) * total
    window = cap.points.get(CONV_WINDOW.name)
    kept = window[d].double().cpu() if window is not None else None  # (Lc-1,) the window after the pass
    want = torch.tensor([float(v[p, d]) if p >= 0 else 0.0 for p in range(t - L + 2, t + 1)], dtype=torch.float64)
    return {"event": "explain", "section": "convolution", "layer": layer, "seed_step": "s6.3", "channel": d,
            "position": t, "kernel": L, "width": D, "rows": rows, "sum": sig6(total), "pass": sig6(z[t, d]),
            "check": sig6(abs(total - float(z[t, d]))), "gate": sig6(c[t, d]), "gated": sig6(gated),
            "gated_pass": sig6(cap.points[CONV_GATED.name][t, d]),
            "window": [sig6(x) for x in want.tolist()],
            "window_check": None if kept is None else sig6((kept - want).abs().max())}
