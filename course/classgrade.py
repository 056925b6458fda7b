"""`make grade-class SUBMISSIONS=dir LESSONS=01,02,03`: grade a class, with answers out of reach.

    python -m course.classgrade SUBMISSIONS --lessons 01,02,03 [--out OUT] [--from NN]
        [--isolation auto|namespaces|uid|none] [--points FILE] [--partial tests|all]
        [--deadline 2026-03-01T23:59+01:00] [--late "10%/day, max 50%"] [--times times.csv]
    python -m course.classgrade --check [NN ...]   # each lesson's solution and stubs, graded so: all pass / none

Exactly the lessons named are graded, for every student. SUBMISSIONS holds one folder per student (the
folder's name is the student; notebooks anywhere under it: a clone of the release, a Gradescope
upload folder) or Canvas's flat download (course/submissions.py: LMS renamings are matched; a notebook
that matches no lesson, an unreadable one, or two different ones for a lesson are reported by name).

Each lesson is graded in its grading tree: the release for that lesson (course/release.py's
`grading_tree`: that lesson's answers do not exist there; every test, hidden ones included), built in
a private temporary folder; with --from NN, the lessons from NN on share the tree of a release that
withholds all of them (a multi-lesson assignment: a later lesson then builds on the student's own
earlier one, as in their release). The grader (trusted: it reads the results) runs a worker in the tree
as you; every process that runs the student's code runs in the sandbox of course/isolation.py: a fresh
root holding only the system, Python, the tree and that one notebook, no network, an unprivileged user,
a new process tree per run (`python -m course.isolation` says what this machine allows). --isolation
none is refused unless named.

Points: course/points.toml (an instructor's --points file merged over it); partial credit by tests
passed ("tests") or all-or-nothing ("all"). A hidden test (`@pytest.mark.hidden`, in no release) runs
here; a student sees only that a hidden case failed. Late: --deadline and --late apply a penalty from
each submission's time (--times CSV, else Gradescope's submission_metadata.json in the student's
folder, else a git clone's last commit).

OUT (default build/grades) receives:
  gradebook.csv              a row per student: per exercise its status (pass, partial, fail, todo (not
                             attempted), skip (needs a GPU), missing, unreadable, duplicate, error) and
                             points; then points, max, submitted, late, penalty, score (after it), notes
  feedback/STUDENT.txt       what the student may read: scoreboards with points (hidden cases masked)
  gradescope/STUDENT/results.json   Gradescope's format: one test per exercise (score, max_score,
                             status; a skipped exercise is worth 0 and not failed), the score after
                             the late penalty
  instructor/STUDENT.txt     for you: every message in full, files not graded, code worth a look
  grading.json               how the run was made (isolation, trees, points, deadline, rule)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.source import ROOT, Lesson, all_lessons, exercise_titles, find_lesson

CELL = {"passed": "pass", "failed": "fail", "not attempted": "todo", "skipped": "skip", "no tests": "error"}
SYMBOL = {"pass": "PASS", "partial": "part", "fail": "FAIL", "todo": "todo", "skip": "skip", "missing": "----",
          "unreadable": "????", "duplicate": "dup?", "error": "ERR!"}
WORDS = {"pass": "passed", "partial": "partly passed", "fail": "failed", "todo": "not attempted", "skip": "skipped",
         "missing": "missing", "unreadable": "unreadable", "duplicate": "two notebooks", "error": "tests could not run"}
HIDDEN_MESSAGE = "a hidden case failed (hidden cases are not shown)"
WORKER_LIMIT = 3600  # seconds for one lesson of one student, all its test processes together (x time scale)
# code worth an instructor's look: the ways a submission could reach past its own notebook
REVIEW = [
    (r"\b(?:import|from)\s+_?pytest\b", "imports pytest, which runs the tests that grade it"),
    (r"\b(?:import|from)\s+course\b", "imports the course's grader (course.*)"),
    (r"MT_RESULTS|MT_SKIP_CELLS|MT_SANDBOX|PYTEST_CURRENT_TEST", "reads the grader's environment"),
    (r"sys\._getframe|inspect\.(?:stack|currentframe|getouterframes)|gc\.get_(?:objects|referrers)",
     "inspects its callers' frames or the interpreter's objects"),
    (r"\bos\.walk\b|\bos\.scandir\b|\bglob\.glob\s*\(|\.rglob\s*\(", "walks the file system"),
    (r"solutions|lessons\.json|/tests/", "names the course's solutions, index or tests"),
    (r"\bsubprocess\b|\bos\.system\b|\bos\.fork\b|\bos\.exec\w*\b|\bos\.kill\b", "starts or signals processes"),
    (r"\bsocket\b|\burllib\b|\brequests\b|\bhttp\.client\b", "uses the network"),
    (r"\bctypes\b|\bcffi\b", "calls C directly"),
    (r"sys\.modules\s*\[|builtins\.|__builtins__", "edits sys.modules or the builtins"),
]


@dataclass
class Graded:
    """One exercise of one student."""
    lesson: str
    id: str
    title: str
    status: str  # pass partial fail todo skip missing unreadable duplicate error
    score: float = 0.0
    worth: float = 0.0
    passed: int = 0
    counted: int = 0
    skipped: int = 0  # tests that could not run here (no GPU)
    detail: str = ""  # what the student reads
    full: str = ""  # what the instructor reads (hidden cases unmasked)


@dataclass
class StudentResult:
    student: str
    exercises: list[Graded] = field(default_factory=list)
    boards: list[str] = field(default_factory=list)  # the student's scoreboards
    full_boards: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # the student's to read too
    private: list[str] = field(default_factory=list)  # the instructor's only
    review: list[str] = field(default_factory=list)
    submitted: str = ""
    late_seconds: float = 0.0
    penalty: float = 0.0
    seconds: float = 0.0

    @property
    def points(self) -> float:
        return round(sum(g.score for g in self.exercises), 2)

    @property
    def maximum(self) -> float:
        return round(sum(g.worth for g in self.exercises), 2)

    @property
    def final(self) -> float:
        return round(self.points * (1 - self.penalty), 2)


def parse_lessons(values: list[str]) -> list[Lesson]:
    keys = [k for v in values for k in re.split(r"[,\s]+", v) if k]
    if not keys:
        raise SystemExit("name the lessons to grade: --lessons 01,02,03 (make grade-class LESSONS=01,02,03)")
    lessons = []
    for k in keys:
        le = find_lesson(k)
        if le not in lessons:
            lessons.append(le)
    return sorted(lessons, key=lambda le: int(le.number))


# --- grading trees and the worker ------------------------------------------------------------------

def tree_plan(lessons: list[Lesson], frm: str | None) -> dict[str, tuple[str, str]]:
    """{lesson stem: (FROM, UPTO) of the grading tree it is graded in}."""
    if not frm:
        return {le.stem: (le.number, le.number) for le in lessons}
    start = int(find_lesson(frm).number)
    last = max(le.number for le in lessons)
    return {le.stem: ((f"{start:02d}", last) if int(le.number) >= start else (le.number, le.number)) for le in lessons}


def hidden_names(tree: Path, lesson: Lesson) -> set[str]:
    from course.release import hidden_tests

    path = tree / "tests" / lesson.tests.name
    return {name for name, _, _ in hidden_tests(path.read_text())} if path.exists() else set()


def is_hidden(test: dict, hidden: set[str]) -> bool:
    parts = [p.split("[")[0] for p in str(test.get("test", "")).split("::")[1:]]
    return any(p in hidden for p in parts)


def run_worker(tree: Path, lesson: Lesson, notebook: Path, own: dict[str, Path], mode: str, work: Path):
    """Grade `notebook` for `lesson` in `tree`: a worker (the grader, as you) runs course.grade's
    run_tests there, each of its test processes in the sandbox. Returns the LessonResult."""
    from course.grade import LessonResult
    from course.isolation import Sandbox
    from course.timing import time_scale

    run = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    try:
        os.chmod(run, 0o755)
        copy = run / f"{lesson.stem}.ipynb"
        shutil.copyfile(notebook, copy)
        (run / "own").mkdir()
        for stem, path in own.items():
            shutil.copyfile(path, run / "own" / f"{stem}.ipynb")
        for p in [copy, *(run / "own").iterdir()]:
            os.chmod(p, 0o644)
        os.chmod(run / "own", 0o755)
        out = run / "result.json"
        env = {k: v for k, v in os.environ.items() if k not in ("MT_ROOT", "MT_WALK", "MT_SANDBOX", "MT_IMPL")}
        env.update(PYTHONPATH=str(tree), MT_OWN_NOTEBOOKS=str(run / "own"), MT_TIME_SCALE=str(time_scale()))
        if mode != "none":
            env["MT_SANDBOX"] = Sandbox(mode, readable=[str(tree), str(run)], cwd=str(tree)).to_json()
        limit = WORKER_LIMIT * time_scale()
        try:
            r = subprocess.run([sys.executable, "-m", "course.classgrade", "--worker", lesson.number, str(copy), str(out)],
                               cwd=tree, env=env, capture_output=True, text=True, timeout=limit)
            data = json.loads(out.read_text()) if out.exists() else None
            if data is None:
                tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
                data = {"tests": [], "problems": [f"the grader failed (exit code {r.returncode}):\n{tail}"]}
        except subprocess.TimeoutExpired:
            data = {"tests": [], "problems": [f"grading did not finish within {limit:.0f} s"]}
        return LessonResult(lesson, notebook.name, data["tests"], data["problems"], data.get("output", ""))
    finally:
        shutil.rmtree(run, ignore_errors=True)


def worker(lesson_key: str, notebook: str, out: str) -> int:
    """In a grading tree: grade one notebook (course.grade.run_tests) and write the results as JSON."""
    from course.grade import run_tests

    r = run_tests(find_lesson(lesson_key), notebook)
    Path(out).write_text(json.dumps({"tests": r.tests, "problems": r.problems, "output": r.output[-20000:]}))
    return 0


# --- from test results to graded exercises ---------------------------------------------------------

def _other_lesson_stub(test: dict, lesson: Lesson) -> dict:
    """A test that stopped at a stub of another lesson (a window's earlier lesson, the student's own) did
    not find this exercise unattempted: it failed for want of that one."""
    from course.notebook import STUB_MESSAGE

    m = STUB_MESSAGE.search(test.get("message") or "")
    if test.get("outcome") == "stub" and m and m.group(1).split(".")[0] != str(int(lesson.number)):
        other = f"{int(m.group(1).split('.')[0]):02d}"
        return {**test, "outcome": "failed",
                "message": f"needs exercise {m.group(1)} ({m.group(2)}) of lesson {other}, which your lesson {other} "
                           f"notebook has not done yet (this lesson builds on it)"}
    return test


def grade_lesson(lesson: Lesson, result, hidden: set[str], points) -> tuple[list[Graded], str, str]:
    """(graded exercises, the student's scoreboard, the instructor's) of one lesson's LessonResult."""
    from course.grade import LessonResult

    tests = [_other_lesson_stub(t, lesson) for t in result.tests]
    masked = []
    for t in tests:
        if is_hidden(t, hidden):
            t = {**t, "hidden": True}
            if t["outcome"] in ("failed", "stub"):
                masked.append({**t, "name": "hidden case", "message": HIDDEN_MESSAGE, "function": None})
                continue
        masked.append(t)
    # the student reads a visible failure first, where there is one
    masked.sort(key=lambda t: bool(t.get("hidden")))
    full = LessonResult(lesson, result.impl, tests, result.problems, "")
    shown = LessonResult(lesson, result.impl, masked, result.problems, "")
    graded = []
    for ex_full, ex in zip(full.exercises(), shown.exercises()):
        if ex.id == "?":
            continue
        status = CELL[ex.status]
        if result.problems and not ex.tests:
            status = "error"
        score, worth, passed, counted = points.score(lesson.stem, ex.id, ex.status if status != "error" else "failed",
                                                     ex.tests)
        if status == "fail" and passed:
            status = "partial"
        detail = ex.detail if ex.status in ("failed", "skipped") else ""
        if status == "error" and not detail:
            detail = result.problems[0] if result.problems else "no test of this exercise ran"
        graded.append(Graded(lesson.stem, ex.id, ex.name, status, score,
                             worth, passed, counted, sum(t["outcome"] == "skipped" for t in ex.tests), detail,
                             ex_full.detail if ex_full.status in ("failed", "skipped") else detail))
    return graded, board(lesson, graded, result, False), board(lesson, graded, result, True)


def board(lesson: Lesson, graded: list[Graded], result, full: bool) -> str:
    lines = [f"Lesson {lesson.stem}  ({result.impl})"]
    for g in graded:
        tests = f"{g.passed} of {g.counted} tests pass" if g.counted and g.status in ("pass", "partial", "fail") \
            else WORDS[g.status]
        tests += f", {g.skipped} skipped" if g.skipped and g.status != "skip" else ""
        pts = f"{g.score:g}/{g.worth:g} points" if g.worth or g.status != "skip" else "not graded here"
        lines.append(f"  [{SYMBOL[g.status]}] {g.id:<5} {g.title:<28} {tests:<22} {pts}")
        text = g.full if full else g.detail
        if text and g.status not in ("pass",):
            lines.append(textwrap.indent(text, "           "))
    for p in result.problems:
        lines.append(textwrap.indent(p, "  ! "))
    return "\n".join(lines)


def missing_lesson(lesson: Lesson, status: str, message: str, points) -> tuple[list[Graded], str]:
    out = []  # the message once, on the lesson (not under every exercise)
    for ex, title in exercise_titles(lesson).items():
        out.append(Graded(lesson.stem, ex, title, status, worth=points.of(lesson.stem, ex)))
    return out, f"Lesson {lesson.stem}: {message}"


def review(nb, lesson: Lesson) -> list[str]:
    """Code worth an instructor's look (REVIEW) in the cells the student wrote or changed (a cell as the
    lesson generated it is skipped), and an import of this lesson's own module."""
    from course.source import release_index

    index = release_index()
    if index is not None:
        own = [m for m, v in index.get("modules", {}).items() if v["lesson"] == lesson.stem]
        own += [m for m, stem in index.get("withheld", {}).items() if stem == lesson.stem]
    else:
        from course.build import exported_modules

        own = list(exported_modules(lesson))
    rules = list(REVIEW)
    if own:
        names = "|".join(map(re.escape, sorted(set(own))))
        rules.append((rf"(?:from|import)\s+minitorch\.(?:{names})\b|from\s+minitorch\s+import\s+[^\n]*\b(?:{names})\b",
                      f"imports this lesson's own module ({', '.join('minitorch.' + m for m in sorted(set(own)))})"))
    try:
        generated = {"".join(c.get("source", "")) for c in json.loads(lesson.notebook.read_text())["cells"]}
    except (OSError, ValueError, KeyError):
        generated = set()
    found = []
    for i, cell in enumerate((nb.data or {}).get("cells", [])):
        src = "".join(cell.get("source", ""))
        if cell.get("cell_type") != "code" or src in generated:
            continue
        src = re.sub(r"^\s*from course\.check import check\s*$", "", src, flags=re.M)  # every lesson's first cell
        for pattern, why in rules:
            if re.search(pattern, src):
                found.append(f"{nb.name}, cell {i}: {why}")
    return found


# --- one student ---------------------------------------------------------------------------------

def grade_submission(sub, lessons: list[Lesson], trees: dict[str, Path], mode: str, work: Path, points,
                     windows: dict[str, tuple[str, str]]) -> StudentResult:
    res = StudentResult(sub.student)
    res.notes += sub.notes
    t0 = time.monotonic()
    for lesson in lessons:
        status, nb, message = sub.for_lesson(lesson.stem)
        if nb is not None and nb.note:
            res.notes.append(nb.note)
        if status != "ok":
            graded, line = missing_lesson(lesson, status, message, points)
            res.exercises += graded
            res.boards.append(line)
            res.full_boards.append(line)
            if status != "missing":
                res.private.append(message)
            continue
        res.review += review(nb, lesson)
        frm = windows[lesson.stem][0]
        own = {lesson.stem: nb.path}  # the student's notebooks of the window: what course/own.py builds on
        for le in all_lessons():
            if int(frm) <= int(le.number) < int(lesson.number):
                s, other, _ = sub.for_lesson(le.stem)
                if s == "ok":
                    own[le.stem] = other.path
        tree = trees[lesson.stem]
        os.chmod(tree, 0o755)
        try:
            result = run_worker(tree, lesson, nb.path, own, mode, work)
        finally:
            os.chmod(tree, 0o700)
        result.impl = nb.name
        graded, shown, full = grade_lesson(lesson, result, hidden_names(tree, lesson), points)
        res.exercises += graded
        res.boards.append(shown)
        res.full_boards.append(full)
    res.seconds = time.monotonic() - t0
    return res


def apply_late(res: StudentResult, sub, deadline, policy) -> None:
    from course.points import duration

    if sub.submitted is None:
        res.submitted = "unknown"
        if deadline is not None and policy.per:
            res.private.append("no submission time (give --times, or a submission_metadata.json): no late penalty applied")
        return
    res.submitted = sub.submitted.isoformat(timespec="seconds")
    if deadline is None:
        return
    res.late_seconds = max(0.0, (sub.submitted - deadline).total_seconds())
    res.penalty = policy.penalty(res.late_seconds)
    if res.late_seconds > 0:
        res.notes.append(f"submitted {duration(res.late_seconds)} after the deadline ({sub.submitted_from}): "
                         f"{res.penalty:.0%} off ({policy.text})")


def feedback_text(res: StudentResult) -> str:
    head = [f"Student {res.student}"]
    if res.submitted and res.submitted != "unknown":
        head.append(f"Submitted {res.submitted}")
    lines = head + [""]
    for b in res.boards:
        lines += [b, ""]
    lines += res.notes
    total = f"Points: {res.points:g} of {res.maximum:g}"
    if res.penalty:
        total += f"; late penalty {res.penalty:.0%}: score {res.final:g}"
    return "\n".join(lines + ["", total]) + "\n"


def gradescope(res: StudentResult) -> dict:
    """Gradescope's results.json: one test per exercise; a skipped exercise is worth 0 and not failed."""
    tests = []
    for g in res.exercises:
        out = {"name": f"{g.id} {g.title}", "number": g.id, "score": g.score, "max_score": g.worth,
               "visibility": "visible", "tags": [f"lesson {g.lesson[:2]}"]}
        counts = f"{g.passed} of {g.counted} tests pass" if g.counted and g.status in ("pass", "partial", "fail") else ""
        if g.status == "skip":
            out["name"] += " (skipped here)"
            out["output"] = f"skipped: {g.detail}" if g.detail else "skipped"
        else:
            out["status"] = "passed" if g.status == "pass" else "failed"
            out["output"] = "\n".join(x for x in [WORDS[g.status] + (f": {counts}" if counts else ""), g.detail] if x)
        tests.append(out)
    summary = f"{res.points:g} of {res.maximum:g} points"
    if res.penalty:
        summary += f"; {res.penalty:.0%} late penalty: {res.final:g}"
    return {"score": res.final, "execution_time": round(res.seconds, 1), "output": "\n".join([summary, *res.notes]),
            "tests": tests}


def instructor_text(res: StudentResult) -> str:
    lines = [f"Student {res.student}", f"Submitted: {res.submitted or 'unknown'}", ""]
    for b in res.full_boards:
        lines += [b, ""]
    if res.notes or res.private:
        lines += ["Notes:", *(f"  {n}" for n in res.notes + res.private), ""]
    if res.review:
        lines += ["Code worth a look (a pattern, not a verdict):", *(f"  {r}" for r in res.review), ""]
    lines.append(f"Points: {res.points:g} of {res.maximum:g}; penalty {res.penalty:.0%}; score {res.final:g}")
    return "\n".join(lines) + "\n"


# --- the class ------------------------------------------------------------------------------------

def grade_class(submissions: Path, out: Path, lessons: list[Lesson], isolation: str = "auto", frm: str | None = None,
                points_file=None, partial=None, deadline=None, late=None, times=None) -> Path:
    from course.isolation import mode as isolation_mode, readable_by, sandbox_uid, summary
    from course.points import LatePolicy, Points, duration, parse_time
    from course.release import grading_tree
    from course.submissions import discover, read_times, submission_time

    points = Points.load(points_file, partial)
    policy = LatePolicy.parse(late)
    due = parse_time(deadline) if deadline else None
    if policy.per and due is None:
        raise SystemExit("a late rule needs a deadline (--deadline 2026-03-01T23:59+01:00)")
    mode, why_not = isolation_mode(isolation)
    print(summary(mode) + (f" [{why_not}]" if why_not else ""), flush=True)
    subs, notes = discover(submissions, [le.stem for le in lessons])
    stamps = read_times(Path(times)) if times else {}
    for n in notes:
        print(f"note: {n}")
    windows = tree_plan(lessons, frm)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mt-grading-"))
    os.chmod(work, 0o711)  # trees reachable by their path only; each is opened to others while graded in
    try:
        built: dict[tuple[str, str], Path] = {}
        trees = {}
        for le in lessons:
            key = windows[le.stem]
            if key not in built:
                t = time.monotonic()
                built[key] = grading_tree(work / f"tree-{key[0]}-{key[1]}", key[1], key[0], points_file, partial)
                os.chmod(built[key], 0o700)  # opened to the sandbox's user only while its lessons are graded
                print(f"grading tree of lessons ..{key[1]} (answers of {key[0]}..{key[1]} absent): "
                      f"{time.monotonic() - t:.0f} s", flush=True)
            trees[le.stem] = built[key]
        if mode == "uid":
            open_paths = readable_by(sandbox_uid(), [str(ROOT / "solutions"), str(ROOT / "minitorch"),
                                                      str(submissions), str(out)])
            answers = [p for p in open_paths if p.endswith(("solutions", "minitorch"))]
            if answers:
                raise SystemExit(f"isolation uid: uid {sandbox_uid()} could read {answers[0]}: make the checkout "
                                 "unreadable to others (chmod o-rx), or use the container recipe")
            for p in open_paths:
                print(f"note: uid {sandbox_uid()} can read {p} (other students' work or grades): chmod o-rx it")
        rows, results = [], []
        ids = [(le, ex) for le in lessons for ex in exercise_titles(le)]
        for sub in subs:
            submission_time(sub, stamps)
            res = grade_submission(sub, lessons, trees, mode, work, points, windows)
            apply_late(res, sub, due, policy)
            results.append(res)
            write_student(out, res)
            by_id = {(g.lesson, g.id): g for g in res.exercises}
            cells = []
            for le, ex in ids:
                g = by_id.get((le.stem, ex))
                cells += [g.status, f"{g.score:g}"] if g else ["missing", "0"]
            late_text = duration(res.late_seconds) if res.late_seconds else ""
            note = "; ".join(res.notes + res.private
                             + ([f"review: {len(res.review)} (instructor/{res.student}.txt)"] if res.review else []))
            rows.append([res.student, *cells, f"{res.points:g}", f"{res.maximum:g}", res.submitted, late_text,
                         f"{res.penalty:.0%}" if res.penalty else "", f"{res.final:g}", note])
            print(f"{res.student}: {res.points:g} of {res.maximum:g} points"
                  + (f", {res.penalty:.0%} late: {res.final:g}" if res.penalty else ""), flush=True)
        with open(out / "gradebook.csv", "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["student", *(c for _, ex in ids for c in (ex, f"{ex} pts")), "points", "max", "submitted",
                             "late", "penalty", "score", "notes"])
            writer.writerows(rows)
        (out / "grading.json").write_text(json.dumps({
            "lessons": [le.number for le in lessons], "trees": {k: list(v) for k, v in windows.items()},
            "isolation": mode, "isolation_summary": summary(mode), "points": str(points_file or "course/points.toml"),
            "partial": points.partial, "deadline": due.isoformat() if due else None, "late": policy.text,
            "notes": notes, "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out / "gradebook.csv"


def write_student(out: Path, res: StudentResult) -> None:
    for folder in ("feedback", "instructor"):
        (out / folder).mkdir(exist_ok=True)
    (out / "feedback" / f"{res.student}.txt").write_text(feedback_text(res))
    (out / "instructor" / f"{res.student}.txt").write_text(instructor_text(res))
    (out / "gradescope" / res.student).mkdir(parents=True, exist_ok=True)
    (out / "gradescope" / res.student / "results.json").write_text(json.dumps(gradescope(res), indent=1) + "\n")


def selfcheck(keys: list[str], isolation: str = "auto", out: Path | None = None) -> int:
    """Every lesson named (default: all) graded as a class of two, in the sandbox: its solution notebook
    must pass every exercise (or skip it for want of a GPU), its stub notebook be "not attempted" all
    through. What .ci/run calls: the isolation must not break a lesson (MPI, a server on loopback, g++)."""
    from course.build import notebook_text, solution_notebook, student_notebook

    lessons = parse_lessons(keys) if keys else all_lessons()
    with tempfile.TemporaryDirectory(prefix="mt-selfcheck-") as d:
        subs = Path(d) / "submissions"
        for le in lessons:
            for who, nb in (("solution", solution_notebook(le)), ("stubs", student_notebook(le))):
                path = subs / who / "lessons" / le.notebook.name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(notebook_text(nb))
        out = out or Path(d) / "grades"
        grade_class(subs, out, lessons, isolation)
        rows = {r["student"]: r for r in csv.DictReader(open(out / "gradebook.csv"))}
        problems = []
        for le in lessons:
            for ex in exercise_titles(le):
                if rows["solution"][ex] not in ("pass", "skip"):
                    problems.append(f"lesson {le.number}: the solution's {ex} is {rows['solution'][ex]}")
                if rows["stubs"][ex] not in ("todo", "skip"):
                    problems.append(f"lesson {le.number}: the stub's {ex} is {rows['stubs'][ex]}")
        for p in problems:
            print(p)
        if problems:
            print((out / "instructor" / "solution.txt").read_text())
        print(f"class grading of {len(lessons)} lessons in the sandbox: "
              + ("every solution passes, every stub is not attempted" if not problems else f"{len(problems)} problems"))
        return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(*argv[1:4])
    if argv[:1] == ["--check"]:  # python -m course.classgrade --check [NN ...] [--isolation MODE]
        rest = argv[1:]
        mode = rest[rest.index("--isolation") + 1] if "--isolation" in rest else "auto"
        keys = [k for k in rest if k != "--isolation" and k != mode]
        return selfcheck(keys, mode)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("submissions", type=Path)
    ap.add_argument("--lessons", nargs="+", required=True, help="the lessons to grade: 01,02,03 (exactly these)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "grades")
    ap.add_argument("--from", dest="frm", default=None,
                    help="a multi-lesson assignment: the lessons from this one on were released with their answers "
                         "withheld together, and are graded in that release")
    ap.add_argument("--isolation", default="auto", help="auto (the best this machine allows), namespaces, uid, none")
    ap.add_argument("--points", default=None, help="points per exercise merged over course/points.toml")
    ap.add_argument("--partial", default=None, choices=("tests", "all"), help="partial credit by tests passed, or none")
    ap.add_argument("--deadline", default=None, help="ISO 8601, e.g. 2026-03-01T23:59+01:00")
    ap.add_argument("--late", default=None, help="the penalty rule: '10%%/day, max 50%%', '2%%/hour, grace 15m', 'zero'")
    ap.add_argument("--times", default=None, help="a CSV of student,submitted (ISO 8601) submission times")
    args = ap.parse_args(argv)
    if not args.submissions.is_dir():
        ap.error(f"{args.submissions}: not a folder")
    lessons = parse_lessons(args.lessons)
    path = grade_class(args.submissions, args.out, lessons, args.isolation, args.frm, args.points, args.partial,
                       args.deadline, args.late, args.times)
    print(f"wrote {path}, feedback/, instructor/ and gradescope/ beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
