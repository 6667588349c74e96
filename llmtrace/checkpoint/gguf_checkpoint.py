"""The GGUF adapter: a GGUF file's metadata and tensors -> ModelConfig and tensor entries (dequantized, q/k rows
un-permuted)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from llmtrace.errors import LlmtraceError, one_line
from llmtrace.checkpoint.weights import CHUNK_BYTES, read_bytes
from llmtrace.checkpoint.gguf_file import GGUFTensor, open_gguf
from llmtrace.checkpoint.hf_checkpoint import family_fields
from llmtrace.model.family import family_of_gguf, gguf_archs, not_yet
from llmtrace.model.transformer import ModelConfig

# ----------------------------------------------------------------------------------------------------------------
# GGUF


def gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_family(reader):
    """The family that reads this file (model.family.family_of_gguf: by its architecture and, where families share
    one, the metadata they require), or None."""
    arch = gguf_field(reader, "general.architecture")
    return family_of_gguf(arch, lambda key: gguf_field(reader, f"{arch}.{key}"))


def config_from_gguf(reader, where: str) -> ModelConfig:
    """The fields every family shares, from the metadata under the file's architecture, then the family's own
    (Family.gguf_config). llama3-style RoPE scaling stored as per-frequency divisors (tensor rope_freqs) is read here,
    into the config, so that nothing later changes it."""
    arch = gguf_field(reader, "general.architecture", "unknown")
    family = gguf_family(reader)
    if family is None and not_yet(arch):
        raise LlmtraceError(f"{where}: architecture {arch!r} is not supported yet: {not_yet(arch)}, which llmtrace "
                            f"does not run")
    if family is None:
        raise LlmtraceError(f"{where}: architecture {arch!r} is not supported (llmtrace runs "
                            f"{', '.join(sorted(gguf_archs()))})")

    def meta(key, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)

    def tensor(name):  # a tensor that is config (Family.gguf_config_tensors), as a list of numbers; None if absent
        t = names.get(name) if name in family.gguf_config_tensors else None
        return None if t is None else _read_small(GGUFEntry.of(t, reader.path))

    meta.tensor = tensor
    meta.has_tensor = lambda name: name in names  # whether the file holds a tensor (Gemma 4: a global layer's attn_v)

    def need(key):
        v = meta(key)
        if v is None:
            raise LlmtraceError(f"{where}: GGUF metadata lacks {arch}.{key}")
        return v

    names = {t.name: t for t in reader.tensors}
    d, h = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta("vocab_size") or (len(tokens.contents()) if tokens is not None else None)
    if vocab is None:
        raise LlmtraceError(f"{where}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    head_dim = meta("attention.key_length") or meta("rope.dimension_count") or d // h
    fields = dict(
        arch=arch,
        family=family.name,
        n_layers=int(need("block_count")),
        d_model=d,
        n_heads=h,
        n_kv_heads=int(_largest(meta("attention.head_count_kv")) or h),
        head_dim=int(head_dim),
        ffn_dim=int(_largest(need("feed_forward_length"))),
        vocab_size=int(vocab),
        max_seq_len=int(meta("context_length", 4096)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=None if family.reads_rope else _gguf_rope_scaling(meta, reader, names.get("rope_freqs.weight"),
                                                                       where),
        rms_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        attn_bias="blk.0.attn_q.bias" in names,
    )
    return ModelConfig.from_dict(fields | family_fields(family.gguf_config, meta, where))


def _largest(value):
    """A per-layer list of a count as its largest: LFM2's KV heads (0 in a layer without attention), Gemma 4's FFN
    widths (a KV-shared layer's may be twice the others'); the family reads the list itself."""
    return max(value) if isinstance(value, list) else value


def _gguf_rope_scaling(meta, reader, freqs, where: str) -> Optional[dict]:
    if freqs is not None:  # llama3-style scaling stored as one divisor per frequency
        return {"rope_type": "freq_factors", "factors": _read_small(GGUFEntry.of(freqs, reader.path))}
    s_type = meta("rope.scaling.type")
    if s_type == "linear":
        return {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    if s_type not in (None, "none"):
        raise LlmtraceError(f"{where}: rope scaling {s_type!r} is not supported (linear and llama3 are)")
    return None


def _read_small(e: "GGUFEntry") -> list[float]:
    out = torch.empty(e.shape, dtype=torch.float32)
    e.read_into(out)
    return out.flatten().tolist()


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. llama.cpp stores each head's rows interleaved (x0, x_half, x1, ...) for its
    pairwise RoPE; HF and llmtrace rotate the halves (x_i, x_{i+Dh/2}). Works on weights (rows, D) and biases (rows,)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_entries(reader, where: str) -> dict[str, "GGUFEntry"]:
    """Every tensor of the GGUF file, not yet read, under its own name (rope_freqs and the family's
    gguf_config_tensors, read into the config, left out)."""
    family = gguf_family(reader)
    config_tensors = {"rope_freqs.weight", *(family.gguf_config_tensors if family is not None else ())}
    out: dict[str, GGUFEntry] = {}
    for t in reader.tensors:
        if t.name in config_tensors:
            continue
        if t.tensor_type.name not in GGUF_DEQUANTIZABLE:
            raise LlmtraceError(f"{where}: tensor {t.name} uses quantization {t.tensor_type.name}, which llmtrace cannot "
                                f"dequantize (supported: {', '.join(sorted(GGUF_DEQUANTIZABLE))})")
        out[t.name] = GGUFEntry.of(t, reader.path)
    return out


def read_gguf_weights(reader, config: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """Every tensor the model takes from the file, dequantized to float32 (with the gguf package), under its GGUF
    name, q/k rows put back in HF order where the arch was converted with llama.cpp's permutation."""
    from llmtrace.checkpoint.weights import plan_weights

    out = {}
    for parts in plan_weights(gguf_entries(reader, where), config, "gguf", where).values():
        for e in parts:
            out[e.key] = torch.empty(e.shape, dtype=torch.float32)
            e.read_into(out[e.key])
    return out


GGUF_DEQUANTIZABLE = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_K", "Q2_K",
                      "Q3_K", "MXFP4"}


class GGUFCheckpoint(NamedTuple):
    """A GGUF file opened: its config, the plan of the model's tensors in it (nothing read yet), its tokenizer and
    the facts the trace shows (file type, block types). The one way every load of a GGUF starts."""

    config: ModelConfig
    plan: dict[str, list]
    tokenizer: "TextTokenizer"  # noqa: F821
    facts: dict


def open_gguf_checkpoint(path: Path) -> GGUFCheckpoint:
    from llmtrace.checkpoint.weights import plan_weights
    from llmtrace.tokens.tokenizer import TextTokenizer

    where = str(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, where)
    tokenizer = TextTokenizer.from_gguf(reader, where)
    plan = plan_weights(gguf_entries(reader, where), config, "gguf", where)
    facts = config.extra | {"format": "gguf", "file_type": gguf_field(reader, "general.file_type"),
                            "quantizations": sorted({t.tensor_type.name for t in reader.tensors}),
                            "gguf_name": gguf_field(reader, "general.name")}
    if config.sliding_window is None and "mistral" in str(facts["gguf_name"] or Path(path).name).lower():
        facts["window_note"] = ("no sliding window: llama.cpp's converter drops Mistral's (its HF config may have "
                                "one, 4096 in Mistral 7B v0.1), so every layer sees the whole context, as llama.cpp "
                                "runs this file")
    return GGUFCheckpoint(config, plan, tokenizer, facts)


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
    def of(cls, t: "GGUFTensor", path: Path, heads: Optional[int] = None) -> "GGUFEntry":
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
