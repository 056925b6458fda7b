"""Lesson 09's attention module (minitorch.attention) where the lesson's tests cannot feed the
validation walk: online_softmax_stats reads a stream, and the tests' streams are generators, which
the walk cannot copy to replay. A list of blocks is a stream too; its statistics are checked here."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch.attention import online_softmax_stats


def test_online_softmax_stats_of_a_list_of_blocks():
    x = np.random.default_rng(5).standard_normal((3, 7))
    x[2] = -np.inf
    m, l = online_softmax_stats([x[:, :3], x[:, 3:3], x[:, 3:]])
    np.testing.assert_array_equal(m, x.max(axis=1))
    want = np.exp(x[:2] - x[:2].max(axis=1, keepdims=True)).sum(axis=1)
    np.testing.assert_allclose(l, [*want, 0.0], rtol=1e-12, atol=0)
    with pytest.raises(TypeError, match=r"online_softmax_stats: blocks must be an iterable of \(rows, w\) arrays, got None"):
        online_softmax_stats(None)
