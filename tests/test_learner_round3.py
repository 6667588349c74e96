"""Issue 50: the learner's page, round 3, in Chromium on the random-weight family fixtures (tests/families.py).

1. A card marks ✓ only over values it computed: every card of the card layers carries the values the one float64
   evaluator computed when the trace was recorded (trace/cards.py); a trace without them says "not computed".
"""

from __future__ import annotations

import json
import re

import pytest

from helpers import Opened, open_at, run_cli

TEXT = "The quick brown fox"  # 13 tokens of tests/tiny.py's tokenizer: past every fixture's window (4)
VIEWPORTS = [(1280, 900), (390, 844)]
# names that stay English on a Chinese page (test_learner_pages.ALLOWED's kind): models, methods, symbols
ALLOWED = {"RoPE", "GQA", "KV", "RMSNorm", "SwiGLU", "GeGLU", "GLU", "softmax", "logit", "logits", "FFN", "GGUF",
           "LongRoPE", "YaRN", "Gated", "DeltaNet", "transformers", "llama", "cpp", "query_pre_attn_scalar"}


@pytest.fixture(scope="module")
def reports(families, tmp_path_factory):
    """report(name, lang="en") -> (the loaded model, the trace's events, the report page's path), made once."""
    import llmtrace

    out = tmp_path_factory.mktemp("round3")
    runs, made = {}, {}

    def get(name: str, lang: str = "en"):
        if name not in runs:
            model = llmtrace.load(str(families.hf_dir(name)), threads=1)
            runs[name] = (model, model.generate(TEXT, max_new_tokens=2, trace="full", layers="0,-1", for_report=True,
                                                ignore_eos=True))
        if (name, lang) not in made:
            model, run = runs[name]
            made[(name, lang)] = (model.loaded, run.events, run.report(out / f"{name}-{lang}.html", lang=lang))
        return made[(name, lang)]

    return get


def n_prompt(events) -> int:
    return len(next(e for e in events if e["event"] == "tokens")["tokens"])


def pick(page, token: int, layer: int, head: int = 0) -> None:
    """Choose the walk-through's token, layer and head, as a learner does."""
    for sel, v in (("#walk-token", token), ("#walk-layer", layer), ("#walk-head", head)):
        page.select_option(sel, str(v))


# every card of the open view: its point, op, whether it marks ✓ / ✗, and its "computed" row's cells
CARDS = """() => Array.from(document.querySelectorAll("#walk-panel .card")).map((c) => {
  const rows = Array.from(c.querySelectorAll("table.walkv tr"));
  const comp = rows.filter((r, k) => k % 3 === 1).flatMap((r) => Array.from(r.querySelectorAll("td")).map((td) => td.textContent));
  const check = c.querySelector(".check");
  return {point: c.dataset.point, layer: c.dataset.layer, op: c.dataset.op, missing: c.dataset.missing || null,
          err: c.dataset.maxError || null, computed: comp, check: check ? check.textContent : null};
})"""


def ticked_over_nothing(cards: list[dict]) -> list[str]:
    """The cards that mark ✓ (or ✗) while an entry of their computed row is `·` (not computed)."""
    return [f"{c['point']} (layer {c['layer']}): {c['check']!r} over {c['computed']}" for c in cards
            if c["check"] and c["check"][:1] in "✓✗" and "·" in c["computed"]]


# ----------------------------------------------------------------------------------------------------------------
# 1. a ✓ over nothing


@pytest.mark.parametrize("name", ["olmo2", "qwen3_5", "phi3", "gpt_oss"])
def test_a_card_marks_a_check_only_over_values_it_computed(browser, reports, name):
    """OLMo 2 (q/k normed over the whole projection), Qwen3.5 and Phi-3 (partial RoPE), gpt-oss (YaRN): at every
    recorded layer, every head, a prefill token and a decode step, no card marks ✓ over a `·`, and every rotating
    RoPE card computes every entry and checks."""
    lm, events, path = reports(name)
    n, L, H = n_prompt(events), lm.config.n_layers, lm.config.n_heads
    o = Opened(browser, path)
    try:
        bad, rope = [], 0
        for token in (n - 1, n - 4, n):
            for layer in (0, L - 1):
                for h in range(H):
                    pick(o.page, token, layer, h)
                    cards = o.page.evaluate(CARDS)
                    bad += [f"token {token} layer {layer} head {h}: {x}" for x in ticked_over_nothing(cards)]
                    for c in cards:
                        if c["op"] == "rope" and c["computed"] and c["layer"] == str(layer):
                            rope += 1
                            if "·" in c["computed"] or not (c["check"] or "").startswith("✓"):
                                bad.append(f"token {token} layer {layer} head {h}: {c['point']} {c['computed']} "
                                           f"{c['check']!r}")
        assert not bad, "\n".join(bad[:20])
        assert rope > 0 or name == "qwen3_5"  # Qwen3.5's layer 0 is linear attention; its layer 3 rotates
        assert not [m for m in o.messages if m[0] in ("error", "pageerror")]
    finally:
        o.page.close()


def test_the_trace_carries_each_cards_computed_values_at_its_samples_entries(reports):
    """Issue 47 item 3: in the card layers every point with a declared operation carries the values the one float64
    evaluator computed (trace.cards), at exactly the rows and entries of its sample, and their difference from the
    recorded values; OLMo 2's RoPE (q/k normed over the whole projection) included, with every entry computed."""
    from llmtrace.trace.packed import unpack

    lm, events, _ = reports("olmo2")
    L = lm.config.n_layers
    seen = set()
    for e in events:
        if e["event"] != "tensor" or not e.get("sample") or lm.maths.op(e["layer"], e["name"]) is None:
            continue
        c = e["sample"].get("computed")
        assert c is not None or e["layer"] not in (None, 0, L - 1), (e["layer"], e["name"])
        if c is None:
            continue
        got, rec = unpack(c["values"]), unpack(e["sample"]["values"])
        assert got.shape == rec.shape and not (got != got).any(), (e["layer"], e["name"])
        a, r = c["error"]
        assert a is not None and (a <= 1e-5 or r <= 1e-4), (e["layer"], e["name"], c["error"])
        seen.add((e["layer"], e["name"]))
    assert {(0, "q_rope"), (0, "k_rope"), (L - 1, "q_rope"), (0, "q"), (None, "logits")} <= seen


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_trace_without_computed_values_says_not_computed_and_marks_no_check(browser, reports, capsys, tmp_path,
                                                                              lang):
    """The same OLMo 2 trace with q_rope's computed values dropped (as a trace written before the cards were
    computed): the q_rope card says its values were not computed, in the page's language, shows no computed row and
    marks neither ✓ nor ✗; nothing is worked out in the page instead."""
    _, events, _ = reports("olmo2")
    n = n_prompt(events)
    out = []
    for ev in events:
        if ev["event"] == "tensor" and ev["name"] == "q_rope" and ev.get("sample", {}).get("computed"):
            ev = json.loads(json.dumps(ev))
            del ev["sample"]["computed"]
        out.append(ev)
    trace = tmp_path / "uncomputed.jsonl"
    trace.write_text("".join(json.dumps(e) + "\n" for e in out), encoding="utf-8")
    page = tmp_path / f"uncomputed-{lang}.html"
    code, _, err = run_cli(capsys, "report", trace, "-o", page, "--lang", lang)
    assert code == 0, err
    o = Opened(browser, page)
    try:
        pick(o.page, n - 1, 0, 1)
        card = next(c for c in o.page.evaluate(CARDS) if c["point"] == "q_rope")
        assert card["err"] is None and card["missing"]
        rows = o.page.evaluate("""() => Array.from(document.querySelectorAll(
          "#walk-panel .card[data-point='q_rope'] table.walkv")).map((t) => t.querySelectorAll("tr").length)""")
        assert rows and all(r == 2 for r in rows), rows  # its entries and the recorded values: no computed row
        assert card["check"] and card["check"][:1] not in "✓✗"
        assert ("not computed" in card["check"]) == (lang == "en") and ("未计算" in card["check"]) == (lang == "zh")
        k = next(c for c in o.page.evaluate(CARDS) if c["point"] == "k_rope")  # its neighbour is still computed
        assert k["check"].startswith("✓") and "·" not in k["computed"]
    finally:
        o.page.close()


# ----------------------------------------------------------------------------------------------------------------
# 2. s3 from the mask the layer used

MASK = """() => { const p = document.querySelector("#walk-panel [data-seed='s3'] p[data-mask-allowed]");
  return p ? {allowed: Number(p.dataset.maskAllowed), slots: Number(p.dataset.maskSlots), text: p.textContent} : null; }"""


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_s3_says_which_keys_the_window_hides(browser, reports, lang):
    """gpt-oss's layer 0 (a window of 4), prompt token t: it may attend min(4, t + 1) of the pass's slots, the older
    ones masked as outside the window and the later ones as later tokens; its global layer 1 hides only the later
    ones; a decode step (17 slots, past the sample's 16) says the same from the layer's declared mask."""
    lm, events, path = reports("gpt_oss", lang)
    n = n_prompt(events)
    window, later = ("outside the window of 4", "later tokens") if lang == "en" else ("在 4 个键的窗口之外", "后面的词元")
    o = Opened(browser, path)
    try:
        pick(o.page, 9, 0, 3)
        m = o.page.evaluate(MASK)
        assert (m["allowed"], m["slots"]) == (4, n)
        assert f"0–5 ({window})" in m["text"] and f"10–{n - 1} ({later})" in m["text"]
        pick(o.page, 9, 1, 3)
        m = o.page.evaluate(MASK)
        assert (m["allowed"], m["slots"]) == (10, n) and window not in m["text"] and f"10–{n - 1} ({later})" in m["text"]
        pick(o.page, n, 0, 0)  # the first decode step: n + 1 slots
        m = o.page.evaluate(MASK)
        assert (m["allowed"], m["slots"]) == (4, n + 1) and f"0–{n - 4} ({window})" in m["text"]
    finally:
        o.page.close()


@pytest.fixture(scope="module")
def batch_pages(families, tmp_path_factory):
    """gpt-oss on a batch of two prompts (row 1 padded on the left): its pages for rows 0 and 1, en and zh."""
    import llmtrace

    out = tmp_path_factory.mktemp("batch3")
    model = llmtrace.load(str(families.hf_dir("gpt_oss")), threads=1)
    run = model.generate(["The quick brown fox jumps", "Hi"], max_new_tokens=2, trace="full", layers="0,-1",
                         for_report=True, ignore_eos=True)
    return {(row, lang): run.report(out / f"batch-{row}-{lang}.html", row=row, lang=lang) for row in (0, 1)
            for lang in ("en", "zh")}


@pytest.mark.parametrize("size", VIEWPORTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_s3_of_a_padded_batch_row_masks_its_pad_slots_and_the_window(browser, batch_pages, size):
    """Row 1 ("Hi", padded): its last prompt token may attend its own real slots only; the line names the pad slots
    and the window's, and the row of cells marks each slot as the mask did. Row 0 has no pad slots and says so."""
    from helpers import embedded

    data = embedded(batch_pages[(1, "en")].read_text(encoding="utf-8"))
    pad, n = data["pad"], len([x for x in data["tokens"] if x["step"] is None])
    assert pad > 0
    o = open_at(browser, batch_pages[(1, "en")], size)
    try:
        pick(o.page, n - 1, 0, 0)
        m = o.page.evaluate(MASK)
        q = pad + n - 1
        allowed = min(4, n)
        assert (m["allowed"], m["slots"]) == (allowed, pad + n)
        assert f"0–{pad - 1} (pad slots)" in m["text"] if pad > 1 else "0 (pad slots)" in m["text"]
        cells = o.page.eval_on_selector_all("#walk-panel table.walkmask td", "tds => tds.map((t) => t.className)")
        assert cells == ["pad"] * pad + ["window"] * (q + 1 - pad - allowed) + ["on"] * allowed
        width = o.page.evaluate("document.documentElement.scrollWidth")
        assert width <= size[0]
    finally:
        o.page.close()
    o = open_at(browser, batch_pages[(0, "zh")], size)
    try:
        pick(o.page, 3, 1, 0)
        m = o.page.evaluate(MASK)
        assert (m["allowed"], m["slots"]) == (4, len(embedded(batch_pages[(0, "zh")].read_text())["tokens"]) - 2)
        assert "(填充槽位)" not in m["text"] and "没有填充槽位" in o.page.inner_text("#walk-panel [data-seed='s3']")
    finally:
        o.page.close()


# ----------------------------------------------------------------------------------------------------------------
# 3. gpt-oss: the sink, YaRN's θ, the clamped GLU, the attention section's words


def card_text(page, point: str) -> str:
    return page.inner_text(f"#walk-panel .card[data-point='{point}']")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_gpt_oss_cards_show_the_sink_logit_yarns_theta_and_the_clamped_glu(browser, reports, lang):
    """Layer 0, head 3: the probs card prints the head's learned sink logit (the checkpoint's attn.sinks[3]) and the
    scores' own log-sum-exp, which with the sink give the lse it prints; the RoPE card prints the θᵢ the model runs
    (its plan's YaRN-blended inv_freq, not base^(−2i/d)) and YaRN's rule; the act card says g·σ(1.702·g)·(u + 1) after
    the clamps."""
    import math
    import re

    lm, events, path = reports("gpt_oss", lang)
    sink = float(lm.model.get_parameter("layers.0.attn.sinks")[3])
    inv = lm.maths.layers[0]["q_rope"].const("inv_freq")
    o = Opened(browser, path)
    try:
        pick(o.page, 9, 0, 3)
        probs = card_text(o.page, "probs")
        assert f"{sink:.5g}" in probs.replace("−", "-")
        lse, lse_s = (float(x) for x in re.search(r"= (-?[\d.]+)[:：].*?= (-?[\d.]+)[ （(]", probs).groups())
        assert lse == pytest.approx(math.log(math.exp(lse_s) + math.exp(sink)), abs=2e-4)
        assert ("learned sink logit" in probs) == (lang == "en") and ("汇点 logit" in probs) == (lang == "zh")
        rope = card_text(o.page, "q_rope")
        assert f"θ4 = {inv[4]:.4g}" in rope and "YaRN" in rope
        assert f"{150000.0 ** (-8 / 16):.4g}" in rope  # the unscaled θ₄ it is not
        act = card_text(o.page, "act")
        assert "g · σ(1.702 · g) · (u + 1)" in act and "clamped(gate" not in act
    finally:
        o.page.close()


HATCHED = """([layer, r, c]) => { const sel = document.querySelector("#att-layer");
  sel.value = String(layer); sel.dispatchEvent(new Event("change"));
  const cv = document.querySelector("#att-canvas"), cell = Number(cv.dataset.cell);
  const px = cv.getContext("2d").getImageData(c * cell + 1, r * cell + 1, 2, 1).data;
  return [[px[0], px[1], px[2]], [px[4], px[5], px[6]]].every((p) => p[0] === p[1] && p[1] === p[2] &&
    (p[0] === 214 || p[0] === 246)); }"""


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("size", VIEWPORTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpt_oss_attention_section_speaks_of_its_window_and_learned_sinks(browser, reports, lang, size):
    """The attention section's words come from the layers' declaration: layer 0's window is named and its masked
    cells hatched (query 9, key 0: hatched in layer 0, drawn in the global layer 1), no "first token is the attention
    sink" where the heads have learned sinks, and the sink's largest recorded share is shown. Llama keeps its words."""
    _, events, path = reports("gpt_oss", lang)
    share = max(e["stats"]["max"] for e in events if e["event"] == "tensor" and e["name"] == "sink")
    o = open_at(browser, path, size)
    try:
        text = o.page.inner_text("#attention")
        assert o.page.evaluate(HATCHED, [0, 9, 0]) and not o.page.evaluate(HATCHED, [1, 9, 0])
        assert o.page.evaluate(HATCHED, [1, 9, 10])  # a later key: hatched in every layer
        assert f"{share:.3f}" in o.page.inner_text("#att-sink")
        if lang == "en":
            assert "layer 0: 4 keys" in text and "attention sink" not in text and "learned sink logit" in text
        else:
            assert "第 0 层：4 个键" in text and "学到的汇点" in text
    finally:
        o.page.close()
    _, _, llama = reports("llama", lang)
    o = open_at(browser, llama, size)
    try:
        text = o.page.inner_text("#attention")
        assert ("the first token (the attention sink)" in text) == (lang == "en") and "learned sink" not in text
    finally:
        o.page.close()


# ----------------------------------------------------------------------------------------------------------------
# 4. per-head cards name the KV head and the GQA group

HEADLINES = """() => Array.from(document.querySelectorAll("#walk-panel .card")).map((c) => {
  const p = c.querySelector(".headline");
  return [c.dataset.point, c.dataset.layer, p ? [p.dataset.kvHead, p.dataset.group, p.textContent] : null]; })"""


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_per_head_cards_name_the_kv_head_and_the_gqa_group(browser, reports, lang):
    """gpt-oss (4 query heads on 2 KV heads), query head 3 chosen: every card of a KV-head point (k, v, k_rope) says
    it reads KV head 1, shared by query heads 2 and 3; every card of a query-head point says head 3 in group 1;
    OLMo 2 (one KV head a query head) says there is no grouping."""
    lm, events, path = reports("gpt_oss", lang)
    axes = {p.name: p.axes for p in lm.points.layer}
    sampled = {e["name"] for e in events if e["event"] == "tensor" and e["layer"] == 0 and e.get("sample")
               and e.get("step", 0) == 0}
    o = Opened(browser, path)
    try:
        pick(o.page, 9, 0, 3)
        lines = {name: line for name, layer, line in o.page.evaluate(HEADLINES) if layer == "0"}
        kv_points = [n for n in ("k", "v", "k_rope") if n in lines]
        assert len(kv_points) == 3
        for name, line in lines.items():
            a = axes.get(name) or () if name in sampled else ()
            if "Hkv" in a and "H" not in a:
                assert line and line[:2] == ["1", "2,3"], (name, line)
                assert ("KV head 1" in line[2] and "query heads 2, 3" in line[2]) if lang == "en" else \
                    ("KV 头 1" in line[2] and "查询头 2, 3" in line[2])
            elif "H" in a:
                assert line and line[:2] == ["1", "2,3"] and ("Query head 3" in line[2] or "查询头 3" in line[2])
            else:
                assert line is None, name
    finally:
        o.page.close()
    _, _, path = reports("olmo2", lang)
    o = Opened(browser, path)
    try:
        pick(o.page, 5, 0, 2)
        lines = {name: line for name, layer, line in o.page.evaluate(HEADLINES) if layer == "0"}
        assert lines["k_rope"][:2] == ["2", "2"]
        assert ("no grouping" in lines["k_rope"][2]) if lang == "en" else ("不分组" in lines["k_rope"][2])
    finally:
        o.page.close()


# ----------------------------------------------------------------------------------------------------------------
# 5. smaller: a masked row's norm, a layer without RoPE, the map's word steps, widths


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_masked_scores_row_has_no_infinite_norm_and_a_layer_without_rope_is_not_rotated(browser, reports, lang):
    """gpt-oss's layer 0 at token 9: its scores row holds −∞ at masked keys, and the card says the row has no norm
    to show instead of "Infinity"; SmolLM3's layer 3 (no RoPE): its q_rope and k_rope cards are not subtitled as
    rotated by their positions."""
    _, _, path = reports("gpt_oss", lang)
    o = Opened(browser, path)
    try:
        pick(o.page, 9, 0, 3)
        scores = card_text(o.page, "scores")
        assert "Infinity" not in o.page.inner_text("#walk-panel") and "−∞" in scores
        assert ("norm of the row: none" in scores) if lang == "en" else ("范数：无" in scores)
    finally:
        o.page.close()
    lm, _, path = reports("smollm3", lang)
    assert lm.maths.layers[3]["q_rope"].const("rotation") == "none"
    o = Opened(browser, path)
    try:
        pick(o.page, 5, 3, 0)
        for point in ("q_rope", "k_rope"):
            sub = o.page.inner_text(f"#walk-panel .card[data-point='{point}'] h4 .note")
            assert ("applies no RoPE" in sub) if lang == "en" else ("不做旋转位置编码" in sub), sub
        pick(o.page, 5, 0, 0)  # a rotating layer keeps its words
        assert "applies no RoPE" not in o.page.inner_text("#walk-panel .card[data-point='q_rope'] h4 .note")
    finally:
        o.page.close()


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("size", VIEWPORTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_map_has_a_button_for_every_step_told_in_words(browser, reports, lang, size):
    """s1–s3, s5 and s10–s12 have no point of their own: each box of the map has a button that opens, in place, what
    the walk says there (the token, its mask row, its position, the sampler), and closes again from the keyboard."""
    _, events, path = reports("gpt_oss", lang)
    o = open_at(browser, path, size)
    try:
        pick(o.page, 9, 0, 3)
        seeds = o.page.eval_on_selector_all("#passmap .mapseed", "bs => bs.map((b) => b.dataset.seedOpen)")
        assert seeds == ["s1", "s2", "s3", "s5", "s10", "s11", "s12"]
        o.page.click("#passmap .mapseed[data-seed-open='s3']")
        assert o.page.get_attribute("#passmap .mapseed[data-seed-open='s3']", "aria-expanded") == "true"
        card = o.page.inner_text("#map-card")
        assert "0–5" in card and ("outside the window of 4" in card if lang == "en" else "窗口之外" in card)
        o.page.press("#passmap .mapseed[data-seed-open='s3']", "Enter")
        assert o.page.inner_text("#map-card") == ""
        o.page.click("#passmap .mapseed[data-seed-open='s5']")
        assert ("Position 9" in o.page.inner_text("#map-card")) if lang == "en" else "位置 9" in o.page.inner_text("#map-card")
        box = o.page.eval_on_selector("#passmap .mapseed[data-seed-open='s12']", "b => b.getBoundingClientRect().right")
        assert box <= size[0]
    finally:
        o.page.close()


FIT = """() => ({cut: Array.from(document.querySelectorAll("#walk-panel .scroll")).filter((e) =>
    e.scrollWidth > e.clientWidth + 1).length, tables: document.querySelectorAll("#walk-panel table.walkv").length,
  page: document.documentElement.scrollWidth,
  heat: document.querySelector(".att-axes").getBoundingClientRect().right})"""


@pytest.mark.parametrize("name", ["gpt_oss", "phi3_longrope"])
def test_walk_tables_fit_at_1280_and_the_heatmap_fits_a_phone(browser, reports, name):
    """At 1280 px no walk table is cut and scrolled inside its card (a 16-entry sample is shown as its two halves);
    at 390 px the heatmap (16 × 16 or more cells) and its labels fit the screen, and the page never scrolls sideways."""
    _, events, path = reports(name)
    for size in VIEWPORTS:
        o = open_at(browser, path, size)
        try:
            pick(o.page, n_prompt(events) - 4, 0, 1)
            got = o.page.evaluate(FIT)
            assert got["tables"] > 20 and got["page"] <= size[0], (size, got)
            if size[0] == 1280:
                assert got["cut"] == 0, got
            assert got["heat"] <= size[0], (size, got)
        finally:
            o.page.close()


# ----------------------------------------------------------------------------------------------------------------
# 6. serve's sliders


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory):
    """`llmtrace serve` of a tiny model (tests/tiny.py), one thread: its page's address with the token."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tiny import TinySpec, write_hf_dir

    path = tmp_path_factory.mktemp("tiny") / "tinyhf"
    write_hf_dir(path, TinySpec())
    p = subprocess.Popen([sys.executable, "-m", "llmtrace", "serve", "-m", str(path), "--port", "0", "--no-browser"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, LLMTRACE_THREADS="1"))
    deadline, url = time.time() + 120, None
    while time.time() < deadline and url is None:
        m = re.search(r"(http://127\.0\.0\.1:\d+/\?token=\S+)", p.stdout.readline())
        if m:
            url = m.group(1)
        elif p.poll() is not None:
            break
    assert url, p.stderr.read()
    yield url
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("size", VIEWPORTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_serves_sampler_settings_are_labelled_sliders_with_their_number(browser, lang, size, tmp_path):
    """Temperature, top-k and top-p (and min-p) are sliders (input type=range) named by their labels, each with its
    number beside it and said to a screen reader (aria-valuetext: 0 is greedy, an untouched truncation off); the
    keyboard moves them; at 390 px they fit the screen."""
    from llmtrace.report.i18n import Words
    from llmtrace.report.serve_page import serve_page
    from llmtrace.serve.runs import Limits

    w = Words(lang)
    page = browser.new_page(viewport={"width": size[0], "height": size[1]})
    try:
        html = tmp_path / f"serve-{lang}.html"
        html.write_text(serve_page(["tinyhf"], Limits(), lang), encoding="utf-8")
        page.goto(html.as_uri())
        for key, id_, shown in (("temperature", "temperature", w("js.greedy")), ("top_k", "top_k", w("js.off")),
                                ("top_p", "top_p", w("js.off")), ("min_p", "min_p", w("js.off"))):
            slider = page.get_by_label(w(f"whatif.{key}"), exact=True)
            assert slider.get_attribute("id") == id_ and slider.get_attribute("type") == "range"
            assert page.inner_text(f"#{id_}-out") == shown and slider.get_attribute("aria-valuetext") == shown
            box = slider.bounding_box()
            assert box["x"] + box["width"] <= size[0]
        page.focus("#temperature")
        page.keyboard.press("ArrowRight")
        assert page.input_value("#temperature") == "0.05" and page.inner_text("#temperature-out") == "0.05"
        assert page.get_attribute("#temperature", "aria-valuetext") == "0.05"
        page.focus("#top_k")
        for _ in range(3):
            page.keyboard.press("ArrowRight")
        assert page.inner_text("#top_k-out") == "3"
        assert page.evaluate("document.documentElement.scrollWidth") <= size[0]
    finally:
        page.close()


def test_moving_a_slider_resamples_the_step_and_redraws_the_distribution(serve_url, browser):
    """After a run, each move of a slider re-samples the chosen step on the server (no button): top-k 2 leaves two
    tokens whose probabilities sum to 1; top-k back to off at temperature 1.5 leaves more, redrawn as bars."""
    url = serve_url
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(url)
        page.get_by_label("Prompt").fill("The capital of France is")
        page.get_by_label("new tokens").fill("3")
        page.get_by_role("button", name="Run").click()
        page.locator("#status", has_text="done").wait_for(timeout=120_000)
        page.frame_locator("#page").locator("#whatif").wait_for(timeout=60_000)  # the run's page, loaded
        page.locator("#step").fill("1")
        page.focus("#temperature")
        for _ in range(30):  # 0 → 1.5, one key press at a time, as a drag goes
            page.keyboard.press("ArrowRight")
        assert page.input_value("#temperature") == "1.5"
        page.locator("#resample[data-temperature='1.5'] .side.again ol.dist").wait_for(timeout=60_000)
        page.focus("#top_k")
        page.keyboard.press("ArrowRight")
        page.keyboard.press("ArrowRight")
        page.locator("#resample[data-top-k='2'] .side.again ol.dist").wait_for(timeout=60_000)
        rows = page.locator("#resample .side.again ol.dist li")
        assert rows.count() == 2
        probs = [float(rows.nth(i).locator(".num").inner_text()) for i in range(2)]
        assert sum(probs) == pytest.approx(1.0, abs=2e-3)
        assert "top-k 2" in page.inner_text("#resample") and "temperature 1.5" in page.inner_text("#resample")
        page.keyboard.press("Home")  # top-k off again
        page.locator("#resample[data-top-k='0'] .side.again ol.dist").wait_for(timeout=60_000)
        assert page.locator("#resample .side.again ol.dist li").count() > 2
        assert errors == []
    finally:
        page.close()


# ----------------------------------------------------------------------------------------------------------------
# 7. what a family changes, in both languages

CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss", "olmo2", "phi3_longrope", "qwen3", "qwen3_5",
                                  "qwen3_moe_dense", "mixtral", "smollm3", "qwen3_swa", "deepseek_v3", "deepseek_v2",
                                  "granite_hybrid", "granite_hybrid_dense", "lfm2", "gemma4"])
def test_every_change_line_of_a_family_is_said_in_both_languages(families, name):
    """Each line of what the family changes (model.family.describe_changes) is said from its family's own words,
    by key and arguments (the model record's changes_said): in English the very line, in Chinese a Chinese one with
    the same numbers."""
    import llmtrace
    from llmtrace.model.family import said_in
    from llmtrace.trace.records import model_record

    lm = llmtrace.load(str(families.hf_dir(name)), threads=1)
    m = model_record(lm.loaded)
    assert m["changes"] and len(m["changes_said"]) == len(m["changes"])
    for line, said in zip(m["changes"], m["changes_said"]):
        assert said is not None, line
        assert said_in(m["family"], said, "en") == line
        zh = said_in(m["family"], said, "zh")
        assert zh and CJK.search(zh) and zh != line, line
        assert set(re.findall(r"\d+", line.replace(",", ""))) <= set(
            re.findall(r"\d+", zh.replace(",", ""))), (line, zh)  # the same numbers


@pytest.mark.parametrize("name", ["deepseek_v3", "granite_hybrid", "lfm2", "gemma4", "gemma3"])
def test_the_chinese_explain_page_says_what_the_family_changes_from_its_words(families, capsys, tmp_path, name):
    """explain --html --lang zh: the block "与 Llama 的不同之处" holds each line of what the family changes as its
    family's words say it in Chinese (model.family.said_in), none of them left in English."""
    from helpers import run_cli

    import llmtrace
    from llmtrace.model.family import said_in
    from llmtrace.trace.records import model_record

    m = model_record(llmtrace.load(str(families.hf_dir(name)), threads=1).loaded)
    out = tmp_path / "explain.html"
    code, _, err = run_cli(capsys, "explain", "hello", "-m", families.hf_dir(name), "--layer", "0", "--html", out,
                           "--lang", "zh")
    assert code == 0, err
    html = out.read_text()
    block = html[html.index("与 Llama 的不同之处"):]
    block = re.sub(r"<[^>]+>", " ", block[:block.index("</table>")])
    for line, said in zip(m["changes"], m["changes_said"]):
        zh = said_in(m["family"], said, "zh")
        assert html_unescaped(zh) in re.sub(r"\s+", " ", html_unescaped(block)), (name, zh)
        assert not english_run(zh), zh


def english_run(text: str, n: int = 3) -> bool:
    """Whether `text` has n English words in a row (names with _ . or digits are not words)."""
    run = 0
    for token in text.split():
        word = token.strip("()[]{},.;:!?\"'“”‘’")
        run = run + 1 if word and re.fullmatch(r"[A-Za-z]+(?:[-'][A-Za-z]+)*", word) else 0
        if run >= n:
            return True
    return False


def html_unescaped(text: str) -> str:
    import html

    return re.sub(r"\s+", " ", html.unescape(text))


CHANGES_ROW = """(k) => { const th = Array.from(document.querySelectorAll("table.facts th")).find((e) => e.textContent === k);
  return th ? th.nextElementSibling.textContent : null; }"""


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss", "qwen3_5", "deepseek_v3", "granite_hybrid", "lfm2", "gemma4"])
@pytest.mark.parametrize("size", VIEWPORTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_chinese_page_says_what_the_family_changes_in_chinese(browser, reports, name, size):
    """The run table's "相对 Llama 的改动" row on the zh page: every line Chinese, no run of three English words
    (test_learner_pages.english_runs); the en page's row is the trace's English lines."""
    from llmtrace.report.i18n import Words

    lm, events, zh = reports(name, "zh")
    _, _, en = reports(name, "en")
    lines = next(e for e in events if e["event"] == "run")["model"]["changes"]
    o = open_at(browser, zh, size)
    try:
        row = o.page.evaluate(CHANGES_ROW, Words("zh")("run.k.changes"))
        assert row and len(row.split(" · ")) == len(lines)
        words = [w.strip("()[]{},.;:!?\"'“”‘’（），。；：") for w in re.split(r"\s+", row)]
        run, runs = [], []
        for w in words + [""]:
            if w and re.fullmatch(r"[A-Za-z]+(?:[-'][A-Za-z]+)*", w) and w not in ALLOWED:
                run.append(w)
                continue
            if len(run) >= 3:
                runs.append(" ".join(run))
            run = []
        assert not runs, runs
    finally:
        o.page.close()
    o = open_at(browser, en, size)
    try:
        assert o.page.evaluate(CHANGES_ROW, Words("en")("run.k.changes")) == " · ".join(lines)
    finally:
        o.page.close()
