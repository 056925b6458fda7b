"""Lesson 09's given code that no exercise test calls (minitorch.gpt): the tokenizer's other half, the
data helpers (split, batches, the bigram baseline), the NumPy LayerNorm and GELU, the learning-rate
schedule, the training loop and the checkpoint files. Small inputs; each test checks what the function
promises (and feeds the validation walk a call to replay), and the refusals reviewers found missing:
a block size of 0, a validation fraction of 1.5, a negative step count."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minitorch.autograd import Tensor
from minitorch.gpt import (GPT, CharTokenizer, GPTConfig, bigram_loss, eval_windows, gelu, gelu_np, get_batch,
                           layer_norm, layer_norm_np, load_checkpoint, lr_schedule, save_checkpoint, split_ids,
                           train_gpt)

TINY = dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)


def test_tokenizer_from_text_round_trips_and_decode_refuses_what_is_not_ids():
    tok = CharTokenizer.from_text("hello, world")
    assert tok.vocab == " ,dehlorw" and tok.vocab_size == 9
    ids = tok.encode("world, hello")
    assert ids.dtype == np.int64 and tok.decode(ids) == "world, hello" and tok.decode(list(ids)) == "world, hello"
    assert tok.decode([]) == "", "no ids decode to the empty string"
    with pytest.raises(ValueError, match=r"decode: ids must lie in \[0, 9\), got values 0\.\.9"):
        tok.decode([0, 9])
    with pytest.raises(TypeError, match=r"decode: ids .*float64"):
        tok.decode(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"decode: ids .*'abc'"):
        tok.decode("abc")


def test_split_ids_is_the_fixed_split_and_refuses_a_fraction_outside_0_1():
    ids = np.arange(50)
    train, val = split_ids(ids)
    assert len(train) == 45 and np.array_equal(np.concatenate([train, val]), ids), "90% train, then the rest"
    assert train.base is ids and val.base is ids, "views, no copy"
    train, val = split_ids(ids, 0.25)
    assert (len(train), len(val)) == (37, 13)
    for bad in (1.5, -0.5):
        with pytest.raises(ValueError, match=rf"split_ids: val_fraction must be a finite number in \[0, 1\], got {bad}"):
            split_ids(ids, bad)
    with pytest.raises(TypeError, match=r"split_ids: ids must be an array of 1 axis of dtype int, got .*float64"):
        split_ids(np.arange(10.0))


def test_get_batch_windows_and_refuses_a_block_size_of_0():
    ids = np.arange(100) * 3
    x, y = get_batch(ids, 5, 7, np.random.default_rng(0))
    assert x.shape == y.shape == (5, 7) and x.dtype == y.dtype == np.int64
    starts = x[:, 0] // 3
    assert np.array_equal(x, (starts[:, None] + np.arange(7)) * 3) and np.array_equal(y, x + 3), \
        "x = ids[s : s + T], y = ids[s + 1 : s + T + 1]"
    again, _ = get_batch(ids, 5, 7, np.random.default_rng(0))
    assert np.array_equal(again, x), "the same generator state gives the same batch"
    with pytest.raises(ValueError, match=r"get_batch: block_size must be an integer >= 1, got 0"):
        get_batch(ids, 5, 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"get_batch: batch_size must be an integer >= 1, got 0"):
        get_batch(ids, 0, 7, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"get_batch: need more than block_size=7 ids, got 7"):
        get_batch(ids[:7], 5, 7, np.random.default_rng(0))
    with pytest.raises(TypeError, match=r"get_batch: rng must be a Generator, got 0"):
        get_batch(ids, 5, 7, 0)
    with pytest.raises(ValueError, match=r"eval_windows: block_size must be >= 1, got 0"):
        eval_windows(ids, 0)
    with pytest.raises(ValueError, match=r"GPTConfig: block_size must be an integer >= 1, got 0"):
        GPTConfig(**{**TINY, "block_size": 0})


def test_bigram_loss_counts_pairs_and_checks_its_ids():
    train = np.array([0, 1, 0, 1, 0, 2])
    got = bigram_loss(train, np.array([0, 1, 0]), 3, alpha=0.5)
    counts = np.full((3, 3), 0.5)
    for a, b in zip(train[:-1], train[1:]):
        counts[a, b] += 1
    p = counts / counts.sum(axis=1, keepdims=True)
    assert math.isclose(got, -(math.log(p[0, 1]) + math.log(p[1, 0])) / 2, rel_tol=1e-12)
    with pytest.raises(ValueError, match=r"bigram_loss: train_ids must hold ids in \[0, vocab_size=3\), got values -1\.\.2"):
        bigram_loss(np.array([0, -1, 2]), np.array([0, 1]), 3)
    with pytest.raises(ValueError, match=r"bigram_loss: eval_ids must hold ids in \[0, vocab_size=3\), got values 0\.\.3"):
        bigram_loss(train, np.array([0, 3]), 3)
    with pytest.raises(ValueError, match=r"bigram_loss: alpha must be a finite number > 0, got 0"):
        bigram_loss(train, np.array([0, 1]), 3, alpha=0)


def test_numpy_layer_norm_and_gelu_are_the_autograd_nodes_values():
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((3, 5)), rng.standard_normal(5), rng.standard_normal(5)
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(layer_norm_np(x, w, b), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer_norm(Tensor(x), Tensor(w), Tensor(b)).numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gelu_np(x), gelu(Tensor(x)).numpy(), rtol=1e-15, atol=0)
    assert gelu_np(np.float32(1.0)).dtype == np.float32
    with pytest.raises(ValueError, match=r"layer_norm_forward: x \(3, 5\) needs weight and bias of shape \(5,\)"):
        layer_norm_np(x, w[:4], b)
    with pytest.raises(ValueError, match=r"layer_norm_forward: eps must be a finite number > 0, got -1"):
        layer_norm_np(x, w, b, -1.0)


def test_lr_schedule_warms_up_then_decays_to_min_ratio():
    lrs = [lr_schedule(s, 20, 1.0, warmup=4, min_ratio=0.25) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0], f"linear warm-up over 4 steps, got {lrs[:4]}"
    assert math.isclose(lrs[-1], 0.25) and all(a >= b for a, b in zip(lrs[3:], lrs[4:])), "cosine down to 0.25 lr"
    assert lr_schedule(0, 10, 0.5, warmup=0) == 0.5, "no warm-up: the full rate at step 0"
    with pytest.raises(ValueError, match=r"lr_schedule: step must be an integer >= 0, got -1"):
        lr_schedule(-1, 10, 1.0)
    with pytest.raises(ValueError, match=r"lr_schedule: min_ratio must be a finite number in \[0, 1\], got 1.5"):
        lr_schedule(0, 10, 1.0, min_ratio=1.5)


def test_train_gpt_lowers_the_loss_and_refuses_a_negative_step_count():
    ids = np.tile(np.arange(11), 30)  # a cycle: the next id is always the current one + 1
    model = GPT(GPTConfig(**TINY), seed=0)
    hist = train_gpt(model, ids[:250], 12, batch_size=4, lr=1e-2, warmup=2, val_ids=ids[250:], eval_every=6,
                     eval_windows=2, progress=False)
    assert len(hist["loss"]) == 12 and hist["val_step"] == [6, 12] and len(hist["val_loss"]) == 2
    assert hist["loss"][-1] < hist["loss"][0], f"12 Adam steps on a cycle must lower the loss: {hist['loss']}"
    assert hist["seconds"] > 0 and hist["cpu_seconds"] > 0
    for bad in (-1, 0):
        with pytest.raises(ValueError, match=rf"train_gpt: steps must be an integer >= 1, got {bad}"):
            train_gpt(model, ids, bad, progress=False)
    with pytest.raises(TypeError, match=r"train_gpt: steps must be an integer >= 1, got 2.5"):
        train_gpt(model, ids, 2.5, progress=False)
    with pytest.raises(ValueError, match=r"train_gpt: lr must be a finite number > 0, got -0.1"):
        train_gpt(model, ids, 1, lr=-0.1, progress=False)
    with pytest.raises(TypeError, match=r"train_gpt: model must be a GPT, got 'model'"):
        train_gpt("model", ids, 1, progress=False)
    with pytest.raises(ValueError, match=r"train_gpt: train_ids must hold ids in \[0, vocab_size=11\), got values 1\.\.11"):
        train_gpt(model, ids + 1, 1, progress=False)


def test_checkpoint_round_trip(tmp_path):
    model = GPT(GPTConfig(**TINY), seed=4)
    save_checkpoint(model, tmp_path / "m", note="test", steps=0)
    loaded, meta = load_checkpoint(tmp_path / "m")
    assert meta["note"] == "test" and meta["config"]["n_embd"] == 8 and not loaded.training
    x = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(loaded(x)[0].numpy(), model(x)[0].numpy())
    flash, _ = load_checkpoint(str(tmp_path / "m"), attention="flash")
    assert flash.config.attention == "flash"
    np.testing.assert_allclose(flash(x)[0].numpy(), model(x)[0].numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"load_checkpoint: attention must be one of 'reference', 'flash', got 'fast'"):
        load_checkpoint(tmp_path / "m", attention="fast")
    with pytest.raises(TypeError, match=r"save_checkpoint: model must be a GPT, got None"):
        save_checkpoint(None, tmp_path / "n")
