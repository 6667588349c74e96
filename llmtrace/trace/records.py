"""The records that `generate` (trace.Recorder) and `explain`/`lens` (explain.py) both write, defined once: their
fields (TypedDicts, checked against trace.schema.json by tests/test_trace.py), the builders that make them, and the
one rounding rule for every float a trace holds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, NotRequired, Optional, TypedDict
from llmtrace.units import plural
from llmtrace.words import in_words


SIGNIFICANT_DIGITS = 7  # float32 carries about 7


def rounded(x: Any, digits: int = SIGNIFICANT_DIGITS) -> Any:
    """A float to `digits` significant digits, or None for inf and nan (JSON has neither); other values as they are.
    Every float of a trace written as a JSON number goes through this rule (stats.round_array applies it to a batch at
    once); a --trace full sample's values are packed float32 instead (trace.packed)."""
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
    path: NotRequired[str]  # where the weights were read from: report finds a file-loaded model's tokenizer there
    arch: str
    family: str
    changes: NotRequired[list[str]]
    changes_said: NotRequired[list[Optional[dict]]]  # each line's words' key and arguments (model.family.Said)
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
    n_experts: NotRequired[int]  # a mixture of experts: E, K, one expert's width and the weights a token uses
    n_experts_used: NotRequired[int]
    expert_ffn_dim: NotRequired[int]
    active_params: NotRequired[int]
    memory: NotRequired[list[dict]]  # each layer's declared memory (model.memory.Memory.record)


class FastRecord(TypedDict):
    """The fast path (--fast): the dtype activations are computed in, how the int4 kernel was chosen (llmtrace.model.fast.
    choose_kernel) and the matrices that run in bfloat16 instead. Each matrix's kernel is in the model's storage."""

    compute_dtype: str
    kernel_choice: dict
    bf16_matrices: list[str]


class PathRecord(TypedDict):
    """Whether the run computes the exact values (the float path, --keep-quantized) or approximates them (--fast)."""

    exact: bool
    fast: NotRequired[FastRecord]


class ExplainModelRecord(ModelRecord):
    """explain and lens also say where the model ran and whether exactly (generate's run event says it beside the
    model)."""

    device: str
    dtype: str
    exact: bool
    fast: NotRequired[FastRecord]


# ----------------------------------------------------------------------------------------------------------------
# the builders


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def token_record(tok, index: int, tid: int) -> TokenRecord:
    return {"index": index, "id": tid, "piece": tok.piece(tid), "text": tok.decode([tid]), "special": tok.is_special(tid)}


def tokens_event(tok, ids: list[int]) -> TokensEvent:
    """The `tokens` event: the prompt, token by token."""
    return {"event": "tokens", "tokens": [token_record(tok, i, t) for i, t in enumerate(ids)], "count": len(ids)}


def candidate_records(tok, candidates: Iterable[tuple[int, float, float]]) -> list[dict]:
    """Top-k records, as every event that lists candidates writes them (a step's and a prediction's `topk`, a lens
    row's): (id, logit, prob) -> {id, piece, text, logit, prob}, numbers by the trace's one rounding rule."""
    return [{"id": i, "piece": tok.piece(i), "text": tok.decode([i]), "logit": rounded(logit), "prob": rounded(prob)}
            for i, logit, prob in candidates]


def batch_event(tok, layout) -> dict:
    """s3, the `batch` event: the padded batch as the first pass sees it (run.generate.BatchLayout). `explain` and
    `lens` add the combined mask of each row to it."""
    return {"event": "batch", "rows": len(layout.ids), "ids": layout.ids, "attention_mask": layout.attention_mask,
            "position_ids": layout.position_ids, "pad_id": layout.pad_id, "pad_source": layout.pad_source,
            "pad_piece": tok.piece(layout.pad_id)}


def tensor_event(step: int, phase: str, layer: Optional[int], name: str, seed_step: Optional[str], shape: list[int],
                 dtype: str, cls: type = dict) -> dict:
    """A `tensor` event without its statistics, fields in the order every writer uses, made as `cls` (the recorder's
    dict subclass that may carry its own JSON line, trace.recorder.TensorEvent: made once, not copied, since a full
    trace makes 574 of them a step)."""
    return cls(event="tensor", step=step, phase=phase, layer=layer, name=name, seed_step=seed_step, shape=shape,
               dtype=dtype)


def model_record(lm) -> ModelRecord:
    """The model's record, from a loaded model (llmtrace.loader.LoadedModel)."""
    from llmtrace.model.family import describe_changes, said_changes
    from llmtrace.model.quant import storage_table, weight_count

    c = lm.config
    changes = describe_changes(c)
    return {"name": lm.name, "source": lm.source, "path": str(Path(lm.path).resolve()), "arch": c.arch,
            "family": c.family, "changes": [str(x) for x in changes], "changes_said": said_changes(changes),
            "n_layers": c.n_layers, "d_model": c.d_model, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "ffn_dim": c.ffn_dim,
            "vocab_size": c.vocab_size, "rope_theta": c.rope_theta,
            "rope_scaling": json.loads(json.dumps(c.rope_scaling)) if c.rope_scaling is not None else None,
            "rms_eps": rounded(c.rms_eps), "tie_embeddings": c.tie_embeddings, "max_seq_len": c.max_seq_len,
            "n_params": weight_count(lm.model), "storage": storage_table(lm.model),
            "memory": memory_record(lm)} | experts_record(lm)


def memory_record(lm) -> list[dict]:
    """Each layer's memory, from its kind's declaration, at the element size the cache keeps."""
    es = lm.model.embed.weight.element_size() if lm.model.embed.weight.is_floating_point() else 4
    return [m.record(es) for m in lm.model.memory()]


def experts_record(lm) -> dict:
    """A mixture of experts' part of the model record: E, K, one expert's width, and the weights one token uses
    (every weight but the experts it does not run: K of E in each MoE layer); nothing for a dense model."""
    c = lm.config
    if not c.n_experts:
        return {}
    from llmtrace.model.moe import active_weights
    from llmtrace.model.quant import weight_count

    active, total = active_weights(c, lm.model.declared_weights())
    return {"n_experts": c.n_experts, "n_experts_used": c.n_experts_used,
            "expert_ffn_dim": c.expert_ffn_dim or c.ffn_dim, "active_params": weight_count(lm.model) - (total - active)}


def path_record(lm) -> PathRecord:
    """{"exact": True}, or {"exact": False, "fast": FastRecord} for a model loaded with --fast."""
    fast = lm.config.extra.get("fast")
    if not fast:
        return {"exact": True}
    return {"exact": False, "fast": {"compute_dtype": dtype_name(lm.dtype), "kernel_choice": fast["kernel_choice"],
                                     "bf16_matrices": list(fast["bf16_matrices"])}}


def fast_parts(fast: dict) -> list[str]:
    """The fast path in words, for the terminal's headers and the report: what it computes with, and why those
    kernels."""
    choice = fast["kernel_choice"]
    return [in_words("`fast=True`: approximate, not the exact values"), f"{fast['compute_dtype']} activations, float32 norm and "
            f"softmax statistics", kernel_words(choice),
            in_words("how far it drifts from the exact path: `llmtrace compare --b-fast`")]


def kernel_words(choice: dict) -> str:
    """Which kernels ran the matrices, and how they were chosen: "matrices on int8pack_mm (int8 rows) x72 and
    int4pack_mm_for_cpu (two nibbles) x1 (measured at load, AVX512, 2 threads)". A trace written before the choice
    was per shape says int4 or bf16."""
    how = [choice["by"]] + [str(choice[k]) for k in ("capability",) if choice.get(k)]
    how += [plural(choice["threads"], "thread")] if choice.get("threads") else []
    kernels = choice.get("kernels")
    if kernels:
        named = [f"{name} x{n}" for name, n in kernels.items()]
        return f"matrices on {' and '.join(named) if len(named) < 3 else ', '.join(named)} ({', '.join(how)})"
    why = {"cuda": "on CUDA", "cpu capability": f"CPU capability {choice.get('capability')}"}.get(
        choice["by"], f"measured at load on {choice.get('capability')}: int4 {choice.get('int4_ms')} ms, bf16 "
                      f"{choice.get('bf16_ms')} ms a GEMV")
    kernel = "int4 kernel" if choice.get("int4") else "bf16 matrices (int4 kernel not chosen)"
    return f"{kernel} ({why})"


def explain_model_record(lm) -> ExplainModelRecord:
    return {**model_record(lm), "device": str(lm.device), "dtype": dtype_name(lm.dtype), **path_record(lm)}
