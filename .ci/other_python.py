"""CI on a Python other than the default: the reference tests of every lesson, and lessons 09-11's
solution notebooks executed (MINITORCH_SMALL=1) with every check cell passing. Run it with the
Python under test, from the repository root, in a virtual environment with the course installed:

    build/venv-3.12/bin/python .ci/other_python.py [--reference-only]

--reference-only: the reference tests alone (the Intel-Mac versions' run, which shares Python 3.12
with the full run, so the notebooks' kernel and Python sides are already covered there).

Prints a line per lesson and one summary line `python 3.12.1: ...`; exits 1 if anything failed.
"""

from __future__ import annotations

import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from course.grade import LessonResult, run_tests  # noqa: E402
from course.executor import execute_notebook  # noqa: E402
from course.maintain import BUILD, all_pass, check_cell_problems, serialise_ast_parse  # noqa: E402
from course.source import all_lessons, find_lesson  # noqa: E402

NOTEBOOKS = ("09", "10", "11")


def main() -> int:
    notebooks = () if "--reference-only" in sys.argv[1:] else NOTEBOOKS
    serialise_ast_parse()  # notebooks are built in two threads (python/cpython#106905)
    version = platform.python_version()
    start = time.perf_counter()
    failures, n_tests, n_skipped = [], 0, 0

    def reference(lesson):
        t0 = time.perf_counter()
        return lesson, run_tests(lesson, "reference"), time.perf_counter() - t0

    def notebook(number):
        lesson = find_lesson(number)
        t0 = time.perf_counter()
        ok, message, checks, tests = execute_notebook(lesson, BUILD / f"check-{version}", small=True)
        problems = ([] if ok else [f"solution notebook failed:\n{message}"]) + check_cell_problems(checks, lesson, stub=False)
        problems += all_pass(LessonResult(lesson, "solution", tests, [], ""))
        return lesson, problems, len(tests), time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=2) as pool:
        for lesson, result, t in pool.map(reference, all_lessons()):
            problems = all_pass(result)
            skipped = sum(r["outcome"] == "skipped" for r in result.tests)
            n_tests, n_skipped = n_tests + len(result.tests), n_skipped + skipped
            print(f"   reference {lesson.stem:<20} {'ok' if not problems else 'FAIL':<4} {len(result.tests):>4} tests "
                  f"({skipped} skipped) {t:6.1f} s", flush=True)
            failures += [f"{lesson.stem} reference: {p}" for p in problems]
        t_ref = time.perf_counter() - start
        for lesson, problems, n, t in pool.map(notebook, notebooks):
            print(f"   notebook  {lesson.stem:<20} {'ok' if not problems else 'FAIL':<4} {n:>4} tests {t:6.1f} s", flush=True)
            failures += [f"{lesson.stem} notebook: {p}" for p in problems]
    for f in failures:
        print("      " + f.replace("\n", "\n      "))
    total = time.perf_counter() - start
    print(f"python {version} ({platform.machine()}): {'FAILED' if failures else 'passed'}: "
          f"reference tests of {len(all_lessons())} lessons ({n_tests} tests, {n_skipped} skipped) in {t_ref:.0f} s, "
          + (f"solution notebooks {', '.join(notebooks)} with their check cells; " if notebooks else "")
          + f"{total:.0f} s in all", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
