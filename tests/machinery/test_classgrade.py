"""`make grade-class`: a class of synthetic students on the sample course (tests/machinery/sample),
each graded in isolation; the gradebook is checked exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent
pytestmark = pytest.mark.timeout(900)  # six students, two of them costing a time limit each


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MT_ROOT": str(root), "MT_CELL_TIME_LIMIT": "3"}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture
def course(tmp_path):  # as tests/machinery/test_machinery.py's
    root = tmp_path / "course"
    shutil.copytree(HERE / "sample", root)
    shutil.copy(HERE.parent / "conftest.py", root / "tests" / "conftest.py")
    (root / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text().replace("timeout = 60", "timeout = 8"))
    assert run(root, "-m", "course.build").returncode == 0
    return root


def notebook(cells: list[dict], replace: dict[str, str | None]) -> dict:
    """A notebook whose cells holding a key are given its value as source (None: the cell is deleted)."""
    out = []
    for cell in cells:
        src = "".join(cell["source"])
        key = next((k for k in replace if k in src), None)
        if key is None:
            out.append(cell)
        elif replace[key] is not None:
            out.append({**cell, "source": replace[key]})
    return out


def test_grade_class_of_synthetic_students(course, tmp_path):
    made = run(course, "-c", "from course.build import notebook_text, solution_notebook\n"
                             "from course.source import find_lesson\n"
                             "print(notebook_text(solution_notebook(find_lesson('01'))), end='')")
    solved = json.loads(made.stdout)
    stubs = json.loads((course / "lessons" / "01_sample.ipynb").read_text())
    area = "class Circle:\n    def __init__(self, r):\n        self.r = r\n    def area(self):\n        return 2 * 3.14159 * self.r\n"
    students = {
        "ada_correct": solved["cells"],
        "bob_stubs": stubs["cells"],
        "cyd_hangs": notebook(solved["cells"], {"def plus3": "def plus3(x):\n    return x + 3\nwhile True:\n    pass\n"}),
        "dan_crashes": notebook(solved["cells"], {"def plus4": "import os\nos._exit(1)\n"}),
        "eve_deleted": notebook(solved["cells"], {"class Circle": None, 'check("1.2")': None}),
        "fay_partial": notebook(stubs["cells"], {"def double": "def double(x):\n    return 2 * x\n",
                                                 "class Circle": area,
                                                 "def plus3": "def plus_three(x):\n    return x + 3\n"}),
    }
    subs = tmp_path / "submissions"
    for name, cells in students.items():
        (subs / name / "lessons").mkdir(parents=True)
        (subs / name / "lessons" / "01_sample.ipynb").write_text(json.dumps({**stubs, "cells": cells}))
    (subs / "gil_nothing").mkdir()  # handed in nothing
    out = tmp_path / "grades"
    r = run(course, "-m", "course.classgrade", str(subs), "--out", str(out), "--lessons", "01")
    assert r.returncode == 0, r.stdout + r.stderr
    ex = [f"1.{k}" for k in range(1, 13)]
    row = lambda name, cells, score: ",".join([name, *cells, str(score), "12"])  # noqa: E731
    expected = "\n".join([
        ",".join(["student", *ex, "score", "max"]),
        row("ada_correct", ["pass"] * 12, 12),
        row("bob_stubs", ["todo"] * 12, 0),
        row("cyd_hangs", ["pass"] * 2 + ["fail"] + ["pass"] * 9, 11),
        row("dan_crashes", ["pass"] * 3 + ["fail"] + ["pass"] * 8, 11),
        row("eve_deleted", ["pass", "fail"] + ["pass"] * 10, 11),
        row("fay_partial", ["pass", "fail", "fail"] + ["todo"] * 9, 1),
        row("gil_nothing", ["missing"] * 12, 0),
    ]) + "\n"
    assert (out / "gradebook.csv").read_text() == expected, r.stdout
    report = json.loads((out / "gradescope" / "cyd_hangs" / "results.json").read_text())
    assert report["score"] == 11 and len(report["tests"]) == 12
    t3 = next(t for t in report["tests"] if t["number"] == "1.3")
    assert t3["score"] == 0 and t3["max_score"] == 1 and "ran longer than" in t3["output"], t3
    assert set(report["tests"][0]) >= {"name", "score", "max_score", "output"}
    feedback = (out / "feedback" / "fay_partial.txt").read_text()
    assert "[PASS] 1.1" in feedback and "[FAIL] 1.2" in feedback and "defines no `plus3`" in feedback
    assert feedback.rstrip().endswith("Score: 1 of 12 exercises")
