import math

import pytest

pytestmark = pytest.mark.lesson01


@pytest.mark.exercise("1.1")
def test_double(lesson):
    assert lesson.double(3) == 6, f"double(3) should be 6, got {lesson.double(3)}"


@pytest.mark.exercise("1.2")
def test_area(lesson):
    assert math.isclose(lesson.Circle(2.0).area(), 4 * math.pi)
