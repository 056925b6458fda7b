"""minitorch.simd (given in lesson 06) and the packed, blocked loops built on it (lesson 06's
gemm_blis, lesson 10's gemm_int8_pairs and gemm_int8_vnni): the given code the lessons' exercises plug into.

The int16-pair multiply-add is compiled three ways (MINITORCH_SIMD=avx512 | avx2 | generic), the
u8 x s8 dot product three ways (MINITORCH_U8S8=avx512vnni | avxvnni | generic: the last two here, the
first by lesson 10's tests where the CPU has it); each is checked for exact results in a child process
of its own, since the choice is made when Numba compiles. The x86
flavours need a CPU that has their instructions, and are skipped elsewhere. Lesson 06's kernel shape
follows the ISA Numba compiles for: checked here on an AVX2 target (NUMBA_CPU_NAME=haswell) too.
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


EXACT_U8S8 = """
import numpy as np
from minitorch.quant import find_int8_madd, gemm_int8_vnni, make_int8_vnni_kernel, shift_to_u8, zero_point_correction
from minitorch.simd import u8s8_flavour


def matmul_int8_vnni(a, b):  # the given one with a 2 x 16 kernel and small blocks: a quick compile, many blocks
    m, k = a.shape
    k4 = -(-k // 4)
    au = np.zeros((m, 4 * k4), np.uint8)
    au[:, :k] = shift_to_u8(a)
    c = np.empty((m, b.shape[1]), np.int32)
    c[:] = -zero_point_correction(b)[None, :]
    gemm_int8_vnni(au.view(np.int32), b, c, make_int8_vnni_kernel(2, 1), 2, 16, 4, 64, 32)
    return c


rng = np.random.default_rng(0)
for (m, k, n) in [(1, 1, 1), (7, 3, 5), (37, 1031, 53), (130, 17, 7), (13, 300, 40)]:
    a = rng.integers(-128, 128, (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    assert np.array_equal(matmul_int8_vnni(a, b), a.astype(np.int64) @ b.astype(np.int64)), (m, k, n)
for x, y in ((-128, -128), (127, -128)):
    a = np.full((7, 4001), x, np.int8)
    b = np.full((4001, 20), y, np.int8)
    assert np.array_equal(matmul_int8_vnni(a, b), a.astype(np.int64) @ b.astype(np.int64)), (x, y)
print(u8s8_flavour(), find_int8_madd(gemm_int8_vnni.inspect_asm(gemm_int8_vnni.signatures[0])))
"""


@pytest.mark.parametrize("flavour", ["avxvnni", "generic"])
def test_u8s8_gemm_is_exact_in_every_flavour(flavour):
    """The flavours this CPU does not pick by itself (lesson 10's tests grade the one it picks, in-process)."""
    feats = host_features()
    if flavour == "avxvnni" and "avxvnni" not in feats and not {"avx512vnni", "avx512vl"} <= feats:
        pytest.skip("this CPU has no AVX-VNNI (nor AVX-512 VNNI with VL, which runs the same 256-bit instruction)")
    env = {**os.environ, "MINITORCH_U8S8": flavour, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", EXACT_U8S8], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(flavour), out.stdout
    if flavour != "generic":  # the x86 flavours are the instruction itself, 512 or 256 bits wide
        assert "vpdpbusd" in out.stdout, out.stdout


def test_a_wrong_u8s8_flavour_name_is_refused():
    env = {**os.environ, "MINITORCH_U8S8": "vnni", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", "from minitorch.simd import u8s8_flavour; u8s8_flavour()"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode != 0 and "MINITORCH_U8S8 must be avx512vnni, avxvnni or generic, got 'vnni'" in out.stderr


AVX2_FEATURES = "+avx2,+fma,+avx,+sse4.2,+sse4.1,+ssse3,+sse3,+sse2,+sse,+cx16,+popcnt,+f16c,+bmi,+bmi2,+lzcnt,+movbe"
ON_AVX2 = r"""
import re
import numpy as np
from minitorch.simd import vector_target
from minitorch.simd_matmul import machine_shape, make_blis_kernel, matmul_blis
assert vector_target()["isa"] == "avx2", vector_target()
assert machine_shape() == (6, 1), machine_shape()
rng = np.random.default_rng(0)
a = rng.standard_normal((37, 301)).astype(np.float32)
b = rng.standard_normal((301, 53)).astype(np.float32)
assert np.allclose(matmul_blis(a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
k = make_blis_kernel(6, 1)
args = (np.zeros(6 * 8, np.float32), np.zeros(16 * 8, np.float32), np.zeros(96, np.float32), 0, 16)
k(*args)
asm = k.inspect_asm(k.signatures[0])
assert "zmm" not in asm and re.search(r"vfmadd\d+ps.*ymm", asm), "expected ymm FMAs only"
print("ok")
"""


def test_the_kernel_shape_follows_an_avx2_target():
    """Numba compiling for Haswell (AVX2, 16 ymm): vector_target says so, the rule picks 6 x 16, matmul_blis is
    right with it and the kernel is ymm FMAs (test_simd_predicates reads the AVX2 kernel's registers)."""
    if "avx2" not in host_features() or "fma" not in host_features():
        pytest.skip("this CPU cannot run AVX2 code")
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": AVX2_FEATURES, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", ON_AVX2], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


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
    from minitorch.quant import pack_a_pairs, pack_a_words, pack_b_pairs, pack_b_words
    from minitorch.simd_matmul import pack_a_block, pack_b_block

    rng = np.random.default_rng(5)
    a = rng.standard_normal((14, 9)).astype(np.float32)
    ap = np.full(12 * 5, np.nan, np.float32)
    pack_a_block(a, 2, 12, 3, 5, ap, 6)  # rows 2..13, k 3..7: two 6-row panels, k-major
    want = a[2:14, 3:8].reshape(2, 6, 5).transpose(0, 2, 1).reshape(-1)
    assert np.array_equal(ap, want)
    ap = np.full(6 * 4, np.nan, np.float32)
    pack_a_block(a, 10, 4, 0, 4, ap, 6)  # rows 10..13 and two rows of zero padding
    assert np.array_equal(ap.reshape(4, 6)[:, :4], a[10:14, :4].T) and not ap.reshape(4, 6)[:, 4:].any()
    ap = np.full(14 * 3, np.nan, np.float32)
    pack_a_block(a, 0, 14, 2, 3, ap, 14)  # one 14-row panel
    assert np.array_equal(ap, a[:, 2:5].T.reshape(-1))

    b = rng.standard_normal((9, 21)).astype(np.float32)
    bp = np.full(32 * 4, np.nan, np.float32)
    pack_b_block(b, 5, 4, 0, 21, bp, 16)  # rows 5..8 as two 16-column panels, the second padded with zeros
    padded = np.zeros((4, 32), np.float32)
    padded[:, :21] = b[5:9]
    assert np.array_equal(bp, padded.reshape(4, 2, 16).transpose(1, 0, 2).reshape(-1))
    b = rng.standard_normal((9, 53)).astype(np.float32)
    bp = np.full(64 * 2, np.nan, np.float32)
    pack_b_block(b, 0, 2, 32, 21, bp, 32)  # columns 32..52 of 53: one 32-column panel, 11 columns of zeros
    padded = np.zeros((2, 32), np.float32)
    padded[:, :21] = b[0:2, 32:53]
    assert np.array_equal(bp[:64], padded.reshape(-1))

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

    au = rng.integers(0, 256, (9, 12)).astype(np.uint8)  # A + 128, K = 12: three words of four k
    aw = au.view(np.int32)
    ap = np.full(14 * 2, -1, np.int32)
    pack_a_words(aw, 0, 9, 1, 2, ap, 14)  # words 1..2 of rows 0..8 in one 14-row panel, rows 9..13 zero
    want = np.zeros((2, 14), np.int32)
    want[:, :9] = aw[:, 1:3].T
    assert np.array_equal(ap, want.reshape(-1))
    b8 = rng.integers(-128, 128, (10, 21)).astype(np.int8)  # K = 10: words of k 0..3, 4..7, 8..9 (+ two zeros)
    bp = np.full(3 * 32, -1, np.int32)
    pack_b_words(b8, 0, 3, 0, 21, bp, 32)
    quads = np.zeros((12, 32), np.int8)
    quads[:10, :21] = b8
    assert np.array_equal(bp.view(np.int8).reshape(3, 32, 4), quads.reshape(3, 4, 32).transpose(0, 2, 1))


def test_blocking_follows_the_caches():
    from minitorch.quant import gemm_int8_pairs, pairs_blocking
    from minitorch.simd_matmul import blis_blocking, block_rows

    for l1, l2 in ((32 * 1024, 512 * 1024), (48 * 1024, 2 * 1024**2), (128 * 1024, 4 * 1024**2), (4096, 65536)):
        for mr, nr in ((14, 32), (6, 16)):
            mc, kc, nc = blis_blocking(l1, l2, mr, nr)
            assert kc % 16 == 0 and 16 <= kc <= 1024 and mc % mr == 0 and nc % nr == 0, (l1, l2, mr, mc, kc, nc)
            assert mr * kc * 4 <= l1 // 2 or kc == 16, (l1, mr, kc)  # the A micro-panel in half of L1 ...
            assert kc == 1024 or mr * (kc + 16) * 4 > l1 // 2, (l1, mr, kc)  # ... the longest that fits
            assert kc * nc * 4 <= l2 // 2 or nc == nr, (l2, kc, nc)  # the B block in half of L2 ...
            assert kc * (nc + nr) * 4 > l2 // 2, (l2, kc, nc)  # ... the widest that fits
            assert mc * kc * 4 <= l2 or mc == mr, (l2, mc, kc)
    assert blis_blocking(48 * 1024, 2 * 1024**2, 14, 32) == (1204, 432, 576)
    assert blis_blocking(32 * 1024, 512 * 1024, 6, 16) == (192, 672, 96)
    for m, threads, mc_max, want in ((1024, 2, 1204, 518), (256, 2, 1204, 140), (2048, 2, 1204, 1036),
                                      (5000, 2, 1204, 840), (13, 4, 1204, 14), (1, 1, 14, 14)):
        got = block_rows(m, 14, mc_max, threads)
        assert got == want, (m, threads, mc_max, got, want)
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="blis_blocking"):
            blis_blocking(bad, 1024**2, 14, 32)
    assert pairs_blocking(1024**2) == (48, 1024) and pairs_blocking(64 * 1024, mc=12) == (12, 256)
    from minitorch.simd_matmul import gemm_blis, make_blis_kernel

    a, b = np.ones((10, 7), np.float32), np.ones((7, 20), np.float32)
    kernel = make_blis_kernel(2, 1)
    for args in ((np.zeros((10, 20), np.float32), 2, 16, 3, 8, 16), (np.zeros((10, 20), np.float32), 2, 16, 4, 0, 16),
                 (np.zeros((10, 20), np.float32), 2, 24, 4, 8, 24), (np.zeros((10, 20), np.float32), 2, 16, 4, 8, 20),
                 (np.zeros((12, 20), np.float32), 2, 16, 4, 8, 16)):
        with pytest.raises(ValueError, match="gemm_blis"):
            gemm_blis(a, b, args[0], kernel, *args[1:])
    with pytest.raises(ValueError, match="gemm_int8_pairs: mc must be a positive multiple of 6"):
        gemm_int8_pairs(a.astype(np.int8), b.astype(np.int8), np.zeros((12, 32), np.int32), 10, 8)


def test_gemm_blis_and_the_int8_gemms_are_parfors():
    from minitorch.quant import gemm_int8_pairs, gemm_int8_vnni, make_int8_vnni_kernel
    from minitorch.simd_matmul import gemm_blis, make_blis_kernel

    cases = ((gemm_blis, (np.ones((60, 8), np.float32), np.ones((8, 16), np.float32), np.zeros((60, 16), np.float32),
                          make_blis_kernel(2, 1), 2, 16, 12, 8, 16)),
             (gemm_int8_pairs, (np.ones((60, 8), np.int8), np.ones((8, 16), np.int8), np.zeros((60, 16), np.int32), 12, 8)),
             (gemm_int8_vnni, (np.full((60, 2), 0x01010101, np.int32), np.ones((8, 16), np.int8),
                               np.zeros((60, 16), np.int32), make_int8_vnni_kernel(2, 1), 2, 16, 12, 1, 16)))
    for fn, args in cases:
        assert fn.targetoptions.get("parallel"), f"{fn.__name__} must be compiled with parallel=True"
        fn(*args)
        diag = fn.overloads[fn.signatures[-1]].metadata.get("parfor_diagnostics")
        assert diag is not None and diag.count_parfors() >= 1, f"{fn.__name__} has no parallel loop"
        assert np.array_equal(args[2], np.full_like(args[2], 8)), f"{fn.__name__} computed a wrong product"
