"""Lesson 16's minitorch.moe where the lesson's tests do not reach it: the models its demo trains
(dense_gpt with DenseMLP, MoEGPT), their cost count, one expert's NumPy MLP, the all-to-all's
argument checks off its fast path, and the MPI-only timing helpers (alltoall_timings and the raw
mpi4py exchange), which run inside an MPI run's processes where the validation walk cannot see
them: their contracts are checked there."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch import comm as mc
from minitorch import moe
from minitorch.autograd import Tensor
from minitorch.gpt import GPTConfig, gelu_np

CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)


def test_dense_and_moe_gpts_and_their_costs():
    dense = moe.dense_gpt(CFG, 16, seed=3)
    assert all(isinstance(b.mlp, moe.DenseMLP) for b in dense.blocks)
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32))
    y = dense.blocks[0].mlp(x)
    assert y.shape == (2, 3, 8) and y.dtype == np.float32
    sparse = moe.MoEGPT(CFG, 4, 2, 16, seed=3)
    idx = np.random.default_rng(1).integers(0, 11, (2, 5))
    sparse.train()
    logits, loss = sparse(idx, idx)
    assert logits.shape == (2, 5, 11) and loss.size == 1
    assert len(sparse.load_history) == 1 and sparse.load_history[0].shape == (2, 4)
    assert sparse.load_history[0].sum(axis=1).tolist() == [2 * 5 * 2] * 2, "every token goes to 2 experts per layer"
    base = moe.MoEGPT(CFG, 4, 2, 16, aux_coef=0.0, z_coef=0.0, seed=3)
    base.train()
    assert loss.item() > base(idx, idx)[1].item(), "the balancing losses add to the loss in training"
    d_costs, m_costs = moe.mlp_costs(dense), moe.mlp_costs(sparse)
    per_mlp = 8 * 16 + 16 + 16 * 8 + 8
    assert d_costs["mlp_params"] == d_costs["active_mlp_params"] == 2 * per_mlp
    expert = 2 * 8 * 16
    assert m_costs["mlp_params"] == 2 * (8 * 4 + 4 * expert)
    assert m_costs["active_mlp_params"] == 2 * (8 * 4 + 2 * expert) and m_costs["mlp_flops_per_token"] == \
        2.0 * m_costs["active_mlp_params"]
    for call, error, message in (
            (lambda: moe.MoEGPT(CFG, 4, 5, 16), ValueError, r"MoEMLP: k must be in \[1, 4\], got 5"),
            (lambda: moe.MoEGPT(CFG, 4, 2, 16, aux_coef=-0.1), ValueError, "MoEGPT: aux_coef must be a finite number "
                                                                          ">= 0, got -0.1"),
            (lambda: moe.dense_gpt(CFG, 0), ValueError, "dense_gpt: hidden must be an integer >= 1, got 0"),
            (lambda: sparse(idx[0]), ValueError, r"MoEGPT.forward: idx must be an array of 2 axes \(B, T\)"),
            (lambda: moe.MoEMLP(8, 4, 2, 16, dtype=np.int32), TypeError, "MoEMLP: dtype must be a floating NumPy "
                                                                         "dtype .*, got int32")):
        with pytest.raises(error, match=message):
            call()


def test_one_experts_numpy_mlp():
    rng = np.random.default_rng(2)
    x, w1, w2 = rng.standard_normal((5, 3)), rng.standard_normal((3, 7)), rng.standard_normal((7, 3))
    np.testing.assert_allclose(moe.expert_ffn_np(x, w1, w2), gelu_np(x @ w1) @ w2, rtol=1e-12)
    with pytest.raises(ValueError, match=r"expert_ffn_np: need x \(n, C\), w1 \(C, H\), w2 \(H, C\), got x \(5, 3\), "
                                         r"w1 \(3, 7\), w2 \(3, 7\)"):
        moe.expert_ffn_np(x, w1, w1.T.copy().T)


def test_the_all_to_all_argument_checks_off_the_fast_path():
    kept = []
    mc.run(lambda comm: kept.append(comm), 2)
    comm = kept[0]
    np.testing.assert_array_equal(moe.check_a2a_args("f", comm, [[1, 2]], 0), [[1, 2]])
    for args, error, message in (
            (("not a comm", np.ones((2, 1)), 0), TypeError, "f: comm must be an object with `rank`, `size`"),
            ((comm, "rows", 0), TypeError, "f: x must be an array of dtype number, got 'rows'"),
            ((comm, np.float64(2.0), 0), ValueError, r"f: x must be rows \(n, ...\), got an array of shape \(\)"),
            ((comm, np.ones((2, 1)), -1), ValueError, r"f: tag must be in \[0, 1048575\], got -1"),
            ((comm, np.ones((2, 1)), 0.5), TypeError, r"f: tag must be an integer, got 0.5 \(float\)")):
        with pytest.raises(error, match=message):
            moe.check_a2a_args("f", *args)
    # and through all_to_all itself, before anything is sent (the run has ended: a message would fail)
    with pytest.raises(TypeError, match=r"all_to_all: x must be an array of dtype number, got None"):
        moe.all_to_all(comm, None, [0, 0], [0, 0])
    with pytest.raises(ValueError, match=r"all_to_all: tag must be in \[0, 1048575\], got 1048576"):
        moe.all_to_all(comm, np.ones((2, 1)), [1, 1], [1, 1], tag=2**20)
    with pytest.raises(TypeError, match=r"exchange_counts: send_counts\[0\] must be an integer, got 1.5 \(float\)"):
        moe.exchange_counts(comm, np.array([1.5, 1.0]))


def timings(comm):
    rows = moe.alltoall_timings(comm, [256, 4096], budget=0.002)
    refused = []
    for call in (lambda: moe.alltoall_timings(comm, [8]),
                 lambda: moe.mpi4py_all_to_all(np.ones((2, 8), np.float32), [1, 1], [1, 1]),
                 lambda: moe.mpi4py_all_to_all(np.ones((2, 8)), [1, -1], [1, 1])):
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
    assert [r[0] for r in rows] == [256, 4096] and all(t > 0 for r in rows for t in r[1:]), rows
    assert refused == ["alltoall_timings: sizes[0] must be an integer >= 64, got 8",
                       "mpi4py_all_to_all: x must be an array of 2 axes of dtype float64, got an array of shape (2, 8) "
                       "and dtype float32",
                       "mpi4py_all_to_all: send_counts[1] must be an integer >= 0, got -1"], refused


def test_the_moe_spec_refuses_what_cannot_be_planned():
    spec = dict(name="s", n_layer=2, d_model=16, n_head=4, n_kv_head=2, d_ff=24, n_experts=8, k=2, vocab=40, seq_len=8,
                batch=4)
    assert moe.MoESpec(**spec).active_params < moe.MoESpec(**spec).total_params
    for change, error, message in (({"k": 9}, ValueError, r"MoESpec: k must be in \[1, 8\], got 9"),
                                   ({"n_kv_head": 3}, ValueError, "MoESpec: n_kv_head must divide n_head=4, got 3"),
                                   ({"batch": 0}, ValueError, "MoESpec: batch must be >= 1, got 0"),
                                   ({"name": None}, TypeError, "MoESpec: name must be a str, got None")):
        with pytest.raises(error, match=message):
            moe.MoESpec(**{**spec, **change})
