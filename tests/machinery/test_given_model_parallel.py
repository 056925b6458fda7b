"""Lesson 13's minitorch.model_parallel where the lesson's tests do not reach it: the demo's MLP
(Dense, mlp_layers), the timed pipeline and the pipeline timings (run on the simulator here: under
MPI they time the wall clock), the intervals and bubble read back from a run's timeline, and the
Gantt charts."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch import comm as mc
from minitorch import model_parallel as mp
from minitorch.autograd import Tensor
from minitorch.nn import MLP


def test_the_demo_mlp_is_float64_and_seeded():
    layers = mp.mlp_layers(3, 6, 4, seed=2)
    assert [type(layer) for layer in layers] == [mp.Dense] * 3
    x = Tensor(np.random.default_rng(0).standard_normal((5, 6)))
    h = layers[1](layers[0](x))
    y = layers[2](h)
    assert y.dtype == np.float64 and y.shape == (5, 4)
    assert np.all(np.abs(h.numpy()) < 1), "hidden layers end in tanh"
    w, b = layers[2].lin.weight.numpy(), layers[2].lin.bias.numpy()
    np.testing.assert_allclose(y.numpy(), h.numpy() @ w + b, rtol=1e-12)  # the output layer has no tanh
    again = mp.mlp_layers(3, 6, 4, seed=2)
    assert all(np.array_equal(a.lin.weight.numpy(), b.lin.weight.numpy()) for a, b in zip(layers, again))
    model = MLP([3, 4, 2], rng=np.random.default_rng(0))
    assert mp.float64_model(model) is model and {p.dtype for p in model.parameters()} == {np.dtype(np.float64)}
    with pytest.raises(ValueError, match="Dense: n_in must be an integer >= 1, got 0"):
        mp.Dense(0, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="mlp_layers: width must be an integer >= 1, got 0"):
        mp.mlp_layers(2, 0)


def test_timed_pipeline_and_the_intervals_read_back_from_its_run():
    res = mc.run(mp.timed_pipeline, 2, 8, 6, 3, 1)
    (best0, t0), (best1, _) = res.results
    assert best0 == best1 > 0 and t0 > 0, res.results
    iv = mp.pipeline_intervals(res, since=t0)
    assert len(iv) == 2 * 2 * 3, "one F and one B per micro-batch on each of 2 stages"
    assert {(i.stage, i.step.kind) for i in iv} == {(s, k) for s in (0, 1) for k in "FB"}
    assert min(i.start for i in iv) == 0.0
    bubble = mp.measured_bubble(iv, 2)
    assert 0 < bubble < 1, bubble
    assert mp.measured_bubble([mp.Interval(0, mp.Step("F", 0), 0.0, 1.0)], 1) == 0.0
    with pytest.raises(ValueError, match="measured_bubble: intervals must be a sequence of at least 1 items, got"):
        mp.measured_bubble([], 2)
    kept = []
    mc.run(lambda comm: kept.append(comm), 2)
    with pytest.raises(ValueError, match="timed_pipeline: width must be an integer >= 5, got 4"):
        mp.timed_pipeline(kept[0], 4, 6, 3, 1)  # refused before the communicator (of a finished run) is used


def test_pipeline_timings_time_one_rank_alone_then_the_pipeline():
    res = mc.run(mp.pipeline_timings, 2, 8, 6, 3, 1)
    (alone, pipe0), (none, pipe1) = res.results
    assert none is None and len(alone) == 2 and all(t > 0 for t in alone) and pipe0[0] == pipe1[0] > 0


def test_gantt_charts_of_a_schedule_and_of_intervals():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = mp.simulate_schedule(mp.one_f_one_b_schedule(3, 4))
    ax = tl.plot(title="1F1B")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    assert ax.get_title() == "1F1B" and ax.get_xlabel() == "time units"
    assert len(ax.texts) == 3 * 8, "every step labelled with its micro-batch"
    _, ax2 = plt.subplots()
    assert mp.plot_pipeline(tl.intervals[:2], 3, ax=ax2, unit="ms") is ax2 and ax2.get_xlabel() == "ms"
    plt.close("all")
    with pytest.raises(ValueError, match="plot_pipeline: p must be an integer >= 1, got 0"):
        mp.plot_pipeline(tl.intervals, 0)


def test_the_planner_records_refuse_what_cannot_be_planned():
    assert mp.ClusterSpec(4, float("inf"), float("inf"), 0.0, 0.0).flop_rate == float("inf")  # no limit, instant
    for call, error, message in (
            (lambda: mp.ModelSpec(4, 64, 0, 32, 8), ValueError, "ModelSpec: n_head must be an integer >= 1, got 0"),
            (lambda: mp.ClusterSpec(4, 0.0, 1e12, 1e-6, 1e-9), ValueError, "ClusterSpec: memory must be > 0, got 0.0"),
            (lambda: mp.ClusterSpec(4, 1e9, 1e12, -1e-6, 1e-9), ValueError,
             "ClusterSpec: alpha must be a finite number >= 0, got -1e-06"),
            (lambda: mp.ClusterSpec(4, 1e9, 1e12, 1e-6, 1e-9, beta_node="fast"), TypeError,
             "ClusterSpec: beta_node must be a finite number >= 0, got 'fast'"),
            (lambda: mp.Plan(2, 1, 2.0, 1), TypeError, "Plan: pp must be an integer >= 1, got 2.0")):
        with pytest.raises(error, match=message):
            call()
