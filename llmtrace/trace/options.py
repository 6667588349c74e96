"""What a trace records (--trace, --layers, --dump, --show-top), checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from llmtrace.errors import BadValue
from llmtrace.trace.events import LAYER_POINTS, LEVELS, MODEL_POINTS


class Dump(NamedTuple):
    """One --dump entry: a point ("logits"; "probs" is every layer's) or a point of one layer ("3.probs", "-1.q")."""

    layer: Optional[int]  # None: the point itself (a model point) or every layer's; negative counts from the end
    point: str

    def __str__(self) -> str:
        return self.point if self.layer is None else f"{self.layer}.{self.point}"

    def layer_index(self, n_layers: int) -> Optional[int]:
        return None if self.layer is None else self.layer + n_layers if self.layer < 0 else self.layer


def parse_dump(text: str) -> Dump:
    """The one parser of a --dump entry: "logits", "probs", "3.probs", "-1.q"."""
    lay, dot, name = text.partition(".")
    dump = Dump(int(lay), name) if dot and lay.lstrip("-").isdigit() else Dump(None, text)
    if dump.point not in set(LAYER_POINTS) | set(MODEL_POINTS):
        raise BadValue("dump", f": unknown point {text!r}; known points: {', '.join(MODEL_POINTS + LAYER_POINTS)}")
    return dump


@dataclass
class TraceOptions:
    level: str = "steps"
    layers: Optional[list[int]] = None  # None: all layers
    dump: tuple[str, ...] = ()  # point names ("logits") or "LAYER.name" ("3.probs") whose values are recorded
    topk: int = 10
    logits_top: int = 0  # the step event keeps this many of the largest raw logits (and the rest as a histogram)
    dumps: tuple[Dump, ...] = field(init=False, repr=False)  # `dump`, parsed

    def __post_init__(self):
        if self.level not in LEVELS:
            raise BadValue("level", f" must be one of {', '.join(LEVELS)}, not {self.level!r}")
        self.dumps = tuple(parse_dump(d) for d in self.dump)

    def check_dump_layers(self, n_layers: int) -> None:
        """Each "LAYER.name" dump names a layer of the model (negative counts from the end), known once it is loaded."""
        for d in self.dumps:
            if d.layer is not None and not -n_layers <= d.layer < n_layers:
                raise BadValue("dump", f": layer {d.layer} of {str(d)!r} is out of range; this model has {n_layers} "
                                       f"layers (0..{n_layers - 1}, or -1 for the last)")
