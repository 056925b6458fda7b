"""Gradescope and GitHub Classroom, end to end on the sample course (tests/machinery/sample):

- `make gradescope`'s bundle, unzipped into a folder laid out as Gradescope lays out /autograder
  (source/, run_autograder, submission/ as the student uploaded it, submission_metadata.json), its
  run_autograder run there: results.json with per-exercise points, partial credit, a hidden case
  masked, a GPU exercise not failed, the late penalty from the submission's time;
- the Classroom workflow's wiring: each reporter variable is the one
  classroom-resources/autograding-grading-reporter@v1 derives from its step id, each step runs the
  instructor's grader, not the student's tests; the step run here on a student's clone, its output
  decoded as the reporter decodes it, the points it posts computed as the reporter computes them (and,
  with MT_CLASSROOM_REPORTER=path/to/the/action's/dist/main.js and node, by the action itself).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).parent
REPO = HERE.parent.parent
pytestmark = pytest.mark.timeout(600)

EXERCISE = '''

# %%
#| export
#| exercise 1.13
def triple(x: int) -> int:
    """3 x, on a GPU (a test only a GPU runs)."""
    ### BEGIN SOLUTION
    return 3 * x
    ### END SOLUTION
'''
TESTS = '''


@pytest.mark.hidden
@pytest.mark.exercise("1.10")
def test_plus10_hidden(lesson):
    assert lesson.plus10(-7) == 3, f"plus10(-7) should be 3, got {lesson.plus10(-7)}"


@pytest.mark.gpu
@pytest.mark.exercise("1.13")
def test_triple_on_a_gpu(lesson):
    assert lesson.triple(2) == 6
'''


def run(root: Path, *args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MT_ROOT": str(root), "MT_CELL_TIME_LIMIT": "3", "MT_TIME_SCALE": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd or root, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("lms") / "course"
    shutil.copytree(HERE / "sample", root)
    shutil.copy(HERE.parent / "conftest.py", root / "tests" / "conftest.py")
    with open(root / "solutions" / "01_sample.py", "a") as f:
        f.write(EXERCISE)
    with open(root / "tests" / "test_01_sample.py", "a") as f:
        f.write(TESTS)
    (root / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text().replace("timeout = 60", "timeout = 8"))
    assert run(root, "-m", "course.build").returncode == 0
    made = run(root, "-c", "from course.build import notebook_text, solution_notebook\n"
                           "from course.source import find_lesson\n"
                           "print(notebook_text(solution_notebook(find_lesson('01'))), end='')")
    solved = json.loads(made.stdout)
    work = []  # the student's: right, but plus10 fails the hidden case and cache_bytes one of its three tests
    for cell in solved["cells"]:
        src = "".join(cell["source"])
        if "def plus10" in src:
            src = "def plus10(x: int) -> int:\n    return 11\n"
        elif "def cache_bytes" in src:
            src = src.replace("return 2 * _positive(layers) * _positive(tokens)", "return 14 * _positive(layers) // layers")
        work.append({**cell, "source": src})
    (root / "student.ipynb").write_text(json.dumps({**solved, "cells": work}))
    return root


def gpu_here() -> bool:
    from course.gpu import gpu_status

    return gpu_status()[0]


def test_gradescope_bundle_run_as_gradescope_runs_it(course, tmp_path):
    r = run(course, "-m", "course.gradescope", "build", "01", "--out", str(tmp_path / "build"),
            "--late", "10%/day, max 50%", "--deadline", "2026-03-01T12:00:00+00:00")
    assert r.returncode == 0, r.stdout + r.stderr
    archive = tmp_path / "build" / "01_sample.zip"
    with zipfile.ZipFile(archive) as z:
        names = z.namelist()
        assert {"setup.sh", "run_autograder", "config.json"} <= set(names)  # at the zip's root, as Gradescope wants
        assert all(n.startswith(("setup.sh", "run_autograder", "config.json", "tree/")) for n in names)
        assert not any(n.startswith("tree/solutions/") or n == "tree/minitorch/sample.py" for n in names)
        assert (z.getinfo("run_autograder").external_attr >> 16) & 0o111
        setup = z.read("setup.sh").decode()
        reqs = z.read("tree/requirements-grading.txt").decode()
    assert subprocess.run(["bash", "-n", "-c", setup]).returncode == 0
    assert "uv python install 3.12" in setup and "UV_PYTHON_INSTALL_DIR=/opt" in setup  # not 3.10, readable by all
    assert "cupy" not in reqs and "nvidia" not in reqs and "numpy" in reqs  # CPU only
    # /autograder as Gradescope lays it out; the student uploaded a renamed notebook in a folder
    ag = tmp_path / "autograder"
    (ag / "source").mkdir(parents=True)
    with zipfile.ZipFile(archive) as z:
        z.extractall(ag / "source")
    for p in ag.rglob("*"):  # zipfile does not restore modes; Gradescope's unzip does
        if p.name in ("run_autograder", "setup.sh"):
            p.chmod(0o755)
    shutil.copy(ag / "source" / "run_autograder", ag / "run_autograder")
    (ag / "submission" / "my work").mkdir(parents=True)
    shutil.copy(course / "student.ipynb", ag / "submission" / "my work" / "01_sample (1).ipynb")
    (ag / "submission_metadata.json").write_text(json.dumps({
        "id": 1, "created_at": "2026-03-02T18:00:00.000000+00:00",
        "assignment": {"due_date": "2026-03-05T00:00:00.000000+00:00", "title": "Lesson 01"}}))
    env = {k: v for k, v in os.environ.items() if k not in ("MT_ROOT", "MT_WALK")}
    env.update(AUTOGRADER_DIR=str(ag), MT_GRADER_PYTHON=sys.executable, MT_CELL_TIME_LIMIT="3", MT_TIME_SCALE="1")
    r = subprocess.run([str(ag / "run_autograder")], cwd=ag, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((ag / "results" / "results.json").read_text())
    tests = {t["number"]: t for t in results["tests"]}
    assert sorted(tests, key=lambda k: int(k.split(".")[1])) == [f"1.{k}" for k in range(1, 14)]
    for k in range(1, 10):
        assert tests[f"1.{k}"]["score"] == tests[f"1.{k}"]["max_score"] == 1 and tests[f"1.{k}"]["status"] == "passed"
    assert tests["1.10"]["score"] == 0.5 and tests["1.10"]["status"] == "failed"  # 1 of 2 tests: the hidden one failed
    assert "a hidden case failed" in tests["1.10"]["output"] and "plus10(-7)" not in json.dumps(results)
    assert "plus10(-7) should be 3" in r.stdout  # the instructor's stdout has it whole
    assert tests["1.12"]["score"] == round(2 / 3, 2) and "2 of 3 tests pass" in tests["1.12"]["output"]
    if not gpu_here():  # a GPU exercise, where there is none: worth 0, not failed
        assert tests["1.13"]["max_score"] == 0 and "status" not in tests["1.13"], tests["1.13"]
        assert "needs a CUDA GPU" in tests["1.13"]["output"]
    total = sum(t["score"] for t in results["tests"])
    assert results["score"] == round(total * 0.8, 2)  # 30 h after the deadline: two days started, 20% off
    assert "after the deadline" in results["output"]
    # the grader itself broken: results.json all the same, with a line for the student
    (ag / "source" / "config.json").write_text("{")
    r = subprocess.run([str(ag / "run_autograder")], cwd=ag, env=env, capture_output=True, text=True, timeout=600)
    broken = json.loads((ag / "results" / "results.json").read_text())
    assert r.returncode == 0 and broken["score"] == 0 and "could not grade" in broken["output"]


# --- GitHub Classroom -----------------------------------------------------------------------------

def reporter(env: dict, runners: str) -> dict:
    """What classroom-resources/autograding-grading-reporter@v1 does with its inputs (src/main.js,
    src/notify-classroom.js, src/helpers/test-helpers.js at tag v1): each runner's result is the base64
    JSON in the variable `<runner upper-cased>_RESULTS`; the grade posted is the sum of the tests' scores
    over the sum of the runners' max_score; the step fails if a runner's status is "fail"."""
    results = []
    for runner in runners.split(","):
        encoded = env.get(f"{runner.strip().upper()}_RESULTS")
        if encoded is None:  # Buffer.from(undefined) throws: no grade is posted at all
            raise KeyError(f"{runner.strip().upper()}_RESULTS")
        results.append(json.loads(base64.b64decode(encoded)))
    total = maximum = 0.0
    for r in results:
        if not r.get("max_score"):
            continue
        maximum += r["max_score"]
        total += sum(t["score"] for t in r["tests"])
    return {"totalPoints": total, "maxPoints": maximum, "failed": any(r["status"] == "fail" for r in results)}


def test_the_workflow_is_wired_as_the_reporter_reads_it():
    from course import release
    from course.source import find_lesson

    lessons = [find_lesson(k) for k in ("01", "02", "03")]
    flow = yaml.safe_load(release.workflow(lessons))
    steps = flow["jobs"]["run-autograding-tests"]["steps"]
    report = next(s for s in steps if s.get("uses", "").startswith("classroom-resources/autograding-grading-reporter@"))
    runners = report["with"]["runners"]
    assert re.fullmatch(r"([a-zA-Z0-9]+,)*[a-zA-Z0-9]+", runners)  # the reporter's own check of the input
    by_id = {s["id"]: s for s in steps if "id" in s}
    for runner, lesson in zip(runners.split(","), lessons):
        step = by_id[runner]
        assert report["env"][f"{runner.upper()}_RESULTS"] == "${{steps.%s.outputs.result}}" % runner
        assert re.fullmatch(rf'sudo -E "\$\(command -v python\)" -m course\.classroom {lesson.number} '
                            r"--submission \.\./submission", step["run"]) and step["working-directory"] == "grader"
    assert set(report["env"]) == {f"{r.upper()}_RESULTS" for r in runners.split(",")}
    checkouts = [s for s in steps if s.get("uses", "").startswith("actions/checkout@")]
    grader = next(s for s in checkouts if s["with"].get("path") == "grader")
    assert grader["with"]["repository"] == "${{ vars.%s }}" % release.GRADER_VAR
    assert grader["with"]["token"] == "${{ secrets.%s }}" % release.GRADER_SECRET
    assert next(s for s in checkouts if s["with"].get("path") == "submission")
    text = release.workflow(lessons)
    assert "make test" not in text and "pip install -q -c grader/" in text  # nothing of the student's runs the grading
    assert report.get("if") == "always()"


def test_a_classroom_step_posts_per_exercise_points(course, tmp_path):
    from course import release

    r = run(course, "-m", "course.release", str(tmp_path / "class"), "--upto", "01", "--grader", str(tmp_path / "grader"))
    assert r.returncode == 0, r.stdout + r.stderr
    work = tmp_path / "runner"  # the job's workspace: the student's repository and the instructor's grader
    subprocess.run(["git", "clone", "-q", str(tmp_path / "class"), str(work / "submission")], check=True)
    subprocess.run(["git", "clone", "-q", str(tmp_path / "grader"), str(work / "grader")], check=True)
    assert not list((work / "submission" / "tests").glob("*hidden*")) and \
        "test_plus10_hidden" not in (work / "submission" / "tests" / "test_01_sample.py").read_text()
    assert "test_plus10_hidden" in (work / "grader" / "tests" / "test_01_sample.py").read_text()
    shutil.copy(course / "student.ipynb", work / "submission" / "lessons" / "01_sample.ipynb")
    # the student edits their copy of the tests to pass everything: the grader never reads it
    (work / "submission" / "tests" / "test_01_sample.py").write_text("def test_everything():\n    pass\n")
    flow = yaml.safe_load((work / "submission" / release.WORKFLOW).read_text())
    steps = flow["jobs"]["run-autograding-tests"]["steps"]
    outputs = {}
    for step in steps:
        if "id" not in step:
            continue
        m = re.fullmatch(r'sudo -E "\$\(command -v python\)" (-m course\.classroom .*)', step["run"])
        output = tmp_path / f"output-{step['id']}"
        output.write_text("")
        env = {k: v for k, v in os.environ.items() if k not in ("MT_ROOT", "MT_WALK")}
        env.update(GITHUB_OUTPUT=str(output), MT_CELL_TIME_LIMIT="3", MT_TIME_SCALE="1")
        done = subprocess.run([sys.executable, *m.group(1).split()], cwd=work / step["working-directory"], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "a hidden case failed" in done.stdout and "plus10(-7)" not in done.stdout  # the log is the student's
        key, _, value = output.read_text().strip().partition("=")
        assert key == "result"
        outputs[step["id"]] = value
    report = next(s for s in steps if "autograding-grading-reporter" in s.get("uses", ""))
    env = {name: outputs[re.fullmatch(r"\$\{\{steps\.(\w+)\.outputs\.result\}\}", v).group(1)]
           for name, v in report["env"].items()}
    posted = reporter(env, report["with"]["runners"])
    # 12 exercises of 1 point (1.13 needs a GPU: left out here); 1.10: 1 of 2 tests, 1.12: 2 of 3
    expected_max = 13.0 if gpu_here() else 12.0
    assert posted["maxPoints"] == expected_max and posted["failed"] is True
    assert posted["totalPoints"] == pytest.approx(expected_max - 0.5 - (1 - 0.67)), posted
    lesson = json.loads(base64.b64decode(env["LESSON01_RESULTS"]))
    scores = {t["name"].split()[0]: t for t in lesson["tests"]}
    assert scores["1.10"]["score"] == 0.5 and scores["1.10"]["status"] == "fail"
    assert scores["1.1"]["status"] == "pass" and lesson["version"] == 1
    # the names of issue 37's workflow: the reporter finds no result under them, and posts nothing
    with pytest.raises(KeyError):
        reporter({"LESSON_01_RESULTS": env["LESSON01_RESULTS"]}, "lesson-01")
    action = os.environ.get("MT_CLASSROOM_REPORTER")  # the action itself: its dist/main.js at tag v1
    if action and shutil.which("node"):
        out = subprocess.run(["node", action], env={"PATH": os.environ["PATH"], "INPUT_RUNNERS": report["with"]["runners"],
                                                    **env}, capture_output=True, text=True, timeout=60)
        notice = re.search(r"::notice title=Autograding report::(\{.*\})", out.stdout)
        assert notice, out.stdout + out.stderr
        assert json.loads(notice.group(1)) == {"totalPoints": pytest.approx(posted["totalPoints"]),
                                               "maxPoints": posted["maxPoints"]}
