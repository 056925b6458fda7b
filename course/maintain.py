"""Maintainer commands: `make check` and `make demo`.

    python -m course.maintain check [NN ...]   prove every lesson (or the ones named)
    python -m course.maintain demo NN          execute lesson NN's solution at full size

`check` proves, per lesson: the tests pass on the reference package; each exercise passes with
only its own solution filled in (the grader's loader, as `make test` loads a notebook); every
exercise has tests and a check cell; the solution notebook and the student's stub notebook each
run as JupyterLab's Run All runs them (a plain kernel, every cell in order, nothing rewritten,
MINITORCH_SMALL=1) to their last cell with no traceback; the solution's check cells run every test
and pass; the stub's check cells run every test, each failing because of its own exercise's stub,
and report "not attempted"; every `gpu` cell says why it skipped where no GPU works. It also
checks that lessons/ and minitorch/ are in sync with solutions/, runs the machinery's own tests
beside the lessons, and runs the browser test (course.browser) on a lesson of each kind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from course.grade import LessonResult, run_tests
from course.source import ROOT, Lesson, all_lessons, find_lesson

BUILD = ROOT / "build"


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
    from course.grade import _child_env, _read_jsonl
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
    if small:  # a correctness run on a shared machine: see course.grade
        env = _child_env({**env, "MT_RESULTS": results})
    if not stub:  # the solution's run drives every live control (the stub's would repeat it)
        env["MT_LIVE_PROBE"] = probes
    limit = round(DEMO_CELL_LIMIT * time_scale())
    running: list[int] = []
    for attempt in (1, 2):
        message, idle = _run_client(nb, env, limit, running, lesson, out)
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
    tests = [r for r in _read_jsonl(results) if r.get("event") == "end"]
    os.unlink(results)
    live = _read_jsonl(probes)
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


def _run_client(nb, env: dict, limit: int, running: list[int], lesson: Lesson, out: Path) -> tuple[str, bool]:  # noqa: ANN001
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


def _check_cell_problems(checks: dict[str, str], lesson: Lesson, stub: bool) -> list[str]:
    """Check cells that do not say what they must: on the solution, that all tests passed (or
    were skipped for want of a GPU); on the stubs, that their own exercise is not attempted."""
    from course.loader import exercise_titles

    problems = []
    for ex in exercise_titles(lesson):
        if ex not in checks:
            problems.append(f"exercise {ex} has no check cell `check(\"{ex}\")`")
    for ex, text in checks.items():
        if not check_cell_says_what_it_must(ex, text, stub):
            where, want = ("stub", "not attempted") if stub else ("solution", "all tests passed")
            problems.append(f"the check cell of exercise {ex} in the {where} notebook should say {want}, "
                            f"but says:\n{text[:1200]}")
    return problems


def _stub_problems(result: LessonResult) -> list[str]:
    """Tests that pass on the stubs, or fail only because of another exercise's stub."""
    problems = []
    for t in result.tests:
        ex = t.get("exercise")
        if t["outcome"] == "passed":
            problems.append(f"{t['name']} (exercise {ex}) PASSES on the stub: it cannot fail")
        elif t["outcome"] == "stub":
            m = re.search(r"Exercise (\d+\.\d+)", t["message"])
            if m and m.group(1) != ex:
                problems.append(f"{t['name']} (exercise {ex}) depends on exercise {m.group(1)}'s code")
    return problems


def _all_pass(result: LessonResult) -> list[str]:
    problems = list(result.problems)
    for t in result.tests:
        if t["outcome"] not in ("passed", "skipped"):
            problems.append(f"{t['name']}: {t['outcome']}: {t['message']}")
    return problems


def _coverage(result: LessonResult) -> list[str]:
    problems = []
    for ex in result.exercises():
        if not ex.tests:
            problems.append(f"exercise {ex.id} ({ex.title}) has no tests")
        if ex.title == "(not an exercise of this lesson)":
            names = ", ".join(t["name"] for t in ex.tests[:3])
            problems.append(f"tests marked exercise {ex.id!r}, which the lesson does not define: {names}")
    return problems


def _walk_stage(lesson: Lesson, report: Path) -> tuple[float, list[str], int]:
    """The validation walk of the lesson's own modules, from its reference run (course.validation_walk):
    (0 s: it ran inside the reference stage, problems, callables walked)."""
    from course.build import exported_modules
    from course.validation_walk import merge

    if not report.exists():
        return 0.0, [f"the reference run wrote no validation-walk report ({report})"], 0
    data = json.loads(report.read_text())
    problems, _ = merge([data], set(exported_modules(lesson)), coverage=False)
    walked = sum(q.split(".")[0] in exported_modules(lesson) for q in data["walked"])
    return 0.0, problems, walked


def walk_summary(lessons: list[Lesson], machinery: bool) -> int:
    """Every lesson's walk (and the machinery tests') merged: findings once each, and (when every
    lesson and the machinery ran) each public callable of the package that no test called. Prints
    them; returns 1 if there are any."""
    from course.validation_walk import merge

    reports = [BUILD / "check" / "walk" / f"{le.stem}.json" for le in lessons]
    reports += sorted((BUILD / "check" / "walk").glob("machinery-*.json")) if machinery else []
    data = [json.loads(p.read_text()) for p in reports if p.exists()]
    problems, line = merge(data, coverage=machinery and len(lessons) == len(all_lessons()))
    shown = {p for le in lessons for p in _walk_stage(le, BUILD / "check" / "walk" / f"{le.stem}.json")[1]}
    print(f"\n== validation walk: {line}: {'ok' if not problems else f'{len(problems)} problems'}"
          + (" (those of each lesson's own modules are listed under it)" if shown & set(problems) else ""))
    for p in problems:
        if p not in shown:
            print("   " + p)
    return 1 if problems else 0


def check_lesson(lesson: Lesson, pool: ThreadPoolExecutor) -> dict:
    """Every check for one lesson; returns {stage: (ok, seconds, problems)}."""

    def timed(fn, *args):
        t0 = time.perf_counter()
        value = fn(*args)
        return value, time.perf_counter() - t0

    # The tests run on the solutions and on the stubs through the check cells of the two
    # notebooks (as a student's check cell runs them), recorded test by test.
    walk_report = BUILD / "check" / "walk" / f"{lesson.stem}.json"
    walk_report.parent.mkdir(parents=True, exist_ok=True)
    walk_report.unlink(missing_ok=True)
    jobs = {
        "reference": pool.submit(timed, run_tests, lesson, "reference", (), {"MT_WALK": str(walk_report)}),
        "notebook": pool.submit(timed, execute_notebook, lesson, BUILD / "check", True),
        "stub nb": pool.submit(timed, execute_notebook, lesson, BUILD / "check", True, True),
    }
    stages: dict[str, tuple[bool, float, list[str], int]] = {}
    ref, t = jobs["reference"].result()
    stages["reference"] = (t, _all_pass(ref) + _coverage(ref), len(ref.tests))
    stages["walk"] = _walk_stage(lesson, walk_report)
    t0 = time.perf_counter()
    iso_problems = []
    futures = {ex.id: pool.submit(run_tests, lesson, f"only:{ex.id}", [f"--exercise={ex.id}"])
               for ex in ref.exercises() if ex.tests}
    for ex_id, fut in futures.items():
        res = fut.result()
        bad = [t for t in res.tests if t["outcome"] not in ("passed", "skipped")] + [{"name": p, "message": ""} for p in res.problems]
        if bad:
            iso_problems.append(f"exercise {ex_id} alone does not pass its tests: {bad[0]['name']}: {bad[0]['message']}")
    stages["isolation"] = (time.perf_counter() - t0, iso_problems, len(futures))
    for stage, stub in (("notebook", False), ("stub nb", True)):
        (ok, message, checks, tests), t = jobs[stage].result()
        result = LessonResult(lesson, "stub" if stub else "solution", tests, [], "")
        problems = [] if ok else [f"{'stub' if stub else 'solution'} notebook failed:\n{message}"]
        problems += _check_cell_problems(checks, lesson, stub=stub)
        problems += _stub_problems(result) if stub else _all_pass(result)
        if len(tests) != len(ref.tests):
            problems.append(f"its check cells ran {len(tests)} tests; the lesson has {len(ref.tests)}")
        stages[stage] = (t, problems, len(tests))
    return stages


def serialise_ast_parse() -> None:
    """Make every `ast.parse` in this process take one lock. CPython 3.11's AST constructor is
    not thread-safe ("SystemError: AST constructor recursion depth mismatch", python/cpython#106905),
    and `make check` builds notebooks in two threads while the libraries it uses parse too
    (jupytext's cell metadata goes through `ast.literal_eval`, 3.11's tracebacks through
    `ast.parse`). A lock in our own code alone did not stop it: CI hit it in lesson 12."""
    import ast

    if getattr(ast.parse, "serialised", False):
        return
    lock, parse = threading.RLock(), ast.parse

    def locked_parse(*args, **kwargs):
        with lock:
            return parse(*args, **kwargs)

    locked_parse.serialised, locked_parse.lock = True, lock
    ast.parse = locked_parse


def machinery_shards() -> list[list[str]]:
    """tests/machinery's test files, as paths from the root, in the pytest processes that run them
    beside the lessons: one. (Two shards kept both cores busy but slowed the lessons more than they
    gained: make check took 1,300 s or more against 1,068 s with one.)"""
    return [sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "machinery").glob("test_*.py"))]


def check(lessons: list[Lesson], machinery: bool = True) -> int:
    serialise_ast_parse()
    start = time.perf_counter()
    failures = 0
    print("== build sync", flush=True)
    failures += subprocess.run([sys.executable, "-m", "course.build", "--check"], cwd=ROOT).returncode != 0
    machinery_runs = []
    if machinery:  # mostly waiting on the time limits it tests: runs beside the lessons
        import tempfile

        t_mach = time.perf_counter()
        for shard, files in enumerate(machinery_shards()):
            walk = BUILD / "check" / "walk" / f"machinery-{shard}.json"  # the machinery's tests of given code feed the walk
            walk.parent.mkdir(parents=True, exist_ok=True)
            walk.unlink(missing_ok=True)
            log = tempfile.TemporaryFile("w+")
            machinery_runs.append((subprocess.Popen([sys.executable, "-m", "pytest", "-q", "--no-header", "-p",
                                                     "no:cacheprovider", *files], cwd=ROOT, stdout=log,
                                                    stderr=subprocess.STDOUT, env={**os.environ, "MT_WALK": str(walk)}),
                                   log, time.perf_counter()))
    rows = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for lesson in lessons:
            print(f"== lesson {lesson.stem}", flush=True)
            stages = check_lesson(lesson, pool)
            for stage, (t, problems, n) in stages.items():
                status = "ok" if not problems else "FAIL"
                failures += bool(problems)
                unit = {"isolation": "exercises", "walk": "callables"}.get(stage, "tests")
                print(f"   {stage:<10} {status:<4} {n:>3} {unit:<9} {t:6.1f} s")
                for p in problems:
                    print("      " + p.replace("\n", "\n      "))
            rows.append((lesson.stem, stages))
    if machinery:
        failures += browser_check()
    for shard, (proc, log, _) in enumerate(machinery_runs):
        rc = proc.wait()
        log.seek(0)
        part = f", part {shard + 1} of {len(machinery_runs)}" if len(machinery_runs) > 1 else ""
        print(f"\n== machinery tests{part} ({time.perf_counter() - t_mach:.0f} s, beside the lessons)")
        print(log.read().rstrip())
        failures += rc != 0
    failures += walk_summary(lessons, machinery)
    total = time.perf_counter() - start
    print("\n== summary")
    print(f"{'lesson':<22}{'tests':>6}{'ref':>6}{'walk':>6}{'iso':>6}{'sol nb':>8}{'stub nb':>9}")
    for stem, st in rows:
        cells = ["ok" if not st[s][1] else "FAIL" for s in ("reference", "walk", "isolation", "notebook", "stub nb")]
        print(f"{stem:<22}{st['reference'][2]:>6}{cells[0]:>6}{cells[1]:>6}{cells[2]:>6}{cells[3]:>8}{cells[4]:>9}")
    print(f"make check: {'FAILED' if failures else 'passed'} in {total:.0f} s")
    return 1 if failures else 0


# The browser test in `make check`: a stub notebook of each kind of lesson (CPU, simulated CUDA,
# CUDA C, MPI), and one solution notebook whose progress bars and plots must render.
BROWSER_STUBS = ["01", "07", "08", "12"]
BROWSER_SOLUTION = "03"


def browser_check() -> int:
    """Run course.browser as `make check` does; 1 if it failed (or could not run under CI)."""
    print("\n== browser: Run All in JupyterLab in Chromium", flush=True)
    t0 = time.perf_counter()
    runs = [[*BROWSER_STUBS], ["--solution", BROWSER_SOLUTION, "--expect-plots", "1", "--expect-progress", "1"]]
    failed = 0
    for args in runs:
        rc = subprocess.run([sys.executable, "-m", "course.browser", *args], cwd=ROOT).returncode
        if rc == 2:  # cannot run here (no Chromium or Playwright), and not required: said why
            return 0
        failed += rc != 0
    print(f"   browser test {'FAILED' if failed else 'ok'} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


def demo(lesson: Lesson) -> int:
    out = BUILD / "demo"
    print(f"executing solutions/{lesson.stem}.py at full size -> {out.relative_to(ROOT)}/{lesson.stem}.ipynb")
    ok, message, _, _ = execute_notebook(lesson, out, small=False)
    print("done" if ok else message)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["check", "demo"])
    ap.add_argument("lessons", nargs="*")
    args = ap.parse_args(argv)
    lessons = [find_lesson(k) for k in args.lessons] if args.lessons else all_lessons()
    if args.command == "demo":
        if len(lessons) != 1:
            ap.error("make demo takes one lesson: make demo L=05")
        return demo(lessons[0])
    return check(lessons, machinery=not args.lessons)


if __name__ == "__main__":
    sys.exit(main())
