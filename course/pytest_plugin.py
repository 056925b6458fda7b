"""Pytest plugin: records one result per test (exercise, outcome, short message).

Results go to `RESULTS` (in-process use, e.g. the notebook check cell) and, when the
environment variable MT_RESULTS names a file, to that file as JSON lines written as each
test starts and ends, so a grader can tell which test was running when a process died.
"""

from __future__ import annotations

import json
import os

import pytest

RESULTS: list[dict] = []
STUB_PREFIX = "Exercise "


def _write(record: dict) -> None:
    path = os.environ.get("MT_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def exercise_of(item) -> str | None:
    mark = item.get_closest_marker("exercise")
    return str(mark.args[0]) if mark and mark.args else None


def _message(report) -> str:
    """The first useful line(s) of a failure, for a scoreboard."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[:6])[:800]


def _is_stub(report, call) -> bool:
    exc = getattr(call, "excinfo", None)
    return bool(
        exc is not None
        and exc.errisinstance(NotImplementedError)
        and str(exc.value).startswith(STUB_PREFIX)
    )


_current: dict[str, dict] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "test": nodeid})


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
        rec.update(outcome="stub" if stub else "failed", message=_message(report))
        if report.when != "call" and not stub:
            rec["message"] = f"(in test {report.when}) " + rec["message"]


def pytest_runtest_logfinish(nodeid, location):
    rec = _current.pop(nodeid, None)
    if rec is not None:
        rec["event"] = "end"
        RESULTS.append(rec)
        _write(rec)


def pytest_collectreport(report):
    if report.failed:
        rec = {"event": "collect_error", "test": report.nodeid, "message": _message(report)}
        RESULTS.append(rec)
        _write(rec)
