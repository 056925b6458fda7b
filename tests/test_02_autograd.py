"""Lesson 02: autograd. Each VJP is tested on its own, against central differences computed
here in NumPy (float64) or against an independent NumPy construction, over shapes drawn by
hypothesis. The engine is tested through graphs whose VJPs are given (add, subtract), so every
exercise is graded by its own code only."""

import sys
import types
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.lesson02

H = 1e-6


def numeric_vjp(fn, x, g, h=H):
    """sum over outputs of g * d fn(x) / dx, by central differences on each element of x."""
    x = np.array(x, dtype=np.float64)
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + h
        up = np.sum(g * fn(x))
        flat[i] = saved - h
        down = np.sum(g * fn(x))
        flat[i] = saved
        gflat[i] = (up - down) / (2 * h)
    return grad


def close(got, expected, what, rtol=1e-5, atol=1e-7):
    got = np.asarray(got)
    assert got.shape == np.shape(expected), f"{what}: expected shape {np.shape(expected)}, got {got.shape}"
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=what)


# ---------------------------------------------------------------- 2.1 topological order

def fake_graph(n_nodes, edges_seed):
    rng = np.random.default_rng(edges_seed)
    nodes = []
    for i in range(n_nodes):
        k = int(rng.integers(0, min(i, 3) + 1))
        parents = tuple(nodes[j] for j in rng.choice(i, size=k, replace=False)) if i and k else ()
        nodes.append(types.SimpleNamespace(name=i, _parents=parents))
    return nodes


def reachable(root):
    seen, todo = {id(root): root}, [root]
    while todo:
        for p in todo.pop()._parents:
            if id(p) not in seen:
                seen[id(p)] = p
                todo.append(p)
    return seen


@pytest.mark.exercise("2.1")
@settings(max_examples=40)
@given(n=st.integers(1, 40), seed=st.integers(0, 10_000))
def test_topo_order_is_a_topological_order(lesson, n, seed):
    nodes = fake_graph(n, seed)
    root = nodes[-1]
    order = lesson.topo_order(root)
    ids = [id(x) for x in order]
    assert len(ids) == len(set(ids)), "each node must appear once"
    assert set(ids) == set(reachable(root)), "the order must hold exactly the nodes reachable from the root"
    assert order[-1] is root, "the root comes last"
    position = {id(x): i for i, x in enumerate(order)}
    for x in order:
        for p in x._parents:
            assert position[id(p)] < position[id(x)], f"node {p.name} must come before its child {x.name}"


@pytest.mark.exercise("2.1")
def test_topo_order_deep_graph_no_recursion_limit(lesson):
    x = types.SimpleNamespace(_parents=())
    node = x
    for _ in range(20_000):
        node = types.SimpleNamespace(_parents=(node, x))
    order = lesson.topo_order(node)
    assert len(order) == 20_001 and order[0] is x and order[-1] is node


def python_call_depth(fn, *args):
    """(fn(*args), the deepest nesting of Python calls during it): recursion shows up here."""
    depth = [0, 0]

    def profile(frame, event, arg):
        if event == "call":
            depth[0] += 1
            depth[1] = max(depth[1], depth[0])
        elif event == "return":
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return result, depth[1]


class CountingNode:
    """A graph node that counts how often its parents are looked at (each expansion does)."""

    def __init__(self, *parents):
        self._stored = parents
        self.reads = 0

    @property
    def _parents(self):
        self.reads += 1
        return self._stored


@pytest.mark.exercise("2.1")
def test_topo_order_is_iterative(lesson):
    node = CountingNode()
    for _ in range(600):
        node = CountingNode(node)
    order, depth = python_call_depth(lesson.topo_order, node)
    assert len(order) == 601 and order[-1] is node, "topo_order of a chain of 601 nodes"
    assert depth < 40, (f"topo_order nested {depth} Python calls deep on a chain of 601 nodes: it recurses "
                        f"(a deeper graph, or a lower recursion limit, breaks it). Use an explicit stack.")


@pytest.mark.exercise("2.1")
def test_topo_order_expands_each_node_once(lesson):
    # a ladder of 14 diamonds: 2**14 paths lead from the root to the bottom node
    bottom = node = CountingNode()
    nodes = [node]
    for _ in range(14):
        left, right = CountingNode(node), CountingNode(node)
        node = CountingNode(left, right)
        nodes += [left, right, node]
    order = lesson.topo_order(node)
    assert len(order) == len(nodes) and len({id(x) for x in order}) == len(nodes), \
        f"expected the {len(nodes)} nodes once each, got {len(order)} entries"
    worst = max(x.reads for x in nodes)
    assert worst <= 3, (f"a node's parents were looked up {worst} times (the bottom node: {bottom.reads}): nodes "
                        f"reached by many paths must be expanded once (keep a set of visited ids)")


@pytest.mark.exercise("2.1")
def test_backward_accumulates_reused_nodes(lesson):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4))
    x = lesson.Tensor(a, requires_grad=True)
    c = lesson.Tensor(rng.standard_normal((3, 4)))
    y = x + x             # 2x
    z = y - x + c         # x + c
    w = z + y + (z - c)   # 4x + c
    g = rng.standard_normal((3, 4))
    w.backward(g)
    close(x.grad.numpy(), 4 * g, "d/dx of 4x (x used five times)")
    w2 = (x + c) - c
    w2.backward(g)
    close(x.grad.numpy(), 5 * g, ".grad accumulates across backward calls")


@pytest.mark.exercise("2.1")
def test_backward_through_a_deep_chain(lesson):
    x = lesson.Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = x
    for _ in range(3000):
        y = y + x
    y.backward(np.ones(2))
    close(x.grad.numpy(), [3001.0, 3001.0], "3001 uses of x")


# ---------------------------------------------------------------- 2.2 elementwise VJPs

BINARY = {
    "mul_vjp": (lambda a, b: a * b, (-2, 2), (-2, 2)),
    "div_vjp": (lambda a, b: a / b, (-2, 2), (0.5, 2)),
    "pow_vjp": (lambda a, b: a ** b, (0.5, 2), (-2, 2)),
}
def sigmoid64(x):
    """The oracle: exp(-|x|) never overflows."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1, e) / (1 + e)


UNARY = {
    "exp_vjp": (np.exp, (-2, 2)),
    "log_vjp": (np.log, (0.2, 3)),
    "tanh_vjp": (np.tanh, (-3, 3)),
    "relu_vjp": (lambda x: np.maximum(x, 0), (-2, 2)),
    "sigmoid_vjp": (sigmoid64, (-4, 4)),
}
PAIRS = st.sampled_from([((3, 4), (3, 4)), ((5,), (5,)), ((2, 1, 3), (4, 1)), ((1,), (3, 2)), ((), (2, 3))])


@pytest.mark.exercise("2.2")
@pytest.mark.parametrize("name", list(BINARY))
@settings(max_examples=10)
@given(shapes=PAIRS, seed=st.integers(0, 1000))
def test_binary_vjps_match_central_differences(lesson, name, shapes, seed):
    fn, ra, rb = BINARY[name]
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(*ra, shapes[0]), rng.uniform(*rb, shapes[1])
    out = fn(a, b)
    g = rng.standard_normal(out.shape)
    A, B = np.broadcast_to(a, out.shape).copy(), np.broadcast_to(b, out.shape).copy()
    ga, gb = getattr(lesson, name)(g, a, b, out)
    close(np.broadcast_to(ga, out.shape), numeric_vjp(lambda t: fn(t, B), A, g), f"{name}: gradient of a",
          atol=1e-6)
    close(np.broadcast_to(gb, out.shape), numeric_vjp(lambda t: fn(A, t), B, g), f"{name}: gradient of b",
          atol=1e-6)


@pytest.mark.exercise("2.2")
@pytest.mark.parametrize("name", list(UNARY))
@settings(max_examples=10)
@given(shape=st.lists(st.integers(1, 4), max_size=3).map(tuple), seed=st.integers(0, 1000))
def test_unary_vjps_match_central_differences(lesson, name, shape, seed):
    fn, rx = UNARY[name]
    rng = np.random.default_rng(seed)
    x = rng.uniform(*rx, shape)
    x = np.where(np.abs(x) < 1e-3, 0.5, x)  # keep relu away from its kink
    out = fn(x)
    g = rng.standard_normal(out.shape)
    close(getattr(lesson, name)(g, x, out), numeric_vjp(fn, x, g), name, atol=1e-6)


@pytest.mark.exercise("2.2")
def test_elementwise_vjps_keep_float32_and_edge_cases(lesson):
    rng = np.random.default_rng(1)
    x = rng.uniform(0.5, 2, (3, 5)).astype(np.float32)
    g = rng.standard_normal((3, 5)).astype(np.float32)
    for name in UNARY:
        got = getattr(lesson, name)(g, x, UNARY[name][0](x).astype(np.float32))
        assert got.dtype == np.float32, f"{name}: float32 in must give float32 out, got {got.dtype}"
    assert lesson.relu_vjp(np.ones(3), np.array([-1.0, 0.0, 2.0]), np.array([0.0, 0.0, 2.0])).tolist() == [0, 0, 1], \
        "relu's derivative is 0 at x == 0"
    a = np.array([-2.0, 0.0, 3.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no log-of-negative warnings
        ga, gb = lesson.pow_vjp(np.ones(3), a, 2.0, a ** 2.0)
    close(ga, 2 * a, "d/da a**2")
    close(np.broadcast_to(gb, (3,)), [0.0, 0.0, 9 * np.log(3)], "d/db a**b is 0 where a <= 0")


def stable_derivatives():
    """name -> (forward, derivative, inputs where the forward is finite), all in float64."""
    big = np.array([-1000.0, -60.0, -0.5, 0.0, 0.5, 60.0, 1000.0])

    def dtanh(x):
        e = np.exp(-2 * np.abs(x))
        return 4 * e / (1 + e) ** 2

    def dsigmoid(x):
        e = np.exp(-np.abs(x))
        return e / (1 + e) ** 2

    return {
        "tanh_vjp": (np.tanh, dtanh, big),
        "sigmoid_vjp": (sigmoid64, dsigmoid, big),
        "exp_vjp": (np.exp, np.exp, np.array([-1000.0, -60.0, -0.5, 0.0, 60.0])),
        "log_vjp": (np.log, lambda x: 1 / x, np.array([1e-30, 0.5, 1e30])),
        "relu_vjp": (lambda x: np.maximum(x, 0), lambda x: (x > 0) * 1.0, np.array([-1e30, -0.5, 0.5, 1e30])),
    }


@pytest.mark.exercise("2.2")
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_vjps_are_finite_where_the_forward_is(lesson, dtype):
    """A backward that overflows where the forward does not (sigmoid's exp(-x) / (1 + exp(-x))**2
    at x = -1000) makes a stable op useless in a network."""
    for name, (fn, deriv, x64) in stable_derivatives().items():
        x = x64.astype(dtype)
        with np.errstate(over="ignore", under="ignore"):
            out = fn(x64).astype(dtype)
        g = np.linspace(0.5, 1.5, x.size).astype(dtype)
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            try:
                got = getattr(lesson, name)(g, x, out)
            except FloatingPointError as exc:
                raise AssertionError(f"{name} at x = {x.tolist()} ({np.dtype(dtype).name}): {exc} in the backward, "
                                     f"although the forward is finite there (reuse `out`)") from None
        got = np.asarray(got)
        assert got.dtype == dtype, f"{name}: {np.dtype(dtype).name} in must give {np.dtype(dtype).name} out, got {got.dtype}"
        want = g.astype(np.float64) * deriv(x.astype(np.float64))
        assert np.all(np.isfinite(got)), f"{name} at x = {x.tolist()}: expected finite gradients {want}, got {got}"
        # atol: 1 - out rounds to 0 once out is within an ulp of 1 (PyTorch's backward does the same)
        close(got, want, f"{name} at large |x| ({np.dtype(dtype).name})", rtol=1e-5 if dtype == np.float32 else 1e-9,
              atol=2 * float(np.finfo(dtype).eps))


@pytest.mark.exercise("2.2")
def test_pow_vjp_edge_cases_and_dtypes(lesson):
    """x ** 0 is the constant 1: gradient 0, also at x = 0 (PyTorch agrees); a Python number on
    either side must not promote float32 gradients to float64."""
    a = np.array([0.0, 0.0, 2.0], dtype=np.float32)
    g = np.ones(3, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ga, gb = lesson.pow_vjp(g, a, 0, np.ones(3, np.float32))
        ga2, _ = lesson.pow_vjp(g, a, np.zeros(3, np.float32), np.ones(3, np.float32))
    for what, got in (("b = 0 (a number)", ga), ("b = zeros (an array)", ga2)):
        assert np.all(np.isfinite(got)) and np.all(np.asarray(got) == 0), \
            f"d(a ** b)/da with {what} must be 0 everywhere, also at a = 0; got {np.asarray(got).tolist()}"
    x = np.array([0.5, 1.5, 3.0], dtype=np.float32)
    ga, gb = lesson.pow_vjp(g, x, 2, x ** 2)
    assert np.asarray(ga).dtype == np.float32, f"float32 ** 2: grad a must stay float32, got {np.asarray(ga).dtype}"
    close(ga, 2 * x.astype(np.float64), "d(x ** 2)/dx", rtol=1e-6)
    out = (2.0 ** x).astype(np.float32)
    ga, gb = lesson.pow_vjp(g, 2, x, out)
    assert np.asarray(gb).dtype == np.float32, f"2 ** float32: grad b must stay float32, got {np.asarray(gb).dtype}"
    close(gb, out * np.log(2.0), "d(2 ** x)/dx", rtol=1e-6)


@pytest.mark.exercise("2.2")
def test_tensor_sigmoid_forward_and_backward(lesson):
    """Tensor.sigmoid (lesson 01's stable forward) records sigmoid_vjp: both finite everywhere.
    (The node's own _vjp is called, so this exercise is graded without the engine of 2.1.)"""
    x = np.array([-1000.0, -745.0, -50.0, -1.0, 0.0, 1.0, 50.0, 1000.0])
    t = lesson.Tensor(x, requires_grad=True)
    g = np.linspace(0.5, 2.0, x.size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow anywhere, forward or backward
        out = t.sigmoid()
        (gx,) = out._vjp(g)
    s = sigmoid64(x)
    close(out.numpy(), s, "Tensor.sigmoid forward", rtol=1e-12, atol=0)
    close(gx, g * s * (1 - s), "Tensor.sigmoid backward", rtol=1e-9, atol=1e-300)
    t32 = lesson.Tensor(x.astype(np.float32), requires_grad=True)
    (g32,) = t32.sigmoid()._vjp(np.ones(x.size, np.float32))
    assert np.asarray(g32).dtype == np.float32 and np.all(np.isfinite(g32)), \
        f"float32 sigmoid gradient: expected finite float32, got {g32!r}"
    z = lesson.Tensor(np.array([0.0, 3.0]), requires_grad=True)
    gz = (z ** 0)._vjp(np.ones(2))[0]
    assert np.array_equal(np.asarray(gz), [0.0, 0.0]), f"d(x ** 0)/dx must be 0, also at x = 0; got {gz}"


@pytest.mark.exercise("2.2")
def test_tensor_ops_record_elementwise_vjps(lesson):
    rng = np.random.default_rng(2)
    a, b = rng.uniform(0.5, 2, (4, 3)), rng.uniform(0.5, 2, (4, 3))
    ta, tb = lesson.Tensor(a, requires_grad=True), lesson.Tensor(b, requires_grad=True)
    g = rng.standard_normal((4, 3))
    out = ta * tb
    ga, gb = out._vjp(g)
    close(ga, g * b, "(a * b)._vjp: grad a")
    close(gb, g * a, "(a * b)._vjp: grad b")
    (gx,) = (2.0 / ta)._vjp(g)
    close(gx, -2 * g / a ** 2, "(2 / a)._vjp")
    (gx,) = ta.tanh()._vjp(g)
    close(gx, g * (1 - np.tanh(a) ** 2), "tanh()._vjp")


# ---------------------------------------------------------------- 2.3 unbroadcast

@st.composite
def broadcast_pair(draw):
    """(shape, target): shape broadcasts to target."""
    target = tuple(draw(st.lists(st.integers(1, 4), max_size=4)))
    keep = draw(st.integers(0, len(target)))
    shape = tuple(1 if draw(st.booleans()) else n for n in target[len(target) - keep:])
    return shape, target


@pytest.mark.exercise("2.3")
@settings(max_examples=60)
@given(pair=broadcast_pair(), seed=st.integers(0, 1000))
def test_unbroadcast_sums_over_broadcast_positions(lesson, pair, seed):
    shape, target = pair
    g = np.random.default_rng(seed).standard_normal(target)
    size = int(np.prod(shape))
    # every output position that read input element i contributes g there: a scatter-add
    idx = np.broadcast_to(np.arange(size).reshape(shape), target).ravel()
    expected = np.bincount(idx, weights=g.ravel(), minlength=size).reshape(shape)
    got = lesson.unbroadcast(g, shape)
    close(got, expected, f"unbroadcast from {target} to {shape}", rtol=1e-10, atol=1e-12)


@pytest.mark.exercise("2.3")
def test_unbroadcast_keeps_dtype_and_rejects_bad_shapes(lesson):
    g = np.ones((2, 3, 4), dtype=np.float32)
    got = lesson.unbroadcast(g, (3, 1))
    assert got.shape == (3, 1) and got.dtype == np.float32 and np.all(got == 8), f"got {got!r}"
    for bad in [(2,), (5, 3, 4), (1, 2, 3, 4, 5), (3, 3)]:
        with pytest.raises(ValueError) as info:
            lesson.unbroadcast(g, bad)
        assert str(bad) in str(info.value) and "(2, 3, 4)" in str(info.value), f"name both shapes: {info.value}"
    # the wrong direction: the gradient has size 1 where the input does not (it cannot come from
    # broadcasting that input), so there is nothing to sum; it must not be broadcast up either
    small = np.ones((2, 1, 4), dtype=np.float32)
    for bad in [(2, 3, 4), (5, 2, 1, 4)]:
        with pytest.raises(ValueError) as info:
            lesson.unbroadcast(small, bad)
        assert str(bad) in str(info.value) and "(2, 1, 4)" in str(info.value), \
            f"unbroadcast of a (2, 1, 4) gradient to {bad}: name both shapes: {info.value}"


# ---------------------------------------------------------------- 2.4 reductions

AXES = [((3, 4, 5), (0,), False), ((3, 4, 5), (1, 2), True), ((3, 4, 5), (0, 1, 2), False),
        ((6,), (0,), True), ((2, 1, 3), (1,), False), ((4, 3), (), False)]


@pytest.mark.exercise("2.4")
@pytest.mark.parametrize("shape,axes,keepdims", AXES)
def test_sum_and_max_vjp_match_central_differences(lesson, shape, axes, keepdims):
    rng = np.random.default_rng(3)
    x = rng.permutation(np.arange(int(np.prod(shape)), dtype=np.float64)).reshape(shape) / 7  # no ties
    for name, fn in (("sum_vjp", np.sum), ("max_vjp", np.max)):
        out = fn(x, axis=axes, keepdims=keepdims)
        g = rng.standard_normal(np.shape(out))
        f = lambda t: fn(t, axis=axes, keepdims=keepdims)  # noqa: E731
        if name == "sum_vjp":
            got = lesson.sum_vjp(g, shape, axes, keepdims)
        else:
            got = lesson.max_vjp(g, x, out, axes, keepdims)
        close(got, numeric_vjp(f, x, g), f"{name}(axes={axes}, keepdims={keepdims})", atol=1e-6)
        got = np.asarray(got)
        got[...] = 0  # the gradient must be an array the engine may write into


@pytest.mark.exercise("2.4")
def test_max_vjp_splits_ties(lesson):
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    out = x.max(axis=1)
    got = lesson.max_vjp(np.array([6.0, 3.0]), x, out, (1,), False)
    close(got, [[0, 3, 3], [1, 1, 1]], "ties share the gradient evenly")


@pytest.mark.exercise("2.4")
def test_reduction_vjps_keep_float32(lesson):
    x = np.array([[1.0, 3.0, 3.0], [2.0, 5.0, 4.0]], dtype=np.float32)
    g = np.array([1.0, 2.0], dtype=np.float32)
    for name, got in (("sum_vjp", lesson.sum_vjp(g, x.shape, (1,), False)),
                      ("max_vjp", lesson.max_vjp(g, x, x.max(axis=1), (1,), False))):
        assert np.asarray(got).dtype == np.float32, (f"{name}: a float32 gradient must stay float32, got "
                                                     f"{np.asarray(got).dtype} (an int64 count promotes to float64)")


@pytest.mark.exercise("2.4")
def test_tensor_reductions_record_vjps(lesson):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    t = lesson.Tensor(a, requires_grad=True)
    g = rng.standard_normal(5).astype(np.float32)
    (gm,) = t.mean(axis=0)._vjp(g)
    close(gm, np.broadcast_to(g / 3, (3, 5)), "mean(axis=0)._vjp", rtol=1e-6)
    assert gm.dtype == np.float32, f"mean's gradient of float32 must stay float32, got {gm.dtype}"
    (gs,) = t.sum(axis=-1, keepdims=True)._vjp(np.ones((3, 1), dtype=np.float32))
    close(gs, np.ones((3, 5)), "sum(axis=-1, keepdims=True)._vjp")


# ---------------------------------------------------------------- 2.5 matmul

@st.composite
def matmul_shapes(draw):
    m, k, n = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    ba = tuple(1 if draw(st.booleans()) else d for d in batch)[draw(st.integers(0, len(batch))):]
    bb = tuple(1 if draw(st.booleans()) else d for d in batch)[draw(st.integers(0, len(batch))):]
    a_shape = (k,) if draw(st.integers(0, 5)) == 0 else ba + (m, k)
    b_shape = (k,) if draw(st.integers(0, 5)) == 0 else bb + (k, n)
    return a_shape, b_shape


def reduce_to(full, shape):
    """Sum `full` down to `shape` (the oracle's own unbroadcast)."""
    while full.ndim > len(shape):
        full = full.sum(axis=0)
    for i, n in enumerate(shape):
        if n == 1 and full.shape[i] != 1:
            full = full.sum(axis=i, keepdims=True)
    return full


@pytest.mark.exercise("2.5")
@settings(max_examples=60)
@given(shapes=matmul_shapes(), seed=st.integers(0, 1000))
def test_matmul_vjp_matches_central_differences(lesson, shapes, seed):
    a_shape, b_shape = shapes
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    out = np.matmul(a, b)
    g = rng.standard_normal(out.shape)
    ga, gb = lesson.matmul_vjp(g, a, b, np.matmul)
    for what, got, x, fn in (("grad a", ga, a, lambda t: np.matmul(t, b)), ("grad b", gb, b, lambda t: np.matmul(a, t))):
        got = np.asarray(got)
        expected = numeric_vjp(fn, x, g)
        own = min(x.ndim, 2)  # the operand's own matrix (or vector) dims; batch dims may be broadcast
        assert got.shape[got.ndim - own:] == x.shape[x.ndim - own:], \
            f"{what} for {a_shape} @ {b_shape}: got shape {got.shape}"
        close(reduce_to(got, x.shape), expected, f"{what} for {a_shape} @ {b_shape}", atol=1e-6)


@pytest.mark.exercise("2.5")
def test_matmul_vjp_uses_the_given_matmul(lesson):
    calls = []

    def counting(x, y):
        calls.append((x.shape, y.shape))
        return np.matmul(x, y)

    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2, 5, 3)), rng.standard_normal((3, 4))
    lesson.matmul_vjp(rng.standard_normal((2, 5, 4)), a, b, counting)
    assert len(calls) == 2, f"both products must go through the backend's matmul (lesson 06 kernels); calls: {calls}"


@pytest.mark.exercise("2.5")
def test_matmul_vjp_keeps_float32(lesson):
    rng = np.random.default_rng(11)
    for sa, sb in (((2, 5, 3), (3, 4)), ((3,), (3, 4)), ((5, 3), (3,))):
        a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
        g = rng.standard_normal(np.matmul(a, b).shape).astype(np.float32)
        for what, got in zip(("grad a", "grad b"), lesson.matmul_vjp(g, a, b, np.matmul)):
            assert np.asarray(got).dtype == np.float32, f"{what} of {sa} @ {sb} in float32: got {np.asarray(got).dtype}"


@pytest.mark.exercise("2.5")
def test_tensor_matmul_records_vjp(lesson):
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((7, 3)), rng.standard_normal((3, 5))
    ta, tb = lesson.Tensor(a, requires_grad=True), lesson.Tensor(b, requires_grad=True)
    g = rng.standard_normal((7, 5))
    ga, gb = (ta @ tb)._vjp(g)
    close(ga, g @ b.T, "(A @ B)._vjp: grad A")
    close(gb, a.T @ g, "(A @ B)._vjp: grad B")


# ---------------------------------------------------------------- 2.6 logsumexp, softmax

def np_lse(x, axis, keepdims=False):
    m = np.max(x, axis=axis, keepdims=True)
    r = m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))
    return r if keepdims else np.squeeze(r, axis=axis)


@pytest.mark.exercise("2.6")
@pytest.mark.parametrize("axis,keepdims", [(-1, False), (0, True), ((0, 2), False), (None, False), (1, True)])
def test_logsumexp_values_and_vjp(lesson, axis, keepdims):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 5)) * 3
    t = lesson.Tensor(x, requires_grad=True)
    out = lesson.logsumexp(t, axis=axis, keepdims=keepdims)
    ax = tuple(range(3)) if axis is None else axis
    close(out.numpy(), np_lse(x, ax, keepdims), f"logsumexp(axis={axis}, keepdims={keepdims})", rtol=1e-12)
    g = rng.standard_normal(out.shape)
    (gx,) = out._vjp(g)
    close(gx, numeric_vjp(lambda v: np_lse(v, ax, keepdims), x, g), "logsumexp backward", atol=1e-6)


@pytest.mark.exercise("2.6")
def test_logsumexp_is_stable(lesson):
    x = np.array([[1000.0, 1001.0, 1002.0], [-1000.0, -1001.0, -1002.0], [-np.inf, 0.0, 88.0]], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = lesson.logsumexp(lesson.Tensor(x), axis=-1).numpy()
    assert out.dtype == np.float32, f"float32 in must give float32 out, got {out.dtype}"
    close(out, np_lse(x.astype(np.float64), -1).astype(np.float32), "logsumexp of large logits", rtol=1e-6)
    allneg = lesson.logsumexp(lesson.Tensor(np.full((2, 3), -np.inf)), axis=-1).numpy()
    assert np.all(allneg == -np.inf), f"a row of -inf has logsumexp -inf, got {allneg}"


@pytest.mark.exercise("2.6")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_logsumexp_backward_is_stable(lesson, dtype):
    """The forward subtracts the max; the backward must not undo it (exp(x) / exp(lse) = inf / inf)."""
    # float32: an ulp of 1000 is 6e-5, so x - lse carries a relative error of about 1e-4
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1003.0, -1001.0], [-np.inf, 0.0, 88.0]], dtype=dtype)
    t = lesson.Tensor(x, requires_grad=True)
    out = lesson.logsumexp(t, axis=-1)
    g = np.array([1.0, 2.0, 0.5], dtype=dtype)
    with np.errstate(over="raise", invalid="raise"):
        try:
            (gx,) = out._vjp(g)
        except FloatingPointError as exc:
            raise AssertionError(f"logsumexp backward at logits of size 1000: {exc} (use exp(x - out))") from None
    gx = np.asarray(gx)
    assert gx.dtype == dtype, f"logsumexp backward: {np.dtype(dtype).name} in must give {np.dtype(dtype).name}, got {gx.dtype}"
    x64 = x.astype(np.float64)
    want = g[:, None].astype(np.float64) * np.exp(x64 - np_lse(x64, -1, keepdims=True))
    assert np.all(np.isfinite(gx)), f"logsumexp backward at large logits must be finite (softmax), got {gx}"
    close(gx, want, "logsumexp backward at large logits", rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-30)


@pytest.mark.exercise("2.6")
def test_axis_errors_are_the_course_messages(lesson):
    t = lesson.Tensor(np.zeros((2, 3)), requires_grad=True)
    close(lesson.logsumexp(t, axis=1).numpy(), np.full(2, np.log(3)), "logsumexp of zeros((2, 3)) over axis 1")
    calls = {"logsumexp": lambda ax: lesson.logsumexp(t, axis=ax), "softmax": lambda ax: lesson.softmax(t, axis=ax),
             "log_softmax": lambda ax: lesson.log_softmax(t, axis=ax)}
    for name, call in calls.items():
        for bad, error in ((3, ValueError), (-3, ValueError), (1.0, TypeError)):
            with pytest.raises(error) as info:
                call(bad)
            assert not isinstance(info.value, np.exceptions.AxisError) and "iterable" not in str(info.value), \
                (f"{name}(x, axis={bad!r}) leaked {type(info.value).__name__}: {info.value}; check the axis with "
                 f"normalize_axis before handing it to the array module")


@pytest.mark.exercise("2.6")
def test_softmax_and_log_softmax_values(lesson):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((4, 7)) * 50).astype(np.float32)
    x[0, 0] = 500.0
    for axis in (-1, 0):
        sm = lesson.softmax(lesson.Tensor(x), axis=axis).numpy()
        x64 = x.astype(np.float64)
        ref = np.exp(x64 - np_lse(x64, axis, keepdims=True))
        close(sm, ref, f"softmax(axis={axis})", rtol=1e-5, atol=1e-30)
        close(sm.sum(axis=axis), np.ones(x.shape[1 - axis % 2]), "softmax sums to 1", rtol=1e-5)
        lsm = lesson.log_softmax(lesson.Tensor(x), axis=axis).numpy()
        close(lsm, x64 - np_lse(x64, axis, keepdims=True), f"log_softmax(axis={axis})", rtol=1e-5, atol=1e-3)
        assert np.all(np.isfinite(lsm)), "log_softmax must be finite for finite logits"


# ---------------------------------------------------------------- 2.7 numerical_grad

@pytest.mark.exercise("2.7")
def test_numerical_grad_against_hand_derived_gradients(lesson):
    rng = np.random.default_rng(9)
    T = lesson.Tensor
    x, y = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    A, B = rng.standard_normal((2, 3)), rng.standard_normal((3, 5))
    cases = [
        ("sum(x * y)", lambda x, y: (x * y).sum(), (x, y), [y, x]),
        ("sum(x ** 3)", lambda x: (x ** 3).sum(), (x,), [3 * x ** 2]),
        ("sum(tanh(x))", lambda x: x.tanh().sum(), (x,), [1 - np.tanh(x) ** 2]),
        ("sum(A @ B)", lambda A, B: (A @ B).sum(), (A, B), [np.ones((2, 5)) @ B.T, A.T @ np.ones((2, 5))]),
        ("mean(exp(x)) / y[0, 0]", lambda x, y: x.exp().mean() / y[0, 0], (x, y),
         [np.exp(x) / 12 / y[0, 0], np.where(np.arange(12).reshape(3, 4) == 0, -np.exp(x).mean() / y[0, 0] ** 2, 0)]),
    ]
    for what, f, inputs, expected in cases:
        got = lesson.numerical_grad(f, *inputs)
        assert isinstance(got, list) and len(got) == len(inputs), f"{what}: expected a list of {len(inputs)} arrays"
        for k, (gk, ek) in enumerate(zip(got, expected)):
            assert isinstance(gk, np.ndarray) and gk.dtype == np.float64, f"{what}: gradients are float64 arrays"
            close(gk, ek, f"{what}: input {k}", rtol=1e-6, atol=1e-7)
    # the inputs are left untouched, and Tensor inputs work
    x0 = x.copy()
    got = lesson.numerical_grad(lambda x: (x * x).sum(), T(x))
    close(got[0], 2 * x0, "numerical_grad of a Tensor input", rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(x, x0, err_msg="numerical_grad must not modify its inputs")


@pytest.mark.exercise("2.7")
def test_numerical_grad_uses_eps(lesson):
    """For x**3 the central difference is exactly 3x^2 + eps^2: the eps argument must be the step."""
    x = np.array([0.5, -1.0, 2.0])
    for eps in (0.1, 1e-3):
        got = lesson.numerical_grad(lambda t: (t ** 3).sum(), x, eps=eps)[0]
        close(got, 3 * x ** 2 + eps ** 2, f"numerical_grad of sum(x**3) with eps={eps} (3x^2 + eps^2)",
              rtol=1e-7, atol=1e-9)


@pytest.mark.exercise("2.7")
def test_numerical_grad_runs_in_float64(lesson):
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    seen = []

    def f(t):
        seen.append(t.dtype)
        return (t.exp()).sum()

    got = lesson.numerical_grad(f, x, eps=1e-6)
    assert all(d == np.float64 for d in seen), f"f must be evaluated in float64, saw {set(map(str, seen))}"
    close(got[0], np.exp(x.astype(np.float64)), "d/dx sum(exp(x)) from float32 input", rtol=1e-7)
    assert len(seen) == 6, f"central differences need 2 evaluations per element (6 here), made {len(seen)}"
