"""Child processes of the grader, and how it watches them (course.grade, course.executor,
course.kernel_watch).

A child reports what it is doing as JSON lines in a file (course.pytest_plugin: a test starts and
ends; course.loader's survey: a notebook cell starts and ends); `watch` reads that file while the
child runs and kills the child, with everything it started, when the unit of work it reports as
running outlives its limit, or the whole run outlives LESSON_TIME_LIMIT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from course.source import ROOT

LESSON_TIME_LIMIT = 900  # seconds for one watched process as a whole (a lesson's whole test process)


def child_env(extra: dict | None = None) -> dict:
    """The environment of a grading child: this one's, then `extra`, with one BLAS thread unless set
    (tests check correctness, and on a busy 2-core machine OpenBLAS's threads can make small matmuls
    100x slower; speed is measured by `make bench`), no .pyc files written, and the machine's
    measured slowness (course.timing) in MT_TIME_SCALE, measured once here and inherited."""
    from course.timing import time_scale

    time_scale()  # measured once here, inherited by every child through MT_TIME_SCALE
    return {"OPENBLAS_NUM_THREADS": "1", **os.environ, **(extra or {}), "PYTHONDONTWRITEBYTECODE": "1"}


def read_jsonl(path: str) -> list[dict]:
    """The JSON records of a report a child appends to, one a line: [] if there is no file yet, and a
    line still being written when we looked is left out."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written when we looked
            pass
    return out


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and everything it started (its own process group), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def watch(cmd: list[str], env: dict, report: str, limit_of, poll: float = 0.2) -> tuple[object, str]:
    """Run cmd, killing it when the unit of work it reports as running (the last "start"
    record in `report` without its "end") outlives limit_of(record). Returns (exit code or
    "timeout", output). With MT_SANDBOX in env (class grading), cmd runs in that sandbox, able to
    write `report` and nothing else outside it."""
    cleanup = None
    if env.get("MT_SANDBOX"):  # class grading: the student's code runs isolated (course/isolation.py)
        from course.isolation import Sandbox

        box = Sandbox.from_json(env["MT_SANDBOX"])
        cmd, env, cleanup = box.prepare(cmd, {k: v for k, v in env.items() if k != "MT_SANDBOX"}, [report])
    try:
        return _watch_run(cmd, env, report, limit_of, poll)
    finally:
        if cleanup is not None:
            cleanup()


def _watch_run(cmd: list[str], env: dict, report: str, limit_of, poll: float) -> tuple[object, str]:
    """`watch` once the command is final: start it in its own session (so that kill_group reaches
    every process it starts), poll it and its report every `poll` seconds."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        started: dict[str, float] = {}
        deadline = time.monotonic() + LESSON_TIME_LIMIT
        rc: object = None
        while rc is None:
            try:
                rc = proc.wait(timeout=poll)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            running = None
            for rec in read_jsonl(report):
                key = str(rec.get("test", rec.get("cell")))
                if rec["event"] == "start":
                    running = rec
                    started.setdefault(key, now)
                elif rec["event"] == "end":
                    running = None
            if now > deadline or (running is not None and
                                  now - started[str(running.get("test", running.get("cell")))] > limit_of(running)):
                kill_group(proc)
                rc = "timeout"
        out.seek(0)
        return rc, out.read()
