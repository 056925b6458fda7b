"""Lesson 12: all-reduce, predicted vs simulated, and the ring on real MPI vs MPICH's own.

1. Simulated: the alpha-beta prediction (`collective_cost`) against the simulator's clock for the
   naive and the ring all-reduce, over message sizes and rank counts. They must agree (ratio 1).
2. Real: `mpiexec -n N` on this machine. The lesson's ring all-reduce (Python, send/recv through
   mpi4py) against `MPI.Allreduce` of MPICH itself, same sizes, same processes: time per
   all-reduce, the bus bandwidth `2(N-1)/N * S / t` (nccl-tests' convention: the per-rank traffic
   of a bandwidth-optimal all-reduce, divided by the time) and the ratio of the two times.
   On a 2-core machine N = 4 is oversubscribed: its timings measure time-sharing too.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from minitorch.comm import mpi_status, run
from minitorch.parallel import collective_cost, naive_allreduce, ring_allreduce

ALPHA, BETA = 5e-6, 1e-10  # the lesson's example network: 5 us, 10 GB/s


def simulated_table() -> list[tuple]:
    rows = []
    for n in (2, 4, 8):
        for nbytes in (8 * 2**10, 256 * 2**10, 4 * 2**20):
            x = np.zeros(nbytes // 8)
            for name, fn in (("naive_allreduce", naive_allreduce), ("ring_allreduce", ring_allreduce)):
                res = run(lambda comm, f=fn: f(comm, x), n, alpha=ALPHA, beta=BETA)
                predicted = collective_cost(name, nbytes, n, ALPHA, BETA)
                rows.append((n, nbytes, name, predicted.time, res.time, predicted.bytes, max(res.bytes_sent())))
    return rows


def mpi_timings(comm, sizes, budget):
    """On every rank: (size, ring seconds, MPI.Allreduce seconds) per size, best of 3 trials."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    out = []
    for nbytes in sizes:
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 8)
        y = np.empty_like(x)
        ring_allreduce(comm, x)  # warm up both
        world.Allreduce(x, y)
        # repetitions: about `budget` seconds per trial, agreed on by all ranks
        world.Barrier()
        t0 = time.perf_counter()
        world.Allreduce(x, y)
        reps = int(world.allreduce(max(1, min(200, budget / max(time.perf_counter() - t0, 1e-6))), op=MPI.MIN))
        best = {}
        for label, op in (("ring", lambda: ring_allreduce(comm, x)), ("mpi", lambda: world.Allreduce(x, y))):
            trials = []
            for _ in range(3):
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    op()
                world.Barrier()
                trials.append((time.perf_counter() - t0) / reps)
            best[label] = min(trials)
        assert np.allclose(ring_allreduce(comm, x), y)
        out.append((nbytes, best["ring"], best["mpi"]))
    return out


def main(out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print(f"simulated all-reduce, alpha = {ALPHA * 1e6:g} us, beta = {BETA * 1e9:g} ns/byte")
    print(f"{'ranks':>5} {'bytes':>9} {'algorithm':>16} {'predicted s':>12} {'simulated s':>12} {'ratio':>6} "
          f"{'pred. bytes':>12} {'counted':>10}")
    rows = simulated_table()
    for n, nbytes, name, pred, simt, pbytes, counted in rows:
        print(f"{n:>5} {nbytes:>9} {name:>16} {pred:>12.4e} {simt:>12.4e} {simt / pred:>6.3f} {pbytes:>12.0f} {counted:>10}")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for (n, name), style in zip([(n, a) for n in (2, 8) for a in ("naive_allreduce", "ring_allreduce")],
                                ["C3--", "C0--", "C3-", "C0-"]):
        pts = [(b, p, s) for m, b, a, p, s, _, _ in rows if m == n and a == name]
        ax.loglog([b for b, _, _ in pts], [p for _, p, _ in pts], style, label=f"{name}, N={n} (model)")
        ax.loglog([b for b, _, _ in pts], [s for _, _, s in pts], style[:2] + "o")
    ax.set(xlabel="bytes", ylabel="seconds (simulated)", title="alpha-beta model (lines) vs simulator (dots)")
    ax.legend(fontsize=7)

    ok, why = mpi_status()
    if not ok:
        print(f"\nMPI part skipped: {why}")
    else:
        sizes = [2**10, 2**13, 2**16, 2**19, 2**22, 2**25]
        print(f"\nreal MPI on this machine ({why}): the lesson's ring all-reduce vs MPI.Allreduce, float64")
        print(f"{'ranks':>5} {'bytes':>9} {'ring us':>10} {'MPI us':>10} {'ring GB/s':>10} {'MPI GB/s':>10} "
              f"{'ring/MPI time':>14}")
        ax = axes[1]
        for n in (2, 4):
            res = run(mpi_timings, n, sizes, 0.05, engine="mpi", timeout=600)
            for nbytes, ring_t, mpi_t in res.results[0]:
                bus = 2 * (n - 1) / n * nbytes
                print(f"{n:>5} {nbytes:>9} {ring_t * 1e6:>10.1f} {mpi_t * 1e6:>10.1f} {bus / ring_t / 1e9:>10.3f} "
                      f"{bus / mpi_t / 1e9:>10.3f} {ring_t / mpi_t:>14.2f}")
            data = res.results[0]
            ax.loglog([d[0] for d in data], [2 * (n - 1) / n * d[0] / d[1] / 1e9 for d in data], "o-",
                      label=f"ring (Python), N={n}")
            ax.loglog([d[0] for d in data], [2 * (n - 1) / n * d[0] / d[2] / 1e9 for d in data], "s--",
                      label=f"MPI.Allreduce, N={n}")
        ax.set(xlabel="bytes", ylabel="bus bandwidth (GB/s)", title="all-reduce on MPI, this machine")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "comm_allreduce.png"
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")
