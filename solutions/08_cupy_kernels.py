# %% [markdown]
# # Lesson 08: CUDA kernels with CuPy
#
# Lesson 07 wrote kernels in Python. Production GPU code is CUDA C++, and CuPy lets us write it
# from Python at three levels of control:
#
# | CuPy API | you write | CuPy writes |
# |---|---|---|
# | `cp.ElementwiseKernel` | the body for one element | indexing, broadcasting, the launch |
# | `cp.ReductionKernel` | map, combine, finish expressions | the tree reduction, the launch |
# | `cp.RawKernel` | a whole `__global__` function in CUDA C | nothing: you choose grid and block |
#
# With `RawKernel` we build single-precision matrix multiply (SGEMM) three times: naive,
# shared-memory tiled (lesson 07 in CUDA C), and register-blocked, where each thread computes an
# 8x8 block of C. Then a fused, numerically stable row softmax, compared with the unfused CuPy
# expression. We compare each against cuBLAS (`cp.matmul`) and time with CUDA events. Then
# minitorch gets a `"cuda"` device whose matmul is your kernel, and lesson 03's MLP trains on it.
# The last section climbs the rest of the SGEMM ladder: vector loads, warp tiles, double
# buffering, the tensor cores and a pipeline of asynchronous copies to feed them, and tuning; and
# takes the softmax to the memory's speed (one read, vector loads, the row in registers).
#
# **Without a GPU** (a laptop, CI) everything here is still graded:
# - NVRTC, NVIDIA's runtime compiler (shipped as a pip wheel, no driver needed), compiles your
#   CUDA C to PTX, the GPU's virtual assembly. Compile errors come back with line numbers, and
#   the PTX shows structure: how many fused multiply-adds, shared-memory loads, barriers.
# - `course.cuda_c.emulate` runs a kernel on the CPU: the CUDA C is compiled with g++ against a
#   small runtime where each GPU thread is a coroutine (a *fiber*) and blocks run one at a time.
#   Every load and store is checked as it happens (the compiler instruments them, as
#   ThreadSanitizer does): an access one element past an array is reported with the argument,
#   the index, the thread and the source line; so is a `float4` load from a misaligned address
#   and an out-of-range shared-memory index. A *race*, a shared-memory word that one thread writes
#   and another reads (or writes) with no `__syncthreads()` between them, is reported with both
#   threads and both lines, the way NVIDIA's `compute-sanitizer --tool racecheck` does on a GPU.
#   Each kernel also runs twice, warps and lanes once in forward and once in reverse order, and
#   any difference in the results is reported as a race. A hang is stopped.
#
# Cells tagged `gpu` need a CUDA GPU; elsewhere they are skipped with the reason. GPU background:
# [the GPU note](../hardware_notes/gpu.md); why matmul can be compute-bound and softmax cannot:
# [the roofline note](../hardware_notes/roofline.md).

# %%
import os
import re
import time

import numpy as np

from course.check import check
from course.cuda_c import KernelError, compile_ptx, emulate, ptx_stats, run_kernel
from course.gpu import gpu_status, require_gpu

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
HAVE_GPU, GPU_REASON = gpu_status()
print("GPU:", GPU_REASON if HAVE_GPU else f"none ({GPU_REASON}); gpu cells will be skipped")

# %%
#| default_exp cupy_kernels
#| export
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

# course.cuda_c (NVRTC, the CPU emulator of CUDA C) is course machinery: the grader's checks use it too.
from course.cuda_c import check_args, emulate, kernel_params, raw_kernel
from minitorch.tensor import Backend, register_backend

if TYPE_CHECKING:  # for the type hints only: CuPy is imported on first use
    import cupy


def _cupy():
    """CuPy, imported on first use (it imports without a GPU, but nothing here needs it then)."""
    import cupy

    return cupy


def ceil_div(a: int, b: int) -> int:
    """Number of size-b pieces that cover a (the blocks of a grid)."""
    return -(-a // b)


def cuda_time_ms(fn: Callable[[], Any], repeat: int = 20, warmup: int = 3) -> float:
    """Median GPU time of fn() in milliseconds, measured with CUDA events on the current stream."""
    cp = _cupy()
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))

# %% [markdown]
# ## 1. Elementwise kernels: fusing bias + GELU
#
# A transformer MLP computes `gelu(x @ W + b)`. Written as NumPy-style expressions, the bias add
# and the GELU each read and write the whole activation: with the tanh form of GELU
# (Hendrycks and Gimpel, 2016)
#
# $$\mathrm{gelu}(v) = \tfrac12 v \left(1 + \tanh\left(\sqrt{2/\pi}\,(v + 0.044715\,v^3)\right)\right),$$
#
# CuPy launches one kernel per operator: ten for `gelu_unfused` below (the add,
# two multiplies for the cube, four more multiplies and adds, the tanh, the final two
# multiplies), each a full pass over memory. These operations do a few FLOPs per 8 bytes moved,
# so they sit far left on the roofline: time is bytes, and one kernel that reads `x` and `b`
# once and writes `y` once moves several times less.
#
# `cp.ElementwiseKernel(in_params, out_params, operation, name)` generates that kernel. The
# parameters are typed (`T x` makes `T` a type placeholder bound at call time, so one kernel
# serves float32 and float64); `operation` is C++ for one element, where each parameter name is
# that element's value (outputs are references you assign). Inputs broadcast: call it with
# `x` of shape (m, n) and `b` of shape (n,).
#
# **Exercise 8.1.** Return the `(in_params, out_params, operation)` strings of the fused kernel:
# inputs `x` and `bias` of type `T`, output `y` of type `T`, `y = gelu(x + bias)` (tanh form;
# compute `x + bias` once). Use `tanh` from CUDA's math library.

# %%
#| export
#| exercise 8.1
def bias_gelu_spec() -> tuple[str, str, str]:
    """(in_params, out_params, operation) for cp.ElementwiseKernel: y = gelu_tanh(x + bias),
    inputs `T x, T bias`, output `T y`."""
    ### BEGIN SOLUTION
    return (
        "T x, T bias",
        "T y",
        "T v = x + bias;"
        " y = (T)0.5 * v * ((T)1 + tanh((T)0.7978845608028654 * (v + (T)0.044715 * v * v * v)));",
    )
    ### END SOLUTION

# %% tags=["check"]
check("8.1")

# %% [markdown]
# The wrapper compiles the kernel once (CuPy caches it per dtype) and checks its inputs: CUDA
# itself checks nothing, so a shape or dtype mistake must be caught here.

# %%
#| export
_KERNELS: dict[Any, Any] = {}


def _check_float(x: Any, what: str, dtypes: tuple = (np.float32, np.float64)) -> None:
    """`what` is "function parameter": the error reads "function: parameter must be ..."."""
    if np.dtype(x.dtype) not in [np.dtype(d) for d in dtypes]:
        func, _, name = what.partition(" ")
        raise TypeError(f"{func}: {name} must be of dtype {' or '.join(str(np.dtype(d)) for d in dtypes)}, "
                        f"got {x.dtype}")


def bias_gelu(x: cupy.ndarray, bias: cupy.ndarray) -> cupy.ndarray:
    """gelu(x + bias) in one kernel on the GPU. x: (..., n) CuPy array, bias: (n,) same dtype."""
    cp = _cupy()
    _check_float(x, "bias_gelu x")
    if bias.shape != x.shape[-1:]:
        raise ValueError(f"bias_gelu: bias must have shape {x.shape[-1:]} for x of shape {x.shape}, got {bias.shape}")
    if bias.dtype != x.dtype:
        raise TypeError(f"bias_gelu: x is {x.dtype} but bias is {bias.dtype}")
    key = ("bias_gelu", bias_gelu_spec())
    if key not in _KERNELS:
        _KERNELS[key] = cp.ElementwiseKernel(*bias_gelu_spec(), "bias_gelu")
    return _KERNELS[key](x, bias)


def gelu_unfused(x: cupy.ndarray, bias: cupy.ndarray) -> cupy.ndarray:
    """gelu(x + bias) as CuPy expressions: one kernel and one pass over memory per operator."""
    cp = _cupy()
    v = x + bias
    return 0.5 * v * (1 + cp.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))

# %% [markdown]
# On a GPU: the fused kernel against the same formula as CuPy expressions (`gelu_unfused`).
# Each CuPy expression is its own kernel and its own pass over 4 bytes x 3 (two reads and a
# write for a binary op).

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
import cupy as cp

xg = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
bg = cp.random.standard_normal(4096, dtype=cp.float32)
assert cp.allclose(bias_gelu(xg, bg), gelu_unfused(xg, bg), atol=1e-5)
t_fused, t_unfused = cuda_time_ms(lambda: bias_gelu(xg, bg)), cuda_time_ms(lambda: gelu_unfused(xg, bg))
gb = 2 * xg.nbytes / 1e9
print(f"bias+GELU 4096x4096 float32: fused {t_fused:.3f} ms ({gb / t_fused * 1e3:.0f} GB/s effective), "
      f"unfused {t_unfused:.3f} ms: {t_unfused / t_fused:.1f}x")

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0) this cell
# printed: fused 0.093 ms (1,449 GB/s effective), unfused 0.834 ms: 9.0x.

# %% [markdown]
# ## 2. Reduction kernels: row norms
#
# A reduction turns many values into one with an associative operation. `cp.ReductionKernel`
# asks for four C expressions and writes the parallel tree for you (lesson 07, section 4):
#
# - `map_expr`: the value each input element contributes (`x * x`),
# - `reduce_expr`: how two partial results `a` and `b` combine (`a + b`),
# - `post_map_expr`: what to do with the final `a` (`y = sqrt(a)`),
# - `identity`: the neutral element every partial starts from (`0`).
#
# Associativity is the contract: the tree combines in an order you do not choose, so with
# floats the result differs from a left-to-right sum in the last bits (and is usually *more*
# accurate: pairwise summation's error grows like log n, not n).
#
# **Exercise 8.2.** Return the keyword arguments of a `cp.ReductionKernel` that computes the
# Euclidean norm along the reduced axes: `in_params="T x"`, `out_params="T y"`, and the four
# expressions above, as a dict with keys `in_params, out_params, map_expr, reduce_expr,
# post_map_expr, identity`.

# %%
#| export
#| exercise 8.2
def l2norm_spec() -> dict[str, str]:
    """Keyword arguments of cp.ReductionKernel computing y = sqrt(sum(x * x)) over the reduced axes."""
    ### BEGIN SOLUTION
    return dict(in_params="T x", out_params="T y", map_expr="x * x", reduce_expr="a + b",
                post_map_expr="y = sqrt(a)", identity="0")
    ### END SOLUTION

# %% tags=["check"]
check("8.2")

# %%
#| export
def l2norm(x: cupy.ndarray, axis: int | None = None) -> cupy.ndarray:
    """Euclidean norm of CuPy array x (float32/float64) over `axis` (all axes if None), one kernel."""
    cp = _cupy()
    _check_float(x, "l2norm x")
    if axis is not None and not -x.ndim <= axis < x.ndim:
        raise ValueError(f"l2norm: axis must be in [-{x.ndim}, {x.ndim}) for x of shape {x.shape}, got {axis}")
    key = ("l2norm", tuple(sorted(l2norm_spec().items())))
    if key not in _KERNELS:
        _KERNELS[key] = cp.ReductionKernel(name="l2norm", **l2norm_spec())
    return _KERNELS[key](x, axis=axis)

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
xr = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
assert cp.allclose(l2norm(xr, axis=1), cp.linalg.norm(xr, axis=1), rtol=1e-5)
t_red = cuda_time_ms(lambda: l2norm(xr, axis=1))
t_np = cuda_time_ms(lambda: cp.sqrt((xr * xr).sum(axis=1)))
print(f"row norms of 4096x4096: ReductionKernel {t_red:.3f} ms ({xr.nbytes / t_red / 1e6:.0f} GB/s), "
      f"sqrt((x*x).sum(1)) {t_np:.3f} ms")

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0) this cell
# printed: `ReductionKernel` 0.046 ms (1,471 GB/s), the expression 0.127 ms: 2.8x.

# %% [markdown]
# ## 3. Raw kernels: a naive SGEMM in CUDA C
#
# `cp.RawKernel(source, name)` compiles a CUDA C `__global__` function with NVRTC the first time
# it is launched; `kernel(grid, block, args)` launches it. Arguments are passed as raw bytes in
# the order of the C signature, which is why the wrappers here check each one (`course.cuda_c.
# check_args`): a Python `int` would be sent as 8 bytes to a 4-byte `int` parameter and every
# later argument would be shifted. `extern "C"` keeps the function's name unmangled so CuPy can
# find it.
#
# The C you need (CUDA C++ Programming Guide, ch. 5 and 7): `blockIdx`, `blockDim`, `threadIdx`
# are structs with `.x .y .z`; arrays arrive as flat pointers, so element (r, c) of a row-major
# (rows, cols) matrix is `p[r * cols + c]`.
#
# **Exercise 8.3.** Write the CUDA C source of
# `extern "C" __global__ void sgemm_naive(const float* A, const float* B, float* C, int M, int N, int K)`:
# C = A @ B for row-major A (M, K), B (K, N), C (M, N). One thread per element of C, launched
# by `sgemm_naive_launch` below: `threadIdx.x` and `blockIdx.x` run along the **columns** of C
# (consecutive threads of a warp then read consecutive elements of B and write consecutive
# elements of C: coalesced, lesson 07 section 7), `.y` along the rows; guard both.
# Return the source as a raw string (`r"""..."""`), so backslashes reach the compiler unchanged.

# %%
#| export
def sgemm_naive_launch(M: int, N: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) for sgemm_naive: 32x8 threads per block, x along the columns of C."""
    return (ceil_div(N, 32), ceil_div(M, 8)), (32, 8)

# %%
#| export
#| exercise 8.3
def sgemm_naive_source() -> str:
    """CUDA C source of sgemm_naive(A, B, C, M, N, K): C (M, N) = A (M, K) @ B (K, N), row-major
    float32, one thread per element of C (x along columns), guarded."""
    ### BEGIN SOLUTION
    return r"""
extern "C" __global__ void sgemm_naive(const float* A, const float* B, float* C, int M, int N, int K) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k)
        acc += A[row * K + k] * B[k * N + col];
    C[row * N + col] = acc;
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.3")

# %% [markdown]
# The same kernel, compiled to PTX by NVRTC (no GPU needed). The inner loop is two global loads
# (`ld.global.f32`) and one `fma.rn.f32`: 8 bytes per 2 FLOPs, an arithmetic intensity of 0.25
# FLOP/byte if nothing were cached. On an H100 (3.35 TB/s HBM3) that caps the kernel near
# 0.8 TFLOP/s, against 67 TFLOP/s of float32 FMA throughput: the caches rescue some of it, but
# the kernel is memory-bound by design. The fix is reuse.

# %% tags=["demo"]
ptx = compile_ptx(sgemm_naive_source())
print("\n".join(ln for ln in ptx.splitlines() if "ld.global" in ln or "fma.rn" in ln))
print(ptx_stats(ptx))

# %% [markdown]
# And run on the CPU emulator, with odd sizes (several blocks, partial blocks at both edges):

# %% tags=["demo"]
rng = np.random.default_rng(0)
A = rng.standard_normal((37, 29), dtype=np.float32)
B = rng.standard_normal((29, 45), dtype=np.float32)
C = np.full((37, 45), np.nan, dtype=np.float32)
grid, block = sgemm_naive_launch(37, 45)
emulate(sgemm_naive_source(), "sgemm_naive", grid, block, [A, B, C, np.int32(37), np.int32(45), np.int32(29)])
print(f"grid {grid}, block {block}: max |C - A@B| = {np.abs(C - A @ B).max():.2e}")

# %% [markdown]
# ## 4. Shared-memory tiling
#
# Lesson 07's tiled matmul, now in CUDA C. A 16x16 block stages a 16x16 tile of A and of B in
# `__shared__` arrays, waits at `__syncthreads()`, and each thread runs 16 FMAs out of shared
# memory; a second barrier keeps the next iteration from overwriting tiles still being read.
# Every element of A is then read from global memory ceil(N / 16) times instead of N times.
#
# **Exercise 8.4.** Write `sgemm_tiled` (same signature as `sgemm_naive`) with `#define TILE 16`,
# two `__shared__ float [TILE][TILE]` tiles and the launch `sgemm_tiled_launch`. Load zeros for
# tile elements outside A or B (M, N, K need not be multiples of 16) and guard the store. All
# threads, including those whose C element is out of range, must reach every barrier.

# %%
#| export
def sgemm_tiled_launch(M: int, N: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) for sgemm_tiled: one 16x16 block per 16x16 tile of C."""
    return (ceil_div(N, 16), ceil_div(M, 16)), (16, 16)

# %%
#| export
#| exercise 8.4
def sgemm_tiled_source() -> str:
    """CUDA C source of sgemm_tiled(A, B, C, M, N, K): as sgemm_naive, staging 16x16 tiles of A
    and B in shared memory; block (16, 16) computes C[16*by : +16, 16*bx : +16]."""
    ### BEGIN SOLUTION
    return r"""
#define TILE 16
extern "C" __global__ void sgemm_tiled(const float* __restrict__ A, const float* __restrict__ B,
                                       float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(k0 + ty) * N + col] : 0.0f;
        __syncthreads();                 // tiles complete before anyone reads them
        #pragma unroll
        for (int k = 0; k < TILE; ++k)
            acc += As[ty][k] * Bs[k][tx];
        __syncthreads();                 // everyone done reading before the next load
    }
    if (row < M && col < N) C[row * N + col] = acc;
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.4")

# %% [markdown]
# The PTX shows the structure: 2 KiB of shared memory (two 16x16 float tiles), two barriers,
# and a fully unrolled inner loop of 16 `fma.rn.f32`, each fed by two `ld.shared` loads.
# Shared memory is fast (about 30 cycles, 32 banks of 4 bytes each per cycle), but two shared
# loads per FMA still bind the kernel to shared-memory bandwidth, not to the FMA units.

# %% tags=["demo"]
st = ptx_stats(compile_ptx(sgemm_tiled_source()))
print(st)
print(f"shared loads per FMA: {st.ld_shared / st.fma_f32:.2f}")

# %% [markdown]
# Remove either barrier and run it on the emulator: the race is reported, with the two threads
# and the two lines. Without the first, a thread reads a tile slot another thread writes in the
# same step; without the second, the next step's load overwrites a slot another thread is
# still reading. On a GPU both bugs give wrong answers only sometimes, depending on timing.

# %% tags=["demo"]
A = rng.standard_normal((37, 29), dtype=np.float32)
B = rng.standard_normal((29, 45), dtype=np.float32)
first, second = (m.start() for m in re.finditer(r"__syncthreads\(\);", sgemm_tiled_source()))
for label, src in [("both barriers", sgemm_tiled_source()),
                   ("first barrier removed", sgemm_tiled_source()[:first] + sgemm_tiled_source()[first + 16:]),
                   ("second barrier removed", sgemm_tiled_source()[:second] + sgemm_tiled_source()[second + 16:])]:
    C = np.zeros((37, 45), dtype=np.float32)
    try:
        emulate(src, "sgemm_tiled", *sgemm_tiled_launch(37, 45), [A, B, C, np.int32(37), np.int32(45), np.int32(29)])
        print(f"{label}: max |C - A@B| = {np.abs(C - A @ B).max():.2e}")
    except KernelError as exc:
        print(f"{label}: {str(exc)[:330]}...")

# %% [markdown]
# Live: why tiles grow. A block that computes a `BM x BN` tile of C, stepping over k by `BK`,
# loads `(BM + BN) BK` floats from global memory for `BM BN BK` multiply-adds: its arithmetic
# intensity is `BM BN / (2 (BM + BN))` flop/byte, `T / 4` for square tiles. Against a GPU's
# ridge point (peak flop/s over memory bandwidth, about 10 to 20 flop/byte for FP32 on recent
# parts), a 16 x 16 tile stays memory-bound; register blocking (section 5) is how tiles reach
# 64 or 128 while shared memory holds only the `BK` slice.

# %% tags=["demo"]
import matplotlib.pyplot as plt

from course.live import live


def draw_tile_intensity(tile_m: int, tile_n: int, ridge: float):
    t = np.arange(4, 257, 4)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.loglog(t, t * t / (2 * (t + t)), color="0.6", label="square tiles")
    ai = tile_m * tile_n / (2 * (tile_m + tile_n))
    ax.loglog([max(tile_m, tile_n)], [ai], "o", color="C3", ms=10, label=f"{tile_m} x {tile_n}")
    ax.axhline(ridge, color="k", lw=0.8, ls="--", label=f"ridge point {ridge:g} flop/byte")
    bound = "compute-bound" if ai >= ridge else f"memory-bound: at most {ai / ridge:.0%} of peak"
    ax.set(xlabel="tile side (larger of BM, BN)", ylabel="flop per global byte", ylim=(0.5, 100),
           title=f"{tile_m} x {tile_n} tile: {ai:.1f} flop/byte, {bound}")
    ax.legend(fontsize=8)
    return fig


live(draw_tile_intensity, tile_m=(8, 256, 8), tile_n=(8, 256, 8), ridge=(5.0, 30.0))

# %% [markdown]
# ## 5. Register blocking: each thread computes 8x8 outputs
#
# The CPU lesson's lesson applies again one level down (lesson 06, the micro-kernel): keep a
# block of C in registers and load each operand once per many FMAs. Here each block of 256
# threads computes a 128x128 tile of C, stepping through K 8 at a time:
#
# 1. all 256 threads cooperatively load a 128x8 slice of A and an 8x128 slice of B into shared
#    memory (4 elements each of each; zeros outside the matrices); barrier;
# 2. for each of the 8 k: every thread loads 8 values of A's column and 8 of B's row from shared
#    memory into registers and does the 8x8 = 64 FMAs of their outer product into `acc[8][8]`;
#    barrier;
# 3. finally each thread writes its 64 results (guarded).
#
# That is 16 shared loads per 64 FMAs, a quarter of a load per FMA instead of two, and each
# element of A is read from global memory ceil(N / 128) times. Two details matter for speed:
#
# - **Which 8x8?** Thread (ty, tx) = (tid / 16, tid % 16) owns rows `ty + 16 i` and columns
#   `tx + 16 j` (i, j < 8), strided rather than contiguous. Then the 16 threads of a half-warp
#   read 16 *consecutive* floats of a B row (16 different banks, no conflict), and the final
#   stores of a half-warp are consecutive addresses (coalesced). With contiguous 8x8 blocks,
#   `Bs[k][8 tx + j]` puts 4 threads on each bank: a 4-way conflict on every load.
# - **Store A transposed** (`As[k][m]`), so step 2 reads a contiguous row of `As`, and pad it
#   to `BM + 4` columns so the transposing stores in step 1 spread over all 32 banks.
#
# Everything with a compile-time size (`#define`, `#pragma unroll`) so `acc`, `a` and `b` live
# in registers: a loop the compiler cannot unroll would put `acc` in local memory (DRAM).
# This is kernel 5 of Boehm's *How to Optimize a CUDA Matmul Kernel* (2022), which reached
# about 70 % of cuBLAS on an A6000; CUTLASS's SGEMM is the same structure plus double
# buffering and vector loads.
#
# **Exercise 8.5.** Write `sgemm_regtile` (same signature) for the launch `sgemm_regtile_launch`:
# BM = BN = 128, BK = 8, 8x8 outputs per thread, 256 threads (1-D block), any M, N, K. A
# skeleton to start from:
#
# ```c
# #define BM 128
# #define BN 128
# #define BK 8
# extern "C" __global__ void __launch_bounds__(256)
# sgemm_regtile(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
#               int M, int N, int K) {
#     __shared__ float As[BK][BM + 4];   // As[k][m] = A[row0 + m][k0 + k]
#     __shared__ float Bs[BK][BN];       // Bs[k][n] = B[k0 + k][col0 + n]
#     const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
#     float acc[8][8] = {};              // acc[i][j] is C[row0 + ty + 16 i][col0 + tx + 16 j]
#     for (int k0 = 0; k0 < K; k0 += BK) {
#         // 1. each thread loads elements tid, tid + 256, tid + 512, tid + 768 of each slice
#         __syncthreads();
#         // 2. for k < BK: a[8] and b[8] from shared memory, then 64 FMAs
#         __syncthreads();
#     }
#     // 3. guarded stores
# }
# ```

# %%
#| export
def sgemm_regtile_launch(M: int, N: int) -> tuple[tuple[int, int], tuple[int]]:
    """(grid, block) for sgemm_regtile: one 256-thread block per 128x128 tile of C."""
    return (ceil_div(N, 128), ceil_div(M, 128)), (256,)

# %%
#| export
#| exercise 8.5
def sgemm_regtile_source() -> str:
    """CUDA C source of sgemm_regtile(A, B, C, M, N, K): block (256,) computes the 128x128 tile
    C[128*by : +128, 128*bx : +128], each thread an 8x8 sub-block held in registers."""
    ### BEGIN SOLUTION
    return r"""
#define BM 128
#define BN 128
#define BK 8
#define TM 8
#define TN 8
#define NT 256   // threads per block: (BM / TM) * (BN / TN)

extern "C" __global__ void __launch_bounds__(NT)
sgemm_regtile(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
              int M, int N, int K) {
    __shared__ float As[BK][BM + 4];   // A tile transposed; +4 spreads the transposing stores over banks
    __shared__ float Bs[BK][BN];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    float acc[TM][TN];
    #pragma unroll
    for (int i = 0; i < TM; ++i)
        #pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
    float a[TM], b[TN];

    for (int k0 = 0; k0 < K; k0 += BK) {
        #pragma unroll
        for (int l = 0; l < (BM * BK) / NT; ++l) {   // 4 elements of A and of B per thread
            const int idx = tid + l * NT;
            const int ar = idx / BK, ac = idx % BK;    // A slice: 128 rows x 8 columns
            const int gr = row0 + ar, gk = k0 + ac;
            As[ac][ar] = (gr < M && gk < K) ? A[(size_t)gr * K + gk] : 0.0f;
            const int br = idx / BN, bc = idx % BN;    // B slice: 8 rows x 128 columns
            const int gk2 = k0 + br, gc = col0 + bc;
            Bs[br][bc] = (gk2 < K && gc < N) ? B[(size_t)gk2 * N + gc] : 0.0f;
        }
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            #pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[k][ty + 16 * i];
            #pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = Bs[k][tx + 16 * j];
            #pragma unroll
            for (int i = 0; i < TM; ++i)
                #pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int r = row0 + ty + 16 * i;
        if (r >= M) continue;
        #pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int c = col0 + tx + 16 * j;
            if (c < N) C[(size_t)r * N + c] = acc[i][j];
        }
    }
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.5")

# %% tags=["demo"]
st = ptx_stats(compile_ptx(sgemm_regtile_source()))
print(st)
print(f"shared loads per FMA: {st.ld_shared / st.fma_f32:.2f} (tiled: 2.00)")

# %% [markdown]
# ## 6. Launching, timing, and the comparison with cuBLAS
#
# The host side: compile each source once with `cp.RawKernel` (here through `course.cuda_c.
# raw_kernel`, which gives NVRTC the same header path and pre-included `FLT_MAX`/`INFINITY`/`uint`
# definitions as `compile_ptx`, so what compiled there compiles here), check the arguments, launch
# with the kernel's own grid and block. GPU work is asynchronous: a launch returns before the kernel
# runs, so a CPU timer measures the launch, not the kernel. CUDA events are timestamps recorded
# *in the GPU's stream*: `start.record(); fn(); stop.record(); stop.synchronize()` and
# `get_elapsed_time(start, stop)` measure the GPU's time between them (resolution about 0.5 us).
# As in lesson 04: warm up first (the first launch compiles), repeat, take the median.

# %%
#| export
# name -> (source, kernel name, launch, multiple): the kernel needs N and K to be multiples of
# `multiple` (float4 loads need 16-byte aligned rows); the wrappers pad with zeros otherwise.
# Section 10's kernels join this table when they are defined.
SGEMM_KERNELS: dict[str, tuple[Callable[[], str], str, Callable, int]] = {
    "naive": (sgemm_naive_source, "sgemm_naive", sgemm_naive_launch, 1),
    "tiled": (sgemm_tiled_source, "sgemm_tiled", sgemm_tiled_launch, 1),
    "regtile": (sgemm_regtile_source, "sgemm_regtile", sgemm_regtile_launch, 1),
}


def _sgemm_operands(a: Any, b: Any, xp: Any, dtype: Any = np.float32, what: str = "sgemm") -> tuple[Any, Any, int, int, int]:
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 2:
            raise ValueError(f"{what}: {name} must be 2-D, got shape {x.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: shape mismatch: a {a.shape} @ b {b.shape}: inner dimensions {a.shape[1]} and "
                         f"{b.shape[0]} differ")
    _check_float(a, f"{what} a", (dtype,))
    _check_float(b, f"{what} b", (dtype,))
    return xp.ascontiguousarray(a), xp.ascontiguousarray(b), a.shape[0], b.shape[1], a.shape[1]


def _pad_to(x: Any, xp: Any, rows: int, cols: int) -> Any:
    """x zero-padded to (rows, cols) (x itself if it has that shape already and starts on 32 bytes)."""
    if x.shape == (rows, cols):
        return _aligned(x, xp)
    out = xp.zeros((rows, cols), dtype=x.dtype)
    out[:x.shape[0], :x.shape[1]] = x
    return out


def _aligned(x: Any, xp: Any, align: int = 32) -> Any:
    """x, or a copy of it that starts on `align` bytes: a contiguous view (b[:, 1:] of one row) may start
    anywhere, and a float4 load, a cp.async copy or a WMMA fragment load from a misaligned address faults."""
    address = x.data.ptr if hasattr(x.data, "ptr") else x.ctypes.data
    return x if address % align == 0 else xp.array(x, copy=True)


def _raw_kernel(source: str, name: str) -> Any:
    key = ("raw", name, source)
    if key not in _KERNELS:
        _KERNELS[key] = raw_kernel(source, name)
    return _KERNELS[key]


def _on_gpu(source: str, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    """Launch kernel `name` of `source` on the GPU (compiled once per source)."""
    _raw_kernel(source, name)(grid, block, args)


def _on_emulator(source: str, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    """Run kernel `name` of `source` on the CPU emulator."""
    emulate(source, name, grid, block, list(args))


def _check_kernel(what: str, kernel: str) -> None:
    if kernel not in SGEMM_KERNELS:
        raise ValueError(f"{what}: kernel must be one of {sorted(SGEMM_KERNELS)}, got {kernel!r}")


def _run_sgemm(a: Any, b: Any, kernel: str, xp: Any, launch_fn: Callable, what: str) -> Any:
    _check_kernel(what, kernel)
    source_fn, name, launch, multiple = SGEMM_KERNELS[kernel]
    a, b, M, N, K = _sgemm_operands(a, b, xp, what=what)
    if M == 0 or N == 0 or K == 0:
        return xp.zeros((M, N), dtype=np.float32)
    Np, Kp = ceil_div(N, multiple) * multiple, ceil_div(K, multiple) * multiple
    a, b = _pad_to(a, xp, M, Kp), _pad_to(b, xp, Kp, Np)
    c = xp.zeros((M, Np), dtype=np.float32)
    args = (a, b, c, np.int32(M), np.int32(Np), np.int32(Kp))
    source = source_fn()
    check_args(kernel_params(source, name), args, name)
    launch_fn(source, name, *launch(M, Np), args)
    return c if Np == N else xp.ascontiguousarray(c[:, :N])


def sgemm(a: cupy.ndarray, b: cupy.ndarray, kernel: str = "regtile") -> cupy.ndarray:
    """a @ b on the GPU with this lesson's SGEMM `kernel` (a key of SGEMM_KERNELS).
    a: (M, K), b: (K, N) float32 CuPy arrays -> (M, N) float32 CuPy array."""
    return _run_sgemm(a, b, kernel, _cupy(), _on_gpu, "sgemm")


def sgemm_emulated(a: np.ndarray, b: np.ndarray, kernel: str = "regtile") -> np.ndarray:
    """a @ b computed by this lesson's SGEMM `kernel` on the CPU emulator (NumPy in and out):
    a (M, K), b (K, N) float32 -> (M, N) float32."""
    return _run_sgemm(np.asarray(a), np.asarray(b), kernel, np, _on_emulator, "sgemm_emulated")

# %% [markdown]
# On a GPU: every kernel against cuBLAS at n = 1024, 2048, 4096 (float32; CuPy's `matmul`
# calls cuBLAS SGEMM, which on an H100 uses the FP32 FMA units, not the tensor cores, unless
# TF32 is allowed). `make bench` runs the same comparison and saves the table. NVIDIA lists
# the H100 SXM at 67 TFLOP/s FP32 (PCIe: 51); cuBLAS reaches most of it at n = 4096.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
sizes = [1024, 2048] if SMALL else [1024, 2048, 4096]
for n in sizes:
    Ag = cp.random.standard_normal((n, n), dtype=cp.float32)
    Bg = cp.random.standard_normal((n, n), dtype=cp.float32)
    ref = Ag @ Bg
    t_blas = cuda_time_ms(lambda: Ag @ Bg)
    row = [f"n={n:5d}  cuBLAS {2 * n**3 / t_blas / 1e9:6.1f} TFLOP/s"]
    for kname in ["naive", "tiled", "regtile"]:
        got = sgemm(Ag, Bg, kname)
        assert cp.allclose(got, ref, rtol=1e-3, atol=1e-2), kname
        t = cuda_time_ms(lambda: sgemm(Ag, Bg, kname), repeat=5 if kname == "naive" else 20)
        row.append(f"{kname} {2 * n**3 / t / 1e9:6.1f} ({t_blas / t:5.1%})")
    print("  ".join(row))

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0) this cell
# printed: cuBLAS 22.4, 42.5 and 50.2 TFLOP/s at n = 1024, 2048 and 4096; `regtile` 21.6 %, 46.3 %
# and 58.4 % of it; `naive` and `tiled` between 11 % and 21 %. cuBLAS itself reaches 75 % of the
# H100 SXM's 67 TFLOP/s only at n = 4096.

# %% [markdown]
# ## 7. A fused, numerically stable row softmax
#
# softmax(x)_j = exp(x_j - m) / sum_k exp(x_k - m) with m = max_k x_k: subtracting the row max
# makes every exponent <= 0, so nothing overflows (lesson 02), and the result is unchanged. The
# unfused CuPy expression `e = cp.exp(x - x.max(1, keepdims=True)); e / e.sum(1, keepdims=True)`
# launches five kernels (max, subtract, exp, sum, divide) that together read the matrix five
# times and write it three times. A fused kernel reads each row and writes the result: one block
# per row, and the row's later passes hit the L1/L2 caches.
#
# Inside the block, the max and the sum are block reductions. Use the warp-shuffle pattern: a
# warp (32 threads) combines its values with `__shfl_xor_sync(0xffffffff, v, offset)` for
# offset = 16, 8, 4, 2, 1 (each thread exchanges registers with the thread `offset` lanes away,
# no shared memory, no barrier; after 5 steps every lane holds the warp's result), lane 0 of
# each warp writes it to a `__shared__` array, a barrier, then every thread combines the
# `blockDim.x / 32` partials. A second barrier before the array is reused.
#
# The running maximum must start at minus infinity, not at 0: a row of masked attention logits
# is all very negative (-1e4, or `-inf` except a few entries), and a maximum that starts at 0
# stays 0, every `expf(x - 0)` underflows to 0, and the row becomes 0 / 0 = NaN. CUDA C has
# `-INFINITY` (through `math.h`, which NVRTC lacks; `course.cuda_c` pre-includes a definition) or
# `__int_as_float(0xff800000)`, its bit pattern.
#
# **Exercise 8.6.** Write `softmax_rows(const float* x, float* y, int rows, int cols)`:
# y = softmax of each row of x (rows, cols), row-major, launched by `softmax_launch` (one
# block of 256 threads per row). Any `cols` >= 1; rows may contain `-inf` (probability 0),
# large values (1e4 must not overflow) and only very negative values. Use `expf`. Besides the
# values, the tests check the structure: warp shuffles in the PTX (`shfl.sync`), and, on the
# emulator, that the work is spread over the block: no thread reads more than about
# 3 cols / 256 elements of its row, and a row's outputs are written by many threads.

# %%
#| export
SOFTMAX_THREADS = 256


def softmax_launch(rows: int, cols: int) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) for softmax_rows: one block of SOFTMAX_THREADS threads per row."""
    return (rows,), (SOFTMAX_THREADS,)

# %%
#| export
#| exercise 8.6
def softmax_source() -> str:
    """CUDA C source of softmax_rows(x, y, rows, cols): y[r] = softmax(x[r]) for row-major float32
    (rows, cols); block r (256 threads) handles row r; max and sum are block reductions."""
    ### BEGIN SOLUTION
    return r"""
#define WARPS_MAX 32   // a block has at most 1024 threads = 32 warps

__device__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, offset));
    return v;
}

__device__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

extern "C" __global__ void softmax_rows(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    __shared__ float partial[WARPS_MAX];
    const int row = blockIdx.x;
    if (row >= rows) return;                       // the whole block leaves together
    const float* xr = x + (size_t)row * cols;
    float* yr = y + (size_t)row * cols;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;

    float m = __int_as_float(0xff800000);         // -inf (NVRTC has no math.h macros such as INFINITY)
    for (int j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, xr[j]);
    m = warp_max(m);
    if (lane == 0) partial[warp] = m;
    __syncthreads();
    m = partial[0];
    for (int w = 1; w < warps; ++w) m = fmaxf(m, partial[w]);
    __syncthreads();                               // partial is reused below

    float s = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s += expf(xr[j] - m);
    s = warp_sum(s);
    if (lane == 0) partial[warp] = s;
    __syncthreads();
    s = 0.0f;
    for (int w = 0; w < warps; ++w) s += partial[w];

    const float inv = 1.0f / s;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = expf(xr[j] - m) * inv;
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.6")

# %%
#| export
def _softmax_operand(x: Any, xp: Any, what: str = "softmax") -> Any:
    if x.ndim != 2:
        raise ValueError(f"{what}: x must be a 2-D array (rows, cols), got shape {x.shape}")
    _check_float(x, f"{what} x", (np.float32,))
    return xp.ascontiguousarray(x)


def softmax(x: cupy.ndarray) -> cupy.ndarray:
    """Row softmax of a 2-D float32 CuPy array with the fused kernel."""
    cp = _cupy()
    return _run_rows(_softmax_operand(x, cp), cp, _on_gpu, softmax_source, "softmax_rows", softmax_launch)


def softmax_emulated(x: np.ndarray) -> np.ndarray:
    """Row softmax of a 2-D float32 NumPy array by softmax_rows on the CPU emulator."""
    return _run_rows(_softmax_operand(np.asarray(x), np, "softmax_emulated"), np, _on_emulator, softmax_source,
                     "softmax_rows", softmax_launch)


def _run_rows(x: Any, xp: Any, launch_fn: Callable, source_fn: Callable[[], str], name: str, launch: Callable) -> Any:
    """y of x's shape from kernel `name(x, y, rows, cols)` of source_fn(), launched by launch(rows, cols)
    through launch_fn (_on_gpu or _on_emulator); x: a checked 2-D float32 array of xp."""
    y = xp.zeros_like(x) if xp is np else xp.empty_like(x)  # the emulator's output starts at zeros
    if x.size:
        args = (x, y, np.int32(x.shape[0]), np.int32(x.shape[1]))
        source = source_fn()
        check_args(kernel_params(source, name), args, name)
        launch_fn(source, name, *launch(*x.shape), args)
    return y


def softmax_unfused(x: cupy.ndarray) -> cupy.ndarray:
    """Row softmax as CuPy expressions: five kernels (max, subtract, exp, sum, divide)."""
    e = _cupy().exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)

# %% tags=["demo"]
xs = np.array([[1.0, 2.0, 3.0], [1e4, 1e4, -np.inf]], dtype=np.float32)
print(softmax_emulated(xs))

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
xs = cp.random.standard_normal((4096, 4096), dtype=cp.float32) * 10
assert cp.allclose(softmax(xs), softmax_unfused(xs), rtol=1e-5, atol=1e-7)
t_f, t_u = cuda_time_ms(lambda: softmax(xs)), cuda_time_ms(lambda: softmax_unfused(xs))
print(f"softmax 4096x4096: fused {t_f:.3f} ms ({2 * xs.nbytes / t_f / 1e6:.0f} GB/s of compulsory traffic), "
      f"unfused {t_u:.3f} ms: fused is {t_u / t_f:.1f}x faster")

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0) this cell
# printed: fused 0.202 ms (663 GB/s of compulsory traffic), unfused 0.327 ms: 1.6x, short of the
# 2x this section aims at. 663 GB/s is a fifth of the H100's 3.35 TB/s, so this kernel is not yet
# bound by memory: the row held in registers, read once with vector loads, by a block sized to
# the row, is the next step (exercise 8.12, in section 10).

# %% [markdown]
# ## 8. A CUDA device for minitorch
#
# Lesson 01 made `Tensor` hold its data in a *backend* array (`Backend.xp`, NumPy by default)
# and lesson 02 sends matmul, forward and backward, through `get_backend(device).matmul`. A
# backend whose `xp` is CuPy puts every tensor of that device in GPU memory, and every
# elementwise op and reduction becomes a CuPy kernel; overriding `matmul` routes the products
# through your SGEMM. Lesson 06 did the same for the CPU with `NumbaBackend`.
#
# **Exercise 8.7.** Write `CupyBackend.matmul(a, b)`: when both operands are 2-D float32,
# check the inner dimensions (ValueError naming both shapes) and return
# `self.matmul_2d(a, b)` on contiguous operands; everything else (batched, 1-D, float64) goes
# to `self.xp.matmul`, which for CuPy is cuBLAS.

# %%
#| export
#| exercise 8.7
class CupyBackend(Backend):
    """minitorch Backend for device "cuda": arrays are CuPy arrays, 2-D float32 matmul runs
    `matmul_2d` (default: this lesson's register-tiled SGEMM), the rest is CuPy's.

    xp: the array module (CuPy; tests pass NumPy with an emulated matmul_2d)."""

    def __init__(self, matmul_2d: Callable[[Any, Any], Any] | None = None, xp: Any = None):
        super().__init__("cupy", _cupy() if xp is None else xp)
        self.matmul_2d = (lambda a, b: sgemm(a, b, "regtile")) if matmul_2d is None else matmul_2d

    def to_numpy(self, a: Any) -> np.ndarray:
        return a.get() if hasattr(a, "get") else np.asarray(a)

    def matmul(self, a: Any, b: Any) -> Any:
        """NumPy matmul semantics; 2-D float32 @ 2-D float32 -> self.matmul_2d, everything else
        (float64, float16, integers, 1-D or batched operands) -> xp.matmul."""
        ### BEGIN SOLUTION
        xp = self.xp
        a, b = xp.asarray(a), xp.asarray(b)
        if a.ndim == 2 and b.ndim == 2 and a.dtype == np.float32 and b.dtype == np.float32:
            if a.shape[1] != b.shape[0]:
                raise ValueError(f"matmul shape mismatch: {a.shape} @ {b.shape}: inner dimensions "
                                 f"{a.shape[1]} and {b.shape[0]} differ")
            return self.matmul_2d(xp.ascontiguousarray(a), xp.ascontiguousarray(b))
        return xp.matmul(a, b)
        ### END SOLUTION


def enable_cuda(kernel: str = "regtile") -> CupyBackend:
    """Register device "cuda" with this lesson's SGEMM `kernel` (a key of SGEMM_KERNELS); RuntimeError
    if no GPU runs kernels."""
    from course.gpu import gpu_status  # the course's one GPU probe (gpu cells and the grader ask it too)

    _check_kernel("enable_cuda", kernel)
    ok, reason = gpu_status()
    if not ok:
        raise RuntimeError(f"enable_cuda: no usable CUDA GPU ({reason})")
    backend = CupyBackend(lambda a, b: sgemm(a, b, kernel))
    register_backend("cuda", backend)
    return backend

# %% tags=["check"]
check("8.7")

# %% [markdown]
# ## 9. Training on your kernels
#
# Lesson 03's MLP on the spirals. On a GPU: `enable_cuda()`, move the model with
# `model.to("cuda")` and the data with `Tensor(X, device="cuda")`; every matmul of every step,
# forward and backward, runs `sgemm_regtile`. The widths here (128) are far too small to keep an
# H100 busy (a 2048 x 128 @ 128 x 128 product is 67 MFLOP, microseconds of work against ~5 us
# of launch overhead per kernel), so the point is that the whole network runs on your code, not
# speed.
#
# Without a GPU the same device plumbing runs on the CPU: a `CupyBackend` whose array module is
# NumPy and whose matmul is your kernel on the emulator, registered as device "cuda" for a few
# steps. Same losses as the NumPy backend up to float32 rounding.

# %%
from minitorch.autograd import Tensor
from minitorch.data import make_spirals
from minitorch.nn import MLP, cross_entropy
from minitorch.optim import Adam
from minitorch.tensor import use_backend


def train(steps: int, device: str, n: int = 512, seed: int = 0) -> list[float]:
    X, y = make_spirals(n, noise=0.2, rng=np.random.default_rng(seed))
    model = MLP([2, 128, 128, 3], rng=np.random.default_rng(seed)).to(device)
    opt = Adam(model.parameters(), lr=1e-2)
    xt = Tensor(X.astype(np.float32), device=device)
    losses = []
    for _ in range(steps):
        loss = cross_entropy(model(xt), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses

# %% tags=["demo"]
calls = {"n": 0}


def counted_emulated(a, b):
    calls["n"] += 1
    return sgemm_emulated(a, b, "regtile")


steps = 3 if SMALL else 10
t0 = time.perf_counter()
ref = train(steps, "cpu", n=256)
with use_backend("cuda", CupyBackend(counted_emulated, xp=np)):
    emu = train(steps, "cuda", n=256)
print(f"{steps} steps, emulated CUDA device: {calls['n']} calls of sgemm_regtile; "
      f"loss {emu[0]:.4f} -> {emu[-1]:.4f}; largest difference from NumPy {max(abs(p - q) for p, q in zip(ref, emu)):.1e} "
      f"({time.perf_counter() - t0:.1f} s)")

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
enable_cuda("regtile")
steps = 100 if SMALL else 500
t0 = time.perf_counter()
gpu_losses = train(steps, "cuda", n=2048)
t_gpu = time.perf_counter() - t0
cpu_losses = train(steps, "cpu", n=2048)
print(f"{steps} steps on the GPU in {t_gpu:.1f} s; final loss GPU {gpu_losses[-1]:.4f}, CPU {cpu_losses[-1]:.4f}")

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0) this cell
# printed: 500 steps on the GPU in 2.3 s; final loss 0.0002 on the GPU and on the CPU.

# %% [markdown]
# ## 10. Further up the ladder: vector loads, warp tiles, double buffering, tensor cores, softmax
#
# `sgemm_regtile` is kernel 5 of Boehm's worklog (2022), which measured it at 69 % of cuBLAS on
# an RTX A6000; his later kernels reached 78 % with vector loads (kernel 6) and 94 % with warp
# tiling (kernel 10). CUTLASS's SGEMM adds double buffering, and past FP32 the tensor cores
# multiply whole tiles per instruction. Each step below is a small change to the kernel before
# it, graded without a GPU by what it changes: the instructions in the PTX, which warp writes
# which outputs, how many barriers a block passes. `make bench` measures each against cuBLAS.

# %% [markdown]
# The host side first: the kernels of this section join `SGEMM_KERNELS` (the wrappers pad N and
# K to multiples of 4 for them), and `hgemm` runs the tensor-core kernel of exercise 8.11,
# padding all three dimensions to multiples of 16. Each looks its kernel's source up when called.

# %%
#| export
SGEMM_KERNELS.update({
    "vec4": (lambda: sgemm_vec4_source(), "sgemm_vec4", sgemm_regtile_launch, 4),
    "warptile": (lambda: sgemm_warptile_source(), "sgemm_warptile", sgemm_regtile_launch, 4),
    "dbuf": (lambda: sgemm_dbuf_source(), "sgemm_dbuf", sgemm_regtile_launch, 4),
})


def _run_hgemm(a: Any, b: Any, xp: Any, launch_fn: Callable, what: str, source_fn: Callable[[], str] | None = None,
               name: str = "hgemm_wmma", launch: Callable | None = None) -> Any:
    """a @ b by a WMMA kernel (default: exercise 8.11's) with all three dimensions padded to multiples of 16."""
    a, b, M, N, K = _sgemm_operands(a, b, xp, np.float16, what)
    if M == 0 or N == 0 or K == 0:
        return xp.zeros((M, N), dtype=np.float32)
    Mp, Np, Kp = (ceil_div(d, 16) * 16 for d in (M, N, K))
    a, b = _pad_to(a, xp, Mp, Kp), _pad_to(b, xp, Kp, Np)
    c = xp.zeros((Mp, Np), dtype=np.float32)
    args = (a, b, c, np.int32(Mp), np.int32(Np), np.int32(Kp))
    source = (source_fn or hgemm_wmma_source)()
    check_args(kernel_params(source, name), args, name)
    launch_fn(source, name, *(launch or hgemm_launch)(Mp, Np), args)
    return c if (Mp, Np) == (M, N) else xp.ascontiguousarray(c[:M, :N])


def hgemm(a: cupy.ndarray, b: cupy.ndarray) -> cupy.ndarray:
    """a @ b on the GPU's tensor cores (hgemm_wmma): a (M, K), b (K, N) float16 CuPy arrays ->
    (M, N) float32 CuPy array (products of halves, accumulated in float32)."""
    return _run_hgemm(a, b, _cupy(), _on_gpu, "hgemm")


def hgemm_emulated(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b by hgemm_wmma on the CPU emulator (float16 NumPy in, float32 out)."""
    return _run_hgemm(np.asarray(a), np.asarray(b), np, _on_emulator, "hgemm_emulated")

# %%
#| export
def hgemm_launch(M: int, N: int) -> tuple[tuple[int, int], tuple[int]]:
    """(grid, block) for hgemm_wmma: one 128-thread block (4 warps) per 64x64 tile of C."""
    return (ceil_div(N, 64), ceil_div(M, 64)), (128,)

# %% [markdown]
# ### Vector loads
#
# `float4` is four floats in one 16-byte struct. Loading one through a `float4*` is a single
# instruction (`ld.global.v4.f32`, `ld.shared.v4.f32`) instead of four: fewer instructions to
# issue for the same bytes, and shared memory serves a warp's 16-byte loads in as few
# *wavefronts* (128 bytes each) as the distinct addresses need. The address must be a
# multiple of 16 bytes, or the load faults ("misaligned address"). A row of A starts at element
# `r * K`, so the rows are aligned only if K is a multiple of 4; likewise N for B and C. The
# wrappers (`sgemm`) pad N and K with zeros to a multiple of 4 for these kernels, and the
# emulator reports a misaligned `float4` access with the argument and the offset.
#
# **Exercise 8.8.** Write `sgemm_vec4` (same signature, launched like `sgemm_regtile`: BM = BN =
# 128, BK = 8, 256 threads, 8 x 8 outputs per thread), with N and K multiples of 4 (M any):
#
# 1. each thread loads one `float4` of A (row `tid / 2`, columns `(tid % 2) * 4` to `+3`) and
#    stores its four values transposed into `As[k][m]` (`BM + 4` columns, `__align__(16)`), and one
#    `float4` of B (row `tid / 32`, columns `(tid % 32) * 4` to `+3`) stored as a `float4` into
#    `Bs`; zeros outside the matrices;
# 2. thread (ty, tx) = (tid / 16, tid % 16) owns rows `4 ty` to `+3` and `64 + 4 ty` to `+3` of the
#    block tile, columns `4 tx` to `+3` and `64 + 4 tx` to `+3`: per k, two `float4` loads from
#    `As[k]` and two from `Bs[k]` feed its 64 FMAs (a sixteenth of a shared load per FMA);
# 3. the results are stored as `float4`s (guarded by row, and by column: `c < N` covers all four).
#
# The tests read the PTX (vector loads from global and shared memory, 4 shared loads per 64 FMAs)
# and run odd M with N, K multiples of 4 on the emulator.

# %%
#| export
#| exercise 8.8
def sgemm_vec4_source() -> str:
    """CUDA C source of sgemm_vec4(A, B, C, M, N, K): sgemm_regtile with float4 loads and stores;
    N and K multiples of 4; block (256,) computes a 128x128 tile of C."""
    ### BEGIN SOLUTION
    return r"""
#define BM 128
#define BN 128
#define BK 8
#define NT 256

// N and K must be multiples of 4 (sgemm() pads them): every float4 below is then 16-byte aligned.
extern "C" __global__ void __launch_bounds__(NT)
sgemm_vec4(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
           int M, int N, int K) {
    __shared__ __align__(16) float As[BK][BM + 4];   // A tile transposed: As[k][m]
    __shared__ __align__(16) float Bs[BK][BN];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int ar = tid / 2, ak = (tid % 2) * 4;      // this thread's float4 of A: row ar, columns ak..ak+3
    const int bk = tid / 32, bc = (tid % 32) * 4;    // and of B: row bk, columns bc..bc+3
    float acc[8][8];
    #pragma unroll
    for (int i = 0; i < 8; ++i)
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += BK) {
        float4 va = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vb = va;
        if (row0 + ar < M && k0 + ak < K)
            va = *reinterpret_cast<const float4*>(&A[(size_t)(row0 + ar) * K + k0 + ak]);
        if (k0 + bk < K && col0 + bc < N)
            vb = *reinterpret_cast<const float4*>(&B[(size_t)(k0 + bk) * N + col0 + bc]);
        As[ak + 0][ar] = va.x; As[ak + 1][ar] = va.y; As[ak + 2][ar] = va.z; As[ak + 3][ar] = va.w;
        *reinterpret_cast<float4*>(&Bs[bk][bc]) = vb;
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[k][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[k][64 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[k][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[k][64 + tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            #pragma unroll
            for (int i = 0; i < 8; ++i)
                #pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = row0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (r >= M) continue;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = col0 + h * 64 + tx * 4;
            if (c < N)
                *reinterpret_cast<float4*>(&C[(size_t)r * N + c]) =
                    make_float4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
        }
    }
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.8")

# %% tags=["demo"]
for fn in (sgemm_regtile_source, sgemm_vec4_source):
    st = ptx_stats(compile_ptx(fn()))
    print(f"{fn.__name__:22s} ld.global.v4 {st.ld_global_v4:2d}  ld.shared.v4 {st.ld_shared_v4:2d}  "
          f"shared loads per FMA {st.ld_shared / st.fma_f32:.4f}")

# %% [markdown]
# ### Warp tiles
#
# In `sgemm_vec4` warp w is threads 32w to 32w + 31: ty is 2w or 2w + 1 and tx takes all 16
# values, so the warp owns 16 rows of the block tile across all 128 columns. Per k it reads 16
# distinct floats of `As` and all 128 of `Bs`; as 16-byte loads that is 6 wavefronts of 128 bytes
# (a0 and a1 one each, b0 and b1 two each). *Warp tiling* gives each warp a compact tile instead:
# 8 warps as 2 x 4 tiles of 64 x 32, and inside a warp each lane (tr, tc) = (lane / 4, lane % 4)
# owns the four 4 x 4 blocks at rows `wr + 4 tr` and `wr + 32 + 4 tr`, columns `wc + 4 tc` and
# `wc + 16 + 4 tc` (each to `+3`), where (wr, wc) = ((warp / 4) * 64, (warp % 4) * 32) is the
# warp's corner. Per k the warp now reads 64 floats of `As` and 32 of `Bs`: 4 wavefronts
# instead of 6, for the same 64 FMAs per thread. The warp tile is also the unit the hardware's
# warp-level matrix instructions work on (the tensor-core step below), which is why CUTLASS
# organises every GEMM as block tile, warp tile, thread tile (NVIDIA, *CUTLASS: Efficient GEMM
# in CUDA*).
#
# **Exercise 8.9.** Write `sgemm_warptile`: `sgemm_vec4` with the warp-tiled ownership above
# (global loads and shared layout unchanged). The tests run it on the emulator and check, from
# which thread wrote each element of C, that every warp writes one dense 64 x 32 rectangle.

# %%
#| export
#| exercise 8.9
def sgemm_warptile_source() -> str:
    """CUDA C source of sgemm_warptile(A, B, C, M, N, K): sgemm_vec4 where warp w computes the
    64x32 tile of C at ((w / 4) * 64, (w % 4) * 32) of the block's 128x128 tile."""
    ### BEGIN SOLUTION
    return r"""
#define BM 128
#define BN 128
#define BK 8
#define WM 64    // each warp computes a WM x WN tile of C: 8 warps as 2 x 4
#define WN 32
#define NT 256

extern "C" __global__ void __launch_bounds__(NT)
sgemm_warptile(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
               int M, int N, int K) {
    __shared__ __align__(16) float As[BK][BM + 4];
    __shared__ __align__(16) float Bs[BK][BN];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int wr = (warp / 4) * WM, wc = (warp % 4) * WN;   // the warp's tile inside the block tile
    const int tr = lane / 4, tc = lane % 4;                  // lanes as 8 x 4, each 2 x 2 blocks of 4 x 4
    const int ar = tid / 2, ak = (tid % 2) * 4;
    const int bk = tid / 32, bc = (tid % 32) * 4;
    float acc[8][8];
    #pragma unroll
    for (int i = 0; i < 8; ++i)
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += BK) {
        float4 va = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vb = va;
        if (row0 + ar < M && k0 + ak < K)
            va = *reinterpret_cast<const float4*>(&A[(size_t)(row0 + ar) * K + k0 + ak]);
        if (k0 + bk < K && col0 + bc < N)
            vb = *reinterpret_cast<const float4*>(&B[(size_t)(k0 + bk) * N + col0 + bc]);
        As[ak + 0][ar] = va.x; As[ak + 1][ar] = va.y; As[ak + 2][ar] = va.z; As[ak + 3][ar] = va.w;
        *reinterpret_cast<float4*>(&Bs[bk][bc]) = vb;
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[k][wr + tr * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[k][wr + 32 + tr * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[k][wc + tc * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[k][wc + 16 + tc * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            #pragma unroll
            for (int i = 0; i < 8; ++i)
                #pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = row0 + wr + (i / 4) * 32 + tr * 4 + i % 4;
        if (r >= M) continue;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = col0 + wc + h * 16 + tc * 4;
            if (c < N)
                *reinterpret_cast<float4*>(&C[(size_t)r * N + c]) =
                    make_float4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
        }
    }
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.9")

# %% [markdown]
# Which warp wrote each element of C, on the emulator (`profile=True` records the writer of every
# element): one 128 x 128 block tile, shown as its 8 x 8 grid of 16 x 16 patches, each patch
# labelled by the warp that wrote it (or `*` where several did).

# %% tags=["demo"]
def warp_map(source_fn, name):
    A1, B1 = np.ones((128, 8), np.float32), np.ones((8, 128), np.float32)
    C1 = np.zeros((128, 128), np.float32)
    run = run_kernel(source_fn(), name, (1, 1), 256, [A1, B1, C1, np.int32(128), np.int32(128), np.int32(8)],
                     profile=True, schedules=("forward",))
    warps = run.profile["C"]["writer"] // 32
    return "\n".join(" ".join(str(set(warps[16 * i:16 * i + 16, 16 * j:16 * j + 16].ravel()).pop())
                              if len(set(warps[16 * i:16 * i + 16, 16 * j:16 * j + 16].ravel())) == 1 else "*"
                              for j in range(8)) for i in range(8))


for fn, name in [(sgemm_vec4_source, "sgemm_vec4"), (sgemm_warptile_source, "sgemm_warptile")]:
    print(name), print(warp_map(fn, name))

# %% [markdown]
# ### Double buffering
#
# Each step of `sgemm_warptile` loads a tile, waits at a barrier, computes, and waits again
# before the next load may overwrite the tile. While a block waits for global memory its FMA
# units idle, unless other blocks on the same SM have work ready. *Double buffering* keeps two
# stages of the tiles in shared memory: in step k the threads first issue the global loads of
# tile k + 1 into registers, then do the 512 FMAs of tile k from stage `s`, then store the
# registers into stage `s ^ 1`. The load latency hides behind the FMAs, and one barrier per step
# is enough: within a step, stage `s` is only read and stage `s ^ 1` only written; the barrier at
# the end of the step orders this step's reads of `s` before the next step's writes to it, and
# this step's writes to `s ^ 1` before the next step's reads. The cost is twice the shared memory
# (16.6 KB per block). CUTLASS calls it a two-stage software pipeline; Hopper kernels run more
# stages with asynchronous copies.
#
# **Exercise 8.10.** Write `sgemm_dbuf`: `sgemm_warptile` with `__shared__ float As[2][BK][BM +
# 4], Bs[2][BK][BN]`, a prologue that loads tile 0 into stage 0 and waits, and a main loop with
# one `__syncthreads()` per step as above. The tests check two stages in the PTX's shared
# memory, the barriers each block passes on the emulator (ceil(K / 8) + 1, instead of 2 ceil(K /
# 8)), the results, and the race check: a single-buffered kernel with one barrier per step is
# a race the emulator reports.

# %%
#| export
#| exercise 8.10
def sgemm_dbuf_source() -> str:
    """CUDA C source of sgemm_dbuf(A, B, C, M, N, K): sgemm_warptile with two shared-memory stages
    and one barrier per K step (loads of the next tile overlap the FMAs of this one)."""
    ### BEGIN SOLUTION
    return r"""
#define BM 128
#define BN 128
#define BK 8
#define WM 64
#define WN 32
#define NT 256

extern "C" __global__ void __launch_bounds__(NT)
sgemm_dbuf(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
           int M, int N, int K) {
    __shared__ __align__(16) float As[2][BK][BM + 4];   // two stages: compute on one, fill the other
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int wr = (warp / 4) * WM, wc = (warp % 4) * WN;
    const int tr = lane / 4, tc = lane % 4;
    const int ar = tid / 2, ak = (tid % 2) * 4;
    const int bk = tid / 32, bc = (tid % 32) * 4;
    float acc[8][8];
    #pragma unroll
    for (int i = 0; i < 8; ++i)
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    float4 va = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vb = va;   // the next tile, on its way through registers
    if (row0 + ar < M && ak < K) va = *reinterpret_cast<const float4*>(&A[(size_t)(row0 + ar) * K + ak]);
    if (bk < K && col0 + bc < N) vb = *reinterpret_cast<const float4*>(&B[(size_t)bk * N + col0 + bc]);
    As[0][ak + 0][ar] = va.x; As[0][ak + 1][ar] = va.y; As[0][ak + 2][ar] = va.z; As[0][ak + 3][ar] = va.w;
    *reinterpret_cast<float4*>(&Bs[0][bk][bc]) = vb;
    __syncthreads();

    int s = 0;
    for (int k0 = 0; k0 < K; k0 += BK, s ^= 1) {
        const bool more = k0 + BK < K;
        if (more) {   // issue the loads of tile k0 + BK: their latency hides behind the FMAs below
            const int k1 = k0 + BK;
            va = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vb = va;
            if (row0 + ar < M && k1 + ak < K) va = *reinterpret_cast<const float4*>(&A[(size_t)(row0 + ar) * K + k1 + ak]);
            if (k1 + bk < K && col0 + bc < N) vb = *reinterpret_cast<const float4*>(&B[(size_t)(k1 + bk) * N + col0 + bc]);
        }
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[s][k][wr + tr * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[s][k][wr + 32 + tr * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[s][k][wc + tc * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[s][k][wc + 16 + tc * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            #pragma unroll
            for (int i = 0; i < 8; ++i)
                #pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] += a[i] * b[j];
        }
        if (more) {   // fill the other stage: nobody reads it during this step
            As[s ^ 1][ak + 0][ar] = va.x; As[s ^ 1][ak + 1][ar] = va.y;
            As[s ^ 1][ak + 2][ar] = va.z; As[s ^ 1][ak + 3][ar] = va.w;
            *reinterpret_cast<float4*>(&Bs[s ^ 1][bk][bc]) = vb;
        }
        __syncthreads();   // one barrier per step: stage s is free again, stage s ^ 1 is complete
    }
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = row0 + wr + (i / 4) * 32 + tr * 4 + i % 4;
        if (r >= M) continue;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = col0 + wc + h * 16 + tc * 4;
            if (c < N)
                *reinterpret_cast<float4*>(&C[(size_t)r * N + c]) =
                    make_float4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
        }
    }
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.10")

# %% [markdown]
# Barriers per block for K = 300 (38 steps of 8), and the shared memory each kernel declares:

# %% tags=["demo"]
A3, B3 = rng.standard_normal((128, 300), dtype=np.float32), rng.standard_normal((300, 128), dtype=np.float32)
for fn, name in [(sgemm_warptile_source, "sgemm_warptile"), (sgemm_dbuf_source, "sgemm_dbuf")]:
    C3 = np.zeros((128, 128), np.float32)
    run = run_kernel(fn(), name, (1, 1), 256, [A3, B3, C3, np.int32(128), np.int32(128), np.int32(300)],
                     schedules=("forward",))
    print(f"{name:15s} barriers per block {run.barriers:3d}, shared memory {ptx_stats(compile_ptx(fn())).shared_bytes} "
          f"bytes, max |C - A@B| = {np.abs(C3 - A3 @ B3).max():.1e}")

# %% [markdown]
# ### Tensor cores
#
# An H100 SXM does 67 TFLOP/s of FP32 on its CUDA cores and 989 TFLOP/s of dense FP16 matrix
# products with FP32 accumulation on its tensor cores (NVIDIA, *H100 Tensor Core GPU
# Architecture*, 2022): fifteen times more, for inputs in half precision. A tensor core
# multiplies small matrix tiles per instruction, issued by a whole warp. CUDA's WMMA API
# (`#include <mma.h>`, namespace `nvcuda::wmma`; Appleyard and Yokim, 2017) exposes them at
# the 16 x 16 x 16 shape: `load_matrix_sync(frag, ptr, ldm)` loads a 16 x 16 tile of A or B into
# a *fragment* (registers spread over the warp's lanes in an unspecified layout),
# `mma_sync(acc, a, b, acc)` computes acc += a b, and `store_matrix_sync(ptr, acc, ldm,
# wmma::mem_row_major)` writes the result. Every lane of the warp must call each of them; the
# pointers must be 32-byte aligned and `ldm` a multiple of 8 halves.
#
# **Exercise 8.11.** Write `hgemm_wmma(const half* A, const half* B, float* C, int M, int N, int K)`:
# C = A @ B for row-major half A (M, K) and B (K, N), float C, with M, N, K multiples of 16
# (`hgemm` pads). Launch `hgemm_launch`: blocks of 128 threads, 4 warps as 2 x 2, each warp a
# 32 x 32 tile of C as 2 x 2 `float` accumulator fragments, stepping K by 16 (load 2 fragments of
# A and 2 of B, 4 `mma_sync`). Skip tiles outside C (a whole warp may return; load zeros with
# `fill_fragment` for a fragment past the edge). The tests count `wmma.mma.sync` in the PTX and run
# it on the emulator (which computes each fragment product in software); its speed needs a GPU.

# %%
#| export
#| exercise 8.11
def hgemm_wmma_source() -> str:
    """CUDA C source of hgemm_wmma(A, B, C, M, N, K): C (M, N) float = A (M, K) @ B (K, N), half
    row-major inputs, M, N, K multiples of 16; each warp computes a 32x32 tile with WMMA."""
    ### BEGIN SOLUTION
    return r"""
#include <mma.h>
using namespace nvcuda;

extern "C" __global__ void hgemm_wmma(const half* __restrict__ A, const half* __restrict__ B,
                                      float* __restrict__ C, int M, int N, int K) {
    const int warp = threadIdx.x / 32;
    const int row0 = blockIdx.y * 64 + (warp / 2) * 32, col0 = blockIdx.x * 64 + (warp % 2) * 32;
    if (row0 >= M || col0 >= N) return;   // the whole warp leaves: no tile here
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    for (int k = 0; k < K; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b[2];
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (row0 + 16 * i < M) wmma::load_matrix_sync(a[i], A + (size_t)(row0 + 16 * i) * K + k, K);
            else wmma::fill_fragment(a[i], __float2half(0.0f));
        }
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (col0 + 16 * j < N) wmma::load_matrix_sync(b[j], B + (size_t)k * N + col0 + 16 * j, N);
            else wmma::fill_fragment(b[j], __float2half(0.0f));
        }
        #pragma unroll
        for (int i = 0; i < 2; ++i)
            #pragma unroll
            for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int j = 0; j < 2; ++j)
            if (row0 + 16 * i < M && col0 + 16 * j < N)
                wmma::store_matrix_sync(C + (size_t)(row0 + 16 * i) * N + col0 + 16 * j, acc[i][j], N,
                                        wmma::mem_row_major);
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.11")

# %% [markdown]
# On a GPU: the whole ladder against cuBLAS at n = 4096, and the tensor-core kernel against
# cuBLAS's half-precision GEMM (`cp.matmul` on float16 arrays, which uses the tensor cores and
# writes float16). `make bench` records the same table.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
n = 2048 if SMALL else 4096
Ag = cp.random.standard_normal((n, n), dtype=cp.float32)
Bg = cp.random.standard_normal((n, n), dtype=cp.float32)
ref = Ag @ Bg
t_blas = cuda_time_ms(lambda: Ag @ Bg)
print(f"n = {n}: cuBLAS SGEMM {2 * n**3 / t_blas / 1e9:.1f} TFLOP/s")
for kname in SGEMM_KERNELS:
    assert cp.allclose(sgemm(Ag, Bg, kname), ref, rtol=1e-3, atol=1e-2), kname
    t = cuda_time_ms(lambda: sgemm(Ag, Bg, kname), repeat=5 if kname == "naive" else 20)
    print(f"  {kname:9s} {2 * n**3 / t / 1e9:6.1f} TFLOP/s  {t_blas / t:6.1%} of cuBLAS")
Ah, Bh = Ag.astype(cp.float16), Bg.astype(cp.float16)
assert cp.allclose(hgemm(Ah, Bh), Ah.astype(cp.float32) @ Bh.astype(cp.float32), rtol=1e-2, atol=1e-1)
t_h, t_hblas = cuda_time_ms(lambda: hgemm(Ah, Bh)), cuda_time_ms(lambda: cp.matmul(Ah, Bh))
print(f"  hgemm_wmma {2 * n**3 / t_h / 1e9:6.1f} TFLOP/s; cuBLAS half GEMM {2 * n**3 / t_hblas / 1e9:6.1f} TFLOP/s "
      f"({t_hblas / t_h:.1%})")

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0) this cell
# printed: at n = 4096, cuBLAS SGEMM 49.9 TFLOP/s; naive 11.3 %, tiled 16.2 %, regtile 58.9 %,
# vec4 69.6 %, warptile 69.7 %, dbuf 79.0 % of it; the WMMA kernel 50.2 TFLOP/s, 7.7 % of cuBLAS's
# half GEMM (650 TFLOP/s): one 16x16x16 fragment per warp with operands from global memory is the
# first step of the tensor-core ladder, not its top (exercise 8.13, at the end of this section, takes
# the next ones).

# %% [markdown]
# ### Softmax at the memory's speed
#
# Exercise 8.6's kernel reads each row three times (max, sum, output), one float per load, with
# 256 threads whatever the row's length. Softmax does a few FLOPs per element, so its limit is the
# memory: at best it reads x once and writes y once, `2 * 4 * rows * cols` bytes. The H100 run
# above put 8.6 at a fifth of the card's bandwidth. Three changes bring it to the memory's speed:
#
# 1. **One read.** Each thread keeps its share of the row in registers (`float4 v[ITEMS]`): the
#    max comes from them, `expf` overwrites them, and the output is written from them. Registers
#    hold an array only when every index is known at compile time: loops over `ITEMS` with
#    `#pragma unroll` and constant bounds. An index the compiler cannot resolve puts the array in
#    *local memory* (per-thread global memory, the PTX's `.local`), and the one read becomes many.
# 2. **Vector loads and stores**, as in exercise 8.8: `float4` is a 16-byte `ld.global.v4.f32`,
#    element `j` of the row's `float4`s read by thread `j % blockDim.x`, so a warp reads 512
#    consecutive bytes per instruction. The row must start on 16 bytes: `cols` a multiple of 4.
# 3. **Enough work per thread**: the block is sized to the row (`softmax_v4_launch`: 32 to 1024
#    threads, each holding up to `SOFTMAX_V4_ITEMS` = 8 `float4`s), rather than 256 threads for
#    a row of 64.
#
# Rows longer than 8 x 4 x 1024 = 32768, or of a length not a multiple of 4, go to exercise 8.6's
# kernel (`softmax_v4` chooses). The online softmax of lesson 09 (a running max that rescales the
# running sum) handles rows of any length in one read, at the price of an `expf` per rescaling.
#
# **Exercise 8.12.** Write `softmax_rows_v4(const float* x, float* y, int rows, int cols)`: y =
# softmax of each row of x (rows, cols), `cols` a multiple of 4 and at most `SOFTMAX_V4_MAX_COLS`,
# launched by `softmax_v4_launch` (one block per row). Thread `t` handles the row's `float4`s
# `t, t + blockDim.x, ...` (at most `ITEMS` = 8 of them; fill the slots past the row's end with
# `-INFINITY` so that they change neither the max nor, after `expf`, the sum). The max and the
# sum are block reductions as in 8.6 (warp shuffles, one `__shared__` partial per warp, barriers
# around its reuse). The tests read the PTX (`float4` loads and stores, shuffles, no local
# memory) and count, on the emulator, the reads of x (each `float4` of x exactly once) and the
# writes of y, besides the values on rows of several lengths, `-inf`, 1e4 and very negative rows.

# %%
#| export
SOFTMAX_V4_ITEMS = 8  # float4s of the row per thread, held in registers
SOFTMAX_V4_MAX_COLS = 4 * SOFTMAX_V4_ITEMS * 1024  # a block has at most 1024 threads


def softmax_v4_launch(rows: int, cols: int) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) for softmax_rows_v4: one block per row, of the fewest whole warps (32 to 1024
    threads) whose threads, SOFTMAX_V4_ITEMS float4s each, cover the row. cols: a multiple of 4, at most
    SOFTMAX_V4_MAX_COLS."""
    if cols % 4 or cols > SOFTMAX_V4_MAX_COLS:
        raise ValueError(f"softmax_v4_launch: cols must be a multiple of 4 and at most {SOFTMAX_V4_MAX_COLS}, "
                         f"got {cols}")
    warps = max(1, ceil_div(ceil_div(cols // 4, SOFTMAX_V4_ITEMS), 32))
    return (rows,), (32 * warps,)

# %%
#| export
#| exercise 8.12
def softmax_v4_source() -> str:
    """CUDA C source of softmax_rows_v4(x, y, rows, cols): y[r] = softmax(x[r]) for row-major float32
    (rows, cols), cols a multiple of 4 (at most SOFTMAX_V4_MAX_COLS); block r holds row r in registers
    (ITEMS float4s per thread), reads it once and writes it once, with float4 loads and stores."""
    ### BEGIN SOLUTION
    return r"""
#define ITEMS 8        // float4s per thread: SOFTMAX_V4_ITEMS
#define WARPS_MAX 32   // a block has at most 1024 threads = 32 warps

__device__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, offset));
    return v;
}

__device__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

// The block's max (is_max) or sum of v, returned to every thread; partial: WARPS_MAX shared floats.
__device__ float block_reduce(float v, float* partial, bool is_max) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = is_max ? warp_max(v) : warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = partial[0];
    for (int w = 1; w < warps; ++w) v = is_max ? fmaxf(v, partial[w]) : v + partial[w];
    __syncthreads();                               // partial is reused by the next reduction
    return v;
}

extern "C" __global__ void softmax_rows_v4(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    __shared__ float partial[WARPS_MAX];
    const int row = blockIdx.x;
    if (row >= rows) return;                       // the whole block leaves together
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)row * cols);
    float4* yr = reinterpret_cast<float4*>(y + (size_t)row * cols);
    const int n4 = cols / 4;
    const float ninf = __int_as_float(0xff800000);  // -inf
    float4 v[ITEMS];
    float m = ninf;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = threadIdx.x + i * blockDim.x;
        v[i] = j < n4 ? xr[j] : make_float4(ninf, ninf, ninf, ninf);
        m = fmaxf(m, fmaxf(fmaxf(v[i].x, v[i].y), fmaxf(v[i].z, v[i].w)));
    }
    m = block_reduce(m, partial, true);

    float s = 0.0f;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        v[i] = make_float4(expf(v[i].x - m), expf(v[i].y - m), expf(v[i].z - m), expf(v[i].w - m));
        s += (v[i].x + v[i].y) + (v[i].z + v[i].w);
    }
    s = block_reduce(s, partial, false);

    const float inv = 1.0f / s;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = threadIdx.x + i * blockDim.x;
        if (j < n4) yr[j] = make_float4(v[i].x * inv, v[i].y * inv, v[i].z * inv, v[i].w * inv);
    }
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.12")

# %%
#| export
def softmax_v4(x: cupy.ndarray) -> cupy.ndarray:
    """Row softmax of a 2-D float32 CuPy array: softmax_rows_v4 (one read, float4s, rows in registers)
    where the rows fit it (cols a multiple of 4, at most SOFTMAX_V4_MAX_COLS), else softmax_rows (8.6)."""
    cp = _cupy()
    return _run_softmax_v4(_softmax_operand(x, cp, "softmax_v4"), cp, _on_gpu)


def softmax_v4_emulated(x: np.ndarray) -> np.ndarray:
    """softmax_v4 on the CPU emulator (float32 NumPy in and out)."""
    return _run_softmax_v4(_softmax_operand(np.asarray(x), np, "softmax_v4_emulated"), np, _on_emulator)


def _run_softmax_v4(x: Any, xp: Any, launch_fn: Callable) -> Any:
    """softmax_rows_v4 on x (checked), or softmax_rows where its rows do not fit the one-read kernel."""
    if x.shape[1] % 4 or x.shape[1] > SOFTMAX_V4_MAX_COLS:
        return _run_rows(x, xp, launch_fn, softmax_source, "softmax_rows", softmax_launch)
    return _run_rows(_aligned(x, xp, 16), xp, launch_fn, softmax_v4_source, "softmax_rows_v4",  # float4s: 16 bytes
                     softmax_v4_launch)


def memory_bandwidth_gbps() -> float | None:
    """The GPU's memory bandwidth in GB/s from its attributes (memory clock x 2 transfers per clock x
    bus width), the datasheet's figure; None where the driver does not report them."""
    cp = _cupy()
    try:
        clock_khz = cp.cuda.runtime.deviceGetAttribute(36, cp.cuda.Device().id)  # cudaDevAttrMemoryClockRate
        bus_bits = cp.cuda.runtime.deviceGetAttribute(37, cp.cuda.Device().id)  # cudaDevAttrGlobalMemoryBusWidth
    except Exception:  # noqa: BLE001 - an attribute this driver lacks
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None

# %% tags=["demo"]
xs = np.array([[1.0, 2.0, 3.0, 4.0], [1e4, 1e4, -np.inf, 0.0]], dtype=np.float32)
print(softmax_v4_emulated(xs))
print("blocks for rows of 64, 4096 and 32768:", [softmax_v4_launch(1, c)[1][0] for c in (64, 4096, 32768)], "threads")

# %% [markdown]
# On a GPU: exercises 8.6 and 8.12 against the unfused expression and against a plain copy of the
# same bytes (`cp.copyto`: one read and one write of each element, the most any row-wise kernel
# can move per second), at 4096 x 4096 and at 1024 rows of 32768; the card's bandwidth from its
# memory clock and bus width beside them.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
peak_gbps = memory_bandwidth_gbps()
print(f"the card's memory bandwidth (clock x 2 x bus width): "
      f"{'not reported' if peak_gbps is None else f'{peak_gbps:.0f} GB/s'}")
for shape in ([(1024, 4096)] if SMALL else [(4096, 4096), (1024, 32768)]):
    xs = cp.random.standard_normal(shape, dtype=cp.float32) * 10
    ys = cp.empty_like(xs)
    assert cp.allclose(softmax_v4(xs), softmax_unfused(xs), rtol=1e-5, atol=1e-7)
    times = {"copy": cuda_time_ms(lambda: cp.copyto(ys, xs)), "softmax_rows_v4 (8.12)": cuda_time_ms(lambda: softmax_v4(xs)),
             "softmax_rows (8.6)": cuda_time_ms(lambda: softmax(xs)), "unfused": cuda_time_ms(lambda: softmax_unfused(xs))}
    for name, t in times.items():
        gbps = 2 * xs.nbytes / t / 1e6
        print(f"{shape[0]} x {shape[1]}: {name:24s} {t:7.3f} ms {gbps:6.0f} GB/s = {times['copy'] / t:4.0%} of the copy"
              + ("" if peak_gbps is None else f", {gbps / peak_gbps:4.0%} of the card's")
              + f"; unfused / this = {times['unfused'] / t:4.1f}x")

# %% [markdown]
# ### Feeding the tensor cores: shared tiles, asynchronous copies, a pipeline
#
# `hgemm_wmma` loads its fragments straight from global memory: each warp reads its 32 rows of A
# and 32 columns of B for itself, and every `mma_sync` waits for its loads. The H100 run above put
# it at 7.7 % of cuBLAS's half GEMM. A tensor core finishes a 16 x 16 x 16 product in a few cycles,
# so the kernel's whole job is to keep operands arriving: the SGEMM ladder's steps again, for halves.
#
# 1. **Shared tiles, bigger warp tiles.** A block of 8 warps computes a 128 x 128 tile of C; each
#    warp a 64 x 32 tile, 4 x 2 accumulator fragments. Per step of 16 in k a warp loads 4
#    fragments of A and 2 of B from shared memory for 8 `mma_sync` (8.11: 2 and 2 for 4, from
#    global memory), and the block reads each element of its A and B tiles from global memory once.
# 2. **Asynchronous copies.** Since compute capability 8.0 a thread can copy 16 bytes from global
#    to shared memory without passing them through its registers (`cp.async`; in CUDA C the
#    primitives of `<cuda_pipeline.h>`): `__pipeline_memcpy_async(dst, src, 16, zfill)` starts a
#    copy (its last `zfill` bytes zeros: 16 for a chunk outside the matrix, and nothing is read),
#    `__pipeline_commit()` closes the thread's batch of copies, and `__pipeline_wait_prior(n)`
#    waits until at most the `n` latest batches are still in flight. A copy is its thread's own:
#    other threads see it after that thread has waited *and* a `__syncthreads()` has followed.
# 3. **A pipeline.** Two stages of the A and B tiles (BK = 32 of k each): while the warps multiply
#    stage t, the copies of stage t + 1 are in flight. Each step issues stage t + 1's copies,
#    commits, waits for all but the latest batch (`__pipeline_wait_prior(1)`: stage t), then
#    `__syncthreads()`; a second barrier after the products keeps step t + 1's copies from
#    overwriting a stage still being read. (A third stage would not fit the 48 KiB of static shared
#    memory with these tiles: more stages take dynamic shared memory and an opt-in attribute.)
# 4. **Padded rows.** A shared row of A is 32 halves, 64 bytes: the 16 rows a fragment load reads
#    would fall on the same few banks. Rows of 40 halves (`APAD` = 8) shift each row by 16 bytes;
#    B's rows of 128 + 8 likewise. `load_matrix_sync`'s stride becomes 40 (a multiple of 8, as WMMA
#    needs) and every fragment still starts on 32 bytes.
#
# **Exercise 8.13.** Write `hgemm_wmma_pipe(const half* A, const half* B, float* C, int M, int N,
# int K)`: C = A @ B as in 8.11 (M, N, K multiples of 16; `hgemm_pipe` pads), launched by
# `hgemm_pipe_launch` (256 threads, one block per 128 x 128 tile of C), with shared tiles
# `__shared__ __align__(128) half As[2][128][32 + 8], Bs[2][32][128 + 8]` filled by
# `__pipeline_memcpy_async` (each thread 2 chunks of 16 bytes of A and 2 of B per stage: chunk `c`
# of A is row `c / 4`, halves `(c % 4) * 8` on; of B row `c / 16`, halves `(c % 16) * 8` on),
# warp `w` computing the 64 x 32 tile at rows `(w / 4) * 64`, columns `(w % 4) * 32` of the block's
# tile, and the two-stage pipeline above. Every thread takes part in every copy and barrier (a
# warp whose tile is outside C computes zeros and stores nothing). The tests read the PTX
# (asynchronous copies, a wait that leaves a batch in flight, fragment loads from shared memory,
# 8 `mma` per step of 16) and run it on the emulator, which lands each copy only when its thread
# waits for it: a missing wait or barrier reads the emulator's NaN fill or is reported as a race.

# %%
#| export
def hgemm_pipe_launch(M: int, N: int) -> tuple[tuple[int, int], tuple[int]]:
    """(grid, block) for hgemm_wmma_pipe: one 256-thread block (8 warps) per 128x128 tile of C."""
    return (ceil_div(N, 128), ceil_div(M, 128)), (256,)

# %%
#| export
def hgemm_pipe(a: cupy.ndarray, b: cupy.ndarray) -> cupy.ndarray:
    """a @ b on the GPU's tensor cores with hgemm_wmma_pipe: a (M, K), b (K, N) float16 CuPy arrays ->
    (M, N) float32 CuPy array."""
    return _run_hgemm(a, b, _cupy(), _on_gpu, "hgemm_pipe", hgemm_wmma_pipe_source, "hgemm_wmma_pipe", hgemm_pipe_launch)


def hgemm_pipe_emulated(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b by hgemm_wmma_pipe on the CPU emulator (float16 NumPy in, float32 out)."""
    return _run_hgemm(np.asarray(a), np.asarray(b), np, _on_emulator, "hgemm_pipe_emulated", hgemm_wmma_pipe_source,
                      "hgemm_wmma_pipe", hgemm_pipe_launch)

# %%
#| export
#| exercise 8.13
def hgemm_wmma_pipe_source() -> str:
    """CUDA C source of hgemm_wmma_pipe(A, B, C, M, N, K): C (M, N) float = A (M, K) @ B (K, N), half
    row-major inputs, M, N, K multiples of 16; 128x128 tiles of C per block of 8 warps (64x32 each), A and
    B tiles copied into padded shared memory by cp.async in a two-stage pipeline."""
    ### BEGIN SOLUTION
    return r"""#include <mma.h>
#include <cuda_pipeline.h>
using namespace nvcuda;

#define BM 128
#define BN 128
#define BK 32             // k per stage
#define APAD 8            // halves of padding per row of a shared tile: rows 16 bytes off each other's banks
#define BPAD 8
#define NT 256            // 8 warps as 2 x 4, each a 64 x 32 tile of C

// Stage `s` of the A and B tiles for k0: 16-byte asynchronous copies, 2 of A and 2 of B per thread;
// a chunk outside A or B is zero-filled (nothing read).
__device__ void load_stage(const half* __restrict__ A, const half* __restrict__ B, half (*As)[BK + APAD],
                           half (*Bs)[BN + BPAD], int M, int N, int K, int row0, int col0, int k0) {
    #pragma unroll
    for (int l = 0; l < 2; ++l) {
        const int c = threadIdx.x + l * NT;
        const int ar = c / (BK / 8), ak = (c % (BK / 8)) * 8;          // A: 128 rows x 4 chunks
        const bool a_in = row0 + ar < M && k0 + ak < K;
        __pipeline_memcpy_async(&As[ar][ak], a_in ? &A[(size_t)(row0 + ar) * K + k0 + ak] : A, 16, a_in ? 0 : 16);
        const int br = c / (BN / 8), bc = (c % (BN / 8)) * 8;          // B: 32 rows x 16 chunks
        const bool b_in = k0 + br < K && col0 + bc < N;
        __pipeline_memcpy_async(&Bs[br][bc], b_in ? &B[(size_t)(k0 + br) * N + col0 + bc] : B, 16, b_in ? 0 : 16);
    }
}

extern "C" __global__ void __launch_bounds__(NT)
hgemm_wmma_pipe(const half* __restrict__ A, const half* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    __shared__ __align__(128) half As[2][BM][BK + APAD];
    __shared__ __align__(128) half Bs[2][BK][BN + BPAD];
    const int warp = threadIdx.x / 32, wm = (warp / 4) * 64, wn = (warp % 4) * 32;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        #pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    const int tiles = (K + BK - 1) / BK;
    load_stage(A, B, As[0], Bs[0], M, N, K, row0, col0, 0);
    __pipeline_commit();
    for (int t = 0; t < tiles; ++t) {
        if (t + 1 < tiles) load_stage(A, B, As[(t + 1) % 2], Bs[(t + 1) % 2], M, N, K, row0, col0, (t + 1) * BK);
        __pipeline_commit();          // a batch per step, empty in the last: wait_prior(1) then means stage t
        __pipeline_wait_prior(1);     // this thread's copies of stage t have landed (stage t + 1 still in flight)
        __syncthreads();              // ... and every thread's
        const int s = t % 2;
        #pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a[4];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b[2];
            #pragma unroll
            for (int i = 0; i < 4; ++i) wmma::load_matrix_sync(a[i], &As[s][wm + 16 * i][kk], BK + APAD);
            #pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &Bs[s][kk][wn + 16 * j], BN + BPAD);
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                #pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();              // stage s is read by all before step t + 1 copies stage t + 2 into it
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int r = row0 + wm + 16 * i, c = col0 + wn + 16 * j;
            if (r < M && c < N) wmma::store_matrix_sync(C + (size_t)r * N + c, acc[i][j], N, wmma::mem_row_major);
        }
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.13")

# %% [markdown]
# On a GPU: both tensor-core kernels against cuBLAS's half GEMM at n = 4096 (2048 in the quick run).

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
n = 2048 if SMALL else 4096
Ah, Bh = (cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16) for _ in range(2))
ref = Ah.astype(cp.float32) @ Bh.astype(cp.float32)
assert cp.allclose(hgemm_pipe(Ah, Bh), ref, rtol=1e-2, atol=1e-1)
t_blas = cuda_time_ms(lambda: cp.matmul(Ah, Bh))
for name, fn in (("hgemm_wmma (8.11)", hgemm), ("hgemm_wmma_pipe (8.13)", hgemm_pipe)):
    t = cuda_time_ms(lambda: fn(Ah, Bh))
    print(f"n = {n}: {name:24s} {2 * n**3 / t / 1e9:6.1f} TFLOP/s = {t_blas / t:5.1%} of cuBLAS's half GEMM "
          f"({2 * n**3 / t_blas / 1e9:.1f} TFLOP/s)")

# %% [markdown]
# ### Tuning: the tile sizes are the GPU's to choose
#
# Every constant of the ladder so far (128 x 128 block tiles, BK = 8, 256 threads, 8 x 8 outputs per
# thread) was chosen by reasoning, and the best values differ from one GPU to the next: cuBLAS
# ships many variants of each kernel and picks one by shape and device, CUTLASS's profiler and
# Triton's `autotune` time the candidates. Two knobs of `sgemm_dbuf` matter most:
#
# - **BK**, the k of each step. BK = 16 halves the barriers per FMA and loads two `float4`s of A
#   and of B per thread per step instead of one, at twice the shared memory per stage (33 KB for
#   both stages at BK = 16; BK = 32 would pass the 48 KB of static shared memory).
# - **Blocks per SM.** 64 accumulators and the tile being loaded take most of a thread's
#   registers; `__launch_bounds__(256, 2)` asks the compiler to fit two blocks of 256 threads on one
#   SM (at most 128 registers per thread), trading spills or recomputed addresses for occupancy.
#
# **Exercise 8.14.** Write `sgemm_tuned_source(bk, min_blocks)`: the source of `sgemm_tuned`,
# `sgemm_dbuf` with `BK = bk` (8 or 16) and `__launch_bounds__(256, min_blocks)`, launched like it.
# With BK = 16 each thread loads `BK / 8` = 2 `float4`s of A per step (`float4` f = `tid + 256 l` of
# the tile: row `f / (BK / 4)`, k `(f % (BK / 4)) * 4`) and 2 of B (row `f / 32`, columns
# `(f % 32) * 4` on), into `float4` arrays indexed by unrolled loops. The given `tune_sgemm` times
# every configuration of `SGEMM_TUNING` on the GPU and makes the fastest the one `sgemm(a, b,
# "tuned")` runs. The tests run both BK on the emulator (values, one barrier per step), and read
# the PTX for the shared memory of two stages and the launch bound (`.minnctapersm`).

# %%
#| export
SGEMM_TUNING = [(bk, min_blocks) for bk in (8, 16) for min_blocks in (1, 2)]  # (BK, blocks per SM) tried
SGEMM_TUNED = {"bk": 16, "min_blocks": 1}  # what sgemm(..., "tuned") runs; tune_sgemm sets it from measurements

# %%
#| export
#| exercise 8.14
def sgemm_tuned_source(bk: int = 16, min_blocks: int = 1) -> str:
    """CUDA C source of sgemm_tuned(A, B, C, M, N, K): sgemm_dbuf with BK = bk (8 or 16) k per step and
    __launch_bounds__(256, min_blocks); N and K multiples of 4; block (256,) computes a 128x128 tile of C."""
    ### BEGIN SOLUTION
    return f"#define BK {bk}\n#define MIN_BLOCKS {min_blocks}\n" + r"""
#define BM 128
#define BN 128
#define WM 64
#define WN 32
#define NT 256
#define LOADS (BK / 8)      // float4s of A (and of B) each thread loads per step

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS)
sgemm_tuned(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    __shared__ __align__(16) float As[2][BK][BM + 4];
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int wr = (warp / 4) * WM, wc = (warp % 4) * WN;
    const int tr = lane / 4, tc = lane % 4;
    float acc[8][8];
    #pragma unroll
    for (int i = 0; i < 8; ++i)
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    float4 va[LOADS], vb[LOADS];   // the next tile, on its way through registers
    #pragma unroll
    for (int l = 0; l < LOADS; ++l) {
        const int f = tid + l * NT, ar = f / (BK / 4), ak = (f % (BK / 4)) * 4, bk = f / 32, bc = (f % 32) * 4;
        va[l] = vb[l] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row0 + ar < M && ak < K) va[l] = *reinterpret_cast<const float4*>(&A[(size_t)(row0 + ar) * K + ak]);
        if (bk < K && col0 + bc < N) vb[l] = *reinterpret_cast<const float4*>(&B[(size_t)bk * N + col0 + bc]);
        As[0][ak + 0][ar] = va[l].x; As[0][ak + 1][ar] = va[l].y; As[0][ak + 2][ar] = va[l].z; As[0][ak + 3][ar] = va[l].w;
        *reinterpret_cast<float4*>(&Bs[0][bk][bc]) = vb[l];
    }
    __syncthreads();

    int s = 0;
    for (int k0 = 0; k0 < K; k0 += BK, s ^= 1) {
        const bool more = k0 + BK < K;
        if (more) {
            #pragma unroll
            for (int l = 0; l < LOADS; ++l) {
                const int f = tid + l * NT, ar = f / (BK / 4), ak = (f % (BK / 4)) * 4, bk = f / 32, bc = (f % 32) * 4;
                const int k1 = k0 + BK;
                va[l] = vb[l] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (row0 + ar < M && k1 + ak < K)
                    va[l] = *reinterpret_cast<const float4*>(&A[(size_t)(row0 + ar) * K + k1 + ak]);
                if (k1 + bk < K && col0 + bc < N)
                    vb[l] = *reinterpret_cast<const float4*>(&B[(size_t)(k1 + bk) * N + col0 + bc]);
            }
        }
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[s][k][wr + tr * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[s][k][wr + 32 + tr * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[s][k][wc + tc * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[s][k][wc + 16 + tc * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            #pragma unroll
            for (int i = 0; i < 8; ++i)
                #pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] += a[i] * b[j];
        }
        if (more) {
            #pragma unroll
            for (int l = 0; l < LOADS; ++l) {
                const int f = tid + l * NT, ar = f / (BK / 4), ak = (f % (BK / 4)) * 4, bk = f / 32, bc = (f % 32) * 4;
                As[s ^ 1][ak + 0][ar] = va[l].x; As[s ^ 1][ak + 1][ar] = va[l].y;
                As[s ^ 1][ak + 2][ar] = va[l].z; As[s ^ 1][ak + 3][ar] = va[l].w;
                *reinterpret_cast<float4*>(&Bs[s ^ 1][bk][bc]) = vb[l];
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = row0 + wr + (i / 4) * 32 + tr * 4 + i % 4;
        if (r >= M) continue;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = col0 + wc + h * 16 + tc * 4;
            if (c < N)
                *reinterpret_cast<float4*>(&C[(size_t)r * N + c]) =
                    make_float4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
        }
    }
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("8.14")

# %%
#| export
SGEMM_KERNELS["tuned"] = (lambda: sgemm_tuned_source(SGEMM_TUNED["bk"], SGEMM_TUNED["min_blocks"]), "sgemm_tuned",
                          sgemm_regtile_launch, 4)


def tune_sgemm(n: int = 4096) -> dict[tuple[int, int], float]:
    """TFLOP/s of sgemm_tuned at each (BK, blocks per SM) of SGEMM_TUNING on an (n, n) @ (n, n) float32 product
    on the GPU (each checked against cuBLAS first); makes the fastest the configuration of sgemm(..., "tuned")."""
    cp = _cupy()
    a, b = (cp.random.standard_normal((n, n), dtype=cp.float32) for _ in range(2))
    ref = a @ b
    before, rates = dict(SGEMM_TUNED), {}
    try:
        for bk, min_blocks in SGEMM_TUNING:  # each timed as sgemm(a, b, "tuned") runs it, as the ladder is timed
            SGEMM_TUNED.update(bk=bk, min_blocks=min_blocks)
            if not cp.allclose(sgemm(a, b, "tuned"), ref, rtol=1e-3, atol=1e-2):
                raise AssertionError(f"tune_sgemm: sgemm_tuned with BK = {bk}, {min_blocks} blocks per SM is wrong at "
                                     f"n = {n}")
            rates[(bk, min_blocks)] = 2 * n**3 / cuda_time_ms(lambda: sgemm(a, b, "tuned")) / 1e9
    except BaseException:
        SGEMM_TUNED.update(before)
        raise
    best = max(rates, key=rates.get)
    SGEMM_TUNED.update(bk=best[0], min_blocks=best[1])
    return rates

# %% [markdown]
# On a GPU: every configuration at n = 4096 (2048 in the quick run), then the tuned kernel beside
# cuBLAS.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
n = 2048 if SMALL else 4096
tuning = tune_sgemm(n)
Ag, Bg = (cp.random.standard_normal((n, n), dtype=cp.float32) for _ in range(2))
t_blas = cuda_time_ms(lambda: Ag @ Bg)
for (bk, min_blocks), tflops in tuning.items():
    print(f"n = {n}: BK = {bk:2d}, {min_blocks} block(s) per SM: {tflops:6.1f} TFLOP/s = {tflops / (2 * n**3 / t_blas / 1e9):5.1%} "
          f"of cuBLAS")
print(f"fastest: {SGEMM_TUNED}; sgemm(..., 'tuned') now runs it")

# %% [markdown]
# ## What you measured / what to remember
#
# - Fusion is the cheapest speed-up on a GPU: elementwise chains and softmax are memory-bound
#   (a few FLOPs per 4-byte element), so one kernel that reads once and writes once beats a
#   chain of library calls by the ratio of passes. `ElementwiseKernel` and `ReductionKernel`
#   give you fusion for the price of one C expression.
# - A `RawKernel` launch checks nothing: argument order, C types (`np.int32` for `int`), dtype
#   and contiguity are the caller's job. Check them in the wrapper.
# - SGEMM is a ladder of reuse: naive (two global loads per FMA), shared-memory tiles (two
#   shared loads per FMA, global traffic / 16), register blocking (a quarter shared load per
#   FMA, global traffic / 128), vector loads (a sixteenth), warp tiles (6 -> 4 shared-memory
#   wavefronts per warp and step), double buffering (one barrier per step, loads overlapping
#   FMAs), tensor cores (a 16 x 16 x 16 product per warp instruction) fed from shared tiles by
#   asynchronous copies in a pipeline, and tile sizes chosen by measuring them on the GPU at hand.
#   The PTX counts, the emulator's writer map and barrier counts show each step without a GPU.
# - Barriers and guards are semantics, not performance: the emulator reports a missing
#   `__syncthreads()` as a race with both threads and lines (on a GPU it gives wrong answers only
#   sometimes), a missing guard with the argument, index and line it overran.
# - Time GPU work with CUDA events after a warm-up; CPU timers measure launches.
# - GPU figures: the `gpu` cells print them on your machine, and `make bench` records SGEMM
#   as a fraction of cuBLAS at n = 1024, 2048, 4096 (every kernel of the ladder, and the
#   tensor-core kernel against cuBLAS's half GEMM) and softmax (8.6, 8.12, unfused) against a copy
#   of the same bytes at 4096² and 1024 x 32768.
#   (This lesson was written on a machine without a GPU; its GPU cells have not been timed yet,
#   so no GPU numbers are quoted here.)
#
# ## Sources
#
# - NVIDIA, *CUDA C++ Programming Guide* (kernels, thread hierarchy, shared memory, warp shuffle
#   functions), https://docs.nvidia.com/cuda/cuda-c-programming-guide/
# - CuPy documentation, *User-Defined Kernels* (ElementwiseKernel, ReductionKernel, RawKernel),
#   https://docs.cupy.dev/en/stable/user_guide/kernel.html
# - NVIDIA, *NVRTC* and *PTX ISA* documentation, https://docs.nvidia.com/cuda/nvrtc/,
#   https://docs.nvidia.com/cuda/parallel-thread-execution/
# - S. Boehm, *How to Optimize a CUDA Matmul Kernel for cuBLAS-like Performance*, 2022,
#   https://siboehm.com/articles/22/CUDA-MMM
# - V. Volkov, J. Demmel, *Benchmarking GPUs to Tune Dense Linear Algebra*, SC 2008
#   (register blocking on GPUs), https://doi.org/10.1109/SC.2008.5214359
# - NVIDIA, CUTLASS, *Efficient GEMM in CUDA* (block, warp and thread tiles; software pipelining),
#   https://github.com/NVIDIA/cutlass/blob/main/media/docs/efficient_gemm.md
# - J. Appleyard, S. Yokim, *Programming Tensor Cores in CUDA 9*, NVIDIA blog, 2017 (WMMA),
#   https://developer.nvidia.com/blog/programming-tensor-cores-cuda-9/
# - NVIDIA, *Compute Sanitizer* (racecheck, memcheck), https://docs.nvidia.com/compute-sanitizer/
# - M. Milakov, N. Gimelshein, *Online normalizer calculation for softmax*, 2018,
#   https://arxiv.org/abs/1805.02867 (the next step: max and sum in one pass, lesson 09)
# - D. Hendrycks, K. Gimpel, *Gaussian Error Linear Units (GELUs)*, 2016, https://arxiv.org/abs/1606.08415
# - NVIDIA, *H100 Tensor Core GPU Architecture* whitepaper, 2022 (SXM5: FP32 67 TFLOP/s, dense FP16
#   tensor 989 TFLOP/s)


# %%
#| export
#| given
from minitorch.checks import Array, Attrs, Choice, Count, Int, Size, describe, validate_public  # noqa: E402


class _OnGpu(Array):
    """Array's rule, for an array that must live on the GPU (a CuPy array; a NumPy array is refused)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if type(value).__module__.split(".")[0] != "cupy" or not hasattr(value, "__cuda_array_interface__"):
            raise TypeError(f"{what}: {name} must be a CuPy array (on the GPU), {self.must}, got {describe(value)}")
        super().__call__(what, name, value)


class _BackendArray(Array):
    """Array's rule, for an array of a backend's own module: an object with `shape` and `dtype` (a CuPy
    array, or a test's stand-in that NumPy cannot convert) is checked by those, never converted."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if isinstance(value, np.ndarray) or not (hasattr(value, "shape") and hasattr(value, "dtype")):
            return super().__call__(what, name, value)
        try:
            ok = self._dtype_ok(np.dtype(value.dtype)) and (self.ndim is None or len(value.shape) in self.ndim)
        except TypeError:
            ok = False
        if not ok:
            raise TypeError(f"{what}: {name} must be {self.must}, got {describe(value)}")


_F = ("float32", "float64")

validate_public(globals(), {
    "ceil_div": {"a": Count, "b": Size},
    "cuda_time_ms": {"repeat": Size, "warmup": Count},
    "bias_gelu": {"x": _OnGpu(dtypes=_F), "bias": _OnGpu(ndim=1, dtypes=_F)},
    "gelu_unfused": {"x": _OnGpu(dtypes="float"), "bias": _OnGpu(dtypes="float")},
    "l2norm": {"x": _OnGpu(dtypes=_F)},
    "sgemm_naive_launch": {"M": Size, "N": Size},
    "sgemm_tiled_launch": {"M": Size, "N": Size},
    "sgemm_regtile_launch": {"M": Size, "N": Size},
    "hgemm_launch": {"M": Size, "N": Size},
    "softmax_launch": {"rows": Size, "cols": Size},
    "sgemm": {"a": _OnGpu(ndim=2, dtypes="float32"), "b": _OnGpu(ndim=2, dtypes="float32")},
    "sgemm_emulated": {"a": Array(ndim=2, dtypes="float32"), "b": Array(ndim=2, dtypes="float32")},
    "softmax": {"x": _OnGpu(ndim=2, dtypes="float32")},
    "softmax_emulated": {"x": Array(ndim=2, dtypes="float32")},
    "softmax_v4_launch": {"rows": Size, "cols": Size},
    "softmax_v4": {"x": _OnGpu(ndim=2, dtypes="float32")},
    "softmax_v4_emulated": {"x": Array(ndim=2, dtypes="float32")},
    "softmax_unfused": {"x": _OnGpu(ndim=2, dtypes="float")},
    "CupyBackend": {"xp": Attrs("asarray", "matmul", "ascontiguousarray")},
    "CupyBackend.to_numpy": {"a": _BackendArray(dtypes="number")},
    "CupyBackend.matmul": {"a": _BackendArray(dtypes="number"), "b": _BackendArray(dtypes="number")},  # xp.matmul's
    "hgemm": {"a": _OnGpu(ndim=2, dtypes="float16"), "b": _OnGpu(ndim=2, dtypes="float16")},
    "hgemm_emulated": {"a": Array(ndim=2, dtypes="float16"), "b": Array(ndim=2, dtypes="float16")},
    "hgemm_pipe_launch": {"M": Size, "N": Size},
    "sgemm_tuned_source": {"bk": Choice(8, 16), "min_blocks": Int(1, 4)},
    "tune_sgemm": {"n": Size},
    "hgemm_pipe": {"a": _OnGpu(ndim=2, dtypes="float16"), "b": _OnGpu(ndim=2, dtypes="float16")},
    "hgemm_pipe_emulated": {"a": Array(ndim=2, dtypes="float16"), "b": Array(ndim=2, dtypes="float16")},
})
