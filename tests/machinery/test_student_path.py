"""The student's path: a notebook run as JupyterLab runs it, and opened, saved and rebuilt.

Notebooks here run in a plain Jupyter kernel through nbclient, cell by cell and stopping at the
first error, as JupyterLab's Run All does; nothing in them is rewritten.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
REPO = HERE.parent.parent


def run_all(cells: list[str], tmp_path: Path) -> list[dict]:
    """Run `cells` as JupyterLab's Run All: [{'ran': bool, 'text': what it printed, 'images': n}]."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    env = {**os.environ, "PYTHONPATH": str(REPO), "MINITORCH_NO_GPU": "1"}
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}},
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])
    try:
        client.execute(env=env)
    except CellExecutionError:
        pass
    out = []
    for cell in nb.cells:
        text, images = "", 0
        for o in cell.outputs:
            text += o.get("text", "") + o.get("data", {}).get("text/plain", "")
            text += f"{o['ename']}: {o['evalue']}" if o.output_type == "error" else ""
            images += "image/png" in o.get("data", {})
        widgets = sum("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in cell.outputs)
        out.append({"ran": cell.execution_count is not None, "text": text.strip(), "images": images, "widgets": widgets})
    return out


PRELUDE = ("from course.check import check\nfrom course.gpu import require_gpu\nimport matplotlib\n"
           "matplotlib.use('module://matplotlib_inline.backend_inline')\nimport matplotlib.pyplot as plt\n"
           "def causal_mask(n):\n    raise NotImplementedError('Exercise 9.1: causal_mask')\n")


def test_run_all_goes_past_unwritten_exercises_and_gpu_cells(tmp_path):
    cells = run_all([
        PRELUDE,
        "fig, ax = plt.subplots()\nmask = causal_mask(4)\nax.imshow(mask)",  # a plot that needs 9.1
        "print(mask.sum())",  # needs a name the skipped cell would have made
        "total = mask.sum() + 1",  # ... and so does this one, transitively
        "print(total)",
        "require_gpu()\nprint('ran on a GPU')",
        "import threading\nerr = []\n"  # an unwritten exercise behind another error (a rank's)
        "try:\n    causal_mask(2)\nexcept NotImplementedError as e:\n    raise RuntimeError('rank 1 failed') from e",
        "roofs = {}\nfor k in (1, 2):\n    roofs[k] = causal_mask(k)",  # a dict half filled ...
        "fig, axes = plt.subplots(1, len(roofs))",  # ... fails later: a consequence, not an error
        "roofs = {1: 2}",  # made whole again: errors that read it are the student's own again
        "from tqdm.auto import tqdm\nprint('partial')\nfor i in tqdm(range(3)):\n    causal_mask(i)",  # a bar at 0 %
        "print('the end')",
    ], tmp_path)
    assert all(c["ran"] for c in cells), cells
    assert cells[1]["text"] == "needs exercise 9.1 (causal_mask), not done yet", cells[1]
    assert cells[10]["text"] == "needs exercise 9.1 (causal_mask), not done yet", "no bar, no partial output: " + cells[10]["text"]
    assert cells[10]["widgets"] == 0, cells[10]
    assert cells[1]["images"] == 0, "a skipped plotting cell must not leave an empty figure"
    assert cells[2]["text"] == ("needs `mask` from an earlier cell, which needs exercise 9.1 (causal_mask), "
                                "not done yet")
    assert cells[4]["text"].startswith("needs `total` from an earlier cell")
    assert cells[5]["text"] == "skipped: this cell needs a CUDA GPU: MINITORCH_NO_GPU=1 is set"
    assert cells[6]["text"] == "needs exercise 9.1 (causal_mask), not done yet"
    assert cells[8]["text"] == "needs `roofs` from an earlier cell, which needs exercise 9.1 (causal_mask), not done yet"
    assert cells[8]["images"] == 0
    assert cells[11]["text"] == "the end"


def test_run_all_goes_past_cuda_c_cells_where_nvrtc_cannot_run(tmp_path, monkeypatch):
    """macOS has no NVRTC wheel: a cell compiling CUDA C to PTX skips, saying why, and so do the
    cells that read what it made; the emulator's cells and the rest of the notebook still run."""
    monkeypatch.setenv("MT_NO_NVRTC", "1")
    cells = run_all([
        PRELUDE,
        "from course.cuda_c import compile_ptx, ptx_stats\nptx = compile_ptx('__global__ void k(float *x) { x[0] = 1; }')",
        "stats = ptx_stats(ptx)",
        "print('the end')",
    ], tmp_path)
    assert all(c["ran"] for c in cells), cells
    assert cells[1]["text"].startswith("skipped: NVRTC is switched off (MT_NO_NVRTC=1)"), cells[1]
    assert cells[2]["text"].startswith("needs `ptx` from an earlier cell, which was skipped (NVRTC"), cells[2]
    assert cells[3]["text"] == "the end"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("number", ["08", "09"])
def test_cuda_c_lessons_run_to_the_end_without_nvrtc(number, monkeypatch):
    """Lessons 08 and 09's solution notebooks as Run All where NVRTC cannot run (macOS): to the end."""
    from course.executor import execute_notebook
    from course.maintain import BUILD
    from course.source import find_lesson

    monkeypatch.setenv("MT_NO_NVRTC", "1")
    ok, message, _, _ = execute_notebook(find_lesson(number), BUILD / "no-nvrtc", small=True)
    assert ok, message


def test_real_errors_still_stop_run_all_with_their_traceback(tmp_path):
    cells = run_all([PRELUDE, "x = 1\nprint(y_typo)", "print('must not run')"], tmp_path)
    assert "NameError" in cells[1]["text"] and not cells[2]["ran"], cells
    cells = run_all([PRELUDE, "def f():\n    raise NotImplementedError('not a stub')\nf()", "print('no')"], tmp_path)
    assert "NotImplementedError: not a stub" in cells[1]["text"] and not cells[2]["ran"], cells
    cells = run_all([PRELUDE, "m = causal_mask(1)", "m = 1", "print(m + 'a')", "print('no')"], tmp_path)
    assert "TypeError" in cells[3]["text"] and not cells[4]["ran"], cells


def test_exception_chain_visits_causes_contexts_and_groups_once():
    from course.notebook import exception_chain

    a, b, c, d = ValueError("a"), KeyError("b"), OSError("c"), TypeError("d")
    a.__cause__, a.__context__ = b, c
    b.__context__ = a  # a cycle
    group = ExceptionGroup("g", [d, a])
    assert [str(e) for e in exception_chain(group)] == ["g (2 sub-exceptions)", "d", "a", "'b'", "c"]
    assert list(exception_chain(None)) == []


def test_stub_exercise_finds_the_stub_in_any_chain():
    from course.notebook import defined_names, stub_exercise

    stub = NotImplementedError("Exercise 12.2: ring_allreduce")
    try:
        try:
            raise stub
        except NotImplementedError:
            raise KeyError("during handling")  # noqa: B904 - the implicit chain (__context__)
    except KeyError as exc:
        assert stub_exercise(exc) == ("12.2", "ring_allreduce")
    group = ExceptionGroup("ranks", [ValueError("x"), stub])
    assert stub_exercise(group) == ("12.2", "ring_allreduce")
    assert stub_exercise(RuntimeError("NotImplementedError: Exercise 3.1: Module.named_parameters")) == \
        ("3.1", "Module.named_parameters")  # a rank's error sent back as text
    assert stub_exercise(ValueError("Exercise 3.1: bad")) is None
    assert stub_exercise(NotImplementedError("float16")) is None
    assert defined_names("a, (b, c) = 1, (2, 3)\nfor i in x: j = i\nimport numpy as np\ndef f(z): w = 1\n"
                         "class K: v = 2\nwith open(p) as fh: pass\n[q for q in r]") == \
        {"a", "b", "c", "i", "j", "np", "f", "K", "fh"}


# -- make build on notebooks a student opened ----------------------------------------------------

@pytest.fixture
def course(tmp_path):
    root = tmp_path / "course"
    shutil.copytree(HERE / "sample", root)
    shutil.copy(HERE.parent / "conftest.py", root / "tests" / "conftest.py")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    build(root)
    return root


def build(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MT_ROOT": str(root)}
    return subprocess.run([sys.executable, "-m", "course.build", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def open_run_and_save(path: Path) -> None:
    """What JupyterLab does to a notebook a student opens and runs: outputs, execution counts,
    the kernel's metadata (with the Python version), cell metadata, sources saved as lists."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                   extra_arguments=["--IPKernelApp.log_level=ERROR"]).execute(
        env={**os.environ, "PYTHONPATH": str(path.parent.parent), "MT_ROOT": str(path.parent.parent)})
    nb.metadata["language_info"]["version"] = "3.13.0"
    for cell in nb.cells:
        cell.metadata["trusted"] = True
    nbformat.write(nb, path)


def test_a_notebook_only_opened_and_run_is_updated_by_make_build(course):
    path = course / "lessons" / "01_sample.ipynb"
    shipped = json.loads(path.read_text())
    assert shipped["metadata"]["kernelspec"]["display_name"] == "Python 3 (ipykernel)"
    open_run_and_save(path)
    assert json.loads(path.read_text()) != shipped
    src = course / "solutions" / "01_sample.py"
    src.write_text(src.read_text().replace("Twice x.", "Two times x."))
    proc = build(course)
    assert proc.returncode == 0 and "Not overwritten" not in proc.stdout, proc.stdout + proc.stderr
    assert "Two times x." in path.read_text()


def test_a_notebook_the_student_changed_is_never_overwritten(course):
    path = course / "lessons" / "01_sample.ipynb"
    open_run_and_save(path)
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if "def double" in "".join(c["source"]))
    cell["source"] = ["def double(x):\n", "    return x + x\n"]
    path.write_text(json.dumps(nb))
    mine = path.read_text()
    src = course / "solutions" / "01_sample.py"
    src.write_text(src.read_text().replace("Twice x.", "Two times x."))
    proc = build(course)
    assert proc.returncode == 1 and "Not overwritten" in proc.stdout
    assert path.read_text() == mine


def test_student_notebook_hides_directives_and_imports_given_machinery(course):
    src = course / "solutions" / "01_sample.py"
    src.write_text(src.read_text().replace(
        "# %%\nfrom course.check import check\n",
        "# %%\nfrom course.check import check\n\n# %%\n#| export\n#| given\n"
        "class Engine:\n    \"\"\"Machinery the student reads but does not write.\"\"\"\n\n\n"
        "LIMIT = 3\n_PRIVATE = 1\n\n\ndef start():\n    return Engine()\n"))
    assert build(course).returncode == 0
    nb = json.loads((course / "lessons" / "01_sample.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert not any("#|" in c for c in code), "build directives are machinery, not the lesson"
    given = [c for c in code if c.startswith("# Given")]
    assert len(given) == 1 and "from minitorch.sample import (" in given[0], code
    assert "Engine, LIMIT, start," in given[0] and "_PRIVATE" not in given[0] and "class Engine" not in given[0]
    assert "class Engine" in (course / "minitorch" / "sample.py").read_text()


def test_a_gpu_cell_must_start_with_require_gpu(course):
    src = course / "solutions" / "01_sample.py"
    src.write_text(src.read_text() + '\n# %% tags=["gpu"]\nimport cupy\n')
    proc = build(course)
    assert proc.returncode != 0 and "must start with `require_gpu()`" in proc.stderr


def test_make_demo_scales_its_cell_limit_and_says_which_cell_ran_past_it(course):
    src = course / "solutions" / "01_sample.py"
    src.write_text(src.read_text() + '\n# %% tags=["demo"]\nimport time\ntime.sleep(600)  # a lecture demo too slow here\n')
    assert build(course).returncode == 0
    # every other cell (check cells run pytest) must fit in the limit even on a loaded machine
    env = {**os.environ, "MT_ROOT": str(course), "MT_DEMO_CELL_LIMIT": "10", "MT_TIME_SCALE": "1.5"}
    proc = subprocess.run([sys.executable, "-m", "course.maintain", "demo", "01"], cwd=course, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "`import time`) ran past the per-cell limit of 15 s (10 s on the course's reference machine, x1.50" in out, out
    assert "build/demo/01_sample.ipynb" in out and (course / "build" / "demo" / "01_sample.ipynb").exists()
