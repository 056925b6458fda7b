# Generated from solutions/03_training.py by `make build`. Do not edit.
"""minitorch.nn: modules, parameters, layers, a stable cross-entropy and a training loop."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from minitorch.autograd import Tensor, no_grad
from minitorch.checks import check_instance, describe
from minitorch.tensor import get_backend


class Parameter(Tensor):
    """A trainable tensor: requires_grad=True, owns a copy of its data."""

    def __init__(self, data: Tensor | np.ndarray, dtype: Any = None, device: str = "cpu"):
        if isinstance(data, Tensor):
            data = data.numpy()
        backend = get_backend(device)
        array = backend.asarray(data, dtype=dtype).copy()
        super().__init__(array, requires_grad=True, dtype=dtype, device=device)

    def _new(self, data: Any) -> Tensor:
        # Lesson 01 builds op results with type(self): the result of `p * 2` must be a plain
        # Tensor, or a module caching it in an attribute would grow a bogus "parameter".
        return Tensor(data, device=self.device)

    def __repr__(self) -> str:
        return f"Parameter(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device!r})"


class Module:
    """Base class of layers and models. Subclasses set attributes in __init__ and define forward."""

    training: bool = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def children(self) -> list[Module]:
        """Direct submodules: attributes that are Modules, or lists/tuples/dicts of Modules."""
        found = []
        for value in vars(self).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            found.extend(v for v in items if isinstance(v, Module))
        return found

    def modules(self) -> list[Module]:
        """This module and all submodules, depth first, each once."""
        out, seen, stack = [], set(), [self]
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            out.append(m)
            stack.extend(reversed(m.children()))
        return out

    def named_parameters(self, prefix: str = "") -> list[tuple[str, Parameter]]:
        """Every Parameter reachable from this module, as (dotted name, parameter) pairs.

        Order: attribute assignment order, depth first. Lists/tuples contribute their index,
        dicts their key, to the name. A parameter (or module) reachable twice appears once, under
        the first name. `prefix`, if given, is prepended as "prefix.name".
        """
        found: list[tuple[str, Parameter]] = []
        seen: set[int] = set()

        def visit(obj: Any, name: str) -> None:
            if isinstance(obj, Parameter):
                if id(obj) not in seen:
                    seen.add(id(obj))
                    found.append((name, obj))
            elif isinstance(obj, Module):
                if id(obj) in seen:
                    return
                seen.add(id(obj))
                for key, value in vars(obj).items():
                    visit(value, f"{name}.{key}" if name else key)
            elif isinstance(obj, (list, tuple)):
                for i, item in enumerate(obj):
                    visit(item, f"{name}.{i}" if name else str(i))
            elif isinstance(obj, dict):
                for key, item in obj.items():
                    visit(item, f"{name}.{key}" if name else str(key))

        visit(self, prefix)
        return found

    def parameters(self) -> list[Parameter]:
        """The parameters of named_parameters(), without the names."""
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        """Forget accumulated gradients (backward adds into .grad)."""
        for p in self.parameters():
            p.zero_grad()

    def train(self, mode: bool = True) -> Module:
        """Set training mode on this module and every submodule (dropout, batch norm care)."""
        for m in self.modules():
            m.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def num_parameters(self) -> int:
        return sum(int(p.size) for p in self.parameters())

    def to(self, device: str) -> Module:
        """Move every parameter to `device` in place (the same Parameter objects); returns self.

        Move the model before building its optimiser: optimiser state lives on the device the
        parameters had when it was created."""
        target = get_backend(device)
        for p in self.parameters():
            if p.device != device:
                p.data = target.asarray(get_backend(p.device).to_numpy(p.data))
                p.device, p.grad = device, None
        return self


INITS = ("he", "glorot", "lecun")


def init_std(init: str | float, fan_in: int, fan_out: int) -> float:
    """Standard deviation of the weights for an init scheme.

    "he": sqrt(2/fan_in); "glorot": sqrt(2/(fan_in+fan_out)); "lecun": sqrt(1/fan_in);
    a number: that standard deviation itself. Anything else raises ValueError.
    """
    if isinstance(init, (int, float)) and not isinstance(init, bool):
        if init < 0:
            raise ValueError(f"init std must be >= 0, got {init}")
        return float(init)
    if init == "he":
        return float(np.sqrt(2.0 / fan_in))
    if init == "glorot":
        return float(np.sqrt(2.0 / (fan_in + fan_out)))
    if init == "lecun":
        return float(np.sqrt(1.0 / fan_in))
    raise ValueError(f"unknown init {init!r}: use one of {INITS} or a standard deviation (float)")


class Linear(Module):
    """y = x @ weight + bias. x (..., in_features) -> y (..., out_features), float32.

    weight: Parameter (in_features, out_features) ~ N(0, init_std(init, in, out)^2);
    bias: Parameter (out_features,) of zeros, or None when bias=False.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 rng: np.random.Generator | None = None, init: str | float = "he", device: str = "cpu"):
        self.in_features, self.out_features = in_features, out_features
        rng = rng if rng is not None else np.random.default_rng()
        std = init_std(init, in_features, out_features)
        w = rng.standard_normal((in_features, out_features)) * std
        self.weight = Parameter(w.astype(np.float32), device=device)
        self.bias = Parameter(np.zeros(out_features, np.float32), device=device) if bias else None

    def forward(self, x: Tensor | np.ndarray) -> Tensor:
        """x (..., in_features), a Tensor or array -> Tensor (..., out_features).

        Raises ValueError naming both shapes when x's last dimension is not in_features."""
        if not isinstance(x, Tensor):
            x = Tensor(np.asarray(x, dtype=np.float32), device=self.weight.device)
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"Linear({self.in_features}, {self.out_features}) expects input shape "
                             f"(..., {self.in_features}), got {tuple(x.shape)}")
        y = x @ self.weight
        return y + self.bias if self.bias is not None else y

    def __repr__(self) -> str:
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias is not None})"


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu()


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.tanh()


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sigmoid()


class Sequential(Module):
    """Apply modules in order. Parameters are named layers.0.weight, layers.1.bias, ..."""

    def __init__(self, *modules: Module):
        for i, m in enumerate(modules):
            check_instance("Sequential", f"modules[{i}]", m, Module)
        self.layers = list(modules)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)


ACTIVATIONS = {"relu": ReLU, "tanh": Tanh, "sigmoid": Sigmoid}


class MLP(Sequential):
    """Linear(sizes[0], sizes[1]) -> act -> ... -> Linear(sizes[-2], sizes[-1]) (no final act).

    x (N, sizes[0]) -> logits (N, sizes[-1]). init defaults to "he" for relu, "glorot" otherwise.
    """

    def __init__(self, sizes: list[int], activation: str = "relu", rng: np.random.Generator | None = None,
                 init: str | float | None = None, device: str = "cpu"):
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least input and output sizes, got {sizes}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: use one of {tuple(ACTIVATIONS)}")
        rng = rng if rng is not None else np.random.default_rng()
        init = init if init is not None else ("he" if activation == "relu" else "glorot")
        layers: list[Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(Linear(n_in, n_out, rng=rng, init=init, device=device))
            if i < len(sizes) - 2:
                layers.append(ACTIVATIONS[activation]())
        super().__init__(*layers)
        self.sizes = list(sizes)


def cross_entropy(logits: Tensor, targets: Tensor | np.ndarray) -> Tensor:
    """Mean cross-entropy of `logits` (N, C) float against integer class `targets` (N,).

    Stable for any finite logits (log-sum-exp with the row max subtracted). Returns a scalar
    Tensor; its gradient w.r.t. logits is (softmax(logits) - onehot(targets)) / N.
    """
    if isinstance(targets, Tensor):
        targets = targets.numpy()
    targets = np.asarray(targets)
    if logits.ndim != 2:
        raise ValueError(f"cross_entropy expects logits of shape (N, C), got {tuple(logits.shape)}")
    n, c = logits.shape
    if targets.shape != (n,):
        raise ValueError(f"cross_entropy: targets must have shape ({n},) to match logits {tuple(logits.shape)}, "
                         f"got {targets.shape}")
    if targets.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: targets must be integer class indices, got dtype {targets.dtype}")
    if n and (targets.min() < 0 or targets.max() >= c):
        raise ValueError(f"cross_entropy: targets must lie in [0, {c}), got values from {targets.min()} to {targets.max()}")
    backend = get_backend(logits.device)
    m = logits.detach().max(axis=1, keepdims=True)
    z = logits - m
    lse = z.exp().sum(axis=1, keepdims=True).log()
    onehot = np.zeros((n, c), dtype=logits.dtype)
    onehot[np.arange(n), targets] = 1
    picked = (z * Tensor(backend.asarray(onehot), device=logits.device)).sum(axis=1, keepdims=True)
    return (lse - picked).mean()


def state_dict(self: Module) -> dict[str, np.ndarray]:
    """{name: NumPy copy of the parameter}, in named_parameters() order."""
    return {name: np.array(get_backend(p.device).to_numpy(p.data), copy=True) for name, p in self.named_parameters()}


def load_state_dict(self: Module, state: dict[str, Any]) -> None:
    """Copy `state`'s arrays into this module's parameters, in place.

    Strict: raises KeyError naming missing and unexpected keys, ValueError naming the key and
    both shapes on a shape mismatch; on error no parameter is modified. Values are cast to
    each parameter's dtype.
    """
    params = dict(self.named_parameters())
    missing = [k for k in params if k not in state]
    unexpected = [k for k in state if k not in params]
    if missing or unexpected:
        raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    arrays = {}
    for name, p in params.items():
        value = state[name]
        array = value.numpy() if isinstance(value, Tensor) else np.asarray(value)
        if array.shape != tuple(p.shape):
            raise ValueError(f"load_state_dict: {name!r} has shape {array.shape} in the state dict "
                             f"but {tuple(p.shape)} in the model")
        arrays[name] = array
    for name, p in params.items():
        p.data[...] = get_backend(p.device).asarray(arrays[name], dtype=p.dtype)


Module.state_dict = state_dict
Module.load_state_dict = load_state_dict


def _device_of(model: Any) -> str:
    params = list(model.parameters())
    return params[0].device if params else "cpu"


def _samples(what: str, X: np.ndarray, y: np.ndarray, names: tuple[str, str] = ("X", "y")) -> tuple:
    """X (N, ...) and y (N,) as arrays; a ValueError naming the argument unless X has a sample axis,
    y one entry per sample, and the class indices in y are >= 0."""
    X, y = np.asarray(X), np.asarray(y)
    if X.ndim == 0:
        raise ValueError(f"{what}: {names[0]} must have a sample axis (N, ...), got {describe(X)}")
    if len(X) != len(y):
        raise ValueError(f"{what}: {names[0]} has {len(X)} samples (shape {X.shape}) but {names[1]} has {len(y)} "
                         f"(shape {y.shape})")
    if y.size and y.min() < 0:
        raise ValueError(f"{what}: {names[1]} must hold class indices >= 0, got {y.min()}")
    return X, y


def _class_checked(loss_fn: Callable, what: str, name: str) -> Callable:
    """loss_fn(logits, targets), with a ValueError naming `name` first when a class index in targets is
    beyond the model's outputs (logits (..., C)): accuracy would silently count it wrong."""
    def checked(logits: Tensor, targets: np.ndarray) -> Tensor:
        if len(targets) and targets.max() >= logits.shape[-1]:
            raise ValueError(f"{what}: {name} must hold class indices < {logits.shape[-1]} (the model's "
                             f"outputs), got {targets.max()}")
        return loss_fn(logits, targets)

    return checked


def evaluate(model: Any, X: np.ndarray, y: np.ndarray, loss_fn: Callable | None = None,
             batch_size: int = 1024) -> tuple[float, float]:
    """(mean loss, accuracy) of `model` on X (N, ...) float32 or float64, y (N,) int64 class indices;
    eval mode, no_grad."""
    X, y = _samples("evaluate", X, y)
    loss_fn = _class_checked(loss_fn if loss_fn is not None else cross_entropy, "evaluate", "y")
    device, was_training = _device_of(model), getattr(model, "training", True)
    model.eval()
    total_loss, correct = 0.0, 0
    with no_grad():
        for start in range(0, len(X), batch_size):
            xb, yb = X[start:start + batch_size], y[start:start + batch_size]
            logits = model(Tensor(xb, device=device))
            total_loss += loss_fn(logits, yb).item() * len(xb)
            correct += int((logits.numpy().argmax(axis=-1) == yb).sum())
    model.train(was_training)
    return total_loss / max(len(X), 1), correct / max(len(X), 1)


def fit(model: Any, X: np.ndarray, y: np.ndarray, optimizer: Any, epochs: int, batch_size: int = 32,
        rng: np.random.Generator | None = None, progress: bool = True, loss_fn: Callable | None = None,
        X_val: np.ndarray | None = None, y_val: np.ndarray | None = None) -> dict[str, list[float]]:
    """Train `model` on X (N, ...) float32 or float64 / y (N,) int64 class indices for `epochs` epochs
    (0 is allowed: no training) of shuffled mini-batches.

    Each batch: forward, loss_fn(logits, y_batch) (default cross_entropy), optimizer.zero_grad(),
    loss.backward(), optimizer.step(). Returns {"loss": [...], "accuracy": [...]} (one entry per
    epoch: sample-weighted mean batch loss, fraction of samples predicted right), plus
    "val_loss" and "val_accuracy" when X_val, y_val are given. rng=None means seed 0.
    """
    X, y = _samples("fit", X, y)
    if (X_val is None) != (y_val is None):
        raise ValueError(f"fit: X_val and y_val go together, got X_val={describe(X_val)}, y_val={describe(y_val)}")
    if X_val is not None:
        X_val, y_val = _samples("fit", X_val, y_val, ("X_val", "y_val"))
    if batch_size < 1 or epochs < 0:
        raise ValueError(f"fit needs batch_size >= 1 and epochs >= 0, got batch_size={batch_size}, epochs={epochs}")
    rng = rng if rng is not None else np.random.default_rng(0)
    plain_loss_fn = loss_fn if loss_fn is not None else cross_entropy
    loss_fn = _class_checked(plain_loss_fn, "fit", "y")  # refuses a class index beyond the model's outputs
    device = _device_of(model)
    history: dict[str, list[float]] = {"loss": [], "accuracy": []}
    if X_val is not None:
        history["val_loss"], history["val_accuracy"] = [], []
    from tqdm.auto import tqdm

    bar = tqdm(range(epochs), disable=not progress, desc="training", unit="epoch")
    for epoch in bar:
        # One epoch: training mode, a fresh permutation from rng, then per mini-batch: forward,
        # loss, zero_grad, backward, step; accumulate the loss (weighted by batch size) and the
        # number of correct predictions; append the epoch's mean loss and accuracy to history.
        model.train()
        order = rng.permutation(len(X))
        total_loss, correct = 0.0, 0
        for start in range(0, len(X), batch_size):
            idx = order[start:start + batch_size]
            xb, yb = X[idx], y[idx]
            logits = model(Tensor(xb, device=device))
            loss = loss_fn(logits, yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(idx)
            correct += int((logits.numpy().argmax(axis=-1) == yb).sum())
        history["loss"].append(total_loss / len(X))
        history["accuracy"].append(correct / len(X))
        if X_val is not None:
            val_loss, val_acc = evaluate(model, X_val, y_val, plain_loss_fn)
            history["val_loss"].append(val_loss)
            history["val_accuracy"].append(val_acc)
        bar.set_postfix(loss=f"{history['loss'][-1]:.4f}", acc=f"{history['accuracy'][-1]:.3f}")
    return history


import math  # noqa: E402

from minitorch.autograd import _Device  # noqa: E402
from minitorch.checks import (Array, Attrs, Choice, Count, Instance, Optional, Rule, Seq, Size,  # noqa: E402
                              TensorLike, validate_public)


class _Init(Rule):
    """An init scheme of init_std: one of INITS, or a standard deviation (a finite number >= 0)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if isinstance(value, str) and value in INITS:
            return
        number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
        if number and math.isfinite(value) and value >= 0:
            return
        raise (ValueError if number or isinstance(value, str) else TypeError)(
            f"{what}: {name} must be one of {', '.join(map(repr, INITS))} or a standard deviation (a finite "
            f"number >= 0), got {describe(value)}")


class _AllOf(Rule):
    """What every one of the rules accepts (the first refusal otherwise)."""

    def __init__(self, *rules: Rule):
        self.rules = rules

    def __call__(self, what: str, name: str, value: Any) -> None:
        for rule in self.rules:
            rule(what, name, value)


class _Labels(Rule):
    """Class indices (N,): what `kind` accepts (an integer array, or Tensor), with one axis."""

    def __init__(self, kind: Rule):
        self.kind = kind

    def __call__(self, what: str, name: str, value: Any) -> None:
        self.kind(what, name, value)
        shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
        if len(shape) != 1:
            raise ValueError(f"{what}: {name} must have one axis (N,) of class indices, got shape {shape}")


# The last of the lesson's given cells: in the notebook (one namespace for the three modules) optim's
# and data's names are wrapped already, and this call wraps the rest, nn's.
_DEVICE, _INIT, _TENSOR = _Device(), _Init(), Instance(Tensor, must="an autograd Tensor")
_STATE = Instance(dict, must="a dict {parameter name: array}")
_SAMPLES, _LABELS = Array(dtypes=("float32", "float64")), _Labels(Array(dtypes="int"))

validate_public(globals(), {
    "Parameter": {"device": _DEVICE},
    "Module.to": {"device": _DEVICE},
    "Module.load_state_dict": {"state": _STATE},
    "init_std": {"init": _INIT, "fan_in": Size, "fan_out": Size},
    "Linear": {"in_features": Size, "out_features": Size, "init": _INIT, "device": _DEVICE},
    "ReLU.forward": {"x": _TENSOR},
    "Tanh.forward": {"x": _TENSOR},
    "Sigmoid.forward": {"x": _TENSOR},
    "MLP": {"sizes": Seq(Size, min_len=2), "activation": Choice(*ACTIVATIONS), "init": Optional(_INIT),
            "device": _DEVICE},
    "cross_entropy": {"logits": _AllOf(_TENSOR, TensorLike(ndim=2, dtypes="float", axes="(N, C)")),
                      "targets": _Labels(TensorLike(dtypes="int"))},
    "load_state_dict": {"state": _STATE},
    "evaluate": {"model": Attrs("parameters", "eval", "train"), "X": _SAMPLES, "y": _LABELS, "batch_size": Size},
    "fit": {"model": Attrs("parameters", "train"), "X": _SAMPLES, "y": _LABELS, "optimizer": Attrs("zero_grad", "step"),
            "epochs": Count, "batch_size": Size, "X_val": Optional(_SAMPLES), "y_val": Optional(_LABELS)},
})
