"""Maintainer commands: `make check` and `make demo`.

    python -m course.maintain check [NN ...]   prove every lesson (or the ones named)
    python -m course.maintain demo NN          execute lesson NN's solution at full size

`check` proves, per lesson: the tests pass on the reference package; each exercise passes with
only its own solution filled in (the grader's loader, as `make test` loads a notebook); every
exercise has tests and a check cell; the solution notebook and the student's stub notebook each
run as JupyterLab's Run All runs them (course.executor: a plain kernel, every cell in order, nothing
rewritten, MINITORCH_SMALL=1) to their last cell with no traceback; the solution's check cells run every test
and pass; the stub's check cells run every test, each failing because of its own exercise's stub,
and report "not attempted"; every `gpu` cell says why it skipped where no GPU works. It also
checks that lessons/ and minitorch/ are in sync with solutions/, runs the machinery's own tests
beside the lessons, and runs the browser test (course.browser) on a lesson of each kind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from course.executor import check_cell_says_what_it_must, execute_notebook
from course.grade import LessonResult, run_tests
from course.source import ROOT, Lesson, all_lessons, find_lesson

BUILD = ROOT / "build"


def check_cell_problems(checks: dict[str, str], lesson: Lesson, stub: bool) -> list[str]:
    """Check cells that do not say what they must: on the solution, that all tests passed (or
    were skipped for want of a GPU); on the stubs, that their own exercise is not attempted."""
    from course.source import exercise_titles

    problems = []
    for ex in exercise_titles(lesson):
        if ex not in checks:
            problems.append(f"exercise {ex} has no check cell `check(\"{ex}\")`")
    for ex, text in checks.items():
        if not check_cell_says_what_it_must(ex, text, stub):
            where, want = ("stub", "not attempted") if stub else ("solution", "all tests passed")
            problems.append(f"the check cell of exercise {ex} in the {where} notebook should say {want}, "
                            f"but says:\n{text[:1200]}")
    return problems


def _stub_problems(result: LessonResult) -> list[str]:
    """Tests that pass on the stubs, or fail only because of another exercise's stub."""
    problems = []
    for t in result.tests:
        ex = t.get("exercise")
        if t["outcome"] == "passed":
            problems.append(f"{t['name']} (exercise {ex}) PASSES on the stub: it cannot fail")
        elif t["outcome"] == "stub":
            m = re.search(r"Exercise (\d+\.\d+)", t["message"])
            if m and m.group(1) != ex:
                problems.append(f"{t['name']} (exercise {ex}) depends on exercise {m.group(1)}'s code")
    return problems


def all_pass(result: LessonResult) -> list[str]:
    problems = list(result.problems)
    for t in result.tests:
        if t["outcome"] not in ("passed", "skipped"):
            problems.append(f"{t['name']}: {t['outcome']}: {t['message']}")
    return problems


def _coverage(result: LessonResult) -> list[str]:
    problems = []
    for ex in result.exercises():
        if not ex.tests:
            problems.append(f"exercise {ex.id} ({ex.title}) has no tests")
        if ex.title == "(not an exercise of this lesson)":
            names = ", ".join(t["name"] for t in ex.tests[:3])
            problems.append(f"tests marked exercise {ex.id!r}, which the lesson does not define: {names}")
    return problems


def _walk_report(lesson: Lesson) -> Path:
    """Where the lesson's reference run writes its validation-walk report (MT_WALK)."""
    return BUILD / "check" / "walk" / f"{lesson.stem}.json"


MACHINERY_WALK = BUILD / "check" / "walk" / "machinery.json"  # the machinery's tests of given code feed the walk too


def _walk_stage(lesson: Lesson, report: Path) -> tuple[float, list[str], int]:
    """The validation walk of the lesson's own modules, from its reference run (course.validation_walk):
    (0 s: it ran inside the reference stage, problems, callables walked)."""
    from course.build import exported_modules
    from course.validation_walk import merge

    if not report.exists():
        return 0.0, [f"the reference run wrote no validation-walk report ({report})"], 0
    data = json.loads(report.read_text())
    problems, _ = merge([data], set(exported_modules(lesson)), coverage=False)
    walked = sum(q.split(".")[0] in exported_modules(lesson) for q in data["walked"])
    return 0.0, problems, walked


def walk_summary(lessons: list[Lesson], machinery: bool) -> int:
    """Every lesson's walk (and the machinery tests') merged: findings once each, and (when every
    lesson and the machinery ran) each public callable of the package that no test called. Prints
    them; returns 1 if there are any."""
    from course.validation_walk import merge

    reports = [_walk_report(le) for le in lessons] + ([MACHINERY_WALK] if machinery else [])
    data = [json.loads(p.read_text()) for p in reports if p.exists()]
    problems, line = merge(data, coverage=machinery and len(lessons) == len(all_lessons()))
    shown = {p for le in lessons for p in _walk_stage(le, _walk_report(le))[1]}
    print(f"\n== validation walk: {line}: {'ok' if not problems else f'{len(problems)} problems'}"
          + (" (those of each lesson's own modules are listed under it)" if shown & set(problems) else ""))
    for p in problems:
        if p not in shown:
            print("   " + p)
    return 1 if problems else 0


def _timed(fn, *args):
    t0 = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - t0


STAGES = ("reference", "isolation", "stub nb", "notebook")  # the order make check queues them in


def start_stage(lesson: Lesson, stage: str, pool: ThreadPoolExecutor):
    """Submit one check of one lesson to `pool`; returns the future of (value, seconds).

    The tests run on the generated package (reference, which also feeds the validation walk), on
    each exercise alone (isolation: every test sees the notebook with only its own exercise solved,
    one process for the lesson), and on the stubs and the solutions through the check cells of the
    two notebooks (as a student's check cell runs them), recorded test by test."""
    if stage == "reference":
        walk_report = _walk_report(lesson)
        walk_report.parent.mkdir(parents=True, exist_ok=True)
        walk_report.unlink(missing_ok=True)
        return pool.submit(_timed, run_tests, lesson, "reference", (), {"MT_WALK": str(walk_report)})
    if stage == "isolation":
        return pool.submit(_timed, run_tests, lesson, "isolated")
    return pool.submit(_timed, execute_notebook, lesson, BUILD / "check", True, stage == "stub nb")


def _isolation_problems(iso: LessonResult, ref: LessonResult) -> tuple[list[str], int]:
    """(problems, exercises checked): an exercise whose tests fail when it alone is solved."""
    problems = [f"isolation run: {p}" for p in iso.problems]
    seen = {}
    for t in iso.tests:
        if t["outcome"] not in ("passed", "skipped") and t.get("exercise") not in seen:
            seen[t.get("exercise")] = t
    for ex_id, t in seen.items():
        problems.append(f"exercise {ex_id} alone does not pass its tests: {t['name']}: {t['message']}")
    with_tests = {t.get("exercise") for t in ref.tests if t.get("exercise")}
    ran = {t.get("exercise") for t in iso.tests}
    problems += [f"exercise {ex} has tests, but none ran in the isolation run" for ex in sorted(with_tests - ran)]
    return problems, len(with_tests)


def finish_lesson(lesson: Lesson, jobs: dict) -> dict:
    """Wait for a lesson's checks ({stage: start_stage's future}); returns {stage: (seconds, problems, count)}."""
    stages: dict[str, tuple[float, list[str], int]] = {}
    ref, t = jobs["reference"].result()
    stages["reference"] = (t, all_pass(ref) + _coverage(ref), len(ref.tests))
    stages["walk"] = _walk_stage(lesson, _walk_report(lesson))
    iso, t = jobs["isolation"].result()
    problems, n = _isolation_problems(iso, ref)
    stages["isolation"] = (t, problems, n)
    for stage, stub in (("notebook", False), ("stub nb", True)):
        (ok, message, checks, tests), t = jobs[stage].result()
        result = LessonResult(lesson, "stub" if stub else "solution", tests, [], "")
        problems = [] if ok else [f"{'stub' if stub else 'solution'} notebook failed:\n{message}"]
        problems += check_cell_problems(checks, lesson, stub=stub)
        problems += _stub_problems(result) if stub else all_pass(result)
        if len(tests) != len(ref.tests):
            problems.append(f"its check cells ran {len(tests)} tests; the lesson has {len(ref.tests)}")
        stages[stage] = (t, problems, len(tests))
    return stages


def serialise_ast_parse() -> None:
    """Make every `ast.parse` in this process take one lock. CPython 3.11's AST constructor is
    not thread-safe ("SystemError: AST constructor recursion depth mismatch", python/cpython#106905),
    and `make check` builds notebooks in two threads while the libraries it uses parse too
    (jupytext's cell metadata goes through `ast.literal_eval`, 3.11's tracebacks through
    `ast.parse`). A lock in our own code alone did not stop it: CI hit it in lesson 12."""
    import ast

    if getattr(ast.parse, "serialised", False):
        return
    lock, parse = threading.RLock(), ast.parse

    def locked_parse(*args, **kwargs):
        with lock:
            return parse(*args, **kwargs)

    locked_parse.serialised, locked_parse.lock = True, lock
    ast.parse = locked_parse


def check(lessons: list[Lesson], machinery: bool = True) -> int:
    serialise_ast_parse()
    start = time.perf_counter()
    failures = 0
    print("== build sync", flush=True)
    failures += subprocess.run([sys.executable, "-m", "course.build", "--check"], cwd=ROOT).returncode != 0
    machinery_run = None
    if machinery:  # one pytest process beside the lessons (two slowed the lessons more than they gained)
        import tempfile

        t_mach = time.perf_counter()
        MACHINERY_WALK.parent.mkdir(parents=True, exist_ok=True)
        MACHINERY_WALK.unlink(missing_ok=True)
        log = tempfile.TemporaryFile("w+")
        machinery_run = (subprocess.Popen([sys.executable, "-m", "pytest", "-q", "--no-header", "--durations=15", "-p",
                                           "no:cacheprovider", "tests/machinery"], cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, env={**os.environ, "MT_WALK": str(MACHINERY_WALK)}),
                         log)
    rows = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        # Every lesson's checks queued at once, a stage for all lessons before the next stage: neither
        # core waits for a lesson's slowest stage, and each kernel cache (lesson 14's generated kernels,
        # the CUDA C emulator's builds) is filled by the reference runs before the notebooks read it.
        print(f"== {len(lessons)} lessons x {len(STAGES)} stages ({', '.join(STAGES)}) queued; each lesson's "
              "results below once its four are done", flush=True)
        started = {lesson.stem: {} for lesson in lessons}
        for stage in STAGES:
            for lesson in lessons:
                started[lesson.stem][stage] = start_stage(lesson, stage, pool)
        for lesson in lessons:  # reported in lesson order
            jobs = started[lesson.stem]
            stages = finish_lesson(lesson, jobs)
            print(f"== lesson {lesson.stem}", flush=True)
            for stage, (t, problems, n) in stages.items():
                status = "ok" if not problems else "FAIL"
                failures += bool(problems)
                unit = {"isolation": "exercises", "walk": "callables"}.get(stage, "tests")
                print(f"   {stage:<10} {status:<4} {n:>3} {unit:<9} {t:6.1f} s")
                for p in problems:
                    print("      " + p.replace("\n", "\n      "))
            rows.append((lesson.stem, stages))
    if machinery:
        failures += browser_check()
    if machinery_run is not None:
        proc, log = machinery_run
        rc = proc.wait()
        log.seek(0)
        print(f"\n== machinery tests ({time.perf_counter() - t_mach:.0f} s, beside the lessons)")
        print(log.read().rstrip())
        failures += rc != 0
    failures += walk_summary(lessons, machinery)
    total = time.perf_counter() - start
    print("\n== summary")
    print(f"{'lesson':<22}{'tests':>6}{'ref':>6}{'walk':>6}{'iso':>6}{'sol nb':>8}{'stub nb':>9}")
    for stem, st in rows:
        cells = ["ok" if not st[s][1] else "FAIL" for s in ("reference", "walk", "isolation", "notebook", "stub nb")]
        print(f"{stem:<22}{st['reference'][2]:>6}{cells[0]:>6}{cells[1]:>6}{cells[2]:>6}{cells[3]:>8}{cells[4]:>9}")
    print(f"make check: {'FAILED' if failures else 'passed'} in {total:.0f} s")
    return 1 if failures else 0


# The browser test in `make check`: a stub notebook of each kind of lesson (CPU, simulated CUDA,
# CUDA C, MPI), and one solution notebook whose progress bars and plots must render.
BROWSER_STUBS = ["01", "07", "08", "12"]
BROWSER_SOLUTION = "03"


def browser_check() -> int:
    """Run course.browser as `make check` does; 1 if it failed (or could not run under CI)."""
    print("\n== browser: Run All in JupyterLab in Chromium", flush=True)
    t0 = time.perf_counter()
    runs = [[*BROWSER_STUBS], ["--solution", BROWSER_SOLUTION, "--expect-plots", "1", "--expect-progress", "1"]]
    failed = 0
    for args in runs:
        rc = subprocess.run([sys.executable, "-m", "course.browser", *args], cwd=ROOT).returncode
        if rc == 2:  # cannot run here (no Chromium or Playwright), and not required: said why
            return 0
        failed += rc != 0
    print(f"   browser test {'FAILED' if failed else 'ok'} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


def demo(lesson: Lesson) -> int:
    out = BUILD / "demo"
    print(f"executing solutions/{lesson.stem}.py at full size -> {out.relative_to(ROOT)}/{lesson.stem}.ipynb")
    ok, message, _, _ = execute_notebook(lesson, out, small=False)
    print("done" if ok else message)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["check", "demo"])
    ap.add_argument("lessons", nargs="*")
    args = ap.parse_args(argv)
    lessons = [find_lesson(k) for k in args.lessons] if args.lessons else all_lessons()
    if args.command == "demo":
        if len(lessons) != 1:
            ap.error("make demo takes one lesson: make demo L=05")
        return demo(lessons[0])
    return check(lessons, machinery=not args.lessons)


if __name__ == "__main__":
    sys.exit(main())
