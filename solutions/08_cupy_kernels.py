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
# expression. We compare each against cuBLAS (`cp.matmul`) and time with CUDA events. Finally
# minitorch gets a `"cuda"` device whose matmul is your kernel, and lesson 03's MLP trains on it.
#
# **Without a GPU** (a laptop, CI) everything here is still graded:
# - NVRTC, NVIDIA's runtime compiler (shipped as a pip wheel, no driver needed), compiles your
#   CUDA C to PTX, the GPU's virtual assembly. Compile errors come back with line numbers, and
#   the PTX shows structure: how many fused multiply-adds, shared-memory loads, barriers.
# - `course.cuda_c.emulate` runs a kernel on the CPU: the CUDA C is compiled with g++ against a
#   small runtime where each GPU thread is a coroutine (a *fiber*), blocks run one at a time and
#   threads run in a fixed order up to each barrier. A missing `__syncthreads()` therefore gives
#   the same wrong answer every run (shared memory starts as NaN), an out-of-bounds access is
#   reported with the argument's name and the thread that made it, and a hang is stopped.
#
# Cells tagged `gpu` need a CUDA GPU; elsewhere they are skipped with the reason. GPU background:
# [the GPU note](../hardware_notes/gpu.md); why matmul can be compute-bound and softmax cannot:
# [the roofline note](../hardware_notes/roofline.md).

# %%
import os
import time

import numpy as np

from course.check import check
from course.cuda_c import compile_ptx, emulate, ptx_stats
from course.gpu import gpu_status

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
HAVE_GPU, GPU_REASON = gpu_status()
print("GPU:", GPU_REASON if HAVE_GPU else f"none ({GPU_REASON}); gpu cells will be skipped")

# %%
#| default_exp cupy_kernels
#| export
import math
from typing import Any, Callable

import numpy as np

from course.cuda_c import check_args, emulate, kernel_params
from minitorch.tensor import Backend, register_backend


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
    if np.dtype(x.dtype) not in [np.dtype(d) for d in dtypes]:
        raise TypeError(f"{what}: expected dtype {' or '.join(str(np.dtype(d)) for d in dtypes)}, got {x.dtype}")


def bias_gelu(x: Any, bias: Any) -> Any:
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


def gelu_unfused(x: Any, bias: Any) -> Any:
    """gelu(x + bias) as CuPy expressions: one kernel and one pass over memory per operator."""
    cp = _cupy()
    v = x + bias
    return 0.5 * v * (1 + cp.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))

# %% [markdown]
# On a GPU: the fused kernel against the same formula as CuPy expressions (`gelu_unfused`).
# Each CuPy expression is its own kernel and its own pass over 4 bytes x 3 (two reads and a
# write for a binary op).

# %% tags=["gpu"]
import cupy as cp

xg = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
bg = cp.random.standard_normal(4096, dtype=cp.float32)
assert cp.allclose(bias_gelu(xg, bg), gelu_unfused(xg, bg), atol=1e-5)
t_fused, t_unfused = cuda_time_ms(lambda: bias_gelu(xg, bg)), cuda_time_ms(lambda: gelu_unfused(xg, bg))
gb = 2 * xg.nbytes / 1e9
print(f"bias+GELU 4096x4096 float32: fused {t_fused:.3f} ms ({gb / t_fused * 1e3:.0f} GB/s effective), "
      f"unfused {t_unfused:.3f} ms: {t_unfused / t_fused:.1f}x")

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
def l2norm(x: Any, axis: int | None = None) -> Any:
    """Euclidean norm of CuPy array x (float32/float64) over `axis` (all axes if None), one kernel."""
    cp = _cupy()
    _check_float(x, "l2norm x")
    key = ("l2norm", tuple(sorted(l2norm_spec().items())))
    if key not in _KERNELS:
        _KERNELS[key] = cp.ReductionKernel(name="l2norm", **l2norm_spec())
    return _KERNELS[key](x, axis=axis)

# %% tags=["gpu"]
xr = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
assert cp.allclose(l2norm(xr, axis=1), cp.linalg.norm(xr, axis=1), rtol=1e-5)
t_red = cuda_time_ms(lambda: l2norm(xr, axis=1))
t_np = cuda_time_ms(lambda: cp.sqrt((xr * xr).sum(axis=1)))
print(f"row norms of 4096x4096: ReductionKernel {t_red:.3f} ms ({xr.nbytes / t_red / 1e6:.0f} GB/s), "
      f"sqrt((x*x).sum(1)) {t_np:.3f} ms")

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
# Remove a barrier and run it on the emulator: threads run in a fixed order, so the race gives
# the same wrong answer every time (NaN where a thread read a tile slot nobody had written yet).

# %% tags=["demo"]
A = rng.standard_normal((37, 29), dtype=np.float32)
B = rng.standard_normal((29, 45), dtype=np.float32)
for label, src in [("both barriers", sgemm_tiled_source()),
                   ("first barrier removed", sgemm_tiled_source().replace("__syncthreads();", "", 1))]:
    C = np.zeros((37, 45), dtype=np.float32)
    emulate(src, "sgemm_tiled", *sgemm_tiled_launch(37, 45), [A, B, C, np.int32(37), np.int32(45), np.int32(29)])
    print(f"{label:22s}: max |C - A@B| = {np.nanmax(np.abs(C - A @ B)):.2e}, NaNs: {np.isnan(C).sum()}")

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
# The host side: compile each source once with `cp.RawKernel`, check the arguments, launch with
# the kernel's own grid and block. GPU work is asynchronous: a launch returns before the kernel
# runs, so a CPU timer measures the launch, not the kernel. CUDA events are timestamps recorded
# *in the GPU's stream*: `start.record(); fn(); stop.record(); stop.synchronize()` and
# `get_elapsed_time(start, stop)` measure the GPU's time between them (resolution about 0.5 us).
# As in lesson 04: warm up first (the first launch compiles), repeat, take the median.

# %%
#| export
SGEMM_KERNELS: dict[str, tuple[Callable[[], str], str, Callable]] = {
    "naive": (sgemm_naive_source, "sgemm_naive", sgemm_naive_launch),
    "tiled": (sgemm_tiled_source, "sgemm_tiled", sgemm_tiled_launch),
    "regtile": (sgemm_regtile_source, "sgemm_regtile", sgemm_regtile_launch),
}


def _sgemm_operands(a: Any, b: Any, xp: Any) -> tuple[Any, Any, int, int, int]:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"sgemm: operands must be 2-D, got shapes {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"sgemm shape mismatch: {a.shape} @ {b.shape}: inner dimensions {a.shape[1]} and {b.shape[0]} differ")
    _check_float(a, "sgemm a", (np.float32,))
    _check_float(b, "sgemm b", (np.float32,))
    return xp.ascontiguousarray(a), xp.ascontiguousarray(b), a.shape[0], b.shape[1], a.shape[1]


def _raw_kernel(source: str, name: str) -> Any:
    key = ("raw", name, source)
    if key not in _KERNELS:
        _KERNELS[key] = _cupy().RawKernel(source, name, options=("-std=c++17",))
    return _KERNELS[key]


def sgemm(a: Any, b: Any, kernel: str = "regtile") -> Any:
    """a @ b on the GPU with this lesson's SGEMM `kernel` (naive | tiled | regtile).
    a: (M, K), b: (K, N) float32 CuPy arrays -> (M, N) float32 CuPy array."""
    cp = _cupy()
    source_fn, name, launch = SGEMM_KERNELS[kernel]
    a, b, M, N, K = _sgemm_operands(a, b, cp)
    c = cp.zeros((M, N), dtype=cp.float32)
    if M == 0 or N == 0 or K == 0:
        return c
    source = source_fn()
    args = (a, b, c, np.int32(M), np.int32(N), np.int32(K))
    check_args(kernel_params(source, name), args, name)
    grid, block = launch(M, N)
    _raw_kernel(source, name)(grid, block, args)
    return c


def sgemm_emulated(a: np.ndarray, b: np.ndarray, kernel: str = "regtile") -> np.ndarray:
    """a @ b computed by this lesson's SGEMM `kernel` on the CPU emulator (NumPy in and out)."""
    source_fn, name, launch = SGEMM_KERNELS[kernel]
    a, b, M, N, K = _sgemm_operands(np.asarray(a), np.asarray(b), np)
    c = np.zeros((M, N), dtype=np.float32)
    if M and N and K:
        emulate(source_fn(), name, *launch(M, N), [a, b, c, np.int32(M), np.int32(N), np.int32(K)])
    return c



# %% [markdown]
# On a GPU: every kernel against cuBLAS at n = 1024, 2048, 4096 (float32; CuPy's `matmul`
# calls cuBLAS SGEMM, which on an H100 uses the FP32 FMA units, not the tensor cores, unless
# TF32 is allowed). `make bench` runs the same comparison and saves the table. NVIDIA lists
# the H100 SXM at 67 TFLOP/s FP32 (PCIe: 51); cuBLAS reaches most of it at n = 4096.

# %% tags=["gpu"]
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
# **Exercise 8.6.** Write `softmax_rows(const float* x, float* y, int rows, int cols)`:
# y = softmax of each row of x (rows, cols), row-major, launched by `softmax_launch` (one
# block of 256 threads per row). Any `cols` >= 1; rows may contain `-inf` (probability 0) and
# large values (1e4 must not overflow). Use `expf`.

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
def _softmax_operand(x: Any, xp: Any) -> Any:
    if x.ndim != 2:
        raise ValueError(f"softmax: expected a 2-D array (rows, cols), got shape {x.shape}")
    _check_float(x, "softmax x", (np.float32,))
    return xp.ascontiguousarray(x)


def softmax(x: Any) -> Any:
    """Row softmax of a 2-D float32 CuPy array with the fused kernel."""
    cp = _cupy()
    x = _softmax_operand(x, cp)
    y = cp.empty_like(x)
    if x.size:
        args = (x, y, np.int32(x.shape[0]), np.int32(x.shape[1]))
        source = softmax_source()
        check_args(kernel_params(source, "softmax_rows"), args, "softmax_rows")
        _raw_kernel(source, "softmax_rows")(*softmax_launch(*x.shape), args)
    return y


def softmax_emulated(x: np.ndarray) -> np.ndarray:
    """Row softmax of a 2-D float32 NumPy array by softmax_rows on the CPU emulator."""
    x = _softmax_operand(np.asarray(x), np)
    y = np.zeros_like(x)
    if x.size:
        emulate(softmax_source(), "softmax_rows", *softmax_launch(*x.shape),
                [x, y, np.int32(x.shape[0]), np.int32(x.shape[1])])
    return y


def softmax_unfused(x: Any) -> Any:
    """Row softmax as CuPy expressions: five kernels (max, subtract, exp, sum, divide)."""
    e = _cupy().exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)

# %% tags=["demo"]
xs = np.array([[1.0, 2.0, 3.0], [1e4, 1e4, -np.inf]], dtype=np.float32)
print(softmax_emulated(xs))

# %% tags=["gpu"]
xs = cp.random.standard_normal((4096, 4096), dtype=cp.float32) * 10
assert cp.allclose(softmax(xs), softmax_unfused(xs), rtol=1e-5, atol=1e-7)
t_f, t_u = cuda_time_ms(lambda: softmax(xs)), cuda_time_ms(lambda: softmax_unfused(xs))
print(f"softmax 4096x4096: fused {t_f:.3f} ms ({2 * xs.nbytes / t_f / 1e6:.0f} GB/s of compulsory traffic), "
      f"unfused {t_u:.3f} ms: fused is {t_u / t_f:.1f}x faster")

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
        """NumPy matmul semantics; 2-D float32 @ 2-D float32 -> self.matmul_2d, else xp.matmul."""
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
    """Register device "cuda" with this lesson's SGEMM `kernel`; RuntimeError if no GPU runs kernels."""
    from course.gpu import gpu_status

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
enable_cuda("regtile")
steps = 100 if SMALL else 500
t0 = time.perf_counter()
gpu_losses = train(steps, "cuda", n=2048)
t_gpu = time.perf_counter() - t0
cpu_losses = train(steps, "cpu", n=2048)
print(f"{steps} steps on the GPU in {t_gpu:.1f} s; final loss GPU {gpu_losses[-1]:.4f}, CPU {cpu_losses[-1]:.4f}")

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
#   FMA, global traffic / 128). The PTX counts in this notebook show each step without a GPU.
# - Barriers and guards are semantics, not performance: under the deterministic emulator a
#   missing `__syncthreads()` gives NaN every run, a missing guard is reported with the
#   argument it overran.
# - Time GPU work with CUDA events after a warm-up; CPU timers measure launches.
# - GPU figures: the `gpu` cells print them on your machine, and `make bench` records SGEMM
#   as a fraction of cuBLAS at n = 1024, 2048, 4096 and fused vs unfused softmax at 4096².
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
# - NVIDIA, CUTLASS, *Efficient GEMM in CUDA*, https://github.com/NVIDIA/cutlass/blob/main/media/docs/efficient_gemm.md
# - M. Milakov, N. Gimelshein, *Online normalizer calculation for softmax*, 2018,
#   https://arxiv.org/abs/1805.02867 (the next step: max and sum in one pass, lesson 09)
# - D. Hendrycks, K. Gimpel, *Gaussian Error Linear Units (GELUs)*, 2016, https://arxiv.org/abs/1606.08415
# - NVIDIA, *H100 Tensor Core GPU Architecture* whitepaper, 2022 (FP32 67 TFLOP/s SXM5)
