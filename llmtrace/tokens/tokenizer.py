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

This module holds TextTokenizer and load_tokenizer; the vocabulary conversion and its checks are in vocab.py, the
per-token byte/span facts in token_facts.py, the chat messages and template helpers in chat_template.py (their public
names are importable from here too).
"""

from __future__ import annotations

import bisect
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from tokenizers import AddedToken, Tokenizer

from llmtrace.errors import FieldError, LlmtraceError, UsageError, one_line
from llmtrace.tokens.chat_template import gguf_chat_template, raise_exception, TemplateRaised, tojson
from llmtrace.tokens.token_facts import CharPart, TokenInfo, char_parts_of, locate, piece_bytes, visible_text
from llmtrace.tokens.vocab import (BYTE_FALLBACK, DAMAGED, BYTE_TO_CHAR, NORMAL, USER_DEFINED, byte_level_bpe,
                                   check_gguf_vocab, check_tokenizer_json, detect_kind, from_library,
                                   library_errors, parse_json, post_processor_of, post_processor_problem, read_json,
                                   read_text_file, sentencepiece_bpe, split_merge)
from llmtrace.units import plural

if TYPE_CHECKING:  # pragma: no cover
    import gguf


def _gguf_add_bos(get, default: bool, default_reason: str, bos_id: int | None) -> tuple[bool, str]:
    """Whether encode adds BOS, and why: tokenizer.ggml.add_bos_token, else the vocabulary kind's habit."""
    field = get("tokenizer.ggml.add_bos_token")
    if field is None:
        add_bos, reason = default, f"tokenizer.ggml.add_bos_token not set; {default_reason}"
    else:
        add_bos, reason = bool(field), f"tokenizer.ggml.add_bos_token = {str(bool(field)).lower()}"
    if add_bos and bos_id is None:
        return False, "the GGUF asks for BOS but names no tokenizer.ggml.bos_token_id"
    return add_bos, reason


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
        check_gguf_vocab(get, tokens, types, merges_raw, where)
        bos_id, eos_id = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
        notes: list[str] = []
        with library_errors(where, "the tokenizer could not be built from its vocabulary"):
            return cls._from_gguf_vocab(get, model, tokens, types, merges_raw, bos_id, eos_id, notes, where,
                                        source=path or "gguf")

    @classmethod
    def _from_gguf_vocab(cls, get, model, tokens, types, merges_raw, bos_id, eos_id, notes, where, source):
        """The parts in the order the tokenizer uses them: the BPE model of this vocabulary kind, the added tokens,
        BOS/EOS, the stop ids and the chat template."""
        if model == "gpt2":
            built = byte_level_bpe(get, tokens, types, merges_raw, where, notes)
        elif model == "llama":
            built = sentencepiece_bpe(get, tokens, types, merges_raw, where)
        else:
            raise LlmtraceError(
                f"{where}: tokenizer model {model!r} is not supported (llmtrace reads 'gpt2' and 'llama')"
            )
        tok = built.tok
        # Control tokens are matched whole in the text and are special; user-defined ones are matched whole too.
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(built.spelled, built.types) if ty in built.special_types])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(built.spelled, built.types) if ty == USER_DEFINED])
        add_bos, reason = _gguf_add_bos(get, built.default_bos, built.default_reason, bos_id)
        add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
        tok.post_processor = post_processor_of(tok, bos_id, eos_id, add_bos, add_eos)
        # Generation stops at EOS, and at end-of-turn / end-of-message tokens when the file names them.
        stops = (eos_id, get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id"))
        return cls(
            tok,
            kind=built.kind,
            bos_id=bos_id,
            eos_ids=[i for i in stops if i is not None],
            pad_id=get("tokenizer.ggml.padding_token_id"),
            unk_id=get("tokenizer.ggml.unknown_token_id"),
            add_bos=add_bos,
            add_eos=add_eos,
            add_bos_reason=reason,
            chat_template=gguf_chat_template(get, notes),
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
        text = read_text_file(tj)
        try:
            tok = Tokenizer.from_str(text)
        except BaseException as e:
            if not from_library(e):
                raise
            check_tokenizer_json(parse_json(text, tj, unique_keys=True), tj)  # names the inconsistency if it can
            raise LlmtraceError(f"{tj}: the tokenizers library cannot read it ({one_line(e)})") from None
        problem = post_processor_problem(tok)
        if problem:
            raise LlmtraceError(f"{tj}: {problem}; {DAMAGED}")
        with library_errors(str(tj), "the tokenizer cannot be set up"):
            return cls._from_hf_parts(tok, path)

    @classmethod
    def _from_hf_parts(cls, tok: Tokenizer, path: Path) -> "TextTokenizer":
        config = read_json(path / "tokenizer_config.json")
        special_map = read_json(path / "special_tokens_map.json")
        generation = read_json(path / "generation_config.json")
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
            tok.post_processor = post_processor_of(tok, bos_id, eos_id, add_bos, add_eos)
        else:  # the tokenizer.json post-processor decides
            empty = tok.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and empty[:1] == [bos_id]
            add_eos = eos_id is not None and empty[-1:] == [eos_id]
            reason = "tokenizer.json post-processor " + ("adds " + tok.id_to_token(bos_id) if add_bos else "adds no BOS")
        reason = ours.get("add_bos_reason", reason)

        template = None
        if (path / "chat_template.jinja").is_file():
            template = read_text_file(path / "chat_template.jinja")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)

        return cls(
            tok,
            kind=ours.get("kind") or detect_kind(tok),
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
                where = locate(text_bytes, data, cursor, char_starts[s], self.kind == "sentencepiece",
                                self.unencodable_bytes)
                if where is not None:
                    parts = char_parts_of(char_starts, text, *where)
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
        return (f"{plural(n, 'character')} of the {what} ha{'ve' if n != 1 else 's'} no token in this "
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
        return self.kind == "sentencepiece" and BYTE_FALLBACK.match(self.piece(tid)) is not None

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
        if self.kind == "sentencepiece" and BYTE_FALLBACK.match(piece):
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
            pair = tuple(m) if isinstance(m, list) else split_merge(m)
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
            raise FieldError("chat", ": this model has no chat template; tokenize the text without it")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
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
        except TemplateRaised as e:
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
