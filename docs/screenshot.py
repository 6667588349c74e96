"""Take the README's screenshot of a report: python docs/screenshot.py report.html docs/report.png

Opens the page in Debian's chromium (through playwright), offline, and saves the top of it at 1100 × 900 pixels."""

import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def main(page_path: str, out: str, section: str = "steps") -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
        page.goto(Path(page_path).resolve().as_uri())
        page.eval_on_selector(f"#{section}", "s => s.scrollIntoView()")
        page.screenshot(path=out)
        browser.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
