"""Pytest plugin: records one result per test (exercise, outcome, failure message, function).

Results go to `RESULTS` (in-process use, e.g. the notebook check cell) and, when the
environment variable MT_RESULTS names a file, to that file as JSON lines: every collected test
(with its exercise) once, then each test as it starts (with its time limit) and ends, so a
grader can tell which test was running when a process died and which tests belong to the
same exercise. The message is course.feedback's: whole, with notes and the student's line.

Time limits: every test's limit (its `timeout` marker, else the ini default) is multiplied by
the machine's measured slowness (course.timing). A test that hits it fails with a message
that says so, and the remaining tests of the same exercise fail at once instead of each
waiting out the limit again. A test that fails with an exception carrying a numeric `time_limit`
attribute (seconds) counts as having hit its time limit too: machinery that runs student code
under a limit of its own (lesson 12's simulated and MPI runs: minitorch.comm.RunTimeoutError)
raises such an exception, and stops the code, before pytest-timeout would.
"""

from __future__ import annotations

import json
import os

import pytest

RESULTS: list[dict] = []
TIMEOUT_PREFIX = "Timeout (>"


def _write(record: dict) -> None:
    path = os.environ.get("MT_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def exercise_of(item) -> str | None:
    mark = item.get_closest_marker("exercise")
    return str(mark.args[0]) if mark and mark.args else None


def _feedback(report, call=None, item=None):
    """The whole failure message, and the function it came from when known (course.feedback)."""
    from course.feedback import Feedback, describe, elide

    excinfo = getattr(call, "excinfo", None)
    if excinfo is not None:
        return describe(excinfo, str(getattr(item, "path", "")) or None)
    crash = getattr(report.longrepr, "reprcrash", None)
    return Feedback(elide((crash.message if crash is not None else str(report.longrepr)).strip()))


def time_limit_error(exc: BaseException | None) -> BaseException | None:
    """`exc`, or the exception it was raised from or during, that reports a time limit: one with
    a numeric `time_limit` attribute (seconds). None if there is none."""
    from course.notebook import exception_chain

    for e in exception_chain(exc):
        limit = getattr(e, "time_limit", None)
        if isinstance(limit, (int, float)) and not isinstance(limit, bool):
            return e
    return None


def _is_stub(report, call) -> bool:
    from course.feedback import is_stub

    exc = getattr(call, "excinfo", None)
    return exc is not None and is_stub(exc.value)


_current: dict[str, dict] = {}
_timed_out: dict[str, str] = {}  # exercise -> name of its test that hit the time limit


def pytest_collection_modifyitems(config, items):
    """Scale every test's time limit by the machine's slowness; list the tests for a grader."""
    from course.timing import time_scale

    scale = time_scale()
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        base = float(mark.args[0]) if mark is not None and mark.args else default
        if base:
            item.add_marker(pytest.mark.timeout(round(base * scale, 1)), append=False)


def pytest_sessionstart(session):
    _timed_out.clear()


def pytest_collection_finish(session):
    _write({"event": "collected", "tests": [
        {"test": it.nodeid, "name": it.name, "exercise": exercise_of(it)} for it in session.items]})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    mark = item.get_closest_marker("timeout")
    limit = float(mark.args[0]) if mark is not None and mark.args else None
    _write({"event": "start", "test": item.nodeid, "name": item.name, "exercise": exercise_of(item),
            "limit": limit})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """NumPy summarises long arrays in the messages a test builds (restored afterwards)."""
    from course.feedback import print_options

    with print_options():
        yield


def timed_out(exercise: str | None) -> str | None:
    """The name of the test of `exercise` that ran past its time limit in this session, or None
    (a fixture shared by several exercises can skip the work of one that already timed out)."""
    return _timed_out.get(exercise) if exercise else None


def pytest_runtest_setup(item):
    ex = exercise_of(item)
    if ex in _timed_out:
        pytest.fail(f"not run: {_timed_out[ex]} of this exercise already ran past its time limit", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    rec = _current.setdefault(
        item.nodeid, {"test": item.nodeid, "name": item.name, "exercise": exercise_of(item), "outcome": "passed", "message": ""}
    )
    if report.skipped and rec["outcome"] == "passed":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        rec.update(outcome="skipped", message=reason.removeprefix("Skipped: "))
    elif report.failed and rec["outcome"] in ("passed", "skipped"):
        stub = _is_stub(report, call)
        feedback = _feedback(report, call, item)
        message = feedback.message
        if message.startswith("Failed: not run:"):  # the rest of an exercise after a time limit
            message = message.removeprefix("Failed: ")
        if message.removeprefix("Failed: ").startswith(TIMEOUT_PREFIX):
            from course.timing import load_note

            limit = message.removeprefix("Failed: ")[len(TIMEOUT_PREFIX):].split("s)")[0]
            where = message.partition("\n")[2].replace("raised in your code", "stopped in your code")
            message = (f"ran past its time limit of {limit} s (an infinite loop, or far too much work?)."
                       + load_note() + (f"\n{where}" if where else ""))
            ex = exercise_of(item)
            if ex:
                _timed_out.setdefault(ex, item.name)
        elif time_limit_error(getattr(getattr(call, "excinfo", None), "value", None)) is not None:
            from course.timing import load_note

            note = load_note().strip()
            message += f"\n{note}" if note else ""
            ex = exercise_of(item)
            if ex:
                _timed_out.setdefault(ex, item.name)
        rec.update(outcome="stub" if stub else "failed", message=message, function=feedback.function)
        if report.when != "call" and not stub and not message.startswith("not run:"):
            rec["message"] = f"(in test {report.when}) " + rec["message"]


def pytest_runtest_logfinish(nodeid, location):
    rec = _current.pop(nodeid, None)
    if rec is not None:
        rec["event"] = "end"
        RESULTS.append(rec)
        _write(rec)


def pytest_collectreport(report):
    if report.failed:
        rec = {"event": "collect_error", "test": report.nodeid, "message": _feedback(report).message}
        RESULTS.append(rec)
        _write(rec)
