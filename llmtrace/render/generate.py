"""The terminal view of a trace: rich tables built only from events, so live runs and saved traces look the same.

Every table fits the console's width (the terminal's, or $COLUMNS, or 100 when stdout is not a terminal): when the
columns do not fit, the least useful ones are left out (`fit_columns`), and a cell that is still too long wraps onto a
second line instead of being cut, so a number is never truncated. Wide consoles get the full top-k and sampler chain.
At --trace layers/full the statistics of a pass are shown one line per layer; every value stays in --json/--jsonl.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmtrace.model.points import AXES
from llmtrace.model.llama_points import DOWN, KV_WRITE, LOGITS, O_PROJ, PROBS, RESID_MID, RESID_POST, SCORES
from llmtrace.trace.reader import trace_points
from llmtrace.units import human_bytes, noun, plural
from llmtrace.words import in_words
from llmtrace.render.say import Say, verbatim

DETAIL_ROWS = 40  # a pass with at most this many recorded points is shown point by point, else one line per layer
GAP = 2  # columns between two table columns (padding 1 on each side, none at the edges)


def visible(text: str) -> str:
    """Whitespace made visible the way `llmtrace tokenize` shows it: ▁ for a space, \\n, \\t, \\xNN."""
    from llmtrace.tokens.token_facts import visible_text

    return visible_text(text.encode("utf-8", errors="surrogatepass"))


def piece_view(tok: dict) -> str:
    """A token as `llmtrace tokenize` shows it in its piece column: its bytes made visible ('▁capital', '\\n'), a
    special token as written ('<|im_end|>'), and part of a character as its bytes ('<e4 bd>')."""
    if tok.get("special"):
        return tok["piece"]
    if "\ufffd" in tok.get("text", "") and tok.get("piece"):
        from llmtrace.tokens.vocab import CHAR_TO_BYTE
        from llmtrace.tokens.token_facts import visible_text

        if all(c in CHAR_TO_BYTE for c in tok["piece"]):  # a byte-level piece: its bytes are exact
            return visible_text(bytes(CHAR_TO_BYTE[c] for c in tok["piece"]))
        return tok["piece"]
    return visible(tok.get("text", ""))


def quoted(text: str) -> str:
    """A token's text as `llmtrace tokenize` shows it in its text column: a JSON string."""
    import json

    return json.dumps(text, ensure_ascii=False)


def fmt_num(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.3e}"
    return f"{x:.4f}"


def fmt_short(x) -> str:
    """Four significant digits, for the one-line-per-layer view: 0.1234, 12.35, 1235, 1.235e+05."""
    if x is None:
        return "—"
    if x == 0:
        return "0"
    return f"{x:.4g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.3e}"


def shape_text(s, axes=None) -> str:
    """[9, 9, 64], or with the axes the model declares for it, [T=9, H=9, Dh=64]."""
    if axes and len(axes) == len(s):
        return "[" + ", ".join(f"{a}={d}" for a, d in zip(axes, s)) + "]"
    return "[" + ", ".join(str(d) for d in s) + "]"


def axes_for(points, name: str, shape) -> Optional[list]:
    """The axes the model declares for a point, where they describe this shape (model.points.Point.axes)."""
    p = points.get(name)
    return list(p.axes) if p is not None and len(p.axes) == len(shape) else None


def storage_parts(rows: list[dict], unit: str = "B/weight") -> list[str]:
    """The model's matrices grouped by storage (and kernel, on the fast path): ['Q4_1 0.625 B/weight ×120',
    'Q8_0 1.0625 B/weight ×1'], or ['Q4_1 0.625 B/weight on int4pack_mm_for_cpu ×120', …]."""
    groups: dict[tuple, int] = {}
    for r in rows:
        key = (r["type"], r["bytes_per_weight"], r.get("kernel"))
        groups[key] = groups.get(key, 0) + 1
    return [f"{t} {b:g} {unit}{f' on {k}' if k else ''} ×{n}" for (t, b, k), n in groups.items()]


def print_changes(console: Console, m: dict, say=None) -> None:
    """What the model's family changes from Llama (the model record's `changes`), one line each, in the order the
    maths runs, in the language of `say` (render.say.Say; English without one): each line from its family's words
    by its recorded key (model.family.said_in); nothing for Llama itself."""
    changes = m.get("changes") or []
    if changes:
        from rich.table import Table

        from llmtrace.model.family import said_in

        say = say or Say()
        said = m.get("changes_said") or []
        family = m.get("family", m.get("arch", "?"))
        console.print(Text.assemble(verbatim(family), say("explain.changes"), style="bold"))
        grid = Table.grid(padding=(0, 1))
        grid.add_column(width=3, justify="right")
        grid.add_column(overflow="fold")
        for i, line in enumerate(changes):
            grid.add_row("·", (said_in(m.get("family"), said[i], say.lang) if i < len(said) and said[i] else None)
                       or line)
        console.print(grid)


def print_note(console: Console, line: str, style: str = "", first: str = "  ", rest: str = "    ") -> None:
    """A note under a step's row (a sampler stage's numbers) or a line of the run's header: after `first` (and the
    line's own leading spaces), and the lines it wraps onto between words after `rest`, never at column 0 under the
    table's step numbers or the header's labels. A line that fits is printed as it is."""
    from rich.cells import cell_len

    body = line.lstrip(" ")
    first += line[: len(line) - len(body)]
    lines: list[str] = []
    current = ""
    for word in body.split(" "):
        room = console.width - len(first if not lines else rest)
        candidate = word if not current else f"{current} {word}"
        if current and cell_len(candidate) > room:
            lines.append(current)
            current = word
        else:
            current = candidate
    lines.append(current)
    for i, text in enumerate(lines):
        console.print(Text((first if i == 0 else rest) + text, style=style), soft_wrap=True)


def print_parts(console: Console, parts: list[str], style: Optional[str] = None, sep: str = " · ") -> None:
    """Print `parts` joined by `sep`, breaking lines only between parts, so that '14.4 tok/s' is never split."""
    line = ""
    for i, part in enumerate(parts):
        candidate = part if not line else line + sep + part
        ends = sep.rstrip() if i < len(parts) - 1 else ""  # a line that breaks after this part ends with the sep
        if line and Text(candidate + ends).cell_len > console.width:
            print_note(console, line + sep.rstrip(), style or "", first="")  # a part wider than the console: indented
            line = "  " + part
        else:
            line = candidate
    if line:
        print_note(console, line, style or "", first="")


# ----------------------------------------------------------------------------------------------------------------
# tables that fit: columns dropped by priority, cells wrapped rather than cut

Cell = Union[str, Text]


@dataclass
class Column:
    name: str
    justify: str = "left"
    drop: Optional[int] = None  # 1 is left out first when the table does not fit; None: always shown


def fit_columns(widths: list[int], drops: list[Optional[int]], width: int) -> list[bool]:
    """Which columns to keep so that their widths and the gaps between them fit `width`: the column with the lowest
    drop rank goes first, then the next, until the table fits or only the undroppable columns are left."""
    keep = [True] * len(widths)
    order = sorted((d, i) for i, d in enumerate(drops) if d is not None)
    for _, i in order:
        kept = [w for w, k in zip(widths, keep) if k]
        if sum(kept) + GAP * (len(kept) - 1) <= width:
            break
        keep[i] = False
    return keep


def fitted_table(console: Console, columns: list[Column], rows: list[list[Cell]], title: Optional[str] = None,
                 show_header: bool = True) -> tuple[Table, list[str]]:
    """A rich Table of `rows` that fits the console: (table, names of the columns left out)."""
    def cell_len(c: Cell) -> int:
        return (c if isinstance(c, Text) else Text(c)).cell_len

    widths = [max([len(col.name) if show_header else 0] + [cell_len(r[i]) for r in rows]) for i, col in enumerate(columns)]
    keep = fit_columns(widths, [c.drop for c in columns], console.width)
    t = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold", show_header=show_header, title=title)
    for col, w, k in zip(columns, widths, keep):
        if k:  # min_width keeps numbers whole; what still does not fit wraps (fold), never ends in '…'
            t.add_column(col.name, justify=col.justify, min_width=min(w, console.width // 2), overflow="fold")
    for r in rows:
        t.add_row(*[c for c, k in zip(r, keep) if k])
    return t, [c.name for c, k in zip(columns, keep) if not k]


def print_columns(console: Console, columns: list[Column], rows: list[list[str]]) -> list[str]:
    """The plain-string form of `print_table` for the tables printed at every step of a deep trace: the same fitting
    (columns dropped by priority, nothing cut), laid out as one Text. A rich Table of 30 rows costs ~40 ms to lay out,
    a quarter of a traced decode step; this costs ~1 ms. Returns the names of the columns left out."""
    widths = [max([len(col.name)] + [len(r[i]) for r in rows]) for i, col in enumerate(columns)]
    keep = fit_columns(widths, [c.drop for c in columns], console.width)
    cols = [(i, c, w) for i, (c, w, k) in enumerate(zip(columns, widths, keep)) if k]

    def line(cells: list[str]) -> str:
        return (" " * GAP).join(cells[i].rjust(w) if c.justify == "right" else cells[i].ljust(w)
                                for i, c, w in cols).rstrip()

    out = Text(line([c.name for c in columns]), style="bold")
    for r in rows:
        out.append("\n" + line(r), style="")
    console.print(out, overflow="fold")
    return [c.name for c, k in zip(columns, keep) if not k]


def columns_left_out(console: Console, names: list[str], say=None) -> Text:
    """The note under a table that had to leave columns out: a terminal can be widened; a pipe or a file has the
    width of $COLUMNS, else 100 (the README says so), and the note just says what that width left out. `say`: the
    view's words (render.say.Say), for a view in another language."""
    if say is not None:
        key = "table.narrow" if console.is_terminal else "table.left_out"
        return Text(say(key, names=say("table.sep").join(names), width=console.width), style="dim")
    if console.is_terminal:
        return Text(f"(narrow console: {', '.join(names)} left out; widen it, or see --json)", style="dim")
    return Text(f"(left out to fit {console.width} columns: {', '.join(names)}; see --json)", style="dim")


def print_table(console: Console, columns: list[Column], rows: list[list[Cell]]) -> None:
    t, dropped = fitted_table(console, columns, rows)
    if dropped:  # above the table, as every table's note
        console.print(columns_left_out(console, dropped))
    console.print(t)


def print_fitted(console: Console, table: Table, say=None) -> None:
    """Print a Table already filled so that no number in it is cut: every column keeps its full width (min_width)
    except token text, which gives way first; when that is not enough the rightmost columns are left out, with a note
    that names them."""
    def natural(col) -> int:
        cells = [col.header] + list(col._cells)
        return max(((c if isinstance(c, Text) else Text(str(c))).cell_len for c in cells if isinstance(c, (str, Text))),
                   default=1)

    def bends(col) -> bool:  # a column of token text may be shortened ('▁capit…'); numbers, shapes and names not
        return "token" in str(col.header)

    pad = table.padding[1] + table.padding[3] if len(table.padding) == 4 else 2
    dropped = []
    while True:
        need = sum(min(natural(c), 8) if bends(c) else natural(c) for c in table.columns)
        need += pad * len(table.columns)
        if need <= console.width or len(table.columns) <= 2:
            break
        dropped.insert(0, str(table.columns.pop().header))
    for col in table.columns:
        if not bends(col):
            col.min_width, col.no_wrap, col.overflow = natural(col), True, "fold"
    if dropped:  # above the table, as every table's note
        console.print(columns_left_out(console, dropped, say))
    console.print(table)


# ----------------------------------------------------------------------------------------------------------------
# the sampler's effect on one step


def sampler_settings(s: dict, row_seeds: Optional[list] = None) -> list[str]:
    """Every sampler setting that differs from its default, in words, and the stages that run in their order. A batch
    (`row_seeds`) names each row's seed."""
    parts = ["greedy (temperature 0)" if s.get("temperature") == 0 else f"sampling, temperature {s.get('temperature', 1):g}"]
    for key, default in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("typical_p", 1.0), ("repetition_penalty", 1.0),
                         ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
        v = s.get(key)
        if v is not None and v != default:
            parts.append(f"{key.replace('_', '-')} {v:g}")
    bias = s.get("logit_bias") or {}
    if bias:
        parts.append("logit-bias " + ", ".join(f"{tid}={b:+g}" for tid, b in bias.items()))
    ban = s.get("ban") or []
    if ban:
        parts.append(f"ban {plural(len(ban), 'sequence')} (ids " + "; ".join(" ".join(map(str, q)) for q in ban) + ")")
    parts += llama_cpp_settings(s)
    stages = s.get("stages") or []
    if stages:
        parts.append("stages " + " → ".join(stages))
    if s.get("temperature") == 0:
        pass  # greedy draws nothing: a seed would be a number that nothing used
    elif row_seeds and len(row_seeds) > 1:
        parts.append(f"seeds {row_seeds[0]}…{row_seeds[-1]} (row r: seed + r)")
    else:
        parts.append(f"seed {s.get('seed')}")
    return parts


def winner_changes(ev: dict) -> list[tuple[str, int, int]]:
    """(stage, most likely token before it, after it) for every sampler stage that changed the most likely token."""
    stages = ev.get("sampler") or []
    out = []
    for before, after in zip(stages, stages[1:]):
        if "top" in before and "top" in after and before["top"] != after["top"]:
            out.append((after["stage"], before["top"], after["top"]))
    return out


def _token_name(ev: dict, tid: int) -> str:
    """A token id of this step in words, from the step's own records: '▁Paris (p 0.77)', or 'id 1234'."""
    for c in ev.get("topk") or []:
        if c["id"] == tid:
            return f"{visible(c['text'])} (p {c['prob']:.2f})"
    if ev["token"]["id"] == tid:
        return visible(ev["token"]["text"])
    return f"id {tid}"


def json_text(text: str) -> str:
    """A short text as a JSON string ("\\n", ":"): what a breaker is, whitespace included."""
    import json

    return json.dumps(text, ensure_ascii=False)


def _named(entry: dict) -> str:
    return visible(entry.get("text", "")) or f"id {entry['id']}"


def stage_lines(ev: dict) -> list[str]:
    """One line for each stage of this step that records what it did (DRY, top-nσ, XTC, mirostat): its numbers over
    the whole vocabulary and, when it did nothing, why."""
    return [line for s in ev.get("sampler") or [] if (line := stage_line(s, ev)) is not None]


def stage_line(s: dict, ev: dict) -> Optional[str]:
    """`stage_lines` for one stage entry `s` of the step event `ev` (None for a stage without a detail)."""
    d = s.get("detail")
    if d is None:
        return None
    name = s["stage"]
    if name == "dry":
        return _dry_line(d)
    if name == "top_n_sigma":
        n, sigma = d["n"], d.get("sigma") or 0.0
        names = [x["stage"] for x in ev.get("sampler") or []]
        return (f"top-nσ: kept {plural(s['survivors'], 'token')} with logit ≥ max − {n:g}σ = {fmt_short(d.get('max'))}"
                f" − {fmt_short(n * sigma)} = {fmt_short(d.get('threshold'))} (σ of {d['candidates']:,} logits"
                + ("; the same tokens at any temperature)" if "temperature" in names else ")"))
    if name == "xtc":
        return _xtc_line(d)
    if name == "mirostat":
        return _mirostat_line(d, s["survivors"], ev.get("token") or {})
    return None


def llama_cpp_settings(s: dict) -> list[str]:
    """The settings of DRY, top-nσ, XTC and mirostat that differ from off, and what mirostat or greedy ignores."""
    parts = []
    for key, default in (("top_n_sigma", 0.0), ("xtc_probability", 0.0), ("dry_multiplier", 0.0)):
        v = s.get(key)
        if v is not None and v != default:
            parts.append(f"{key.replace('_', '-')} {v:g}")
    if s.get("xtc_probability"):
        parts.append(f"xtc-threshold {s.get('xtc_threshold', 0.1):g}")
    if "dry" in (s.get("stages") or []):
        last_n = s.get("dry_penalty_last_n")
        breakers = " ".join(json_text(b) for b in s.get("dry_sequence_breakers") or []) or "none"
        parts.append(f"dry-base {s.get('dry_base', 1.75):g}, dry-allowed-length {s.get('dry_allowed_length', 2)}, "
                     f"dry-penalty-last-n {'all' if last_n == -1 else last_n}, breakers {breakers}")
    ignored = ", ".join(i.replace("_", "-") for i in s.get("ignored") or [])
    if s.get("mirostat"):
        tau = s.get("mirostat_tau", 5.0)
        parts.append(f"mirostat {s['mirostat']} (τ {tau:g} bits, η {s.get('mirostat_eta', 0.1):g}, μ from {2 * tau:g}) "
                     f"replaces penalties, DRY and truncation as in llama.cpp" + (f": ignores {ignored}" if ignored else ""))
    elif ignored:
        parts.append(f"greedy ignores {ignored}")
    return parts


def _dry_line(d: dict) -> str:
    allowed = d["allowed_length"]
    if d.get("limit") is None:
        return f"dry: no penalty: the context has {plural(d['scanned'], 'token')}, not more than the allowed length {allowed}"
    if d["limit"] < allowed:
        return (f"dry: no penalty: a sequence breaker {plural(d['breaker_distance'], 'token')} from the end limits "
                f"repeats to {d['limit']} (allowed length {allowed})")
    exempt = d.get("exempt") or []
    tail = f"; {', '.join(_named(e) for e in exempt[:4])} exempt (sequence breaker)" if exempt else ""
    if not d["n_penalised"]:
        return (f"dry: no penalty: the longest repeat a token could extend is {d['longest']} < allowed length "
                f"{allowed} ({plural(d['scanned'], 'token')} scanned){tail}")
    hits = ", ".join(f"{_named(e)} n={e['n']} −{fmt_short(e['penalty'])}" for e in d["penalised"][:5])
    more = "…" if d["n_penalised"] > 5 else ""
    return (f"dry: {plural(d['n_penalised'], 'token')} penalised by {fmt_short(d['multiplier'])}×"
            f"{fmt_short(d['base'])}^(n−{allowed}), n the repeat it would extend: {hits}{more}{tail}")


def _xtc_line(d: dict) -> str:
    p, t = d["probability"], d["threshold"]
    if d.get("draw") is None:
        why = f"threshold {t:g} > 0.5, no two tokens can reach it" if t > 0.5 else "fewer than 2 candidates"
        return f"xtc: no draw: {why}"
    u = f"draw {d['draw']:.4f}"
    if not d["fired"]:
        return f"xtc: {u} ≥ {p:g}: did not act this step"
    if not d.get("n_removed"):
        return f"xtc: {u} < {p:g}: acted, but only {plural(d['over'], 'token')} had p ≥ {t:g}: nothing removed"
    gone = ", ".join(f"{_named(e)} {e['p']:.3f}" for e in d["removed"][:5]) + ("…" if d["n_removed"] > 5 else "")
    kept = d["kept"]
    return (f"xtc: {u} < {p:g}: removed {plural(d['n_removed'], 'token')} with p ≥ {t:g} ({gone}); kept the least "
            f"likely of them, {_named(kept)} {kept['p']:.3f}")


def _mirostat_line(d: dict, kept: int, token: dict) -> str:
    after = ""
    if d.get("mu_after") is not None:  # (a surprise of -0.00 is p = 1 rounded)
        after = f"; {visible(token.get('text', ''))}: {max(d['surprise'], 0.0) + 0.0:.2f} bits, μ → {d['mu_after']:.3f}"
    if d["version"] == 1:
        k = "k not a number: all kept" if d.get("k") is None else f"k = {fmt_short(d['k'])}"
        s_hat = "–" if d.get("s_hat") is None else f"{d['s_hat']:.3f}"
        return f"mirostat v1: Zipf ŝ {s_hat} (top 100), μ {d['mu']:.3f} → {k}: kept {kept}{after}"
    return f"mirostat v2: kept {plural(kept, 'token')} with surprise −log₂p ≤ μ {d['mu']:.3f}{after}"


def survivors_chain(stages: list[dict], width: Optional[int] = None) -> str:
    """Each stage's survivors, '49,152→49,152→40→12', or in less room with repeats merged ('49,152→40→12'), then the
    first and last ('49,152→…→12'), then the last alone: every number shown is whole."""
    counts = [s["survivors"] for s in stages]
    merged = [n for i, n in enumerate(counts) if i == 0 or n != counts[i - 1]]
    forms = [counts, merged, counts[:1] + [None] + counts[-1:], [None] + counts[-1:]]
    out = ""
    for form in forms:
        out = "→".join("…" if n is None else f"{n:,}" for n in form)
        if width is None or len(out) <= width:
            break
    return out


# ----------------------------------------------------------------------------------------------------------------
# the step table: one row per generated token, printed as it happens, so its layout is fixed by the first step


@dataclass
class StepLayout:
    """Column widths of the step table, worked out once from the console width and the first step."""

    keep: dict[str, int]  # column name -> width, in display order

    JUSTIFY = {"step": "right", "row": "right", "pos": "right", "id": "right", "KV len": "right", "KV bytes": "right", "ms": "right"}

    @classmethod
    def for_step(cls, ev: dict, run: Optional[dict], width: int) -> "StepLayout":
        kv = ev["kv_cache"]
        capacity = kv.get("capacity") or max(kv["seq_len"], 1)
        ctx = len(str((run or {}).get("model", {}).get("max_seq_len") or capacity))
        vocab = (run or {}).get("model", {}).get("vocab_size") or 10 ** 5
        stages = ev.get("sampler") or []
        greedy = (ev.get("rng") or {}).get("greedy")
        full = "greedy argmax" if greedy or not stages else survivors_chain(stages)
        merged = "greedy argmax" if greedy or not stages else survivors_chain(stages, width=len(full) - 1)
        topk = ev.get("topk") or []
        cands = [len(_candidate(c)) for c in topk]
        three = min(36, sum(cands[:3]) + 2 * (len(cands[:3]) - 1))
        # (name, minimum width, wanted width, drop rank): KV len equals pos, so it goes first; under greedy the
        # survivors say only "greedy argmax" and go before the id
        cols = [("step", max(4, ctx), None, None), ("pos", max(3, ctx), None, None), ("token", 8, 16, None),
                ("id", max(2, len(str(vocab - 1))), None, 4 if greedy else 3),
                ("top candidates (p)", max(18, three), None, None),
                ("survivors", max(9, min(len(merged) + 1, 16)), len(full) + 2, 3 if greedy else 4),
                ("KV len", max(6, len(str(capacity))), None, 1),
                ("KV bytes", max(8, len(f"{capacity * kv['bytes_per_token'] + kv.get('state', {}).get('bytes', 0):,}")),
                 None, 2), ("ms", 7, None, 5)]
        if "row" in ev:  # a batch: which row the token belongs to
            cols.insert(1, ("row", 3, None, None))
        keep = fit_columns([c[1] for c in cols], [c[3] for c in cols], width)
        kept = [c for c, k in zip(cols, keep) if k]
        widths = {name: lo for name, lo, _, _ in kept}
        wants = {name: want for name, _, want, _ in kept if want is not None}
        spare = width - sum(widths.values()) - GAP * (len(kept) - 1)
        for name in ("token", "survivors"):
            if name in widths and spare > 0:
                grow = max(0, min(spare, wants[name] - widths[name]))
                widths[name] += grow
                spare -= grow
        widths["top candidates (p)"] += max(0, spare)  # the rest: as much of the top-k as fits
        return cls(keep=widths)
    def table(self, show_header: bool) -> Table:
        t = Table(box=None, padding=(0, 1), pad_edge=False, show_header=show_header, header_style="bold")
        for name, w in self.keep.items():  # a fixed width keeps the rows aligned; a longer cell wraps, never cut
            t.add_column(name, width=w, justify=self.JUSTIFY.get(name, "left"), overflow="fold")
        return t


def _candidate(c: dict) -> str:
    return f"{visible(c['text'])}:{c['prob']:.2f}"


def _candidates(topk: list[dict], width: int) -> str:
    """As many whole candidates as fit in `width` (at least one): a probability is never cut."""
    out = ""
    for c in topk:
        nxt = _candidate(c) if not out else out + "  " + _candidate(c)
        if out and len(nxt) > width:
            break
        out = nxt
    return out


# ----------------------------------------------------------------------------------------------------------------
# the renderer


class TerminalRenderer:
    """Consumes events one at a time and prints the matching part of the view."""

    def __init__(self, console: Console, show_steps: bool = True, stream_text: bool = False):
        self.console = console
        self.show_steps = show_steps
        self.stream_text = stream_text
        self.run: Optional[dict] = None
        self._points = trace_points([])  # the model's declared points, from the run event (Llama's until then)
        self._step_rows = 0
        self._layout: Optional[StepLayout] = None
        self._tensors: list[dict] = []  # the tensor events of the current pass
        self._last_kv: Optional[dict] = None
        self._dropped_note = False
        self._compact_note = False
        self._held_dumps: list[dict] = []  # --dump values under --trace none, shown after the streamed text
        self._routing: list[dict] = []  # the routing events of the current pass (a mixture of experts)

    def __call__(self, ev: dict) -> None:
        kind = ev.get("event")
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(ev)

    def _title(self, text: str) -> None:
        self.console.print(Text(text, style="bold cyan"))

    # -- header and prompt ----------------------------------------------------------------------------------------

    def _on_run(self, ev: dict) -> None:
        self._points = trace_points([ev])
        self.run = ev
        if not self.show_steps:  # --trace none: only the text and the timings
            return
        m = ev["model"]
        gqa = (f"GQA {m['n_heads']}q/{m['n_kv_heads']}kv" if m["n_kv_heads"] < m["n_heads"]
               else f"MHA {plural(m['n_heads'], 'head')}")
        parts = [f"model {m['name']}", m.get("arch", "?"), plural(m["n_layers"], "layer"), f"D={m['d_model']}", gqa,
                 f"Dh={m['head_dim']}", f"F={m['ffn_dim']}", f"V={m['vocab_size']:,}", f"RoPE θ={m['rope_theta']:,g}"]
        if m.get("n_params"):
            parts.append(f"{m['n_params'] / 1e6:.1f}M params")
        if m.get("n_experts"):  # a mixture of experts: what one token uses
            parts.append(f"{m['n_experts_used']} of {plural(m['n_experts'], 'expert')} a token: "
                         f"{m['active_params'] / 1e6:.1f}M active")
        print_parts(self.console, parts)
        print_changes(self.console, m)
        trace = ev.get("trace", {})
        n = ev.get("threads") if ev.get("device") == "cpu" else None
        print_parts(self.console, [f"run {ev.get('device', '?')}", *([plural(n, "thread")] if n else []), ev.get("dtype", "?"),
                                   *sampler_settings(ev.get("sampling", {}), ev.get("row_seeds")), f"trace {trace.get('level', '?')}"])
        if ev.get("interventions"):
            print_parts(self.console, ["interventions", *(iv["label"] for iv in ev["interventions"])], style="yellow")
        if m.get("storage"):
            print_parts(self.console, ["weights", *storage_parts(m["storage"])])
        if ev.get("exact") is False:
            from llmtrace.trace.records import fast_parts

            print_parts(self.console, fast_parts(ev["fast"]), style="yellow")

    def _on_tokens(self, ev: dict) -> None:
        if not self.show_steps:
            return
        toks = ev["tokens"]
        if "row" in ev:
            self._title(f"s1–s2 row {ev['row']} prompt → {plural(len(toks), 'token')}")
        else:
            self._title(f"s1–s3 prompt → {plural(len(toks), 'token')} (s3: one sequence, so no padding; every "
                        f"position is attended)")
        shown = toks if len(toks) <= 40 else toks[:20] + [None] + toks[-19:]
        rows = []
        for tok in shown:
            if tok is None:
                rows.append(["…", "…", f"({len(toks) - 39} more)", ""])
                continue
            style = "magenta" if tok.get("special") else ""
            rows.append([str(tok["index"]), str(tok["id"]), Text(piece_view(tok), style=style),
                         Text(quoted(tok["text"]), style=style)])
        print_table(self.console, [Column("#", "right"), Column("id", "right"), Column("piece"), Column("text")], rows)

    def _on_batch(self, ev: dict) -> None:
        """s3: the padded ids [B, T], the attention mask and the position ids, one line per row; pads dim."""
        if not self.show_steps:
            return
        ids, mask, pos = ev["ids"], ev["attention_mask"], ev["position_ids"]
        B, T = len(ids), len(ids[0]) if ids else 0
        source = "the tokenizer's pad token" if ev.get("pad_source") == "pad" else "EOS (the checkpoint has no pad token)"
        self._title(f"s3 batch: {B} rows left-padded to T={T} with id {ev['pad_id']}, {source}; pad slots (·) are "
                    f"masked, positions start at 0 at each row's first real token")
        for title, matrix in (("ids", ids), ("attention_mask", mask), ("position_ids", pos)):
            self.console.print(Text(f"{title} [{B}, {T}]", style="bold"))
            width = max(len(str(v)) for row in matrix for v in row) if T else 1
            fit = max(4, (self.console.width - len(str(B)) - 10) // (width + 2))  # slots one console line holds
            head = fit // 3
            shown = list(range(T)) if T <= fit else list(range(head)) + [None] + list(range(T - (fit - head - 1), T))
            for r in range(B):
                line = Text(f"  row {r:>{len(str(B - 1))}}  ")
                for j in shown:
                    if j is None:
                        line.append("…  ")
                        continue
                    pad = not mask[r][j]
                    line.append(f"{matrix[r][j]:>{width}}", style="dim" if pad else "bold" if title == "ids" else "")
                    line.append("·" if pad else " ")
                    line.append(" ")
                self.console.print(line)

    # -- the prefill's shapes and per-layer statistics -------------------------------------------------------------

    def _on_shapes(self, ev: dict) -> None:
        self._title(f"s4–s9 prefill pass over {plural(ev['n_tokens'], 'token')}: the shape at each stage "
                    f"(layer rows repeat in all {plural(ev['n_layers'], 'layer')})")
        order = {n: i for i, n in enumerate(self._points.names())}
        rows = []
        for p in sorted(ev["points"], key=lambda p: order.get(p["name"], 99)):
            where = "model" if p["layer"] is None else "layer ℓ"
            shape = shape_text(p["shape"], p.get("axes")) if p["name"] != KV_WRITE.name else \
                f"positions 0..{p['shape'][0] - 1}"
            step = p.get("seed_step") or ""
            if step == "s6.3":  # RoPE: s5's position, applied inside attention
                step += " (s5)"
            rows.append([step, where, p["name"], shape, p["dtype"]])
        rope, where = _rope_words(ev["points"], (self.run or {}).get("maths"))
        print_table(self.console, [Column("step"), Column("where"), Column("point"), Column("shape"),
                                   Column("dtype", drop=1)], rows)
        note = Text(style="dim")
        used = dict.fromkeys(a for p in ev["points"] for a in p.get("axes") or ())
        if used:
            note.append("axes: " + " · ".join(f"{a} {AXES[a]}" for a in used if a in AXES) + "\n")
        note.append("s5 position: no position table is added to the embedding; RoPE rotates q and k inside attention "
                    f"(s6.3, {rope}), {where}.\n")
        note.append("s8 before s7: the model normalizes every position, then takes the last one. RMSNorm works on each "
                    "position alone, so this gives the seed's numbers (take the last, then normalize).")
        self.console.print(note)

    def _on_tensor(self, ev: dict) -> None:
        self._tensors.append(ev)

    def _on_routing(self, ev: dict) -> None:
        self._routing.append(ev)

    def _routing_line(self, row: Optional[int]) -> None:
        """Under a step: what each MoE layer's router chose for the token whose pass made this step (the last position
        of the pass), 'L3 e2 .61 e5 .39': layer, then each chosen expert and its weight."""
        mine = [ev for ev in self._routing if ev.get("row") == row and ev["positions"]]
        self._routing = [ev for ev in self._routing if ev not in mine]
        if not mine or not self.show_steps:
            return
        parts = [f"L{ev['layer']} " + " ".join(f"e{e} {_weight(w)}" for e, w in zip(ev["experts"][-1],
                                                                                     ev["weights"][-1]))
                 for ev in mine]
        parts[0] = f"  routing @{mine[0]['positions'][-1]}: {parts[0]}"
        print_parts(self.console, parts, style="dim")

    def _flush_tensors(self) -> None:
        rows, self._tensors = self._tensors, []
        if not rows:
            return
        step = rows[0].get("step", 0)
        dumps = [r for r in rows if "values" in r]
        if not self.show_steps:  # --trace none streams the text: the dumps wait for its end, one line each
            self._held_dumps += dumps
            return
        if len(rows) <= DETAIL_ROWS:
            what = "prefill (step 0)" if step == 0 else f"step {step}"
            self._title(f"{what}: statistics at each recorded point")
            self._point_table(rows)
        else:
            self._layer_lines(rows, step)
        for r in dumps:
            self._dump_line(r)

    def _point_table(self, rows: list[dict]) -> None:
        cols = [Column("layer", "right"), Column("point"), Column("shape", drop=4), Column("mean", "right", drop=2),
                Column("std", "right", drop=3), Column("min", "right", drop=1), Column("max", "right", drop=1),
                Column("‖x‖", "right")]
        out = []
        for r in rows:
            st = r["stats"]
            out.append(["—" if r["layer"] is None else str(r["layer"]), r["name"],
                        shape_text(r["shape"], axes_for(self._points, r["name"], r["shape"])), fmt_num(st["mean"]),
                        fmt_num(st["std"]), fmt_num(st["min"]), fmt_num(st["max"]), fmt_num(st["norm"])])
        print_table(self.console, cols, out)

    # The one-line-per-layer view of a pass: what each sublayer added to the residual stream, the stream's size, and
    # how sharp attention was. (point, statistic, column header, drop rank)
    LAYER_LINE = ((O_PROJ.name, "norm", "‖attn‖ s6.6", None), (RESID_MID.name, "norm", "‖x'‖", 3),
                  (DOWN.name, "norm", "‖ffn‖ s6.7", None), (RESID_POST.name, "norm", "‖x''‖ out", None),
                  (RESID_POST.name, "absmax", "max|x''|", 2), (SCORES.name, "max", "score max", 4),
                  (PROBS.name, "max", "attn p max", 1))
    LAYER_LEGEND = {
        "‖attn‖ s6.6": "‖attn‖: the L2 norm of what attention adds to the residual stream",
        "‖x'‖": "‖x'‖: the L2 norm of the residual stream after attention's add",
        "‖ffn‖ s6.7": "‖ffn‖: the norm of what the FFN adds",
        "‖x''‖ out": "‖x''‖: the norm of the stream leaving the layer",
        "max|x''|": "max|x''|: its largest magnitude",
        "score max": "score max: the largest unmasked q·k/√Dh",
        "attn p max": "attn p max: the sharpest attention weight",
    }

    def _layer_lines(self, rows: list[dict], step: int) -> None:
        by: dict[tuple, dict] = {(r["layer"], r["name"]): r["stats"] for r in rows}
        layers = sorted({r["layer"] for r in rows if r["layer"] is not None})
        present = {r["name"] for r in rows}
        cols = [(p, s, h, d) for p, s, h, d in self.LAYER_LINE if p in present]
        what = "prefill (step 0)" if step == 0 else f"step {step}"
        self._title(f"{what}: one line per layer ({plural(len(rows), 'recorded point')}; every statistic is in "
                    f"--json/--jsonl)")

        def stat(st: Optional[dict], key: str) -> str:
            if st is None:
                return ""
            if key == "absmax":
                lo, hi = st.get("min"), st.get("max")
                return fmt_short(None if lo is None or hi is None else max(abs(lo), abs(hi)))
            return fmt_short(st.get(key))

        out = [[str(layer)] + [stat(by.get((layer, p)), s) for p, s, _, _ in cols] for layer in layers]
        left = print_columns(self.console, [Column("layer", "right")] + [Column(h, "right", drop=d) for _, _, h, d in cols],
                             out)
        if not self._compact_note:  # once: what the columns shown mean, and which ones did not fit
            shown = [h for _, _, h, _ in cols if h not in left]
            self.console.print(Text("; ".join(self.LAYER_LEGEND[h] for h in shown), style="dim"))
            if left:
                self.console.print(columns_left_out(self.console, left))
            self._compact_note = True
        model = [(n, by[(None, n)]) for n in self._points.names(layer=False) if (None, n) in by]
        if model:
            print_parts(self.console, [f"{n} ‖x‖ {fmt_short(st['norm'])}" if n != LOGITS.name else
                                       f"logits max {fmt_short(st['max'])}, mean {fmt_short(st['mean'])}"
                                       for n, st in model], style="dim")

    def _dump_line(self, r: dict) -> None:
        """A --dump's values, compactly: the first few, and where all of them are."""
        flat: list = []

        def walk(v) -> None:
            if isinstance(v, list):
                for x in v:
                    if len(flat) >= 6:
                        return
                    walk(x)
            else:
                flat.append(v)

        walk(r["values"])
        n = 1
        for d in r["shape"]:
            n *= d
        where = "" if r["layer"] is None else f"layer {r['layer']} "
        head = ", ".join(fmt_short(x) for x in flat)
        more = ", …" if n > len(flat) else ""
        print_parts(self.console, [f"dump {where}{r['name']} {shape_text(r['shape'])} step {r['step']}: [{head}{more}]",
                                   f"all {plural(n, 'value')} are in --json/--jsonl"], style="dim")

    # -- generation steps ------------------------------------------------------------------------------------------

    def _on_step(self, ev: dict) -> None:
        self._last_kv = ev.get("kv_cache")
        if self._tensors:
            self._flush_tensors()
            self._step_rows = 0  # repeat the step header after a statistics table
        if self.show_steps:
            self._step_row(ev)

    def _step_row(self, ev: dict) -> None:
        if self._layout is None:
            self._layout = StepLayout.for_step(ev, self.run, self.console.width)
        lay = self._layout
        if self._step_rows == 0 and ev["step"] == 0:
            self._title("s7–s12 each step: last position → logits → sampler stages → token; the KV cache grows")
        t = lay.table(show_header=self._step_rows == 0)
        tok = ev["token"]
        changes = winner_changes(ev)
        stages = ev.get("sampler") or []
        if (ev.get("rng") or {}).get("greedy") or not stages:
            surv = "greedy argmax" if stages or (ev.get("rng") or {}).get("greedy") else ""
        else:
            surv = survivors_chain(stages, width=lay.keep.get("survivors", 0))
        kv = ev["kv_cache"]
        token = Text(piece_view(tok), style="magenta" if tok.get("special") else "bold")
        if changes:
            token.append(" *", style="bold red")
        cells = {"step": str(ev["step"]), "row": str(ev.get("row", "")), "pos": str(ev["position"]), "token": token, "id": str(tok["id"]),
                 "top candidates (p)": _candidates(ev.get("topk") or [], lay.keep.get("top candidates (p)", 0)),
                 "survivors": surv, "KV len": str(kv["seq_len"]), "KV bytes": f"{kv.get('total_bytes_used', kv['bytes_used']):,}",
                 "ms": f"{ev['ms']:.1f}"}
        t.add_row(*[cells[name] for name in lay.keep])
        if self._step_rows == 0 and not self._dropped_note:  # above the table: its rows follow one another unbroken
            left = [n for n in ("id", "survivors", "KV len", "KV bytes", "ms") if n not in lay.keep]
            if left:
                self.console.print(columns_left_out(self.console, left))
            self._dropped_note = True
        self.console.print(t)
        for stage, before, after in changes:
            print_note(self.console, f"* {stage} changed the most likely token: {_token_name(ev, before)} → "
                                     f"{_token_name(ev, after)}", "red")
        for line in stage_lines(ev):
            print_note(self.console, line, "dim")
        self._routing_line(ev.get("row"))
        self._step_rows += 1

    def _on_prediction(self, ev: dict) -> None:
        """A prefill-only run (-n 0): the next-token candidates, no token taken."""
        self._last_kv = ev.get("kv_cache")
        self._flush_tensors()  # the prefill's recorded points, if any
        row = f"row {ev['row']} " if "row" in ev else ""
        self._title(f"s7–s9 prefill only (-n 0): what the model would predict at {row}position {ev['position']}")
        t = Table(box=None, padding=(0, 1), header_style="bold")
        for col, just in (("#", "right"), ("id", "right"), ("token", "left"), ("logit", "right"), ("prob", "right")):
            t.add_column(col, justify=just)
        for rank, c in enumerate(ev.get("topk") or [], 1):
            t.add_row(str(rank), str(c["id"]), Text(visible(c["text"])), fmt_num(c["logit"]), f"{c['prob']:.4f}")
        self.console.print(t)
        self._routing_line(ev.get("row"))

    # -- the end ---------------------------------------------------------------------------------------------------

    def _load_lines(self, ev: dict) -> None:
        """A mixture of experts: how the run's tokens spread over each MoE layer's experts."""
        if ev.get("routing") and self.show_steps:
            print_parts(self.console, ["expert load (tokens per expert, by index)", *load_parts(ev["routing"])],
                        style="dim")

    def _on_summary(self, ev: dict) -> None:
        if self._tensors:  # a pass whose step never came (interrupted)
            self._flush_tensors()
        if self.stream_text:
            self.console.print()
            for r in self._held_dumps:
                self._dump_line(r)
        elif "rows" in ev:
            for r in ev["rows"]:
                self.console.print(Text.assemble((f"row {r['row']} ", "bold"), (f"[{r['stop_reason']}, "
                                                 f"{plural(len(r['tokens']), 'token')}] ", "dim"), r["text"]))
        else:
            self.console.print(Text.assemble(("output ", "bold"), ev["text"]))
        if "rows" in ev:
            n = sum(len(r["tokens"]) for r in ev["rows"])
            decoded = any(len(r["tokens"]) > 1 for r in ev["rows"]) and ev.get("decode_tok_s")
            parts = [f"batch of {len(ev['rows'])} rows", f"{n:,} generated"] + _stop(ev, " (row 0)")
            parts += [f"TTFT {ev['ttft_ms']:.0f} ms", f"prefill {ev['prefill_tok_s']:.1f} tok/s",
                      f"decode {ev['decode_tok_s']:.1f} tok/s (all rows)" if decoded else "decode – tok/s"]
            print_parts(self.console, parts, style="dim")
            kv = self._last_kv
            if kv is not None and "batch_bytes_used" in kv:
                print_parts(self.console, [f"KV cache: {ev['batch']} rows × {plural(kv['batch_seq_len'], 'slot')} × "
                                           f"{kv['bytes_per_token']:,} B = {human_bytes(kv['batch_bytes_used'])} "
                                           f"(allocated {human_bytes(kv['bytes_allocated'])})"], style="dim")
            return
        n_gen = ev["generated_tokens"]
        decode = f"decode {ev['decode_tok_s']:.1f} tok/s" if n_gen > 1 and ev.get("decode_tok_s") else "decode – tok/s"
        parts = [plural(ev["prompt_tokens"], "prompt token"), f"{n_gen:,} generated"] + _stop(ev)
        parts += [f"TTFT {ev['ttft_ms']:.0f} ms", f"prefill {ev['prefill_tok_s']:.1f} tok/s", decode]
        if self.run is not None and self.run.get("exact") is False:
            parts.append(in_words("`fast=True` (approximate)"))
        print_parts(self.console, parts, style="dim")
        self._load_lines(ev)
        if self.run is not None and self._last_kv is not None:
            kv = self._last_kv
            saving = kv["mha_bytes_used"] / kv["bytes_used"] if kv["bytes_used"] else 0
            print_parts(self.console, [
                f"KV cache: {plural(kv['seq_len'], 'position')} × {kv['bytes_per_token']:,} B = "
                f"{human_bytes(kv['bytes_used'])} (allocated {human_bytes(kv['bytes_allocated'])})",
                f"full multi-head attention would need {human_bytes(kv['mha_bytes_used'])}, {saving:.0f}× more"],
                style="dim", sep="; ")
            state = kv.get("state")
            if state:  # layers whose memory is a fixed-size state (linear attention)
                print_parts(self.console, [
                    f"constant-size memory (a state or a convolution window): {plural(len(state['layers']), 'layer')} "
                    f"× {state['bytes_per_layer']:,} B = "
                    f"{human_bytes(state['bytes'])}, the same at every step (the KV cache above is the other "
                    f"layers')", f"together {human_bytes(kv['total_bytes_used'])}"], style="dim", sep="; ")


def _rope_words(points: list[dict], maths: Optional[dict]) -> tuple[str, str]:
    """The points RoPE makes and which layers turn q and k, from the run's declared maths (model.maths: each layer's
    plan and operations); without one, the step's points of layer 0 in every layer."""
    if not maths:
        return " and ".join(p["name"] for p in points if p.get("seed_step") == "s6.3" and p["layer"] == 0), \
            "in every layer"
    plans = [maths["kinds"][k]["plan"] for k in maths["layer_kind"]]
    from llmtrace.model.maths import ROTATION, attention_words, has_role, plan_from_record

    def rotates(o: dict) -> bool:  # the record's role (so that `show` needs no torch); a trace before roles: the registry
        return o["role"] == ROTATION if "role" in o else has_role(o["op"], ROTATION)

    names = dict.fromkeys(n for kind in maths["kinds"] for n, o in kind["ops"].items() if rotates(o))
    turning = [i for i, plan in enumerate(plans) if plan.get("rope")]
    if len(turning) == len(plans):
        return " and ".join(names), "in every layer"
    if not turning:
        return " and ".join(names), "in no layer: no layer turns q and k"

    other = plan_from_record(plans[next(i for i in range(len(plans)) if i not in turning)])
    return " and ".join(names), (f"in {noun(len(turning), 'layer')} {', '.join(map(str, turning))} only "
                                 f"(the others turn nothing: {attention_words(other)})")


def _weight(w: Optional[float]) -> str:
    """A routing weight in two decimals without the leading zero, as '.61'; '1.0' for a whole one."""
    if w is None:
        return "?"
    return f"{w:.2f}".removeprefix("0") if abs(w) < 0.995 else f"{w:.1f}"


def load_parts(loads: list[dict], shown: int = 16) -> list[str]:
    """The summary's expert load, a part per MoE layer: 'L0 3 12 7 10 (max/mean 1.50)', every expert's count when
    the layer has at most `shown` experts, else the busiest four ('L0 e5 40, e17 33, e2 31, e9 30 of 128')."""
    out = []
    for r in loads:
        load, imb = r["load"], r.get("imbalance")
        if len(load) <= shown:
            counts = " ".join(str(n) for n in load)
        else:
            top = sorted(range(len(load)), key=lambda e: -load[e])[:4]
            counts = ", ".join(f"e{e} {load[e]}" for e in top) + f" … of {len(load)}"
        out.append(f"L{r['layer']} {counts} (max/mean {imb:.2f})" if imb is not None else f"L{r['layer']} {counts}")
    return out


def _stop(summary: dict, which: str = "") -> list[str]:
    """Why the run stopped, in words, said once: 'stop: interrupted (Ctrl-C)', or 'stop: eos' then 'interrupted
    (Ctrl-C)' for a Ctrl-C that came after the run had ended (while its outputs were written)."""
    reason = summary["stop_reason"]
    if reason == "interrupted":
        return [f"stop: interrupted (Ctrl-C){which}"]
    return [f"stop: {reason}{which}"] + (["interrupted (Ctrl-C)"] if summary.get("interrupted") else [])


def render_events(events: list[dict], console: Console) -> None:
    r = TerminalRenderer(console)
    for ev in events:
        r(ev)
