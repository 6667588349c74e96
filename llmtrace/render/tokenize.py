"""The terminal views of `llmtrace tokenize`: the token table, the chat template with its control tokens marked, the
BPE merge story and the summary line. Built from TextTokenizer facts; no torch."""

from __future__ import annotations

import json

from llmtrace.tokens.tokenizer import TextTokenizer
from llmtrace.tokens.token_facts import TokenInfo


def quoted(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def token_table(tokens: list[TokenInfo], title: str | None = None):
    from rich.table import Table

    from rich.text import Text

    table = Table(title=title, show_lines=False, header_style="bold")
    table.add_column("#", justify="right", style="dim")
    table.add_column("id", justify="right", style="cyan")
    table.add_column("piece")
    table.add_column("text")
    table.add_column("UTF-8 bytes")
    table.add_column("chars", justify="right")
    table.add_column("special")
    for t in tokens:
        span = "added" if t.span is None else f"{t.span[0]}–{t.span[1]}"
        piece_style = "bold magenta" if t.special else ("yellow" if t.char_parts or t.byte_fallback else None)
        table.add_row(
            str(t.index),
            str(t.id),
            Text(t.visible, style=piece_style or ""),
            quoted(t.text),
            t.bytes_label(),
            span,
            "yes" if t.special else "",
        )
    return table if tokens else Text("(no tokens)", style="dim")


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
        out.append(f"  ({n_final} token{'s' if n_final != 1 else ''}" + (f"; {w.note}" if w.note else "") + ")\n", style="dim")
    return out


def summary_line(tt: TextTokenizer, text: str, tokens: list[TokenInfo], info: dict):
    from rich.text import Text

    n = len(tokens)
    ratio = f"{len(text) / n:.2f} chars/token" if n else "– chars/token"
    bos = tt.piece(tt.bos_id) if tt.bos_id is not None else None
    out = Text()
    out.append(f"{n} token{'s' if n != 1 else ''}", style="bold")
    out.append(f" · {len(text)} chars · {len(text.encode('utf-8'))} bytes · {ratio}\n")
    out.append(f"BOS {bos or '(none)'}: {'added' if info['bos_added'] else 'not added'} ({info['reason']})")
    out.append(f" · EOS: {'added' if info['eos_added'] else 'not added'}")
    return out
