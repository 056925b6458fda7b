"""Pytest plugin for class grading (loaded by tests/conftest.py beside course.pytest_plugin).

- The `hidden` marker: `@pytest.mark.hidden` on a test function or class keeps it out of every
  student release (course/release.py strips it from the released test file); it runs when the class
  is graded (`make grade-class`, the Gradescope bundle, the Classroom grader), where a failure shows the
  student only that a hidden case failed (course/classgrade.py).
- A time limit that Hypothesis cannot swallow. pytest-timeout stops a test that runs too long by
  raising pytest's `Failed` from a SIGALRM handler; Hypothesis catches `Failed` as an ordinary failure
  and then shrinks the failing example, calling the student's function again and again with no timer
  left to stop it, until the grader's watchdog kills the process long after the limit and can no
  longer say where the code was. In a Hypothesis test this plugin answers pytest-timeout's alarm with
  an exception Hypothesis lets through (a BaseException of its own, named and worded as
  pytest-timeout's, so that course.pytest_plugin reports it as the time limit it is and names the
  student's line), and re-arms the alarm until the test has returned (code that swallows it once is
  stopped again).
- No shrinking of an exercise that is not written yet. A stub raises NotImplementedError("Exercise
  ..."); Hypothesis would treat it as any failure and shrink the example, calling the stub again and
  again for an answer that cannot change (half a second a test, minutes over a lesson's stubs). In a
  Hypothesis test the stub's exception leaves Hypothesis at once (inside a BaseException of this
  plugin) and is restored unchanged for the report: the student sees the same "not written yet".
"""

from __future__ import annotations

import signal
import threading

import pytest

HIDDEN_MARKER = "hidden"
TIMEOUT_MESSAGE = "Timeout (>%ss) from pytest-timeout."  # pytest-timeout's own words (course.pytest_plugin reads them)
REARM_S = 0.5


class _StubReached(BaseException):
    """Carries a stub's NotImplementedError through Hypothesis, which would shrink it."""

    def __init__(self, error: NotImplementedError):
        super().__init__(str(error))
        self.error = error


def _passing_stubs_through(inner):
    """`inner` (a Hypothesis test's body) with a stub's NotImplementedError raised as _StubReached."""
    import functools

    from course.feedback import is_stub

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        __tracebackhide__ = True  # noqa: F841 - pytest leaves this frame out of the traceback
        try:
            return inner(*args, **kwargs)
        except NotImplementedError as exc:
            if is_stub(exc):
                raise _StubReached(exc) from None
            raise
    return wrapped


class Failed(BaseException):  # noqa: N818 - named as pytest's, whose message course.pytest_plugin recognises
    """The per-test time limit, raised inside a Hypothesis test (Hypothesis catches pytest's Failed)."""

    def __init__(self, limit: float):
        super().__init__(TIMEOUT_MESSAGE % limit)
        self.limit = limit


def pytest_configure(config):
    config.addinivalue_line("markers", f"{HIDDEN_MARKER}: a hidden test: never in a student release; graded in "
                                       "class grading, where its failure shows only that a hidden case failed")


def _limit(item) -> float | None:
    mark = item.get_closest_marker("timeout")
    if mark is not None and mark.args:
        return float(mark.args[0])
    try:
        value = item.config.getini("timeout")
        return float(value) if value else None
    except (TypeError, ValueError):
        return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    hypothesis_test = getattr(getattr(item, "obj", None), "is_hypothesis_test", False)
    handle = getattr(item.obj, "hypothesis", None) if hypothesis_test else None
    inner = getattr(handle, "inner_test", None)
    if inner is not None:
        handle.inner_test = _passing_stubs_through(inner)
    try:
        outcome = yield from _with_time_limit(item, hypothesis_test)
    finally:
        if inner is not None:
            handle.inner_test = inner
    if outcome is not None and isinstance(outcome.exception, _StubReached):
        error = outcome.exception.error
        outcome.force_exception(error.with_traceback(error.__traceback__))


def _with_time_limit(item, hypothesis_test: bool):
    armed = (hypothesis_test and threading.current_thread() is threading.main_thread()
             and hasattr(signal, "setitimer")
             and signal.getitimer(signal.ITIMER_REAL)[0] > 0)  # pytest-timeout's alarm (signal method) is set
    if not armed:
        return (yield)
    limit = _limit(item) or 0.0
    fired = []

    def on_alarm(signum, frame):
        fired.append(True)
        signal.setitimer(signal.ITIMER_REAL, REARM_S)  # again, until the test has returned
        raise Failed(limit)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        return (yield)
    finally:
        if fired:
            signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
