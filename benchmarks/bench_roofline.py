"""Lesson 04: this machine's roofline.

Measures the two roofs the same way, once on one thread and once on all of them: sustained memory
bandwidth (STREAM-style triad, a Numba loop on that many threads) and the compute roof, lesson 04's
loop of independent FMAs at each vector width the CPU has (the widest gives the roof). Beside them
the best float32 matmul FLOP/s of NumPy's BLAS limited to that many threads, as a fraction of the
FMA roof. Times a few kernels (elementwise add, NumPy softmax, matmul at several sizes) with BLAS on
the same threads, prints a table per thread count and saves roofline.png (one panel each). NumPy's
BLAS runs as on a student's machine: where OPENBLAS_CORETYPE or OPENBLAS_L2_SIZE is set, this
benchmark reruns itself in a child process without them, and it names the kernel that ran. Run
through `make bench` (or `make bench L=roofline`).

The machine may be shared: every figure is a best-of-repeats, and a roof is raised to the best
rate any kernel reached (a kernel cannot beat a true roof; if it does, the roof's own run was
unlucky). Such a kernel then sits at 100% by construction; the table and plot say "sets the roof".
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np

import numba

from minitorch.bench import (
    arithmetic_intensity,
    attainable_flops,
    benchmark,
    blas_limit,
    blas_line,
    elementwise_bytes,
    elementwise_flops,
    fma_peaks,
    matmul_bytes,
    load_report,
    matmul_flops,
    measure_bandwidth,
    measure_peak_matmul,
    roofline_plot,
    softmax_bytes,
    softmax_flops,
)

SMALL = os.environ.get("MINITORCH_SMALL") == "1"


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def kernels(rng: np.random.Generator) -> dict[str, tuple[float, float]]:
    """{label: (minimum-traffic intensity FLOP/byte, achieved FLOP/s)} for a few float32 kernels."""
    points: dict[str, tuple[float, float]] = {}
    n = 8_000_000 if SMALL else 20_000_000  # 96+ MB: far beyond a 32 MiB L3
    a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    out = np.empty_like(a)
    t = benchmark(np.add, a, b, out, warmup=2, repeat=10)
    points["add"] = (arithmetic_intensity(elementwise_flops(n), elementwise_bytes(n, 4)), elementwise_flops(n) / t.min)

    r, c = (512, 1024) if SMALL else (8192, 1024)
    x = rng.standard_normal((r, c), dtype=np.float32)
    t = benchmark(_softmax, x, warmup=2, repeat=10)
    points["softmax"] = (arithmetic_intensity(softmax_flops(r, c), softmax_bytes(r, c, 4)), softmax_flops(r, c) / t.min)

    for m in (32, 128, 512) if SMALL else (32, 128, 512, 1024, 2048):
        A = rng.standard_normal((m, m), dtype=np.float32)
        B = rng.standard_normal((m, m), dtype=np.float32)
        t = benchmark(np.matmul, A, B, warmup=2, repeat=7, number=max(1, 2_000_000 // m**2))
        points[f"matmul {m}"] = (arithmetic_intensity(matmul_flops(m, m, m), matmul_bytes(m, m, m, 4)),
                                 matmul_flops(m, m, m) / t.min)
    return points


def main(out_dir: Path) -> None:
    from benchmarks.native_blas import ran_natively

    if not ran_natively(__file__, out_dir):
        _main(Path(out_dir))


def _main(out_dir) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
          f"numpy {np.__version__}")
    print(load_report())
    print(blas_line())
    counts = sorted({1, numba.get_num_threads()})
    fig, axes = plt.subplots(1, len(counts), figsize=(6.5 * len(counts), 4.5), squeeze=False)
    for ax, threads in zip(axes[0], counts):
        bw = max(measure_bandwidth(n=4_000_000 if SMALL else 20_000_000, repeat=10, threads=threads) for _ in range(2))
        sizes = (256, 512) if SMALL else (512, 1024, 2048)
        peaks = {n: measure_peak_matmul(n, repeat=5, threads=threads) for n in sizes}
        peak64 = measure_peak_matmul(512 if SMALL else 1024, dtype=np.float64, repeat=5, threads=threads)
        runs = [fma_peaks(threads) for _ in range(2)]  # the best of two: a roof is the best rate seen
        fmas = {w: max(r[w] for r in runs) for w in runs[0]}
        with blas_limit(threads):
            points = kernels(rng)
        measured_bw, measured_peak, fma_roof = bw, max(peaks.values()), max(fmas.values())
        bw = max(bw, points["add"][1] / points["add"][0])
        peak = max(fma_roof, *(f for k, (_, f) in points.items() if k.startswith("matmul")))

        label = f"{threads} thread{'s' * (threads > 1)}"
        print(f"\n== {label}")
        print(f"triad bandwidth              {measured_bw / 1e9:8.1f} GB/s")
        for n, p in peaks.items():
            print(f"BLAS float32 matmul n={n:<5d} {p / 1e9:8.1f} GFLOP/s")
        print(f"BLAS float64 matmul          {peak64 / 1e9:8.1f} GFLOP/s")
        for w, r in fmas.items():
            print(f"FMA loop {w:>8s} float32  {r / 1e9:8.1f} GFLOP/s")
        print(f"FMA roof {fma_roof / 1e9:.1f} GFLOP/s; BLAS float32 best {measured_peak / 1e9:.1f} GFLOP/s = "
              f"{measured_peak / fma_roof:.0%} of it")
        print(f"roofs used: {bw / 1e9:.1f} GB/s, {peak / 1e9:.1f} GFLOP/s, ridge {peak / bw:.1f} FLOP/byte")
        print(f"{'kernel':12s} {'FLOP/byte':>10s} {'GFLOP/s':>10s} {'% of roof':>10s}")
        for k, (i, f) in points.items():
            frac = f / attainable_flops(i, peak, bw)
            print(f"{k:12s} {i:10.3f} {f / 1e9:10.2f} {frac:10.1%}" + ("  sets the roof" if abs(frac - 1) < 1e-9 else ""))
        roofline_plot(peak, bw, points, ax=ax, title=f"roofline, {label}, float32")
    fig.tight_layout()
    path = out_dir / "roofline.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main(Path(__file__).resolve().parent.parent / "build" / "bench")
