"""Checkpoint adapters: an HF directory (safetensors) or a GGUF file -> ModelConfig + weights + tokenizer.

Each format maps onto one internal layout, the parameter names of llmtrace.model.Transformer. Key renames and the
llama.cpp q/k row permutation are tables and small named transforms here, kept out of the model.

A GGUF is converted once (read, dequantize, un-permute, fuse) and the result cached as safetensors in the user cache
directory, so later loads are a memory-mapped read.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
import torch.nn as nn

from llmtrace.devices import (DTYPES, cpuinfo_cores, physical_cores, pick_device, pick_dtype,  # noqa: F401
                              set_threads, thread_count)
from llmtrace.errors import LlmtraceError, UsageError, one_line
from llmtrace.gguf_file import GGUFField, GGUFFile, GGUFTensor, open_gguf  # noqa: F401
from llmtrace.loaded import LoadedModel
from llmtrace.model import ModelConfig, Transformer
from llmtrace.registry import CONVERSION_SOURCE, conversion_source, converted_dir  # the cache's business
from llmtrace.tokenizer import load_tokenizer  # noqa: F401  (it needs no torch, so `tokenize` loads it from there)

SUPPORTED_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_GGUF_ARCHS = {"llama", "mistral", "qwen2"}


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


# ----------------------------------------------------------------------------------------------------------------
# GGUF


def _gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def config_from_gguf(reader, where: str) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture", "unknown")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise LlmtraceError(f"{where}: architecture {arch!r} is not supported (llmtrace runs the LLaMA family: "
                            f"{', '.join(sorted(SUPPORTED_GGUF_ARCHS))})")

    def need(key):
        v = _gguf_field(reader, f"{arch}.{key}")
        if v is None:
            raise LlmtraceError(f"{where}: GGUF metadata lacks {arch}.{key}")
        return v

    d, h = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _gguf_field(reader, f"{arch}.vocab_size") or (len(tokens.contents()) if tokens is not None else None)
    if vocab is None:
        raise LlmtraceError(f"{where}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    scaling = None
    s_type = _gguf_field(reader, f"{arch}.rope.scaling.type")
    if s_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(_gguf_field(reader, f"{arch}.rope.scaling.factor"))}
    elif s_type not in (None, "none"):
        raise LlmtraceError(f"{where}: rope scaling {s_type!r} is not supported (linear and llama3 are)")
    head_dim = _gguf_field(reader, f"{arch}.attention.key_length") or _gguf_field(reader, f"{arch}.rope.dimension_count") or d // h
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        arch=arch,
        n_layers=int(need("block_count")),
        d_model=d,
        n_heads=h,
        n_kv_heads=int(_gguf_field(reader, f"{arch}.attention.head_count_kv") or h),
        head_dim=int(head_dim),
        ffn_dim=int(need("feed_forward_length")),
        vocab_size=int(vocab),
        max_seq_len=int(_gguf_field(reader, f"{arch}.context_length", 4096)),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_eps=float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        attn_bias="blk.0.attn_q.bias" in names,
    )


GGUF_LAYER_KEYS = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "attn.q.weight",
    "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight",
    "attn_q.bias": "attn.q.bias",
    "attn_k.bias": "attn.k.bias",
    "attn_v.bias": "attn.v.bias",
    "attn_output.weight": "attn.wo.weight",
    "ffn_gate.weight": "ffn.gate.weight",
    "ffn_up.weight": "ffn.up.weight",
    "ffn_down.weight": "ffn.w_down.weight",
}
GGUF_TOP_KEYS = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. llama.cpp stores each head's rows interleaved (x0, x_half, x1, ...) for its
    pairwise RoPE; HF and llmtrace rotate the halves (x_i, x_{i+Dh/2}). Works on weights (rows, D) and biases (rows,)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_entries(reader, config: ModelConfig, where: str) -> dict[str, "GGUFEntry"]:
    """Every tensor of the GGUF file, not yet read, under llmtrace's names; q/k entries undo llama.cpp's row order."""
    out: dict[str, GGUFEntry] = {}
    for t in reader.tensors:
        name = _rename_gguf(t.name)
        if name is None:
            continue
        heads = None
        if config.arch in ("llama", "mistral"):  # converted with the q/k permutation; qwen2 was not
            if name.endswith(("attn.q.weight", "attn.q.bias")):
                heads = config.n_heads
            elif name.endswith(("attn.k.weight", "attn.k.bias")):
                heads = config.n_kv_heads
        if t.tensor_type.name not in GGUF_DEQUANTIZABLE:
            raise LlmtraceError(f"{where}: tensor {t.name} uses quantization {t.tensor_type.name}, which llmtrace cannot "
                                f"dequantize (supported: {', '.join(sorted(GGUF_DEQUANTIZABLE))})")
        out[name] = GGUFEntry.of(reader.path, t, heads, where)
    return out


GGUF_DEQUANTIZABLE = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_K", "Q2_K",
                      "Q3_K"}


def read_gguf_weights(reader, config: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 (with the gguf package), under llmtrace's names, q/k rows in HF order."""
    out = {}
    for name, e in gguf_entries(reader, config, where).items():
        out[name] = torch.empty(e.shape, dtype=torch.float32)
        e.read_into(out[name])
    return out


def _rename_gguf(key: str) -> Optional[str]:
    if key in GGUF_TOP_KEYS:
        return GGUF_TOP_KEYS[key]
    if key == "rope_freqs.weight":
        return "rope_freqs"
    if key.startswith("blk."):
        i, _, sub = key[4:].partition(".")
        if sub in GGUF_LAYER_KEYS:
            return f"layers.{i}.{GGUF_LAYER_KEYS[sub]}"
    return key


# ----------------------------------------------------------------------------------------------------------------
# tensor by tensor: a checkpoint tensor is an entry that knows its shape and reads itself into a tensor it is given,
# so a load never holds a second copy of the weights. Files are read with readinto, not memory-mapped: the pages of
# a mapping count towards the process's resident memory for as long as it stays mapped.

CHUNK_BYTES = 16 << 20  # a conversion (bfloat16 -> float32, dequantization) handles at most this much at a time
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def read_bytes(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of `path` at [offset, offset + out.nbytes)."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    done = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < len(view):  # one read() returns at most ~2 GiB on Linux
            n = f.readinto(view[done:])
            if not n:
                raise LlmtraceError(f"{path}: the file ends inside a tensor; it is truncated: download it again")
            done += n


class FileTensor(NamedTuple):
    """One tensor of a safetensors file, not yet read."""

    path: Path
    key: str
    dtype: Optional[torch.dtype]  # None: a dtype llmtrace does not load (named in the error if it is needed)
    dtype_name: str
    shape: tuple[int, ...]
    offset: int  # where its bytes start in the file

    def read_into(self, out: torch.Tensor) -> None:
        """Write the tensor's values into `out` (same shape, any float dtype, any device), converting a chunk at a time."""
        if self.dtype is None:
            raise LlmtraceError(f"{self.path}: tensor {self.key} has dtype {self.dtype_name}, which llmtrace does not load")
        if out.dtype == self.dtype and out.device.type == "cpu":
            read_bytes(self.path, self.offset, out)  # straight into place: no copy at all
            return
        flat, size = out.view(-1), self.dtype.itemsize
        step = max(1, CHUNK_BYTES // size)
        buf = torch.empty(min(step, flat.numel()), dtype=self.dtype)
        for i in range(0, flat.numel(), step):
            n = min(step, flat.numel() - i)
            read_bytes(self.path, self.offset + i * size, buf[:n])
            flat[i : i + n].copy_(buf[:n])


def safetensors_entries(f: Path) -> dict[str, FileTensor]:
    """The tensor directory of one safetensors file: an 8-byte header length, a JSON header, then the data."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("the file ends inside the header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError("the file ends inside the header")
            header = json.loads(fh.read(n))
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            shape = tuple(int(x) for x in info["shape"])
            dtype = ST_DTYPES.get(info["dtype"])
            if 8 + n + end > size:
                raise ValueError(f"tensor {key} ends past the end of the file")
            if dtype is not None and end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {key} has {end - start} bytes for shape {list(shape)}")
            out[key] = FileTensor(f, key, dtype, info["dtype"], shape, 8 + n + start)
        return out
    except (ValueError, KeyError, TypeError, OSError, struct.error) as e:
        raise LlmtraceError(f"{f}: cannot read safetensors file ({one_line(e)}); it may be truncated or corrupt: "
                            f"download it again") from None


class GGUFEntry(NamedTuple):
    """One tensor of a GGUF file, not yet read: its rows are runs of quantized blocks."""

    path: Path
    key: str
    kind: str  # GGUF type name (F32, Q4_K, ...)
    shape: tuple[int, ...]  # torch order: (rows, columns) or (n,)
    offset: int
    row_bytes: int
    heads: Optional[int]  # q/k: undo llama.cpp's row permutation for this many heads

    @classmethod
    def of(cls, path: Path, t: "GGUFTensor", heads: Optional[int], where: str) -> "GGUFEntry":
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dimensions innermost first
        rows = math.prod(shape[:-1])
        return cls(path, t.name, t.tensor_type.name, shape, t.file_offset, t.nbytes // max(rows, 1), heads)

    def raw(self) -> torch.Tensor:
        """The stored bytes, (rows, bytes per row) uint8, rows in HF order."""
        rows = math.prod(self.shape[:-1])
        out = torch.empty((rows, self.row_bytes), dtype=torch.uint8)
        read_bytes(self.path, self.offset, out)
        return out if self.heads is None else unpermute_rope_rows(out, self.heads).contiguous()

    def read_into(self, out: torch.Tensor) -> None:
        """Dequantize (with the gguf package, the reference) into `out`, a chunk of rows at a time."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        kind = GGMLQuantizationType[self.kind]
        rows = math.prod(self.shape[:-1])
        flat = out.view(rows, self.shape[-1])
        step = rows if self.heads is not None else max(1, CHUNK_BYTES // max(self.row_bytes, 4 * self.shape[-1]))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            raw = torch.empty((n, self.row_bytes), dtype=torch.uint8)
            read_bytes(self.path, self.offset + r * self.row_bytes, raw)
            try:
                w = torch.from_numpy(dequantize(raw.numpy(), kind).astype("float32", copy=False).reshape(n, -1))
            except (ValueError, IndexError, NotImplementedError) as e:
                raise LlmtraceError(f"{self.path}: tensor {self.key} could not be read ({one_line(e)}); the file may "
                                    f"be truncated: download it again") from None
            if self.heads is not None:
                w = unpermute_rope_rows(w, self.heads)
            flat[r : r + n].copy_(w)


def read_weights(plan: dict[str, list], dtype: torch.dtype, device: torch.device, progress=None) -> dict[str, torch.Tensor]:
    """Each of the model's tensors, allocated once in the run dtype on its device and filled part by part."""
    out: dict[str, torch.Tensor] = {}
    for n, (name, parts) in enumerate(plan.items()):
        t = torch.empty(_Stacked(parts).shape, dtype=dtype, device=device)
        r = 0
        for part in parts:
            part.read_into(t[r : r + part.shape[0]])
            r += part.shape[0]
        out[name] = t
        if progress is not None:
            progress(n + 1, len(plan))
    return out


def write_safetensors(plan: dict[str, list], path: Path, progress=None) -> None:
    """Write the planned tensors as one float32 safetensors file, a part at a time (the header first: every shape
    is known before anything is read)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, parts in plan.items():
        shape = _Stacked(parts).shape
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + 4 * math.prod(shape)]}
        offset += 4 * math.prod(shape)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for n, parts in enumerate(plan.values()):
            for part in parts:
                t = torch.empty(part.shape, dtype=torch.float32)
                part.read_into(t)
                f.write(memoryview(t.view(-1).numpy()))
                del t
            if progress is not None:
                progress(n + 1, len(plan))


# ----------------------------------------------------------------------------------------------------------------
# from renamed tensors to a model


def plan_layout(entries: dict[str, Any], config: ModelConfig, where: str) -> dict[str, list[Any]]:
    """Which checkpoint tensors make each of the model's tensors: q/k/v fused into wqkv and gate/up into w_gate_up
    (lists of parts, stacked by rows). Checks every expected tensor is present with the shape the config implies,
    before anything is read. `entries` maps llmtrace names to objects with a `.shape`."""
    c, sd = config, dict(entries)
    if "rope_freqs" in sd:  # llama3-style scaling stored as per-frequency divisors (GGUF)
        e = sd.pop("rope_freqs")
        factors = torch.empty(e.shape, dtype=torch.float32)
        e.read_into(factors)
        c.rope_scaling = {"rope_type": "freq_factors", "factors": factors.flatten().tolist()}
    out: dict[str, list[Any]] = {}
    for key in ("embed.weight", "norm.weight", "lm_head.weight"):
        if key in sd:
            out[key] = [sd.pop(key)]
    fused = {"attn.wqkv.weight": ("attn.q.weight", "attn.k.weight", "attn.v.weight"),
             "attn.wqkv.bias": ("attn.q.bias", "attn.k.bias", "attn.v.bias"),
             "ffn.w_gate_up.weight": ("ffn.gate.weight", "ffn.up.weight")}
    part_shapes = {"attn.q.weight": (c.n_heads * c.head_dim, c.d_model), "attn.k.weight": (c.n_kv_heads * c.head_dim, c.d_model),
                   "attn.v.weight": (c.n_kv_heads * c.head_dim, c.d_model), "ffn.gate.weight": (c.ffn_dim, c.d_model),
                   "ffn.up.weight": (c.ffn_dim, c.d_model)}  # fmt: skip
    for i in range(c.n_layers):
        p = f"layers.{i}."
        for whole, subs in fused.items():
            if whole == "attn.wqkv.bias" and not c.attn_bias:
                for sub in subs:
                    sd.pop(p + sub, None)
                continue
            for sub in subs:
                if p + sub not in sd:
                    raise LlmtraceError(f"{where}: tensor for layer {i} {sub} is missing from the checkpoint; download it again")
                if sub in part_shapes:
                    _check_shape(where, p + sub, sd[p + sub], part_shapes[sub])
            out[p + whole] = [sd.pop(p + sub) for sub in subs]
        for sub in ("attn_norm.weight", "ffn_norm.weight", "attn.wo.weight", "ffn.w_down.weight"):
            if p + sub not in sd:
                raise LlmtraceError(f"{where}: tensor for layer {i} {sub} is missing from the checkpoint; download it again")
            out[p + sub] = [sd.pop(p + sub)]
    if c.tie_embeddings:
        out.pop("lm_head.weight", None)
    for key, shape in expected_shapes(c).items():
        if key not in out:
            raise LlmtraceError(f"{where}: tensor {key} is missing from the checkpoint; download it again")
        _check_shape(where, key, _Stacked(out[key]), shape)
    if sd:
        raise LlmtraceError(f"{where}: unexpected tensor {next(iter(sd))} (the config says {c.n_layers} layers)")
    return out


class _Stacked(NamedTuple):
    """The shape of parts stacked by rows."""

    parts: list

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"embed.weight": (c.vocab_size, c.d_model), "norm.weight": (c.d_model,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.d_model)
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    for i in range(c.n_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (c.d_model,)
        shapes[p + "ffn_norm.weight"] = (c.d_model,)
        shapes[p + "attn.wqkv.weight"] = (qkv, c.d_model)
        if c.attn_bias:
            shapes[p + "attn.wqkv.bias"] = (qkv,)
        shapes[p + "attn.wo.weight"] = (c.d_model, c.n_heads * c.head_dim)
        shapes[p + "ffn.w_gate_up.weight"] = (2 * c.ffn_dim, c.d_model)
        shapes[p + "ffn.w_down.weight"] = (c.d_model, c.ffn_dim)
    return shapes


def _check_shape(where, key, t, shape):
    if tuple(t.shape) != tuple(shape):
        raise LlmtraceError(f"{where}: tensor {key} has shape {list(t.shape)} but the config implies {list(shape)}; the "
                        f"config and the weights do not belong together")


@contextlib.contextmanager
def _skip_weight_init():
    """Construct modules with uninitialised (never touched, so never paged in) parameters: they are replaced at once.

    Random initialisation of 135M parameters would cost seconds; the meta device would cost a slow first import."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def build_model(config: ModelConfig, sd: dict[str, torch.Tensor], device: Optional[torch.device], dtype: torch.dtype,
                modules: Optional[dict[str, nn.Module]] = None) -> Transformer:
    """Create the model without initialising random weights, then adopt the given tensors. `modules` replace the
    model's own by name first (--keep-quantized: llmtrace.quant's modules for the matrices); `sd` holds the rest.
    device None: leave every tensor where it is (llmtrace.placement)."""
    modules = modules or {}
    with _skip_weight_init():
        model = Transformer(config)
    for name, m in modules.items():
        model.set_submodule(name, m)
    sd = {k: v.to(dtype=dtype) for k, v in sd.items()}  # read_weights put each on its device already
    tied = config.tie_embeddings and "lm_head" not in modules
    if tied:
        sd["lm_head.weight"] = sd["embed.weight"]
    missing, unexpected = model.load_state_dict(sd, assign=True, strict=not modules)
    if any(not k.startswith(tuple(n + "." for n in modules)) for k in [*missing, *unexpected]):
        raise RuntimeError(f"weights left unset: {missing + unexpected}")  # a bug, not bad input
    if tied:
        model.lm_head.weight = model.embed.weight
    return model.to(device).eval().requires_grad_(False)  # .to: the RoPE frequencies, the one buffer


# ----------------------------------------------------------------------------------------------------------------
# the conversion cache for GGUF files


def _config_to_json(c: ModelConfig) -> str:
    return json.dumps(asdict(c), indent=1)


def _config_from_json(text: str) -> ModelConfig:
    return ModelConfig(**json.loads(text))


def _progress_to_stderr(label: str):
    """A tiny progress callback for slow conversions: a rich bar on a terminal, silence otherwise."""
    if not sys.stderr.isatty():
        return None, lambda: None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from llmtrace.render import make_console

    prog = Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    transient=True, console=make_console(stderr=True))
    prog.start()
    task = prog.add_task(label, total=None)

    def update(done, total):
        prog.update(task, completed=done, total=total)

    return update, prog.stop


def convert_gguf(path: Path, dest: Path) -> None:
    """Read and dequantize a GGUF once; write config, float32 weights (tensor by tensor) and tokenizer to `dest`
    atomically."""
    from llmtrace.fsutil import atomic_dir
    from llmtrace.tokenizer import TextTokenizer

    reader = open_gguf(path)
    where = str(path)
    config = config_from_gguf(reader, where)
    tokenizer = TextTokenizer.from_gguf(reader, where)
    plan = plan_layout(gguf_entries(reader, config, where), config, where)
    config.extra = gguf_facts(reader)
    del reader
    progress, stop = _progress_to_stderr(f"converting {path.name}")
    try:
        with atomic_dir(dest) as tmp:
            write_safetensors(plan, tmp / "weights.safetensors", progress)
            tokenizer.save_hf_dir(tmp / "tokenizer")
            (tmp / "llmtrace_config.json").write_text(_config_to_json(config))
            (tmp / CONVERSION_SOURCE).write_text(conversion_source(path))  # whose conversion this is, for models/rm
    finally:
        stop()


def gguf_facts(reader) -> dict:
    return {"format": "gguf", "file_type": _gguf_field(reader, "general.file_type"),
            "quantizations": sorted({t.tensor_type.name for t in reader.tensors}),
            "gguf_name": _gguf_field(reader, "general.name")}


def _open_converted(dest: Path) -> tuple[ModelConfig, dict[str, list], "TextTokenizer"]:  # noqa: F821
    """The cached conversion: its config, a plan of one part per tensor, its tokenizer."""
    from llmtrace.tokenizer import TextTokenizer

    where = str(dest / "weights.safetensors")
    config = _config_from_json((dest / "llmtrace_config.json").read_text())
    entries = safetensors_entries(dest / "weights.safetensors")
    for key, shape in expected_shapes(config).items():
        if key not in entries:
            raise LlmtraceError(f"{where}: tensor {key} is missing")
        _check_shape(where, key, entries[key], shape)
    plan = {key: [entries[key]] for key in expected_shapes(config)}
    return config, plan, TextTokenizer.from_hf_dir(dest / "tokenizer")


# ----------------------------------------------------------------------------------------------------------------
# public entry points


def _resolve(spec: Optional[str]):
    from llmtrace.registry import resolve

    return resolve(spec)


def load_model(spec: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None, *,
               keep_quantized: bool = False, placement: Optional["Placement"] = None) -> LoadedModel:  # noqa: F821
    """Resolve a model spec (registry name, hub id, HF directory or .gguf file) and load it ready to run.

    Weights are read tensor by tensor straight into the run dtype. `keep_quantized`: a GGUF's matrices stay in their
    blocks (llmtrace.quant). `placement`: layers spread over devices and disk by accelerate (llmtrace.placement).
    Before any weight is read, the memory they need is checked against what is available (placement.check_fits)."""
    from llmtrace import placement as place

    resolved = _resolve(spec)
    dev = pick_device(device) if placement is None else placement.main_device
    t0 = time.perf_counter()
    converted = False
    if keep_quantized:
        if resolved.kind != "gguf":
            raise UsageError(f"--keep-quantized keeps a GGUF file's blocks; {resolved.name} is not a GGUF file "
                             f"(use --dtype bfloat16 to halve its memory)")
        if placement is not None:
            raise UsageError("--keep-quantized and --device-map cannot be combined yet; choose one")
        from llmtrace.quant import load_gguf_quantized

        dt = pick_dtype(dtype, dev)
        place.check_fits(resolved.name, resolved.path.stat().st_size, "its quantized blocks", dev)
        config, model, tokenizer = load_gguf_quantized(resolved.path, dev, dt)
        tokenizer.check_fits(config.vocab_size, str(resolved.path))
    else:
        config, plan, tokenizer, converted = _open_checkpoint(resolved)
        tokenizer.check_fits(config.vocab_size, str(resolved.path))
        dt = place.choose_dtype(dtype, dev, resolved.name, place.weight_count(config), placement)
        if placement is None:
            progress, stop = _progress_to_stderr(f"loading {resolved.name}")
            try:
                sd = read_weights(plan, dt, dev, progress)
            finally:
                stop()
            model = build_model(config, sd, dev, dt)
            del sd
        else:
            model = placement.load(config, plan, dt)
    return LoadedModel(name=resolved.name, source=resolved.kind, path=resolved.path, config=config, model=model,
                       tokenizer=tokenizer, device=dev, dtype=dt, load_s=time.perf_counter() - t0, converted=converted)


def _open_checkpoint(resolved) -> tuple[ModelConfig, dict[str, list], "TextTokenizer", bool]:  # noqa: F821
    """Config, tensor plan (nothing read yet) and tokenizer of an HF directory or a GGUF file (converted once)."""
    from llmtrace.tokenizer import TextTokenizer

    if resolved.kind == "gguf":
        dest = converted_dir(resolved.path)
        converted = not (dest / "llmtrace_config.json").exists()
        if converted:
            convert_gguf(resolved.path, dest)
        try:
            config, plan, tokenizer = _open_converted(dest)
        except Exception as e:  # a damaged cache entry: convert again next time
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
            raise LlmtraceError(f"the cached conversion of {resolved.path.name} was unreadable ({one_line(e)}) and "
                                f"has been removed; run the command again") from None
        return config, plan, tokenizer, converted
    where = str(resolved.path)
    cfg_path = resolved.path / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise LlmtraceError(f"{where}: no config.json in this directory") from None
    except json.JSONDecodeError as e:
        raise LlmtraceError(f"{cfg_path}: not valid JSON (line {e.lineno}: {e.msg}); fix it or fetch it again") from None
    config = config_from_hf(raw, where)
    config.extra = {"format": "safetensors", "torch_dtype": raw.get("torch_dtype", raw.get("dtype"))}
    plan = plan_layout(hf_entries(resolved.path), config, where)
    return config, plan, TextTokenizer.from_hf_dir(resolved.path), False
