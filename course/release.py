"""`make release DEST=dir [FROM=NN] [UPTO=NN]`: a repository a class clones, without the answers.

    python -m course.release DEST [--upto NN] [--from NN] [--grader DIR]
                                                # write DEST (new or empty: git init, one commit; an
                                                # earlier release: one more commit, see below)
    python -m course.release --verify [DIR]     # in a release: check what it contains
    python -m course.release --matrix [NN ...]  # release up to each lesson, grade stub and solution inside

The release holds lessons 01..NN (stub notebooks, generated fresh from solutions/) and their tests
(without the tests marked `@pytest.mark.hidden`); minitorch/ with the reference modules of the lessons
before FROM (a lesson is graded with the reference of the earlier ones) and the given modules of
lessons FROM..NN (machinery their notebooks import, never an exercise), and nothing of the answers of
lessons FROM..NN; course/ (the grader, with `course/lessons.json` standing for solutions/: each lesson's
exercises, which notebook cell is which exercise, its given functions); data/, hardware_notes/; its own
README, Makefile, pyproject.toml, constraints.txt; a GitHub Classroom autograding workflow. No
solutions/, no benchmarks/ (they time every lesson's reference). UPTO defaults to the first lesson,
FROM to UPTO: a release never carries answers unless asked.

FROM < UPTO withholds several lessons' answers at once (a multi-lesson assignment): a module of lessons
FROM..UPTO-1 that a later lesson imports is then the student's own code, loaded from their notebook
(course/own.py), until its reference is released.

DEST holding an earlier release (a git clone of the class repository, clean): the new lessons are added
and the references that became due replace what stood for them, as one new commit, so that students
pull it. The lesson notebooks already there are not touched (they are the students' work: the commit
merges into their clones without a conflict). A lesson's answers enter the release only when a later
release no longer withholds them: `UPTO=04` after `UPTO=03` adds lesson 04 and lesson 03's reference.

--grader DIR writes the instructor's grading repository beside it (the release with every test, hidden
ones included, the points and the grading requirements): the GitHub Classroom workflow checks it out
(repository variable MINITORCH_GRADER_REPO, secret MINITORCH_GRADER_TOKEN) and grades with it, never
with the tests in the student's repository. Keep it private.

Before the commit the release is checked against the sources (`check_release`): no solution marker in
any file, no solution region's body (normalised: stripped lines, blank lines dropped) of lesson FROM or
later in any file, the own modules of lessons FROM..NN absent (or the student's own, for the later
lessons of the window), every `minitorch.X` the released notebooks and tests import present, and no
hidden test in a released test file.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the checkout holding this machinery
MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")
WORKFLOW = ".github/workflows/classroom.yml"
GRADER_VAR, GRADER_SECRET = "MINITORCH_GRADER_REPO", "MINITORCH_GRADER_TOKEN"
REQUIREMENTS = "requirements-grading.txt"
# what a release writes, below its root: an update replaces these and leaves anything else alone
MANAGED_DIRS = ("lessons", "tests", "minitorch", "course", "data", "hardware_notes")
OWN_HEADER = '"""minitorch.{module}: lesson {number}\'s module, withheld from this release with the lesson\'s answers.'


def _source_root() -> Path:
    from course.source import ROOT

    return ROOT


def plan(upto: str | None):
    """(released lessons, the lesson NN whose answers are withheld)."""
    released, _first, last = window(upto)
    return released, last


def window(upto: str | None, frm: str | None = None):
    """(released lessons, first and last lesson whose answers are withheld)."""
    from course.source import all_lessons, find_lesson

    lessons = all_lessons()
    last = find_lesson(upto) if upto else lessons[0]
    first = find_lesson(frm) if frm else last
    if int(first.number) > int(last.number):
        raise SystemExit(f"FROM={first.number} comes after UPTO={last.number}")
    return [le for le in lessons if int(le.number) <= int(last.number)], first, last


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


def own_parts(lesson, nb, module: str) -> list[dict]:
    """How to rebuild `module` of `lesson` from a student's notebook (course/own.py): its export cells in
    order, each {"cell": id in the student notebook, "stub": the cell as generated} (the student's code)
    or {"source": code} (a given cell, shipped as it is: machinery, never an answer)."""
    from course.build import student_notebook, student_view_cells
    from course.source import BEGIN, END, default_module, directives, strip_directives

    default = default_module(nb)
    in_stub = dict(zip(student_view_cells(nb), student_notebook(lesson, nb).cells))  # source cell -> student cell
    parts = []
    for i, cell in enumerate(nb.cells):
        d = directives(cell)
        if "export" not in d or (d["export"] or default) != module:
            continue
        code = "\n".join(ln for ln in strip_directives(cell.source).splitlines() if ln.strip() not in (BEGIN, END))
        if "given" in d:
            parts.append({"source": code})
        else:
            parts.append({"cell": in_stub[i]["id"], "stub": in_stub[i].source})
    return parts


def imported_own_modules(nb) -> set[str]:
    """The lesson's modules, partly given, whose given names its student notebook imports (course.build's
    given_import: a module's given cells that define public names become `from minitorch.X import ...`)."""
    from course.build import given_names
    from course.source import default_module, directives

    default = default_module(nb)
    kinds: dict[str, set[bool]] = {}
    public: set[str] = set()
    for cell in nb.cells:
        d = directives(cell)
        if "export" in d:
            m = d["export"] or default
            kinds.setdefault(m, set()).add("given" in d)
            if "given" in d and given_names(cell.source):
                public.add(m)
    return {m for m in public if kinds[m] == {True, False}}


def own_module_text(lesson, module: str) -> str:
    return OWN_HEADER.format(module=module, number=lesson.number) + f"""

Until your instructor releases its reference, minitorch.{module} is your own code: the cells of your
notebook lessons/{lesson.stem}.ipynb that make it up, run in order (course/own.py), so that the later
lessons of this release build on your lesson {lesson.number}.
\"\"\"
from course.own import load as _load

_load(globals(), "{lesson.stem}", "{module}")
"""


def _is_hidden_mark(node: ast.AST) -> bool:
    """`pytest.mark.hidden`, `mark.hidden`, or a call of either."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "hidden" and (
        (isinstance(node.value, ast.Attribute) and node.value.attr == "mark")
        or (isinstance(node.value, ast.Name) and node.value.id == "mark"))


def hidden_tests(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of each top-level test function or class marked hidden (its
    decorators and the comment lines right above them included)."""
    return list(_hidden_tests(source))


@functools.lru_cache(maxsize=64)
def _hidden_tests(source: str) -> tuple[tuple[str, int, int], ...]:
    tree = ast.parse(source)
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if any(_is_hidden_mark(v) for v in values):
                raise SystemExit("a whole test file marked hidden (pytestmark): mark its tests one by one")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                any(_is_hidden_mark(d) for d in node.decorator_list):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            while start > 1 and lines[start - 2].lstrip().startswith("#"):
                start -= 1
            out.append((node.name, start, node.end_lineno))
    return tuple(out)


def strip_hidden(source: str) -> tuple[str, list[str]]:
    """The test file without its hidden tests, and their names."""
    spans = hidden_tests(source)
    if not spans:
        return source, []
    lines = source.splitlines(keepends=True)
    drop = {i for _, a, b in spans for i in range(a - 1, b)}
    text = "".join(ln for i, ln in enumerate(lines) if i not in drop)
    return re.sub(r"\n{4,}", "\n\n\n", text), [name for name, _, _ in spans]


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
        if p.is_file() and ".git" not in p.relative_to(root).parts and p.suffix not in (".gz", ".npz", ".zip"):
            yield p


def _lesson_rows(released) -> str:
    from course.source import read_source

    rows = []
    for le in released:
        title = next((c.source.splitlines()[0].lstrip("# ").strip() for c in read_source(le).cells
                      if c.cell_type == "markdown" and c.source.strip()), le.stem)
        rows.append(f"| {le.number} | [lessons/{le.notebook.name}](lessons/{le.notebook.name}) | {title} |")
    return "\n".join(rows)


def readme(released, last, modules: dict[str, str], first=None) -> str:
    first = first or last
    before = [le for le in released if int(le.number) < int(first.number)]
    before = (f"lessons {before[0].number}-{before[-1].number}" if len(before) > 1 else
              f"lesson {before[0].number}" if before else "no lesson")
    withheld = f"lesson {last.number}'s" if first == last else f"lessons {first.number}-{last.number}'s"
    given = sorted(m for m, why in modules.items() if why == "given")
    own = sorted(m for m, why in modules.items() if why == "own")
    own_text = "" if not own else f"""
  Until their references are released, {', '.join(f'`minitorch/{m}.py`' for m in own)} {'is' if len(own) == 1 else 'are'}
  your own code, loaded from your notebooks of this release (lesson {first.number} onwards): a later
  lesson builds on what you wrote in an earlier one."""
    return f"""# minitorch systems: the class release (lessons {released[0].number}-{last.number})

A hands-on course on deep-learning systems: you build `minitorch`, a small NumPy deep-learning
framework, then make it fast, lean and big. Every exercise is graded automatically, on a laptop.

## Start

```
make lab     # first run: creates .venv with pinned versions (~3 min), then opens JupyterLab
make test    # grades your saved notebooks and prints a scoreboard
```

Python 3.11-3.13 and `make` are all you need (`make setup PYTHON=python3.12` picks the Python).
`make setup GPU=0` leaves out the GPU packages (CuPy and NVRTC, several hundred MB; of use on Linux
only): every lesson still runs, and the checks of CUDA C kernels compiled to PTX (lessons 08-10, 14)
skip, saying why (the CPU emulator still grades those kernels).
`make test L=02` grades one lesson. In a notebook, each exercise's check cell runs its tests on the
code in your kernel; Run All on an untouched notebook says "not attempted" for every exercise.

New lessons arrive as new commits of this repository: `git pull` (or "Sync fork" on GitHub). They
never change a notebook you already have.

## What is in this release

| # | notebook | lesson |
|---|---|---|
{_lesson_rows(released)}

- `lessons/`: your notebooks. Each exercise is a function whose body raises `NotImplementedError`.
- `tests/`: the tests that grade them (`make test`, and the check cells).
- `minitorch/`: the course's reference package: the reference code of {before} (a lesson is
  graded with your code for that lesson and the reference for the earlier ones){
  f", and the given machinery ({', '.join(f'`minitorch/{m}.py`' for m in given)}) the notebooks import" if given else ""}.
  {withheld[0].upper() + withheld[1:]} answers are not in it: your instructor releases each lesson's
  reference after its deadline.{own_text}
- `course/`: the grader. `hardware_notes/`, `data/`: what the lessons link and read.

`make verify` checks what this release contains (no solution in any file; only the modules listed
above in `minitorch/`).
"""


# The class's Makefile: the student targets of the course's own Makefile (the lines between its
# `# >>> student Makefile` and `# <<< student Makefile` markers, their `## who: what` help entries
# dropped: the class's Makefile has no `make help`), with `make verify` added.
MAKEFILE_HEAD = """# A student release of the minitorch systems course (written by `make release`).
.PHONY: setup lab test verify clean
"""
MAKEFILE_VERIFY = """verify: $(STAMP)
\t$(PY) -m course.release --verify .
"""


def student_makefile_blocks(text: str) -> list[str]:
    """The blocks of the course's Makefile `text` marked for the student's Makefile, in order."""
    blocks, current = [], None
    for line in text.splitlines(keepends=True):
        if line.startswith("# >>> student Makefile"):
            if current is not None:
                raise ValueError("Makefile: `# >>> student Makefile` inside another such block")
            current = []
        elif line.startswith("# <<< student Makefile"):
            if current is None:
                raise ValueError("Makefile: `# <<< student Makefile` without its `# >>>`")
            blocks.append("".join(current))
            current = None
        elif current is not None:
            if re.match(r"[a-zA-Z$][^\t=]*:(?!=)", line):  # a rule: its help entry goes
                line = re.sub(r" +## [a-z]+: .*", "", line)
            current.append(line)
    if current is not None or not blocks:
        raise ValueError("Makefile: no complete `# >>> student Makefile` ... `# <<< student Makefile` block")
    return blocks


def makefile(course_makefile: Path | None = None) -> str:
    """A class release's Makefile, made from the course's Makefile (this checkout's): its student
    targets (setup, lab, test, clean and what they use), then `make verify` before the last block."""
    blocks = student_makefile_blocks((course_makefile or REPO / "Makefile").read_text())
    parts = [MAKEFILE_HEAD, *blocks[:-1], MAKEFILE_VERIFY, blocks[-1]]
    return "\n".join(part.strip("\n") + "\n" for part in parts)


def step_id(lesson) -> str:
    """The workflow step of a lesson: letters and digits only, as the reporter's check of its `runners`
    input wants them (classroom-resources/autograding-grading-reporter: /^([a-zA-Z0-9]+,)*[a-zA-Z0-9]+$/)."""
    return f"lesson{lesson.number}"


def results_env(step: str) -> str:
    """The environment variable the reporter reads a step's result from: the step id upper-cased, '-'
    kept, then _RESULTS (its src/main.js: process.env[`${runner.trim().toUpperCase()}_RESULTS`])."""
    return f"{step.strip().upper()}_RESULTS"


def workflow(released) -> str:
    """GitHub Classroom's autograding, wired for classroom-resources/autograding-grading-reporter@v1:
    one step per lesson (id `lessonNN`), each running the instructor's grader (checked out from the
    repository MINITORCH_GRADER_REPO with the secret MINITORCH_GRADER_TOKEN, never this repository's
    tests) on this repository's notebook and writing, as the step's output `result`, the base64 JSON the
    reporter reads: one test per exercise with its points (partial credit as course/points.toml says),
    the lesson's points as max_score."""
    steps, ids = [], []
    for le in released:
        ident = step_id(le)
        ids.append(ident)
        steps.append(f"""      - name: lesson {le.number}
        id: {ident}
        working-directory: grader
        run: sudo -E "$(command -v python)" -m course.classroom {le.number} --submission ../submission""")
    results = "\n".join(f"          {results_env(i)}: \"${{{{steps.{i}.outputs.result}}}}\"" for i in ids)
    return f"""# GitHub Classroom autograding (written by `make release`). The tests (hidden ones included), the
# points and the grader come from the instructor's grading repository (`make release GRADER=dir`), named
# by the organization's variable {GRADER_VAR} and read with its secret {GRADER_SECRET}; never
# from this repository, which the student edits. One step per lesson: one test per exercise, with its
# points. The student's code runs as an unprivileged user in namespaces (course/isolation.py).
name: Autograding Tests
on: [push, repository_dispatch, workflow_dispatch]
permissions:
  checks: write
  actions: read
  contents: read
jobs:
  run-autograding-tests:
    runs-on: ubuntu-24.04
    if: github.actor != 'github-classroom[bot]'
    timeout-minutes: 60
    steps:
      - name: the submission
        uses: actions/checkout@v4
        with:
          path: submission
      - name: the grading repository is set
        env:
          GRADER_REPO: ${{{{ vars.{GRADER_VAR} }}}}
        run: |
          test -n "$GRADER_REPO" || {{ echo "::error::set the organization variable {GRADER_VAR} (owner/name of the grading repository) and the secret {GRADER_SECRET}"; exit 1; }}
      - name: the instructor's grader
        uses: actions/checkout@v4
        with:
          repository: ${{{{ vars.{GRADER_VAR} }}}}
          token: ${{{{ secrets.{GRADER_SECRET} }}}}
          path: grader
      - uses: actions/setup-python@v5
        with:
          python-version: "3.12"
      - name: set up (CPU only, the grader's pins)
        run: python -m pip install -q -c grader/constraints.txt -r grader/{REQUIREMENTS}
{chr(10).join(steps)}
      - name: Autograding Reporter
        if: always()
        uses: classroom-resources/autograding-grading-reporter@v1
        env:
{results}
        with:
          runners: {','.join(ids)}
"""


def requirements() -> str:
    """What grading needs, CPU only: the course's dependencies (pyproject.toml) without the `gpu` extra."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return "# Written by `make release`/`make gradescope`: the course's dependencies, CPU only (no `gpu` extra).\n" + \
        "\n".join(deps) + "\n"


_PARTS: dict = {}  # (what, lesson, hash of its source and tests) -> a derived text: see _lesson_part


def _lesson_part(what: str, le, compute):
    """compute() -> one of a lesson's derived parts (its student notebook's text, its tests without the
    hidden ones, its index entry), made once per content of its source and test files: a release of
    every lesson in turn (matrix) builds each lesson's parts once, not once per release."""
    import hashlib

    digest = hashlib.sha256(le.source.read_bytes() + b"\0" + le.tests.read_bytes()).hexdigest()
    key = (what, le.stem, digest)
    if key not in _PARTS:
        _PARTS[key] = compute()
    return _PARTS[key]


def _write_release(dest: Path, released, first, last, hidden: bool = False) -> dict:
    """Write the release's files into the empty folder `dest`; returns its index (course/lessons.json).
    hidden: keep the hidden tests (a grading tree), else strip them."""
    from course.build import exported_modules, notebook_text, student_notebook
    from course.source import all_lessons, read_source

    root = _source_root()

    def write(rel: str, text: str) -> None:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    index = {"upto": last.number, "from": first.number, "lessons": {}, "modules": {}}
    modules: dict[str, str] = {}
    (dest / "tests").mkdir(parents=True, exist_ok=True)
    for le in released:
        nb = read_source(le)
        write(f"lessons/{le.notebook.name}", _lesson_part("notebook", le, lambda: notebook_text(student_notebook(le, nb))))
        tests = le.tests.read_text()
        write(f"tests/{le.tests.name}", tests if hidden else _lesson_part("tests", le, lambda: strip_hidden(tests)[0]))
        index["lessons"][le.stem] = json.loads(_lesson_part("index", le, lambda: json.dumps(index_entry(le, nb))))
        if int(le.number) < int(first.number):
            chosen = {m: (text, "reference") for m, text in exported_modules(le, nb).items()}
        else:
            chosen = {m: (text, "given") for m, text in given_modules(le, nb).items()}
            # the student's own, from their notebook: a module a later lesson of the window may import, or one
            # whose given part the lesson's own notebook imports (lesson 14's compiler: its given machinery
            # calls the student's exercises)
            needed = set(exported_modules(le, nb)) if le != last else imported_own_modules(nb)
            for m in exported_modules(le, nb):
                if m not in chosen and m in needed:
                    chosen[m] = (own_module_text(le, m), "own")
                    index.setdefault("own", {})[m] = {"lesson": le.stem, "parts": own_parts(le, nb, m)}
        for name, (text, kind) in chosen.items():
            write(f"minitorch/{name.replace('.', '/')}.py", text)
            modules[name] = kind
            index["modules"][name] = {"lesson": le.stem, "kind": kind}
    for le in all_lessons():  # what a demo cell may import and this release withholds (course.notebook)
        for name in exported_modules(le, read_source(le)):
            if modules.get(name) in (None, "own"):
                index.setdefault("withheld", {})[name] = le.stem
    doc = ['"""minitorch: the course\'s reference package, as released to the class.\n',
           f"Reference modules of the lessons before {first.number}; given machinery (and the student's own "
           f"modules) of lessons {first.number}-{last.number}:\n"]
    doc += [f"    minitorch.{m:<14} {v['kind']:<9} lesson {v['lesson']}\n" for m, v in index["modules"].items()]
    write("minitorch/__init__.py", "".join(doc) + '"""\n')
    write("course/lessons.json", json.dumps(index, indent=1) + "\n")
    released_tests = "\n".join(le.tests.read_text() for le in released)
    for helper in sorted((root / "tests").glob("*.py")):  # conftest, and the shared helpers the tests use
        if helper.name == "conftest.py" or (not helper.name.startswith("test_") and helper.stem in released_tests):
            shutil.copyfile(helper, dest / "tests" / helper.name)
    ignore = shutil.ignore_patterns("__pycache__", "_tree", "*.pyc", "lessons.json")
    shutil.copytree(REPO / "course", dest / "course", ignore=ignore, dirs_exist_ok=True)
    for folder in ("data", "hardware_notes"):
        if (root / folder).is_dir():
            shutil.copytree(root / folder, dest / folder, ignore=ignore, dirs_exist_ok=True)
    for name in ("pyproject.toml", "constraints.txt", "setup.py", ".gitignore"):  # the course's own, else this checkout's
        shutil.copyfile(root / name if (root / name).exists() else REPO / name, dest / name)
    write("MANIFEST.in", "include setup.py pyproject.toml constraints.txt\ninclude tests/*.py data/*\n")
    write("Makefile", makefile())
    write("README.md", readme(released, last, modules, first))
    write(WORKFLOW, workflow(released))
    return index


def _git(dest: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    git = ["git", "-c", "user.name=minitorch release", "-c", "user.email=release@localhost",
           "-c", "commit.gpgsign=false", "-C", str(dest)]
    return subprocess.run(git + list(args), check=check, capture_output=True, text=True)


def _is_release(dest: Path) -> bool:
    return (dest / "course" / "lessons.json").exists() and (dest / ".git").exists()


def build_release(dest: Path, upto: str | None = None, commit: bool = True, frm: str | None = None,
                  hidden: bool = False) -> Path:
    """Write the release of lessons ..UPTO (answers of FROM..UPTO withheld) into `dest`: a new or empty
    folder (git init and one commit, unless commit=False), or a git clone holding an earlier release
    (updated as one more commit: `update_release`). hidden=True keeps the hidden tests: the instructor's
    grading tree, never for students."""
    dest = Path(dest).resolve()
    released, first, last = window(upto, frm)
    if dest.exists() and any(dest.iterdir()):
        if commit and _is_release(dest):
            return update_release(dest, upto, frm)
        raise SystemExit(f"{dest} exists and is not empty (nor a git repository holding a release): a release "
                         "is written into a new folder, or added to a clone of an earlier release")
    dest.mkdir(parents=True, exist_ok=True)
    _write_release(dest, released, first, last, hidden)
    problems = check_release(dest, last, first, hidden=hidden)
    if problems:
        raise SystemExit("the release is not clean:\n  " + "\n  ".join(problems))
    if commit:
        subprocess.run(["git", "init", "-q", "-b", "main", str(dest)], check=True)
        _git(dest, "add", "-A")
        _git(dest, "commit", "-q", "-m", _message(released, first, last))
    return dest


def _message(released, first, last, added=(), due=()) -> str:
    withheld = f"lesson {last.number}'s answers" if first == last else f"lessons {first.number}-{last.number}'s answers"
    head = f"minitorch systems: lessons {released[0].number}-{last.number} ({withheld} withheld)"
    body = []
    if added:
        body.append("New: " + ", ".join(f"lesson {a}" for a in added) + ".")
    if due:
        body.append("Now with the reference of " + ", ".join(f"lesson {d}" for d in due) + ".")
    return head + ("\n\n" + " ".join(body) if body else "")


def update_release(dest: Path, upto: str | None, frm: str | None = None) -> Path:
    """Add lessons to an earlier release in `dest` (a clean git clone of it) as one commit: new lessons'
    notebooks and tests, the references now due, the grader and README as they are now. The lesson
    notebooks already in `dest` are left as they are: students have edited theirs, and a commit that
    does not touch them merges into their clones without a conflict."""
    dest = Path(dest).resolve()
    status = _git(dest, "status", "--porcelain").stdout
    if status.strip():
        raise SystemExit(f"{dest} has uncommitted changes: commit or discard them first\n{status}")
    old = json.loads((dest / "course" / "lessons.json").read_text())
    released, first, last = window(upto, frm)
    if int(last.number) < int(old["upto"]):
        raise SystemExit(f"{dest} already releases lessons up to {old['upto']}: UPTO={last.number} would go back")
    old_from = old.get("from", old["upto"])
    if int(first.number) < int(old_from):
        raise SystemExit(f"{dest} already holds the reference of the lessons before {old_from}: FROM={first.number} "
                         "cannot withhold them again")
    added = [le.number for le in released if le.stem not in old["lessons"]]
    due = [le.number for le in released if int(old_from) <= int(le.number) < int(first.number)]
    kept, notes = [], []
    with tempfile.TemporaryDirectory(prefix="mt-release-") as tmp:
        new = Path(tmp) / "release"
        new.mkdir()
        _write_release(new, released, first, last)
        fresh = {p.relative_to(new).as_posix() for p in new.rglob("*") if p.is_file()}
        for rel in sorted(fresh):
            if rel.startswith("lessons/") and (dest / rel).exists():
                kept.append(rel)
                if (dest / rel).read_text() != (new / rel).read_text():
                    notes.append(f"{rel}: kept as the class has it (the lesson's source has changed since: what "
                                 "students have stays theirs)")
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(new / rel, dest / rel)
        tracked = _git(dest, "ls-files").stdout.splitlines()
        for rel in tracked:
            managed = rel.split("/")[0] in MANAGED_DIRS or rel == WORKFLOW
            if managed and rel not in fresh and not rel.startswith("lessons/"):
                _git(dest, "rm", "-q", rel)
    problems = check_release(dest, last, first)
    if problems:
        _git(dest, "checkout", "-q", "--", ".", check=False)
        _git(dest, "clean", "-q", "-fd", check=False)
        raise SystemExit("the updated release is not clean (left as it was):\n  " + "\n  ".join(problems))
    _git(dest, "add", "-A")
    if not _git(dest, "status", "--porcelain").stdout.strip():
        print(f"{dest}: nothing new to release")
        return dest
    _git(dest, "commit", "-q", "-m", _message(released, first, last, added, due))
    for n in notes:
        print(n)
    return dest


def grading_tree(dest: Path, upto: str, frm: str | None = None, points: str | Path | None = None,
                 partial: str | None = None) -> Path:
    """The instructor's grading tree for lessons ..UPTO (answers of FROM..UPTO absent): the release with
    every test (hidden ones included), the points (course/points.toml, an instructor's file merged in) and
    what grading needs to install. Class grading runs a lesson's tests there; so do the Gradescope bundle
    and the GitHub Classroom grader."""
    from course.points import Points

    dest = Path(dest).resolve()
    build_release(dest, upto, commit=False, frm=frm, hidden=True)
    (dest / REQUIREMENTS).write_text(requirements())
    if points or partial:
        (dest / "course" / "points.toml").write_text(points_toml(Points.load(points, partial)))
    return dest


def points_toml(points) -> str:
    lines = ["# Points per exercise: course/points.toml with the instructor's values merged in (written by the grader).",
             f"default = {points.default:g}", f'partial = "{points.partial}"', ""]
    if points.partial_of:
        lines += ["[partial_of]", *(f'"{k}" = "{v}"' for k, v in points.partial_of.items()), ""]
    for stem, table in points.table.items():
        lines += [f"[points.{stem}]", *(f'"{k}" = {v:g}' for k, v in table.items()), ""]
    return "\n".join(lines)


GRADER_README = """# minitorch systems: the grading repository (PRIVATE)

Written by `make release ... GRADER=dir` for the class release of lessons {first}-{last}. It holds every
test, hidden ones included, and the points: keep it private. The class repository's GitHub Classroom
workflow (`.github/workflows/classroom.yml`) checks it out and grades each student's notebooks with it,
never with the tests in the student's repository.

Set up once, in the GitHub organization of the classroom (Settings > Secrets and variables > Actions):
- variable `{var}`: this repository, `owner/name`;
- secret `{secret}`: a fine-grained token that can read this repository's contents (only this one).

Each week `make release DEST=class-repo UPTO=NN GRADER=this-folder` updates both, one commit each; push
both. By hand, here: `python -m course.classroom NN --submission path/to/a/student/clone`.
"""


def build_grader(dest: Path, upto: str | None, frm: str | None = None, points=None, partial=None) -> Path:
    """The grading repository for the Classroom workflow: a grading tree, its README, one commit (an
    existing one: its files replaced, one more commit)."""
    dest = Path(dest).resolve()
    released, first, last = window(upto, frm)
    with tempfile.TemporaryDirectory(prefix="mt-grader-") as tmp:
        tree = grading_tree(Path(tmp) / "tree", last.number, first.number, points, partial)
        (tree / "README.md").write_text(GRADER_README.format(first=released[0].number, last=last.number,
                                                             var=GRADER_VAR, secret=GRADER_SECRET))
        (tree / WORKFLOW).unlink()
        (tree / "Makefile").unlink()
        if dest.exists() and any(dest.iterdir()):
            if not (dest / ".git").exists() or not (dest / "course" / "lessons.json").exists():
                raise SystemExit(f"{dest} exists and is not a grading repository")
            for rel in _git(dest, "ls-files").stdout.splitlines():
                _git(dest, "rm", "-q", rel)
        else:
            dest.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "init", "-q", "-b", "main", str(dest)], check=True)
        shutil.copytree(tree, dest, dirs_exist_ok=True)
    _git(dest, "add", "-A")
    if _git(dest, "status", "--porcelain").stdout.strip():
        _git(dest, "commit", "-q", "-m", f"grader: lessons {released[0].number}-{last.number}")
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


def check_release(dest: Path, last, first=None, hidden: bool = False) -> list[str]:
    """verify(), plus what only the sources can tell: no body of a solution region of lesson FROM or
    later in any file, none of their own modules present (but the student's own, course/own.py, for the
    window's earlier lessons), every imported minitorch module there, no hidden test (unless `hidden`:
    a grading tree)."""
    from course.build import exported_modules
    from course.source import all_lessons, read_source

    first = first or last
    problems = verify(dest)
    files = {p: normalised(p) for p in _text_files(dest) if p.name != "lessons.json"}
    withheld = [le for le in all_lessons() if int(le.number) >= int(first.number)]
    shared = "\n".join(files[p] for p in files if p.is_relative_to(dest / "tests")) + "\n".join(
        normalised_text(text) for le in all_lessons() if int(le.number) < int(first.number)
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
        shipped = given_modules(le, nb) if int(le.number) <= int(last.number) else {}
        for name in exported_modules(le, nb):
            path = dest / "minitorch" / f"{name.replace('.', '/')}.py"
            if name in shipped or not path.exists():
                continue
            if path.read_text() == own_module_text(le, name):
                continue  # the student's own (course/own.py)
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
        names = minitorch_references(p.read_text()) if p.suffix == ".py" else \
            set(re.findall(r"(?:from|import)\s+minitorch\.(\w+)", text))
        for name in sorted(names - own.get(p.name, set())):
            if not (dest / "minitorch" / f"{name}.py").exists():
                problems.append(f"{p.relative_to(dest)}: imports minitorch.{name}, which the release lacks")
    if not hidden:
        for p in sorted((dest / "tests").glob("test_*.py")):
            names = [n for n, _, _ in hidden_tests(p.read_text())]
            if names:
                problems.append(f"{p.relative_to(dest)}: holds hidden tests ({', '.join(names)})")
    return problems


def minitorch_references(source: str) -> frozenset[str]:
    """Every minitorch module a Python file can reach by name (see _minitorch_references)."""
    return _minitorch_references(source)


@functools.lru_cache(maxsize=512)
def _minitorch_references(source: str) -> frozenset[str]:
    """Every minitorch module a Python file can reach by name: `import minitorch.x`, `from minitorch.x
    import ...`, `from minitorch import x`, and any string that names one (`importlib.import_module(
    "minitorch.x")`, `__import__`, a monkeypatch target "minitorch.x.f"), docstrings aside."""
    import ast

    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("minitorch.")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("minitorch."):
                names.add(node.module.split(".")[1])
            elif node.module == "minitorch":
                names |= {a.name for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names |= set(re.findall(r"\bminitorch\.(\w+)", node.value))
    return frozenset(names)


def _in_release(root: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MT_ROOT", "MT_WALK")}
    env["PYTHONPATH"] = str(root)
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def matrix(keys: list[str], out: Path, grade: bool = True) -> list[str]:
    """For each lesson NN: the release up to NN (checked, no commit) in out/NN; inside it, the released
    tests must load (pytest --collect-only), and with grade, the untouched stub notebook must grade as
    "not attempted" for every exercise and the lesson's solution notebook, saved in its place, must pass
    every exercise (or skip it for want of a GPU). Returns the problems, each naming its lesson."""
    from course.build import notebook_text, solution_notebook
    from course.source import find_lesson
    from course.timing import time_scale

    problems = []
    for key in keys:
        le = find_lesson(key)
        dest = out / le.number
        if dest.exists():
            shutil.rmtree(dest)
        try:
            build_release(dest, le.number, commit=False)
        except SystemExit as exc:
            problems.append(f"release up to {le.number}: {exc}")
            continue
        limit = 900 * time_scale()
        r = _in_release(dest, ["-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                               f"tests/{le.tests.name}"], limit)
        if r.returncode != 0:
            problems.append(f"release up to {le.number}: its tests do not load:\n{(r.stdout + r.stderr)[-1500:]}")
            continue
        if not grade:
            continue
        r = _in_release(dest, ["-m", "course.grade", le.number], limit)
        rows = [ln for ln in r.stdout.splitlines() if ln.startswith("  [")]
        if not rows or any("not attempted" not in ln for ln in rows):
            problems.append(f"release up to {le.number}: the untouched notebook should be 'not attempted' "
                            f"everywhere:\n{r.stdout[-1500:]}{r.stderr[-500:]}")
        stub = dest / "lessons" / le.notebook.name
        saved = stub.read_text()
        stub.write_text(notebook_text(solution_notebook(le)))
        try:
            r = _in_release(dest, ["-m", "course.grade", le.number], limit)
        finally:
            stub.write_text(saved)
        rows = [ln for ln in r.stdout.splitlines() if ln.startswith("  [")]
        if r.returncode != 0 or not rows or any("[PASS]" not in ln and "[skip]" not in ln for ln in rows):
            problems.append(f"release up to {le.number}: the solution notebook does not pass there:\n"
                            f"{r.stdout[-2500:]}{r.stderr[-500:]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", nargs="?", help="the folder to write (new or empty, or a clone of an earlier release); "
                                            "with --verify, the release")
    ap.add_argument("--upto", default=None, help="the last lesson released, whose answers are withheld (default: the first)")
    ap.add_argument("--from", dest="frm", default=None,
                    help="the first lesson whose answers are withheld (default: UPTO): several at once for a "
                         "multi-lesson assignment")
    ap.add_argument("--grader", default=None, help="also write the instructor's (private) grading repository here, "
                                                   "for the GitHub Classroom workflow")
    ap.add_argument("--points", default=None, help="an instructor's points file merged over course/points.toml (grader)")
    ap.add_argument("--verify", action="store_true", help="check a release's contents")
    ap.add_argument("--matrix", nargs="*", metavar="NN",
                    help="release up to each lesson named (default: every lesson) into DEST (default "
                         "build/releases) and grade the stub and the solution notebook inside each")
    args = ap.parse_args(argv)
    if args.matrix is not None:
        from course.source import all_lessons

        keys = args.matrix or [le.number for le in all_lessons()]
        out = Path(args.dest or REPO / "build" / "releases")
        problems = []
        for key in keys:  # one lesson at a time, so that the log shows progress
            found = matrix([key], out)
            print(f"release up to {key}: {'ok' if not found else 'FAILED'}", flush=True)
            problems += found
        print("\n".join(problems) if problems else f"every release ({len(keys)}) grades its lesson's solution and stubs")
        return 1 if problems else 0
    if args.verify:
        problems = verify(Path(args.dest or "."))
        print("\n".join(problems) if problems else "release contents: clean (no solutions; minitorch/ as listed)")
        return 1 if problems else 0
    if not args.dest:
        ap.error("usage: make release DEST=dir [FROM=NN] [UPTO=NN] [GRADER=dir]")
    dest = Path(args.dest).resolve()
    updating = dest.exists() and any(dest.iterdir()) and _is_release(dest)
    head = _git(dest, "rev-parse", "HEAD").stdout.strip() if updating else ""
    build_release(dest, args.upto, frm=args.frm)
    released, first, last = window(args.upto, args.frm)
    withheld = f"lesson {last.number}'s answers" if first == last else f"lessons {first.number}-{last.number}'s answers"
    if updating and _git(dest, "rev-parse", "HEAD").stdout.strip() == head:
        pass  # update_release said why: nothing new
    elif updating:
        print(f"updated {dest}: lessons {released[0].number}-{last.number} ({withheld} withheld), checked, one more "
              f"commit: {_git(dest, 'log', '-1', '--format=%s').stdout.strip()}")
    else:
        print(f"wrote {dest}: lessons {released[0].number}-{last.number} ({withheld} withheld), checked, one commit")
    if args.grader:
        grader = build_grader(Path(args.grader), args.upto, args.frm, args.points)
        print(f"wrote {grader}: the grading repository (every test, hidden ones included; keep it private), "
              f"for the variable {GRADER_VAR} of the Classroom workflow")
    return 0


if __name__ == "__main__":
    sys.exit(main())
