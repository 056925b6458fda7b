"""Lesson 10's minitorch.quant where the lesson's tests do not reach it: the given layers and
helpers its demos use (float-format layers, the LLM.int8 and input-scaled layers, the recorder
of calibration inputs, W8A8, W4 groups, the dp4a packing), and the contracts of the functions
whose ranges the outside review found open (LLM.int8's threshold, SmoothQuant's alpha).

The int8 GEMM (exercise 10.6) is graded by the lesson; where a given layer calls it by default
these tests put an exact NumPy product in its place, so that no Numba kernel is compiled here
except the explicit-pairs GEMM, which has no other in-process caller."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from minitorch import quant
from minitorch.autograd import Tensor
from minitorch.nn import MLP, Linear


def np_int8_gemm(a, b):
    return (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)


def linear(seed=0, n_in=6, n_out=5):
    return Linear(n_in, n_out, rng=np.random.default_rng(seed))


def test_round_to_format_and_cast_round_values_and_gradients_to_fp16():
    x = np.random.default_rng(1).standard_normal(33).astype(np.float32) * 100
    want = x.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(quant.round_to_format(x, "fp16"), want)
    np.testing.assert_array_equal(quant.round_to_format(np.float32([1 + 2**-8, 1e6]), "bf16", saturate=True),
                                  np.float32([1.0, 999424.0]))  # the tie goes to the even code; 1e6 is in range
    t = Tensor(x, requires_grad=True)
    y = quant.cast(t, "fp16")
    np.testing.assert_array_equal(y.numpy(), want)
    (y * Tensor(np.full(33, 1 + 2**-12, np.float32))).sum().backward()
    np.testing.assert_array_equal(t.grad.numpy(), np.ones(33, np.float32))  # 1 + 2^-12 rounds to 1 in fp16
    with pytest.raises(TypeError, match="cast: x must be a minitorch Tensor, got an array"):
        quant.cast(x, "fp16")
    with pytest.raises(ValueError, match="round_to_format: fmt must be one of .*got 'fp12'"):
        quant.round_to_format(x, "fp12")


def test_mixed_forward_runs_the_mlp_in_a_format():
    model = MLP([4, 7, 3], rng=np.random.default_rng(2))
    x = np.random.default_rng(3).standard_normal((5, 4))
    exact = model(Tensor(x.astype(np.float32))).numpy()
    np.testing.assert_array_equal(quant.mixed_forward(model, x, None).numpy(), exact)
    bf16 = quant.mixed_forward(model, x, "bf16").numpy()
    assert bf16.dtype == np.float32 and bf16.shape == (5, 3)
    np.testing.assert_array_equal(bf16, quant.round_to_format(bf16, "bf16"))  # every result is a bf16 value
    np.testing.assert_allclose(bf16, exact, rtol=0.05, atol=0.05)
    with pytest.raises(TypeError, match="mixed_forward: model must be an object with `layers`"):
        quant.mixed_forward(Linear(4, 3), x, "bf16")


def test_check_matmul_shapes_and_expand_blocks():
    quant.check_matmul_shapes("f", np.zeros((2, 3)), np.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"f: shape mismatch \(2, 3\) @ \(2, 4\) \(need x \(T, K\) @ w \(K, N\)"):
        quant.check_matmul_shapes("f", np.zeros((2, 3)), np.zeros((2, 4)))
    s = quant.expand_blocks(np.array([[1.0], [2.0]]), (4, 3))  # the axis of one block stays 1: it broadcasts
    np.testing.assert_array_equal(s, [[1.0], [1.0], [2.0], [2.0]])
    np.testing.assert_array_equal(quant.expand_blocks(np.array([[1.0, 2.0, 3.0]]), (2, 6)),
                                  [[1.0, 1.0, 2.0, 2.0, 3.0, 3.0]])
    with pytest.raises(ValueError, match=r"expand_blocks: s must have one entry per block of shape \(4, 3\).*\(3, 1\)"):
        quant.expand_blocks(np.ones((3, 1)), (4, 3))


def test_dp4a_packing_and_launch_geometry():
    a = np.arange(-5, 5, dtype=np.int8).reshape(2, 5)
    packed = quant.pack_k4(a)
    assert packed.dtype == np.int32 and packed.shape == (2, 2)
    np.testing.assert_array_equal(packed.view(np.int8).reshape(2, 8)[:, :5], a)
    np.testing.assert_array_equal(packed.view(np.int8).reshape(2, 8)[:, 5:], 0)
    assert quant.dp4a_launch(17, 33) == ((3, 2), (16, 16))
    assert quant.dp4a_launch(16, 1) == ((1, 1), (16, 16))
    with pytest.raises(ValueError, match="dp4a_launch: m must be an integer >= 1, got 0"):
        quant.dp4a_launch(0, 4)


def test_the_emulated_dp4a_kernel_is_exact():
    rng = np.random.default_rng(4)
    a = rng.integers(-128, 128, (3, 9)).astype(np.int8)
    b = rng.integers(-128, 128, (9, 17)).astype(np.int8)
    np.testing.assert_array_equal(quant.int8_gemm_dp4a_emulated(a, b), np_int8_gemm(a, b))


def test_the_explicit_pairs_gemm_is_exact():
    """Compiles lesson 06's packed loops with the int8 pairs kernel (seconds; test_simd's in-process test
    of the same kernel then finds it compiled)."""
    rng = np.random.default_rng(4)
    a = rng.integers(-128, 128, (7, 13)).astype(np.int8)
    b = rng.integers(-128, 128, (13, 19)).astype(np.int8)
    c = quant.matmul_int8_pairs(a, b)
    assert c.dtype == np.int32 and c.shape == (7, 19)
    np.testing.assert_array_equal(c, np_int8_gemm(a, b))
    with pytest.raises(ValueError, match=r"matmul_int8_pairs: shape mismatch: a \(7, 13\) @ b \(7, 13\)"):
        quant.check_int8_operands(a, a, "matmul_int8_pairs")


def test_the_vnni_kernel_source_and_the_pairs_blocking():
    source = quant.int8_vnni_kernel_source(2, 1)
    assert "def int8_vnni_kernel_2x1(ap, bp, c, co, ldc):" in source and source.count("vdot_u8s8(") == 2
    kernel = quant.make_int8_vnni_kernel(2, 1)
    assert quant.make_int8_vnni_kernel(2, 1) is kernel
    ap = np.array([0x01010101, 0x80808080], np.uint32).view(np.int32)  # one k4: row 0's four uint8 are 1, row 1's 128
    bp = np.tile(np.array([1, -1, 2, -128], np.int8), 16).view(np.int32)  # every column's four int8
    c = np.zeros(32, np.int32)
    kernel(ap, bp, c, 0, 16)
    np.testing.assert_array_equal(c, [1 - 1 + 2 - 128] * 16 + [128 * (1 - 1 + 2 - 128)] * 16)
    assert quant.pairs_blocking(1024**2) == (48, 1024) and quant.pairs_blocking(32 * 1024, mc=6) == (6, 128)
    with pytest.raises(ValueError, match="make_int8_vnni_kernel: nv must be an integer >= 1, got 0"):
        quant.make_int8_vnni_kernel(2, 0)
    with pytest.raises(TypeError, match="matmul_int8_vnni: a must be an array of 2 axes of dtype int8"):
        quant.matmul_int8_vnni(np.ones((2, 2)), np.ones((2, 2), np.int8))


def test_find_int8_madd_counts_the_widening_multiply_adds_of_an_isa():
    asm = "\tvpmaddwd %ymm1, %ymm2, %ymm3\n\tvpaddd %ymm3, %ymm0, %ymm0\n\tvpmaddwd %ymm4, %ymm2, %ymm5\n\tsdot v0.4s"
    assert quant.find_int8_madd(asm, "x86_64") == {"vpmaddwd": 2}
    assert quant.find_int8_madd(asm, "aarch64") == {"sdot": 1}
    assert quant.find_int8_madd(asm, "riscv64") == {}
    assert quant.isa() in ("x86_64", "aarch64") or quant.find_int8_madd(asm) == {}


def test_w8a8_matmul_and_w4_groups_against_the_float_product():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    w = rng.standard_normal((32, 5)).astype(np.float32)
    y = quant.w8a8_matmul(x, w, gemm=np_int8_gemm)
    assert y.dtype == np.float32 and y.shape == (6, 5)
    np.testing.assert_allclose(y, x @ w, rtol=0, atol=0.05 * np.abs(x @ w).max())
    np.testing.assert_array_equal(quant.w8a8_matmul(np.zeros((2, 0), np.float32), np.zeros((0, 3), np.float32)),
                                  np.zeros((2, 3), np.float32))
    w4 = quant.quantize_w4_group(w, 8)
    assert w4.shape == w.shape and w4.dtype == np.float32
    for g in range(4):  # at most 16 levels in each group of 8 rows of each column
        assert all(len(np.unique(w4[8 * g:8 * g + 8, j])) <= 16 for j in range(5))
    np.testing.assert_array_equal(w4, quant.quantize(w, bits=4, symmetric=False, block=(8, 1)).dequantize())
    np.testing.assert_array_equal(quant.quantize_w4_group(w), quant.quantize_w4_group(w, 32))  # group_size_for(32)
    with pytest.raises(ValueError, match="quantize_w4_group: group_size must be an integer >= 1, got 0"):
        quant.quantize_w4_group(w, 0)


def test_capture_inputs_records_what_each_linear_sees():
    model = MLP([4, 6, 2], rng=np.random.default_rng(6))
    x = np.random.default_rng(7).standard_normal((3, 4)).astype(np.float32)
    seen = quant.capture_inputs(model, lambda m: (m(Tensor(x)), m(Tensor(x[:1]))))
    assert sorted(seen) == ["layers.0", "layers.2"]
    np.testing.assert_array_equal(seen["layers.0"], np.concatenate([x, x[:1]]))
    hidden = np.maximum(x @ model.layers[0].weight.numpy() + model.layers[0].bias.numpy(), 0)
    np.testing.assert_allclose(seen["layers.2"][:3], hidden, rtol=1e-6)
    rec = quant.RecordingLinear(model.layers[0])
    np.testing.assert_array_equal(rec(Tensor(x)).numpy(), model.layers[0](Tensor(x)).numpy())
    assert len(rec.seen) == 1 and rec.seen[0].shape == (3, 4)
    assert isinstance(model.layers[0], Linear), "capture_inputs records on a copy: the model keeps its layers"


def test_format_llm_int8_and_input_scaled_layers(monkeypatch):
    lin = linear(8)
    x = np.random.default_rng(9).standard_normal((4, 6)).astype(np.float32)
    x[:, 2] *= 50  # one outlier channel
    exact = lin(Tensor(x)).numpy()
    for fmt, scaled, nbytes in (("bf16", False, 60), ("fp8_e4m3", True, 34)):
        layer = quant.FormatLinear(lin, fmt, scaled)
        y = layer(Tensor(x)).numpy()
        assert y.dtype == np.float32 and layer.weight_bytes() == nbytes, (fmt, layer.weight_bytes())
        np.testing.assert_allclose(y, exact, rtol=0, atol=0.1 * np.abs(exact).max())
    monkeypatch.setattr(quant, "matmul_int8", np_int8_gemm)  # the default int8 GEMM, without its compile
    llm = quant.LLMInt8Linear(lin, 6.0)
    y = llm(Tensor(x)).numpy()
    assert llm.outlier_counts == [1] and llm.weight_bytes() == 30 + 4 * 5
    np.testing.assert_allclose(y, exact, rtol=0, atol=0.02 * np.abs(exact).max())
    s = quant.smoothquant_scales(np.abs(x).max(axis=0), lin.weight.numpy(), 0.5)
    inner = quant.QuantLinear(lin.weight.numpy() * s[:, None].astype(np.float32), lin.bias.numpy(),
                              gemm=np_int8_gemm)
    scaled = quant.InputScaledLinear(inner, s)
    assert scaled.weight_bytes() == inner.weight_bytes()
    np.testing.assert_allclose(scaled(Tensor(x)).numpy(), exact, rtol=0, atol=0.02 * np.abs(exact).max())
    model = MLP([6, 5, 5], rng=np.random.default_rng(10))
    assert quant.linear_weight_bytes(model) == 4 * (30 + 25)
    assert quant.linear_weight_bytes(quant.quantize_model(model, skip=["layers.2"], mode="w8")) == 30 + 4 * 5 + 4 * 25


def test_outlier_threshold_and_smoothing_alpha_are_refused_outside_their_range():
    """The outside review: llm_int8_matmul took a negative threshold (every column an outlier, silently)
    and smoothquant_scales an alpha outside [0, 1] (scales that make the problem worse)."""
    rng = np.random.default_rng(11)
    x, w = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32)
    for bad, error, shown in ((-1.0, ValueError, "-1.0"), (float("nan"), ValueError, "nan"), ("6", TypeError, "'6'")):
        with pytest.raises(error, match=rf"llm_int8_matmul: threshold must be .* >= 0, got {shown}"):
            quant.llm_int8_matmul(x, w, bad)
        with pytest.raises(error, match=rf"LLMInt8Linear: threshold must be .* >= 0, got {shown}"):
            quant.LLMInt8Linear(linear(), bad)
    y, cols = quant.llm_int8_matmul(x, w, np.inf, int8_matmul=lambda a, b: a @ b)  # inf: no outlier column
    assert len(cols) == 0
    for bad in (-0.5, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"smoothquant_scales: alpha must be a finite number in \[0, 1\], got {bad}"):
            quant.smoothquant_scales(np.abs(x).max(axis=0), w, bad)
    np.testing.assert_array_equal(quant.smoothquant_scales(np.abs(x).max(axis=0), w, 0.0),
                                  1 / np.abs(w.astype(np.float64)).max(axis=1))


def test_contracts_name_the_parameter_and_the_value():
    x = np.ones((2, 4), np.float32)
    for call, error, message in (
            (lambda: quant.get_format("fp12"), ValueError, "get_format: fmt must be one of 'fp16'.*got 'fp12'"),
            (lambda: quant.quantize(x, bits=9), ValueError, r"quantize: bits must be an integer in \[2, 8\], got 9"),
            (lambda: quant.quantize(x.astype(np.float16)), TypeError, "quantize: x must be an array of dtype float32 or "
                                                                      "float64, got an array of shape"),
            (lambda: quant.quantize(x, block=(2,)), ValueError, r"quantize: block \(2,\) has 1 axes but x has 2"),
            (lambda: quant.quantize_with(x, np.ones((1, 1)), np.zeros((1, 1))), TypeError,
             "quantize_with: zero_point must be an array of dtype int"),
            (lambda: quant.matmul_int8(np.zeros((2, 2), np.int8), np.zeros((2, 2), np.float32)), TypeError,
             "matmul_int8: b must be an array of 2 axes of dtype int8, got an array of shape"),
            (lambda: quant.unpack_int4(np.zeros(2, np.uint8), (2, -2)), ValueError,
             r"unpack_int4: shape\[1\] must be an integer >= 0, got -2"),
            (lambda: quant.quantize_model(MLP([2, 2]), skip=None), TypeError,
             "quantize_model: skip must be a list, tuple or set of layer names"),
            (lambda: quant.QuantLinear(np.ones((4, 2), np.float32), group_size=0), ValueError,
             "QuantLinear: group_size must be an integer >= 1, got 0"),
            (lambda: quant.smooth(x, np.ones((4, 3), np.float32), np.ones(3)), ValueError,
             r"smooth: x \(T, K\), w \(K, N\) and s \(K,\) must agree, got x \(2, 4\), w \(4, 3\), s \(3,\)"),
            (lambda: quant.smooth(x, np.ones((4, 3), np.float32), np.array([1.0, 0.0, 2.0, 1.0])), ValueError,
             r"smooth: s must be finite and > 0, got \[0.0\]"),
            (lambda: quant.DynamicLossScaler(backoff_factor=1.0), ValueError,
             r"DynamicLossScaler: backoff_factor must be a finite number in \(0, 1\), got 1.0"),
            (lambda: quant.DynamicLossScaler().step(None, []), TypeError,
             "DynamicLossScaler.step: optimizer must be an object with `step`, got None")):
        with pytest.raises(error, match=message):
            call()


@numba.njit(cache=False)
def _spy_kernel(ap, bp, c, co, ldc):
    """Adds, at its block's first item, 1 plus where bp starts within a cache line."""
    c[co] += 1 + bp.ctypes.data % 64


def test_gemm_int8_vnni_hands_the_kernel_b_panels_on_whole_cache_lines():
    """As lesson 06's gemm_blis: B packed into a line-aligned buffer, each panel whole lines, so that no
    vector load of B straddles two lines."""
    for m, k4, n in ((37, 70, 75), (12, 33, 100), (7, 100, 200), (50, 20, 40)):
        aw, b = np.zeros((m, k4), np.int32), np.zeros((4 * k4, n), np.int8)
        c = np.zeros((m, n), np.int32)
        quant.gemm_int8_vnni(aw, b, c, _spy_kernel, 3, 32, 12, 16, 64)
        k_blocks = -(-k4 // 16)
        firsts = c[::3, ::32]
        assert np.all(firsts == k_blocks), f"{(m, k4, n)}: the B panels start {np.unique(firsts - k_blocks)} " \
                                           f"bytes into a cache line (summed over {k_blocks} blocks of k)"
