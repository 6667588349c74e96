"""OLMo 2: Llama with its norms moved to the sub-layers' outputs and onto q and k:
  - no norm before attention or before the feed-forward; each sub-layer's output is normed before the residual add:
    h = h + post_attn_norm(attn(h)) (s6.6), h = h + post_ffn_norm(ffn(h)) (s6.7);
  - q and k RMS-normalized over their whole projection (one γ of width H·Dh for q, Hkv·Dh for k), before the split
    into heads (Qwen3 norms each head on its own, after the split).
The final norm, SwiGLU, RoPE (halves, as Llama in HF order: llama.cpp's converter does not permute OLMo 2's rows) are
Llama's. A GGUF (arch olmo2) has post_attention_norm, post_ffw_norm, attn_q_norm [H·Dh] and attn_k_norm [Hkv·Dh],
and no attn_norm or ffn_norm.
"""

from __future__ import annotations

import torch

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family, say
from llmtrace.model.llama_points import ATTN_NORM, FFN_NORM, RESID_MID, RESID_POST, V
from llmtrace.model.maths import LayerPlan, Op
from llmtrace.model.points import Point, inserted
from llmtrace.model.transformer import Attention, Block, RMSNorm, Transformer
from llmtrace.model.wiring import Addition

Q_NORM = Point("q_norm", "s6.1/s6.2", ("T", "H*Dh"), about="the queries RMS-normalized over their whole width (γ of "
               "width H·Dh), before the split into heads", input="q")
K_NORM = Point("k_norm", "s6.1/s6.2", ("T", "Hkv*Dh"), about="the keys RMS-normalized over their whole width (γ of "
               "width Hkv·Dh), before the split into heads", input="k")
POST_ATTN_NORM = Point("post_attn_norm", "s6.6", ("T", "D"), about="RMSNorm of attention's output, before the residual "
                       "add", input="o_proj")
POST_FFN_NORM = Point("post_ffn_norm", "s6.7", ("T", "D"), about="RMSNorm of the feed-forward's output, before the "
                      "residual add", input="down")


class Olmo2Attention(Attention):
    """Llama's attention with q and k normed over the whole projection before the split into heads."""

    POINTS = inserted(Attention.POINTS, V.name, Q_NORM, K_NORM)
    CHILDREN = {"q_norm": ("q_norm", "attn_q_norm"), "k_norm": ("k_norm", "attn_k_norm")}
    NORMS = {Q_NORM.name: "q_norm", K_NORM.name: "k_norm"}
    ROTATED = (Q_NORM.name, K_NORM.name)

    def __init__(self, config):
        super().__init__(config)
        self.q_norm = RMSNorm(config.n_heads * config.head_dim, config.rms_eps, axis="H*Dh")
        self.k_norm = RMSNorm(config.n_kv_heads * config.head_dim, config.rms_eps, axis="Hkv*Dh")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s6.1 X Wq, X Wk, X Wv; q and k normed over their whole width; s6.2 split into heads:
        (B, T, H+Hkv, Dh), (B, T, Hkv, Dh)."""
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split_with_sizes([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)  # (B, T, H*Dh), (B, T, Hkv*Dh) ×2
        v = v.view(B, T, Hkv, Dh)
        if self.hook is not None:  # the projections, split into heads as Llama's q, k, v (a hook may replace them)
            q = self.point("q", q.view(B, T, H, Dh)).reshape(B, T, H * Dh)
            k = self.point("k", k.view(B, T, Hkv, Dh)).reshape(B, T, Hkv * Dh)
            v = self.point("v", v)
        q = self.point(Q_NORM.name, self.q_norm(q))  # (B, T, H*Dh)
        k = self.point(K_NORM.name, self.k_norm(k))  # (B, T, Hkv*Dh)
        return torch.cat([q, k], dim=-1).view(B, T, H + Hkv, Dh), v

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        out = super().maths(x, plan)
        return out | {Q_NORM.name: self.q_norm.op("q", "q_norm."), K_NORM.name: self.k_norm.op("k", "k_norm.")}


class Olmo2Block(Block):
    """No pre-norms: each sub-layer reads the stream as it is, and its output is normed before the residual add."""

    attention = Olmo2Attention
    POINTS = inserted(inserted(tuple(p for p in Block.POINTS if p not in (ATTN_NORM, FFN_NORM)), "attn",
                               POST_ATTN_NORM), "ffn", POST_FFN_NORM)
    CHILDREN = {"attn": ("self_attn", ""), "post_attn_norm": ("post_attention_layernorm", "post_attention_norm"),
                "ffn": ("mlp", ""), "post_ffn_norm": ("post_feedforward_layernorm", "post_ffw_norm")}
    NORMS = {POST_ATTN_NORM.name: "post_attn_norm", POST_FFN_NORM.name: "post_ffn_norm"}
    WIRING = (Addition("attn", RESID_MID.name, post_norm=POST_ATTN_NORM.name),
              Addition("ffn", RESID_POST.name, post_norm=POST_FFN_NORM.name))

    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        del self.attn_norm, self.ffn_norm  # Llama's pre-norms: none here
        self.post_attn_norm = RMSNorm(config.d_model, config.rms_eps, step="s6.6")
        self.post_ffn_norm = RMSNorm(config.d_model, config.rms_eps, step="s6.7")


class Olmo2(Transformer):
    block = Olmo2Block


def hf_config(cfg: dict) -> dict:
    if cfg.get("attention_bias"):  # transformers' OLMo 2 then has a bias on Wo too, which llmtrace's attention lacks
        raise LlmtraceError("attention_bias True is not supported: OLMo 2 with biases on q, k, v and o (no released "
                            "OLMo 2 has them)")
    return {}


# What OLMo 2 changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "qk_norm": ("q/k RMSNorm over the whole projection (width {q} for q, {kv} for k), before the split into heads",
                "q/k 在整个投影上做 RMSNorm（q 宽 {q}，k 宽 {kv}），在拆成多头之前"),
    "post_attn": ("no norm before attention: the stream goes in as it is; attention's output is RMS-normed, then added",
                  "注意力之前不做归一化：残差流原样进入；注意力的输出先做 RMSNorm，再相加"),
    "post_ffn": ("no norm before the feed-forward: its output is RMS-normed, then added",
                 "前馈网络之前不做归一化：它的输出先做 RMSNorm，再相加"),
}


def changes(c) -> list[str]:
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return [say(WORDS, "qk_norm", q=f"{q:,}", kv=f"{kv:,}"), say(WORDS, "post_attn"), say(WORDS, "post_ffn")]


FAMILY = Family(
    name="olmo2",
    title="OLMo 2",
    model=Olmo2,
    hf_types={"olmo2": "Olmo2ForCausalLM"},
    gguf_archs={"olmo2": False},  # the converter keeps q/k rows in HF order (NEOX RoPE)
    hf_config=hf_config,
    changes=changes,
    words=WORDS,
)
