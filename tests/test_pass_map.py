"""The map of the pass (issue 40 item 3) and the words of the declaration on the page (issue 39): drawn from the
model's maths, not from Llama's shape."""

import pytest

from helpers import Opened, embedded


@pytest.fixture(scope="module")
def gemma3_page(loaded, tmp_path_factory):
    from llmtrace.api import Model

    lm = Model(loaded("gemma3", "hf"))
    trace = lm.generate("hello there world, a long prompt", max_new_tokens=2, trace="full", layers="0,-1", for_report=True, ignore_eos=True)
    return trace.report(tmp_path_factory.mktemp("map") / "gemma3.html")


def test_the_map_has_a_block_for_every_declared_point_and_opens_its_card(browser, gemma3_page):
    o = Opened(browser, gemma3_page)
    data = embedded(o.page.content())
    ops = data["maths"]["record"]["kinds"][data["maths"]["record"]["layer_kind"][0]]["ops"]
    blocks = o.page.eval_on_selector_all("#passmap .mapblock", "bs => bs.map(b => [b.dataset.point, b.dataset.op])")
    layer_blocks = {p: op for p, op in blocks if p in ops}
    traced = {p["name"] for p in data["points"] if p["layer"] and p.get("traced", True)}
    assert layer_blocks == {p: ops[p]["op"] for p in traced if p in ops}  # every declared step, its own operation
    assert ["embed_scaled", "scale"] in blocks and ["final_norm", "rmsnorm"] in blocks
    assert "a window of 4 keys" in o.page.inner_text("#passmap")  # layer 0 of Gemma 3 is a sliding-window layer
    o.page.click('#passmap .mapblock[data-point="q_rope"]')  # s6.3, then its worked card in place
    card = o.page.eval_on_selector("#map-card .card", "c => [c.dataset.op, Number(c.dataset.maxRel), c.dataset.point]")
    assert card[0] == "rope" and card[2] == "q_rope" and card[1] < 1e-4  # the tolerance, relative
    assert "10,000^(−2i/16)" in o.page.inner_text("#map-card")  # layer 0's own base (the global layers use 1e6)
    o.page.press('#passmap .mapblock[data-point="q_rope"]', "Enter")  # the keyboard closes it again
    assert o.page.inner_text("#map-card") == ""
    o.page.select_option("#walk-layer", "5")  # the global layer: no window, its own base
    assert "a window" not in o.page.inner_text("#passmap")
    o.page.click('#passmap .mapblock[data-point="q_rope"]')
    assert "1,000,000^(−2i/16)" in o.page.inner_text("#map-card")
    o.page.close()


def test_the_run_table_gives_each_layers_rope_and_the_declared_glu(gemma3_page):
    page = gemma3_page.read_text(encoding="utf-8")
    assert "base θ = 10,000; a window of 4 in layers 0–4" in page and "base θ = 1,000,000 in layer 5" in page
    assert "feed-forward (GeGLU) + residual" in page and "SwiGLU" not in page
    assert "what it changes from Llama" in page
