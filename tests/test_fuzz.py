"""Fuzzing and properties (hypothesis).

- The real SmolLM2 tokenizer gives back any Unicode text it encoded, and the generation loop's streamed text adds up
  to the same text.
- The sampler: after every stage the probabilities sum to 1, and the token it draws never has probability zero.
- Checkpoint files cut off or corrupted at many offsets (tiny ones at random offsets, the real SmolLM2 files at chosen
  ones) give a clean LlmtraceError, or load; never another exception, never a hang. The vocabulary (a GGUF's
  tokenizer metadata, a tokenizer.json) gets flips of its own, since a flip there is what the tokenizers library
  refuses.

Every run draws the same examples (tests/conftest.py loads a derandomized profile): CI cannot pass or fail by chance.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from llmtrace.errors import LlmtraceError
from llmtrace.run.sampler import STAGES, Sampler, SamplerConfig

_BASE = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                       HealthCheck.data_too_large])


def fuzz(examples: int) -> settings:
    return settings(_BASE, max_examples=examples)


def test_examples_are_the_same_on_every_run():
    """A fixed seed per test and no example database: the outcome cannot depend on the run."""
    assert settings.default.derandomize and settings.default.database is None
    assert fuzz(10).derandomize and fuzz(10).database is None


# ----------------------------------------------------------------------------------------------------------------
# the tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    from llmtrace.checkpoint.tokenizer_only import load_tokenizer

    return load_tokenizer(str(smollm_path))


@pytest.fixture(scope="module")
def spellable(tokenizer) -> set[int]:
    """The bytes the vocabulary has a token for. SmolLM2's lacks 21 of the 256 (0x04, 0xc0, 0xf1, 0xff, ...), so text
    holding them cannot round-trip: those bytes are dropped, by transformers' tokenizer just the same."""
    from llmtrace.tokens.vocab import BYTE_TO_CHAR

    vocab = tokenizer.tok.get_vocab()
    return {b for b, c in BYTE_TO_CHAR.items() if c in vocab}


def allowed(text: str, spellable: set[int]) -> bool:
    return set(text.encode("utf-8")) <= spellable


# Any Unicode text that UTF-8 can hold (lone surrogates cannot be encoded, so no tokenizer can take them).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=80)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@fuzz(300)
@given(text=TEXT)
@example(text="")
@example(text="  leading and trailing  \n\n\t")
@example(text="你好, мир! 🤖👩‍👩‍👧 e\u0301 \u200b\ufeff\x00\x7f")
@example(text="<|im_start|>user")
@example(text="ends with a replacement character \ufffd")
def test_decode_encode_round_trips(tokenizer, spellable, text):
    assume(allowed(text, spellable))
    ids = tokenizer.encode(text, add_special_tokens=False, parse_special=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


@fuzz(100)
@given(parts=st.lists(st.one_of(TEXT, st.sampled_from(SPECIALS)), max_size=6))
def test_round_trip_with_special_tokens_parsed(tokenizer, spellable, parts):
    text = "".join(parts)
    assume(allowed(text, spellable))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


@fuzz(150)
@given(text=TEXT)
@example(text="naïve café 你好 🤖")
def test_streamed_text_adds_up_to_the_decoded_text(tokenizer, spellable, text):
    """What generate's TextStream hands out piece by piece is the whole text, once every character is complete."""
    from llmtrace.run.generate import TextStream

    assume(allowed(text, spellable))
    assume(not text.endswith("\ufffd"))  # a real U+FFFD at the end looks like an unfinished character: held back
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in tokenizer.encode(text, add_special_tokens=False, parse_special=False)]
    assert "".join(pieces) == text == stream.text


# ----------------------------------------------------------------------------------------------------------------
# the sampler


@st.composite
def sampler_cases(draw):
    vocab = draw(st.integers(2, 48))
    values = st.one_of(st.floats(-30, 30, allow_nan=False, width=32), st.sampled_from([0.0, 1.0, 5.0, -5.0]))
    logits = draw(st.lists(values, min_size=vocab, max_size=vocab))  # sampled_from gives ties
    ids = st.integers(0, vocab - 1)
    stages = list(STAGES)
    order = draw(st.one_of(st.sampled_from(["hf", "llama.cpp"]), st.permutations(stages).map(",".join)))
    config = SamplerConfig(
        temperature=draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(0.05, 5.0))),
        top_k=draw(st.one_of(st.just(0), st.integers(1, vocab + 3))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.001, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0))),
        typical_p=draw(st.one_of(st.just(1.0), st.floats(0.001, 1.0))),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.2, 3.0))),
        frequency_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
        presence_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
        logit_bias=draw(st.dictionaries(ids, st.floats(-20, 20), max_size=4)),
        ban=draw(st.lists(st.lists(ids, min_size=1, max_size=2), max_size=2)),
        seed=draw(st.integers(0, 2**32)),
    )
    from llmtrace.run.sampler import parse_order

    config.order = parse_order(order)
    history = draw(st.lists(ids, max_size=12))
    return torch.tensor(logits, dtype=torch.float32), config, history


@fuzz(400)
@given(case=sampler_cases())
def test_sampler_probabilities_sum_to_one_and_the_pick_is_possible(case):
    logits, config, history = case
    sampler = Sampler(config, logits.numel())
    stages = sampler.process(logits, history)
    survivors = [int(torch.isfinite(x).sum()) for _, x in stages]
    for (name, x), n in zip(stages, survivors):
        if n:  # every stage that leaves a token leaves a distribution
            probs = torch.softmax(x.double(), dim=-1)
            assert abs(float(probs.sum()) - 1) < 1e-9, name
    for (name, _), before, after in zip(stages[1:], survivors, survivors[1:]):
        if STAGES[name].kind == "truncate":  # truncation never adds tokens back, and never removes the last one
            assert after <= before and (after >= 1 or before == 0), (name, before, after)
    try:
        token, ledger = sampler.sample(logits, history, ledger=True)
    except LlmtraceError as e:  # only when the bans left nothing at all
        assert survivors[-1] == 0, e
        return
    final = stages[-1][1]
    assert 0 <= token < logits.numel() and torch.isfinite(final[token])
    assert float(torch.softmax(final.double(), dim=-1)[token]) > 0
    if config.greedy:
        assert final[token] == final.max()
    for record in ledger.stages:
        assert abs(record.probs_sum - 1) < 1e-5, record
        assert record.pick_prob > 0 or record.stage == "input" or record.survivors == logits.numel(), record
    assert ledger.stages[-1].pick_prob > 0


# ----------------------------------------------------------------------------------------------------------------
# damaged checkpoint files


class Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int):
    """Turn a hang into a test failure."""

    def alarm(signum, frame):
        raise Hang(f"no answer after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def load_or_clean_error(path: Path, seconds: int = 60, run: bool = True) -> str:
    """Load a (damaged) checkpoint: a clean LlmtraceError, or a model that runs. Anything else fails the test."""
    from llmtrace.checkpoint.load import load_model

    with deadline(seconds):
        try:
            lm = load_model(str(path), device="cpu", dtype="float32")
        except LlmtraceError as e:
            message = str(e)
            assert message and "\n" not in message.strip()
            return message
        if run:
            ids = lm.tokenizer.encode("The quick brown fox", add_special_tokens=False) or [0]
            logits = lm.model(torch.tensor([ids]))
            assert logits.shape == (1, len(ids), lm.config.vocab_size)
    return ""


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from tiny import TinySpec, make_hf_model, write_gguf, write_hf_dir

    root = tmp_path_factory.mktemp("fuzz")
    hf = root / "hf"
    model = write_hf_dir(hf, TinySpec())
    gguf_path = root / "tiny.gguf"
    write_gguf(gguf_path, make_hf_model(TinySpec()))
    return {"hf": hf, "safetensors": (hf / "model.safetensors").read_bytes(), "gguf": gguf_path.read_bytes(),
            "model": model}


@pytest.fixture
def fresh_home(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def damage(data: bytes, cut: int | None = None, flip: tuple[int, int] | None = None) -> bytes:
    if cut is not None:
        data = data[:cut]
    if flip is not None:
        at, mask = flip
        data = data[:at] + bytes([data[at] ^ mask]) + data[at + 1:]
    return data


_serial = iter(range(10**9))


def damaged_gguf(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / f"damaged-{next(_serial)}.gguf"  # a new name each time: a cache entry of its own
    path.write_bytes(data)
    return path


@fuzz(60)
@given(cut=st.floats(0, 1, exclude_max=True))
def test_truncated_tiny_gguf(tiny_files, tmp_path, fresh_home, cut):
    data = tiny_files["gguf"]
    assert load_or_clean_error(damaged_gguf(tmp_path, damage(data, cut=int(cut * len(data))))) != ""


@fuzz(80)
@given(at=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_corrupted_tiny_gguf(tiny_files, tmp_path, fresh_home, at, mask):
    data = tiny_files["gguf"]
    load_or_clean_error(damaged_gguf(tmp_path, damage(data, flip=(int(at * len(data)), mask))))


def vocabulary_span(data: bytes) -> tuple[int, int]:
    """Where the tiny GGUF keeps its tokens, token types and merges (up to the next key)."""
    start = data.index(b"tokenizer.ggml.tokens")
    return start, data.index(b"tokenizer.ggml.bos_token_id", start)


@fuzz(80)
@given(at=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
@example(at=0.5, mask=0x01)
def test_corrupted_tiny_gguf_vocabulary(tiny_files, tmp_path, fresh_home, at, mask):
    """Flips aimed at the vocabulary: a token, its type, a merge. A refused vocabulary names the file."""
    data = tiny_files["gguf"]
    start, end = vocabulary_span(data)
    path = damaged_gguf(tmp_path, damage(data, flip=(start + int(at * (end - start)), mask)))
    message = load_or_clean_error(path)
    assert message == "" or message.startswith(f"{path}: "), message


def flip_in_string(data: bytes, key: bytes, text: bytes, index: int, mask: int) -> bytes:
    """Flip byte `index` of the GGUF string `text` stored after `key` (a token or a merge)."""
    at = data.index(len(text).to_bytes(8, "little") + text, data.index(key)) + 8 + index
    return damage(data, flip=(at, mask))


def test_damaged_token_and_merge_of_tiny_gguf(tiny_files, tmp_path, fresh_home):
    """The failure hypothesis once found at random, made explicit: a token that a merge makes, and a merge, damaged."""
    from llmtrace.checkpoint.gguf_file import open_gguf

    data = tiny_files["gguf"]
    merges = open_gguf(damaged_gguf(tmp_path, data)).fields["tokenizer.ggml.merges"].value
    merge = next(m for m in merges if len(m) == 4 and m.isascii() and " " in m[1:3])  # e.g. 'a ll'
    made = merge.replace(" ", "").encode()
    # its first byte becomes DEL (0x7f): still UTF-8, but no longer the token the merge makes
    token = flip_in_string(data, b"tokenizer.ggml.tokens", made, 0, made[0] ^ 0x7F)
    message = load_or_clean_error(damaged_gguf(tmp_path, token))
    assert f"makes {made.decode()!r}, which is not in the vocabulary" in message, message
    bad_merge = flip_in_string(data, b"tokenizer.ggml.merges", merge.encode(), len(merge) - 1, ord(merge[-1]) ^ 0x7F)
    message = load_or_clean_error(damaged_gguf(tmp_path, bad_merge))
    assert "tokenizer.ggml.merges: merge" in message and "which is not in the vocabulary" in message, message


@pytest.fixture
def hf_copy(tiny_files, tmp_path):
    return Path(shutil.copytree(tiny_files["hf"], tmp_path / "hf-copy", dirs_exist_ok=True))


@fuzz(60)
@given(cut=st.floats(0, 1, exclude_max=True))
def test_truncated_tiny_safetensors(tiny_files, hf_copy, cut):
    data = tiny_files["safetensors"]
    (hf_copy / "model.safetensors").write_bytes(damage(data, cut=int(cut * len(data))))
    assert "truncated or corrupt" in load_or_clean_error(hf_copy)


@fuzz(80)
@given(at=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255), in_header=st.booleans())
def test_corrupted_tiny_safetensors(tiny_files, hf_copy, at, mask, in_header):
    data = tiny_files["safetensors"]
    header_end = 8 + int.from_bytes(data[:8], "little")
    offset = int(at * header_end) if in_header else int(at * len(data))  # the header is small: aim at it half the time
    (hf_copy / "model.safetensors").write_bytes(damage(data, flip=(offset, mask)))
    load_or_clean_error(hf_copy)


@fuzz(80)
@given(at=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_corrupted_tiny_tokenizer_json(tiny_files, hf_copy, at, mask):
    """A flipped byte in tokenizer.json: it loads and round-trips text, or the error names tokenizer.json."""
    from llmtrace.checkpoint.tokenizer_only import load_tokenizer

    path = hf_copy / "tokenizer.json"
    data = (tiny_files["hf"] / "tokenizer.json").read_bytes()
    path.write_bytes(damage(data, flip=(int(at * len(data)), mask)))
    with deadline(60):
        try:
            tok = load_tokenizer(str(hf_copy))
        except LlmtraceError as e:
            assert str(e).startswith(f"{path}: ") and "\n" not in str(e), e
            return
        ids = tok.encode("The quick brown fox <|im_start|>")
        tok.decode(ids)
        tok.encode_prompt("hi", chat=True)


# -- the real SmolLM2 files, at chosen offsets (each full read of its metadata takes seconds)


@pytest.mark.slow
def test_truncated_real_gguf(smollm_path, tmp_path, fresh_home):
    import gguf

    size = smollm_path.stat().st_size
    data_start = gguf.GGUFReader(str(smollm_path)).data_offset
    cuts = [0, 3, 4, 8, 16, 23, 24, 25, 1000, 100_000, 1_000_000, data_start - 1, data_start + 12_345, size - 1]
    target = tmp_path / "cut.gguf"
    for cut in cuts:
        with open(smollm_path, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read(cut))
        message = load_or_clean_error(target, run=False)
        assert "cut.gguf" in message, (cut, message)


def tensor_info_offsets(path: Path, index: int) -> dict[str, int]:
    """Where one tensor's record (name, dimensions, type, data offset) sits in a GGUF file's header."""
    import gguf

    t = gguf.GGUFReader(str(path)).tensors[index]
    name_at = t.field.offset + 8  # after the name's length
    dims_at = name_at + len(t.name.encode()) + 4  # after the name and the number of dimensions
    type_at = dims_at + 8 * len(t.shape)
    return {"name": name_at, "dim0": dims_at, "type": type_at, "offset": type_at + 4}


@pytest.mark.slow
def test_corrupted_real_gguf_header(smollm_path, tmp_path, fresh_home):
    """The version, the counts, and a tensor's record. A wrong count must not send the reader through 2**56 entries;
    a wrong type, shape or offset must be named, not crash the dequantizer."""
    first, last = tensor_info_offsets(smollm_path, 0), tensor_info_offsets(smollm_path, -1)
    flips = [(0, 0x01), (4, 0x02), (4 + 3, 0x80), (8 + 7, 0x01), (8, 0xFF), (16 + 7, 0x01), (16, 0x40),
             (first["dim0"], 0x01), (first["type"], 0x10), (first["offset"] + 6, 0x01), (first["name"], 0x01),
             (last["dim0"], 0x01), (last["type"], 0x10), (last["offset"], 0x01)]
    data = bytearray(smollm_path.read_bytes())
    target = tmp_path / "flipped.gguf"
    for at, mask in flips:
        data[at] ^= mask
        target.write_bytes(data)
        data[at] ^= mask
        assert "flipped.gguf" in load_or_clean_error(target, seconds=120, run=False), (at, mask)


@pytest.mark.slow
def test_truncated_real_converted_safetensors(smollm, smollm_path, tmp_path, monkeypatch):
    """The cached conversion of the real model, cut off: a clean error, and the damaged entry is removed."""
    from llmtrace.registry.cache import converted_dir

    real = converted_dir(smollm_path)
    assert (real / "weights.safetensors").is_file()
    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    fake = converted_dir(smollm_path)
    assert tmp_path in fake.parents  # never touch the user's cache
    weights = real / "weights.safetensors"
    with open(weights, "rb") as f:
        header_end = 8 + int.from_bytes(f.read(8), "little")
    for cut in [0, 7, 8, 100, header_end - 1, header_end, header_end + 1000, 20_000_000]:
        fake.mkdir(parents=True)
        shutil.copy(real / "llmtrace_config.json", fake)
        shutil.copytree(real / "tokenizer", fake / "tokenizer")
        with open(weights, "rb") as src, open(fake / "weights.safetensors", "wb") as dst:
            dst.write(src.read(cut))
        message = load_or_clean_error(smollm_path, run=False)
        assert "unreadable" in message and "run the command again" in message, (cut, message)
        assert not fake.exists()
