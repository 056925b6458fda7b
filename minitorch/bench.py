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
