"""Bad input through the real command line (`python -m llmtrace generate ...` in a subprocess): every case must end
with exactly one stderr line starting `error:`, no traceback, and exit status 1.

Cases: a damaged vocabulary (one byte of the real GGUF's tokens, merges, token types or BOS id; a tokenizer.json whose
merge names a missing token or whose added token is past the model's rows) and a chat template that raises. Two
controls show that the untouched files do load. Missing paths, unsupported architectures, truncated checkpoints and
prompts too long are test_bad_input's (in this process); random cuts and flips of every file are test_fuzz's.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import assert_no_conversion_left, assert_one_line_error
from tiny import TinySpec, write_gguf, write_hf_dir

RUNTIME_ERROR = 1


def run_generate(home, model, prompt="hi", *extra):
    env = {k: v for k, v in os.environ.items() if k != "LLMTRACE_DEBUG"}
    env.update(LLMTRACE_HOME=str(home), HF_HUB_OFFLINE="1", LLMTRACE_THREADS="1", NO_COLOR="1")
    argv = [sys.executable, "-m", "llmtrace", "generate", prompt, "-m", str(model), "-n", "1", *extra]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)


def assert_load_failed(proc, *needles):
    """Exit 1, stderr exactly one line `error: ...` holding every needle, no traceback, nothing on stdout."""
    assert proc.returncode == RUNTIME_ERROR, (proc.returncode, proc.stderr)
    assert_one_line_error(proc.stderr, *needles)
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny HF directory and a tiny GGUF of the same model, both loadable."""
    root = tmp_path_factory.mktemp("good")
    hf = write_hf_dir(root / "hf", TinySpec(seed=40))
    write_gguf(root / "tiny.gguf", hf)
    return root


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


def truncated_copy(src, dest, size):
    with open(src, "rb") as f, open(dest, "wb") as g:
        g.write(f.read(size))
    assert dest.stat().st_size == size
    return dest


# ----------------------------------------------------------------------------------------------------------------
# controls: the files the broken ones are made from do load and generate


def test_control_hf_dir_runs(files, home):
    proc = run_generate(home, files / "hf", "hello", "--trace", "none")
    assert proc.returncode == 0, proc.stderr
    assert "error" not in proc.stderr


def test_control_gguf_runs(files, home):
    proc = run_generate(home, files / "tiny.gguf", "hello", "--trace", "none")
    assert proc.returncode == 0, proc.stderr
    assert list((home / "converted").rglob("llmtrace_config.json"))  # it was converted and cached


# ----------------------------------------------------------------------------------------------------------------
# a damaged vocabulary or chat template: the tokenizers and jinja2 libraries' own exceptions never reach the user


def gguf_string_at(data, key: bytes, text: bytes) -> int:
    """Offset of the first byte of the GGUF string `text` stored after `key` (a token, a merge)."""
    return data.index(len(text).to_bytes(8, "little") + text, data.index(key)) + 8


def gguf_array_item_at(data, key: bytes, index: int, size: int) -> int:
    """Offset of item `index` of a numeric array value (after the key: value type, item type, count)."""
    return data.index(key) + len(key) + 4 + 4 + 8 + size * index


def gguf_scalar_at(data, key: bytes) -> int:
    return data.index(key) + len(key) + 4


@pytest.fixture(scope="module")
def real_gguf_bytes(smollm_path):
    return smollm_path.read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, message",
    [
        ("token", "tokenizer.ggml.merges: merge 847 'v es' makes 'ves', which is not in the vocabulary"),
        ("duplicate", "token 'ver' appears twice in tokenizer.ggml.tokens (ids 331 and 1099)"),
        ("merge", r"tokenizer.ggml.merges: merge 847 'v e\x7f' names 'eġ', which is not in the vocabulary"),
        ("type", "token 1099 ('ves') has type 9 in tokenizer.ggml.token_type"),
        ("bos", "tokenizer.ggml.bos_token_id = 1048577 is not a token id (ids are 0..49151)"),
    ],
)
def test_damaged_vocabulary_of_real_gguf(real_gguf_bytes, tmp_path, home, where, message):
    """One byte of the real SmolLM2 GGUF, inside its vocabulary: exit 1 with one line naming the file and what is
    inconsistent (the tokenizers library's 'Token `ves` out of vocabulary' traceback before)."""
    data = bytearray(real_gguf_bytes)
    at, mask = {
        "token": (gguf_string_at(data, b"tokenizer.ggml.tokens", b"ves"), 0x01),  # 'ves' -> 'wes'
        "duplicate": (gguf_string_at(data, b"tokenizer.ggml.tokens", b"ves") + 2, 0x01),  # 'ves' -> 'ver', id 331
        "merge": (gguf_string_at(data, b"tokenizer.ggml.merges", b"v es") + 3, 0x0C),  # 's' -> DEL
        "type": (gguf_array_item_at(data, b"tokenizer.ggml.token_type", 1099, 4), 0x08),  # 1 (normal) -> 9
        "bos": (gguf_scalar_at(data, b"tokenizer.ggml.bos_token_id") + 2, 0x10),  # 1 -> 1 + 2**20
    }[where]
    data[at] ^= mask
    path = tmp_path / "SmolLM2-damaged.gguf"
    path.write_bytes(data)
    assert_load_failed(run_generate(home, path), f"{path}: ", message)
    assert_no_conversion_left(home)


def edit_json(path, edit):
    spec = json.loads(path.read_text())
    edit(spec)
    path.write_text(json.dumps(spec))


def add_token_past_the_rows(spec):
    spec["added_tokens"].append({"id": 320, "content": "<extra>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})


@pytest.mark.parametrize(
    "edit, file, message",
    [
        (lambda s: s["model"]["merges"].insert(0, ["Ġ", "zzz"]), "tokenizer.json",
         "model.merges: merge 0 ['Ġ', 'zzz'] names 'zzz', which is not in the vocabulary"),
        (add_token_past_the_rows, "", "the tokenizer has ids up to 320 but the model has 320 token rows"),
    ],
)
def test_damaged_tokenizer_json(files, tmp_path, home, edit, file, message):
    d = tmp_path / "hf"
    shutil.copytree(files / "hf", d)
    edit_json(d / "tokenizer.json", edit)
    assert_load_failed(run_generate(home, d, "hello"), f"{d / file if file else d}: ", message)


def test_chat_template_that_raises(files, tmp_path, home):
    d = tmp_path / "hf"
    shutil.copytree(files / "hf", d)
    edit_json(d / "tokenizer_config.json", lambda c: c.update(chat_template="{{ messages[0]['content'] / 2 }}"))
    assert_load_failed(run_generate(home, d, "hello", "--chat"), f"{d}: the chat template failed on these messages",
                          "TypeError")
