"""Qwen3: Llama with an RMSNorm on each query head and each key head, after the split into heads and before RoPE
(q_norm, k_norm: one γ of width Dh shared by the heads), and a head width given on its own (H·Dh need not be D).
No bias on q, k, v. A sliding window on some layers is possible (use_sliding_window, layer_types): a config value."""

import torch

from llmtrace.model.family import Family, say
from llmtrace.model.maths import LayerPlan, Op
from llmtrace.model.points import Point, inserted
from llmtrace.model.transformer import Attention, Block, RMSNorm, Transformer
from llmtrace.units import plural

Q_NORM = Point("q_norm", "s6.2", ("T", "H", "Dh"), about="each query head RMS-normalized (γ of width Dh)", input="q")
K_NORM = Point("k_norm", "s6.2", ("T", "Hkv", "Dh"), about="each key head RMS-normalized (γ of width Dh)", input="k")


class Qwen3Attention(Attention):
    POINTS = inserted(Attention.POINTS, "v", Q_NORM, K_NORM)
    CHILDREN = {"q_norm": ("q_norm", "attn_q_norm"), "k_norm": ("k_norm", "attn_k_norm")}
    NORMS = {Q_NORM.name: "q_norm", K_NORM.name: "k_norm"}
    ROTATED = (Q_NORM.name, K_NORM.name)

    def __init__(self, config):
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.rms_eps, axis="Dh", step="s6.2")
        self.k_norm = RMSNorm(config.head_dim, config.rms_eps, axis="Dh", step="s6.2")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama's projection and split, then each head normalized: (B, T, H+Hkv, Dh), (B, T, Hkv, Dh)."""
        qk, v = super().project(x)
        q, k = qk.split_with_sizes([self.n_heads, self.n_kv_heads], dim=2)  # (B, T, H, Dh), (B, T, Hkv, Dh)
        q = self.point(Q_NORM.name, self.q_norm(q))
        k = self.point(K_NORM.name, self.k_norm(k))
        return torch.cat([q, k], dim=2), v

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        out = super().maths(x, plan)
        return out | {Q_NORM.name: self.q_norm.op("q", "q_norm."), K_NORM.name: self.k_norm.op("k", "k_norm.")}


class Qwen3Block(Block):
    attention = Qwen3Attention


class Qwen3(Transformer):
    block = Qwen3Block


# What Qwen3 changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "qk_norm": ("q/k RMSNorm per head (width {dh}) after the split into heads, before RoPE",
                "q/k 按头做 RMSNorm（宽 {dh}），在拆成多头之后、RoPE 之前"),
    "head_dim": ("head width {dh} given on its own: {heads} × {dh} = {hd}, not the width {d}",
                 "头宽 {dh} 单独给出：{h} 个头 × {dh} = {hd}，不等于模型宽度 {d}"),
}


def changes(c) -> list[str]:
    out = [say(WORDS, "qk_norm", dh=c.head_dim)]
    if c.n_heads * c.head_dim != c.d_model:
        out.append(say(WORDS, "head_dim", dh=c.head_dim, heads=plural(c.n_heads, "head"), h=c.n_heads,
                       hd=c.n_heads * c.head_dim, d=c.d_model))
    return out


FAMILY = Family(
    name="qwen3",
    title="Qwen3",
    model=Qwen3,
    hf_types={"qwen3": "Qwen3ForCausalLM"},
    gguf_archs={"qwen3": False},  # the converter keeps q/k rows in HF order (NEOX RoPE)
    changes=changes,
    words=WORDS,
)
