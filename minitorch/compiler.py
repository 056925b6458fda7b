# Generated from solutions/14_compiler.py by `make build`. Do not edit.
"""minitorch.compiler: a small deep-learning compiler. Capture minitorch code into a graph
(tracing with proxies, guards, graph breaks), passes (shape/dtype propagation, DCE, CSE, constant
folding, simplification), fusion into kernels with their byte counts, and code generation (Numba
source run on the CPU, CUDA C for the GPU)."""
from __future__ import annotations

import builtins
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numba import njit

from minitorch import tensor as _t
from minitorch.autograd import Tensor


FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
UNARY = ("neg", "exp", "log", "tanh", "relu", "sqrt")
BINARY = ("add", "sub", "mul", "div", "pow")
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

    def __init__(self, op: str, inputs: Sequence[Node], attrs: dict, shape: tuple, dtype: Any):
        self.op, self.inputs, self.attrs = op, tuple(inputs), dict(attrs)
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)

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

    def add_input(self, name: str, shape: tuple, dtype: Any) -> Node:
        node = Node("input", (), {"name": name}, shape, dtype)
        self.nodes.append(node)
        self.inputs.append(node)
        return node

    def add_const(self, value: float, dtype: Any) -> Node:
        node = Node("const", (), {"value": float(value)}, (), dtype)
        self.nodes.append(node)
        return node

    def add(self, op: str, inputs: Sequence[Node], attrs: dict | None = None) -> Node:
        attrs = dict(attrs or {})
        shape, dtype = infer_meta(op, [i.shape for i in inputs], [i.dtype for i in inputs], attrs)
        node = Node(op, inputs, attrs, shape, dtype)
        self.nodes.append(node)
        return node

    def copy_node(self, node: Node, inputs: Sequence[Node]) -> Node:
        """A copy of `node` (op, attrs, shape, dtype) reading `inputs`, appended to this graph."""
        new = Node(node.op, inputs, node.attrs, node.shape, node.dtype)
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


def _where() -> str:
    """file:line of the traced code that called into the proxy."""
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__") == __name__ and f.f_code.co_name != "<module>":
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

    def _reduce(self, op: str, axis: Any, keepdims: bool) -> Proxy:
        if axis is None or isinstance(axis, (tuple, list)):
            raise GraphBreak(f"{op}(axis={axis!r}) at {_where()}: the compiler reduces over one axis only")
        return self._op(op, axis=int(axis), keepdims=bool(keepdims))

    def sum(self, axis: Any = None, keepdims: bool = False) -> Proxy:
        return self._reduce("sum", axis, keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> Proxy:
        return self._reduce("max", axis, keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Proxy:
        total = self._reduce("sum", axis, keepdims)
        return total * (1.0 / self.shape[int(axis)])

    def __bool__(self) -> bool:
        raise GraphBreak(f"data-dependent control flow: bool() of a traced tensor at {_where()}")

    def _value(self, *args: Any, **kwargs: Any) -> Any:
        raise GraphBreak(f"reading a traced tensor's value at {_where()}")

    __float__ = __int__ = __index__ = item = numpy = _value
    __lt__ = __le__ = __gt__ = __ge__ = lambda self, o: self._value()  # noqa: E731

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise GraphBreak(f"`.{name}` is not supported by the tracer (at {_where()})")


def probe(x: Any, label: str = "") -> None:
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
        kept = shape[:axis] + ((1,) if attrs.get("keepdims") else ()) + shape[axis + 1:]
        return kept, np.dtype(dtypes[0])
    if op == "matmul":
        a, b = shapes
        if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
            raise ValueError(f"matmul: shapes {a} and {b} do not fit (..., n, k) @ (..., k, m)")
        return broadcast_shapes(op, a[:-2], b[:-2]) + (a[-2], b[-1]), np.result_type(*dtypes)
    raise ValueError(f"infer_meta: unknown op {op!r}")


def interpret(graph: Graph) -> Callable[..., list[np.ndarray]]:
    """A runner that executes `graph` node by node with NumPy: the eager reference, one array
    per node. runner(*arrays) -> [output arrays]; the arrays are the graph's inputs in order."""
    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        env: dict[Node, np.ndarray] = {}
        for node, a in zip(graph.inputs, arrays):
            env[node] = np.asarray(a)
        for n in graph.nodes:
            if n.op == "input":
                continue
            if n.op == "const":
                env[n] = np.asarray(n.attrs["value"], dtype=n.dtype)
            else:
                env[n] = np.asarray(numpy_op(n, *(env[i] for i in n.inputs)), dtype=n.dtype)
        return [env[o] for o in graph.outputs]

    return run


def numpy_op(n: Node, *xs: np.ndarray) -> np.ndarray:
    """What node n computes, in NumPy (a probe prints, and passes its input on)."""
    if n.op == "probe":
        print(f"probe {n.attrs['label']}: shape {xs[0].shape}, mean {xs[0].mean():.6g}")
        return xs[0]
    if n.op in REDUCTIONS:
        return getattr(np, "max" if n.op == "max" else "sum")(xs[0], axis=n.attrs["axis"], keepdims=n.attrs["keepdims"])
    fn = {"neg": np.negative, "exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt,
          "relu": lambda a: np.maximum(a, 0), "add": np.add, "sub": np.subtract, "mul": np.multiply,
          "div": np.divide, "pow": np.power, "matmul": np.matmul}[n.op]
    return fn(*xs)


def guard_key(args: Sequence[Any]) -> tuple:
    """The cache key of a call: per argument ("tensor", shape, dtype) for a minitorch Tensor or a
    NumPy array, ("value", type, value) for anything else."""
    key = []
    for a in args:
        if isinstance(a, (_t.Tensor, np.ndarray)):
            key.append(("tensor", tuple(a.shape), np.dtype(a.dtype).str))
        else:
            key.append(("value", type(a).__name__, a))
    return tuple(key)


class Compiled:
    """fn compiled on first call per guard key. compiles: how many graphs were built; breaks: the
    graph breaks' messages; cache: {key: runner, or None for eager}."""

    def __init__(self, fn: Callable, backend: Callable[[Graph], Callable] = interpret):
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
    if first.op not in POINTWISE:
        return None
    return (first.shape[:-1], first.shape[-1]) if first.shape else ((), 1)


def fits(node: Node, dom: tuple[tuple, int]) -> str | None:
    """"full", "row" or None: how `node` fits a group of domain dom = (R, C)."""
    rows, width = dom
    if node.op in REDUCTIONS:
        shape = node.inputs[0].shape
        last = node.attrs["axis"] % len(shape) == len(shape) - 1 if shape else False
        return "row" if last and shape == rows + (width,) else None
    if node.op not in POINTWISE:
        return None
    if node.shape == rows + (width,):
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
        for g, nodes in enumerate(groups):
            if g not in placed and all(group_of.get(i, g) in placed or group_of.get(i, g) == g
                                       for n in nodes for i in n.inputs):
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


def row_view(a: np.ndarray, node_shape: tuple, dom: tuple[tuple, int], per_row: bool) -> np.ndarray:
    """a (of shape node_shape) as a 2-D (rows, C) or (rows, 1) array over domain dom, broadcast, not copied where NumPy can."""
    rows, width = dom
    target = rows + ((1,) if per_row else (width,))
    if per_row and node_shape == rows:  # a reduction without keepdims
        a = a.reshape(rows + (1,))
    return np.broadcast_to(a, target).reshape(math.prod(rows), target[-1])


def per_row(node: Node, dom: tuple[tuple, int]) -> bool:
    """Does this read or write hold one value per row (else one per column)?"""
    if node.op in REDUCTIONS and fits(node, dom) == "row":
        return True
    return not node.shape or node.shape[-1] == 1 and dom[1] != 1 or node.shape == dom[0] + (1,)


PY_OPS = {"neg": "(-{0})", "exp": "math.exp({0})", "log": "math.log({0})", "tanh": "math.tanh({0})",
          "sqrt": "math.sqrt({0})", "relu": "max({0}, 0.0)", "add": "({0} + {1})", "sub": "({0} - {1})",
          "mul": "({0} * {1})", "div": "({0} / {1})", "pow": "({0} ** {1})"}


def numba_source(graph: Graph, group: Sequence[Node], name: str) -> str:
    """Python source of the kernel `name(rows, C, in0, ..., out0, ...)` for one fused group."""
    dom = domain(group)
    reads, writes = kernel_io(graph, group)
    arg = {n: f"in{k}" for k, n in enumerate(reads)}
    out = {n: f"out{k}" for k, n in enumerate(writes)}
    var = {n: f"v{k}" for k, n in enumerate(group)}
    inside = set(group)
    lines = [f"def {name}(rows, C, {', '.join(list(arg.values()) + list(out.values()))}):",
             "    for r in range(rows):"]

    def ref(n: Node) -> str:
        if n.op == "const":
            return repr(float(n.attrs["value"]))
        if n in inside:
            return var[n]
        return f"{arg[n]}[r, 0]" if per_row(n, dom) else f"{arg[n]}[r, c]"

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
            lines.append(f"        {var[n]} = {'0.0' if n.op == 'sum' else '-math.inf'}")
            lines.append("        for c in range(C):")
            emit_full(x, set(), lines)
            step = f"{var[n]} + {ref(x)}" if n.op == "sum" else f"max({var[n]}, {ref(x)})"
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


def compile_numba(source: str, name: str) -> Callable:
    """exec `source` and njit the function `name` it defines."""
    scope: dict[str, Any] = {"math": math}
    exec(builtins.compile(source, f"<kernel {name}>", "exec"), scope)  # noqa: S102 - our own generated code
    return njit(cache=False)(scope[name])


def build_kernels(graph: Graph, source_fn: Callable | None = None, log: list | None = None) -> Callable:
    """The compiled runner of `graph`: optimize, fuse, generate (numba_source by default) and
    compile every fused group. `log`, if given, receives (kernel name, reads, writes) for each
    kernel run: the arrays (rows, C views) it was passed."""
    source_fn = source_fn or numba_source
    graph = optimize(graph)
    plan = fuse(graph)
    steps = []
    for k, group in enumerate(plan):
        dom = domain(group)
        reads, writes = kernel_io(graph, group)
        if dom is None:
            steps.append((None, group, reads, writes, None))
        else:
            name = f"kernel{k}"
            steps.append((compile_numba(source_fn(graph, group, name), name), group, reads, writes, dom))

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        env: dict[Node, np.ndarray] = {n: np.asarray(a) for n, a in zip(graph.inputs, arrays)}
        for n in graph.nodes:
            if n.op == "const":
                env[n] = np.asarray(n.attrs["value"], dtype=n.dtype)
        for k, (kernel, group, reads, writes, dom) in enumerate(steps):
            if kernel is None:
                (n,) = group
                env[n] = np.asarray(numpy_op(n, *(env[i] for i in n.inputs)), dtype=n.dtype)
                if log is not None:
                    log.append((f"library {n.op}", [env[i] for i in n.inputs if i.op != "const"], [env[n]]))
                continue
            ins = [row_view(env[n], n.shape, dom, per_row(n, dom)) for n in reads]
            for n in writes:
                env[n] = np.empty(n.shape, n.dtype)
            outs = [env[n].reshape(math.prod(dom[0]), 1 if per_row(n, dom) else dom[1]) for n in writes]
            kernel(math.prod(dom[0]), dom[1], *ins, *outs)
            if log is not None:
                log.append((f"kernel{k}", ins, outs))
        return [env[o] for o in graph.outputs]

    run.graph, run.plan = graph, plan
    return run


def compile(fn: Callable) -> Compiled:  # noqa: A001 - the name torch.compile uses
    """fn, compiled: traced per guard key, optimized, fused, generated as Numba kernels."""
    return Compiled(fn, backend=build_kernels)
