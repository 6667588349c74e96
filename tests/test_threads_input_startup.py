"""Everyday friction (issue 13, part 5): thread count, the shell's trailing newline, start-up imports, the cache.

The model runs here are the tiny checkpoint of tests/tiny.py; the cache tests use a temporary $LLMTRACE_HOME and
never touch the user's cache.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from llmtrace.errors import UsageError

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("isolated")  # conftest: a cache and config of each test's own


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny import TinySpec, write_hf_dir

    path = tmp_path_factory.mktemp("tiny") / "hf"
    write_hf_dir(path, TinySpec())
    return path


def run_event(out: str) -> dict:
    return next(e for e in map(json.loads, out.splitlines()) if e["event"] == "run")


def prompt_ids(out: str) -> list[int]:
    tokens = next(e for e in map(json.loads, out.splitlines()) if e["event"] == "tokens")
    return [t["id"] for t in tokens["tokens"]]


# ----------------------------------------------------------------------------------------------------------------
# threads


CPUINFO_2_CORES_4_THREADS = "\n\n".join(
    f"processor\t: {cpu}\nvendor_id\t: AuthenticAMD\nphysical id\t: 0\nsiblings\t: 4\ncore id\t\t: {cpu % 2}\ncpu cores\t: 2"
    for cpu in range(4)
)


def test_hyperthread_siblings_count_as_one_core():
    from llmtrace.checkpoint.devices import cpuinfo_cores

    assert len(cpuinfo_cores(CPUINFO_2_CORES_4_THREADS, {0, 1, 2, 3})) == 2
    assert len(cpuinfo_cores(CPUINFO_2_CORES_4_THREADS, {0, 2})) == 1  # two siblings of core 0
    assert len(cpuinfo_cores(CPUINFO_2_CORES_4_THREADS, {1})) == 1
    assert cpuinfo_cores("processor : 0\nflags : fpu\n", {0}) == set()  # no core ids: the caller falls back


def test_default_threads_are_the_physical_cores_of_our_cpus():
    from llmtrace.checkpoint.devices import physical_cores, thread_count

    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= physical_cores() <= logical
    assert thread_count() == physical_cores()


def test_threads_flag_then_environment(monkeypatch):
    from llmtrace.checkpoint.devices import thread_count

    monkeypatch.setenv("LLMTRACE_THREADS", "3")
    assert thread_count() == 3
    assert thread_count(1) == 1  # --threads wins over the environment
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("LLMTRACE_THREADS", bad)
        with pytest.raises(UsageError, match="LLMTRACE_THREADS"):
            thread_count()
    with pytest.raises(UsageError, match="^threads must be") as e:  # the library names the value; the CLI the flag
        thread_count(0)
    assert e.value.named("--threads") == "--threads must be ≥ 1"


def test_run_event_and_header_show_the_thread_count(tiny_dir, capsys, monkeypatch):
    monkeypatch.setenv("LLMTRACE_THREADS", "1")
    code, out, err = run_cli(capsys, "generate", "hi", "-m", tiny_dir, "-n", "1", "--jsonl", "-")
    assert code == 0, err
    assert run_event(out)["threads"] == 1 == torch.get_num_threads()
    code, out, err = run_cli(capsys, "generate", "hi", "-m", tiny_dir, "-n", "1", "--threads", "2", "--jsonl", "-")
    assert code == 0, err
    assert run_event(out)["threads"] == 2 == torch.get_num_threads()

    from llmtrace.console import make_console
    from llmtrace.render.generate import render_events

    console = make_console()
    events = [json.loads(line) for line in out.splitlines()]
    render_events(events, console)
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run"))
    assert "cpu · 2 threads · float32" in header

    code, _, err = run_cli(capsys, "generate", "hi", "-m", tiny_dir, "--threads", "0")
    assert code == 2 and "--threads must be ≥ 1" in err


# ----------------------------------------------------------------------------------------------------------------
# the trailing newline of stdin and --file


def test_strip_one_newline():
    from llmtrace.cli.text_input import strip_one_newline

    assert strip_one_newline("a\n") == "a"
    assert strip_one_newline("a\r\n") == "a"
    assert strip_one_newline("a\n\n") == "a\n"
    assert strip_one_newline("a\r\n\r\n") == "a\r\n"
    assert strip_one_newline("a\r") == "a\r"
    assert strip_one_newline("") == "" and strip_one_newline("\n") == ""


def test_echo_into_generate_is_the_same_prompt_as_the_argument(tiny_dir, tmp_path, capsys, monkeypatch):
    text = "The capital of France is"
    args = ("generate", "-m", tiny_dir, "-n", "1", "--trace", "none", "--jsonl", "-")
    code, out, err = run_cli(capsys, *args, text)
    assert code == 0, err
    expected = prompt_ids(out)
    code, out, err = run_cli(capsys, *args, stdin=(text + "\n").encode())
    assert code == 0, err
    assert prompt_ids(out) == expected
    assert run_event(out)["prompt"] == text
    for ending in ("\n", "\r\n"):
        (tmp_path / "prompt.txt").write_bytes((text + ending).encode())
        code, out, err = run_cli(capsys, *args, "--file", tmp_path / "prompt.txt")
        assert code == 0, err
        assert prompt_ids(out) == expected
    # a newline that is not the shell's stays: a second one, or one in the argument
    code, out, err = run_cli(capsys, *args, stdin=(text + "\n\n").encode())
    assert run_event(out)["prompt"] == text + "\n"
    code, out, err = run_cli(capsys, *args, text + "\n")
    assert run_event(out)["prompt"] == text + "\n" and prompt_ids(out) != expected


def test_help_says_what_happens_to_the_newline_and_threads(capsys, monkeypatch):
    code, out, _ = run_cli(capsys, "generate", "--help")
    flat = " ".join(out.split())
    assert code == 0 and "One trailing newline of a file or stdin" in flat
    assert "LLMTRACE_THREADS" in flat and "physical cores" in flat
    code, out, _ = run_cli(capsys, "tokenize", "--help")
    assert "One trailing newline of a file or stdin" in " ".join(out.split())


# ----------------------------------------------------------------------------------------------------------------
# start-up: only the commands that run the model import torch


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny import TinySpec, make_hf_model, write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, make_hf_model(TinySpec()))
    return path


def imports_torch(*argv, env: dict, stdin: str = "") -> tuple[bool, subprocess.CompletedProcess]:
    """Run `llmtrace ARGV` in a fresh interpreter; whether it imported torch, and the process."""
    code = ("import sys\nfrom llmtrace.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    code = e.code\nelse:\n    code = 0\nprint('torch' in sys.modules, file=sys.stderr)\nsys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, input=stdin,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.strip().splitlines()[-1] == "True", proc


@pytest.mark.slow
def test_tokenizer_and_file_commands_do_not_import_torch(tiny_gguf, tiny_dir, tmp_path, capsys, monkeypatch):
    from llmtrace.checkpoint.load import load_model

    load_model(str(tiny_gguf))  # converts it into this test's cache, as the first `generate` would
    trace = tmp_path / "run.json"
    code, _, err = run_cli(capsys, "generate", "hi", "-m", tiny_gguf, "-n", "2", "--json", trace)
    assert code == 0, err
    env = {"LLMTRACE_HOME": os.environ["LLMTRACE_HOME"], "LLMTRACE_CONFIG_DIR": os.environ["LLMTRACE_CONFIG_DIR"]}
    for argv in [
        ("tokenize", "Hello", "--ids", "-m", tiny_gguf),
        ("tokenize", "Hello", "--merges", "-m", tiny_dir),
        ("detokenize", "5", "6", "-m", tiny_gguf),
        ("models",),
        ("models", "--json", "-"),
        ("schema",),
        ("show", trace),
    ]:
        torch_imported, proc = imports_torch(*argv, env=env)
        assert proc.stdout and not torch_imported, argv
    # the control: a command that runs the model does import it, so the check above can fail
    torch_imported, _ = imports_torch("generate", "hi", "-m", tiny_gguf, "-n", "1", "--trace", "none", env=env)
    assert torch_imported


# ----------------------------------------------------------------------------------------------------------------
# help (issue 20)

COMMANDS = ["generate", "tokenize", "detokenize", "models", "pull", "rm", "explain", "lens", "schema", "show", "report"]


def test_llmtrace_alone_prints_the_help_as_help_prints_it(capsys):
    code, out, err = run_cli(capsys)
    _, help_out, _ = run_cli(capsys, "--help")
    assert code == 2 and out == ""
    assert err == help_out  # the same lines as --help, not squashed into one error line
    assert err.startswith("Usage: llmtrace [OPTIONS] COMMAND [ARGS]...\n") and "\nCommands:\n" in err


@pytest.mark.parametrize("columns", [80, 200])
def test_help_examples_are_one_per_line_and_help_uses_the_width(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    widest = 0
    for command in COMMANDS:
        code, out, _ = run_cli(capsys, command, "--help")
        assert code == 0
        for line in out.splitlines():
            widest = max(widest, len(line))
            # a pipe or && joins commands on purpose; otherwise one `llmtrace …` per line
            for part in line.replace("&&", "|").split("|"):
                assert part.count("llmtrace ") <= 1, f"{command} --help runs two examples together: {line!r}"
    if columns == 200:
        assert widest > 120  # paragraphs use the room (click's default stops at 80)


def test_help_examples_at_80_columns_are_broken_as_shell_lines_that_run_as_written(capsys, monkeypatch):
    """At 80 columns a long example is not rewrapped as prose (which split commands mid-word, e.g. a quoted prompt):
    it is broken between its words with a shell continuation, never between a flag and its value, each row within
    the width; joined again it is the example as the command declares it."""
    from llmtrace.cli.generate import GENERATE_HELP

    monkeypatch.setenv("COLUMNS", "80")
    joined, too_wide = [], []
    for command in COMMANDS:
        _, out, _ = run_cli(capsys, command, "--help")
        lines, i = out.splitlines(), 0
        while i < len(lines):
            line = lines[i]
            while line.endswith(" \\") and i + 1 < len(lines):
                too_wide += [lines[i]] if len(lines[i]) > 80 else []
                ends_in_flag = lines[i][:-2].rstrip().split()[-1].startswith("-")
                i += 1
                assert not ends_in_flag or lines[i].strip()[:1] in "-#", lines[i]  # a flag stays with its value
                line = line[:-2] + " " + lines[i].strip()
            joined.append(line.strip())
            i += 1
    assert not too_wide, too_wide
    dry = next(x.strip() for x in GENERATE_HELP.splitlines() if "--dry-multiplier" in x and x.strip().startswith("llm"))
    assert dry in joined and len(dry) > 80  # a long one, made of three rows, runs as written


# ----------------------------------------------------------------------------------------------------------------
# --json and --jsonl in every command the documentation names (issue 20; the sentence moved from the README to
# docs/commands.md in issue 38)


def test_every_command_the_docs_name_takes_json_and_jsonl(capsys):
    readme = (Path(__file__).resolve().parents[1] / "docs" / "commands.md").read_text()
    sentence = readme[readme.index("`--json FILE` and `--jsonl FILE` mean the same in every command"):][:200]
    named = [c for c in COMMANDS if f"`{c}`" in sentence]
    assert named == ["generate", "tokenize", "detokenize", "models", "pull", "explain", "lens"]
    for command in named:
        _, out, _ = run_cli(capsys, command, "--help")
        assert "--json " in out and "--jsonl " in out, command


def test_detokenize_models_and_pull_write_jsonl(capsys, monkeypatch, tmp_path, smollm_path):
    from llmtrace.registry.models_toml import load_registry

    monkeypatch.setenv("LLMTRACE_HOME", str(smollm_path.parents[2]))  # the tests' cache, which holds the model

    code, _, err = run_cli(capsys, "detokenize", "19556", "905", "--jsonl", tmp_path / "d.jsonl")
    assert code == 0, err
    lines = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [(d["kind"], d["index"], d["id"], d["text"]) for d in lines] == [("token", 0, 19556, "Hello"),
                                                                           ("token", 1, 905, " world")]
    code, _, err = run_cli(capsys, "models", "--jsonl", tmp_path / "m.jsonl")
    assert code == 0, err
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [m["name"] for m in lines] == list(load_registry())
    code, out, err = run_cli(capsys, "pull", "--jsonl", "-")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines == [{"name": "smollm2-135m-instruct", "kind": "gguf", "file": str(smollm_path),
                      "bytes": smollm_path.stat().st_size}]


def test_json_names_the_default_model(capsys, monkeypatch, smollm_path):
    monkeypatch.setenv("LLMTRACE_HOME", str(smollm_path.parents[2]))
    for argv in (("tokenize", "Hello", "--json", "-"), ("detokenize", "19556", "--json", "-")):
        code, out, _ = run_cli(capsys, *argv)
        assert code == 0 and json.loads(out)["model"] == "smollm2-135m-instruct"


def test_version(capsys):
    from llmtrace.version import __version__

    code, out, err = run_cli(capsys, "--version")
    assert code == 0 and out == f"llmtrace {__version__}\n" and err == ""


def test_a_one_token_prompt_is_one_prompt_token_in_the_report(smollm):
    from llmtrace.report.write import build
    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig
    from llmtrace.trace.options import TraceOptions
    from llmtrace.trace.recorder import Recorder

    events = []
    rec = Recorder(TraceOptions(level="steps"), [events.append], run_info={"prompt": "Hi"})
    ids = smollm.tokenizer.encode("Hi")
    assert len(ids) == 1
    generate(smollm, ids, Sampler(SamplerConfig(temperature=0), smollm.config.vocab_size), 2, ignore_eos=True,
             observer=rec)
    page = build(json.loads(json.dumps(events)))
    assert "<p>1 prompt token and 2 generated tokens, coloured" in page and "1 prompt tokens" not in page


@pytest.mark.parametrize("flags", [["--temperature", "-1"], ["--top-p", "2"], ["--sampler-order", "x"],
                                   ["--logit-bias", "abc"], ["--layers", "a,b"], ["-n", "-1"], ["--trace", "deep"],
                                   ["--compile", "--trace", "full"]], ids=lambda f: " ".join(f))
def test_generate_usage_errors_are_found_before_torch_is_imported(flags):
    """Not a timing: the import of torch is what took 2-3 s before a usage error was said; -X importtime lists every
    module imported, and torch is not among them."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "llmtrace", "generate", "hi", *flags],
                            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    said = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert result.returncode == 2 and len(said) == 1 and said[0].startswith("error: "), result.stderr[-500:]
    assert "torch" not in imported and "llmtrace.cli.generate" in imported
