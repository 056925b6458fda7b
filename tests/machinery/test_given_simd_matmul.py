"""Lesson 06's given code that no exercise test calls (minitorch.simd_matmul): reading the machine code,
the dot and matmul wrappers, packing, the BLIS blocking and the timing helpers. Small inputs, each
checked against what the function promises (and each call feeds the validation walk)."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from minitorch import simd_matmul as sm


def test_asm_of_compiles_and_returns_the_listing():
    x = np.ones(8, np.float32)
    asm = sm.asm_of(sm.dot_kernel, x, x)
    assert isinstance(asm, str) and asm.count("\n") > 10, "asm_of must return the assembly listing"
    assert (numba.typeof(x), numba.typeof(x)) in sm.dot_kernel.signatures
    with pytest.raises(TypeError, match=r"asm_of: fn must be a Numba-compiled function.*len"):
        sm.asm_of(len, x)


def test_dot_promotes_and_checks():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(37).astype(np.float32), rng.standard_normal(37)
    got = sm.dot(x, y)
    assert got == pytest.approx(float(x.astype(np.float64) @ y), rel=1e-12), "float32 . float64 is float64"
    with pytest.raises(ValueError, match=r"dot: x and y .*\(37,\).*\(5,\)"):
        sm.dot(x, y[:5])
    with pytest.raises(TypeError, match="dot: x and y must be float32 or float64.*int64"):
        sm.dot(np.arange(3), np.arange(3))


def test_pack_operands_pads_to_the_block():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((7, 4)).astype(np.float32)
    ap, bt = sm.pack_operands(a, b)
    assert ap.shape == (8, 7) and bt.shape == (6, 7), (ap.shape, bt.shape)
    assert ap.flags.c_contiguous and bt.flags.c_contiguous
    np.testing.assert_array_equal(ap[:5], a)
    np.testing.assert_array_equal(bt[:4], b.T)
    assert not ap[5:].any() and not bt[4:].any(), "the padding rows must be zero"
    ap2, bt2 = sm.pack_operands(a, b, mr=5, nr=2)
    assert ap2.shape == (5, 7) and bt2.shape == (4, 7)
    with pytest.raises(ValueError, match="pack_operands: mr must be an integer >= 1, got 0"):
        sm.pack_operands(a, b, mr=0)


def test_matmul_simd_matches_numpy():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((9, 13)), rng.standard_normal((13, 7))  # one compile of the loop nest: ~4 s
    np.testing.assert_allclose(sm.matmul_simd(a, b), a @ b, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="matmul_simd: kernel must be a Numba-compiled function"):
        sm.matmul_simd(a, b, kernel=np.dot)
    with pytest.raises(ValueError, match=r"matmul_simd: shape mismatch: a \(9, 13\) @ b \(7, 13\)"):
        sm.matmul_simd(a, b.T)


def test_blis_blocking_values_and_errors():
    assert sm.blis_blocking(48 * 1024, 2 * 1024**2, 14, 32) == (1204, 432, 576)
    assert sm.blis_blocking(32 * 1024, 256 * 1024, 6, 16, itemsize=8) == (96, 336, 48)
    with pytest.raises(TypeError, match="blis_blocking: l1_bytes must be a positive integer, got '6'"):
        sm.blis_blocking("6", 1024**2, 14, 32)
    with pytest.raises(ValueError, match="blis_blocking: need l2_bytes a positive integer, got l2_bytes=nan"):
        sm.blis_blocking(32768, float("nan"), 14, 32)
    mc, kc, nc = sm.machine_blocking(14, 32)
    assert mc % 14 == 0 and kc % 16 == 0 and nc % 32 == 0
    assert sm.block_rows(1024, 14, 1204, 2) == 518 and sm.block_rows(1, 6, 6, 1) == 6


def test_even_block_makes_the_fewest_even_blocks():
    for total in (1, 15, 16, 17, 160, 1000, 1024, 1025, 2048, 4099):
        for most, multiple in ((432, 1), (16, 16), (576, 32), (512, 32), (14, 14)):
            size = sm.even_block(total, most, multiple)
            parts = -(-total // most)
            assert 1 <= size <= most and size % multiple == 0, (total, most, multiple, size)
            assert -(-total // size) == parts, f"even_block({total}, {most}, {multiple}) = {size}: more blocks than needed"
            assert parts * size - total < parts * multiple, f"even_block({total}, {most}, {multiple}) = {size}: not even"
    assert sm.even_block(1024, 432) == 342 and sm.even_block(1000, 576, 32) == 512
    with pytest.raises(ValueError, match="even_block: need most a multiple of multiple, got most=100, multiple=32"):
        sm.even_block(1000, 100, 32)
    with pytest.raises(ValueError, match="even_block: total must be an integer >= 1, got 0"):
        sm.even_block(0, 16)


def test_blis_plan_once_per_generator_and_sizes(monkeypatch):
    kernel, mr, nr, mc, kc, nc = sm._blis_plan((3, 1), 100, 1000, 70, 2)
    assert (mr, nr) == (3, 16) and kernel is sm.make_blis_kernel(3, 1)
    mc_max, kc_max, nc_max = sm.machine_blocking(3, 16)
    assert (mc, kc, nc) == (sm.block_rows(100, 3, mc_max, 2), sm.even_block(1000, kc_max), sm.even_block(70, nc_max, 16))
    assert sm._blis_plan((3, 1), 100, 1000, 70, 2) is sm._blis_plan((3, 1), 100, 1000, 70, 2), "worked out once"
    calls = []
    original = sm.blis_kernel_source

    def generator(mr, nv):
        calls.append((mr, nv))
        return original(mr, nv)

    monkeypatch.setattr(sm, "blis_kernel_source", generator)  # a redefined generator: a new plan
    sm._blis_plan((3, 1), 100, 1000, 70, 2)
    sm._blis_plan((3, 1), 100, 1000, 70, 2)
    assert calls == [(3, 1)], "a new generator is asked once for its kernel's source"


def test_the_machine_shape_follows_the_vector_registers():
    from minitorch.simd import target_features, u8s8_flavour, vector_target

    t = vector_target()
    assert set(t) == {"isa", "registers", "per_vector", "broadcast_registers"} and t["isa"] in sm.IN_FLIGHT
    assert sm.machine_shape() == sm.blis_shape(t["registers"], t["per_vector"], t["broadcast_registers"],
                                               sm.IN_FLIGHT[t["isa"]])
    assert isinstance(target_features(), set) and u8s8_flavour() in ("avx512vnni", "avxvnni", "generic")
    kernel = sm.make_blis_kernel(2, 1)
    assert sm.make_blis_kernel(2, 1) is kernel, "one compiled kernel per source"
    with pytest.raises(ValueError, match="make_blis_kernel: mr must be an integer >= 1, got 0"):
        sm.make_blis_kernel(0, 1)
    with pytest.raises(TypeError, match=r"matmul_blis: shape must be a pair \(MR, NV\)"):
        sm.matmul_blis(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), shape=(2, 1, 1))


def test_best_apart_times_each_kernel():
    calls = {"a": 0, "b": 0}

    def bump(name):
        calls[name] += 1

    best = sm.best_apart({"a": lambda: bump("a"), "b": lambda: bump("b")}, rounds=2, repeat=2, pause=0.0)
    assert set(best) == {"a", "b"} and all(0 <= t < 1 for t in best.values()), best
    assert calls == {"a": 6, "b": 6}, f"2 rounds of (1 untimed + 2 timed) calls each, got {calls}"
    with pytest.raises(TypeError, match=r"best_apart: kernels must map names to callables, got kernels\['x'\] = 3"):
        sm.best_apart({"x": 3}, pause=0.0)


def test_blis_peak_and_peak_rate_on_one_thread():
    rate = sm.blis_peak(1, shape=(2, 1), kc=16, calls=20)
    assert rate > 0, f"blis_peak must be a positive GFLOP/s, got {rate}"
    assert sm.blis_peak(1, shape=(2, 1), calls=5) > 0  # KC from this machine's L1 (the kernel compiled above)
    kc = 16
    kernel = sm.make_blis_kernel(6, 1)
    ap, bp = np.ones((1, 6 * kc), np.float32), np.ones((1, 16 * kc), np.float32)
    c = np.zeros((1, 6 * 16), np.float32)
    assert sm.peak_rate(kernel, ap, bp, c, 16, 3, 2 * 6 * 16 * kc) > 0
    np.testing.assert_array_equal(c[0], np.full(6 * 16, 6 * 3 * kc, np.float32))  # warm-up + 5 runs, 3 calls each
    with pytest.raises(ValueError, match=r"peak_rate: ap, bp and c must have one row per thread"):
        sm.peak_rate(kernel, ap, np.ones((2, 16 * kc), np.float32), c, 16, 3, 1.0)


def test_gemm_blis_writes_or_adds():
    """accumulate=False (matmul_blis's call, into np.empty) never reads C: a C of NaNs comes out as a @ b;
    accumulate=True adds. Odd sizes: edge blocks on both sides, several blocks of k and of columns."""
    rng = np.random.default_rng(3)
    kernel = sm.make_blis_kernel(3, 2)
    for m, k, n in ((37, 70, 75), (3, 16, 32), (50, 33, 100)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        want = a.astype(np.float64) @ b
        c = np.full((m, n), np.nan, np.float32)
        sm.gemm_blis(a, b, c, kernel, 3, 32, 12, 16, 64, False)
        np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4, err_msg=f"c = a @ b, {(m, k, n)}")
        sm.gemm_blis(a, b, c, kernel, 3, 32, 12, 16, 64)
        np.testing.assert_allclose(c, 2 * want, rtol=1e-4, atol=1e-4, err_msg=f"c += a @ b, {(m, k, n)}")
        sm.gemm_blis(a, b, c, kernel, 3, 32, 12, 16, 64, False, 3)  # B's buffer 12 bytes past a line: same product
        np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4, err_msg=f"c = a @ b, b_offset=3, {(m, k, n)}")
    with pytest.raises(ValueError, match="gemm_blis: need .* and b_offset >= 0"):
        sm.gemm_blis(a, b, c, kernel, 3, 32, 12, 16, 64, False, -1)


def test_aligned_empty_starts_a_cache_line():
    for dtype in (np.float32, np.float64, np.int32, np.int16, np.uint8):
        for size in (0, 1, 15, 16, 17, 1000, 4099):
            x = sm.aligned_empty(size, dtype)
            assert x.shape == (size,) and x.dtype == dtype and x.flags.c_contiguous, (dtype, size, x.shape, x.dtype)
            assert x.ctypes.data % sm.CACHE_LINE == 0, f"aligned_empty({size}, {dtype.__name__}) starts at " \
                                                       f"{x.ctypes.data % sm.CACHE_LINE} bytes into a cache line"


@numba.njit(cache=False)
def _spy_kernel(ap, bp, c, co, ldc):
    """Adds, at its block's first item, 1 plus where bp starts within a cache line."""
    c[co] += 1 + bp.ctypes.data % 64


def test_gemm_blis_hands_the_kernel_b_panels_on_whole_cache_lines():
    """Each f32x16 load of a B panel must not straddle two lines: gemm_blis packs B into a line-aligned
    buffer, and each panel is a whole number of lines. Odd sizes: edge blocks, several blocks of k and N."""
    for m, k, n in ((37, 70, 75), (12, 33, 100), (7, 100, 200), (50, 20, 40), (3, 16, 32)):
        a, b = np.ones((m, k), np.float32), np.ones((k, n), np.float32)
        c = np.zeros((m, n), np.float32)
        sm.gemm_blis(a, b, c, _spy_kernel, 3, 32, 12, 16, 64)
        firsts = c[::3, ::32]  # each kernel block's first item: one visit per block of k, plus where bp started
        k_blocks = -(-k // 16)
        assert np.all(firsts == k_blocks), f"{(m, k, n)}: the B panels start {np.unique(firsts - k_blocks)} " \
                                           f"bytes into a cache line (summed over {k_blocks} blocks of k)"
