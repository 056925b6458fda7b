"""`make release`: a student release of lessons 01-02 (lesson 02's answers withheld), cloned fresh,
grades with its own machinery and passes its own check of what it contains."""

from __future__ import annotations

import json
import os
import shutil
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
    assert sorted(p.name for p in (clone / "minitorch").glob("*.py")) == ["__init__.py", "checks.py", "tensor.py"]  # no autograd.py
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
    assert index["upto"] == "02" and index["modules"] == {"tensor": {"lesson": "01_tensors", "kind": "reference"},
                                                          "checks": {"lesson": "01_tensors", "kind": "reference"}}


@pytest.mark.timeout(600)  # measured: 25-60 s (nineteen releases built and their tests collected)
def test_a_release_up_to_every_lesson_is_clean_and_its_tests_load(tmp_path):
    """Every UPTO=NN builds, passes check_release (which sees a withheld module named by any import
    path, an importlib string included) and its tests load inside it. Grading every lesson's solution
    inside its release takes minutes per lesson: a maintainer's command before a term
    (`python -m course.release --matrix`); here lesson 01's, the one whose tests used its own module,
    and the stand-in rule."""
    from course.source import all_lessons

    keys = [le.number for le in all_lessons()]
    assert release.matrix(keys, tmp_path, grade=False) == []
    assert release.matrix(["01"], tmp_path, grade=True) == []


def test_the_scan_sees_every_way_a_test_can_name_a_module():
    src = '''"""Tests that mention minitorch.docstring only in their docstring."""
import importlib
import minitorch.a
from minitorch.b import f
from minitorch import c, d as dd
def t():
    """minitorch.notthis"""
    importlib.import_module("minitorch.e")
    __import__("minitorch.f.g")
'''
    assert release.minitorch_references(src) == {"a", "b", "c", "d", "e", "f"}


# --- issue 37: weekly releases, several lessons withheld at once, hidden tests, a CPU-only set-up ---

def test_hidden_tests_ship_to_no_student():
    src = '''import pytest


@pytest.mark.exercise("1.1")
def test_seen(lesson):
    assert lesson.f(1) == 2


# an edge case the students never see
@pytest.mark.hidden
@pytest.mark.exercise("1.1")
@pytest.mark.parametrize("x", [0, -1])
def test_unseen(lesson, x):
    assert lesson.f(x) == 2 * x


@pytest.mark.hidden()
class TestAlsoUnseen:
    def test_it(self, lesson):
        pass
'''
    text, names = release.strip_hidden(src)
    assert names == ["test_unseen", "TestAlsoUnseen"]
    assert "test_seen" in text and "unseen" not in text.lower() and "edge case" not in text
    compile(text, "stripped", "exec")
    with pytest.raises(SystemExit, match="one by one"):
        release.hidden_tests("import pytest\npytestmark = [pytest.mark.hidden]\n")


def test_several_lessons_withheld_at_once(tmp_path):
    """FROM=01 UPTO=03: no answer of 01-03 anywhere; lesson 02 builds on the student's own lesson 01
    (course/own.py), until lesson 01's reference is released."""
    dest = release.build_release(tmp_path / "window", "03", commit=False, frm="01")
    index = json.loads((dest / "course" / "lessons.json").read_text())
    assert index["from"] == "01" and index["upto"] == "03"
    kinds = {m: v["kind"] for m, v in index["modules"].items()}
    assert kinds == {"checks": "given", "tensor": "own", "autograd": "own"}, kinds  # 03's own modules: absent
    assert {"tensor", "autograd", "nn", "optim"} <= set(index["withheld"])
    assert release.check_release(dest, find_lesson("03"), find_lesson("01")) == []
    for le in ("01", "02", "03"):  # no region of the three lessons, whichever file
        for body in release.solution_bodies(read_source(find_lesson(le))):
            assert not any(body in release.normalised(p) for p in release._text_files(dest) if p.suffix == ".py")
    code = ("import minitorch.tensor as t\n"
            "try:\n    t.strides_for((2, 3))\nexcept NotImplementedError as e:\n    print('stub:', e)\n")
    r = in_release(dest, "-c", code)
    assert "stub: Exercise 1.1: strides_for" in r.stdout, r.stdout + r.stderr  # the student's untouched lesson 01
    nb = dest / "lessons" / "01_tensors.ipynb"
    solved = json.loads(notebook_text(solution_notebook(find_lesson("01"))))
    for cell in solved["cells"]:  # Colab's way: no cell ids; still found, by lining the cells up
        cell.pop("id")
    nb.write_text(json.dumps(solved))
    r = in_release(dest, "-c", "import minitorch.tensor as t\nprint(t.strides_for((2, 3, 4)))")
    assert "(12, 4, 1)" in r.stdout, r.stdout + r.stderr


def test_the_next_lesson_arrives_as_a_commit_students_pull(tmp_path):
    base = tmp_path
    env = {k: v for k, v in os.environ.items() if k != "MT_ROOT"}
    make = lambda *a: subprocess.run([sys.executable, "-m", "course.release", *a], cwd=ROOT, env=env,  # noqa: E731
                                     capture_output=True, text=True)
    assert make(str(base / "class"), "--upto", "01").returncode == 0
    git = ["git", "-c", "user.name=s", "-c", "user.email=s@x"]
    subprocess.run(["git", "clone", "-q", str(base / "class"), str(base / "student")], check=True)
    work = base / "student" / "lessons" / "01_tensors.ipynb"
    nb = json.loads(work.read_text())
    nb["cells"][6]["source"] = "# my answer\n" + "".join(nb["cells"][6]["source"])
    work.write_text(json.dumps(nb))
    subprocess.run(git + ["-C", str(base / "student"), "commit", "-qam", "my lesson 01"], check=True)
    r = make(str(base / "class"), "--upto", "02")
    assert r.returncode == 0 and "one more commit" in r.stdout, r.stdout + r.stderr
    log = subprocess.run(["git", "-C", str(base / "class"), "log", "--format=%B"], capture_output=True, text=True).stdout
    assert "New: lesson 02." in log and "reference of lesson 01" in log
    changed = subprocess.run(["git", "-C", str(base / "class"), "diff", "--name-only", "HEAD~1"], capture_output=True,
                             text=True).stdout.split()
    assert "lessons/02_autograd.ipynb" in changed and "minitorch/tensor.py" in changed
    assert "lessons/01_tensors.ipynb" not in changed  # the students' work is not touched
    pull = subprocess.run(git + ["-C", str(base / "student"), "pull", "-q", "--no-rebase", "--no-edit"],
                          capture_output=True, text=True)
    assert pull.returncode == 0, pull.stdout + pull.stderr
    assert "# my answer" in work.read_text() and (base / "student" / "lessons" / "02_autograd.ipynb").exists()
    assert release.check_release(base / "student", find_lesson("02")) == []
    r = make(str(base / "class"), "--upto", "01")
    assert r.returncode != 0 and "would go back" in r.stdout + r.stderr


def test_cpu_only_setup_leaves_out_the_gpu_extra():
    sys.path.insert(0, str(ROOT / "course"))
    try:
        import setup_venv
    finally:
        sys.path.pop(0)
    assert setup_venv.install_spec(cpu=True) == "." and setup_venv.install_spec(cpu=False) == ".[gpu]"
    assert "skip" in setup_venv.CPU_ONLY_SKIPS and "08" in setup_venv.CPU_ONLY_SKIPS
    r = subprocess.run(["make", "-n", "setup", "GPU=0", "-W", "pyproject.toml"], cwd=ROOT, capture_output=True, text=True)
    assert "setup_venv.py .venv constraints.txt --cpu" in r.stdout, r.stdout + r.stderr
    assert "--cpu" in release.makefile()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_class_makefile_is_made_from_the_course_makefiles_student_targets(tmp_path):
    """The class's Makefile is the course Makefile's `# >>> student Makefile` blocks (course.release.makefile),
    so the two cannot drift: each student target runs exactly what the course's runs, and `make verify`
    is added."""
    text = release.makefile()
    (tmp_path / "Makefile").write_text(text)
    assert "## " not in text and "help" not in text and "build:" not in text, text
    for target in ("setup", "lab", "test", "clean"):
        args = ["-n", target, "L=01", "GPU=0", "-W", "pyproject.toml"]
        ours = subprocess.run(["make", "-f", str(tmp_path / "Makefile"), *args], cwd=ROOT, capture_output=True, text=True)
        course = subprocess.run(["make", *args], cwd=ROOT, capture_output=True, text=True)
        assert ours.returncode == 0 and ours.stdout == course.stdout and ours.stdout.strip(), (target, ours, course)
    verify = subprocess.run(["make", "-f", str(tmp_path / "Makefile"), "-n", "verify"], cwd=ROOT, capture_output=True,
                            text=True)
    assert "-m course.release --verify ." in verify.stdout, verify
    with pytest.raises(ValueError, match="no complete"):
        release.student_makefile_blocks("# >>> student Makefile\nPY := python\n")


def test_hosted_ci_uses_runner_images_github_still_offers():
    text = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    import yaml

    images = yaml.safe_load(text)["jobs"]["lessons"]["strategy"]["matrix"]["os"]
    retired = {"macos-12", "macos-13", "ubuntu-20.04", "windows-2019"}  # GitHub's retired labels
    assert not set(images) & retired and "macos-15-intel" in images, images
