"""Attention that shares an earlier layer's keys and values (Gemma 4's KV-shared layers): it computes its own queries and
reads K and V from the cache of layer j, which computed and wrote them in this same pass; it writes nothing.

    q = X Wq, split into heads (then whatever the family does to a query: a norm, RoPE)
    K, V = layer j's cache, slots [0, start + T)      no Wk, no Wv, no cache write in this layer
    out = softmax(q Kᵀ · scale + mask) V, then Wo

Its memory (s6.8) is none of its own: `Memory("shared", reads=j)`, and KVCache hands the layer the *same* LayerKV
object as layer j, which the layer only reads (`LayerKV.read`). The bytes a token costs are counted once, at layer j.
Its declared operations read layer j's points by name ("@j:k_rope"): the keys and values the scores and P·V use are
layer j's, every slot of the cache.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from llmtrace.model.llama_points import ATTN_OUT, K_REPEATED, O_PROJ, PROBS, Q, Q_ROPE, SCORES
from llmtrace.model.maths import LayerPlan, Op, op
from llmtrace.model.memory import Memory
from llmtrace.model.points import Source, Weight
from llmtrace.model.transformer import Attention, LayerInput, apply_rope

KIND = "shared_kv"

# The seed steps with this kind's own headings (English, Chinese): no K or V of its own, and no write.
HEADINGS = {
    "s6.1": ("pre-norm and the Q projection (K and V are another layer's)", "预归一化与 Q 投影（K、V 来自另一层）"),
    "s6.4": ("scores against the shared keys", "与共享的键计算分数"),
    "s6.8": ("the keys and values read from an earlier layer's cache", "从前面一层的缓存读取键和值"),
}


def layer_ref(layer: int, point: str) -> str:
    """An operand that is another layer's point (model.maths: "@j:name")."""
    return f"@{layer}:{point}"


class SharedKVAttention(Attention):
    """Queries of its own; keys and values of layer `reads` (module docstring). `k_point` and `v_point` name the points
    of that layer its cache holds (after RoPE, after any norm)."""

    KIND = KIND
    HEADINGS = HEADINGS
    POINTS = (Q, Q_ROPE, K_REPEATED, SCORES, PROBS, ATTN_OUT, O_PROJ)
    ROTATED = (Q.name,)

    def __init__(self, config, reads: int, k_point: str = "k_rope", v_point: str = "v"):
        super().__init__(config)
        self.reads, self.k_point, self.v_point = reads, k_point, v_point
        self.wqkv = nn.Linear(config.d_model, self.n_heads * self.head_dim, bias=False)  # Wq only: (H*Dh, D)

    def weights(self) -> tuple[Weight, ...]:
        q_rows = str(self.n_heads * self.head_dim)
        return (Weight("wqkv.weight", (q_rows, "D"), "s6.1", "matrix",
                       (Source("q_proj.weight", "attn_q.weight", q_rows, "Wq"),)),
                Weight("wo.weight", ("D", q_rows), "s6.6", "matrix",
                       (Source("o_proj.weight", "attn_output.weight", "D", "Wo"),)))

    def memory(self) -> Memory:
        """s6.8 nothing of its own: layer `reads`'s keys and values."""
        return Memory("shared", reads=self.reads)

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """What the family does to each query head before RoPE: (B, T, H, Dh) -> the same (nothing here)."""
        return q

    def forward(self, x: torch.Tensor, io: LayerInput) -> torch.Tensor:
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        q = self.query(self.point(Q.name, self.wqkv(x).view(B, T, H, Dh)))  # s6.1, s6.2: (B, T, H, Dh)
        if io.cos is not None:
            q = apply_rope(q, io.cos, io.sin)
        q = self.point(Q_ROPE.name, q).transpose(1, 2)  # s6.3: (B, H, T, Dh)
        if io.cache is None:
            raise ValueError(f"a KV-shared layer reads layer {self.reads}'s keys and values from the cache; "
                             "the model's forward gives it one")
        k, v = io.cache.read(io.start + T)  # s6.8 read, never written: (B, Hkv, S, Dh) each
        y = self.point(ATTN_OUT.name, self.attend(q, k, v, io.mask).transpose(1, 2))  # (B, T, H, Dh)
        return self.point(O_PROJ.name, self.wo(y.reshape(B, T, H * Dh)))  # s6.6: (B, T, D)

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        """Llama's attention without K, V and the write: the keys and values are layer `reads`'s, every slot."""
        H, Hkv = self.n_heads, self.n_kv_heads
        k, v = layer_ref(self.reads, self.k_point), layer_ref(self.reads, self.v_point)
        rope = dict(plan.rope) if plan.rope else {"rotation": "none"}
        return {Q.name: op("matmul", [x], ["wqkv.weight"], split="H"),
                Q_ROPE.name: op("rope", [self.ROTATED[-1]], **rope),
                K_REPEATED.name: op("repeat_kv", [k], group=H // Hkv, cached=[k]),
                SCORES.name: op("scores", [Q_ROPE.name, K_REPEATED.name], scale=self.scale,
                                scale_label=self.SCALE_LABEL, softcap=None, mask="causal", window=plan.window),
                PROBS.name: op("softmax", [SCORES.name], sink=None),
                ATTN_OUT.name: op("weighted_sum", [PROBS.name, v], group=H // Hkv, cached=[v]),
                O_PROJ.name: op("matmul", [ATTN_OUT.name], ["wo.weight"], merge="H")}

    EXPLAIN = ()  # no K or V of its own: the steps table works its operations; s6.8 says whose cache it reads

    def flops(self, n_tokens: int, n_keys: Optional[int] = None) -> list[tuple]:
        """Multiply-add FLOPs over n tokens, as rows: the query and output projections and the scores and P·V against
        S keys (n_tokens by default); no K or V projection."""
        T, S, H, Dh, D = n_tokens, n_keys or n_tokens, self.n_heads, self.head_dim, self.config.d_model
        return [("q", ("Q projection (K and V are an earlier layer's)", "Q 投影（K 和 V 来自更早的一层）"),
                 "2·T·D·H·Dh", 2 * T * D * H * Dh),
                ("scores", ("scores Q·Kᵀ", "分数 Q·Kᵀ"), "2·H·T·S·Dh", 2 * H * T * S * Dh),
                ("pv", ("weighted sum P·V", "加权求和 P·V"), "2·H·T·S·Dh", 2 * H * T * S * Dh),
                ("o", ("output projection", "输出投影"), "2·T·H·Dh·D", 2 * T * H * Dh * D)]
