"""The statistics of `llmtrace eval`, as llama.cpp's `llama-perplexity` computes them (tools/perplexity/perplexity.cpp),
from per-chunk sums: no torch here.

Each chunk carries plain sums over its scored positions (of the NLL, its square, the KLD, ...) and, for the
distributions, its per-position values. A summary adds the chunks' sums in chunk order, so that a run split over
processes, machines or an interrupted session gives the figures of one uninterrupted run: never an average of
averages.

    mean ± uncertainty   f = S/n,  σ_f = sqrt((S2/n − f²)/(n − 1))          (0 when n ≤ 10, as llama.cpp)
    PPL                  exp(mean NLL) ± PPL·σ
    ln(PPL(B)/PPL(A))    mean NLL_B − mean NLL_A ± sqrt(σ_B² + σ_A² − 2 cov)
    cov                  (S_AB/n − (S_A/n)(S_B/n)) / (n − 1)
    Δp RMS               sqrt(mean Δp²) ± σ(Δp²) / (2 RMS)
    same top             f ± sqrt(f (1 − f) / (n − 1))
    KLD's bound          with a base file: the mean of the per-position bound (an exact base: the KLD is within it
                         of the one-run KLD; a top-K base: the KLD is a lower bound, short by at most it)
    percentile q         the sorted values v: (1 − t) v[i] + t v[i+1], i + t = q (n − 1)
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

# the sums a chunk carries (`sums`), by side: A alone, or A against B
SUMS_ONE = ("nll", "nll2")
SUMS_TWO = SUMS_ONE + ("nll_b", "nll_b2", "nll_ab", "kld", "kld2", "kld_ba", "dp", "dp2", "dp4", "same_top")
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)
ERR_PERCENTILES = (99.0, 90.0, 50.0, 10.0)
MIN_FOR_DISTRIBUTIONS = 100  # llama.cpp prints no distribution over fewer scored tokens


def add_sums(chunks: Iterable[dict], keys: tuple[str, ...]) -> dict:
    """Each sum over the chunks, added in chunk order (float64; same_top an integer)."""
    total = {k: 0 for k in keys} | {"n": 0}
    for c in chunks:
        for k in keys:
            total[k] += c["sums"][k]
        total["n"] += c["tokens_scored"]
    return total


def mean_unc(s: float, s2: float, n: int) -> tuple[float, float]:
    """The mean of n values from their sum and sum of squares, and its uncertainty (llama.cpp's mean_and_uncertainty)."""
    if n < 1:
        return 0.0, 0.0
    f = s / n
    var = s2 / n - f * f
    return f, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def covariance(sa: float, sb: float, sab: float, n: int) -> float:
    if n < 10:
        return 0.0
    return (sab / n - (sa / n) * (sb / n)) / (n - 1)


def percentile(values: list[float], q: float) -> float:
    """llama.cpp's percentile of sorted `values` (q in percent): linear between the two nearest ranks."""
    if not values:
        return math.nan
    if q <= 0:
        return values[0]
    if q >= 100:
        return values[-1]
    p = q / 100 * (len(values) - 1)
    i = int(p)
    t = p - i
    return (1 - t) * values[i] + t * values[min(i + 1, len(values) - 1)]


def median(values: list[float]) -> float:
    n = len(values)
    if not n:
        return math.nan
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2] + values[n // 2 - 1])


def vu(value: float, unc: float) -> dict:
    """A figure with its uncertainty."""
    return {"value": value, "uncertainty": unc}


def ppl_figure(nll: float, nll2: float, n: int) -> dict:
    m, u = mean_unc(nll, nll2, n)
    ppl = math.exp(m)
    return vu(ppl, ppl * u)


def distribution(values: list[float], qs: tuple[float, ...]) -> dict:
    """max, the percentiles, min, of sorted values (`median` for 50)."""
    out = {"max": values[-1] if values else math.nan}
    out["percentiles"] = {f"{q:g}": median(values) if q == 50.0 else percentile(values, q) for q in qs}
    out["min"] = values[0] if values else math.nan
    return out


def summarize_one(chunks: list[dict]) -> dict:
    """PPL of one side, ± its uncertainty."""
    s = add_sums(chunks, SUMS_ONE)
    return {"tokens_scored": s["n"], "ppl": ppl_figure(s["nll"], s["nll2"], s["n"])}


def summarize_two(chunks: list[dict], distributions: bool = True) -> dict:
    """A against B, as llama.cpp's KL-divergence mode prints them (A the base, B the model under test);
    `distributions`: also the percentiles of KLD and Δp (from 100 scored tokens on)."""
    s = add_sums(chunks, SUMS_TWO)
    n = s["n"]
    (la, ua), (lb, ub) = mean_unc(s["nll"], s["nll2"], n), mean_unc(s["nll_b"], s["nll_b2"], n)
    cov = covariance(s["nll_b"], s["nll"], s["nll_ab"], n)
    ratio, ratio_u = lb - la, math.sqrt(max(ua * ua + ub * ub - 2 * cov, 0.0))
    ppl_a, ppl_b = ppl_figure(s["nll"], s["nll2"], n), ppl_figure(s["nll_b"], s["nll_b2"], n)
    diff_u = math.sqrt(max(ppl_a["uncertainty"] ** 2 + ppl_b["uncertainty"] ** 2
                           - 2 * ppl_a["value"] * ppl_b["value"] * cov, 0.0))
    kld_m, kld_u = mean_unc(s["kld"], s["kld2"], n)
    dp_m, dp_u = mean_unc(s["dp"], s["dp2"], n)
    mse, mse_u = mean_unc(s["dp2"], s["dp4"], n)
    rms = math.sqrt(mse)
    same = s["same_top"] / n if n else 0.0
    out = {"tokens_scored": n, "ppl": ppl_a, "ppl_b": ppl_b,
           "ln_ppl_correlation": cov / (ua * ub) if ua > 0 and ub > 0 else None,
           "ln_ppl_ratio": vu(ratio, ratio_u), "ppl_ratio": vu(math.exp(ratio), math.exp(ratio) * ratio_u),
           "ppl_diff": vu(ppl_b["value"] - ppl_a["value"], diff_u),
           "kld": {"mean": kld_m, "uncertainty": kld_u},
           "kld_ba": {"mean": s["kld_ba"] / n if n else 0.0},
           "dp": {"mean": dp_m, "uncertainty": dp_u, "rms": vu(rms, 0.5 / rms * mse_u if rms > 0 else 0.0)},
           "same_top": vu(same, math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0)}
    if "kld_bound" in chunks[0]["sums"]:  # side A from a base file (eval_score.py derives the bound)
        out["kld"]["bound"] = math.fsum(c["sums"]["kld_bound"] for c in chunks) / n
    if "base_tail" in chunks[0]["sums"]:  # a top-K base: the mean mass outside the top K
        out["kld"]["tail"] = math.fsum(c["sums"]["base_tail"] for c in chunks) / n
    if distributions and n >= MIN_FOR_DISTRIBUTIONS:
        kld = sorted(v for c in chunks for v in c["kld"])
        dp = sorted(v for c in chunks for v in c["dp"])
        out["kld"] |= distribution(kld, KLD_PERCENTILES)
        out["dp"] |= distribution(dp, DP_PERCENTILES)
    return out


def running_line(chunks: list[dict]) -> dict:
    """The figures llama.cpp prints after each chunk, over the chunks so far: PPL, and with two sides ln ratio, KLD,
    Δp RMS and same top, each ± its uncertainty."""
    if "kld" not in chunks[0]["sums"]:
        return summarize_one(chunks)
    out = summarize_two(chunks, distributions=False)
    return {k: out[k] for k in ("tokens_scored", "ppl", "ppl_b", "ln_ppl_ratio", "same_top")} | {
        "kld": {"mean": out["kld"]["mean"], "uncertainty": out["kld"]["uncertainty"]}, "dp_rms": out["dp"]["rms"]}


def summarize_layers(chunks: list[dict], n_layers: int) -> Optional[dict]:
    """--layers: per layer, the relative error it adds and the one accumulated up to its output, as mean and
    percentiles over every scored position; where each position first diverges; MoE routing agreement and load."""
    if not chunks or "layers" not in chunks[0]:
        return None
    out = []
    for i in range(n_layers + 2):  # the embeddings, each layer, the logits
        row = {"layer": i - 1 if 0 < i <= n_layers else None,
               "where": "embed" if i == 0 else "logits" if i == n_layers + 1 else "layer"}
        for kind in ("added", "accumulated"):
            vals = sorted(v for c in chunks for v in c["layers"][kind][i])
            row[kind] = {"mean": math.fsum(vals) / len(vals) if vals else None} | {
                f"p{q:g}": percentile(vals, q) for q in ERR_PERCENTILES} | {"max": vals[-1] if vals else None}
        out.append(row)
    first = [0] * (n_layers + 3)
    for c in chunks:
        first = [x + y for x, y in zip(first, c["layers"]["first_divergence"])]
    doc = {"rows": out, "first_divergence": first}
    if "routing" in chunks[0]["layers"]:
        doc["routing"] = _routing(chunks)
    return doc


def _routing(chunks: list[dict]) -> list[dict]:
    layers = sorted({int(k) for c in chunks for k in c["layers"]["routing"]})
    out = []
    for layer in layers:
        recs = [c["layers"]["routing"][str(layer)] for c in chunks]
        agree, n = sum(r["agree"] for r in recs), sum(r["n"] for r in recs)
        load_a = [sum(col) for col in zip(*(r["load_a"] for r in recs))]
        load_b = [sum(col) for col in zip(*(r["load_b"] for r in recs))]
        out.append({"layer": layer, "agreement": agree / n if n else None, "positions": n, "load_a": load_a,
                    "load_b": load_b})
    return out
