"""What a new user reads in the terminal, on tiny models: characters in their visible form, tables that drop columns
rather than cut a number, notes where they belong, messages whose numbers agree with their words, and the notices of
--compile. (Round 4 of a new user's trial: issue 30, items 11-14 and 16.)"""

from __future__ import annotations

import re
import unicodedata

import pytest

from helpers import run_cli
from helpers import SPEC, save_hf
from tiny import make_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("terminal") / "m", make_hf_model(SPEC))


def wide(text: str, width: int) -> list[str]:
    return [line for line in text.splitlines() if len(line) > width]


# ----------------------------------------------------------------------------------------------------------------
# characters: every place one is shown uses the visible form


def test_tokenize_names_combining_and_invisible_characters_by_code_point(capsys, tiny_dir):
    code, out, err = run_cli(capsys, "tokenize", "e\u0301 \u200b\u2009", "-m", tiny_dir)
    assert code == 0, err
    for cp in ("0301", "200B", "2009"):
        assert f"of <U+{cp}>)" in out  # the bytes note says which character a byte belongs to
    raw = [c for c in out if unicodedata.category(c) in ("Mn", "Me", "Cf") or c in "\u2009\u00a0"]
    assert raw == [], [f"U+{ord(c):04X}" for c in raw]


def test_a_lone_combining_mark_is_shown_by_its_code_point_and_a_mark_on_a_letter_as_it_is():
    from llmtrace.render.tokenize import quoted
    from llmtrace.tokens.token_facts import CharPart, shown_char, visible_text

    assert str(CharPart("\u0301", 1, 1, 2)) == "1/2 of <U+0301>" and str(CharPart("é", 1, 1, 2)) == "1/2 of é"
    assert shown_char("\u200b") == "<U+200B>" and shown_char("你") == "你"
    assert visible_text("\u0301a".encode()) == "<U+0301>a"  # nothing before it to sit on
    assert visible_text(" \u0301".encode()) == "▁<U+0301>"  # not on the space mark
    assert visible_text("e\u0301".encode()) == "e\u0301"  # on its letter: é, as written
    assert quoted("\u0301") == '"\\u0301"' and quoted("e\u0301") == '"e\u0301"'


# ----------------------------------------------------------------------------------------------------------------
# tables drop columns; they never cut an id or a number


@pytest.mark.parametrize("width", [100, 70, 40, 24])
def test_tokenize_drops_columns_to_fit_and_cuts_nothing(capsys, monkeypatch, tiny_dir, width):
    from llmtrace.checkpoint.tokenizer_only import load_tokenizer

    text = "The quick brown fox jumps over the lazy dog"
    ids = load_tokenizer(str(tiny_dir)).encode(text)
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, err = run_cli(capsys, "tokenize", text, "-m", tiny_dir)
    assert code == 0, err
    lines = out.splitlines()
    table = [line for line in lines if line.startswith("│")]
    assert len(table) == len(ids) and wide("\n".join(table), width) == []
    assert "…" not in out
    for line, i in zip(table, ids):  # the id column is whole on every row
        assert str(i) in [cell.strip() for cell in line.split("│")]
    note = next((n for n, line in enumerate(lines) if line.startswith("(left out to fit")), None)
    top = next(n for n, line in enumerate(lines) if line.startswith("┏"))
    heads = [cell.strip() for cell in lines[top + 1].split("┃") if cell.strip()]
    missing = [h for h in ("#", "id", "piece", "text", "UTF-8 bytes", "chars", "special") if h not in heads]
    assert "id" in heads and "piece" in heads
    assert (note is None) == (missing == []) and (width > 40 or missing)
    if missing:  # said once, above the table, naming what it left out
        assert note < top
        left = " ".join(lines[note:top])
        assert all(h in left for h in missing)


def test_detokenize_drops_columns_to_fit_and_cuts_nothing(capsys, monkeypatch, tiny_dir):
    monkeypatch.setenv("COLUMNS", "30")
    ids = ["316", "223", "286", "90"]
    code, out, err = run_cli(capsys, "detokenize", *ids, "-m", tiny_dir)
    assert code == 0, err
    lines = out.splitlines()
    table = [line for line in lines if line.startswith("│")]
    assert [[c.strip() for c in line.split("│")][1] for line in table] == ids and "…" not in out
    assert wide("\n".join(table), 30) == []
    assert lines[0].startswith("(left out to fit 30 columns:") and "#" in lines[0] + lines[1]
    assert lines[-1].startswith("text: ")


# ----------------------------------------------------------------------------------------------------------------
# notes where they belong


def test_the_left_out_note_comes_before_the_step_table(capsys, monkeypatch, tiny_dir):
    monkeypatch.setenv("COLUMNS", "60")
    code, out, err = run_cli(capsys, "generate", "The lazy dog", "-m", tiny_dir, "-n", "3")
    assert code == 0, err
    lines = out.splitlines()
    head = next(n for n, line in enumerate(lines) if line.split()[:3] == ["step", "pos", "token"])
    note = next(n for n, line in enumerate(lines) if line.startswith("(left out to fit 60 columns"))
    assert note < head
    assert [lines[head + 1 + k].split()[0] for k in range(3)] == ["0", "1", "2"]  # the step rows unbroken


def test_models_at_80_columns_keeps_each_path_on_one_line(capsys, monkeypatch, fresh_home):
    """The default model in the cache, as pull leaves it (a manifest written last): its path is 63 characters."""
    import llmtrace.cli.models as models
    from llmtrace.registry.cache import write_manifest
    from llmtrace.registry.models_toml import DEFAULT_MODEL, Source

    folder = fresh_home / "models" / DEFAULT_MODEL
    folder.mkdir(parents=True)
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    write_manifest(folder, DEFAULT_MODEL, "gguf", path.name, Source(kind="pypi", package="p", version="1",
                                                                    member="m.gguf"), {})
    monkeypatch.setattr(models.sys.stdout, "isatty", lambda: True)  # the table, not a pipe's tab-separated lines
    monkeypatch.setenv("COLUMNS", "80")  # rich reads the terminal's width from it
    code, out, err = run_cli(capsys, "models")
    assert code == 0, err
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # a terminal gets bold headers
    assert wide(out, 80) == []
    assert f"    models/{DEFAULT_MODEL}/{path.name}" in out.splitlines(), out


@pytest.mark.parametrize("columns", [80, 200])
def test_models_never_cuts_a_value_and_keeps_the_defaults_marker(capsys, monkeypatch, fresh_home, columns):
    """Every value of every row appears whole (the name with the default's `*`, the model and its license, the
    sources, the size), or its column is named in the note as left out; the `*` is there whenever the legend is."""
    import json

    import llmtrace.cli.models as models
    from llmtrace.registry.cache import write_manifest
    from llmtrace.registry.models_toml import DEFAULT_MODEL, Source

    folder = fresh_home / "models" / DEFAULT_MODEL
    folder.mkdir(parents=True)
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    write_manifest(folder, DEFAULT_MODEL, "gguf", path.name, Source(kind="pypi", package="p", version="1",
                                                                    member="m.gguf"), {})
    code, doc, _ = run_cli(capsys, "models", "--json", "-")
    rows = json.loads(doc)["models"]
    monkeypatch.setattr(models.sys.stdout, "isatty", lambda: True)  # the table, not a pipe's tab-separated lines
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = run_cli(capsys, "models")
    assert code == 0, err
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert wide(out, columns) == []
    note = next((line for line in out.splitlines() if "left out" in line), "")
    assert (note == "") == (columns == 200), out  # 200 columns hold every column
    cells = [line.split("│") for line in out.splitlines() if line.startswith("│")]
    shown = {c.strip() for row in cells for c in row}
    for row in rows:
        name = row["name"] + (" *" if row["default"] else "")
        assert name in shown, (name, out)
        values = {"model / license": [f"{row['architecture']} {row['params']}", row["license"]],
                  "sources": [",".join(s["kind"] for s in row["sources"] if s["kind"] != "cache")],
                  "tested": ["yes" if row["tested"] else "no"]}
        for column, whole in values.items():
            if column not in note:
                assert all(v in shown for v in whole), (column, whole, out)
    assert "93.8 MiB" not in shown and any(c.endswith(" B") for c in shown)  # the size, whole (this one is tiny)
    assert "* default model" in err and any(c.endswith(" *") for c in shown)


def test_patch_help_fits_80_columns_and_keeps_the_leading_space_whole(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(capsys, "patch", "--help")
    assert code == 0
    assert wide(out, 80) == []
    assert '" Paris", not "Paris"' in out


# ----------------------------------------------------------------------------------------------------------------
# words that agree with their numbers


def test_messages_count_in_the_singular(tiny_dir):
    from llmtrace.checkpoint.load import load_model
    from llmtrace.run.generate import context_note

    lm = load_model(str(tiny_dir))
    ctx = lm.config.max_seq_len
    assert context_note(lm, [1], ctx + 5).startswith("the prompt has 1 token and")
    assert f": {ctx - 1:,} tokens fit, not" in context_note(lm, [1], ctx + 5)
    assert ": 1 token fits, not" in context_note(lm, [ctx - 1], 5)


def test_an_interrupted_run_says_so_once(capsys, tiny_dir):
    from rich.console import Console

    from llmtrace.render.generate import TerminalRenderer

    console = Console(width=200, force_terminal=False)
    summary = {"event": "summary", "prompt_tokens": 1, "generated_tokens": 2, "tokens": [5, 6], "text": "ab",
               "stop_reason": "interrupted", "ttft_ms": 1.0, "prefill_tok_s": 1.0, "decode_tok_s": 1.0,
               "interrupted": True}
    TerminalRenderer(console)(summary)
    out = capsys.readouterr().out
    assert "1 prompt token · 2 generated · stop: interrupted (Ctrl-C) · TTFT" in out
    assert out.count("interrupted") == 1


def test_a_one_token_comparison_and_a_page_of_one_recorded_layer_read_in_the_singular(capsys, tiny_dir, tmp_path):
    code, out, err = run_cli(capsys, "compare", "The", "-m", tiny_dir, "--b-dtype", "bfloat16")
    assert code == 0, err
    assert "1 position (1 prompt, 0 decode)" in out
    page = tmp_path / "r.html"
    code, _, err = run_cli(capsys, "generate", "The lazy dog", "-m", tiny_dir, "-n", "2", "--trace", "layers",
                           "--layers", "1", "--html", page)
    assert code == 0, err
    text = page.read_text()
    assert "layer 1 (of 3 layers)" in text and "Only layers 1 of" not in text


# ----------------------------------------------------------------------------------------------------------------
# report of a trace whose model was loaded from a file


def test_report_of_a_local_gguf_trace_warns_and_names_the_flag(capsys, tmp_path):
    """The trace names the model by the file's stem, which no registry knows, and carries the file's path: while the
    file is there the story is drawn from it and nothing is said; once it is gone, the terminal says so in one
    warning naming -m PATH (the page says the same); with -m PATH the story is drawn and nothing is said."""
    from tiny import TinySpec, write_gguf

    gguf = tmp_path / "local.gguf"
    write_gguf(gguf, make_hf_model(TinySpec()))
    trace, page = tmp_path / "t.json", tmp_path / "r.html"
    code, _, err = run_cli(capsys, "generate", "The lazy dog", "-m", gguf, "-n", "2", "--json", trace)
    assert code == 0, err
    code, out, err = run_cli(capsys, "report", trace, "-o", page)
    assert code == 0 and "warning" not in err, err  # the run event's path: the file is still there
    assert '<button class="word" data-word="1"' in page.read_text() and "-m PATH" not in page.read_text()
    gguf = gguf.rename(tmp_path / "moved.gguf")
    code, out, err = run_cli(capsys, "report", trace, "-o", page)
    assert code == 0 and out == ""
    warning, wrote = err.splitlines()
    assert warning.startswith("warning: the page has no BPE merge story: the trace names its model 'local'")
    assert f"its file {tmp_path / 'local.gguf'} is not here" in warning
    assert "-m PATH" in warning and wrote.startswith(f"wrote {page}")
    assert "-m PATH" in page.read_text()
    code, _, err = run_cli(capsys, "report", trace, "-o", page, "-m", gguf)
    assert code == 0 and "warning" not in err
    assert '<button class="word" data-word="1"' in page.read_text() and "-m PATH" not in page.read_text()
    code, _, err = run_cli(capsys, "report", trace, "-o", page, "--no-merges")
    assert code == 0 and "warning" not in err


# ----------------------------------------------------------------------------------------------------------------
# --compile


def test_the_compile_notice_says_its_cache_is_per_thread_count(capsys, tiny_dir, monkeypatch, tmp_path):
    """-n 1 runs no decode step, so nothing is compiled: the notice alone, at once."""
    import torch

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    threads = torch.get_num_threads()
    try:
        code, _, err = run_cli(capsys, "generate", "The lazy dog", "-m", tiny_dir, "-n", "1", "--trace", "none",
                               "--compile", "--threads", "1")
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    assert "  kept per thread count (1 thread here): another count compiles anew\n" in err
    assert wide("\n".join(line for line in err.splitlines() if "its cache: " not in line), 80) == []


# ----------------------------------------------------------------------------------------------------------------
# output into a pipe or a file (issue 38, items 7 and 9)


@pytest.mark.parametrize("argv", [
    ["generate", "Hello", "-n", "20", "--ignore-eos", "--jsonl", "-"],  # the JSONL stream
    ["generate", "Hello", "-n", "20", "--ignore-eos"],  # the terminal view (rich), into a pipe
    ["tokenize", "Hello world"],  # rich, without a model loaded
    ["generate", "--help"],  # click's help
])
def test_a_reader_that_goes_away_ends_the_command_quietly_with_141(tiny_dir, argv):
    """`llmtrace generate "Hello" -n 20 --jsonl - | head -2` left exit 1 and nothing said; now 141 (a process ended by
    SIGPIPE, as a shell reports `yes | head -1`), nothing on stderr. The reader is gone before the first write, so the
    write fails whatever the timing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if argv[-1] != "--help":
        argv = argv + ["-m", str(tiny_dir)]
    env = {k: v for k, v in os.environ.items() if k not in ("LLMTRACE_DEBUG", "COLUMNS")}
    p = subprocess.Popen([sys.executable, "-m", "llmtrace", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=Path(__file__).resolve().parent.parent, env=env | {"OMP_NUM_THREADS": "1"})
    p.stdout.close()  # the reader goes away
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141 and err == ""


def test_output_into_a_file_has_no_trailing_spaces(capsys, tiny_dir):
    """Piped to a file, `explain` carried trailing spaces on 101 of 156 lines (rich pads tables to the width)."""
    code, out, err = run_cli(capsys, "explain", "Hello world", "-m", tiny_dir)
    assert code == 0, err
    assert out.count("\n") > 50 and "resid_post" in out  # the whole view, tables and all
    assert [line for line in out.splitlines() if line.endswith(" ")] == []


def test_the_console_strips_line_ends_only_off_a_terminal():
    import io

    from rich.table import Table

    from llmtrace.console import make_console

    table = Table("a", "b", box=None)  # no border: rich pads each row's last cell to the width
    table.add_row("1", "a long cell that sets the width")
    table.add_row("22", "x")
    for tty in (False, True):
        buf = io.StringIO()
        buf.isatty = lambda tty=tty: tty  # noqa: B023
        console = make_console(file=buf)
        console.print(table)
        console.print("kept: ", end="")  # a space before more text on the same line is not a line end
        console.print("here")
        text = buf.getvalue()
        assert ("kept: here" in text) and any(line.endswith(" ") for line in text.splitlines()) == tty, text


def test_a_skin_tone_keeps_the_table_border_straight(capsys, tiny_dir):
    """`tokenize "🎉👍🏽 👨‍👩‍👧"`: the rows naming the skin tone 🏽 on its own ("1/4 of 🏽") were two columns wider,
    since rich counts a lone skin tone as 0 columns and a terminal draws it as 2. Measured here as a terminal draws
    (wcwidth, grapheme clusters), every line of the table has one width; the lone skin tone is named by code point."""
    import wcwidth

    from llmtrace.tokens.token_facts import shown_char, visible_text

    code, out, err = run_cli(capsys, "tokenize", "🎉👍🏽 👨‍👩‍👧", "-m", tiny_dir)
    assert code == 0, err
    table = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert len(table) > 30 and "(1/4 of <U+1F3FD>)" in out
    assert {wcwidth.wcswidth(line) for line in table} == {wcwidth.wcswidth(table[0])}
    assert shown_char("🏽") == "<U+1F3FD>" and visible_text("👍🏽".encode()) == "👍🏽"  # on its emoji: as written
    assert visible_text("a🏽".encode()) == "a<U+1F3FD>"  # a letter takes no skin tone: the terminal draws it apart


# ----------------------------------------------------------------------------------------------------------------
# the Python API speaks keywords, the CLI flags (issue 38, item 15)


def test_a_library_note_names_keywords_and_the_cli_writes_them_as_flags(capsys):
    from llmtrace.cli.options import flag_words
    from llmtrace.words import in_words, say, worded

    note = "no logits were saved (record them with `trace='full'` or `dump=['logits']`); KLD is not known"
    assert in_words(note) == note  # a Python caller reads the keywords
    say("loading in bfloat16 instead (`dtype='float32'` overrides)")
    with worded(flag_words):
        assert in_words(note) == "no logits were saved (record them with --trace full or --dump logits); KLD is not known"
        say("loading in bfloat16 instead (`dtype='float32'` overrides)")
        assert in_words("`chat=True` uses Gemma's turn format; `save_tensors`; `for_report=True`; `order`") == \
            "--chat uses Gemma's turn format; --save-tensors; --html; --sampler-order"
    assert flag_words("`chat=True` and a `prompt_of_mine`", known=frozenset({"--chat"})) == \
        "--chat and a `prompt_of_mine`"  # a name that is no flag of the CLI stays as written
    assert capsys.readouterr().err == ("note: loading in bfloat16 instead (`dtype='float32'` overrides)\n"
                                       "note: loading in bfloat16 instead (--dtype float32 overrides)\n")


def test_the_cli_says_the_fast_notes_in_flags_and_the_api_in_keywords():
    from llmtrace.trace.records import fast_parts

    fast = {"compute_dtype": "bfloat16", "kernel_choice": {"by": "cuda", "int4": True}}
    assert fast_parts(fast)[0] == "`fast=True`: approximate, not the exact values"
