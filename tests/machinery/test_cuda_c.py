"""The CUDA C tools lessons 08-10 grade with: NVRTC compile, PTX counts, and the CPU emulator.

Every construct the emulator supports has a small kernel here, compiled by NVRTC (so the same
source is valid CUDA: what works on the emulator works on a GPU) and run on the emulator against a
NumPy oracle. Racy kernels must fail under every schedule setting; the errors must name the real
problem (argument, index, thread, line).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from course.cuda_c import (
    CudaCompileError, EmulatorUnsupported, KernelError, compile_ptx, compiler, emulate, emulator_unavailable, kernel_params,
    prepare_source, ptx_stats, run_kernel,
)

needs_cxx = pytest.mark.skipif(emulator_unavailable() is not None, reason=str(emulator_unavailable()))


def both(src, name, grid, block, args, **kw):
    """Compile with NVRTC (valid CUDA) and run on the emulator; return the emulator's run."""
    compile_ptx(src, name_expressions=[name] if "<" in name else ())
    return run_kernel(src, name, grid, block, args, **kw)


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


# ------------------------------------------------------------------ signatures, NVRTC, PTX
def test_kernel_params_reads_types_pointers_templates_and_defaults():
    ps = kernel_params(SCALE, "scale")
    assert [(p.name, p.ctype, p.pointer) for p in ps] == [
        ("x", "float", True), ("y", "float", True), ("a", "float", False), ("n", "int", False)]
    with pytest.raises(ValueError, match="kernels found: \\['scale'\\]"):
        kernel_params(SCALE, "scal")
    templ = "template <int BM, typename T> __global__ void k(const T* x, T* y, float4* v, int n = 3) {}"
    ps = kernel_params(templ, "k<64, double>")
    assert [(p.name, p.ctype, p.pointer, p.vec, p.default) for p in ps] == [
        ("x", "double", True, 1, None), ("y", "double", True, 1, None), ("v", "float4", True, 4, None),
        ("n", "int", False, 1, "3")]
    with pytest.raises(ValueError, match="template arguments"):
        kernel_params(templ, "k")


def test_without_nvrtc_compile_ptx_says_why(monkeypatch):
    from course.cuda_c import NvrtcUnavailable, nvrtc_unavailable

    monkeypatch.setenv("MT_NO_NVRTC", "1")
    assert "MT_NO_NVRTC" in nvrtc_unavailable()
    with pytest.raises(NvrtcUnavailable, match="CPU emulator still grades"):
        compile_ptx(SCALE)


def test_compile_errors_carry_nvrtc_line_numbers():
    with pytest.raises(CudaCompileError, match=r"kernel\.cu\(3\)"):
        compile_ptx('extern "C" __global__ void f(float* x) {\n  x[0] = 1;\n  undefined_name = 2;\n}\n')
    st = ptx_stats(compile_ptx(SCALE))
    assert st.ld_global == 1 and st.shared_bytes == 0 and st.shared_arrays == 0


@needs_cxx
def test_nvrtc_and_the_emulator_know_the_c_constants_and_cuda_headers():
    src = r"""
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <mma.h>
extern "C" __global__ void f(float* x) {
    uint u = 3;
    x[0] = FLT_MAX + u + INT_MAX;
    x[1] = -INFINITY;
    x[2] = __half2float(__float2half(1.5f));
}"""
    x = np.zeros(3, np.float32)
    both(src, "f", 1, 1, [x])  # the same source compiles and runs on the emulator
    assert x[0] == np.float32(np.finfo(np.float32).max) and x[1] == -np.inf and x[2] == 1.5


def test_ptx_stats_count_vector_loads_tensor_cores_and_votes():
    src = r"""
#include <mma.h>
using namespace nvcuda;
extern "C" __global__ void f(const float4* x, float4* y, const half* a, const half* b, float* c, unsigned* v) {
    y[threadIdx.x] = x[threadIdx.x];
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
    wmma::fill_fragment(fc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(fc, fa, fb, fc);
    wmma::store_matrix_sync(c, fc, 16, wmma::mem_row_major);
    v[threadIdx.x] = __ballot_sync(0xffffffff, threadIdx.x & 1) + __reduce_add_sync(0xffffffff, threadIdx.x);
}"""
    st = ptx_stats(compile_ptx(src))
    assert st.ld_global_v4 == 1 and st.st_global_v4 == 1, st
    assert st.mma >= 1 and st.wmma_load == 2, st
    assert st.vote == 1 and st.redux == 1, st


# ------------------------------------------------------------------ running, arguments
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
    with pytest.raises(ValueError, match="schedules"):
        emulate(SCALE, "scale", 3, 32, [x, y, np.float32(2), np.int32(70)], schedules=("sideways",))


@needs_cxx
def test_noinline_device_functions_beside_libstdcxx_headers():
    """`__noinline__` is CUDA's qualifier and also an attribute libstdc++ spells in its own headers
    (GCC 12's <memory>; with GCC 13.3 on a GPU machine the emulator's own runtime failed to
    compile). Both must compile, with the prelude before the header."""
    src = r"""
#include <memory>
__noinline__ __device__ float twice(float v) { return 2 * v; }
__global__ void twice_all(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = twice(x[i]);
}"""
    x = np.arange(40, dtype=np.float32)
    y = np.zeros_like(x)
    emulate(src, "twice_all", 2, 32, [x, y, np.int32(40)])
    assert np.array_equal(y, 2 * x)


@needs_cxx
def test_template_kernel_by_name_default_and_null_pointer_arguments():
    src = r"""
template <int SCALE, typename T>
__global__ void axpb(const T* x, T* y, const T* bias = nullptr, int n = 5) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = SCALE * x[i] + (bias ? bias[i] : T(0));
}"""
    x = np.arange(8, dtype=np.float64)
    y = np.zeros(8)
    both(src, "axpb<3, double>", 1, 32, [x, y])  # bias and n left to their defaults
    assert np.array_equal(y, np.r_[3 * x[:5], [0, 0, 0]])
    both(src, "axpb<2, double>", 1, 32, [x, y, None, np.int32(8)])  # an explicit null pointer
    assert np.array_equal(y, 2 * x)
    b = np.ones(8)
    both(src, "axpb<2, double>", 1, 32, [x, y, b, np.int32(8)])
    assert np.array_equal(y, 2 * x + 1)


@needs_cxx
def test_null_pointer_dereference_is_reported():
    src = 'extern "C" __global__ void f(const float* x, float* y) { y[threadIdx.x] = x[threadIdx.x]; }'
    with pytest.raises(KernelError, match=r"null pointer .*kernel\.cu:1"):
        emulate(src, "f", 1, 4, [None, np.zeros(4, np.float32)])


# ------------------------------------------------------------------ memory errors name the problem
@needs_cxx
def test_any_byte_past_the_end_is_reported_with_argument_index_thread_and_line():
    x = np.arange(70, dtype=np.float32)
    y = np.zeros(70, dtype=np.float32)
    off_by_one = SCALE.replace("if (i < n)", "if (i <= n)")  # reads x[70]: inside the old 16-byte padding
    with pytest.raises(KernelError, match=r"thread \(6,0,0\) of block \(2,0,0\) reads x\[70\] at kernel\.cu:4, "
                                          r"past the end of argument 'x' \(70 elements of float: x\[0\] to x\[69\]\)"):
        emulate(off_by_one, "scale", 3, 32, [x, y, np.float32(2), np.int32(70)])
    unguarded = SCALE.replace("if (i < n) ", "")
    with pytest.raises(KernelError, match="past the end of argument '(x|y)'"):
        emulate(unguarded, "scale", 8, 128, [x, y, np.float32(2), np.int32(70)])
    far = 'extern "C" __global__ void f(const float* x, float* y) { y[0] = x[100000]; }'
    with pytest.raises(KernelError, match=r"reads x\[100000\] at kernel\.cu:1, past the end of argument 'x'"):
        emulate(far, "f", 1, 1, [x, y])
    before = 'extern "C" __global__ void f(const float* x, float* y) { y[0] = x[-1]; }'
    with pytest.raises(KernelError, match=r"reads x\[-1\] at kernel\.cu:1, before the start of argument 'x'"):
        emulate(before, "f", 1, 1, [x, y])


@needs_cxx
def test_misaligned_float4_access_names_argument_and_offset():
    src = r"""
extern "C" __global__ void copy4(const float* x, float* y, int offset) {
    int i = threadIdx.x;
    float4 v = reinterpret_cast<const float4*>(x + offset)[i];
    *(float4*)(y + 4 * i) = v;
}"""
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(32, dtype=np.float32)
    both(src, "copy4", 1, 8, [x, y, np.int32(8)])
    assert np.array_equal(y, x[8:40])
    with pytest.raises(KernelError, match=r"misaligned vector access: thread \(0,0,0\) of block \(0,0,0\) makes a "
                                          r"16-byte vector pointer .* at byte offset 4 of argument 'x'.*kernel\.cu:4"):
        emulate(src, "copy4", 1, 8, [x, y, np.int32(1)])


@needs_cxx
def test_shared_memory_index_out_of_bounds_names_the_array():
    src = r"""
extern "C" __global__ void f(float* y) {
    __shared__ float tile[4][8];
    tile[threadIdx.y][threadIdx.x] = 1.0f;
    __syncthreads();
    y[threadIdx.y * 8 + threadIdx.x] = tile[threadIdx.y][threadIdx.x + 1];
}"""
    with pytest.raises(KernelError, match=r"out-of-bounds shared memory access: thread \(7,3,0\) .* reads "
                                          r"tile\[32\] \(flat index\), past the end of __shared__ float tile\[4\]\[8\] "
                                          r"\(32 elements\) at kernel\.cu:6"):
        emulate(src, "f", 1, (8, 4), [np.zeros(32, np.float32)])


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
    with pytest.raises(KernelError, match=r"deadlock .* waits at __shfl_\*_sync\(mask 0xffffffff\) at kernel\.cu:4 "
                                          r"for lane 0, which waits at __syncthreads\(\) at kernel\.cu:3"):
        emulate(deadlock, "dl", 1, 64, [np.zeros(1, np.int32)])
    divergent = r"""
extern "C" __global__ void db(int* x) {
    if (threadIdx.x < 32) { __syncthreads(); }
    else { __syncthreads(); }
}"""
    with pytest.raises(KernelError, match=r"different barriers: thread \(0,0,0\) at kernel\.cu:3 .*, thread \(32,0,0\) "
                                          r"at kernel\.cu:4"):
        emulate(divergent, "db", 1, 64, [np.zeros(1, np.int32)])
    with pytest.raises(KernelError, match="ended before the launch finished"):
        emulate('extern "C" __global__ void quit(int* x) { exit(0); }', "quit", 1, 1, [np.zeros(1, np.int32)])


# ------------------------------------------------------------------ races fail under every schedule
REVERSE = r"""
extern "C" __global__ void reverse(const float* x, float* y) {
    __shared__ float s[64];
    s[threadIdx.x] = x[threadIdx.x];
    SYNC
    y[threadIdx.x] = s[63 - threadIdx.x];
}"""

SCHEDULE_SETTINGS = [("forward",), ("reverse",), ("shuffle",), ("forward", "reverse")]


@needs_cxx
@pytest.mark.parametrize("schedules", SCHEDULE_SETTINGS)
def test_missing_barrier_is_a_reported_race(schedules):
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, dtype=np.float32)
    emulate(REVERSE.replace("SYNC", "__syncthreads();"), "reverse", 1, 64, [x, y], schedules=schedules)
    assert np.array_equal(y, x[::-1])
    with pytest.raises(KernelError, match=r"race on shared memory in block \(0,0,0\): thread \(\d+,0,0\) (writes|reads) "
                                          r"s\[\d+\] at kernel\.cu:[46], which thread \(\d+,0,0\) (read|wrote) at "
                                          r"kernel\.cu:[46]"):
        emulate(REVERSE.replace("SYNC", ""), "reverse", 1, 64, [x, y], schedules=schedules)


NEIGHBOUR_SUM = r"""
extern "C" __global__ void prefix(float* out) {
    __shared__ float buf[64];
    int t = threadIdx.x;
    buf[t] = 1.0f;
    __syncthreads();
    if (t > 0) buf[t] += buf[t - 1];   // racy: reads a neighbour that may already have added
    __syncthreads();
    out[t] = buf[t];
}"""


@needs_cxx
@pytest.mark.parametrize("schedules", SCHEDULE_SETTINGS)
def test_in_place_neighbour_update_is_a_race_whatever_the_schedule(schedules):
    out = np.zeros(64, np.float32)
    with pytest.raises(KernelError, match=r"race on shared memory .* (reads|writes) buf\[\d+\] at kernel\.cu:7, which "
                                          r"thread \(\d+,0,0\) (\(same warp\) )?(wrote|read) at kernel\.cu:7"):
        emulate(NEIGHBOUR_SUM, "prefix", 1, 64, [out], schedules=schedules)


@needs_cxx
def test_global_memory_race_is_caught_by_comparing_schedules():
    src = r"""
extern "C" __global__ void prefix(float* buf, int n) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t > 0 && t < n) buf[t] += buf[t - 1];
}"""
    buf = np.ones(64, np.float32)
    with pytest.raises(KernelError, match=r"different results .*buf\[\d+\] is .* when warps, lanes and blocks run "
                                          r"forward but .* when they run reverse"):
        emulate(src, "prefix", 2, 32, [buf, np.int32(64)])
    with pytest.raises(KernelError, match="different results"):
        emulate(src, "prefix", 2, 32, [buf, np.int32(64)], schedules=("forward", "shuffle"))
    emulate(src, "prefix", 2, 32, [buf, np.int32(64)], schedules=("forward",))  # one schedule cannot see it
    assert buf[-1] == 64


@needs_cxx
def test_legal_patterns_are_not_races():
    src = r"""
extern "C" __global__ void legal(float* out, int* count) {
    __shared__ float s[32];
    __shared__ int hits;
    int t = threadIdx.x, lane = t % 32;
    if (t == 0) hits = 0;
    __syncthreads();
    if (t < 32) {
        s[lane] = lane;             // written by one lane ...
        s[lane] = s[lane] + 1.0f;   // ... and re-read by the same thread: fine
        __syncwarp();               // orders it before the other lanes' reads
        float v = s[31 - lane];
        __syncwarp();
        s[lane] = v;                // write after the others read, ordered by __syncwarp
        float w = __shfl_xor_sync(0xffffffff, s[lane], 1);
        s[lane] = w;                // after a shuffle: ordered
    }
    atomicAdd(&hits, 1);            // atomics do not race with each other
    __syncthreads();
    if (t < 32) out[t] = s[t];
    if (t == 0) count[0] = hits;
}"""
    out, count = np.zeros(32, np.float32), np.zeros(1, np.int32)
    both(src, "legal", 1, 64, [out, count])
    assert np.array_equal(out, (31 - (np.arange(32) ^ 1)) + 1.0) and count[0] == 64
    plain_after_atomic = src.replace("    __syncthreads();\n    if (t < 32) out", "    if (t < 32) out")
    with pytest.raises(KernelError, match=r"race on shared memory .* (reads hits .*updated atomically|updates hits .*read)"):
        emulate(plain_after_atomic, "legal", 1, 64, [out, count])
    no_syncwarp = src.replace("__syncwarp();               // orders it", "// orders it")
    assert no_syncwarp != src
    with pytest.raises(KernelError, match=r"race on shared memory .*same warp"):
        emulate(no_syncwarp, "legal", 1, 64, [out, count])


@needs_cxx
def test_shared_read_before_any_write_is_noted():
    src = r"""
extern "C" __global__ void f(float* y) {
    __shared__ float s[64];
    if (threadIdx.x < 32) s[threadIdx.x] = 1.0f;
    __syncthreads();
    y[threadIdx.x] = s[threadIdx.x];
}"""
    y = np.zeros(64, np.float32)
    run = run_kernel(src, "f", 1, 64, [y])
    assert np.isnan(y[32:]).all() and y[:32].sum() == 32
    assert any(re.search(r"thread \(32,0,0\) .* read s\[32\] at kernel\.cu:6 before any thread of its block wrote it", n)
               for n in run.notes), run.notes


# ------------------------------------------------------------------ warp-level primitives
@needs_cxx
def test_warp_shuffles_follow_cuda_semantics():
    x = np.arange(64, dtype=np.int32)
    out = np.zeros(4 * 64, dtype=np.int32)
    both(WARP_SUM, "warp_sums", 2, 32, [x, out])
    out = out.reshape(64, 4)
    assert list(out[:32, 0]) == [x[:32].sum()] * 32 and list(out[32:, 0]) == [x[32:].sum()] * 32
    lane = np.arange(64) % 32
    assert np.array_equal(out[:, 1], np.where(lane < 31, lane + 1, lane))  # down: last lane keeps its own
    assert np.array_equal(out[:, 2], np.where(lane > 0, lane - 1, lane))   # up: lane 0 keeps its own
    assert np.array_equal(out[:, 3], np.full(64, 3))


@needs_cxx
def test_votes_reductions_activemask_and_block_predicates():
    src = r"""
extern "C" __global__ void votes(const int* x, unsigned* out) {
    int t = threadIdx.x, v = x[t];
    unsigned* o = out + 12 * t;
    o[0] = __ballot_sync(0xffffffff, v > 10);
    o[1] = __any_sync(0xffffffff, v == 5);
    o[2] = __all_sync(0xffffffff, v >= 0);
    o[3] = __reduce_add_sync(0xffffffff, (unsigned)v);
    o[4] = (unsigned)__reduce_min_sync(0xffffffff, v - 20);
    o[5] = __reduce_max_sync(0xffffffff, (unsigned)v);
    o[6] = __reduce_or_sync(0xffffffff, 1u << (t % 32 % 8));
    o[7] = (t % 32 < 8) ? __activemask() : 0u;   // the lanes that took the branch together
    o[8] = __syncthreads_count(v % 3 == 0);
    o[9] = __syncthreads_and(v < 64);
    o[10] = __syncthreads_or(v == 63);
    o[11] = __match_any_sync(0xffffffff, v % 4);
}"""
    x = np.arange(64, dtype=np.int32)
    out = np.zeros((64, 12), np.uint32)
    both(src, "votes", 1, 64, [x, out])
    for w in range(2):
        xs, o = x[32 * w:32 * w + 32], out[32 * w:32 * w + 32]
        assert (o[:, 0] == sum(1 << i for i in range(32) if xs[i] > 10)).all()
        assert (o[:, 1] == int((xs == 5).any())).all() and (o[:, 2] == 1).all()
        assert (o[:, 3] == xs.sum()).all() and (o[:, 4].astype(np.int32) == xs.min() - 20).all()
        assert (o[:, 5] == xs.max()).all() and (o[:, 6] == 0xFF).all()
        assert (o[:8, 7] == 0xFF).all() and (o[8:, 7] == 0).all()
        assert all(o[i, 11] == sum(1 << j for j in range(32) if xs[j] % 4 == xs[i] % 4) for i in range(32))
    assert (out[:, 8] == (x % 3 == 0).sum()).all() and (out[:, 9] == 1).all() and (out[:, 10] == 1).all()


SHFL_SCAN = r"""
// NVIDIA's shfl_scan sample, in miniature: warp scans, then warp 0's first lanes scan the warp
// sums with a partial mask while the other lanes of the block wait at __syncthreads().
extern "C" __global__ void shfl_scan(int* data) {
    __shared__ int sums[32];
    int id = threadIdx.x, lane = id % 32, warp = id / 32, value = data[id];
    for (int i = 1; i <= 32; i *= 2) {
        int n = __shfl_up_sync(0xffffffff, value, i, 32);
        if (lane >= i) value += n;
    }
    if (lane == 31) sums[warp] = value;
    __syncthreads();
    int nwarps = blockDim.x / 32;
    if (warp == 0 && lane < nwarps) {
        int warp_sum = sums[lane];
        unsigned mask = (1u << nwarps) - 1;
        for (int i = 1; i <= nwarps; i *= 2) {
            int n = __shfl_up_sync(mask, warp_sum, i, nwarps);
            if (lane >= i) warp_sum += n;
        }
        sums[lane] = warp_sum;
    }
    __syncthreads();
    if (warp > 0) value += sums[warp - 1];
    data[id] = value;
}"""


@needs_cxx
def test_shuffle_masks_let_other_lanes_wait_at_a_barrier():
    x = np.arange(1, 257, dtype=np.int32)
    both(SHFL_SCAN, "shfl_scan", 1, 256, [x])
    assert np.array_equal(x, np.cumsum(np.arange(1, 257)))


@needs_cxx
def test_reading_a_lane_outside_the_mask_is_an_error():
    src = r"""
extern "C" __global__ void f(int* y) {
    int v = threadIdx.x;
    if (threadIdx.x < 16) v += __shfl_down_sync(0x0000ffff, v, 8);  // lanes 8..15 read lanes 16..23
    y[threadIdx.x] = v;
}"""
    with pytest.raises(KernelError, match=r"inactive lane: thread \(8,0,0\) \(lane 8\) reads lane 16 in __shfl_\*_sync "
                                          r"at kernel\.cu:4, but lane 16 is not in the mask 0x0000ffff"):
        emulate(src, "f", 1, 32, [np.zeros(32, np.int32)])
    mismatch = src.replace("0x0000ffff", "0xffffffff")  # lanes 16..31 never arrive
    with pytest.raises(KernelError, match=r"deadlock|inactive"):
        emulate(mismatch, "f", 1, 32, [np.zeros(32, np.int32)])


@needs_cxx
def test_cooperative_groups_basics():
    src = r"""
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
namespace cg = cooperative_groups;
extern "C" __global__ void cgsum(const float* x, float* out) {
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
    __shared__ float part[8];
    float v = x[block.thread_rank()];
    float s = cg::reduce(warp, v, cg::plus<float>());
    float m = cg::reduce(warp, v, cg::greater<float>());
    if (warp.thread_rank() == 0) part[warp.meta_group_rank()] = s;
    block.sync();
    if (block.thread_rank() == 0) {
        float t = 0.0f;
        for (int w = 0; w < (int)(block.size() / 32); ++w) t += part[w];
        out[0] = t;
    }
    out[1 + block.thread_rank()] = warp.shfl(m, 0) + warp.shfl_down(1.0f, 1);
    auto quad = cg::tiled_partition<4>(block);
    quad.sync();
    out[1 + block.size() + block.thread_rank()] = cg::reduce(quad, 1.0f, cg::plus<float>());
}"""
    x = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    out = np.zeros(1 + 2 * 128, np.float32)
    both(src, "cgsum", 1, 128, [x, out])
    assert np.isclose(out[0], x.astype(np.float64).sum(), rtol=1e-5)
    assert np.allclose(out[1:129], np.repeat(x.reshape(4, 32).max(1), 32) + 1.0)
    assert (out[129:] == 4).all()


# ------------------------------------------------------------------ intrinsics, atomics, types
@needs_cxx
def test_bit_intrinsics_dp4a_and_cache_hinted_loads():
    src = r"""
extern "C" __global__ void bits(const unsigned* x, const int* a, const int* b, int* out) {
    int t = threadIdx.x;
    unsigned v = __ldg(x + t);
    out[8 * t + 0] = __popc(v);
    out[8 * t + 1] = __clz((int)v);
    out[8 * t + 2] = __ffs((int)v);
    out[8 * t + 3] = (int)__brev(v);
    out[8 * t + 4] = __dp4a(__ldcs(a + t), b[t], 7);
    out[8 * t + 5] = (int)__dp4a((unsigned)a[t], (unsigned)b[t], 1u);
    out[8 * t + 6] = max(-1, 2u) == 0xffffffffu;     // mixed signs: unsigned, as in CUDA
    __stcs(out + 8 * t + 7, (int)min(t, 3));
}"""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)
    x[0] = 0
    a = rng.integers(-2**31, 2**31, 32, dtype=np.int64).astype(np.int32)
    b = rng.integers(-2**31, 2**31, 32, dtype=np.int64).astype(np.int32)
    out = np.zeros((32, 8), np.int32)
    both(src, "bits", 1, 32, [x, a, b, out])
    xs = [int(v) for v in x]
    assert list(out[:, 0]) == [bin(v).count("1") for v in xs]
    assert list(out[:, 1]) == [32 - v.bit_length() for v in xs]
    assert list(out[:, 2]) == [(v & -v).bit_length() for v in xs]
    assert list(out[:, 3].view(np.uint32)) == [int(f"{v:032b}"[::-1], 2) for v in xs]
    sa, sb = a.view(np.int8).reshape(32, 4).astype(np.int64), b.view(np.int8).reshape(32, 4).astype(np.int64)
    ua, ub = a.view(np.uint8).reshape(32, 4).astype(np.int64), b.view(np.uint8).reshape(32, 4).astype(np.int64)
    assert np.array_equal(out[:, 4], (sa * sb).sum(1) + 7)
    assert np.array_equal(out[:, 5].view(np.uint32), (((ua * ub).sum(1) + 1) % 2**32).astype(np.uint32))
    assert (out[:, 6] == 1).all() and np.array_equal(out[:, 7], np.minimum(np.arange(32), 3))


@needs_cxx
def test_atomics_and_clock64():
    src = r"""
extern "C" __global__ void atomics(int* i, unsigned* u, unsigned long long* c, float* f, long long* clk) {
    int t = threadIdx.x + blockIdx.x * blockDim.x;
    atomicAdd(&i[0], 2);
    atomicSub(&i[1], 1);
    atomicMin(&i[2], -t);
    atomicMax(&i[3], t);
    atomicAnd(&u[0], ~(1u << (t % 32)));
    atomicOr(&u[1], 1u << (t % 32));
    atomicXor(&u[2], 1u << (t % 4));
    unsigned old = u[3], seen;
    do {                                              // an atomic increment built from atomicCAS
        seen = old;
        old = atomicCAS(&u[3], seen, seen + 1u);
    } while (old != seen);
    atomicAdd(&c[0], 1ull);
    atomicExch(&u[4], 7u);
    atomicAdd(&f[0], 0.5f);
    long long t0 = clock64();
    clk[t] = clock64() - t0;
}"""
    n = 96
    i = np.array([0, 0, 0, 0], np.int32)
    u = np.array([0xFFFFFFFF, 0, 0, 0, 0], np.uint32)
    c, f, clk = np.zeros(1, np.uint64), np.zeros(1, np.float32), np.zeros(n, np.int64)
    both(src, "atomics", 3, 32, [i, u, c, f, clk])
    assert list(i) == [2 * n, -n, -(n - 1), n - 1]
    assert list(u) == [0, 0xFFFFFFFF, 0, n, 7] and c[0] == n and f[0] == n / 2
    assert (clk > 0).all()


@needs_cxx
def test_vector_types_and_make_functions():
    src = r"""
extern "C" __global__ void vec(const float* x, float* y, int4* iv, uint4* uv, double2* dv) {
    int t = threadIdx.x;
    float3 a = make_float3(x[3 * t], x[3 * t + 1], x[3 * t + 2]);
    float4 b = make_float4(a.x, a.y, a.z, a.x + a.y + a.z);
    reinterpret_cast<float4*>(y)[t] = b;
    iv[t] = make_int4(t, -t, 2 * t, 3);
    uv[t] = make_uint4(t, t + 1u, t + 2u, 0xffffffffu);
    dv[t] = make_double2(a.x * 0.5, (double)t);
    float2 c = make_float2(1.0f, 2.0f);
    y[4 * blockDim.x + t] = c.x + c.y;
}"""
    x = np.arange(24, dtype=np.float32)
    y = np.zeros(8 * 4 + 8, np.float32)
    iv, uv, dv = np.zeros(32, np.int32), np.zeros(32, np.uint32), np.zeros(16, np.float64)
    both(src, "vec", 1, 8, [x, y, iv, uv, dv])
    xs = x.reshape(8, 3)
    assert np.array_equal(y[:32].reshape(8, 4), np.c_[xs, xs.sum(1)]) and (y[32:] == 3).all()
    t = np.arange(8)
    assert np.array_equal(iv.reshape(8, 4), np.c_[t, -t, 2 * t, np.full(8, 3)])
    assert np.array_equal(uv.reshape(8, 4), np.c_[t, t + 1, t + 2, np.full(8, 0xFFFFFFFF)].astype(np.uint32))
    assert np.array_equal(dv.reshape(8, 2), np.c_[xs[:, 0] * 0.5, t])
    with pytest.raises(ValueError, match="not a whole number of int4"):
        emulate(src, "vec", 1, 8, [x, y, np.zeros(30, np.int32), uv, dv])


@needs_cxx
def test_half_precision_arithmetic_and_conversions():
    src = r"""
#include <cuda_fp16.h>
extern "C" __global__ void halves(const __half* a, const __half* b, __half* out, float* f) {
    int t = threadIdx.x;
    __half x = a[t], y = b[t];
    out[4 * t + 0] = x + y;
    out[4 * t + 1] = __hmul(x, y);
    out[4 * t + 2] = __hfma(x, y, __float2half(1.0f));
    out[4 * t + 3] = __hmax(x, -y);
    f[t] = __half2float(x) * 2.0f + (__hlt(x, y) ? 1.0f : 0.0f);
}"""
    rng = np.random.default_rng(2)
    a = (rng.standard_normal(32) * 100).astype(np.float16)
    b = (rng.standard_normal(32) * 100).astype(np.float16)
    a[0], b[0] = np.float16(65504), np.float16(65504)  # overflows to inf in half
    out, f = np.zeros(128, np.float16), np.zeros(32, np.float32)
    both(src, "halves", 1, 32, [a, b, out, f])
    o = out.reshape(32, 4)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(over="ignore"):  # 65504 + 65504 overflows to inf in half, on both sides
        assert np.array_equal(o[:, 0], (a64 + b64).astype(np.float16))  # correctly rounded, like np.float16
        assert np.array_equal(o[:, 1], (a64 * b64).astype(np.float16))
        assert np.array_equal(o[:, 2], (a64 * b64 + 1).astype(np.float16))
    assert np.array_equal(o[:, 3], np.maximum(a, -b))
    assert np.array_equal(f, a.astype(np.float32) * 2 + (a < b))


@needs_cxx
def test_dynamic_shared_memory_is_sized_at_launch():
    src = r"""
extern "C" __global__ void rev(const float* x, float* y, int n) {
    extern __shared__ float buf[];
    int t = threadIdx.x;
    for (int i = t; i < n; i += blockDim.x) buf[i] = x[i];
    __syncthreads();
    for (int i = t; i < n; i += blockDim.x) y[i] = buf[n - 1 - i];
}"""
    x = np.arange(100, dtype=np.float32)
    y = np.zeros(100, np.float32)
    both(src, "rev", 1, 32, [x, y, np.int32(100)], shared_bytes=400)
    assert np.array_equal(y, x[::-1])
    with pytest.raises(KernelError, match=r"dynamic shared memory byte 396, past the end of the 396 bytes given at launch"):
        emulate(src, "rev", 1, 32, [x, y, np.int32(100)], shared_bytes=396)
    with pytest.raises(KernelError, match=r"launch gave 0 bytes of dynamic shared memory"):
        emulate(src, "rev", 1, 32, [x, y, np.int32(100)])


@needs_cxx
def test_wmma_tensor_core_tile():
    src = r"""
#include <mma.h>
using namespace nvcuda;
extern "C" __global__ void hgemm16(const half* a, const half* b, float* c) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
    wmma::fill_fragment(fc, 1.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(fc, fa, fb, fc);
    for (int i = 0; i < fc.num_elements; ++i) fc.x[i] *= 2.0f;
    wmma::store_matrix_sync(c, fc, 16, wmma::mem_row_major);
}"""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 16)).astype(np.float16)
    c = np.zeros((16, 16), np.float32)
    both(src, "hgemm16", 1, 32, [a, b, c])
    assert np.allclose(c, 2 * (a.astype(np.float64) @ b.astype(np.float64) + 1), rtol=1e-5, atol=1e-5)


def test_unsupported_constructs_say_so():
    ptx_mma = r"""
extern "C" __global__ void f(float* d) {
    float x = 0;
    asm volatile("mov.f32 %0, 1.0;" : "=f"(x));
    d[0] = x;
}"""
    compile_ptx(ptx_mma)  # fine for NVRTC ...
    with pytest.raises(EmulatorUnsupported, match=r"not supported by the CPU emulator: inline PTX"):
        emulate(ptx_mma, "f", 1, 1, [np.zeros(1, np.float32)])  # ... but the CPU cannot run PTX
    grid = "#include <cooperative_groups.h>\nextern \"C\" __global__ void g(int* x) { cooperative_groups::this_grid().sync(); }"
    with pytest.raises(EmulatorUnsupported, match="this_grid"):
        emulate(grid, "g", 1, 1, [np.zeros(1, np.int32)])


def test_shared_declarations_are_rewritten_keeping_line_numbers():
    src = ("__global__ void k() {\n  __shared__ __align__(16) float a[4][8], b[3];\n  extern __shared__ char dyn[];\n"
           "  __shared__ int\n    total;\n  int z = 0;\n}\n")
    out = prepare_source(src)
    assert out.count("\n") == src.count("\n")
    assert 'shared_alloc_t<mt_id<float[4][8]>>("a", "float a[4][8]", 16)' in out
    assert 'shared_alloc_t<mt_id<float[3]>>("b"' in out and 'shared_alloc_t<mt_id<int>>("total"' in out
    assert "static char* const dyn = reinterpret_cast<char*>(MT_DYN_BASE);" in out
    assert out.splitlines()[5] == "  int z = 0;"


@needs_cxx
def test_profile_counts_accesses_per_thread_and_records_writers():
    src = r"""
extern "C" __global__ void rowsum(const float* x, float* y, int cols) {
    __shared__ float part[32];
    float s = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s += x[blockIdx.x * cols + j];
    part[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int k = 0; k < 32; ++k) t += part[k];
        y[blockIdx.x] = t;
    }
}"""
    x = np.ones((3, 100), np.float32)
    y = np.zeros(3, np.float32)
    run = run_kernel(src, "rowsum", 3, 32, [x, y, np.int32(100)], profile=True)
    assert (y == 100).all() and run.reads == {"x": 300, "y": 0} and run.writes == {"x": 0, "y": 3}
    assert run.barriers == 3 and run.shared_writes == 96 and run.shared_reads == 96
    p = run.profile
    assert p["x"]["reads"].shape == (3, 32) and list(p["x"]["reads"][0, :5]) == [4, 4, 4, 4, 3]
    assert (p["shared"]["reads"][:, 0] == 32).all() and (p["shared"]["reads"][:, 1:] == 0).all()
    assert list(p["y"]["writer"]) == [0, 32, 64] and (p["x"]["writer"] == -1).all()


ASYNC_TILES = r"""
#include <cuda_pipeline.h>
// y[i] = 2 * x[i] through shared memory, 64 floats per step: 16 threads each copy one float4 asynchronously,
// two stages in flight (step s + 1 is copied while step s is read).
extern "C" __global__ void tiles(const float* __restrict__ x, float* __restrict__ y, int steps) {
    __shared__ __align__(16) float s[2][64];
    const int t = threadIdx.x;
    __pipeline_memcpy_async(&s[0][4 * t], &x[4 * t], 16);
    __pipeline_commit();
    for (int step = 0; step < steps; ++step) {
        if (step + 1 < steps) __pipeline_memcpy_async(&s[(step + 1) % 2][4 * t], &x[64 * (step + 1) + 4 * t], 16);
        __pipeline_commit();
        WAIT
        __syncthreads();
        for (int j = 0; j < 4; ++j) y[64 * step + 16 * j + t] = 2.0f * s[step % 2][16 * j + t];
        __syncthreads();
    }
}"""


@needs_cxx
def test_asynchronous_copies_land_when_their_thread_waits():
    """The __pipeline_* primitives (cp.async): a double-buffered copy is correct with the right wait and
    wrong without one (an unwaited copy never lands: the NaN fill shows), and NVRTC compiles it to cp.async."""
    x = np.arange(5 * 64, dtype=np.float32)
    y = np.zeros_like(x)
    src = ASYNC_TILES.replace("WAIT", "__pipeline_wait_prior(1);")
    assert "cp.async.cg.shared.global" in compile_ptx(src) or "cp.async.ca.shared.global" in compile_ptx(src)
    emulate(src, "tiles", 1, 16, [x, y, np.int32(5)])
    np.testing.assert_array_equal(y, 2 * x)
    y[:] = 0
    emulate(ASYNC_TILES.replace("WAIT", ""), "tiles", 1, 16, [x, y, np.int32(5)])
    assert np.isnan(y).all(), "copies never waited for must not land"
    y[:] = 0
    emulate(ASYNC_TILES.replace("WAIT", "__pipeline_wait_prior(2);"), "tiles", 1, 16, [x, y, np.int32(5)])
    # waiting for all but the 2 latest batches leaves each step's own batch in flight: the first two steps
    # read the NaN fill, the later ones the data two steps old
    assert np.isnan(y[:128]).all() and np.array_equal(y[128:], 2 * x[:-128])


ASYNC_ONE = r"""
#include <cuda_pipeline_primitives.h>
extern "C" __global__ void one(const float* __restrict__ x, float* __restrict__ y, int offset, int zfill) {
    __shared__ __align__(16) float s[32];
    const int t = threadIdx.x;
    __pipeline_memcpy_async(&s[4 * t], &x[4 * t + offset], 16, zfill);
    __pipeline_commit();
    __pipeline_wait_prior(0);
    BARRIER
    y[t] = s[(4 * t + 4) % 32];
}"""


@needs_cxx
def test_asynchronous_copies_are_checked_like_any_access():
    x = np.arange(40, dtype=np.float32)
    y = np.zeros(8, dtype=np.float32)
    ok = ASYNC_ONE.replace("BARRIER", "__syncthreads();")
    emulate(ok, "one", 1, 8, [x, y, np.int32(0), np.int32(8)])  # zfill 8: the last two floats of each copy are 0
    np.testing.assert_array_equal(y, [4, 8, 12, 16, 20, 24, 28, 0])
    with pytest.raises(KernelError, match=r"misaligned asynchronous copy: thread \(0,0,0\) of block \(0,0,0\) reads 16 "
                                          r"bytes .* at kernel\.cu:6"):
        emulate(ok, "one", 1, 8, [x, y, np.int32(1), np.int32(0)])
    with pytest.raises(KernelError, match=r"reads x\[40\] \(16 bytes\) at kernel\.cu:6, past the end of argument 'x'"):
        emulate(ok, "one", 1, 8, [x, y, np.int32(12), np.int32(0)])
    with pytest.raises(KernelError, match=r"race on shared memory .* at kernel\.cu:[69]"):
        emulate(ASYNC_ONE.replace("BARRIER", ""), "one", 1, 8, [x, y, np.int32(0), np.int32(0)])
    to_global = ASYNC_ONE.replace("__pipeline_memcpy_async(&s[4 * t]", "__pipeline_memcpy_async(&y[0]")
    with pytest.raises(KernelError, match=r"__pipeline_memcpy_async: .* not shared memory"):
        emulate(to_global.replace("BARRIER", ""), "one", 1, 8, [x, np.zeros(32, np.float32), np.int32(0), np.int32(0)])
