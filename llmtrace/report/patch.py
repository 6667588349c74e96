"""The HTML view of `llmtrace patch`: the sweep's heatmap as one self-contained page (a jinja2 template shipped in
templates/, autoescaped; no script, nothing loaded from the network)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from llmtrace.report.page import colour, ink, visible


def two_places(x: float) -> str:
    """x to two decimals, never "-0.00": a value that rounds to zero is 0.00, whatever its sign."""
    r = round(x, 2)
    return f"{0.0 if r == 0 else r:.2f}"


def _cell(recovery: Optional[float]) -> dict:
    x = None if recovery is None else max(0.0, min(1.0, recovery))  # the palette's 0..1; below 0 shows as 0
    return {"bg": colour(x), "fg": ink(x), "label": "·" if recovery is None else two_places(recovery)}


def patch_page(ev: dict, lang: str = "en") -> str:
    """The page's HTML, from the `patch` event (llmtrace.run.patching.patch_sweep), its words in `lang`."""
    import jinja2

    from llmtrace.report.i18n import Words

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string((Path(__file__).with_name("templates") / "patch.html.j2").read_text(encoding="utf-8"))
    rec = {(c["layer"], c["position"]): c for c in ev["cells"]}
    columns = [{"corrupt": visible(ev["corrupt_texts"][p]),  # ▁ for a space, as in the terminal
                "clean": visible(ev["clean_texts"][p]) if ev["clean_tokens"][p] != ev["corrupt_tokens"][p] else ""}
               for p in range(ev["n_positions"])]
    rows = [{"layer": layer, "cells": [dict(_cell(rec[(layer, p)]["recovery"]), position=p,
                                            metric=rec[(layer, p)]["metric"]) for p in range(ev["n_positions"])]}
            for layer in range(ev["n_layers"])]
    legend = [_cell(v) for v in (0.0, 0.25, 0.5, 0.75, 1.0)]
    return template.render(ev=ev, columns=columns, rows=rows, legend=legend, w=Words(lang))


def write_patch_html(ev: dict, target, lang: str = "en") -> int:
    """Write the page to `target`, whole or not at all; its size in bytes."""
    from llmtrace.fsutil import write_text_atomic

    html = patch_page(ev, lang)
    write_text_atomic(Path(target), html)
    return len(html.encode("utf-8"))
