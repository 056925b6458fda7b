# Generated from solutions/02_autograd.py by `make build`. Do not edit.
"""minitorch.autograd: reverse-mode automatic differentiation over minitorch.tensor."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from minitorch import tensor as _t
from minitorch.checks import TensorLike, check_int, describe
from minitorch.tensor import get_backend, normalize_axis


_GRAD_ENABLED = True


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Inside this context no graph is recorded (inference, optimizer updates, checks)."""
    global _GRAD_ENABLED
    previous, _GRAD_ENABLED = _GRAD_ENABLED, False
    try:
        yield
    finally:
        _GRAD_ENABLED = previous


def _float_kind(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind == "f"


def _int_args(what: str, name: str, args: tuple) -> tuple:
    """The integers of a `*shape` or `*axes` argument, given one by one or as one sequence; a
    TypeError naming `name` and the item where one is not an integer (2.5, True, "1")."""
    first = args[0] if len(args) == 1 else None
    one = isinstance(first, (list, tuple)) or isinstance(first, np.ndarray) and first.ndim == 1
    items = tuple(args[0]) if one else args
    for i, a in enumerate(items):
        check_int(what, f"{name}[{i}]", a)
    return items


def add_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, *, xp: Any = np) -> tuple[Any, Any]:
    """VJP of out = a + b: g for both inputs."""
    return g, g


def sub_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, *, xp: Any = np) -> tuple[Any, Any]:
    """VJP of out = a - b: g for a, -g for b."""
    return g, -g


def _binary_vjp(name: str) -> Callable:
    """The VJP function of the binary ufunc `name` (looked up when the backward runs)."""
    if name == "add":
        return add_vjp
    if name == "subtract":
        return sub_vjp
    if name == "multiply":
        return mul_vjp
    if name == "divide":
        return div_vjp
    if name == "power":
        return pow_vjp
    raise NotImplementedError(f"no VJP for the binary op {name!r}")


class Tensor(_t.Tensor):
    """A lesson-01 Tensor that records the computation graph for reverse-mode autodiff.

    Tensor(data, requires_grad=False, dtype=None, device="cpu"). `.grad` is a Tensor (same
    shape and dtype) or None; `.backward(grad=None)` fills the `.grad` of every leaf that
    requires it. Only floating-point tensors can require gradients.
    """

    grad: Tensor | None = None
    requires_grad: bool = False
    _parents: tuple = ()
    _vjp: Callable | None = None
    _op: str = ""

    def __init__(self, data: Any, requires_grad: bool = False, dtype: Any = None, device: str = "cpu"):
        super().__init__(data, dtype=dtype, device=device)
        if requires_grad and not _float_kind(self.dtype):
            raise TypeError(f"Tensor: requires_grad=True needs a floating-point tensor (only those have gradients), "
                            f"got dtype {self.dtype}")
        self.requires_grad = bool(requires_grad)
        self.grad = None

    def __repr__(self) -> str:
        text = super().__repr__()
        return text[:-1] + ", requires_grad=True)" if self.requires_grad else text

    # -- graph recording --
    def _record(self, out: Tensor, parents: Sequence[Any], vjp: Callable, op: str) -> Tensor:
        """Attach (parents, vjp) to `out` if gradients are enabled and a parent needs one.

        `vjp(g)` returns one gradient per entry of `parents` (entries that are not autograd
        Tensors get None placeholders and are dropped here)."""
        keep = [i for i, p in enumerate(parents) if isinstance(p, Tensor) and p.requires_grad]
        if not _GRAD_ENABLED or not keep:
            return out
        out.requires_grad = True
        out._parents = tuple(parents[i] for i in keep)
        out._op = op

        def vjp_kept(g: Any) -> tuple:
            grads = vjp(g)
            return tuple(grads[i] for i in keep)

        out._vjp = vjp_kept
        return out

    def detach(self) -> Tensor:
        """The same data (shared) as a new leaf that does not require gradients."""
        return Tensor(self.data, device=self.device)

    def zero_grad(self) -> None:
        self.grad = None

    # -- the engine --
    def backward(self, grad: Tensor | np.ndarray | None = None) -> None:
        """Accumulate d(self)/d(leaf) * grad into `.grad` of every leaf that requires it.

        `grad` defaults to 1 for a tensor with one element; otherwise it must be given, with
        self's shape, as a Tensor or an array of any real dtype (float16 or float64 for a float32
        graph, say). It is cast to self's dtype (as PyTorch does): a float64 seed must not turn
        the backward of a float32 graph into float64."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad (no input has requires_grad=True, "
                               "or it was computed under no_grad())")
        xp = self.xp
        if grad is None:
            if self.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a one-element output, got shape {self.shape}")
            g = xp.ones(self.shape, dtype=self.dtype)
        else:
            g = grad.data if isinstance(grad, _t.Tensor) else self.backend.asarray(grad)
            if tuple(g.shape) != self.shape:
                raise ValueError(f"Tensor.backward: grad must have the tensor's shape {self.shape}, "
                                 f"got {describe(grad)}")
            if g.dtype != self.dtype:
                g = g.astype(self.dtype)
        grads: dict[int, Any] = {id(self): g}
        for node in reversed(topo_order(self)):
            g = grads.pop(id(node), None)
            if g is None:
                continue
            if node._vjp is None:  # a leaf
                g = node.backend.asarray(g, dtype=node.dtype)
                if node.grad is None:
                    node.grad = Tensor(g.copy(), device=node.device)
                else:  # in place, as PyTorch accumulates: no new array per backward (micro-batches)
                    node.grad.data += g
                continue
            for parent, pg in zip(node._parents, node._vjp(g)):
                if pg is None:
                    continue
                if tuple(pg.shape) != parent.shape:
                    pg = unbroadcast(pg, parent.shape)
                key = id(parent)
                grads[key] = pg if key not in grads else grads[key] + pg

    # -- differentiable ops (forward from lesson 01, backward from this lesson) --
    def _binary(self, other: Any, name: str, reverse: bool = False) -> Tensor:
        if isinstance(other, np.generic):  # a NumPy scalar counts as a Python number (lesson 01)
            other = other.item()
        out = super()._binary(other, name, reverse)
        a, b = (other, self) if reverse else (self, other)
        ad = a.data if isinstance(a, _t.Tensor) else a
        bd = b.data if isinstance(b, _t.Tensor) else b
        if not isinstance(a, _t.Tensor) and not isinstance(a, (int, float, bool, np.number)):
            ad = self.backend.asarray(a)
        if not isinstance(b, _t.Tensor) and not isinstance(b, (int, float, bool, np.number)):
            bd = self.backend.asarray(b)
        xp = self.xp
        return self._record(out, (a, b), lambda g: _binary_vjp(name)(g, ad, bd, out.data, xp=xp), name)

    def __neg__(self) -> Tensor:
        out = super().__neg__()
        return self._record(out, (self,), lambda g: (-g,), "neg")

    def exp(self) -> Tensor:
        out = super().exp()
        return self._record(out, (self,), lambda g: (exp_vjp(g, self.data, out.data, xp=self.xp),), "exp")

    def log(self) -> Tensor:
        out = super().log()
        return self._record(out, (self,), lambda g: (log_vjp(g, self.data, out.data, xp=self.xp),), "log")

    def tanh(self) -> Tensor:
        out = super().tanh()
        return self._record(out, (self,), lambda g: (tanh_vjp(g, self.data, out.data, xp=self.xp),), "tanh")

    def relu(self) -> Tensor:
        out = super().relu()
        return self._record(out, (self,), lambda g: (relu_vjp(g, self.data, out.data, xp=self.xp),), "relu")

    def sigmoid(self) -> Tensor:
        out = super().sigmoid()
        return self._record(out, (self,), lambda g: (sigmoid_vjp(g, self.data, out.data, xp=self.xp),), "sigmoid")

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        out = super().sum(axis, keepdims)
        axes = normalize_axis(axis, self.ndim)
        return self._record(out, (self,), lambda g: (sum_vjp(g, self.shape, axes, keepdims, xp=self.xp),), "sum")

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        out = super().mean(axis, keepdims)
        axes = normalize_axis(axis, self.ndim)
        count = math.prod(self.shape[a] for a in axes)
        return self._record(out, (self,),
                            lambda g: (sum_vjp(g, self.shape, axes, keepdims, xp=self.xp) / count,), "mean")

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        out = super().max(axis, keepdims)
        axes = normalize_axis(axis, self.ndim)
        return self._record(out, (self,),
                            lambda g: (max_vjp(g, self.data, out.data, axes, keepdims, xp=self.xp),), "max")

    def matmul(self, other: Tensor | np.ndarray) -> Tensor:
        if not isinstance(other, _t.Tensor):
            other = Tensor(other, device=self.device)
        out = super().matmul(other)
        backend = self.backend  # the backend's matmul runs the backward too (lesson 06, 08)
        return self._record(out, (self, other),
                            lambda g: matmul_vjp(g, self.data, other.data, backend.matmul), "matmul")

    def __rmatmul__(self, other: Any) -> Tensor:
        return Tensor(other, device=self.device).matmul(self)

    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        _int_args("Tensor.reshape", "shape", shape)
        out = super().reshape(*shape)
        return self._record(out, (self,), lambda g: (g.reshape(self.shape),), "reshape")

    def transpose(self, *axes: int | Sequence[int]) -> Tensor:
        _int_args("Tensor.transpose", "axes", axes)
        out = super().transpose(*axes)
        if len(axes) == 1 and not isinstance(axes[0], (int, np.integer)):
            axes = tuple(axes[0])
        perm = tuple(int(a) % self.ndim for a in axes) if axes else tuple(reversed(range(self.ndim)))
        inverse = tuple(int(i) for i in np.argsort(perm))
        return self._record(out, (self,), lambda g: (self.xp.transpose(g, inverse),), "transpose")

    def __getitem__(self, key: Any) -> Tensor:
        out = super().__getitem__(key)
        bkey = _t._backend_key(key)

        def vjp(g):
            full = self.xp.zeros(self.shape, dtype=g.dtype)
            self.xp.add.at(full, bkey, g)  # add.at: repeated indices accumulate
            return (full,)

        return self._record(out, (self,), vjp, "getitem")

    def to(self, device: str) -> Tensor:
        out = super().to(device)
        if out is self:
            return out
        src = self.backend
        dst = out.backend
        return self._record(out, (self,), lambda g: (src.asarray(dst.to_numpy(g)),), "to")


def topo_order(root: Tensor) -> list[Tensor]:
    """Every tensor reachable from `root` through `_parents`, each listed once, each after all
    of its parents; `root` is last. Iterative: works for graphs deeper than the recursion limit."""
    order: list[Tensor] = []
    visited: set[int] = set()
    stack: list[tuple[Tensor, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        for parent in node._parents:
            if id(parent) not in visited:
                stack.append((parent, False))
    return order


def mul_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, *, xp: Any = np) -> tuple[Any, Any]:
    """VJP of out = a * b. g: gradient of out (broadcast shape); a, b: arrays or scalars.
    Returns (grad_a, grad_b) in the broadcast shape."""
    return g * b, g * a


def div_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, *, xp: Any = np) -> tuple[Any, Any]:
    """VJP of out = a / b. Returns (grad_a, grad_b)."""
    return g / b, -g * a / (b * b)


def pow_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, *, xp: Any = np) -> tuple[Any, Any]:
    """VJP of out = a ** b (a, b: arrays or Python numbers). grad_a is 0 where b == 0; grad_b
    is 0 where a <= 0. Returns (grad_a, grad_b) in g's dtype, with no warnings at a = 0."""
    if isinstance(b, (int, float)):
        grad_a = g * b * a ** (b - 1) if b != 0 else g * 0
    else:
        grad_a = xp.where(b == 0, 0, g * b * a ** xp.where(b == 0, 1, b - 1))
    if isinstance(a, (int, float)):
        grad_b = g * out * math.log(a) if a > 0 else g * 0
    else:
        positive = a > 0
        grad_b = xp.where(positive, g * out * xp.log(xp.where(positive, a, 1)), 0)
    return grad_a, grad_b


def exp_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = exp(x)."""
    return g * out


def log_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = log(x)."""
    return g / x


def tanh_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = tanh(x), using out."""
    return g * (1 - out * out)


def relu_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = max(x, 0); the derivative at x == 0 is taken as 0."""
    return g * (x > 0)


def sigmoid_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = sigmoid(x), using out (finite for every x, even where exp(-x) overflows)."""
    return g * out * (1 - out)


def unbroadcast(g: np.ndarray, shape: Sequence[int]) -> Any:
    """Sum `g` (an array of the broadcast shape) down to `shape`, the shape of an input that was
    broadcast to g.shape. Returns an array of exactly `shape`. Uses only array methods
    (g.sum, g.reshape), so it works for NumPy and CuPy arrays alike."""
    shape = tuple(shape)
    gshape = tuple(g.shape)
    lead = len(gshape) - len(shape)
    if lead < 0 or any(n != 1 and n != m for n, m in zip(shape, gshape[lead:])):
        raise ValueError(f"unbroadcast: shape {shape} does not broadcast to gradient shape {gshape}")
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, g.shape)) if n == 1 and m != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _check_reduced(what: str, in_shape: Sequence[int], axes: tuple[int, ...], keepdims: bool, **arrays: Any) -> None:
    """A ValueError naming the argument unless `axes` are distinct axes of `in_shape` and each of
    `arrays` (g, out) has the reduced shape. (Given: the exercise is below.)"""
    ndim = len(in_shape)
    if len(set(axes)) != len(axes) or any(not 0 <= a < ndim for a in axes):
        raise ValueError(f"{what}: axes must be distinct axes in [0, {ndim}) of a shape {tuple(in_shape)}, "
                         f"got {axes!r}")
    reduced = tuple(1 if i in axes else n for i, n in enumerate(in_shape) if keepdims or i not in axes)
    for name, array in arrays.items():
        if tuple(array.shape) != reduced:
            raise ValueError(f"{what}: {name} must have the reduced shape {reduced} ({tuple(in_shape)} over axes "
                             f"{tuple(axes)}, keepdims={keepdims}), got shape {tuple(array.shape)}")


def sum_vjp(g: np.ndarray, in_shape: Sequence[int], axes: tuple[int, ...], keepdims: bool, *, xp: Any = np) -> Any:
    """VJP of out = x.sum(axes, keepdims): an array of `in_shape` (x's shape), dtype of g."""
    _check_reduced("sum_vjp", in_shape, axes, keepdims, g=g)
    if not keepdims:
        g = g.reshape(tuple(1 if i in axes else n for i, n in enumerate(in_shape)))
    return xp.broadcast_to(g, tuple(in_shape)).copy()


def max_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, axes: tuple[int, ...], keepdims: bool, *,
            xp: Any = np) -> Any:
    """VJP of out = x.max(axes, keepdims): g goes to the maximal elements, split evenly among
    ties. Returns an array of x's shape."""
    _check_reduced("max_vjp", x.shape, axes, keepdims, g=g, out=out)
    if not keepdims:
        kept = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        g, out = g.reshape(kept), out.reshape(kept)
    mask = x == out
    count = mask.sum(axis=axes, keepdims=True).astype(g.dtype)  # int64 counts would promote to float64
    return g * mask / count


def _matmul_shape(what: str, a: Any, b: Any) -> tuple[int, ...]:
    """The shape of matmul(a, b), or a ValueError naming a or b and the shapes. (Given: the exercise
    is below.)"""
    for name, x in (("a", a), ("b", b)):
        if x.ndim == 0:
            raise ValueError(f"{what}: {name} must have at least one axis (matmul of a 0-d array), got shape ()")
    k_a, k_b = a.shape[-1], b.shape[0] if b.ndim == 1 else b.shape[-2]
    if k_a != k_b:
        raise ValueError(f"{what}: a of shape {tuple(a.shape)} and b of shape {tuple(b.shape)} do not agree in the "
                         f"summed dimension ({k_a} != {k_b})")
    try:
        batch = tuple(a.shape[:-2]) if a.shape[:-2] == b.shape[:-2] else np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(f"{what}: the batch dimensions of a {tuple(a.shape)} and b {tuple(b.shape)} do not "
                         "broadcast") from None
    return batch + tuple(a.shape[-2:-1]) + tuple(b.shape[-1:] if b.ndim > 1 else ())


def matmul_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, matmul: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
    """VJP of out = matmul(a, b), NumPy semantics (batch dims broadcast, 1-D operands are vectors).

    g has out's shape. Returns (grad_a, grad_b), each in the broadcast batch shape followed by
    a's (resp. b's) own last one or two dimensions; the engine sums broadcast batch axes."""
    out_shape = _matmul_shape("matmul_vjp", a, b)
    if tuple(g.shape) != out_shape:
        raise ValueError(f"matmul_vjp: g must have the product's shape {out_shape}, got shape {tuple(g.shape)}")
    a_vec, b_vec = a.ndim == 1, b.ndim == 1
    if b_vec:
        b = b.reshape(-1, 1)
        g = g[..., None]
    if a_vec:
        a = a.reshape(1, -1)
        g = g[..., None, :]
    grad_a = matmul(g, b.swapaxes(-1, -2))
    grad_b = matmul(a.swapaxes(-1, -2), g)
    if a_vec:
        grad_a = grad_a[..., 0, :]
    if b_vec:
        grad_b = grad_b[..., 0]
    return grad_a, grad_b


def logsumexp(x: Tensor | np.ndarray, axis: int | Sequence[int] | None = -1, keepdims: bool = False) -> Tensor:
    """log(sum(exp(x), axis)) computed stably (max-shifted), as one differentiable node.

    x: an autograd Tensor (anything else is wrapped as a constant) of floating dtype.
    Returns a Tensor of x's dtype, reduced over `axis` (keepdims as in sum); its backward is
    g * exp(x - out) with the reduced axes reinserted."""
    if not isinstance(x, Tensor):
        x = Tensor(x)
    axes = normalize_axis(axis, x.ndim)
    xp = x.xp
    m = xp.max(x.data, axis=axes, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)
    lse_kept = m + xp.log(xp.sum(xp.exp(x.data - m), axis=axes, keepdims=True))
    out = x._new(lse_kept if keepdims else lse_kept.reshape(
        tuple(n for i, n in enumerate(x.shape) if i not in axes)))

    def vjp(g: Any) -> tuple[Any]:
        g_kept = g if keepdims else g.reshape(lse_kept.shape)
        return (g_kept * xp.exp(x.data - lse_kept),)

    return x._record(out, (x,), vjp, "logsumexp")


def log_softmax(x: Tensor | np.ndarray, axis: int | Sequence[int] = -1) -> Tensor:
    """log(softmax(x)) along `axis`, stable: s - logsumexp(s, axis, keepdims=True), s = x - max(x).

    The max is a constant (no gradient flows through it; the result does not depend on it).
    A bad `axis` gets lesson 01's message (normalize_axis), not NumPy's AxisError."""
    if not isinstance(x, Tensor):
        x = Tensor(x)
    axis = normalize_axis(axis, x.ndim)
    m = x.xp.max(x.data, axis=axis, keepdims=True)
    s = x - x._new(x.xp.where(x.xp.isfinite(m), m, 0))
    return s - logsumexp(s, axis=axis, keepdims=True)


def softmax(x: Tensor | np.ndarray, axis: int | Sequence[int] = -1) -> Tensor:
    """exp(x) / sum(exp(x)) along `axis`, stable: exp(log_softmax(x))."""
    return log_softmax(x, axis).exp()


def numerical_grad(f: Callable[..., Any], *inputs: Any, eps: float = 1e-6) -> list[np.ndarray]:
    """Central-difference gradients of the scalar function `f(*tensors)` at `inputs`.

    inputs: Tensors or arrays; each is copied to a float64 NumPy array. f is called with
    float64 autograd Tensors (on the inputs' devices) and must return a one-element Tensor.
    Returns one float64 NumPy array per input, of its shape:
    d f / d x[i] ~ (f(x + eps e_i) - f(x - eps e_i)) / (2 eps)."""
    for i, x in enumerate(inputs):  # given: an input that is not a real array or Tensor is refused by name
        TensorLike(dtypes="real")("numerical_grad", f"inputs[{i}]", x)
    devices = [x.device if isinstance(x, _t.Tensor) else "cpu" for x in inputs]
    arrays = [np.array(x.numpy() if isinstance(x, _t.Tensor) else x, dtype=np.float64) for x in inputs]

    def evaluate() -> float:
        with no_grad():
            out = f(*(Tensor(a.copy(), device=d) for a, d in zip(arrays, devices)))
        if not isinstance(out, _t.Tensor) or out.size != 1:
            raise ValueError(f"numerical_grad: f must return a one-element Tensor, got {out!r:.80}")
        return float(out.item())

    grads = []
    for a in arrays:
        grad = np.zeros_like(a)
        flat, gflat = a.reshape(-1), grad.reshape(-1)
        for i in range(flat.size):
            saved = flat[i]
            flat[i] = saved + eps
            up = evaluate()
            flat[i] = saved - eps
            down = evaluate()
            flat[i] = saved
            gflat[i] = (up - down) / (2 * eps)
        grads.append(grad)
    return grads


def grad_check(f: Callable[..., Any], *inputs: Any, eps: float = 1e-6, atol: float = 1e-5,
               rtol: float = 1e-4) -> None:
    """Compare backward() of the scalar f(*inputs) with central differences, in float64.

    Raises AssertionError naming the input, the element and both values of the worst
    mismatch (|analytic - numeric| > atol + rtol * |numeric|, or a value that is not finite)."""
    for i, x in enumerate(inputs):
        TensorLike(dtypes="real")("grad_check", f"inputs[{i}]", x)
    devices = [x.device if isinstance(x, _t.Tensor) else "cpu" for x in inputs]
    arrays = [np.array(x.numpy() if isinstance(x, _t.Tensor) else x, dtype=np.float64) for x in inputs]
    leaves = [Tensor(a.copy(), requires_grad=True, device=d) for a, d in zip(arrays, devices)]
    out = f(*leaves)
    if not isinstance(out, Tensor) or out.size != 1:
        raise ValueError(f"grad_check: f must return a one-element autograd Tensor, got {out!r:.80}")
    if out.requires_grad:
        out.backward()
    numeric = numerical_grad(f, *arrays, eps=eps)
    worst = None
    for k, (leaf, num) in enumerate(zip(leaves, numeric)):
        ana = leaf.grad.numpy() if leaf.grad is not None else np.zeros_like(num)
        if ana.shape != num.shape:
            raise AssertionError(f"input {k}: gradient shape {ana.shape} != input shape {num.shape}")
        excess = np.abs(ana - num) - (atol + rtol * np.abs(num))
        excess = np.where(np.isfinite(ana) & np.isfinite(num), excess, np.inf)  # nan/inf never pass
        if excess.size and (worst is None or excess.max() > worst[0]):
            idx = np.unravel_index(int(np.argmax(excess)), excess.shape)
            worst = (excess.max(), k, idx, ana[idx], num[idx])
    if worst is not None and worst[0] > 0:
        _, k, idx, a_val, n_val = worst
        raise AssertionError(f"gradient mismatch: input {k}, element {tuple(int(i) for i in idx)}: "
                             f"backward gives {a_val:.8g}, central differences give {n_val:.8g} "
                             f"(atol={atol}, rtol={rtol})")


from minitorch.checks import Attrs, Int, NonNegative, Positive, Rule, Seq, validate_public  # noqa: E402


class _Operand(Rule):
    """What the engine hands a VJP: an array of a backend (NumPy's, or CuPy's: anything with
    `__array_namespace__` or `__cuda_array_interface__`) of bool, integer or floating dtype, or
    (scalars=True) a real Python number (`x * 2`, `2 ** x`). Fast: the engine calls a VJP per node."""

    def __init__(self, scalars: bool):
        self.scalars = scalars
        self.must = "an array of bool, integer or floating dtype" + (" or a real number" if scalars else "")

    def __call__(self, what: str, name: str, value: Any) -> None:
        if type(value) is np.ndarray or hasattr(value, "__array_namespace__") or \
                hasattr(value, "__cuda_array_interface__"):
            if value.dtype.kind in "biuf":
                return
        elif self.scalars and isinstance(value, (int, float)):
            return
        raise TypeError(f"{what}: {name} must be {self.must}, got {describe(value)}")


class _Device(Rule):
    """The name of a device with a registered backend ("cpu"; "cuda" once lesson 08 registers CuPy)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, str):
            raise TypeError(f"{what}: {name} must be a device name (a str such as 'cpu'), got {describe(value)}")
        try:
            get_backend(value)
        except (KeyError, ValueError) as exc:  # lesson 01's get_backend refuses an unknown device
            raise ValueError(f"{what}: {name} must be a device with a registered backend, got {value!r} "
                             f"({exc.args[0]})") from None


class _Ints(Rule):
    """A shape or normalised axes: a sequence of integers >= lo (Seq(Int(lo))'s rule and messages), with
    a fast path for the tuple of Python ints the engine passes (Seq checks each item with a call)."""

    def __init__(self, lo: int | None):
        self.lo, self.slow = lo, Seq(Int(lo))

    def __call__(self, what: str, name: str, value: Any) -> None:
        if type(value) is tuple and all(type(n) is int and (self.lo is None or n >= self.lo) for n in value):
            return
        self.slow(what, name, value)


_OPERAND, _ARRAY, _DEVICE = _Operand(scalars=True), _Operand(scalars=False), _Device()
_SHAPE, _AXES = _Ints(0), _Ints(None)
_FLOAT_X = TensorLike(dtypes="float")

validate_public(globals(), {
    "Tensor": {"device": _DEVICE},
    "Tensor.to": {"device": _DEVICE},
    "topo_order": {"root": Attrs("_parents")},
    **{name: {"g": _OPERAND, "a": _OPERAND, "b": _OPERAND, "out": _OPERAND}
       for name in ("add_vjp", "sub_vjp", "mul_vjp", "div_vjp", "pow_vjp")},
    **{name: {"g": _OPERAND, "x": _OPERAND, "out": _OPERAND}
       for name in ("exp_vjp", "log_vjp", "tanh_vjp", "relu_vjp", "sigmoid_vjp")},
    "unbroadcast": {"g": _ARRAY, "shape": _SHAPE},
    "sum_vjp": {"g": _ARRAY, "in_shape": _SHAPE, "axes": _AXES},
    "max_vjp": {"g": _ARRAY, "x": _ARRAY, "out": _ARRAY, "axes": _AXES},
    "matmul_vjp": {"g": _ARRAY, "a": _ARRAY, "b": _ARRAY},
    "logsumexp": {"x": _FLOAT_X},
    "log_softmax": {"x": _FLOAT_X},
    "softmax": {"x": _FLOAT_X},
    "numerical_grad": {"eps": Positive},
    "grad_check": {"eps": Positive, "atol": NonNegative, "rtol": NonNegative},
})
