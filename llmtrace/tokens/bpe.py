"""The BPE merge story of a text, word by word (`llmtrace tokenize --merges`).

BPE never sees the whole text at once. The pre-tokenizer first cuts it into words (' world', '2', '\\n\\n'); each word
starts as its smallest pieces (one per byte in a byte-level vocabulary: 'Ġ|w|o|r|l|d'), and then, again and again,
the adjacent pair with the best (lowest) merge rank is glued together, until no pair left is in the merge table:

    Ġ|w|o|r|l|d  --(o r, rank 11)-->  Ġ|w|or|l|d  --(Ġ w, rank 20)-->  Ġw|or|l|d  --> ... -->  Ġworld

The pieces left at the end are the word's tokens. Special-token text such as '<|im_start|>' is matched whole before
any of this and never merged. The final pieces here equal the tokenizer's own tokens (tests/test_tokenize.py checks it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenizers import pre_tokenizers

from llmtrace.tokens.tokenizer import TextTokenizer


@dataclass(frozen=True)
class MergeStep:
    rank: int  # position in the merge table: lower merges first
    pair: tuple[str, str]  # the two pieces glued together
    at: int  # index of the left piece before the merge
    pieces: tuple[str, ...]  # the word's pieces after this merge

    def to_dict(self) -> dict:
        return {"rank": self.rank, "pair": list(self.pair), "at": self.at, "pieces": list(self.pieces)}


@dataclass
class WordTrace:
    word: str  # the word as the BPE model sees it (byte-level: 'Ġworld')
    text: str  # the input characters it came from (' world')
    span: tuple[int, int]  # [start, end) in characters of the input
    start: tuple[str, ...]  # the pieces before any merge
    steps: list[MergeStep] = field(default_factory=list)
    special: bool = False  # an added token matched whole: no merges
    note: str | None = None  # why there are no merge steps, when that needs saying

    @property
    def final(self) -> tuple[str, ...]:
        return self.steps[-1].pieces if self.steps else self.start

    def to_dict(self) -> dict:
        return {
            "word": self.word,
            "text": self.text,
            "span": list(self.span),
            "special": self.special,
            "start": list(self.start),
            "steps": [s.to_dict() for s in self.steps],
            "final": list(self.final),
            "note": self.note,
        }


def merge_word(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[MergeStep]:
    """Apply merges to one word until none applies; one step per merge, leftmost first among equal ranks."""
    pieces = list(symbols)
    steps: list[MergeStep] = []
    while len(pieces) > 1:
        best_rank, best_at = None, -1
        for i in range(len(pieces) - 1):
            rank = ranks.get((pieces[i], pieces[i + 1]))
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_at = rank, i
        if best_rank is None:
            break
        pair = (pieces[best_at], pieces[best_at + 1])
        pieces[best_at : best_at + 2] = [pair[0] + pair[1]]
        steps.append(MergeStep(best_rank, pair, best_at, tuple(pieces)))
    return steps


def _added_pattern(tt: TextTokenizer, parse_special: bool) -> re.Pattern | None:
    """A regex matching the added tokens that are cut out of the text whole (longest first)."""
    added = tt.tok.get_added_tokens_decoder().values()
    texts = sorted({a.content for a in added if parse_special or not a.special}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


def _segments(text: str, pattern: re.Pattern | None) -> list[tuple[str, int, bool]]:
    """(segment, char offset, is_added_token) in order."""
    out, pos = [], 0
    for m in pattern.finditer(text) if pattern is not None else ():
        if m.start() > pos:
            out.append((text[pos : m.start()], pos, False))
        out.append((m.group(), m.start(), True))
        pos = m.end()
    if pos < len(text):
        out.append((text[pos:], pos, False))
    return out


def _initial_symbols(tt: TextTokenizer, word: str, vocab: dict[str, int], byte_fallback: bool) -> list[str]:
    """The pieces a word starts as: its characters, each replaced by '<0xNN>' byte tokens when it is not in the
    vocabulary and the model has byte fallback."""
    if tt.kind == "byte_level" or not byte_fallback:
        return list(word)
    out = []
    for ch in word:
        if ch in vocab:
            out.append(ch)
        else:
            out.extend(f"<0x{b:02X}>" for b in ch.encode("utf-8"))
    return out


def trace_merges(
    tt: TextTokenizer, text: str, parse_special: bool = True, max_words: int | None = None,
    max_chars: int | None = None,
) -> list[WordTrace]:
    """The merge story of each word of `text`, using the tokenizer's own normalizer, pre-tokenizer and merge table.
    `max_chars`: a longer word (a tokenizer that merges across spaces, SentencePiece's, sees the whole text as one)
    gets no story: each of its merges would repeat every piece of it."""
    ranks = tt.merge_ranks
    options = tt.model_options
    vocab = tt.tok.get_vocab(with_added_tokens=False)
    pre = tt.tok.pre_tokenizer
    norm = tt.tok.normalizer
    traces: list[WordTrace] = []
    for segment, offset, is_added in _segments(text, _added_pattern(tt, parse_special)):
        if max_words is not None and len(traces) >= max_words:
            break
        if is_added:
            traces.append(
                WordTrace(segment, segment, (offset, offset + len(segment)), (segment,), special=True,
                          note="added token: matched whole, never merged")
            )
            continue
        normalized = norm.normalize_str(segment) if norm is not None else segment
        seg_pre = pre
        if isinstance(pre, pre_tokenizers.Metaspace) and pre.prepend_scheme == "first" and offset > 0:
            # '▁' is prepended only to the very start of the text, not after a special token.
            seg_pre = pre_tokenizers.Metaspace(replacement=pre.replacement, prepend_scheme="never", split=pre.split)
        words = seg_pre.pre_tokenize_str(normalized) if seg_pre is not None else [(normalized, (0, len(normalized)))]
        for word, (s, e) in words:
            if max_words is not None and len(traces) >= max_words:
                break
            # Offsets are in the normalized segment; without a normalizer they are the input's characters.
            span = (offset + s, offset + e) if norm is None else (offset, offset + len(segment))
            source = text[span[0] : span[1]]
            if max_chars is not None and len(word) > max_chars:
                traces.append(WordTrace(word, source, span, (word,), note=f"{len(word):,} characters merged as one "
                                        f"word: too long to show merge by merge"))
                continue
            if options.get("ignore_merges") and word in vocab:
                traces.append(WordTrace(word, source, span, (word,), note="the whole word is a token (ignore_merges)"))
                continue
            start = _initial_symbols(tt, word, vocab, bool(options.get("byte_fallback")))
            trace = WordTrace(word, source, span, tuple(start), merge_word(start, ranks))
            if not trace.steps:
                trace.note = "a single piece: nothing to merge" if len(start) == 1 else "no merge applies"
            traces.append(trace)
    return traces
