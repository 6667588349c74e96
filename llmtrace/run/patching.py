"""The activation-patching sweep (`llmtrace patch`): which layer and position carry the answer.

The corrupt prompt runs once for each layer ℓ and each position p, with the clean prompt's activation at `at` (a
residual-stream point), layer ℓ, position p patched in; each run is measured by m = logit(answer) − logit(against) at
the last position, and by its recovery (m − m_corrupt) / (m_clean − m_corrupt): 0 is the corrupt run's value, 1 the
clean run's. This is ROME's causal tracing and TransformerLens's `get_act_patch_resid_pre` and kin.

How it runs (every cell equals the single `Patch(ℓ, at, p, clean)` run of llmtrace.run.interventions, to float
rounding; tests/test_patching.py checks every cell):
- the clean prompt runs once and keeps its activation at `at` in every layer;
- the corrupt prompt runs once into a KV cache (its own metric);
- patching position p changes nothing before p (attention is causal), so the L runs patched at position p start from
  the corrupt cache's slots [0, p) and compute only the positions [p, T), as L rows of one batch (row ℓ patched at
  layer ℓ; rows are independent). T passes in all instead of L·T prefills, each of them shorter.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from llmtrace.errors import BadValue, LlmtraceError
from llmtrace.model.capture import capture
from llmtrace.run.interventions import grab, layer_output, resid_points
from llmtrace.units import plural


def answer_token(tok, text: str, field_name: str) -> int:
    """The one token `text` encodes to (without BOS), or a one-line error that shows its tokens."""
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        pieces = ", ".join(repr(tok.decode([i])) for i in ids) or "none"
        raise BadValue(field_name, f" {text!r} must be one token; it is {len(ids)}: {pieces}. Try another spelling "
                                   f"(a leading space is often part of a word's token)")
    return ids[0]


def patch_sweep(lm, clean: str, corrupt: str, answer: str, against: str, at: Optional[str] = None,
                encode: Optional[Callable[[str], list[int]]] = None,
                on_progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """The sweep as the trace's `patch` event: prompts, tokens, metrics of the clean and corrupt runs, and `cells`
    [{layer, position, metric, recovery}] for every layer × position. `at`: a residual-stream point the model
    declares (default: the layer's output). `encode` (default: plain text, as --from is encoded) turns the prompts
    into ids; `on_progress(done, total)` is called after each position."""
    pair = prompt_pair(lm, clean, corrupt, answer, against, at, encode)
    at, a_id, b_id, clean_ids, corrupt_ids = (pair[k] for k in ("at", "answer_id", "against_id", "clean_ids",
                                                                "corrupt_ids"))
    tok, model = lm.tokenizer, lm.model
    T, L = len(corrupt_ids), lm.config.n_layers
    t0 = time.perf_counter()
    grid = sweep_metrics(model, clean_ids, corrupt_ids, a_id, b_id, at, on_progress)
    seconds = time.perf_counter() - t0
    m_clean, m_corrupt = grid["clean"], grid["corrupt"]
    span = m_clean - m_corrupt
    cells = [{"layer": layer, "position": p, "metric": _r(m),
              "recovery": _r((m - m_corrupt) / span) if span != 0 else None}
             for layer in range(L) for p, m in enumerate(grid["metric"][layer].tolist())]
    return {
        "event": "patch", "at": at, "clean": clean, "corrupt": corrupt,
        "answer": {"text": answer, "id": a_id, "piece": tok.piece(a_id)},
        "against": {"text": against, "id": b_id, "piece": tok.piece(b_id)},
        "metric": "logit(answer) - logit(against) at the last position",
        "clean_tokens": [tok.piece(i) for i in clean_ids], "corrupt_tokens": [tok.piece(i) for i in corrupt_ids],
        "clean_texts": [tok.decode([i]) for i in clean_ids], "corrupt_texts": [tok.decode([i]) for i in corrupt_ids],
        "n_layers": L, "n_positions": T, "clean_metric": _r(m_clean), "corrupt_metric": _r(m_corrupt),
        "cells": cells, "seconds": round(seconds, 3),
    }


def prompt_pair(lm, clean: str, corrupt: str, answer: str, against: str, at: Optional[str] = None,
                encode: Optional[Callable[[str], list[int]]] = None) -> dict:
    """What a sweep (exact or estimated: run.attribution_patching) checks before its passes: `at` a residual-stream
    point (default: the layer's output), the two answers one token each and different, the prompts' ids of the same
    length within the context window. {"at", "answer_id", "against_id", "clean_ids", "corrupt_ids"}."""
    sweep_points = resid_points(lm.points)
    at = at or layer_output(lm.points)
    if at not in sweep_points:
        raise BadValue("at", f" {at!r} is not a residual-stream point; one of {', '.join(sweep_points)}")
    tok = lm.tokenizer
    a_id, b_id = answer_token(tok, answer, "answer"), answer_token(tok, against, "against")
    if a_id == b_id:
        raise BadValue("against", f" {against!r} is the same token as answer; the metric would be 0 everywhere",
                       also=("answer",))
    encode = encode or (lambda text: tok.encode_prompt(text)[1])
    clean_ids, corrupt_ids = encode(clean), encode(corrupt)
    if len(clean_ids) != len(corrupt_ids):
        raise LlmtraceError(f"the clean prompt has {plural(len(clean_ids), 'token')} and the corrupt prompt "
                            f"{len(corrupt_ids)}; patching pairs positions, so they must have the same number of "
                            f"tokens")
    T = len(corrupt_ids)
    if T > lm.config.max_seq_len:
        raise LlmtraceError(f"the prompts have {plural(T, 'token')} but the context window of {lm.name} "
                            f"is {lm.config.max_seq_len}")
    return {"at": at, "answer_id": a_id, "against_id": b_id, "clean_ids": clean_ids, "corrupt_ids": corrupt_ids}


def _r(x: float) -> float:
    return float(f"{x:.6g}")


@torch.inference_mode()
def sweep_metrics(model, clean_ids: list[int], corrupt_ids: list[int], answer: int, against: int, at: str,
                  on_progress=None) -> dict:
    """{"clean": m, "corrupt": m, "metric": (L, T) tensor}: the metric of every cell, in float (see the module doc)."""
    L, T = model.config.n_layers, len(corrupt_ids)
    device = model.embed.weight.device

    def metric(logits: torch.Tensor) -> torch.Tensor:  # (B, V) -> (B,)
        logits = logits.float()
        return logits[:, answer] - logits[:, against]

    last: list = []
    clean_acts = grab(model, clean_ids, [(layer, at) for layer in range(L)], logits=last)  # L × (T, D)
    m_clean = metric(last[0][None])[0].item()
    # the corrupt run: its KV cache (the slots before a patched position) and the stream entering every layer
    idx = torch.tensor([corrupt_ids], dtype=torch.long, device=device)  # (1, T)
    base = model.new_cache(T)
    entering_point = model.declared_points().layer[0].name  # a layer's first point: the stream entering it
    with capture(model, [(layer, entering_point) for layer in range(L)], clone=False) as kept:
        m_corrupt = metric(model(idx, base, 0, last_only=True))[0].item()
    entering = {layer: kept[(layer, entering_point)][0] for layer in range(L)}  # L × (T, D)
    grid = torch.empty(L, T, dtype=torch.float64)
    stateful = any(m.constant for m in model.memory())  # a memory of constant size (a state), not slots
    for p in range(T):
        before = _corrupt_prefix(model, idx, p, T) if stateful else base
        grid[:, p] = metric(_patched_at_position(model, before, entering, clean_acts, at, p, T, idx)).double().cpu()
        if on_progress is not None:
            on_progress(p + 1, T)
    return {"clean": m_clean, "corrupt": m_corrupt, "metric": grid}


def _corrupt_prefix(model, idx: torch.Tensor, p: int, T: int):
    """The corrupt run's cache after its first p tokens. A KV cache's slots [0, p) are the same in the cache of all T
    tokens, but a recurrent state after p tokens is not the state after T: it is computed again for each position."""
    cache = model.new_cache(T)
    if p > 0:
        model(idx[:, :p], cache, 0, last_only=True)
    return cache


def _patched_at_position(model, base, entering: dict, clean_acts: dict, at: str, p: int, T: int,
                         ids: torch.Tensor) -> torch.Tensor:
    """The L runs patched at position p, as the rows of one batch: (L, V) logits at the last position, row ℓ patched
    at layer ℓ.

    Row ℓ computes what the full patched run computes, less what it shares with the corrupt run: before position p
    nothing differs (the corrupt cache's slots [0, p) serve every row), and below layer ℓ nothing differs either, so
    row ℓ joins the batch at layer ℓ with the corrupt stream entering that layer (positions [p, T)). This is the
    model's layer loop (`run_layers`, one layer at a time) over a batch that grows by one row per layer, each layer
    with its own copy of the corrupt cache; the patch itself is made by the model's hook."""
    L = model.config.n_layers
    memory = model.memory()
    copies: dict = {}  # layer -> its cache copy for this position's rows (a KV-shared layer reads an earlier one's)
    # the corrupt run's ids of positions [p, T): their count sets the pass, and a family whose layers read the ids
    # themselves (Gemma 4's per-layer inputs) reads them
    inputs = model.layer_inputs(ids[:, p:], None, p, dtype=entering[0].dtype)

    def patch(layer: int, name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        if name != at:
            return None
        x = x.clone()  # (ℓ + 1, T - p, D): the newest row, ℓ, is the one patched at this layer
        x[-1, 0] = clean_acts[(layer, at)][p]
        return x

    x = entering[0][None, p:]  # (1, T - p, D): row 0 enters at layer 0
    with model.hooked(patch, spell_out=False):
        for layer in range(L):
            if layer > 0:
                x = torch.cat([x, entering[layer][None, p:]])  # row ℓ = layer joins: (ℓ + 1, T - p, D)
            rows = layer + 1
            j = memory[layer].reads
            if j is not None:  # rows that joined after layer j read layer j's corrupt entries
                cache = copies[j].joined(base.layers[j].rows(rows - j - 1, T)) if rows > j + 1 else copies[j]
            else:  # the corrupt run's memory after positions [0, p) (a state), or its slots: one copy a row
                cache = copies[layer] = base.layers[layer].rows(rows, T)
            inputs[layer] = inputs[layer]._replace(cache=cache)  # slots [p, T) written over the copy; [0, p) corrupt
            x = model.run_layers(x, inputs, [layer])
    return model.head(x, last_only=True)  # (L, V)
