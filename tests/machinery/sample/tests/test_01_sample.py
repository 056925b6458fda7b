import math

import numpy as np
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


@pytest.mark.exercise("1.11")
def test_causal_mask(lesson):
    n = 20  # 400 elements: printed whole; a larger mask would be summarised by NumPy
    want = np.tril(np.ones((n, n), dtype=bool))
    got = np.asarray(lesson.causal_mask(n))
    assert np.array_equal(got, want), f"causal_mask({n}):\nexpected\n{want.astype(int)}\ngot\n{got.astype(int)}"


@pytest.mark.exercise("1.12")
def test_fork(lesson):
    blocks = [3, 1, 4]
    assert lesson.fork(blocks) == blocks and lesson.fork(blocks) is not blocks


@pytest.mark.exercise("1.12")
def test_cache_bytes_rejects_negative(lesson):
    with pytest.raises(ValueError):
        lesson.cache_bytes(-2, 4)


@pytest.mark.exercise("1.12")
def test_cache_bytes_on_each_rank(lesson):
    for rank in range(2):  # as a simulated run reports a failure: a note names the rank
        try:
            assert lesson.cache_bytes(rank + 1, 7) == 14 * (rank + 1)
        except Exception as exc:
            exc.add_note(f"(raised on rank {rank} of a simulated run with 2 ranks)")
            raise
