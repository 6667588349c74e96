"""A base file of `llmtrace eval` (save_base= / base=): side A's log-probabilities over a text, for a later run of
the model under test. One safetensors file (no pickle), in one of two forms.

**exact** (the default): per scored position, A's whole log-probability row, each entry as a uint16 between the
row's minimum and maximum (as llama.cpp's --kl-divergence-base keeps 16 bits per entry; it floors the row at
max − 16, this file keeps the whole range):

    lo = min_v ln p(v),  step = (max_v ln p(v) − lo) / 65535,  q(v) = round((ln p(v) − lo) / step)  ∈ 0 … 65535

so every entry comes back within step / 2 of A's value (`half_steps`; eval_score.py derives the bound this gives on
the KLD). Beside it, whole: the row's lo and step (float64), the next token's log-probability (float64) and the most
likely token (int32), so that PPL(A), Δp and same top are exact. 2 bytes per vocabulary entry a position (98 KB on
SmolLM2's 49,152 tokens); the file is written chunk by chunk as the run goes, and read a chunk at a time.

**top_k** (base_top_k=K): the top K ids (int32) and log-probabilities (float32), the mass of every other token (the
tail, float64) and the next token's log-probability (float64): K · 8 + 16 bytes a position, and a KLD that is a
lower bound (eval_score.py says by how much at most). Files of format /1 are this form and still load.

Both hold the chunks' token ids (int32). The JSON header (the safetensors metadata, strings only) names what the
figures belong to: the model, its shape and tokenizer (a hash of its vocabulary), the text (its SHA-256), ctx, the
chunks and the form. A run against it refuses another tokenizer, model shape, text or ctx, in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from pathlib import Path
from typing import Optional, Union

from llmtrace.errors import LlmtraceError, UsageError

BASE_FORMAT = "llmtrace.eval-base/2"  # what this version writes
BASE_FORMATS = ("llmtrace.eval-base/1", BASE_FORMAT)  # what it reads: /1 files are all of the top_k form
LEVELS = 65535  # uint16: the steps between a row's minimum and maximum


def tokenizer_hash(tok) -> str:
    """A short hash of a vocabulary: every id's piece, in order, and whether BOS is added."""
    h = hashlib.sha256()
    for i in range(tok.vocab_size):
        h.update(tok.piece(i).encode("utf-8", "surrogatepass") + b"\n")
    h.update(f"bos={tok.bos_id if tok.add_bos else None}".encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# the exact form: 16 bits per entry


def quantize(lp) -> dict:
    """Rows of log-probabilities (P, V) float64 as uint16 between each row's min and max: {q (P, V), lo, step (P,)}."""
    import torch

    lo, hi = lp.min(-1).values, lp.max(-1).values  # (P,)
    step = (hi - lo) / LEVELS
    safe = torch.where(step > 0, step, torch.ones_like(step))  # a flat row: every entry is lo
    q = ((lp - lo[:, None]) / safe[:, None]).round_().clamp_(0, LEVELS)
    return {"q": q.to(torch.int32).to(torch.uint16), "lo": lo, "step": step}


def dequantize(q, lo, step):
    """The log-probabilities (P, V) float64 a quantized row stands for, each within `half_steps` of the original."""
    import torch

    return lo.double()[:, None] + q.to(torch.int32).double() * step.double()[:, None]


def half_steps(step):
    """The most a dequantized entry can differ from the original (float64 rounding of the round trip included)."""
    return step.double() / 2 + 1e-12


# ----------------------------------------------------------------------------------------------------------------
# writing


class BaseWriter:
    """A base file written as the chunks come, whole or not at all (`finish` renames it into place; leaving the block
    without it removes the partial file). `rows` of each chunk: eval_score.exact_rows or eval_score.top_rows."""

    def __init__(self, path: Union[str, Path], header: dict, tokens: list[int], n_rows: int, vocab: int):
        self.path, self.header, self.tokens = Path(path), header, tokens
        self.exact = header["form"] == "exact"
        self.n_rows, self.vocab, self.next_chunk = n_rows, vocab, 0
        self.finished = False
        self.small: list[dict] = []  # per chunk: the small tensors (exact), or every tensor (top_k)
        self._stack = contextlib.ExitStack()
        self._f = None

    def __enter__(self) -> "BaseWriter":
        from llmtrace.fsutil import atomic_path

        self._tmp = self._stack.enter_context(atomic_path(self.path, suffix=".safetensors"))
        if self.exact:
            self._f = self._stack.enter_context(open(self._tmp, "wb"))
            self._f.write(self._safetensors_header())
        return self

    def __exit__(self, *exc) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
        if exc[0] is None and not self.finished:  # an interrupted run: the partial file goes, never into place
            gone = LlmtraceError("the base file was not finished")
            exc = (type(gone), gone, None)
        self._stack.__exit__(*exc)

    def _tensors(self) -> list[tuple[str, str, list[int], int]]:
        """(name, safetensors dtype, shape, bytes) in file order; the big matrix first, as it is streamed."""
        n = self.n_rows
        return [("logp_q", "U16", [n, self.vocab], 2 * n * self.vocab), ("lo", "F64", [n], 8 * n),
                ("step", "F64", [n], 8 * n), ("target_logp", "F64", [n], 8 * n), ("top_id", "I32", [n], 4 * n),
                ("tokens", "I32", [len(self.tokens)], 4 * len(self.tokens))]

    def _safetensors_header(self) -> bytes:
        """The safetensors header of the whole file, known before the first row: 8 bytes of length, then JSON."""
        doc: dict = {"__metadata__": {"format": BASE_FORMAT, "header": json.dumps(self.header, ensure_ascii=False)}}
        at = 0
        for name, dtype, shape, size in self._tensors():
            doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
            at += size
        raw = json.dumps(doc, ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned
        return struct.pack("<Q", len(raw)) + raw

    def add(self, chunk: int, rows: dict) -> None:
        """Chunk `chunk`'s rows; chunks come in order."""
        if chunk != self.next_chunk:
            raise LlmtraceError(f"the base file expected chunk {self.next_chunk}, got {chunk}")
        self.next_chunk += 1
        if self.exact:
            self._f.write(rows["q"].contiguous().numpy().tobytes())
            self.small.append({k: rows[k] for k in ("lo", "step", "target_logp", "top_id")})
        else:
            self.small.append(rows)

    def finish(self) -> int:
        """Write what is left and put the file in place. Returns its size in bytes."""
        import torch

        if sum(len(r["target_logp"]) for r in self.small) != self.n_rows:
            raise LlmtraceError("a base file needs every chunk's log-probabilities: run it again whole")
        tokens = torch.tensor(self.tokens, dtype=torch.int32)
        if self.exact:
            for name in ("lo", "step", "target_logp"):
                self._f.write(torch.cat([r[name] for r in self.small]).double().contiguous().numpy().tobytes())
            self._f.write(torch.cat([r["top_id"] for r in self.small]).to(torch.int32).numpy().tobytes())
            self._f.write(tokens.numpy().tobytes())
            self._f.close()
        else:
            from safetensors.torch import save_file

            rows = self.small
            tensors = {"tokens": tokens, "top_ids": torch.cat([r["top_ids"] for r in rows]).contiguous(),
                       "top_logp": torch.cat([r["top_logp"] for r in rows]).contiguous(),
                       "tail": torch.cat([r["tail"] for r in rows]).double().contiguous(),
                       "target_logp": torch.cat([r["target_logp"] for r in rows]).double().contiguous()}
            save_file(tensors, str(self._tmp), metadata={"format": BASE_FORMAT,
                                                         "header": json.dumps(self.header, ensure_ascii=False)})
        self.finished = True
        self._stack.close()  # the rename
        return self.path.stat().st_size


# ----------------------------------------------------------------------------------------------------------------
# reading


class BaseFile:
    """A base file opened for reading: its header, and each chunk's rows on demand (a chunk in memory at a time)."""

    def __init__(self, path: Union[str, Path]):
        from safetensors import safe_open

        self.path = Path(path)
        try:
            self._f = safe_open(str(self.path), framework="pt")
            meta = self._f.metadata() or {}
        except Exception as e:  # safetensors raises its own errors for a file that is not one
            raise UsageError(f"{path}: not a base file of llmtrace eval ({type(e).__name__})") from None
        if meta.get("format") not in BASE_FORMATS:
            raise UsageError(f"{path}: not a base file of llmtrace eval (its format is {meta.get('format')!r})")
        self.header = json.loads(meta["header"])
        self.header.setdefault("form", "top_k")  # format /1
        self.form: str = self.header["form"]
        self.tokens = self._f.get_tensor("tokens").tolist()
        names = ("lo", "step", "target_logp", "top_id") if self.form == "exact" else (
            "top_ids", "top_logp", "tail", "target_logp")
        self._small = {k: self._f.get_tensor(k) for k in names}

    @property
    def top_k(self) -> Optional[int]:
        return self.header.get("top_k") if self.form == "top_k" else None

    def rows(self, chunk: int, scored: int) -> dict:
        """Chunk `chunk`'s rows: exact {q (P, V) uint16, lo, step, target_logp, top_id (P,)}, or top_k {top_ids,
        top_logp (P, K), tail, target_logp (P,)}."""
        s = slice(chunk * scored, (chunk + 1) * scored)
        rows = {"form": self.form} | {k: v[s] for k, v in self._small.items()}
        if self.form == "exact":
            rows["q"] = self._f.get_slice("logp_q")[s]
        return rows

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
