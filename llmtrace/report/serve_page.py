"""The page `llmtrace serve` serves: a prompt, the options and Run, over the same learner's page a report is. Each run
streams its events (tokens appear as they come), then its page is the report of that run, shown in a sandboxed
frame: one front end, fed here by the live server instead of a file (assets/serve.js)."""

from __future__ import annotations

from pathlib import Path


def serve_page(models: list[str], limits, lang: str = "en") -> str:
    import markupsafe

    from llmtrace.report.i18n import LANGS, Words
    from llmtrace.report.page import environment

    w = Words(lang)
    assets = Path(__file__).with_name("assets")
    # the page's own words in every language: picking 中文 relabels the page at once, not only the run's report
    words = {"lang": lang, "all": {code: serve_words(Words(code)) for code in LANGS}}
    return environment().get_template("serve.html.j2").render(
        w=w, models=models, limits=limits.__dict__, lang=lang, words=words,
        css=markupsafe.Markup((assets / "report.css").read_text(encoding="utf-8")),
        script=markupsafe.Markup((assets / "serve.js").read_text(encoding="utf-8")))


def serve_words(w) -> dict[str, str]:
    """The texts the live page shows in one language: its labels (serve., whatif., section.) and its script's (js.)."""
    return {k: w(k) for k in w.keys() if k.split(".")[0] in ("serve", "whatif", "section", "js")}
