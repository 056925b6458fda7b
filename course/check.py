"""The check cell: grade one exercise against the code live in this notebook's kernel.

    from course.check import check
    check("1.2")

Nothing is saved or written: the tests see the notebook's current globals. Importing this module
in a notebook also installs course.notebook's hooks: a cell that needs an exercise not written
yet, or a GPU that is not there, says so in one line and Run All goes on.
"""

from __future__ import annotations

import contextlib
import io
import sys

from course import loader, notebook
from course.feedback import PYTEST_ARGS
from course.source import ROOT, find_lesson

notebook.install()


def check(exercise: str, names: dict | None = None) -> None:
    """Run exercise `exercise`'s tests on the calling notebook's globals and print a summary."""
    import pytest

    from course import pytest_plugin

    lesson = find_lesson(exercise)
    names = names if names is not None else sys._getframe(1).f_globals
    loader.LIVE[lesson.number] = loader.from_globals(lesson, names)
    pytest_plugin.RESULTS.clear()
    args = [str(lesson.tests), f"--exercise={exercise}", "-q", "--no-header", "-p", "no:cacheprovider",
            f"--rootdir={ROOT}", "-c", str(ROOT / "pyproject.toml"), "--import-mode=importlib",
            "--capture=sys", "--timeout-method=signal", "--tb=line", *PYTEST_ARGS]
    sink = io.StringIO()
    progress = Progress(exercise)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            pytest.main(args, plugins=[progress])
    finally:
        progress.close()
        loader.LIVE.pop(lesson.number, None)
    print(summary(exercise, list(pytest_plugin.RESULTS), sink.getvalue()))


class Progress:
    """A pytest plugin: a progress bar over a check's tests (tqdm.auto: a widget in JupyterLab, a line
    on a terminal, written to the real stderr since the check captures the rest). It opens when the
    tests are collected, advances as each ends, and shows only once the run has taken DELAY seconds,
    so that a quick check prints nothing but its summary. A missing tqdm (or a display that fails)
    only means no bar."""

    DELAY = 2.0

    def __init__(self, exercise: str):
        self.exercise, self.bar = exercise, None

    def pytest_collection_finish(self, session) -> None:  # noqa: ANN001
        try:
            from tqdm.auto import tqdm

            class Bar(tqdm):
                monitor_interval = 0  # no monitor thread: a check leaves no thread of its own behind

            self.bar = Bar(total=len(session.items), desc=f"checking {self.exercise}", unit="test", leave=False,
                            delay=self.DELAY, file=sys.__stderr__ or sys.stderr)
        except Exception:  # noqa: BLE001 - no bar is better than a check that fails for it
            self.bar = None

    def pytest_runtest_logfinish(self, nodeid, location) -> None:  # noqa: ANN001
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        bar, self.bar = self.bar, None
        if bar is None:
            return
        try:
            bar.close()
        finally:  # a widget's display stays in the cell's output: clear it, so the summary stands alone
            widget = any(cls.__module__ == "tqdm.notebook" for cls in type(bar).__mro__)  # tqdm.auto's subclasses it
            if widget and getattr(bar, "displayed", False):
                from IPython.display import clear_output

                clear_output()


def summary(exercise: str, results: list[dict], output: str) -> str:
    tests = [r for r in results if r.get("event") == "end"]
    errors = [r for r in results if r.get("event") == "collect_error"]
    if errors:
        return f"Exercise {exercise}: the tests could not run:\n{errors[0]['message']}"
    if not tests:
        return f"Exercise {exercise}: no tests found (is the id right?)\n{output[-500:]}"
    n = len(tests)
    by = {o: [t for t in tests if t["outcome"] == o] for o in ("passed", "failed", "stub", "skipped")}
    if by["stub"] and not by["failed"] and not by["passed"]:
        return f"Exercise {exercise}: not attempted yet (the stub still raises NotImplementedError)."
    if by["failed"] or by["stub"]:
        bad = by["failed"] + by["stub"]
        where = f" ({bad[0]['function']})" if bad[0].get("function") else ""
        lines = [f"Exercise {exercise}{where}: {len(bad)} of {n} tests failed. First failure:",
                 f"  {bad[0]['name']}:", *("    " + ln for ln in bad[0]["message"].splitlines())]
        if len(bad) > 1:
            lines.append("  Also failing: " + ", ".join(t["name"] for t in bad[1:6]))
        return "\n".join(lines)
    if by["skipped"] and not by["passed"]:
        return f"Exercise {exercise}: skipped: {by['skipped'][0]['message']}"
    extra = f" ({len(by['skipped'])} skipped: {by['skipped'][0]['message']})" if by["skipped"] else ""
    return f"Exercise {exercise}: all {len(by['passed'])} tests passed.{extra}"
