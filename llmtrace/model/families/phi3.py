"""Phi-3 / Phi-4-mini: Llama with
  - q, k and v read from one fused matrix (HF qkv_proj, GGUF attn_qkv: q rows, then k, then v) and gate and up from
    another (gate_up_proj, GGUF ffn_up: gate rows first). Llama's modules hold them fused the same way (wqkv,
    w_gate_up), so the maths splits them where it always does and the trace shows q, k, v, gate and up as for Llama;
  - partial rotary: RoPE turns only the first Dr = partial_rotary_factor·Dh dims of each head, the rest pass
    unchanged (the config's rotary_dim, which the core's RoPE reads);
  - LongRoPE (the 128k models): frequency i is divided by a factor, from the short set while the sequence is at most
    original_max_position_embeddings long and from the long set beyond, and cos and sin are multiplied by the
    attention factor √(1 + ln s / ln orig), s = max_position_embeddings / orig. As transformers does: a pass takes
    the set of the longest position it covers (Phi3RotaryEmbedding's longrope update), and when a cached sequence
    first goes past the original context its cache is computed again with the long set (Phi3ForCausalLM drops its
    cache there), so every step's logits are those of one pass over the whole sequence.

From GGUF (llama.cpp's Phi3MiniModel): rope.dimension_count is Dr (not the head width, which is D/H), the factors are
the tensors rope_factors_long/short, the original context rope.scaling.original_context_length and the attention
factor rope.scaling.attn_factor. llama.cpp itself chooses the set by its context size; llmtrace switches as
transformers does, from either format. A sliding window in a Phi-3 GGUF is not applied (llama.cpp and transformers'
GGUF loader both leave it out).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family, say
from llmtrace.model.llama_points import K_ROPE, Q_ROPE
from llmtrace.model.points import Source, Weight
from llmtrace.model.transformer import Attention, Block, FeedForward, KVCache, Transformer, rope_angles

LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"
Q_ROPE_PARTIAL = replace(Q_ROPE, about="queries with the first Dr dims of each head rotated by their positions")
K_ROPE_PARTIAL = replace(K_ROPE, about="keys with the first Dr dims of each head rotated by their positions")


class Phi3Attention(Attention):
    """Llama's attention; Wq, Wk and Wv are one checkpoint tensor."""

    POINTS = tuple({Q_ROPE.name: Q_ROPE_PARTIAL, K_ROPE.name: K_ROPE_PARTIAL}.get(p.name, p) for p in Attention.POINTS)

    def weights(self) -> tuple[Weight, ...]:
        fused = Weight("wqkv.weight", ("H*Dh+2*Hkv*Dh", "D"), "s6.1", "matrix",
                       (Source("qkv_proj.weight", "attn_qkv.weight", "H*Dh+2*Hkv*Dh", "Wq|Wk|Wv"),))
        return (fused,) + tuple(w for w in super().weights() if w.name == "wo.weight")


class Phi3FeedForward(FeedForward):
    """Llama's SwiGLU; W_gate and W_up are one checkpoint tensor (gate rows first)."""

    def weights(self) -> tuple[Weight, ...]:
        fused = Weight("w_gate_up.weight", ("2*F", "D"), "s6.7", "matrix",
                       (Source("gate_up_proj.weight", "ffn_up.weight", "2*F", "W_gate|W_up"),))
        return (fused,) + tuple(w for w in super().weights() if w.name == "w_down.weight")


class Phi3Block(Block):
    attention = Phi3Attention
    feed_forward = Phi3FeedForward


class LongRope(NamedTuple):
    """LongRoPE's numbers: the original context and the factor cos and sin are multiplied by."""

    original: int
    attention_factor: float


class LongRopeCache(KVCache):
    """The KV cache, plus what a LongRoPE model needs to compute its slots again: each slot's token and position, and
    whether the slots were computed with the long factors."""

    def __init__(self, config, max_len: int, batch: int = 1, dtype=torch.float32, device=None, ids_device=None):
        super().__init__(config, max_len, batch, dtype, device)
        self.ids = torch.zeros((batch, max_len), dtype=torch.long, device=ids_device)  # (B, S_max)
        self.pos = torch.zeros((batch, max_len), dtype=torch.long, device=ids_device)  # (B, S_max)
        self.long = False


class Phi3(Transformer):
    block = Phi3Block

    def __init__(self, config):
        super().__init__(config)
        s = config.rope_scaling or {}
        self.longrope = None
        if s.get("rope_type") == "longrope":
            self.longrope = LongRope(int(s["original_max_position_embeddings"]), float(s["attention_factor"]))
            self.register_buffer("inv_freq", longrope_inv_freq(config, s["short_factor"]), persistent=False)
            self.register_buffer("inv_freq_long", longrope_inv_freq(config, s["long_factor"]), persistent=False)

    def rope_plan(self, layer: int) -> Optional[dict]:
        """Llama's RoPE over the rotary width; with LongRoPE, the short and the long θ_i, the switch and the factor
        cos and sin are multiplied by."""
        out = super().rope_plan(layer)
        if getattr(self, "longrope", None) is not None:  # (not yet while Transformer.__init__ works out the kinds)
            out |= {"inv_freq": [float(f) for f in self.inv_freq], "inv_freq_long": [float(f) for f in self.inv_freq_long],
                    "original": self.longrope.original, "attention_factor": self.longrope.attention_factor}
        return out

    def rope_tables(self, positions: torch.Tensor, dtype: Optional[torch.dtype]) -> dict[str, tuple]:
        """LongRoPE: the long set when the pass reaches past the original context, else the short one (a tensor
        choice, as transformers makes it: a compiled step needs no branch), cos and sin × the attention factor."""
        if self.longrope is None:
            return super().rope_tables(positions, dtype)
        inv_freq = torch.where(positions.max() + 1 > self.longrope.original, self.inv_freq_long, self.inv_freq)
        return {"global": self._scaled_angles(inv_freq, positions, dtype)}

    def _scaled_angles(self, inv_freq, positions, dtype):
        cos, sin = rope_angles(inv_freq, positions)
        f = self.longrope.attention_factor
        cos, sin = cos * f, sin * f
        return (cos.to(dtype), sin.to(dtype)) if dtype is not None else (cos, sin)

    # -- LongRoPE's switch in a cached sequence -----------------------------------------------------------------

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        if self.longrope is None:
            return super().new_cache(max_len, batch)
        p = self.embed.weight
        return LongRopeCache(self.config, max_len, batch=batch, dtype=p.dtype, device=self.layer_devices or p.device,
                             ids_device=p.device)

    def cache_stale(self, cache: KVCache, start: int, n: int, input_pos: Optional[torch.Tensor] = None) -> bool:
        """The pass reaches past the original context and the cached slots were computed with the short factors."""
        return (isinstance(cache, LongRopeCache) and start > 0 and not cache.long
                and _seq_len(start, n, input_pos) > self.longrope.original)

    def forward(self, idx: torch.Tensor, cache: Optional[KVCache] = None, start: int = 0, *,
                input_pos: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                last_only: bool = False) -> torch.Tensor:
        """Llama's forward; with LongRoPE and a cache, each slot's token and position are kept, and the cached slots
        are computed again with the long factors when this pass is the first to reach past the original context."""
        if isinstance(cache, LongRopeCache):
            T = idx.size(1)
            cache.ids[:, start : start + T] = idx
            cache.pos[:, start : start + T] = torch.arange(start, start + T, device=idx.device) if input_pos is None \
                else input_pos
            if not torch.compiler.is_compiling():  # a compiled step never switches (model.compiled.decode_step)
                if self.cache_stale(cache, start, T, input_pos):
                    self._recompute_long(cache, start, attention_mask)
                cache.long = _seq_len(start, T, input_pos) > self.longrope.original
        return super().forward(idx, cache, start, input_pos=input_pos, attention_mask=attention_mask,
                               last_only=last_only)

    @torch.no_grad()
    def _recompute_long(self, cache: LongRopeCache, start: int, attention_mask: Optional[torch.Tensor]) -> None:
        """Slots [0, start) computed again with the long factors, as transformers' Phi-3 does when its cache drops.
        Nothing observes or edits this pass (the hooks see the pass that asked for it)."""
        ids, pos = cache.ids[:, :start], cache.pos[:, :start]  # (B, start) each
        mask = None if attention_mask is None else attention_mask[:, :start]
        with self.unhooked():
            x = self.embed_tokens(ids)  # (B, start, D)
            cos, sin = self._scaled_angles(self.inv_freq_long, pos, x.dtype)
            inputs = [io._replace(cos=cos, sin=sin) for io in self.layer_inputs(ids, cache, 0, pos, mask, x.dtype)]
            self.run_layers(x, inputs)


def _seq_len(start: int, n: int, input_pos: Optional[torch.Tensor]) -> int:
    """The sequence length a pass reaches, as transformers counts it: its largest position + 1."""
    return start + n if input_pos is None else int(input_pos.max()) + 1


def longrope_inv_freq(config, factors: list) -> torch.Tensor:
    """θ_i = 1 / (factor_i · base^(2i/Dr)), i in [0, Dr/2): (Dr/2,) float32, in transformers' order of operations."""
    dr = config.rotary_dim or config.head_dim
    exponent = torch.arange(0, dr, 2, dtype=torch.int64, device="cpu").float() / dr
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * config.rope_theta ** exponent)


# ----------------------------------------------------------------------------------------------------------------
# reading a config


def refuse(field: str, value, why: str) -> LlmtraceError:
    return LlmtraceError(f"{field} {value!r} is not supported: {why}")


def attention_factor(s: float, original: int) -> float:
    """LongRoPE's default scale of cos and sin for a context s times the original: √(1 + ln s / ln orig), 1 when
    s ≤ 1."""
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original))


def _rotary(head_dim: int, dr: int, field: str, value) -> Optional[int]:
    if dr < 2 or dr % 2 or dr > head_dim:
        raise refuse(field, value, f"RoPE needs an even number of dims from 2 to the head width {head_dim}")
    return dr if dr < head_dim else None


def _factors(short, long, dr: int, field: str) -> None:
    for name, f in (("short_factor", short), ("long_factor", long)):
        if not isinstance(f, list) or len(f) != dr // 2 or not all(isinstance(x, (int, float)) for x in f):
            raise refuse(f"{field}.{name}", f if not isinstance(f, list) else f"{len(f)} numbers",
                         f"LongRoPE takes one number per rotated pair ({dr // 2})")


def hf_config(cfg: dict) -> dict:
    """partial_rotary_factor and LongRoPE, read as transformers' Phi3Config reads them: rope_scaling, else
    rope_parameters; the original context from the top-level original_max_position_embeddings (default 4096)."""
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = dict(cfg.get(field) or {})
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ("default", "longrope", "su"):
        raise refuse(f"{field}.rope_type", kind, "Phi-3 runs default RoPE and LongRoPE (longrope, su), as "
                     "transformers' Phi3Config does")
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    dr = int(head_dim * float(factor))
    # transformers' Phi-3 has no bias on qkv_proj, whatever attention_bias says
    out = {"rotary_dim": _rotary(head_dim, dr, "partial_rotary_factor", factor), "attn_bias": False}
    if kind == "default":
        return out
    _factors(rope.get("short_factor"), rope.get("long_factor"), dr, field)
    original = cfg.get("original_max_position_embeddings", 4096)
    if not isinstance(original, int) or original < 2:
        raise refuse("original_max_position_embeddings", original, "LongRoPE needs the original context length")
    s = rope.get("factor")
    s = float(s) if s is not None else int(cfg.get("max_position_embeddings") or 4096) / original
    scale = rope.get("attention_factor")
    scale = attention_factor(s, original) if scale is None else scale
    out["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": original,
                           "attention_factor": float(scale), "short_factor": [float(x) for x in rope["short_factor"]],
                           "long_factor": [float(x) for x in rope["long_factor"]]}
    return out


def gguf_config(meta) -> dict:
    """The head width is D/H (rope.dimension_count is the rotary width); LongRoPE from the factor tensors."""
    d, h = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length") or d // h)
    dr = int(meta("rope.dimension_count") or head_dim)
    out: dict = {"head_dim": head_dim, "rotary_dim": _rotary(head_dim, dr, "phi3.rope.dimension_count", dr)}
    kind = meta("rope.scaling.type")
    if kind not in (None, "none", "longrope", "su"):
        raise refuse("phi3.rope.scaling.type", kind, "Phi-3 runs default RoPE and LongRoPE")
    long, short = meta.tensor(LONG_FACTORS), meta.tensor(SHORT_FACTORS)
    if long is not None or short is not None:
        if long is None or short is None:
            raise LlmtraceError(f"tensor {SHORT_FACTORS if short is None else LONG_FACTORS} is missing: LongRoPE needs "
                                f"both factor sets")
        _factors(short, long, dr, "rope_factors")
        original = int(meta("rope.scaling.original_context_length") or 0)
        if original < 2:
            raise LlmtraceError("GGUF metadata lacks phi3.rope.scaling.original_context_length, which LongRoPE needs")
        context = int(meta("context_length") or original)
        scale = meta("rope.scaling.attn_factor")
        out["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": original,
                               "attention_factor": float(scale if scale is not None else
                                                         attention_factor(context / original, original)),
                               "short_factor": short, "long_factor": long}
    window = meta("attention.sliding_window")
    if window:
        out["extra"] = {"window_note": f"no sliding window: this GGUF names one of {int(window):,} tokens, which "
                                       f"llama.cpp (and transformers' GGUF loader) leave out for Phi-3, so every layer "
                                       f"sees the whole context, as llama.cpp runs this file"}
    return out


# What Phi-3 changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "qkv": ("q, k and v read from one fused matrix ({q} + {kv} + {kv} rows), split as the maths reads it",
            "q、k、v 从同一个融合矩阵读出（{q} + {kv} + {kv} 行），按数学的读法拆开"),
    "partial": ("RoPE on {dr} of {dh} dims of each head (dims 0-{last} turn, {dr}-{dh_last} pass unchanged)",
                "每个头的 {dh} 维中只有 {dr} 维做 RoPE（第 0-{last} 维旋转，第 {dr}-{dh_last} 维原样通过）"),
    "longrope": ("LongRoPE: short factors up to {n} positions, long beyond (a cached sequence is computed again with "
                 "them when it first passes {n}, as transformers does); cos and sin × {a}",
                 "LongRoPE：{n} 个位置以内用短因子，超过后用长因子（缓存的序列第一次超过 {n} 时用它们重新计算，与 "
                 "transformers 一致）；cos 和 sin 乘以 {a}"),
    "gate_up": ("gate and up read from one fused matrix ({f} + {f} rows, gate first)",
                "gate 和 up 从同一个融合矩阵读出（{f} + {f} 行，gate 在前）"),
}


def changes(c) -> list[str]:
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out = [say(WORDS, "qkv", q=f"{q:,}", kv=f"{kv:,}")]
    if c.rotary_dim:
        out.append(say(WORDS, "partial", dr=c.rotary_dim, dh=c.head_dim, last=c.rotary_dim - 1, dh_last=c.head_dim - 1))
    s = c.rope_scaling or {}
    if s.get("rope_type") == "longrope":
        out.append(say(WORDS, "longrope", n=f"{s['original_max_position_embeddings']:,}",
                       a=f"{s['attention_factor']:.4g}"))
    out.append(say(WORDS, "gate_up", f=f"{c.ffn_dim:,}"))
    return out


FAMILY = Family(
    name="phi3",
    title="Phi-3",
    model=Phi3,
    hf_types={"phi3": "Phi3ForCausalLM"},
    gguf_archs={"phi3": False},  # the converter keeps the fused rows in HF order (NEOX RoPE)
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=WORDS,
    reads_rope=True,
    gguf_config_tensors=(LONG_FACTORS, SHORT_FACTORS),
)
