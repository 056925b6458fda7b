# Generated from solutions/04_measuring.py by `make build`. Do not edit.
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


def benchmark(fn: Callable[..., Any], *args: Any, warmup: int = 1, repeat: int = 5, number: int = 1,
              sync: Callable[[], Any] | None = None,
              timer: Callable[[], float] = time.perf_counter) -> Timing:
    """Time `fn(*args)`: `warmup` untimed calls, then `repeat` runs of `number` calls each.

    `sync()` (if given) runs after the warm-up and inside each timed run, before the clock
    stops. Returns Timing whose `times[i]` is run i's seconds per call (length `repeat`).
    """
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


def _check_dims(**dims: int) -> None:
    for name, v in dims.items():
        if int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of (m, k) @ (k, n): one multiply and one add per MAC."""
    _check_dims(m=m, n=n, k=k)
    return 2 * int(m) * int(n) * int(k)


def matmul_macs(m: int, n: int, k: int) -> int:
    """Multiply-accumulates of (m, k) @ (k, n)."""
    _check_dims(m=m, n=n, k=k)
    return int(m) * int(n) * int(k)


def matmul_bytes(m: int, n: int, k: int, itemsize: int) -> int:
    """Minimum DRAM traffic of (m, k) @ (k, n) -> (m, n): read A and B once, write C once."""
    _check_dims(m=m, n=n, k=k, itemsize=itemsize)
    return (int(m) * int(k) + int(k) * int(n) + int(m) * int(n)) * int(itemsize)


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


def attainable_flops(intensity: float | np.ndarray, peak_flops: float,
                     peak_bandwidth: float) -> float | np.ndarray:
    """Roofline bound min(peak_flops, intensity * peak_bandwidth) in FLOP/s.

    intensity: FLOP/byte, scalar or array; peak_flops: FLOP/s; peak_bandwidth: bytes/s.
    """
    if peak_flops <= 0 or peak_bandwidth <= 0:
        raise ValueError(f"peaks must be positive, got peak_flops={peak_flops!r}, "
                         f"peak_bandwidth={peak_bandwidth!r}")
    i = np.asarray(intensity, dtype=np.float64)
    if np.any(i < 0):
        raise ValueError(f"arithmetic intensity must be >= 0, got {intensity!r}")
    out = np.minimum(float(peak_flops), i * float(peak_bandwidth))
    return float(out) if out.ndim == 0 else out


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
    `threads` threads (None: as BLAS is currently set up)."""
    if n < 1 or repeat < 1 or (threads is not None and threads < 1):
        raise ValueError(f"n, repeat and threads must be >= 1, got n={n}, repeat={repeat}, threads={threads}")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    out = np.empty((n, n), dtype=dtype)
    with blas_limit(threads):
        t = benchmark(np.matmul, a, b, out, warmup=2, repeat=repeat)
    return 2.0 * n**3 / t.min


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


def transformer_params(n_layers: int, d_model: int, vocab: int, d_ff: int | None = None,
                       n_ctx: int = 0, embeddings: bool = True, tied: bool = True) -> int:
    """Parameters of a decoder-only transformer (Kaplan et al. 2020, Table 1).

    Per layer 4*d_model^2 (attention Q, K, V, O) + 2*d_model*d_ff (MLP); d_ff defaults to
    4*d_model; biases and norms ignored. With `embeddings`, add vocab*d_model (tokens) and
    n_ctx*d_model (learned positions), plus vocab*d_model if the output head is not `tied`.
    """
    _check_dims(n_layers=n_layers, d_model=d_model, vocab=vocab, n_ctx=n_ctx)
    d, d_ff = int(d_model), int(4 * d_model if d_ff is None else d_ff)
    n = int(n_layers) * (4 * d * d + 2 * d * d_ff)
    if embeddings:
        n += int(vocab) * d + int(n_ctx) * d
        if not tied:
            n += int(vocab) * d
    return n


def transformer_flops_per_token(n_layers: int, d_model: int, n_ctx: int, d_ff: int | None = None,
                                vocab: int = 0) -> int:
    """Forward FLOPs per token: 2*N + 2*n_layers*n_ctx*d_model + 2*d_model*vocab.

    N is the non-embedding parameter count. vocab=0 gives Kaplan et al. 2020's C_forward.
    """
    _check_dims(n_layers=n_layers, d_model=d_model, n_ctx=n_ctx, vocab=vocab)
    n = transformer_params(n_layers, d_model, 0, d_ff=d_ff, embeddings=False)
    return 2 * n + 2 * int(n_layers) * int(n_ctx) * int(d_model) + 2 * int(d_model) * int(vocab)


OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}  # fp32 tensors per parameter
PRECISIONS = ("fp32", "mixed")


def training_flops(n_params: float, n_tokens: float) -> float:
    """Total training FLOPs C = 6 * N * D (forward 2N + backward 4N per token)."""
    if n_params < 0 or n_tokens < 0:
        raise ValueError(f"n_params and n_tokens must be >= 0, got {n_params!r}, {n_tokens!r}")
    return 6.0 * n_params * n_tokens


def training_memory_breakdown(n_params: int, optimizer: str = "adam", precision: str = "mixed") -> dict[str, int]:
    """Bytes for {"weights", "gradients", "optimizer"} when training `n_params` parameters.

    fp32: 4-byte weights and gradients; optimizer state 4 bytes per state tensor
    (OPTIMIZER_STATES). mixed: 2-byte weights and gradients; optimizer holds a 4-byte fp32
    master copy plus the fp32 states (ZeRO, Rajbhandari et al. 2019). Activations excluded.
    """
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


def training_memory_bytes(n_params: int, optimizer: str = "adam", precision: str = "mixed") -> int:
    """Total bytes of weights + gradients + optimizer state (16 * n_params for Adam)."""
    return sum(training_memory_breakdown(n_params, optimizer, precision).values())


def chinchilla_optimal(compute_flops: float, tokens_per_param: float = 20.0) -> tuple[float, float]:
    """(N params, D tokens) with 6*N*D = compute_flops and D = tokens_per_param * N."""
    if compute_flops <= 0 or tokens_per_param <= 0:
        raise ValueError(f"compute_flops and tokens_per_param must be positive, got "
                         f"{compute_flops!r}, {tokens_per_param!r}")
    n = math.sqrt(compute_flops / (6.0 * tokens_per_param))
    return n, tokens_per_param * n


from minitorch.checks import (Attrs, Choice, Count, Number, NonNegative, Optional, Positive, Rule,  # noqa: E402
                              Size, describe, validate_public)


class _Intensity(Rule):
    """Arithmetic intensity: a number >= 0 (inf allowed: no bytes moved), or an ndarray of real dtype
    with no NaN and no value < 0."""

    number = Number(0, finite=False)

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
    "roofline_plot": {"peak_flops": Positive, "bandwidth": Positive, "points": Optional(_Points()),
                      "ax": Optional(Attrs("loglog", "plot", "annotate"))},
    "transformer_params": {**_DIMS, "d_ff": Optional(Count)},
    "transformer_flops_per_token": {**_DIMS, "d_ff": Optional(Count)},
    "training_flops": {"n_params": NonNegative, "n_tokens": NonNegative},
    "training_memory_breakdown": _MEMORY,
    "training_memory_bytes": _MEMORY,
    "chinchilla_optimal": {"compute_flops": Positive, "tokens_per_param": Positive},
})
