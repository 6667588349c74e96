"""The HTML report: one self-contained page drawn from a trace's events (`llmtrace report`, `--html`).

    events -> data.extract -> one dict of numbers -> page.view -> each section's strings and chart geometry
           -> jinja2 templates (templates/report.html.j2, templates/report/*.html.j2) -> one HTML file
              (inline CSS, JS and data)

The page loads nothing from the network and needs no build step: its static parts are HTML and SVG laid out by
autoescaped templates shipped in the package, from what page.py computes; its interactive parts a small vanilla
script (assets/report.js) reading the data embedded in the page by named fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional
from llmtrace.units import plural

MAX_MERGE_WORDS = 200
MAX_MERGE_CHARS = 64  # a longer "word" (SentencePiece merges across spaces) is named, not told merge by merge


def merge_story(tokenizer, prompt: str) -> tuple[Optional[list[dict]], Optional[str]]:
    """The BPE merges of each word of the prompt, from the model's tokenizer: (words, None) or (None, why not)."""
    if tokenizer is None:
        return None, None
    try:
        from llmtrace.tokens.bpe import trace_merges

        words = [w.to_dict() for w in trace_merges(tokenizer, prompt, max_words=MAX_MERGE_WORDS,
                                                max_chars=MAX_MERGE_CHARS)]
    except Exception as e:  # a tokenizer without a merge table (not BPE): the section says so, the page is still made
        return None, f"the merge story is not available for this tokenizer ({' '.join(str(e).split())[:120]})"
    # the pieces as the reader sees them everywhere else (▁ for a space), not in the vocabulary's own alphabet (Ġ)
    for w in words:
        w["start"] = [tokenizer.visible(p) for p in w["start"]]
        for step in w["steps"]:
            step["pieces"] = [tokenizer.visible(p) for p in step["pieces"]]
            step["pair"] = [tokenizer.visible(p) for p in step["pair"]]
        w["final"] = [tokenizer.visible(p) for p in w["final"]]
    return words, None


def build(events: list[dict], tokenizer=None, merges_note: Optional[str] = None, row: int = 0, lang: str = "en",
          all_rows: bool = True) -> str:
    """The report page of a trace, as a string. A batch of prompts: the page of row `row`, holding every other row's
    page too (`all_rows`), which its row switch (s3) opens in place. `tokenizer` (the model's) adds the BPE merge
    story; `lang` is the language of its words (report.i18n: en, zh). The events of a comparison (compare, diff) or
    of a patching sweep make the page their command's --html writes."""
    from llmtrace.errors import BadValue
    from llmtrace.report.data import check_schema, extract
    from llmtrace.report.page import render

    other = _other_page(events, row, lang)
    if other is not None:
        return other
    check_schema(events)
    run = next((e for e in events if e.get("event") == "run"), None)
    rows = (run or {}).get("batch") or 1
    if not 0 <= row < rows:
        raise BadValue("row", f" {row} is out of range: the trace has {plural(rows, 'row')} "
                              f"(0..{rows - 1})")
    if run is not None and run.get("batch"):
        prompt = (run.get("prompts") or [""] * rows)[row]
    else:
        prompt = next((e.get("prompt", "") for e in events
                       if e.get("event") == "run" or (e.get("event") == "explain" and e.get("section") == "model")), "")
    words, why = merge_story(tokenizer, prompt)
    note = None if words is not None else (
        why or merges_note or "the merge story needs the model's tokenizer, and this report was made without it")
    d = extract(events, row=row, merges=words, merges_note=note)
    if d["kind"] == "explain":  # the page carries everything the terminal explain prints
        from llmtrace.report.explain_view import explain_blocks

        d["explain_view"] = explain_blocks(events, lang)
    page = render(d, lang)
    if rows > 1 and all_rows:  # one page holds every row: the others ride along, the row switch opens them
        others = {str(r): build(events, tokenizer, merges_note, r, lang, all_rows=False)
                  for r in range(rows) if r != row}
        page = with_rows(page, others)
    return page


def with_rows(page: str, others: dict[str, str]) -> str:
    """The page with the other rows' pages embedded (a JSON object of HTML strings, every <, > and & escaped so that
    nothing in them can close the script); report.js's row switch writes the chosen one in place."""
    import json

    blob = (json.dumps(others, ensure_ascii=False, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))
    at = page.rindex('<script type="application/json" id="data">')  # before the page's script, which reads it
    return page[:at] + f'<script type="application/json" id="rows">{blob}</script>\n' + page[at:]


def _other_page(events: list[dict], row: int, lang: str = "en") -> Optional[str]:
    """The page of a comparison's or a sweep's events (what compare, diff and patch write with --html), or None."""
    from llmtrace.errors import BadValue

    kind = next((e["event"] for e in events if e.get("event") in ("compare", "patch")), None)
    if kind is None:
        return None
    if row:
        raise BadValue("row", f" {row} is out of range: a {'comparison' if kind == 'compare' else 'patching sweep'} "
                              f"has one page (row 0)")
    if kind == "compare":
        from llmtrace.report.compare import render_compare_page
        from llmtrace.trace.comparison import document

        return render_compare_page(document(events), lang)
    from llmtrace.report.patch import patch_page

    return patch_page(next(e for e in events if e["event"] == "patch"), lang)


def write_report(events: list[dict], path: str | Path, tokenizer=None, merges_note: Optional[str] = None,
                 row: int = 0, lang: str = "en") -> int:
    """Write the page to `path` atomically (an existing file is replaced only by a complete one). Returns its bytes."""
    from llmtrace.fsutil import write_text_atomic

    page = build(events, tokenizer, merges_note, row, lang)
    write_text_atomic(Path(path), page)
    return len(page.encode("utf-8"))


def report_dumps(layers: Optional[list[int]], n_layers: int, points=None) -> tuple[str, ...]:
    """What --html adds to a generate trace: the attention probabilities of the recorded layers (--layers), or of the
    first and last layer when every layer is recorded (all of them would make a page of many MB). `points`: the
    model's declared points (model.points: each with name, step, axes); the attention probabilities are the one
    softmax makes over heads × tokens × slots (report.walk.attention_points)."""
    from llmtrace.model.llama_points import PROBS
    from llmtrace.report.walk import attention_points

    chosen = layers if layers is not None else sorted({0, n_layers - 1})
    declared = [{"name": p.name, "step": p.step, "axes": list(p.axes)} for p in points or ()]
    names = sorted(attention_points(declared)) or [PROBS.name]  # no points given: Llama's declaration
    return tuple(f"{i}.{name}" for i in chosen for name in names)
