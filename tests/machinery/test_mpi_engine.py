"""Lesson 12's MPI engine (minitorch.comm, engine="mpi"): its message semantics against the
simulator's, bit for bit; its deadlock reports; and that nothing survives a deadlock, a time
limit, a Ctrl-C or the death of the process that called `run`. Each MPI launch costs 1-2 s here,
so every test makes one (two for the interrupt tests: one per signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from minitorch import comm as mc

REPO = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.skipif(not mc.mpi_status()[0], reason=f"MPI cannot start here: {mc.mpi_status()[1]}")


def kill_left(marker: str) -> list[str]:
    """Kill (SIGKILL) the processes whose command line contains `marker`; return what they were,
    so that a failing test leaves nothing spinning."""
    left = job_processes(marker)
    for line in left:
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    return left


def job_processes(marker: str) -> list[str]:
    """'pid cmdline' of every process whose command line contains `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if marker.encode() in cmd and int(pid) != os.getpid():
            found.append(pid + " " + cmd.replace(b"\0", b" ").decode(errors="replace")[:200])
    return found


@pytest.fixture
def job_dir(tmp_path, monkeypatch):
    """MPI jobs' files (and so their processes' command lines) under tmp_path; afterwards, none
    of their processes may be left."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    left = kill_left(str(tmp_path))
    assert not left, "processes of the MPI job are still running:\n" + "\n".join(left)


# (array, view): rank 0 sends view(its own copy of array), then zeroes that copy
CASES = [(np.float64(3.5), None), (np.array(-2, np.int16), None), (np.zeros((0, 3)), None),
         (np.zeros(0, np.uint8), None),
         (np.arange(24.0).reshape(4, 6), lambda a: a[:, ::2]),                 # not contiguous
         (np.arange(3000, dtype=np.float32).reshape(10, 300), lambda a: a.T),  # transposed, 12000 bytes
         (np.arange(mc._INLINE // 8, dtype=np.float64), None),                 # exactly the inline limit
         (np.arange(mc._INLINE // 8 + 1, dtype=np.float64), lambda a: a[::-1]),  # just past it, reversed
         (np.ones((3, 5000), np.complex128) * (1 + 2j), None), (np.array([True, False, True]), None),
         (np.arange(6, dtype=">i4"), None), (np.arange(7, dtype=np.uint64) * 2**60, None),
         (np.linspace(0, 1, 72).reshape(2, 3, 1, 2, 2, 3), None)]


def sent(i, array):
    view = CASES[i][1]
    return array if view is None else view(array)


def semantics(comm):
    """Rank 0 sends every case with its own tag, zeroing its array right after the send
    (buffered sends), then 200 small messages with one tag; rank 1 receives the cases' tags in
    reverse order (matching by tag), then the 200 in order, then answers."""
    if comm.rank == 0:
        for i, (array, _) in enumerate(CASES):
            mine = np.array(array)
            comm.send(sent(i, mine), 1, tag=i)
            mine[...] = 0
        for k in range(200):
            comm.send(np.full(3, k), 1, tag=99)
        return comm.recv(1, tag=7)
    got = {i: comm.recv(0, tag=i) for i in reversed(range(len(CASES)))}
    stream = [int(comm.recv(0, tag=99)[0]) for _ in range(200)]
    comm.send(np.arange(5), 0, tag=7)
    return [got[i] for i in range(len(CASES))], stream


def test_messages_match_the_simulator_bit_for_bit(job_dir):
    sim = mc.run(semantics, 2)
    real = mc.run(semantics, 2, engine="mpi", timeout=60)
    arrays, stream = real.results[1]
    assert stream == list(range(200)), f"messages with one tag must arrive in the order sent, got {stream}"
    for i, (a, b) in enumerate(zip(sim.results[1][0], arrays)):
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b), \
            f"case {i}: MPI gave {b.dtype} {b.shape} {b!r}, the simulator {a.dtype} {a.shape} {a!r}"
        expected = sent(i, np.asarray(CASES[i][0]))
        assert b.dtype == expected.dtype and b.shape == expected.shape and np.array_equal(b, expected), \
            f"case {i}: rank 1 got {b!r}, rank 0 sent {expected!r} (and changed its array after the send)"
        assert b.flags.c_contiguous and b.flags.writeable, f"case {i}: {b.flags}"
    assert np.array_equal(real.results[0], np.arange(5))
    assert real.stats[0]["msgs_sent"] == sim.stats[0]["msgs_sent"] == len(CASES) + 200
    assert real.stats[0]["bytes_sent"] == sim.stats[0]["bytes_sent"]
    assert real.stats[1]["recv_from"] == sim.stats[1]["recv_from"]
    for r in range(2):  # the timeline: the same messages, in the same order, as Events
        def messages(res):
            return [(e.kind, e.peer, e.nbytes, e.tag) for e in res.events(r) if e.kind in ("send", "recv")]
        assert messages(real) == messages(sim), f"rank {r}'s timeline of messages differs from the simulator's"
        assert all(isinstance(e, mc.Event) and e.end >= e.start for e in real.events(r))


def typed_semantics(comm):
    """isend/irecv: rank 0 isends every case with its own tag (then waits), then 200 small messages on
    one tag; rank 1 posts the cases' irecvs in reverse tag order into arrays it allocates, and the
    200 in order, waits for them in reverse, then two irecvs on one tag waited for in reverse order."""
    if comm.rank == 0:
        reqs = [comm.isend(sent(i, np.array(array)), 1, tag=i) for i, (array, _) in enumerate(CASES)]
        reqs += [comm.isend(np.full(3, k), 1, tag=99) for k in range(200)]
        comm.waitall(reqs)
        a, b = comm.isend(np.array([1.0]), 1, tag=5), comm.isend(np.array([2.0]), 1, tag=5)
        comm.waitall([b, a])
        return None
    outs, reqs = {}, []
    for i in reversed(range(len(CASES))):
        like = sent(i, np.asarray(CASES[i][0]))
        outs[i] = np.empty(like.shape, like.dtype)
        reqs.append(comm.irecv(outs[i], 0, tag=i))
    stream = np.empty((200, 3), np.int64)
    reqs += [comm.irecv(stream[k], 0, tag=99) for k in range(200)]
    comm.waitall(reqs[::-1])
    first, second = np.empty(1), np.empty(1)
    p, q = comm.irecv(first, 0, tag=5), comm.irecv(second, 0, tag=5)
    q.wait()
    p.wait()
    return [outs[i] for i in range(len(CASES))], stream[:, 0].tolist(), (first[0], second[0]), p.done and q.done


def test_isend_irecv_match_the_simulator_bit_for_bit(job_dir):
    sim = mc.run(typed_semantics, 2)
    real = mc.run(typed_semantics, 2, engine="mpi", timeout=60)
    for res in (sim, real):
        arrays, stream, pair, done = res.results[1]
        assert stream == list(range(200)), f"{res.engine}: irecvs on one tag match isends in order, got {stream}"
        assert pair == (1.0, 2.0) and done, f"{res.engine}: irecvs match in the order posted, got {pair}"
        for i, got in enumerate(arrays):
            want = sent(i, np.asarray(CASES[i][0]))
            assert got.dtype == want.dtype and np.array_equal(got, want), f"{res.engine}, case {i}: {got!r} != {want!r}"
    for key in ("msgs_sent", "bytes_sent", "sent_to"):
        assert real.stats[0][key] == sim.stats[0][key], key
    for key in ("msgs_recv", "bytes_recv", "recv_from"):
        assert real.stats[1][key] == sim.stats[1][key], key

    def messages(res, r):
        return sorted((e.kind, e.peer, e.nbytes, e.tag) for e in res.events(r) if e.kind in ("send", "recv"))
    assert all(messages(real, r) == messages(sim, r) for r in range(2)), "the timelines' messages differ"


def typed_short(comm):
    if comm.rank == 0:
        comm.isend(np.ones(3), 1, tag=4).wait()
    else:
        comm.irecv(np.empty((2, 2)), 0, tag=4).wait()


def typed_long(comm):
    if comm.rank == 0:
        comm.isend(np.ones(5), 1).wait()
    else:
        comm.irecv(np.empty(4), 0).wait()


def typed_unwaited(comm):
    if comm.rank == 0:
        comm.isend(np.ones(5), 1)
    else:
        comm.irecv(np.empty(5), 0).wait()


def typed_to_recv(comm):
    if comm.rank == 0:
        comm.isend(np.ones(5), 1).wait()
    else:
        comm.recv(0)


@pytest.mark.parametrize("engine", ["sim", "mpi"])
def test_isend_irecv_errors_name_the_ranks_and_sizes(job_dir, engine):
    kw = {"timeout": 60} if engine == "mpi" else {}
    with pytest.raises(ValueError, match=r"rank 1: irecv\(src=0, tag=4\) into shape \(2, 2\), dtype float64 "
                       r"\(32 bytes\), but rank 0 sent .*24 bytes"):
        mc.run(typed_short, 2, engine=engine, **kw)
    with pytest.raises(ValueError, match=r"rank 1: irecv\(src=0, tag=0\) into shape \(4,\).*\(32 bytes\), but rank 0 "
                       r"sent (more than 32 bytes|.*40 bytes)"):
        mc.run(typed_long, 2, engine=engine, **kw)
    with pytest.raises(RuntimeError, match=r"rank 0 returned with 1 isend/irecv request\(s\) not completed"):
        mc.run(typed_unwaited, 2, engine=engine, **kw)
    with pytest.raises(mc.DeadlockError, match=r"rank 1 waits in recv\(src=0, tag=0\)"):
        mc.run(typed_to_recv, 2, engine=engine, **kw)
    with pytest.raises(ValueError, match=r"rank 0: irecv\(\) receives into a C-contiguous array"):
        mc.run(lambda comm: comm.irecv(np.empty((4, 4))[:, 1], 0), 1, engine=engine, **kw)
    with pytest.raises(TypeError, match=r"rank 0: waitall\(\) takes requests returned by isend/irecv, got 3"):
        mc.run(lambda comm: comm.waitall([3]), 1, engine=engine, **kw)
    got = mc.run(typed_any_iterable, 2, engine=engine, **kw).results
    assert got == [1.0, 0.0], f"{engine}: waitall of a generator, then of repeated and completed requests: {got}"
    if engine == "sim":  # what MPI cannot see: the simulator is where such bugs are found
        with pytest.raises(ValueError, match=r"rank 0: the array of isend\(dst=1, tag=0\) changed before the request "
                           r"completed"):
            mc.run(typed_changed, 2)
        with pytest.raises(ValueError, match=r"rank 0: irecv\(src=0, tag=0\) into shape \(4,\) overlaps the array of"):
            mc.run(typed_overlap, 1)
        with pytest.raises(ValueError, match=r"rank 1: irecv\(src=0, tag=0\) into shape \(4,\), dtype float64 .*"
                           r"but rank 0 sent shape \(4,\), dtype int64"):
            mc.run(typed_dtype, 2)


def typed_any_iterable(comm):
    other, out = 1 - comm.rank, np.empty(3)
    a, b = comm.irecv(out, other), comm.isend(np.full(3, float(comm.rank)), other)
    comm.waitall(q for q in (a, b))
    comm.waitall([a, b, a])
    a.wait()
    return out[0]


def typed_changed(comm):
    x = np.ones(4)
    if comm.rank == 0:
        req = comm.isend(x, 1)
        x[0] = 5
        req.wait()
    else:
        comm.irecv(np.empty(4), 0).wait()


def typed_overlap(comm):
    out = np.empty(8)
    comm.irecv(out[:5], 0)
    comm.irecv(out[4:], 0)


def typed_dtype(comm):
    if comm.rank == 0:
        comm.isend(np.ones(4, np.int64), 1).wait()
    else:
        comm.irecv(np.empty(4), 0).wait()


def exchange_waited_in(comm, order):
    """Every rank irecvs a block from every other and isends one to every other (pairwise order),
    then waits for the requests in `order` ("posted" or "reversed")."""
    n, r = comm.size, comm.rank
    out = np.zeros((n, 100))
    reqs = [comm.irecv(out[(r - s) % n], (r - s) % n) for s in range(1, n)]
    reqs += [comm.isend(np.full(100, float(r)), (r + s) % n) for s in range(1, n)]
    comm.waitall(reqs if order == "posted" else reqs[::-1])
    return out


def test_simulated_time_does_not_depend_on_the_order_of_the_waitall_list():
    a, b = (mc.run(exchange_waited_in, 5, order, alpha=1e-6, beta=1e-9) for order in ("posted", "reversed"))
    want = 4 * (1e-6 + 800 * 1e-9)
    assert a.time == b.time and abs(a.time - want) < 1e-12, (a.time, b.time, want)
    assert all(np.array_equal(x, y) for x, y in zip(a.results, b.results))


def test_the_mpi_timeline_is_one_list_in_time_order(job_dir):
    """MPIComm records messages as tuples and makes Events when `events` is read: code that appends
    its own Events (lesson 13's compute intervals) keeps them, in order."""
    def fn(comm):
        other = 1 - comm.rank
        comm.send(np.arange(3), other)
        comm.recv(other)
        comm.events.append(mc.Event(comm.rank, "compute", comm.time, comm.time, label="mine"))
        comm.send(np.arange(2000.0), other)
        comm.recv(other)
        same = comm.events is comm.events
        return same, [(e.kind, e.label) for e in comm.events]
    res = mc.run(fn, 2, engine="mpi", timeout=60)
    for same, kinds in res.results:
        assert same and kinds == [("send", ""), ("recv", ""), ("compute", "mine"), ("send", ""), ("recv", "")], kinds


def shifts(comm):
    """Each rank exchanges arrays around the ring with sendrecv (and within a group of ranks 0
    and 2), zeroing each right after the call. Returns what it received and, on MPI, how many
    private copies of the arrays the engine held (sendrecv needs none)."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got, copies = [], 0
    for k, n in enumerate([mc._INLINE // 8, mc._INLINE // 8 + 1, 5000, 300_000]):
        mine = np.arange(n, dtype=np.float64) * (comm.rank + 1) + k
        got.append(comm.sendrecv(mine, right, left, tag=k))
        if comm.engine == "mpi":
            copies += sum(isinstance(b, np.ndarray) and b.nbytes == mine.nbytes for _, b in comm._pending)
        mine[...] = 0
    odd = np.arange(20_000, dtype=np.int32).reshape(100, 200).T  # not contiguous: sent as send does
    got.append(comm.sendrecv(odd, right, left, tag=9))
    if comm.rank in (0, 2):
        g = comm.group([0, 2])
        got.append(g.sendrecv(np.full(4000, comm.rank, np.int64), 1 - g.rank, 1 - g.rank, tag=11))
    return got, copies


def test_sendrecv_sends_without_a_copy_and_matches_the_simulator(job_dir):
    sim = mc.run(shifts, 3)
    real = mc.run(shifts, 3, engine="mpi", timeout=60)
    for r in range(3):
        want, _ = sim.results[r]
        got, copies = real.results[r]
        assert len(got) == len(want)
        for a, b in zip(want, got):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"rank {r}: {b!r} != {a!r}"
        assert copies == 0, f"rank {r}: sendrecv kept {copies} private copies of arrays over the inline limit"
    assert real.stats[0]["bytes_sent"] == sim.stats[0]["bytes_sent"]


def allreduce_faults(comm, nbytes):
    """Minor page faults per ring all-reduce of nbytes, after three warm-up calls."""
    import resource

    from minitorch.parallel import ring_allreduce

    x = np.random.default_rng(comm.rank).standard_normal(nbytes // 8)
    for _ in range(3):
        ring_allreduce(comm, x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        ring_allreduce(comm, x)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (MPI_ENV) are Linux's")
def test_ranks_keep_freed_memory_mapped(job_dir):
    """A 4 MiB all-reduce makes arrays of 2 and 4 MiB; glibc gave each back to the kernel when
    freed, and the next faulted on every page (about 2,000 faults per call): MPI_ENV keeps them."""
    faults = mc.run(allreduce_faults, 2, 4 << 20, engine="mpi", timeout=60).results
    assert max(faults) < 100, f"minor page faults per 4 MiB all-reduce, per rank: {faults}"


def affinity(comm):
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no sched_getaffinity on this OS")
def test_ranks_are_pinned_one_core_each_in_turn(job_dir):
    if not mc._MPI_BIND:
        pytest.skip("Hydra cannot bind ranks to cores here (mpi_status fell back to unpinned ranks)")
    cores = sorted(os.sched_getaffinity(0))
    got = mc.run(affinity, 4, engine="mpi", timeout=60).results
    assert all(len(a) == 1 for a in got), f"each rank on one core, got affinities {got}"
    if len(cores) >= 2:
        assert got[0] != got[1], f"ranks 0 and 1 on different cores, got {got}"


def test_mpi_status_falls_back_to_unpinned_ranks(monkeypatch):
    """Where Hydra cannot bind (no topology support), mpi_status must still start MPI, unpinned."""
    launched = []

    def launch(cmd, timeout, watch=None):
        launched.append(cmd)
        return (1, "hwloc: cannot bind") if "-bind-to" in cmd else (0, "MPICH Version: test\n")

    monkeypatch.setattr(mc, "_MPI_STATUS", None)
    monkeypatch.setattr(mc, "_MPI_BIND", ["-bind-to", "core"])
    monkeypatch.setattr(mc, "_launch", launch)
    assert mc.mpi_status() == (True, "MPICH Version: test")
    assert mc._MPI_BIND == [] and len(launched) == 2 and "-bind-to" not in launched[1]


def sendrecv_before_its_receiver(comm):
    """Rank 0's sendrecv returns only once rank 1 has received its message, but rank 1 first waits
    for a message rank 0 sends after the sendrecv: MPI may hang here, so both engines must say so."""
    if comm.rank == 0:
        comm.sendrecv(np.zeros(100_000), 1, 1, tag=0)
        comm.send(np.ones(2), 1, tag=1)
    else:
        comm.send(np.ones(3), 0)
        comm.recv(0, tag=1)
        comm.recv(0, tag=0)


@pytest.mark.parametrize("engine", ["sim", "mpi"])
def test_a_sendrecv_waits_for_its_receiver_on_both_engines(job_dir, engine):
    t0 = time.monotonic()
    with pytest.raises(mc.DeadlockError) as info:
        mc.run(sendrecv_before_its_receiver, 2, engine=engine, timeout=60)
    text = str(info.value)
    assert "rank 0 waits in sendrecv(dst=1, tag=0) until rank 1 receives its message" in text, text
    assert "rank 1 waits in recv(src=0, tag=1)" in text and "cycle: rank 0 -> rank 1 -> rank 0" in text, text
    assert time.monotonic() - t0 < 15, "the launcher should see this deadlock long before the time limit"


def orphan_sendrecv(comm):
    if comm.rank == 0:
        comm.sendrecv(np.zeros(100_000), 1, 1)
    else:
        comm.send(np.ones(3), 0)


def test_a_sendrecv_to_a_rank_that_returned_is_reported(job_dir):
    with pytest.raises(mc.DeadlockError) as info:
        mc.run(orphan_sendrecv, 2, engine="mpi", timeout=60)
    text = str(info.value)
    assert "rank 0 waits in sendrecv(dst=1, tag=0) until rank 1 receives its message, at " in text, text
    assert "but rank 1 has returned: that message will never be received" in text, text


def irecv_from_returned(comm):
    if comm.rank == 1:
        comm.irecv(np.empty(3), 0, tag=2).wait()


def irecv_cycle(comm):
    comm.waitall([comm.irecv(np.empty(3), 1 - comm.rank, tag=1)])


@pytest.mark.parametrize("engine", ["sim", "mpi"])
def test_a_waitall_that_cannot_complete_is_named(job_dir, engine):
    with pytest.raises(mc.DeadlockError) as info:
        mc.run(irecv_from_returned, 2, engine=engine, timeout=60)
    text = str(info.value)
    assert "rank 1 waits in waitall: irecv(src=0, tag=2)" in text and "rank 0 has" in text, text
    with pytest.raises(mc.DeadlockError) as info:
        mc.run(irecv_cycle, 2, engine=engine, timeout=60)
    text = str(info.value)
    assert all(f"rank {r} waits in waitall: irecv(src={1 - r}, tag=1)" in text for r in range(2)), text
    assert "cycle: rank 0 -> rank 1 -> rank 0" in text, text


def cycle(comm):
    comm.recv((comm.rank + 1) % comm.size, tag=3)


def test_a_deadlock_names_every_rank_and_is_found_early(job_dir):
    t0 = time.monotonic()
    with pytest.raises(mc.DeadlockError) as info:
        mc.run(cycle, 3, engine="mpi", timeout=60)
    took = time.monotonic() - t0
    text = str(info.value)
    for r in range(3):
        assert f"rank {r} waits in recv(src={(r + 1) % 3}, tag=3), at {__file__}, line " in text, text
    assert "in cycle: `comm.recv((comm.rank + 1) % comm.size, tag=3)`" in text, text
    assert "cycle: rank 0 -> rank 1 -> rank 2 -> rank 0" in text, text
    assert "Output" not in text and "BAD TERMINATION" not in text and "====" not in text, text
    assert took < 15, f"a deadlock of 3 ranks took {took:.1f} s to report (limit 60 s): the launcher should see it"


def wrong_tag_then_barrier(comm):
    if comm.rank == 0:
        comm.send(np.ones(2), 1, tag=1)
        comm.barrier()
    elif comm.rank == 1:
        comm.recv(0, tag=2)
    return comm.rank


def test_a_wrong_tag_a_barrier_and_a_returned_rank(job_dir):
    with pytest.raises(mc.DeadlockError) as info:
        mc.run(wrong_tag_then_barrier, 3, engine="mpi", timeout=60)
    text = str(info.value)
    assert "rank 0 waits in barrier(), at " in text and "in wrong_tag_then_barrier: `comm.barrier()`" in text, text
    assert "rank 1 waits in recv(src=0, tag=2), at " in text and "rank 2 has returned" in text, text
    assert "sent but not received (wrong peer or tag?):\n    rank 0 -> rank 1: 1 message(s)" in text, text


def spin_and_wait(comm):
    if comm.rank == 0:
        while True:
            pass
    return comm.recv(0)


def test_a_time_limit_names_the_ranks_and_what_they_do(job_dir):
    with pytest.raises(mc.RunTimeoutError) as info:
        mc.run(spin_and_wait, 2, engine="mpi", timeout=5)
    text, err = str(info.value), info.value
    assert err.ranks == [0, 1] and err.time_limit == 5, (err.ranks, err.time_limit)
    assert "rank 0 had not returned; near the limit it was at " in text and "`while True:`" in text, text
    assert "rank 1 waits in recv(src=0, tag=0), at " in text and "in spin_and_wait" in text, text
    assert "killed with all its processes" in text, text


INTERRUPTED = r"""
import signal, sys, time
from pathlib import Path
from minitorch import comm as mc

# Ctrl-C raises KeyboardInterrupt, as in a terminal or a Jupyter kernel, even where this test was
# started in the background of a non-interactive shell (which ignores SIGINT, and children inherit it)
signal.signal(signal.SIGINT, signal.default_int_handler)

def job(comm, ready):
    Path(ready, f"rank{comm.rank}").touch()
    if comm.rank == 0:
        while True:      # busy in Python code
            pass
    return comm.recv(0)  # waits in MPI

mc.run(job, 3, sys.argv[1], engine="mpi", timeout=120)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "launcher-killed"])
def test_one_interrupt_stops_the_whole_job(tmp_path, sig):
    """Ctrl-C (SIGINT: KeyboardInterrupt where `run` waits) kills mpiexec and every rank; if the
    process that called `run` dies without a word (SIGKILL, a kernel restart), the ranks see it
    and exit, and mpiexec with them."""
    script, ready = tmp_path / "interrupted.py", tmp_path / "ready"
    script.write_text(INTERRUPTED)
    ready.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, str(script), str(ready)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(list(ready.iterdir())) == 3, f"the ranks did not start: {proc.communicate(timeout=60)[0]}"
        time.sleep(0.3)  # rank 1 and 2 are now waiting in recv, rank 0 spinning
        proc.send_signal(sig)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in out, out
    deadline = time.monotonic() + 5  # a rank's watchdog looks every 0.5 s
    while job_processes(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = kill_left(str(tmp_path))
    assert not left, f"after {sig.name} these processes of the MPI job still run:\n" + "\n".join(left)
