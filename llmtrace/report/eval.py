"""The page of `llmtrace eval --html`: one self-contained HTML file, static SVG, no script, nothing from the network.

    the events (eval, chunk…, eval_summary) -> view(events) -> geometry and labels -> templates/eval.html.j2

    PPL per chunk          each chunk's own PPL (exp of its mean NLL), A and B
    KLD distribution       a histogram of log10 KL(A‖B) over every scored position
    Δp distribution        a histogram of p_B − p_A of the next token
    where the error enters the mean and 99th percentile of the relative error each stage adds, and the accumulated
                           mean, on one log axis (--layers); MoE routing agreement per layer
"""

from __future__ import annotations

import math
from typing import Optional

W, H, LEFT, TOP, BOTTOM = 760, 200, 64, 12, 28
KLD_LO, KLD_HI = -8, 0  # log10 KLD histogram range


def _axis_y(lo: float, hi: float, log: bool, n: int = 4) -> list[dict]:
    out = []
    for k in range(n + 1):
        v = lo + (hi - lo) * k / n
        out.append({"y": _y(k / n), "text": f"1e{v:.0f}" if log else f"{v:.4g}"})
    return out


def _y(f: float) -> float:
    return round(TOP + (1 - f) * (H - TOP - BOTTOM), 1)


def _x(f: float) -> float:
    return round(LEFT + f * (W - LEFT - 10), 1)


def line_chart(series: list[tuple[str, str, list[Optional[float]]]], log: bool = False,
               xlabels: Optional[list[str]] = None) -> Optional[dict]:
    """Polylines of (name, css class, values) over a shared x (index) and y axis (decades on a log axis), with a
    label under every x (thinned to about 30) when `xlabels` are given."""
    vals = [v for _, _, vs in series for v in vs if v is not None and (v > 0 or not log)]
    if not vals:
        return None
    f = (lambda v: math.log10(v)) if log else (lambda v: v)  # noqa: E731
    lo, hi = min(map(f, vals)), max(map(f, vals))
    if log:
        lo, hi = math.floor(lo), math.ceil(hi)
    if hi == lo:
        lo, hi = lo - 1, hi + 1
    n = max(len(vs) for _, _, vs in series)
    out = []
    for name, css, vs in series:
        pts = [(_x(i / max(n - 1, 1)), _y((f(v) - lo) / (hi - lo))) for i, v in enumerate(vs)
               if v is not None and (v > 0 or not log)]
        out.append({"name": name, "css": css, "points": " ".join(f"{x},{y}" for x, y in pts),
                    "dots": [{"x": x, "y": y} for x, y in pts] if len(pts) <= 80 else []})
    step = max(1, math.ceil(n / 30))
    xs = [{"x": _x(i / max(n - 1, 1)), "text": t} for i, t in enumerate(xlabels or []) if i % step == 0]
    return {"series": out, "yticks": _axis_y(lo, hi, log, int(hi - lo) if log else 4), "n": n, "width": W,
            "height": H, "xlabels": xs}


def histogram(values: list[float], lo: float, hi: float, bins: int, label) -> dict:
    counts = [0] * bins
    for v in values:
        k = int((v - lo) / (hi - lo) * bins)
        counts[min(max(k, 0), bins - 1)] += 1
    top = max(counts) or 1
    bw = (W - LEFT - 10) / bins
    bars = [{"x": round(LEFT + k * bw, 1), "w": round(bw - 1, 1), "y": _y(c / top), "h": round(_y(0) - _y(c / top), 1),
             "title": f"{label(lo + (hi - lo) * k / bins)} … {label(lo + (hi - lo) * (k + 1) / bins)}: {c}"}
            for k, c in enumerate(counts)]
    ticks = [{"x": _x(k / 4), "text": label(lo + (hi - lo) * k / 4)} for k in range(5)]
    return {"bars": bars, "ticks": ticks, "top": top, "width": W, "height": H}


def _chunk_ppl(chunks: list[dict], key: str) -> list[Optional[float]]:
    return [math.exp(c["sums"][key] / c["tokens_scored"]) if key in c["sums"] and c["tokens_scored"] else None
            for c in chunks]


def view(events: list[dict]) -> dict:
    from llmtrace.render.eval import summary_text

    header, summary = events[0], events[-1]
    chunks = [e for e in events if e.get("event") == "chunk"]
    two = "kld" in summary
    series = [("PPL(A)", "a", _chunk_ppl(chunks, "nll"))] + ([("PPL(B)", "b", _chunk_ppl(chunks, "nll_b"))] if two else [])
    v = {"header": header, "summary": summary, "text": summary_text(header, summary), "ppl": line_chart(series),
         "kld": None, "dp": None, "dp_reach": None, "layers": None, "stages": [], "first": [], "routing": []}
    if two:
        kld = [math.log10(max(x, 1e-30)) for c in chunks for x in c["kld"]]
        v["kld"] = histogram(kld, KLD_LO, KLD_HI, 45, lambda x: f"1e{x:.0f}" if x == int(x) else f"1e{x:.1f}")
        dp = [x for c in chunks for x in c["dp"]]
        reach = next((r for r in (1e-4, 1e-3, 1e-2, 1e-1) if max(map(abs, dp), default=0) <= r), 1.0)
        v["dp"] = histogram(dp, -reach, reach, 40, lambda x: f"{100 * x:+.3g}%")
        v["dp_reach"] = f"{100 * reach:g}%"
    lay = summary.get("layers")
    if lay:
        rows = lay["rows"]
        v["stages"] = [("embed" if r["where"] == "embed" else "logits" if r["where"] == "logits" else str(r["layer"]))
                       for r in rows]
        v["layers"] = line_chart([("added, mean", "add", [r["added"]["mean"] for r in rows]),
                                  ("added, 99th percentile", "add99", [r["added"]["p99"] for r in rows]),
                                  ("accumulated, mean", "acc", [r["accumulated"]["mean"] for r in rows])], log=True,
                                 xlabels=v["stages"])
        total = sum(lay["first_divergence"]) or 1
        v["first"] = [{"stage": s, "share": 100 * c / total} for s, c in
                      zip(v["stages"] + ["never"], lay["first_divergence"]) if c]
        v["routing"] = lay.get("routing") or []
    return v


def render_eval_page(events: list[dict]) -> str:
    """The page's HTML from an evaluation's events (EvalResult.to_jsonl_events())."""
    from pathlib import Path

    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
                             autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("eval.html.j2").render(v=view(events), W=W, H=H, LEFT=LEFT, BASE=_y(0))
