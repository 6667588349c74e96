"""The points of a loaded model as a researcher's hook sees them: named `3.q_rope`, `embed`, `logits`.

A model declares its points once (model.points, Transformer.declared_points); this module lists those of a built
model in forward order with the name a hook is given (`PointInfo`), selects some by name, glob or predicate, and wraps
a researcher's function `fn(x, point)` into an edit of the one hook (`hook_op`): the function observes (returns None)
or, at an editable point, returns the tensor the pass goes on with. What it does wrong is said with the point's name
(`HookError`): a tensor returned where the point is not editable names the editable points next to it.

Axes are the declared ones with the batch axis B in front, as the tensor reaches a hook in a pass over every position
(run_with_cache, run_with_hooks): the points after the layers that the trace records for the last position only (the
logits) have a T axis there; a broadcast view (GQA's repeated keys) is handed over as the tensor it stands for; the
cache slots a pass writes are one list for every row (no B).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from llmtrace.errors import BadValue, LlmtraceError
from llmtrace.model.llama_points import (ACT, ATTN_NORM, ATTN_OUT, EMBED, FFN_NORM, FINAL_NORM, GATE, K, K_ROPE, LAST,
                                         PROBS, Q, Q_ROPE, RESID_MID, RESID_POST, RESID_PRE, SCORES, UP, V)
from llmtrace.model.points import Point

Names = Union[None, str, Sequence[str], Callable[[str], bool]]


class HookError(LlmtraceError):
    """A researcher's hook failed or returned what the point cannot take; `point` is the point's name ("3.attn_out").
    The hook's own exception, when it raised one, is the `__cause__`."""

    def __init__(self, message: str, point: str):
        super().__init__(message)
        self.point = point


@dataclass(frozen=True)
class PointInfo:
    """One point of a loaded model, as `model.points()` lists it and as a hook's second argument: `name` as a hook
    and a cache name it (`3.q_rope`; a model-level point has no layer: `embed`), `layer` (None outside the layers),
    `point` its declared name (`q_rope`), its seed `step`, its `axes` as the hook's tensor has them, whether it is
    `editable` (a hook may return a replacement), what it is (`about`), the part reporting it (`where`: model,
    block, attn, ffn) and its declared operation (`op`: the maths declaration's record, None where the model
    declares none)."""

    name: str
    layer: Optional[int]
    point: str
    step: str
    axes: tuple[str, ...]
    editable: bool
    about: str = ""
    where: str = "block"
    op: Any = None

    def record(self) -> dict:
        """The point as plain data (JSON-ready but for `op`, which is the declaration's own record)."""
        return {"name": self.name, "layer": self.layer, "point": self.point, "seed_step": self.step,
                "axes": list(self.axes), "editable": self.editable, "where": self.where, "about": self.about,
                "op": self.op}

    def __repr__(self) -> str:
        edit = ", editable" if self.editable else ""
        return f"PointInfo({self.name!r}, {self.step}, ({', '.join(self.axes)}){edit})"


def declared_op(maths, layer: Optional[int], point: str) -> Any:
    """The operation the model's maths declaration (model.maths.Maths, from `Transformer.maths()`) says makes `point`
    of `layer`: a model.maths.Op (its kind, operands, weights and this layer's constants), or None where none is
    declared. The one place this API reads that declaration."""
    return None if maths is None else maths.op(layer, point)


def hook_axes(p: Point, after_layers: bool) -> tuple[str, ...]:
    """The axes of point `p`'s tensor as a hook gets it in a pass over every position (see the module's docstring)."""
    if p.axes == ("T",):  # the cache slots a pass writes: one list for every row
        return p.axes
    if after_layers and "T" not in p.axes and p.name != LAST.name:  # recorded for the last position only
        return ("B", "T") + p.axes
    return ("B",) + p.axes


def point_table(model, layer_points: Callable[[int], Sequence[Point]]) -> list[PointInfo]:
    """Every point of the built `model` in forward order: the model's own before the layers, each layer's (as
    `layer_points(i)` reports them), the model's own after them."""
    declared = model.declared_points()
    maths = model.maths() if hasattr(model, "maths") else None  # worked out once for the whole table

    def info(p: Point, layer: Optional[int], after: bool = False) -> PointInfo:
        name = p.name if layer is None else f"{layer}.{p.name}"
        return PointInfo(name, layer, p.name, p.step, hook_axes(p, after), p.editable, p.about, p.where,
                         declared_op(maths, layer, p.name))

    out = [info(p, None) for p in declared.before]
    for i in range(model.config.n_layers):
        out += [info(p, i) for p in layer_points(i)]
    return out + [info(p, None, after=True) for p in declared.after]


def filter_points(table: list[PointInfo], layer: Optional[int] = None, step: Optional[str] = None,
                  n_layers: int = 0) -> list[PointInfo]:
    """The points of `layer` (negative: from the end) and of seed step `step` ("s6.3"; "s6" takes its sub-steps)."""
    if layer is not None:
        layer = check_layer("layer", layer, n_layers)
    out = []
    for p in table:
        steps = p.step.split("/")
        if layer is not None and p.layer != layer:
            continue
        if step is not None and not any(s == step or s.startswith(step + ".") for s in steps):
            continue
        out.append(p)
    return out


def check_layer(field: str, layer: int, n_layers: int) -> int:
    if not isinstance(layer, int) or not -n_layers <= layer < n_layers:
        raise BadValue(field, f" {layer!r} is out of range; this model has {n_layers} layers (0..{n_layers - 1}, or "
                              f"-1..-{n_layers} from the end)")
    return layer % n_layers


def canonical(name: str, n_layers: int, field: str = "names") -> str:
    """'-1.resid_post' -> '29.resid_post' (a layer counted from the end); other names as they are."""
    head, dot, rest = name.partition(".")
    if dot and head.lstrip("-").isdigit():
        return f"{check_layer(field, int(head), n_layers)}.{rest}"
    return name


def select(table: list[PointInfo], names: Names, layers: Optional[Sequence[int]], n_layers: int,
           field: str = "names") -> list[PointInfo]:
    """The points `names` picks (None: all; a name, a glob such as "*.resid_post", a list of them, or a predicate
    on the name) in the layers `layers` (None: all, the model's own points included), in forward order. A name that
    is not a point, or a glob that matches none, is an error naming the keyword."""
    by_name = {p.name: p for p in table}
    if names is None:
        picked = set(by_name)
    elif callable(names):  # asked of each point's name, and of its TransformerLens name where it has one
        picked = {p.name for p in table if names(p.name) or _asked(names, transformer_lens_name(p, table))}
    else:
        picked = set()
        for pattern in [names] if isinstance(names, str) else list(names):
            if not isinstance(pattern, str):
                raise BadValue(field, f" takes point names, globs or a predicate, not {pattern!r}")
            picked |= _matches(table, by_name, pattern, n_layers, field)
    if layers is not None:
        keep = {check_layer("layers", i, n_layers) for i in layers}
        picked = {n for n in picked if by_name[n].layer in keep}
    return [p for p in table if p.name in picked]


def _asked(predicate: Callable[[str], bool], name: Optional[str]) -> bool:
    return name is not None and bool(predicate(name))


def translated(name: str, table: list[PointInfo], field: str = "names") -> str:
    """`name` as llmtrace names it: a TransformerLens name translated (blocks.3.attn.hook_pattern -> 3.probs), any
    other name as it is. A TransformerLens name with no point here is a BadValue naming the keyword and saying what
    to take instead."""
    try:
        return from_transformer_lens(name, table) or name
    except NoSuchPoint as e:
        raise BadValue(field, f": {e}") from None


def _matches(table: list[PointInfo], by_name: dict, pattern: str, n_layers: int, field: str) -> set[str]:
    pattern = translated(pattern, table, field)
    if any(c in pattern for c in "*?["):
        hits = {p.name for p in table if fnmatch.fnmatchcase(p.name, pattern)}
        if not hits:
            raise BadValue(field, f" {pattern!r} matches no point of this model; model.points() lists them")
        return hits
    name = canonical(pattern, n_layers, field)
    if name not in by_name:
        raise BadValue(field, f" {pattern!r} is not a point of this model{did_you_mean(name, table)}; "
                              f"{_near(table, name)}")
    return {name}


def _near(table: list[PointInfo], name: str) -> str:
    """What a wrong name could have meant: the points of the layer it names, or the model's own."""
    head, dot, rest = name.partition(".")
    if dot and head.isdigit():
        same = [p.name for p in table if p.layer == int(head)]
        if same:
            return f"layer {head}'s points: {', '.join(same)}"
    own = [p.name for p in table if p.layer is None]
    layer0 = [p.point for p in table if p.layer == 0]
    return f"the model's own points: {', '.join(own)}; a layer's: L.NAME with NAME one of {', '.join(layer0)}"


def editable_near(table: list[PointInfo], name: str) -> str:
    """The editable points next to `name` in forward order: the last before it and the first after it."""
    i = next(k for k, p in enumerate(table) if p.name == name)
    before = next((p.name for p in reversed(table[:i]) if p.editable), None)
    after = next((p.name for p in table[i + 1:] if p.editable), None)
    said = [f"{after} (after it)"] if after else []
    said += [f"{before} (before it)"] if before else []
    return " and ".join(said) if said else "none"


# ----------------------------------------------------------------------------------------------------------------
# a researcher's function on the one hook


def function_name(fn: Callable) -> str:
    """How a trace and an error name a function: module.qualname (a lambda is '<lambda>')."""
    inner = getattr(fn, "func", fn)  # functools.partial
    qual = getattr(inner, "__qualname__", None) or type(inner).__name__
    module = getattr(inner, "__module__", None)
    return f"{module}.{qual}" if module and module not in ("__main__", "builtins") else qual


def as_declared(x, axes: tuple[str, ...]):
    """The tensor of a point laid out as its axes say: a broadcast view of (B, Hkv, G, S, Dh) as the (B, H, S, Dh) it
    stands for (a copy); anything else as it is."""
    if x.dim() == len(axes) + 1 and "H" in axes:
        return x.flatten(1, 2)
    return x


def hook_op(info: PointInfo, fn: Callable, table: list[PointInfo]) -> Callable:
    """The edit that calls fn(x, info) at the point: x as the point's axes say. None observes; a tensor of x's shape
    replaces x at an editable point. Anything else, and any exception fn raises, is a HookError naming the point."""
    import torch

    who = function_name(fn)

    def op(x):
        seen = as_declared(x, info.axes)
        try:
            y = fn(seen, info)
        except HookError:
            raise
        except Exception as e:
            raise HookError(f"hook {who} at point {info.name!r} raised {type(e).__name__}: {e}", info.name) from e
        if y is None or y is seen:
            return x
        if not info.editable:
            raise HookError(f"hook {who} at point {info.name!r} returned a tensor, but {info.name} is not editable (a "
                            f"hook there may only observe it: return None); editable points near it: "
                            f"{editable_near(table, info.name)}", info.name)
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(x.shape):
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise HookError(f"hook {who} at point {info.name!r} returned {got}; a replacement must be a tensor of the "
                            f"point's shape {tuple(x.shape)} ({', '.join(info.axes)})", info.name)
        return y.to(device=x.device, dtype=x.dtype)

    return op


def needs_spelled_attention(info: PointInfo) -> bool:
    """Whether the point exists only where attention is spelled out step by step: the steps of the scores and the
    softmax (s6.4, s6.5: the repeated keys, the scores, the probabilities, a sink's share), which the fused kernel
    computes in one call. Its output (attn_out, each head's P·V) exists always."""
    return info.where == "attn" and info.point != ATTN_OUT.name and any(s in ("s6.4", "s6.5")
                                                                         for s in info.step.split("/"))


# ----------------------------------------------------------------------------------------------------------------
# TransformerLens's names

# A layer's hooks, `blocks.L.<hook>`, and the point each is here. hook_attn_out and hook_mlp_out are what each
# sub-layer adds to the stream: the point just before resid_mid and resid_post (o_proj and down, or a family's norm
# of them: Gemma's post_attn_norm); they are worked out from the built layer.
TL_LAYER = {
    "hook_resid_pre": RESID_PRE.name, "hook_resid_mid": RESID_MID.name, "hook_resid_post": RESID_POST.name,
    "ln1.hook_normalized": ATTN_NORM.name, "ln2.hook_normalized": FFN_NORM.name,
    "attn.hook_q": Q.name, "attn.hook_k": K.name, "attn.hook_v": V.name, "attn.hook_rot_q": Q_ROPE.name,
    "attn.hook_rot_k": K_ROPE.name, "attn.hook_attn_scores": SCORES.name, "attn.hook_pattern": PROBS.name,
    "attn.hook_z": ATTN_OUT.name, "mlp.hook_pre": GATE.name, "mlp.hook_pre_linear": UP.name, "mlp.hook_post": ACT.name,
}
TL_ADDED = {"hook_attn_out": RESID_MID.name, "hook_mlp_out": RESID_POST.name}  # the point before this one
TL_MODEL = {"hook_embed": EMBED.name, "ln_final.hook_normalized": FINAL_NORM.name}
# TransformerLens's hooks that have no point here, and what to take instead
TL_NONE = {
    "hook_pos_embed": "positions are not added to the stream: RoPE turns q and k inside attention (L.q_rope, L.k_rope)",
    "attn.hook_result": "each head's output after Wo is not computed; L.attn_out holds each head's output before Wo "
                        "(hook_z), L.o_proj their sum after it",
    "ln1.hook_scale": "a norm's scale is not kept; L.attn_norm is the normed stream (ln1.hook_normalized)",
    "ln2.hook_scale": "a norm's scale is not kept; L.ffn_norm is the normed stream (ln2.hook_normalized)",
    "ln_final.hook_scale": "a norm's scale is not kept; final_norm is the normed stream (ln_final.hook_normalized)",
    "hook_attn_in": "attention reads L.resid_pre (through L.attn_norm)",
    "hook_mlp_in": "the feed-forward reads L.resid_mid (through L.ffn_norm)",
    "hook_q_input": "q is computed from L.attn_norm", "hook_k_input": "k is computed from L.attn_norm",
    "hook_v_input": "v is computed from L.attn_norm",
    "mlp.hook_expert_indices": "the chosen experts are where L.expert_weights is not 0",
}
_TL_BLOCK = re.compile(r"^blocks\.(?P<layer>[-\w*?\[\]]+)\.(?P<hook>.+)$")


class NoSuchPoint(LlmtraceError):
    """A TransformerLens name with no point here; the message says what to take instead."""


def from_transformer_lens(name: str, table: list[PointInfo]) -> Optional[str]:
    """llmtrace's name for TransformerLens's `name` ("blocks.3.attn.hook_pattern" -> "3.probs", "hook_embed" ->
    "embed", "blocks.*.hook_resid_post" -> "*.resid_post"); None where `name` is not a TransformerLens name. A
    TransformerLens hook that has no point here is a NoSuchPoint saying what to take instead."""
    if name in TL_MODEL:
        return TL_MODEL[name]
    m = _TL_BLOCK.match(name)
    hook = m["hook"] if m else name
    if hook in TL_NONE:
        raise NoSuchPoint(f"{name!r} is TransformerLens's name of a tensor llmtrace does not compute: "
                          f"{TL_NONE[hook].replace('L.', (m['layer'] + '.') if m else 'L.')}")
    if not m or (hook not in TL_LAYER and hook not in TL_ADDED):
        return None
    layer = m["layer"]
    if hook in TL_ADDED:  # the point just before resid_mid (resid_post) in this layer, or in layer 0 for a glob
        n_layers = 1 + max(p.layer for p in table if p.layer is not None)
        at = int(layer) % n_layers if layer.lstrip("-").isdigit() else 0
        order = [p.point for p in table if p.layer == at]
        return f"{layer}.{order[order.index(TL_ADDED[hook]) - 1]}"
    return f"{layer}.{TL_LAYER[hook]}"


def transformer_lens_name(info: PointInfo, table: list[PointInfo]) -> Optional[str]:
    """TransformerLens's name of point `info` ("3.probs" -> "blocks.3.attn.hook_pattern"), None where it has none."""
    if info.layer is None:
        return next((tl for tl, ours in TL_MODEL.items() if ours == info.point), None)
    order = [p.point for p in table if p.layer == info.layer]
    added = {hook: order[order.index(after) - 1] for hook, after in TL_ADDED.items() if after in order}
    for hook, ours in list(TL_LAYER.items()) + list(added.items()):
        if ours == info.point:
            return f"blocks.{info.layer}.{hook}"
    return None


def did_you_mean(name: str, table: list[PointInfo]) -> str:
    """'; did you mean 3.probs?' for a name near one of the model's points, else ''."""
    import difflib

    close = difflib.get_close_matches(name, [p.name for p in table], n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""
