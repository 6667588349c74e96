"""The GGUF adapter: a GGUF file's metadata and tensors -> ModelConfig and tensor entries (dequantized, q/k rows
un-permuted)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from llmtrace.errors import LlmtraceError, one_line
from llmtrace.checkpoint.weights import CHUNK_BYTES, read_bytes
from llmtrace.checkpoint.gguf_file import GGUFTensor
from llmtrace.model.transformer import ModelConfig

SUPPORTED_GGUF_ARCHS = {"llama", "mistral", "qwen2"}


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
