"""The comparison page of `llmtrace compare --html` and `llmtrace diff --html`: one self-contained HTML file.

    CompareResult.to_json() -> view(doc) -> one dict of geometry and labels -> templates/compare.html.j2

Every chart's geometry (cell rectangles, line points, bar heights, colours) is computed here; the jinja2 template
(autoescaped) only places it, and the small script (assets/compare.js) reads named fields of the embedded data to
draw the chosen point's error per position. The page loads nothing from the network.

    the heat strip        points (rows) x layers (columns), colour = log10 of the largest relative error at any
                          position (1e-9 .. 1e-1, viridis), grey where identical; the first divergence outlined
    accumulated / added   per layer, both on one log axis
    KLD per position      a bar per position under its token; a different top-1 marked in red
    the chosen point      its relative error (and the error its layer adds) at each position
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Union

from llmtrace.report.page import colour
from llmtrace.words import in_words

LOG_LO, LOG_HI = -9.0, -1.0  # the colour and chart scale: relative errors from 1e-9 to 1e-1
CELL_W, CELL_H = 22, 15
LABEL_W = 78
CHART_W, CHART_H = 720, 200
BAR_W = 16


def log_fraction(x: Optional[float]) -> Optional[float]:
    """Where x sits on the log scale [1e-9, 1e-1], as 0..1; None for a missing value, 0 for an exact zero."""
    if x is None:
        return None
    if x <= 0:
        return 0.0
    return min(1.0, max(0.0, (math.log10(x) - LOG_LO) / (LOG_HI - LOG_LO)))


def cell_colour(x: Optional[float]) -> str:
    if x is None:
        return "#ffffff"
    if x == 0:
        return "#e4e4e4"
    return colour(log_fraction(x))


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "—"
    return "0" if x == 0 else f"{x:.2e}"


def heat_strip(doc: dict) -> dict:
    layers = doc["layers"]
    points: list[str] = []
    for lay in layers:
        for p in lay["points"]:
            if p["point"] not in points:
                points.append(p["point"])
    fd = doc.get("first_divergence") or {}
    cells, mark = [], None
    for col, lay in enumerate(layers):
        by = {p["point"]: p for p in lay["points"]}
        for row, name in enumerate(points):
            p = by.get(name)
            if p is None:
                continue
            x, y = LABEL_W + col * CELL_W, 20 + row * CELL_H
            v = p["max_rel_err"]
            cells.append({"x": x, "y": y, "fill": cell_colour(v), "layer": lay["layer"], "point": name,
                          "title": f"layer {lay['layer']} {name}: max rel. error {_fmt(v)} at position "
                                   f"{p['position']}; over all positions {_fmt(p['rel_err'])}; added "
                                   f"{_fmt(p.get('added_rel_err'))}"})
            if fd.get("layer") == lay["layer"] and fd.get("point") == name:
                mark = {"x": x - 1, "y": y - 1}
    labels = [{"x": LABEL_W - 6, "y": 20 + r * CELL_H + CELL_H - 4, "text": n} for r, n in enumerate(points)]
    cols = [{"x": LABEL_W + c * CELL_W + CELL_W / 2, "text": str(lay["layer"])} for c, lay in enumerate(layers)
            if c % (1 if len(layers) <= 32 else 2) == 0]
    width = LABEL_W + len(layers) * CELL_W + 10
    height = 20 + len(points) * CELL_H + 8
    legend = [{"x": i * 40, "fill": colour(i / 8), "text": f"1e{int(LOG_LO) + i}"} for i in range(9)]
    model = []
    for i, (name, p) in enumerate((doc.get("model_points") or {}).items()):  # in forward order
        if p is not None:
            model.append({"x": 90 + i * 120, "fill": cell_colour(p["max_rel_err"]), "name": name, "point": name,
                          "title": f"{name}: max rel. error {_fmt(p['max_rel_err'])}, added "
                                   f"{_fmt(p.get('added_rel_err'))}",
                          "marked": fd.get("layer") is None and fd.get("point") == name})
    return {"cells": cells, "mark": mark, "labels": labels, "cols": cols, "width": width, "height": height,
            "cw": CELL_W, "ch": CELL_H, "legend": legend, "model": model}


def layer_chart(doc: dict) -> Optional[dict]:
    layers = doc["layers"]
    if not layers:
        return None
    n = len(layers)
    left, top, w, h = 56, 10, CHART_W - 70, CHART_H - 40
    step = w / max(n - 1, 1)

    def y(v: Optional[float]) -> Optional[float]:
        f = log_fraction(v)
        return None if f is None else round(top + h - f * h, 1)

    lines = []
    for key, label, cls in (("rel_err", "accumulated (the layer's output)", "acc"),
                            ("added_rel_err", "added (B's layer on A's input)", "add")):
        pts = [(round(left + i * step, 1), y(lay.get(key))) for i, lay in enumerate(layers)]
        pts = [(x, yy) for x, yy in pts if yy is not None]
        if pts:
            lines.append({"cls": cls, "label": label, "points": " ".join(f"{x},{yy}" for x, yy in pts),
                          "dots": [{"x": x, "y": yy, "title": f"layer {lay['layer']}: {_fmt(lay.get(key))}"}
                                   for (x, yy), lay in zip(pts, [lay for lay in layers if lay.get(key) is not None])]})
    ticks = [{"y": round(top + h - (k - LOG_LO) / (LOG_HI - LOG_LO) * h, 1), "text": f"1e{k}"}
             for k in range(int(LOG_LO), int(LOG_HI) + 1, 2)]
    xt = [{"x": round(left + i * step, 1), "text": str(lay["layer"])} for i, lay in enumerate(layers)
          if i % max(1, n // 15) == 0]
    tol = y(doc["tolerance"])
    # the axis title sits under the tick labels, inside the drawing (it was cut at the bottom edge)
    return {"width": CHART_W, "height": top + h + 40, "lines": lines, "ticks": ticks, "xticks": xt, "left": left,
            "right": left + w, "top": top, "bottom": top + h, "tolerance": tol, "xlabel_y": top + h + 32}


BAR_LEFT = 56  # the bar charts' left margin: their y axis and its ticks


def kld_chart(doc: dict) -> dict:
    pos = doc["positions"]
    klds = [p.get("kld") for p in pos]
    top = max((k for k in klds if k), default=0.0)
    h = 120
    bars = []
    for i, p in enumerate(pos):
        k = p.get("kld")
        bh = 0.0 if not k or not top else max(1.0, k / top * h)
        differs = p.get("same_top") is False
        tip = f"position {p['position']} {p.get('text', '')!r}: KLD {_fmt(k)}"
        if p.get("top_a"):
            tip += f"; top-1 A {p['top_a'].get('text', '')!r}, B {p['top_b'].get('text', '')!r}"
        if p.get("dp") is not None:
            tip += f"; Δp {p['dp']:+.3g}"
        bars.append({"x": BAR_LEFT + i * BAR_W, "y": round(h - bh, 1), "h": round(bh, 1), "differs": differs,
                     "title": tip, "token": _visible(p.get("text", "")), "decode": p.get("phase") == "decode"})
    ticks = [{"y": round(h - f * h, 1), "text": _fmt(f * top) if top else "0"} for f in (0, 0.5, 1)] if top else \
        [{"y": h, "text": "0"}]
    return {"bars": bars, "width": BAR_LEFT + max(len(pos) * BAR_W, 200), "height": h, "max": _fmt(top), "bw": BAR_W,
            "left": BAR_LEFT, "ticks": ticks}


def _visible(text: str) -> str:
    s = (text or "").replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥") or "∅"
    return s if len(s) <= 10 else s[:9] + "…"


def point_data(doc: dict) -> dict:
    """For the script: each point's per-position errors as bar heights (0..1 on the log scale) and values."""
    out = {}
    entries = [(lay["layer"], p) for lay in doc["layers"] for p in lay["points"]]
    outside = list((doc.get("model_points") or {}).values())  # in forward order: the first has nothing before it
    entries += [(None, p) for p in outside]
    for layer, p in entries:
        pp = p.get("per_position") or {}
        rel = pp.get("rel_err") or []
        # "added by its layer": the error of B's layer on A's input. The first point of the pass (the embedding) has
        # no layer and no input to take from A: what it adds is all its error, so no second bar is drawn for it.
        added = [] if outside and p is outside[0] and layer is None else pp.get("added_rel_err") or []
        out[f"{'model' if layer is None else layer}/{p['point']}"] = {
            "label": f"layer {layer}, {p['point']}" if layer is not None else p["point"],
            "rel": rel, "added": added, "max_abs": pp.get("max_abs") or [], "cos": pp.get("cos") or [],
            "h_rel": [_frac(v) for v in rel], "h_added": [_frac(v) for v in added]}
    return out


def _frac(v: Optional[float]) -> Optional[float]:
    f = log_fraction(v)
    return None if f is None else round(f, 3)


def view(doc: dict) -> dict:
    fd = doc.get("first_divergence")
    from llmtrace.run.compare import summary_line

    chosen = None
    if fd is not None:
        chosen = f"{'model' if fd['layer'] is None else fd['layer']}/{fd['point']}"
    elif doc["layers"]:
        chosen = f"{doc['layers'][-1]['layer']}/resid_post"
    differing = [p for p in doc["positions"] if p.get("same_top") is False]
    return {
        # a diff's sides come from two traces, which say nothing of quantized blocks
        "summary": summary_line(doc), "doc": doc, "a": {"keep_quantized": False} | doc["a"],
        "b": {"keep_quantized": False} | doc["b"],
        "heat": heat_strip(doc) if doc["layers"] and any(lay["points"] for lay in doc["layers"]) else None,
        "layers": layer_chart(doc) if any(lay.get("rel_err") is not None for lay in doc["layers"]) else None,
        "kld": kld_chart(doc), "differing": differing,
        "numbers": [("tolerance", f"{doc['tolerance']:g}"), ("KLD mean", _fmt(doc.get("kld_mean"))),
                    ("KLD max", _fmt(doc.get("kld_max"))),
                    ("same top", "—" if doc.get("same_top") is None else f"{100 * doc['same_top']:.1f}%"),
                    ("mean |Δp|", _fmt(doc.get("dp_mean_abs"))), ("positions", str(len(doc["positions"])))],
        "data": {"points": point_data(doc), "chosen": chosen, "bar": BAR_W, "height": 120, "left": BAR_LEFT,
                 "ticks": [{"f": (k - LOG_LO) / (LOG_HI - LOG_LO), "text": f"1e{k}"}
                           for k in range(int(LOG_LO), int(LOG_HI) + 1, 2)],
                 "positions": [{"position": p["position"], "token": _visible(p.get("text", ""))}
                               for p in doc["positions"]]},
    }


def render_compare_page(doc: dict) -> str:
    import jinja2
    import markupsafe

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
                             autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    script = Path(__file__).with_name("assets").joinpath("compare.js").read_text(encoding="utf-8")
    doc = doc | {"notes": [in_words(note) for note in doc.get("notes", [])]}  # the words of the front end that runs
    return env.get_template("compare.html.j2").render(v=view(doc), script=markupsafe.Markup(script))


def write_compare_page(result_or_doc, path: Union[str, Path]) -> int:
    """Write the page of a CompareResult (or its JSON object) to `path`, atomically; returns its size in bytes."""
    from llmtrace.fsutil import write_text_atomic

    doc = result_or_doc if isinstance(result_or_doc, dict) else result_or_doc.to_json()
    page = render_compare_page(doc)
    write_text_atomic(Path(path), page)
    return len(page.encode("utf-8"))
