"""Lesson 16: mixture of experts and expert parallelism. The router against NumPy softmax/top-k in
float64 (ties to the lowest index) and by gradient check; the balancing losses against their
formulas; dispatch and capacity against a loop that applies the stated rule assignment by
assignment; the grouped GEMM against per-expert matmuls, its work counted through the matmul it
calls; the MoE layer against a dense reference (every token through its experts, with its
weights) and every gradient against autograd through that reference. The all-to-all against a
reference permutation for 1..8 ranks with uneven splits, its bytes, messages and clock against the
formulas; expert parallelism and EP x DP training against one process. Exercises are graded on
their own: where one needs another's code (a router, a dispatch, an all-to-all), the test brings
its own oracle. Key cases also run under `mpiexec -n 4` (one launch for the whole file: on 4
ranks, then on 2 of them as a group) and must agree with the simulator bit for bit."""

from __future__ import annotations

import contextlib
import math
import re
import traceback
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minitorch.autograd import Tensor, grad_check, softmax
from minitorch.gpt import gelu, gelu_np

pytestmark = pytest.mark.lesson16

ALPHA, BETA = 3e-6, 2e-10


def sim(lesson, fn, nranks, *args, alpha=ALPHA, beta=BETA, **kwargs):
    return lesson.run(fn, nranks, *args, engine="sim", alpha=alpha, beta=beta, **kwargs)


@contextlib.contextmanager
def raises(kind, match):
    """pytest.raises(kind, match=match); an exception of another kind fails naming both (pytest.raises
    alone would let it through as if the test had crashed), where it was raised and its notes."""
    try:
        with pytest.raises(kind, match=match) as info:
            yield info
    except Exception as exc:  # noqa: BLE001 - any other exception is the student's, reported
        if isinstance(exc, kind) or (isinstance(exc, AssertionError) and str(exc).startswith("Regex pattern")) \
                or (isinstance(exc, NotImplementedError) and str(exc).startswith("Exercise ")):  # a stub: not attempted
            raise
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
        notes = "".join(f"\n{n}" for n in getattr(exc, "__notes__", ()))
        raise AssertionError(f"expected {kind.__name__} matching {match!r}, got {type(exc).__name__}: {exc}{where}"
                             f"{notes}") from exc


# ---------------------------------------------------------------- oracles (NumPy and autograd, by the test)


def softmax_np(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def topk_np(scores, k):
    """The k largest per row, best first, ties to the lowest index (a loop, not a sort)."""
    out = []
    for row in np.asarray(scores):
        chosen = []
        for _ in range(k):
            best = None
            for i, v in enumerate(row):
                if i not in chosen and (best is None or v > row[best]):
                    best = i
            chosen.append(best)
        out.append(chosen)
    return np.array(out, dtype=np.int64).reshape(len(out), k)


def weights_np(p, experts):
    sel = np.take_along_axis(p, experts, axis=1)
    return sel / sel.sum(axis=1, keepdims=True) if experts.shape[1] > 1 else sel


class OGate(NamedTuple):
    experts: np.ndarray
    weights: Tensor
    probs: Tensor


def oracle_gate(logits, k, bias=None):
    probs = softmax(logits, axis=-1)
    experts = topk_np(probs.numpy(), k)
    mask = np.zeros(probs.shape, probs.dtype)  # the logits' dtype: a float32 layer stays float32
    np.put_along_axis(mask, experts, 1.0, axis=1)
    masked = probs * mask
    full = masked / masked.sum(axis=-1, keepdims=True) if k > 1 else masked
    return OGate(experts, full[np.arange(len(experts))[:, None], experts], probs)


class ODispatch(NamedTuple):
    token: np.ndarray
    slot: np.ndarray
    group_sizes: np.ndarray
    kept: np.ndarray
    dropped: int


def oracle_dispatch(experts, n_experts, capacity=None):
    """The stated rule, assignment by assignment in token order."""
    experts = np.asarray(experts)
    t, k = experts.shape
    used = [0] * n_experts
    kept = np.zeros((t, k), bool)
    rows = [[] for _ in range(n_experts)]
    for i in range(t):
        for j in range(k):
            e = int(experts[i, j])
            if capacity is None or used[e] < capacity:
                used[e] += 1
                kept[i, j] = True
                rows[e].append((i, j))
    flat = [r for e in range(n_experts) for r in rows[e]]
    token = np.array([r[0] for r in flat], np.int64)
    slot = np.array([r[1] for r in flat], np.int64)
    return ODispatch(token, slot, np.array(used, np.int64), kept, int(t * k - kept.sum()))


def oracle_grouped_matmul(x, sizes, w):
    """Autograd grouped matmul from indexing and matmul: each group's rows through a 0/1 matrix."""
    r = x.shape[0]
    out = None
    lo = 0
    for e, n in enumerate(np.asarray(sizes).tolist()):
        if n:
            place = np.zeros((r, n), x.dtype)
            place[lo:lo + n] = np.eye(n)
            part = Tensor(place) @ (x[lo:lo + n] @ w[e])
            out = part if out is None else out + part
        lo += n
    if out is None:
        return x @ w[0] * 0.0 if len(sizes) else x
    return out


def oracle_scatter(src, index, n):
    onehot = np.zeros((n, src.shape[0]), src.dtype)
    onehot[np.asarray(index, int), np.arange(src.shape[0])] = 1.0
    return Tensor(onehot) @ src


def oracle_ops(lesson, grouped=None, scatter=None):
    return lesson.MoEOps(oracle_gate, oracle_dispatch, grouped or oracle_grouped_matmul, scatter or oracle_scatter)


def dense_np(x, router, w1, w2, k, capacity=None):
    """Every token through its experts, with its weights; assignments over capacity skipped."""
    p = softmax_np(x @ router)
    experts = topk_np(p, k)
    w = weights_np(p, experts)
    kept = oracle_dispatch(experts, router.shape[1], capacity).kept
    out = np.zeros((x.shape[0], w2.shape[2]))
    for t in range(x.shape[0]):
        for j in range(k):
            if kept[t, j]:
                e = experts[t, j]
                out[t] += w[t, j] * (gelu_np(x[t] @ w1[e]) @ w2[e])
    return out


def dense_tensor(x, router, w1, w2, k):
    """The same as autograd ops (dense: every expert on every token, masked): the gradient oracle."""
    probs = softmax(x @ router, axis=-1)
    experts = topk_np(probs.numpy(), k)
    mask = np.zeros(probs.shape)
    np.put_along_axis(mask, experts, 1.0, axis=1)
    g = probs * mask
    if k > 1:
        g = g / g.sum(axis=-1, keepdims=True)
    out = None
    for e in range(w1.shape[0]):
        y = (gelu(x @ w1[e]) @ w2[e]) * g[:, e:e + 1]
        out = y if out is None else out + y
    return out


def oracle_a2a(comm, x, send_counts, recv_counts, tag=0):
    """All-to-all by rounds through rank order (every rank sends to every other, then receives)."""
    x = np.asarray(x)
    off = np.concatenate([[0], np.cumsum(np.asarray(send_counts).reshape(-1))]).astype(int)
    for j in range(comm.size):
        if j != comm.rank:
            comm.send(x[off[j]:off[j + 1]], j, tag=tag + 50)
    parts = [x[off[s]:off[s + 1]].copy() if s == comm.rank else comm.recv(s, tag=tag + 50) for s in range(comm.size)]
    return np.concatenate(parts, axis=0)


def oracle_pairwise_a2a(comm, x, send_counts, recv_counts, tag=0):
    """The pairwise exchange's schedule (the one the cost formula describes), written by the test."""
    x = np.asarray(x)
    n, r = comm.size, comm.rank
    off = np.concatenate([[0], np.cumsum(np.asarray(send_counts).reshape(-1))]).astype(int)
    parts = [None] * n
    parts[r] = x[off[r]:off[r + 1]].copy()
    for s in range(1, n):
        comm.send(x[off[(r + s) % n]:off[(r + s) % n + 1]], (r + s) % n, tag=tag + 60)
        parts[(r - s) % n] = comm.recv((r - s) % n, tag=tag + 60)
    return np.concatenate(parts, axis=0)


def layer_np(lesson, layer):
    return layer.router.numpy(), layer.w1.numpy(), layer.w2.numpy()


def make_layer(lesson, c, e, k, h, seed, ops=None, capacity_factor=None):
    return lesson.MoEMLP(c, e, k, h, np.random.default_rng(seed), capacity_factor=capacity_factor,
                         dtype=np.float64, ops=ops, init=0.5, proj_init=0.5)


def close(got, want, what, tol=1e-12):
    got = np.asarray(got.numpy() if hasattr(got, "numpy") else got)
    assert got.shape == np.shape(want), f"{what}: expected shape {np.shape(want)}, got {got.shape}"
    err = float(np.abs(got - want).max()) if got.size else 0.0
    assert err <= tol * max(1.0, float(np.abs(want).max()) if got.size else 1.0), \
        f"{what}: max error {err:.3g} (tolerance {tol}); expected\n{np.asarray(want)}\ngot\n{got}"


# ---------------------------------------------------------------- 16.1 the router


@pytest.mark.exercise("16.1")
@settings(max_examples=40)
@given(t=st.integers(1, 12), e=st.integers(1, 9), k=st.integers(1, 9), seed=st.integers(0, 10**6))
@example(t=1, e=1, k=1, seed=0)
@example(t=5, e=8, k=2, seed=1)
@example(t=3, e=4, k=4, seed=2)
def test_top_k_gating_picks_k_largest_and_renormalises(lesson, t, e, k, seed):
    k = min(k, e)
    logits = np.random.default_rng(seed).standard_normal((t, e)) * 2
    g = lesson.top_k_gating(Tensor(logits), k)
    p = softmax_np(logits)
    want = topk_np(p, k)
    experts = np.asarray(g.experts)
    assert experts.shape == (t, k), f"T={t}, E={e}, k={k}: experts should have shape {(t, k)}, got {experts.shape}"
    assert all(len(set(row)) == k for row in experts.tolist()), f"each token needs k={k} distinct experts, got\n{experts}"
    np.testing.assert_array_equal(experts, want, err_msg=f"E={e}, k={k}: the k most probable experts, best first")
    close(g.probs, p, "probs (softmax of the logits)")
    close(g.weights, weights_np(p, want), f"k={k}: weights (the chosen probabilities"
          + (", renormalised to sum to 1)" if k > 1 else ", raw for k = 1 as in Switch)"))
    if k > 1:
        close(g.weights.numpy().sum(axis=1), np.ones(t), "each token's weights must sum to 1")


@pytest.mark.exercise("16.1")
def test_top_k_gating_no_tokens(lesson):
    g = lesson.top_k_gating(Tensor(np.zeros((0, 4))), 2)
    assert np.asarray(g.experts).shape == (0, 2) and g.weights.shape == (0, 2) and g.probs.shape == (0, 4), \
        f"no tokens: experts (0, 2), weights (0, 2), probs (0, 4); got {np.asarray(g.experts).shape}, " \
        f"{g.weights.shape}, {g.probs.shape}"


@pytest.mark.exercise("16.1")
def test_top_k_gating_ties_go_to_the_lowest_index(lesson):
    cases = [(np.zeros((2, 5)), 2, [[0, 1], [0, 1]]),
             (np.array([[1.0, 3.0, 3.0, 0.0]]), 2, [[1, 2]]),
             (np.array([[1.0, 3.0, 3.0, 0.0]]), 1, [[1]]),
             (np.array([[2.0, 0.0, 2.0, 2.0]]), 3, [[0, 2, 3]]),
             (np.array([[0.0, 5.0, 0.0, 0.0, 0.0]]), 3, [[1, 0, 2]])]
    for logits, k, want in cases:
        got = np.asarray(lesson.top_k_gating(Tensor(logits), k).experts).tolist()
        assert got == want, f"logits {logits.tolist()}, k={k}: ties go to the lowest index, best first: " \
                            f"expected {want}, got {got}"


@pytest.mark.exercise("16.1")
def test_top_k_gating_bias_selects_but_does_not_weigh(lesson):
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    bias = np.array([-1.0, 0.0, 0.3, 0.0])
    g = lesson.top_k_gating(Tensor(logits), 2, bias=bias)
    p = softmax_np(logits)
    want = topk_np(p + bias, 2)
    np.testing.assert_array_equal(np.asarray(g.experts), want,
                                  err_msg="the bias is added to the probabilities to choose the experts")
    close(g.weights, weights_np(p, want), "weights come from the probabilities without the bias")


@pytest.mark.exercise("16.1")
@pytest.mark.parametrize("k", [1, 2, 3])
def test_gate_gradient_by_gradient_check(lesson, k):
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((6, 5)) * 3  # well separated: no tie within eps
    c = rng.standard_normal((6, k))
    grad_check(lambda z: (lesson.top_k_gating(z, k).weights * c).sum(), logits)
    c2 = rng.standard_normal((6, 5))
    grad_check(lambda z: (lesson.top_k_gating(z, k).probs * c2).sum(), logits)


@pytest.mark.exercise("16.1")
@settings(max_examples=25)
@given(t=st.integers(1, 20), e=st.integers(1, 8), k=st.integers(1, 3), seed=st.integers(0, 10**6))
@example(t=1, e=1, k=1, seed=0)
def test_load_balancing_loss_formula(lesson, t, e, k, seed):
    k = min(k, e)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((t, e))
    experts = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    p = softmax_np(logits)
    f = np.bincount(experts.ravel(), minlength=e) / (t * k)
    want = e * np.sum(f * p.mean(axis=0))
    got = lesson.load_balancing_loss(Tensor(p), experts)
    assert abs(got.item() - want) <= 1e-12, \
        f"T={t}, E={e}, k={k}: N * sum_i f_i P_i = {want!r} (f_i: share of the T*k assignments, P_i: mean " \
        f"probability, N = E), got {got.item()!r}"


@pytest.mark.exercise("16.1")
def test_load_balancing_loss_extremes_and_gradient(lesson):
    e, t = 4, 8
    uniform = np.full((t, e), 1 / e)
    balanced = np.array([[i % e] for i in range(t)])
    assert abs(lesson.load_balancing_loss(Tensor(uniform), balanced).item() - 1.0) < 1e-12, \
        "uniform probabilities and loads: the loss is 1"
    collapsed = np.zeros((t, e))
    collapsed[:, 2] = 1.0
    assert abs(lesson.load_balancing_loss(Tensor(collapsed), np.full((t, 1), 2)).item() - e) < 1e-12, \
        "every token to one expert with probability 1: the loss is N"
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((t, e)) * 2
    experts = np.argsort(-logits, axis=1, kind="stable")[:, :2]
    grad_check(lambda z: lesson.load_balancing_loss(softmax(z, axis=-1), experts), logits)
    z = Tensor(logits, requires_grad=True)
    lesson.load_balancing_loss(softmax(z, axis=-1), experts).backward()
    assert z.grad is not None and np.abs(z.grad.numpy()).max() > 1e-3, \
        "the gradient flows through P_i (the mean probabilities); f_i is a count and has none"


@pytest.mark.exercise("16.1")
def test_router_z_loss_value_and_gradient(lesson):
    logits = np.random.default_rng(6).standard_normal((7, 5)) * 3
    m = logits.max(axis=1)
    lse = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))
    got = lesson.router_z_loss(Tensor(logits)).item()
    assert abs(got - np.mean(lse ** 2)) < 1e-12, f"mean_t logsumexp(logits_t)^2 = {np.mean(lse ** 2)!r}, got {got!r}"
    big = np.array([[1000.0, 999.0]])
    assert math.isfinite(lesson.router_z_loss(Tensor(big)).item()), "the z-loss must be stable for large logits"
    grad_check(lambda z: lesson.router_z_loss(z), logits)


@pytest.mark.exercise("16.1")
def test_update_bias(lesson):
    bias = np.array([0.0, 0.1, -0.2, 0.0])
    load = np.array([10, 2, 4, 4])
    got = lesson.update_bias(bias, load, 0.01)
    np.testing.assert_allclose(got, bias + 0.01 * np.array([-1, 1, 1, 1]), atol=1e-15,
                               err_msg="overloaded experts (load above the mean 5) go down by rate, the others up")
    np.testing.assert_allclose(lesson.update_bias(bias, np.array([3, 3, 3, 3]), 0.5), bias, atol=0,
                               err_msg="a balanced load leaves the bias unchanged")
    assert bias.tolist() == [0.0, 0.1, -0.2, 0.0], "update_bias must return a new array, not change its input"


@pytest.mark.exercise("16.1")
def test_router_bad_input(lesson):
    for k in (0, 5):
        with raises(ValueError, match=r"k"):
            lesson.top_k_gating(Tensor(np.zeros((3, 4))), k)
    with raises(ValueError, match=r"shape|dimension"):
        lesson.top_k_gating(Tensor(np.zeros(4)), 1)
    with raises(ValueError, match=r"bias"):
        lesson.top_k_gating(Tensor(np.zeros((3, 4))), 1, bias=np.zeros(3))
    with raises(ValueError, match=r"expert"):
        lesson.load_balancing_loss(Tensor(np.full((2, 3), 1 / 3)), np.array([[0], [3]]))


def separated_logits(t, e, seed, dtype):
    """Logits whose every row is a permutation of 0, 0.7, ..., 0.7 (E-1) plus a shift: no two
    probabilities within float32 rounding of each other, so the top-k is the same in any dtype."""
    rng = np.random.default_rng(seed)
    rows = np.array([rng.permutation(e) for _ in range(t)]).reshape(t, e)
    return (rows * 0.7 + rng.standard_normal((t, 1))).astype(dtype)


@pytest.mark.exercise("16.1")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_router_keeps_the_logits_dtype(lesson, dtype):
    tol = 1e-6 if dtype == np.float32 else 1e-12
    name = np.dtype(dtype).name
    logits = separated_logits(7, 5, seed=8, dtype=dtype)
    p = softmax_np(logits)
    for k in (1, 2, 5):
        g = lesson.top_k_gating(Tensor(logits), k)
        assert g.probs.dtype == dtype and g.weights.dtype == dtype, \
            f"{name} logits, k={k}: probs and weights must be {name}, got {g.probs.dtype} and {g.weights.dtype}"
        want = topk_np(p, k)
        np.testing.assert_array_equal(np.asarray(g.experts), want, err_msg=f"{name} logits, k={k}: the k most probable")
        close(g.probs, p, f"{name} logits: probs", tol)
        close(g.weights, weights_np(p, want), f"{name} logits, k={k}: weights", tol)
    aux = lesson.load_balancing_loss(g.probs, np.asarray(g.experts))
    z = lesson.router_z_loss(Tensor(logits))
    assert aux.dtype == dtype and z.dtype == dtype, \
        f"{name} router: the losses must be {name} too, got load_balancing_loss {aux.dtype}, router_z_loss {z.dtype}"
    bias = np.array([0.0, 0.25, -0.5, 0.0], dtype)
    load = np.array([4, 6, 5, 5])  # mean 5: experts 2 and 3 exactly at the mean
    got = lesson.update_bias(bias, load, 0.125)
    assert np.asarray(got).dtype == dtype, f"update_bias of a {name} bias must return {name}, got {np.asarray(got).dtype}"
    np.testing.assert_array_equal(got, np.array([0.125, 0.125, -0.5, 0.0], dtype),
                                  err_msg="loads [4, 6, 5, 5], mean 5: expert 0 up by rate, expert 1 down, experts 2 "
                                          "and 3 (exactly at the mean) unchanged")


@pytest.mark.exercise("16.1")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("value,text", [(np.inf, "inf"), (np.nan, "nan"), (-np.inf, "-inf")])
def test_top_k_gating_refuses_non_finite_logits(lesson, dtype, value, text):
    """softmax of a +inf logit is NaN (inf - inf), and the top-k of NaNs is arbitrary: refuse it."""
    logits = np.zeros((3, 4), dtype)
    logits[1, 2] = value
    logits[2, 0] = value
    with raises(ValueError, match=rf"top_k_gating: logits must be finite, got {re.escape(text)} at token 1, expert 2$"):
        lesson.top_k_gating(Tensor(logits), 2)


@pytest.mark.exercise("16.1")
def test_top_k_gating_ties_after_the_bias(lesson):
    """Zero logits: every probability is exactly 1/4, so the bias alone decides, with exact ties."""
    for bias, k, want in [([0.0, 0.5, 0.5, 0.25], 2, [1, 2]), ([0.0, 0.5, 0.5, 0.25], 3, [1, 2, 3]),
                          ([0.5, 0.0, 0.5, 0.0], 2, [0, 2]), ([0.0, 0.25, 0.0, 0.25], 3, [1, 3, 0])]:
        g = lesson.top_k_gating(Tensor(np.zeros((2, 4))), k, bias=np.array(bias))
        got = np.asarray(g.experts).tolist()
        assert got == [want, want], f"probabilities 1/4 each, bias {bias}, k={k}: the largest p + bias, ties to the " \
                                    f"lowest index, best first: expected {[want, want]}, got {got}"
        close(g.weights, np.full((2, k), 1 / k), f"bias {bias}, k={k}: the weights ignore the bias (each 1/k)")


@pytest.mark.exercise("16.1")
def test_router_logits_have_two_readers_and_two_outputs(lesson):
    """MoEGPT reads a layer's logits twice (the gate, then the z-loss) and uses both outputs of one
    gate (weights in the layer, probs in the auxiliary loss): top_k_gating must leave its logits
    alone, and the gradients of every use must add up."""
    rng = np.random.default_rng(31)
    logits = rng.standard_normal((6, 5)) * 2
    kept = logits.copy()
    t = Tensor(logits.copy(), requires_grad=True)
    g2 = lesson.top_k_gating(t, 2)
    assert np.array_equal(t.numpy(), kept), \
        "top_k_gating changed its logits in place (e.g. subtracting the row max for stability): the z-loss reads " \
        "them afterwards"
    m = kept.max(axis=1)
    want_z = np.mean((m + np.log(np.exp(kept - m[:, None]).sum(axis=1))) ** 2)
    close(lesson.router_z_loss(t).numpy().reshape(()), want_z, "the z-loss of the logits after the gate read them")
    c2, c, c1 = rng.standard_normal((6, 2)), rng.standard_normal((6, 5)), rng.standard_normal((6, 1))

    def two_gates(z):
        a = lesson.top_k_gating(z, 2)
        b = lesson.top_k_gating(z, 1)
        return ((a.weights * c2).sum() + (a.probs * c).sum() + (b.weights * c1).sum()
                + lesson.load_balancing_loss(a.probs, np.asarray(a.experts)) + lesson.router_z_loss(z))
    grad_check(two_gates, logits)


# ---------------------------------------------------------------- 16.2 dispatch, capacity, grouped GEMM


def routed(seed, t, e, k, skew=0.0):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((t, e)) + skew * np.linspace(1, 0, e)
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def same_dispatch(got, want, what):
    for name in ("token", "slot", "group_sizes", "kept"):
        g = np.asarray(getattr(got, name))
        w = getattr(want, name)
        assert g.shape == w.shape and np.array_equal(g, w), f"{what}: {name} should be\n{w.tolist()}\ngot\n{g.tolist()}"
    assert int(got.dropped) == want.dropped, f"{what}: {want.dropped} assignments dropped, reported {got.dropped}"


@pytest.mark.exercise("16.2")
@settings(max_examples=40)
@given(t=st.integers(0, 30), e=st.integers(1, 7), k=st.integers(1, 3), cap=st.one_of(st.none(), st.integers(0, 8)),
       seed=st.integers(0, 10**6))
@example(t=0, e=3, k=1, cap=None, seed=0)
@example(t=1, e=1, k=1, cap=0, seed=0)
@example(t=20, e=4, k=2, cap=3, seed=7)
def test_dispatch_sorts_and_drops_by_the_rule(lesson, t, e, k, cap, seed):
    k = min(k, e)
    experts = routed(seed, t, e, k, skew=2.0)
    d = lesson.dispatch(experts, e, cap)
    same_dispatch(d, oracle_dispatch(experts, e, cap),
                  f"T={t}, E={e}, k={k}, capacity={cap} (rows sorted by expert, token order within an expert; "
                  "each expert keeps its first `capacity` assignments in token order)")


@pytest.mark.exercise("16.2")
def test_capacity_is_per_expert_not_per_batch(lesson):
    experts = np.array([[0], [0], [0], [0], [1], [2], [0], [1]])
    d = lesson.dispatch(experts, 3, 2)
    want = oracle_dispatch(experts, 3, 2)
    same_dispatch(d, want, "8 tokens, capacity 2 per expert: expert 0 keeps tokens 0 and 1, expert 1 tokens 4 and 7, "
                  "expert 2 token 5")
    assert d.dropped == 3 and d.dropped_tokens == 3, f"3 tokens dropped, got {d.dropped}, {d.dropped_tokens}"
    e2 = np.array([[0, 1], [0, 2], [0, 1], [1, 0]])
    d2 = lesson.dispatch(e2, 3, 1)
    same_dispatch(d2, oracle_dispatch(e2, 3, 1), "top-2, capacity 1")
    assert d2.dropped_tokens == 2, f"tokens 2 and 3 lose both assignments: 2 dropped tokens, got {d2.dropped_tokens}"


@pytest.mark.exercise("16.2")
@settings(max_examples=25)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=6), din=st.integers(1, 5), dout=st.integers(1, 5),
       seed=st.integers(0, 1000))
@example(sizes=[0, 0, 0], din=2, dout=3, seed=0)
@example(sizes=[1], din=1, dout=1, seed=0)
def test_grouped_gemm_equals_per_expert_matmul_and_counts_work(lesson, sizes, din, dout, seed):
    rng = np.random.default_rng(seed)
    r = sum(sizes)
    x, w = rng.standard_normal((r, din)), rng.standard_normal((len(sizes), din, dout))
    calls = []

    def counting(a, b):
        calls.append((a.shape, b.shape))
        return np.matmul(a, b)

    got = lesson.grouped_gemm(x, np.array(sizes), w, matmul=counting)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    want = np.concatenate([x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(len(sizes))]).reshape(r, dout)
    close(got, want, f"group sizes {sizes}")
    macs = sum(a[0] * a[1] * b[1] for a, b in calls)
    assert macs == r * din * dout, \
        f"group sizes {sizes}: the multiply-adds must be rows routed x d_in x d_out = {r * din * dout}, " \
        f"the matmuls did {macs} ({calls}); no padding, no experts x tokens"
    assert [a[0] for a, _ in calls] == [s for s in sizes if s], \
        f"one matmul per non-empty group, of its rows {[s for s in sizes if s]}; got calls with rows {[a[0] for a, _ in calls]}"


@pytest.mark.exercise("16.2")
@pytest.mark.parametrize("t,e,k,cap", [(23, 4, 2, None), (23, 4, 2, 1000), (17, 5, 1, None), (1, 3, 3, None),
                                       (30, 4, 2, 5), (30, 4, 1, 3), (9, 1, 1, 4)])
def test_dispatch_gemm_combine_equals_dense_reference(lesson, t, e, k, cap):
    rng = np.random.default_rng(t * 100 + e)
    c, h = 6, 7
    x = rng.standard_normal((t, c))
    router = rng.standard_normal((c, e)) + np.linspace(0.8, 0, e)
    w1, w2 = rng.standard_normal((e, c, h)), rng.standard_normal((e, h, c))
    p = softmax_np(x @ router)
    experts = topk_np(p, k)
    weights = weights_np(p, experts)
    d = lesson.dispatch(experts, e, cap)
    y = lesson.grouped_gemm(gelu_np(lesson.grouped_gemm(x[np.asarray(d.token)], d.group_sizes, w1)), d.group_sizes, w2)
    out = lesson.combine(y, d, weights, t)
    close(out, dense_np(x, router, w1, w2, k, cap),
          f"T={t}, E={e}, k={k}, capacity {cap}: combine must put w * y back on each row's token (token order, "
          "not dispatch order); dropped assignments add nothing")


@pytest.mark.exercise("16.2")
def test_combine_uses_token_order(lesson):
    experts = np.array([[2], [0], [1], [0]])
    d = oracle_dispatch(experts, 3)
    y = np.array([[10.0], [20.0], [30.0], [40.0]])  # rows in expert order: tokens 1, 3, 2, 0
    weights = np.array([[1.0], [0.5], [2.0], [1.0]])
    got = lesson.combine(y, d, weights, 4)
    close(got, np.array([[40.0], [5.0], [60.0], [20.0]]), "rows for tokens 1, 3, 2, 0 (sorted by expert) with weights 0.5, 1, 2, 1")


@pytest.mark.exercise("16.2")
def test_dispatch_bad_input(lesson):
    with raises(ValueError, match=r"\[0, 3\)|expert"):
        lesson.dispatch(np.array([[0], [3]]), 3)
    with raises(ValueError, match=r"2-D|shape"):
        lesson.dispatch(np.array([0, 1]), 3)
    with raises(ValueError, match=r"capacity"):
        lesson.dispatch(np.array([[0]]), 3, -1)
    with raises(ValueError, match=r"group_sizes|rows"):
        lesson.grouped_gemm(np.ones((4, 2)), np.array([1, 2]), np.ones((2, 2, 3)))


@pytest.mark.exercise("16.2")
def test_dispatch_capacity_bounds(lesson):
    """Loads 3, 2, 1: capacity 3 is exactly expert 0's load (nothing dropped), 2 exactly expert 1's
    (only expert 0 drops, its last assignment), 0 drops everything (0 is a capacity, not "none")."""
    experts = np.array([[0], [1], [0], [0], [2], [1]])
    for cap, dropped in [(3, 0), (2, 1), (1, 3), (0, 6), (None, 0)]:
        d = lesson.dispatch(experts, 3, cap)
        want = oracle_dispatch(experts, 3, cap)
        same_dispatch(d, want, f"loads [3, 2, 1], capacity {cap}: an expert keeps an assignment while it holds fewer "
                               "than `capacity` rows")
        assert int(d.dropped) == dropped, f"loads [3, 2, 1], capacity {cap}: {dropped} dropped, got {d.dropped}"


@pytest.mark.exercise("16.2")
def test_dispatch_and_combine_a_token_that_names_one_expert_twice(lesson):
    """dispatch takes any (T, k) ids: token 0 names expert 0 twice, token 2 expert 2 twice. Both rows
    go to the expert, in slot order, and combine adds both back; experts is read, not changed."""
    experts = np.array([[0, 0], [1, 0], [2, 2]])
    before = experts.copy()
    d = lesson.dispatch(experts, 3)
    same_dispatch(d, oracle_dispatch(experts, 3), "experts [[0, 0], [1, 0], [2, 2]]")
    assert np.array_equal(experts, before), f"dispatch changed its experts argument to {experts.tolist()}"
    y = np.arange(1.0, 7.0)[:, None] * np.array([[1.0, 10.0]])
    weights = np.array([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0]])
    want = np.zeros((3, 2))
    od = oracle_dispatch(experts, 3)
    for r, (t, j) in enumerate(zip(od.token, od.slot)):
        want[t] += weights[t, j] * y[r]
    close(lesson.combine(y, d, weights, 3), want, "combine adds both rows of a token that names an expert twice")


@pytest.mark.exercise("16.2")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sizes", [[0, 3, 0, 2], [1], [0, 0]])
def test_grouped_gemm_and_combine_keep_the_dtype(lesson, dtype, sizes):
    name, tol = np.dtype(dtype).name, 1e-6 if dtype == np.float32 else 1e-12
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    r = sum(sizes)
    x, w = rng.standard_normal((r, 3)).astype(dtype), rng.standard_normal((len(sizes), 3, 2)).astype(dtype)
    y = lesson.grouped_gemm(x, np.array(sizes), w)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    want = np.zeros((r, 2))
    for e in range(len(sizes)):
        want[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]].astype(np.float64) @ w[e]
    assert np.asarray(y).dtype == dtype, \
        f"grouped_gemm of {name} rows and weights (group sizes {sizes}) must return {name}, got {np.asarray(y).dtype}"
    close(y, want, f"grouped_gemm in {name}, group sizes {sizes}", tol)
    experts = np.repeat(np.arange(len(sizes)), sizes)[:, None]  # token t went to the expert of row t
    d = oracle_dispatch(experts, len(sizes))
    weights = rng.uniform(0.5, 1.5, (r, 1)).astype(dtype)
    out = lesson.combine(np.asarray(y), d, weights, r)
    assert np.asarray(out).dtype == dtype, \
        f"combine of {name} rows and weights must return {name}, got {np.asarray(out).dtype}"
    close(out, want * weights, f"combine in {name}, {r} tokens", tol)
    dropped = oracle_dispatch(experts, len(sizes), 0)
    nothing = lesson.combine(np.zeros((0, 2), dtype), dropped, weights, r)
    assert np.asarray(nothing).dtype == dtype and np.array_equal(nothing, np.zeros((r, 2))), \
        f"capacity 0, every assignment dropped: combine returns {r} rows of {name} zeros, got {nothing!r}"


# ---------------------------------------------------------------- 16.3 the MoE layer with autograd


@pytest.mark.exercise("16.3")
@pytest.mark.parametrize("sizes", [[3, 0, 4, 1], [0, 0], [5]])
def test_grouped_matmul_values_and_gradients(lesson, sizes):
    rng = np.random.default_rng(len(sizes))
    r, din, dout = sum(sizes), 3, 4
    x, w = rng.standard_normal((r, din)), rng.standard_normal((len(sizes), din, dout))
    xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    out = lesson.grouped_matmul(xt, np.array(sizes), wt)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    want = np.zeros((r, dout))
    for e in range(len(sizes)):
        want[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]] @ w[e]
    close(out, want, f"grouped_matmul, group sizes {sizes}")
    g = rng.standard_normal((r, dout))
    out.backward(g)
    gx, gw = np.zeros_like(x), np.zeros_like(w)
    for e in range(len(sizes)):
        lo, hi = bounds[e], bounds[e + 1]
        gx[lo:hi], gw[e] = g[lo:hi] @ w[e].T, x[lo:hi].T @ g[lo:hi]
    close(xt.grad, gx, f"group sizes {sizes}: dx_e = g_e w_e^T")
    close(wt.grad, gw, f"group sizes {sizes}: dw_e = x_e^T g_e (zeros for an empty group)")
    if r:
        c = rng.standard_normal((r, dout))
        grad_check(lambda a, b: (lesson.grouped_matmul(a, np.array(sizes), b) * c).sum(), x, w)


@pytest.mark.exercise("16.3")
def test_scatter_rows_values_and_gradient(lesson):
    rng = np.random.default_rng(4)
    src, index = rng.standard_normal((6, 3)), np.array([2, 0, 2, 4, 0, 2])
    want = np.zeros((5, 3))
    np.add.at(want, index, src)
    st_ = Tensor(src, requires_grad=True)
    out = lesson.scatter_rows(st_, index, 5)
    close(out, want, "scatter_rows: out[index[r]] += src[r] (repeated indices add up; row 1 and 3 stay 0)")
    g = rng.standard_normal((5, 3))
    out.backward(g)
    close(st_.grad, g[index], "the gradient of scatter_rows is the gather g[index]")
    with raises(ValueError, match=r"index"):
        lesson.scatter_rows(Tensor(src), np.array([0, 1, 2, 3, 4, 5]), 5)
    with raises(ValueError, match=r"group_sizes"):
        lesson.grouped_matmul(Tensor(np.ones((4, 2))), np.array([1, 2]), Tensor(np.ones((2, 2, 3))))


@pytest.mark.exercise("16.3")
@pytest.mark.parametrize("t,c,e,k,h", [(11, 5, 4, 2, 6), (9, 4, 3, 1, 5), (7, 3, 1, 1, 4), (8, 4, 5, 3, 3)])
def test_moe_layer_equals_dense_reference_values_and_every_gradient(lesson, t, c, e, k, h):
    ops = oracle_ops(lesson, lesson.grouped_matmul, lesson.scatter_rows)
    layer = make_layer(lesson, c, e, k, h, seed=t, ops=ops)
    router, w1, w2 = layer_np(lesson, layer)
    x = np.random.default_rng(t + 1).standard_normal((t, c))
    xt = Tensor(x, requires_grad=True)
    out = layer(xt)
    close(out, dense_np(x, router, w1, w2, k), f"MoEMLP (T={t}, E={e}, k={k}) vs every token through its experts")
    g = np.random.default_rng(0).standard_normal((t, c))
    out.backward(g)
    ref = [Tensor(a, requires_grad=True) for a in (x, router, w1, w2)]
    dense_tensor(*ref, k).backward(g)
    for name, got, want in zip(["x", "router", "w1", "w2"], [xt, layer.router, layer.w1, layer.w2], ref):
        assert got.grad is not None, f"MoEMLP: no gradient reached {name}"
        close(got.grad, want.grad.numpy(), f"MoEMLP (E={e}, k={k}): gradient of {name} vs the dense reference")
    assert layer.last is not None and np.array_equal(np.asarray(layer.last.dispatch.group_sizes),
                                                     oracle_dispatch(topk_np(softmax_np(x @ router), k), e).group_sizes), \
        "MoEMLP.last should record the forward's LayerRecord(logits, gate, dispatch)"


@pytest.mark.exercise("16.3")
def test_moe_layer_gradient_check_and_shapes(lesson):
    ops = oracle_ops(lesson, lesson.grouped_matmul, lesson.scatter_rows)
    layer = make_layer(lesson, 3, 3, 2, 4, seed=1, ops=ops)
    with raises(ValueError, match=r"n_embd|shape"):
        layer(Tensor(np.ones((2, 4))))
    x = np.random.default_rng(2).standard_normal((2, 3, 3))
    out = layer(Tensor(x))
    assert out.shape == (2, 3, 3), f"MoEMLP keeps the input's shape (B, T, C): expected (2, 3, 3), got {out.shape}"
    close(out.numpy().reshape(6, 3), dense_np(x.reshape(6, 3), *layer_np(lesson, layer), 2), "(B, T, C) input")

    def f(xx, r, a, b):
        layer.router, layer.w1, layer.w2 = r, a, b
        return (layer(xx) ** 2).sum()
    grad_check(f, x, *layer_np(lesson, layer))


@pytest.mark.exercise("16.3")
@pytest.mark.parametrize("cf", [None, 0.75])
def test_moe_layer_does_routed_work_only(lesson, cf):
    calls = []

    def counting(x, sizes, w):
        calls.append((x.shape, tuple(np.asarray(sizes).tolist()), w.shape))
        return lesson.grouped_matmul(x, sizes, w)
    ops = oracle_ops(lesson, counting, lesson.scatter_rows)
    t, c, e, k, h = 24, 4, 6, 2, 5
    layer = make_layer(lesson, c, e, k, h, seed=4, ops=ops, capacity_factor=cf)
    x = np.random.default_rng(5).standard_normal((t, c))
    layer(Tensor(x))
    cap = None if cf is None else math.ceil(cf * t * k / e)
    d = oracle_dispatch(topk_np(softmax_np(x @ layer.router.numpy()), k), e, cap)
    rows = len(d.token)
    want = [((rows, c), tuple(d.group_sizes.tolist()), (e, c, h)), ((rows, h), tuple(d.group_sizes.tolist()), (e, h, c))]
    assert calls == want, \
        f"capacity factor {cf}: the layer should run ops.grouped_matmul twice on the {rows} routed rows (grouped as " \
        f"{d.group_sizes.tolist()}), x @ w1 then h @ w2, not every expert on every token; calls were {calls}"


@pytest.mark.exercise("16.3")
def test_moe_layer_with_capacity_drops_to_the_residual(lesson):
    ops = oracle_ops(lesson, lesson.grouped_matmul, lesson.scatter_rows)
    t, c, e, k = 20, 4, 4, 1
    layer = make_layer(lesson, c, e, k, 5, seed=3, ops=ops, capacity_factor=1.0)
    router, w1, w2 = layer_np(lesson, layer)
    router += np.array([2.0, 0, 0, 0])  # expert 0 overloaded
    layer.router.data[...] = router
    x = np.random.default_rng(9).standard_normal((t, c)) + 1
    out = layer(Tensor(x)).numpy()
    cap = math.ceil(1.0 * t * k / e)
    want = dense_np(x, router, w1, w2, k, cap)
    d = oracle_dispatch(topk_np(softmax_np(x @ router), k), e, cap)
    assert d.dropped > 0
    close(out, want, f"capacity factor 1.0 (capacity {cap}): dropped tokens output 0 (the residual carries them)")


def recording_ops(lesson, caps):
    """The test's router and dispatch (oracles) with the layer's grouped_matmul and scatter_rows; the
    capacity each forward passes to ops.dispatch is appended to caps."""
    def dispatch(experts, n_experts, capacity=None):
        caps.append(capacity)
        return oracle_dispatch(experts, n_experts, capacity)
    return lesson.MoEOps(oracle_gate, dispatch, lesson.grouped_matmul, lesson.scatter_rows)


@pytest.mark.exercise("16.3")
@pytest.mark.parametrize("shape,cf,cap", [((3, 5), 1.0, 8), ((3, 5), 1.25, 10), ((2, 6), 1.0, 6), ((15,), 1.0, 8)])
def test_moe_layer_capacity_counts_every_token_of_the_batch(lesson, shape, cf, cap):
    """capacity = ceil(cf * N * k / E) with N every token of the call: for x (B, T, C), N = B * T. With
    E = 4, k = 2: (3, 5) tokens at cf 1.0 give 8 (T alone would give 3, B alone 2); (2, 6) at cf 1.0
    give exactly 6, not 7."""
    c, e, k = 4, 4, 2
    caps = []
    layer = make_layer(lesson, c, e, k, 5, seed=sum(shape), ops=recording_ops(lesson, caps), capacity_factor=cf)
    router, w1, w2 = layer_np(lesson, layer)
    layer.router.data[...] = router + np.array([1.5, 0.5, 0, 0])  # uneven: the capacity drops rows
    x = np.random.default_rng(7).standard_normal((*shape, c)) + 0.5
    out = layer(Tensor(x))
    n = math.prod(shape)
    assert caps == [cap], \
        f"x of shape {x.shape}: {n} tokens, capacity factor {cf}, E={e}, k={k}: ops.dispatch should get capacity " \
        f"ceil({cf} * {n} * {k} / {e}) = {cap} (every token of the call, not one batch row or one position); got {caps}"
    want = dense_np(x.reshape(n, c), layer.router.numpy(), w1, w2, k, cap)
    assert oracle_dispatch(topk_np(softmax_np(x.reshape(n, c) @ layer.router.numpy()), k), e, cap).dropped > 0
    close(out.numpy().reshape(n, c), want, f"x {x.shape}, capacity {cap}: the layer drops what dispatch drops")
    assert out.shape == x.shape, f"the output has x's shape {x.shape}, got {out.shape}"


@pytest.mark.exercise("16.3")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_moe_layer_and_its_ops_keep_the_dtype(lesson, dtype):
    name, tol = np.dtype(dtype).name, 2e-6 if dtype == np.float32 else 1e-12
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal((5, 3)).astype(dtype), rng.standard_normal((3, 3, 2)).astype(dtype)
    xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    y = lesson.grouped_matmul(xt, np.array([2, 0, 3]), wt)
    assert y.dtype == dtype, f"grouped_matmul of {name} x and w must return {name}, got {y.dtype}"
    close(y, np.concatenate([x[:2].astype(np.float64) @ w[0], x[2:].astype(np.float64) @ w[2]]),
          f"grouped_matmul in {name}", tol)
    y.backward(np.ones((5, 2), dtype))
    assert xt.grad.dtype == dtype and wt.grad.dtype == dtype, f"{name} gradients, got {xt.grad.dtype}, {wt.grad.dtype}"
    empty = lesson.grouped_matmul(Tensor(np.zeros((0, 3), dtype)), np.array([0, 0, 0]), Tensor(w))
    assert empty.shape == (0, 2) and empty.dtype == dtype, \
        f"grouped_matmul of no rows: ({0}, 2) {name}, got {empty.shape} {empty.dtype}"
    s = lesson.scatter_rows(Tensor(x), np.array([3, 0, 3, 1, 0]), 4)
    assert s.dtype == dtype, f"scatter_rows of {name} rows must return {name}, got {s.dtype}"
    none = lesson.scatter_rows(Tensor(np.zeros((0, 3), dtype)), np.zeros(0, np.int64), 2)
    assert none.shape == (2, 3) and none.dtype == dtype and not none.numpy().any(), \
        f"scatter_rows of no rows into 2: a (2, 3) {name} zero array, got {none.shape} {none.dtype}"
    layer = lesson.MoEMLP(4, 3, 2, 5, np.random.default_rng(2), dtype=dtype, init=0.5, proj_init=0.5,
                          ops=oracle_ops(lesson, lesson.grouped_matmul, lesson.scatter_rows))
    router, w1, w2 = (a.astype(np.float64) for a in layer_np(lesson, layer))
    for xs in [(6, 4), (1, 4), (0, 4), (2, 3, 4), (2, 0, 4)]:
        xx = rng.standard_normal(xs).astype(dtype)
        out = layer(Tensor(xx))
        assert out.dtype == dtype and out.shape == xs, \
            f"a {name} MoEMLP given {name} x of shape {xs} returns {name} of the same shape, got {out.dtype} {out.shape}"
        flat = xx.reshape(-1, 4).astype(np.float64)
        if len(flat):
            close(out.numpy().reshape(-1, 4), dense_np(flat, router, w1, w2, 2), f"{name} MoEMLP, x {xs}", 1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.exercise("16.3")
def test_moe_layer_applied_twice_gets_both_gradients(lesson):
    """One layer used twice in one graph, y = layer(layer(x)) + x: every gradient is the sum over
    both uses (nothing the backward needs may live in the layer, which the second call overwrites)."""
    ops = oracle_ops(lesson, lesson.grouped_matmul, lesson.scatter_rows)
    layer = make_layer(lesson, 4, 4, 2, 5, seed=21, ops=ops)
    x = np.random.default_rng(22).standard_normal((9, 4))
    xt = Tensor(x, requires_grad=True)
    out = layer(layer(xt)) + xt
    g = np.random.default_rng(23).standard_normal((9, 4))
    out.backward(g)
    ref = [Tensor(a, requires_grad=True) for a in (x, *layer_np(lesson, layer))]
    want = dense_tensor(dense_tensor(ref[0], *ref[1:], 2), *ref[1:], 2) + ref[0]
    want.backward(g)
    close(out, want.numpy(), "layer(layer(x)) + x vs the dense reference")
    for name, got, w in zip(["x", "router", "w1", "w2"], [xt, layer.router, layer.w1, layer.w2], ref):
        assert got.grad is not None, f"layer applied twice: no gradient reached {name}"
        close(got.grad, w.grad.numpy(), f"layer applied twice: the gradient of {name} sums both uses")
    first = layer_np(lesson, layer)
    assert np.array_equal(np.asarray(layer.last.dispatch.group_sizes), oracle_dispatch(
        topk_np(softmax_np(dense_np(x, *first, 2) @ first[0]), 2), 4).group_sizes), \
        "MoEMLP.last must record the second (the last) forward"


# ---------------------------------------------------------------- 16.4 all-to-all


def a2a_case(n, seed, width=3, dtype=np.float64, zero_some=True):
    """counts[i][j]: rows rank i sends to rank j; xs[i]: rank i's rows, distinct values."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5, (n, n))
    if zero_some and n > 1:
        counts[0, n - 1] = 0
        counts[n - 1, n - 1] = 0
    shape = (-1, width) if width else (-1,)
    xs = [(np.arange(counts[i].sum() * max(width, 1)) + 1000 * i).astype(dtype).reshape(shape) for i in range(n)]
    return counts, xs


def a2a_reference(counts, xs, r):
    """The permutation: the block rank s holds for rank r, for every s, in rank order."""
    out = []
    for s in range(len(xs)):
        off = np.concatenate([[0], np.cumsum(counts[s])])
        out.append(xs[s][off[r]:off[r + 1]])
    return np.concatenate(out, axis=0)


def a2a_job(comm, a2a, counts, xs):
    r = comm.rank
    x = xs[r]
    before = x.copy()
    out = a2a(comm, x, counts[r], counts[:, r])
    assert np.array_equal(x, before), f"rank {r}: all_to_all modified its input"
    return out


@pytest.mark.exercise("16.4")
@pytest.mark.parametrize("dtype,width", [(np.float64, 3), (np.int32, 0), (np.float32, 2)])
def test_all_to_all_is_the_reference_permutation(lesson, dtype, width):
    for n in range(1, 9):
        counts, xs = a2a_case(n, seed=n, width=width, dtype=dtype)
        res = sim(lesson, a2a_job, n, lesson.all_to_all, counts, xs)
        for r, got in enumerate(res.results):
            want = a2a_reference(counts, xs, r)
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape \
                and np.array_equal(got, want), \
                f"{n} ranks, send counts (row i: rank i's counts)\n{counts}\nrank {r} should receive\n{want}\ngot\n{got}"
        row_bytes = np.dtype(dtype).itemsize * max(width, 1)
        for r, st_ in enumerate(res.stats):
            want_bytes = int(sum(counts[r, j] for j in range(n) if j != r) * row_bytes)
            assert st_["bytes_sent"] == want_bytes, \
                f"{n} ranks: rank {r} should send sum over j != r of its rows for j x {row_bytes} bytes = {want_bytes}, " \
                f"sent {st_['bytes_sent']} (its own block stays local)"
            assert st_["msgs_sent"] == n - 1 and set(st_["sent_to"]) == set(range(n)) - {r}, \
                f"{n} ranks: rank {r} should send one message to each other rank (empty blocks too), " \
                f"sent {st_['msgs_sent']} to {sorted(st_['sent_to'])}"


@pytest.mark.exercise("16.4")
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_all_to_all_time_is_pairwise_exchange(lesson, n):
    m = 7
    counts = np.full((n, n), m)
    xs = [np.zeros((n * m, 4)) for _ in range(n)]
    res = sim(lesson, a2a_job, n, lesson.all_to_all, counts, xs)
    want = (n - 1) * (ALPHA + m * 4 * 8 * BETA)
    assert math.isclose(res.time, want, rel_tol=1e-9), \
        f"{n} ranks, {m * 32} bytes per block: (N-1)(alpha + m beta) = {want:.6g} s, simulated {res.time:.6g} s " \
        "(step s: send to rank + s, receive from rank - s)"
    peers = [[e.peer for e in res.events(r, "send")] for r in range(n)]
    assert all(p == [(r + s) % n for s in range(1, n)] for r, p in enumerate(peers)), \
        f"step s sends to (rank + s) % N; sends per rank went to {peers}"


class CallLog:
    """Forwards every call to the communicator and logs (name, peer, the array) of the point-to-point
    ones, so a test can see how an all-to-all posts its messages."""

    def __init__(self, comm):
        self._comm, self.calls = comm, []
        self.rank, self.size, self.engine = comm.rank, comm.size, comm.engine

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in ("send", "recv", "sendrecv", "isend", "irecv", "waitall", "barrier"):
            return attr

        def logged(*args, **kwargs):
            self.calls.append((name, args))
            return attr(*args, **kwargs)
        return logged


def logged_a2a_job(comm, a2a, counts, xs):
    log = CallLog(comm)
    out = a2a(log, xs[comm.rank], counts[comm.rank], counts[:, comm.rank])
    return out, [(name, args[1] if name in ("isend", "irecv") else None,
                  (args[0].size == 0 or np.shares_memory(args[0], out)) if name == "irecv" else None)
                 for name, args in log.calls]


@pytest.mark.exercise("16.4")
@pytest.mark.parametrize("n", [2, 3, 6])
def test_all_to_all_posts_receives_into_the_result_then_sends(lesson, n):
    counts, xs = a2a_case(n, seed=30 + n)
    res = sim(lesson, logged_a2a_job, n, lesson.all_to_all, counts, xs)
    for r, (out, calls) in enumerate(res.results):
        names = [c[0] for c in calls]
        want = ["irecv"] * (n - 1) + ["isend"] * (n - 1) + ["waitall"]
        assert names == want, \
            f"{n} ranks, rank {r}: post every irecv (into the result), then every isend, then one waitall; the " \
            f"calls were {names}"
        srcs = [c[1] for c in calls if c[0] == "irecv"]
        dsts = [c[1] for c in calls if c[0] == "isend"]
        assert srcs == [(r - s) % n for s in range(1, n)] and dsts == [(r + s) % n for s in range(1, n)], \
            f"{n} ranks, rank {r}: step s receives from (rank - s) % N and sends to (rank + s) % N; receives from " \
            f"{srcs}, sends to {dsts}"
        assert all(c[2] for c in calls if c[0] == "irecv"), \
            f"{n} ranks, rank {r}: every irecv must receive into its rows of the array all_to_all returns (no " \
            "buffer per block, no concatenation afterwards)"


def tagged_job(comm, a2a, counts, xs):
    """A message of another exchange in flight on tag 0 (an isend of one int8 to the right
    neighbour), then all_to_all on tag 3, then that message received."""
    n, r = comm.size, comm.rank
    stray = comm.isend(np.array([r], np.int8), (r + 1) % n, tag=0)
    out = a2a(comm, xs[r], counts[r], counts[:, r], tag=3)
    got = np.empty(1, np.int8)
    comm.waitall([stray, comm.irecv(got, (r - 1) % n, tag=0)])
    return out, int(got[0])


@pytest.mark.exercise("16.4")
def test_all_to_all_sends_on_its_tag(lesson):
    n = 3
    counts, xs = a2a_case(n, seed=33)
    res = sim(lesson, tagged_job, n, lesson.all_to_all, counts, xs)
    for r, (out, got) in enumerate(res.results):
        assert np.array_equal(out, a2a_reference(counts, xs, r)) and got == (r - 1) % n, \
            f"rank {r}: all_to_all(..., tag=3) must send and receive on tag 3 (pass tag to isend and irecv), " \
            "leaving another exchange's messages on tag 0 alone"


def counts_job(comm, fn, counts):
    return fn(comm, counts[comm.rank])


@pytest.mark.exercise("16.4")
def test_exchange_counts_and_mismatch(lesson):
    for n in (1, 3, 6):
        counts = np.random.default_rng(n).integers(0, 9, (n, n))
        res = sim(lesson, counts_job, n, lesson.exchange_counts, counts)
        for r, got in enumerate(res.results):
            assert np.array_equal(np.asarray(got), counts[:, r]), \
                f"{n} ranks, send counts\n{counts}\nrank {r} should learn column {r}: {counts[:, r]}, got {got}"
    counts, xs = a2a_case(3, seed=11)
    bad = counts.copy()

    def wrong_recv(comm, a2a, counts, xs):
        r = comm.rank
        return a2a(comm, xs[r], counts[r], bad[:, r] + (r == 1))
    own = int(counts[1, 1])
    with raises(ValueError, match=rf"rank 1\b.*send_counts\[1\] = {own}\b.*recv_counts\[1\] = {own + 1}\b"):
        sim(lesson, wrong_recv, 3, lesson.all_to_all, counts, xs)

    def wrong_send(comm, a2a):
        return a2a(comm, np.ones((5, 2)), [2, 2], [2, 2])
    with raises(ValueError, match=r"send_counts"):
        sim(lesson, wrong_send, 2, lesson.all_to_all)

    def too_few_counts(comm, a2a):
        return a2a(comm, np.ones((2, 2)), [2], [2])
    with raises(ValueError, match=r"counts"):
        sim(lesson, too_few_counts, 2, lesson.all_to_all)

    def alone(comm, a2a):
        x = np.ones((3, 2))
        return np.shares_memory(a2a(comm, x, [3], [3]), x)
    assert not sim(lesson, alone, 1, lesson.all_to_all).results[0], \
        "on one rank all_to_all must still return a new array, not a view of x"


def round_trip_job(comm, a2a, counts, xs, dtype):
    """All-to-all there and back (counts swapped) on one tag, twice in a row."""
    r = comm.rank
    x = xs[r].astype(dtype)
    before = x.copy()
    there = a2a(comm, x, counts[r], counts[:, r])
    back = a2a(comm, there, counts[:, r], counts[r])
    again = a2a(comm, x, counts[r], counts[:, r])
    return x, before, there, back, again


@pytest.mark.exercise("16.4")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_to_all_round_trip_and_empty_exchanges(lesson, dtype):
    name = np.dtype(dtype).name
    for n in (1, 2, 3):
        for counts, xs in [a2a_case(n, seed=90 + n), (np.zeros((n, n), np.int64), [np.zeros((0, 3))] * n)]:
            res = sim(lesson, round_trip_job, n, lesson.all_to_all, counts, xs, dtype)
            for r, (x, before, there, back, again) in enumerate(res.results):
                what = f"{n} ranks, send counts {counts.tolist()}, {name}, rank {r}"
                want = a2a_reference(counts, [a.astype(dtype) for a in xs], r)
                assert there.dtype == dtype and there.shape == want.shape and np.array_equal(there, want), \
                    f"{what}: expected {want.shape} {name}\n{want}\ngot {there.shape} {there.dtype}\n{there}"
                assert np.array_equal(again, want), f"{what}: the same all-to-all a second time gave\n{again}"
                assert back.dtype == dtype and np.array_equal(back, before), \
                    f"{what}: all-to-all there and back (counts swapped) must give x again:\n{before}\ngot\n{back}"
                assert np.array_equal(x, before), f"{what}: all_to_all changed its input"
                assert not np.shares_memory(there, x) and not np.shares_memory(again, x), \
                    f"{what}: the result must be a new array (the own block copied), not a view of x"


# ---------------------------------------------------------------- 16.5 expert parallelism


def a2a_op_job(comm, op, counts, xs, gs):
    r = comm.rank
    x = Tensor(xs[r], requires_grad=True)
    out = op(comm, x, counts[r], counts[:, r], oracle_a2a)
    out.backward(gs[r])
    return out.numpy(), x.grad.numpy()


@pytest.mark.exercise("16.5")
def test_all_to_all_op_backward_sends_gradients_home(lesson):
    for n in (1, 2, 4):
        counts, xs = a2a_case(n, seed=20 + n)
        gs = [np.random.default_rng(r).standard_normal((counts[:, r].sum(), 3)) for r in range(n)]
        res = sim(lesson, a2a_op_job, n, lesson.all_to_all_op, counts, xs, gs)
        for r, (out, gx) in enumerate(res.results):
            close(out, a2a_reference(counts, xs, r), f"{n} ranks, rank {r}: all_to_all_op forward")
            close(gx, a2a_reference(counts.T, gs, r),
                  f"{n} ranks, rank {r}: the gradient of an all-to-all is the all-to-all back (counts swapped)")


def ep_job(comm, EP, layer, xs, gs):
    ep = EP(comm, layer, a2a=oracle_a2a)
    x = Tensor(xs[comm.rank], requires_grad=True)
    out = ep(x)
    out.backward(gs[comm.rank])
    grads = [p.grad.numpy() if p.grad is not None else None for p in (ep.router, ep.w1, ep.w2)]
    return out.numpy(), x.grad.numpy(), grads


def ep_case(lesson, n, e, k, seed, t_per_rank=(5, 0, 7, 3)):
    c, h = 4, 5
    layer = make_layer(lesson, c, e, k, h, seed, ops=oracle_ops(lesson))
    rng = np.random.default_rng(seed + 1)
    sizes = [t_per_rank[r % len(t_per_rank)] for r in range(n)]
    xs = [rng.standard_normal((s, c)) for s in sizes]
    gs = [rng.standard_normal((s, c)) for s in sizes]
    return layer, xs, gs


@pytest.mark.exercise("16.5")
@pytest.mark.parametrize("n,e,k", [(1, 3, 2), (2, 4, 2), (4, 4, 1), (4, 8, 2), (3, 6, 3)])
def test_expert_parallel_equals_one_process(lesson, n, e, k):
    layer, xs, gs = ep_case(lesson, n, e, k, seed=n * 10 + e)
    res = sim(lesson, ep_job, n, lesson.ExpertParallelMoE, layer, xs, gs)
    router, w1, w2 = layer_np(lesson, layer)
    x = np.concatenate(xs)
    ref = [Tensor(a, requires_grad=True) for a in (x, router, w1, w2)]
    out = dense_tensor(*ref, k)
    out.backward(np.concatenate(gs))
    lo = 0
    el = e // n
    for r, (y, gx, (g_router, g_w1, g_w2)) in enumerate(res.results):
        hi = lo + len(xs[r])
        what = f"EP on {n} ranks, E={e}, k={k}, rank {r}"
        close(y, out.numpy()[lo:hi], f"{what}: output vs one process")
        close(gx, ref[0].grad.numpy()[lo:hi], f"{what}: gradient of its tokens")
        close(g_w1, ref[2].grad.numpy()[r * el:(r + 1) * el], f"{what}: gradient of its experts' w1 (all tokens)")
        close(g_w2, ref[3].grad.numpy()[r * el:(r + 1) * el], f"{what}: gradient of its experts' w2")
        lo = hi
    router_sum = sum(r[2][0] for r in res.results)
    close(router_sum, ref[1].grad.numpy(), f"EP on {n} ranks: the router gradients summed over ranks")
    if n == 2:
        bad = make_layer(lesson, 4, 3, 1, 5, seed=0, ops=oracle_ops(lesson))
        with raises(ValueError, match=r"3 experts.*2 ranks"):
            sim(lesson, ep_bad_job, 2, lesson.ExpertParallelMoE, bad)


def ep_count_job(comm, EP, layer, xs):
    log = []

    def counting_a2a(comm_, x, send_counts, recv_counts, tag=0):
        x = np.asarray(x)
        if x.dtype.kind == "f":
            log.append((np.asarray(send_counts).tolist(), np.asarray(recv_counts).tolist()))
        return oracle_a2a(comm_, x, send_counts, recv_counts, tag)
    ep = EP(comm, layer, a2a=counting_a2a)
    out = ep(Tensor(xs[comm.rank], requires_grad=True))
    out.sum().backward()
    return log


@pytest.mark.exercise("16.5")
def test_expert_parallel_sends_each_routed_row_to_its_experts_rank(lesson):
    n, e, k = 4, 8, 2
    layer, xs, _ = ep_case(lesson, n, e, k, seed=77, t_per_rank=(6, 9, 0, 4))
    res = sim(lesson, ep_count_job, n, lesson.ExpertParallelMoE, layer, xs)
    router = layer.router.numpy()
    sends = []
    for r in range(n):
        experts = topk_np(softmax_np(xs[r] @ router), k) if len(xs[r]) else np.zeros((0, k), np.int64)
        sends.append(np.bincount(experts.ravel() // (e // n), minlength=n).tolist())
    for r, log in enumerate(res.results):
        recv = [sends[s][r] for s in range(n)]
        want = [(sends[r], recv), (recv, sends[r]), (sends[r], recv), (recv, sends[r])]
        assert log == want, \
            f"EP on {n} ranks, rank {r}: the all-to-alls of rows should be (send counts, receive counts) = dispatch " \
            f"{want[0]}, combine {want[1]}, then in the backward the combine's and the dispatch's swapped: " \
            f"{want[2:]}; got {log} (each routed row travels once to its expert's rank and once back)"


def ep_bad_job(comm, EP, layer):
    return EP(comm, layer, a2a=oracle_a2a)


def ep_dp_job(comm, EP, step, ep_dp_groups, layer, xs, ys, ep, steps, lr, total, allreduce):
    ep_group, dp_group = ep_dp_groups(comm, ep)
    model = EP(ep_group, layer, a2a=oracle_a2a)

    def loss_fn(out, y):
        diff = out - y
        return (diff * diff).sum() * (1.0 / total)
    losses = [step(comm, dp_group, model, xs[s][comm.rank], ys[s][comm.rank], loss_fn, lr, allreduce)
              for s in range(steps)]
    return losses, model.router.numpy(), model.w1.numpy(), model.w2.numpy()


def oracle_allreduce(comm, x):
    x = np.asarray(x)
    if comm.rank == 0:
        total = x.copy()
        for r in range(1, comm.size):
            total += comm.recv(r, tag=77)
        for r in range(1, comm.size):
            comm.send(total, r, tag=77)
        return total
    comm.send(x, 0, tag=77)
    return comm.recv(0, tag=77)


def ep_dp_data(n, steps, c, seed):
    rng = np.random.default_rng(seed)
    sizes = [3 + (r * 2) % 5 for r in range(n)]
    xs = [[rng.standard_normal((s, c)) for s in sizes] for _ in range(steps)]
    ys = [[rng.standard_normal((s, c)) for s in sizes] for _ in range(steps)]
    return xs, ys, sum(sizes)


@pytest.mark.exercise("16.5")
@pytest.mark.parametrize("dp,ep", [(2, 2), (1, 2), (2, 1), (3, 2)])
def test_ep_dp_training_equals_one_process(lesson, dp, ep):
    n, e, k, c, steps, lr = dp * ep, 4, 2, 4, 3, 0.3
    layer = make_layer(lesson, c, e, k, 5, seed=dp * 7 + ep, ops=oracle_ops(lesson))
    xs, ys, total = ep_dp_data(n, steps, c, seed=n)
    res = sim(lesson, ep_dp_job, n, lesson.ExpertParallelMoE, lesson.ep_dp_train_step, lesson.ep_dp_groups, layer, xs, ys, ep, steps, lr,
              total, oracle_allreduce)
    params = [Tensor(a.copy(), requires_grad=True) for a in layer_np(lesson, layer)]
    want_losses = []
    for s in range(steps):
        for p in params:
            p.zero_grad()
        x = Tensor(np.concatenate(xs[s]))
        diff = dense_tensor(x, *params, k) - np.concatenate(ys[s])
        loss = (diff * diff).sum() * (1.0 / total)
        loss.backward()
        want_losses.append(loss.item())
        for p in params:
            p.data -= lr * p.grad.data
    el = e // ep
    for r, (losses, router, w1, w2) in enumerate(res.results):
        what = f"EP x DP, dp={dp}, ep={ep}, rank {r} after {steps} SGD steps"
        close(router, params[0].numpy(), f"{what}: router (reduce its gradient over all ranks)")
        j = r % ep
        close(w1, params[1].numpy()[j * el:(j + 1) * el], f"{what}: its experts' w1 (reduce expert gradients over the "
              "DP group: the ranks holding the same experts)")
        close(w2, params[2].numpy()[j * el:(j + 1) * el], f"{what}: its experts' w2")
    first = [sum(res.results[r][0][s] for r in range(n)) for s in range(steps)]
    close(np.array(first), np.array(want_losses), "the ranks' losses add up to the one-process loss at every step")


def logging_a2a(log):
    """The test's all-to-all, logging (rank, dtype) of every floating-point array it sends."""
    def a2a(comm, x, send_counts, recv_counts, tag=0):
        x = np.asarray(x)
        if x.dtype.kind == "f":
            log.append((comm.rank, x.dtype.name))
        return oracle_a2a(comm, x, send_counts, recv_counts, tag)
    return a2a


def a2a_op_dtype_job(comm, op, counts, xs, cs, dtype):
    """Forward in dtype; the loss multiplies by float64 constants, so a float64 gradient reaches the op."""
    log = []
    x = Tensor(xs[comm.rank].astype(dtype), requires_grad=True)
    out = op(comm, x, counts[comm.rank], counts[:, comm.rank], logging_a2a(log))
    (out * Tensor(cs[comm.rank])).sum().backward()
    return out.numpy(), x.grad.numpy(), log


@pytest.mark.exercise("16.5")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_to_all_op_sends_the_dtype_of_its_input_both_ways(lesson, dtype):
    name = np.dtype(dtype).name
    n = 3
    counts, xs = a2a_case(n, seed=41)
    cs = [np.random.default_rng(r).standard_normal((counts[:, r].sum(), 3)) for r in range(n)]
    res = sim(lesson, a2a_op_dtype_job, n, lesson.all_to_all_op, counts, xs, cs, dtype)
    for r, (out, gx, log) in enumerate(res.results):
        assert out.dtype == dtype and gx.dtype == dtype, f"rank {r}: {name} in, {name} out and gradient; got " \
                                                         f"{out.dtype}, {gx.dtype}"
        close(out, a2a_reference(counts, [a.astype(dtype) for a in xs], r), f"rank {r}: all_to_all_op forward")
        close(gx, a2a_reference(counts.T, [c.astype(dtype) for c in cs], r), f"rank {r}: the gradient sent home",
              1e-6 if dtype == np.float32 else 1e-12)
        assert log == [(r, name), (r, name)], \
            f"rank {r}: the forward and the backward all-to-all should each send {name} (a {name} input's gradient " \
            f"is {name}, even where the loss was computed in float64: cast it); sent {[d for _, d in log]}"


def ep_float_job(comm, EP, layer, xs):
    log = []
    ep = EP(comm, layer, a2a=logging_a2a(log))
    x = Tensor(xs[comm.rank], requires_grad=True)
    out = ep(x)
    out.sum().backward()
    return out.numpy(), ep.w1.grad.numpy(), log


@pytest.mark.exercise("16.5")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_expert_parallel_keeps_the_layer_dtype(lesson, dtype):
    name = np.dtype(dtype).name
    n, e, k, c = 2, 4, 2, 4
    layer = lesson.MoEMLP(c, e, k, 5, np.random.default_rng(5), dtype=dtype, init=0.5, proj_init=0.5,
                          ops=oracle_ops(lesson))
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((t, c)).astype(dtype) for t in (6, 3)]
    res = sim(lesson, ep_float_job, n, lesson.ExpertParallelMoE, layer, xs)
    router, w1, w2 = (a.astype(np.float64) for a in layer_np(lesson, layer))
    want = dense_np(np.concatenate(xs).astype(np.float64), router, w1, w2, k)
    lo = 0
    for r, (out, g_w1, log) in enumerate(res.results):
        assert out.dtype == dtype and g_w1.dtype == dtype, \
            f"EP of a {name} layer on {name} tokens, rank {r}: output and gradients {name}, got {out.dtype}, {g_w1.dtype}"
        close(out, want[lo:lo + len(xs[r])], f"EP in {name}, rank {r}", 1e-5 if dtype == np.float32 else 1e-12)
        lo += len(xs[r])
        assert log and {d for _, d in log} == {name}, \
            f"EP of a {name} layer, rank {r}: every all-to-all of rows should send {name}; sent {[d for _, d in log]}"


@pytest.mark.exercise("16.5")
@pytest.mark.parametrize("n", [2, 4])
def test_expert_parallel_layer_applied_twice(lesson, n):
    """ep(ep(x)): two forward passes of one EP layer in one graph, then one backward through both:
    eight all-to-alls of rows per rank, every gradient the sum over both uses."""
    layer, xs, gs = ep_case(lesson, n, 4, 2, seed=55, t_per_rank=(5, 0, 7, 3))

    def job(comm, EP, layer, xs, gs):
        ep = EP(comm, layer, a2a=oracle_a2a)
        x = Tensor(xs[comm.rank], requires_grad=True)
        out = ep(ep(x))
        out.backward(gs[comm.rank])
        return out.numpy(), x.grad.numpy(), ep.w1.grad.numpy(), ep.w2.grad.numpy(), ep.router.grad.numpy()
    res = sim(lesson, job, n, lesson.ExpertParallelMoE, layer, xs, gs)
    ref = [Tensor(a, requires_grad=True) for a in (np.concatenate(xs), *layer_np(lesson, layer))]
    out = dense_tensor(dense_tensor(ref[0], *ref[1:], 2), *ref[1:], 2)
    out.backward(np.concatenate(gs))
    lo, el = 0, 4 // n
    for r, (y, gx, g1, g2, gr) in enumerate(res.results):
        hi = lo + len(xs[r])
        what = f"ep(ep(x)) on {n} ranks, rank {r}"
        close(y, out.numpy()[lo:hi], f"{what}: output vs one process")
        close(gx, ref[0].grad.numpy()[lo:hi], f"{what}: gradient of its tokens (both uses)")
        close(g1, ref[2].grad.numpy()[r * el:(r + 1) * el], f"{what}: gradient of its experts' w1 (both uses)")
        close(g2, ref[3].grad.numpy()[r * el:(r + 1) * el], f"{what}: gradient of its experts' w2 (both uses)")
        lo = hi
    close(sum(r[4] for r in res.results), ref[1].grad.numpy(), f"ep(ep(x)) on {n} ranks: router gradients summed")


def ep_dp_dtype_job(comm, EP, step, ep_dp_groups, layer, xs, ys):
    log = []
    ep_group, dp_group = ep_dp_groups(comm, 2)
    model = EP(ep_group, layer, a2a=logging_a2a(log))
    reduced = []

    def allreduce(c, x):
        reduced.append(np.asarray(x).dtype.name)
        return oracle_allreduce(c, x)

    def loss_fn(out, y):
        diff = out - y
        return (diff * diff).sum() * (1.0 / 14)
    for s in range(2):
        step(comm, dp_group, model, xs[s][comm.rank], ys[s][comm.rank], loss_fn, 0.3, allreduce)
    return [p.numpy() for p in (model.router, model.w1, model.w2)], sorted({d for _, d in log}), sorted(set(reduced))


@pytest.mark.exercise("16.5")
def test_ep_dp_step_casts_its_input_to_the_parameters_dtype(lesson):
    """A float32 EP x DP model fed float64 data (NumPy's default) must cast it, as lesson 12's
    dp_train_step does: otherwise every all-to-all sends float64 rows, twice the bytes."""
    n, e, k, c = 4, 4, 2, 4
    layer = lesson.MoEMLP(c, e, k, 5, np.random.default_rng(8), dtype=np.float32, init=0.5, proj_init=0.5,
                          ops=oracle_ops(lesson))
    rng = np.random.default_rng(9)
    sizes = (5, 3, 0, 6)
    xs = [[rng.standard_normal((t, c)) for t in sizes] for _ in range(2)]
    ys = [[rng.standard_normal((t, c)) for t in sizes] for _ in range(2)]
    res = sim(lesson, ep_dp_dtype_job, n, lesson.ExpertParallelMoE, lesson.ep_dp_train_step, lesson.ep_dp_groups,
              layer, xs, ys)
    params = [Tensor(a.astype(np.float64), requires_grad=True) for a in layer_np(lesson, layer)]
    for s in range(2):
        for p in params:
            p.zero_grad()
        diff = dense_tensor(Tensor(np.concatenate(xs[s]).astype(np.float32).astype(np.float64)), *params, k) \
            - np.concatenate(ys[s])
        ((diff * diff).sum() * (1.0 / 14)).backward()
        for p in params:
            p.data -= 0.3 * p.grad.data
    for r, (got, sent, reduced) in enumerate(res.results):
        assert sent == ["float32"], \
            f"EP x DP with float32 parameters and float64 x, rank {r}: the all-to-alls sent {sent}; cast x to the " \
            "parameters' dtype before the forward pass"
        assert reduced == ["float32"], f"rank {r}: the gradient all-reduces got {reduced}, expected float32"
        mine = slice(r % 2 * 2, r % 2 * 2 + 2)  # ep = 2: rank r holds experts of EP position r % 2
        for name, g, w, sl in zip(["router", "w1", "w2"], got, params, [slice(None), mine, mine]):
            want = w.numpy()[sl]
            assert g.dtype == np.float32, f"rank {r}: {name} must stay float32, got {g.dtype}"
            close(g, want, f"EP x DP in float32, rank {r}: {name} after 2 steps", 1e-5)


# ---------------------------------------------------------------- MPI: the same cases on real processes
# One `mpiexec -n 4` runs every case the selected tests need, on the 4 ranks and then on ranks 0
# and 1 as a group of 2 (comm.group), after the simulator has run them on 4 and 2 ranks.


def case_a2a(lesson):
    cases = {n: a2a_case(n, seed=40 + n) for n in (2, 4)}
    ints = {n: a2a_case(n, seed=50 + n, width=0, dtype=np.int16) for n in (2, 4)}

    def job(comm, a2a, exchange, cases, ints):
        n, r = comm.size, comm.rank
        counts, xs = cases[n]
        icounts, ixs = ints[n]
        recv = exchange(comm, counts[r])
        return a2a(comm, xs[r], counts[r], recv), a2a(comm, ixs[r], icounts[r], icounts[:, r]), recv
    return job, (lesson.all_to_all, lesson.exchange_counts, cases, ints)


def case_ep(lesson):
    setups = {n: ep_case(lesson, n, 4, 2, seed=60 + n) for n in (2, 4)}

    def job(comm, EP, setups):
        layer, xs, gs = setups[comm.size]
        return ep_job(comm, EP, layer, xs, gs)
    return job, (lesson.ExpertParallelMoE, setups)


def case_ep_dp(lesson):
    setups = {}
    for n in (2, 4):
        layer = make_layer(lesson, 4, 4, 2, 5, seed=70 + n, ops=oracle_ops(lesson))
        setups[n] = (layer, *ep_dp_data(n, 2, 4, seed=80 + n))

    def job(comm, EP, step, groups, setups):
        layer, xs, ys, total = setups[comm.size]
        return ep_dp_job(comm, EP, step, groups, layer, xs, ys, 2, 2, 0.3, total, oracle_allreduce)
    return job, (lesson.ExpertParallelMoE, lesson.ep_dp_train_step, lesson.ep_dp_groups, setups)


MPI_CASES = {"test_mpi_all_to_all": case_a2a, "test_mpi_expert_parallel": case_ep, "test_mpi_ep_dp": case_ep_dp}


@pytest.fixture(scope="module")
def mpi_runs(lesson, request, test_helper):
    return test_helper("mpi_cases").run_cases(lesson, request, MPI_CASES, sim, timeout=120)


@pytest.mark.exercise("16.4")
def test_mpi_all_to_all(lesson, mpi_runs):
    mpi_runs.check("test_mpi_all_to_all")


@pytest.mark.exercise("16.5")
def test_mpi_expert_parallel(lesson, mpi_runs):
    mpi_runs.check("test_mpi_expert_parallel")


# ---------------------------------------------------------------- the emulated cluster (course.cluster)
# The all-to-all across 2 nodes x 2 ranks of an emulated cluster: the rows equal the simulator's (its
# two-level topology) bit for bit, and each rank's NIC (veth) sent the rows it sent to the other node.


def case_cluster_a2a(lesson):
    rng = np.random.default_rng(91)
    counts = rng.integers(500, 3000, (4, 4))
    counts[1, 3] = 0  # an empty block across nodes, sent anyway
    xs = [rng.standard_normal((int(counts[i].sum()), 8)) for i in range(4)]

    def job(comm, a2a, counts, xs):
        r = comm.rank
        return a2a(comm, xs[r], counts[r], counts[:, r])
    return job, (lesson.all_to_all, counts, xs)


CLUSTER_CASES = {"test_cluster_all_to_all": case_cluster_a2a}


@pytest.fixture(scope="module")
def cluster_runs(lesson, request, test_helper):
    return test_helper("cluster_cases").run_cluster_cases(lesson, request, CLUSTER_CASES)


@pytest.mark.exercise("16.4")
@pytest.mark.timeout(90)
def test_cluster_all_to_all(lesson, cluster_runs):
    cluster_runs.check("test_cluster_all_to_all")


# ---------------------------------------------------------------- 16.6 EP in the planner


def planner_specs(lesson):
    small = lesson.MoESpec("small", n_layer=2, d_model=16, n_head=4, n_kv_head=2, d_ff=24, n_experts=8, k=2, vocab=40,
                           seq_len=8, batch=8)
    odd = lesson.MoESpec("odd", n_layer=3, d_model=12, n_head=3, n_kv_head=1, d_ff=20, n_experts=6, k=3, vocab=30,
                         seq_len=6, batch=4)
    return small, odd


def ep_formula(model, n, ep, flop_rate, links, node_size):
    """The test's own reading of the formulas: links = {"node": (a, b), "net": (a, b)}."""
    def link(span):
        return links["node"] if span <= node_size and node_size % span == 0 else links["net"]

    def ring(p, nbytes, a, b):
        return 2 * (p - 1) * (a + nbytes / p * b) if p > 1 else 0.0
    dp = n // ep
    pd, pe = model.dense_params, model.expert_params
    mem = 4 * (pd + pe / ep) + 12 * (pd / n + pe / n)
    b = model.batch * model.seq_len / n
    a, be = link(ep)
    t = 6 * model.active_params * b / flop_rate + 4 * model.n_layer * (ep - 1) * (a + model.k * b * 2 * model.d_model / ep * be)
    t += ring(dp, 2 * pe / ep, *link(n)) + ring(n, 2 * pd, *link(n))
    return mem, t


@pytest.mark.exercise("16.6")
def test_mixtral_counts_are_the_papers(lesson):
    m = lesson.MIXTRAL_8X7B
    assert round(m.total_params / 1e9, 1) == 46.7 and round(m.active_params / 1e9, 1) == 12.9
    cl = lesson.ClusterSpec(n_ranks=64, memory=80e9, flop_rate=400e12, alpha=14e-6, beta=1 / 50e9, node_size=8,
                            alpha_node=3.4e-6, beta_node=1 / 450e9)
    links = {"node": (3.4e-6, 1 / 450e9), "net": (14e-6, 1 / 50e9)}
    for ep in (1, 2, 4, 8):
        got = lesson.estimate_ep(m, cl, ep)
        mem, t = ep_formula(m, 64, ep, 400e12, links, 8)
        assert math.isclose(got.memory, mem, rel_tol=1e-9) and math.isclose(got.time, t, rel_tol=1e-9), \
            f"Mixtral 8x7B on 64 H100s (nodes of 8), ep={ep}: expected memory {mem / 1e9:.4f} GB and time {t:.6f} s " \
            f"from the formulas, got {got.memory / 1e9:.4f} GB, {got.time:.6f} s"


@pytest.mark.exercise("16.6")
def test_best_ep_picks_the_fastest_that_fits_and_changes_with_the_node(lesson):
    m = lesson.MIXTRAL_8X7B
    links = {"node": (3.4e-6, 1 / 450e9), "net": (14e-6, 1 / 50e9)}
    for node in (8, 4, 2):
        cl = lesson.ClusterSpec(n_ranks=64, memory=80e9, flop_rate=400e12, alpha=14e-6, beta=1 / 50e9, node_size=node,
                                alpha_node=3.4e-6, beta_node=1 / 450e9)
        table = {ep: ep_formula(m, 64, ep, 400e12, links, node) for ep in (1, 2, 4, 8)}
        want = min((t, ep) for ep, (mem, t) in table.items() if mem <= 80e9)[1]
        ep, est = lesson.best_ep(m, cl)
        assert ep == want, f"nodes of {node}: (memory GB, time s) per ep {({e: (round(a / 1e9, 1), round(b, 3)) for e, (a, b) in table.items()})}: " \
                           f"the fastest that fits in 80 GB is ep={want}, got ep={ep}"
    tight = lesson.ClusterSpec(n_ranks=64, memory=20e9, flop_rate=400e12, alpha=14e-6, beta=1 / 50e9)
    with raises(ValueError, match=r"GB"):
        lesson.best_ep(m, tight)
    with raises(ValueError, match=r"ep"):
        lesson.estimate_ep(m, tight, 3)


@pytest.mark.exercise("16.6")
@pytest.mark.parametrize("which,n", [(0, 8), (0, 4), (1, 6), (0, 1)])
def test_estimate_ep_matches_the_simulator(lesson, which, n):
    model = planner_specs(lesson)[which]
    cl = lesson.ClusterSpec(n_ranks=n, memory=1e12, flop_rate=1e9, alpha=5e-6, beta=1e-9)
    for ep in range(1, n + 1):
        if n % ep or model.n_experts % ep or (model.k * model.batch * model.seq_len // n) % ep:
            continue
        sim_t = lesson.simulate_ep(model, cl, ep, a2a=oracle_pairwise_a2a).time
        est = lesson.estimate_ep(model, cl, ep)
        assert math.isclose(est.time, sim_t, rel_tol=1e-6), \
            f"{model.name} on {n} ranks, ep={ep}: the simulator's step takes {sim_t:.9g} s, the estimate says {est.time:.9g} s"


@pytest.mark.exercise("16.6")
def test_best_ep_breaks_exact_ties_by_the_smaller_ep_and_fits_at_the_bound(lesson):
    """Free links (alpha = beta = 0 in and between nodes): every ep takes exactly the compute time,
    so the tie rule alone decides among the ep that fit: the smaller ep, not the smaller memory. The
    memories here are whole numbers of bytes, and a plan that needs exactly the memory there is fits."""
    small = planner_specs(lesson)[0]
    free = dict(n_ranks=8, flop_rate=2.0 ** 30, alpha=0.0, beta=0.0, node_size=8, alpha_node=0.0, beta_node=0.0)
    mem = {ep: ep_formula(small, 8, ep, 2.0 ** 30, {"node": (0, 0), "net": (0, 0)}, 8)[0] for ep in (1, 2, 4, 8)}
    assert all(m == int(m) for m in mem.values())
    times = {ep: lesson.estimate_ep(small, lesson.ClusterSpec(memory=1e15, **free), ep).time for ep in (1, 2, 4, 8)}
    assert len(set(times.values())) == 1, f"with free links every ep takes the compute time alone, got {times}"
    for memory, want in [(1e15, 1), (mem[1], 1), (mem[1] - 1, 2), (mem[2], 2), (mem[4] + 1, 4), (mem[8], 8)]:
        ep, est = lesson.best_ep(small, lesson.ClusterSpec(memory=memory, **free))
        assert ep == want, \
            f"every ep equally fast, memory per ep {mem} bytes, cluster memory {memory:.0f}: the ep that fit are " \
            f"{[e for e in mem if mem[e] <= memory]} (memory <= the cluster's), and a tie goes to the smaller ep: " \
            f"expected {want}, got {ep}"
    with raises(ValueError, match=r"GB"):
        lesson.best_ep(small, lesson.ClusterSpec(memory=mem[8] - 1, **free))
    m = lesson.MIXTRAL_8X7B
    links = {"node": (3.4e-6, 1 / 450e9), "net": (14e-6, 1 / 50e9)}
    four = {ep: ep_formula(m, 64, ep, 400e12, links, 4) for ep in (1, 2, 4, 8)}
    assert four[4][1] < four[8][1] and four[4][0] == int(four[4][0])
    for memory, want in [(four[4][0], 4), (four[4][0] - 1, 8)]:
        cl = lesson.ClusterSpec(n_ranks=64, memory=memory, flop_rate=400e12, alpha=14e-6, beta=1 / 50e9, node_size=4,
                                alpha_node=3.4e-6, beta_node=1 / 450e9)
        ep, _ = lesson.best_ep(m, cl)
        assert ep == want, f"Mixtral 8x7B on 64 H100s in nodes of 4, {memory:.0f} bytes per GPU: ep=4 needs exactly " \
                           f"{four[4][0]:.0f} and is faster than ep=8: expected ep={want}, got {ep}"


@pytest.mark.exercise("16.6")
def test_estimate_ep_one_rank_and_bad_ep(lesson):
    small = planner_specs(lesson)[0]
    one = lesson.ClusterSpec(n_ranks=1, memory=1e15, flop_rate=1e9, alpha=5e-6, beta=1e-9)
    est = lesson.estimate_ep(small, one, 1)
    mem, t = ep_formula(small, 1, 1, 1e9, {"node": (5e-6, 1e-9), "net": (5e-6, 1e-9)}, 1)
    assert math.isclose(est.memory, mem, rel_tol=1e-12) and math.isclose(est.time, t, rel_tol=1e-12), \
        f"one rank: 16 bytes per parameter ({mem:.0f}) and the compute alone ({t:.6g} s, no all-to-all, no " \
        f"all-reduce), got {est.memory:.0f} bytes, {est.time:.6g} s"
    assert lesson.best_ep(small, one)[0] == 1, "one rank: ep = 1"
    m = lesson.MIXTRAL_8X7B
    cl = lesson.ClusterSpec(n_ranks=64, memory=80e9, flop_rate=400e12, alpha=14e-6, beta=1 / 50e9)
    for ep in (0, 16, 3):  # below 1; divides the 64 ranks but not the 8 experts; divides neither
        with raises(ValueError, match=r"ep"):
            lesson.estimate_ep(m, cl, ep)
    with raises(ValueError, match=r"ep"):
        lesson.estimate_ep(m, one, 2)  # more ranks than the cluster has


@pytest.mark.exercise("16.5")
def test_mpi_ep_dp(lesson, mpi_runs):
    mpi_runs.check("test_mpi_ep_dp")
