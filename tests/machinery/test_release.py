"""`make release`: a student release of lessons 01-02 (lesson 02's answers withheld), cloned fresh,
grades with its own machinery and passes its own check of what it contains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course import release
from course.build import notebook_text, solution_notebook
from course.source import ROOT, find_lesson, read_source

pytestmark = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="needs the course's sources")


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    base = tmp_path_factory.mktemp("release")
    env = {k: v for k, v in os.environ.items() if k != "MT_ROOT"}
    subprocess.run([sys.executable, "-m", "course.release", str(base / "rel"), "--upto", "02"],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    subprocess.run(["git", "clone", "-q", str(base / "rel"), str(base / "clone")], check=True)
    return base / "clone"


def in_release(root: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MT_ROOT"}
    env["PYTHONPATH"] = str(root)
    return subprocess.run([sys.executable, *args], cwd=cwd or root, env=env, capture_output=True, text=True, timeout=600)


def test_release_holds_no_solutions_and_only_earlier_references(clone):
    assert not (clone / "solutions").exists() and not (clone / "benchmarks").exists()
    assert sorted(p.name for p in (clone / "lessons").glob("*.ipynb")) == ["01_tensors.ipynb", "02_autograd.ipynb"]
    assert sorted(p.name for p in (clone / "tests").glob("test_*.py")) == ["test_01_tensors.py", "test_02_autograd.py"]
    assert sorted(p.name for p in (clone / "minitorch").glob("*.py")) == ["__init__.py", "tensor.py"]  # no autograd.py
    # every solution region of lesson 02 (and later), normalised, is in no file of the release
    bodies = [b for le in ("02", "03", "09") for b in release.solution_bodies(read_source(find_lesson(le)))]
    assert len(bodies) > 40
    shared = "\n".join(release.normalised(p) for p in (clone / "tests").glob("*.py"))
    assert len(release.distinctive(bodies, shared)) >= len(bodies) - 2  # nearly every region is checkable
    texts = [release.normalised(p) for p in release._text_files(clone)]
    assert not [b for b in bodies if any(b in t for t in texts)]
    # ... while lesson 01's are (its reference), so the scan does find bodies
    assert any(b in release.normalised(clone / "minitorch" / "tensor.py")
               for b in release.solution_bodies(read_source(find_lesson("01"))))
    assert release.check_release(clone, find_lesson("02")) == []
    problems = release.check_release(clone, find_lesson("01"))  # as if lesson 01 were withheld
    assert any("minitorch/tensor.py: lesson 01's module is present" in p for p in problems)
    assert any("holds a solution of lesson 01" in p for p in problems)
    assert (clone / ".github" / "workflows" / "classroom.yml").exists()
    readme = (clone / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme and "lessons/02_autograd.ipynb" in readme


def test_release_verifies_itself(clone):
    r = in_release(clone, "-m", "course.release", "--verify", ".")
    assert r.returncode == 0, r.stdout + r.stderr
    (clone / "minitorch" / "autograd.py").write_text("### BEGIN SOLUTION\n")
    try:
        r = in_release(clone, "-m", "course.release", "--verify", ".")
        assert r.returncode == 1
        assert "minitorch/autograd.py: holds a solution marker" in r.stdout
        assert "minitorch/autograd.py: not a module this release lists" in r.stdout
    finally:
        (clone / "minitorch" / "autograd.py").unlink()


def test_untouched_release_is_not_attempted_and_a_solved_lesson_passes(clone):
    r = in_release(clone, "-m", "course.grade", "02")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("  [")]
    assert lines and all("[todo]" in ln and "not attempted" in ln for ln in lines), r.stdout
    # lesson 01 answered (its solution notebook) passes with the release's tests and grader
    nb = clone / "lessons" / "01_tensors.ipynb"
    nb.write_text(notebook_text(solution_notebook(find_lesson("01"))))
    r = in_release(clone, "-m", "course.grade", "01")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("  [")]
    assert r.returncode == 0 and lines and all("[PASS]" in ln for ln in lines), r.stdout + r.stderr


def test_check_cell_works_in_the_release(clone):
    code = ("import minitorch.tensor as t\nfrom course.check import check\n"
            "check('1.1', names=vars(t))\n"
            "check('2.1', names={})\n"
            "from course.notebook import _withheld\n"
            "print(_withheld(ModuleNotFoundError('no', name='minitorch.bench')))\n")
    r = in_release(clone, "-c", code, cwd=clone / "lessons")
    assert "Exercise 1.1: all" in r.stdout and "tests passed" in r.stdout, r.stdout + r.stderr
    assert "Exercise 2.1" in r.stdout, r.stdout
    # a demo cell of lesson 01 imports lesson 04's module: one line, and Run All goes on
    assert "needs minitorch.bench (lesson 04's reference), which this release does not hold yet" in r.stdout
    index = json.loads((clone / "course" / "lessons.json").read_text())
    assert index["upto"] == "02" and index["modules"] == {"tensor": {"lesson": "01_tensors", "kind": "reference"}}
