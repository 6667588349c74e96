"""A vocabulary as the `tokenizers` library needs it: the byte-level alphabet, the split regexes and post-processors,
and the consistency checks that name what makes a GGUF vocabulary or a tokenizer.json unusable before the library
refuses it. Used by tokenizer.TextTokenizer's constructors.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

from typing import NamedTuple

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from llmtrace.errors import LlmtraceError, one_line
from llmtrace.units import plural


# ---------------------------------------------------------------------------------------------------------------------
# byte-level alphabet
# ---------------------------------------------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """The GPT-2 byte → character table: printable Latin-1 bytes stand for themselves, the other 68 bytes (control
    characters, space, NBSP, soft hyphen) are moved up to U+0100.. in byte order, so that every byte is visible."""
    keeps_itself = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    table, moved = {}, 0
    for b in range(256):
        if b in keeps_itself:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + moved)
            moved += 1
    return table


BYTE_TO_CHAR: dict[int, str] = _byte_alphabet()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}

SPACE_MARK = "▁"  # how a space is shown (and how SentencePiece vocabularies spell it)
BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# GGUF token types (llama.cpp's llama_token_type; 0 is 'undefined', read as normal).
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 0, 1, 2, 3, 4, 5, 6

# Split regexes of byte-level vocabularies, by `tokenizer.ggml.pre`. These are the patterns the models' own
# tokenizer.json files use; the merges were learned on words cut this way.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss, GPT-4o; llama.cpp's 'gpt-4o'): a word is cut where lower case turns to upper case and keeps a
# contraction as its suffix; digits go in runs of up to 3; a punctuation run takes a trailing '/' with its newlines.
_O200K_LETTERS = r"[^\r\n\p{L}\p{N}]?"
_O200K_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K_SPLIT = (
    _O200K_LETTERS + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _O200K_CONTRACTION + "|"
    + _O200K_LETTERS + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _O200K_CONTRACTION
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], _QWEN2_SPLIT),
    "gpt-4o": _O200K_SPLIT,
}
_GPT2_PRES = {None, "", "default", "gpt2", "gpt-2"}


def byte_level_pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, str | None]:
    """The pre-tokenizer for a byte-level vocabulary, and a note when `pre` is not one we know."""
    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit on its own, then the GPT-2 split.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ), None
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ), None
    note = None
    if pre not in _GPT2_PRES:
        note = f"pre-tokenizer {pre!r} is not known to llmtrace; words are split the GPT-2 way, so ids may differ"
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), note


def post_processor_of(tok: Tokenizer, bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool):
    """`[BOS] $A [EOS]` as asked: the only thing `add_special_tokens=True` adds."""
    single, special = ["$A:0"], []
    if add_bos and bos_id is not None:
        bos = tok.id_to_token(bos_id)
        single.insert(0, f"{bos}:0")
        special.append((bos, bos_id))
    if add_eos and eos_id is not None:
        eos = tok.id_to_token(eos_id)
        single.append(f"{eos}:0")
        if (eos, eos_id) not in special:
            special.append((eos, eos_id))
    pair = single + [s.replace("$A", "$B").replace(":0", ":1") for s in single]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=special)


def split_merge(m: str, where: str = "the tokenizer", index: int | None = None) -> tuple[str, str]:
    parts = m.split(" ")
    if len(parts) != 2:
        which = f"merge {index}" if index is not None else "merge"
        raise LlmtraceError(f"{where}: {which} {m!r} is malformed (expected 'left right'); {DAMAGED}")
    return parts[0], parts[1]


# ---------------------------------------------------------------------------------------------------------------------
# consistency checks: what makes a vocabulary unusable is named here, before the tokenizers library refuses it
# ---------------------------------------------------------------------------------------------------------------------

DAMAGED = "the file may be damaged: download it again"
_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "padding", "unknown")


def check_gguf_vocab(get, tokens: list, types: list, merges: list | None, where: str) -> None:
    """The `tokenizer.ggml.*` values have the types and ranges a tokenizer can be built from."""

    def bad(what: str) -> LlmtraceError:
        return LlmtraceError(f"{where}: {what}; {DAMAGED}")

    for key, values, kind in (("tokens", tokens, str), ("token_type", types, int), ("merges", merges or [], str)):
        if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
            raise bad(f"tokenizer.ggml.{key} is not a list of {kind.__name__}s")
    if len(types) != len(tokens):
        raise bad(f"tokenizer.ggml.token_type has {plural(len(types), 'entry', 'entries')} "
                  f"for {plural(len(tokens), 'token')}")
    for i, ty in enumerate(types):
        if not UNDEFINED <= ty <= BYTE:
            raise bad(f"token {i} ({tokens[i]!r}) has type {ty} in tokenizer.ggml.token_type (types are 0..6)")
    for name in _SPECIAL_ID_KEYS:
        value = get(f"tokenizer.ggml.{name}_token_id")
        if value is not None and not (isinstance(value, int) and 0 <= value < len(tokens)):
            raise bad(f"tokenizer.ggml.{name}_token_id = {value!r} is not a token id (ids are 0..{len(tokens) - 1})")
    template = get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise bad(f"tokenizer.chat_template is a {type(template).__name__}, not text")


def gguf_vocab(tokens: list[str], where: str) -> dict[str, int]:
    """piece -> id. Two ids with one string cannot both be looked up (llama.cpp refuses such a file too)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise LlmtraceError(f"{where}: token {t!r} appears twice in tokenizer.ggml.tokens (ids {vocab[t]} and {i}); "
                                f"{DAMAGED}")
        vocab[t] = i
    return vocab


def bpe_model(vocab: dict[str, int], merges: list[tuple[str, str]], shown: list | None, where: str, **options) -> Tokenizer:
    """A BPE tokenizer. When the library refuses the vocabulary, the merge at fault is named."""
    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=merges, **options))
    except Exception as e:
        _check_merges(vocab, merges, shown, where)
        raise LlmtraceError(f"{where}: the BPE model cannot be built ({one_line(e)}); {DAMAGED}") from None


def _check_merges(vocab: dict, merges: list[tuple[str, str]], shown: list | None, where: str) -> None:
    """Every merge joins two pieces of the vocabulary into a third one, or BPE cannot be built. `shown[i]` is merge i
    as the file writes it."""
    for i, (left, right) in enumerate(merges):
        for piece, role in ((left, "names"), (right, "names"), (left + right, "makes")):
            if piece not in vocab:
                merge = shown[i] if shown is not None else f"{left} {right}"
                raise LlmtraceError(f"{where}: merge {i} {merge!r} {role} {piece!r}, which is not in the vocabulary; "
                                    f"{DAMAGED}")


def from_library(e: BaseException) -> bool:
    """An error the tokenizers library raises on bad input: a plain Exception, or pyo3's PanicException (which is a
    BaseException, so that `except Exception` lets it through)."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


@contextlib.contextmanager
def library_errors(where: str, doing: str):
    """Whatever the tokenizers library raises in this block becomes one LlmtraceError naming the file."""
    try:
        yield
    except LlmtraceError:
        raise
    except BaseException as e:
        if not from_library(e):
            raise
        raise LlmtraceError(f"{where}: {doing} ({one_line(e)})") from None


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float], skip: set[str]) -> list[tuple[str, str]]:
    """SentencePiece BPE stores no merges: a pair may merge when their concatenation is a token, and the merged
    token's score orders the merges (higher first; then longer left part, longer right part)."""
    found = []
    for token, score in scores.items():
        if token in skip:
            continue
        pairs = [
            (token[:k], token[k:])
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab and token[:k] not in skip and token[k:] not in skip
        ]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((left, right, score) for left, right in pairs)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


# ---------------------------------------------------------------------------------------------------------------------
# the BPE model of a GGUF vocabulary, by tokenizer.ggml.model
# ---------------------------------------------------------------------------------------------------------------------


class GgufBpe(NamedTuple):
    tok: Tokenizer  # the BPE model with its pre-tokenizer and decoder; no added tokens yet
    kind: str  # "byte_level" or "sentencepiece"
    spelled: list[str]  # each token as the model's vocabulary spells it (the added tokens are matched this way)
    types: list[int]  # the token types, as the model uses them
    special_types: tuple[int, ...]  # the token types that are special
    default_bos: bool  # whether this kind adds BOS when the file does not say
    default_reason: str


def byte_level_bpe(get, tokens: list[str], types: list[int], merges_raw: list[str] | None, where: str,
                   notes: list[str]) -> GgufBpe:
    """`tokenizer.ggml.model = gpt2`: every byte spelled as one printable character, merges from the file."""
    alphabet = set(CHAR_TO_BYTE)

    def spell(t: str) -> str:
        # A normal token must be written in the byte alphabet; a few converters store raw text instead.
        return t if set(t) <= alphabet else "".join(BYTE_TO_CHAR[b] for b in t.encode("utf-8"))

    spelled = [t if ty in (CONTROL, USER_DEFINED) else spell(t) for t, ty in zip(tokens, types)]
    if merges_raw is None:
        raise LlmtraceError(f"{where}: its byte-level (gpt2) tokenizer has no tokenizer.ggml.merges")
    merges = [tuple(spell(p) for p in split_merge(m, where, i)) for i, m in enumerate(merges_raw)]
    tok = bpe_model(gguf_vocab(spelled, where), merges, merges_raw, f"{where}: tokenizer.ggml.merges", fuse_unk=False,
                    byte_fallback=False)
    tok.pre_tokenizer, note = byte_level_pre_tokenizer(get("tokenizer.ggml.pre"))
    if note:
        notes.append(note)
    tok.decoder = decoders.ByteLevel()
    return GgufBpe(tok, "byte_level", spelled, types, (CONTROL,), False, "byte-level BPE adds no BOS unless told")


def sentencepiece_bpe(get, tokens: list[str], types: list[int], merges_raw: list[str] | None, where: str) -> GgufBpe:
    """`tokenizer.ggml.model = llama`: SentencePiece BPE. Spaces are '▁', a character the vocabulary lacks falls back
    to its UTF-8 bytes '<0xE4>'; without merges in the file, the scores order them (merges_from_scores).

    Gemma's files (general.architecture gemma*) differ twice, and transformers' Gemma tokenizer reads them so: a run
    of spaces is stored as real spaces ('  ', user-defined) though it is the piece '▁▁' that merges build, and the
    merges go in the order of the file, which is not the order of its scores for those runs."""
    gemma = get("general.architecture") in ("gemma", "gemma2", "gemma3")
    if gemma:
        runs = [i for i, t in enumerate(tokens) if t and not t.strip(" ")]
        tokens, types = list(tokens), list(types)
        for i in runs:
            tokens[i], types[i] = SPACE_MARK * len(tokens[i]), NORMAL
    vocab = gguf_vocab(tokens, where)
    if merges_raw is not None:
        merges = [split_merge(m, where, i) for i, m in enumerate(merges_raw)]
    else:
        scores: list[float] = get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        if gemma:
            scores = [-float(i) for i in range(len(tokens))]
        skip = {t for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN, BYTE)}
        merges = merges_from_scores(vocab, dict(zip(tokens, scores)), skip)
    unk_id = get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = bpe_model(vocab, merges, merges_raw, f"{where}: tokenizer.ggml.merges", unk_token=unk, fuse_unk=True,
                    byte_fallback=True)
    space_prefix = bool(get("tokenizer.ggml.add_space_prefix", True))  # Gemma's say false: no '▁' before the text
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE_MARK, prepend_scheme="first" if space_prefix
                                                 else "never", split=False)
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return GgufBpe(tok, "sentencepiece", tokens, types, (CONTROL, UNKNOWN), True,
                   "SentencePiece (llama) vocabularies add BOS unless told")


def detect_kind(tok: Tokenizer) -> str:
    spec = json.loads(tok.to_str())
    parts = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    if '"ByteLevel"' in parts:
        return "byte_level"
    if spec.get("model", {}).get("byte_fallback") or SPACE_MARK in parts or SPACE_MARK in json.dumps(spec.get("normalizer")):
        return "sentencepiece"
    return "plain"


def read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise LlmtraceError(f"{path}: not UTF-8 text (byte offset {e.start}); {DAMAGED}") from None


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            if isinstance(value, int) and isinstance(found[key], int):  # a vocabulary: a token with two ids
                raise _DuplicateKey(f"token {key!r} appears twice (ids {found[key]} and {value})")
            raise _DuplicateKey(f"key {key!r} appears twice in one object")
        found[key] = value
    return found


def parse_json(text: str, path: Path, unique_keys: bool = False) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys if unique_keys else None)
    except json.JSONDecodeError as e:
        raise LlmtraceError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except _DuplicateKey as e:
        raise LlmtraceError(f"{path}: {e}; {DAMAGED}") from None


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = parse_json(read_text_file(path), path)
    return data if isinstance(data, dict) else {}


def check_tokenizer_json(spec: Any, path: Path) -> None:
    """Why the tokenizers library refused a tokenizer.json, when it is one of these: a token or an id given twice, a
    merge naming (or making) a piece the vocabulary lacks. Run only after a refusal: it costs a full JSON parse."""

    def bad(what: str) -> LlmtraceError:
        return LlmtraceError(f"{path}: {what}; {DAMAGED}")

    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict):
        raise bad("it has no \"model\" object")
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        seen: dict[int, str] = {}
        for piece, tid in vocab.items():
            if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                raise bad(f"model.vocab gives {piece!r} the id {tid!r}, which is not a token id")
            if tid in seen:
                raise bad(f"model.vocab gives id {tid} to both {seen[tid]!r} and {piece!r}")
            seen[tid] = piece
    if model.get("type", "BPE") == "BPE" and isinstance(vocab, dict):
        raw = model.get("merges") or []
        raw, pairs = raw if isinstance(raw, list) else [raw], []
        for i, m in enumerate(raw):
            pair = m.split(" ") if isinstance(m, str) else m
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise bad(f"model.merges entry {i} {m!r} is not 'left right' or [left, right]")
            pairs.append(tuple(pair))
        _check_merges(vocab, pairs, raw, f"{path}: model.merges")


def post_processor_problem(tok: Tokenizer) -> str | None:
    """A TemplateProcessing that uses a special token its `special_tokens` lacks makes the tokenizers library panic at
    the first encode (the library builds it without a word); one that adds an id past the vocabulary hands the model
    a token it has no row for. Find both first."""
    if tok.post_processor is None:
        return None
    return _template_problem(json.loads(tok.post_processor.__getstate__()), tok.get_vocab_size(with_added_tokens=True))


def _template_problem(pp: Any, vocab_size: int, where: str = "post_processor") -> str | None:
    if not isinstance(pp, dict):
        return None
    if pp.get("type") == "Sequence":
        for i, inner in enumerate(pp.get("processors") or []):
            problem = _template_problem(inner, vocab_size, f"{where}.processors[{i}]")
            if problem:
                return problem
        return None
    if pp.get("type") != "TemplateProcessing":
        return None
    known = pp.get("special_tokens") if isinstance(pp.get("special_tokens"), dict) else {}
    for side in ("single", "pair"):
        for piece in pp.get(side) or []:
            special = piece.get("SpecialToken") if isinstance(piece, dict) else None
            if isinstance(special, dict) and special.get("id") not in known:
                return f"{where}.{side} uses the special token {special.get('id')!r}, which {where}.special_tokens lacks"
    for name, entry in known.items():
        ids = entry.get("ids") if isinstance(entry, dict) else None
        for tid in ids if isinstance(ids, list) else []:
            if not 0 <= tid < vocab_size:
                return f"{where}.special_tokens gives {name!r} the id {tid}, past the vocabulary's {vocab_size} tokens"
    return None
