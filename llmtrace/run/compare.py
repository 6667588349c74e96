"""Comparing two runs of one prompt: where they part, the error each layer adds, and how far the answers drift.

    compare(a, b, prompt) -> CompareResult      .to_json() .save(path) .report(path) .summary_line()

Two models (or one model under two settings, `Side`) read the same token ids. They run side by side, layer by layer:
each layer of A, then the same layer of B, then B's layer once more on A's input to that layer. Only one layer's
activations of each side are held at a time, never two full traces, so two models fit where one fits twice.

Every metric is computed in float64 from the two sides' tensors, at every point (the `tap` names of the forward pass,
in the order the maths runs) and at every position:

    relative error  ||a - b||_2 / ||a||_2   (||a - b||_2 where ||a||_2 is 0)
    max |a - b|
    cosine similarity   a.b / (||a|| ||b||)  (1 where both are 0)

A point's `rel_err` is taken over all compared positions at once; `max_rel_err` is its largest error at one position,
and `position` names that position. The first divergence is the first point, in forward order, whose error at some
position exceeds the tolerance. The error a layer *adds* is that of B's layer run on A's input against A's layer: zero
for a layer whose weights and maths are the same on both sides, whatever came before it.

Decode steps (`max_new_tokens`). A's greedy tokens are generated first (A alone, with a KV cache), then both sides
read the prompt followed by those tokens in one pass. Attention is causal, so the activations at position p depend
only on the tokens at positions <= p: one pass over prompt + N tokens computes what the prefill and N decode steps
compute, position by position, and both sides are fed the same tokens, so positions line up (teacher forcing). The
one pass is what lets the sides run layer by layer; the decode steps' own kernels (one query row at a time) differ from
it only in the order of floating-point sums, the same on both sides. The tokens are A's argmax at each step, past an
end-of-sequence token too: the comparison is of the maths, not of the text.

The answers, per position: KL(P_A || P_B) over the whole vocabulary (softmax at temperature 1 of each side's float32
logits), whether the top-1 tokens agree, and dp = P_B(A's top token) - P_A(A's top token). Summaries: mean and max
KLD, the share of positions whose top-1 agrees (llama.cpp's "same top") and the mean |dp|.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional, Union

from llmtrace.errors import BadValue, FieldError, LlmtraceError, UsageError
from llmtrace.model.llama_points import EMBED
from llmtrace.model.moe_points import EXPERT_WEIGHTS, ROUTER_PROBS, chosen_experts
from llmtrace.trace.comparison import COMPARE_SCHEMA, jsonl_events, model_points_around
from llmtrace.units import plural

DEFAULT_TOLERANCE = 1e-4
DIGITS = 4  # significant digits of every float written



def compared_points(points) -> frozenset:
    """The points compared, from the model's declaration (model.points.Points): those a trace records whose values
    are an activation (not kv_write's slots, nor k_repeated, which is k_rope laid out for the query heads: its error
    is k_rope's)."""
    return frozenset(points.names(traced=True, stored=True))


def position_axis(points, name: str) -> int:
    """Which axis of a point's tensor, batch axis included, is the (query) position: the declared T axis (the
    scores' (B, H, T, S) have it third); 1 for a point that does not say."""
    p = points.get(name)
    return p.axes.index("T") + 1 if p is not None and "T" in p.axes else 1


def round_sig(x: Optional[float]) -> Optional[float]:
    if x is None or math.isinf(x) or math.isnan(x):
        return None
    return float(f"%.{DIGITS}g" % x)


# ----------------------------------------------------------------------------------------------------------------
# the two sides


@dataclass
class Side:
    """How one side of a comparison is loaded and run. Side B starts as a copy of side A with the options given for B
    replaced (`A.with_changes(...)`); a new way of running a model is a new field here."""

    model: Optional[str] = None  # a spec as -m takes it; None: the default model
    dtype: Optional[str] = None
    device: Optional[str] = None
    keep_quantized: bool = False
    fast: bool = False  # a GGUF on int4 kernels with bfloat16 activations (--fast)
    interventions: tuple = ()  # run/interventions.py objects applied to this side's passes (side B only)
    loaded: Any = None  # a model already loaded (LoadedModel), run as it is: one model under two settings, read once

    def with_changes(self, **changes: Any) -> "Side":
        """This side with the fields that `changes` gives (not None) replaced."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise TypeError(f"Side has no field {sorted(unknown)[0]!r}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def load(self):
        if self.loaded is not None:
            return self.loaded
        from llmtrace.checkpoint.load import load_model

        return load_model(self.model, device=self.device, dtype=self.dtype, keep_quantized=self.keep_quantized,
                          fast=self.fast)

    def check(self) -> None:
        """The options' values, before anything is loaded."""
        if self.loaded is not None:
            return
        from llmtrace.checkpoint.devices import pick_device, pick_dtype

        pick_dtype(self.dtype, pick_device(self.device))


def side_record(lm, side: Optional[Side]) -> dict:
    """What the output says about one side: the model, its shape, where and how it ran."""
    from llmtrace.run.interventions import record
    from llmtrace.trace.records import dtype_name

    c = lm.config
    return {"model": lm.name, "source": lm.source, "arch": c.arch, "dtype": dtype_name(lm.dtype),
            "device": str(lm.device),
            "keep_quantized": bool(side.keep_quantized) if side and side.loaded is None else _is_quantized(lm),
            "n_layers": c.n_layers, "d_model": c.d_model, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
            "vocab_size": c.vocab_size} | ({"exact": False} if side is not None and side.fast else {}) | (
                {"interventions": [record(iv) for iv in side.interventions]} if side is not None and side.interventions
                else {})


def _is_quantized(lm) -> bool:
    from llmtrace.model.quant import QuantLinear

    return any(isinstance(m, QuantLinear) for m in lm.model.modules())


def check_comparable(ca, cb) -> None:
    """Refuse two configs whose tensors cannot be compared point by point, naming the first mismatch."""
    for what, key in (("layers", "n_layers"), ("width (d_model)", "d_model"), ("query heads", "n_heads"),
                      ("key/value heads", "n_kv_heads"), ("head width", "head_dim"), ("FFN width", "ffn_dim"),
                      ("vocabulary", "vocab_size"), ("experts", "n_experts"), ("experts per token", "n_experts_used")):
        va, vb = getattr(ca, key), getattr(cb, key)
        if va != vb:
            raise LlmtraceError(f"the models cannot be compared point by point: their {what} differ (A {va}, B {vb})")


def read_config(spec: Optional[str]):
    """A model's config from its metadata alone (config.json, or a GGUF file's header): no weight is read."""
    from llmtrace.registry.resolve import resolve

    resolved = resolve(spec)
    if resolved.kind == "gguf":
        from llmtrace.checkpoint.gguf_checkpoint import config_from_gguf
        from llmtrace.checkpoint.gguf_file import open_gguf

        return config_from_gguf(open_gguf(resolved.path), str(resolved.path))
    from llmtrace.checkpoint.hf_checkpoint import config_from_hf

    path = resolved.path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LlmtraceError(f"{path}: cannot read the model's config ({type(e).__name__}: {e})") from None
    return config_from_hf(raw, str(resolved.path))


def check_ids(tok_a, tok_b, ids_a: list[int], ids_b: list[int], ids_from: Optional[str]) -> list[int]:
    """The ids both sides read: the prompt's ids when both tokenizers agree, A's with ids_from="a", else an error."""
    if ids_from not in (None, "a"):
        raise BadValue("ids_from", f" takes a (A's ids for both sides), not {ids_from!r}")
    if ids_a == ids_b or ids_from == "a":
        return ids_a
    i = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
    what = (f"at position {i} A has {_id_text(tok_a, ids_a, i)} and B {_id_text(tok_b, ids_b, i)}"
            if i < min(len(ids_a), len(ids_b)) else f"A gives {plural(len(ids_a), 'token')} and B {len(ids_b)}")
    raise FieldError("ids_from", " a feeds A's ids to both sides", before=f"the two tokenizers give different ids for "
                     f"the prompt ({what}); ")


def _id_text(tok, ids: list[int], i: int) -> str:
    return f"id {ids[i]} {tok.piece(ids[i])!r}"


# ----------------------------------------------------------------------------------------------------------------
# metrics


def as_rows(x, axis: int):
    """A point's tensor as float64 rows, one per position (the tensor's `axis`): (P, N). MPS has no float64, so there
    the rows are made on the CPU."""
    import torch

    dev = x.device if x.device.type != "mps" else torch.device("cpu")
    x = x.detach().movedim(axis, 0)
    return x.reshape(x.size(0), -1).to(dev, torch.float64)


def _rows(x, axis: int):
    """A point's tensor as one row per position, in its own dtype and device: (P, N)."""
    x = x.detach().movedim(axis, 0)
    return x.reshape(x.size(0), -1)


def position_sums(a, b, masked: bool = False):
    """Per position, from two (..., P, N) float64 row matrices: sum of (a-b)^2, of a^2, of b^2, of a*b, and max
    |a-b| over the last dimension, as one (5, ..., P) tensor. `masked`: entries that are -inf on both sides (masked
    attention scores) count as equal."""
    import torch

    if masked:
        both = torch.isneginf(a) & torch.isneginf(b)
        if both.any():
            a, b = a.masked_fill(both, 0.0), b.masked_fill(both, 0.0)
    d = a - b
    vecdot = torch.linalg.vecdot
    d2, a2, b2 = vecdot(d, d), vecdot(a, a), vecdot(b, b)
    max_abs = torch.linalg.vector_norm(d, ord=math.inf, dim=-1) if d.size(-1) else d.new_zeros(d.shape[:-1])
    # a.b from the three sums (one pass fewer): in float64 its rounding is ~1e-16 of |a|^2 + |b|^2, far below any
    # cosine worth showing
    return torch.stack([d2, a2, b2, (a2 + b2 - d2) / 2, max_abs])


def _rel(d2: float, a2: float) -> float:
    return math.sqrt(d2) / math.sqrt(a2) if a2 > 0 else math.sqrt(d2)


def _cos(dot: float, a2: float, b2: float) -> float:
    if a2 == 0 and b2 == 0:
        return 1.0
    if a2 == 0 or b2 == 0:
        return 0.0
    return dot / math.sqrt(a2 * b2)


@dataclass
class PointSums:
    """The per-position sums of one point, possibly gathered over several passes (diff: one per step)."""

    d2: list[float] = field(default_factory=list)
    a2: list[float] = field(default_factory=list)
    b2: list[float] = field(default_factory=list)
    dot: list[float] = field(default_factory=list)
    max_abs: list[float] = field(default_factory=list)

    def add(self, a, b, axis: int) -> "PointSums":
        """Add the positions of tensors a and b (any dtype and device; `axis` is the position axis)."""
        return self.add_rows(as_rows(a, axis), as_rows(b, axis), masked=a.dtype.is_floating_point)

    def add_rows(self, a, b, masked: bool = False) -> "PointSums":
        for mine, got in zip((self.d2, self.a2, self.b2, self.dot, self.max_abs), position_sums(a, b, masked).tolist()):
            mine.extend(got)
        return self

    def extend_sums(self, sums: list) -> "PointSums":
        """Add positions from five lists: (a-b)^2, a^2, b^2, a.b sums and max |a-b|."""
        for mine, got in zip((self.d2, self.a2, self.b2, self.dot, self.max_abs), sums):
            mine.extend(got)
        return self

    def extend(self, other: "PointSums") -> "PointSums":
        for mine, got in zip((self.d2, self.a2, self.b2, self.dot, self.max_abs),
                             (other.d2, other.a2, other.b2, other.dot, other.max_abs)):
            mine.extend(got)
        return self

    def record(self, name: str, positions: Optional[list[int]] = None, added: Optional["PointSums"] = None,
               step: Optional[str] = None) -> dict:
        """The point's JSON record: whole-tensor figures, the worst position, and the per-position lists."""
        positions = positions if positions is not None else list(range(len(self.d2)))
        rel = [_rel(d, a) for d, a in zip(self.d2, self.a2)]
        cos = [_cos(x, a, b) for x, a, b in zip(self.dot, self.a2, self.b2)]
        worst = max(range(len(rel)), key=rel.__getitem__) if rel else None
        rec = {"point": name, "seed_step": step, "rel_err": round_sig(_rel(sum(self.d2), sum(self.a2))),
               "max_rel_err": round_sig(rel[worst]) if rel else None,
               "position": positions[worst] if worst is not None else None,
               "max_abs": round_sig(max(self.max_abs, default=0.0)), "cos_min": round_sig(min(cos, default=1.0)),
               "added_rel_err": None,
               "per_position": {"rel_err": [round_sig(x) for x in rel], "max_abs": [round_sig(x) for x in self.max_abs],
                                "cos": [round_sig(x) for x in cos]}}
        if added is not None:
            rec["added_rel_err"] = round_sig(_rel(sum(added.d2), sum(added.a2)))
            rec["per_position"]["added_rel_err"] = [round_sig(_rel(d, a)) for d, a in zip(added.d2, added.a2)]
        return rec


def find_first_divergence(model_points: dict, layers: list[dict], tolerance: float) -> tuple[Optional[dict], float]:
    """The first point in forward order (embed, each layer's points, final_norm, logits; a family's own model points
    where they run) whose error at some position
    exceeds `tolerance`, and the largest error of any point before it. The point as {"layer", "point", "seed_step",
    "position": the earliest position over the tolerance there, "position_rel_err": its error, "worst_position": the
    position of the largest error there, "rel_err": that largest error} (positions as indices into the compared
    positions), or None."""
    before, after = model_points_around(model_points)
    order = [(None, model_points[n]) for n in before]
    order += [(lay["layer"], p) for lay in layers for p in lay["points"]]
    order += [(None, model_points[n]) for n in after]
    before = 0.0
    for layer, p in order:
        worst = p["max_rel_err"]
        if worst is not None and worst > tolerance:
            per = (p.get("per_position") or {}).get("rel_err") or []
            earliest = next((i for i, x in enumerate(per) if x is not None and x > tolerance), p["position"])
            at = per[earliest] if earliest is not None and earliest < len(per) else worst
            return {"layer": layer, "point": p["point"], "seed_step": p["seed_step"], "position": earliest,
                    "position_rel_err": at, "worst_position": p["position"], "rel_err": worst}, before
        before = max(before, worst or 0.0)
    return None, before


def answer_metrics(logits_a, logits_b) -> dict:
    """Per position and in summary: KL(P_A || P_B), same top-1, dp, from (P, V) logits of each side. P_X is the
    softmax at temperature 1 of side X's logits taken as float32, computed in float64."""
    import torch

    la = torch.log_softmax(logits_a.detach().float().double().cpu(), dim=-1)  # (P, V)
    lb = torch.log_softmax(logits_b.detach().float().double().cpu(), dim=-1)
    pa = la.exp()
    kld = (pa * (la - lb)).nansum(-1)  # (P,); 0 * (-inf) terms of a zero probability count as 0
    top_a, top_b = la.argmax(-1), lb.argmax(-1)  # (P,)
    p_top_a = pa.gather(1, top_a[:, None])[:, 0]
    p_b_top_a = lb.gather(1, top_a[:, None])[:, 0].exp()
    return {"kld": kld.tolist(), "top_a": top_a.tolist(), "top_b": top_b.tolist(), "p_a": p_top_a.tolist(),
            "p_b": p_b_top_a.tolist(), "dp": (p_b_top_a - p_top_a).tolist()}


# ----------------------------------------------------------------------------------------------------------------
# the result


@dataclass
class CompareResult:
    """Everything one comparison found. `to_json()` is the output's one object (schema: trace.schema.json's
    "compare" definition)."""

    a: dict  # side_record of A and B
    b: dict
    prompt: Union[str, list[str]]  # the text the model read (a list for several prompts)
    ids: list  # every position's token: the prompt, then A's greedy tokens (a list per prompt for several)
    n_prompt: Union[int, list[int]]  # the prompt's tokens (of each prompt)
    tolerance: float
    layers: list[dict]
    model_points: dict  # embed, final_norm, logits: point records
    positions: list[dict]
    first_divergence: Optional[dict]
    max_rel_err_before: float  # the largest error of any point before the first divergence (or anywhere, if none)
    kld_mean: float
    kld_max: float
    same_top: float
    dp_mean_abs: float
    source: str = "compare"  # "compare" (two models run here) or "diff" (two saved traces)
    notes: list[str] = field(default_factory=list)
    diff: Optional[dict] = None  # diff: what the traces hold besides tensors (tokens, top-k, ledger, statistics)
    routing: Optional[dict] = None  # a mixture of experts: where B's routers chose other experts (RoutingFlips)

    def to_json(self) -> dict:
        return {"schema": COMPARE_SCHEMA, "source": self.source, "a": self.a, "b": self.b, "prompt": self.prompt,
                "ids": self.ids, "n_prompt": self.n_prompt, "tolerance": self.tolerance,
                "first_divergence": self.first_divergence, "max_rel_err_before": round_sig(self.max_rel_err_before),
                "kld_mean": round_sig(self.kld_mean), "kld_max": round_sig(self.kld_max), "same_top": round_sig(self.same_top),
                "dp_mean_abs": round_sig(self.dp_mean_abs), "positions": self.positions, "layers": self.layers,
                "model_points": self.model_points, "notes": self.notes} | (
                    {"diff": {k: v for k, v in self.diff.items() if not k.startswith("_")}} if self.diff else {}) | (
                    {"routing": self.routing} if self.routing is not None else {})

    def to_jsonl_events(self) -> list[dict]:
        return jsonl_events(self.to_json())

    def save(self, path: Union[str, Path]) -> None:
        """The JSON object to `path`, written whole or not at all."""
        from llmtrace.fsutil import write_text_atomic

        write_text_atomic(Path(path), json.dumps(self.to_json(), indent=1) + "\n")

    def summary_line(self) -> str:
        """The answer in one line: where the runs part, or that they do not."""
        return summary_line(self.to_json())

    @property
    def different_top(self) -> list[dict]:
        return [p for p in self.positions if not p["same_top"]]


def summary_line(doc: dict) -> str:
    """The answer in one line: where the runs part, or that they do not."""
    fd = doc["first_divergence"]
    tol = f"{doc['tolerance']:g}"
    before = doc.get("max_rel_err_before") or 0.0
    if fd is None:
        worst = "identical" if before == 0 else f"largest rel. error {before:.1e}"
        return f"runs agree within {tol} at every point and position ({worst})" + routing_clause(doc.get("routing"))
    where = f"layer {fd['layer']}, " if fd["layer"] is not None else ""
    step = f" ({fd['seed_step']})" if fd.get("seed_step") else ""
    norms = fd.get("basis") == "norm"
    if fd["layer"] is None and fd["point"] == EMBED.name:
        rest = "the first point"
    elif before == 0:
        rest = "every norm before it the same" if norms else "everything before it identical"
    else:
        rest = (f"every norm before it within the tolerance (largest difference {_sci(before)})" if norms else
                f"everything before it within the tolerance (largest rel. error {_sci(before)})")
    basis = " (from the norms)" if norms else ""
    return f"runs part at {where}{fd['point']}{step}, {divergence_place(fd)}: rel. error{basis} " \
           f"{_sci(fd['rel_err'])}; {rest}" + routing_clause(doc.get("routing"))


def routing_clause(routing: Optional[dict]) -> str:
    """A mixture of experts: '; routing first flips at layer 1, position 5: {2,5} → {2,6} (3 of 28 choices)'."""
    if not routing:
        return ""
    first = routing.get("first")
    if first is None:
        return f"; every router chose the same experts ({routing['compared']:,} choices)"
    sets = lambda e: "{" + ",".join(map(str, e)) + "}"  # noqa: E731
    return (f"; routing first flips at layer {first['layer']}, {_place(first.get('prompt'), first['position'])}: "
            f"{sets(first['a'])} → {sets(first['b'])} ({routing['flips']:,} of {routing['compared']:,} choices)")


def divergence_place(fd: dict) -> str:
    """Where the first divergence is: "position 2", or "from position 0; largest at 2" when the earliest position
    over the tolerance is not the one of the largest error ("prompt 1, position 0" with several prompts); "step 3"
    for a point compared by its norm alone. A file written before `worst_position` existed names the largest."""
    if fd.get("position") is None:
        return f"step {fd.get('step', 0)}"
    first = _place(fd.get("prompt"), fd["position"])
    if fd.get("worst_position") is None or (fd.get("worst_prompt"), fd["worst_position"]) == (
            fd.get("prompt"), fd["position"]):
        return first
    worst = (str(fd["worst_position"]) if fd.get("worst_prompt") == fd.get("prompt")
             else _place(fd.get("worst_prompt"), fd["worst_position"]))
    return f"from {first}; largest at {worst}"


def _place(prompt: Optional[int], position: int) -> str:
    return f"position {position}" if prompt is None else f"prompt {prompt}, position {position}"


def _sci(x: float) -> str:
    """3.1e-3, not 3.1e-03."""
    m, _, ex = f"{x:.1e}".partition("e")
    return f"{m}e{int(ex)}"


def position_records(tok_a, tok_b, ids: list[int], n_prompt: int, m: dict) -> list[dict]:
    out = []
    for i, t in enumerate(ids):
        ta, tb = m["top_a"][i], m["top_b"][i]
        out.append({"position": i, "phase": "prompt" if i < n_prompt else "decode", "token": t,
                    "text": tok_a.decode([t]), "kld": round_sig(max(m["kld"][i], 0.0)), "same_top": ta == tb,
                    "top_a": {"id": ta, "text": tok_a.decode([ta])}, "top_b": {"id": tb, "text": tok_b.decode([tb])},
                    "p_a": round_sig(m["p_a"][i]), "p_b": round_sig(m["p_b"][i]), "dp": round_sig(m["dp"][i])})
    return out


def summarize_answers(m: dict) -> dict:
    n = len(m["kld"]) or 1
    return {"kld_mean": sum(max(k, 0.0) for k in m["kld"]) / n, "kld_max": max((max(k, 0.0) for k in m["kld"]), default=0.0),
            "same_top": sum(a == b for a, b in zip(m["top_a"], m["top_b"])) / n,
            "dp_mean_abs": sum(abs(d) for d in m["dp"]) / n}


class RoutingFlips:
    """Where B's router chose other experts than A's (a mixture of experts): each MoE layer's choice at each position
    compared as a set of K experts. `offset` numbers the positions across prompts (the position records' index)."""

    def __init__(self, k: int):
        self.k, self.offset = k, 0
        self.compared, self.per_layer, self.first = 0, {}, None

    def add(self, layer: int, points_a: dict, points_b: dict) -> None:
        pa, pb = points_a.get(ROUTER_PROBS.name), points_b.get(ROUTER_PROBS.name)
        if pa is None or pb is None:
            return  # a dense layer
        wa, wb = points_a.get(EXPERT_WEIGHTS.name), points_b.get(EXPERT_WEIGHTS.name)
        chosen = [(p[0].topk(self.k, dim=-1).indices if w is None else chosen_experts(p[0], w[0], self.k))
                  .sort(dim=-1).values.tolist() for p, w in ((pa, wa), (pb, wb))]  # (T, K) each: the experts that ran
        flips = [(i, a, b) for i, (a, b) in enumerate(zip(*chosen)) if a != b]
        self.compared += len(chosen[0])
        self.per_layer[layer] = self.per_layer.get(layer, 0) + len(flips)
        if flips and (self.first is None or layer < self.first["layer"]):
            i, a, b = flips[0]
            self.first = {"layer": layer, "position": self.offset + i, "a": a, "b": b}

    def record(self, positions: list[dict]) -> dict:
        """The compare document's `routing`: the first flip (its position as the position records name it), how many
        choices flipped of how many, and per layer."""
        first = None
        if self.first is not None:
            first = dict(self.first) | {"position": positions[self.first["position"]]["position"]}
            if "prompt" in positions[self.first["position"]]:
                first["prompt"] = positions[self.first["position"]]["prompt"]
        return {"first": first, "flips": sum(self.per_layer.values()), "compared": self.compared,
                "layers": [{"layer": layer, "flips": n} for layer, n in sorted(self.per_layer.items())]}


# ----------------------------------------------------------------------------------------------------------------
# running two models side by side


ModelLike = Union[str, Side, Any]  # a spec, a Side, or a loaded model (llmtrace.loaded.LoadedModel)


def _as_side(x: ModelLike) -> tuple[Optional[Side], Any]:
    """(Side, None) for a spec or a Side; (None, the model) for a model already loaded; (Side, its model) for a Side
    that holds one."""
    if x is None or isinstance(x, str):
        return Side(model=x), None
    if isinstance(x, Side):
        return x, x.loaded
    return None, x


def compare(a: ModelLike, b: ModelLike, prompt: Union[str, list[str]], *, max_new_tokens: int = 0, chat: bool = False,
            system: Optional[str] = None, tolerance: float = DEFAULT_TOLERANCE, ids_from: Optional[str] = None,
            progress: Optional[Callable[[str], None]] = None) -> CompareResult:
    """Run `prompt` through A and B side by side and compare them at every point, layer and position.

    `a`, `b`: a model spec (as -m takes it), a `Side` (a spec and how to run it) or a loaded model. With a spec or a
    Side, the tokenizers are checked before any weight is read. `prompt`: one text, or a list of texts compared one
    after the other and summarized together (each position record names its prompt). `max_new_tokens`: besides the
    prompt, compare this many decode steps, both sides fed A's greedy tokens. `ids_from="a"`: feed A's ids to both
    sides even when B's tokenizer reads the prompt differently. `progress(message)` hears what is happening."""
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    side_a, lm_a = _as_side(a)
    side_b, lm_b = _as_side(b)
    ivs_b = list(side_b.interventions) if side_b is not None else []
    _check_arguments(side_a, side_b, ivs_b, max_new_tokens, tolerance, ids_from)
    say = progress or (lambda _msg: None)
    # the prompts' ids, from the tokenizers alone when the models are not loaded yet
    from llmtrace.checkpoint.tokenizer_only import load_tokenizer

    tok_a = lm_a.tokenizer if lm_a is not None else load_tokenizer(side_a.model)
    tok_b = lm_b.tokenizer if lm_b is not None else load_tokenizer(side_b.model)
    prompts, all_ids, notes = _encode_prompts(tok_a, tok_b, texts, chat, system, ids_from)
    lm_a, lm_b = _load_sides((side_a, lm_a), (side_b, lm_b), ivs_b, all_ids, max_new_tokens, say)

    import torch

    flips = RoutingFlips(lm_a.config.n_experts_used) if lm_a.config.n_experts else None
    with torch.inference_mode():
        acc, positions, answers, seqs = _run_prompts((lm_a, tok_a), (lm_b, tok_b), all_ids, max_new_tokens, ivs_b,
                                                     say, several=len(texts) > 1, flips=flips)
    layers, model_points = build_records(acc, lm_a.config.n_layers, lm_a.points)
    first, before = find_first_divergence(model_points, layers, tolerance)
    return CompareResult(a=side_record(lm_a, side_a), b=side_record(lm_b, side_b),
                         prompt=prompts[0] if len(prompts) == 1 else prompts, ids=seqs[0] if len(seqs) == 1 else seqs,
                         n_prompt=len(all_ids[0]) if len(all_ids) == 1 else [len(i) for i in all_ids],
                         tolerance=tolerance, layers=layers, model_points=model_points, positions=positions,
                         first_divergence=label_divergence(first, positions), max_rel_err_before=before,
                         **summarize_answers(answers), notes=notes,
                         routing=flips.record(positions) if flips is not None else None)


def _check_arguments(side_a: Optional[Side], side_b: Optional[Side], ivs_b: list, max_new_tokens: int,
                     tolerance: float, ids_from: Optional[str]) -> None:
    """Every value that needs no model, before anything is read."""
    if not tolerance > 0:
        raise BadValue("tolerance", f" must be > 0, not {tolerance}")
    if max_new_tokens < 0:
        raise BadValue("max_new_tokens", " must be ≥ 0")
    if ids_from not in (None, "a"):
        raise BadValue("ids_from", f" takes a (A's ids for both sides), not {ids_from!r}")
    if side_a is not None and side_a.interventions:
        raise UsageError("compare applies interventions to side B only: side A is the reference the intervention is "
                         "measured against")
    if max_new_tokens and any(getattr(iv, "mean", False) for iv in ivs_b):
        raise UsageError("a mean ablation takes its mean over the prompt's pass; compare reads the prompt and A's "
                         "tokens in one pass, so compare it over the prompt only (-n 0)")
    for side in (side_a, side_b):
        if side is not None:
            side.check()


def _encode_prompts(tok_a, tok_b, texts: list[str], chat: bool, system: Optional[str], ids_from: Optional[str]
                    ) -> tuple[list[str], list[list[int]], list[str]]:
    """Each prompt as A's text and the ids both sides read; a note when B's tokenizer reads them differently."""
    prompts, all_ids, notes = [], [], []
    for k, text in enumerate(texts):
        text_a, ids_a = tok_a.encode_prompt(text, chat=chat, system=system)
        _, ids_b = tok_b.encode_prompt(text, chat=chat, system=system)
        ids = check_ids(tok_a, tok_b, ids_a, ids_b, ids_from)
        if not ids:
            raise UsageError(f"prompt {k + 1} has no tokens; give some text" if len(texts) > 1
                             else "the prompt has no tokens; give some text")
        if ids_a != ids_b and not notes:
            notes.append("B's tokenizer reads the prompt differently; both sides were fed A's ids (`ids_from='a'`)")
        prompts.append(text_a)
        all_ids.append(ids)
    return prompts, all_ids, notes


def _load_sides(a: tuple, b: tuple, ivs_b: list, all_ids: list[list[int]], max_new_tokens: int, say) -> tuple:
    """Both models loaded, (Side, loaded model or None) each: their shapes and B's interventions checked from the
    metadata before any weight is read, then the ids against B's vocabulary and both context windows."""
    (side_a, lm_a), (side_b, lm_b) = a, b
    config_b = lm_b.config if lm_b is not None else read_config(side_b.model)
    check_comparable(lm_a.config if lm_a is not None else read_config(side_a.model), config_b)  # before any weight
    if ivs_b:  # B's interventions against B's shape and the prompts, before any weight is read
        from llmtrace.run.interventions import check

        check(ivs_b, config_b, [len(ids) for ids in all_ids])
    if lm_a is None:
        say(f"loading A: {side_a.model or 'the default model'}")
        lm_a = side_a.load()
    if lm_b is None:
        say(f"loading B: {side_b.model or 'the default model'}")
        lm_b = side_b.load()
    check_comparable(lm_a.config, lm_b.config)
    top_id = max(max(ids) for ids in all_ids)
    if top_id >= lm_b.config.vocab_size:
        raise LlmtraceError(f"A's id {top_id} is outside B's vocabulary of {lm_b.config.vocab_size}")
    limit = min(lm_a.config.max_seq_len, lm_b.config.max_seq_len)
    longest = max(len(ids) for ids in all_ids)
    if longest + max_new_tokens > limit:
        raise BadValue("max_new_tokens", f" {max_new_tokens} exceed the context window of {plural(limit, 'token')}",
                       before=f"the prompt's {plural(longest, 'token')} + ")
    return lm_a, lm_b


def _run_prompts(a: tuple, b: tuple, all_ids: list[list[int]], max_new_tokens: int, ivs_b: list, say, several: bool,
                 flips: Optional[RoutingFlips] = None) -> tuple[dict, list[dict], dict, list[list[int]]]:
    """Each prompt (and A's greedy tokens after it) through both sides, (loaded model, tokenizer) each: the
    accumulated point sums, the position records (numbered across prompts), the answers' per-position lists and each
    prompt's sequence. `flips` hears each MoE layer's routing on both sides."""
    (lm_a, tok_a), (lm_b, tok_b) = a, b
    acc: dict = {}
    positions: list[dict] = []
    answers: dict = {}
    seqs = []
    for k, ids in enumerate(all_ids):
        generated = greedy_tokens(lm_a.model, ids, max_new_tokens, lm_a.device) if max_new_tokens else []
        seq = ids + generated
        seqs.append(seq)
        edits_b = None
        if ivs_b:  # B's interventions, their positions counted in the prompt (the pass also reads A's tokens)
            from llmtrace.run.interventions import Patch, prepare

            ivs = [replace(iv, position=iv.position + len(ids)) if isinstance(iv, Patch) and iv.position < 0
                   else iv for iv in ivs_b]
            edits_b = prepare(lm_b, ivs, [len(ids)])
        if flips is not None:
            flips.offset = len(positions)
        logits_a, logits_b = run_side_by_side(lm_a, lm_b, seq, acc, say, edits_b=edits_b, flips=flips)
        m = answer_metrics(logits_a, logits_b)
        del logits_a, logits_b
        for key, v in m.items():
            answers.setdefault(key, []).extend(v)
        for r in position_records(tok_a, tok_b, seq, len(ids), m):
            r["index"] = len(positions)
            if several:
                r["prompt"] = k
            positions.append(r)
    return acc, positions, answers, seqs


def label_divergence(first: Optional[dict], positions: list[dict]) -> Optional[dict]:
    """The first divergence with its positions, indices into `positions` until now, as each position names itself:
    its place in its sequence, and its prompt (`prompt`, `worst_prompt`) when several prompts were compared."""
    if first is None:
        return None
    out = dict(first)
    for key, prompt_key in (("position", "prompt"), ("worst_position", "worst_prompt")):
        i = first.get(key)
        if i is None:
            continue
        out[key] = positions[i]["position"]
        if "prompt" in positions[i]:
            out[prompt_key] = positions[i]["prompt"]
    return out


def greedy_tokens(model, ids: list[int], n: int, device) -> list[int]:
    """A's greedy continuation of `ids`: n tokens, each the argmax of the last position's logits (KV cache)."""
    import torch

    cache = model.new_cache(len(ids) + n)
    logits = model(torch.tensor([ids], device=device), cache, 0, last_only=True)  # (1, V)
    out: list[int] = []
    for k in range(n):
        out.append(int(logits[0].argmax()))
        if k + 1 < n:
            logits = model(torch.tensor([[out[-1]]], device=device), cache, len(ids) + k, last_only=True)
    return out


def run_side_by_side(lm_a, lm_b, ids: list[int], acc: dict, say=lambda _m: None, edits_b=None,
                     flips: Optional[RoutingFlips] = None):
    """Run both loaded models over `ids` layer by layer, and B's layer once more on A's input, adding each point's
    per-position sums to `acc` ({(layer, point): (A against B, A against B on A's input)}, in forward order).
    `edits_b` (run.interventions.prepare): B's interventions, applied to each of B's passes as to a prompt's pass.
    `flips` hears each layer's routing on both sides. Returns A's and B's logits, (P, V) each."""
    import contextlib

    import torch

    from llmtrace.model.capture import capture

    def edited():  # B's interventions, hooked around each of B's calls alone: A may be the same model (one loaded
        if edits_b is None:  # model under two settings), whose passes must stay as they are
            return contextlib.nullcontext()
        return lm_b.model.hooked(edits_b, edits_b.layers, spell_out=edits_b.spell_out)

    if edits_b is not None:
        edits_b.begin_pass(prompt=True, pads=[0])
    model_a, model_b, device_b, dtype_b = lm_a.model, lm_b.model, lm_b.device, lm_b.dtype
    points = lm_a.points
    wanted = compared_points(points)
    idx_a = torch.tensor([ids], device=lm_a.device)  # (1, P)
    idx_b = torch.tensor([ids], device=device_b)

    def run(model, fn, layer: Optional[int], b: bool = False):
        """fn's result and the compared points it reported ({name: tensor}), with `layer`'s attention spelled out;
        `b`: a call of side B, under B's interventions."""
        lay = [] if layer is None else [layer]
        with edited() if b else contextlib.nullcontext(), \
                capture(model, lambda _layer, name: name in wanted, layers=lay, spell_out=True, clone=False) as kept:
            out = fn()
        return out, {name: x for (_, name), x in kept.items()}

    def add(layer, points_a: dict, points_b: dict, points_z: dict):
        add_point_sums(acc, points, layer, points_a, points_b, points_z)

    # s4: the embeddings (nothing feeds them, so the error B adds is its whole error)
    xa, pa = run(model_a, lambda: model_a.embed_tokens(idx_a), None)
    xb, pb = run(model_b, lambda: model_b.embed_tokens(idx_b), None, b=True)
    add(None, pa, pb, pb)
    inputs_a = model_a.layer_inputs(idx_a, dtype=xa.dtype)
    inputs_b = model_b.layer_inputs(idx_b, dtype=xb.dtype)
    n_layers = lm_a.config.n_layers
    for i in range(n_layers):
        if i % 10 == 0:
            say(f"layer {i}/{n_layers}")
        ya, pa = run(model_a, lambda: model_a.run_layers(xa, inputs_a, [i]), i)
        yb, pb = run(model_b, lambda: model_b.run_layers(xb, inputs_b, [i]), i, b=True)
        x_in = xa.to(device_b, dtype_b)
        if torch.equal(x_in, xb):  # B's input is A's: B's layer on it is the run just made (saves a third pass)
            pz = pb
        else:
            _, pz = run(model_b, lambda: model_b.run_layers(x_in, inputs_b, [i]), i, b=True)
        add(i, pa, pb, pz)
        if flips is not None:
            flips.add(i, pa, pb)
        del pa, pb, pz, x_in
        xa, xb = ya, yb
    # s8, s9: the final norm and the LM head; B's on A's input gives the error they add
    la, pa = run(model_a, lambda: model_a.head(xa), None)
    lb, pb = run(model_b, lambda: model_b.head(xb), None, b=True)
    x_in = xa.to(device_b, dtype_b)
    pz = pb if torch.equal(x_in, xb) else run(model_b, lambda: model_b.head(x_in), None, b=True)[1]
    add(None, pa, pb, pz)
    return la[0], lb[0]


def add_point_sums(acc: dict, points, layer: Optional[int], points_a: dict, points_b: dict, points_z: dict) -> None:
    """Each point of A against B, and against B on A's input (`points_z` is `points_b` itself when B's input was A's,
    bit for bit), added to `acc` (run_side_by_side). Points whose rows have one width are stacked and reduced
    together: a few reductions per layer rather than a few per point."""
    import torch

    groups: dict[tuple, list] = {}
    for name, ta in points_a.items():  # forward order
        if name not in points_b:
            continue
        axis = position_axis(points, name)
        acc.setdefault((layer, name), (PointSums(), PointSums()))
        ra, rb = _rows(ta, axis), _rows(points_b[name], axis)
        rz = rb if points_z is points_b else _rows(points_z[name], axis)
        groups.setdefault((ra.shape, rb.shape, rz.shape), []).append((name, ra, rb, rz))
    for items in groups.values():
        dev = items[0][1].device if items[0][1].device.type != "mps" else torch.device("cpu")  # MPS: no float64
        # (G, P, N) float64 on A's device (B's tensors cross over when B runs elsewhere)
        stack = lambda k: torch.stack([it[k] for it in items]).to(dev, torch.float64)  # noqa: E731
        a64 = stack(1)
        same = position_sums(a64, stack(2), masked=True).tolist()  # (5, G, P); masked scores are -inf on both
        added = same if points_z is points_b else position_sums(a64, stack(3), masked=True).tolist()
        for g, (name, *_) in enumerate(items):
            s_acc, a_acc = acc[(layer, name)]
            s_acc.extend_sums([row[g] for row in same])
            a_acc.extend_sums([row[g] for row in added])


def build_records(acc: dict, n_layers: int, points) -> tuple[list[dict], dict]:
    """The layer records and the model-level point records from the accumulated sums; each layer's summary is its
    output's (the last residual-stream point the model declares)."""
    from llmtrace.run.interventions import layer_output

    output = layer_output(points)
    layers = [{"layer": i, "points": []} for i in range(n_layers)]
    model_points = {}
    for (layer, name), (same, added) in acc.items():
        rec = same.record(name, added=added, step=points.step_of(name))
        if layer is None:
            model_points[name] = rec
        else:
            layers[layer]["points"].append(rec)
    for lay in layers:
        pts = lay["points"]
        out = next((p for p in pts if p["point"] == output), None)
        lay["rel_err"] = out["rel_err"] if out else None
        lay["added_rel_err"] = out["added_rel_err"] if out else None
        lay["max_rel_err"] = max((p["max_rel_err"] or 0.0 for p in pts), default=None)
        lay["max_added_rel_err"] = max((p["added_rel_err"] or 0.0 for p in pts), default=None)
        lay["points"] = lay.pop("points")  # last, after the summary fields
    return layers, model_points
