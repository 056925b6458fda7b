"""Lesson 06: SIMD and threads. NumPy (float64) is the oracle; shapes are odd and not multiples
of the blocks; structural checks read the machine code Numba generated (packed FMAs, a
register-blocked loop) and the parallel structure (a parfor, more than one thread at work).

The kernel tests build their inputs with NumPy and pass their own micro-kernels, so each
exercise is graded on its own code only.
"""

import platform
import re

import numba
import numpy as np
import pytest
from numba import njit

pytestmark = pytest.mark.lesson06

DTYPES = [np.float32, np.float64]

# Packed float32 FMA on 256/512-bit registers (x86-64) or on NEON/SVE vectors (aarch64).
FMA_PS = {
    "x86_64": re.compile(r"\bvf(?:n?m(?:add|sub))(?:132|213|231)ps\b.*\b[yz]mm\d"),
    "aarch64": re.compile(r"\bfml[as]\b.*\b(?:v\d+\.4s|z\d+\.s)\b"),
}
FMA_PD_X86 = re.compile(r"\bvf(?:n?m(?:add|sub))(?:132|213|231)pd\b.*\b[yz]mm\d")


def machine_isa() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def float32_fma_lines(asm: str) -> list[str]:
    """Packed float32 FMA lines of `asm` on this machine; skips the test on another ISA."""
    arch = machine_isa()
    if arch not in FMA_PS:
        pytest.skip(f"no packed-FMA pattern for this ISA ({arch}); the structural check needs x86-64 or aarch64")
    if arch == "x86_64" and "+fma" not in _host_features().split(","):
        pytest.skip("this x86-64 CPU has no FMA3 unit, so no packed FMA to find")
    return [ln.strip() for ln in asm.splitlines() if FMA_PS[arch].search(ln)]


def _host_features() -> str:
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_features().flatten()


def asm_for(fn, *args) -> str:
    sig = tuple(numba.typeof(x) for x in args)
    if sig not in fn.signatures:
        fn.compile(sig)
    return fn.inspect_asm(sig)


def tol(dtype, k):
    return 4 * max(k, 1) * np.finfo(dtype).eps


def assert_close(got, want64, absprod, dtype, k, what):
    """|got - want| <= 4 k eps |a||b| (elementwise), with want and |a||b| in float64."""
    err = np.abs(np.asarray(got, dtype=np.float64) - want64)
    bound = tol(dtype, k) * absprod + 1e-300
    if not np.all(err <= bound):
        idx = np.unravel_index(np.argmax(err - bound), np.shape(err)) if np.ndim(err) else ()
        raise AssertionError(f"{what}: wrong value at {idx}: got {np.asarray(got)[idx]!r}, "
                             f"expected {np.asarray(want64)[idx]!r}")


# ---------------------------------------------------------------- 6.1 reading the asm

X86_ASM = """
.LBB0_5:
	vmovups	(%rdx,%rsi,4), %ymm4
	vfmadd231ps	%ymm4, %ymm5, %ymm0
	vfmadd213pd	32(%rax,%rbx,8), %ymm1, %ymm2
	vfnmadd231ps	%zmm3, %zmm4, %zmm5 {%k1}
	vfmsub132pd	%ymm1, %ymm2, %ymm3
	vfmadd231ss	%xmm1, %xmm2, %xmm0
	vfmadd231sd	(%rax), %xmm2, %xmm0
	vfmadd231ps	%xmm1, %xmm2, %xmm0
	vmulps	%ymm1, %ymm2, %ymm3
	vaddps	%ymm1, %ymm2, %ymm3
	vfmaddsub231ps	%ymm1, %ymm2, %ymm3
	vfmadd132ps ymm0, ymm1, ymmword ptr [rdi + 4*rax]
	vfnmsub213pd zmm2, zmm3, zmm4
	# vfmadd231ps in a comment, no register
	jne	.LBB0_5
"""
X86_EXPECTED = [
    "vfmadd231ps\t%ymm4, %ymm5, %ymm0",
    "vfmadd213pd\t32(%rax,%rbx,8), %ymm1, %ymm2",
    "vfnmadd231ps\t%zmm3, %zmm4, %zmm5 {%k1}",
    "vfmsub132pd\t%ymm1, %ymm2, %ymm3",
    "vfmadd132ps ymm0, ymm1, ymmword ptr [rdi + 4*rax]",
    "vfnmsub213pd zmm2, zmm3, zmm4",
]

ARM_ASM = """
.LBB0_3:
	ldr	q1, [x8], #16
	fmla	v0.4s, v1.4s, v2.4s
	fmla	v3.2d, v4.2d, v5.d[1]
	fmls	v6.8h, v7.8h, v8.8h
	fmla	z0.s, p0/m, z1.s, z2.s
	fmadd	s0, s1, s2, s3
	fmul	v0.4s, v1.4s, v2.4s
	fadd	v0.4s, v0.4s, v1.4s
	b.ne	.LBB0_3
"""
ARM_EXPECTED = [
    "fmla\tv0.4s, v1.4s, v2.4s",
    "fmla\tv3.2d, v4.2d, v5.d[1]",
    "fmls\tv6.8h, v7.8h, v8.8h",
    "fmla\tz0.s, p0/m, z1.s, z2.s",
]


@pytest.mark.exercise("6.1")
def test_find_packed_fma_x86(lesson):
    got = lesson.find_packed_fma(X86_ASM, "x86_64")
    assert got == X86_EXPECTED, (f"find_packed_fma(x86 listing) should return the packed FMA lines "
                                 f"(stripped, in order):\n{X86_EXPECTED}\ngot:\n{got}")
    assert lesson.find_packed_fma("vfmadd231ss %xmm1, %xmm2, %xmm0\n", "x86_64") == [], \
        "a scalar vfmadd231ss is not a packed FMA"


@pytest.mark.exercise("6.1")
def test_find_packed_fma_aarch64(lesson):
    got = lesson.find_packed_fma(ARM_ASM, "aarch64")
    assert got == ARM_EXPECTED, (f"find_packed_fma(aarch64 listing) should return:\n{ARM_EXPECTED}\n"
                                 f"got:\n{got}")


@pytest.mark.exercise("6.1")
def test_find_packed_fma_default_arch_and_unknown(lesson):
    arch = lesson.isa()
    if arch in ("x86_64", "aarch64"):
        text = X86_ASM if arch == "x86_64" else ARM_ASM
        assert lesson.find_packed_fma(text) == lesson.find_packed_fma(text, arch), \
            f"find_packed_fma(asm) must default to this machine's ISA ({arch})"
    assert lesson.find_packed_fma("", "x86_64") == [], "an empty listing has no FMA"
    with pytest.raises(ValueError, match="riscv64"):
        lesson.find_packed_fma(X86_ASM, "riscv64")


# ---------------------------------------------------------------- 6.2 vectorised dot product


@pytest.mark.exercise("6.2")
@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_kernel_matches_numpy(lesson, dtype):
    rng = np.random.default_rng(2)
    for n in (0, 1, 7, 8, 33, 1000, 4099):
        x = rng.standard_normal(n).astype(dtype)
        y = rng.standard_normal(n).astype(dtype)
        got = lesson.dot_kernel(x, y)
        want = float(x.astype(np.float64) @ y.astype(np.float64))
        absprod = float(np.abs(x.astype(np.float64)) @ np.abs(y.astype(np.float64)))
        assert_close(got, want, absprod, dtype, n, f"dot_kernel on two length-{n} {np.dtype(dtype).name} vectors")


@pytest.mark.exercise("6.2")
def test_dot_kernel_float32_is_vectorised(lesson):
    x = np.arange(64, dtype=np.float32)
    assert lesson.dot_kernel(x, x) == pytest.approx(float(x @ x), rel=1e-6), "dot_kernel(x, x) is wrong"
    asm = asm_for(lesson.dot_kernel, x, x)
    fmas = float32_fma_lines(asm)
    if not fmas and machine_isa() == "x86_64" and FMA_PD_X86.search(asm):
        raise AssertionError("dot_kernel's float32 code does its FMAs in float64 (vfmadd...pd): start the "
                             "accumulator at x.dtype.type(0), not 0.0")
    assert fmas, ("dot_kernel's float32 machine code has no packed FMA (vfmadd...ps on ymm/zmm): the loop "
                  "was not vectorised. Is it a plain loop over a contiguous array, indexed from 0, with "
                  "fastmath=True in the decorator?")


# ---------------------------------------------------------------- 6.3 register-blocked micro-kernel

MR, NR = 4, 3


def run_micro(lesson, dtype, i0, j0, p0, p1, seed=3):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((13, 50)).astype(dtype)
    bt = rng.standard_normal((11, 50)).astype(dtype)
    c0 = rng.standard_normal((13, 11)).astype(dtype)
    c = c0.copy()
    lesson.micro_kernel(a, bt, c, i0, j0, p0, p1)
    a64, b64 = a.astype(np.float64), bt.astype(np.float64)
    want = c0.astype(np.float64)
    blk = (slice(i0, i0 + MR), slice(j0, j0 + NR))
    want[blk] += a64[i0:i0 + MR, p0:p1] @ b64[j0:j0 + NR, p0:p1].T
    absprod = np.abs(c0.astype(np.float64))
    absprod[blk] += np.abs(a64[i0:i0 + MR, p0:p1]) @ np.abs(b64[j0:j0 + NR, p0:p1]).T
    what = f"micro_kernel(a, bt, c, i0={i0}, j0={j0}, p0={p0}, p1={p1}) ({np.dtype(dtype).name})"
    outside = np.ones(c.shape, bool)
    outside[blk] = False
    changed = np.argwhere((c != c0) & outside)
    assert changed.size == 0, f"{what} changed c outside its 4 x 3 block, e.g. at {tuple(changed[0])}"
    assert_close(c, want, absprod, dtype, max(p1 - p0, 1), what)


@pytest.mark.exercise("6.3")
@pytest.mark.parametrize("dtype", DTYPES)
def test_micro_kernel_values(lesson, dtype):
    run_micro(lesson, dtype, 5, 7, 9, 44)    # interior block, a k-range not starting at 0
    run_micro(lesson, dtype, 0, 0, 0, 50)    # corner block, all of k
    run_micro(lesson, dtype, 9, 8, 49, 50)   # last rows and columns, one step of k
    run_micro(lesson, dtype, 4, 3, 20, 20)   # empty k-range: c unchanged


def packed_fma_dests(lines: list[str]) -> set[str]:
    """Destination registers of FMA lines (AT&T: last operand; Intel and Arm: first)."""
    dests = set()
    for ln in lines:
        ops = [o.strip() for o in re.sub(r"\{[^}]*\}", "", ln.split(None, 1)[1]).split(",")]
        dests.add(ops[-1] if ops[-1].startswith("%") else ops[0])
    return dests


@pytest.mark.exercise("6.3")
def test_micro_kernel_is_register_blocked_simd(lesson):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((8, 40)).astype(np.float32)
    bt = rng.standard_normal((6, 40)).astype(np.float32)
    c = np.zeros((8, 6), np.float32)
    lesson.micro_kernel(a, bt, c, 4, 3, 0, 40)
    np.testing.assert_allclose(c[4:8, 3:6], a[4:8] @ bt[3:6].T, rtol=1e-4, atol=1e-4,
                               err_msg="micro_kernel computed a wrong block")
    asm = asm_for(lesson.micro_kernel, a, bt, c, 0, 0, 0, 1)
    fmas = float32_fma_lines(asm)
    if not fmas and machine_isa() == "x86_64" and FMA_PD_X86.search(asm):
        raise AssertionError("micro_kernel's float32 code does its FMAs in float64 (vfmadd...pd): start the "
                             "accumulators at c.dtype.type(0), not 0.0")
    assert fmas, ("micro_kernel's float32 machine code has no packed FMA (vfmadd...ps on ymm/zmm): the p loop "
                  "was not vectorised. Use row views indexed from 0 (a0 = a[i0, p0:p1]; a0[p]) and scalar "
                  "accumulators.")
    # Register blocking: one loop whose packed FMAs accumulate into MR * NR different registers.
    blocks, current = [], []
    for ln in asm.splitlines():
        s = ln.strip()
        if s.endswith(":"):  # a label starts a new basic block (".LBB0_5:" on Linux, "LBB0_5:" on macOS)
            blocks.append(current)
            current = []
        elif s in fmas:
            current.append(s)
    blocks.append(current)
    best = max(len(packed_fma_dests(b)) for b in blocks if b) if any(blocks) else 0
    # 12 when all accumulators stay in registers; allow for a few spills, but a loop with one
    # accumulator (even unrolled by LLVM into 2-4 partial sums) is not register-blocked.
    assert best >= 8, (f"micro_kernel's vector loop accumulates into only {best} registers; a 4 x 3 "
                       f"register block needs 12 independent accumulators (c00 ... c32) updated in the "
                       f"same loop over p")


# ---------------------------------------------------------------- 6.4 threaded loop nest


@njit
def plain_kernel(a, bt, c, i0, j0, p0, p1):
    """The micro-kernel contract with plain loops (the test's own, so 6.4 is graded alone)."""
    for i in range(4):
        for j in range(3):
            acc = c.dtype.type(0)
            for p in range(p0, p1):
                acc += a[i0 + i, p] * bt[j0 + j, p]
            c[i0 + i, j0 + j] += acc


@njit
def spy_kernel(a, bt, c, i0, j0, p0, p1):
    """Records its calls in its own block: row 0 counts them, row 1 sums p1 - p0, row 2 keeps
    the largest p1 - p0, row 3 holds (pool thread id + 1) of the last call."""
    for j in range(3):
        c[i0, j0 + j] += 1
        c[i0 + 1, j0 + j] += p1 - p0
        c[i0 + 2, j0 + j] = max(c[i0 + 2, j0 + j], p1 - p0)
        c[i0 + 3, j0 + j] = numba.get_thread_id() + 1


def gemm_shapes(lesson):
    MC, KC, NC = lesson.MC, lesson.KC, lesson.NC
    return [
        (2 * MC + 3 * MR, KC + 37, NC + 5 * NR),   # several panels/blocks/pieces, all ragged
        (MR, 1, NR),                               # one block
        (MC + MR, 5, 2 * NC),                      # exact multiple of NC
    ]


@pytest.mark.exercise("6.4")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_parallel_matches_numpy(lesson, dtype):
    rng = np.random.default_rng(7)
    for (m, k, n) in gemm_shapes(lesson):
        ap = rng.standard_normal((m, k)).astype(dtype)
        bt = rng.standard_normal((n, k)).astype(dtype)
        c0 = rng.standard_normal((m, n)).astype(dtype)
        c = c0.copy()
        lesson.gemm_parallel(ap, bt, c, plain_kernel)
        want = c0.astype(np.float64) + ap.astype(np.float64) @ bt.astype(np.float64).T
        absprod = np.abs(c0.astype(np.float64)) + np.abs(ap.astype(np.float64)) @ np.abs(bt.astype(np.float64)).T
        assert_close(c, want, absprod, dtype, k,
                     f"gemm_parallel(ap {ap.shape}, bt {bt.shape}, c, kernel) must add ap @ bt.T into c")


def run_spy(lesson, m, k, n, threads=None):
    c = np.zeros((m, n))
    before = numba.get_num_threads()
    if threads:
        numba.set_num_threads(threads)
    try:
        lesson.gemm_parallel(np.zeros((m, k)), np.zeros((n, k)), c, spy_kernel)
    finally:
        numba.set_num_threads(before)
    return c


@pytest.mark.exercise("6.4")
def test_gemm_parallel_calls_every_block_once_per_k_piece(lesson):
    m, k, n = gemm_shapes(lesson)[0]
    c = run_spy(lesson, m, k, n)
    pieces = -(-k // lesson.KC)
    counts = c[0::MR]
    assert np.all(counts == pieces), (f"with K={k} and KC={lesson.KC} each 4 x 3 block of C needs {pieces} kernel "
                                      f"calls (one per KC-long piece of k); got counts from {counts.min():g} "
                                      f"to {counts.max():g}")
    assert np.all(c[1::MR] == k), "the k-ranges [p0, p1) given to the kernel must cover 0..K exactly once"
    assert c[2::MR].max() <= lesson.KC, f"a k-range longer than KC={lesson.KC} was passed to the kernel"
    c = run_spy(lesson, MR, 0, NR)
    assert not c.any(), "with K = 0 there is nothing to add: the kernel should not be called"


@pytest.mark.exercise("6.4")
def test_gemm_parallel_loop_nest_is_blocked(lesson):
    """The uncompiled loop nest (py_func; prange runs as range) with a kernel that records its
    calls: within each row panel (MC rows), the calls for one (NC columns, KC of k) block come
    together, and every MR x NR block of C is visited once per block."""
    MC, KC, NC = lesson.MC, lesson.KC, lesson.NC
    m, k, n = 2 * MC + 2 * MR, KC + 5, NC + 2 * NR
    calls = []
    fn = getattr(lesson.gemm_parallel, "py_func", lesson.gemm_parallel)
    fn(np.zeros((m, k)), np.zeros((n, k)), np.zeros((m, n)), lambda a, bt, c, i0, j0, p0, p1: calls.append((i0, j0, p0, p1)))
    expected = {(i0, j0, p0, min(p0 + KC, k)) for i0 in range(0, m, MR) for j0 in range(0, n, NR) for p0 in range(0, k, KC)}
    assert len(calls) == len(expected) and set(calls) == expected, \
        f"expected the {len(expected)} calls (i0, j0, p0, p1) of the loop nest, got {len(calls)}"
    runs = []  # consecutive calls of one (row panel, column block, k block)
    for i0, j0, p0, _ in calls:
        key = (i0 // MC, j0 // NC, p0 // KC)
        if not runs or runs[-1] != key:
            runs.append(key)
    panels = [r[0] for r in runs]
    assert panels == sorted(panels), (f"gemm_parallel must finish one row panel of MC = {MC} rows (a prange "
                                      f"iteration) before the next; panel order: {describe(panels)}")
    assert len(runs) == len(set(runs)), (
        f"within a row panel, all the calls for one NC x KC block of bt (columns j0 // NC, k-range p0 // KC) must "
        f"come together, so that the block stays in L2 while the panel's MR-row slivers use it; the calls went "
        f"through the blocks (panel, column block, k block) {describe(runs, 8)}")


def describe(seq, limit=6):
    return ", ".join(str(t) for t in seq[:limit]) + (", ..." if len(seq) > limit else "")


@pytest.mark.exercise("6.4")
def test_gemm_parallel_is_a_parfor_run_by_several_threads(lesson):
    fn = lesson.gemm_parallel
    assert fn.targetoptions.get("parallel"), "gemm_parallel must be compiled with @njit(parallel=True)"
    m, n = 4 * lesson.MC, lesson.NC
    available = numba.config.NUMBA_NUM_THREADS
    c = run_spy(lesson, m, 8, n, threads=2 if available >= 2 else None)
    assert c[0::MR].min() >= 1, "some blocks of C were never given to the kernel"
    sig = next(s for s in fn.signatures if s[3] == numba.typeof(spy_kernel))
    diag = fn.overloads[sig].metadata.get("parfor_diagnostics")
    n_parfors = diag.count_parfors() if diag is not None else 0
    assert n_parfors >= 1, ("Numba found no parallel loop (parfor) in gemm_parallel: use numba.prange for "
                            "the row-panel loop")
    if available < 2:
        pytest.skip("Numba has only one thread here (NUMBA_NUM_THREADS=1): cannot observe parallel execution")
    ids = np.unique(c[3::MR])
    assert len(ids) >= 2, (f"with 2 threads and {m // lesson.MC} row panels, every block was computed by thread "
                           f"{int(ids[0]) - 1}: the loop nest runs serially. Is the outer loop a prange?")
    for panel in range(m // lesson.MC):
        owners = np.unique(c[panel * lesson.MC + 3:(panel + 1) * lesson.MC:MR])
        assert len(owners) == 1, (f"row panel {panel} was computed by threads {[int(t) - 1 for t in owners]}: the "
                                  f"prange must be the row-panel loop, so that one thread does a whole panel (one "
                                  f"fork and join per call, each thread's bt block in its own L2)")


# ---------------------------------------------------------------- 6.5 the Numba backend


class Spy:
    """A 2-D matmul that checks its arguments, counts calls, records dtypes and uses NumPy."""

    def __init__(self):
        self.calls = 0
        self.dtypes = []

    def __call__(self, x, y):
        assert x.ndim == 2 and y.ndim == 2, f"matmul_2d must get 2-D arrays, got {x.shape} and {y.shape}"
        self.calls += 1
        self.dtypes.append((x.dtype, y.dtype))
        return np.matmul(x.astype(np.float64), y.astype(np.float64)).astype(np.result_type(x, y))


@pytest.mark.exercise("6.5")
@pytest.mark.parametrize("sa, sb, calls", [
    ((5, 7), (7, 3), 1),
    ((4, 5, 7), (4, 7, 3), 4),
    ((2, 1, 5, 7), (3, 7, 4), 6),
    ((5, 7), (2, 7, 3), 2),
    ((7,), (7, 3), 1),
    ((5, 7), (7,), 1),
    ((7,), (7,), 1),
    ((3, 5, 7), (7,), 3),
    ((1, 1), (1, 1), 1),
])
def test_backend_matmul_shapes(lesson, sa, sb, calls):
    rng = np.random.default_rng(8)
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    spy = Spy()
    got = np.asarray(lesson.NumbaBackend(matmul_2d=spy).matmul(a, b))
    want = np.matmul(a, b)
    assert got.shape == want.shape, f"NumbaBackend.matmul: {sa} @ {sb} should have shape {want.shape}, got {got.shape}"
    assert got.dtype == np.float32, f"float32 @ float32 should give float32, got {got.dtype}"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"NumbaBackend.matmul: {sa} @ {sb}")
    assert spy.calls == calls, (f"{sa} @ {sb}: matmul_2d should be called once per batch element ({calls}), "
                                f"was called {spy.calls} times")


@pytest.mark.exercise("6.5")
def test_backend_matmul_dtypes_and_errors(lesson):
    rng = np.random.default_rng(9)
    spy = Spy()
    be = lesson.NumbaBackend(matmul_2d=spy)
    a, b = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 2))
    got = be.matmul(a, b)
    assert got.dtype == np.float64 and spy.calls == 1, "float32 @ float64 should go to matmul_2d and give float64"
    np.testing.assert_allclose(got, a @ b, rtol=1e-6)
    ia, ib = np.arange(6).reshape(2, 3), np.arange(12).reshape(3, 4)
    np.testing.assert_array_equal(be.matmul(ia, ib), ia @ ib)
    assert spy.calls == 1, "integer operands should go to np.matmul, not to the float kernel"
    fa = rng.standard_normal((2, 3)).astype(np.float32)
    for x, y, what in ((fa, ib, "float32 @ int64"), (ia, b[:3], "int64 @ float64")):
        got = be.matmul(x, y)
        np.testing.assert_allclose(got, np.matmul(x, y), rtol=1e-12, err_msg=what)
        assert got.dtype == np.matmul(x, y).dtype, f"{what}: expected dtype {np.matmul(x, y).dtype}, got {got.dtype}"
        assert spy.calls == 1, (f"{what}: one operand is not a float: the product goes to np.matmul (check both "
                                f"operands' dtypes, not only the first)")
    spy.dtypes.clear()
    a64, b64 = rng.standard_normal((4, 5)), rng.standard_normal((5, 3))
    got = be.matmul(a64, b64)
    np.testing.assert_allclose(got, a64 @ b64, rtol=1e-13, atol=1e-13,
                               err_msg="float64 @ float64 must be computed in float64, not rounded through float32")
    assert spy.dtypes == [(np.float64, np.float64)], f"float64 operands must reach matmul_2d as float64, got {spy.dtypes}"
    with pytest.raises(ValueError, match=r"\(5, 7\).*\(6, 3\)"):
        be.matmul(np.ones((5, 7)), np.ones((6, 3)))
    with pytest.raises(ValueError, match=r"\(2, 5, 7\).*\(3, 7, 4\)"):
        be.matmul(np.ones((2, 5, 7)), np.ones((3, 7, 4)))
    with pytest.raises(ValueError):
        be.matmul(np.float64(2.0), np.ones((2, 2)))
    try:
        from minitorch.tensor import Backend
    except ImportError:
        return
    assert issubclass(lesson.NumbaBackend, Backend), "NumbaBackend must subclass minitorch.tensor.Backend"


@pytest.mark.exercise("6.5")
def test_backend_runs_tensor_matmul_forward_and_backward(lesson):
    autograd = pytest.importorskip("minitorch.autograd", reason="lesson 02 (minitorch.autograd) not built")
    tensor = pytest.importorskip("minitorch.tensor", reason="lesson 01 (minitorch.tensor) not built")
    rng = np.random.default_rng(10)
    a64, b64 = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    spy = Spy()
    be = lesson.NumbaBackend(matmul_2d=spy)
    be.matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))  # the stub fails here
    spy.calls = 0
    with tensor.use_backend("cpu", be):
        a = autograd.Tensor(a64, requires_grad=True)
        b = autograd.Tensor(b64, requires_grad=True)
        (a @ b).sum().backward()
    assert spy.calls >= 3, (f"under use_backend('cpu', NumbaBackend(...)) a matmul forward and backward should "
                            f"call the kernel 3 times, got {spy.calls}")
    np.testing.assert_allclose(a.grad.numpy(), np.ones((5, 3)) @ b64.T, rtol=1e-10)
    np.testing.assert_allclose(b.grad.numpy(), a64.T @ np.ones((5, 3)), rtol=1e-10)


# ---------------------------------------------------------------- 6.6 the BLIS micro-kernel, any shape

# The shape each ISA's register file takes (the lesson's rule, exercise 6.7): named here, so that 6.6 is
# graded on its own. One f32x16 is 1 zmm, 2 ymm or 4 NEON registers.
SHAPE_FOR = {"avx512": (14, 2), "avx2": (6, 1), "avx": (6, 1), "neon": (6, 1), "sse": (2, 1)}


def target():
    from minitorch.simd import vector_target

    return vector_target()


def blis_case(rng, mr, nv, kc, ldc=80, rows=None, co=None):
    nr = 16 * nv
    ap = rng.standard_normal(mr * kc).astype(np.float32)
    bp = rng.standard_normal(nr * kc).astype(np.float32)
    rows = mr + 3 if rows is None else rows
    c = rng.standard_normal(rows * ldc).astype(np.float32)  # not zero: the kernel adds into C
    co = ldc + 3 if co is None else co
    return ap, bp, c, co, ldc


def check_kernel_values(kernel, mr, nv, kc, ldc, co, seed):
    rng = np.random.default_rng(seed)
    nr = 16 * nv
    ap, bp, c, co, ldc = blis_case(rng, mr, nv, kc, ldc=ldc, co=co)
    before = c.copy()
    kernel(ap, bp, c, co, ldc)
    a64 = ap.reshape(kc, mr).T.astype(np.float64)
    b64 = bp.reshape(kc, nr).astype(np.float64)
    block, absblock = a64 @ b64, np.abs(a64) @ np.abs(b64)
    want = before.astype(np.float64)
    absprod = np.abs(want)
    for r in range(mr):
        want[co + r * ldc: co + r * ldc + nr] += block[r]
        absprod[co + r * ldc: co + r * ldc + nr] += absblock[r]
    assert_close(c, want, absprod, np.float32, kc + 1,
                 f"blis_kernel_{mr}x{nv} (kc = {kc}, ldc = {ldc}, co = {co}): C after the call (it must add the "
                 f"{mr} x {nr} block ap-panel @ bp-panel into c[co + r*ldc + j], leaving the rest of c alone)")


@pytest.mark.exercise("6.6")
@pytest.mark.parametrize("kc", [0, 1, 5, 64, 301])
def test_blis_kernel_source_values(lesson, kc):
    shapes = [(1, 1), (3, 2), (6, 1), SHAPE_FOR.get(target()["isa"], (6, 1))]
    for mr, nv in dict.fromkeys(shapes):
        kernel = lesson.make_blis_kernel(mr, nv)
        for ldc, co in ((16 * nv + 9, 7), (16 * nv, 0), (80, 83)):
            check_kernel_values(kernel, mr, nv, kc, ldc, co, seed=kc + 100 * mr + nv)


@pytest.mark.exercise("6.6")
def test_blis_kernel_source_is_python_for_the_shape(lesson):
    for mr, nv in ((1, 1), (4, 3)):
        source = lesson.blis_kernel_source(mr, nv)
        assert isinstance(source, str), f"blis_kernel_source({mr}, {nv}) must return the kernel's source as a str"
        compile(source, "blis_kernel_source", "exec")  # a SyntaxError here names the line
        assert f"def blis_kernel_{mr}x{nv}(" in source, (
            f"blis_kernel_source({mr}, {nv}) must define blis_kernel_{mr}x{nv}(ap, bp, c, co, ldc)")


X86_BROADCAST = re.compile(r"\{1to(?:8|16)\}|\bvbroadcastss\b")
X86_VECTOR_STORE = re.compile(r"\bvmov\w*\s+%[xyz]mm\d+,\s*[-\w]*\(")
X86_STACK = re.compile(r"%[xyz]mm\d+.*\(%r[sb]p\)|\(%r[sb]p\).*%[xyz]mm\d+")  # a vector register to or from the stack
ARM_BROADCAST = re.compile(r"\bfmla\b.*\.s\[\d\]|\bld1r\b|\bdup\b")
ARM_VECTOR_STORE = re.compile(r"\b(?:str|stp|stur)\s+q\d+|\bst1\b")
ARM_STACK = re.compile(r"\b(?:ldr|str|ldp|stp|ldur|stur)\s+q\d+.*\[(?:sp|x29)\b")


def fma_loop_blocks(asm: str, fmas: set[str]) -> list[list[str]]:
    """The basic blocks of `asm` (split at labels) that contain packed FMA lines, as lists of lines."""
    blocks, current = [], []
    for ln in asm.splitlines():
        s = ln.strip()
        if s.endswith(":"):
            blocks.append(current)
            current = []
        elif s and not s.startswith((".", "#", "//")):
            current.append(s)
    blocks.append(current)
    return [b for b in blocks if any(s in fmas for s in b)]


def kernel_loop_problems(asm: str, mr: int, nv: int, arch: str) -> list[str]:
    """What the FMA loop of an mr x 16nv kernel's `asm` lacks: accumulators, broadcasts, no stores/spills."""
    fmas = {ln.strip() for ln in asm.splitlines() if FMA_PS[arch].search(ln)}
    if not fmas:
        return ["its machine code has no packed float32 FMA: use the f32x16 operations of minitorch.simd "
                "(vload_f32, vfma_bcast), not scalar loops"]
    broadcast, store, stack = ((X86_BROADCAST, X86_VECTOR_STORE, X86_STACK) if arch == "x86_64"
                               else (ARM_BROADCAST, ARM_VECTOR_STORE, ARM_STACK))
    best = max(fma_loop_blocks(asm, fmas), key=lambda b: len(packed_fma_dests([s for s in b if s in fmas])))
    dests = packed_fma_dests([s for s in best if s in fmas])
    # one f32x16 is 1 zmm, 2 ymm or 4 NEON registers
    per_vector = 1 if any("zmm" in d for d in dests) else 2 if any("ymm" in d for d in dests) else 4
    out = []
    if len(dests) < mr * nv * per_vector:
        out.append(f"its loop accumulates into {len(dests)} vector registers, {len(dests) / per_vector:g} f32x16 "
                   f"values; the {mr} x {16 * nv} block needs {mr * nv} f32x16 accumulators ({mr * nv * per_vector} "
                   f"registers) updated in one loop over k, each B vector loaded once per k")
    if not any(broadcast.search(s) for s in best):
        out.append("its loop does not broadcast a scalar of A into a vector (no broadcast operand or instruction "
                   "next to its FMAs): the outer-product form multiplies a vector of B by one element of A (vfma_bcast)")
    stores = [s for s in best if store.search(s)]
    if stores:
        out.append(f"it stores vectors inside its loop over k ({stores[0]}): keep the block of C in the "
                   f"accumulators and add them to c once, after the loop (vstore_add_f32)")
    spills = [s for s in best if stack.search(s) and s not in stores]
    if spills:
        out.append(f"its loop reads the stack ({spills[0]}): registers spilled")
    return out


@pytest.mark.exercise("6.6")
def test_blis_kernel_is_an_outer_product_in_registers(lesson):
    arch = machine_isa()
    if arch not in FMA_PS:
        pytest.skip(f"no packed-FMA pattern for this ISA ({arch}); the structural check needs x86-64 or aarch64")
    mr, nv = SHAPE_FOR.get(target()["isa"], (6, 1))
    rng = np.random.default_rng(1)
    ap, bp, c, co, ldc = blis_case(rng, mr, nv, 8)
    kernel = lesson.make_blis_kernel(mr, nv)
    kernel(ap, bp, c, co, ldc)
    float32_fma_lines("")  # skips where this x86-64 CPU has no FMA unit
    problems = kernel_loop_problems(asm_for(kernel, ap, bp, c, co, ldc), mr, nv, arch)
    assert not problems, f"blis_kernel_{mr}x{nv} (this machine's shape, {target()['isa']}): " + "; ".join(problems)


def gemm_case(rng, m, k, n):
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32).T  # a non-contiguous view
    return a, b


@pytest.mark.exercise("6.6")
def test_matmul_blis_matches_numpy(lesson):
    rng = np.random.default_rng(2)
    for shape in ((3, 2), (1, 1)):
        for (m, k, n) in [(1, 1, 1), (3, 16, 32), (37, 1031, 53), (130, 17, 7), (5, 600, 211), (13, 2100, 33)]:
            a, b = gemm_case(rng, m, k, n)
            got = lesson.matmul_blis(a, b, shape=shape)
            assert got.shape == (m, n) and got.dtype == np.float32 and got.flags.c_contiguous
            assert_close(got, a.astype(np.float64) @ b, np.abs(a).astype(np.float64) @ np.abs(b), np.float32, k,
                         f"matmul_blis on ({m}, {k}) @ ({k}, {n}) with the {shape[0]} x {16 * shape[1]} kernel")
    # several blocks of every loop (NC, KC, row blocks), the last ones short, C not zero: small MC, KC, NC
    a = rng.standard_normal((50, 150)).astype(np.float32)
    b = rng.standard_normal((150, 70)).astype(np.float32)
    c0 = rng.standard_normal((50, 70)).astype(np.float32)
    c = c0.copy()
    lesson.gemm_blis(a, b, c, lesson.make_blis_kernel(3, 2), 3, 32, 12, 64, 64)
    assert_close(c, c0.astype(np.float64) + a.astype(np.float64) @ b,
                 np.abs(c0).astype(np.float64) + np.abs(a).astype(np.float64) @ np.abs(b), np.float32, 151,
                 "gemm_blis with the 3 x 32 kernel, MC = 12, KC = 64, NC = 64 (c += a @ b)")


@pytest.mark.exercise("6.6")
def test_matmul_blis_errors(lesson):
    a = np.ones((4, 5), np.float32)
    lesson.matmul_blis(a, np.ones((5, 3), np.float32), shape=(1, 1))
    with pytest.raises(TypeError, match="float32"):
        lesson.matmul_blis(a.astype(np.float64), np.ones((5, 3)), shape=(1, 1))
    with pytest.raises(ValueError, match=r"\(4, 5\).*\(6, 3\)|\(6, 3\).*\(4, 5\)"):
        lesson.matmul_blis(a, np.ones((6, 3), np.float32), shape=(1, 1))


# ---------------------------------------------------------------- 6.7 the shape rule


@pytest.mark.exercise("6.7")
@pytest.mark.parametrize("args, want", [
    ((32, 1, 1, 8), (14, 2)),   # AVX-512, two FMA pipes x 4 cycles: 28 zmm accumulators, 31 registers
    ((32, 1, 1, 4), (14, 2)),   # one 512-bit pipe: more than enough in flight, same shape
    ((16, 2, 1, 8), (6, 1)),    # AVX2: 12 ymm accumulators, 15 registers (BLIS's Haswell kernel)
    ((16, 2, 1, 10), (6, 1)),   # Haswell's 2 x 5
    ((32, 4, 2, 8), (6, 1)),    # NEON: 24 q accumulators
    ((32, 4, 2, 16), (6, 1)),   # Apple M1's 4 x 4
    ((31, 1, 1, 8), (14, 2)),   # the registers exactly full: 28 + 2 + 1 = 31
    ((16, 4, 1, 8), (2, 1)),    # in flight exactly: 2 x 4 = 8 registers of FMAs
    ((7, 1, 1, 4), (2, 2)),     # loads exactly as many as FMAs: 2 + 2 = 4
    ((16, 1, 1, 1), (4, 3)),    # 4 x 3 and 6 x 2 both 12 accumulators: the fewer loads (7, not 8)
    ((10, 1, 1, 1), (3, 2)),    # 3 x 2 and 2 x 3: 6 accumulators, 5 loads each: the smaller NV
])
def test_blis_shape_picks_the_rules_shape(lesson, args, want):
    got = lesson.blis_shape(*args)
    assert tuple(got) == want, (
        f"blis_shape(registers={args[0]}, per_vector={args[1]}, broadcast_registers={args[2]}, in_flight={args[3]}) "
        f"should be {want}, got {got}")


@pytest.mark.exercise("6.7")
@pytest.mark.parametrize("args", [(16, 4, 1, 9), (16, 4, 1, 10), (8, 4, 1, 1), (4, 4, 0, 1)])
def test_blis_shape_refuses_a_machine_no_shape_fits(lesson, args):
    with pytest.raises(ValueError, match="blis_shape"):
        lesson.blis_shape(*args)
