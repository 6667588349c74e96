"""No command writes over one of its own inputs, and none writes over a file llmtrace did not write without --force
(issue 52, items 1 and 2; llmtrace/cli/outputs.py).

Each refusal is one line, exit 2, before any model loads, and leaves every file as it was, byte for byte. A file
llmtrace wrote (a trace, a page, a base file) is written over as before, so a command can be run again over its own
outputs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import assert_one_line_error, run_cli, save_hf, SPEC
from tiny import CORPUS, make_hf_model

NOTE = b"my notes, keep me\n"  # a user's own file: 18 bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_hf(tmp_path_factory.mktemp("overwrite") / "tiny", make_hf_model(SPEC))


@pytest.fixture(autouse=True)
def here(tmp_path, monkeypatch):
    """Each test in a directory of its own (relative paths are part of the cases); torch's threads stay the suite's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("llmtrace.checkpoint.devices.set_threads", lambda n: None)
    return tmp_path


@pytest.fixture
def trace(tiny, capsys) -> Path:
    """A trace of generate's, written by this test."""
    path = Path("tr.jsonl")
    code, _, err = run_cli(capsys, "generate", "The lazy dog", "-m", tiny, "-n", "2", "--jsonl", path)
    assert code == 0, err
    return path


def text_file() -> Path:
    path = Path("p.txt")
    path.write_text(" ".join(CORPUS * 8))
    return path


def refused(capsys, argv: list, *says: str, unchanged: dict[Path, bytes]) -> str:
    """The command fails with one line and exit 2, and every file of UNCHANGED holds the bytes it held."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, err
    line = assert_one_line_error(err, *says)
    for path, data in unchanged.items():
        assert path.read_bytes() == data, path
    return line


# ----------------------------------------------------------------------------------------------------------------
# 1. an output that is an input


def test_report_over_its_own_trace_is_refused(capsys, trace):
    before = trace.read_bytes()
    refused(capsys, ["report", trace, "-o", trace], "-o tr.jsonl is the trace to render", "another name",
            unchanged={trace: before})


def test_eval_over_its_own_text_is_refused(capsys, tiny):
    p = text_file()
    before = p.read_bytes()
    refused(capsys, ["eval", p, "-m", tiny, "--ctx", 32, "--chunks", 1, "--jsonl", p],
            "--jsonl p.txt is the text to score", unchanged={p: before})
    for flag in ("--json", "--html", "--save-base"):  # every output of eval, not only the stream
        refused(capsys, ["eval", p, "-m", tiny, "--ctx", 32, "--chunks", 1, flag, p], f"{flag} p.txt is the text",
                unchanged={p: before})


def test_generate_over_its_own_prompt_file_is_refused(capsys, tiny):
    prompt = Path("prompt.txt")
    prompt.write_bytes(b"The lazy dog\n")
    refused(capsys, ["generate", "--file", prompt, "-n", 1, "-m", tiny, "--jsonl", prompt],
            "--jsonl prompt.txt is the prompt file (--file)", unchanged={prompt: b"The lazy dog\n"})
    refused(capsys, ["generate", "--prompts", prompt, "-n", 1, "-m", tiny, "--html", prompt],
            "--html prompt.txt is the prompts file (--prompts)", unchanged={prompt: b"The lazy dog\n"})


def test_a_symlink_to_the_input_is_the_input(capsys, tiny):
    prompt, link = Path("prompt.txt"), Path("link.jsonl")
    prompt.write_bytes(b"The lazy dog\n")
    link.symlink_to(prompt)
    refused(capsys, ["generate", "--file", prompt, "-n", 1, "-m", tiny, "--jsonl", link],
            "--jsonl link.jsonl is prompt.txt, the prompt file", unchanged={prompt: b"The lazy dog\n"})
    assert link.is_symlink()


def test_a_relative_path_through_dotdot_is_the_input(capsys, tiny, here):
    prompt = here / "prompt.txt"
    prompt.write_bytes(b"The lazy dog\n")
    (here / "sub").mkdir()
    refused(capsys, ["tokenize", "--file", "prompt.txt", "-m", tiny, "--json", "sub/../prompt.txt"],
            "sub/../prompt.txt is prompt.txt, the text file (--file)", unchanged={prompt: b"The lazy dog\n"})
    refused(capsys, ["explain", "--file", prompt, "-m", tiny, "--json", Path("sub/../prompt.txt").absolute()],
            "the prompt file (--file)", unchanged={prompt: b"The lazy dog\n"})


def test_a_hard_link_to_the_input_is_the_input(capsys, tiny, trace):
    os.link(trace, "again.jsonl")
    before = trace.read_bytes()
    refused(capsys, ["report", "again.jsonl", "-o", trace], "is again.jsonl, the trace to render",
            unchanged={trace: before})


def test_two_outputs_in_one_file_are_refused(capsys, tiny, trace):
    before = trace.read_bytes()
    refused(capsys, ["generate", "Hi", "-m", tiny, "-n", 1, "--jsonl", trace, "--html", "./tr.jsonl"],
            "--jsonl and --html name the same file", unchanged={trace: before})


def test_resume_is_written_on_but_no_other_output_may_be_it(capsys, tiny):
    p = text_file()
    code, _, err = run_cli(capsys, "eval", p, "-m", tiny, "--ctx", 32, "--chunks", 2, "--jsonl", "run.jsonl")
    assert code == 0, err
    run = Path("run.jsonl")
    run.write_text("".join(run.read_text().splitlines(keepends=True)[:2]))  # the header and one chunk: killed
    before = run.read_bytes()
    refused(capsys, ["eval", p, "-m", tiny, "--ctx", 32, "--chunks", 2, "--resume", run, "--json", run],
            "--resume and --json name the same file", unchanged={run: before})
    refused(capsys, ["eval", p, "-m", tiny, "--ctx", 32, "--chunks", 2, "--resume", p],
            "--resume p.txt is the text to score", unchanged={run: before})
    code, _, err = run_cli(capsys, "eval", p, "-m", tiny, "--ctx", 32, "--chunks", 2, "--resume", run)
    assert code == 0, err
    events = [json.loads(line)["event"] for line in run.read_text().splitlines()]
    assert events == ["eval", "chunk", "chunk", "eval_summary"]


# ----------------------------------------------------------------------------------------------------------------
# 2. a file llmtrace did not write


def test_a_users_file_is_refused_without_force(capsys, trace):
    notes = Path("notes.txt")
    notes.write_bytes(NOTE)
    line = refused(capsys, ["report", trace, "-o", notes], "-o notes.txt", "llmtrace did not write it", "--force",
                   unchanged={notes: NOTE})
    assert len(line) <= 120
    assert sorted(p.name for p in Path().iterdir()) == ["notes.txt", "tr.jsonl"]  # no temporary file left


@pytest.mark.parametrize("flag", ["--jsonl", "--json", "--html"])
def test_every_output_of_generate_refuses_a_users_file(capsys, tiny, flag):
    notes = Path("notes.txt")
    notes.write_bytes(NOTE)
    refused(capsys, ["generate", "Hi", "-m", tiny, "-n", 1, flag, notes], f"{flag} notes.txt", "--force",
            unchanged={notes: NOTE})


def test_force_writes_over_a_users_file(capsys, trace):
    notes = Path("notes.txt")
    notes.write_bytes(NOTE)
    code, _, err = run_cli(capsys, "report", trace, "-o", notes, "--force")
    assert code == 0, err
    page = notes.read_text()
    assert page.lstrip().lower().startswith("<!doctype html>") and '<meta name="generator" content="llmtrace">' in page


def test_force_never_writes_over_an_input(capsys, trace):
    before = trace.read_bytes()
    refused(capsys, ["report", trace, "-o", trace, "--force"], "is the trace to render", unchanged={trace: before})


def test_commands_run_again_over_their_own_outputs(capsys, tiny):
    """Every output a command wrote is llmtrace's, so the same command line runs again (and so does another command
    whose output lands there: a page over a page, a trace over a trace)."""
    p = text_file()
    outs = ["--jsonl", "g.jsonl", "--json", "g.json", "--html", "g.html", "--save-tensors", "g.safetensors"]
    evals = ["--jsonl", "e.jsonl", "--json", "e.json", "--html", "e.html", "--save-base", "e.safetensors"]
    runs = [["generate", "The lazy dog", "-m", tiny, "-n", 2, "--trace", "full", *outs],
            ["report", "g.jsonl", "-o", "r.html", "--no-merges"],
            ["eval", p, "-m", tiny, "--ctx", 32, "--chunks", 1, *evals],
            ["lens", "The lazy dog", "-m", tiny, "--jsonl", "l.jsonl", "--json", "l.json", "--html", "l.html"],
            ["tokenize", "The lazy dog", "-m", tiny, "--jsonl", "t.jsonl", "--json", "t.json"]]
    for argv in runs + runs:
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, (argv, err)
    code, _, err = run_cli(capsys, "report", "l.jsonl", "-o", "g.html", "--no-merges")  # another command's page
    assert code == 0, err


# ----------------------------------------------------------------------------------------------------------------
# what llmtrace wrote, by content


def test_what_counts_as_written_by_llmtrace(tmp_path):
    from llmtrace.cli.outputs import written_by_llmtrace

    def wrote(name: str, data: bytes) -> bool:
        path = tmp_path / name
        path.write_bytes(data)
        return written_by_llmtrace(path)

    def safetensors(meta: dict) -> bytes:
        header = json.dumps({"__metadata__": meta, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
        return len(header).to_bytes(8, "little") + header.encode() + bytes(4)

    ours, theirs = safetensors({"format": "llmtrace.eval-base/1"}), safetensors({"format": "pt"})
    assert wrote("empty", b"")  # nothing to lose
    assert wrote("ours.safetensors", ours) and not wrote("theirs.safetensors", theirs)
    assert wrote("run.json", b'{"schema": "llmtrace.trace/1", "events": []}\n')
    assert wrote("run.jsonl", b'{"event": "summary", "command": "lens", "prompt_tokens": 0, "interrupted": true}\n')
    assert wrote("page.html", b'<!doctype html>\n<html><head><meta charset="utf-8">\n'
                              b'<meta name="generator" content="llmtrace">\n</head></html>\n')
    assert not wrote("page2.html", b"<!doctype html>\n<html lang=en><title>a report</title></html>\n")
    assert not wrote("notes.txt", NOTE)
    assert not wrote("bogus.jsonl", b'{"event": "bogus"}\n')  # an event of no kind llmtrace writes
    assert not wrote("data.json", b'{"schema": "https://json-schema.org/draft/2020-12/schema"}\n')
    assert not wrote("data2.json", b'{\n  "name": "x",\n  "kind": "y"\n}\n')  # a few of pull's keys, not all
