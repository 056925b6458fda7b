"""`make release DEST=dir [UPTO=NN]`: a repository a class clones, without the answers.

    python -m course.release DEST [--upto NN]   # write DEST (new or empty), git init, one commit
    python -m course.release --verify [DIR]     # in a release: check what it contains

The release holds lessons 01..NN (stub notebooks, generated fresh from solutions/) and their tests;
minitorch/ with the reference modules of the lessons before NN (a lesson is graded with the
reference of the earlier ones) and lesson NN's given modules (machinery its notebook imports, never
an exercise), and nothing of lessons NN and later; course/ (the grader, with `course/lessons.json`
standing for solutions/: each lesson's exercises, which notebook cell is which exercise, its given
functions); data/, hardware_notes/; its own README, Makefile, pyproject.toml, constraints.txt; a
GitHub Classroom autograding workflow. No solutions/, no benchmarks/ (they time every lesson's
reference). UPTO defaults to the first lesson: a release never carries answers unless asked.

Before the commit the release is checked against the sources (`check_release`): no solution
marker in any file, no solution region's body (normalised: stripped lines, blank lines dropped)
of lesson NN or later in any file, lesson NN's own modules absent, and every `minitorch.X` the
released notebooks and tests import present.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the checkout holding this machinery
MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")
WORKFLOW = ".github/workflows/classroom.yml"


def _source_root() -> Path:
    from course.source import ROOT

    return ROOT


def plan(upto: str | None):
    """(released lessons, the lesson NN whose answers are withheld)."""
    from course.source import all_lessons, find_lesson

    lessons = all_lessons()
    last = find_lesson(upto) if upto else lessons[0]
    return [le for le in lessons if int(le.number) <= int(last.number)], last


def given_modules(lesson, nb) -> dict[str, str]:
    """{module: source} of the modules every cell of which, in `lesson`, is `#| given`."""
    from course.build import exported_modules
    from course.source import default_module, directives

    default = default_module(nb)
    kinds: dict[str, set[bool]] = {}
    for cell in nb.cells:
        d = directives(cell)
        if "export" in d:
            kinds.setdefault(d["export"] or default, set()).add("given" in d)
    modules = exported_modules(lesson, nb)
    return {m: modules[m] for m, k in kinds.items() if k == {True}}


def index_entry(lesson, nb) -> dict:
    from course.build import exercise_cells
    from course.feedback import given_in
    from course.source import exercises

    return {"exercises": exercises(nb), "cells": exercise_cells(lesson, nb),
            "given_functions": sorted(given_in([c.source for c in nb.cells if c.cell_type == "code"]))}


def solution_bodies(nb) -> list[str]:
    """Each solution region of a lesson, normalised (stripped lines, no blank lines)."""
    out, inside, body = [], False, []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for line in cell.source.splitlines():
            s = line.strip()
            if s.startswith(MARKERS[0]):
                inside, body = True, []
            elif s.startswith(MARKERS[1]):
                inside = False
                if body:
                    out.append("\n".join(body))
            elif inside and s:
                body.append(s)
    return out


def normalised_text(text: str) -> str:
    return "\n".join(s for s in (ln.strip() for ln in text.splitlines()) if s)


def normalised(path: Path) -> str:
    """A file's text (a notebook's: its cells' sources) with each line stripped, blank lines dropped."""
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        cells = json.loads(text).get("cells", [])
        text = "\n".join("".join(c.get("source", "")) for c in cells)
    return normalised_text(text)


def distinctive(bodies: list[str], shared: str) -> list[str]:
    """The bodies that do not also occur in `shared` (normalised text shipped by design)."""
    return [b for b in bodies if b not in shared]


def _text_files(root: Path):
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".git" not in p.relative_to(root).parts and p.suffix not in (".gz", ".npz"):
            yield p


def _lesson_rows(released) -> str:
    from course.source import read_source

    rows = []
    for le in released:
        title = next((c.source.splitlines()[0].lstrip("# ").strip() for c in read_source(le).cells
                      if c.cell_type == "markdown" and c.source.strip()), le.stem)
        rows.append(f"| {le.number} | [lessons/{le.notebook.name}](lessons/{le.notebook.name}) | {title} |")
    return "\n".join(rows)


def readme(released, last, modules: dict[str, str]) -> str:
    before = f"lessons {released[0].number}-{released[-2].number}" if len(released) > 2 else (
        f"lesson {released[0].number}" if len(released) == 2 else "no lesson")
    given = sorted(m for m, why in modules.items() if why == "given")
    return f"""# minitorch systems: the class release (lessons {released[0].number}-{last.number})

A hands-on course on deep-learning systems: you build `minitorch`, a small NumPy deep-learning
framework, then make it fast, lean and big. Every exercise is graded automatically, on a laptop.

## Start

```
make lab     # first run: creates .venv with pinned versions (~3 min), then opens JupyterLab
make test    # grades your saved notebooks and prints a scoreboard
```

Python 3.11-3.13 and `make` are all you need (`make setup PYTHON=python3.12` picks the Python).
`make test L=02` grades one lesson. In a notebook, each exercise's check cell runs its tests on the
code in your kernel; Run All on an untouched notebook says "not attempted" for every exercise.

## What is in this release

| # | notebook | lesson |
|---|---|---|
{_lesson_rows(released)}

- `lessons/`: your notebooks. Each exercise is a function whose body raises `NotImplementedError`.
- `tests/`: the tests that grade them (`make test`, and the check cells).
- `minitorch/`: the course's reference package: the reference code of {before} (a lesson is
  graded with your code for that lesson and the reference for the earlier ones){
  f", and lesson {last.number}'s given machinery ({', '.join(f'`minitorch/{m}.py`' for m in given)}), which its notebook imports" if given else ""}.
  Lesson {last.number}'s answers are not in it: your instructor releases each lesson's reference
  after its deadline.
- `course/`: the grader. `hardware_notes/`, `data/`: what the lessons link and read.

`make verify` checks what this release contains (no solution in any file; only the modules listed
above in `minitorch/`).
"""


MAKEFILE = """# A student release of the minitorch systems course (written by `make release`).
PY      := .venv/bin/python
STAMP   := .venv/.installed
L       ?=
BLAS_THREADS ?= 1
PYTHON ?= python3
CONSTRAINTS := constraints.txt

.PHONY: setup lab test verify clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
\t@$(PYTHON) course/setup_venv.py .venv $(CONSTRAINTS)
\t@touch $(STAMP)

lab: $(STAMP)
\tOPENBLAS_NUM_THREADS=$(BLAS_THREADS) MKL_NUM_THREADS=$(BLAS_THREADS) .venv/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/lessons

test: $(STAMP)
\t$(PY) -m course.grade $(L)

verify: $(STAMP)
\t$(PY) -m course.release --verify .

clean:
\trm -rf build .pytest_cache
\tfind . -name __pycache__ -not -path "./.venv/*" -prune -exec rm -rf {} +
"""


def workflow(released) -> str:
    """GitHub Classroom's autograding: one test per lesson, `make test L=NN` (its exit code is the
    verdict), points per lesson, reported by the autograding-grading-reporter action."""
    steps, ids = [], []
    for le in released:
        ident = f"lesson-{le.number}"
        ids.append(ident)
        steps.append(f"""      - name: lesson {le.number}
        id: {ident}
        uses: classroom-resources/autograding-command-grader@v1
        with:
          test-name: lesson {le.number}
          setup-command: make setup
          command: make test L={le.number}
          timeout: 30
          max-score: 10""")
    results = "\n".join(f"          {i.upper().replace('-', '_')}_RESULTS: \"${{{{steps.{i}.outputs.result}}}}\"" for i in ids)
    return f"""# GitHub Classroom autograding (written by `make release`): each lesson is one test, worth 10
# points when `make test L=NN` exits 0 (every exercise passes; GPU-only tests skip).
name: Autograding Tests
on: [push, repository_dispatch]
permissions:
  checks: write
  actions: read
  contents: read
jobs:
  run-autograding-tests:
    runs-on: ubuntu-latest
    if: github.actor != 'github-classroom[bot]'
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.12"
{chr(10).join(steps)}
      - name: Autograding Reporter
        uses: classroom-resources/autograding-grading-reporter@v1
        env:
{results}
        with:
          runners: {','.join(ids)}
"""


def build_release(dest: Path, upto: str | None = None, commit: bool = True) -> Path:
    from course.build import exported_modules, notebook_text, student_notebook
    from course.source import all_lessons, read_source

    root = _source_root()
    dest = Path(dest).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"{dest} exists and is not empty: a release is written into a new folder")
    released, last = plan(upto)
    dest.mkdir(parents=True, exist_ok=True)

    def write(rel: str, text: str) -> None:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    index, modules = {"upto": last.number, "lessons": {}, "modules": {}}, {}
    for le in released:
        nb = read_source(le)
        write(f"lessons/{le.notebook.name}", notebook_text(student_notebook(le, nb)))
        (dest / "tests").mkdir(exist_ok=True)
        shutil.copyfile(le.tests, dest / "tests" / le.tests.name)
        index["lessons"][le.stem] = index_entry(le, nb)
        chosen = exported_modules(le, nb) if le != last else given_modules(le, nb)
        for name, text in chosen.items():
            write(f"minitorch/{name.replace('.', '/')}.py", text)
            modules[name] = "reference" if le != last else "given"
            index["modules"][name] = {"lesson": le.stem, "kind": modules[name]}
    for le in all_lessons():  # what a demo cell may import and this release withholds (course.notebook)
        for name in exported_modules(le, read_source(le)):
            if name not in index["modules"]:
                index.setdefault("withheld", {})[name] = le.stem
    doc = ['"""minitorch: the course\'s reference package, as released to the class.\n',
           f"Reference modules of the lessons before {last.number}; given machinery of lesson {last.number}:\n"]
    doc += [f"    minitorch.{m:<14} {v['kind']:<9} lesson {v['lesson']}\n" for m, v in index["modules"].items()]
    write("minitorch/__init__.py", "".join(doc) + '"""\n')
    write("course/lessons.json", json.dumps(index, indent=1) + "\n")
    for helper in sorted((root / "tests").glob("*.py")):  # conftest and the tests' shared helpers
        if not helper.name.startswith("test_"):
            shutil.copyfile(helper, dest / "tests" / helper.name)
    ignore = shutil.ignore_patterns("__pycache__", "_tree", "*.pyc", "lessons.json")
    shutil.copytree(REPO / "course", dest / "course", ignore=ignore, dirs_exist_ok=True)
    for folder in ("data", "hardware_notes"):
        if (root / folder).is_dir():
            shutil.copytree(root / folder, dest / folder, ignore=ignore)
    for name in ("pyproject.toml", "constraints.txt", "setup.py", ".gitignore"):
        shutil.copyfile(REPO / name, dest / name)
    write("MANIFEST.in", "include setup.py pyproject.toml constraints.txt\ninclude tests/*.py data/*\n")
    write("Makefile", MAKEFILE)
    write("README.md", readme(released, last, modules))
    write(WORKFLOW, workflow(released))
    problems = check_release(dest, last)
    if problems:
        raise SystemExit("the release is not clean:\n  " + "\n  ".join(problems))
    if commit:
        git = ["git", "-c", "user.name=minitorch release", "-c", "user.email=release@localhost",
               "-c", "commit.gpgsign=false", "-C", str(dest)]
        subprocess.run(git[:-2] + ["init", "-q", "-b", "main", str(dest)], check=True)
        subprocess.run(git + ["add", "-A"], check=True)
        subprocess.run(git + ["commit", "-q", "-m", f"minitorch systems: lessons {released[0].number}-{last.number}"],
                       check=True)
    return dest


def verify(dest: Path) -> list[str]:
    """What a release can check of itself (no sources needed): no solution marker in any file, no
    solutions/, and minitorch/ holding exactly the modules its index lists."""
    dest = Path(dest)
    problems = []
    if (dest / "solutions").exists():
        problems.append("solutions/ is present")
    for p in _text_files(dest):  # a line that is a marker (the machinery names them, in strings)
        if any(line.startswith(MARKERS) for line in normalised(p).splitlines()):
            problems.append(f"{p.relative_to(dest)}: holds a solution marker")
    index = json.loads((dest / "course" / "lessons.json").read_text())
    present = {str(p.relative_to(dest / "minitorch").with_suffix("")).replace("/", ".")
               for p in (dest / "minitorch").rglob("*.py") if p.name != "__init__.py"}
    for extra in sorted(present - set(index["modules"])):
        problems.append(f"minitorch/{extra}.py: not a module this release lists")
    for missing in sorted(set(index["modules"]) - present):
        problems.append(f"minitorch/{missing}.py: listed but absent")
    return problems


def check_release(dest: Path, last) -> list[str]:
    """verify(), plus what only the sources can tell: no body of a solution region of lesson NN or
    later in any file, none of their own modules present, every imported minitorch module there."""
    from course.build import exported_modules
    from course.source import all_lessons, read_source

    problems = verify(dest)
    files = {p: normalised(p) for p in _text_files(dest) if p.name != "lessons.json"}
    withheld = [le for le in all_lessons() if int(le.number) >= int(last.number)]
    shared = "\n".join(files[p] for p in files if p.is_relative_to(dest / "tests")) + "\n".join(
        normalised_text(text) for le in all_lessons() if int(le.number) < int(last.number)
        for text in exported_modules(le).values())
    for le in withheld:
        nb = read_source(le)
        # a region whose body is also in an earlier lesson's reference or in the tests (a line such
        # as `b, t, c = x.shape`, a block lesson 13 shares with lesson 09's model) reveals nothing
        for body in distinctive(solution_bodies(nb), shared):
            for p, text in files.items():
                if body in text:
                    problems.append(f"{p.relative_to(dest)}: holds a solution of lesson {le.number}: "
                                    f"{body.splitlines()[0][:60]}")
        shipped = given_modules(le, nb) if le == last else {}
        for name in exported_modules(le, nb):
            if name not in shipped and (dest / "minitorch" / f"{name.replace('.', '/')}.py").exists():
                problems.append(f"minitorch/{name}.py: lesson {le.number}'s module is present")
    # what a test or a cell run when grading imports must be there (a demo cell may import a later
    # lesson's module: in a release, course.notebook prints one line for it and Run All goes on)
    needed = {p: files[p] for p in (dest / "tests").glob("*.py")}
    for p in (dest / "lessons").glob("*.ipynb"):
        cells = json.loads(p.read_text())["cells"]
        needed[p] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code"
                              and not set(c.get("metadata", {}).get("tags", [])) & {"demo", "gpu", "check"})
    own = {f"{le.stem}.ipynb": set(exported_modules(le)) for le in all_lessons()}
    for p, text in needed.items():  # (a lesson's own module: imported only under a guard, by the package)
        for name in set(re.findall(r"(?:from|import)\s+minitorch\.(\w+)", text)) - own.get(p.name, set()):
            if not (dest / "minitorch" / f"{name}.py").exists():
                problems.append(f"{p.relative_to(dest)}: imports minitorch.{name}, which the release lacks")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", nargs="?", help="the folder to write (new or empty); with --verify, the release")
    ap.add_argument("--upto", default=None, help="the last lesson released, whose answers are withheld (default: the first)")
    ap.add_argument("--verify", action="store_true", help="check a release's contents")
    args = ap.parse_args(argv)
    if args.verify:
        problems = verify(Path(args.dest or "."))
        print("\n".join(problems) if problems else "release contents: clean (no solutions; minitorch/ as listed)")
        return 1 if problems else 0
    if not args.dest:
        ap.error("usage: make release DEST=dir [UPTO=NN]")
    dest = build_release(Path(args.dest), args.upto)
    released, last = plan(args.upto)
    print(f"wrote {dest}: lessons {released[0].number}-{last.number} (lesson {last.number}'s answers withheld), "
          "checked, one commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
