"""A small reader for the course's jupytext "percent" sources, for machines without jupytext.

GPU machines often have a preinstalled Python stack (NumPy, Numba, CuPy, PyTorch, pytest) and no
Jupyter packages. `read(path)` parses `solutions/NN_topic.py` into the same cells jupytext gives
(cell type, source, tags), as plain dicts with attribute access; `install_shims()` registers
minimal `jupytext` and `nbformat` modules built on it when the real ones are missing, so the
course's machinery (course.source, course.loader, course.build) imports and can load the
reference package and the solutions. tests/machinery/test_gpu_report.py checks the reader
against jupytext on every lesson.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import types
from pathlib import Path

_MARKER = re.compile(r"^# %%(.*)$")


class NotebookNode(dict):
    """A dict whose keys are also attributes (nbformat's NotebookNode, minus validation)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self[key] = value


def from_dict(d):
    if isinstance(d, dict):
        return NotebookNode({k: from_dict(v) for k, v in d.items()})
    if isinstance(d, list):
        return [from_dict(v) for v in d]
    return d


def _metadata(header: str) -> tuple[str, dict]:
    """'# %% [markdown] tags=["demo"]' -> ('markdown', {'tags': ['demo']})."""
    kind = "code"
    m = re.match(r"\s*\[(\w+)\]", header)
    if m:
        kind = m.group(1)
        header = header[m.end():]
    meta: dict = {}
    for key, value in re.findall(r"(\w+)=(\[[^\]]*\]|\"[^\"]*\"|\S+)", header):
        try:
            meta[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            meta[key] = value
    return kind, meta


def _trim(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def read(path: str | Path, fmt: str = "py:percent") -> NotebookNode:
    """The notebook of a percent-format script: cells with cell_type, source, metadata."""
    cells, kind, meta, body = [], None, {}, []

    def flush():
        if kind is None:
            return
        lines = _trim(list(body))
        if kind == "markdown":
            lines = [ln[2:] if ln.startswith("# ") else ln[1:] if ln.startswith("#") else ln for ln in lines]
        cell = NotebookNode(cell_type=kind, source="\n".join(lines), metadata=NotebookNode(meta))
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        cells.append(cell)

    for line in Path(path).read_text().splitlines():
        m = _MARKER.match(line)
        if m:
            flush()
            kind, meta = _metadata(m.group(1))
            body = []
        elif kind is not None:
            body.append(line)
    flush()
    return NotebookNode(cells=cells, metadata=NotebookNode(), nbformat=4, nbformat_minor=5)


def install_shims() -> list[str]:
    """Register minimal `jupytext` and `nbformat` modules if the real ones cannot be imported.
    Returns the names of the modules shimmed."""
    shimmed = []
    try:
        import jupytext  # noqa: F401
    except ImportError:
        mod = types.ModuleType("jupytext")
        mod.read = read
        mod.__version__ = "course.percent stand-in"
        mod.__doc__ = "course.percent's stand-in for jupytext (read only)"
        sys.modules["jupytext"] = mod
        shimmed.append("jupytext")
    try:
        import nbformat  # noqa: F401
    except ImportError:
        mod = types.ModuleType("nbformat")
        mod.NotebookNode = NotebookNode
        mod.__version__ = "course.percent stand-in"
        mod.from_dict = from_dict
        mod.read = lambda fp, as_version=4: from_dict(json.loads(Path(fp).read_text() if isinstance(fp, (str, Path))
                                                                 else fp.read()))
        mod.reads = lambda s, as_version=4: from_dict(json.loads(s))
        mod.writes = lambda nb, version=4: json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False)
        mod.__doc__ = "course.percent's stand-in for nbformat (read and write JSON, no validation)"
        sys.modules["nbformat"] = mod
        shimmed.append("nbformat")
    return shimmed
