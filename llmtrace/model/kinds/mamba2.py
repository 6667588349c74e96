"""Mamba2: a selective state-space layer, whose memory is a fixed-size state per head instead of keys and values
that grow with every token. As transformers computes it (GraniteMoeHybridMambaLayer and its torch path), for each
token t, in float32:

    [z | xBC | dt] = x W_in                        z the gate (I = Hs·P), xBC the convolution's input, dt per head
    xBC     = silu(causal_conv1d(xBC) + b)         depthwise over the last Kc tokens (s6.3: where the layer sees
                                                   order; it has no RoPE); the Kc-1 inputs before this pass are its
                                                   conv state
    x, B, C = split(xBC)                           x per head (Hs × P), B and C per group (Gs × N)
    Δ       = softplus(dt + dt_bias)               the step of each head, > 0
    a       = exp(Δ·A),  A = −exp(A_log)           how much of the state each token keeps, 0 < a < 1
    h       ← a·h + Δ·x ⊗ B                        the state of head j (P × N), B of its group j // (Hs/Gs)
    y       = h·C + D·x                            the state read with C, plus a skip of x
    y       = RMSNorm(y · silu(z)) · γ             gated, then normed over each of Gs groups of I/Gs
    out     = y W_out

transformers' prefill runs the chunked form of the scan (state space duality) and its decode steps the recurrence;
llmtrace runs the recurrence, token by token, everywhere (the same numbers within float32 rounding).

Notation beside model/transformer.py's: Hs SSM heads, P a head's width, I = Hs·P, Gs groups of B and C, N the state
size, Kc the convolution's kernel, Cs = I + 2·Gs·N the convolution's channels. The sizes are the config's "mamba2"
part (`config_part`), read by this declaration only.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.model.llama_points import O_PROJ
from llmtrace.model.maths import LayerPlan, Op, OpKind, carried_words, declare, op
from llmtrace.model.memory import Memory
from llmtrace.model.points import Point, Source, Weight
from llmtrace.model.transformer import LayerInput, Module, RMSNorm
from llmtrace.units import sig6, sig6_rows

KEY = "mamba2"  # the config part and the kind

SSM_Z = Point("ssm_z", "s6.1", ("T", "I"), about="X·W_z: the gate of the output norm")
SSM_XBC = Point("ssm_xbc", "s6.1", ("T", "Cs"), about="X·W_xBC: x, B and C before the convolution")
SSM_DT_RAW = Point("ssm_dt_raw", "s6.1", ("T", "Hs"), about="X·W_dt: each head's step, before its bias and softplus")
SSM_CONV_STATE = Point("ssm_conv_state", "s6.8", ("Cs", "Kc-1"), state=True,
                       about="the convolution's last Kc-1 inputs after this pass")
SSM_CONV = Point("ssm_conv", "s6.3", ("T", "Cs"), about="silu(causal conv1d over the last Kc tokens + bias): where a "
                 "Mamba2 layer sees order (no RoPE)", input=SSM_XBC.name)
SSM_X = Point("ssm_x", "s6.2", ("T", "Hs", "P"), about="x: the convolution's first I channels, one row of P per head")
SSM_B = Point("ssm_B", "s6.2", ("T", "Gs", "N"), about="B: what each token writes along the state's N axis, per group")
SSM_C = Point("ssm_C", "s6.2", ("T", "Gs", "N"), about="C: how each token reads the state, per group")
SSM_DT = Point("ssm_dt", "s6.4", ("T", "Hs"), about="Δ = softplus(dt + dt_bias): each head's step",
               input=SSM_DT_RAW.name)
SSM_DECAY = Point("ssm_decay", "s6.4", ("T", "Hs"), about="a = exp(Δ·A): the share of the state each token keeps",
                  input=SSM_DT.name)
SSM_STATE = Point("ssm_state", "s6.8", ("Hs", "P", "N"), state=True, about="the state h after this pass: "
                  "h ← a·h + Δ·x⊗B per token; the same size at every step")
SSM_Y = Point("ssm_y", "s6.5", ("T", "Hs", "P"), editable=True, about="each token's read-out, C·h + D·x")
SSM_NORM = Point("ssm_norm", "s6.6", ("T", "I"), about="RMSNorm(y · silu(z))·γ over each group", input=SSM_Y.name)
O_PROJ_SSM = replace(O_PROJ, about="the heads' outputs, normed and gated, times W_out (attention: the heads × Wo)")


def config_part(heads: int, head_dim: int, groups: int, state: int, kernel: int, conv_bias: bool = True,
                dt_limit=(0.0, math.inf)) -> dict:
    """The config's "mamba2" part: the sizes, and the axes the declarations use (ModelConfig.dims)."""
    inner = heads * head_dim
    channels = inner + 2 * groups * state
    lo, hi = (float(v) for v in dt_limit)
    return {"heads": heads, "head_dim": head_dim, "groups": groups, "state": state, "conv_kernel": kernel,
            "conv_bias": bool(conv_bias), "dt_limit": [lo, hi] if math.isfinite(hi) or lo > 0 else None,
            "axes": {"Hs": heads, "P": head_dim, "I": inner, "Gs": groups, "N": state, "Kc": kernel, "Cs": channels,
                     "Ig": inner // groups}}


def ssm_scan(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor,
             D: torch.Tensor, h: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, one token at a time, float32: x (B, T, Hs, P), B and C (B, T, Gs, N), dt and decay
    (B, T, Hs), D (Hs,), h (B, Hs, P, N) -> the read-outs (B, T, Hs, P) and the state after the last token."""
    Bh, Ch = B.repeat_interleave(group, dim=2), C.repeat_interleave(group, dim=2)  # (B, T, Hs, N): head j's group
    ys = []
    for t in range(x.size(1)):
        write = (dt[:, t, :, None] * Bh[:, t])[:, :, None, :] * x[:, t, :, :, None]  # Δ·B ⊗ x, (B, Hs, P, N)
        h = h * decay[:, t, :, None, None] + write  # a·h + Δ·x⊗B
        y = (h @ Ch[:, t, :, :, None]).squeeze(-1)  # h·C, (B, Hs, P)
        ys.append(y + x[:, t] * D[:, None])  # + D·x
    return torch.stack(ys, dim=1), h


class GroupGatedRMSNorm(RMSNorm):
    """RMSNorm(x · silu(z))·γ, normed over each of `groups` groups of the width, in float32, as transformers'
    GraniteMoeHybridRMSNormGated (the gate before the norm)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__(dim, eps, axis="I", step="s6.6")
        self.groups = groups

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(gate.float())  # (B, T, I)
        g = h.view(*h.shape[:-1], self.groups, -1)  # (B, T, Gs, I/Gs)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(x.dtype)


class Mamba2(Module):
    """The Mamba2 mixer (module docstring): its memory is the layer's LayerState in the cache, the state h
    (Hs, P, N) and the convolution's last Kc-1 inputs, updated in place by each pass."""

    WHERE = "attn"
    POINTS = (SSM_Z, SSM_XBC, SSM_DT_RAW, SSM_CONV_STATE, SSM_CONV, SSM_X, SSM_B, SSM_C, SSM_DT, SSM_DECAY, SSM_STATE,
              SSM_Y, SSM_NORM, O_PROJ_SSM)
    CHILDREN = {"norm": ("norm", "ssm_norm")}
    NORMS = {SSM_NORM.name: "norm"}

    def __init__(self, config):
        super().__init__()
        p = config.parts[KEY]
        self.hs, self.hd, self.gs, self.n = p["heads"], p["head_dim"], p["groups"], p["state"]
        self.kc = p["conv_kernel"]
        self.inner = self.hs * self.hd  # I
        self.channels = self.inner + 2 * self.gs * self.n  # Cs
        self.dt_limit = p.get("dt_limit")
        D = config.d_model
        self.w_in = nn.Linear(D, self.inner + self.channels + self.hs, bias=False)  # rows z, then xBC, then dt
        self.conv = nn.Parameter(torch.empty(self.channels, self.kc))  # (Cs, Kc): one kernel per channel
        self.conv_bias = nn.Parameter(torch.empty(self.channels)) if p.get("conv_bias", True) else None
        self.dt_bias = nn.Parameter(torch.empty(self.hs))
        self.A = nn.Parameter(torch.empty(self.hs))  # −exp(A_log): each head's (negative) rate
        self.D = nn.Parameter(torch.empty(self.hs))  # the skip of x
        self.norm = GroupGatedRMSNorm(self.inner, self.gs, config.rms_eps)
        self.w_out = nn.Linear(self.inner, D, bias=False)

    def weights(self) -> tuple[Weight, ...]:
        out = [Weight("w_in.weight", ("I+Cs+Hs", "D"), "s6.1", "matrix",
                      (Source("in_proj.weight", "ssm_in.weight", "I+Cs+Hs", "W_in"),)),
               Weight("conv", ("Cs", "Kc"), "s6.3", "conv",
                      (Source("conv1d.weight", "ssm_conv1d.weight", "Cs", "w_conv", hf_transform=("squeeze1",)),))]
        if self.conv_bias is not None:
            out.append(Weight("conv_bias", ("Cs",), "s6.3", "vector",
                              (Source("conv1d.bias", "ssm_conv1d.bias", "Cs", "b_conv"),)))
        return (*out,
                Weight("dt_bias", ("Hs",), "s6.4", "vector", (Source("dt_bias", "ssm_dt.bias", "Hs", "dt_bias"),)),
                Weight("A", ("Hs",), "s6.4", "vector",
                       (Source("A_log", "ssm_a", "Hs", "A", hf_transform=("neg_exp",)),)),
                Weight("D", ("Hs",), "s6.5", "vector", (Source("D", "ssm_d", "Hs", "D"),)),
                Weight("w_out.weight", ("D", "I"), "s6.6", "matrix",
                       (Source("out_proj.weight", "ssm_out.weight", "D", "W_out"),)))

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        """Each point's operation, in the forward's order; h and the conv inputs are `carried`."""
        I, Cs, hs, gn = self.inner, self.channels, self.hs, self.gs * self.n
        conv_w = ["conv"] + (["conv_bias"] if self.conv_bias is not None else [])
        conv = dict(kernel=self.kc, act="silu", carried=[SSM_CONV_STATE.name])
        reads = [SSM_X.name, SSM_B.name, SSM_C.name, SSM_DT.name, SSM_DECAY.name, SSM_STATE.name]
        scan = dict(group=hs // self.gs, carried=[SSM_STATE.name])
        return {SSM_Z.name: op("matmul", [x], ["w_in.weight"], rows=[0, I]),
                SSM_XBC.name: op("matmul", [x], ["w_in.weight"], rows=[I, I + Cs]),
                SSM_DT_RAW.name: op("matmul", [x], ["w_in.weight"], rows=[I + Cs, I + Cs + hs]),
                SSM_CONV_STATE.name: op("conv1d", [SSM_XBC.name, SSM_CONV_STATE.name], conv_w, output="state", **conv),
                SSM_CONV.name: op("conv1d", [SSM_XBC.name, SSM_CONV_STATE.name], conv_w, output="y", **conv),
                SSM_X.name: op("slice", [SSM_CONV.name], cols=[0, I], split="Hs"),
                SSM_B.name: op("slice", [SSM_CONV.name], cols=[I, I + gn], split="Gs"),
                SSM_C.name: op("slice", [SSM_CONV.name], cols=[I + gn, Cs], split="Gs"),
                SSM_DT.name: op("softplus", [SSM_DT_RAW.name], ["dt_bias"], limit=self.dt_limit),
                SSM_DECAY.name: op("ssm_decay", [SSM_DT.name], ["A"]),
                SSM_STATE.name: op("ssm_scan", reads, ["D"], output="state", **scan),
                SSM_Y.name: op("ssm_scan", reads, ["D"], output="y", **scan),
                SSM_NORM.name: op("group_gated_rmsnorm", [SSM_Y.name, SSM_Z.name], ["norm.weight"], eps=self.norm.eps,
                                  group=I // self.gs),
                O_PROJ.name: op("matmul", [SSM_NORM.name], ["w_out.weight"])}

    # -- the kind, declared (model.kinds) -----------------------------------------------------------------------
    KIND = "mamba2"
    HEADINGS = {
        "summary": ("Mamba2: a fixed-size state per head, no KV cache",
                    "Mamba2：每个头一个固定大小的状态，没有 KV 缓存"),
        "s6.1": ("pre-norm and the input projection: the gate z, x·B·C, the step dt",
                 "预归一化与输入投影：门控 z、x·B·C、步长 dt"),
        "s6.2": ("split into x (per head), B and C (per group)", "拆分：x（按头），B 与 C（按组）"),
        "s6.3": ("causal convolution over the last Kc tokens, SiLU", "因果卷积（最近 Kc 个词元），SiLU"),
        "s6.4": ("the step Δ = softplus(dt + bias) and the decay exp(Δ·A)",
                 "步长 Δ = softplus(dt + 偏置) 与衰减 exp(Δ·A)"),
        "s6.5": ("the selective scan: h ← a·h + Δ·x⊗B, read y = C·h + D·x",
                 "选择性扫描：h ← a·h + Δ·x⊗B，读出 y = C·h + D·x"),
        "s6.6": ("gated group norm with z, output projection + residual",
                 "带 z 门控的分组归一化、输出投影 + 残差"),
        "s6.8": ("the state kept: a fixed size, no KV cache", "保留的状态：大小固定，没有 KV 缓存"),
    }
    EXPLAIN = ("state_update",)  # one state update worked on real numbers (below)

    def explain(self, key: str, cap, model, maths, head: Optional[int]) -> Optional[dict]:
        """explain's section `key` of this layer (one of EXPLAIN), from the pass's capture: one head's state update."""
        y = scan_op(maths, cap.layer, "y")[1]
        weights = {w: model.get_parameter(f"layers.{cap.layer}.{w}").detach() for w in y.weights}
        return scan_section(cap, maths, weights, head if head is not None and head < cap.points[y.inputs[0]].size(1)
                            else 0)
    FLOPS_NOTE = ("the scan grows with T, not T²: each token updates a state of fixed size",
                  "扫描随 T 增长，而不是 T²：每个词元更新一个固定大小的状态")

    def flops(self, n_tokens: int) -> list[tuple]:
        """Over T tokens: the input projection, the convolution, the scan (per token and head: the decay, Δ·x⊗B and
        the add, 3·P·N, then C·h, 2·P·N; linear in T, no T×T square), the output projection."""
        T, D = n_tokens, self.w_out.out_features
        I, Cs, hs, P, N, kc = self.inner, self.channels, self.hs, self.hd, self.n, self.kc
        return [("in", ("z, x·B·C, dt projection", "z、x·B·C、dt 投影"), "2·T·D·(I + Cs + Hs)", 2 * T * D * (I + Cs + hs)),
                ("conv", ("causal convolution", "因果卷积"), "2·T·Cs·Kc", 2 * T * Cs * kc),
                ("scan", ("selective scan (no T×T scores)", "选择性扫描（没有 T×T 分数）"), "5·T·Hs·P·N", 5 * T * hs * P * N),
                ("o", ("output projection", "输出投影"), "2·T·I·D", 2 * T * I * D)]

    def memory(self) -> Memory:
        """s6.8 the layer's memory, without the batch axis: the same size at every step."""
        return Memory("state", constant={"ssm": (self.hs, self.hd, self.n), "conv": (self.channels, self.kc - 1)})

    def forward(self, x: torch.Tensor, io: LayerInput) -> torch.Tensor:
        B, T, _ = x.shape
        if io.padding is not None:  # a pad slot's input is zero, as transformers' apply_mask_to_padding_states
            x = (x * io.padding[:, :, None]).to(x.dtype)
        z, xbc, dt = self.w_in(x).split_with_sizes([self.inner, self.channels, self.hs], dim=-1)
        z = self.point(SSM_Z.name, z)  # (B, T, I)
        xbc = self.point(SSM_XBC.name, xbc)  # (B, T, Cs)
        dt = self.point(SSM_DT_RAW.name, dt)  # (B, T, Hs)
        conv = self.convolve(xbc, io)  # s6.3: (B, T, Cs)
        if io.padding is not None:
            conv = (conv * io.padding[:, :, None]).to(conv.dtype)
        xs, Bm, Cm = conv.split_with_sizes([self.inner, self.gs * self.n, self.gs * self.n], dim=-1)
        xs = self.point(SSM_X.name, xs.reshape(B, T, self.hs, self.hd))  # s6.2: (B, T, Hs, P)
        Bm = self.point(SSM_B.name, Bm.reshape(B, T, self.gs, self.n))  # (B, T, Gs, N)
        Cm = self.point(SSM_C.name, Cm.reshape(B, T, self.gs, self.n))
        dt = F.softplus(dt.float() + self.dt_bias.float())  # s6.4: Δ, (B, T, Hs)
        if self.dt_limit:
            dt = dt.clamp(*self.dt_limit)
        dt = self.point(SSM_DT.name, dt)
        decay = self.point(SSM_DECAY.name, torch.exp(dt * self.A.float()))  # a = exp(Δ·A), (B, T, Hs)
        h = io.cache["ssm"] if io.cache is not None else torch.zeros(B, self.hs, self.hd, self.n, device=x.device)
        y, h = ssm_scan(xs.float(), Bm.float(), Cm.float(), dt, decay, self.D.float(), h, self.hs // self.gs)  # s6.5
        if io.cache is not None:
            io.cache.write("ssm", h)
        self.point(SSM_STATE.name, h)  # (B, Hs, P, N)
        y = self.point(SSM_Y.name, y.to(x.dtype))  # (B, T, Hs, P)
        y = self.point(SSM_NORM.name, self.norm(y.reshape(B, T, self.inner), z))  # s6.6: (B, T, I)
        return self.point(O_PROJ.name, self.w_out(y))  # (B, T, D)

    def convolve(self, xbc: torch.Tensor, io: LayerInput) -> torch.Tensor:
        """s6.3 the causal depthwise convolution over this pass's tokens and the Kc-1 before them (the conv state),
        plus its bias, then silu: (B, T, Cs) -> (B, T, Cs)."""
        B, T, Cs = xbc.shape
        x = xbc.transpose(1, 2)  # (B, Cs, T)
        before = io.cache["conv"] if io.cache is not None else x.new_zeros(B, Cs, self.kc - 1)
        x = torch.cat([before.to(x.dtype), x], dim=-1)  # (B, Cs, Kc-1+T)
        if io.cache is not None:
            io.cache.write("conv", x[:, :, -(self.kc - 1):])
        self.point(SSM_CONV_STATE.name, x[:, :, -(self.kc - 1):])
        y = F.conv1d(x, self.conv.unsqueeze(1), self.conv_bias, groups=Cs)  # (B, Cs, T)
        return self.point(SSM_CONV.name, F.silu(y).transpose(1, 2))  # (B, T, Cs)


# -- its operations (model.maths.OpKind): each formula line with its words, and its float64 evaluator ------------


def _softplus(o, x, w, shape, **_):
    dt = F.softplus(x[0] + w[0])
    lo, hi = o.const("limit") or (0.0, math.inf)
    return dt.clamp(lo, hi)


def _scan(o, x, w, shape, **_):
    """The recurrence from its formula: per head, h (P × N) ← a·h + Δ·x ⊗ B, y = C·h + D·x; head j reads group
    j // (Hs/Gs) of B and C."""
    xs, b, c, dt, a, h = x  # (B, T, Hs, P), (B, T, Gs, N) twice, (B, T, Hs) twice, the carried (B, Hs, P, N) or None
    g = o.const("group")
    b, c = b.repeat_interleave(g, dim=2), c.repeat_interleave(g, dim=2)  # (B, T, Hs, N)
    Bn, T, H, P = xs.shape
    h = torch.zeros(Bn, H, P, b.size(-1), dtype=xs.dtype) if h is None else h
    ys = []
    for t in range(T):
        h = a[:, t, :, None, None] * h + dt[:, t, :, None, None] * xs[:, t, :, :, None] * b[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, c[:, t]) + w[0][:, None] * xs[:, t])
    return h if o.const("output") == "state" else torch.stack(ys, dim=1)


def _scan_line(o, name, x, c, say):
    xs, b, cc, dt, a, state = x
    out = say("ssm_scan_y", name=name, c=cc, x=xs) if c.get("output") == "y" else say("ssm_scan_last")
    return say("ssm_scan", name=name, state=carried_words(c, state, say), a=a, dt=dt, x=xs, b=b, c=cc, out=out,
               g=c.get("group"))


def _group_gated_rmsnorm(o, x, w, shape, **_):
    v = x[0].reshape(*x[0].shape[:2], -1) * F.silu(x[1].reshape(*x[1].shape[:2], -1))  # (B, T, I)
    grouped = v.reshape(*v.shape[:2], -1, o.const("group"))
    y = grouped / torch.sqrt(grouped.pow(2).mean(-1, keepdim=True) + o.const("eps"))
    return y.reshape(v.shape) * w[0]


declare(
    __name__,
    OpKind("softplus", "Δ = softplus(x + dt_bias)",
           lambda o, name, x, c, say: f"{name} = softplus({x[0]} + dt_bias)" + (
               say("softplus_clamp", lo=f"{c['limit'][0]:g}", hi=f"{c['limit'][1]:g}") if c.get("limit") else ""),
           {"softplus_clamp": (", clamped to [{lo}, {hi}]", "，截断到 [{lo}, {hi}]")}, _softplus),
    OpKind("ssm_decay", "a = exp(Δ · A)", lambda o, name, x, c, say: f"{name} = exp({x[0]} · A), A = −exp(A_log) < 0",
           {}, lambda o, x, w, shape, **_: torch.exp(x[0] * w[0])),
    OpKind("ssm_scan", "h ← a·h + Δ·x⊗B;  y = C·h + D·x", _scan_line,
           {"ssm_scan": ("{name}: from h = {state}, for each token h ← {a}·h + {dt}·{x}⊗{b}{out} (head j reads group "
                         "j // {g} of {b} and {c})",
                         "{name}：从 h = {state} 开始，逐个词元 h ← {a}·h + {dt}·{x}⊗{b}{out}（头 j 读取 {b} 与 {c} 的第 "
                         "j // {g} 组）"),
            "ssm_scan_y": ("; {name}_t = {c}·h + D·{x}", "；{name}_t = {c}·h + D·{x}"),
            "ssm_scan_last": ("; the last h", "；取最后的 h")}, _scan),
    OpKind("group_gated_rmsnorm", "y = g / √(mean_group(g²) + ε) · γ,  g = x · silu(z)",
           lambda o, name, x, c, say: say("group_gated_rmsnorm", name=name, eps=f"{c['eps']:g}", group=c["group"],
                                          x=x[0], z=x[1]),
           {"group_gated_rmsnorm": ("{name} = g / √(mean(g²) + {eps}) · γ over each group of {group}, g = {x} · silu({z})",
                                    "{name} = g / √(mean(g²) + {eps}) · γ，每 {group} 个一组分别计算，g = {x} · silu({z})")},
           _group_gated_rmsnorm),
)


# ----------------------------------------------------------------------------------------------------------------
# explain's own section of a Mamba2 layer ("state_update", its EXPLAIN key; run.explain calls Mamba2.explain)

SHOWN_CORNER = 4  # rows and columns of the state shown


def scan_op(maths, layer: int, output: str):
    """The layer's declared Mamba2 scan making `output` ("y" or "state"), and its point; (None, None) if none."""
    return next(((n, o) for n, o in maths.layers[layer].items() if o.kind == "ssm_scan" and o.const("output") ==
                 output), (None, None))


def scan_section(cap, maths, weights: dict, head: Optional[int] = None) -> dict:
    """One Mamba2 state update of head `head` (default 0) at the last prompt token, worked on real numbers and
    checked against the pass's own state and read-out. `weights`: the layer's parameters the declared operation reads
    (its D), by their names in the declaration. The state before the token, h₀, is the declared operation applied to
    the earlier tokens from zeros; then
        a·h₀                  the decay: every entry of the head's state times a = exp(Δ·A)
        Δ·x ⊗ B               the write: the token's x (P) times its group's B (N), scaled by its step Δ
        h = a·h₀ + Δ·x ⊗ B
        y = h·C + D·x         the read-out with its group's C, plus the skip"""
    y_name, o = scan_op(maths, cap.layer, "y")
    state_name, so = scan_op(maths, cap.layer, "state")
    names = o.inputs[:5]  # x, B, C, Δ, a
    p = {n: cap.points[n].double() for n in names}  # (T, ...) each, no batch axis
    x_all, B_all, C_all, dt_all, a_all = (p[n] for n in names)
    T, Hs, P = x_all.shape
    h, g = head or 0, o.const("group")
    grp = h // g
    D = weights[o.weights[0]].double()
    before = torch.zeros(1, Hs, P, B_all.size(-1), dtype=torch.float64)
    if T > 1:  # the state after the earlier tokens: the declared operation on their numbers
        from llmtrace.model.recompute import apply

        before = apply(so, [p[n][None, : T - 1] for n in names] + [None], [D], tuple(before.shape))
    h0 = before[0, h]  # (P, N)
    x, B, C, dt, a = x_all[-1, h], B_all[-1, grp], C_all[-1, grp], dt_all[-1, h], a_all[-1, h]
    decayed = a * h0
    write = dt * torch.outer(x, B)  # (P, N)
    hT = decayed + write
    y = hT @ C + D[h] * x  # (P,)
    recorded_h, recorded_y = cap.points[state_name][h].double(), cap.points[y_name][-1, h].double()
    c, n = SHOWN_CORNER, min(SHOWN_CORNER, B.numel())
    return {
        "event": "explain", "section": "state_update", "layer": cap.layer, "seed_step": "s6.4-s6.8", "head": h,
        "group": grp, "position": T - 1, "point_state": state_name, "point_out": y_name,
        "formula": "h ← a·h + Δ·x ⊗ B;  y = h·C + D·x", "shape_state": list(cap.points[state_name].shape),
        "dt": sig6(dt), "a": sig6(a), "D": sig6(D[h]), "x": sig6_rows(x[:c]), "B": sig6_rows(B[:n]), "C": sig6_rows(C[:n]),
        "h_before": sig6_rows(h0[:c, :n]), "h_decayed": sig6_rows(decayed[:c, :n]), "write": sig6_rows(write[:c, :n]),
        "h_after": sig6_rows(hT[:c, :n]), "read": sig6_rows((hT @ C)[:c]), "skip": sig6_rows((D[h] * x)[:c]), "out": sig6_rows(y[:c]),
        "check_state_max_abs_diff": sig6((hT - recorded_h).abs().max()),
        "check_out_max_abs_diff": sig6((y - recorded_y).abs().max()),
        "dt_all": sig6_rows(dt_all[:, h]), "a_all": sig6_rows(a_all[:, h]),
    }
