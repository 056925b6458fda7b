"""Lesson 18: sparsity. Oracles written here from the lesson's rules: a sort by (|w|, index) for the
masks, loops over groups and bits for the 2:4 format, NumPy's dense product for the kernels, and a
dense model with the dropped structures zeroed for structured pruning (lesson 11's gpt_forward).
Each exercise is graded on its own code: the kernel tests build their CSR and 2:4 inputs with the
oracles here. The kernels' structure is checked on their Python source (Numba's `py_func`) with
traced arrays: which rows of B they read, and (tracemalloc) that the 2:4 kernel builds no dense
copy of A."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from minitorch.nn import Linear, Module, Parameter
from minitorch.optim import Adam
from minitorch.kv_cache import gpt_forward, random_gpt_weights

pytestmark = pytest.mark.lesson18

DTYPES = [np.float32, np.float64]


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- oracles


def oracle_magnitude(w, s):
    flat = np.abs(np.asarray(w, np.float64)).ravel()
    n = int(round(s * flat.size))
    order = sorted(range(flat.size), key=lambda i: (flat[i], i))
    keep = np.ones(flat.size, bool)
    keep[order[:n]] = False
    return keep.reshape(np.shape(w))


def oracle_wanda(w, norms, s):
    w = np.asarray(w, np.float64)
    keep = np.ones(w.shape, bool)
    n = int(round(s * w.shape[0]))
    for j in range(w.shape[1]):
        scores = [abs(w[i, j]) * norms[i] for i in range(w.shape[0])]
        for i in sorted(range(w.shape[0]), key=lambda i: (scores[i], i))[:n]:
            keep[i, j] = False
    return keep


def oracle_csr(a):
    indptr, indices, data = [0], [], []
    for row in a:
        for j, v in enumerate(row):
            if v != 0:
                indices.append(j)
                data.append(v)
        indptr.append(len(indices))
    return np.array(indptr, np.int64), np.array(indices, np.int32), np.array(data, a.dtype)


def oracle_24(a):
    """(values, meta, dense pruned) by loops: each group's 2 largest |a|, ties to the lower position."""
    m, k = a.shape
    values = np.zeros((m, k // 2), a.dtype)
    meta = np.zeros((m, -(-k // 8)), np.uint8)
    dense = np.zeros_like(a)
    for i in range(m):
        for g in range(k // 4):
            grp = [(-abs(float(a[i, 4 * g + p])), p) for p in range(4)]
            kept = sorted(p for _, p in sorted(grp)[:2])
            for t, p in enumerate(kept):
                s = 2 * g + t
                values[i, s] = a[i, 4 * g + p]
                meta[i, s // 4] |= p << (2 * (s % 4))
                dense[i, 4 * g + p] = a[i, 4 * g + p]
    return values, meta, dense


class Reads(np.ndarray):
    """An array that logs the index of every read (for a kernel's Python source, Numba's py_func)."""

    def __new__(cls, a, log):
        obj = np.asarray(a).view(cls)
        obj.log = log
        return obj

    def __array_finalize__(self, obj):
        self.log = getattr(obj, "log", None)

    def __getitem__(self, key):
        self.log.append(key)
        return np.asarray(self)[key]


def rows_read(log):
    return [int(k[0] if isinstance(k, tuple) else k) for k in log]


def py_source(kernel, name):
    assert hasattr(kernel, "py_func"), (f"{name} must be compiled with Numba (@njit): the structural checks read its "
                                        "Python source through .py_func, and speed needs the compiler")
    return kernel.py_func


# ---------------------------------------------------------------- 18.1 magnitude pruning


@pytest.mark.exercise("18.1")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 13), (3, 4, 5), (1,), (0,), (2, 0)])
def test_magnitude_mask_matches_the_rule(lesson, dtype, shape):
    rng = np.random.default_rng(sum(shape) + 3)
    w = rng.standard_normal(shape).astype(dtype)
    before = w.copy()
    for s in (0.0, 0.3, 0.5, 0.7, 1.0):
        got = np.asarray(lesson.magnitude_mask(w, s))
        want = oracle_magnitude(w, s)
        assert got.dtype == np.bool_ and got.shape == w.shape, f"mask must be bool of shape {w.shape}, got {got.dtype} {got.shape}"
        assert np.array_equal(got, want), f"sparsity {s}, w {w.ravel()}: expected mask\n{want}\ngot\n{got}"
    assert np.array_equal(w, before), "magnitude_mask must not modify w"


@pytest.mark.exercise("18.1")
def test_magnitude_mask_ties_prune_the_lower_index_and_signs_tie(lesson):
    w = np.array([0.5, -0.25, 0.25, -0.5, 0.25])
    got = lesson.magnitude_mask(w, 0.4)  # 2 of 5: the 0.25s at 1 and 2 (not 4)
    assert np.array_equal(got, [True, False, False, True, True]), f"ties: the lower index goes first, got {got}"
    assert np.array_equal(lesson.magnitude_mask(w, 0.8), [False, False, False, True, False]), (
        "at 0.8 (4 of 5) the three 0.25s go, then |0.5| at 0 before |-0.5| at 3")
    assert np.array_equal(lesson.magnitude_mask(np.array([[0.0, -0.0], [1.0, 0.0]]), 0.5), [[False, False], [True, True]])


@pytest.mark.exercise("18.1")
def test_magnitude_mask_rejects_a_sparsity_outside_0_1(lesson):
    for bad in (1.5, -0.25):
        with pytest.raises(ValueError, match="sparsity"):
            lesson.magnitude_mask(np.ones(4), bad)


@pytest.mark.exercise("18.1")
def test_global_masks_one_threshold_over_mixed_dtypes(lesson):
    rng = np.random.default_rng(5)
    weights = {"big": rng.standard_normal((6, 5)).astype(np.float32) * 4.0,
               "small": rng.standard_normal((5, 7)) * 0.25,
               "mid": rng.standard_normal(9).astype(np.float32)}
    for s in (0.0, 0.25, 0.5, 0.75, 1.0):
        got = lesson.global_magnitude_masks(weights, s)
        assert list(got) == list(weights), f"the masks must keep the dict's order {list(weights)}, got {list(got)}"
        flat = np.concatenate([np.asarray(w, np.float64).ravel() for w in weights.values()])
        want = oracle_magnitude(flat, s)
        start = 0
        for name, w in weights.items():
            m = np.asarray(got[name])
            assert m.dtype == np.bool_ and m.shape == w.shape
            assert np.array_equal(m.ravel(), want[start:start + w.size]), (
                f"sparsity {s}: mask of {name!r} wrong (one threshold over all arrays, compared in float64)")
            start += w.size
    got = lesson.global_magnitude_masks(weights, 0.5)
    share = {n: 1 - m.mean() for n, m in got.items()}
    assert share["small"] > 0.8 and share["big"] < 0.2, f"a global threshold prunes the small layer most, got {share}"


@pytest.mark.exercise("18.1")
def test_global_masks_ties_across_arrays_go_to_the_earlier_array(lesson):
    weights = {"b": np.array([0.5, 0.25]), "a": np.array([0.25, 1.0])}
    got = lesson.global_magnitude_masks(weights, 0.25)  # 1 of 4: the 0.25 of "b" (earlier in the dict)
    assert np.array_equal(got["b"], [True, False]) and np.array_equal(got["a"], [True, True]), got
    got = lesson.global_magnitude_masks(weights, 0.5)
    assert np.array_equal(got["b"], [True, False]) and np.array_equal(got["a"], [False, True]), got
    assert lesson.global_magnitude_masks({}, 0.5) == {}


class TwoLayers(Module):
    def __init__(self, dtype=np.float32, seed=0):
        rng = np.random.default_rng(seed)
        self.fc = Linear(6, 9, rng=rng)
        self.out = Linear(9, 4, rng=rng)
        for lin in (self.fc, self.out):
            lin.weight = Parameter(lin.weight.numpy().astype(dtype))
            lin.bias = Parameter(lin.bias.numpy().astype(dtype) + 0.1)

    def forward(self, x):
        return self.out(self.fc(x).relu())


def loss_of(model, x, y):
    from minitorch.nn import cross_entropy

    return cross_entropy(model(x), y)


@pytest.mark.exercise("18.1")
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_masks_zeroes_weights_and_gradients_in_place(lesson, dtype):
    from minitorch.autograd import Tensor

    model = TwoLayers(dtype)
    rng = np.random.default_rng(1)
    x, y = Tensor(rng.standard_normal((5, 6)).astype(dtype)), rng.integers(0, 4, 5)
    loss_of(model, x, y).backward()
    mask = rng.random((6, 9)) < 0.5
    w_array = model.fc.weight.data  # the parameter's own array: pruning is in place
    w0, g0 = w_array.copy(), model.fc.weight.grad.numpy().copy()
    out_w0, out_g0 = model.out.weight.numpy().copy(), model.out.weight.grad.numpy().copy()
    lesson.apply_masks_(model, {"fc.weight": mask})
    w, g = model.fc.weight.numpy(), model.fc.weight.grad.numpy()
    assert w.dtype == dtype, f"the weight must keep its dtype {dtype}, got {w.dtype}"
    assert np.all(w[~mask] == 0), f"pruned weights must be 0 after apply_masks_, got {w[~mask]}"
    assert np.array_equal(w[mask], w0[mask]), "kept weights must not change"
    assert np.all(w_array[~mask] == 0), "apply_masks_ must prune in place (the parameter's own array), not rebind .data"
    assert np.all(g[~mask] == 0), f"gradients of pruned weights must be 0 after apply_masks_, got {g[~mask]}"
    assert np.array_equal(g[mask], g0[mask]), "gradients of kept weights must not change"
    assert np.array_equal(model.out.weight.numpy(), out_w0) and np.array_equal(model.out.weight.grad.numpy(), out_g0), \
        "a parameter without a mask must not change"


@pytest.mark.exercise("18.1")
def test_apply_masks_without_gradients_and_its_errors(lesson):
    model = TwoLayers()
    mask = np.zeros((9, 4), bool)
    mask[2, 1] = True
    lesson.apply_masks_(model, {"out.weight": mask, "out.bias": np.array([True, False, True, False])})
    assert np.count_nonzero(model.out.weight.numpy()) == 1 and model.out.weight.grad is None
    assert np.array_equal(model.out.bias.numpy() == 0, [False, True, False, True])
    with pytest.raises(KeyError, match="fc.wieght"):
        lesson.apply_masks_(model, {"fc.wieght": np.ones((6, 9), bool)})
    with pytest.raises(ValueError, match=r"\(9, 6\).*\(6, 9\)|\(6, 9\).*\(9, 6\)"):
        lesson.apply_masks_(model, {"fc.weight": np.ones((9, 6), bool)})


@pytest.mark.exercise("18.1")
def test_pruned_weights_stay_zero_through_adam_with_momentum(lesson):
    """Prune after some training (Adam's moments are nonzero everywhere), then fine-tune with the
    mask applied after the backward and after each step: the pruned weights stay exactly 0 and the
    others keep learning."""
    from minitorch.autograd import Tensor

    model = TwoLayers(np.float64, seed=3)
    rng = np.random.default_rng(2)
    x, y = Tensor(rng.standard_normal((32, 6))), rng.integers(0, 4, 32)
    opt = Adam(model.parameters(), lr=0.05)

    def step(masks=None):
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        if masks:
            lesson.apply_masks_(model, masks)
        opt.step()
        if masks:
            lesson.apply_masks_(model, masks)
        return loss.item()

    for _ in range(5):
        step()
    masks = {"fc.weight": lesson.magnitude_mask(model.fc.weight.numpy(), 0.5),
             "out.weight": lesson.magnitude_mask(model.out.weight.numpy(), 0.5)}
    lesson.apply_masks_(model, masks)
    kept_before = model.fc.weight.numpy()[masks["fc.weight"]].copy()
    losses = [step(masks) for _ in range(8)]
    for name, lin in (("fc.weight", model.fc), ("out.weight", model.out)):
        w = lin.weight.numpy()
        assert np.all(w[~masks[name]] == 0), f"{name}: pruned weights regrew to {w[~masks[name]][w[~masks[name]] != 0]}"
    assert not np.array_equal(model.fc.weight.numpy()[masks["fc.weight"]], kept_before), "the kept weights must train"
    assert losses[-1] < losses[0], f"fine-tuning should lower the loss, got {losses}"


# ---------------------------------------------------------------- 18.2 structured pruning


@pytest.fixture(scope="module")
def W64():
    return random_gpt_weights(vocab_size=11, block_size=16, n_layer=2, n_head=4, n_embd=16, seed=7)


def idx(W, t=9, b=3, seed=0):
    return np.random.default_rng(seed).integers(0, W.vocab_size, (b, t))


def top(scores, n):
    return np.array(sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n]), np.int64)


def oracle_channel(w_in, w_out):
    return np.array([np.linalg.norm(np.asarray(w_in, np.float64)[:, j]) * np.linalg.norm(np.asarray(w_out, np.float64)[j])
                     for j in range(w_in.shape[1])])


def oracle_heads(w_v, w_o, n_head):
    hd = w_v.shape[1] // n_head
    return np.array([np.linalg.norm(np.asarray(w_v, np.float64)[:, h * hd:(h + 1) * hd]) *
                     np.linalg.norm(np.asarray(w_o, np.float64)[h * hd:(h + 1) * hd]) for h in range(n_head)])


@pytest.mark.exercise("18.2")
@pytest.mark.parametrize("dtype", DTYPES)
def test_channel_and_head_scores(lesson, dtype):
    rng = np.random.default_rng(4)
    w_in, w_out = rng.standard_normal((5, 7)).astype(dtype), rng.standard_normal((7, 5)).astype(dtype)
    got = np.asarray(lesson.channel_scores(w_in, w_out))
    assert got.dtype == np.float64 and got.shape == (7,), f"channel_scores: float64 (H,), got {got.dtype} {got.shape}"
    np.testing.assert_allclose(got, oracle_channel(w_in, w_out), rtol=1e-12)
    np.testing.assert_allclose(lesson.channel_scores(w_in[:, :1], w_out[:1]), oracle_channel(w_in[:, :1], w_out[:1]),
                               rtol=1e-12)
    w_v, w_o = rng.standard_normal((5, 6)).astype(dtype), rng.standard_normal((6, 4)).astype(dtype)
    for n_head in (3, 2, 1, 6):
        got = np.asarray(lesson.head_scores(w_v, w_o, n_head))
        assert got.dtype == np.float64 and got.shape == (n_head,)
        np.testing.assert_allclose(got, oracle_heads(w_v, w_o, n_head), rtol=1e-12,
                                   err_msg=f"n_head={n_head}: head h owns columns h*hd..(h+1)*hd of w_v, rows of w_o")


def masked_mlp(W, keeps):
    params = dict(W.params)
    for i, keep in enumerate(keeps):
        proj = params[f"blocks.{i}.mlp.proj.weight"].copy()
        drop = np.setdiff1d(np.arange(proj.shape[0]), keep)
        proj[drop] = 0
        params[f"blocks.{i}.mlp.proj.weight"] = proj
    from dataclasses import replace

    return replace(W, params=params)


@pytest.mark.exercise("18.2")
@pytest.mark.parametrize("n_keep", [64, 37, 1])
def test_prune_mlp_equals_the_dense_model_with_those_channels_zeroed(lesson, W64, n_keep):
    before = {k: v.copy() for k, v in W64.params.items()}
    got = lesson.prune_mlp(W64, n_keep)
    keeps = []
    for i in range(W64.n_layer):
        fc, proj = W64.params[f"blocks.{i}.mlp.fc.weight"], W64.params[f"blocks.{i}.mlp.proj.weight"]
        keep = top(oracle_channel(fc, proj), n_keep)
        keeps.append(keep)
        assert np.array_equal(got.params[f"blocks.{i}.mlp.fc.weight"], fc[:, keep]), (
            f"layer {i}: fc.weight must be the columns {keep.tolist()} (the {n_keep} best, in increasing order)")
        assert np.array_equal(got.params[f"blocks.{i}.mlp.fc.bias"], W64.params[f"blocks.{i}.mlp.fc.bias"][keep])
        assert np.array_equal(got.params[f"blocks.{i}.mlp.proj.weight"], proj[keep])
    np.testing.assert_allclose(gpt_forward(got, idx(W64)), gpt_forward(masked_mlp(W64, keeps), idx(W64)),
                               rtol=1e-12, atol=1e-12)
    assert all(np.array_equal(v, W64.params[k]) for k, v in before.items()), "prune_mlp must not modify W"
    assert got.n_head == W64.n_head and got is not W64


@pytest.mark.exercise("18.2")
def test_prune_mlp_ties_keep_the_lower_channel_and_float32(lesson, W64):
    W = W64.astype(np.float32)
    fc = W.params["blocks.0.mlp.fc.weight"].copy()
    proj = W.params["blocks.0.mlp.proj.weight"].copy()
    scores = oracle_channel(fc, proj)
    best = int(np.argmax(scores))
    twin = (best + 5) % fc.shape[1]
    fc[:, twin], proj[twin] = fc[:, best], proj[best]  # an exact tie for the best score
    W.params["blocks.0.mlp.fc.weight"], W.params["blocks.0.mlp.proj.weight"] = fc, proj
    bias = W.params["blocks.0.mlp.fc.bias"]
    assert bias[best] != bias[twin]  # the two tied channels differ in their bias (which the score does not see)
    got = lesson.prune_mlp(W, 1)
    assert got.params["blocks.0.mlp.fc.bias"][0] == bias[min(best, twin)], (
        f"channels {best} and {twin} tie: keep the lower index {min(best, twin)}")
    assert got.params["blocks.0.mlp.fc.weight"].dtype == np.float32


def masked_heads(W, keeps):
    params = dict(W.params)
    hd = W.n_embd // W.n_head
    for i, keep in enumerate(keeps):
        proj = params[f"blocks.{i}.attn.proj.weight"].copy()
        for h in range(W.n_head):
            if h not in keep:
                proj[h * hd:(h + 1) * hd] = 0
        params[f"blocks.{i}.attn.proj.weight"] = proj
    from dataclasses import replace

    return replace(W, params=params)


@pytest.mark.exercise("18.2")
@pytest.mark.parametrize("n_keep", [4, 3, 1])
def test_prune_heads_equals_the_dense_model_without_those_heads(lesson, W64, n_keep):
    got = lesson.prune_heads(W64, n_keep)
    assert got.n_head == n_keep and got.n_kv_head == n_keep, f"n_head and n_kv_head must be {n_keep}"
    hd = W64.n_embd // W64.n_head
    keeps = []
    for i in range(W64.n_layer):
        pre = f"blocks.{i}.attn."
        keep = top(oracle_heads(W64.params[pre + "v.weight"], W64.params[pre + "proj.weight"], W64.n_head), n_keep)
        keeps.append(keep)
        cols = (keep[:, None] * hd + np.arange(hd)).ravel()
        for name in ("q", "k", "v"):
            assert np.array_equal(got.params[pre + name + ".weight"], W64.params[pre + name + ".weight"][:, cols]), (
                f"layer {i}: attn.{name}.weight must be the columns of heads {keep.tolist()}, in order")
            assert np.array_equal(got.params[pre + name + ".bias"], W64.params[pre + name + ".bias"][cols])
        assert np.array_equal(got.params[pre + "proj.weight"], W64.params[pre + "proj.weight"][cols])
    np.testing.assert_allclose(gpt_forward(got, idx(W64)), gpt_forward(masked_heads(W64, keeps), idx(W64)),
                               rtol=1e-12, atol=1e-12)
    assert W64.n_head == 4 and W64.params["blocks.0.attn.q.weight"].shape == (16, 16), "W must not change"


@pytest.mark.exercise("18.2")
def test_structured_pruning_refuses_what_it_cannot_do(lesson, W64):
    for fn, bad in ((lesson.prune_mlp, 0), (lesson.prune_mlp, 65), (lesson.prune_heads, 0), (lesson.prune_heads, 5)):
        with pytest.raises(ValueError, match="n_keep"):
            fn(W64, bad)
    gqa = random_gpt_weights(vocab_size=11, block_size=8, n_layer=1, n_head=4, n_kv_head=2, n_embd=16, seed=1)
    with pytest.raises(ValueError, match="n_kv_head"):
        lesson.prune_heads(gqa, 2)


# ---------------------------------------------------------------- 18.3 Wanda


@pytest.mark.exercise("18.3")
@pytest.mark.parametrize("dtype", DTYPES)
def test_input_norms(lesson, dtype):
    x = np.random.default_rng(8).standard_normal((9, 6)).astype(dtype)
    got = np.asarray(lesson.input_norms(x))
    assert got.dtype == np.float64 and got.shape == (6,), f"float64 (in,), got {got.dtype} {got.shape}"
    np.testing.assert_allclose(got, np.sqrt((x.astype(np.float64) ** 2).sum(axis=0)), rtol=1e-12)
    np.testing.assert_array_equal(lesson.input_norms(np.zeros((0, 3))), np.zeros(3))
    np.testing.assert_allclose(lesson.input_norms(np.array([[3.0, -4.0]])), [3.0, 4.0])


@pytest.mark.exercise("18.3")
@pytest.mark.parametrize("dtype", DTYPES)
def test_wanda_mask_matches_the_rule(lesson, dtype):
    rng = np.random.default_rng(9)
    w = rng.standard_normal((10, 7)).astype(dtype)
    norms = np.exp(rng.standard_normal(10) * 2)  # a few large input features, as in an LLM
    for s in (0.0, 0.3, 0.5, 0.8, 1.0):
        got = np.asarray(lesson.wanda_mask(w, norms, s))
        want = oracle_wanda(w, norms, s)
        assert got.dtype == np.bool_ and got.shape == w.shape
        assert np.array_equal(got, want), f"sparsity {s}: expected\n{want}\ngot\n{got}"
        assert (got.sum(axis=0) == 10 - round(s * 10)).all(), f"every output keeps the same number of inputs: {got.sum(0)}"


@pytest.mark.exercise("18.3")
def test_wanda_scores_use_the_norm_and_compare_within_each_output(lesson):
    w, norms = np.array([[1.0], [3.0]]), np.array([2.0, 1.0])  # scores 2 and 3 (squared norms would give 4 and 3)
    assert np.array_equal(lesson.wanda_mask(w, norms, 0.5), [[False], [True]]), "score = |w| * ||x||, not ||x||^2"
    w = np.array([[10.0, 0.01], [20.0, 0.02], [30.0, 0.03], [40.0, 0.04]])  # one loud column, one quiet
    got = lesson.wanda_mask(w, np.ones(4), 0.5)
    assert np.array_equal(got, [[False, False], [False, False], [True, True], [True, True]]), (
        f"each output column prunes its own half (not one threshold for the layer), got\n{got}")
    tie = lesson.wanda_mask(np.array([[1.0, 2.0], [2.0, 1.0], [1.0, 1.0]]), np.array([2.0, 1.0, 2.0]), 1 / 3)
    # column 0: scores 2, 2, 2 -> prune row 0; column 1: scores 4, 1, 2 -> prune row 1
    assert np.array_equal(tie, [[False, True], [True, False], [True, True]]), f"ties prune the lower index, got\n{tie}"
    assert np.array_equal(lesson.wanda_mask(np.array([[5.0, -1.0]]), np.array([1.0]), 1.0), [[False, False]])
    with pytest.raises(ValueError, match="norms"):
        lesson.wanda_mask(np.ones((3, 2)), np.ones(2), 0.5)


# ---------------------------------------------------------------- 18.4 CSR


@pytest.mark.exercise("18.4")
@pytest.mark.parametrize("dtype", DTYPES)
def test_to_csr_matches_the_format(lesson, dtype):
    rng = np.random.default_rng(10)
    a = np.where(rng.random((6, 9)) < 0.3, rng.standard_normal((6, 9)), 0).astype(dtype)
    a[2] = 0  # an empty row
    a[:, 4] = 0  # an empty column
    a[0, 4] = -0.0  # == 0: not stored
    for m in (a, a[:1], np.zeros((0, 5), dtype), np.zeros((3, 0), dtype), np.zeros((2, 3), dtype)):
        got = lesson.to_csr(m)
        indptr, indices, data = oracle_csr(m)
        assert np.asarray(got.indptr).dtype == np.int64 and np.asarray(got.indices).dtype == np.int32, (
            f"indptr int64 and indices int32, got {np.asarray(got.indptr).dtype} and {np.asarray(got.indices).dtype}")
        assert np.asarray(got.data).dtype == m.dtype, f"data keeps a's dtype {m.dtype}"
        np.testing.assert_array_equal(got.indptr, indptr, err_msg=f"indptr of\n{m}")
        np.testing.assert_array_equal(got.indices, indices, err_msg=f"indices of\n{m}")
        np.testing.assert_array_equal(got.data, data)
        assert tuple(got.shape) == m.shape


def csr_inputs(rng, m, k, density, dtype, empty_cols=()):
    a = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)) + 0.5, 0).astype(dtype)
    a[:, list(empty_cols)] = 0
    return a, *oracle_csr(a)


@pytest.mark.exercise("18.4")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(7, 13, 5), (1, 9, 1), (5, 4, 3), (3, 6, 0)])
def test_csr_kernel_matches_dense(lesson, dtype, m, k, n):
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a, indptr, indices, data = csr_inputs(rng, m, k, 0.4, dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    start = rng.standard_normal((m, n)).astype(dtype)
    out = start.copy()
    lesson.csr_matmul_kernel(indptr, indices, data, b, out)
    np.testing.assert_allclose(out, start + a.astype(np.float64) @ b, **tol(dtype),
                               err_msg="the kernel must add A @ b into out")
    assert out.dtype == dtype
    out = np.zeros((m, n), dtype)
    lesson.csr_matmul_kernel(np.zeros(m + 1, np.int64), np.zeros(0, np.int32), np.zeros(0, dtype), b, out)
    assert not out.any(), "no nonzeros: out stays zero"


@pytest.mark.exercise("18.4")
def test_csr_matmul_wrapper_with_to_csr(lesson):
    rng = np.random.default_rng(12)
    a = np.where(rng.random((11, 17)) < 0.2, rng.standard_normal((11, 17)), 0).astype(np.float32)
    b = rng.standard_normal((17, 6))
    got = lesson.csr_matmul(lesson.to_csr(a), b)
    assert got.dtype == np.float64, "float32 A times float64 B gives float64"
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-6, atol=1e-6)


@pytest.mark.exercise("18.4")
def test_csr_kernel_reads_b_only_at_the_rows_its_nonzeros_name(lesson):
    kernel = py_source(lesson.csr_matmul_kernel, "csr_matmul_kernel")
    rng = np.random.default_rng(13)
    a, indptr, indices, data = csr_inputs(rng, 6, 10, 0.35, np.float64, empty_cols=(0, 3, 7))
    b_log = []
    n = 3
    out = np.zeros((6, n))
    kernel(indptr, indices, data, Reads(rng.standard_normal((10, n)), b_log), out)
    read = rows_read(b_log)
    assert set(read) == set(indices.tolist()), (
        f"the kernel read rows {sorted(set(read))} of B; the nonzeros name {sorted(set(indices.tolist()))} "
        "(a row of B that no nonzero names is never needed)")
    assert len(read) <= len(indices) * n, f"{len(read)} reads of B for {len(indices)} nonzeros x {n} columns"
    for i in range(6):  # row by row: exactly that row's columns
        log = []
        lo, hi = indptr[i], indptr[i + 1]
        kernel(np.array([0, hi - lo]), indices[lo:hi], data[lo:hi], Reads(np.ones((10, n)), log), np.zeros((1, n)))
        assert set(rows_read(log)) == set(indices[lo:hi].tolist()), (
            f"row {i}: read rows {sorted(set(rows_read(log)))} of B, its nonzeros are at {indices[lo:hi].tolist()}")


# ---------------------------------------------------------------- 18.5 2:4


@pytest.mark.exercise("18.5")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 12), (1, 4), (3, 20), (0, 8), (2, 16)])
def test_compress_2_4_matches_the_format(lesson, dtype, shape):
    a = np.random.default_rng(shape[1]).standard_normal(shape).astype(dtype)
    values, meta = lesson.compress_2_4(a)
    want_v, want_m, _ = oracle_24(a)
    values, meta = np.asarray(values), np.asarray(meta)
    assert values.dtype == dtype and values.shape == want_v.shape, (
        f"values: {want_v.shape} {np.dtype(dtype)}, got {values.shape} {values.dtype}")
    assert meta.dtype == np.uint8 and meta.shape == want_m.shape, (
        f"meta: {want_m.shape} uint8 (ceil(K/8) bytes per row), got {meta.shape} {meta.dtype}")
    np.testing.assert_array_equal(values, want_v, err_msg="the two kept values of each group, in increasing position")
    np.testing.assert_array_equal(meta, want_m, err_msg=(
        "meta: slot s of a row holds its position (0..3) in bits 2*(s%4), 2*(s%4)+1 of byte s//4"))


@pytest.mark.exercise("18.5")
def test_compress_2_4_ties_zero_groups_and_the_bits(lesson):
    a = np.array([[0, 0, 0, 0, 1, 1, 1, 1, -2, 2, 0, 0, 0, 0, 0, 3]], np.float64)
    values, meta = lesson.compress_2_4(a)
    # positions (0,1) (0,1) (0,1) (0,3): byte 0 = 0 | 1<<2 | 0<<4 | 1<<6, byte 1 = 0 | 1<<2 | 0<<4 | 3<<6
    assert np.array_equal(meta, [[68, 196]]), f"expected meta [[68, 196]] (see the comment in this test), got {meta}"
    assert np.array_equal(values, [[0, 0, 1, 1, -2, 2, 0, 3]]), f"got values {values}"
    values, meta = lesson.compress_2_4(np.array([[0.5, -3.0, 0.25, 3.0]]))  # |-3| ties |3|: both kept, in order
    assert np.array_equal(values, [[-3.0, 3.0]]) and np.array_equal(meta, [[1 | 3 << 2]]), (values, meta)
    with pytest.raises(ValueError, match="multiple of 4"):
        lesson.compress_2_4(np.ones((2, 6)))


def inputs_24(rng, m, k, dtype):
    a = (rng.standard_normal((m, k)) + np.sign(rng.standard_normal((m, k))) * 0.1).astype(dtype)
    return oracle_24(a)


@pytest.mark.exercise("18.5")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(5, 12, 7), (1, 4, 1), (3, 20, 2), (4, 8, 0), (2, 32, 5)])
def test_sparse24_kernel_matches_dense(lesson, dtype, m, k, n):
    rng = np.random.default_rng(m + k + n)
    values, meta, dense = inputs_24(rng, m, k, dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    start = rng.standard_normal((m, n)).astype(dtype)
    out = start.copy()
    lesson.sparse24_kernel(values, meta, b, out)
    np.testing.assert_allclose(out, start + dense.astype(np.float64) @ b, **tol(dtype),
                               err_msg="the kernel must add A @ b into out, A = the 2:4 matrix values and meta describe")
    assert out.dtype == dtype


@pytest.mark.exercise("18.5")
def test_sparse24_matmul_with_compress(lesson):
    rng = np.random.default_rng(14)
    a = rng.standard_normal((9, 24)).astype(np.float32)
    b = rng.standard_normal((24, 5)).astype(np.float32)
    values, meta = lesson.compress_2_4(a)
    got = lesson.sparse24_matmul(values, meta, b)
    assert got.dtype == np.float32 and got.shape == (9, 5)
    np.testing.assert_allclose(got, oracle_24(a)[2].astype(np.float64) @ b, rtol=2e-5, atol=2e-5)


@pytest.mark.exercise("18.5")
def test_sparse24_kernel_reads_the_compressed_form_only(lesson):
    """Structure: B is read only at the rows the kept positions name (half of them), every value and
    the metadata are read, and no dense copy of A is built (tracemalloc)."""
    kernel = py_source(lesson.sparse24_kernel, "sparse24_kernel")
    rng = np.random.default_rng(15)
    values, meta, dense = inputs_24(rng, 4, 16, np.float64)
    n = 2
    for i in range(4):
        b_log, v_log, m_log = [], [], []
        kernel(Reads(values[i:i + 1], v_log), Reads(meta[i:i + 1], m_log), Reads(rng.standard_normal((16, n)), b_log),
               np.zeros((1, n)))
        want = set(np.flatnonzero(dense[i]).tolist())
        assert set(rows_read(b_log)) == want, (
            f"row {i}: the kernel read rows {sorted(set(rows_read(b_log)))} of B; the kept positions are {sorted(want)} "
            "(row 4 * (s // 2) + position of slot s)")
        slots = {(int(k[1]) if isinstance(k, tuple) else None) for k in v_log}
        assert slots >= set(range(8)) or None in slots, f"row {i}: every value must be read, read slots {sorted(slots)}"
        assert m_log, "the kernel must read the positions from meta"
    m, k = 16, 256
    values, meta, _ = inputs_24(np.random.default_rng(16), m, k, np.float64)
    b, out = np.random.default_rng(17).standard_normal((k, 2)), np.zeros((m, 2))
    tracemalloc.start()
    try:
        kernel(values, meta, b, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < m * k * 8 // 4, (f"the kernel allocated {peak} bytes at its peak; a dense copy of A is {m * k * 8}: "
                                   "multiply from values and meta directly")
