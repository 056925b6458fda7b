"""`make build`: solutions/NN_topic.py -> lessons/NN_topic.ipynb (stubs) + minitorch/*.py.

    python -m course.build            # write what changed
    python -m course.build --check    # write nothing; exit 1 if lessons/ or minitorch/ are stale
    python -m course.build --force    # also overwrite lesson notebooks a student has edited

A student's edits are detected with lessons/.manifest.json, the hash of each notebook's content
(its cells' types and sources) as last generated: a notebook whose content differs from it was
changed by hand and is left alone. Opening a notebook in JupyterLab, running it and saving it
(outputs, execution counts, metadata, the source stored as a list of lines) changes no content.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import threading
from pathlib import Path


from course.percent import from_dict
from course.source import (
    BEGIN,
    END,
    EXERCISE_METADATA,
    LESSONS,
    PACKAGE,
    ROOT,
    Lesson,
    all_lessons,
    cell_exercise,
    default_module,
    directives,
    enclosing_names,
    read_source,
    strip_directives,
    tags,
)

MANIFEST = LESSONS / ".manifest.json"


def stub_source(source: str, exercise: str | None, where: str) -> str:
    """Replace each solution region of a cell by a `raise NotImplementedError`."""
    if BEGIN not in source:
        return source
    if not exercise:
        raise ValueError(f"{where}: solution region in a cell without '#| exercise L.K'")
    names = iter(enclosing_names(source))
    out, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError(f"{where}: nested {BEGIN}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            name = next(names)
            if name == "<module>":
                raise ValueError(f"{where}: solution region must sit inside a function body")
            out.append(f'{indent}raise NotImplementedError("Exercise {exercise}: {name}")')
        elif stripped.startswith(END):
            if not inside:
                raise ValueError(f"{where}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out)


# The metadata JupyterLab's Python kernel writes into a notebook it opens (all but the Python
# version, which differs between students and which `make build` ignores: see content_hash).
NOTEBOOK_METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                      "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                      "pygments_lexer": "ipython3"},
}


GIVEN_HEADER = "# Given, not an exercise:"


def slide_types(cells) -> list[str]:
    """Each cell's `slideshow.slide_type` (RISE in JupyterLab, nbconvert's reveal.js slides), from
    the lesson's structure alone (AUTHORING.md, "Slides"):

    - a markdown cell opening with `# ` (the lesson's title) or `## ` (a section): "slide";
      with `### `: "subslide"; any other markdown continues the slide it follows ("-");
    - check cells, the set-up code before the first section, and given-machinery imports: "skip";
    - a `demo` cell (a figure, a table, a live control): "subslide", so its output has the screen;
    - any other code (an exercise's solution or stub, exported machinery): "fragment", revealed
      under the prose that introduces it.
    """
    kinds, in_body = [], False
    for cell in cells:
        src = cell.source.lstrip()
        cell_tags = set(cell.metadata.get("tags", []))
        if cell.cell_type == "markdown":
            if src.startswith("# ") or src.startswith("## "):
                in_body = in_body or src.startswith("## ")
                kinds.append("slide")
            elif src.startswith("### "):
                kinds.append("subslide")
            else:
                kinds.append("-")
        elif cell.cell_type != "code":
            kinds.append("skip")
        elif "check" in cell_tags or not in_body or src.startswith(GIVEN_HEADER) or "#| given" in src:
            kinds.append("skip")
        elif "demo" in cell_tags:
            kinds.append("subslide")
        else:
            kinds.append("fragment")
    return kinds


def _finish(nb, lesson: Lesson):
    """Deterministic ids, no outputs, standard metadata (tags, the exercise a cell belongs to),
    slide types from the structure."""
    nb = copy.deepcopy(nb)
    nb.nbformat, nb.nbformat_minor = 4, 5
    nb.metadata = from_dict(NOTEBOOK_METADATA)
    for i, (cell, kind) in enumerate(zip(nb.cells, slide_types(nb.cells))):
        cell["id"] = f"{lesson.stem.replace('_', '-')}-{i:03d}"
        meta = {"tags": cell.metadata["tags"]} if cell.metadata.get("tags") else {}
        if cell.metadata.get(EXERCISE_METADATA):  # the student notebook's map from cells to exercises
            meta[EXERCISE_METADATA] = cell.metadata[EXERCISE_METADATA]
        meta["slideshow"] = {"slide_type": kind}
        cell.metadata = from_dict(meta)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


# ast.parse is not thread-safe in CPython 3.11 ("AST constructor recursion depth mismatch" when two
# threads parse at once, python/cpython#106905), and `make check` builds notebooks in threads.
_PARSE = threading.Lock()


def given_names(source: str) -> list[str]:
    """The public names a given cell defines at its top level (functions, classes, assignments)."""
    import ast

    with _PARSE:
        tree = ast.parse(strip_directives(source))
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]


def given_import(module: str, names: list[str]) -> str:
    """The cell that stands for a module's given cells in the student notebook."""
    lines, line = [], "   "
    for name in names:
        if len(line) + len(name) + 2 > 96:
            lines.append(line)
            line = "   "
        line += f" {name},"
    lines.append(line)
    body = "\n".join(lines)
    return (f"{GIVEN_HEADER} this machinery is minitorch/{module.replace('.', '/')}.py (read it there).\n"
            f"from minitorch.{module} import (  # noqa: F401\n{body}\n)")


def _given_by_module(nb, where: str) -> dict[str, list[str]]:
    """{module: the public names its given cells define} (a module's given cells become one import
    of those names in the student notebook)."""
    default = default_module(nb)
    given: dict[str, list[str]] = {}
    for cell in nb.cells:
        d = directives(cell)
        if "given" in d:
            if "export" not in d:
                raise ValueError(f"{where}: a `#| given` cell must also be exported")
            given.setdefault(d["export"] or default, []).extend(given_names(cell.source))
    return given


def student_view_cells(nb, where: str = "lesson") -> list[int]:
    """The indices of the source cells the student notebook keeps, in order: all but a module's
    given cells after its first (which becomes the module's import) and the given cells of a module
    that defines no public name (its validate_public call). The one walk of it: the student
    notebook (_student_view), the site's pages and a release's own modules all use this."""
    default, given = default_module(nb), _given_by_module(nb, where)
    kept, placed = [], set()
    for i, cell in enumerate(nb.cells):
        d = directives(cell)
        if "given" in d:
            module = d["export"] or default
            if module in placed or not given[module]:
                continue
            placed.add(module)
        kept.append(i)
    return kept


def _student_view(nb, lesson: Lesson):
    """Hide the build machinery: directive lines go, and the cells marked `#| given` (machinery
    the student reads but does not write: a simulator, a tracer) become one import per module,
    at the first of them. The cell of each exercise says which it is in its metadata
    (`minitorch.exercise`, the map from cells to exercises that exercise_cells reads)."""
    default = default_module(nb)
    given = _given_by_module(nb, lesson.source.name)
    cells = []
    for i in student_view_cells(nb, lesson.source.name):
        cell = nb.cells[i]
        d = directives(cell)
        if d.get("exercise"):
            cell.metadata[EXERCISE_METADATA] = {"exercise": d["exercise"]}
        if "given" in d:
            module = d["export"] or default
            cell.source = given_import(module, list(dict.fromkeys(given[module])))
        elif cell.cell_type == "code":
            cell.source = strip_directives(cell.source)
        cells.append(cell)
    nb.cells = cells
    return nb


def student_notebook(lesson: Lesson, nb=None, solved: frozenset[str] = frozenset()):
    """The lesson as students get it: solutions replaced by stubs, except the exercises in
    `solved` (used by `make check` to prove each exercise is graded on its own); no build
    directives; given machinery imported, not shown."""
    nb = copy.deepcopy(nb if nb is not None else read_source(lesson))
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            ex = directives(cell).get("exercise")
            if "gpu" in tags(cell) and not cell.source.startswith("require_gpu()"):
                raise ValueError(f"{lesson.source.name} cell {i}: a `gpu` cell must start with `require_gpu()`")
            if ex not in solved:
                cell.source = stub_source(cell.source, ex, f"{lesson.source.name} cell {i}")
    return _finish(_student_view(nb, lesson), lesson)


def exercise_cells(lesson: Lesson, nb=None) -> dict[str, str]:
    """{cell id in the student notebook: exercise id} for the cells of exercises, as the student
    notebook's cells say (their `minitorch.exercise` metadata, written by _student_view)."""
    return {cell["id"]: ex for cell in student_notebook(lesson, nb).cells if (ex := cell_exercise(cell))}


def solution_notebook(lesson: Lesson, nb=None):
    """The lesson with its solutions (what `make demo` and `make check` execute)."""
    return _finish(nb if nb is not None else read_source(lesson), lesson)


def exported_modules(lesson: Lesson, nb=None) -> dict[str, str]:
    """{module name: source} from the lesson's export cells."""
    nb = nb if nb is not None else read_source(lesson)
    default = default_module(nb)
    parts: dict[str, list[str]] = {}
    for cell in nb.cells:
        d = directives(cell)
        if "export" in d:
            code = "\n".join(ln for ln in strip_directives(cell.source).splitlines()
                             if ln.strip() not in (BEGIN, END))
            parts.setdefault(d["export"] or default, []).append(code)
    header = f"# Generated from solutions/{lesson.stem}.py by `make build`. Do not edit.\n"
    return {name: header + "\n\n\n".join(chunks) + "\n" for name, chunks in parts.items()}


def notebook_text(nb) -> str:
    import nbformat

    return nbformat.writes(nbformat.from_dict(nb), version=4) + "\n"


def content_hash(text: str) -> str:
    """Hash of a notebook's content: each cell's type and source, nothing else (not outputs,
    execution counts, ids or metadata, which running a notebook in Jupyter changes)."""
    cells = json.loads(text).get("cells", [])
    content = [(c.get("cell_type"), "".join(c.get("source", ""))) for c in cells]
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()


def outputs() -> dict[Path, str]:
    """Every generated file and its content."""
    files: dict[Path, str] = {}
    owners: dict[str, str] = {}
    index = ['"""minitorch: the package students build in this course.\n', "Generated by `make build` from solutions/; each module belongs to one lesson:\n"]
    for lesson in all_lessons():
        nb = read_source(lesson)
        files[lesson.notebook] = notebook_text(student_notebook(lesson, nb))
        for name, text in exported_modules(lesson, nb).items():
            if name in owners:
                raise ValueError(f"module {name} exported by {owners[name]} and {lesson.stem}")
            owners[name] = lesson.stem
            files[PACKAGE / f"{name.replace('.', '/')}.py"] = text
            index.append(f"    minitorch.{name:<14} lesson {lesson.stem}\n")
    files[PACKAGE / "__init__.py"] = "".join(index) + '"""\n'
    return files


def stale(files: dict[Path, str]) -> list[str]:
    """Generated paths whose content on disk differs, plus leftovers nothing generates."""
    problems = [str(p.relative_to(ROOT)) for p, text in files.items() if not p.exists() or p.read_text() != text]
    made = set(files)
    for p in list(PACKAGE.glob("**/*.py")) + list(LESSONS.glob("*.ipynb")):
        if p not in made:
            problems.append(f"{p.relative_to(ROOT)} (generated by no lesson)")
    return problems


def _content_or_none(text: str) -> str | None:
    try:
        return content_hash(text)
    except (ValueError, AttributeError, TypeError):  # not a notebook any more: the student's to keep
        return None


def build(force: bool = False) -> int:
    files = outputs()
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    refused = []
    for path, text in files.items():
        key = path.name
        if path.exists():
            current = path.read_text()
            if current == text:
                if path.suffix == ".ipynb":
                    manifest[key] = content_hash(text)
                continue
            # (a manifest from before content hashes holds the hash of the whole file)
            if path.suffix == ".ipynb" and not force and manifest.get(key) not in (
                    _content_or_none(current), hashlib.sha256(current.encode()).hexdigest()):
                refused.append(str(path.relative_to(ROOT)))
                continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if path.suffix == ".ipynb":
            manifest[key] = content_hash(text)
        print(f"wrote {path.relative_to(ROOT)}")
    for p in PACKAGE.glob("**/*.py"):
        if p not in files and p.read_text().startswith("# Generated from solutions/"):
            p.unlink()
            print(f"removed {p.relative_to(ROOT)} (no lesson exports it)")
    MANIFEST.parent.mkdir(exist_ok=True)
    MANIFEST.write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    if refused:
        print("\nNot overwritten, because you edited them (your work is safe):")
        for r in refused:
            print(f"  {r}")
        print("Move your copy aside, or run `make build FORCE=1` to replace it with the fresh lesson.")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; fail if generated files are stale")
    ap.add_argument("--force", action="store_true", help="overwrite edited lesson notebooks")
    args = ap.parse_args(argv)
    if args.check:
        problems = stale(outputs())
        if problems:
            print("Out of sync with solutions/ (run `make build` and commit):")
            for p in problems:
                print(f"  {p}")
            return 1
        print("lessons/ and minitorch/ are in sync with solutions/")
        return 0
    return build(force=args.force)


if __name__ == "__main__":
    sys.exit(main())
