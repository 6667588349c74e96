"""The report page: HTML and inline SVG made here, from `extract`'s data, readable before any script runs.

Everything a reader needs at first sight is drawn in Python: the run's facts, the pipeline with its shapes, the token
chips, every step's top-k chart and sampler funnel (one panel per step; the script only shows the chosen one), the
logit lens table, and the KV cache and residual stream charts. The script (assets/report.js) adds what needs
interaction: the attention heatmap on a canvas, the per-layer statistics of a pipeline stage, selection and keys.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path
from typing import Any, Optional

from llmtrace.trace.records import fast_parts
from llmtrace.units import human_bytes

# viridis: perceptually even and readable with the common colour-vision deficiencies
PALETTE = ("#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b",
           "#fde725")


def colour(x: Optional[float]) -> str:
    """A value in [0, 1] on the palette (linear between its stops); grey for a missing value."""
    if x is None:
        return "#bbbbbb"
    x = min(1.0, max(0.0, float(x))) * (len(PALETTE) - 1)
    i = min(int(x), len(PALETTE) - 2)
    f = x - i
    a, b = PALETTE[i], PALETTE[i + 1]
    mix = [round(int(a[k:k + 2], 16) * (1 - f) + int(b[k:k + 2], 16) * f) for k in (1, 3, 5)]
    return "#%02x%02x%02x" % tuple(mix)


def ink(x: Optional[float]) -> str:
    """Text colour readable on colour(x)."""
    return "#000" if x is not None and x >= 0.55 else "#fff"


def e(x: Any) -> str:
    return escape(str(x), quote=True)


def visible(text: str) -> str:
    """A token's text as the terminal shows it (▁ for a space, \\n, <U+00A0>: tokens.token_facts.visible_text); ∅ when
    empty."""
    from llmtrace.tokens.token_facts import visible_text

    return visible_text(text.encode("utf-8", errors="surrogatepass")) or "∅"


def num(x: Any, digits: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:.{digits}g}"


def fill_command(d: dict, command: str) -> str:
    """The exact command that records what this trace lacks, for its prompt and model: `generate` (steps, per-layer
    statistics, attention, the KV cache, the residual stream), `lens` or `explain`."""
    import shlex

    from llmtrace.registry.models_toml import default_model, load_registry

    r = d["run"]
    prompt = "PROMPT --chat" if r["chat"] else shlex.quote(r["prompt"])  # a chat trace keeps only the templated text
    name = r["model"]["name"]
    try:
        known = name in load_registry()
    except Exception:  # a broken user models.toml must not stop a report
        known = False
    # a model loaded from a file or a directory is named by its file's stem in the trace, not by its path
    model = "" if name == default_model() else f" -m {shlex.quote(name)}" if known else " -m MODEL_PATH"
    if command == "lens":
        return f"llmtrace lens {prompt}{model} --positions all --html lens.html"
    if command == "explain":
        return f"llmtrace explain {prompt}{model} --layer 0 --html explain.html"
    layers = r["layer"] if r.get("layer") is not None else "0,-1"
    return f"llmtrace generate {prompt}{model} -n 8 --trace full --layers {layers} --html report.html"


def missing(d: dict, what: str, flags: Optional[str] = None, command: str = "generate") -> str:
    """What this trace lacks. A generate page says so where the section stands, with generate's own `flags` or the
    exact command of another (`command`); an explain or lens page leads with what it has and collects what it
    lacks for the one note at its end (`render`), each with the exact command that records it."""
    how = flags if flags and command == d["kind"] == "generate" else fill_command(d, command)
    if d["kind"] != "generate":
        d["lacking"].append((what, fill_command(d, command)))
        return ""
    return f'<p class="missing">Not in this trace: {e(what)}. To record it: <code>{e(how)}</code>.</p>'


def lacking_note(d: dict) -> str:
    """The explain and lens pages' closing note: what the trace lacks, grouped by the command that records it."""
    by: dict[str, list[str]] = {}
    for what, command in d["lacking"]:
        by.setdefault(command, []).append(what)
    items = "".join(f'<li>{e(", ".join(whats))}: <code>{e(command)}</code></li>' for command, whats in by.items())
    return f'<p>This page shows what <code>llmtrace {e(d["kind"])}</code> records. Not in this trace:</p><ul>{items}</ul>'


def _asset(name: str) -> str:
    return (Path(__file__).with_name("assets") / name).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------------
# sections


def intervened(interventions: list[dict]) -> str:
    """The run's interventions in words, naming the layers and heads they change ("none": the model as it is)."""
    if not interventions:
        return "none: the model as it is"
    where = sorted({(iv["layer"], iv.get("head")) for iv in interventions if iv.get("layer") is not None},
                   key=lambda lh: (lh[0], -1 if lh[1] is None else lh[1]))
    places = ", ".join(f"layer {lay}" + ("" if head is None else f" head {head}") for lay, head in where)
    return " · ".join(iv["label"] for iv in interventions) + (f" (changes {places})" if places else "")


def section_run(d: dict) -> str:
    r = d["run"]
    m = r["model"]
    groups = "; ".join(f"KV head {k} ← query heads {', '.join(map(str, g))}" for k, g in enumerate(r["groups"]))
    rows = [
        ("model", f'{m["name"]} ({m.get("arch", "llama")}, {m.get("source", "?")})'),
        ("parameters", num(m.get("n_params"))),
        ("layers × width", f'{m["n_layers"]} × {m["d_model"]} (FFN {m["ffn_dim"]})'),
        ("heads", f'{m["n_heads"]} query heads, {m["n_kv_heads"]} KV heads of width {m["head_dim"]}: '
                  f'GQA, {m["n_heads"] // m["n_kv_heads"]} query heads per KV head'),
        ("GQA groups", groups),
        ("RoPE base θ", num(m.get("rope_theta"), 7) + ("" if not m.get("rope_scaling") else f' (scaling {m["rope_scaling"]})')),
        ("vocabulary", num(m["vocab_size"])),
        ("tied embeddings", "yes" if m.get("tie_embeddings") else "no"),
        ("device · dtype", f'{r["device"]} · {r["dtype"]}'),
        ("exact", "yes: the exact path" if not r.get("fast") else " · ".join(fast_parts(r["fast"]))),
        ("interventions", intervened(r["interventions"])),
        ("threads", num(r["threads"]) if r["threads"] is not None else "not recorded in this trace"),
        ("command", r["command"] + (f' (layer {r["layer"]})' if r["layer"] is not None else "")),
    ]
    s = r["sampling"]
    if s is not None:
        on = ", ".join(s.get("stages") or []) or "none"
        mode = "greedy (argmax)" if s.get("greedy") else "sampling"
        rows.append(("sampling", f'{mode}; temperature {s.get("temperature")}, top-k {s.get("top_k")}, top-p '
                                 f'{s.get("top_p")}, min-p {s.get("min_p")}, typical-p {s.get("typical_p")}; '
                                 f'active stages: {on}' + ("" if s.get("greedy") else f'; seed {s.get("seed")}')))
        rows.append(("stage order", " → ".join(s.get("order") or [])))
        from llmtrace.render.generate import llama_cpp_settings

        extra = llama_cpp_settings(s)
        if extra:
            rows.append(("llama.cpp samplers", "; ".join(extra)))
    if r["trace"] is not None:
        t = r["trace"]
        rows.append(("trace", f'--trace {t.get("level")}, layers {t.get("layers") or "all"}, '
                              f'dumps {", ".join(t.get("dump") or []) or "none"}'))
    sm = r["summary"]
    if sm is not None:
        rows += [
            ("tokens", f'{sm["prompt_tokens"]} prompt + {sm["generated_tokens"]} generated; stopped: {sm["stop_reason"]}'),
            ("time to first token", f'{num(sm["ttft_ms"])} ms'),
            ("prefill · decode", f'{num(sm["prefill_tok_s"])} tok/s · {num(sm["decode_tok_s"])} tok/s'),
        ]
    body = "".join(f"<tr><th scope=row>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows)
    prompt = f'<p class="prompt"><b>Prompt</b>{" (chat template applied)" if r["chat"] else ""}: <q>{e(r["prompt"])}</q></p>'
    out = f'<p>llmtrace {e(r["version"] or "")} · schema llmtrace.trace/1</p>' if r["version"] else ""
    if sm is not None:
        out += f'<p class="prompt"><b>Output:</b> <q>{e(sm["text"])}</q></p>'
    return f'{prompt}{out}<table class="facts">{body}</table>'


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _shape(s: Optional[list]) -> str:
    return "[" + ", ".join(map(str, s)) + "]" if s is not None else "not recorded"


def section_pipeline(d: dict) -> str:
    items = []
    for st in d["pipeline"]["stages"]:
        pts = st["points"]
        detail = ""
        if "shape" in st:
            detail = _shape(st["shape"])
        elif st["id"] == "s3" and st.get("padding"):
            pad = st["padding"]
            real = pad["slots"] - pad["pad_slots"]
            detail = (f'causal + padding: this row is {plural(pad["pad_slots"], "pad slot")} then '
                      f'{plural(real, "token")}, {pad["slots"]} slots like every row of the batch (the shapes below '
                      f'are the padded ones)')
        elif st["id"] == "s3":
            detail = "causal" + (f', {st["masked"]:,} scores masked' if st.get("masked") is not None else "")
        elif "sampler" in st:
            detail = ", ".join(st["active"]) or "none active"
        shapes = "".join(f'<span class="pt">{e(p["name"])} <code>{e(_shape(p["shape"]))}</code></span>'
                         for p in pts if st["id"] != "s3")
        layer = " layer" if st["id"].startswith("s6") else ""
        items.append(f'<li><button class="stage{layer}" data-stage="{e(st["id"])}" aria-pressed="false">'
                     f'<b>{e(st["id"])}</b> {e(st["title"])} <span class="detail">{e(detail)}</span>{shapes}'
                     f'</button></li>')
    note = ("<p>Shapes are those of the prefill (the whole prompt at once); a decode step has one token where the "
            "prefill has T. Select a stage to see its statistics per layer at the chosen step.</p>")
    panel = '<div id="stage-panel" class="panel" aria-live="polite"><p>Select a stage.</p></div>'
    if not d["tensors"]["points"]:
        panel = missing(d, "per-layer statistics", "--trace full") + panel
    return f'{note}<ol class="pipeline">{"".join(items)}</ol>{panel}'


def chip(t: dict) -> str:
    p = t["prob"]
    gen = t["step"] is not None
    style = f' style="background:{colour(p)};color:{ink(p)}"' if gen else ""
    bytes_ = " ".join(f"{b:02x}" for b in t["bytes"])
    label = (f'{"generated at step " + str(t["step"]) if gen else "prompt"} token {t["index"]}: id {t["id"]}, '
             f'vocabulary piece {t["piece"]!r}, bytes {bytes_}' + (f", p = {p:.4g}" if p is not None else ""))
    attrs = f' data-step="{t["step"]}"' if gen else ""
    cls = "chip gen" if gen else "chip"
    if t["special"]:
        cls += " special"
    prob = f'<span class="p">{p:.3f}</span>' if p is not None else ""
    return (f'<button class="{cls}"{attrs}{style} title="{e(label)}" aria-label="{e(label)}">'
            f'<span class="piece">{e(visible(t["text"]))}</span><span class="id">{t["id"]}</span>'
            f'<span class="bytes">{e(bytes_)}</span>{prob}</button>')


def ramp() -> str:
    """The palette as a strip of eleven swatches."""
    stops = "".join(f'<span style="background:{colour(i / 10)}"></span>' for i in range(11))
    return f'<span class="ramp">{stops}</span>'


def legend() -> str:
    return f'<span class="legend">p = 0 {ramp()} 1</span>'


def section_tokens(d: dict) -> str:
    toks = d["tokens"]
    prompt = [t for t in toks if t["step"] is None]
    gen = [t for t in toks if t["step"] is not None]
    out = [f'<p>{plural(len(prompt), "prompt token")}' + (f' and {plural(len(gen), "generated token")}, coloured by the probability the '
                                                f'model gave each one (before the sampler). {legend()}' if gen else ".")
           + ' Each chip shows the text, the id and the UTF-8 bytes. Select a generated token to choose its step.</p>',
           '<div class="chips" id="chips">', "".join(chip(t) for t in toks), "</div>"]
    out.append('<h3 id="merges-title">BPE merges of a word</h3>')
    words = d["merges"]["words"]
    if not words:
        note = d["merges"]["note"] or "the merge story needs the model's tokenizer"
        out.append(f'<p class="missing">{e(note)}.</p>')
        return "".join(out)
    default = max(range(len(words)), key=lambda i: len(words[i]["steps"]))
    buttons = "".join(f'<button class="word" data-word="{i}" aria-pressed="{str(i == default).lower()}">'
                      f'{e(visible(w["text"]))}</button>' for i, w in enumerate(words))
    out.append(f'<p>Each word starts as single bytes (▁ is a space, as everywhere on this page); the pair with '
               f'the lowest merge rank is glued again and again until no pair is in the merge table.</p>'
               f'<div class="words" role="group" aria-label="words">{buttons}</div>')
    for i, w in enumerate(words):
        lines = [f'<div class="merge-line"><span class="pieces">{_pieces(w["start"])}</span> <span class="rank">start</span></div>']
        for s in w["steps"]:
            lines.append(f'<div class="merge-line"><span class="pieces">{_pieces(s["pieces"], s["at"])}</span> '
                         f'<span class="rank">merged {e(s["pair"][0])} + {e(s["pair"][1])} (rank {s["rank"]})</span></div>')
        if w.get("note"):
            lines.append(f'<p class="note">{e(w["note"])}</p>')
        hidden = "" if i == default else " hidden"
        out.append(f'<div class="merge" data-word="{i}"{hidden}>{"".join(lines)}</div>')
    return "".join(out)


def _pieces(pieces: list[str], at: Optional[int] = None) -> str:
    return "<span class=bar>|</span>".join(
        f'<span class="mp{" new" if i == at else ""}">{e(p)}</span>' for i, p in enumerate(pieces))


def topk_svg(step: dict) -> str:
    top = step["topk"] or []
    pick = step["token"]["id"]
    w, row = 560, 22
    h = row * len(top) + 24
    pmax = max((c["prob"] for c in top), default=1.0) or 1.0
    bars = []
    for i, c in enumerate(top):
        y = 20 + i * row
        bw = 250 * c["prob"] / pmax
        cls = "bar pick" if c["id"] == pick else "bar"
        bars.append(f'<text x="108" y="{y + 14}" class="lab" text-anchor="end">{e(visible(c["text"]))}</text>'
                    f'<rect class="{cls}" x="112" y="{y + 2}" width="{bw:.1f}" height="{row - 6}" fill="{colour(c["prob"])}">'
                    f'<title>id {c["id"]} · logit {c["logit"]} · p {c["prob"]}</title></rect>'
                    f'<text x="{116 + bw:.1f}" y="{y + 14}" class="val">{c["prob"]:.4f} · logit {num(c["logit"])}</text>')
    return (f'<svg class="topk" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
            f'aria-label="top {len(top)} candidates at step {step["step"]}"><text x="0" y="12" class="cap">'
            f'top-{len(top)} of the raw distribution (softmax of the logits); outlined: the token chosen</text>'
            f'{"".join(bars)}</svg>')


def funnel(step: dict, vocab: int) -> str:
    from llmtrace.render.generate import stage_line

    stages = step["sampler"] or []
    rng = step["rng"] or {}
    rows = []
    prev = None
    for s in stages:
        frac = math.log(max(1, s["survivors"])) / math.log(vocab) if vocab > 1 else 0  # a log scale: 1 .. V
        kept = ""
        if prev is not None and s["survivors"] < prev["survivors"] and s["pick_prob"] > 0:
            kept = f'{prev["pick_prob"] / s["pick_prob"]:.4f}'  # a truncation renormalises: p_after = p_before / mass kept
        rows.append(f'<tr><th scope=row>{e(s["stage"])}</th><td class="num">{s["survivors"]:,}</td>'
                    f'<td><span class="fbar" style="width:{max(1.0, 100 * frac):.1f}%"></span></td>'
                    f'<td class="num">{s["pick_prob"]:.6g}</td><td class="num">{kept or "—"}</td></tr>')
        why = stage_line(s, step)  # DRY, top-nσ, XTC, mirostat: what it did over the vocabulary, and why
        if why is not None:
            rows.append(f'<tr class="why"><td colspan="5">{e(why)}</td></tr>')
        prev = s
    tok = step["token"]
    if rng.get("greedy") or rng.get("draw") is None:
        draw = f'<p>Greedy: no random draw; the argmax, <b>{e(visible(tok["text"]))}</b> (id {tok["id"]}), is taken.</p>'
    else:
        u = rng["draw"]
        p = stages[-1]["pick_prob"] if stages else None
        draw = (f'<p>The draw: u = {u:.6g} from the generator seeded {rng.get("seed")}. The token is the first id '
                f'whose cumulative probability (in id order) exceeds u; it landed on <b>{e(visible(tok["text"]))}</b> '
                f'(id {tok["id"]}), whose slice of [0, 1) is {num(p)} wide.</p>'
                f'<svg class="draw" viewBox="0 0 400 26" width="400" height="26" role="img" aria-label="draw u = {u:.4f}">'
                f'<rect x="0" y="8" width="400" height="10" class="unit"/>'
                f'<line x1="{400 * u:.1f}" x2="{400 * u:.1f}" y1="2" y2="24" class="u"/>'
                f'<text x="2" y="7" class="cap">0</text><text x="390" y="7" class="cap">1</text></svg>')
    head = ("<tr><th>stage (in the order run)</th><th>candidates</th><th>of the vocabulary (log)</th>"
            "<th>p of the chosen token</th><th>mass kept</th></tr>")
    note = ('<p class="note">Mass kept by a truncation = p(chosen) before ÷ after it (the survivors are renormalised). '
            'Stages that change values (temperature, penalties) keep every candidate.</p>')
    return f'<table class="funnel">{head}{"".join(rows)}</table>{note}{draw}'


def section_steps(d: dict) -> str:
    steps = d["steps"]
    if not steps:
        return missing(d, "generation steps") or None
    vocab = d["run"]["model"]["vocab_size"]
    panels = []
    for i, s in enumerate(steps):
        hidden = "" if i == 0 else " hidden"
        title = (f'Step {s["step"]} ({s["phase"]}, position {s["position"]}): chose '
                 f'<b>{e(visible(s["token"]["text"]))}</b> (id {s["token"]["id"]}) · {num(s["ms"])} ms')
        if s["topk"] is None:
            body = missing(d, "top-k and sampler ledger", "--trace steps (or deeper)")
        else:
            body = f'<div class="two"><div>{topk_svg(s)}</div><div>{funnel(s, vocab)}</div></div>'
        panels.append(f'<div class="step-panel" data-step="{s["step"]}"{hidden}><h3>{title}</h3>{body}</div>')
    return "".join(panels)


def gqa_svg(d: dict) -> str:
    groups = d["run"]["groups"]
    H = sum(len(g) for g in groups)
    w = max(300, 34 * H + 10)
    parts = []
    for k, g in enumerate(groups):
        kx = (g[0] + g[-1]) / 2 * 34 + 20
        parts.append(f'<rect x="{kx - 22:.0f}" y="70" width="44" height="22" class="kvh" data-kv="{k}"/>'
                     f'<text x="{kx:.0f}" y="85" text-anchor="middle">KV {k}</text>')
        for h in g:
            x = h * 34 + 20
            parts.append(f'<line x1="{x}" y1="30" x2="{kx:.0f}" y2="70" class="link" data-head="{h}"/>'
                         f'<rect x="{x - 14}" y="8" width="28" height="22" class="qh" data-head="{h}"/>'
                         f'<text x="{x}" y="23" text-anchor="middle">q{h}</text>')
    return (f'<svg class="gqa" viewBox="0 0 {w} 100" width="{w}" height="100" role="img" '
            f'aria-label="grouped-query attention: which query heads read which KV head">{"".join(parts)}</svg>')


def overview(a: dict) -> str:
    """Every recorded layer and head as a thumbnail (drawn by the script), heads grouped by the KV head they read."""
    if len(a["heads"]) < 2:
        return ""
    rows = []
    for layer in a["layers"]:
        groups = "".join(
            '<span class="kvgroup">' + "".join(
                f'<button class="thumb" data-layer="{layer}" data-hi="{h}" aria-pressed="false" '
                f'aria-label="layer {layer} head {h}"><canvas width="64" height="64"></canvas><span>h{h}</span></button>'
                for h in g) + "</span>" for g in a["groups"])
        rows.append(f'<div class="thumbs"><span class="tl">layer {layer}</span>{groups}</div>')
    return (f'<h3>Every recorded layer and head</h3><p>Query heads are grouped by the KV head they share; select one '
            f'to open it above.</p>{"".join(rows)}')


HEATMAP_PX = 480  # the canvas's side; report.js draws B cells of floor(480 / B) pixels each way
LABEL_PX = 11  # the least pixels a label needs across its line: rows (and columns) narrower than this share one


def heatmap_axes(d: dict) -> str:
    """The heatmap's canvas with its axes labelled in SVG (readable before any script runs): keys along the top,
    queries down the left. Each row and column is a position (its token, made visible) where a label fits the cell;
    where cells are too small, or a cell is a bin of several positions, every k-th cell is labelled with its
    positions instead ("16–31")."""
    bins = d["attention"]["bins"]
    tokens = d["tokens"]
    B = len(bins)
    cell = max(1, HEATMAP_PX // B)
    size = cell * B
    single = all(b1 - b0 == 1 for b0, b1 in bins)
    every = 1 if cell >= LABEL_PX else -(-LABEL_PX // cell)

    def text(i: int) -> str:  # a label covers its cell and the unlabelled ones after it, up to the next label
        b0, b1 = bins[i][0], bins[min(i + every, B) - 1][1]
        if single and every == 1:
            t = visible(tokens[b0]["text"]) if b0 < len(tokens) else ""
            return f"{b0} {t[:9] + '…' if len(t) > 10 else t}"
        return str(b0) if b1 - b0 == 1 else f"{b0}–{b1 - 1}"

    marks = range(0, B, every)
    side = 96
    left = "".join(f'<text x="{side - 4}" y="{(i + 0.5) * cell + 4:.1f}" text-anchor="end" class="cap">{e(text(i))}</text>'
                   for i in marks)
    top = "".join(f'<text transform="translate({(i + 0.5) * cell + 4:.1f},{side - 4}) rotate(-60)" class="cap">'
                  f'{e(text(i))}</text>' for i in marks)
    what = "tokens" if single and every == 1 else "positions"
    return (f'<div class="att-axes" style="grid-template-columns:{side}px {size + 2}px" '
            f'aria-label="keys and queries labelled by {e(what)}">'
            f'<span class="att-corner cap">query ↓ · key →</span>'
            f'<svg class="att-keys" width="{size + 2}" height="{side}" viewBox="-1 0 {size + 2} {side}">{top}</svg>'
            f'<svg class="att-queries" width="{side}" height="{size + 2}" viewBox="0 -1 {side} {size + 2}">{left}</svg>'
            f'<canvas id="att-canvas" width="{size}" height="{size}" tabindex="0" role="img" '
            f'aria-label="attention heatmap; arrow keys move the cursor"></canvas></div>')


def section_attention(d: dict) -> str:
    a = d["attention"]
    gqa = f'<p>Grouped-query attention: the query heads above share the KV head below them.</p>{gqa_svg(d)}'
    if not a["maps"]:
        note = missing(d, "attention probabilities",
                       "--html with any --trace but none (it records the probabilities of --layers), or --dump 0.probs")
        return note + gqa if note else None
    layer_opts = "".join(f'<option value="{l}">layer {l}</option>' for l in a["layers"])
    head_opts = "".join(f'<option value="{i}">{"head " + str(h) if h != "mean" else "mean over heads"}</option>'
                        for i, h in enumerate(a["heads"]))
    n = a["n"]
    binned = (f'The sequence has {n} positions, more than fit a readable map: they are binned into {len(a["bins"])} '
              f'bins (a cell is the mean over its query positions of the sum over its key positions).'
              if a["binned"] else f'One cell per query and key position ({n} × {n}).')
    notes = " ".join(e(x) + "." for x in a["notes"])
    return (f'<p>Rows are queries (the token doing the looking), columns are keys (the tokens looked at). The hatched '
            f'upper triangle is the causal mask: a token never sees a later one. {binned} Values are stored as 16-bit '
            f'fixed point (each within 0.000008 of the trace). {notes} Most heads put much of their weight on the '
            f'first token (the attention sink), which swamps a linear scale: the log and rank scales show the rest.</p>'
            f'<div class="controls"><label>layer <select id="att-layer">{layer_opts}</select></label> '
            f'<label>head <select id="att-head">{head_opts}</select></label> '
            f'<label>scale <select id="att-scale"><option value="log">log</option><option value="linear">linear</option>'
            f'<option value="rank">rank per row</option></select></label> <span class="legend"><span id="att-lo"></span> '
            f'{ramp()} <span id="att-hi"></span></span></div>'
            f'<div class="att">{heatmap_axes(d)}'
            f'<div><p id="att-readout" aria-live="polite">The heatmap needs JavaScript.</p>{gqa}</div></div>'
            f'{overview(a)}')


def section_lens(d: dict) -> str:
    lens = d["lens"]
    if lens is None:
        return missing(d, "the logit lens", command="lens") or None
    pos = lens["positions"]
    head = "".join(f'<th scope=col>{p}<br><span class="tok">{e(visible(lens["pieces"].get(str(p), "")))}</span></th>'
                   for p in pos)
    rows = []
    for ri, r in enumerate(lens["rows"]):
        cells = []
        for p in pos:
            top = r["cells"].get(str(p))
            if not top:
                cells.append("<td></td>")
                continue
            t = top[0]
            tip = " · ".join(f'{visible(c["text"])} {c["prob"]:.3g}' for c in top)
            cells.append(f'<td tabindex="0" data-row="{ri}" data-pos="{p}" style="background:{colour(t["prob"])};'
                         f'color:{ink(t["prob"])}" title="{e(tip)}">{e(visible(t["text"]))}</td>')
        label = "output" if r["stage"] == "logits" else f'layer {r["label"]}'
        rows.append(f'<tr><th scope=row>{e(label)}</th>{"".join(cells)}</tr>')
    return (f'<p>The final norm and the LM head applied to the residual stream after each layer: what the model '
            f'would predict if it stopped there. Columns are prompt positions, headed by the token there; each cell is the '
            f'top-1 prediction of the token after it, coloured by its probability '
            f'{legend()}; hover or select a cell for the top-{len(lens["rows"][0]["cells"][str(pos[0])])}.</p>'
            f'<div class="scroll"><table class="lens"><tr><th></th>{head}</tr>{"".join(rows)}</table></div>'
            f'<div id="lens-panel" class="panel" aria-live="polite"></div>')


def line_chart(series: list[tuple[str, list[tuple[float, float]], str]], xlabel: str, ylabel: str, *,
               marker: bool = False, dots: bool = False, w: int = 560, h: int = 240, ylog: bool = False, fmt=num,
               join: Optional[float] = None) -> str:
    """A small SVG line chart: series of (class, points, title). `join`: points further apart in x than this are not
    joined by a line (a line would show values between them that were never recorded); their dots are drawn."""
    xs = [x for _, pts, _ in series for x, _ in pts]
    ys = [y for _, pts, _ in series for _, y in pts]
    if not xs:
        return ""
    x0, x1 = min(xs), max(xs)
    y1 = max(ys) * 1.05 or 1.0
    L, R, T, B = 64, 12, 24, 34

    def px(x):
        return L + (w - L - R) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)

    def py(y):
        return h - B - (h - T - B) * (y / y1)

    out = [f'<line x1="{L}" y1="{h - B}" x2="{w - R}" y2="{h - B}" class="axis"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{h - B}" class="axis"/>']
    for i in range(5):
        y = y1 * i / 4
        out.append(f'<text x="{L - 4}" y="{py(y) + 4:.1f}" text-anchor="end" class="cap">{e(fmt(y))}</text>')
    for x in sorted({x0, x1, round((x0 + x1) / 2)}):
        out.append(f'<text x="{px(x):.1f}" y="{h - B + 14}" text-anchor="middle" class="cap">{x:g}</text>')
    out.append(f'<text x="{(L + w - R) / 2:.0f}" y="{h - 4}" text-anchor="middle" class="cap">{e(xlabel)}</text>')
    out.append(f'<text x="{L - 60}" y="12" class="cap">{e(ylabel)}</text>')
    for cls, pts, title in series:
        runs: list[list[tuple[float, float]]] = []
        for x, y in pts:
            if runs and (join is None or x - runs[-1][-1][0] <= join):
                runs[-1].append((x, y))
            else:
                runs.append([(x, y)])
        for run in runs:
            if len(run) > 1:
                path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
                out.append(f'<polyline points="{path}" class="{cls}" fill="none"><title>{e(title)}</title></polyline>')
        dots = dots or any(len(run) == 1 for run in runs)
        if dots:
            out.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" class="{cls}"><title>{e(title)}: {e(fmt(y))}'
                       f'</title></circle>' for x, y in pts)
    if marker:
        out.append(f'<line class="marker" x1="{px(x0):.1f}" x2="{px(x0):.1f}" y1="{T}" y2="{h - B}" '
                   f'data-x0="{x0}" data-x1="{x1}" data-l="{L}" data-w="{w - L - R}"/>')
    return f'<svg class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" aria-label="{e(ylabel)}">{"".join(out)}</svg>'


def section_kv(d: dict) -> str:
    kv = d["kv"]
    if kv is None:
        return missing(d, "the KV cache per step") or None
    m = d["run"]["model"]
    pts = [(s["step"], s["bytes_used"]) for s in kv["steps"]]
    mha = [(s["step"], s["mha_bytes_used"]) for s in kv["steps"]]
    chart = line_chart([("mha", mha, "full multi-head attention would need"), ("gqa", pts, "this model's cache (GQA)")],
                       "step", "bytes in the cache", marker=True, fmt=human_bytes)
    last = kv["steps"][-1]
    per_layer = kv["per_layer"]
    el = kv["element_size"]
    H, Hkv, Dh = m["n_heads"], m["n_kv_heads"], m["head_dim"]
    layers = "".join(f'<span class="kvl" style="width:{100 / m["n_layers"]:.3f}%" title="layer {i}: '
                     f'{int(per_layer)} bytes per token"></span>' for i in range(m["n_layers"]))
    return (f'<p>Every step appends one position (K and V, every layer) to the cache. '
            f'<span class="swatch gqa"></span> this model (GQA, {Hkv} KV heads) '
            f'<span class="swatch mha"></span> what {H} KV heads (full multi-head attention) would need.</p>{chart}'
            f'<table class="facts"><tr><th scope=row>bytes per token</th><td>{kv["bytes_per_token"]:,} = 2 (K, V) × '
            f'{m["n_layers"]} layers × {Hkv} KV heads × {Dh} × {el:g} bytes</td></tr>'
            f'<tr><th scope=row>per layer</th><td>{per_layer:,.0f} bytes per token (K {per_layer / 2:,.0f} + V '
            f'{per_layer / 2:,.0f})</td></tr>'
            f'<tr><th scope=row>at the end</th><td>{last["seq_len"]} positions: {human_bytes(last["bytes_used"])} used, '
            f'{human_bytes(last["bytes_allocated"])} allocated; MHA would use {human_bytes(last["mha_bytes_used"])} '
            f'({last["mha_bytes_used"] / max(1, last["bytes_used"]):.1f}×)</td></tr>'
            f'<tr><th scope=row>chosen step</th><td id="kv-now"></td></tr></table>'
            f'<p>The cache by layer (each the same size):</p><div class="kvlayers">{layers}</div>')


def section_residual(d: dict) -> str:
    r = d["residual"]
    if r is None:
        return missing(d, "the residual stream per layer", "--trace layers or --trace full") or None
    xs = r["layers"]
    series = []
    for step in r["steps"]:
        n = r["norms"][str(step)]
        pts = ([(-1, n["embed"])] if "embed" in n else []) + [(l, n[str(l)]) for l in xs if str(l) in n]
        series.append((f"resid s{step}", pts, f"step {step}"))
    chart = line_chart(series, "layer (−1: the embedding)", "‖x‖ per token", fmt=lambda y: f"{y:.4g}",
                       dots=len(xs) < 40, join=1)  # only neighbouring layers are joined: nothing drawn is unrecorded
    n_layers = d["run"]["model"]["n_layers"]
    more = (f' Only layers {", ".join(map(str, xs))} of {n_layers} were recorded, so only neighbouring layers are '
            f'joined by a line; <code>--trace layers</code> without <code>--layers</code> records them all.'
            if len(xs) < n_layers else "")
    return (f'<p>The norm of the residual stream after every recorded layer, one line per step; the chosen step is '
            f'drawn bold. For the prefill (many tokens at once) it is the root mean square of the per-token '
            f'norms.{more}</p>{chart}')


SECTIONS = (
    ("run", "The run", section_run),
    ("pipeline", "The pipeline s1–s12", section_pipeline),
    ("tokens", "Tokens", section_tokens),
    ("steps", "Each step: top-k and the sampler", section_steps),
    ("attention", "Attention", section_attention),
    ("lens", "Logit lens", section_lens),
    ("kv", "The KV cache", section_kv),
    ("residual", "The residual stream", section_residual),
)


def step_bar(d: dict) -> str:
    steps = d["steps"]
    if not steps:
        return ""
    return (f'<div class="stepbar" role="group" aria-label="choose the step"><button id="step-prev" '
            f'aria-label="previous step">◀</button><input id="step" type="range" min="0" max="{len(steps) - 1}" '
            f'value="0" aria-label="step"><button id="step-next" aria-label="next step">▶</button> '
            f'<span id="step-label">step {steps[0]["step"]} of {len(steps)}</span></div>')


def render(d: dict) -> str:
    """The whole page as one string. A section a trace has nothing for (None) is left out: an explain or lens page
    leads with what it has and ends with one note on what it lacks (`lacking_note`); a generate page keeps every
    section and says in place what is missing."""
    d = dict(d, lacking=[], fill=None)
    d["fill"] = fill_command(d, "generate")  # report.js names it where a stage has no statistics
    title = f'llmtrace report · {d["run"]["model"]["name"]} · {d["run"]["prompt"][:60]}'
    shown = [(sid, name, html) for sid, name, fn in SECTIONS if (html := fn(d)) is not None]
    if d["lacking"]:
        shown.append(("lacking", "Not in this trace", lacking_note(d)))
    shown = [(sid, f"{i} · {name}", html) for i, (sid, name, html) in enumerate(shown, 1)]
    nav = " ".join(f'<a href="#{sid}">{e(name.split(" · ")[1])}</a>' for sid, name, _ in shown)
    body = "".join(f'<section id="{sid}" aria-labelledby="{sid}-h"><h2 id="{sid}-h">{e(name)}</h2>{html}</section>'
                   for sid, name, html in shown)
    del d["lacking"]
    data = json.dumps(d, ensure_ascii=False, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'; '
            f'script-src \'unsafe-inline\'; img-src data:">'
            f'<title>{e(title)}</title><style>{_asset("report.css")}</style></head><body>'
            f'<header><h1>llmtrace report</h1><nav>{nav}</nav>{step_bar(d)}</header><main>{body}</main>'
            f'<footer><p>Every number on this page comes from the trace. Made by llmtrace; one file, no network.</p></footer>'
            f'<script type="application/json" id="data">{data}</script>'
            f'<script>window.PALETTE={json.dumps(PALETTE)};</script><script>{_asset("report.js")}</script></body></html>')
