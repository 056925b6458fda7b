"""Lesson 02's given code (minitorch.autograd) and its contracts: what no exercise test calls
(Tensor.to, grad_check), and the refusals the validation walk relies on, each a TypeError or
ValueError that names the parameter and the value, never a raw NumPy error or a silent answer.

Regression: `x.sum(axis=1.7)` once summed over axis 1 (an outside review): a float, bool or str
axis is refused wherever an axis is taken (reductions, logsumexp/softmax/log_softmax, the
reduction VJPs, transpose and reshape).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from minitorch import autograd as ag
from minitorch.autograd import Tensor


def leaf(shape=(2, 3), seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("axis", [1.7, 1.0, True, "1", np.float64(1.0), [1.5], (0, 0.5)])
def test_reductions_refuse_an_axis_that_is_not_an_integer(op, axis):
    x = leaf()
    with pytest.raises(TypeError, match=rf"Tensor\.{op}: axis must be an integer, got {re.escape(repr(axis))}"):
        getattr(x, op)(axis=axis)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_reductions_refuse_out_of_range_and_repeated_axes(op):
    x = leaf()
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        getattr(x, op)(axis=2)
    with pytest.raises(ValueError, match="repeated"):
        getattr(x, op)(axis=(1, -1))
    assert getattr(x, op)(axis=-1).shape == (2,)


@pytest.mark.parametrize("fn", [ag.logsumexp, ag.softmax, ag.log_softmax])
def test_softmax_family_refuses_a_float_axis_and_integer_data(fn):
    x = leaf()
    with pytest.raises(TypeError, match=f"{fn.__name__}: axis must be an integer, got 1.7"):
        fn(x, axis=1.7)
    with pytest.raises(TypeError, match=f"{fn.__name__}: x must be .*dtype float.*int64"):
        fn(np.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match=f"{fn.__name__}: x must be .*None"):
        fn(None)


def test_transpose_and_reshape_refuse_non_integers():
    x = leaf()
    for call, message in ((lambda: x.transpose(1.7, 0), r"Tensor\.transpose: axes\[0\] must be an integer, got 1\.7"),
                          (lambda: x.transpose((1, True)), r"axes\[1\] must be an integer, got True"),
                          (lambda: x.reshape(3.0, 2), r"Tensor\.reshape: shape\[0\] must be an integer, got 3\.0"),
                          (lambda: x.reshape((3, 2.5)), r"shape\[1\] must be an integer, got 2\.5")):
        with pytest.raises(TypeError, match=message):
            call()
    assert x.transpose(1, 0).shape == (3, 2) and x.reshape(np.array([3, 2])).shape == (3, 2)
    assert x.transpose((1, 0)).shape == (3, 2) and x.reshape(-1).shape == (6,)


def test_reduction_vjps_refuse_bad_axes_and_shapes():
    g, x = np.ones(2), np.ones((2, 3))
    with pytest.raises(TypeError, match=r"sum_vjp: axes\[0\] must be an integer, got 1\.7"):
        ag.sum_vjp(g, (2, 3), (1.7,), False)
    with pytest.raises(ValueError, match=r"sum_vjp: axes must be distinct axes in \[0, 2\).*\(-1,\)"):
        ag.sum_vjp(g, (2, 3), (-1,), False)  # not normalised: reshaping by `i in axes` would be silently wrong
    with pytest.raises(ValueError, match=r"sum_vjp: g must have the reduced shape \(2,\).*\(3,\)"):
        ag.sum_vjp(np.ones(3), (2, 3), (1,), False)
    with pytest.raises(ValueError, match=r"max_vjp: out must have the reduced shape \(2, 1\).*\(2,\)"):
        ag.max_vjp(np.ones((2, 1)), x, x.max(axis=1), (1,), True)
    with pytest.raises(TypeError, match="max_vjp: x must be an array.*None"):
        ag.max_vjp(g, None, np.ones(2), (1,), False)
    with pytest.raises(ValueError, match=r"sum_vjp: in_shape\[1\] must be an integer >= 0, got -3"):
        ag.sum_vjp(g, (2, -3), (1,), False)
    assert ag.sum_vjp(g, (2, 3), (1,), False).shape == (2, 3)


def test_matmul_vjp_checks_the_shapes_it_is_given():
    a, b = np.ones((4, 2, 3)), np.ones((3, 5))
    ga, gb = ag.matmul_vjp(np.ones((4, 2, 5)), a, b, np.matmul)
    assert ga.shape == (4, 2, 3) and gb.shape == (4, 3, 5)
    with pytest.raises(ValueError, match=r"matmul_vjp: g must have the product's shape \(4, 2, 5\), got shape \(2, "):
        ag.matmul_vjp(np.ones((2, 5)), a, b, np.matmul)
    with pytest.raises(ValueError, match=r"a of shape \(4, 2, 3\) and b of shape \(4, 5\).*3 != 4"):
        ag.matmul_vjp(np.ones((4, 2, 5)), a, np.ones((4, 5)), np.matmul)
    with pytest.raises(ValueError, match="matmul_vjp: a must have at least one axis"):
        ag.matmul_vjp(np.ones(3), np.float64(2.0), np.ones(3), np.matmul)
    with pytest.raises(TypeError, match="matmul_vjp: matmul must be callable, got 3"):
        ag.matmul_vjp(np.ones((4, 2, 5)), a, b, 3)
    gv, gw = ag.matmul_vjp(np.float64(1.0), np.ones(3), np.ones(3), np.matmul)  # vector . vector
    assert gv.shape == (3,) and gw.shape == (3,)


@pytest.mark.parametrize("name", ["add_vjp", "sub_vjp", "mul_vjp", "div_vjp", "pow_vjp"])
def test_binary_vjps_take_arrays_or_numbers_only(name):
    fn = getattr(ag, name)
    g, a = np.ones(3), np.full(3, 2.0)
    fn(g, a, 3.0, a)  # a Python number operand (x * 3.0) is what the engine passes
    fn(g, 2, a, a)
    for pname, position in (("g", 0), ("a", 1), ("b", 2), ("out", 3)):
        for bad in (None, "x", [1.0, 2.0, 3.0], a.astype(np.complex128)):
            args = [g, a, a, a]
            args[position] = bad
            with pytest.raises(TypeError, match=f"{name}: {pname} must be an array"):
                fn(*args)


def test_unary_vjps_and_unbroadcast_refuse_non_arrays():
    g, x = np.ones(3), np.full(3, 0.5)
    for name in ("exp_vjp", "log_vjp", "tanh_vjp", "relu_vjp", "sigmoid_vjp"):
        fn = getattr(ag, name)
        assert fn(g, x, x).shape == (3,)
        with pytest.raises(TypeError, match=f"{name}: out must be an array.*'a'"):
            fn(g, x, "a")
    with pytest.raises(TypeError, match="unbroadcast: g must be an array.*2.0"):
        ag.unbroadcast(2.0, ())
    with pytest.raises(ValueError, match=r"unbroadcast: shape \(4,\) does not broadcast"):
        ag.unbroadcast(np.ones((2, 3)), (4,))


def test_tensor_device_requires_grad_and_backward_seed():
    x = leaf()
    assert x.to("cpu") is x
    for call in (lambda: Tensor(1.0, device="no-such-device"), lambda: x.to("no-such-device")):
        with pytest.raises(ValueError, match="device must be a device with a registered backend, got 'no-such-device'"):
            call()
    with pytest.raises(TypeError, match="device must be a device name.*3"):
        x.to(3)
    with pytest.raises(TypeError, match="requires_grad=True needs a floating-point tensor.*int64"):
        Tensor(np.arange(3), requires_grad=True)
    y = (x * 2.0).sum(axis=1)
    with pytest.raises(ValueError, match=r"Tensor\.backward: grad must have the tensor's shape \(2,\), got an array of "
                                         r"shape \(3,\)"):
        y.backward(np.ones(3))
    with pytest.raises(TypeError, match=r"Tensor\.backward: grad must be .*complex"):
        y.backward(np.ones(2, np.complex128))
    y.backward(np.ones(2, np.float16))  # any real dtype seeds the backward, cast to the graph's dtype
    assert x.grad.dtype == np.float64 and np.allclose(x.grad.numpy(), 2.0)
    with pytest.raises(TypeError, match="Tensor.matmul: other must be .*'w'"):
        x.matmul("w")


def test_grad_check_passes_right_gradients_and_names_a_wrong_one():
    rng = np.random.default_rng(1)
    w, b = rng.standard_normal((3, 2)), rng.standard_normal(2)
    x = Tensor(rng.standard_normal((4, 3)))
    ag.grad_check(lambda w, b: ((x @ w + b).tanh() ** 2).mean(), w, b, eps=1e-6, atol=1e-6, rtol=1e-5)

    def wrong(w):  # a backward that drops a factor of 2: x * w recorded with w's VJP halved
        out = (w * w).sum()
        vjp = out._vjp
        out._vjp = lambda g: tuple(v * 0.5 for v in vjp(g))
        return out

    with pytest.raises(AssertionError, match=r"gradient mismatch: input 0, element"):
        ag.grad_check(wrong, w)
    with pytest.raises(ValueError, match=r"grad_check: eps must be a finite number > 0, got -1"):
        ag.grad_check(lambda w: w.sum(), w, eps=-1.0)
    with pytest.raises(TypeError, match=r"grad_check: inputs\[1\] must be an array.*'b'"):
        ag.grad_check(lambda w, b: w.sum(), w, "b")
    with pytest.raises(TypeError, match=r"numerical_grad: inputs\[0\] must be an array.*None"):
        ag.numerical_grad(lambda w: w.sum(), None)
    with pytest.raises(ValueError, match="grad_check: f must return a one-element autograd Tensor"):
        ag.grad_check(lambda w: w * 2, w)
