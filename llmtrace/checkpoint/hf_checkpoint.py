"""The HF adapter: a directory with config.json and *.safetensors -> ModelConfig and tensor entries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


from llmtrace.errors import LlmtraceError
from llmtrace.checkpoint.weights import FileTensor, safetensors_entries
from llmtrace.model.transformer import ModelConfig

SUPPORTED_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


# ----------------------------------------------------------------------------------------------------------------
# HF directories: config.json + safetensors


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else cfg.get("model_type", "unknown")
    if arch not in SUPPORTED_HF_ARCHS:
        names = ", ".join(SUPPORTED_HF_ARCHS)
        raise LlmtraceError(f"{where}: architecture {arch!r} is not supported (llmtrace runs the LLaMA family: {names})")
    kind = SUPPORTED_HF_ARCHS[arch]
    if cfg.get("mlp_bias"):
        raise LlmtraceError(f"{where}: mlp_bias = true is not supported")
    try:
        d, h = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps theta and scaling together
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if scaling is not None:
            kind_s = scaling.get("rope_type", scaling.get("type"))
            if kind_s not in ("linear", "llama3"):
                raise LlmtraceError(f"{where}: rope_scaling type {kind_s!r} is not supported (linear and llama3 are)")
        max_len = int(cfg.get("max_position_embeddings", 4096))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", kind == "mistral") else None
        if window:
            max_len = min(max_len, int(window))  # within the window, sliding attention equals full attention
        return ModelConfig(
            arch=kind,
            n_layers=int(cfg["num_hidden_layers"]),
            d_model=d,
            n_heads=h,
            n_kv_heads=int(cfg.get("num_key_value_heads") or h),
            head_dim=int(cfg.get("head_dim") or d // h),
            ffn_dim=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_seq_len=max_len,
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=bool(cfg.get("attention_bias", kind == "qwen2")),
        )
    except KeyError as e:
        raise LlmtraceError(f"{where}: config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise LlmtraceError(f"{where}: config.json has a bad value: {e}") from None


# HF parameter name -> llmtrace name, per layer ({i}); q/k/v and gate/up are fused after renaming.
HF_LAYER_KEYS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.q_proj.bias": "attn.q.bias",
    "self_attn.k_proj.bias": "attn.k.bias",
    "self_attn.v_proj.bias": "attn.v.bias",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "mlp.gate_proj.weight": "ffn.gate.weight",
    "mlp.up_proj.weight": "ffn.up.weight",
    "mlp.down_proj.weight": "ffn.w_down.weight",
}
HF_TOP_KEYS = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LlmtraceError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(found)}: pickle checkpoints are never loaded; convert them to safetensors)" if found else ""
        raise LlmtraceError(f"{path}: no *.safetensors weight files{hint}")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise LlmtraceError(f"{path}: weight file {missing[0]} named in the index is missing")
    return files


def hf_entries(path: Path) -> dict[str, "FileTensor"]:
    """Every tensor of the directory's safetensors files, not yet read, under llmtrace's names."""
    out: dict[str, FileTensor] = {}
    for f in _safetensors_files(path):
        for key, entry in safetensors_entries(f).items():
            name = _rename_hf(key)
            if name is not None:
                out[name] = entry
    return out


def _rename_hf(key: str) -> Optional[str]:
    if key in HF_TOP_KEYS:
        return HF_TOP_KEYS[key]
    if key.startswith("model.layers."):
        rest = key[len("model.layers."):]
        i, _, sub = rest.partition(".")
        if sub in HF_LAYER_KEYS:
            return f"layers.{i}.{HF_LAYER_KEYS[sub]}"
        if sub.endswith("rotary_emb.inv_freq"):
            return None
    return key  # unknown keys are kept so that check_weights can name them
