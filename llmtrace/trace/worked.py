"""Which values of a --trace full run the report's worked cards read: the entries a sample keeps, and the layers whose
cards are computed (trace.cards).

A point's sample keeps the first entries of each half of every row and each row's norm (trace.recorder); in the card
layers the one float64 evaluator (model.recompute) computes the point from the pass's own tensors, sampled at the same
rows and entries, and the sample carries it (trace.cards). Nothing here names a point.
"""

from __future__ import annotations

from typing import Optional

SAMPLE_WIDTH = 16  # a sample keeps a row whole up to this many entries, else the first 8 of each half (recorder)
CARD_LAYERS = 4  # the cards are computed in at most this many layers (the selected ones, else the first and last)


def full_row_layers(selected: Optional[list[int]], n_layers: int) -> list[int]:
    """The layers whose cards a trace computes: the selected layers when there are at most four, else the first and
    the last of them (every layer traced: the model's first and last)."""
    layers = sorted({l % n_layers for l in selected}) if selected is not None else list(range(n_layers))
    return layers if len(layers) <= CARD_LAYERS else [layers[0], layers[-1]]


def sample_index(width: int, sample_width: int = SAMPLE_WIDTH) -> list[int]:
    """The entries a sample keeps along a last axis of `width` (the recorder's rule): all of them up to
    `sample_width`, else the first sample_width/2 of each half."""
    half = sample_width // 2
    return list(range(width)) if width <= sample_width else list(range(half)) + list(range(width // 2, width // 2 + half))
