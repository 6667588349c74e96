"""What a trace records (--trace, --layers, --dump, --show-top), checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from llmtrace.errors import BadValue
from llmtrace.trace.events import LAYER_POINTS, LEVELS, MODEL_POINTS


@dataclass
class TraceOptions:
    level: str = "steps"
    layers: Optional[list[int]] = None  # None: all layers
    dump: tuple[str, ...] = ()  # point names ("logits") or "LAYER.name" ("3.probs") whose values are recorded
    topk: int = 10

    def __post_init__(self):
        if self.level not in LEVELS:
            raise BadValue("level", f" must be one of {', '.join(LEVELS)}, not {self.level!r}")
        known = set(LAYER_POINTS) | set(MODEL_POINTS)
        for d in self.dump:
            name = d.split(".", 1)[1] if "." in d and d.split(".", 1)[0].lstrip("-").isdigit() else d
            if name not in known:
                raise BadValue("dump", f": unknown point {d!r}; known points: {', '.join(MODEL_POINTS + LAYER_POINTS)}")

    def check_dump_layers(self, n_layers: int) -> None:
        """Each "LAYER.name" dump names a layer of the model (negative counts from the end), known once it is loaded."""
        for d in self.dump:
            head = d.split(".", 1)[0]
            if "." in d and head.lstrip("-").isdigit() and not -n_layers <= int(head) < n_layers:
                raise BadValue("dump", f": layer {head} of {d!r} is out of range; this model has {n_layers} layers "
                                       f"(0..{n_layers - 1}, or -1 for the last)")
