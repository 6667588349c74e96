"""What a trace records (--trace, --layers, --dump, --show-top), checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from llmtrace.errors import BadValue
from llmtrace.trace.events import LEVELS, Level


class Dump(NamedTuple):
    """One --dump entry: a point ("logits"; "probs" is every layer's) or a point of one layer ("3.probs", "-1.q")."""

    layer: Optional[int]  # None: the point itself (a model point) or every layer's; negative counts from the end
    point: str

    def __str__(self) -> str:
        return self.point if self.layer is None else f"{self.layer}.{self.point}"

    def layer_index(self, n_layers: int) -> Optional[int]:
        return None if self.layer is None else self.layer + n_layers if self.layer < 0 else self.layer


def parse_dump(text: str) -> Dump:
    """The one parser of a --dump entry: "logits", "probs", "3.probs", "-1.q". A point no family declares is refused
    here; whether this model has it is its own declaration's to say (TraceOptions.check_dumps, once it is loaded)."""
    from llmtrace.model.family import known_points

    lay, dot, name = text.partition(".")
    dump = Dump(int(lay), name) if dot and lay.lstrip("-").isdigit() else Dump(None, text)
    known = known_points(traced=True)
    if dump.point not in known:
        raise BadValue("dump", f": unknown point {text!r}; known points: {', '.join(known)}")
    return dump


@dataclass
class TraceOptions:
    level: Level = Level.STEPS  # a name ("full") is taken too
    layers: Optional[list[int]] = None  # None: all layers
    dump: tuple[str, ...] = ()  # point names ("logits") or "LAYER.name" ("3.probs") whose values are recorded
    topk: int = 10
    logits_top: int = 0  # the step event keeps this many of the largest raw logits (and the rest as a histogram)
    dumps: tuple[Dump, ...] = field(init=False, repr=False)  # `dump`, parsed

    def __post_init__(self):
        if self.level not in LEVELS:
            raise BadValue("level", f" must be one of {', '.join(LEVELS)}, not {self.level!r}")
        self.level = Level.of(self.level)
        self.dumps = tuple(parse_dump(d) for d in self.dump)

    def check_dumps(self, n_layers: int, points) -> None:
        """Each dump names a point the model declares (model.points.Points) and, as "LAYER.name", a layer of the model
        (negative counts from the end): known once it is loaded."""
        traced = points.names(traced=True)
        layer_points = points.names(layer=True, traced=True)
        for d in self.dumps:
            if d.point not in traced or (d.layer is not None and d.point not in layer_points):
                raise BadValue("dump", f": unknown point {str(d)!r}; this model's points: {', '.join(traced)} "
                                       f"(a layer's as LAYER.name)")
        for d in self.dumps:
            if d.layer is not None and not -n_layers <= d.layer < n_layers:
                raise BadValue("dump", f": layer {d.layer} of {str(d)!r} is out of range; this model has {n_layers} "
                                       f"layers (0..{n_layers - 1}, or -1 for the last)")
