"""The terminal view of `llmtrace patch`: a layers × positions heatmap of the recovery, from the `patch` event alone.

Rows are layers and columns the prompt's positions, labelled by the corrupt prompt's tokens (the clean token under it
where they differ). When the positions do not fit the console at 3 characters a cell, the map is transposed: one row per
position, one column per layer (layers binned, by their mean, if even that does not fit).
"""

from __future__ import annotations

from typing import Optional

from rich.console import Console
from rich.text import Text

from llmtrace.render.generate import visible
from llmtrace.units import plural

LABEL = 4  # "L29 "


def _style(recovery: Optional[float]) -> str:
    """Background by recovery: red towards 1 (restores the clean answer), blue below 0, none near 0."""
    if recovery is None:
        return ""
    r = max(-1.0, min(1.0, recovery))
    level = int(40 + 200 * abs(r))
    bg = f"rgb({level},{max(0, 60 - level // 4)},{max(0, 60 - level // 4)})" if r >= 0 else f"rgb(40,{level // 2},{level})"
    return f"{'black' if abs(r) > 0.6 else 'white'} on {bg}"


def _cell(recovery: Optional[float], w: int) -> Text:
    """One cell of w ≥ 3 characters: a space, then the recovery in w − 1 (0.81, .8, or tenths: 8)."""
    if recovery is None:
        return Text("·".rjust(w))
    n = w - 1
    s = f"{recovery:.2f}" if n >= 4 else f"{recovery:.1f}".replace("0.", ".", 1) if n == 3 else f"{round(recovery * 10)}"
    return Text(" ") + Text(s.rjust(n)[-n:], style=_style(recovery))


def render_patch(ev: dict, console: Console) -> None:
    L, T = ev["n_layers"], ev["n_positions"]
    rec = {(c["layer"], c["position"]): c["recovery"] for c in ev["cells"]}
    if ev.get("method") == "attribution":
        console.print(Text(f"attribution patching at {ev['at']}: {plural(L, 'layer')} × {plural(T, 'position')}, "
                           f"estimated from one forward and one backward pass, {ev['seconds']:.1f} s",
                           style="bold cyan"))
    else:
        console.print(Text(f"activation patching at {ev['at']}: {plural(L, 'layer')} × {plural(T, 'position')}, "
                           f"{plural(L * T, 'run')}, "
                           f"{ev['seconds']:.1f} s", style="bold cyan"))
    console.print(Text.assemble(("clean   ", "bold"), repr(ev["clean"])))
    console.print(Text.assemble(("corrupt ", "bold"), repr(ev["corrupt"])))
    a, b = ev["answer"]["text"], ev["against"]["text"]
    console.print(f"m = logit({a!r}) − logit({b!r}), last position: clean {ev['clean_metric']:.3f}, "
                  f"corrupt {ev['corrupt_metric']:.3f}")
    console.print(Text("cell = (m − m_corrupt)/(m_clean − m_corrupt): 1 = the clean run, 0 = no change", style="dim"))
    width = console.width
    w = min(8, (width - LABEL) // T)
    if w >= 3:
        _by_layer(console, ev, rec, L, T, w)
    else:
        _by_position(console, ev, rec, L, T, width)
    best = sorted(ev["cells"], key=lambda c: -(c["recovery"] or 0))[:3]
    if best and best[0]["recovery"] is not None:
        console.print("highest: " + ", ".join(
            f"layer {c['layer']} at {c['position']} ({visible(ev['corrupt_texts'][c['position']]).strip() or '␣'}) "
            f"{c['recovery']:.2f}" for c in best))
    if ev.get("method") == "attribution":
        _attribution_lines(ev, console)


def _attribution_lines(ev: dict, console: Console) -> None:
    """The heads' estimates, and how the estimates agree with the exact patches when they ran (--check)."""
    heads = sorted(ev.get("heads", []), key=lambda h: -abs(h["estimate"]))[:5]
    if heads:
        console.print("heads (patched at every position), largest estimated effect on m: " + ", ".join(
            f"{h['layer']}.h{h['head']} {h['estimate']:+.3f}" for h in heads))
    for grid, what in (("resid", "layer × position"), ("heads", "layer × head")):
        a = (ev.get("agreement") or {}).get(grid)
        if a:
            console.print(f"against the exact patches ({what}, {a['cells']} cells): Pearson r {a['pearson']:.3f}, "
                          f"top {a['top_k']} overlap {a['overlap']}/{a['top_k']}")


def _token(text: str, w: int) -> str:
    t = visible(text)
    return t[:w] if len(t) <= w else t[: w - 1] + "…"


def _by_layer(console: Console, ev: dict, rec: dict, L: int, T: int, w: int) -> None:
    """Layers down, positions across."""
    head = Text(" " * LABEL)
    for p in range(T):
        head.append(_token(ev["corrupt_texts"][p], w - 1).rjust(w), style="bold")
    console.print(head)
    if ev["clean_tokens"] != ev["corrupt_tokens"]:
        sub = Text(" " * LABEL)
        for p in range(T):
            differs = ev["clean_tokens"][p] != ev["corrupt_tokens"][p]
            sub.append((_token(ev["clean_texts"][p], w - 1) if differs else "").rjust(w), style="dim")
        console.print(sub)
    for layer in range(L):
        line = Text(f"L{layer}".ljust(LABEL), style="dim")
        for p in range(T):
            line.append(_cell(rec[(layer, p)], w))
        console.print(line)


def _by_position(console: Console, ev: dict, rec: dict, L: int, T: int, width: int) -> None:
    """Positions down, layers across (binned by their mean when one character a layer does not fit)."""
    label = 12
    n_cols = min(L, max(1, width - label))
    edges = [(round(i * L / n_cols), round((i + 1) * L / n_cols)) for i in range(n_cols)]
    w = max(1, min(3, (width - label) // n_cols))
    console.print(Text(" " * label + "layers " + ("0.." + str(L - 1) if n_cols == L else
                                                  f"0..{L - 1} in {n_cols} bins"), style="bold"))
    for p in range(T):
        line = Text(f"{p:>3} {_token(ev['corrupt_texts'][p], label - 5):<{label - 4}}", style="bold")
        for lo, hi in edges:
            vals = [rec[(layer, p)] for layer in range(lo, hi) if rec[(layer, p)] is not None]
            r = sum(vals) / len(vals) if vals else None
            line.append(" " * w, style=_style(r))
        console.print(line)
