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
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from llmtrace.errors import BadValue, LlmtraceError
from llmtrace.model.llama_points import LAST
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
    elif callable(names):
        picked = {p.name for p in table if names(p.name)}
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


def _matches(table: list[PointInfo], by_name: dict, pattern: str, n_layers: int, field: str) -> set[str]:
    if any(c in pattern for c in "*?["):
        hits = {p.name for p in table if fnmatch.fnmatchcase(p.name, pattern)}
        if not hits:
            raise BadValue(field, f" {pattern!r} matches no point of this model; model.points() lists them")
        return hits
    name = canonical(pattern, n_layers, field)
    if name not in by_name:
        raise BadValue(field, f" {pattern!r} is not a point of this model; {_near(table, name)}")
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
    """Whether the point exists only where attention is spelled out step by step: the observed steps of the scores
    and the softmax (s6.4, s6.5), which the fused kernel computes in one call. Its output (editable) exists always."""
    return info.where == "attn" and not info.editable and any(s in ("s6.4", "s6.5") for s in info.step.split("/"))
