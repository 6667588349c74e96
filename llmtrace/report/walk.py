"""The learner's parts of the report, from a trace's events: the model's declared points, the walk-through's values
and each step's logits for the what-if sampler.

    declared_points  the points in forward order with their seed step, axes, what they are and their input (the run
                     event's `points`, as the model declares them; for an older trace, the points it recorded)
    walk             every sampled tensor (tensor.sample, --trace full) by step, layer and point, packed as float32
    step_logits      each step's raw logits: the 1,000 largest and the rest as a histogram (step.logits), or every
                     one where the trace dumped them (--dump logits)

No point is named here: what a point is comes from its declaration (its seed step, its axes, `input`, `residual`).
"""

from __future__ import annotations

import base64
from typing import Any, Optional

import numpy as np

from llmtrace.trace.packed import pack, unpack

# The axes of an attention map (a declared point): query heads × the pass's tokens × the key slots they attend.
ATTENTION_AXES = ["H", "T", "S"]


def declared_points(run: Optional[dict], head: Optional[dict], tensors: list[dict]) -> list[dict]:
    """The model's observable points in forward order: {name, step, axes, about, input, layer, residual}. A trace
    written before points were declared has none: its recorded points then stand in, with their seed steps and
    without axes."""
    decl = (run or {}).get("points") or (head or {}).get("points")
    if decl:
        return [{"name": p["name"], "step": p.get("seed_step") or "", "axes": list(p.get("axes") or []) or None,
                 "about": p.get("about", ""), "input": p.get("input", ""), "layer": bool(p.get("layer")),
                 "residual": bool(p.get("residual")), "traced": p.get("traced", True)} for p in decl]
    seen: dict[tuple[str, bool], Optional[str]] = {}
    for ev in tensors:
        seen.setdefault((ev["name"], ev["layer"] is not None), ev.get("seed_step"))
    return [{"name": n, "step": s or "", "axes": None, "about": "", "input": "", "layer": lay, "residual": False,
             "traced": True} for (n, lay), s in seen.items()]


def axes_of(ev: dict, by_name: dict[str, dict]) -> Optional[list[str]]:
    """The axes of a tensor event: its own `axes`, else its point's declared ones where they describe its shape."""
    axes = ev.get("axes") or (by_name.get(ev["name"]) or {}).get("axes")
    if axes and "K" in axes and len(axes) == len(ev["shape"]) + 1:  # a dense layer of a family with experts (DeepSeek's
        axes = [a for a in axes if a != "K"]  # first layers): its feed-forward points have no axis of chosen experts
    if axes and axes[0] == "H" and len(axes) == len(ev["shape"]) - 1:  # the repeated keys as recorded: (Hkv, G, ...)
        axes = ["Hkv", "G"] + list(axes[1:])
    return list(axes) if axes and len(axes) == len(ev["shape"]) else None


def attention_points(points: list[dict]) -> set[str]:
    """The points that are attention probabilities: softmax's output (s6.5) over heads × tokens × slots."""
    return {p["name"] for p in points if p["axes"] == ATTENTION_AXES and p["step"].split("/")[0] == "s6.5"}


def residual_output(points: list[dict]) -> Optional[str]:
    """The point that is a layer's output: the last residual-stream point of the layer (None without declarations)."""
    res = [p["name"] for p in points if p["layer"] and p["residual"] and p.get("traced", True)]
    return res[-1] if res else None


def embedding_point(points: list[dict]) -> Optional[str]:
    """The point of s4 (the embedding), outside the layers."""
    return next((p["name"] for p in points if not p["layer"] and p["step"] == "s4"), None)


def maths_view(run: Optional[dict], head: Optional[dict], words: Optional[dict] = None) -> Optional[dict]:
    """The model's declared maths for the page (model.maths): the trace's record, and each point's formula with its
    layer kind's constants, written once here (maths.formula, in the page's `words`) so that the page shows what
    explain prints. None for a trace written before the maths was declared."""
    from llmtrace.model.maths import Maths, card_numbers, formula

    record = (run or {}).get("maths") or (head or {}).get("maths")
    maths = Maths.from_record(record)
    if maths is None:
        return None
    first = {k: record["layer_kind"].index(k) for k in range(len(record["kinds"]))}
    kinds = [{n: formula(o, n, -1, maths, words) for n, o in maths.layers[first[k]].items()}
             for k in range(len(record["kinds"]))]
    return {"record": record, "formulas": {"model": {n: formula(o, n, None, maths, words) for n, o in maths.model.items()},
                                           "kinds": kinds},
            # the numbers each card prints from its operation's constants alone, as the kind declares them
            # (OpKind.card: RoPE's unscaled θᵢ, the only kind that has any; the page reads them as `rope`)
            "rope": [{n: card for n, o in maths.layers[first[k]].items() if (card := card_numbers(o))}
                     for k in range(len(record["kinds"]))]}


def pack_f32(values) -> str:
    """Numbers as little-endian float32, base64 (trace.packed): a trace's packed values as they are; a list (None for
    a non-finite value) or an array packed."""
    return values if isinstance(values, str) else pack(values)


def f24_bytes(values) -> np.ndarray:
    """Numbers as float32 without their last 8 bits (rounded to nearest): (n, 3) bytes, little-endian (pack_f24)."""
    f = unpack(values).astype("<f4")
    a = f.view("<u4").astype(np.uint64)
    sign, mag = a & 0x80000000, a & 0x7FFFFFFF
    mag = np.where(np.isfinite(f), np.minimum(mag + 0x80, 0x7F7FFFFF), mag)  # rounding never makes an infinity
    a = (sign | mag).astype(np.uint32)
    return a.view(np.uint8).reshape(-1, 4)[:, 1:]  # the three high bytes of each little-endian float32


def pack_f24(values) -> str:
    """Numbers as float32 without their last 8 bits (rounded to nearest), 3 bytes each, little-endian, base64: about
    5 significant figures (relative error below 2e-5), what the walk-through shows. A trace's packed values, a list
    (None for a non-finite value) or an array."""
    return base64.b64encode(f24_bytes(values).tobytes()).decode("ascii")


def pack_f24_beside(values: np.ndarray, shown: np.ndarray) -> dict:
    """`values` as pack_f24 would show them, where most equal the `shown` ones to those 24 bits (a card's computed
    values beside the recorded ones): "same", a bit per entry (1: the shown entry's 24 bits, little-endian bit
    order), and "v", pack_f24 of the others only. Lossless against pack_f24, and a fraction of its size."""
    a, b = f24_bytes(values), f24_bytes(shown)
    same = (a == b).all(axis=1)
    return {"same": base64.b64encode(np.packbits(same, bitorder="little").tobytes()).decode("ascii"),
            "v": base64.b64encode(a[~same].tobytes()).decode("ascii")}


def pack_ids(values: list[int], vocab: int) -> str:
    """Token ids as little-endian uint16 when the vocabulary fits (49,152 for SmolLM2), else uint32, base64."""
    return base64.b64encode(np.asarray(values, dtype="<u2" if vocab <= 1 << 16 else "<u4").tobytes()).decode("ascii")


def walk(tensors: list[dict], points: list[dict]) -> dict:
    """The walk-through's values: {"samples": {"STEP/LAYER/NAME": [m, v, n, x]}, "metas": [...], "indexes": [...],
    "layers": [...], "steps": [...], "card_layers": [...]}, LAYER "m" for a point outside the layers. A sample's meta
    `metas[m]` gives its shape, axes, `rows` (the recorded shape's other axes, row-major) and `ix`, the entries
    `indexes[ix]` kept along the last axis; `v` its values (rows × entries) and each row's norm after them, packed by
    pack_f24 (about 5 significant figures, what the page shows) (the slots a pass wrote, the KV cache's point, are
    {"m", "positions"}). `x`, where the trace computed the point's card (trace.cards): "c" the computed values (rows ×
    entries, pack_f24), "e" each row's largest |computed − recorded| and that over the row's largest |recorded|
    (worked out here in float64, from the trace's own numbers: rows × 2, pack_f24), "aux" the numbers its words print
    (per row), "dot" a matrix product's first kept entry as Σ_j x_j·W_ij, its weight rows ("w", "b") in
    "dot_weights" once per layer and point where every pass reads the same. The few distinct metas and index lists
    are kept once: a page of every layer stays within 2 MB."""
    by_name = {p["name"]: p for p in points}
    samples: dict[str, Any] = {}
    indexes: list[list[int]] = []
    metas: list[dict] = []  # the few distinct (shape, axes, entries kept, rows) of the samples, each stored once

    def meta(m: dict) -> int:
        if m not in metas:
            metas.append(m)
        return metas.index(m)

    layers, steps, carded = set(), set(), set()
    dot_weights: dict[str, dict] = {}  # "LAYER/NAME" -> a dot product's weight rows (and bias), kept once
    for ev in tensors:
        s = ev.get("sample")
        step = ev.get("step", 0)
        key = f'{step}/{"m" if ev["layer"] is None else ev["layer"]}/{ev["name"]}'
        if "positions" in ev and not s:  # the slots a pass wrote (the KV cache's point): [first, last]
            samples[key] = {"m": meta({"shape": ev["shape"], "axes": axes_of(ev, by_name)}),
                            "positions": ev["positions"]}
            continue
        if not s or not len(s["values"]):
            continue
        if s["index"] not in indexes:
            indexes.append(s["index"])
        # a tensor of one row has no norms in its sample: its statistics' norm is that row's
        norms = unpack(s["norms"] if s.get("norms") is not None else [ev["stats"]["norm"]])
        m = meta({"shape": ev["shape"], "axes": axes_of(ev, by_name), "ix": indexes.index(s["index"]), "rows": len(norms)})
        # 24-bit values and their rows' norms in one string (the norms after the rows × entries values): a page of
        # every layer holds thousands of samples, and one string each keeps it within 2 MB
        values = unpack(s["values"])
        samples[key] = [m, pack_f24(np.concatenate([values, norms]))]
        c = s.get("computed")
        if c is not None:
            x = card_values(c, values, len(s["index"]))
            at = key.split("/", 1)[1]
            for name in ("w", "b"):  # a weight row is the same in every pass: kept once per layer and point
                d = x.get("dot") or {}
                if name in d and dot_weights.setdefault(at, {}).setdefault(name, d[name]) == d[name]:
                    del d[name]
            samples[key] += [None, x]
            if ev["layer"] is not None:
                carded.add(ev["layer"])
        steps.add(step)
        if ev["layer"] is not None:
            layers.add(ev["layer"])
    # a long prompt is prefilled in chunks (run.generate.PREFILL_CHUNK): each chunk's events share step 0, and the
    # page keeps the last chunk's; its rows along T are the prompt's last ones
    rows = [ev["shape"][0] for ev in tensors if ev.get("step", 0) == 0 and ev["layer"] is not None and ev.get("shape")
            and (axes_of(ev, by_name) or [None])[0] == "T"]
    return {"samples": samples, "metas": metas, "indexes": indexes, "layers": sorted(layers), "steps": sorted(steps),
            "card_layers": sorted(carded), "dot_weights": dot_weights, "prefill_rows": rows[-1] if rows else None}


def row_errors(computed: np.ndarray, recorded: np.ndarray) -> np.ndarray:
    """(rows, 2): each row's largest |computed − recorded| (a masked entry, −∞ or a missing value in an older trace,
    against −∞: none) and that over the row's largest finite |recorded|; NaN for a row with an entry not computed."""
    masked_c, masked_r = np.isneginf(computed), np.isneginf(recorded) | np.isnan(recorded)
    with np.errstate(invalid="ignore"):
        d = np.where(masked_c & masked_r, 0.0, np.abs(computed - recorded))
    d = np.where(masked_c ^ masked_r, np.inf, d)
    absolute = d.max(axis=1)
    big = np.where(np.isfinite(recorded), np.abs(recorded), 0.0).max(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        relative = np.where(big > 0, absolute / np.where(big > 0, big, 1.0), absolute)
    return np.stack([absolute, relative], axis=1)


def card_values(c: dict, recorded: np.ndarray, k: int) -> dict:
    """A point's computed sample (trace.cards) as the page carries it: the values, each row's difference from the
    recorded values (float64), the words' numbers and a matrix product's dot product."""
    computed = unpack(c["values"]).reshape(-1, k)
    out: dict[str, Any] = {"c": pack_f24_beside(computed.reshape(-1), recorded.reshape(-1)),
                           "e": pack_f24(row_errors(computed, recorded.reshape(-1, k)).reshape(-1))}
    if c.get("aux"):
        out["aux"] = {name: pack_f32(v) for name, v in c["aux"].items()}
    if c.get("dot"):
        d = c["dot"]
        out["dot"] = {"i": d["i"], "k": len(d["j"]), "n": d["n"], "xg": d["xg"], "wg": d["wg"]} | {
            name: pack_f24(d[name]) for name in ("x", "w", "p", "rest", "b") if d.get(name) is not None}
    return out


def step_logits(steps: list[dict], tensors: list[dict], points: list[dict]) -> dict:
    """{step: logits} for the what-if sampler: "all" where the trace dumped every logit of that step's last position
    (the LM head's point, s9, with values), else the step event's 1,000 largest and its tail histogram."""
    head = {p["name"] for p in points if p["step"] == "s9"}
    dumped = {}
    for ev in tensors:
        if ev["name"] in head and "values" in ev:
            v = np.asarray(ev["values"], dtype=np.float64)
            dumped[ev.get("step", 0)] = v.reshape(-1, v.shape[-1])[-1] if v.ndim else v
    out = {}
    for e in steps:
        s = e["step"]
        if s in dumped:
            z = dumped[s]
            order = np.argsort(-z, kind="stable")
            out[str(s)] = {"all": True, "vocab": int(z.size), "ids": pack_ids(order.tolist(), int(z.size)),
                           "values": pack_f32(z[order].tolist()), "n": int(z.size), "tail": None}
        elif e.get("logits"):
            lg = e["logits"]
            out[str(s)] = {"all": lg["tail"] is None, "vocab": lg["vocab"], "ids": pack_ids(lg["ids"], lg["vocab"]),
                           "values": pack_f32(lg["values"]), "n": len(lg["ids"]), "tail": lg["tail"]}
    return out
