"""The SIMD checks of lessons 06 and 10 know both ISAs: on x86-64 packed FMA on ymm/zmm and
vpmaddwd/VNNI, on aarch64 `fmla v.4s`/`fmla z.s` and smull/smlal/sdot. Tested on real aarch64
assembly of the reference kernels: Numba's LLVM IR compiled by llvmlite for aarch64 (NEON), so it
runs on an x86 machine too; on an aarch64 machine the lesson tests read the native code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cross_asm import cross_asm  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]


def load_test_module(name: str):
    spec = importlib.util.spec_from_file_location(f"mt_pred_{name}", TESTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def t06():
    return load_test_module("test_06_simd_threads")


@pytest.fixture(scope="module")
def t10():
    return load_test_module("test_10_quantization")


def host_is_x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64")


def test_lesson06_fma_predicates_on_aarch64_code_of_the_kernels(t06):
    from minitorch.simd_matmul import dot_kernel, find_packed_fma, micro_kernel

    x = np.arange(64, dtype=np.float32)
    a, bt, c = np.zeros((8, 40), np.float32), np.zeros((6, 40), np.float32), np.zeros((8, 6), np.float32)
    for fn, args, least in ((dot_kernel, (x, x), 1), (micro_kernel, (a, bt, c, 0, 0, 0, 1), 12)):
        arm = cross_asm(fn, args, "aarch64")
        fmas = [ln.strip() for ln in arm.splitlines() if t06.FMA_PS["aarch64"].search(ln)]
        assert len(fmas) >= least and all(ln.startswith("fml") and ".4s" in ln for ln in fmas), fmas
        assert find_packed_fma(arm, "aarch64") == fmas  # the lesson's own predicate agrees
        assert not t06.FMA_PS["x86_64"].search(arm) and find_packed_fma(arm, "x86_64") == []
        if fn is micro_kernel:  # 12 accumulators in one loop, as on x86
            assert len(t06.packed_fma_dests(fmas)) >= 8
    if host_is_x86():  # the x86 predicates as before, on this machine's code of the same kernel
        native = cross_asm(dot_kernel, (x, x), "x86_64")
        assert t06.FMA_PS["x86_64"].search(native) and not t06.FMA_PS["aarch64"].search(native)


def test_lesson10_widening_madd_predicates_on_aarch64_code_of_int8_dot(t10):
    from minitorch.quant import int8_dot

    x = np.zeros(64, np.int8)
    arm = cross_asm(int8_dot, (x, x), "aarch64")
    pattern, names = t10.widening_madds("aarch64")
    found = sorted({m.group(1) for m in pattern.finditer(arm)})
    assert found and set(found) <= {"sdot", "smlal", "smlal2", "smull", "smull2", "sadalp"}, found
    x86_pattern, _ = t10.widening_madds("x86_64", {"+avx2"})
    assert not x86_pattern.search(arm)
    if host_is_x86():
        native = cross_asm(int8_dot, (x, x), "x86_64")
        assert x86_pattern.search(native) and not pattern.search(native)


def kernel_args(mr, nv):
    nr = 16 * nv
    return (np.zeros(mr * 16, np.float32), np.zeros(nr * 16, np.float32), np.zeros(mr * nr, np.float32), 0, nr)


@pytest.mark.parametrize("target, fits, spills", [("aarch64", (6, 1), (7, 1)), ("x86_64", (6, 1), (7, 1))])
def test_lesson06_shape_rule_matches_the_compiler_on_neon_and_avx2(t06, target, fits, spills):
    """The register counts lesson 06's rule uses (vector_target's, exercise 6.7's) against LLVM itself, on
    NEON (32 q, four per f32x16) and AVX2 (16 ymm, two per f32x16; cross_asm's x86 target is Skylake without
    AVX-512): the rule's shape compiles to its accumulators with nothing spilled, one row more spills."""
    from minitorch.simd_matmul import blis_shape, make_blis_kernel

    registers, per_vector, broadcast = {"aarch64": (32, 4, 2), "x86_64": (16, 2, 1)}[target]
    assert blis_shape(registers, per_vector, broadcast, 8) == fits
    for shape, ok in ((fits, True), (spills, False)):
        asm = cross_asm(make_blis_kernel(*shape), kernel_args(*shape), target)
        if target == "x86_64":
            assert "zmm" not in asm, "cross_asm's x86 target must be AVX2 only"
        problems = t06.kernel_loop_problems(asm, *shape, target)
        if ok:
            assert problems == [], f"{shape} on {target}: {problems}"
        else:
            assert any("spilled" in p or "accumulates into" in p or "stores vectors" in p for p in problems), (
                f"{shape} on {target} should not fit the registers: {problems}")


def test_lesson06_shape_rule_matches_the_compiler_on_avx512(t06):
    """On an AVX-512 machine (native code): 14 x 32 fits the 32 zmm registers, 15 x 32 spills."""
    from minitorch.simd import vector_target
    from minitorch.simd_matmul import make_blis_kernel

    if vector_target()["isa"] != "avx512":
        pytest.skip(f"Numba compiles for {vector_target()['isa']} here, not AVX-512")
    for shape, ok in (((14, 2), True), ((15, 2), False)):
        kernel = make_blis_kernel(*shape)
        kernel(*kernel_args(*shape))
        asm = kernel.inspect_asm(kernel.signatures[0])
        problems = t06.kernel_loop_problems(asm, *shape, "x86_64")
        assert (problems == []) == ok, f"{shape}: {problems}"
