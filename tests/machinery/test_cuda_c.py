"""The CUDA C tools lesson 08 grades with: NVRTC compile, PTX counts, the CPU emulator."""

from __future__ import annotations

import numpy as np
import pytest

from course.cuda_c import CudaCompileError, KernelError, compile_ptx, compiler, emulate, kernel_params, ptx_stats

needs_cxx = pytest.mark.skipif(compiler() is None, reason="the CUDA emulator needs g++")

SCALE = r"""
extern "C" __global__ void scale(const float* __restrict__ x, float* y, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}
"""

WARP_SUM = r"""
extern "C" __global__ void warp_sums(const int* x, int* out) {
    int v = x[blockIdx.x * blockDim.x + threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int d = __shfl_down_sync(0xffffffff, threadIdx.x, 1);
    int u = __shfl_up_sync(0xffffffff, threadIdx.x, 1);
    int b = __shfl_sync(0xffffffff, threadIdx.x, 3);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[4 * i] = v; out[4 * i + 1] = d; out[4 * i + 2] = u; out[4 * i + 3] = b;
}
"""


def test_kernel_params_reads_types_and_pointers():
    ps = kernel_params(SCALE, "scale")
    assert [(p.name, p.ctype, p.pointer) for p in ps] == [
        ("x", "float", True), ("y", "float", True), ("a", "float", False), ("n", "int", False)]
    with pytest.raises(ValueError, match="kernels found: \\['scale'\\]"):
        kernel_params(SCALE, "scal")


def test_compile_errors_carry_nvrtc_line_numbers():
    with pytest.raises(CudaCompileError, match=r"kernel\.cu\(3\)"):
        compile_ptx('extern "C" __global__ void f(float* x) {\n  x[0] = 1;\n  undefined_name = 2;\n}\n')
    st = ptx_stats(compile_ptx(SCALE))
    assert st.ld_global == 1 and st.shared_bytes == 0


@needs_cxx
def test_emulate_runs_and_checks_arguments():
    x = np.arange(70, dtype=np.float32)
    y = np.zeros(70, dtype=np.float32)
    emulate(SCALE, "scale", 3, 32, [x, y, np.float32(2), np.int32(70)])
    assert np.array_equal(y, 2 * x)
    with pytest.raises(TypeError, match="argument n .* needs np.int32"):
        emulate(SCALE, "scale", 3, 32, [x, y, np.float32(2), 70])
    with pytest.raises(TypeError, match="argument x .* needs dtype float32, got float64"):
        emulate(SCALE, "scale", 3, 32, [x.astype(np.float64), y, np.float32(2), np.int32(70)])
    with pytest.raises(ValueError, match="C-contiguous"):
        emulate(SCALE, "scale", 1, 32, [np.zeros((8, 8), np.float32)[:, 0], y, np.float32(2), np.int32(8)])
    with pytest.raises(TypeError, match="takes 4 arguments"):
        emulate(SCALE, "scale", 1, 32, [x, y])


@needs_cxx
def test_emulate_reports_out_of_bounds_with_the_argument_name():
    x = np.arange(70, dtype=np.float32)
    y = np.zeros(70, dtype=np.float32)
    unguarded = SCALE.replace("if (i < n) ", "")
    with pytest.raises(KernelError, match="past the end of argument '(x|y)'"):
        emulate(unguarded, "scale", 8, 128, [x, y, np.float32(2), np.int32(70)])


@needs_cxx
def test_warp_shuffles_follow_cuda_semantics():
    x = np.arange(64, dtype=np.int32)
    out = np.zeros(4 * 64, dtype=np.int32)
    emulate(WARP_SUM, "warp_sums", 2, 32, [x, out])
    out = out.reshape(64, 4)
    assert list(out[:32, 0]) == [x[:32].sum()] * 32 and list(out[32:, 0]) == [x[32:].sum()] * 32
    lane = np.arange(64) % 32
    assert np.array_equal(out[:, 1], np.where(lane < 31, lane + 1, lane))  # down: last lane keeps its own
    assert np.array_equal(out[:, 2], np.where(lane > 0, lane - 1, lane))   # up: lane 0 keeps its own
    assert np.array_equal(out[:, 3], np.full(64, 3))


@needs_cxx
def test_emulate_reports_hangs_and_deadlocks():
    hang = 'extern "C" __global__ void spin(int* x) { while (x[0] == 0) {} }'
    with pytest.raises(KernelError, match="did not finish within 2 s"):
        emulate(hang, "spin", 1, 1, [np.zeros(1, np.int32)], timeout=2)
    deadlock = r"""
extern "C" __global__ void dl(int* x) {
    if (threadIdx.x < 16) __syncthreads();  // half a warp at the barrier, half at a shuffle
    else x[0] = __shfl_sync(0xffffffff, 1, 0);
}"""
    with pytest.raises(KernelError, match="deadlock"):
        emulate(deadlock, "dl", 1, 64, [np.zeros(1, np.int32)])
    with pytest.raises(KernelError, match="ended before the launch finished"):
        emulate('extern "C" __global__ void quit(int* x) { exit(0); }', "quit", 1, 1, [np.zeros(1, np.int32)])


@needs_cxx
def test_missing_barrier_is_deterministically_wrong():
    src = r"""
extern "C" __global__ void reverse(const float* x, float* y) {
    __shared__ float s[64];
    s[threadIdx.x] = x[threadIdx.x];
    SYNC
    y[threadIdx.x] = s[63 - threadIdx.x];
}"""
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, dtype=np.float32)
    emulate(src.replace("SYNC", "__syncthreads();"), "reverse", 1, 64, [x, y])
    assert np.array_equal(y, x[::-1])
    emulate(src.replace("SYNC", ""), "reverse", 1, 64, [x, y])
    assert np.isnan(y[:32]).all(), "warp 0 runs ahead and reads slots warp 1 has not written (NaN)"
