"""Lesson 10: quantization. Oracles: np.float16 and ml_dtypes (bf16, float8_e4m3fn, float8_e5m2)
for the formats, bit for bit; NumPy int64/float64 for everything integer; brute force for the
searches. Each exercise is graded on its own code: the later exercises get NumPy versions of
quantize and the int8 GEMM passed in (written below, from the lesson's spec).
"""

import math
import platform
import re

import ml_dtypes
import numba
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minitorch.autograd import Tensor
from minitorch.nn import Linear, Parameter

pytestmark = pytest.mark.lesson10

# name -> (E, M, oracle dtype, unsigned view)
FMT = {
    "fp16": (5, 10, np.float16, np.uint16),
    "bf16": (8, 7, ml_dtypes.bfloat16, np.uint16),
    "fp8_e4m3": (4, 3, ml_dtypes.float8_e4m3fn, np.uint8),
    "fp8_e5m2": (5, 2, ml_dtypes.float8_e5m2, np.uint8),
}
MAXFIN = {"fp16": 65504.0, "bf16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def all_codes(name):
    return np.arange(1 << (1 + FMT[name][0] + FMT[name][1]), dtype=np.int64).astype(FMT[name][3])


def oracle_values(name, codes):
    return codes.view(FMT[name][2]).astype(np.float32)


def is_nan_code(name, codes):
    return np.isnan(oracle_values(name, np.asarray(codes, dtype=FMT[name][3])))


def first_bad(got, want):
    i = int(np.flatnonzero(got != want)[0])
    return i


# ---------------------------------------------------------------- 10.1 decode


@pytest.mark.exercise("10.1")
@pytest.mark.parametrize("name", list(FMT))
def test_decode_every_code_bit_exact(lesson, name):
    codes = all_codes(name)
    got = np.asarray(lesson.decode_bits(codes, name))
    want = oracle_values(name, codes)
    assert got.dtype == np.float32, f"decode_bits should return float32, got {got.dtype}"
    assert got.shape == codes.shape
    nan_w = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan_w), (
        f"{name}: NaN codes differ; first: code {hex(codes[first_bad(np.isnan(got), nan_w)])}")
    gb, wb = got.view(np.uint32)[~nan_w], want.view(np.uint32)[~nan_w]
    if not np.array_equal(gb, wb):
        i = first_bad(gb, wb)
        c = codes[~nan_w][i]
        raise AssertionError(f"{name}: code {int(c):#06x} decodes to {got[~nan_w][i]!r}, expected {want[~nan_w][i]!r} "
                             "(bit for bit, -0 included)")


@pytest.mark.exercise("10.1")
def test_decode_keeps_shape_and_known_values(lesson):
    codes = np.array([[0x3C00, 0x0001], [0x7BFF, 0xFC00]], np.uint16)
    got = lesson.decode_bits(codes, "fp16")
    assert got.shape == (2, 2)
    assert got[0, 0] == 1.0 and got[0, 1] == 2.0 ** -24 and got[1, 0] == 65504.0 and got[1, 1] == -np.inf, got
    assert lesson.decode_bits(np.array([0x7E], np.uint8), "fp8_e4m3")[0] == 448.0
    assert np.isnan(lesson.decode_bits(np.array([0x7F], np.uint8), "fp8_e4m3")[0]), "E4M3 0x7F is NaN"
    assert lesson.decode_bits(np.array([0x78], np.uint8), "fp8_e4m3")[0] == 256.0, "E4M3 has no infinity: 0x78 is 256"


@pytest.mark.exercise("10.1")
def test_decode_rejects_bad_codes(lesson):
    with pytest.raises((ValueError, TypeError)):
        lesson.decode_bits(np.array([256]), "fp8_e5m2")
    with pytest.raises((ValueError, TypeError)):
        lesson.decode_bits(np.array([-1]), "fp16")
    with pytest.raises((ValueError, TypeError)):
        lesson.decode_bits(np.array([1.0]), "fp16")
    with pytest.raises(ValueError, match="fp12|format"):
        lesson.decode_bits(np.array([1]), "fp12")


# ---------------------------------------------------------------- 10.2 encode


def edge_inputs(name):
    """Every code's value and the midpoints between neighbours (ties), their float32 neighbours,
    the overflow region, specials and float32 subnormals."""
    codes = all_codes(name)
    with np.errstate(invalid="ignore"):
        v = oracle_values(name, codes).astype(np.float64)
    pos = v[: len(v) // 2]
    pos = pos[np.isfinite(pos)]
    mids = (pos[:-1] + pos[1:]) / 2  # exact in float64; exact in float32 too (fewer bits than float32)
    maxf = MAXFIN[name]
    ulp = maxf * 2.0 ** -FMT[name][1]
    special = [maxf + ulp / 2, maxf + ulp / 4, maxf + ulp, maxf * 2, 3e38, np.inf, np.nan, 0.0, 1e-45, 1e-40, 1.17e-38]
    with np.errstate(over="ignore"):
        base = np.concatenate([pos, mids, special]).astype(np.float32)
    base = base[np.isfinite(base) | np.isinf(base) | np.isnan(base)]
    nb = np.concatenate([base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))])
    return np.concatenate([nb, -nb]).astype(np.float32)


def compare_encode(lesson, name, x, saturate=False):
    got = np.asarray(lesson.encode_bits(x, name, saturate=saturate) if saturate else lesson.encode_bits(x, name))
    view = FMT[name][3]
    assert got.dtype == view, f"encode_bits({name}) should return {np.dtype(view)}, got {got.dtype}"
    assert got.shape == x.shape
    with np.errstate(over="ignore", invalid="ignore"):
        src = np.clip(x, -MAXFIN[name], MAXFIN[name]) if saturate else x
        want = src.astype(FMT[name][2]).view(view)
    nan_w = np.isnan(x)
    assert np.all(is_nan_code(name, got[nan_w])), f"{name}: NaN inputs must give NaN codes"
    g, w, xs = got[~nan_w], want[~nan_w], x[~nan_w]
    if not np.array_equal(g, w):
        i = first_bad(g, w)
        raise AssertionError(f"{name}{' (saturate)' if saturate else ''}: {xs[i]!r} (float32 bits "
                             f"{int(xs[i:i + 1].view(np.uint32)[0]):#010x}) encodes to {int(g[i]):#x}, expected "
                             f"{int(w[i]):#x} ({w[i:i + 1].view(FMT[name][2])[0]!r}); "
                             f"{int(np.sum(g != w))} of {len(g)} inputs differ")


@pytest.mark.exercise("10.2")
@pytest.mark.parametrize("name", list(FMT))
def test_encode_random_bit_patterns(lesson, name):
    bits = np.random.default_rng(10 + len(name)).integers(0, 2**32, 2**21, dtype=np.uint64).astype(np.uint32)
    compare_encode(lesson, name, bits.view(np.float32))


@pytest.mark.exercise("10.2")
@pytest.mark.parametrize("name", list(FMT))
def test_encode_ties_neighbours_and_specials(lesson, name):
    compare_encode(lesson, name, edge_inputs(name))


@pytest.mark.exercise("10.2")
@pytest.mark.parametrize("name", ["fp16", "fp8_e4m3", "fp8_e5m2"])
def test_encode_saturate(lesson, name):
    x = np.concatenate([edge_inputs(name), np.random.default_rng(3).standard_normal(4096).astype(np.float32) * MAXFIN[name]])
    compare_encode(lesson, name, x.astype(np.float32), saturate=True)


@pytest.mark.exercise("10.2")
def test_encode_known_roundings(lesson):
    e = lambda v, f, **kw: int(lesson.encode_bits(np.array([v], np.float32), f, **kw)[0])  # noqa: E731
    assert e(464.0, "fp8_e4m3") == 0x7E, "464 is the tie between 448 and 480 (NaN slot): ties to even give 448"
    assert e(1e6, "fp8_e4m3") & 0x7F == 0x7F, "E4M3 overflow is NaN (no infinity)"
    assert e(1e6, "fp8_e4m3", saturate=True) == 0x7E, "saturate=True clamps to 448"
    assert e(61440.0, "fp8_e5m2") == 0x7C, "61440 ties between 57344 (odd mantissa) and 65536: rounds up to inf"
    assert e(1 + 2.0 ** -11, "fp16") == 0x3C00 and e(1 + 3 * 2.0 ** -11, "fp16") == 0x3C02, "ties to even"
    assert e(-1e-30, "fp16") == 0x8000, "the sign of a value that rounds to zero is kept (-0)"


@pytest.mark.exercise("10.2")
def test_encode_rejects_float64(lesson):
    with pytest.raises(TypeError, match="float32|float64"):
        lesson.encode_bits(np.array([1.0]), "fp16")


# ---------------------------------------------------------------- 10.3 loss scaling


class CountingOptimizer:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1


def param_with_grad(g):
    p = Parameter(np.zeros(np.shape(g), np.float32))
    p.zero_grad()
    (p * Tensor(np.asarray(g, dtype=np.float32))).sum().backward()
    return p


@pytest.mark.exercise("10.3")
def test_scaler_update_rule(lesson):
    s = lesson.DynamicLossScaler(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    seq = [False, False, True, False, False, False, False, True, True]
    want = [1024, 1024, 512, 512, 512, 1024, 1024, 512, 256]
    got = []
    for f in seq:
        s.update(f)
        got.append(s.scale)
    assert got == want, (f"scale after update(found_inf) for {seq}: expected {want}, got {got} "
                         "(an overflow halves and resets the count; 3 good steps in a row double)")


@pytest.mark.exercise("10.3")
def test_scaler_unscale_and_step(lesson):
    s = lesson.DynamicLossScaler(init_scale=8.0, growth_interval=100)
    p1, p2 = param_with_grad([8.0, -16.0]), param_with_grad([[4.0]])
    p3 = Parameter(np.zeros(2, np.float32))  # no grad
    opt = CountingOptimizer()
    assert s.step(opt, [p1, p2, p3]) is True, "finite gradients: step() returns True"
    assert opt.steps == 1, "the optimizer must step when every gradient is finite"
    np.testing.assert_array_equal(p1.grad.numpy(), [1.0, -2.0], err_msg="unscale_ divides each grad by the scale")
    np.testing.assert_array_equal(p2.grad.numpy(), [[0.5]])
    for bad in (np.inf, -np.inf, np.nan):
        q = param_with_grad([1.0, 2.0])
        q.grad.data[1] = bad
        before = s.scale
        assert s.step(opt, [param_with_grad([1.0]), q]) is False, f"a {bad} gradient: step() returns False"
        assert opt.steps == 1, f"a {bad} gradient: the optimizer step must be skipped"
        assert s.scale == before / 2, f"a {bad} gradient must halve the scale ({before} -> {s.scale})"
    assert s.unscale_([param_with_grad([1.0])]) is False
    s = lesson.DynamicLossScaler(init_scale=4.0)
    bad, later = param_with_grad([1.0, 1.0]), param_with_grad([8.0])
    bad.grad.data[0] = np.inf
    assert s.unscale_([bad, later]) is True
    np.testing.assert_array_equal(later.grad.numpy(), [2.0], err_msg="unscale_ divides every gradient, also those after "
                                  "an overflowing one")


@pytest.mark.exercise("10.3")
def test_scaler_rescues_fp16_underflow(lesson):
    """A gradient of 1e-9 underflows fp16; the scaler starting at 2^24 keeps it, and backs off
    from a scale at which a large gradient overflows."""
    fp16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32)  # noqa: E731
    true_grad = np.array([1e-9, 3e-9, -2e-9, 5e-4], np.float32)
    s = lesson.DynamicLossScaler(init_scale=2.0 ** 30, growth_interval=1000)
    opt = CountingOptimizer()
    scales = []
    for _ in range(12):
        with np.errstate(over="ignore", invalid="ignore"):
            p = param_with_grad(fp16(true_grad * s.scale))  # the backward pass ran in fp16
        scales.append(s.scale)
        if s.step(opt, [p]):
            break
    assert opt.steps == 1, f"expected the scaler to back off until a step succeeds; scales tried {scales}"
    assert s.scale * 5e-4 < 65504, "the accepted scale must not overflow fp16"
    np.testing.assert_allclose(p.grad.numpy(), true_grad, rtol=2e-3,
                               err_msg="after unscaling, the small gradients must survive (no fp16 underflow)")
    assert np.all(fp16(true_grad)[:3] == 0), "sanity: unscaled, these gradients underflow fp16"


# ---------------------------------------------------------------- NumPy reference quantizer (for 10.9-10.12)


class NpQ:
    """A NumPy QTensor-alike made by np_quantize (the lesson's spec)."""

    def __init__(self, q, scale, zero_point, bits, symmetric):
        self.q, self.scale, self.zero_point, self.bits, self.symmetric = q, scale, zero_point, bits, symmetric

    def dequantize(self):
        s = expand(self.scale, self.q.shape)
        z = expand(self.zero_point, self.q.shape)
        return ((self.q.astype(np.int32) - z) * s).astype(np.float32)

    def nbytes(self):
        return (self.q.size * self.bits + 7) // 8 + 4 * self.scale.size + (0 if self.symmetric else self.zero_point.size)


def expand(s, shape):
    for ax, (ns, n) in enumerate(zip(s.shape, shape)):
        if ns != n and ns != 1:
            s = np.repeat(s, n // ns, axis=ax)
    return s


def np_quantize(x, bits=8, symmetric=True, block=None):
    x = np.asarray(x, dtype=np.float64)
    block = x.shape if block is None else tuple(n if b == -1 else b for b, n in zip(block, x.shape))
    grid = tuple(n // b for n, b in zip(x.shape, block))
    split = x.reshape(tuple(v for g, b in zip(grid, block) for v in (g, b)))
    axes = tuple(range(1, 2 * x.ndim, 2))
    qmax = 2 ** (bits - 1) - 1
    qmin = -qmax if symmetric else -qmax - 1
    if symmetric:
        s = np.abs(split).max(axis=axes) / qmax
        z = np.zeros(grid, np.int64)
    else:
        lo, hi = np.minimum(split.min(axis=axes), 0), np.maximum(split.max(axis=axes), 0)
        s = (hi - lo) / (qmax - qmin)
        z = np.clip(np.round(qmin - lo / np.where(s > 0, s, 1)), qmin, qmax).astype(np.int64)
    s = s.astype(np.float32)
    s = np.where(s > 0, s, np.float32(1))
    q = np.clip(np.round(x / expand(s.astype(np.float64), x.shape)) + expand(z, x.shape), qmin, qmax).astype(np.int8)
    return NpQ(q, s, z.astype(np.int32), bits, symmetric)


def np_gemm(a, b):
    assert a.dtype == np.int8 and b.dtype == np.int8, f"the int8 GEMM was called with {a.dtype} and {b.dtype}"
    return (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)


# ---------------------------------------------------------------- 10.4 quantize


@st.composite
def tensors_and_blocks(draw):
    ndim = draw(st.integers(1, 3))
    block = tuple(draw(st.sampled_from([1, 2, 3])) for _ in range(ndim))
    grid = tuple(draw(st.integers(1, 3)) for _ in range(ndim))
    shape = tuple(b * g for b, g in zip(block, grid))
    elems = st.floats(-1e4, 1e4, allow_nan=False, width=32)
    x = draw(hnp.arrays(np.float32, shape, elements=elems))
    return x, block


def block_scales(qt, shape):
    return np.broadcast_to(expand(np.asarray(qt.scale, dtype=np.float64), shape), shape)


@pytest.mark.exercise("10.4")
@given(tensors_and_blocks(), st.booleans(), st.sampled_from([8, 4]))
@example((np.array([0.0, 0.0, 0.0, 0.0], np.float32), (2,)), False, 8)
@example((np.array([5.0, 5.0, -3.0, -3.0], np.float32), (2,)), False, 8)
@example((np.array([1.0, -1.0, 0.5, 2.5], np.float32), (4,)), True, 4)
def test_quantize_error_bound(lesson, xb, symmetric, bits):
    x, block = xb
    qt = lesson.quantize(x, bits=bits, symmetric=symmetric, block=block)
    q = np.asarray(qt.q)
    assert q.dtype == np.int8 and q.shape == x.shape, f"q must be int8 of shape {x.shape}, got {q.dtype} {q.shape}"
    grid = tuple(n // b for n, b in zip(x.shape, block))
    assert np.shape(qt.scale) == grid, f"one scale per block: expected shape {grid}, got {np.shape(qt.scale)}"
    assert np.asarray(qt.scale).dtype == np.float32 and np.asarray(qt.zero_point).dtype == np.int32
    qmax = 2 ** (bits - 1) - 1
    lo = -qmax if symmetric else -qmax - 1
    assert q.min() >= lo and q.max() <= qmax, f"q outside [{lo}, {qmax}]: {q.min()}..{q.max()}"
    if symmetric:
        assert not np.any(qt.zero_point), "symmetric quantization has zero_point 0"
    d = np.asarray(qt.dequantize(), dtype=np.float64)
    assert np.all(np.isfinite(d)), "dequantize gave NaN/inf (a constant or zero block with scale 0?)"
    s = block_scales(qt, x.shape)
    err = np.abs(d - x)
    bound = s / 2 * (1 + 1e-6) + 4e-7 * np.abs(x) + 2e-45
    if not np.all(err <= bound):
        i = np.unravel_index(np.argmax(err - bound), x.shape)
        raise AssertionError(f"|x - dequantize(quantize(x))| must be <= scale/2: at {i}, x = {x[i]!r}, "
                             f"dequantized {d[i]!r}, scale {s[i]!r}")
    assert np.all(d[x == 0] == 0), "zero must be exact"


@pytest.mark.exercise("10.4")
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_per_channel_matches_spec(lesson, symmetric):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((45, 14)) * np.linspace(0.1, 10, 14)).astype(np.float32)
    if not symmetric:
        x = np.abs(x) + 0.5  # one-sided: the zero point matters
    for block in [(45, 1), (-1, 1), (1, 14), (15, 7), None]:
        got = lesson.quantize(x, symmetric=symmetric, block=block)
        want = np_quantize(x, symmetric=symmetric, block=block)
        np.testing.assert_allclose(np.asarray(got.scale), want.scale, rtol=1e-6, err_msg=f"scales for block {block}")
        np.testing.assert_array_equal(np.asarray(got.zero_point), want.zero_point, err_msg=f"zero points for block {block}")
        diff = np.abs(np.asarray(got.q, np.int32) - want.q)
        assert diff.max() <= 1 and np.mean(diff) < 1e-3, f"q for block {block} differs from round(x / s) + z"


@pytest.mark.exercise("10.4")
def test_quantize_constant_and_zero_tensors(lesson):
    for x in [np.zeros((4, 6), np.float32), np.full((4, 6), 3.5, np.float32), np.full((4, 6), -2.0, np.float32)]:
        for sym in (True, False):
            qt = lesson.quantize(x, symmetric=sym, block=(2, 3))
            d = np.asarray(qt.dequantize())
            assert np.all(np.isfinite(np.asarray(qt.scale))) and np.all(np.asarray(qt.scale) > 0), \
                f"constant tensor {x.flat[0]}: scales must be finite and > 0, got {qt.scale}"
            np.testing.assert_allclose(d, x, atol=np.abs(x).max() / 100 + 0, err_msg=f"constant {x.flat[0]}, symmetric={sym}")


@pytest.mark.exercise("10.4")
def test_quantize_with_saturates(lesson):
    x = np.array([[-1000.0, -2.0, 0.0, 1.26, 1000.0]], np.float32)
    q = np.asarray(lesson.quantize_with(x, np.array([[0.01]], np.float32), np.array([[0]], np.int32), 8, True))
    assert q.dtype == np.int8
    np.testing.assert_array_equal(q, [[-127, -127, 0, 126, 127]], err_msg="symmetric int8 saturates at -127/127")
    q = np.asarray(lesson.quantize_with(x, np.array([[0.01]], np.float32), np.array([[-100]], np.int32), 8, False))
    np.testing.assert_array_equal(q, [[-128, -128, -100, 26, 127]], err_msg="asymmetric int8: round(x/s) + z, clipped to [-128, 127]")
    q = np.asarray(lesson.quantize_with(x, np.array([[0.5]], np.float32), np.array([[0]], np.int32), 4, True))
    np.testing.assert_array_equal(q, [[-7, -4, 0, 3, 7]], err_msg="symmetric int4 saturates at -7/7")
    ties = np.array([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.25]], np.float32)
    q = np.asarray(lesson.quantize_with(ties, np.array([[1.0]], np.float32), np.array([[0]], np.int32), 8, True))
    np.testing.assert_array_equal(q, [[0, 2, 2, 0, -2, -2, 3]], err_msg="x / s exactly halfway rounds to the even "
                                  "integer (np.round), not away from zero")


@pytest.mark.exercise("10.4")
def test_quantize_rejects_bad_blocks(lesson):
    x = np.zeros((6, 10), np.float32)
    with pytest.raises(ValueError, match="divide|10|4"):
        lesson.quantize(x, block=(1, 4))
    with pytest.raises(ValueError):
        lesson.quantize(x, block=(6,))
    with pytest.raises(TypeError):
        lesson.quantize(np.zeros(4, np.int32))


@pytest.mark.exercise("10.4")
def test_quantize_rejects_values_and_parameters_it_cannot_represent(lesson):
    """NaN gave codes 0 with scale 1, inf a scale of inf, scale 0 codes of +-127, an empty input a
    ZeroDivisionError and parameters of the wrong shape a broadcast error: each is a clear error."""
    x = np.array([[0.5, -1.0, 2.0, 0.25]], np.float32)
    qt = lesson.quantize(x)
    np.testing.assert_array_equal(qt.q, [[32, -64, 127, 16]], err_msg="quantize of [0.5, -1, 2, 0.25]: s = 2/127")
    for bad, what in ((np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")):
        y = x.copy()
        y[0, 2] = bad
        with pytest.raises(ValueError, match=rf"quantize: x holds 1 NaN or inf.*{what} at index \(0, 2\)"):
            lesson.quantize(y)
        with pytest.raises(ValueError, match=rf"quantize_with: x holds 1 NaN or inf.*{what}"):
            lesson.quantize_with(y, np.ones((1, 1), np.float32), np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match=r"quantize: x is empty \(shape \(0, 3\)\)"):
        lesson.quantize(np.zeros((0, 3), np.float32))
    with pytest.raises(ValueError, match=r"quantize_with: scales must be finite and > 0, got \[0\.0\]"):
        lesson.quantize_with(x, np.zeros((1, 1), np.float32), np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match=r"quantize_with: scale \(3,\) and zero_point \(3,\) must have one entry per block of the tensor's shape \(1, 4\)"):
        lesson.quantize_with(x, np.ones(3, np.float32), np.zeros(3, np.int32))
    broken = lesson.QTensor(qt.q, np.ones((1, 3), np.float32), np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match=r"QTensor.dequantize: scale \(1, 3\) and zero_point \(1, 3\) .*\(1, 4\)"):
        broken.dequantize()


# ---------------------------------------------------------------- 10.5 int4


@pytest.mark.exercise("10.5")
def test_int4_bijection_over_all_bytes(lesson):
    allbytes = np.arange(256, dtype=np.uint8)
    vals = np.asarray(lesson.unpack_int4(allbytes, 512))
    assert vals.dtype == np.int8 and vals.shape == (512,)
    lo = ((allbytes.astype(np.int16) & 15) ^ 8) - 8
    hi = ((allbytes.astype(np.int16) >> 4) ^ 8) - 8
    np.testing.assert_array_equal(vals[0::2], lo, err_msg="low nibble (element 2i), sign-extended")
    np.testing.assert_array_equal(vals[1::2], hi, err_msg="high nibble (element 2i+1), sign-extended")
    np.testing.assert_array_equal(np.asarray(lesson.pack_int4(vals)), allbytes, err_msg="pack(unpack(b)) == b")


@pytest.mark.exercise("10.5")
def test_int4_layout_and_sign(lesson):
    got = np.asarray(lesson.pack_int4(np.array([1, -2, -8, 7, -1], np.int8)))
    assert got.dtype == np.uint8, f"pack_int4 returns uint8, got {got.dtype}"
    np.testing.assert_array_equal(got, [0xE1, 0x78, 0x0F], err_msg="[1, -2, -8, 7, -1] packs to E1 78 0F")
    np.testing.assert_array_equal(lesson.unpack_int4(np.array([0x8F], np.uint8), 2), [-1, -8])


@pytest.mark.exercise("10.5")
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 3), (0,)])
def test_int4_roundtrip_odd_shapes(lesson, shape):
    q = np.random.default_rng(5).integers(-8, 8, shape).astype(np.int8)
    packed = np.asarray(lesson.pack_int4(q))
    assert packed.shape == ((q.size + 1) // 2,), f"{q.size} values need {(q.size + 1) // 2} bytes, got {packed.shape}"
    back = np.asarray(lesson.unpack_int4(packed, shape))
    assert back.dtype == np.int8
    np.testing.assert_array_equal(back, q)


@pytest.mark.exercise("10.5")
def test_int4_errors(lesson):
    with pytest.raises(ValueError, match="-8|7|range"):
        lesson.pack_int4(np.array([8], np.int8))
    with pytest.raises(ValueError):
        lesson.pack_int4(np.array([-9], np.int16))
    with pytest.raises(TypeError):
        lesson.pack_int4(np.array([0.5]))
    with pytest.raises(ValueError, match="5"):
        lesson.unpack_int4(np.zeros(2, np.uint8), 5)   # too few bytes for 5 values
    for nbytes, shape in [(4, 5), (3, 4), (8, (2, 3))]:   # too many: a shape that uses only part of them
        with pytest.raises(ValueError):
            lesson.unpack_int4(np.zeros(nbytes, np.uint8), shape)
            pytest.fail(f"unpack_int4 of {nbytes} bytes into shape {shape} ({np.prod(shape)} values need "
                        f"{(np.prod(shape) + 1) // 2} bytes) should raise ValueError: too many bytes is an error too")
    assert np.asarray(lesson.unpack_int4(np.zeros(3, np.uint8), 5)).shape == (5,), "3 bytes hold 5 values"


# ---------------------------------------------------------------- 10.6 int8 GEMM


def machine_isa():
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def host_features():
    import llvmlite.binding as llvm

    return set(llvm.get_host_cpu_features().flatten().split(","))


def widening_madds(arch=None, feats=None):
    """Regex of the widening integer multiply-adds a CPU has (this one unless `arch` and its
    `feats`, e.g. {"+avx2"}, are given), and their names."""
    arch = arch or machine_isa()
    if arch == "x86_64":
        feats = host_features() if feats is None else feats
        names = []
        if "+avx2" in feats or "+avx512bw" in feats:
            names += ["vpmaddwd", "vpmaddubsw"]
        if feats & {"+avx512vnni", "+avxvnni"}:
            names += ["vpdpwssd", "vpdpwssds", "vpdpbusd", "vpdpbusds"]
        if not names:
            pytest.skip("this x86-64 CPU has neither AVX2 nor AVX-512BW")
        return re.compile(r"\b(" + "|".join(names) + r")\b"), names
    if arch == "aarch64":
        names = ["sdot", "smlal", "smlal2", "smull", "smull2", "sadalp"]
        return re.compile(r"\b(" + "|".join(names) + r")\b"), names
    pytest.skip(f"no widening multiply-add pattern for ISA {arch}")


@pytest.mark.exercise("10.6")
def test_int8_dot_exact_and_int32(lesson):
    rng = np.random.default_rng(6)
    for n in [0, 1, 7, 33, 1000, 4099]:
        x = rng.integers(-128, 128, n).astype(np.int8)
        y = rng.integers(-128, 128, n).astype(np.int8)
        got = lesson.int8_dot(x, y)
        assert isinstance(got, (int, np.integer)) and not isinstance(got, bool), \
            f"int8_dot should return an integer (int32 in Numba), got {type(got).__name__} {got!r}"
        assert int(got) == int(x.astype(np.int64) @ y.astype(np.int64)), f"n={n}: got {got}"


@pytest.mark.exercise("10.6")
def test_int8_dot_no_int16_overflow(lesson):
    for k in [2, 3, 1000, 100_000]:
        x = np.full(k, -128, np.int8)
        got = int(lesson.int8_dot(x, x))
        assert got == 16384 * k, (f"all -128, K={k}: expected {16384 * k}, got {got} (an int8/int16 accumulator, "
                                  "or a float32 one, would lose it)")
    x = np.full(100_000, -128, np.int8)
    y = np.full(100_000, 127, np.int8)
    assert int(lesson.int8_dot(x, y)) == -128 * 127 * 100_000


@pytest.mark.exercise("10.6")
def test_int8_dot_uses_widening_multiply_add(lesson):
    pattern, names = widening_madds()
    x = np.zeros(64, np.int8)
    lesson.int8_dot(x, x)
    fn = lesson.int8_dot
    sig = (numba.typeof(x), numba.typeof(x))
    asm = fn.inspect_asm(sig)
    found = sorted({m.group(1) for m in pattern.finditer(asm)})
    assert found, (f"int8_dot's machine code has no widening integer multiply-add ({', '.join(names)}): is the sum "
                   "kept in int32 (np.int32(acc + ...)) so that LLVM can use them? An int64 sum compiles to "
                   "vpmuldq/vpaddq, a float one to float instructions.")


@pytest.mark.exercise("10.6")
def test_matmul_int8_ragged_and_extremes(lesson):
    rng = np.random.default_rng(7)
    for m, k, n in [(1, 1, 1), (17, 33, 5), (37, 200, 70), (3, 1, 130)]:
        a = rng.integers(-128, 128, (m, k)).astype(np.int8)
        b = rng.integers(-128, 128, (k, n)).astype(np.int8)
        c = lesson.matmul_int8(a, b)
        assert c.dtype == np.int32 and c.shape == (m, n), f"expected int32 {(m, n)}, got {c.dtype} {c.shape}"
        np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64), err_msg=f"{m}x{k} @ {k}x{n}")
    a = np.full((5, 3000), -128, np.int8)
    np.testing.assert_array_equal(lesson.matmul_int8(a, a.T.copy()), np.full((5, 5), 16384 * 3000))
    np.testing.assert_array_equal(lesson.matmul_int8(a[:, ::2], a.T[::2]), np.full((5, 5), 16384 * 1500),
                                  err_msg="strided (non-contiguous) operands")
    with pytest.raises(TypeError, match="int8"):
        lesson.matmul_int8(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int8))
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        lesson.matmul_int8(np.zeros((2, 3), np.int8), np.zeros((2, 2), np.int8))


@pytest.mark.exercise("10.6")
def test_int8_sums_exact_at_the_widest_k_allowed(lesson):
    """matmul_int8's docstring allows K <= MAX_K_INT32 = 131071 (K * 128 * 128 < 2^31): at that K, with
    every product at its extreme, the int32 sums must still be exact; one element more is refused."""
    k = lesson.MAX_K_INT32
    assert k == 131071, f"MAX_K_INT32 should be 131071 (the largest K with K * 128 * 128 < 2^31), got {k}"
    x = np.full(k, -128, np.int8)
    got = int(lesson.int8_dot(x, x))
    assert got == 16384 * k == 2**31 - 2**14, \
        f"int8_dot of two all -128 vectors of K={k}: expected {16384 * k} (just below 2^31), got {got}"
    a = np.full((2, k), -128, np.int8)
    b = np.full((k, 3), -128, np.int8)
    b[:, 1] = 127
    want = np.array([[16384 * k, -128 * 127 * k, 16384 * k]] * 2, np.int64)
    c = lesson.matmul_int8(a, b)
    assert c.dtype == np.int32, f"matmul_int8 should return int32, got {c.dtype}"
    np.testing.assert_array_equal(c.astype(np.int64), want,
                                  err_msg=f"matmul_int8 at K = {k}, every product at -128 x -128 or -128 x 127")
    with pytest.raises(ValueError, match=str(k)):
        lesson.matmul_int8(np.zeros((1, k + 1), np.int8), np.zeros((k + 1, 1), np.int8))


@pytest.mark.exercise("10.6")
def test_int8_dot_rejects_other_lengths_and_dtypes(lesson):
    """ones(5) . ones(3) used to read past the end of the shorter array (it returned 106), and
    int16 was accepted."""
    x = np.arange(-3, 4, dtype=np.int8)
    assert int(lesson.int8_dot(x, x)) == 28, f"int8_dot(x, x) for x = -3..3: expected 28, got {lesson.int8_dot(x, x)}"
    with pytest.raises(ValueError, match=r"int8_dot: x and y must have the same length, got 5 and 3"):
        lesson.int8_dot(np.ones(5, np.int8), np.ones(3, np.int8))
    with pytest.raises(TypeError, match=r"int8_dot: x and y must be 1-D int8 arrays, got .*int16"):
        lesson.int8_dot(np.ones(5, np.int16), np.ones(5, np.int16))


# ---------------------------------------------------------------- 10.13 the zero-point shift for VNNI


@pytest.mark.exercise("10.13")
def test_shift_to_u8_values_shape_and_dtype(lesson):
    a = np.array([[-128, -1, 0], [1, 126, 127]], np.int8)
    got = lesson.shift_to_u8(a)
    want = np.array([[0, 127, 128], [129, 254, 255]], np.uint8)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint8 and got.shape == a.shape, (
        f"shift_to_u8 must return a uint8 array of a's shape {a.shape}, got {getattr(got, 'dtype', type(got))} "
        f"{getattr(got, 'shape', '')}")
    np.testing.assert_array_equal(got, want, err_msg="shift_to_u8(a) must be a + 128 (-128 -> 0, 127 -> 255)")
    np.testing.assert_array_equal(a, [[-128, -1, 0], [1, 126, 127]], err_msg="shift_to_u8 must not change a")
    t = lesson.shift_to_u8(np.arange(-128, 128, dtype=np.int8).reshape(16, 16).T)  # a non-contiguous view
    np.testing.assert_array_equal(t, (np.arange(256).reshape(16, 16).T).astype(np.uint8))
    assert lesson.shift_to_u8(np.zeros((0, 3), np.int8)).shape == (0, 3)


@pytest.mark.exercise("10.13")
def test_zero_point_correction_values_and_int32(lesson):
    b = np.array([[-128, 127, 1], [-128, 127, -1], [-128, 127, 0]], np.int8)
    got = lesson.zero_point_correction(b)
    assert isinstance(got, np.ndarray) and got.dtype == np.int32 and got.shape == (3,), (
        f"zero_point_correction(b (3, 3)) must be an int32 vector of shape (3,), got "
        f"{getattr(got, 'dtype', type(got))} {getattr(got, 'shape', '')}")
    np.testing.assert_array_equal(got, [128 * -384, 128 * 381, 0],
                                  err_msg="zero_point_correction(b)[j] must be 128 * (sum over k of b[k, j])")
    big = np.full((131071, 2), -128, np.int8)  # a column sum an int16 (or int8) sum would wrap
    np.testing.assert_array_equal(lesson.zero_point_correction(big), [128 * -128 * 131071] * 2,
                                  err_msg="sum the columns in int32 (or wider): 131071 x -128 does not fit int16")
    np.testing.assert_array_equal(lesson.zero_point_correction(np.zeros((0, 4), np.int8)), np.zeros(4, np.int32))


@pytest.mark.exercise("10.13")
def test_matmul_int8_vnni_exact(lesson):
    rng = np.random.default_rng(13)
    for m, k, n in [(1, 1, 1), (7, 3, 5), (17, 33, 5), (37, 1031, 70), (3, 4, 130), (64, 4096, 48), (5, 0, 3)]:
        a = rng.integers(-128, 128, (m, k)).astype(np.int8)
        b = rng.integers(-128, 128, (k, n)).astype(np.int8)
        got = lesson.matmul_int8_vnni(a, b)
        want = a.astype(np.int64) @ b.astype(np.int64)
        assert got.dtype == np.int32 and got.shape == (m, n), f"matmul_int8_vnni must return int32 (M, N), got {got.dtype} {got.shape}"
        np.testing.assert_array_equal(got, want, err_msg=f"matmul_int8_vnni on ({m}, {k}) @ ({k}, {n})")
    a = rng.integers(-128, 128, (9, 40)).astype(np.int8)
    np.testing.assert_array_equal(lesson.matmul_int8_vnni(a[:, ::2], a.T[::2]),  # non-contiguous views, K = 20
                                  a[:, ::2].astype(np.int64) @ a.T[::2].astype(np.int64))


@pytest.mark.exercise("10.13")
def test_matmul_int8_vnni_exact_at_the_widest_k(lesson):
    """At K = MAX_K_INT32 the shifted products' sum leaves int32's range (131071 x 255 x 128); the
    instruction adds modulo 2^32 and the correction brings the sum back."""
    k = 131071
    for x, y in ((-128, -128), (127, -128), (-128, 127)):
        a = np.full((3, k), x, np.int8)
        b = np.full((k, 17), y, np.int8)
        np.testing.assert_array_equal(lesson.matmul_int8_vnni(a, b), np.full((3, 17), k * x * y, np.int64),
                                      err_msg=f"matmul_int8_vnni with every a = {x}, every b = {y}, K = {k}")


@pytest.mark.exercise("10.13")
def test_matmul_int8_vnni_uses_vpdpbusd(lesson):
    from minitorch.simd import u8s8_flavour

    if machine_isa() != "x86_64" or u8s8_flavour() == "generic":
        pytest.skip(f"this CPU has no VNNI (AVX-512 VNNI or AVX-VNNI): vdot_u8s8 is portable LLVM IR here "
                    f"({machine_isa()}, flavour {u8s8_flavour()})")
    a = np.ones((20, 64), np.int8)
    np.testing.assert_array_equal(lesson.matmul_int8_vnni(a, a.T.copy()), np.full((20, 20), 64))
    gemm = lesson.gemm_int8_vnni
    asm = "\n".join(gemm.inspect_asm(sig) for sig in gemm.signatures)
    assert re.search(r"\bvpdpbusd\b", asm), "the VNNI GEMM's machine code has no vpdpbusd"


# ---------------------------------------------------------------- 10.7 dp4a (CUDA C)


def dp4a_ptx(lesson):
    from course.cuda_c import compile_ptx

    return compile_ptx(lesson.int8_gemm_dp4a_source())

def _packed_dp4a_operands(a, b):
    k4 = -(-a.shape[1] // 4)
    ap = np.zeros((a.shape[0], 4 * k4), np.int8)
    ap[:, :a.shape[1]] = a
    bp = np.zeros((b.shape[1], 4 * k4), np.int8)
    bp[:, :b.shape[0]] = b.T
    return ap.view(np.int32), bp.view(np.int32), k4



@pytest.mark.exercise("10.7")
def test_dp4a_kernel_ptx_structure(lesson):
    from course.cuda_c import kernel_params, ptx_stats

    src = lesson.int8_gemm_dp4a_source()
    params = [(p.name, p.ctype, p.pointer) for p in kernel_params(src, "int8_gemm_dp4a")]
    assert [(c, ptr) for _, c, ptr in params] == [("int", True)] * 3 + [("int", False)] * 3, \
        f"signature must be (const int* A4, const int* B4t, int* C, int M, int N, int K4), got {params}"
    ptx = dp4a_ptx(lesson)
    n_dp4a = len(re.findall(r"\bdp4a\.s32\.s32\b", ptx))
    st = ptx_stats(ptx)
    assert n_dp4a >= 1, "the PTX has no dp4a.s32.s32: the inner loop must call __dp4a on int words"
    assert st.fma_f32 == 0, f"an int8 GEMM should do no float FMAs, found {st.fma_f32}"
    assert st.bar_sync >= 2 and st.ld_shared >= 2 and st.shared_bytes >= 2 * 16 * 16 * 4, (
        f"expected 16x16 shared-memory tiles of int (>= 2048 bytes) and two barriers per tile step; got {st}")


@pytest.mark.exercise("10.7")
def test_dp4a_kernel_on_emulator(lesson):
    from course.cuda_c import emulate

    rng = np.random.default_rng(19)
    for m, k, n in [(19, 37, 21), (3, 4, 40), (33, 130, 5)]:
        a = rng.integers(-128, 128, (m, k)).astype(np.int8)
        b = rng.integers(-128, 128, (k, n)).astype(np.int8)
        a[0] = -128
        b[:, 0] = -128
        a4, b4t, k4 = _packed_dp4a_operands(a, b)
        c = np.zeros((m, n), np.int32)
        emulate(lesson.int8_gemm_dp4a_source(), "int8_gemm_dp4a", (-(-n // 16), -(-m // 16)), (16, 16),
                [a4, b4t, c, np.int32(m), np.int32(n), np.int32(k4)])
        np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64), err_msg=f"{m}x{k} @ {k}x{n}")


@pytest.mark.exercise("10.7")
@pytest.mark.gpu
def test_dp4a_kernel_on_gpu(lesson):
    import cupy as cp

    rng = np.random.default_rng(20)
    a = rng.integers(-128, 128, (77, 301)).astype(np.int8)
    b = rng.integers(-128, 128, (301, 45)).astype(np.int8)
    c = cp.asnumpy(lesson.int8_gemm_dp4a(cp.asarray(a), cp.asarray(b)))
    np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64))


# ---------------------------------------------------------------- 10.14 dp4a with register tiles (CUDA C)



@pytest.mark.exercise("10.14")
def test_dp4a_regtile_ptx_structure(lesson):
    from course.cuda_c import compile_ptx, kernel_params, ptx_stats

    src = lesson.int8_gemm_dp4a_regtile_source()
    params = [(p.name, p.ctype, p.pointer) for p in kernel_params(src, "int8_gemm_dp4a_regtile")]
    assert [(c, ptr) for _, c, ptr in params] == [("int", True)] * 3 + [("int", False)] * 3, \
        f"signature must be (const int* A4, const int* B4t, int* C, int M, int N, int K4), got {params}"
    ptx = compile_ptx(src)
    st = ptx_stats(ptx)
    assert st.dp4a >= 64, (f"each thread's 8 x 8 outputs take 64 __dp4a per word of k (dp4a in the PTX, the loop "
                           f"over kk unrolled); the PTX has {st.dp4a}")
    assert st.fma_f32 == 0, f"an int8 GEMM should do no float FMAs, found {st.fma_f32}"
    assert st.ld_shared_v4 >= 4 and st.ld_shared_v4 * 16 <= st.dp4a, (
        f"per word of k, two int4 loads from As and two from Bs (ld.shared.v4) should feed 64 __dp4a: the PTX has "
        f"{st.ld_shared_v4} 16-byte shared loads for {st.dp4a} dp4a")
    assert st.local_bytes == 0, (f"{st.local_bytes} bytes per thread in local memory: the 64 accumulators and the "
                                 f"a[8], b[8] arrays must be indexed by compile-time constants (#pragma unroll)")
    assert st.bar_sync >= 2, f"two barriers per step of k (after the tiles are stored, before they are overwritten); got {st.bar_sync}"


@pytest.mark.exercise("10.14")
def test_dp4a_regtile_exact_on_odd_shapes(lesson):
    from course.cuda_c import emulate

    rng = np.random.default_rng(24)
    # several k steps with a partial last one; a block of C past both edges; K not a multiple of 4
    for m, k, n in [(130, 70, 131), (5, 3, 9), (1, 37, 200)]:
        a = rng.integers(-128, 128, (m, k)).astype(np.int8)
        b = rng.integers(-128, 128, (k, n)).astype(np.int8)
        a[0] = -128
        b[:, 0] = -128
        a4, b4t, k4 = _packed_dp4a_operands(a, b)
        c = np.full((m, n), -7, np.int32)
        emulate(lesson.int8_gemm_dp4a_regtile_source(), "int8_gemm_dp4a_regtile", *lesson.dp4a_regtile_launch(m, n),
                [a4, b4t, c, np.int32(m), np.int32(n), np.int32(k4)])
        np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64), err_msg=f"{m}x{k} @ {k}x{n}")
    a = rng.integers(-128, 128, (40, 50)).astype(np.int8)
    b = rng.integers(-128, 128, (50, 30)).astype(np.int8)
    np.testing.assert_array_equal(lesson.int8_gemm_dp4a_regtile_emulated(a, b), a.astype(np.int64) @ b,
                                  err_msg="int8_gemm_dp4a_regtile_emulated (the given wrapper packs the operands)")


@pytest.mark.exercise("10.14")
def test_dp4a_regtile_gives_each_thread_an_8x8_block(lesson):
    from course.cuda_c import run_kernel

    a = np.ones((128, 8), np.int8)
    b = np.ones((8, 128), np.int8)
    a4, b4t, k4 = _packed_dp4a_operands(a, b)
    c = np.zeros((128, 128), np.int32)
    run = run_kernel(lesson.int8_gemm_dp4a_regtile_source(), "int8_gemm_dp4a_regtile", *lesson.dp4a_regtile_launch(128, 128),
                     [a4, b4t, c, np.int32(128), np.int32(128), np.int32(k4)], profile=True, schedules=("forward",))
    np.testing.assert_array_equal(c, np.full((128, 128), 8))
    writer = run.profile["C"]["writer"].reshape(128, 128)
    threads = np.unique(writer)
    assert len(threads) == 256 and (threads >= 0).all(), (
        f"the 128 x 128 tile should be written by all 256 threads of the block, 64 outputs each; {len(threads)} "
        f"threads wrote it")
    for t in (0, 1, 16, 37, 200, 255):  # ty != tx in most: the two must not be swapped
        rows, cols = np.nonzero(writer == t)
        want_rows = sorted({4 * (t // 16) + i % 4 + 64 * (i // 4) for i in range(8)})
        want_cols = sorted({4 * (t % 16) + j % 4 + 64 * (j // 4) for j in range(8)})
        assert sorted(set(rows)) == want_rows and sorted(set(cols)) == want_cols and len(rows) == 64, (
            f"thread {t} (ty = {t // 16}, tx = {t % 16}) should write rows {want_rows} x columns {want_cols} of the "
            f"tile; it wrote rows {sorted(set(rows.tolist()))}, columns {sorted(set(cols.tolist()))}")


@pytest.mark.exercise("10.14")
@pytest.mark.gpu
def test_dp4a_regtile_on_gpu(lesson):
    import cupy as cp

    rng = np.random.default_rng(25)
    a = rng.integers(-128, 128, (300, 517)).astype(np.int8)
    b = rng.integers(-128, 128, (517, 259)).astype(np.int8)
    c = cp.asnumpy(lesson.int8_gemm_dp4a_regtile(cp.asarray(a), cp.asarray(b)))
    np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64))


# ---------------------------------------------------------------- 10.8 systolic array

X_NOTE = np.array([[1, 2, 3, 2], [3, 0, 1, 2], [-2, 1, 4, 0], [0, -1, 2, 3]], np.int8)
W_NOTE = np.array([[1, 0, 2, -1], [0, 1, -1, 2], [2, -1, 0, 1], [1, 1, 1, 0]], np.int8)
Y_NOTE = np.array([[9, 1, 2, 6], [7, 1, 8, -2], [6, -3, -5, 8], [7, 0, 4, 0]])


def record(lesson, x, w):
    trace = []
    y, done, cycles = lesson.systolic_tile(x, w, lambda t, row, act, psum: trace.append(
        (int(t), np.array(row), np.array(act), np.array(psum))))
    return y, done, cycles, trace


@pytest.mark.exercise("10.8")
def test_systolic_worked_example_of_the_note(lesson):
    y, done, cycles, trace = record(lesson, X_NOTE, W_NOTE)
    np.testing.assert_array_equal(y, Y_NOTE, err_msg="the note's 4x4 example: Y = X @ W")
    assert np.asarray(y).dtype == np.int32
    assert cycles == 10, f"one 4x4 tile with M = 4 takes M + R + C - 2 = 10 cycles, got {cycles}"
    assert [t for t, *_ in trace] == list(range(10)), "on_cycle must be called once per cycle, t = 0..9"
    want_done = np.add.outer(np.arange(4), np.arange(4)) + 3
    np.testing.assert_array_equal(done, want_done, err_msg="Y[m, c] leaves at the end of cycle m + R - 1 + c")
    col0 = [trace[r][3][r, 0] for r in range(4)]
    assert col0 == [1, 1, 7, 9], f"the note follows Y[0,0] down column 0: partial sums 1, 1, 7, 9; got {col0}"
    t3_row = trace[3][1]
    assert t3_row[0].tolist() == [3, 2, 1, 0] and t3_row[3].tolist() == [0, -1, -1, -1], \
        f"at cycle 3, PE(r, c) works on row m = 3 - r - c (-1 idle): got\n{t3_row}"


@pytest.mark.exercise("10.8")
@pytest.mark.parametrize("m,r,c", [(5, 3, 4), (2, 4, 6), (1, 5, 2)])
def test_systolic_dataflow_every_cycle(lesson, m, r, c):
    rng = np.random.default_rng(m * 100 + r * 10 + c)
    x = rng.integers(-128, 128, (m, r)).astype(np.int8)
    w = rng.integers(-128, 128, (r, c)).astype(np.int8)
    y, done, cycles, trace = record(lesson, x, w)
    assert cycles == m + r + c - 2 == len(trace)
    np.testing.assert_array_equal(y, x.astype(np.int64) @ w.astype(np.int64))
    x64, w64 = x.astype(np.int64), w.astype(np.int64)
    for t, row, act, psum in trace:
        for i in range(r):
            for j in range(c):
                mm = t - i - j
                if 0 <= mm < m:
                    assert row[i, j] == mm, f"cycle {t}: PE({i},{j}) should work on row {mm}, says {row[i, j]}"
                    assert act[i, j] == x64[mm, i], f"cycle {t}: PE({i},{j}) should hold X[{mm},{i}] = {x64[mm, i]}, holds {act[i, j]}"
                    want = int(x64[mm, : i + 1] @ w64[: i + 1, j])
                    assert psum[i, j] == want, (f"cycle {t}: PE({i},{j}) should hold sum_(k<={i}) X[{mm},k] W[k,{j}] "
                                                f"= {want}, holds {psum[i, j]}")
                else:
                    assert row[i, j] == -1, f"cycle {t}: PE({i},{j}) has no valid row (m = {mm}), so row must be -1"


@pytest.mark.exercise("10.8")
def test_systolic_matmul_tiles(lesson):
    rng = np.random.default_rng(8)
    for (m, k, n), (r, c) in [((7, 11, 9), (4, 4)), ((3, 4, 4), (4, 4)), ((6, 13, 5), (3, 2))]:
        x = rng.integers(-128, 128, (m, k)).astype(np.int8)
        w = rng.integers(-128, 128, (k, n)).astype(np.int8)
        y, cycles = lesson.systolic_matmul(x, w, r, c)
        assert np.asarray(y).dtype == np.int32 and y.shape == (m, n)
        np.testing.assert_array_equal(y, x.astype(np.int64) @ w.astype(np.int64), err_msg=f"{m}x{k} @ {k}x{n} on {r}x{c}")
        want = math.ceil(k / r) * math.ceil(n / c) * (m + r + c - 2)
        assert cycles == want, f"ceil(K/R) * ceil(N/C) * (M + R + C - 2) = {want} cycles, got {cycles}"
    x = np.full((2, 9), -128, np.int8)
    y, _ = lesson.systolic_matmul(x, x.T.copy(), 4, 4)
    np.testing.assert_array_equal(y, np.full((2, 2), 16384 * 9), err_msg="int32 accumulation across K tiles")


@pytest.mark.exercise("10.8")
def test_systolic_matmul_rejects_an_empty_array(lesson):
    x = np.arange(6, dtype=np.int8).reshape(2, 3)
    y, _ = lesson.systolic_matmul(x, x.T.copy(), 2, 2)
    np.testing.assert_array_equal(y, x.astype(np.int64) @ x.T.astype(np.int64), err_msg="2x3 @ 3x2 on a 2x2 array")
    for rows, cols in ((0, 2), (2, 0)):
        with pytest.raises(ValueError, match=r"systolic_matmul: (rows|cols) must be >= 1, got 0"):
            lesson.systolic_matmul(x, x.T.copy(), rows, cols)


# ---------------------------------------------------------------- 10.9 QuantLinear


def quant_linear(lesson, w, b, **kw):
    return lesson.QuantLinear(w, b, gemm=np_gemm, quantize_fn=np_quantize, **kw)


def w8a8_expected(x2, w, b, per_channel):
    k = w.shape[0]
    qw = np_quantize(w, 8, True, (k, 1) if per_channel else None)
    qx = np_quantize(x2, 8, False, (1, k) if per_channel else None)
    acc = qx.q.astype(np.int64) @ qw.q.astype(np.int64)
    colsum = qw.q.astype(np.int64).sum(axis=0)
    y = (acc - qx.zero_point.astype(np.int64) * colsum) * qx.scale.astype(np.float64) * qw.scale.astype(np.float64)
    return y + (0 if b is None else b)


@pytest.mark.exercise("10.9")
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_quantlinear_w8a8_formula(lesson, granularity):
    rng = np.random.default_rng(9)
    k, n = 24, 10
    w = (rng.standard_normal((k, n)) * np.linspace(0.2, 3, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x = (np.abs(rng.standard_normal((2, 3, k))) * np.linspace(0.5, 4, 6)[:, None].reshape(2, 3, 1) - 0.2).astype(np.float32)
    layer = quant_linear(lesson, w, b, mode="w8a8", granularity=granularity)
    out = layer(Tensor(x))
    assert isinstance(out, Tensor), f"forward returns a Tensor, got {type(out).__name__}"
    y = out.numpy()
    assert y.shape == (2, 3, n) and y.dtype == np.float32, f"expected float32 (2, 3, {n}), got {y.dtype} {y.shape}"
    want = w8a8_expected(x.reshape(6, k), w, b, granularity == "channel").reshape(2, 3, n)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5,
                               err_msg=f"W8A8 ({granularity}): s_x s_w (acc - z_x colsum) + bias")
    ref = x @ w + b
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err < 0.05, f"W8A8 output is far from the float product (relative error {err:.3f})"


@pytest.mark.exercise("10.9")
@pytest.mark.parametrize("mode,granularity,bits,sym", [("w8", "channel", 8, True), ("w8", "group", 8, True),
                                                        ("w4", "group", 4, False), ("w4", "channel", 4, False)])
def test_quantlinear_weight_only(lesson, mode, granularity, bits, sym):
    rng = np.random.default_rng(10)
    k, n = 48, 7
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((5, k)).astype(np.float32)
    layer = quant_linear(lesson, w, None, mode=mode, granularity=granularity, group_size=16)
    y = layer(x).numpy()
    block = (16, 1) if granularity == "group" else (k, 1)
    want = x @ np_quantize(w, bits, sym, block).dequantize()
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=f"{mode}/{granularity}: x @ dequantized weight")


@pytest.mark.exercise("10.9")
def test_quantlinear_drops_into_a_model(lesson):
    rng = np.random.default_rng(11)
    lin = Linear(20, 6, rng=rng)
    lin.bias.data[...] = rng.standard_normal(6)
    q = lesson.QuantLinear.from_linear(lin, mode="w8a8", gemm=np_gemm, quantize_fn=np_quantize)
    x = rng.standard_normal((9, 20)).astype(np.float32)
    np.testing.assert_allclose(q(Tensor(x)).numpy(), w8a8_expected(x, lin.weight.numpy(), lin.bias.numpy(), True),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"20"):
        q(Tensor(np.zeros((3, 7), np.float32)))


@pytest.mark.exercise("10.9")
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_quantlinear_w8a8_uses_the_integer_gemm(lesson, granularity):
    """W8A8 multiplies int8 by int8 with the GEMM it is given, and rescales its int32 result: adding 1000 to
    every entry the GEMM returns must move y[t, n] by 1000 s_x[t] s_w[n]. Dequantizing both operands
    and multiplying in float gives the same numbers but never calls it (the int8 kernel does no work)."""
    rng = np.random.default_rng(21)
    k, n, t = 20, 6, 7
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((t, k)).astype(np.float32)
    calls = []

    def gemm(a, b, bump=0):
        calls.append((np.asarray(a).dtype, np.asarray(a).shape, np.asarray(b).dtype, np.asarray(b).shape))
        return np_gemm(a, b) + np.int32(bump)

    layer = lesson.QuantLinear(w, None, mode="w8a8", granularity=granularity, gemm=gemm, quantize_fn=np_quantize)
    y = layer(x).numpy().astype(np.float64)
    assert calls == [(np.dtype(np.int8), (t, k), np.dtype(np.int8), (k, n))], (
        f"one forward must call the int8 GEMM once, on int8 (T, K) and (K, N) operands; calls: {calls}")
    layer.gemm = lambda a, b: gemm(a, b, bump=1000)
    y1 = layer(x).numpy().astype(np.float64)
    block = (1, k) if granularity == "channel" else None
    sx = np.broadcast_to(np_quantize(x, 8, False, block).scale.astype(np.float64), (t, 1))
    sw = np.broadcast_to(np_quantize(w, 8, True, (k, 1) if granularity == "channel" else None).scale.astype(np.float64), (1, n))
    np.testing.assert_allclose(y1 - y, 1000 * sx * sw, rtol=1e-4, atol=0,
                               err_msg="y must be s_x s_w (acc - z_x colsum) with acc the GEMM's int32 result")


@pytest.mark.exercise("10.9")
def test_quantlinear_zero_point_matters(lesson):
    """One-sided activations (after GELU): a forgotten zero-point correction is a large error."""
    rng = np.random.default_rng(12)
    k, n = 64, 16
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    x = (np.abs(rng.standard_normal((32, k))) + 1.0).astype(np.float32)
    y = quant_linear(lesson, w, None, mode="w8a8")(x).numpy()
    ref = x.astype(np.float64) @ w
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < 0.01, f"W8A8 per-channel relative error {err:.4f} on one-sided activations (zero point applied?)"


@pytest.mark.exercise("10.9")
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_quantlinear_zero_point_correction_does_not_overflow_int32(lesson, granularity):
    """A layer 100,003 inputs wide (under MAX_K_INT32 = 131,071, so the int8 GEMM's int32 sums are
    exact) with positive weights and positive activations: q_w = 127 everywhere, z_x = -128 and
    q_x = 127, so acc = 127 * 127 * K = 1.61e9 fits int32, z_x colsum = -128 * 127 * K = -1.63e9
    fits too, but acc - z_x colsum = 255 * 127 * K = 3.24e9 does not. Correcting in int32 wraps
    around to a negative y; the oracle is the exact product in float64."""
    k, n = 100_003, 3
    w = np.full((k, n), 0.01, np.float32) * np.array([1.0, 2.0, 0.5], np.float32)
    x = np.full((2, k), 0.5, np.float32) * np.array([[1.0], [3.0]], np.float32)
    y = quant_linear(lesson, w, None, mode="w8a8", granularity=granularity)(Tensor(x)).numpy()
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert y.dtype == np.float32 and y.shape == (2, n), f"expected float32 (2, {n}), got {y.dtype} {y.shape}"
    np.testing.assert_allclose(y, exact, rtol=1e-2,
                               err_msg=f"W8A8 ({granularity}), K = {k}: acc - z_x colsum = 255 * 127 * K exceeds "
                                       "int32 (2^31 - 1): compute the zero-point correction in int64 (or float64)")


@pytest.mark.exercise("10.9")
def test_quantlinear_rejects_a_bias_and_group_that_do_not_fit(lesson):
    """A bias of the wrong shape used to be accepted and fail only at forward; group_size_for(0)
    raised 'max() arg is an empty sequence'."""
    rng = np.random.default_rng(21)
    w, b = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    got = quant_linear(lesson, w, b, mode="w8", granularity="channel")(x).numpy()
    np.testing.assert_allclose(got, x @ np_quantize(w, 8, True, (6, 1)).dequantize() + b, rtol=1e-5, atol=1e-5,
                               err_msg="w8 per channel")
    with pytest.raises(ValueError, match=r"QuantLinear: bias must have shape \(4,\) for weight \(6, 4\), got \(6,\)"):
        quant_linear(lesson, w, np.zeros(6, np.float32), mode="w8")
    with pytest.raises(ValueError, match=r"group_size_for: k must be >= 1, got 0"):
        lesson.group_size_for(0)


# ---------------------------------------------------------------- tiny GPT (lesson 09's checkpoint), graded under 10.9

GPT_MARGIN = 0.005  # nats/char on 16 windows; measured |W8A8 per-channel - fp32| = 0.0018, missing zero point +7.7


@pytest.mark.exercise("10.9")
@pytest.mark.timeout(120)
def test_quantized_tiny_gpt_val_loss(lesson):
    gpt = pytest.importorskip("minitorch.gpt", reason="lesson 09 (minitorch.gpt, the tiny GPT) is not installed")
    try:
        model, tok = gpt.load_tiny_gpt()
    except FileNotFoundError as exc:
        pytest.skip(f"lesson 09's checkpoint is missing: {exc}")
    _, val_ids = gpt.split_ids(tok.encode(gpt.load_corpus()))
    base = gpt.evaluate_loss(model, val_ids, 16)
    q = lesson.quantize_model(model, mode="w8a8", granularity="channel", gemm=np_gemm, quantize_fn=np_quantize)
    n_q = sum(type(m).__name__ == "QuantLinear" for m in q.modules())
    assert n_q == 6 * model.config.n_layer, f"expected every Linear of the blocks replaced, got {n_q} QuantLinears"
    loss = gpt.evaluate_loss(q, val_ids, 16)
    assert abs(loss - base) <= GPT_MARGIN, (f"tiny GPT val loss with W8A8 per-channel: {loss:.4f}, fp32: {base:.4f}; "
                                            f"expected within {GPT_MARGIN} (a wrong scale axis or a missing zero-point "
                                            "correction is far outside it)")


def np_w8a8(x, w):
    k = x.shape[1]
    qx = np_quantize(x, 8, True, (1, k))
    qw = np_quantize(w, 8, True, (k, 1))
    return (np_gemm(qx.q, qw.q).astype(np.float64) * qx.scale * qw.scale).astype(np.float32)


# ---------------------------------------------------------------- 10.10 LLM.int8


def outlier_data(seed, t=48, k=64, n=24, n_out=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)).astype(np.float32)
    cols = rng.choice(k, n_out, replace=False)
    x[:, cols] *= np.float32(40)
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    return x, w, np.sort(cols)


@pytest.mark.exercise("10.10")
def test_llm_int8_threshold_extremes(lesson):
    x, w, _ = outlier_data(13)
    calls = []

    def int8_path(a, b):
        calls.append(a.shape)
        return np_w8a8(a, b)

    y, cols = lesson.llm_int8_matmul(x, w, np.inf, int8_matmul=int8_path)
    assert len(cols) == 0 and calls == [x.shape], f"threshold inf: no outliers, one int8 call on all of x; calls {calls}"
    np.testing.assert_array_equal(y, np_w8a8(x, w), err_msg="threshold inf must equal the pure int8 path")
    calls.clear()
    y, cols = lesson.llm_int8_matmul(x, w, 0.0, int8_matmul=int8_path)
    assert calls == [], f"threshold 0: every column is an outlier, the int8 path must not be called (got {calls})"
    np.testing.assert_array_equal(np.asarray(cols), np.arange(x.shape[1]))
    np.testing.assert_allclose(y, x @ w, rtol=1e-6, atol=1e-6, err_msg="threshold 0 must equal the float product")


@pytest.mark.exercise("10.10")
def test_llm_int8_outlier_rule(lesson):
    """A column is an outlier if ANY of its |x| reaches the threshold: one spiking token is enough, a
    negative spike counts, and exactly the threshold counts; a column of values just below it does not."""
    rng = np.random.default_rng(22)
    x = rng.uniform(-1, 1, (9, 12)).astype(np.float32)
    x[4, 3] = 7.0     # one token
    x[0, 5] = -6.0    # negative, exactly the threshold
    x[:, 8] = 5.99    # every token, just below
    w = rng.standard_normal((12, 4)).astype(np.float32)
    _, cols = lesson.llm_int8_matmul(x, w, 6.0, int8_matmul=np_w8a8)
    np.testing.assert_array_equal(np.asarray(cols), [3, 5], err_msg="outlier columns: max_t |x[t, k]| >= threshold")


@pytest.mark.exercise("10.10")
def test_llm_int8_decomposition(lesson):
    x, w, planted = outlier_data(14)
    seen = []

    def int8_path(a, b):
        seen.append((a.copy(), b.copy()))
        return np_w8a8(a, b)

    y, cols = lesson.llm_int8_matmul(x, w, 6.0, int8_matmul=int8_path)
    np.testing.assert_array_equal(np.asarray(cols), planted, err_msg="the outlier columns are those with max |x| >= 6")
    keep = np.setdiff1d(np.arange(x.shape[1]), planted)
    (a, b), = seen
    np.testing.assert_array_equal(a, x[:, keep], err_msg="the int8 path gets the non-outlier columns of x")
    np.testing.assert_array_equal(b, w[keep], err_msg="... and the matching rows of w")
    want = x[:, planted] @ w[planted] + np_w8a8(x[:, keep], w[keep])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    ref = x.astype(np.float64) @ w
    e_mixed = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    e_int8 = np.linalg.norm(np_w8a8(x, w) - ref) / np.linalg.norm(ref)
    assert e_mixed < e_int8 / 3, f"mixed decomposition error {e_mixed:.4f} should be far below pure int8 {e_int8:.4f}"


@pytest.mark.exercise("10.10")
def test_w8a8_matmul_names_the_shape_mismatch(lesson):
    """(3, 4) @ (5, 2) used to be reported as a block-size problem of the weight's quantization."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)
    y, cols = lesson.llm_int8_matmul(x, w, threshold=0.0, int8_matmul=lambda a, b: pytest.fail("no column is left"))
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5, err_msg="threshold 0: the float product")
    with pytest.raises(ValueError, match=r"w8a8_matmul: shape mismatch \(3, 4\) @ \(5, 2\)"):
        lesson.w8a8_matmul(np.ones((3, 4), np.float32), np.ones((5, 2), np.float32))


# ---------------------------------------------------------------- 10.11 SmoothQuant


@pytest.mark.exercise("10.11")
def test_smoothquant_scales_formula(lesson):
    rng = np.random.default_rng(15)
    x = rng.standard_normal((30, 12)) * rng.uniform(0.1, 50, 12)
    w = rng.standard_normal((12, 9))
    xa = np.abs(x).max(axis=0)
    for alpha in (0.5, 0.75):
        s = np.asarray(lesson.smoothquant_scales(xa, w, alpha))
        want = xa ** alpha / np.abs(w).max(axis=1) ** (1 - alpha)
        assert s.shape == (12,)
        np.testing.assert_allclose(s, want, rtol=1e-12, err_msg=f"s = max|X|^a / max|W|^(1-a), alpha={alpha}")
    xa0 = xa.copy()
    xa0[3] = 0
    w0 = w.copy()
    w0[5] = 0
    s = np.asarray(lesson.smoothquant_scales(xa0, w0))
    assert np.all(np.isfinite(s)) and s[3] == 1 and s[5] == 1, f"dead channels get s = 1, got {s[[3, 5]]}"


@pytest.mark.exercise("10.11")
def test_smoothquant_keeps_product_and_lowers_error(lesson):
    x, w, _ = outlier_data(16, t=64, k=96, n=40, n_out=4)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    s = np.asarray(lesson.smoothquant_scales(np.abs(x64).max(axis=0), w64, 0.5))
    xs, ws = lesson.smooth(x64, w64, s)
    np.testing.assert_allclose(xs @ ws, x64 @ w64, rtol=0, atol=1e-12 * np.abs(x64 @ w64).max(),
                               err_msg="smoothing must leave the float64 product unchanged")
    ref = x64 @ w64
    e_plain = np.linalg.norm(np_w8a8(x, w) - ref) / np.linalg.norm(ref)
    e_smooth = np.linalg.norm(np_w8a8(xs.astype(np.float32), ws.astype(np.float32)) - ref) / np.linalg.norm(ref)
    assert e_smooth < e_plain / 2, f"W8A8 error after SmoothQuant {e_smooth:.4f} should be well below {e_plain:.4f}"


# ---------------------------------------------------------------- 10.12 AWQ


def np_w4(w, g=16):
    return np_quantize(w, 4, False, (g, 1)).dequantize()


def brute_awq(x, w, n_grid, qw):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    m = np.abs(x64).mean(axis=0)
    ref = x64 @ w64
    out = []
    for i in range(n_grid):
        a = i / n_grid
        s = np.maximum(m, 1e-4) ** a
        s = s / np.sqrt(s.max() * s.min())
        cand = qw((w64 * s[:, None]).astype(np.float32)).astype(np.float64) / s[:, None]
        out.append((float(np.mean((x64 @ cand - ref) ** 2)), a, s))
    return out


@pytest.mark.exercise("10.12")
def test_awq_search_matches_brute_force(lesson):
    rng = np.random.default_rng(17)
    t, k, n = 64, 48, 20
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, rng.choice(k, 3, replace=False)] *= 15
    w = rng.standard_normal((k, n)).astype(np.float32)
    s, alpha, errors = lesson.awq_search(x, w, n_grid=10, quantize_w=np_w4)
    cands = brute_awq(x, w, 10, np_w4)
    np.testing.assert_allclose(errors, [c[0] for c in cands], rtol=1e-9, err_msg="the error for each alpha on the grid")
    best = min(range(10), key=lambda i: cands[i][0])
    assert alpha == pytest.approx(cands[best][1]), f"best alpha is {cands[best][1]}, got {alpha}"
    np.testing.assert_allclose(s, cands[best][2], rtol=1e-9, err_msg="the scales of the best alpha")
    assert cands[best][0] < cands[0][0] * 0.9, "sanity: with salient channels, scaling beats plain round-to-nearest"


@pytest.mark.exercise("10.12")
def test_awq_search_dead_channel(lesson):
    rng = np.random.default_rng(18)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    x[:, 4] = 0
    w = rng.standard_normal((32, 8)).astype(np.float32)
    s, alpha, errors = lesson.awq_search(x, w, n_grid=5, quantize_w=np_w4)
    assert np.all(np.isfinite(s)) and np.all(s > 0) and len(errors) == 5, "a zero channel must not give 0/inf scales"


@pytest.mark.exercise("10.12")
def test_awq_search_ties_take_the_first_alpha(lesson):
    """Every channel with the same mean |x|: every alpha gives s = 1 after normalisation, the same error,
    and the search must return the first, alpha = 0."""
    rng = np.random.default_rng(23)
    x = np.where(rng.random((12, 16)) < 0.5, -1.5, 1.5).astype(np.float32)
    w = rng.standard_normal((16, 5)).astype(np.float32)
    s, alpha, errors = lesson.awq_search(x, w, n_grid=4, quantize_w=np_w4)
    assert len(set(errors)) == 1, f"sanity: all alphas give the same error here, got {errors}"
    assert alpha == 0.0 and np.all(s == 1.0), f"on a tie the first alpha (0) wins; got alpha {alpha}, s {s}"


@pytest.mark.exercise("10.12")
def test_awq_search_rejects_an_empty_grid(lesson):
    rng = np.random.default_rng(19)
    x, w = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    s, alpha, errors = lesson.awq_search(x, w, n_grid=1, quantize_w=np_w4)
    assert alpha == 0 and len(errors) == 1 and np.allclose(s, 1.0), f"n_grid=1 tries alpha 0 only, got {alpha}, {errors}"
    with pytest.raises(ValueError, match=r"awq_search: n_grid must be >= 1, got 0"):
        lesson.awq_search(x, w, n_grid=0, quantize_w=np_w4)
