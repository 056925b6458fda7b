"""One lesson of a student's repository, graded for GitHub Classroom's autograding reporter.

    python -m course.classroom NN --submission ../submission [--output FILE]

Run by the class repository's workflow (`.github/workflows/classroom.yml`, written by course/release.py)
from the instructor's grading repository (this tree: every test, hidden ones included, and the
points), never from the student's copy of the tests. It grades `lessons/NN_topic.ipynb` of the
student's checkout as `make grade-class` does (isolated: course/isolation.py; points and partial
credit: course/points.toml; a hidden case shows only that it failed), prints the student's scoreboard
to the log, and appends the step's output `result` to $GITHUB_OUTPUT: base64 of the JSON that
classroom-resources/autograding-grading-reporter@v1 reads (src/main.js decodes the variable
`<STEP ID>_RESULTS`; src/notify-classroom.js posts the sum of the tests' `score` over the sum of the
runners' `max_score`):

    {"version": 1, "status": "pass" | "fail" | "error", "max_score": <the lesson's points>,
     "tests": [{"name": "3.2 init_std", "status": "pass" | "fail", "score": <points earned>,
                "message": ..., "test_code": "", "filename": "", "line_no": 0, "duration": 0}, ...]}

One test per exercise. An exercise that needs a GPU is left out (worth nothing on a runner without
one). The reporter's own console table counts passed tests, not points: the grade Classroom records
is the notice "Autograding report" {"totalPoints", "maxPoints"}, the sum of the scores.
It exits 0 even when the lesson fails, so that the reporter step runs; a failure of the grader itself
is a runner with status "error".
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path


def result(res, lesson) -> dict:
    """The reporter's JSON for one lesson of a graded student (course.classgrade.StudentResult)."""
    tests = []
    for g in res.exercises:
        if g.lesson != lesson.stem or g.status == "skip":
            continue
        tests.append({"name": f"{g.id} {g.title}", "status": "pass" if g.status == "pass" else "fail",
                      "score": g.score, "message": g.detail[:2000] if g.detail else g.status,
                      "test_code": "", "filename": "", "line_no": 0, "duration": 0})
    status = "pass" if all(t["status"] == "pass" for t in tests) else "fail"
    return {"version": 1, "status": status, "max_score": round(sum(g.worth for g in res.exercises
                                                                    if g.lesson == lesson.stem), 2), "tests": tests}


def error_result(message: str) -> dict:
    return {"version": 1, "status": "error", "max_score": 0,
            "tests": [{"name": "grading", "status": "error", "score": 0, "message": message, "test_code": "",
                       "filename": "", "line_no": 0, "duration": 0}]}


def encode(data: dict) -> str:
    return base64.b64encode(json.dumps(data).encode()).decode()


def grade(key: str, submission: Path, isolation: str = "auto"):
    from course.classgrade import grade_submission
    from course.isolation import mode as isolation_mode, summary
    from course.points import Points
    from course.source import ROOT, all_lessons, find_lesson, release_index
    from course.submissions import student_submission

    lesson = find_lesson(key)
    index = release_index() or {}
    frm, upto = index.get("from", lesson.number), index.get("upto", lesson.number)
    window = (frm, upto) if int(lesson.number) >= int(frm) else (lesson.number, lesson.number)
    sub = student_submission(submission.name or "submission", submission, [le.stem for le in all_lessons()])
    mode, note = isolation_mode(isolation)
    print(summary(mode) + (f" [{note}]" if note else ""), flush=True)
    work = Path(tempfile.mkdtemp(prefix="mt-grading-"))
    os.chmod(work, 0o711)
    try:
        return lesson, grade_submission(sub, [lesson], {lesson.stem: ROOT}, mode, work, Points.load(),
                                        {lesson.stem: window})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lesson")
    ap.add_argument("--submission", type=Path, required=True, help="the student's checkout")
    ap.add_argument("--output", default=os.environ.get("GITHUB_OUTPUT"), help="where `result=...` goes "
                                                                           "(default: $GITHUB_OUTPUT)")
    ap.add_argument("--isolation", default="auto")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        lesson, res = grade(args.lesson, args.submission.resolve(), args.isolation)
        data = result(res, lesson)
        print("\n".join(res.boards))
        print(f"\nLesson {lesson.number}: {sum(t['score'] for t in data['tests']):g} of {data['max_score']:g} points "
              f"({time.monotonic() - t0:.0f} s)")
    except BaseException as exc:  # noqa: BLE001 - the reporter must get a result whatever happened
        traceback.print_exc()
        data = error_result(f"the grader failed: {type(exc).__name__}: {str(exc)[:500]}")
    if args.output:
        with open(args.output, "a") as f:
            f.write(f"result={encode(data)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
