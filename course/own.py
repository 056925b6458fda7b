"""A module of a lesson whose answers a release withholds, made of the student's own code.

A release that withholds several lessons' answers at once (`make release FROM=01 UPTO=03`) cannot ship
lesson 01's module, yet lesson 02 imports it. There `minitorch/tensor.py` is three lines that call
`load()`: it runs, in order, the cells of the student's notebook `lessons/01_tensors.ipynb` that make up
the module (found by their cell ids; in a notebook without ids, such as Colab saves, by matching the
cells to the lesson as generated), and the lesson's given cells as shipped in course/lessons.json. So
lesson 02 builds on the student's lesson 01 until the instructor releases its reference.

The notebook is read from MT_OWN_NOTEBOOKS (a folder: class grading puts the student's notebooks of the
release there) or else from the release's lessons/ folder.
"""

from __future__ import annotations

import difflib
import json
import linecache
import os
from pathlib import Path


class OwnModuleError(ImportError):
    pass


def notebook_path(stem: str) -> Path:
    from course.source import ROOT

    folder = os.environ.get("MT_OWN_NOTEBOOKS")
    if folder and (Path(folder) / f"{stem}.ipynb").exists():
        return Path(folder) / f"{stem}.ipynb"
    return ROOT / "lessons" / f"{stem}.ipynb"


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _anchor(source: str) -> str:
    """The line that names a cell: its first `def`/`class` line, else its first line."""
    lines = [ln.strip() for ln in source.splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.startswith(("def ", "class ", "async def "))), lines[0] if lines else "")


def student_cells(cells: list[dict], parts: list[dict]) -> dict[str, dict]:
    """{generated cell id: the student's cell} for the parts that come from the notebook: the cell with
    that id if it still holds the part's `def`/`class` line, else the cell that holds it and looks most
    like the generated one (a notebook saved without ids, as Colab saves them, or with other ids)."""
    code = [c for c in cells if c.get("cell_type") == "code"]
    by_id = {c.get("id"): c for c in code if c.get("id")}
    found = {}
    for p in (p for p in parts if "cell" in p):
        anchor = _anchor(p["stub"])
        cell = by_id.get(p["cell"])
        if cell is not None and anchor in _source(cell):
            found[p["cell"]] = cell
            continue
        candidates = [c for c in code if anchor and anchor in _source(c)]
        if candidates:
            found[p["cell"]] = max(candidates, key=lambda c: difflib.SequenceMatcher(None, _source(c), p["stub"]).ratio())
    return found


def load(namespace: dict, stem: str, module: str) -> None:
    """Fill `namespace` (the module's globals) from the student's notebook of lesson `stem`."""
    from course.source import release_index

    index = release_index() or {}
    parts = index.get("own", {}).get(module, {}).get("parts")
    if parts is None:
        raise OwnModuleError(f"minitorch.{module}: this release does not say how to make it (course/lessons.json)")
    path = notebook_path(stem)
    what = f"minitorch.{module} is lesson {stem[:2]}'s module, made of your notebook lessons/{stem}.ipynb"
    try:
        cells = json.loads(path.read_text())["cells"]
    except FileNotFoundError:
        raise OwnModuleError(f"{what}, which is not there", name=f"minitorch.{module}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise OwnModuleError(f"{what}, which cannot be read ({exc})", name=f"minitorch.{module}") from None
    found = student_cells(cells, parts)
    for i, part in enumerate(parts):
        if "source" in part:
            source, where = part["source"], f"minitorch/{module}.py (given), part {i}"
        elif part["cell"] in found:
            source, where = _source(found[part["cell"]]), f"{path.name}, cell {part['cell']}"
        else:  # the student deleted the cell: the lesson's stub stands for it
            source, where = part["stub"], f"{path.name}, cell {part['cell']} (not found: the stub)"
        linecache.cache[where] = (len(source), None, source.splitlines(keepends=True), where)
        try:
            exec(compile(source, where, "exec"), namespace)  # noqa: S102 - the student's own code, by design
        except Exception as exc:
            raise OwnModuleError(f"{what}; its {where} raised {type(exc).__name__}: {exc}",
                                 name=f"minitorch.{module}") from exc
