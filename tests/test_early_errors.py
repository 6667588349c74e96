"""Values that need no model are refused before `import torch` (seconds) and the load, on every command; the
library's errors name the Python keyword, the CLI's the flag (issues 30 and 31)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import llmtrace
from llmtrace.errors import BadValue, LlmtraceError, UsageError

# (argv, exit code, fragments of the one error line): each is refused without torch being imported
EARLY = [
    (["generate", "hi", "--dtype", "int8"], 2, ("--dtype 'int8' is unknown",)),
    (["generate", "hi", "--ban", ""], 2, ("--ban", "non-empty")),
    (["generate", "hi", "--stop", ""], 2, ("--stop", "non-empty")),
    (["generate", "hi", "--max-batch", "0"], 2, ("--max-batch must be ≥ 1",)),
    (["generate", "hi", "--trace", "bogus"], 2, ("--trace must be one of",)),
    (["generate", "hi", "--fast", "--keep-quantized"], 2, ("--fast and --keep-quantized do not combine",)),
    (["generate", "hi", "--threads", "0"], 2, ("--threads must be ≥ 1",)),
    (["generate", "hi", "--fast", "--dtype", "float32"], 2, ("--fast computes in bfloat16", "--dtype float32")),
    (["generate", "hi", "--device", "gpu"], 2, ("--device 'gpu' is unknown",)),
    (["generate", "hi", "--device", "cuda:x"], 2, ("--device 'cuda:x' is malformed",)),
    (["generate", "hi", "--device-map", "balanced"], 2, ("unknown --device-map 'balanced'",)),
    (["generate", "hi", "--max-memory", "cpu20GiB"], 2, ("bad --max-memory", "DEVICE=SIZE")),
    (["generate", "hi", "--offload-dir", "x"], 2, ("--offload-dir applies with --device-map auto",)),
    (["generate", "hi", "--device", "cpu", "--device-map", "auto"], 2, ("--device and --device-map",)),
    (["generate", "hi", "--temperature", "-1"], 2, ("--temperature must be >= 0",)),
    (["generate", "hi", "--sampler-order", "top_k,nope"], 2, ("--sampler-order", "'nope'")),
    (["generate", "hi", "--json", "/proc/x.json"], 1, ("/proc", "not writable", "takes no new files")),
    (["explain", "hi", "--dtype", "int8"], 2, ("--dtype 'int8'",)),
    (["lens", "hi", "--threads", "0"], 2, ("--threads must be ≥ 1",)),
    (["lens", "hi", "--fast", "--device-map", "auto"], 2, ("--fast and --device-map",)),
    (["patch", "--clean", "a", "--corrupt", "b", "--answer", "x", "--against", "y", "--html", "/proc/x.html"], 1,
     ("/proc", "not writable")),
    (["patch", "--clean", "a", "--corrupt", "b", "--answer", "x", "--against", "y", "--at", "bogus"], 2,
     ("--at 'bogus'",)),
    (["patch", "--clean", "a", "--corrupt", "b", "--answer", "x", "--against", "y", "--dtype", "int8"], 2,
     ("--dtype 'int8'",)),
    (["compare", "hi", "--b-dtype", "int8"], 2, ("--b-dtype 'int8' is unknown",)),
    (["compare", "hi", "--b-fast", "--b-dtype", "float32"], 2, ("--b-fast computes in bfloat16", "--b-dtype")),
    (["compare", "hi", "--b-dtype", "bf16", "--threads", "0"], 2, ("--threads must be ≥ 1",)),
]

RUNNER = """
import contextlib, io, json, sys
from llmtrace.cli.main import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out.append({"code": code, "err": err.getvalue(), "torch": "torch" in sys.modules})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def early(tmp_path_factory):
    """Every case of EARLY, run in one fresh interpreter (one after the other: torch, once imported, would stay)."""
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("LLMTRACE_DEBUG", "LLMTRACE_THREADS")}
    env |= {"LLMTRACE_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([argv for argv, _, _ in EARLY])],
                          capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("i", range(len(EARLY)), ids=[" ".join(a)[:60] for a, _, _ in EARLY])
def test_a_value_that_needs_no_model_is_refused_before_torch_is_imported(early, i):
    argv, code, says = EARLY[i]
    got = early[i]
    lines = got["err"].splitlines()
    assert got["code"] == code and len(lines) == 1 and lines[0].startswith("error: "), got
    for fragment in says:
        assert fragment in lines[0], (fragment, lines[0])
    assert not got["torch"], f"torch was imported before {argv} was refused"


@pytest.mark.parametrize("call, says", [
    (lambda: llmtrace.load(fast=True, keep_quantized=True), "fast and keep_quantized do not combine"),
    (lambda: llmtrace.load(fast=True, dtype="float32"), "fast computes in bfloat16; leave out dtype float32"),
    (lambda: llmtrace.load(device="cpu", device_map="auto"), "device and device_map both place the model"),
    (lambda: llmtrace.load(dtype="int8"), "dtype 'int8' is unknown"),
    (lambda: llmtrace.load(threads=0), "threads must be ≥ 1"),
    (lambda: llmtrace.load(max_memory=["cpu20GiB"]), "bad max_memory 'cpu20GiB'"),
    (lambda: llmtrace.load(offload_dir="x"), "offload_dir applies with device_map auto"),
    (lambda: llmtrace.GenerateOptions.of(trace="bogus"), "trace must be one of"),
    (lambda: llmtrace.GenerateOptions.of(sampler_order="top_k,nope"), "sampler_order: unknown sampler stage"),
    (lambda: llmtrace.GenerateOptions.of(ban=[""]), "ban needs a non-empty text"),
    (lambda: llmtrace.GenerateOptions.of(stop=[""]), "stop needs a non-empty text"),
    (lambda: llmtrace.GenerateOptions.of(dry_sequence_breakers=[""]), "dry_sequence_breakers must be a non-empty"),
    (lambda: llmtrace.GenerateOptions.of(temprature=0), "unknown keyword 'temprature'"),
])
def test_the_library_names_the_keyword_the_caller_used(call, says):
    with pytest.raises(LlmtraceError) as info:
        call()
    assert says in str(info.value) and "--" not in str(info.value)
    assert isinstance(info.value, UsageError)


def test_a_model_generate_with_a_bad_trace_names_trace(tmp_path):
    """`model.generate("Hi", trace="bogus")` names the keyword the caller used (it said `level`), before any run."""
    model = llmtrace.Model.__new__(llmtrace.Model)  # no model is needed: the options are refused first
    with pytest.raises(BadValue) as info:
        model.generate("Hi", trace="bogus")
    assert info.value.field == "trace" and str(info.value).startswith("trace must be one of none, steps")


def test_sampler_settings_live_in_one_config_checked_once(monkeypatch):
    """GenerateOptions holds a SamplerConfig made once from the keywords; its ranges are checked when it is made, and
    a Sampler (one per batch row) checks only the ids against the vocabulary."""
    from llmtrace.run import sampler as sampler_module

    checks = []
    real = sampler_module.SamplerConfig._check_ranges
    monkeypatch.setattr(sampler_module.SamplerConfig, "_check_ranges", lambda self: (checks.append(1), real(self)))
    options = llmtrace.GenerateOptions.of(temperature=0.7, top_k=40, logit_bias=["3=-1.5"], sampler_order="llama.cpp")
    assert options.sampler.temperature == 0.7 and options.sampler.logit_bias == {3: -1.5}
    assert options.sampler.order[0] == "logit_bias" and len(checks) == 1
    s = sampler_module.Sampler(options.sampler, 10)
    rows = [s.with_seed(s.seed + r) for r in range(3)]
    assert len(checks) == 1 and [r.config.seed for r in rows] == [s.seed, s.seed + 1, s.seed + 2]
    with pytest.raises(BadValue, match="outside the vocabulary"):
        sampler_module.Sampler(options.sampler, 3)


def test_the_sampling_record_has_every_field_of_the_config():
    from dataclasses import fields

    from llmtrace.run.sampler import SamplerConfig

    cfg = SamplerConfig(logit_bias={3: 1.0}, ban=[[1, 2]], seed=5)
    record = cfg.to_dict()
    assert [f.name for f in fields(cfg)] == list(record)[: len(fields(cfg))]
    assert record["logit_bias"] == {"3": 1.0} and record["ban"] == [[1, 2]] and record["seed"] == 5
    json.dumps(record)


def test_exit_codes_of_usage_errors_are_2_and_the_messages_say_what_is_true(capsys, tmp_path):
    from helpers import fails

    empty = tmp_path / "prompts.txt"
    empty.write_bytes(b"")
    fails(capsys, 2, "generate", "--prompts", empty, says=("prompts file", "is empty"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    line = fails(capsys, 1, "tokenize", "hi", "-m", gguf, says=("model.gguf", "is empty (0 bytes)"))
    assert "does not start with" not in line


def test_an_empty_gguf_is_said_to_be_empty_by_the_resolver(tmp_path):
    from llmtrace.registry.resolve import resolve

    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(LlmtraceError, match=r"is empty \(0 bytes\)"):
        resolve(str(tmp_path / "m.gguf"))
    (tmp_path / "n.gguf").write_bytes(b"GGU")  # a short file is not empty: it does not start with GGUF
    with pytest.raises(LlmtraceError, match="does not start with the bytes 'GGUF'"):
        resolve(str(tmp_path / "n.gguf"))


def test_generate_returns_its_notes_instead_of_printing_them(tiny_lm, capsys):
    """-n cut short by the context window: the note is in the trace's `notes` (and prepare_generate's, before the
    run), and nothing reaches stderr from the library."""
    model = llmtrace.Model(tiny_lm)
    ctx = tiny_lm.config.max_seq_len
    prompt = "a" * (ctx - 3)  # one token a character in the tiny byte-level vocabulary: 3 slots left
    assert len(tiny_lm.tokenizer.encode(prompt)) == ctx - 3
    capsys.readouterr()
    prepared = model.prepare_generate(prompt, llmtrace.GenerateOptions.of(max_new_tokens=8, trace="none"))
    assert len(prepared.notes) == 1 and "3 tokens fit, not 8" in prepared.notes[0]
    trace = prepared.run()
    assert trace.notes == prepared.notes and len(trace.tokens) == 3
    assert model.generate(prompt, max_new_tokens=8, trace="none").notes == prepared.notes
    assert capsys.readouterr().err == ""


def test_the_shared_flag_groups_are_declared_once_and_spread_into_each_command():
    """generate, explain and lens take the load, intervention and prompt flags from one declaration each
    (cli/options.py, cli/batch_input.py); patch takes the one-device load flags."""
    from dataclasses import fields

    import typer.main

    from llmtrace.cli.app import app
    from llmtrace.cli.batch_input import PromptFlags
    from llmtrace.cli.options import InterventionFlags, LoadFlags, OneDeviceLoadFlags
    import llmtrace.cli.main  # noqa: F401  (registers the commands)

    click_app = typer.main.get_command(app)
    for name in ("generate", "explain", "lens", "patch"):
        params = {p.name for p in click_app.commands[name].params}
        groups = (OneDeviceLoadFlags,) if name == "patch" else (LoadFlags, InterventionFlags, PromptFlags)
        for group in groups:
            assert {f.name for f in fields(group) if f.init} <= params, (name, group.__name__)
    sources = "\n".join(p.read_text() for p in (Path(llmtrace.__file__).parent / "cli").glob("*.py"))
    for alias in ("DeviceMapOpt", "MaxMemoryOpt", "OffloadDirOpt", "AblateOpt", "ControlVectorOpt", "PromptsOpt"):
        uses = sources.count(f": {alias} =")
        assert uses == 1, f"{alias} is a parameter {uses} times in cli/: declare it in its flag group only"
