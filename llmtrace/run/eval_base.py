"""A base file of `llmtrace eval` (save_base= / base=): side A's log-probabilities over a text, kept compactly.

One safetensors file (no pickle): per scored position, the top K token ids (int32) and their log-probabilities
(float32), the mass of every other token (the tail, float64) and the next token's log-probability (float64); and the
chunks' token ids (int32). That is K·8 + 16 bytes a position, not the 2 bytes per vocabulary entry that llama.cpp's
--kl-divergence-base writes (K = 64 on SmolLM2's 49,152 tokens: 528 bytes against 98 KB, about 186 times smaller),
and O(K) memory a position to read.

Its JSON header (the safetensors metadata, strings only) names what the figures belong to: the model, its shape and
tokenizer (a hash of its vocabulary), the text (its SHA-256), ctx, K and the chunks. A run against it refuses another
tokenizer, another model shape, another text or another ctx, in one line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Union

from llmtrace.errors import LlmtraceError, UsageError

BASE_FORMAT = "llmtrace.eval-base/1"


def tokenizer_hash(tok) -> str:
    """A short hash of a vocabulary: every id's piece, in order, and whether BOS is added."""
    h = hashlib.sha256()
    for i in range(tok.vocab_size):
        h.update(tok.piece(i).encode("utf-8", "surrogatepass") + b"\n")
    h.update(f"bos={tok.bos_id if tok.add_bos else None}".encode())
    return h.hexdigest()[:16]


def write_base(path: Union[str, Path], header: dict, tokens: list[int], rows: list[dict]) -> int:
    """The base file, whole or not at all: `rows` are the chunks' kept rows (eval_score.top_rows), in chunk order.
    Returns its size in bytes."""
    import torch
    from safetensors.torch import save_file

    from llmtrace.fsutil import atomic_path

    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int32),
               "top_ids": torch.cat([r["top_ids"] for r in rows]).contiguous(),
               "top_logp": torch.cat([r["top_logp"] for r in rows]).contiguous(),
               "tail": torch.cat([r["tail"] for r in rows]).double().contiguous(),
               "target_logp": torch.cat([r["target_logp"] for r in rows]).double().contiguous()}
    meta = {"format": BASE_FORMAT, "header": json.dumps(header, ensure_ascii=False)}
    with atomic_path(Path(path), suffix=".safetensors") as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return Path(path).stat().st_size


class BaseFile:
    """A base file opened for reading: its header, and each chunk's rows on demand."""

    def __init__(self, path: Union[str, Path]):
        from safetensors import safe_open

        self.path = Path(path)
        try:
            self._f = safe_open(str(self.path), framework="pt")
            meta = self._f.metadata() or {}
        except Exception as e:  # safetensors raises its own errors for a file that is not one
            raise UsageError(f"{path}: not a base file of llmtrace eval ({type(e).__name__})") from None
        if meta.get("format") != BASE_FORMAT:
            raise UsageError(f"{path}: not a base file of llmtrace eval (its format is {meta.get('format')!r})")
        self.header = json.loads(meta["header"])
        self.tokens = self._f.get_tensor("tokens").tolist()
        self._top_ids = self._f.get_tensor("top_ids")
        self._top_logp = self._f.get_tensor("top_logp")
        self._tail = self._f.get_tensor("tail")
        self._target = self._f.get_tensor("target_logp")

    def rows(self, chunk: int, scored: int) -> dict:
        """Chunk `chunk`'s rows: top ids and log-probs (P, K), tail and next-token log-prob (P,)."""
        s = slice(chunk * scored, (chunk + 1) * scored)
        return {"top_ids": self._top_ids[s], "top_logp": self._top_logp[s], "tail": self._tail[s],
                "target_logp": self._target[s]}

    def check(self, facts: dict, tok_hash: str, text_sha256: str, ctx: int, n_chunks: int) -> None:
        """Refuse a model, tokenizer, text, ctx or chunk count the file was not written for, in one line."""
        h = self.header
        where = f"{self.path}: a base file of {h['model']['model']}"
        if h["tokenizer"] != tok_hash or h["model"]["vocab_size"] != facts["vocab_size"]:
            raise UsageError(f"{where}, whose tokenizer differs from this model's ({facts['model']})")
        shape = ("arch", "n_layers", "d_model")
        if any(h["model"][k] != facts[k] for k in shape):
            raise UsageError(f"{where} ({_shape(h['model'])}); this model is another one ({_shape(facts)})")
        if h["text_sha256"] != text_sha256:
            raise UsageError(f"{where} over another text (SHA-256 {h['text_sha256'][:12]}…, this one "
                             f"{text_sha256[:12]}…)")
        if h["ctx"] != ctx:
            raise UsageError(f"{where} at ctx {h['ctx']}, not {ctx}")
        if h["chunks"] < n_chunks:
            raise UsageError(f"{where} holds {h['chunks']} chunks; this run asks for {n_chunks}")


def _shape(m: dict) -> str:
    return f"{m['arch']}, {m['n_layers']} layers, width {m['d_model']}"


def open_base(path: Union[str, Path]) -> BaseFile:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: no such base file")
    try:
        return BaseFile(p)
    except (OSError, KeyError, ValueError) as e:
        raise LlmtraceError(f"{path}: cannot read the base file ({type(e).__name__}: {e})") from None
