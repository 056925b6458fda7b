# Generated from solutions/08_cupy_kernels.py by `make build`. Do not edit.
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


def bias_gelu_spec() -> tuple[str, str, str]:
    """(in_params, out_params, operation) for cp.ElementwiseKernel: y = gelu_tanh(x + bias),
    inputs `T x, T bias`, output `T y`."""
    return (
        "T x, T bias",
        "T y",
        "T v = x + bias;"
        " y = (T)0.5 * v * ((T)1 + tanh((T)0.7978845608028654 * (v + (T)0.044715 * v * v * v)));",
    )


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


def l2norm_spec() -> dict[str, str]:
    """Keyword arguments of cp.ReductionKernel computing y = sqrt(sum(x * x)) over the reduced axes."""
    return dict(in_params="T x", out_params="T y", map_expr="x * x", reduce_expr="a + b",
                post_map_expr="y = sqrt(a)", identity="0")


def l2norm(x: Any, axis: int | None = None) -> Any:
    """Euclidean norm of CuPy array x (float32/float64) over `axis` (all axes if None), one kernel."""
    cp = _cupy()
    _check_float(x, "l2norm x")
    key = ("l2norm", tuple(sorted(l2norm_spec().items())))
    if key not in _KERNELS:
        _KERNELS[key] = cp.ReductionKernel(name="l2norm", **l2norm_spec())
    return _KERNELS[key](x, axis=axis)


def sgemm_naive_launch(M: int, N: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) for sgemm_naive: 32x8 threads per block, x along the columns of C."""
    return (ceil_div(N, 32), ceil_div(M, 8)), (32, 8)


def sgemm_naive_source() -> str:
    """CUDA C source of sgemm_naive(A, B, C, M, N, K): C (M, N) = A (M, K) @ B (K, N), row-major
    float32, one thread per element of C (x along columns), guarded."""
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


def sgemm_tiled_launch(M: int, N: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) for sgemm_tiled: one 16x16 block per 16x16 tile of C."""
    return (ceil_div(N, 16), ceil_div(M, 16)), (16, 16)


def sgemm_tiled_source() -> str:
    """CUDA C source of sgemm_tiled(A, B, C, M, N, K): as sgemm_naive, staging 16x16 tiles of A
    and B in shared memory; block (16, 16) computes C[16*by : +16, 16*bx : +16]."""
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


def sgemm_regtile_launch(M: int, N: int) -> tuple[tuple[int, int], tuple[int]]:
    """(grid, block) for sgemm_regtile: one 256-thread block per 128x128 tile of C."""
    return (ceil_div(N, 128), ceil_div(M, 128)), (256,)


def sgemm_regtile_source() -> str:
    """CUDA C source of sgemm_regtile(A, B, C, M, N, K): block (256,) computes the 128x128 tile
    C[128*by : +128, 128*bx : +128], each thread an 8x8 sub-block held in registers."""
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


SOFTMAX_THREADS = 256


def softmax_launch(rows: int, cols: int) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) for softmax_rows: one block of SOFTMAX_THREADS threads per row."""
    return (rows,), (SOFTMAX_THREADS,)


def softmax_source() -> str:
    """CUDA C source of softmax_rows(x, y, rows, cols): y[r] = softmax(x[r]) for row-major float32
    (rows, cols); block r (256 threads) handles row r; max and sum are block reductions."""
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
        xp = self.xp
        a, b = xp.asarray(a), xp.asarray(b)
        if a.ndim == 2 and b.ndim == 2 and a.dtype == np.float32 and b.dtype == np.float32:
            if a.shape[1] != b.shape[0]:
                raise ValueError(f"matmul shape mismatch: {a.shape} @ {b.shape}: inner dimensions "
                                 f"{a.shape[1]} and {b.shape[0]} differ")
            return self.matmul_2d(xp.ascontiguousarray(a), xp.ascontiguousarray(b))
        return xp.matmul(a, b)


def enable_cuda(kernel: str = "regtile") -> CupyBackend:
    """Register device "cuda" with this lesson's SGEMM `kernel`; RuntimeError if no GPU runs kernels."""
    from course.gpu import gpu_status

    ok, reason = gpu_status()
    if not ok:
        raise RuntimeError(f"enable_cuda: no usable CUDA GPU ({reason})")
    backend = CupyBackend(lambda a, b: sgemm(a, b, kernel))
    register_backend("cuda", backend)
    return backend
