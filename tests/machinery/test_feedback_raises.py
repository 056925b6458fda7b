"""When a test expects an exception and another one comes, the student reads which was expected and
which was raised (course.feedback), as well as the message of the one raised."""

from __future__ import annotations

import sys

import pytest

from course.feedback import describe

TEST = '''
import pytest

def f(x):
    if x == "2":
        raise TypeError("f: x must be an integer, got '2'")
    return x

def test_refuses_a_str():
    with pytest.raises(ValueError):
        f("2")

def test_passes_through():
    f("2")
'''


def _excinfo(tmp_path, name):
    path = tmp_path / "test_sample_raises.py"
    path.write_text(TEST)
    ns: dict = {}
    exec(compile(TEST, str(path), "exec"), ns)
    try:
        ns[name]()
    except BaseException:  # noqa: BLE001
        return pytest.ExceptionInfo.from_exc_info(sys.exc_info()), str(path)
    raise AssertionError("the sample test did not fail")


def test_the_message_names_the_expected_and_the_raised_exception(tmp_path):
    info, path = _excinfo(tmp_path, "test_refuses_a_str")
    message = describe(info, path).message
    assert message.startswith("Expected ValueError, but TypeError was raised:\nTypeError: f: x must be an integer"), message


def test_an_error_outside_a_raises_block_is_reported_as_it_is(tmp_path):
    info, path = _excinfo(tmp_path, "test_passes_through")
    assert describe(info, path).message.startswith("TypeError: f: x must be an integer"), describe(info, path).message
