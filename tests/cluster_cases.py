"""Run a test file's key cases on an emulated cluster and compare them with the simulator's two-level
topology (lessons 12, 13 and 16; not a test file itself).

A test file names its cases in a dict `{test name: case(lesson) -> (job, args)}`; `job(comm, *args)`
runs on every rank of 2 nodes x 2 ranks. `run_cluster_cases` runs the cases the session selected on
the simulator (`nodes=2`), then, where this machine can make an emulated cluster
(course.cluster.cluster_status: Linux, root), starts one cluster of 2 nodes x 2 ranks for the whole
file and sends the cases that passed on the simulator to one `mpiexec` launch across it: each case
runs between barriers, rank 0 reading every rank's NIC counters (the veths') before and after it.
The cluster is removed when the launch ends. `check(name)` on the result: the simulator's failure
re-raised; a skip naming why where no cluster can be made; else MPI's results equal the simulator's
rank by rank, bit for bit, and each rank's NIC sent at least the bytes the simulator says the rank
sent to other nodes, and at most that plus the communicator's headers (64 bytes a message), 2% and
4 KiB (TCP/IP and UCX headers, the ACKs of what it receives, the barriers) and two full segments (on
a busy machine TCP now and then sends a segment again: a tail loss probe fires after a few ms).

Test files get it from the `test_helper` fixture (tests/conftest.py); its functions travel to the MPI
ranks by value, as mpi_cases' do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

NODES, PPN = 2, 2
MTU = 9000  # course.cluster's: a retransmitted TCP segment is at most this (tail loss probes on a busy machine)
LINKS = dict(alpha=3e-6, beta=2e-10, alpha_inter=2e-5, beta_inter=2e-9)  # the simulator's two levels here


def measured(comm: Any, nics: list[str], cases: dict[str, tuple[Callable, tuple]]) -> dict[str, Any]:
    """On the cluster: every case between barriers; rank 0 returns, per case, (result, bytes each
    rank's NIC sent while it ran); the other ranks (result, None)."""
    from course.cluster import read_nic_bytes

    out = {}
    for name, (job, args) in cases.items():
        comm.barrier()
        before = read_nic_bytes(nics) if comm.rank == 0 else None
        comm.barrier()
        result = job(comm, *args)
        comm.barrier()
        sent = [a[0] - b[0] for a, b in zip(read_nic_bytes(nics), before)] if comm.rank == 0 else None
        out[name] = (result, sent)
    return out


def across(res: Any) -> tuple[list[int], list[int]]:
    """Per rank of a simulated run on several nodes: (bytes, messages) it sent to other nodes."""
    msgs = [sum(res.node_of(e.peer) != res.node_of(r) for e in res.events(rank=r, kind="send"))
            for r in range(res.nranks)]
    return res.bytes_between_nodes(), msgs


@dataclass
class ClusterRuns:
    lesson: Any
    sim_out: dict[str, Any]
    mpi_out: Any
    why: str = ""
    sim_runs: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str) -> None:
        """The test of one case (see the module docstring)."""
        assert_same = _mpi_cases().assert_same
        if isinstance(self.sim_out[name], Exception):
            raise self.sim_out[name]
        if self.why:
            pytest.skip(self.why)
        if isinstance(self.mpi_out, Exception):
            raise self.mpi_out
        res = self.sim_runs[name]
        for r in range(NODES * PPN):
            assert_same(res.results[r], self.mpi_out[r][name][0],
                        f"{name}, on an emulated cluster of {NODES} nodes x {PPN} ranks, rank {r}")
        nic = self.mpi_out[0][name][1]
        want, msgs = across(res)
        for r in range(NODES * PPN):
            top = want[r] + 64 * msgs[r] + 0.02 * want[r] + 4096 + 2 * MTU
            assert want[r] <= nic[r] <= top, (
                f"{name}: rank {r}'s NIC sent {nic[r]} bytes (its veth's counter), but on the simulator the rank "
                f"sent {want[r]} bytes in {msgs[r]} messages to ranks on the other node: expected between {want[r]} "
                f"and {top:.0f} (headers, TCP/IP, ACKs, the barriers, two retransmitted segments). Every rank's "
                f"NIC: {nic}; the simulator's count: {want}")


def _mpi_cases() -> Any:
    """tests/mpi_cases.py (its assert_same), loaded by path as tests/conftest.py loads helpers."""
    import importlib.util
    import sys
    from pathlib import Path

    key = "minitorch_tests_mpi_cases"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name("mpi_cases.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def run_cluster_cases(lesson: Any, request: Any, cases: dict[str, Callable], timeout: float = 120,
                      exercise: str | None = None) -> Any:
    """Run the selected cases (of `exercise` if given) on the simulator (nodes=2) and, where a cluster
    can be made, on one. A lesson graded `isolated`: each exercise's, when one of them is checked."""
    from course.loader import Isolated
    from course.pytest_plugin import exercise_of, timed_out

    if isinstance(lesson, Isolated):
        return _mpi_cases().PerExercise(lambda ex: run_cluster_cases(lesson.namespace, request, cases, timeout, ex))
    items, wanted = _mpi_cases().selected(request, cases, exercise)
    sim_out, sim_runs, ready = {}, {}, {}
    for name in wanted:
        if timed_out(exercise_of(items[name])):
            sim_out[name] = RuntimeError(f"{name}: not run, its exercise already ran past its time limit")
            continue
        job, args = cases[name](lesson)
        try:
            res = lesson.run(job, NODES * PPN, *args, engine="sim", nodes=NODES, **LINKS)
            sim_out[name], sim_runs[name] = res.results, res
            ready[name] = (job, args)
        except Exception as exc:  # noqa: BLE001 - reported by the case's own test
            sim_out[name] = exc
    from course.cluster import ClusterUnavailable, EmulatedCluster, cluster_status

    ok, why = cluster_status()
    runs = ClusterRuns(lesson, sim_out, None, "" if ok else f"no emulated cluster here: {why}", sim_runs)
    if ok and ready:
        try:
            with EmulatedCluster(NODES, PPN, link="4gbit") as cluster:
                runs.mpi_out = lesson.run(measured, NODES * PPN, cluster.nics(), ready, engine="mpi", nodes=NODES,
                                          timeout=timeout).results
        except ClusterUnavailable as exc:
            runs.why = f"no emulated cluster here: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported by every case's test
            runs.mpi_out = exc
    return runs
