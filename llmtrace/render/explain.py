"""The terminal views of `llmtrace explain` (one decoder layer taken apart) and `llmtrace lens` (the logit lens): rich
tables drawn from the events alone, never from the model, so a saved trace renders the same (`llmtrace show`).

Every line is said by its key in the catalogue of the view's language (render.say: `say("explain.kv.title", ...)`),
with the events' numbers as values; formulas, tokens and names are printed as they are (`verbatim`). A word a kind of
layer declares comes with it as an (English, Chinese) pair (its FLOPs rows, its note, its headings)."""

from __future__ import annotations

import math
from typing import Optional

from rich.console import Console
from rich.style import Style
from rich.table import Table
from rich.text import Text

from llmtrace.model.llama_points import ATTN_NORM, FFN_NORM, LOGITS, RESID_MID, RESID_POST
from llmtrace.render.explain_latent import latent
from llmtrace.render.explain_state import conv_window, delta_rule, ssm_scan, state_cache
from llmtrace.render.generate import axes_for, fmt_num, print_fitted, shape_text, visible
from llmtrace.render.say import Say, verbatim
from llmtrace.trace.events import Section
from llmtrace.trace.reader import trace_points
from llmtrace.units import human_bytes
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


def _formula(console: Console, text: str) -> None:
    console.print(verbatim(text, "dim"))


def _tok(text: str, width: int = 12) -> str:
    v = visible(text)
    return v if len(v) <= width else v[: width - 1] + "…"


def _tokt(text: str, width: int = 12, style: Optional[str] = None) -> Text:
    """A token's text as a cell: as it is in every language."""
    return verbatim(_tok(text, width), style)


def _names(*cells) -> list[Text]:
    """Cells that hold names (points, weights, operations, shapes): as they are in every language."""
    return [c if isinstance(c, Text) else verbatim(str(c)) for c in cells]


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
               complete: bool, say: Say) -> bool:
    """A pass cut short (Ctrl-C, or a stream cut off) before its view could be drawn: the header, if the trace has it,
    and one line that says so. Returns whether it was."""
    if complete:
        return False
    if model is not None and tokens is not None:
        _header(console, model, tokens, say)
    summary = next((e for e in events if e["event"] == "summary"), None)
    why = "interrupted" if summary is not None and summary.get("interrupted") else "ends"
    command = (model or {}).get("command", "explain")
    console.print(Text(say(f"explain.cut.{why}", command=command), style="yellow"))
    return True


# ----------------------------------------------------------------------------------------------------------------
# the explain view


# the sections a kind of layer declares for its own mixer (model.kinds EXPLAIN), each with its view, in the order
# they are drawn: (console, event, the prompt's tokens, say)
KIND_SECTIONS = (
    (Section.DELTA_RULE, delta_rule),  # a layer whose memory is a recurrent state (render.explain_state)
    (Section.STATE_UPDATE, ssm_scan),  # a Mamba2 layer
    (Section.CONVOLUTION, conv_window),  # a short convolution layer
    (Section.LATENT_CACHE, lambda console, ev, toks, say: latent(console, ev, say)),  # MLA (render.explain_latent)
)


def render_explain(events: list[dict], console: Console, say: Optional[Say] = None) -> None:
    say = say or Say()
    by = {}
    heads, tensors, lens_rows = [], [], []
    for ev in events:
        kind = ev["event"]
        if kind == "explain" and ev["section"] == Section.ATTENTION_HEAD:
            heads.append(ev)
        elif kind == "explain" and ev["section"] == Section.RMSNORM:
            by.setdefault(Section.RMSNORM, []).append(ev)
        elif kind == "explain":
            by[ev["section"]] = ev
        elif kind == "tokens":
            by["tokens"] = ev
        elif kind == "tensor":
            tensors.append(ev)
        elif kind == "lens":
            lens_rows.append(ev)
    if _cut_short(console, events, by.get(Section.MODEL), by.get("tokens"),
                  complete=Section.KV_CACHE in by or Section.STATE_CACHE in by or Section.MEMORY in by, say=say):
        return
    toks = [t["text"] for t in by["tokens"]["tokens"]]
    _header(console, by[Section.MODEL], by["tokens"], say)
    _batch_masks(console, events, say)
    _layer(console, by[Section.LAYER], say)
    if Section.STEPS in by:
        _steps(console, by[Section.STEPS], say)
    _rmsnorm(console, by[Section.RMSNORM], toks, say)
    for key, view in KIND_SECTIONS:  # the mixer's own sections, those its kind declared: drawn as they are present
        if key in by:
            view(console, by[key], toks, say)
    if Section.QKV in by:
        _qkv(console, by[Section.QKV], say)
    if Section.ROPE in by:
        _rope(console, by[Section.ROPE], say)
    if Section.ATTENTION in by:
        _attention(console, by[Section.ATTENTION], heads, by[Section.ATTENTION_MAP], toks, say)
    _residual(console, by[Section.RESIDUAL], toks, say)
    if Section.ROUTER in by:
        _router(console, by[Section.ROUTER], toks, say)
    else:
        _ffn(console, by[Section.FFN], toks, say)
    if Section.STATE_CACHE in by:
        state_cache(console, by[Section.STATE_CACHE], say)
    elif Section.MEMORY in by:
        _memory(console, by[Section.MEMORY], say)
    else:
        _kv(console, by[Section.KV_CACHE], say)
    _lens_here(console, lens_rows, by[Section.MODEL], say)
    _tensors(console, tensors, trace_points(events), say)


def _batch_masks(console: Console, events: list[dict], say: Say, most: int = 24) -> None:
    """s3 with several prompts: each row's combined causal and padding mask, query rows × key columns (the last
    `most` slots of a longer batch): █ attended, · in the future (causal), ░ a pad slot (padding)."""
    ev = next((e for e in events if e["event"] == "batch"), None)
    if ev is None:
        return
    T = len(ev["ids"][0])
    cut = max(0, T - most)
    source = say("explain.batch.pad" if ev["pad_source"] == "pad" else "explain.batch.eos")
    _title(console, say("explain.batch.title", rows=ev["rows"], T=T, pad_id=ev["pad_id"], source=source)
           + (say("explain.batch.slots", lo=cut, hi=T - 1) if cut else ""))
    # explain's batch event carries each row's combined mask; generate's has only the padding, so causal is added here
    combined = ev.get("combined_mask") or [[[bool(pad[j]) and j <= i for j in range(T)] for i in range(T)]
                                           for pad in ev["attention_mask"]]
    for r, (mask, pad) in enumerate(zip(combined, ev["attention_mask"])):
        here = say("explain.batch.here") if r == ev.get("explained_row") else ""
        console.print(Text(say.n("explain.batch.row", sum(pad), row=r, last=sum(pad) - 1) + here, style="bold"))
        for i in range(cut, T):
            line = Text("  ")
            for j in range(cut, T):
                if not pad[j] or not pad[i]:
                    line.append("░", style="grey42")
                else:
                    line.append("█" if mask[i][j] else "·", style="gold1" if mask[i][j] else "grey42")
            console.print(line)


def _header(console: Console, m: dict, tokens: dict, say: Say) -> None:
    info = m["model"]
    L = info["n_layers"]
    where = say("explain.header.layer", layer=m["layer"], last=L - 1) if m.get("layer") is not None else ""
    console.print(Text.assemble(verbatim(f"llmtrace {m['command']}", "bold"), where, " · ",
                                verbatim(f"{info['name']} · {info['arch']}"),
                                f" · D={info['d_model']} · H={info['n_heads']} · Hkv={info['n_kv_heads']} · "
                                f"Dh={info['head_dim']} · F={info['ffn_dim']} · ",
                                verbatim(f"{info['device']} {info['dtype']}"),
                                say("explain.header.chat") if m.get("chat") else ""))
    from llmtrace.render.generate import print_changes, print_parts, storage_parts

    print_changes(console, info, say)
    if info.get("storage"):
        print_parts(console, [say("explain.header.weights"), *storage_parts(info["storage"], say("unit.per_weight"))])
    if m.get("interventions"):
        print_parts(console, [say("explain.header.interventions"), *(iv["label"] for iv in m["interventions"])],
                    style="yellow")
    if info.get("exact") is False:
        from llmtrace.trace.records import fast_parts

        print_parts(console, fast_parts(info["fast"]), style="yellow")
    toks = tokens["tokens"]
    shown = toks if len(toks) <= 40 else toks[:20] + [None] + toks[-19:]
    line = Text(say.n("explain.tokens", len(toks)), style="bold")
    for i, t in enumerate(shown):
        if i:
            line.append(" · ", style="dim")
        if t is None:
            line.append(say("explain.tokens.more", n=len(toks) - 39), style="dim")
            continue
        line.append(f"{t['index']}:", style="dim")
        line.append_text(_tokt(t["text"], 16, "magenta" if t.get("special") else None))
    console.print(line)


def _layer(console: Console, ev: dict, say: Say) -> None:
    n = ev["layer"]
    _title(console, say("explain.layer.title", layer=n, k=n + 1, of=ev["n_layers"]))
    t = _table((say("explain.col.step"), "left"), (say("explain.col.weight"), "left"),
               (say("explain.col.shape_xw"), "left"), (say("explain.col.parameters"), "right"),
               (say("explain.col.of_layer"), "right"))
    for p in ev["params"]:
        t.add_row(*_names(p["seed_step"], p["name"], shape_text(p["shape"])), f"{p['numel']:,}",
                  f"{p['numel'] / ev['layer_params']:.1%}")
    t.add_row("", Text(say("explain.layer.total"), style="bold"), "", Text(f"{ev['layer_params']:,}", style="bold"),
              "100%")
    print_fitted(console, t, say)
    _note(console, say("explain.layer.share", share=f"{ev['share']:.2%}", params=f"{ev['model_params']:,}",
                       layers=f"{ev['share_of_layers']:.2%}", embedding=f"{ev['embedding_params']:,}"))
    if "model_active_params" in ev:  # a mixture of experts
        _note(console, say("explain.layer.active", n=f"{ev['layer_active_params']:,}",
                           share=active_share(ev["model_active_params"], ev["model_params"], say)))
    f = ev["flops"]
    T = ev["n_tokens"]
    t = _table((say("explain.flops.title"), "left"), (say("explain.flops.formula", T=T), "left"),
               (say("explain.col.flops"), "right"))
    for _, label, formula, value in f["rows"]:  # as the layer's kinds declare them: the label an (en, zh) pair
        t.add_row(say.pick(label), verbatim(formula), f"{value:,}")
    t.add_row(Text(say("explain.layer.total"), style="bold"), "", Text(f"{f['total']:,} ({_si(f['total'])})", style="bold"))
    print_fitted(console, t, say)
    note = f.get("note_words") or f.get("note")  # the mixer's note, an (en, zh) pair (a trace before: English)
    _note(console, say("explain.flops.note") + (say("explain.sep") + say.pick(note) if note else ""))


def _rmsnorm(console: Console, evs: list[dict], toks: list[str], say: Say) -> None:
    a = evs[0]
    if len(evs) == 2 and [e["norm"] for e in evs] == [ATTN_NORM.name, FFN_NORM.name]:
        title = say("explain.rmsnorm.two")
    else:
        title = "(" + ", ".join(f"{e['norm']} {e['seed_step']}" for e in evs) + ")"
    _title(console, say("explain.rmsnorm.title", n=len(evs), which=title))
    for ev in evs:
        _formula(console, ev["formula"])
    _note(console, say("explain.rmsnorm.eps", eps=f"{a['eps']:g}"))
    for ev in evs:
        g = ev["gamma"]
        dims = ", ".join(f"{d}:{v:.3f}" for d, v in zip(g["top_dims"][:3], g["top_values"][:3]))
        _note(console, say("explain.rmsnorm.gamma", norm=ev["norm"], mean=f"{g['mean']:.4f}", min=f"{g['min']:.4f}",
                           max=f"{g['max']:.4f}", dims=dims, diff=fmt_num(ev["check_max_abs_diff"])))
    if len(evs) == 2:
        t = _table((say("explain.col.pos"), "right"), (say("explain.col.token"), "left"), ("RMS(x)", "right"),
                   ("‖x‖", "right"), ("‖x/RMS‖", "right"), ("‖γ⊙x/RMS‖", "right"), (say("explain.col.ffn_rms"), "right"),
                   ("‖x'‖", "right"), ("‖γ⊙x'/RMS‖", "right"))
        cells = lambda r, s: [fmt_num(r["rms"]), fmt_num(r["norm_in"]), fmt_num(r["norm_unit"]),  # noqa: E731
                              fmt_num(r["norm_out"]), fmt_num(s["rms"]), fmt_num(s["norm_in"]), fmt_num(s["norm_out"])]
    else:  # a family's extra norms: each norm's input RMS and output length
        t = _table((say("explain.col.pos"), "right"), (say("explain.col.token"), "left"),
                   *[c for e in evs for c in ((say("explain.col.norm_rms", norm=e["norm"]), "right"),
                                              (say("explain.col.norm_out"), "right"))])
        cells = lambda *rows: [fmt_num(r[k]) for r in rows for k in ("rms", "norm_out")]  # noqa: E731
    for i in _sample_rows(len(a["tokens"])):
        if i is None:
            t.add_row("…", "", *[""] * (len(t.columns) - 2))
            continue
        t.add_row(str(i), _tokt(toks[i]), *cells(*(e["tokens"][i] for e in evs)))
    print_fitted(console, t, say)
    _note(console, say("explain.rmsnorm.why", sqrt_d=f"{a['d_model'] ** 0.5:.2f}"))


def _qkv(console: Console, ev: dict, say: Say) -> None:
    H, Hkv, Dh = ev["n_heads"], ev["n_kv_heads"], ev["head_dim"]
    _title(console, say("explain.qkv.title", H=H, Hkv=Hkv, Dh=Dh))
    t = _table((say("explain.col.projection"), "left"), (say("explain.col.shape"), "left"),
               (say("explain.col.split"), "left"), (say("explain.col.heads_first"), "left"))
    for s in ev["shapes"]:
        t.add_row(*_names(s["name"], shape_text(s["shape"]), shape_text(s["split"]) if "split" in s else "",
                          shape_text(s["heads_first"]) if "heads_first" in s else ""))
    print_fitted(console, t, say)
    if Hkv < H:
        console.print(Text(say("explain.qkv.gqa", g=ev["group_size"]), style="bold"))
        for g, qs in enumerate(ev["groups"]):
            console.print(say("explain.qkv.group", kv=g, q=", ".join(map(str, qs))))
    else:
        console.print(say("explain.qkv.mha"))
    c = ev["cache"]
    _note(console, say("explain.qkv.cache", Hkv=Hkv, Dh=Dh, e=c["element_size"],
                       bytes=f"{c['bytes_per_position_layer']:,}", mha=f"{c['mha_bytes_per_position_layer']:,}",
                       saving=f"{c['saving']:g}", prompt=human_bytes(c["bytes_prompt_model"]),
                       mha_prompt=human_bytes(c["mha_bytes_prompt_model"])))


def _attention_words(plan: dict, say: Say) -> str:
    """Which keys the layer's queries read, or what its kind is (its summary, an (en, zh) pair)."""
    summary = (plan.get("headings") or {}).get("summary")
    if summary:
        return say.pick(summary)
    if plan.get("window"):
        return say("explain.steps.window", n=f"{plan['window']:,}")
    return say("explain.steps.global") if plan.get("attention") == "global" else plan.get("attention", "")


def _rope_words(plan: dict, say: Say) -> str:
    """This layer's RoPE in words: its base, its rotary width where it turns part of a head, its scaling; or none."""
    r = plan.get("rope")
    if not r:
        return say("explain.steps.rope_none")
    base = r["base"]
    out = say("explain.steps.rope_base", base=f"{base:,.0f}" if float(base).is_integer() else f"{base:,g}")
    if r.get("rotary_dim") != r.get("head_dim"):
        out += say("explain.steps.rope_width", dr=r["rotary_dim"], dh=r["head_dim"])
    kind = (r.get("scaling") or {}).get("rope_type")
    return out + (say("explain.steps.rope_scaled", kind=kind) if kind and kind != "default" else "")


def _steps(console: Console, ev: dict, say: Say) -> None:
    """Each point of the layer with the operation the model declares, and the check on this pass."""
    plan = ev["plan"]
    _title(console, say("explain.steps.title", layer=ev["layer"], attention=_attention_words(plan, say),
                        rope=_rope_words(plan, say), ffn=say(f"explain.steps.ffn.{plan['ffn']}")))
    t = _table((say("explain.col.point"), "left"), (say("explain.col.op"), "left"),
               (say("explain.col.formula"), "left"), (say("explain.col.check"), "right"))
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
        t.add_row(*_names(r["point"], r["op"], r["formula"]), mark)
    console.print(t)
    checked = sum(r["check"] is not None for r in ev["steps"])
    agree = say("explain.steps.all_agree") if not bad else say.n("explain.steps.disagree", bad)
    _note(console, say.n("explain.steps.checked", len(ev["steps"]), checked=checked, agree=agree))


def _rope(console: Console, ev: dict, say: Say) -> None:
    if ev.get("rotation") == "none":
        _title(console, say("explain.rope.none_title"))
        _formula(console, ev["formula"])
        console.print(Text(say("explain.rope.none_why")))
        _note(console, say("explain.rope.none_check", diff=fmt_num(ev["check_q_rope_max_abs_diff"])))
        return
    scaling = say("explain.rope.no_scaling") if not ev["scaling"] else say("explain.rope.scaling")
    table = say("explain.rope.local_table") if ev.get("rope_table") == "local" else ""
    width = (say("explain.rope.width", dr=ev["rotary_dim"], dh=ev["head_dim"])
             if ev.get("rotary_dim", ev["head_dim"]) != ev["head_dim"] else "")
    theta = ev["theta"]
    base = f"{theta:,.0f}" if float(theta).is_integer() else f"{theta:,g}"  # 1,000,000 as the steps' formula says it
    console.print()
    console.print(Text.assemble(say("explain.rope.title", base=base, table=table, width=width, scaling=scaling),
                                verbatim(", ".join(f"{k}={v}" for k, v in (ev["scaling"] or {}).items())),
                                style="bold cyan"))  # the scaling's fields as the config names them
    _formula(console, ev["formula"])
    n = len(ev["pairs"][0]["angles"])
    cols = list(range(min(n, 6))) + ([n - 1] if n > 6 else [])
    t = _table((say("explain.col.pair"), "right"), (say("explain.col.dims"), "left"),
               (say("explain.col.theta"), "right"), (say("explain.col.turn"), "right"),
               *[(say("explain.col.pos_n", p=p), "right") for p in cols])
    for p in ev["pairs"]:
        turn = say("explain.rope.every", n=f"{p['wavelength']:.3g}") if p["wavelength"] is not None else say(
            "explain.rope.still")
        t.add_row(str(p["i"]), f"{p['dims'][0]}, {p['dims'][1]}", f"{p['theta_i']:.3g}", turn,
                  *[f"{p['angles'][c]:.3g}" for c in cols])
    print_fitted(console, t, say)
    _note(console, say("explain.rope.angles"))
    r = ev["relative"]
    console.print(Text(say("explain.rope.relative", head=r["head"], kv=r["kv_head"]), style="bold"))
    t = _table(("d = m − n", "right"), *[(f"n = {s}", "right") for s in r["shifts"]], (say("explain.col.spread"), "right"))
    for d, row, dev in zip(r["distances"], r["scores"], r["deviation_by_distance"]):
        t.add_row(str(d), *[f"{v:.6f}" for v in row], fmt_num(dev))
    print_fitted(console, t, say)
    ok = r["max_deviation"] <= 1e-4
    console.print(Text(("✓ " if ok else "✗ ") + say("explain.rope.same", spread=fmt_num(r["max_deviation"])),
                       style="green" if ok else "red"))
    _note(console, say("explain.rope.tables", q=fmt_num(ev["check_q_rope_max_abs_diff"]),
                       k=fmt_num(ev["check_k_rope_max_abs_diff"])))


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


def _attention(console: Console, ev: dict, heads: list[dict], amap: dict, toks: list[str], say: Say) -> None:
    H, T, _ = ev["shape"]
    _title(console, say("explain.attention.title", shape=shape_text(ev["shape"])))
    window = ev.get("window")
    which = say("explain.attention.masked_window", w=window) if window else say("explain.attention.masked")
    _formula(console, ev["formula"])
    _note(console, say.n("explain.attention.mask", ev["masked"], which=which))
    _note(console, say("explain.attention.range", a=fmt_num(ev["pre_mask"]["min"]), b=fmt_num(ev["pre_mask"]["max"]),
                       c=fmt_num(ev["post_mask"]["min"]), d=fmt_num(ev["post_mask"]["max"]),
                       e=fmt_num(ev["row_sum_max_error"])))
    ex = ev["example"]
    scores = _matrix_table(say("explain.attention.scores", head=ex["head"]), ex["scores"], ex["masked_scores"])
    probs = _matrix_table("softmax P", ex["probs"])
    if console.measure(scores).maximum + console.measure(probs).maximum + 3 <= console.width:
        grid = Table.grid(padding=(0, 3))  # side by side when they fit
        grid.add_row(scores, probs)
        console.print(grid)
    else:
        print_fitted(console, scores, say)
        print_fitted(console, probs, say)
    if ex["positions"] < T:
        _note(console, say.n("explain.attention.first", ex["positions"], T=T))
    # for each head, the position each query attends to most
    console.print(Text(say("explain.attention.argmax"), style="bold"))
    for lo in range(0, H, 10):
        chunk = heads[lo:lo + 10]
        t = _table((say("explain.col.pos"), "right"), (say("explain.col.token"), "left"),
                   *[(f"h{h['head']}", "right") for h in chunk])
        for i in _sample_rows(T):
            if i is None:
                t.add_row("…", "", *[""] * len(chunk))
                continue
            t.add_row(str(i), _tokt(toks[i], 10), *[f"{h['argmax'][i]}:{h['weight'][i]:.2f}" for h in chunk])
        t.add_row("", Text(say("explain.attention.mean_on_0"), style="dim"),
                  *[Text(f"{h['first_token_weight']:.2f}", style="dim") for h in chunk])
        print_fitted(console, t, say)
    _heatmap(console, amap, toks, say)


def _heatmap(console: Console, amap: dict, toks: list[str], say: Say) -> None:
    bins, m = amap["bins"], amap["matrix"]
    window = amap.get("window")
    how = (say.n("explain.map.binned", amap["n_tokens"], bins=len(bins)) if amap["binned"] else
           say.n("explain.map.positions", amap["n_tokens"]))
    what = say("explain.map.head", head=amap["head"]) if amap.get("head") is not None else say("explain.map.mean")
    console.print(Text(say("explain.map.title", what=what, how=how, pick=in_words("`head`")),
                       style=Style(bold=True, meta={"role": "attention_map"})))  # the page puts its grid here
    if window:
        _note(console, say("explain.map.window", w=window))
    elif amap.get("model_window"):
        _note(console, say("explain.map.global", w=amap["model_window"]))
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
        line = Text(f"{label} ", style="dim")
        line.append_text(verbatim(name.ljust(label_w - len(label) - 1)[:max(0, label_w - len(label) - 1)], "dim"))
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
    legend.append(say("explain.map.legend_window" if window else "explain.map.legend"), style="dim")
    console.print(legend)


def _residual(console: Console, ev: dict, toks: list[str], say: Say) -> None:
    title = Text(say("explain.residual.title"), style="bold cyan")
    title.append_text(verbatim(ev["formula"].partition(";")[0], "bold cyan"))
    console.print()
    console.print(title)
    t = _table((say("explain.col.pos"), "right"), (say("explain.col.token"), "left"), ("‖x‖", "right"),
               ("‖attn‖", "right"), ("‖attn‖/‖x‖", "right"), ("cos(x,attn)", "right"), ("cos(x,x')", "right"),
               ("‖x''−x‖/‖x‖", "right"), ("cos(x,x'')", "right"))
    for i in _sample_rows(len(ev["tokens"])):
        if i is None:
            t.add_row("…", "", *[""] * 7)
            continue
        r = ev["tokens"][i]
        t.add_row(str(i), _tokt(toks[i]), fmt_num(r["norm_in"]), fmt_num(r["norm_attn"]), fmt_num(r["attn_to_stream"]),
                  _f(r["cos_attn_stream"], 3), _f(r["cos_attn"], 5), fmt_num(r["rel_change_layer"]), _f(r["cos_layer"], 5))
    print_fitted(console, t, say)
    _note(console, say("explain.residual.why"))


def _ffn(console: Console, ev: dict, toks: list[str], say: Say) -> None:
    chain = " → ".join(f"{s['name']} {shape_text(s['shape'])}" for s in ev["shapes"])
    _title(console, say("explain.ffn.title", kind=ev.get("kind", "SwiGLU")))
    fn = ev.get("activation", "silu")
    _formula(console, ev["formula"])
    console.print(verbatim(chain))
    _note(console, say("explain.ffn.gate", fn=fn, t=f"{ev['near_zero_threshold']:g}",
                       near=f"{ev['near_zero_fraction']:.1%}", neg=f"{ev['negative_gate_fraction']:.1%}",
                       mean=fmt_num(ev["silu_gate"]["mean"]), max=fmt_num(ev["silu_gate"]["max"]),
                       diff=fmt_num(ev["check_act_max_abs_diff"])))
    t = _table((say("explain.col.pos"), "right"), (say("explain.col.token"), "left"),
               (say("explain.col.units_off"), "right"), ("‖act‖", "right"), ("‖down‖", "right"),
               ("‖down‖/‖x'‖", "right"), ("cos(x', x'')", "right"))
    for i in _sample_rows(len(ev["tokens"])):
        if i is None:
            t.add_row("…", "", *[""] * 5)
            continue
        r = ev["tokens"][i]
        t.add_row(str(i), _tokt(toks[i]), f"{r['near_zero_fraction']:.1%}", fmt_num(r["norm_act"]), fmt_num(r["norm_down"]),
                  fmt_num(r["rel_change"]), _f(r["cos"], 5))
    print_fitted(console, t, say)
    tu = ev["top_units"]
    line = Text(say("explain.ffn.top", pos=tu["position"]), style="bold")
    line.append_text(_tokt(toks[tu["position"]], style="bold"))
    line.append(say("explain.ffn.top_end"), style="bold")
    console.print(line)
    t = _table((say("explain.col.unit"), "right"), ("gate", "right"), (f"{fn}(gate)", "right"), ("up", "right"),
               ("act", "right"))
    for u in tu["units"]:
        t.add_row(str(u["unit"]), fmt_num(u["gate"]), fmt_num(u["silu_gate"]), fmt_num(u["up"]), fmt_num(u["act"]))
    print_fitted(console, t, say)


def active_share(n_active: int, n_total: int, say: Optional[Say] = None) -> str:
    """'1.1M active of 4.2M'."""
    return (say or Say())("explain.active", active=_si(n_active), total=_si(n_total))


def _router(console: Console, ev: dict, toks: list[str], say: Say, shown: int = 12) -> None:
    """A mixture-of-experts layer's router, a row per prompt token: each expert's probability (chosen ones bold,
    the K-th marked where the cut falls) when the E columns fit, else the 2K most probable; the weights; entropy."""
    E, K = ev["n_experts"], ev["k"]
    _title(console, say.n("explain.router.title", E, k=K, width=f"{ev['expert_ffn_dim']:,}"))
    _formula(console, ev["formula"])
    wide = E <= shown
    cols = [(say("explain.col.pos"), "right"), (say("explain.col.token"), "left")] + (
        [(f"e{e}", "right") for e in range(E)] if wide else [(say("explain.router.top", n=min(E, 2 * K)), "left")])
    t = _table(*cols, (say("explain.col.weights"), "left"), ("bits", "right"), ("‖ffn‖/‖x'‖", "right"))
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
        t.add_row(str(r["position"]), _tokt(toks[r["position"]]), *cells, weights, _f(r["entropy"], 2),
                  fmt_num(r["rel_change"]))
    print_fitted(console, t, say)
    gap = [r["cut"] - r["next"] for r in ev["tokens"] if r["next"] is not None]
    how = say("explain.router.renormalised" if ev["renormalised"] else "explain.router.as_given")
    margin = say("explain.router.margin", m=f"{min(gap):.3f}") if gap else ""
    _note(console, say("explain.router.legend", margin=margin, how=how, E=E, bits=f"{math.log2(E):.2f}"))
    imb = say("explain.router.imbalance", x=f"{ev['imbalance']:.2f}") if ev.get("imbalance") is not None else ""
    _note(console, say("explain.router.load", load=" ".join(f"e{e} {n}" for e, n in enumerate(ev["load"])) + imb))


def _kv(console: Console, ev: dict, say: Say) -> None:
    lo, hi = ev["positions"]
    _title(console, say("explain.kv.title", lo=lo, hi=hi))
    console.print(say("explain.kv.bytes", k=shape_text(ev["shape_k"]), v=shape_text(ev["shape_v"]),
                      e=ev["element_size"], bytes=f"{ev['bytes']:,}", per=f"{ev['bytes_per_position']:,}",
                      all=human_bytes(ev["all_layers_bytes"])))
    _note(console, say("explain.kv.mha", bytes=f"{ev['mha_bytes']:,}"))


def _memory(console: Console, ev: dict, say: Say) -> None:
    """s6.8 a layer's memory as its kind declares it (an MLA layer's latent and RoPE key)."""
    m = ev["record"]
    parts = say("explain.and").join(f"{name} {shape_text(shape)}" for name, shape in m["per_token"].items())
    _title(console, say("explain.memory.title", parts=parts, n=ev["n_positions"]))
    console.print(say("explain.memory.bytes", per=f"{m['per_token_bytes']:,}", bytes=f"{ev['bytes']:,}",
                      all=human_bytes(ev["all_layers_bytes"])))
    if m["mha_per_token_bytes"]:
        _note(console, say("explain.memory.mha", bytes=f"{ev['mha_bytes']:,}",
                           x=f"{m['mha_per_token_bytes'] / max(m['per_token_bytes'], 1):.1f}"))


def _cand(c: dict) -> Text:
    return Text.assemble(_tokt(c["text"], 14, _prob_style(c["prob"])), (f" {c['prob']:.3f}", "dim"))


def _lens_here(console: Console, rows: list[dict], m: dict, say: Say) -> None:
    mid = next(r for r in rows if r["stage"] == RESID_MID.name)
    post = next(r for r in rows if r["stage"] == RESID_POST.name)
    final = next(r for r in rows if r["stage"] == LOGITS.name)
    L = m["model"]["n_layers"]
    _title(console, say("explain.lens.title", layer=mid["layer"], pos=mid["position"]))
    _note(console, say("explain.lens.what"))
    t = _table((say("explain.col.rank"), "right"), (say("explain.lens.mid"), "left"), (say("explain.lens.post"), "left"),
               (say("explain.lens.real", last=L - 1), "left"))
    for k in range(len(final["topk"])):
        t.add_row(str(k + 1), _cand(mid["topk"][k]), _cand(post["topk"][k]), _cand(final["topk"][k]))
    print_fitted(console, t, say)


def _tensors(console: Console, tensors: list[dict], points, say: Say) -> None:
    if not tensors:
        return
    _title(console, say("explain.tensors.title", layer=tensors[0]["layer"]))
    t = _table((say("explain.col.step"), "left"), (say("explain.col.point"), "left"), (say("explain.col.shape"), "left"),
               (say("explain.col.mean"), "right"), (say("explain.col.std"), "right"), (say("explain.col.min"), "right"),
               (say("explain.col.max"), "right"), ("‖x‖", "right"))
    for ev in tensors:
        s = ev["stats"]
        t.add_row(*_names(ev.get("seed_step") or "", ev["name"],
                          shape_text(ev["shape"], axes_for(points, ev["name"], ev["shape"]))),
                  fmt_num(s["mean"]), fmt_num(s["std"]), fmt_num(s["min"]), fmt_num(s["max"]), fmt_num(s["norm"]))
    print_fitted(console, t, say)


# ----------------------------------------------------------------------------------------------------------------
# the lens view


def render_lens(events: list[dict], console: Console, say: Optional[Say] = None) -> None:
    say = say or Say()
    m = next((e for e in events if e["event"] == "explain" and e["section"] == "model"), None)
    tokens = next((e for e in events if e["event"] == "tokens"), None)
    cells: dict[tuple, dict] = {}
    for ev in events:
        if ev["event"] == "lens":
            cells[(ev["layer"] if ev["stage"] != LOGITS.name else "out", ev["position"])] = ev
    if _cut_short(console, events, m, tokens, complete=m is not None and ("out", m["positions"][-1]) in cells, say=say):
        return
    toks = tokens["tokens"]
    _header(console, m, {"tokens": toks}, say)
    _batch_masks(console, events, say)
    positions, layers = m["positions"], m["layers"]
    L = m["model"]["n_layers"]
    T = len(toks)
    _title(console, say("lens.title", lo=positions[0], hi=positions[-1], last=T - 1))
    # one space between columns; cells as wide as the console allows (6 characters for 12 columns at 100), 4 to 12
    w = max(4, min(12, (console.width - 6) // len(positions) - 1))
    t = Table(box=None, padding=(0, 0, 0, 1), header_style="bold", pad_edge=False)
    t.add_column(say("lens.layer"), justify="right")
    for p in positions:
        t.add_column(Text.assemble(f"{p}\n", verbatim(_tok(toks[p]['text'], w))), width=w, no_wrap=True,
                     overflow="ellipsis")
    rows = list(layers) + ([] if L - 1 in layers else ["out"])
    styled = console.color_system is not None  # a pipe, a file or NO_COLOR: no colour, no underline
    for layer in rows:
        line = []
        for p in positions:
            c = cells[(layer, p)]["topk"][0]
            hit = p + 1 < T and c["id"] == toks[p + 1]["id"]
            if styled:
                line.append(_tokt(c["text"], w, _prob_style(c["prob"]) + (" underline" if hit else "")))
            else:
                line.append(_tokt(c["text"], w - 1) + "*" if hit else _tokt(c["text"], w))
        t.add_row(str(layer), *line)
    print_fitted(console, t, say)
    if styled:
        legend = Text(say("lens.legend"))
        for lo, style in PROB_STYLES:
            legend.append(f"≥{lo:.0%} " if lo else "<5%", style=style)
            legend.append("  ")
        legend.append(say("lens.underlined"), style="underline")
    else:
        legend = Text(say("lens.star"))
    console.print(legend)
    last = positions[-1]
    fin = cells[("out", last)] if ("out", last) in cells else None
    if fin is not None:
        top = Text()
        for i, c in enumerate(fin["topk"][:5]):
            top.append_text(Text(", " if i else "") + verbatim(visible(c["text"])) + Text(f" {c['prob']:.3f}"))
        row = say("lens.row_exact", layer=L - 1) if L - 1 in layers else say("lens.row_out")
        note = Text(say("lens.real", pos=last), style="dim")
        note.append_text(top)
        note.append(row)
        console.print(note)
