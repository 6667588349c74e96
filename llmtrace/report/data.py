"""What the report shows, taken from a trace's events: one plain dict, the page's only source of numbers.

`extract(events)` reads the events once and returns the data of every section. A section whose events are missing
gets a `missing` note naming the flags that would record them. Numbers are copied from the events as they are, except
the attention probabilities: they are binned when the sequence is long and stored as 16-bit fixed point (see
`pack_attention`); the page says so where it shows them.

Traces of batched runs will carry a "row" on step and tensor events; an event without one is row 0. `extract` reads
one row (`row=0`), so a batch is one more argument, not a new reader.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Optional

import numpy as np

from llmtrace.model.gqa import gqa_groups
from llmtrace.errors import LlmtraceError
from llmtrace.tokens.vocab import CHAR_TO_BYTE
from llmtrace.trace.events import SCHEMA_ID
from llmtrace.report.walk import (ATTENTION_AXES, attention_points, axes_of, declared_points, embedding_point,
                                  maths_view, residual_output, step_logits, walk)

AFTER_EMBEDDING = "e"  # the residual chart's key of the stream after the embedding (the others: layer numbers)
MAX_POSITIONS = 128  # attention maps wider than this many positions are binned to this many bins
ATTENTION_BUDGET = 600_000  # most attention cells embedded (2 bytes each): keeps a report within a few MB
TENSOR_BUDGET = 12_000  # most tensor-statistics rows embedded; beyond it, steps are kept evenly spaced
Q16 = 65535  # attention probabilities are stored as round(p * Q16)

def check_schema(events: list[dict], declared: Optional[str] = None) -> str:
    """The trace's kind ("generate", "explain" or "lens"); raises LlmtraceError for a trace this version cannot read."""
    for schema in [declared] + [e.get("schema") for e in events if e.get("event") == "run"]:
        if schema is not None and schema != SCHEMA_ID:
            raise LlmtraceError(f"trace schema {schema!r} is not {SCHEMA_ID!r}, the one this llmtrace reads; "
                                f"render it with the llmtrace version that wrote it")
    if any(e.get("event") == "run" for e in events):
        return "generate"
    head = next((e for e in events if e.get("event") == "explain" and e.get("section") == "model"), None)
    if head is not None:
        return "lens" if head.get("command") == "lens" else "explain"
    raise LlmtraceError("not an llmtrace trace: it has no run event (generate) and no model section (explain, lens)")


def _row(ev: dict) -> int:
    return ev.get("row", 0)


def extract(events: list[dict], *, row: int = 0, merges: Optional[list[dict]] = None,
            merges_note: Optional[str] = None) -> dict:
    """The data of every section of the report, from the events of one trace (one batch row)."""
    kind = check_schema(events)
    by_kind: dict[str, list[dict]] = {}
    for ev in events:
        if ev.get("event") in ("step", "tensor", "tokens", "prediction", "routing") and _row(ev) != row:
            continue
        by_kind.setdefault(ev.get("event"), []).append(ev)
    run = (by_kind.get("run") or [None])[0]
    explain = [e for e in by_kind.get("explain", [])]
    head = next((e for e in explain if e.get("section") == "model"), None)
    model = dict(run["model"]) if run else dict(head["model"])
    steps = sorted(by_kind.get("step", []), key=lambda e: e["step"])
    tensors = by_kind.get("tensor", [])
    tokens = (by_kind.get("tokens") or [{"tokens": []}])[0]["tokens"]
    summary = (by_kind.get("summary") or [None])[0]
    batch = (by_kind.get("batch") or [None])[0]
    points = declared_points(run, head, tensors)
    data: dict[str, Any] = {
        "kind": kind,
        "run": _run_facts(run, head, model, summary, row),
        "tokens": _tokens(tokens, steps),
        "steps": [_step(e) for e in steps],
        "pipeline": _pipeline(by_kind.get("shapes", []), tensors, model, run, tokens, batch, row, points),
        "attention": _attention(tensors, explain, model, pad_slots(batch, row), attention_points(points)),
        "lens": _lens(by_kind.get("lens", []), head, tokens),
        "kv": _kv(steps, model),
        "residual": _residual(tensors, model, points),
        "routing": _routing(by_kind.get("routing", [])),
        "points": points,
        "walk": walk(tensors, points),
        "maths": maths_view(run, head),
        "kept_logits": step_logits(steps, tensors, points),
        "pad": pad_slots(batch, row),
        "batch": _batch(batch, row, run),
        "positions": (batch or {}).get("position_ids", [None] * (row + 1))[row] if batch else None,
        "merges": {"words": merges, "note": merges_note} if merges is not None else {"words": None, "note": merges_note},
    }
    data["tensors"] = _tensor_table(tensors)
    return data


# ----------------------------------------------------------------------------------------------------------------
# the run, the tokens and the steps



def _row_sampling(run: Optional[dict], row: int) -> Optional[dict]:
    """The run's sampler settings as row `row` used them: in a batch, each row has its own seed (run.row_seeds)."""
    if not run or run.get("sampling") is None:
        return None
    seeds = run.get("row_seeds")
    return run["sampling"] | ({"seed": seeds[row]} if seeds and row < len(seeds) else {})


def _run_facts(run: Optional[dict], head: Optional[dict], model: dict, summary: Optional[dict], row: int = 0) -> dict:
    src = run or head
    batch = run.get("batch") if run else None  # a batch of prompts: the page shows one row
    facts = {
        "model": model,
        "groups": gqa_groups(model["n_heads"], model["n_kv_heads"]),
        "device": src.get("device", model.get("device")),
        "dtype": src.get("dtype", model.get("dtype")),
        "fast": src.get("fast", model.get("fast")),  # --fast: the run approximates the exact path
        "interventions": src.get("interventions") or [],  # --ablate, --scale, --patch, --steer, --control-vector
        "threads": src.get("threads"),
        "prompt": src.get("prompt", ""),
        "chat": src.get("chat", False),
        "sampling": _row_sampling(run, row),
        "trace": run.get("trace") if run else None,
        "compiled": run.get("compiled") if run else None,
        "version": run.get("llmtrace_version") if run else None,
        "command": head.get("command") if head and not run else "generate",
        "layer": head.get("layer") if head and not run else None,
        "summary": None,
    }
    if summary is not None and summary.get("command", "generate") == "generate":  # explain's and lens's say less
        facts["summary"] = {k: summary.get(k) for k in ("prompt_tokens", "generated_tokens", "stop_reason", "ttft_ms",
                                                         "prefill_tok_s", "decode_tok_s", "interrupted", "text")}
    if batch:
        facts["batch"] = {"rows": batch, "row": row}  # the page says it: "generate, a batch of ..."
        facts["prompt"] = (run.get("prompts") or [""] * batch)[row]
        entry = next((r for r in (summary or {}).get("rows", []) if r["row"] == row), None)
        if entry is not None:
            facts["summary"].update(prompt_tokens=entry.get("prompt_tokens"), generated_tokens=len(entry["tokens"]),
                                    stop_reason=entry["stop_reason"], text=entry["text"])
    return facts


def piece_bytes(piece: str, text: str) -> list[int]:
    """The UTF-8 bytes a token stands for: from its byte-level piece ('Ġthe'), its byte-fallback piece ('<0xE4>'),
    else from its decoded text (a sentencepiece '▁' is a space)."""
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
        try:
            return [int(piece[3:5], 16)]
        except ValueError:
            pass
    if piece and all(ch in CHAR_TO_BYTE for ch in piece):  # GPT-2's byte-level alphabet (Ġ for the space)
        return [CHAR_TO_BYTE[ch] for ch in piece]
    return list(piece.replace("▁", " ").encode("utf-8")) if piece else list(text.encode("utf-8"))


def _tokens(prompt: list[dict], steps: list[dict]) -> list[dict]:
    out = []
    for t in prompt:
        out.append({"index": t["index"], "id": t["id"], "piece": t["piece"], "text": t["text"],
                    "bytes": piece_bytes(t["piece"], t["text"]), "special": bool(t.get("special")), "step": None,
                    "prob": None})
    n = len(out)
    for e in steps:
        tok = e["token"]
        stages = e.get("sampler") or []
        prob = stages[0]["pick_prob"] if stages else None  # what the model gave it, before any sampler stage
        out.append({"index": n + e["step"], "id": tok["id"], "piece": tok["piece"], "text": tok["text"],
                    "bytes": piece_bytes(tok["piece"], tok["text"]), "special": bool(tok.get("special")),
                    "step": e["step"], "prob": prob})
    return out


def _step(e: dict) -> dict:
    return {"step": e["step"], "phase": e["phase"], "position": e["position"], "token": e["token"],
            "topk": e.get("topk"), "sampler": e.get("sampler"), "rng": e.get("rng"), "kv": e["kv_cache"],
            "ms": e.get("ms")}


# ----------------------------------------------------------------------------------------------------------------
# the pipeline s1-s12

# The seed table's steps, in order (seeds/001); each shows the points whose declared seed step it is. Their titles
# are words of the page, in its catalogue (report/catalogue/LANG.json: "step.s6.1").
SEED_TABLE = ("s1", "s2", "s3", "s4", "s5", "s6.1", "s6.2", "s6.3", "s6.4", "s6.5", "s6.6", "s6.7", "s6.8", "s7", "s8",
              "s9", "s10", "s11", "s12")
VALUE_STAGES = ("temperature", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "ban", "dry")


def _pipeline(shapes_events: list[dict], tensors: list[dict], model: dict, run: Optional[dict],
              tokens: list[dict], batch: Optional[dict] = None, row: int = 0,
              points: Optional[list[dict]] = None) -> dict:
    """The seed table's steps, each with the points the model declares at that step ("s6.1/s6.2" sits at both) and
    their shapes in the prefill, with axes where the trace names them."""
    by_name = {p["name"]: p for p in points or []}
    shapes: dict[str, dict] = {}
    for ev in shapes_events[:1]:
        for p in ev["points"]:
            shapes.setdefault(p["name"], {"shape": p["shape"], "axes": p.get("axes") or axes_of(p, by_name),
                                          "step": p.get("seed_step")})
    for ev in tensors:  # explain traces (and points the shape table lacks) carry shapes on their tensor events
        if ev.get("step", 0) == 0:
            shapes.setdefault(ev["name"], {"shape": ev["shape"], "axes": axes_of(ev, by_name),
                                           "step": ev.get("seed_step")})
    order = [p["name"] for p in points or []] + [n for n in shapes if n not in by_name]
    masked = next((ev["masked"] for ev in tensors if "masked" in ev and ev.get("step", 0) == 0), None)
    sampling = (run or {}).get("sampling") or {}
    order_run, active = sampling.get("order", []), set(sampling.get("stages", []))
    stages = []
    for sid in SEED_TABLE:
        here = [n for n in order if sid in ((by_name.get(n) or {}).get("step") or (shapes.get(n) or {}).get("step")
                                            or "").split("/")]
        stage: dict[str, Any] = {"id": sid, "points": [{"name": n, "shape": (shapes.get(n) or {}).get("shape"),
                                                        "axes": (shapes.get(n) or {}).get("axes")} for n in here]}
        if sid in ("s1", "s2"):
            stage["shape"] = [len(tokens)]
        if sid == "s3":
            stage["masked"] = masked
            if batch is not None:  # the row's pad slots: the shapes are those of the padded batch
                mask = batch["attention_mask"][row]
                stage["padding"] = {"pad_slots": len(mask) - sum(mask), "slots": len(mask), "rows": len(batch["ids"])}
        if sid == "s10":
            stage["sampler"] = [s for s in order_run if s in VALUE_STAGES]
        if sid == "s11":  # mirostat is in no order: it replaces the truncation chain, last
            stage["sampler"] = ([s for s in order_run if s not in VALUE_STAGES]
                                + (["mirostat"] if "mirostat" in active else []))
        if sid in ("s10", "s11"):
            stage["active"] = [s for s in stage["sampler"] if s in active]
        stages.append(stage)
    return {"stages": stages, "n_layers": model["n_layers"]}


def _tensor_table(tensors: list[dict]) -> dict:
    """Statistics of every recorded point, for the pipeline's panel (report.js): {name: [row, ...]}, each row
    {step, layer, mean, std, min, max, norm, shape} (layer None outside the layers). Past TENSOR_BUDGET rows, only
    evenly spaced steps are kept (always the first and the last)."""
    steps = sorted({ev.get("step", 0) for ev in tensors})
    kept = set(steps)
    if len(tensors) > TENSOR_BUDGET and steps:
        per_step = max(1, len(tensors) // len(steps))
        n = max(2, TENSOR_BUDGET // per_step)
        kept = {steps[round(i * (len(steps) - 1) / (n - 1))] for i in range(n)} if n < len(steps) else set(steps)
    table: dict[str, list] = {}
    for ev in tensors:
        step = ev.get("step", 0)
        if step not in kept:
            continue
        s = ev["stats"]
        table.setdefault(ev["name"], []).append({"step": step, "layer": ev["layer"], "mean": s["mean"], "std": s["std"],
                                                 "min": s["min"], "max": s["max"], "norm": s["norm"],
                                                 "shape": ev["shape"]})
    return {"points": table, "steps": sorted(kept), "all_steps": len(steps)}


# ----------------------------------------------------------------------------------------------------------------
# attention


def bins_for(n: int, max_bins: int = MAX_POSITIONS) -> list[tuple[int, int]]:
    """[lo, hi) position ranges: one per position up to max_bins positions, else max_bins nearly equal bins."""
    if n <= max_bins:
        return [(i, i + 1) for i in range(n)]
    edges = [round(i * n / max_bins) for i in range(max_bins + 1)]
    return [(edges[i], edges[i + 1]) for i in range(max_bins)]


def bin_matrix(m: np.ndarray, bins: list[tuple[int, int]]) -> np.ndarray:
    """(H, N, N) probabilities -> (H, B, B): each query bin is the mean of its rows, each key bin the sum of its
    columns, so every binned row still sums to 1."""
    if len(bins) == m.shape[-1]:
        return m
    cols = np.stack([m[..., lo:hi].sum(axis=-1) for lo, hi in bins], axis=-1)  # (H, N, B)
    return np.stack([cols[:, lo:hi].mean(axis=1) for lo, hi in bins], axis=1)  # (H, B, B)


def pack_attention(m: np.ndarray) -> str:
    """Probabilities in [0, 1] as little-endian uint16 round(p * 65535), base64: within 1/131070 of each value."""
    q = np.rint(np.clip(m, 0.0, 1.0) * Q16).astype("<u2")
    return base64.b64encode(q.tobytes()).decode("ascii")


def unpack_attention(text: str, shape: tuple[int, ...]) -> np.ndarray:
    return (np.frombuffer(base64.b64decode(text), dtype="<u2").astype(np.float64) / Q16).reshape(shape)


def _batch(batch: Optional[dict], row: int, run: Optional[dict]) -> Optional[dict]:
    """s3 of a batch of prompts: every row's padded ids, attention_mask and position_ids as the first pass saw them,
    the pad id and its piece, and the row this page shows. None for one prompt (no padding: the mask is all ones)."""
    if batch is None:
        return None
    return {"rows": len(batch["ids"]), "row": row, "ids": batch["ids"], "attention_mask": batch["attention_mask"],
            "position_ids": batch["position_ids"], "pad_id": batch.get("pad_id"), "pad_piece": batch.get("pad_piece"),
            "pad_source": batch.get("pad_source"), "prompts": (run or {}).get("prompts")}


def pad_slots(batch: Optional[dict], row: int) -> int:
    """The slots of a batch row that hold its left padding (s3): the row's tokens start after them. 0 for one prompt.
    The attention maps of a row are indexed by slot; its tokens and positions by token."""
    if batch is None or row >= len(batch.get("attention_mask") or []):
        return 0
    mask = batch["attention_mask"][row]
    return next((i for i, m in enumerate(mask) if m), len(mask))


def _attention(tensors: list[dict], explain: list[dict], model: dict, pad: int = 0,
               probs: Optional[set[str]] = None) -> dict:
    """The attention maps, by slot: `pad` leading slots of a batch row are padding (never attended: drawn masked)."""
    H = model["n_heads"]
    out: dict[str, Any] = {"n_heads": H, "groups": gqa_groups(H, model["n_kv_heads"]), "layers": [], "maps": {},
                           "heads": list(range(H)), "binned": False, "bins": None, "n": 0, "source": None,
                           "quant": Q16, "notes": [], "pad": pad}
    rows_of: dict[int, dict[int, np.ndarray]] = {}  # layer -> query position -> (H, S) probabilities
    for ev in tensors:
        if "values" not in ev or ev["layer"] is None:
            continue
        if ev["name"] not in (probs or ()) and not (not probs and (ev.get("seed_step") or "").startswith("s6.5")
                                                    and ev.get("axes", ATTENTION_AXES) == ATTENTION_AXES
                                                    and len(ev["shape"]) == 3 and ev["shape"][0] == H):
            continue  # an older trace without declarations: a dumped s6.5 tensor shaped (H, T, S)
        v = np.asarray(ev["values"], dtype=np.float64)  # (H, T, S): T new queries over S keys
        if v.ndim != 3:
            continue
        T, S = v.shape[1], v.shape[2]
        for t in range(T):
            rows_of.setdefault(ev["layer"], {})[S - T + t] = v[:, t, :]
    if rows_of:
        n = max(max(r) + 1 for r in rows_of.values())
        bins = bins_for(n)
        maps = {}
        for layer, rows in sorted(rows_of.items()):
            m = np.zeros((H, n, n))
            for q, vec in rows.items():
                m[:, q, : vec.shape[1]] = vec
            maps[layer] = bin_matrix(m, bins)
        out.update(source="maps", n=n, layers=sorted(maps), bins=[list(b) for b in bins], binned=len(bins) < n)
        if H * len(bins) ** 2 * len(maps) > ATTENTION_BUDGET:  # many layers: keep the first ones that fit
            keep = max(1, ATTENTION_BUDGET // (H * len(bins) ** 2))
            out["notes"].append({"key": "attention.note_kept", "keep": keep, "n": len(maps)})
            maps = dict(list(maps.items())[:keep])
            out["layers"] = sorted(maps)
        out["maps"] = {str(k): pack_attention(v) for k, v in maps.items()}
        return out
    amaps = [e for e in explain if e.get("section") == "attention_map"]
    if amaps:  # explain: one binned map of its layer, the mean over heads or one head
        e = amaps[0]
        m = np.asarray([[x if x is not None else 0.0 for x in r] for r in e["matrix"]], dtype=np.float64)[None]
        head = e.get("head")
        out.update(source="explain", n=e["n_tokens"], layers=[e["layer"]], bins=e["bins"], binned=e["binned"],
                   heads=[head if head is not None else "mean"], pad=0)
        out["maps"] = {str(e["layer"]): pack_attention(m)}
        out["notes"].append({"key": "attention.note_explain_mean"} if head is None else
                            {"key": "attention.note_explain_head", "head": head})
    return out


# ----------------------------------------------------------------------------------------------------------------
# logit lens, KV cache, residual stream


def _lens(lens: list[dict], head: Optional[dict], tokens: list[dict]) -> Optional[dict]:
    """The logit lens: a row per (layer, stage) in the order the pass reaches them, then the model's output (the row
    without a layer); a layer lensed at several points labels its earlier ones by their point."""
    if not lens:
        return None
    positions = sorted({e["position"] for e in lens})
    rows: dict[tuple, dict] = {}
    stages_of: dict[Any, list[str]] = {}
    for e in lens:
        key = (e["layer"], e["stage"])
        if key not in rows:
            stages_of.setdefault(e["layer"], []).append(e["stage"])
            rows[key] = {"layer": e["layer"], "stage": e["stage"], "cells": {}}
        rows[key]["cells"][str(e["position"])] = e["topk"]
    for r in rows.values():
        last = stages_of[r["layer"]][-1] == r["stage"]
        r["label"] = "output" if r["layer"] is None else f'{r["layer"]}' + ("" if last else f' ({r["stage"]})')
    ordered = sorted(rows.values(), key=lambda r: (r["layer"] is None, r["layer"] or 0,
                                                   stages_of[r["layer"]].index(r["stage"])))
    return {"positions": positions, "rows": ordered, "pieces": {str(t["index"]): t["text"] for t in tokens}}


def _kv(steps: list[dict], model: dict) -> Optional[dict]:
    if not steps:
        return None
    """The KV cache section: the step events' kv_cache records as the run wrote them (element size and the no-GQA
    figure included; a trace from before they were recorded shows those two as unknown)."""
    kv = [{"step": e["step"], **e["kv_cache"]} for e in steps]
    first = kv[0]
    state = first.get("state")  # layers whose memory is of a fixed size (a state, a window), not K and V
    memory = model.get("memory")  # each layer's declared memory (model.memory); a trace from before: K and V or a state
    kv_layers = (sum(1 for m in memory if m["per_token_bytes"]) if memory else
                 model["n_layers"] - len(state["layers"] if state else ()))
    return {"steps": kv, "bytes_per_token": first["bytes_per_token"], "state": state, "kv_layers": kv_layers,
            "per_layer": first["bytes_per_token"] / max(1, kv_layers),
            "element_size": first.get("element_size"), "mha_bytes_per_token": first.get("mha_bytes_per_token")}


def _residual(tensors: list[dict], model: dict, points: list[dict]) -> Optional[dict]:
    """Norm of each token's residual stream after every layer (the layer's output: its last declared residual point)
    and after the embedding: a pass over T tokens reports the norm of the whole (T, D) tensor, so it is divided by
    √T, the root mean square of the per-token norms (exact for one token)."""
    out_point, embed = residual_output(points), embedding_point(points)
    if out_point is None:  # an older trace without declarations: the layer's last recorded s6.7 point of shape (T, D)
        out_point = next((p["name"] for p in reversed(points) if p["layer"] and p["step"] == "s6.7"), None)
    series: dict[int, dict[str, float]] = {}
    for ev in tensors:
        if ev["name"] not in (out_point, embed) or ev["stats"]["norm"] is None or (ev["name"] == embed) != (
                ev["layer"] is None):
            continue
        t = ev["shape"][0] if len(ev["shape"]) == 2 else 1
        key = AFTER_EMBEDDING if ev["layer"] is None else str(ev["layer"])
        series.setdefault(ev.get("step", 0), {})[key] = ev["stats"]["norm"] / math.sqrt(t)
    if not any(len([k for k in s if k != AFTER_EMBEDDING]) for s in series.values()):
        return None
    layers = sorted({int(k) for s in series.values() for k in s if k != AFTER_EMBEDDING})
    return {"layers": layers, "steps": sorted(series), "norms": {str(k): v for k, v in sorted(series.items())}}


# ----------------------------------------------------------------------------------------------------------------
# the router ledger (a mixture of experts)


def _routing(events: list[dict]) -> Optional[dict]:
    """Each MoE layer's choice at each position of the row (its routing events: the prompt's pass, then one position
    per step), and each layer's load over those positions: {"layers", "n_experts", "k", "renormalised", "cells":
    {layer: {position: [experts, weights]}}, "load": [{"layer", "tokens", "load", "imbalance"}]}. None without them."""
    if not events:
        return None
    cells: dict[str, dict[str, list]] = {}
    for e in events:
        mine = cells.setdefault(str(e["layer"]), {})
        for p, experts, weights in zip(e["positions"], e["experts"], e["weights"]):
            mine[str(p)] = [experts, weights]
    first = events[0]
    E, K = first["n_experts"], first["k"]
    load = []
    for layer, by_pos in cells.items():
        counts = [0] * E
        for experts, _ in by_pos.values():
            for x in experts:
                counts[x] += 1
        mean = len(by_pos) * K / E
        load.append({"layer": int(layer), "tokens": len(by_pos), "load": counts,
                     "imbalance": round(max(counts) / mean, 4) if mean else None})
    return {"layers": sorted(int(k) for k in cells), "n_experts": E, "k": K,
            "renormalised": first.get("renormalised", True), "cells": cells,
            "load": sorted(load, key=lambda r: r["layer"])}
