"""The terminal view of a comparison (`llmtrace compare`, `llmtrace diff`), drawn from its JSON object alone.

    first line      where the runs part (or that they agree), the answer to the question
    the sides       model, dtype, device of A and B; positions and tolerance
    the matrix      layers x points, each cell the decade of the largest relative error at any position, shaded on
                    a log scale; then each layer's accumulated and added error (its output, resid_post)
    the answers     KLD mean/max, same top, mean |dp|; the positions whose top-1 differs, with both tokens

The matrix is 4 + 3 x 17 + 18 = 73 columns wide, so it fits 80.
"""

from __future__ import annotations

import math
from typing import Optional

from rich.console import Console
from rich.text import Text

from llmtrace.model.llama_points import LAST
from llmtrace.render.generate import visible
from llmtrace.run.compare import summary_line
from llmtrace.trace.comparison import model_points_around
from llmtrace.units import plural
from llmtrace.words import in_words


def short_names(names: list[str]) -> dict[str, str]:
    """Two-letter column heads for point names, each its own: the initials of its words (attn_norm: an), else its
    first two letters (scores: sc), else its first and a later letter."""
    out: dict[str, str] = {}
    for name in names:
        parts = name.split("_")
        tries = ["".join(p[0] for p in parts)[:2] if len(parts) > 1 else name[:2]]
        tries += [name[0] + c for c in name[1:]] + [name]
        out[name] = next(t for t in tries if t not in out.values())
    return out
# shades from small to large error (log scale, 1e-9 .. 1e-1): dim to bright red
SHADES = ("grey30", "grey50", "blue", "cyan", "green", "yellow", "dark_orange", "red", "bold red")
MAX_DIFFERING_ROWS = 20


def decade_cell(x: Optional[float]) -> str:
    """A relative error as one character: its decade d for an error about 1e-d (3e-4 -> "4"), "·" for none at all,
    "!" for 1e-1 and more, "-" for a point not compared."""
    if x is None:
        return "-"
    if x == 0:
        return "·"
    d = -math.floor(math.log10(x))
    if d <= 1:
        return "!"
    return str(d) if d <= 9 else "0"  # "0": below 1e-9 (a decade of 10 or more)


def shade(x: Optional[float]) -> str:
    if not x:
        return "grey23"
    level = min(len(SHADES) - 1, max(0, int(round(math.log10(x) + 9))))
    return SHADES[level]


def _e(x: Optional[float]) -> str:
    return "—" if x is None else ("0" if x == 0 else f"{x:.1e}")


def render_compare(doc: dict, console: Console) -> None:
    """Print the comparison `doc` (CompareResult.to_json()) on `console`."""
    first = doc["first_divergence"]
    console.print(Text(summary_line(doc), style="bold"))
    for key in ("a", "b"):
        s = doc[key]
        extra = ", quantized blocks" if s.get("keep_quantized") else ""
        extra += in_words(", `fast=True`: int4 kernels, approximate") if s.get("exact") is False else ""
        console.print(f"{key.upper()}  {s['model']}  ({s['dtype']}, {s['device']}{extra})")
        for iv in s.get("interventions", []):
            console.print(f"   intervention: {iv['label']}", style="yellow")
    n = len(doc["positions"])
    n_decode = sum(p.get("phase") == "decode" for p in doc["positions"])
    console.print(f"{plural(n, 'position')} ({n - n_decode} prompt, {n_decode} decode), tolerance {doc['tolerance']:g}"
                  + ("; from two saved traces" if doc.get("source") == "diff" else ""))
    for note in doc.get("notes", []):
        console.print(f"note: {in_words(note)}", style="yellow")
    if doc["layers"] and any(lay["points"] for lay in doc["layers"]):
        console.print()
        _matrix(doc, first, console)
    console.print()
    _answers(doc, console)


def _matrix(doc: dict, first: Optional[dict], console: Console) -> None:
    points = []
    for lay in doc["layers"]:
        for p in lay["points"]:
            if p["point"] not in points:
                points.append(p["point"])
    console.print("largest relative error ‖a−b‖/‖a‖ at any position: digit d ≈ 1e-d, · identical, ! ≥ 1e-1; "
                  "boxed: first divergence", style="dim")
    short = short_names(points)
    head = Text("      ")
    for name in points:
        head.append(f"{short[name]:<3}")
    head.append("   accum.   added")
    console.print(head, style="bold")
    mp = doc.get("model_points") or {}
    before, after = model_points_around(mp)
    if before:  # the embedding (and a family's scaling of it), one cell each
        row = Text(" emb  ")
        for name in before:
            v = mp[name]["max_rel_err"]
            if first is not None and first["layer"] is None and first["point"] == name:
                row.append(f"[{decade_cell(v)}]", style="bold reverse red")
            else:
                row.append(f"{decade_cell(v):<3}", style=shade(v))
        console.print(row)
    for lay in doc["layers"]:
        by_name = {p["point"]: p for p in lay["points"]}
        row = Text(f"{lay['layer']:>4}  ")
        for name in points:
            p = by_name.get(name)
            v = p["max_rel_err"] if p else None
            is_first = first is not None and first["layer"] == lay["layer"] and first["point"] == name
            cell = decade_cell(v) if p else " "
            if is_first:
                row.append(f"[{cell}]", style="bold reverse red")
            else:
                over = v is not None and v > doc["tolerance"]
                row.append(f"{cell:<3}", style=shade(v) + (" bold" if over else ""))
        row.append(f"{_e(lay.get('rel_err')):>9}{_e(lay.get('added_rel_err')):>8}",
                   style="bold" if (lay.get("added_rel_err") or 0) > doc["tolerance"] else "")
        console.print(row)
    tail = [f"{name} {_e(mp[name]['max_rel_err'])} (added {_e(mp[name]['added_rel_err'])})" for name in after
            if name != LAST.name]
    if tail:
        console.print("after the layers: " + ", ".join(tail))
    legend = " ".join(f"{short[n]}={n}" for n in points)
    console.print(Text(legend, style="dim"), overflow="fold")
    console.print(Text("accum.: error of the layer's output (its last residual point); added: B's layer run on A's input against "
                       "A's layer, the error this layer adds by itself", style="dim"), overflow="fold")


def _holdings(d: dict, console: Console) -> None:
    """diff: what the traces hold besides tensors."""
    t = d["tokens"]
    if t["same"]:
        console.print(f"tokens: the same {len(t['a'])} generated tokens")
    else:
        console.print(f"tokens: part at step {t['first_different_step']} "
                      f"(A {plural(len(t['a']), 'token')}, B {len(t['b'])})")
    ledger = [s for s in d["steps"] if s.get("sampler_differs")]
    if ledger:
        console.print(f"sampler ledger: survivors differ at {len(ledger)} step(s), first at step {ledger[0]['step']} "
                      f"({', '.join(x['stage'] for x in ledger[0]['sampler_differs'])})")
    st = d["statistics"]
    if st["compared"]:
        fd = st["first_difference"]
        where = ("none over the tolerance" if fd is None else
                 f"first over the tolerance: step {fd['step']}, " + (f"layer {fd['layer']}, " if fd["layer"] is not None
                                                                      else "") + f"{fd['point']} ({_e(fd['rel_err'])})")
        console.print(f"statistics: {st['compared']} recorded points in common; norms: {where}")


def _answers(doc: dict, console: Console) -> None:
    if doc.get("diff"):
        _holdings(doc["diff"], console)
    n = len(doc["positions"])
    if not n:
        return
    known = [p for p in doc["positions"] if p.get("same_top") is not None]
    same = sum(p["same_top"] for p in known)
    share = f"{100 * same / len(known):.1f}% ({same}/{len(known)})" if known else "—"
    console.print(f"answers: KLD mean {_e(doc['kld_mean'])}, max {_e(doc['kld_max'])}; same top {share}; "
                  f"mean |Δp| {_e(doc.get('dp_mean_abs'))}")
    differing = [p for p in known if not p["same_top"]]
    if not differing:
        console.print("the top-1 token agrees at every position")
        return
    console.print(f"top-1 differs at {plural(len(differing), 'position')}:")
    console.print(Text(f"{'pos':>5}  {'token':<14} {'A top':<16} {'B top':<16} {'KLD':>8} {'Δp':>9}", style="bold"))
    for p in differing[:MAX_DIFFERING_ROWS]:
        where = f"{p['prompt']}:{p['position']}" if "prompt" in p else str(p["position"])
        console.print(f"{where:>5}  {_clip(p['text']):<14} {_clip(p['top_a']['text']):<16} "
                      f"{_clip(p['top_b']['text']):<16} {_e(p.get('kld')):>8} {_e(p.get('dp')):>9}")
    if len(differing) > MAX_DIFFERING_ROWS:
        console.print(f"… and {len(differing) - MAX_DIFFERING_ROWS} more (all of them in --json)", style="dim")


def _clip(text: Optional[str], width: int = 14) -> str:
    s = visible(text or "")
    return s if len(s) <= width else s[: width - 1] + "…"
