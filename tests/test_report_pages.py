"""The HTML pages on a tiny random model (quick: no real checkpoint), in the page's HTML and in Chromium: a padded
batch row drawn by slot, the small defects of the report, compare and patch pages, and the learner's parts of the
report (the walk-through, live sampling, named axes, the page in Chinese)."""

from __future__ import annotations

import json
import math
import re
from html import unescape
from pathlib import Path

import pytest

from helpers import Opened, embedded

TEXTS = ["The quick brown fox jumps", "Hi"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from tiny import TinySpec, write_hf_dir

    path = tmp_path_factory.mktemp("tiny") / "hf"
    write_hf_dir(path, TinySpec())
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    import llmtrace

    return llmtrace.load(str(tiny_dir), threads=1)


@pytest.fixture(scope="module")
def batch_trace(tiny):
    return tiny.generate(TEXTS, max_new_tokens=4, trace="full", layers="0,-1", for_report=True, ignore_eos=True)


def errors(o: Opened) -> list:
    """The page's errors (reading canvas pixels back in a test makes Chromium warn about readback speed)."""
    return [m for m in o.messages if m[0] in ("error", "pageerror")]


def section(page: str, sid: str) -> str:
    return page.split(f'id="{sid}"')[1].split("</section>")[0]


# ----------------------------------------------------------------------------------------------------------------
# issue 30 item 4: a padded batch row is drawn by slot


def test_a_padded_rows_heatmap_is_labelled_by_slot(batch_trace, tmp_path):
    page = batch_trace.report(tmp_path / "r1.html", row=1).read_text(encoding="utf-8")
    d = embedded(page)
    batch = next(e for e in batch_trace.events if e["event"] == "batch")
    pad = batch["attention_mask"][1].index(1)
    assert pad > 0 and d["attention"]["pad"] == pad
    keys = [unescape(t) for t in re.findall(r">([^<]+)</text>", section(page, "attention").split('class="att-keys"')[1]
                                            .split("</svg>")[0])]
    n = d["attention"]["n"]
    assert keys[:pad] == [f"{s} pad" for s in range(pad)]
    assert keys[pad:pad + 2] == [f"{pad} H", f"{pad + 1} i"]  # "Hi" where its slots are, not at slots 0 and 1
    assert len(keys) == n and all(not k.endswith(" ") for k in keys)  # every slot labelled, generated ones too


def test_a_padded_row_in_the_browser_hatches_pads_and_outlines_the_right_query(browser, batch_trace, tmp_path):
    path = batch_trace.report(tmp_path / "r1.html", row=1)
    o = Opened(browser, path)
    pg = o.page
    d = pg.evaluate("JSON.parse(document.getElementById('data').textContent)")
    pad, n = d["attention"]["pad"], d["attention"]["n"]
    pg.select_option("#att-scale", "linear")
    cell = int(pg.eval_on_selector("#att-canvas", "c => c.dataset.cell"))
    pixel = ("([x, y]) => Array.from(document.getElementById('att-canvas').getContext('2d')"
             ".getImageData(x, y, 1, 1).data.slice(0, 3))")

    def at(r, c):
        return pg.evaluate(pixel, [c * cell + cell // 2, r * cell + cell // 2])

    grey = lambda px: px[0] == px[1] == px[2] and px[0] >= 200  # noqa: E731
    # the pad query of slot 0 attends its own pad slot in the trace (p = 1), but it is padding: hatched
    assert grey(at(0, 0)) and grey(at(pad + 1, 0)) and grey(at(n - 1, pad - 1))
    assert not grey(at(pad, pad)) and not grey(at(n - 1, pad))  # the row's first token, seen by the last query
    # step 0's query is the last prompt token, slot pad + 1: the red outline sits on that row
    top = pg.evaluate(pixel, [cell * (pad + 1) + cell // 2, (pad + 1) * cell])
    assert top == [214, 39, 40]
    pg.hover("#att-canvas", position={"x": pad * cell + 2, "y": (pad + 1) * cell + 2})
    readout = pg.inner_text("#att-readout")
    assert f"slot {pad + 1}, position 1 (i)" in readout and f"key slot {pad}, position 0 (H)" in readout
    pg.hover("#att-canvas", position={"x": 2, "y": (pad + 1) * cell + 2})
    assert "masked (a pad slot)" in pg.inner_text("#att-readout")
    assert errors(o) == [] and o.requests == [o.url]
    o.page.close()


# ----------------------------------------------------------------------------------------------------------------
# issue 30 item 19: the small defects of the pages


@pytest.fixture(scope="module")
def patch_event(tiny):
    import llmtrace
    from llmtrace.trace.records import model_record

    ev = llmtrace.patch_sweep(tiny, clean="The quick brown fox", corrupt="The quick lazy dog", answer=" b",
                              against="The")
    return ev | {"model": model_record(tiny.loaded)}


def test_patch_page_labels_its_legend_rows_and_axes(browser, patch_event, tmp_path):
    from llmtrace.report.patch import patch_page, two_places

    assert two_places(-0.001) == "0.00" and two_places(-0.006) == "-0.01" and two_places(0.25) == "0.25"
    assert any(-0.005 < c["recovery"] < 0 for c in patch_event["cells"])  # the case that printed "-0.00"
    page = patch_page(patch_event)
    assert "-0.00" not in page
    assert "Ġ" not in page  # the space marks as in the terminal (the header's ▁ below), not the vocabulary's
    path = tmp_path / "patch.html"
    path.write_text(page, encoding="utf-8")
    o = Opened(browser, path)
    legend = o.page.inner_text("p.legend")
    assert legend.startswith("recovery: 0.00 0.25 0.50 0.75 1.00"), legend
    heads = o.page.locator("table tr").nth(0).locator("th").all_inner_texts()
    assert heads[0] == "corrupt" and heads[1:3] == ["The", "▁"]
    assert o.page.locator("table tr").nth(1).locator("th").first.inner_text().startswith("clean")
    assert "layer" in o.page.inner_text("caption") and "position" in o.page.inner_text("caption")
    assert errors(o) == [] and o.requests == [o.url]
    o.page.close()


@pytest.fixture(scope="module")
def compare_page(tiny, tiny_dir, tmp_path_factory):
    import llmtrace

    cmp = llmtrace.compare(tiny, llmtrace.Side(model=str(tiny_dir), dtype="bfloat16"), "The quick brown fox")
    path = tmp_path_factory.mktemp("cmp") / "compare.html"
    cmp.report(path)
    return path


def test_compare_page_axes_ticks_and_no_added_bar_for_the_embedding(browser, compare_page):
    o = Opened(browser, compare_page)
    pg = o.page
    box = pg.locator("#layers svg").bounding_box()
    label = pg.locator("#layers svg text", has_text="layer").last.bounding_box()
    assert label["y"] + label["height"] <= box["y"] + box["height"]  # the x axis title is not cut
    assert len(pg.locator("#kld-svg text.ytick").all_text_contents()) >= 2
    pg.click("rect.cell[data-key='model/embed']")
    ticks = pg.locator("#point-svg text.ytick").all_text_contents()
    assert ticks[:5] == ["1e-9", "1e-7", "1e-5", "1e-3", "1e-1"]
    data = pg.evaluate("JSON.parse(document.getElementById('compare-data').textContent)")
    top = max(v for p in data["points"].values() for v in p["rel"] if v is not None)
    assert float(ticks[-1]) >= top and float(ticks[-1]) < 10 * max(top, 0.1)  # the axis reaches the largest error
    assert pg.locator("#point-svg rect.bar.added").count() == 0  # the embedding has no layer to add anything
    pg.click("rect.cell[data-key='0/resid_post']")
    assert pg.locator("#point-svg rect.bar.added").count() > 0  # a layer's point has its added error
    assert errors(o) == [] and o.requests == [o.url]
    o.page.close()


def test_the_draw_bar_shows_the_chosen_slice_and_its_end_labels(browser, tiny, tmp_path):
    run = tiny.generate("The quick brown fox", max_new_tokens=3, temperature=0.9, seed=2, ignore_eos=True)
    steps = [e for e in run.events if e["event"] == "step"]
    for s in steps:  # the trace says where the draw landed: u inside the chosen token's slice
        lo, hi = s["rng"]["slice"]
        assert lo <= s["rng"]["draw"] < hi + 1e-6 and abs(hi - lo - s["sampler"][-1]["pick_prob"]) < 1e-5
    o = Opened(browser, run.report(tmp_path / "r.html"))
    svg = o.page.locator(".step-panel:not([hidden]) svg.draw")
    box = svg.bounding_box()
    for t in svg.locator("text").all():
        b = t.bounding_box()
        assert box["x"] <= b["x"] and b["x"] + b["width"] <= box["x"] + box["width"] + 0.5
        assert box["y"] <= b["y"] and b["y"] + b["height"] <= box["y"] + box["height"] + 0.5
    sl, u = svg.locator("rect.slice").bounding_box(), svg.locator("line.u").bounding_box()
    assert sl["x"] - 1.5 <= u["x"] + u["width"] / 2 <= sl["x"] + sl["width"] + 1.5
    assert errors(o) == [] and o.requests == [o.url]
    o.page.close()


def test_kv_chart_has_round_ticks_and_the_layers_are_numbered(tiny):
    from llmtrace.report.page import nice_step

    assert nice_step(3.32 * 2**20 * 1.05, base=1024) == 1 * 2**20 and nice_step(1000) == 250
    assert nice_step(4.0) == 1 and nice_step(4.4) == 2 and nice_step(0.07) == 0.02
    run = tiny.generate("The quick brown fox", max_new_tokens=3, ignore_eos=True)
    from llmtrace.report.write import build

    page = build(run.events)
    kv = section(page, "kv")
    ticks = re.findall(r'text-anchor="end" class="cap">([^<]+)</text>', kv)
    round_tick = r"\d+(\.0+)? (B|KiB|MiB)|\d+\.\d*[05]0* KiB"
    assert ticks[0] == "0 B" and all(re.fullmatch(round_tick, t) for t in ticks), ticks
    assert re.findall(r'<span class="kvn">(\d+)</span>', kv) == ["0", "1"]  # the tiny model's two layers


# ----------------------------------------------------------------------------------------------------------------
# issue 30 item 18: the merge story's note for a model loaded from a file


def test_report_of_a_file_models_trace_says_to_give_its_path(tiny, tmp_path):
    """The run event names the model's directory (model.path); where it is no longer there, the page and the
    terminal say to give it with -m PATH."""
    import subprocess
    import sys

    run = tiny.generate("The quick brown fox", max_new_tokens=2, ignore_eos=True)
    import json

    head = next(e for e in run.events if e["event"] == "run")
    assert head["model"]["path"] == str(tiny.loaded.path.resolve())
    trace = tmp_path / "t.json"
    run.save(trace)
    doc = json.loads(trace.read_text())
    next(e for e in doc["events"] if e["event"] == "run")["model"]["path"] = str(tmp_path / "gone")  # moved since
    trace.write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "-m", "llmtrace", "report", str(trace), "-o", str(tmp_path / "r.html")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "the trace names its model 'hf'" in r.stderr and "-m PATH" in r.stderr  # said in the terminal
    tokens = unescape(section((tmp_path / "r.html").read_text(encoding="utf-8"), "tokens"))
    assert "-m PATH" in tokens and "unknown model" not in tokens


def test_a_page_made_with_the_tokenizer_never_says_it_lacks_it(tiny, tmp_path):
    page = tiny.lens("The quick brown fox").report(tmp_path / "lens.html").read_text(encoding="utf-8")
    assert embedded(page)["merges"]["note"] is None and embedded(page)["merges"]["words"]
    assert "needs the model" not in page and "made without it" not in page


# ----------------------------------------------------------------------------------------------------------------
# issue 34: what the trace records for the learner's page


def test_trace_full_samples_every_float_point_and_the_logits(tiny):
    import torch

    from llmtrace.trace.packed import unpack

    run = tiny.generate("The quick brown fox", max_new_tokens=2, trace="full", ignore_eos=True)
    tensors = [e for e in run.events if e["event"] == "tensor"]
    sampled = [e for e in tensors if "sample" in e]
    assert len(sampled) >= 0.85 * len(tensors)
    prompt = next(e for e in run.events if e["event"] == "tokens")["tokens"]
    embed = next(e for e in sampled if e["step"] == 0 and e["layer"] is None and e["sample"].get("norms")
                 and len(e["shape"]) == 2 and e["shape"][1] == tiny.loaded.config.d_model
                 and e["seed_step"] == "s4")
    W = tiny.loaded.model.embed.weight.detach().double()
    s = embed["sample"]
    assert s["index"] == list(range(8)) + list(range(32, 40))  # D = 64: the first 8 of each half
    values, norms = unpack(s["values"], len(s["index"])), unpack(s["norms"])  # packed float32 (trace.packed)
    assert values.shape == (len(prompt), 16) and norms.shape == (len(prompt),)
    for t, tok in enumerate(prompt):  # every token's row: the embedding's own values, exactly, and the row's norm
        torch.testing.assert_close(torch.from_numpy(values[t]), W[tok["id"], s["index"]], rtol=0, atol=0)
        assert abs(norms[t] - float(W[tok["id"]].norm())) < 1e-6 * norms[t]
    # a tensor of one row (every decode step's hidden state) has no norms in its sample: its statistics hold its norm
    one_row = [e for e in sampled if e["step"] > 0 and e["name"] == "embed"]
    assert one_row and all("norms" not in e["sample"] and len(unpack(e["sample"]["values"])) == 16 for e in one_row)
    assert all("norms" in e["sample"] for e in sampled if math.prod(e["shape"][:-1]) > 1)
    step = next(e for e in run.events if e["event"] == "step")
    assert len(step["logits"]["ids"]) == tiny.loaded.config.vocab_size and step["logits"]["tail"] is None
    assert step["logits"]["ids"][0] == step["topk"][0]["id"] and step["logits"]["values"][0] == step["topk"][0]["logit"]
    for e in run.events:  # the schema declares them
        from helpers import undeclared_fields

        assert undeclared_fields([e]) == []


def test_the_logits_tail_gives_the_softmax_at_any_temperature():
    import torch

    from llmtrace.trace.recorder import logits_record

    z = torch.randn(49152, generator=torch.Generator().manual_seed(0)) * 2.5
    z[7] = float("-inf")  # a banned token is not in the tail
    r = logits_record(z, 1000)
    assert len(r["ids"]) == 1000 and sum(r["tail"]["counts"]) == 49152 - 1001
    for T in (0.3, 0.8, 1.0, 2.0, 5.0):
        exact = torch.softmax(z.double() / T, dim=0)
        top = torch.tensor(r["values"], dtype=torch.float64) / T
        tail = torch.tensor(r["tail"]["counts"], dtype=torch.float64) * torch.exp(
            torch.tensor(r["tail"]["means"], dtype=torch.float64) / T - top[0])
        p0 = 1 / (torch.exp(top - top[0]).sum() + tail.sum())
        assert abs(float(p0) - float(exact.max())) < 1e-3 * float(exact.max()), T


# ----------------------------------------------------------------------------------------------------------------
# issue 34: the learner's page in the browser


@pytest.fixture(scope="module")
def sampled_run(tiny):
    """A sampled run at --trace full (the what-if sampler and the walk-through have what they need)."""
    return tiny.generate("The quick brown fox", max_new_tokens=4, temperature=0.8, top_k=40, top_p=0.9, seed=3,
                         trace="full", ignore_eos=True, for_report=True)


def set_range(pg, selector: str, value) -> None:
    pg.eval_on_selector(selector, "(e, v) => { e.value = String(v); e.dispatchEvent(new Event('input')); }", value)


def test_the_temperature_slider_redraws_softmax_of_the_logits_over_t(browser, tiny, sampled_run, tmp_path):
    import torch

    o = Opened(browser, sampled_run.report(tmp_path / "r.html"))
    pg = o.page
    assert pg.get_by_role("slider", name="temperature").count() == 1  # accessible names: the labels
    assert pg.get_by_role("slider", name="top-p").count() == 1 and pg.get_by_role("slider", name="min-p").count() == 1
    ids = next(e for e in sampled_run.events if e["event"] == "tokens")["tokens"]
    with torch.no_grad():
        z = tiny.loaded.model(torch.tensor([[t["id"] for t in ids]]))[0, -1].double()  # step 0's logits
    set_range(pg, "#wi-top-k", 0)
    set_range(pg, "#wi-top-p", 1)
    set_range(pg, "#wi-min-p", 0)
    set_range(pg, "#wi-temperature", 2)
    shown = float(pg.inner_text("#whatif-top1").split("p = ")[1])
    assert abs(shown - float(torch.softmax(z / 2, 0).max())) < 1e-5
    assert "320 candidates survive" in pg.inner_text("#whatif-summary")
    set_range(pg, "#wi-temperature", 0.5)
    assert abs(float(pg.inner_text("#whatif-top1").split("p = ")[1]) - float(torch.softmax(z / 0.5, 0).max())) < 1e-5
    assert errors(o) == [] and o.requests == [o.url]
    o.page.close()


def test_at_the_runs_settings_the_what_if_draw_lands_on_the_runs_token(browser, sampled_run, tmp_path):
    """The page's sampler, on the stored logits with the run's settings and its draw u, picks what the run picked
    at every step: the same stages, in the run's order."""
    o = Opened(browser, sampled_run.report(tmp_path / "r.html"))
    pg = o.page
    steps = [e for e in sampled_run.events if e["event"] == "step"]
    for i, s in enumerate(steps):
        pg.eval_on_selector("#step", "(e, v) => { e.value = String(v); e.dispatchEvent(new Event('input')); }", i)
        landed = pg.eval_on_selector("svg.whatif-draw", "s => s.dataset.landed")
        assert int(landed) == s["token"]["id"], i
        survivors = int(pg.inner_text("#whatif-summary").split(" candidates")[0].replace(",", ""))
        assert survivors == s["sampler"][-1]["survivors"], i
        assert pg.locator("table.whatif-bars tr.chosen").count() == (1 if any(c["id"] == s["token"]["id"]
                                                                          for c in s["topk"]) else 0)
    assert errors(o) == [] and o.requests == [o.url]
    o.page.close()


def test_the_page_in_chinese_uses_the_seeds_terms(tiny, sampled_run, tmp_path):
    import json as _json

    from llmtrace.report.i18n import _load

    en, zh = _load("en"), _load("zh")
    assert set(zh) == set(en)  # every word of the page has its Chinese
    for k in en:  # with the same values filled in
        assert set(re.findall(r"\{(\w+)\}", en[k])) == set(re.findall(r"\{(\w+)\}", zh[k])), k
    page = sampled_run.html(lang="zh")
    assert '<html lang="zh-Hans">' in page
    heads = re.findall(r'<h2 id="[^"]+">([^<]+)</h2>', page)
    for term in ("词元", "注意力", "KV 缓存", "残差", "采样"):
        assert any(term in h for h in heads), term
    pipeline = unescape(section(page, "pipeline"))
    for term in ("分词", "嵌入", "旋转位置编码", "前馈网络", "归一化"):
        assert term in pipeline, term
    assert "温度" in section(page, "whatif") and embedded(page)["words"]["whatif_source_all"].startswith("由")
    shown = page.split('<script type="application/json"')[0]  # the page before its data and script
    assert "The run" not in shown and "Each step" not in shown and "What if" not in shown
    trace = tmp_path / "t.json"
    sampled_run.save(trace)
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "llmtrace", "report", str(trace), "-o", str(tmp_path / "zh.html"),
                        "--lang", "zh", "--no-merges"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "温度" in (tmp_path / "zh.html").read_text(encoding="utf-8"), r.stderr
    r = subprocess.run([sys.executable, "-m", "llmtrace", "report", str(trace), "-o", str(tmp_path / "fr.html"),
                        "--lang", "fr"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--lang" in r.stderr and not (tmp_path / "fr.html").exists()
    del _json


def test_lens_cells_show_the_token_and_its_probability(browser, tiny, tmp_path):
    lens = tiny.lens("The quick brown fox")
    o = Opened(browser, lens.report(tmp_path / "lens.html"))
    cells = o.page.locator("table.lens td[data-row]")
    first = [e for e in lens.events if e["event"] == "lens"][0]
    cell = o.page.locator(f"table.lens td[data-pos='{first['position']}']").first
    text = cell.inner_text()
    assert cells.count() > 0 and f"{first['topk'][0]['prob']:.2f}" in text or "e-" in text
    assert all(len(c.split("\n")) == 2 for c in cells.all_inner_texts())  # the token, then its probability
    assert errors(o) == [] and o.requests == [o.url]
    o.page.close()


def test_the_residual_chart_has_a_place_per_recorded_layer_and_a_gap_between(tmp_path):
    import llmtrace
    from tiny import TinySpec, write_hf_dir

    write_hf_dir(tmp_path / "m4", TinySpec(n_layers=5))
    run = llmtrace.load(str(tmp_path / "m4"), threads=1).generate("The quick brown fox", max_new_tokens=2,
                                                                   trace="layers", layers="0,1,-1", ignore_eos=True)
    res = section(run.html(), "residual")
    ticks = re.findall(r'text-anchor="middle" class="cap">([^<]+)</text>', res)
    assert ticks[:5] == ["emb", "0", "1", "⋯", "4"], ticks
    for line in re.findall(r'<polyline points="([^"]+)"', res):  # emb-0-1 joined; 4 stands alone
        assert len(line.split()) == 3
    assert "layer 0, layer 1, layer 4" in unescape(res)


def test_the_explain_page_holds_everything_the_terminal_explain_prints(browser, tiny, tmp_path):
    from rich.console import Console

    from llmtrace.render.explain import render_explain

    ex = tiny.explain("The quick brown fox", layer=1)
    console = Console(record=True, width=200, color_system=None)
    render_explain(ex.events, console)
    terminal = console.export_text()
    o = Opened(browser, ex.report(tmp_path / "explain.html"))
    page = o.page.inner_text("#explain")
    numbers = re.findall(r"-?\d[\d,]*\.?\d*(?:e[-+]\d+)?", terminal)
    assert len(numbers) > 200
    missing = [n for n in set(numbers) if n not in page]
    assert missing == []
    for title in re.findall(r"^([①-⑩] s[\d.]+)", terminal, re.M):  # every section, in order
        assert title in page
    assert o.page.locator("#explain table").count() >= 10
    assert "Select a generated token" not in o.page.inner_text("body")  # nothing left over from generate's page
    assert errors(o) == [] and o.requests == [o.url]
    o.page.close()


def declared(events: list[dict]) -> bool:
    """The trace carries the model's point declarations, with axes (the model core's declarations, issue 34)."""
    run = next((e for e in events if e["event"] == "run"), None)
    return bool(run and run.get("points"))


def test_the_walk_through_shows_the_embedding_of_the_last_prompt_token_as_the_gguf_holds_it(browser, tmp_path):
    import llmtrace
    from tiny import TinySpec, make_hf_model, write_gguf

    written = write_gguf(tmp_path / "t.gguf", make_hf_model(TinySpec(seed=4)))
    model = llmtrace.load(str(tmp_path / "t.gguf"), threads=1)
    run = model.generate("The quick brown fox", max_new_tokens=2, trace="full", ignore_eos=True, for_report=True)
    if not declared(run.events):
        pytest.skip("this trace has no point declarations yet (the model core's axes): the walk needs them")
    last = next(e for e in run.events if e["event"] == "tokens")["tokens"][-1]
    table = written["token_embd.weight"][1][last["id"]]  # the row the file holds, dequantized
    o = Opened(browser, run.report(tmp_path / "r.html"))
    pg = o.page
    assert pg.eval_on_selector("#walk-token", "s => s.value") == str(last["index"])  # opens on the last prompt token
    card = pg.locator(".wstep[data-seed='s4'] .wpoint").first
    # per half of the sample a table: its index row, the computed row, the trace's row
    rows = [r.split("\t") for r in card.locator("table tr").all_inner_texts()]
    index = [x for r in rows if r[0].strip() == "i" for x in r[1:]]
    values = [x for r in rows if r[0].strip() == "in the trace" for x in r[1:]]
    got = {int(i): float(v) for i, v in zip(index, values)}
    assert len(got) == 16
    for i, v in got.items():
        assert abs(v - table[i]) <= 1e-4 * max(1.0, abs(table[i])), (i, v, table[i])
    norm = float(re.search(r": (\S+)", card.inner_text()).group(1))  # "norm of the row: 8.2759"
    assert abs(norm - float((table.astype("float64") ** 2).sum() ** 0.5)) < 1e-3
    for sid in ("s6.1", "s6.3", "s6.4", "s6.5", "s6.7", "s8", "s9"):  # the token goes all the way through
        assert pg.locator(f".wstep[data-seed='{sid}'] .wpoint").count() >= 1, sid
    assert errors(o) == [] and o.requests == [o.url]
    o.page.close()


def test_every_shape_has_axes_of_its_length(tiny):
    run = tiny.generate(TEXTS, max_new_tokens=2, trace="full", ignore_eos=True)
    if not declared(run.events):
        pytest.skip("this trace has no point declarations yet (the model core's axes)")
    shapes = [p for e in run.events if e["event"] == "shapes" for p in e["points"]]
    assert shapes and all(len(p.get("axes", [])) == len(p["shape"]) for p in shapes)
    page = run.html()
    assert "[B=2, T=" in section(page, "pipeline") and "Dh=" in section(page, "pipeline")  # a batch: B first


# ----------------------------------------------------------------------------------------------------------------
# issue 52 item 10: a --trace full trace's page says exactly why it has no heatmaps


def test_a_full_traces_page_says_why_it_has_no_heatmaps_while_its_walk_shows_probabilities(tiny, tmp_path):
    """`--trace full --jsonl` then `report`: the walk shows the sampled probabilities, and the attention section says
    that the heatmaps need the whole matrices, which such a trace does not keep (not a bare "attention probabilities",
    which the walk contradicts); the same run for a page (`--html`, for_report) draws them."""
    full = tiny.generate("The quick brown fox", max_new_tokens=2, trace="full", ignore_eos=True)
    page = full.report(tmp_path / "full.html").read_text(encoding="utf-8")
    assert 'id="walk"' in page
    note = " ".join(unescape(section(page, "attention")).split())
    assert "Not in this trace: the whole attention probability matrices the heatmaps draw" in note, note
    assert "keeps a sample of each point, which the walk-through shows" in note
    drawn = tiny.generate("The quick brown fox", max_new_tokens=2, trace="full", ignore_eos=True, for_report=True)
    page = drawn.report(tmp_path / "drawn.html").read_text(encoding="utf-8")
    assert "Not in this trace" not in section(page, "attention") and "heatmaps draw" not in page
