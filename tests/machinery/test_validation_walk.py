"""The validation walk (course/validation_walk.py) and the contracts it checks (minitorch/checks.py).

The walk must find what it is built to find: a function that accepts a bad value silently, one that
fails with a raw NumPy error, one whose error does not name the parameter; and must pass a function
whose contract refuses every bad value. The contracts must refuse with messages that name the
function, the parameter and the value, and leave what a caller does not pass (defaults) alone.
The package-wide walk itself runs in `make check` (each lesson's reference run harvests and walks).
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest

from course.validation_walk import Harvester, merge, probes_for, public_callables, report_json, walk
from minitorch import checks
from minitorch.checks import Array, Fraction, Size, validate_public


def _sample_module() -> types.ModuleType:
    """A module of four functions: one with a full contract, three with the flaws the walk must see."""
    mod = types.ModuleType("walk_sample")
    contracted = '''
from __future__ import annotations
import numpy as np

def good(n: int, frac: float, x: np.ndarray, flag: bool = False) -> float:
    """n >= 1 copies of x (rows, cols) float32 or float64 scaled by frac in [0, 1]."""
    return float(np.tile(x, (n, 1)).sum() * frac)
'''
    source = '''
from __future__ import annotations
import numpy as np

def silent(n: int) -> int:
    """Twice n, n >= 1 (no check: a float or a bool goes through)."""
    return n * 2

def raw(x: np.ndarray, axis: int = 1) -> np.ndarray:
    """x (rows, cols) summed over an axis: NumPy's own error for a bad one."""
    return np.asarray(x).sum(axis=axis)

def unnamed(k: int) -> int:
    """k >= 1, checked, but the error does not say which argument."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError("bad input")
    return k
'''
    mod.__dict__["__name__"] = "walk_sample"
    exec(compile(contracted, "walk_sample.py", "exec"), mod.__dict__)
    validate_public(mod.__dict__, {"good": {"n": Size, "frac": Fraction, "x": Array(ndim=2, dtypes=("float32", "float64"))}})
    exec(compile(source, "walk_sample.py", "exec"), mod.__dict__)  # the flawed ones: no contract
    sys.modules["walk_sample"] = mod
    return mod


@pytest.fixture
def sample():
    mod = _sample_module()
    yield mod
    sys.modules.pop("walk_sample", None)


def _walk(mod):
    targets, skipped = public_callables(["walk_sample"])
    harvester = Harvester(targets)
    harvester.install()
    try:
        mod.good(2, 0.5, np.ones((2, 3)))
        mod.silent(3)
        mod.raw(np.ones((2, 3)))
        mod.unnamed(2)
    finally:
        harvester.uninstall()
    report = walk(harvester, {})
    return report, harvester, skipped


def test_the_walk_finds_silent_raw_and_unnamed_failures_and_passes_a_full_contract(sample):
    report, harvester, skipped = _walk(sample)
    found = {(f.qualname, f.param, f.probe): f.got for f in report.findings}
    assert not [k for k in found if k[0] == "walk_sample.good"], found
    assert set(report.walked) == {"walk_sample.good", "walk_sample.silent", "walk_sample.raw", "walk_sample.unnamed"}
    # a float, a bool and a size of 0 go through `silent`
    for probe in ("float where an integer", "bool where an integer", "zero size"):
        assert found[("walk_sample.silent", "n", probe)].startswith("accepted"), found
    # NumPy's AxisError for an axis of 2.5 is no TypeError/ValueError naming `axis`
    assert ("walk_sample.raw", "x", "str where an array") in found
    assert ("walk_sample.raw", "x", "one axis more than documented") in found
    assert "does not name 'k'" in found[("walk_sample.unnamed", "k", "zero size")]
    problems, line = merge([report_json(report, harvester, skipped)], coverage=True)
    assert any(p.startswith("walk_sample.silent(n=<float where an integer>)") for p in problems)
    assert "4 callables walked" in line


def test_a_callable_no_test_reaches_is_reported_by_the_merged_walk(sample):
    targets, skipped = public_callables(["walk_sample"])
    harvester = Harvester(targets)
    harvester.install()
    try:
        sample.good(1, 0.0, np.zeros((1, 1)))
    finally:
        harvester.uninstall()
    problems, _ = merge([report_json(walk(harvester, {}), harvester, skipped)], coverage=True)
    never = sorted(p.split(":")[0] for p in problems if "no test calls it" in p)
    assert never == ["walk_sample.raw", "walk_sample.silent", "walk_sample.unnamed"]


def test_exemptions_need_a_match_of_callable_parameter_and_value(sample):
    targets, skipped = public_callables(["walk_sample"])
    harvester = Harvester(targets)
    harvester.install()
    try:
        sample.silent(3)
    finally:
        harvester.uninstall()
    exempt = {("walk_sample.silent", "n", "zero size"): "zero is a valid count here"}
    labels = {f.probe for f in walk(harvester, exempt).findings}
    assert "zero size" not in labels and "float where an integer" in labels


@pytest.mark.parametrize("call, message", [
    (lambda m: m.good(0, 0.5, np.ones((2, 3))), "good: n must be an integer >= 1, got 0"),
    (lambda m: m.good(True, 0.5, np.ones((2, 3))), "good: n must be an integer >= 1, got True"),
    (lambda m: m.good(2, math.nan, np.ones((2, 3))), "good: frac must be a finite number in [0, 1], got nan"),
    (lambda m: m.good(2, 1.5, np.ones((2, 3))), "good: frac must be a finite number in [0, 1], got 1.5"),
    (lambda m: m.good(2, "0.5", np.ones((2, 3))), "good: frac must be a finite number in [0, 1], got '0.5'"),
    (lambda m: m.good(2, 0.5, np.ones(3)), "good: x must be an array of 2 axes of dtype float32 or float64, got an array of shape (3,) and dtype float64"),
    (lambda m: m.good(2, 0.5, np.ones((2, 2), complex)), "got an array of shape (2, 2) and dtype complex128"),
    (lambda m: m.good(2, 0.5, np.ones((2, 3)), flag="yes"), "good: flag must be True or False, got 'yes'"),
])
def test_contracts_name_the_function_the_parameter_and_the_value(sample, call, message):
    with pytest.raises((TypeError, ValueError)) as info:
        call(sample)
    assert message in str(info.value), f"expected {message!r} in the error, got {info.value!r}"


def test_a_contract_leaves_defaults_alone_and_keeps_the_signature(sample):
    import inspect

    assert sample.good(1, 1.0, [[1.0, 2.0]]) == 3.0  # a list is an array-like; flag's default is not checked
    assert str(inspect.signature(sample.good)).startswith("(n: 'int', frac: 'float', x: 'np.ndarray'")
    assert set(sample.good.__contract__) == {"n", "frac", "x", "flag"}


def test_rules_for_names_a_module_does_not_define_are_an_error():
    ns = {"__name__": "walk_sample2"}
    exec("def f(n: int) -> int:\n    return n\n", ns)
    with pytest.raises(ValueError, match="rules for names walk_sample2 does not define: g"):
        validate_public(ns, {"g": {"n": Size}})


@pytest.mark.parametrize("hint, good, bad", [
    ("int", [3, np.int64(3)], [True, 2.5, "3", None]),
    ("int | None", [None, 3], [2.5, "x"]),
    ("float", [1, 2.5, np.float32(1)], [math.nan, math.inf, "1", True, None]),
    ("bool", [True, np.bool_(False)], [1, "yes", None]),
    ("str", ["a"], [3, None]),
    ("np.ndarray", [np.ones(2), [1.0, 2.0], 3.0], [None, "x", np.ones(2, complex), np.array([object()])]),
    ("Sequence[int]", [[1, 2], (3,), np.arange(2)], ["12", 3, [1.5]]),
    ("Callable[[int], int]", [len, print], [3, None]),
])
def test_rules_implied_by_type_hints(hint, good, bad):
    rule = checks.rule_for_hint(hint, {"np": np})
    for v in good:
        rule("f", "p", v)
    for v in bad:
        with pytest.raises((TypeError, ValueError), match=r"f: p(\[\d+\])? must be"):
            rule("f", "p", v)


def test_probes_follow_the_name_the_hint_and_the_docstring():
    labels = {p.label for p in probes_for("n_layer", "int", 2, 4, "")}
    assert {"zero size", "negative", "float where an integer", "nan where an integer", "None"} <= labels
    assert "None" not in {p.label for p in probes_for("k", "int | None", None, 2, "")}
    frac = {p.label for p in probes_for("val_frac", "float", 0.1, 0.1, "")}
    assert {"fraction below 0", "fraction above 1"} <= frac
    shaped = {p.label for p in probes_for("x", "np.ndarray", None, np.ones((2, 3)), "x (T, C) float32")}
    assert {"one axis more than documented", "one axis fewer than documented", "complex array"} <= shaped
    ids = {p.label for p in probes_for("idx", "np.ndarray", None, np.arange(4), "")}
    assert {"an id of -1", "an id of 10**9", "float array where integers"} <= ids


def test_a_contract_that_takes_inf_or_nan_is_not_probed_with_them():
    """A rule marked finite=False (inf is valid: an intensity with no bytes) or allow_nan=True (a graph
    constant may be NaN) tells the walk not to call those values bad; unmarked, both are probed."""
    from course.validation_walk import Target, _allows_inf, _allows_nan

    class Real(checks.Rule):
        finite, allow_nan = False, True

        def __call__(self, what, name, value):
            pass

    def f(a: float, b: float, c: float | None = None) -> float:
        return a

    wrapped = types.SimpleNamespace(__contract__={"a": Real(), "b": checks.Number(0, finite=False),
                                                  "c": checks.Optional(Real())})
    t = Target("m.f", "m", wrapped, None, "f")
    assert (_allows_inf(t, "a"), _allows_nan(t, "a")) == (True, True)
    assert (_allows_inf(t, "b"), _allows_nan(t, "b")) == (True, False)
    assert (_allows_inf(t, "c"), _allows_nan(t, "c")) == (True, True)
    plain = {p.label for p in probes_for("x", "float", None, 0.5, "")}
    assert {"nan", "inf"} <= plain
    assert not {"nan", "inf"} & {p.label for p in probes_for("x", "float", None, 0.5, "", True, True)}


def test_a_second_validate_public_in_one_namespace_rewraps_what_its_rules_name():
    """A notebook runs the contract cells of a lesson's modules in one namespace: the first wraps
    every function by its hints; a later one with rules for a function wraps it again, from the original."""
    ns = {"__name__": "walk_sample3"}
    exec("def f(n: int) -> int:\n    return n\n\ndef g(n: int) -> int:\n    return n\n", ns)
    validate_public(ns)
    validate_public(ns, {"f": {"n": Size}})
    with pytest.raises(ValueError, match="f: n must be an integer >= 1, got 0"):
        ns["f"](0)
    assert ns["g"](0) == 0 and ns["f"].__wrapped__.__name__ == "f" and not hasattr(ns["f"].__wrapped__, "__wrapped__")
