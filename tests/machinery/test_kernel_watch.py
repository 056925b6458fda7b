"""make check's watchdog over a notebook run (course.kernel_watch): a kernel that stops answering
in the middle of a cell is killed and reported, and one whose work runs in a child process is not."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from course import kernel_watch

pytestmark = pytest.mark.timeout(180)

pytest.importorskip("psutil")


def run(cells: list[str], tmp_path: Path, monkeypatch, idle_s: float = 4.0) -> tuple[str, bool, list[int], float, list[str]]:  # noqa: ANN001
    """Run `cells` through make check's notebook runner with a short idle limit: (message, idle,
    the cells started, seconds, what each cell printed)."""
    import nbformat

    from course.executor import run_client

    monkeypatch.setattr(kernel_watch, "IDLE_S", idle_s)
    monkeypatch.setattr(kernel_watch, "POLL_S", 0.5)
    monkeypatch.setenv("MT_TIME_SCALE", "1")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    lesson = SimpleNamespace(notebook=tmp_path / "watched.ipynb")
    running: list[int] = []
    t0 = time.monotonic()
    message, idle = run_client(nb, {}, 120, running, lesson, tmp_path / "out.ipynb")
    printed = ["".join(o.get("text", "") for o in c.get("outputs", [])) for c in nb.cells]
    return message, idle, running, time.monotonic() - t0, printed


def test_a_kernel_that_stops_answering_is_killed_and_reported(tmp_path, monkeypatch):
    # SIGSTOP: the kernel never answers the cell, and nothing under it uses CPU, as in the hangs
    # seen here (an idle kernel, nbclient waiting for its reply until the cell limit). The sleeping
    # child a cell started goes with it.
    message, idle, running, seconds, printed = run(
        ["import subprocess\nchild = subprocess.Popen(['sleep', '300'])\nprint(child.pid)",
         "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", "print('never')"], tmp_path, monkeypatch)
    assert idle and running == [0, 1], (message, running)
    assert "cell 1:" in message and "idle" in message and "killed" in message, message
    assert seconds < 60, f"the watch took {seconds:.0f} s to kill a kernel idle for 4 s"
    child = int(printed[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), f"the cell's child process {child} outlived the killed kernel"


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_work_in_a_child_process_is_not_idleness(tmp_path, monkeypatch):
    # The kernel waits (no CPU of its own) while a child process burns CPU for 3x the idle limit,
    # as a cell that waits for mpiexec's ranks or a server does.
    spin = "import time\nt = time.time()\nwhile time.time() - t < 12: pass"
    message, idle, running, _, _ = run(["import subprocess, sys", f"subprocess.run([sys.executable, '-c', {spin!r}])",
                                     "print('done')"], tmp_path, monkeypatch)
    assert message == "" and not idle and running == [0, 1, 2], message


def test_tree_cpu_counts_live_children():
    import os
    import subprocess
    import sys

    mine = kernel_watch.tree_cpu_seconds(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        time.sleep(2)
        with_child = kernel_watch.tree_cpu_seconds(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert with_child - mine > 0.5, (mine, with_child)
    assert kernel_watch.tree_cpu_seconds(2**22 + 12345) is None  # no such process


def test_a_reply_whose_poll_never_woke_is_seen_on_the_next_look(monkeypatch):
    """course.executor.repoll_shell: nbclient's single wait for an execute_reply can miss its wake-up
    after a widget cell (jupyter/nbclient#312); the wrapped wait looks again every REPOLL_S seconds,
    and still raises Empty once the caller's own timeout has passed."""
    import asyncio
    import queue
    import types

    from course import executor

    monkeypatch.setattr(executor, "REPOLL_S", 0.05)
    looks = []

    async def poll_once(timeout=None):  # the first look misses the reply that is already there
        looks.append(timeout)
        await asyncio.sleep(min(timeout or 0.05, 0.05))
        if len(looks) == 1:
            raise queue.Empty
        return {"msg_type": "execute_reply"}

    kc = types.SimpleNamespace(shell_channel=types.SimpleNamespace(get_msg=poll_once))
    executor.repoll_shell(kc)
    assert asyncio.run(kc.shell_channel.get_msg(timeout=None)) == {"msg_type": "execute_reply"}
    assert looks == [0.05, 0.05], looks

    async def never(timeout=None):
        await asyncio.sleep(timeout)
        raise queue.Empty

    kc.shell_channel.get_msg = never
    executor.repoll_shell(kc)
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        asyncio.run(kc.shell_channel.get_msg(timeout=0.2))
    assert 0.15 < time.monotonic() - t0 < 1.0
