"""A small reader for the course's jupytext "percent" sources, without jupytext or nbformat.

`read(path)` parses `solutions/NN_topic.py` into the same cells jupytext gives (cell type, source,
tags), as plain dicts with attribute access (`from_dict` makes such a notebook of any JSON one).
The machinery reads every lesson with it (course.source.read_source, course.loader, course.build):
importing jupytext and nbformat costs seconds in every grading process, and GPU machines often
have a preinstalled Python stack (NumPy, Numba, CuPy, PyTorch, pytest) and no Jupyter packages
(course.gpu_report). tests/machinery/test_gpu_report.py checks the reader against jupytext on
every lesson.
"""

from __future__ import annotations

import ast
import re
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
