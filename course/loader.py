"""Load one implementation of a lesson as a namespace the tests grade: the seam.

    reference   the generated package (minitorch.<modules the lesson exports>)
    solution    the cells of solutions/NN_topic.py, run in a fresh module
    stub        the student notebook as `make build` generates it (in memory)
    only:L.K    that notebook with exercise L.K solved and the others stubbed
    isolated    each test sees `only:` its own exercise (make check's isolation stage, one process
                for a lesson: `Isolated`)
    <path>      a notebook: the student's saved work

Loading runs the code cells that are not tagged demo/gpu/check, one at a time, each under a
time limit. A cell that raises (syntax error, NameError, sys.exit, a hang) is recorded and
loading goes on, so one broken cell costs only the exercises that need what it defines.

A cell that ends the process (os._exit, a crash) or hangs where a signal cannot interrupt it
(inside compiled code) cannot be survived in-process: before grading a notebook, the grader
runs `survey` in a child process, which loads the cells one by one and reports each cell's
fate; such cells are then skipped in every test process (MT_SKIP_CELLS) and reported.
"""

from __future__ import annotations

import importlib
import json
import linecache
import os
import signal
import sys
import threading
import traceback
import types
from contextlib import contextmanager
from pathlib import Path


from course.source import Lesson, loadable_code, read_source

CELL_TIME_LIMIT = float(os.environ.get("MT_CELL_TIME_LIMIT", 20))  # seconds a cell may run while loading (x MT_TIME_SCALE)
LIVE: dict = {}  # lesson number -> namespace of a running notebook (set by course.check)


class LessonNamespace:
    """Attribute access to a lesson's names, with a clear error for a missing one."""

    def __init__(self, lesson: Lesson, impl: str, names: dict, errors: list[str]):
        self._lesson, self._impl, self._names, self._errors = lesson, impl, names, errors

    def __getattr__(self, name: str):
        try:
            return self._names[name]
        except KeyError:
            pass
        msg = f"lesson {self._lesson.number} ({self._impl}) defines no `{name}`: was it renamed or deleted?"
        if self._errors:
            msg += " Cells that failed while loading:\n" + "\n".join(self._errors)
        raise AttributeError(msg) from None

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __repr__(self) -> str:
        return f"<lesson {self._lesson.stem} ({self._impl})>"

    @property
    def load_errors(self) -> list[str]:
        return list(self._errors)

    @property
    def namespace(self) -> LessonNamespace:
        """The namespace a test sees now: itself (an `Isolated` lesson answers its current exercise's)."""
        return self


class Isolated:
    """A lesson whose every test sees the notebook with only its own exercise solved: attribute
    access goes to `only:<exercise>` of the test that is running (`Isolated.exercise`, set by the
    tests' conftest before each test). Each exercise's namespace is loaded once, in a module of its
    own name, so the isolation of a whole lesson runs in one process instead of one per exercise."""

    exercise: str | None = None

    def __init__(self, lesson: Lesson):
        self._lesson = lesson
        self._loaded: dict[str, LessonNamespace] = {}

    @property
    def namespace(self) -> LessonNamespace:
        ex = Isolated.exercise
        if ex is None:
            raise RuntimeError(f"lesson {self._lesson.number} (isolated) is used outside a test of an exercise")
        if ex not in self._loaded:
            self._loaded[ex] = load(self._lesson, f"only:{ex}")
        return self._loaded[ex]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.namespace, name)

    def __contains__(self, name: str) -> bool:
        return name in self.namespace

    def __repr__(self) -> str:
        return f"<lesson {self._lesson.stem} (isolated, now only:{Isolated.exercise})>"


class CellTimeout(Exception):
    pass


def cell_time_limit() -> float:
    """Seconds one cell may run while a notebook loads, scaled by the machine's slowness."""
    from course.timing import time_scale

    return round(CELL_TIME_LIMIT * time_scale(), 1)


@contextmanager
def time_limit(seconds: float):
    """Raise CellTimeout in the main thread after `seconds` (no-op off the main thread).

    Nests inside another SIGALRM timer (pytest-timeout's): the outer timer is re-armed with
    what is left of it, and fires at once if it expired meanwhile."""
    import time

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise CellTimeout(f"ran longer than {seconds:g} s (an infinite loop at the top level of a cell?)")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    if outer and outer < seconds:  # the outer limit comes first: keep it
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        signal.setitimer(signal.ITIMER_REAL, outer)
        yield
        return
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 1e-3))


def skipped_cells() -> dict[int, str]:
    """{cell index: why} for the cells the grader's survey found unsafe to run (MT_SKIP_CELLS)."""
    return {int(k): v for k, v in json.loads(os.environ.get("MT_SKIP_CELLS") or "{}").items()}


def run_cells(cells: list[tuple[int, str]], module_name: str, label: str,
              progress=None) -> tuple[dict, list[str]]:
    """Run code cells in a fresh module registered in sys.modules; return (names, errors).

    progress(event, index, error) is called before and after each cell (the survey's report)."""
    module = types.ModuleType(module_name)
    module.__file__ = f"<{label}>"
    sys.modules[module_name] = module  # dataclasses, pickling and numba look modules up here
    errors = []
    skip = skipped_cells()
    limit = cell_time_limit()
    for index, source in cells:
        where = f"{label}, cell {index}"
        if index in skip:
            errors.append(f"  {where}: not run: {skip[index]}")
            continue
        if progress:
            progress("start", index, None)
        # the cell's source, for tracebacks and course.feedback ("raised in your code: ..., line 3")
        linecache.cache[where] = (len(source), None, source.splitlines(keepends=True), where)
        try:
            code = compile(source, where, "exec")
            with time_limit(limit):
                exec(code, module.__dict__)
        except BaseException as exc:  # noqa: BLE001 - student code may raise anything, incl. SystemExit
            if isinstance(exc, KeyboardInterrupt):
                raise
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            errors.append(f"  {where}: {last}")
            if progress:
                progress("end", index, last)
            continue
        if progress:
            progress("end", index, None)
    return module.__dict__, errors


def load_reference(lesson: Lesson) -> LessonNamespace:
    from course.build import exported_modules

    names: dict = {}
    for module in exported_modules(lesson):
        mod = importlib.import_module(f"minitorch.{module}")
        names.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
    return LessonNamespace(lesson, "reference", names, [])


def notebook_of(lesson: Lesson, impl: str):
    """(notebook, label, generated?) for an implementation other than the reference."""
    if impl == "solution":
        nb, label = read_source(lesson), f"solutions/{lesson.stem}.py"
    elif impl == "stub" or impl.startswith("only:"):
        from course.build import student_notebook

        solved = frozenset(impl.removeprefix("only:").split(",")) if impl != "stub" else frozenset()
        nb, label = student_notebook(lesson, solved=solved), f"{impl} of {lesson.stem}"
    else:
        path = Path(impl)
        from course.percent import from_dict

        nb, label = from_dict(json.loads(path.read_text())), path.name  # no nbformat: its import costs seconds
        for cell in nb.cells:
            if isinstance(cell.get("source"), list):  # the .ipynb format allows a list of lines
                cell["source"] = "".join(cell["source"])
    return nb, label, impl in ("solution", "stub") or impl.startswith("only:")


def load(lesson: Lesson, impl: str) -> LessonNamespace:
    """Load `impl` ('reference', 'solution', 'stub' or a notebook path) of `lesson`."""
    if impl == "reference":
        return load_reference(lesson)
    nb, label, generated = notebook_of(lesson, impl)
    module_name = f"lesson{lesson.number}_{'generated' if generated else 'notebook'}"
    if impl.startswith("only:"):  # several may live in one process (Isolated): a module each
        module_name = f"lesson{lesson.number}_only_" + "".join(c if c.isalnum() else "_" for c in impl[5:])
    names, errors = run_cells(loadable_code(nb), module_name, label)
    return LessonNamespace(lesson, impl if generated else "your notebook", names, errors)


def survey(lesson: Lesson, impl: str, report: str) -> None:
    """Load `impl` cell by cell, appending {"event", "cell", "error"} JSON lines to `report`
    (flushed at once, so a parent sees which cell was running if this process dies)."""
    nb, label, generated = notebook_of(lesson, impl)

    def progress(event: str, index: int, error: str | None) -> None:
        with open(report, "a") as f:
            f.write(json.dumps({"event": event, "cell": index, "error": error}) + "\n")

    run_cells(loadable_code(nb), f"lesson{lesson.number}_survey", label, progress)
    progress("finished", -1, None)


def from_globals(lesson: Lesson, names: dict) -> LessonNamespace:
    """The live namespace of a running notebook (the check cell's view)."""
    return LessonNamespace(lesson, "this notebook", names, [])


if __name__ == "__main__":  # python -m course.loader survey LESSON IMPL REPORT (used by course.grade)
    from course.source import find_lesson

    _, lesson_key, impl_arg, report_path = sys.argv[1:5]
    survey(find_lesson(lesson_key), impl_arg, report_path)
