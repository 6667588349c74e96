"""Every file a command writes with --json, --jsonl or --html (and report's -o), opened and read back, on tiny models
so that the quick suite covers them all.

Each command runs once with all of its outputs (module fixture `ran`). Then: each JSON file parses and holds what the
command printed, each JSONL file is one JSON object per line, each HTML file is one whole page that holds the run's own
text and parseable embedded data. `llmtrace show` renders every trace file (generate, explain, lens, compare, diff,
patch; JSON and JSONL) as the command printed it, and `llmtrace report` makes the page their --html writes.
"""

from __future__ import annotations

import contextlib
import io
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from helpers import SPEC, perturbed_copy, save_hf
from tiny import make_hf_model

PROMPT = "The lazy dog"
CORRUPT = "The lazy cat"  # as many tokens as PROMPT in the tiny tokenizer


def run_main(argv: list) -> tuple[int, str, str]:
    """`llmtrace ARGV` in this process, outside any test's capsys: (exit code, stdout, stderr)."""
    from llmtrace.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in argv])
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


# every command with every output it has: (name, argv after the command, its outputs)
def commands(a: Path, b: Path, d: Path) -> dict[str, tuple[list, dict[str, Path]]]:
    out = lambda name, *kinds: {k: d / f"{name}.{k}" for k in kinds}  # noqa: E731
    return {
        "generate": (["generate", PROMPT, "-m", a, "-n", "3", "--trace", "full", "--save-tensors", d / "g.safetensors"],
                     out("generate", "json", "jsonl", "html")),
        "generate_b": (["generate", PROMPT, "-m", b, "-n", "3", "--trace", "full", "--save-tensors",
                        d / "gb.safetensors"], out("generate_b", "json")),
        "explain": (["explain", PROMPT, "-m", a, "--layer", "1"], out("explain", "json", "jsonl", "html")),
        "lens": (["lens", PROMPT, "-m", a], out("lens", "json", "jsonl", "html")),
        "tokenize": (["tokenize", PROMPT, "-m", a], out("tokenize", "json", "jsonl")),
        "detokenize": (["detokenize", "316", "223", "-m", a], out("detokenize", "json", "jsonl")),
        "models": (["models"], out("models", "json", "jsonl")),
        "pull": (["pull", a], out("pull", "json", "jsonl")),
        "compare": (["compare", PROMPT, "-m", a, "-m", b, "-n", "2"], out("compare", "json", "jsonl", "html")),
        "patch": (["patch", "--clean", PROMPT, "--corrupt", CORRUPT, "--answer", "j", "--against", "u", "-m", a],
                  out("patch", "json", "html")),
    }


FLAGS = {"json": "--json", "jsonl": "--jsonl", "html": "--html"}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """{command: (exit code, stdout, stderr, {kind: path})}, each command run once with all its outputs."""
    root = tmp_path_factory.mktemp("outputs")
    a = save_hf(root / "a", make_hf_model(SPEC))
    b = save_hf(root / "b", perturbed_copy(1, "mlp.up_proj.weight"))
    results = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("llmtrace.checkpoint.devices.set_threads", lambda n: None)  # torch's threads stay the suite's
        for name, (argv, outs) in commands(a, b, root).items():
            flags = [x for kind, path in outs.items() for x in (FLAGS[kind], path)]
            results[name] = (*run_main(argv + flags), outs)
        trace_a, trace_b = results["generate"][3]["json"], results["generate_b"][3]["json"]
        outs = {k: root / f"diff.{k}" for k in ("json", "jsonl", "html")}
        results["diff"] = (*run_main(["diff", trace_a, trace_b] + [x for k, p in outs.items() for x in (FLAGS[k], p)]),
                           outs)
        outs = {k: root / f"diff_norms.{k}" for k in ("json", "jsonl", "html")}
        results["diff_norms"] = (*run_main(["diff", trace_a, trace_b, "--no-tensors"]
                                           + [x for k, p in outs.items() for x in (FLAGS[k], p)]), outs)
    for name, (code, _, err, _) in results.items():
        assert code == 0 and "Traceback" not in err, (name, err)
    return results


ALL_OUTPUTS = [(name, kind) for name, (_, outs) in commands(Path(), Path(), Path()).items() for kind in outs] + [
    (name, kind) for name in ("diff", "diff_norms") for kind in ("json", "jsonl", "html")]


class Page(HTMLParser):
    """What a page holds: its text (scripts and styles left out), its script blocks, whether <html> closed."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.scripts, self.closed, self._in = [], [], False, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self._in = (tag, dict(attrs)) if tag in ("script", "style") else None

    def handle_endtag(self, tag):
        self.closed |= tag == "html"
        self._in = None

    def handle_data(self, data):
        if self._in is None:
            self.text.append(data)
        elif self._in[0] == "script":
            self.scripts.append((self._in[1], data))

    @property
    def words(self) -> str:
        return " ".join(" ".join(self.text).split())


def read_output(path: Path, kind: str):
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") or kind == "html"
    if kind == "json":
        return json.loads(text)
    if kind == "jsonl":
        lines = text.splitlines()
        assert lines and all(line.strip() for line in lines)
        return [json.loads(line) for line in lines]
    page = Page(text)
    assert text.lstrip().lower().startswith("<!doctype html>") and page.closed
    for attrs, data in page.scripts:  # the data a page embeds parses
        if attrs.get("type") == "application/json":
            json.loads(data)
    return page


@pytest.mark.parametrize("name, kind", ALL_OUTPUTS, ids=[f"{n}-{k}" for n, k in ALL_OUTPUTS])
def test_every_output_of_every_command_opens(ran, name, kind):
    """The file is there, whole, of its kind, and holds this run's own content."""
    code, stdout, err, outs = ran[name]
    got = read_output(outs[kind], kind)
    if kind == "html":
        assert f"wrote {outs[kind]}" in err
        words = got.words
        if name in ("generate", "explain", "lens"):
            assert PROMPT in words or "The ▁lazy ▁dog" in words or "▁lazy" in words, words[:300]
            assert "None" not in words  # explain's and lens's summary is no generate summary
        elif name == "patch":
            assert CORRUPT in words and "Activation patching at resid_post" in words
        else:  # compare, diff: the page's answer is the terminal's first line
            doc = json.loads(outs["json"].read_text())
            from llmtrace.run.compare import summary_line

            assert summary_line(doc) in words
        return
    events = got if kind == "jsonl" else got.get("events", got) if isinstance(got, dict) else got
    if name in ("generate", "generate_b", "explain", "lens", "patch"):
        assert (got["schema"] if kind == "json" else "llmtrace.trace/1") == "llmtrace.trace/1"
        kinds = [e["event"] for e in events]
        first = {"generate": "run", "generate_b": "run", "explain": "explain", "lens": "explain", "patch": "patch"}
        assert kinds[0] == first[name], kinds[:3]
        if name.startswith("generate"):
            assert kinds[-1] == "summary" and events[-1]["interrupted"] is False
    elif name in ("compare", "diff", "diff_norms"):
        doc = got if kind == "json" else next(e for e in got if e["event"] == "compare")
        assert doc["schema"] == "llmtrace.compare/1" and doc["source"] == name.split("_")[0]
        from llmtrace.run.compare import summary_line

        assert " ".join(stdout.split()).startswith(summary_line(doc))
    elif name in ("tokenize", "detokenize"):
        rows = got["tokens"] if kind == "json" else got
        ids = [r["id"] for r in rows]
        assert ids == ([316, 223] if name == "detokenize" else ids) and ids
        if name == "tokenize":
            assert "".join(r["text"] for r in rows) == PROMPT
    elif name == "models":
        names = [r["name"] for r in (got["models"] if kind == "json" else got)]
        assert "smollm2-135m-instruct" in names
    elif name == "pull":
        path = got["path"] if kind == "json" else str(Path(got[0]["file"]).parent)
        assert Path(path).name == "a" and stdout == f"{path}\n"
        if kind == "jsonl":
            assert {Path(x["file"]).name for x in got} >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_every_output_is_one_llmtrace_may_write_over(ran):
    """A second run over its own outputs is allowed: each file a command writes (and --save-tensors' file) is
    recognised as llmtrace's by its content (cli/outputs.py), which a user's file is not (tests/test_overwrite.py)."""
    from llmtrace.cli.outputs import written_by_llmtrace

    files = [ran[name][3][kind] for name, kind in ALL_OUTPUTS]
    files += sorted(ran["generate"][3]["json"].parent.glob("*.safetensors"))
    assert len(files) == len(ALL_OUTPUTS) + 2
    assert [str(f) for f in files if not written_by_llmtrace(f)] == []


# ----------------------------------------------------------------------------------------------------------------
# show and report read them back


SHOWN = [(name, kind) for name in ("generate", "explain", "lens", "compare", "diff", "diff_norms", "patch")
         for kind in ("json", "jsonl") if (name, kind) != ("patch", "jsonl")]


@pytest.mark.parametrize("name, kind", SHOWN, ids=[f"{n}-{k}" for n, k in SHOWN])
def test_show_renders_each_file_as_its_command_did(ran, name, kind):
    code, stdout, _, outs = ran[name]
    got, shown, err = run_main(["show", outs[kind]])
    assert got == 0 and err == ""
    assert shown == stdout and len(shown.splitlines()) > 3


PAGES = [(name, kind) for name, kind in SHOWN if name not in ("generate", "explain", "lens")]


@pytest.mark.parametrize("name, kind", PAGES, ids=[f"{n}-{k}" for n, k in PAGES])
def test_report_makes_the_page_of_a_saved_comparison_or_sweep(ran, tmp_path, name, kind):
    """`report` of a compare, diff or patch file writes the page their --html wrote (the same bytes)."""
    _, _, _, outs = ran[name]
    page = tmp_path / "page.html"
    code, _, err = run_main(["report", outs[kind], "-o", page])
    assert code == 0, err
    assert page.read_text() == outs["html"].read_text()


def test_report_of_a_comparison_has_one_page(ran, tmp_path):
    from helpers import assert_one_line_error

    code, _, err = run_main(["report", ran["compare"][3]["json"], "-o", tmp_path / "p.html", "--row", "1"])
    assert code == 2
    assert_one_line_error(err, "--row 1 is out of range: a comparison has one page")


@pytest.mark.parametrize("command", ["show", "report"])
def test_show_and_report_refuse_files_llmtrace_did_not_write(ran, tmp_path, command):
    """tokenize's own --json, a bogus event: one line, exit 2, nothing written."""
    from helpers import assert_one_line_error

    bogus = tmp_path / "bogus.jsonl"
    bogus.write_text('{"event": "bogus"}\n')
    text, page, weights = tmp_path / "notamodel.txt", tmp_path / "report.html", tmp_path / "w.safetensors"
    text.write_text("not a model\n")
    page.write_text("<!doctype html>\n<html lang=en><title>a report</title></html>\n")
    weights.write_bytes(b"\x58\x00\x00\x00\x00\x00\x00\x00\xff\xfe" + bytes(range(256)))
    for path, says in ((ran["tokenize"][3]["json"], "valid JSON; not a file llmtrace reads back"),
                       (bogus, 'an event of kind "bogus", which llmtrace does not write'),
                       (text, "line 1 is not valid JSON; not a file llmtrace reads back"),
                       (page, "line 1 is not valid JSON; not a file llmtrace reads back"),
                       (weights, "line 1 is not valid JSON; not a file llmtrace reads back")):
        page = tmp_path / "p.html"
        code, out, err = run_main([command, path] + (["-o", page] if command == "report" else []))
        assert code == 2 and out == "" and not page.exists()
        assert_one_line_error(err, says)


def test_every_output_follows_the_umask(ran):
    """--save-tensors wrote 0o600 (safetensors makes its own file), every other output 0o644: all follow the umask."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    root = ran["generate"][3]["json"].parent
    files = sorted(p for p in root.iterdir() if p.is_file())
    assert {p.suffix for p in files} >= {".safetensors", ".json", ".jsonl", ".html"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(0o666 & ~mask) for p in files}


def test_a_directory_made_whole_follows_the_umask(tmp_path):
    """atomic_dir (a pulled model, a conversion) made its directory with mkdtemp's 0o700."""
    import os

    from llmtrace.fsutil import atomic_dir

    mask = os.umask(0o027)
    try:
        with atomic_dir(tmp_path / "model") as tmp:
            (tmp / "config.json").write_text("{}")
    finally:
        os.umask(mask)
    assert oct((tmp_path / "model").stat().st_mode & 0o777) == oct(0o750)
    assert (tmp_path / "model" / "config.json").read_text() == "{}"
