"""A live control in JupyterLab in Chromium: lesson 13's pipeline control (its solution's cell,
on the reference package) renders a slider and a plot, and moving the slider redraws the plot.
Skipped where Playwright or Chromium is missing (course.browser)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from course.source import ROOT, find_lesson, read_source

pytestmark = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="needs the course's sources")


def test_moving_a_slider_redraws_the_plot():
    from course.browser import CHROMIUM_FLAGS, Lab, find_chromium, missing

    if missing():
        pytest.skip(missing())
    from playwright.sync_api import sync_playwright

    cell = next(c.source for c in read_source(find_lesson("13")).cells if "live(draw_pipeline" in c.source)
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\n"
                                  "from minitorch.model_parallel import gpipe_schedule, one_f_one_b_schedule, simulate_schedule"),
        nbformat.v4.new_code_cell(cell)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("MT_LIVE_PROBE", None)
    with tempfile.TemporaryDirectory(prefix="minitorch-live-") as tmp:
        (Path(tmp) / "live.ipynb").write_text(nbformat.writes(nb))
        lab = Lab(Path(tmp), env)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=find_chromium(), args=CHROMIUM_FLAGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(lab.url("lab/workspaces/live/tree/live.ipynb", "reset"))
                page.wait_for_function("""() => ((document.querySelector('#jp-main-statusbar') || {}).innerText || '')
                    .includes('| Idle')""", timeout=120_000)
                page.locator(".jp-Notebook .jp-Cell").first.click()
                page.keyboard.press("Control+Enter")
                page.keyboard.press("Shift+Enter")
                page.keyboard.press("Shift+Enter")
                img = ".jp-OutputArea-output .widget-output img"
                page.wait_for_selector(img, timeout=120_000)
                page.wait_for_selector(".widget-slider", timeout=30_000)
                before = page.locator(img).first.get_attribute("src")
                handle = page.locator(".widget-slider .noUi-handle").nth(1)  # micro-batches
                handle.focus()
                for _ in range(6):
                    page.keyboard.press("ArrowRight")
                deadline = time.monotonic() + 60
                after = before
                while time.monotonic() < deadline and after == before:
                    time.sleep(0.5)
                    after = page.locator(img).first.get_attribute("src")
                page.screenshot(path=str(ROOT / "build" / "live_slider.png"))
                browser.close()
        finally:
            lab.close()
    assert before and after != before, "moving the micro-batches slider did not redraw the plot"
