"""Lesson 12's communicator (minitorch.comm, given) where the lessons' tests do not reach it: the
non-blocking calls and every call of a process group (SubComm) on the simulator, the interface's
defaults, the timeline plot, and the contracts of the point-to-point calls on both engines.

The point-to-point calls check their own arguments (a wrapper per message would cost what a small
all-to-all costs, see MPIComm), so the table below is the contract of both engines: each bad call
is refused, naming the argument and the value, before anything is sent. MPIComm exists only inside
the processes of an MPI run, which the validation walk does not see: this file is where its
refusals are checked (one MPI launch, where MPI can start)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from minitorch import comm as mc


def p2p_and_groups(comm):
    """Ranks 0..3: isend/irecv/waitall on the world, then every call of the group {r, r ^ 1}."""
    r, n = comm.rank, comm.size
    out = np.empty((n - 1, 3))
    reqs = [comm.irecv(out[s - 1], (r - s) % n, tag=1) for s in range(1, n)]
    reqs += [comm.isend(np.full(3, float(r)), (r + s) % n, tag=1) for s in range(1, n)]
    comm.waitall(reqs)
    pair = comm.group(sorted({r, r ^ 1}))
    other = 1 - pair.rank
    pair.send(np.array([r]), other, tag=2)
    got = int(pair.recv(other, tag=2)[0])
    swapped = pair.sendrecv(np.array([10 * r]), other, other, tag=3)
    buf = np.empty(1)
    pair.waitall([pair.irecv(buf, other, tag=4), pair.isend(np.array([r + 0.5]), other, tag=4)])
    pair.compute(2e-3, kind="F", label="layer")
    before = comm.time
    mc.Communicator.compute(comm, 1.0)  # the interface's compute: a no-op (MPI's clock is the wall clock)
    still = comm.time == before
    default = mc.Communicator.sendrecv(comm, np.array([r]), r ^ 1, r ^ 1, tag=5)  # send, then recv
    work = pair.launch(lambda g, x: g.sendrecv(x, 1 - g.rank, 1 - g.rank, tag=6), np.array([r * 2]))
    pair.barrier()
    return out[:, 0].tolist(), got, int(swapped[0]), float(buf[0]), still, int(default[0]), int(work.wait()[0])


def test_nonblocking_calls_and_every_call_of_a_process_group():
    res = mc.run(p2p_and_groups, 4)
    for r, (world, got, swapped, buf, still, default, launched) in enumerate(res.results):
        assert world == [float((r - s) % 4) for s in range(1, 4)], (r, world)
        assert (got, swapped, buf, default, launched) == (r ^ 1, 10 * (r ^ 1), (r ^ 1) + 0.5, r ^ 1, 2 * (r ^ 1)), r
        assert still, "the interface's compute(1.0) must not move the clock"
    layer = res.events(kind="F")
    assert len(layer) == 4 and all(e.label == "layer" and e.duration == pytest.approx(2e-3) for e in layer)
    assert res.events(rank=3, stream="comm") and not res.events(kind="no such kind")
    with pytest.raises(ValueError, match=r"RunResult.events: rank must be in \[0, 4\) \(the run's ranks\), got 4"):
        res.events(rank=4)
    with pytest.raises(ValueError, match="RunResult.events: stream must be one of 'main', 'comm', got 'side'"):
        res.events(stream="side")


def test_the_timeline_plot_has_a_row_per_rank_and_stream():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = mc.run(p2p_and_groups, 4)
    ax = res.plot(title="p2p")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["rank 0", "rank 0 comm", "rank 1", "rank 1 comm", "rank 2", "rank 2 comm", "rank 3",
                      "rank 3 comm"], labels
    assert ax.get_title() == "p2p" and "simulated" in ax.get_xlabel()
    fig, ax2 = plt.subplots()
    assert mc.plot_timeline(res, ax=ax2) is ax2 and ax2.get_title() == "sim: 4 ranks"
    plt.close("all")
    with pytest.raises(TypeError, match="plot_timeline: result must be a RunResult, got 'p2p'"):
        mc.plot_timeline("p2p")


BAD_CALLS = [  # (call, error, message): rank 0 of 2 ranks; nothing may be sent
    (lambda c: c.send(np.ones(3), 2), ValueError, r"rank 0: dst=2 is not a rank of this communicator"),
    (lambda c: c.send("x", 1), TypeError, r"rank 0: send\(\)'s array must be a numeric NumPy array, got 'x'"),
    (lambda c: c.send(np.ones(3), 1, tag=-1), ValueError, r"rank 0: tag must be an int in \[0, 2\*\*20\), got -1"),
    (lambda c: c.recv(-1), ValueError, r"rank 0: src=-1 is not a rank"),
    (lambda c: c.recv(1, tag=2.5), ValueError, r"rank 0: tag must be an int .*, got 2.5"),
    (lambda c: c.sendrecv(np.ones(3), 1, 5), ValueError, r"rank 0: src=5 is not a rank"),
    (lambda c: c.sendrecv(np.ones(3), 1, 1, recvtag=2**20), ValueError, r"tag must be an int .*, got 1048576"),
    (lambda c: c.isend(None, 1), TypeError, r"send\(\)'s array must be a numeric NumPy array, got None"),
    (lambda c: c.isend(np.ones(2), True), ValueError, r"rank 0: dst=True is not a rank"),
    (lambda c: c.irecv([0.0], 1), TypeError, r"rank 0: irecv\(\) receives into out, a NumPy array .*, got \[0.0\]"),
    (lambda c: c.irecv(np.empty(3), 1, tag="1"), ValueError, r"tag must be an int .*, got '1'"),
    (lambda c: c.waitall(None), TypeError, r"rank 0: waitall\(\) takes a list of requests .*NoneType"),
    (lambda c: c.compute(seconds=-1.0), ValueError, r"compute: seconds must be a finite number >= 0, got -1.0"),
    (lambda c: c.compute(flops="1e9"), TypeError, r"compute: flops must be a finite number >= 0, got '1e9'"),
    (lambda c: c.launch(3), TypeError, r"launch: fn must be callable, got 3"),
    (lambda c: c.group([0, 5]), ValueError, r"rank 0: group member=5 is not a rank"),
    (lambda c: c.group("01"), TypeError, r"group: ranks must be a sequence of at least 1 items, got '01'"),
]


def bad_calls(comm):
    """Rank 0 makes every bad call (rank 1 waits at the barrier): [(error type name, message)], and
    the bytes this rank sent meanwhile."""
    found = []
    if comm.rank == 0:
        for call, _, _ in BAD_CALLS:
            try:
                call(comm)
                found.append(("returned", ""))
            except Exception as exc:  # noqa: BLE001 - the table says which
                found.append((type(exc).__name__, str(exc)))
    sent = comm.stats["bytes_sent"]
    comm.barrier()
    return found, sent


@pytest.mark.parametrize("engine", ["sim", "mpi"])
def test_bad_point_to_point_calls_are_refused_before_anything_is_sent(engine, tmp_path, monkeypatch):
    if engine == "mpi":
        if not mc.mpi_status()[0]:
            pytest.skip(f"MPI cannot start here: {mc.mpi_status()[1]}")
        import tempfile

        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    res = mc.run(bad_calls, 2, engine=engine, **({"timeout": 60} if engine == "mpi" else {}))
    found, sent = res.results[0]
    for (_, error, message), (kind, text) in zip(BAD_CALLS, found):
        assert kind == error.__name__ and re.search(message, text), f"{engine}: expected {error.__name__} " \
                                                                     f"matching {message!r}, got {kind}: {text}"
    assert sent == 0, f"{engine}: the bad calls sent {sent} bytes"


def test_runner_and_records_refuse_bad_arguments():
    keep = []
    mc.run(lambda comm: keep.append(comm), 2)
    for call, error, message in (
            (lambda: mc.run(print, 0), ValueError, "run: nranks must be an integer >= 1, got 0"),
            (lambda: mc.run(print, 2, engine="gpu"), ValueError, "run: engine must be one of 'sim', 'mpi', got 'gpu'"),
            (lambda: mc.run(print, 2, beta=-1e-9), ValueError, "run: beta must be a finite number >= 0, got -1e-09"),
            (lambda: mc.run(3, 2), TypeError, "run: fn must be callable, got 3"),
            (lambda: mc.chunk_bounds(-1, 2), ValueError, "chunk_bounds needs n >= 0 and parts >= 1, got n=-1"),
            (lambda: mc.Work(keep[0], None, -1.0), ValueError, "Work: done must be a finite number >= 0, got -1.0"),
            (lambda: mc.Request(keep[0], "send", 1, 0, None), ValueError,
             "Request: kind must be one of 'isend', 'irecv', got 'send'"),
            (lambda: mc.SimComm(2, keep[0]._w), ValueError, r"SimComm: rank must be in \[0, 2\) .*, got 2"),
            (lambda: mc.SubComm(keep[0], []), ValueError, "SubComm: ranks must be a sequence of at least 1 items")):
        with pytest.raises(error, match=message):
            call()
    assert mc.chunk_bounds(0, 3) == [(0, 0)] * 3
