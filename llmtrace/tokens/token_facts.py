"""What a learner sees about each token: its bytes, the characters of the input it covers (and which bytes of a
multi-byte character, when BPE cut one apart), whether it is special; and whitespace made visible."""

from __future__ import annotations

import bisect
import unicodedata
from dataclasses import dataclass
from typing import Optional


from llmtrace.tokens.vocab import BYTE_FALLBACK, CHAR_TO_BYTE, SPACE_MARK


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
        return f"{where}/{self.total} of {shown_char(self.char)}"

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


def invisible(ch: str) -> bool:
    """A character a reader cannot see or tell from a space: other spaces (U+00A0, U+2009, U+3000), line and paragraph
    separators, format characters (zero-width space U+200B, joiners, U+FEFF, the soft hyphen), private-use and
    unassigned code points, and C1 controls."""
    return ch != " " and unicodedata.category(ch) in ("Zs", "Zl", "Zp", "Cf", "Cc", "Co", "Cn")


def combining(ch: str) -> bool:
    """A mark drawn on the character before it (U+0301, the combining acute accent): alone, it lands on whatever
    precedes it on the screen (a quote, a parenthesis)."""
    return unicodedata.category(ch) in ("Mn", "Me")


def emoji_modifier(ch: str) -> bool:
    """One of the five skin tones (U+1F3FB-U+1F3FF, Unicode's Emoji_Modifier): drawn into the emoji before it (👍🏽, two
    columns in all), but alone, or after a letter, a terminal draws it as a two-column swatch of its own, where rich
    counts none: a table with one in a cell was two columns wider on that row."""
    return 0x1F3FB <= ord(ch) <= 0x1F3FF


def sits_on(ch: str, before: Optional[str]) -> bool:
    """Whether CH is drawn together with BEFORE (the character shown just before it, None for none), so that the two
    take the columns rich counts for them: a combining mark on a letter or a symbol, a skin tone on an emoji."""
    if before is None or len(before) != 1 or before in ' "▁':
        return False
    if emoji_modifier(ch):
        return unicodedata.category(before) == "So" and unicodedata.east_asian_width(before) == "W"
    return combining(ch)


def drawn_alone(ch: str, before: Optional[str]) -> bool:
    """A character that needs its code point to be seen where it stands: one that is invisible, or one that is drawn
    on the character before it (a combining mark, a skin tone) with nothing here to be drawn on."""
    return invisible(ch) or ((combining(ch) or emoji_modifier(ch)) and not sits_on(ch, before))


def shown_char(ch: str) -> str:
    """One character named on its own ("1/2 of é"), as a reader can see it: '<U+0301>' for a combining mark or an
    invisible character, else the character."""
    return f"<U+{ord(ch):04X}>" if drawn_alone(ch, None) else ch


def visible_text(data: bytes) -> str:
    """Bytes as text a reader can see: ' ' → '▁', '\\n' → '\\\\n', '\\t' → '\\\\t', other control characters below
    0x80 as '\\\\xNN', every other invisible character (`invisible`) as '<U+00A0>', and bytes that are not (yet) a
    whole UTF-8 character as '<e4 bd>'. (The same rules, in the report's script: `vis` in report/assets/report.js.)"""
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
        elif drawn_alone(ch, out[-1] if out else None):  # a mark (or a skin tone) with nothing of its own to sit on
            out.append(f"<U+{ord(ch):04X}>")
        else:
            out.append(ch)
    if raw:
        out.append("<" + bytes(raw).hex(" ") + ">")
    return "".join(out)


def char_parts_of(char_starts: list[int], text: str, b0: int, b1: int) -> tuple[CharPart, ...]:
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


def piece_bytes(piece: str, kind: str) -> bytes:
    """The bytes a vocabulary piece stands for."""
    if kind == "byte_level":
        try:
            return bytes(CHAR_TO_BYTE[c] for c in piece)
        except KeyError:  # not written in the byte alphabet (should not happen for a normal token)
            return piece.encode("utf-8")
    if kind == "sentencepiece":
        m = BYTE_FALLBACK.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace(SPACE_MARK, " ").encode("utf-8")
    return piece.encode("utf-8")


def locate(
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


def bos_eos_summary(tt, tokens: list[TokenInfo], add_special: bool, chat: bool) -> dict:
    """Whether BOS and EOS were added to TOKENS, and why (the `tokenize` summary line and its JSON)."""
    added_ids = [t.id for t in tokens if t.span is None]
    bos_added = tt.bos_id is not None and tt.bos_id in added_ids[:1]
    eos_added = bool(added_ids) and added_ids[-1] in tt.eos_ids and (len(added_ids) > 1 or not bos_added)
    if chat and not add_special:
        why = "a chat prompt is encoded with add_special_tokens=False: the template writes its own control tokens"
    elif not add_special:
        why = "add_special_tokens=False"
    else:
        why = tt.add_bos_reason
    return {"bos_id": tt.bos_id, "bos_added": bos_added, "eos_ids": tt.eos_ids, "eos_added": eos_added, "reason": why}
