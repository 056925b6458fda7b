"""The notebook executor: a lesson's notebook run as JupyterLab's Run All runs it (nbclient).

`make check` (course.maintain) runs the solution and the stub notebook of each lesson with it,
`make demo` the solution at full size, and `make slides` (course.slides) and `make site`
(course.site) the notebooks whose outputs they show; the browser test (course.browser) judges the
check and gpu cells it sees by the same rules (check_cell_exercise, check_cell_says_what_it_must,
GPU_SKIP). Each run is watched by course.kernel_watch, and nbclient's waits for a cell's reply look
at the kernel's socket every REPOLL_S seconds (repoll_shell).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from course.source import Lesson


def _cell_text(cell) -> str:
    """What a code cell printed (streams, results, errors), as plain text."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
        elif out.get("output_type") == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}")
    return "".join(parts).strip()


DEMO_CELL_LIMIT = float(os.environ.get("MT_DEMO_CELL_LIMIT", 900))  # s per cell on the reference machine
GPU_SKIP = "skipped: this cell needs a CUDA GPU"  # how a `gpu` cell begins its output where no GPU works


def check_cell_exercise(cell) -> str | None:
    """The exercise a check cell (`check("L.K")`, tagged check) grades, else None."""
    from course.source import tags

    m = re.fullmatch(r"""check\(["']([\d.]+)["']\)""", cell.source.strip()) if "check" in tags(cell) else None
    return m.group(1) if m else None


def check_cell_says_what_it_must(exercise: str, text: str, stub: bool) -> bool:
    """On the stub notebook a check cell says its exercise is not attempted; on the solution, that
    all its tests passed (or were skipped for want of a GPU)."""
    ex = re.escape(exercise)
    want = rf"Exercise {ex}: not attempted yet" if stub else rf"Exercise {ex}: (all \d+ tests passed|skipped: needs a CUDA GPU)"
    return re.match(want, text.strip()) is not None


LIVE_REDRAW_LIMIT = 0.5  # CPU seconds for one redraw of a live control (course.live) on the reference machine


def execute_notebook(lesson: Lesson, out_dir: Path, small: bool, stub: bool = False) -> tuple[bool, str, dict[str, str], list[dict]]:
    """Run the lesson's solution notebook (or, with stub=True, the student notebook) exactly as
    JupyterLab's Run All does: every cell in order in a plain kernel, nothing rewritten, stopping
    at the first cell that ends in an error. `gpu` cells skip themselves where no GPU works, and
    cells that need an unwritten exercise say so in one line (course.notebook). Each cell may run
    DEMO_CELL_LIMIT seconds, scaled by the machine's measured speed (course.timing).

    Returns (ok, error message, {exercise: what its check cell printed}, the result of every test
    the check cells ran, as course.pytest_plugin records them). The executed notebook is written
    to out_dir whatever happened."""
    import tempfile

    import nbformat

    from course.build import solution_notebook, student_notebook
    from course.gpu import gpu_status
    from course.process import child_env, read_jsonl
    from course.source import tags
    from course.timing import time_scale

    nb = nbformat.from_dict(student_notebook(lesson) if stub else solution_notebook(lesson))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{lesson.stem}{'.stub' if stub else ''}.ipynb"
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as f:
        results = f.name
    with tempfile.NamedTemporaryFile("r", suffix=".live.jsonl", delete=False) as f:
        probes = f.name  # course.live: each live control driven over its range, timed
    env = {**os.environ, "MINITORCH_SMALL": "1" if small else "0", "MT_RESULTS": results}
    if small:  # a correctness run on a shared machine: see course.process.child_env
        env = child_env({**env, "MT_RESULTS": results})
    if not stub:  # the solution's run drives every live control (the stub's would repeat it)
        env["MT_LIVE_PROBE"] = probes
    limit = round(DEMO_CELL_LIMIT * time_scale())
    running: list[int] = []
    for attempt in (1, 2):
        message, idle = run_client(nb, env, limit, running, lesson, out)
        # A kernel that went idle in the middle of a cell stopped answering (ipykernel's fault,
        # not the lesson's): the notebook runs once more from the start, and the check says so.
        if not idle or attempt == 2:
            break
        print(f"  {lesson.stem}{' (stub)' if stub else ''}: {message}; running the notebook again", flush=True)
        nb = nbformat.from_dict(student_notebook(lesson) if stub else solution_notebook(lesson))
        running.clear()
        for path in (results, probes):
            open(path, "w").close()
    nbformat.write(nb, out)
    tests = [r for r in read_jsonl(results) if r.get("event") == "end"]
    os.unlink(results)
    live = read_jsonl(probes)
    (out_dir / f"{lesson.stem}{'.stub' if stub else ''}.live.jsonl").write_text(
        "".join(json.dumps(p) + "\n" for p in live))  # each control's slowest redraw, for the record
    for probe in live:
        dead = [name for name, changes in probe["controls"].items() if not changes]
        if not message and dead:
            message = f"live control {probe['draw']}: moving {', '.join(dead)} over its range does not change the figure"
        if not message and probe["slowest_cpu_s"] > LIVE_REDRAW_LIMIT * time_scale():
            message = (f"live control {probe['draw']}: one redraw took {probe['slowest_cpu_s']:.2f} s of CPU "
                       f"({probe['slowest_s']:.2f} s wall), more than {LIVE_REDRAW_LIMIT} s x{time_scale():.2f}: "
                       f"precompute what is slow in an earlier cell")
    os.unlink(probes)
    checks = {}
    if not message and running and running[-1] != len(nb.cells) - 1:
        message = f"Run All stopped at cell {running[-1]}, not at the last cell ({len(nb.cells) - 1})"
    ok_gpu, reason = gpu_status()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        text = _cell_text(cell)
        ex = check_cell_exercise(cell)
        if ex:
            checks[ex] = text
        if not message and "Traceback (most recent call last)" in text:
            message = f"cell {i} printed a traceback although Run All went on:\n{text[-1500:]}"
        if not message and "gpu" in tags(cell) and not ok_gpu and i in running and \
                not text.startswith(GPU_SKIP):
            message = f"gpu cell {i} should say it skipped (no GPU here: {reason}), but printed:\n{text[:500]}"
    return not message, message, checks, tests


REPOLL_S = 1.0  # how often a wait for the kernel's reply looks again at its socket


def repoll_shell(kc) -> None:  # noqa: ANN001 - a jupyter_client AsyncKernelClient
    """Make waits on the kernel client's shell channel look at the socket every REPOLL_S seconds.

    nbclient waits for a cell's execute_reply with one poll of the shell socket. After a cell that
    creates widgets (course.live's controls) that poll sometimes never wakes although the reply has
    arrived (jupyter/nbclient#312): the kernel sits idle and Run All hangs until the cell limit. Under
    load it happened in one Run All in a few here. A poll repeated with a short timeout sees the
    message on its next look (pyzmq checks the socket's events first); the overall timeout is kept."""
    import queue

    from jupyter_client.utils import ensure_async

    channel = kc.shell_channel
    poll_once = channel.get_msg

    async def get_msg(timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await ensure_async(poll_once(timeout=REPOLL_S if left is None else min(REPOLL_S, left)))
            except queue.Empty:
                if left is not None and left <= REPOLL_S:
                    raise

    channel.get_msg = get_msg


def run_client(nb, env: dict, limit: int, running: list[int], lesson: Lesson, out: Path) -> tuple[str, bool]:  # noqa: ANN001
    """Execute `nb` in place in a fresh kernel, watched by course.kernel_watch; append each cell's
    index to `running` as it starts. Returns (error message or '', whether the watch killed a
    kernel that sat idle in a cell)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    from course.kernel_watch import IDLE_S, KernelWatch
    from course.timing import time_scale

    client = NotebookClient(nb, timeout=limit, kernel_name="python3", record_timing=True,
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],  # no transport warning
                            resources={"metadata": {"path": str(lesson.notebook.parent)}})
    watch = KernelWatch(client, limit, IDLE_S)

    def started(cell_index, **kw):  # noqa: ANN001, ANN003, ANN202 - nbclient's hook signature
        running.append(cell_index)
        watch.cell_started(**kw)

    client.on_cell_start, client.on_cell_executed = started, watch.cell_done
    client.on_notebook_start = lambda **_: repoll_shell(client.kc)
    message = ""
    with watch:
        try:
            client.execute(env=env)
        except CellTimeoutError:
            i = running[-1] if running else -1
            first = nb.cells[i].source.strip().splitlines()[0] if i >= 0 else "?"
            message = (f"cell {i} (`{first}`) ran past the per-cell limit of {limit} s ({DEMO_CELL_LIMIT:g} s on the "
                       f"course's reference machine, x{time_scale():.2f} for this machine's measured speed). The "
                       f"notebook up to that cell is in {out}. Run it on a quieter machine, or allow more with "
                       f"MT_DEMO_CELL_LIMIT=<seconds>.")
        except CellExecutionError as exc:
            i = running[-1] if running else -1
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # no terminal colours in a report
            message = f"cell {i} ended in an error, and Run All stops there:\n" + "\n".join(text.splitlines()[-15:])
        except Exception as exc:  # noqa: BLE001 - kernel death: report, don't crash the check
            message = f"{type(exc).__name__}: {exc}"
    if watch.reason:
        i = running[-1] if running else -1
        message = f"cell {i}: {watch.reason}; the kernel was killed ({message})"
    return message, watch.idle
