"""The report page: `extract`'s data laid out by jinja2 templates, readable before any script runs.

    data.extract(events) -> one dict of numbers -> view(d): per section, a dict of strings and SVG geometry
                         -> templates/report.html.j2 (the skeleton) + templates/report/SECTION.html.j2 -> one HTML page

Python decides what the page says and where it is drawn: every number is formatted here, and every chart's geometry
(coordinates, bar widths, colours, which labels fit) is computed here. The templates only place those strings and
numbers, autoescaped: no text of a trace reaches the page unescaped. The only raw text is the package's own stylesheet
and script (assets/), inlined as they are.

Everything a reader needs at first sight is in the templates: the run's facts, the pipeline with its shapes, the
token chips, every step's top-k chart and sampler funnel (one panel per step; the script only shows the chosen one),
the logit lens table, and the KV cache and residual stream charts. The script (assets/report.js) adds what needs
interaction: the attention heatmap on a canvas, the per-layer statistics of a pipeline stage, selection and keys.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Callable, Optional

from llmtrace.report import sizes
from llmtrace.report.data import AFTER_EMBEDDING
from llmtrace.report.walk import maths_view
from llmtrace.trace.events import SCHEMA_ID
from llmtrace.units import human_bytes, plural
from llmtrace.words import in_words

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


def count(w, n: int, key: str) -> str:
    """n things in the page's words, agreeing in number: the catalogue's "count.KEY" is "{n} thing|{n} things" (one
    form for a language without plurals)."""
    forms = w(f"count.{key}").split("|")
    return (forms[0] if n == 1 else forms[-1]).format(n=f"{n:,}")


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


def missing(d: dict, what: str, flags: Optional[str] = None, command: str = "generate") -> Optional[dict]:
    """What this trace lacks. A generate page says so where the section stands (the note's {what, how}), with
    generate's own `flags` or the exact command of another (`command`); an explain or lens page leads with what it
    has and collects what it lacks for the one note at its end (`lacking`), each with the exact command that records
    it, and gets None here."""
    what = in_words(d["w"](f"what.{what}"))  # a key of the catalogue's "what." texts, in the front end's words
    how = in_words(flags) if flags and command == d["kind"] == "generate" else fill_command(d, command)
    if d["kind"] != "generate":
        d["lacking"].append((what, fill_command(d, command)))
        return None
    return {"what": what, "how": how}


def lacking(d: dict) -> dict:
    """The explain and lens pages' closing note: what the trace lacks, grouped by the command that records it."""
    by: dict[str, list[str]] = {}
    for what, command in d["lacking"]:
        by.setdefault(command, []).append(what)
    return {"kind": d["kind"], "entries": [{"whats": d["w"]("list.sep").join(whats), "command": command}
                                           for command, whats in by.items()]}


# ----------------------------------------------------------------------------------------------------------------
# the sections: each returns the dict its template (templates/report/ID.html.j2) lays out, {"only_missing": note} for a
# section that only says what is missing, or None for a section left out


def intervened(interventions: list[dict], w=None) -> str:
    """The run's interventions in words, naming the layers and heads they change ("none": the model as it is)."""
    w = w or _english()
    if not interventions:
        return w("run.v.no_interventions")
    where = sorted({(iv["layer"], iv.get("head")) for iv in interventions if iv.get("layer") is not None},
                   key=lambda lh: (lh[0], -1 if lh[1] is None else lh[1]))
    places = ", ".join(w("run.v.layer", layer=lay) if head is None else w("run.v.layer_head", layer=lay, head=head)
                       for lay, head in where)
    return " · ".join(iv["label"] for iv in interventions) + (" " + w("run.v.changes", places=places) if places else "")


@functools.lru_cache(maxsize=1)
def _english():
    from llmtrace.report.i18n import Words

    return Words("en")


def sampling_words(s: dict, w) -> str:
    """The sampler's settings in words: "greedy" at temperature 0, "off" for a truncation that cuts nothing."""
    def off(key: str, value, none) -> str:
        if value is None or value == none:
            return w("run.v.off")
        return f"{value:g}" if isinstance(value, float) else str(value)

    on = w("list.sep").join(word_or(w, f"stage.{x}", x) for x in s.get("stages") or []) or w("run.v.none")
    greedy = bool(s.get("greedy"))
    t = s.get("temperature")
    temp = w("run.v.greedy_temp") if greedy or not t else f"{t:g}"
    text = w("run.v.sampling", mode=w("run.v.greedy") if greedy else w("run.v.sample"), temperature=temp,
             top_k=off("top_k", s.get("top_k"), 0), top_p=off("top_p", s.get("top_p"), 1.0),
             min_p=off("min_p", s.get("min_p"), 0.0), typical_p=off("typical_p", s.get("typical_p"), 1.0), stages=on)
    return text + ("" if greedy else w("run.v.seed", seed=s.get("seed")))


def fast_words(fast: dict, w) -> str:
    """The fast path in the page's words (trace.records.fast_parts is the terminal's)."""
    choice = fast["kernel_choice"]
    if choice.get("kernels"):  # the kernels by name (identifiers, not words to translate)
        kernel = ", ".join(f"{name} ×{n}" for name, n in choice["kernels"].items())
    else:
        kernel = w("run.v.int4") if choice.get("int4") else w("run.v.bf16")
    return w("run.v.fast", dtype=fast["compute_dtype"], kernel=kernel, by=choice.get("capability") or choice["by"])


def glu_of(d: dict) -> str:
    """The gated activation's name as the model declares it (layer 0's act), e.g. SwiGLU or GeGLU."""
    from llmtrace.model.maths import ACTIVATION, glu_name, has_role, op_from_record

    rec = (d.get("maths") or {}).get("record")
    if not rec:
        return "SwiGLU"  # a trace written before the maths was declared: Llama's
    for kind in rec["kinds"]:  # the first gated activation the model declares (OpKind.role)
        act = next((o for o in kind["ops"].values() if has_role(o["op"], ACTIVATION)), None)
        if act:
            return glu_name(op_from_record(act))
    return "GLU"


def step_title(w, sid: str, d: dict) -> str:
    """A seed step's title in the page's words, with what this model declares filled in (its GLU's name)."""
    return w(f"step.{sid}", glu=glu_of(d)) if sid == "s6.7" else w(f"step.{sid}")


def changes_in(m: dict, lang: str) -> list[str]:
    """What the model's family changes from Llama, in the page's language: each line from its family's words by its
    recorded key and arguments (model.family.said_in), else as the trace wrote it."""
    from llmtrace.model.family import said_in

    said = m.get("changes_said") or []
    return [(said_in(m.get("family"), said[i], lang) if i < len(said) and said[i] else None) or line
            for i, line in enumerate(m["changes"])]


def kind_titles(d: dict, lang: str) -> list[dict]:
    """Per kind of layer in the maths record (its `layer_kind` index): the seed steps its kind teaches under titles of
    its own (model.kinds: a linear-attention layer's s6.3 is its convolution, not RoPE), in the page's language."""
    from llmtrace.model.maths import plan_from_record

    rec = (d.get("maths") or {}).get("record")
    if not rec:
        return []
    out = []
    for kind in rec["kinds"]:
        plan = plan_from_record(kind["plan"])
        out.append({sid: plan.heading(sid, lang) for sid in (plan.headings or {}) if sid != "summary"})
    return out


def kind_words(d: dict, w) -> list[str]:
    """Per kind of layer in the maths record: what it is, in the page's words (its own summary where its kind declares
    one; attention over every earlier key or over a window), with its RoPE: the map says it instead of a number."""
    from llmtrace.model.maths import plan_from_record

    rec = (d.get("maths") or {}).get("record")
    out = []
    for kind in (rec or {}).get("kinds", ()):
        plan = plan_from_record(kind["plan"])
        what = plan.heading("summary", w.lang) or (w("js.kind_window", w=f"{plan.window:,}") if plan.window else
                                                    w("js.kind_global"))
        out.append(what + ("" if plan.heading("summary") else "; " + (w("js.kind_rope") if plan.rope else
                                                                        w("js.kind_no_rope"))))
    return out


def rope_rows(d: dict, w) -> str:
    """RoPE as each layer's plan declares it: one line per kind of layer (its base, rotary width, scaling, or none, and
    its window), naming its layers; a trace without the declaration gives the config's one base."""
    from llmtrace.model.maths import plan_from_record, rope_words

    m = d["run"]["model"]
    rec = (d.get("maths") or {}).get("record")
    if not rec:
        return num(m.get("rope_theta"), 7) + ("" if not m.get("rope_scaling") else
                                              " " + w("run.v.scaling", kind=m["rope_scaling"]))
    by: dict[str, list[int]] = {}
    for layer, k in enumerate(rec["layer_kind"]):
        plan = plan_from_record(rec["kinds"][k]["plan"])
        words = rope_words(plan, w.maths) + (w("maths.window_of", w=f"{plan.window:,}") if plan.window else "")
        by.setdefault(words, []).append(layer)
    return " · ".join(w("run.rope_layers", rope=words, layers=layer_ranges(layers, w)) for words, layers in by.items())


def layer_ranges(layers: list[int], w) -> str:
    """[0, 1, 2, 4] -> 'layers 0–2, 4' (in the page's language: w, its words)."""
    parts, start = [], None
    for i, x in enumerate(layers):
        start = x if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            parts.append(f"{start}" if start == x else f"{start}–{x}")
            start = None
    return w("run.layer_one" if len(layers) == 1 else "run.layer_many", n=", ".join(parts))


def section_run(d: dict) -> dict:
    r = d["run"]
    m = r["model"]
    w = d["w"]
    groups = "; ".join(w("run.v.group", k=k, heads=", ".join(map(str, g))) for k, g in enumerate(r["groups"]))
    yes, no = w("run.v.yes"), w("run.v.no")
    rows = [
        ("model", f'{m["name"]} ({m.get("arch", "llama")}, {m.get("source", "?")})'),
        ("parameters", num(m.get("n_params"))),
        ("layers", w("run.v.layers", n=m["n_layers"], d=m["d_model"], f=m["ffn_dim"])),
        ("heads", w("run.v.heads", h=m["n_heads"], kv=m["n_kv_heads"], dh=m["head_dim"],
                    g=m["n_heads"] // m["n_kv_heads"])),
        ("groups", groups),
        ("rope", rope_rows(d, w)),
        ("vocab", num(m["vocab_size"])),
        *([("changes", " · ".join(changes_in(m, w.lang)))] if m.get("changes") else []),
        ("tied", yes if m.get("tie_embeddings") else no),
        ("device", f'{r["device"]} · {r["dtype"]}'),
        ("exact", w("run.v.exact") if not r.get("fast") else fast_words(r["fast"], w)),
        ("interventions", intervened(r["interventions"], w)),
        ("threads", num(r["threads"]) if r["threads"] is not None else w("run.v.not_recorded")),
        ("command", w("run.v.batch", rows=r["batch"]["rows"], row=r["batch"]["row"]) if r.get("batch") else
         r["command"] + (" " + w("run.v.layer_of", layer=r["layer"]) if r["layer"] is not None else "")),
    ]
    s = r["sampling"]
    if s is not None:
        rows.append(("sampling", sampling_words(s, w)))
        rows.append(("order", " → ".join(word_or(w, f"stage.{x}", x) for x in s.get("order") or [])))
        from llmtrace.render.generate import llama_cpp_settings

        extra = llama_cpp_settings(s)
        if extra:
            rows.append(("llama_cpp", "; ".join(extra)))
    if r["trace"] is not None:
        t = r["trace"]
        rows.append(("trace", w("run.v.trace", level=in_words(f'`trace={t.get("level")!r}`'), layers=t.get("layers") or w("run.v.all"),
                                dumps=", ".join(t.get("dump") or []) or w("run.v.none"))))
    sm = r["summary"]
    if sm is not None:
        rows += [
            ("tokens", w("run.v.tokens", prompt=sm["prompt_tokens"], generated=sm["generated_tokens"],
                         stop=sm["stop_reason"])),
            ("ttft", f'{num(sm["ttft_ms"])} ms'),
            ("speed", f'{num(sm["prefill_tok_s"])} tok/s · {num(sm["decode_tok_s"])} tok/s'),
        ]
    rows = [(w(f"run.k.{k}"), v) for k, v in rows]
    return {"prompt": r["prompt"], "chat": bool(r["chat"]), "version": r["version"], "schema": SCHEMA_ID,
            "output": sm["text"] if sm is not None else None, "rows": rows}


def _shape(s: Optional[list], axes: Optional[list] = None, w=None) -> str:
    """A shape as the seed table writes it, with the model's axis names where the trace gives them: [T=9, H=9, Dh=64]."""
    if s is None:
        return (w or _english())("run.v.not_recorded")
    if axes and len(axes) == len(s):
        return "[" + ", ".join(f"{a}={n}" for a, n in zip(axes, s)) + "]"
    return "[" + ", ".join(map(str, s)) + "]"


def batched(shape: str, d: dict) -> str:
    """A shape of a batch's pass with its B axis first ([B=2, T=6, D=64]): the pass runs every row at once; the page's
    numbers are one row's."""
    b = d.get("batch")
    return shape if b is None or not shape.startswith("[") else f'[B={b["rows"]}, {shape[1:]}'


def section_pipeline(d: dict) -> dict:
    w = d["w"]
    stages = []
    for st in d["pipeline"]["stages"]:
        detail = ""
        if "shape" in st:
            detail = batched(_shape(st["shape"], w=w), d)
        elif st["id"] == "s3" and st.get("padding"):
            pad = st["padding"]
            real = pad["slots"] - pad["pad_slots"]
            detail = w("pipeline.padding", pads=count(w, pad["pad_slots"], "pad_slot"), real=count(w, real, "token"),
                       slots=pad["slots"])
        elif st["id"] == "s3":
            detail = w("pipeline.causal") + (", " + w("pipeline.masked", n=f'{st["masked"]:,}')
                                             if st.get("masked") is not None else "")
        elif "sampler" in st:
            detail = ", ".join(st["active"]) or w("pipeline.none_active")
        points = [{"name": p["name"], "shape": batched(_shape(p["shape"], p.get("axes"), w), d)} for p in st["points"]]
        stages.append({"id": st["id"], "title": step_title(w, st["id"], d), "layer": st["id"].startswith("s6"),
                       "detail": detail, "points": points})
    note = None if d["tensors"]["points"] else missing(d, "stats", "`trace='full'`")
    recorded = any(p["shape"] is not None for st in d["pipeline"]["stages"] for p in st["points"])
    if d["kind"] == "lens" and not recorded:  # every tile would say "not recorded": the closing note says it once
        return None
    return {"stages": stages, "missing": note}


def section_batch(d: dict) -> Optional[dict]:
    """s3 of a batch: each row's padded ids (the pad id named), the attention_mask as a B × S grid and the
    position_ids of each row; a row switch picks the row whose ids and positions are shown beside the grid."""
    b = d.get("batch")
    if b is None:
        return None
    w = d["w"]
    rows = []
    for r, (ids, mask, pos) in enumerate(zip(b["ids"], b["attention_mask"], b["position_ids"])):
        pads = len(mask) - sum(mask)
        prompt = (b["prompts"] or [""] * b["rows"])[r]
        rows.append({"r": r, "ids": ids, "mask": mask, "positions": pos, "pads": pads, "prompt": prompt,
                     "summary": w("batch.row_summary", r=r, pads=count(w, pads, "pad_slot"),
                                  real=count(w, len(mask) - pads, "token"))})
    S = len(b["attention_mask"][0]) if b["attention_mask"] else 0
    source = word_or(w, f'batch.pad_source.{b["pad_source"]}', b["pad_source"] or "")
    return {"rows": rows, "row": b["row"], "B": b["rows"], "S": S, "slots": list(range(S)),
            "pad": w("batch.pad", id=b["pad_id"], piece=b["pad_piece"], source=source)}


def chip(t: dict, w=None) -> dict:
    w = w or _english()
    p = t["prob"]
    gen = t["step"] is not None
    bytes_ = " ".join(f"{b:02x}" for b in t["bytes"])
    label = w("tokens.chip_gen" if gen else "tokens.chip", step=t["step"], index=t["index"], id=t["id"],
              piece=repr(t["piece"]), bytes=bytes_) + (f", p = {p:.4g}" if p is not None else "")
    return {"cls": "chip" + (" gen" if gen else "") + (" special" if t["special"] else ""), "step": t["step"],
            "bg": colour(p), "fg": ink(p), "label": label, "piece": visible(t["text"]), "id": t["id"],
            "bytes": bytes_, "prob": f"{p:.3f}" if p is not None else None}


MERGE_NOTES = {  # tokens/bpe.py's notes, by their catalogue keys (tokens.note.KEY)
    "added token: matched whole, never merged": "added", "the whole word is a token (ignore_merges)": "whole",
    "a single piece: nothing to merge": "single", "no merge applies": "none"}


def merge_words(merges: dict, w=None) -> dict:
    """The BPE merge story of each prompt word: its lines of pieces (`at`: the piece a merge just made), the word
    with the most merges shown first."""
    w = w or _english()
    words = merges["words"]
    if not words:
        note = merges["note"]
        if note and note.startswith("the merge story is not available"):
            note = w("tokens.merges_not_bpe", why=note.split("(", 1)[-1].rstrip(")"))
        elif note and note.startswith("the merge story needs"):
            note = w("tokens.merges_no_tokenizer")
        return {"note": note or w("tokens.merges_no_tokenizer"), "words": []}
    default = max(range(len(words)), key=lambda i: len(words[i]["steps"]))
    out = []
    for i, wd in enumerate(words):
        lines = [{"pieces": wd["start"], "at": None, "rank": w("tokens.merge_start")}]
        lines += [{"pieces": s["pieces"], "at": s["at"],
                   "rank": w("tokens.merged", a=s["pair"][0], b=s["pair"][1], rank=s["rank"])} for s in wd["steps"]]
        note = wd.get("note")
        out.append({"text": visible(wd["text"]), "lines": lines, "shown": i == default,
                    "note": word_or(w, "tokens.note." + MERGE_NOTES[note], note) if note in MERGE_NOTES else note})
    return {"note": None, "words": out}


def section_tokens(d: dict) -> dict:
    toks = d["tokens"]
    n_gen = sum(t["step"] is not None for t in toks)
    w = d["w"]
    return {"prompt": count(w, len(toks) - n_gen, "prompt_token"),
            "generated": count(w, n_gen, "generated_token") if n_gen else None, "chips": [chip(t, w) for t in toks],
            "merges": merge_words(d["merges"], w)}


def topk_chart(step: dict) -> dict:
    """The top-k bar chart of one step: a bar per candidate, its length its probability against the largest."""
    top = step["topk"] or []
    pick = step["token"]["id"]
    w, row = 560, 22
    pmax = max((c["prob"] for c in top), default=1.0) or 1.0
    bars = []
    for i, c in enumerate(top):
        y = 20 + i * row
        bw = 250 * c["prob"] / pmax
        bars.append({"label": visible(c["text"]), "text_y": y + 14, "y": y + 2, "height": row - 6,
                     "width": f"{bw:.1f}", "value_x": f"{116 + bw:.1f}", "cls": "bar pick" if c["id"] == pick else "bar",
                     "fill": colour(c["prob"]), "title": f'id {c["id"]} · logit {c["logit"]} · p {c["prob"]}',
                     "value": f'{c["prob"]:.4f} · logit {num(c["logit"])}'})
    return {"w": w, "h": row * len(top) + 24, "n": len(top), "step": step["step"], "bars": bars}


DRAW_X0, DRAW_W = 12, 400  # the draw bar: [0, 1) drawn from x0 over w pixels, room for its end labels either side


def word_or(w, key: str, fallback: str) -> str:
    """The catalogue's text for `key`, or `fallback` (a name the catalogue does not know stays as it is)."""
    return w(key) if w.has(key) else fallback


def funnel(step: dict, vocab: int, w=None) -> dict:
    """The sampler's stages at one step: candidates left (on a log scale of the vocabulary), the chosen token's
    probability and the mass each truncation kept; then the draw."""
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
        rows.append({"stage": word_or(w or _english(), f'stage.{s["stage"]}', s["stage"]),
                     "survivors": f'{s["survivors"]:,}', "width": f"{max(1.0, 100 * frac):.1f}",
                     "pick": f'{s["pick_prob"]:.6g}', "kept": kept or "—",
                     "why": stage_line(s, step)})  # DRY, top-nσ, XTC, mirostat: what it did over the vocabulary, and why
        prev = s
    tok = step["token"]
    draw: dict[str, Any] = {"token": visible(tok["text"]), "id": tok["id"], "greedy": True}
    if not (rng.get("greedy") or rng.get("draw") is None):
        u = rng["draw"]
        p = stages[-1]["pick_prob"] if stages else None
        draw.update(greedy=False, u=f"{u:.6g}", u4=f"{u:.4f}", seed=rng.get("seed"), width=num(p),
                    x=f"{DRAW_X0 + DRAW_W * u:.1f}", x0=DRAW_X0, x1=DRAW_X0 + DRAW_W, slice=None)
        if rng.get("slice"):  # the chosen token's slice of [0, 1) (traces from before it was recorded lack it)
            lo, hi = rng["slice"]
            draw["slice"] = {"x": f"{DRAW_X0 + DRAW_W * lo:.1f}", "w": f"{max(1.0, DRAW_W * (hi - lo)):.1f}",
                             "text": f"[{lo:.4f}, {hi:.4f})"}
    return {"rows": rows, "draw": draw}


def section_steps(d: dict) -> Optional[dict]:
    steps = d["steps"]
    if not steps:
        note = missing(d, "steps")
        return {"only_missing": note} if note else None
    vocab = d["run"]["model"]["vocab_size"]
    panels = []
    for s in steps:
        panel = {"step": s["step"], "phase": word_or(d["w"], f'phase.{s["phase"]}', s["phase"]),
                 "position": s["position"], "token": visible(s["token"]["text"]),
                 "id": s["token"]["id"], "ms": num(s["ms"]), "missing": None, "topk": None, "funnel": None}
        if s["topk"] is None:
            panel["missing"] = missing(d, "topk", "`trace='steps'` (or deeper)")
        else:
            panel.update(topk=topk_chart(s), funnel=funnel(s, vocab, d["w"]))
        panels.append(panel)
    return {"panels": panels}


def gqa_diagram(d: dict) -> dict:
    """Which query heads read which KV head: a box per head, 34 px apart, each KV head under the middle of its group."""
    groups = d["run"]["groups"]
    H = sum(len(g) for g in groups)
    out = []
    for k, g in enumerate(groups):
        kx = (g[0] + g[-1]) / 2 * 34 + 20
        out.append({"k": k, "x": f"{kx - 22:.0f}", "text_x": f"{kx:.0f}",
                    "heads": [{"h": h, "x": h * 34 + 20, "box_x": h * 34 + 6} for h in g]})
    return {"w": max(300, 34 * H + 10), "groups": out}


def overview(a: dict) -> Optional[list[dict]]:
    """Every recorded layer and head as a thumbnail (drawn by the script), heads grouped by the KV head they read."""
    if len(a["heads"]) < 2:
        return None
    return [{"layer": layer, "groups": a["groups"]} for layer in a["layers"]]


HEATMAP_PX = 480  # the canvas's side; report.js draws B cells of floor(480 / B) pixels each way
LABEL_PX = 11  # the least pixels a label needs across its line: rows (and columns) narrower than this share one


def heatmap_axes(d: dict) -> dict:
    """The heatmap's canvas size and its axes' labels (drawn in SVG, readable before any script runs): keys along the
    top, queries down the left. Each row and column is a position (its token, made visible) where a label fits the
    cell; where cells are too small, or a cell is a bin of several positions, every k-th cell is labelled with its
    positions instead ("16–31")."""
    bins = d["attention"]["bins"]
    tokens = d["tokens"]
    pad = d["attention"].get("pad", 0)  # a batch row's leading pad slots: its token i sits in slot pad + i
    B = len(bins)
    cell = max(1, HEATMAP_PX // B)
    single = all(b1 - b0 == 1 for b0, b1 in bins)
    every = 1 if cell >= LABEL_PX else -(-LABEL_PX // cell)

    def text(i: int) -> str:  # a label covers its cell and the unlabelled ones after it, up to the next label
        b0, b1 = bins[i][0], bins[min(i + every, B) - 1][1]
        if single and every == 1:
            i = b0 - pad
            t = "pad" if i < 0 else visible(tokens[i]["text"]) if i < len(tokens) else ""
            return f"{b0} {t[:9] + '…' if len(t) > 10 else t}"
        return str(b0) if b1 - b0 == 1 else f"{b0}–{b1 - 1}"

    side = 96
    return {"side": side, "inner": side - 4, "size": cell * B, "outer": cell * B + 2,  # the SVGs overhang by a pixel
            "what": "tokens" if single and every == 1 else "positions",
            "marks": [{"at": f"{(i + 0.5) * cell + 4:.1f}", "text": text(i)} for i in range(0, B, every)]}


def attention_words(d: dict, w) -> tuple[str, str]:
    """The attention section's words from the declaration of the layers it draws: the mask (causal, and each
    layer's window, hatched alike) and the sink (the first token's, or the heads' learned sink logits, with the
    largest share the trace recorded for them)."""
    rec = (d.get("maths") or {}).get("record")
    layers = [int(x) for x in d["attention"]["layers"] if str(x).lstrip("-").isdigit()]
    if not rec:
        return w("attention.intro"), w("attention.sink")
    plans = {layer: rec["kinds"][rec["layer_kind"][layer]] for layer in layers if layer < len(rec["layer_kind"])}
    windows = {layer: k["plan"].get("window") for layer, k in plans.items() if k["plan"].get("window")}
    intro = w("attention.intro")
    if windows:
        by: dict[int, list[int]] = {}
        for layer, win in windows.items():
            by.setdefault(win, []).append(layer)
        intro = w("attention.intro_window", windows="; ".join(
            w("attention.window_of", layers=", ".join(map(str, ls)), w=f"{win:,}") for win, ls in by.items()))
    sinks = {o_name for k in plans.values() for o_name, o in k["ops"].items()
             if (o.get("consts") or {}).get("take") == "sink"}  # the softmax's sink column (gpt-oss)
    if not sinks:
        return intro, w("attention.sink")
    rows = [r for name in sinks for r in ((d.get("tensors") or {}).get("points") or {}).get(name, [])
            if r["layer"] in plans and r.get("max") is not None]
    if not rows:
        return intro, w("attention.learned_sink")
    top = max(rows, key=lambda r: r["max"])
    return intro, w("attention.learned_sink") + " " + w("attention.learned_sink_max", share=f'{top["max"]:.3f}',
                                                        layer=top["layer"], step=top["step"])


def section_attention(d: dict) -> Optional[dict]:
    a = d["attention"]
    if not a["maps"]:  # a full trace has each point's sample (the walk shows its probabilities), not whole matrices
        full = (d["run"].get("trace") or {}).get("level") == "full"
        note = missing(d, "attention_matrices" if full else "attention",
                       "`for_report=True` with any `trace` but 'none' (it records the probabilities of `layers`), "
                       "or `dump=['0.probs']`")
        return {"maps": False, "missing": note, "gqa": gqa_diagram(d)} if note else None
    n = a["n"]
    w = d["w"]
    binned = w("attention.binned", n=n, b=len(a["bins"])) if a["binned"] else w("attention.one_cell", n=n)
    if a.get("pad"):
        binned += " " + w("attention.padded", pads=count(w, a["pad"], "pad_slot"))
    notes = " ".join(w(x["key"], **{k: v for k, v in x.items() if k != "key"}) for x in a["notes"])
    intro, sink = attention_words(d, w)
    return {"maps": True, "binned": binned, "notes": notes, "layers": a["layers"], "intro": intro, "sink": sink,
            "heads": [w("attention.head_n", h=h) if h != "mean" else w("attention.mean") for h in a["heads"]],
            "axes": heatmap_axes(d), "gqa": gqa_diagram(d), "overview": overview(a)}


def section_lens(d: dict) -> Optional[dict]:
    lens = d["lens"]
    if lens is None:
        note = missing(d, "lens", command="lens")
        return {"only_missing": note} if note else None
    pos = lens["positions"]
    rows = []
    for ri, r in enumerate(lens["rows"]):
        cells = []
        for p in pos:
            top = r["cells"].get(str(p))
            if not top:
                cells.append(None)
                continue
            t = top[0]
            cells.append({"row": ri, "pos": p, "bg": colour(t["prob"]), "fg": ink(t["prob"]), "text": visible(t["text"]),
                          "p": f'{t["prob"]:.2f}' if t["prob"] >= 0.005 else f'{t["prob"]:.0e}',
                          "tip": " · ".join(f'{visible(c["text"])} {c["prob"]:.3g}' for c in top)})
        rows.append({"label": d["w"]("lens.output") if r["layer"] is None else d["w"]("run.v.layer", layer=r["label"]),
                     "cells": cells})
    return {"columns": [{"pos": p, "token": visible(lens["pieces"].get(str(p), ""))} for p in pos], "rows": rows,
            "k": len(lens["rows"][0]["cells"][str(pos[0])])}


def nice_step(span: float, n: int = 4, base: int = 10) -> float:
    """A round tick step that cuts [0, span] into about n parts: 1, 2, 2.5 or 5 × a power of ten, in units of
    base**k (base 1024 for bytes: 256 KiB, 1 MiB, 2 MiB rather than 1.11 MiB)."""
    if span <= 0:
        return 1.0
    unit = 1.0
    if base == 1024:
        while span / unit >= 1024:
            unit *= 1024
    raw = span / unit / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return step * unit


def line_chart(series: list[tuple[str, list[tuple[float, float]], str]], xlabel: str, ylabel: str, *,
               marker: bool = False, dots: bool = False, w: int = 560, h: int = 240,
               fmt: Callable[[float], str] = num, join: Optional[float] = None, base: int = 10,
               xticks: Optional[list[tuple[float, str]]] = None) -> Optional[dict]:
    """The geometry of a small SVG line chart: series of (class, points, title). `join`: points further apart in x
    than this are not joined by a line (a line would show values between them that were never recorded); their dots
    are drawn. The y axis starts at 0 and has round ticks (`base` 1024 for bytes). None when there are no points."""
    xs = [x for _, pts, _ in series for x, _ in pts]
    ys = [y for _, pts, _ in series for _, y in pts]
    if not xs:
        return None
    x0, x1 = min(xs), max(xs)
    ystep = nice_step(max(ys), base=base)
    y1 = math.ceil(max(ys) / ystep) * ystep or 1.0
    L, R, T, B = 64, 12, 24, 34

    def px(x) -> float:
        return L + (w - L - R) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)

    def py(y) -> float:
        return h - B - (h - T - B) * (y / y1)

    out = {"w": w, "h": h, "left": L, "right": w - R, "top": T, "bottom": h - B, "ytick_x": L - 4, "xtick_y": h - B + 14,
           "yticks": [{"y": f"{py(i * ystep) + 4:.1f}", "text": fmt(i * ystep)} for i in range(round(y1 / ystep) + 1)],
           "xticks": [{"x": f"{px(x):.1f}", "text": t} for x, t in xticks] if xticks is not None else
                     [{"x": f"{px(x):.1f}", "text": f"{x:g}"} for x in sorted({x0, x1, round((x0 + x1) / 2)})],
           "xlabel": {"x": f"{(L + w - R) / 2:.0f}", "y": h - 4, "text": xlabel},
           "ylabel": {"x": L - 60, "text": ylabel}, "series": [], "marker": None}
    for cls, pts, title in series:
        runs: list[list[tuple[float, float]]] = []
        for x, y in pts:
            if runs and (join is None or x - runs[-1][-1][0] <= join):
                runs[-1].append((x, y))
            else:
                runs.append([(x, y)])
        lines = [" ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run) for run in runs if len(run) > 1]
        dots = dots or any(len(run) == 1 for run in runs)  # once a series needs dots, the later ones get them too
        out["series"].append({"cls": cls, "title": title, "lines": lines,
                              "dots": [{"x": f"{px(x):.1f}", "y": f"{py(y):.1f}", "value": fmt(y)} for x, y in pts]
                              if dots else []})
    if marker:
        out["marker"] = {"x": f"{px(x0):.1f}", "x0": x0, "x1": x1, "l": L, "w": w - L - R}
    return out


def section_kv(d: dict) -> Optional[dict]:
    kv = d["kv"]
    if kv is None:
        note = missing(d, "kv")
        return {"only_missing": note} if note else None
    m = d["run"]["model"]
    pts = [(s["step"], s["bytes_used"]) for s in kv["steps"]]
    mha = [(s["step"], s["mha_bytes_used"]) for s in kv["steps"]]
    w = d["w"]
    state = kv.get("state")
    boxes = memory_boxes(m, w, int(kv["per_layer"]), state)
    kinds = {b["kind"] for b in boxes["boxes"]}  # the legend: each kind of memory present
    # the line of what this model keeps per token, named by what its layers keep (K and V, MLA's latent, ...)
    own = w("kv.own_line", what=" + ".join(w(f"kv.kind.{k}") for k in boxes["grow_kinds"]) or w("kv.kind.none"))
    series = [("mha", mha, w("kv.mha_title")), ("gqa", pts, own)]
    if state:  # the recurrent states: a flat line; and the sum, which grows only by the KV cache's positions
        series += [("state", [(s["step"], state["bytes"]) for s in kv["steps"]], w("kv.state")),
                   ("total", [(s["step"], s["bytes_used"] + state["bytes"]) for s in kv["steps"]], w("kv.total"))]
    chart = line_chart(series, w("kv.x"), w("kv.y"), marker=True, fmt=human_bytes, base=1024)
    last = kv["steps"][-1]
    per_layer = kv["per_layer"]
    el = kv["element_size"]
    n_kv = kv.get("kv_layers", m["n_layers"])
    return {"chart": chart, "n_heads": m["n_heads"], "n_kv_heads": m["n_kv_heads"], "boxes": boxes,
            "intro": w("kv.intro") if boxes["uniform_kv"] else memory_intro(boxes, w),
            "legend": [{"kind": k, "text": w(f"kv.kind.{k}")} for k in MEMORY_ORDER if k in kinds],
            "state": None if not state else {
                "layers": state["layers"], "bytes": state["bytes_per_layer"],
                "text": w("kv.v.state", n=len(state["layers"]), per=f'{state["bytes_per_layer"]:,}',
                          bytes=human_bytes(state["bytes"]), total=human_bytes(last["bytes_used"] + state["bytes"]))},
            "per_token": (w("kv.v.per_token_kinds", bytes=f'{kv["bytes_per_token"]:,}', parts=boxes["parts"])
                          if not boxes["uniform"] else
                          w("kv.v.per_token", bytes=f'{kv["bytes_per_token"]:,}', layers=n_kv, kv=m["n_kv_heads"],
                            dh=m["head_dim"], el=num(el)) if not boxes["shapes"] else
                          w("kv.v.per_token_shapes", bytes=f'{kv["bytes_per_token"]:,}', layers=n_kv,
                            parts=boxes["shapes"], el=num(el))),
            "per_layer": w("kv.v.per_layer", bytes=f"{per_layer:,.0f}", half=f"{per_layer / 2:,.0f}"),
            "at_end": w("kv.v.at_end", n=last["seq_len"], used=human_bytes(last["bytes_used"]),
                        allocated=human_bytes(last["bytes_allocated"]), mha=human_bytes(last["mha_bytes_used"]),
                        x=f'{last["mha_bytes_used"] / max(1, last["bytes_used"]):.1f}'),
            "layers": {"width": f'{100 / m["n_layers"]:.3f}', "bytes": int(per_layer), "n": m["n_layers"],
                       "labelled": [i for i in range(m["n_layers"]) if i % max(1, -(-m["n_layers"] // 10)) == 0
                                    or i == m["n_layers"] - 1]}}


MEMORY_ORDER = ("kv", "latent", "shared", "state", "window", "none")  # the legend's order: growing, then fixed


def memory_boxes(m: dict, w, per_layer: int, state: Optional[dict]) -> dict:
    """One box per layer, from each layer's declared memory (the run event's model.memory): its kind and its bytes,
    in the page's words. A trace from before the declarations: K and V in every layer, or a state where the kv
    records say so."""
    mem = m.get("memory")
    if not mem:
        st = set((state or {}).get("layers") or ())
        mem = [{"kind": "state", "per_token_bytes": 0, "constant_bytes": (state or {}).get("bytes_per_layer", 0),
                "reads": None} if i in st else {"kind": "kv", "per_token_bytes": per_layer, "constant_bytes": 0,
                                                "reads": None} for i in range(m["n_layers"])]
    boxes = [{"i": i, "kind": r["kind"], "title": w(f"kv.box.{r['kind']}", i=i, per=f'{r["per_token_bytes"]:,}',
                                                    const=f'{r["constant_bytes"]:,}', reads=r.get("reads"))}
             for i, r in enumerate(mem)]
    growing: dict[tuple, int] = {}
    for r in mem:
        if r["per_token_bytes"]:
            growing[(r["kind"], r["per_token_bytes"])] = growing.get((r["kind"], r["per_token_bytes"]), 0) + 1
    parts = " + ".join(f"{n} × {b:,} B ({w(f'kv.kind.{k}')})" for (k, b), n in growing.items())
    # every layer keeps the same thing, growing by the same bytes a token: one box size, one formula from its shapes
    uniform = len({(r["kind"], r["per_token_bytes"], r["constant_bytes"], r.get("reads")) for r in mem}) == 1 \
        and not mem[0]["constant_bytes"]
    shapes = " + ".join(f"{n} ({' × '.join(map(str, s))})" for n, s in (mem[0].get("per_token") or {}).items())
    return {"boxes": boxes, "parts": parts, "uniform": uniform, "shapes": shapes if uniform else "",
            "grow_kinds": list(dict.fromkeys(k for k, _ in growing)),
            "uniform_kv": uniform,
            "n_grow": sum(growing.values()), "n_fixed": sum(1 for r in mem if r["constant_bytes"]),
            "n_shared": sum(1 for r in mem if r.get("reads") is not None), "n": len(mem)}


def memory_intro(boxes: dict, w) -> str:
    """What a step adds, when the layers remember in more than one way."""
    text = w("kv.intro_kinds", grow=boxes["n_grow"], n=boxes["n"], fixed=boxes["n_fixed"])
    return text + (" " + w("kv.intro_shared", k=boxes["n_shared"]) if boxes["n_shared"] else "")


def section_residual(d: dict) -> Optional[dict]:
    """The residual stream's norm after the embedding and each recorded layer. The x axis has one place per recorded
    value, in order, and a gap (⋯) where layers between two recorded ones were not recorded: nothing drawn was not
    recorded, and no line crosses a gap."""
    r = d["residual"]
    if r is None:
        note = missing(d, "residual", "`trace='layers'` or `trace='full'`")
        return {"only_missing": note} if note else None
    w = d["w"]
    xs = r["layers"]
    has_embed = any(AFTER_EMBEDDING in n for n in r["norms"].values())
    keys = ([AFTER_EMBEDDING] if has_embed else []) + [str(lay) for lay in xs]
    place, ticks, at = {}, [], 0
    for i, k in enumerate(keys):
        if i and k != AFTER_EMBEDDING and keys[i - 1] != AFTER_EMBEDDING and int(k) != int(keys[i - 1]) + 1:
            ticks.append((at, "⋯"))  # layers between were not recorded
            at += 1
        elif i and keys[i - 1] == AFTER_EMBEDDING and int(k) != 0:
            ticks.append((at, "⋯"))
            at += 1
        place[k] = at
        ticks.append((at, w("residual.emb") if k == AFTER_EMBEDDING else k))
        at += 1
    series = []
    for step in r["steps"]:
        n = r["norms"][str(step)]
        pts = [(place[k], n[k]) for k in keys if k in n]
        series.append((f"resid s{step}", pts, w("residual.step", step=step)))
    chart = line_chart(series, w("residual.x"), w("residual.y"), fmt=lambda y: f"{y:.4g}", dots=len(keys) < 40,
                       join=1, xticks=ticks)  # only neighbours are joined: nothing drawn is unrecorded
    n_layers = d["run"]["model"]["n_layers"]
    which = ", ".join(([w("residual.embedding")] if has_embed else []) + [w("run.v.layer", layer=lay) for lay in xs])
    return {"chart": chart, "recorded": which if len(xs) < n_layers else None, "n_layers": n_layers}


def expert_colour(e: int) -> str:
    """A colour per expert index, told apart by hue (the golden angle between neighbours)."""
    return f"hsl({(e * 137.508) % 360:.0f} 62% 52%)"


def section_routing(d: dict) -> Optional[dict]:
    """A mixture of experts: a tokens × layers grid, each cell coloured by the expert the token trusted most at that
    layer (its title: the K experts and their weights), and each layer's load as a histogram of tokens per expert.
    A dense model has no such section."""
    r = d.get("routing")
    model = d["run"]["model"]
    if r is None:
        if not model.get("n_experts"):
            return None
        note = missing(d, "routing", "`trace='layers'` or `trace='full'`")
        return {"only_missing": note} if note else None
    toks = {t["index"]: t for t in d["tokens"]}
    positions = sorted({int(p) for by in r["cells"].values() for p in by})
    columns = [{"p": p, "text": visible(toks[p]["text"]) if p in toks else "", "decode": toks.get(p, {}).get("step")
                is not None} for p in positions]
    rows = []
    for layer in r["layers"]:
        by = r["cells"][str(layer)]
        cells = []
        for p in positions:
            if str(p) not in by:
                cells.append(None)
                continue
            experts, weights = by[str(p)]
            top = experts[max(range(len(experts)), key=lambda i: weights[i] if weights[i] is not None else -1)]
            title = f"layer {layer} · position {p} {columns[positions.index(p)]['text']!r} · " + ", ".join(
                f"e{x} {num(w, 3)}" for x, w in zip(experts, weights))
            cells.append({"e": top, "colour": expert_colour(top), "title": title})
        rows.append({"layer": layer, "cells": cells})
    E = r["n_experts"]
    loads = []
    for entry in r["load"]:
        most = max(entry["load"]) or 1
        loads.append({"layer": entry["layer"], "imbalance": num(entry["imbalance"], 3), "bars": [
            {"e": e, "h": f"{100 * n / most:.1f}", "colour": expert_colour(e),
             "title": f"layer {entry['layer']} · e{e}: {n} of {plural(entry['tokens'], 'token')}"}
            for e, n in enumerate(entry["load"])]})
    return {"columns": columns, "rows": rows, "loads": loads, "k": r["k"], "n_experts": E,
            "legend": [{"e": e, "colour": expert_colour(e)} for e in range(E)] if E <= 32 else None,
            "renormalised": r["renormalised"]}


def section_walk(d: dict) -> Optional[dict]:
    """The walk-through: the script draws the chosen token's values (data "walk"); here, its controls and, for a
    trace without values, what records them."""
    wk = d["walk"]
    if not any(isinstance(s, list) for s in wk["samples"].values()):
        note = missing(d, "walk", "`trace='full'`")
        return {"only_missing": note} if note else None
    toks = d["tokens"]
    n_prompt = sum(t["step"] is None for t in toks)
    choices = [{"i": t["index"], "label": f'{t["index"]} {visible(t["text"])}',
                "selected": t["index"] == n_prompt - 1} for t in toks]
    return {"tokens": choices, "layers": wk["layers"], "heads": list(range(d["run"]["model"]["n_heads"]))}


def section_whatif(d: dict) -> Optional[dict]:
    """The what-if sampler: sliders the script reads (named by their labels), set to the run's own settings."""
    if not d["steps"]:
        return None
    if not d["kept_logits"]:
        note = missing(d, "kept_logits", "`for_report=True` or `trace='full'`")
        return {"only_missing": note} if note else None
    s = d["run"]["sampling"] or {}
    temperature = 0.0 if s.get("greedy") else float(s.get("temperature") or 1.0)
    top_k = int(s.get("top_k") or 0)
    return {"temperature": temperature, "top_k": top_k, "top_p": float(s.get("top_p") or 1.0),
            "min_p": float(s.get("min_p") or 0.0), "k_max": max(1000, top_k)}


def section_explain(d: dict) -> Optional[dict]:
    """An explain page: every table, figure and note the terminal explain prints (report.explain_view)."""
    blocks = d.get("explain_view")
    return {"blocks": blocks} if blocks else None


def section_sizes(d: dict) -> Optional[dict]:
    """The pass's tensors drawn to scale (report.sizes, assets/sizes.js), under this page's titles of the seed steps
    and of the kinds of layer, with its note on what a trace lacks."""
    return sizes.section(d, kind_titles=kind_titles, kind_words=kind_words, step_title=step_title, missing=missing)


SECTIONS = (
    ("run", section_run),
    ("explain", section_explain),
    ("batch", section_batch),
    ("pipeline", section_pipeline),
    ("sizes", section_sizes),  # the pass's tensors drawn to scale (report.sizes, assets/sizes.js)
    ("walk", section_walk),
    ("tokens", section_tokens),
    ("steps", section_steps),
    ("whatif", section_whatif),
    ("attention", section_attention),
    ("lens", section_lens),
    ("kv", section_kv),
    ("residual", section_residual),
    ("routing", section_routing),
)


def step_bar(d: dict) -> Optional[dict]:
    steps = d["steps"]
    if not steps:
        return None
    return {"max": len(steps) - 1, "label": d["w"]("nav.step_label", step=steps[0]["step"], n=len(steps))}


def view(d: dict, w=None) -> dict:
    """Everything the templates lay out: the page's title, its sections (id, name, the section's dict) in order, the
    step bar, and the data the script reads. A section a trace has nothing for (None) is left out: an explain or lens
    page leads with what it has and ends with one note on what it lacks (`lacking`); a generate page keeps every
    section and says in place what is missing. `w`: the page's words (i18n.Words; English by default)."""
    from llmtrace.report.i18n import Words

    w = w or Words("en")
    d = dict(d, lacking=[], fill=None, w=w)
    d["fill"] = fill_command(d, "generate")  # report.js names it where a stage has no statistics
    order = SECTIONS
    if d["kind"] == "lens":  # the lens page opens on the lens, then says what ran
        order = tuple(x for x in SECTIONS if x[0] == "lens") + tuple(x for x in SECTIONS if x[0] != "lens")
    shown = [{"id": sid, "name": w(f"section.{sid}"), "v": v} for sid, fn in order if (v := fn(d)) is not None]
    if d["lacking"]:
        shown.append({"id": "lacking", "name": w("section.lacking"), "v": lacking(d)})
    del d["lacking"], d["w"]
    d.pop("explain_view", None)  # laid out in the page, not read by the script
    d["tensors"] = compact_stats(d["tensors"])
    # the script's texts, in the page's language (the live page's own, serve_*, travel in its page: serve_page)
    d["words"] = {k: v for k, v in w.js.items() if not k.startswith("serve_")}
    if d.get("maths") and w.maths:  # the formulas said in the page's language
        d["maths"] = maths_view({"maths": d["maths"]["record"]}, None, w.maths)
    d["step_titles"] = {st["id"]: step_title(w, st["id"], d) for st in d["pipeline"]["stages"]}
    d["kind_titles"] = kind_titles(d, w.lang)
    d["kind_words"] = kind_words(d, w)
    d["points"] = [dict(p, about=about(p, w)) for p in d["points"]]
    return {"title": f'{w("page.title")} · {d["run"]["model"]["name"]} · {d["run"]["prompt"][:60]}',
            "sections": shown, "stepbar": step_bar(dict(d, w=w)), "data": d, "palette": PALETTE, "w": w}


def compact_stats(t: dict) -> dict:
    """The per-layer statistics as the page stores them: per point, one list per field (report.js makes them rows
    again), each number to 4 significant figures (what the stage panel shows), the shape once per step. The points
    recorded at the same steps and layers (most of them) share one grid of steps and layers, `grids[i]`, named by
    their "grid", and those of one shape at every step one `shapes[j]`: an all-layers page keeps each once, not once
    per point."""
    def sig4(x):
        return None if x is None else float(f"{x:.4g}")

    def once(kept: list, index: dict, value) -> int:
        i = index.setdefault(repr(value), len(kept))
        if i == len(kept):
            kept.append(value)
        return i

    points, grids, shapes, ix = {}, [], [], ({}, {})
    for name, rows in t["points"].items():
        grid = once(grids, ix[0], {"step": [r["step"] for r in rows], "layer": [r["layer"] for r in rows]})
        shape = once(shapes, ix[1], {str(r["step"]): r["shape"] for r in rows})
        points[name] = {"grid": grid, **{k: [sig4(r[k]) for r in rows] for k in ("mean", "std", "min", "max", "norm")},
                        "shapes": shape}
    return dict(t, points=points, grids=grids, shapes=shapes)


def about(point: dict, w) -> str:
    """A point's note (declared in English in llmtrace/model/) in the page's language: the catalogue's "about.NAME"
    (or "about.NAME.alt", a family's variant) where its English is the declared one; else the declaration's own."""
    en = _english()
    for key in (f'about.{point["name"]}', f'about.{point["name"]}.alt'):
        if en.has(key) and en(key) == point.get("about"):
            return w(key)
    return point.get("about", "")


def _asset(name: str) -> str:
    return (Path(__file__).with_name("assets") / name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def environment():
    """The templates' environment: shipped in the package (templates/), every value autoescaped, an undefined name an
    error; the data for the script goes through `tojson`, which escapes <, >, & and ' so it cannot close its
    <script>."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("llmtrace.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=False)
    env.policies["json.dumps_kwargs"] = {"ensure_ascii": False, "separators": (",", ":"), "allow_nan": False}
    env.globals["ramp_colours"] = [colour(i / 10) for i in range(11)]  # the palette as eleven swatches, for the legends
    return env


def render(d: dict, lang: str = "en") -> str:
    """The whole page as one string, its words in `lang` (i18n.LANGS)."""
    import markupsafe

    from llmtrace.report.i18n import Words

    # the package's own stylesheet and script, inlined as they are (escaping would break them); no trace text in them
    assets = {"css": markupsafe.Markup(_asset("report.css") + _asset("sizes.css")),
              "script": markupsafe.Markup(_asset("report.js") + "\n" + _asset("cards.js") + "\n" +
                                                _asset("walk.js") + "\n" + _asset("sizes.js"))}
    v = view(d, Words(lang))
    return environment().get_template("report.html.j2").render(v=v, w=v["w"], **assets)
