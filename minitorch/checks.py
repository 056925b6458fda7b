# Generated from solutions/01_tensors.py by `make build`. Do not edit.
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
