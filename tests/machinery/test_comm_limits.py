"""Lesson 12's engines under student code that hangs or fails: every simulated rank thread is
stopped before `run` returns or raises, a time limit names the ranks still running and where,
and the first time limit ends the exercise in the check cell (and in `make test`: the same
pytest plugin). The reference engine (minitorch.comm) is what runs here; the check-cell test
grades lesson 12's solution with one function replaced by a hanging one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from minitorch import comm as mc

REPO = Path(__file__).resolve().parent.parent.parent


def threads_now() -> set[threading.Thread]:
    return set(threading.enumerate())


def spin_on(rank):
    def job(comm):
        if comm.rank == rank:
            while True:
                pass
        if comm.rank == 0:
            return comm.recv(rank)  # waits for the spinning rank
        return comm.rank
    return job


def test_a_hung_rank_is_stopped_and_named():
    before = threads_now()
    t0 = time.monotonic()
    with pytest.raises(mc.RunTimeoutError) as info:
        mc.run(spin_on(2), 4, timeout=0.5)
    took = time.monotonic() - t0
    assert threads_now() == before, f"threads left running: {threads_now() - before}"
    err = info.value
    text = str(err)
    assert err.time_limit == 0.5 and err.ranks == [0, 2], (err.time_limit, err.ranks)
    assert text.startswith("rank 2 of a simulated run with 4 ranks did not finish within 0.5 s"), text
    assert "rank 2 is still running at" in text and "in job: `while True:`" in text, text
    assert "rank 0 waits in recv(src=2, tag=0), at" in text and "ranks 1, 3 finished" in text, text
    assert took < 3, f"stopping the run took {took:.1f} s"


def test_a_rank_that_swallows_the_stop_is_stopped_anyway():
    def job(comm):
        if comm.rank == 1:
            n = 0
            while True:
                try:
                    n += 1
                except BaseException:  # noqa: BLE001 - a student's over-broad except catches some stops
                    pass
        return comm.rank

    before = threads_now()
    with pytest.raises(mc.RunTimeoutError, match="rank 1 "):
        mc.run(job, 3, timeout=0.3)
    assert threads_now() == before, f"threads left running: {threads_now() - before}"


def test_an_exception_stops_the_other_ranks_at_once():
    def job(comm):
        if comm.rank == 0:
            raise ValueError("rank 0 fails")
        if comm.rank == 1:
            while True:  # would run until the time limit
                pass
        return comm.recv(0)

    before = threads_now()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 0 fails") as info:
        mc.run(job, 3, timeout=30)
    assert time.monotonic() - t0 < 5, "the run waited for its time limit instead of stopping at the exception"
    assert any("raised on rank 0" in n for n in info.value.__notes__)
    assert threads_now() == before, f"threads left running: {threads_now() - before}"


def test_a_deadlock_leaves_no_thread():
    def job(comm):
        comm.recv((comm.rank + 1) % comm.size)

    before = threads_now()
    with pytest.raises(mc.DeadlockError, match="cycle: rank 0 -> rank 1 -> rank 2 -> rank 0"):
        mc.run(job, 3)
    assert threads_now() == before, f"threads left running: {threads_now() - before}"


def test_an_interrupt_while_waiting_stops_every_rank():
    """pytest-timeout's alarm (or Ctrl-C) raises in the thread that waits in `run`."""
    def on_alarm(signum, frame):
        raise KeyboardInterrupt("alarm")

    before = threads_now()
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt, match="alarm"):
            mc.run(spin_on(1), 3, timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert threads_now() == before, f"threads left running: {threads_now() - before}"


def test_the_default_limit_scales_with_the_machine(monkeypatch):
    monkeypatch.setenv("MT_TIME_SCALE", "2.5")
    seen = {}
    monkeypatch.setattr(mc, "_run_sim", lambda *a: seen.setdefault("timeout", a[7]))
    mc.run(lambda comm: None, 2)
    assert seen["timeout"] == mc.SIM_TIME_LIMIT * 2.5


def test_the_plugin_counts_an_exception_with_a_time_limit_as_a_timeout():
    from course.pytest_plugin import time_limit_error

    err = mc.RunTimeoutError("late", 3.0, [1])
    assert time_limit_error(err) is err
    try:
        try:
            raise err
        except TimeoutError as exc:
            raise AssertionError("wrapped") from exc
    except AssertionError as outer:
        assert time_limit_error(outer) is err
    assert time_limit_error(ValueError("x")) is None
    assert time_limit_error(mc.RunTimeoutError("no limit")) is None


CHECK_SCRIPT = r"""
import json, sys, threading, time
from course import loader, pytest_plugin
from course.check import check
from course.source import find_lesson

names = dict(loader.load(find_lesson("12"), "solution")._names)
before = {t.ident for t in threading.enumerate()}
t0 = time.monotonic()
check("12.2", names)
passing = time.monotonic() - t0

ring_reduce_scatter, ring_allgather = names["ring_reduce_scatter"], names["ring_allgather"]
def ring_allreduce(comm, x):
    if comm.rank == comm.size - 1:
        while True:
            pass
    return ring_allgather(comm, ring_reduce_scatter(comm, x)).reshape(x.shape)
names["ring_allreduce"] = ring_allreduce
t0 = time.monotonic()
check("12.2", names)
hung = time.monotonic() - t0
time.sleep(0.2)
left = [t.name for t in threading.enumerate() if t.ident not in before]
tests = [r for r in pytest_plugin.RESULTS if r.get("event") == "end"]
from minitorch import comm as mc
limit = mc.SIM_TIME_LIMIT * mc._time_scale()
print("RESULT " + json.dumps({"passing": passing, "hung": hung, "left": left, "tests": tests, "limit": limit}))
"""


@pytest.mark.timeout(240)  # measured: ~13 s on the quiet 2-core machine (10 s of it the simulator's limit)
def test_a_hung_rank_ends_the_exercise_in_the_check_cell(tmp_path):
    script = tmp_path / "hang_check.py"
    script.write_text(CHECK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO / "lessons", env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    out = json.loads(lines[-1].removeprefix("RESULT "))
    passed = re.search(r"Exercise 12\.2: all (\d+) tests passed\.", proc.stdout)
    assert passed, proc.stdout
    tests = out["tests"]
    assert len(tests) == int(passed.group(1)) and all(t["outcome"] == "failed" for t in tests), proc.stdout
    first, rest = tests[0], tests[1:]
    assert "did not finish within" in first["message"] and "in ring_allreduce: `while True:`" in first["message"], \
        first["message"]
    for t in rest:
        assert t["message"].startswith(f"not run: {first['name']} of this exercise already ran past its time limit"), t
    assert not out["left"], f"threads still alive after the check cell: {out['left']}"
    # one time limit for the exercise, not one per test (10 tests): the passing run's time plus
    # the limit, with room for one more (a comparison with the passing time alone depends on
    # how fast MPI runs the passing code)
    assert out["hung"] < out["passing"] + 2 * out["limit"], \
        f"a hung rank took {out['hung']:.1f} s to grade, the passing code {out['passing']:.1f} s, " \
        f"the simulator's time limit is {out['limit']:.0f} s"
