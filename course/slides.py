"""`make slides [L=NN]`: a lesson's executed demo notebook as a reveal.js slideshow, offline.

    python -m course.slides 05          build/slides/05_cpu_matmul.slides.html
    python -m course.slides             every lesson
    python -m course.slides 01 --small  MINITORCH_SMALL=1 (the test's quick run)

The demo notebook is build/demo/NN_topic.ipynb, what `make demo L=NN` writes; it is executed
again (as `make demo` does) unless it is newer than solutions/NN_topic.py. Slide breaks are the
`slideshow` metadata `make build` writes from the lesson's structure (course.build.slide_types).
nbconvert's slides exporter turns it into HTML with a template (course/slides_template) that
loads reveal.js from build/slides/reveal.js/, copied from the installed sphinx-revealjs package,
and MathJax 2.7 (the lessons' LaTeX) from build/slides/mathjax/, copied from the
installed jupyter-server-mathjax package (each with its licence), and loads nothing else: no
jQuery, require.js or widget manager from a CDN. Plots are the notebook's PNG outputs, embedded
in the page.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from course.source import ROOT, Lesson, all_lessons, find_lesson

BUILD = ROOT / "build"
SLIDES = BUILD / "slides"
TEMPLATE = Path(__file__).parent / "slides_template"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def installed_static(module: str, package: str, folder: str, *required: str) -> Path:
    """The folder of static files an installed package of the `slides` extra ships (`folder`,
    relative to the module), checked to hold `required`; SystemExit saying what to install else."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"make slides needs the `slides` extra ({package}): run `make slides`, "
                         "which installs it, or pip install -e '.[slides]'") from exc
    src = Path(mod.__file__).parent / folder
    missing = [name for name in required if not (src / name).exists()]
    if missing:
        raise SystemExit(f"no {', '.join(missing)} in {src}: reinstall {package}")
    return src


def _copied(src: Path, out: Path) -> bool:
    """A copy at `out` of the file `src` is already there (same size: the copies are whole packages'
    files, replaced whole when the package changes)."""
    return out.exists() and out.stat().st_size == src.stat().st_size


def reveal_source() -> Path:
    """reveal.js as the installed sphinx-revealjs ships it (dist/, plugin/, LICENSE)."""
    return installed_static("sphinx_revealjs", "sphinx-revealjs", "_static/revealjs", "dist/reveal.js")


def copy_reveal(dest: Path) -> Path:
    """Copy what the slides load (reveal.js, its CSS and themes, the notes plugin, the licence)."""
    src, out = reveal_source(), dest / "reveal.js"
    if _copied(src / "dist" / "reveal.js", out / "dist" / "reveal.js"):
        return out
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src / "dist", out / "dist", ignore=shutil.ignore_patterns("*.map", "*.esm.js"))
    shutil.copytree(src / "plugin" / "notes", out / "plugin" / "notes")
    shutil.copy(src / "LICENSE", out / "LICENSE")
    return out


def mathjax_source() -> Path:
    """MathJax 2.7 as the installed jupyter-server-mathjax ships it (MathJax.js, jax/, LICENSE)."""
    return installed_static("jupyter_server_mathjax", "jupyter-server-mathjax", "static",
                            "MathJax.js", "config/TeX-AMS-MML_HTMLorMML-full.js")


def copy_mathjax(dest: Path) -> Path:
    """Copy MathJax to dest/mathjax (about 10 MB: its TeX configuration, HTML-CSS output with the
    STIX-Web fonts, extensions, licence), without the translations the slides never load."""
    src, out = mathjax_source(), dest / "mathjax"
    if _copied(src / "MathJax.js", out / "MathJax.js"):
        return out
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("localization"))
    return out


def ran_to_the_end(path: Path) -> bool:
    """Every code cell of the executed notebook ran (a run that stopped leaves the rest unnumbered)."""
    import nbformat

    try:
        cells = nbformat.read(path, as_version=4).cells
    except Exception:  # noqa: BLE001 - unreadable: run it again
        return False
    return all(c.get("execution_count") for c in cells if c.cell_type == "code")


def demo_notebook(lesson: Lesson, small: bool = False, out_dir: Path | None = None) -> Path:
    """The executed demo notebook: build/demo/NN.ipynb if newer than its source, else run it now
    (course.executor.execute_notebook, as `make demo` does; small: MINITORCH_SMALL=1, written to
    build/slides/small/ so it never stands in for a full-size demo)."""
    from course.executor import execute_notebook

    out_dir = out_dir or (SLIDES / "small" if small else BUILD / "demo")
    nb = out_dir / f"{lesson.stem}.ipynb"
    if nb.exists() and nb.stat().st_mtime > lesson.source.stat().st_mtime and ran_to_the_end(nb):
        return nb
    print(f"executing solutions/{lesson.stem}.py{' (MINITORCH_SMALL=1)' if small else ''} "
          f"-> {_shown(nb)}", flush=True)
    ok, message, _, _ = execute_notebook(lesson, out_dir, small=small)
    if not ok:
        raise RuntimeError(f"lesson {lesson.stem}'s demo notebook did not run: {message}")
    return nb


def export(notebook: Path, dest: Path) -> Path:
    """nbconvert's slides exporter with the offline template: notebook -> dest/<stem>.slides.html."""
    import nbformat
    from nbconvert import SlidesExporter

    nb = nbformat.read(notebook, as_version=4)
    nb.metadata.pop("widgets", None)  # a live control needs a kernel; its static picture stays
    for cell in nb.cells:
        if cell.cell_type == "code" and "\nlive(" in "\n" + cell.source:
            cell.metadata["transient"] = {"remove_source": True}  # a live control's slide is its picture
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data:
                data.pop("application/vnd.jupyter.widget-view+json", None)
    exporter = SlidesExporter(extra_template_basedirs=[str(TEMPLATE.parent)], template_name=TEMPLATE.name)
    exporter.reveal_url_prefix = "reveal.js"
    exporter.reveal_scroll = True
    exporter.reveal_theme = "white"  # its fonts ship with it (the "simple" theme fetches Google Fonts)
    exporter.exclude_input_prompt = True
    exporter.exclude_output_prompt = True
    html, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": notebook.stem}})
    html = html.replace('href="../', 'href="../../')  # the lessons' links, from build/slides/
    dest.mkdir(parents=True, exist_ok=True)
    copy_reveal(dest)
    copy_mathjax(dest)
    out = dest / f"{notebook.stem}.slides.html"
    out.write_text(html)
    return out


def inspect(html: Path, screenshot: Path | None = None, timeout_ms: int = 30_000) -> dict:
    """Open the slides in headless Chromium (course.browser's), every request that is not a local
    file refused and recorded. Returns {"ready": reveal initialised, "slides": horizontal slides,
    "images": rendered <img> with a size, "outputs": output areas, "math": formulas MathJax
    typeset, "math_errors": formulas it could not, "tex_left": `$$` still in the text,
    "math_font": "loaded" if one of its web fonts (STIX-Web, from the copy) did,
    "requests": refused URLs, "missing": local files that failed to load}; with `screenshot`, a
    PNG of the first slide that shows a plot."""
    from playwright.sync_api import sync_playwright

    from course.browser import CHROMIUM_FLAGS, find_chromium

    refused: list[str] = []
    missing: list[str] = []

    def route(r):
        if r.request.url.startswith("file:"):
            r.continue_()
        else:
            refused.append(r.request.url)
            r.abort()

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=find_chromium(), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.route("**/*", route)
            page.on("requestfailed", lambda r: r.url.startswith("file:") and missing.append(r.url))
            page.goto(html.resolve().as_uri())
            page.wait_for_function("() => window.Reveal && Reveal.isReady()", timeout=timeout_ms)
            page.wait_for_function("() => !window.MathJax || window.mathjaxDone", timeout=timeout_ms)  # typeset
            seen = page.evaluate("""async () => {
                const imgs = [...document.querySelectorAll('.slides img')];
                await Promise.all(imgs.map(i => i.decode().catch(() => null)));  // hidden slides decode lazily
                const plot = imgs.find(i => i.naturalWidth > 0);
                let at = null;
                if (plot) { const s = plot.closest('section'); const ix = Reveal.getIndices(s); at = [ix.h, ix.v || 0]; }
                return {ready: Reveal.isReady(), slides: Reveal.getHorizontalSlides().length,
                        images: imgs.filter(i => i.naturalWidth > 0).length,
                        outputs: document.querySelectorAll('.slides .jp-OutputArea-output').length,
                        math: document.querySelectorAll('.slides span.MathJax').length,
                        math_errors: document.querySelectorAll('.slides .MathJax .noError, .slides .MathJax merror, .slides .MathJax_Error').length,
                        tex_left: (document.querySelector('.slides').innerText.match(/[$][$]/g) || []).length,
                        math_font: [...document.fonts].some(f => f.family.startsWith('STIXMathJax') && f.status === 'loaded')
                                ? 'loaded' : null,
                        at: at};
            }""")
            if screenshot is not None and seen["at"]:
                page.evaluate(f"() => Reveal.slide({seen['at'][0]}, {seen['at'][1]})")
                page.wait_for_timeout(1200)  # the slide transition
                page.evaluate("""() => { const i = [...document.querySelectorAll('section.present img')]
                    .find(i => i.naturalWidth > 0); if (i) i.scrollIntoView({block: 'center'}); }""")
                page.wait_for_timeout(300)
                page.screenshot(path=str(screenshot))
        finally:
            browser.close()
    return {**seen, "requests": refused, "missing": missing}


def slides(lesson: Lesson, small: bool = False, dest: Path = SLIDES, demo_dir: Path | None = None) -> Path:
    """Lesson -> dest/NN_topic.slides.html (and dest/reveal.js/)."""
    return export(demo_notebook(lesson, small, demo_dir), dest)


def sections(nb) -> int:
    """The slides a notebook makes: its markdown cells that open with the title or a section."""
    return sum(c.cell_type == "markdown" and c.source.lstrip().startswith(("# ", "## ")) for c in nb.cells)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lessons", nargs="*")
    ap.add_argument("--small", action="store_true", help="MINITORCH_SMALL=1 (quick, smaller figures)")
    ap.add_argument("--screenshot", action="store_true",
                    help="open each in headless Chromium: NN_topic.png of a slide with a plot, and any network request")
    args = ap.parse_args(argv)
    lessons = [find_lesson(k) for k in args.lessons] if args.lessons else all_lessons()
    failed = 0
    for lesson in lessons:
        try:
            out = slides(lesson, small=args.small)
            line = f"{out.relative_to(ROOT)}"
            if args.screenshot:
                png = out.with_name(f"{lesson.stem}.png")
                seen = inspect(out, png)
                line += (f": {seen['slides']} slides, {seen['images']} plots, {seen['outputs']} outputs, "
                         f"{seen['math']} formulas ({seen['math_errors']} errors), {len(seen['requests'])} network "
                         f"requests, {len(seen['missing'])} missing files -> {png.relative_to(ROOT)}")
                failed += bool(seen["requests"] or seen["missing"] or seen["math_errors"]) or not seen["ready"]
            print(line, flush=True)
        except RuntimeError as exc:
            print(exc, flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
