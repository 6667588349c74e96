"""The HF adapter: a directory with config.json and *.safetensors -> ModelConfig and tensor entries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


from llmtrace.errors import LlmtraceError
from llmtrace.checkpoint.weights import FileTensor, safetensors_entries
from llmtrace.model.family import Family, family_of_hf, hf_types, hf_wrapper, not_yet
from llmtrace.model.transformer import ModelConfig
from llmtrace.units import plural

def hf_family(cfg: dict, where: str) -> Family:
    """The model family of a config.json, decided as transformers' auto classes decide it: by `model_type` (its
    `architectures` list only names the head a checkpoint was saved with, and may be absent). A config without
    `model_type` is read by its first architecture."""
    types = hf_types()
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type is None and archs:
        model_type = next((t for t, a in types.items() if a == archs[0]), None)
    family = family_of_hf(model_type) if isinstance(model_type, str) else None
    if family is not None:
        return family
    why = not_yet(model_type)
    if why:
        raise LlmtraceError(f"{where}: model_type {model_type!r} is not supported yet: {why}, which llmtrace does not "
                            f"run")
    said = ", ".join(f"{key} {value!r}" for key, value in (("model_type", cfg.get("model_type")),
                                                           ("architectures", archs or None))
                     if value is not None) or "neither model_type nor architectures"
    raise LlmtraceError(f"{where}: {said} is not supported; llmtrace runs model_type "
                        f"{', '.join(sorted(types))} ({', '.join(types.values())})")


def family_fields(read, source, where: str) -> dict:
    """A family's own config fields (Family.hf_config / gguf_config); what it refuses is said with the file's name."""
    try:
        return read(source)
    except LlmtraceError as e:
        raise LlmtraceError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------------------------------------------
# HF directories: config.json + safetensors

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def hf_activation(cfg: dict, where: str) -> str:
    """The feed-forward gate's activation (hidden_act; Gemma's hidden_activation)."""
    key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    act = cfg.get(key) or "silu"
    if act not in ACTIVATIONS:
        raise LlmtraceError(f"{where}: {key} {act!r} is not supported (llmtrace runs {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def hf_window(cfg: dict, n_layers: int, where: str) -> dict:
    """sliding_window and layer_types: which layers see only the last W tokens. A window is not a context limit:
    positions go on past it. Mistral's window covers every layer; transformers writes `layer_types` for the families
    that mix (Gemma, Qwen with use_sliding_window). `use_sliding_window: false` turns a given window off."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return {}
    types = cfg.get("layer_types") or ["sliding_attention"] * n_layers
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise LlmtraceError(f"{where}: layer_types {unknown[0]!r} is not supported (llmtrace runs "
                            f"{', '.join(LAYER_TYPES)})")
    if len(types) != n_layers:
        raise LlmtraceError(f"{where}: layer_types has {plural(len(types), 'entry', 'entries')} "
                            f"for {plural(n_layers, 'layer')}")
    return {"sliding_window": int(window), "layer_types": [LAYER_TYPES[t] for t in types]}


def text_model(cfg: dict, where: str) -> tuple[dict, Optional[str]]:
    """A config.json that wraps a family's text model with other parts (Family.hf_wrappers: Qwen3.5's vision
    checkpoint): the text model's config and the key prefix of its tensors; any other: (cfg, None)."""
    wrapper = hf_wrapper(cfg.get("model_type"))
    if wrapper is None:
        return cfg, None
    family, arch, prefix = wrapper
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise LlmtraceError(f"{where}: config.json of a {arch} lacks its text_config, the text model llmtrace runs")
    tie = {"tie_word_embeddings": cfg["tie_word_embeddings"]} if "tie_word_embeddings" in cfg else {}
    return {"model_type": next(iter(family.hf_types))} | text | tie, prefix


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    """The fields every family shares, read as transformers reads them, then the family's own (Family.hf_config).
    A checkpoint that wraps a text model (text_model) is read as that text model."""
    outer, (cfg, prefix) = cfg, text_model(cfg, where)
    family = hf_family(cfg, where)
    if cfg.get("mlp_bias"):
        raise LlmtraceError(f"{where}: mlp_bias = true is not supported")
    try:
        d, h = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps theta and scaling together
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        kind_s = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if family.reads_rope or kind_s in (None, "default"):
            scaling = None  # none, or the family's own to read (its hf_config sets rope_scaling)
        if scaling is not None:
            if kind_s not in ("linear", "llama3"):
                raise LlmtraceError(f"{where}: rope_scaling type {kind_s!r} is not supported (linear and llama3 are)")
        n_layers = int(cfg["num_hidden_layers"])
        fields = dict(
            arch=str(cfg.get("model_type") or family.name),
            family=family.name,
            n_layers=n_layers,
            d_model=d,
            n_heads=h,
            n_kv_heads=int(cfg.get("num_key_value_heads") or h),
            head_dim=int(cfg.get("head_dim") or d // h),
            ffn_dim=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_seq_len=int(cfg.get("max_position_embeddings") or 4096),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            ffn_act=hf_activation(cfg, where),
            **hf_window(cfg, n_layers, where),
        )
        config = ModelConfig.from_dict(fields | family_fields(family.hf_config, cfg, where))
        if prefix is not None:  # what the text model was read from, for the run header
            config.extra = {"text_model_of": (outer.get("architectures") or [outer.get("model_type")])[0]}
        return config
    except KeyError as e:
        raise LlmtraceError(f"{where}: config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise LlmtraceError(f"{where}: config.json has a bad value: {e}") from None


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


def hf_entries(path: Path, text_prefix: Optional[str] = None) -> dict[str, "FileTensor"]:
    """Every tensor of the directory's safetensors files, not yet read, under its own key. RoPE's frequency tables,
    which some checkpoints carry, are left out: they are computed from the config. With `text_prefix` (a checkpoint
    that wraps a text model: text_model), only the text model's tensors, under the keys of the text model alone
    (the prefix "model.language_model." read as "model."), and its LM head."""
    out: dict[str, FileTensor] = {}
    for f in _safetensors_files(path):
        for key, entry in safetensors_entries(f).items():
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if text_prefix is not None:
                if not key.startswith(text_prefix) and key != "lm_head.weight":
                    continue  # the vision encoder, multi-token prediction layers: not the text model
                key = "model." + key[len(text_prefix):] if key.startswith(text_prefix) else key
            out[key] = entry
    return out
