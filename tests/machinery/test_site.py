"""`make site`: the course as a static website (course/site.py), tested as a reader sees it.

A small site (lessons 01 and 04 in the small preview mode, the two cheapest to run with plots, 04
with formulas; the notes, the guides, the glossary) is built into a temporary folder, served on
loopback and opened page by page in headless Chromium with every request to anything else refused:
no request leaves loopback, no file is missing, every image loads, every formula is typeset by the
local MathJax, every link into the site resolves (file and anchor), and the search finds lesson 04
by a term it defines. Inside `make check` the lessons' outputs are those make check has just made
(build/check/, taken over when fresh), so the test costs the Sphinx build and the browser.
The rest needs no build: stale outputs are refused, links are rewritten, the glossary and the docs
are true to the lessons. `make site-test` runs the same reader's test on the whole site.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from course.source import ROOT, all_lessons, find_lesson

pytestmark = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="needs the course's sources")
SITE_LESSONS = ("01", "04")
SMALL_SEARCH = ("roofline", "lessons/04_measuring.html")  # a term lesson 04 defines

sys.path.insert(0, str(Path(__file__).parent))
from test_links import problems as link_problems  # noqa: E402


@pytest.fixture(scope="module")
def small_site(tmp_path_factory):
    pytest.importorskip("myst_nb", reason="the `site` extra (make site and make check install it)")
    from course import site

    base = tmp_path_factory.mktemp("site")
    lessons = [find_lesson(n) for n in SITE_LESSONS]
    index = site.build(lessons, small=True, dest=base / "out", small_dir=base / "small", repo="someone/course")
    return index


def _reader_test(index: Path) -> dict:
    from course.browser import missing
    from course.site import expected_figures, inspect_site

    if missing():
        if __import__("os").environ.get("MT_BROWSER_REQUIRED") == "1":
            pytest.fail(missing())
        pytest.skip(missing())
    return inspect_site(index.parent, SMALL_SEARCH, figures=expected_figures(index.parent.parent / "src"))


def test_the_small_site_reads_offline_in_chromium(small_site):
    seen = _reader_test(small_site)
    pages = seen["pages"]
    assert seen["problems"] == [], "\n".join(seen["problems"])
    assert seen["requests"] == [] and seen["missing"] == []
    lessons = {p for p in pages if p.startswith("lessons/")}
    assert lessons == {f"lessons/{find_lesson(n).stem}.html" for n in SITE_LESSONS}
    assert {"index.html", "docs/glossary.html", "docs/maintainers.html", "AUTHORING.html",
            "hardware_notes/README.html", "hardware_notes/gpu.html", "search.html"} <= set(pages)
    l04 = pages[f"lessons/{find_lesson('04').stem}.html"]
    assert l04["figures"] >= 2 and l04["math"] >= 3 and l04["typeset"] == l04["math"], l04
    assert any("04_measuring.html" in u for u in seen["search"]), seen["search"]
    # the path through the course links every lesson, built or not, and each page its neighbours
    assert sum("lessons/" in u for u in pages["index.html"]["links"]) >= len(all_lessons())


def test_a_lesson_page_says_how_to_run_it_and_where_its_outputs_come_from(small_site):
    html = (small_site.parent / "lessons" / f"{find_lesson('04').stem}.html").read_text()
    text = re.sub(r"<[^>]+>", "", html)
    assert "https://colab.research.google.com/github/someone/course/blob/main/lessons/04_measuring.ipynb" in html
    assert "http://localhost:8888/lab/tree/lessons/04_measuring.ipynb" in html
    assert "make lab" in text and "make test L=04" in text
    assert "small preview mode" in text and "MINITORCH_SMALL=1" in text
    assert "Builds on" in text and "Terms defined here" in text and 'href="../docs/glossary.html#term-' in html
    # lessons in this build link to their pages, the others to their notebooks on GitHub
    assert 'href="01_tensors.html"' in html
    assert "https://github.com/someone/course/blob/main/lessons/05_cpu_matmul.ipynb" in html


def test_without_the_repositorys_address_a_page_gives_no_colab_link(monkeypatch):
    from course import site

    monkeypatch.delenv("MT_SITE_REPO", raising=False)
    lesson = find_lesson("01")
    out = site.Outputs(lesson, ROOT / "build" / "x.ipynb", True, "2026-11-27 20:00", "make site")
    box = site.run_box(lesson, out, {}, site.REPO, [], False)
    assert "colab.research.google.com" not in box and "REPO=owner/name" in box
    assert "colab.research.google.com/github/me/c/blob/main/lessons/01_tensors.ipynb" in \
        site.run_box(lesson, out, {}, "me/c", [], False)
    monkeypatch.setenv("MT_SITE_REPO", "me/c")
    assert site.default_repo() == "me/c"


def test_the_pages_show_the_exercises_as_students_get_them_not_the_answers(small_site):
    from course.build import student_notebook

    src = small_site.parent.parent / "src" / "lessons" / f"{find_lesson('04').stem}.ipynb"
    nb = nbformat.read(src, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "BEGIN SOLUTION" not in code and "#| export" not in code
    stubs = re.findall(r'raise NotImplementedError\("Exercise [\d.]+: \w+"\)', code)
    expected = re.findall(r'raise NotImplementedError\("Exercise [\d.]+: \w+"\)',
                          "\n".join(c.source for c in student_notebook(find_lesson("04")).cells))
    assert stubs == expected and stubs
    assert not any("check" in c.metadata.get("tags", []) and "remove-cell" not in c.metadata["tags"]
                   for c in nb.cells), "check cells are the grader's: left out of the page"
    assert not any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                   for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_the_built_html_names_no_other_host_for_what_it_loads(small_site):
    root = small_site.parent
    for page in root.rglob("*.html"):
        text = page.read_text()
        refs = re.findall(r'<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)\s*=\s*["\']([^"\']*)', text)
        loads = [r for r in refs if re.match(r"(https?:)?//", r)
                 and not re.search(r'rel="(canonical|next|prev)"', r)]
        assert not loads, f"{page.relative_to(root)} loads {loads[:5]}"
    for css in (root / "_static").rglob("*.css"):
        assert not re.search(r"(@import|url\()\s*['\"]?(https?:)?//", css.read_text()), css


def test_the_reader_test_finds_what_a_reader_would_meet(tmp_path):
    """The checks can fail: an outside script, a missing image, a broken link and anchor, TeX
    that no MathJax typesets, and a search page that lists nothing."""
    from course.site import inspect_site

    (tmp_path / "index.html").write_text(
        '<html><head><script src="https://cdn.example.com/x.js"></script></head><body><article>'
        '<img src="gone.png"><a href="other.html#nowhere">a</a><a href="missing.html">b</a>'
        '<span class="math notranslate">\\(x^2\\)</span></article></body></html>')
    (tmp_path / "other.html").write_text('<html><body><article><h1 id="here">x</h1></article></body></html>')
    if __import__("course.browser", fromlist=["missing"]).missing():
        pytest.skip("no Chromium or Playwright")
    seen = inspect_site(tmp_path, timeout_ms=1500)
    found = "\n".join(seen["problems"])
    assert seen["requests"] == ["https://cdn.example.com/x.js"]
    for expected in ("gone.png", "missing.html: no such file", "no #nowhere on other.html",
                     "MathJax did not finish", "1 of 1 formulas not typeset", "requests outside loopback"):
        assert expected in found, f"{expected!r} not in:\n{found}"


def test_outputs_made_before_the_lesson_changed_fail_the_build(tmp_path, monkeypatch):
    from course import site
    from course.build import solution_notebook

    lesson = find_lesson("01")
    nb = solution_notebook(lesson)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.execution_count = 1
    assert site.stale_reason(lesson, nb) is None and site.incomplete_reason(nb) is None
    changed = nbformat.from_dict(nb)
    i = next(i for i, c in enumerate(changed.cells) if c.cell_type == "markdown" and i > 0)
    changed.cells[i].source += "\nA sentence added since."
    assert f"cell {i}" in site.stale_reason(lesson, changed)
    changed.cells.pop()
    assert "cells" in site.stale_reason(lesson, changed)
    small = tmp_path / "small"
    small.mkdir()
    monkeypatch.setattr(site, "BUILD", tmp_path)  # no run of make check's to take over
    nbformat.write(nbformat.from_dict(dict(changed, cells=changed.cells)), small / f"{lesson.stem}.ipynb")
    with pytest.raises(site.SiteError, match=r"outputs are stale.*make site L=01 RUN=1 SMALL=1"):
        site.outputs_for(lesson, small=True, small_dir=small)
    # a fresh complete run of make check's replaces the stale one
    (tmp_path / "check").mkdir()
    nbformat.write(nb, tmp_path / "check" / f"{lesson.stem}.ipynb")
    out = site.outputs_for(lesson, small=True, small_dir=small)
    assert out.small and out.by == "make check" and site.stale_reason(lesson, site._read_nb(out.path)) is None
    # full size: make demo's notebook, and the command that makes it again
    demo = tmp_path / "demo"
    demo.mkdir()
    nbformat.write(changed, demo / f"{lesson.stem}.ipynb")
    monkeypatch.setattr(site, "DEMO", demo)
    with pytest.raises(site.SiteError, match=r"make demo L=01"):
        site.outputs_for(lesson, small=False)
    nbformat.write(nb, demo / f"{lesson.stem}.ipynb")
    out = site.outputs_for(lesson, small=False)
    assert not out.small and out.path == demo / f"{lesson.stem}.ipynb" and out.by == "make demo"


def test_links_stay_in_the_site_or_go_to_the_repository():
    from course.site import rewrite_links

    pages = {"lessons/01_tensors.ipynb", "hardware_notes/caches.md", "docs/gpu.md"}
    text = ("See [caches](../hardware_notes/caches.md#cache-lines), [01](../lessons/01_tensors.ipynb), "
            "[02](../lessons/02_autograd.ipynb), [data](../data/pydoc_topics.NOTICE.md), [web](https://x.org/a), "
            "[here](#top), [readme](../README.md#start), `[code](../nowhere.md)`.\n"
            "```\n[in a fence](../nowhere.md)\n```\n"
            "```{glossary}\nterm\n  [in a directive](../lessons/02_autograd.ipynb)\n```\n")
    out = rewrite_links(text, "docs/gpu.md", pages, "me/c")
    assert "(../hardware_notes/caches.md#cache-lines)" in out and "(../lessons/01_tensors.ipynb)" in out
    assert "(https://github.com/me/c/blob/main/lessons/02_autograd.ipynb)" in out
    assert "(https://github.com/me/c/blob/main/data/pydoc_topics.NOTICE.md)" in out
    assert "(https://x.org/a)" in out and "(#top)" in out and "(../index.md#start)" in out
    assert "`[code](../nowhere.md)`" in out and "[in a fence](../nowhere.md)" in out
    assert "[in a directive](https://github.com/me/c/blob/main/lessons/02_autograd.ipynb)" in out


def test_every_glossary_term_is_in_the_lessons_and_notes_it_names():
    from course.site import glossary_terms

    terms = glossary_terms()
    assert len(terms) >= 60
    names = [t.term.lower() for t in terms]
    assert len(names) == len(set(names)), "a term twice"
    text = {le.number: le.source.read_text().lower() for le in all_lessons()}
    wrong = []
    for t in terms:
        assert t.lessons, f"{t.term}: names no lesson"
        for n in t.lessons:
            if t.term.lower() not in text[n]:
                wrong.append(f"{t.term!r} is not in lesson {n}")
        for note in t.notes:
            if t.term.lower() not in (ROOT / "hardware_notes" / f"{note}.md").read_text().lower():
                wrong.append(f"{t.term!r} is not in the note {note}")
    assert not wrong, "\n".join(wrong)
    assert {n for t in terms for n in t.lessons} == {le.number for le in all_lessons()}, "a lesson defines no term"


def test_the_docs_links_resolve():
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert {"platforms", "install", "gpu", "mpi", "grading", "lecturers", "instructors", "maintainers",
            "glossary"} <= {p.stem for p in docs}
    found = [msg for p in docs for msg in link_problems(p)]
    assert not found, "\n".join(found)


def test_the_readme_is_the_front_door():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert 70 <= len(lines) <= 110, f"README.md has {len(lines)} lines: the details belong in docs/"
    assert "make lab" in readme and "make test" in readme
    rows = [ln for ln in lines if re.match(r"^\| \d\d \|", ln)]
    assert [r[2:4] for r in rows] == [le.number for le in all_lessons()], "one row per lesson, in order"
    for le, row in zip(all_lessons(), rows):
        assert f"(lessons/{le.stem}.ipynb)" in row, row
    assert "OWNER" not in readme and "github.io/" not in readme, "no placeholder address: the site is not hosted yet"
    assert "make site" in readme and "make check" in readme
    for page in ("platforms", "install", "grading", "lecturers", "instructors", "gpu", "mpi", "maintainers"):
        assert f"(docs/{page}.md)" in readme, page


def test_every_environment_variable_the_code_reads_is_documented():
    """docs/maintainers.md's table lists every MT_* and MINITORCH_* name in the code, one row each
    (the CUDA C emulator's MT_* macros aside: the names its C sources define or use, and their prefixes)."""
    pattern = re.compile(r"\b((?:MT|MINITORCH)_[A-Z0-9_]+)")
    names = set()
    for folder in ["course", "minitorch", "solutions", "tests", "benchmarks", ".ci", ".github"]:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yml", ".sh", "") and path.is_file() and "__pycache__" not in path.parts \
                    and path != Path(__file__):
                try:
                    names |= set(pattern.findall(path.read_text()))
                except UnicodeDecodeError:
                    continue
    c_names = {n for ext in ("*.h", "*.cpp") for path in (ROOT / "course").rglob(ext) for n in pattern.findall(path.read_text())}
    names = {n for n in names if not any(c.startswith(n) for c in c_names)}
    rows = re.findall(r"^\| `((?:MT|MINITORCH)_[A-Z0-9_]+)", (ROOT / "docs" / "maintainers.md").read_text(), re.M)
    assert len(rows) == len(set(rows)), "a variable listed twice"
    missing, stale = sorted(names - set(rows)), sorted(set(rows) - names)
    assert not missing, f"docs/maintainers.md does not list {missing}"
    assert not stale, f"docs/maintainers.md lists {stale}, which no code reads any more"
    assert len(names) >= 30


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_site_and_its_settings_reach_the_builder():
    import subprocess

    out = subprocess.run(["make", "-n", "site", "L=05", "SMALL=1", "RUN=1", "ANSWERS=1", "REPO=a/b"], cwd=ROOT,
                         capture_output=True, text=True).stdout
    assert "-m course.site 05 --small --run --answers --repo a/b" in out, out
    out = subprocess.run(["make", "-n", "site-test", "L=05"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "-m course.site --test 05" in out, out


def test_the_pages_workflow_builds_tests_and_publishes_the_site():
    """.github/workflows/pages.yml (it cannot run here): the reader's test gates the upload, the links
    name the repository it runs in, and what it publishes is what make site builds."""
    import yaml

    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "pages.yml").read_text())
    triggers = flow.get("on", flow.get(True))  # YAML 1.1 reads the key `on` as True
    assert "main" in triggers["push"]["branches"] and "workflow_dispatch" in triggers
    assert flow["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}
    steps = flow["jobs"]["build"]["steps"]
    run = next(s for s in steps if "make site-test" in s.get("run", ""))
    assert run["env"]["MT_SITE_REPO"] == "${{ github.repository }}" and run["env"]["MT_BROWSER_REQUIRED"] == "1"
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-pages-artifact"))
    assert steps.index(upload) > steps.index(run) and upload["with"]["path"] == "build/site/html"
    from course.site import site_dest

    assert site_dest(None) / "html" == ROOT / "build" / "site" / "html"
    deploy = flow["jobs"]["deploy"]
    assert deploy["needs"] == "build" and deploy["steps"][0]["uses"].startswith("actions/deploy-pages")
