# Generated from solutions/14_compiler.py by `make build`. Do not edit.
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


def broadcast_shapes(what: str, a: tuple, b: tuple) -> tuple:
    """NumPy's broadcast of two shapes (a helper for infer_meta; ValueError naming both)."""
    if not isinstance(what, str):
        raise TypeError(f"broadcast_shapes: what must be a str (the op, for messages), got {what!r}")
    for name, shape in (("a", a), ("b", b)):
        if not isinstance(shape, (tuple, list)) or not all(isinstance(n, (int, np.integer)) and n >= 0 for n in shape):
            raise ValueError(f"broadcast_shapes({what}): {name} must be a shape (a tuple of sizes >= 0), got {shape!r}")
    a0, b0 = tuple(a), tuple(b)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError(f"{what}: shapes {a0} and {b0} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)


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


def guard_key(args: Sequence[Any]) -> tuple:
    """The cache key of a call: per argument ("tensor", shape, dtype.str) for a minitorch Tensor or
    a NumPy array, ("value", type name, repr(value)) for anything else (NaN is one key, -0.0 and
    0.0 are two)."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"guard_key: args must be the call's arguments as a tuple or list, got {type(args).__name__}")
    key = []
    for a in args:
        if isinstance(a, (_t.Tensor, np.ndarray)):
            key.append(("tensor", tuple(a.shape), np.dtype(a.dtype).str))
        else:
            key.append(("value", type(a).__name__, repr(a)))
    return tuple(key)


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


def dce(graph: Graph) -> Graph:
    """The graph without the nodes that reach no output and no side effect (inputs are kept)."""
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


def cse(graph: Graph) -> Graph:
    """The graph with each set of identical nodes (op, inputs, attrs, shape, dtype) merged into its
    first; inputs and side effects are never merged."""
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


def fold_constants(graph: Graph) -> Graph:
    """The graph with every pointwise node whose inputs are all constants replaced by a constant."""
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


def simplify(graph: Graph) -> Graph:
    """The graph with x*1, 1*x, x+0, 0+x, x-0, x/1, x**1 and -(-x) replaced by x (when x has the
    node's shape and dtype)."""
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


def optimize(graph: Graph) -> Graph:
    """The pass pipeline compile() runs: CSE, folding, simplification, CSE again, DCE."""
    return dce(cse(simplify(fold_constants(cse(graph)))))


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


def fuse(graph: Graph) -> list[list[Node]]:
    """The fusion plan: groups of nodes, each one kernel (see the rule above)."""
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


def kernel_io(graph: Graph, group: Sequence[Node]) -> tuple[list[Node], list[Node]]:
    """(reads, writes) of one kernel: the non-constant nodes outside the group its nodes use, and
    its nodes used outside it or returned by the graph; each list in graph order, no repeats."""
    inside = set(group)
    users = graph.users()
    used = {i for n in group for i in n.inputs if i not in inside and i.op != "const"}
    outs = set(graph.outputs)
    written = {n for n in group if n in outs or any(u not in inside for u in users.get(n, ()))}
    return [n for n in graph.nodes if n in used], [n for n in graph.nodes if n in written]


def plan_buffers(graph: Graph, plan: Sequence[Sequence[Node]]) -> dict[Node, int]:
    """{node: buffer number} for every node a kernel of `plan` writes (kernel_io) that is not a
    graph output. Two nodes share a buffer only if they have the same size and dtype and the first
    one's last reader runs before the second one's kernel."""
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


def numba_source(graph: Graph, group: Sequence[Node], name: str) -> str:
    """Python source of the kernel `name(rows, C, in0, ..., out0, ...)` for one fused group."""
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


def cuda_source(graph: Graph, group: Sequence[Node], name: str) -> str:
    """CUDA C source of the kernel `name(int rows, int C, const T* in0, ..., T* out0, ...)` for one
    fused group: one thread per row, the Numba kernel's loops over the columns."""
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
