"""The HTML view of `llmtrace attribute`: every part as a row with a bar, one self-contained page (no script, nothing
loaded from the network), from the `attribute` event alone."""

from __future__ import annotations

import html
from pathlib import Path

from llmtrace.report.page import visible


def attribution_page(ev: dict) -> str:
    t, a = ev["target"], ev["against"]
    what = f"logit({t['text']!r})" + (f" − logit({a['text']!r})" if a else "")
    big = max((abs(p["value"]) for p in ev["parts"]), default=1.0) or 1.0
    rows = []
    for p in sorted(ev["parts"], key=lambda p: -abs(p["value"])):
        width = 100 * abs(p["value"]) / big
        colour = "#2e7d32" if p["value"] >= 0 else "#c62828"
        rows.append(f"<tr><td>{html.escape(p['name'])}</td><td>{html.escape(p['kind'])}</td>"
                    f"<td class=n>{p['value']:+.4f}</td><td class=bar><span style=\"width:{width:.1f}%;"
                    f"background:{colour}\"></span></td></tr>")
    tokens = " ".join(f"<code{' class=at' if i == ev['position'] else ''}>{html.escape(visible(s))}</code>"
                      for i, s in enumerate(ev["tokens"]))
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in ev["notes"])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmtrace attribute: {html.escape(what)}</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em;max-width:60em}} td{{padding:2px 8px}}
td.n{{text-align:right;font-family:monospace}} td.bar{{width:40%}} td.bar span{{display:block;height:12px}}
code.at{{background:#ffe082}} code{{margin-right:2px}}</style></head><body>
<h1>Direct logit attribution of {html.escape(what)}</h1>
<p>{tokens}</p>
<p>logit {ev['logit']:.4f} = the sum of {len(ev['parts'])} parts ({ev['total']:.4f}), at position
{ev['position']}.</p><ul>{notes}</ul>
<table><thead><tr><th>part</th><th>kind</th><th>contribution</th><th></th></tr></thead>
<tbody>{''.join(rows)}</tbody></table></body></html>
"""


def write_attribution_html(ev: dict, target) -> int:
    """Write the page to `target`, whole or not at all; its size in bytes."""
    from llmtrace.fsutil import write_text_atomic

    text = attribution_page(ev)
    write_text_atomic(Path(target), text)
    return len(text.encode("utf-8"))
