"""The failure message a student reads (a check cell's summary, a `make test` scoreboard).

    with print_options():      # while a test runs: NumPy summarises long arrays with `...`
        ...
    describe(excinfo, test_file) -> Feedback(message, function)

The message keeps every line: the assertion's own message (or, for a bare `assert a == b`,
pytest's comparison), every exception note (the rank a simulated run failed on, hypothesis's
falsifying example), the call a `pytest.raises` block expected to raise, and, for an exception
raised in the student's code, where: the notebook cell (or live cell In[n]), the line and its
source. Only an absurdly long message loses its middle, with a note saying how much.
`function` names the function the failure came from when it can be known (a stub's
"Exercise 11.6: PagedKVCache.fork", or the student's function that raised).
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import os
import re
import sys
import sysconfig
import types
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

if TYPE_CHECKING:
    import pytest

MAX_CHARS = 12_000  # a message longer than this loses its middle (two arrays of 400 floats fit)
PRINT_OPTIONS = {"threshold": 400, "edgeitems": 8, "linewidth": 100}  # NumPy's print options in tests
STUB_PREFIX = "Exercise "
# pytest's own comparison of a bare `assert a == b` shows both sides whole at this verbosity
PYTEST_ARGS = ["-o", "verbosity_assertions=2"]


@dataclass
class Feedback:
    message: str
    function: str | None = None


@contextlib.contextmanager
def print_options():
    """NumPy print options suited to a failure message, and numpy.testing's messages (assert_allclose's
    ACTUAL/DESIRED) with whole arrays instead of their first 3 lines; the caller's are restored."""
    try:
        import numpy as np
        from numpy.testing._private import utils
    except ImportError:
        yield
        return
    original = getattr(utils, "build_err_msg", None)

    def build_err_msg(arrays, err_msg, header="Items are not equal:", verbose=True, names=("ACTUAL", "DESIRED"),
                      precision=8):
        msg = original(arrays, err_msg, header, False, names, precision)
        for name, a in zip(names, arrays) if verbose else ():
            try:
                msg += f"\n {name}: " + (np.array_repr(a, precision=precision) if isinstance(a, np.ndarray) else repr(a))
            except Exception as exc:  # noqa: BLE001 - as numpy does
                msg += f"\n {name}: [repr failed for <{type(a).__name__}>: {exc}]"
        return msg

    with np.printoptions(**PRINT_OPTIONS), \
            (mock.patch.object(utils, "build_err_msg", build_err_msg) if original else contextlib.nullcontext()):
        yield


def elide(text: str, limit: int = MAX_CHARS) -> str:
    """`text`, or its first and last lines with a note saying how much was left out."""
    if len(text) <= limit:
        return text
    head = text[: limit // 2].rsplit("\n", 1)[0]
    tail = text[-limit // 2:].split("\n", 1)[-1]
    lines = text.count("\n") - head.count("\n") - tail.count("\n") - 1
    return f"{head}\n... ({len(text) - len(head) - len(tail)} characters, {lines} lines elided) ...\n{tail}"


def describe(excinfo: pytest.ExceptionInfo[BaseException], test_file: str | None = None) -> Feedback:
    """What went wrong, in full, for the exception of a failed test (a pytest ExceptionInfo)."""
    exc = excinfo.value
    if getattr(exc, "pytrace", True) is False:  # pytest.fail(..., pytrace=False): the message is all
        return Feedback(str(getattr(exc, "msg", exc)))
    frame = None if is_stub(exc) else student_frame(exc.__traceback__, test_file, given_functions(test_file))
    text = _headline(exc, raised_in_student_code=frame is not None)
    if test_file and text.startswith(("Failed: DID NOT RAISE", "Failed: DID NOT WARN")):
        text += _expected_from(exc, test_file)
    elif test_file:
        text = _wrong_exception(exc, test_file) + text
    parts = [elide(text)]
    parts += [elide(n) for n in _notes(exc)]
    function = None
    if is_stub(exc):
        function = str(exc).split(": ", 1)[-1].strip() or None
    elif frame is not None:
        parts.append(_where(*frame))
        function = frame[2] if frame[2] != "<module>" else None
    return Feedback("\n".join(p for p in parts if p), function)


def is_stub(exc: BaseException) -> bool:
    """Whether `exc` is an unwritten exercise's stub: NotImplementedError("Exercise L.K: name")."""
    return isinstance(exc, NotImplementedError) and str(exc).startswith(STUB_PREFIX)


def _headline(exc: BaseException, raised_in_student_code: bool = False) -> str:
    """The exception's message without its notes; for a test's assertion with a message of its
    own, that message alone (pytest's introspection of the assert expression follows it)."""
    name = type(exc).__name__
    text = str(exc).strip("\n")  # numpy.testing's messages start with a blank line
    if isinstance(exc, AssertionError) and text and not raised_in_student_code:
        lines = text.splitlines()
        cut = next((i for i, ln in enumerate(lines) if i and ln.startswith("assert ")), None)
        if cut is not None and not lines[0].startswith("assert "):  # "message\nassert <introspection>"
            return "\n".join([lines[0], *(ln.removeprefix("  ") for ln in lines[1:cut])])
        return _without_full_diff(text)
    return f"{name}: {text}" if text else name


def _without_full_diff(text: str) -> str:
    """pytest's comparison without its "Full diff:" block (at verbosity 2 both sides are already
    shown whole), up to the next "+  where ..." line of the introspection."""
    out, skipping = [], False
    for ln in text.splitlines():
        if ln.strip().startswith("Full diff:"):
            skipping = True
            while out and not out[-1].strip():
                out.pop()
        elif skipping and re.match(r"\s*\+\s+where ", ln):
            skipping = False
        if not skipping:
            out.append(ln)
    return "\n".join(out)


def _notes(exc: BaseException) -> list[str]:
    """Every note, without hypothesis's line for the `lesson` fixture (an unhelpful repr)."""
    notes = []
    for note in getattr(exc, "__notes__", None) or []:
        lines = [ln for ln in str(note).strip().splitlines() if "lesson=<lesson" not in ln]
        if any(ln.strip() for ln in lines):
            notes.append("\n".join(lines))
    return notes


# --- where in the student's code -------------------------------------------------------------

@lru_cache(maxsize=1)
def _machinery_dirs() -> tuple[str, ...]:
    from course.source import ROOT

    dirs = {str(Path(__file__).parent), str(ROOT / "tests"), str(ROOT / "minitorch"), sys.prefix,
            sys.base_prefix, *(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    return tuple(sorted({os.path.join(os.path.realpath(d), "") for d in dirs if d}
                        | {os.path.join(d, "") for d in dirs if d}))


def _ipython_cell(filename: str) -> str | None:
    """'cell In[7]' for a cell of a running IPython (ipykernel names them /tmp/ipykernel_*/<hash>.py)."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    named = getattr(getattr(shell, "compile", None), "format_code_name", None)
    found = named(filename) if named else None
    if found:
        return f"cell {found[1]}"
    if re.search(r"ipykernel_\d+/|<ipython-input-", filename):
        return "a notebook cell"
    return None


def _is_student(filename: str) -> bool:
    if re.search(r", cell \d+$", filename) or _ipython_cell(filename):  # course.loader, IPython
        return True
    if filename.startswith("<"):  # <string> (dataclasses, exec), <frozen ...>
        return False
    return not (filename.startswith(_machinery_dirs()) or os.path.realpath(filename).startswith(_machinery_dirs()))


def student_frame(tb, test_file: str | None = None, given: frozenset[str] = frozenset()) -> tuple[str, int, str] | None:
    """(filename, line, function) of the innermost traceback entry in the student's code:
    not in the tests, pytest, NumPy, the standard library, course/ or minitorch/, nor in a
    function the lesson gives (`given`: a communicator defined in the notebook, say)."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        name = getattr(code, "co_qualname", code.co_name)
        if code.co_filename != test_file and name not in given and _is_student(code.co_filename):
            found = (code.co_filename, tb.tb_lineno, name)
        tb = tb.tb_next
    return found


@lru_cache(maxsize=8)
def given_functions(test_file: str | None) -> frozenset[str]:
    """Qualified names of the functions the lesson of `test_file` (tests/test_NN_*.py) defines
    outside its exercises' solution regions: given code, not the student's."""
    from course.source import find_lesson, read_source, release_index

    m = re.match(r"test_(\d\d)_", Path(test_file or "").name)
    try:
        lesson = find_lesson(m.group(1)) if m else None
        index = release_index()
        if lesson is not None and index is not None:  # a student release: no sources, their index
            return frozenset(index["lessons"][lesson.stem]["given_functions"])
        cells = [c.source for c in read_source(lesson).cells if c.cell_type == "code"] if lesson else []
    except (LookupError, OSError, ValueError, KeyError):
        return frozenset()
    return given_in(cells)


def given_in(cells: list[str]) -> frozenset[str]:
    """Qualified names of the functions the code cells `cells` define outside solution regions."""
    from course.source import enclosing_names

    defined, solved = set(), set()
    for source in cells:
        solved.update(enclosing_names(source))
        try:
            defined.update(_qualnames(ast.parse(source)))
        except SyntaxError:  # an IPython magic
            pass
    return frozenset(defined - solved)


def _qualnames(node: ast.AST, prefix: str = "") -> list[str]:
    """The __qualname__ of every function defined in `node` ("Class.method", "f.<locals>.g")."""
    out = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += [prefix + child.name, *_qualnames(child, f"{prefix}{child.name}.<locals>.")]
        elif isinstance(child, ast.ClassDef):
            out += _qualnames(child, f"{prefix}{child.name}.")
        else:
            out += _qualnames(child, prefix)
    return out


def _where(filename: str, line: int, function: str) -> str:
    place = _ipython_cell(filename) or filename
    source = linecache.getline(filename, line).strip()
    at = f"raised in your code: {place}, line {line}" + (f", in {function}" if function != "<module>" else "")
    return at + (f":\n    {source}" if source else "")


# --- DID NOT RAISE: the call that should have raised -----------------------------------------

@lru_cache(maxsize=32)
def _parsed(path: str) -> tuple[str, ast.AST] | None:
    try:
        source = Path(path).read_text()
        return source, ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return None


def _expected_from(exc: BaseException, test_file: str) -> str:
    """'\\nExpected ValueError from: lesson.f(x)\\n  where x = -1', from the `with pytest.raises(...)`
    block of the test (and the values its local names had)."""
    frame, tb = None, exc.__traceback__
    while tb is not None:  # the test's frame stops at the `with` line when __exit__ fails
        if os.path.realpath(tb.tb_frame.f_code.co_filename) == os.path.realpath(test_file):
            frame, line = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
    parsed = _parsed(str(test_file))
    if frame is None or parsed is None:
        return ""
    source, tree = parsed
    for node in ast.walk(tree):
        if not (isinstance(node, ast.With) and node.lineno == line):
            continue
        for item in node.items:
            call = item.context_expr
            func = getattr(call, "func", None)
            if getattr(func, "attr", getattr(func, "id", "")) not in ("raises", "warns"):
                continue
            raised = re.match(r"DID NOT RAISE (.+)", str(exc))
            what = raised.group(1) if raised else ast.get_source_segment(source, call.args[0]) if call.args else "it"
            body = [ast.get_source_segment(source, s) or "" for s in node.body]
            text = (f"\nExpected {what} from: {body[0]}" if len(body) == 1 and "\n" not in body[0] else
                    f"\nExpected {what} from:\n" + "\n".join("    " + ln for s in body for ln in s.splitlines()))
            return text + _values(node.body, frame.f_locals)
    return ""


def _wrong_exception(exc: BaseException, test_file: str) -> str:
    """'Expected ValueError, but TypeError was raised:\n' when `exc` left a `with pytest.raises(ValueError)`
    block of the test (another exception than the one it expects), else ''."""
    lines, tb = [], exc.__traceback__
    while tb is not None:  # the lines of the test file that were running (the test's, its helpers')
        if os.path.realpath(tb.tb_frame.f_code.co_filename) == os.path.realpath(test_file):
            lines.append(tb.tb_lineno)
        tb = tb.tb_next
    for first, last, what in _raises_blocks(os.path.realpath(test_file)) if lines else ():
        if any(first <= line <= last for line in lines):
            return f"Expected {what}, but {type(exc).__name__} was raised:\n"
    return ""


@lru_cache(maxsize=32)
def _raises_blocks(test_file: str) -> tuple[tuple[int, int, str], ...]:
    """(first line, last line, what it expects) of each `with pytest.raises(X)` body in the file, in
    the order ast.walk meets them (found once per file: a lesson's stubs fail a hundred tests)."""
    parsed = _parsed(test_file)
    if parsed is None:
        return ()
    source, tree = parsed
    blocks = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.With) or not node.body:
            continue
        for item in node.items:
            call = item.context_expr
            func = getattr(call, "func", None)
            if getattr(func, "attr", getattr(func, "id", "")) == "raises" and call.args:
                what = ast.get_source_segment(source, call.args[0]) or "an exception"
                blocks.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno, what))
                break
    return tuple(blocks)


def _values(statements: list[ast.stmt], local: dict) -> str:
    """'\\n  where a = 1, b = (2, 3)' for the test's local variables the statements use."""
    names = dict.fromkeys(n.id for s in statements for n in ast.walk(s) if isinstance(n, ast.Name))
    shown = []
    with print_options():
        for name in names:
            value = local.get(name)
            if name in local and name != "lesson" and not isinstance(value, (types.ModuleType, types.FunctionType, type)):
                text = repr(value)
                shown.append(f"{name} = {text if len(text) <= 500 else text[:500] + ' ...'}")
    return ("\n  where " + ", ".join(shown)) if shown else ""
