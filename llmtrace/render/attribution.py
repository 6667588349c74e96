"""The terminal view of `llmtrace attribute`: the parts of largest contribution as bars, from the `attribute` event
alone (run/attribution.py)."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from llmtrace.render.generate import visible

BAR = 24  # characters of the longest bar


def render_attribution(ev: dict, console: Console, top: int = 12) -> None:
    t, a = ev["target"], ev["against"]
    what = f"logit({t['text']!r})" + (f" − logit({a['text']!r})" if a else "")
    token = visible(ev["tokens"][ev["position"]])
    console.print(Text(f"direct logit attribution of {what} at position {ev['position']} ({token!r})",
                       style="bold cyan"))
    console.print(f"logit {ev['logit']:.4f} = Σ {len(ev['parts'])} parts {ev['total']:.4f}")
    for note in ev["notes"]:
        console.print(Text(note, style="dim"))
    parts = sorted(ev["parts"], key=lambda p: -abs(p["value"]))[:top]
    if not parts:
        return
    big = max(abs(p["value"]) for p in parts) or 1.0
    name_w = max(len(p["name"]) for p in parts)
    for p in parts:
        n = max(1, round(BAR * abs(p["value"]) / big))
        style = "green" if p["value"] >= 0 else "red"
        console.print(Text.assemble(f"{p['name']:<{name_w}} {p['value']:+9.4f} ", ("█" * n, style),
                                    (f" {p['kind']}", "dim")))
    rest = len(ev["parts"]) - len(parts)
    if rest > 0:
        shown = sum(p["value"] for p in parts)
        console.print(Text(f"… {rest} more parts, together {ev['total'] - shown:+.4f}", style="dim"))
