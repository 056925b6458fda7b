"""Lesson 08's given code (minitorch.cupy_kernels) that no exercise test calls: the emulated softmax,
the unfused CuPy references, the CUDA-event timer and enable_cuda; and the contracts of the GPU
functions, which refuse bad arguments before CuPy is touched (so they are checked on any machine)."""

from __future__ import annotations

import numpy as np
import pytest

from course.cuda_c import emulator_unavailable
from minitorch import cupy_kernels as ck


def test_softmax_emulated_rows():
    if emulator_unavailable():
        pytest.skip(emulator_unavailable())
    x = np.array([[1.0, 2.0, 3.0], [1e4, 1e4, -np.inf], [0.0, 0.0, 0.0]], dtype=np.float32)
    got = ck.softmax_emulated(x)
    e = np.exp(x[0].astype(np.float64) - 3)
    np.testing.assert_allclose(got[0], e / e.sum(), rtol=1e-6)
    np.testing.assert_array_equal(got[1], np.array([0.5, 0.5, 0.0], np.float32))
    np.testing.assert_allclose(got[2], np.full(3, 1 / 3), rtol=1e-6)
    with pytest.raises(ValueError, match=r"softmax_emulated: x must be an array of 2 axes.*\(3,\)"):
        ck.softmax_emulated(x[0])


def test_softmax_v4_launch_and_the_emulated_wrapper():
    """The block fits the row (whole warps, each thread at most SOFTMAX_V4_ITEMS float4s); rows the kernel
    cannot hold (not a multiple of 4, longer than SOFTMAX_V4_MAX_COLS) are refused by the launch and sent
    to exercise 8.6's kernel by the wrapper."""
    for cols in (4, 128, 256, 260, 4096, 8192, 32768):
        (grid,), (threads,) = ck.softmax_v4_launch(3, cols)
        assert grid == 3 and threads % 32 == 0 and 32 <= threads <= 1024, (cols, threads)
        assert threads * ck.SOFTMAX_V4_ITEMS * 4 >= cols > (threads - 32) * ck.SOFTMAX_V4_ITEMS * 4, (cols, threads)
    for cols in (6, ck.SOFTMAX_V4_MAX_COLS + 4):
        with pytest.raises(ValueError, match=f"softmax_v4_launch: cols must be a multiple of 4 and at most "
                                             f"{ck.SOFTMAX_V4_MAX_COLS}, got {cols}"):
            ck.softmax_v4_launch(1, cols)
    if emulator_unavailable():
        pytest.skip(emulator_unavailable())
    rng = np.random.default_rng(5)
    for shape in ((3, 8), (2, 5), (1, 260)):
        x = (rng.standard_normal(shape) * 4).astype(np.float32)
        e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
        np.testing.assert_allclose(ck.softmax_v4_emulated(x), e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7,
                                   err_msg=f"softmax_v4_emulated of {shape}")
    assert ck.softmax_v4_emulated(np.zeros((0, 8), np.float32)).shape == (0, 8)
    with pytest.raises(TypeError, match="softmax_v4_emulated: x must be an array of 2 axes of dtype float32"):
        ck.softmax_v4_emulated(np.ones((2, 4)))


def test_gpu_functions_refuse_bad_arguments_before_cupy():
    x = np.ones((2, 3), np.float32)
    for call, pattern in [
        (lambda: ck.bias_gelu(x, x[0]), r"bias_gelu: x must be a CuPy array \(on the GPU\).*got an array of shape \(2, 3\)"),
        (lambda: ck.gelu_unfused(x, x[0]), "gelu_unfused: x must be a CuPy array"),
        (lambda: ck.l2norm([1.0, 2.0]), r"l2norm: x must be a CuPy array.*\[1.0, 2.0\]"),
        (lambda: ck.sgemm(x, x.T), "sgemm: a must be a CuPy array"),
        (lambda: ck.softmax(None), "softmax: x must be a CuPy array.*None"),
        (lambda: ck.softmax_unfused(x), "softmax_unfused: x must be a CuPy array"),
        (lambda: ck.softmax_v4(x), "softmax_v4: x must be a CuPy array"),
        (lambda: ck.hgemm(x, x.T), "hgemm: a must be a CuPy array"),
        (lambda: ck.hgemm_pipe(x, x.T), "hgemm_pipe: a must be a CuPy array"),
        (lambda: ck.cuda_time_ms(lambda: None, repeat=0), "cuda_time_ms: repeat must be an integer >= 1, got 0"),
        (lambda: ck.cuda_time_ms("fn"), "cuda_time_ms: fn must be callable, got 'fn'"),
    ]:
        with pytest.raises(TypeError if "CuPy" in pattern or "callable" in pattern else ValueError, match=pattern):
            call()
    with pytest.raises(ValueError, match=r"enable_cuda: kernel must be one of \[.*'regtile'.*\], got 'fastest'"):
        ck.enable_cuda("fastest")
    with pytest.raises(ValueError, match=r"sgemm_emulated: kernel must be one of .*got 'fastest'"):
        ck.sgemm_emulated(x, x.T, "fastest")


@pytest.mark.gpu
def test_gpu_unfused_references_and_timer():
    import cupy as cp

    rng = np.random.default_rng(0)
    x, b = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    v = x.astype(np.float64) + b
    want = 0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v**3)))
    np.testing.assert_allclose(ck.gelu_unfused(cp.asarray(x), cp.asarray(b)).get(), want, rtol=1e-5, atol=1e-6)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(ck.softmax_unfused(cp.asarray(x)).get(), e / e.sum(axis=1, keepdims=True), rtol=1e-5)
    calls = []
    ms = ck.cuda_time_ms(lambda: calls.append(cp.asarray(x).sum()), repeat=3, warmup=1)
    assert ms >= 0 and len(calls) == 4, (ms, len(calls))


@pytest.mark.gpu
def test_gpu_enable_cuda_registers_the_device():
    import cupy as cp

    from minitorch.tensor import Backend, get_backend, use_backend

    with use_backend("cuda", Backend()):  # restored afterwards: enable_cuda registers globally
        backend = ck.enable_cuda("tiled")
        assert get_backend("cuda") is backend and isinstance(backend, ck.CupyBackend)
        a = cp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
        np.testing.assert_allclose(backend.matmul(a, a.T).get(), (a @ a.T).get(), rtol=1e-6)


@pytest.mark.gpu
def test_gpu_memory_bandwidth_from_the_attributes():
    bw = ck.memory_bandwidth_gbps()
    assert bw is None or 100 <= bw <= 20_000, f"memory_bandwidth_gbps: {bw} GB/s is no GPU's"
