"""Grade a lesson: run its tests on one implementation in a child process, survive anything.

    python -m course.grade            # make test: every saved lesson notebook
    python -m course.grade 05         # make test L=05

Each lesson runs in its own pytest process (with a per-test time limit). If that process dies
(os._exit, a segfault, a hang past the limit), the test it was running is reported as such and
the remaining tests run in a fresh process. Student files are only read, never written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from course.source import ROOT, Lesson, all_lessons, find_lesson

LESSON_TIME_LIMIT = 900  # seconds for one lesson's whole test process


@dataclass
class Exercise:
    id: str
    title: str
    tests: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str:
        outcomes = [t["outcome"] for t in self.tests]
        if not outcomes:
            return "no tests"
        if "failed" in outcomes:
            return "failed"
        if "stub" in outcomes:
            return "not attempted" if all(o in ("stub", "skipped") for o in outcomes) and "passed" not in outcomes else "failed"
        if all(o == "skipped" for o in outcomes):
            return "skipped"
        return "passed"

    @property
    def detail(self) -> str:
        status = self.status
        for t in self.tests:
            if status == "failed" and t["outcome"] in ("failed", "stub"):
                return f"{t['name']}: {t['message']}"
            if status == "skipped" and t["outcome"] == "skipped":
                return t["message"]
        n = len(self.tests)
        skipped = sum(t["outcome"] == "skipped" for t in self.tests)
        if status == "passed":
            return f"{n - skipped} test{'s' * (n - skipped != 1)}" + (f", {skipped} skipped (needs a GPU)" if skipped else "")
        return ""


@dataclass
class LessonResult:
    lesson: Lesson
    impl: str
    tests: list[dict]
    problems: list[str]  # collection errors, crashes of the whole process
    output: str

    def exercises(self) -> list[Exercise]:
        from course.loader import exercise_titles

        found = {k: Exercise(k, v) for k, v in exercise_titles(self.lesson).items()}
        for t in self.tests:
            ex = t.get("exercise") or "?"
            found.setdefault(ex, Exercise(ex, "(not an exercise of this lesson)")).tests.append(t)
        return list(found.values())


def run_tests(lesson: Lesson, impl: str, extra: list[str] = (), env: dict | None = None) -> LessonResult:
    """Run lesson's tests on `impl` in child processes until every test has a result."""
    done: dict[str, dict] = {}
    problems: list[str] = []
    outputs: list[str] = []
    for _attempt in range(50):
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as f:
            results_path = f.name
        cmd = [sys.executable, "-m", "pytest", str(lesson.tests), f"--impl={impl}", "-q", "-rN",
               "--no-header", "-p", "no:cacheprovider", "--timeout-method=thread", *extra]
        cmd += [f"--deselect={nodeid}" for nodeid in done]
        # One BLAS thread: tests check correctness, and on a busy 2-core machine OpenBLAS's
        # threads can make small matmuls 100x slower. Speed is measured by `make bench`.
        child_env = {"OPENBLAS_NUM_THREADS": "1", **os.environ, **(env or {}),
                     "MT_RESULTS": results_path, "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=child_env, capture_output=True, text=True,
                                  timeout=LESSON_TIME_LIMIT, stdin=subprocess.DEVNULL)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        outputs.append(out)
        records = [json.loads(line) for line in Path(results_path).read_text().splitlines() if line.strip()]
        os.unlink(results_path)
        running = None
        for rec in records:
            if rec["event"] == "start":
                running = rec["test"]
            elif rec["event"] == "end":
                done[rec["test"]] = rec
                running = None
            elif rec["event"] == "collect_error":
                problems.append(f"could not load the tests: {rec['message']}")
        if running is None:
            if rc not in (0, 1, 5) and not problems:
                tail = "\n".join(out.strip().splitlines()[-5:])
                problems.append(f"the test process ended with exit code {rc}:\n{tail}")
            break
        why = "ran past the time limit" if ("Timeout" in out or rc == "timeout") else f"killed the test process (exit code {rc})"
        name = running.split("::")[-1]
        done[running] = {"test": running, "name": name, "exercise": _exercise_from_source(lesson, name),
                         "outcome": "failed", "message": f"this test {why}: an infinite loop, os._exit or a crash?"}
    return LessonResult(lesson, impl, list(done.values()), problems, "\n".join(outputs))


def _exercise_from_source(lesson: Lesson, test_name: str) -> str | None:
    """The exercise marker of a test, read from the test file (for a test whose process died)."""
    import re

    base = test_name.split("[")[0]
    text = lesson.tests.read_text()
    m = re.search(rf'@pytest\.mark\.exercise\("([\d.]+)"\)(?:\s*\n\s*@[^\n]*)*\s*\n\s*def {re.escape(base)}\(', text)
    return m.group(1) if m else None


SYMBOL = {"passed": "PASS", "failed": "FAIL", "not attempted": "todo", "skipped": "skip", "no tests": "????"}


def scoreboard(result: LessonResult, where: str) -> str:
    lines = [f"Lesson {result.lesson.stem}  ({where})"]
    for ex in result.exercises():
        head = f"  [{SYMBOL[ex.status]}] {ex.id:<5} {ex.title:<28} {ex.status}"
        detail = ex.detail
        if ex.status in ("failed", "skipped") and detail:
            lines.append(head)
            lines.append(textwrap.indent(detail, "           "))
        else:
            lines.append(head + (f" ({detail})" if detail else ""))
    for p in result.problems:
        lines.append(textwrap.indent(p, "  ! "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Grade the saved lesson notebooks.")
    ap.add_argument("lessons", nargs="*", help="lesson numbers (default: all)")
    args = ap.parse_args(argv)
    lessons = [find_lesson(k) for k in args.lessons] if args.lessons else all_lessons()
    totals: dict[str, int] = {}
    for lesson in lessons:
        if not lesson.notebook.exists():
            print(f"Lesson {lesson.stem}: no notebook at {lesson.notebook.relative_to(ROOT)} (run `make build`)\n")
            totals["missing"] = totals.get("missing", 0) + 1
            continue
        result = run_tests(lesson, str(lesson.notebook))
        print(scoreboard(result, f"your notebook lessons/{lesson.notebook.name}"), flush=True)
        print()
        for ex in result.exercises():
            totals[ex.status] = totals.get(ex.status, 0) + 1
        if result.problems:
            totals["problems"] = totals.get("problems", 0) + 1
    order = ["passed", "failed", "not attempted", "skipped", "no tests", "problems", "missing"]
    print("Total: " + ", ".join(f"{totals[k]} {k}" for k in order if totals.get(k)))
    bad = sum(totals.get(k, 0) for k in ("failed", "not attempted", "no tests", "problems", "missing"))
    if bad:
        print("Not done yet: every exercise must pass (skipped ones need a GPU).")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
