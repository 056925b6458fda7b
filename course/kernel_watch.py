"""A watchdog for a notebook run by nbclient: it kills a kernel that has stopped answering.

nbclient times each cell, but it waits for a kernel message, and when the reply never reaches it
it waits with the kernel idle until the cell limit, which is minutes. Seen here three times, the
last in a cell that opens ipywidgets (lesson 01's first live control), a known nbclient fault
(jupyter/nbclient#312); ipykernel 7 has similar reports (ipython/ipykernel#1471). Two rules,
checked every POLL_S seconds:

- stalled: no cell has started or finished for the cell limit plus a minute;
- idle: a cell is running, yet the kernel and every process under it have used no more than 1%
  of a core for IDLE_S seconds. Not scaled by the machine's speed: a slower machine takes
  longer to compute, not longer to sit still. No lesson cell waits that long doing nothing:
  every wait in the course (an MPI launch, a server, a grader's time limit) is shorter or burns
  CPU somewhere under the kernel.

Either way the kernel and its session are killed, nbclient reports the kernel dead, and `reason` says
which rule fired (`idle`: the second). make check runs a notebook whose kernel went idle once
more (course.executor.execute_notebook).
"""

from __future__ import annotations

import threading
import time

from course.process import kill_group

IDLE_S = 120.0  # s a running cell may leave the kernel's process tree without CPU
POLL_S = 5.0


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process `pid`, its live descendants and the
    children they have reaped; None where psutil is missing or the process is gone."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for proc in procs:
        try:  # children_*: the children it has reaped, so the total never falls when one ends
            t = proc.cpu_times()
            total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
        except psutil.Error:  # a child that ended between the listing and the reading
            pass
    return total


class KernelWatch:
    """Watch an nbclient.NotebookClient while it executes; pass `cell_started` and `cell_done` as
    its on_cell_start / on_cell_executed hooks. `reason` is '' or what made the watch kill the
    kernel."""

    def __init__(self, client, cell_limit: float, idle_s: float) -> None:  # noqa: ANN001 - nbclient's client
        self.client, self.cell_limit, self.idle_s = client, cell_limit, idle_s
        self.in_cell = False
        self.progress = time.monotonic()  # when the last cell started or finished
        self.reason = ""
        self.idle = False  # the idle rule fired
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def cell_started(self, **_) -> None:  # noqa: ANN003 - nbclient's hook signature
        self.in_cell, self.progress = True, time.monotonic()

    def cell_done(self, **_) -> None:  # noqa: ANN003
        self.in_cell, self.progress = False, time.monotonic()

    def __enter__(self) -> KernelWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        self._done.set()
        self._thread.join()

    def _process(self):  # noqa: ANN202 - the kernel's subprocess.Popen, or None before it starts
        return getattr(getattr(getattr(self.client, "km", None), "provisioner", None), "process", None)

    def _watch(self) -> None:
        last_cpu, active = None, time.monotonic()  # the tree's CPU at the last poll; when it last worked
        while not self._done.wait(POLL_S):
            now, process = time.monotonic(), self._process()
            if process is None:
                continue
            cpu = tree_cpu_seconds(process.pid)
            # Working: more than 1% of a core since the last poll (an idle kernel's threads use less).
            if cpu is None or last_cpu is None or cpu - last_cpu > 0.01 * POLL_S:
                active = now
            last_cpu = cpu
            quiet = now - max(active, self.progress)
            if now - self.progress > self.cell_limit + 60:
                self.reason = f"no cell started or finished for {self.cell_limit + 60:.0f} s (the cell limit plus a minute)"
            elif self.in_cell and cpu is not None and quiet > self.idle_s:
                self.idle = True
                self.reason = (f"the kernel and every process under it sat idle for {quiet:.0f} s in the middle of a "
                               f"cell (more than {self.idle_s:.0f} s): the kernel stopped answering")
            if self.reason:  # the kernel's whole session: jupyter_client starts each kernel in its own,
                kill_group(process)  # so no child of a cell (a server, a subprocess) outlives it
                return

