# %% [markdown]
# # Lesson 04: measuring
#
# Lessons 05-08 make minitorch fast. "Fast" needs two numbers: how long a kernel takes, and how
# long it *could* take on this machine. This lesson builds both.
#
# 1. **Timing honestly**: warm-up, JIT compilation excluded, repeats, min and median, noise.
# 2. **Counting work**: FLOPs vs MACs, bytes moved, arithmetic intensity.
# 3. **This machine's ceilings**: peak memory bandwidth (a STREAM-style triad) and the best
#    matmul FLOP/s NumPy's BLAS reaches, drawn as a roofline with real kernels placed on it.
# 4. **Transformer arithmetic**: parameters, FLOPs per token (~2N forward, ~6N training),
#    training memory (16 bytes per parameter for mixed-precision Adam), compute-optimal scaling.
#
# The course's reference version of this lesson is `minitorch/bench.py`, the benchmarking
# utility later lessons and `make bench` use. Hardware background: [the roofline model](../hardware_notes/roofline.md),
# [transformer arithmetic](../hardware_notes/transformer_arithmetic.md), why bandwidth falls
# further behind compute with every hardware generation
# ([the memory wall](../hardware_notes/memory.md#the-memory-wall)), and what a training run
# costs in GPU-hours and energy ([energy](../hardware_notes/energy.md#the-cost-of-a-training-run)).

# %%
#| default_exp bench
#| export
"""minitorch.bench: honest timing, FLOP/byte counting, rooflines and transformer arithmetic."""
from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

# %%
from course.check import check
import os

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %% [markdown]
# ## 1. Timing honestly
#
# A single `time.perf_counter()` pair around one call measures much more than the kernel:
#
# - **First-call costs.** The first call of a Numba function compiles it (often 0.1-2 s); the
#   first touch of a fresh array takes page faults; the first BLAS call starts its thread pool.
#   None of that recurs, so it must be excluded: run the function a few times (*warm-up*)
#   before timing.
# - **Asynchronous work.** A GPU launch returns before the kernel has run. Stopping the clock
#   without a device synchronisation measures the launch, not the kernel. So the timer takes a
#   `sync` callback that is run before the clock stops (lesson 07/08 pass
#   `cupy.cuda.Device().synchronize`). The warm-up is synchronised too, or its queued work
#   leaks into the first timed repeat.
# - **Timer resolution.** `perf_counter` is good to well under a microsecond, but a call that
#   takes 2 us is dominated by the Python overhead of the timing loop itself. Time `number`
#   calls in a row and divide, as `timeit` does. Calling a compiled (Numba) function from
#   Python costs a fixed few hundred nanoseconds as well; a kernel of a microsecond or less is
#   timed inside a compiled loop instead (lesson 06 does this).
# - **Noise.** Other processes, frequency changes, interrupts and the garbage collector only
#   ever make a run *slower*. On a shared machine (ours: 2 cores, other engineers' tests
#   running) the noise is large. Repeat and report the **minimum** (the best estimate of the
#   kernel's cost: noise is additive and positive; Chen & Revels 2016) together with the
#   **median** (what a user typically sees). Python's `timeit` disables the garbage collector
#   while timing; so do we.
# - **Threads.** NumPy's BLAS (OpenBLAS in NumPy's wheels) starts one thread per CPU, and a
#   product split over threads runs at the pace of the slowest one: when another program holds
#   a core, even a small matmul waits for it (lesson 03 measures this). `make lab` and
#   `make demo` therefore start the notebooks with one BLAS thread (`OPENBLAS_NUM_THREADS=1`),
#   and a demo that compares with a multi-threaded BLAS sets and states the count itself, with
#   `blas_limit(n)` (given below, built on threadpoolctl). `load_report()` prints the load
#   average and the thread counts; every timing demo in the course prints it first, and it
#   warns when the machine is busy.
#
# ### Exercise 4.1: `benchmark`
#
# The `Timing` record is given. Write `benchmark(fn, *args, warmup, repeat, number, sync, timer)`:
#
# 1. call `fn(*args)` `warmup` times; if `sync` is given and `warmup > 0`, call `sync()` once
#    afterwards (drain the warm-up's queued work before timing starts);
# 2. then `repeat` times: read `timer()`, call `fn(*args)` `number` times, call `sync()` if
#    given, read `timer()` again, and record *(elapsed / number)*, the seconds per call;
# 3. return `Timing(times)`.
#
# `timer` defaults to `time.perf_counter`; the tests pass a fake clock so they can check the
# structure (which calls are timed) without timing anything. Reject `repeat < 1`,
# `number < 1` and `warmup < 0` with a `ValueError` naming the argument.

# %%
#| export
@dataclass
class Timing:
    """Seconds per call of `repeat` timed runs; summary statistics as properties."""

    times: list[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def std(self) -> float:
        """Sample standard deviation (0.0 for a single run)."""
        return statistics.stdev(self.times) if len(self.times) > 1 else 0.0

    def __str__(self) -> str:
        return (f"min {format_seconds(self.min)}  median {format_seconds(self.median)}  "
                f"std {format_seconds(self.std)}  ({len(self.times)} runs)")


def format_seconds(s: float) -> str:
    """3 significant digits with a unit: '812 us', '1.52 ms', '2.31 s'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(s) >= scale or unit == "ns":
            return f"{s / scale:.3g} {unit}"
    return f"{s} s"


def blas_threads() -> dict[str, int]:
    """{BLAS library: threads it will use} for NumPy's BLAS (via threadpoolctl), e.g. {'openblas': 1}."""
    from threadpoolctl import threadpool_info

    return {i["internal_api"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}


@contextlib.contextmanager
def blas_limit(threads: int | None) -> Iterator[None]:
    """Run the block with NumPy's BLAS on `threads` threads (None: leave it as it is)."""
    if threads is None:
        yield
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=int(threads), user_api="blas"):
        yield


def load_report(busy_per_core: float = 0.75) -> str:
    """One line to print before timing anything: the 1-minute load average, the number of
    CPUs, and the threads NumPy's BLAS (and Numba, if imported) will use. It starts with
    "WARNING" when the load is above `busy_per_core` per CPU (and above 1.5): other programs
    are running, so timings will be slower and noisier than on an idle machine, and anything
    using every core (BLAS, prange) waits for the slowest thread."""
    cpus = os.cpu_count() or 1
    threads = ", ".join(f"{lib} BLAS {n} thread{'s' * (n != 1)}" for lib, n in blas_threads().items())
    if "numba" in sys.modules:
        n = sys.modules["numba"].get_num_threads()
        threads += f", Numba {n} thread{'s' * (n != 1)}"
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on Windows
        return f"{cpus} CPUs ({threads}); load average not available here"
    line = f"load average {load:.2f} on {cpus} CPUs ({threads})"
    if load > max(busy_per_core * cpus, 1.5):
        return (f"WARNING: the machine is busy: {line}. Timings below will be slower and noisier "
                "than on an idle machine; multi-threaded ones suffer most.")
    return line + ": quiet enough to time"

# %%
#| export
#| exercise 4.1
def benchmark(fn: Callable[..., Any], *args: Any, warmup: int = 1, repeat: int = 5, number: int = 1,
              sync: Callable[[], Any] | None = None,
              timer: Callable[[], float] = time.perf_counter) -> Timing:
    """Time `fn(*args)`: `warmup` untimed calls, then `repeat` runs of `number` calls each.

    `sync()` (if given) runs after the warm-up and inside each timed run, before the clock
    stops. Returns Timing whose `times[i]` is run i's seconds per call (length `repeat`).
    """
    ### BEGIN SOLUTION
    for name, value, low in (("repeat", repeat, 1), ("number", number, 1), ("warmup", warmup, 0)):
        if int(value) != value or value < low:
            raise ValueError(f"benchmark: {name} must be an integer >= {low}, got {value!r}")
    for _ in range(warmup):
        fn(*args)
    if sync is not None and warmup > 0:
        sync()
    times = []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection in the middle of a run is noise, as timeit knows
    try:
        for _ in range(repeat):
            start = timer()
            for _ in range(number):
                fn(*args)
            if sync is not None:
                sync()
            times.append((timer() - start) / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(times)
    ### END SOLUTION

# %% tags=["check"]
check("4.1")

# %% [markdown]
# **Demo: the first call of a JIT function.** A fresh Numba function, timed with no warm-up:
# run 0 includes compilation and is orders of magnitude slower than the rest. With one warm-up
# call it disappears from the record.

# %% tags=["demo"]
from numba import njit


def make_jit_sum():
    @njit
    def jit_sum(a):
        s = 0.0
        for x in a:
            s += x
        return s
    return jit_sum


a = np.random.default_rng(0).random(100_000)
cold = benchmark(make_jit_sum(), a, warmup=0, repeat=5)
warm = benchmark(make_jit_sum(), a, warmup=1, repeat=5)
print("no warm-up :", [format_seconds(t) for t in cold.times])
print("1 warm-up  :", [format_seconds(t) for t in warm.times])

# %% [markdown]
# **Demo: noise.** Sorting a million floats many times. Expect a tight cluster near the minimum
# and a tail to the right (never to the left): that is why the minimum is the stable statistic
# and the mean is not. On the 2-core dev machine, shared with other test runs, the slowest run
# was 1.5-3.5x the fastest.

# %% tags=["demo"]
import matplotlib.pyplot as plt

print(load_report())
x = np.random.default_rng(1).random(200_000 if SMALL else 1_000_000)
t = benchmark(np.sort, x, warmup=2, repeat=30 if SMALL else 100)
print(t)
print(f"max / min = {max(t.times) / t.min:.2f}")
fig, ax = plt.subplots(figsize=(6, 2.5))
ax.hist(np.array(t.times) * 1e3, bins=30)
ax.axvline(t.min * 1e3, color="k", ls="--", label="min")
ax.axvline(t.median * 1e3, color="r", ls=":", label="median")
ax.set_xlabel("ms per np.sort call"); ax.legend(); plt.show()

# %% [markdown]
# ## 2. Counting work: FLOPs, MACs, bytes
#
# A **FLOP** is one floating-point add or multiply. A **MAC** (multiply-accumulate,
# `c += a * b`) is two FLOPs; hardware executes it as one fused multiply-add (FMA)
# instruction, and vendors quote peak FLOP/s counting an FMA as 2. Papers are not consistent:
# some "FLOPs" tables (many vision papers) actually count MACs. Always check which.
#
# `A (m, k) @ B (k, n) -> C (m, n)`: each of the `m*n` outputs is a dot product of length `k`,
# i.e. `k` MACs, so **`m*n*k` MACs = `2*m*n*k` FLOPs**.
#
# **Bytes moved** is what must cross between DRAM and the chip. The minimum for a matmul reads
# A and B once and writes C once: `(m*k + k*n + m*n) * itemsize`. Real kernels move more when
# the operands do not fit in cache (lesson 05 is about getting close to this minimum).
#
# ### Exercise 4.2: `matmul_flops`, `matmul_macs`, `matmul_bytes`
#
# Return Python `int`s (exact for any size). Negative dimensions raise `ValueError` (the
# given `_check_dims(m=m, ...)` does that with a message naming the argument).

# %%
#| export
def _check_dims(**dims: int) -> None:
    for name, v in dims.items():
        if int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")

# %%
#| export
#| exercise 4.2
def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of (m, k) @ (k, n): one multiply and one add per MAC."""
    ### BEGIN SOLUTION
    _check_dims(m=m, n=n, k=k)
    return 2 * int(m) * int(n) * int(k)
    ### END SOLUTION


def matmul_macs(m: int, n: int, k: int) -> int:
    """Multiply-accumulates of (m, k) @ (k, n)."""
    ### BEGIN SOLUTION
    _check_dims(m=m, n=n, k=k)
    return int(m) * int(n) * int(k)
    ### END SOLUTION


def matmul_bytes(m: int, n: int, k: int, itemsize: int) -> int:
    """Minimum DRAM traffic of (m, k) @ (k, n) -> (m, n): read A and B once, write C once."""
    ### BEGIN SOLUTION
    _check_dims(m=m, n=n, k=k, itemsize=itemsize)
    return (int(m) * int(k) + int(k) * int(n) + int(m) * int(n)) * int(itemsize)
    ### END SOLUTION

# %% tags=["check"]
check("4.2")

# %% [markdown]
# Two more counters, given, for the roofline below. An elementwise `a + b` on `n` elements does
# `n` FLOPs and moves `3n` elements (two reads, one write). A row softmax
# `exp(x - max) / sum(exp(x - max))` does about 5 operations per element (compare for the max,
# subtract, exp, add for the sum, divide; an `exp` is really ~10-20 instructions, but by
# convention counts as one) and must at least read `x` once and write the result once. These
# conventions are choices; what matters is stating them and using them consistently.

# %%
#| export
def elementwise_flops(n: int) -> int:
    """FLOPs of a binary elementwise op (a + b) on n elements."""
    _check_dims(n=n)
    return int(n)


def elementwise_bytes(n: int, itemsize: int, n_inputs: int = 2) -> int:
    """Minimum traffic of an elementwise op: read `n_inputs` arrays, write one."""
    _check_dims(n=n, itemsize=itemsize, n_inputs=n_inputs)
    return (int(n_inputs) + 1) * int(n) * int(itemsize)


def softmax_flops(rows: int, cols: int) -> int:
    """FLOPs of a row softmax, counting max, subtract, exp, sum, divide as 1 each per element."""
    _check_dims(rows=rows, cols=cols)
    return 5 * int(rows) * int(cols)


def softmax_bytes(rows: int, cols: int, itemsize: int) -> int:
    """Minimum traffic of a row softmax: read x once, write the result once."""
    _check_dims(rows=rows, cols=cols, itemsize=itemsize)
    return 2 * int(rows) * int(cols) * int(itemsize)


def gflops(flops: float, seconds: float) -> float:
    """Throughput in GFLOP/s (1e9 FLOP/s)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    return flops / seconds / 1e9


def arithmetic_intensity(flops: float, bytes: float) -> float:
    """FLOPs per byte moved."""
    if bytes <= 0:
        raise ValueError(f"bytes must be positive, got {bytes!r}")
    return flops / bytes

# %% [markdown]
# **Arithmetic intensity** `I = FLOPs / bytes` says how much work a kernel does per byte it
# moves. It decides which resource limits the kernel:
#
# | kernel (float32) | FLOPs | bytes | intensity (FLOP/byte) |
# |---|---|---|---|
# | `a + b`, n elements | n | 12 n | 1/12 = 0.083 |
# | softmax, r x c | 5rc | 8rc | 0.625 |
# | square matmul, n x n | 2n^3 | 12n^2 | n/6 (171 at n = 1024) |
#
# Elementwise ops and softmax have constant, tiny intensity; matmul's grows with `n` because
# each loaded element is reused `n` times. That reuse is what lessons 05-08 exploit.
#
# ## 3. The roofline
#
# A machine has a peak compute rate `P` (FLOP/s) and a peak memory bandwidth `B` (bytes/s). A
# kernel of intensity `I` needs at least `FLOPs / P` seconds of compute and `bytes / B` seconds
# of memory traffic, so at best it runs at
#
# $$\text{attainable}(I) = \min(P,\; I \cdot B)\quad\text{FLOP/s}$$
#
# (Williams, Waterman & Patterson 2009). On a log-log plot this is a slanted line (memory-bound)
# meeting a flat one (compute-bound) at the **ridge point** `I* = P / B`: the intensity a kernel
# needs before the arithmetic units, not memory, become its limit.
#
# ### Exercise 4.3: `attainable_flops`
#
# Accept a scalar (return a `float`) or a NumPy array of intensities (return an array, for
# plotting). Negative intensity and non-positive peaks raise `ValueError`.

# %%
#| export
#| exercise 4.3
def attainable_flops(intensity: float | np.ndarray, peak_flops: float,
                     peak_bandwidth: float) -> float | np.ndarray:
    """Roofline bound min(peak_flops, intensity * peak_bandwidth) in FLOP/s.

    intensity: FLOP/byte, scalar or array; peak_flops: FLOP/s; peak_bandwidth: bytes/s.
    """
    ### BEGIN SOLUTION
    if peak_flops <= 0 or peak_bandwidth <= 0:
        raise ValueError(f"peaks must be positive, got peak_flops={peak_flops!r}, "
                         f"peak_bandwidth={peak_bandwidth!r}")
    i = np.asarray(intensity, dtype=np.float64)
    if np.any(i < 0):
        raise ValueError(f"arithmetic intensity must be >= 0, got {intensity!r}")
    out = np.minimum(float(peak_flops), i * float(peak_bandwidth))
    return float(out) if out.ndim == 0 else out
    ### END SOLUTION

# %% tags=["check"]
check("4.3")

# %% [markdown]
# ### Measuring this machine's two roofs
#
# **Bandwidth.** McCalpin's STREAM benchmark (1995) measures sustainable bandwidth with simple
# loops over arrays much larger than the last-level cache; its *triad* is `a = b + s*c`. STREAM
# counts 3 arrays x 8 bytes per element. (A CPU store to a line not in cache first reads the line
# in, "write-allocate", so the hardware actually moves ~4 words per element; STREAM's number,
# like ours, understates the raw bus traffic.) NumPy cannot do a triad in one pass:
# `b + s * c` makes a temporary and walks memory twice. So we compile the loop with Numba, and
# exclude its compilation with a warm-up, as section 1 taught. The arrays are 3 x 8 x n bytes;
# at the default n = 10^7 that is 240 MB, beyond the L3 cache of most machines. Arrays
# that fit in cache measure the cache instead: on the dev machine `a + b` on 2 million float32
# (24 MB in all, inside L3) ran at about 48 GB/s, twice the DRAM figure.
#
# **Compute.** The peak rate of the arithmetic units: a loop of independent fused multiply-adds
# on the widest vectors the CPU has, measured below (`fma_roof`). Next to it, the best FLOP/s of
# NumPy's BLAS (OpenBLAS here) on a large float32 matmul: the best a whole, well-written kernel
# gets, placed on the roofline as a kernel, with its fraction of the roof. Lesson 06 reports your
# own kernels as a fraction of both.
#
# **The same way for both.** A roofline compares two rates, so both must be measured on the
# same cores: one thread each, or all threads each. A bandwidth taken on one core next to a
# compute peak taken on all of them draws a ridge point that belongs to no real configuration
# (on the dev machine it moves the ridge by about 2x). Both functions take `threads` (None:
# all of them): the triad runs as a Numba `prange` loop on that many threads, the FMA loop on that
# many Python threads, the matmul with BLAS limited to that many (`blas_limit`).
#
# The measurements are given: they are instrumentation, not exercises.

# %%
#| export
_TRIAD: dict[bool, Any] = {}


def _triad_kernel(parallel: bool = False):
    """The compiled triad a = b + s*c: a plain loop, or a prange loop over Numba's threads."""
    if parallel not in _TRIAD:
        from numba import njit, prange

        if parallel:
            @njit(parallel=True, cache=False)
            def triad(a, b, c, s):
                for i in prange(a.shape[0]):
                    a[i] = b[i] + s * c[i]
        else:
            @njit(cache=False)
            def triad(a, b, c, s):
                for i in range(a.shape[0]):
                    a[i] = b[i] + s * c[i]

        _TRIAD[parallel] = triad
    return _TRIAD[parallel]


def measure_bandwidth(n: int = 10_000_000, repeat: int = 10, dtype=np.float64, threads: int | None = None) -> float:
    """Sustained memory bandwidth in bytes/s from a STREAM-style triad a = b + s*c.

    threads: 1 runs a plain loop on one core; None (all of Numba's threads) or n > 1 run a
    prange loop on that many threads. Counts 3 * n * itemsize bytes per call (STREAM's
    convention); returns the best of `repeat` runs, after one warm-up call that also compiles.
    """
    if n < 1 or repeat < 1 or (threads is not None and threads < 1):
        raise ValueError(f"n, repeat and threads must be >= 1, got n={n}, repeat={repeat}, threads={threads}")
    import numba

    before = numba.get_num_threads()
    use = before if threads is None else min(int(threads), numba.config.NUMBA_NUM_THREADS)
    triad = _triad_kernel(parallel=use > 1)
    a = np.zeros(n, dtype=dtype)
    b = np.ones(n, dtype=dtype)
    c = np.full(n, 2.0, dtype=dtype)
    numba.set_num_threads(use)
    try:
        t = benchmark(triad, a, b, c, dtype(3.0), warmup=1, repeat=repeat)
    finally:
        numba.set_num_threads(before)
    if not np.all(a[: min(n, 1000)] == 7.0):
        raise RuntimeError("triad kernel computed a wrong result")
    return 3 * n * np.dtype(dtype).itemsize / t.min


def measure_peak_matmul(n: int = 1024, dtype=np.float32, repeat: int = 5, threads: int | None = None) -> float:
    """Best FLOP/s of NumPy's BLAS on an (n, n) @ (n, n) matmul of `dtype`, with BLAS on
    `threads` threads (None: as BLAS is currently set up), timed as a student's machine runs it:
    blas_matmul_gflops (in a child process where this environment holds OpenBLAS back; print
    blas_line() beside the figure)."""
    if n < 1 or repeat < 1 or (threads is not None and threads < 1):
        raise ValueError(f"n, repeat and threads must be >= 1, got n={n}, repeat={repeat}, threads={threads}")
    return blas_matmul_gflops([n], threads=threads, dtype=dtype, repeat=repeat, rounds=1, pause=0.0)["gflops"][n] * 1e9


def roofline_plot(peak_flops: float, bandwidth: float,
                  points: dict[str, tuple[float, float]] | None = None, ax=None, title: str | None = None):
    """Draw the roofline min(peak_flops, I * bandwidth) on log-log axes and place measured kernels.

    points: {label: (intensity FLOP/byte, achieved FLOP/s)}. A point exactly on the roof is
    labelled "sets the roof": the roof was raised to it (a measured roof is the best rate seen),
    so it sits at 100% by construction. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    points = points or {}
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    ridge = peak_flops / bandwidth
    xs = [ridge] + [i for i, _ in points.values()]
    lo, hi = min(xs) / 8, max(xs) * 8
    grid = np.geomspace(lo, hi, 200)
    roof = np.minimum(peak_flops, grid * bandwidth)
    ax.loglog(grid, roof / 1e9, "k-", lw=2, label="roofline")
    ax.axvline(ridge, color="0.6", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.2g} FLOP/B", (ridge, peak_flops / 1e9), textcoords="offset points",
                xytext=(5, -14), fontsize=8, color="0.4")
    ax.text(grid[3], grid[3] * bandwidth / 1e9 * 3, f"{bandwidth / 1e9:.1f} GB/s", fontsize=8)
    ax.text(ridge * 1.3, peak_flops / 1e9 * 1.25, f"{peak_flops / 1e9:.0f} GFLOP/s", fontsize=8)
    ax.set_ylim(top=peak_flops / 1e9 * 2.5)
    for label, (intensity, achieved) in points.items():
        ax.plot(intensity, achieved / 1e9, "o")
        frac = achieved / float(np.minimum(peak_flops, intensity * bandwidth))
        note = "100%: sets the roof" if abs(frac - 1) < 1e-9 else f"{frac:.0%}"
        ax.annotate(f"{label} ({note})", (intensity, achieved / 1e9), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title or "roofline")
    ax.grid(True, which="both", alpha=0.2)
    return ax

# %% [markdown]
# ### The compute roof, measured directly: a loop of independent FMAs
#
# NumPy's BLAS gives *a* compute roof, but only as high as that library is good on this CPU,
# and only for the kernel it chose to run. The arithmetic units themselves can be measured
# directly: a loop that does nothing but fused multiply-adds, on vectors as wide as the CPU has
# (one float32, then 128-, 256- and 512-bit vectors: 4, 8 and 16 lanes), counted as 2 FLOPs per
# lane. Two numbers of the core decide what such a loop reaches
# ([simd](../hardware_notes/simd.md#fma-and-peak-flops)):
#
# - the FMA **throughput**: how many vector FMAs start per cycle (the number of FMA pipes,
#   two on most current x86 and Arm server cores);
# - the FMA **latency**: how many cycles until a result can feed the next FMA (4 on most).
#
# A loop with one accumulator (`acc = fma(b, s, acc)`) waits for each result: one FMA per
# latency. With A independent accumulators A FMAs are in flight, and the loop reaches the
# pipes' rate once A >= latency x pipes (8 for two pipes of 4 cycles). So the roof loop keeps 16
# accumulators (12 where the ISA has only 16 vector registers): more than any current core needs,
# fewer than the registers, so nothing is spilled to memory. It is written in LLVM IR (8 lines per
# accumulator count, printed below), compiled for this CPU by llvmlite (the compiler library
# Numba itself uses) and called through `ctypes`, which releases Python's lock: on all cores, one
# Python thread per core runs it at once. `fma_roof` gives the best rate of the widest vectors:
# the compute roof of the rooflines below, and the peak `make bench` states every kernel as a
# fraction of.
#
# **The BLAS as a student's machine runs it.** OpenBLAS picks its kernel for the CPU when it
# loads, unless the environment says otherwise: `OPENBLAS_CORETYPE=Haswell` holds it to its AVX2
# kernel on an AVX-512 CPU (some of the course's development machines set it, with
# `OPENBLAS_L2_SIZE`). `blas_line()` names the kernel in use (threadpoolctl's "architecture") and
# the CPU's vector ISA, and says so when the environment holds BLAS back; `blas_matmul_gflops`
# times NumPy's matmul, checked against float64, in this process when nothing holds it back, and
# otherwise in a child process started without those variables. All of it is given.

# %%
#| export
BLAS_HANDICAPS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # variables that hold OpenBLAS to another kernel


def blas_forced() -> dict[str, str]:
    """{variable: value} of the BLAS_HANDICAPS set in this process's environment; empty on a student's
    machine. OpenBLAS reads them once, when it loads."""
    return {k: os.environ[k] for k in BLAS_HANDICAPS if k in os.environ}


def blas_kernel() -> str:
    """NumPy's BLAS and the kernel it runs, as threadpoolctl names them: 'openblas 0.3.31 (SkylakeX
    kernel)', or 'no BLAS found'."""
    import numpy  # noqa: F401 - threadpoolctl sees only loaded libraries
    from threadpoolctl import threadpool_info

    found = [f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture') or 'unknown'} kernel)"
             for i in threadpool_info() if i.get("user_api") == "blas"]
    return ", ".join(found) or "no BLAS found"


_X86_EXTENSIONS = (("fma", "FMA3"), ("avx512vnni", "VNNI"), ("avx512bf16", "BF16"), ("avx512fp16", "FP16"),
                   ("avxvnni", "AVX-VNNI"), ("amx-int8", "AMX-INT8"), ("amx-bf16", "AMX-BF16"))
_ARM_EXTENSIONS = (("dotprod", "dotprod"), ("fullfp16", "fp16"), ("i8mm", "i8mm"), ("bf16", "bf16"),
                   ("sve", "SVE"), ("sme", "SME"))


def cpu_features() -> set[str]:
    """The instruction-set features of this CPU as LLVM names them ('avx2', 'avx512f', 'neon', ...)."""
    import llvmlite.binding as llvm

    return {name for name, on in llvm.get_host_cpu_features().items() if on}


def vector_isa() -> dict[str, Any]:
    """This CPU's vector instruction set: {'name': 'AVX-512' | 'AVX2' | 'AVX' | 'SSE2' | 'NEON' | ...,
    'registers': vector registers, 'widths': {label: float32 lanes} of the FMA loops worth measuring
    (scalar up to the widest vectors), 'extensions': the names of its int8/bf16/fp16/matrix extensions}."""
    import platform

    feats, machine = cpu_features(), platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        name = ("AVX-512" if "avx512f" in feats else "AVX2" if "avx2" in feats else "AVX" if "avx" in feats
                else "SSE2")
        widths = {"scalar": 1, "128-bit": 4}
        if "avx" in feats:
            widths["256-bit"] = 8
        if "avx512f" in feats:
            widths["512-bit"] = 16
        extensions = [label for f, label in _X86_EXTENSIONS if f in feats]
        return {"name": name, "registers": 32 if "avx512f" in feats else 16, "widths": widths,
                "extensions": extensions}
    if machine in ("aarch64", "arm64"):
        return {"name": "NEON", "registers": 32, "widths": {"scalar": 1, "128-bit": 4},
                "extensions": [label for f, label in _ARM_EXTENSIONS if f in feats]}
    return {"name": machine or "unknown", "registers": 16, "widths": {"scalar": 1}, "extensions": []}


def blas_line() -> str:
    """One line to print beside any comparison with NumPy's BLAS: the BLAS, the kernel it runs, the CPU's
    vector ISA, and, where the environment holds BLAS to another kernel than the CPU's, that fact."""
    isa = vector_isa()
    ext = f" with {', '.join(isa['extensions'])}" if isa["extensions"] else ""
    line = f"NumPy's BLAS: {blas_kernel()}; CPU vector ISA: {isa['name']}{ext}"
    forced = blas_forced()
    if forced:
        line += ("; NOTE: " + ", ".join(f"{k}={v}" for k, v in forced.items()) + " in this process's environment "
                 "hold(s) OpenBLAS to another kernel than a student's machine runs: BLAS timed in this process "
                 "is slower than it should be")
    return line


def native_env() -> dict[str, str]:
    """This process's environment without BLAS_HANDICAPS, with minitorch importable: for a child process
    that runs NumPy's BLAS as a student's machine does."""
    env = {k: v for k, v in os.environ.items() if k not in BLAS_HANDICAPS}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_native(target: str, timeout: float = 600.0, **kwargs: Any) -> Any:
    """Call `target` ('package.module:function') with `kwargs` (JSON values) in a child Python process
    started with native_env(), and return what it returns (a JSON value). For timing NumPy's BLAS where
    this process's environment holds it back: OpenBLAS reads BLAS_HANDICAPS only when it loads."""
    import json
    import subprocess

    module, sep, function = target.partition(":")
    if not sep or not module or not function.isidentifier():
        raise ValueError(f"run_native: target must be 'package.module:function', got {target!r}")
    code = (f"import json, sys, {module} as m; r = m.{function}(**json.loads(sys.argv[1])); "
            "print('\\n' + json.dumps(r))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], env=native_env(), capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"run_native: {target} failed in the child process:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _blas_matmul_run(sizes: list, threads: int | None, dtype: str, repeat: int, rounds: int, pause: float) -> dict:
    """blas_matmul_gflops's measurement, in whichever process runs it."""
    rng = np.random.default_rng(0)
    mats = {n: (rng.standard_normal((n, n)).astype(dtype), rng.standard_normal((n, n)).astype(dtype))
            for n in sizes}
    error = 0.0
    with blas_limit(threads):
        for a, b in mats.values():  # warm-up, and the check: relative to float64, as large as float32's rounding
            want = a.astype(np.float64) @ b.astype(np.float64)
            error = max(error, float(np.abs(np.matmul(a, b) - want).max() / max(np.abs(want).max(), 1e-300)))
        best = {n: float("inf") for n in sizes}
        for _ in range(rounds):
            for n, (a, b) in mats.items():
                number = max(1, 2_000_000 // n**2)  # calls per timed run: a small product takes microseconds
                time.sleep(pause)  # another thread pool's spinning threads settle
                np.matmul(a, b)
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    for _ in range(number):
                        np.matmul(a, b)
                    best[n] = min(best[n], (time.perf_counter() - t0) / number)
    return {"gflops": {str(n): 2.0 * n**3 / t / 1e9 for n, t in best.items()}, "error": error,
            "blas": blas_kernel(), "forced": blas_forced()}


def blas_matmul_gflops(sizes: list[int], threads: int | None = None, dtype=np.float32, repeat: int = 3,
                       rounds: int = 3, pause: float = 0.3) -> dict[str, Any]:
    """GFLOP/s of NumPy's matmul on (n, n) @ (n, n) for each n in `sizes`, BLAS on `threads` threads
    (None: as set up), best of `rounds` x `repeat` runs, each round after a `pause` (seconds). Runs as a
    student's machine does: in this process when no BLAS_HANDICAPS is set, else in a child process
    without them. Each product is checked against float64 first (a RuntimeError if it is off by more
    than float32 rounding allows). Returns {"gflops": {n: GFLOP/s}, "error": largest relative error,
    "blas": the BLAS and kernel that ran, "where": "this process" or "a child process without ..."}."""
    args = dict(sizes=[int(n) for n in sizes], threads=threads, dtype=np.dtype(dtype).name, repeat=int(repeat),
                rounds=int(rounds), pause=float(pause))
    forced = blas_forced()
    out = run_native("minitorch.bench:_blas_matmul_run", **args) if forced else _blas_matmul_run(**args)
    if out["error"] > 1e-4 * max(args["sizes"]) ** 0.5:
        raise RuntimeError(f"blas_matmul_gflops: NumPy's matmul is off by {out['error']:.2g} (relative to float64)")
    where = ("a child process without " + ", ".join(forced) + " (as on a student's machine)") if forced \
        else "this process"
    return {"gflops": {int(n): g for n, g in out["gflops"].items()}, "error": out["error"], "blas": out["blas"],
            "where": where}


_FMA_LOOPS: dict[tuple[int, int], tuple[Any, Any, str]] = {}


def fma_loop_ir(lanes: int, accumulators: int) -> str:
    """LLVM IR of `float fma_loop(i64 iters, float b, float s)`: `accumulators` independent vectors of
    `lanes` float32, each updated acc = b * s + acc (llvm.fmuladd: one FMA where the CPU has them)
    `iters` times; returns one lane of their sum, so that the work is used."""
    vt, n = (f"<{lanes} x float>", f"v{lanes}f32") if lanes > 1 else ("float", "f32")
    splat = ([f"  %b0 = insertelement {vt} undef, float %bs, i32 0",
              f"  %b = shufflevector {vt} %b0, {vt} undef, <{lanes} x i32> zeroinitializer",
              f"  %s0 = insertelement {vt} undef, float %ss, i32 0",
              f"  %s = shufflevector {vt} %s0, {vt} undef, <{lanes} x i32> zeroinitializer"] if lanes > 1
             else ["  %b = fadd float %bs, 0.0", "  %s = fadd float %ss, 0.0"])
    zero = "zeroinitializer" if lanes > 1 else "0.0"
    lines = [f"declare {vt} @llvm.fmuladd.{n}({vt}, {vt}, {vt})", "",
             "define float @fma_loop(i64 %iters, float %bs, float %ss) {", "entry:", *splat, "  br label %loop",
             "loop:", "  %i = phi i64 [0, %entry], [%i1, %loop]"]
    lines += [f"  %a{j} = phi {vt} [{zero}, %entry], [%n{j}, %loop]" for j in range(accumulators)]
    lines += [f"  %n{j} = call {vt} @llvm.fmuladd.{n}({vt} %b, {vt} %s, {vt} %a{j})" for j in range(accumulators)]
    lines += ["  %i1 = add i64 %i, 1", "  %more = icmp ult i64 %i1, %iters", "  br i1 %more, label %loop, label %done",
              "done:"]
    total = "%n0"
    for j in range(1, accumulators):
        lines.append(f"  %t{j} = fadd {vt} {total}, %n{j}")
        total = f"%t{j}"
    lines.append(f"  %r = extractelement {vt} {total}, i32 0" if lanes > 1 else f"  %r = fadd float {total}, 0.0")
    return "\n".join(lines + ["  ret float %r", "}", ""])


def fma_loop(lanes: int, accumulators: int) -> tuple[Callable[[int, float, float], float], str]:
    """(function, assembly) of fma_loop_ir(lanes, accumulators) compiled for this CPU by llvmlite: call
    function(iters, b, s) from any thread (ctypes releases Python's lock while it runs)."""
    key = (int(lanes), int(accumulators))
    if key not in _FMA_LOOPS:
        import ctypes

        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        tm = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
        module = llvm.parse_assembly(fma_loop_ir(*key))
        module.verify()
        asm = tm.emit_assembly(module)
        engine = llvm.create_mcjit_compiler(module, tm)
        engine.finalize_object()
        fn = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_float)(
            engine.get_function_address("fma_loop"))
        _FMA_LOOPS[key] = (engine, fn, asm)  # the engine owns the machine code: keep it alive
    return _FMA_LOOPS[key][1], _FMA_LOOPS[key][2]


def measure_fma(lanes: int, accumulators: int, threads: int = 1, seconds: float = 0.02, repeat: int = 5) -> float:
    """FLOP/s (2 per FMA and lane) of the FMA loop with `accumulators` vectors of `lanes` float32, run on
    `threads` Python threads at once (one per core), each for about `seconds`: the best of `repeat` runs."""
    import threading

    fn, _ = fma_loop(lanes, accumulators)
    fn(1000, 1.0, 1e-3)  # page in the code
    t0 = time.perf_counter()
    fn(100_000, 1.0, 1e-3)
    iters = max(1000, int(100_000 * seconds / max(time.perf_counter() - t0, 1e-7)))
    best = float("inf")
    for _ in range(repeat):
        start = threading.Barrier(threads + 1)

        def work():
            start.wait()
            fn(iters, 1.0, 1e-3)

        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in pool:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * lanes * accumulators * iters * threads / best


def fma_accumulators() -> int:
    """Accumulators of the roof loop: 16 where the ISA has 32 vector registers, 12 where it has 16."""
    return 16 if vector_isa()["registers"] >= 32 else 12


def fma_peaks(threads: int = 1, seconds: float = 0.02, repeat: int = 5) -> dict[str, float]:
    """{width label: FLOP/s} of the FMA loop at each vector width this CPU has (vector_isa()['widths']),
    fma_accumulators() accumulators, on `threads` threads at once."""
    acc = fma_accumulators()
    return {label: measure_fma(lanes, acc, threads, seconds, repeat) for label, lanes in vector_isa()["widths"].items()}


def fma_roof(threads: int = 1, seconds: float = 0.02, repeat: int = 5) -> float:
    """The compute roof in float32 FLOP/s: the FMA loop on the widest vectors, `threads` threads at once."""
    widest = max(vector_isa()["widths"].values())
    return measure_fma(widest, fma_accumulators(), threads, seconds, repeat)

# %% [markdown]
# **Demo: the FMA loop, and how many accumulators it needs.** First the loop's machine code for
# the widest vectors here (expect one `vfmadd...ps` per accumulator on `zmm` registers on an
# AVX-512 CPU, `ymm` on AVX2, `fmla v.4s` on Arm), then its rate on one core with 1 to 16
# accumulators. With one accumulator the loop runs at one FMA per latency; the rate grows with
# each accumulator until latency x pipes are in flight, and stays flat after. The ratio of the
# flat rate to the one-accumulator rate is latency x pipes itself, measured without knowing the
# clock: lesson 06 sizes its micro-kernel with it.
#
# On the course's development machine (an Intel Xeon with AVX-512 under KVM, 2 vCPUs, nearly idle:
# load average 0.7), one run of the same measurement gave 27.6 GFLOP/s with one accumulator of 16
# lanes, 197 with 8 and 220 with 10 to 16: 8.0 FMAs in flight, the 2 pipes x 4 cycles of Intel's
# manuals for its AVX-512 server cores. The loop is one `vfmadd231ps` on `zmm` registers per
# accumulator. Your own machine prints its own.

# %% tags=["demo"]
import re

import matplotlib.pyplot as plt

print(load_report())
isa = vector_isa()
widest = max(isa["widths"].values())
_, fma_asm = fma_loop(widest, 4)
print(f"CPU vector ISA: {isa['name']}, {isa['registers']} vector registers; the FMA loop with 4 accumulators of "
      f"{widest} float32, its loop:")
asm_lines = fma_asm.splitlines()
fma_at = [i for i, ln in enumerate(asm_lines) if re.search(r"\bv?fm(?:add|la)", ln)]
print("\n".join(asm_lines[max(fma_at[0] - 3, 0):fma_at[-1] + 4]))
sweep = {a: measure_fma(widest, a, repeat=3 if SMALL else 5) for a in (1, 2, 3, 4, 6, 8, 10, 12, 16)}
in_flight = max(sweep.values()) / sweep[1]
for a, r in sweep.items():
    print(f"{a:2d} accumulator{'s' * (a > 1)}: {r / 1e9:6.1f} GFLOP/s")
print(f"best / one accumulator = {in_flight:.1f}: FMAs in flight = latency x pipes")
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(list(sweep), [r / 1e9 for r in sweep.values()], "o-")
ax.set(xlabel="independent accumulators", ylabel="GFLOP/s (one core)",
       title=f"FMA loop, {widest} float32 lanes: flat from about {round(in_flight)} accumulators")
ax.grid(True, alpha=0.3)
plt.show()

# %% [markdown]
# **Demo: this machine's roofs**, on one thread and on all of them: the triad's bandwidth, the FMA
# roof at each vector width, and NumPy's float32 matmul at its best size as a fraction of the roof
# (timed as a student's machine runs it, `blas_matmul_gflops`; `blas_line()` names the kernel that
# ran).
#
# One `make bench L=roofline` run on the same machine (the same functions; load average 0.4-0.7;
# OpenBLAS 0.3.31 on its AVX-512 "SkylakeX" kernel) printed: one thread, triad 15.2 GB/s and an FMA
# roof of 230 GFLOP/s (the 512-bit loop; 125 at 256 bits, 63 at 128, 16 scalar), a ridge of about
# 15 FLOP/byte, NumPy's best float32 matmul 180 GFLOP/s = 78% of the roof; two threads, 30.2 GB/s
# and 450 GFLOP/s, a ridge of 14.9, the matmul at 324 GFLOP/s = 72%. Both roofs doubled with the
# second core, so the ridge stayed put.
#
# Mixing the roofs, compute from two threads over bandwidth from one, draws a ridge for a machine
# that does not exist (the last line). Under heavy load the multi-threaded figures fall by 10x or
# more, which is why `load_report` comes first. Expect your own figures to differ; the ratios are
# what matters.

# %% tags=["demo"]
import numba

print(load_report())
print(blas_line())
all_threads = numba.get_num_threads()
roofs = {}
blas_best = {}
for threads in sorted({1, all_threads}):
    bw_t = measure_bandwidth(n=4_000_000 if SMALL else 20_000_000, repeat=5 if SMALL else 10, threads=threads)
    peaks_t = fma_peaks(threads, repeat=3 if SMALL else 5)
    peak_t = max(peaks_t.values())
    blas = blas_matmul_gflops((256, 512) if SMALL else (512, 1024, 2048), threads=threads, rounds=1 if SMALL else 2)
    blas_best[threads] = max(blas["gflops"].values()) * 1e9
    roofs[threads] = (bw_t, peak_t)
    label = f"{threads} thread{'s' * (threads > 1)}"
    print(f"{label}: FMA loop " + ", ".join(f"{w} {r / 1e9:.1f}" for w, r in peaks_t.items()) + " GFLOP/s")
    print(f"{label}: triad {bw_t / 1e9:6.1f} GB/s   FMA roof {peak_t / 1e9:6.1f} GFLOP/s   ridge {peak_t / bw_t:5.1f} "
          f"FLOP/byte   BLAS float32 matmul {blas_best[threads] / 1e9:6.1f} GFLOP/s = {blas_best[threads] / peak_t:.0%} "
          f"of the roof ({blas['where']})")
print(f"mixed (compute on {all_threads} threads, bandwidth on 1): ridge {roofs[all_threads][1] / roofs[1][0]:.1f} "
      "FLOP/byte, a machine that does not exist")

# %% [markdown]
# **Demo: kernels on the roofline.** We time three kinds of kernel and place each at its
# *minimum-traffic* intensity and its achieved FLOP/s, once with BLAS on one thread against
# the one-thread roofs and once with BLAS on every thread against the all-thread roofs; the
# label shows the fraction of the roof each reaches. What to expect:
#
# - `a + b` sits on the slanted roof of one thread: memory-bound, near the measured bandwidth
#   (NumPy's add is a single pass, close to ideal). NumPy's elementwise loops always run on
#   one thread, so against the all-thread roof it reaches only what one core can pull from
#   memory.
# - NumPy softmax lands far *below* its roof: its five steps (`max`, `-`, `exp`, `sum`, `/`)
#   each read a full array and three of them write a fresh temporary: 8 array passes instead
#   of 2, about 4x the minimum bytes. It also pays page faults for the new temporaries, and
#   `exp` costs more than the one FLOP we count. Fusing the steps into one pass (lesson 08's
#   softmax kernel, exercise 8.6) is what moves it up.
# - matmul (NumPy's BLAS, timed as a student's machine runs it) climbs with size: small
#   matrices are limited by overheads, large ones approach the flat roof, but stay under it:
#   the FMA loop does nothing but FMAs, a matmul also loads, packs and stores.
#
# A measured roof is the best rate seen. If a kernel beats it (the roof's own run was unlucky),
# the roof is raised to that kernel rather than reporting more than 100%; such a point then
# sits at 100% *by construction*, and the plot and table say "sets the roof". The bandwidth roof
# is the one this happens to, when `a + b` beats the triad.
#
# In that run, on one thread: `a + b` set the bandwidth roof (it beat the triad), NumPy's softmax
# reached 15% of its roof, the matmuls 59-65% (n = 32 and 128) and 74-77% (n = 512 to 2048) of
# the FMA roof.

# %% tags=["demo"]
rng = np.random.default_rng(0)
n = 8_000_000 if SMALL else 20_000_000  # 96+ MB: well beyond the L3 cache of most machines
a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
out = np.empty_like(a)
r, c = (512, 1024) if SMALL else (4096, 1024)
x = rng.standard_normal((r, c), dtype=np.float32)
sizes = (32, 128, 512) if SMALL else (32, 128, 512, 2048)


def np_softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


print(blas_line())
fig, axes = plt.subplots(1, len(roofs), figsize=(6.5 * len(roofs), 4.5), squeeze=False)
for ax, (threads, (bw_t, peak_t)) in zip(axes[0], roofs.items()):
    points = {}
    with blas_limit(threads):
        t = benchmark(np.add, a, b, out, warmup=2, repeat=5)
        points["add"] = (arithmetic_intensity(elementwise_flops(n), elementwise_bytes(n, 4)), elementwise_flops(n) / t.min)
        t = benchmark(np_softmax, x, warmup=2, repeat=5)
        points["softmax"] = (arithmetic_intensity(softmax_flops(r, c), softmax_bytes(r, c, 4)),
                             softmax_flops(r, c) / t.min)
    blas = blas_matmul_gflops(sizes, threads=threads, rounds=1 if SMALL else 2)
    for m, g in blas["gflops"].items():
        points[f"matmul {m}"] = (arithmetic_intensity(matmul_flops(m, m, m), matmul_bytes(m, m, m, 4)), g * 1e9)
    bw_t = max(bw_t, points["add"][1] / points["add"][0])  # raise a roof that a kernel beat
    peak_t = max(peak_t, *(f for k, (i, f) in points.items() if k.startswith("matmul")))
    print(f"{threads} thread{'s' * (threads > 1)} (roofs {bw_t / 1e9:.1f} GB/s, {peak_t / 1e9:.1f} GFLOP/s; "
          f"matmul timed in {blas['where']}):")
    for k, (i, f) in points.items():
        frac = f / attainable_flops(i, peak_t, bw_t)
        print(f"  {k:12s} intensity {i:8.3f} FLOP/B   {f / 1e9:8.2f} GFLOP/s   {frac:6.1%} of roof"
              + ("  (sets the roof: 100% by construction)" if abs(frac - 1) < 1e-9 else ""))
    roofline_plot(peak_t, bw_t, points, ax=ax, title=f"this machine, {threads} thread{'s' * (threads > 1)}")
plt.tight_layout()
plt.show()

# %% [markdown]
# Live: any kernel on the rooflines measured above. Slide its arithmetic intensity: left of the
# ridge point the bound is `intensity x bandwidth` (memory-bound, each extra FLOP per byte is
# free speed), right of it the flat compute roof.

# %% tags=["demo"]
from course.live import live


def draw_roofline_point(log10_intensity: float, threads: int):
    bw_t, peak_t = roofs[threads]
    i = 10 ** log10_intensity
    f = attainable_flops(i, peak_t, bw_t)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    roofline_plot(peak_t, bw_t, {f"I = {i:.3g}": (i, f)}, ax=ax,
                  title=f"{threads} thread(s): at most {f / 1e9:.2f} GFLOP/s, "
                        f"{'memory' if i < peak_t / bw_t else 'compute'}-bound")
    return fig


live(draw_roofline_point, log10_intensity=(-2.0, 3.0), threads=sorted(roofs))

# %% [markdown]
# ## 4. Transformer arithmetic
#
# With the counters above you can predict the cost of a model before running it. For a
# decoder-only transformer with `n_layers` blocks, width `d = d_model`, MLP width `d_ff`
# (usually `4d`), vocabulary `V` and context `n_ctx` (Kaplan et al. 2020, Section 2.1, Table 1):
#
# **Parameters.** Each block has the attention projections Q, K, V, O (`4 d^2`) and the MLP's
# two matrices (`2 d d_ff`). Biases and layer norms add `O(d)` per block, under 1%, and are
# ignored. So the *non-embedding* parameter count is
#
# $$N = n_\text{layers}\,(4d^2 + 2 d\, d_\text{ff}) = 12\, n_\text{layers} d^2 \quad (d_\text{ff} = 4d).$$
#
# The embeddings add `V d` (token table) and `n_ctx d` (learned positions, GPT-2 style); an
# output projection that is *not* tied to the token table adds another `V d`.
#
# **FLOPs per token, forward.** Every weight is used in one MAC per token: `2N` FLOPs. Attention
# scores and their weighted sum add, per layer, `q . k` and `p v` over the preceding tokens:
# `2 d` FLOPs per (query, key) pair each. With a causal mask a query sees on average
# `n_ctx / 2` keys, giving Kaplan's term `2 n_layers n_ctx d`. The output projection onto the
# vocabulary (the "de-embedding") adds `2 d V`:
#
# $$C_\text{forward} = 2N + 2\, n_\text{layers} n_\text{ctx} d + 2 d V.$$
#
# Kaplan's `C_forward = 2N + 2 n_layers n_ctx d` is this with `V = 0` (they exclude embeddings
# from N and from C). Per layer and token that is `24 d^2 + 2 n_ctx d`: the attention term is
# negligible while `n_ctx < 12 d`.
#
# **Training.** The backward pass costs about twice the forward (one matmul for the gradient
# with respect to the input, one for the weights), so training costs **~6N FLOPs per token**,
# and **`C = 6 N D`** for `D` training tokens.
#
# ### Exercise 4.4: `transformer_params`, `transformer_flops_per_token`

# %%
#| export
#| exercise 4.4
def transformer_params(n_layers: int, d_model: int, vocab: int, d_ff: int | None = None,
                       n_ctx: int = 0, embeddings: bool = True, tied: bool = True) -> int:
    """Parameters of a decoder-only transformer (Kaplan et al. 2020, Table 1).

    Per layer 4*d_model^2 (attention Q, K, V, O) + 2*d_model*d_ff (MLP); d_ff defaults to
    4*d_model; biases and norms ignored. With `embeddings`, add vocab*d_model (tokens) and
    n_ctx*d_model (learned positions), plus vocab*d_model if the output head is not `tied`.
    """
    ### BEGIN SOLUTION
    _check_dims(n_layers=n_layers, d_model=d_model, vocab=vocab, n_ctx=n_ctx)
    d, d_ff = int(d_model), int(4 * d_model if d_ff is None else d_ff)
    n = int(n_layers) * (4 * d * d + 2 * d * d_ff)
    if embeddings:
        n += int(vocab) * d + int(n_ctx) * d
        if not tied:
            n += int(vocab) * d
    return n
    ### END SOLUTION


def transformer_flops_per_token(n_layers: int, d_model: int, n_ctx: int, d_ff: int | None = None,
                                vocab: int = 0) -> int:
    """Forward FLOPs per token: 2*N + 2*n_layers*n_ctx*d_model + 2*d_model*vocab.

    N is the non-embedding parameter count. vocab=0 gives Kaplan et al. 2020's C_forward.
    """
    ### BEGIN SOLUTION
    _check_dims(n_layers=n_layers, d_model=d_model, n_ctx=n_ctx, vocab=vocab)
    n = transformer_params(n_layers, d_model, 0, d_ff=d_ff, embeddings=False)
    return 2 * n + 2 * int(n_layers) * int(n_ctx) * int(d_model) + 2 * int(d_model) * int(vocab)
    ### END SOLUTION

# %% tags=["check"]
check("4.4")

# %% [markdown]
# **Demo: GPT-2 small.** 12 layers, `d = 768`, `V = 50257`, `n_ctx = 1024`, tied output head.
# The formula gives 124,318,464 parameters; the released checkpoint has 124,439,808. The
# difference, 121,344 (0.1%), is exactly the biases and layer norms we ignored. Of the 124M,
# 39M (32%) are embeddings: at this small size the embedding table is a large share of the
# model, which is why Kaplan et al. count only non-embedding parameters in their laws.

# %% tags=["demo"]
gpt2 = dict(n_layers=12, d_model=768, vocab=50257, n_ctx=1024)
n_all = transformer_params(**gpt2)
n_body = transformer_params(**gpt2, embeddings=False)
print(f"GPT-2 small: {n_all:,} parameters, {n_body:,} non-embedding")
fwd = transformer_flops_per_token(12, 768, 1024, vocab=50257)
print(f"forward: {fwd / 1e6:.0f} MFLOP/token = {fwd / n_all:.2f} x params")
for ctx in (1024, 8192, 65536):
    f = transformer_flops_per_token(12, 768, ctx)
    print(f"  n_ctx {ctx:6d}: attention share of non-embedding forward FLOPs "
          f"{2 * 12 * ctx * 768 / f:.0%}")

# %% [markdown]
# ### Training memory
#
# Training with Adam keeps, per parameter (Rajbhandari et al. 2019, "ZeRO", Section 3.1):
#
# | precision | weights | gradients | optimizer state | total |
# |---|---|---|---|---|
# | fp32 | 4 | 4 | 8 (Adam m, v) | 16 bytes |
# | mixed (fp16/bf16 + fp32 master) | 2 | 2 | 12 (fp32 master copy, m, v) | 16 bytes |
#
# Mixed precision (Micikevicius et al. 2017) does *not* shrink this: the fp32 master copy of the
# weights is needed so small updates are not lost to rounding. What it saves is activation
# memory and, on tensor-core hardware, time. SGD with momentum keeps one state (4 bytes), plain
# SGD none (mixed SGD still keeps the 4-byte master copy). Activations are extra and depend on
# batch size and sequence length (activation checkpointing trades them for compute; the
# data-parallel lesson, planned as lesson 12, does both). A 7B-parameter model thus needs
# 112 GB for weights, gradients and Adam state before any activation: more than one 80 GB GPU,
# which is the problem ZeRO solves by sharding the three terms across GPUs (see
# [optimizer memory](../hardware_notes/optimizer_memory.md)).
#
# ### Exercise 4.5: `training_flops`, `training_memory_breakdown`

# %%
#| export
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}  # fp32 tensors per parameter
PRECISIONS = ("fp32", "mixed")

# %%
#| export
#| exercise 4.5
def training_flops(n_params: float, n_tokens: float) -> float:
    """Total training FLOPs C = 6 * N * D (forward 2N + backward 4N per token)."""
    ### BEGIN SOLUTION
    if n_params < 0 or n_tokens < 0:
        raise ValueError(f"n_params and n_tokens must be >= 0, got {n_params!r}, {n_tokens!r}")
    return 6.0 * n_params * n_tokens
    ### END SOLUTION


def training_memory_breakdown(n_params: int, optimizer: str = "adam", precision: str = "mixed") -> dict[str, int]:
    """Bytes for {"weights", "gradients", "optimizer"} when training `n_params` parameters.

    fp32: 4-byte weights and gradients; optimizer state 4 bytes per state tensor
    (OPTIMIZER_STATES). mixed: 2-byte weights and gradients; optimizer holds a 4-byte fp32
    master copy plus the fp32 states (ZeRO, Rajbhandari et al. 2019). Activations excluded.
    """
    ### BEGIN SOLUTION
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
    _check_dims(n_params=n_params)
    n = int(n_params)
    states = 4 * OPTIMIZER_STATES[optimizer]
    if precision == "fp32":
        return {"weights": 4 * n, "gradients": 4 * n, "optimizer": states * n}
    return {"weights": 2 * n, "gradients": 2 * n, "optimizer": (4 + states) * n}
    ### END SOLUTION

# %% tags=["check"]
check("4.5")

# %%
#| export
def training_memory_bytes(n_params: int, optimizer: str = "adam", precision: str = "mixed") -> int:
    """Total bytes of weights + gradients + optimizer state (16 * n_params for Adam)."""
    return sum(training_memory_breakdown(n_params, optimizer, precision).values())

# %% [markdown]
# ## 5. Compute-optimal scaling
#
# Given a compute budget `C`, how large a model, trained on how many tokens? Kaplan et al.
# (2020) concluded that model size should grow much faster than data. Hoffmann et al. (2022,
# "Chinchilla") re-ran the study with learning-rate schedules matched to each run's length and
# found parameters and tokens should grow *equally*: `N_opt ~ C^0.5`, `D_opt ~ C^0.5`, about
# **20 tokens per parameter**. Their 70B-parameter Chinchilla, trained on 1.4T tokens, beat the
# 280B Gopher trained with the same compute on 300B tokens.
#
# With `C = 6 N D` and `D = 20 N`: `C = 120 N^2`, so `N = sqrt(C / 120)` and `D = 20 N`.
#
# ### Exercise 4.6: `chinchilla_optimal`

# %%
#| export
#| exercise 4.6
def chinchilla_optimal(compute_flops: float, tokens_per_param: float = 20.0) -> tuple[float, float]:
    """(N params, D tokens) with 6*N*D = compute_flops and D = tokens_per_param * N."""
    ### BEGIN SOLUTION
    if compute_flops <= 0 or tokens_per_param <= 0:
        raise ValueError(f"compute_flops and tokens_per_param must be positive, got "
                         f"{compute_flops!r}, {tokens_per_param!r}")
    n = math.sqrt(compute_flops / (6.0 * tokens_per_param))
    return n, tokens_per_param * n
    ### END SOLUTION

# %% tags=["check"]
check("4.6")

# %% [markdown]
# **Demo: what would this machine train?** Take the float32 BLAS rate measured above, assume a
# (generous) 50% of it is sustained through a whole training run, and ask what a day of compute
# buys. The answer is humbling: a Chinchilla-optimal model of a few million parameters. The same
# arithmetic for a server of 8 H100 GPUs (989 TFLOP/s dense bf16 each, NVIDIA's datasheet) at
# 40% utilisation gives a model of about 1.5 billion parameters in a day. The same formula,
# with power and prices, gives the cost of a real run: [the cost of a training
# run](../hardware_notes/energy.md#the-cost-of-a-training-run) works it through for Llama 3.1.

# %% tags=["demo"]
day = 24 * 3600
for name, flops_per_s in (("this machine (50% of BLAS peak)", 0.5 * blas_best[all_threads]),
                          ("8 x H100 bf16 at 40%", 8 * 989e12 * 0.4)):
    c = flops_per_s * day
    n_opt, d_opt = chinchilla_optimal(c)
    mem = training_memory_bytes(int(n_opt))
    print(f"{name:32s}: C = {c:.2e} FLOP/day -> N = {n_opt:.3g} params, D = {d_opt:.3g} tokens, "
          f"Adam state {mem / 2**30:.2f} GiB")

# %% [markdown]
# ## What you measured / what to remember
#
# - Time with warm-up (JIT compile, page faults, thread start excluded), repeats, a `sync` for
#   asynchronous devices, and report min and median. Noise only adds time; the minimum is the
#   stable estimate. `minitorch.bench.benchmark` is what every later lesson uses.
# - 1 MAC = 2 FLOPs. `(m,k) @ (k,n)`: `2mnk` FLOPs, at least `(mk + kn + mn) * itemsize` bytes.
# - Arithmetic intensity decides the bound: attainable = `min(P, I * B)`. Measure both roofs
#   on the same threads. On the 2-core dev machine (Zen 4 VM) one thread gave 25 GB/s and
#   98 GFLOP/s float32, two threads 53 GB/s and 192 GFLOP/s: a ridge of about 4 FLOP/byte
#   either way (7.7 if the two are mixed). Elementwise ops and softmax (I < 1) are memory-bound
#   by a wide margin, large matmuls compute-bound; NumPy's elementwise ops use one core, so
#   they reach only half of the two-thread bandwidth roof.
# - A roof is the best rate seen; a kernel that beat it raised it and sits at 100% by
#   construction (here `a + b` and the largest matmul).
# - A kernel far below its roof wastes either traffic (NumPy softmax: several passes) or
#   compute (small matmul: overheads). Lessons 05-08 close these gaps on the CPU and the GPU.
# - Transformers: `N ~ 12 n_layers d^2`, forward `~2N` FLOPs per token (+ `2 n_layers n_ctx d`
#   for attention), training `~6N` per token, `C = 6ND`; Adam training state 16 bytes per
#   parameter in fp32 or mixed precision; compute-optimal `D ~ 20 N`.
#
# ## Sources
#
# - J. Chen, J. Revels, "Robust benchmarking in noisy environments", 2016. https://arxiv.org/abs/1608.04295
# - Python documentation, `timeit` (notes on min, gc, number/repeat). https://docs.python.org/3/library/timeit.html
# - J. D. McCalpin, "Memory Bandwidth and Machine Balance in Current High Performance Computers",
#   IEEE TCCA Newsletter, 1995; STREAM benchmark. https://www.cs.virginia.edu/stream/
# - S. Williams, A. Waterman, D. Patterson, "Roofline: An Insightful Visual Performance Model for
#   Multicore Architectures", Communications of the ACM 52(4), 2009. https://doi.org/10.1145/1498765.1498785
# - H. He, "Making Deep Learning Go Brrrr From First Principles", 2022. https://horace.io/brrr_intro.html
# - J. Kaplan et al., "Scaling Laws for Neural Language Models", 2020 (Section 2.1, Table 1). https://arxiv.org/abs/2001.08361
# - J. Hoffmann et al., "Training Compute-Optimal Large Language Models", 2022. https://arxiv.org/abs/2203.15556
# - S. Rajbhandari, J. Rasley, O. Ruwase, Y. He, "ZeRO: Memory Optimizations Toward Training
#   Trillion Parameter Models", 2019 (Section 3.1). https://arxiv.org/abs/1910.02054
# - P. Micikevicius et al., "Mixed Precision Training", 2017. https://arxiv.org/abs/1710.03740
# - Q. Anthony, S. Biderman, H. Schoelkopf, "Transformer Math 101", EleutherAI blog, 2023. https://blog.eleuther.ai/transformer-math/
# - A. Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019. https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf


# %%
#| export
#| given
from minitorch.checks import (Attrs, Choice, Count, Int, Number, NonNegative, Optional, Positive, Rule,  # noqa: E402
                              Seq, Size, Str, describe, validate_public)


class _Intensity(Rule):
    """Arithmetic intensity: a number >= 0 (inf allowed: no bytes moved), or an ndarray of real dtype
    with no NaN and no value < 0."""

    number = Number(0, finite=False)
    finite = False  # the validation walk's marker: inf is a valid intensity

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, np.ndarray):
            if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{what}: {name} must be a number >= 0 or an ndarray of them, got {describe(value)}")
            self.number(what, name, value)
            return
        if value.dtype.kind not in "iuf":
            raise TypeError(f"{what}: {name} must be a number >= 0 or an ndarray of them, got {describe(value)}")
        if value.size and (np.isnan(value).any() or (value < 0).any()):
            raise ValueError(f"{what}: {name} must hold numbers >= 0 (no NaN), got {value!r:.120}")


class _FloatDtype(Rule):
    """A floating NumPy dtype, or what names one (np.float32, "float64")."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        try:
            ok = value is not None and np.dtype(value).kind == "f"
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise TypeError(f"{what}: {name} must be a floating dtype (np.float32, np.float64), got {describe(value)}")


class _Points(Rule):
    """roofline_plot's points: {label: (intensity, achieved FLOP/s)}, both finite and > 0 (log axes)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"{what}: {name} must be a dict {{label: (intensity, FLOP/s)}}, got {describe(value)}")
        for label, point in value.items():
            if not isinstance(point, (tuple, list)) or len(point) != 2:
                raise TypeError(f"{what}: {name}[{label!r}] must be a pair (intensity, FLOP/s), got {describe(point)}")
            for i, v in enumerate(point):
                Number(0, lo_open=True)(what, f"{name}[{label!r}][{i}]", v)


_DIMS = {name: Count for name in ("m", "n", "k", "rows", "cols", "n_inputs", "n_layers", "d_model", "vocab", "n_ctx",
                                  "n_params")}
_FMA_SHAPE = {"lanes": Int(1, 64), "accumulators": Int(1, 64)}
_MEMORY = {"n_params": Count, "optimizer": Choice(*OPTIMIZER_STATES), "precision": Choice(*PRECISIONS)}

validate_public(globals(), {
    "blas_limit": {"threads": Optional(Size)},
    "load_report": {"busy_per_core": Positive},
    "benchmark": {"warmup": Count, "repeat": Size, "number": Size},
    "matmul_flops": _DIMS, "matmul_macs": _DIMS,
    "matmul_bytes": {**_DIMS, "itemsize": Size},
    "elementwise_flops": _DIMS,
    "elementwise_bytes": {**_DIMS, "itemsize": Size},
    "softmax_flops": _DIMS,
    "softmax_bytes": {**_DIMS, "itemsize": Size},
    "gflops": {"flops": NonNegative, "seconds": Positive},
    "arithmetic_intensity": {"flops": NonNegative, "bytes": Positive},
    "attainable_flops": {"intensity": _Intensity(), "peak_flops": Positive, "peak_bandwidth": Positive},
    "measure_bandwidth": {"n": Size, "repeat": Size, "dtype": _FloatDtype(), "threads": Optional(Size)},
    "measure_peak_matmul": {"n": Size, "repeat": Size, "dtype": _FloatDtype(), "threads": Optional(Size)},
    "run_native": {"target": Str(), "timeout": Positive},
    "blas_matmul_gflops": {"sizes": Seq(Size, min_len=1), "threads": Optional(Size), "dtype": _FloatDtype(),
                           "repeat": Size, "rounds": Size, "pause": NonNegative},
    "fma_loop_ir": _FMA_SHAPE, "fma_loop": _FMA_SHAPE,
    "measure_fma": {**_FMA_SHAPE, "threads": Size, "seconds": Positive, "repeat": Size},
    "fma_peaks": {"threads": Size, "seconds": Positive, "repeat": Size},
    "fma_roof": {"threads": Size, "seconds": Positive, "repeat": Size},
    "roofline_plot": {"peak_flops": Positive, "bandwidth": Positive, "points": Optional(_Points()),
                      "ax": Optional(Attrs("loglog", "plot", "annotate"))},
    "transformer_params": {**_DIMS, "d_ff": Optional(Count)},
    "transformer_flops_per_token": {**_DIMS, "d_ff": Optional(Count)},
    "training_flops": {"n_params": NonNegative, "n_tokens": NonNegative},
    "training_memory_breakdown": _MEMORY,
    "training_memory_bytes": _MEMORY,
    "chinchilla_optimal": {"compute_flops": Positive, "tokens_per_param": Positive},
})
