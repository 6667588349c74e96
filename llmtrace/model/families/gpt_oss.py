"""gpt-oss: Llama's pre-norm layer with
  - biases on q, k, v and o;
  - attention sinks: each head has a learned logit that joins every softmax row as one more column and is dropped
    after it, so a row of `probs` sums to less than 1; the sink's share, 1 − Σ probs, is a point of its own (s6.5);
  - a sliding window of 128 keys on every other layer (layer_types: a config value the core's masks read);
  - YaRN RoPE: the frequencies blended by a ramp (model.transformer.yarn_inv_freq) and cos, sin × an attention
    factor, 0.1·ln(factor) + 1 unless the checkpoint gives it;
  - a mixture of experts (model/moe.py) whose router has a bias and chooses differently: the top K of the raw
    logits, then a softmax over those K alone (MoEFeedForward.choice "topk_softmax");
  - experts with biases and a clamped GLU: gate ≤ limit, −limit ≤ up ≤ limit, out = gate·σ(α·gate)·(up + 1),
    α = 1.702, limit 7 (config.json's swiglu_alpha, swiglu_limit, kept in the config part "glu_clamp"; a GGUF stores
    neither: llama.cpp's values).

Layouts. An HF directory stores the experts for x·W: `experts.gate_up_proj` (E, D, 2F) with gate and up interleaved
along the last axis (g0 u0 g1 u1 ...), its bias (E, 2F) likewise, `experts.down_proj` (E, F, D). The declaration
reads them through named load transforms (model.points.TRANSFORMS: transpose, even, odd), so the loader has no code
of gpt-oss's. The released checkpoints hold the expert matrices in MXFP4 (`*_blocks`, `*_scales`), which the loader
dequantizes (checkpoint.weights.MXFP4Entry); a GGUF holds them as MXFP4 tensors that gguf's dequantizer reads, the
gate and up already split, and the FFN's norm under the name `post_attention_norm`.

From a GGUF, YaRN's ramp ends are rounded to whole pairs, as llama.cpp always does (transformers' `truncate`, which
gpt-oss's config sets false): such a file computes what llama.cpp computes."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family, say
from llmtrace.model.maths import Op, op
from llmtrace.model.llama_points import PROBS, SCORES
from llmtrace.model.moe import ExpertMatrices, MoEBlock, MoEFeedForward, moe_fields
from llmtrace.model.moe_points import EXPERT_ACT, MOE_POINTS, ROUTER_PROBS
from llmtrace.model.points import Point, Source, Weight, inserted
from llmtrace.model.transformer import Attention, Block, Transformer, rope_angles

ALPHA, LIMIT = 1.702, 7.0  # llama.cpp's gpt-oss graph hard-codes both; a GGUF has no key for them
CLAMP = "glu_clamp"  # its config part (ModelConfig.parts): {"alpha": α, "limit": the clamp}

SINK = Point("sink", "s6.5", ("H", "T"), about="the sink's share of each softmax row (its learned logit per head "
             "joined the row as one more column): 1 − Σ probs", input="scores")
PROBS_SINK = replace(PROBS, about="softmax of the scores and the head's sink logit, the sink's column dropped: each "
                                  "row sums to 1 − the sink's share")
ACT_CLAMPED = replace(EXPERT_ACT, about="each chosen expert's clamped GLU: min(gate, 7)·σ(1.702·min(gate, 7))·"
                                        "(clamp(up, ±7) + 1)")
PROBS_TOPK = replace(ROUTER_PROBS, about="softmax over each token's top-K router scores (the raw logits chose them), "
                                         "0 for the experts not chosen: each row sums to 1")


class GptOssAttention(Attention):
    """Llama's attention with a bias on o and a sink logit per head in the softmax; always spelled out (the fused
    kernel has no sink)."""

    POINTS = inserted(tuple(PROBS_SINK if p == PROBS else p for p in Attention.POINTS), SCORES.name, SINK)
    fused = False  # no fused kernel has a sink

    def __init__(self, config):
        super().__init__(config)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=True)  # (D, H*Dh), bias (D,)
        self.sinks = nn.Parameter(torch.empty(config.n_heads))  # (H,): one logit per head

    def weights(self) -> tuple[Weight, ...]:
        return super().weights() + (
            Weight("wo.bias", ("D",), "s6.6", "vector", (Source("o_proj.bias", "attn_output.bias", "D", "bo"),)),
            Weight("sinks", ("H",), "s6.5", "vector", (Source("sinks", "attn_sinks.weight", "H", "sink"),)))

    def maths(self, x: str, plan) -> dict[str, Op]:
        out = super().maths(x, plan)
        sink = "a learned logit per head"
        return out | {"sink": op("softmax", ["scores"], ["sinks"], sink=sink, take="sink"),
                      "probs": op("softmax", ["scores"], ["sinks"], sink=sink),
                      "o_proj": op("matmul", ["attn_out"], ["wo.weight", "wo.bias"], merge="H")}

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """softmax over [scores, sink] (B, H, T, S+1) in float32, the sink's column dropped: (B, H, T, S), rows
        summing to 1 − the sink's share."""
        B, H, T, _ = scores.shape
        sink = self.sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
        both = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)  # (B, H, T, S+1)
        self.point(SINK.name, both[..., -1])  # (B, H, T)
        return both[..., :-1].to(scores.dtype)


class GptOssFeedForward(MoEFeedForward):
    """Mixtral's experts with a biased router that takes the top K of its logits, then a softmax over them, and
    experts with biases and a clamped GLU."""

    POINTS = tuple(PROBS_TOPK if p == ROUTER_PROBS else ACT_CLAMPED if p == EXPERT_ACT else p for p in MOE_POINTS)
    choice = "topk_softmax"

    def __init__(self, config):
        super().__init__(config)
        E, D, Fe = self.n_experts, config.d_model, self.expert_dim
        self.router = nn.Linear(D, E, bias=True)  # (E, D), bias (E,)
        self.w_gate = ExpertMatrices(E, Fe, D, bias=True)
        self.w_up = ExpertMatrices(E, Fe, D, bias=True)
        self.w_down = ExpertMatrices(E, D, Fe, bias=True)
        clamp = config.parts.get(CLAMP, {})  # its own config part (ModelConfig.parts)
        self.alpha, self.limit = clamp.get("alpha", ALPHA), clamp.get("limit", LIMIT)

    def weights(self) -> tuple[Weight, ...]:
        def w(name, shape, kind, hf, gguf, rows, math_name, transform=()):
            return Weight(name, shape, "s6.7", kind, (Source(hf, gguf, rows, math_name, hf_transform=transform),))

        gate_up, bias = "experts.gate_up_proj", "experts.gate_up_proj_bias"
        return (w("router.weight", ("E", "D"), "matrix", "router.weight", "ffn_gate_inp.weight", "E", "W_router"),
                w("router.bias", ("E",), "vector", "router.bias", "ffn_gate_inp.bias", "E", "b_router"),
                w("w_gate.weight", ("E", "Fe", "D"), "experts", gate_up, "ffn_gate_exps.weight", "E", "W_gate",
                  ("transpose", "even")),
                w("w_gate.bias", ("E", "Fe"), "vector", bias, "ffn_gate_exps.bias", "E", "b_gate", ("even",)),
                w("w_up.weight", ("E", "Fe", "D"), "experts", gate_up, "ffn_up_exps.weight", "E", "W_up",
                  ("transpose", "odd")),
                w("w_up.bias", ("E", "Fe"), "vector", bias, "ffn_up_exps.bias", "E", "b_up", ("odd",)),
                w("w_down.weight", ("E", "D", "Fe"), "experts", "experts.down_proj", "ffn_down_exps.weight", "E",
                  "W_down", ("transpose",)),
                w("w_down.bias", ("E", "D"), "vector", "experts.down_proj_bias", "ffn_down_exps.bias", "E", "b_down"))

    def glu_op(self) -> Op:
        return op("glu", ["gate", "up"], act="clamped", clamp=self.limit, alpha=self.alpha, up_offset=1.0)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The clamped GLU, in transformers' order: gate ≤ limit, up within ±limit, gate·σ(α·gate)·(up + 1)."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssBlock(MoEBlock):
    attention = GptOssAttention
    feed_forward = GptOssFeedForward
    CHILDREN = {**Block.CHILDREN, "ffn_norm": ("post_attention_layernorm", "post_attention_norm")}


class GptOss(Transformer):
    """YaRN's cos and sin scaled by the attention factor (the frequencies are the core's, rope_inv_freq)."""

    block = GptOssBlock

    def __init__(self, config):
        super().__init__(config)
        self.attention_factor = yarn_attention_factor(config.rope_scaling)

    def rope_plan(self, layer: int):
        plan = super().rope_plan(layer)
        return None if plan is None else plan | {"attention_factor": yarn_attention_factor(self.config.rope_scaling)}

    def rope_tables(self, positions, dtype):
        cos, sin = rope_angles(self.inv_freq, positions)
        cos, sin = cos * self.attention_factor, sin * self.attention_factor
        tables = {"global": (cos.to(dtype), sin.to(dtype)) if dtype is not None else (cos, sin)}
        return tables | {"none": (None, None)}


def yarn_attention_factor(s) -> float:
    """cos and sin × this: the checkpoint's attention_factor, else YaRN's 0.1·ln(factor) + 1 (1 without YaRN)."""
    if not s or s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale(1.0)


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "attention_factor",
             "mscale", "mscale_all_dim")


def hf_config(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("yarn", "default"):
        raise LlmtraceError(f"rope_type {kind!r} is not what gpt-oss runs (yarn, or none)")
    scaling = {"rope_type": "yarn"} | {k: rope[k] for k in YARN_KEYS if rope.get(k) is not None} if kind == "yarn" \
        else None
    fields = moe_fields(cfg.get("num_local_experts", 128), "num_local_experts", cfg.get("num_experts_per_tok", 4),
                        "num_experts_per_tok")
    return fields | {"expert_ffn_dim": int(cfg["intermediate_size"]), "norm_topk_prob": False,
                     "rope_theta": float(cfg.get("rope_theta") or rope.get("rope_theta") or 150000.0),
                     "rope_scaling": scaling,
                     "parts": _clamp(float(cfg.get("swiglu_alpha", ALPHA)), float(cfg.get("swiglu_limit", LIMIT)))}


def _clamp(alpha: float, limit: float) -> dict:
    return {CLAMP: {"alpha": alpha, "limit": limit}}


def gguf_config(meta) -> dict:
    fields = moe_fields(meta("expert_count"), "expert_count", meta("expert_used_count"), "expert_used_count")
    n = int(meta("block_count"))
    out = fields | {"expert_ffn_dim": int(meta("expert_feed_forward_length") or meta("feed_forward_length")),
                    "norm_topk_prob": False, "parts": _clamp(ALPHA, LIMIT), "attn_bias": True}
    if meta("rope.scaling.type") == "yarn":
        out["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(meta("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "beta_fast": float(meta("rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(meta("rope.scaling.yarn_beta_slow") or 1.0), "truncate": True,
            # llama.cpp multiplies the file's factor (1 when absent) by YaRN's 0.1·ln(factor) + 1
            "attention_factor": float(meta("rope.scaling.yarn_attn_factor") or 1.0) * (
                0.1 * math.log(float(meta("rope.scaling.factor"))) + 1.0)}
    elif meta("rope.scaling.type") not in (None, "none"):
        raise LlmtraceError(f"rope scaling {meta('rope.scaling.type')!r} is not what gpt-oss runs (yarn, or none)")
    window = meta("attention.sliding_window")
    if window:  # llama.cpp's pattern for gpt-oss: the even layers slide
        out.update(sliding_window=int(window), layer_types=["sliding" if i % 2 == 0 else "full" for i in range(n)])
    return out


# What gpt-oss changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "biases": ("biases on q, k, v and o", "q、k、v 和 o 带偏置"),
    "sinks": ("attention sinks: a learned logit per head joins each softmax row and is dropped after it, so each row "
              "of probs sums to 1 − the sink's share",
              "注意力汇点：每个头有一个学到的 logit，加入每一行 softmax 后再去掉，所以 probs 的每一行之和为 1 减去汇点的份额"),
    "yarn": ("YaRN RoPE: factor {f} over an original context of {L}, cos and sin × {a}",
             "YaRN RoPE：在 {L} 的原始上下文上放大 {f} 倍，cos 和 sin 乘以 {a}"),
    "yarn_untruncated": ("YaRN RoPE: factor {f} over an original context of {L}, cos and sin × {a} (ramp not rounded "
                         "to whole pairs)",
                         "YaRN RoPE：在 {L} 的原始上下文上放大 {f} 倍，cos 和 sin 乘以 {a}（斜坡不取整到整对维度）"),
    "experts": ("feed-forward: {e} experts (width {w}) and a router with a bias; the top {k} of the raw router logits, "
                "then a softmax over those {k}",
                "前馈网络：{e} 个专家（宽 {w}）和一个带偏置的路由器；取路由器原始 logits 的前 {k} 个，再对这 {k} 个做 softmax"),
    "clamped": ("experts with biases and a clamped GLU: gate ≤ {lim}, −{lim} ≤ up ≤ {lim}, gate·σ({alpha}·gate)·(up + 1)",
                "专家带偏置，GLU 有截断：gate ≤ {lim}，−{lim} ≤ up ≤ {lim}，gate·σ({alpha}·gate)·(up + 1)"),
}


def changes(c) -> list[str]:
    s = c.rope_scaling or {}
    out = [say(WORDS, "biases"), say(WORDS, "sinks")]
    if s.get("rope_type") == "yarn":
        out.append(say(WORDS, "yarn" if s.get("truncate", True) else "yarn_untruncated", f=f"{s['factor']:g}",
                       L=f"{s['original_max_position_embeddings']:,}", a=f"{yarn_attention_factor(s):.4f}"))
    out.append(say(WORDS, "experts", e=c.n_experts, w=f"{c.expert_ffn_dim:,}", k=c.n_experts_used))
    clamp = c.parts.get(CLAMP, {})
    out.append(say(WORDS, "clamped", lim=f"{clamp.get('limit', LIMIT):g}", alpha=f"{clamp.get('alpha', ALPHA):g}"))
    return out


FAMILY = Family(
    name="gpt_oss",
    title="gpt-oss",
    model=GptOss,
    hf_types={"gpt_oss": "GptOssForCausalLM"},
    gguf_archs={"gpt-oss": False},  # the converter's gpt-oss class keeps q/k rows in HF order
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=WORDS,
    reads_rope=True,
)
