"""The seam between tests and the code they grade.

Every test receives the fixture `lesson`: a namespace with the lesson's names, loaded from the
implementation chosen by `--impl` (reference | solution | stub | path/to/notebook.ipynb), or the
live notebook namespace when a check cell runs the tests.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from course.gpu import driver_present

# The CUDA simulator must be chosen before numba is first imported (lesson 07).
if not driver_present():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Write nothing to disk; the same examples every run (the same code always gets the same
# verdict); one failure reported, with its falsifying example, not "N distinct failures".
# Hypothesis caches what it learns in a .hypothesis folder beside the current directory (the
# lessons/ folder when a check cell runs): keep it in the temp dir, away from students' files.
import tempfile  # noqa: E402

from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), f"minitorch-hypothesis-{os.getuid()}"))
settings.register_profile("course", database=None, deadline=None, derandomize=True,
                          report_multiple_bugs=False, print_blob=False)
settings.load_profile("course")

from course import loader  # noqa: E402
from course.pytest_plugin import exercise_of  # noqa: E402
from course.source import find_lesson  # noqa: E402

pytest_plugins = ["course.pytest_plugin", "course.grading_plugin"]  # grading_plugin: the hidden marker, time limits in Hypothesis tests
collect_ignore = ["machinery/sample"]  # a sample course the machinery tests copy and grade

_loaded: dict[tuple[str, str], loader.LessonNamespace] = {}


def pytest_addoption(parser):
    parser.addoption("--impl", default=os.environ.get("MT_IMPL", "reference"),
                     help="reference | solution | stub | only:L.K | isolated | path to a lesson notebook")
    parser.addoption("--exercise", default=None, help="run only this exercise's tests, e.g. 1.2")


def pytest_configure(config):
    """MT_WALK=<file> (make check's reference stage): the validation walk harvests this run's calls
    and, when the run ends, walks the public callables they reached (course.validation_walk)."""
    path = os.environ.pop("MT_WALK", None)  # this process's own: the processes its tests start do not walk
    if path and config.getoption("--impl") == "reference":
        from course.validation_walk import WalkPlugin

        config.pluginmanager.register(WalkPlugin(path), "validation-walk")


def pytest_collection_modifyitems(config, items):
    wanted = config.getoption("--exercise")
    isolated = config.getoption("--impl") == "isolated"  # the tests of exercises, each on only:<its own>
    if wanted or isolated:
        keep = [it for it in items if (ex := exercise_of(it)) is not None and (ex == wanted or not wanted)]
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep
    if any(it.get_closest_marker("gpu") for it in items):
        from course.gpu import gpu_status

        ok, reason = gpu_status()
        if not ok:
            skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}")
            for it in items:
                if it.get_closest_marker("gpu"):
                    it.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """--impl=isolated: the namespace this test sees is that of its own exercise (loader.Isolated)."""
    loader.Isolated.exercise = exercise_of(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that needs NVRTC where there is none (macOS, no `gpu` extra) is skipped with the reason,
    not failed: course.cuda_c.compile_ptx raises NvrtcUnavailable."""
    outcome = yield
    rep = outcome.get_result()
    if call.excinfo is not None and rep.failed:
        from course.cuda_c import NvrtcUnavailable

        if isinstance(call.excinfo.value, NvrtcUnavailable):
            rep.outcome = "skipped"
            rep.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")


def lesson_of(path: str):
    m = re.match(r"test_(\d\d)_", Path(path).name)
    if not m:
        raise LookupError(f"{path}: test files are named test_NN_topic.py")
    return find_lesson(m.group(1))


@pytest.fixture(scope="module")
def lesson(request):
    les = lesson_of(request.module.__file__)
    if les.number in loader.LIVE:
        return loader.LIVE[les.number]
    impl = request.config.getoption("--impl")
    key = (les.number, impl)
    if key not in _loaded:
        _loaded[key] = loader.Isolated(les) if impl == "isolated" else loader.load(les, impl)
    return _loaded[key]


def _load_helper(name: str):
    """tests/<name>.py, a module shared by several test files (not a test file itself), loaded
    by path once: tests/ is not a package, and check cells import test files in importlib mode."""
    import importlib.util
    import sys

    key = f"minitorch_tests_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def reference_module(name: str):
    """minitorch.<name>, the reference of the lesson's own module, which a test may use as the stand-in
    for the other exercises' code (so that each exercise is graded on its own); None in a class release,
    which withholds it (course/lessons.json says so): there the other exercises are the student's own."""
    import importlib

    from course.source import release_index

    index = release_index()
    if index is not None and name in index.get("withheld", {}):
        return None
    return importlib.import_module("minitorch." + name)


@pytest.fixture(scope="session")
def standin():
    """standin("compiler") -> the reference module minitorch.compiler, or None in a release that withholds it."""
    return reference_module


@pytest.fixture(scope="session")
def test_helper():
    """test_helper("strict_device") -> the module tests/strict_device.py."""
    return _load_helper
