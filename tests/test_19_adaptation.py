"""Lesson 19: efficient adaptation. Oracles written here: NumPy formulas in float64 for the LoRA
forward, its gradients and the merged weight; lesson 10's QTensor for the int4 groups; a loop over rows
for the batched adapters (its multiply-adds counted through the matmul it is given); lesson 11's
generate on merged weights for the engine; the distillation loss and its gradient from their formulas.
Each exercise is graded on its own code: merging is tested on a plain object with the attributes of
exercise 19.1's layer, and the engine is given the student's lora_batched."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch.autograd import Tensor
from minitorch.nn import Linear, Parameter
from minitorch.quant import QTensor, quantize
from minitorch.kv_cache import generate, random_gpt_weights

pytestmark = pytest.mark.lesson19

DTYPES = [np.float32, np.float64]


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)


def base_linear(d_in, d_out, dtype=np.float64, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    lin = Linear(d_in, d_out, bias=bias, rng=rng)
    lin.weight = Parameter(rng.standard_normal((d_in, d_out)).astype(dtype) * 0.5)
    if bias:
        lin.bias = Parameter(rng.standard_normal(d_out).astype(dtype))
    return lin


def lora_np(x, w, b, a, bb, s):
    y = x.astype(np.float64) @ w.astype(np.float64) + s * (x.astype(np.float64) @ a.astype(np.float64)) @ bb.astype(np.float64)
    return y + (0 if b is None else b.astype(np.float64))


# ---------------------------------------------------------------- 19.1 LoRALinear


@pytest.mark.exercise("19.1")
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_init_freezes_the_base_and_starts_at_it(lesson, dtype):
    base = base_linear(7, 5, dtype)
    layer = lesson.LoRALinear(base, r=3, lora_alpha=12.0, seed=4)
    params = list(layer.parameters())
    assert len(params) == 2 and {tuple(p.shape) for p in params} == {(7, 3), (3, 5)}, (
        f"only lora_A (7, 3) and lora_B (3, 5) may be Parameters, got {[tuple(p.shape) for p in params]}")
    a_want = (np.random.default_rng(4).standard_normal((7, 3)) / np.sqrt(7)).astype(dtype)
    assert layer.lora_A.dtype == dtype and layer.lora_B.dtype == dtype, "A and B in the base weight's dtype"
    np.testing.assert_allclose(layer.lora_A.numpy(), a_want, rtol=1e-6,
                               err_msg="lora_A = default_rng(seed).standard_normal((in, r)) / sqrt(in)")
    assert not layer.lora_B.numpy().any(), "lora_B must start at zero, so that the model starts as the base"
    assert layer.scaling == 4.0 and layer.r == 3 and layer.lora_alpha == 12.0 and layer.merged is False
    assert isinstance(layer.weight, np.ndarray) and np.array_equal(layer.weight, base.weight.numpy())
    assert layer.weight is not base.weight.data, "weight must be a copy (training the base model must not move it)"
    x = np.random.default_rng(1).standard_normal((2, 4, 7)).astype(dtype)
    y = layer(Tensor(x))
    want = x @ base.weight.numpy() + base.bias.numpy()
    assert y.dtype == dtype and tuple(y.shape) == (2, 4, 5)
    np.testing.assert_allclose(y.numpy(), want, **tol(dtype), err_msg="at initialisation the layer is the base Linear")


@pytest.mark.exercise("19.1")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("r,alpha", [(4, 16.0), (1, 3.0), (6, 2.0)])
def test_lora_forward_is_base_plus_scaled_low_rank(lesson, dtype, r, alpha):
    base = base_linear(9, 6, dtype, seed=r)
    layer = lesson.LoRALinear(base, r=r, lora_alpha=alpha, seed=1)
    rng = np.random.default_rng(2)
    layer.lora_B.data[...] = rng.standard_normal((r, 6)).astype(dtype)
    for x in (rng.standard_normal((5, 9)), rng.standard_normal((1, 9)), rng.standard_normal((0, 9)),
              rng.standard_normal((2, 3, 9))):
        x = x.astype(dtype)
        got = layer(Tensor(x))
        want = lora_np(x, base.weight.numpy(), base.bias.numpy(), layer.lora_A.numpy(), layer.lora_B.numpy(), alpha / r)
        np.testing.assert_allclose(got.numpy(), want, **tol(dtype), err_msg=(
            f"r={r}, lora_alpha={alpha}: y = x W + b + (lora_alpha / r) (x A) B, scaling {alpha / r}"))
    layer.merged, layer.weight = True, layer.weight + 1.0  # as exercise 19.2 leaves a merged layer
    x = rng.standard_normal((3, 9)).astype(dtype)
    np.testing.assert_allclose(layer(Tensor(x)).numpy(), x @ layer.weight + base.bias.numpy(), **tol(dtype),
                               err_msg="merged: the update is inside weight, so forward is x W + b alone")
    nobias = lesson.LoRALinear(base_linear(4, 3, dtype, bias=False), r=2, lora_alpha=2.0)
    np.testing.assert_allclose(nobias(Tensor(np.ones((1, 4), dtype))).numpy(), np.ones((1, 4)) @ nobias.weight, **tol(dtype))


@pytest.mark.exercise("19.1")
def test_lora_gradients_reach_only_a_and_b(lesson):
    base = base_linear(6, 4, np.float64, seed=3)
    w0 = base.weight.numpy().copy()
    layer = lesson.LoRALinear(base, r=2, lora_alpha=6.0, seed=0)
    rng = np.random.default_rng(5)
    x = Tensor(rng.standard_normal((5, 6)), requires_grad=True)
    g = rng.standard_normal((5, 4))
    s = 3.0
    a, b = layer.lora_A.numpy(), layer.lora_B.numpy()
    (layer(x) * Tensor(g)).sum().backward()  # B = 0: dA = 0, dB = s (x A)^T g
    np.testing.assert_allclose(layer.lora_B.grad.numpy(), s * (x.numpy() @ a).T @ g, rtol=1e-12,
                               err_msg="dL/dB = scaling (x A)^T g: nonzero at the start, since A is random")
    np.testing.assert_allclose(layer.lora_A.grad.numpy(), np.zeros((6, 2)), atol=1e-15)
    np.testing.assert_allclose(x.grad.numpy(), g @ w0.T, rtol=1e-12)
    layer.lora_B.data[...] = rng.standard_normal((2, 4))
    b = layer.lora_B.numpy()
    layer.lora_A.zero_grad(), layer.lora_B.zero_grad()
    x2 = Tensor(x.numpy(), requires_grad=True)
    (layer(x2) * Tensor(g)).sum().backward()
    np.testing.assert_allclose(layer.lora_A.grad.numpy(), s * x2.numpy().T @ (g @ b.T), rtol=1e-12)
    np.testing.assert_allclose(x2.grad.numpy(), g @ w0.T + s * (g @ b.T) @ a.T, rtol=1e-12)
    assert np.array_equal(base.weight.numpy(), w0) and base.weight.grad is None, "the base Linear must not change"


# ---------------------------------------------------------------- 19.2 merging


class Layer:
    """What exercise 19.1's LoRALinear holds, and nothing else."""

    def __init__(self, d_in, d_out, r, alpha, dtype, seed=0, bias=True):
        rng = np.random.default_rng(seed)
        self.weight = rng.standard_normal((d_in, d_out)).astype(dtype)
        self.bias = rng.standard_normal(d_out).astype(dtype) if bias else None
        self.r, self.lora_alpha, self.scaling, self.merged = r, alpha, alpha / r, False
        self.lora_A = Parameter(rng.standard_normal((d_in, r)).astype(dtype))
        self.lora_B = Parameter(rng.standard_normal((r, d_out)).astype(dtype))


@pytest.mark.exercise("19.2")
@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_and_merge(lesson, dtype):
    layer = Layer(7, 5, 3, 12.0, dtype)
    w0 = layer.weight
    a, b = layer.lora_A.numpy().astype(np.float64), layer.lora_B.numpy().astype(np.float64)
    delta = np.asarray(lesson.lora_delta(layer))
    assert delta.dtype == np.float64 and delta.shape == (7, 5)
    np.testing.assert_allclose(delta, 4.0 * a @ b, rtol=1e-12, err_msg="delta = (lora_alpha / r) A @ B")
    lesson.merge_lora_(layer)
    assert layer.merged is True and layer.base_weight is w0, "merge sets the original weight array aside as base_weight"
    assert layer.weight.dtype == dtype
    np.testing.assert_allclose(layer.weight, w0.astype(np.float64) + 4.0 * a @ b, **tol(dtype))
    x = np.random.default_rng(3).standard_normal((4, 7)).astype(dtype)
    np.testing.assert_allclose(x @ layer.weight + layer.bias, lora_np(x, w0, layer.bias, a, b, 4.0),
                               rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5 if dtype == np.float32 else 1e-12,
                               err_msg="the merged layer computes what the adapter did")
    merged_once = layer.weight.copy()
    lesson.merge_lora_(layer)
    assert np.array_equal(layer.weight, merged_once) and layer.base_weight is w0, "merging twice must merge once"


@pytest.mark.exercise("19.2")
def test_unmerge_restores_the_weights_bit_for_bit_however_often(lesson):
    layer = Layer(16, 12, 4, 8.0, np.float32, seed=7)
    layer.lora_B.data[...] *= 50.0  # a large update: rounding shows
    w0 = layer.weight.copy()
    lesson.unmerge_lora_(layer)  # not merged: nothing happens
    assert np.array_equal(layer.weight, w0) and layer.merged is False
    for _ in range(40):
        lesson.merge_lora_(layer)
        lesson.unmerge_lora_(layer)
    assert layer.merged is False
    drift = np.abs(layer.weight.astype(np.float64) - w0).max()
    assert np.array_equal(layer.weight, w0), (f"after 40 merge/unmerge cycles the weight moved by up to {drift:.3g}: "
                                              "unmerge must restore the original array, not subtract the update")
    assert layer.weight.dtype == np.float32


# ---------------------------------------------------------------- 19.3 QLoRA


def qlora_oracle(w, group):
    q = quantize(np.asarray(w, np.float32), bits=4, symmetric=False, block=(group, 1))
    return QTensor(q.q, q.scale, q.zero_point, 4, False).dequantize()


@pytest.mark.exercise("19.3")
@pytest.mark.parametrize("d_in,d_out,group", [(64, 24, 64), (32, 7, 8), (12, 5, 4), (8, 1, 8)])
def test_qlora_dequantizes_the_int4_groups(lesson, d_in, d_out, group):
    base = base_linear(d_in, d_out, np.float32, seed=d_in + d_out)
    layer = lesson.QLoRALinear(base, r=2, lora_alpha=4.0, group_size=group)
    got = np.asarray(layer.dequantized_weight())
    assert got.dtype == np.float32 and got.shape == (d_in, d_out)
    np.testing.assert_array_equal(got, qlora_oracle(base.weight.numpy(), group), err_msg=(
        f"(q - zero_point) * scale, each group of {group} inputs of each output with its own scale and zero point"))
    assert np.abs(got - base.weight.numpy()).max() <= np.abs(base.weight.numpy()).max() / 7, "a 4-bit copy of W"


@pytest.mark.exercise("19.3")
@pytest.mark.parametrize("dtype", DTYPES)
def test_qlora_forward_and_gradients(lesson, dtype):
    base = base_linear(16, 6, np.float32, seed=2)
    layer = lesson.QLoRALinear(base, r=3, lora_alpha=6.0, seed=1, group_size=8)
    w = qlora_oracle(base.weight.numpy(), 8)
    rng = np.random.default_rng(9)
    x0 = rng.standard_normal((5, 16)).astype(dtype)
    np.testing.assert_allclose(layer(Tensor(x0)).numpy(), x0.astype(np.float64) @ w + base.bias.numpy(), rtol=2e-5, atol=2e-5,
                               err_msg="at initialisation (B = 0) the layer is the 4-bit base")
    layer.lora_B.data[...] = rng.standard_normal((3, 6))
    x = Tensor(x0, requires_grad=True)
    y = layer(x)
    a, b = layer.lora_A.numpy(), layer.lora_B.numpy()
    np.testing.assert_allclose(y.numpy(), lora_np(x0, w, base.bias.numpy(), a, b, 2.0), rtol=2e-5, atol=2e-5,
                               err_msg="y = x W4 + b + scaling (x A) B, W4 the dequantized weight")
    g = rng.standard_normal((5, 6))
    (y * Tensor(g.astype(y.dtype))).sum().backward()
    np.testing.assert_allclose(layer.lora_B.grad.numpy(), 2.0 * (x0 @ a).T @ g, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), g @ w.T + 2.0 * (g @ b.T) @ a.T, rtol=1e-4, atol=1e-4)
    assert len(list(layer.parameters())) == 2


@pytest.mark.exercise("19.3")
def test_qlora_keeps_no_float_copy_of_the_weight(lesson):
    base = base_linear(64, 32, np.float32, seed=5)
    layer = lesson.QLoRALinear(base, r=4, lora_alpha=8.0, group_size=64)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    y1 = layer(Tensor(x)).numpy()

    def big_floats(obj):
        found = []
        for name, v in vars(obj).items():
            arr = v.data if isinstance(v, Tensor) else v
            if isinstance(arr, np.ndarray) and arr.dtype.kind == "f" and arr.size >= 64 * 32 // 2:
                found.append((name, arr.shape))
        return found

    assert not big_floats(layer), f"the layer holds float arrays the size of W: {big_floats(layer)}; keep it 4-bit"
    other = base_linear(64, 32, np.float32, seed=6)
    layer.packed = lesson.QLoRALinear(other, r=4, lora_alpha=8.0, group_size=64).packed  # new codes, same scales
    y2 = layer(Tensor(x)).numpy()
    assert not np.allclose(y1, y2), "forward must dequantize the codes it holds now (made afresh in every call)"
    assert layer.weight_bytes() == 64 * 32 // 2 + 4 * 32 + 32


# ---------------------------------------------------------------- 19.4 many adapters in one batch


def batched_oracle(x, A, B, scales, ids):
    out = np.zeros((x.shape[0], B.shape[2]))
    for n, a in enumerate(ids):
        if a >= 0:
            out[n] = scales[a] * (x[n].astype(np.float64) @ A[a]) @ B[a]
    return out


def counting():
    calls = []

    def matmul(a, b):
        calls.append((a.shape, b.shape))
        return np.matmul(a, b)

    return calls, matmul


@pytest.mark.exercise("19.4")
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_batched_matches_a_loop_over_rows(lesson, dtype):
    rng = np.random.default_rng(11)
    n_adapters, d_in, r, d_out = 4, 9, 3, 7
    A = rng.standard_normal((n_adapters, d_in, r)).astype(dtype)
    B = rng.standard_normal((n_adapters, r, d_out)).astype(dtype)
    scales = np.array([2.0, 0.5, 4.0, 1.0])
    for ids in ([2, -1, 0, 2, 3, -1, 0, 2, 1, 1, 0], [-1, -1, -1], [3], [0, 0, 0, 0]):
        ids = np.array(ids)
        x = rng.standard_normal((len(ids), d_in)).astype(dtype)
        calls, matmul = counting()
        got = lesson.lora_batched(x, A, B, scales, ids, matmul=matmul)
        assert got.dtype == dtype and got.shape == (len(ids), d_out), f"(N, out) in {np.dtype(dtype)}, got {got.dtype} {got.shape}"
        np.testing.assert_allclose(got, batched_oracle(x, A, B, scales, ids), **tol(dtype),
                                   err_msg=f"adapter_of_row {ids.tolist()}: row n gets scales[a] (x[n] A[a]) B[a], "
                                           "and zeros where a = -1 (A[-1] is the last adapter, not none)")
        present = sorted(set(ids[ids >= 0].tolist()))
        assert len(calls) == 2 * len(present), (
            f"adapter_of_row {ids.tolist()}: {len(calls)} matmul calls; expected 2 per adapter present ({len(present)}), "
            "rows grouped by adapter")
        macs = sum(a[0] * a[1] * b[1] for a, b in calls)
        want = sum(int((ids == k).sum()) * (d_in * r + r * d_out) for k in present)
        assert macs == want, f"{macs} multiply-adds; the rows with an adapter need {want} (none for rows with -1)"


@pytest.mark.exercise("19.4")
def test_lora_batched_sizes_and_errors(lesson):
    A, B = np.ones((2, 4, 1)), np.ones((2, 1, 3))
    out = lesson.lora_batched(np.zeros((0, 4)), A, B, np.ones(2), np.zeros(0, np.int64))
    assert out.shape == (0, 3)
    got = lesson.lora_batched(np.ones((2, 4), np.float32), A.astype(np.float32), B.astype(np.float32), np.array([0.25, 1.0]),
                              np.array([1, 0]))
    np.testing.assert_array_equal(got, [[4.0] * 3, [1.0] * 3])
    for bad in ([2, 0], [0, -2]):
        with pytest.raises(ValueError, match="adapter_of_row"):
            lesson.lora_batched(np.ones((2, 4)), A, B, np.ones(2), np.array(bad))


@pytest.fixture(scope="module")
def W_small():
    return random_gpt_weights(vocab_size=13, block_size=32, n_layer=2, n_head=2, n_embd=8, seed=5)


def random_adapter(W, names, r, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for name in names:
        d_in, d_out = W.params[name + ".weight"].shape
        out[name] = (rng.standard_normal((d_in, r)) * 0.3, rng.standard_normal((r, d_out)) * 0.3, 2.0 / r)
    return out


@pytest.mark.exercise("19.4")
def test_adapter_engine_serves_each_request_as_its_merged_model(lesson, W_small):
    """One AdapterEngine step loop, requests for three adapters (of different ranks and layers) and
    for none, mixed in its batches: every request's greedy tokens are those of lesson 11's generate on
    the base weights with that request's adapter merged in."""
    W = W_small
    adapters = {"a": random_adapter(W, ["blocks.0.attn.q", "blocks.1.mlp.fc", "blocks.0.mlp.proj"], 2, 1),
                "b": random_adapter(W, ["blocks.0.attn.v", "blocks.1.attn.proj"], 3, 2),
                "c": random_adapter(W, ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.1.mlp.proj"], 1, 3)}
    calls = []

    def lora_fn(x, A, B, scales, ids):
        calls.append(int((np.asarray(ids) >= 0).sum()))
        return lesson.lora_batched(x, A, B, scales, ids)

    engine = lesson.AdapterEngine(W, adapters, lora_fn=lora_fn, num_blocks=64, block_size=4, max_num_batched_tokens=24)
    rng = np.random.default_rng(0)
    plan = ["a", "b", None, "a", "c", "b", None]
    prompts = [rng.integers(0, 13, n) for n in (3, 5, 7, 2, 6, 4, 1)]
    handles = [engine.add_request(p, 6, adapter=a) for p, a in zip(prompts, plan)]
    engine.run_until_idle()
    for h, p, a in zip(handles, prompts, plan):
        Wm = W if a is None else lesson.merge_adapter_weights(W, adapters[a])
        want = generate(Wm, p, 6)  # the 6 ids after the prompt
        assert list(h.output) == list(want), (f"request for adapter {a!r}, prompt {p.tolist()}: the engine generated "
                                              f"{list(h.output)}, the merged model {list(want)}")
    assert calls and max(calls) > 1, "the adapters went through lora_fn, several tokens per call"
    with pytest.raises(ValueError, match="adapter"):
        engine.add_request(prompts[0], 2, adapter="nope")


# ---------------------------------------------------------------- 19.5 distillation


def kl_oracle(s, t, T):
    def log_softmax(z):
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(t / T), log_softmax(s / T)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1).mean(), np.exp(lp), np.exp(lq)


def ce_oracle(s, y):
    z = s - s.max(axis=-1, keepdims=True)
    lq = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -lq[np.arange(len(y)), y].mean(), np.exp(lq)


@pytest.mark.exercise("19.5")
@pytest.mark.parametrize("T,alpha", [(1.0, 1.0), (2.0, 1.0), (4.0, 0.25), (0.5, 0.5), (2.0, 0.0)])
def test_distillation_loss_value_and_gradient(lesson, T, alpha):
    rng = np.random.default_rng(int(T * 10 + alpha * 4))
    n, v = 7, 11
    s = rng.standard_normal((n, v)) * 2
    t = rng.standard_normal((n, v)) * 3
    y = rng.integers(0, v, n)
    student = Tensor(s.copy(), requires_grad=True)
    loss = lesson.distillation_loss(student, t, y, temperature=T, alpha=alpha)
    kl, p, q = kl_oracle(s, t, T)
    ce, soft = ce_oracle(s, y)
    want = alpha * T * T * kl + (1 - alpha) * ce
    assert np.isclose(loss.item(), want, rtol=1e-10, atol=1e-12), (
        f"T={T}, alpha={alpha}: expected alpha T^2 KL(p_T || q_T) + (1 - alpha) CE = {want:.10f} "
        f"(KL {kl:.6f}, CE {ce:.6f}), got {loss.item():.10f}")
    loss.backward()
    onehot = np.eye(v)[y]
    grad = alpha * T * (q - p) / n + (1 - alpha) * (soft - onehot) / n
    np.testing.assert_allclose(student.grad.numpy(), grad, rtol=1e-9, atol=1e-12,
                               err_msg="d loss / d student logits = alpha T (q_T - p_T) / N + (1 - alpha)(softmax - onehot) / N")


@pytest.mark.exercise("19.5")
def test_distillation_direction_temperature_and_edges(lesson):
    rng = np.random.default_rng(3)
    s, t = rng.standard_normal((5, 6)) * 2, rng.standard_normal((5, 6)) * 2
    got = lesson.distillation_loss(Tensor(s), t, None, temperature=3.0, alpha=1.0).item()
    forward, _, _ = kl_oracle(s, t, 3.0)
    reverse, _, _ = kl_oracle(t, s, 3.0)
    assert abs(got - 9.0 * forward) < 1e-10, (f"expected 9 KL(teacher || student) = {9 * forward:.8f}; "
                                              f"9 KL(student || teacher) would be {9 * reverse:.8f}; without T^2 "
                                              f"{forward:.8f}; got {got:.8f}")
    same = lesson.distillation_loss(Tensor(t.copy()), t, None, temperature=2.0, alpha=1.0).item()
    assert abs(same) < 1e-12, f"a student equal to its teacher has KL 0, got {same}"
    one = lesson.distillation_loss(Tensor(s[:1]), t[:1], np.array([2]), temperature=1.0, alpha=0.5)
    assert np.isclose(one.item(), 0.5 * kl_oracle(s[:1], t[:1], 1.0)[0] + 0.5 * ce_oracle(s[:1], np.array([2]))[0])
    f32 = Tensor(s.astype(np.float32), requires_grad=True)
    loss32 = lesson.distillation_loss(f32, t.astype(np.float32), rng.integers(0, 6, 5), temperature=2.0, alpha=0.5)
    loss32.backward()
    assert loss32.dtype == np.float32 and f32.grad.dtype == np.float32, "the loss and gradient keep the student's float32"
    with pytest.raises(ValueError, match="teacher_logits"):
        lesson.distillation_loss(Tensor(s), t[:, :5], None, alpha=1.0)
    with pytest.raises(ValueError, match="targets"):
        lesson.distillation_loss(Tensor(s), t, None, temperature=2.0, alpha=0.5)
