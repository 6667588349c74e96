"""The screenshots of the HTML pages that the README and the documentation site (docs/*.md) show.

    python docs/screenshot.py report.html docs/report.png [SECTION]   one page, scrolled to a section (default: steps)
    python docs/screenshot.py --all [-m MODEL] [--out docs]           every page: runs llmtrace to make the pages of
                                                                      the documentation's examples, then shoots each
    python docs/screenshot.py --serve [-m MODEL] [--out docs]         the live page: starts `llmtrace serve`, runs,
                                                                      re-samples step 0 at temperature 1.5, clicks a
                                                                      head of the heatmap, shoots the page

Opens each page in Debian's chromium (through playwright), offline, and saves 1100 × 900 pixels from the section's
top. --all takes a few minutes on a CPU (it runs generate, explain, lens, compare and patch on the default model).
The Chinese page needs a CJK font in the system for its picture (Debian: apt-get install fonts-wqy-microhei); the
page itself loads no font.
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
PROMPT = "Quantum mechanics is a fundamental theory in physics that"


def shoot(browser, page_path, out: str, section: str = "steps", actions=()) -> None:
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
    page.goto(Path(page_path).resolve().as_uri())
    for selector, value in actions:  # move a control first (a slider: the what-if sampler)
        page.eval_on_selector(selector, "(e, v) => { e.value = String(v); e.dispatchEvent(new Event('input')); "
                                        "e.dispatchEvent(new Event('change')); }", value)
    page.eval_on_selector(f"#{section}", "s => s.scrollIntoView()")
    page.screenshot(path=out)
    page.close()
    print(f"wrote {out}", file=sys.stderr)


def shoot_card(browser, page_path, out: str, point: str = "gate") -> None:
    """One worked card of the walk-through's map (layer 0, the first prompt token's pass), the card alone."""
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
    page.goto(Path(page_path).resolve().as_uri())
    page.click(f'.mapblock[data-point="{point}"]')
    card = page.locator("#map-card .wpoint")
    card.scroll_into_view_if_needed()
    card.screenshot(path=out)
    page.close()
    print(f"wrote {out}", file=sys.stderr)


def llmtrace(*args: str) -> None:
    print("llmtrace " + " ".join(args), file=sys.stderr)
    subprocess.run([sys.executable, "-m", "llmtrace", *args], check=True, stdout=subprocess.DEVNULL)


def make_all(model: list[str], out: Path) -> None:
    """The documentation's examples as pages, then a screenshot of each."""
    tmp = Path(tempfile.mkdtemp(prefix="llmtrace-shots-"))
    llmtrace("generate", PROMPT, *model, "-n", "24", "--temperature", "0.8", "--top-p", "0.9", "--seed", "1",
             "--trace", "full", "--layers", "0,-1", "--html", str(tmp / "report.html"), "--json", str(tmp / "t.json"))
    llmtrace("report", str(tmp / "t.json"), *model, "--lang", "zh", "-o", str(tmp / "zh.html"))
    llmtrace("explain", "The capital of France is", *model, "--layer", "3", "--html", str(tmp / "explain.html"))
    llmtrace("lens", "The capital of France is", *model, "--positions", "all", "--html", str(tmp / "lens.html"))
    llmtrace("compare", "The capital of France is", *model, "--b-dtype", "bfloat16", "--html",
             str(tmp / "compare.html"))
    llmtrace("patch", *model, "--clean", "The Eiffel Tower is in the city of", "--corrupt",
             "The Colosseum is in the city of", "--answer", " Paris", "--against", " Rome", "--html",
             str(tmp / "patch.html"))
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        shoot(browser, tmp / "report.html", str(out / "report.png"), "tokens")
        shoot(browser, tmp / "report.html", str(out / "walk.png"), "walk", [("#walk-layer", "0")])
        shoot_card(browser, tmp / "report.html", str(out / "card.png"))
        shoot(browser, tmp / "report.html", str(out / "sizes.png"), "sizes")
        shoot(browser, tmp / "report.html", str(out / "whatif.png"), "whatif", [("#wi-temperature", "1.5")])
        shoot(browser, tmp / "zh.html", str(out / "report-zh.png"), "pipeline")
        shoot(browser, tmp / "explain.html", str(out / "explain.png"), "explain")
        shoot(browser, tmp / "lens.html", str(out / "lens.png"), "lens")
        shoot(browser, tmp / "compare.html", str(out / "compare.png"), "heat")
        shoot(browser, tmp / "patch.html", str(out / "patch.png"), "sweep")
        browser.close()


def make_serve(model: list[str], out: Path) -> None:
    """The live page after Run, Re-sample this step and a click on a head: serve.png."""
    proc = subprocess.Popen([sys.executable, "-m", "llmtrace", "serve", *model, "--port", "0", "--no-browser"],
                            stdout=subprocess.PIPE, text=True)
    try:
        url = None
        while url is None and proc.poll() is None:
            found = re.search(r"(http://\S+/\?token=\S+)", proc.stdout.readline())
            url = found.group(1) if found else None
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1100, "height": 1500})
            page.goto(url)
            page.get_by_role("button", name="Run").click()
            page.locator("#status", has_text="done").wait_for(timeout=600_000)
            frame = page.frame_locator("#page")
            frame.locator("#whatif").wait_for(timeout=60_000)
            page.fill("#temperature", "1.5")
            page.get_by_role("button", name="Re-sample this step").click()
            page.locator("#resample .side.again table").wait_for(timeout=60_000)
            frame.locator("button.thumb[data-layer='0'][data-hi='3']").click()
            page.locator("#compare-page").wait_for(timeout=600_000)
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(out / "serve.png"))
            browser.close()
        print(f"wrote {out / 'serve.png'}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("--all", "--serve"):
        rest = argv[1:]
        model = rest[rest.index("-m"):rest.index("-m") + 2] if "-m" in rest else []
        out = Path(rest[rest.index("--out") + 1]) if "--out" in rest else Path(__file__).parent
        (make_all if argv[0] == "--all" else make_serve)(model, out)
        return
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        shoot(browser, argv[0], argv[1], argv[2] if len(argv) > 2 else "steps")
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1:])
