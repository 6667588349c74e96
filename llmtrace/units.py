"""Numbers for people: the one byte formatter and the one count of things ('1 token', '2 tokens') every view and
message uses."""

from __future__ import annotations

from typing import Optional

_UNITS = ("KiB", "MiB", "GiB", "TiB")


def human_bytes(n: Optional[float]) -> str:
    """Bytes in binary units with three significant figures: 612 B, 1.50 KiB, 11.3 MiB, 513 MiB, 1.23 GiB; — for None.
    Binary units because memory and cache sizes are powers of two; the exact count is for the JSON, not this."""
    if n is None:
        return "—"
    if abs(n) < 1023.5:
        return f"{int(n):,} B"
    x = float(n)
    for unit in _UNITS:
        x /= 1024
        if abs(x) < 1023.5 or unit == _UNITS[-1]:  # 1023.9 MiB reads 1.00 GiB, not 1,024 MiB
            break
    if abs(x) >= 99.95:
        return f"{x:,.0f} {unit}"
    return f"{x:.1f} {unit}" if abs(x) >= 9.995 else f"{x:.2f} {unit}"


def plural(n: int, word: str, plural: Optional[str] = None) -> str:  # noqa: A002 (the keyword callers write)
    """'1 position', '3 positions', '1,024 tokens'; `plural` for a word that does not take an s ('1 index', '2 indices')."""
    return f"{n:,} {noun(n, word, plural)}"


def noun(n: int, word: str, plural: Optional[str] = None) -> str:  # noqa: A002
    """The word alone, as plural() counts it: 'layer' for 1, 'layers' for any other n ('in layers 0, 3')."""
    return word if n == 1 else (plural or word + "s")


def sig6(x) -> float:
    """A number to 6 significant digits, as explain's worked sections print them."""
    return float(f"{float(x):.6g}")


def sig6_rows(t) -> list:
    """A tensor's values to 6 significant digits: a list for a vector (or a flattened scalar), a list of lists for a
    matrix (explain's corners of a state)."""
    return [sig6(v) for v in t.reshape(-1).tolist()] if t.dim() <= 1 else [sig6_rows(r) for r in t]
