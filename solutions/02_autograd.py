# %% [markdown]
# # Lesson 02: autograd
#
# Training a network needs the gradient of one scalar (the loss) with respect to millions of
# parameters. Reverse-mode automatic differentiation computes all of them for a small constant
# multiple of the cost of evaluating the loss once: run the computation forward while
# recording it as a graph, then walk the graph backwards once, applying the chain rule at each
# node (Griewank and Walther, *Evaluating Derivatives*, 2008; Baydin et al., "Automatic
# differentiation in machine learning: a survey", 2018).
#
# Each op needs one piece of local knowledge, its *vector-Jacobian product* (VJP): given
# `g = dL/d(out)`, return `dL/d(input) = g · d(out)/d(input)` for each input. For `out = a * b`
# that is `(g * b, g * a)`. The engine does the rest: it orders the graph so every node is
# processed after all nodes that use it, and it *adds* the gradients arriving at a node used
# more than once.
#
# You will write:
#
# 1. `topo_order`: the graph in topological order, iteratively (no recursion limit).
# 2. The VJPs of the elementwise ops: `mul`, `div`, `pow`, `exp`, `log`, `tanh`, `relu`,
#    `sigmoid`.
# 3. `unbroadcast`: sum a gradient back to the shape of an input that was broadcast.
# 4. The VJPs of the reductions `sum`, `mean` and `max`, with axes and `keepdims`.
# 5. The VJP of `matmul`, with batch dimensions and vectors.
# 6. `logsumexp`, numerically stable, with its own backward; `softmax` and `log_softmax`
#    follow from it.
# 7. `numerical_grad`: central differences, the check every other gradient is held to.
#
# The result is `minitorch/autograd.py`: a `Tensor` that subclasses lesson 01's and records
# the graph. Background on why gradient checks run in float64:
# [number formats](../hardware_notes/number_formats.md).

# %%
#| default_exp autograd
#| export
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

# %%
import os

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %% [markdown]
# ## 0. The graph and the engine (given)
#
# An autograd `Tensor` is a lesson-01 `Tensor` with four more fields: `requires_grad`,
# `grad`, and for a tensor made by an op, its `_parents` (the input tensors that need
# gradients) and `_vjp`, a closure that maps the output gradient to one gradient per parent.
# The closure captures what the backward needs (the inputs, sometimes the output); this saved
# state is why training uses far more memory than inference, a cost that activation
# checkpointing trades for recomputation (the data-parallel lesson, planned as lesson 12).
#
# The engine, `backward`, is given. It calls your `topo_order` (section 1), walks the nodes
# from the output back, calls each node's `_vjp`, and accumulates into a dictionary keyed by
# node. A gradient that comes back in a broadcast shape is summed to its parent's shape with
# your `unbroadcast` (section 3); a VJP therefore returns gradients in the broadcast shape of
# the output, which keeps each VJP simple. Only leaves (tensors made by the user with
# `requires_grad=True`) keep `.grad`, and it accumulates across calls, as in PyTorch, until
# `zero_grad()`.
#
# The cell below is the whole class; its ops call VJP functions you write in the following
# sections. Until you write them, the forward pass works and the backward raises
# `NotImplementedError` naming the missing exercise.

# %%
#| export
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


# %% [markdown]
# ## 1. Topological order
#
# `backward` must process a node only after every node that consumes it has sent its
# gradient. Listing the graph so that each node comes after all of its parents (a topological
# order) and walking that list in reverse guarantees it. The textbook way is a recursive
# depth-first search that appends a node after visiting its parents (micrograd does this).
# Recursion fails on deep graphs: an RNN unrolled over 2,000 steps, or a loop that
# accumulates 5,000 terms, exceeds Python's default recursion limit of 1,000 frames. Write
# it with an explicit stack: push `(node, expanded=False)`; when popped unexpanded, push it
# back as expanded and push its unvisited parents; when popped expanded, append it to the
# order. Visit each node once (a set of `id(node)`), however many paths lead to it.

# %%
#| export
#| exercise 2.1
def topo_order(root: Tensor) -> list[Tensor]:
    """Every tensor reachable from `root` through `_parents`, each listed once, each after all
    of its parents; `root` is last. Iterative: works for graphs deeper than the recursion limit."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


# %% tags=["check"]
check("2.1")

# %% tags=["demo"]
x = Tensor(np.array(1.0), requires_grad=True)
y = x
for _ in range(5000):  # deeper than the recursion limit
    y = y + x
y.backward()
print("d/dx of x + x + ... (5001 terms):", x.grad.item())

# %% [markdown]
# ## 2. Elementwise VJPs
#
# For an elementwise op each output element depends on the input element at the same position
# (after broadcasting), so the Jacobian is diagonal and the VJP is an elementwise product:
#
# | op | VJP for `a` | VJP for `b` |
# |---|---|---|
# | `a * b` | `g * b` | `g * a` |
# | `a / b` | `g / b` | `-g * a / b**2` |
# | `a ** b` | `g * b * a**(b-1)` | `g * out * log(a)` (0 where `a <= 0`) |
# | `exp(x)` | `g * out` | |
# | `log(x)` | `g / x` | |
# | `tanh(x)` | `g * (1 - out**2)` | |
# | `relu(x)` | `g * (x > 0)` | |
# | `sigmoid(x)` | `g * out * (1 - out)` | |
#
# Reusing `out` (exp, tanh, sigmoid) saves recomputing the function, and for sigmoid it is also
# what keeps the backward as stable as the forward: lesson 01's `sigmoid` never overflows, but
# the textbook derivative `exp(-x) / (1 + exp(-x))**2` gives `inf / inf = nan` at `x = -1000`.
# `relu`'s derivative at exactly 0 is undefined; we use 0, as PyTorch does. Two edge cases of
# `a ** b`, both as PyTorch has them: where `b == 0` the gradient of `a` is 0 (`x ** 0` is the
# constant 1), although the formula gives `0 * 0 ** -1 = 0 * inf = nan` at `a = 0`; and for
# `a <= 0` the derivative in `b` is not a real number (for `a < 0`) or has the limit 0: we
# return 0 there. For arrays use `xp.where`, and feed the formula a harmless value (exponent
# 1, base 1) where its result is not used, so that no `0 ** -1` or `log` of a non-positive
# number is evaluated into a warning. `a` or `b` may also be a Python number (`x ** 2`,
# `2 ** x`): handle that case with plain Python (`math.log`), because `xp.where` would turn
# the number into a 0-d int64 or float64 array, and a float64 array, unlike a Python number,
# promotes a float32 gradient to float64.
# `a` and `b` may be arrays or Python scalars; the engine drops gradients of scalars.
# Return gradients with the shape of `g` (the broadcast shape); `unbroadcast` does the rest.
# `add_vjp` and `sub_vjp` are given in the class cell above.

# %%
#| export
#| exercise 2.2
def mul_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, *, xp: Any = np) -> tuple[Any, Any]:
    """VJP of out = a * b. g: gradient of out (broadcast shape); a, b: arrays or scalars.
    Returns (grad_a, grad_b) in the broadcast shape."""
    ### BEGIN SOLUTION
    return g * b, g * a
    ### END SOLUTION


def div_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, *, xp: Any = np) -> tuple[Any, Any]:
    """VJP of out = a / b. Returns (grad_a, grad_b)."""
    ### BEGIN SOLUTION
    return g / b, -g * a / (b * b)
    ### END SOLUTION


def pow_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, *, xp: Any = np) -> tuple[Any, Any]:
    """VJP of out = a ** b (a, b: arrays or Python numbers). grad_a is 0 where b == 0; grad_b
    is 0 where a <= 0. Returns (grad_a, grad_b) in g's dtype, with no warnings at a = 0."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def exp_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = exp(x)."""
    ### BEGIN SOLUTION
    return g * out
    ### END SOLUTION


def log_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = log(x)."""
    ### BEGIN SOLUTION
    return g / x
    ### END SOLUTION


def tanh_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = tanh(x), using out."""
    ### BEGIN SOLUTION
    return g * (1 - out * out)
    ### END SOLUTION


def relu_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = max(x, 0); the derivative at x == 0 is taken as 0."""
    ### BEGIN SOLUTION
    return g * (x > 0)
    ### END SOLUTION


def sigmoid_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, *, xp: Any = np) -> Any:
    """VJP of out = sigmoid(x), using out (finite for every x, even where exp(-x) overflows)."""
    ### BEGIN SOLUTION
    return g * out * (1 - out)
    ### END SOLUTION


# %% tags=["check"]
check("2.2")

# %% [markdown]
# ## 3. Unbroadcast
#
# When `a` of shape (3, 1) is added to `b` of shape (2, 3, 4), every element of `a` is read by
# 2 * 4 = 8 output positions (lesson 01: broadcasting is a view with stride 0 along those
# axes). By the multivariate chain rule the gradient of `a` is the *sum* of the gradients of
# all the positions that read it. So: sum `g` over the leading axes that `a` does not have,
# then over the axes where `a` has size 1 and `g` does not, keeping those axes. Forgetting
# this is a classic autograd bug: the gradient of a bias comes back with the batch dimension.
# Raise `ValueError` naming both shapes if `shape` does not broadcast to `g.shape`.

# %%
#| export
#| exercise 2.3
def unbroadcast(g: np.ndarray, shape: Sequence[int]) -> Any:
    """Sum `g` (an array of the broadcast shape) down to `shape`, the shape of an input that was
    broadcast to g.shape. Returns an array of exactly `shape`. Uses only array methods
    (g.sum, g.reshape), so it works for NumPy and CuPy arrays alike."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


# %% tags=["check"]
check("2.3")

# %% [markdown]
# ## 4. Reductions
#
# `out = x.sum(axis)` reads each input element once, into the output position with those axes
# removed; so the gradient of every input element is the output gradient at its position:
# reinsert the reduced axes as size 1 (unless `keepdims` kept them) and broadcast `g` back to
# the input shape. `mean` is `sum / count` (given, using your `sum_vjp`).
#
# `out = x.max(axis)` depends only on the maximal elements: the gradient flows to positions
# where `x == out` (out reinserted like `g`). With ties, the max is not differentiable;
# we split the gradient evenly among the tied elements (PyTorch's `amax` does the same), so
# the gradient still sums to `g`.
#
# `axes` arrives normalised (a sorted tuple from lesson 01's `normalize_axis`). Return an
# array you can write into (`xp.broadcast_to` returns a read-only view; multiply by ones or
# copy it).

# %%
#| export
#| exercise 2.4
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
    ### BEGIN SOLUTION
    if not keepdims:
        g = g.reshape(tuple(1 if i in axes else n for i, n in enumerate(in_shape)))
    return xp.broadcast_to(g, tuple(in_shape)).copy()
    ### END SOLUTION


def max_vjp(g: np.ndarray, x: np.ndarray, out: np.ndarray, axes: tuple[int, ...], keepdims: bool, *,
            xp: Any = np) -> Any:
    """VJP of out = x.max(axes, keepdims): g goes to the maximal elements, split evenly among
    ties. Returns an array of x's shape."""
    _check_reduced("max_vjp", x.shape, axes, keepdims, g=g, out=out)
    ### BEGIN SOLUTION
    if not keepdims:
        kept = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        g, out = g.reshape(kept), out.reshape(kept)
    mask = x == out
    count = mask.sum(axis=axes, keepdims=True).astype(g.dtype)  # int64 counts would promote to float64
    return g * mask / count
    ### END SOLUTION


# %% tags=["check"]
check("2.4")

# %% [markdown]
# ## 5. Matmul
#
# For `C = A @ B` with `A` (m, k), `B` (k, n), each `C[i, j] = sum_p A[i, p] B[p, j]`, so
# `dL/dA[i, p] = sum_j G[i, j] B[p, j]`, i.e.
#
# `grad_A = G @ B^T` (m, k) and `grad_B = A^T @ G` (k, n).
#
# The shapes check themselves: there is only one way to combine `G` (m, n) with `B` to get
# (m, k). With batch dimensions `(..., m, k) @ (..., k, n)` the same formulas hold per batch
# element, with `^T` swapping the last two axes only; a batch dimension that was broadcast
# is then summed by the engine's `unbroadcast`. A 1-D operand is a vector: NumPy treats
# `a` (k,) as a (1, k) row and `b` (k,) as a (k, 1) column and then drops that axis; promote
# them (and `g`) the same way, apply the formulas, and drop the axis again.
#
# Call `matmul` (the backend's, passed in) for both products: in lesson 06 your Numba kernel
# then runs the backward pass as well as the forward.

# %%
#| export
#| exercise 2.5
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
    ### BEGIN SOLUTION
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
    ### END SOLUTION


# %% tags=["check"]
check("2.5")

# %% [markdown]
# ## 6. Stable logsumexp, softmax, log-softmax
#
# `logsumexp(x) = log(sum(exp(x)))` appears in every softmax and cross-entropy. Evaluated as
# written it overflows: `exp(89)` is already `inf` in float32 (float32's largest value is
# about 3.4e38, see [number formats](../hardware_notes/number_formats.md)), and logits of
# that size are routine. The fix is exact algebra: for any `m`,
# `log(sum(exp(x))) = m + log(sum(exp(x - m)))`; choosing `m = max(x)` makes every exponent
# `<= 0` and the largest term exactly 1, so the sum lies in `[1, n]`: no overflow, and no
# `log(0)` underflow. (If a whole row is `-inf`, the max is `-inf` and `x - m` is `nan`; use
# `m = 0` for such rows so the result is `-inf`.)
#
# Its gradient is `d lse / d x_i = exp(x_i - lse) = softmax(x)_i`, so `logsumexp` gets its
# own VJP: `g` (with the reduced axis reinserted) times `exp(x - lse)`, reusing the saved
# output. Recording it as one node, rather than as max, subtract, exp, sum, log, saves memory
# and time, and is the first example of a *fused* op (lesson 08, exercise 8.6, fuses the
# whole softmax into one GPU kernel).
# With it, `log_softmax(x) = x - logsumexp(x, keepdims=True)` and
# `softmax(x) = exp(log_softmax(x))` are stable and differentiable for free (given). One more
# detail, about precision rather than overflow: for logits near 1000, `x - lse` subtracts two
# large float32 numbers whose rounding error (an ulp of 1000 is 6e-5) lands in the result, so
# the given code first subtracts the max as a constant, `s = x - max(x)` (exact for nearby
# values), and computes `s - logsumexp(s)`, where `logsumexp(s)` lies in `[0, log n]`.

# %%
#| export
#| exercise 2.6
def logsumexp(x: Tensor | np.ndarray, axis: int | Sequence[int] | None = -1, keepdims: bool = False) -> Tensor:
    """log(sum(exp(x), axis)) computed stably (max-shifted), as one differentiable node.

    x: an autograd Tensor (anything else is wrapped as a constant) of floating dtype.
    Returns a Tensor of x's dtype, reduced over `axis` (keepdims as in sum); its backward is
    g * exp(x - out) with the reduced axes reinserted."""
    if not isinstance(x, Tensor):
        x = Tensor(x)
    axes = normalize_axis(axis, x.ndim)
    xp = x.xp
    ### BEGIN SOLUTION
    m = xp.max(x.data, axis=axes, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)
    lse_kept = m + xp.log(xp.sum(xp.exp(x.data - m), axis=axes, keepdims=True))
    out = x._new(lse_kept if keepdims else lse_kept.reshape(
        tuple(n for i, n in enumerate(x.shape) if i not in axes)))
    ### END SOLUTION

    def vjp(g: Any) -> tuple[Any]:
        ### BEGIN SOLUTION
        g_kept = g if keepdims else g.reshape(lse_kept.shape)
        return (g_kept * xp.exp(x.data - lse_kept),)
        ### END SOLUTION

    return x._record(out, (x,), vjp, "logsumexp")


# %%
#| export
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


# %% tags=["check"]
check("2.6")

# %% tags=["demo"]
z = Tensor(np.array([[1000.0, 1001.0, 1002.0], [-1000.0, -1000.0, -1000.0]], dtype=np.float32))
with np.errstate(over="ignore", divide="ignore"):
    print("naive:  ", np.log(np.exp(z.numpy()).sum(axis=-1)))
print("stable: ", logsumexp(z).numpy())
print("softmax:", softmax(z).numpy())

# %% [markdown]
# ## 7. Numerical gradients
#
# How do you know a VJP is right? Compare it with the definition of the derivative. The
# *central* difference `(f(x + eps) - f(x - eps)) / (2 eps)` has error `O(eps^2)` from
# truncation (the `f''` terms cancel), against `O(eps)` for the one-sided difference. The
# other error is rounding: `f` is computed with relative error about machine epsilon `u`, and
# dividing by `2 eps` amplifies it to about `u |f| / eps`. The total is smallest near
# `eps ~ u^(1/3)`: about 1e-5 in float64 (`u = 1.1e-16`), giving gradients good to roughly
# 1e-10 relative. In float32 (`u = 6e-8`) the best achievable accuracy is only about 1e-3 to
# 1e-5, too coarse to tell a subtle bug from noise; this is why gradient checks run in float64
# (see [number formats](../hardware_notes/number_formats.md); Nocedal and Wright, *Numerical
# Optimization*, 2006, section 8.1).
#
# `numerical_grad(f, *inputs, eps)` perturbs each element of each input in turn, in float64
# copies, and evaluates `f` twice per element (so it costs `2 * total size` forward passes:
# fine for checks, hopeless for training, which is the point of reverse mode). Run `f` under
# `no_grad()`: no graph is needed. The given `grad_check` compares it with `backward()`.

# %%
#| export
#| exercise 2.7
def numerical_grad(f: Callable[..., Any], *inputs: Any, eps: float = 1e-6) -> list[np.ndarray]:
    """Central-difference gradients of the scalar function `f(*tensors)` at `inputs`.

    inputs: Tensors or arrays; each is copied to a float64 NumPy array. f is called with
    float64 autograd Tensors (on the inputs' devices) and must return a one-element Tensor.
    Returns one float64 NumPy array per input, of its shape:
    d f / d x[i] ~ (f(x + eps e_i) - f(x - eps e_i)) / (2 eps)."""
    for i, x in enumerate(inputs):  # given: an input that is not a real array or Tensor is refused by name
        TensorLike(dtypes="real")("numerical_grad", f"inputs[{i}]", x)
    ### BEGIN SOLUTION
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
    ### END SOLUTION


# %%
#| export
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


# %% tags=["check"]
check("2.7")

# %% [markdown]
# Live: the two errors of a central difference, for `f(x) = sin(x) exp(x)` at `x = 1` (exact
# derivative `(sin x + cos x) exp x`). Right of the minimum the truncation error falls as
# `eps^2`; left of it rounding grows as `u / eps`. Switch to float32 to see the minimum rise by
# eight orders of magnitude and move to larger eps.

# %% tags=["demo"]
import matplotlib.pyplot as plt

from course.live import live


def central_error(eps: np.ndarray, dtype) -> np.ndarray:
    x, e = dtype(1.0), eps.astype(dtype)
    f = lambda t: np.sin(t) * np.exp(t)  # noqa: E731
    exact = (np.sin(1.0) + np.cos(1.0)) * np.exp(1.0)
    return np.abs((f(x + e) - f(x - e)) / (2 * e) - exact) / abs(exact)


EPS = np.logspace(-14, 0, 200)


def draw_numerical_grad(log10_eps: float, dtype: str):
    dt = np.float64 if dtype == "float64" else np.float32
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, d in (("float64", np.float64), ("float32", np.float32)):
        ax.loglog(EPS, np.maximum(central_error(EPS, d), 1e-17), label=name, alpha=1 if d is dt else 0.3)
    err = central_error(np.array([10.0 ** log10_eps]), dt)[0]
    ax.loglog([10.0 ** log10_eps], [max(err, 1e-17)], "o", color="C3", ms=10)
    ax.set(xlabel="eps", ylabel="relative error", ylim=(1e-17, 10),
           title=f"{dtype}, eps = 1e{log10_eps:.1f}: relative error {err:.1e}")
    ax.legend(fontsize=8)
    return fig


live(draw_numerical_grad, log10_eps=(-14.0, 0.0), dtype=["float64", "float32"])

# %% [markdown]
# ## 8. Everything together
#
# With every exercise done, `grad_check` can test whole expressions: a two-layer network with
# broadcasting biases, a softmax cross-entropy, batch matmuls, indexing. The cell below is
# the end-to-end test of your lesson; lesson 03 trains networks on exactly these pieces.

# %% tags=["demo"]
rng = np.random.default_rng(0)
X = rng.standard_normal((7, 5))
W1, b1 = rng.standard_normal((5, 6)), rng.standard_normal(6)
W2, b2 = rng.standard_normal((6, 3)), rng.standard_normal(3)
labels = rng.integers(0, 3, size=7)


def loss_fn(W1, b1, W2, b2):
    h = (Tensor(X) @ W1 + b1).tanh()
    logits = h @ W2 + b2
    logp = log_softmax(logits, axis=-1)
    return -logp[np.arange(7), labels].mean()


grad_check(loss_fn, W1, b1, W2, b2)
print("two-layer MLP with cross-entropy: backward matches central differences")

A = rng.standard_normal((2, 1, 4, 3))
B = rng.standard_normal((5, 3, 2))
grad_check(lambda A, B: ((A @ B).relu() ** 2).max(axis=(1, 3)).sum() / (A.sum() + 100.0), A, B)
print("batch matmul, relu, pow, max over axes, division: ok")

# %% [markdown]
# ### What reverse mode costs, measured
#
# Reverse mode gives all gradients for a few times the cost of one forward pass; central
# differences need two forward passes per parameter. The cell times both on the MLP above
# (5*6 + 6 + 6*3 + 3 = 57 parameters) and the forward pass alone.

# %% tags=["demo"]
import time

from minitorch.bench import load_report  # lesson 04's timing helpers

print(load_report())


def best_of(fn, repeat=5):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


params = [Tensor(p, requires_grad=True) for p in (W1, b1, W2, b2)]
n_params = sum(p.size for p in params)
t_fwd = best_of(lambda: loss_fn(*params))
t_bwd = best_of(lambda: loss_fn(*params).backward())
t_num = best_of(lambda: numerical_grad(loss_fn, W1, b1, W2, b2), repeat=3)
print(f"{n_params} parameters")
print(f"forward            {t_fwd * 1e6:8.0f} us")
print(f"forward + backward {t_bwd * 1e6:8.0f} us  ({t_bwd / t_fwd:.1f}x forward)")
print(f"central diffs      {t_num * 1e6:8.0f} us  ({t_num / t_fwd:.0f}x forward, ~{2 * n_params} forward passes)")

# %% [markdown]
# Expect forward + backward to cost a small multiple of the forward (each op's VJP does about
# as much work as its forward, plus Python overhead per node), and central differences about
# `2 * 57 = 114` forward passes. Those passes run under `no_grad()`, which skips the graph
# bookkeeping, so each is cheaper than the recorded forward timed here; rebuilding the input
# tensors for every evaluation adds some back. Measured on the 2-core dev machine (a Zen 4 VM,
# another job running; best of 5, best of 3 for central differences), three runs: forward
# 90-170 us, forward + backward 1.9 times that, central differences 100-650 times the forward.
# The spread of the last figure is the shared machine (each of its runs takes tens of
# milliseconds, long enough to be interrupted), not the method. At these tiny sizes the time
# is Python overhead per op, not arithmetic; the ratio that matters grows with the model: a
# network with a million parameters needs two million forward passes for its numerical
# gradient and still one backward pass for the exact one.
#
# ## What you measured / what to remember
#
# - Reverse mode = record the graph forward, then apply each op's VJP in reverse topological
#   order, summing the gradients of nodes used more than once. All gradients cost a small
#   multiple of one forward pass, independent of the number of parameters.
# - Topological order by an explicit stack: no recursion limit.
# - Broadcasting in the forward pass is a sum in the backward pass (`unbroadcast`); a
#   reduction in the forward pass is a broadcast in the backward pass. They are adjoint.
# - `grad_A = G @ B^T`, `grad_B = A^T @ G`, per batch element; broadcast batch axes are summed.
# - Compute `logsumexp` with the max subtracted; its gradient is the softmax.
# - Check gradients with central differences in float64; float32 is too coarse to separate
#   bugs from rounding.
#
# ## Sources
#
# - A. Griewank, A. Walther, *Evaluating Derivatives: Principles and Techniques of Algorithmic
#   Differentiation*, 2nd ed., SIAM, 2008.
# - A. G. Baydin, B. A. Pearlmutter, A. A. Radul, J. M. Siskind, "Automatic differentiation in
#   machine learning: a survey", JMLR 18, 2018. https://arxiv.org/abs/1502.05767
# - A. Karpathy, micrograd, 2020 (a scalar autograd engine in ~100 lines).
#   https://github.com/karpathy/micrograd
# - A. Paszke et al., "Automatic differentiation in PyTorch", NIPS Autodiff Workshop, 2017.
#   https://openreview.net/forum?id=BJJsrmfCZ
# - J. Nocedal, S. J. Wright, *Numerical Optimization*, 2nd ed., Springer, 2006, section 8.1
#   (finite-difference derivative approximations).
# - CS231n notes, "Gradient checks". https://cs231n.github.io/neural-networks-3/#gradcheck


# %%
#| export
#| given
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
