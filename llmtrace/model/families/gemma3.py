"""Gemma 3: Gemma 2's layer (gemma2.py: embedding × √D, (1 + w) norms, four norms a layer, GeGLU, the score scale
query_pre_attn_scalar^-1/2) with Qwen3's RMSNorm on each query and key head before RoPE (qwen3.py), and no
soft-caps; 5 sliding-window layers to 1 global, each kind with its own RoPE base (1e4 local, 1e6 global): config
values (layer_types, sliding_window, rope_local_theta) that the core's masks and RoPE tables read.

From GGUF, three facts are not in the file and are taken as llama.cpp takes them (load_hparams, LLM_ARCH_GEMMA3):
the layer pattern (layer i global when i % 6 == 5), the local RoPE base when the file has no rope.freq_base_swa
(10000) and the score scale (1/√key_length; the 27B model, 62 layers, 1/√(D/H)): see gemma2.score_scale_gguf.
"""

from __future__ import annotations

from llmtrace.model.family import Family, say
from llmtrace.model.families.gemma2 import (Gemma2Block, GemmaModel, GemmaRMSNorm, from_gguf, gemma_hf_common,
                                            gemma_lines, refuse, score_scale_gguf)
from llmtrace.model.families.gemma2 import WORDS as GEMMA_WORDS
from llmtrace.model.families.qwen3 import Qwen3Attention

GLOBAL_EVERY = 6  # Gemma 3's pattern: 5 sliding-window layers, then a global one
ROPE_TYPES = ("default", "linear")  # what the global layers' RoPE may be (model.transformer.rope_inv_freq)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's per-head q/k RMSNorm, scaling by 1 + w; Gemma's score scale."""

    SCALE_LABEL = "1/√query_pre_attn_scalar"

    def __init__(self, config):
        super().__init__(config)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_eps, axis="Dh", step="s6.2")
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_eps, axis="Dh", step="s6.2")


class Gemma3Block(Gemma2Block):
    attention = Gemma3Attention


class Gemma3(GemmaModel):
    block = Gemma3Block


# ----------------------------------------------------------------------------------------------------------------
# reading a config


def _pattern(cfg: dict):
    every = int(cfg.get("sliding_window_pattern") or GLOBAL_EVERY)
    return lambda i: "sliding_attention" if (i + 1) % every else "full_attention"


def _rope(cfg: dict) -> dict:
    """The two RoPEs: transformers 5's rope_parameters per layer type, or the older rope_theta (global),
    rope_local_base_freq and rope_scaling (global only), with transformers' defaults 1e6 and 1e4."""
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if params and not (full or local) and "rope_theta" in params:  # one set for every layer
        raise refuse("rope_parameters", params, "Gemma 3 takes one set per layer type (full_attention, "
                     "sliding_attention)")
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    for name, p in (("full_attention", full), ("sliding_attention", local)):
        kind = p.get("rope_type", p.get("type", "default"))
        allowed = ROPE_TYPES if name == "full_attention" else ("default",)
        if kind not in allowed:
            raise refuse(f"rope_parameters.{name}.rope_type", kind, f"llmtrace runs {' and '.join(allowed)} there")
    kind = full.get("rope_type", full.get("type", "default"))
    scaling = {"rope_type": "linear", "factor": float(full["factor"])} if kind == "linear" else None
    return dict(rope_theta=float(full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0),
                rope_local_theta=float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0),
                rope_scaling=scaling)


def hf_config(cfg: dict) -> dict:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise refuse(key, cfg[key], "Gemma 3 has no soft-cap (transformers' Gemma 3 attention ignores "
                         "attn_logit_softcapping, and no released Gemma 3 sets either); Gemma 2 has them")
    out = gemma_hf_common(cfg, 4096, 131072, _pattern(cfg))
    return out | _rope(cfg)


def gguf_config(meta) -> dict:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if meta(key) is not None:
            raise refuse(f"gemma3.{key}", meta(key), "Gemma 3 has no soft-cap")
    n = int(meta("block_count"))
    out = dict(ffn_act="gelu_tanh", attn_scale=score_scale_gguf(meta, n, 62),
               rope_local_theta=float(meta("rope.freq_base_swa") or 10_000.0))
    window = meta("attention.sliding_window")
    if window:
        out.update(sliding_window=int(window),
                   layer_types=["full" if i % GLOBAL_EVERY == GLOBAL_EVERY - 1 else "sliding" for i in range(n)])
    return out


def changes(c) -> list[str]:
    out = gemma_lines(c, qk_norm=True)
    out.append(say(GEMMA_WORDS, "geglu", f=c.ffn_dim))
    if from_gguf(c) and c.layer_types:
        out.append(say(GEMMA_WORDS, "gguf_pattern"))
    return out


FAMILY = Family(
    name="gemma3",
    title="Gemma 3",
    model=Gemma3,
    hf_types={"gemma3_text": "Gemma3ForCausalLM"},
    gguf_archs={"gemma3": False},  # the converter keeps q/k rows in HF order
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=GEMMA_WORDS,
)
