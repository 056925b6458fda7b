"""Lesson 07: CUDA kernels in Numba, graded under the CUDA simulator (or on a real GPU).

Correctness runs through the lesson's host wrappers (the real launch path). Structural
properties (reads per element, coalescing, bank conflicts, active warps, races) run through
`lesson.simulate`, which traces every global and shared-memory access on the CPU and starts
shared memory as NaN, so a missing barrier shows up as a wrong answer.
"""

import dis
import math
import re
from contextlib import contextmanager

import numpy as np
import pytest

pytestmark = pytest.mark.lesson07


@contextmanager
def unstub():
    """The simulator prefixes a kernel's exception with the thread id; keep the stub's own
    message so an unsolved exercise reads as 'not attempted'."""
    try:
        yield
    except NotImplementedError as exc:
        m = re.search(r"(Exercise \d+\.\d+: .*)$", str(exc))
        raise NotImplementedError(m.group(1) if m else str(exc)) from None


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def traced(lesson, trace, **arrays):
    return {name: lesson.TracedArray(a, name, trace) for name, a in arrays.items()}


def assert_close(got, want, what, rtol=1e-5, atol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: expected shape {want.shape}, got {got.shape}"
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        bad = np.argwhere(~np.isclose(got, want, rtol=rtol, atol=atol))
        i = tuple(int(v) for v in bad[0])
        msg = (f"{what}: {len(bad)} of {want.size} elements wrong; first at index {i}: "
               f"expected {want[i]}, got {got[i]}")
        nan = np.isnan(got) & ~np.isnan(want)
        if nan.any():
            msg += (f". {int(nan.sum())} results are NaN: traced shared memory starts as NaN, so a NaN usually means "
                    "a thread read a shared slot before any thread wrote it (a missing cuda.syncthreads(), or a slot "
                    "never loaded)")
        raise AssertionError(msg)


def float_literal_accumulators(kernel) -> list[str]:
    """Names a kernel starts from a float literal (`acc = 0.0`, float64 in Numba) and then updates
    with `+=`/`-=`/`*=`: on a GPU every such update runs in double precision."""
    fn = getattr(kernel, "py_func", kernel)
    ins = list(dis.get_instructions(fn.__code__))
    literal = {b.argval for a, b in zip(ins, ins[1:])
               if a.opname == "LOAD_CONST" and isinstance(a.argval, float) and b.opname == "STORE_FAST"}
    found = set()
    for i, x in enumerate(ins):
        if x.opname in ("BINARY_OP", "INPLACE_ADD", "INPLACE_SUBTRACT", "INPLACE_MULTIPLY") and \
                (x.opname != "BINARY_OP" or x.argrepr.endswith("=")):
            nxt = next((y for y in ins[i + 1:i + 3] if y.opname == "STORE_FAST"), None)
            if nxt is not None and nxt.argval in literal:
                found.add(nxt.argval)
    return sorted(found)


def assert_float32_accumulators(kernel, what):
    bad = float_literal_accumulators(kernel)
    assert not bad, (f"{what} starts {', '.join(bad)} from a float literal: Numba types 0.0 as float64, so on a GPU "
                     f"every += runs in double precision. Write {bad[0]} = np.float32(0.0)")


def shared_array_shapes(kernel) -> list[tuple[str, bool]] | None:
    """(shape as written, whether it is a compile-time constant) for each cuda.shared.array /
    cuda.local.array call in a kernel's source; None where the source cannot be read. Constant:
    literals and names of global constants, not expressions computed in the kernel (`T_TILE + 1`)."""
    import ast
    import inspect
    import textwrap

    fn = getattr(kernel, "py_func", kernel)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None

    def constant(node) -> bool:
        if isinstance(node, ast.Tuple):
            return all(constant(e) for e in node.elts)
        return isinstance(node, (ast.Constant, ast.Name, ast.Attribute))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node) and "Exercise" in ast.unparse(node):
            raise NotImplementedError(ast.literal_eval(node.exc.args[0]) if isinstance(node.exc, ast.Call)
                                      and node.exc.args and isinstance(node.exc.args[0], ast.Constant)
                                      else "not attempted")  # the stub: graded as not attempted
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "array"
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in ("shared", "local")):
            shape = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "shape"), None)
            if shape is not None:
                found.append((ast.unparse(shape), constant(shape)))
    return found


@pytest.mark.parametrize("kernel", [
    pytest.param("block_sum_kernel", marks=pytest.mark.exercise("7.3")),
    pytest.param("block_scan_kernel", marks=pytest.mark.exercise("7.4")),
    pytest.param("matmul_tiled_kernel", marks=pytest.mark.exercise("7.6")),
    pytest.param("transpose_kernel", marks=pytest.mark.exercise("7.7")),
    pytest.param("blelloch_scan_kernel", marks=pytest.mark.exercise("7.8")),
    pytest.param("coarse_sum_kernel", marks=pytest.mark.exercise("7.9"))])
def test_shared_array_shapes_are_compile_time_constants(lesson, kernel):
    """Each of these kernels works in shared memory. The simulator allocates any shape; compiled for
    a GPU, Numba must read the shape when it compiles the kernel (numba-cuda 0.30 on an H100 refused
    `(T_TILE, T_TILE + 1)`)."""
    shapes = shared_array_shapes(getattr(lesson, kernel))
    if shapes is None:
        pytest.skip(f"the source of {kernel} cannot be read here")
    assert shapes, f"{kernel} allocates no cuda.shared.array: this exercise stages its data in shared memory"
    bad = [shape for shape, constant in shapes if not constant]
    assert not bad, (f"{kernel} sizes a shared array with {bad[0]!r}: on a GPU Numba needs the shape as literals or "
                     "names of global constants (computed in the kernel it is a run-time integer, and compiling "
                     "fails). Use a global constant, e.g. T_PAD = T_TILE + 1")


def assert_counts(trace, name, kind, expected, what):
    c = trace.counts(name, kind)
    if not np.all(c == expected):
        verb = "read" if kind == "r" else "written"
        vals = ", ".join(str(v) for v in np.unique(c)[:6])
        raise AssertionError(f"{what}: every element of {name!r} should be {verb} from global memory "
                             f"exactly {expected} time(s); counts seen: {vals}")


# ------------------------------------------------------------------ 7.1 vector add
@pytest.mark.exercise("7.1")
def test_vector_add_matches_numpy_and_guards(lesson):
    rng = np.random.default_rng(0)
    for n, threads in [(1000, 128), (257, 64), (1, 32)]:  # last block partly empty: needs the guard
        a, b = f32(rng, n), f32(rng, n)
        with unstub():
            got = lesson.vector_add(a, b, threads=threads)
        assert_close(got, a + b, f"vector_add with n={n}, {threads} threads per block")
    with pytest.raises(ValueError, match=r"\(5,\).*\(6,\)"):
        lesson.vector_add(np.zeros(5, np.float32), np.zeros(6, np.float32))


@pytest.mark.exercise("7.1")
def test_vector_add_one_read_per_element(lesson):
    rng = np.random.default_rng(1)
    n = 150
    a, b, out = f32(rng, n), f32(rng, n), np.zeros(n, np.float32)
    tr = lesson.Trace()
    t = traced(lesson, tr, a=a, b=b, out=out)
    with unstub():
        lesson.simulate(lesson.vector_add_kernel, 4, 64, t["a"], t["b"], t["out"], trace=tr)  # 256 threads for 150
    assert_close(out, a + b, "vector_add_kernel launched with 4 blocks of 64 for 150 elements")
    for name in ("a", "b"):
        assert_counts(tr, name, "r", 1, "vector_add_kernel")
    assert_counts(tr, "out", "w", 1, "vector_add_kernel")


# ------------------------------------------------------------------ 7.2 2-D bias + relu
@pytest.mark.exercise("7.2")
def test_bias_relu_matches_numpy(lesson):
    rng = np.random.default_rng(2)
    for shape, block in [((37, 45), (32, 4)), ((5, 3), (2, 2))]:  # partial blocks in both dims
        x, bias = f32(rng, *shape), f32(rng, shape[1])
        with unstub():
            got = lesson.bias_relu(x, bias, block=block)
        assert_close(got, np.maximum(x + bias, 0), f"bias_relu on shape {shape} with block {block}")


@pytest.mark.exercise("7.2")
def test_bias_relu_is_coalesced(lesson):
    rng = np.random.default_rng(3)
    x, bias, out = f32(rng, 21, 40), f32(rng, 40), np.zeros((21, 40), np.float32)
    tr = lesson.Trace()
    t = traced(lesson, tr, x=x, bias=bias, out=out)
    with unstub():
        lesson.simulate(lesson.bias_relu_kernel, (2, 6), (32, 4), t["x"], t["bias"], t["out"], trace=tr)
    assert_close(out, np.maximum(x + bias, 0), "bias_relu_kernel, grid (2, 6), block (32, 4)")
    assert_counts(tr, "x", "r", 1, "bias_relu_kernel")
    for name, kind in [("x", "r"), ("out", "w")]:
        eff = tr.coalescing(name, kind)
        assert eff >= 0.5, (f"accesses to {name!r} are not coalesced: efficiency {eff:.3f} (want >= 0.5). "
                            "Map cuda.grid(2)'s x to the column (last, contiguous) index: col, row = cuda.grid(2)")


# ------------------------------------------------------------------ 7.3 block reduction
@pytest.mark.exercise("7.3")
def test_block_sum_partials_reads_and_warps(lesson):
    rng = np.random.default_rng(4)
    R = lesson.REDUCE_THREADS
    n = 2 * R + 44  # 3 blocks, the last one partly empty
    blocks = math.ceil(n / R)
    x, partial = f32(rng, n), np.zeros(blocks, np.float32)
    tr = lesson.Trace()
    t = traced(lesson, tr, x=x, partial=partial)
    with unstub():
        lesson.simulate(lesson.block_sum_kernel, blocks, R, t["x"], t["partial"], trace=tr)
    want = np.array([x[i * R:(i + 1) * R].astype(np.float64).sum() for i in range(blocks)])
    assert_close(partial, want, f"block_sum_kernel partial sums ({blocks} blocks of {R})", rtol=1e-4, atol=1e-4)
    assert_counts(tr, "x", "r", 1, "block_sum_kernel")
    assert_counts(tr, "partial", "w", 1, "block_sum_kernel")
    shared = tr.shared_names()
    assert shared, "block_sum_kernel should reduce in a cuda.shared.array"
    warps = max(tr.active_warps(s) for s in shared) / blocks
    ideal = R // 32 + sum(math.ceil((R >> s) / 32) for s in range(1, int(math.log2(R)) + 1))
    assert warps <= 1.5 * ideal, (f"{warps:.0f} active warp-steps per block writing shared memory; sequential "
                                  f"addressing needs {ideal}. Keep the active threads contiguous (tid < s), "
                                  "not spread out (tid % (2*s) == 0)")


@pytest.mark.exercise("7.3")
def test_block_sum_is_a_tree(lesson):
    """The point of 7.3 is the tree: log2(R) barrier-separated steps in which many threads add,
    not thread 0 adding all R values in a loop (right answer, no parallelism)."""
    rng = np.random.default_rng(40)
    R = lesson.REDUCE_THREADS
    x, partial = f32(rng, 2 * R), np.zeros(2, np.float32)
    tr = lesson.Trace()
    with unstub():
        lesson.simulate(lesson.block_sum_kernel, 2, R, x, lesson.TracedArray(partial, "partial", tr), trace=tr)
    assert_close(partial, [x[:R].astype(np.float64).sum(), x[R:].astype(np.float64).sum()],
                 "block_sum_kernel partial sums", rtol=1e-4, atol=1e-4)
    shared = tr.shared_names()
    assert shared, "block_sum_kernel should reduce in a cuda.shared.array"
    levels = int(math.log2(R))
    busiest = max(max(tr.per_thread(s, "r").values(), default=0) for s in shared)
    assert busiest <= 2 * levels + 2, (
        f"one thread read {busiest} partial sums from shared memory; in a tree over {R} values each thread reads at "
        f"most 2 per level, {2 * levels} in all. Thread 0 adding every value in a loop is a sequential sum")
    steps = max(tr.steps(s) for s in shared)
    assert steps >= levels, (f"the reduction used {steps} barrier-separated steps; a tree over {R} values needs "
                             f"log2({R}) = {levels} (a barrier after each level)")


@pytest.mark.exercise("7.3")
def test_gpu_sum_multi_pass(lesson):
    rng = np.random.default_rng(5)
    x = f32(rng, 2 * lesson.REDUCE_THREADS + 7)
    with unstub():
        got = lesson.gpu_sum(x)
    want = x.astype(np.float64).sum()
    assert abs(got - want) <= 1e-3 * (1 + abs(want)), f"gpu_sum: expected {want:.6f}, got {got:.6f}"


# ------------------------------------------------------------------ 7.4 block scan
@pytest.mark.exercise("7.4")
def test_block_scan(lesson):
    rng = np.random.default_rng(6)
    S = lesson.SCAN_THREADS
    n = 2 * S + 22
    blocks = math.ceil(n / S)
    x, out, sums = f32(rng, n), np.zeros(n, np.float32), np.zeros(blocks, np.float32)
    tr = lesson.Trace()
    t = traced(lesson, tr, x=x, out=out, block_sums=sums)
    with unstub():
        lesson.simulate(lesson.block_scan_kernel, blocks, S, t["x"], t["out"], t["block_sums"], trace=tr)
    want = np.concatenate([np.cumsum(x[i * S:(i + 1) * S].astype(np.float64)) for i in range(blocks)])
    assert_close(out, want, f"block_scan_kernel output ({blocks} blocks of {S})", rtol=1e-4, atol=1e-4)
    want_sums = [x[i * S:(i + 1) * S].astype(np.float64).sum() for i in range(blocks)]
    assert_close(sums, want_sums, "block_scan_kernel block_sums", rtol=1e-4, atol=1e-4)
    assert_counts(tr, "x", "r", 1, "block_scan_kernel")
    assert_counts(tr, "out", "w", 1, "block_scan_kernel")


@pytest.mark.exercise("7.4")
def test_gpu_cumsum(lesson):
    rng = np.random.default_rng(7)
    x = f32(rng, 3 * lesson.SCAN_THREADS + 5)
    with unstub():
        got = lesson.gpu_cumsum(x)
    assert_close(got, np.cumsum(x.astype(np.float64)), "gpu_cumsum", rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ 7.5 naive matmul
@pytest.mark.exercise("7.5")
def test_matmul_naive_matches_numpy(lesson):
    rng = np.random.default_rng(8)
    for (m, k, n), block in [((21, 17, 40), (32, 4)), ((3, 5, 2), (4, 4))]:
        a, b = f32(rng, m, k), f32(rng, k, n)
        with unstub():
            got = lesson.matmul_naive(a, b, block=block)
        assert_close(got, a @ b, f"matmul_naive {a.shape} @ {b.shape}, block {block}", rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        lesson.matmul_naive(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32))


@pytest.mark.exercise("7.5")
def test_matmul_naive_accumulates_in_float32(lesson):
    rng = np.random.default_rng(46)
    a, b = f32(rng, 3, 70), f32(rng, 70, 5)
    with unstub():
        got = lesson.matmul_naive(a, b, block=(8, 4))
    assert_close(got, a @ b, "matmul_naive (3, 70) @ (70, 5)", rtol=1e-4, atol=1e-4)
    assert_float32_accumulators(lesson.matmul_naive_kernel, "matmul_naive_kernel")


@pytest.mark.exercise("7.5")
def test_matmul_naive_reads(lesson):
    rng = np.random.default_rng(9)
    m, k, n = 9, 7, 40
    a, b, out = f32(rng, m, k), f32(rng, k, n), np.zeros((m, n), np.float32)
    tr = lesson.Trace()
    t = traced(lesson, tr, a=a, b=b, out=out)
    with unstub():
        lesson.simulate(lesson.matmul_naive_kernel, (2, 5), (32, 2), t["a"], t["b"], t["out"], trace=tr)
    assert_close(out, a @ b, "matmul_naive_kernel, grid (2, 5), block (32, 2)", rtol=1e-4, atol=1e-4)
    assert_counts(tr, "a", "r", n, "naive matmul reads a row of a once per output column")
    assert_counts(tr, "b", "r", m, "naive matmul reads a column of b once per output row")
    assert_counts(tr, "out", "w", 1, "matmul_naive_kernel")
    eff = tr.coalescing("b")
    assert eff >= 0.5, f"reads of b are not coalesced (efficiency {eff:.3f}): x should index columns"


# ------------------------------------------------------------------ 7.6 tiled matmul
@pytest.mark.exercise("7.6")
def test_matmul_tiled_matches_numpy(lesson):
    rng = np.random.default_rng(10)
    T = lesson.TILE
    for m, k, n in [(2 * T + 3, 3 * T - 1, T + 5), (3, 2, 5)]:  # not multiples of TILE; smaller than a tile
        a, b = f32(rng, m, k), f32(rng, k, n)
        with unstub():
            got = lesson.matmul_tiled(a, b)
        assert_close(got, a @ b, f"matmul_tiled {a.shape} @ {b.shape} (TILE={T})", rtol=1e-4, atol=1e-4)
    assert_float32_accumulators(lesson.matmul_tiled_kernel, "matmul_tiled_kernel")


@pytest.mark.exercise("7.6")
def test_matmul_tiled_reads_each_element_once_per_tile_pass(lesson):
    rng = np.random.default_rng(11)
    T = lesson.TILE
    m, k, n = 2 * T + 3, 2 * T + 7, T + 5
    a, b, out = f32(rng, m, k), f32(rng, k, n), np.zeros((m, n), np.float32)
    tr = lesson.Trace()
    t = traced(lesson, tr, a=a, b=b, out=out)
    grid = (math.ceil(n / T), math.ceil(m / T))
    with unstub():
        lesson.simulate(lesson.matmul_tiled_kernel, grid, (T, T), t["a"], t["b"], t["out"], trace=tr)
    assert_close(out, a @ b, f"matmul_tiled_kernel (shared memory starts as NaN: a missing syncthreads "
                             f"or an unloaded tile slot shows here), grid {grid}", rtol=1e-4, atol=1e-4)
    assert tr.shared_names(), "matmul_tiled_kernel should stage tiles in cuda.shared.array"
    assert_counts(tr, "a", "r", grid[0], f"tiled matmul: once per tile pass, i.e. ceil(n/TILE) = {grid[0]} times")
    assert_counts(tr, "b", "r", grid[1], f"tiled matmul: once per tile pass, i.e. ceil(m/TILE) = {grid[1]} times")
    assert_counts(tr, "out", "w", 1, "matmul_tiled_kernel")


# ------------------------------------------------------------------ 7.7 transpose
@pytest.mark.exercise("7.7")
def test_transpose_matches_numpy(lesson):
    rng = np.random.default_rng(12)
    for shape in [(45, 70), (3, 40)]:
        a = f32(rng, *shape)
        with unstub():
            got = lesson.transpose(a)
        assert_close(got, a.T, f"transpose of shape {shape}", rtol=0, atol=0)


@pytest.mark.exercise("7.7")
def test_transpose_coalesced_and_conflict_free(lesson):
    rng = np.random.default_rng(13)
    TT, TR = lesson.T_TILE, lesson.T_ROWS
    rows, cols = 40, 36
    a, out = f32(rng, rows, cols), np.zeros((cols, rows), np.float32)
    tr = lesson.Trace()
    t = traced(lesson, tr, a=a, out=out)
    grid = (math.ceil(cols / TT), math.ceil(rows / TT))
    with unstub():
        lesson.simulate(lesson.transpose_kernel, grid, (TT, TR), t["a"], t["out"], trace=tr)
    assert_close(out, a.T, f"transpose_kernel on ({rows}, {cols}), grid {grid}", rtol=0, atol=0)
    assert_counts(tr, "a", "r", 1, "transpose_kernel")
    assert_counts(tr, "out", "w", 1, "transpose_kernel")
    for name, kind in [("a", "r"), ("out", "w")]:
        eff = tr.coalescing(name, kind)
        assert eff >= 0.5, (f"{'reads of a' if kind == 'r' else 'writes of out'} are not coalesced (efficiency "
                            f"{eff:.3f}, want >= 0.5): stage the tile in shared memory so both sides walk rows")
    shared = tr.shared_names()
    assert shared, "transpose_kernel should stage the tile in cuda.shared.array"
    worst = max(tr.bank_conflicts(s) for s in shared)
    assert worst == 1, f"{worst}-way shared-memory bank conflict: pad the tile to (T_TILE, T_PAD), T_PAD = T_TILE + 1"


# ------------------------------------------------------------------ 7.8 work-efficient scan
@pytest.mark.exercise("7.8")
def test_blelloch_scan_results_and_work(lesson):
    rng = np.random.default_rng(41)
    T, N = lesson.BSCAN_THREADS, lesson.BSCAN_N
    assert N == 2 * T, f"BSCAN_N should be 2 * BSCAN_THREADS, got {N} and {T}"
    n = 2 * N + 37  # 3 blocks, the last one partly empty
    blocks = math.ceil(n / N)
    x, out, sums = f32(rng, n), np.zeros(n, np.float32), np.zeros(blocks, np.float32)
    tr = lesson.Trace()
    t = traced(lesson, tr, x=x, out=out, block_sums=sums)
    with unstub():
        lesson.simulate(lesson.blelloch_scan_kernel, blocks, T, t["x"], t["out"], t["block_sums"], trace=tr)
    want = np.concatenate([np.cumsum(x[i * N:(i + 1) * N].astype(np.float64)) for i in range(blocks)])
    assert_close(out, want, f"blelloch_scan_kernel output ({blocks} blocks of {N} elements)", rtol=1e-4, atol=1e-4)
    assert_close(sums, [x[i * N:(i + 1) * N].astype(np.float64).sum() for i in range(blocks)],
                 "blelloch_scan_kernel block_sums", rtol=1e-4, atol=1e-4)
    assert_counts(tr, "x", "r", 1, "blelloch_scan_kernel")
    assert_counts(tr, "out", "w", 1, "blelloch_scan_kernel")
    shared = tr.shared_names()
    assert shared, "blelloch_scan_kernel should scan in a cuda.shared.array"
    writes = sum(len(tr.of(s, "w")) for s in shared) / (blocks * N)
    assert writes <= 4.5, (
        f"{writes:.1f} shared-memory writes per element; a work-efficient scan does about 4 (load, up-sweep, two in "
        f"the down-sweep), Hillis-Steele log2({N}) + 1 = {int(math.log2(N)) + 1}: use the up-sweep / down-sweep tree")


@pytest.mark.exercise("7.8")
def test_gpu_cumsum_blelloch(lesson):
    rng = np.random.default_rng(42)
    for n in [1, lesson.BSCAN_N, 3 * lesson.BSCAN_N + 5]:
        x = f32(rng, n)
        with unstub():
            got = lesson.gpu_cumsum_blelloch(x)
        assert_close(got, np.cumsum(x.astype(np.float64)), f"gpu_cumsum_blelloch of {n} elements", rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ 7.9 thread coarsening
@pytest.mark.exercise("7.9")
def test_coarse_sum_reads_coarsens_and_coalesces(lesson):
    rng = np.random.default_rng(43)
    R, C = lesson.REDUCE_THREADS, lesson.COARSEN
    assert C >= 2, f"COARSEN should be at least 2, got {C}"
    n = 2 * C * R + 3 * R + 5  # 3 blocks, the last one partly empty
    blocks = math.ceil(n / (C * R))
    x, partial = f32(rng, n), np.zeros(blocks, np.float32)
    tr = lesson.Trace()
    t = traced(lesson, tr, x=x, partial=partial)
    with unstub():
        lesson.simulate(lesson.coarse_sum_kernel, blocks, R, t["x"], t["partial"], trace=tr)
    want = [x[i * C * R:(i + 1) * C * R].astype(np.float64).sum() for i in range(blocks)]
    assert_close(partial, want, f"coarse_sum_kernel partial sums ({blocks} blocks of {C} x {R} elements)",
                 rtol=1e-4, atol=1e-4)
    assert_counts(tr, "x", "r", 1, "coarse_sum_kernel")
    full = [v for (blk, _), v in tr.per_thread("x", "r").items() if blk[0] < blocks - 1]
    assert full and min(full) == max(full) == C, (
        f"in a full block every thread should read exactly COARSEN = {C} elements of x; threads read "
        f"{sorted(set(full))}")
    eff = tr.coalescing("x")
    assert eff >= 0.5, (f"reads of x are not coalesced (efficiency {eff:.3f}): thread t should read x[base + c*R + t], "
                        "so each of its C loads covers consecutive addresses across the warp")
    shared = tr.shared_names()
    assert shared, "coarse_sum_kernel should finish with a tree in a cuda.shared.array"
    per_element = sum(len(tr.of(s, "w")) for s in shared) / n
    assert per_element <= 2.0 / C + 0.05, (
        f"{per_element:.2f} shared-memory writes per element of x; coarsened by {C}, the tree should write about "
        f"{2 / C:.2f} (2 per thread): add the C elements in a register first")


@pytest.mark.exercise("7.9")
def test_gpu_sum_coarse(lesson):
    rng = np.random.default_rng(44)
    x = f32(rng, 5 * lesson.COARSEN * lesson.REDUCE_THREADS + 11)
    with unstub():
        got = lesson.gpu_sum_coarse(x)
    want = x.astype(np.float64).sum()
    assert abs(got - want) <= 1e-3 * (1 + abs(want)), f"gpu_sum_coarse: expected {want:.6f}, got {got:.6f}"
    assert_float32_accumulators(lesson.coarse_sum_kernel, "coarse_sum_kernel")


# ------------------------------------------------------------------ on a real GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [pytest.param("matmul_naive", marks=pytest.mark.exercise("7.5")),
                                    pytest.param("matmul_tiled", marks=pytest.mark.exercise("7.6"))])
def test_gpu_matmul_compiles_to_float32_arithmetic(lesson, kernel):
    """On a GPU the kernel is compiled: no double-precision arithmetic may appear in its PTX."""
    if lesson.SIMULATED:
        pytest.skip("needs the compiled CUDA target (NUMBA_ENABLE_CUDASIM is set)")
    rng = np.random.default_rng(45)
    a, b = f32(rng, 33, 17), f32(rng, 17, 20)
    with unstub():
        got = getattr(lesson, kernel)(a, b)
    assert_close(got, a @ b, f"{kernel} on the GPU", rtol=1e-4, atol=1e-4)
    ptx = "\n".join(getattr(lesson, kernel + "_kernel").inspect_asm().values())
    f64 = re.findall(r"\b(?:add|sub|mul|fma\.rn|div\.rn)\.f64\b", ptx)
    assert not f64, (f"{kernel}_kernel's PTX has {len(f64)} double-precision instructions ({f64[0]}, ...): start the "
                     "accumulator from np.float32(0.0)")
