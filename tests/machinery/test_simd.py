"""minitorch.simd (given in lesson 06) and the packed, blocked loops built on it (lesson 06's
gemm_blis, lesson 10's gemm_int8_pairs): the given code the lessons' exercises plug into.

The int8 multiply-add is compiled three ways (MINITORCH_SIMD=avx512 | avx2 | generic); each is
checked for exact results in a child process of its own, since the choice is made when Numba
compiles. The x86 flavours need a CPU that has their instructions, and are skipped elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


def host_features() -> set[str]:
    import llvmlite.binding as llvm

    return {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+")}


EXACT_INT8 = """
import numpy as np
from minitorch.quant import find_int8_madd, gemm_int8_pairs, matmul_int8_pairs
from minitorch.simd import madd_flavour
rng = np.random.default_rng(0)
for (m, k, n) in [(1, 1, 1), (7, 3, 5), (37, 1031, 53), (130, 17, 7), (13, 300, 40)]:
    a = rng.integers(-128, 128, (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    assert np.array_equal(matmul_int8_pairs(a, b), a.astype(np.int64) @ b.astype(np.int64)), (m, k, n)
a = np.full((7, 4001), -128, np.int8)
assert np.array_equal(matmul_int8_pairs(a, a.T), a.astype(np.int64) @ a.T.astype(np.int64))
a = np.full((7, 4001), 127, np.int8)
assert np.array_equal(matmul_int8_pairs(a, -a.T - 1), a.astype(np.int64) @ (-a.T.astype(np.int64) - 1))
c = np.zeros((12, 48), np.int32)
x = rng.integers(-128, 128, (11, 333)).astype(np.int8)
y = rng.integers(-128, 128, (333, 45)).astype(np.int8)
gemm_int8_pairs(x, y, c, 6, 16)  # several k blocks and row blocks, the last ones short
assert np.array_equal(c[:11, :45], x.astype(np.int64) @ y.astype(np.int64)) and not c[11:].any() and not c[:, 45:].any()
print(madd_flavour(), find_int8_madd(gemm_int8_pairs.inspect_asm(gemm_int8_pairs.signatures[0])))
"""


@pytest.mark.parametrize("flavour", ["avx512", "avx2", "generic"])
def test_int8_pairs_gemm_is_exact_in_every_flavour(flavour):
    need = {"avx512": "avx512bw", "avx2": "avx2"}.get(flavour)
    if need and need not in host_features():
        pytest.skip(f"this CPU has no {need}, so the {flavour} flavour cannot run here")
    env = {**os.environ, "MINITORCH_SIMD": flavour, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", EXACT_INT8], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(flavour), out.stdout
    if flavour != "generic":  # the x86 flavours are the instruction itself
        assert "vpmaddwd" in out.stdout or "vpdpwssd" in out.stdout, out.stdout


def test_a_wrong_flavour_name_is_refused():
    env = {**os.environ, "MINITORCH_SIMD": "sse", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", "from minitorch.simd import madd_flavour; madd_flavour()"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode != 0 and "MINITORCH_SIMD must be avx512, avx2 or generic, got 'sse'" in out.stderr


def test_vector_indices_are_checked():
    from minitorch.simd import (VALUES_IN_ERRORS, vload_f32, vmadd_pairs, vstore_add_f32, vstore_add_i32, vzero_f32,
                                vzero_i32)

    @njit
    def load_sum(x, i):
        y = np.zeros(16, np.float32)
        vstore_add_f32(vload_f32(x, i), y, 0)
        return y

    x = np.arange(20, dtype=np.float32)
    assert np.array_equal(load_sum(x, 4), x[4:20])
    for bad in (5, -1, 100):
        with pytest.raises(IndexError, match="vload_f32: vector lanes outside the array") as err:
            load_sum(x, bad)
        if VALUES_IN_ERRORS:
            assert err.value.args[1:] == (bad, 16, 20), err.value.args

    @njit
    def madd(p, i):
        return vmadd_pairs(vzero_i32(), np.int32(1), p, i)

    with pytest.raises(IndexError, match="vmadd_pairs: vector lanes outside the array") as err:
        madd(np.zeros(32, np.int16), 2)
    if VALUES_IN_ERRORS:
        assert err.value.args[1:] == (2, 32, 32), err.value.args

    @njit
    def stores(y32, yi, i):
        vstore_add_f32(vzero_f32(), y32, i)
        vstore_add_i32(vzero_i32(), yi, i)

    stores(np.zeros(16, np.float32), np.zeros(16, np.int32), 0)
    with pytest.raises(IndexError, match="vstore_add_f32: vector lanes outside the array"):
        stores(np.zeros(17, np.float32), np.zeros(17, np.int32), 2)
    with pytest.raises(IndexError, match="vstore_add_i32: vector lanes outside the array"):
        stores(np.zeros(18, np.float32), np.zeros(17, np.int32), 2)

    @njit
    def madd16(p):  # a narrower word is sign-extended: (-1, -1) as int16 pairs is the int32 -1
        return vmadd_pairs(vzero_i32(), np.int16(-1), p, 0)

    y = np.zeros(16, np.int32)

    @njit
    def keep(p, y):
        vstore_add_i32(madd16(p), y, 0)

    keep(np.ones(32, np.int16), y)
    assert np.array_equal(y, np.full(16, -2, np.int32))


def test_vector_operands_have_their_dtype():
    from minitorch.simd import vload_f32, vmadd_pairs, vzero_i32

    @njit
    def load64(x):
        return vload_f32(x, 0)

    with pytest.raises(TypingError, match="vload_f32: needs a 1-D C-contiguous float32 array"):
        load64(np.zeros(16))

    @njit
    def madd32(p):
        return vmadd_pairs(vzero_i32(), np.int32(1), p, 0)

    with pytest.raises(TypingError, match="vmadd_pairs: needs a 1-D C-contiguous int16 array"):
        madd32(np.zeros(32, np.int32))


def test_packed_panels_have_the_kernels_layout():
    from minitorch.quant import pack_a_pairs, pack_b_pairs
    from minitorch.simd_matmul import pack_a_block, pack_b_block

    rng = np.random.default_rng(5)
    a = rng.standard_normal((14, 9)).astype(np.float32)
    ap = np.full(12 * 5, np.nan, np.float32)
    pack_a_block(a, 2, 12, 3, 5, ap)  # rows 2..13, k 3..7: two 6-row panels, k-major
    want = a[2:14, 3:8].reshape(2, 6, 5).transpose(0, 2, 1).reshape(-1)
    assert np.array_equal(ap, want)
    ap = np.full(6 * 4, np.nan, np.float32)
    pack_a_block(a, 10, 4, 0, 4, ap)  # rows 10..13 and two rows of zero padding
    assert np.array_equal(ap.reshape(4, 6)[:, :4], a[10:14, :4].T) and not ap.reshape(4, 6)[:, 4:].any()

    b = rng.standard_normal((9, 21)).astype(np.float32)
    bp = np.full(32 * 4, np.nan, np.float32)
    pack_b_block(b, 5, 4, bp)  # rows 5..8 as two 16-column panels, the second padded with zeros
    padded = np.zeros((4, 32), np.float32)
    padded[:, :21] = b[5:9]
    assert np.array_equal(bp, padded.reshape(4, 2, 16).transpose(1, 0, 2).reshape(-1))

    a8 = rng.integers(-128, 128, (7, 5)).astype(np.int8)
    ap = np.zeros(12 * 3, np.int32)
    pack_a_pairs(a8, 0, 7, 0, 3, ap)  # K = 5: three pairs, the last one (a[:, 4], 0)
    wide = np.zeros((12, 6), np.int16)
    wide[:7, :5] = a8
    words = wide.view(np.int32)  # little-endian: the even k in the low half
    assert np.array_equal(ap, words.reshape(2, 6, 3).transpose(0, 2, 1).reshape(-1))

    b8 = rng.integers(-128, 128, (5, 20)).astype(np.int8)
    bp = np.zeros(2 * 3 * 32, np.int16)
    pack_b_pairs(b8, 0, 3, bp)
    wide = np.zeros((6, 32), np.int16)
    wide[:5, :20] = b8
    pairs = wide.reshape(3, 2, 2, 16).transpose(2, 0, 3, 1)  # (panel, k2, column, t)
    assert np.array_equal(bp, pairs.reshape(-1))


def test_blocking_follows_the_l2_cache():
    from minitorch.simd_matmul import blis_blocking

    for l2 in (256 * 1024, 512 * 1024, 1024**2, 2 * 1024**2, 32 * 1024):
        mc, kc = blis_blocking(l2)
        assert mc % 6 == 0 and kc & (kc - 1) == 0 and 64 <= kc <= 1024
        assert (mc + 16) * kc * 4 <= l2 // 2 or kc == 64, (l2, mc, kc)
        assert kc == 1024 or (mc + 16) * 2 * kc * 4 > l2 // 2, (l2, mc, kc)  # the longest that fits
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="blis_blocking"):
            blis_blocking(bad)
    from minitorch.quant import gemm_int8_pairs
    from minitorch.simd_matmul import gemm_blis

    a, b = np.ones((10, 7), np.float32), np.ones((7, 20), np.float32)
    for mc, kc, c in ((10, 8, np.zeros((12, 32), np.float32)), (12, 0, np.zeros((12, 32), np.float32)),
                      (12, 8, np.zeros((6, 32), np.float32)), (12, 8, np.zeros((12, 20), np.float32))):
        with pytest.raises(ValueError, match="gemm_blis"):
            gemm_blis(a, b, c, mc, kc)
    with pytest.raises(ValueError, match="gemm_int8_pairs: mc must be a positive multiple of 6"):
        gemm_int8_pairs(a.astype(np.int8), b.astype(np.int8), np.zeros((12, 32), np.int32), 10, 8)
    with pytest.raises(ValueError, match="mc a positive multiple of 6"):
        blis_blocking(1024**2, mc=10)


def test_gemm_blis_and_gemm_int8_pairs_are_parfors():
    from minitorch.quant import gemm_int8_pairs
    from minitorch.simd_matmul import gemm_blis

    for fn, args in ((gemm_blis, (np.ones((60, 8), np.float32), np.ones((8, 16), np.float32),
                                  np.zeros((60, 16), np.float32), 12, 8)),
                     (gemm_int8_pairs, (np.ones((60, 8), np.int8), np.ones((8, 16), np.int8),
                                        np.zeros((60, 16), np.int32), 12, 8))):
        assert fn.targetoptions.get("parallel"), f"{fn.__name__} must be compiled with parallel=True"
        fn(*args)
        diag = fn.overloads[fn.signatures[-1]].metadata.get("parfor_diagnostics")
        assert diag is not None and diag.count_parfors() >= 1, f"{fn.__name__} has no parallel loop"
        assert np.array_equal(args[2], np.full_like(args[2], 8)), f"{fn.__name__} computed a wrong product"
