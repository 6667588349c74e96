"""Nothing is lost on Ctrl-C: the outputs are finished first. The JSON document replaces a file only when finished; the
JSONL stream is written as the run goes, so it can be followed and a killed run leaves a prefix that parses.

A real `python -m llmtrace generate` gets a real SIGINT (or SIGKILL) halfway through a 2,000-token run. In-process runs (the
session's model, a few tokens) place the Ctrl-C at the awkward moments: while the run's first events are written,
while the summary is written. The model cache is checked the same way: a conversion cut short leaves nothing that
could be taken for a whole one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"


def read_jsonl(path: Path) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines, f"{path} is empty"
    return [json.loads(line) for line in lines]  # every line is valid JSON on its own


def check_interrupted_trace(events: list[dict]) -> dict:
    """The stream is whole: run, tokens, consecutive steps, and a summary that says it was interrupted."""
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["run", "tokens"] and kinds[-1] == "summary" and kinds.count("summary") == 1
    summary = events[-1]
    assert summary["interrupted"] is True and summary["stop_reason"] == "interrupted"
    steps = [e for e in events if e["event"] == "step"]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert summary["tokens"] == [s["token"]["id"] for s in steps]
    assert summary["generated_tokens"] == len(steps)
    return summary


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") or "partial" in p.name)


@pytest.fixture(autouse=True)
def sigint_raises_keyboard_interrupt():
    """Python installs its Ctrl-C handler only when SIGINT is not ignored at start-up, and a test run started as a
    background job (a CI script run with `&`, nohup) inherits it ignored. The in-process tests here need the handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def wait_for(predicate, timeout: float, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"llmtrace ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def complete_lines(path: Path) -> list[dict]:
    """The events of the complete lines of a stream that may still be growing (or was cut): each must parse."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def count_steps(path: Path) -> int:
    return sum(e["event"] == "step" for e in complete_lines(path))


def start(argv: list[str], out_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LLMTRACE_DEBUG"} | {"PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "llmtrace", "generate", PROMPT, "-n", "2000", "--ignore-eos", "--device", "cpu",
           "--threads", "1", *argv]
    # Files, not pipes, for stdout and stderr: a pipe nobody reads would block the run's last writes. SIGINT gets its
    # default disposition back in the child: a shell starts background jobs (a CI script run with `&`, nohup) with
    # SIGINT ignored, the child would inherit that, and Python then never raises KeyboardInterrupt.
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(out_dir / "stdout.txt", "w"),
                            stderr=open(out_dir / "stderr.txt", "w"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


# ----------------------------------------------------------------------------------------------------------------
# a real process, a real SIGINT


@pytest.mark.slow
def test_sigint_during_generation_finishes_every_output(smollm_path, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    jsonl, doc = out / "run.jsonl", out / "run.json"
    doc.write_text("OLD\n")  # replaced only by a finished document (--force: llmtrace did not write it)
    proc = start(["--jsonl", str(jsonl), "--json", str(doc), "--force"], tmp_path)
    try:
        # the stream can be followed at its own name while the run goes on; the document waits for the end
        wait_for(lambda: count_steps(jsonl) >= 3, 300, proc, "three steps in the stream")
        assert proc.poll() is None and doc.read_text() == "OLD\n"
        assert [e["event"] for e in complete_lines(jsonl)[:2]] == ["run", "tokens"]
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    stdout = (tmp_path / "stdout.txt").read_text()
    assert rc == 130, stderr
    assert stderr == "error: interrupted\n"
    # the terminal view ends with the summary
    tail = " ".join(" ".join(stdout.splitlines()[-6:]).split())  # the view wraps long lines
    assert "stop: interrupted (Ctrl-C) · TTFT" in tail and tail.count("interrupted") == 1 and tail.endswith("more"), tail
    events = read_jsonl(jsonl)
    summary = check_interrupted_trace(events)
    assert 3 <= summary["generated_tokens"] < 2000
    # the JSON document is complete (it could also have been absent, but never partial) and holds the same events
    document = json.loads(doc.read_text())
    assert document["schema"] == "llmtrace.trace/1" and document["events"] == events
    assert leftovers(out) == []


@pytest.mark.slow
def test_sigkill_leaves_a_stream_whose_complete_lines_parse(smollm_path, tmp_path, capsys):
    """A run killed outright (no chance to clean up) leaves the stream up to its last step; `show` renders it."""
    out = tmp_path / "out"
    out.mkdir()
    jsonl = out / "run.jsonl"
    proc = start(["--jsonl", str(jsonl), "--trace", "layers", "--layers", "0,-1"], tmp_path)
    try:
        wait_for(lambda: count_steps(jsonl) >= 3, 300, proc, "three steps in the stream")
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = complete_lines(jsonl)
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["run", "tokens"] and "summary" not in kinds
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) >= 3 and [s["step"] for s in steps] == list(range(len(steps)))
    assert {e["layer"] for e in events if e["event"] == "tensor" and e["step"] == 1} == {None, 0, 29}
    assert leftovers(out) == []
    code, _, err = run_cli(capsys, "show", jsonl)
    assert code == 0 and "error" not in err


@pytest.mark.slow
def test_sigint_with_jsonl_on_stdout(smollm_path, tmp_path):
    proc = start(["--jsonl", "-", "--trace", "none"], tmp_path)
    stdout = tmp_path / "stdout.txt"
    try:
        wait_for(lambda: stdout.read_text().count('"event":"step"') >= 3, 300, proc, "three steps")
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130 and (tmp_path / "stderr.txt").read_text() == "error: interrupted\n"
    check_interrupted_trace(read_jsonl(stdout))


# ----------------------------------------------------------------------------------------------------------------
# the stream as a reader sees it


@pytest.mark.slow
def test_each_write_is_whole_lines_and_a_step_is_out_when_it_ends(capsys, monkeypatch, real_model, tmp_path):
    """Every write call carries whole lines; a pass's tensor events go out with its step event, before the next
    forward pass begins. So a reader following the file sees each step as it ends, and never half a line."""
    import llmtrace.trace.writers as writers

    target = tmp_path / "t.jsonl"
    writes: list[bytes] = []
    on_disk_at_forward: list[int] = []
    write = os.write

    def recording_write(fd, data):
        writes.append(bytes(data))
        return write(fd, data)

    forward = real_model.model.forward

    def observed_forward(*args, **kwargs):
        on_disk_at_forward.append(len(complete_lines(target)))
        return forward(*args, **kwargs)

    monkeypatch.setattr(writers.os, "write", recording_write)
    monkeypatch.setattr(real_model.model, "forward", observed_forward)
    code, _, err = run_cli(capsys, "generate", PROMPT, "-n", "3", "--ignore-eos", "--trace", "layers", "--layers", "0",
                        "--jsonl", target)
    assert code == 0, err
    assert all(w.endswith(b"\n") for w in writes) and b"".join(writes) == target.read_bytes()
    events = read_jsonl(target)
    steps = [i for i, e in enumerate(events) if e["event"] == "step"]
    # before each decode pass, everything up to the previous step is on disk
    assert on_disk_at_forward[1:] == [i + 1 for i in steps[:-1]]
    # one write per step: the step's tensor events and the step event together
    assert sum(w.count(b'"event":"step"') for w in writes) == len(steps) == 3
    assert all(w.count(b'"event":"step"') <= 1 for w in writes)


# ----------------------------------------------------------------------------------------------------------------
# in process: Ctrl-C at the awkward moments


@pytest.fixture
def real_model(monkeypatch, smollm):
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", lambda *a, **k: smollm)
    monkeypatch.setattr("llmtrace.checkpoint.devices.set_threads", lambda n: torch.get_num_threads())
    return smollm


def sigint_on_event(monkeypatch, kind: str) -> None:
    """Deliver a real SIGINT to this process while the JSONL sink writes the first event of this kind."""
    from llmtrace.trace.writers import JsonlWriter

    write = JsonlWriter.__call__
    sent = []

    def call(self, event):
        if event["event"] == kind and not sent:
            sent.append(kind)
            signal.raise_signal(signal.SIGINT)
        write(self, event)

    monkeypatch.setattr(JsonlWriter, "__call__", call)


def test_ctrl_c_in_a_forward_pass(capsys, monkeypatch, real_model, tmp_path):
    forward = real_model.model.forward
    calls = []

    def interrupted_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the prefill and two decode steps are done
            signal.raise_signal(signal.SIGINT)
        return forward(*args, **kwargs)

    monkeypatch.setattr(real_model.model, "forward", interrupted_forward)
    code, _, err = run_cli(capsys, "generate", PROMPT, "-n", "20", "--ignore-eos", "--jsonl", tmp_path / "t.jsonl",
                        "--json", tmp_path / "t.json")
    assert code == 130 and err == "error: interrupted\n"
    events = read_jsonl(tmp_path / "t.jsonl")
    assert check_interrupted_trace(events)["generated_tokens"] == 3
    assert json.loads((tmp_path / "t.json").read_text())["events"] == events
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_ctrl_c_while_the_run_starts_still_gives_a_whole_stream(capsys, monkeypatch, real_model, tmp_path):
    """The run and tokens events are written whole; the Ctrl-C is taken after them and the summary follows."""
    sigint_on_event(monkeypatch, "run")
    code, _, err = run_cli(capsys, "generate", PROMPT, "-n", "20", "--jsonl", tmp_path / "t.jsonl")
    assert code == 130 and err == "error: interrupted\n"
    events = read_jsonl(tmp_path / "t.jsonl")
    assert [e["event"] for e in events] == ["run", "tokens", "summary"]
    assert check_interrupted_trace(events)["generated_tokens"] == 0


@pytest.mark.slow
def test_ctrl_c_while_the_summary_is_written(capsys, monkeypatch, real_model, tmp_path):
    """The summary is finished first. The run had ended, so the stream says so; the document is not started."""
    doc = tmp_path / "t.json"
    doc.write_text("OLD\n")
    sigint_on_event(monkeypatch, "summary")
    code, _, err = run_cli(capsys, "generate", PROMPT, "-n", "3", "--jsonl", tmp_path / "t.jsonl", "--json", doc,
                           "--force")
    assert code == 130 and err == "error: interrupted\n"
    events = read_jsonl(tmp_path / "t.jsonl")
    assert events[-1]["event"] == "summary" and events[-1]["generated_tokens"] == 3
    assert doc.read_text() == "OLD\n"  # absent, never partial: the old file is still there
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_ctrl_c_while_the_document_is_renamed(capsys, monkeypatch, real_model, tmp_path):
    """fsync and rename run with Ctrl-C held: the document lands whole, then the run ends with 130."""
    import llmtrace.fsutil as fsutil

    fsync = os.fsync
    sent = []

    def interrupted_fsync(fd):
        if not sent:
            sent.append(1)
            signal.raise_signal(signal.SIGINT)
        fsync(fd)

    monkeypatch.setattr(fsutil.os, "fsync", interrupted_fsync)
    code, _, err = run_cli(capsys, "generate", PROMPT, "-n", "3", "--json", tmp_path / "t.json")
    assert sent and code == 130 and err == "error: interrupted\n"
    assert json.loads((tmp_path / "t.json").read_text())["events"][-1]["event"] == "summary"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("command", ["generate", "explain", "lens"])
def test_ctrl_c_during_the_load_keeps_the_users_files(capsys, monkeypatch, tmp_path, command):
    """A real SIGINT while the model loads: the run has nothing to write yet, so an existing --jsonl file is kept as it
    was (as --json's is), and none is created where there was none."""
    def interrupted_load(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        pytest.fail("SIGINT did not interrupt the load")

    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", interrupted_load)
    (tmp_path / "t.jsonl").write_text("OLD\n")
    (tmp_path / "t.json").write_text("OLD\n")
    code, _, err = run_cli(capsys, command, PROMPT, "--jsonl", tmp_path / "t.jsonl", "--json", tmp_path / "t.json",
                           "--force")
    assert code == 130 and err == "error: interrupted\n"
    assert (tmp_path / "t.jsonl").read_text() == "OLD\n" and (tmp_path / "t.json").read_text() == "OLD\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.jsonl"]
    code, _, err = run_cli(capsys, command, PROMPT, "--jsonl", tmp_path / "new.jsonl")
    assert code == 130 and not (tmp_path / "new.jsonl").exists()


@pytest.mark.parametrize("command", ["generate", "explain", "lens"])
def test_ctrl_c_during_the_load_with_the_stream_on_stdout(capsys, monkeypatch, command):
    """On stdout the stream still ends: it is one summary, interrupted, of a run that had not begun."""
    def interrupted_load(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", interrupted_load)
    code, out, _ = run_cli(capsys, command, PROMPT, "--jsonl", "-")
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 130 and [e["event"] for e in events] == ["summary"]
    assert events[0]["interrupted"] is True and events[0]["prompt_tokens"] == 0
    assert events[0].get("command", "generate") == command


def test_an_error_before_the_run_leaves_no_stream(capsys, monkeypatch, tmp_path):
    """The stream's file is created by its first event: a command that fails before its run starts (here, in the
    load) writes nothing."""
    from llmtrace.errors import LlmtraceError

    def failed_load(*args, **kwargs):
        raise LlmtraceError("no such model")

    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", failed_load)
    code, _, err = run_cli(capsys, "generate", PROMPT, "--jsonl", tmp_path / "t.jsonl")
    assert code == 1 and err == "error: no such model\n"
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------------------------
# the model cache


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    from tiny import TinySpec, make_hf_model, write_gguf

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, make_hf_model(TinySpec()))
    return path


def test_a_conversion_cut_short_leaves_nothing_behind(monkeypatch, tiny_gguf, tmp_path):
    from llmtrace.checkpoint import conversion
    from llmtrace.registry.cache import converted_dir
    from llmtrace.checkpoint.load import load_model

    save_file = conversion.write_safetensors

    def half_then_ctrl_c(plan, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\0" * 1000)  # half a file on disk, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "write_safetensors", half_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(tiny_gguf), device="cpu")
    cache = converted_dir(tiny_gguf).parent
    assert not cache.exists() or list(cache.iterdir()) == []

    monkeypatch.setattr(conversion, "write_safetensors", save_file)
    lm = load_model(str(tiny_gguf), device="cpu")
    assert lm.converted and [p.name for p in cache.iterdir()] == [converted_dir(tiny_gguf).name]


def test_a_damaged_cache_entry_is_never_used(tiny_gguf):
    from llmtrace.errors import LlmtraceError
    from llmtrace.registry.cache import converted_dir
    from llmtrace.checkpoint.load import load_model

    first = load_model(str(tiny_gguf), device="cpu")
    weights = converted_dir(tiny_gguf) / "weights.safetensors"
    damaged = weights.with_name("damaged")  # a new file: `first` still maps the old one
    damaged.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    damaged.replace(weights)
    with pytest.raises(LlmtraceError, match="unreadable .* removed; run the command again"):
        load_model(str(tiny_gguf), device="cpu")
    assert not converted_dir(tiny_gguf).exists()
    again = load_model(str(tiny_gguf), device="cpu")
    assert again.converted
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(again.model(ids), first.model(ids), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# a real SIGINT while the command starts (llmtrace/sigint.py)


def start_traced_imports(argv: list[str], out_dir: Path) -> subprocess.Popen:
    """`python -X importtime -m llmtrace generate …`: stderr names each module as its import ends, so the test can
    place a SIGINT at a known point of the start-up, whatever the machine's speed."""
    env = {k: v for k, v in os.environ.items() if k != "LLMTRACE_DEBUG"} | {"PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-X", "importtime", "-m", "llmtrace", "generate", PROMPT, "-n", "2000", "--ignore-eos",
           "--device", "cpu", "--threads", "1", *argv]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(out_dir / "stdout.txt", "w"),
                            stderr=open(out_dir / "stderr.txt", "w"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def imported(out_dir: Path, module: str) -> bool:
    text = (out_dir / "stderr.txt").read_text(errors="replace")
    return any(line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == module
               for line in text.splitlines())


def check_interrupted_stream(path: Path, old: str = "OLD\n") -> dict:
    """The stream of a run stopped at any moment: every line parses, the last is the only summary, interrupted. A
    run stopped before it began left the user's file as it was (`old`); one stopped later is whole up to it."""
    if path.read_text() == old:
        return {"generated_tokens": 0}
    return check_interrupted_trace(read_jsonl(path))


# The points of the start-up, each a module whose import has just ended, and a further delay after it (seconds).
# llmtrace.sigint: the entry point's first line. numpy.version: inside `import numpy`, which torch's C++ start-up
# runs inside `import torch` and whose KeyboardInterrupt it used to swallow (the run then generated every token).
START_POINTS = [
    ("llmtrace.sigint", 0.0),
    ("typer", 0.0),
    ("numpy.version", 0.0),
    ("torch._utils_internal", 0.0),
    ("llmtrace.sigint", 1.0),
    ("llmtrace.sigint", 2.5),
]


@pytest.mark.slow
@pytest.mark.parametrize("module,delay", START_POINTS, ids=[f"{m}+{d}s" for m, d in START_POINTS])
def test_sigint_at_any_moment_of_the_start_up_ends_the_stream_with_a_summary(smollm_path, tmp_path, module, delay):
    out = tmp_path / "out"
    out.mkdir()
    jsonl = out / "run.jsonl"
    jsonl.write_text("OLD\n")
    proc = start_traced_imports(["--jsonl", str(jsonl), "--force"], tmp_path)
    try:
        wait_for(lambda: imported(tmp_path, module), 300, proc, f"the import of {module}")
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = [line for line in (tmp_path / "stderr.txt").read_text().splitlines() if not line.startswith("import time:")]
    assert rc == 130, stderr
    assert stderr == ["error: interrupted"]
    summary = check_interrupted_stream(jsonl)
    assert summary["generated_tokens"] < 2000
    assert leftovers(out) == []


@pytest.mark.slow
def test_sigint_during_import_torch_without_jsonl(smollm_path, tmp_path):
    proc = start_traced_imports(["--trace", "none"], tmp_path)
    try:
        wait_for(lambda: imported(tmp_path, "numpy.version"), 300, proc, "the import of numpy")
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = [line for line in (tmp_path / "stderr.txt").read_text().splitlines() if not line.startswith("import time:")]
    assert rc == 130 and stderr == ["error: interrupted"]
    assert (tmp_path / "stdout.txt").read_text() == ""  # stopped before the run: nothing generated


# ----------------------------------------------------------------------------------------------------------------
# explain and lens keep generate's contract


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers import SPEC, save_hf
    from tiny import make_hf_model

    return save_hf(tmp_path_factory.mktemp("tiny") / "m", make_hf_model(SPEC))


def capture_seeing(monkeypatch, path: Path, interrupt: bool) -> list[str]:
    """Replace the forward pass explain and lens take apart by one that first notes what the --jsonl file holds, then
    runs, or is interrupted by a real SIGINT."""
    import llmtrace.run.explain as explain

    real_capture, seen = explain.capture, []

    def capture(*args, **kwargs):
        seen.append(path.read_text() if path.exists() else "")
        if interrupt:
            signal.raise_signal(signal.SIGINT)
            pytest.fail("SIGINT did not interrupt the pass")
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(explain, "capture", capture)
    return seen


@pytest.mark.parametrize("command", ["explain", "lens"])
def test_explain_and_lens_stream_as_the_pass_goes_and_end_with_a_summary(capsys, monkeypatch, tiny_dir, tmp_path,
                                                                          command):
    stream = tmp_path / "t.jsonl"
    stream.write_text("OLD\n")
    seen = capture_seeing(monkeypatch, stream, interrupt=False)
    code, out, err = run_cli(capsys, command, "The lazy dog", "-m", tiny_dir, "--jsonl", stream, "--json",
                             tmp_path / "t.json", "--force")
    assert code == 0, err
    # before the pass ran, the file held the header and the prompt's tokens already (the old content was gone)
    assert [json.loads(line)["event"] for line in seen[0].splitlines()] == ["explain", "tokens"]
    events = read_jsonl(stream)
    assert events[0]["command"] == command and events[-1] == {"event": "summary", "command": command,
                                                               "prompt_tokens": events[1]["count"],
                                                               "interrupted": False}
    assert [e["event"] for e in events].count("summary") == 1
    assert json.loads((tmp_path / "t.json").read_text())["events"] == events  # the document holds the same
    code, shown, err = run_cli(capsys, "show", stream)
    assert code == 0 and err == "" and shown == out


@pytest.mark.parametrize("command", ["explain", "lens"])
def test_ctrl_c_in_the_pass_of_explain_and_lens_ends_the_stream_with_an_interrupted_summary(
        capsys, monkeypatch, tiny_dir, tmp_path, command):
    stream, doc = tmp_path / "t.jsonl", tmp_path / "t.json"
    capture_seeing(monkeypatch, stream, interrupt=True)
    code, out, err = run_cli(capsys, command, "The lazy dog", "-m", tiny_dir, "--jsonl", stream, "--json", doc,
                             "--html", tmp_path / "t.html")
    assert code == 130 and err == "error: interrupted\n"
    events = read_jsonl(stream)
    assert [e["event"] for e in events] == ["explain", "tokens", "summary"]
    assert events[-1]["interrupted"] is True and events[-1]["command"] == command
    assert json.loads(doc.read_text())["events"] == events  # the document is whole, and says so too
    assert not (tmp_path / "t.html").exists()  # no page of a pass that was not taken apart
    assert f"the {command} run was interrupted (Ctrl-C) before its pass was taken apart" in " ".join(out.split())
    code, shown, err = run_cli(capsys, "show", stream)
    assert code == 0 and err == "" and shown == out


def test_a_conversion_an_older_llmtrace_wrote_is_converted_again(tiny_gguf, capsys):
    """A cached conversion whose config names a field ModelConfig no longer has (an older llmtrace wrote it): the
    load converts the GGUF again, says so on stderr, and runs as a fresh conversion does."""
    import json

    from llmtrace.checkpoint.load import load_model
    from llmtrace.registry.cache import converted_dir

    first = load_model(str(tiny_gguf), device="cpu")
    path = converted_dir(tiny_gguf) / "llmtrace_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"linear_attn": None}))
    again = load_model(str(tiny_gguf), device="cpu")
    assert again.converted and "written by an older llmtrace (its config has linear_attn)" in capsys.readouterr().err
    assert "linear_attn" not in json.loads(path.read_text())
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(again.model(ids), first.model(ids), rtol=0, atol=0)
