"""The HTML pages on a tiny random model (quick: no real checkpoint), in the page's HTML and in Chromium: a padded
batch row drawn by slot, the small defects of the report, compare and patch pages, and the learner's parts of the
report (the walk-through, live sampling, named axes, the page in Chinese)."""

from __future__ import annotations

import json
import re
from html import unescape
from pathlib import Path

import pytest

from test_report import Opened, browser, embedded  # noqa: F401  (browser: the shared Chromium fixture)

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
