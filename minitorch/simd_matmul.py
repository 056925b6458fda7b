# Generated from solutions/06_simd_threads.py by `make build`. Do not edit.
"""minitorch.simd_matmul: SIMD and multi-threaded matmul with Numba, and minitorch's Numba backend."""
from __future__ import annotations

import platform
import re
import time
from typing import Callable

import numba
import numpy as np
from numba import njit, prange

from minitorch.checks import describe
from minitorch.cpu_matmul import FALLBACK_CACHES, check_matmul_args, machine_cache_sizes

from minitorch.tensor import Backend


def isa() -> str:
    """This machine's instruction set family: 'x86_64', 'aarch64', or platform.machine() as is."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return "x86_64"
    if machine in ("aarch64", "arm64"):
        return "aarch64"
    return machine


def asm_of(fn: Callable, *arrays) -> str:
    """Assembly Numba generated for the dispatcher `fn` (an @njit function) called with `arrays`
    (compiles if needed)."""
    sig = tuple(numba.typeof(x) for x in arrays)
    if sig not in fn.signatures:
        fn.compile(sig)
    return fn.inspect_asm(sig)


def find_packed_fma(asm: str, arch: str | None = None) -> list[str]:
    """The packed (SIMD) fused multiply-add instructions in `asm`, one stripped line each.

    asm: assembly text (AT&T or Intel syntax on x86-64). arch: 'x86_64' or 'aarch64'
    (default: this machine's `isa()`); anything else raises ValueError.
    """
    arch = isa() if arch is None else arch
    patterns = {
        "x86_64": r"\bvf(?:n?m(?:add|sub))(?:132|213|231)p[sd]\b.*\b[yz]mm\d",
        "aarch64": r"\bfml[as]\b.*\b(?:v\d+\.(?:2d|4s|8h)|z\d+\.[dsh])\b",
    }
    if arch not in patterns:
        raise ValueError(f"find_packed_fma: arch must be one of {sorted(patterns)} (the ISAs with a packed-FMA "
                         f"pattern), got {arch!r}")
    pattern = re.compile(patterns[arch])
    return [line.strip() for line in asm.splitlines() if pattern.search(line)]


@njit(fastmath=True, cache=False)
def dot_kernel(x, y):
    """sum_i x[i] * y[i] for 1-D C-contiguous arrays of one float dtype and equal length.

    Returns a scalar of that dtype (accumulated in that dtype, in vector partial sums).
    """
    acc = x.dtype.type(0)
    for i in range(x.shape[0]):
        acc += x[i] * y[i]
    return acc


def dot(x: np.ndarray, y: np.ndarray) -> float:
    """x . y for 1-D float arrays of equal length (validated, made contiguous, common dtype)."""
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim != 1 or y.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"dot: x and y must be 1-D arrays of equal length, got shapes {x.shape} and {y.shape}")
    dtype = np.result_type(x, y)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dot: x and y must be float32 or float64 arrays, got dtypes {x.dtype} and {y.dtype}")
    return dot_kernel(np.ascontiguousarray(x, dtype=dtype), np.ascontiguousarray(y, dtype=dtype))


MR, NR = 4, 3  # the micro-kernel's block of C: MR rows x NR columns


@njit(fastmath=True, cache=False)
def micro_kernel_reference(a, bt, c, i0, j0, p0, p1):
    """Plain-loop version of `micro_kernel` (same contract, no register blocking): a reference."""
    for i in range(MR):
        for j in range(NR):
            acc = c.dtype.type(0)
            for p in range(p0, p1):
                acc += a[i0 + i, p] * bt[j0 + j, p]
            c[i0 + i, j0 + j] += acc


@njit(fastmath=True, cache=False)
def micro_kernel(a, bt, c, i0, j0, p0, p1):
    """c[i0:i0+MR, j0:j0+NR] += a[i0:i0+MR, p0:p1] @ bt[j0:j0+NR, p0:p1].T, with MR=4, NR=3.

    a (M, K) and bt (N, K): C-contiguous, one float dtype (bt is B transposed, so a column of B
    is a contiguous row of bt); c (M, N) of the same dtype. Requires i0 + 4 <= M, j0 + 3 <= N,
    0 <= p0 <= p1 <= K. The 4 x 3 block is kept in 12 scalar accumulators of c's dtype.
    """
    zero = c.dtype.type(0)
    c00 = c01 = c02 = c10 = c11 = c12 = c20 = c21 = c22 = c30 = c31 = c32 = zero
    a0, a1, a2, a3 = a[i0, p0:p1], a[i0 + 1, p0:p1], a[i0 + 2, p0:p1], a[i0 + 3, p0:p1]
    b0, b1, b2 = bt[j0, p0:p1], bt[j0 + 1, p0:p1], bt[j0 + 2, p0:p1]
    for p in range(p1 - p0):
        x0, x1, x2, x3 = a0[p], a1[p], a2[p], a3[p]
        y0, y1, y2 = b0[p], b1[p], b2[p]
        c00 += x0 * y0
        c01 += x0 * y1
        c02 += x0 * y2
        c10 += x1 * y0
        c11 += x1 * y1
        c12 += x1 * y2
        c20 += x2 * y0
        c21 += x2 * y1
        c22 += x2 * y2
        c30 += x3 * y0
        c31 += x3 * y1
        c32 += x3 * y2
    c[i0, j0] += c00
    c[i0, j0 + 1] += c01
    c[i0, j0 + 2] += c02
    c[i0 + 1, j0] += c10
    c[i0 + 1, j0 + 1] += c11
    c[i0 + 1, j0 + 2] += c12
    c[i0 + 2, j0] += c20
    c[i0 + 2, j0 + 1] += c21
    c[i0 + 2, j0 + 2] += c22
    c[i0 + 3, j0] += c30
    c[i0 + 3, j0 + 1] += c31
    c[i0 + 3, j0 + 2] += c32


@njit(parallel=True, cache=False)
def transpose_into(src, dst):
    """dst[j, p] = src[p, j] for src (K, N) of any strides; dst (>= N, K) C-contiguous.

    Copies 32 x 32 tiles, so that both the reads and the writes stay within a few cache lines;
    tile columns are shared among the threads.
    """
    k, n = src.shape
    for jb in prange((n + 31) // 32):
        j1 = min(jb * 32 + 32, n)
        for p0 in range(0, k, 32):
            p1 = min(p0 + 32, k)
            for j in range(jb * 32, j1):
                for p in range(p0, p1):
                    dst[j, p] = src[p, j]


def pack_operands(a: np.ndarray, b: np.ndarray, mr: int = MR, nr: int = NR) -> tuple[np.ndarray, np.ndarray]:
    """Packed copies for the micro-kernel: (ap, bt).

    a (m, k), b (k, n): float32/float64 arrays, any strides (validated by lesson 05's
    check_matmul_args). ap: (ceil(m/mr)*mr, k) C-contiguous a (a itself when it already is one
    and m % mr == 0); bt: (ceil(n/nr)*nr, k) C-contiguous copy of b.T; both in the result
    dtype, extra rows zero.
    """
    return _pack(a, b, check_matmul_args(a, b, "pack_operands"), mr, nr)


def _pack(a: np.ndarray, b: np.ndarray, dtype: np.dtype, mr: int, nr: int) -> tuple[np.ndarray, np.ndarray]:
    """pack_operands for checked operands: their result dtype is `dtype`."""
    m, k = a.shape
    n = b.shape[1]
    if m % mr == 0:
        ap = np.ascontiguousarray(a, dtype=dtype)
    else:
        ap = np.zeros((-(-m // mr) * mr, k), dtype=dtype)
        ap[:m] = a
    bt = np.empty((-(-n // nr) * nr, k), dtype=dtype)
    bt[n:] = 0
    if b.dtype != dtype:
        b = b.astype(dtype)
    if n and k:
        transpose_into(b, bt)
    return ap, bt


MC, KC, NC = 32, 1024, 48  # rows of A per thread task, k per block, columns of C per block (NC % NR == 0)


@njit(parallel=True, fastmath=True, cache=False)
def gemm_parallel(ap, bt, c, kernel):
    """c += ap @ bt.T, block by block, with the row-panel loop run on all threads.

    ap (M, K), bt (N, K), c (M, N): C-contiguous, one float dtype, M % MR == 0 and N % NR == 0.
    kernel(ap, bt, c, i0, j0, p0, p1) adds the MR x NR block at (i0, j0) over k in [p0, p1).
    """
    m, k = ap.shape
    n = bt.shape[0]
    for ic in prange((m + MC - 1) // MC):
        i_start = ic * MC
        i_end = min(i_start + MC, m)
        for jc in range(0, n, NC):
            j_end = min(jc + NC, n)
            for pc in range(0, k, KC):
                p_end = min(pc + KC, k)
                for i0 in range(i_start, i_end, MR):
                    for j0 in range(jc, j_end, NR):
                        kernel(ap, bt, c, i0, j0, pc, p_end)


def matmul_simd(a: np.ndarray, b: np.ndarray, kernel: Callable | None = None) -> np.ndarray:
    """C = a @ b: packed operands, blocked loops on all Numba threads, SIMD micro-kernel.

    a (m, k), b (k, n): float32/float64, any strides. Returns a new C-contiguous (m, n) array
    of dtype result_type(a, b). kernel: the micro-kernel, an @njit function with micro_kernel's
    signature (default `micro_kernel`).
    """
    ap, bt = _pack(a, b, check_matmul_args(a, b, "matmul_simd"), MR, NR)
    m, n = a.shape[0], b.shape[1]
    c = np.zeros((ap.shape[0], bt.shape[0]), dtype=ap.dtype)
    gemm_parallel(ap, bt, c, micro_kernel if kernel is None else kernel)
    return c if c.shape == (m, n) else np.ascontiguousarray(c[:m, :n])


FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float64))


class NumbaBackend(Backend):
    """minitorch Backend for device 'cpu' whose matmul runs `matmul_simd` (this lesson's kernel).

    Everything else (elementwise ops, reductions) is NumPy's. matmul_2d: the 2-D matmul to use,
    (m, k), (k, n) -> (m, n); default `matmul_simd`.
    """

    def __init__(self, matmul_2d: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None):
        super().__init__("numba", np)
        self.matmul_2d = matmul_simd if matmul_2d is None else matmul_2d

    def __repr__(self) -> str:
        return f"NumbaBackend(matmul_2d={getattr(self.matmul_2d, '__name__', self.matmul_2d)})"

    def matmul(self, a, b) -> np.ndarray:
        """NumPy matmul semantics: (..., m, k) @ (..., k, n) -> (..., m, n), batch dims broadcast;
        1-D operands promoted and the promoted dimension removed. Float32/float64 operands go
        through self.matmul_2d once per batch element; other dtypes (integers, bool, float16)
        through np.matmul.
        """
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype not in FLOAT_TYPES or b.dtype not in FLOAT_TYPES:
            return np.matmul(a, b)
        if a.ndim == 0 or b.ndim == 0:
            raise ValueError(f"matmul: operands must have at least 1 dimension, got shapes {a.shape} and {b.shape}")
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        if a2.shape[-1] != b2.shape[-2]:
            raise ValueError(f"matmul shape mismatch: {a.shape} @ {b.shape}: inner dimensions "
                             f"{a2.shape[-1]} and {b2.shape[-2]} differ")
        try:
            batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
        except ValueError:
            raise ValueError(f"matmul: batch dimensions of {a.shape} and {b.shape} do not broadcast") from None
        m, n = a2.shape[-2], b2.shape[-1]
        a3 = np.broadcast_to(a2, batch + a2.shape[-2:])
        b3 = np.broadcast_to(b2, batch + b2.shape[-2:])
        out = np.empty(batch + (m, n), dtype=np.result_type(a, b))
        for idx in np.ndindex(*batch):
            out[idx] = self.matmul_2d(a3[idx], b3[idx])
        if a.ndim == 1:
            out = out[..., 0, :]
        if b.ndim == 1:
            out = out[..., 0]
        return out


from minitorch.simd import vfma_bcast, vload_f32, vstore_add_f32, vzero_f32  # noqa: E402


@njit(cache=False, inline="always")
def blis_kernel(ap, bp, c, co, ldc):
    """c[co + r*ldc + j] += sum_k ap[6k + r] * bp[16k + j] for r < 6, j < 16, k < bp.size // 16.

    ap (6 kc,), bp (16 kc,), c (any,): 1-D C-contiguous float32; six f32x16 accumulators.
    """
    c0, c1, c2 = vzero_f32(), vzero_f32(), vzero_f32()
    c3, c4, c5 = vzero_f32(), vzero_f32(), vzero_f32()
    for k in range(bp.size // 16):
        b = vload_f32(bp, 16 * k)
        a = 6 * k
        c0 = vfma_bcast(c0, b, ap[a])
        c1 = vfma_bcast(c1, b, ap[a + 1])
        c2 = vfma_bcast(c2, b, ap[a + 2])
        c3 = vfma_bcast(c3, b, ap[a + 3])
        c4 = vfma_bcast(c4, b, ap[a + 4])
        c5 = vfma_bcast(c5, b, ap[a + 5])
    vstore_add_f32(c0, c, co)
    vstore_add_f32(c1, c, co + ldc)
    vstore_add_f32(c2, c, co + 2 * ldc)
    vstore_add_f32(c3, c, co + 3 * ldc)
    vstore_add_f32(c4, c, co + 4 * ldc)
    vstore_add_f32(c5, c, co + 5 * ldc)


BLIS_MR, BLIS_NR = 6, 16  # the kernel's block of C: rows, and float32 lanes of one f32x16


def blis_blocking(l2_bytes: int, mc: int = 48, itemsize: int = 4) -> tuple[int, int]:
    """(MC, KC): MC rows of A per thread task (a multiple of 6) and the longest KC (a power of two,
    64..1024) for which the A block and one B panel, (MC + 16) x KC items, fill at most half of an
    L2 cache of `l2_bytes`."""
    for name, v in (("l2_bytes", l2_bytes), ("mc", mc)):  # a float is a number, but no size: a ValueError
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"blis_blocking: {name} must be a positive integer, got {describe(v)}")
    if not isinstance(l2_bytes, (int, np.integer)) or l2_bytes <= 0:
        raise ValueError(f"blis_blocking: need l2_bytes a positive integer, got l2_bytes={l2_bytes!r}")
    if not isinstance(mc, (int, np.integer)) or mc <= 0 or mc % BLIS_MR:
        raise ValueError(f"blis_blocking: need mc a positive multiple of {BLIS_MR}, got mc={mc!r}")
    kc = 1024
    while kc > 64 and (mc + BLIS_NR) * kc * itemsize > l2_bytes // 2:
        kc //= 2
    return mc, kc


BLIS_MC, BLIS_KC = blis_blocking(machine_cache_sizes().get("L2", FALLBACK_CACHES["L2"]))


@njit(cache=False)
def pack_a_block(a, i0, mc, pc, kc, ap):
    """Rows i0..i0+mc of a (M, K), columns pc..pc+kc, as 6-row panels, k-major, into ap (float32):
    ap[(ir * kc + k) * 6 + r] = a[i0 + 6 ir + r, pc + k]; rows past M are zeros."""
    m = a.shape[0]
    for ir in range((mc + BLIS_MR - 1) // BLIS_MR):
        base = ir * kc * BLIS_MR
        for r in range(BLIS_MR):
            i = i0 + ir * BLIS_MR + r
            for k in range(kc):
                ap[base + k * BLIS_MR + r] = a[i, pc + k] if i < m else np.float32(0)


@njit(parallel=True, cache=False)
def pack_b_block(b, pc, kc, bp):
    """Rows pc..pc+kc of b (K, N) as 16-column panels, k-major, on all threads:
    bp[(jp * kc + k) * 16 + j] = b[pc + k, 16 jp + j]; columns past N are zeros."""
    n = b.shape[1]
    for jp in prange((n + BLIS_NR - 1) // BLIS_NR):
        base = jp * kc * BLIS_NR
        for k in range(kc):
            for j in range(BLIS_NR):
                col = jp * BLIS_NR + j
                bp[base + k * BLIS_NR + j] = b[pc + k, col] if col < n else np.float32(0)


@njit(cache=False)
def macro_kernel(ap, bp, cf, i0, mc, kc, ldc):
    """One thread's work for one A block: every 16-column panel of bp against every 6-row panel of ap.

    ap (6 ceil(mc/6) kc,) float32: pack_a_block's panels of rows i0..i0+mc; bp (N' kc,) float32:
    pack_b_block's panels; cf: C (M', N') flattened, float32, ldc = N'.
    """
    for jp in range(bp.size // (kc * BLIS_NR)):
        bo = jp * kc * BLIS_NR
        for ir in range((mc + BLIS_MR - 1) // BLIS_MR):
            ao = ir * kc * BLIS_MR
            blis_kernel(ap[ao:ao + kc * BLIS_MR], bp[bo:bo + kc * BLIS_NR], cf, (i0 + ir * BLIS_MR) * ldc + jp * BLIS_NR,
                        ldc)


@njit(parallel=True, cache=False)
def gemm_blis(a, b, c, mc, kc):
    """c += a @ b. a (M, K), b (K, N) float32, any strides; c (M', N') float32 C-contiguous with
    M' >= 6 ceil(M/6) and N' = 16 ceil(N/16) (the padding gets zeros). mc: rows of A per thread
    task, a positive multiple of 6; kc: k per block, >= 1."""
    m, k = a.shape
    ldc = c.shape[1]
    if mc <= 0 or mc % BLIS_MR or kc <= 0:
        raise ValueError("gemm_blis: mc must be a positive multiple of 6 and kc positive")
    if b.shape[0] != k or c.shape[0] < -(-m // BLIS_MR) * BLIS_MR or ldc != -(-b.shape[1] // BLIS_NR) * BLIS_NR:
        raise ValueError("gemm_blis: need a (M, K), b (K, N) and c (M', N') with M' >= 6 ceil(M/6), N' = 16 ceil(N/16)")
    cf = c.reshape(-1)
    bp = np.empty(ldc * min(kc, k), np.float32)
    for pc in range(0, k, kc):
        kcur = min(kc, k - pc)
        pack_b_block(b, pc, kcur, bp[:ldc * kcur])
        for ic in prange((m + mc - 1) // mc):
            i0 = ic * mc
            mcur = min(mc, m - i0)
            ap = np.empty(((mcur + BLIS_MR - 1) // BLIS_MR) * BLIS_MR * kcur, np.float32)
            pack_a_block(a, i0, mcur, pc, kcur, ap)
            macro_kernel(ap, bp[:ldc * kcur], cf, i0, mcur, kcur, ldc)


def matmul_blis(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C = a @ b for float32 a (m, k) and b (k, n), any strides: packed panels, Goto's loops on all
    Numba threads, the 6 x 16 outer-product kernel. Returns a new C-contiguous (m, n) float32 array."""
    dtype = check_matmul_args(a, b, "matmul_blis")
    if dtype != np.float32:
        raise TypeError(f"matmul_blis: a and b must be float32 (its kernel is f32x16), got {a.dtype} and "
                        f"{b.dtype}; for float64 use matmul_simd")
    m, n = a.shape[0], b.shape[1]
    c = np.zeros((-(-m // BLIS_MR) * BLIS_MR, -(-n // BLIS_NR) * BLIS_NR), np.float32)
    if m and n and a.shape[1]:
        # once from Python on a small block: a kernel's error (an unfinished exercise, an index outside
        # its panels) shows here as itself; raised inside gemm_blis's threads it would be a SystemError
        blis_kernel(np.zeros(2 * BLIS_MR, np.float32), np.zeros(2 * BLIS_NR, np.float32),
                    np.zeros(BLIS_MR * BLIS_NR, np.float32), 0, BLIS_NR)
        gemm_blis(a, b, c, BLIS_MC, BLIS_KC)
    return c if c.shape == (m, n) else np.ascontiguousarray(c[:m, :n])


POOL_PAUSE = 0.3  # seconds: OpenBLAS's threads spin for about 0.1 s after a call, OpenMP's a few ms


def best_apart(kernels: dict[str, Callable], *args, rounds: int = 3, repeat: int = 3, pause: float = POOL_PAUSE) -> dict:
    """{name: best seconds per call of fn(*args)} for kernels {name: fn}, taking turns for `rounds`
    rounds. Each turn sleeps `pause` seconds and makes one untimed call first: two thread pools
    (Numba's OpenMP threads, OpenBLAS's) share the cores, and a pool's threads keep spinning after
    its call returns, taking the next kernel's cores if it starts at once."""
    for name, fn in kernels.items():
        if not callable(fn):
            raise TypeError(f"best_apart: kernels must map names to callables, got kernels[{name!r}] = {describe(fn)}")
    best = {name: float("inf") for name in kernels}
    for _ in range(rounds):
        for name, fn in kernels.items():
            time.sleep(pause)
            fn(*args)
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn(*args)
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


@njit(cache=False)
def blis_kernel_calls(ap, bp, c, calls):
    """blis_kernel(ap, bp, c, 0, 16) `calls` times: one 6 x 16 block, its panels in L1."""
    for _ in range(calls):
        blis_kernel(ap, bp, c, 0, 16)


@njit(parallel=True, cache=False)
def run_everywhere(calls_fn, ap, bp, c, calls):
    """Thread t runs calls_fn(ap[t], bp[t], c[t], calls): each thread its own L1-resident operands."""
    for t in prange(c.shape[0]):
        calls_fn(ap[t], bp[t], c[t], calls)


def peak_rate(calls_fn: Callable, ap: np.ndarray, bp: np.ndarray, c: np.ndarray, calls: int,
              work_per_call: float) -> float:
    """Work per second (e.g. FLOP/s) of `run_everywhere(calls_fn, ...)` on ap.shape[0] Numba threads at
    once, work_per_call counted per kernel call and thread: the best of 5 timed runs after a warm-up.
    calls_fn(ap[t], bp[t], c[t], calls): an @njit function; ap, bp, c: one row per thread."""
    from minitorch.bench import benchmark

    threads_used = ap.shape[0]
    if not 1 <= threads_used <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"peak_rate: ap must have one row per thread, 1 to {numba.config.NUMBA_NUM_THREADS}, "
                         f"got shape {ap.shape}")
    if bp.shape[0] != threads_used or c.shape[0] != threads_used:
        raise ValueError(f"peak_rate: ap, bp and c must have one row per thread each, got shapes {ap.shape}, "
                         f"{bp.shape} and {c.shape}")
    before = numba.get_num_threads()
    numba.set_num_threads(threads_used)
    try:
        t = benchmark(run_everywhere, calls_fn, ap, bp, c, calls, warmup=1, repeat=5).min
    finally:
        numba.set_num_threads(before)
    return work_per_call * calls * threads_used / t


def blis_peak(threads_used: int, kc: int = 256, calls: int = 3000, seed: int = 0) -> float:
    """GFLOP/s of blis_kernel with its panels (kc long) in L1, on `threads_used` threads at once: the
    peak no matmul built on it can beat. threads_used: 1 to numba.config.NUMBA_NUM_THREADS."""
    rng_ = np.random.default_rng(seed)
    ap = rng_.standard_normal((threads_used, 6 * kc)).astype(np.float32)
    bp = rng_.standard_normal((threads_used, 16 * kc)).astype(np.float32)
    c = np.zeros((threads_used, 6 * 16 * 4), np.float32)  # rows 1.5 KiB apart: no false sharing
    return peak_rate(blis_kernel_calls, ap, bp, c, calls, 2 * 6 * 16 * kc) / 1e9


from numba.core.dispatcher import Dispatcher as _Dispatcher  # noqa: E402

from minitorch.checks import (Array, Choice, Count, Instance, Int, NonNegative, Optional, Positive, Size,  # noqa: E402
                              Unchecked, validate_public)

_NJIT = Instance(_Dispatcher, must="a Numba-compiled function (@njit)")

validate_public(globals(), {
    "asm_of": {"fn": _NJIT},
    "find_packed_fma": {"arch": Optional(Choice("x86_64", "aarch64"))},
    "dot": {"x": Array(ndim=1), "y": Array(ndim=1)},
    "pack_operands": {"mr": Size, "nr": Size},
    "matmul_simd": {"kernel": Optional(_NJIT)},
    "NumbaBackend.matmul": {"a": Array(dtypes="number"), "b": Array(dtypes="number")},  # what np.matmul takes
    "blis_blocking": {"l2_bytes": Unchecked(), "mc": Unchecked(),  # checked in its body: a float is a ValueError
                      "itemsize": Size},
    "best_apart": {"kernels": Instance(dict, must="a dict {name: callable}"), "rounds": Size, "repeat": Size,
                   "pause": NonNegative},
    "peak_rate": {"calls_fn": _NJIT, "ap": Array(ndim=2), "bp": Array(ndim=2), "c": Array(ndim=2), "calls": Size,
                  "work_per_call": Positive},
    "blis_peak": {"threads_used": Int(1, numba.config.NUMBA_NUM_THREADS), "kc": Size, "calls": Size, "seed": Count},
})
