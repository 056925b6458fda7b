"""The course installed from its wheel, away from the checkout (as on Colab or a JupyterHub).

Builds the wheel, installs it with `pip install <wheel>` (its dependencies from PyPI, no `gpu`
extra) into a fresh Python 3.12 virtual environment, copies lessons 01 and 09's student notebooks
into a folder outside the repository, and executes them there with nbclient: every check cell must
say "not attempted"; then lesson 01's solution notebook, whose check cells must all pass.

Slow (a few minutes, mostly pip) and needs PyPI: `.ci/run` runs it, `make check` does not.
    .venv/bin/python -m pytest -q .ci/test_wheel.py
MT_WHEEL_PYTHON picks the interpreter (default: python3.12 on PATH, or pyenv's 3.12).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run inside the wheel's venv: execute a notebook in a plain python3 kernel of that venv, from the
# folder it lies in, and print {exercise: the first line its check cell printed} as json.
RUNNER = r"""
import json, re, sys
import nbformat
from nbclient import NotebookClient
path = sys.argv[1]
nb = nbformat.read(path, as_version=4)
nb.cells = [c for c in nb.cells if not set(c.get("metadata", {}).get("tags", [])) & {"demo", "gpu"}]
NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
               resources={"metadata": {"path": str(__import__("pathlib").Path(path).parent)}}).execute()
checks, errors = {}, []
for cell in nb.cells:
    if cell.cell_type != "code":
        continue
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    m = re.fullmatch(r'check\(["\']([\d.]+)["\']\)', cell.source.strip())
    if m:
        checks[m.group(1)] = text.strip()
    errors += [f"{o['ename']}: {o['evalue']}" for o in cell.get("outputs", []) if o.get("output_type") == "error"]
print("RESULT " + json.dumps({"checks": checks, "errors": errors}))
"""


def find_python(minor: str) -> str | None:
    """An interpreter for Python `minor` ("3.12") that runs: pyenv's, else python3.12 on PATH
    (a pyenv shim on PATH may exist and still refuse to run)."""
    candidates = []
    try:
        versions = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True, timeout=30).stdout
        for v in reversed(versions.split()):
            if v == minor or v.startswith(minor + "."):
                prefix = subprocess.run(["pyenv", "prefix", v], capture_output=True, text=True, timeout=30).stdout.strip()
                candidates.append(str(Path(prefix, "bin", "python3")))
    except (OSError, subprocess.SubprocessError):
        pass
    candidates += [p for p in (shutil.which(f"python{minor}"),) if p]
    for cand in candidates:
        try:
            out = subprocess.run([cand, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip() == minor:
            return cand
    return None


def _python312() -> str | None:
    return os.environ.get("MT_WHEEL_PYTHON") or find_python("3.12")


def _pypi_reachable() -> str:
    try:
        urllib.request.urlopen("https://pypi.org/simple/numba/", timeout=15).close()
        return ""
    except OSError as exc:
        return f"PyPI (https://pypi.org) cannot be reached from here ({exc}): the wheel's dependencies come from it"


def _clean_env() -> dict:
    # No PYTHONPATH (and nothing else pointing at the checkout): the venv sees only what it installed.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MT_ROOT", "MINITORCH_DATA", "VIRTUAL_ENV")}


def _run(cmd, cwd=None, timeout=900, env=None):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or _clean_env())
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _execute(python: Path, notebook: Path) -> dict:
    # A clean environment and a cwd outside the checkout: the kernel can only find the installed course.
    env = {**_clean_env(), "MINITORCH_SMALL": "1"}
    out = _run([python, "-c", RUNNER, notebook], cwd=notebook.parent, env=env)
    return json.loads(out.split("RESULT ", 1)[1])


@pytest.fixture
def tmp_path():
    """A folder of our own under the system temp dir (pytest's numbered ones are pruned by other
    pytest runs of the same user), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="minitorch-wheel-") as d:
        yield Path(d)


@pytest.mark.timeout(1800)
def test_wheel_grades_notebooks_outside_the_repository(tmp_path):
    reason = _pypi_reachable()
    if reason:
        pytest.skip(reason)
    py312 = _python312()
    if not py312:
        pytest.skip("no Python 3.12 found (python3.12 on PATH, pyenv, or MT_WHEEL_PYTHON)")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", ROOT])
    wheel = next((tmp_path / "dist").glob("minitorch_systems-*.whl"))
    venv = tmp_path / "venv"
    _run([py312, "-m", "venv", venv])
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", wheel], timeout=1500)
    assert _run([python, "-c", "import sys; print(sys.version_info[:2])"]).strip() == "(3, 12)"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for stem in ("01_tensors", "09_attention"):
        shutil.copy(ROOT / "lessons" / f"{stem}.ipynb", elsewhere)
    sys.path.insert(0, str(ROOT))
    try:
        import nbformat

        from course.build import solution_notebook
        from course.source import find_lesson

        nbformat.write(nbformat.from_dict(solution_notebook(find_lesson("01"))), elsewhere / "01_tensors.solution.ipynb")
    finally:
        sys.path.remove(str(ROOT))

    where = _run([python, "-c", "import course.source, minitorch.gpt; print(course.source.ROOT); print(minitorch.gpt.DATA_DIR)"],
                 cwd=elsewhere).split()
    assert all(str(venv) in w for w in where), f"the installed course should read its own files, reads {where}"

    for stem in ("01_tensors", "09_attention"):
        got = _execute(python, elsewhere / f"{stem}.ipynb")
        assert got["checks"], f"{stem}: no check cell ran"
        wrong = {ex: text for ex, text in got["checks"].items() if not text.startswith(f"Exercise {ex}: not attempted yet")}
        assert not wrong, f"{stem} (stubs): check cells that do not say 'not attempted': {wrong}"

    got = _execute(python, elsewhere / "01_tensors.solution.ipynb")
    assert got["checks"] and not got["errors"], got
    wrong = {ex: text for ex, text in got["checks"].items() if not text.startswith(f"Exercise {ex}: all ")}
    assert not wrong, f"01 (solution): check cells that do not pass: {wrong}"
