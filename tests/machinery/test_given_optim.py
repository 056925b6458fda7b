"""Lesson 03's minitorch.optim: the given Optimizer base class and the contracts of SGD and Adam
(a bad hyper-parameter is refused by name before any state is made)."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch import optim
from minitorch.autograd import Tensor


def params():
    return [Tensor(np.ones((2, 3), np.float32), requires_grad=True),
            Tensor(np.zeros(3, np.float32), requires_grad=True)]


def test_optimizer_base_collects_and_checks_parameters():
    p = params()
    opt = optim.Optimizer(p + [p[0]])
    assert opt.params == p and opt.state_arrays() == 0, "a parameter listed twice is kept once"
    p[0].grad = Tensor(np.ones((2, 3), np.float32))
    opt.zero_grad()
    assert p[0].grad is None
    with pytest.raises(NotImplementedError, match="Optimizer does not implement step"):
        opt.step()
    for bad, error, message in ((None, TypeError, "Optimizer: params must be an iterable of Tensors.*None"),
                                ("w", TypeError, "Optimizer: params must be an iterable of Tensors.*'w'"),
                                (p[0], TypeError, "Optimizer: params must be an iterable of Tensors.*Tensor"),
                                ([], ValueError, "Optimizer got an empty parameter list"),
                                ([np.ones(3)], TypeError, r"Optimizer: params\[0\] is a ndarray, not a Tensor"),
                                ([Tensor(np.ones(3))], ValueError, r"params\[0\] .* does not require grad")):
        with pytest.raises(error, match=message):
            optim.Optimizer(bad)


def test_sgd_and_adam_refuse_bad_hyperparameters():
    for kwargs, error, message in (
            ({"lr": 0.0}, ValueError, "SGD: lr must be a finite number > 0, got 0.0"),
            ({"lr": float("nan")}, ValueError, "SGD: lr must be .*nan"),
            ({"momentum": 1.5}, ValueError, r"SGD: momentum must be a finite number in \[0, 1\), got 1.5"),
            ({"weight_decay": -1e-4}, ValueError, "SGD: weight_decay must be .* >= 0, got -0.0001"),
            ({"params": None}, TypeError, "SGD: params must be an iterable")):
        with pytest.raises(error, match=message):
            optim.SGD(**{"params": params(), "lr": 0.1, **kwargs})
    for kwargs, error, message in (
            ({"betas": (0.9,)}, ValueError, r"Adam: betas must be a pair \(beta1, beta2\).*\(0.9,\)"),
            ({"betas": 0.9}, TypeError, r"Adam: betas must be a pair.*0.9"),
            ({"betas": (0.9, 1.0)}, ValueError, r"Adam: betas\[1\] must be .*\[0, 1\), got 1.0"),
            ({"eps": -1.0}, ValueError, "Adam: eps must be .* >= 0, got -1.0"),
            ({"lr": "3e-4"}, TypeError, "Adam: lr must be a finite number > 0, got '3e-4'")):
        with pytest.raises(error, match=message):
            optim.Adam(**{"params": params(), **kwargs})
    sgd, adam = optim.SGD(params(), lr=0.1, momentum=0.9), optim.Adam(params(), betas=[0.8, 0.99])
    assert sgd.state_arrays() == 1 and adam.state_arrays() == 2 and adam.betas == (0.8, 0.99)
