"""Qwen3.5 (dense): three layers of every four are linear attention (Gated DeltaNet), whose memory is a fixed-size
state updated by the delta rule instead of keys and values that grow with every token; every fourth layer is full
attention with an output gate. As transformers' Qwen3_5ForCausalLM computes it (modeling_qwen3_5.py):

  a linear-attention layer (GatedDeltaNet), for each token t, per value head (Hv of them, each reading key head
  j // (Hv/Hk), or j % Hk in a GGUF's "tiled" order), in float32:
    [q k v] = silu(causal_conv1d(x W_qkv))   a depthwise convolution over the last Kc tokens (s6.3: the only place
                                              a linear layer sees order; it has no RoPE); the Kc-1 inputs before
                                              this pass are its conv state
    q, k    = q / ‖q‖, k / ‖k‖ (L2, eps 1e-6), then q / √Dk
    β       = sigmoid(x W_b)                  how strongly this token writes
    α       = exp(A · softplus(x W_a + dt_bias)),  A = -exp(A_log)     how much of the state it keeps
    S       ← α·S;  S ← S + k ⊗ β(v − Sᵀk)    the delta rule: write v at k, less what S already holds there
    o       = Sᵀq                             the state read with the query (S: Dk × Dv per value head)
    y       = RMSNorm(o)·γ · silu(x W_z)      the gated norm (γ as stored, not 1 + γ), per value head
    out     = y W_out
  (transformers' `torch_recurrent_gated_delta_rule`, in its order; its chunked form is not used here);
  a full-attention layer: Qwen3's (q/k RMSNorm per head before RoPE) with RoPE on the first 25% of each head's dims
  and an output gate: q_proj gives each head Dh query dims then Dh gate dims, and the heads' output is multiplied by
  sigmoid(gate) before o_proj;
  every RMSNorm but the gated one scales by 1 + w (an HF file stores w; llama.cpp's converter stores 1 + w).

The state lives in the KV cache the caller passes (model.transformer.LayerState: the delta rule's S, Hv × Dk × Dv,
and the convolution's last Kc-1 inputs, C × (Kc-1)), so a decode step goes on from where the prefill left it.

From GGUF (arch qwen35, llama.cpp's converter, `--no-mtp` for a checkpoint without its MTP layers): ssm_a holds
A = -exp(A_log) itself, the layer pattern is full_attention_interval, and with Hv > Hk the value heads are stored
in "tiled" order (value head j reads key head j % Hk); the model reads them in that order rather than moving rows.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family, say
from llmtrace.model.families.gemma2 import GemmaRMSNorm
from llmtrace.model.families.qwen3 import K_NORM, Q_NORM
from llmtrace.model.llama_points import ATTN_OUT, K, O_PROJ, Q, V
from llmtrace.model.maths import LayerPlan, Op, OpKind, carried_words, declare, op
from llmtrace.model.memory import Memory
from llmtrace.model.hybrid import HybridBlock
from llmtrace.model.points import Point, Source, Weight, inserted
from llmtrace.model.recompute import per_value_head
from llmtrace.model.transformer import Attention, Block, LayerInput, Module, RMSNorm, Transformer

EPS_L2 = 1e-6  # transformers' l2norm (as the FLA kernels)

# a full-attention layer's output gate
ATTN_GATE = Point("attn_gate", "s6.1/s6.2", ("T", "H", "Dh"), about="the gate: each head's second Dh rows of Wq")
ATTN_GATED = Point("attn_gated", "s6.6", ("T", "H", "Dh"), editable=True,
                   about="each head's P·V × sigmoid(gate), before Wo", input=ATTN_OUT.name)

# a linear-attention layer (Gated DeltaNet)
DELTA_QKV = Point("delta_qkv", "s6.1", ("T", "C"), about="X·W_qkv: q, k and v before the convolution")
DELTA_Z = Point("delta_z", "s6.1", ("T", "Hv", "Dv"), about="X·W_z: the output gate of each value head")
DELTA_B = Point("delta_b", "s6.1", ("T", "Hv"), about="X·W_b: the write strength's logit")
DELTA_A = Point("delta_a", "s6.1", ("T", "Hv"), about="X·W_a: the decay's input")
DELTA_CONV = Point("delta_conv", "s6.3", ("T", "C"), about="silu(causal conv1d over the last Kc tokens): where a "
                   "linear layer sees order (no RoPE)", input=DELTA_QKV.name)
DELTA_Q = Point("delta_q", "s6.2", ("T", "Hk", "Dk"), about="queries L2-normalized, ÷ √Dk")
DELTA_K = Point("delta_k", "s6.2", ("T", "Hk", "Dk"), about="keys L2-normalized")
DELTA_V = Point("delta_v", "s6.2", ("T", "Hv", "Dv"), about="values")
DELTA_BETA = Point("delta_beta", "s6.4", ("T", "Hv"), about="β = sigmoid(b): how strongly each token writes",
                   input=DELTA_B.name)
DELTA_DECAY = Point("delta_decay", "s6.4", ("T", "Hv"), about="α = exp(A·softplus(a + dt_bias)): the share of the "
                    "state each token keeps", input=DELTA_A.name)
DELTA_OUT = Point("delta_out", "s6.5", ("T", "Hv", "Dv"), editable=True, about="each token's state read with its "
                  "query, Sᵀq")
DELTA_STATE = Point("delta_state", "s6.8", ("Hv", "Dk", "Dv"), state=True, editable=True,
                    about="the state S after this pass: S ← α·S + k⊗β(v − Sᵀk) per token; the same size at every step "
                          "(editable: the next pass reads the value a hook returns)")
CONV_STATE = Point("conv_state", "s6.8", ("C", "Kc-1"), state=True, editable=True,
                   about="the convolution's last Kc-1 inputs after this pass (editable: the next pass reads them)")
DELTA_NORM = Point("delta_norm", "s6.6", ("T", "Hv", "Dv"), about="RMSNorm(Sᵀq)·γ · silu(z), per value head",
                   input=DELTA_OUT.name)
O_PROJ_LINEAR = replace(O_PROJ, about="the value heads concatenated, times W_out (attention: the heads, times Wo)")


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / √(Σx² + eps) over the last axis, as transformers' l2norm computes it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + EPS_L2)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time, in transformers' order (torch_recurrent_gated_delta_rule), float32:
    q, k (B, Hv, T, Dk) normalized (q ÷ √Dk), v (B, Hv, T, Dv), g and beta (B, Hv, T), state (B, Hv, Dk, Dv) ->
    the outputs (B, Hv, T, Dv) and the state after the last token."""
    out = torch.zeros_like(v)
    for t in range(q.size(2)):
        state = state * g[:, :, t].exp()[..., None, None]  # α·S
        kv_mem = (state * k[:, :, t].unsqueeze(-1)).sum(dim=-2)  # Sᵀk: what S holds at k, (B, Hv, Dv)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t].unsqueeze(-1)  # β(v − Sᵀk)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)  # + k ⊗ β(v − Sᵀk)
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)  # Sᵀq
    return out, state


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x)·γ · silu(gate), in float32 as transformers' Qwen3_5RMSNormGated; γ as stored."""

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(Module):
    """Linear attention with the gated delta rule (module docstring): its memory is the layer's LayerState in the
    cache, S (Hv, Dk, Dv) and the convolution's last Kc-1 inputs, updated in place by each pass."""

    WHERE = "attn"
    POINTS = (DELTA_QKV, DELTA_Z, DELTA_B, DELTA_A, CONV_STATE, DELTA_CONV, DELTA_Q, DELTA_K, DELTA_V, DELTA_BETA,
              DELTA_DECAY, DELTA_STATE, DELTA_OUT, DELTA_NORM, O_PROJ_LINEAR)
    CHILDREN = {"norm": ("norm", "ssm_norm")}
    NORMS = {DELTA_NORM.name: "norm"}

    def __init__(self, config):
        super().__init__()
        la = config.parts[PART]  # its own config part (ModelConfig.parts)
        self.hk, self.hv, self.dk, self.dv, self.kc = (la["k_heads"], la["v_heads"], la["k_dim"], la["v_dim"],
                                                       la["conv_kernel"])
        self.tiled = la.get("v_order") == "tiled"
        self.channels = 2 * self.hk * self.dk + self.hv * self.dv  # C
        D = config.d_model
        # W_qkv, W_z, W_b, W_a as one matrix (one matmul): rows C, then Hv·Dv, Hv, Hv
        self.w_in = nn.Linear(D, self.channels + self.hv * self.dv + 2 * self.hv, bias=False)
        self.conv = nn.Parameter(torch.empty(self.channels, self.kc))  # (C, Kc): one kernel per channel
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A = nn.Parameter(torch.empty(self.hv))  # -exp(A_log): each head's (negative) decay rate
        self.norm = GatedRMSNorm(self.dv, config.rms_eps, axis="Dv", step="s6.6")
        self.w_out = nn.Linear(self.hv * self.dv, D, bias=False)

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("w_in.weight", ("C+Hv*Dv+2*Hv", "D"), "s6.1", "matrix", (
                    Source("in_proj_qkv.weight", "attn_qkv.weight", "C", "W_qkv"),
                    Source("in_proj_z.weight", "attn_gate.weight", "Hv*Dv", "W_z"),
                    Source("in_proj_b.weight", "ssm_beta.weight", "Hv", "W_b"),
                    Source("in_proj_a.weight", "ssm_alpha.weight", "Hv", "W_a"))),
                Weight("conv", ("C", "Kc"),
                       "s6.3", "conv", (Source("conv1d.weight", "ssm_conv1d.weight", "C", "w_conv", hf_transform=("squeeze1",)),)),
                Weight("dt_bias", ("Hv",), "s6.4", "vector", (Source("dt_bias", "ssm_dt.bias", "Hv", "dt_bias"),)),
                Weight("A", ("Hv",), "s6.4", "vector", (Source("A_log", "ssm_a", "Hv", "A", hf_transform=("neg_exp",)),)),
                Weight("w_out.weight", ("D", "Hv*Dv"), "s6.6", "matrix",
                       (Source("out_proj.weight", "ssm_out.weight", "D", "W_out"),)))

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        """Each point's operation (model.maths), in the forward's order; S and the conv inputs are `carried`."""
        C, hv, dv, hk, dk = self.channels, self.hv, self.dv, self.hk, self.dk
        z_end = C + hv * dv
        conv = dict(kernel=self.kc, act="silu", carried=[CONV_STATE.name])
        delta = dict(group=hv // hk, v_order="tiled" if self.tiled else "grouped", carried=[DELTA_STATE.name])
        reads = [DELTA_Q.name, DELTA_K.name, DELTA_V.name, DELTA_DECAY.name, DELTA_BETA.name, DELTA_STATE.name]
        return {DELTA_QKV.name: op("matmul", [x], ["w_in.weight"], rows=[0, C]),
                DELTA_Z.name: op("matmul", [x], ["w_in.weight"], rows=[C, z_end], split="Hv"),
                DELTA_B.name: op("matmul", [x], ["w_in.weight"], rows=[z_end, z_end + hv]),
                DELTA_A.name: op("matmul", [x], ["w_in.weight"], rows=[z_end + hv, z_end + 2 * hv]),
                CONV_STATE.name: op("conv1d", [DELTA_QKV.name, CONV_STATE.name], ["conv"], output="state", **conv),
                DELTA_CONV.name: op("conv1d", [DELTA_QKV.name, CONV_STATE.name], ["conv"], output="y", **conv),
                DELTA_Q.name: op("l2norm", [DELTA_CONV.name], cols=[0, hk * dk], split="Hk", eps=EPS_L2,
                                 scale=1 / math.sqrt(dk), scale_label="1/√Dk"),
                DELTA_K.name: op("l2norm", [DELTA_CONV.name], cols=[hk * dk, 2 * hk * dk], split="Hk", eps=EPS_L2,
                                 scale=1.0, scale_label="1"),
                DELTA_V.name: op("slice", [DELTA_CONV.name], cols=[2 * hk * dk, C], split="Hv"),
                DELTA_BETA.name: op("sigmoid", [DELTA_B.name]),
                DELTA_DECAY.name: op("decay", [DELTA_A.name], ["A", "dt_bias"]),
                DELTA_STATE.name: op("delta_rule", reads, output="state", **delta),
                DELTA_OUT.name: op("delta_rule", reads, output="o", **delta),
                DELTA_NORM.name: op("gated_rmsnorm", [DELTA_OUT.name, DELTA_Z.name], ["norm.weight"],
                                    eps=self.norm.eps, gamma="w", over="Dv"),
                O_PROJ.name: op("matmul", [DELTA_NORM.name], ["w_out.weight"], merge="Hv")}

    # -- the kind, declared (model.kinds) -----------------------------------------------------------------------
    KIND = "linear_attention"
    HEADS = (DELTA_NORM.name, "w_out")  # its output splits by value head: the norm works within each head
    HEAD_KIND = "linear_head"
    HEADINGS = {
        "summary": ("linear attention: a fixed-size state, no KV cache", "线性注意力：固定大小的状态，没有 KV 缓存"),
        "s6.1": ("pre-norm and projections: q, k, v, the gate z, β's and α's inputs",
                 "预归一化与投影：q、k、v，门控 z，β 与 α 的输入"),
        "s6.2": ("split into heads; q and k L2-normalized", "拆分成头；q 与 k 做 L2 归一化"),
        "s6.3": ("causal convolution over the last Kc tokens", "因果卷积：覆盖最近 Kc 个词元"),
        "s6.4": ("decay α and write strength β", "衰减 α 与写入强度 β"),
        "s6.5": ("the delta rule: update the state, read it with q", "delta 规则：更新状态，再用 q 读出"),
        "s6.6": ("gated norm, output projection + residual", "门控归一化、输出投影 + 残差"),
        "s6.8": ("the state kept: a fixed size, no KV cache", "保留的状态：大小固定，没有 KV 缓存"),
    }
    EXPLAIN = ("delta_rule",)
    # the points explain's delta-rule section works on: the output read from the state, and the state it leaves
    RECURRENCE = {"o": DELTA_OUT.name, "state": DELTA_STATE.name}
    FLOPS_NOTE = ("the delta rule grows with T, not T²: each token updates a state of fixed size",
                  "delta 规则随 T 增长，而不是 T²：每个词元更新一个固定大小的状态")

    def flops(self, n_tokens: int) -> list[tuple]:
        """Over T tokens: the projections, the convolution, the delta rule (per token and value head: decay Dk·Dv,
        Sᵀk, the write and Sᵀq, ~7·Dk·Dv; linear in T, no T×T square), the output projection."""
        T, D = n_tokens, self.w_out.out_features
        hv, hk, dk, dv, kc, C = self.hv, self.hk, self.dk, self.dv, self.kc, self.channels
        return [("in", ("q, k, v, z, b, a projections", "q、k、v、z、b、a 投影"),
                 "2·T·D·(C + Hv·Dv + 2·Hv)", 2 * T * D * (C + hv * dv + 2 * hv)),
                ("conv", ("causal convolution", "因果卷积"), "2·T·C·Kc", 2 * T * C * kc),
                ("delta", ("delta rule (no T×T scores)", "delta 规则（没有 T×T 分数）"), "7·T·Hv·Dk·Dv", 7 * T * hv * dk * dv),
                ("o", ("output projection", "输出投影"), "2·T·Hv·Dv·D", 2 * T * hv * dv * D)]

    def memory(self) -> Memory:
        """s6.8 the layer's memory, without the batch axis: the same size at every step."""
        return Memory("state", constant={"state": (self.hv, self.dk, self.dv), "conv": (self.channels, self.kc - 1)})

    def forward(self, x: torch.Tensor, io: LayerInput) -> torch.Tensor:
        B, T, _ = x.shape
        if io.padding is not None:  # a pad slot's input is zero, as transformers' apply_mask_to_padding_states
            x = (x * io.padding[:, :, None]).to(x.dtype)
        hv, dv = self.hv, self.dv
        qkv, z, b, a = self.w_in(x).split_with_sizes([self.channels, hv * dv, hv, hv], dim=-1)
        qkv = self.point(DELTA_QKV.name, qkv)  # (B, T, C)
        z = self.point(DELTA_Z.name, z.reshape(B, T, hv, dv))
        b, a = self.point(DELTA_B.name, b), self.point(DELTA_A.name, a)  # (B, T, Hv) each
        q, k, v = self.convolve(qkv, io)  # s6.3 then s6.2: (B, T, Hk, Dk) twice, (B, T, Hv, Dv)
        beta = self.point(DELTA_BETA.name, b.sigmoid())  # (B, T, Hv)
        g = self.A.float() * F.softplus(a.float() + self.dt_bias)  # log α, (B, T, Hv)
        if self.hook is not None:
            self.point(DELTA_DECAY.name, g.exp())
        state = io.cache["state"] if io.cache is not None else torch.zeros(B, hv, self.dk, dv, device=x.device)
        if x.requires_grad and io.cache is not None:  # a graph keeps the state it read; the cache's is written below
            state = state.clone()
        q, k = (self.per_value_head(t).transpose(1, 2).float() for t in (q, k))  # (B, Hv, T, Dk)
        o, state = delta_rule(q, k, v.transpose(1, 2).float(), g.transpose(1, 2), beta.transpose(1, 2).float(), state)
        state = self.point(DELTA_STATE.name, state)  # (B, Hv, Dk, Dv): a hook may replace what the next pass reads
        if io.cache is not None:
            io.cache.write("state", state)
        o = self.point(DELTA_OUT.name, o.transpose(1, 2).to(x.dtype))  # (B, T, Hv, Dv)
        y = self.point(DELTA_NORM.name, self.norm(o, z))  # (B, T, Hv, Dv)
        return self.point(O_PROJ.name, self.w_out(y.reshape(B, T, hv * dv)))  # (B, T, D)

    def convolve(self, qkv: torch.Tensor, io: LayerInput):
        """s6.3 the causal depthwise convolution over this pass's tokens and the Kc-1 before them (the conv state),
        silu; s6.2 split into q, k, v heads, q and k L2-normalized (q ÷ √Dk)."""
        B, T, C = qkv.shape
        x = qkv.transpose(1, 2)  # (B, C, T)
        before = io.cache["conv"] if io.cache is not None else x.new_zeros(B, C, self.kc - 1)
        x = torch.cat([before.to(x.dtype), x], dim=-1)  # (B, C, Kc-1+T)
        tail = self.point(CONV_STATE.name, x[:, :, -(self.kc - 1):])  # (B, C, Kc-1): what the next pass reads
        if io.cache is not None:
            io.cache.write("conv", tail)
        y = F.silu(F.conv1d(x, self.conv.unsqueeze(1), groups=C)).transpose(1, 2)  # (B, T, C)
        y = self.point(DELTA_CONV.name, y)
        q, k, v = y.split_with_sizes([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q = self.point(DELTA_Q.name, l2norm(q.reshape(B, T, self.hk, self.dk).float()) / math.sqrt(self.dk))
        k = self.point(DELTA_K.name, l2norm(k.reshape(B, T, self.hk, self.dk).float()))
        v = self.point(DELTA_V.name, v.reshape(B, T, self.hv, self.dv))
        return q, k, v

    def per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, Hk, Dk) -> (B, T, Hv, Dk): each value head's key head (HF's grouped order, or a GGUF's tiled)."""
        r = self.hv // self.hk
        if r == 1:
            return x
        return x.repeat(1, 1, r, 1) if self.tiled else x.repeat_interleave(r, dim=2)


# ----------------------------------------------------------------------------------------------------------------
# linear attention's operations (model.maths.OpKind): each formula line with its words, and its float64 evaluator


def _columns(o, x, shape):
    a, b = o.const("cols")
    return x[0][..., a:b].reshape(shape)


def _l2norm(o, x, w, shape, **_):
    v = _columns(o, x, shape)
    return v / torch.sqrt((v * v).sum(-1, keepdim=True) + o.const("eps")) * o.const("scale")


def _l2norm_line(o, name, x, c, say):
    scale = f" · {c['scale']:.4g} ({c['scale_label']})" if c.get("scale", 1) != 1 else ""
    return (f"{name} = v / √(Σv² + {c['eps']:g}){scale}"
            + say("l2norm_of", x=x[0], a=c["cols"][0], b=c["cols"][1], split=c["split"]))


def _decay(o, x, w, shape, **_):
    return torch.exp(w[0] * F.softplus(x[0] + w[1]))


def _delta_rule_eval(o, x, w, shape, **_):
    q, k, v, alpha, beta, state = x  # (B, T, Hk, Dk) twice, (B, T, Hv, Dv), (B, T, Hv) twice, carried S or None
    g, order = o.const("group"), o.const("v_order")
    q, k = per_value_head(q, g, order), per_value_head(k, g, order)
    B, T, Hv, Dv = v.shape
    S = torch.zeros(B, Hv, q.size(-1), Dv, dtype=v.dtype) if state is None else state
    out = []
    for t in range(T):
        S = alpha[:, t, :, None, None] * S
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return S if o.const("output") == "state" else torch.stack(out, dim=1)


def _delta_rule_line(o, name, x, c, say):
    q, k, v, alpha, beta, state = x
    reads = "j mod Hk" if c.get("v_order") == "tiled" else f"j // {c.get('group')}"
    out = say("delta_out", name=name, q=q) if c.get("output") == "o" else say("delta_last")
    return say("delta_rule", name=name, state=carried_words(c, state, say), alpha=alpha, k=k, beta=beta, v=v,
               out=out, reads=reads)


def _gated_rmsnorm(o, x, w, shape, **_):
    h, z = x
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + o.const("eps")) * w[0] * F.silu(z)


declare(
    __name__,
    OpKind("l2norm", "y = x / √(Σx² + ε) · c", _l2norm_line,
           {"l2norm_of": (", v = {x}[{a}:{b}] per {split} head", "，v = {x}[{a}:{b}]，每个 {split} 头各自计算")},
           _l2norm),
    OpKind("sigmoid", "y = σ(x)", lambda o, name, x, c, say: f"{name} = σ({x[0]})", {},
           lambda o, x, w, shape, **_: torch.sigmoid(x[0])),
    OpKind("decay", "α = exp(A · softplus(x + dt_bias))",
           lambda o, name, x, c, say: f"{name} = exp(A · softplus({x[0]} + dt_bias)), A = −exp(A_log) < 0", {}, _decay),
    OpKind("delta_rule", "S ← α·S + k⊗β(v − Sᵀk);  o = Sᵀq", _delta_rule_line,
           {"delta_rule": ("{name}: from S = {state}, for each token S ← {alpha}·S + {k} ⊗ {beta}·({v} − "
                           "({alpha}·S)ᵀ{k}){out} (value head j reads key head {reads})",
                           "{name}：从 S = {state} 开始，逐个词元 S ← {alpha}·S + {k} ⊗ {beta}·({v} − "
                           "({alpha}·S)ᵀ{k}){out}（值头 j 读取键头 {reads}）"),
            "delta_out": ("; {name}_t = Sᵀ{q}", "；{name}_t = Sᵀ{q}"),
            "delta_last": ("; the last S", "；取最后的 S")}, _delta_rule_eval),
    OpKind("gated_rmsnorm", "y = x / √(mean(x²) + ε) · γ · silu(z)",
           lambda o, name, x, c, say: say("gated_rmsnorm", name=name, x=x[0], z=x[1], eps=f"{c['eps']:g}"),
           {"gated_rmsnorm": ("{name} = {x} / √(mean({x}²) + {eps}) · γ · silu({z}), per head (γ = w)",
                              "{name} = {x} / √(mean({x}²) + {eps}) · γ · silu({z})，按头计算（γ = w）")},
           _gated_rmsnorm),
    OpKind("gate", "y = x · σ(g)", lambda o, name, x, c, say: f"{name} = {x[0]} · σ({x[1]})", {},
           lambda o, x, w, shape, **_: x[0] * torch.sigmoid(x[1])),
)


class Qwen35Attention(Attention):
    """Qwen3's attention (q/k RMSNorm per head, as 1 + w) with an output gate: Wq's rows are, for each head, Dh query
    rows then Dh gate rows; the heads' output × sigmoid(gate) goes into Wo. RoPE is partial (the config's
    rotary_dim)."""

    POINTS = inserted(inserted(Attention.POINTS, V.name, ATTN_GATE, Q_NORM, K_NORM), ATTN_OUT.name, ATTN_GATED)
    CHILDREN = {"q_norm": ("q_norm", "attn_q_norm"), "k_norm": ("k_norm", "attn_k_norm")}
    NORMS = {Q_NORM.name: "q_norm", K_NORM.name: "k_norm"}
    ROTATED = (Q_NORM.name, K_NORM.name)
    HEADS = (ATTN_GATED.name, "wo")  # the gated heads are what Wo reads

    def __init__(self, config):
        super().__init__(config)
        H, Hkv, Dh = config.n_heads, config.n_kv_heads, config.head_dim
        self.wqkv = nn.Linear(config.d_model, 2 * H * Dh + 2 * Hkv * Dh, bias=False)  # [q|gate per head], k, v
        self.q_norm = GemmaRMSNorm(Dh, config.rms_eps, axis="Dh", step="s6.2")
        self.k_norm = GemmaRMSNorm(Dh, config.rms_eps, axis="Dh", step="s6.2")

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("wqkv.weight", ("2*H*Dh+2*Hkv*Dh", "D"), "s6.1", "matrix", (
                    Source("q_proj.weight", "attn_q.weight", "2*H*Dh", "Wq|Wgate"),
                    Source("k_proj.weight", "attn_k.weight", "Hkv*Dh", "Wk"),
                    Source("v_proj.weight", "attn_v.weight", "Hkv*Dh", "Wv"))),
                Weight("wo.weight", ("D", "H*Dh"), "s6.6", "matrix",
                       (Source("o_proj.weight", "attn_output.weight", "D", "Wo"),)))

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        """Llama's attention with the gate's rows taken out of Wq, the per-head norms, and the gate before Wo."""
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        q_end, k_end = 2 * H * Dh, (2 * H + Hkv) * Dh
        w = ["wqkv.weight"]
        return super().maths(x, plan) | {
            Q.name: op("matmul", [x], w, rows=[0, q_end], blocks=[2, 0], split="H"),
            ATTN_GATE.name: op("matmul", [x], w, rows=[0, q_end], blocks=[2, 1], split="H"),
            K.name: op("matmul", [x], w, rows=[q_end, k_end], split="Hkv"),
            V.name: op("matmul", [x], w, rows=[k_end, k_end + Hkv * Dh], split="Hkv"),
            Q_NORM.name: self.q_norm.op(Q.name, "q_norm."), K_NORM.name: self.k_norm.op(K.name, "k_norm."),
            ATTN_GATED.name: op("gate", [ATTN_OUT.name, ATTN_GATE.name], act="sigmoid"),
            O_PROJ.name: op("matmul", [ATTN_GATED.name], ["wo.weight"], merge="H")}

    def forward(self, x: torch.Tensor, io: LayerInput) -> torch.Tensor:
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        qk, v, gate = self.project_gated(x)  # s6.1, s6.2
        q, k = self.rotate(qk, io.cos, io.sin)  # s6.3
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if io.cache is not None:  # s6.8
            k, v = io.cache.update(io.start, k, v)
            if self.hook is not None:
                self.point("kv_write", torch.arange(io.start, io.start + T))
        y = self.point(ATTN_OUT.name, self.attend(q, k, v, io.mask).transpose(1, 2))  # (B, T, H, Dh)
        y = self.point(ATTN_GATED.name, y * torch.sigmoid(gate))  # s6.6: the output gate
        return self.point(O_PROJ.name, self.wo(y.reshape(B, T, H * Dh)))  # (B, T, D)

    def project_gated(self, x: torch.Tensor):
        """s6.1, s6.2: q and the gate from each head's 2·Dh rows of Wq; k, v; q and k normed per head:
        (B, T, H+Hkv, Dh), (B, T, Hkv, Dh), gate (B, T, H, Dh)."""
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        qg, k, v = self.wqkv(x).split_with_sizes([2 * H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        q, gate = qg.view(B, T, H, 2 * Dh).chunk(2, dim=-1)  # (B, T, H, Dh) each
        k, v = k.view(B, T, Hkv, Dh), v.view(B, T, Hkv, Dh)
        if self.hook is not None:  # a hook may replace q, k, v
            q, k, v = self.point(Q.name, q), self.point(K.name, k), self.point(V.name, v)
            self.point(ATTN_GATE.name, gate)
        q = self.point(Q_NORM.name, self.q_norm(q))
        k = self.point(K_NORM.name, self.k_norm(k))
        return torch.cat([q, k], dim=2), v, gate


class Qwen35Block(HybridBlock):
    """Llama's block with (1 + w) norms; its mixer is linear attention in the config's "linear" layers (its tensors
    under linear_attn. in an HF file)."""

    attention = Qwen35Attention
    mixers = {"linear": GatedDeltaNet}
    MIXER_KEYS = {"linear": ("linear_attn", "")}
    CHILDREN = {**Block.CHILDREN, "ffn_norm": ("post_attention_layernorm", "post_attention_norm")}

    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        self.attn_norm = GemmaRMSNorm(config.d_model, config.rms_eps)
        self.ffn_norm = GemmaRMSNorm(config.d_model, config.rms_eps, step="s6.7")


class Qwen35(Transformer):
    block = Qwen35Block

    def __init__(self, config):
        super().__init__(config)
        self.norm = GemmaRMSNorm(config.d_model, config.rms_eps, step="s8")


# ----------------------------------------------------------------------------------------------------------------
# reading a config


def refuse(field: str, value, why: str) -> LlmtraceError:
    return LlmtraceError(f"{field} {value!r} is not supported: {why}")


PART = "linear_attention"  # the config part of its linear-attention layers (ModelConfig.parts)

LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}


def _linear_sizes(k_heads, v_heads, k_dim, v_dim, kernel, field: str) -> dict:
    sizes = dict(k_heads=int(k_heads), v_heads=int(v_heads), k_dim=int(k_dim), v_dim=int(v_dim), conv_kernel=int(kernel))
    if min(sizes.values()) < 1 or sizes["v_heads"] % sizes["k_heads"] or sizes["conv_kernel"] < 2:
        raise refuse(field, sizes, "linear attention needs value heads a multiple of key heads and a kernel of 2 or more")
    return sizes


def _rotary(head_dim: int, factor, field: str) -> Optional[int]:
    dr = int(head_dim * float(factor))
    if dr < 2 or dr % 2 or dr > head_dim:
        raise refuse(field, factor, f"RoPE needs an even number of dims from 2 to the head width {head_dim}")
    return dr if dr < head_dim else None


def hf_config(cfg: dict) -> dict:
    if cfg.get("attention_bias"):
        raise refuse("attention_bias", True, "no released Qwen3.5 has biases on q, k, v and o")
    rope = cfg.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default" or cfg.get("rope_scaling"):
        raise refuse("rope_parameters.rope_type", kind, "llmtrace runs Qwen3.5's default RoPE")
    n = int(cfg["num_hidden_layers"])
    every = int(cfg.get("full_attention_interval") or 4)
    types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown or len(types) != n:
        raise refuse("layer_types", unknown[0] if unknown else f"{len(types)} entries",
                     f"Qwen3.5 has {n} layers, each linear_attention or full_attention")
    head_dim = int(cfg.get("head_dim") or 256)
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    linear = _linear_sizes(cfg.get("linear_num_key_heads", 16), cfg.get("linear_num_value_heads", 32),
                           cfg.get("linear_key_head_dim", 128), cfg.get("linear_value_head_dim", 128),
                           cfg.get("linear_conv_kernel_dim", 4), "linear attention sizes")
    return dict(head_dim=head_dim, rotary_dim=_rotary(head_dim, factor, "partial_rotary_factor"),
                layer_types=[LAYER_TYPES[t] for t in types], rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                ffn_act="silu", parts=_part(linear, "grouped"), attn_bias=False)


def _part(linear: dict, v_order: str) -> dict:
    """The config part of a linear-attention layer: its sizes, the order its value heads read the key heads in
    ("grouped": value head j reads key head j // (Hv/Hk), HF's order; "tiled": j % Hk, the order llama.cpp's converter
    writes), and the axes its points and weights are declared in."""
    hk, hv, dk, dv = linear["k_heads"], linear["v_heads"], linear["k_dim"], linear["v_dim"]
    axes = dict(Hk=hk, Hv=hv, Dk=dk, Dv=dv, Kc=linear["conv_kernel"], C=2 * hk * dk + hv * dv)
    return {PART: {**linear, "v_order": v_order, "axes": axes}}


def gguf_config(meta) -> dict:
    n = int(meta("block_count"))
    every = int(meta("full_attention_interval") or 4)
    need = {k: meta(k) for k in ("ssm.group_count", "ssm.time_step_rank", "ssm.state_size", "ssm.inner_size",
                                 "ssm.conv_kernel")}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise LlmtraceError(f"GGUF metadata lacks qwen35.{missing[0]}, which linear attention needs")
    v_heads = int(need["ssm.time_step_rank"])
    linear = _linear_sizes(need["ssm.group_count"], v_heads, need["ssm.state_size"],
                           int(need["ssm.inner_size"]) // v_heads, need["ssm.conv_kernel"], "qwen35.ssm")
    d, h = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length") or d // h)
    dr = int(meta("rope.dimension_count") or head_dim)
    return dict(head_dim=head_dim, rotary_dim=_rotary(head_dim, dr / head_dim, "qwen35.rope.dimension_count"),
                layer_types=["linear" if (i + 1) % every else "full" for i in range(n)],
                parts=_part(linear, "tiled"))


def changes(c) -> list[str]:
    la = c.parts.get(PART, {})
    kinds = c.layer_types or []
    n_linear = sum(t == "linear" for t in kinds)
    state = la.get("v_heads", 0) * la.get("k_dim", 0) * la.get("v_dim", 0)
    out = [say(WORDS, "linear", k=n_linear, n=c.n_layers, h=la.get("v_heads"), dk=la.get("k_dim"), dv=la.get("v_dim"),
               state=f"{state:,}"),
           say(WORDS, "linear_parts", kernel=la.get("conv_kernel")),
           say(WORDS, "gated_attention", k=c.n_layers - n_linear, dh=c.head_dim)]
    if c.rotary_dim:
        out.append(say(WORDS, "partial", dr=c.rotary_dim, dh=c.head_dim))
    out.append(say(WORDS, "norm_1w"))
    if (c.extra or {}).get("text_model_of"):
        out.append(say(WORDS, "text_model", of=c.extra["text_model_of"]))
    if la.get("v_order") == "tiled" and la.get("v_heads") != la.get("k_heads"):
        out.append(say(WORDS, "tiled", k=la.get("k_heads")))
    return out


# What Qwen3.5 changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "linear": ("{k} of {n} layers are linear attention (Gated DeltaNet): a state S of {h} × {dk} × {dv} = {state} "
               "numbers per layer, updated by the delta rule S ← α·S + k⊗β(v − Sᵀk), in place of a KV cache that grows "
               "with every token",
               "{n} 层中有 {k} 层是线性注意力（Gated DeltaNet）：每层一个 {h} × {dk} × {dv} = {state} 个数的状态 S，"
               "按 delta 规则 S ← α·S + k⊗β(v − Sᵀk) 更新，代替随每个词元增长的 KV 缓存"),
    "linear_parts": ("linear layers: a causal convolution over the last {kernel} tokens (no RoPE), q and k "
                     "L2-normalized, the output RMS-normed and gated by silu(x W_z)",
                     "线性层：对最近 {kernel} 个词元做因果卷积（不做 RoPE），q 和 k 做 L2 归一化，输出先做 RMSNorm，"
                     "再由 silu(x W_z) 门控"),
    "gated_attention": ("the other {k} layers: attention with an output gate (sigmoid of a second half of each head's "
                        "Wq rows) and q/k RMSNorm per head (width {dh})",
                        "其余 {k} 层：带输出门的注意力（门是每个头 Wq 后一半行的 sigmoid），q/k 按头做 RMSNorm（宽 {dh}）"),
    "partial": ("RoPE on {dr} of {dh} dims of each head", "每个头的 {dh} 维中只有 {dr} 维做 RoPE"),
    "norm_1w": ("every RMSNorm but the gated one scales by 1 + w", "除门控的那个以外，每个 RMSNorm 都乘以 1 + w"),
    "text_model": ("the text model of a {of} checkpoint: its vision encoder (and any multi-token-prediction layers) "
                   "left out", "{of} 检查点中的文本模型：视觉编码器（以及多词元预测层）不读"),
    "tiled": ("value heads in llama.cpp's tiled order (head j reads key head j mod {k}), as the GGUF stores them",
              "值头按 llama.cpp 的平铺顺序（第 j 个头读第 j mod {k} 个键头），与 GGUF 的存法一致"),
}


FAMILY = Family(
    name="qwen3_5",
    title="Qwen3.5",
    model=Qwen35,
    hf_types={"qwen3_5_text": "Qwen3_5ForCausalLM"},
    gguf_archs={"qwen35": False},  # the converter keeps q/k rows in HF order (NEOX-style RoPE)
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=WORDS,
    hf_wrappers={"qwen3_5": ("Qwen3_5ForConditionalGeneration", "model.language_model.")},
)
