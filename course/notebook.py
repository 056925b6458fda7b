"""What a lesson notebook does in JupyterLab when a cell needs something that is not there yet.

A student opens a stub notebook and presses Run All. Cells that use an exercise not yet written
raise the stub's `NotImplementedError("Exercise 9.3: causal_mask")`; cells tagged `gpu` need a
CUDA GPU. Left alone, each shows a long traceback and Run All stops at the first one, so later
prose output, plots and check cells never run. `install()` (called when a lesson imports
`course.check`) registers two IPython hooks that turn exactly these cases into one line and let
Run All go on:

- an unwritten exercise, anywhere in the exception's chain (a rank's error re-raised by the
  communicator included): `needs exercise 9.3 (causal_mask), not done yet`;
- `require_gpu()` (the first line of every `gpu` cell) where no GPU works:
  `skipped: this cell needs a CUDA GPU (no NVIDIA driver ...)`;
- a cell that compiles CUDA C to PTX where NVRTC cannot run (macOS, no `gpu` extra):
  `skipped: NVRTC cannot compile here (...)`;
- an error in a cell that reads a name a cell skipped this way would have made (a NameError, or
  an error from the half-made value: an empty dict the skipped cell had started to fill):
  `needs `losses` from an earlier cell, which needs exercise 9.3 (causal_mask), not done yet`.

Every other error shows its usual traceback and stops Run All, as it should. What a skipped cell
showed before it stopped (a progress bar at 0 %, figures it had started) is cleared, so only its
one line is left. Outside IPython (the grader's
loader, plain Python) nothing is installed and the exceptions propagate.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

STUB_MESSAGE = re.compile(r"Exercise (\d+\.\d+): ([\w.<>]+)")


class SkipCell(Exception):
    """Raised to skip the rest of a notebook cell with a one-line reason (see require_gpu)."""


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and every exception it was raised from or during, and those of an exception group,
    each once (depth first)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [*getattr(e, "exceptions", ())[::-1], e.__context__, e.__cause__]


def stub_exercise(exc: BaseException | None) -> tuple[str, str] | None:
    """(exercise id, function) if `exc` or an exception in its chain is an unwritten exercise's
    stub: a NotImplementedError("Exercise L.K: name"), or an error whose text carries one (a
    rank's error sent back from another process as text)."""
    for e in exception_chain(exc):
        text = str(e)
        if isinstance(e, NotImplementedError) or "NotImplementedError" in text:
            m = STUB_MESSAGE.search(text)
            if m:
                return m.group(1), m.group(2)
    return None


def defined_names(source: str) -> set[str]:
    """Names a cell's top level would bind (assignments, loops, imports, defs, classes)."""
    return _names(source, store=True)


def used_names(source: str) -> set[str]:
    """Names a cell reads (anywhere, function bodies included)."""
    return _names(source, store=False)


def _names(source: str, store: bool) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    if not store:
        return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(child.name)
                continue  # their bodies bind local names
            if isinstance(child, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                continue
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                names.add(child.id)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in child.names if a.name != "*")
            visit(child)

    visit(tree)
    return names


class _Hooks:
    """The IPython side: a custom exception handler and pre/post_run_cell hooks."""

    def __init__(self, shell):
        self.shell = shell
        self.cell = ""  # the source of the cell being run, as Python (magics transformed)
        self.skipped = False  # the running cell was skipped (its error is not an error)
        # Names a skipped cell binds, and why it was skipped: they are missing, or half made (a
        # list the cell had started to fill), until a cell that binds them runs to its end.
        self.incomplete: dict[str, str] = {}

    def pre_run_cell(self, info) -> None:
        self.skipped = False
        try:
            self.cell = self.shell.transform_cell(info.raw_cell or "")
        except Exception:  # noqa: BLE001 - a cell IPython cannot transform fails by itself
            self.cell = ""

    def post_run_cell(self, result) -> None:
        if result is None:
            return
        if self.skipped:
            result.error_in_exec = None  # a reported skip: Run All goes on
        elif result.success:
            for name in defined_names(self.cell):
                self.incomplete.pop(name, None)

    def handler(self, shell, etype, value, tb, tb_offset=None):
        line = self.one_line(value)
        if line is None:
            return shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        self.skipped = True
        _close_new_figures()
        _clear_cell_output()
        print(line)
        return None

    def one_line(self, value: BaseException) -> str | None:
        """The line that stands for this error, or None for a real error (a traceback)."""
        found = stub_exercise(value)
        withheld = _withheld(value)
        if isinstance(value, SkipCell):  # require_gpu(), course.cuda_c.NvrtcUnavailable
            line = f"skipped: {value}"
            why = f"was skipped ({value})"
        elif withheld:
            why = line = withheld
        elif found:
            why = line = f"needs exercise {found[0]} ({found[1]}), not done yet"
        else:
            name = getattr(value, "name", None) if isinstance(value, NameError) else None
            if name not in self.incomplete:  # the first name this cell reads that a skipped cell made
                name = next((n for n in self.incomplete if n in used_names(self.cell)), None)
            if name is None:
                return None
            why = self.incomplete[name]
            line = f"needs `{name}` from an earlier cell, which {why}"
        for name in defined_names(self.cell):
            self.incomplete.setdefault(name, why)
        return line


def _withheld(value: BaseException) -> str | None:
    """In a student release: the line for an import of a module the release does not carry yet (a
    later lesson's reference, which a demo cell of an earlier lesson may use)."""
    if not isinstance(value, ModuleNotFoundError) or not (value.name or "").startswith("minitorch."):
        return None
    from course.source import release_index

    index = release_index() or {}
    lesson = index.get("withheld", {}).get(value.name.removeprefix("minitorch."))
    if lesson is None:
        return None
    return f"needs {value.name} (lesson {lesson[:2]}'s reference), which this release does not hold yet"


def _close_new_figures() -> None:
    """Close open matplotlib figures, so a skipped plotting cell leaves no empty axes behind."""
    import sys

    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close("all")


def _clear_cell_output() -> None:
    """Remove what a skipped cell showed before it stopped (a progress bar at 0 %, a half table):
    the one line says it all."""
    import sys

    progress = sys.modules.get("tqdm")
    if progress is not None:  # bars the cell left open would redraw themselves after the clear
        for bar in list(getattr(progress.tqdm, "_instances", ())):
            bar.disable = True
    from IPython.display import clear_output

    clear_output()


_installed: dict[int, _Hooks] = {}


def install() -> bool:
    """Register the hooks in the running IPython kernel (once); False outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    if id(shell) in _installed:
        return True
    hooks = _Hooks(shell)
    shell.set_custom_exc((Exception,), hooks.handler)
    shell.events.register("pre_run_cell", hooks.pre_run_cell)
    shell.events.register("post_run_cell", hooks.post_run_cell)
    _installed[id(shell)] = hooks
    return True
