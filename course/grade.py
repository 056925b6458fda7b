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
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field

from course import process
from course.feedback import PYTEST_ARGS
from course.process import LESSON_TIME_LIMIT  # seconds for one lesson's whole test process
from course.source import ROOT, Lesson, all_lessons, find_lesson


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
    def name(self) -> str:
        """The function a failure came from (an exercise may have several), else the title."""
        if self.status == "failed":
            bad = [t for t in self.tests if t["outcome"] in ("failed", "stub")]
            if bad and bad[0].get("function"):
                return bad[0]["function"]
        return self.title

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
            reasons = dict.fromkeys(_skip_reason(t["message"]) for t in self.tests if t["outcome"] == "skipped")
            return f"{n - skipped} test{'s' * (n - skipped != 1)}" + (
                f", {skipped} skipped ({'; '.join(reasons)})" if skipped else "")
        return ""


def _skip_reason(message: str) -> str:
    """A skipped test's reason in one short line ('needs a CUDA GPU: no driver', 'needs Chromium')."""
    line = (message or "no reason given").strip().splitlines()[0].removeprefix("Skipped: ")
    return line if len(line) <= 90 else line[:87] + "..."


@dataclass
class LessonResult:
    lesson: Lesson
    impl: str
    tests: list[dict]
    problems: list[str]  # collection errors, crashes of the whole process
    output: str

    def exercises(self) -> list[Exercise]:
        from course.source import exercise_titles

        found = {k: Exercise(k, v) for k, v in exercise_titles(self.lesson).items()}
        for t in self.tests:
            ex = t.get("exercise") or "?"
            found.setdefault(ex, Exercise(ex, "(not an exercise of this lesson)")).tests.append(t)
        return list(found.values())


def survey(lesson: Lesson, impl: str) -> dict[int, str]:
    """{cell index: why} for the cells of a notebook that end the process or hang when loaded.

    Loads the notebook cell by cell in a child process; a cell that kills it, or outlives the
    per-cell limit (even inside compiled code, where no signal reaches), is recorded and the
    survey starts again without it."""
    from course.loader import cell_time_limit

    env = process.child_env()
    limit = cell_time_limit()
    bad: dict[int, str] = {}
    for _attempt in range(100):
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as f:
            report = f.name
        cmd = [sys.executable, "-m", "course.loader", "survey", lesson.number, impl, report]
        rc, out = process.watch(cmd, {**env, "MT_SKIP_CELLS": json.dumps(bad)}, report, lambda rec: limit + 5)
        records = process.read_jsonl(report)
        os.unlink(report)
        for rec in records:  # a cell the in-process limit stopped: skip it too, it would cost that again
            if rec["event"] == "end" and "CellTimeout" in (rec["error"] or ""):
                bad[rec["cell"]] = rec["error"].split(": ", 1)[-1] + "; it was skipped"
        if any(r["event"] == "finished" for r in records):
            break
        running = None
        for rec in records:
            running = rec["cell"] if rec["event"] == "start" else None
        if running is None:  # died outside any cell (an import of the machinery failed)
            break
        bad[running] = (f"ran longer than {limit:g} s while the notebook was loaded (an infinite loop at the top "
                        "level of the cell?); it was skipped" if rc == "timeout" else
                        f"ended the whole process while the notebook was loaded (exit code {rc}: os._exit, "
                        "a crash?); it was skipped")
    return bad


def _exercise_at(lesson: Lesson, impl: str, cell: int) -> str | None:
    """The exercise a notebook cell belongs to: by the cell's id in the lesson as generated (the
    student may have replaced its source), else what the cell itself says (the `minitorch.exercise`
    metadata the build writes, which a copied cell keeps, or a directive), else the first exercise
    after it (by id or by what it says)."""
    from course.loader import notebook_of
    from course.source import cell_exercise, release_index

    nb, _, _ = notebook_of(lesson, impl)
    index = release_index()
    if index is not None:
        by_id = index["lessons"][lesson.stem]["cells"]
    else:
        from course.build import exercise_cells

        by_id = exercise_cells(lesson)
    ids = cell_ids(lesson, nb.cells)
    if by_id.get(ids[cell]):
        return by_id[ids[cell]]
    after = [by_id.get(i) or cell_exercise(c) for i, c in zip(ids[cell:], nb.cells[cell:])]
    return next((ex for ex in after if ex), None)


def cell_ids(lesson: Lesson, cells) -> list[str | None]:
    """Each cell's id. A notebook saved without ids (Colab saves nbformat 4.0-4.4) gets the ids of the
    generated notebook's cells it lines up with: cells that open alike are matched (difflib), and a cell
    the student rewrote, between two matched ones, stands where the generated cell stood."""
    import difflib

    ids = [c.get("id") for c in cells]
    if all(ids):
        return ids
    try:
        generated = json.loads(lesson.notebook.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        from course.build import student_notebook

        generated = student_notebook(lesson).cells

    def key(c):
        src = c.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        first = next((ln.strip() for ln in src.splitlines() if ln.strip()), "")
        return f"{c.get('cell_type')}: {first}"

    theirs, ours = [key(c) for c in cells], [key(c) for c in generated]
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, theirs, ours, autojunk=False).get_opcodes():
        if op == "equal" or (op == "replace" and i2 - i1 == j2 - j1):
            for k in range(i2 - i1):
                ids[i1 + k] = ids[i1 + k] or generated[j1 + k].get("id")
    return ids


def run_tests(lesson: Lesson, impl: str, extra: list[str] = (), env: dict | None = None) -> LessonResult:
    """Run lesson's tests on `impl` in child processes until every test has a result.

    A notebook (a student's work) is first surveyed: cells that end the process or hang while
    it loads are skipped everywhere and fail the exercise they belong to (or precede). A test
    that kills its process, or outlives its time limit where pytest-timeout cannot stop it, is
    recorded as failed, the other tests of its exercise are failed without being run (each
    would cost the same again), and the rest run in a fresh process."""
    done: dict[str, dict] = {}
    problems: list[str] = []
    outputs: list[str] = []
    collected: dict[str, dict] = {}
    generated = impl in ("reference", "solution", "stub", "isolated") or impl.startswith("only:")
    skip_cells = {} if generated else survey(lesson, impl)
    for cell, why in skip_cells.items():
        name = f"loading cell {cell}"
        done[name] = {"test": name, "name": name, "exercise": _exercise_at(lesson, impl, cell),
                      "outcome": "failed", "message": f"cell {cell} of the notebook {why}"}
    child_env = process.child_env({**(env or {}), "MT_SKIP_CELLS": json.dumps(skip_cells)})
    while True:
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as f:
            results_path = f.name
        cmd = [sys.executable, "-m", "pytest", str(lesson.tests), f"--impl={impl}", "-q", "-rN",
               "--no-header", "-p", "no:cacheprovider", "--timeout-method=signal", "--tb=line", *PYTEST_ARGS, *extra]
        cmd += [f"--deselect={nodeid}" for nodeid in done if "::" in nodeid]
        # pytest-timeout's signal stops a test in Python code; the watchdog kills one stuck in
        # compiled code, with some grace so pytest-timeout's clearer report comes first.
        rc, out = process.watch(cmd, {**child_env, "MT_RESULTS": results_path}, results_path,
                         lambda rec: (rec.get("limit") or LESSON_TIME_LIMIT) * 1.5 + 10)
        outputs.append(out)
        records = process.read_jsonl(results_path)
        os.unlink(results_path)
        running = None
        for rec in records:
            if rec["event"] == "collected":
                collected.update({t["test"]: t for t in rec["tests"]})
            elif rec["event"] == "start":
                running = rec
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
        from course.timing import load_note

        why = (f"ran past its time limit ({running.get('limit') or LESSON_TIME_LIMIT:g} s) and could not be "
               "interrupted (a loop in compiled code?)." + load_note()) if rc == "timeout" else \
              f"killed the test process (exit code {rc}): an os._exit, sys.exit in a thread, or a crash?"
        ex = running.get("exercise")
        done[running["test"]] = {"test": running["test"], "name": running["name"], "exercise": ex,
                                 "outcome": "failed", "message": f"this test {why}"}
        for nodeid, t in collected.items():
            if nodeid not in done and ex is not None and t["exercise"] == ex:
                done[nodeid] = {**t, "outcome": "failed",
                                "message": f"not run: {running['name']} of this exercise {why.split(':')[0]}"}
    return LessonResult(lesson, impl, list(done.values()), problems, "\n".join(outputs))


SYMBOL = {"passed": "PASS", "failed": "FAIL", "not attempted": "todo", "skipped": "skip", "no tests": "????"}


def scoreboard(result: LessonResult, where: str) -> str:
    lines = [f"Lesson {result.lesson.stem}  ({where})"]
    for ex in result.exercises():
        head = f"  [{SYMBOL[ex.status]}] {ex.id:<5} {ex.name:<28} {ex.status}"
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
        from course.submissions import read_notebook

        _, unreadable = read_notebook(lesson.notebook)
        if unreadable:  # one line, not the same JSON error under every exercise
            print(f"Lesson {lesson.stem}: lessons/{lesson.notebook.name} is not a readable notebook ({unreadable}). "
                  "Restore it from a checkpoint (File > Revert Notebook to Checkpoint) or from git.\n")
            totals["unreadable"] = totals.get("unreadable", 0) + 1
            continue
        result = run_tests(lesson, str(lesson.notebook))
        print(scoreboard(result, f"your notebook lessons/{lesson.notebook.name}"), flush=True)
        print()
        for ex in result.exercises():
            totals[ex.status] = totals.get(ex.status, 0) + 1
        if result.problems:
            totals["problems"] = totals.get("problems", 0) + 1
    order = ["passed", "failed", "not attempted", "skipped", "no tests", "problems", "missing", "unreadable"]
    print("Total: " + ", ".join(f"{totals[k]} {k}" for k in order if totals.get(k)))
    bad = sum(totals.get(k, 0) for k in ("failed", "not attempted", "no tests", "problems", "missing", "unreadable"))
    if bad:
        print("Not done yet: every exercise must pass (skipped ones need a GPU).")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
