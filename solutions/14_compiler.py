# %% [markdown]
# # Lesson 14: a deep-learning compiler: capture, optimise, fuse, generate kernels
#
# Lessons 08 and 09 fused kernels by hand: one softmax kernel instead of five, attention without
# the N x N matrix. A compiler does it automatically. `torch.compile` (TorchDynamo captures the
# Python code into a graph, TorchInductor fuses it and writes Triton or C++ kernels), XLA, TVM and
# tinygrad all follow the same path, and this lesson builds a small version of it for minitorch:
#
# 1. **Capture.** Run a minitorch function on *proxies* that record every operation into a small
#    graph IR (op, inputs, attributes, shape, dtype), as `torch.fx`'s symbolic tracer does.
#    You write the shape and dtype rules (exercise 14.1) and the *guards* (14.2): a compiled
#    function is reused while the inputs' shapes and dtypes match, recompiled once for a new one,
#    and a function whose Python control flow depends on data is a *graph break*: it runs eagerly,
#    with a warning that names the cause.
# 2. **Passes**, each a function from graph to graph: dead-code elimination and common
#    subexpression elimination (14.3), constant folding and algebraic simplification (14.4).
# 3. **Fusion** (14.5): pointwise chains, and a reduction over the last axis with its pointwise
#    prologue and epilogue, become one kernel (TorchInductor's and tinygrad's rule); count the
#    bytes each plan reads and writes, eager against fused; then give the intermediate values
#    buffers, reusing a buffer once its value is dead (14.6).
# 4. **Code generation**: Numba source for each fused group, printed, compiled and run on all
#    cores (14.7), and CUDA C for the same groups, run on the course's CPU emulator and compiled
#    to PTX (14.8); a small autotuner picks a kernel's work split by measuring (14.9).
#
# Then `compile(fn)` runs lesson 09's transformer block (attention and MLP, written with
# minitorch's operations) and a training step (forward and backward, differentiated on the graph
# with lesson 02's rules) and gives the eager numbers (float64 to 1e-12) with fewer kernels and
# fewer bytes; section 9 places eager and fused kernels on lesson 04's roofline and times the
# block against eager minitorch and NumPy. The course's reference version of this lesson is
# `minitorch/compiler.py`.
#
# Hardware background: why fusion pays (bytes not moved, launches not made, caches) is in
# [fusion](../hardware_notes/fusion.md); the roofline it moves a kernel along is in
# [roofline](../hardware_notes/roofline.md).
#
# Scope: floating tensors (float32, float64), reductions over the last axis, matmul as an
# external (library) kernel; what is left out is listed at the end.

# %%
import os

import numpy as np

from course.check import check
from course.gpu import gpu_status, require_gpu

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
HAVE_GPU, GPU_REASON = gpu_status()
rng = np.random.default_rng(0)

# %%
#| default_exp compiler
#| export
"""minitorch.compiler: a small deep-learning compiler. Capture minitorch code into a graph
(tracing with proxies, guards, graph breaks), passes (shape/dtype propagation, DCE, CSE, constant
folding, simplification), fusion into kernels with their byte counts, and code generation (Numba
source run on the CPU, CUDA C for the GPU)."""
from __future__ import annotations

import builtins
import contextlib
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit, prange
from numba import types as numba_types
from numba.extending import overload, register_jitable
from numpy.typing import DTypeLike

from minitorch import tensor as _t
from minitorch.autograd import Tensor

# %% [markdown]
# ## 1. The graph IR and capture
#
# A graph is a list of nodes in topological order. A node is one operation:
#
# | op | inputs | attrs | meaning |
# |---|---|---|---|
# | `input` | | `name` | an argument of the function |
# | `const` | | `value` | a Python number, held in the node's dtype, shape `()` |
# | `neg exp log tanh relu sqrt` | x | | pointwise, unary |
# | `add sub mul div pow` | a, b | | pointwise, binary, NumPy broadcasting |
# | `sum max` | x | `axis`, `keepdims` | a reduction over one axis |
# | `matmul` | a, b | | `a @ b`, run by a library (BLAS): never fused |
# | `probe` | x | `label` | prints a summary of x: a *side effect*, no output |
# | `transpose` | x | | swaps the last two axes (`k.transpose(0, 2, 1)`): a library kernel |
# | `expand` | x | `shape` | x broadcast to `shape` (NumPy's rule; a row value stretched over the columns) |
# | `reshape` | x | `shape` | x's elements in a new `shape` (as many elements) |
# | `astype` | x | `dtype` | x converted to `dtype` (float32 or float64): a library kernel |
# | `step`, `eq` | x; a, b | | 1.0 where x > 0 (else 0.0), 1.0 where a == b (pointwise) |
#
# `expand`, `reshape`, `astype`, `step` and `eq` are made only by `grad_graph` (section 5), for the
# backward.
#
# Tracing (given) calls the function with `Proxy` objects in place of tensors. A proxy has the
# tensor's methods and operators; each one adds a node to the graph and returns a new proxy, so
# running the function once writes down everything it computes, whatever Python code produced it
# (loops are unrolled, helper functions inlined). What a proxy cannot do is give a value: `if
# x.sum() > 0:` asks for `bool()` of a value the tracer does not know. That is a *graph break*
# (TorchDynamo's term), raised as `GraphBreak` with the line that asked. So is every operation a
# tensor has and the graph does not: indexing `x[0]`, iterating, `len(x)`, a method the IR lacks
# (`x.sigmoid()`), NumPy's functions on a proxy, an eager Tensor or array mixed into the traced
# arithmetic; the message names the operation.
#
# Each node carries its shape and dtype, computed when it is added from its inputs' by
# `infer_meta`. That is shape and dtype propagation; it is how the compiler knows, before running
# anything, how big every buffer is, which ops can share a loop, and how many bytes a plan moves.
#
# **Exercise 14.1.** Write `broadcast_shapes(what, a, b)` and `infer_meta(op, shapes, dtypes,
# attrs) -> (shape, dtype)` for the ops of the table (all but `input` and `const`; shapes are
# tuples, dtypes `np.dtype`s, `attrs` the node's attributes):
# - binary pointwise ops: NumPy's broadcasting (shapes right-aligned, the missing leading axes
#   count as 1; two sizes agree when they are equal or one of them is 1, and the result takes the
#   other one, so a size-1 axis against a size-0 axis gives 0; otherwise a `ValueError` naming
#   both shapes); unary ops and `probe`: the input's shape and dtype;
# - `sum`, `max`: the input's shape without axis `attrs["axis"]`, or with it as 1 when
#   `attrs["keepdims"]` (a negative axis counts from the end; `ValueError` for an axis out of range,
#   and for a `max` over an axis of size 0: a maximum of nothing has no value);
# - `matmul`: `(..., n, k) @ (..., k, m) -> (..., n, m)`, the batch axes `...` of *both* operands
#   broadcast as above (`(4, 5) @ (2, 5, 3)` is `(2, 4, 3)`); `ValueError` unless both have 2 or
#   more axes and the k agree;
# - `transpose`: the last two axes swapped (`ValueError` for fewer than 2 axes); `expand`:
#   `attrs["shape"]`, which the input's shape must broadcast to (`ValueError` otherwise);
#   `reshape`: `attrs["shape"]`, which must hold as many elements; `astype`: the input's shape and
#   the dtype `attrs["dtype"]`.
#
# Dtypes: only float32 and float64 (`TypeError` otherwise, for an input or an `astype` target); a
# binary op and a matmul give `np.result_type` of their inputs (float32 with float64 is float64).
# An op not in the table is a `ValueError`.

# %%
#| export
#| given
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
UNARY = ("neg", "exp", "log", "tanh", "relu", "sqrt", "step")
BINARY = ("add", "sub", "mul", "div", "pow", "eq")
POINTWISE = UNARY + BINARY
REDUCTIONS = ("sum", "max")
SIDE_EFFECTS = ("probe",)


class GraphBreak(Exception):
    """The traced function did something a graph cannot hold (data-dependent control flow, reading
    a value, an unsupported operation). The message names the cause and the line."""


class Node:
    """One operation of a Graph: op (a str of the IR's table), inputs (Nodes), attrs (a dict of
    Python values), shape (a tuple), dtype (a np.dtype). Compare nodes by identity."""

    __slots__ = ("op", "inputs", "attrs", "shape", "dtype")

    def __init__(self, op: str, inputs: Sequence[Node], attrs: dict, shape: tuple, dtype: DTypeLike):
        self._fill(op, inputs, attrs, shape, dtype)

    def _fill(self, op: str, inputs: Sequence[Node], attrs: dict, shape: tuple, dtype: DTypeLike) -> None:
        self.op, self.inputs, self.attrs = op, tuple(inputs), dict(attrs)
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)

    @classmethod
    def _new(cls, op: str, inputs: Sequence[Node], attrs: dict, shape: tuple, dtype: DTypeLike) -> Node:
        """Node(...) without the checks of its arguments (minitorch.checks): Graph's methods make their
        nodes with it, having checked their own arguments (a pass copies every node: checking each
        copy's fields again would cost more than the copy)."""
        node = cls.__new__(cls)
        node._fill(op, inputs, attrs, shape, dtype)
        return node

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"<Node {self.op} {self.dtype}{list(self.shape)}>"


class Graph:
    """nodes: every Node in topological order (inputs first); inputs: the `input` nodes in argument
    order; outputs: the Nodes the function returns. `add` and `add_input` append nodes (the shape
    and dtype of an operation come from `infer_meta`); print(graph) lists it."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.inputs: list[Node] = []
        self.outputs: list[Node] = []
        self.single = True  # the function returned one tensor, not a tuple

    def add_input(self, name: str, shape: tuple, dtype: DTypeLike) -> Node:
        node = Node._new("input", (), {"name": name}, shape, dtype)
        self.nodes.append(node)
        self.inputs.append(node)
        return node

    def add_const(self, value: float, dtype: DTypeLike) -> Node:
        node = Node._new("const", (), {"value": float(value)}, (), dtype)
        self.nodes.append(node)
        return node

    def add(self, op: str, inputs: Sequence[Node], attrs: dict | None = None) -> Node:
        attrs = dict(attrs or {})
        shape, dtype = infer_meta(op, [i.shape for i in inputs], [i.dtype for i in inputs], attrs)
        node = Node._new(op, inputs, attrs, shape, dtype)
        self.nodes.append(node)
        return node

    def copy_node(self, node: Node, inputs: Sequence[Node]) -> Node:
        """A copy of `node` (op, attrs, shape, dtype) reading `inputs`, appended to this graph."""
        new = Node._new(node.op, inputs, node.attrs, node.shape, node.dtype)
        self.nodes.append(new)
        if node.op == "input":
            self.inputs.append(new)
        return new

    def users(self) -> dict[Node, list[Node]]:
        """{node: the nodes that read it}, for every node."""
        out: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n)
        return out

    def count(self, op: str | None = None) -> int:
        """The number of nodes (with this op)."""
        return sum(1 for n in self.nodes if op is None or n.op == op)

    def __str__(self) -> str:
        names = {n: f"%{k}" for k, n in enumerate(self.nodes)}
        lines = []
        for n in self.nodes:
            args = [names[i] for i in n.inputs] + [f"{k}={v!r}" for k, v in n.attrs.items()]
            lines.append(f"{names[n]:>4} = {n.op}({', '.join(args)})  : {n.dtype.name}{list(n.shape)}")
        lines.append(f"return {', '.join(names[o] for o in self.outputs)}")
        return "\n".join(lines)

    def to_dot(self, plan: Sequence[Sequence[Node]] | None = None) -> str:
        """The graph in Graphviz's dot language (paste into any dot viewer, or `dot -Tsvg`); with a
        fusion plan, each kernel is a box around its nodes."""
        ids = {n: f"n{k}" for k, n in enumerate(self.nodes)}

        def label(n: Node) -> str:
            extra = n.attrs.get("name", n.attrs.get("value", n.attrs.get("axis", "")))
            return f"{n.op} {extra}\\n{n.dtype.name}{list(n.shape)}".replace('"', "'")

        lines = ["digraph G {", "  rankdir=TB; node [shape=box, fontsize=10];"]
        boxed = set()
        for k, group in enumerate(plan or []):
            lines.append(f'  subgraph cluster_{k} {{ label="kernel {k}"; style=rounded;')
            lines += [f'    {ids[n]} [label="{label(n)}"];' for n in group]
            lines.append("  }")
            boxed |= set(group)
        lines += [f'  {ids[n]} [label="{label(n)}"];' for n in self.nodes if n not in boxed]
        lines += [f"  {ids[i]} -> {ids[n]};" for n in self.nodes for i in n.inputs]
        lines += [f'  out{k} [label="output {k}", shape=plaintext]; {ids[o]} -> out{k};' for k, o in enumerate(self.outputs)]
        return "\n".join(lines + ["}"])


def _where() -> str:
    """file:line of the traced code that called into the proxy (past this module's frames, and
    minitorch's or NumPy's when the proxy was handed to them)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_name != "<module>" and (
            f.f_globals.get("__name__") == __name__ or str(f.f_globals.get("__name__")).startswith(("minitorch.", "numpy"))):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


class Proxy:
    """Stands for a tensor while tracing: every operation adds a node to `graph`."""

    def __init__(self, graph: Graph, node: Node):
        self.graph, self.node = graph, node

    shape = property(lambda self: self.node.shape)
    dtype = property(lambda self: self.node.dtype)
    ndim = property(lambda self: len(self.node.shape))
    size = property(lambda self: math.prod(self.node.shape))

    def _lift(self, other: Any) -> Node:
        if isinstance(other, Proxy):
            return other.node
        if isinstance(other, (bool, int, float, np.number)):
            return self.graph.add_const(float(other), self.dtype)
        raise GraphBreak(f"an operand of type {type(other).__name__} is not a traced tensor or a number "
                         f"(at {_where()}): pass it as an argument of the compiled function")

    def _op(self, op: str, *others: Any, reverse: bool = False, **attrs: Any) -> Proxy:
        nodes = [self.node] + [self._lift(o) for o in others]
        if reverse:
            nodes.reverse()
        return Proxy(self.graph, self.graph.add(op, nodes, attrs))

    __add__ = lambda self, o: self._op("add", o)  # noqa: E731
    __radd__ = lambda self, o: self._op("add", o, reverse=True)  # noqa: E731
    __sub__ = lambda self, o: self._op("sub", o)  # noqa: E731
    __rsub__ = lambda self, o: self._op("sub", o, reverse=True)  # noqa: E731
    __mul__ = lambda self, o: self._op("mul", o)  # noqa: E731
    __rmul__ = lambda self, o: self._op("mul", o, reverse=True)  # noqa: E731
    __truediv__ = lambda self, o: self._op("div", o)  # noqa: E731
    __rtruediv__ = lambda self, o: self._op("div", o, reverse=True)  # noqa: E731
    __pow__ = lambda self, o: self._op("pow", o)  # noqa: E731
    __rpow__ = lambda self, o: self._op("pow", o, reverse=True)  # noqa: E731
    __matmul__ = lambda self, o: self._op("matmul", o)  # noqa: E731
    __rmatmul__ = lambda self, o: self._op("matmul", o, reverse=True)  # noqa: E731
    __neg__ = lambda self: self._op("neg")  # noqa: E731
    exp = lambda self: self._op("exp")  # noqa: E731
    log = lambda self: self._op("log")  # noqa: E731
    tanh = lambda self: self._op("tanh")  # noqa: E731
    relu = lambda self: self._op("relu")  # noqa: E731
    sqrt = lambda self: self._op("sqrt")  # noqa: E731

    def _reduce(self, op: str, axis: int | Sequence[int] | None, keepdims: bool) -> Proxy:
        if axis is None or isinstance(axis, (tuple, list)):
            raise GraphBreak(f"{op}(axis={axis!r}) at {_where()}: the compiler reduces over one axis only")
        return self._op(op, axis=int(axis), keepdims=bool(keepdims))

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Proxy:
        return self._reduce("sum", axis, keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Proxy:
        return self._reduce("max", axis, keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Proxy:
        total = self._reduce("sum", axis, keepdims)
        n = self.shape[int(axis)]
        return total * (1.0 / n if n else math.nan)  # NumPy's mean of nothing is nan

    def transpose(self, *axes: int) -> Proxy:
        """Swap the last two axes (the only transpose the IR has: a library kernel)."""
        n = self.ndim
        swap = tuple(range(n - 2)) + (n - 1, n - 2)
        if n < 2 or tuple(a % n for a in axes) != swap:
            raise GraphBreak(f"transpose{axes} of a {n}-d tensor at {_where()}: only swapping the last two axes "
                             f"({swap}) is supported")
        return self._op("transpose")

    def __bool__(self) -> bool:
        raise GraphBreak(f"data-dependent control flow: bool() of a traced tensor at {_where()}")

    def _value(self, *args: Any, **kwargs: Any) -> Any:
        raise GraphBreak(f"reading a traced tensor's value at {_where()}")

    __float__ = __int__ = __index__ = item = numpy = _value
    __lt__ = __le__ = __gt__ = __ge__ = lambda self, o: self._value()  # noqa: E731

    # What eager minitorch (or NumPy) can do with a tensor and the graph cannot hold: a graph break
    # naming the operation, so that compile() runs the function eagerly instead of failing.
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise GraphBreak(f"NumPy's {ufunc.__name__} on a traced tensor (np.{ufunc.__name__}(x), or an array "
                         f"operand) at {_where()}: use the tensor's own operations")

    def __getitem__(self, key: Any) -> Any:
        raise GraphBreak(f"indexing a traced tensor (x[{key!r}]) at {_where()}: the graph has no indexing op")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise GraphBreak(f"assigning into a traced tensor (x[{key!r}] = ...) at {_where()}: graphs do not mutate")

    def __iter__(self) -> Any:
        raise GraphBreak(f"iterating over a traced tensor at {_where()}: the graph has no indexing op")

    def __len__(self) -> int:
        raise GraphBreak(f"len() of a traced tensor at {_where()}: use x.shape[0]")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise GraphBreak(f"converting a traced tensor to a NumPy array (np.asarray, or an eager Tensor operand) "
                         f"at {_where()}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise GraphBreak(f"`.{name}` is not supported by the tracer (at {_where()})")


def probe(x: Tensor | Proxy | np.ndarray, label: str = "") -> None:
    """A side effect to keep: print x's shape and mean (eagerly), or record a `probe` node (traced)."""
    if isinstance(x, Proxy):
        x.graph.add("probe", [x.node], {"label": label})
    else:
        data = np.asarray(x.data if isinstance(x, _t.Tensor) else x)
        print(f"probe {label}: shape {data.shape}, mean {data.mean():.6g}")


def trace(fn: Callable, *args: Any) -> Graph:
    """The graph of fn(*args): tensors and arrays become `input` nodes (their shape and dtype),
    other arguments (numbers, strings, modules) are passed as they are and end up as constants.
    fn returns a tensor or a tuple of them. Raises GraphBreak for what a graph cannot hold."""
    graph = Graph()
    call = []
    for k, a in enumerate(args):
        if isinstance(a, (_t.Tensor, np.ndarray)):
            dtype = np.dtype(a.dtype)
            if dtype not in FLOAT_DTYPES:
                raise GraphBreak(f"argument {k} has dtype {dtype}: the compiler handles float32 and float64")
            call.append(Proxy(graph, graph.add_input(f"x{k}", tuple(a.shape), dtype)))
        else:
            call.append(a)
    out = fn(*call)
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        if not isinstance(o, Proxy):
            raise GraphBreak(f"the function returned a {type(o).__name__}, not a traced tensor")
    graph.outputs = [o.node for o in outs]
    graph.single = not isinstance(out, tuple)
    return graph

# %%
#| export
#| exercise 14.1
def broadcast_shapes(what: str, a: tuple, b: tuple) -> tuple:
    """NumPy's broadcast of two shapes (a helper for infer_meta; ValueError naming both)."""
    if not isinstance(what, str):
        raise TypeError(f"broadcast_shapes: what must be a str (the op, for messages), got {what!r}")
    for name, shape in (("a", a), ("b", b)):
        if not isinstance(shape, (tuple, list)) or not all(isinstance(n, (int, np.integer)) and n >= 0 for n in shape):
            raise ValueError(f"broadcast_shapes({what}): {name} must be a shape (a tuple of sizes >= 0), got {shape!r}")
    ### BEGIN SOLUTION
    a0, b0 = tuple(a), tuple(b)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError(f"{what}: shapes {a0} and {b0} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)
    ### END SOLUTION


def infer_meta(op: str, shapes: Sequence[tuple], dtypes: Sequence[Any], attrs: dict) -> tuple[tuple, np.dtype]:
    """(shape, dtype) of the result of `op` on inputs of these shapes and dtypes (the IR's table).
    ValueError for shapes that do not fit (naming them), TypeError for a dtype other than float32
    or float64, ValueError for an unknown op."""
    if not isinstance(op, str):
        raise TypeError(f"infer_meta: op must be a str, got {op!r}")
    for name, value in (("shapes", shapes), ("dtypes", dtypes)):
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"infer_meta({op!r}): {name} must be a list (one per input), got {value!r}")
    if not isinstance(attrs, dict):
        raise TypeError(f"infer_meta({op!r}): attrs must be a dict, got {attrs!r}")
    if len(shapes) != len(dtypes):
        raise ValueError(f"infer_meta({op!r}): {len(shapes)} shapes but {len(dtypes)} dtypes, one of each per input")
    ### BEGIN SOLUTION
    for d in dtypes:
        if np.dtype(d) not in FLOAT_DTYPES:
            raise TypeError(f"{op}: the compiler handles float32 and float64, got {np.dtype(d)}")
    shapes = [tuple(s) for s in shapes]
    if op in UNARY or op in SIDE_EFFECTS:
        return shapes[0], np.dtype(dtypes[0])
    if op in BINARY:
        return broadcast_shapes(op, *shapes), np.result_type(*dtypes)
    if op in REDUCTIONS:
        (shape,) = shapes
        axis = attrs["axis"]
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"{op}: axis {axis} is out of range for shape {shape}")
        axis %= len(shape)
        if op == "max" and shape[axis] == 0:
            raise ValueError(f"max: axis {axis} of shape {shape} is empty: a maximum of nothing has no value")
        kept = shape[:axis] + ((1,) if attrs.get("keepdims") else ()) + shape[axis + 1:]
        return kept, np.dtype(dtypes[0])
    if op == "matmul":
        a, b = shapes
        if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
            raise ValueError(f"matmul: shapes {a} and {b} do not fit (..., n, k) @ (..., k, m)")
        return broadcast_shapes(op, a[:-2], b[:-2]) + (a[-2], b[-1]), np.result_type(*dtypes)
    if op == "transpose":
        (shape,) = shapes
        if len(shape) < 2:
            raise ValueError(f"transpose: shape {shape} has fewer than 2 axes to swap")
        return shape[:-2] + (shape[-1], shape[-2]), np.dtype(dtypes[0])
    if op == "expand":
        (shape,), target = shapes, tuple(attrs["shape"])
        if broadcast_shapes(op, shape, target) != target:
            raise ValueError(f"expand: shape {shape} does not broadcast to {target}")
        return target, np.dtype(dtypes[0])
    if op == "reshape":
        (shape,), target = shapes, tuple(attrs["shape"])
        if math.prod(shape) != math.prod(target):
            raise ValueError(f"reshape: shape {shape} and shape {target} hold different numbers of elements")
        return target, np.dtype(dtypes[0])
    if op == "astype":
        dtype = np.dtype(attrs["dtype"])
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"astype: the compiler handles float32 and float64, got {dtype}")
        return tuple(shapes[0]), dtype
    raise ValueError(f"infer_meta: unknown op {op!r}")
    ### END SOLUTION


# %% tags=["check"]
check("14.1")

# %% [markdown]
# A traced function, printed. Each line is one node: its number, op, inputs, attributes, dtype and
# shape. The `mean` became a `sum` and a multiplication by a constant: the tracer records what the
# tensor methods do, in the IR's few primitives.

# %%
def softmax_fn(x):
    e = (x - x.max(axis=-1, keepdims=True)).exp()
    return e / e.sum(axis=-1, keepdims=True)


def layer_norm_fn(x, w, b):
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc * (var + 1e-5) ** -0.5 * w + b


print(trace(softmax_fn, np.zeros((4, 10))))
print()
print(trace(layer_norm_fn, np.zeros((4, 10), np.float32), np.ones(10, np.float32), np.zeros(10, np.float32)))

# %% [markdown]
# ## 2. Guards and graph breaks
#
# A graph holds the shapes and dtypes it was traced with: the buffers, loop bounds and kernels
# built from it are valid for those only. `torch.compile` keeps, beside each compiled graph, the
# *guards* that must hold for it to be reused (a tensor's shape, dtype, device, a Python value the
# code branched on), checks them on every call, and recompiles when one fails.
#
# Here the guard is a key made of what the trace depended on: for each tensor argument (a
# minitorch Tensor or a NumPy array) its shape and dtype, for any other argument its type and
# value (a number read by the function is baked into the graph as a constant, so `f(x, 2.0)` and
# `f(x, 3.0)` are two graphs). The value goes into the key as its `repr`: two numbers are the same
# key exactly when they are the same number, NaN included (`nan != nan`, so a key holding the float
# itself would never match again and recompile on every call), while `0.0` and `-0.0` stay two
# keys (`x / 0.0` is `inf` where `x / -0.0` is `-inf`); a list or a string works the same way. A
# compiled function keeps a cache {key: runner}, where `runner = backend(graph)` takes the tensor
# arguments' arrays, in order and without the other arguments, and returns the outputs' arrays.
#
# If tracing raises `GraphBreak`, the function cannot become one graph (TorchDynamo would split it
# into several graphs around the break; we keep it simple): warn once for that key with a message
# that contains the break's cause, remember the key as eager, and from then on run `fn` itself on
# the arguments.
#
# **Exercise 14.2.** Write `guard_key(args)`: a tuple with, per argument, `("tensor", shape, dtype)`
# (the shape a tuple, the dtype `np.dtype(...).str`) for a minitorch Tensor or a NumPy array, and
# `("value", type name, repr(value))` for anything else. Then `Compiled.__call__(*args)`: look the
# key up in `self.cache`; on a miss trace `self.fn` on the arguments, keep `self.backend(graph)`
# and the graph (`self.graphs[key]`), and count the compilation in `self.compiles`. A trace that
# raises `GraphBreak` is not a compilation: warn (`warnings.warn`) with its message, append the
# message to `self.breaks`, and cache None for the key, which means "run `self.fn` eagerly" for
# this and every later call with the key (one warning per key). Run the runner on the tensor
# arguments' arrays and return minitorch Tensors (`Tensor(array)`): one, or a tuple if the
# function returned a tuple (`graph.single`).

# %%
#| export
#| given
def interpret(graph: Graph) -> Callable[..., list[np.ndarray]]:
    """A runner that executes `graph` node by node with NumPy: the eager reference, one array
    per node. runner(*arrays) -> [output arrays]; the arrays are the graph's inputs in order."""
    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        env: dict[Node, np.ndarray] = dict(zip(graph.inputs, check_arrays("interpret", graph, arrays)))
        for n in graph.nodes:
            if n.op == "input":
                continue
            if n.op == "const":
                env[n] = np.asarray(n.attrs["value"], dtype=n.dtype)
            else:
                env[n] = np.asarray(_numpy_op(n, *(env[i] for i in n.inputs)), dtype=n.dtype)
        return [env[o] for o in graph.outputs]

    return run


def check_arrays(what: str, graph: Graph, arrays: Sequence[Any]) -> list[np.ndarray]:
    """The arrays a runner of `graph` was called with, checked against the graph's inputs: their
    number, and each one's shape and dtype exactly (a compiled kernel's loops and buffers were built
    for those). ValueError or TypeError naming the argument, what the graph expects and what came."""
    if len(arrays) != len(graph.inputs):
        raise ValueError(f"{what}: the graph takes {len(graph.inputs)} arrays "
                         f"({', '.join(n.attrs['name'] for n in graph.inputs)}), got {len(arrays)}")
    out = []
    for node, a in zip(graph.inputs, arrays):
        a = np.asarray(a.data if isinstance(a, _t.Tensor) else a)
        if a.shape != node.shape:
            raise ValueError(f"{what}: argument {node.attrs['name']} has shape {a.shape}, "
                             f"the graph was built for {node.shape}")
        if a.dtype != node.dtype:
            raise TypeError(f"{what}: argument {node.attrs['name']} has dtype {a.dtype}, "
                            f"the graph was built for {node.dtype}")
        out.append(a)
    return out


def numpy_op(n: Node, *xs: np.ndarray) -> np.ndarray:
    """What node n computes, in NumPy (a probe prints, and passes its input on)."""
    return _numpy_op(n, *xs)


def _numpy_op(n: Node, *xs: np.ndarray) -> np.ndarray:
    """numpy_op without its argument checks: the runners' path, run for every node on every call (their
    graphs were checked when they were built)."""
    if n.op == "probe":
        print(f"probe {n.attrs['label']}: shape {xs[0].shape}, mean {xs[0].mean():.6g}")
        return xs[0]
    if n.op in REDUCTIONS:
        return getattr(np, "max" if n.op == "max" else "sum")(xs[0], axis=n.attrs["axis"], keepdims=n.attrs["keepdims"])
    fn = {"neg": np.negative, "exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt,
          "relu": lambda a: np.maximum(a, 0), "step": lambda a: (a > 0).astype(n.dtype),
          "eq": lambda a, b: (a == b).astype(n.dtype), "add": np.add, "sub": np.subtract, "mul": np.multiply,
          "div": np.divide, "pow": np.power, "matmul": np.matmul,
          "expand": lambda a: np.broadcast_to(a, n.shape).copy(), "reshape": lambda a: a.reshape(n.shape),
          "transpose": lambda a: np.swapaxes(a, -1, -2), "astype": lambda a: a.astype(n.dtype)}[n.op]
    return fn(*xs)

# %%
#| export
#| exercise 14.2
def guard_key(args: Sequence[Any]) -> tuple:
    """The cache key of a call: per argument ("tensor", shape, dtype.str) for a minitorch Tensor or
    a NumPy array, ("value", type name, repr(value)) for anything else (NaN is one key, -0.0 and
    0.0 are two)."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"guard_key: args must be the call's arguments as a tuple or list, got {type(args).__name__}")
    ### BEGIN SOLUTION
    key = []
    for a in args:
        if isinstance(a, (_t.Tensor, np.ndarray)):
            key.append(("tensor", tuple(a.shape), np.dtype(a.dtype).str))
        else:
            key.append(("value", type(a).__name__, repr(a)))
    return tuple(key)
    ### END SOLUTION


class Compiled:
    """fn compiled on first call per guard key. compiles: how many graphs were built; breaks: the
    graph breaks' messages; cache: {key: runner, or None for eager}."""

    def __init__(self, fn: Callable, backend: Callable[[Graph], Callable] = interpret):
        for name, value in (("fn", fn), ("backend", backend)):
            if not callable(value):
                raise TypeError(f"Compiled: {name} must be callable, got {value!r}")
        self.fn, self.backend = fn, backend
        self.cache: dict[tuple, Any] = {}
        self.graphs: dict[tuple, Graph] = {}
        self.compiles = 0
        self.breaks: list[str] = []

    def __call__(self, *args: Any) -> Any:
        ### BEGIN SOLUTION
        key = guard_key(args)
        if key not in self.cache:
            try:
                graph = trace(self.fn, *args)
            except GraphBreak as e:
                msg = f"graph break in {getattr(self.fn, '__name__', self.fn)}: {e}; running it eagerly"
                warnings.warn(msg, stacklevel=2)
                self.breaks.append(msg)
                self.cache[key] = None
            else:
                self.cache[key] = self.backend(graph)
                self.graphs[key] = graph
                self.compiles += 1
        runner = self.cache[key]
        if runner is None:
            return self.fn(*args)
        arrays = [a.data if isinstance(a, _t.Tensor) else a for a in args if isinstance(a, (_t.Tensor, np.ndarray))]
        outs = [Tensor(o) for o in runner(*arrays)]
        return outs[0] if self.graphs[key].single else tuple(outs)
        ### END SOLUTION

# %% tags=["check"]
check("14.2")

# %%
f = Compiled(softmax_fn)
for shape, dtype in [((4, 10), np.float64), ((4, 10), np.float64), ((5, 10), np.float64), ((4, 10), np.float32)]:
    f(Tensor(rng.standard_normal(shape).astype(dtype)))
    print(f"call with {shape} {np.dtype(dtype).name}: compiles so far {f.compiles}")


def relu_if_positive(x):
    if x.sum(axis=-1).item() > 0:  # Python branches on a value: a graph break
        return x.relu()
    return x


g = Compiled(relu_if_positive)
g(Tensor(rng.standard_normal(5)))
print(g.breaks[0])

# %% [markdown]
# ## 3. Passes
#
# A pass takes a graph and returns a new one that computes the same outputs. The compiler runs a
# few in a row; each is small, and each can be tested alone on graphs built by hand.
#
# - **Dead-code elimination (DCE)**: drop every node that no output needs. A node is *live* if it
#   is an output (any of them: a function may return several values, or one value twice), has a
#   side effect (`probe`: printing is what it is for, though nothing reads it), or is an input of
#   a live node. The graph's `input` nodes stay (they are the function's signature), used or not.
# - **Common-subexpression elimination (CSE)**: two nodes with the same op, the same inputs (after
#   merging) *in the same order* and the same attributes compute the same value: keep the first,
#   point the users of the second at it. Order matters (`x - y` is not `y - x`), attributes matter
#   (`sum(axis=0)` is not `sum(axis=1)`; a constant 2.0 is not 3.0), and so do the shape and the
#   dtype (a float32 constant 2.0 is not a float64 one); inputs are never merged (two arguments are
#   two arrays) and neither are side effects (two probes print twice, even of the same value).
#
# Both rebuild the graph with `Graph.copy_node(node, new_inputs)`, in the old topological order,
# and set the new graph's `outputs` (and `single`) from the old.
#
# **Exercise 14.3.** Write `dce(graph)` and `cse(graph)`.

# %%
#| export
#| exercise 14.3
def dce(graph: Graph) -> Graph:
    """The graph without the nodes that reach no output and no side effect (inputs are kept)."""
    ### BEGIN SOLUTION
    live = set(graph.outputs) | {n for n in graph.nodes if n.op in SIDE_EFFECTS or n.op == "input"}
    for n in reversed(graph.nodes):
        if n in live:
            live.update(n.inputs)
    out, new = Graph(), {}
    for n in graph.nodes:
        if n in live:
            new[n] = out.copy_node(n, [new[i] for i in n.inputs])
    out.outputs, out.single = [new[o] for o in graph.outputs], graph.single
    return out
    ### END SOLUTION


def cse(graph: Graph) -> Graph:
    """The graph with each set of identical nodes (op, inputs, attrs, shape, dtype) merged into its
    first; inputs and side effects are never merged."""
    ### BEGIN SOLUTION
    out, new, seen = Graph(), {}, {}
    for n in graph.nodes:
        ins = [new[i] for i in n.inputs]
        if n.op == "input" or n.op in SIDE_EFFECTS:
            new[n] = out.copy_node(n, ins)
            continue
        key = (n.op, tuple(map(id, ins)), tuple(sorted(n.attrs.items())), n.shape, n.dtype.str)
        if key not in seen:
            seen[key] = out.copy_node(n, ins)
        new[n] = seen[key]
    out.outputs, out.single = [new[o] for o in graph.outputs], graph.single
    return out
    ### END SOLUTION

# %% tags=["check"]
check("14.3")

# %%
def wasteful(x):
    a = (x * 2.0).exp()
    b = (x * 2.0).exp()  # the same as a: CSE merges it
    (x * 3.0).tanh()     # computed, never used: DCE drops it
    probe(a, "a")        # never used either, but a side effect: DCE keeps it
    return a + b


g0 = trace(wasteful, np.zeros(6))
print(g0, "\n\nafter cse and dce:")
print(dce(cse(g0)))

# %% [markdown]
# - **Constant folding**: a pointwise node (the table's unary and binary ops) whose inputs are
#   all constants is itself a constant: compute it now, with `numpy_op` on 0-d arrays of the
#   constants' dtypes so that the arithmetic is the node's (float32 rounds as the kernel would:
#   `(1e8 + 1) - 1e8` is 0 in float32 and 1 in float64), and put a `const` node of the node's dtype
#   in its place. Nothing else folds: a `probe` of a constant must still print, and an `expand` of
#   a constant has a shape where a `const` has `()`.
# - **Algebraic simplification**: rewrite a node that does nothing into its input: `x * 1`,
#   `1 * x`, `x + 0`, `0 + x`, `x - 0`, `x / 1`, `x ** 1` and `-(-x)`, where x keeps the node's
#   shape and dtype (`zeros(3) + ones((2, 3))` broadcasts: it is not a no-op; nor is a float32
#   x plus a float64 zero). Only these: `-`, `/` and `**` do not commute, so a constant on their
#   left stays (`0 - x` is `-x`, `1 / x` a reciprocal, `1 ** x` is 1, none of them `x`). The rules
#   ignore the sign of zero, as the kernels' `nsz` flag does (`-0.0 + 0` is `+0.0`).
#
# Where do constant subexpressions come from? Not from your source: Python computes `2.0 ** 0.5 *
# x` as `1.4142135623730951 * x` before the tracer sees it. They come from code that writes graphs
# for any input, such as the backward of section 5: the gradient of `a ** b` is `b * a ** (b - 1)`,
# and when `b` is a constant, `b - 1` is a node of two constants (section 5 folds one).
#
# Both passes leave the dead nodes behind (the folded constants' inputs, the skipped `mul`): DCE
# removes them afterwards. Build the new graph as in 14.3 (`add_const` makes a constant).
#
# **Exercise 14.4.** Write `fold_constants(graph)` and `simplify(graph)`.

# %%
#| export
#| exercise 14.4
def fold_constants(graph: Graph) -> Graph:
    """The graph with every pointwise node whose inputs are all constants replaced by a constant."""
    ### BEGIN SOLUTION
    out, new = Graph(), {}
    for n in graph.nodes:
        ins = [new[i] for i in n.inputs]
        if n.op in POINTWISE and all(i.op == "const" for i in ins):
            values = [np.asarray(i.attrs["value"], dtype=i.dtype) for i in ins]
            with np.errstate(all="ignore"):
                new[n] = out.add_const(float(numpy_op(n, *values)), n.dtype)
        else:
            new[n] = out.copy_node(n, ins)
    out.outputs, out.single = [new[o] for o in graph.outputs], graph.single
    return out
    ### END SOLUTION


def simplify(graph: Graph) -> Graph:
    """The graph with x*1, 1*x, x+0, 0+x, x-0, x/1, x**1 and -(-x) replaced by x (when x has the
    node's shape and dtype)."""
    ### BEGIN SOLUTION
    def is_const(node: Node, value: float) -> bool:
        return node.op == "const" and node.attrs["value"] == value

    out, new = Graph(), {}
    for n in graph.nodes:
        ins = [new[i] for i in n.inputs]
        same = None
        if n.op in ("mul", "add"):
            unit = 1.0 if n.op == "mul" else 0.0
            same = ins[0] if is_const(ins[1], unit) else ins[1] if is_const(ins[0], unit) else None
        elif n.op in ("sub", "div", "pow"):
            same = ins[0] if is_const(ins[1], 0.0 if n.op == "sub" else 1.0) else None
        elif n.op == "neg" and ins[0].op == "neg":
            same = ins[0].inputs[0]
        if same is not None and same.shape == n.shape and same.dtype == n.dtype:
            new[n] = same
        else:
            new[n] = out.copy_node(n, ins)
    out.outputs, out.single = [new[o] for o in graph.outputs], graph.single
    return out
    ### END SOLUTION

# %% tags=["check"]
check("14.4")

# %%
def silly(x):
    return (-(-(x * 1.0)) + 0.0) ** 1.0 - 1.0 / x  # 1.0 / x is not x: it stays


g1 = trace(silly, np.zeros(3))
print(g1, "\n\nsimplified, dead code removed:")
print(dce(simplify(g1)))


# %%
#| export
#| given
def optimize(graph: Graph) -> Graph:
    """The pass pipeline compile() runs: CSE, folding, simplification, CSE again, DCE."""
    return dce(cse(simplify(fold_constants(cse(graph)))))

# %% [markdown]
# ## 4. Fusion
#
# Run eagerly, every node is a kernel: it reads its inputs from memory and writes its output to
# memory. A softmax over a (rows, C) matrix is five kernels (max, sub, exp, sum, div), and each
# row of the input crosses memory several times on the way (the cell after the exercise counts
# the rows' worth); one fused kernel reads each row once (then again from the cache) and writes it
# once. On a memory-bound operation bytes are time ([fusion](../hardware_notes/fusion.md)).
#
# The fusion rule here is TorchInductor's and tinygrad's, reduced to reductions over the last
# axis. A *fused group* works row by row over a domain (R, C): R the leading axes (the rows), C
# the last axis. Its nodes are
# - *full* pointwise nodes, of shape R + (C,): one value per (row, column);
# - reductions over the last axis of a full node (input shape R + (C,)): one value per row;
# - *row* pointwise nodes, of shape R + (1,): one value per row (`1 / sqrt(var + eps)`).
#
# Walk the nodes in order. `input` and `const` nodes are not kernels (constants become literals
# in the code). A `matmul`, and a reduction over another axis, is a group of its own (a library
# kernel). A pointwise node or last-axis reduction joins the group of the first of its inputs
# that is in a fused group when (a) it fits that group's domain as above, and (b) none of its
# other inputs depends on that group through a node outside it (joining would make a cycle:
# group A -> matmul -> node in A). Otherwise it starts a new fused group, whose domain is its own
# (a reduction's: its input's shape; a pointwise node's: shape[:-1] and shape[-1], `()` and 1 for
# a scalar). So a chain of pointwise ops is one kernel, a softmax is one kernel, and a LayerNorm
# is one kernel; a matmul between two of them separates them.
#
# Then the bytes: a group *reads* the nodes outside it that its nodes use (not constants) and
# *writes* its nodes that a node outside it uses or that are graph outputs. `plan_bytes` (given)
# adds up their sizes over the plan; `eager_plan(graph)` is the plan of one node per kernel.
#
# **Exercise 14.5.** Write `fuse(graph) -> list[list[Node]]` (the groups in an order they can run
# in, each group's nodes in topological order) and `kernel_io(graph, group) -> (reads, writes)`
# (two lists of distinct nodes, in graph order).

# %%
#| export
#| given
def domain(group: Sequence[Node]) -> tuple[tuple, int] | None:
    """(R, C) of a fused group (from its first node), or None for a library kernel (a matmul, a
    reduction over another axis than the last)."""
    first = group[0]
    if first.op in REDUCTIONS:
        shape = first.inputs[0].shape
        if first.attrs["axis"] % len(shape) != len(shape) - 1:
            return None
        return shape[:-1], shape[-1]
    if first.op not in POINTWISE and first.op != "expand":
        return None
    return (first.shape[:-1], first.shape[-1]) if first.shape else ((), 1)


def fits(node: Node, dom: tuple[tuple, int]) -> str | None:
    """"full", "row" or None: how `node` fits a group of domain dom = (R, C)."""
    rows, width = dom
    if node.op in REDUCTIONS:
        shape = node.inputs[0].shape
        last = node.attrs["axis"] % len(shape) == len(shape) - 1 if shape else False
        return "row" if last and shape == rows + (width,) else None
    if node.op not in POINTWISE and node.op != "expand":
        return None
    if node.shape == rows + (width,) or (not node.shape and not rows and width == 1):  # a scalar group
        return "full"
    return "row" if node.shape == rows + (1,) else None


def plan_bytes(graph: Graph, plan: Sequence[Sequence[Node]]) -> tuple[int, int]:
    """(bytes read, bytes written) by all the kernels of a plan."""
    read = written = 0
    for group in plan:
        reads, writes = kernel_io(graph, group)
        read += sum(n.nbytes for n in reads)
        written += sum(n.nbytes for n in writes)
    return read, written


def eager_plan(graph: Graph) -> list[list[Node]]:
    """One kernel per operation (what eager minitorch runs)."""
    return [[n] for n in graph.nodes if n.op not in ("input", "const")]

# %%
#| export
#| exercise 14.5
def fuse(graph: Graph) -> list[list[Node]]:
    """The fusion plan: groups of nodes, each one kernel (see the rule above)."""
    ### BEGIN SOLUTION
    group_of: dict[Node, int] = {}
    groups: list[list[Node]] = []
    doms: list[tuple | None] = []

    def depends_on_group(node: Node, g: int) -> bool:
        """Does `node` (outside group g) depend on group g?"""
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if group_of.get(n) == g:
                return True
            stack.extend(n.inputs)
        return False

    for n in graph.nodes:
        if n.op in ("input", "const"):
            continue
        target = None
        for i in n.inputs:
            g = group_of.get(i)
            if g is None or doms[g] is None or fits(n, doms[g]) is None:
                continue
            if any(group_of.get(o) != g and depends_on_group(o, g) for o in n.inputs):
                continue
            target = g
            break
        if target is None:
            groups.append([])
            doms.append(domain([n]))
            target = len(groups) - 1
        groups[target].append(n)
        group_of[n] = target
    order: list[int] = []  # the groups in an order they can run in: each after those it reads
    placed: set[int] = set()
    while len(order) < len(groups):
        ready = [g for g, nodes in enumerate(groups)
                 if g not in placed and all(group_of.get(i, g) in placed or group_of.get(i, g) == g
                                            for n in nodes for i in n.inputs)]
        if not ready:  # a cycle between groups: a bug in the grouping above, never an endless loop
            stuck = [[n.op for n in groups[g]] for g in range(len(groups)) if g not in placed]
            raise RuntimeError(f"fuse: the groups {stuck} wait on each other (a cycle)")
        for g in ready:
            order.append(g)
            placed.add(g)
    return [groups[g] for g in order]
    ### END SOLUTION


def kernel_io(graph: Graph, group: Sequence[Node]) -> tuple[list[Node], list[Node]]:
    """(reads, writes) of one kernel: the non-constant nodes outside the group its nodes use, and
    its nodes used outside it or returned by the graph; each list in graph order, no repeats."""
    ### BEGIN SOLUTION
    inside = set(group)
    users = graph.users()
    used = {i for n in group for i in n.inputs if i not in inside and i.op != "const"}
    outs = set(graph.outputs)
    written = {n for n in group if n in outs or any(u not in inside for u in users.get(n, ()))}
    return [n for n in graph.nodes if n in used], [n for n in graph.nodes if n in written]
    ### END SOLUTION

# %% tags=["check"]
check("14.5")

# %%
for name, fn, args in [("softmax", softmax_fn, (np.zeros((256, 1000)),)),
                       ("layer norm", layer_norm_fn, (np.zeros((256, 1000)), np.ones(1000), np.zeros(1000)))]:
    gr = optimize(trace(fn, *args))
    plan = fuse(gr)
    e_r, e_w = plan_bytes(gr, eager_plan(gr))
    f_r, f_w = plan_bytes(gr, plan)
    row = gr.inputs[0].nbytes / gr.inputs[0].shape[0]  # the bytes of one row of x
    print(f"{name}: eager {len(eager_plan(gr))} kernels, {(e_r + e_w) / 1e6:.1f} MB "
          f"({(e_r + e_w) / row / 256:.1f} rows' worth per row of x); fused {len(plan)} kernel(s), "
          f"{(f_r + f_w) / 1e6:.1f} MB ({(f_r + f_w) / row / 256:.1f} rows' worth); {(e_r + e_w) / (f_r + f_w):.1f}x fewer bytes")

# %% [markdown]
# ### Memory planning: reuse buffers whose values are dead
#
# Each kernel writes its results into buffers. Eagerly, every node gets a fresh array from the
# allocator; a compiler knows the whole plan in advance, so it can give a buffer to a later node
# once every kernel that reads the buffer's value has run (TorchInductor's buffer reuse, XLA's
# buffer assignment). Fewer buffers mean less memory and warm caches: the next kernel writes where
# the last one's dead value still sits in the cache.
#
# The rule: walk the kernels in order. For kernel k, first give each node it writes (except the
# graph's outputs, which go back to the caller, and the inputs, which belong to the caller) a
# buffer: a free one of the same number of elements *and* dtype if there is one (the first freed
# of those), else a new one. Equal bytes are not enough: a float64 buffer of n elements holds as
# many bytes as a float32 one of 2n, but a kernel that writes float32 values needs float32
# storage. Then free the buffers whose value's *last reader* is kernel k. Not before: kernel k may
# read a value in several loops (the softmax reads x three times), so it must not overwrite it
# while it runs; and a buffer whose value a later kernel still reads is *live* and must not be
# reused. A value can have several readers far apart (a residual connection `h + f(h)` reads `h`
# again after all of `f`'s kernels): it is live until the last of them.
#
# **Exercise 14.6.** Write `plan_buffers(graph, plan) -> {node: buffer number}` (numbers 0, 1, ...
# in order of first use) for the nodes the kernels write, outputs left out.

# %%
#| export
#| exercise 14.6
def plan_buffers(graph: Graph, plan: Sequence[Sequence[Node]]) -> dict[Node, int]:
    """{node: buffer number} for every node a kernel of `plan` writes (kernel_io) that is not a
    graph output. Two nodes share a buffer only if they have the same size and dtype and the first
    one's last reader runs before the second one's kernel."""
    ### BEGIN SOLUTION
    last_read: dict[Node, int] = {}
    writes_of = []
    for k, group in enumerate(plan):
        reads, writes = kernel_io(graph, group)
        for n in reads:
            last_read[n] = k
        writes_of.append(writes)
    outs = set(graph.outputs)
    kinds: list[tuple[int, str]] = []  # (elements, dtype) of each buffer
    free: list[int] = []
    freed_after: dict[int, list[int]] = {}
    assign: dict[Node, int] = {}
    for k, writes in enumerate(writes_of):
        for n in writes:
            if n in outs or n.op == "input":
                continue
            kind = (math.prod(n.shape), n.dtype.str)
            b = next((b for b in free if kinds[b] == kind), None)
            if b is None:
                b = len(kinds)
                kinds.append(kind)
            else:
                free.remove(b)
            assign[n] = b
            freed_after.setdefault(last_read.get(n, k), []).append(b)
        free.extend(freed_after.pop(k, []))
    return assign
    ### END SOLUTION

# %% tags=["check"]
check("14.6")

# %% [markdown]
# A chain of four matmul + ReLU layers of one width: every value but the last layer's output is an
# intermediate, and each is dead as soon as the next layer's matmul has read it, so two buffers
# take turns. The cell counts them.

# %%
def deep_relu(x, w):
    for _ in range(4):
        x = (x @ w).relu()
    return x


gd = optimize(trace(deep_relu, np.zeros((8, 16)), np.zeros((16, 16))))
pd = fuse(gd)
bufs = plan_buffers(gd, pd)
for k, group in enumerate(pd):
    print(f"kernel {k}: {'+'.join(n.op for n in group):<8} writes buffer "
          f"{', '.join(str(bufs[n]) if n in bufs else 'output' for n in kernel_io(gd, group)[1])}")
print(f"{len(bufs)} intermediate values (every value but the output) in {len(set(bufs.values()))} buffers")

# %% [markdown]
# The graph can also be drawn: `graph.to_dot(plan)` writes it in Graphviz's language, each kernel
# a box (paste the text into any dot viewer). The softmax, fused:

# %%
g_dot = optimize(trace(softmax_fn, np.zeros((4, 10))))
print(g_dot.to_dot(fuse(g_dot)))

# %% [markdown]
# ## 5. Code generation: Numba
#
# A fused group becomes one Python function, compiled by Numba (lesson 05). Its arguments are
# `rows` (the product of R), `C`, then one 2-D array per read (in `kernel_io` order), then one per
# write. A value per (row, column) is a (rows, C) array, read `in0[r, c]`; one value per row (a
# read whose last axis is 1, a row node, a reduction; `per_row`, given) a (rows, 1) array, read
# `in0[r, 0]`; one value per column, the same for every row (a bias of shape (C,); `per_col`,
# given) a (1, C) array, read `in0[0, c]`. The runner (given) makes these views with `reshape` and
# `np.broadcast_to`, so nothing is copied where NumPy can avoid it. (A bias could also be seen as
# (rows, C) with a row stride of 0, but Numba compiles a strided array as layout "A" and then does
# not vectorise the loop over it.) The loops: one
# over rows; inside, for each reduction in order, a loop over the columns that computes the full
# nodes it needs (the prologue, recomputed in each loop: they are cheap, and the row is in the
# cache) and accumulates; row nodes between the loops; a last loop over the columns for the full
# nodes the group writes (the epilogue). A reduction must finish its row before anything reads
# it: that is why its users come after its loop.
#
# Name the values `v0, v1, ...` by the node's position in the group, the arrays `in0, in1, ...`
# and `out0, out1, ...`. Ops: `PY_OPS[op].format(*operands)` (given): `vexp` and `vtanh` for exp
# and tanh (below), `math.log/sqrt`, `vrelu(a)` for relu, `-a`, `+ - * /`, `**`; constants as
# `py_literal(value, dtype)` (given: `f32(0.5)` in a float32 node, so the arithmetic stays in
# float32 as NumPy's does; `0.5` in a float64 one; `math.inf` for an infinity); sums start at
# zero, maxima at minus infinity, both as `py_literal` of the reduction's dtype. A bare `0.0` is a
# float64: a float32 row would be converted element by element and summed in float64 (not
# NumPy's float32 result). A maximum must give NumPy's answer for NaN too: `np.max` of a row with
# a NaN is NaN, but Python's `max(v, x)` (and C's `fmax`) returns the other operand when one is
# NaN, so a fused max would skip it. Accumulate with `PY_OPS["max"]`, `vmax(v, x)` (given): `v if
# v >= x or v != v else x`, NaN as soon as either is; `vrelu` keeps NaN the same way. (LLVM
# vectorises a floating-point max reduction only when told there are no NaNs, so the max loop
# runs one element at a time; the sums vectorise.) Rows run in parallel: `for r in prange(rows)`
# (Numba's parallel range, lesson 06): each row is independent.
#
# `exp` and `tanh` need care on a CPU. The C library's `expf` is a function call per element,
# which stops LLVM from vectorising the loop around it (Numba has vector versions only with
# Intel's SVML), so a fused loop with an `exp` runs at the scalar function's speed while NumPy's
# ufunc uses SIMD. `vexp` (given) is exp written as arithmetic the loop can inline and vectorise:
# split x = n ln2 + r with |r| <= ln2/2, take exp(r) - 1 from its Taylor polynomial (degree 7 for
# float32, 13 for float64: the first term left out is under half an ulp), add 1, and multiply by
# 2**n built from exponent bits, as two factors 2**h * 2**(n-h): 2**128 is no float32, though
# exp(88.7) is, so one factor would overflow early, while with two the last multiplication
# overflows to inf exactly where float32 does and rounds into the subnormals as NumPy's exp does.
# `vtanh` is expm1(2x) / (expm1(2x) + 2), with expm1(y) = 2**n (exp(r) - 1) + (2**n - 1) from the
# same polynomial: the textbook 1 - 2 / (exp(2x) + 1) subtracts two numbers close to 1 near
# x = 0 and loses the digits that tanh(x) ~ x needs. Glibc, SLEEF and SVML compute them the same
# way. The cell after the exercise measures their error and speed.
#
# **Exercise 14.7.** Write `numba_source(graph, group, name) -> str`: the source of
# `def name(rows, C, in0, ..., out0, ...)`.

# %%
#| export
#| given
def row_view(a: np.ndarray, node_shape: tuple, dom: tuple[tuple, int], per_row: bool,
             per_col: bool = False) -> np.ndarray:
    """a (of shape node_shape) as a 2-D array over domain dom: (rows, 1) per row, (1, C) per column,
    else (rows, C), broadcast, not copied where NumPy can."""
    if a.shape != tuple(node_shape):
        raise ValueError(f"row_view: a has shape {a.shape}, not node_shape {tuple(node_shape)}")
    return _row_view(a, node_shape, dom, per_row, per_col)


def _row_view(a: np.ndarray, node_shape: tuple, dom: tuple[tuple, int], per_row: bool,
              per_col: bool = False) -> np.ndarray:
    """row_view without its argument checks: the runners' path, run for every read of every kernel on
    every call (their shapes were checked when they were built)."""
    rows, width = dom
    if per_col:
        return a.reshape(1, width)
    target = rows + ((1,) if per_row else (width,))
    if per_row and node_shape == rows:  # a reduction without keepdims
        a = a.reshape(rows + (1,))
    return np.broadcast_to(a, target).reshape(math.prod(rows), target[-1])


def per_row(node: Node, dom: tuple[tuple, int]) -> bool:
    """Does this read or write hold one value per row (else one per column)?"""
    if node.op in REDUCTIONS and fits(node, dom) == "row":
        return True
    return not node.shape or node.shape[-1] == 1 and dom[1] != 1 or node.shape == dom[0] + (1,)


def per_col(node: Node, dom: tuple[tuple, int]) -> bool:
    """Is this read one value per column, the same for every row (a bias of shape (C,) or (1, C))?
    The kernel then reads it as a (1, C) array: in[0, c]."""
    rows, width = dom
    shape = node.shape
    return (bool(shape) and width != 1 and shape[-1] == width and not per_row(node, dom)
            and all(s == 1 for s in shape[:-1]) and math.prod(rows) > 1)


def py_literal(value: float, dtype: DTypeLike) -> str:
    """A constant in generated Python/Numba source: f32(v) for float32 (float32 arithmetic), v for
    float64, math.inf / math.nan for the non-finite."""
    value = float(value)
    text = ("math.inf" if value > 0 else "-math.inf") if math.isinf(value) else "math.nan" if math.isnan(value) \
        else repr(value)
    return f"f32({text})" if np.dtype(dtype) == np.float32 else text


PY_OPS = {"neg": "(-{0})", "exp": "vexp({0})", "log": "math.log({0})", "tanh": "vtanh({0})",
          "sqrt": "math.sqrt({0})", "relu": "vrelu({0})", "add": "({0} + {1})", "sub": "({0} - {1})",
          "mul": "({0} * {1})", "div": "({0} / {1})", "pow": "({0} ** {1})", "expand": "{0}",
          "step": "(1.0 if {0} > 0 else 0.0)", "eq": "(1.0 if {0} == {1} else 0.0)", "max": "vmax({0}, {1})"}


def _scalar(what: str, name: str, value: Any) -> None:
    """The check of the kernels' scalar functions, in their Python bodies (Numba compiles the @overload
    below instead, and finds the function by identity, so it is never wrapped): a real number, inf
    and nan included (they follow NumPy's rules for them)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what}: {name} must be a real number (inf and nan included), got {value!r}")


def vexp(x: float) -> float:
    """exp(x) in the generated kernels: in Python math.exp (inf where it overflows); compiled by
    Numba, the range-reduced polynomial below (no call, so LLVM vectorises the loop around it)."""
    _scalar("vexp", "x", x)
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def vtanh(x: float) -> float:
    """tanh(x) in the generated kernels: expm1(2x) / (expm1(2x) + 2) when compiled (below)."""
    _scalar("vtanh", "x", x)
    return math.tanh(x)


def vmax(a: float, b: float) -> float:
    """NumPy's maximum of two numbers: nan if either is nan (Python's max and C's fmax skip it)."""
    _scalar("vmax", "a", a)
    _scalar("vmax", "b", b)
    return a if a >= b or a != a else b


def vrelu(x: float) -> float:
    """NumPy's relu, np.maximum(x, 0): nan stays nan; in x's own type when compiled."""
    _scalar("vrelu", "x", x)
    return x if x > 0 or x != x else 0.0


@register_jitable(inline="always")
def _scale32(p, n):  # noqa: ANN001, ANN202 - p * 2**n for integral float32 n in [-151, 128], as two
    f = np.float32  # powers of two (each a normal number), so the product over- or underflows only at the end
    h = np.floor(n * f(0.5))
    return (p * np.int32((np.int32(h) + np.int32(127)) << np.int32(23)).view(f)) \
        * np.int32((np.int32(n - h) + np.int32(127)) << np.int32(23)).view(f)


@register_jitable(inline="always")
def _scale64(p, n):  # noqa: ANN001, ANN202 - _scale32 in float64, n in [-1076, 1024]
    h = np.floor(n * 0.5)
    return (p * np.int64((np.int64(h) + np.int64(1023)) << np.int64(52)).view(np.float64)) \
        * np.int64((np.int64(n - h) + np.int64(1023)) << np.int64(52)).view(np.float64)


@register_jitable(inline="always")
def _expm1_r32(r):  # noqa: ANN001, ANN202 - exp(r) - 1 for |r| <= ln2 / 2: Taylor to degree 7, Horner form
    f = np.float32
    q = f(1 / 5040) * r + f(1 / 720)
    q = (((q * r + f(1 / 120)) * r + f(1 / 24)) * r + f(1 / 6)) * r + f(0.5)
    return q * r * r + r


@register_jitable(inline="always")
def _expm1_r64(r):  # noqa: ANN001, ANN202 - the same in float64: Taylor to degree 13
    q = ((1 / 6227020800 * r + 1 / 479001600) * r + 1 / 39916800) * r + 1 / 3628800
    q = ((((q * r + 1 / 362880) * r + 1 / 40320) * r + 1 / 5040) * r + 1 / 720) * r + 1 / 120
    q = ((q * r + 1 / 24) * r + 1 / 6) * r + 0.5
    return q * r * r + r


def _exp32(x):  # noqa: ANN001, ANN202 - float32 -> float32, compiled by Numba
    """exp as straight-line arithmetic (float32): x = n ln2 + r with n an integer, |r| <= ln2 / 2
    (ln2 in two parts, n * ln2_hi exact), exp(r) = 1 + expm1(r) by its Taylor polynomial (the first
    term left out is below half an ulp), times 2**n made from exponent bits. x is clamped to
    [-104, 89], past which exp is 0 or inf in float32 anyway; the last multiplication rounds, so
    the result overflows to inf exactly where float32 does (above ln(FLT_MAX) = 88.7228...) and
    runs into the subnormals as NumPy's does. nan stays nan."""
    f = np.float32
    xc = min(max(x, f(-104.0)), f(89.0))
    n = np.floor(xc * f(1.4426950408889634) + f(0.5))  # a float32 (math.floor: an int64)
    r = (xc - n * f(0.693359375)) - n * f(-2.1219444005469057e-4)
    e = _scale32(_expm1_r32(r) + f(1.0), n)
    return x if x != x else e


def _exp64(x):  # noqa: ANN001, ANN202 - float64 -> float64, compiled by Numba
    """_exp32 in float64: x clamped to [-746, 710], inf above ln(DBL_MAX) = 709.7827..."""
    xc = min(max(x, -746.0), 710.0)
    n = np.floor(xc * 1.4426950408889634 + 0.5)
    r = (xc - n * 0.693359375) - n * -2.1219444005469057e-4
    e = _scale64(_expm1_r64(r) + 1.0, n)
    return x if x != x else e


def _tanh32(x):  # noqa: ANN001, ANN202 - float32 -> float32, compiled by Numba
    """tanh(x) = expm1(2x) / (expm1(2x) + 2), with expm1(y) = 2**n expm1(r) + (2**n - 1) for
    y = n ln2 + r: no cancellation near 0, where 1 - 2 / (exp(2x) + 1) subtracts two numbers close
    to 1 and keeps few correct digits of tanh(x) ~ x. |x| is clamped to 9, where tanh is 1.0 in
    float32; 0 keeps its sign and nan stays nan."""
    f = np.float32
    y = min(max(x, f(-9.0)), f(9.0)) * f(2.0)
    n = np.floor(y * f(1.4426950408889634) + f(0.5))
    r = (y - n * f(0.693359375)) - n * f(-2.1219444005469057e-4)
    u = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(f)  # 2**n, |n| <= 26
    e = u * _expm1_r32(r) + (u - f(1.0))
    t = e / (e + f(2.0))
    return x if (x != x) | (x == f(0.0)) else t


def _tanh64(x):  # noqa: ANN001, ANN202 - float64 -> float64, compiled by Numba
    """_tanh32 in float64, |x| clamped to 19.5."""
    y = min(max(x, -19.5), 19.5) * 2.0
    n = np.floor(y * 1.4426950408889634 + 0.5)
    r = (y - n * 0.693359375) - n * -2.1219444005469057e-4
    u = np.int64((np.int64(n) + np.int64(1023)) << np.int64(52)).view(np.float64)
    e = u * _expm1_r64(r) + (u - 1.0)
    t = e / (e + 2.0)
    return x if (x != x) | (x == 0.0) else t


# Compiled with "contract" only (a*b+c may become one FMA): not the kernels' reassociation, which
# could multiply the two powers of two of _scale32 first and overflow where the result does not.
@overload(vexp, jit_options={"fastmath": {"contract"}})
def _vexp_numba(x):  # noqa: ANN001, ANN202 - Numba requires the signature of the implementation
    if isinstance(x, numba_types.Float):
        return _exp32 if x.name == "float32" else _exp64
    return None


@overload(vtanh, jit_options={"fastmath": {"contract"}})
def _vtanh_numba(x):  # noqa: ANN001, ANN202
    if isinstance(x, numba_types.Float):
        return _tanh32 if x.name == "float32" else _tanh64
    return None


@overload(vmax)
def _vmax_numba(a, b):  # noqa: ANN001, ANN202
    if isinstance(a, numba_types.Float) and isinstance(b, numba_types.Float):
        def vmax_impl(a, b):  # noqa: ANN001, ANN202 - a select, no branch: nan if either is nan
            return a if (a >= b) | (a != a) else b
        return vmax_impl
    return None


@overload(vrelu)
def _vrelu_numba(x):  # noqa: ANN001, ANN202
    if isinstance(x, numba_types.Float):
        zero = np.float32(0.0) if x.name == "float32" else 0.0

        def vrelu_impl(x):  # noqa: ANN001, ANN202 - in x's type (a float64 0.0 would widen a float32 kernel)
            return x if (x > zero) | (x != x) else zero
        return vrelu_impl
    return None


KERNEL_NAMES = {"math": math, "prange": prange, "f32": np.float32, "vexp": vexp, "vtanh": vtanh, "vmax": vmax,
                "vrelu": vrelu}
# The generated kernels' fastmath flags: not "no NaNs/infinities" (a -inf mask is data); sums may be
# reassociated (vectorised), a*b+c fused into one FMA: results move by a few ulps, never by NaN rules.
KERNEL_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}

# %%
#| export
#| exercise 14.7
def numba_source(graph: Graph, group: Sequence[Node], name: str) -> str:
    """Python source of the kernel `name(rows, C, in0, ..., out0, ...)` for one fused group."""
    ### BEGIN SOLUTION
    dom = domain(group)
    reads, writes = kernel_io(graph, group)
    arg = {n: f"in{k}" for k, n in enumerate(reads)}
    out = {n: f"out{k}" for k, n in enumerate(writes)}
    var = {n: f"v{k}" for k, n in enumerate(group)}
    inside = set(group)
    lines = [f"def {name}(rows, C, {', '.join(list(arg.values()) + list(out.values()))}):",
             "    for r in prange(rows):"]

    def ref(n: Node) -> str:
        if n.op == "const":
            return py_literal(n.attrs["value"], n.dtype)
        if n in inside:
            return var[n]
        if per_row(n, dom):
            return f"{arg[n]}[r, 0]"
        return f"{arg[n]}[0, c]" if per_col(n, dom) else f"{arg[n]}[r, c]"

    def emit_full(n: Node, done: set, body: list[str]) -> None:
        """Emit the full nodes n needs (and n) inside a column loop."""
        if n not in inside or n in done or fits(n, dom) != "full":
            return
        for i in n.inputs:
            emit_full(i, done, body)
        body.append(f"            {var[n]} = {PY_OPS[n.op].format(*map(ref, n.inputs))}")
        done.add(n)

    for n in group:
        if n.op in REDUCTIONS:
            x = n.inputs[0]
            # the accumulator in the node's dtype: a float64 0.0 would make a float32 row's sum float64
            # (a conversion per element, and not NumPy's float32 result)
            lines.append(f"        {var[n]} = {py_literal(0.0 if n.op == 'sum' else -math.inf, n.dtype)}")
            lines.append("        for c in range(C):")
            emit_full(x, set(), lines)
            step = f"{var[n]} + {ref(x)}" if n.op == "sum" else PY_OPS["max"].format(var[n], ref(x))
            lines.append(f"            {var[n]} = {step}")
        elif fits(n, dom) == "row":
            lines.append(f"        {var[n]} = {PY_OPS[n.op].format(*map(ref, n.inputs))}")
        if n in out and fits(n, dom) == "row":
            lines.append(f"        {out[n]}[r, 0] = {var[n]}")
    full_out = [n for n in writes if fits(n, dom) == "full"]
    if full_out:
        lines.append("        for c in range(C):")
        done: set = set()
        for n in full_out:
            emit_full(n, done, lines)
            lines.append(f"            {out[n]}[r, c] = {var[n]}")
    return "\n".join(lines) + "\n"
    ### END SOLUTION

# %% tags=["demo"]
# vexp and vtanh against NumPy: the largest relative error over every normal result (reference:
# np.longdouble), where exp overflows, and the time of a loop over 2**16 elements
from minitorch.bench import benchmark, load_report  # noqa: E402

def _loop(f):
    """A Numba loop applying the scalar function f to every element, compiled as the kernels are."""
    @njit(fastmath=KERNEL_FASTMATH, error_model="numpy")
    def loop(x, out):
        for i in range(x.size):
            out[i] = f(x[i])
    return loop


_loop_vexp, _loop_exp, _loop_vtanh, _loop_tanh = map(_loop, (vexp, math.exp, vtanh, math.tanh))


def rel_error(got, x, fn):
    """The largest |got - fn(x)| / |fn(x)| in eps of got's dtype, fn computed in long double."""
    exact = fn(x.astype(np.longdouble))
    return float(np.max(np.abs(got - exact) / np.abs(exact)) / np.finfo(got.dtype).eps)


from tqdm.auto import tqdm  # noqa: E402

bar, lines = tqdm(total=4, desc="errors, then times (the first step compiles the loops)"), []
with np.errstate(over="ignore"):
    for dt in (np.float32, np.float64):
        fi = np.finfo(dt)
        first, last = dt(np.log(fi.tiny)), dt(np.log(fi.max))  # the x whose exp is normal: first .. last
        while np.exp(first) < fi.tiny:
            first = np.nextafter(first, dt(np.inf))
        while np.isfinite(np.exp(np.nextafter(last, dt(np.inf)))):
            last = np.nextafter(last, dt(np.inf))
        while not np.isfinite(np.exp(last)):
            last = np.nextafter(last, dt(-np.inf))
        xe = np.linspace(first, last, 1 << 16).astype(dt)
        xe[-1] = last
        out = np.empty_like(xe)
        _loop_vexp(xe, out)
        exp_err = rel_error(out, xe, np.exp)
        xt = np.concatenate([np.geomspace(fi.tiny, 20, 1 << 15), -np.geomspace(fi.tiny, 20, 1 << 15)]).astype(dt)
        _loop_vtanh(xt, out)
        tanh_err = rel_error(out, xt, np.tanh)
        edge = np.array([last, np.nextafter(last, dt(np.inf))], dt)
        _loop_vexp(edge, edge_out := np.empty_like(edge))
        lines.append(f"{np.dtype(dt).name}: vexp max relative error {exp_err:.2f} eps, vtanh {tanh_err:.2f} eps; "
                     f"vexp({edge[0]!r}) = {edge_out[0]:.6g}, vexp({edge[1]!r}) = {edge_out[1]} (NumPy: {np.exp(edge)})")
        bar.update()

lines += [f"\n{load_report()}",
          "a loop over 2**16 elements on one thread (np.*: NumPy's ufunc), fastest - median of 20 runs, us:"]
for dt in (np.float32, np.float64):
    xe = np.linspace(-5, 5, 1 << 16).astype(dt)
    out = np.empty_like(xe)
    times = {name: benchmark(fn, xe, out, repeat=20)
             for name, fn in [("vexp", _loop_vexp), ("math.exp", _loop_exp), ("np.exp", lambda a, o: np.exp(a, out=o)),
                              ("vtanh", _loop_vtanh), ("math.tanh", _loop_tanh), ("np.tanh", lambda a, o: np.tanh(a, out=o))]}
    lines.append(f"  {np.dtype(dt).name}: " + ", ".join(f"{k} {1e6 * t.min:.0f}-{1e6 * t.median:.0f}" for k, t in times.items()))
    bar.update()
bar.close()
print("\n".join(lines))

# %% [markdown]
# The runner (given) turns a plan into one callable: it generates and compiles each fused group's
# kernel once (`compile_numba`), runs the library kernels with NumPy, and keeps a dictionary of
# the arrays each kernel wrote. `compile(fn)` is `Compiled(fn, backend=build_kernels)`.
# Compiling is the expensive part (LLVM takes about half a second a kernel here, running it
# microseconds), so, as TorchInductor keeps its generated code and Triton its binaries in a cache
# directory, `compile_numba` keeps each kernel in a file named by the hash of everything its
# machine code depends on: its source, the flags, the source of the helpers it calls (`vexp`, ...)
# and the Numba version. Numba caches the machine code beside the file, so the next process that
# generates the same kernel loads it instead of compiling it.

# %%
#| export
#| given
KERNEL_CACHE: dict[tuple[str, bool], Callable] = {}
PARALLEL_MIN = 1 << 20  # elements in a kernel's domain from which its rows run on all cores
KERNEL_DIR = Path(tempfile.gettempdir()) / f"minitorch-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _kernel_file(source: str, name: str, parallel: bool) -> Path | None:
    """The file that holds this kernel on disk: KERNEL_DIR/k<hash>.py, the hash of the source, the
    flags, the helpers' code (_helpers_text) and the versions; None where a helper's source cannot be
    read (the kernel is then compiled in memory only)."""
    import hashlib

    import numba

    helpers = _helpers_text()
    if helpers is None:
        return None
    parts = [source, name, str(parallel), str(sorted(KERNEL_FASTMATH)), numba.__version__, sys.version, helpers]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    return KERNEL_DIR / f"k{digest}.py"


def _helpers_text() -> str | None:
    """Everything of ours a kernel's machine code is made from besides its source: the functions of
    KERNEL_NAMES, each function and constant their code names (transitively), and the Numba
    implementations registered for them with @overload, as source text (the same in the package and
    in a notebook, so both find the same kernels); None if a source cannot be read."""
    import dis
    import inspect
    import re

    first = next((v for v in KERNEL_NAMES.values() if inspect.isfunction(getattr(v, "py_func", v))), None)
    if first is None:
        return ""
    ns = getattr(first, "py_func", first).__globals__

    def ours(value: Any) -> Any:
        fn = getattr(value, "py_func", value)
        return fn if inspect.isfunction(fn) and fn.__globals__ is ns else None

    def names(code: Any) -> set[str]:  # the globals the code reads (co_names also holds attributes)
        out = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        for const in code.co_consts:
            if inspect.iscode(const):
                out |= names(const)
        return out

    try:
        overloads: dict[str, list[Any]] = {}
        for value in list(ns.values()):
            if (fn := ours(value)) is not None:
                for target in re.findall(r"@overload\((\w+)", inspect.getsource(fn)):
                    overloads.setdefault(target, []).append(fn)
        todo = [fn for v in KERNEL_NAMES.values() if (fn := ours(v)) is not None]
        seen: dict[str, str] = {}
        while todo:
            fn = todo.pop()
            key = fn.__qualname__ if fn.__name__ != "<lambda>" else f"<lambda> {fn.__code__.co_firstlineno}"
            if key in seen:
                continue
            seen[key] = inspect.getsource(fn)
            todo += overloads.get(fn.__name__, [])
            for name in names(fn.__code__):
                value = ns.get(name)
                if ours(value) is not None:
                    todo.append(ours(value))
                elif isinstance(value, (bool, int, float, str, tuple, frozenset, np.generic)):
                    seen[f"const {name}"] = repr(value)
    except (OSError, TypeError):  # no source (a function typed in a console)
        return None
    return "\n".join(f"{k}\n{seen[k]}" for k in sorted(seen))


def _kernel_from_file(source: str, name: str, parallel: bool) -> Callable | None:
    """The kernel `name`, defined by a module loaded from its file (written once, atomically), with
    Numba's on-disk cache on; None if the file cannot be written or loaded."""
    import importlib.util

    path = _kernel_file(source, name, parallel)
    if path is None:
        return None
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
            tmp.write_text(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(f"minitorch_kernel_{path.stem}", path)
        module = sys.modules.get(spec.name)
        if getattr(module, "__file__", None) != str(path):  # by name: Numba's cached code refers to it
            module = importlib.util.module_from_spec(spec)
            module.__dict__.update(KERNEL_NAMES)
            spec.loader.exec_module(module)
            sys.modules[spec.name] = module
    except (OSError, ImportError):
        return None
    return njit(cache=True, parallel=parallel, error_model="numpy", fastmath=KERNEL_FASTMATH)(getattr(module, name))


_KERNEL_DIR_ON = True


@contextlib.contextmanager
def _cold_kernel_cache():
    """Inside the block, a kernel not yet compiled in this process is compiled in memory, not loaded
    from KERNEL_DIR (for timing a compilation, as a first run on a new machine pays it)."""
    global _KERNEL_DIR_ON
    saved, _KERNEL_DIR_ON = _KERNEL_DIR_ON, False
    try:
        yield
    finally:
        _KERNEL_DIR_ON = saved


def compile_numba(source: str, name: str, parallel: bool = True) -> Callable:
    """exec `source` and njit the function `name` it defines (`prange` runs the rows on all cores
    when parallel, else it is `range`). Kernels are cached by their source: the same group on
    another shape reuses the compiled kernel (Numba compiles once per argument types), and another
    process loads its machine code from disk (_kernel_file)."""
    key = (source, parallel)
    if key not in KERNEL_CACHE:
        scope: dict[str, Any] = dict(KERNEL_NAMES)
        try:
            code = builtins.compile(source, f"<kernel {name}>", "exec")
        except SyntaxError as exc:
            raise ValueError(f"compile_numba: source is not valid Python ({exc.msg}, line {exc.lineno}): "
                             f"{source[:200]!r}") from None
        exec(code, scope)  # noqa: S102 - our own generated code
        if not callable(scope.get(name)):
            raise ValueError(f"compile_numba: name {name!r} is not a function the source defines")
        KERNEL_CACHE[key] = (_KERNEL_DIR_ON and _kernel_from_file(source, name, parallel)) or \
            njit(cache=False, parallel=parallel, error_model="numpy", fastmath=KERNEL_FASTMATH)(scope[name])
    return KERNEL_CACHE[key]


def build_kernels(graph: Graph, source_fn: Callable | None = None, log: list | None = None,
                  parallel: bool = True, kernel_wrapper: Callable | None = None,
                  times: dict | None = None) -> Callable:
    """The compiled runner of `graph`: optimize, fuse, plan the buffers, generate (numba_source by
    default) and compile every fused group. runner(*arrays) -> [output arrays]; it checks the
    arrays against the graph's inputs first (`check_arrays`). Intermediate values live in buffers
    allocated once (`plan_buffers`), so a runner is not re-entrant; outputs are new arrays each
    call. `log`, if given, receives (kernel name, reads, writes) for each kernel run: the arrays of
    the nodes it read and wrote (before any view). kernel_wrapper(kernel, source), if given,
    returns what runs in the kernel's place (the autotuner's hook). `times`, if given, receives
    {(k, label): [seconds of each run]} for each kernel (the profiler's hook)."""
    import time

    source_fn = source_fn or numba_source
    graph = optimize(graph)
    plan = fuse(graph)
    assign = plan_buffers(graph, plan)
    sizes: dict[int, tuple[int, np.dtype]] = {b: (math.prod(n.shape), n.dtype) for n, b in assign.items()}
    pool = {b: np.empty(size, dtype) for b, (size, dtype) in sizes.items()}
    steps = []
    for k, group in enumerate(plan):
        dom = domain(group)
        reads, writes = kernel_io(graph, group)
        if dom is None:
            steps.append((None, group, reads, writes, None, None, None))
        else:
            name = f"kernel{k}"
            source = source_fn(graph, group, name)
            # threads pay off on big kernels; a small one runs on one core (no wake-up cost)
            kernel = compile_numba(source, name, parallel and math.prod(dom[0]) * dom[1] >= PARALLEL_MIN)
            if kernel_wrapper is not None:
                kernel = kernel_wrapper(kernel, source)
            # how each read is viewed and each write shaped, decided here once, not on every call
            views = [(per_row(n, dom), per_col(n, dom)) for n in reads]
            widths = [1 if per_row(n, dom) else dom[1] for n in writes]
            steps.append((kernel, group, reads, writes, dom, views, widths))

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        env: dict[Node, np.ndarray] = dict(zip(graph.inputs, check_arrays("compiled graph", graph, arrays)))
        for n in graph.nodes:
            if n.op == "const":
                env[n] = np.asarray(n.attrs["value"], dtype=n.dtype)
        for k, (kernel, group, reads, writes, dom, views, widths) in enumerate(steps):
            t0 = time.perf_counter() if times is not None else 0.0
            for n in writes:
                env[n] = pool[assign[n]].reshape(n.shape) if n in assign else np.empty(n.shape, n.dtype)
            if kernel is None:
                (n,) = group
                if n.op == "matmul" and n in env:
                    a, b = env[n.inputs[0]], env[n.inputs[1]]
                    if a.ndim > 2 and b.ndim == 2:  # (..., n, k) @ (k, m): one GEMM of all rows, not one per batch
                        np.matmul(a.reshape(-1, a.shape[-1]), b, out=env[n].reshape(-1, b.shape[-1]))
                    else:
                        np.matmul(a, b, out=env[n])
                elif n in env:
                    env[n][...] = _numpy_op(n, *(env[i] for i in n.inputs))
                else:
                    env[n] = np.asarray(_numpy_op(n, *(env[i] for i in n.inputs)), dtype=n.dtype)
                if log is not None:
                    log.append((f"library {n.op}", [env[i] for i in n.inputs if i.op != "const"], [env[n]]))
                if times is not None:
                    times.setdefault((k, f"library {n.op}"), []).append(time.perf_counter() - t0)
                continue
            rows = math.prod(dom[0])
            ins = [_row_view(env[n], n.shape, dom, pr, pc) for n, (pr, pc) in zip(reads, views)]
            outs = [env[n].reshape(rows, width) for n, width in zip(writes, widths)]
            kernel(rows, dom[1], *ins, *outs)
            if log is not None:
                log.append((f"kernel{k}", [env[n] for n in reads], [env[n] for n in writes]))
            if times is not None:
                kind = "reduction" if any(n.op in REDUCTIONS for n in group) else "pointwise"
                times.setdefault((k, f"{kind} {'+'.join(n.op for n in group)}"), []).append(time.perf_counter() - t0)
        return [env[o] for o in graph.outputs]

    run.graph, run.plan, run.buffers = graph, plan, assign
    return run


def compile(fn: Callable) -> Compiled:  # noqa: A001 - the name torch.compile uses
    """fn, compiled: traced per guard key, optimized, fused, generated as Numba kernels."""
    return Compiled(fn, backend=build_kernels)

# %% [markdown]
# The softmax's one kernel: three loops over the columns (the max, the sum of the exponentials,
# the output), one pass over rows.

# %%
gs = optimize(trace(softmax_fn, np.zeros((4, 10))))
print(numba_source(gs, fuse(gs)[0], "softmax_kernel"))

# %% [markdown]
# ### Putting it together: a LayerNorm + MLP block
#
# Lesson 09's block computes `x + mlp(ln(x))` (and the same with attention). Written with
# minitorch's operations, with GELU in its tanh form and the LayerNorm of section 1, it traces
# into one graph; the compiler fuses the LayerNorm into one kernel, the bias and GELU after the
# first matmul into one, and the bias and residual after the second into one.

# %%
GELU_C = float(np.sqrt(2.0 / np.pi))


def mlp_block(x, ln_w, ln_b, w1, b1, w2, b2):
    h = layer_norm_fn(x, ln_w, ln_b) @ w1 + b1
    h = 0.5 * h * (1.0 + (GELU_C * (h + 0.044715 * h * h * h)).tanh())
    return x + h @ w2 + b2


def block_params(c, seed=0, dtype=np.float64):
    r = np.random.default_rng(seed)
    return [Tensor(a.astype(dtype)) for a in (1 + 0.1 * r.standard_normal(c), 0.1 * r.standard_normal(c),
                                               0.1 * r.standard_normal((c, 4 * c)), 0.1 * r.standard_normal(4 * c),
                                               0.1 * r.standard_normal((4 * c, c)), 0.1 * r.standard_normal(c))]


block = compile(mlp_block)
xb = Tensor(rng.standard_normal((2, 16, 64)))
params = block_params(64)
got, want = block(xb, *params), mlp_block(xb, *params)
print(f"compiled vs eager minitorch (float64): max |difference| {np.abs(got.data - want.data).max():.1e}")
gb = optimize(trace(mlp_block, xb, *params))
plan_b = fuse(gb)
print(f"{len(eager_plan(gb))} eager kernels -> {len(plan_b)} kernels "
      f"({sum(domain(g) is None for g in plan_b)} matmuls); bytes eager {sum(plan_bytes(gb, eager_plan(gb))):,}, "
      f"fused {sum(plan_bytes(gb, plan_b)):,}")

# %% [markdown]
# ### A training step: forward and backward in one graph
#
# Lesson 02's tape records, while the forward runs, a closure per operation that computes its
# vector-Jacobian product from NumPy arrays; `backward()` walks the tape in reverse. A compiler
# wants the backward as *graph nodes*, so it can fuse and plan them with the forward: PyTorch's
# AOTAutograd traces the backward into the same kind of graph ahead of time, and XLA and JAX
# differentiate the graph itself (`jax.grad` is a graph-to-graph transformation).
#
# `grad_graph(graph, wrt)` (given) does that here: it walks the forward graph in reverse and
# appends, for each node, lesson 02's VJP rules written with the IR's operations (`mul`, `div`,
# `tanh`'s `1 - out * out`, a matmul's `g @ b^T` and `a^T @ g`), a sum of the broadcast axes to
# undo broadcasting (`unbroadcast`, as lesson 02's), and three layout operations that only
# gradients need: `expand` (a row value stretched over the columns: the backward of a sum, fused
# like a pointwise op), `reshape` and `transpose` (library kernels). The new graph returns the
# loss and the gradients of the chosen inputs; the passes, fusion, buffers and code generation
# of this lesson compile it unchanged. `compile_grad(fn, wrt)` returns (loss, grads) as Tensors.

# %%
#| export
#| given
def grad_graph(graph: Graph, wrt: Sequence[int] | None = None) -> Graph:
    """A graph returning (loss, d loss / d input k for k in wrt): the forward of `graph` (its first
    output is the loss, one element) and its backward. wrt: input positions (default: all)."""
    if not all(hasattr(graph, name) for name in ("nodes", "inputs", "outputs")):  # a Graph (of any copy of the module)
        raise TypeError(f"grad_graph: graph must be a Graph, got {type(graph).__name__}")
    if not graph.outputs:
        raise ValueError("grad_graph: the graph has no output (its first output is the loss)")
    loss = graph.outputs[0]
    if math.prod(loss.shape) != 1:
        raise ValueError(f"grad_graph: the loss must have one element, got shape {loss.shape}")
    wrt = list(range(len(graph.inputs))) if wrt is None else list(wrt)
    for k in wrt:
        if not isinstance(k, (int, np.integer)) or not 0 <= k < len(graph.inputs):
            raise ValueError(f"grad_graph: wrt holds {k!r}, not an input position 0..{len(graph.inputs) - 1}")
    g = Graph()
    new = {}
    for n in graph.nodes:
        new[n] = g.copy_node(n, [new[i] for i in n.inputs])

    def const(v: float, like: Node) -> Node:
        return g.add_const(v, like.dtype)

    def unbroadcast(d: Node, shape: tuple) -> Node:
        while len(d.shape) > len(shape):
            d = g.add("sum", [d], {"axis": 0, "keepdims": False})
        for ax, (want, have) in enumerate(zip(shape, d.shape)):
            if want == 1 and have != 1:
                d = g.add("sum", [d], {"axis": ax, "keepdims": True})
        return d

    grads: dict[Node, Node] = {new[loss]: g.add("expand", [const(1.0, loss)], {"shape": loss.shape})}

    def give(n: Node, d: Node) -> None:
        if n.op == "const":
            return
        d = unbroadcast(d, n.shape)
        grads[n] = d if n not in grads else g.add("add", [grads[n], d])

    for old in reversed(graph.nodes):
        n = new[old]
        if n not in grads or n.op in ("input", "const"):
            continue
        d = grads[n]
        op, ins = n.op, n.inputs
        if op == "add":
            give(ins[0], d), give(ins[1], d)
        elif op == "sub":
            give(ins[0], d), give(ins[1], g.add("neg", [d]))
        elif op == "mul":
            give(ins[0], g.add("mul", [d, ins[1]])), give(ins[1], g.add("mul", [d, ins[0]]))
        elif op == "div":
            give(ins[0], g.add("div", [d, ins[1]]))
            give(ins[1], g.add("neg", [g.add("div", [g.add("mul", [d, n]), ins[1]])]))
        elif op == "pow":
            a, b = ins
            if b.op == "const":  # b * a ** (b - 1): b - 1 is a node of two constants (fold_constants folds it)
                down = g.add("pow", [a, g.add("sub", [b, const(1.0, b)])])
                give(a, g.add("mul", [d, g.add("mul", [down, b])]))
            else:
                give(a, g.add("mul", [d, g.add("mul", [b, g.add("div", [n, a])])]))
                give(b, g.add("mul", [d, g.add("mul", [n, g.add("log", [a])])]))
        elif op == "neg":
            give(ins[0], g.add("neg", [d]))
        elif op == "exp":
            give(ins[0], g.add("mul", [d, n]))
        elif op == "log":
            give(ins[0], g.add("div", [d, ins[0]]))
        elif op == "sqrt":
            give(ins[0], g.add("div", [d, g.add("mul", [n, const(2.0, n)])]))
        elif op == "tanh":
            give(ins[0], g.add("mul", [d, g.add("sub", [const(1.0, n), g.add("mul", [n, n])])]))
        elif op == "sum":
            axis = n.attrs["axis"] % len(ins[0].shape)
            if not n.attrs["keepdims"]:
                kept = ins[0].shape[:axis] + (1,) + ins[0].shape[axis + 1:]
                d = g.add("reshape", [d], {"shape": kept})
            give(ins[0], g.add("expand", [d], {"shape": ins[0].shape}))
        elif op == "relu":  # lesson 02's rule: the derivative at 0 is 0
            give(ins[0], g.add("mul", [d, g.add("step", [ins[0]])]))
        elif op == "max":  # lesson 02's rule: to the maximal elements, split evenly among ties
            axis = n.attrs["axis"] % len(ins[0].shape)
            top = n
            if not n.attrs["keepdims"]:
                kept = ins[0].shape[:axis] + (1,) + ins[0].shape[axis + 1:]
                d = g.add("reshape", [d], {"shape": kept})
                top = g.add("reshape", [n], {"shape": kept})
            mask = g.add("eq", [ins[0], top])
            count = g.add("sum", [mask], {"axis": axis, "keepdims": True})
            give(ins[0], g.add("div", [g.add("mul", [d, mask]), count]))
        elif op == "transpose":
            give(ins[0], g.add("transpose", [d]))
        elif op == "matmul":
            a, b = ins
            if len(a.shape) < 2 or len(b.shape) < 2:
                raise GraphBreak("grad_graph: matmul of a vector has no gradient rule here")
            give(a, g.add("matmul", [d, g.add("transpose", [b])])), give(b, g.add("matmul", [g.add("transpose", [a]), d]))
        else:
            raise GraphBreak(f"grad_graph: no gradient rule for {op}")
    outs = []
    for k in wrt:
        x = new[graph.inputs[k]]
        if x not in grads:  # the loss does not reach x: zeros (not x * 0, which is nan where x is inf)
            grads[x] = g.add("expand", [const(0.0, x)], {"shape": x.shape})
        if grads[x].dtype != x.dtype:  # a float32 input of a float64 loss: its gradient in float32, as the tape's
            grads[x] = g.add("astype", [grads[x]], {"dtype": x.dtype})
        outs.append(grads[x])
    g.outputs = [new[loss]] + outs
    g.single = False
    return g


def compile_grad(fn: Callable, wrt: Sequence[int] | None = None, **options: Any) -> Compiled:
    """fn (returning a one-element loss), compiled with its backward: the call returns
    (loss, (grad of argument k for k in wrt)) as Tensors. options go to build_kernels."""
    known = ("source_fn", "log", "parallel", "kernel_wrapper", "times")
    for name in options:
        if name not in known:
            raise TypeError(f"compile_grad: options are build_kernels' ({', '.join(known)}), got {name!r}")
    compiled = Compiled(lambda *args: (fn(*args),),
                        backend=lambda graph: build_kernels(grad_graph(graph, wrt), **options))

    def step(*args: Any) -> tuple[Tensor, tuple[Tensor, ...]]:
        loss, *grads = compiled(*args)
        return loss, tuple(grads)

    step.compiled = compiled
    return step

# %% [markdown]
# Constant folding at work (section 3): the gradient graph of a LayerNorm-like scale
# `(mean square + eps) ** -0.5` holds the exponent's `b - 1` as a `sub` of two constants, which
# `fold_constants` replaces by one constant.

# %%
def inv_norm(x):  # (mean of x * x + eps) ** -0.5 over one row of 5
    return ((x * x).sum(axis=0) * 0.2 + 1e-5) ** -0.5


g2 = grad_graph(trace(inv_norm, np.zeros(5)))
g2f = dce(fold_constants(g2))
print(f"the value and its gradient: {g2.count()} nodes, {g2.count('const')} constants\n{g2}")
print(f"\nfolded, dead code removed: {g2f.count()} nodes, {g2f.count('const')} constants\n{g2f}")

# %% [markdown]
# One training step of the block: the loss is the squared error against a target. The compiled
# gradients equal lesson 02's tape (float64), and the whole step is a few kernels.

# %%
def block_loss(x, ln_w, ln_b, w1, b1, w2, b2, target):
    d = mlp_block(x, ln_w, ln_b, w1, b1, w2, b2) - target
    return (d * d).sum(axis=-1).sum(axis=0) * 0.5


from tqdm.auto import tqdm  # noqa: E402

xs_t = rng.standard_normal((9, 16))
ts_t = rng.standard_normal((9, 16))
ps_t = block_params(16)
bar = tqdm(total=2, desc="compile and run the step, then the tape")  # the first call compiles its kernels: seconds
step = compile_grad(block_loss, wrt=range(1, 7))
loss_c, grads_c = step(Tensor(xs_t), *ps_t, Tensor(ts_t))
bar.update()
leaves = [Tensor(p.data, requires_grad=True) for p in ps_t]
loss_e = block_loss(Tensor(xs_t), *leaves, Tensor(ts_t))
loss_e.backward()
bar.update()
bar.close()
worst = max(np.abs(gc.data - leaf.grad.data).max() for gc, leaf in zip(grads_c, leaves))
print(f"loss: compiled {float(loss_c.data):.12f}, eager {float(loss_e.data):.12f}; "
      f"largest gradient difference {worst:.1e}")
gt = optimize(grad_graph(trace(lambda *a: (block_loss(*a),), Tensor(xs_t), *ps_t, Tensor(ts_t)), range(1, 7)))
pt = fuse(gt)
print(f"forward + backward: {len(eager_plan(gt))} eager kernels -> {len(pt)} kernels "
      f"({sum(domain(p) is None for p in pt)} library); bytes eager {sum(plan_bytes(gt, eager_plan(gt))):,}, "
      f"fused {sum(plan_bytes(gt, pt)):,}")

# %% [markdown]
# The check grades your kernels on all of it: edge shapes (size 0 and 1, broadcast axes, a
# scalar), bad inputs, the guards of `compile`, the bytes the kernels really touch (each kernel
# run as plain Python on arrays that record every element read and written), the buffers, the
# block and the training step.

# %% tags=["check"]
check("14.7")

# %% [markdown]
# ## 6. Code generation: CUDA C
#
# The same fused group, for a GPU. The simplest mapping gives each row to one thread: thread
# `r = blockIdx.x * blockDim.x + threadIdx.x` runs the loops over the columns that the Numba
# kernel runs for row r (so a row's reductions need no shared memory and no barrier), and a
# thread past the last row returns at once. That is the right shape for many short rows; a wide
# row wants a block per row and a tree reduction in shared memory (lesson 08's fused softmax),
# which TorchInductor chooses by the row's length ("persistent" vs "looped" reductions).
#
# `cuda_source(graph, group, name)` writes
#
# ```
# extern "C" __global__ void name(int rows, int C, const T* in0, ..., T* out0, ...)
# ```
#
# with each array's own C type (`float` for float32, `double` for float64), contiguous: element
# (r, c) of a read or write with a value per column is at `r * C + c`, one with a value per row at
# `r` (the runner, given, makes these arrays from the row views). Values are local variables of
# their node's type (`float v3 = ...`). Functions by type (`c_func`, given): `expf logf tanhf sqrtf
# powf` for float, `exp log tanh sqrt pow` for double. NaN must come out where NumPy gives NaN, and
# `fmaxf(a, b)` returns the other operand when one is NaN: so relu is `((a > 0 || a != a) ? a : 0)`,
# and a max accumulates with `v = (v >= x || v != v) ? v : x` (as `vmax`), starting at `-INFINITY`.
# The backward's `step` (relu's derivative) is `(a > 0 ? 1 : 0)` and `eq` (a max's tie mask)
# `(a == b ? 1 : 0)`, with typed literals; `expand` is its input (the indexing already
# broadcasts); float constants carry an `f` (`0.5f`), infinities are `INFINITY`. The loop
# structure is the Numba kernel's, so a training step's backward groups run as CUDA C too.
#
# **Exercise 14.8.** Write `cuda_source(graph, group, name) -> str`.

# %%
#| export
#| given
CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
C_FUNCS = {"exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "pow": "pow"}


def c_literal(value: float, dtype: DTypeLike) -> str:
    """A C literal of `value` in `dtype` (float gets an f suffix; inf and nan by macro)."""
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    if math.isnan(value):
        return "(INFINITY - INFINITY)"
    text = repr(float(value))
    return text + "f" if np.dtype(dtype) == np.float32 else text


def c_func(op: str, dtype: DTypeLike) -> str:
    """The C math function for op in dtype: expf for float, exp for double."""
    return C_FUNCS[op] + ("f" if np.dtype(dtype) == np.float32 else "")

# %%
#| export
#| exercise 14.8
def cuda_source(graph: Graph, group: Sequence[Node], name: str) -> str:
    """CUDA C source of the kernel `name(int rows, int C, const T* in0, ..., T* out0, ...)` for one
    fused group: one thread per row, the Numba kernel's loops over the columns."""
    ### BEGIN SOLUTION
    dom = domain(group)
    reads, writes = kernel_io(graph, group)
    arg = {n: f"in{k}" for k, n in enumerate(reads)}
    out = {n: f"out{k}" for k, n in enumerate(writes)}
    var = {n: f"v{k}" for k, n in enumerate(group)}
    inside = set(group)
    params = ([f"const {CTYPES[n.dtype]}* {arg[n]}" for n in reads]
              + [f"{CTYPES[n.dtype]}* {out[n]}" for n in writes])
    lines = [f'extern "C" __global__ void {name}(int rows, int C, {", ".join(params)})', "{",
             "    int r = blockIdx.x * blockDim.x + threadIdx.x;",
             "    if (r >= rows) return;"]

    def ref(n: Node) -> str:
        if n.op == "const":
            return c_literal(n.attrs["value"], n.dtype)
        if n in inside:
            return var[n]
        return f"{arg[n]}[r]" if per_row(n, dom) else f"{arg[n]}[(long long)r * C + c]"

    def expr(n: Node) -> str:
        a = [ref(i) for i in n.inputs]
        if n.op == "neg":
            return f"(-{a[0]})"
        if n.op == "relu":
            zero = c_literal(0.0, n.dtype)  # not fmax(a, 0): fmax(nan, 0) is 0, NumPy's relu of nan is nan
            return f"(({a[0]} > {zero} || {a[0]} != {a[0]}) ? {a[0]} : {zero})"
        if n.op == "expand":
            return a[0]
        if n.op in ("step", "eq"):
            one, zero = c_literal(1.0, n.dtype), c_literal(0.0, n.dtype)
            test = f"{a[0]} > {zero}" if n.op == "step" else f"{a[0]} == {a[1]}"
            return f"({test} ? {one} : {zero})"
        if n.op in ("exp", "log", "tanh", "sqrt", "pow"):
            return f"{c_func(n.op, n.dtype)}({', '.join(a)})"
        return f"({a[0]} {dict(add='+', sub='-', mul='*', div='/')[n.op]} {a[1]})"

    def emit_full(n: Node, done: set, body: list[str]) -> None:
        if n not in inside or n in done or fits(n, dom) != "full":
            return
        for i in n.inputs:
            emit_full(i, done, body)
        body.append(f"        {CTYPES[n.dtype]} {var[n]} = {expr(n)};")
        done.add(n)

    for n in group:
        if n.op in REDUCTIONS:
            x = n.inputs[0]
            start = c_literal(0.0, n.dtype) if n.op == "sum" else "(-INFINITY)"
            lines.append(f"    {CTYPES[n.dtype]} {var[n]} = {start};")
            lines.append("    for (int c = 0; c < C; ++c) {")
            emit_full(x, set(), lines)
            v, xv = var[n], ref(x)  # a max that propagates nan, as np.max does (fmax skips it)
            step = f"{v} + {xv}" if n.op == "sum" else f"({v} >= {xv} || {v} != {v}) ? {v} : {xv}"
            lines.append(f"        {var[n]} = {step};")
            lines.append("    }")
        elif fits(n, dom) == "row":
            lines.append(f"    {CTYPES[n.dtype]} {var[n]} = {expr(n)};")
        if n in out and fits(n, dom) == "row":
            lines.append(f"    {out[n]}[r] = {var[n]};")
    full_out = [n for n in writes if fits(n, dom) == "full"]
    if full_out:
        lines.append("    for (int c = 0; c < C; ++c) {")
        done: set = set()
        for n in full_out:
            emit_full(n, done, lines)
            lines.append(f"        {out[n]}[(long long)r * C + c] = {var[n]};")
        lines.append("    }")
    lines.append("}")
    return "\n".join(lines) + "\n"
    ### END SOLUTION

# %% [markdown]
# The runner (given) runs a graph with its fused groups as CUDA C kernels: on the course's CPU
# emulator (`course.cuda_c.emulate`: every access checked against the arrays, each kernel run in
# two thread orders), or on a GPU through CuPy where there is one; library kernels (matmul) run
# in NumPy. `grid = ceil(rows / block)` blocks of `block` threads.

# %%
#| export
#| given
def cuda_runner(graph: Graph, source_fn: Callable | None = None, block: int = 32,
                device: str = "emulator") -> Callable[..., list[np.ndarray]]:
    """A runner of `graph` (optimized, fused) whose fused groups run as CUDA C kernels
    (cuda_source by default), on "emulator" (the CPU) or "gpu" (CuPy). run.sources: the kernels."""
    from course import cuda_c  # NVRTC and the CPU emulator of CUDA C: course machinery (course/cuda_c.py)

    source_fn = source_fn or cuda_source
    if block < 1 or block > 1024:
        raise ValueError(f"cuda_runner: block must be 1..1024 threads, got {block}")
    graph = optimize(graph)
    plan = fuse(graph)
    sources = {k: source_fn(graph, g, f"kernel{k}") for k, g in enumerate(plan) if domain(g) is not None}

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        env: dict[Node, np.ndarray] = dict(zip(graph.inputs, check_arrays("cuda graph", graph, arrays)))
        for n in graph.nodes:
            if n.op == "const":
                env[n] = np.asarray(n.attrs["value"], dtype=n.dtype)
        for k, group in enumerate(plan):
            reads, writes = kernel_io(graph, group)
            dom = domain(group)
            if dom is None:
                (n,) = group
                env[n] = np.asarray(_numpy_op(n, *(env[i] for i in n.inputs)), dtype=n.dtype)
                continue
            rows = math.prod(dom[0])
            ins = [np.array(_row_view(env[n], n.shape, dom, per_row(n, dom)), order="C") for n in reads]
            outs = [np.zeros((rows, 1 if per_row(n, dom) else dom[1]), n.dtype) for n in writes]
            if rows:
                args = [np.int32(rows), np.int32(dom[1]), *ins, *outs]
                grid = (rows + block - 1) // block
                if device == "gpu":
                    import cupy

                    dev = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
                    cuda_c.raw_kernel(sources[k], f"kernel{k}")((grid,), (block,), tuple(dev))
                    outs = [cupy.asnumpy(d) for d in dev[2 + len(ins):]]
                else:
                    cuda_c.emulate(sources[k], f"kernel{k}", grid, block, args)
            for n, o in zip(writes, outs):
                env[n] = o.reshape(n.shape)
        return [env[o] for o in graph.outputs]

    run.graph, run.plan, run.sources = graph, plan, sources
    return run

# %% tags=["check"]
check("14.8")

# %% [markdown]
# The softmax as CUDA C, checked by NVRTC (the compiler behind CuPy's RawKernel) where it is
# installed, and run on the emulator against NumPy with several blocks and a last block that is
# only partly used.

# %%
print(cuda_source(gs, fuse(gs)[0], "softmax_kernel"))
from course.cuda_c import compile_ptx, nvrtc_unavailable, ptx_stats  # noqa: E402

why_no_nvrtc = nvrtc_unavailable()
if why_no_nvrtc is None:
    st = ptx_stats(compile_ptx(cuda_source(gs, fuse(gs)[0], "softmax_kernel")))
    print(f"PTX: {st.ld_global} global loads, {st.bar_sync} barriers, {st.local_bytes} bytes of local memory")
else:
    print(why_no_nvrtc)
xs = rng.standard_normal((37, 11))
got = cuda_runner(trace(softmax_fn, xs), block=16)(xs)[0]
want = np.exp(xs - xs.max(-1, keepdims=True))
want /= want.sum(-1, keepdims=True)
print(f"emulated softmax (37 rows, 3 blocks of 16 threads): max |difference| from NumPy {np.abs(got - want).max():.1e}")

# %% tags=["gpu"]
require_gpu()
xg = rng.standard_normal((4096, 1000)).astype(np.float32)
got = cuda_runner(trace(softmax_fn, xg), block=128, device="gpu")(xg)[0]
want = np.exp(xg - xg.max(-1, keepdims=True))
want /= want.sum(-1, keepdims=True)
print(f"GPU softmax: max |difference| from NumPy {np.abs(got - want).max():.1e}")

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0) this cell
# printed: `GPU softmax: max |difference| from NumPy 6.0e-08` for 4096 rows of 1,000 float32.

# %% [markdown]
# ## 7. A small autotuner
#
# Which block size, tile size or work split is fastest depends on the shape and the machine, and
# is easier to measure than to predict. Triton's `@autotune`, TVM's AutoTVM/Ansor and
# TorchInductor's `max-autotune` all run a few candidate configurations of a kernel on the real
# shape, keep the fastest, and cache the choice per shape so the cost is paid once.
#
# The knob tuned here is the Numba kernels' *chunk size*: how many rows `prange` hands a thread at
# a time (`numba.set_parallel_chunksize`; 0 means "divide the rows evenly once", Numba's
# default). Small chunks balance uneven work, large ones cost less scheduling. Every candidate
# computes the same thing, which the tuner checks: a configuration that changes the answer is a
# bug, never a winner.
#
# `Autotuner(timer)` keeps `cache = {key: best config}` and `trials` (how many timed runs it
# measured). `tune(key, candidates, run)` returns the cached choice for a key seen before, without
# running anything; otherwise it calls `run(config)` (which returns the kernel's outputs) once per
# candidate to warm up and compare outputs with the first candidate's (`np.array_equal` with
# `equal_nan=True`: a softmax of a fully masked row is NaN in every config; `ValueError` naming both
# configs if they differ). Copy the first candidate's outputs before running the others: a runner
# may hand back the same buffers every time. Then it times `repeat` runs of each with `timer`
# (each timed run counts in `trials`; the warm-up runs do not), ranks the candidates by their
# *fastest* run, as lesson 04 taught (not by the total or the mean: one run slowed by another
# program must not cost a config the race), breaks a tie in favour of the earlier candidate, and
# caches and returns the winner.
#
# **Exercise 14.9.** Write `Autotuner.tune`.

# %%
#| export
#| exercise 14.9
class Autotuner:
    """Choose a kernel configuration by measuring the candidates; cache the choice per key
    (a kernel and a shape). timer: a clock in seconds (time.perf_counter)."""

    def __init__(self, timer: Callable[[], float] | None = None, repeat: int = 3):
        import time

        if timer is not None and not callable(timer):
            raise TypeError(f"Autotuner: timer must be a callable clock, got {timer!r}")
        if not isinstance(repeat, (int, np.integer)) or isinstance(repeat, bool) or repeat < 1:
            raise ValueError(f"Autotuner: repeat must be an integer >= 1, got {repeat!r}")
        self.timer = timer or time.perf_counter
        self.repeat = int(repeat)
        self.cache: dict[Any, Any] = {}
        self.trials = 0

    def tune(self, key: Hashable, candidates: Sequence[Any], run: Callable[[Any], Sequence[np.ndarray]]) -> Any:
        """The best of `candidates` for `key` (cached): run(config) -> the kernel's outputs."""
        if not isinstance(candidates, (tuple, list)):
            raise TypeError(f"tune({key!r}): candidates must be a list or tuple of configs, got {candidates!r}")
        if len(candidates) == 0:
            raise ValueError(f"tune({key!r}): candidates is empty: nothing to choose from")
        if not callable(run):
            raise TypeError(f"tune({key!r}): run must be callable (config -> outputs), got {run!r}")
        ### BEGIN SOLUTION
        if key in self.cache:
            return self.cache[key]
        first = [np.asarray(o).copy() for o in run(candidates[0])]
        for config in candidates[1:]:
            outs = run(config)
            if len(outs) != len(first) or not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(first, outs)):
                raise ValueError(f"tune({key!r}): config {config!r} gives other results than {candidates[0]!r}")
        best, best_t = candidates[0], math.inf
        for config in candidates:
            for _ in range(self.repeat):
                t0 = self.timer()
                run(config)
                t = self.timer() - t0
                self.trials += 1
                if t < best_t:
                    best, best_t = config, t
        self.cache[key] = best
        return best
        ### END SOLUTION


def tuned_kernels(graph: Graph, tuner: Autotuner, candidates: Sequence[int] = (0, 1, 4, 16)) -> Callable:
    """build_kernels(graph), with each fused kernel's chunk size chosen by `tuner` on its first run
    for a shape (key: the kernel's source and the rows, C it runs over). run.choices: {key: chunk}."""
    import numba

    choices: dict = {}
    seen: set = set()

    def wrap(kernel: Callable, source: str) -> Callable:
        def tuned(rows: int, C: int, *arrays: np.ndarray) -> None:
            key = (source, rows, C)
            outs = arrays[len(arrays) - n_writes[source]:]

            def run(chunk: int) -> list[np.ndarray]:
                old = numba.set_parallel_chunksize(chunk)
                try:
                    kernel(rows, C, *arrays)
                finally:
                    numba.set_parallel_chunksize(old)
                return [o.copy() for o in outs]

            if key not in seen:
                choices[key] = tuner.tune(key, candidates, run)
                seen.add(key)
            old = numba.set_parallel_chunksize(choices[key])
            try:
                kernel(rows, C, *arrays)
            finally:
                numba.set_parallel_chunksize(old)
        return tuned

    n_writes: dict[str, int] = {}

    def source_fn(g: Graph, group: Sequence[Node], name: str) -> str:
        src = numba_source(g, group, name)
        n_writes[src] = len(kernel_io(g, group)[1])
        return src

    run = build_kernels(graph, source_fn=source_fn, kernel_wrapper=wrap)
    run.choices = choices
    return run

# %% tags=["check"]
check("14.9")

# %%
from minitorch.bench import load_report  # noqa: E402

print(load_report())
tuner = Autotuner()
xt = rng.standard_normal((2048 if not SMALL else 256, 512))
run_t = tuned_kernels(trace(softmax_fn, xt), tuner)
run_t(xt)
run_t(xt)  # the same shape: no measuring
for (src, rows, C), chunk in run_t.choices.items():
    print(f"softmax kernel (the given tuned_kernels' runner) on ({rows}, {C}): chunk size {chunk} chosen by your "
          f"Autotuner after {tuner.trials} timed runs; when the candidates are within noise of each other, "
          f"another run may choose another")

# %% [markdown]
# ## 8. Compiled against eager: the whole transformer block
#
# Lesson 09's block adds causal self-attention before the MLP: `x + attn(ln1(x))`, then
# `x + mlp(ln2(x))`. Written with the operations the tracer knows, each head has its own query,
# key, value and output weights (the usual `(C, C)` matrices cut into heads: the same
# arithmetic), the causal mask is an input added to the scores (`-inf` above the diagonal), and
# `k.transpose(0, 2, 1)` swaps the last two axes. `gpt_block` (given, exported: the benchmark
# uses it too) is that block; `gpt_block_numpy` the same block written directly in NumPy, heads
# as one batched axis.

# %%
#| export
#| given
def gpt_block_weights(c: int, n_head: int, seed: int = 0, dtype: DTypeLike = np.float32) -> list[np.ndarray]:
    """Random weights of gpt_block for width c: ln1 (w, b), per head (wq, wk, wv) of (c, c/h), per head
    wo of (c/h, c), ln2 (w, b), w1 (c, 4c), b1, w2 (4c, c), b2."""
    if c % n_head:
        raise ValueError(f"gpt_block_weights: c = {c} is not a multiple of n_head = {n_head}")
    r = np.random.default_rng(seed)
    d = c // n_head
    s = 1 / math.sqrt(c)
    ws = [1 + 0.1 * r.standard_normal(c), 0.1 * r.standard_normal(c)]
    ws += [s * r.standard_normal((c, d)) for _ in range(3 * n_head)]
    ws += [s * r.standard_normal((d, c)) for _ in range(n_head)]
    ws += [1 + 0.1 * r.standard_normal(c), 0.1 * r.standard_normal(c), s * r.standard_normal((c, 4 * c)),
           0.1 * r.standard_normal(4 * c), s * r.standard_normal((4 * c, c)) / 2, 0.1 * r.standard_normal(c)]
    return [w.astype(dtype) for w in ws]


def additive_causal_mask(t: int, dtype: DTypeLike = np.float32) -> np.ndarray:
    """(t, t): 0 on and below the diagonal, -inf above: the mask gpt_block adds to its scores (a graph
    has no `where`). Lesson 09's attention.causal_mask is the boolean form (True: may attend)."""
    return np.triu(np.full((t, t), -np.inf, dtype), 1)


def _heads(what: str, weights: Sequence[Any]) -> int:
    """The number of heads of gpt_block's weights (8 + 4 per head, gpt_block_weights' order)."""
    if len(weights) < 12 or (len(weights) - 8) % 4:
        raise ValueError(f"{what}: weights must be gpt_block_weights' list (8 + 4 * n_head arrays), got "
                         f"{len(weights)} arrays")
    return (len(weights) - 8) // 4


def _ln(x: Any, w: Any, b: Any) -> Any:
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc * (var + 1e-5) ** -0.5 * w + b


def gpt_block(x: Tensor | Proxy | np.ndarray, mask: Tensor | Proxy | np.ndarray, *weights: Any) -> Any:
    """Lesson 09's pre-LayerNorm block on x (B, T, C) with minitorch operations (traceable):
    causal multi-head attention, then a tanh-GELU MLP, each with its residual.

    A variant of lesson 09's Block.forward, written for the tracer: the same arithmetic (LayerNorm
    eps 1e-5, tanh GELU), with the attention's projections per head and without biases (one (C, d)
    matrix each for q, k, v, one (d, C) for the output), the mask added (additive_causal_mask)
    rather than selected, and the softmax spelled out in operations a graph holds.
    tests/machinery/test_one_transformer.py checks it against GPT's block."""
    n_head = _heads("gpt_block", weights)
    ln1_w, ln1_b = weights[:2]
    qkv, wo = weights[2:2 + 3 * n_head], weights[2 + 3 * n_head:2 + 4 * n_head]
    ln2_w, ln2_b, w1, b1, w2, b2 = weights[2 + 4 * n_head:]
    h = _ln(x, ln1_w, ln1_b)
    scale = 1.0 / math.sqrt(qkv[0].shape[-1])
    attn = None
    for k in range(n_head):
        q, kk, v = h @ qkv[3 * k], h @ qkv[3 * k + 1], h @ qkv[3 * k + 2]
        s = (q @ kk.transpose(0, 2, 1)) * scale + mask
        e = (s - s.max(axis=-1, keepdims=True)).exp()
        head = (e / e.sum(axis=-1, keepdims=True)) @ v @ wo[k]
        attn = head if attn is None else attn + head
    x = x + attn
    u = _ln(x, ln2_w, ln2_b) @ w1 + b1
    u = 0.5 * u * (1.0 + (0.7978845608028654 * (u + 0.044715 * u * u * u)).tanh())
    return x + u @ w2 + b2


def gpt_block_numpy(x: np.ndarray, mask: np.ndarray, *weights: np.ndarray) -> np.ndarray:
    """gpt_block written directly in NumPy on x (B, T, C) and mask (T, T): heads as a batched axis, one
    (C, C) matrix each for q, k, v, o. The eager baseline the compiled block is timed against; the
    same numbers as gpt_block and lesson 09's Block (tests/machinery/test_one_transformer.py)."""
    n_head = _heads("gpt_block_numpy", weights)
    ln1_w, ln1_b = weights[:2]
    qkv, wo = weights[2:2 + 3 * n_head], weights[2 + 3 * n_head:2 + 4 * n_head]
    ln2_w, ln2_b, w1, b1, w2, b2 = weights[2 + 4 * n_head:]
    bsz, t, c = x.shape
    d = c // n_head
    wq, wk, wv = (np.concatenate(qkv[j::3], axis=1) for j in range(3))

    def ln(a: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
        mu = a.mean(-1, keepdims=True)
        var = a.var(-1, keepdims=True)
        return (a - mu) / np.sqrt(var + 1e-5) * w + b

    h = ln(x, ln1_w, ln1_b)
    q, k, v = ((h @ w).reshape(bsz, t, n_head, d).transpose(0, 2, 1, 3) for w in (wq, wk, wv))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + mask
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    a = (s @ v).transpose(0, 2, 1, 3).reshape(bsz, t, c)
    x = x + a @ np.concatenate(wo, axis=0)
    u = ln(x, ln2_w, ln2_b) @ w1 + b1
    u = 0.5 * u * (1.0 + np.tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)))
    return x + u @ w2 + b2

# %% [markdown]
# The block, traced: the passes one by one (node counts), then the plan.

# %%
xg_b = rng.standard_normal((2, 16, 32)).astype(np.float32)
wg_b = gpt_block_weights(32, 4)
graph_b = trace(gpt_block, xg_b, additive_causal_mask(16), *wg_b)
print(f"traced: {graph_b.count()} nodes")
for name, pass_fn in [("cse", cse), ("fold_constants", fold_constants), ("simplify", simplify), ("cse", cse),
                      ("dce", dce)]:
    graph_b = pass_fn(graph_b)
    print(f"after {name:<15} {graph_b.count():>4} nodes, {graph_b.count('const'):>3} constants")
plan_gb = fuse(graph_b)
print(f"{len(eager_plan(graph_b))} eager kernels -> {len(plan_gb)} kernels, of which "
      f"{sum(domain(g) is None for g in plan_gb)} library (matmul, transpose); "
      f"bytes eager {sum(plan_bytes(graph_b, eager_plan(graph_b))):,}, fused {sum(plan_bytes(graph_b, plan_gb)):,}")

# %% [markdown]
# ### The roofline and the clock
#
# Fusion leaves the FLOPs as they are and divides the bytes, so each fused kernel sits further
# right on lesson 04's roofline than the eager kernels it replaces: its arithmetic intensity
# (FLOP per byte) grows by the ratio of bytes, and so does the bound on its speed while it is
# memory-bound. `plan_flops` (given) counts one FLOP per output element of a pointwise node, one
# per input element of a reduction, and 2nk per output element of a matmul (lesson 04's count).
# The cell measures this machine's bandwidth and matmul peak with lesson 04's helpers and places
# the softmax, the LayerNorm and the block's non-matmul work, eager and fused.

# %%
#| export
#| given
def plan_flops(graph: Graph) -> int:
    """FLOPs of a graph: pointwise nodes one per output element, reductions one per input element,
    matmul 2 * k per output element; layout nodes and constants none."""
    total = 0
    for n in graph.nodes:
        if n.op in POINTWISE:
            total += math.prod(n.shape)
        elif n.op in REDUCTIONS:
            total += math.prod(n.inputs[0].shape)
        elif n.op == "matmul":
            total += 2 * math.prod(n.shape) * n.inputs[0].shape[-1]
    return total

# %% tags=["demo"]
import matplotlib.pyplot as plt  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from minitorch.bench import (benchmark, blas_line, load_report, measure_bandwidth, measure_peak_matmul,  # noqa: E402
                             roofline_plot)


def timed_compiler() -> str:
    """Whose compiler the timings below run: in the student notebook the given functions
    (build_kernels, compile, block_speed) are imported from minitorch/compiler.py."""
    if build_kernels.__module__ == "minitorch.compiler":
        return "the course's reference compiler (minitorch/compiler.py), whatever the state of your exercises"
    return "this notebook's compiler"


print(load_report())
print(f"fused: build_kernels' runner, from {timed_compiler()}; eager: minitorch Tensors (autograd recording); "
      "times: fastest - median of 5 runs")
bar = tqdm(total=4, desc="bandwidth, peak, softmax, layer norm")
bw = measure_bandwidth(n=2_000_000 if SMALL else 20_000_000, repeat=3 if SMALL else 10, dtype=np.float32)
bar.update()
peak = measure_peak_matmul(n=256 if SMALL else 1024, repeat=3)
bar.update()
rows_r = 512 if SMALL else 4096
xr = rng.standard_normal((rows_r, 1024)).astype(np.float32)
wr, br = np.ones(1024, np.float32), np.zeros(1024, np.float32)
points, lines = {}, []
for name, fn, args in [("softmax", softmax_fn, (xr,)), ("layer norm", layer_norm_fn, (xr, wr, br))]:
    gr = optimize(trace(fn, *args))
    flops = plan_flops(gr)
    t_e = benchmark(fn, *(Tensor(a) for a in args), repeat=5)
    run_r = build_kernels(trace(fn, *args))
    t_f = benchmark(run_r, *args, repeat=5)
    b_e, b_f = sum(plan_bytes(gr, eager_plan(gr))), sum(plan_bytes(gr, fuse(gr)))
    points[f"{name} eager"] = (flops / b_e, flops / t_e.min)
    points[f"{name} fused"] = (flops / b_f, flops / t_f.min)
    lines.append(f"{name} ({rows_r}, 1024) float32: {flops / 1e6:.0f} MFLOP; eager {b_e / 1e6:.0f} MB in "
                 f"{t_e.min * 1e3:.2f}-{t_e.median * 1e3:.2f} ms ({flops / b_e:.3f} FLOP/B), fused {b_f / 1e6:.0f} MB in "
                 f"{t_f.min * 1e3:.2f}-{t_f.median * 1e3:.2f} ms ({flops / b_f:.3f} FLOP/B); "
                 f"memory-bound limit {b_f / bw * 1e3:.2f} ms fused")
    bar.update()
bar.close()
print("\n".join(lines))
print(f"this machine: {bw / 1e9:.1f} GB/s (triad, float32), {peak / 1e9:.0f} GFLOP/s (BLAS matmul, float32, timed as a "
      "student's machine runs BLAS: measure_peak_matmul)")
print(blas_line())
roofline_plot(peak, bw, points, title="eager vs fused kernels (lesson 04's roofline)")
plt.show()

# %% [markdown]
# Live: a chain of pointwise operations (`+ 0.5`, `* 1.5`, `tanh` in turn) on the same
# (rows, 1024) float32 input, then nothing, a softmax or a LayerNorm. Eagerly every operation is
# a kernel that reads and writes the whole array, so the bytes grow with the chain and the
# intensity stays at about 1/8 FLOP/B; fused, the chain is one kernel that reads the input once
# and writes the output once, and each operation added moves it right on the roofline. The
# plans are the compiler's own (`fuse`, `plan_bytes`, `plan_flops`), computed for every length
# when the cell runs; the roofline is the one measured above.

# %% tags=["demo"]
from course.live import live

x_live = np.zeros((rows_r, 1024), np.float32)
w_live, b_live = np.ones(1024, np.float32), np.zeros(1024, np.float32)
TAILS = {"nothing": lambda x, w, b: x, "softmax": lambda x, w, b: softmax_fn(x), "layer norm": layer_norm_fn}
MAX_OPS = 24


def chain_graph(ops: int, then: str) -> Graph:
    """The optimised graph of `ops` pointwise operations (+ 0.5, * 1.5, tanh in turn), then TAILS[then]."""
    def chain(x, w, b):
        for i in range(ops):
            x = x + 0.5 if i % 3 == 0 else x * 1.5 if i % 3 == 1 else x.tanh()
        return TAILS[then](x, w, b)
    return optimize(trace(chain, x_live, w_live, b_live))


def plan_summary(g: Graph) -> dict:
    """FLOPs, and (kernels, bytes) of the eager and of the fused plan of g."""
    return {"flops": plan_flops(g), **{name: (len(p), sum(plan_bytes(g, p))) for name, p in
                                       (("eager", eager_plan(g)), ("fused", fuse(g)))}}


chains = {(n, then): plan_summary(chain_graph(n, then)) for then in TAILS for n in range(1, MAX_OPS + 1)}


def draw_fusion(ops: int, then: str):
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8),
                                   gridspec_kw=dict(left=0.07, right=0.98, bottom=0.14, wspace=0.22))
    here = chains[ops, then]
    for name, color in (("eager", "C3"), ("fused", "C0")):
        kernels, nbytes = here[name]
        ax0.plot(range(1, MAX_OPS + 1), [chains[n, then][name][1] / 1e6 for n in range(1, MAX_OPS + 1)],
                 "-", color=color, label=name)
        ax0.plot(ops, nbytes / 1e6, "o", color=color)
        intensity = here["flops"] / nbytes
        ax1.plot(intensity, min(peak, intensity * bw) / 1e9, "o", color=color, ms=9,
                 label=f"{name}: {kernels} kernel{'s' * (kernels > 1)}, {nbytes / 1e6:.0f} MB, "
                       f"at least {nbytes / bw * 1e3:.2f} ms")
    grid = np.geomspace(0.01, 1000, 50)
    ax1.loglog(grid, np.minimum(peak, grid * bw) / 1e9, "k-", lw=1.5)
    ax1.minorticks_off()  # these, plain tick labels (no mathtext) and no tight_layout: a quicker redraw
    ax1.xaxis.set_major_formatter("{x:g}")
    ax1.yaxis.set_major_formatter("{x:g}")
    ax0.set(xlabel="pointwise operations in the chain", ylabel="MB read + written", ylim=(0, None),
            title=f"{ops} pointwise ops, then {then}: bytes moved")
    ax1.set(xlabel="arithmetic intensity (FLOP / byte)", ylabel="GFLOP/s bound",
            title=f"this machine's roofline: {here['flops'] / 1e6:.0f} MFLOP")
    ax0.legend(fontsize=8)
    ax1.legend(fontsize=8, loc="lower right")
    return fig


live(draw_fusion, ops=(1, MAX_OPS), then=list(TAILS))

# %% [markdown]
# The speed table: `benchmarks/bench_compiler.py` (`make bench L=compiler`) times the whole block
# eagerly (minitorch with autograd recording), in NumPy, and compiled, at the tiny GPT's shape and
# 4x wider, with the bytes of each plan, the compile time and the cost of a cache hit. What it
# compiles: `block_speed` and the `compile` it calls are given, so in your notebook they come from
# minitorch/compiler.py, the course's reference compiler (the table's first line says which):
# it times the course's code, not yours, and runs before you have written any of it.
#
# The numbers are this machine's, measured now, and they move: on a machine shared with other
# work the same table has shown ratios several times apart from one run to the next. So the table
# prints the load average and the threads beside the times, each ratio as its range over rounds
# of runs interleaved with the other columns, and a busy machine is named as such; read the
# ratios, and run it again when the load is high. Where the compiled block wins, it is by running
# fewer, fused kernels (no per-operation tape, allocation and dispatch; intermediates in reused
# buffers), by running each fused loop at SIMD speed (`vexp`/`vtanh` inlined, biases read as
# contiguous rows) and by giving BLAS one GEMM of all B*T rows where eager minitorch makes one call
# per batch element. What is left is mostly matmul time, which no fusion changes: the profile below
# shows it, and the table's `matmul` column times the plan's library GEMMs alone. Eager minitorch
# runs the same GEMMs through the same BLAS, so `bound` = eager / matmul is the most any compiler
# that keeps them can gain (Amdahl's law); compare it across the two shapes: the wider the block,
# the larger the GEMMs' share. The fused kernels use all cores only from `PARALLEL_MIN` = 2**20
# elements: below that, waking the threads costs more than it saves, their spinning competes with
# BLAS's own threads, and on a machine shared with other work a parallel loop waits for its
# slowest thread ([fusion](../hardware_notes/fusion.md), "Where fusion stops").

# %%
#| export
#| given
def block_speed(batch: int, t: int, c: int, n_head: int = 4, rounds: int = 6, progress: Any = None) -> dict:
    """Times (s) of gpt_block at (batch, t, c), float32: eager, NumPy and compiled, interleaved over
    `rounds` rounds of 3 runs each; `eager`, `numpy`, `compiled` are the fastest run overall and
    `rounds` holds each round's fastest, per kind. Also bytes, kernels, compile time, guard cost, the
    1-minute load average before and after (`load`), and the library matmuls' time (`matmul`).
    progress: a progress bar (tqdm), updated once after the compilation and once per round."""
    import time

    from minitorch.bench import benchmark

    for name, value in (("batch", batch), ("t", t), ("c", c), ("n_head", n_head), ("rounds", rounds)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"block_speed: {name} must be an integer >= 1, got {value!r}")
    if c % n_head:
        raise ValueError(f"block_speed: c = {c} is not a multiple of n_head = {n_head}")
    load = [_load_average()]
    ws = gpt_block_weights(c, n_head, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((batch, t, c)).astype(np.float32)
    mask = additive_causal_mask(t)
    f = compile(gpt_block)
    args = [Tensor(x), Tensor(mask), *map(Tensor, ws)]
    with _cold_kernel_cache():  # the compile time itself (kernels new to this process), not a load from disk
        t0 = time.perf_counter()
        out = f(*args)
        t_compile = time.perf_counter() - t0
    if progress is not None:
        progress.update()
    leaves = [Tensor(x, requires_grad=True), Tensor(mask)] + [Tensor(w, requires_grad=True) for w in ws]
    want = gpt_block(*leaves).data
    per_round: dict[str, list[float]] = {"eager": [], "numpy": [], "compiled": []}
    for _ in range(rounds):
        per_round["eager"].append(benchmark(gpt_block, *leaves, repeat=3).min)
        per_round["numpy"].append(benchmark(gpt_block_numpy, x, mask, *ws, repeat=3).min)
        per_round["compiled"].append(benchmark(f, *args, repeat=3).min)
        if progress is not None:
            progress.update()
    g = optimize(trace(gpt_block, x, mask, *ws))
    plan = fuse(g)
    times: dict = {}  # the plan's library matmuls alone: what no fusion removes (eager runs the same GEMMs)
    run = build_kernels(trace(gpt_block, x, mask, *ws), times=times)
    for _ in range(3 * rounds):
        run(x, mask, *ws)
    matmul = sum(min(v) for (_, label), v in times.items() if label.startswith("library matmul"))
    load.append(_load_average())
    return dict(shape=(batch, t, c), err=float(np.abs(out.data - want).max()), compile=t_compile,
                guard=benchmark(guard_key, args, repeat=5, number=100).min, matmul=matmul,
                eager_bytes=sum(plan_bytes(g, eager_plan(g))), fused_bytes=sum(plan_bytes(g, plan)),
                eager_kernels=len(eager_plan(g)), fused_kernels=len(plan), rounds=per_round, load=tuple(load),
                **{k: min(v) for k, v in per_round.items()})


def _load_average() -> float:
    """The 1-minute load average (nan where the system has none, as on Windows)."""
    import os

    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return math.nan


def print_speed_table(results: Sequence[dict]) -> None:
    """The table of block_speed results: ms (the fastest run), ratios as the range over the rounds
    (each round's eager / compiled and NumPy / compiled), the matmul bound, kernels, MB, compile s,
    guard us, max error, the load average while the row was measured; the machine's threads above."""
    from minitorch.bench import load_report

    where = "the course's reference" if __name__ == "minitorch.compiler" else "this notebook's"
    print(f"gpt_block (causal attention, 4 heads + GELU MLP), float32; compiled: compile() of {where} compiler "
          f"({__name__})")
    print(f"now: {load_report()}")
    rounds = len(results[0]["rounds"]["eager"]) if results else 0
    print(f"times: the fastest run, ms; ratios: lowest-highest over {rounds} interleaved rounds of 3 runs "
          "(each round's fastest); load: the 1-minute load average before-after the row")
    print(f"{'shape':>14} {'eager':>8} {'NumPy':>8} {'compiled':>9} {'matmul':>7} {'eager/comp':>12} {'bound':>6} "
          f"{'NumPy/comp':>12} {'kernels':>9} {'MB eager':>9} {'MB fused':>9} {'compile s':>10} {'guard us':>9} "
          f"{'max err':>8} {'load':>9}")
    for r in results:
        rr = r["rounds"]
        ec = [e / c for e, c in zip(rr["eager"], rr["compiled"])]
        nc = [n / c for n, c in zip(rr["numpy"], rr["compiled"])]
        ratios = f"{min(ec):.1f}-{max(ec):.1f}x", f"{min(nc):.2f}-{max(nc):.2f}x"
        load = f"{r['load'][0]:.1f}-{r['load'][1]:.1f}"
        print(f"{str(r['shape']):>14} {1e3 * r['eager']:>8.2f} {1e3 * r['numpy']:>8.2f} {1e3 * r['compiled']:>9.2f} "
              f"{1e3 * r['matmul']:>7.2f} {ratios[0]:>12} {r['eager'] / r['matmul']:>5.1f}x {ratios[1]:>12} "
              f"{r['eager_kernels']:>4}->{r['fused_kernels']:<4} {r['eager_bytes'] / 1e6:>9.1f} "
              f"{r['fused_bytes'] / 1e6:>9.1f} {r['compile']:>10.2f} {1e6 * r['guard']:>9.1f} {r['err']:>8.1e} "
              f"{load:>9}")

# %% tags=["demo"]
shapes_s = [(2, 64, 64), (2, 64, 256)] if SMALL else [(8, 64, 64), (8, 64, 256)]
with tqdm(total=len(shapes_s) * 7, desc="compile + 6 rounds per shape") as bar:
    speeds = [block_speed(*sh, progress=bar) for sh in shapes_s]
print_speed_table(speeds)

# %% [markdown]
# Where the compiled block's time goes: `build_kernels(..., times=...)` (given) times each step
# of the plan; the cell sums them by kind (library matmuls, fused kernels with a reduction,
# pointwise-only fused kernels, layout copies) and lists the slowest kernels. Each time is shown as
# the fastest - median of the runs; the fastest runs add up to a little under one run of the
# whole block. Like the table, it profiles the compiler the given functions come from.

# %%
#| export
#| given
def block_profile(batch: int, t: int, c: int, n_head: int = 4, repeat: int = 20) -> dict:
    """{(k, label): [seconds of each run]} of each kernel of the compiled gpt_block at (batch, t, c),
    float32, over `repeat` runs."""
    if not isinstance(repeat, (int, np.integer)) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"block_profile: repeat must be an integer >= 1, got {repeat!r}")
    if c % n_head:
        raise ValueError(f"block_profile: c = {c} is not a multiple of n_head = {n_head}")
    ws = gpt_block_weights(c, n_head, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((batch, t, c)).astype(np.float32)
    mask = additive_causal_mask(t)
    times: dict = {}
    run = build_kernels(trace(gpt_block, x, mask, *ws), times=times)
    for _ in range(repeat):
        run(x, mask, *ws)
    return times


def print_profile(shape: tuple, prof: dict, top: int = 5) -> None:
    """The profile of block_profile: time by kind of kernel (fastest - median), then the `top`
    kernels slowest at their fastest run."""
    if not prof:
        raise ValueError(f"print_profile: prof holds no kernel's times (block_profile's dict), got {prof!r}")
    kinds: dict[str, list] = {}
    for (k, label), ts in prof.items():
        kind = label.split()[0] if not label.startswith("library") else label.split()[1]
        kinds.setdefault("layout" if kind == "transpose" else kind, []).append(ts)
    lo = {key: min(ts) for key, ts in prof.items()}
    total, total_med = sum(lo.values()), sum(float(np.median(ts)) for ts in prof.values())
    print(f"{shape}: {1e3 * total:.2f}-{1e3 * total_med:.2f} ms in {len(prof)} kernels ({len(next(iter(prof.values())))} runs); "
          + ", ".join(f"{kind} {1e3 * sum(map(min, tss)):.2f}-{1e3 * sum(float(np.median(t)) for t in tss):.2f} ms "
                      f"({len(tss)}, {100 * sum(map(min, tss)) / total:.0f}%)" for kind, tss in sorted(kinds.items())))
    for (k, label), t in sorted(lo.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {1e6 * t:8.0f}-{1e6 * float(np.median(prof[k, label])):.0f} us  kernel {k:<3} {label[:70]}")

# %% tags=["demo"]
from minitorch.bench import load_report  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

print(f"{load_report()}\nprofiled: {timed_compiler()}")
for sh in tqdm(shapes_s, desc="block shapes"):
    print_profile(sh, block_profile(*sh, repeat=5 if SMALL else 20))

# %% [markdown]
# ## What is left out
#
# - Symbolic shapes: every new shape retraces (torch.compile marks a dimension dynamic after it
#   changes once, and compiles one graph for all its sizes).
# - Splitting at a graph break: the whole function runs eagerly; TorchDynamo compiles the parts
#   before and after the break and runs only the break in Python.
# - Fusing into the matmul: a bias or activation epilogue fused into the GEMM kernel itself, applied
#   to each output tile while it is in registers (cuBLASLt epilogues, CUTLASS epilogue visitors,
#   TorchInductor's Triton templates). Here the epilogue runs in the next kernel, which reads the
#   matmul's output once, from the cache at these sizes. On the CPU the GEMM would have to be in
#   the generated code: Numba's `np.dot` needs SciPy's BLAS (not a course dependency), and a
#   generated triple loop is many times slower than OpenBLAS (lesson 06).
# - Horizontal fusion: the block's per-head q, k and v matmuls share their input `h`; one GEMM
#   with the weights concatenated (what `gpt_block_numpy` does by hand, and TorchInductor's
#   batch-fusion passes do for linear layers) would replace twelve small ones.
# - The block-per-row CUDA kernel with a shared-memory reduction for wide rows (lesson 08's
#   softmax).
# - Autograd through a graph break.

# %%
#| export
#| given
import inspect  # noqa: E402

from minitorch.checks import (Array, Attrs, Choice, Count, Instance, Int, Optional, Rule, Seq, Size,  # noqa: E402
                              TensorLike, Unchecked, describe, validate_public)

_ADDABLE = POINTWISE + REDUCTIONS + SIDE_EFFECTS + ("matmul", "transpose", "expand", "reshape", "astype")
_OPS = ("input", "const") + _ADDABLE


class _Duck(Attrs):
    """A Graph or a Node by its attributes, not its class: the tests grade one exercise with the
    others taken from another copy of this module (the reference's or the notebook's), whose graphs
    are instances of that copy's classes. Every pass makes a node per node, so a class once seen with
    the attributes is remembered (its __init__ sets them all): then the check is one set lookup."""

    def __init__(self, kind: str, *names: str):
        super().__init__(*names)
        self.must = f"a {kind} (an object with {', '.join(names)})"
        self.seen: set[type] = set()

    def __call__(self, what: str, name: str, value: Any) -> None:
        if type(value) in self.seen:
            return
        try:
            ok = all(hasattr(value, n) for n in self.names)
        except GraphBreak:  # a Proxy answers an attribute it lacks with a graph break
            ok = False
        if not ok:
            raise TypeError(f"{what}: {name} must be {self.must}, got {describe(value)}")
        self.seen.add(type(value))


class _Ducks(Rule):
    """A sequence of what `duck` accepts (Seq's rule and messages), with a fast path for a list or
    tuple of objects of classes seen before."""

    def __init__(self, duck: _Duck, min_len: int = 0):
        self.duck, self.min_len, self.slow = duck, min_len, Seq(duck, min_len=min_len)

    def __call__(self, what: str, name: str, value: Any) -> None:
        seen = self.duck.seen
        if type(value) in (list, tuple) and len(value) >= self.min_len and all(type(v) in seen for v in value):
            return
        self.slow(what, name, value)


class _Op(Rule):
    """One of the IR's ops (a str of the table)."""

    def __init__(self, ops: tuple[str, ...]):
        self.ops = frozenset(ops)

    def __call__(self, what: str, name: str, value: Any) -> None:
        if type(value) is str and value in self.ops:
            return
        kind = ValueError if isinstance(value, str) else TypeError
        raise kind(f"{what}: {name} must be an op of the IR ({', '.join(sorted(self.ops))}), got {describe(value)}")


class _Shape(Rule):
    """A shape: a tuple or list of integers >= 0 (a fast path for the tuple of ints every node passes)."""

    slow = Seq(Int(0))

    def __call__(self, what: str, name: str, value: Any) -> None:
        if type(value) is tuple and all(type(n) is int and n >= 0 for n in value):
            return
        self.slow(what, name, value)


class _FloatDType(Rule):
    """float32 or float64, as np.dtype reads it (np.float32, "float64", np.dtype(...)): the dtypes the
    compiler handles. A TypeError otherwise, None included (np.dtype(None) would be float64)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if isinstance(value, np.dtype) and value in FLOAT_DTYPES:
            return
        try:
            ok = value is not None and not isinstance(value, (bool, int, float)) and np.dtype(value) in FLOAT_DTYPES
        except (TypeError, ValueError):
            ok = False
        if not ok:  # describe() reads a NumPy type's shape descriptor as an array's: a type is shown by repr
            shown = repr(value) if isinstance(value, type) else describe(value)
            raise TypeError(f"{what}: {name} must be float32 or float64 (a dtype), got {shown}")


class _Real(Rule):
    """A real number, inf and nan included (a constant of the graph may be either: a -inf mask, the
    nan of a mean over nothing)."""

    finite = False  # the validation walk's markers: inf and nan are valid values here
    allow_nan = True

    def __call__(self, what: str, name: str, value: Any) -> None:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{what}: {name} must be a real number (inf and nan included), got {describe(value)}")


class _Domain(Rule):
    """A fused group's domain (R, C): a tuple of row sizes and the width, sizes >= 0."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        ok = (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple)
              and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0
                      for n in (*value[0], value[1])))
        if not ok:
            raise (TypeError if not isinstance(value, tuple) else ValueError)(
                f"{what}: {name} must be a domain (R, C): a tuple of row sizes and a width, got {describe(value)}")


class _Hashable(Rule):
    """A value that can be a dict's key (hash() succeeds: a tuple of lists cannot)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        try:
            hash(value)
        except TypeError:
            raise TypeError(f"{what}: {name} must be hashable (a cache key), got {describe(value)}") from None


class _Identifier(Rule):
    """The name of a generated function: a Python/C identifier."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, str):
            raise TypeError(f"{what}: {name} must be a str (a kernel's name), got {describe(value)}")
        if not value.isidentifier():
            raise ValueError(f"{what}: {name} must be an identifier (a kernel's name), got {value!r}")


class _Keys(Rule):
    """A dict with (at least) these keys."""

    def __init__(self, *keys: str):
        self.keys = keys

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"{what}: {name} must be a dict, got {describe(value)}")
        missing = [k for k in self.keys if k not in value]
        if missing:
            raise ValueError(f"{what}: {name} must be a dict with {', '.join(self.keys)}; it has no "
                             f"{', '.join(missing)}: got {describe(value)}")


_GRAPH = _Duck("Graph", "nodes", "inputs", "outputs")
_NODE = _Duck("Node", "op", "inputs", "attrs", "shape", "dtype")
_NODES, _GROUP = _Ducks(_NODE), _Ducks(_NODE, min_len=1)
_DTYPE, _SHAPE, _NAME = _FloatDType(), _Shape(), _Identifier()
# a parameter's hint -> its rule, for every public function and method (graphs and nodes by duck type)
_BY_HINT = {"Graph": _GRAPH, "Node": _NODE, "Sequence[Node]": _NODES, "Sequence[Sequence[Node]]": Seq(_NODES),
            "Sequence[Sequence[Node]] | None": Optional(Seq(_NODES)), "tuple[tuple, int]": _Domain(),
            "DTypeLike": _DTYPE}


def _rules_by_hint(namespace: dict) -> dict[str, dict[str, Rule]]:
    """{"function" or "Class.method": {parameter: rule}} for the parameters whose hints _BY_HINT names."""
    rules: dict[str, dict[str, Rule]] = {}
    for name, obj in list(namespace.items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != namespace["__name__"]:
            continue
        members = [(name, obj)] if inspect.isfunction(obj) else []
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            members = [(name if m == "__init__" else f"{name}.{m}", f) for m, f in vars(obj).items()
                       if inspect.isfunction(f) and (m == "__init__" or not m.startswith("_"))]
        for key, fn in members:
            for p in inspect.signature(inspect.unwrap(fn)).parameters.values():
                if p.annotation in _BY_HINT:
                    rules.setdefault(key, {})[p.name] = _BY_HINT[p.annotation]
    return rules


_SPEED_KEYS = ("shape", "rounds", "eager", "numpy", "compiled", "matmul", "eager_kernels", "fused_kernels",
               "eager_bytes", "fused_bytes", "compile", "guard", "err", "load")
_COMPILER_RULES = _rules_by_hint(globals())
for _key, _rules in {
    "Node": {"op": _Op(_OPS), "attrs": Instance(dict), "shape": _SHAPE},
    "Graph.add_input": {"shape": _SHAPE},
    "Graph.add_const": {"value": _Real()},
    "Graph.add": {"op": _Op(_ADDABLE), "attrs": Optional(Instance(dict))},
    "Graph.count": {"op": Optional(_Op(_OPS))},
    "infer_meta": {"op": _Op(_ADDABLE), "shapes": Seq(_SHAPE), "dtypes": Seq(_DTYPE), "attrs": Instance(dict)},
    "domain": {"group": _GROUP},
    "kernel_io": {"group": _GROUP},
    "row_view": {"a": Array(dtypes="real"), "node_shape": _SHAPE},  # a layout view: of element ids too
    "py_literal": {"value": _Real()},
    "c_literal": {"value": _Real()},
    "c_func": {"op": Choice(*C_FUNCS)},
    # called by the generated kernels, and by Numba through their @overload, which finds them by
    # identity: never wrapped (their Python bodies check their arguments)
    "vexp": {"x": Unchecked()}, "vtanh": {"x": Unchecked()}, "vrelu": {"x": Unchecked()},
    "vmax": {"a": Unchecked(), "b": Unchecked()},
    "numba_source": {"group": _GROUP, "name": _NAME},
    "cuda_source": {"group": _GROUP, "name": _NAME},
    "compile_numba": {"name": _NAME},
    "build_kernels": {"log": Optional(Instance(list)), "times": Optional(Instance(dict))},
    "cuda_runner": {"block": Int(1, 1024), "device": Choice("emulator", "gpu")},
    "grad_graph": {"wrt": Optional(Seq(Int(0)))},
    "compile_grad": {"wrt": Optional(Seq(Int(0)))},
    "Autotuner": {"repeat": Unchecked()},  # checked in __init__: a ValueError for every bad repeat (the tests')
    "Autotuner.tune": {"key": _Hashable(), "candidates": Seq(min_len=1)},
    "tuned_kernels": {"tuner": Attrs("tune"), "candidates": Seq(Int(0), min_len=1)},
    "gpt_block_weights": {"c": Size, "n_head": Size},
    "additive_causal_mask": {"t": Count},
    "gpt_block": {"x": TensorLike(ndim=3, dtypes="float", axes="(B, T, C)"),
                  "mask": TensorLike(ndim=2, dtypes="float", axes="(T, T)")},
    "gpt_block_numpy": {"x": Array(ndim=3, dtypes="float", axes="(B, T, C)"),
                        "mask": Array(ndim=2, dtypes="float", axes="(T, T)")},
    "block_speed": {**{n: Size for n in ("batch", "t", "c", "n_head", "rounds")},
                    "progress": Optional(Attrs("update"))},
    "block_profile": {n: Size for n in ("batch", "t", "c", "n_head", "repeat")},
    "print_speed_table": {"results": Seq(_Keys(*_SPEED_KEYS))},
    "print_profile": {"shape": _SHAPE, "prof": Instance(dict), "top": Count},
}.items():
    _COMPILER_RULES.setdefault(_key, {}).update(_rules)
validate_public(globals(), _COMPILER_RULES)
causal_mask = additive_causal_mask   # its name before it was told apart from lesson 09's boolean causal_mask
