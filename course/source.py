"""Read a lesson's source (`solutions/NN_topic.py`) and the notebooks made from it.

A lesson source is a jupytext "percent" script. Code cells carry nbdev-style directives
(`#| default_exp NAME`, `#| export [NAME]`, `#| exercise L.K`) and cell tags (`demo`, `gpu`,
`check`). This module turns the script into cells and answers questions about them; it
writes nothing.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


def _root() -> Path:
    """The folder holding solutions/ and tests/: MT_ROOT if set (the machinery's own tests run it on
    a sample course in a temporary folder); else the checkout around this package; else, for a
    course installed from a wheel (`pip install`, e.g. on Colab), the copy in course/_tree/."""
    if os.environ.get("MT_ROOT"):
        return Path(os.environ["MT_ROOT"])
    here = Path(__file__).resolve().parent
    if (here.parent / "solutions").is_dir() and (here.parent / "tests" / "conftest.py").exists():
        return here.parent
    if (here / "_tree" / "solutions").is_dir():
        return here / "_tree"
    return here.parent


ROOT = _root()
SOLUTIONS = ROOT / "solutions"
LESSONS = ROOT / "lessons"
TESTS = ROOT / "tests"
PACKAGE = ROOT / "minitorch"
# A student release (`make release`, course/release.py) has no solutions/: this index, written by
# the release from the sources, says what its lessons, their exercises and their given code are.
INDEX = ROOT / "course" / "lessons.json"

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
_DIRECTIVE = re.compile(r"^\s*#\|\s*(\w+)\s*(.*?)\s*$")
_LESSON_FILE = re.compile(r"^(\d\d)_(\w+)\.py$")

# The cell metadata of the student notebook that says which exercise a cell belongs to (the
# notebook has no directives): {"minitorch": {"exercise": "1.2"}}.
EXERCISE_METADATA = "minitorch"

# Tags whose cells are not run when a lesson is loaded for grading.
NOT_LOADED = {"demo", "gpu", "check"}


@dataclass(frozen=True)
class Lesson:
    """One lesson: its number ('01'), stem ('01_tensors') and files."""

    number: str
    stem: str

    @property
    def source(self) -> Path:
        return SOLUTIONS / f"{self.stem}.py"

    @property
    def notebook(self) -> Path:
        return LESSONS / f"{self.stem}.ipynb"

    @property
    def tests(self) -> Path:
        return TESTS / f"test_{self.stem}.py"

    @property
    def exercise_prefix(self) -> str:
        return f"{int(self.number)}."


@lru_cache(maxsize=1)
def release_index() -> dict | None:
    """The lessons index of a student release, or None in a checkout with solutions/."""
    if SOLUTIONS.is_dir() or not INDEX.exists():
        return None
    return json.loads(INDEX.read_text())


def all_lessons() -> list[Lesson]:
    """Every lesson with a source in solutions/ (in a student release: in its index), in order."""
    index = release_index()
    if index is not None:
        return [Lesson(stem[:2], stem) for stem in index["lessons"]]
    found = []
    for path in sorted(SOLUTIONS.glob("*.py")):
        m = _LESSON_FILE.match(path.name)
        if m:
            found.append(Lesson(m.group(1), path.stem))
    return found


def find_lesson(key: str | int) -> Lesson:
    """The lesson named by a number ('5', '05'), an exercise id ('5.2') or a stem."""
    key = str(key)
    if re.fullmatch(r"\d+\.\d+", key):
        key = key.split(".")[0]
    lessons = all_lessons()
    for lesson in lessons:
        if key in (lesson.stem, lesson.number) or (key.isdigit() and int(key) == int(lesson.number)):
            return lesson
    names = ", ".join(le.number for le in lessons)
    raise LookupError(f"no lesson {key!r}; lessons are {names}")


def read_source(lesson: Lesson):
    """The lesson source as a notebook (solutions included, no outputs)."""
    # course.percent reads the percent format exactly as jupytext does (tests/machinery checks it
    # on every lesson) without importing jupytext and nbformat, whose import (jsonschema's format
    # checkers) costs seconds in every grading process.
    from course.percent import read

    return read(lesson.source)


def directives(cell) -> dict[str, str]:
    """`#| name value` lines of a code cell, as {name: value}."""
    found = {}
    if cell.cell_type != "code":
        return found
    for line in cell.source.splitlines():
        m = _DIRECTIVE.match(line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def strip_directives(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not _DIRECTIVE.match(line)).strip("\n")


def tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def default_module(nb) -> str:
    for cell in nb.cells:
        d = directives(cell)
        if "default_exp" in d:
            return d["default_exp"]
    raise ValueError("lesson has no '#| default_exp NAME' cell")


def exercises(nb) -> dict[str, str]:
    """{exercise id: title} in order of appearance. The title is the function that holds
    the first solution region of the exercise's cell."""
    found: dict[str, str] = {}
    for cell in nb.cells:
        ex = directives(cell).get("exercise")
        if ex:
            found[ex] = enclosing_names(cell.source)[0] if BEGIN in cell.source else ex
    return found


def exercise_titles(lesson: Lesson) -> dict[str, str]:
    """{exercise id: title} of a lesson, from its source or, in a student release, its index."""
    index = release_index()
    if index is not None:
        return dict(index["lessons"][lesson.stem]["exercises"])
    return exercises(read_source(lesson))


def cell_exercise(cell) -> str | None:
    """The exercise a cell belongs to: in the student notebook (and a student's copy of it) its
    metadata says (`minitorch.exercise`, written by `make build`), in the source and the solution
    notebook its `#| exercise L.K` directive."""
    meta = cell.get("metadata", {}).get(EXERCISE_METADATA)
    return (meta.get("exercise") if isinstance(meta, dict) else None) or directives(cell).get("exercise")


def enclosing_names(source: str) -> list[str]:
    """For each solution region in `source`, the name of the function it sits in."""
    names, stack = [], []  # stack of (indent, name)
    for line in source.splitlines():
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        m = re.match(r"(?:async\s+)?def\s+(\w+)|class\s+(\w+)", stripped)
        if m:
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m.group(1) or m.group(2)))
        elif stripped.startswith(BEGIN):
            while stack and stack[-1][0] >= indent:
                stack.pop()
            names.append(".".join(n for _, n in stack) or "<module>")
    return names


def loadable_code(nb) -> list[tuple[int, str]]:
    """(cell index, source) of the code cells run when a lesson is loaded for grading."""
    return [
        (i, cell.source)
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and not (tags(cell) & NOT_LOADED)
    ]
