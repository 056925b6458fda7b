"""`make grade-class SUBMISSIONS=dir [OUT=dir]`: grade a class, one folder per student.

    python -m course.classgrade SUBMISSIONS [--out OUT] [--lessons 01 02]

SUBMISSIONS holds one folder per student (the folder's name is the student) with their lesson
notebooks (`NN_topic.ipynb`, anywhere under the folder: a clone of the release works). Each
notebook is graded in isolation by the grader (`course.grade.run_tests`: child processes, the
grader's time limits, a survey of cells that hang or end the process), so a broken notebook costs
only its own exercises. Graded lessons: --lessons, else every lesson some student handed in.

OUT (default build/grades) receives:
  gradebook.csv              student x exercise: pass / fail / todo (not attempted) / skip (needs a
                             GPU) / missing (no notebook), then score and max
  feedback/STUDENT.txt       the student's scoreboards, as `make test` prints them
  gradescope/STUDENT/results.json   Gradescope's autograder format: one test per exercise
                             (name, number, score, max_score, status, output), and the total score
A skipped exercise has max_score 0 (it cannot be graded here); every other exercise is worth 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

from course.source import ROOT, Lesson, all_lessons, exercise_titles, find_lesson

CELL = {"passed": "pass", "failed": "fail", "not attempted": "todo", "skipped": "skip", "no tests": "fail"}


def students(submissions: Path) -> list[Path]:
    return sorted(p for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))


def notebook_of(folder: Path, lesson: Lesson) -> Path | None:
    found = sorted(p for p in folder.rglob(f"{lesson.stem}.ipynb") if ".ipynb_checkpoints" not in p.parts)
    return found[0] if found else None


def grade_student(folder: Path, lessons: list[Lesson]) -> tuple[dict[str, dict], str]:
    """({exercise id: {status, cell, name, output}}, feedback text) for one student."""
    from course.grade import run_tests, scoreboard

    results, feedback = {}, [f"Student {folder.name}", ""]
    for lesson in lessons:
        path = notebook_of(folder, lesson)
        if path is None:
            for ex, title in exercise_titles(lesson).items():
                results[ex] = {"status": "missing", "cell": "missing", "name": title,
                               "output": f"no notebook {lesson.stem}.ipynb in the submission"}
            feedback += [f"Lesson {lesson.stem}: no notebook {lesson.stem}.ipynb handed in", ""]
            continue
        result = run_tests(lesson, str(path.resolve()))
        for ex in result.exercises():
            if ex.id == "?":
                continue
            results[ex.id] = {"status": ex.status, "cell": CELL[ex.status], "name": ex.title,
                              "output": f"{ex.status}" + (f": {ex.detail}" if ex.detail else "")}
        board = scoreboard(result, f"{path.relative_to(folder)}")
        feedback += [board, ""]
        if result.problems:  # a problem of the whole lesson (its tests could not load): no pass is safe
            for ex in exercise_titles(lesson):
                results.setdefault(ex, {"status": "failed", "cell": "fail", "name": ex, "output": result.problems[0]})
    return results, "\n".join(feedback)


def gradescope(results: dict[str, dict], seconds: float) -> dict:
    tests = []
    for ex, r in results.items():
        maximum = 0 if r["status"] == "skipped" else 1
        tests.append({"name": f"{ex} {r['name']}", "number": ex, "score": int(r["status"] == "passed"),
                      "max_score": maximum, "status": "passed" if r["status"] == "passed" else "failed",
                      "output": r["output"], "visibility": "visible"})
    return {"score": sum(t["score"] for t in tests), "execution_time": round(seconds, 1), "tests": tests,
            "output": f"{sum(t['score'] for t in tests)} of {sum(t['max_score'] for t in tests)} exercises pass"}


def grade_class(submissions: Path, out: Path, lessons: list[Lesson] | None = None) -> Path:
    folders = students(submissions)
    if lessons is None:
        lessons = [le for le in all_lessons() if any(notebook_of(f, le) for f in folders)]
    ids = [ex for le in lessons for ex in exercise_titles(le)]
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for folder in folders:
        t0 = time.monotonic()
        results, feedback = grade_student(folder, lessons)
        report = gradescope({ex: results[ex] for ex in ids if ex in results}, time.monotonic() - t0)
        maximum = sum(t["max_score"] for t in report["tests"])
        (out / "feedback").mkdir(exist_ok=True)
        (out / "feedback" / f"{folder.name}.txt").write_text(
            feedback + f"\nScore: {report['score']} of {maximum} exercises\n")
        (out / "gradescope" / folder.name).mkdir(parents=True, exist_ok=True)
        (out / "gradescope" / folder.name / "results.json").write_text(json.dumps(report, indent=1) + "\n")
        rows.append([folder.name, *(results.get(ex, {"cell": "missing"})["cell"] for ex in ids),
                     report["score"], maximum])
        print(f"{folder.name}: {report['score']} of {maximum}", flush=True)
    with open(out / "gradebook.csv", "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["student", *ids, "score", "max"])
        writer.writerows(rows)
    return out / "gradebook.csv"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("submissions", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "grades")
    ap.add_argument("--lessons", nargs="*", default=None, help="lesson numbers (default: those handed in)")
    args = ap.parse_args(argv)
    if not args.submissions.is_dir():
        ap.error(f"{args.submissions}: not a folder")
    lessons = [find_lesson(k) for k in args.lessons] if args.lessons else None
    path = grade_class(args.submissions, args.out, lessons)
    print(f"wrote {path}, feedback/ and gradescope/ beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
