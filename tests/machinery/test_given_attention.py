"""Lesson 09's attention module (minitorch.attention) where the lesson's tests cannot feed the
validation walk: online_softmax_stats reads a stream, and the tests' streams are generators, which
the walk cannot copy to replay. A list of blocks is a stream too; its statistics are checked here. And
the GPU reference no lesson test calls, PyTorch's SDPA on CuPy arrays."""

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


def test_attention_torch_sdpa_checks_and_says_what_it_needs():
    """PyTorch's SDPA is the GPU reference (issue 43): where PyTorch with CUDA is missing it says so; bad
    operands are refused by the argument rules first."""
    import numpy as np

    from minitorch import attention as att

    q = np.ones((2, 8, 4), np.float32)
    with pytest.raises(ValueError, match=r"attention_torch_sdpa: q must be an array of 3 axes \(G, N, d\)"):
        att.attention_torch_sdpa(q[0], q, q)
    if not att.torch_sdpa_available():
        with pytest.raises(RuntimeError, match="attention_torch_sdpa: needs PyTorch with CUDA"):
            att.attention_torch_sdpa(q, q, q)


@pytest.mark.gpu
def test_gpu_attention_torch_sdpa_matches_the_tiled_kernel():
    import cupy as cp
    import numpy as np

    from minitorch import attention as att

    if not att.torch_sdpa_available():
        pytest.skip("PyTorch with CUDA is not installed here")
    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal((3, 130, 64)).astype(np.float32)) for _ in range(3))
    for causal in (False, True):
        want = att.flash_attention_cuda(q, k, v, causal=causal)[0]
        assert cp.allclose(att.attention_torch_sdpa(q, k, v, causal=causal), want, rtol=1e-3, atol=1e-4), causal
