"""`make site [L=NN]`: the course as a static website, built offline (docs/maintainers.md, "The site").

    python -m course.site                 every lesson, the notes and the docs -> build/site/html/index.html
    python -m course.site 12              lesson 12 with the notes and docs -> build/site/lesson-12/html/
    python -m course.site --small         every lesson's outputs in the small preview mode (MINITORCH_SMALL=1)
    python -m course.site --run           execute again the outputs of lessons whose source changed
    python -m course.site --answers       show the reference solutions (an instructor's copy: build/site/answers/)
    python -m course.site --test          then open every page in headless Chromium (course.site.inspect_site)
    python -m course.site --serve         serve the built site on http://127.0.0.1:PORT/ until Ctrl-C

Built with Sphinx, MyST-NB (executed notebooks and MyST Markdown: the executable-book stack of
Jupyter Book 1) and sphinx-book-theme, all from the `site` extra. Nothing is fetched at build or view
time: the theme's fonts and scripts ship in its wheel, MathJax 2.7 comes from jupyter-server-mathjax
(copied beside the pages, as for the slides), search is Sphinx's own index, and notebook widgets,
which MyST-NB would load from a CDN, are left out (a live control keeps its first picture).

Each lesson's page is its executed demo notebook: the prose, the code as a student gets it (stubs
where the exercises are; `--answers` shows the reference solutions), and the outputs and figures of
the reference solution. Outputs come from `make demo` (build/demo/, full size) for the lessons in
FULL, whose full run takes minutes at most on the 2-core machine, and from the small preview mode
(MINITORCH_SMALL=1, build/site/small/) for the others and with --small; each page says which, when
and on what machine. Missing outputs are made (as `make demo` makes them, or small);
outputs whose lesson changed since they were made fail the build (`--run` makes them again): a
page's code cells must be the lesson's current cells, compared cell by cell.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from course.source import ROOT, Lesson, all_lessons, directives, find_lesson, strip_directives, tags

BUILD = ROOT / "build"
SITE = BUILD / "site"
SMALL_OUT = SITE / "small"  # the small preview mode's executed notebooks
RUNS = ".site-runs.json"  # beside the executed notebooks the site uses: how and when each was made
DEMO = BUILD / "demo"  # make demo's
# Where the course is hosted (GitHub owner/name): the Colab and source links. MT_SITE_REPO or --repo
# overrides it (the Pages workflow passes the repository it runs in).
REPO = "OWNER/NAME"  # a placeholder: no Colab link, no repository button while it stands


def default_repo() -> str:
    """MT_SITE_REPO, else the GitHub repository of the checkout's `origin` remote, else the placeholder."""
    if os.environ.get("MT_SITE_REPO"):
        return os.environ["MT_SITE_REPO"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        url = subprocess.run(["git", "remote", "get-url", "origin"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        m = re.search(r"github\.com[:/]([\w.-]+/[\w.-]+?)(?:\.git)?/?$", url)
        if m:
            return m.group(1)
    return REPO
BRANCH = "main"

# Lessons whose full-size run (`make demo`) takes minutes at most on the 2-core development machine:
# their pages show the full-size outputs. Measured 2026-11-27 (docs/maintainers.md, "The site"): every
# lesson but 15 ran in 6-130 s. Lesson 15's full run did not finish then (its source was being changed),
# so its page shows the small preview mode, saying so, until it is measured and added here.
FULL = frozenset({f"{n:02d}" for n in range(1, 20)} - {"15"})

# The path through the course: the site's navigation and the landing page's parts.
PARTS = [
    ("Build a framework", ["01", "02", "03"]),
    ("Fast on one CPU", ["04", "05", "06"]),
    ("Fast on a GPU", ["07", "08"]),
    ("A language model, lean", ["09", "10", "11"]),
    ("Big: many devices", ["12", "13"]),
    ("Putting it together", ["14", "15", "16"]),
    ("Further", ["17", "18", "19"]),
]

DOCS = ROOT / "docs"
NOTES = ROOT / "hardware_notes"
# The guides, in the order the navigation lists them (docs/*.md; any other is appended).
DOC_ORDER = ["platforms", "install", "gpu", "mpi", "grading", "lecturers", "instructors", "maintainers", "glossary"]


# ---------------------------------------------------------------------------------------------
# Outputs: which executed notebook each lesson's page shows, never a stale one


@dataclass
class Outputs:
    lesson: Lesson
    path: Path
    small: bool
    made: str  # "2026-11-27 19:30"
    by: str  # "make demo", "make site", "make check"
    seconds: float | None = None
    load: float | None = None  # the 1-minute load average when it ended (other jobs on the machine)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _read_nb(path: Path):
    import nbformat

    return nbformat.read(path, as_version=4)


def stale_reason(lesson: Lesson, nb) -> str | None:
    """Why the executed notebook `nb` is not the lesson's current solution notebook (a cell added,
    removed or changed since it ran), or None: its cells are the current ones, so its outputs are."""
    from course.build import solution_notebook

    now = solution_notebook(lesson).cells
    if len(nb.cells) != len(now):
        return f"it has {len(nb.cells)} cells, the lesson now {len(now)}"
    for i, (old, new) in enumerate(zip(nb.cells, now)):
        if old.cell_type != new.cell_type or old.source != new.source:
            first = (new.source.strip().splitlines() or [""])[0][:60]
            return f"cell {i} (`{first}`) changed"
    return None


def incomplete_reason(nb) -> str | None:
    """Why an executed notebook is not a complete run (a cell not run, an error), or None."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if not cell.get("execution_count"):
            return f"cell {i} did not run"
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return f"cell {i} ended in an error"
    return None


def _runs(folder: Path) -> dict:
    try:
        return json.loads((folder / RUNS).read_text())
    except (OSError, ValueError):
        return {}


def _record_run(path: Path, by: str, seconds: float | None) -> None:
    runs = _runs(path.parent)
    runs[path.name] = {"mtime": path.stat().st_mtime, "by": by, "seconds": seconds,
                       "load": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    (path.parent / RUNS).write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")


def _outputs(lesson: Lesson, path: Path, small: bool, default_by: str) -> Outputs:
    rec = _runs(path.parent).get(path.name, {})
    mtime = path.stat().st_mtime
    if abs(rec.get("mtime", -1) - mtime) > 1e-3:
        rec = {}
    made = dt.datetime.fromtimestamp(mtime).strftime("%Y-%m-%d %H:%M")
    return Outputs(lesson, path, small, made, rec.get("by", default_by), rec.get("seconds"), rec.get("load"))


def _execute(lesson: Lesson, out_dir: Path, small: bool) -> Path:
    from course.executor import execute_notebook

    what = "small (MINITORCH_SMALL=1)" if small else "at full size, as `make demo` does"
    print(f"  executing solutions/{lesson.stem}.py {what} -> {_shown(out_dir / (lesson.stem + '.ipynb'))}",
          flush=True)
    t0 = time.perf_counter()
    ok, message, _, _ = execute_notebook(lesson, out_dir, small=small)
    if not ok:
        raise SiteError(f"lesson {lesson.stem}'s notebook did not run to its end: {message}")
    path = out_dir / f"{lesson.stem}.ipynb"
    _record_run(path, "make site" if small else "make demo (run by make site)", round(time.perf_counter() - t0))
    return path


class SiteError(Exception):
    """The site cannot be built as asked (stale or failed outputs, a broken page): the message says why."""


def outputs_for(lesson: Lesson, small: bool = False, run: bool = False, small_dir: Path | None = None) -> Outputs:
    """The executed notebook for the lesson's page. Full size (build/demo/, `make demo`'s) for the
    lessons in FULL unless `small`; else the small preview mode's (small_dir, default
    build/site/small/; where it is missing or out of date, a fresh complete run of `make check`
    or `make slides SMALL=1` is taken over rather than made again). Missing: made now. Stale (the
    lesson changed since): SiteError, unless `run`, which makes it again."""
    small_dir = small_dir or SMALL_OUT
    full = lesson.number in FULL and not small
    path = (DEMO if full else small_dir) / f"{lesson.stem}.ipynb"
    remake = "make demo L={n}" if full else "make site L={n} RUN=1" + (" SMALL=1" if small else "")
    problem = None
    if path.exists():
        nb = _read_nb(path)
        stale, incomplete = stale_reason(lesson, nb), incomplete_reason(nb)
        if stale is None and incomplete is None:
            return _outputs(lesson, path, not full, "make demo" if full else "make site")
        problem = (f"are stale: solutions/{lesson.stem}.py changed since {_shown(path)} was made ({stale})" if stale
                   else f"are incomplete: {_shown(path)} did not run to its end ({incomplete})")
    if not full:  # missing or out of date: take over a fresh small run that make check or make slides SMALL=1 made
        for seed, by in ((BUILD / "check", "make check"), (BUILD / "slides" / "small", "make slides SMALL=1")):
            cand = seed / f"{lesson.stem}.ipynb"
            try:
                nb = _read_nb(cand) if cand.exists() else None
            except Exception:  # noqa: BLE001 - being written (make check runs beside): not a seed
                nb = None
            if nb is not None:
                if stale_reason(lesson, nb) is None and incomplete_reason(nb) is None:
                    small_dir.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(cand, path)
                    _record_run(path, by, None)
                    return _outputs(lesson, path, True, by)
    if problem and not run:
        raise SiteError(f"lesson {lesson.number}'s outputs {problem}. Make them again: {remake.format(n=lesson.number)}")
    path = _execute(lesson, path.parent, small=not full)
    return _outputs(lesson, path, not full, "make site")


# ---------------------------------------------------------------------------------------------
# Cross-links: what each lesson builds on, which notes it uses, the glossary


@functools.lru_cache(maxsize=None)
def module_owners() -> dict[str, str]:
    """{minitorch module: the lesson number that exports it}."""
    from course.build import exported_modules

    return {module: lesson.number for lesson in all_lessons() for module in exported_modules(lesson)}


@functools.lru_cache(maxsize=None)
def builds_on(lesson: Lesson) -> list[str]:
    """The earlier lessons whose modules this lesson's code imports, in order."""
    text = lesson.source.read_text()
    mods = set(re.findall(r"\bminitorch\.(\w+)", text))
    mods |= {m for names in re.findall(r"from minitorch import ([\w, ()\n]+)", text)
             for m in re.findall(r"\w+", names)}
    owners = module_owners()
    return sorted({owners[m] for m in mods if m in owners and owners[m] < lesson.number})


def lesson_markdown(lesson: Lesson) -> str:
    """The lesson's prose (its markdown cells, joined)."""
    out, in_md = [], False
    for line in lesson.source.read_text().splitlines():
        if line.startswith("# %%"):
            in_md = "[markdown]" in line
        elif in_md:
            out.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
    return "\n".join(out)


def notes_used(lesson: Lesson) -> list[str]:
    """The hardware notes the lesson links, in the order it first links them (stems)."""
    found = re.findall(r"\]\(\.\./hardware_notes/(\w+)\.md", lesson_markdown(lesson))
    return list(dict.fromkeys(found))


_GLOSSARY_ITEM = re.compile(r"^- \*\*(?P<term>[^*]+)\*\* \((?P<refs>[^)]*(?:\([^)]*\)[^)]*)*)\): (?P<text>.*)$")


@dataclass
class Term:
    term: str
    refs: str  # the markdown links in the parentheses: the lessons and notes that define it
    text: str
    lessons: list[str]  # lesson numbers it cites
    notes: list[str]  # note stems it cites


def glossary_terms(path: Path | None = None) -> list[Term]:
    """docs/glossary.md's entries: `- **term** ([lesson NN](../lessons/NN_x.ipynb), ...): definition`,
    each on one line (a continuation line starts with two spaces)."""
    path = path or DOCS / "glossary.md"
    lines = path.read_text().splitlines()
    items: list[str] = []
    for line in lines:
        if line.startswith("- **"):
            items.append(line)
        elif items and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
    out = []
    for item in items:
        m = _GLOSSARY_ITEM.match(item.strip())
        if not m:
            raise SiteError(f"docs/glossary.md: an entry not of the form `- **term** (links): text`: {item[:80]!r}")
        refs = m.group("refs")
        out.append(Term(m.group("term"), refs, m.group("text").strip(),
                        re.findall(r"lessons/(\d\d)_\w+\.ipynb", refs),
                        re.findall(r"hardware_notes/(\w+)\.md", refs)))
    return out


# ---------------------------------------------------------------------------------------------
# Links: every relative link of the staged pages points into the site or to the repository


_INLINE_LINK = re.compile(r"(\]\()(<?)([^)\s>]+)(>?(?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"^\s{0,3}(```|~~~|:::)")
_CODE_SPAN = re.compile(r"(`+).+?\1")


def _rewrite_line(line: str, fix) -> str:
    """Apply fix(target) to the link targets of one line, outside its code spans."""
    out, last = [], 0
    for span in _CODE_SPAN.finditer(line):
        out.append(_INLINE_LINK.sub(lambda m: m.group(1) + m.group(2) + fix(m.group(3)) + m.group(4),
                                    line[last:span.start()]))
        out.append(span.group(0))
        last = span.end()
    out.append(_INLINE_LINK.sub(lambda m: m.group(1) + m.group(2) + fix(m.group(3)) + m.group(4), line[last:]))
    return "".join(out)


def rewrite_links(text: str, origin: str, pages: set[str], repo: str) -> str:
    """Markdown `text` of the file at repository path `origin` (its links are relative to its
    folder) with each relative link to a file the site has no page for (a source file, a lesson
    not in this build) turned into its address on GitHub; links between pages stay relative (the
    site keeps the repository's layout). `pages`: repository paths of the site's pages."""
    base = Path(origin).parent

    def fix(target: str) -> str:
        if not target or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//|^#", target):
            return target
        file_part, hash_, anchor = target.partition("#")
        path = os.path.normpath(base / unquote(file_part)).replace(os.sep, "/")
        if path == "README.md":
            return os.path.relpath("index.md", base).replace(os.sep, "/") + hash_ + anchor
        if path in pages:
            return target
        kind = "tree" if (ROOT / path).is_dir() else "blob"
        return f"https://github.com/{repo}/{kind}/{BRANCH}/{path}" + hash_ + anchor

    out, fences = [], []  # open fences: (marker, a directive's (its body is markdown) or code's)
    for line in text.splitlines(keepends=True):
        m = _FENCE.match(line)
        if m and m.group(1) != ":::":
            rest = line.strip()[len(m.group(1)):]
            if fences and fences[-1][0] == m.group(1) and not rest.strip():
                fences.pop()
            elif not (fences and not fences[-1][1]):  # not inside a code block
                fences.append((m.group(1), rest.startswith("{")))
            out.append(line)
            continue
        code = bool(fences) and not fences[-1][1]
        out.append(line if code else _rewrite_line(line, fix))
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Pages


@functools.lru_cache(maxsize=1)
def machine() -> str:
    """This machine in one line: CPU, cores, OS, Python and the packages the figures depend on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    if sys.platform == "darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            cpu = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5).stdout.strip() or cpu
    versions = []
    for name in ("numpy", "numba"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions.append(f"{'NumPy' if name == 'numpy' else 'Numba'} {version(name)}")
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, {', '.join(versions)}")


@functools.lru_cache(maxsize=1)
def gpu_line() -> str:
    from course.gpu import gpu_status

    ok, reason = gpu_status()
    return "a CUDA GPU ran the `gpu` cells" if ok else f"no GPU here, so each `gpu` cell says it skipped ({reason})"


def _lesson_url(n: str, site_lessons: dict[str, Lesson], here: str, repo: str) -> str:
    """A link from the page at repository path `here` to lesson n: its page, or its notebook on GitHub."""
    stem = next((le.stem for le in all_lessons() if le.number == n), None)
    if n in site_lessons:
        return os.path.relpath(f"lessons/{stem}.ipynb", Path(here).parent).replace(os.sep, "/")
    return f"https://github.com/{repo}/blob/{BRANCH}/lessons/{stem}.ipynb"


def lesson_title(lesson: Lesson) -> str:
    first = lesson_markdown(lesson).strip().splitlines()[0]
    return re.sub(r"^#\s*(Lesson \d+:\s*)?", "", first).strip()


def run_box(lesson: Lesson, out: Outputs, site_lessons: dict[str, Lesson], repo: str, terms: list[Term],
            answers: bool) -> str:
    """The box under a lesson page's title: how to run it, where its outputs come from, the lessons
    it builds on and that build on it, its notes and the terms it defines."""
    here = f"lessons/{lesson.stem}.ipynb"
    nb = f"lessons/{lesson.stem}.ipynb"
    colab = f"https://colab.research.google.com/github/{repo}/blob/{BRANCH}/{nb}"
    lab = f"http://localhost:8888/lab/tree/{nb}"
    if out.small:
        how = (f"executed in the **small preview mode** (`MINITORCH_SMALL=1`: smaller sizes, fewer steps) by "
               f"{out.by} on {out.made}, so figures and timings are smaller than the lesson's own; "
               f"`make demo L={lesson.number}` runs it at full size")
    else:
        by = f"`make demo L={lesson.number}`" + (" (run by `make site`)" if "make site" in out.by else "")
        how = (f"executed at **full size** by {by} on {out.made}" + (f", in {out.seconds:.0f} s" if out.seconds else ""))
    load = f"; load average {out.load:.1f} when it finished" if out.load is not None else ""
    code = ("the reference solutions are shown (an instructor's build)" if answers else
            "exercises are shown as you get them (`raise NotImplementedError(\"Exercise ...\")`), and the "
            "outputs are those of the reference solutions")
    lines = [
        ":::{admonition} Run this lesson",
        ":class: tip",
        f"- **On your machine:** `make lab`, then open `{nb}` ([open in JupyterLab]({lab}) once `make lab` "
        f"runs); `make test L={lesson.number}` grades your saved notebook.",
        (f"- **In Colab:** [open in Colab]({colab}), then put "
         f"`%pip install \"minitorch-systems[gpu] @ git+https://github.com/{repo}\"` in a first cell and run it "
         f"([installing](../docs/install.md))." if repo != REPO else
         "- **In Colab:** once the course is on GitHub (this copy was built without its address: "
         "`make site REPO=owner/name`), open the notebook from there in Colab with the install cell "
         "[installing](../docs/install.md) describes."),
        f"- **These outputs:** {how}; on {machine()}{load}; {gpu_line()}.",
        f"- **The code:** the {code}.",
        ":::",
    ]
    before = builds_on(lesson)
    after = [le.number for le in all_lessons() if lesson.number in builds_on(le)]
    notes = notes_used(lesson)
    defined = [t.term for t in terms if lesson.number in t.lessons]
    links = []
    if before:
        links.append("**Builds on:** " + ", ".join(f"[{n}]({_lesson_url(n, site_lessons, here, repo)})" for n in before))
    if after:
        links.append("**Used by:** " + ", ".join(f"[{n}]({_lesson_url(n, site_lessons, here, repo)})" for n in after))
    if notes:
        links.append("**Hardware notes:** " + ", ".join(
            f"[{s.replace('_', ' ')}](../hardware_notes/{s}.md)" for s in notes))
    if defined:
        links.append("**Terms defined here:** " + ", ".join(f"{{term}}`{t}`" for t in defined))
    return "\n".join(lines) + ("\n\n" + " · ".join(links) if links else "") + "\n"


def _clean_outputs(cell) -> None:
    """Drop what a static page cannot show without a CDN: widget views (a live control keeps its
    PNG, a progress bar its text)."""
    kept = []
    for out in cell.get("outputs", []):
        data = out.get("data")
        if data is not None:
            data.pop("application/vnd.jupyter.widget-view+json", None)
            data.pop("application/vnd.jupyter.widget-state+json", None)
            if not data:
                continue
        kept.append(out)
    cell["outputs"] = kept


def page_notebook(lesson: Lesson, out: Outputs, site_lessons: dict[str, Lesson], repo: str, terms: list[Term],
                  pages: set[str], answers: bool = False):
    """The lesson's page: the executed notebook's outputs under the code as the student notebook
    shows it (stubs, given machinery as its import; `answers`: the reference solutions), check
    cells left out, widget views dropped, links fixed, and the run box under the title."""
    import nbformat

    from course.build import BEGIN, END, student_notebook, student_view_cells
    from course.source import read_source

    executed = _read_nb(out.path)
    src = read_source(lesson)
    stub = student_notebook(lesson)
    kept = student_view_cells(src)
    if not len(src.cells) == len(executed.cells) or len(kept) != len(stub.cells):
        raise SiteError(f"lesson {lesson.number}: the executed notebook and the student notebook do not line up")
    cells = []
    for i, shown in zip(kept, stub.cells):
        cell = copy.deepcopy(executed.cells[i])
        if cell.cell_type == "code":
            if answers and "given" not in directives(src.cells[i]):
                cell.source = "\n".join(ln for ln in strip_directives(cell.source).splitlines()
                                        if ln.strip() not in (BEGIN, END))
            else:
                cell.source = shown.source
            _clean_outputs(cell)
            cell_tags = sorted(tags(src.cells[i]))
            if "check" in cell_tags:  # "Exercise 1.2: all 5 tests passed" is the grader's, not the reader's
                cell_tags.append("remove-cell")
            cell.metadata = nbformat.from_dict({"tags": cell_tags} if cell_tags else {})
        else:
            cell.source = rewrite_links(cell.source, f"lessons/{lesson.stem}.ipynb", pages, repo)
            cell.metadata = nbformat.from_dict({})
        cells.append(cell)
    title, _, rest = cells[0].source.partition("\n")
    cells[0].source = title + "\n\n" + run_box(lesson, out, site_lessons, repo, terms, answers) + "\n" + rest
    nb = nbformat.v4.new_notebook(cells=cells, metadata=copy.deepcopy(executed.metadata))
    nb.metadata.pop("widgets", None)
    nb.nbformat, nb.nbformat_minor = executed.nbformat, executed.nbformat_minor
    return nb


def note_page(path: Path, pages: set[str], repo: str, terms: list[Term]) -> str:
    """A hardware note, with a line under its title: the lessons that link it and its glossary terms."""
    text = rewrite_links(path.read_text(), f"hardware_notes/{path.name}", pages, repo)
    if path.stem == "README":
        return text
    users = [le for le in all_lessons() if path.stem in notes_used(le)]
    defined = [t.term for t in terms if path.stem in t.notes]
    extra = []
    if users:
        extra.append("**Lessons that use this note:** " + ", ".join(
            f"[{le.number} {lesson_title(le)}](../lessons/{le.stem}.ipynb)" if f"lessons/{le.stem}.ipynb" in pages
            else f"[{le.number} {lesson_title(le)}](https://github.com/{repo}/blob/{BRANCH}/lessons/{le.stem}.ipynb)"
            for le in users))
    if defined:
        extra.append("**Terms:** " + ", ".join(f"{{term}}`{t}`" for t in defined))
    if not extra:
        return text
    title, _, rest = text.partition("\n")
    return title + "\n\n" + " · ".join(extra) + "\n" + rest


def glossary_page(pages: set[str], repo: str) -> str:
    """docs/glossary.md as a Sphinx glossary (each term an anchor the pages link with {term})."""
    text = (DOCS / "glossary.md").read_text()
    head = text.split("\n- **", 1)[0].rstrip()
    body = ["", "```{glossary}", ":sorted:"]
    for t in glossary_terms():
        body += [t.term, f"  {t.text} ({t.refs})", ""]
    body.append("```")
    return rewrite_links(head + "\n" + "\n".join(body) + "\n", "docs/glossary.md", pages, repo)


def readme_lessons() -> dict[str, tuple[str, str]]:
    """{lesson number: (title, what you build)} from README.md's lesson table."""
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"^\| (\d\d) \| \[([^\]]+)\]\([^)]*\)[^|]*\| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip())
    return rows


def readme_pitch() -> str:
    """README.md's opening paragraphs (between the title and the first section)."""
    text = (ROOT / "README.md").read_text()
    return text.split("\n", 1)[1].split("\n## ", 1)[0].strip()


def doc_pages() -> list[str]:
    found = sorted(p.stem for p in DOCS.glob("*.md"))
    return [s for s in DOC_ORDER if s in found] + [s for s in found if s not in DOC_ORDER]


def _doc_title(stem: str) -> str:
    first = (DOCS / f"{stem}.md").read_text().splitlines()[0]
    return first.lstrip("# ").strip()


def landing_page(site_lessons: dict[str, Lesson], pages: set[str], repo: str) -> str:
    rows = readme_lessons()
    out = ["# minitorch systems", "", readme_pitch(), "",
           "## Start", "",
           "In a clone of the repository (Python 3.11-3.13 and `make`; the first run sets up `.venv`):", "",
           "```", "make lab     # JupyterLab on the lessons", "make test    # grade your saved notebooks", "```", "",
           "Every lesson page below shows the lesson executed, with a box saying how to open it in JupyterLab "
           "or Colab and where its outputs come from. [Installing without make](docs/install.md), "
           "[platforms](docs/platforms.md), [the GPU path](docs/gpu.md), [MPI](docs/mpi.md), "
           "[how grading works](docs/grading.md).", "",
           "## The path through the course", ""]
    for i, (part, numbers) in enumerate(PARTS, 1):
        out += [f"### {i}. {part}", "", "| lesson | you build / measure | builds on |", "|---|---|---|"]
        for n in numbers:
            lesson = next(le for le in all_lessons() if le.number == n)
            title, what = rows.get(n, (lesson_title(lesson), ""))
            link = _lesson_url(n, site_lessons, "index.md", repo)
            before = ", ".join(f"[{b}]({_lesson_url(b, site_lessons, 'index.md', repo)})" for b in builds_on(lesson))
            out.append(f"| [{n} {title}]({link}) | {what} | {before or '-'} |")
        out.append("")
    out += ["## Hardware notes", "",
            "What the machines under minitorch are made of, with every figure's source: "
            "[the index](hardware_notes/README.md).", "",
            "## Guides", ""]
    out += [f"- [{_doc_title(s)}](docs/{s}.md)" for s in doc_pages()]
    out += ["- [Authoring lessons](AUTHORING.md) (maintainers: the source format)", ""]
    # the navigation: one caption per part, then the notes, the guides
    for part, numbers in PARTS:
        entries = [f"lessons/{site_lessons[n].stem}" for n in numbers if n in site_lessons]
        if entries:
            out += ["```{toctree}", ":hidden:", f":caption: {part}", "", *entries, "```", ""]
    notes = ["hardware_notes/README"] + [f"hardware_notes/{p.stem}" for p in sorted(NOTES.glob("*.md")) if p.stem != "README"]
    out += ["```{toctree}", ":hidden:", ":caption: Hardware notes", "", *notes, "```", ""]
    out += ["```{toctree}", ":hidden:", ":caption: Guides", "", *[f"docs/{s}" for s in doc_pages()], "AUTHORING", "```", ""]
    return rewrite_links("\n".join(out), "index.md", pages, repo)


CONF = '''\
# Generated by course/site.py (`make site`): edit it there.
project = "minitorch systems"
author = "the minitorch systems course"
copyright = "the course's authors"
extensions = ["myst_nb"]
html_theme = "sphinx_book_theme"
html_title = "minitorch systems"
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_favicon = "_static/favicon.svg"
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
exclude_patterns = ["_build"]
source_suffix = {{".md": "myst-nb", ".ipynb": "myst-nb"}}
nb_execution_mode = "off"  # the notebooks arrive executed (course/site.py)
nb_ipywidgets_js = {{}}  # MyST-NB would load the widget manager from a CDN; widget views are dropped
nb_merge_streams = True
nb_output_stderr = "show"
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "attrs_inline"]
myst_heading_anchors = 6  # GitHub's anchors, which the notes and lessons link
myst_dmath_double_inline = True
myst_dmath_allow_space = False  # "$40 / 600 kWh = $0.10": prices, not math
myst_dmath_allow_digits = False
myst_update_mathjax = False  # its ignore-classes are for MathJax 3; MathJax 2 here takes only \\( \\[ delimiters
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]
# MathJax 2.7 beside the pages (jupyter-server-mathjax's), never a CDN's
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
mathjax2_config = {{
    "tex2jax": {{"inlineMath": [["\\\\(", "\\\\)"]], "displayMath": [["\\\\[", "\\\\]"]], "processEscapes": True}},
    # the copy has the STIX-Web fonts only (as course/slides_template): no local-font probe, no fast
    # preview (it asks for the TeX fonts)
    "HTML-CSS": {{"availableFonts": [], "preferredFont": None, "webFont": "STIX-Web", "imageFont": None}},
    "MMLorHTML": {{"prefer": "HTML"}},
    "fast-preview": {{"disabled": True}},
    "messageStyle": "none",
}}
html_theme_options = {{
    "repository_url": "https://github.com/{repo}",
    "repository_branch": "{branch}",
    "use_repository_button": {has_repo},
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "use_download_button": False,
    "use_fullscreen_button": False,
}}


def setup(app):
    # a flag the site's test waits for (course.site.inspect_site): MathJax finished typesetting
    app.add_js_file(None, type="text/x-mathjax-config",
                    body='MathJax.Hub.Register.StartupHook("End", function () {{ window.mathjaxDone = true; }});')
'''

FAVICON = """<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" fill="#2b5797"/>
<text x="8" y="12" font-size="10" text-anchor="middle" fill="#fff" font-family="sans-serif">mt</text></svg>
"""

CSS = """\
/* course/site.py: the run box under each lesson's title */
.admonition.tip p { margin-bottom: 0.35em; }
/* The hidden MathML MathJax keeps for screen readers asks, through its NativeMML styles, for TeX fonts
   the copy lacks (\\mathbb: MathJax_AMS); it is never seen, so any font will do (as in the slides). */
.MJX_Assistive_MathML [mathvariant] { font-family: serif !important; }
"""


def _write(path: Path, text: str) -> None:
    """Write only if different, so that Sphinx rebuilds only the pages that changed."""
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def stage(dest: Path, outputs: list[Outputs], repo: str, answers: bool) -> Path:
    """Write the site's sources into dest/src: conf.py, index.md, lessons/, hardware_notes/, docs/,
    AUTHORING.md, _static/ (MathJax, CSS). Returns the source folder."""
    import nbformat

    from course.slides import copy_mathjax

    src = dest / "src"
    site_lessons = {o.lesson.number: o.lesson for o in outputs}
    pages = ({f"lessons/{o.lesson.stem}.ipynb" for o in outputs} | {f"hardware_notes/{p.name}" for p in NOTES.glob("*.md")}
             | {f"docs/{p.name}" for p in DOCS.glob("*.md")} | {"AUTHORING.md"})
    terms = glossary_terms()
    _write(src / "conf.py", CONF.format(repo=repo, branch=BRANCH, has_repo=repo != REPO))
    _write(src / "index.md", landing_page(site_lessons, pages, repo))
    _write(src / "AUTHORING.md", rewrite_links((ROOT / "AUTHORING.md").read_text(), "AUTHORING.md", pages, repo))
    for p in NOTES.glob("*.md"):
        _write(src / "hardware_notes" / p.name, note_page(p, pages, repo, terms))
    for p in DOCS.glob("*.md"):
        text = glossary_page(pages, repo) if p.stem == "glossary" else \
            rewrite_links(p.read_text(), f"docs/{p.name}", pages, repo)
        _write(src / "docs" / p.name, text)
    keep_lessons = set()
    for o in outputs:
        nb = page_notebook(o.lesson, o, site_lessons, repo, terms, pages, answers)
        _write(src / "lessons" / f"{o.lesson.stem}.ipynb", nbformat.writes(nb) + "\n")
        keep_lessons.add(f"{o.lesson.stem}.ipynb")
    for old in (src / "lessons").glob("*.ipynb"):  # lessons of an earlier, larger build
        if old.name not in keep_lessons:
            old.unlink()
    static = src / "_static"
    static.mkdir(parents=True, exist_ok=True)
    copy_mathjax(static)
    _write(static / "site.css", CSS)
    _write(static / "favicon.svg", FAVICON)
    return src


def sphinx_build(src: Path, html: Path, doctrees: Path) -> list[str]:
    """Run Sphinx (a child process: the build's imports stay out of this one); returns its warnings.
    A warning that a page or a link target is missing fails the build."""
    warnings = html.parent / "warnings.txt"
    html.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-d", str(doctrees), "-w", str(warnings),
           "-j", "1", str(src), str(html)]
    r = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
    text = warnings.read_text() if warnings.exists() else ""
    if r.returncode != 0:
        raise SiteError(f"Sphinx failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [line for line in text.splitlines() if "WARNING" in line or "ERROR" in line]


FATAL_WARNINGS = re.compile(r"xref_missing|not found|toc\.not_readable|undefined label|unknown document|"
                            r"image file not readable|term not in glossary|duplicate|ERROR")


def site_dest(lessons: list[Lesson] | None, answers: bool = False) -> Path:
    """Where a build goes: build/site/ for every lesson, build/site/lesson-NN/ for some; an answers
    build (an instructor's) goes beside them into build/site/answers[-lesson-NN]/, never where the
    public site is built."""
    name = "" if lessons is None else "lesson-" + "-".join(le.number for le in lessons)
    if answers:
        return SITE / "-".join(filter(None, ["answers", name]))
    return SITE / name if name else SITE


def build(lessons: list[Lesson] | None = None, small: bool = False, run: bool = False, answers: bool = False,
          dest: Path | None = None, repo: str | None = None, small_dir: Path | None = None) -> Path:
    """Build the site; returns its index.html. SiteError says why it cannot."""
    everything = lessons is None
    lessons = lessons or all_lessons()
    if dest is None:
        dest = site_dest(None if everything else lessons, answers)
    repo = repo or default_repo()
    t0 = time.perf_counter()
    outputs, errors = [], []
    for lesson in lessons:  # every lesson's problem at once, not the first
        try:
            outputs.append(outputs_for(lesson, small=small, run=run, small_dir=small_dir))
        except SiteError as exc:
            errors.append(str(exc))
    if errors:
        raise SiteError("\n".join(errors))
    t_out = time.perf_counter() - t0
    src = stage(dest, outputs, repo, answers)
    t_stage = time.perf_counter() - t0 - t_out
    html = dest / "html"
    warnings = sphinx_build(src, html, dest / ".doctrees")
    fatal = [w for w in warnings if FATAL_WARNINGS.search(w)]
    if fatal:
        raise SiteError(f"{len(fatal)} problem(s) in the pages:\n" + "\n".join(fatal[:40]))
    for o in outputs:  # never stale: what the pages show is what the lessons are now
        why = stale_reason(o.lesson, _read_nb(o.path))
        if why:
            raise SiteError(f"lesson {o.lesson.number} changed while the site was built ({why}): build it again")
    full = ", ".join(o.lesson.number for o in outputs if not o.small) or "none"
    small_ = ", ".join(o.lesson.number for o in outputs if o.small) or "none"
    print(f"{_shown(html / 'index.html')}: {len(outputs)} lessons (full size: {full}; small: {small_}), "
          f"{len(list(NOTES.glob('*.md')))} notes, {len(doc_pages())} guides; outputs "
          f"{t_out:.0f} s, pages {t_stage:.0f} s, Sphinx {time.perf_counter() - t0 - t_out - t_stage:.0f} s"
          + (f"; {len(warnings)} warnings in {_shown(html.parent / 'warnings.txt')}" if warnings else ""), flush=True)
    return html / "index.html"


# ---------------------------------------------------------------------------------------------
# Serving and the reader's test


@contextlib.contextmanager
def serve(root: Path, port: int = 0):
    """Serve `root` on http://127.0.0.1:port/ (0: a free port) in a thread; yields the base URL."""
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):  # noqa: ANN002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


_PAGE_FACTS = """async () => {
  const art = document.querySelector('article, .bd-article, main') || document.body;
  const imgs = [...document.querySelectorAll('img')];
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  const math = [...art.querySelectorAll('.math.notranslate')];  // Sphinx's formulas (MathJax's output has span.math too)
  return {
    title: document.title,
    images: imgs.length,
    broken_images: imgs.filter(i => !(i.naturalWidth > 0)).map(i => i.getAttribute('src')),
    figures: art.querySelectorAll('.cell_output img, .output img').length,
    math: math.length,
    typeset: math.filter(m => m.querySelector('script[type^="math/tex"]') && m.querySelector('.MathJax, .MathJax_Display, .MathJax_Preview')).length,
    math_errors: art.querySelectorAll('.MathJax_Error, merror, .noError').length,
    tex_left: (() => { const c = art.cloneNode(true); c.querySelectorAll('pre, code, script, .MathJax, .MathJax_Display, .MathJax_Preview, .highlight').forEach(e => e.remove());
                       return (c.textContent.match(/\\\\\\(|\\\\\\[|\\$\\$|\\$[^$\\s][^$\\n]{0,80}[^$\\s\\\\]\\$/g) || []).slice(0, 5); })(),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
    assets: [...document.querySelectorAll('link[href]:not([rel~="canonical"]):not([rel~="next"]):not([rel~="prev"]):not([rel~="index"]):not([rel~="search"]), script[src], img[src], source[src], iframe[src]')]
              .map(e => e.href || e.src),
    ids: [...document.querySelectorAll('[id]')].map(e => e.id),
    text: art.innerText.length,
  };
}"""


def expected_figures(src: Path) -> dict[str, int]:
    """{lesson page: the figures its notebook holds} (image outputs of the cells the page shows)."""
    import nbformat

    out = {}
    for path in sorted((src / "lessons").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        out[f"lessons/{path.stem}.html"] = sum(
            any(k.startswith("image/") for k in o.get("data", {}))
            for c in nb.cells if c.cell_type == "code" and not {"remove-cell", "remove-output"} & set(c.metadata.get("tags", []))
            for o in c.outputs)
    return out


def inspect_site(html_root: Path, search: tuple[str, str] | None = None, timeout_ms: int = 60_000,
                 screenshot: Path | None = None, figures: dict[str, int] | None = None) -> dict:
    """Open every page of the built site in headless Chromium, served on loopback, as a reader
    would. Every request to anything but the loopback server is refused and recorded. Returns
    {"pages": {page: facts}, "requests": refused URLs, "missing": loopback requests that failed or
    answered >= 400, "problems": what is wrong, one line each, "search": result pages} where a
    page's facts are its images and broken ones, figures (notebook outputs), formulas and those
    MathJax typeset, TeX left untypeset, and links; `search=(term, page)`: the search page is asked
    for term and must list page; `figures={page: n}`: the page must show n figures (expected_figures)."""
    from playwright.sync_api import sync_playwright

    from course.browser import CHROMIUM_FLAGS, find_chromium

    pages = sorted(p.relative_to(html_root).as_posix() for p in html_root.rglob("*.html")
                   if not p.relative_to(html_root).parts[0].startswith("_"))
    refused: list[str] = []
    missing: list[str] = []
    facts: dict[str, dict] = {}
    problems: list[str] = []
    found: list[str] = []
    with serve(html_root) as base, sync_playwright() as pw:
        def route(r):
            if r.request.url.startswith(base):
                r.continue_()
            else:
                refused.append(r.request.url)
                r.abort()

        def response(resp):
            if resp.url.startswith(base) and resp.status >= 400:
                missing.append(f"{resp.url} ({resp.status})")

        browser = pw.chromium.launch(executable_path=find_chromium(), args=CHROMIUM_FLAGS)
        try:
            ctx = browser.new_context(viewport={"width": 1280, "height": 900})
            ctx.route("**/*", route)
            page = ctx.new_page()
            page.on("response", response)
            # a request the next page's navigation cut short (ERR_ABORTED) is not a missing file
            # Chromium cancels the requests in flight when the machine's network changes (another job adding
            # a network namespace or an interface: make cluster): not a missing file, but the page is loaded again
            changed: list[str] = []

            def failed(r):
                if not r.url.startswith(base) or "ABORTED" in (r.failure or ""):
                    return
                (changed if "NETWORK_CHANGED" in (r.failure or "") else missing).append(f"{r.url} ({r.failure})")

            page.on("requestfailed", failed)

            def goto(url: str) -> None:
                for attempt in range(3):
                    changed.clear()
                    try:
                        page.goto(url, wait_until="load", timeout=timeout_ms)
                    except Exception as exc:  # noqa: BLE001 - the page itself cut short by a network change
                        if "NETWORK_CHANGED" not in str(exc) or attempt == 2:
                            raise
                        changed.append(f"{url} (net::ERR_NETWORK_CHANGED)")
                    if not changed:
                        return
                missing.extend(changed)

            for name in pages:
                goto(base + name)
                has_math = page.evaluate("() => document.querySelectorAll('.math.notranslate').length > 0")
                if has_math:
                    try:
                        page.wait_for_function("() => window.mathjaxDone === true", timeout=timeout_ms)
                    except Exception:  # noqa: BLE001 - reported below as untypeset formulas
                        problems.append(f"{name}: MathJax did not finish within {timeout_ms / 1000:.0f} s")
                f = page.evaluate(_PAGE_FACTS)
                facts[name] = f
                if f["broken_images"]:
                    problems.append(f"{name}: images that did not load: {f['broken_images'][:5]}")
                if figures and name in figures and f["figures"] != figures[name]:
                    problems.append(f"{name}: {f['figures']} figures shown, its notebook has {figures[name]}")
                if f["math"] != f["typeset"] or f["math_errors"]:
                    problems.append(f"{name}: {f['math'] - f['typeset']} of {f['math']} formulas not typeset, "
                                    f"{f['math_errors']} MathJax errors")
                if f["tex_left"]:
                    problems.append(f"{name}: TeX left as text: {f['tex_left']}")
                if screenshot is not None and name.startswith("lessons/") and f["figures"] and not screenshot.exists():
                    page.locator(".cell_output img").first.scroll_into_view_if_needed()
                    page.screenshot(path=str(screenshot))
            if search:
                term, expect = search
                goto(base + f"search.html?q={term}")
                page.wait_for_function("""() => { const s = document.querySelector('#search-results');
                    return s && (s.querySelector('li') || /found|did not match/i.test(s.innerText)); }""",
                                       timeout=timeout_ms)
                page.wait_for_timeout(500)
                found = page.evaluate("() => [...document.querySelectorAll('#search-results li a')].map(a => a.href)")
                if not any(expect in u for u in found):
                    problems.append(f"search for {term!r} did not list {expect} (it listed {found[:8]})")
        finally:
            browser.close()
    # links: every link into the site names a file that exists, and its #anchor an id on that page;
    # every file a page refers to (styles, scripts, images, the icon) exists, loaded or not
    for name, f in facts.items():
        for href in f["assets"]:
            target = unquote(urlsplit(href).path[len(urlsplit(base).path):])
            if href.startswith(base) and not (html_root / target).is_file():
                problems.append(f"{name}: refers to {href[len(base):]}: no such file")
        for href in f["links"]:
            if not href.startswith(base):
                continue
            parts = urlsplit(href)
            target = unquote(parts.path[len(urlsplit(base).path):]) or "index.html"
            if target.endswith("/"):
                target += "index.html"
            if not (html_root / target).exists():
                problems.append(f"{name}: link to {href[len(base):]}: no such file")
            elif parts.fragment and target in facts and unquote(parts.fragment) not in facts[target]["ids"]:
                problems.append(f"{name}: link to {href[len(base):]}: no #{parts.fragment} on {target}")
    if refused:
        problems.append(f"{len(refused)} requests outside loopback, refused: {sorted(set(refused))[:10]}")
    if missing:
        problems.append(f"{len(missing)} files missing: {sorted(set(missing))[:10]}")
    return {"pages": facts, "requests": refused, "missing": missing, "problems": problems, "search": found}


SEARCH = ("bucketing", "lessons/12_data_parallel.html")  # a term lesson 12 defines


def test_site(index: Path, screenshot: Path | None = None) -> int:
    """Open the built site in Chromium; print what was seen and each problem. 0 if none."""
    from course.browser import missing as browser_missing

    why = browser_missing()
    if why:
        print(f"site test skipped: {why}")
        return 1 if os.environ.get("MT_BROWSER_REQUIRED") == "1" else 2
    html_root = index.parent
    search = SEARCH if (html_root / SEARCH[1]).exists() else None
    t0 = time.perf_counter()
    seen = inspect_site(html_root, search, screenshot=screenshot, figures=expected_figures(html_root.parent / "src"))
    pages = seen["pages"]
    print(f"site test: {len(pages)} pages in Chromium in {time.perf_counter() - t0:.0f} s: "
          f"{sum(f['figures'] for f in pages.values())} figures, {sum(f['images'] for f in pages.values())} images, "
          f"{sum(f['typeset'] for f in pages.values())}/{sum(f['math'] for f in pages.values())} formulas typeset, "
          f"{sum(len(f['links']) for f in pages.values())} links, {len(seen['requests'])} requests outside loopback, "
          f"{len(seen['missing'])} missing files" + (f", search for {search[0]!r}: {len(seen['search'])} results" if search else ""))
    for p in seen["problems"]:
        print("  " + p)
    return 1 if seen["problems"] else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lessons", nargs="*")
    ap.add_argument("--small", action="store_true", help="every lesson in the small preview mode (MINITORCH_SMALL=1)")
    ap.add_argument("--run", action="store_true", help="execute again the outputs of lessons that changed")
    ap.add_argument("--answers", action="store_true", help="show the reference solutions (an instructor's build)")
    ap.add_argument("--repo", help="owner/name on GitHub for the Colab and source links (default MT_SITE_REPO, else the origin remote's)")
    ap.add_argument("--test", action="store_true", help="then open every page in headless Chromium")
    ap.add_argument("--serve", action="store_true", help="serve the built site on loopback until Ctrl-C")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args(argv)
    lessons = [find_lesson(k) for k in args.lessons] if args.lessons else None
    dest = site_dest(lessons, args.answers)
    if args.serve:
        index = dest / "html" / "index.html"
        if not index.exists():
            print(f"no site at {_shown(index)}: make site first")
            return 1
        with serve(index.parent, args.port) as url:
            print(f"serving {_shown(index.parent)} on {url} (Ctrl-C stops)", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
        return 0
    try:
        index = build(lessons, small=args.small, run=args.run, answers=args.answers, dest=dest, repo=args.repo)
    except SiteError as exc:
        print(f"make site failed: {exc}", flush=True)
        return 1
    if args.test:
        rc = test_site(index, screenshot=index.parent.parent / "lesson.png")
        return 0 if rc == 2 else rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
