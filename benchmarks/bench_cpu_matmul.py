"""Lessons 04-06: GFLOP/s of every CPU matmul version against NumPy's BLAS and the machine's FMA peak.

For n = 256, 512, 1024, 2048 (float32, square): lesson 05's matmul_ijk, matmul_ikj, matmul_tiled,
lesson 06's matmul_simd (1 thread and all Numba threads) and matmul_blis (section 8: packed
panels, the outer-product kernel of the shape lesson 06's rule picks for this CPU; 1 thread and all
threads: the one-thread ratio to BLAS is the one other jobs on the machine disturb least),
and NumPy's matmul with its BLAS on 1 thread and on all threads (set with threadpoolctl, so the
count is known whatever the environment says). NumPy's BLAS runs as on a student's machine: where
OPENBLAS_CORETYPE or OPENBLAS_L2_SIZE is set, this benchmark reruns itself in a child process
without them (lesson 04's native_env), and its first lines name the BLAS kernel that ran and the
CPU's vector ISA. Every result is checked against float64 before anything is timed.

The peak every kernel is a fraction of is measured directly: lesson 04's loop of independent FMAs
on the widest vectors (fma_roof), on 1 thread and on all. Beside it: lesson 06's kernels from L1
(the 4 x 3 inner-product micro-kernel and the BLIS kernel), each as a fraction of that roof.
Targets (issue 44, one run, quiet machine, native BLAS): the BLIS kernel from L1 at >= 90% of the
FMA roof (1 and all threads); matmul_blis at >= 90% of all-thread BLAS at n = 1024 and 2048, 75% at
n = 256. Prints a table and the targets, saves cpu_matmul.png and cpu_matmul.json. Run through
`make bench` (or `make bench L=cpu_matmul`).

Every figure is the best of several runs: on a shared machine noise only ever adds time. Each
entry's runs start after a pause (POOL_PAUSE): OpenBLAS's threads spin for about 0.1 s after
a call and Numba's OpenMP threads for a few ms, taking the cores of whatever runs next.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from minitorch.bench import (benchmark, blas_limit, blas_line, fma_peaks, load_report, matmul_flops,
                             vector_isa)
from minitorch.cpu_matmul import matmul_ijk, matmul_ikj, matmul_tiled
from minitorch.simd_matmul import (MR, NR, POOL_PAUSE, blis_peak, machine_blocking, machine_shape, matmul_blis,
                                   matmul_simd, micro_kernel)

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
SIZES = (128, 256) if SMALL else (256, 512, 1024, 2048)
ROUNDS = 1 if SMALL else 3
LIMITS = {"ijk (05)": 512, "ikj (05)": 1024, "tiled (05)": 1024}  # seconds per call beyond these
TARGETS = {256: 0.75, 1024: 0.90, 2048: 0.90}  # matmul_blis / all-thread native BLAS, issue 44
KERNEL_TARGET = 0.90  # the BLIS kernel from L1 / the FMA roof, issue 44


@njit(parallel=True)
def _fma_peak_kernel(a, bt, c, calls):
    """Each thread runs the micro-kernel `calls` times on its own L1-resident block."""
    for t in prange(c.shape[0]):
        for _ in range(calls):
            micro_kernel(a[t], bt[t], c[t], 0, 0, 0, a.shape[2])


def fma_peak(threads: int, kc: int = 256, calls: int = 4000) -> float:
    """FLOP/s of section 3's micro-kernel with its operands in L1, on `threads` threads at once."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((threads, MR, kc)).astype(np.float32)
    bt = rng.standard_normal((threads, NR, kc)).astype(np.float32)
    c = np.zeros((threads, MR, 16), np.float32)  # 256 bytes per thread: no false sharing of C
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        t = benchmark(_fma_peak_kernel, a, bt, c, calls, warmup=1, repeat=5).min
    finally:
        numba.set_num_threads(before)
    return 2 * MR * NR * kc * calls * threads / t


def _simd_1thread(a, b):
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        return matmul_simd(a, b)
    finally:
        numba.set_num_threads(before)


def _blis_1thread(a, b):
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        return matmul_blis(a, b)
    finally:
        numba.set_num_threads(before)


def main(out_dir: Path) -> None:
    from benchmarks.native_blas import ran_natively

    if not ran_natively(__file__, out_dir):
        _main(Path(out_dir))


def _main(out_dir) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = numba.get_num_threads()
    mr, nv = machine_shape()
    mc, kc, nc = machine_blocking(mr, 16 * nv)
    blis = f"blis {threads} threads (06)"
    numpy_all = f"numpy, BLAS {threads} threads"
    versions = {
        "ijk (05)": matmul_ijk,
        "ikj (05)": matmul_ikj,
        "tiled (05)": matmul_tiled,
        "simd 1 thread (06)": _simd_1thread,
        f"simd {threads} threads (06)": matmul_simd,
        "blis 1 thread (06)": _blis_1thread,
        blis: matmul_blis,
        "numpy, BLAS 1 thread": np.matmul,
        numpy_all: np.matmul,
    }
    blas_threads = {"numpy, BLAS 1 thread": 1, numpy_all: threads}
    # the threads each entry runs on (lesson 05's loops on one), for its fraction of the FMA roof
    entry_threads = {name: blas_threads.get(name, 1 if "1 thread" in name or name.endswith("(05)") else threads)
                     for name in versions}
    rng = np.random.default_rng(0)
    operands = {}
    for n in SIZES:
        a = rng.standard_normal((n, n)).astype(np.float32)
        b = rng.standard_normal((n, n)).astype(np.float32)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        for name, fn in versions.items():
            if n <= LIMITS.get(name, n):
                with blas_limit(blas_threads.get(name, 1)):
                    err = np.abs(fn(a, b) - ref).max() / np.abs(ref).max()  # also compiles
                if err > 1e-4:
                    raise AssertionError(f"{name} is wrong at n={n}: relative error {err:.2e}")
        operands[n] = (a, b)

    # Interleaved rounds, best time per entry: a burst of load from another process then hurts
    # one round of one entry, not a whole column.
    best: dict[str, dict[int, float]] = {v: {} for v in versions}
    counts = sorted({1, threads})
    roofs = {t: 0.0 for t in counts}
    peaks = {t: 0.0 for t in counts}
    blis_peaks = {t: 0.0 for t in counts}
    for _ in range(ROUNDS):
        for n, (a, b) in operands.items():
            for name, fn in versions.items():
                if n > LIMITS.get(name, n):
                    continue
                repeat = 1 if name.startswith(("ijk", "ikj", "tiled")) else 5
                time.sleep(POOL_PAUSE)  # the previous entry's thread pool stops spinning
                with blas_limit(blas_threads.get(name, 1)):
                    t = benchmark(fn, a, b, warmup=1, repeat=repeat).min
                best[name][n] = min(best[name].get(n, float("inf")), t)
        for th in counts:
            roofs[th] = max(roofs[th], max(fma_peaks(th, seconds=0.05).values()) / 1e9)
            peaks[th] = max(peaks[th], fma_peak(th) / 1e9)
            blis_peaks[th] = max(blis_peaks[th], blis_peak(th, calls=4000))
    table = {name: {n: matmul_flops(n, n, n) / t / 1e9 for n, t in row.items()} for name, row in best.items()}
    blas_best = max(table[numpy_all].values())
    isa = vector_isa()

    print(load_report())
    print(blas_line())
    print(f"CPU matmul, float32, square n x n; {isa['name']}, {os.cpu_count()} CPUs, {threads} Numba threads "
          f"({numba.threading_layer()} layer); lesson 06's kernel here: {mr} x {16 * nv}, KC = {kc}, NC = {nc}, "
          f"MC at most {mc}")
    print("FMA roof (lesson 04's loop of independent FMAs, widest vectors): "
          + ", ".join(f"{roofs[t]:.1f} GFLOP/s on {t} thread{'s' * (t > 1)}" for t in counts))
    print("kernels from L1, fraction of the FMA roof on as many threads:")
    for label, rates in ((f"BLIS kernel {mr} x {16 * nv}", blis_peaks), ("4 x 3 micro-kernel", peaks)):
        print(f"  {label:22s} " + "   ".join(f"{t} thread{'s' * (t > 1)} {rates[t]:7.1f} GFLOP/s = {rates[t] / roofs[t]:4.0%}"
                                             for t in counts))
    if any(rates[t] > roofs[t] for rates in (blis_peaks, peaks) for t in counts):
        print("  (above 100%: the FMA loop's own runs lost their cores to other jobs; the roof is then too low)")
    print(f"NumPy BLAS best ({threads} threads, n={max(table[numpy_all], key=table[numpy_all].get)}): {blas_best:.1f} "
          f"GFLOP/s = {blas_best / roofs[threads]:.0%} of the FMA roof")
    print(f"GFLOP/s (fraction of NumPy with {threads} BLAS threads in the same run; fraction of the FMA roof on the "
          f"entry's threads)")
    print(f"{'version':24s}" + "".join(f"{'n=' + str(n):>24s}" for n in SIZES))
    for name in versions:
        cells = []
        for n in SIZES:
            if n in table[name]:
                g = table[name][n]
                cells.append(f"{g:8.1f} ({g / table[numpy_all][n]:5.0%}, {g / roofs[entry_threads[name]]:4.0%})")
            else:
                cells.append("-")
        print(f"{name:24s}" + "".join(f"{c:>24s}" for c in cells))

    print(f"targets (issue 44), one run, native BLAS ({blas_line().split('; ')[0].split(': ', 1)[1]}):")
    for th in counts:
        ratio = blis_peaks[th] / roofs[th]
        print(f"  BLIS kernel from L1, {th} thread{'s' * (th > 1)}: {ratio:5.0%} of the FMA roof "
              f"(target >= {KERNEL_TARGET:.0%}) {'met' if ratio >= KERNEL_TARGET else 'NOT met'}")
    for n, want in TARGETS.items():
        if n in table[blis] and n in table[numpy_all]:
            ratio = table[blis][n] / table[numpy_all][n]
            print(f"  matmul_blis / NumPy, n={n:5d}, {threads} threads each: {ratio:5.0%} (target >= {want:.0%}) "
                  f"{'met' if ratio >= want else 'NOT met'}")
    print("  (the same on 1 thread each, less exposed to other jobs on the machine: "
          + ", ".join(f"n={n} {table['blis 1 thread (06)'][n] / table['numpy, BLAS 1 thread'][n]:.0%}" for n in SIZES)
          + ")")

    (out_dir / "cpu_matmul.json").write_text(json.dumps({
        "dtype": "float32", "sizes": list(SIZES), "threads": threads, "blas": blas_line(),
        "kernel_shape": [mr, 16 * nv], "blocking": {"MC": mc, "KC": kc, "NC": nc},
        "gflops": {k: {str(n): g for n, g in v.items()} for k, v in table.items()},
        "fma_roof_gflops": {str(k): v for k, v in roofs.items()},
        "peak_microkernel_l1_gflops": {str(k): v for k, v in peaks.items()},
        "peak_blis_kernel_l1_gflops": {str(k): v for k, v in blis_peaks.items()},
        "peak_numpy_blas_gflops": blas_best,
    }, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name in versions:
        ns = sorted(table[name])
        ax.plot(ns, [table[name][n] for n in ns], marker="o", label=name)
    ax.axhline(roofs[threads], color="k", ls="-", lw=1, label=f"FMA roof (lesson 04), {threads} threads")
    ax.axhline(blis_peaks[threads], color="k", ls=":", lw=1, label=f"BLIS kernel from L1, {threads} threads")
    ax.axhline(peaks[threads], color="k", ls="--", lw=1, label=f"4 x 3 micro-kernel from L1, {threads} threads")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(SIZES), [str(n) for n in SIZES])
    ax.set_xlabel("n (square, float32)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("CPU matmul: lessons 05-06 vs NumPy's BLAS and the FMA roof")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "cpu_matmul.png", dpi=120)
    plt.close(fig)
    print(f"saved {out_dir / 'cpu_matmul.png'} and cpu_matmul.json")


if __name__ == "__main__":
    main(Path(__file__).resolve().parent.parent / "build" / "bench")
