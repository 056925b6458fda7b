"""The machinery's own tests: build, grade and check on a two-exercise sample course.

Each test copies tests/machinery/sample into a temporary folder and runs the real commands
there (MT_ROOT points the machinery at it), so the repository's own lessons are never touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Each test builds and grades a sample course in child processes: tens of seconds on the idle
# 2-core machine, several times that when it is busy. Limits are scaled by course.timing too.
pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
REPO = HERE.parent.parent


@pytest.fixture
def course(tmp_path):
    root = tmp_path / "course"
    shutil.copytree(HERE / "sample", root)
    shutil.copy(HERE.parent / "conftest.py", root / "tests" / "conftest.py")
    text = (REPO / "pyproject.toml").read_text().replace("timeout = 60", "timeout = 4")
    (root / "pyproject.toml").write_text(text)
    run(root, "course.build")
    return root


def run(root: Path, module: str, *args: str, check: bool = True, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MT_ROOT": str(root), "MT_CELL_TIME_LIMIT": "3", **(extra_env or {})}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if check and proc.returncode not in (0, 1):
        raise AssertionError(proc.stdout + proc.stderr)
    return proc


def edit(root: Path, edits: dict[str, str]) -> Path:
    """The student notebook with cells whose source contains a key replaced by its value."""
    path = root / "lessons" / "01_sample.ipynb"
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        for key, new in edits.items():
            if key in src:
                cell["source"] = new
    path.write_text(json.dumps(nb))
    return path


DOUBLE = "#| export\n#| exercise 1.1\ndef double(x):\n    return 2 * x\n"
AREA = ("#| export\n#| exercise 1.2\nclass Circle:\n    def __init__(self, r):\n        self.r = r\n"
        "    def area(self):\n        return math.pi * self.r ** 2\n")


def scoreboard(root: Path) -> tuple[int, dict[str, str], str]:
    proc = run(root, "course.grade")
    rows = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].startswith("[") and parts[1].startswith("1."):
            rows[parts[1]] = line
    return proc.returncode, rows, proc.stdout


def test_student_notebook_has_stubs_not_solutions(course):
    nb = json.loads((course / "lessons" / "01_sample.ipynb").read_text())
    text = "".join("".join(c["source"]) for c in nb["cells"])
    assert 'raise NotImplementedError("Exercise 1.1: double")' in text
    assert 'raise NotImplementedError("Exercise 1.2: Circle.area")' in text
    assert "2 * x" not in text and "BEGIN SOLUTION" not in text
    assert [c["id"] for c in nb["cells"]][:2] == ["01-sample-000", "01-sample-001"]
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
    module = (course / "minitorch" / "sample.py").read_text()
    assert "return 2 * x" in module and "BEGIN SOLUTION" not in module


def test_build_is_deterministic_and_in_sync(course):
    assert run(course, "course.build", "--check").returncode == 0
    (course / "minitorch" / "sample.py").write_text("# edited\n")
    assert run(course, "course.build", "--check").returncode == 1


def test_build_never_overwrites_an_edited_notebook_without_force(course):
    path = edit(course, {"def double": DOUBLE})
    mine = path.read_text()
    src = course / "solutions" / "01_sample.py"
    src.write_text(src.read_text().replace("Twice x.", "Two times x."))
    proc = run(course, "course.build")
    assert proc.returncode == 1 and "Not overwritten" in proc.stdout
    assert path.read_text() == mine
    assert run(course, "course.build", "--force").returncode == 0
    assert "Two times x." in path.read_text()


def test_untouched_lesson_is_not_attempted_and_fails(course):
    rc, rows, out = scoreboard(course)
    assert rc == 1, out
    assert "not attempted" in rows["1.1"] and "not attempted" in rows["1.2"], out


def test_one_solved_exercise_passes_alone(course):
    edit(course, {"def double": DOUBLE})
    rc, rows, out = scoreboard(course)
    assert "passed" in rows["1.1"] and "not attempted" in rows["1.2"], out
    edit(course, {"class Circle": AREA})
    rc, rows, out = scoreboard(course)
    assert rc == 1 and "passed" in rows["1.2"] and "not attempted" in rows["1.3"], out


def test_a_copied_cell_that_breaks_loading_fails_its_own_exercise(course):
    """make build writes each exercise cell's exercise into its metadata ({"minitorch": {"exercise": "1.2"}}):
    a cell the student copied (a new id) keeps it, so if the copy ends the process while the notebook
    loads, the scoreboard files that under exercise 1.2, not under the next exercise after the copy."""
    path = course / "lessons" / "01_sample.ipynb"
    nb = json.loads(path.read_text())
    marked = [(i, c) for i, c in enumerate(nb["cells"]) if c["metadata"].get("minitorch")]
    assert [c["metadata"]["minitorch"]["exercise"] for _, c in marked][:2] == ["1.1", "1.2"], marked
    (first, _), (_, area) = marked[:2]
    nb["cells"].insert(first, {**area, "id": "my-copy", "source": "import os\nos._exit(1)\n"})
    path.write_text(json.dumps(nb))
    rc, rows, out = scoreboard(course)
    assert "FAIL" in rows["1.2"] and "ended the whole process while the notebook was loaded" in \
        out.split(rows["1.2"], 1)[1].split("\n  [", 1)[0], out
    assert "not attempted" in rows["1.1"], out


BLOCK_ALARM = "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"  # as if stuck in C code
BROKEN = {
    # exercise: (its cell's new source, what the scoreboard must say)
    "1.1": ("#| exercise 1.1\ndef double(x):\n    return 2 *\n", "SyntaxError"),
    "1.3": ("#| exercise 1.3\ndef plus_three(x):\n    return x + 3\n", "defines no `plus3`"),
    "1.4": ("#| exercise 1.4\nimport os\ndef plus4(x):\n    os._exit(3)\n", "killed the test process"),
    "1.5": ("#| exercise 1.5\ndef plus5(x):\n    while True:\n        pass\n", "ran past its time limit of"),
    "1.6": ("#| exercise 1.6\nimport sys\nsys.exit(1)\ndef plus6(x):\n    return x + 6\n", "SystemExit"),
    "1.7": ("#| exercise 1.7\nwhile True:\n    pass\n", "ran longer than"),
    "1.8": ("#| exercise 1.8\nimport os\nos._exit(1)\n", "ended the whole process while the notebook was loaded"),
    "1.9": (f"#| exercise 1.9\ndef plus9(x):\n    {BLOCK_ALARM.replace(chr(10), chr(10) + '    ')}while True:\n        pass\n",
            "could not be interrupted"),
    "1.10": (f"#| exercise 1.10\n{BLOCK_ALARM}while True:\n    pass\n", "ran longer than"),
}


@pytest.mark.timeout(600)  # measured: ~70 s on the idle 2-core machine (every way to break costs a time limit)
def test_broken_exercises_are_reported_and_the_rest_still_graded(course):
    edits = {f'"Exercise {ex}:': src for ex, (src, _) in BROKEN.items()}  # the stub's cell
    path = edit(course, {**edits, "class Circle": AREA})
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    rc, rows, out = scoreboard(course)
    assert rc == 1, out
    assert "passed" in rows["1.2"], out
    for ex, (_, expect) in BROKEN.items():
        assert "FAIL" in rows[ex], f"exercise {ex} should fail:\n{out}"
        block = out.split(rows[ex], 1)[1].split("\n  [", 1)[0]
        assert expect in block, f"exercise {ex}: expected {expect!r} in its report:\n{out}"
    assert "(not an exercise of this lesson)" not in out, f"every test is filed under its exercise:\n{out}"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before, "grading changed the student's notebook"


def test_check_cell_grades_live_code(course):
    code = (
        "import math\nfrom course.check import check\n"
        "def double(x):\n    return 2 * x\n"
        "check('1.1')\n"
        "def double(x):\n    return 3 * x\n"
        "check('1.1')\n"
        "check('1.2')\n"
    )
    env = {**os.environ, "MT_ROOT": str(course)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=course / "lessons", env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("Exercise")]
    assert lines[0] == "Exercise 1.1: all 1 tests passed.", proc.stdout + proc.stderr
    assert lines[1].startswith("Exercise 1.1: 1 of 1 tests failed"), proc.stdout
    assert "double(3) should be 6, got 9" in proc.stdout
    assert lines[2].startswith("Exercise 1.2:") and "defines no `Circle`" in proc.stdout


def first_two_exercises(root: Path) -> None:
    """Cut the sample down to exercises 1.1 and 1.2 (fewer tests in every stage of make check)."""
    src = root / "solutions" / "01_sample.py"
    src.write_text(src.read_text().split("# %% [markdown]\n# Five more")[0])
    tests = root / "tests" / "test_01_sample.py"
    tests.write_text(tests.read_text().split('@pytest.mark.exercise("1.3")')[0])
    (root / "lessons" / "01_sample.ipynb").unlink()
    run(root, "course.build")


@pytest.mark.timeout(600)  # measured: ~25 s on the idle 2-core machine (two notebook kernels, three pytest runs)
def test_make_check_catches_vacuous_tests_dependent_tests_and_check_cells_that_disagree(course):
    first_two_exercises(course)
    tests = course / "tests" / "test_01_sample.py"
    tests.write_text(tests.read_text() + '\n\n@pytest.mark.exercise("1.1")\ndef test_vacuous(lesson):\n    assert True\n'
                     '\n\n@pytest.mark.exercise("1.2")\ndef test_unit(lesson):\n    assert lesson.UNIT == 1\n'
                     # passes with every exercise solved; with 1.2 alone, 1.1's double is a stub
                     '\n\n@pytest.mark.exercise("1.2")\ndef test_leans_on_1_1(lesson):\n    assert lesson.double(lesson.Circle(1).r) == 2\n')
    # UNIT is given code defined after 1.2's check cell: `make test` passes, the live check cell cannot.
    src = course / "solutions" / "01_sample.py"
    src.write_text(src.read_text() + "\n# %%\n#| export\nUNIT = 1\n")
    run(course, "course.build")
    proc = run(course, "course.maintain", "check", "01")
    assert proc.returncode == 1
    assert "test_vacuous (exercise 1.1) PASSES on the stub" in proc.stdout, proc.stdout
    assert "the check cell of exercise 1.2 in the solution notebook should say all tests passed" in proc.stdout, proc.stdout
    assert "defines no `UNIT`" in proc.stdout, proc.stdout
    assert "the check cell of exercise 1.1 in the solution notebook" not in proc.stdout, proc.stdout
    assert "exercise 1.2 alone does not pass its tests: test_leans_on_1_1: " in proc.stdout, proc.stdout
    assert "exercise 1.1 alone" not in proc.stdout, proc.stdout


@pytest.mark.timeout(300)
def test_hypothesis_failures_show_the_example_and_never_change(course):
    first_two_exercises(course)
    tests = course / "tests" / "test_01_sample.py"
    tests.write_text(tests.read_text() + '''

from hypothesis import given, strategies as st


@pytest.mark.exercise("1.1")
@given(x=st.integers(-10**6, 10**6))
def test_double_property(lesson, x):
    assert lesson.double(x) == x + x, f"double({x}) should be {2 * x}"
''')
    wrong = "#| export\n#| exercise 1.1\ndef double(x):\n    return 2 * x if abs(x) < 1000 else 2 * x + 1\n"
    edit(course, {"def double": wrong})
    verdicts = set()
    for _ in range(2):
        rc, rows, out = scoreboard(course)
        assert "FAIL" in rows["1.1"], out
        block = out.split(rows["1.1"], 1)[1]
        assert "Failing test case" in block and "x=1000" in block, f"the example must be shown:\n{out}"
        verdicts.add(re.sub(r"0x[0-9a-f]+", "0x", block.split("\n  [", 1)[0]))
    assert len(verdicts) == 1, f"two runs gave different reports: {verdicts}"


STUB_UNDER_HYPOTHESIS = """
from hypothesis import given, strategies as st

calls = {"stub": 0, "other": 0}


def stub(x):
    calls["stub"] += 1
    raise NotImplementedError("Exercise 9.9: stub")


def unfinished(x):
    calls["other"] += 1
    if x > 5:
        raise NotImplementedError("x > 5 is not handled yet")


@given(st.integers())
def test_stub(x):
    stub(x)


@given(st.integers())
def test_unfinished(x):
    unfinished(x)


def test_calls():
    assert calls["stub"] == 1 and calls["other"] > 2, calls
"""


def test_a_stub_under_hypothesis_fails_at_once_with_its_own_message(tmp_path):
    """A stub's NotImplementedError leaves a Hypothesis test at its first example (nothing to shrink:
    the exercise is not written) and is reported as itself; other exceptions are shrunk as before."""
    (tmp_path / "test_stub.py").write_text(STUB_UNDER_HYPOTHESIS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "course.grading_plugin",
                           "--tb=short", "test_stub.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    out = proc.stdout + proc.stderr
    assert "2 failed, 1 passed" in out, out
    assert "NotImplementedError: Exercise 9.9: stub" in out, out
    assert "test case: test_unfinished(" in out and "x=6," in out, out  # shrunk to the smallest failing x
    assert "grading_plugin" not in out, out


# --- the feedback a student reads (course.feedback) ------------------------------------------

# given code in exercise 1.12's cell: an error it raises is shown at the student's call
POSITIVE = "def _positive(n):\n    if n < 0:\n        raise ValueError(f'a size must be >= 0, got {n}')\n    return n\n"
PLANTED = {  # wrong answers in exercises 1.11 and 1.12 (two functions: fork is left a stub)
    '"Exercise 1.11:': "#| export\n#| exercise 1.11\ndef causal_mask(n):\n    return np.triu(np.ones((n, n), dtype=bool))\n",
    '"Exercise 1.12:': ("#| export\n#| exercise 1.12\n" + POSITIVE + "\n\ndef cache_bytes(layers, tokens):\n"
                        "    if layers > 1:\n        return _positive(-layers)\n    return 2 * layers * tokens\n\n\n"
                        "def fork(blocks):\n    raise NotImplementedError('Exercise 1.12: fork')\n"),
}


def mask_rows(upper: bool) -> list[str]:
    """The rows of the 20 x 20 causal mask as NumPy prints them (the right one, or its transpose)."""
    import numpy as np

    mask = np.ones((20, 20), dtype=int)
    return [ln.strip(" []") for ln in str(np.triu(mask) if upper else np.tril(mask)).splitlines()]


def assert_whole_mask(message: str) -> None:
    expected, got = message.split("\nexpected\n", 1)[1].split("\ngot\n", 1)
    assert [ln.strip(" []") for ln in expected.splitlines()] == mask_rows(upper=False), message
    assert [ln.strip(" []") for ln in got.splitlines()][:20] == mask_rows(upper=True), message


def test_grader_shows_whole_messages_notes_lines_and_the_failing_function(course):
    path = edit(course, PLANTED)
    code = ("import json, sys\nfrom course.grade import run_tests, scoreboard\nfrom course.source import find_lesson\n"
            "r = run_tests(find_lesson('01'), sys.argv[1])\n"
            "print(json.dumps({t['name']: t for t in r.tests}))\nprint(scoreboard(r, 'x'))\n")
    env = {**os.environ, "MT_ROOT": str(course), "MT_CELL_TIME_LIMIT": "3"}
    proc = subprocess.run([sys.executable, "-c", code, str(path)], cwd=course, env=env, capture_output=True,
                          text=True, timeout=300)
    first, board = proc.stdout.split("\n", 1)
    tests = json.loads(first)
    # a wrong answer whose message is 40+ lines: expected and got both whole
    assert_whole_mask(tests["test_causal_mask"]["message"])
    # the call that should have raised
    assert tests["test_cache_bytes_rejects_negative"]["message"] == (
        "Failed: DID NOT RAISE ValueError\nExpected ValueError from: lesson.cache_bytes(-2, 4)")
    # an exception raised in the student's code: its note (the rank), the cell, the line and its source
    cell = next(i for i, c in enumerate(json.loads(path.read_text())["cells"]) if "def fork" in "".join(c["source"]))
    assert tests["test_cache_bytes_on_each_rank"]["message"] == (
        "ValueError: a size must be >= 0, got -2\n(raised on rank 1 of a simulated run with 2 ranks)\n"
        f"raised in your code: 01_sample.ipynb, cell {cell}, line 11, in cache_bytes:\n"
        "    return _positive(-layers)"), proc.stdout
    # the exercise is named by the function that failed (its second), not its first
    row = next(ln for ln in board.splitlines() if "] 1.12 " in ln)
    assert "fork" in row and "cache_bytes" not in row and "FAIL" in row, board
    assert "causal_mask(20):\n           expected\n           [[1 0 0" in board, board


LIVE_CELLS = [  # a notebook's cells, run by IPython as a kernel runs them (In[1] ... In[7])
    "import json\nimport numpy as np\nnp.set_printoptions(threshold=5)\nfrom course.check import check\n"
    "from course import pytest_plugin\n" + POSITIVE,
    "def causal_mask(n):\n    return np.triu(np.ones((n, n), dtype=bool))",
    "check('1.11')",
    "def cache_bytes(layers, tokens):\n    if layers > 1:\n        return _positive(-layers)\n"
    "    return 2 * layers * tokens\n\ndef fork(blocks):\n    return blocks.copy(1)",
    "check('1.12')",
    "print('RESULTS', json.dumps({r['name']: r for r in pytest_plugin.RESULTS}))",
    "print('THRESHOLD', np.get_printoptions()['threshold'])",
]


def test_check_cell_shows_whole_messages_notes_lines_and_the_failing_function(course):
    pytest.importorskip("IPython")
    code = ("import json, sys\nfrom IPython.core.interactiveshell import InteractiveShell\n"
            "shell = InteractiveShell.instance()\n"
            "for cell in json.loads(sys.argv[1]):\n    shell.run_cell(cell, store_history=True)\n")
    env = {**os.environ, "MT_ROOT": str(course)}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(LIVE_CELLS)], cwd=course / "lessons", env=env,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout
    mask = out.split("Exercise 1.11: 1 of 1 tests failed. First failure:\n  test_causal_mask:\n", 1)[1]
    assert_whole_mask("\n".join(ln.removeprefix("    ") for ln in mask.split("\nExercise 1.12")[0].splitlines()))
    # an exception in the student's code names the live cell, the line, its source and the function
    assert ("Exercise 1.12 (fork): 3 of 3 tests failed. First failure:\n  test_fork:\n"
            "    TypeError: list.copy() takes no arguments (1 given)\n"
            "    raised in your code: cell In[4], line 7, in fork:\n        return blocks.copy(1)\n") in out, out
    tests = json.loads(out.split("RESULTS ", 1)[1].splitlines()[0])
    assert tests["test_cache_bytes_rejects_negative"]["message"].endswith(
        "\nExpected ValueError from: lesson.cache_bytes(-2, 4)"), out
    assert tests["test_cache_bytes_on_each_rank"]["message"] == (
        "ValueError: a size must be >= 0, got -2\n(raised on rank 1 of a simulated run with 2 ranks)\n"
        "raised in your code: cell In[4], line 3, in cache_bytes:\n"
        "    return _positive(-layers)"), out
    assert "THRESHOLD 5" in out, "the student's own NumPy print options must be restored"


def test_long_arrays_are_summarised_by_numpy_and_absurd_messages_elided():
    import numpy as np

    from course.feedback import MAX_CHARS, elide, print_options

    with print_options():
        whole, summarised = str(np.linspace(0, 1, 300)), str(np.linspace(0, 1, 5000))
    assert "..." not in whole and whole.count(".") == 300
    assert "..." in summarised and len(summarised) < 1000
    got = np.arange(40.0).reshape(8, 5)
    with print_options(), pytest.raises(AssertionError) as info:  # numpy.testing keeps 3 lines of each
        np.testing.assert_allclose(got, got + 1)
    assert str(info.value).count("\n       [") == 2 * 7, f"all 8 rows of ACTUAL and DESIRED:\n{info.value}"
    message = "\n".join(f"line {i}" for i in range(5000))
    short = elide(message)
    assert len(short) <= MAX_CHARS + 100 and short.startswith("line 0\n") and short.endswith("line 4999")
    assert re.search(r"\.\.\. \(\d+ characters, \d+ lines elided\) \.\.\.", short), short
    assert elide("a\nb") == "a\nb"


def test_check_serialises_ast_parse_across_threads():
    """`make check` builds notebooks in threads; CPython 3.11's parser is not thread-safe
    (python/cpython#106905), so maintain makes every ast.parse in the process, the libraries'
    literal_eval included, take one lock, and doing it twice wraps it once."""
    import ast
    import threading

    from course.maintain import serialise_ast_parse

    serialise_ast_parse()
    first = ast.parse
    serialise_ast_parse()
    assert ast.parse is first and first.serialised
    inside = []
    lock_taken = threading.Event()

    def hold_the_lock():  # one thread inside a parse: another's literal_eval must wait for it
        with first.lock:
            lock_taken.set()
            inside.append("held")
            threading.Event().wait(0.2)
            inside.append("released")

    t = threading.Thread(target=hold_the_lock)
    t.start()
    lock_taken.wait()
    assert ast.literal_eval("['demo', 'gpu']") == ["demo", "gpu"]
    inside.append("parsed")
    t.join()
    assert inside == ["held", "released", "parsed"]
