"""Summary statistics of tensors (mean, std, min, max, L2 norm), many tensors at once, kept on the device until
the end of a pass; and the trace's rounding rule (records.rounded) applied to a whole batch of them at once."""

from __future__ import annotations

import torch

from llmtrace.trace.records import rounded


def stat_rows(m: torch.Tensor, finite_only: bool) -> torch.Tensor:
    """(sum, sum of squares, min, max, count) of each row of m (n, N), accumulated in float64: one (n, 5) tensor."""
    if not m.is_floating_point():  # kv_write's positions
        m = m.double()
    if finite_only:  # masked attention scores hold -inf: summarise the entries that take part
        ok = torch.isfinite(m)
        lo = torch.where(ok, m, float("inf")).amin(dim=1)
        hi = torch.where(ok, m, float("-inf")).amax(dim=1)
        m = torch.where(ok, m, 0)
        n = ok.sum(dim=1, dtype=torch.float64)
    else:  # amin and amax apart: faster here than aminmax
        lo, hi = m.amin(dim=1), m.amax(dim=1)
        n = torch.full((m.size(0),), float(m.size(1)), dtype=torch.float64, device=m.device)
    # both sums read m as it is and accumulate in float64 (no float64 copy of m is made)
    s1 = m.sum(dim=1, dtype=torch.float64)
    s2 = torch.linalg.vector_norm(m, dim=1, dtype=torch.float64).square()
    return torch.stack([s1, s2, lo.double(), hi.double(), n], dim=1)


def stat_vector(x: torch.Tensor, finite_only: bool) -> torch.Tensor:
    """(sum, sum of squares, min, max, count) of one tensor, as one small device tensor."""
    return stat_rows(x.detach().reshape(1, -1), finite_only)[0]


STAT_NAMES = ("mean", "std", "min", "max", "norm")


def summaries(rows: torch.Tensor) -> torch.Tensor:
    """(sum, sum of squares, min, max, count) rows -> (mean, std, min, max, L2 norm, count) rows, on the device."""
    s1, s2, lo, hi, n = rows.unbind(dim=1)
    mean = torch.where(n > 0, s1 / n, 0.0)
    var = torch.where(n > 1, (s2 - s1 * s1 / n).clamp_min(0.0) / (n - 1), 0.0)  # sample variance
    return torch.stack([mean, var.sqrt(), lo, hi, s2.clamp_min(0.0).sqrt(), n], dim=1)


def tensor_stats(x: torch.Tensor) -> dict:
    """Summary statistics of one tensor (mean, std, min, max, L2 norm); non-finite entries are left out."""
    return dict(zip(STAT_NAMES, summaries(stat_vector(x, finite_only=True)[None])[0].tolist()))


def round_tensor(x: torch.Tensor) -> torch.Tensor:
    """records.rounded for every entry of a float64 tensor at once: each finite x becomes n * 10^e with n a 7-digit integer,
    computed so that the result is the double nearest to that decimal (the value `float("%.7g" % x)` gives). Entries
    this cannot do exactly (magnitudes below 1e-15 or above 1e22) and non-finite ones are left as they are."""
    mag = x.abs()
    k = 6 - torch.floor(torch.log10(mag))  # x * 10^k has 7 digits before the point
    k = torch.where(torch.isfinite(k), k, 0.0)
    up = torch.pow(10.0, k.clamp(0, 22))  # powers of ten up to 1e22 are exact doubles
    down = torch.pow(10.0, (-k).clamp(0, 22))
    # n / 10^k (k >= 0) and n * 10^-k (k < 0) are single correctly rounded operations on exact operands
    out = torch.where(k >= 0, torch.round(x * up) / up, torch.round(x / down) * down)
    return torch.where(batch_roundable(x), out, x)


def batch_roundable(x: torch.Tensor) -> torch.Tensor:
    """Where round_tensor rounds exactly: finite, nonzero magnitudes in (1e-15, 1e22)."""
    mag = x.abs()
    return (mag > 1e-15) & (mag < 1e22)  # false for nan, and inf fails the upper bound


def rounded_rows(rows: torch.Tensor) -> list[list]:
    """(n, 6) float64 rows of (mean, std, min, max, norm, count) -> lists with the five statistics rounded (records.rounded), all
    rounded in one batch; the count stays exact."""
    rows = rows.cpu()
    stats = rows[:, :5]
    out = torch.cat([round_tensor(stats), rows[:, 5:]], dim=1).tolist()
    for r, c in ((stats != 0) & ~batch_roundable(stats)).nonzero().tolist():  # what round_tensor left
        out[r][c] = rounded(out[r][c])
    return out
