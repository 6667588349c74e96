"""Index lists as people type them ('0,3,-1', '2-5', 'all') for layers and positions: parsed and checked here."""

from __future__ import annotations

from typing import Optional

from llmtrace.errors import BadValue
from llmtrace.units import plural


def parse_index_ranges(spec: str, field: str, noun: str) -> list[tuple[int, int]]:
    """The syntax alone: '0,3,-1' -> [(0, 0), (3, 3), (-1, -1)], '2-5' -> [(2, 5)]. Checked before a model is loaded."""
    ranges = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part[1:]:
                cut = part.index("-", 1)
                ranges.append((int(part[:cut]), int(part[cut + 1:])))
            else:
                ranges.append((int(part), int(part)))
        except ValueError:
            raise BadValue(field, f": {part!r} is not a {noun} number (use e.g. 0,3,-1 or 2-5)") from None
    return ranges


def parse_indices(spec: str, n: int, field: str, noun: str, of: str) -> list[int]:
    """'0,3,-1' or '2-5' -> sorted distinct indices in [0, n); negative ones count from the end.

    `field`, `noun` and `of` word the errors: "layers: layer 31 is out of range; this model has 30 layers"."""
    out: list[int] = []
    for lo, hi in parse_index_ranges(spec, field, noun):
        for end in (lo, hi):  # check before building a range
            if not -n <= end < n:
                raise BadValue(field, f": {noun} {end} is out of range; {of} {plural(n, noun)} "
                                      f"(0..{n - 1}, or -1 for the last)")
        lo, hi = (e + n if e < 0 else e for e in (lo, hi))
        out.extend(i for i in range(lo, hi + 1) if i not in out)
    return sorted(out)


def parse_layers(spec: Optional[str], n_layers: int) -> Optional[list[int]]:
    """'0,3,-1' -> [0, 3, n-1]; ranges like '2-5' are accepted. None (or 'all') means every layer."""
    if spec is None or spec.strip() in ("", "all"):
        return None
    return parse_indices(spec, n_layers, "layers", "layer", "this model has")
