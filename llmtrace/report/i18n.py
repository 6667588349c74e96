"""The words of the HTML pages, one catalogue per language: report/catalogue/LANG.json, a flat object of keys to
texts ({name} marks a value filled in). English is complete; another language gives the keys it translates and falls
back to English for the rest (tests/test_report_pages.py checks that Chinese translates every key). The terms follow
the seed documents' own: 分词, 词元, 嵌入, 旋转位置编码, 注意力, 前馈网络, 残差, 归一化, 采样, 温度, KV 缓存. The formulas'
words ("maths.<word>") are not in a catalogue: each operation kind declares its own, in both languages
(model.maths.words_in)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from llmtrace.errors import BadValue

LANGS = ("en", "zh")
HTML_LANG = {"en": "en", "zh": "zh-Hans"}
MATHS = "maths."  # the keys of the formulas' words: their operation kinds declare them (model.maths)


@functools.cache
def _load(lang: str) -> dict[str, str]:
    return json.loads((Path(__file__).with_name("catalogue") / f"{lang}.json").read_text(encoding="utf-8"))


def check_lang(lang: str) -> str:
    if lang not in LANGS:
        raise BadValue("lang", f" must be one of {', '.join(LANGS)}, not {lang!r}")
    return lang


class Words:
    """The texts of one language: `w("key", name=value)`; `w.js` the keys the page's script uses (those starting
    with "js.")."""

    def __init__(self, lang: str = "en"):
        self.lang = check_lang(lang)
        self.html_lang = HTML_LANG[lang]
        self._texts = _load("en") | (_load(lang) if lang != "en" else {})

    def __call__(self, key: str, **values) -> str:
        text = self.maths[key[len(MATHS):]] if key.startswith(MATHS) else self._texts[key]
        return text.format(**values) if values else text

    def has(self, key: str) -> bool:
        return key in self._texts

    def keys(self) -> list[str]:
        return list(self._texts)

    @property
    def maths(self) -> dict[str, str]:
        """The words of the formulas in this language, as each operation kind declares them (model.maths.words_in),
        not a catalogue's: `w("maths.window_of", ...)` reads one of them."""
        from llmtrace.model.maths import words_in

        return words_in(self.lang)

    @property
    def js(self) -> dict[str, str]:
        return {k[3:]: v for k, v in self._texts.items() if k.startswith("js.")}
