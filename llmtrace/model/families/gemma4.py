"""Gemma 4 (the text model, Gemma4ForCausalLM): Gemma 3's layer (embedding × √D, four norms a layer, GeGLU, q/k norm per
head, sliding and global layers with their own RoPE) with these changes, as transformers' modeling_gemma4.py computes
them:

  - every RMSNorm scales by w as stored (Gemma 2 and 3 scale by 1 + w), and the values are RMS-normed too, without a
    scale (v_norm); the scores are not scaled (scale 1: the q/k norms set their size);
  - the global layers have their own head width (global_head_dim), may have their own KV head count
    (num_global_key_value_heads), use the key projection as values where attention_k_eq_v, and turn only the first
    partial_rotary_factor of each head's pairs ("proportional" RoPE: the other frequencies are 0, RoPE base 1e6);
    the sliding-window layers keep Gemma 3's RoPE (base 1e4 over the whole head);
  - per-layer inputs: a second embedding table (vocab × L·P) gives each token P numbers per layer, added to a
    projection of its embedding (× 1/√D, RMS-normed per layer), the sum × 1/√2; after its feed-forward each layer
    adds RMSNorm(W_proj (gelu(W_gate h) ⊙ its P numbers)) to the stream;
  - each layer's output is multiplied by a learned scalar (layer_scalar);
  - the last num_kv_shared_layers layers compute no keys or values: each reads those of the last earlier layer of
    its kind (sliding or global) from the cache (model.kinds.shared_kv) and writes none; with use_double_wide_mlp
    their feed-forward is twice as wide;
  - the logits are soft-capped, cap·tanh(logits / cap) (Gemma 2's final cap).

From GGUF (arch gemma4, llama.cpp's converter): the norms are stored as they are (no +1); the head width and the KV
head count are per kind of layer (attention.key_length, key_length_swa; head_count_kv one number a layer); which
layers are sliding is attention.sliding_window_pattern; the proportional RoPE is the tensor rope_freqs (1 for a turned
pair, 1e30 for a still one); a global layer without attn_v uses its keys as values.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family, say
from llmtrace.model.families.gemma2 import Gemma2, Gemma2Block, embed_scale
from llmtrace.model.families.qwen3 import K_NORM, Q_NORM, Qwen3Attention
from llmtrace.model.kinds.shared_kv import SharedKVAttention
from llmtrace.model.llama_points import ATTN_OUT, KV_WRITE, Q, RESID_POST, V
from llmtrace.model.maths import LayerPlan, Op, op
from llmtrace.model.points import Point, Source, Weight, inserted
from llmtrace.model.transformer import FeedForward, Module, RMSNorm
from llmtrace.model.wiring import Addition, Rescale

GLOBAL, SHARED, PER_LAYER = "global_attention", "shared_kv", "per_layer_input"  # ModelConfig.parts keys

V_NORM = Point("v_norm", "s6.2", ("T", "Hkv", "Dh"), about="each value head RMS-normalized, no scale", input="v")

# per-layer inputs: the model's part (before the layers)
PLE_TOK = Point("ple_tok", "s4", ("T", "L*P"), about="each token's row of the per-layer table: P numbers a layer")
PLE_TOK_SCALED = Point("ple_tok_scaled", "s4", ("T", "L*P"), about="the per-layer rows × √P", input="ple_tok")
PLE_CTX = Point("ple_ctx", "s4", ("T", "L*P"), about="the scaled embedding × W_ple: P numbers a layer from context")
PLE_CTX_SCALED = Point("ple_ctx_scaled", "s4", ("T", "L*P"), about="× 1/√D", input="ple_ctx")
PLE_CTX_NORM = Point("ple_ctx_norm", "s4", ("T", "L*P"), about="RMSNorm of each layer's P numbers",
                     input="ple_ctx_scaled")
PLE_SUM = Point("ple_sum", "s4", ("T", "L*P"), about="the table's rows + the projection's")
PLE = Point("ple", "s4", ("T", "L*P"), about="(table + projection) × 1/√2: each layer's per-layer input",
            input="ple_sum")

# per-layer inputs: a layer's part (after its feed-forward)
RESID_FFN = Point("resid_ffn", "s6.7", ("T", "D"), editable=True, about="stream + feed-forward, before the per-layer input")
PLE_GATE = Point("ple_gate", "s6.7", ("T", "P"), about="the stream × W_gate: the gate of this layer's per-layer input")
PLE_IN = Point("ple_in", "s6.7", ("T", "P"), about="this layer's P numbers of the per-layer input")
PLE_ACT = Point("ple_act", "s6.7", ("T", "P"), about="gelu(gate) ⊙ the per-layer input")
PLE_PROJ = Point("ple_proj", "s6.7", ("T", "D"), about="× W_proj, back to the width D")
PLE_NORM = Point("ple_norm", "s6.7", ("T", "D"), about="RMSNorm of the projection, before the residual add",
                 input="ple_proj")
RESID_PLE = Point("resid_ple", "s6.7", ("T", "D"), editable=True, about="stream + the per-layer input's part")
RESID_SCALED = replace(RESID_POST, about="(stream + per-layer input) × the layer's learned scalar: the layer's output")


def global_part(config) -> dict:
    """The global layers' sizes (ModelConfig.parts), the sliding layers' where a config says nothing."""
    g = config.parts.get(GLOBAL, {})
    return {"head_dim": int(g.get("head_dim", config.head_dim)), "kv_heads": int(g.get("kv_heads", config.n_kv_heads)),
            "k_eq_v": bool(g.get("k_eq_v", False)), "rotary": float(g.get("rotary", 1.0))}


def is_global(config, layer: int) -> bool:
    return config.layer_type(layer) != "sliding"


def layer_config(config, layer: int):
    """The config one layer's attention reads: the global layers' head width and KV heads where it is one."""
    if not is_global(config, layer):
        return config
    g = global_part(config)
    return replace(config, head_dim=g["head_dim"], n_kv_heads=g["kv_heads"], rotary_dim=None)


def shared_reads(config, layer: int) -> Optional[int]:
    reads = config.parts.get(SHARED, {}).get("reads") or []
    return reads[layer] if layer < len(reads) else None


def ple_width(config) -> int:
    return int(config.parts.get(PER_LAYER, {}).get("width", 0))


class Gemma4Input(NamedTuple):
    """LayerInput's fields, and this layer's P numbers of the per-layer input (B, T, P)."""

    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    cache: object
    start: int
    padding: Optional[torch.Tensor] = None
    per_layer: Optional[torch.Tensor] = None


def value_norm(v: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a scale, in float32 as transformers' Gemma4RMSNorm(with_scale=False)."""
    return F.rms_norm(v.float(), (v.size(-1),), None, eps).to(v.dtype)


class WidthNorm(RMSNorm):
    """RMSNorm whose γ's width is declared in numbers: a global layer's heads (their own width, not the model's Dh), each
    layer's P numbers of the per-layer input (P is not a model axis)."""

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("weight", (str(self.weight.numel()),), self.step, "vector", (Source("weight", "weight"),),
                       math="γ"),)


class Gemma4Attention(Qwen3Attention):
    """Qwen3's q/k norms (scale w), a scale-less RMSNorm of the values, no score scale; in a global layer its own head
    width and KV heads, and the key projection as values where k_eq_v (Wqkv then has no Wv rows)."""

    POINTS = inserted(Qwen3Attention.POINTS, K_NORM.name, V_NORM)
    SCALE_LABEL = "1 (the q/k norms set the scale)"

    def __init__(self, config, k_eq_v: bool = False):
        super().__init__(config)
        self.k_eq_v = k_eq_v
        self.q_norm = WidthNorm(config.head_dim, config.rms_eps, axis="Dh", step="s6.2")
        self.k_norm = WidthNorm(config.head_dim, config.rms_eps, axis="Dh", step="s6.2")
        H, Hkv, Dh = config.n_heads, config.n_kv_heads, config.head_dim
        if k_eq_v:
            self.wqkv = nn.Linear(config.d_model, (H + Hkv) * Dh, bias=False)  # Wq rows, then Wk (also the values)

    def weights(self) -> tuple[Weight, ...]:
        H, Hkv, Dh = (str(n) for n in (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.head_dim))
        rows = (Source("q_proj.weight", "attn_q.weight", H, "Wq"), Source("k_proj.weight", "attn_k.weight", Hkv, "Wk"))
        if not self.k_eq_v:
            rows += (Source("v_proj.weight", "attn_v.weight", Hkv, "Wv"),)
        total = str(sum(int(s.rows) for s in rows))
        return (Weight("wqkv.weight", (total, "D"), "s6.1", "matrix", rows),
                Weight("wo.weight", ("D", H), "s6.6", "matrix", (Source("o_proj.weight", "attn_output.weight", "D", "Wo"),)))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s6.1, s6.2: q, k, v (v = the keys' projection where k_eq_v), each head normed: (B, T, H+Hkv, Dh), v."""
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        parts = self.wqkv(x).split_with_sizes([H * Dh] + [Hkv * Dh] * (1 if self.k_eq_v else 2), dim=-1)
        q, k = parts[0].view(B, T, H, Dh), parts[1].view(B, T, Hkv, Dh)
        v = k if self.k_eq_v else parts[2].view(B, T, Hkv, Dh)
        if self.hook is not None:
            self.point(Q.name, q)
            self.point("k", k)
            self.point(V.name, v)
        q = self.point(Q_NORM.name, self.q_norm(q))
        k = self.point(K_NORM.name, self.k_norm(k))
        v = self.point(V_NORM.name, value_norm(v, self.config.rms_eps))
        return torch.cat([q, k], dim=2), v

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        out = super().maths(x, plan)
        k_rows = [H * Dh, (H + Hkv) * Dh]
        v_rows = k_rows if self.k_eq_v else [(H + Hkv) * Dh, (H + 2 * Hkv) * Dh]
        return out | {V.name: op("matmul", [x], ["wqkv.weight"], rows=v_rows, split="Hkv"),
                      V_NORM.name: op("rmsnorm", [V.name], [], eps=self.config.rms_eps, gamma="none", over="Dh"),
                      KV_WRITE.name: op("cache_write", ["k_rope", V_NORM.name]),
                      ATTN_OUT.name: op("weighted_sum", ["probs", V_NORM.name], group=H // Hkv, cached=[V_NORM.name])}


class Gemma4SharedAttention(SharedKVAttention):
    """A KV-shared layer (model.kinds.shared_kv) with Gemma 4's query: each head RMS-normed (scale w) before RoPE."""

    POINTS = inserted(SharedKVAttention.POINTS, Q.name, Q_NORM)
    CHILDREN = {"q_norm": ("q_norm", "attn_q_norm")}
    NORMS = {Q_NORM.name: "q_norm"}
    ROTATED = (Q_NORM.name,)
    SCALE_LABEL = Gemma4Attention.SCALE_LABEL

    def __init__(self, config, reads: int):
        super().__init__(config, reads, k_point="k_rope", v_point=V_NORM.name)
        self.q_norm = WidthNorm(config.head_dim, config.rms_eps, axis="Dh", step="s6.2")

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return self.point(Q_NORM.name, self.q_norm(q))

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        return super().maths(x, plan) | {Q_NORM.name: self.q_norm.op(Q.name, "q_norm.")}


class Gemma4FeedForward(FeedForward):
    """GeGLU, its width in numbers (a KV-shared layer's may be twice the others')."""

    def weights(self) -> tuple[Weight, ...]:
        F_ = str(self.ffn_dim)
        return (Weight("w_gate_up.weight", (f"2*{F_}", "D"), "s6.7", "matrix", (
                    Source("gate_proj.weight", "ffn_gate.weight", F_, "W_gate"),
                    Source("up_proj.weight", "ffn_up.weight", F_, "W_up"))),
                Weight("w_down.weight", ("D", F_), "s6.7", "matrix",
                       (Source("down_proj.weight", "ffn_down.weight", "D", "W_down"),)))


class Gemma4Block(Gemma2Block):
    """Gemma 2's four norms (scale w); the mixer of the layer's kind; then the per-layer input and the layer scalar."""

    attention = Gemma4Attention
    feed_forward = Gemma4FeedForward
    POINTS = tuple(RESID_FFN if p == RESID_POST else p for p in Gemma2Block.POINTS) + (
        PLE_GATE, PLE_IN, PLE_ACT, PLE_PROJ, PLE_NORM, RESID_PLE, RESID_SCALED)
    CHILDREN = {**Gemma2Block.CHILDREN, "ple_norm": ("post_per_layer_input_norm", "post_norm")}
    NORMS = {**Gemma2Block.NORMS, PLE_NORM.name: "ple_norm"}
    # Gemma 2's two additions (the feed-forward's now ends at resid_ffn), the per-layer input's (a step of the block's
    # own, post-normed), then the whole stream × the layer's learned scalar
    WIRING = (Gemma2Block.WIRING[0], replace(Gemma2Block.WIRING[1], total=RESID_FFN.name),
              Addition("ple", RESID_PLE.name, post_norm=PLE_NORM.name, output=PLE_PROJ.name))
    RESCALE = Rescale("layer_scalar", RESID_POST.name)

    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        d, eps, P = config.d_model, config.rms_eps, ple_width(config)
        self.attn_norm, self.ffn_norm = RMSNorm(d, eps), RMSNorm(d, eps, step="s6.7")
        self.post_attn_norm, self.post_ffn_norm = RMSNorm(d, eps, step="s6.6"), RMSNorm(d, eps, step="s6.7")
        self.ple_gate = nn.Linear(d, P, bias=False)  # (P, D)
        self.ple_proj = nn.Linear(P, d, bias=False)  # (D, P)
        self.ple_norm = RMSNorm(d, eps, step="s6.7")
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.ple_cols = [layer * P, (layer + 1) * P]  # this layer's columns of the model's per-layer input
        for m in self.modules():
            if isinstance(m, Module):
                m.layer = layer

    def attention_of(self, config, layer: int) -> Module:
        reads = shared_reads(config, layer)
        lc = layer_config(config, layer)
        if reads is not None:
            return Gemma4SharedAttention(lc, reads)
        return self.attention(lc, k_eq_v=is_global(config, layer) and global_part(config)["k_eq_v"])

    def feed_forward_of(self, config, layer: int) -> Module:
        wide = shared_reads(config, layer) is not None and config.parts.get(SHARED, {}).get("wide_ffn", False)
        return self.feed_forward(replace(config, ffn_dim=2 * config.ffn_dim) if wide else config)

    def weights(self) -> tuple[Weight, ...]:
        P = str(self.ple_gate.out_features)
        return (Weight("ple_gate.weight", (P, "D"), "s6.7", "matrix",
                       (Source("per_layer_input_gate.weight", "inp_gate.weight", P, "W_gate,ple"),)),
                Weight("ple_proj.weight", ("D", P), "s6.7", "matrix",
                       (Source("per_layer_projection.weight", "proj.weight", "D", "W_proj,ple"),)),
                Weight("layer_scalar", ("1",), "s6.7", "vector",
                       (Source("layer_scalar", "layer_output_scale.weight", "1", "s_layer"),)))

    def run(self, part: str, h: torch.Tensor, io) -> torch.Tensor:
        """The per-layer input's step (the stream h (B, T, D) as it is after the feed-forward): W_proj (gelu(W_gate h)
        ⊙ this layer's P numbers); the mixer and the feed-forward as Llama's."""
        if part != "ple":
            return super().run(part, h, io)
        g = self.point(PLE_GATE.name, self.ple_gate(h))  # (B, T, P)
        p = self.point(PLE_IN.name, io.per_layer)  # (B, T, P)
        a = self.point(PLE_ACT.name, F.gelu(g, approximate="tanh") * p)
        return self.point(PLE_PROJ.name, self.ple_proj(a))  # (B, T, D)

    def part_maths(self, part: str, x: str, plan: LayerPlan) -> dict[str, Op]:
        return {PLE_GATE.name: op("matmul", [x], ["ple_gate.weight"]),
                PLE_IN.name: op("slice", [PLE.name], cols=self.ple_cols, split="P"),
                PLE_ACT.name: op("glu", [PLE_GATE.name, PLE_IN.name], act="gelu_tanh", clamp=None),
                PLE_PROJ.name: op("matmul", [PLE_ACT.name], ["ple_proj.weight"])}


class Gemma4(Gemma2):
    """Gemma 2's model (embedding × √D, the logits soft-capped) with the per-layer inputs worked out before the layers,
    a final norm scaling by w, the global layers' proportional RoPE, and a cache for the KV-shared layers to read."""

    block = Gemma4Block
    POINTS = inserted(Gemma2.POINTS, "embed_scaled", PLE_TOK, PLE_TOK_SCALED, PLE_CTX, PLE_CTX_SCALED, PLE_CTX_NORM,
                      PLE_SUM, PLE)
    CHILDREN = {**Gemma2.CHILDREN, "ple_norm": ("model.per_layer_projection_norm", "per_layer_proj_norm")}

    def __init__(self, config):
        super().__init__(config)
        L, P = config.n_layers, ple_width(config)
        self.norm = RMSNorm(config.d_model, config.rms_eps, step="s8")
        self.ple_embed = nn.Embedding(config.vocab_size, L * P)  # (V, L·P): P numbers a layer for each token
        self.ple_proj = nn.Linear(config.d_model, L * P, bias=False)  # (L·P, D)
        self.ple_norm = WidthNorm(P, config.rms_eps, axis="P", step="s4")
        self.register_buffer("inv_freq", self.global_inv_freq(), persistent=False)

    def global_inv_freq(self) -> torch.Tensor:
        """The global layers' θ_i over their head width Dg: base^(−2i/Dg) for the first rotary·Dg/2 pairs, 0 (no turn)
        for the rest (transformers' "proportional" RoPE)."""
        g, base = global_part(self.config), self.config.rope_theta
        dg = g["head_dim"]
        turned = int(g["rotary"] * dg // 2)
        inv = 1.0 / (base ** (torch.arange(0, 2 * turned, 2, dtype=torch.int64, device="cpu").float() / dg))
        return torch.cat([inv, torch.zeros(dg // 2 - turned, device="cpu")])

    def weights(self) -> tuple[Weight, ...]:
        LP = str(self.ple_proj.out_features)
        return super().weights() + (
            Weight("ple_embed.weight", ("V", LP), "s4", "embedding",
                   (Source("model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight", "V", "E_ple"),)),
            Weight("ple_proj.weight", (LP, "D"), "s4", "matrix",
                   (Source("model.per_layer_model_projection.weight", "per_layer_model_proj.weight", LP, "W_ple"),)))

    def rope_plan(self, layer: int) -> Optional[dict]:
        if not is_global(self.config, layer):
            return super().rope_plan(layer)
        g = global_part(self.config)
        return {"table": "global", "base": self.config.rope_theta, "rotary_dim": g["head_dim"],
                "head_dim": g["head_dim"], "scaling": None, "pairs": "halves", "proportional": g["rotary"],
                "inv_freq": [float(f) for f in self.global_inv_freq()]}

    def per_layer_inputs(self, idx: torch.Tensor, dtype) -> torch.Tensor:
        """s4 each token's per-layer input, (B, T, L·P): its row of the per-layer table × √P, plus the projection of its
        scaled embedding × 1/√D, normed per layer, the sum × 1/√2."""
        P = ple_width(self.config)
        tok = self.point(PLE_TOK.name, self.ple_embed(idx))  # (B, T, L·P)
        tok = self.point(PLE_TOK_SCALED.name, tok * embed_scale(P, tok.dtype))
        x = self.embed(idx) * embed_scale(self.config.d_model, self.embed.weight.dtype)  # the scaled embedding
        ctx = self.point(PLE_CTX.name, self.ple_proj(x))  # (B, T, L·P)
        ctx = self.point(PLE_CTX_SCALED.name, ctx * self.config.d_model ** -0.5)
        B, T, LP = ctx.shape
        ctx = self.point(PLE_CTX_NORM.name, self.ple_norm(ctx.view(B, T, LP // P, P)).view(B, T, LP))
        both = self.point(PLE_SUM.name, ctx + tok)
        return self.point(PLE.name, both * 2.0 ** -0.5).to(dtype)

    def layer_inputs(self, idx, cache=None, start=0, input_pos=None, attention_mask=None, dtype=None) -> list:
        """Llama's, each with its layer's part of the per-layer input; without a cache, one for this pass, which the
        KV-shared layers read the keys and values of their earlier layer from."""
        if cache is None:
            cache = self.new_cache(start + idx.size(1), batch=idx.size(0))
        ple = self.per_layer_inputs(idx, dtype or self.embed.weight.dtype)
        base = super().layer_inputs(idx, cache, start, input_pos, attention_mask, dtype)
        return [Gemma4Input(*io, ple[..., block.ple_cols[0]:block.ple_cols[1]]) for io, block in zip(base, self.layers)]

    def model_maths(self) -> dict[str, Op]:
        P, D = ple_width(self.config), self.config.d_model
        dtype = self.embed.weight.dtype
        return super().model_maths() | {
            PLE_TOK.name: op("lookup", ["ids"], ["ple_embed.weight"]),
            PLE_TOK_SCALED.name: op("scale", [PLE_TOK.name], factor=float(embed_scale(P, dtype)), label="√P"),
            PLE_CTX.name: op("matmul", ["embed_scaled"], ["ple_proj.weight"]),
            PLE_CTX_SCALED.name: op("scale", [PLE_CTX.name], factor=D ** -0.5, label="1/√D"),
            PLE_CTX_NORM.name: self.ple_norm.op(PLE_CTX_SCALED.name, "ple_norm."),
            PLE_SUM.name: op("add", [PLE_CTX_NORM.name, PLE_TOK_SCALED.name]),
            PLE.name: op("scale", [PLE_SUM.name], factor=2.0 ** -0.5, label="1/√2")}


# ----------------------------------------------------------------------------------------------------------------
# reading a config


def refuse(field: str, value, why: str) -> LlmtraceError:
    return LlmtraceError(f"{field} {value!r} is not supported: {why}")


def _reads(types: list[str], n_shared: int) -> list[Optional[int]]:
    """Which earlier layer each layer reads its keys and values from (None: its own): a KV-shared layer (one of the last
    n_shared) reads the last layer before them of its kind, as transformers' kv_sharing_modes and llama.cpp decide."""
    n = len(types)
    first = n - n_shared
    out: list[Optional[int]] = [None] * n
    for i in range(first, n):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise refuse("num_kv_shared_layers", n_shared, f"layer {i} ({types[i]}) has no earlier layer of its kind "
                         "to share keys and values with")
        out[i] = earlier[-1]
    return out


def _parts(types: list[str], n_shared: int, wide: bool, global_: dict, ple: int) -> dict:
    return {GLOBAL: global_, SHARED: {"reads": _reads(types, n_shared), "wide_ffn": wide}, PER_LAYER: {"width": ple}}


def hf_config(cfg: dict) -> dict:
    for key, why in (("enable_moe_block", "llmtrace runs the dense Gemma 4 text models"),
                     ("use_bidirectional_attention", "llmtrace runs causal language models only"),
                     ("attention_bias", "no released Gemma 4 has biases on q, k, v and o")):
        if cfg.get(key):
            raise refuse(key, cfg[key], why)
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    if ple < 1:
        raise refuse("hidden_size_per_layer_input", cfg.get("hidden_size_per_layer_input"),
                     "llmtrace runs the Gemma 4 text models with per-layer inputs (E2B, E4B)")
    vocab = int(cfg["vocab_size"])
    if int(cfg.get("vocab_size_per_layer_input") or vocab) != vocab:
        raise refuse("vocab_size_per_layer_input", cfg["vocab_size_per_layer_input"], "llmtrace reads a per-layer "
                     "table of the vocabulary's size")
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise refuse("hidden_activation", act, "Gemma runs gelu_pytorch_tanh (GeGLU)")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise refuse("layer_types", types, f"Gemma 4 has {n} layers, each sliding_attention or full_attention")
    rope = cfg.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if full.get("rope_type", "proportional") not in ("proportional", "default") or local.get("rope_type", "default") != "default":
        raise refuse("rope_parameters", rope, "llmtrace runs Gemma 4's proportional global and default local RoPE")
    if float(full.get("factor", 1.0)) != 1.0:
        raise refuse("rope_parameters.full_attention.factor", full["factor"], "llmtrace runs an unscaled RoPE")
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    first_full = next((per_layer.get(i, {}) for i, t in enumerate(types) if t == "full_attention"), {})
    head_dim = int(cfg.get("head_dim") or 256)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    global_ = {"head_dim": int(cfg.get("global_head_dim") or first_full.get("head_dim") or 512),
               "kv_heads": int((cfg.get("num_global_key_value_heads") if k_eq_v else None)
                               or first_full.get("num_key_value_heads") or cfg.get("num_key_value_heads") or 1),
               "k_eq_v": k_eq_v, "rotary": float(full.get("partial_rotary_factor", 1.0))}
    window = int(cfg.get("sliding_window") or 512)
    return dict(head_dim=head_dim, ffn_act="gelu_tanh", attn_scale=1.0, tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                sliding_window=window, layer_types=["sliding" if t == "sliding_attention" else "full" for t in types],
                rope_theta=float(full.get("rope_theta") or 1_000_000.0),
                rope_local_theta=float(local.get("rope_theta") or 10_000.0), rope_scaling=None,
                final_softcap=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None,
                parts=_parts([t for t in types], int(cfg.get("num_kv_shared_layers") or 0),
                             bool(cfg.get("use_double_wide_mlp", False)), global_, ple))


def gguf_config(meta) -> dict:
    n = int(meta("block_count"))
    pattern = meta("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise LlmtraceError("GGUF metadata gemma4.attention.sliding_window_pattern is not one flag a layer")
    types = ["sliding" if s else "full" for s in pattern]
    kv = meta("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * n
    ffn = meta("feed_forward_length")
    ffn = ffn if isinstance(ffn, list) else [ffn] * n
    first_full = types.index("full")
    n_shared = int(meta("attention.shared_kv_layers") or 0)
    freqs = meta.tensor("rope_freqs.weight")  # 1 for a turned pair of a global head, 1e30 for a still one
    dg = int(meta("attention.key_length"))
    has = getattr(meta, "has_tensor", lambda name: True)
    global_ = {"head_dim": dg, "kv_heads": int(kv[first_full]),
               "k_eq_v": not has(f"blk.{first_full}.attn_v.weight"),
               "rotary": (sum(1 for f in freqs if f < 1e20) / (dg // 2)) if freqs else 1.0}
    ple = int(meta("embedding_length_per_layer_input") or 0)
    if ple < 1:
        raise LlmtraceError("GGUF metadata gemma4.embedding_length_per_layer_input is 0: llmtrace runs the Gemma 4 "
                            "text models with per-layer inputs (E2B, E4B)")
    sliding = types.index("sliding") if "sliding" in types else 0
    return dict(head_dim=int(meta("attention.key_length_swa") or dg), n_kv_heads=int(kv[sliding]),
                ffn_dim=int(min(ffn)), ffn_act="gelu_tanh", attn_scale=1.0, layer_types=types,
                sliding_window=int(meta("attention.sliding_window")),
                rope_theta=float(meta("rope.freq_base") or 1_000_000.0),
                rope_local_theta=float(meta("rope.freq_base_swa") or 10_000.0),
                final_softcap=float(meta("final_logit_softcapping")) if meta("final_logit_softcapping") else None,
                parts=_parts(types, n_shared, max(ffn) != min(ffn), global_, ple))


# What Gemma 4 changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "embed_norms": ("embedding × √D = √{d} ≈ {root} (s4); every RMSNorm scales by w as stored (Gemma 2 and 3: 1 + w)",
                    "嵌入 × √D = √{d} ≈ {root}（s4）；每个 RMSNorm 直接乘以存储的 w（Gemma 2 和 3 是 1 + w）"),
    "per_layer": ("per-layer inputs: a second table gives each token {p} numbers for each of the {n} layers, added "
                  "to a projection of its embedding (× 1/√D, normed per layer), × 1/√2; after its feed-forward each "
                  "layer adds RMSNorm(W_proj (gelu(W_gate h) ⊙ its {p} numbers)) to the stream",
                  "逐层输入：第二张嵌入表给每个词元在 {n} 层的每一层各 {p} 个数，加上它的嵌入的一个投影（× 1/√D，逐层做"
                  "归一化），再 × 1/√2；每层在前馈网络之后把 RMSNorm(W_proj (gelu(W_gate h) ⊙ 这 {p} 个数)) 加到残差流上"),
    "four_norms": ("four norms a layer (before and after attention, before and after the FFN); each layer's output × a "
                   "learned scalar",
                   "每层四个归一化（注意力前后、前馈网络前后）；每层的输出 × 一个学到的标量"),
    "qkv_norms": ("q/k RMSNorm per head, and the values RMS-normed without a scale; scores not scaled (the norms set "
                  "their size)",
                  "q/k 按头做 RMSNorm，值做不带缩放权重的 RMS 归一化；分数不再缩放（大小由归一化决定）"),
    "global": ("{g} of {n} layers are global: head width {dh} (the sliding ones {dh_local}), {kv} KV heads, RoPE base "
               "{base} on the first {share} of each head's pairs (proportional RoPE)",
               "{n} 层中有 {g} 层是全局层：头宽 {dh}（滑动窗口层为 {dh_local}），{kv} 个 KV 头，RoPE 基数 {base}，只作用"
               "在每个头前 {share} 的维度对上（比例 RoPE）"),
    "global_k_eq_v": ("{g} of {n} layers are global: head width {dh} (the sliding ones {dh_local}), {kv} KV heads, "
                      "RoPE base {base} on the first {share} of each head's pairs (proportional RoPE); the key "
                      "projection is also the values (attention_k_eq_v)",
                      "{n} 层中有 {g} 层是全局层：头宽 {dh}（滑动窗口层为 {dh_local}），{kv} 个 KV 头，RoPE 基数 {base}，"
                      "只作用在每个头前 {share} 的维度对上（比例 RoPE）；键的投影同时也是值（attention_k_eq_v）"),
    "shared": ("the last {k} layers compute no keys or values: {reads} from the cache and writes none (its KV cache "
               "costs nothing per token)",
               "最后 {k} 层不计算键和值：{reads_zh}，从 KV 缓存读取，自己不写入（它们的 KV 缓存每个词元不占空间）"),
    "shared_wide": ("the last {k} layers compute no keys or values: {reads} from the cache and writes none (its KV "
                    "cache costs nothing per token); their feed-forward is twice as wide",
                    "最后 {k} 层不计算键和值：{reads_zh}，从 KV 缓存读取，自己不写入（它们的 KV 缓存每个词元不占空间）；"
                    "它们的前馈网络宽一倍"),
    "geglu": ("GeGLU feed-forward: gelu_tanh(x W_gate) ⊙ (x W_up), width {f}",
              "GeGLU 前馈网络：gelu_tanh(x W_gate) ⊙ (x W_up)，宽 {f}"),
    "softcap": ("logits soft-capped: {cap}·tanh(logits / {cap})", "logits 软截断：{cap}·tanh(logits / {cap})"),
}


def changes(c) -> list[str]:
    g, P = global_part(c), ple_width(c)
    reads = c.parts.get(SHARED, {}).get("reads") or []
    shared = [(i, j) for i, j in enumerate(reads) if j is not None]
    n_global = sum(is_global(c, i) for i in range(c.n_layers))
    out = [say(WORDS, "embed_norms", d=c.d_model, root=f"{math.sqrt(c.d_model):.1f}"),
           say(WORDS, "per_layer", p=P, n=c.n_layers), say(WORDS, "four_norms"), say(WORDS, "qkv_norms"),
           say(WORDS, "global_k_eq_v" if g["k_eq_v"] else "global", g=n_global, n=c.n_layers, dh=g["head_dim"],
               dh_local=c.head_dim, kv=g["kv_heads"], base=f"{c.rope_theta:,.0f}", share=f"{g['rotary']:.0%}")]
    if shared:  # the pairs (layer, the layer it reads) said in each language: the list is the words' argument
        out.append(say(WORDS, "shared_wide" if c.parts.get(SHARED, {}).get("wide_ffn") else "shared", k=len(shared),
                       reads=", ".join(f"layer {i} reads layer {j}'s" for i, j in shared),
                       reads_zh="，".join(f"第 {i} 层读第 {j} 层的" for i, j in shared)))
    out.append(say(WORDS, "geglu", f=c.ffn_dim))
    if c.final_softcap:
        out.append(say(WORDS, "softcap", cap=f"{c.final_softcap:g}"))
    return out


FAMILY = Family(
    name="gemma4",
    title="Gemma 4",
    model=Gemma4,
    hf_types={"gemma4_text": "Gemma4ForCausalLM"},
    gguf_archs={"gemma4": False},  # the converter keeps q/k rows in HF order
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=WORDS,
    reads_rope=True,
    gguf_config_tensors=("rope_freqs.weight",),
    hf_wrappers={"gemma4": ("Gemma4ForConditionalGeneration", "model.language_model.")},
)
