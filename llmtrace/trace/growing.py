"""Statistics of a view over a cache that grows by the slots each pass writes, carried from pass to pass.

A point such as k_repeated (the keys laid out for the query heads) is every key cached so far: at --trace full its
statistics were reduced over the whole cache at every step, which made a decode step's tracing cost grow with the
context (30 layers of SmolLM2 at 104 slots: 60% of the time of all the pass's statistics). Each pass writes only its
own slots, so the statistics of the slots before them are those of the pass before: this keeps, per point, the
(sum, sum of squares, min, max, count) row of the last pass and reduces only the slots the pass wrote.

It does so only when the view is of the same buffer (the same storage), starts at the same address with the same
strides, and has grown along one axis by exactly the slots the layer's kv_write reported in this pass. This rests on
the cache being append-only: LayerKV.update is its one writer (it reports kv_write), and a hook may not edit a point
in place (Module.point). A pass in inference mode tracks no version counters to check it by. Anything else (a first
pass, another run's or a copied cache, a pass not seen) is reduced whole, as before. The sums are the same float64
sums in another order, equal to the whole reduction far below the 7 digits a trace keeps (tests/test_trace.py:
within 1e-12 relative over a run).
"""

from __future__ import annotations

from typing import Optional

import torch


class Growing:
    """The last pass's statistics row of each growing view, by key (layer, point, batch row)."""

    def __init__(self):
        self._state: dict[tuple, tuple] = {}  # key -> (storage, shape, strides, address, rows, index)

    def split(self, key: tuple, distinct: torch.Tensor, written: Optional[tuple[int, int]]
              ) -> Optional[tuple[tuple[torch.Tensor, int], torch.Tensor]]:
        """((rows, index): the last pass's row of this view, the slots this pass wrote of it), when the view only
        grew by them since (see the module's docstring); else None. `written`: [first, last] slot of the layer's
        kv_write in this pass."""
        state = self._state.get(key)
        if state is None or written is None:
            return None
        storage, shape, strides, address, rows, index = state
        if distinct.data_ptr() != address or distinct.stride() != strides or distinct.dim() != len(shape) or \
                _storage(distinct) != storage:
            return None
        grown = [d for d, (a, b) in enumerate(zip(shape, distinct.shape)) if a != b]
        if len(grown) != 1:
            return None
        d = grown[0]
        first, last = written
        if first != shape[d] or last + 1 != distinct.shape[d]:
            return None
        return (rows, index), distinct.narrow(d, first, last + 1 - first)

    def keep(self, key: tuple, distinct: torch.Tensor, rows: torch.Tensor, index: int) -> None:
        """Note row `index` of `rows` (unscaled statistics rows) as this view's, for the next pass."""
        self._state[key] = (_storage(distinct), tuple(distinct.shape), distinct.stride(), distinct.data_ptr(), rows,
                            index)

    def clear(self) -> None:
        self._state.clear()


def _storage(x: torch.Tensor) -> tuple[int, int]:
    s = x.untyped_storage()
    return s.data_ptr(), s.nbytes()


def combine(before: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """(sum, sum of squares, min, max, count) rows of two disjoint parts -> the rows of their union."""
    out = before + new
    out[:, 2] = torch.minimum(before[:, 2], new[:, 2])
    out[:, 3] = torch.maximum(before[:, 3], new[:, 3])
    return out


def gather(prev: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The rows of `prev` [(rows, index)] as one tensor: the rows tensor itself when they are all of it, in order
    (every pass after the first, where the same members come in the same order)."""
    rows = prev[0][0]
    if all(r is rows and j == k for k, (r, j) in enumerate(prev)) and rows.size(0) == len(prev):
        return rows
    return torch.stack([r[j] for r, j in prev])
