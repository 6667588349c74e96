"""The HTML report: its embedded numbers equal the trace's, bad input fails in one line, and the page works in a real
browser (Debian's chromium, driven by playwright): no console errors, no network, one chip per token, a T × S heatmap,
a step choice that changes the top-k chart, and a screenshot that is not blank."""

import base64
import filecmp
from html import unescape
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import Opened, embedded, model_param

from llmtrace.run.explain import lens_events
from llmtrace.run.generate import generate
from llmtrace.report.write import build
from llmtrace.report.data import Q16, bin_matrix, bins_for, unpack_attention
from llmtrace.run.sampler import Sampler, SamplerConfig
from llmtrace.trace.recorder import Recorder
from llmtrace.trace.options import TraceOptions

PROMPT = "Quantum mechanics is a fundamental theory in physics that"


def run_events(lm, level="full", layers=(0, 29), n=6, dump=("0.probs", "29.probs")):
    """A sampled run (temperature, top-k and top-p all act), as the events the recorder emits."""
    events = []
    rec = Recorder(TraceOptions(level=level, layers=list(layers) if layers else None, dump=dump), [events.append],
                   run_info={"prompt": PROMPT})
    cfg = SamplerConfig(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    ids = lm.tokenizer.encode(PROMPT)
    generate(lm, ids, Sampler(cfg, lm.config.vocab_size), n, ignore_eos=True, observer=rec)
    return json.loads(json.dumps(events))  # as a saved trace reads back


@pytest.fixture(scope="module")
def events(smollm):
    return run_events(smollm)


@pytest.fixture(scope="module")
def page(events, smollm):
    return build(events, tokenizer=smollm.tokenizer)


@pytest.fixture(scope="module", params=model_param())
def recorded(request):
    """(model, events, page) of a sampled full run recording the first and the last layer, on the tiny model (quick
    suite) and on SmolLM2 (slow): the checks of the page's numbers run on both."""
    lm = request.getfixturevalue(request.param)
    last = lm.config.n_layers - 1
    events = run_events(lm, layers=(0, last), dump=("0.probs", f"{last}.probs"))
    return lm, events, build(events, tokenizer=lm.tokenizer)


# ----------------------------------------------------------------------------------------------------------------
# the data in the page


def test_tokens_and_steps_in_the_page_are_the_traces(recorded):
    _, events, page = recorded
    d = embedded(page)
    prompt = next(e for e in events if e["event"] == "tokens")["tokens"]
    steps = [e for e in events if e["event"] == "step"]
    assert [t["id"] for t in d["tokens"]] == [t["id"] for t in prompt] + [s["token"]["id"] for s in steps]
    for t in d["tokens"]:  # a byte-level piece stands for its bytes: they decode to the token's text
        if "\ufffd" not in t["text"]:
            assert bytes(t["bytes"]).decode("utf-8") == t["text"]
    for got, s in zip(d["steps"], steps):
        assert got["topk"] == s["topk"] and got["sampler"] == s["sampler"] and got["rng"] == s["rng"]
        assert got["kv"] == s["kv_cache"]
    gen = [t for t in d["tokens"] if t["step"] is not None]
    assert [t["prob"] for t in gen] == [s["sampler"][0]["pick_prob"] for s in steps]
    assert len(steps) == 6 and any(len(s["sampler"]) > 2 for s in steps)  # the funnel has stages to show


def test_attention_maps_are_the_recorded_probabilities(recorded):
    lm, events, page = recorded
    last = lm.config.n_layers - 1
    d = embedded(page)["attention"]
    probs = [e for e in events if e["event"] == "tensor" and e["name"] == "probs"]
    n = max(len(e["values"][0][-1]) for e in probs)  # keys of the last step = every position seen
    assert d["layers"] == [0, last] and d["n"] == n and not d["binned"] and len(d["bins"]) == n
    H = d["n_heads"]
    for layer in (0, last):
        m = unpack_attention(d["maps"][str(layer)], (H, n, n))
        for e in (e for e in probs if e["layer"] == layer):
            v = np.asarray(e["values"])  # (H, T, S): the new queries of this step over all keys so far
            T, S = v.shape[1:]
            np.testing.assert_allclose(m[:, S - T:S, :S], v, atol=0.5 / Q16 + 1e-12)
        assert np.all(m[:, np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] == 0)  # the causal mask


def test_residual_norms_and_kv_are_the_traces(recorded):
    lm, events, page = recorded
    c = lm.config
    d = embedded(page)
    post = [e for e in events if e["event"] == "tensor" and e["name"] == "resid_post"]
    for e in post:
        T = e["shape"][0]
        assert d["residual"]["norms"][str(e["step"])][str(e["layer"])] == e["stats"]["norm"] / math.sqrt(T)
    steps = [e for e in events if e["event"] == "step"]
    assert [s["bytes_used"] for s in d["kv"]["steps"]] == [e["kv_cache"]["bytes_used"] for e in steps]
    bpt = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4  # K and V, every layer, float32
    assert bpt == 46080 or c.n_layers != 30
    assert d["kv"]["bytes_per_token"] == bpt and d["kv"]["per_layer"] == bpt / c.n_layers
    for s in d["kv"]["steps"]:
        assert s["bytes_used"] == s["seq_len"] * bpt
    q = d["tensors"]["points"]["q"]  # a list per field (page.compact_stats), to the 4 figures the panel shows
    grid = d["tensors"]["grids"][q["grid"]]  # its steps and layers, shared with the points recorded at the same ones
    stats = dict(zip(zip(grid["step"], grid["layer"]), q["norm"]))
    for e in (e for e in events if e["event"] == "tensor" and e["name"] == "q"):
        assert stats[(e["step"], e["layer"])] == float(f'{e["stats"]["norm"]:.4g}')


def test_the_residual_chart_joins_only_neighbouring_recorded_layers(recorded):
    """Layers 0 and 29 recorded (and the embedding, x = -1): a line may join the embedding to layer 0, never layer 0
    to layer 29, which would draw 28 layers that were not recorded. Layer 29 is a dot of its own at every step. (The
    tiny model: layers 0 and 3.)"""
    _, events, page = recorded
    section = page.split('id="residual"')[1].split("</section>")[0]
    steps = sorted({e["step"] for e in events if e["event"] == "tensor" and e["name"] == "resid_post"})
    lines = re.findall(r'<polyline points="([^"]+)"', section)
    assert len(lines) == len(steps) and all(len(pts.split()) == 2 for pts in lines)  # -1 → 0 only
    assert len(re.findall(r"<circle ", section)) == 3 * len(steps)  # -1, 0 and 29: every recorded value a dot
    assert "no line crosses it" in section and "⋯" in section  # the gap between layer 0 and layer 29


def test_merges_of_the_prompt_end_in_its_tokens(page, smollm):
    d = embedded(page)
    words = d["merges"]["words"]
    finals = [p for w in words for p in w["final"]]
    assert finals == [smollm.tokenizer.visible(t["piece"]) for t in d["tokens"] if t["step"] is None]
    assert "Quantum" in page and "merged" in page
    # one glyph for a space, as in the terminal: ▁, never the vocabulary's Ġ or the chips' old ␣
    tokens_section = page.split('id="tokens"')[1].split("</section>")[0]
    assert "▁mechanics" in tokens_section and "␣" not in page
    # the raw piece stays only where it is labelled as the vocabulary's own
    assert unescape(tokens_section).count("Ġ") == unescape(tokens_section).count("vocabulary piece 'Ġ") > 0


def test_each_top_k_bar_is_its_probability_against_the_largest(recorded):
    """The top-k chart of every step: the most likely candidate's bar is the full 250 px, each other bar its
    probability's share of the largest, in the trace's order."""
    _, events, page = recorded
    steps = [e for e in events if e["event"] == "step"]
    panels = page.split('<div class="step-panel"')[1:]
    assert len(panels) == len(steps)
    for panel, step in zip(panels, steps):
        chart = panel.split('<svg class="topk"')[1].split("</svg>")[0]
        widths = [float(w) for w in re.findall(r'<rect class="bar[^"]*" x="112" y="[^"]+" width="([^"]+)"', chart)]
        probs = [c["prob"] for c in step["topk"]]
        assert len(widths) == len(probs) and widths[0] == 250.0
        assert widths == pytest.approx([250 * p / max(probs) for p in probs], abs=0.051)


def test_binned_rows_still_sum_to_one():
    n = 300
    rng = np.random.default_rng(0)
    m = np.tril(rng.random((2, n, n)))
    m /= m.sum(axis=-1, keepdims=True)
    bins = bins_for(n)
    assert len(bins) == 128 and bins[0][0] == 0 and bins[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bins, bins[1:]))
    b = bin_matrix(m, bins)
    assert b.shape == (2, 128, 128)
    np.testing.assert_allclose(b.sum(axis=-1), 1.0, atol=1e-12)


def test_a_page_made_by_the_cli_names_the_flags(tiny_lm):
    """The same page, made while a command runs (cli/main.py sets the CLI's words): flags, not keywords."""
    from llmtrace.cli.options import flag_words
    from llmtrace.words import worded

    with worded(flag_words):
        page = build(run_events(tiny_lm, level="steps", layers=None, n=2, dump=()))
    assert "--dump 0.probs" in page and "--trace layers" in page and "`" not in page.split("<script")[0]


@pytest.mark.parametrize("which", model_param())
def test_a_section_without_its_values_names_the_flags(which, request):
    page = build(run_events(request.getfixturevalue(which), level="steps", layers=None, n=2, dump=()))
    attention = page.split('id="attention"')[1].split("</section>")[0]
    residual = page.split('id="residual"')[1].split("</section>")[0]
    lens = page.split('id="lens"')[1].split("</section>")[0]
    # made from Python, the page names the keywords; made by the CLI, its flags (test_a_page_made_by_the_cli_...)
    assert "Not in this trace" in attention and "`dump=[&#39;0.probs&#39;]`" in attention and "--dump" not in page
    assert "Not in this trace" in residual and "`trace=&#39;layers&#39;`" in residual and "--trace" not in residual
    assert "llmtrace lens" in lens
    assert "BPE merges" in page and "without it" in page  # no tokenizer given


def test_the_page_loads_nothing_from_anywhere(recorded):
    page = recorded[2]
    assert not re.search(r'\b(src|href)="(https?:)?//', page)
    assert "@import" not in page and "url(" not in page
    assert "default-src 'none'" in page  # and the browser is told to refuse anything else


# ----------------------------------------------------------------------------------------------------------------
# the command line


def llmtrace(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "llmtrace", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("content, says", [
    ('{"hello": 1}\n', "not a file llmtrace reads back"),
    ("", "empty"),
    ("not json at all\n", "not valid JSON"),
    ('{"schema": "llmtrace.trace/2", "events": [{"event": "run", "schema": "llmtrace.trace/2"}]}\n', "llmtrace.trace/2"),
    ('{"event": "run", "schema": "llmtrace.trace/2", "model": {}}\n{"event": "summary"}\n', "llmtrace.trace/2"),
])
def test_report_of_bad_input_is_one_line_and_keeps_the_old_page(tmp_path, content, says):
    trace = tmp_path / "trace.json"
    trace.write_text(content)
    out = tmp_path / "report.html"
    earlier = '<!doctype html>\n<meta name="generator" content="llmtrace">\n<p>an earlier report</p>\n'
    out.write_text(earlier)  # a page of llmtrace's, which a report may replace
    r = llmtrace("report", str(trace), "-o", str(out))
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
    assert out.read_text() == earlier
    assert [p.name for p in tmp_path.iterdir()] != [] and len(list(tmp_path.iterdir())) == 2  # no temporary left


@pytest.mark.slow
def test_html_of_a_64_token_full_run_fits_3mb_and_equals_report_of_its_trace(smollm_path, tmp_path):
    html, doc = tmp_path / "run.html", tmp_path / "run.json"
    r = llmtrace("generate", PROMPT, "-m", str(smollm_path), "-n", "64", "--ignore-eos", "--trace", "full",
                 "--layers", "0,-1", "--threads", "1", "--html", str(html), "--json", str(doc))
    assert r.returncode == 0, r.stderr
    size = html.stat().st_size
    assert size <= 3_000_000, size
    page = html.read_text()
    d = embedded(page)
    assert d["attention"]["layers"] == [0, 29]  # --html recorded the probabilities of the chosen layers
    assert len(d["steps"]) == 64 and d["attention"]["n"] == 9 + 63
    again = tmp_path / "again.html"
    r = llmtrace("report", str(doc), "-o", str(again), "-m", str(smollm_path))
    assert r.returncode == 0, r.stderr
    assert filecmp.cmp(again, html, shallow=False)  # the same page from the saved trace


@pytest.mark.slow
def test_the_readme_example_page_stays_under_2mb(smollm_path, tmp_path):
    """The README's `--trace full --layers 0,-1` example (24 tokens): with the walk-through's values and every step's
    kept logits, the page stays one file under about 2 MB (issue 34)."""
    html = tmp_path / "report.html"
    r = llmtrace("generate", PROMPT, "-m", str(smollm_path), "-n", "24", "--temperature", "0.8", "--top-p", "0.9",
                 "--seed", "1", "--trace", "full", "--layers", "0,-1", "--threads", "1", "--html", str(html))
    assert r.returncode == 0, r.stderr
    assert html.stat().st_size < 2_000_000, html.stat().st_size
    d = embedded(html.read_text())
    assert len(d["kept_logits"]) == len(d["steps"]) and d["walk"]["samples"]  # what the size is spent on is there


# ----------------------------------------------------------------------------------------------------------------
# in a real browser


@pytest.fixture(scope="module")
def opened(browser, page, tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(page, encoding="utf-8")
    o = Opened(browser, path)
    yield o
    o.page.close()


def test_page_loads_without_errors_or_network(opened):
    assert opened.messages == []
    assert opened.requests == [opened.url]


def test_one_chip_per_token(opened, events):
    n = len(next(e for e in events if e["event"] == "tokens")["tokens"]) + sum(e["event"] == "step" for e in events)
    assert opened.page.locator("#chips .chip").count() == n


def test_heatmap_has_t_by_s_cells_and_shows_the_mask(opened, events):
    pg = opened.page
    pg.select_option("#att-layer", "29")
    pg.select_option("#att-head", "4")
    pg.select_option("#att-scale", "linear")
    c = pg.eval_on_selector("#att-canvas", "c => ({...c.dataset, w: c.width})")
    last = [e for e in events if e["event"] == "tensor" and e["name"] == "probs" and e["layer"] == 29][-1]
    H, T, S = len(last["values"]), None, len(last["values"][0][-1])
    T = S  # every query position over every key position
    assert (int(c["rows"]), int(c["cols"]), int(c["cells"])) == (T, S, T * S)
    assert (c["layer"], c["head"]) == ("29", "4")
    cell = int(c["cell"])
    # a masked cell (first query, last key) is hatched grey; the first query's own key is coloured (p = 1)
    pixel = ("([x, y]) => Array.from(document.getElementById('att-canvas').getContext('2d')"
             ".getImageData(x, y, 1, 1).data.slice(0, 3))")
    masked = pg.evaluate(pixel, [S * cell - cell // 2, cell // 2])
    first = pg.evaluate(pixel, [cell // 2, cell // 2])
    assert masked[0] == masked[1] == masked[2] and masked[0] >= 200
    assert first == [253, 231, 37]  # the palette's top: attention 1.0
    assert H == 9 and pg.locator("button.thumb").count() == 2 * H  # the layers × heads overview
    pg.click("button.thumb[data-layer='0'][data-hi='7']")
    c = pg.eval_on_selector("#att-canvas", "c => c.dataset")
    assert (c["layer"], c["head"], c["cells"]) == ("0", "7", str(T * S))


def test_choosing_a_step_changes_the_topk_chart_and_the_marks(opened):
    pg = opened.page
    shown = lambda: pg.eval_on_selector(".step-panel:not([hidden]) svg.topk", "s => s.outerHTML")
    first = shown()
    pg.focus("#step")
    pg.keyboard.press("ArrowRight")  # keyboard: the step slider
    second = shown()
    assert second != first
    assert pg.eval_on_selector(".step-panel:not([hidden])", "p => p.dataset.step") == "1"
    pg.click("#chips .chip.gen >> nth=3")  # a generated token's chip selects its step
    assert pg.eval_on_selector(".step-panel:not([hidden])", "p => p.dataset.step") == "3"
    assert pg.locator(".chip.gen.current").count() == 1
    pg.click("button.stage[data-stage='s6.1']")
    assert pg.locator("#stage-panel table.stats").count() == 4  # attn_norm, q, k, v per layer
    assert [m for m in opened.messages if m[0] in ("error", "pageerror")] == []


def test_screenshot_is_not_blank(opened, browser):
    png = opened.page.screenshot(full_page=False)
    probe = browser.new_page()
    colours = probe.evaluate("""async (src) => {
        const img = new Image(); img.src = src; await img.decode();
        const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
        const g = c.getContext('2d'); g.drawImage(img, 0, 0);
        const d = g.getImageData(0, 0, c.width, c.height).data, seen = new Set();
        for (let i = 0; i < d.length; i += 4 * 7) seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
        return seen.size; }""", "data:image/png;base64," + base64.b64encode(png).decode())
    probe.close()
    assert colours > 50


def test_lens_page_shows_the_topk_of_a_cell(browser, smollm, tmp_path):
    ids = smollm.tokenizer.encode(PROMPT)
    ev = json.loads(json.dumps(lens_events(smollm, ids, list(range(len(ids))), None, top=5, prompt=PROMPT)))
    path = tmp_path / "lens.html"
    path.write_text(build(ev), encoding="utf-8")
    o = Opened(browser, path)
    cells = o.page.locator("table.lens td[data-row]")
    assert cells.count() == 31 * len(ids)  # 30 layers and the output, every position
    o.page.focus("table.lens td[data-row='29'][data-pos='8']")
    top = [e for e in ev if e["event"] == "lens" and e["layer"] == 29 and e["position"] == 8][0]["topk"]
    panel = o.page.inner_text("#lens-panel")
    assert str(top[0]["id"]) in panel and str(top[4]["id"]) in panel
    assert o.messages == [] and o.requests == [o.url]
    o.page.close()


def test_static_content_is_readable_without_scripts(browser, opened):
    context = browser.new_context(java_script_enabled=False)
    pg = context.new_page()
    pg.route("**/*", lambda r: r.continue_() if r.request.url == opened.url else r.abort())
    pg.goto(opened.url)
    assert pg.locator("#chips .chip").count() == opened.page.locator("#chips .chip").count()
    assert pg.locator(".step-panel:not([hidden]) svg.topk rect.bar").count() == 10  # step 0's top-k chart
    assert pg.locator("#kv svg.chart polyline").count() == 2 and pg.locator("ol.pipeline button").count() == 19
    assert "no merges" not in pg.inner_text("#tokens") and pg.locator(".merge:not([hidden])").count() == 1
    context.close()


def test_explain_and_lens_pages_say_the_threads(smollm):
    import torch

    ids = smollm.tokenizer.encode("The capital of France is")
    page = build(json.loads(json.dumps(lens_events(smollm, ids, [0, 1], [0], prompt="The capital of France is"))))
    assert f"<th scope=row>threads</th><td>{torch.get_num_threads()}</td>" in page and "not recorded in" not in page


# ----------------------------------------------------------------------------------------------------------------
# explain and lens pages lead with what they have; the heatmap's axes are labelled (issue 20, item 5)


def as_default_model(events: list[dict]) -> list[dict]:
    """The session's model is loaded from its GGUF file, so its events name the file's stem; a `llmtrace explain`
    of the default model names it by its registry name, as here."""
    from llmtrace.registry.models_toml import DEFAULT_MODEL

    for ev in events:
        if "model" in ev and isinstance(ev["model"], dict):
            ev["model"]["name"] = DEFAULT_MODEL
    return events


def explain_page(smollm, prompt="The capital of France is"):
    from llmtrace.run.explain import explain_events

    ids = smollm.tokenizer.encode(prompt)
    events = as_default_model(json.loads(json.dumps(explain_events(smollm, ids, 3, prompt=prompt))))
    return build(events, tokenizer=smollm.tokenizer), ids


def headings(page: str) -> list[str]:
    return re.findall(r'<h2 id="[^"]+">([^<]+)</h2>', page)


def test_explain_and_lens_pages_lead_with_what_they_have_and_end_with_the_command_for_the_rest(smollm):
    page, ids = explain_page(smollm)
    assert headings(page) == ["1 · The run", "2 · The layer, taken apart", "3 · The pipeline s1–s12", "4 · Tokens",
                              "5 · Attention", "6 · Logit lens", "7 · The residual stream", "8 · Not in this trace"]
    note = unescape(page.split('id="lacking"')[1].split("</section>")[0])
    assert note.count("<li>") == 1 and ("the values of each point (the walk-through), generation steps, the KV cache "
                                        "per step: <code>llmtrace generate 'The capital of France is' -n 8 --trace "
                                        "full --layers 3 --html report.html</code>") in note
    assert page.count('class="missing"') == 0  # nothing lacking is said anywhere else

    lens = build(as_default_model(json.loads(json.dumps(lens_events(smollm, ids, [0, 4], [0, 29],
                                                                     prompt="The capital of France is")))))
    heads = headings(lens)  # the lens page opens on the lens, with no pipeline of tiles that say "not recorded"
    assert heads[0] == "1 · Logit lens" and heads[-1].endswith("Not in this trace")
    assert not any("pipeline" in h for h in heads) and any(h.endswith("The run") for h in heads)
    note = unescape(lens.split('id="lacking"')[1].split("</section>")[0])
    codes = re.findall(r"<li>.*?<code>([^<]+)</code>", note)
    assert codes == ["llmtrace generate 'The capital of France is' -n 8 --trace full --layers 0,-1 "
                     "--html report.html"]
    assert "per-layer statistics" in note and "attention probabilities" in note
    # every hint on a lens page is a whole command, never a flag lens does not have (it said --trace full)
    hints = re.findall(r'class="missing"[^>]*>.*?</p>', lens) + [note]
    assert all("--trace" not in h.split("llmtrace generate")[0] for h in hints)
    assert embedded(lens)["fill"] == codes[0]  # report.js names it for a stage's statistics
    # a model loaded from a file: the trace has its stem, not its path, so the command says where the path goes
    file_page = build(json.loads(json.dumps(lens_events(smollm, ids, [0], [0], prompt="Hi"))))
    assert "llmtrace generate Hi -m MODEL_PATH -n 8" in file_page


def test_heatmap_axes_name_the_tokens_where_they_fit_and_bins_where_not(smollm, events):
    page, ids = explain_page(smollm)
    keys = page.split('class="att-keys"')[1].split("</svg>")[0]
    labels = [unescape(t) for t in re.findall(r">([^<]+)</text>", keys)]
    assert labels == [f"{i} {smollm.tokenizer.visible_piece(t)}" for i, t in enumerate(ids)]
    queries = page.split('class="att-queries"')[1].split("</svg>")[0]
    assert re.findall(r">([^<]+)</text>", queries) == re.findall(r">([^<]+)</text>", keys)
    # 128 bins of a long run: a label per group of cells, naming its positions, covering them all
    from llmtrace.report.page import heatmap_axes

    d = {"attention": {"bins": [[2 * i, 2 * i + 2] for i in range(128)]}, "tokens": []}
    labels = [m["text"] for m in heatmap_axes(d)["marks"]]
    assert labels[0] == "0–7" and labels[1] == "8–15" and labels[-1] == "248–255" and len(labels) == 32


def test_explain_page_in_the_browser_labels_the_heatmap_beside_its_cells(browser, smollm, tmp_path):
    page, ids = explain_page(smollm)
    path = tmp_path / "explain.html"
    path.write_text(page, encoding="utf-8")
    o = Opened(browser, path)
    canvas = o.page.locator("#att-canvas").bounding_box()
    labels = o.page.locator(".att-queries text")
    assert labels.count() == len(ids) and o.page.locator("#att-canvas").get_attribute("data-rows") == str(len(ids))
    for i in range(len(ids)):  # each query label sits level with its row of cells, left of the canvas
        box = labels.nth(i).bounding_box()
        row_mid = canvas["y"] + (i + 0.5) * canvas["height"] / len(ids)
        assert abs(box["y"] + box["height"] / 2 - row_mid) < canvas["height"] / len(ids) / 2
        assert box["x"] + box["width"] <= canvas["x"] + 1
    assert o.messages == [] and o.requests == [o.url]
    o.page.close()


HOSTILE = "</script><script>document.title='pwned'</script><b id=evil>&amp; \"q\"</b>"


def test_trace_text_reaches_the_page_escaped(browser, smollm, tmp_path):
    """A prompt (and the tokens it makes) full of markup is shown as text: in the page's HTML it is escaped, in the
    embedded data it cannot close its script, and in the browser nothing of it runs or becomes an element."""
    from markupsafe import escape

    events = []
    rec = Recorder(TraceOptions(level="steps"), [events.append], run_info={"prompt": HOSTILE})
    generate(smollm, smollm.tokenizer.encode(HOSTILE), Sampler(SamplerConfig(temperature=0), smollm.config.vocab_size),
             2, ignore_eos=True, observer=rec)
    page = build(json.loads(json.dumps(events)), tokenizer=smollm.tokenizer)
    assert "<script>document" not in page and "<b id=evil>" not in page and page.count("</script>") == 3
    assert f"<q>{escape(HOSTILE)}</q>" in page
    assert f" · {escape(HOSTILE[:60])}</title>" in page
    assert embedded(page)["run"]["prompt"] == HOSTILE
    path = tmp_path / "hostile.html"
    path.write_text(page, encoding="utf-8")
    o = Opened(browser, path)
    assert o.page.title().endswith(HOSTILE[:60]) and o.page.locator("#evil").count() == 0
    assert o.page.locator("#run q").first.inner_text() == HOSTILE
    chips = o.page.locator("#chips .piece").all_inner_texts()
    assert "script" in chips and ">" in "".join(chips)  # the prompt's tokens, as text
    assert o.messages == [] and o.requests == [o.url]
    o.page.close()


def test_the_run_tables_layer_ranges_are_said_in_the_pages_language():
    """The RoPE row's layer ranges come from the catalogue: the Chinese page said "layers 0–29" in English."""
    from llmtrace.report.i18n import Words
    from llmtrace.report.page import layer_ranges

    assert layer_ranges([0, 1, 2, 4], Words("en")) == "layers 0–2, 4"
    assert layer_ranges([3], Words("en")) == "layer 3"
    assert layer_ranges(list(range(30)), Words("zh")) == "第 0–29 层"
