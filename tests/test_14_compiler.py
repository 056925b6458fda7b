"""Lesson 14: a deep-learning compiler.

Oracles: NumPy (shapes, dtypes, values), eager minitorch (the traced functions run on Tensors),
graphs built by hand with known dead nodes and duplicates. Each exercise's tests swap the lesson's
other exercises for the reference package's (`solo`), so they grade that exercise alone.
"""

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from course.cuda_c import NvrtcUnavailable, compile_ptx, emulator_unavailable, ptx_stats
from minitorch.autograd import Tensor

pytestmark = pytest.mark.lesson14

EXERCISES = {"14.1": ("infer_meta", "broadcast_shapes"), "14.2": ("guard_key", "Compiled"),
             "14.3": ("dce", "cse"), "14.4": ("fold_constants", "simplify"),
             "14.5": ("fuse", "kernel_io"), "14.6": ("plan_buffers",), "14.7": ("numba_source",),
             "14.8": ("cuda_source",), "14.9": ("Autotuner",)}


@pytest.fixture
def solo(lesson, monkeypatch):
    """lesson, with every exercise but the one named replaced by the reference package's."""
    import minitorch.compiler as ref

    def only(ex):
        spaces = {id(lesson._names): lesson._names}
        for v in list(lesson._names.values()):
            g = getattr(v, "__globals__", None)
            if g is not None:
                spaces[id(g)] = g
        for other, names in EXERCISES.items():
            if other != ex:
                for d in spaces.values():
                    for name in names:
                        monkeypatch.setitem(d, name, getattr(ref, name))
        return lesson

    return only


def softmax_fn(x):
    e = (x - x.max(axis=-1, keepdims=True)).exp()
    return e / e.sum(axis=-1, keepdims=True)


def layer_norm_fn(x, w, b):
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc * (var + 1e-5) ** -0.5 * w + b


def chain_fn(x, y):
    return ((x * 2.0 + y).tanh() - 1.0).relu().exp()


GELU_C = float(np.sqrt(2.0 / np.pi))


def mlp_block(x, ln_w, ln_b, w1, b1, w2, b2):
    h = layer_norm_fn(x, ln_w, ln_b) @ w1 + b1
    h = 0.5 * h * (1.0 + (GELU_C * (h + 0.044715 * h * h * h)).tanh())
    return x + h @ w2 + b2


def block_params(c, seed=0, dtype=np.float64):
    r = np.random.default_rng(seed)
    return [Tensor(a.astype(dtype)) for a in (1 + 0.1 * r.standard_normal(c), 0.1 * r.standard_normal(c),
                                               0.1 * r.standard_normal((c, 4 * c)), 0.1 * r.standard_normal(4 * c),
                                               0.1 * r.standard_normal((4 * c, c)), 0.1 * r.standard_normal(c))]


def ops(graph):
    return [n.op for n in graph.nodes]


shapes = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)


# ------------------------------------------------------------------ 14.1 shapes and dtypes
@pytest.mark.exercise("14.1")
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=shapes, b=shapes)
@example(a=(3, 1), b=(1, 4))
@example(a=(), b=(2, 3))
@example(a=(2, 3), b=(3, 2))
def test_infer_meta_broadcasts_like_numpy(solo, a, b):
    lesson = solo("14.1")
    for da, db in [(np.float32, np.float32), (np.float32, np.float64), (np.float64, np.float32)]:
        try:
            want = np.add(np.zeros(a, da), np.zeros(b, db))
        except ValueError:
            with pytest.raises(ValueError):
                lesson.infer_meta("mul", [a, b], [np.dtype(da), np.dtype(db)], {})
            continue
        shape, dtype = lesson.infer_meta("mul", [a, b], [np.dtype(da), np.dtype(db)], {})
        assert (tuple(shape), np.dtype(dtype)) == (want.shape, want.dtype), \
            f"mul of {a} {np.dtype(da)} and {b} {np.dtype(db)}: expected {want.shape} {want.dtype}, got {shape} {dtype}"
    for op in ("exp", "neg", "relu"):
        assert tuple(lesson.infer_meta(op, [a], [np.dtype(np.float32)], {})[0]) == a


@pytest.mark.exercise("14.1")
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple), data=st.data())
def test_infer_meta_reductions_and_matmul(solo, shape, data):
    lesson = solo("14.1")
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    for keepdims in (False, True):
        want = np.zeros(shape).sum(axis=axis, keepdims=keepdims).shape
        got = lesson.infer_meta("sum", [shape], [np.dtype(np.float64)], {"axis": axis, "keepdims": keepdims})
        assert tuple(got[0]) == want, f"sum(axis={axis}, keepdims={keepdims}) of {shape}: expected {want}, got {got[0]}"
    m = data.draw(st.integers(1, 4))
    if len(shape) >= 2:
        b = (shape[-1], m)
        want = (np.zeros(shape) @ np.zeros(b)).shape
        assert tuple(lesson.infer_meta("matmul", [shape, b], [np.dtype(np.float64)] * 2, {})[0]) == want
        with pytest.raises(ValueError):
            lesson.infer_meta("matmul", [shape, (shape[-1] + 1, m)], [np.dtype(np.float64)] * 2, {})
    with pytest.raises(TypeError):
        lesson.infer_meta("exp", [shape], [np.dtype(np.int64)], {})


# ------------------------------------------------------------------ 14.2 guards
@pytest.mark.exercise("14.2")
def test_guards_cache_and_recompile_once(solo):
    lesson = solo("14.2")
    f = lesson.Compiled(softmax_fn)
    rng = np.random.default_rng(1)
    calls = [((3, 7), np.float64, 1), ((3, 7), np.float64, 1), ((5, 7), np.float64, 2), ((5, 7), np.float64, 2),
             ((3, 7), np.float32, 3), ((3, 7), np.float32, 3), ((3, 7), np.float64, 3)]
    for shape, dtype, compiles in calls:
        x = rng.standard_normal(shape).astype(dtype)
        out = f(Tensor(x))
        want = softmax_fn(Tensor(x)).data
        assert f.compiles == compiles, f"after a call with {shape} {np.dtype(dtype)}: expected {compiles} compilations, got {f.compiles}"
        assert out.data.dtype == want.dtype and out.shape == want.shape, \
            f"{shape} {np.dtype(dtype)}: expected {want.shape} {want.dtype}, got {out.shape} {out.data.dtype} (a guard that ignores dtype?)"
        np.testing.assert_allclose(out.data, want, rtol=1e-6)
    key32 = lesson.guard_key([Tensor(np.zeros((2, 3), np.float32))])
    key64 = lesson.guard_key([Tensor(np.zeros((2, 3)))])
    assert key32 != key64, "guard_key must include the dtype"


@pytest.mark.exercise("14.2")
def test_graph_break_falls_back_to_eager_with_message(solo):
    lesson = solo("14.2")

    def branchy(x):
        if x.sum(axis=-1).item() > 0:
            return x.relu()
        return -x

    f = lesson.Compiled(branchy)
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal(6)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = f(Tensor(x))
        np.testing.assert_allclose(out.data, branchy(Tensor(x)).data)
        if seed == 0:
            assert any("item" in str(w.message) or "value" in str(w.message) for w in caught), \
                f"expected a warning naming the cause of the graph break, got {[str(w.message) for w in caught]}"
    assert f.compiles == 0, f"a graph break is not a compilation; compiles = {f.compiles}"
    assert len(f.breaks) == 1 and "value" in f.breaks[0], f"breaks: {f.breaks}"
    two = lesson.Compiled(lambda x, y: (x + y, x * y))(Tensor(np.ones(3)), Tensor(np.full(3, 2.0)))
    assert isinstance(two, tuple) and len(two) == 2, "a function returning a tuple returns a tuple"


# ------------------------------------------------------------------ 14.3 DCE and CSE
def hand_graph(lesson):
    g = lesson.Graph()
    x = g.add_input("x", (3, 5), np.float64)
    y = g.add_input("y", (3, 5), np.float64)
    two, two_b, three = g.add_const(2.0, np.float64), g.add_const(2.0, np.float64), g.add_const(3.0, np.float64)
    a = g.add("mul", [x, two])
    b = g.add("mul", [x, two_b])        # duplicate of a (after the constants merge)
    c = g.add("mul", [x, three])        # not a duplicate: another constant
    s0 = g.add("sum", [a], {"axis": 0, "keepdims": True})
    s1 = g.add("sum", [b], {"axis": 1, "keepdims": True})   # other attributes
    s0b = g.add("sum", [b], {"axis": 0, "keepdims": True})  # duplicate of s0
    dead1 = g.add("exp", [y])
    dead2 = g.add("tanh", [dead1])
    g.add("probe", [c], {"label": "c"})  # a side effect
    out = g.add("add", [g.add("add", [s0, s0b]), s1])
    g.outputs = [out]
    return g, dict(x=x, y=y, a=a, b=b, c=c, dead1=dead1, dead2=dead2, s0=s0, s1=s1, s0b=s0b)


@pytest.mark.exercise("14.3")
def test_dce_removes_exactly_the_dead_nodes(solo):
    lesson = solo("14.3")
    g, n = hand_graph(lesson)
    out = lesson.dce(g)
    assert len(out.nodes) == len(g.nodes) - 2, f"expected exactly exp and tanh of y removed:\n{out}"
    assert sorted(ops(out)) == sorted(o for o in ops(g) if o not in ("exp", "tanh"))
    assert out.count("probe") == 1, "a probe is a side effect: DCE must keep it"
    assert [i.attrs["name"] for i in out.inputs] == ["x", "y"], "inputs stay, in order"
    assert all(i in out.nodes for m in out.nodes for i in m.inputs), "the new graph's nodes read nodes of the new graph"
    x = np.random.default_rng(0).standard_normal((3, 5))
    np.testing.assert_allclose(lesson.interpret(out)(x, x)[0], lesson.interpret(g)(x, x)[0])


@pytest.mark.exercise("14.3")
def test_cse_merges_exactly_the_duplicates(solo):
    lesson = solo("14.3")
    g, _ = hand_graph(lesson)
    out = lesson.cse(g)
    assert len(out.nodes) == len(g.nodes) - 3, f"expected 3 merges (a constant 2.0, x*2, sum(axis=0)):\n{out}"
    assert out.count("const") == 2 and out.count("mul") == 2 and out.count("sum") == 2, f"\n{out}"
    assert out.count("input") == 2 and out.count("probe") == 1
    g2 = lesson.trace(lambda x: (x.sum(axis=0, keepdims=True), x.sum(axis=1, keepdims=True), x + 1.0, x + 2.0),
                      np.zeros((4, 4)))
    out2 = lesson.cse(g2)
    assert out2.count("sum") == 2 and out2.count("const") == 2, f"different attributes are different nodes:\n{out2}"
    x = np.random.default_rng(1).standard_normal((3, 5))
    np.testing.assert_allclose(lesson.interpret(out)(x, x)[0], lesson.interpret(g)(x, x)[0])


# ------------------------------------------------------------------ 14.4 folding and simplification
@pytest.mark.exercise("14.4")
def test_fold_constants(solo):
    lesson = solo("14.4")
    g = lesson.trace(lambda x: x * (2.0 ** 0.5) + (3.0 - 1.0) * (1.0 / 4.0), np.zeros(5, np.float32))
    out = lesson.dce(lesson.fold_constants(g))
    assert ops(out).count("pow") == 0 and out.count("mul") == 1 and out.count("add") == 1, f"\n{out}"
    consts = sorted(n.attrs["value"] for n in out.nodes if n.op == "const")
    np.testing.assert_allclose(consts, sorted([2.0 ** 0.5, 0.5]), rtol=1e-6)
    assert all(n.dtype == np.float32 for n in out.nodes), "folded constants keep the node's dtype"
    x = np.random.default_rng(2).standard_normal(5).astype(np.float32)
    np.testing.assert_allclose(lesson.interpret(out)(x)[0], x * np.float32(2 ** 0.5) + 0.5, rtol=1e-6)


@pytest.mark.exercise("14.4")
def test_simplify_removes_no_ops_only(solo):
    lesson = solo("14.4")
    g = lesson.trace(lambda x: -(-(((x * 1.0 + 0.0) - 0.0) / 1.0) ** 1.0), np.zeros((2, 3)))
    out = lesson.dce(lesson.simplify(g))
    assert ops(out) == ["input"] and out.outputs == out.inputs, f"expected the input returned:\n{out}"
    # not no-ops: a broadcast, and a dtype change
    g2 = lesson.trace(lambda x, z: (x + z, x * 2.0), np.zeros(3), np.zeros((2, 3)))
    out2 = lesson.dce(lesson.simplify(g2))
    assert out2.count("add") == 1 and out2.count("mul") == 1, f"\n{out2}"
    gb = lesson.Graph()
    x = gb.add_input("x", (3,), np.float32)
    gb.outputs = [gb.add("add", [x, gb.add_const(0.0, np.float64)])]
    assert lesson.dce(lesson.simplify(gb)).count("add") == 1, "float32 + float64 zero changes the dtype: keep it"


# ------------------------------------------------------------------ 14.5 fusion
@pytest.mark.exercise("14.5")
@pytest.mark.parametrize("fn,args,kernels", [
    (softmax_fn, [(7, 13)], 1), (layer_norm_fn, [(2, 5, 11), (11,), (11,)], 1), (chain_fn, [(9,), (9,)], 1),
    (lambda x, w: softmax_fn(x) @ w, [(4, 6), (6, 3)], 2),
    (lambda x, w: (softmax_fn(x) @ w).relu() + x.sum(axis=-1, keepdims=True), [(4, 6), (6, 3)], 4),
    (lambda x: x.sum(axis=0, keepdims=True).exp(), [(4, 6)], 2),
])
def test_fusion_plan_kernels(solo, fn, args, kernels):
    lesson = solo("14.5")
    g = lesson.optimize(lesson.trace(fn, *(np.zeros(s) for s in args)))
    plan = lesson.fuse(g)
    assert len(plan) == kernels, f"expected {kernels} kernels, got {len(plan)}: {[[n.op for n in p] for p in plan]}\n{g}"
    every = [n for p in plan for n in p]
    assert sorted(map(id, every)) == sorted(id(n) for n in g.nodes if n.op not in ("input", "const")), \
        "every operation is in exactly one kernel"
    done = set(n for n in g.nodes if n.op in ("input", "const"))
    for p in plan:  # runnable in this order
        inside = set(p)
        for n in p:
            assert all(i in done or i in inside for i in n.inputs), f"kernel {[m.op for m in p]} runs before its inputs"
        done |= inside


@pytest.mark.exercise("14.5")
def test_fusion_does_not_cross_matmul_or_make_cycles(solo):
    lesson = solo("14.5")

    def f(x, w):
        a = x.exp()
        return a + (a @ w)  # a -> matmul -> add: the add cannot join a's kernel
    g = lesson.optimize(lesson.trace(f, np.zeros((4, 4)), np.zeros((4, 4))))
    plan = lesson.fuse(g)
    assert len(plan) == 3, f"expected exp | matmul | add, got {[[n.op for n in p] for p in plan]}"


@pytest.mark.exercise("14.5")
def test_bytes_eager_vs_fused(solo):
    lesson = solo("14.5")
    rows, c = 7, 13
    g = lesson.optimize(lesson.trace(softmax_fn, np.zeros((rows, c))))
    row, full = rows * 8, rows * c * 8
    assert lesson.plan_bytes(g, lesson.fuse(g)) == (full, full), "fused softmax reads x once and writes once"
    # eager: max r x w m; sub r x,m w; exp r w; sum r w s; div r e,s w
    want = (full + (full + row) + full + full + (full + row), row + full + full + row + full)
    assert lesson.plan_bytes(g, lesson.eager_plan(g)) == want
    gl = lesson.optimize(lesson.trace(layer_norm_fn, np.zeros((rows, c), np.float32), np.ones(c, np.float32),
                                      np.zeros(c, np.float32)))
    reads, writes = lesson.kernel_io(gl, lesson.fuse(gl)[0])
    assert [n.attrs["name"] for n in reads] == ["x0", "x1", "x2"] and writes == gl.outputs


# ------------------------------------------------------------------ 14.6 code generation and compile()
@pytest.mark.exercise("14.7")
@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 6), c=st.integers(1, 9), dtype=st.sampled_from([np.float64, np.float32]))
@example(rows=1, c=1, dtype=np.float64)
def test_generated_kernels_equal_eager(solo, rows, c, dtype):
    lesson = solo("14.7")
    rng = np.random.default_rng(rows * 10 + c)
    x = rng.standard_normal((rows, c)).astype(dtype)
    w, b = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-5, atol=2e-6)
    for fn, args in [(softmax_fn, (x,)), (layer_norm_fn, (x, w, b)), (chain_fn, (x, b)),
                     (lambda x: x.sum(axis=-1) * 2.0, (x,))]:
        run = lesson.build_kernels(lesson.trace(fn, *args), source_fn=lesson.numba_source, parallel=False)
        got = run(*args)[0]
        want = fn(*(Tensor(a) for a in args)).data
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, **tol)


@pytest.mark.exercise("14.7")
def test_source_is_one_loop_nest_per_group(solo):
    lesson = solo("14.7")
    g = lesson.optimize(lesson.trace(softmax_fn, np.zeros((3, 5))))
    src = lesson.numba_source(g, lesson.fuse(g)[0], "k")
    assert src.startswith("def k(rows, C, in0, out0):"), src
    assert src.count("for r in prange(rows)") == 1 and src.count("for c in range") == 3, \
        f"a softmax: one loop over rows, three over columns (max, sum, output):\n{src}"
    compile(src, "<k>", "exec")


@pytest.mark.exercise("14.7")
def test_float32_kernels_compute_in_float32(solo):
    """Numba's own type inference of a float32 softmax and LayerNorm kernel: every value v0, v1, ...
    (the accumulators included) is float32. A bare 0.0 or -math.inf is a float64 and drags the
    row's sum or max into float64: a conversion per element, and a max loop LLVM does not vectorise."""
    import numba

    lesson = solo("14.7")
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    w = np.ones(6, np.float32)
    for fn, args in [(softmax_fn, (x,)), (layer_norm_fn, (x, w, w))]:
        g = lesson.optimize(lesson.trace(fn, *args))
        group = lesson.fuse(g)[0]
        src = lesson.numba_source(g, group, "k")
        kernel = lesson.compile_numba(src, "k", parallel=False)
        writes = lesson.kernel_io(g, group)[1]
        rows, c = 4, 6
        ins = [(np.asarray(a).reshape(rows, c) if np.asarray(a).size == rows * c else np.asarray(a).reshape(1, c))
               for a in args]
        outs = [np.empty((rows, 1 if n.shape[-1] == 1 else c), np.float32) for n in writes]
        kernel(rows, c, *ins, *outs)
        typemap = next(iter(kernel.overloads.values())).type_annotation.typemap
        wide = sorted({f"{name.split('.')[0]}: {t}" for name, t in typemap.items()
                       if name.split(".")[0][:1] == "v" and name.split(".")[0][1:].isdigit() and t != numba.float32})
        assert not wide, f"values of a float32 kernel that are not float32 ({fn.__name__}):\n" + "\n".join(wide) \
            + f"\n{src}"


@pytest.mark.exercise("14.7")
@pytest.mark.timeout(120)
def test_compile_mlp_block_equals_eager(solo):
    lesson = solo("14.7")
    f = lesson.Compiled(mlp_block, backend=lambda g: lesson.build_kernels(g, source_fn=lesson.numba_source))
    for shape in [(2, 5, 8), (7, 8)]:
        x = Tensor(np.random.default_rng(3).standard_normal(shape))
        params = block_params(8)
        got, want = f(x, *params), mlp_block(x, *params)
        np.testing.assert_allclose(got.data, want.data, rtol=1e-12, atol=1e-12)
    assert f.compiles == 2
    log = []
    x = np.random.default_rng(4).standard_normal((7, 8))
    p = [t.data for t in block_params(8)]
    run = lesson.build_kernels(lesson.trace(mlp_block, x, *p), source_fn=lesson.numba_source, log=log)
    run(x, *p)
    assert len(log) == 5, f"expected 5 kernels (ln, matmul, bias+gelu, matmul, bias+residual), got {[k for k, _, _ in log]}"


def eager(fn, *arrays):
    """fn run by eager minitorch on these arrays: a list of arrays."""
    out = fn(*(Tensor(a) for a in arrays))
    return [o.data for o in (out if isinstance(out, tuple) else (out,))]


# ------------------------------------------------------------------ 14.5 bytes, instrumented
class Recorder:
    """A (rows, C) argument of a generated kernel that records which elements of the node's own
    array (ids: the row view of the flat element numbers) the kernel reads or writes."""

    def __init__(self, data, ids, seen):
        self.data, self.ids, self.seen = data, ids, seen

    def __getitem__(self, rc):
        self.seen.add(int(self.ids[rc]))
        return self.data[rc]

    def __setitem__(self, rc, value):
        self.seen.add(int(self.ids[rc]))
        self.data[rc] = value


def touched_bytes(lesson, g, plan, arrays):
    """(bytes read, bytes written) by running the plan with each fused kernel's source executed as
    plain Python on recording arrays: distinct elements of each array touched x its itemsize."""
    import math as m
    env = dict(zip(g.inputs, arrays))
    for n in g.nodes:
        if n.op == "const":
            env[n] = np.asarray(n.attrs["value"], n.dtype)
    read = written = 0
    for k, group in enumerate(plan):
        reads, writes = lesson.kernel_io(g, group)
        dom = lesson.domain(group)
        if dom is None:  # a library kernel reads its operands whole and writes its result
            (n,) = group
            env[n] = np.asarray(lesson.numpy_op(n, *(env[i] for i in n.inputs)), n.dtype)
            read += sum(env[i].nbytes for i in n.inputs if i.op != "const")
            written += env[n].nbytes if n in writes else 0
            continue
        rows = m.prod(dom[0])
        args, seen = [], []
        for n in reads:
            ids = np.arange(m.prod(n.shape)).reshape(n.shape)
            pr, pc = lesson.per_row(n, dom), lesson.per_col(n, dom)
            seen.append(set())
            args.append(Recorder(lesson.row_view(env[n], n.shape, dom, pr, pc),
                                 lesson.row_view(ids, n.shape, dom, pr, pc), seen[-1]))
        outs = []
        for n in writes:
            env[n] = np.full(n.shape, np.nan, n.dtype)
            pr = lesson.per_row(n, dom)
            ids = np.arange(m.prod(n.shape)).reshape(n.shape)
            seen.append(set())
            outs.append(Recorder(env[n].reshape(rows, 1 if pr else dom[1]),
                                 ids.reshape(rows, 1 if pr else dom[1]), seen[-1]))
        scope = {**lesson.KERNEL_NAMES, "prange": range}
        exec(lesson.numba_source(g, group, "k"), scope)
        scope["k"](rows, dom[1], *args, *outs)
        sizes = [n.dtype.itemsize for n in reads + writes]
        counts = [len(s) * z for s, z in zip(seen, sizes)]
        read += sum(counts[:len(reads)])
        written += sum(counts[len(reads):])
    return (read, written), [env[o] for o in g.outputs]


@pytest.mark.exercise("14.7")
@pytest.mark.parametrize("fn,shapes", [
    (softmax_fn, [(7, 13)]), (layer_norm_fn, [(2, 5, 11), (11,), (11,)]), (chain_fn, [(9,), (9,)]),
    (mlp_block, [(5, 8), (8,), (8,), (8, 32), (32,), (32, 8), (8,)]),
    (lambda x, b: (x + b).exp().sum(axis=-1, keepdims=True) * x, [(4, 1, 6), (3, 6)]),
])
def test_bytes_counted_equal_bytes_touched(solo, fn, shapes):
    lesson = solo("14.7")
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s) for s in shapes]
    g = lesson.optimize(lesson.trace(fn, *arrays))
    plan = lesson.fuse(g)
    touched, outs = touched_bytes(lesson, g, plan, arrays)
    counted = lesson.plan_bytes(g, plan)
    assert counted == touched, (f"plan_bytes says (read, written) = {counted}, the generated kernels touch {touched}: "
                                "each kernel must read every element of each array it is given and write every "
                                "element of each output, and touch nothing else (constants are literals)")
    for got, want in zip(outs, eager(fn, *arrays)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    eager_bytes = sum(lesson.plan_bytes(g, lesson.eager_plan(g)))
    assert sum(counted) < eager_bytes, f"fusion should move fewer bytes than eager: fused {counted}, eager {eager_bytes}"


# ------------------------------------------------------------------ 14.6 memory planning
def deep_relu(x, w):
    for _ in range(4):
        x = (x @ w).relu()
    return x


def check_buffer_plan(lesson, g, plan, assign):
    """Every node written and not returned has a buffer; shared buffers hold values of the same size and
    dtype whose lifetimes (written by kernel d, last read by kernel u) do not overlap."""
    born, last = {}, {}
    for k, group in enumerate(plan):
        reads, writes = lesson.kernel_io(g, group)
        for n in writes:
            born[n] = k
        for n in reads:
            last[n] = k
    want = {n for n in born if n not in g.outputs}
    assert set(assign) == want, (f"buffers for {sorted(n.op for n in assign)}, expected one for each value a kernel "
                                 f"writes that the graph does not return: {sorted(n.op for n in want)}")
    by_buffer = {}
    for n, b in assign.items():
        by_buffer.setdefault(b, []).append(n)
    for b, nodes in by_buffer.items():
        nodes.sort(key=born.get)
        for p, q in zip(nodes, nodes[1:]):
            assert (p.nbytes, p.dtype) == (q.nbytes, q.dtype), f"buffer {b} holds {p} and {q}: other size or dtype"
            assert born[q] > last.get(p, born[p]), (
                f"buffer {b}: {q.op} (kernel {born[q]}) is written while {p.op} (kernel {born[p]}) is still read by "
                f"kernel {last.get(p)}: a live buffer reused")
    assert sorted(set(assign.values())) == list(range(len(by_buffer))), "buffers are numbered 0, 1, ..."
    return len(by_buffer)


@pytest.mark.exercise("14.6")
@pytest.mark.parametrize("fn,shapes,buffers", [
    (deep_relu, [(8, 16), (16, 16)], 2),
    (softmax_fn, [(7, 13)], 0),
    (lambda x, w: softmax_fn(x @ w) @ w.relu(), [(6, 6), (6, 6)], 3),
    (mlp_block, [(5, 8), (8,), (8,), (8, 32), (32,), (32, 8), (8,)], 3),
])
def test_plan_buffers_reuses_only_dead_values(solo, fn, shapes, buffers):
    lesson = solo("14.6")
    g = lesson.optimize(lesson.trace(fn, *(np.zeros(s) for s in shapes)))
    plan = lesson.fuse(g)
    got = check_buffer_plan(lesson, g, plan, lesson.plan_buffers(g, plan))
    assert got == buffers, f"expected {buffers} buffers (a buffer is reused as soon as its value is dead), got {got}"


@pytest.mark.exercise("14.7")
def test_buffers_in_the_runner_give_eager_numbers(solo):
    lesson = solo("14.7")
    rng = np.random.default_rng(6)
    for fn, shapes in [(deep_relu, [(8, 16), (16, 16)]), (lambda x, w: softmax_fn(x @ w) @ w.relu(), [(6, 6), (6, 6)])]:
        arrays = [0.3 * rng.standard_normal(s) for s in shapes]
        run = lesson.build_kernels(lesson.trace(fn, *arrays), source_fn=lesson.numba_source, parallel=False)
        for _ in range(2):  # the buffers are reused from call to call too
            np.testing.assert_allclose(run(*arrays)[0], eager(fn, *arrays)[0], rtol=1e-12, atol=1e-12)
    gm = lesson.optimize(lesson.trace(lambda x: (x.exp(), x.exp() * 2.0), np.zeros((3, 4))))
    assert lesson.plan_buffers(gm, lesson.fuse(gm)) == {}, "outputs go back to the caller: never in a buffer"


# ------------------------------------------------------------------ 14.7 robustness of the generated code
def broadcast_pair(draw_shape, flags):
    """A shape and a broadcast partner: axes set to 1 where flags say, leading axes dropped."""
    other = tuple(1 if f == 1 else s for s, f in zip(draw_shape, flags))
    drop = sum(1 for f in flags if f == 2)
    return other[min(drop, len(other)):]


@pytest.mark.exercise("14.7")
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
       flags=st.lists(st.integers(0, 2), min_size=3, max_size=3))
@example(shape=(0, 5), flags=[0, 0, 0])
@example(shape=(3, 0), flags=[0, 0, 0])
@example(shape=(1, 1), flags=[1, 1, 0])
@example(shape=(2, 1, 3), flags=[2, 1, 0])
@example(shape=(), flags=[0, 0, 0])
def test_compiled_equals_eager_on_edge_shapes(solo, shape, flags):
    lesson = solo("14.7")
    rng = np.random.default_rng(len(shape) * 7 + sum(shape))
    x = rng.standard_normal(shape)
    y = rng.standard_normal(broadcast_pair(shape, flags[:len(shape)]))
    fns = [(chain_fn, (x, y)), (lambda x, y: (x * y).sum(axis=-1, keepdims=True) + x, (x, y))]
    if shape and shape[-1] > 0:
        fns.append((lambda x, y: softmax_fn(x + y), (x, y)))
    for fn, args in fns:
        if not shape and fn is not chain_fn:
            continue
        run = lesson.build_kernels(lesson.trace(fn, *args), source_fn=lesson.numba_source, parallel=False)
        got, want = run(*args)[0], eager(fn, *args)[0]
        assert got.shape == want.shape, f"x {x.shape}, y {y.shape}: expected shape {want.shape}, got {got.shape}"
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"x {x.shape}, y {y.shape}")


@pytest.mark.exercise("14.7")
def test_compiled_runner_rejects_bad_input(solo):
    lesson = solo("14.7")
    x, w, b = np.zeros((4, 6)), np.ones(6), np.zeros(6)
    run = lesson.build_kernels(lesson.trace(layer_norm_fn, x, w, b), source_fn=lesson.numba_source, parallel=False)
    with pytest.raises(ValueError, match=r"\(5, 6\).*\(4, 6\)"):
        run(np.zeros((5, 6)), w, b)
    with pytest.raises(TypeError, match="float32.*float64"):
        run(x.astype(np.float32), w, b)
    with pytest.raises(ValueError, match="3 arrays"):
        run(x, w)


@pytest.mark.exercise("14.7")
def test_guards_trace_once_per_shape_and_dtype(solo):
    lesson = solo("14.7")
    traced = []

    def fn(x):
        if not isinstance(x, Tensor):  # a tracer's proxy, not the eager run below
            traced.append(x.shape)
        return softmax_fn(x) * 2.0

    f = lesson.Compiled(fn, backend=lambda g: lesson.build_kernels(g, source_fn=lesson.numba_source, parallel=False))
    rng = np.random.default_rng(8)
    for shape, dtype, traces in [((3, 5), np.float64, 1), ((3, 5), np.float64, 1), ((4, 5), np.float64, 2),
                                 ((3, 5), np.float32, 3), ((4, 5), np.float64, 3)]:
        x = rng.standard_normal(shape).astype(dtype)
        out = f(Tensor(x))
        assert len(traced) == traces, f"after a call with {shape} {np.dtype(dtype)}: {len(traced)} traces, expected {traces}"
        assert out.data.dtype == np.dtype(dtype), f"a {np.dtype(dtype)} input gave a {out.data.dtype} result"
        np.testing.assert_allclose(out.data, eager(fn, x)[0], rtol=1e-5 if dtype == np.float32 else 1e-12)


# ------------------------------------------------------------------ 14.8 CUDA C
def need_emulator():
    why = emulator_unavailable()
    if why is not None:
        pytest.skip(why)


@pytest.mark.exercise("14.8")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_kernels_on_the_emulator(solo, dtype):
    need_emulator()
    lesson = solo("14.8")
    rng = np.random.default_rng(9)
    x = rng.standard_normal((37, 11)).astype(dtype)
    w, b = rng.standard_normal(11).astype(dtype), rng.standard_normal(11).astype(dtype)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-5, atol=2e-6)
    for what, fn, args in [("softmax", softmax_fn, (x,)), ("layer norm", layer_norm_fn, (x, w, b)),
                           ("pointwise chain", chain_fn, (x, b)),
                           ("row sum", lambda x: (x.relu().sum(axis=-1) * 2.0 + 1.0) ** 0.5, (x,))]:
        run = lesson.cuda_runner(lesson.trace(fn, *args), source_fn=lesson.cuda_source, block=16)  # 3 blocks, the last one partly used
        got, want = run(*args)[0], eager(fn, *args)[0]
        assert got.shape == want.shape and got.dtype == want.dtype, \
            f"{what}: expected {want.shape} {want.dtype}, got {got.shape} {got.dtype}"
        np.testing.assert_allclose(got, want, **tol, err_msg=f"{what} ({np.dtype(dtype)}) on the emulator:\n{run.sources}")


@pytest.mark.exercise("14.8")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("shape", [(5, 7), (1, 3), (4, 1)])
def test_cuda_kernels_run_a_training_steps_backward(solo, shape):
    """The backward of a loss with relu and max (lesson 02's rules: step at relu's kink, a max's
    gradient split among ties) as CUDA C on the emulator: the loss and both gradients equal the
    tape to 1e-12 in float64, and the step and tie-mask ops are inside generated kernels."""
    need_emulator()
    lesson = solo("14.8")
    rng = np.random.default_rng(sum(shape))
    x = np.round(rng.standard_normal(shape))  # ties for the max, exact zeros at relu's kink
    y = rng.standard_normal(shape[-1:])

    def loss(x, y):
        h = (x * y).relu() + x.relu() * 0.5
        return full_sum(h * h) + full_sum(h.max(axis=-1))

    run = lesson.cuda_runner(lesson.grad_graph(lesson.trace(loss, x, y)), source_fn=lesson.cuda_source, block=4)
    value, dx, dy = run(x, y)
    xt, yt = Tensor(x, requires_grad=True), Tensor(y, requires_grad=True)
    want = loss(xt, yt)
    want.backward()
    np.testing.assert_allclose(value, want.data, rtol=1e-12, atol=1e-12, err_msg=f"loss, x {shape}")
    np.testing.assert_allclose(dx, xt.grad.data, rtol=1e-12, atol=1e-12, err_msg=f"d loss / d x, x {shape}")
    np.testing.assert_allclose(dy, yt.grad.data, rtol=1e-12, atol=1e-12, err_msg=f"d loss / d y, x {shape}")
    ops = {n.op for group in run.plan if lesson.domain(group) is not None for n in group}
    assert {"step", "eq"} <= ops, f"relu's step and max's tie mask should run inside generated kernels, got {ops}"


@pytest.mark.exercise("14.8")
def test_cuda_source_compiles_to_ptx(solo):
    lesson = solo("14.8")
    g = lesson.optimize(lesson.trace(layer_norm_fn, np.zeros((3, 5), np.float32), np.ones(5, np.float32),
                                     np.zeros(5, np.float32)))
    src = lesson.cuda_source(g, lesson.fuse(g)[0], "ln")
    assert 'extern "C" __global__ void ln(int rows, int C, const float* in0, const float* in1, const float* in2, ' \
           'float* out0)' in src, f"the kernel's signature:\n{src}"
    try:
        stats = ptx_stats(compile_ptx(src))
    except NvrtcUnavailable as exc:
        pytest.skip(str(exc))
    except Exception as exc:
        raise AssertionError(f"the generated CUDA C does not compile:\n{exc}\n{src}") from None
    assert stats.local_bytes == 0 and stats.bar_sync == 0 and stats.ld_shared == 0, \
        f"one thread per row needs no shared memory, barriers or local arrays: {stats}"


# ------------------------------------------------------------------ 14.9 autotuner
class FakeClock:
    """A timer under the test's control: each run of config c takes cost[c] 'seconds'."""

    def __init__(self):
        self.now, self.cost, self.current = 0.0, {}, None

    def __call__(self):
        return self.now

    def run_of(self, outputs):
        def run(config):
            self.now += self.cost[config]
            return outputs(config)
        return run


@pytest.mark.exercise("14.9")
def test_autotuner_measures_once_and_caches(solo):
    lesson = solo("14.9")
    clock = FakeClock()
    clock.cost = {8: 3.0, 16: 1.0, 32: 2.0}
    tuner = lesson.Autotuner(timer=clock, repeat=2)
    run = clock.run_of(lambda c: [np.arange(5.0)])
    assert tuner.tune(("k", (4, 5)), [8, 16, 32], run) == 16, "the fastest candidate wins"
    trials = tuner.trials
    assert trials == 6, f"3 candidates x repeat 2 timed runs, got trials = {trials}"
    before = clock.now
    assert tuner.tune(("k", (4, 5)), [8, 16, 32], run) == 16 and clock.now == before and tuner.trials == trials, \
        "a key seen before is answered from the cache without running anything"
    clock.cost = {8: 0.5, 16: 1.0, 32: 2.0}
    assert tuner.tune(("k", (9, 5)), [8, 16, 32], run) == 8, "another shape is another key: measured again"
    assert tuner.cache == {("k", (4, 5)): 16, ("k", (9, 5)): 8}
    bad = clock.run_of(lambda c: [np.arange(5.0) + (c == 32)])
    with pytest.raises(ValueError, match="32"):
        tuner.tune(("k", (2, 2)), [8, 16, 32], bad)


@pytest.mark.exercise("14.9")
def test_tuned_kernels_choose_a_candidate_and_keep_the_numbers(solo):
    lesson = solo("14.9")
    rng = np.random.default_rng(10)
    tuner = lesson.Autotuner()
    x = rng.standard_normal((33, 7))
    run = lesson.tuned_kernels(lesson.trace(softmax_fn, x), tuner, candidates=(0, 1, 4))
    first = run(x)[0]
    trials = tuner.trials
    np.testing.assert_allclose(first, eager(softmax_fn, x)[0], rtol=1e-12, atol=1e-12)
    assert len(run.choices) == 1 and set(run.choices.values()) <= {0, 1, 4}, f"choices: {run.choices}"
    np.testing.assert_array_equal(run(x)[0], first)
    assert tuner.trials == trials, "the same shape again: no measuring"


# ------------------------------------------------------------------ 14.7 the training step
def block_loss(x, ln_w, ln_b, w1, b1, w2, b2, target):
    d = mlp_block(x, ln_w, ln_b, w1, b1, w2, b2) - target
    return (d * d).sum(axis=-1).sum(axis=0) * 0.5


@pytest.mark.exercise("14.7")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rows,c", [(9, 8), (1, 8), (4, 3)])
def test_compiled_training_step_equals_the_tape(solo, rows, c):
    lesson = solo("14.7")
    rng = np.random.default_rng(rows * 31 + c)
    x, target = rng.standard_normal((rows, c)), rng.standard_normal((rows, c))
    params = block_params(c, seed=rows)
    step = lesson.compile_grad(block_loss, source_fn=lesson.numba_source, parallel=False)
    loss, grads = step(Tensor(x), *params, Tensor(target))
    leaves = [Tensor(x, requires_grad=True)] + [Tensor(p.data, requires_grad=True) for p in params]
    want = block_loss(*leaves, Tensor(target))
    want.backward()
    np.testing.assert_allclose(loss.data, want.data, rtol=1e-12, err_msg="the compiled loss")
    names = ["x", "ln_w", "ln_b", "w1", "b1", "w2", "b2", "target"]
    for name, got, leaf in zip(names, grads, leaves):
        assert got.shape == leaf.shape, f"d loss / d {name}: expected shape {leaf.shape}, got {got.shape}"
        np.testing.assert_allclose(got.data, leaf.grad.data, rtol=1e-12, atol=1e-12,
                                   err_msg=f"d loss / d {name} ({rows}x{c}): compiled vs lesson 02's tape")


def full_sum(v):
    while v.ndim:
        v = v.sum(axis=0)
    return v


def assert_compiled_grad_equals_tape(lesson, loss, x, y, where: str) -> None:
    """compile_grad(loss) at (x, y), Numba kernels on one thread: its value and both gradients equal
    lesson 02's tape to 1e-12 (a leaf the loss does not reach: a zero gradient); `where` describes the case."""
    value, grads = lesson.compile_grad(loss, source_fn=lesson.numba_source, parallel=False)(Tensor(x), Tensor(y))
    xt, yt = Tensor(x, requires_grad=True), Tensor(y, requires_grad=True)
    want = loss(xt, yt)
    want.backward()
    np.testing.assert_allclose(value.data, want.data, rtol=1e-12, atol=1e-12)
    for name, got, leaf in (("x", grads[0], xt), ("y", grads[1], yt)):
        expected = leaf.grad.data if leaf.grad is not None else np.zeros(leaf.shape)
        assert got.shape == leaf.shape, f"d loss / d {name}: expected shape {leaf.shape}, got {got.shape}"
        np.testing.assert_allclose(got.data, expected, rtol=1e-12, atol=1e-12, err_msg=f"d loss / d {name}, {where}")


@pytest.mark.exercise("14.7")
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple),
       flags=st.lists(st.integers(0, 2), min_size=3, max_size=3))
@example(shape=(1, 1), flags=[1, 1, 0])
@example(shape=(3, 0), flags=[0, 0, 0])
@example(shape=(2, 1, 3), flags=[2, 1, 0])
def test_compiled_gradients_equal_the_tape_on_edge_shapes(solo, shape, flags):
    lesson = solo("14.7")
    rng = np.random.default_rng(len(shape) * 5 + sum(shape))
    x = rng.standard_normal(shape)
    y = rng.standard_normal(broadcast_pair(shape, flags[:len(shape)]))

    def loss(x, y):
        h = (x * y + y).tanh() * x - y.exp() / (x * x + 1.0)
        return full_sum(h * h + (h - h.sum(axis=-1, keepdims=True) * 0.5))

    assert_compiled_grad_equals_tape(lesson, loss, x, y, f"x {x.shape}, y {y.shape}")


@pytest.mark.gpu
@pytest.mark.exercise("14.8")
def test_cuda_kernels_on_the_gpu(solo):
    lesson = solo("14.8")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1000, 37)).astype(np.float32)
    w, b = rng.standard_normal(37).astype(np.float32), rng.standard_normal(37).astype(np.float32)
    for what, fn, args in [("softmax", softmax_fn, (x,)), ("layer norm", layer_norm_fn, (x, w, b))]:
        run = lesson.cuda_runner(lesson.trace(fn, *args), source_fn=lesson.cuda_source, block=128, device="gpu")
        np.testing.assert_allclose(run(*args)[0], eager(fn, *args)[0], rtol=2e-5, atol=2e-6,
                                   err_msg=f"{what} on the GPU")


@pytest.mark.exercise("14.7")
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
       keepdims=st.booleans(), ties=st.booleans(), last=st.booleans())
@example(shape=(1,), keepdims=False, ties=False, last=True)
@example(shape=(3, 4), keepdims=True, ties=True, last=True)
@example(shape=(2, 3, 5), keepdims=False, ties=True, last=False)
def test_compiled_gradients_of_relu_and_max_equal_the_tape(solo, shape, keepdims, ties, last):
    """relu's and max's gradients (lesson 02's rules: 0 at relu's kink, a max's gradient split evenly
    among ties), on drawn shapes, a reduction over the last axis (fused) or the first (a library kernel)."""
    lesson = solo("14.7")
    rng = np.random.default_rng(sum(shape) * 3 + keepdims + 2 * ties)
    x = rng.standard_normal(shape)
    y = rng.standard_normal(shape[-1:])
    if ties:  # repeated values: ties for the max, exact zeros for relu
        x = np.round(x)
    axis = -1 if last else 0

    def loss(x, y):
        h = (x * y).relu() + x.relu() * 0.5
        m = h.max(axis=axis, keepdims=keepdims)
        s = (x - x.max(axis=-1, keepdims=True)).exp()
        return full_sum(m * m) + full_sum(s * y)

    assert_compiled_grad_equals_tape(lesson, loss, x, y,
                                     f"x {x.shape} (ties: {ties}), max over axis {axis}, keepdims={keepdims}")


@pytest.mark.exercise("14.7")
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_generated_exp_and_tanh_at_the_edges(solo, dtype):
    """The kernels' exp and tanh (vexp, vtanh: polynomials, not the C library) keep NumPy's values at
    the edges: -inf (a causal mask) gives 0, overflow inf, nan stays nan, tiny and huge arguments."""
    lesson = solo("14.7")
    x = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 1e-9, -1e-9, 0.5, -3.0, 20.0, -20.0, 88.0, -87.0, 100.0,
                  -100.0, 700.0, -700.0, 800.0, -800.0], dtype)
    fn = lambda x: (x.exp(), x.tanh())  # noqa: E731
    run = lesson.build_kernels(lesson.trace(fn, x), source_fn=lesson.numba_source, parallel=False)
    with np.errstate(over="ignore"):
        want_exp, want_tanh = np.exp(x), np.tanh(x)
    got_exp, got_tanh = run(x)
    tol = dict(rtol=1e-13, atol=0) if dtype == np.float64 else dict(rtol=1e-6, atol=0)
    normal = np.abs(want_exp) > np.finfo(dtype).tiny  # below it vexp gives 0, NumPy a subnormal
    np.testing.assert_allclose(got_exp[normal], want_exp[normal], **tol, err_msg=f"exp of {x[normal]}")
    assert np.all(got_exp[~normal & ~np.isnan(x)] <= np.finfo(dtype).tiny), f"exp of {x}: {got_exp}"
    np.testing.assert_allclose(got_tanh, want_tanh, rtol=0, atol=4 * np.finfo(dtype).eps, err_msg=f"tanh of {x}")
