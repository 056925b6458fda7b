# Generated from solutions/07_cuda_model.py by `make build`. Do not edit.
from __future__ import annotations

import glob
import os
import shutil

# The simulator must be chosen before numba is first imported (see the lesson's first cell).
if not (glob.glob("/dev/nvidia[0-9]*") or shutil.which("nvidia-smi")):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import re
import sys
import threading
from collections import defaultdict
from typing import Callable

import numpy as np
from numba import config, cuda

from minitorch.checks import check_int

SIMULATED: bool = bool(config.ENABLE_CUDASIM)

if SIMULATED:
    # Numba's simulator allocates a block's shared array when the first thread reaches the
    # `cuda.shared.array` line, with an unlocked check-then-create: two threads arriving at once
    # can get different arrays (seen here as rare wrong results). Same logic, under a lock.
    from numba.core import types as _types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared as _FakeShared
    from numba.np import numpy_support as _np_support

    _SHARED_LOCK = threading.Lock()

    def _locked_shared_array(self, shape, dtype):
        if isinstance(dtype, _types.Type):
            dtype = _np_support.as_dtype(dtype)
        if shape == 0:  # dynamic shared memory: one buffer for all
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with _SHARED_LOCK:
            if key not in self._allocations:
                self._allocations[key] = np.empty(shape, dtype)
            return self._allocations[key]

    _FakeShared.array = _locked_shared_array


def blocks_for(n: int, threads: int) -> int:
    """Blocks needed so that `blocks * threads >= n` (ceil division): a 1-D grid size. n >= 0
    elements, threads >= 1 per block."""
    n = check_int("blocks_for", "n", n, 0)
    threads = check_int("blocks_for", "threads", threads, 1)
    return (n + threads - 1) // threads


def _as_f32(what: str, name: str, x, ndim: int) -> np.ndarray:
    """`x` as a C-contiguous float32 array with `ndim` dimensions, or an error naming `what` and `name`."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"{what}: {name} must be a float32 array (these kernels are written for float32), "
                        f"got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{what}: {name} must be a {ndim}-D array, got shape {x.shape}")
    return np.ascontiguousarray(x)


@cuda.jit
def vector_add_kernel(a, b, out):
    """out[i] = a[i] + b[i] for i < out.shape[0]. 1-D float32 arrays of equal length; 1-D
    launch of at least len(out) threads, one element per thread."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] + b[i]


THREADS_1D = 128


def vector_add(a: np.ndarray, b: np.ndarray, threads: int = THREADS_1D) -> np.ndarray:
    """a + b for 1-D float32 arrays of equal shape, computed by `vector_add_kernel`."""
    a, b = _as_f32("vector_add", "a", a, 1), _as_f32("vector_add", "b", b, 1)
    if a.shape != b.shape:
        raise ValueError(f"vector_add: a and b must have the same shape, got {a.shape} and {b.shape}")
    d_out = cuda.device_array(a.shape, np.float32)
    vector_add_kernel[blocks_for(a.shape[0], threads), threads](cuda.to_device(a), cuda.to_device(b), d_out)
    return d_out.copy_to_host()


@cuda.jit
def bias_relu_kernel(x, bias, out):
    """out[r, c] = max(x[r, c] + bias[c], 0). x, out: (rows, cols) float32; bias: (cols,).
    2-D launch covering (cols, rows) in (x, y); x indexes columns, so warps coalesce."""
    col, row = cuda.grid(2)
    if row < out.shape[0] and col < out.shape[1]:
        v = x[row, col] + bias[col]
        out[row, col] = v if v > 0 else np.float32(0.0)


BLOCK_2D = (32, 4)


def bias_relu(x: np.ndarray, bias: np.ndarray, block: tuple[int, int] = BLOCK_2D) -> np.ndarray:
    """max(x + bias, 0) for x (rows, cols) float32 and bias (cols,) float32."""
    x, bias = _as_f32("bias_relu", "x", x, 2), _as_f32("bias_relu", "bias", bias, 1)
    if bias.shape[0] != x.shape[1]:
        raise ValueError(f"bias_relu: bias must have shape ({x.shape[1]},) for x of shape {x.shape}, got shape {bias.shape}")
    d_out = cuda.device_array(x.shape, np.float32)
    grid = (blocks_for(x.shape[1], block[0]), blocks_for(x.shape[0], block[1]))
    bias_relu_kernel[grid, block](cuda.to_device(x), cuda.to_device(bias), d_out)
    return d_out.copy_to_host()


REDUCE_THREADS = 128


@cuda.jit
def interleaved_block_sum_kernel(x, partial):
    """The naive tree: partial[block] = sum of the block's REDUCE_THREADS elements of x,
    pairing neighbours at distance 1, 2, 4, ... (divergent warps)."""
    s_data = cuda.shared.array(REDUCE_THREADS, np.float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    s_data[tid] = x[i] if i < x.shape[0] else np.float32(0.0)
    cuda.syncthreads()
    s = 1
    while s < REDUCE_THREADS:
        if tid % (2 * s) == 0:
            s_data[tid] += s_data[tid + s]
        cuda.syncthreads()
        s *= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s_data[0]


@cuda.jit
def block_sum_kernel(x, partial):
    """partial[b] = sum of x[b*R : (b+1)*R] (R = REDUCE_THREADS; missing elements count 0).
    x: (n,) float32; partial: (blocks,) float32; launch [blocks, REDUCE_THREADS].
    Tree in shared memory with sequential addressing and a barrier after every step."""
    s_data = cuda.shared.array(REDUCE_THREADS, np.float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    s_data[tid] = x[i] if i < x.shape[0] else np.float32(0.0)
    cuda.syncthreads()
    s = REDUCE_THREADS // 2
    while s > 0:
        if tid < s:
            s_data[tid] += s_data[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s_data[0]


def gpu_sum(x: np.ndarray, kernel: Callable | None = None) -> float:
    """Sum of a 1-D float32 array: block sums, then block sums of those, until one is left.
    kernel: a @cuda.jit kernel with block_sum_kernel's contract (default: block_sum_kernel)."""
    kernel = block_sum_kernel if kernel is None else kernel
    x = _as_f32("gpu_sum", "x", x, 1)
    if x.shape[0] == 0:
        return 0.0
    d, n = cuda.to_device(x), x.shape[0]
    while n > 1:
        blocks = blocks_for(n, REDUCE_THREADS)
        d_partial = cuda.device_array(blocks, np.float32)
        kernel[blocks, REDUCE_THREADS](d, d_partial)
        d, n = d_partial, blocks
    return float(d.copy_to_host()[0])


SCAN_THREADS = 64


@cuda.jit
def block_scan_kernel(x, out, block_sums):
    """Per block of S = SCAN_THREADS elements: out[b*S + t] = x[b*S] + ... + x[b*S + t]
    (inclusive, restarting at each block), block_sums[b] = the block's total.
    x, out: (n,) float32; block_sums: (blocks,) float32; launch [blocks, SCAN_THREADS]."""
    buf = cuda.shared.array(SCAN_THREADS, np.float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    buf[tid] = x[i] if i < x.shape[0] else np.float32(0.0)
    cuda.syncthreads()
    d = 1
    while d < SCAN_THREADS:
        v = buf[tid - d] if tid >= d else np.float32(0.0)
        cuda.syncthreads()  # everyone has read the old values
        buf[tid] += v
        cuda.syncthreads()  # everyone has written the new ones
        d *= 2
    if i < x.shape[0]:
        out[i] = buf[tid]
    if tid == SCAN_THREADS - 1:
        block_sums[cuda.blockIdx.x] = buf[tid]


@cuda.jit
def add_offsets_kernel(out, offsets):
    """out[i] += offsets[i // blockDim.x]: add each block's carry-in. Launch like the scan."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] += offsets[cuda.blockIdx.x]


def gpu_cumsum(x: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of a 1-D float32 array: block scans + carried block totals."""
    x = _as_f32("gpu_cumsum", "x", x, 1)
    n = x.shape[0]
    if n == 0:
        return x.copy()
    blocks = blocks_for(n, SCAN_THREADS)
    d_out = cuda.device_array(n, np.float32)
    d_sums = cuda.device_array(blocks, np.float32)
    block_scan_kernel[blocks, SCAN_THREADS](cuda.to_device(x), d_out, d_sums)
    if blocks > 1:
        sums = d_sums.copy_to_host().astype(np.float64)
        offsets = np.concatenate([[0.0], np.cumsum(sums[:-1])]).astype(np.float32)
        add_offsets_kernel[blocks, SCAN_THREADS](d_out, cuda.to_device(offsets))
    return d_out.copy_to_host()


@cuda.jit
def matmul_naive_kernel(a, b, out):
    """out = a @ b. a: (m, k), b: (k, n), out: (m, n), all float32. 2-D launch covering
    (n, m) in (x, y); one thread per output element, accumulating in a register."""
    col, row = cuda.grid(2)
    if row < out.shape[0] and col < out.shape[1]:
        acc = np.float32(0.0)  # 0.0 would make acc, and every += below, float64
        for k in range(a.shape[1]):
            acc += a[row, k] * b[k, col]
        out[row, col] = acc


MATMUL_BLOCK = (32, 4)


def _check_matmul(what: str, a, b) -> tuple[np.ndarray, np.ndarray]:
    a, b = _as_f32(what, "a", a, 2), _as_f32(what, "b", b, 2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: shape mismatch: a {a.shape} @ b {b.shape}: inner dimensions {a.shape[1]} != {b.shape[0]}")
    return a, b


def matmul_naive(a: np.ndarray, b: np.ndarray, block: tuple[int, int] = MATMUL_BLOCK) -> np.ndarray:
    """a @ b for float32 matrices (m, k) and (k, n), by `matmul_naive_kernel`."""
    a, b = _check_matmul("matmul_naive", a, b)
    m, n = a.shape[0], b.shape[1]
    d_out = cuda.device_array((m, n), np.float32)
    grid = (blocks_for(n, block[0]), blocks_for(m, block[1]))
    matmul_naive_kernel[grid, block](cuda.to_device(a), cuda.to_device(b), d_out)
    return d_out.copy_to_host()


TILE = 8 if SIMULATED else 16


@cuda.jit
def matmul_tiled_kernel(a, b, out):
    """out = a @ b with TILE x TILE shared-memory tiles. a: (m, k), b: (k, n), out: (m, n),
    float32. Launch grid (ceil(n/TILE), ceil(m/TILE)), block (TILE, TILE); block (bx, by)
    computes out[by*TILE : (by+1)*TILE, bx*TILE : (bx+1)*TILE]."""
    a_tile = cuda.shared.array((TILE, TILE), np.float32)
    b_tile = cuda.shared.array((TILE, TILE), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col = cuda.blockIdx.x * TILE + tx
    row = cuda.blockIdx.y * TILE + ty
    m, k_dim = a.shape
    n = b.shape[1]
    acc = np.float32(0.0)
    for t in range((k_dim + TILE - 1) // TILE):
        ka = t * TILE + tx
        a_tile[ty, tx] = a[row, ka] if row < m and ka < k_dim else np.float32(0.0)
        kb = t * TILE + ty
        b_tile[ty, tx] = b[kb, col] if kb < k_dim and col < n else np.float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += a_tile[ty, kk] * b_tile[kk, tx]
        cuda.syncthreads()
    if row < m and col < n:
        out[row, col] = acc


def matmul_tiled(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for float32 matrices (m, k) and (k, n), by `matmul_tiled_kernel`."""
    a, b = _check_matmul("matmul_tiled", a, b)
    m, n = a.shape[0], b.shape[1]
    d_out = cuda.device_array((m, n), np.float32)
    grid = (blocks_for(n, TILE), blocks_for(m, TILE))
    matmul_tiled_kernel[grid, (TILE, TILE)](cuda.to_device(a), cuda.to_device(b), d_out)
    return d_out.copy_to_host()


T_TILE = 32
T_PAD = T_TILE + 1  # the padded row of the shared tile (a constant: see above)
T_ROWS = 8


@cuda.jit
def transpose_kernel(a, out):
    """out = a.T. a: (rows, cols) float32, out: (cols, rows) float32. Launch grid
    (ceil(cols/T_TILE), ceil(rows/T_TILE)), block (T_TILE, T_ROWS); each thread copies
    T_TILE // T_ROWS elements through a padded shared tile."""
    tile = cuda.shared.array((T_TILE, T_PAD), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    rows, cols = a.shape
    col = cuda.blockIdx.x * T_TILE + tx
    row = cuda.blockIdx.y * T_TILE + ty
    for j in range(0, T_TILE, T_ROWS):
        if row + j < rows and col < cols:
            tile[ty + j, tx] = a[row + j, col]
    cuda.syncthreads()
    col = cuda.blockIdx.y * T_TILE + tx  # column of out = row of a
    row = cuda.blockIdx.x * T_TILE + ty  # row of out = column of a
    for j in range(0, T_TILE, T_ROWS):
        if row + j < cols and col < rows:
            out[row + j, col] = tile[tx, ty + j]


def transpose(a: np.ndarray) -> np.ndarray:
    """a.T (a copy) for a 2-D float32 array, by `transpose_kernel`."""
    a = _as_f32("transpose", "a", a, 2)
    rows, cols = a.shape
    d_out = cuda.device_array((cols, rows), np.float32)
    grid = (blocks_for(cols, T_TILE), blocks_for(rows, T_TILE))
    transpose_kernel[grid, (T_TILE, T_ROWS)](cuda.to_device(a), d_out)
    return d_out.copy_to_host()


BSCAN_THREADS = 64
BSCAN_N = 2 * BSCAN_THREADS


@cuda.jit
def blelloch_scan_kernel(x, out, block_sums):
    """Per block of N = BSCAN_N elements (BSCAN_THREADS threads, two elements each):
    out[b*N + i] = x[b*N] + ... + x[b*N + i] (inclusive), block_sums[b] = the block's total.
    Work-efficient: an up-sweep and a down-sweep over a balanced tree in shared memory.
    x, out: (n,) float32; block_sums: (blocks,) float32; launch [blocks, BSCAN_THREADS]."""
    buf = cuda.shared.array(BSCAN_N, np.float32)
    tid = cuda.threadIdx.x
    base = cuda.blockIdx.x * BSCAN_N
    n = x.shape[0]
    i0, i1 = base + tid, base + tid + BSCAN_THREADS
    v0 = x[i0] if i0 < n else np.float32(0.0)
    v1 = x[i1] if i1 < n else np.float32(0.0)
    buf[tid] = v0
    buf[tid + BSCAN_THREADS] = v1
    stride = 1
    while stride < BSCAN_N:  # up-sweep: partial sums up the tree
        cuda.syncthreads()
        j = (tid + 1) * 2 * stride - 1
        if j < BSCAN_N:
            buf[j] += buf[j - stride]
        stride *= 2
    cuda.syncthreads()
    if tid == 0:
        block_sums[cuda.blockIdx.x] = buf[BSCAN_N - 1]
        buf[BSCAN_N - 1] = np.float32(0.0)
    stride = BSCAN_N // 2
    while stride > 0:  # down-sweep: each node passes its prefix left and prefix + left sum right
        cuda.syncthreads()
        j = (tid + 1) * 2 * stride - 1
        if j < BSCAN_N:
            t = buf[j - stride]
            buf[j - stride] = buf[j]
            buf[j] += t
        stride //= 2
    cuda.syncthreads()
    if i0 < n:
        out[i0] = buf[tid] + v0
    if i1 < n:
        out[i1] = buf[tid + BSCAN_THREADS] + v1


def gpu_cumsum_blelloch(x: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of a 1-D float32 array with `blelloch_scan_kernel` per block and
    the carried block totals added by `add_offsets_kernel` (one thread per element)."""
    x = _as_f32("gpu_cumsum_blelloch", "x", x, 1)
    n = x.shape[0]
    if n == 0:
        return x.copy()
    blocks = blocks_for(n, BSCAN_N)
    d_out = cuda.device_array(n, np.float32)
    d_sums = cuda.device_array(blocks, np.float32)
    blelloch_scan_kernel[blocks, BSCAN_THREADS](cuda.to_device(x), d_out, d_sums)
    if blocks > 1:
        sums = d_sums.copy_to_host().astype(np.float64)
        offsets = np.concatenate([[0.0], np.cumsum(sums[:-1])]).astype(np.float32)
        add_offsets_kernel[blocks, BSCAN_N](d_out, cuda.to_device(offsets))
    return d_out.copy_to_host()


COARSEN = 4


@cuda.jit
def coarse_sum_kernel(x, partial):
    """partial[b] = sum of x[b*C*R : (b+1)*C*R] (C = COARSEN, R = REDUCE_THREADS; missing
    elements count 0): each thread adds C elements strided by R in a register, then a
    sequential-addressing tree in shared memory. Launch [ceil(n / (C*R)), REDUCE_THREADS]."""
    s_data = cuda.shared.array(REDUCE_THREADS, np.float32)
    tid = cuda.threadIdx.x
    base = cuda.blockIdx.x * COARSEN * REDUCE_THREADS + tid
    acc = np.float32(0.0)
    for c in range(COARSEN):
        i = base + c * REDUCE_THREADS
        if i < x.shape[0]:
            acc += x[i]
    s_data[tid] = acc
    cuda.syncthreads()
    s = REDUCE_THREADS // 2
    while s > 0:
        if tid < s:
            s_data[tid] += s_data[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s_data[0]


def gpu_sum_coarse(x: np.ndarray) -> float:
    """Sum of a 1-D float32 array with `coarse_sum_kernel`, pass after pass."""
    x = _as_f32("gpu_sum_coarse", "x", x, 1)
    if x.shape[0] == 0:
        return 0.0
    d, n = cuda.to_device(x), x.shape[0]
    while n > 1:
        blocks = blocks_for(n, COARSEN * REDUCE_THREADS)
        d_partial = cuda.device_array(blocks, np.float32)
        coarse_sum_kernel[blocks, REDUCE_THREADS](d, d_partial)
        d, n = d_partial, blocks
    return float(d.copy_to_host()[0])


from minitorch.checks import Instance, Int, Optional, validate_public  # noqa: E402
from minitorch.cuda_trace import _Dims  # noqa: E402

validate_public(globals(), {
    "vector_add": {"threads": Int(1, 1024)},
    "bias_relu": {"block": _Dims(sizes=(2,), max_threads=1024)},
    "gpu_sum": {"kernel": Optional(Instance(type(block_sum_kernel), must="a Numba CUDA kernel (@cuda.jit)"))},
    "matmul_naive": {"block": _Dims(sizes=(2,), max_threads=1024)},
})
