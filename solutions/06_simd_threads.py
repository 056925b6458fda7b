# %% [markdown]
# # Lesson 06: SIMD and threads
#
# Lesson 05 ended with cache-aware loops that still ran far below NumPy. The loops were right;
# what was missing is how the core actually does arithmetic. A current x86-64 or Arm core
# executes *vector* instructions that apply one operation to 4, 8 or 16 numbers at once, and a
# *fused multiply-add* (FMA) that computes `a*b + c` in one instruction. One Zen 3 core (the
# dev machine) can issue two 256-bit FMAs per cycle: 2 x 8 float32 x 2 FLOPs = 32 FLOPs per
# cycle. A scalar loop gets 1/8 of that at best, and a loop that keeps reloading its
# accumulators from memory gets much less. Then there is the second core.
#
# This lesson:
#
# 1. **Reading the machine code.** Numba shows you the assembly it generated; you write the
#    small tool that finds packed FMA instructions in it, and use it to check every kernel
#    that follows.
# 2. **What the compiler needs to vectorise.** A dot product: a contiguous inner loop, indices
#    the compiler can prove are in range, and permission to reassociate floating-point sums
#    (`fastmath`).
# 3. **A register-blocked micro-kernel.** A 4 x 3 block of C kept in 12 accumulators that
#    LLVM turns into 12 vector registers: 12 FMAs per 7 loads.
# 4. **Packing.** Copy the operands once into the layout the micro-kernel wants.
# 5. **Threads.** The blocked loop nest around the micro-kernel, its outer loop run on every
#    core with Numba's `prange`, compared with NumPy's BLAS.
# 6. **minitorch's Numba backend.** The kernel behind `Tensor.__matmul__`, forward and backward,
#    and lesson 03's MLP trained on it.
#
# The course's reference version of this lesson is `minitorch/simd_matmul.py`. Background:
# [SIMD, vector registers and FMA](../hardware_notes/simd.md) (and a core's peak FLOP/s),
# [caches](../hardware_notes/caches.md) (the levels the blocking targets, and
# [false sharing](../hardware_notes/caches.md#false-sharing) between threads), and
# [the roofline](../hardware_notes/roofline.md) (why a large matmul can run at the compute peak
# at all). The design follows Goto and van de Geijn (2008) and
# the BLIS framework (Van Zee and van de Geijn, 2015): a few portable loops around a small
# architecture-specific micro-kernel.

# %%
#| default_exp simd_matmul
#| export
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

# %%
import os
import time

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Reading the machine code
#
# A compiler that "vectorises" a loop replaces scalar instructions with packed ones. On x86-64
# the names tell you which (Intel SDM, vol. 2; Agner Fog's instruction tables):
#
# | instruction | meaning |
# |---|---|
# | `vfmadd231ss %xmm1, %xmm2, %xmm0` | one float32 FMA (**s**calar **s**ingle), in the low lane of a 128-bit register |
# | `vfmadd231ps %ymm1, %ymm2, %ymm0` | eight float32 FMAs (**p**acked **s**ingle) in 256-bit `ymm` registers (AVX2 + FMA3) |
# | `vfmadd231pd %zmm1, %zmm2, %zmm0` | eight float64 FMAs (**p**acked **d**ouble) in 512-bit `zmm` registers (AVX-512) |
# | `vmulps` + `vaddps` | packed, but not fused: two instructions and two roundings |
#
# `231` names the operand order (`op0 = op1*op2 + op0` in Intel's numbering); there are also
# `132`, `213`, and the subtracting forms `vfmsub`, `vfnmadd`, `vfnmsub`. Numba prints AT&T
# syntax (`%ymm0`, destination last); Intel syntax writes `ymm0` and puts the destination
# first. On 64-bit Arm the packed FMA is `fmla v0.4s, v1.4s, v2.4s` (four float32 in a 128-bit
# NEON register; `.2d` for two float64), and with SVE `fmla z0.s, p0/m, z1.s, z2.s`.
#
# Numba hands you the assembly of any compiled function: `fn.inspect_asm(fn.signatures[0])`.
# The tests of this lesson read it, so that "is my kernel vectorised?" has a yes-or-no answer.

# %%
#| export
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

# %% [markdown]
# **Exercise 6.1.** Write `find_packed_fma(asm, arch=None)`: return the lines of `asm` (stripped
# of surrounding whitespace, in order) that are packed FMA instructions of at least 256 bits on
# x86-64, or vector FMAs on aarch64. `arch` defaults to `isa()`. Precisely:
#
# - `x86_64`: the mnemonic is `vfmadd`, `vfmsub`, `vfnmadd` or `vfnmsub`, then `132`, `213` or
#   `231`, then `ps` or `pd`, and the line names a `ymm` or `zmm` register (`%ymm3` or
#   `ymm3`). Scalar forms (`ss`, `sd`), 128-bit `xmm`-only lines, `vfmaddsub` and non-fused
#   `vmulps` do not count.
# - `aarch64`: `fmla` or `fmls` on NEON vectors (`v0.4s`, `v1.2d`, `v2.8h`) or SVE registers
#   (`z0.s`, `z1.d`, `z2.h`). The scalar `fmadd s0, s1, s2, s3` does not count.
# - any other `arch`: raise ValueError naming it and the known ones.
#
# The `re` module is enough: one compiled pattern per ISA, searched line by line.

# %%
#| export
#| exercise 6.1
def find_packed_fma(asm: str, arch: str | None = None) -> list[str]:
    """The packed (SIMD) fused multiply-add instructions in `asm`, one stripped line each.

    asm: assembly text (AT&T or Intel syntax on x86-64). arch: 'x86_64' or 'aarch64'
    (default: this machine's `isa()`); anything else raises ValueError.
    """
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("6.1")

# %% [markdown]
# ## 2. What the compiler needs to vectorise
#
# LLVM's loop vectoriser (which Numba uses) rewrites a loop so that one iteration of the new
# loop does W iterations of the old one with packed instructions, W = register width / element
# size (LLVM, "Auto-Vectorization in LLVM"). It only does so when it can prove the result is
# the same. Three things commonly stop it:
#
# 1. **Non-contiguous or unknowable addresses.** Packed loads read W neighbours. A loop over
#    a column of a row-major matrix would need a gather; a Numba index that might be negative
#    needs Python's wrap-around fix-up (`i + len` when `i < 0`) on every access. Lesson 05
#    saw this: index a view from 0 (`row = a[i, p0:p1]; row[p]`) rather than `a[i, p]` with
#    `p` starting at `p0`.
# 2. **Possible aliasing.** If a store through one array might change what a load from another
#    array reads, the loads cannot be moved ahead of the stores. NumPy arrays carry no
#    "these do not overlap" promise (C's `restrict`).
# 3. **Floating-point order.** `acc += x[i] * y[i]` is a chain: each addition needs the previous
#    sum. Vectorising it means keeping W partial sums and adding them at the end, which
#    *reassociates* the additions, and floating-point addition is not associative, so the
#    answer may change in the last bits. The compiler may not do that unless told it may:
#    `fastmath=True` (or the single LLVM flag `fastmath={"reassoc"}`). Fusing `x*y + acc` into
#    one FMA changes rounding too and needs the `contract` flag.
#
# Reassociation is not a loss of accuracy in any meaningful sense: W partial sums are a
# partial form of pairwise summation, usually *more* accurate than one long chain (Higham,
# *Accuracy and Stability of Numerical Algorithms*, ch. 4). What `fastmath=True` also permits
# (assuming no NaN or infinity, `nnan`/`ninf`) is riskier; kernels that must handle NaN should
# pass only the flags they need.
#
# **Exercise 6.2.** Write the body of `dot_kernel(x, y)`, compiled with `fastmath=True`: the
# sum of `x[i] * y[i]`. Accumulate in the arrays' own dtype: start from `x.dtype.type(0)`, not
# `0.0`, which is a float64 and would make a float32 loop convert every product to float64.
# The test checks the result against NumPy and checks that the float32 machine code contains
# packed FMAs (`vfmadd...ps` on `ymm`/`zmm` here).

# %%
#| export
#| exercise 6.2
@njit(fastmath=True, cache=False)
def dot_kernel(x, y):
    """sum_i x[i] * y[i] for 1-D C-contiguous arrays of one float dtype and equal length.

    Returns a scalar of that dtype (accumulated in that dtype, in vector partial sums).
    """
    ### BEGIN SOLUTION
    acc = x.dtype.type(0)
    for i in range(x.shape[0]):
        acc += x[i] * y[i]
    return acc
    ### END SOLUTION


def dot(x: np.ndarray, y: np.ndarray) -> float:
    """x . y for 1-D float arrays of equal length (validated, made contiguous, common dtype)."""
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim != 1 or y.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"dot: x and y must be 1-D arrays of equal length, got shapes {x.shape} and {y.shape}")
    dtype = np.result_type(x, y)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dot: x and y must be float32 or float64 arrays, got dtypes {x.dtype} and {y.dtype}")
    return dot_kernel(np.ascontiguousarray(x, dtype=dtype), np.ascontiguousarray(y, dtype=dtype))

# %% tags=["check"]
check("6.2")

# %% [markdown]
# The same loop compiled three ways: no fast-math, contraction only (`{"contract"}`: FMA
# allowed, reassociation not), and `fastmath=True`. For each, the packed FMAs found in its
# float32 machine code and its speed on vectors that fit in L1. Expect no packed FMA and the
# lowest speed for the first two (the chain of dependent additions runs at one add per FMA
# latency, about 4 cycles), and several times more for the third, which keeps several
# vector accumulators in flight.
#
# A fast dot product of 1024 float32 takes well under 100 ns, less than the ~0.5 us it costs
# to call any compiled function from Python (Numba checks the argument types and unboxes the
# arrays on every call). Timed from Python, the figure would mostly measure that call. So each
# variant is timed inside a compiled loop that calls it thousands of times, alternating
# between two pairs of vectors so that the compiler cannot hoist the call out of the loop; the
# from-Python time per call is printed next to it, to show what it would have measured.

# %% tags=["demo"]
from minitorch.bench import benchmark, load_report

print(load_report())


dot_body = dot_kernel.py_func  # your exercise 6.2, as Python: compiled below with three sets of flags


def in_a_compiled_loop(fn):
    """`many(xs, ys, calls)`: calls fn(xs[r % 2], ys[r % 2]) `calls` times inside compiled code."""
    @njit
    def many(xs, ys, calls):
        acc = xs.dtype.type(0)
        for r in range(calls):
            acc += fn(xs[r & 1], ys[r & 1])  # the result is used and the operands change: no hoisting
        return acc
    return many


n_dot, calls = 1024, 1000
xs = rng.standard_normal((2, n_dot)).astype(np.float32)  # 2 x 2 x 4 KiB: all in L1
ys = rng.standard_normal((2, n_dot)).astype(np.float32)
variants = {"no fastmath": njit(dot_body), "contract only": njit(fastmath={"contract"})(dot_body),
            "fastmath=True": njit(fastmath=True)(dot_body)}
for label, fn in variants.items():
    fmas = find_packed_fma(asm_of(fn, xs[0], ys[0])) if isa() in ("x86_64", "aarch64") else []
    t_loop = benchmark(in_a_compiled_loop(fn), xs, ys, calls, warmup=1, repeat=20).min / calls
    t_python = benchmark(fn, xs[0], ys[0], warmup=2, repeat=200).min
    print(f"{label:14s} packed FMAs in asm: {len(fmas):2d}   {t_loop * 1e9:6.0f} ns per call = "
          f"{2 * n_dot / t_loop / 1e9:6.2f} GFLOP/s   (timed from Python: {t_python * 1e9:5.0f} ns)"
          + (f"   e.g. {fmas[0]}" if fmas else ""))

# %% [markdown]
# ## 3. A register-blocked micro-kernel
#
# A vectorised dot product is still slow for matmul: each FMA needs two fresh loads (one
# vector of `x`, one of `y`), and a core does at most two or three loads per cycle next to its
# two FMAs. The cure is *register blocking*: compute a small block of C at once so that every
# loaded vector is used several times. For an MR x NR block, each step along `k` loads MR
# vectors of A and NR vectors of B and does MR * NR FMAs with them.
#
# The block shape is set by the register file. AVX2 has 16 `ymm` registers. With MR = 4 and
# NR = 3 there are 12 accumulators, 4 registers for the vectors of A, and the vectors of B are
# used straight from memory as the FMA's memory operand: 12 FMAs per 7 loads, 16 registers.
#
# Our micro-kernel computes each element of the block as a dot product along `k`, which needs
# A's rows and B's *columns* contiguous in `k`. So it reads B transposed, `bt = B.T` stored
# row-major (section 4 makes that copy). LLVM vectorises the `p` loop exactly as in
# exercise 6.2, but now with 12 independent sums: each scalar accumulator becomes one `ymm`
# register holding 8 partial sums, reduced to one number after the loop.
#
# BLIS's micro-kernels are organised differently (an *outer product* per step: broadcast
# MR numbers of A, load NR-wide vectors of a row of B, with the MR x NR block of C itself held
# in registers, so no reduction at the end), written in assembly or intrinsics. Numba has no
# vector types, and LLVM will not keep a small NumPy array in registers: measured on the
# 2-core dev machine, a 4 x 16 accumulator allocated with `np.zeros` compiled to scalar
# `vfmadd213ss` with a load and store per FMA, about 4 GFLOP/s on one core, while the scalar
# form below reached about 80 GFLOP/s on one core from L1, close to the 2 x 8 x 2 FLOPs per
# cycle the core can do. Scalar variables are the way to tell LLVM "these live in registers".
#
# **Exercise 6.3.** Write `micro_kernel(a, bt, c, i0, j0, p0, p1)`:
# `c[i0:i0+4, j0:j0+3] += a[i0:i0+4, p0:p1] @ bt[j0:j0+3, p0:p1].T`. Use 12 scalar accumulators
# `c00 ... c32` started at `c.dtype.type(0)`, row views `a0 = a[i0, p0:p1]` ... and
# `b0 = bt[j0, p0:p1]` ... indexed from 0 in one loop over `p`, and add the accumulators into
# `c` after the loop. Nothing else of `c` may change. The test checks the values, float32 and
# float64, and that the float32 code contains packed FMAs.

# %%
#| export
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

# %%
#| export
#| exercise 6.3
@njit(fastmath=True, cache=False)
def micro_kernel(a, bt, c, i0, j0, p0, p1):
    """c[i0:i0+MR, j0:j0+NR] += a[i0:i0+MR, p0:p1] @ bt[j0:j0+NR, p0:p1].T, with MR=4, NR=3.

    a (M, K) and bt (N, K): C-contiguous, one float dtype (bt is B transposed, so a column of B
    is a contiguous row of bt); c (M, N) of the same dtype. Requires i0 + 4 <= M, j0 + 3 <= N,
    0 <= p0 <= p1 <= K. The 4 x 3 block is kept in 12 scalar accumulators of c's dtype.
    """
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("6.3")

# %% [markdown]
# Look at the machine code yourself. The listing below prints the packed FMAs of the float32
# micro-kernel and the instructions of the loop that contains them: expect 12 `vfmadd231ps`
# on `ymm` registers (some with a memory operand, the vectors of `bt`), 4 or 7 `vmovups`
# loads, and a pointer increment and compare-and-branch: the whole inner loop.
# `micro_kernel_reference`, with its one accumulator per inner loop, is printed for contrast.

# %% tags=["demo"]
a_demo = rng.standard_normal((8, 256)).astype(np.float32)
bt_demo = rng.standard_normal((6, 256)).astype(np.float32)
c_demo = np.zeros((8, 6), np.float32)
args = (a_demo, bt_demo, c_demo, 0, 0, 0, 256)
micro_kernel(*args)
micro_kernel_reference(*args)
sig = tuple(numba.typeof(x) for x in args)
asm = micro_kernel.inspect_asm(sig)
if isa() in ("x86_64", "aarch64"):
    fmas = find_packed_fma(asm)
    print(f"micro_kernel: {len(fmas)} packed FMAs; reference: "
          f"{len(find_packed_fma(micro_kernel_reference.inspect_asm(sig)))}")
    lines = asm.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.strip() in fmas)
    start = max(i for i in range(first + 1) if lines[i].startswith(".LBB"))  # the loop's label
    end = next(i for i in range(first, len(lines)) if lines[i].strip().startswith(("jne", "jb", "jl", "b.", "cbnz")))
    print("\n".join(lines[start:end + 1]))

# %% tags=["demo"]
def micro_gflops(kernel, dtype, kc=256, calls=2000):
    """GFLOP/s of `kernel` on one 4 x 3 block with kc-long operands (all in L1), one core."""
    a = rng.standard_normal((MR, kc)).astype(dtype)
    bt = rng.standard_normal((NR, kc)).astype(dtype)
    c = np.zeros((MR, NR), dtype)

    @njit
    def many(a, bt, c, calls):
        for _ in range(calls):
            kernel(a, bt, c, 0, 0, 0, a.shape[1])

    t = benchmark(many, a, bt, c, calls, warmup=1, repeat=5).min
    return 2 * MR * NR * kc * calls / t / 1e9


print(load_report())
for dtype in (np.float32, np.float64):
    print(f"{np.dtype(dtype).name}: micro_kernel {micro_gflops(micro_kernel, dtype):6.1f} GFLOP/s   "
          f"reference {micro_gflops(micro_kernel_reference, dtype):6.1f} GFLOP/s (one core, data in L1)")

# %% [markdown]
# ## 4. Packing
#
# The micro-kernel wants A with rows contiguous in `k` (row-major A already is) and B with
# *columns* contiguous in `k` (so B transposed), both with a number of rows that is a multiple
# of the block: MR for A, NR for B.T. `pack_operands` (given) makes those copies, padded with
# zero rows, so that the loops never meet a partial block: a zero row of A or of `bt` adds
# nothing, and the padded rows and columns of C are cut off at the end. This is a simplified
# form of the packing in Goto and van de Geijn (2008), who also copy each block into the exact
# order the micro-kernel reads it, so that it streams through consecutive addresses and few
# TLB pages.
#
# Packing moves `m*k + k*n` numbers while the product does `m*n*k` multiply-adds, so for all
# but small matrices it should be noise, but only if the copy itself is done well. A transposing
# copy reads along rows and writes along columns (or the reverse), so one side touches a new
# cache line per element; `np.ascontiguousarray(b.T)` took about 5.5 ms for a 1024 x 1024
# float32 matrix on the dev machine, a quarter of the time of the whole threaded product.
# `transpose_into` copies 32 x 32 tiles instead (each tile's 32 source and 32 destination
# lines stay in L1) on all threads. It also solves the non-contiguous input problem (a transposed
# or strided view is copied like anything else) and the dtype problem (one common dtype).

# %%
#| export
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

# %% [markdown]
# ## 5. The loops around the micro-kernel, on every core
#
# The micro-kernel is fast only if its operands come from nearby caches. The five loops of
# Goto and van de Geijn (2008), in a simplified three-level form, arrange that:
#
# ```
# for ic in prange(row panels of MC rows):        # each thread takes whole row panels
#     for jc in range(0, N, NC):                  # NC columns of C: a (NC x KC) block of bt
#         for pc in range(0, K, KC):              # KC along k
#             for i0 in range(ic*MC, ..., MR):    # the MR rows of A (MR x KC) stay in L1
#                 for j0 in range(jc, ..., NR):   #   while NR rows of bt stream from L2
#                     kernel(ap, bt, c, i0, j0, pc, pc_end)
# ```
#
# Block sizes (given, `MC, KC, NC`): the `bt` block, NC x KC = 48 x 1024 float32 = 192 KiB, and
# the A panel, MC x KC = 32 x 1024 = 128 KiB, fit together in the 512 KiB L2 of the Zen 3 dev
# machine (Zen 4 cores have 1 MiB); 4 rows of A (16 KiB) fit in the 32 KiB L1 and are reused by NC / NR = 16 micro-kernel calls.
# A long KC matters for this micro-kernel in particular: its 12 accumulators are reduced
# horizontally after every call (8 lanes to 1, twelve times), which costs as much as a few
# dozen iterations of its loop, so the loop must be long. Measured on the 2-core dev machine,
# one thread, n = 1024: KC = 512 gave about 52-60 GFLOP/s, KC = 1024 about 66-77.
#
# **Threads.** `numba.prange` marks a loop whose iterations are independent; with
# `parallel=True` Numba turns it into a *parfor* whose iterations are divided among a pool of
# threads (OpenMP, TBB or Numba's own work queue), one per core by default
# (`numba.get_num_threads()`, set with `numba.set_num_threads(n)`). The outer loop is the
# right one to parallelise: each row panel writes its own rows of C, so no two threads write
# the same element (no race, no locking), each thread packs nothing and shares the read-only
# `bt`, and there is one fork and join per call rather than per block. Each core has its own
# L2, so each thread keeps its own copy of the `bt` block there. Nor do the threads fight over
# cache lines: caches keep copies coherent line by line, so two threads writing *different*
# values that share a 64-byte line take the line from each other on every write (false
# sharing, [caches](../hardware_notes/caches.md#false-sharing)). Here each thread writes its
# own rows of C, and the micro-kernel writes each element once, after its loop, from a
# register; at most the line at a panel boundary is shared, and it is written a few times per
# call, not once per multiply-add.
#
# **Exercise 6.4.** Write `gemm_parallel(ap, bt, c, kernel)`: the loop nest above, with
# `prange` on the row-panel loop, calling `kernel(ap, bt, c, i0, j0, pc, pc_end)` for every
# MR x NR block of C and every KC-long piece of `k` exactly once. `kernel` is a parameter
# (any Numba function with `micro_kernel`'s signature), like the micro-kernels BLIS plugs into
# one loop nest; `matmul_simd` passes `micro_kernel`, the tests pass their own. Shapes are
# multiples of the block (`pack_operands` padded them), but not of MC, NC or KC: the last
# panel, block and piece are shorter.

# %%
#| export
MC, KC, NC = 32, 1024, 48  # rows of A per thread task, k per block, columns of C per block (NC % NR == 0)

# %%
#| export
#| exercise 6.4
@njit(parallel=True, fastmath=True, cache=False)
def gemm_parallel(ap, bt, c, kernel):
    """c += ap @ bt.T, block by block, with the row-panel loop run on all threads.

    ap (M, K), bt (N, K), c (M, N): C-contiguous, one float dtype, M % MR == 0 and N % NR == 0.
    kernel(ap, bt, c, i0, j0, p0, p1) adds the MR x NR block at (i0, j0) over k in [p0, p1).
    """
    ### BEGIN SOLUTION
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
    ### END SOLUTION


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

# %% tags=["check"]
check("6.4")

# %% [markdown]
# Is it really parallel? Numba's parallel diagnostics list the parfors it created and what
# it did to them; `numba.get_thread_id()` tells a function which pool thread runs it. The cell
# below prints the diagnostics, then runs the loop nest with a micro-kernel that writes its
# thread id into the block it was given: each row panel should carry one id, and with 2 threads
# both ids should appear.

# %% tags=["demo"]
gemm_parallel.parallel_diagnostics(gemm_parallel.signatures[0], level=1)


@njit
def thread_id_kernel(ap, bt, c, i0, j0, p0, p1):
    for i in range(MR):
        for j in range(NR):
            c[i0 + i, j0 + j] = numba.get_thread_id()


ids = np.zeros((4 * MC, NC), dtype=np.float64)
gemm_parallel(np.zeros((4 * MC, 8)), np.zeros((NC, 8)), ids, thread_id_kernel)
print(f"{numba.get_num_threads()} threads ({numba.threading_layer()} layer); "
      f"thread id per row panel: {[int(ids[r * MC, 0]) for r in range(4)]}")

# %% [markdown]
# Now the whole matmul. First a correctness check on awkward shapes, then GFLOP/s at n = 1024
# float32 next to lesson 05's best loop and NumPy's BLAS (OpenBLAS here, hand-written assembly
# micro-kernels for each CPU family), each with one thread and with all threads; `blas_limit`
# (lesson 04) sets BLAS's count, `numba.set_num_threads` ours. The cell prints `blas_line()`
# (lesson 04) first: the BLAS kernel that ran and the CPU's vector ISA, with a note where the
# environment holds OpenBLAS to an older kernel than your CPU's (section 8 times BLAS without it). Expect the single-thread kernel to be three to
# four times faster than lesson 05's tiled loop, close to the micro-kernel's own speed from L1,
# and the all-thread kernel to reach about half of NumPy's all-thread figure or more (the
# target for this lesson; measured figures at the end). On a shared machine, thread scaling is
# the first thing noise destroys: if another process is busy on one core, the parallel loop
# waits for its slowest thread.

# %% tags=["demo"]
from minitorch.bench import blas_limit, blas_line
from minitorch.cpu_matmul import matmul_tiled

for (m, k, n) in [(1, 1, 1), (37, 1031, 53), (130, 17, 7), (5, 600, 211)]:
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32).T  # a non-contiguous view
    np.testing.assert_allclose(matmul_simd(a, b), a.astype(np.float64) @ b, rtol=1e-3, atol=1e-3 * np.sqrt(k))
print("matmul_simd matches NumPy on odd shapes")
print(load_report())
print(blas_line())

threads = numba.get_num_threads()


def gflops(fn, n, threads_used, repeat=5):
    """GFLOP/s of fn on (n, n) @ (n, n) float32 with Numba and BLAS on `threads_used` threads."""
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    before = numba.get_num_threads()
    numba.set_num_threads(threads_used)
    try:
        with blas_limit(threads_used):
            return 2 * n**3 / benchmark(fn, a, b, warmup=2, repeat=repeat).min / 1e9
    finally:
        numba.set_num_threads(before)


n = 256 if SMALL else 1024
results = {"lesson 05 tiled, 1 thread": gflops(matmul_tiled, n, 1, repeat=2)}
for t in sorted({1, threads}):
    results[f"simd, {t} thread{'s' * (t > 1)}"] = gflops(matmul_simd, n, t)
    results[f"numpy (OpenBLAS), {t} thread{'s' * (t > 1)}"] = gflops(np.matmul, n, t)
best_numpy = max(g for name, g in results.items() if name.startswith("numpy"))
for name, g in results.items():
    print(f"n={n} float32  {name:28s} {g:7.1f} GFLOP/s  {g / best_numpy:6.0%} of NumPy's best")

# %% [markdown]
# **GFLOP/s against n, and against threads, with the peak drawn.** Two more measurements put
# those numbers in context. The *peak* is what the arithmetic units can do: the micro-kernel
# run over and over on a block that stays in L1, on every thread at once (each thread its own
# block), as `benchmarks/bench_cpu_matmul.py` measures it for `make bench`; no matmul of ours
# can beat it. The left plot sweeps n for both kernels on one thread and on all threads, the
# right one the number of threads at one n. Expect the curves to climb with n until packing
# and the fork and join are paid off, NumPy to lead at every size, and both to scale with the
# threads only as far as the machine really has idle cores.

# %% tags=["demo"]
import matplotlib.pyplot as plt


@njit(parallel=True)
def micro_kernel_everywhere(a, bt, c, calls):
    """Each thread runs the micro-kernel `calls` times on its own L1-resident block."""
    for t in prange(c.shape[0]):
        for _ in range(calls):
            micro_kernel(a[t], bt[t], c[t], 0, 0, 0, a.shape[2])


def peak_gflops(threads_used, kc=256, calls=300 if SMALL else 2000):
    a = rng.standard_normal((threads_used, MR, kc)).astype(np.float32)
    bt = rng.standard_normal((threads_used, NR, kc)).astype(np.float32)
    c = np.zeros((threads_used, MR, 16), np.float32)  # 256 bytes per thread: no false sharing of C
    before = numba.get_num_threads()
    numba.set_num_threads(threads_used)
    try:
        t = benchmark(micro_kernel_everywhere, a, bt, c, calls, warmup=1, repeat=5).min
    finally:
        numba.set_num_threads(before)
    return 2 * MR * NR * kc * calls * threads_used / t / 1e9


print(blas_line())
thread_counts = list(range(1, threads + 1))
peaks = {t: peak_gflops(t) for t in thread_counts}
sizes = (64, 128) if SMALL else (64, 128, 256, 512, 1024, 2048)
fig, (ax_n, ax_t) = plt.subplots(1, 2, figsize=(12, 4.3))
for t, style in ((1, "--"), (threads, "-")):
    for name, fn in (("simd", matmul_simd), ("numpy", np.matmul)):
        ys = [gflops(fn, n_, t, repeat=2 if SMALL else 3) for n_ in sizes]
        ax_n.plot(sizes, ys, style, marker="o", label=f"{name}, {t} thread{'s' * (t > 1)}")
        print(f"{name:5s} {t} thread(s): " + "  ".join(f"n={n_}: {g:.0f}" for n_, g in zip(sizes, ys)) + " GFLOP/s")
    ax_n.axhline(peaks[t], color="k", ls=style, lw=1, label=f"peak, {t} thread{'s' * (t > 1)}")
ax_n.set(xscale="log", xlabel="n (square, float32)", ylabel="GFLOP/s", title="GFLOP/s against n")
ax_n.set_xticks(sizes, [str(x) for x in sizes])
n_scale = 128 if SMALL else 1024
for name, fn in (("simd", matmul_simd), ("numpy", np.matmul)):
    ys = [gflops(fn, n_scale, t, repeat=2 if SMALL else 3) for t in thread_counts]
    ax_t.plot(thread_counts, ys, marker="o", label=f"{name}, n = {n_scale}")
    print(f"{name:5s} n={n_scale}: " + "  ".join(f"{t} thr: {g:.0f}" for t, g in zip(thread_counts, ys)) + " GFLOP/s")
ax_t.plot(thread_counts, [peaks[t] for t in thread_counts], "k--", marker="s", label="peak (micro-kernel from L1)")
ax_t.set(xlabel="threads", ylabel="GFLOP/s", title="thread scaling", xticks=thread_counts)
print("peak: " + "  ".join(f"{t} thr: {g:.0f}" for t, g in peaks.items()) + " GFLOP/s")
for ax in (ax_n, ax_t):
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Live: why threads stop paying (Amdahl, 1967). If a fraction `s` of one run is serial (packing
# on one thread, the fork and join, Python around the call), p threads give at most
# `1 / (s + (1 - s) / p)`, never more than `1 / s`; a fixed cost per thread of a fork/join makes
# the curve turn down. The dots are the simd kernel's measured speed-ups from the plot above.

# %% tags=["demo"]
from course.live import live

measured_speedup = {t: gflops(matmul_simd, n_scale, t, repeat=2) for t in thread_counts}
measured_speedup = {t: g / measured_speedup[1] for t, g in measured_speedup.items()}


def draw_amdahl(serial_percent: float, fork_join_percent: float):
    s, c = serial_percent / 100, fork_join_percent / 100
    p = np.arange(1, 65)
    speedup = 1 / (s + (1 - s) / p + c * (p - 1))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(p, speedup, label="model")
    ax.plot(p, p, ":", color="gray", label="linear")
    ax.plot(list(measured_speedup), list(measured_speedup.values()), "o", color="C3", label="simd, measured")
    best = int(p[np.argmax(speedup)])
    ax.set(xscale="log", yscale="log", xlabel="threads", ylabel="speed-up", ylim=(0.8, 70),
           title=f"serial {serial_percent:.1f}%: at most {1 / s if s else float('inf'):.0f}x; "
                 f"best {speedup.max():.1f}x at {best} threads")
    ax.legend(fontsize=8)
    return fig


live(draw_amdahl, serial_percent=(0.0, 30.0), fork_join_percent=(0.0, 2.0))

# %% [markdown]
# ## 6. minitorch's Numba backend
#
# Lesson 01 routes every array operation of a `Tensor` through its device's `Backend`, and
# lesson 02 computes matmul's forward *and* backward (`grad_a = grad @ b.T`,
# `grad_b = a.T @ grad`) with `get_backend(device).matmul`. So a backend whose `matmul` is our
# kernel makes every `Linear` layer, forward and backward, run on it, without touching lessons
# 01-03. `use_backend("cpu", NumbaBackend())` swaps it in for a `with` block.
#
# `Backend.matmul` has NumPy's `matmul` semantics, so the backend must handle what `np.matmul`
# handles: batched operands (`(..., m, k) @ (..., k, n)`, batch dimensions broadcast) and 1-D
# operands (a vector is promoted to a one-row or one-column matrix and that dimension is
# removed from the result). Only the elementwise operations stay with NumPy: they are
# memory-bound (one or two FLOPs per 8-12 bytes moved, see lesson 04's roofline), NumPy's
# loops are already vectorised, and a second thread helps a memory-bound loop only where one
# core cannot saturate the memory system.
#
# **Exercise 6.5.** Write `NumbaBackend.matmul(a, b)`:
#
# - if either operand is not float32/float64, return `np.matmul(a, b)` (our kernel is for
#   floats; integers are rare in a network and NumPy is the reference);
# - 0-d operands: ValueError (as `np.matmul`);
# - promote 1-D operands as NumPy does; inner dimensions must match, else ValueError naming
#   both shapes; batch dimensions must broadcast (`np.broadcast_shapes`), else ValueError
#   naming both shapes;
# - call `self.matmul_2d` (by default `matmul_simd`) once per batch element and assemble the
#   result of shape `batch + (m, n)` (with the promoted dimensions removed), dtype
#   `np.result_type(a, b)`.

# %%
#| export
#| exercise 6.5
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
        ### BEGIN SOLUTION
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
        ### END SOLUTION

# %% tags=["check"]
check("6.5")

# %% [markdown]
# ## 7. Training on your own kernel
#
# Lesson 03's MLP, trained twice on the same data from the same initial weights: once with the
# NumPy backend and once inside `use_backend("cpu", NumbaBackend(...))`. A counting wrapper
# around `matmul_simd` shows the kernel is really called, forward and backward (3 matmuls per
# `Linear` per step: one forward, two for the gradients). Expect equal losses up to float32
# rounding (the kernel sums in a different order than BLAS), and expect the Numba backend to be
# *slower*: our kernel reaches 60-75 % of OpenBLAS on large matrices (section 5), and these
# layers are at most 128 wide, where packing and waking the threads cost as much as the
# arithmetic; the first steps also compile the kernels for each new operand layout. The
# point is not speed but that the whole network, gradients included, now runs on code you
# wrote and can read down to the instructions.
#
# The cell trains 300 steps on each backend (30 with `MINITORCH_SMALL=1`), with a progress bar
# for each run, and prints the time of each run (the steps alone, not the bar) and of the whole
# cell: 10-20 s on an idle 2-core laptop, minutes when other programs share its cores.

# %% tags=["demo"]
from tqdm.auto import tqdm

try:
    from minitorch.autograd import Tensor
    from minitorch.data import make_spirals
    from minitorch.nn import MLP, cross_entropy
    from minitorch.optim import Adam
    from minitorch.tensor import use_backend
    HAVE_NN = True
except ImportError as exc:
    HAVE_NN = False
    print(f"skipped: lessons 01-03 (minitorch.tensor/autograd/nn) are not built yet ({exc})")

if HAVE_NN:
    calls = {"n": 0}

    def counted_matmul(x, y):
        calls["n"] += 1
        return matmul_simd(x, y)

    def train(steps: int, desc: str, seed: int = 0) -> tuple[list[float], float]:
        """(losses, seconds): the seconds add up the steps alone, not the progress bar between them."""
        data_rng = np.random.default_rng(seed)
        X, y = make_spirals(512 if SMALL else 2048, noise=0.2, rng=data_rng)
        model = MLP([2, 128, 128, 3], rng=np.random.default_rng(seed))
        opt = Adam(model.parameters(), lr=1e-2)
        xt = Tensor(X.astype(np.float32))
        losses, seconds = [], 0.0
        for _ in tqdm(range(steps), desc=desc, unit="step"):
            t0 = time.perf_counter()
            loss = cross_entropy(model(xt), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
            seconds += time.perf_counter() - t0
        return losses, seconds

    steps = 30 if SMALL else 300
    print(load_report())
    t_cell = time.perf_counter()
    with blas_limit(threads):  # both backends on all threads: BLAS's and Numba's
        ref_losses, ref_time = train(steps, "NumPy backend")
        with use_backend("cpu", NumbaBackend(matmul_2d=counted_matmul)):
            our_losses, our_time = train(steps, "Numba backend")
    print(f"{steps} steps, {threads} threads: NumPy backend {ref_time:.2f} s, Numba backend {our_time:.2f} s; "
          f"matmul_simd called {calls['n']} times ({calls['n'] / steps:.0f} per step); "
          f"this cell took {time.perf_counter() - t_cell:.0f} s")
    print(f"final loss: NumPy {ref_losses[-1]:.4f}, Numba {our_losses[-1]:.4f}; "
          f"largest loss difference {max(abs(p - q) for p, q in zip(ref_losses, our_losses)):.2e}")

# %% [markdown]
# And one wide product, 1024 x 1024, forward and backward through the Tensor API on each
# backend, both on all threads: the gap is the kernel gap of section 5, plus packing the
# transposed operands of the backward pass.

# %% tags=["demo"]
if HAVE_NN:
    w = 256 if SMALL else 1024
    xw = Tensor(rng.standard_normal((w, w)).astype(np.float32), requires_grad=True)
    ww = Tensor(rng.standard_normal((w, w)).astype(np.float32), requires_grad=True)

    def fwd_bwd():
        xw.zero_grad()
        ww.zero_grad()
        (xw @ ww).sum().backward()

    with blas_limit(threads):
        t_np = benchmark(fwd_bwd, warmup=1, repeat=3).min
        with use_backend("cpu", NumbaBackend()):
            t_nb = benchmark(fwd_bwd, warmup=1, repeat=3).min
    print(f"{w}x{w} matmul forward+backward (3 matmuls), {threads} threads: NumPy backend {t_np * 1e3:.1f} ms, "
          f"Numba backend {t_nb * 1e3:.1f} ms")

# %% [markdown]
# ## 8. The BLIS micro-kernel: explicit vectors, shaped by the machine
#
# Section 3's kernel is an *inner-product* kernel: each of its 12 sums is a dot product whose
# lanes are added together (a horizontal reduction, 8 lanes to 1, 16 on AVX-512) after every call, and it
# loads 4 + 3 vectors for 12 FMAs. BLAS libraries use the *outer-product* form instead
# (Goto and van de Geijn 2008; BLIS, Van Zee and van de Geijn 2015). Keep an MR x NR block of C
# in vector registers, NR / 16 vectors per row of the block, and for every k:
#
# ```
# b[v] = B[k, j0+16v : j0+16v+16]  for v < NV    # NV vector loads (NR = 16 NV columns)
# for r in range(MR):                            # MR x NV FMAs, each with one broadcast scalar of A
#     acc[r][v] += A[i0 + r, k] * b[v]           # acc[r][v]: 16 elements of row r of the C block
# ```
#
# Nothing is reduced: the accumulators *are* the block of C, and are added to it once, at the
# end. Numba cannot express that kernel: it has no vector type, and whether a loop uses vector
# registers is up to LLVM's auto-vectoriser, which would see MR x NR scalar sums here.
# `minitorch.simd` (given, about 350 lines; read it) adds one: `f32x16` is a value of 16 float32
# lanes that Numba keeps in registers (LLVM's `<16 x float>`: one `zmm` register on AVX-512, two
# `ymm` on AVX2, four `q` on Arm NEON), with `vzero_f32()`, `vload_f32(x, i)` (16 lanes from
# `x[i:]`), `vfma_bcast(acc, b, s)` (`acc + b * s` with the scalar `s` in every lane, one fused
# multiply-add) and `vstore_add_f32(acc, y, i)` (`y[i:i+16] += acc`). Each is a few LLVM
# instructions (a splat and `llvm.fma`; a load, an add and a store), as `_mm512_fmadd_ps` is a C
# intrinsic; every vector access is checked against its array's size, and LLVM removes the checks
# it can prove. (The scalar reads of `ap` are ordinary Numba indexing, which does not check
# bounds.) Lesson 10 adds the integer operations it needs to the same module.

# %%
#| export simd
#| given
"""minitorch.simd: explicit SIMD vectors for Numba kernels, the way C code uses intrinsics.

Given in lesson 06 (not an exercise); lesson 10 builds on it.

Numba has no vector type: whether a loop uses SIMD registers is the auto-vectoriser's choice.
This module adds two, each a value Numba keeps in registers (an LLVM `<16 x float>` or
`<16 x i32>`): a zmm register on AVX-512, two ymm on AVX2, four q registers on Arm NEON.

    f32x16: vzero_f32(), vload_f32(x, i), vfma_bcast(acc, b, s), vstore_add_f32(acc, y, i)
    i32x16: vzero_i32(), vmadd_pairs(acc, w, p, i), vdot_u8s8(acc, w, p, i), vstore_add_i32(acc, y, i)

Arrays are 1-D, C-contiguous, of the stated dtype; `i` is an element index, checked against the
array's size (an IndexError with the index, the lanes and the size, never a read or write outside
the array; LLVM drops the checks it can prove, as in a loop over a panel). Each operation is a
few LLVM instructions: a splat and `llvm.fma` for the float multiply-add; a load, an add and a
store for `vstore_add_*`; for `vmadd_pairs`, `vpmaddwd` on x86 (one on AVX-512BW, two on AVX2,
chosen from this CPU's features; LLVM fuses it with the add into VNNI's `vpdpwssd` where the CPU
has it), else portable LLVM IR (sign-extend, multiply, add the pairs), which is correct on every
CPU and fast where LLVM matches it. `vdot_u8s8` is VNNI's `vpdpbusd` (four uint8 x int8 products
per int32 lane, added into the lane) on AVX-512 VNNI, two 256-bit `vpdpbusd` on AVX-VNNI, else
portable IR (widen, multiply, add the fours).
MINITORCH_SIMD=avx512|avx2|generic forces vmadd_pairs's flavour, MINITORCH_U8S8=avx512vnni|avxvnni|generic
vdot_u8s8's (the tests run each). `vector_target()` describes the vector registers of the CPU Numba
compiles for: how many there are and how many one f32x16 takes (lesson 06 shapes its micro-kernel
with it).
"""
import os

import llvmlite.binding as llvm_binding
import numba
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.core.extending import intrinsic, models, register_model

LANES = 16
# Numba 0.62 (Intel Macs' last wheels) reports a raised exception's run-time arguments wrongly in
# these functions; there the IndexError names the operation only.
VALUES_IN_ERRORS = tuple(int(v) for v in numba.__version__.split(".")[:2]) >= (0, 68)


class F32x16(types.Type):
    """16 float32 lanes in registers."""

    def __init__(self):
        super().__init__(name="f32x16")


class I32x16(types.Type):
    """16 int32 lanes in registers."""

    def __init__(self):
        super().__init__(name="i32x16")


f32x16, i32x16 = F32x16(), I32x16()
_I32, _I16, _F32 = ir.IntType(32), ir.IntType(16), ir.FloatType()
_VF32, _VI32, _VI16 = ir.VectorType(_F32, LANES), ir.VectorType(_I32, LANES), ir.VectorType(_I16, 2 * LANES)


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF32)


@register_model(I32x16)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI32)


def madd_flavour() -> str:
    """How vmadd_pairs is compiled here: 'avx512', 'avx2' or 'generic' (MINITORCH_SIMD overrides)."""
    forced = os.environ.get("MINITORCH_SIMD", "")
    if forced:
        if forced not in ("avx512", "avx2", "generic"):
            raise ValueError(f"MINITORCH_SIMD must be avx512, avx2 or generic, got {forced!r}")
        return forced
    if numba.config.CPU_NAME:  # Numba compiles for another CPU: no host-only instructions
        return "generic"
    features = llvm_binding.get_host_cpu_features()
    if features.get("avx512bw", False):
        return "avx512"
    return "avx2" if features.get("avx2", False) else "generic"


def _need_array(what: str, ary, dtype) -> None:
    if not (isinstance(ary, types.Array) and ary.ndim == 1 and ary.layout == "C" and ary.dtype == dtype):
        raise TypingError(f"{what}: needs a 1-D C-contiguous {dtype} array, got {ary}")


def _need_int(what: str, name: str, value) -> None:
    if not isinstance(value, types.Integer):
        raise TypingError(f"{what}: {name} must be an integer, got {value}")


def _address(context, builder, aryty, ary, index, vector):
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [index]), vector.as_pointer())


def _splat(builder, value, vector):
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, vector.count), [0] * vector.count))


@intrinsic
def vzero_f32(typingctx):
    """f32x16 of zeros."""
    return f32x16(), lambda context, builder, sig, args: ir.Constant(_VF32, [0.0] * LANES)


@intrinsic
def vzero_i32(typingctx):
    """i32x16 of zeros."""
    return i32x16(), lambda context, builder, sig, args: ir.Constant(_VI32, [0] * LANES)


@intrinsic
def _vload_f32(typingctx, x, i):
    _need_array("vload_f32", x, types.float32)
    _need_int("vload_f32", "i", i)

    def codegen(context, builder, sig, args):
        return builder.load(_address(context, builder, sig.args[0], args[0], args[1], _VF32), align=4)
    return f32x16(x, i), codegen


@intrinsic
def vfma_bcast(typingctx, acc, b, s):
    """acc + b * s, lane by lane, with one rounding (a fused multiply-add); s a float scalar (a float64
    is rounded to float32 first)."""
    if acc != f32x16 or b != f32x16 or not isinstance(s, types.Float):
        raise TypingError(f"vfma_bcast(acc, b, s): acc and b f32x16, s a float, got {acc}, {b}, {s}")

    def codegen(context, builder, sig, args):
        acc_v, b_v, s_v = args
        s_v = context.cast(builder, s_v, sig.args[2], types.float32)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF32, [_VF32] * 3), "llvm.fma.v16f32")
        return builder.call(fma, [b_v, _splat(builder, s_v, _VF32), acc_v])
    return f32x16(acc, b, s), codegen


@intrinsic
def _vstore_add_f32(typingctx, acc, y, i):
    _need_array("vstore_add_f32", y, types.float32)
    _need_int("vstore_add_f32", "i", i)

    def codegen(context, builder, sig, args):
        p = _address(context, builder, sig.args[1], args[1], args[2], _VF32)
        builder.store(builder.fadd(builder.load(p, align=4), args[0]), p, align=4)
        return context.get_dummy_value()
    return types.none(acc, y, i), codegen


def _pair_products(builder, a16, b16):
    """<16 x i32>: a16[2l]*b16[2l] + a16[2l+1]*b16[2l+1] for <32 x i16> a16, b16 (int32 sums)."""
    flavour = madd_flavour()
    if flavour == "avx512":
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI32, [_VI16, _VI16]),
                                           "llvm.x86.avx512.pmaddw.d.512")
        return builder.call(f, [a16, b16])
    if flavour == "avx2":
        half16, half32 = ir.VectorType(_I16, LANES), ir.VectorType(_I32, LANES // 2)
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(half32, [half16, half16]),
                                           "llvm.x86.avx2.pmadd.wd")
        lo, hi = ir.Constant(ir.VectorType(_I32, LANES), list(range(LANES))), \
            ir.Constant(ir.VectorType(_I32, LANES), list(range(LANES, 2 * LANES)))
        parts = [builder.call(f, [builder.shuffle_vector(a16, a16, ix), builder.shuffle_vector(b16, b16, ix)])
                 for ix in (lo, hi)]
        return builder.shuffle_vector(parts[0], parts[1], ir.Constant(_VI32, list(range(LANES))))
    even = ir.Constant(_VI32, list(range(0, 2 * LANES, 2)))
    odd = ir.Constant(_VI32, list(range(1, 2 * LANES, 2)))
    ext = [builder.sext(builder.shuffle_vector(v, v, ix), _VI32) for v in (a16, b16) for ix in (even, odd)]
    return builder.add(builder.mul(ext[0], ext[2]), builder.mul(ext[1], ext[3]))


@intrinsic
def _vmadd_pairs(typingctx, acc, w, p, i):
    _need_array("vmadd_pairs", p, types.int16)
    _need_int("vmadd_pairs", "i", i)
    if acc != i32x16 or not isinstance(w, types.Integer):
        raise TypingError(f"vmadd_pairs(acc, w, p, i): acc an i32x16, w an int32 word, got {acc}, {w}")

    def codegen(context, builder, sig, args):
        acc_v, w_v, p_v, i_v = args
        if w_v.type.width > 32:
            w_v = builder.trunc(w_v, _I32)
        elif w_v.type.width < 32:
            w_v = builder.sext(w_v, _I32)
        a16 = builder.bitcast(_splat(builder, w_v, _VI32), _VI16)  # the pair (lo, hi) in every lane
        b16 = builder.load(_address(context, builder, sig.args[2], p_v, i_v, _VI16), align=2)
        return builder.add(acc_v, _pair_products(builder, a16, b16))
    return i32x16(acc, w, p, i), codegen


def target_features() -> set[str]:
    """The CPU features Numba compiles for (NUMBA_CPU_FEATURES where set, else this CPU's), as LLVM names
    them: 'avx2', 'fma', 'avx512f', 'avx512vnni', 'neon', ..."""
    flat = numba.config.CPU_FEATURES if numba.config.CPU_FEATURES is not None else \
        llvm_binding.get_host_cpu_features().flatten()
    return {f[1:] for f in flat.split(",") if f.startswith("+")}


def vector_target() -> dict:
    """The vector registers of the CPU Numba compiles for, as a micro-kernel sees them: {'isa': 'avx512' |
    'avx2' | 'avx' | 'sse' | 'neon', 'registers': how many, 'per_vector': registers one f32x16 takes,
    'broadcast_registers': registers an FMA needs for the broadcast scalars of A beside its operands}."""
    key = (numba.config.CPU_NAME, numba.config.CPU_FEATURES)
    if key not in _TARGETS:
        _TARGETS[key] = _vector_target()
    return dict(_TARGETS[key])


_TARGETS: dict = {}


def _vector_target() -> dict:
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):  # 32 q registers; A's scalars come in a q register
        return {"isa": "neon", "registers": 32, "per_vector": 4, "broadcast_registers": 2}
    feats = target_features()
    if "avx512f" in feats:  # 32 zmm; vbroadcastss into a register when a scalar feeds two FMAs
        return {"isa": "avx512", "registers": 32, "per_vector": 1, "broadcast_registers": 1}
    if "avx" in feats:  # 16 ymm; vbroadcastss into a register
        return {"isa": "avx2" if {"avx2", "fma"} <= feats else "avx", "registers": 16, "per_vector": 2,
                "broadcast_registers": 1}
    return {"isa": "sse", "registers": 16, "per_vector": 4, "broadcast_registers": 1}


def u8s8_flavour() -> str:
    """How vdot_u8s8 is compiled here: 'avx512vnni', 'avxvnni' or 'generic' (MINITORCH_U8S8 overrides)."""
    forced = os.environ.get("MINITORCH_U8S8", "")
    if forced:
        if forced not in ("avx512vnni", "avxvnni", "generic"):
            raise ValueError(f"MINITORCH_U8S8 must be avx512vnni, avxvnni or generic, got {forced!r}")
        return forced
    if numba.config.CPU_NAME:  # Numba compiles for another CPU: no host-only instructions
        return "generic"
    features = llvm_binding.get_host_cpu_features()
    if features.get("avx512vnni", False) and features.get("avx512f", False):
        return "avx512vnni"
    return "avxvnni" if features.get("avxvnni", False) else "generic"


_VI8 = ir.VectorType(ir.IntType(8), 4 * LANES)


def _u8s8_dot(builder, a32, b32):
    """<16 x i32>: sum over t < 4 of u8(byte t of a32[l]) * s8(byte t of b32[l]), for <16 x i32> a32, b32."""
    flavour = u8s8_flavour()
    if flavour == "avx512vnni":
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI32, [_VI32] * 3),
                                           "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(f, [ir.Constant(_VI32, [0] * LANES), a32, b32])
    if flavour == "avxvnni":
        half = ir.VectorType(_I32, LANES // 2)
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(half, [half] * 3),
                                           "llvm.x86.avx512.vpdpbusd.256")
        parts = []
        for ix in (list(range(LANES // 2)), list(range(LANES // 2, LANES))):
            pick = ir.Constant(ir.VectorType(_I32, LANES // 2), ix)
            parts.append(builder.call(f, [ir.Constant(half, [0] * (LANES // 2)),
                                          builder.shuffle_vector(a32, a32, pick), builder.shuffle_vector(b32, b32, pick)]))
        return builder.shuffle_vector(parts[0], parts[1], ir.Constant(_VI32, list(range(LANES))))
    wide = ir.VectorType(_I32, 4 * LANES)
    prod = builder.mul(builder.zext(builder.bitcast(a32, _VI8), wide), builder.sext(builder.bitcast(b32, _VI8), wide))
    quarters = [builder.shuffle_vector(prod, prod, ir.Constant(_VI32, [4 * l + t for l in range(LANES)])) for t in range(4)]
    return builder.add(builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3]))


@intrinsic
def _vdot_u8s8(typingctx, acc, w, p, i):
    _need_array("vdot_u8s8", p, types.int32)
    _need_int("vdot_u8s8", "i", i)
    if acc != i32x16 or not isinstance(w, types.Integer):
        raise TypingError(f"vdot_u8s8(acc, w, p, i): acc an i32x16, w an int32 word, got {acc}, {w}")

    def codegen(context, builder, sig, args):
        acc_v, w_v, p_v, i_v = args
        if w_v.type.width > 32:
            w_v = builder.trunc(w_v, _I32)
        elif w_v.type.width < 32:
            w_v = builder.zext(w_v, _I32)
        a32 = _splat(builder, w_v, _VI32)  # the four uint8 of A in every lane
        b32 = builder.load(_address(context, builder, sig.args[2], p_v, i_v, _VI32), align=4)
        if u8s8_flavour() == "avx512vnni":  # the add is the instruction's own: acc as its first operand
            f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI32, [_VI32] * 3),
                                               "llvm.x86.avx512.vpdpbusd.512")
            return builder.call(f, [acc_v, a32, b32])
        return builder.add(acc_v, _u8s8_dot(builder, a32, b32))
    return i32x16(acc, w, p, i), codegen


@intrinsic
def _vstore_add_i32(typingctx, acc, y, i):
    _need_array("vstore_add_i32", y, types.int32)
    _need_int("vstore_add_i32", "i", i)

    def codegen(context, builder, sig, args):
        p = _address(context, builder, sig.args[1], args[1], args[2], _VI32)
        builder.store(builder.add(builder.load(p, align=4), args[0]), p, align=4)
        return context.get_dummy_value()
    return types.none(acc, y, i), codegen


@njit
def vload_f32(x, i):
    """f32x16 of x[i:i+16] (x 1-D C-contiguous float32)."""
    if i < 0 or i > x.size - LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vload_f32: vector lanes outside the array (first index, lanes, array size):", i,
                             LANES, x.size)
        raise IndexError("vload_f32: vector lanes outside the array")
    return _vload_f32(x, i)


@njit
def vstore_add_f32(acc, y, i):
    """y[i:i+16] += acc (y 1-D C-contiguous float32)."""
    if i < 0 or i > y.size - LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vstore_add_f32: vector lanes outside the array (first index, lanes, array size):", i,
                             LANES, y.size)
        raise IndexError("vstore_add_f32: vector lanes outside the array")
    _vstore_add_f32(acc, y, i)


@njit
def vmadd_pairs(acc, w, p, i):
    """acc[l] + a0*p[i+2l] + a1*p[i+2l+1] for l < 16, in int32: w is an int32 word holding two int16
    (a0 in its low half, a1 in its high half: int16 array [a0, a1] viewed as int32), p a 1-D
    C-contiguous int16 array holding 16 pairs from index i. One `vpmaddwd` on AVX-512, two on AVX2."""
    if i < 0 or i > p.size - 2 * LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vmadd_pairs: vector lanes outside the array (first index, lanes, array size):", i,
                             2 * LANES, p.size)
        raise IndexError("vmadd_pairs: vector lanes outside the array")
    return _vmadd_pairs(acc, w, p, i)


@njit
def vdot_u8s8(acc, w, p, i):
    """acc[l] + sum over t < 4 of u8(byte t of w) * s8(byte t of p[i + l]) for l < 16, in int32 (wrapping
    modulo 2**32, as the instruction does): w an int32 word holding four uint8 of A (little-endian: byte t
    is the t-th), broadcast to every lane; p a 1-D C-contiguous int32 array whose words each hold four
    int8 of B, 16 words from index i. One `vpdpbusd` on AVX-512 VNNI, two on AVX-VNNI."""
    if i < 0 or i > p.size - LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vdot_u8s8: vector lanes outside the array (first index, lanes, array size):", i,
                             LANES, p.size)
        raise IndexError("vdot_u8s8: vector lanes outside the array")
    return _vdot_u8s8(acc, w, p, i)


@njit
def vstore_add_i32(acc, y, i):
    """y[i:i+16] += acc (y 1-D C-contiguous int32)."""
    if i < 0 or i > y.size - LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vstore_add_i32: vector lanes outside the array (first index, lanes, array size):", i,
                             LANES, y.size)
        raise IndexError("vstore_add_i32: vector lanes outside the array")
    _vstore_add_i32(acc, y, i)

# %% [markdown]
# ### The shape of the block, from the machine
#
# How large should the block be? Three constraints decide it (Low et al. 2016 derive BLIS's shapes
# from the same quantities; [simd](../hardware_notes/simd.md#fma-and-peak-flops) has the hardware):
#
# 1. **Enough FMAs in flight.** Each accumulator is a chain of dependent FMAs, one step per FMA
#    latency L. With P FMA pipes the kernel needs at least L x P independent accumulators (counted
#    in native registers: MR x NV x the registers one `f32x16` takes). Lesson 04's FMA loop
#    measures L x P directly, as its best rate over its one-accumulator rate; the cell after the
#    exercises prints it. The vendors' figures: 2 pipes x 4 cycles on Intel's Skylake-SP to
#    Sapphire Rapids and on AMD's Zen 3 and Zen 4, 2 x 5 on Haswell, 4 x 4 on Apple's M1
#    (Intel's and AMD's optimisation manuals; Agner Fog's instruction tables).
# 2. **Registers.** The accumulators, the NV vectors of B and the registers that hold broadcast
#    scalars of A must fit the register file: (MR x NV + NV) x per_vector + broadcast <= registers,
#    with 32 `zmm` (one per `f32x16`) on AVX-512, 16 `ymm` (two per `f32x16`) on AVX2, 32 `q`
#    (four) on NEON. A shape that does not fit *spills*: accumulators go to the stack, a load and a
#    store per FMA.
# 3. **Loads.** Per k the kernel loads NV x per_vector vectors of B and MR scalars of A (a
#    broadcast from memory is a load too) for MR x NV x per_vector FMAs. A core with two FMA pipes
#    has two or three load ports: it keeps its FMAs busy only if the kernel has no more loads than
#    FMAs.
#
# Among the shapes that satisfy all three, take the one with the **most accumulators**: each
# scalar of A then feeds NV vectors and each vector of B feeds MR rows, so the larger the block,
# the less the kernel asks of the caches per FLOP. (A tie goes to the fewer loads per k, then to
# the smaller NV.) The rule gives:
#
# | ISA | registers | per `f32x16` | broadcast registers | block MR x NR | registers used |
# |---|---|---|---|---|---|
# | AVX-512 | 32 `zmm` | 1 | 1 | 14 x 32 (NV = 2) | 28 + 2 + 1 = 31 |
# | AVX2 | 16 `ymm` | 2 | 1 | 6 x 16 (NV = 1) | 12 + 2 + 1 = 15 |
# | NEON | 32 `q` | 4 | 2 | 6 x 16 (NV = 1) | 24 + 4 + 2 = 30 |
#
# On AVX-512 one vector of B per row is ruled out by constraint 3 (MR + 1 loads for MR FMAs),
# and 15 x 32 needs 33 registers. 6 x 16 is BLIS's Haswell kernel; on AVX-512 it keeps 6
# FMAs in flight, fewer than 2 x 4: at most 3/4 of the peak, whatever else is right. BLIS's
# Skylake-X kernels keep 24 and 28 `zmm` accumulators for the same reasons: its float32 kernel is
# 32 x 12 in BLIS's column-major terms (12 x 32 in ours), its float64 kernel 16 x 14 (two `zmm` of
# 8 doubles by 14 rows: our 14 x 2 vectors).
#
# **Exercise 6.6: the kernel for any shape.** Numba has no array of registers: each accumulator
# must be a variable of its own, 28 of them for 14 x 32. So we write a *generator*: a function
# that returns the kernel's source text for a given MR and NV, which `make_blis_kernel(mr, nv)`
# (given) compiles with Numba. (BLIS and OpenBLAS write one kernel per machine by hand, in assembly;
# tensor compilers such as TVM generate theirs.) For MR = 2 and NV = 1 the source is:
#
# ```python
# def blis_kernel_2x1(ap, bp, c, co, ldc):
#     c0_0 = vzero_f32()
#     c1_0 = vzero_f32()
#     for k in range(bp.size // 16):
#         b0 = vload_f32(bp, 16 * k)
#         a = ap[2 * k + 0]
#         c0_0 = vfma_bcast(c0_0, b0, a)
#         a = ap[2 * k + 1]
#         c1_0 = vfma_bcast(c1_0, b0, a)
#     vstore_add_f32(c0_0, c, co + 0 * ldc + 0)
#     vstore_add_f32(c1_0, c, co + 1 * ldc + 0)
# ```
#
# Write `blis_kernel_source(mr, nv)`: the source of `blis_kernel_{mr}x{nv}(ap, bp, c, co, ldc)`
# for any `mr >= 1` and `nv >= 1`, NR = 16 nv. `ap` is one packed panel of A (`kc * mr` float32:
# `ap[mr * k + r]` is A[row r of the panel, k]), `bp` one packed panel of B (`kc * NR` float32:
# `bp[NR * k + j]` is B[k, column j of the panel]), `kc = bp.size // NR`; `c` is C flattened (1-D
# float32), `co` the index of the block's top-left element and `ldc` the length of C's rows. The
# kernel adds the MR x NR block `ap-panel @ bp-panel` into `c[co + r * ldc + j]` (r < MR, j < NR)
# with MR x NV `f32x16` accumulators, NV `vload_f32` of B and MR x NV `vfma_bcast` per k, and
# MR x NV `vstore_add_f32` after the loop. The tests compile shapes from 1 x 16 to this machine's,
# check the values (into a C that is not zero, with `kc` from 0 up) and read the machine code:
# MR x NV accumulators in the loop (one `zmm`, two `ymm` or four NEON registers each), broadcast
# scalars of A, and no store in the loop (neither of C nor of a spilled register), and run
# `matmul_blis` (given, below) with your kernels; its check cell follows that code.

# %%
#| export
#| exercise 6.6
from minitorch.simd import vfma_bcast, vload_f32, vstore_add_f32, vzero_f32  # noqa: E402


def blis_kernel_source(mr: int, nv: int) -> str:
    """Python source of `def blis_kernel_{mr}x{nv}(ap, bp, c, co, ldc):`, the MR x (16 NV) outer-product
    micro-kernel: c[co + r*ldc + j] += sum_k ap[mr*k + r] * bp[16*nv*k + j] for r < mr, j < 16 nv,
    k < bp.size // (16 nv), with mr * nv f32x16 accumulators (minitorch.simd's operations)."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %%
#| export
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

# %% [markdown]
# **Exercise 6.7: the shape rule.** Write `blis_shape(registers, per_vector, broadcast_registers,
# in_flight)`: the (MR, NV) the three constraints above pick, for a vector unit with `registers`
# vector registers of which one `f32x16` takes `per_vector`, `broadcast_registers` more for the
# broadcast scalars of A, and `in_flight` = FMA latency x pipes (native vector FMAs). Of the
# shapes with MR >= 1 and NV >= 1 that satisfy
#
# 1. `MR * NV * per_vector >= in_flight`,
# 2. `(MR * NV + NV) * per_vector + broadcast_registers <= registers`,
# 3. `MR + NV * per_vector <= MR * NV * per_vector`,
#
# return the one with the largest `MR * NV`; a tie goes to the smaller `MR + NV * per_vector`,
# then to the smaller NV. Raise a ValueError naming the arguments if no shape satisfies them
# (16 registers of four lanes cannot keep 10 FMAs in flight). `matmul_blis` calls it with
# `vector_target()` (given in `minitorch.simd`: this CPU's registers) and the vendors' latency x
# pipes for the ISA (`IN_FLIGHT`, given).

# %%
#| export
#| exercise 6.7
def blis_shape(registers: int, per_vector: int, broadcast_registers: int, in_flight: int) -> tuple[int, int]:
    """(MR, NV) of the micro-kernel: the shape with the most accumulators MR*NV among those that keep
    in_flight FMAs going, fit the registers and need no more loads than FMAs (see the lesson); ties to
    fewer loads per k (MR + NV*per_vector), then to the smaller NV. ValueError if there is none."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("6.7")

# %% [markdown]
# **Blocking from the caches** (given, `blis_blocking`, from lesson 05's `machine_cache_sizes`).
# The loops around the kernel (Goto's, in BLIS's order, the kernel innermost) decide which panel
# each cache level holds:
#
# ```
# for pc in range(0, K, KC):                  # KC of k:
#     for ic in prange(threads' rows):        #   each thread: pack_a_block(its rows of A[:, pc:pc+KC]), once
#     for jc in range(0, N, NC):              #   a block of NC columns of B: pack_b_block (all threads), kept in L2
#         for ic in prange(threads' rows):    #     each thread, its packed rows of A:
#             for ir in range(MC / MR):       #       one A micro-panel (MR x KC), kept in L1 ...
#                 for jr in range(NC / NR):   #       ... against every B micro-panel (KC x NR), from L2
#                     kernel(A panel ir, B panel jr, C, offset of C[ic + MR ir, jc + NR jr], ldc)
# ```
#
# The A micro-panel is reused by all NC / NR micro-panels of B, and its MR scalars per k are
# broadcast by MR loads, so it should stay in L1: KC is the longest multiple of 16 (up to 1024) for
# which it fills at most half of L1, leaving the other half to the B panels streaming through and
# to C. The B block is reused by every A micro-panel, so it should stay in L2: NC is the largest
# multiple of NR for which it fills at most half of L2. BLIS's own blocking for Skylake-X follows
# the same reasoning (its `bli_cntx_init_skx.c`: KC = 384, in its column-major terms the
# broadcast micro-panel 18 KiB in L1 and a 720 KiB block in L2). Threads split the rows of A
# (section 5's reasoning: each writes its own rows of C), each packing its own rows into blocks of
# at most MC rows. Packing copies each operand into the order the kernel reads it (consecutive
# addresses, zeros past the edges of A and B), and into a buffer that starts a cache line
# (`aligned_empty`): NumPy aligns arrays to 16 bytes and Numba to 32, and a 64-byte `vload_f32` from
# such a buffer straddles two lines, which costs the cache two accesses for one load (measured
# below, after KC). A's panels are read from memory once per B block
# anyway (each A micro-panel is used for one sweep of the B block), so A is packed once per KC,
# all N columns of C served from the same packed rows, instead of once per (NC, KC) block as in
# BLIS's order of the loops: at n = 2048 with NC = 576 that is one pass over A instead of four,
# about a tenth of the product's time on one core. When KC or NC does not divide K or N, the
# blocks are made even (`even_block`: K = 1024 with KC at most 432 is three blocks of 342, not
# 432, 432 and 160, whose short kernel calls would pay C's loads and stores three times as
# often). The blocks at the bottom and right edges of C, where M or N is not a multiple of the
# kernel's block, are
# computed into a small buffer and added from there, so C itself needs no padding. `matmul_blis`
# takes C from `np.empty`, not `np.zeros`: in the first block of k, each block of C is zeroed just
# before the kernel adds into it (`gemm_blis(..., accumulate=False)`), while its lines come into L1
# for the kernel anyway, instead of in a pass of its own over all of C beforehand. (BLIS's
# micro-kernels go one step further when asked for C = AB, BLAS's `beta = 0`: they store C's block
# without loading it.)

# %%
#| export
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

# %% [markdown]
# Exercise 6.6's check comes here, after the given loops around the kernel: its tests also run the
# whole product, `matmul_blis`, with kernels your generator writes.

# %% tags=["check"]
check("6.6")

# %% [markdown]
# The rule on this machine: Numba's vector registers here (`vector_target()`), FMA latency x pipes
# as lesson 04's FMA loop measures it (its best rate over its one-accumulator rate) beside the
# vendors' figure the lesson's kernel is shaped with (`IN_FLIGHT`), the shape and the blocking that
# follow, and the shapes of the other ISAs' register files.
#
# On the course's development machine (an Intel Xeon with AVX-512 under KVM, 2 vCPUs, 48 KiB of
# L1d and 2 MiB of L2 per core; nearly idle, load average 0.6) the same code printed: Numba compiles
# for `avx512` (32 registers, one per `f32x16`, one for the broadcast); the FMA loop ran at 29.7
# GFLOP/s with one accumulator and 223 with 16, 7.5 FMAs in flight (8.0 in lesson 04's sweep)
# against the 8 of `IN_FLIGHT`; both give `blis_shape(32, 1, 1, 8) = (14, 2)`, a 14 x 32 kernel,
# and the caches give KC = 432, NC = 576 and MC at most 1204. AVX2's register file gives 6 x 16,
# NEON's 6 x 16.

# %% tags=["demo"]
from minitorch.bench import blas_line, blas_matmul_gflops, fma_roof, measure_fma, vector_isa
from minitorch.simd import vector_target

print(load_report())
target = vector_target()
widest = max(vector_isa()["widths"].values())
one_chain = measure_fma(widest, 1)
many_chains = measure_fma(widest, 16 if vector_isa()["registers"] >= 32 else 12)
measured_in_flight = many_chains / one_chain
print(f"Numba compiles for: {target}")
print(f"FMA loop, {widest} lanes, one core: {one_chain / 1e9:.1f} GFLOP/s with one accumulator, {many_chains / 1e9:.1f} "
      f"with many: {measured_in_flight:.1f} FMAs in flight (IN_FLIGHT for {target['isa']}: {IN_FLIGHT[target['isa']]})")
for in_flight in sorted({max(1, round(measured_in_flight)), IN_FLIGHT[target["isa"]]}):
    shape_ = blis_shape(target["registers"], target["per_vector"], target["broadcast_registers"], in_flight)
    print(f"  blis_shape({target['registers']}, {target['per_vector']}, {target['broadcast_registers']}, {in_flight}) "
          f"= {shape_}: {shape_[0]} x {16 * shape_[1]}")
mr_here, nv_here = machine_shape()
mc_here, kc_here, nc_here = machine_blocking(mr_here, 16 * nv_here)
print(f"this machine's kernel: {mr_here} x {16 * nv_here}; blocking from the caches {machine_cache_sizes()}: "
      f"KC = {kc_here}, NC = {nc_here}, MC at most {mc_here}")
for name, args in (("AVX-512", (32, 1, 1, 8)), ("AVX2", (16, 2, 1, 10)), ("NEON", (32, 4, 2, 16))):
    print(f"  {name:8s} blis_shape{args} = {blis_shape(*args)}")

# %% [markdown]
# The kernel's loop as this machine runs it, then kernels of several shapes from L1 (panels of KC
# that fit in L1 together, `blis_peak`) on one core and on all of them, each as a fraction of the
# FMA roof measured by lesson 04's loop on as many threads. A shape with too few accumulators stays
# below the roof by about the ratio of its accumulators to latency x pipes; one that does not fit
# the registers spills (the listing counts the stack accesses in its loop).
#
# Two repetitions of these measurements on that machine (the same quiet spell), as fractions of the
# FMA roof (225 GFLOP/s on one core, 437-442 on two), one core / both cores: 6 x 16 at 68-69% /
# 67-71% (6 accumulators of the 8 needed: at most 75%), 8 x 16 at 69-76% / 73-78%, 12 x 32 at
# 87-93% / 82-85%, 14 x 32 at 85-95% / 84-96%, and 15 x 32 (30 accumulators and 2 B vectors: 33
# registers, it spills) at 74-81% / 73-84%.

# %% tags=["demo"]
def fma_loop_of(asm):
    """The basic block of `asm` with the most packed float32 FMAs: the kernel's loop over k."""
    blocks, current = [], []
    for ln in asm.splitlines():
        s = ln.strip()
        if s.endswith(":"):
            blocks.append(current)
            current = []
        elif s and not s.startswith((".", "#", "//")):
            current.append(s)
    blocks.append(current)
    return max(blocks, key=lambda b: sum(1 for s in b if re.search(r"\bv?fm(?:add\d+ps|la)\b", s)))


def describe_loop(mr, nv):
    kernel = make_blis_kernel(mr, nv)
    nr = 16 * nv
    args = (np.zeros(mr * 32, np.float32), np.zeros(nr * 32, np.float32), np.zeros(mr * nr, np.float32), 0, nr)
    loop = fma_loop_of(asm_of(kernel, *args))
    fmas = [s for s in loop if re.search(r"\bv?fm(?:add\d+ps|la)\b", s)]
    stack = [s for s in loop if re.search(r"\(%rsp\)|\[sp", s)]
    return loop, fmas, stack


loop, fmas, stack = describe_loop(mr_here, nv_here)
print(f"{mr_here} x {16 * nv_here} kernel: {len(fmas)} packed FMAs in its loop, {len(stack)} stack accesses; the loop:")
print("\n".join("  " + s for s in loop[:12] + ["..."] + loop[-6:]))

threads = numba.get_num_threads()
shapes = [(6, 1), (mr_here, nv_here)] if SMALL else sorted({(6, 1), (8, 1), (12, 2), (mr_here, nv_here), (mr_here + 1, nv_here)})
roof = {t: fma_roof(t) / 1e9 for t in sorted({1, threads})}
print(load_report())
print(f"FMA roof (lesson 04's loop): " + ", ".join(f"{g:.0f} GFLOP/s on {t} thread{'s' * (t > 1)}" for t, g in roof.items()))
kernel_rates = {}
for mr_, nv_ in shapes:
    _, f_, st_ = describe_loop(mr_, nv_)
    rates = {t: blis_peak(t, (mr_, nv_), calls=300 if SMALL else 3000) for t in roof}
    kernel_rates[(mr_, nv_)] = rates
    print(f"{mr_:2d} x {16 * nv_:2d} ({mr_ * nv_:2d} accumulators, {len(st_)} stack accesses in the loop): " +
          "   ".join(f"{t} thread{'s' * (t > 1)} {g:6.1f} GFLOP/s = {g / roof[t]:4.0%} of the roof" for t, g in rates.items()))

# %% [markdown]
# KC, the length of each kernel call, measured: the whole product at n = 1024 on all threads with
# KC from 64 up (NC and MC from the caches as above). Short calls pay the kernel's prologue and
# epilogue (C's block loaded, added and stored) more often; long ones push the A micro-panel out
# of L1.

# %% tags=["demo"]
n_kc = 256 if SMALL else 1024
a_kc = rng.standard_normal((n_kc, n_kc)).astype(np.float32)
b_kc = rng.standard_normal((n_kc, n_kc)).astype(np.float32)
kernel_here = make_blis_kernel(mr_here, nv_here)


def blis_with_kc(kc):
    gemm_blis(a_kc, b_kc, np.zeros((n_kc, n_kc), np.float32), kernel_here, mr_here, 16 * nv_here,
              block_rows(n_kc, mr_here, mc_here, threads), kc, nc_here)


for kc in sorted({64, 128, kc_here} if SMALL else {64, 128, 256, kc_here, 2 * kc_here, 1024}):
    t = benchmark(blis_with_kc, kc, warmup=1, repeat=3).min
    print(f"n = {n_kc}, KC = {kc:4d}{' (from the caches)' if kc == kc_here else ''}: "
          f"{2 * n_kc**3 / t / 1e9:6.1f} GFLOP/s ({threads} threads)")

# %% [markdown]
# Where B's panels start. The kernel loads B 64 bytes at a time; `gemm_blis` packs B into a buffer
# that starts a cache line (`aligned_empty`), and each panel is a whole number of lines. Here the
# whole product at n = 1024 (256 in the quick run) on all threads with B's buffer on a line and 16
# or 32 bytes past one (`b_offset`, in items: where NumPy's 16-byte and Numba's 32-byte alignment
# may leave it), in turns. From L1 a core can absorb a load's second access (the kernel issues 16
# loads per 28 FMAs, and the core has load ports to spare); with B's panels arriving from L2, a load
# across two lines waits for both.

# %% tags=["demo"]
def blis_b_offset(b_offset):
    gemm_blis(a_kc, b_kc, np.empty((n_kc, n_kc), np.float32), kernel_here, mr_here, 16 * nv_here,
              block_rows(n_kc, mr_here, mc_here, threads), even_block(n_kc, kc_here), even_block(n_kc, nc_here, 16 * nv_here),
              False, b_offset)


offset_times = best_apart({f"{4 * items:2d} bytes": (lambda o=items: blis_b_offset(o)) for items in (0, 4, 8)})
print(load_report())
on_line = offset_times[" 0 bytes"]
for where, t in offset_times.items():
    print(f"n = {n_kc}, {threads} threads, B {where} past a cache line: {2 * n_kc**3 / t / 1e9:6.1f} GFLOP/s "
          f"= {on_line / t:4.0%} of B on a line")

# %% [markdown]
# The whole product against NumPy's BLAS and section 5's `matmul_simd`, on all threads, the ratio
# to BLAS measured in the same run, and GFLOP/s against n with two peaks drawn: the FMA roof and
# this kernel from L1 on every thread. Our kernels take turns (`best_apart`, given), each turn
# after a pause: two thread pools share these cores, and OpenBLAS's threads keep spinning for
# about 0.1 s after each call (OpenMP's, Numba's here, for a few ms), so a kernel started at once
# runs with its cores taken. NumPy's BLAS is timed as a student's machine runs it
# (`blas_matmul_gflops`: in this process, or in a child process where the environment holds BLAS
# back), after its own pauses; the line above the table names its kernel and the CPU's ISA.
#
# `make bench L=cpu_matmul` measures the same ratios (the same kernels and BLAS timing, three
# rounds, the best of each). On the course's development machine (an Intel Xeon with AVX-512 under
# KVM, 2 vCPUs; OpenBLAS 0.3.31 on its AVX-512 "SkylakeX" kernel, as a student's machine runs it),
# four runs one after the other while the machine was nearly idle (load average 0.5-0.9) put
# `matmul_blis` at 84-92% of NumPy's BLAS at n = 256, 91-96% at 512, 90-93% at 1024 and 94-100% at
# 2048 with two threads each, and at 81-84%, 86-100%, 94-98% and 92-96% with one thread each (the
# record: `hardware_notes/measured.md`, run cpu-matmul-xeon). The first version of these loops,
# which packed A once per block of B and worked out its blocking in Python on every call, stood at
# 54%, 69%, 74% and 79% with two threads in a run on the same machine; packing B into a buffer
# that starts a cache line took n = 1024 from 84-91% (four runs before it) to 90-93%.

# %% tags=["demo"]
for (m, k, n) in [(1, 1, 1), (37, 1031, 53), (130, 17, 7), (5, 600, 211), (7, 2100, 33)]:
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32).T  # a non-contiguous view
    np.testing.assert_allclose(matmul_blis(a, b), a.astype(np.float64) @ b, rtol=1e-3, atol=1e-3 * np.sqrt(k))
print("matmul_blis matches NumPy on odd shapes;", load_report())
print(blas_line())


def gflops_apart(kernels: dict, n: int, rounds: int) -> dict:
    """GFLOP/s of each kernel on (n, n) @ (n, n) float32 (best_apart's protocol)."""
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    return {name: 2 * n**3 / t / 1e9 for name, t in best_apart(kernels, a, b, rounds=rounds).items()}


kernels = {"blis": matmul_blis, "simd": matmul_simd}
sizes = (64, 128, 256) if SMALL else (128, 256, 512, 1024, 2048)
curves = {n_: gflops_apart(kernels, n_, rounds=2 if SMALL or n_ >= 2048 else 3) for n_ in sizes}
blas_run = blas_matmul_gflops(sizes, threads=threads, rounds=2 if SMALL else 3)
for n_ in sizes:
    curves[n_]["numpy"] = blas_run["gflops"][n_]
peak = blis_peak(threads, calls=300 if SMALL else 3000)
print(f"{threads} threads (Numba and BLAS; BLAS timed in {blas_run['where']}); FMA roof {roof[threads]:.0f} GFLOP/s; "
      f"the {mr_here} x {16 * nv_here} kernel from L1 on every thread: {peak:.0f} GFLOP/s")
for n_, g in curves.items():
    print(f"n={n_:5d}: blis {g['blis']:6.1f}  simd {g['simd']:6.1f}  numpy {g['numpy']:6.1f} GFLOP/s   "
          f"blis / numpy = {g['blis'] / g['numpy']:.0%}   blis / roof = {g['blis'] / roof[threads]:.0%}")
fig, ax = plt.subplots(figsize=(7, 4))
for name in ("blis", "simd", "numpy"):
    ax.plot(sizes, [curves[n_][name] for n_ in sizes], marker="o", label=f"{name}, {threads} threads")
ax.axhline(roof[threads], color="k", ls="--", lw=1, label="FMA roof (lesson 04), all threads")
ax.axhline(peak, color="k", ls=":", lw=1, label=f"{mr_here} x {16 * nv_here} kernel from L1, all threads")
ax.set(xscale="log", xlabel="n (square, float32)", ylabel="GFLOP/s", title="the BLIS kernel against n")
ax.set_xticks(sizes, [str(x) for x in sizes])
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# What to read in those figures: the kernel from L1 runs near the FMA roof, and the whole product
# keeps most of it because packing made both operand streams consecutive and blocking kept them in
# L1 and L2; what remains between it and BLAS is packing time (paid by every call, a larger share at
# small n), the fork and join, and the traffic to C. `make bench` (benchmarks/bench_cpu_matmul.py)
# measures the same ratios at n = 256 to 2048, with targets at n = 256, 1024 and 2048.
#
# In those runs the 14 x 32 kernel from L1 ran at 93-95% of the FMA roof on one core (89-94% on
# both), and the whole product at n = 1024 and 2048 at 73-78% of it on one core, where OpenBLAS's
# reached 74-82%. Four changes outside the kernel took `matmul_blis` from about three quarters of
# OpenBLAS to nine tenths and more, each measured on its own before it went in: packing A once per
# block of k instead of once per block of B (at n = 2048 that removed three of four passes over A:
# about a tenth of the time on one core, side by side with the old loops); blocks of even size (K
# = 1024 in three blocks of 342, not 432, 432 and 160, whose short kernel calls pay C's loads and
# stores more often); and the Python around each call (the kernel's source generated, the shape
# rule and the blocking worked out) done once per shape and size instead of every call, from 68 us
# to about 20 us, which is what n = 256 needed: its whole product takes about 130 us; and B packed
# into a buffer that starts a cache line (the cell after KC's shows what 16 or 32 bytes off cost
# at n = 1024). What is left
# is the packing itself (plain scalar copies; OpenBLAS's are hand-vectorised), two fork-joins per
# block of B (its packing, then the kernels) and one per block of k, and, at n = 1024 on two
# threads, the noise of a shared machine, as large as what is left.

# %% [markdown]
# ## What you measured / what to remember
#
# Figures measured on the 2-core dev machine (AMD EPYC Zen 3 under KVM, AVX2 + FMA, 32 KiB L1d
# and 512 KiB L2 per core), float32, best of several runs while other jobs shared the machine:
#
# | what | measured |
# |---|---|
# | dot product, float32, 4096 elements (in L1), one core, timed from Python | 1.9 GFLOP/s without fast-math, 1.5 with `contract` only, 10.4 with `fastmath=True` (4 packed FMAs): mostly the ~0.5 us call, see below |
# | 4 x 16 accumulator in an `np.zeros` array, one core, L1 | about 4 GFLOP/s (scalar `vfmadd213ss`, a load and a store per FMA) |
# | micro-kernel, 12 scalar accumulators, one core, L1 | up to 72-81 GFLOP/s float32, 46 float64; plain-loop reference 30-36 and 16-19 |
# | micro-kernel from L1 on both cores at once | up to 152 GFLOP/s float32: the machine's measured FMA peak for this kernel |
# | n = 1024 float32 matmul: lesson 05 `tiled` / `ikj` | 14-22 / 25-27 GFLOP/s |
# | n = 1024 float32 `matmul_simd`, 1 thread / 2 threads | 63-68 / 105-124 GFLOP/s |
# | n = 1024 float32 NumPy (OpenBLAS, 2 threads) | 150-169 GFLOP/s |
# | best quiet run, both in the same run: `matmul_simd` / NumPy | n = 1024: 124 / 165 GFLOP/s = 75 %; n = 512: 118 / 163 = 72 %; n = 256: 66 / 127 = 52 % |
# | packing B: `np.ascontiguousarray(b.T)` / `transpose_into`, n = 1024 | 5.5 ms / about 2 ms (the threaded product itself: about 18 ms) |
# | MLP [2, 128, 128, 3], 300 Adam steps on 2048 points | same losses to 1.4e-7; NumPy backend 1.3 s, Numba backend 5.3 s (including compiling the kernels for each new operand layout) |
# | 1024 x 1024 product forward + backward through `Tensor` | NumPy backend 38 ms, Numba backend 58 ms |
#
# OpenBLAS reaches 75-85 GFLOP/s per core here (its assembly micro-kernels use 32 FLOPs per
# cycle at 2.5-2.9 GHz), our micro-kernel about 75 on one core from L1, less inside the whole
# product: the horizontal reductions after every call and the extra loads of the dot-product
# form cost the difference. Small matrices (n = 256) leave too little work per thread to hide
# packing and the fork and join. An outer-product micro-kernel with the block of C in vector
# registers (what BLAS does) is the next step; it needs explicit vector types, which Numba does
# not have, and section 8 adds them.
#
# The same lesson on the machine the dev VM later became (a 2-vCPU AMD EPYC **Zen 4** VM:
# AVX-512, 32 KiB L1d and 1 MiB L2 per core, OpenBLAS 0.3.31), in one `make demo L=06` run
# while another job held part of a core (load average 1.6-1.9). Numba compiles the same loops
# to 512-bit `zmm` instructions here (16 float32 per FMA), and the tests pass unchanged:
#
# | what | measured (Zen 4 VM, busy) |
# |---|---|
# | dot product, 1024 float32 in L1, one core, timed inside a compiled loop | 2.6 GFLOP/s without fast-math, 1.9 with `contract` only, 32 with `fastmath=True` (63 ns per call; the same call timed from Python took 590 ns, which would have read as 3.5 GFLOP/s) |
# | micro-kernel from L1, one core | 72 GFLOP/s float32, 47 float64; plain-loop reference 49 and 20 |
# | peak: micro-kernel from L1 on 1 / 2 threads at once | 87 / 138 GFLOP/s float32 (163 on 2 threads in a busier second run: peaks are noisy too) |
# | n = 1024 float32: lesson 05 `tiled`, `matmul_simd`, 1 thread each | 23, 67 GFLOP/s |
# | n = 1024 float32: `matmul_simd`, 2 threads | 54 GFLOP/s: *slower* than one thread |
# | GFLOP/s against n (64 to 2048), `matmul_simd`, 1 thread | 15, 38, 57, 70, 72, 56 |
# | the same, 2 threads | 12, 41, 59, 121, 45, 52 |
# | MLP [2, 128, 128, 3], 300 Adam steps, 2 threads | same losses to 3.7e-7; NumPy backend 11 s, Numba backend 72 s |
# | 1024 x 1024 product forward + backward through `Tensor`, 2 threads | NumPy backend 216 ms, Numba backend 335 ms |
#
# (That run's NumPy figures are left out: which OpenBLAS kernel ran was not recorded, and some
# of the course's machines held it to an older one; section 8's table below has BLAS as a
# student's machine runs it.) The one-thread figures behave like the Zen 3 ones (the kernel near
# its L1 speed from n = 512 on); the two-thread row is what a busy machine does to threads.
# Where the other job held the second core, each product waited for its slower thread, and ours
# doubled only at n = 512. The plots of section 5 show the same run, with the peak drawn; on an
# idle machine the two-thread curves sit near twice the one-thread ones, as in the Zen 3 table
# above. This is why the demo prints `load_report()` first, and why speed claims in this course
# come with the load they were measured under.
#
# Section 8's kernels on the machine the course runs on now (an Intel Xeon with AVX-512 under KVM,
# 2 vCPUs, 48 KiB L1d and 2 MiB L2 per core), from one `make bench L=cpu_matmul` run while the
# machine was nearly idle (load average 0.9; the last run of cpu-matmul-xeon in
# `hardware_notes/measured.md`), NumPy's BLAS as a student's machine runs it (OpenBLAS 0.3.31, its
# AVX-512 "SkylakeX" kernel):
#
# | what | measured (Xeon VM, quiet), 1 thread / 2 threads |
# |---|---|
# | FMA roof (lesson 04's loop, 512-bit) | 245 / 486 GFLOP/s |
# | the 14 x 32 BLIS kernel from L1 | 232 / 434 GFLOP/s (95 / 89 % of the roof) |
# | section 3's 4 x 3 `micro_kernel` from L1 | 104 / 176 GFLOP/s (43 / 36 %) |
# | `matmul_blis`, n = 256 / 512 / 1024 / 2048, 1 thread | 160 / 173 / 182 / 188 GFLOP/s |
# | NumPy (OpenBLAS), the same, same run | 194 / 191 / 190 / 196 GFLOP/s: `matmul_blis` at 83 / 90 / 96 / 96 % of it |
# | `matmul_blis`, the same n, 2 threads | 245 / 303 / 354 / 374 GFLOP/s |
# | NumPy (OpenBLAS), 2 threads, same run | 269 / 334 / 380 / 372 GFLOP/s: `matmul_blis` at 91 / 91 / 93 / 100 % of it |
# | `matmul_simd`, the same n, 1 / 2 threads | 74 / 82 / 80 / 77 and 126 / 157 / 157 / 139 GFLOP/s |
#
# The kernel is within about 10 % of the roof, and the whole product within 10 % of OpenBLAS's
# from n = 512 on (section 8 says what closed the gap and what is left).
#
# - **Read the machine code.** Whether a loop is vectorised is a fact you can check in a
#   second: `vfmadd231ps %ymm...` is 8 float32 FMAs, `vfmadd231ss` is one.
# - **The compiler needs three permissions**: contiguous accesses it can prove in range,
#   no possible aliasing between what it loads and what it stores, and (for reductions)
#   leave to reassociate (`fastmath`). Without reassociation a dot product is a chain of
#   dependent additions, one per FMA latency.
# - **Register blocking** turns a load-bound loop into an FMA-bound one: an MR x NR block
#   needs MR + NR loads per MR * NR FMAs. The register file (16 `ymm` on AVX2, 32 `zmm` on
#   AVX-512, 32 NEON registers) sets MR and NR. In Numba, scalar locals are what ends up in
#   registers; a small NumPy array stays in memory.
# - **Packing and blocking** put each operand in the cache level its reuse needs: in section 5
#   the micro panel of A in L1 and the block of B in L2; in section 8 the same, with KC and NC read
#   from this machine's cache sizes. The packing copy must itself be cache-friendly: a
#   naive transposed copy cost a quarter of the whole product.
# - **The kernel's shape comes from the machine**: enough accumulators for FMA latency x pipes,
#   all of them and the B vectors in the register file, no more loads than FMAs (14 x 32 on
#   AVX-512, 6 x 16 on AVX2 and NEON). A 6 x 16 kernel on AVX-512 stays near 3/4 of the roof.
# - **Explicit vectors** let you write the kernel BLAS libraries write: an outer product with
#   the block of C in vector registers, one broadcast of A per FMA, nothing to reduce. Where the
#   language has no vector type, a few lines of LLVM IR give it one (`minitorch.simd`), the way C
#   has intrinsics.
# - **Threads** over independent row panels scale with the cores, provided the machine is not
#   shared: a parallel loop runs at the pace of its slowest thread.
# - **A backend is one method**: lesson 02 computes matmul's gradients with the backend's
#   matmul, so the kernel trains networks without any change to lessons 01-03.
#
# ## Sources
#
# - K. Goto, R. A. van de Geijn, "Anatomy of High-Performance Matrix Multiplication", ACM TOMS
#   34(3), 2008. https://doi.org/10.1145/1356052.1356053
# - F. G. Van Zee, R. A. van de Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS
#   Functionality", ACM TOMS 41(3), 2015. https://doi.org/10.1145/2764454 ; and
#   T. M. Low et al., "Analytical Modeling Is Enough for High-Performance BLIS", ACM TOMS 43(2),
#   2016. https://doi.org/10.1145/2925987
# - Intel, *Intel 64 and IA-32 Architectures Software Developer's Manual*, vol. 2 (VFMADD231PS
#   and friends). https://www.intel.com/content/www/us/en/developer/articles/technical/intel-sdm.html
# - Arm, *Arm Architecture Reference Manual for A-profile architecture* (FMLA, vector and SVE).
#   https://developer.arm.com/documentation/ddi0487/latest
# - A. Fog, *Instruction tables* and *The microarchitecture of Intel, AMD and VIA CPUs*.
#   https://www.agner.org/optimize/
# - AMD, *Software Optimization Guide for AMD EPYC 7003 Processors* (Zen 3), pub. 56665, 2020.
# - LLVM Project, "Auto-Vectorization in LLVM". https://llvm.org/docs/Vectorizers.html ; and
#   "Fast-Math Flags". https://llvm.org/docs/LangRef.html#fast-math-flags
# - Numba documentation, "Automatic parallelization with @jit" (prange, parallel diagnostics)
#   and "Performance tips" (fastmath). https://numba.readthedocs.io/en/stable/user/parallel.html
# - Numba documentation, "High-level extension API" (`@intrinsic`, `register_model`): how
#   `minitorch.simd` adds its vector types. https://numba.readthedocs.io/en/stable/extending/high-level.html
# - LLVM Language Reference: vector types and the `llvm.fma.*` intrinsic.
#   https://llvm.org/docs/LangRef.html#vector-type ; https://llvm.org/docs/LangRef.html#llvm-fma-intrinsic
# - The BLIS project's Haswell kernels (6 x 16 float32, broadcast A, load B).
#   https://github.com/flame/blis/tree/master/kernels/haswell/3
# - N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM, 2002, ch. 4
#   (summation).
# - S. Boehm, "Fast Multidimensional Matrix Multiplication on CPU from Scratch", 2022.
#   https://siboehm.com/articles/22/Fast-MMM-on-CPU


# %%
#| export
#| given
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


# %%
#| export simd
#| given
from minitorch.checks import validate_public  # noqa: E402

validate_public(globals(), {
})
