"""Gemma 2: Llama with
  - the embedding scaled by √D (s4), the factor rounded to the model's dtype first, as transformers does;
  - RMSNorm as x̂·(1 + w): an HF checkpoint stores w (the loader adds the 1), llama.cpp's converter stores 1 + w;
  - four norms a layer: before attention, on attention's output before the residual add (post_attn_norm, s6.6),
    before the feed-forward (ffn_norm) and on its output (post_ffn_norm, s6.7);
  - GeGLU: the gate through GELU (tanh approximation) instead of SiLU (a config value, ffn_act);
  - the scores scaled by query_pre_attn_scalar^-1/2 (a config value, attn_scale) and soft-capped,
    cap·tanh(s / cap), before the mask (s6.4); the logits soft-capped the same way (s9);
  - a sliding window on every other layer (layer_types, a config value; the mask is the core's).
The soft-caps keep attention on the spelled-out path: the fused kernel has no tanh.

Gemma 3 (gemma3.py) builds on these modules.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family, say
from llmtrace.model.llama_points import (ATTN_NORM, EMBED, FFN_NORM, K_REPEATED, LAST, LOGITS, RESID_MID, RESID_POST,
                                         SCORES)
from llmtrace.model.maths import LayerPlan, Op, op
from llmtrace.model.points import Point, Source, Weight, inserted
from llmtrace.model.transformer import Attention, Block, RMSNorm, Transformer, grouped_matmul
from llmtrace.model.wiring import Addition
from llmtrace.units import plural

EMBED_SCALED = Point("embed_scaled", "s4", ("T", "D"), about="the embedding × √D: the stream entering layer 0",
                     input="embed")
POST_ATTN_NORM = Point("post_attn_norm", "s6.6", ("T", "D"), about="RMSNorm of attention's output, before the residual add",
                       input="o_proj")
POST_FFN_NORM = Point("post_ffn_norm", "s6.7", ("T", "D"), about="RMSNorm of the feed-forward's output, before the "
                      "residual add", input="down")
SCORES_RAW = Point("scores_raw", "s6.4", ("H", "T", "S"), about="Q·Kᵀ·scale before the soft-cap and the mask")
SCORES_CAPPED = replace(SCORES, about="cap·tanh(scores_raw / cap), masked keys at -inf")
LOGITS_RAW = Point("logits_raw", "s9", ("V",), about="the LM head's output before the soft-cap")
LOGITS_CAPPED = replace(LOGITS, about="cap·tanh(logits_raw / cap): one score per vocabulary entry")


def softcap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap·tanh(x / cap): x squeezed smoothly into (-cap, cap), nearly unchanged where |x| ≪ cap; x itself without a
    cap. The operations in transformers' order, so that float32 agrees bit for bit."""
    return x if cap is None else torch.tanh(x / cap) * cap


def embed_scale(d_model: int, dtype: torch.dtype) -> torch.Tensor:
    """√D as Gemma multiplies by it: a float32 number rounded to the model's dtype (√640 = 25.298 in float32, 25.25
    in bfloat16), as a 0-dim tensor (a constant to torch.compile, on any device)."""
    return torch.tensor(d_model ** 0.5, dtype=torch.float32).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# the modules


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose scale is 1 + w: the parameter holds 1 + w (an HF checkpoint's w plus the 1 the loader adds; a
    GGUF's value as it is), so the maths is Llama's norm."""

    GAMMA = "1 + w"

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("weight", (self.axis,), self.step, "vector", (Source("weight", "weight", hf_add=1.0),),
                       math="γ"),)


class Gemma2Attention(Attention):
    """Llama's attention with the scores soft-capped before the mask; always spelled out (no fused kernel caps)."""

    POINTS = tuple(SCORES_CAPPED if p == SCORES else p for p in inserted(Attention.POINTS, K_REPEATED.name, SCORES_RAW))
    SCALE_LABEL = "1/√query_pre_attn_scalar"
    fused = False  # no fused kernel caps the scores

    def __init__(self, config):
        super().__init__(config)
        self.cap = score_cap(config)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """cap·tanh(Q Kᵀ · scale / cap): (B, H, T, Dh), (B, Hkv, S, Dh) -> (B, H, T, S)."""
        raw = self.point(SCORES_RAW.name, grouped_matmul(q, k.transpose(-2, -1)) * self.scale)  # (B, H, T, S)
        return softcap(raw, self.cap)

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        out = super().maths(x, plan)
        mask = {k: out[SCORES.name].const(k) for k in ("mask", "window")}
        raw = op("scores", ["q_rope", "k_repeated"], scale=self.scale, scale_label=self.SCALE_LABEL, softcap=None,
                 mask=None, window=None)
        capped = op("softcap", [SCORES_RAW.name], cap=self.cap, **mask) if self.cap else op(
            "scores", ["q_rope", "k_repeated"], scale=self.scale, scale_label=self.SCALE_LABEL, softcap=None, **mask)
        return out | {SCORES_RAW.name: raw, SCORES.name: capped}


class Gemma2Block(Block):
    """Four norms: each sub-layer's input and its output are normed, then the output is added to the stream."""

    attention = Gemma2Attention
    POINTS = inserted(inserted(Block.POINTS, "attn", POST_ATTN_NORM), "ffn", POST_FFN_NORM)
    CHILDREN = {"attn_norm": ("input_layernorm", "attn_norm"), "attn": ("self_attn", ""),
                "post_attn_norm": ("post_attention_layernorm", "post_attention_norm"),
                "ffn_norm": ("pre_feedforward_layernorm", "ffn_norm"), "ffn": ("mlp", ""),
                "post_ffn_norm": ("post_feedforward_layernorm", "post_ffw_norm")}
    NORMS = {ATTN_NORM.name: "attn_norm", POST_ATTN_NORM.name: "post_attn_norm", FFN_NORM.name: "ffn_norm",
             POST_FFN_NORM.name: "post_ffn_norm"}
    WIRING = (Addition("attn", RESID_MID.name, norm=ATTN_NORM.name, post_norm=POST_ATTN_NORM.name),
              Addition("ffn", RESID_POST.name, norm=FFN_NORM.name, post_norm=POST_FFN_NORM.name))

    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        d, eps = config.d_model, config.rms_eps
        self.attn_norm = GemmaRMSNorm(d, eps)
        self.post_attn_norm = GemmaRMSNorm(d, eps, step="s6.6")
        self.ffn_norm = GemmaRMSNorm(d, eps, step="s6.7")
        self.post_ffn_norm = GemmaRMSNorm(d, eps, step="s6.7")


class GemmaModel(Transformer):
    """The embedding scaled by √D; the final norm as x̂·(1 + w)."""

    POINTS = inserted(Transformer.POINTS, EMBED.name, EMBED_SCALED)
    STREAM_IN = EMBED_SCALED.name

    def __init__(self, config):
        super().__init__(config)
        self.norm = GemmaRMSNorm(config.d_model, config.rms_eps, step="s8")

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """s4: ids (B, T) -> their embedding rows × √D (B, T, D)."""
        x = self.point(EMBED.name, self.embed(idx))  # (B, T, D)
        return self.point(EMBED_SCALED.name, x * embed_scale(self.config.d_model, x.dtype))

    def model_maths(self) -> dict[str, Op]:
        factor = float(embed_scale(self.config.d_model, self.embed.weight.dtype))
        return super().model_maths() | {EMBED_SCALED.name: op("scale", [EMBED.name], factor=factor, label="√D")}


class Gemma2(GemmaModel):
    """...and the logits soft-capped."""

    block = Gemma2Block
    POINTS = tuple(LOGITS_CAPPED if p == LOGITS else p for p in inserted(GemmaModel.POINTS, LAST.name, LOGITS_RAW))

    def head(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        x = self.point("final_norm", self.norm(x))  # s8: (B, T, D)
        if last_only:
            x = self.point("last", x[:, -1, :])  # s7: (B, D)
        raw = self.point(LOGITS_RAW.name, self.lm_head(x))  # s9: (B, V) or (B, T, V)
        return self.point("logits", softcap(raw, self.config.final_softcap))

    def model_maths(self) -> dict[str, Op]:
        out = super().model_maths()
        cap = self.config.final_softcap
        head = out[LOGITS.name]
        return out | {LOGITS_RAW.name: head, LOGITS.name: op("softcap", [LOGITS_RAW.name], cap=cap) if cap else
                      Op("matmul", head.inputs, head.weights, head.consts)}


# ----------------------------------------------------------------------------------------------------------------
# reading a config


def refuse(field: str, value, why: str) -> LlmtraceError:
    return LlmtraceError(f"{field} {value!r} is not supported: {why}")


def gemma_hf_common(cfg: dict, default_window: int, default_ctx: int, pattern: Callable[[int], str]) -> dict:
    """The fields Gemma 2 and 3 read alike, with transformers' defaults for the keys a config.json leaves out."""
    if cfg.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", True, "llmtrace runs causal language models only")
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"  # Gemma's MLP reads hidden_activation, not hidden_act
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise refuse("hidden_activation", act, "Gemma runs gelu_pytorch_tanh (GeGLU)")
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window", default_window)
    types = cfg.get("layer_types") or [pattern(i) for i in range(n)]
    out = dict(ffn_act="gelu_tanh", attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
               head_dim=int(cfg.get("head_dim") or 256), tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
               max_seq_len=int(cfg.get("max_position_embeddings") or default_ctx), sliding_window=None,
               layer_types=None)
    if window:
        unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
        if unknown:
            raise refuse("layer_types", unknown[0], "Gemma's layers are sliding_attention or full_attention")
        if len(types) != n:
            raise LlmtraceError(f"layer_types has {plural(len(types), 'entry', 'entries')} for {plural(n, 'layer')}")
        out.update(sliding_window=int(window),
                   layer_types=["sliding" if t == "sliding_attention" else "full" for t in types])
    return out


def score_scale_gguf(meta, n_layers: int, big_model_layers: int) -> float:
    """The score scale of a Gemma GGUF, which stores no query_pre_attn_scalar: llama.cpp's rule (load_hparams),
    1/√key_length, except the 27B model (known by its layer count) whose scalar is D/H. transformers' GGUF loader
    would take its default 256 instead, which is the same for every released size with head_dim 256 and wrong for
    the 27B models (query_pre_attn_scalar 144 in Gemma 2 27B, 168 in Gemma 3 27B = D/H)."""
    d, h = int(meta("embedding_length")), int(meta("attention.head_count"))
    key_length = int(meta("attention.key_length") or d // h)
    return (d / h) ** -0.5 if n_layers == big_model_layers else key_length ** -0.5


def hf_config(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or {}
    if "sliding_attention" in rope or "full_attention" in rope:
        raise refuse("rope_parameters", "per layer type", "Gemma 2 has one RoPE for every layer")
    out = gemma_hf_common(cfg, 4096, 8192, lambda i: "sliding_attention" if i % 2 == 0 else "full_attention")
    out.update(parts=_score_cap(_cap(cfg, "attn_logit_softcapping", 50.0)),
               final_softcap=_cap(cfg, "final_logit_softcapping", 30.0))
    return out


SCORE_CAP = "softcap"  # the config part of the scores' soft-cap (ModelConfig.parts): {"cap": 50.0}


def _score_cap(cap: Optional[float]) -> dict:
    return {SCORE_CAP: {"cap": cap}} if cap else {}


def score_cap(config) -> Optional[float]:
    """The scores' soft-cap, or None (no cap)."""
    return config.parts.get(SCORE_CAP, {}).get("cap")


def _cap(cfg: dict, key: str, default: float) -> Optional[float]:
    value = cfg.get(key, default)
    if value is not None and not float(value) > 0:
        raise refuse(key, value, "a soft-cap is a positive number (or null: none)")
    return None if value is None else float(value)


def gguf_config(meta) -> dict:
    n = int(meta("block_count"))
    window = meta("attention.sliding_window")
    # llama.cpp's defaults where the file says nothing: caps 50 and 30, the window on even layers (set_swa_pattern(2))
    out = dict(ffn_act="gelu_tanh", attn_scale=score_scale_gguf(meta, n, 46),
               parts=_score_cap(float(meta("attn_logit_softcapping", 50.0))),
               final_softcap=float(meta("final_logit_softcapping", 30.0)))
    if window:
        out.update(sliding_window=int(window), layer_types=["sliding" if i % 2 == 0 else "full" for i in range(n)])
    return out


def from_gguf(c) -> bool:
    return (c.extra or {}).get("format") == "gguf"


# What Gemma changes from Llama, each line in English and Chinese (model.family.say), Gemma 3's too.
WORDS = {
    "embed": ("embedding × √D = √{d} ≈ {root} (s4)", "嵌入 × √D = √{d} ≈ {root}（s4）"),
    "norm_1w": ("RMSNorm scales by 1 + w (a GGUF stores 1 + w)", "RMSNorm 乘以 1 + w（GGUF 存的是 1 + w）"),
    "four_norms": ("four norms a layer: before attention, on its output (s6.6), before the FFN, on its output (s6.7)",
                   "每层四个归一化：注意力之前、注意力输出上（s6.6）、FFN 之前、FFN 输出上（s6.7）"),
    "qk_norm": ("q/k RMSNorm per head (width {dh}) after the split into heads, before RoPE",
                "q/k 按头做 RMSNorm（宽 {dh}），在拆成多头之后、RoPE 之前"),
    "scale_gguf": ("scores × 1/√{s}: the GGUF stores no query_pre_attn_scalar; llama.cpp's rule ({rule})",
                   "分数 × 1/√{s}：GGUF 不存 query_pre_attn_scalar；按 llama.cpp 的规则（{rule}）"),
    "scale_same": ("scores × 1/√{s} (query_pre_attn_scalar {s}, = Dh here)",
                   "分数 × 1/√{s}（query_pre_attn_scalar {s}，这里等于 Dh）"),
    "scale_other": ("scores × 1/√{s} (query_pre_attn_scalar {s}) instead of 1/√Dh = 1/√{dh}",
                    "分数 × 1/√{s}（query_pre_attn_scalar {s}），而不是 1/√Dh = 1/√{dh}"),
    "softcap_scores": ("scores soft-capped {cap}·tanh(s/{cap}) before the mask (s6.4)",
                       "分数在掩码之前软截断为 {cap}·tanh(s/{cap})（s6.4）"),
    "no_softcap_scores": ("no soft-cap on the scores (attn_logit_softcapping null)",
                          "分数不做软截断（attn_logit_softcapping 为空）"),
    "geglu": ("GeGLU feed-forward: gelu_tanh(x W_gate) ⊙ (x W_up), width {f}",
              "GeGLU 前馈网络：gelu_tanh(x W_gate) ⊙ (x W_up)，宽 {f}"),
    "softcap_logits": ("logits soft-capped {cap}·tanh(x/{cap}) (s9)", "logits 软截断为 {cap}·tanh(x/{cap})（s9）"),
    "no_softcap_logits": ("no soft-cap on the logits (final_logit_softcapping null)",
                          "logits 不做软截断（final_logit_softcapping 为空）"),
    "gguf_pattern": ("the GGUF stores no layer pattern: llama.cpp's, layer i global when i % 6 = 5",
                     "GGUF 不存层的排布：按 llama.cpp 的，i % 6 = 5 的第 i 层为全局层"),
}


def scale_line(c) -> str:
    """The score scale, and where it came from: config.json's query_pre_attn_scalar, or llama.cpp's rule for a GGUF
    (which does not store it)."""
    scalar = c.attn_scale ** -2
    same = abs(scalar - c.head_dim) < 1e-6 * scalar
    if from_gguf(c):
        return say(WORDS, "scale_gguf", s=f"{scalar:g}", rule="1/√Dh" if same else "1/√(D/H) for this size")
    return say(WORDS, "scale_same" if same else "scale_other", s=f"{scalar:g}", dh=c.head_dim)


def gemma_lines(c, qk_norm: bool) -> list[str]:
    """Gemma's changes, in the order the maths runs (Gemma 3 adds the q/k norm)."""
    out = [say(WORDS, "embed", d=c.d_model, root=f"{c.d_model ** 0.5:.4g}"), say(WORDS, "norm_1w"),
           say(WORDS, "four_norms")]
    if qk_norm:
        out.append(say(WORDS, "qk_norm", dh=c.head_dim))
    out.append(scale_line(c))
    return out


def changes(c) -> list[str]:
    out = gemma_lines(c, qk_norm=False)
    out.append(say(WORDS, "softcap_scores", cap=f"{score_cap(c):g}") if score_cap(c) else
               say(WORDS, "no_softcap_scores"))
    out.append(say(WORDS, "geglu", f=c.ffn_dim))
    out.append(say(WORDS, "softcap_logits", cap=f"{c.final_softcap:g}") if c.final_softcap else
               say(WORDS, "no_softcap_logits"))
    return out


FAMILY = Family(
    name="gemma2",
    title="Gemma 2",
    model=Gemma2,
    hf_types={"gemma2": "Gemma2ForCausalLM"},
    gguf_archs={"gemma2": False},  # the converter keeps q/k rows in HF order
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=WORDS,
)
