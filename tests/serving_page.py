"""Lesson 15's page in a real browser, as a lecturer uses it (not a test file itself): the tests of
lesson 15's server (tests/test_15_serving.py) and of `make serve`'s engine process
(tests/machinery/test_engine_process.py) drive it with `drive_serving_page`.

Test files get it from the `test_helper` fixture (tests/conftest.py): `test_helper("serving_page")`.
Headless Chromium through Playwright, as the browser test (course.browser) drives JupyterLab;
`missing()` says why it cannot run here (no Playwright, no Chromium), or None.
"""

from __future__ import annotations

from course.browser import CHROMIUM_FLAGS, find_chromium, missing

__all__ = ["drive_serving_page", "missing"]


def drive_serving_page(url: str, prompt: str, max_tokens: int, final_length: int) -> dict:
    """Lesson 15's page at `url` in headless Chromium, as a lecturer uses it: type the prompt, ask
    for max_tokens, press Go. Returns what the page showed: "partial" (the text once the first
    tokens are in), "blocks" (KV blocks in use while the request runs), "final" (the text once it
    has final_length characters) and "total" (the pool's blocks, once nothing runs)."""
    from playwright.sync_api import sync_playwright

    seen: dict = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=find_chromium(), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.fill("#prompt", prompt)
            page.fill("#max", str(max_tokens))
            page.click("#go")
            page.wait_for_function("document.getElementById('out').textContent.length > 0", timeout=20_000)
            seen["partial"] = page.text_content("#out")
            page.wait_for_function("document.getElementById('running').textContent === '1'", timeout=20_000)
            seen["blocks"] = int(page.text_content("#blocks"))
            page.wait_for_function(f"document.getElementById('out').textContent.length === {final_length}",
                                   timeout=30_000)
            seen["final"] = page.text_content("#out")
            page.wait_for_function("document.getElementById('running').textContent === '0'", timeout=20_000)
            seen["total"] = int(page.text_content("#total"))
        finally:
            browser.close()
    return seen
