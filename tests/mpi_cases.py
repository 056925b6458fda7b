"""Run a test file's key cases on real MPI and compare them with the simulator (lessons 12 and
13; not a test file itself).

A test file names its cases in a dict `{test name: case(lesson) -> (job, args)}`; `job(comm,
*args)` runs on every rank. `run_cases` runs the cases the session selected on the simulator with
2 and 4 ranks, then sends those that passed there to one `mpiexec -n 4` launch, which runs each on
the 4 ranks and again on ranks 0 and 1 as a group of 2 (`comm.group`). A case that fails on the
simulator is not sent to MPI (it would hang); its own test reports the failure. `check(name)` on
the result asserts that MPI gave, rank by rank, exactly what the simulator gave, bytes sent
included.

Test files get it from the `test_helper` fixture (tests/conftest.py). Its functions travel to the MPI ranks by value: `minitorch.comm` ships
every module of the repository outside minitorch/ and course/ that way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest


def with_bytes(comm: Any, job: Callable, args: tuple) -> tuple[Any, int]:
    """job(comm, *args) and the bytes this rank sent while it ran."""
    before = comm.stats["bytes_sent"]
    out = job(comm, *args)
    return out, comm.stats["bytes_sent"] - before


def batch_job(comm: Any, cases: dict[str, tuple[Callable, tuple]]) -> dict[int, dict[str, Any]]:
    """Every case on 4 ranks, then on ranks 0 and 1 as a group of 2 (one launch for both sizes)."""
    out = {4: {name: with_bytes(comm, job, args) for name, (job, args) in cases.items()}}
    if comm.rank < 2:
        pair = comm.group([0, 1])
        out[2] = {name: with_bytes(pair, job, args) for name, (job, args) in cases.items()}
    return out


@dataclass
class CaseRuns:
    """The results of `run_cases`: per case, the simulator's results {n: per-rank results} or the
    exception it raised; MPI's results, the exception, or None when MPI cannot start or no case
    was ready."""

    lesson: Any
    sim_out: dict[str, Any]
    mpi_out: Any

    def check(self, name: str) -> None:
        """The test of one case: its simulator failure re-raised, a skip naming why MPI cannot
        start, or MPI's results equal to the simulator's on every rank of both sizes."""
        if isinstance(self.sim_out[name], Exception):
            raise self.sim_out[name]
        ok, why = self.lesson.mpi_status()
        if not ok:
            pytest.skip(f"MPI cannot start here: {why}")
        if isinstance(self.mpi_out, Exception):
            raise self.mpi_out
        for n in (2, 4):
            for r in range(n):
                where = f"{name}, mpiexec -n 4" + (", ranks 0 and 1 as a group of 2" if n == 2 else "") + f", rank {r}"
                assert_same(self.sim_out[name][n][r], self.mpi_out[r][n][name], where)


class PerExercise:
    """The runs of a lesson graded `isolated` (course.loader.Isolated): each exercise's cases run on
    the first check of one of them, with the namespace of that exercise alone."""

    def __init__(self, run: Callable[[str], Any]):
        self._run, self._runs = run, {}

    def check(self, name: str) -> None:
        from course.loader import Isolated

        if Isolated.exercise not in self._runs:
            self._runs[Isolated.exercise] = self._run(Isolated.exercise)
        self._runs[Isolated.exercise].check(name)


def selected(request: Any, cases: dict[str, Callable], exercise: str | None) -> tuple[dict, list[str]]:
    """({test name: item} of the session, the names of `cases` it selected, of `exercise` if given)."""
    from course.pytest_plugin import exercise_of

    items = {item.originalname: item for item in request.session.items}
    return items, [name for name in cases if name in items and exercise in (None, exercise_of(items[name]))]


def run_cases(lesson: Any, request: Any, cases: dict[str, Callable], sim: Callable, timeout: float,
              exercise: str | None = None) -> CaseRuns | PerExercise:
    """Run the cases the session selected (of `exercise` if given); sim(lesson, fn, n, *args) runs fn on
    the simulator with n ranks."""
    from course.loader import Isolated
    from course.pytest_plugin import exercise_of, timed_out

    if isinstance(lesson, Isolated):
        return PerExercise(lambda ex: run_cases(lesson.namespace, request, cases, sim, timeout, ex))
    items, wanted = selected(request, cases, exercise)
    sim_out, ready = {}, {}
    for name in wanted:
        if timed_out(exercise_of(items[name])):  # its test will not run: spare a second time limit
            sim_out[name] = RuntimeError(f"{name}: not run, its exercise already ran past its time limit")
            continue
        job, args = cases[name](lesson)
        try:
            sim_out[name] = {n: sim(lesson, with_bytes, n, job, args).results for n in (2, 4)}
            ready[name] = (job, args)
        except Exception as exc:  # noqa: BLE001 - reported by the case's own test
            sim_out[name] = exc
    mpi_out = None
    if ready and lesson.mpi_status()[0]:
        try:
            mpi_out = lesson.run(batch_job, 4, ready, engine="mpi", timeout=timeout).results
        except Exception as exc:  # noqa: BLE001 - reported by every case's test
            mpi_out = exc
    return CaseRuns(lesson, sim_out, mpi_out)


def assert_same(a: Any, b: Any, where: str) -> None:
    """a (simulator) and b (MPI) equal bit for bit: arrays of one dtype and shape, nested lists,
    tuples and dicts of them, or values that compare equal."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), \
            f"{where}: MPI gave {b!r}, the simulator {a!r}"
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: MPI gave {b!r}, the simulator {a!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: MPI gave {b!r}, the simulator {a!r}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, f"{where}: MPI gave {b!r}, the simulator {a!r}"

