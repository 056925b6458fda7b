"""`make grade-class`: a class of synthetic students on the sample course (tests/machinery/sample), handed
in as LMSs hand work over, each graded in the lesson's grading tree, isolated where this machine allows;
the gradebook is checked exactly. The cheating submission on the real course: test_class_isolation.py."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent
pytestmark = pytest.mark.timeout(900)  # fifteen students, three of them costing a time limit each

# appended to the sample's tests in the copy: a Hypothesis property of 1.5 and a hidden case of 1.10
EXTRA_TESTS = '''

from hypothesis import example, given, strategies as st  # noqa: E402


@pytest.mark.exercise("1.5")
@given(st.integers(-50, 50))
@example(-3)
def test_plus5_property(lesson, x):
    assert lesson.plus5(x) == x + 5


@pytest.mark.hidden
@pytest.mark.exercise("1.10")
def test_plus10_hidden(lesson):
    assert lesson.plus10(-7) == 3, f"plus10(-7) should be 3, got {lesson.plus10(-7)}"
'''


def run(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MT_ROOT": str(root), "MT_CELL_TIME_LIMIT": "3", "MT_TIME_SCALE": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def course(tmp_path_factory):  # as tests/machinery/test_machinery.py's, with EXTRA_TESTS
    root = tmp_path_factory.mktemp("classgrade") / "course"
    shutil.copytree(HERE / "sample", root)
    shutil.copy(HERE.parent / "conftest.py", root / "tests" / "conftest.py")
    with open(root / "tests" / "test_01_sample.py", "a") as f:
        f.write(EXTRA_TESTS)
    (root / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text().replace("timeout = 60", "timeout = 4"))
    assert run(root, "-m", "course.build").returncode == 0
    return root


def notebook(cells: list[dict], replace: dict[str, str | None]) -> list[dict]:
    """Cells whose source holds a key get its value as source (None: the cell is deleted)."""
    out = []
    for cell in cells:
        src = "".join(cell["source"])
        key = next((k for k in replace if k in src), None)
        if key is None:
            out.append(cell)
        elif replace[key] is not None:
            out.append({**cell, "source": replace[key]})
    return out


def isolation() -> str:
    from course.isolation import probe

    return "auto" if not probe("namespaces") or not probe("uid") else "none"


def test_grade_class_of_synthetic_students(course, tmp_path):
    made = run(course, "-c", "from course.build import notebook_text, solution_notebook\n"
                             "from course.source import find_lesson\n"
                             "print(notebook_text(solution_notebook(find_lesson('01'))), end='')")
    solved = json.loads(made.stdout)
    stubs = json.loads((course / "lessons" / "01_sample.ipynb").read_text())
    area = "class Circle:\n    def __init__(self, r):\n        self.r = r\n    def area(self):\n        return 2 * 3.14159 * self.r\n"
    hang3 = "def plus3(x):\n    return x + 3\nwhile True:\n    pass\n"
    subs = tmp_path / "submissions"

    def hand_in(rel: str, cells: list[dict], **top) -> Path:
        path = subs / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**stubs, **top, "cells": cells}))
        return path

    hand_in("ada_correct/lessons/01_sample.ipynb", solved["cells"])
    hand_in("ada_correct/scratch.ipynb", [])  # no lesson's: reported, not graded
    hand_in("bob_stubs/lessons/01_sample.ipynb", stubs["cells"])
    hand_in("cyd_hangs/lessons/01_sample.ipynb", notebook(solved["cells"], {"def plus3": hang3}))
    hand_in("dan_crashes/lessons/01_sample.ipynb", notebook(solved["cells"], {"def plus4": "import os\nos._exit(1)\n"}))
    hand_in("eve_deleted/lessons/01_sample.ipynb", notebook(solved["cells"], {"class Circle": None, 'check("1.2")': None}))
    hand_in("fay_partial/lessons/01_sample.ipynb", notebook(stubs["cells"], {
        "def double": "def double(x):\n    return 2 * x\n", "class Circle": area,
        "def plus3": "def plus_three(x):\n    return x + 3\n"}))
    (subs / "gil_nothing").mkdir()
    hand_in("hal_renamed/01_sample (1).ipynb", solved["cells"])  # a browser's second download
    hand_in("ivy_1234_5678_01_sample-1.ipynb", solved["cells"])  # Canvas's flat download, a resubmission
    hand_in("kim_two_copies/01_sample.ipynb", solved["cells"])
    hand_in("kim_two_copies/old/01_sample.ipynb", stubs["cells"])
    whole = json.dumps({**stubs, "cells": solved["cells"]})
    (subs / "lea_truncated").mkdir()
    (subs / "lea_truncated" / "01_sample.ipynb").write_text(whole[: len(whole) // 2])  # an upload cut short
    colab = [{k: v for k, v in c.items() if k != "id"} for c in notebook(solved["cells"], {"def plus3": hang3})]
    hand_in("max_colab/01_sample.ipynb", colab, nbformat_minor=0)  # Colab saves no cell ids
    hand_in("ned_loop/lessons/01_sample.ipynb", notebook(solved["cells"], {
        "def plus5": "def plus5(x: int) -> int:\n    y = 0\n    while y != x:\n        y += 1\n    return y + 5\n"}))
    hand_in("oli_hidden/lessons/01_sample.ipynb", notebook(solved["cells"], {
        "def plus10": "def plus10(x: int) -> int:\n    return 11\n"}))
    hand_in("pat_points/lessons/01_sample.ipynb", notebook(solved["cells"], {
        "def cache_bytes": "def cache_bytes(n, b):\n    if n < 0:\n        raise ValueError(n)\n    return 14\n\n\n"
                           "def fork(blocks):\n    return list(blocks)\n"}))
    (tmp_path / "points.toml").write_text('[points.01_sample]\n"1.10" = 2\n"1.12" = 3\n')
    (tmp_path / "times.csv").write_text("student,submitted\nada_correct,2026-03-01T11:00:00+00:00\n"
                                        "hal_renamed,2026-03-02T13:00:00+00:00\n")
    out = tmp_path / "grades"
    r = run(course, "-m", "course.classgrade", str(subs), "--out", str(out), "--lessons", "01",
            "--isolation", isolation(), "--points", str(tmp_path / "points.toml"),
            "--deadline", "2026-03-01T12:00:00+00:00", "--late", "10%/day, max 50%", "--times", str(tmp_path / "times.csv"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {row["student"]: row for row in csv.DictReader(open(out / "gradebook.csv"))}
    ex = [f"1.{k}" for k in range(1, 13)]
    worth = {e: (2 if e == "1.10" else 3 if e == "1.12" else 1) for e in ex}

    def expect(name, statuses, points=None, total=None, score=None, late="", penalty=""):
        row = rows[name]
        assert [row[e] for e in ex] == statuses, (name, row)
        pts = points or {}
        got = {e: float(row[f"{e} pts"]) for e in ex}
        want = {e: pts.get(e, worth[e] if s == "pass" else 0.0) for e, s in zip(ex, statuses)}
        assert got == want, (name, got)
        assert float(row["points"]) == (total if total is not None else sum(want.values())) and row["max"] == "15", row
        assert float(row["score"]) == (score if score is not None else float(row["points"])), row
        assert (row["late"], row["penalty"]) == (late, penalty), row

    passed = ["pass"] * 12
    expect("ada_correct", passed)
    assert "scratch.ipynb: not a notebook of any lesson graded here" in rows["ada_correct"]["notes"]
    expect("bob_stubs", ["todo"] * 12)
    expect("cyd_hangs", passed[:2] + ["fail"] + passed[3:])
    expect("dan_crashes", passed[:3] + ["fail"] + passed[4:])
    expect("eve_deleted", ["pass", "fail"] + passed[2:])
    expect("fay_partial", ["pass", "fail", "fail"] + ["todo"] * 9)
    expect("gil_nothing", ["missing"] * 12)
    expect("hal_renamed", passed, score=12.0, late="1 d 1 h", penalty="20%")  # two days started: 20% of 15
    expect("ivy", passed)
    expect("kim_two_copies", ["duplicate"] * 12)
    expect("lea_truncated", ["unreadable"] * 12)
    expect("max_colab", passed[:2] + ["fail"] + passed[3:])  # the hang charged to 1.3: no row for "?"
    expect("ned_loop", passed[:4] + ["partial"] + passed[5:], points={"1.5": 0.5})
    expect("oli_hidden", passed[:9] + ["partial"] + passed[10:], points={"1.10": 1.0})
    expect("pat_points", passed[:11] + ["partial"], points={"1.12": 2.0})
    assert list(rows) == sorted(rows)  # Canvas's file went to its student, nothing else added

    fb = lambda name: (out / "feedback" / f"{name}.txt").read_text()  # noqa: E731
    mine = lambda name: (out / "instructor" / f"{name}.txt").read_text()  # noqa: E731
    report = lambda name: json.loads((out / "gradescope" / name / "results.json").read_text())  # noqa: E731
    assert "[FAIL] 1.2" in fb("fay_partial") and "defines no `plus3`" in fb("fay_partial")
    assert fb("fay_partial").rstrip().endswith("Points: 1 of 15")
    # LMS names, two copies, an unreadable file: said once, by name
    assert "01_sample.ipynb, old/01_sample.ipynb" in fb("kim_two_copies") and "Not graded" in fb("kim_two_copies")
    lea = fb("lea_truncated")
    assert lea.count("not a readable notebook") == 1 and "JSONDecodeError" not in lea and "breaks off" in lea
    # the loop under Hypothesis: stopped at the per-test limit, the line named, not the watchdog's words
    ned = fb("ned_loop")
    assert "ran past its time limit of 4" in ned and "while y != x:" in ned and "could not be interrupted" not in ned
    # a hidden case: the student reads that one failed; the instructor reads which and why
    assert "a hidden case failed" in fb("oli_hidden") and "plus10(-7)" not in fb("oli_hidden")
    assert "plus10(-7) should be 3, got 11" in mine("oli_hidden")
    assert "plus10(-7)" not in json.dumps(report("oli_hidden"))
    # late: the rule applied from the submission's time, in the CSV and in results.json
    hal = report("hal_renamed")
    assert hal["score"] == 12.0 and "20% off" in hal["output"], hal
    # results.json: per-exercise points and partial credit
    pat = {t["number"]: t for t in report("pat_points")["tests"]}
    assert pat["1.12"]["score"] == 2.0 and pat["1.12"]["max_score"] == 3.0 and pat["1.12"]["status"] == "failed"
    assert "2 of 3 tests pass" in pat["1.12"]["output"]
    cyd = {t["number"]: t for t in report("cyd_hangs")["tests"]}
    assert cyd["1.3"]["score"] == 0 and "ran longer than" in cyd["1.3"]["output"], cyd["1.3"]
    grading = json.loads((out / "grading.json").read_text())
    assert grading["lessons"] == ["01"] and grading["late"] == "10%/day, max 50%"


def test_exactly_the_lessons_named_and_lms_names():
    """Notebooks found by what they hold or by the names LMSs give them; lessons not asked for are not
    graded (and said so); two different copies are not chosen between."""
    from course.submissions import discover, lesson_from_name

    stems = ["01_tensors", "02_autograd", "03_training"]
    assert lesson_from_name("01_tensors (1).ipynb", stems) == "01_tensors"
    assert lesson_from_name("smithjohn_LATE_123_456_02_autograd-2.ipynb", stems) == "02_autograd"
    assert lesson_from_name("03_Training.ipynb", stems) == "03_training"
    assert lesson_from_name("notes.ipynb", stems) is None
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        subs = Path(d)

        def nb(rel, lesson_id="01-tensors", n=2):
            p = subs / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps({"cells": [{"cell_type": "code", "id": f"{lesson_id}-{i:03d}", "source": f"x = {i}"}
                                               for i in range(n)], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))

        nb("amy/submission/01_tensors.ipynb")  # Gradescope's upload folder, one level down
        nb("amy/.ipynb_checkpoints/01_tensors-checkpoint.ipynb")
        nb("amy/__MACOSX/._01_tensors.ipynb")
        nb("amy/02_autograd.ipynb", "02-autograd")  # a lesson not asked for
        nb("ben/01_tensors.ipynb", "02-autograd")  # named for 01, holds 02
        nb("cat/work.ipynb")  # any name: its cells say lesson 01
        nb("smithjohn_late_11_22_01_tensors-1.ipynb")
        (subs / "stray.ipynb").write_text("{}")
        found, notes = discover(subs, ["01_tensors"])
        by = {s.student: s for s in found}
        assert sorted(by) == ["amy", "ben", "cat", "smithjohn"]
        assert by["amy"].for_lesson("01_tensors")[0] == "ok"
        assert any("02_autograd.ipynb: not a notebook of any lesson graded here" in n for n in by["amy"].notes)
        assert by["ben"].for_lesson("01_tensors")[0] == "missing"
        assert by["cat"].for_lesson("01_tensors")[0] == "ok"
        assert by["smithjohn"].for_lesson("01_tensors")[0] == "ok" and "Canvas marked this submission LATE" in by["smithjohn"].notes
        assert any("stray.ipynb" in n for n in notes)
        found, _ = discover(subs, stems)
        ben = {s.student: s for s in found}["ben"]
        assert ben.for_lesson("02_autograd")[0] == "ok" and "holds lesson 02_autograd" in ben.notes[0]


def test_points_partial_credit_and_late_rules(tmp_path):
    from course.points import LatePolicy, Points

    course = Points.load()
    assert course.of("03_training", "3.3") >= 1 and course.partial == "tests"
    tests = [{"outcome": o} for o in ("passed", "passed", "failed", "skipped")]
    assert course.score("03_training", "3.3", "failed", tests) == (round(course.of("03_training", "3.3") * 2 / 3, 2),
                                                                   course.of("03_training", "3.3"), 2, 3)
    (tmp_path / "p.toml").write_text('partial = "all"\n[points.03_training]\n"3.3" = 10\n')
    mine = Points.load(tmp_path / "p.toml")
    assert mine.score("03_training", "3.3", "failed", tests) == (0.0, 10.0, 2, 3)
    assert mine.score("03_training", "3.3", "skipped", [{"outcome": "skipped"}]) == (0.0, 0.0, 0, 0)
    day = 86400
    rule = LatePolicy.parse("10%/day, max 30%")
    assert [rule.penalty(s) for s in (0, 1, day, day + 1, 10 * day)] == [0, 0.1, 0.1, 0.2, 0.3]
    assert LatePolicy.parse("2%/hour, grace 15m").penalty(20 * 60) == 0.02
    assert LatePolicy.parse("2%/hour, grace 15m").penalty(10 * 60) == 0
    assert LatePolicy.parse("zero").penalty(5) == 1 and LatePolicy.parse("none").penalty(10 * day) == 0
    with pytest.raises(SystemExit, match="cannot read"):
        LatePolicy.parse("ten percent")


def test_every_course_point_names_an_exercise():
    """course/points.toml names only exercises that exist (a renumbered exercise must move its points)."""
    import tomllib

    from course.source import all_lessons, exercise_titles

    table = tomllib.loads((REPO / "course" / "points.toml").read_text())["points"]
    lessons = {le.stem: le for le in all_lessons()}
    for stem, points in table.items():
        assert stem in lessons, f"course/points.toml: no lesson {stem}"
        assert set(points) <= set(exercise_titles(lessons[stem])), (stem, set(points) - set(exercise_titles(lessons[stem])))
        assert all(v > 0 for v in points.values())


def test_make_test_says_one_line_for_an_unreadable_notebook(course, tmp_path):
    """A student's own `make test` on a notebook cut short: one plain line, not a JSON error per exercise."""
    copy = tmp_path / "course"
    shutil.copytree(course, copy)
    nb = copy / "lessons" / "01_sample.ipynb"
    nb.write_text(nb.read_text()[:500])
    r = run(copy, "-m", "course.grade", "01")
    assert r.returncode == 1 and r.stdout.count("is not a readable notebook") == 1, r.stdout + r.stderr
    assert "JSONDecodeError" not in r.stdout and "[" not in r.stdout.split("Total")[0], r.stdout


def test_a_window_lessons_unwritten_dependency_is_a_failure_not_a_todo():
    """Lesson 02 graded on the student's own lesson 01 (FROM=01): a test stopped by lesson 01's stub failed
    for want of it; the exercise is not 'not attempted'."""
    from course.classgrade import grade_lesson
    from course.grade import LessonResult
    from course.points import Points
    from course.source import find_lesson

    lesson = find_lesson("02")
    tests = [{"test": "tests/test_02_autograd.py::test_topo_order", "name": "test_topo_order", "exercise": "2.1",
              "outcome": "stub", "message": "NotImplementedError: Exercise 1.3: transpose_layout"},
             {"test": "tests/test_02_autograd.py::test_other", "name": "test_other", "exercise": "2.1",
              "outcome": "passed", "message": ""}]
    graded, shown, _ = grade_lesson(lesson, LessonResult(lesson, "nb", tests, [], ""), set(), Points.load())
    g = next(g for g in graded if g.id == "2.1")
    assert g.status == "partial" and "needs exercise 1.3 (transpose_layout) of lesson 01" in g.detail, g
