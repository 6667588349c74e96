"""Issue 50 item 7: the size of things. Every tensor of one pass drawn as a box whose area is its element count, on the
report page (report/sizes.py, assets/sizes.js), in Chromium at 1280 and 390 px, in English and Chinese: on the real
SmolLM2 and on the random-weight fixtures of Qwen3.5 (linear attention) and Granite 4 (Mamba2).

What is measured is what Chromium drew: each box's bands' rendered areas against the element counts the trace gives,
and each caption against the trace's own shapes (its tensor events, its declared axes, its layers' memory and the
cache's length after each step), never against the page's own data."""

from __future__ import annotations

import math
import re

import pytest

from helpers import DRAWN, open_at

VIEWPORTS = [(1280, 900), (390, 844)]
COUNT_WORD = {"en": "numbers", "zh": "个数"}


def shape_text(shape, axes) -> str:
    return "[" + ", ".join(f"{a}={n}" for a, n in zip(axes, shape)) + "]" if axes and len(axes) == len(shape) else \
        "[" + ", ".join(map(str, shape)) + "]"


def expected(events: list[dict], step: int, layer: int) -> dict[str, tuple[list[int], str, str]]:
    """What the trace says the view of (step, layer) holds: {name: (shape, its text, role)}: the tensors the pass
    recorded in the layer and outside the layers, and the layer's cache, its per-token entries times the slots after
    the pass."""
    run = next(e for e in events if e["event"] == "run")
    axes = {p["name"]: p.get("axes") for p in run["points"]}
    mem = run["model"]["memory"][layer]
    out = {}
    for e in events:
        if e["event"] == "tensor" and e.get("step", 0) == step and e["layer"] in (None, layer):
            state = tuple(e["shape"]) in {tuple(s) for s in mem["constant"].values()}
            out[e["name"]] = [e["shape"], shape_text(e["shape"], axes.get(e["name"])), "state" if state else ""]
    slots = next(e for e in events if e["event"] == "step" and e["step"] == step)["kv_cache"]["seq_len"]
    for name, per in mem["per_token"].items():
        if mem["reads"] is None:
            own = [a for a in axes.get(name) or [] if a != "T"]
            out[f"cache.{name}"] = [[slots, *per], shape_text([slots, *per], ["S", *own] if len(own) == len(per)
                                                                else None), "cache"]
    return out


def check_view(page, events, step: int, layer: int, lang: str, width: int) -> list[dict]:
    """The view drawn for (step, layer): every box the trace has, captioned with its shape and count, each box's
    drawn area its element count at one scale (a cut box drawn whole first), nothing past the window's right edge.
    Returns the boxes as drawn (before any was drawn whole)."""
    boxes = page.evaluate(DRAWN)
    want = expected(events, step, layer)
    assert sorted(b["name"] for b in boxes) == sorted(want), (step, layer)
    for b in boxes:
        shape, text, role = want[b["name"]]
        assert b["shape"] == shape and b["text"] == text and b["role"] == role, (b, want[b["name"]])
        assert b["n"] == math.prod(shape) and f"{b['n']:,} {COUNT_WORD[lang]}" in b["cap"]
        assert b["hidden"] == "true"  # the caption is the text; the drawing is hidden from screen readers
        assert b["right"] <= width + 0.5, b  # no box or caption past the right edge
    cell = float(page.eval_on_selector("#sizes-fig", "f => f.dataset.cell"))
    for b in boxes:
        if b["broken"]:  # cut at the cap: it says how much of it is drawn, and that part is drawn to scale
            pct = float(re.search(r"(\d+)%", b["note"]).group(1))
            assert abs(100 * b["area"] / (b["n"] * cell * cell) - pct) <= 1, b
    for b in [b for b in boxes if b["broken"]]:
        page.locator(f"#sizes-fig li[data-name='{b['name']}'] .sz-broken button").click()
    whole = {b["name"]: b for b in page.evaluate(DRAWN)}
    assert not any(b["broken"] for b in whole.values())
    for b in whole.values():  # area = n · c² for every box: the ratios of the areas are the ratios of the counts
        if b["n"] * cell * cell >= 1:  # (a box under one px² is drawn and measured too coarsely to compare)
            assert b["area"] == pytest.approx(b["n"] * cell * cell, rel=0.03), b
    for b in [b for b in boxes if b["broken"]]:  # and back: the learner's choice, undone
        page.locator(f"#sizes-fig li[data-name='{b['name']}'] .sz-broken button").click()
    return boxes


def walk_views(o, events, lang: str, size) -> dict[tuple[int, int], list[dict]]:
    """Every recorded layer at every step of the step bar: check_view on each."""
    page = o.page
    steps = sorted(e["step"] for e in events if e["event"] == "step")
    layers = [int(x) for x in page.eval_on_selector_all("#sizes-layer option", "os => os.map((o) => o.value)")]
    seen = {}
    for i, step in enumerate(steps):
        if i:
            page.click("#step-next")
        for layer in layers:
            page.select_option("#sizes-layer", str(layer))
            seen[(step, layer)] = check_view(page, events, step, layer, lang, size[0])
    assert page.evaluate("document.documentElement.scrollWidth") <= size[0]
    assert not [m for m in o.messages if m[0] in ("error", "pageerror")]
    return seen


def by_name(boxes: list[dict]) -> dict[str, dict]:
    return {b["name"]: b for b in boxes}


# ----------------------------------------------------------------------------------------------------------------
# the layout's rules, on shapes a model records


def test_a_boxs_rows_are_its_tokens_and_a_state_is_laid_wide():
    from llmtrace.report.sizes import grid, seed_group

    assert grid([5, 9, 64], ["T", "H", "Dh"]) == (5, 576, 9)  # q: T rows of 9 heads × 64
    assert grid([9, 5, 7], ["H", "T", "S"]) == (5, 63, 9)  # scores: T rows of 9 heads × 7 slots
    assert grid([9, 7, 64], ["H", "S", "Dh"]) == (7, 576, 9)  # the keys read: S rows
    assert grid([49152], ["V"]) == (1, 49152, 1)  # the logits: one row
    assert grid([5], ["T"]) == (5, 1, 1)  # the slots written: one column
    assert grid([96, 3], ["C", "Kc-1"]) == (3, 96, 1)  # a convolution's state: wide, not 96 rows of 3
    assert grid([4, 16, 8], ["Hv", "Dk", "Dv"]) == (16, 32, 4)  # a recurrent state: Dk rows of 4 heads × Dv
    assert seed_group("s6.1/s6.2") == "s6.1" and seed_group("s6") == "s6.1" and seed_group("s9") == "s9"


# ----------------------------------------------------------------------------------------------------------------
# the real SmolLM2


@pytest.fixture(scope="module")
def smol(smollm_path, tmp_path_factory):
    """SmolLM2's three-step run, `--trace full --layers 0,-1`, and its page in each language."""
    import llmtrace

    lm = llmtrace.load(str(smollm_path), threads=1)
    run = lm.generate("The capital of France is", max_new_tokens=3, trace="full", layers="0,-1", for_report=True,
                      ignore_eos=True)
    out = tmp_path_factory.mktemp("sizes")
    return run.events, {lang: run.report(out / f"smol-{lang}.html", lang=lang) for lang in ("en", "zh")}


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("size", VIEWPORTS, ids=["1280", "390"])
def test_smollm2s_tensors_are_drawn_to_scale(browser, smol, lang, size):
    """Every box of layers 0 and 29 at each step: its area its count, its caption the trace's shape; the logits over
    49,152 entries cut at first (saying how much is drawn) and whole on a click; the K and V caches one slot longer
    each step while a decode pass is one row."""
    events, paths = smol
    o = open_at(browser, paths[lang], size)
    try:
        seen = walk_views(o, events, lang, size)
        n = len(next(e for e in events if e["event"] == "tokens")["tokens"])
        first, last = by_name(seen[(0, 0)]), by_name(seen[(2, 29)])
        assert first["logits"]["broken"] and [b["name"] for b in seen[(0, 0)] if b["can"]] == ["logits"]
        assert first["q"]["shape"] == [n, 9, 64] and last["q"]["shape"] == [1, 9, 64]
        assert first["k"]["label"] == "k" and first["k"]["group"] == "s6.1"
        assert [first["k"]["shape"][0], last["k"]["shape"][0]] == [n, 1]
        caches = [[b for b in seen[(s, 0)] if b["role"] == "cache"] for s in range(3)]
        assert [[c["shape"] for c in cs] for cs in caches] == [[[n + s, 3, 64]] * 2 for s in range(3)]
        assert caches[0][0]["group"] == "s6.8" and caches[0][0]["text"] == f"[S={n}, Hkv=3, Dh=64]"
        o.page.select_option("#sizes-layer", "0")
        o.page.locator("#sizes-layer").focus()  # the controls from the keyboard: the layer, then the cut box's button
        o.page.keyboard.press("ArrowDown")
        assert o.page.eval_on_selector("#sizes-layer", "s => s.value") == "29"
        button = o.page.locator("#sizes-fig li[data-name='logits'] .sz-broken button")
        button.focus()
        o.page.keyboard.press("Enter")
        assert o.page.evaluate("document.activeElement.dataset.name") == "logits"  # focus kept over the redraw
        assert by_name(o.page.evaluate(DRAWN))["logits"]["broken"] is False
    finally:
        o.page.close()


def test_smollm2s_boxes_are_the_traces_shapes_at_every_step_and_layer(smol):
    """The section's data, before any drawing: every view (step × layer) holds exactly the trace's tensors of that
    pass with their shapes and axes, the cache's per-token entries times its slots, and the layers' views are kept
    once per distinct list (the 30 layers of an all-layers page share a few)."""
    from llmtrace.report.data import extract
    from llmtrace.report.i18n import Words
    from llmtrace.report.page import view

    events, _ = smol
    v = view(extract(events), Words("en"))
    sec = next(s["v"] for s in v["sections"] if s["id"] == "sizes")
    S = sec["data"]
    assert [x["layer"] for x in sec["layers"]] == S["layers"] == [0, 29]
    for i, step in enumerate(S["steps"]):
        for j, layer in enumerate(S["layers"]):
            boxes = [S["entries"][e] for _, es in S["lists"][S["views"][i][j]]["g"] for e in es]
            got = {b[0]: (b[2], b[6], b[7]) for b in boxes}
            assert got == {k: tuple(v) for k, v in expected(events, step, layer).items()}, (step, layer)
            n = {b[0]: math.prod(b[2]) for b in boxes}
            assert S["lists"][S["views"][i][j]]["max"] is not None and n["logits"] == 49152
    assert len(S["lists"]) <= len(S["steps"]) * len(S["layers"])


def test_gemma3s_262144_logits_are_cut_and_drawn_whole_on_a_phone(browser, gemma3_path, tmp_path):
    """The real Gemma 3 270M, in Chinese at 390 px: the logits over 262,144 entries are cut (the only box cut), the
    part drawn is the part the note says, and whole they are drawn to the same scale as every other box."""
    import llmtrace

    lm = llmtrace.load(str(gemma3_path), threads=1)
    run = lm.generate("The capital of France is", max_new_tokens=1, trace="full", layers="0,-1", for_report=True,
                      ignore_eos=True)
    o = open_at(browser, run.report(tmp_path / "gemma-zh.html", lang="zh"), VIEWPORTS[1])
    try:
        seen = walk_views(o, run.events, "zh", VIEWPORTS[1])
        first = seen[(0, 0)]
        assert [b["name"] for b in first if b["can"]] == ["logits"] and by_name(first)["logits"]["n"] == 262144
        assert by_name(first)["logits"]["broken"] and "完整画出" in o.page.inner_text("#sizes-fig")
    finally:
        o.page.close()


# ----------------------------------------------------------------------------------------------------------------
# a linear-attention and a Mamba2 hybrid: their own tensors, a state of constant size, a cache only where they attend


@pytest.fixture(scope="module")
def hybrids(families, tmp_path_factory):
    """Qwen3.5 (layers 0: Gated DeltaNet, 3: attention) and Granite 4 hybrid (0: Mamba2, 2: attention), 2 new tokens
    of a prompt past every window, each page in each language."""
    import llmtrace

    out = tmp_path_factory.mktemp("hybrids")
    made = {}
    for name, layers in (("qwen3_5", "0,3"), ("granite_hybrid", "0,2")):
        lm = llmtrace.load(str(families.hf_dir(name)), threads=1)
        run = lm.generate("The quick brown fox", max_new_tokens=2, trace="full", layers=layers, for_report=True,
                          ignore_eos=True)
        made[name] = (run.events, {lang: run.report(out / f"{name}-{lang}.html", lang=lang) for lang in ("en", "zh")})
    return made


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("size", VIEWPORTS, ids=["1280", "390"])
@pytest.mark.parametrize("name,state,mixer,attn", [("qwen3_5", "delta_state", 0, 3), ("granite_hybrid", "ssm_state", 0, 2)])
def test_a_hybrids_layers_show_their_own_tensors_and_memory(browser, hybrids, lang, size, name, state, mixer, attn):
    """The recurrent layer draws its own tensors and its state, the same size at every step, with no cache; the
    attention layer draws q, k, v and a cache one slot longer each step."""
    events, paths = hybrids[name]
    o = open_at(browser, paths[lang], size)
    try:
        seen = walk_views(o, events, lang, size)
        states = [by_name(seen[(s, mixer)])[state] for s in (0, 1)]
        assert states[0]["role"] == "state" and states[0]["shape"] == states[1]["shape"]
        assert states[0]["area"] == pytest.approx(states[1]["area"], rel=1e-6)  # constant: drawn the same
        assert not [b for s in (0, 1) for b in seen[(s, mixer)] if b["role"] == "cache"]
        assert "q" not in by_name(seen[(0, mixer)]) and "q" in by_name(seen[(0, attn)])
        caches = [[b["shape"][0] for b in seen[(s, attn)] if b["role"] == "cache"] for s in (0, 1)]
        assert caches[0] and [c + 1 for c in caches[0]] == caches[1]
        labels = o.page.eval_on_selector_all("#sizes-layer option", "os => os.map((o) => o.textContent)")
        assert len(set(labels)) == 2 and all(("层" in x) == (lang == "zh") for x in labels)  # each layer's kind said
    finally:
        o.page.close()
