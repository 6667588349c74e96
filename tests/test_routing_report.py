"""The router ledger in the HTML pages (report/page.py section_routing, report/data.py _routing): a tokens × layers
grid coloured by each token's most weighted expert, its title the K experts and weights, and each layer's load; and
explain's page the router table. On the tiny Qwen3-MoE of tests/families.py."""

from __future__ import annotations

import re
from html import unescape

import pytest

import llmtrace
from helpers import Opened

TEXT = "The quick brown fox"


@pytest.fixture(scope="module")
def moe(families):
    return llmtrace.load(str(families.hf_dir("qwen3_moe")), device="cpu", threads=1)


@pytest.fixture(scope="module")
def traced(moe):
    return moe.generate(TEXT, max_new_tokens=3, trace="layers", temperature=0)


def section(page: str, sid: str) -> str:
    return page.split(f'id="{sid}"')[1].split("</section>")[0]


def test_the_grid_is_each_tokens_most_weighted_expert_at_each_layer(traced):
    grid = section(traced.html(), "routing")
    cells = re.findall(r'<td style="background:[^"]+" title="layer (\d+) · position (\d+) [^·]+· ([^"]+)">(\d+)</td>',
                       grid)
    events = [e for e in traced.events if e["event"] == "routing"]
    expected = {}
    for e in events:
        for p, experts, weights in zip(e["positions"], e["experts"], e["weights"]):
            expected[(e["layer"], p)] = (experts, weights)
    assert len(cells) == len(expected) == 2 * (len(traced.events[1]["tokens"]) + 2)
    for layer, p, title, top in cells:
        experts, weights = expected[(int(layer), int(p))]
        assert int(top) == experts[weights.index(max(weights))]
        assert unescape(title) == ", ".join(f"e{x} {w:.3g}" for x, w in zip(experts, weights))


def test_each_layers_load_is_a_bar_per_expert(traced):
    loads = section(traced.html(), "routing").split('class="loads"')[1]
    bars = re.findall(r'<span style="height:([\d.]+)%;[^"]*" title="layer (\d+) · e(\d+): (\d+) of (\d+) tokens"',
                      loads)
    assert len(bars) == 2 * 8
    summary = {r["layer"]: r for r in traced.events[-1]["routing"]}
    for height, layer, e, n, tokens in bars:
        r = summary[int(layer)]
        assert int(n) == r["load"][int(e)] and int(tokens) == r["tokens"]
        assert float(height) == pytest.approx(100 * int(n) / max(r["load"]), abs=0.06)
    assert f"max/mean {summary[0]['imbalance']:.3g}" in unescape(loads)


def test_without_the_ledger_the_section_names_the_flags(moe):
    from html import unescape

    page = moe.generate(TEXT, max_new_tokens=1, trace="steps").html()  # made from Python: it names the keywords
    assert "`trace='layers'` or `trace='full'`" in unescape(section(page, "routing"))


def test_a_dense_model_has_no_routing_section(families):
    page = llmtrace.load(str(families.hf_dir("qwen3")), device="cpu").generate(TEXT, max_new_tokens=1,
                                                                                   trace="layers").html()
    assert 'id="routing"' not in page


def test_explains_page_has_the_router_table(moe):
    run = moe.explain(TEXT, layer=0)
    router = next(e for e in run.events if e.get("section") == "router")
    page = section(run.html(), "explain")
    assert "the router: each token runs 2 of 8 experts" in page
    text = unescape(re.sub(r"<[^>]+>", " ", page))
    weights = " ".join(f"e{x} {w:.2f}".replace(" 0.", " .") for x, w in zip(router["tokens"][3]["experts"],
                                                                          router["tokens"][3]["weights"]))
    assert weights in " ".join(text.split())


def test_the_page_opens_without_errors(browser, traced, tmp_path):
    path = tmp_path / "r.html"
    path.write_text(traced.html(), encoding="utf-8")
    o = Opened(browser, path)
    assert [m for m in o.messages if m[0] in ("error", "pageerror")] == []
    cell = o.page.locator("#routing .routing-grid td").first
    assert cell.get_attribute("title").startswith("layer 0 · position 0")
    assert o.page.locator("#routing .load .bars span").count() == 16
