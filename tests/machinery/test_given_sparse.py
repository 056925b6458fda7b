"""Lesson 18's given code that no exercise test calls (minitorch.sparse): the weights pruning acts on,
the masked fine-tuning loop, the 2:4 helpers (decompress, bytes, masks from scores), the timing child
process, the break-even interpolation and the GPU model. Small inputs; each test checks what the
function promises (and feeds the validation walk a call to replay)."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch.gpt import GPT, GPTConfig
from minitorch.sparse import (CSR, GPU_KINDS, break_even, compress_2_4, decompress_2_4, finetune, gpu_matmul_time,
                              lm_step_loss, mask_2_4, mask_sparsity, prunable_weights, sparse24_nbytes, sparse_timings,
                              to_csr)


@pytest.fixture(scope="module")
def gpt():
    return GPT(GPTConfig(vocab_size=9, block_size=8, n_layer=2, n_head=2, n_embd=8), seed=1)


def test_prunable_weights_are_the_block_matrices_themselves(gpt):
    weights = prunable_weights(gpt)
    assert list(weights) == [f"blocks.{i}.{n}.weight" for i in range(2)
                             for n in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")]
    params = dict(gpt.named_parameters())
    assert all(weights[n] is params[n].data for n in weights), "the parameters' own arrays, not copies"
    assert mask_sparsity({n: np.arange(w.size).reshape(w.shape) % 4 != 0 for n, w in weights.items()}) == 0.25
    assert mask_sparsity({}) == 0.0


def test_finetune_calls_its_hooks_and_lowers_the_loss(gpt):
    ids = np.random.default_rng(0).integers(0, 9, 400)
    calls = []
    model = GPT(gpt.config, seed=2)
    x, y = ids[None, :8], ids[None, 1:9]
    assert abs(lm_step_loss(model, x, y).item() - model(x, y)[1].item()) < 1e-12
    losses = finetune(model, ids, 12, batch_size=4, lr=3e-3, seed=1, on_grads=lambda: calls.append("grads"),
                      on_step=lambda: calls.append("step"))
    assert len(losses) == 12 and calls == ["grads", "step"] * 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    frozen = GPT(gpt.config, seed=3)
    wte = frozen.wte.weight.numpy().copy()
    finetune(frozen, ids, 2, params=[frozen.blocks[0].mlp.fc.weight], batch_size=2)
    assert np.array_equal(frozen.wte.weight.numpy(), wte), "only the parameters passed are trained"


def test_decompress_bytes_and_masks_from_scores():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 20))
    values, meta = compress_2_4(a)
    dense = decompress_2_4(values, meta)
    groups = dense.reshape(3, 5, 4)
    assert ((groups != 0).sum(axis=2) == 2).all()
    kept = np.abs(a.reshape(3, 5, 4))
    assert np.allclose(np.sort(np.abs(groups), axis=2)[:, :, 2:], np.sort(kept, axis=2)[:, :, 2:])
    assert sparse24_nbytes(3, 20, 4) == 3 * 10 * 4 + 3 * 3 and sparse24_nbytes(8, 64, 2) == 8 * 32 * 2 + 8 * 8
    mask = mask_2_4(np.abs(a.T))  # a layer's weight (in, out) is a.T
    assert mask.shape == (20, 3) and np.array_equal(mask.T, dense != 0)
    with pytest.raises(ValueError, match="multiple of 4"):
        mask_2_4(np.ones((6, 2)))
    with pytest.raises(ValueError, match="meta"):
        decompress_2_4(values, meta[:, :1])
    csr = to_csr(dense)
    assert isinstance(csr, CSR) and csr.nnz == 30 and csr.nbytes() == 30 * 8 + 30 * 4 + 4 * 8


def test_break_even_interpolates():
    assert break_even([0.1, 0.2, 0.4], [1.0, 2.0, 4.0], 3.0) == pytest.approx(0.3)
    assert break_even([0.4, 0.1, 0.2], [4.0, 1.0, 2.0], 1.5) == pytest.approx(0.15)
    assert break_even([0.1, 0.2], [1.0, 2.0], 5.0) is None


def test_gpu_model_the_arithmetic_of_the_lesson():
    m = k = 8192
    dense_prefill = gpu_matmul_time(m, k, 4096, 1.0, "dense")
    assert dense_prefill == pytest.approx(2 * m * k * 4096 / 989e12)  # compute-bound
    assert gpu_matmul_time(m, k, 4096, 0.5, "2:4") == pytest.approx(2 * m * k * 4096 / 1979e12)  # twice the rate
    csr = gpu_matmul_time(m, k, 4096, 0.03, "csr", efficiency=0.5)
    assert csr == pytest.approx(2 * 0.03 * m * k * 4096 / (67e12 * 0.5))
    dense_decode = gpu_matmul_time(m, k, 1, 1.0, "dense")
    assert dense_decode == pytest.approx((2 * m * k + 2 * (k + m)) / 3.35e12)  # memory-bound: bytes
    assert gpu_matmul_time(m, k, 1, 0.3, "sparse load, dense compute") < dense_decode
    assert gpu_matmul_time(m, k, 1, 0.5, "2:4", gpu="A100 SXM 80GB") > 0
    assert set(GPU_KINDS) == {"dense", "2:4", "csr", "sparse load, dense compute"}
    with pytest.raises(ValueError, match="kind"):
        gpu_matmul_time(m, k, 1, 0.5, "block")


def test_sparse_timings_child_process():
    out = sparse_timings(16, 16, 4, densities=(0.25, 0.5), rounds=1)
    assert set(out) >= {"dense", "sparse24", "csr24", "csr", "env", "load"}
    assert set(out["csr"]) == {0.25, 0.5} and all(t > 0 for t in out["csr"].values())
    assert set(out["env"]) == {"OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"}
    with pytest.raises(ValueError, match="multiple of 4"):
        sparse_timings(8, 6, 2)
