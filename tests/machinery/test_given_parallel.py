"""Lesson 12's minitorch.parallel where the lesson's tests do not reach it: the ZeRO training step
(given), the batch check that runs on every rank before a step sends anything, and the MPI-only
timing helpers (allreduce_timings and the two it calls), which run inside an MPI run's processes
where the validation walk cannot see them: their contracts are checked there."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from minitorch import comm as mc
from minitorch import parallel as par
from minitorch.autograd import Tensor
from minitorch.nn import MLP, cross_entropy
from minitorch.optim import Adam

X = np.random.default_rng(0).standard_normal((7, 4))
Y = np.array([0, 2, 1, 1, 0, 2, 2])


def model():
    return MLP([4, 6, 3], rng=np.random.default_rng(1))


def zero_job(comm, stage):
    m = model()
    zero = par.ZeroAdam(comm, m, stage, lr=1e-2, reduce_scatter=par.ring_reduce_scatter,
                        allgather=par.ring_allgather)
    loss, held = par.zero_train_step(comm, m, zero, X, Y)
    zero.gather_params()
    return loss, held, [p.numpy().copy() for p in m.parameters()]


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_train_step_is_one_adam_step_on_the_whole_batch(stage):
    single = model()
    opt = Adam(single.parameters(), lr=1e-2)
    loss = cross_entropy(single(Tensor(X.astype(np.float32))), Y)
    loss.backward()
    opt.step()
    res = mc.run(zero_job, 3, stage)
    assert sum(r[0] for r in res.results) == pytest.approx(loss.item(), rel=1e-6)
    for r, (_, held, params) in enumerate(res.results):
        assert held["optimizer"] == 3 * len(range(*mc.chunk_bounds(sum(p.size for p in single.parameters()), 3)[r]))
        for got, want in zip(params, single.parameters()):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"stage {stage}, rank {r}")


def refused_before_sending(comm):
    m = model()
    zero = par.ZeroAdam(comm, m, 3, reduce_scatter=par.ring_reduce_scatter, allgather=par.ring_allgather)
    found = []
    for x, y in ((X, Y[:5]), (X, Y - 1), (X[0], Y), (X, Y.astype(float))):
        try:
            par.zero_train_step(comm, m, zero, x, y)
        except (TypeError, ValueError) as exc:
            found.append(str(exc))
    return found, comm.stats["bytes_sent"]


def test_a_bad_batch_is_refused_on_every_rank_before_anything_is_sent():
    for found, sent in mc.run(refused_before_sending, 2).results:
        assert sent == 0 and len(found) == 4, (sent, found)
        assert found[0] == "zero_train_step: X and y must have one row per label, got X of shape (7, 4) and y of " \
                           "shape (5,)"
        assert found[1] == "zero_train_step: y must hold class indices >= 0, got -1 at index 0"
        assert found[2].startswith("zero_train_step: X must be an array of 2 axes (B, d) of dtype real, got an array "
                                 "of shape (4,)")
        assert found[3].startswith("zero_train_step: y must be an array of 1 axis (B,) of dtype int")
    par.check_batch("dp_train_step", X, Y)
    par.check_batch("dp_train_step", X[:0], Y[:0])


def timings(comm):
    rows = par.allreduce_timings(comm, [64, 8 * 1001], budget=0.002)
    refused = []
    for call in (lambda: par.allreduce_timings(comm, [4]), lambda: par.mpi_best_seconds([], 0.01),
                 lambda: par.mpi_best_seconds([print], -1.0), lambda: par.mpi4py_ring_allreduce(comm, np.ones(3))):
        try:
            call()
        except (TypeError, ValueError) as exc:
            refused.append(str(exc))
    return rows, refused


def test_the_mpi_timings_run_under_mpi_and_refuse_bad_arguments(tmp_path, monkeypatch):
    if not mc.mpi_status()[0]:
        pytest.skip(f"MPI cannot start here: {mc.mpi_status()[1]}")
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rows, refused = mc.run(timings, 2, engine="mpi", timeout=120).results[0]
    assert [r[0] for r in rows] == [64, 8 * 1001] and all(t > 0 for r in rows for t in r[1:]), rows
    assert refused == ["allreduce_timings: sizes[0] must be an integer >= 8, got 4",
                       "mpi_best_seconds: ops must be a sequence of at least 1 items, got []",
                       "mpi_best_seconds: budget must be a finite number > 0, got -1.0",
                       "mpi4py_ring_allreduce: world must be an object with `Sendrecv`, `Get_size`, `Get_rank`, got "
                       "<MPIComm rank 0 of 2> (MPIComm)"], refused


def test_the_cost_model_and_memory_formulas_refuse_what_they_cannot_price():
    for call, error, message in (
            (lambda: par.collective_cost("tree", 1e6, 4, 1e-6, 1e-9), ValueError,
             "collective_cost: name must be one of 'naive_allreduce', .*got 'tree'"),
            (lambda: par.collective_cost("ring_allreduce", 1e6, 4, -1e-6, 1e-9), ValueError,
             "collective_cost: alpha must be a finite number >= 0, got -1e-06"),
            (lambda: par.zero_memory_per_rank(1e9, 0, 1), ValueError,
             "zero_memory_per_rank: nranks must be an integer >= 1, got 0"),
            (lambda: par.make_buckets([np.ones(3)], 4), TypeError,
             r"make_buckets: params\[0\] must be a minitorch Tensor, got an array"),
            (lambda: par.Block(0, np.random.default_rng(0)), ValueError, "Block: width must be an integer >= 1, got 0")):
        with pytest.raises(error, match=message):
            call()
    assert copy.copy(par.collective_cost("ring_allreduce", 8e6, 4, 0.0, 1e-9)).bytes == pytest.approx(1.2e7)
