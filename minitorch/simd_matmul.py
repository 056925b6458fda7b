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


def blis_kernel_source(mr: int, nv: int) -> str:
    """Python source of `def blis_kernel_{mr}x{nv}(ap, bp, c, co, ldc):`, the MR x (16 NV) outer-product
    micro-kernel: c[co + r*ldc + j] += sum_k ap[mr*k + r] * bp[16*nv*k + j] for r < mr, j < 16 nv,
    k < bp.size // (16 nv), with mr * nv f32x16 accumulators (minitorch.simd's operations)."""
    nr = 16 * nv
    lines = [f"def blis_kernel_{mr}x{nv}(ap, bp, c, co, ldc):"]
    lines += [f"    c{r}_{v} = vzero_f32()" for r in range(mr) for v in range(nv)]
    lines.append(f"    for k in range(bp.size // {nr}):")
    lines += [f"        b{v} = vload_f32(bp, {nr} * k + {16 * v})" for v in range(nv)]
    for r in range(mr):
        lines.append(f"        a = ap[{mr} * k + {r}]")
        lines += [f"        c{r}_{v} = vfma_bcast(c{r}_{v}, b{v}, a)" for v in range(nv)]
    lines += [f"    vstore_add_f32(c{r}_{v}, c, co + {r} * ldc + {16 * v})" for r in range(mr) for v in range(nv)]
    return "\n".join(lines) + "\n"


_KERNELS: dict[str, Callable] = {}  # source text -> compiled kernel


def make_blis_kernel(mr: int, nv: int) -> Callable:
    """The micro-kernel `blis_kernel_source(mr, nv)` describes, compiled by Numba (inline="always"), with
    minitorch.simd's operations in its namespace. Compiled once per source text (an edited generator gives
    a new kernel); a ValueError if the source does not define exactly one function."""
    import linecache

    source = blis_kernel_source(mr, nv)
    if not isinstance(source, str):
        raise TypeError(f"make_blis_kernel: blis_kernel_source({mr}, {nv}) must return a str, got {describe(source)}")
    if source not in _KERNELS:
        filename = f"<blis_kernel_source({mr}, {nv})>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show it
        namespace = {"vzero_f32": vzero_f32, "vload_f32": vload_f32, "vfma_bcast": vfma_bcast,
                     "vstore_add_f32": vstore_add_f32, "np": np}
        exec(compile(source, filename, "exec"), namespace)
        fns = [v for v in namespace.values() if getattr(getattr(v, "__code__", None), "co_filename", "") == filename]
        if len(fns) != 1:
            raise ValueError(f"make_blis_kernel: blis_kernel_source({mr}, {nv}) must define exactly one function, "
                             f"it defines {len(fns)}")
        _KERNELS[source] = njit(cache=False, inline="always")(fns[0])
    return _KERNELS[source]


def blis_shape(registers: int, per_vector: int, broadcast_registers: int, in_flight: int) -> tuple[int, int]:
    """(MR, NV) of the micro-kernel: the shape with the most accumulators MR*NV among those that keep
    in_flight FMAs going, fit the registers and need no more loads than FMAs (see the lesson); ties to
    fewer loads per k (MR + NV*per_vector), then to the smaller NV. ValueError if there is none."""
    best = None
    for nv in range(1, registers // per_vector + 1):
        mr = (registers - broadcast_registers - nv * per_vector) // (nv * per_vector)
        if mr < 1:
            continue
        fmas = mr * nv * per_vector
        if fmas < in_flight or mr + nv * per_vector > fmas:
            continue
        key = (-mr * nv, mr + nv * per_vector, nv)
        if best is None or key < best[0]:
            best = (key, (mr, nv))
    if best is None:
        raise ValueError(f"blis_shape: no shape keeps {in_flight} FMAs in flight in {registers} registers of "
                         f"{per_vector} per f32x16 with {broadcast_registers} for broadcasts, and no more loads "
                         f"than FMAs")
    return best[1]


BLIS_LANES = 16  # float32 lanes of one f32x16: NR = 16 NV
# FMA latency x pipes, per ISA, from the vendors' manuals (lesson 04's FMA loop measures this machine's):
# AVX-512 Skylake-SP..Sapphire Rapids 4 x 2; AVX2 Haswell 5 x 2; NEON Apple M1 4 x 4.
IN_FLIGHT = {"avx512": 8, "avx2": 10, "avx": 10, "sse": 8, "neon": 16}


def machine_shape() -> tuple[int, int]:
    """(MR, NV) of this machine's kernel: blis_shape of its vector registers (vector_target()) and its
    ISA's FMA latency x pipes (IN_FLIGHT)."""
    from minitorch.simd import vector_target

    t = vector_target()
    key = (blis_shape, t["registers"], t["per_vector"], t["broadcast_registers"], IN_FLIGHT[t["isa"]])
    if key not in _SHAPES:  # once per blis_shape function (a redefined one is asked again)
        _SHAPES[key] = blis_shape(*key[1:])
    return _SHAPES[key]


_SHAPES: dict[tuple, tuple[int, int]] = {}


def even_block(total: int, most: int, multiple: int = 1) -> int:
    """The block size that splits `total` items into the fewest blocks of at most `most` (a multiple of
    `multiple`), as even as blocks of a multiple of `multiple` allow: even_block(1024, 432) = 342
    (three blocks: 342, 342, 340), even_block(1000, 576, 32) = 512 (512 and 488)."""
    if most % multiple:
        raise ValueError(f"even_block: need most a multiple of multiple, got most={most}, multiple={multiple}")
    parts = -(-total // most)
    return min(most, -(-(-(-total // parts)) // multiple) * multiple)


def blis_blocking(l1_bytes: int, l2_bytes: int, mr: int, nr: int, itemsize: int = 4) -> tuple[int, int, int]:
    """(MC, KC, NC) for an MR x NR kernel: KC the longest multiple of 16 (16..1024) for which an A
    micro-panel, MR x KC items, fills at most half of an L1 of `l1_bytes`; NC the largest multiple of NR
    (at least NR) for which a B block, KC x NC items, fills at most half of an L2 of `l2_bytes`; MC the
    largest multiple of MR (at least MR) for which an A block, MC x KC items, fits in that L2."""
    for name, v in (("l1_bytes", l1_bytes), ("l2_bytes", l2_bytes)):  # a float is a number, but no size
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"blis_blocking: {name} must be a positive integer, got {describe(v)}")
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"blis_blocking: need {name} a positive integer, got {name}={v!r}")
    kc = max(16, min(1024, (l1_bytes // 2) // (mr * itemsize)) // 16 * 16)
    nc = max(nr, (l2_bytes // 2) // (kc * itemsize) // nr * nr)
    mc = max(mr, l2_bytes // (kc * itemsize) // mr * mr)
    return int(mc), int(kc), int(nc)


def machine_blocking(mr: int, nr: int) -> tuple[int, int, int]:
    """blis_blocking for this machine's L1 and L2 (lesson 05's machine_cache_sizes, read once)."""
    if not _CACHES:
        _CACHES.update(machine_cache_sizes())
    return blis_blocking(_CACHES.get("L1d", FALLBACK_CACHES["L1d"]), _CACHES.get("L2", FALLBACK_CACHES["L2"]), mr, nr)


_CACHES: dict[str, int] = {}


def block_rows(m: int, mr: int, mc_max: int, threads: int) -> int:
    """Rows per block of A: M split into a multiple of `threads` blocks of at most `mc_max` rows, as even
    as whole MR-row micro-panels allow (so that each thread gets as many)."""
    panels = -(-m // mr)
    blocks = max(threads, -(-panels * mr // mc_max))
    blocks = -(-blocks // threads) * threads
    return max(1, -(-panels // blocks)) * mr


CACHE_LINE = 64  # bytes: the L1 line of x86-64 and most Arm cores (Apple M-series: 128, where a 64-byte load from a 64-aligned address still stays in one line)


@njit(cache=False)
def aligned_empty(size, dtype):
    """np.empty(size, dtype), 1-D, whose first item starts a cache line (CACHE_LINE bytes). NumPy aligns its
    arrays to 16 bytes and Numba to 32: an f32x16 load (64 bytes) from such an array straddles two lines
    at every other offset or every one, and a load that straddles costs the cache two accesses."""
    raw = np.empty(size + CACHE_LINE, dtype)
    skip = (-raw.ctypes.data) % CACHE_LINE // raw.itemsize
    return raw[skip:skip + size]


@njit(cache=False)
def pack_a_block(a, i0, mc, pc, kc, ap, mr):
    """Rows i0..i0+mc of a (M, K), columns pc..pc+kc, as mr-row panels, k-major, into ap (float32):
    ap[(ir * kc + k) * mr + r] = a[i0 + mr ir + r, pc + k]; rows past M are zeros."""
    m = a.shape[0]
    for ir in range((mc + mr - 1) // mr):
        base = ir * kc * mr
        for r in range(mr):
            i = i0 + ir * mr + r
            if i < m:
                row = a[i, pc:pc + kc]
                for k in range(kc):
                    ap[base + k * mr + r] = row[k]
            else:
                for k in range(kc):
                    ap[base + k * mr + r] = np.float32(0)


@njit(parallel=True, cache=False)
def pack_b_block(b, pc, kc, jc, nc, bp, nr):
    """Rows pc..pc+kc, columns jc..jc+nc of b (K, N) as nr-column panels, k-major, on all threads:
    bp[(jp * kc + k) * nr + j] = b[pc + k, jc + nr jp + j]; columns past N are zeros."""
    n = b.shape[1]
    for jp in prange((nc + nr - 1) // nr):
        base = jp * kc * nr
        j0 = jc + jp * nr
        if j0 + nr <= n:
            for k in range(kc):
                row = b[pc + k, j0:j0 + nr]
                dst = bp[base + k * nr:base + k * nr + nr]
                for j in range(nr):
                    dst[j] = row[j]
        else:
            for k in range(kc):
                for j in range(nr):
                    bp[base + k * nr + j] = b[pc + k, j0 + j] if j0 + j < n else np.float32(0)


@njit(cache=False)
def macro_kernel(kernel, ap, bp, c, i0, mc, j0, nc, kc, mr, nr, edge, fresh=False):
    """One thread's work for one A block and one B block: every A micro-panel of ap (held in L1) against
    every B micro-panel of bp (from L2). ap: pack_a_block's panels of rows i0..i0+mc; bp: pack_b_block's
    panels of columns j0..j0+nc; c (M, N) C-contiguous, of the kernel's dtype; edge: a buffer of mr * nr
    of that dtype for the blocks that cross C's edges. fresh: C's old values are not read: each block is
    zeroed just before the kernel adds into it (its lines come into L1 for the kernel then anyway; a
    separate pass over C, np.zeros, would read and write all of it once more)."""
    m, n = c.shape
    cf = c.reshape(-1)
    for ir in range((mc + mr - 1) // mr):
        ao, r0 = ir * kc * mr, i0 + ir * mr
        for jr in range((nc + nr - 1) // nr):
            bo, c0 = jr * kc * nr, j0 + jr * nr
            if r0 + mr <= m and c0 + nr <= n:
                if fresh:
                    for r in range(mr):
                        cf[(r0 + r) * n + c0:(r0 + r) * n + c0 + nr] = 0
                kernel(ap[ao:ao + kc * mr], bp[bo:bo + kc * nr], cf, r0 * n + c0, n)
            else:
                edge[:] = 0
                kernel(ap[ao:ao + kc * mr], bp[bo:bo + kc * nr], edge, 0, nr)
                for r in range(min(mr, m - r0)):
                    for j in range(min(nr, n - c0)):
                        if fresh:
                            c[r0 + r, c0 + j] = edge[r * nr + j]
                        else:
                            c[r0 + r, c0 + j] += edge[r * nr + j]


@njit(parallel=True, cache=False)
def gemm_blis(a, b, c, kernel, mr, nr, mc, kc, nc, accumulate=True, b_offset=0):
    """c += a @ b with an mr x nr micro-kernel (an @njit function with blis_kernel's signature); with
    accumulate=False, c = a @ b without reading c's old values (c may come from np.empty: the first block
    of k writes it, macro_kernel's `fresh`). a (M, K), b (K, N) float32, any strides; c (M, N) float32
    C-contiguous. mc: rows of A per thread task, a positive multiple of mr; kc: k per block, >= 1; nc:
    columns of B per block, a positive multiple of nr. A is packed once per kc (each task its rows), B
    once per (kc, nc) block (all threads), into a buffer that starts a cache line, or b_offset >= 0 items
    past one (for measuring what loads across two lines cost)."""
    m, k = a.shape
    n = b.shape[1]
    if mr <= 0 or nr <= 0 or nr % 16 or mc <= 0 or mc % mr or kc <= 0 or nc <= 0 or nc % nr or b_offset < 0:
        raise ValueError("gemm_blis: need mr >= 1, nr a positive multiple of 16, mc and nc positive multiples of "
                         "mr and nr, kc >= 1 and b_offset >= 0")
    if b.shape[0] != k or c.shape[0] != m or c.shape[1] != n:
        raise ValueError("gemm_blis: need a (M, K), b (K, N) and c (M, N)")
    tasks = (m + mc - 1) // mc
    ap = np.empty((tasks, ((min(mc, m) + mr - 1) // mr) * mr * min(kc, k)), np.float32)  # A[:, pc:pc+kc], packed
    bp_size = min(nc, (n + nr - 1) // nr * nr) * min(kc, k)
    bp = aligned_empty(b_offset + bp_size, np.float32)[b_offset:]  # b_offset 0: no f32x16 load across two lines
    for pc in range(0, k, kc):
        kcur = min(kc, k - pc)
        for ic in prange(tasks):
            i0 = ic * mc
            mcur = min(mc, m - i0)
            pack_a_block(a, i0, mcur, pc, kcur, ap[ic, :((mcur + mr - 1) // mr) * mr * kcur], mr)
        for jc in range(0, n, nc):
            ncur = min(nc, n - jc)
            bblock = bp[:(ncur + nr - 1) // nr * nr * kcur]
            pack_b_block(b, pc, kcur, jc, ncur, bblock, nr)
            for ic in prange(tasks):
                i0 = ic * mc
                mcur = min(mc, m - i0)
                macro_kernel(kernel, ap[ic, :((mcur + mr - 1) // mr) * mr * kcur], bblock, c, i0, mcur, jc, ncur,
                             kcur, mr, nr, np.empty(mr * nr, np.float32), pc == 0 and not accumulate)


def matmul_blis(a: np.ndarray, b: np.ndarray, shape: tuple[int, int] | None = None) -> np.ndarray:
    """C = a @ b for float32 a (m, k) and b (k, n), any strides: packed panels, Goto's loops on all Numba
    threads, the outer-product micro-kernel of `shape` = (MR, NV) (default: machine_shape()), blocked by
    blis_blocking from this machine's caches (made even, even_block). Returns a new C-contiguous (m, n) float32
    array."""
    dtype = check_matmul_args(a, b, "matmul_blis")
    if dtype != np.float32:
        raise TypeError(f"matmul_blis: a and b must be float32 (its kernel is f32x16), got {a.dtype} and "
                        f"{b.dtype}; for float64 use matmul_simd")
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if not (m and n and k):
        return np.zeros((m, n), np.float32)
    kernel, mr, nr, mc, kc, nc = _blis_plan(None if shape is None else tuple(shape), m, k, n, numba.get_num_threads())
    c = np.empty((m, n), np.float32)  # not zeroed: the first block of k writes it (np.zeros is a pass over C)
    gemm_blis(a, b, c, kernel, mr, nr, mc, kc, nc, False)
    return c


_PLANS: dict[tuple, tuple] = {}


def _blis_plan(shape: tuple[int, int] | None, m: int, k: int, n: int, threads: int) -> tuple:
    """(kernel, MR, NR, MC, KC, NC) of matmul_blis for an (m, k) @ (k, n) product on `threads` threads,
    with the kernel of `shape` = (MR, NV) (None: machine_shape()). Worked out once per generator
    (blis_kernel_source), shape rule (blis_shape), shape, sizes and thread count: it is some 20 us of
    Python, a tenth of the whole product at n = 256."""
    key = (blis_kernel_source, blis_shape, shape, m, k, n, threads)
    if key not in _PLANS:
        mr, nv = machine_shape() if shape is None else shape
        kernel = make_blis_kernel(mr, nv)
        nr = BLIS_LANES * nv
        # once from Python on a small block: a kernel's error (an unfinished exercise, an index outside
        # its panels) shows here as itself; raised inside gemm_blis's threads it would be a SystemError
        kernel(np.zeros(2 * mr, np.float32), np.zeros(2 * nr, np.float32), np.zeros(mr * nr, np.float32), 0, nr)
        mc_max, kc, nc = machine_blocking(mr, nr)
        if len(_PLANS) >= 4096:  # a long run over many sizes: start again rather than grow
            _PLANS.clear()
        _PLANS[key] = (kernel, mr, nr, block_rows(m, mr, mc_max, threads), even_block(k, kc), even_block(n, nc, nr))
    return _PLANS[key]


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
def kernel_calls(kernel, ap, bp, c, ldc, calls):
    """kernel(ap, bp, c, 0, ldc) `calls` times: one block of C, its panels in L1."""
    for _ in range(calls):
        kernel(ap, bp, c, 0, ldc)


@njit(parallel=True, cache=False)
def run_everywhere(kernel, ap, bp, c, ldc, calls):
    """Thread t runs kernel_calls(kernel, ap[t], bp[t], c[t], ldc, calls): each thread its own L1-resident
    operands."""
    for t in prange(c.shape[0]):
        kernel_calls(kernel, ap[t], bp[t], c[t], ldc, calls)


def peak_rate(kernel: Callable, ap: np.ndarray, bp: np.ndarray, c: np.ndarray, ldc: int, calls: int,
              work_per_call: float) -> float:
    """Work per second (e.g. FLOP/s) of `run_everywhere(kernel, ...)` on ap.shape[0] Numba threads at once,
    work_per_call counted per kernel call and thread: the best of 5 timed runs after a warm-up.
    kernel(ap[t], bp[t], c[t], 0, ldc): an @njit micro-kernel; ap, bp, c: one row per thread."""
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
        t = benchmark(run_everywhere, kernel, ap, bp, c, ldc, calls, warmup=1, repeat=5).min
    finally:
        numba.set_num_threads(before)
    return work_per_call * calls * threads_used / t


def blis_peak(threads_used: int, shape: tuple[int, int] | None = None, kc: int | None = None, calls: int = 3000,
              seed: int = 0) -> float:
    """GFLOP/s of the micro-kernel of `shape` = (MR, NV) (default: machine_shape()) with its panels (kc
    long; default: the longest multiple of 16 for which both fill at most 3/4 of L1) in L1, on
    `threads_used` threads at once: the peak no matmul built on it can beat.
    threads_used: 1 to numba.config.NUMBA_NUM_THREADS."""
    mr, nv = machine_shape() if shape is None else shape
    nr = BLIS_LANES * nv
    if kc is None:
        l1 = machine_cache_sizes().get("L1d", FALLBACK_CACHES["L1d"])
        kc = max(16, (3 * l1 // 4) // ((mr + nr) * 4) // 16 * 16)
    kernel = make_blis_kernel(mr, nv)
    rng_ = np.random.default_rng(seed)
    ap = rng_.standard_normal((threads_used, mr * kc)).astype(np.float32)
    bp = aligned_empty(threads_used * nr * kc, np.float32).reshape(threads_used, nr * kc)  # rows: whole lines
    bp[:] = rng_.standard_normal(bp.shape)
    c = np.zeros((threads_used, mr * nr + 1024), np.float32)  # rows 4 KiB+ apart: no false sharing
    return peak_rate(kernel, ap, bp, c, nr, calls, 2 * mr * nr * kc) / 1e9


from numba.core.dispatcher import Dispatcher as _Dispatcher  # noqa: E402

from minitorch.checks import (Array, Choice, Count, Instance, Int, NonNegative, Optional, Positive, Rule,  # noqa: E402
                              Size, Unchecked, validate_public)

_NJIT = Instance(_Dispatcher, must="a Numba-compiled function (@njit)")


class _Shape(Rule):
    """A micro-kernel's shape: a pair (MR, NV) of integers >= 1."""

    def __call__(self, what: str, name: str, value) -> None:
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise TypeError(f"{what}: {name} must be a pair (MR, NV) of integers >= 1, got {describe(value)}")
        for i, v in enumerate(value):
            Size(what, f"{name}[{i}]", v)


_SHAPE = _Shape()

validate_public(globals(), {
    "asm_of": {"fn": _NJIT},
    "find_packed_fma": {"arch": Optional(Choice("x86_64", "aarch64"))},
    "dot": {"x": Array(ndim=1), "y": Array(ndim=1)},
    "pack_operands": {"mr": Size, "nr": Size},
    "matmul_simd": {"kernel": Optional(_NJIT)},
    "NumbaBackend.matmul": {"a": Array(dtypes="number"), "b": Array(dtypes="number")},  # what np.matmul takes
    "blis_kernel_source": {"mr": Size, "nv": Size},
    "make_blis_kernel": {"mr": Size, "nv": Size},
    "blis_shape": {"registers": Size, "per_vector": Size, "broadcast_registers": Count, "in_flight": Size},
    "blis_blocking": {"l1_bytes": Unchecked(), "l2_bytes": Unchecked(),  # checked in its body: a float is a ValueError
                      "mr": Size, "nr": Size, "itemsize": Size},
    "machine_blocking": {"mr": Size, "nr": Size},
    "block_rows": {"m": Size, "mr": Size, "mc_max": Size, "threads": Size},
    "even_block": {"total": Size, "most": Size, "multiple": Size},
    "matmul_blis": {"shape": Optional(_SHAPE)},
    "best_apart": {"kernels": Instance(dict, must="a dict {name: callable}"), "rounds": Size, "repeat": Size,
                   "pause": NonNegative},
    "peak_rate": {"kernel": _NJIT, "ap": Array(ndim=2), "bp": Array(ndim=2), "c": Array(ndim=2), "ldc": Size,
                  "calls": Size, "work_per_call": Positive},
    "blis_peak": {"threads_used": Int(1, numba.config.NUMBA_NUM_THREADS), "shape": Optional(_SHAPE),
                  "kc": Optional(Size), "calls": Size, "seed": Count},
})
