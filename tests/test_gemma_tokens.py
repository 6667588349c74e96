"""Gemma's SentencePiece vocabulary, on a small one built like the real file (tokenizer.ggml.model = llama, scores
in merge order, 256 byte-fallback tokens, runs of spaces, newlines and tabs as user-defined tokens, control tokens,
add_space_prefix false, no merges, no chat template): llmtrace tokenizes it exactly as transformers does, from the
GGUF and from the tokenizer.json transformers writes for it; the merge story ends in the tokens; Gemma's turn format
renders in the sandbox as transformers renders it. The real 262k vocabulary: tests/test_gemma3_real.py (slow)."""

import pytest

from llmtrace.tokens.chat_template import GEMMA_TURNS
from llmtrace.tokens.tokenizer import TextTokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The theory of everything.",
    "Attention looks back at every earlier position; the cache keeps their keys and values.",
    "Hello world! hello there, the weather is nice and the fox is quick.",
    "café naïve résumé Zürich",
]
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["\n", "\n\n", "\n\n\n", "  ", "   ", "    ", "\t", "\t\t", "<b>", "</b>"]
ODD = [
    "Hello world", " leading space", "  two leading", "trailing  ", "café naïve résumé", "日本語のテキスト",
    "emoji 😀👍🏽 done", "tab\there\t\tx\t", "runs   of    spaces     and\u00a0nbsp", "line\nbreak\n\nmore\n\n\n\n",
    "<start_of_turn>user\nhi<end_of_turn>\n", "<b>bold</b> and <bos>", "", " ", "\n", "a\r\nb", "x" * 40,
    "Grüße, Zürich! ¿Qué? ÀÉÎÕÜ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ①②", "the the the theory", "  \t \n  mixed \n\t",
]


def _pieces() -> list[str]:
    """Normal pieces: a BPE trained on CORPUS the SentencePiece way (spaces as '▁', no pre-tokenization), in id
    order: single characters first, then each merge's result in the order it was learned."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get)


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    """A GGUF holding only a Gemma-style vocabulary and the few keys a reader needs."""
    import gguf

    path = tmp_path_factory.mktemp("gemma-vocab") / "gemma-vocab.gguf"
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    normal = [p for p in _pieces() if p not in CONTROL + USER_DEFINED + bytes_]
    tokens = CONTROL + USER_DEFINED + bytes_ + normal
    types = [3] * len(CONTROL) + [4] * len(USER_DEFINED) + [6] * 256 + [1] * len(normal)
    scores = [-1000.0] * (len(CONTROL) + len(USER_DEFINED)) + [0.0] * 256 + [-float(i) for i in range(len(normal))]
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in (("block_count", 1), ("context_length", 128), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4)):
        w.add_uint32(f"gemma3.{key}", value)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    for name, tid in (("bos", 2), ("eos", 1), ("unknown", 3), ("padding", 0)):
        w.add_uint32(f"tokenizer.ggml.{name}_token_id", tid)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hf_gemma(gemma_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)


@pytest.fixture(scope="module")
def ours(gemma_gguf):
    import gguf

    return TextTokenizer.from_gguf(gguf.GGUFReader(str(gemma_gguf)), str(gemma_gguf))


def test_reference_is_transformers_gemma_tokenizer(hf_gemma):
    assert type(hf_gemma).__name__ == "GemmaTokenizer"


@pytest.mark.parametrize("text", ODD)
def test_gguf_ids_and_text_equal_transformers(ours, hf_gemma, text):
    assert ours.kind == "sentencepiece"
    expected = hf_gemma.encode(text)
    assert ours.encode(text) == expected
    assert expected[:1] == [2]  # BOS, as add_bos_token says
    assert ours.decode(expected) == hf_gemma.decode(expected)
    assert ours.encode(text, add_special_tokens=False) == hf_gemma.encode(text, add_special_tokens=False)


def test_hf_dir_tokenizer_json_equals_transformers(ours, hf_gemma, tmp_path):
    """The tokenizer.json transformers writes for Gemma (normalizer ' ' -> '▁', byte fallback, no prefix space)."""
    import transformers

    hf_gemma.save_pretrained(str(tmp_path))
    from_dir = TextTokenizer.from_hf_dir(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert from_dir.kind == "sentencepiece"
    for text in ODD:
        assert from_dir.encode(text) == reference.encode(text) == ours.encode(text), repr(text)


def test_pieces_show_spaces_bytes_and_added_tokens(ours):
    infos = ours.encode_detailed("  a\tb 日")
    pieces = [i.piece for i in infos]
    assert pieces[0] == "<bos>" and infos[0].special
    assert "▁▁" in pieces  # a run of spaces: stored as real spaces, built as '▁▁' (as transformers reads Gemma)
    assert "\t" in pieces and ours.is_added(ours.encode("\t", add_special_tokens=False)[0])  # user-defined: whole
    fallback = [i for i in infos if i.byte_fallback]
    assert [i.piece for i in fallback] == ["<0xE6>", "<0x97>", "<0xA5>"]  # 日 is not in the vocabulary
    assert b"".join(i.bytes for i in infos[1:]) == "  a\tb 日".encode()


@pytest.mark.parametrize("text", ["the theory of the quick fox", "Zürich café", "the fox\u00a0is   there"])
def test_merge_story_ends_in_the_tokens(ours, text):
    """SentencePiece BPE merges the adjacent pair whose result scores best; llmtrace ranks the merges by those scores,
    so the merge story of `tokenize --merges` ends in exactly the tokenizer's pieces."""
    from llmtrace.tokens.bpe import trace_merges

    final = [p for word in trace_merges(ours, text) for p in word.final]
    assert final == [ours.piece(i) for i in ours.encode(text, add_special_tokens=False)]
    assert any(word.steps for word in trace_merges(ours, text))


def test_gemma_gguf_without_template_gets_gemma_turns(ours, hf_gemma):
    """The 270M base model's GGUF has no chat template: --chat uses Gemma's turn format, rendered in the sandbox
    exactly as transformers renders the same template, with a note that says so."""
    assert ours.chat_template == GEMMA_TURNS
    assert any("Gemma's turn format" in note for note in ours.notes)
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And you?"}]
    text = ours.render_chat(messages, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello."
                    "<end_of_turn>\n<start_of_turn>user\nAnd you?<end_of_turn>\n<start_of_turn>model\n")
    assert text == hf_gemma.apply_chat_template(messages, chat_template=GEMMA_TURNS, tokenize=False,
                                                add_generation_prompt=True)
    prompt, ids = ours.encode_prompt("Hi there", chat=True)
    assert ids[0] == 2 and ids.count(2) == 1  # the template's BOS, not a second one from the tokenizer
    assert [ours.piece(i) for i in ids[:2]] == ["<bos>", "<start_of_turn>"]


def test_gemma_turns_refuse_two_user_turns_in_a_row(ours):
    from llmtrace.errors import LlmtraceError

    with pytest.raises(LlmtraceError, match="Gemma turns alternate"):
        ours.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_saved_and_read_back_it_is_the_same_tokenizer(ours, tmp_path):
    """A GGUF's conversion keeps its tokenizer as tokenizer.json + tokenizer_config.json (save_hf_dir): the Gemma
    vocabulary, the turn format and the note come back unchanged."""
    ours.save_hf_dir(tmp_path)
    back = TextTokenizer.from_hf_dir(tmp_path)
    assert (back.kind, back.bos_id, back.eos_ids, back.add_bos) == (ours.kind, ours.bos_id, ours.eos_ids, ours.add_bos)
    assert back.chat_template == GEMMA_TURNS and back.notes == ours.notes
    for text in ODD:
        assert back.encode(text) == ours.encode(text), repr(text)
