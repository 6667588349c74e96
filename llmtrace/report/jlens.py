"""The HTML view of `llmtrace lens PROMPT --jacobian FILE --html PAGE`: the Jacobian lens beside the logit lens, one
layer × position table each, every cell the top-1 token and its probability (its top-k in the cell's title), with
what the lens was fitted on. Built from the `jlens` event alone (the one `--json` writes): one self-contained page, a
jinja2 template shipped in templates/, autoescaped, no script, nothing loaded from the network. English only."""

from __future__ import annotations

from pathlib import Path

from llmtrace.report.page import colour, ink, visible


def prob(p: float) -> str:
    return f"{p:.2f}" if p >= 0.005 else f"{p:.0e}"


def _table(ev: dict, key: str) -> list[dict]:
    """The rows of one lens: {layer, cells: [{pos, text, id, p, label, bg, fg, tip}]}."""
    by = {(c["layer"], c["position"]): c[key] for c in ev["cells"]}
    rows = []
    for layer in range(ev["n_layers"]):
        cells = []
        for pos in range(len(ev["tokens"])):
            top = by[(layer, pos)]
            t = top[0]
            cells.append({"pos": pos, "text": visible(t["text"]), "id": t["id"], "p": t["p"], "label": prob(t["p"]),
                          "bg": colour(t["p"]), "fg": ink(t["p"]),
                          "tip": " · ".join(f'{visible(c["text"])} {c["p"]:.3g}' for c in top)})
        rows.append({"layer": layer, "cells": cells})
    return rows


def _fit(info: dict) -> list[tuple[str, str]]:
    """What the lens file says of its fit, as (what, value) lines."""
    if info.get("format") == "jlens":  # the reference package's file: what it keeps, and its own metadata if any
        lines = [("format", "jlens (anthropics/jacobian-lens, torch.save), read without unpickling"),
                 ("width", str(info.get("d_model"))), ("prompts averaged", str(info.get("n_prompts"))),
                 ("layers", f'{len(info.get("source_layers", []))} (the last layer\'s J is I)')]
        return lines + [(str(k), str(v)) for k, v in (info.get("metadata") or {}).items()]
    return [("format", str(info.get("format"))), ("fitted on", str(info.get("model"))),
            ("corpus tokens", f'{info.get("positions", 0):,}'), ("ctx", str(info.get("ctx"))),
            ("chunks", str(info.get("chunks"))), ("text sha256", str(info.get("text_sha256", ""))[:16] + "…"),
            ("layers × width", f'{info.get("layers")} × {info.get("d_model")}')]


def jlens_page(ev: dict) -> str:
    """The page's HTML, from the `jlens` event (cli/jlens.py's readout_command)."""
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string((Path(__file__).with_name("templates") / "jlens.html.j2").read_text(encoding="utf-8"))
    jl, ll = _table(ev, "top"), _table(ev, "logit_lens")
    same = sum(a["id"] == b["id"] for ra, rb in zip(jl, ll) for a, b in zip(ra["cells"], rb["cells"]))
    columns = [{"pos": p, "token": visible(t)} for p, t in enumerate(ev["tokens"])]
    legend = [{"label": f"{v:.2f}", "bg": colour(v), "fg": ink(v)} for v in (0.0, 0.25, 0.5, 0.75, 1.0)]
    return template.render(ev=ev, columns=columns, lenses=[("jlens", jl), ("logit", ll)], fit=_fit(ev["fit"]),
                           same=same, cells=len(ev["cells"]), legend=legend)


def write_jlens_html(ev: dict, target) -> int:
    """Write the page to `target`, whole or not at all; its size in bytes."""
    from llmtrace.fsutil import write_text_atomic

    html = jlens_page(ev)
    write_text_atomic(Path(target), html)
    return len(html.encode("utf-8"))
