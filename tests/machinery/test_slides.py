"""`make slides`: a lesson's executed demo notebook as an offline reveal.js slideshow. Lesson 04
with MINITORCH_SMALL=1 (its demo draws plots and runs in seconds, and its prose has formulas),
exported into a temporary folder and opened in headless Chromium with every non-file request
refused and recorded: plots, outputs and typeset math, from files beside the page only."""

from __future__ import annotations

import re

import nbformat
import pytest

from course.build import slide_types, solution_notebook, student_notebook
from course.source import ROOT, all_lessons, find_lesson

pytestmark = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="needs the course's sources")


@pytest.fixture(scope="module")
def deck(tmp_path_factory):
    pytest.importorskip("sphinx_revealjs", reason="the `slides` extra (make slides installs it)")
    from course import slides

    base = tmp_path_factory.mktemp("slides")
    lesson = find_lesson("04")
    html = slides.slides(lesson, small=True, dest=base / "out", demo_dir=base / "demo")
    return lesson, html, nbformat.read(base / "demo" / f"{lesson.stem}.ipynb", as_version=4)


def test_every_generated_notebook_carries_slide_types_from_its_structure():
    for lesson in all_lessons():
        for nb in (solution_notebook(lesson), student_notebook(lesson)):
            kinds = [c.metadata["slideshow"]["slide_type"] for c in nb.cells]
            assert kinds == slide_types(nb.cells)
            for cell, kind in zip(nb.cells, kinds):
                src = cell.source.lstrip()
                if cell.cell_type == "markdown" and src.startswith(("# ", "## ")):
                    assert kind == "slide", (lesson.stem, src[:40])
                if "check" in cell.metadata.get("tags", []):
                    assert kind == "skip", (lesson.stem, src[:40])
            assert kinds[0] == "slide", lesson.stem


def test_the_html_loads_nothing_from_the_network(deck):
    _, html, _ = deck
    text = html.read_text()
    refs = re.findall(r'<(?:script|link|img)\b[^>]*?\b(?:src|href)\s*=\s*["\']([^"\']*)', text, flags=re.I)
    assert refs, "no script or stylesheet at all?"
    assert not [r for r in refs if re.match(r"(https?:)?//", r)], refs
    assert 'src="reveal.js/dist/reveal.js"' in text
    assert not re.search(r"@import\s+url\(\s*['\"]?(https?:)?//", text)
    assert (html.parent / "reveal.js" / "LICENSE").read_text().startswith("Copyright") or \
        "MIT" in (html.parent / "reveal.js" / "LICENSE").read_text()
    theme = re.search(r'href="(reveal\.js/dist/theme/[^"]+)"', text).group(1)
    assert "//" not in (html.parent / theme).read_text().split("*/", 1)[-1].split("{")[0]


def test_slides_render_offline_in_chromium_with_outputs_and_plots(deck, tmp_path):
    from course.browser import missing
    from course.slides import inspect, sections

    if missing():
        pytest.skip(missing())
    _, html, executed = deck
    seen = inspect(html, tmp_path / "slide.png")
    assert seen["ready"], "reveal.js did not initialise"
    assert seen["requests"] == [], f"the slides asked the network for {seen['requests']}"
    assert seen["slides"] == sections(executed) > 3
    assert seen["images"] >= 1 and seen["outputs"] >= 3, seen
    assert (tmp_path / "slide.png").stat().st_size > 10_000
    assert seen["missing"] == [], f"files the page loads are not beside it: {seen['missing']}"


def test_the_lessons_latex_is_typeset_by_the_local_mathjax(deck):
    """Lesson 04's markdown has three display formulas ($$...$$): MathJax, loaded from the copy
    beside the page (no network), typesets each one with no error and leaves no TeX delimiter."""
    from course.browser import missing
    from course.slides import inspect

    if missing():
        pytest.skip(missing())
    _, html, executed = deck
    formulas = sum(c.source.count("$$") // 2 for c in executed.cells if c.cell_type == "markdown")
    assert formulas == 3
    assert 'src="mathjax/MathJax.js?config=' in html.read_text()
    assert "Apache License" in (html.parent / "mathjax" / "LICENSE").read_text()
    seen = inspect(html)
    assert seen["requests"] == [] and seen["missing"] == [], seen
    assert seen["math"] == formulas and seen["math_errors"] == 0 and seen["tex_left"] == 0, seen
    assert seen["math_font"] == "loaded", seen


def test_inline_display_and_ams_math_typeset_with_no_file_missing(tmp_path):
    """Every kind of formula the lessons write (inline $...$, display $$...$$, AMS symbols such as
    lesson 09's \\mathbb{R}) is typeset from the copied MathJax, and nothing it asks for is absent."""
    pytest.importorskip("sphinx_revealjs", reason="the `slides` extra (make slides installs it)")
    from course.browser import missing
    from course.slides import export, inspect

    if missing():
        pytest.skip(missing())
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Formulas"),
        nbformat.v4.new_markdown_cell("## Inline and display\n\nQ in $\\mathbb{R}^{N \\times d}$, scale "
                                      "$1/\\sqrt d$:\n\n$$O = \\mathrm{softmax}\\!\\left(\\frac{Q K^\\top}{\\sqrt d}\\right) V$$"),
        nbformat.v4.new_markdown_cell("## Aligned\n\n$$\\begin{aligned} m_j &= \\max(m_{j-1}, x_j) \\\\ "
                                      "l_j &= l_{j-1} e^{m_{j-1} - m_j} \\end{aligned}$$"),
    ])
    src = tmp_path / "math.ipynb"
    nbformat.write(nb, src)
    seen = inspect(export(src, tmp_path / "out"))
    assert seen["requests"] == [] and seen["missing"] == [], seen
    assert seen["math"] == 4 and seen["math_errors"] == 0 and seen["tex_left"] == 0, seen
    assert seen["math_font"] == "loaded", seen
