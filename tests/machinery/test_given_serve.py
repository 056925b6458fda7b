"""Lesson 11's given code that no exercise test calls (minitorch.kv_cache): the language models behind
speculative decoding's interface, the dtype cast of the weights, the dense cache's reset, the paged
cache's constructor for a model and its block tables, the latency probe and the loss. Small random
models; each test checks what the function promises (and feeds the validation walk a call to replay)."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch.kv_cache import (BigramLM, CachedLM, KVCache, PagedKVCache, RecomputeLM, decode_latencies, forward_cached,
                                gpt_forward, lm_loss, random_gpt_weights)


@pytest.fixture(scope="module")
def W():
    return random_gpt_weights(vocab_size=13, block_size=16, n_layer=2, n_head=2, n_embd=8, seed=3)


def test_cached_and_recompute_lms_agree_and_truncate(W):
    tokens = np.array([1, 5, 2, 7, 3])
    cached, plain = CachedLM(W), RecomputeLM(W)
    a, b = cached.append(tokens[:3]), plain.append(list(tokens[:3]))
    assert a.shape == b.shape == (3, 13) and a.dtype == np.float64
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    cached.truncate(2)
    plain.truncate(2)
    assert len(cached) == len(plain) == 2 and cached.calls == plain.calls == 1
    np.testing.assert_allclose(cached.append(tokens[2:]), plain.append(tokens[2:]), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(plain.append([4])[-1], gpt_forward(W, np.array([[1, 5, 2, 7, 3, 4]]))[0, -1],
                               rtol=1e-12, atol=1e-12)
    for lm in (cached, plain):
        with pytest.raises(ValueError, match=r"truncate: n must lie in \[0, \d+\], got 9"):
            lm.truncate(9)
        with pytest.raises(ValueError, match=r"append: tokens must be a 1-D array of at least one token id in \[0, 13\)"
                                             r".*values 0\.\.13"):
            lm.append([0, 13])


def test_bigram_lm_is_the_smoothed_pair_counts():
    train = np.array([0, 1, 2, 0, 1, 1])
    lm = BigramLM(train, 3, alpha=0.5)
    logp = lm.append([1, 0])
    counts = np.full((3, 3), 0.5)
    np.add.at(counts, (train[:-1], train[1:]), 1.0)
    want = np.log(counts / counts.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(logp, want[[1, 0]], rtol=1e-15)
    assert len(lm) == 2 and lm.calls == 1
    lm.truncate(1)
    assert len(lm) == 1
    with pytest.raises(ValueError, match=r"BigramLM: train_ids must lie in \[0, vocab_size=3\), got values 0\.\.3"):
        BigramLM(np.array([0, 3]), 3)
    with pytest.raises(ValueError, match=r"BigramLM.append: tokens must be a 1-D array .* values -1\.\.1"):
        lm.append(np.array([-1, 1]))


def test_weights_astype_and_the_dense_cache_reset(W):
    W32 = W.astype(np.float32)
    assert W32.dtype == np.float32 and W.dtype == np.float64 and W32.n_layer == W.n_layer
    with pytest.raises(TypeError, match=r"GPTWeights.astype: dtype must be a floating dtype .*got 'int8'"):
        W.astype("int8")
    cache = KVCache.for_model(W, batch=3)
    forward_cached(W, cache, np.array([[1, 2], [3, 4], [5, 6]]))
    cache.reset([0, 2])
    assert cache.lengths.tolist() == [0, 2, 0]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"KVCache.reset: rows must be row indices in \[0, 3\), got \[3\]"):
        cache.reset([3])


def test_paged_cache_for_a_model_and_its_block_tables(W):
    cache = PagedKVCache.for_model(W, block_size=4, num_blocks=6)
    assert cache.k.shape == (2, 6, 2, 4, 4) and cache.k.dtype == W.dtype and cache.num_free == 6
    cache.add("a")
    cache.append("a", 6)
    cache.add("b")
    cache.append("b", 1)
    table = cache.block_table(["b", "a"])
    assert table.dtype == np.int64 and table.shape == (2, 2) and table[0, 1] == -1, table
    assert sorted(table[table >= 0].tolist()) == sorted(cache.tables["a"] + cache.tables["b"])
    with pytest.raises(KeyError, match="c"):
        cache.block_table(["a", "c"])
    with pytest.raises(ValueError, match=r"PagedKVCache.for_model: num_blocks must be an integer >= 1, got 0"):
        PagedKVCache.for_model(W, 4, 0)


def test_decode_latencies_and_lm_loss(W):
    lat = decode_latencies(W, [1, 2, 3], 4)
    assert lat.shape == (4,) and (lat > 0).all()
    assert decode_latencies(W, np.array([4]), 2, use_cache=False).shape == (2,)
    with pytest.raises(ValueError, match=r"decode_latencies: 3 \+ 14 tokens do not fit block_size=16"):
        decode_latencies(W, [1, 2, 3], 14)
    x = np.random.default_rng(0).integers(0, 13, (3, 5))
    y = np.roll(x, -1, axis=1)
    logits = gpt_forward(W, x)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    want = -np.take_along_axis(logp, y[..., None], axis=-1).mean()
    assert abs(lm_loss(W, x, y, batch_size=2) - want) < 1e-12
    with pytest.raises(ValueError, match=r"lm_loss: y must be a \(B, T\) integer array of token ids in \[0, 13\).*13"):
        lm_loss(W, x, y + 1)
    with pytest.raises(ValueError, match=r"lm_loss: x and y must have one shape"):
        lm_loss(W, x, y[:, :4])
