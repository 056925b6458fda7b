"""Lesson 08: CUDA C kernels, graded on any machine and, where a GPU is present, on it too.

Without a GPU each kernel is (1) compiled to PTX by NVRTC, whose counts show its structure, and
(2) run on the CPU by `course.cuda_c.emulate`: one block at a time, threads as fibers in a fixed
order, shared memory starting as NaN, guard pages after every argument array. A missing barrier
or guard therefore fails deterministically. Tests marked `gpu` run the same kernels through CuPy.
"""

import re

import numpy as np
import pytest

from course.cuda_c import KernelError, compile_ptx, compiler, emulate, kernel_params, ptx_stats

pytestmark = pytest.mark.lesson08

CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def need_compiler():
    if compiler() is None:
        pytest.skip("the CUDA emulator needs a C++ compiler (g++), and none is installed")


def assert_close(got, want, what, rtol=1e-5, atol=1e-6):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: expected shape {want.shape}, got {got.shape}"
    ok = np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=False)
    if not ok.all():
        bad = np.argwhere(~ok)
        i = tuple(int(v) for v in bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {want.size} elements wrong; first at index {i}: "
                             f"expected {want[i]}, got {got[i]}")


def compiled(source, what):
    """PTX stats of `source`, with NVRTC's message as the failure if it does not compile."""
    try:
        return ptx_stats(compile_ptx(source))
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


def run_sgemm(source, name, launch, A, B):
    M, K = A.shape
    N = B.shape[1]
    C = np.full((M, N), np.nan, dtype=np.float32)
    grid, block = launch(M, N)
    try:
        emulate(source, name, grid, block, [A, B, C, np.int32(M), np.int32(N), np.int32(K)])
    except KernelError as exc:
        raise AssertionError(f"{name} on {M}x{K} @ {K}x{N} failed on the emulator: {exc}") from None
    return C


def check_sgemm(source, name, launch, shapes):
    need_compiler()
    rng = np.random.default_rng(3)
    for M, K, N in shapes:
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = rng.standard_normal((K, N)).astype(np.float32)
        want = A.astype(np.float64) @ B.astype(np.float64)
        got = run_sgemm(source, name, launch, A, B)
        assert_close(got, want, f"{name}: C = A @ B for A {M}x{K}, B {K}x{N}", rtol=1e-4, atol=1e-4 * np.sqrt(K))


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


def run_softmax(lesson, src, x):
    y = np.full_like(x, np.nan)
    try:
        emulate(src, "softmax_rows", *lesson.softmax_launch(*x.shape), [x, y, np.int32(x.shape[0]), np.int32(x.shape[1])])
    except KernelError as exc:
        raise AssertionError(f"softmax_rows on a {x.shape} matrix failed on the emulator: {exc}") from None
    return y


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
        assert_close(run_softmax(lesson, src, x), softmax_ref(x), f"softmax of a ({rows}, {cols}) matrix",
                     rtol=1e-5, atol=1e-7)


@pytest.mark.exercise("8.6")
def test_softmax_rows_is_stable(lesson):
    src = lesson.softmax_source()
    need_compiler()
    x = np.array([[1e4, 1e4 - 1, 1e4 - 2, -1e4],
                  [-np.inf, 0.0, 1.0, -np.inf],
                  [88.0, 89.0, 90.0, 91.0]], dtype=np.float32)
    y = run_softmax(lesson, src, x)
    assert np.isfinite(y).all(), f"softmax of large / -inf inputs must be finite, got\n{y}"
    assert_close(y, softmax_ref(x), "softmax of rows with values 1e4 and -inf", rtol=1e-5, atol=1e-7)


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
    assert not k.calls, f"only 2-D float32 products go to matmul_2d; it was called with {k.calls}"
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
                                    pytest.param("regtile", marks=pytest.mark.exercise("8.5"))])
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
@pytest.mark.exercise("8.6")
def test_gpu_softmax(lesson):
    import cupy as cp

    x = (np.random.default_rng(11).standard_normal((513, 4099)) * 10).astype(np.float32)
    assert_close(lesson.softmax(cp.asarray(x)).get(), softmax_ref(x), "softmax on the GPU", rtol=1e-5, atol=1e-7)


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
