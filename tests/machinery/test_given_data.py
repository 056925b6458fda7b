"""Lesson 03's generated data sets (minitorch.data, given code): shapes, dtypes, labels, seeding,
and the refusal of a bad size, noise or generator by name."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch import data


@pytest.mark.parametrize("make,n,classes,features", [(data.make_moons, 11, 2, 2), (data.make_spirals, 13, 3, 2),
                                                     (data.make_digits, 23, 10, 64)])
def test_generators_shapes_labels_and_seeds(make, n, classes, features):
    X, y = make(n, rng=np.random.default_rng(0))
    assert X.shape == (n, features) and X.dtype == np.float32 and y.shape == (n,) and y.dtype == np.int64
    assert set(np.unique(y)) <= set(range(classes)) and np.all(np.isfinite(X))
    X2, y2 = make(n, rng=np.random.default_rng(0))
    assert np.array_equal(X, X2) and np.array_equal(y, y2), "the same seed gives the same data"


def test_spirals_and_digits_options():
    X, y = data.make_spirals(12, noise=0.0, classes=4, turns=0.5, rng=np.random.default_rng(1))
    assert np.bincount(y).tolist() == [3, 3, 3, 3]
    radius = np.hypot(X[:, 0], X[:, 1])
    assert radius.min() >= 0.05 - 1e-6 and radius.max() <= 1 + 1e-6
    X, y = data.make_digits(7, noise=0.0, size=5, rng=np.random.default_rng(2))
    assert X.shape == (7, 25) and X.min() >= 0 and X.max() <= 1


@pytest.mark.parametrize("make", [data.make_moons, data.make_spirals, data.make_digits])
def test_generators_refuse_bad_arguments(make):
    name = make.__name__
    for kwargs, error, message in (({"n": 0}, ValueError, f"{name}: n must be an integer >= 1, got 0"),
                                   ({"n": 2.5}, TypeError, f"{name}: n must be an integer >= 1, got 2.5"),
                                   ({"noise": -0.1}, ValueError, f"{name}: noise must be .* >= 0, got -0.1"),
                                   ({"rng": 0}, TypeError, f"{name}: rng must be a Generator, got 0")):
        with pytest.raises(error, match=message):
            make(**{"n": 5, **kwargs})
    with pytest.raises(ValueError, match="make_spirals: classes must be an integer >= 1, got 0"):
        data.make_spirals(5, classes=0)
