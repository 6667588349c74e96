"""The HTML comparison page (compare --html): drawn from the result's JSON, opened in headless chromium as
tests/test_report.py does: no network, no errors, the heat strip marks the first divergence, the KLD bars mark the
positions whose top-1 differs, and choosing a point shows its error per position."""

import json

import pytest

from helpers import SPEC, Opened, perturbed_copy, run_cli, save_hf
from tiny import make_hf_model

PROMPT = "The quick brown fox <script>alert(1)</script> jumps & runs"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("page")
    a = save_hf(root / "a", make_hf_model(SPEC))
    b = save_hf(root / "b", perturbed_copy(1, "mlp.gate_proj.weight", amount=4.0))
    return root, a, b


@pytest.fixture(scope="module")
def compared(made):
    from llmtrace import compare

    root, a, b = made
    result = compare(str(a), str(b), PROMPT, max_new_tokens=4)
    path = root / "compare.html"
    result.report(path)
    return result.to_json(), path


def test_page_is_self_contained_and_escaped(compared):
    doc, path = compared
    html = path.read_text()
    assert "<script>alert(1)</script>" not in html  # the prompt's text is escaped wherever it appears
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    assert json.loads(html.split('<script type="application/json" id="compare-data">')[1].split("</script>")[0])


def test_page_in_a_browser(browser, compared):  # noqa: F811
    doc, path = compared
    o = Opened(browser, path)
    pg = o.page
    try:
        assert o.messages == [] and o.requests == [o.url]
        n_points = len(doc["layers"][0]["points"])
        assert pg.locator("#heat-svg rect.cell").count() == len(doc["layers"]) * n_points
        fd = doc["first_divergence"]
        assert (fd["layer"], fd["point"]) == (1, "gate")
        # the outline sits on the first divergence's cell
        mark = pg.eval_on_selector("#heat-svg rect.first", "r => [r.x.baseVal.value, r.y.baseVal.value]")
        cell = pg.eval_on_selector(f'#heat-svg rect.cell[data-key="1/gate"]', "r => [r.x.baseVal.value, r.y.baseVal.value]")
        assert mark == [cell[0] - 1, cell[1] - 1]
        # the chosen point starts as the first divergence: one bar per position
        assert pg.eval_on_selector("#point-svg", "s => s.dataset.key") == "1/gate"
        assert pg.eval_on_selector("#point-svg", "s => s.dataset.bars") == str(len(doc["positions"]))
        pg.click('#heat-svg rect.cell[data-key="2/resid_post"]')
        assert pg.eval_on_selector("#point-svg", "s => s.dataset.key") == "2/resid_post"
        assert pg.inner_text("#point-label") == "layer 2, resid_post"
        # KLD: one bar per position, the ones whose top-1 differs in red
        assert pg.locator("#kld-svg rect.bar").count() == len(doc["positions"])
        differs = sum(p["same_top"] is False for p in doc["positions"])
        assert pg.locator("#kld-svg rect.bar.differs").count() == differs
        # accumulated and added per layer: one dot per layer on each line (added is 0 in layer 0: on the floor)
        assert pg.locator("#layers circle.acc").count() == len(doc["layers"])
        assert pg.locator("#layers circle.add").count() == len(doc["layers"])
        assert [m for m in o.messages if m[0] in ("error", "pageerror")] == []
    finally:
        pg.close()


def test_html_option_of_compare_and_diff(made, tmp_path, capsys):
    _, a, b = made
    page = tmp_path / "c.html"
    code, _, err = run_cli(capsys, "compare", "Hello world", "-m", a, "-m", b, "--html", page)
    assert code == 0, err
    assert "wrote" in err and page.read_text().startswith("<!doctype html>")
    fails_html = run_cli(capsys, "compare", "Hi", "-m", a, "-m", b, "--html", "-")
    assert fails_html[0] == 2
