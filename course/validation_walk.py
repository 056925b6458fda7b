"""The validation walk: every public function and method of `minitorch`, called with the bad values
of each parameter's kind, must refuse them with a TypeError or ValueError that names the parameter
and the value (or be on the short exemption list in `course/validation_exempt.py`, with a reason).

Where the valid calls come from: the lessons' own tests. While a lesson's reference tests run
(`make check`'s reference stage sets MT_WALK=<file>), the first call of each public callable that
returns normally is kept, its arguments deep-copied before the call. When the session ends, each
kept call is replayed as it was (it must still succeed), then once per bad value of each parameter,
the other arguments as they were. A parameter's kind comes from its type hint, or from the value
the tests passed where the hint is `Any`; its bounds from its name (a size or count is >= 1, a
fraction lies in [0, 1]) and its docstring (an array given a shape must have that many axes).

The bad values of each kind:
    int       True, '3', 2.5, nan, inf, None, [2]; a size or count: 0 and -1; any other: -1
    float     True, '0.5', nan, inf, None, [0.5]; a fraction: -0.5 and 1.5; a positive quantity: -1
    bool      'yes', 2, None
    str       3, None; one of a documented set of options: 'no-such-option'
    array     a str, None, complex and float16 copies (float arrays), a float copy (integer arrays),
              an id of -1 and of 10**9 (arrays of ids), one axis more and one fewer (a documented shape)
    callable  3, None
    object    a str, None (a parameter whose hint is one of minitorch's classes)
None is only bad where the hint does not allow it. A value is only bad where no part of the
hint's union admits it. A refusal must be a TypeError or ValueError (or a subclass) whose message
contains the parameter's name and the value (its repr or str, or for an array its shape or dtype);
anything else (another exception, a result, more than PROBE_LIMIT seconds) is a finding.

    python -m course.validation_walk REPORT [REPORT ...]   print the findings of walk reports, merged
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import io
import json
import re
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

PROBE_LIMIT = 2.0      # s for one bad call, on the reference machine (x course.timing's scale)
BASELINE_LIMIT = 30.0  # s for replaying a kept call

# Names of parameters that are sizes or counts (>= 1), fractions ([0, 1]) and positive quantities.
SIZE_NAMES = re.compile(r"^(n|num|max|min)_|(^|_)(n|size|sizes|count|steps|step_count|dim|len|length|heads?|layers?|"
                        r"experts?|k|top_k|world|world_size|ranks|nranks|batch|block|blocks|tile|tiles|chunk|width|"
                        r"hidden|epochs|repeat|repeats|rounds|buckets|stages|microbatches|vocab|vocab_size|"
                        r"block_size|n_embd|n_head|n_layer|capacity|warmup|iters|iterations|tokens|group|groups|"
                        r"bits|rank|tp|pp|dp|ep|degree|threads|workers|samples|trials|mc|nc|kc|mr|nr|bm|bn|bk)$")
FRACTION_NAMES = re.compile(r"(^|_)(frac|fraction|ratio|p|prob|probability|dropout|top_p|alpha|momentum|beta1|beta2|"
                            r"quantile|percentile_frac|val_frac|smoothing)$")
POSITIVE_NAMES = re.compile(r"(^|_)(lr|rate|temperature|scale|eps|timeout|interval|slo|budget|factor|duration|"
                            r"bandwidth|latency|alpha_s|beta_s|clip|threshold|std|sigma|tolerance|tol|delay|period)$")
CHOICE_NAMES = re.compile(r"^(mode|kind|device|backend|engine|decode|schedule|method|order|policy|reduction|norm|"
                          r"granularity|activation|scheme|fmt|format|impl|direction|how|strategy|op|layout|"
                          r"variant|stage|which|style|placement|init|loss|optimizer)$")
ID_ARRAY_NAMES = re.compile(r"(^|_)(idx|ids|tokens|experts|index|indices|targets|labels|y)$")
UNBOUNDED_INTS = re.compile(r"(^|_)(axis|axes|dim|offset|shift|delta|start|pos|position|seed)$")


# ----------------------------------------------------------------------------- the public callables

@dataclass
class Target:
    """One public callable: `qualname` (module.name or module.Class.method), the function object
    whose parameters are walked, and where it lives (`owner`: the module or class, `attr`)."""
    qualname: str
    module: str
    func: Callable
    owner: Any
    attr: str
    kind: str = "function"   # function | method | staticmethod | classmethod | constructor


def _is_record(cls: type) -> bool:
    """A NamedTuple, or a dataclass with a generated __init__ and no __post_init__."""
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return True
    return dataclasses.is_dataclass(cls) and not hasattr(cls, "__post_init__")


def public_callables(module_names: list[str]) -> tuple[list[Target], dict[str, str]]:
    """Every public function, method and constructor defined in the named minitorch modules, and
    {qualname: why it is not walked} for the public callables the walk cannot call (compiled
    kernels, coroutines, records, exceptions)."""
    targets, skipped = [], {}
    for module_name in module_names:
        full = module_name if "." in module_name or module_name in sys.modules else f"minitorch.{module_name}"
        mod = importlib.import_module(full)
        module_name = module_name.rsplit(".", 1)[-1]
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            qual = f"{module_name}.{name}"
            if inspect.isclass(obj):
                if issubclass(obj, BaseException):
                    skipped[qual] = "an exception class"
                    continue
                if _is_record(obj):
                    skipped[qual] = "a record (NamedTuple or plain dataclass): its fields are checked where it is made"
                elif "__init__" in vars(obj) and inspect.isfunction(vars(obj)["__init__"]):
                    targets.append(Target(qual, module_name, vars(obj)["__init__"], obj, "__init__", "constructor"))
                for mname, member in vars(obj).items():
                    if mname.startswith("_") and mname != "__call__":
                        continue
                    mqual = f"{qual}.{mname}"
                    if isinstance(member, staticmethod):
                        targets.append(Target(mqual, module_name, member.__func__, obj, mname, "staticmethod"))
                    elif isinstance(member, classmethod):
                        targets.append(Target(mqual, module_name, member.__func__, obj, mname, "classmethod"))
                    elif inspect.isfunction(member):
                        if inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member):
                            skipped[mqual] = "a coroutine: it runs in the server's event loop"
                        else:
                            targets.append(Target(mqual, module_name, member, obj, mname, "method"))
            elif inspect.isfunction(obj):
                if inspect.iscoroutinefunction(obj) or inspect.isasyncgenfunction(obj):
                    skipped[qual] = "a coroutine or async generator: it runs in the server's event loop"
                else:
                    targets.append(Target(qual, module_name, obj, mod, name))
            elif callable(obj) and hasattr(obj, "py_func"):
                skipped[qual] = "compiled by Numba: its arguments are typed by Numba; the Python functions that call it validate"
            elif callable(obj) and type(obj).__module__.startswith("numba"):
                skipped[qual] = "a Numba CUDA kernel: launched by the lesson's Python wrappers, which validate"
    return targets, skipped


# ----------------------------------------------------------------------------- harvesting valid calls

@dataclass
class Kept:
    """A call that returned normally: the arguments as they were before the call."""
    args: tuple
    kwargs: dict
    seconds: float


class Harvester:
    """Wraps every target so that its first call that returns normally is kept (deep copies of its
    arguments, taken before the call); a callable that already has its call runs unwrapped in all
    but one extra Python frame."""

    def __init__(self, targets: list[Target]):
        self.targets = targets
        self.kept: dict[str, Kept] = {}
        self.lock = threading.Lock()
        self.originals: list[tuple[Any, str, Any]] = []
        self.numba_called: list[str] = []

    def install(self) -> None:
        import types

        # modules (a backend's NumPy), locks, threads and communicators are shared, not copied, by the
        # deep copies of the arguments
        for atomic in (types.ModuleType, type(threading.Lock()), type(threading.RLock()), threading.Thread,
                       threading.Event, threading.Condition, *_live_classes()):
            copy._deepcopy_dispatch[atomic] = copy._deepcopy_atomic
        from minitorch.checks import called_from_numba

        numba_calls: set[tuple[str, str]] = set()
        for mod_name in {t.module for t in self.targets}:
            mod = sys.modules.get(f"minitorch.{mod_name}") or sys.modules.get(mod_name)
            if mod is not None:
                numba_calls |= {(mod_name, n) for n in called_from_numba(vars(mod))}
        # what Numba code calls is found by identity (an @overload): never wrapped, walked from Python only
        self.numba_called = [t.qualname for t in self.targets if (t.module, t.attr) in numba_calls and t.kind == "function"]
        self.targets = [t for t in self.targets if t.qualname not in self.numba_called]
        by_func: dict[int, Callable] = {}
        for t in self.targets:
            wrapper = self._wrap(t)
            by_func[id(t.func)] = wrapper
            raw = vars(t.owner)[t.attr] if inspect.isclass(t.owner) else t.func
            if t.kind == "staticmethod":
                wrapped_attr = staticmethod(wrapper)
            elif t.kind == "classmethod":
                wrapped_attr = classmethod(wrapper)
            else:
                wrapped_attr = wrapper
            self.originals.append((t.owner, t.attr, raw))
            setattr(t.owner, t.attr, wrapped_attr)
        # module-level functions imported by name into other minitorch modules
        for mod_name, mod in list(sys.modules.items()):
            if not mod_name.startswith("minitorch") or mod is None:
                continue
            for name, value in list(vars(mod).items()):
                if inspect.isfunction(value) and id(value) in by_func and by_func[id(value)] is not value:
                    self.originals.append((mod, name, value))
                    setattr(mod, name, by_func[id(value)])

    def uninstall(self) -> None:
        for owner, attr, raw in reversed(self.originals):
            setattr(owner, attr, raw)
        self.originals.clear()

    def _wrap(self, t: Target) -> Callable:
        func, qual, kept, lock = t.func, t.qualname, self.kept, self.lock
        tries = [0]

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if qual in kept or tries[0] >= 50:
                return func(*args, **kwargs)
            try:
                saved = copy.deepcopy((args, kwargs))
            except Exception:  # noqa: BLE001 - locks, sockets, generators: not replayable
                tries[0] += 1
                return func(*args, **kwargs)
            t0 = time.perf_counter()
            result = func(*args, **kwargs)
            seconds = time.perf_counter() - t0
            with lock:
                if qual not in kept:
                    kept[qual] = Kept(saved[0], saved[1], seconds)
            return result

        wrapper.__validation_walk__ = True
        return wrapper


def _live_classes() -> tuple[type, ...]:
    """Classes whose objects only work inside the run that made them (lesson 12's communicators and
    their requests): shared by the copies, and a call that holds one is not replayed after its run."""
    try:
        from minitorch import comm
    except ImportError:
        return ()
    return tuple(c for c in vars(comm).values()
                 if inspect.isclass(c) and c.__module__ == comm.__name__ and c.__name__ in
                 ("Communicator", "SimComm", "MPIComm", "SubComm", "Request", "Work"))


def _holds_live(args: tuple, kwargs: dict) -> bool:
    live = _live_classes()
    return bool(live) and any(isinstance(v, live) for v in (*args, *kwargs.values()))


# ----------------------------------------------------------------------------- the bad values

class ProbeTimeout(BaseException):
    """Raised by the walk's alarm in a call that ran past its limit (a BaseException, so that no
    `except Exception` in the code under test swallows it)."""


@dataclass
class Probe:
    label: str            # what kind of bad value, e.g. "bool where int"
    value: Any
    tokens: list[str]     # one of these must appear in the error message (the value, as text)


def _hint_parts(hint: Any) -> tuple[set[str], bool]:
    """The kinds a type hint (a string, under `from __future__ import annotations`) admits, and
    whether it admits None. Kinds: int float bool str array tensor callable seq dtype any other."""
    if hint is inspect.Parameter.empty:
        return {"any"}, True
    text = hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
    text = text.replace("typing.", "").replace("Optional[", "None | ").strip()
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "|" and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    kinds, optional = set(), False
    for p in parts:
        base = p.split("[", 1)[0].strip().strip("'\"")
        if base in ("None", "NoneType"):
            optional = True
        elif base == "int":
            kinds.add("int")
        elif base == "float":
            kinds |= {"float", "int"}
        elif base == "bool":
            kinds.add("bool")
        elif base == "str":
            kinds.add("str")
        elif base in ("np.ndarray", "ndarray", "numpy.ndarray", "NDArray", "np.typing.NDArray"):
            kinds.add("array")
        elif base == "Tensor":
            kinds.add("tensor")
        elif base in ("Callable", "collections.abc.Callable"):
            kinds.add("callable")
        elif base in ("Sequence", "list", "tuple", "Iterable", "collections.abc.Sequence"):
            kinds.add("seq")
        elif base in ("np.dtype", "dtype", "DTypeLike", "type"):
            kinds.add("dtype")
        elif base in ("Any", "object"):
            kinds.add("any")
        else:
            kinds.add("other:" + base)
    return kinds, optional


def _value_kind(value: Any) -> str | None:
    import numpy as np

    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, np.ndarray):
        return "array"
    if type(value).__name__ == "Tensor" and type(value).__module__.startswith("minitorch"):
        return "tensor"
    if inspect.isfunction(value) or inspect.ismethod(value):
        return "callable"
    return None


def _admits(kinds: set[str], value: Any) -> bool:
    """Whether a hint of these kinds plainly admits `value` (so it is no bad value for it)."""
    import numpy as np

    if "any" in kinds:
        return False
    v = _value_kind(value)
    if v == "bool":
        return "bool" in kinds
    if v == "int":
        return "int" in kinds or "float" in kinds
    if v == "float":
        return "float" in kinds
    if v == "str":
        return "str" in kinds or "dtype" in kinds
    if isinstance(value, list):
        return "seq" in kinds
    if isinstance(value, np.ndarray):
        return "array" in kinds or "seq" in kinds
    return False


def _documented_ndim(doc: str, name: str) -> int | None:
    """The number of axes the docstring gives `name`: 'name (B, T, C)', 'name: (T,)', 'name of shape (n, k)'."""
    m = re.search(rf"(?<![\w.]){re.escape(name)}(?:\s*:|\s+of shape|\s+shaped)?\s*\(([^()]*)\)", doc)
    if not m:
        return None
    inside = m.group(1).strip()
    if not inside or not re.fullmatch(r"[\w\s*+/-]+(,[\w\s*+/-]*)*,?", inside) or "..." in inside:
        return None
    items = [x.strip() for x in inside.split(",") if x.strip()]
    if not items or any(len(x) > 12 or " " in x for x in items):  # "(any shape)" documents no axes
        return None
    return len(items)


def _documented_choice(doc: str, value: str) -> bool:
    """Whether the docstring quotes `value` as one of several options ('sim' or 'mpi')."""
    quoted = set(re.findall(r"""['"]([\w-]+)['"]""", doc))
    return value in quoted and len(quoted) >= 2


def probes_for(name: str, hint: Any, default: Any, value: Any, doc: str, allows_inf: bool = False,
               allows_nan: bool = False) -> list[Probe]:
    """The bad values for one parameter whose valid value in the kept call was `value`; allows_inf: its
    contract accepts infinities (a Number rule with finite=False), so inf is not among them; allows_nan:
    it accepts NaN too (a rule with allow_nan=True: a graph's constant may be NaN)."""
    import numpy as np

    kinds, optional = _hint_parts(hint)
    optional = optional or default is None
    if "any" in kinds:
        v = _value_kind(value)
        if v is None:
            return []
        kinds = {v}
    out: list[Probe] = []

    def add(label: str, bad: Any, *tokens: str, in_range: bool = False) -> None:
        """A bad value: of a kind the hint does not admit, or (in_range) of its kind but out of its range."""
        if in_range or not _admits(kinds, bad):
            out.append(Probe(label, bad, list(tokens) or [repr(bad), str(bad)]))

    if not optional and not (kinds & {"any"}):
        add("None", None, "None")
    vk = _value_kind(value)
    if vk == "int" and "int" in kinds and "float" not in kinds:
        add("bool where an integer", True, "True")
        add("str where an integer", "3", "'3'", "str")
        add("float where an integer", float(value) + 0.5, repr(float(value) + 0.5))
        add("nan where an integer", float("nan"), "nan")
        add("inf where an integer", float("inf"), "inf")
        add("list where an integer", [int(value)], repr([int(value)]), "list")
        if not UNBOUNDED_INTS.search(name) and value >= 0:
            add("negative", -1, "-1", in_range=True)
        if SIZE_NAMES.search(name) and value >= 1:
            add("zero size", 0, "0", in_range=True)
    elif vk in ("int", "float") and ("float" in kinds or "int" in kinds):
        add("bool where a number", True, "True")
        add("str where a number", "0.5", "'0.5'", "str")
        if not allows_nan:
            add("nan", float("nan"), "nan", in_range=True)  # a valid number only where the contract says so
        if not allows_inf:
            add("inf", float("inf"), "inf", in_range=True)
        add("list where a number", [value], repr([value]), "list")
        if FRACTION_NAMES.search(name) and 0 <= value <= 1:
            add("fraction below 0", -0.5, "-0.5", in_range=True)
            add("fraction above 1", 1.5, "1.5", in_range=True)
        elif POSITIVE_NAMES.search(name) and value > 0:
            add("negative quantity", -1.0, "-1", in_range=True)
    elif vk == "bool" and "bool" in kinds:
        add("str where a bool", "yes", "'yes'", "str")
        add("int where a bool", 2, "2")
    elif vk == "str" and "str" in kinds:
        add("int where a str", 3, "3")
        if CHOICE_NAMES.search(name) or _documented_choice(doc, value):
            add("not one of the options", "no-such-option", "no-such-option", in_range=True)
    elif vk == "array" and isinstance(value, np.ndarray):
        add("str where an array", "not an array", "str", "'not an array'")
        if value.dtype.kind == "f":
            add("complex array", value.astype(np.complex128), "complex", in_range=True)
            if value.dtype != np.float16 and re.search(r"float32|float64", doc) and "float16" not in doc:
                add("float16 array", value.astype(np.float16), "float16", in_range=True)
        elif value.dtype.kind in "iu":
            add("float array where integers", value.astype(np.float64) + 0.5, "float", in_range=True)
            if ID_ARRAY_NAMES.search(name) and value.size:
                neg = value.copy()
                neg.flat[0] = -1
                add("an id of -1", neg, "-1", in_range=True)
                big = value.astype(np.int64)
                big.flat[0] = 10**9
                add("an id of 10**9", big, "1000000000", in_range=True)
        ndim = _documented_ndim(doc, name)
        if ndim is not None and value.ndim == ndim:
            more = value[None]
            add("one axis more than documented", more, str(more.shape), "dimension", "axes", "axis", in_range=True)
            if value.ndim >= 1:
                less = value[0] if value.shape[0] else np.zeros(value.shape[1:], value.dtype)
                add("one axis fewer than documented", less, str(less.shape), "dimension", "axes", "axis", in_range=True)
    elif vk == "tensor":
        add("str where a Tensor", "not a tensor", "str", "'not a tensor'")
    elif "callable" in kinds or vk == "callable":
        add("not callable", 3, "3", "int", "callable")
    elif any(k.startswith("other:") for k in kinds) and value is not None:
        add("str where an object", "not an object", "str", "'not an object'")
    return out


# ----------------------------------------------------------------------------- probing

@dataclass
class Finding:
    qualname: str
    param: str
    probe: str
    got: str

    def __str__(self) -> str:
        return f"{self.qualname}({self.param}=<{self.probe}>): {self.got}"


@dataclass
class Report:
    walked: dict[str, list[str]] = field(default_factory=dict)     # qualname -> parameters walked
    findings: list[Finding] = field(default_factory=list)
    not_replayed: dict[str, str] = field(default_factory=dict)     # qualname -> why the kept call failed again
    skipped: dict[str, str] = field(default_factory=dict)          # qualname -> why not walkable
    probes: int = 0


@contextlib.contextmanager
def _alarm(seconds: float):
    def on_alarm(signum, frame):  # noqa: ANN001
        raise ProbeTimeout(f"ran past {seconds:.1f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _call(t: Target, args: tuple, kwargs: dict, limit: float) -> tuple[str, BaseException | None]:
    """('returned' | 'raised' | 'timeout', the exception)."""
    func = t.func
    if t.kind == "classmethod":
        args = (t.owner, *args[1:]) if args and args[0] is t.owner else (t.owner, *args)
    try:
        with _quiet(), _alarm(limit):
            func(*args, **kwargs)
    except ProbeTimeout as exc:
        return "timeout", exc
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the finding is what it raised
        return "raised", exc
    return "returned", None


def _message_names(exc: BaseException, param: str, tokens: list[str]) -> bool:
    text = str(exc)
    for note in getattr(exc, "__notes__", []) or []:
        text += "\n" + note
    low = text.lower()
    return param.lower() in low and any(tok.lower() in low for tok in tokens if tok)


def walk(harvester: Harvester, exempt: dict, scale: float = 1.0) -> Report:
    """Replay each kept call, then once per bad value of each of its callable's parameters.
    `exempt`: course.validation_exempt's rules."""
    from course.validation_exempt import exemption

    report = Report()
    for t in harvester.targets:
        reason = exemption(exempt, t.qualname, "*", "*")
        if reason:
            report.skipped[t.qualname] = reason
            continue
        kept = harvester.kept.get(t.qualname)
        if kept is None:
            continue
        sig = inspect.signature(t.func)
        try:
            bound = sig.bind(*kept.args, **kept.kwargs)
        except TypeError as exc:
            report.not_replayed[t.qualname] = f"the kept arguments do not bind: {exc}"
            continue
        limit = max(BASELINE_LIMIT, 5 * kept.seconds) * scale
        try:
            args, kwargs = copy.deepcopy((bound.args, bound.kwargs))
        except Exception as exc:  # noqa: BLE001
            report.not_replayed[t.qualname] = f"its arguments cannot be copied: {exc}"
            continue
        # A call that holds a communicator is not replayed (its run has ended); its bad calls must be
        # refused before they reach the communicator, which is what the walk asks of every call.
        if not _holds_live(args, kwargs):
            what, exc = _call(t, args, kwargs, limit)
            if what != "returned":
                report.not_replayed[t.qualname] = f"{type(exc).__name__}: {exc}"[:300]
                continue
        doc = inspect.getdoc(t.func) or ""
        if t.kind == "constructor":
            doc += "\n" + (inspect.getdoc(t.owner) or "")
        walked = []
        for pname, param in sig.parameters.items():
            if pname in ("self", "cls") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            value = bound.arguments.get(pname, param.default)
            probes = probes_for(pname, param.annotation, param.default, value, doc, _allows_inf(t, pname),
                                _allows_nan(t, pname))
            if not probes:
                continue
            walked.append(pname)
            for probe in probes:
                why = exemption(exempt, t.qualname, pname, probe.label)
                if why:
                    continue
                trial = copy.deepcopy(bound)
                trial.arguments[pname] = probe.value
                report.probes += 1
                what, exc = _call(t, trial.args, trial.kwargs, PROBE_LIMIT * scale)
                if what == "returned":
                    got = "accepted: returned normally"
                elif what == "timeout":
                    got = f"accepted: still running after {PROBE_LIMIT * scale:.1f} s"
                elif not isinstance(exc, (TypeError, ValueError)):
                    got = f"{type(exc).__name__}: {str(exc)[:200]}"
                elif not _message_names(exc, pname, probe.tokens):
                    got = f"{type(exc).__name__} that does not name {pname!r} and the value: {str(exc)[:200]}"
                else:
                    continue
                report.findings.append(Finding(t.qualname, pname, probe.label, got))
        report.walked[t.qualname] = walked
    return report


def _contract_rules(t: Target, pname: str) -> tuple:
    """The rules of the callable's contract (minitorch.checks) for the parameter, Optional and AnyOf opened."""
    rule = getattr(t.func, "__contract__", {}).get(pname)
    while rule is not None and hasattr(rule, "rule"):  # Optional(...)
        rule = rule.rule
    return getattr(rule, "rules", (rule,))  # AnyOf(...)


def _allows_inf(t: Target, pname: str) -> bool:
    """Whether the callable's contract for the parameter takes infinities (a rule with finite=False)."""
    return any(getattr(r, "finite", True) is False for r in _contract_rules(t, pname))


def _allows_nan(t: Target, pname: str) -> bool:
    """Whether the callable's contract for the parameter takes NaN (a rule with allow_nan=True)."""
    return any(getattr(r, "allow_nan", False) is True for r in _contract_rules(t, pname))


def _walkable(t: Target) -> bool:
    """Whether the callable has a parameter the walk could try (not self, *args or **kwargs)."""
    params = list(inspect.signature(t.func).parameters.values())
    if t.kind in ("method", "constructor", "classmethod"):
        params = params[1:]
    return any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def report_json(report: Report, harvester: Harvester, skipped: dict[str, str]) -> dict:
    """What one lesson's run found, as JSON: every walkable target (to count coverage across runs),
    what was walked, the findings, the calls that did not replay, what is not walked and why."""
    return {"targets": sorted(t.qualname for t in harvester.targets if _walkable(t)),
            "walked": report.walked, "probes": report.probes,
            "findings": [dataclasses.asdict(f) for f in report.findings],
            "not_replayed": report.not_replayed, "skipped": {**skipped, **report.skipped}}


# ----------------------------------------------------------------------------- the pytest plugin

class WalkPlugin:
    """Registered by tests/conftest.py when MT_WALK names a file: harvests while the lesson's tests
    run; when they end, walks every callable they called (of any module) and writes the report."""

    def __init__(self, path: str):
        from course.validation_exempt import ALL_MODULES, EXEMPT, exemption

        self.path = path
        targets, self.skipped = public_callables(ALL_MODULES)
        for t in targets:
            reason = exemption(EXEMPT, t.qualname, "*", "*")
            if reason:
                self.skipped[t.qualname] = reason
        self.harvester = Harvester([t for t in targets if t.qualname not in self.skipped])
        self.harvester.install()
        for q in self.harvester.numba_called:
            self.skipped[q] = "called from Numba code, which finds it by identity: it cannot be wrapped to harvest a call"

    def pytest_sessionfinish(self, session, exitstatus):  # noqa: ANN001
        from course.timing import time_scale
        from course.validation_exempt import EXEMPT

        self.harvester.uninstall()
        report = walk(self.harvester, EXEMPT, time_scale())
        with open(self.path, "w") as f:
            json.dump(report_json(report, self.harvester, self.skipped), f, indent=1)


def merge(reports: list[dict], modules: set[str] | None = None, coverage: bool = True) -> tuple[list[str], str]:
    """(problems, one-line summary) of the walk reports of several runs, restricted to callables of
    `modules` (None: all). A callable walked in any run is covered; a finding of any run counts once.
    With coverage, a walkable callable no run called is a problem too."""
    def mine(q: str) -> bool:
        return modules is None or q.split(".")[0] in modules

    walked: dict[str, list[str]] = {}
    findings: dict[tuple, str] = {}
    not_replayed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    targets: set[str] = set()
    probes = 0
    for data in reports:
        walked.update({q: v for q, v in data["walked"].items() if mine(q)})
        for f in data["findings"]:
            if mine(f["qualname"]):
                findings.setdefault((f["qualname"], f["param"], f["probe"]), f["got"])
        not_replayed.update({q: v for q, v in data["not_replayed"].items() if mine(q)})
        skipped.update({q: v for q, v in data["skipped"].items() if mine(q)})
        targets |= {q for q in data["targets"] if mine(q)}
        probes += data["probes"]
    problems = [f"{q}({p}=<{label}>): {got}" for (q, p, label), got in sorted(findings.items())]
    problems += [f"{q}: its call from the tests does not replay: {why}"
                 for q, why in sorted(not_replayed.items()) if q not in walked]
    if coverage:
        never = sorted(targets - set(walked) - set(not_replayed) - set(skipped))
        problems += [f"{q}: no test calls it, so the walk cannot (call it in a test, or exempt it with the reason)"
                     for q in never]
    n_params = sum(len(v) for v in walked.values())
    line = (f"{len(walked)} callables walked ({n_params} parameters, {probes} bad calls); "
            f"{len(skipped)} not walked, each with its reason")
    return problems, line


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Print the findings of validation-walk reports, merged.")
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--modules", help="only these minitorch modules (comma-separated)")
    ap.add_argument("--coverage", action="store_true", help="also list the callables no report's run called")
    a = ap.parse_args()
    mods = set(a.modules.split(",")) if a.modules else None
    problems, line = merge([json.load(open(p)) for p in a.reports], mods, coverage=a.coverage)
    print(f"{line}; {len(problems)} problems")
    for problem in problems:
        print("  " + problem)
