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
