"""Load one implementation of a lesson as a namespace the tests grade: the seam.

    reference   the generated package (minitorch.<modules the lesson exports>)
    solution    the cells of solutions/NN_topic.py, run in a fresh module
    stub        the student notebook as `make build` generates it (in memory)
    only:L.K    that notebook with exercise L.K solved and the others stubbed
    <path>      a notebook: the student's saved work

Loading runs the code cells that are not tagged demo/gpu/check, one at a time, each under a
time limit. A cell that raises (syntax error, NameError, sys.exit, a hang) is recorded and
loading goes on, so one broken cell costs only the exercises that need what it defines.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import traceback
import types
from contextlib import contextmanager
from pathlib import Path

import nbformat

from course.source import Lesson, exercises, loadable_code, read_source

CELL_TIME_LIMIT = float(os.environ.get("MT_CELL_TIME_LIMIT", 60))  # seconds a cell may run while loading
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


class CellTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise CellTimeout in the main thread after `seconds` (no-op off the main thread)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise CellTimeout(f"ran longer than {seconds:g} s (infinite loop?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cells(cells: list[tuple[int, str]], module_name: str, label: str) -> tuple[dict, list[str]]:
    """Run code cells in a fresh module registered in sys.modules; return (names, errors)."""
    module = types.ModuleType(module_name)
    module.__file__ = f"<{label}>"
    sys.modules[module_name] = module  # dataclasses, pickling and numba look modules up here
    errors = []
    for index, source in cells:
        where = f"{label}, cell {index}"
        try:
            code = compile(source, where, "exec")
            with time_limit(CELL_TIME_LIMIT):
                exec(code, module.__dict__)
        except BaseException as exc:  # noqa: BLE001 - student code may raise anything, incl. SystemExit
            if isinstance(exc, KeyboardInterrupt):
                raise
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            errors.append(f"  {where}: {last}")
    return module.__dict__, errors


def load_reference(lesson: Lesson) -> LessonNamespace:
    from course.build import exported_modules

    names: dict = {}
    for module in exported_modules(lesson):
        mod = importlib.import_module(f"minitorch.{module}")
        names.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
    return LessonNamespace(lesson, "reference", names, [])


def load(lesson: Lesson, impl: str) -> LessonNamespace:
    """Load `impl` ('reference', 'solution', 'stub' or a notebook path) of `lesson`."""
    if impl == "reference":
        return load_reference(lesson)
    if impl == "solution":
        nb, label = read_source(lesson), f"solutions/{lesson.stem}.py"
    elif impl == "stub" or impl.startswith("only:"):
        from course.build import student_notebook

        solved = frozenset(impl.removeprefix("only:").split(",")) if impl != "stub" else frozenset()
        nb, label = student_notebook(lesson, solved=solved), f"{impl} of {lesson.stem}"
    else:
        path = Path(impl)
        nb, label = nbformat.read(path, as_version=4), path.name
    generated = impl in ("solution", "stub") or impl.startswith("only:")
    module_name = f"lesson{lesson.number}_{'generated' if generated else 'notebook'}"
    names, errors = run_cells(loadable_code(nb), module_name, label)
    return LessonNamespace(lesson, impl if generated else "your notebook", names, errors)


def from_globals(lesson: Lesson, names: dict) -> LessonNamespace:
    """The live namespace of a running notebook (the check cell's view)."""
    return LessonNamespace(lesson, "this notebook", names, [])


def exercise_titles(lesson: Lesson) -> dict[str, str]:
    return exercises(read_source(lesson))
