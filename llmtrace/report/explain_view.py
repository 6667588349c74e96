"""Everything the terminal `explain` prints, for the explain page: its own renderer (render/explain.py) run on a
console that keeps what it is given instead of drawing it, each table made an HTML table and each line a paragraph.

    render_explain(events, Blocks())  ->  [{"kind": "title" | "text" | "note" | "table", ...}, ...]

One renderer serves both, so the page holds every table, figure and note of the terminal, in the same order, with
the same numbers; the browser lays them out. Colours (the attention shades, the lens's probabilities) come through
as each segment's colour; text is escaped by the template like any other. The page's language is the renderer's:
it says every line from its catalogue (render.say), so a Chinese page is Chinese because each line was said in
Chinese, not translated after the fact; a segment the renderer printed as it is (a formula, a token, a name) is
marked "verbatim".
"""

from __future__ import annotations

from typing import Any, Optional

from rich.console import Console
from rich.style import Style
from rich.table import Table
from rich.text import Text

from llmtrace.render.say import Say
from llmtrace.trace.events import Section


def _segments(t: Any) -> list[dict]:
    """A cell or a line as [{"text", "colour" (#rrggbb or None), "bold", "verbatim"}], from a rich Text's spans
    (verbatim: a formula, a token or a name, render.say.verbatim)."""
    if not isinstance(t, Text):
        return [{"text": str(t), "colour": None, "bold": False, "verbatim": False}]
    out, plain = [], t.plain
    cuts = sorted({0, len(plain)} | {s.start for s in t.spans} | {s.end for s in t.spans})
    base = t.style if not isinstance(t.style, str) or t.style else None
    for a, b in zip(cuts, cuts[1:]):
        if a >= b:
            continue
        styles = [base] + [s.style for s in t.spans if s.start <= a and b <= s.end]
        colour, bold, kept = None, False, False
        for st in styles:
            if not st:
                continue
            style = Style.parse(st) if isinstance(st, str) else st
            if style.color is not None and not style.color.is_default:
                colour = style.color.get_truecolor().hex
            bold = bold or bool(style.bold)
            kept = kept or bool(style.meta.get("verbatim"))
        out.append({"text": plain[a:b], "colour": colour, "bold": bold, "verbatim": kept})
    return out


def _table(t: Table) -> list[dict]:
    """A rich Table as blocks: a table with headers as one table block; a grid (no headers) of nested tables as its
    tables in order."""
    cells = [list(c._cells) for c in t.columns]
    if not t.show_header and any(isinstance(x, Table) for col in cells for x in col):
        return [b for col in cells for x in col for b in (_table(x) if isinstance(x, Table) else [])]
    rows = [[_segments(cells[c][r]) for c in range(len(cells))] for r in range(t.row_count)]
    title = t.title.plain if isinstance(t.title, Text) else t.title
    header = [c.header.plain if isinstance(c.header, Text) else str(c.header) for c in t.columns] if t.show_header else None
    return [{"kind": "table", "title": title or None, "header": header,
             "right": [c.justify == "right" for c in t.columns], "rows": rows}]


class Blocks(Console):
    """A console that keeps what it is asked to print as blocks (see the module's docstring)."""

    def __init__(self):
        super().__init__(width=200, record=False, color_system="truecolor", force_terminal=False)
        self.blocks: list[dict] = []

    def print(self, *objects: Any, style: Any = None, **_: Any) -> None:  # noqa: A003 (rich's own name)
        if not objects:
            return
        for obj in objects:
            if isinstance(obj, Table):
                self.blocks.extend(_table(obj))
                continue
            text = obj if isinstance(obj, Text) else Text(str(obj), style=style or "")
            kind = "title" if "bold cyan" in str(text.style) else "note" if str(text.style) == "dim" else "text"
            role = text.style.meta.get("role") if isinstance(text.style, Style) else None
            self.blocks.append({"kind": kind, "segments": _segments(text)} | ({"role": role} if role else {}))


def explain_blocks(events: list[dict], lang: str = "en") -> list[dict]:
    """The terminal explain's output as blocks, from the trace's events, said in the page's language (the renderer's
    catalogue, render.say; the formulas the model declares in that language: `localized`): the attention map's text
    art made a grid (attention_grid)."""
    from llmtrace.render.explain import render_explain

    console, say = Blocks(), Say(lang)
    render_explain(localized(events, lang), console, say)
    steps = next((e for e in events if e.get("event") == "explain" and e.get("section") == Section.STEPS), None)
    columns = [say("explain.col.point"), say("explain.col.op")]
    table = next((b for b in console.blocks if b["kind"] == "table" and (b["header"] or [])[:2] == columns), None)
    if steps is not None and table is not None and len(table["rows"]) == len(steps["steps"]):
        # each step's row carries its point, its declared operation and its check, for a reader or a test
        table["row_attrs"] = [{"point": r["point"], "op": r["op"], "layer": steps["layer"]}
                              | ({"max-error": r["check"]["max_abs"], "max-rel": r["check"]["max_rel"]}
                                 if r["check"] else {}) for r in steps["steps"]]
    return with_grid(console.blocks, next((e for e in events if e.get("event") == "explain"
                                           and e.get("section") == Section.ATTENTION_MAP), None), events)


def said_changes(e: dict, lang: str) -> dict:
    """The model section's "what it changes" lines from its family's words in `lang` (model.family.said_in, by each
    line's recorded key and arguments), as the page's run table says them; a line without words stays as recorded."""
    m = e.get("model") if e.get("event") == "explain" and e.get("section") == Section.MODEL else None
    if not m or not m.get("changes_said"):
        return e
    from llmtrace.model.family import said_in

    said = m["changes_said"]
    lines = [(said_in(m.get("family"), said[i], lang) if i < len(said) and said[i] else None) or line
             for i, line in enumerate(m.get("changes") or [])]
    return dict(e, model=dict(m, changes=lines))


def localized(events: list[dict], lang: str) -> list[dict]:
    """The events with each formula the model's declaration makes said in the page's language (model.maths.formula
    with the catalogue's "maths." words): the steps' table, the norms, RoPE and the GLU."""
    if lang == "en":
        return events
    from llmtrace.model.llama_points import ATTENTION_LINE, Q_ROPE
    from llmtrace.model.maths import Maths, formula
    from llmtrace.model.moe_points import ROUTER_LINE
    from llmtrace.report.i18n import Words

    events = [said_changes(e, lang) for e in events]
    head = next((e for e in events if e.get("event") == "explain" and e.get("section") == Section.MODEL), None)
    maths = Maths.from_record((head or {}).get("maths"))
    words = Words(lang).maths
    if maths is None or not words:
        return events

    def said(layer: int, name: str, text: str) -> str:
        o = maths.op(layer, name)
        return text if o is None else formula(o, name, layer, maths, words)

    def line(layer: int, names) -> str:
        """The points explain's one line says (declared in model: ATTENTION_LINE, ROUTER_LINE), joined."""
        return " ｜ ".join(formula(maths.op(layer, n), n, layer, maths, words) for n in names
                          if maths.op(layer, n) is not None)

    out = []
    for e in events:
        sec = e.get("section") if e.get("event") == "explain" else None
        if sec == Section.STEPS:
            e = dict(e, steps=[dict(r, formula=said(e["layer"], r["point"], r["formula"])) for r in e["steps"]])
        elif sec == Section.ATTENTION:  # the declared scores, softmax and P·V, as explain joins them
            e = dict(e, formula=line(e["layer"], ATTENTION_LINE))
        elif sec == Section.ROUTER and e.get("layer") is not None:  # the declared choice rule, GLU and weighted sum
            if maths.op(e["layer"], ROUTER_LINE[0]) is not None:
                e = dict(e, formula=line(e["layer"], ROUTER_LINE))
        elif sec == Section.STATE_CACHE:  # each carried state's update, as its declared operation says it
            e = dict(e, updates={n: said(e["layer"], n, text) for n, text in (e.get("updates") or {}).items()})
        elif sec == Section.RMSNORM:
            e = dict(e, formula=said(e["layer"], e["norm"], e["formula"]))
        elif sec == Section.ROPE:  # q's rotation, as explain's section says it
            e = dict(e, formula=said(e["layer"], Q_ROPE.name, e["formula"]))
        out.append(e)
    return out


def with_grid(blocks: list[dict], amap: Optional[dict], events: list[dict]) -> list[dict]:
    """The blocks with the attention map's lines (a header of key labels, a line per query bin, the legend) replaced
    by one grid block: a real table, each column a key under its own label."""
    if amap is None:
        return blocks
    start = next((i for i, b in enumerate(blocks) if b.get("role") == "attention_map"), None)
    if start is None:
        return blocks
    tokens = next((e.get("tokens") for e in events if e.get("event") == "tokens"), None) or []
    head = start + 1
    while head < len(blocks) and blocks[head]["kind"] == "note":  # a sliding window's notes stay; then the key labels
        head += 1
    return blocks[:head] + [attention_grid(amap, tokens)] + blocks[head + 2 + len(amap["bins"]):]


def attention_grid(amap: dict, tokens: list) -> dict:
    """The explain attention map as a grid: rows are query bins, columns key bins, a cell coloured by its weight (the
    palette of the page) with the weight as its title; masked cells (a key after every query of its row, or out of a
    sliding window) are blank and say so."""
    from llmtrace.report.page import colour, ink, visible

    bins, window = amap["bins"], amap.get("window")

    def label(lo: int, hi: int) -> str:
        if hi - lo > 1:
            return f"{lo}–{hi - 1}"
        t = tokens[lo] if lo < len(tokens) else None
        text = t.get("text", "") if isinstance(t, dict) else (t or "")
        return f"{lo} {visible(text)[:8]}"

    rows = []
    for i, (lo, hi) in enumerate(bins):
        cells = []
        for j, (klo, khi) in enumerate(bins):
            v = amap["matrix"][i][j]
            if klo > hi - 1:
                cells.append({"masked": "future"})
            elif window and khi - 1 <= lo - window:
                cells.append({"masked": "window"})
            else:
                x = None if v is None else max(0.0, min(1.0, v))
                cells.append({"bg": colour(x), "fg": ink(x), "p": "—" if v is None else f"{v:.2f}"})
        rows.append({"label": label(lo, hi), "cells": cells})
    return {"kind": "grid", "columns": [str(lo) for lo, _ in bins], "rows": rows, "window": bool(window)}
