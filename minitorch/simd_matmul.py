# Generated from solutions/06_simd_threads.py by `make build`. Do not edit.
"""minitorch.simd_matmul: SIMD and multi-threaded matmul with Numba, and minitorch's Numba backend."""
from __future__ import annotations

import platform
import re
from typing import Callable

import numba
import numpy as np
from numba import njit, prange

from minitorch.cpu_matmul import check_matmul_args

from minitorch.tensor import Backend


def isa() -> str:
    """This machine's instruction set family: 'x86_64', 'aarch64', or platform.machine() as is."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return "x86_64"
    if machine in ("aarch64", "arm64"):
        return "aarch64"
    return machine


def asm_of(fn, *arrays) -> str:
    """Assembly Numba generated for the dispatcher `fn` called with `arrays` (compiles if needed)."""
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
        raise ValueError(f"find_packed_fma: no packed-FMA pattern for ISA {arch!r}; known: {sorted(patterns)}")
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
        raise ValueError(f"dot expects two 1-D arrays of equal length, got shapes {x.shape} and {y.shape}")
    dtype = np.result_type(x, y)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dot supports float32 and float64, got {x.dtype} and {y.dtype}")
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
    dtype = check_matmul_args(a, b)
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


def matmul_simd(a: np.ndarray, b: np.ndarray, kernel=None) -> np.ndarray:
    """C = a @ b: packed operands, blocked loops on all Numba threads, SIMD micro-kernel.

    a (m, k), b (k, n): float32/float64, any strides. Returns a new C-contiguous (m, n) array
    of dtype result_type(a, b). kernel: the micro-kernel (default `micro_kernel`).
    """
    ap, bt = pack_operands(a, b)
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
        through self.matmul_2d once per batch element; other dtypes through np.matmul.
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
