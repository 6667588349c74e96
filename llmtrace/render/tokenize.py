"""The terminal views of `llmtrace tokenize`: the token table, the chat template with its control tokens marked, the
BPE merge story and the summary line. Built from TextTokenizer facts; no torch."""

from __future__ import annotations

import json

from llmtrace.tokens.tokenizer import TextTokenizer
from llmtrace.tokens.token_facts import TokenInfo
from llmtrace.units import plural


def quoted(s: str) -> str:
    """A JSON string, with every invisible character (U+00A0, U+200B, ...), and a combining mark or a skin tone with no
    character before it to sit on (it would sit on the quote), escaped as \\u00a0 so that it shows."""
    from llmtrace.tokens.token_facts import drawn_alone

    out: list[str] = []
    for c in json.dumps(s, ensure_ascii=False):
        shown = ord(c) < 0x20 or not drawn_alone(c, out[-1] if out else None)  # json.dumps escaped controls already
        out.append(c if shown else f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else json.dumps(c)[1:-1])
    return "".join(out)


# The token table's columns: (name, justify, drop rank). At a narrow width the lowest rank is left out first; id and
# piece always stay. No cell is ever cut: an id, a span or a byte is shown whole, and a long piece or text wraps.
TOKEN_COLUMNS = (("#", "right", 3), ("id", "right", None), ("piece", "left", None), ("text", "left", 5),
                 ("UTF-8 bytes", "left", 4), ("chars", "right", 2), ("special", "left", 1))
# detokenize's: the same, without the character spans (ids have no place in a text)
ID_COLUMNS = (("#", "right", 2), ("id", "right", None), ("piece", "left", None), ("text", "left", 4),
              ("UTF-8 bytes", "left", 3), ("special", "left", 1))
STYLES = {"#": "dim", "id": "cyan"}


def fitted_table(columns: tuple, rows: list[list], width: int, title: str | None = None):
    """A bordered table of `rows` (Text cells) that fits `width` columns: columns left out by their drop rank rather
    than cut. Returns (the table, the names of the columns left out)."""
    from rich.table import Table

    from llmtrace.render.generate import fit_columns

    natural = [max([len(name)] + [r[i].cell_len for r in rows]) for i, (name, _, _) in enumerate(columns)]
    # a bordered column takes its text, a space on each side and its border (3 more), the table 1 more at its start;
    # fit_columns counts 2 between columns, so each column is given 1 more and the width 3 less
    keep = fit_columns([w + 1 for w in natural], [d for _, _, d in columns], width - 3)
    table = Table(title=title, show_lines=False, header_style="bold")
    for (name, justify, _), w, k in zip(columns, natural, keep):
        if k:  # whole, unless one cell alone is wider than the console: then it wraps (fold), never ends in '…'
            table.add_column(name, justify=justify, style=STYLES.get(name, ""), min_width=min(w, width // 2),
                             overflow="fold")
    for r in rows:
        table.add_row(*[c for c, k in zip(r, keep) if k])
    return table, [name for (name, _, _), k in zip(columns, keep) if not k]


def token_table(tokens: list[TokenInfo], width: int = 10**6, title: str | None = None):
    """The token table that fits `width` columns, borders included: (the table, the names of the columns left out)."""
    from rich.text import Text

    if not tokens:
        return Text("(no tokens)", style="dim"), []
    rows = []
    for t in tokens:
        span = "added" if t.span is None else f"{t.span[0]}–{t.span[1]}"
        piece_style = "bold magenta" if t.special else ("yellow" if t.char_parts or t.byte_fallback else None)
        rows.append([Text(str(t.index)), Text(str(t.id)), Text(t.visible, style=piece_style or ""),
                     Text(quoted(t.text)), Text(t.bytes_label()), Text(span), Text("yes" if t.special else "")])
    return fitted_table(TOKEN_COLUMNS, rows, width, title)


def highlight_specials(tt: TextTokenizer, text: str):
    """The templated prompt with control tokens in colour and newlines marked."""
    import re

    from rich.text import Text

    out = Text()
    specials = tt.special_texts
    pattern = re.compile("|".join(re.escape(s) for s in specials)) if specials else None
    pos = 0

    def plain(chunk: str) -> None:
        for i, line in enumerate(chunk.split("\n")):
            if i:
                out.append("\\n", style="dim")
                out.append("\n")
            out.append(line)

    for m in pattern.finditer(text) if pattern is not None else ():
        plain(text[pos : m.start()])
        out.append(m.group(), style="bold magenta")
        pos = m.end()
    plain(text[pos:])
    return out


def merge_lines(tt: TextTokenizer, traces, total_words: int | None):
    from rich.text import Text

    def joined(pieces) -> str:
        return "|".join(tt.visible(p) for p in pieces)

    out = Text()
    shown = len(traces)
    head = f"BPE merges, word by word ({shown} of {total_words} words)" if total_words is not None else "BPE merges"
    out.append(head + "\n", style="bold")
    for n, w in enumerate(traces):
        out.append(f"\nword {n} ", style="bold")
        out.append(quoted(w.text))
        span = f" chars {w.span[0]}–{w.span[1]}"
        if w.special:
            out.append(f"{span}: special token ", style="dim")
            out.append(w.word, style="bold magenta")
            out.append(", matched whole (no merges)\n", style="dim")
            continue
        out.append(f"{span}\n", style="dim")
        out.append(f"   start        {joined(w.start)}\n")
        width = max((len(str(s.rank)) for s in w.steps), default=1)
        for i, s in enumerate(w.steps, 1):
            out.append(f"   {i:>2}. rank {s.rank:>{width}}  ", style="dim")
            out.append(f"{tt.visible(s.pair[0])} + {tt.visible(s.pair[1])}", style="cyan")
            out.append(f"  →  {joined(s.pieces)}\n")
        n_final = len(w.final)
        out.append(f"   = {joined(w.final)}", style="bold")
        out.append(f"  ({plural(n_final, 'token')}" + (f"; {w.note}" if w.note else "") + ")\n", style="dim")
    return out


def summary_line(tt: TextTokenizer, text: str, tokens: list[TokenInfo], info: dict):
    from rich.text import Text

    n = len(tokens)
    ratio = f"{len(text) / n:.2f} chars/token" if n else "– chars/token"
    bos = tt.piece(tt.bos_id) if tt.bos_id is not None else None
    out = Text()
    out.append(plural(n, "token"), style="bold")
    out.append(f" · {plural(len(text), 'char')} · {plural(len(text.encode('utf-8')), 'byte')} · {ratio}\n")
    out.append(f"BOS {bos or '(none)'}: {'added' if info['bos_added'] else 'not added'} ({info['reason']})")
    out.append(f" · EOS: {'added' if info['eos_added'] else 'not added'}")
    return out
