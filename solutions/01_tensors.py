# %% [markdown]
# # Lesson 01: tensors
#
# A tensor is two things: a flat block of memory (the *storage*) and a recipe for reading it
# as an n-dimensional array (the *layout*: shape, strides, offset). Almost everything a
# framework does cheaply (transpose, slicing, broadcasting, `reshape` of contiguous data) is a
# change of recipe that moves no data. Everything expensive (a copy, a reduction, a matmul)
# walks the storage, and how fast it walks depends on whether the recipe visits memory in
# order. This lesson builds the recipe by hand and checks every step against NumPy, then wraps
# NumPy arrays in a `Tensor` class that the rest of the course builds on.
#
# You will write:
#
# 1. `strides_for`, `index_to_offset`: row-major strides and the address of one element.
# 2. `gather`: read an arbitrary strided view out of a flat storage, element by element.
# 3. `transpose_layout`, `slice_layout`, `is_contiguous`: views as stride arithmetic.
# 4. `broadcast_shape`: NumPy's broadcasting rule.
# 5. `broadcast_strides`: broadcasting as a view with zero strides.
# 6. `normalize_axis`: the axis argument of every reduction, with clear errors.
# 7. `Tensor._binary`: elementwise arithmetic with broadcasting, type and device checks.
#
# The course's reference version of this lesson is `minitorch/tensor.py`; later lessons import
# it, so they work whether or not you finish this one. Lesson 02 subclasses its `Tensor` to add
# autograd, lesson 06 plugs in a Numba matmul and lesson 08 a CuPy (GPU) array backend, all
# without editing this module: the extension points are listed in section 7.
# Background: [memory layout](../hardware_notes/memory_layout.md) (row-major storage,
# strides, contiguity), [cache lines](../hardware_notes/caches.md#cache-lines) (why the order of
# a walk through memory matters) and [number formats](../hardware_notes/number_formats.md)
# (the dtypes a `Tensor` accepts and how they promote).

# %%
#| default_exp tensor
#| export
"""minitorch.tensor: storage, strides, broadcasting and the Tensor class."""
from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from minitorch.checks import check_int

# %%
import os

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %% [markdown]
# Every public function of minitorch checks its arguments before it runs: a wrong type, a NaN, a
# size of 0 or an array with the wrong number of axes is refused with an error that names the
# function, the parameter and the value, never a NumPy traceback from deep inside or a silent wrong
# answer. The contract is the signature: type hints, plus a rule where a hint says too little (a
# size >= 1, a fraction in [0, 1]). The machinery is given (`minitorch/checks.py`); each module
# ends by applying it to its own public functions.

# %%
#| export checks
#| given
"""minitorch.checks: argument validation shared by every module of minitorch.

Each public function of the package states its contract in its signature: the type hints, plus,
where a hint is not enough, a rule (a size >= 1, a fraction in [0, 1], an array of two axes).
`validate_public(globals(), RULES)` at the end of a module wraps each public function and method
so that a bad argument is refused before the body runs, with a TypeError or ValueError that names
the function, the parameter and the value:

    top_k_gating: k must be an integer >= 1, got 2.5
    Engine: num_blocks must be an integer >= 1, got 0
    attention: q must be an array of 4 axes (B, H, T, D), got an array of shape (2, 3) and dtype float64

The helpers (`check_int`, `check_number`, `check_array`, ...) are also called directly where a
check depends on other arguments (k <= the number of experts, two shapes that must agree).
Defaults are trusted: only arguments the caller passed are checked. The course's validation walk
(course/validation_walk.py) calls every public function with the bad values of each parameter's
kind and fails `make check` where one gets through.
"""
from __future__ import annotations

import functools
import inspect
import math
import re
import typing
from typing import Any, Callable

import numpy as np

__all__ = ["Rule", "Int", "Number", "Bool", "Str", "Choice", "Array", "TensorLike", "Instance", "Attrs", "Func", "Seq",
           "Optional", "AnyOf", "Unchecked", "HashableKey", "FloatDType", "Size", "Count", "Fraction", "Positive", "NonNegative",
           "check_int", "check_number", "check_bool", "check_choice", "check_array", "check_callable",
           "check_instance", "describe", "validate_public", "rule_for_hint"]


def describe(value: Any) -> str:
    """A value as an error message shows it: an array by shape and dtype, anything else by a short repr."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, (np.generic, type)):
        return f"a {type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    if isinstance(value, (list, tuple, dict, set)) or value is None or isinstance(value, (bool, int, float, str, np.generic)):
        return text
    return f"{text} ({type(value).__name__})"


def _fail(exc: type, what: str, name: str, must: str, value: Any) -> None:
    raise exc(f"{what}: {name} must be {must}, got {describe(value)}")


class Rule:
    """A contract for one argument: `rule(what, name, value)` returns None or raises TypeError or
    ValueError naming `what` (the function), `name` (the parameter) and the value."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        raise NotImplementedError

    def __or__(self, other: Rule) -> Rule:
        return AnyOf(self, other)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _bounds(lo: Any, hi: Any, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi}"
    return ""


class Int(Rule):
    """An integer (Python or NumPy, not a bool), optionally in [lo, hi]."""

    def __init__(self, lo: int | None = None, hi: int | None = None):
        self.lo, self.hi = lo, hi
        bounds = _bounds(lo, hi)
        self.must = "an integer" + (" " + bounds if bounds else "")

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not _is_int(value):
            _fail(TypeError, what, name, self.must, value)
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            _fail(ValueError, what, name, self.must, value)


class Number(Rule):
    """A real number (int or float, Python or NumPy, not a bool); finite unless finite=False (NaN
    is never accepted); optionally within bounds (open or closed)."""

    def __init__(self, lo: float | None = None, hi: float | None = None, finite: bool = True,
                 lo_open: bool = False, hi_open: bool = False):
        self.lo, self.hi, self.finite, self.lo_open, self.hi_open = lo, hi, finite, lo_open, hi_open
        bounds = _bounds(lo, hi, lo_open, hi_open)
        self.must = ("a finite number" if finite else "a number, not NaN") + (" " + bounds if bounds else "")

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not _is_real(value):
            _fail(TypeError, what, name, self.must, value)
        v = float(value)
        if math.isnan(v) or (self.finite and math.isinf(v)):
            _fail(ValueError, what, name, self.must, value)
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            _fail(ValueError, what, name, self.must, value)
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            _fail(ValueError, what, name, self.must, value)


class Bool(Rule):
    """True or False (a Python or NumPy bool)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, (bool, np.bool_)):
            _fail(TypeError, what, name, "True or False", value)


class Str(Rule):
    """A str."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, str):
            _fail(TypeError, what, name, "a str", value)


class Choice(Rule):
    """One of the given options (compared with ==)."""

    def __init__(self, *options: Any):
        self.options = options
        self.must = "one of " + ", ".join(repr(o) for o in options)
        self._strs = frozenset(o for o in options if type(o) is str)

    def __call__(self, what: str, name: str, value: Any) -> None:
        if type(value) is str and value in self._strs:
            return
        try:
            ok = any(type(value) is type(o) and value == o for o in self.options)
        except Exception:  # noqa: BLE001 - an array compared with a str
            ok = False
        if not ok:
            _fail(ValueError if isinstance(value, str) else TypeError, what, name, self.must, value)


_FLOAT_KINDS = {"float": "f", "int": "iu", "real": "fiu", "bool": "b", "number": "fiub"}


class Array(Rule):
    """An array-like of real numbers (an ndarray, or a list/tuple/number NumPy reads as one); with
    ndim, exactly that many axes (an int or a tuple of allowed counts); with dtypes, one of them
    ("float" = any floating dtype, "int" = any integer dtype, "real" = either, or NumPy dtypes;
    a list is read as NumPy reads it); never complex, object, bytes or str unless dtypes="any"."""

    def __init__(self, ndim: int | tuple[int, ...] | None = None, dtypes: Any = None, axes: str = ""):
        self.ndim = (ndim,) if isinstance(ndim, int) else ndim
        if isinstance(dtypes, (str, type, np.dtype)):
            dtypes = (dtypes,)
        self.dtypes = tuple(dtypes) if dtypes is not None else None
        self.axes = axes
        parts = "an array"
        if self.ndim is not None:
            n = " or ".join(str(d) for d in self.ndim)
            parts += f" of {n} ax{'is' if self.ndim == (1,) else 'es'}" + (f" {axes}" if axes else "")
        if self.dtypes is not None and self.dtypes != ("any",):
            parts += " of dtype " + " or ".join(d if isinstance(d, str) else np.dtype(d).name for d in self.dtypes)
        self.must = parts

    def _dtype_ok(self, dtype: np.dtype) -> bool:
        if self.dtypes == ("any",):
            return True
        if dtype.kind in "cOSUVMm":
            return False
        if self.dtypes is None:
            return True
        for d in self.dtypes:
            if isinstance(d, str) and d in _FLOAT_KINDS:
                if dtype.kind in _FLOAT_KINDS[d]:
                    return True
            elif dtype == np.dtype(d):
                return True
        return False

    def __call__(self, what: str, name: str, value: Any) -> None:
        if isinstance(value, np.ndarray) or (hasattr(value, "__array_namespace__") or hasattr(value, "__cuda_array_interface__")):
            dtype, ndim = value.dtype, value.ndim  # NumPy's, or another library's array (CuPy's): not converted
        elif value is None or isinstance(value, (str, bytes, dict, set)) or callable(value):
            _fail(TypeError, what, name, self.must, value)
        else:
            try:
                arr = np.asarray(value)
            except Exception:  # noqa: BLE001 - ragged lists and the like
                _fail(TypeError, what, name, self.must, value)
            dtype, ndim = arr.dtype, arr.ndim
            if dtype.kind == "O":
                _fail(TypeError, what, name, self.must, value)
        if not self._dtype_ok(dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)):
            _fail(TypeError, what, name, self.must, value)
        if self.ndim is not None and ndim not in self.ndim:
            shown = value if isinstance(value, np.ndarray) else f"{describe(value)} (shape {np.shape(value)})"
            raise ValueError(f"{what}: {name} must be {self.must}, got {describe(shown) if shown is value else shown}")


class TensorLike(Array):
    """A Tensor of minitorch (any class with `shape`, `dtype` and `numpy()`), or an array-like
    (Array's rule), with optional ndim and dtypes."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if hasattr(value, "numpy") and hasattr(value, "shape") and hasattr(value, "dtype") \
                and not isinstance(value, np.ndarray):
            dtype = np.dtype(value.dtype) if not isinstance(value.dtype, np.dtype) else value.dtype
            if not self._dtype_ok(dtype) or (self.ndim is not None and len(value.shape) not in self.ndim):
                _fail(TypeError if not self._dtype_ok(dtype) else ValueError, what, name, self.must, value)
            return
        Array.__call__(self, what, name, value)


class Instance(Rule):
    """An instance of one of the given classes."""

    def __init__(self, *classes: type, must: str | None = None):
        self.classes = classes
        self.must = must or " or ".join(("an " if c.__name__[0] in "AEIOU" else "a ") + c.__name__ for c in classes)

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, self.classes):
            _fail(TypeError, what, name, self.must, value)


class Attrs(Rule):
    """Any object with the given attributes (a duck-typed node of a graph, a model)."""

    def __init__(self, *names: str):
        self.names = names
        self.must = "an object with " + ", ".join(f"`{n}`" for n in names)

    def __call__(self, what: str, name: str, value: Any) -> None:
        for n in self.names:
            try:
                getattr(value, n)
            except Exception:  # noqa: BLE001 - AttributeError, or a traced value's graph break
                _fail(TypeError, what, name, self.must, value)


class HashableKey(Rule):
    """A value usable as a dict key (a sequence id, a cache key): hashable, and not a bool."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        try:
            hash(value)
        except TypeError:
            _fail(TypeError, what, name, "hashable", value)
        if isinstance(value, (bool, np.bool_)):
            _fail(TypeError, what, name, "hashable and not a bool", value)


class FloatDType(Rule):
    """A floating-point dtype (np.float32, "float64", np.dtype(np.float16), ...), optionally one of `allowed`."""

    def __init__(self, *allowed: Any):
        self.allowed = tuple(np.dtype(a) for a in allowed)
        self.must = "a floating-point dtype" + (
            " (" + ", ".join(a.name for a in self.allowed) + ")" if self.allowed else "")

    def __call__(self, what: str, name: str, value: Any) -> None:
        try:
            dt = np.dtype(value) if value is not None else None  # np.dtype(None) would be float64
        except Exception:  # noqa: BLE001 - not a dtype at all
            dt = None
        if dt is None:
            _fail(TypeError, what, name, self.must, value)
        if isinstance(value, bool) or dt.kind != "f" or (self.allowed and dt not in self.allowed):
            _fail(TypeError, what, name, self.must, value)


class Func(Rule):
    """Something callable."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not callable(value):
            _fail(TypeError, what, name, "callable", value)


class Seq(Rule):
    """A list, tuple or 1-D array (not a str), each item checked by `item` if given, with at least
    `min_len` items."""

    def __init__(self, item: Rule | None = None, min_len: int = 0):
        self.item, self.min_len = item, min_len
        self.must = "a sequence" + (f" of at least {min_len} items" if min_len else "")

    def __call__(self, what: str, name: str, value: Any) -> None:
        if isinstance(value, np.ndarray):
            if value.ndim != 1:
                _fail(ValueError, what, name, self.must + " (1-D)", value)
        elif not isinstance(value, (list, tuple, range)):
            _fail(TypeError, what, name, self.must, value)
        if len(value) < self.min_len:
            _fail(ValueError, what, name, self.must, value)
        if self.item is not None:
            if isinstance(self.item, Int) and type(value) is tuple and all(type(v) is int for v in value) and \
                    (self.item.lo is None or all(v >= self.item.lo for v in value)) and \
                    (self.item.hi is None or all(v <= self.item.hi for v in value)):
                return  # a shape: the common case, without a name per item
            for i, v in enumerate(value):
                self.item(what, f"{name}[{i}]", v)


class Optional(Rule):
    """None, or what `rule` accepts."""

    def __init__(self, rule: Rule):
        self.rule = rule

    def __call__(self, what: str, name: str, value: Any) -> None:
        if value is not None:
            self.rule(what, name, value)


class AnyOf(Rule):
    """What any of the rules accepts (the first rule's error otherwise)."""

    def __init__(self, *rules: Rule):
        self.rules = rules

    def __call__(self, what: str, name: str, value: Any) -> None:
        first = None
        for rule in self.rules:
            try:
                rule(what, name, value)
                return
            except (TypeError, ValueError) as exc:
                first = first or exc
        raise first


class Unchecked(Rule):
    """No check (a parameter whose contract the function checks itself)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        return None


Size, Count = Int(1), Int(0)
Fraction, Positive, NonNegative = Number(0, 1), Number(0, lo_open=True), Number(0)


def check_int(what: str, name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as a Python int if it is an integer in [lo, hi], else the error (Int's). The common case
    costs two type checks and two comparisons: tensor code calls it for every axis."""
    if type(value) is int and (lo is None or value >= lo) and (hi is None or value <= hi):
        return value
    Int(lo, hi)(what, name, value)
    return int(value)


def check_number(what: str, name: str, value: Any, lo: float | None = None, hi: float | None = None,
                 finite: bool = True) -> float:
    """`value` as a float if it is a real number (finite unless finite=False) in [lo, hi], else the error."""
    if type(value) in (int, float) and math.isfinite(value) and (lo is None or value >= lo) and \
            (hi is None or value <= hi):
        return float(value)
    Number(lo, hi, finite)(what, name, value)
    return float(value)


def check_bool(what: str, name: str, value: Any) -> bool:
    Bool()(what, name, value)
    return bool(value)


def check_choice(what: str, name: str, value: Any, options: Any) -> Any:
    Choice(*options)(what, name, value)
    return value


def check_array(what: str, name: str, value: Any, ndim: int | tuple[int, ...] | None = None, dtypes: Any = None,
                axes: str = "") -> np.ndarray:
    """`value` as an ndarray if Array(ndim, dtypes) accepts it, else the error."""
    Array(ndim, dtypes, axes)(what, name, value)
    return np.asarray(value)


def check_callable(what: str, name: str, value: Any) -> Any:
    Func()(what, name, value)
    return value


def check_instance(what: str, name: str, value: Any, *classes: type) -> Any:
    Instance(*classes)(what, name, value)
    return value


# ----------------------------------------------------------------------------- rules from type hints

def _split_union(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "|" and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()]


def rule_for_hint(hint: Any, namespace: dict) -> Rule | None:
    """The rule a type hint (a string under `from __future__ import annotations`) implies, or None
    where it implies none (Any, a type variable, a hint this function does not read)."""
    if hint is inspect.Parameter.empty:
        return None
    text = hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
    text = re.sub(r"\btyping\.", "", text).strip()
    m = re.fullmatch(r"Optional\[(.*)\]", text)
    if m:
        text = m.group(1) + " | None"
    optional, rules = False, []
    for part in _split_union(text):
        base = part.split("[", 1)[0].strip().strip("'\"")
        if base in ("None", "NoneType"):
            optional = True
            continue
        rule = _base_rule(base, part, namespace)
        if rule is None:
            return None
        rules.append(rule)
    if not rules:
        return None
    rule = rules[0] if len(rules) == 1 else AnyOf(*rules)
    if isinstance(rule, AnyOf) and any(isinstance(r, Number) for r in rules) and any(isinstance(r, Int) for r in rules):
        rule = AnyOf(*[r for r in rules if not isinstance(r, Int)])
    return Optional(rule) if optional else rule


def _base_rule(base: str, part: str, namespace: dict) -> Rule | None:
    simple = {"int": Int(), "float": Number(), "bool": Bool(), "str": Str()}
    if base in simple:
        return simple[base]
    if base in ("np.ndarray", "ndarray", "numpy.ndarray"):
        return Array()
    if base in ("Callable", "collections.abc.Callable"):
        return Func()
    if base in ("Sequence", "list", "tuple", "collections.abc.Sequence"):
        inner = part[len(base):].strip()
        item = None
        if inner.startswith("[") and inner.endswith("]"):
            args = [a.strip() for a in _split_union(inner[1:-1].replace(",", "|"))]
            if base == "tuple" and len(args) == 2 and args[1] == "...":
                args = args[:1]
            if len(args) == 1 and args[0] in ("int", "float", "str", "bool"):
                item = rule_for_hint(args[0], namespace)
        return Seq(item)
    if base in ("Any", "object", "type", "np.dtype", "DTypeLike") or "." in base and base.split(".")[0] not in namespace:
        return None
    obj = namespace.get(base)
    if obj is None and "." in base:
        head, *rest = base.split(".")
        obj = namespace.get(head)
        for attr in rest:
            obj = getattr(obj, attr, None)
    if inspect.isclass(obj):
        if obj.__name__ == "Tensor":
            return TensorLike()
        if obj is typing.Any:
            return None
        return Instance(obj)
    return None


def _plan(func: Callable, rules: dict[str, Rule], namespace: dict, skip_first: bool) -> list[tuple[int, str, Rule]]:
    sig = inspect.signature(func)
    plan = []
    for i, (pname, param) in enumerate(sig.parameters.items()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or (skip_first and i == 0):
            continue
        rule = rules[pname] if pname in rules else rule_for_hint(param.annotation, namespace)
        if rule is not None and not isinstance(rule, Unchecked):
            index = i if param.kind != param.KEYWORD_ONLY else 10**9
            plan.append((index, pname, rule))
    return plan


def _checked(func: Callable, what: str, plan: list[tuple[int, str, Rule]]) -> Callable:
    @functools.wraps(func)
    def checked(*args, **kwargs):
        n = len(args)
        for i, pname, rule in plan:
            if i < n:
                rule(what, pname, args[i])
            elif pname in kwargs:
                rule(what, pname, kwargs[pname])
        return func(*args, **kwargs)

    checked.__contract__ = {pname: rule for _, pname, rule in plan}
    return checked


_HELPERS = set(__all__) | {"validate_public", "called_from_numba"}  # never wrapped (a notebook defines them beside the lesson's code)


def called_from_numba(namespace: dict) -> set[str]:
    """Names that functions compiled by Numba in `namespace` call: Numba finds them by identity (an
    @overload of a Python function), so they are never wrapped."""
    names: set[str] = set()
    for obj in list(namespace.values()):
        code = getattr(getattr(obj, "py_func", None), "__code__", None)
        stack = [code] if code is not None else []
        while stack:
            c = stack.pop()
            names |= set(c.co_names)
            stack += [k for k in c.co_consts if inspect.iscode(k)]
    return names


def validate_public(namespace: dict, rules: dict[str, dict[str, Rule]] | None = None) -> None:
    """Wrap every public function and method defined in the module `namespace` (its globals()) so
    that the arguments a caller passes are checked against the contract: the rule given in
    `rules[name][param]` ('Class.method' for a method, 'Class' for the constructor), else the one
    the type hint implies. Coroutines, properties and functions compiled by Numba are left alone."""
    rules = dict(rules or {})
    module = namespace.get("__name__")
    numba_calls = called_from_numba(namespace)
    for name, obj in list(namespace.items()):
        if name.startswith("_") or name in _HELPERS or name in numba_calls or \
                getattr(obj, "__module__", None) != module:
            continue
        # A function wrapped already (a notebook runs the validate_public cells of several modules in
        # one namespace) is wrapped again from the original only where rules name it.
        if inspect.isfunction(obj):
            if getattr(obj, "__contract__", None) is not None:
                if name not in rules:
                    continue
                obj = obj.__wrapped__
            if inspect.iscoroutinefunction(obj) or inspect.isasyncgenfunction(obj):
                continue
            plan = _plan(obj, rules.pop(name, {}), namespace, False)
            namespace[name] = _checked(obj, name, plan) if plan else obj
        elif inspect.isclass(obj) and not issubclass(obj, BaseException):
            for mname, member in list(vars(obj).items()):
                if (mname.startswith("_") and mname not in ("__init__", "__call__")) or isinstance(member, property):
                    continue
                key = name if mname == "__init__" else f"{name}.{mname}"
                raw = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                if inspect.isfunction(raw) and getattr(raw, "__contract__", None) is not None:
                    if key not in rules:
                        continue
                    raw = raw.__wrapped__
                if not inspect.isfunction(raw) or inspect.iscoroutinefunction(raw) or inspect.isasyncgenfunction(raw):
                    continue
                if raw.__code__.co_filename == "<string>":  # a dataclass's generated __init__
                    rules.pop(key, None)
                    continue
                plan = _plan(raw, rules.pop(key, {}), namespace, not isinstance(member, staticmethod))
                wrapped = _checked(raw, key, plan) if plan else raw
                if isinstance(member, staticmethod):
                    wrapped = staticmethod(wrapped)
                elif isinstance(member, classmethod):
                    wrapped = classmethod(wrapped)
                setattr(obj, mname, wrapped)
    reserved = sorted(set(rules) & _HELPERS)
    if reserved:
        raise ValueError(f"validate_public: {module} defines {', '.join(reserved)}, a name of minitorch.checks' own "
                         "helpers, which are never wrapped: rename it")
    unknown = sorted(rules)
    if unknown:
        raise ValueError(f"validate_public: rules for names {module} does not define: {', '.join(unknown)}")

# %% [markdown]
# ## 1. Shape, strides, offset
#
# Memory is one-dimensional. A (2, 3) matrix stored *row-major* (C order, NumPy's default)
# lays out its rows one after another:
#
# ```
# logical         storage (element offsets 0..5)
# [[a b c]        a b c d e f
#  [d e f]]
# ```
#
# To step one position along axis 1 (the next column) you move 1 element; along axis 0 (the
# next row) you move 3. Those step sizes are the *strides*: `(3, 1)`. In general, for shape
# `(n0, n1, ..., n_{d-1})` the row-major stride of axis `i` is the product of the sizes of all
# axes to its right, and the element at index `(i0, ..., i_{d-1})` lives at
#
# `offset + i0*s0 + i1*s1 + ... + i_{d-1}*s_{d-1}`.
#
# Our strides count *elements*. NumPy's `a.strides` counts *bytes* (elements times
# `a.itemsize`), because it also describes arrays of mixed record types; divide by the item
# size to compare.

# %%
#| export
#| exercise 1.1
def strides_for(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major (C-order) strides, in elements, for `shape`.

    strides_for((2, 3, 4)) == (12, 4, 1); strides_for(()) == ().
    """
    ### BEGIN SOLUTION
    strides = []
    step = 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
    ### END SOLUTION


def index_to_offset(index: Sequence[int], strides: Sequence[int], offset: int = 0) -> int:
    """Storage position of the element at multi-index `index` (non-negative ints).

    Returns offset + sum(index[i] * strides[i]). Raises ValueError if `index` and `strides`
    have different lengths (naming both).
    """
    ### BEGIN SOLUTION
    index, strides = tuple(index), tuple(strides)
    if len(index) != len(strides):
        raise ValueError(f"index {index} has {len(index)} entries but strides {strides} has {len(strides)}")
    position = offset
    for i, s in zip(index, strides):
        position += i * s
    return position
    ### END SOLUTION


# %% tags=["check"]
check("1.1")

# %% tags=["demo"]
a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
print("shape", a.shape, "numpy strides (bytes)", a.strides, "-> elements", tuple(s // a.itemsize for s in a.strides))
print("strides_for:", strides_for(a.shape))
print("a[1, 2, 3] =", a[1, 2, 3], "= storage[%d]" % index_to_offset((1, 2, 3), strides_for(a.shape)))

# %% [markdown]
# ## 2. A strided view, read by hand
#
# Any (shape, strides, offset) triple over a storage defines an array: this is what
# `np.lib.stride_tricks.as_strided` builds, and what every NumPy view is. `as_strided` does no
# bounds checking (a wrong stride reads whatever memory lies there), so the function below
# checks first: the smallest and largest storage positions the layout can touch are
# `offset + sum over axes of min(0, s*(n-1))` and `offset + sum of max(0, s*(n-1))`, and both
# must lie inside the storage. Then it reads every element, in row-major order of the
# *output*, into a fresh contiguous array: this is what a copy (`np.ascontiguousarray`) does.
#
# Write it with plain loops (`np.ndindex` or `itertools.product` give the indices); it is slow,
# and that is fine: it is the definition.

# %%
#| export
#| exercise 1.2
def gather(storage: np.ndarray, shape: Sequence[int], strides: Sequence[int], offset: int = 0) -> np.ndarray:
    """Materialise the strided view (shape, strides, offset) of a 1-D `storage` array.

    Returns a new C-contiguous array of `shape` and storage's dtype with
    out[idx] = storage[offset + sum(idx[i] * strides[i])]. Strides are in elements and may be
    zero or negative. Raises ValueError if shape and strides differ in length or `storage`
    is not 1-D, and IndexError (naming the offending position and the storage size) if the
    layout reaches outside the storage.
    """
    ### BEGIN SOLUTION
    shape, strides = tuple(shape), tuple(strides)
    if storage.ndim != 1:
        raise ValueError(f"storage must be 1-D, got shape {storage.shape}")
    if len(shape) != len(strides):
        raise ValueError(f"shape {shape} and strides {strides} have different lengths")
    out = np.empty(shape, dtype=storage.dtype)
    if out.size == 0:
        return out
    lo = offset + sum(min(0, s * (n - 1)) for n, s in zip(shape, strides))
    hi = offset + sum(max(0, s * (n - 1)) for n, s in zip(shape, strides))
    if lo < 0 or hi >= storage.size:
        bad = lo if lo < 0 else hi
        raise IndexError(f"layout shape={shape} strides={strides} offset={offset} reaches storage "
                         f"position {bad}, outside a storage of {storage.size} elements")
    for idx in itertools.product(*(range(n) for n in shape)):
        position = offset
        for i, s in zip(idx, strides):
            position += i * s
        out[idx] = storage[position]
    return out
    ### END SOLUTION


# %% tags=["check"]
check("1.2")

# %% tags=["demo"]
storage = np.arange(12, dtype=np.float64)
print(gather(storage, (3, 4), (4, 1)))          # the row-major 3x4 matrix
print(gather(storage, (4, 3), (1, 4)))          # its transpose: same storage, strides swapped
print(gather(storage, (3, 4), (0, 1)))          # a stride of 0 repeats row 0: broadcasting
print(gather(storage, (12,), (-1,), offset=11))  # a negative stride reverses

# %% [markdown]
# ## 3. Views are stride arithmetic
#
# **Transpose** permutes the shape and the strides together: axis `i` of the result is axis
# `axes[i]` of the input. No element moves; `x.T` of a (1000, 1000) array is free.
#
# **Slicing** `x[start:stop:step]` along an axis of stride `s` starts `start*s` further into
# storage (the offset grows), keeps stride `s*step`, and has `len(range(start, stop, step))`
# elements. Python's `slice.indices(n)` resolves negative and missing bounds for you. An
# integer index `i` moves the offset by `i*s` and drops the axis.
#
# **Contiguity.** A layout is C-contiguous when its strides are exactly `strides_for(shape)`,
# ignoring axes of size 1 (their stride is never used) and treating an empty array as
# contiguous. It matters for two reasons. First, `reshape` can only be a free view when the
# elements are already in row-major order (for contiguous data any reshape is just new strides
# over the same storage; otherwise it must copy; NumPy's `reshape` silently copies, PyTorch's
# `view` refuses). Second, speed: a contiguous walk uses every byte of each 64-byte cache line
# it loads, a transposed walk of float32 data may use 4 bytes of each. See
# [memory layout](../hardware_notes/memory_layout.md).

# %%
#| export
#| exercise 1.3
def transpose_layout(shape: Sequence[int], strides: Sequence[int],
                     axes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) of the transpose with axis order `axes` (a permutation of range(ndim)).

    Raises ValueError naming `axes` and ndim if `axes` is not such a permutation.
    """
    ### BEGIN SOLUTION
    shape, strides, axes = tuple(shape), tuple(strides), tuple(axes)
    if sorted(axes) != list(range(len(shape))):
        raise ValueError(f"axes {axes} are not a permutation of the {len(shape)} axes of shape {shape}")
    return tuple(shape[a] for a in axes), tuple(strides[a] for a in axes)
    ### END SOLUTION


def slice_layout(shape: Sequence[int], strides: Sequence[int], offset: int,
                 key: Sequence[int | slice]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(shape, strides, offset) of the view x[key], where x has layout (shape, strides, offset).

    `key` holds one int or slice per leading axis (fewer entries than axes: the rest are
    taken whole). An int selects one position (negative counts from the end) and removes the
    axis; a slice keeps it. Raises IndexError naming the index, axis and size for an int out of
    range, and for more entries than axes.
    """
    ### BEGIN SOLUTION
    shape, strides, key = tuple(shape), tuple(strides), tuple(key)
    if len(key) > len(shape):
        raise IndexError(f"too many indices: {len(key)} for a tensor of shape {shape}")
    new_shape, new_strides = [], []
    for axis, (n, s) in enumerate(zip(shape, strides)):
        k = key[axis] if axis < len(key) else slice(None)
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            length = len(range(start, stop, step))
            if length > 0:
                offset += start * s
            new_shape.append(length)
            new_strides.append(s * step)
        else:
            i = int(k)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of range for axis {axis} of size {n}")
            offset += (i % n) * s
    return tuple(new_shape), tuple(new_strides), offset
    ### END SOLUTION


def is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True if (shape, strides) is C-contiguous: strides == strides_for(shape) on every axis
    of size > 1. Arrays with a zero-size axis are contiguous."""
    ### BEGIN SOLUTION
    shape, strides = tuple(shape), tuple(strides)
    if 0 in shape:
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if s != expected:
            return False
        expected *= n
    return True
    ### END SOLUTION


# %% tags=["check"]
check("1.3")

# %% tags=["demo"]
x = np.arange(2 * 3 * 4).reshape(2, 3, 4)
shape, strides = transpose_layout(x.shape, (12, 4, 1), (2, 0, 1))
print("transpose (2,0,1):", shape, strides, "contiguous?", is_contiguous(shape, strides))
shape, strides, off = slice_layout(x.shape, (12, 4, 1), 0, (1, slice(None, None, -1), slice(1, 4, 2)))
print("x[1, ::-1, 1:4:2]:", shape, strides, "offset", off)
print(gather(x.ravel(), shape, strides, off))
print(x[1, ::-1, 1:4:2])

# %% [markdown]
# Live: a view of a (4, n) matrix and the storage it reads. Each square of the view shows the
# storage offset of its element (`offset + i*s0 + j*s1`), and the strip below numbers the
# elements in the order the view visits them: in storage order for a contiguous view, jumping
# for a transpose or a stepped slice. No view copies anything.

# %% tags=["demo"]
import matplotlib.pyplot as plt

from course.live import live

VIEWS = {"a": lambda a: a, "a.T": lambda a: a.T, "a[:, ::2]": lambda a: a[:, ::2],
         "a[1:3, 1:]": lambda a: a[1:3, 1:], "a[::-1]": lambda a: a[::-1], "a[:, 2:3]": lambda a: a[:, 2:3]}


def draw_view(view: str, n: int):
    a = np.arange(4 * n).reshape(4, n)  # each element's value is its storage offset
    v = VIEWS[view](a)
    strides = tuple(s // a.itemsize for s in v.strides)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 4.5), height_ratios=[3, 1])
    ax.imshow(v, cmap="viridis", vmin=0, vmax=4 * n - 1, aspect="equal")
    for (i, j), off in np.ndenumerate(v):
        ax.text(j, i, str(off), ha="center", va="center", color="w")
    ax.set(xticks=[], yticks=[], title=f"{view}: shape {v.shape}, strides {strides}, offset {v.ravel()[0] if v.size else 0}, "
           f"{'contiguous' if v.flags.c_contiguous else 'not contiguous'}")
    strip = np.full(4 * n, np.nan)
    strip[v.ravel()] = np.arange(v.size)
    ax2.imshow(strip[None, :], cmap="plasma", aspect="auto")
    for k, order in enumerate(strip):
        if not np.isnan(order):
            ax2.text(k, 0, str(int(order)), ha="center", va="center", color="w", fontsize=8)
    ax2.set(yticks=[], xlabel="storage offset (number: visit order; blank: not in the view)")
    fig.tight_layout()
    return fig


live(draw_view, view=list(VIEWS), n=(3, 10))

# %% [markdown]
# ## 4. Broadcasting: the shape rule
#
# Elementwise ops on arrays of different shapes follow NumPy's broadcasting rule
# ([NumPy docs, "Broadcasting"](https://numpy.org/doc/stable/user/basics.broadcasting.html)):
# align the shapes on the right; missing leading axes count as size 1; along each axis the
# sizes must be equal or one of them 1, and the result takes the other size. So (8, 1, 6) with
# (7, 1) gives (8, 7, 6); (2, 3) with (4,) is an error. Size 0 follows the same rule: 0 with 1
# gives 0, 0 with 3 is an error. A silent wrong broadcast (say a (n,) bias added to an (n, 1)
# column, giving (n, n)) is one of the most common bugs in model code, so the error must name
# the shapes.

# %%
#| export
#| exercise 1.4
def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """The shape that `shapes` broadcast to under NumPy's rule.

    broadcast_shape((8, 1, 6), (7, 1)) == (8, 7, 6); broadcast_shape() == ().
    Raises ValueError naming all the shapes and the first incompatible axis.
    """
    ### BEGIN SOLUTION
    shapes = tuple(tuple(s) for s in shapes)
    ndim = max((len(s) for s in shapes), default=0)
    result = []
    for axis in range(-ndim, 0):
        size = 1
        for s in shapes:
            n = s[axis] if -axis <= len(s) else 1
            if n == 1:
                continue
            if size != 1 and n != size:
                listed = " and ".join(str(s) for s in shapes)
                raise ValueError(f"shapes {listed} cannot be broadcast: axis {axis} has sizes {size} and {n}")
            size = n
        result.append(size)
    return tuple(result)
    ### END SOLUTION


# %% tags=["check"]
check("1.4")

# %% [markdown]
# ## 5. Broadcasting as a view
#
# Broadcasting costs no memory: `np.broadcast_to(x, shape)` is a view whose broadcast axes
# have stride 0, so moving along them stays on the same element. Given an array's layout and a
# target shape it broadcasts to, the new strides are: 0 for each new leading axis, 0 where the
# array has size 1 and the target does not, and the original stride elsewhere. The same
# zero-stride trick reappears in lesson 02: the backward of a broadcast is a *sum* over exactly
# these axes, because every output position along them read the same input element.

# %%
#| export
#| exercise 1.5
def broadcast_strides(shape: Sequence[int], strides: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    """Strides (elements) that view an array of (shape, strides) as broadcast to `target`.

    Raises ValueError naming `shape` and `target` if `shape` does not broadcast to `target`
    (broadcasting here is one-way: the result must have exactly the target shape).
    """
    ### BEGIN SOLUTION
    shape, strides, target = tuple(shape), tuple(strides), tuple(target)
    if len(shape) > len(target):
        raise ValueError(f"shape {shape} cannot be broadcast to {target}: it has more axes")
    lead = len(target) - len(shape)
    out = [0] * lead
    for n, s, t in zip(shape, strides, target[lead:]):
        if n == t:
            out.append(s)
        elif n == 1:
            out.append(0)
        else:
            raise ValueError(f"shape {shape} cannot be broadcast to {target}: size {n} vs {t}")
    return tuple(out)
    ### END SOLUTION


# %% tags=["check"]
check("1.5")

# %% tags=["demo"]
col = np.arange(3.0).reshape(3, 1)
st = broadcast_strides(col.shape, (1, 1), (2, 3, 4))
print("(3,1) -> (2,3,4) strides:", st)
print(gather(col.ravel(), (2, 3, 4), st)[1])

# %% [markdown]
# ## 6. Axes
#
# Reductions (`sum`, `mean`, `max`) take `axis=None` (all axes), an int, or a tuple of ints,
# where -1 means the last axis. Every reduction, softmax and loss in the course goes through
# one function that turns that argument into a sorted tuple of non-negative axes, or says
# precisely what is wrong: an axis out of range (name it and the number of dimensions), a
# repeated axis, or something that is not an axis at all (`axis=1.0` would otherwise fail deep
# inside with "'float' object is not iterable"). NumPy raises `AxisError`, a subclass of both
# `ValueError` and `IndexError`; we raise `ValueError`, and `TypeError` for a non-integer.
#
# The tests compare your function with NumPy's own axis normalisation
# (`np.lib.array_utils.normalize_axis_tuple`), and then plug it into the reductions of the
# reference `Tensor` (section 7 defines yours) to check `sum`, `mean` and `max` with every
# kind of `axis`, and their error messages.

# %%
#| export
#| exercise 1.6
def normalize_axis(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Sorted tuple of non-negative axes for an `axis` argument over `ndim` dimensions.

    None -> all axes (0, ..., ndim-1); an int, or a tuple or list of ints, each in [-ndim, ndim).
    Raises ValueError naming the axis and ndim when out of range, ValueError for a repeated
    axis, TypeError naming the value when `axis` (or an entry) is not an int (1.0, True, "0").
    """
    ### BEGIN SOLUTION
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool):
        axes = (axis,)
    elif isinstance(axis, (tuple, list)):
        axes = tuple(axis)
    else:
        raise TypeError(f"axis must be None, an int or a tuple of ints, got {axis!r} ({type(axis).__name__})")
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"axis must be an int or a tuple of ints, got {a!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a tensor with {ndim} dimensions "
                             f"(valid axes: {-ndim}..{ndim - 1})")
        a = int(a) % ndim
        if a in out:
            raise ValueError(f"axis {a} is repeated in {axis!r}")
        out.append(a)
    return tuple(sorted(out))
    ### END SOLUTION


# %% tags=["check"]
check("1.6")

# %% [markdown]
# ## 7. The `Tensor` class
#
# `Tensor` wraps one array of a *backend*: `.data` is a NumPy array for device `"cpu"`, and a
# CuPy array in lesson 08 for device `"cuda"`. NumPy already implements strided storage in C,
# so `Tensor` does not reimplement sections 1-5; it borrows NumPy's layout engine and adds
# what a framework needs on top: one place for error checks, one place for devices, and hooks
# for autograd.
#
# **Extension points** (later lessons use exactly these; none edits this module):
#
# - **Backends.** Every array operation goes through `self.backend` (`self.xp.exp`,
#   `self.backend.matmul`, ...), never through a hard-coded `np.` call on `.data`. A `Backend`
#   names its array module `xp` and provides `asarray`, `to_numpy` and `matmul`.
#   `register_backend("cuda", CupyBackend())` adds a device (lesson 08); `use_backend("cpu",
#   NumbaBackend())` temporarily swaps the CPU matmul for your own kernel (lesson 06).
# - **Subclassing.** Every op builds its result with `self._new(data)`, which creates an
#   instance of `type(self)`: an autograd `Tensor` (lesson 02) gets autograd tensors back
#   from every inherited op, and only has to override the ops to record the graph. Derived ops
#   call primitive ones through `self` (`.T` calls `self.transpose()`, `x @ y` calls
#   `self.matmul`), so overriding the primitives is enough.
# - **Dtypes.** `Tensor` accepts bool, integer and floating-point data and follows NumPy's
#   promotion rules (a Python scalar does not promote a float32 tensor to float64). Anything
#   else (strings, objects, complex) is rejected when the tensor is made, with its dtype named.
#
# The exercise is the heart of the class: `_binary`, which every arithmetic operator calls.
# It must
#
# 1. accept a `Tensor`, a Python scalar (kept as a scalar, so float32 stays float32), a NumPy
#    scalar (`np.float64(2)`, `np.sqrt(d)`: treat it as the Python number `other.item()`, as
#    PyTorch does, or NumPy 2's promotion rules turn a float32 tensor into float64), or an
#    array (wrapped as a tensor on this tensor's device);
# 2. refuse tensors on a different device, naming both devices (no silent copies between
#    CPU and GPU; the user calls `.to()`);
# 3. refuse shapes that do not broadcast, naming both shapes and the operation;
# 4. apply the backend's ufunc `getattr(self.xp, name)` (`"add"`, `"multiply"`, ...) with the
#    operands in the right order (`reverse=True` computes `other OP self`, for `2 - x`).
#
# For step 3 you may use `np.broadcast_shapes` on the two shape tuples (shapes are plain
# tuples on every backend) or your `broadcast_shape`; either way catch the failure and raise
# your own message.
#
# One more detail is given in the class: `__array_ufunc__ = None`. Without it, NumPy handles
# `np.ones(3) - x` or `np.float64(2) * x` itself: it sees an object that is not an array,
# treats it as a sequence of 0-d tensors and returns a NumPy *object array* of tensors. With
# it, NumPy's operators return `NotImplemented`, Python calls our reflected operator
# (`x.__rsub__`, `x.__rmul__`) and the result is a `Tensor`; a NumPy function called on a
# tensor (`np.exp(x)`) raises a clear `TypeError` instead of building an object array.

# %%
#| export
class Backend:
    """A device's array implementation: an array module `xp` plus conversions and matmul.

    The default is NumPy. Lesson 06 subclasses it to replace `matmul` with a Numba kernel;
    lesson 08 provides one whose `xp` is CuPy.
    """

    def __init__(self, name: str = "numpy", xp: Any = np):
        self.name = name
        self.xp = xp

    def asarray(self, x: Any, dtype: Any = None) -> Any:
        """`x` as an array of this backend (no copy when it already is one)."""
        return self.xp.asarray(x, dtype=dtype)

    def to_numpy(self, a: Any) -> np.ndarray:
        """A NumPy array with the contents of backend array `a` (host memory)."""
        return np.asarray(a)

    def matmul(self, a: Any, b: Any) -> Any:
        """a @ b with NumPy's matmul semantics (batch dimensions broadcast)."""
        return self.xp.matmul(a, b)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


_BACKENDS: dict[str, Backend] = {"cpu": Backend("numpy", np)}


def register_backend(device: str, backend: Backend) -> None:
    """Make `backend` the implementation of `device` (e.g. "cuda")."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend expects a Backend, got {type(backend).__name__}")
    _BACKENDS[device] = backend


def get_backend(device: str) -> Backend:
    """The backend registered for `device`; a ValueError naming the device and the known ones otherwise
    (a TypeError for a device that is not a str). Checked here rather than by a contract: every op calls it."""
    try:
        return _BACKENDS[device]
    except (KeyError, TypeError):
        if not isinstance(device, str):
            raise TypeError(f"get_backend: device must be a str, got {device!r}") from None
        raise ValueError(f"get_backend: no backend registered for device {device!r}; known devices: "
                         f"{sorted(_BACKENDS)}") from None


@contextlib.contextmanager
def use_backend(device: str, backend: Backend) -> Iterator[Backend]:
    """Temporarily make `backend` the implementation of `device`; restores the previous one."""
    previous = _BACKENDS.get(device)
    register_backend(device, backend)
    try:
        yield backend
    finally:
        if previous is None:
            _BACKENDS.pop(device, None)
        else:
            _BACKENDS[device] = previous


_OK_KINDS = "biuf"  # bool, signed int, unsigned int, float


# %%
#| export
#| exercise 1.7
class Tensor:
    """An n-dimensional array on a device, backed by an array of that device's backend.

    Tensor(data, dtype=None, device="cpu"): `data` is a Tensor, an array, a (nested) list or a
    scalar; no copy is made when it already is a backend array of the right dtype.
    Attributes: .data (backend array), .shape, .dtype, .ndim, .size, .device.
    """

    __array_ufunc__ = None  # NumPy operators defer to ours: np.ones(3) - x is x.__rsub__(...)

    def __init__(self, data: Any, dtype: Any = None, device: str = "cpu"):
        backend = get_backend(device)
        if isinstance(data, Tensor):
            data = data.data if data.device == device else data.backend.to_numpy(data.data)
        arr = backend.asarray(data, dtype=dtype)
        if arr.dtype.kind not in _OK_KINDS:
            raise TypeError(f"Tensor supports bool, integer and floating-point data: data must be one of them, "
                            f"got {data!r:.60} (dtype {arr.dtype})")
        self.data = arr
        self.device = device

    # -- construction hook used by every op (subclasses get their own type back) --
    def _new(self, data: Any) -> Tensor:
        out = type(self).__new__(type(self))
        out.data = self.backend.asarray(data)  # reductions may return a NumPy scalar
        out.device = self.device
        return out

    # -- properties --
    @property
    def backend(self) -> Backend:
        return get_backend(self.device)

    @property
    def xp(self) -> Any:
        return self.backend.xp

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def T(self) -> Tensor:
        return self.transpose()

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", prefix="Tensor(")
        dev = "" if self.device == "cpu" else f", device={self.device!r}"
        return f"Tensor({body}, dtype={self.dtype}{dev})"

    # -- conversion --
    def numpy(self) -> np.ndarray:
        """The contents as a NumPy array (shares memory on the CPU backend)."""
        return self.backend.to_numpy(self.data)

    def item(self) -> float | int | bool:
        """The single element of a size-1 tensor as a Python number."""
        if self.size != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {self.shape}")
        return self.numpy().reshape(()).item()

    def to(self, device: str) -> Tensor:
        """A copy of this tensor on `device` (self when already there)."""
        if device == self.device:
            return self
        target = get_backend(device)
        out = type(self).__new__(type(self))
        out.data = target.asarray(self.backend.to_numpy(self.data))
        out.device = device
        return out

    # -- elementwise binary ops: the exercise --
    def _binary(self, other: Any, name: str, reverse: bool = False) -> Tensor:
        """Elementwise `self <name> other` (or `other <name> self` if reverse) with broadcasting.

        `name` is a ufunc of the backend's array module: "add", "subtract", "multiply",
        "divide", "power". `other` is a Tensor, a Python scalar, a NumPy scalar (used as the
        Python number other.item(), so it does not promote float32) or an array. Raises
        ValueError naming both shapes if they do not broadcast, ValueError naming both devices
        if the tensors live on different devices. Returns a tensor of type(self) on self.device.
        """
        ### BEGIN SOLUTION
        if isinstance(other, Tensor):
            if other.device != self.device:
                raise ValueError(f"{name}: tensors are on different devices: {self.device!r} and {other.device!r}; "
                                 f"move one with .to()")
            b = other.data
        elif isinstance(other, np.generic):
            b = other.item()
        elif isinstance(other, (bool, int, float)):
            b = other
        else:
            b = Tensor(other, device=self.device).data
        a = self.data
        b_shape = tuple(getattr(b, "shape", ()))
        try:
            np.broadcast_shapes(self.shape, b_shape)
        except ValueError:
            first, second = (b_shape, self.shape) if reverse else (self.shape, b_shape)
            raise ValueError(f"{name}: shapes {first} and {second} cannot be broadcast together") from None
        fn = getattr(self.xp, name)
        return self._new(fn(b, a) if reverse else fn(a, b))
        ### END SOLUTION

    def __add__(self, other: Any) -> Tensor:
        return self._binary(other, "add")

    def __radd__(self, other: Any) -> Tensor:
        return self._binary(other, "add", reverse=True)

    def __sub__(self, other: Any) -> Tensor:
        return self._binary(other, "subtract")

    def __rsub__(self, other: Any) -> Tensor:
        return self._binary(other, "subtract", reverse=True)

    def __mul__(self, other: Any) -> Tensor:
        return self._binary(other, "multiply")

    def __rmul__(self, other: Any) -> Tensor:
        return self._binary(other, "multiply", reverse=True)

    def __truediv__(self, other: Any) -> Tensor:
        return self._binary(other, "divide")

    def __rtruediv__(self, other: Any) -> Tensor:
        return self._binary(other, "divide", reverse=True)

    def __pow__(self, other: Any) -> Tensor:
        return self._binary(other, "power")

    def __rpow__(self, other: Any) -> Tensor:
        return self._binary(other, "power", reverse=True)

    def __neg__(self) -> Tensor:
        return self._new(self.xp.negative(self.data))

    # -- elementwise unary ops --
    def exp(self) -> Tensor:
        return self._new(self.xp.exp(self.data))

    def log(self) -> Tensor:
        return self._new(self.xp.log(self.data))

    def tanh(self) -> Tensor:
        return self._new(self.xp.tanh(self.data))

    def relu(self) -> Tensor:
        return self._new(self.xp.maximum(self.data, 0))

    def sigmoid(self) -> Tensor:
        """1 / (1 + exp(-x)), stable for any x: with e = exp(-|x|) in (0, 1], it is 1 / (1 + e)
        for x >= 0 and e / (1 + e) for x < 0, so no exp overflows and tiny values keep their
        relative precision."""
        xp = self.xp
        e = xp.exp(-xp.abs(self.data))
        return self._new(xp.where(self.data >= 0, 1, e) / (1 + e))

    # -- reductions (axis handling: normalize_axis) --
    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = normalize_axis(axis, self.ndim)
        return self._new(self.xp.sum(self.data, axis=axes, keepdims=keepdims))

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = normalize_axis(axis, self.ndim)
        if any(self.shape[a] == 0 for a in axes):
            raise ValueError(f"mean over an empty axis: shape {self.shape}, axis {axis}")
        return self._new(self.xp.mean(self.data, axis=axes, keepdims=keepdims))

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = normalize_axis(axis, self.ndim)
        if any(self.shape[a] == 0 for a in axes):
            raise ValueError(f"max over an empty axis: shape {self.shape}, axis {axis}")
        return self._new(self.xp.max(self.data, axis=axes, keepdims=keepdims))

    # -- matmul --
    def matmul(self, other: Tensor) -> Tensor:
        """Matrix product with NumPy semantics: (..., m, k) @ (..., k, n) -> (..., m, n);
        batch dimensions broadcast; a 1-D operand is a vector. Uses backend.matmul."""
        if not isinstance(other, Tensor):
            other = Tensor(other, device=self.device)
        if other.device != self.device:
            raise ValueError(f"matmul: tensors are on different devices: {self.device!r} and {other.device!r}")
        sa, sb = self.shape, other.shape
        if len(sa) == 0 or len(sb) == 0:
            raise ValueError(f"matmul: operands must have at least 1 dimension, got shapes {sa} and {sb}")
        k_a = sa[-1]
        k_b = sb[-2] if len(sb) >= 2 else sb[0]
        if k_a != k_b:
            raise ValueError(f"matmul: shapes {sa} and {sb} are not aligned: {k_a} (last axis of the first) "
                             f"!= {k_b} ({'second-to-last' if len(sb) >= 2 else 'only'} axis of the second)")
        try:
            np.broadcast_shapes(sa[:-2], sb[:-2])
        except ValueError:
            raise ValueError(f"matmul: batch dimensions of shapes {sa} and {sb} cannot be broadcast") from None
        return self._new(self.backend.matmul(self.data, other.data))

    def __matmul__(self, other: Tensor) -> Tensor:
        return self.matmul(other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return self._new(Tensor(other, device=self.device).data).matmul(self)

    # -- views --
    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        """View (or, for non-contiguous data, copy) with a new shape; one entry may be -1."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        shape = tuple(check_int("reshape", f"shape[{i}]", n) for i, n in enumerate(shape))
        known = math.prod(n for n in shape if n != -1)
        if shape.count(-1) > 1 or any(n < -1 for n in shape):
            raise ValueError(f"reshape: invalid shape {shape}")
        if shape.count(-1) == 1:
            if known == 0 or self.size % known:
                raise ValueError(f"reshape: cannot reshape {self.shape} ({self.size} elements) into {shape}")
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"reshape: cannot reshape {self.shape} ({self.size} elements) into {shape}")
        return self._new(self.data.reshape(shape))

    def transpose(self, *axes: int | Sequence[int]) -> Tensor:
        """Permute axes (default: reverse them). A view: no data moves."""
        if len(axes) == 1 and not isinstance(axes[0], (int, np.integer)):
            axes = tuple(axes[0])
        if not axes:
            axes = tuple(reversed(range(self.ndim)))
        axes = tuple(check_int("transpose", f"axes[{i}]", a) for i, a in enumerate(axes))
        if sorted(int(a) % max(self.ndim, 1) for a in axes) != list(range(self.ndim)) or \
                any(not -self.ndim <= a < self.ndim for a in axes):
            raise ValueError(f"transpose: axes {tuple(axes)} are not a permutation of the {self.ndim} axes "
                             f"of shape {self.shape}")
        return self._new(self.xp.transpose(self.data, tuple(int(a) for a in axes)))

    def __getitem__(self, key: Any) -> Tensor:
        """NumPy indexing: ints and slices give views, integer/bool arrays (or Tensors) copy."""
        return self._new(self.data[_backend_key(key)])


def _backend_key(key: Any) -> Any:
    """An indexing key with Tensors replaced by their arrays."""
    if isinstance(key, tuple):
        return tuple(_backend_key(k) for k in key)
    return key.data if isinstance(key, Tensor) else key


# %% tags=["check"]
check("1.7")

# %% tags=["demo"]
x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
b = Tensor(np.array([10.0, 20.0, 30.0], dtype=np.float32))
print(x + b)                   # (2, 3) + (3,) -> (2, 3)
print((2 * x - 1).dtype)       # Python scalars keep float32
print(x.sum(axis=0), x.mean(axis=-1, keepdims=True).shape, x.max())
print(x @ x.T)
for bad in (lambda: x + Tensor(np.ones(2)), lambda: x.sum(axis=2), lambda: x @ x, lambda: Tensor(["a"])):
    try:
        bad()
    except (ValueError, TypeError) as e:
        print(f"{type(e).__name__}: {e}")

# %% [markdown]
# The backend is the seam later lessons use. A backend whose `matmul` counts its calls shows
# that every matmul of a tensor on the device goes through it, and that `use_backend` puts
# the previous backend back afterwards:

# %% tags=["demo"]
class CountingBackend(Backend):
    def __init__(self):
        super().__init__("counting-numpy", np)
        self.calls = 0

    def matmul(self, a, b):
        self.calls += 1
        return super().matmul(a, b)


with use_backend("cpu", CountingBackend()) as counting:
    y = (x @ x.T) @ x
print("matmuls through the swapped backend:", counting.calls, "| cpu backend afterwards:", get_backend("cpu"))

# %% [markdown]
# ## 8. Views versus copies, measured
#
# A view costs nothing regardless of size; a copy costs a walk over the data; and the walk's
# speed depends on the order in which it touches memory. The cell below times, on a large
# float32 matrix: a transpose (a view), a copy of the contiguous matrix, and a copy of its
# transpose into row-major order (`np.ascontiguousarray(a.T)`), which reads memory with a
# stride of a whole row. It first prints the machine's load (`load_report`, from lesson 04's
# `minitorch.bench`): timings taken while other programs run are slower and noisier.

# %% tags=["demo"]
import time

from minitorch.bench import load_report

print(load_report())


def best_of(fn, repeat=5):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


n = 1024 if SMALL else 4096
a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
gb = a.nbytes / 1e9
t_view = best_of(lambda: a.T)
t_copy = best_of(lambda: a.copy())
t_tcopy = best_of(lambda: np.ascontiguousarray(a.T))
print(f"{n}x{n} float32 ({a.nbytes / 2**20:.0f} MiB)")
print(f"transpose (view)        {t_view * 1e6:9.1f} us")
print(f"contiguous copy         {t_copy * 1e3:9.2f} ms  {2 * gb / t_copy:6.1f} GB/s (read + write)")
print(f"copy of the transpose   {t_tcopy * 1e3:9.2f} ms  {2 * gb / t_tcopy:6.1f} GB/s")
print("reshape of contiguous data is a view:", np.shares_memory(a, a.reshape(n // 2, 2 * n)))
print("reshape of the transpose must copy: ", not np.shares_memory(a, a.T.reshape(n // 2, 2 * n)))

# %% [markdown]
# Expect the view to take well under a microsecond at any size (it creates a small object),
# the contiguous copy to run near the machine's memory bandwidth, and the copy of the
# transpose to be many times slower. Reading `a.T` in row-major order of the output jumps `n`
# floats ahead at every step, 16 KiB at n = 4096. Each read therefore uses 4 bytes of a
# 64-byte cache line whose other 60 bytes are wanted only 1 to 15 columns later, after the
# line has left the small L1 cache, and each read lands on a different 4 KiB page, so it also
# needs its own address translation (a [TLB](../hardware_notes/caches.md#the-tlb) lookup, often
# a miss). The hardware prefetcher is not what fails: it follows constant strides, but only
# within one page, and a 16 KiB stride leaves the page at every step. Measured on the 2-core
# dev machine (a Zen 4 VM, best of 5, with another job running): at 4096 x 4096 float32
# (64 MiB), the view 0.2-0.4 us, the contiguous copy 9.6-17 ms (8-14 GB/s counting read plus
# write), the copy of the transpose 130-320 ms (0.4-1.0 GB/s), 13-19 times slower for the same
# bytes. At 1024 x 1024 (4 MiB, which fits in the L3 cache) the contiguous copy reached 84 GB/s
# and the transposed one 2 GB/s.
# Cache blocking (lesson 05) is the cure: transpose in tiles small enough that every cache
# line loaded is used fully before it is evicted.
#
# ## What you measured / what to remember
#
# - A tensor is storage plus layout `(shape, strides, offset)`; element `idx` lives at
#   `offset + sum(idx * strides)`.
# - Transpose, slicing, integer indexing, broadcasting and reshape of contiguous data are
#   views: new strides over the same storage, O(1) cost. Broadcast axes have stride 0.
# - A copy walks the data; a walk in storage order is bandwidth-bound, a strided one wastes
#   most of each cache line.
# - Broadcasting aligns shapes on the right; sizes must match or be 1. Good error messages
#   name the shapes.
# - `Tensor` delegates arrays to a backend and builds results with `type(self)`, so autograd
#   (lesson 02), a Numba matmul (lesson 06) and GPU arrays (lesson 08) plug in from outside.
#
# ## Sources
#
# - NumPy documentation, "Broadcasting" and "The N-dimensional array (ndarray)": memory layout
#   and strides. https://numpy.org/doc/stable/user/basics.broadcasting.html,
#   https://numpy.org/doc/stable/reference/arrays.ndarray.html
# - S. van der Walt, S. C. Colbert, G. Varoquaux, "The NumPy array: a structure for efficient
#   numerical computation", Computing in Science & Engineering 13(2), 2011.
#   https://arxiv.org/abs/1102.1523
# - E. Z. Yang, "PyTorch internals", 2019 (tensors as storage + sizes/strides/offset).
#   http://blog.ezyang.com/2019/05/pytorch-internals/
# - Cornell minitorch, Module 2 "Tensors" (strides and broadcasting by hand).
#   https://minitorch.github.io/
# - U. Drepper, "What Every Programmer Should Know About Memory", 2007 (cache lines).
#   https://people.freebsd.org/~lstewart/articles/cpumemory.pdf


# %%
#| export
#| given
from minitorch.checks import Array, Count, Unchecked, validate_public  # noqa: E402

validate_public(globals(), {
    "gather": {"storage": Array(ndim=1, dtypes="any")},
    "normalize_axis": {"ndim": Count},
    "get_backend": {"device": Unchecked()},
})
