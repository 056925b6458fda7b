import math

import pytest

pytestmark = pytest.mark.lesson01


@pytest.mark.exercise("1.1")
def test_double(lesson):
    assert lesson.double(3) == 6, f"double(3) should be 6, got {lesson.double(3)}"


@pytest.mark.exercise("1.2")
def test_area(lesson):
    assert math.isclose(lesson.Circle(2.0).area(), 4 * math.pi)


@pytest.mark.exercise("1.3")
def test_plus3(lesson):
    assert lesson.plus3(1) == 4


@pytest.mark.exercise("1.4")
def test_plus4(lesson):
    assert lesson.plus4(1) == 5


@pytest.mark.exercise("1.5")
def test_plus5(lesson):
    assert lesson.plus5(1) == 6


@pytest.mark.exercise("1.6")
def test_plus6(lesson):
    assert lesson.plus6(1) == 7


@pytest.mark.exercise("1.7")
def test_plus7(lesson):
    assert lesson.plus7(1) == 8


@pytest.mark.exercise("1.8")
def test_plus8(lesson):
    assert lesson.plus8(1) == 9


@pytest.mark.exercise("1.9")
@pytest.mark.parametrize(
    "x",
    [1, 2, 3],
)
def test_plus9(lesson, x):
    assert lesson.plus9(x) == x + 9


@pytest.mark.exercise("1.10")
def test_plus10(lesson):
    assert lesson.plus10(1) == 11
