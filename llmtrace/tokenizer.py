"""Text ⇄ token ids, built from what a checkpoint ships: a GGUF's vocabulary metadata or an HF `tokenizer.json`.

Step s1–s2 of the pipeline. One `TextTokenizer` wraps a `tokenizers.Tokenizer` and adds what a learner wants to see
about each token: the raw vocabulary piece, the UTF-8 bytes it stands for, the characters of the input it covers (and
which bytes of a multi-byte character, when BPE cut one apart), whether it is a special token, and why a BOS was or
was not added.

Two vocabulary kinds are understood:

    byte_level     GPT-2 style byte-level BPE (GGUF `tokenizer.ggml.model = gpt2`). Every byte 0..255 is spelled as
                   one printable character ('Ġ' is the space byte 0x20, 'Ċ' is 0x0A), so a piece is a string of
                   those characters and maps back to bytes exactly.
    sentencepiece  LLaMA-1/2 style BPE (GGUF `tokenizer.ggml.model = llama`): spaces are written '▁', a character
                   missing from the vocabulary falls back to byte tokens '<0xE4>' '<0xBD>' '<0xA0>'.

The ids are the ones HF transformers gives for the same file (tests/test_tokenize.py checks this on SmolLM2).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from llmtrace.errors import LlmtraceError, UsageError, one_line

if TYPE_CHECKING:  # pragma: no cover
    import gguf


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
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

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
_PRE_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], _QWEN2_SPLIT),
}
_GPT2_PRES = {None, "", "default", "gpt2", "gpt-2"}


def _byte_level_pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, str | None]:
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


def _post_processor(tok: Tokenizer, bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool):
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


# ---------------------------------------------------------------------------------------------------------------------
# per-token facts
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CharPart:
    """A token carries bytes `first..last` (1-based) of the `total` UTF-8 bytes of `char`, not the whole character."""

    char: str
    first: int
    last: int
    total: int

    def __str__(self) -> str:
        where = f"{self.first}" if self.first == self.last else f"{self.first}-{self.last}"
        return f"{where}/{self.total} of {self.char}"

    def to_dict(self) -> dict:
        return {"char": self.char, "first": self.first, "last": self.last, "total": self.total}


@dataclass(frozen=True)
class TokenInfo:
    index: int  # position in the id list
    id: int
    piece: str  # the raw vocabulary string, e.g. 'Ġworld'
    visible: str  # the piece with whitespace made visible, e.g. '▁world'
    text: str  # the UTF-8 text of its bytes ('�' where it holds only part of a character)
    bytes: bytes  # the bytes of the input this token stands for
    span: tuple[int, int] | None  # [start, end) in characters of the input; None for a BOS/EOS the tokenizer added
    special: bool  # a control token such as <|im_start|>
    byte_fallback: bool = False  # a SentencePiece '<0xNN>' token
    char_parts: tuple[CharPart, ...] = ()  # characters it holds only part of

    @property
    def added(self) -> bool:
        """Added by the tokenizer (BOS/EOS), not found in the input."""
        return self.span is None

    def bytes_hex(self) -> str:
        return self.bytes.hex(" ")

    def bytes_label(self) -> str:
        """'e4 bd (1-2/3 of 你)': the bytes, and which part of a character they are when not all of it."""
        notes = [str(p) for p in self.char_parts]
        if self.byte_fallback:
            notes.insert(0, "byte fallback")
        return self.bytes_hex() + (f" ({'; '.join(notes)})" if notes else "")

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "id": self.id,
            "piece": self.piece,
            "visible": self.visible,
            "text": self.text,
            "bytes": self.bytes_hex(),
            "span": list(self.span) if self.span is not None else None,
            "special": self.special,
            "added": self.added,
            "byte_fallback": self.byte_fallback,
            "char_parts": [p.to_dict() for p in self.char_parts],
        }


def visible_text(data: bytes) -> str:
    """Bytes as text a reader can see: ' ' → '▁', '\\n' → '\\\\n', '\\t' → '\\\\t', other control characters as
    '\\\\xNN', and bytes that are not (yet) a whole UTF-8 character as '<e4 bd>'."""
    out: list[str] = []
    raw: list[int] = []
    for ch in data.decode("utf-8", errors="surrogateescape"):
        if "\udc80" <= ch <= "\udcff":  # a byte that is not a complete character
            raw.append(ord(ch) - 0xDC00)
            continue
        if raw:
            out.append("<" + bytes(raw).hex(" ") + ">")
            raw = []
        if ch == " ":
            out.append(SPACE_MARK)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    if raw:
        out.append("<" + bytes(raw).hex(" ") + ">")
    return "".join(out)


def _char_parts(char_starts: list[int], text: str, b0: int, b1: int) -> tuple[CharPart, ...]:
    """The characters that bytes [b0, b1) of the input cut into: at most one at each end."""
    if b1 <= b0:
        return ()
    parts: list[CharPart] = []
    first_char = bisect.bisect_right(char_starts, b0) - 1
    last_char = bisect.bisect_right(char_starts, b1 - 1) - 1
    for c in sorted({first_char, last_char}):
        start, end = char_starts[c], char_starts[c + 1]
        lo, hi = max(b0, start), min(b1, end)
        if lo == start and hi == end:
            continue  # the whole character is in this token
        parts.append(CharPart(text[c], lo - start + 1, hi - start, end - start))
    return tuple(parts)


def check_messages(messages: Any, where: str = "messages") -> list[dict]:
    """A chat as a list of {"role": str, "content": str}; anything else is a one-line LlmtraceError."""
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    if not isinstance(messages, list) or not messages:
        raise LlmtraceError(f"{where}: expected a non-empty JSON list of {{\"role\": ..., \"content\": ...}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise LlmtraceError(f"{where}: message {i} is not an object")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise LlmtraceError(f"{where}: message {i} has no \"role\" string")
        if not isinstance(m.get("content"), str):
            raise LlmtraceError(f"{where}: message {i} has no \"content\" string")
    return messages


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


# ---------------------------------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------------------------------


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the facts about it that llmtrace shows (see the module docstring)."""

    def __init__(
        self,
        tok: Tokenizer,
        *,
        kind: str,
        bos_id: int | None,
        eos_ids: list[int],
        pad_id: int | None,
        add_bos: bool,
        add_eos: bool,
        add_bos_reason: str,
        chat_template: str | None,
        unk_id: int | None = None,
        vocab_size: int | None = None,
        source: str = "",
        notes: Iterable[str] = (),
    ):
        self.tok = tok
        self.kind = kind  # "byte_level", "sentencepiece" or "plain"
        self.bos_id = bos_id
        self.eos_ids = list(dict.fromkeys(eos_ids))
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_bos_reason = add_bos_reason
        self.chat_template = chat_template
        self.vocab_size = vocab_size if vocab_size is not None else tok.get_vocab_size(with_added_tokens=True)
        self.source = source  # where it was built from, for messages
        self.notes = list(notes)  # things the user should know (an unknown pre-tokenizer, ...)
        self._added: dict[int, AddedToken] = dict(tok.get_added_tokens_decoder())

    # -- construction ------------------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader", path: str | None = None) -> "TextTokenizer":
        """Build the tokenizer a GGUF describes in its `tokenizer.ggml.*` metadata. `path` names the file in errors:
        a vocabulary the tokenizer cannot be built from (a merge naming a missing token, a duplicate token, a token
        type or special id out of range) is one LlmtraceError that says what is inconsistent."""
        where = path or "this GGUF"

        def get(key, default=None):
            f = reader.fields.get(key)
            return f.contents() if f is not None else default

        model = get("tokenizer.ggml.model")
        tokens: list[str] | None = get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise LlmtraceError(f"{where} has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        types: list[int] = get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        merges_raw: list[str] | None = get("tokenizer.ggml.merges")
        _check_gguf_vocab(get, tokens, types, merges_raw, where)
        bos_id, eos_id = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
        notes: list[str] = []
        with _library_errors(where, "the tokenizer could not be built from its vocabulary"):
            return cls._from_gguf_vocab(get, model, tokens, types, merges_raw, bos_id, eos_id, notes, where,
                                        source=path or "gguf")

    @classmethod
    def _from_gguf_vocab(cls, get, model, tokens, types, merges_raw, bos_id, eos_id, notes, where, source):
        if model == "gpt2":
            kind = "byte_level"
            alphabet = set(CHAR_TO_BYTE)

            def spell(t: str) -> str:
                # A normal token must be written in the byte alphabet; a few converters store raw text instead.
                return t if set(t) <= alphabet else "".join(BYTE_TO_CHAR[b] for b in t.encode("utf-8"))

            vocab_list = [t if ty in (CONTROL, USER_DEFINED) else spell(t) for t, ty in zip(tokens, types)]
            if merges_raw is None:
                raise LlmtraceError(f"{where}: its byte-level (gpt2) tokenizer has no tokenizer.ggml.merges")
            merges = [tuple(spell(p) for p in _split_merge(m, where, i)) for i, m in enumerate(merges_raw)]
            vocab = _gguf_vocab(vocab_list, where)
            tok = _bpe(vocab, merges, merges_raw, f"{where}: tokenizer.ggml.merges", fuse_unk=False, byte_fallback=False)
            tok.pre_tokenizer, note = _byte_level_pre_tokenizer(get("tokenizer.ggml.pre"))
            if note:
                notes.append(note)
            tok.decoder = decoders.ByteLevel()
            special_types = (CONTROL,)
            default_bos, default_reason = False, "byte-level BPE adds no BOS unless told"
        elif model == "llama":
            kind = "sentencepiece"
            scores: list[float] = get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            vocab = _gguf_vocab(tokens, where)
            if merges_raw is not None:
                merges = [_split_merge(m, where, i) for i, m in enumerate(merges_raw)]
            else:
                skip = {t for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN, BYTE)}
                merges = _merges_from_scores(vocab, dict(zip(tokens, scores)), skip)
            unk_id = get("tokenizer.ggml.unknown_token_id")
            unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
            tok = _bpe(vocab, merges, merges_raw, f"{where}: tokenizer.ggml.merges", unk_token=unk, fuse_unk=True,
                       byte_fallback=True)
            space_prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
            tok.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement=SPACE_MARK, prepend_scheme="first" if space_prefix else "never", split=False
            )
            steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
            if space_prefix:
                steps.append(decoders.Strip(content=" ", left=1, right=0))
            tok.decoder = decoders.Sequence(steps)
            special_types = (CONTROL, UNKNOWN)
            default_bos, default_reason = True, "SentencePiece (llama) vocabularies add BOS unless told"
        else:
            raise LlmtraceError(
                f"{where}: tokenizer model {model!r} is not supported (llmtrace reads 'gpt2' and 'llama')"
            )

        # Control tokens are matched whole in the text and are special; user-defined ones are matched whole too.
        spelled = vocab_list if kind == "byte_level" else tokens
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(spelled, types) if ty in special_types]
        )
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(spelled, types) if ty == USER_DEFINED])

        add_bos_field = get("tokenizer.ggml.add_bos_token")
        if add_bos_field is None:
            add_bos, reason = default_bos, f"tokenizer.ggml.add_bos_token not set; {default_reason}"
        else:
            add_bos, reason = bool(add_bos_field), f"tokenizer.ggml.add_bos_token = {str(bool(add_bos_field)).lower()}"
        add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
        if add_bos and bos_id is None:
            add_bos, reason = False, "the GGUF asks for BOS but names no tokenizer.ggml.bos_token_id"
        tok.post_processor = _post_processor(tok, bos_id, eos_id, add_bos, add_eos)

        # Generation stops at EOS, and at end-of-turn / end-of-message tokens when the file names them.
        stops = (eos_id, get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id"))
        eos_ids = [i for i in stops if i is not None]
        return cls(
            tok,
            kind=kind,
            bos_id=bos_id,
            eos_ids=eos_ids,
            pad_id=get("tokenizer.ggml.padding_token_id"),
            unk_id=get("tokenizer.ggml.unknown_token_id"),
            add_bos=add_bos,
            add_eos=add_eos,
            add_bos_reason=reason,
            chat_template=get("tokenizer.chat_template"),
            vocab_size=len(tokens),
            source=source,
            notes=notes,
        )

    @classmethod
    def from_hf_dir(cls, path) -> "TextTokenizer":
        """Load `tokenizer.json` with `tokenizer_config.json` (and `chat_template.jinja`, `special_tokens_map.json`,
        `generation_config.json` when present) from an HF model directory."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise LlmtraceError(f"{path} has no tokenizer.json")
        text = _read_text(tj)
        try:
            tok = Tokenizer.from_str(text)
        except BaseException as e:
            if not _from_library(e):
                raise
            _check_tokenizer_json(_parse_json(text, tj, unique_keys=True), tj)  # names the inconsistency if it can
            raise LlmtraceError(f"{tj}: the tokenizers library cannot read it ({one_line(e)})") from None
        problem = _post_processor_problem(tok)
        if problem:
            raise LlmtraceError(f"{tj}: {problem}; {_DAMAGED}")
        with _library_errors(str(tj), "the tokenizer cannot be set up"):
            return cls._from_hf_parts(tok, path)

    @classmethod
    def _from_hf_parts(cls, tok: Tokenizer, path: Path) -> "TextTokenizer":
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        generation = _read_json(path / "generation_config.json")
        ours = config.get("llmtrace") if isinstance(config.get("llmtrace"), dict) else {}

        def token_id(key: str) -> int | None:
            value = config.get(key, special_map.get(key))
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        bos_id, eos_id, pad_id, unk_id = (token_id(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token"))
        eos_ids = [eos_id] if eos_id is not None else []
        gen_eos = generation.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        eos_ids += [i for i in ours.get("eos_token_ids", []) if isinstance(i, int)]

        if "add_bos_token" in config or "add_eos_token" in config:
            add_bos = bool(config.get("add_bos_token", False)) and bos_id is not None
            add_eos = bool(config.get("add_eos_token", False)) and eos_id is not None
            reason = f"tokenizer_config.json add_bos_token = {str(add_bos).lower()}"
            tok.post_processor = _post_processor(tok, bos_id, eos_id, add_bos, add_eos)
        else:  # the tokenizer.json post-processor decides
            empty = tok.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and empty[:1] == [bos_id]
            add_eos = eos_id is not None and empty[-1:] == [eos_id]
            reason = "tokenizer.json post-processor " + ("adds " + tok.id_to_token(bos_id) if add_bos else "adds no BOS")
        reason = ours.get("add_bos_reason", reason)

        template = None
        if (path / "chat_template.jinja").is_file():
            template = _read_text(path / "chat_template.jinja")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)

        return cls(
            tok,
            kind=ours.get("kind") or _detect_kind(tok),
            bos_id=bos_id,
            eos_ids=eos_ids,
            pad_id=pad_id,
            unk_id=unk_id,
            add_bos=add_bos,
            add_eos=add_eos,
            add_bos_reason=reason,
            chat_template=template,
            source=ours.get("source", str(path)),
            notes=ours.get("notes", []),
        )

    def save_hf_dir(self, path) -> None:
        """Write tokenizer.json and tokenizer_config.json so that `from_hf_dir(path)` gives the same tokenizer."""
        from llmtrace.fsutil import write_text_atomic

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        piece = lambda i: self.tok.id_to_token(i) if i is not None else None  # noqa: E731
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": piece(self.bos_id),
            "eos_token": piece(self.eos_ids[0]) if self.eos_ids else None,
            "pad_token": piece(self.pad_id),
            "unk_token": piece(self.unk_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
            "llmtrace": {
                "kind": self.kind,
                "add_bos_reason": self.add_bos_reason,
                "eos_token_ids": self.eos_ids,
                "source": self.source,
                "notes": self.notes,
            },
        }
        write_text_atomic(path / "tokenizer.json", self.tok.to_str())
        write_text_atomic(path / "tokenizer_config.json", json.dumps(config, ensure_ascii=False, indent=2) + "\n")

    # -- ids ---------------------------------------------------------------------------------------------------------

    def _encoding(self, text: str, add_special_tokens: bool, parse_special: bool):
        if not parse_special:
            self.tok.encode_special_tokens = True  # special-token text is split like any other text
        try:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        finally:
            self.tok.encode_special_tokens = False

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids. `add_special_tokens` adds BOS/EOS when this model wants them; `parse_special=False` treats
        '<|im_start|>' in the text as plain characters instead of one control token."""
        return list(self._encoding(text, add_special_tokens, parse_special).ids)

    def encode_detailed(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[TokenInfo]:
        """One `TokenInfo` per id: piece, bytes, character span and which part of a character it holds."""
        enc = self._encoding(text, add_special_tokens, parse_special)
        text_bytes = text.encode("utf-8")
        char_starts = [0]
        for ch in text:
            char_starts.append(char_starts[-1] + len(ch.encode("utf-8")))
        out: list[TokenInfo] = []
        cursor = 0  # byte offset in the input where the next token's bytes should start
        for i, (tid, seq, (s, e)) in enumerate(zip(enc.ids, enc.sequence_ids, enc.offsets)):
            data = self.token_bytes(tid)
            span = None if seq is None else (s, e)
            parts: tuple[CharPart, ...] = ()
            if span is not None and not self.is_added(tid):
                where = _locate(text_bytes, data, cursor, char_starts[s], self.kind == "sentencepiece",
                                self.unencodable_bytes)
                if where is not None:
                    parts = _char_parts(char_starts, text, *where)
                    cursor = where[1]
                    if not char_starts[s] <= where[0] < max(char_starts[e], char_starts[s] + 1):
                        # the tokenizer's offsets lose count after a byte it dropped: the span follows the bytes
                        span = (bisect.bisect_right(char_starts, where[0]) - 1,
                                bisect.bisect_right(char_starts, max(where[1] - 1, where[0])))
            elif span is not None:
                cursor = char_starts[e]
            out.append(
                TokenInfo(
                    index=i,
                    id=tid,
                    piece=self.piece(tid),
                    visible=self.visible_piece(tid),
                    text=data.decode("utf-8", errors="replace"),
                    bytes=data,
                    span=span,
                    special=self.is_special(tid),
                    byte_fallback=self.is_byte_fallback(tid),
                    char_parts=parts,
                )
            )
        return out

    @cached_property
    def unencodable_bytes(self) -> frozenset[int]:
        """Bytes that no token stands for (a byte-level vocabulary may lack some: SmolLM2's lacks 21, e.g. 0x04). The
        tokenizer drops them from the text, as the reference tokenizer does."""
        if self.kind != "byte_level":
            return frozenset()
        return frozenset(b for b, ch in BYTE_TO_CHAR.items() if self.tok.token_to_id(ch) is None)

    def dropped_chars(self, text: str) -> list[int]:
        """Positions of the characters of `text` the tokenizer leaves out because a byte of theirs has no token."""
        dropped = self.unencodable_bytes
        if not dropped:
            return []
        return [i for i, ch in enumerate(text) if not dropped.isdisjoint(ch.encode("utf-8", errors="surrogatepass"))]

    def dropped_note(self, text: str, what: str = "text") -> str | None:
        """One line naming the characters `dropped_chars` finds, or None when there are none."""
        found = self.dropped_chars(text)
        if not found:
            return None
        n = len(found)
        shown = ", ".join(f"U+{ord(text[i]):04X} at char {i}" for i in found[:5]) + (" …" if n > 5 else "")
        return (f"{n} character{'s' if n != 1 else ''} of the {what} ha{'ve' if n != 1 else 's'} no token in this "
                f"vocabulary and {'are' if n != 1 else 'is'} left out of the ids ({shown}); the model never sees "
                f"{'them' if n != 1 else 'it'}")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- single tokens -----------------------------------------------------------------------------------------------

    def check_fits(self, n_rows: int, where: str) -> None:
        """The model has an embedding row for every id this tokenizer can produce (its files may not belong together:
        a tokenizer.json with an added token past the model's vocab_size would crash the embedding lookup)."""
        highest = max(self.vocab_size - 1, max(self._added, default=-1))
        if highest >= n_rows:
            raise LlmtraceError(f"{where}: the tokenizer has ids up to {highest} but the model has {n_rows} token rows "
                                f"(vocab_size); the tokenizer and the weights do not belong together")

    def check_id(self, tid: int) -> None:
        if not 0 <= tid < self.vocab_size:
            raise UsageError(f"token id {tid} is out of range: this vocabulary has ids 0..{self.vocab_size - 1}")

    def piece(self, tid: int) -> str:
        """The raw vocabulary string, e.g. 'Ġworld' (byte-level) or '▁world' (SentencePiece)."""
        p = self.tok.id_to_token(tid)
        if p is None:
            self.check_id(tid)
            return ""
        return p

    def is_added(self, tid: int) -> bool:
        """An added token (special or user-defined): matched whole in the text, never built by merges."""
        return tid in self._added

    def is_special(self, tid: int) -> bool:
        added = self._added.get(tid)
        return bool(added is not None and added.special)

    def is_byte_fallback(self, tid: int) -> bool:
        return self.kind == "sentencepiece" and _BYTE_FALLBACK.match(self.piece(tid)) is not None

    def token_bytes(self, tid: int) -> bytes:
        """The bytes this token stands for when decoded (an added token: its own text)."""
        return piece_bytes(self.piece(tid), self.kind if not self.is_added(tid) else "plain")

    def visible_piece(self, tid: int) -> str:
        """The piece as a reader should see it: '▁world', 'hello\\n', '<e4 bd>' for part of a character."""
        if self.is_added(tid):
            return self.piece(tid)
        if self.is_byte_fallback(tid):
            return self.piece(tid)
        return visible_text(self.token_bytes(tid))

    def visible(self, piece: str) -> str:
        """`visible_piece` for a raw piece string (e.g. an intermediate piece of a merge trace)."""
        if self.kind == "sentencepiece" and _BYTE_FALLBACK.match(piece):
            return piece
        return visible_text(piece_bytes(piece, self.kind))

    @cached_property
    def special_texts(self) -> list[str]:
        """The text of every special token, longest first (for highlighting)."""
        return sorted({a.content for a in self._added.values() if a.special}, key=len, reverse=True)

    @cached_property
    def merge_ranks(self) -> dict[tuple[str, str], int]:
        """(left, right) → rank for every merge of a BPE model; lower ranks are applied first."""
        model = json.loads(self.tok.to_str())["model"]
        if model.get("type") != "BPE":
            raise LlmtraceError(f"this tokenizer is a {model.get('type')} model, not BPE, so it has no merges")
        ranks = {}
        for rank, m in enumerate(model.get("merges", [])):
            pair = tuple(m) if isinstance(m, list) else _split_merge(m)
            ranks.setdefault(pair, rank)
        return ranks

    @cached_property
    def model_options(self) -> dict:
        model = json.loads(self.tok.to_str())["model"]
        return {k: model.get(k) for k in ("byte_fallback", "ignore_merges", "unk_token", "fuse_unk")}

    # -- chat --------------------------------------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise LlmtraceError("this model has no chat template; tokenize the text without --chat")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise LlmtraceError(f"{self._template_where}the chat template has a syntax error on line {e.lineno}: "
                                f"{e.message}") from None
        except Exception as e:  # jinja2's compiler on a template it cannot take (too deeply nested, ...)
            raise LlmtraceError(f"{self._template_where}the chat template cannot be compiled "
                                f"({type(e).__name__}: {one_line(e)})") from None

    @property
    def _template_where(self) -> str:
        """'FILE: ' for messages about the chat template, when the file it came from is known."""
        return f"{self.source}: " if self.source not in ("", "gguf") else ""

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt string the model's chat template makes of `messages` (the way HF's apply_chat_template does)."""
        import jinja2

        template = self._compiled_template
        names = {}
        for name, tid in (("bos_token", self.bos_id), ("eos_token", self.eos_ids[0] if self.eos_ids else None),
                          ("pad_token", self.pad_id), ("unk_token", self.unk_id)):
            if tid is not None:
                names[name] = self.piece(tid)
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **names, **extra)
        except _TemplateRaised as e:
            raise LlmtraceError(f"{self._template_where}the chat template refused these messages: {e}") from None
        except jinja2.TemplateError as e:
            raise LlmtraceError(f"{self._template_where}the chat template failed: {one_line(e)}") from None
        except Exception as e:  # the template's own expressions: 1/0, a bad format, a runaway recursion, ...
            raise LlmtraceError(f"{self._template_where}the chat template failed on these messages "
                                f"({type(e).__name__}: {one_line(e)})") from None

    def encode_prompt(self, text: str, chat: bool = False, system: str | None = None) -> tuple[str, list[int]]:
        """The text the model reads and its ids: `text` as is (BOS as the tokenizer adds it), or with `chat` the
        user message (after an optional system message) in the chat template, whose control tokens are its own."""
        if not chat:
            return text, self.encode(text)
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]
        prompt = self.render_chat(messages, add_generation_prompt=True)
        return prompt, self.encode(prompt, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"TextTokenizer({self.kind}, vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_ids})"


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------


def piece_bytes(piece: str, kind: str) -> bytes:
    """The bytes a vocabulary piece stands for."""
    if kind == "byte_level":
        try:
            return bytes(CHAR_TO_BYTE[c] for c in piece)
        except KeyError:  # not written in the byte alphabet (should not happen for a normal token)
            return piece.encode("utf-8")
    if kind == "sentencepiece":
        m = _BYTE_FALLBACK.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace(SPACE_MARK, " ").encode("utf-8")
    return piece.encode("utf-8")


def _locate(
    text_bytes: bytes, data: bytes, cursor: int, span_start: int, prefixed_space: bool,
    dropped: frozenset[int] = frozenset(),
) -> tuple[int, int] | None:
    """The byte range [b0, b1) of the input a token's bytes came from: at the cursor if they match there, else at its
    span's start, else after bytes at the cursor that the tokenizer drops (`dropped`: no token stands for them). A
    SentencePiece piece may begin with a '▁' that was prepended, not typed; that byte is skipped."""
    for at in (cursor, span_start):
        if text_bytes.startswith(data, at):
            return at, at + len(data)
        if prefixed_space and data[:1] == b" " and text_bytes.startswith(data[1:], at):
            return at, at + len(data) - 1
    at = cursor
    while at < len(text_bytes) and text_bytes[at] in dropped:
        at += 1
        if text_bytes.startswith(data, at):
            return at, at + len(data)
    return None


def _split_merge(m: str, where: str = "the tokenizer", index: int | None = None) -> tuple[str, str]:
    parts = m.split(" ")
    if len(parts) != 2:
        which = f"merge {index}" if index is not None else "merge"
        raise LlmtraceError(f"{where}: {which} {m!r} is malformed (expected 'left right'); {_DAMAGED}")
    return parts[0], parts[1]


# ---------------------------------------------------------------------------------------------------------------------
# consistency checks: what makes a vocabulary unusable is named here, before the tokenizers library refuses it
# ---------------------------------------------------------------------------------------------------------------------

_DAMAGED = "the file may be damaged: download it again"
_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "padding", "unknown")


def _check_gguf_vocab(get, tokens: list, types: list, merges: list | None, where: str) -> None:
    """The `tokenizer.ggml.*` values have the types and ranges a tokenizer can be built from."""

    def bad(what: str) -> LlmtraceError:
        return LlmtraceError(f"{where}: {what}; {_DAMAGED}")

    for key, values, kind in (("tokens", tokens, str), ("token_type", types, int), ("merges", merges or [], str)):
        if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
            raise bad(f"tokenizer.ggml.{key} is not a list of {kind.__name__}s")
    if len(types) != len(tokens):
        raise bad(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
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


def _gguf_vocab(tokens: list[str], where: str) -> dict[str, int]:
    """piece -> id. Two ids with one string cannot both be looked up (llama.cpp refuses such a file too)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise LlmtraceError(f"{where}: token {t!r} appears twice in tokenizer.ggml.tokens (ids {vocab[t]} and {i}); "
                                f"{_DAMAGED}")
        vocab[t] = i
    return vocab


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], shown: list | None, where: str, **options) -> Tokenizer:
    """A BPE tokenizer. When the library refuses the vocabulary, the merge at fault is named."""
    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=merges, **options))
    except Exception as e:
        _check_merges(vocab, merges, shown, where)
        raise LlmtraceError(f"{where}: the BPE model cannot be built ({one_line(e)}); {_DAMAGED}") from None


def _check_merges(vocab: dict, merges: list[tuple[str, str]], shown: list | None, where: str) -> None:
    """Every merge joins two pieces of the vocabulary into a third one, or BPE cannot be built. `shown[i]` is merge i
    as the file writes it."""
    for i, (left, right) in enumerate(merges):
        for piece, role in ((left, "names"), (right, "names"), (left + right, "makes")):
            if piece not in vocab:
                merge = shown[i] if shown is not None else f"{left} {right}"
                raise LlmtraceError(f"{where}: merge {i} {merge!r} {role} {piece!r}, which is not in the vocabulary; "
                                    f"{_DAMAGED}")


def _from_library(e: BaseException) -> bool:
    """An error the tokenizers library raises on bad input: a plain Exception, or pyo3's PanicException (which is a
    BaseException, so that `except Exception` lets it through)."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


@contextlib.contextmanager
def _library_errors(where: str, doing: str):
    """Whatever the tokenizers library raises in this block becomes one LlmtraceError naming the file."""
    try:
        yield
    except LlmtraceError:
        raise
    except BaseException as e:
        if not _from_library(e):
            raise
        raise LlmtraceError(f"{where}: {doing} ({one_line(e)})") from None


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float], skip: set[str]) -> list[tuple[str, str]]:
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


def _detect_kind(tok: Tokenizer) -> str:
    spec = json.loads(tok.to_str())
    parts = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    if '"ByteLevel"' in parts:
        return "byte_level"
    if spec.get("model", {}).get("byte_fallback") or SPACE_MARK in parts or SPACE_MARK in json.dumps(spec.get("normalizer")):
        return "sentencepiece"
    return "plain"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise LlmtraceError(f"{path}: not UTF-8 text (byte offset {e.start}); {_DAMAGED}") from None


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


def _parse_json(text: str, path: Path, unique_keys: bool = False) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys if unique_keys else None)
    except json.JSONDecodeError as e:
        raise LlmtraceError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except _DuplicateKey as e:
        raise LlmtraceError(f"{path}: {e}; {_DAMAGED}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = _parse_json(_read_text(path), path)
    return data if isinstance(data, dict) else {}


def load_tokenizer(spec: str | None = None) -> TextTokenizer:
    """Only the tokenizer of a model (`spec` as --model takes it). No weights are read, and torch is imported only
    the first time a GGUF file is used, when its conversion is not cached yet."""
    from llmtrace.registry import converted_dir, resolve

    resolved = resolve(spec)
    if resolved.kind == "gguf":
        dest = converted_dir(resolved.path)
        if (dest / "llmtrace_config.json").exists():
            return TextTokenizer.from_hf_dir(dest / "tokenizer")
        from llmtrace.loader import config_from_gguf, open_gguf

        reader = open_gguf(resolved.path)
        config_from_gguf(reader, str(resolved.path))  # refuse unsupported architectures here too
        return TextTokenizer.from_gguf(reader, str(resolved.path))
    if not (resolved.path / "tokenizer.json").exists():
        raise LlmtraceError(f"{resolved.path}: no tokenizer.json in this directory, so it has no tokenizer llmtrace can use")
    return TextTokenizer.from_hf_dir(resolved.path)


def _check_tokenizer_json(spec: Any, path: Path) -> None:
    """Why the tokenizers library refused a tokenizer.json, when it is one of these: a token or an id given twice, a
    merge naming (or making) a piece the vocabulary lacks. Run only after a refusal: it costs a full JSON parse."""

    def bad(what: str) -> LlmtraceError:
        return LlmtraceError(f"{path}: {what}; {_DAMAGED}")

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


def _post_processor_problem(tok: Tokenizer) -> str | None:
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
