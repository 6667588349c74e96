"""Everything the terminal `explain` prints, for the explain page: its own renderer (render/explain.py) run on a
console that keeps what it is given instead of drawing it, each table made an HTML table and each line a paragraph.

    render_explain(events, Blocks())  ->  [{"kind": "title" | "text" | "note" | "table", ...}, ...]

One renderer serves both, so the page holds every table, figure and note of the terminal, in the same order, with
the same numbers; the browser lays them out. Colours (the attention shades, the lens's probabilities) come through
as each segment's colour; text is escaped by the template like any other.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _segments(t: Any) -> list[dict]:
    """A cell or a line as [{"text", "colour" (#rrggbb or None), "bold"}], from a rich Text's spans."""
    if not isinstance(t, Text):
        return [{"text": str(t), "colour": None, "bold": False}]
    out, plain = [], t.plain
    cuts = sorted({0, len(plain)} | {s.start for s in t.spans} | {s.end for s in t.spans})
    base = t.style if not isinstance(t.style, str) or t.style else None
    for a, b in zip(cuts, cuts[1:]):
        if a >= b:
            continue
        styles = [base] + [s.style for s in t.spans if s.start <= a and b <= s.end]
        colour, bold = None, False
        for st in styles:
            if not st:
                continue
            from rich.style import Style

            style = Style.parse(st) if isinstance(st, str) else st
            if style.color is not None and not style.color.is_default:
                colour = style.color.get_truecolor().hex
            bold = bold or bool(style.bold)
        out.append({"text": plain[a:b], "colour": colour, "bold": bold})
    return out


def _table(t: Table) -> list[dict]:
    """A rich Table as blocks: a table with headers as one table block; a grid (no headers) of nested tables as its
    tables in order."""
    cells = [list(c._cells) for c in t.columns]
    if not t.show_header and any(isinstance(x, Table) for col in cells for x in col):
        return [b for col in cells for x in col for b in (_table(x) if isinstance(x, Table) else [])]
    rows = [[_segments(cells[c][r]) for c in range(len(cells))] for r in range(t.row_count)]
    title = t.title.plain if isinstance(t.title, Text) else t.title
    header = [str(c.header) for c in t.columns] if t.show_header else None
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
            self.blocks.append({"kind": kind, "segments": _segments(text)})


def explain_blocks(events: list[dict]) -> list[dict]:
    """The terminal explain's output as blocks, from the trace's events."""
    from llmtrace.render.explain import render_explain

    console = Blocks()
    render_explain(events, console)
    steps = next((e for e in events if e.get("event") == "explain" and e.get("section") == "steps"), None)
    table = next((b for b in console.blocks if b["kind"] == "table" and (b["header"] or [])[:2] == ["point", "op"]),
                 None)
    if steps is not None and table is not None and len(table["rows"]) == len(steps["steps"]):
        # each step's row carries its point, its declared operation and its check, for a reader or a test
        table["row_attrs"] = [{"point": r["point"], "op": r["op"], "layer": steps["layer"]}
                              | ({"max-error": r["check"]["max_abs"], "max-rel": r["check"]["max_rel"]}
                                 if r["check"] else {}) for r in steps["steps"]]
    return console.blocks
