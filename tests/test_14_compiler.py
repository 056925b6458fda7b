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

from minitorch.autograd import Tensor

pytestmark = pytest.mark.lesson14

EXERCISES = {"14.1": ("infer_meta", "broadcast_shapes"), "14.2": ("guard_key", "Compiled"),
             "14.3": ("dce", "cse"), "14.4": ("fold_constants", "simplify"),
             "14.5": ("fuse", "kernel_io"), "14.6": ("numba_source",)}


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
@pytest.mark.exercise("14.6")
@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 6), c=st.integers(1, 9), dtype=st.sampled_from([np.float64, np.float32]))
@example(rows=1, c=1, dtype=np.float64)
def test_generated_kernels_equal_eager(solo, rows, c, dtype):
    lesson = solo("14.6")
    rng = np.random.default_rng(rows * 10 + c)
    x = rng.standard_normal((rows, c)).astype(dtype)
    w, b = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-5, atol=2e-6)
    for fn, args in [(softmax_fn, (x,)), (layer_norm_fn, (x, w, b)), (chain_fn, (x, b)),
                     (lambda x: x.sum(axis=-1) * 2.0, (x,))]:
        run = lesson.build_kernels(lesson.trace(fn, *args), source_fn=lesson.numba_source)
        got = run(*args)[0]
        want = fn(*(Tensor(a) for a in args)).data
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, **tol)


@pytest.mark.exercise("14.6")
def test_source_is_one_loop_nest_per_group(solo):
    lesson = solo("14.6")
    g = lesson.optimize(lesson.trace(softmax_fn, np.zeros((3, 5))))
    src = lesson.numba_source(g, lesson.fuse(g)[0], "k")
    assert src.startswith("def k(rows, C, in0, out0):"), src
    assert src.count("for r in range") == 1 and src.count("for c in range") == 3, \
        f"a softmax: one loop over rows, three over columns (max, sum, output):\n{src}"
    compile(src, "<k>", "exec")


@pytest.mark.exercise("14.6")
@pytest.mark.timeout(120)
def test_compile_mlp_block_equals_eager(solo):
    lesson = solo("14.6")
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
