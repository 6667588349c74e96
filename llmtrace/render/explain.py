"""The terminal views of `llmtrace explain` (one decoder layer taken apart) and `llmtrace lens` (the logit lens): rich
tables drawn from the events alone, never from the model, so a saved trace renders the same (`llmtrace show`)."""

from __future__ import annotations

import math
from typing import Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmtrace.model.llama_points import ATTN_NORM, FFN_NORM, LOGITS, RESID_MID, RESID_POST
from llmtrace.render.explain_state import delta_rule, ssm_scan, state_cache
from llmtrace.render.generate import axes_for, fmt_num, print_fitted, shape_text, visible
from llmtrace.trace.reader import trace_points
from llmtrace.units import human_bytes, plural
from llmtrace.words import in_words


# ----------------------------------------------------------------------------------------------------------------
# the view: small helpers

SHADES = ((0.6, "█", "gold1"), (0.3, "▓", "orange1"), (0.1, "▒", "dark_orange3"), (0.02, "░", "deep_sky_blue4"),
          (0.0, "·", "grey42"))  # attention weight ≥ threshold → character and colour; readable without colour too
PROB_STYLES = ((0.8, "bold bright_green"), (0.5, "green"), (0.2, "yellow"), (0.05, "dark_orange"), (0.0, "grey50"))


def _title(console: Console, text: str) -> None:
    console.print()
    console.print(Text(text, style="bold cyan"))


def _note(console: Console, text: str) -> None:
    console.print(Text(text, style="dim"))


def _tok(text: str, width: int = 12) -> str:
    v = visible(text)
    return v if len(v) <= width else v[: width - 1] + "…"


def _si(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _f(x, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _sample_rows(n: int, head: int = 3, tail: int = 6) -> list[Optional[int]]:
    """Row indices to show for per-token tables: all of a short prompt, else the first few, a gap (None), the last."""
    if n <= head + tail + 1:
        return list(range(n))
    return list(range(head)) + [None] + list(range(n - tail, n))


def _table(*cols: tuple[str, str]) -> Table:
    t = Table(box=None, padding=(0, 1), header_style="bold")
    for name, just in cols:
        t.add_column(name, justify=just)
    return t


def _prob_style(p: float) -> str:
    return next(style for lo, style in PROB_STYLES if p >= lo)


def _shade(w: Optional[float]) -> Text:
    if w is None:
        return Text("  ")
    ch, colour = next((c, col) for lo, c, col in SHADES if w >= lo)
    return Text(ch * 2, style=colour)


def _cut_short(console: Console, events: list[dict], model: Optional[dict], tokens: Optional[dict],
               complete: bool) -> bool:
    """A pass cut short (Ctrl-C, or a stream cut off) before its view could be drawn: the header, if the trace has it,
    and one line that says so. Returns whether it was."""
    if complete:
        return False
    if model is not None and tokens is not None:
        _header(console, model, tokens)
    summary = next((e for e in events if e["event"] == "summary"), None)
    why = "was interrupted (Ctrl-C)" if summary is not None and summary.get("interrupted") else "ends"
    command = (model or {}).get("command", "explain")
    console.print(Text(f"the {command} run {why} before its pass was taken apart: nothing more to show",
                       style="yellow"))
    return True


# ----------------------------------------------------------------------------------------------------------------
# the explain view


def render_explain(events: list[dict], console: Console) -> None:
    by = {}
    heads, tensors, lens_rows = [], [], []
    for ev in events:
        kind = ev["event"]
        if kind == "explain" and ev["section"] == "attention_head":
            heads.append(ev)
        elif kind == "explain" and ev["section"] == "rmsnorm":
            by.setdefault("rmsnorm", []).append(ev)
        elif kind == "explain":
            by[ev["section"]] = ev
        elif kind == "tokens":
            by["tokens"] = ev
        elif kind == "tensor":
            tensors.append(ev)
        elif kind == "lens":
            lens_rows.append(ev)
    if _cut_short(console, events, by.get("model"), by.get("tokens"), complete="kv_cache" in by or "state_cache" in by or "memory" in by):
        return
    toks = [t["text"] for t in by["tokens"]["tokens"]]
    _header(console, by["model"], by["tokens"])
    _batch_masks(console, events)
    _layer(console, by["layer"])
    if "steps" in by:
        _steps(console, by["steps"])
    _rmsnorm(console, by["rmsnorm"], toks)
    # the mixer's sections, those its kind declared (model.kinds EXPLAIN): drawn as they are present
    if "delta_rule" in by:  # a layer whose memory is a recurrent state (render.explain_state)
        delta_rule(console, by["delta_rule"], toks)
    if "ssm_scan" in by:  # a Mamba2 layer
        ssm_scan(console, by["ssm_scan"], toks)
    if "qkv" in by:
        _qkv(console, by["qkv"])
    if "rope" in by:
        _rope(console, by["rope"])
    if "attention" in by:
        _attention(console, by["attention"], heads, by["attention_map"], toks)
    _residual(console, by["residual"], toks)
    if "router" in by:
        _router(console, by["router"], toks)
    else:
        _ffn(console, by["ffn"], toks)
    if "state_cache" in by:
        state_cache(console, by["state_cache"])
    elif "memory" in by:
        _memory(console, by["memory"])
    else:
        _kv(console, by["kv_cache"])
    _lens_here(console, lens_rows, by["model"])
    _tensors(console, tensors, trace_points(events))


def _batch_masks(console: Console, events: list[dict], most: int = 24) -> None:
    """s3 with several prompts: each row's combined causal and padding mask, query rows × key columns (the last
    `most` slots of a longer batch): █ attended, · in the future (causal), ░ a pad slot (padding)."""
    ev = next((e for e in events if e["event"] == "batch"), None)
    if ev is None:
        return
    T = len(ev["ids"][0])
    cut = max(0, T - most)
    source = "the tokenizer's pad token" if ev["pad_source"] == "pad" else "EOS (no pad token in this checkpoint)"
    _title(console, f"s3 batch of {ev['rows']} prompts, left-padded to T={T} with id {ev['pad_id']} ({source}): "
                    f"each row's causal + padding mask (█ attended, · future, ░ pad)"
                    + (f", slots {cut}..{T - 1}" if cut else ""))
    # explain's batch event carries each row's combined mask; generate's has only the padding, so causal is added here
    combined = ev.get("combined_mask") or [[[bool(pad[j]) and j <= i for j in range(T)] for i in range(T)]
                                           for pad in ev["attention_mask"]]
    for r, (mask, pad) in enumerate(zip(combined, ev["attention_mask"])):
        here = " ← explained below" if r == ev.get("explained_row") else ""
        console.print(Text(f"row {r}: {plural(sum(pad), 'real token')}, positions 0..{sum(pad) - 1}{here}", style="bold"))
        for i in range(cut, T):
            line = Text("  ")
            for j in range(cut, T):
                if not pad[j] or not pad[i]:
                    line.append("░", style="grey42")
                else:
                    line.append("█" if mask[i][j] else "·", style="gold1" if mask[i][j] else "grey42")
            console.print(line)


def _header(console: Console, m: dict, tokens: dict) -> None:
    info = m["model"]
    L = info["n_layers"]
    where = f" · layer {m['layer']} of 0..{L - 1}" if m.get("layer") is not None else ""
    console.print(Text.assemble((f"llmtrace {m['command']}", "bold"), where,
                                f" · {info['name']} · {info['arch']} · D={info['d_model']} · H={info['n_heads']} · "
                                f"Hkv={info['n_kv_heads']} · Dh={info['head_dim']} · F={info['ffn_dim']} · "
                                f"{info['device']} {info['dtype']}" + (" · chat template" if m.get("chat") else "")))
    from llmtrace.render.generate import print_changes, print_parts, storage_parts

    print_changes(console, info)
    if info.get("storage"):
        print_parts(console, ["weights", *storage_parts(info["storage"])])
    if m.get("interventions"):
        print_parts(console, ["interventions", *(iv["label"] for iv in m["interventions"])], style="yellow")
    if info.get("exact") is False:
        from llmtrace.trace.records import fast_parts

        print_parts(console, fast_parts(info["fast"]), style="yellow")
    toks = tokens["tokens"]
    shown = toks if len(toks) <= 40 else toks[:20] + [None] + toks[-19:]
    line = Text(f"{plural(len(toks), 'token')}: ", style="bold")
    for i, t in enumerate(shown):
        if i:
            line.append(" · ", style="dim")
        if t is None:
            line.append(f"… {len(toks) - 39} more …", style="dim")
            continue
        line.append(f"{t['index']}:", style="dim")
        line.append(_tok(t["text"], 16), style="magenta" if t.get("special") else None)
    console.print(line)


def _layer(console: Console, ev: dict) -> None:
    n = ev["layer"]
    _title(console, f"① s6  where the layer sits: layer {n} is decoder layer {n + 1} of {ev['n_layers']}")
    t = _table(("step", "left"), ("weight", "left"), ("shape (x @ W)", "left"), ("parameters", "right"), ("of layer", "right"))
    for p in ev["params"]:
        t.add_row(p["seed_step"], p["name"], shape_text(p["shape"]), f"{p['numel']:,}", f"{p['numel'] / ev['layer_params']:.1%}")
    t.add_row("", Text("layer total", style="bold"), "", Text(f"{ev['layer_params']:,}", style="bold"), "100%")
    print_fitted(console, t)
    _note(console, f"= {ev['share']:.2%} of the model's {ev['model_params']:,} parameters "
                   f"({ev['share_of_layers']:.2%} of the weights outside the embedding and final norm; the embedding "
                   f"table holds {ev['embedding_params']:,})")
    if "model_active_params" in ev:  # a mixture of experts
        _note(console, f"a token uses {ev['layer_active_params']:,} of this layer's weights (the router and K of the "
                       f"experts) and {active_share(ev['model_active_params'], ev['model_params'])} of the model's")
    f = ev["flops"]
    T = ev["n_tokens"]
    t = _table(("FLOPs for this prompt", "left"), ("formula (T = " + str(T) + ")", "left"), ("FLOPs", "right"))
    rows = [(label, formula, value) for _, label, formula, value in f["rows"]]  # as the layer's kinds declare them
    for label, formula, value in rows:
        t.add_row(label, formula, f"{value:,}")
    t.add_row(Text("layer total", style="bold"), "", Text(f"{f['total']:,} ({_si(f['total'])})", style="bold"))
    print_fitted(console, t)
    _note(console, "2 FLOPs per multiply-add" + (f"; {f['note']}" if f.get("note") else ""))


def _rmsnorm(console: Console, evs: list[dict], toks: list[str]) -> None:
    a = evs[0]
    if len(evs) == 2 and [e["norm"] for e in evs] == [ATTN_NORM.name, FFN_NORM.name]:
        title = "(before attention, before the FFN)"
    else:
        title = "(" + ", ".join(f"{e['norm']} {e['seed_step']}" for e in evs) + ")"
    _title(console, f"② RMSNorm ×{len(evs)} {title}")
    for ev in evs:
        _note(console, ev["formula"])
    _note(console, f"ε = {a['eps']:g}; γ is learned, one weight per dimension")
    for ev in evs:
        g = ev["gamma"]
        dims = ", ".join(f"{d}:{v:.3f}" for d, v in zip(g["top_dims"][:3], g["top_values"][:3]))
        _note(console, f"{ev['norm']} γ: mean {g['mean']:.4f}, min {g['min']:.4f}, max {g['max']:.4f} "
                       f"(largest |γ| at dims {dims}); max |y − forward pass| = {fmt_num(ev['check_max_abs_diff'])}")
    if len(evs) == 2:
        f = evs[1]
        t = _table(("pos", "right"), ("token", "left"), ("RMS(x)", "right"), ("‖x‖", "right"), ("‖x/RMS‖", "right"),
                   ("‖γ⊙x/RMS‖", "right"), ("│ ffn: RMS(x')", "right"), ("‖x'‖", "right"), ("‖γ⊙x'/RMS‖", "right"))
        cells = lambda r, s: [fmt_num(r["rms"]), fmt_num(r["norm_in"]), fmt_num(r["norm_unit"]),  # noqa: E731
                              fmt_num(r["norm_out"]), fmt_num(s["rms"]), fmt_num(s["norm_in"]), fmt_num(s["norm_out"])]
    else:  # a family's extra norms: each norm's input RMS and output length
        t = _table(("pos", "right"), ("token", "left"),
                   *[c for e in evs for c in ((f"{e['norm'].removesuffix('_norm')} RMS(in)", "right"), ("‖out‖", "right"))])
        cells = lambda *rows: [fmt_num(r[k]) for r in rows for k in ("rms", "norm_out")]  # noqa: E731
    for i in _sample_rows(len(a["tokens"])):
        if i is None:
            t.add_row("…", "", *[""] * (len(t.columns) - 2))
            continue
        t.add_row(str(i), _tok(toks[i]), *cells(*(e["tokens"][i] for e in evs)))
    print_fitted(console, t)
    _note(console, f"dividing by the RMS gives every token the same length √D = {a['d_model'] ** 0.5:.2f}, whatever "
                   f"its scale; γ then re-weights each of the D dimensions (learned), which sets the final length")


def _qkv(console: Console, ev: dict) -> None:
    H, Hkv, Dh = ev["n_heads"], ev["n_kv_heads"], ev["head_dim"]
    _title(console, f"③ s6.1–s6.2  Q, K, V and the head split: H = {H} query heads, Hkv = {Hkv}, Dh = {Dh}")
    t = _table(("projection", "left"), ("shape", "left"), ("split into heads", "left"), ("heads first", "left"))
    for s in ev["shapes"]:
        t.add_row(s["name"], shape_text(s["shape"]), shape_text(s["split"]) if "split" in s else "",
                  shape_text(s["heads_first"]) if "heads_first" in s else "")
    print_fitted(console, t)
    if Hkv < H:
        console.print(Text(f"grouped-query attention (GQA): {ev['group_size']} query heads share each KV head", style="bold"))
        for g, qs in enumerate(ev["groups"]):
            console.print(f"  KV head {g} ← query heads {', '.join(map(str, qs))}")
    else:
        console.print("multi-head attention: every query head has its own K and V (no sharing)")
    c = ev["cache"]
    _note(console, f"KV cache per position per layer: 2 × {Hkv} × {Dh} × {c['element_size']} B = "
                   f"{c['bytes_per_position_layer']:,} B instead of {c['mha_bytes_per_position_layer']:,} B with one "
                   f"KV head per query head: {c['saving']:g}× smaller (this prompt, all layers: "
                   f"{human_bytes(c['bytes_prompt_model'])} instead of {human_bytes(c['mha_bytes_prompt_model'])})")


def _steps(console: Console, ev: dict) -> None:
    """Each point of the layer with the operation the model declares, and the check on this pass."""
    plan = ev["plan"]
    _title(console, f"⓪ s6  layer {ev['layer']}'s steps, as the model declares them: attention {plan['attention_words']}; "
                    f"RoPE {plan['rope_words']}; {plan['ffn']} feed-forward")
    t = _table(("point", "left"), ("op", "left"), ("formula, with this layer's constants", "left"),
               ("computed vs trace", "right"))
    t.columns[2].overflow = "fold"
    t.columns[2].ratio = 1
    for c in (0, 1, 3):
        t.columns[c].no_wrap = True
    t.expand = True
    bad = 0
    for r in ev["steps"]:
        c = r["check"]
        if c is None:
            mark = Text("—", style="dim")
        else:
            bad += not c["ok"]
            mark = Text(("✓ " if c["ok"] else "✗ ") + fmt_num(c["max_abs"]), style="green" if c["ok"] else "red")
        t.add_row(r["point"], r["op"], r["formula"], mark)
    console.print(t)
    checked = sum(r["check"] is not None for r in ev["steps"])
    _note(console, f"each formula applied in float64 to this pass's own inputs, beside the value the pass computed "
                   f"(largest |difference|): {checked} of {plural(len(ev['steps']), 'step')} checked, "
                   f"{'all agree' if not bad else plural(bad, 'disagreement')}; — marks a step with nothing to recompute "
                   f"(the cache's slots) or an input this pass did not keep")


def _rope(console: Console, ev: dict) -> None:
    if ev.get("rotation") == "none":
        _title(console, "④ s6.3  RoPE on q and k: no rotation in this layer")
        _note(console, ev["formula"])
        console.print(Text(ev["why"]))
        _note(console, f"q_rope equals its input to {fmt_num(ev['check_q_rope_max_abs_diff'])}")
        return
    scaling = "no scaling" if not ev["scaling"] else "scaling " + ", ".join(f"{k}={v}" for k, v in ev["scaling"].items())
    table = {"local": ", the sliding-window layers' own table", "global": ""}.get(ev.get("rope_table"), "")
    width = (f", rotary width {ev['rotary_dim']} of {ev['head_dim']}" if ev.get("rotary_dim", ev["head_dim"]) !=
             ev["head_dim"] else "")
    theta = ev["theta"]
    base = f"{theta:,.0f}" if float(theta).is_integer() else f"{theta:,g}"  # 1,000,000 as the steps' formula says it
    _title(console, f"④ s6.3  RoPE on q and k: base θ = {base}{table}{width}, {scaling}")
    _note(console, ev["formula"])
    n = len(ev["pairs"][0]["angles"])
    cols = list(range(min(n, 6))) + ([n - 1] if n > 6 else [])
    t = _table(("pair i", "right"), ("dims", "left"), ("θ_i rad/pos", "right"), ("turn every", "right"),
               *[(f"pos {p}", "right") for p in cols])
    for p in ev["pairs"]:
        t.add_row(str(p["i"]), f"{p['dims'][0]}, {p['dims'][1]}", f"{p['theta_i']:.3g}", f"{p['wavelength']:.3g} pos" if p["wavelength"] is not None else "still",
                  *[f"{p['angles'][c]:.3g}" for c in cols])
    print_fitted(console, t)
    _note(console, "angles in radians; fast pairs (small i) turn in a few positions and see nearby order, slow pairs "
                   "barely turn and carry long-range position. V is not rotated.")
    r = ev["relative"]
    console.print(Text(f"relative distance: the real q of head {r['head']} (last token) and k of KV head "
                       f"{r['kv_head']} (first token), placed at positions m = n + d and n", style="bold"))
    t = _table(("d = m − n", "right"), *[(f"n = {s}", "right") for s in r["shifts"]], ("spread", "right"))
    for d, row, dev in zip(r["distances"], r["scores"], r["deviation_by_distance"]):
        t.add_row(str(d), *[f"{v:.6f}" for v in row], fmt_num(dev))
    print_fitted(console, t)
    ok = r["max_deviation"] <= 1e-4
    console.print(Text(("✓" if ok else "✗") + f" q·k/√Dh is the same wherever the pair sits, given d "
                       f"(largest spread {fmt_num(r['max_deviation'])}); it changes when d changes", style="green" if ok else "red"))
    _note(console, f"the model's RoPE tables reproduce its q_rope / k_rope to {fmt_num(ev['check_q_rope_max_abs_diff'])} / "
                   f"{fmt_num(ev['check_k_rope_max_abs_diff'])}")


def _matrix_table(title: str, rows: list[list], masked: Optional[list[list]] = None) -> Table:
    n = len(rows)
    t = Table(title=title, box=None, padding=(0, 1), header_style="bold", title_style="bold")
    t.add_column("q\\k", justify="right")
    for j in range(n):
        t.add_column(str(j), justify="right")
    for i, row in enumerate(rows):
        cells = []
        for j, v in enumerate(row):
            if masked is not None and masked[i][j] is None:
                cells.append(Text(f"{v:.2f}→−∞", style="dim"))
            else:
                cells.append(f"{v:.2f}")
        t.add_row(str(i), *cells)
    return t


def _attention(console: Console, ev: dict, heads: list[dict], amap: dict, toks: list[str]) -> None:
    H, T, _ = ev["shape"]
    _title(console, f"⑤ s6.4–s6.5  attention: scores {shape_text(ev['shape'])} → causal mask → softmax → P·V")
    window = ev.get("window")
    which = f"every key after its query, and every key {window} or more back" if window else "every key after its query"
    _note(console, f"{ev['formula']}; the mask sets {plural(ev['masked'], 'entry', 'entries')} ({which}) to −∞")
    _note(console, f"scores before the mask: min {fmt_num(ev['pre_mask']['min'])}, max {fmt_num(ev['pre_mask']['max'])}; "
                   f"after (the entries a position may see): min {fmt_num(ev['post_mask']['min'])}, max "
                   f"{fmt_num(ev['post_mask']['max'])}; every softmax row sums to 1 (largest error "
                   f"{fmt_num(ev['row_sum_max_error'])})")
    ex = ev["example"]
    scores = _matrix_table(f"head {ex['head']}: scores, masked →−∞", ex["scores"], ex["masked_scores"])
    probs = _matrix_table("softmax P", ex["probs"])
    if console.measure(scores).maximum + console.measure(probs).maximum + 3 <= console.width:
        grid = Table.grid(padding=(0, 3))  # side by side when they fit
        grid.add_row(scores, probs)
        console.print(grid)
    else:
        print_fitted(console, scores)
        print_fitted(console, probs)
    if ex["positions"] < T:
        _note(console, f"(the first {plural(ex['positions'], 'position')} of {T})")
    # for each head, the position each query attends to most
    console.print(Text("the key each position attends to most, per head (position:weight)", style="bold"))
    for lo in range(0, H, 10):
        chunk = heads[lo:lo + 10]
        t = _table(("pos", "right"), ("token", "left"), *[(f"h{h['head']}", "right") for h in chunk])
        for i in _sample_rows(T):
            if i is None:
                t.add_row("…", "", *[""] * len(chunk))
                continue
            t.add_row(str(i), _tok(toks[i], 10), *[f"{h['argmax'][i]}:{h['weight'][i]:.2f}" for h in chunk])
        t.add_row("", Text("mean on 0", style="dim"), *[Text(f"{h['first_token_weight']:.2f}", style="dim") for h in chunk])
        print_fitted(console, t)
    _heatmap(console, amap, toks)


def _heatmap(console: Console, amap: dict, toks: list[str]) -> None:
    bins, m = amap["bins"], amap["matrix"]
    window = amap.get("window")
    how = (f"{plural(amap['n_tokens'], 'position')} in {plural(len(bins), 'bin')} "
           f"(keys summed, queries averaged per bin)"
           if amap["binned"] else plural(amap['n_tokens'], 'position'))
    console.print(Text(f"attention map, {amap['what']} ({how}): rows are queries, columns keys; "
                       + in_words("pick a head with `head`"), style="bold"))
    if window:
        _note(console, f"a sliding-window layer: each query sees only the last {window} keys, the band along the "
                       f"diagonal (╳: out of the window)")
    elif amap.get("model_window"):
        _note(console, f"a global layer: every query sees every earlier key (the model's other layers see only the "
                       f"last {amap['model_window']})")
    label_w = 16
    head = Text(" " * label_w)
    j = 0
    while j < len(bins):  # a key label every 5 columns
        lab = str(bins[j][0])
        head.append(lab.ljust(10)[: 2 * min(5, len(bins) - j)])
        j += 5
    console.print(head)
    for i, (lo, hi) in enumerate(bins):
        label = f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"
        name = _tok(toks[lo], label_w - len(label) - 2) if hi - lo == 1 else ""
        line = Text(f"{label} {name}".ljust(label_w)[:label_w], style="dim")
        for j, w in enumerate(m[i]):
            if bins[j][0] > hi - 1:  # keys after every query of the bin: masked, the future
                line.append_text(_shade(None))
            elif window and bins[j][1] - 1 <= lo - window:  # keys before every query's window
                line.append("╳╳", style="grey30")
            else:
                line.append_text(_shade(w))
        console.print(line)
    legend = Text("  ")
    for lo, ch, colour in reversed(SHADES):
        legend.append(ch * 2, style=colour)
        legend.append(f" ≥{lo:.0%}  " if lo else " <2%  ", style="dim")
    legend.append("(blank: masked, in the future" + ("; ╳: out of the window)" if window else ")"), style="dim")
    console.print(legend)


def _residual(console: Console, ev: dict, toks: list[str]) -> None:
    _title(console, f"⑥ s6.6  output projection and residual: {ev['formula'].partition(';')[0]}")
    t = _table(("pos", "right"), ("token", "left"), ("‖x‖", "right"), ("‖attn‖", "right"), ("‖attn‖/‖x‖", "right"),
               ("cos(x,attn)", "right"), ("cos(x,x')", "right"), ("‖x''−x‖/‖x‖", "right"), ("cos(x,x'')", "right"))
    for i in _sample_rows(len(ev["tokens"])):
        if i is None:
            t.add_row("…", "", *[""] * 7)
            continue
        r = ev["tokens"][i]
        t.add_row(str(i), _tok(toks[i]), fmt_num(r["norm_in"]), fmt_num(r["norm_attn"]), fmt_num(r["attn_to_stream"]),
                  _f(r["cos_attn_stream"], 3), _f(r["cos_attn"], 5), fmt_num(r["rel_change_layer"]), _f(r["cos_layer"], 5))
    print_fitted(console, t)
    _note(console, "x enters the layer; attn = what attention adds to it; x' = x + attn (so ‖x'−x‖/‖x‖ = ‖attn‖/‖x‖); "
                   "x'' = x' + FFN(x') leaves the layer. A cosine near 1: the layer nudged the token's vector "
                   "rather than replacing it")


def _ffn(console: Console, ev: dict, toks: list[str]) -> None:
    chain = " → ".join(f"{s['name']} {shape_text(s['shape'])}" for s in ev["shapes"])
    _title(console, f"⑦ s6.7  {ev.get('kind', 'SwiGLU')} feed-forward, D → F → D")
    fn = ev.get("activation", "silu")
    _note(console, ev["formula"])
    console.print(chain)
    _note(console, f"{fn}(gate) near zero (|·| < {ev['near_zero_threshold']:g}): {ev['near_zero_fraction']:.1%} of all "
                   f"units; gate < 0 for {ev['negative_gate_fraction']:.1%}; {fn}(gate) mean "
                   f"{fmt_num(ev['silu_gate']['mean'])}, max {fmt_num(ev['silu_gate']['max'])}; "
                   f"act = {fn}(gate)⊙up matches the forward pass to {fmt_num(ev['check_act_max_abs_diff'])}")
    t = _table(("pos", "right"), ("token", "left"), ("units ≈ 0", "right"), ("‖act‖", "right"), ("‖down‖", "right"),
               ("‖down‖/‖x'‖", "right"), ("cos(x', x'')", "right"))
    for i in _sample_rows(len(ev["tokens"])):
        if i is None:
            t.add_row("…", "", *[""] * 5)
            continue
        r = ev["tokens"][i]
        t.add_row(str(i), _tok(toks[i]), f"{r['near_zero_fraction']:.1%}", fmt_num(r["norm_act"]), fmt_num(r["norm_down"]),
                  fmt_num(r["rel_change"]), _f(r["cos"], 5))
    print_fitted(console, t)
    tu = ev["top_units"]
    console.print(Text(f"the most active units for the last token (position {tu['position']}, "
                       f"{_tok(toks[tu['position']])}), by |act|", style="bold"))
    t = _table(("unit", "right"), ("gate", "right"), (f"{fn}(gate)", "right"), ("up", "right"), ("act", "right"))
    for u in tu["units"]:
        t.add_row(str(u["unit"]), fmt_num(u["gate"]), fmt_num(u["silu_gate"]), fmt_num(u["up"]), fmt_num(u["act"]))
    print_fitted(console, t)


def active_share(n_active: int, n_total: int) -> str:
    """'1.1M active of 4.2M'."""
    return f"{_si(n_active)} active of {_si(n_total)}"


def _router(console: Console, ev: dict, toks: list[str], shown: int = 12) -> None:
    """A mixture-of-experts layer's router, a row per prompt token: each expert's probability (chosen ones bold,
    the K-th marked where the cut falls) when the E columns fit, else the 2K most probable; the weights; entropy."""
    E, K = ev["n_experts"], ev["k"]
    _title(console, f"⑦ s6.7  the router: each token runs {K} of {plural(E, 'expert')} "
                    f"(width {ev['expert_ffn_dim']:,} each)")
    _note(console, ev["formula"])
    wide = E <= shown
    cols = [("pos", "right"), ("token", "left")] + ([(f"e{e}", "right") for e in range(E)] if wide else
                                                    [(f"top {min(E, 2 * K)} (p; | the cut)", "left")])
    t = _table(*cols, ("weights", "left"), ("bits", "right"), ("‖ffn‖/‖x'‖", "right"))
    for i in range(len(ev["tokens"])):
        r = ev["tokens"][i]
        chosen = set(r["experts"])
        if wide:
            cells = [Text(f"{p:.2f}".removeprefix("0"), style="bold" if e in chosen else "dim")
                     for e, p in enumerate(r["probs"])]
        else:
            order = sorted(range(E), key=lambda e: -r["probs"][e])[: 2 * K]
            line = Text()
            for n, e in enumerate(order):
                line.append(("| " if n == K else "") + f"e{e} {r['probs'][e]:.2f} ".replace(" 0.", " ."),
                            style="bold" if e in chosen else "dim")
            cells = [line]
        weights = " ".join(f"e{e} {w:.2f}".replace(" 0.", " .") for e, w in zip(r["experts"], r["weights"]))
        t.add_row(str(r["position"]), _tok(toks[r["position"]]), *cells, weights, _f(r["entropy"], 2),
                  fmt_num(r["rel_change"]))
    print_fitted(console, t)
    gap = [r["cut"] - r["next"] for r in ev["tokens"] if r["next"] is not None]
    how = "renormalised to sum to 1" if ev["renormalised"] else "as the softmax gave them"
    margin = f" (closest margin {min(gap):.3f})" if gap else ""
    _note(console, f"bold: the experts a token ran; the cut: the K-th probability against the best one left out"
                   f"{margin}; weights {how}; bits: the router's entropy (log2 {E} = {math.log2(E):.2f} when it "
                   f"cannot choose)")
    imb = f" (max/mean {ev['imbalance']:.2f})" if ev.get("imbalance") is not None else ""
    _note(console, "load over the prompt (tokens per expert): " + " ".join(f"e{e} {n}" for e, n in
                                                                          enumerate(ev["load"])) + imb)


def _kv(console: Console, ev: dict) -> None:
    lo, hi = ev["positions"]
    _title(console, f"⑧ s6.8  KV cache write: this layer stores K and V for positions {lo}..{hi}")
    console.print(f"K {shape_text(ev['shape_k'])} and V {shape_text(ev['shape_v'])} × {ev['element_size']} B = "
                  f"{ev['bytes']:,} B ({ev['bytes_per_position']:,} B per position); every layer together: "
                  f"{human_bytes(ev['all_layers_bytes'])}")
    _note(console, f"with one KV head per query head this layer would write {ev['mha_bytes']:,} B; later decode steps "
                   f"read these instead of recomputing them")


def _memory(console: Console, ev: dict) -> None:
    """s6.8 a layer's memory as its kind declares it (an MLA layer's latent and RoPE key)."""
    m = ev["record"]
    parts = " and ".join(f"{name} {shape_text(shape)}" for name, shape in m["per_token"].items())
    _title(console, f"⑧ s6.8  cache write: this layer keeps {parts} for each of {ev['n_positions']} positions")
    console.print(f"{m['per_token_bytes']:,} B per position, {ev['bytes']:,} B for this pass; every layer together: "
                  f"{human_bytes(ev['all_layers_bytes'])}")
    if m["mha_per_token_bytes"]:
        _note(console, f"full multi-head attention with these heads would keep {ev['mha_bytes']:,} B "
                       f"({m['mha_per_token_bytes'] / max(m['per_token_bytes'], 1):.1f}× more)")


def _cand(c: dict) -> Text:
    return Text.assemble((_tok(c["text"], 14), _prob_style(c["prob"])), (f" {c['prob']:.3f}", "dim"))


def _lens_here(console: Console, rows: list[dict], m: dict) -> None:
    mid = next(r for r in rows if r["stage"] == RESID_MID.name)
    post = next(r for r in rows if r["stage"] == RESID_POST.name)
    final = next(r for r in rows if r["stage"] == LOGITS.name)
    L = m["model"]["n_layers"]
    _title(console, f"⑨ s8–s9 early  logit lens at layer {mid['layer']}, last position ({mid['position']})")
    _note(console, "what the model would predict if it stopped here: the final norm and the LM head applied to the stream")
    t = _table(("rank", "right"), (f"after attention (x')", "left"), (f"after the FFN (x'')", "left"),
               (f"real output (after layer {L - 1})", "left"))
    for k in range(len(final["topk"])):
        t.add_row(str(k + 1), _cand(mid["topk"][k]), _cand(post["topk"][k]), _cand(final["topk"][k]))
    print_fitted(console, t)


def _tensors(console: Console, tensors: list[dict], points) -> None:
    if not tensors:
        return
    _title(console, f"every observed point of layer {tensors[0]['layer']} (the tensor events of --json)")
    t = _table(("step", "left"), ("point", "left"), ("shape", "left"), ("mean", "right"), ("std", "right"),
               ("min", "right"), ("max", "right"), ("‖x‖", "right"))
    for ev in tensors:
        s = ev["stats"]
        t.add_row(ev.get("seed_step") or "", ev["name"], shape_text(ev["shape"], axes_for(points, ev["name"], ev["shape"])),
                  fmt_num(s["mean"]), fmt_num(s["std"]),
                  fmt_num(s["min"]), fmt_num(s["max"]), fmt_num(s["norm"]))
    print_fitted(console, t)


# ----------------------------------------------------------------------------------------------------------------
# the lens view


def render_lens(events: list[dict], console: Console) -> None:
    m = next((e for e in events if e["event"] == "explain" and e["section"] == "model"), None)
    tokens = next((e for e in events if e["event"] == "tokens"), None)
    cells: dict[tuple, dict] = {}
    for ev in events:
        if ev["event"] == "lens":
            cells[(ev["layer"] if ev["stage"] != LOGITS.name else "out", ev["position"])] = ev
    if _cut_short(console, events, m, tokens, complete=m is not None and ("out", m["positions"][-1]) in cells):
        return
    toks = tokens["tokens"]
    _header(console, m, {"tokens": toks})
    _batch_masks(console, events)
    positions, layers = m["positions"], m["layers"]
    L = m["model"]["n_layers"]
    T = len(toks)
    _title(console, f"logit lens: final norm + LM head applied after every layer; top-1 token per cell "
                    f"(positions {positions[0]}..{positions[-1]} of 0..{T - 1})")
    # one space between columns; cells as wide as the console allows (6 characters for 12 columns at 100), 4 to 12
    w = max(4, min(12, (console.width - 6) // len(positions) - 1))
    t = Table(box=None, padding=(0, 0, 0, 1), header_style="bold", pad_edge=False)
    t.add_column("layer", justify="right")
    for p in positions:
        t.add_column(Text(f"{p}\n{_tok(toks[p]['text'], w)}"), width=w, no_wrap=True, overflow="ellipsis")
    rows = list(layers) + ([] if L - 1 in layers else ["out"])
    styled = console.color_system is not None  # a pipe, a file or NO_COLOR: no colour, no underline
    for layer in rows:
        line = []
        for p in positions:
            c = cells[(layer, p)]["topk"][0]
            hit = p + 1 < T and c["id"] == toks[p + 1]["id"]
            if styled:
                line.append(Text(_tok(c["text"], w), style=_prob_style(c["prob"]) + (" underline" if hit else "")))
            else:
                line.append(Text(_tok(c["text"], w - 1) + "*" if hit else _tok(c["text"], w)))
        t.add_row(str(layer), *line)
    print_fitted(console, t)
    if styled:
        legend = Text("probability of the top-1 token: ")
        for lo, style in PROB_STYLES:
            legend.append(f"≥{lo:.0%} " if lo else "<5%", style=style)
            legend.append("  ")
        legend.append("underlined: already the prompt's next token", style="underline")
    else:
        legend = Text("*: the top-1 token is already the prompt's next token (without colour the probabilities are "
                      "not shown; --json has them)")
    console.print(legend)
    last = positions[-1]
    fin = cells[("out", last)] if ("out", last) in cells else None
    if fin is not None:
        top = ", ".join(f"{visible(c['text'])} {c['prob']:.3f}" for c in fin["topk"][:5])
        row = f"the row of layer {L - 1} is exactly this" if L - 1 in layers else "row 'out'"
        _note(console, f"the model's real prediction after position {last}: {top} ({row})")
