"""Lesson 08: CUDA C kernels, graded on any machine and, where a GPU is present, on it too.

Without a GPU each kernel is (1) compiled to PTX by NVRTC, whose counts show its structure, and
(2) run on the CPU by `course.cuda_c.emulate`: every access checked against the argument arrays
and shared arrays, a happens-before race check on shared memory, and two schedules (threads
forward and in reverse) whose results must agree. A missing barrier or guard therefore fails,
with the threads and lines involved. Tests marked `gpu` run the same kernels through CuPy.
"""

import re

import numpy as np
import pytest

from course.cuda_c import (
    KernelError, NvrtcUnavailable, compile_ptx, emulate, emulator_unavailable, kernel_params, ptx_stats, run_kernel,
)

pytestmark = pytest.mark.lesson08

CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def need_compiler():
    why = emulator_unavailable()
    if why is not None:
        pytest.skip(why)


def assert_close(got, want, what, rtol=1e-5, atol=1e-6, notes=()):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: expected shape {want.shape}, got {got.shape}"
    ok = np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=False)
    if not ok.all():
        bad = np.argwhere(~ok)
        i = tuple(int(v) for v in bad[0])
        msg = (f"{what}: {len(bad)} of {want.size} elements wrong; first at index {i}: "
               f"expected {want[i]}, got {got[i]}")
        nan = np.isnan(got) & ~np.isnan(want)
        if nan.any():
            msg += (f". {int(nan.sum())} results are NaN: the emulator fills shared memory with NaN bytes, so a NaN "
                    "usually means a value read from shared memory before any thread wrote it (a tile slot never "
                    "loaded, an index off by one), or an output element no thread wrote")
        for note in notes:
            msg += f". Note: {note}"
        raise AssertionError(msg)


def compiled(source, what):
    """PTX stats of `source`, with NVRTC's message as the failure if it does not compile."""
    try:
        return ptx_stats(compile_ptx(source))
    except NvrtcUnavailable:
        raise  # skipped with its reason (conftest.py)
    except Exception as exc:  # CudaCompileError carries NVRTC's log
        raise AssertionError(f"{what} does not compile:\n{exc}") from None


def gelu(v):
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))


# ------------------------------------------------------------------ 8.1 ElementwiseKernel
def names_of(params, what):
    out = []
    for p in filter(None, (s.strip() for s in params.split(","))):
        words = p.split()
        assert len(words) == 2, f"{what}: each parameter is 'TYPE NAME', got {p!r}"
        out.append(tuple(words))
    return out


def elementwise_source(spec, dtype):
    """The CUDA C that ElementwiseKernel generates for `spec`, in miniature: one thread per element,
    parameters bound by name; bias broadcast along the last axis."""
    in_params, out_params, op = spec
    ins, outs = names_of(in_params, "in_params"), names_of(out_params, "out_params")
    assert [n for _, n in ins] == ["x", "bias"], f"in_params should declare x and bias, got {in_params!r}"
    assert [n for _, n in outs] == ["y"], f"out_params should declare y, got {out_params!r}"
    assert all(t == "T" for t, _ in ins + outs), f"declare every parameter with the type placeholder T: {spec[:2]}"
    c = CTYPE[np.dtype(dtype)]
    return f"""
typedef {c} T;
extern "C" __global__ void elementwise(const {c}* _x, const {c}* _bias, {c}* _y, int n, int cols) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const T x = _x[i];
    const T bias = _bias[i % cols];
    T& y = _y[i];
    {op};
}}
"""


def run_elementwise(spec, x, bias):
    src = elementwise_source(spec, x.dtype)
    y = np.zeros_like(x)
    emulate(src, "elementwise", (x.size + 127) // 128, 128,
            [x, bias, y, np.int32(x.size), np.int32(bias.size)])
    return y


@pytest.mark.exercise("8.1")
def test_bias_gelu_spec_matches_gelu(lesson):
    spec = lesson.bias_gelu_spec()
    need_compiler()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 45)).astype(np.float32) * 3
    x[0, :5] = [-20, -5, 0, 5, 20]
    bias = rng.standard_normal(45).astype(np.float32)
    want = gelu((x.astype(np.float64) + bias)).astype(np.float32)
    assert_close(run_elementwise(spec, x, bias), want, "gelu(x + bias), float32", rtol=1e-5, atol=1e-6)


@pytest.mark.exercise("8.1")
def test_bias_gelu_spec_is_generic_and_compiles(lesson):
    spec = lesson.bias_gelu_spec()
    need_compiler()
    compiled(elementwise_source(spec, np.float64), "the elementwise kernel (float64)")
    rng = np.random.default_rng(1)
    x, bias = rng.standard_normal((3, 17)), rng.standard_normal(17)
    assert_close(run_elementwise(spec, x, bias), gelu(x + bias), "gelu(x + bias), float64", rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ 8.2 ReductionKernel
def reduction_source(spec, dtype):
    """A block-per-row reduction built from the four expressions, the way ReductionKernel uses them."""
    keys = {"in_params", "out_params", "map_expr", "reduce_expr", "post_map_expr", "identity"}
    assert set(spec) >= keys, f"the spec needs keys {sorted(keys)}, got {sorted(spec)}"
    assert [n for _, n in names_of(spec["in_params"], "in_params")] == ["x"], "in_params should be 'T x'"
    assert [n for _, n in names_of(spec["out_params"], "out_params")] == ["y"], "out_params should be 'T y'"
    c = CTYPE[np.dtype(dtype)]
    return f"""
typedef {c} T;
typedef {c} _type_reduce;
__device__ _type_reduce _combine(_type_reduce a, _type_reduce b) {{ return ({spec["reduce_expr"]}); }}
extern "C" __global__ void reduce_rows(const {c}* _x, {c}* _y, int rows, int cols) {{
    __shared__ _type_reduce part[128];
    _type_reduce acc = (_type_reduce)({spec["identity"]});
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {{
        const T x = _x[blockIdx.x * cols + j];
        acc = _combine(acc, (_type_reduce)({spec["map_expr"]}));
    }}
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {{
        if (threadIdx.x < s) part[threadIdx.x] = _combine(part[threadIdx.x], part[threadIdx.x + s]);
        __syncthreads();
    }}
    if (threadIdx.x == 0) {{
        _type_reduce a = part[0];
        T& y = _y[blockIdx.x];
        {spec["post_map_expr"]};
    }}
}}
"""


@pytest.mark.exercise("8.2")
def test_l2norm_spec_matches_numpy(lesson):
    spec = lesson.l2norm_spec()
    need_compiler()
    rng = np.random.default_rng(2)
    for cols in [1, 5, 300]:
        x = rng.standard_normal((4, cols)).astype(np.float32)
        y = np.zeros(4, dtype=np.float32)
        emulate(reduction_source(spec, np.float32), "reduce_rows", 4, 128, [x, y, np.int32(4), np.int32(cols)])
        assert_close(y, np.linalg.norm(x.astype(np.float64), axis=1), f"row norms of a (4, {cols}) matrix", rtol=1e-5)


@pytest.mark.exercise("8.2")
def test_l2norm_spec_compiles_for_float64(lesson):
    spec = lesson.l2norm_spec()
    compiled(reduction_source(spec, np.float64), "the reduction kernel (float64)")


@pytest.mark.exercise("8.2")
def test_l2norm_spec_is_exact_in_float64(lesson):
    """T is double for float64 inputs: every expression must stay in double (sqrt, not sqrtf: a float
    intrinsic rounds the result to 7 digits)."""
    spec = lesson.l2norm_spec()
    need_compiler()
    rng = np.random.default_rng(3)
    for cols in [1, 7, 300]:
        x = rng.standard_normal((3, cols)) * 1e3
        y = np.zeros(3)
        emulate(reduction_source(spec, np.float64), "reduce_rows", 3, 128, [x, y, np.int32(3), np.int32(cols)])
        assert_close(y, np.linalg.norm(x, axis=1), f"float64 row norms of a (3, {cols}) matrix (computed in double)",
                     rtol=1e-13, atol=0)


# ------------------------------------------------------------------ SGEMM (8.3, 8.4, 8.5)
SGEMM_SIGNATURE = [("A", "float", True), ("B", "float", True), ("C", "float", True),
                   ("M", "int", False), ("N", "int", False), ("K", "int", False)]


def check_signature(source, name):
    try:
        params = kernel_params(source, name)
    except ValueError as exc:
        raise AssertionError(str(exc)) from None
    got = [(p.name, p.ctype, p.pointer) for p in params]
    want = [(n, t, p) for n, t, p in SGEMM_SIGNATURE]
    assert [(t, p) for _, t, p in got] == [(t, p) for _, t, p in want], (
        f"{name} must take (const float* A, const float* B, float* C, int M, int N, int K); "
        f"got ({', '.join(map(str, params))})")


def run_sgemm(source, name, launch, A, B, out_dtype=np.float32, **kw):
    M, K = A.shape
    N = B.shape[1]
    C = np.full((M, N), np.nan, dtype=out_dtype)
    grid, block = launch(M, N)
    try:
        run = run_kernel(source, name, grid, block, [A, B, C, np.int32(M), np.int32(N), np.int32(K)], **kw)
    except KernelError as exc:
        raise AssertionError(f"{name} on {M}x{K} @ {K}x{N} failed on the emulator: {exc}") from None
    return C, run


def check_sgemm(source, name, launch, shapes, dtype=np.float32, rtol=1e-4):
    need_compiler()
    rng = np.random.default_rng(3)
    for M, K, N in shapes:
        A = rng.standard_normal((M, K)).astype(dtype)
        B = rng.standard_normal((K, N)).astype(dtype)
        want = A.astype(np.float64) @ B.astype(np.float64)
        got, run = run_sgemm(source, name, launch, A, B)
        assert_close(got, want, f"{name}: C = A @ B for A {M}x{K}, B {K}x{N}", rtol=rtol, atol=rtol * np.sqrt(K),
                     notes=run.notes)


@pytest.mark.exercise("8.3")
def test_sgemm_naive_compiles_with_the_right_signature(lesson):
    src = lesson.sgemm_naive_source()
    check_signature(src, "sgemm_naive")
    compiled(src, "sgemm_naive")


@pytest.mark.exercise("8.3")
def test_sgemm_naive_correct_on_odd_shapes(lesson):
    src = lesson.sgemm_naive_source()
    check_sgemm(src, "sgemm_naive", lesson.sgemm_naive_launch,
                [(1, 1, 1), (37, 29, 45), (8, 64, 32), (70, 3, 9), (2, 130, 71)])


@pytest.mark.exercise("8.4")
def test_sgemm_tiled_uses_shared_tiles_and_barriers(lesson):
    src = lesson.sgemm_tiled_source()
    check_signature(src, "sgemm_tiled")
    st = compiled(src, "sgemm_tiled")
    assert st.shared_bytes == 2 * 16 * 16 * 4, (
        f"sgemm_tiled should stage two 16x16 float tiles (2048 bytes of shared memory); PTX declares {st.shared_bytes}")
    assert st.ld_shared >= 16 and st.fma_f32 >= 16, (
        f"the inner loop should run its 16 FMAs out of shared memory (unrolled); PTX has {st.ld_shared} "
        f"shared loads and {st.fma_f32} fma.rn.f32")
    assert st.bar_sync >= 2, f"a tiled matmul needs two barriers per tile step; PTX has {st.bar_sync}"


@pytest.mark.exercise("8.4")
def test_sgemm_tiled_correct_on_odd_shapes(lesson):
    src = lesson.sgemm_tiled_source()
    check_sgemm(src, "sgemm_tiled", lesson.sgemm_tiled_launch,
                [(1, 1, 1), (16, 16, 16), (37, 29, 45), (33, 50, 17), (5, 70, 40)])


@pytest.mark.exercise("8.5")
def test_sgemm_regtile_blocks_in_registers(lesson):
    src = lesson.sgemm_regtile_source()
    check_signature(src, "sgemm_regtile")
    st = compiled(src, "sgemm_regtile")
    assert st.fma_f32 >= 64, (
        f"each thread should do an 8x8 outer product per k (64 FMAs, unrolled so acc stays in registers); "
        f"PTX has {st.fma_f32} fma.rn.f32")
    ratio = st.ld_shared / st.fma_f32
    assert ratio <= 0.25 + 1e-9, (
        f"register blocking loads 16 shared values per 64 FMAs (0.25 per FMA); this kernel has "
        f"{st.ld_shared} shared loads for {st.fma_f32} FMAs ({ratio:.2f} per FMA)")
    assert 0 < st.shared_bytes <= 48 * 1024, f"static shared memory must be 1..49152 bytes, PTX declares {st.shared_bytes}"
    assert st.bar_sync >= 2, f"two barriers per K step are needed; PTX has {st.bar_sync}"
    assert not re.search(r"\.local\s", compile_ptx(src)), (
        "the kernel uses local memory (an array the compiler could not keep in registers): "
        "use compile-time sizes and #pragma unroll")


@pytest.mark.exercise("8.5")
def test_sgemm_regtile_correct_on_odd_shapes(lesson):
    src = lesson.sgemm_regtile_source()
    check_sgemm(src, "sgemm_regtile", lesson.sgemm_regtile_launch,
                [(1, 1, 1), (128, 8, 128), (200, 21, 136), (129, 9, 257), (7, 300, 5)])


# ------------------------------------------------------------------ 8.6 fused softmax
def softmax_ref(x):
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=1, keepdims=True)


def run_softmax(lesson, src, x, kernel="softmax_rows", launch=None, **kw):
    y = np.full_like(x, np.nan)
    try:
        run = run_kernel(src, kernel, *(launch or lesson.softmax_launch)(*x.shape),
                         [x, y, np.int32(x.shape[0]), np.int32(x.shape[1])], **kw)
    except KernelError as exc:
        raise AssertionError(f"{kernel} on a {x.shape} matrix failed on the emulator: {exc}") from None
    return y, run


@pytest.mark.exercise("8.6")
def test_softmax_rows_correct_for_any_row_length(lesson):
    src = lesson.softmax_source()
    params = kernel_params(src, "softmax_rows")
    assert [(p.ctype, p.pointer) for p in params] == [("float", True), ("float", True), ("int", False), ("int", False)], (
        f"softmax_rows must take (const float* x, float* y, int rows, int cols), got ({', '.join(map(str, params))})")
    compiled(src, "softmax_rows")
    need_compiler()
    rng = np.random.default_rng(4)
    for rows, cols in [(3, 1), (4, 33), (2, 1000), (5, 257)]:
        x = (rng.standard_normal((rows, cols)) * 5).astype(np.float32)
        y, run = run_softmax(lesson, src, x)
        assert_close(y, softmax_ref(x), f"softmax of a ({rows}, {cols}) matrix", rtol=1e-5, atol=1e-7, notes=run.notes)


@pytest.mark.exercise("8.6")
def test_softmax_rows_is_stable(lesson):
    src = lesson.softmax_source()
    need_compiler()
    x = np.array([[1e4, 1e4 - 1, 1e4 - 2, -1e4],
                  [-np.inf, 0.0, 1.0, -np.inf],
                  [88.0, 89.0, 90.0, 91.0]], dtype=np.float32)
    y, _ = run_softmax(lesson, src, x)
    assert np.isfinite(y).all(), f"softmax of large / -inf inputs must be finite, got\n{y}"
    assert_close(y, softmax_ref(x), "softmax of rows with values 1e4 and -inf", rtol=1e-5, atol=1e-7)


@pytest.mark.exercise("8.6")
def test_softmax_rows_of_very_negative_logits(lesson):
    """Masked attention rows: every logit far below 0. A running max that starts at 0 instead of
    -inf stays 0, every exp underflows, and the row comes out 0 / 0 = NaN."""
    src = lesson.softmax_source()
    need_compiler()
    x = np.array([[-1e4, -1e4 - 1, -1e4 - 3, -1e4 - 0.5, -1e4],
                  [-np.inf, -200.0, -np.inf, -201.0, -np.inf],
                  [-120.0, -110.0, -100.0, -130.0, -90.0]], dtype=np.float32)
    y, _ = run_softmax(lesson, src, x)
    assert np.isfinite(y).all(), (f"softmax of rows whose logits are all very negative must be finite (start the "
                                  f"running maximum at -INFINITY, not 0), got\n{y}")
    assert_close(y, softmax_ref(x), "softmax of rows of very negative (masked) logits", rtol=1e-5, atol=1e-7)


@pytest.mark.exercise("8.6")
def test_softmax_rows_spreads_the_row_over_the_block(lesson):
    src = lesson.softmax_source()
    st = compiled(src, "softmax_rows")
    assert st.shfl >= 2, (f"the max and the sum should be warp reductions with __shfl_xor_sync (shfl.sync in the PTX); "
                          f"the PTX has {st.shfl} shuffles")
    need_compiler()
    rows, cols = 2, 1000
    x = np.random.default_rng(13).standard_normal((rows, cols)).astype(np.float32)
    y, run = run_softmax(lesson, src, x, profile=True, schedules=("forward",))
    assert_close(y, softmax_ref(x), f"softmax of a ({rows}, {cols}) matrix", rtol=1e-5, atol=1e-7)
    threads = lesson.softmax_launch(rows, cols)[1][0]
    per_thread = 3 * -(-cols // threads)
    busiest = int(run.profile["x"]["reads"].max())
    assert busiest <= per_thread + 2, (
        f"one thread reads {busiest} elements of x for rows of {cols}; with {threads} threads per row each should "
        f"read at most about {per_thread} (three passes over its share): the row must be split over the block")
    writers = [len(np.unique(run.profile["y"]["writer"][r])) for r in range(rows)]
    assert min(writers) >= min(cols, threads), (
        f"each row's {cols} outputs should be written by the block's {threads} threads; a row was written by "
        f"{min(writers)} thread(s)")


# ------------------------------------------------------------------ 8.7 CupyBackend
class Counting:
    def __init__(self):
        self.calls = []

    def __call__(self, a, b):
        self.calls.append((a.shape, b.shape, a.flags.c_contiguous and b.flags.c_contiguous))
        return np.matmul(a, b)


@pytest.mark.exercise("8.7")
def test_backend_sends_2d_float32_to_the_kernel(lesson):
    k = Counting()
    be = lesson.CupyBackend(k, xp=np)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((5, 3)).astype(np.float32)
    b = rng.standard_normal((7, 3)).astype(np.float32).T  # a transposed (non-contiguous) view
    out = be.matmul(a, b)
    assert k.calls, "a 2-D float32 product should go to matmul_2d (your SGEMM), but matmul_2d was not called"
    assert k.calls[0][2], "matmul_2d must receive C-contiguous operands (the kernel reads raw row-major memory)"
    assert_close(out, a @ b, "CupyBackend.matmul 2-D float32")


class FakeDeviceArray:
    """An array on a pretend device: NumPy cannot convert it (like a CuPy array), only FakeXP can."""

    __array_priority__ = 1000

    def __init__(self, data):
        self.data = np.asarray(data)

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    flags = property(lambda self: self.data.flags)
    T = property(lambda self: FakeDeviceArray(self.data.T))

    def __array__(self, *args, **kwargs):
        raise TypeError("implicit conversion of a device array to NumPy (use the backend's array module, self.xp)")


class FakeXP:
    """A stand-in for CuPy: the array module of FakeDeviceArray."""
    float32, float64 = np.float32, np.float64

    @staticmethod
    def _d(a):
        return a.data if isinstance(a, FakeDeviceArray) else np.asarray(a)

    def asarray(self, a, dtype=None):
        return FakeDeviceArray(np.asarray(self._d(a), dtype=dtype))

    def ascontiguousarray(self, a):
        return FakeDeviceArray(np.ascontiguousarray(self._d(a)))

    def matmul(self, a, b):
        return FakeDeviceArray(np.matmul(self._d(a), self._d(b)))


@pytest.mark.exercise("8.7")
def test_backend_uses_its_array_module_not_numpy(lesson):
    seen = []

    def kernel(a, b):
        seen.append((type(a).__name__, type(b).__name__))
        return FakeDeviceArray(np.matmul(a.data, b.data))

    be = lesson.CupyBackend(kernel, xp=FakeXP())
    rng = np.random.default_rng(14)
    a = FakeDeviceArray(rng.standard_normal((4, 3)).astype(np.float32))
    b = FakeDeviceArray(rng.standard_normal((5, 3)).astype(np.float32).T)
    try:
        out = be.matmul(a, b)
    except TypeError as exc:
        raise AssertionError(f"CupyBackend.matmul converted a device array with NumPy ({exc}); on a GPU the operands "
                             "are CuPy arrays: use self.xp.asarray / self.xp.ascontiguousarray") from None
    assert seen == [("FakeDeviceArray", "FakeDeviceArray")], f"matmul_2d should get the backend's arrays, got {seen}"
    assert isinstance(out, FakeDeviceArray), f"the result should stay on the device, got {type(out).__name__}"
    assert_close(out.data, a.data @ b.data, "CupyBackend.matmul on device arrays")


@pytest.mark.exercise("8.7")
def test_backend_falls_back_and_checks_shapes(lesson):
    k = Counting()
    be = lesson.CupyBackend(k, xp=np)
    rng = np.random.default_rng(6)
    a64, b64 = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    assert_close(be.matmul(a64, b64), a64 @ b64, "float64 matmul")
    a3, b3 = rng.standard_normal((2, 4, 3)).astype(np.float32), rng.standard_normal((3, 5)).astype(np.float32)
    assert_close(be.matmul(a3, b3), a3 @ b3, "batched matmul", rtol=1e-5)
    v = rng.standard_normal(3).astype(np.float32)
    assert_close(be.matmul(a3[0], v), a3[0] @ v, "matrix @ vector", rtol=1e-5)
    a32, b64 = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((3, 2))
    assert_close(be.matmul(a32, b64), a32 @ b64, "float32 @ float64")
    assert_close(be.matmul(b64.T, a32.T), b64.T @ a32.T, "float64 @ float32")
    assert not k.calls, (f"only products of two 2-D float32 operands go to matmul_2d (check both: the kernel would "
                         f"read float64 bytes as float32); it was called with {k.calls}")
    with pytest.raises(ValueError) as err:
        be.matmul(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32))
    assert "(2, 3)" in str(err.value) and "(4, 5)" in str(err.value), (
        f"the shape-mismatch error should name both shapes, got: {err.value}")


@pytest.mark.exercise("8.7")
def test_tensors_on_the_cuda_device_use_the_kernel_forward_and_backward(lesson):
    from minitorch.autograd import Tensor
    from minitorch.tensor import use_backend

    k = Counting()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    with use_backend("cuda", lesson.CupyBackend(k, xp=np)):
        xt = Tensor(x, device="cuda", requires_grad=True)
        wt = Tensor(w, device="cuda", requires_grad=True)
        (xt @ wt).sum().backward()
        gx, gw = xt.backend.to_numpy(xt.grad.data), wt.backend.to_numpy(wt.grad.data)
    assert len(k.calls) >= 1, "x @ w on device 'cuda' should call the backend's kernel"
    assert_close(gx, np.ones((6, 3), np.float32) @ w.T, "gradient of x", rtol=1e-5)
    assert_close(gw, x.T @ np.ones((6, 3), np.float32), "gradient of w", rtol=1e-5)


# ------------------------------------------------------------------ 8.8-8.11: the rest of the ladder
VEC_SHAPES = [(1, 4, 4), (200, 20, 136), (129, 12, 260), (7, 300, 8)]  # N and K multiples of 4, M any


def check_vector_kernel(src, name):
    check_signature(src, name)
    st = compiled(src, name)
    assert st.ld_global_v4 >= 2, (f"{name} should load A and B from global memory as float4 (ld.global.v4 in the "
                                  f"PTX); it has {st.ld_global_v4} such loads")
    assert st.fma_f32 >= 64, f"each thread should do 64 FMAs per k, unrolled; PTX has {st.fma_f32} fma.rn.f32"
    ratio = st.ld_shared / st.fma_f32
    assert st.ld_shared_v4 >= 4 and ratio <= 1 / 16 + 1e-9, (
        f"{name} should read shared memory as float4: 4 ld.shared.v4 per 64 FMAs (1/16 per FMA); PTX has "
        f"{st.ld_shared_v4} ld.shared.v4 and {st.ld_shared} shared loads for {st.fma_f32} FMAs ({ratio:.3f} per FMA)")
    assert st.local_bytes == 0, (f"{name} uses {st.local_bytes} bytes of local memory per thread (an array the "
                                 "compiler could not keep in registers): use compile-time sizes and #pragma unroll")
    return st


@pytest.mark.exercise("8.8")
def test_sgemm_vec4_loads_float4(lesson):
    check_vector_kernel(lesson.sgemm_vec4_source(), "sgemm_vec4")


@pytest.mark.exercise("8.8")
def test_sgemm_vec4_correct_and_padded_by_the_wrapper(lesson):
    src = lesson.sgemm_vec4_source()
    check_sgemm(src, "sgemm_vec4", lesson.sgemm_regtile_launch, VEC_SHAPES)
    rng = np.random.default_rng(15)
    A, B = rng.standard_normal((37, 29)).astype(np.float32), rng.standard_normal((29, 45)).astype(np.float32)
    assert_close(lesson.sgemm_emulated(A, B, "vec4"), A.astype(np.float64) @ B, "sgemm(a, b, 'vec4') on 37x29 @ 29x45 "
                 "(the wrapper pads N and K to multiples of 4)", rtol=1e-4, atol=1e-3)


@pytest.mark.exercise("8.9")
def test_sgemm_warptile_correct(lesson):
    src = lesson.sgemm_warptile_source()
    check_vector_kernel(src, "sgemm_warptile")
    check_sgemm(src, "sgemm_warptile", lesson.sgemm_regtile_launch, VEC_SHAPES)


@pytest.mark.exercise("8.9")
def test_sgemm_warptile_gives_each_warp_a_64x32_tile(lesson):
    src = lesson.sgemm_warptile_source()
    need_compiler()
    rng = np.random.default_rng(16)
    M = N = 256
    A, B = rng.standard_normal((M, 8)).astype(np.float32), rng.standard_normal((8, N)).astype(np.float32)
    C, run = run_sgemm(src, "sgemm_warptile", lesson.sgemm_regtile_launch, A, B, profile=True, schedules=("forward",))
    assert_close(C, A.astype(np.float64) @ B, "sgemm_warptile 256x8 @ 8x256", rtol=1e-4, atol=1e-4)
    writer = run.profile["C"]["writer"]
    assert (writer >= 0).all(), "every element of C should be written"
    for w in np.unique(writer // 32):
        rows, cols = np.nonzero(writer // 32 == w)
        h, wd = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
        assert (h, wd) == (64, 32) and h * wd == rows.size, (
            f"warp {w % 8} of block {w // 8} writes {rows.size} elements of C spread over rows {rows.min()}..{rows.max()} "
            f"and columns {cols.min()}..{cols.max()}; with warp tiling it writes one dense 64 x 32 tile")


@pytest.mark.exercise("8.10")
def test_sgemm_dbuf_has_two_stages_and_one_barrier_per_step(lesson):
    src = lesson.sgemm_dbuf_source()
    st = check_vector_kernel(src, "sgemm_dbuf")
    one_stage = (8 * 128 + 8 * 128) * 4
    assert st.shared_bytes >= 2 * one_stage, (
        f"double buffering keeps two stages of the A and B tiles in shared memory (at least {2 * one_stage} bytes); "
        f"the PTX declares {st.shared_bytes}")
    need_compiler()
    rng = np.random.default_rng(17)
    M, K, N = 130, 300, 136
    A, B = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    C, run = run_sgemm(src, "sgemm_dbuf", lesson.sgemm_regtile_launch, A, B)
    assert_close(C, A.astype(np.float64) @ B, f"sgemm_dbuf {M}x{K} @ {K}x{N}", rtol=1e-4, atol=1e-4 * np.sqrt(K),
                 notes=run.notes)
    blocks = int(np.prod(lesson.sgemm_regtile_launch(M, N)[0]))
    steps = -(-K // 8)
    assert run.barriers <= blocks * (steps + 1), (
        f"with two stages one __syncthreads() per K step is enough: each block should pass {steps} + 1 barriers for "
        f"K = {K}, but passed {run.barriers / blocks:.0f}")


@pytest.mark.exercise("8.10")
def test_sgemm_dbuf_correct(lesson):
    check_sgemm(lesson.sgemm_dbuf_source(), "sgemm_dbuf", lesson.sgemm_regtile_launch, VEC_SHAPES)


@pytest.mark.exercise("8.11")
def test_hgemm_wmma_uses_tensor_cores(lesson):
    src = lesson.hgemm_wmma_source()
    params = kernel_params(src, "hgemm_wmma")
    assert [(p.ctype, p.pointer) for p in params] == [("half", True), ("half", True), ("float", True), ("int", False),
                                                      ("int", False), ("int", False)] or \
        [(p.ctype, p.pointer) for p in params] == [("__half", True), ("__half", True), ("float", True), ("int", False),
                                                   ("int", False), ("int", False)], (
        f"hgemm_wmma must take (const half* A, const half* B, float* C, int M, int N, int K), got "
        f"({', '.join(map(str, params))})")
    st = compiled(src, "hgemm_wmma")
    assert st.mma >= 4 and st.wmma_load >= 2, (
        f"each warp should do 2 x 2 tensor-core products per K step (wmma::mma_sync -> wmma.mma.sync) on fragments "
        f"loaded with wmma::load_matrix_sync; the PTX has {st.mma} mma and {st.wmma_load} wmma.load instructions")


@pytest.mark.exercise("8.11")
def test_hgemm_wmma_correct(lesson):
    src = lesson.hgemm_wmma_source()
    need_compiler()
    rng = np.random.default_rng(18)
    for M, K, N in [(16, 16, 16), (48, 32, 80), (96, 64, 32)]:
        A, B = rng.standard_normal((M, K)).astype(np.float16), rng.standard_normal((K, N)).astype(np.float16)
        C, run = run_sgemm(src, "hgemm_wmma", lesson.hgemm_launch, A, B)
        assert_close(C, A.astype(np.float64) @ B.astype(np.float64), f"hgemm_wmma {M}x{K} @ {K}x{N} (half inputs, "
                     "float result)", rtol=1e-4, atol=1e-4 * np.sqrt(K), notes=run.notes)
    A, B = rng.standard_normal((37, 29)).astype(np.float16), rng.standard_normal((29, 45)).astype(np.float16)
    assert_close(lesson.hgemm_emulated(A, B), A.astype(np.float64) @ B.astype(np.float64),
                 "hgemm(a, b) on 37x29 @ 29x45 (the wrapper pads to multiples of 16)", rtol=1e-4, atol=1e-3)


# ------------------------------------------------------------------ 8.12 softmax at the memory's speed
def run_softmax_v4(lesson, src, x, **kw):
    return run_softmax(lesson, src, x, "softmax_rows_v4", lesson.softmax_v4_launch, **kw)


@pytest.mark.exercise("8.12")
def test_softmax_v4_correct_for_rows_of_many_lengths(lesson):
    src = lesson.softmax_v4_source()
    params = kernel_params(src, "softmax_rows_v4")
    assert [(p.ctype, p.pointer) for p in params] == [("float", True), ("float", True), ("int", False), ("int", False)], (
        f"softmax_rows_v4 must take (const float* x, float* y, int rows, int cols), got "
        f"({', '.join(map(str, params))})")
    compiled(src, "softmax_rows_v4")
    need_compiler()
    rng = np.random.default_rng(21)
    # a row of one float4; a block of one warp with idle threads; rows that fill some of the slots; a block
    # whose last warp is partly used; every slot of every thread (8 float4s x 64 threads)
    # and the longest row: 1024 threads, 32 warps' partials
    for rows, cols in [(3, 4), (2, 36), (4, 132), (2, 1000), (1, 2052), (1, 2048), (1, 32768)]:
        x = (rng.standard_normal((rows, cols)) * 5).astype(np.float32)
        y, run = run_softmax_v4(lesson, src, x)
        assert_close(y, softmax_ref(x), f"softmax_rows_v4 of a ({rows}, {cols}) matrix", rtol=1e-5, atol=1e-7,
                     notes=run.notes)


@pytest.mark.exercise("8.12")
def test_softmax_v4_is_stable_on_large_infinite_and_very_negative_rows(lesson):
    src = lesson.softmax_v4_source()
    need_compiler()
    x = np.array([[1e4, 1e4 - 1, 1e4 - 2, -1e4, 0.0, 1.0, 2.0, 3.0],
                  [-np.inf, 0.0, 1.0, -np.inf, -np.inf, -np.inf, 5.0, -np.inf],
                  [-1e4, -1e4 - 1, -1e4 - 3, -1e4 - 0.5, -1e4, -1e4 - 7, -1e4 - 2, -1e4 - 9],
                  [-120.0, -110.0, -100.0, -130.0, -90.0, -95.0, -np.inf, -105.0]], dtype=np.float32)
    y, _ = run_softmax_v4(lesson, src, x)
    assert np.isfinite(y).all(), (f"softmax of rows with 1e4, -inf or only very negative logits must be finite (the "
                                  f"running maximum starts at -INFINITY; the unused slots hold -INFINITY), got\n{y}")
    assert_close(y, softmax_ref(x), "softmax_rows_v4 of rows with 1e4, -inf and very negative logits", rtol=1e-5,
                 atol=1e-7)
    # the max must see every element of every float4: one logit 110 above the rest, in each lane of a float4
    # and in a thread's later slots, overflows exp if it is missed
    x = np.full((4, 2052), -50.0, np.float32)
    for r, j in enumerate((2051, 403, 1026, 4 * 300 + 2)):
        x[r, j] = 60.0
    y, _ = run_softmax_v4(lesson, src, x)
    assert np.isfinite(y).all(), ("softmax of rows with one large logit among small ones must be finite: the max "
                                  "should cover every element (each lane of each float4, every slot)")
    assert_close(y, softmax_ref(x), "softmax_rows_v4 of rows with one logit 110 above the rest", rtol=1e-5, atol=1e-7)


@pytest.mark.exercise("8.12")
def test_softmax_v4_reads_each_float4_once_into_registers(lesson):
    src = lesson.softmax_v4_source()
    st = compiled(src, "softmax_rows_v4")
    assert st.ld_global_v4 >= 1 and st.st_global_v4 >= 1, (
        f"x should be read and y written as float4s (ld.global.v4.f32, st.global.v4.f32 in the PTX); the PTX has "
        f"{st.ld_global_v4} vector loads and {st.st_global_v4} vector stores from and to global memory")
    assert st.shfl >= 2, f"the max and the sum should be warp reductions (shfl.sync); the PTX has {st.shfl} shuffles"
    assert st.local_bytes == 0, (
        f"the kernel keeps {st.local_bytes} bytes per thread in local memory (.local in the PTX, which lives in "
        f"global memory): index the float4 array only with compile-time constants (#pragma unroll over ITEMS)")
    need_compiler()
    rows, cols = 3, 1536  # 48 threads' worth of float4s: 2 warps, each thread up to 8 float4s
    x = np.random.default_rng(22).standard_normal((rows, cols)).astype(np.float32)
    y, run = run_softmax_v4(lesson, src, x, profile=True, schedules=("forward",))
    assert_close(y, softmax_ref(x), f"softmax_rows_v4 of a ({rows}, {cols}) matrix", rtol=1e-5, atol=1e-7)
    reads, writes = int(run.profile["x"]["reads"].sum()), int(run.profile["y"]["writes"].sum())
    assert reads == rows * cols // 4, (
        f"x ({rows} x {cols}) is {rows * cols // 4} float4s; the kernel made {reads} reads of x: each float4 should be "
        f"read once (kept in registers for the max, the exponentials and the output)"
        + (" (scalar loads count one read per float)" if reads == rows * cols else ""))
    assert writes in (rows * cols // 4, rows * cols), (  # the emulator may count a float4 store as four
        f"each element of y ({rows} x {cols}) should be written once; the kernel made {writes} writes")
    threads = lesson.softmax_v4_launch(rows, cols)[1][0]
    writer = run.profile["y"]["writer"].reshape(rows, cols)[:, ::4]  # who stored each float4
    want = np.arange(rows)[:, None] * threads + np.arange(cols // 4) % threads
    assert (writer == want).all(), (
        f"thread t of a row's block should handle the row's float4s t, t + blockDim.x, ... (a warp then reads 512 "
        f"consecutive bytes per load); row 0's first float4s were stored by threads "
        f"{writer[0, :6].tolist()}, not {want[0, :6].tolist()}")
    busiest = int(run.profile["x"]["reads"].max())
    assert busiest <= lesson.SOFTMAX_V4_ITEMS, (
        f"one thread read {busiest} float4s of x; with {threads} threads per row each should hold at most "
        f"SOFTMAX_V4_ITEMS = {lesson.SOFTMAX_V4_ITEMS}")


# ------------------------------------------------------------------ 8.13 tensor cores fed by a pipeline
@pytest.mark.exercise("8.13")
def test_hgemm_wmma_pipe_copies_asynchronously_into_shared_tiles(lesson):
    src = lesson.hgemm_wmma_pipe_source()
    params = [(p.ctype.replace("__half", "half"), p.pointer) for p in kernel_params(src, "hgemm_wmma_pipe")]
    assert params == [("half", True), ("half", True), ("float", True), ("int", False), ("int", False), ("int", False)], (
        f"hgemm_wmma_pipe must take (const half* A, const half* B, float* C, int M, int N, int K), got {params}")
    ptx = compile_ptx(src)
    st = ptx_stats(ptx)
    assert st.cp_async >= 2, (f"the A and B tiles should reach shared memory by asynchronous copies "
                              f"(__pipeline_memcpy_async, cp.async in the PTX); the PTX has {st.cp_async}")
    waits = [int(w) for w in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    assert waits and max(waits) >= 1, (
        f"a pipeline waits for all but the latest batch (__pipeline_wait_prior(1)), so that the next stage's copies "
        f"stay in flight while this one is multiplied; the PTX's waits leave {max(waits) if waits else 'no'} batches")
    shared_loads = len(re.findall(r"\bwmma\.load\.[ab]\.\S*\.shared\.", ptx))
    assert shared_loads >= 6 and st.mma >= 8, (
        f"per step of 16 in k each warp loads 4 fragments of A and 2 of B from shared memory for 8 mma_sync; the PTX "
        f"has {shared_loads} fragment loads from shared memory and {st.mma} mma")
    stage = 128 * 32 * 2 + 32 * 128 * 2
    assert st.shared_bytes >= 2 * stage, (
        f"two stages of the A (128 x 32) and B (32 x 128) half tiles take at least {2 * stage} bytes of shared "
        f"memory; the PTX declares {st.shared_bytes}")


@pytest.mark.exercise("8.13")
def test_hgemm_wmma_pipe_correct(lesson):
    src = lesson.hgemm_wmma_pipe_source()
    need_compiler()
    rng = np.random.default_rng(26)
    # one partial block; three k stages (the third partial: a stage's buffer refilled after it was read) and a
    # partial block row
    for M, K, N in [(16, 16, 48), (144, 80, 32)]:
        A, B = rng.standard_normal((M, K)).astype(np.float16), rng.standard_normal((K, N)).astype(np.float16)
        C, run = run_sgemm(src, "hgemm_wmma_pipe", lesson.hgemm_pipe_launch, A, B)
        assert_close(C, A.astype(np.float64) @ B.astype(np.float64), f"hgemm_wmma_pipe {M}x{K} @ {K}x{N} (half "
                     "inputs, float result)", rtol=1e-4, atol=1e-4 * np.sqrt(K), notes=run.notes)
        tiles = -(-K // 32)
        blocks = int(np.prod(lesson.hgemm_pipe_launch(M, N)[0]))
        assert run.barriers <= blocks * 2 * tiles, (
            f"two barriers per stage (after the wait, after the products) are enough; a block passed "
            f"{run.barriers / blocks:.0f} for {tiles} stages")
    A, B = rng.standard_normal((20, 30)).astype(np.float16), rng.standard_normal((30, 21)).astype(np.float16)
    assert_close(lesson.hgemm_pipe_emulated(A, B), A.astype(np.float64) @ B.astype(np.float64),
                 "hgemm_pipe(a, b) on 20x30 @ 30x21 (the wrapper pads to multiples of 16)", rtol=1e-4, atol=1e-3)


@pytest.mark.exercise("8.13")
def test_hgemm_wmma_pipe_gives_each_warp_a_64x32_tile(lesson):
    src = lesson.hgemm_wmma_pipe_source()
    need_compiler()
    A, B = np.ones((128, 32), np.float16), np.ones((32, 128), np.float16)
    C, run = run_sgemm(src, "hgemm_wmma_pipe", lesson.hgemm_pipe_launch, A, B, profile=True, schedules=("forward",))
    assert_close(C, np.full((128, 128), 32.0), "hgemm_wmma_pipe of ones, 128x32 @ 32x128", notes=run.notes)
    warp = run.profile["C"]["writer"].reshape(128, 128) // 32
    for w in range(8):
        r0, c0 = (w // 4) * 64, (w % 4) * 32
        region = warp[r0:r0 + 64, c0:c0 + 32]
        assert (region == w).all(), (
            f"warp {w} should write C's rows {r0}-{r0 + 63}, columns {c0}-{c0 + 31} of the block's tile; there the "
            f"writers were warps {sorted(set(region.ravel().tolist()))}")


# ------------------------------------------------------------------ 8.14 tuning
@pytest.mark.exercise("8.14")
@pytest.mark.parametrize("bk,min_blocks", [(8, 1), (16, 2)])
def test_sgemm_tuned_takes_its_tile_sizes_from_the_arguments(lesson, bk, min_blocks):
    src = lesson.sgemm_tuned_source(bk, min_blocks)
    ptx = compile_ptx(src)
    st = ptx_stats(ptx)
    stages = 2 * bk * (128 + 4 + 128) * 4
    assert st.shared_bytes >= stages, (
        f"sgemm_tuned_source({bk}, {min_blocks}): two stages of BK = {bk} rows of A (128 + 4) and B (128) take "
        f"{stages} bytes of shared memory; the PTX declares {st.shared_bytes}")
    bound = re.search(r"\.minnctapersm\s+(\d+)", ptx)
    if min_blocks > 1:
        assert bound and int(bound.group(1)) == min_blocks, (
            f"sgemm_tuned_source({bk}, {min_blocks}) should ask for {min_blocks} blocks per SM "
            f"(__launch_bounds__(256, {min_blocks}): .minnctapersm in the PTX); found {bound.group(0) if bound else 'none'}")
    assert st.ld_global_v4 >= bk // 8 * 2, (
        f"with BK = {bk} each thread loads {bk // 8} float4 of A and {bk // 8} of B per step; the PTX has "
        f"{st.ld_global_v4} vector loads from global memory")
    need_compiler()
    rng = np.random.default_rng(28)
    M, K, N = 130, 100, 136
    A, B = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    C, run = run_sgemm(src, "sgemm_tuned", lesson.sgemm_regtile_launch, A, B)
    assert_close(C, A.astype(np.float64) @ B, f"sgemm_tuned (BK = {bk}) {M}x{K} @ {K}x{N}", rtol=1e-4,
                 atol=1e-4 * np.sqrt(K), notes=run.notes)
    blocks = int(np.prod(lesson.sgemm_regtile_launch(M, N)[0]))
    steps = -(-K // bk)
    assert run.barriers <= blocks * (steps + 1), (
        f"double buffered with BK = {bk}: {steps} + 1 barriers per block for K = {K}, but a block passed "
        f"{run.barriers / blocks:.0f}")


# ------------------------------------------------------------------ on a real GPU
@pytest.mark.gpu
@pytest.mark.exercise("8.1")
def test_gpu_bias_gelu(lesson):
    import cupy as cp

    rng = np.random.default_rng(8)
    x = rng.standard_normal((300, 257)).astype(np.float32)
    b = rng.standard_normal(257).astype(np.float32)
    got = lesson.bias_gelu(cp.asarray(x), cp.asarray(b)).get()
    assert_close(got, gelu(x.astype(np.float64) + b), "bias_gelu on the GPU", rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.exercise("8.2")
def test_gpu_l2norm(lesson):
    import cupy as cp

    x = np.random.default_rng(9).standard_normal((301, 1001)).astype(np.float32)
    assert_close(lesson.l2norm(cp.asarray(x), axis=1).get(), np.linalg.norm(x, axis=1), "l2norm on the GPU", rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [pytest.param("naive", marks=pytest.mark.exercise("8.3")),
                                    pytest.param("tiled", marks=pytest.mark.exercise("8.4")),
                                    pytest.param("regtile", marks=pytest.mark.exercise("8.5")),
                                    pytest.param("vec4", marks=pytest.mark.exercise("8.8")),
                                    pytest.param("warptile", marks=pytest.mark.exercise("8.9")),
                                    pytest.param("dbuf", marks=pytest.mark.exercise("8.10"))])
def test_gpu_sgemm(lesson, kernel):
    import cupy as cp

    source_fn = lesson.SGEMM_KERNELS[kernel][0]
    source_fn()  # not attempted -> NotImplementedError before any GPU work
    rng = np.random.default_rng(10)
    for M, K, N in [(1, 1, 1), (257, 129, 511), (1024, 1024, 1024)]:
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = rng.standard_normal((K, N)).astype(np.float32)
        got = lesson.sgemm(cp.asarray(A), cp.asarray(B), kernel).get()
        assert_close(got, A.astype(np.float64) @ B, f"sgemm {kernel} {M}x{K}x{N} on the GPU", rtol=1e-3,
                     atol=1e-3 * np.sqrt(K))



@pytest.mark.gpu
@pytest.mark.exercise("8.11")
def test_gpu_hgemm_wmma(lesson):
    import cupy as cp

    lesson.hgemm_wmma_source()  # not attempted -> NotImplementedError before any GPU work
    rng = np.random.default_rng(19)
    for M, K, N in [(16, 16, 16), (257, 129, 511), (1024, 1024, 1024)]:
        A = rng.standard_normal((M, K)).astype(np.float16)
        B = rng.standard_normal((K, N)).astype(np.float16)
        got = lesson.hgemm(cp.asarray(A), cp.asarray(B)).get()
        assert_close(got, A.astype(np.float64) @ B.astype(np.float64), f"hgemm {M}x{K}x{N} on the GPU's tensor cores",
                     rtol=1e-2, atol=1e-2 * np.sqrt(K))


@pytest.mark.gpu
@pytest.mark.exercise("8.6")
def test_gpu_softmax(lesson):
    import cupy as cp

    x = (np.random.default_rng(11).standard_normal((513, 4099)) * 10).astype(np.float32)
    assert_close(lesson.softmax(cp.asarray(x)).get(), softmax_ref(x), "softmax on the GPU", rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.exercise("8.13")
def test_gpu_hgemm_pipe(lesson):
    import cupy as cp

    rng = np.random.default_rng(27)
    for M, K, N in [(300, 200, 260), (128, 4096, 256)]:
        A, B = rng.standard_normal((M, K)).astype(np.float16), rng.standard_normal((K, N)).astype(np.float16)
        got = lesson.hgemm_pipe(cp.asarray(A), cp.asarray(B)).get()
        assert_close(got, A.astype(np.float64) @ B.astype(np.float64), f"hgemm_pipe {M}x{K}x{N} on the GPU",
                     rtol=1e-2, atol=1e-2 * np.sqrt(K))


@pytest.mark.gpu
@pytest.mark.exercise("8.12")
def test_gpu_softmax_v4(lesson):
    import cupy as cp

    rng = np.random.default_rng(23)
    for rows, cols in [(513, 4096), (7, 32768), (3, 4099)]:  # the last: not a multiple of 4, 8.6's kernel
        x = (rng.standard_normal((rows, cols)) * 10).astype(np.float32)
        assert_close(lesson.softmax_v4(cp.asarray(x)).get(), softmax_ref(x), f"softmax_v4 of ({rows}, {cols}) on the GPU",
                     rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.exercise("8.7")
def test_gpu_mlp_step_matches_cpu(lesson):
    from minitorch.autograd import Tensor
    from minitorch.nn import MLP, cross_entropy
    from minitorch.tensor import use_backend

    rng = np.random.default_rng(12)
    X = rng.standard_normal((256, 2)).astype(np.float32)
    y = rng.integers(0, 3, 256)
    losses = {}
    with use_backend("cuda", lesson.CupyBackend()):
        for device in ["cpu", "cuda"]:
            model = MLP([2, 64, 3], rng=np.random.default_rng(0)).to(device)
            loss = cross_entropy(model(Tensor(X, device=device)), y)
            loss.backward()
            losses[device] = float(loss.item())
    assert abs(losses["cpu"] - losses["cuda"]) < 1e-4, f"loss on cpu {losses['cpu']} vs cuda {losses['cuda']}"
