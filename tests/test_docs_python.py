"""Every Python block of the documentation runs as written (issue 52 item 8), as tests/test_docs.py parses every
`llmtrace …` line.

The blocks of one page run in order in one namespace (a page's later blocks use what its earlier ones made: the
model, the prompt), in a temporary directory, on the default model the pages name (SmolLM2-135M, from the tests'
cache). A page whose block reads a file that the page's own shell lines make (eval.md's `json.txt`, api.md's two saved
runs for `diff`, research-api.md's captured `acts`) gets that file made the way the page makes it, before its blocks
run.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line, code) of each ```python block of a Markdown file, in order."""
    out, lang, start, lines = [], None, 0, []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line.strip())
        if lang is None and m and m[1]:
            lang, start, lines = m[1], n + 1, []
        elif lang is not None and line.strip() == "```":
            if lang in ("python", "py"):
                out.append((start, "\n".join(lines)))
            lang = None
        elif lang is not None:
            lines.append(line)
    return out


PAGES = [p for p in DOC_FILES if python_blocks(p)]


def made_by_the_page(page: str, where: Path) -> None:
    """The files a page's blocks read that its own shell lines make."""
    if page == "eval.md":  # `python3 -m pydoc json > json.txt`
        text = subprocess.run([sys.executable, "-m", "pydoc", "json"], capture_output=True, text=True, check=True)
        (where / "json.txt").write_text(text.stdout, encoding="utf-8")
    if page == "api.md":  # two saved runs of one prompt, as `llmtrace diff` compares a CPU's and a GPU's
        import llmtrace

        for name, dtype in (("cpu.json", "float32"), ("gpu.json", "bfloat16")):
            model = llmtrace.load("smollm2-135m-instruct", device="cpu", dtype=dtype)
            model.generate("The capital of France is", max_new_tokens=4, temperature=0).save(str(where / name))
    if page == "research-api.md":  # `llmtrace capture wiki.raw … --points 6.resid_post,6.attn_out --ctx 128 -o acts`
        import llmtrace

        text = subprocess.run([sys.executable, "-m", "pydoc", "json"], capture_output=True, text=True, check=True)
        model = llmtrace.load("smollm2-135m-instruct", device="cpu")
        llmtrace.capture_corpus(model, text.stdout, "6.resid_post,6.attn_out", 128, where / "acts", chunks=2)


def test_the_pages_have_python_blocks_and_the_parser_finds_them():
    names = {p.name for p in PAGES}
    assert {"research-api.md", "api.md"} <= names
    blocks = python_blocks(ROOT / "docs" / "research-api.md")
    assert blocks[0][1].startswith("import llmtrace") and len(blocks) >= 8


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_of_a_page_runs(page, smollm_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    made_by_the_page(page.name, tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for line, code in python_blocks(page):
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
        except Exception as e:  # the block and its line, not only the traceback into llmtrace
            raise AssertionError(f"the block at {page.name}:{line} failed: {type(e).__name__}: {e}") from e
