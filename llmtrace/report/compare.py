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
import re
from pathlib import Path
from typing import Optional, Union

from llmtrace.report.page import colour
from llmtrace.words import in_words

LOG_LO, LOG_HI = -9.0, -1.0  # the colour and chart scale: relative errors from 1e-9 to at least 1e-1 (scale_of)
CELL_W, CELL_H = 22, 15
LABEL_W = 78
CHART_W, CHART_H = 720, 200
BAR_W = 16


def scale_of(doc: dict) -> tuple[float, float]:
    """The log scale of a comparison's errors: 1e-9 up to the largest error it has, at least 1e-1 (a relative error
    of 1.2 is drawn at 1.2, not clamped at the top)."""
    xs = [lay.get(k) for lay in doc["layers"] for k in ("rel_err", "added_rel_err")]
    xs += [p.get(k) for lay in doc["layers"] for p in lay["points"] for k in ("max_rel_err", "rel_err")]
    xs += [v for lay in doc["layers"] for p in lay["points"] for v in (p.get("per_position") or {}).get("rel_err") or []]
    xs += [p.get("max_rel_err") for p in (doc.get("model_points") or {}).values() if p]
    top = max((x for x in xs if x is not None and x > 0), default=0.0)
    return LOG_LO, max(LOG_HI, float(math.ceil(math.log10(top)))) if top > 0 else LOG_HI


def log_fraction(x: Optional[float], sc: tuple[float, float] = (LOG_LO, LOG_HI)) -> Optional[float]:
    """Where x sits on the page's log scale [1e-9, its top], as 0..1; None for a missing value, 0 for an exact zero."""
    if x is None:
        return None
    if x <= 0:
        return 0.0
    lo, hi = sc
    return min(1.0, max(0.0, (math.log10(x) - lo) / (hi - lo)))


def cell_colour(x: Optional[float], sc: tuple[float, float] = (LOG_LO, LOG_HI)) -> str:
    if x is None:
        return "#ffffff"
    if x == 0:
        return "#e4e4e4"
    return colour(log_fraction(x, sc))


def _fmt(x: Optional[float]) -> str:
    """3 significant figures, the exponent without padding: 1.30e-3, 0.18 → 1.80e-1."""
    if x is None:
        return "—"
    if x == 0:
        return "0"
    m, _, ex = f"{x:.2e}".partition("e")
    return f"{m}e{int(ex)}"


def _tick(x: float) -> str:
    """A tick's label, short enough for the axis: 0.0013 → 1.3e-3, 0.5 → 0.5, 12 → 12."""
    if x == 0:
        return "0"
    if 0.01 <= abs(x) < 1000:
        return f"{x:.3g}"
    m, _, ex = f"{x:.1e}".partition("e")
    return f"{m.rstrip('0').rstrip('.')}e{int(ex)}"


def log_ticks(sc: tuple[float, float]) -> list[int]:
    """The powers of ten labelled on the log axis: every other one from 1e-9, and the top."""
    lo, hi = int(sc[0]), int(sc[1])
    ks = list(range(lo, hi + 1, 2))
    return ks if ks[-1] == hi else ks + [hi]


def heat_strip(doc: dict, sc: tuple[float, float], w) -> dict:
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
            cells.append({"x": x, "y": y, "fill": cell_colour(v, sc), "layer": lay["layer"], "point": name,
                          "title": w("cmp.cell_title", layer=lay["layer"], point=name, err=_fmt(v),
                                     position=p["position"], all=_fmt(p["rel_err"]),
                                     added=_fmt(p.get("added_rel_err")))})
            if fd.get("layer") == lay["layer"] and fd.get("point") == name:
                mark = {"x": x - 1, "y": y - 1}
    labels = [{"x": LABEL_W - 6, "y": 20 + r * CELL_H + CELL_H - 4, "text": n} for r, n in enumerate(points)]
    cols = [{"x": LABEL_W + c * CELL_W + CELL_W / 2, "text": str(lay["layer"])} for c, lay in enumerate(layers)
            if c % (1 if len(layers) <= 32 else 2) == 0]
    width = LABEL_W + len(layers) * CELL_W + 10
    height = 20 + len(points) * CELL_H + 8
    span = int(sc[1] - sc[0])
    legend = [{"x": i * 40, "fill": colour(i / span), "text": f"1e{int(sc[0]) + i}"} for i in range(span + 1)]
    model = []
    for i, (name, p) in enumerate((doc.get("model_points") or {}).items()):  # in forward order
        if p is not None:
            model.append({"x": 90 + i * 120, "fill": cell_colour(p["max_rel_err"], sc), "name": name, "point": name,
                          "title": w("cmp.model_title", point=name, err=_fmt(p["max_rel_err"]),
                                     added=_fmt(p.get("added_rel_err"))),
                          "marked": fd.get("layer") is None and fd.get("point") == name})
    return {"cells": cells, "mark": mark, "labels": labels, "cols": cols, "width": width, "height": height,
            "cw": CELL_W, "ch": CELL_H, "legend": legend, "legend_w": 60 + 40 * (span + 1), "model": model,
            "model_w": max(90 + 120 * len(model), 60 + 40 * (span + 1))}


def layer_chart(doc: dict, sc: tuple[float, float], w) -> Optional[dict]:
    layers = doc["layers"]
    if not layers:
        return None
    n = len(layers)
    left, top, width, h = 56, 10, CHART_W - 70, CHART_H - 40
    step = width / max(n - 1, 1)

    def y(v: Optional[float]) -> Optional[float]:
        f = log_fraction(v, sc)
        return None if f is None else round(top + h - f * h, 1)

    lines = []
    for key, label, cls in (("rel_err", w("cmp.acc_label"), "acc"), ("added_rel_err", w("cmp.add_label"), "add")):
        pts = [(round(left + i * step, 1), y(lay.get(key))) for i, lay in enumerate(layers)]
        pts = [(x, yy) for x, yy in pts if yy is not None]
        if pts:
            lines.append({"cls": cls, "label": label, "points": " ".join(f"{x},{yy}" for x, yy in pts),
                          "dots": [{"x": x, "y": yy, "title": w("cmp.layer_dot", layer=lay["layer"],
                                                                 err=_fmt(lay.get(key)))}
                                   for (x, yy), lay in zip(pts, [lay for lay in layers if lay.get(key) is not None])]})
    ticks = [{"y": round(top + h - (k - sc[0]) / (sc[1] - sc[0]) * h, 1), "text": f"1e{k}"} for k in log_ticks(sc)]
    xt = [{"x": round(left + i * step, 1), "text": str(lay["layer"])} for i, lay in enumerate(layers)
          if i % max(1, n // 15) == 0]
    tol = y(doc["tolerance"])
    # the axis title sits under the tick labels, inside the drawing (it was cut at the bottom edge)
    return {"width": CHART_W, "height": top + h + 40, "lines": lines, "ticks": ticks, "xticks": xt, "left": left,
            "right": left + width, "top": top, "bottom": top + h, "tolerance": tol, "xlabel_y": top + h + 32}


BAR_LEFT = 56  # the bar charts' left margin: their y axis and its ticks (labels of at most 7 characters: _tick)


def kld_chart(doc: dict, w) -> dict:
    from llmtrace.report.page import nice_step

    pos = doc["positions"]
    klds = [p.get("kld") for p in pos]
    top = max((k for k in klds if k), default=0.0)
    h = 120
    step = nice_step(top, n=2) if top else 1.0
    y1 = math.ceil(top / step) * step if top else 1.0  # the axis reaches a round value at or over the tallest bar
    bars = []
    for i, p in enumerate(pos):
        k = p.get("kld")
        bh = 0.0 if not k or not top else max(1.0, k / y1 * h)
        differs = p.get("same_top") is False
        tip = w("cmp.kld_tip", position=p["position"], text=repr(p.get("text", "")), kld=_fmt(k))
        if p.get("top_a"):
            tip += w("cmp.kld_tip_top", a=repr(p["top_a"].get("text", "")), b=repr(p["top_b"].get("text", "")))
        if p.get("dp") is not None:
            tip += f"; Δp {p['dp']:+.3g}"
        bars.append({"x": BAR_LEFT + i * BAR_W, "y": round(h - bh, 1), "h": round(bh, 1), "differs": differs,
                     "title": tip, "token": _visible(p.get("text", "")), "decode": p.get("phase") == "decode"})
    ticks = [{"y": round(h - i * step / y1 * h, 1), "text": _tick(i * step)} for i in range(round(y1 / step) + 1)] \
        if top else [{"y": h, "text": "0"}]
    return {"bars": bars, "width": BAR_LEFT + max(len(pos) * BAR_W, 200), "height": h, "max": _fmt(top), "bw": BAR_W,
            "left": BAR_LEFT, "ticks": ticks}


def _visible(text: str) -> str:
    s = (text or "").replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥") or "∅"
    return s if len(s) <= 10 else s[:9] + "…"


def point_data(doc: dict, sc: tuple[float, float], w) -> dict:
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
            "label": w("cmp.point_label", layer=layer, point=p["point"]) if layer is not None else p["point"],
            "rel": rel, "added": added, "max_abs": pp.get("max_abs") or [], "cos": pp.get("cos") or [],
            "h_rel": [_frac(v, sc) for v in rel], "h_added": [_frac(v, sc) for v in added]}
    return out


def _frac(v: Optional[float], sc: tuple[float, float]) -> Optional[float]:
    f = log_fraction(v, sc)
    return None if f is None else round(f, 3)


def side_words(side: dict, w) -> dict:
    """What one side is, in the page's words: its model, dtype, device, and how it ran (the exact path or --fast,
    quantized blocks, the interventions it applied, e.g. "ablate 0.attn")."""
    how = [w("cmp.fast") if side.get("exact") is False else w("cmp.exact")]
    if side.get("keep_quantized"):
        how.append(w("cmp.quantized"))
    if side.get("trace"):
        how.append(f"trace {side['trace']}")
    ivs = [iv.get("label") or f'{iv.get("kind")} {iv.get("spec")}' for iv in side.get("interventions") or []]
    return {"model": side.get("model", "?"), "dtype": side.get("dtype", "?"), "device": side.get("device", "?"),
            "how": w("list.sep").join(how), "interventions": "; ".join(ivs) or w("cmp.no_intervention")}


def summary_words(doc: dict, w) -> str:
    """The answer in one line in the page's language (run.compare.summary_line is the terminal's, in English)."""
    from llmtrace.run.compare import summary_line

    if w.lang == "en":
        return summary_line(doc)
    fd = doc["first_divergence"]
    tol = f"{doc['tolerance']:g}"
    before = doc.get("max_rel_err_before") or 0.0
    if fd is None:
        return w("cmp.agree", tol=tol, worst=w("cmp.identical") if before == 0 else _fmt(before))
    if fd.get("position") is None:
        place = w("cmp.at_step", step=fd.get("step", 0))
    else:
        place = w("cmp.at_position", position=fd["position"]) + (
            "" if fd.get("prompt") is None else w("cmp.of_prompt", prompt=fd["prompt"]))
    where = w("run.v.layer", layer=fd["layer"]) + " " if fd["layer"] is not None else ""
    rest = w("cmp.before_same") if before == 0 else w("cmp.before_within", err=_fmt(before))
    return w("cmp.part", where=where, point=fd["point"], step=fd.get("seed_step") or "", place=place,
             err=_fmt(fd["rel_err"]), rest=rest)


NOTES = [(re.compile(p), key) for p, key in (  # the notes of run/compare.py and run/diff.py, said in the page's words;
    # what to run is carried over as the note says it (a flag from the CLI, a keyword from Python)
    (r"^B's tokenizer reads the prompt differently; both sides were fed A's ids \((?P<how>.*)\)$", "cmp.note_ids"),
    (r"^the generated tokens part at step (?P<step>\d+); later steps read different inputs and are compared only by "
     r"what they chose$", "cmp.note_gen"),
    (r"^only (?P<side>[AB]) saved its tensors; comparing what the traces hold$", "cmp.note_one_side"),
    (r"^(?P<n>\d+) of (?P<of>\d+) layers were not recorded by both runs \((?P<spans>.*)\): the first divergence is "
     r"the first among the recorded points$", "cmp.note_unrecorded"),
    (r"^no logits were saved \(record them with (?P<how>.*)\); KLD is not known$", "cmp.note_logits"),
    (r"^no tensors: the first divergence is judged from each point's norm \(a lower bound of its relative error\); "
     r"KLD needs the full logits \((?P<how>.*)\)$", "cmp.note_norms"),
)]


def note_words(note: str, w) -> str:
    """A note of the comparison in the page's words; one no pattern knows stays as the terminal says it."""
    for pattern, key in NOTES:
        m = pattern.match(note)
        if m:
            return w(key, **m.groupdict())
    return note


def view(doc: dict, w=None) -> dict:
    from llmtrace.report.i18n import Words

    w = w or Words("en")
    sc = scale_of(doc)
    fd = doc.get("first_divergence")
    chosen = None
    if fd is not None:
        chosen = f"{'model' if fd['layer'] is None else fd['layer']}/{fd['point']}"
    elif doc["layers"]:
        chosen = f"{doc['layers'][-1]['layer']}/resid_post"
    differing = [p for p in doc["positions"] if p.get("same_top") is False]
    return {
        # a diff's sides come from two traces, which say nothing of quantized blocks
        "summary": summary_words(doc, w), "doc": doc, "a": side_words(doc["a"], w), "b": side_words(doc["b"], w),
        "heat": heat_strip(doc, sc, w) if doc["layers"] and any(lay["points"] for lay in doc["layers"]) else None,
        "layers": layer_chart(doc, sc, w) if any(lay.get("rel_err") is not None for lay in doc["layers"]) else None,
        "kld": kld_chart(doc, w), "differing": differing, "top": f"1e{int(sc[1])}",
        "notes": [note_words(n, w) for n in doc.get("notes") or []],
        "numbers": [(w("cmp.n_tolerance"), f"{doc['tolerance']:g}"), (w("cmp.n_kld_mean"), _fmt(doc.get("kld_mean"))),
                    (w("cmp.n_kld_max"), _fmt(doc.get("kld_max"))),
                    (w("cmp.n_same_top"), "—" if doc.get("same_top") is None else f"{100 * doc['same_top']:.1f}%"),
                    (w("cmp.n_dp"), _fmt(doc.get("dp_mean_abs"))), (w("cmp.n_positions"), str(len(doc["positions"])))],
        "data": {"points": point_data(doc, sc, w), "chosen": chosen, "bar": BAR_W, "height": 120, "left": BAR_LEFT,
                 "ticks": [{"f": (k - sc[0]) / (sc[1] - sc[0]), "text": f"1e{k}"} for k in log_ticks(sc)],
                 "words": w.js,
                 "positions": [{"position": p["position"], "token": _visible(p.get("text", ""))}
                               for p in doc["positions"]]},
    }


def render_compare_page(doc: dict, lang: str = "en") -> str:
    import jinja2
    import markupsafe

    from llmtrace.report.i18n import Words

    w = Words(lang)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
                             autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    script = Path(__file__).with_name("assets").joinpath("compare.js").read_text(encoding="utf-8")
    doc = doc | {"notes": [in_words(note) for note in doc.get("notes", [])]}  # the words of the front end that runs
    return env.get_template("compare.html.j2").render(v=view(doc, w), w=w, script=markupsafe.Markup(script))


def write_compare_page(result_or_doc, path: Union[str, Path], lang: str = "en") -> int:
    """Write the page of a CompareResult (or its JSON object) to `path`, atomically; returns its size in bytes."""
    from llmtrace.fsutil import write_text_atomic

    doc = result_or_doc if isinstance(result_or_doc, dict) else result_or_doc.to_json()
    page = render_compare_page(doc, lang)
    write_text_atomic(Path(path), page)
    return len(page.encode("utf-8"))
