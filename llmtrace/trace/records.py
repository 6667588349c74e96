"""The records that `generate` (trace.Recorder) and `explain`/`lens` (explain.py) both write, defined once: their
fields (TypedDicts, checked against trace.schema.json by tests/test_trace.py), the builders that make them, and the
one rounding rule for every float a trace holds.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, TypedDict

SIGNIFICANT_DIGITS = 7  # float32 carries about 7


def rounded(x: Any, digits: int = SIGNIFICANT_DIGITS) -> Any:
    """A float to `digits` significant digits, or None for inf and nan (JSON has neither); other values as they are.
    Every float of a trace goes through this rule (stats.round_tensor applies it to a batch at once)."""
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return None
        return float(f"%.{digits}g" % x)
    return x


# ----------------------------------------------------------------------------------------------------------------
# the records


class TokenRecord(TypedDict):
    """One token of the prompt: its position, id, vocabulary piece, decoded text, and whether it is special."""

    index: int
    id: int
    piece: str
    text: str
    special: bool


class TokensEvent(TypedDict):
    event: str  # "tokens"
    tokens: list[TokenRecord]
    count: int


class StatsRecord(TypedDict):
    """A tensor's summary statistics (stats.tensor_stats), rounded; None for a non-finite value."""

    mean: Optional[float]
    std: Optional[float]
    min: Optional[float]
    max: Optional[float]
    norm: Optional[float]


class ModelRecord(TypedDict):
    """The model a trace was made with: its config, parameter count and how its weights are stored."""

    name: str
    source: str
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    rope_scaling: Optional[dict]
    rms_eps: float
    tie_embeddings: bool
    max_seq_len: int
    n_params: int
    storage: list[dict]


class ExplainModelRecord(ModelRecord):
    """explain and lens also say where the model ran (generate's run event says it beside the model)."""

    device: str
    dtype: str


# ----------------------------------------------------------------------------------------------------------------
# the builders


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def token_record(tok, index: int, tid: int) -> TokenRecord:
    return {"index": index, "id": tid, "piece": tok.piece(tid), "text": tok.decode([tid]), "special": tok.is_special(tid)}


def tokens_event(tok, ids: list[int]) -> TokensEvent:
    """The `tokens` event: the prompt, token by token."""
    return {"event": "tokens", "tokens": [token_record(tok, i, t) for i, t in enumerate(ids)], "count": len(ids)}


def model_record(lm) -> ModelRecord:
    """The model's record, from a loaded model (llmtrace.loader.LoadedModel)."""
    from llmtrace.model.quant import storage_table, weight_count

    c = lm.config
    return {"name": lm.name, "source": lm.source, "arch": c.arch, "n_layers": c.n_layers, "d_model": c.d_model,
            "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "ffn_dim": c.ffn_dim,
            "vocab_size": c.vocab_size, "rope_theta": c.rope_theta,
            "rope_scaling": json.loads(json.dumps(c.rope_scaling)) if c.rope_scaling is not None else None,
            "rms_eps": rounded(c.rms_eps), "tie_embeddings": c.tie_embeddings, "max_seq_len": c.max_seq_len,
            "n_params": weight_count(lm.model), "storage": storage_table(lm.model)}


def explain_model_record(lm) -> ExplainModelRecord:
    return {**model_record(lm), "device": str(lm.device), "dtype": dtype_name(lm.dtype)}
