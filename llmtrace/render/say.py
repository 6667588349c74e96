"""The words of the terminal views, one catalogue per language: render/catalogue/LANG.json, a flat object of keys to
texts ({name} marks a value filled in, with Python's format specs: {n:,}). A view says every line by its key and
values, `say("explain.kv.title", lo=0, hi=13)`, never in English of its own, so the same view speaks every language
(`llmtrace explain --lang zh`, and the explain page: report.explain_view). Every language gives every key
(tests/test_explain_words.py); a word a layer's kind declares comes with it as an (English, Chinese) pair
(`say.pick`), as its headings do (model.kinds).

    say = Say("zh")
    say("explain.kv.title", lo=0, hi=13)      a line
    say.n("explain.tokens", 5)                 a line about n things ("explain.tokens.one" where n is 1)
    say.pick(("causal convolution", "因果卷积"))  a declared pair, in this language
    verbatim("silu(gate)")                     a formula, a token or a name: printed as it is, in every language
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional, Sequence, Union

from rich.style import Style
from rich.text import Text

LANGS = ("en", "zh")
VERBATIM = Style(meta={"verbatim": True})  # a span no language translates: a formula, a token, a name


@functools.cache
def catalogue(lang: str) -> dict[str, str]:
    return json.loads((Path(__file__).with_name("catalogue") / f"{lang}.json").read_text(encoding="utf-8"))


class Say:
    """The words of one language (the module's docstring)."""

    def __init__(self, lang: str = "en"):
        if lang not in LANGS:
            raise ValueError(f"no catalogue for language {lang!r}: {', '.join(LANGS)}")
        self.lang = lang
        self._texts = catalogue(lang)

    def __call__(self, key: str, **values) -> str:
        text = self._texts[key]
        return text.format(**values) if values else text

    def n(self, key: str, n: int, **values) -> str:
        """The line `key` about `n` things: its ".one" form where n is 1 and the language has one."""
        one = f"{key}.one"
        return self(one if n == 1 and one in self._texts else key, n=n, **values)

    def pick(self, pair: Union[str, Sequence[str], None]) -> str:
        """A word a kind declares as (English, Chinese), in this language; a plain string (a trace written before
        the pair) as it is."""
        if pair is None or isinstance(pair, str):
            return pair or ""
        if not isinstance(pair, (list, tuple)) or not pair:
            return str(pair)
        return str(pair[1 if self.lang == "zh" and len(pair) > 1 else 0])


def verbatim(text: str, style: Optional[str] = None) -> Text:
    """`text` marked as a formula, a token or a name: the page keeps it as it is (report.explain_view)."""
    return Text(text, style=(Style.parse(style) if style else Style()) + VERBATIM)
