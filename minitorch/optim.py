# Generated from solutions/03_training.py by `make build`. Do not edit.
"""minitorch.optim: SGD with momentum and weight decay, and Adam."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from minitorch.autograd import Tensor
from minitorch.tensor import get_backend


class Optimizer:
    """Holds a deduplicated list of trainable tensors; subclasses implement step()."""

    def __init__(self, params: Iterable[Tensor]):
        params = list(params)
        self.params: list[Tensor] = []
        seen: set[int] = set()
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"{type(self).__name__}: params[{i}] is a {type(p).__name__}, not a Tensor "
                                "(pass model.parameters())")
            if not p.requires_grad:
                raise ValueError(f"{type(self).__name__}: params[{i}] (shape {tuple(p.shape)}) does not require grad")
            if id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def step(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement step()")

    def state_arrays(self) -> int:
        """How many parameter-sized arrays of state the optimiser keeps per parameter."""
        return 0


class SGD(Optimizer):
    """p <- p - lr * v with v <- momentum * v + (grad + weight_decay * p); v starts at 0."""

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params)
        if lr <= 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD needs lr > 0, momentum >= 0, weight_decay >= 0; "
                             f"got lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.velocity: list = [None] * len(self.params)  # one array per parameter, created lazily

    def step(self) -> None:
        """One update of every parameter that has a .grad, in place on p.data."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad.data
            if self.weight_decay:
                g = g + self.weight_decay * p.data
            if self.momentum:
                if self.velocity[i] is None:
                    self.velocity[i] = get_backend(p.device).xp.zeros_like(p.data)
                v = self.velocity[i]
                v *= self.momentum
                v += g
                g = v
            p.data[...] -= (self.lr * g).astype(p.data.dtype, copy=False)

    def state_arrays(self) -> int:
        return 1 if self.momentum else 0


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015) with bias correction; m, v start at 0, t counts step() calls."""

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        super().__init__(params)
        b1, b2 = betas
        if lr <= 0 or not (0 <= b1 < 1 and 0 <= b2 < 1) or eps < 0:
            raise ValueError(f"Adam needs lr > 0, 0 <= betas < 1, eps >= 0; got lr={lr}, betas={betas}, eps={eps}")
        self.lr, self.betas, self.eps = lr, (b1, b2), eps
        self.t = 0
        self.m: list = [None] * len(self.params)
        self.v: list = [None] * len(self.params)

    def step(self) -> None:
        """One bias-corrected Adam update of every parameter that has a .grad, in place."""
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            xp = get_backend(p.device).xp
            g = p.grad.data
            if self.m[i] is None:
                self.m[i], self.v[i] = xp.zeros_like(p.data), xp.zeros_like(p.data)
            m, v = self.m[i], self.v[i]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            update = self.lr * (m / c1) / (xp.sqrt(v / c2) + self.eps)
            p.data[...] -= update.astype(p.data.dtype, copy=False)

    def state_arrays(self) -> int:
        return 2


from typing import Any  # noqa: E402

from minitorch.checks import NonNegative, Number, Positive, Rule, describe, validate_public  # noqa: E402


class _Params(Rule):
    """An iterable of Tensors (model.parameters()); the optimizer checks each item itself."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if isinstance(value, (str, bytes, dict, Tensor)) or not hasattr(value, "__iter__"):
            raise TypeError(f"{what}: {name} must be an iterable of Tensors (model.parameters()), "
                            f"got {describe(value)}")


class _Betas(Rule):
    """Adam's (beta1, beta2): two numbers in [0, 1)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise (ValueError if isinstance(value, (tuple, list)) else TypeError)(
                f"{what}: {name} must be a pair (beta1, beta2) of numbers in [0, 1), got {describe(value)}")
        for i, b in enumerate(value):
            _DECAY(what, f"{name}[{i}]", b)


_PARAMS, _DECAY = _Params(), Number(0, 1, hi_open=True)

# The notebook defines lesson 03's three modules in one namespace, and this cell runs before nn's: it
# wraps only optim's own classes (in place), leaving nn's names to nn's rules.
validate_public({"__name__": __name__, "Optimizer": Optimizer, "SGD": SGD, "Adam": Adam}, {
    "Optimizer": {"params": _PARAMS},
    "SGD": {"params": _PARAMS, "lr": Positive, "momentum": _DECAY, "weight_decay": NonNegative},
    "Adam": {"params": _PARAMS, "lr": Positive, "betas": _Betas(), "eps": NonNegative},
})
