"""Lesson 07's tracer (minitorch.cuda_trace, given): a strided copy and a shared-memory kernel with a
two-way bank conflict, small enough to count by hand, against every question Trace answers. Runs
under Numba's CUDA simulator (tests/conftest.py turns it on where there is no GPU); `simulate` runs
the kernel's Python function either way."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from minitorch.cuda_trace import Trace, TracedArray, simulate


@cuda.jit
def strided_copy(x, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = x[2 * i]


@cuda.jit
def shared_stride_two(x, out):
    s = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    s[2 * t] = x[t]  # words 2t: threads t and t + 16 share a bank
    cuda.syncthreads()
    out[t] = s[2 * t]


def traced(**arrays):
    tr = Trace()
    return tr, {name: TracedArray(a, name, tr) for name, a in arrays.items()}


def test_strided_copy_counts_requests_and_coalescing():
    x, out = np.arange(80, dtype=np.float32), np.zeros(40, np.float32)
    tr, t = traced(x=x, out=out)
    assert simulate(strided_copy, 2, 32, t["x"], t["out"], trace=tr) is tr
    np.testing.assert_array_equal(out, x[::2])
    np.testing.assert_array_equal(tr.counts("x"), np.arange(80) % 2 == 0)
    np.testing.assert_array_equal(tr.counts("out", "w"), np.ones(40))
    req = tr.requests("x")
    assert sorted(req) == [((0, 0, 0), 0, 0), ((1, 0, 0), 0, 0)], sorted(req)
    assert req[((0, 0, 0), 0, 0)] == list(range(0, 64, 2)) and req[((1, 0, 0), 0, 0)] == list(range(64, 80, 2))
    assert tr.coalescing("x") == pytest.approx(160 / 320), "40 floats asked for, 10 sectors of 32 bytes fetched"
    assert tr.coalescing("out", "w") == 1.0
    assert tr.coalescing("x", sector=128) == pytest.approx(160 / 384)
    assert tr.lane_utilization("out") == pytest.approx(40 / 64), "warps of 32 and 8 active lanes"
    assert tr.active_warps("out") == 2 and tr.steps("x") == 1 and tr.shared_names() == []
    assert tr.per_thread("x") == {((b, 0, 0), i): 1 for b, n in ((0, 32), (1, 8)) for i in range(n)}
    assert len(tr.of("x")) == 40 and tr.of("x", "w") == [] and len(tr.of("out")) == 40
    with pytest.raises(ValueError, match=r"Trace.lane_utilization: name must be a traced array, .*got 'y'"):
        tr.lane_utilization("y")
    with pytest.raises(ValueError, match=r"Trace.requests: kind must be one of 'r', 'w', got 'x'"):
        tr.requests("x", "x")


def test_shared_memory_bank_conflicts_and_steps():
    x, out = np.arange(32, dtype=np.float32), np.zeros(32, np.float32)
    tr, t = traced(x=x, out=out)
    simulate(shared_stride_two, 1, 32, t["x"], t["out"], trace=tr)
    np.testing.assert_array_equal(out, x)
    (sh,) = tr.shared_names()
    assert tr.bank_conflicts(sh) == 2 and tr.bank_conflicts(sh, "w", banks=64) == 1
    assert tr.steps(sh) == 2, "a write step and a read step, one barrier apart"
    assert tr.lane_utilization(sh, "r") == 1.0


def test_simulate_refuses_bad_launches():
    out = np.zeros(4, np.float32)
    for grid, block in ((0, 32), (1, (32, 0)), (1, 2048), (1, (1, 1, 1, 1))):
        with pytest.raises(ValueError, match=r"simulate: (grid|block) must be"):
            simulate(strided_copy, grid, block, np.zeros(8, np.float32), out)
    with pytest.raises(TypeError, match=r"simulate: block must be .*got 32.0"):
        simulate(strided_copy, 1, 32.0, np.zeros(8, np.float32), out)
