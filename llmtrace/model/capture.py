"""Keep named tensors of a forward pass: the one capture that explain, compare, the interventions and the patching
sweep run their passes under (TransformerLens's run_with_cache, as a scope around the model's own calls)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Union

import torch

from llmtrace.model.points import Point, splice
from llmtrace.model.transformer import Transformer

Wanted = Union[None, Iterable[tuple[Optional[int], str]], Callable[[Optional[int], str], bool]]


@contextlib.contextmanager
def capture(model: Transformer, wanted: Wanted = None, *, layers: Optional[Iterable[int]] = None,
            attention: Optional[Iterable[int]] = None, spell_out: bool = False,
            clone: bool = True) -> Iterator[dict[tuple[Optional[int], str], torch.Tensor]]:
    """Within the block, keep the tensor of each point the model reports, as {(layer, name): tensor} (layer None for
    the model's own points; the batch axis kept; the last pass's value when several passes report one). `wanted`:
    (layer, name) pairs, or a predicate, or None for every point of the hooked parts. `layers` (default: those the
    pairs name, else every layer) and `attention` are the hooked parts, as `Transformer.hooked` takes them;
    `spell_out` makes hooked attention layers report their scores and probabilities. Values are observed, never
    changed; `clone` False keeps the tensors themselves (valid while nothing writes them)."""
    if wanted is None or callable(wanted):
        keep_it = wanted or (lambda layer, name: True)
    else:
        pairs = set(wanted)
        keep_it = lambda layer, name: (layer, name) in pairs  # noqa: E731
        if layers is None:
            layers = sorted({layer for layer, _ in pairs if layer is not None})
    out: dict[tuple[Optional[int], str], torch.Tensor] = {}

    def keep(layer: Optional[int], name: str, x: torch.Tensor) -> None:
        if keep_it(layer, name):
            out[(layer, name)] = x.clone() if clone else x

    with model.hooked(keep, layers, attention=attention, spell_out=spell_out):
        yield out


def layer_points(model: Transformer, layer: int) -> tuple[Point, ...]:
    """The points decoder layer `layer` of the built model reports, in forward order: its block's own with those of the
    sub-layers it holds (a mixture-of-experts model's dense layer reports a dense feed-forward's points, not the
    experts' its class declares). What a hook and a capture of that layer can see."""
    block = model.layers[layer]
    own = {p.name: p for p in type(block).declared_points()}
    order = tuple(own[p.name] if isinstance(p, Point) else p for p in type(block).POINTS)
    return splice(order, {part: getattr(block, part).declared_points() for part in order if isinstance(part, str)})
