"""Lesson 03: training. Oracles are NumPy in float64; optimiser updates are checked against
hand-computed numbers and a NumPy re-implementation over several steps. Every exercise is
graded on its own: the tests build Parameters and modules directly (given code), and the
training-loop test brings its own model, loss and optimiser."""

import numpy as np
import pytest

from minitorch.autograd import Tensor, log_softmax
from minitorch.tensor import use_backend

pytestmark = pytest.mark.lesson03


def arrays_in(obj):
    """Every NumPy array held by obj's attributes (inside lists, tuples and dicts too)."""
    found, todo = [], list(vars(obj).values())
    while todo:
        x = todo.pop()
        if isinstance(x, np.ndarray):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return found


def check_optimizer_state(opt, params, what):
    """The update is in place (p.data is the same array before and after) and every state array
    has the dtype of the parameter of its shape (the test's parameters have distinct shapes)."""
    dtypes = {tuple(p.shape): p.dtype for p in params}
    for a in arrays_in(opt):
        if a.shape in dtypes:
            assert a.dtype == dtypes[a.shape], (f"{what}: optimizer state of shape {a.shape} is {a.dtype}, but its "
                                                f"parameter is {dtypes[a.shape]} (create it with xp.zeros_like(p.data))")


def grad_of(t):
    assert t.grad is not None, "expected a gradient after backward(), got .grad = None"
    return np.asarray(t.grad.numpy(), dtype=np.float64)


def set_grad(lesson, p, g):
    """Give Parameter p the gradient g through backward (no knowledge of Tensor internals)."""
    p.zero_grad()
    (p * Tensor(np.asarray(g, dtype=p.dtype))).sum().backward()


# ---------------------------------------------------------------- 3.1 parameter discovery


def build_tree(lesson):
    M, P = lesson.Module, lesson.Parameter

    class Leaf(M):
        def __init__(self, n):
            self.weight = P(np.full((n, 2), float(n), np.float32))
            self.bias = P(np.zeros(2, np.float32))

    class Net(M):
        def __init__(self):
            self.scale = P(np.ones(1, np.float32))
            self.encoder = Leaf(3)
            self.blocks = [Leaf(4), Leaf(5)]
            self.pair = (Leaf(6),)
            self.heads = {"q": Leaf(7), "k": Leaf(8)}
            self.buffer = Tensor(np.ones(3, np.float32), requires_grad=True)  # a Tensor, not a Parameter
            self.derived = self.scale * 2.0  # computed from a Parameter: a Tensor that requires grad
            self.table = np.ones(4)
            self.depth = 3
            self.name = "net"

    return Net()


@pytest.mark.exercise("3.1")
def test_named_parameters_names_and_order(lesson):
    net = build_tree(lesson)
    names = [n for n, _ in net.named_parameters()]
    expected = ["scale", "encoder.weight", "encoder.bias", "blocks.0.weight", "blocks.0.bias",
                "blocks.1.weight", "blocks.1.bias", "pair.0.weight", "pair.0.bias",
                "heads.q.weight", "heads.q.bias", "heads.k.weight", "heads.k.bias"]
    assert names == expected, f"expected names (in attribute order)\n  {expected}\ngot\n  {names}"
    pairs = net.named_parameters()
    assert pairs[3][1] is net.blocks[0].weight, "named_parameters must return the Parameter objects themselves"
    assert all(isinstance(p, lesson.Parameter) for _, p in pairs)
    params = net.parameters()
    assert len(params) == len(pairs) and all(a is b for (_, a), b in zip(pairs, params)), \
        "parameters() must return the same Parameters, in the same order, as named_parameters()"
    prefixed = [n for n, _ in net.encoder.named_parameters(prefix="enc")]
    assert prefixed == ["enc.weight", "enc.bias"], f"prefix='enc' should give ['enc.weight', 'enc.bias'], got {prefixed}"


@pytest.mark.exercise("3.1")
def test_named_parameters_shared_once(lesson):
    M, P = lesson.Module, lesson.Parameter

    class Block(M):
        def __init__(self):
            self.w = P(np.ones((2, 2), np.float32))

    class Tied(M):
        def __init__(self):
            self.embed = P(np.ones((5, 3), np.float32))
            self.first = Block()
            self.again = self.first                # the same block twice
            self.layers = [self.first, Block()]
            self.unembed = self.embed              # weight tying
            self.parent_ref = None

    net = Tied()
    net.layers[1].parent_ref = net  # a cycle: a child that refers back to its parent
    names = [n for n, _ in net.named_parameters()]
    assert names == ["embed", "first.w", "layers.1.w"], (
        "a Parameter or Module reachable twice must be reported once, under the first name; "
        f"expected ['embed', 'first.w', 'layers.1.w'], got {names}")
    assert len(net.parameters()) == 3


@pytest.mark.exercise("3.1")
def test_zero_grad_reaches_nested_parameters(lesson):
    net = build_tree(lesson)
    loss = None
    for _, p in net.named_parameters():
        term = p.sum()
        loss = term if loss is None else loss + term
    loss.backward()
    assert net.heads["k"].weight.grad is not None
    net.zero_grad()
    for name, p in net.named_parameters():
        assert p.grad is None or not np.any(p.grad.numpy()), f"zero_grad left a gradient on {name}"


# ---------------------------------------------------------------- 3.2 Linear + init


@pytest.mark.exercise("3.2")
def test_init_std(lesson):
    cases = [(("he", 50, 7), np.sqrt(2 / 50)), (("glorot", 50, 7), np.sqrt(2 / 57)),
             (("lecun", 50, 7), np.sqrt(1 / 50)), ((0.37, 50, 7), 0.37), ((1, 3, 3), 1.0)]
    for args, want in cases:
        got = lesson.init_std(*args)
        assert np.isclose(got, want, rtol=1e-12), f"init_std{args}: expected {want:.6g}, got {got}"
    with pytest.raises(ValueError, match="xavier"):
        lesson.init_std("xavier", 4, 4)


@pytest.mark.exercise("3.2")
def test_linear_init_statistics(lesson):
    lin = lesson.Linear(301, 203, rng=np.random.default_rng(0))
    w = lin.weight.numpy()
    assert isinstance(lin.weight, lesson.Parameter) and isinstance(lin.bias, lesson.Parameter), \
        "weight and bias must be Parameters (so the optimiser finds them)"
    assert w.shape == (301, 203), f"weight shape: expected (in, out) = (301, 203), got {w.shape}"
    assert w.dtype == np.float32, f"weight dtype: expected float32, got {w.dtype}"
    assert lin.bias.shape == (203,) and not np.any(lin.bias.numpy()), "bias: expected zeros of shape (203,)"
    want = np.sqrt(2 / 301)
    assert abs(w.std() / want - 1) < 0.03, f"He init: weight std should be sqrt(2/301) = {want:.4f}, got {w.std():.4f}"
    assert abs(w.mean()) < 0.002, f"weights should have mean ~0, got {w.mean():.4f}"
    g = lesson.Linear(301, 203, rng=np.random.default_rng(1), init="glorot").weight.numpy()
    assert abs(g.std() / np.sqrt(2 / 504) - 1) < 0.03, f"glorot: std should be {np.sqrt(2 / 504):.4f}, got {g.std():.4f}"
    s = lesson.Linear(64, 32, rng=np.random.default_rng(2), init=0.01).weight.numpy()
    assert abs(s.std() / 0.01 - 1) < 0.05, f"init=0.01: std should be 0.01, got {s.std():.5f}"
    again = lesson.Linear(301, 203, rng=np.random.default_rng(0)).weight.numpy()
    assert np.array_equal(w, again), "the same rng seed must give the same weights (draw them from `rng`)"
    nob = lesson.Linear(5, 3, bias=False, rng=np.random.default_rng(0))
    assert nob.bias is None, "bias=False: expected .bias = None"


@pytest.mark.exercise("3.2")
def test_linear_lives_on_its_device(lesson, test_helper):
    strict = test_helper("strict_device")
    with use_backend("strict", strict.StrictBackend()):
        lin = lesson.Linear(6, 4, rng=np.random.default_rng(5), device="strict")
        for name in ("weight", "bias"):
            p = getattr(lin, name)
            assert p.device == "strict" and isinstance(p.data, strict.DeviceArray), \
                f"Linear(..., device='strict').{name} must be created on that device, got device {p.device!r}"
        x = np.random.default_rng(6).standard_normal((3, 6)).astype(np.float32)
        for what, inp in (("a Tensor on the device", Tensor(x, device="strict")), ("a NumPy array", x)):
            y = lin(inp)
            assert y.device == "strict", f"Linear on the 'strict' device with {what} as input: output on {y.device!r}"
            np.testing.assert_allclose(y.numpy(), x @ lin.weight.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.exercise("3.2")
def test_linear_forward_backward(lesson):
    rng = np.random.default_rng(3)
    lin = lesson.Linear(13, 5, rng=rng)
    lin.bias.data[...] = rng.standard_normal(5).astype(np.float32)  # non-zero bias, to see it added
    W, b = lin.weight.numpy().astype(np.float64), lin.bias.numpy().astype(np.float64)
    x = rng.standard_normal((7, 13)).astype(np.float32)
    xt = Tensor(x, requires_grad=True)
    y = lin(xt)
    want = x.astype(np.float64) @ W + b
    assert tuple(y.shape) == (7, 5), f"expected output shape (7, 5), got {tuple(y.shape)}"
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5, err_msg="Linear forward != x @ W + b")
    g = rng.standard_normal((7, 5))
    (y * Tensor(g.astype(np.float32))).sum().backward()
    np.testing.assert_allclose(grad_of(lin.weight), x.T.astype(np.float64) @ g, rtol=1e-4, atol=1e-4,
                               err_msg="dL/dW should be x.T @ dL/dy")
    np.testing.assert_allclose(grad_of(lin.bias), g.sum(0), rtol=1e-4, atol=1e-4, err_msg="dL/db should be dL/dy summed over the batch")
    np.testing.assert_allclose(grad_of(xt), g @ W.T, rtol=1e-4, atol=1e-4, err_msg="dL/dx should be dL/dy @ W.T")
    x3 = rng.standard_normal((2, 3, 13)).astype(np.float32)
    y3 = lin(Tensor(x3))
    np.testing.assert_allclose(y3.numpy(), x3.astype(np.float64) @ W + b, rtol=1e-5, atol=1e-5,
                               err_msg="Linear on a (2, 3, 13) input (batch dims broadcast)")
    y_np = lin(x)  # a NumPy input is wrapped in a Tensor
    np.testing.assert_allclose(y_np.numpy(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"13.*\(7, 12\)|\(7, 12\).*13"):
        lin(Tensor(np.ones((7, 12), np.float32)))


# ---------------------------------------------------------------- 3.3 cross-entropy


def ce_oracle(z, t):
    z = z.astype(np.float64)
    m = z.max(1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(1))
    loss = np.mean(lse - z[np.arange(len(t)), t])
    p = np.exp(z - lse[:, None])
    p[np.arange(len(t)), t] -= 1
    return loss, p / len(t)


@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("n,c,scale,dtype", [(37, 11, 3.0, np.float32), (1, 2, 1.0, np.float32),
                                             (64, 3, 0.1, np.float32), (33, 7, 5.0, np.float64)])
def test_cross_entropy_matches_numpy(lesson, n, c, scale, dtype):
    rng = np.random.default_rng(n + c)
    z = (scale * rng.standard_normal((n, c))).astype(dtype)
    t = rng.integers(0, c, n)
    logits = Tensor(z, requires_grad=True)
    loss = lesson.cross_entropy(logits, t)
    want, dz = ce_oracle(z, t)
    assert loss.size == 1, f"cross_entropy must return a scalar, got shape {tuple(loss.shape)}"
    rtol, atol = (1e-5, 1e-6) if dtype == np.float32 else (1e-12, 1e-15)  # float64 must not round through float32
    assert loss.dtype == dtype, f"float {np.dtype(dtype).name} logits must give a {np.dtype(dtype).name} loss, got {loss.dtype}"
    assert np.isclose(loss.item(), want, rtol=rtol, atol=atol), f"loss: expected {want:.15g}, got {loss.item():.15g}"
    loss.backward()
    np.testing.assert_allclose(grad_of(logits), dz, rtol=rtol * 10, atol=atol,
                               err_msg="d loss / d logits should be (softmax - onehot) / N")


@pytest.mark.exercise("3.3")
def test_cross_entropy_huge_logits(lesson):
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((9, 6)) * 1e4).astype(np.float32)
    z[3] -= 5e4   # a row of very negative logits (underflow of a naive sum)
    z[5] += 5e4   # a row of very positive logits (overflow of a naive exp)
    t = rng.integers(0, 6, 9)
    logits = Tensor(z, requires_grad=True)
    loss = lesson.cross_entropy(logits, t)
    assert np.isfinite(loss.item()), f"loss must be finite for logits of size 1e4, got {loss.item()} (subtract the row max)"
    want, dz = ce_oracle(z, t)
    assert np.isclose(loss.item(), want, rtol=1e-5), f"loss: expected {want:.2f}, got {loss.item():.2f}"
    loss.backward()
    g = grad_of(logits)
    assert np.all(np.isfinite(g)), "gradient contains inf/nan for large logits"
    np.testing.assert_allclose(g, dz, atol=1e-6)


@pytest.mark.exercise("3.3")
def test_cross_entropy_is_built_from_primitive_ops(lesson):
    """The exercise is the log-sum-exp trick itself: the graph must hold exp, sum and log nodes,
    not lesson 02's fused logsumexp node (which log_softmax and softmax use)."""
    z = Tensor(np.random.default_rng(9).standard_normal((4, 3)).astype(np.float32), requires_grad=True)
    loss = lesson.cross_entropy(z, np.array([0, 2, 1, 1]))
    ops, seen, todo = set(), set(), [loss]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        ops.add(node._op)
        todo.extend(node._parents)
    assert "logsumexp" not in ops, ("cross_entropy calls lesson 02's logsumexp (or log_softmax): build the loss from "
                                    "the primitive ops (max, subtract, exp, sum, log) as the exercise asks")
    assert {"exp", "sum", "log"} <= ops, f"expected exp, sum and log in the loss's graph, found the ops {sorted(ops)}"


@pytest.mark.exercise("3.3")
def test_cross_entropy_on_another_device(lesson, test_helper):
    strict = test_helper("strict_device")
    rng = np.random.default_rng(8)
    z = (3 * rng.standard_normal((6, 5))).astype(np.float32)
    t = rng.integers(0, 5, 6)
    with use_backend("strict", strict.StrictBackend()):
        logits = Tensor(z, requires_grad=True, device="strict")
        loss = lesson.cross_entropy(logits, t)
        loss.backward()
        value, grad = loss.item(), grad_of(logits)
    want, dz = ce_oracle(z, t)
    assert np.isclose(value, want, rtol=1e-5), f"cross_entropy on the 'strict' device: expected {want}, got {value}"
    np.testing.assert_allclose(grad, dz, rtol=1e-4, atol=1e-6)


@pytest.mark.exercise("3.3")
def test_cross_entropy_rejects_bad_input(lesson):
    z = Tensor(np.zeros((4, 3), np.float32), requires_grad=True)
    assert np.isclose(lesson.cross_entropy(z, np.array([0, 1, 2, 0])).item(), np.log(3), rtol=1e-6)
    with pytest.raises(ValueError, match=r"\(4, 3\)|\(5,\)"):
        lesson.cross_entropy(z, np.array([0, 1, 2, 0, 1]))
    with pytest.raises(ValueError, match=r"\(N, C\)|\(12,\)"):
        lesson.cross_entropy(Tensor(np.zeros(12, np.float32)), np.zeros(12, np.int64))
    with pytest.raises(TypeError, match="float"):
        lesson.cross_entropy(z, np.array([0.0, 1.0, 2.0, 0.0]))
    with pytest.raises(ValueError, match="3"):
        lesson.cross_entropy(z, np.array([0, 1, 3, 0]))
    with pytest.raises(ValueError):
        lesson.cross_entropy(z, np.array([0, -1, 2, 0]))


# ---------------------------------------------------------------- 3.4 SGD


@pytest.mark.exercise("3.4")
def test_sgd_hand_computed(lesson):
    # p0 = 1, gradient 1 at every step, lr 0.1, momentum 0.9:
    # v1 = 1     p1 = 1 - 0.1 * 1     = 0.9
    # v2 = 1.9   p2 = 0.9 - 0.1 * 1.9 = 0.71
    # v3 = 2.71  p3 = 0.71 - 0.271    = 0.439
    p = lesson.Parameter(np.array([1.0], np.float32))
    opt = lesson.SGD([p], lr=0.1, momentum=0.9)
    for want in (0.9, 0.71, 0.439):
        set_grad(lesson, p, [1.0])
        opt.step()
        assert np.isclose(p.numpy()[0], want, atol=1e-6), f"SGD momentum: expected p = {want}, got {p.numpy()[0]}"
    # plain SGD with weight decay: p = 2, g = 0.5, lr 0.1, wd 0.1 -> 2 - 0.1 * (0.5 + 0.2) = 1.93
    q = lesson.Parameter(np.array([2.0], np.float32))
    opt = lesson.SGD([q], lr=0.1, weight_decay=0.1)
    set_grad(lesson, q, [0.5])
    opt.step()
    assert np.isclose(q.numpy()[0], 1.93, atol=1e-6), f"SGD weight decay: expected 1.93, got {q.numpy()[0]}"


@pytest.mark.exercise("3.4")
@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.01)])
def test_sgd_matches_numpy_over_steps(lesson, momentum, wd):
    rng = np.random.default_rng(11)
    shapes = [(7, 3), (5,), (2, 3, 4)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [lesson.Parameter(a) for a in init]
    frozen = lesson.Parameter(np.ones(3, np.float32))  # never gets a gradient: must not move
    opt = lesson.SGD(params + [frozen], lr=0.05, momentum=momentum, weight_decay=wd)
    ref = [a.astype(np.float64) for a in init]
    vel = [np.zeros_like(a) for a in ref]
    for step in range(5):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        for p, g in zip(params, grads):
            set_grad(lesson, p, g)
        opt.step()
        for i, g in enumerate(grads):
            d = g + wd * ref[i]
            vel[i] = momentum * vel[i] + d
            ref[i] = ref[i] - 0.05 * vel[i]
        for i, p in enumerate(params):
            np.testing.assert_allclose(p.numpy(), ref[i], rtol=1e-5, atol=1e-6,
                                       err_msg=f"SGD(momentum={momentum}, weight_decay={wd}) param {i} after step {step + 1}")
    assert np.array_equal(frozen.numpy(), np.ones(3)), "a parameter whose .grad is None must not change"
    assert all(p.dtype == np.float32 for p in params), "the update must keep the parameters float32"


def run_optimizer(lesson, make, device="cpu", steps=4):
    """Params of float32 and float64 (distinct shapes), `steps` steps of seeded gradients.
    Returns (params, optimizer, float64 NumPy copies of the initial values, the gradients)."""
    rng = np.random.default_rng(13)
    init = [rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((5,)) * 0.1]
    params = [lesson.Parameter(a, device=device) for a in init]
    opt = make(params)
    before = [p.data for p in params]
    grads = [[rng.standard_normal(a.shape).astype(a.dtype) for a in init] for _ in range(steps)]
    for step in grads:
        for p, g in zip(params, step):
            p.zero_grad()
            (p * Tensor(g, device=device)).sum().backward()
        opt.step()
        for p, b in zip(params, before):
            assert p.data is b, ("the update must write into p.data in place (p.data[...] -= ...), not rebind "
                                 "p.data to a new array: other references to the array (a view, a backend, a "
                                 "checkpoint) would keep the old values")
    return params, opt, [a.astype(np.float64) for a in init], grads


@pytest.mark.exercise("3.4")
def test_sgd_in_place_dtypes_and_device(lesson, test_helper):
    make = lambda ps: lesson.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731
    params, opt, ref, grads = run_optimizer(lesson, make)
    check_optimizer_state(opt, params, "SGD")
    vel = [np.zeros_like(r) for r in ref]
    for step in grads:
        for i, g in enumerate(step):
            vel[i] = 0.9 * vel[i] + g + 0.01 * ref[i]
            ref[i] = ref[i] - 0.1 * vel[i]
    assert [p.dtype for p in params] == [np.float32, np.float64], "SGD must keep each parameter's dtype"
    np.testing.assert_allclose(params[1].numpy(), ref[1], rtol=1e-13, atol=1e-15,
                               err_msg="SGD on a float64 parameter must compute in float64 (not via float32)")
    strict = test_helper("strict_device")
    with use_backend("strict", strict.StrictBackend()):
        dev_params, _, _, _ = run_optimizer(lesson, make, device="strict")
        for p, q in zip(dev_params, params):
            np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-6,
                                       err_msg="SGD on the 'strict' device must give the CPU result")


@pytest.mark.exercise("3.4")
def test_sgd_momentum_zero_weight_decay_used(lesson):
    p = lesson.Parameter(np.array([1.0, -2.0]))
    opt = lesson.SGD([p], lr=0.5, weight_decay=0.2)
    set_grad(lesson, p, [0.0, 0.0])
    opt.step()
    np.testing.assert_allclose(p.numpy(), [1.0 - 0.5 * 0.2, -2.0 + 0.5 * 0.4], rtol=1e-15,
                               err_msg="with a zero gradient, weight decay alone must shrink p by lr * wd * p")


# ---------------------------------------------------------------- 3.5 Adam


@pytest.mark.exercise("3.5")
def test_adam_hand_computed(lesson):
    # Constant gradient g: with bias correction m_hat = g and v_hat = g^2 at every step, so each
    # step is lr * g / (|g| + eps) = lr * sign(g) (up to eps). Without correction the first step
    # would be 0.1 / sqrt(0.001) = 3.16 times larger.
    p = lesson.Parameter(np.array([0.0, 1.0], np.float32))
    opt = lesson.Adam([p], lr=0.01)
    for t in range(1, 4):
        set_grad(lesson, p, [0.5, -2.0])
        opt.step()
        want = np.array([-0.01 * t, 1.0 + 0.01 * t])
        np.testing.assert_allclose(p.numpy(), want, atol=1e-6,
                                   err_msg=f"Adam with bias correction: after {t} steps of a constant gradient "
                                           f"each coordinate moves lr * t = {0.01 * t:.2f}")
    assert opt.t == 3, f"Adam.t should count step() calls: expected 3, got {opt.t}"


@pytest.mark.exercise("3.5")
def test_adam_in_place_dtypes_and_device(lesson, test_helper):
    make = lambda ps: lesson.Adam(ps, lr=0.05, betas=(0.8, 0.99), eps=1e-6)  # noqa: E731
    params, opt, ref, grads = run_optimizer(lesson, make)
    check_optimizer_state(opt, params, "Adam")
    m = [np.zeros_like(r) for r in ref]
    v = [np.zeros_like(r) for r in ref]
    for t, step in enumerate(grads, 1):
        for i, g in enumerate(step):
            g = g.astype(np.float64)
            m[i] = 0.8 * m[i] + 0.2 * g
            v[i] = 0.99 * v[i] + 0.01 * g * g
            ref[i] = ref[i] - 0.05 * (m[i] / (1 - 0.8 ** t)) / (np.sqrt(v[i] / (1 - 0.99 ** t)) + 1e-6)
    assert [p.dtype for p in params] == [np.float32, np.float64], "Adam must keep each parameter's dtype"
    np.testing.assert_allclose(params[1].numpy(), ref[1], rtol=1e-12, atol=1e-14,
                               err_msg="Adam on a float64 parameter must compute in float64 (not via float32)")
    strict = test_helper("strict_device")
    with use_backend("strict", strict.StrictBackend()):
        dev_params, _, _, _ = run_optimizer(lesson, make, device="strict")
        for p, q in zip(dev_params, params):
            np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-6,
                                       err_msg="Adam on the 'strict' device must give the CPU result")


@pytest.mark.exercise("3.5")
@pytest.mark.parametrize("betas,eps", [((0.9, 0.999), 1e-8), ((0.5, 0.9), 1e-3)])
def test_adam_matches_numpy_over_steps(lesson, betas, eps):
    rng = np.random.default_rng(5)
    shapes = [(9, 4), (3,)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [lesson.Parameter(a) for a in init]
    frozen = lesson.Parameter(np.ones(2, np.float32))
    lr, (b1, b2) = 0.03, betas
    opt = lesson.Adam(params + [frozen], lr=lr, betas=betas, eps=eps)
    ref = [a.astype(np.float64) for a in init]
    m = [np.zeros_like(a) for a in ref]
    v = [np.zeros_like(a) for a in ref]
    for t in range(1, 7):
        grads = [(rng.standard_normal(s) * 10 ** rng.uniform(-3, 1)).astype(np.float32) for s in shapes]
        for p, g in zip(params, grads):
            set_grad(lesson, p, g)
        opt.step()
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g.astype(np.float64) ** 2
            ref[i] = ref[i] - lr * (m[i] / (1 - b1 ** t)) / (np.sqrt(v[i] / (1 - b2 ** t)) + eps)
        for i, p in enumerate(params):
            np.testing.assert_allclose(p.numpy(), ref[i], rtol=1e-5, atol=1e-5,
                                       err_msg=f"Adam(betas={betas}, eps={eps}) param {i} after step {t}")
    assert np.array_equal(frozen.numpy(), np.ones(2)), "a parameter whose .grad is None must not change"


# ---------------------------------------------------------------- 3.6 state_dict


def toy_module(lesson, seed):
    """A Module whose named_parameters is given here, so 3.6 is graded without 3.1."""
    rng = np.random.default_rng(seed)

    class Toy(lesson.Module):
        def __init__(self):
            self.w = lesson.Parameter(rng.standard_normal((3, 5)).astype(np.float32))
            self.b = lesson.Parameter(rng.standard_normal(5).astype(np.float32))
            self.e = lesson.Parameter(rng.standard_normal((2, 2, 2)).astype(np.float32))
            self.s = lesson.Parameter(rng.standard_normal(3) / 3)  # float64: 1/3 has no float32 value

        def named_parameters(self, prefix=""):
            return [("layer.weight", self.w), ("layer.bias", self.b), ("embed", self.e), ("scale", self.s)]

    return Toy()


@pytest.mark.exercise("3.6")
def test_state_dict_of_a_device_model_holds_numpy_copies(lesson, test_helper):
    """On a device (CuPy's arrays on "cuda"; here the strict fake device) state_dict must still hand
    back plain NumPy arrays, as documented: p.data.copy() would be a device array."""
    strict = test_helper("strict_device")
    rng = np.random.default_rng(7)
    with use_backend("strict", strict.StrictBackend()):
        host = {"w": rng.standard_normal((3, 4)).astype(np.float32), "s": rng.standard_normal(2) / 3}

        class OnDevice(lesson.Module):
            def __init__(self):
                self.w = lesson.Parameter(host["w"], device="strict")
                self.s = lesson.Parameter(host["s"], device="strict")

            def named_parameters(self, prefix=""):
                return [("w", self.w), ("s", self.s)]

        model = OnDevice()
        assert isinstance(model.w.data, strict.DeviceArray), "test set-up: the parameters should be on the device"
        sd = model.state_dict()
        for k, want in host.items():
            assert type(sd[k]) is np.ndarray, \
                f"state_dict()[{k!r}] of a model on a device must be a plain NumPy array (a host copy), got " \
                f"{type(sd[k]).__module__}.{type(sd[k]).__name__}: copy through the backend's to_numpy"
            assert sd[k].dtype == want.dtype and np.array_equal(sd[k], want), f"state_dict()[{k!r}]: wrong values"
        other = OnDevice()
        other.load_state_dict({k: v * 2 for k, v in sd.items()})
        for k, want in host.items():
            p = getattr(other, k)
            assert p.device == "strict" and isinstance(p.data, strict.DeviceArray), \
                f"load_state_dict must keep parameter {k!r} on its device"
            assert np.array_equal(p.numpy(), want * 2), f"load_state_dict: parameter {k!r} has wrong values"


@pytest.mark.exercise("3.6")
def test_state_dict_round_trip(lesson):
    src, dst = toy_module(lesson, 0), toy_module(lesson, 1)
    sd = src.state_dict()
    assert list(sd) == ["layer.weight", "layer.bias", "embed", "scale"], f"keys in named_parameters order, got {list(sd)}"
    for k, p in src.named_parameters():
        assert isinstance(sd[k], np.ndarray), f"state_dict[{k!r}] should be a NumPy array, got {type(sd[k]).__name__}"
        assert np.array_equal(sd[k], p.numpy())
    saved = {k: v.copy() for k, v in sd.items()}
    src.w.data[...] += 1.0
    assert np.array_equal(sd["layer.weight"], saved["layer.weight"]), \
        "state_dict must return copies: changing the model afterwards changed the saved dict"
    before = dst.w.data
    dst.load_state_dict(sd)
    for k, p in dst.named_parameters():
        assert np.array_equal(p.numpy(), saved[k]), f"after load_state_dict, {k} differs from the state dict"
    assert np.array_equal(before, saved["layer.weight"]), "load_state_dict must copy into the existing arrays (in place)"
    sd["layer.bias"][...] = 99.0
    assert not np.any(dst.b.numpy() == 99.0), "load_state_dict must copy: the model aliases the dict's arrays"
    assert sd["scale"].dtype == np.float64, f"state_dict must keep a float64 parameter float64, got {sd['scale'].dtype}"
    assert dst.s.dtype == np.float64 and np.array_equal(dst.s.numpy(), saved["scale"]), \
        "a float64 parameter must round-trip exactly (not through float32)"
    dst.load_state_dict({k: v.astype(np.float64) for k, v in saved.items()})
    assert dst.w.dtype == np.float32, "loading float64 arrays must keep the parameters float32"


@pytest.mark.exercise("3.6")
def test_load_state_dict_errors_are_clear_and_atomic(lesson):
    src, dst = toy_module(lesson, 0), toy_module(lesson, 1)
    original = dst.state_dict()
    sd = src.state_dict()
    missing = {k: v for k, v in sd.items() if k != "embed"}
    with pytest.raises(KeyError, match="embed"):
        dst.load_state_dict(missing)
    with pytest.raises(KeyError, match="extra.scale"):
        dst.load_state_dict({**sd, "extra.scale": np.ones(1)})
    bad = {**sd, "layer.bias": np.zeros(4, np.float32)}
    with pytest.raises(ValueError, match=r"layer\.bias.*\(4,\).*\(5,\)|layer\.bias.*\(5,\).*\(4,\)"):
        dst.load_state_dict(bad)
    for k, p in dst.named_parameters():
        assert np.array_equal(p.numpy(), original[k]), f"a failed load_state_dict modified {k}: it must change nothing"


# ---------------------------------------------------------------- 3.7 fit


class TinyMLP:
    """A 2-layer ReLU MLP on raw autograd Tensors (duck-types what fit needs)."""

    def __init__(self, n_in, hidden, n_out, seed):
        rng = np.random.default_rng(seed)
        self.W1 = Tensor((rng.standard_normal((n_in, hidden)) * np.sqrt(2 / n_in)).astype(np.float32), requires_grad=True)
        self.b1 = Tensor(np.zeros(hidden, np.float32), requires_grad=True)
        self.W2 = Tensor((rng.standard_normal((hidden, n_out)) * np.sqrt(1 / hidden)).astype(np.float32), requires_grad=True)
        self.b2 = Tensor(np.zeros(n_out, np.float32), requires_grad=True)
        self.training = True
        self.train_calls = 0
        self.seen = []

    def parameters(self):
        return [self.W1, self.b1, self.W2, self.b2]

    def train(self, mode=True):
        self.training = mode
        self.train_calls += mode
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, x):
        self.seen.append((self.training, np.array(x.numpy())))
        return ((x @ self.W1 + self.b1).relu()) @ self.W2 + self.b2


class MomentumSGD:
    def __init__(self, params, lr, momentum=0.9):
        self.params, self.lr, self.mu = params, lr, momentum
        self.vel = [np.zeros(p.shape) for p in params]
        self.calls = []

    def zero_grad(self):
        self.calls.append("zero_grad")
        for p in self.params:
            p.zero_grad()

    def step(self):
        self.calls.append("step")
        for p, v in zip(self.params, self.vel):
            if p.grad is not None:
                v *= self.mu
                v += p.grad.numpy()
                p.data[...] -= (self.lr * v).astype(np.float32)


def make_loss(record):
    def loss_fn(logits, y):
        n, c = logits.shape
        onehot = np.zeros((n, c), np.float32)
        onehot[np.arange(n), y] = 1
        loss = -(log_softmax(logits, axis=-1) * Tensor(onehot, device=logits.device)).sum() * (1.0 / n)
        record.append((n, loss.item(), int((logits.numpy().argmax(1) == y).sum())))
        return loss
    return loss_fn


@pytest.mark.exercise("3.7")
def test_fit_batches_shuffling_and_history(lesson):
    n, bs, epochs = 103, 16, 3
    rng = np.random.default_rng(0)
    X = np.concatenate([np.arange(n, dtype=np.float32)[:, None], rng.standard_normal((n, 2)).astype(np.float32)], 1)
    y = rng.integers(0, 3, n)
    model, record = TinyMLP(3, 8, 3, seed=0), []
    opt = MomentumSGD(model.parameters(), lr=1e-4)
    hist = lesson.fit(model, X, y, opt, epochs=epochs, batch_size=bs, rng=np.random.default_rng(42),
                      progress=False, loss_fn=make_loss(record))
    batches = [xb for training, xb in model.seen if training]
    per_epoch = -(-n // bs)
    assert len(batches) == epochs * per_epoch, f"expected {per_epoch} batches per epoch x {epochs} epochs, got {len(batches)}"
    orders = []
    for e in range(epochs):
        ep = batches[e * per_epoch:(e + 1) * per_epoch]
        sizes = [len(b) for b in ep]
        assert sizes == [bs] * (n // bs) + [n % bs], f"epoch {e}: batch sizes should be {[bs] * (n // bs) + [n % bs]}, got {sizes}"
        ids = np.concatenate([b[:, 0] for b in ep]).astype(int)
        assert sorted(ids) == list(range(n)), f"epoch {e}: every sample must be seen exactly once"
        for b in ep:
            rows = b[:, 0].astype(int)
            assert np.array_equal(b, X[rows]), "a batch's rows must be X's rows (inputs changed?)"
        orders.append(ids)
    assert not np.array_equal(orders[0], np.arange(n)), "samples must be shuffled (rng.permutation), not visited in order"
    assert not np.array_equal(orders[0], orders[1]), "each epoch needs a fresh random order"
    assert opt.calls == ["zero_grad", "step"] * (epochs * per_epoch), \
        "per batch: optimizer.zero_grad() once, then (after backward) optimizer.step() once"
    assert model.train_calls >= 1, "fit must put the model in training mode (model.train())"
    assert set(hist) >= {"loss", "accuracy"} and len(hist["loss"]) == epochs and len(hist["accuracy"]) == epochs, \
        f"history needs 'loss' and 'accuracy' lists with one entry per epoch, got { {k: len(v) for k, v in hist.items()} }"
    for e in range(epochs):
        rec = record[e * per_epoch:(e + 1) * per_epoch]
        want_loss = sum(k * loss for k, loss, _ in rec) / n
        want_acc = sum(c for _, _, c in rec) / n
        assert np.isclose(hist["loss"][e], want_loss, rtol=1e-6), \
            f"history['loss'][{e}] should be the sample-weighted mean of the batch losses {want_loss:.6f}, got {hist['loss'][e]}"
        assert np.isclose(hist["accuracy"][e], want_acc), f"history['accuracy'][{e}]: expected {want_acc:.4f}, got {hist['accuracy'][e]}"
    model2 = TinyMLP(3, 8, 3, seed=0)
    lesson.fit(model2, X, y, MomentumSGD(model2.parameters(), lr=1e-4), epochs=1, batch_size=bs,
               rng=np.random.default_rng(42), progress=False, loss_fn=make_loss([]))
    ids2 = np.concatenate([b[:, 0] for t, b in model2.seen if t]).astype(int)
    assert np.array_equal(ids2, orders[0]), "the same rng seed must give the same batch order"
    with pytest.raises(ValueError, match=r"103.*100|100.*103"):
        lesson.fit(model2, X, y[:100], opt, epochs=1, batch_size=bs, progress=False, loss_fn=make_loss([]))


class DeviceSGD:
    """Plain SGD that keeps everything on the parameters' device."""

    def __init__(self, params, lr):
        self.params, self.lr = params, lr

    def zero_grad(self):
        for p in self.params:
            p.zero_grad()

    def step(self):
        for p in self.params:
            if p.grad is not None:
                p.data[...] -= self.lr * p.grad.data


@pytest.mark.exercise("3.7")
def test_fit_puts_batches_on_the_model_device(lesson, test_helper):
    strict = test_helper("strict_device")
    rng = np.random.default_rng(1)
    X, y = rng.standard_normal((40, 3)).astype(np.float32), rng.integers(0, 3, 40)
    with use_backend("strict", strict.StrictBackend()):
        model = TinyMLP(3, 8, 3, seed=2)
        for name in ("W1", "b1", "W2", "b2"):
            setattr(model, name, Tensor(getattr(model, name).numpy(), requires_grad=True, device="strict"))
        hist = lesson.fit(model, X, y, DeviceSGD(model.parameters(), lr=0.05), epochs=2, batch_size=16,
                          rng=np.random.default_rng(0), progress=False, loss_fn=make_loss([]))
    assert len(hist["loss"]) == 2 and all(np.isfinite(hist["loss"])), f"fit on the 'strict' device: history {hist}"


@pytest.mark.exercise("3.7")
def test_fit_learns_moons(lesson):
    X, y = lesson.make_moons(400, noise=0.1, rng=np.random.default_rng(0))
    model = TinyMLP(2, 32, 2, seed=1)
    hist = lesson.fit(model, X, y, MomentumSGD(model.parameters(), lr=0.05), epochs=40, batch_size=32,
                      rng=np.random.default_rng(0), progress=False, loss_fn=make_loss([]),
                      X_val=X[:100], y_val=y[:100])
    first, last = hist["loss"][0], hist["loss"][-1]
    assert last < 0.25 * first, f"training loss should fall by 4x in 40 epochs: {first:.3f} -> {last:.3f}"
    with_grad = None
    from minitorch.autograd import no_grad
    with no_grad():
        with_grad = model(Tensor(X)).numpy()
    acc = float((with_grad.argmax(1) == y).mean())
    assert acc >= 0.97, f"a 2-32-2 MLP trained 40 epochs on moons (seed 0) should reach >= 97% accuracy, got {acc:.3f}"
    assert hist["accuracy"][-1] >= 0.95, f"history['accuracy'] of the last epoch: expected >= 0.95, got {hist['accuracy'][-1]:.3f}"
    assert len(hist.get("val_accuracy", [])) == 40
