"""Lesson 11: KV cache, GQA, paged KV cache, continuous batching, speculative decoding.

Oracles written here, independent of the lesson: a float64 NumPy forward of the GPT from its
weights (full recomputation, repeated KV heads), dense attention, a reference block allocator
and paged cache (used to build pools for 11.5 and to stand in for exercises 11.4-11.6 where
another exercise's tests need them), greedy generation by full recomputation, Markov-chain
language models with exact output distributions. Work is graded by multiply-adds counted in the
lesson's matmul(), memory by tracemalloc; hypothesis drives the allocator and the paged cache
with random operation sequences (derandomised).
"""

import functools
import inspect
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

pytestmark = pytest.mark.lesson11


# ------------------------------------------------------------------ oracles
def np_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def np_gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def dense_attention(q, k, v, mask=None):
    """float64 attention, K/V heads repeated to q's heads; rows that see nothing give 0."""
    g = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    allowed = np.ones(s.shape, bool) if mask is None else np.broadcast_to(mask, s.shape)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    e = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    return (e / np.where(tot > 0, tot, 1.0)) @ v


def causal(nq, nk):
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)


def oracle_forward(W, idx, return_kv=False):
    """Full recomputation in float64 from W.params: logits (B, T, V) [, [(k, v) per layer]]."""
    p = {k: np.asarray(v, np.float64) for k, v in W.params.items()}
    idx = np.asarray(idx)
    b, t = idx.shape
    x = p["wte.weight"][idx] + p["wpe.weight"][:t]
    kv = []
    for i in range(W.n_layer):
        pre = f"blocks.{i}."
        h = np_layer_norm(x, p[pre + "ln1.weight"], p[pre + "ln1.bias"], W.ln_eps)
        heads = []
        for n, nh in (("q", W.n_head), ("k", W.n_kv_head), ("v", W.n_kv_head)):
            y = h @ p[pre + f"attn.{n}.weight"] + p[pre + f"attn.{n}.bias"]
            heads.append(y.reshape(b, t, nh, -1).transpose(0, 2, 1, 3))
        kv.append((heads[1], heads[2]))
        o = dense_attention(*heads, causal(t, t)).transpose(0, 2, 1, 3).reshape(b, t, -1)
        x = x + o @ p[pre + "attn.proj.weight"] + p[pre + "attn.proj.bias"]
        h = np_layer_norm(x, p[pre + "ln2.weight"], p[pre + "ln2.bias"], W.ln_eps)
        x = x + np_gelu(h @ p[pre + "mlp.fc.weight"] + p[pre + "mlp.fc.bias"]) @ p[pre + "mlp.proj.weight"] \
            + p[pre + "mlp.proj.bias"]
    logits = np_layer_norm(x, p["ln_f.weight"], p["ln_f.bias"], W.ln_eps) @ p["wte.weight"].T
    return (logits, kv) if return_kv else logits


def greedy_alone(W, prompt, n):
    """Greedy generation by full recomputation (no window: prompt + n <= block_size)."""
    tokens = list(int(t) for t in prompt)
    for _ in range(n):
        tokens.append(int(oracle_forward(W, np.array([tokens]))[0, -1].argmax()))
    return np.array(tokens[len(prompt):])


@functools.cache
def tiny_weights(ns):
    return ns.load_tiny_weights(np.float64)


@pytest.fixture
def tiny(lesson):
    """The tiny GPT's weights in float64, loaded once per namespace (an isolated lesson has one per exercise)."""
    return tiny_weights(lesson.namespace)


def small_gqa(lesson, seed=0):
    """An odd-sized random model: 3 layers, 6 query heads of 4, 3 KV heads, vocab 11, context 40."""
    return lesson.random_gpt_weights(vocab_size=11, block_size=40, n_layer=3, n_head=6, n_embd=24, n_kv_head=3,
                                     seed=seed, dtype=np.float64)


def assert_close(got, want, what, tol=1e-10):
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: expected shape {want.shape}, got {got.shape}"
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= tol, f"{what}: max |difference| from full recomputation {err:.3e} > {tol:g}"


def decode_macs(W, n_keys, b=1, t=1):
    """Multiply-adds of one step of t new tokens for b rows attending over n_keys positions."""
    c, hd = W.n_embd, W.head_dim
    per_token = W.n_layer * (2 * c * c + 2 * c * W.n_kv_head * hd + 8 * c * c) + c * W.vocab_size
    return b * t * per_token + W.n_layer * 2 * b * W.n_head * t * n_keys * hd


# ------------------------------------------------------------------ 11.1 forward_cached
@pytest.mark.exercise("11.1")
@pytest.mark.parametrize("prompt_len", [1, 2, 7, 30])
def test_cached_decode_equals_full_recompute_every_step(lesson, tiny, prompt_len):
    rng = np.random.default_rng(prompt_len)
    tokens = list(rng.integers(0, tiny.vocab_size, prompt_len))
    cache = lesson.KVCache.for_model(tiny)
    got = lesson.forward_cached(tiny, cache, np.array([tokens]))
    want = oracle_forward(tiny, np.array([tokens]))
    assert_close(got, want, f"prefill of {prompt_len} tokens, logits of every prompt position")
    for step in range(12):
        tokens.append(int(want[0, -1].argmax()))
        got = lesson.forward_cached(tiny, cache, np.array([tokens[-1:]]))
        want = oracle_forward(tiny, np.array([tokens]))
        assert_close(got, want[:, -1:], f"decode step {step} (position {len(tokens) - 1}) after a "
                                        f"{prompt_len}-token prompt")
        assert int(cache.lengths[0]) == len(tokens), \
            f"after {len(tokens)} tokens cache.lengths[0] should be {len(tokens)}, got {cache.lengths[0]}"


@pytest.mark.exercise("11.1")
def test_chunked_prefill(lesson, tiny):
    tokens = np.random.default_rng(1).integers(0, tiny.vocab_size, 23)
    want = oracle_forward(tiny, tokens[None])
    cache = lesson.KVCache.for_model(tiny)
    start = 0
    for size in (5, 1, 7, 10):
        got = lesson.forward_cached(tiny, cache, tokens[None, start:start + size])
        assert_close(got, want[:, start:start + size], f"chunk of {size} tokens at positions {start}..{start + size - 1}")
        start += size


@pytest.mark.exercise("11.1")
def test_rows_of_different_lengths_decode_together(lesson):
    W = small_gqa(lesson)
    rng = np.random.default_rng(2)
    seqs = [list(rng.integers(0, W.vocab_size, n)) for n in (3, 9, 1)]
    cache = lesson.KVCache.for_model(W, batch=3, max_len=W.block_size)
    for r, s in enumerate(seqs):       # prefill each row on its own
        got = lesson.forward_cached(W, cache, np.array([s]), rows=[r])
        assert_close(got, oracle_forward(W, np.array([s])), f"prefill of row {r} ({len(s)} tokens)")
    for step in range(4):               # all rows decode in one call, each at its own position
        new = rng.integers(0, W.vocab_size, 3)
        for s, t in zip(seqs, new):
            s.append(int(t))
        got = lesson.forward_cached(W, cache, new[:, None])
        for r, s in enumerate(seqs):
            assert_close(got[r:r + 1], oracle_forward(W, np.array([s]))[:, -1:],
                         f"decode step {step}, row {r} at position {len(s) - 1} (rows hold {[len(x) for x in seqs]})")
    new = rng.integers(0, W.vocab_size, (2, 2))   # a subset of rows, out of order, two tokens each
    for r, t in zip((2, 0), new):
        seqs[r] += [int(x) for x in t]
    got = lesson.forward_cached(W, cache, new, rows=[2, 0])
    for j, r in enumerate((2, 0)):
        assert_close(got[j:j + 1], oracle_forward(W, np.array([seqs[r]]))[:, -2:], f"rows=[2, 0]: row {r}")
    assert cache.lengths.tolist() == [len(s) for s in seqs], \
        f"cache.lengths should be {[len(s) for s in seqs]}, got {cache.lengths.tolist()}"


@pytest.mark.exercise("11.1")
def test_position_offset_and_cache_contents(lesson):
    """The classic bugs: the first token's K/V not written, positions starting at 0 in decode."""
    W = small_gqa(lesson, seed=3)
    tokens = np.random.default_rng(3).integers(0, W.vocab_size, 7)
    cache = lesson.KVCache.for_model(W)
    lesson.forward_cached(W, cache, tokens[None, :6])
    got = lesson.forward_cached(W, cache, tokens[None, 6:7])
    want, kv = oracle_forward(W, tokens[None], return_kv=True)
    for i, (k, v) in enumerate(kv):
        for name, arr, ref in (("k", cache.k, k), ("v", cache.v, v)):
            held = arr[i, 0, :, :7]
            first = np.abs(held[:, 0] - ref[0, :, 0]).max()
            assert first < 1e-10, (f"layer {i}: cache.{name} at position 0 (the first token) differs from the "
                                   f"recomputed one by {first:.2e}: was the first token's {name} written?")
            err = np.abs(held - ref[0]).max()
            assert err < 1e-10, f"layer {i}: cache.{name}[{i}, 0, :, :7] differs from the recomputed keys/values by {err:.2e}"
    shifted = oracle_forward(W, tokens[None, 6:7])[:, -1:]   # the new token embedded at position 0
    assert np.abs(want[:, -1:] - shifted).max() > 1e-3      # (the test can see a position error)
    assert_close(got, want[:, -1:], "the token fed at position 6 (its position embedding must be wpe[6], not wpe[0])")


@pytest.mark.exercise("11.1")
def test_decode_work_is_one_token_not_the_prefix(lesson, tiny):
    """Multiply-adds counted by matmul(): a decode step at position T costs the layers for one
    token plus attention over T + 1 keys: linear in T. Recomputing the prefix would be ~T times more."""
    cache = lesson.KVCache.for_model(tiny)
    tokens = np.arange(40) % tiny.vocab_size
    with lesson.count_macs() as c:
        lesson.forward_cached(tiny, cache, tokens[None, :9])
    assert c.macs == decode_macs(tiny, 9, t=9), \
        f"prefill of 9 tokens: expected {decode_macs(tiny, 9, t=9):,} multiply-adds through matmul(), counted {c.macs:,}"
    counts = []
    for n in range(9, 40):
        with lesson.count_macs() as c:
            lesson.forward_cached(tiny, cache, tokens[None, n:n + 1])
        counts.append(c.macs)
        want = decode_macs(tiny, n + 1)
        assert c.macs == want, (f"decode at position {n}: expected {want:,} multiply-adds (one token through the "
                                f"layers, attention over the {n + 1} filled positions only), counted {c.macs:,}. Do "
                                f"every product through matmul() or the given helpers, and attend over "
                                f"cache.k[..., :n_keys, :], not the whole max_len buffer")
    steps = np.diff(counts)
    assert np.all(steps == steps[0]) and steps[0] == 2 * tiny.n_layer * tiny.n_head * tiny.head_dim, \
        f"work per decode step should grow by {2 * tiny.n_layer * tiny.n_head * tiny.head_dim} per position, got {set(steps.tolist())}"


@pytest.mark.exercise("11.1")
def test_overflow_is_refused_and_cache_unchanged(lesson, tiny):
    cache = lesson.KVCache.for_model(tiny, batch=2, max_len=10)
    tokens = np.arange(12)[None] % tiny.vocab_size
    lesson.forward_cached(tiny, cache, tokens[:, :8], rows=[1])
    before = (cache.k.copy(), cache.v.copy(), cache.lengths.copy())
    with pytest.raises(ValueError, match="1"):
        lesson.forward_cached(tiny, cache, tokens[:, 8:11], rows=[1])   # 8 + 3 > max_len 10
    for a, b, name in zip((cache.k, cache.v, cache.lengths), before, ("k", "v", "lengths")):
        assert np.array_equal(a, b), f"a refused step must leave cache.{name} unchanged"
    with pytest.raises(ValueError):
        lesson.forward_cached(tiny, cache, tokens[:, :2], rows=[0, 1])  # 1 row of ids for 2 rows
    big = lesson.KVCache.for_model(tiny, max_len=80)                    # the model's context is 64
    lesson.forward_cached(tiny, big, (np.arange(60) % tiny.vocab_size)[None])
    with pytest.raises(ValueError):
        lesson.forward_cached(tiny, big, (np.arange(5) % tiny.vocab_size)[None])
    assert int(big.lengths[0]) == 60, "a refused step must not advance lengths"


@pytest.mark.exercise("11.1")
def test_limit_is_per_row_and_checked_before_any_write(lesson):
    """Only the rows fed are checked, each against its own length; a refused step writes nothing,
    even when it is a later row of the batch that does not fit."""
    W = small_gqa(lesson, seed=5)
    rng = np.random.default_rng(41)
    seqs = [list(rng.integers(0, W.vocab_size, n)) for n in (3, 10, 12)]
    cache = lesson.KVCache.for_model(W, batch=3, max_len=12)
    for r, s in enumerate(seqs):
        lesson.forward_cached(W, cache, np.array([s]), rows=[r])
    new = rng.integers(0, W.vocab_size, (2, 1))          # row 2 is full; rows 0 and 1 are not
    for s, t in zip(seqs, new[:, 0]):
        s.append(int(t))
    got = lesson.forward_cached(W, cache, new, rows=[0, 1])
    for j in range(2):
        assert_close(got[j:j + 1], oracle_forward(W, np.array([seqs[j]]))[:, -1:],
                     f"rows=[0, 1] while row 2 is full (lengths {cache.lengths.tolist()}): row {j}")
    before = (cache.k.copy(), cache.v.copy(), cache.lengths.copy())
    for rows in ([0, 1], [1, 0]):                          # row 1 holds 11 of 12: 2 more do not fit
        with pytest.raises(ValueError, match=r"\b1\b"):
            lesson.forward_cached(W, cache, rng.integers(0, W.vocab_size, (2, 2)), rows=rows)
        for a, b, name in zip((cache.k, cache.v, cache.lengths), before, ("k", "v", "lengths")):
            assert np.array_equal(a, b), (f"rows={rows}, 2 tokens each, row 1 does not fit: the step must be refused "
                                          f"before anything is written, but cache.{name} changed")


@pytest.mark.exercise("11.1")
def test_generation_across_the_window_matches_recompute(lesson, tiny):
    """lesson.generate with the cache (re-prefill at each window restart) against full recomputation."""
    prompt = np.random.default_rng(4).integers(0, tiny.vocab_size, 10)
    out_c, log_c = lesson.generate(tiny, prompt, 90, use_cache=True, keep=20, return_logits=True)
    out_p, log_p = lesson.generate(tiny, prompt, 90, use_cache=False, keep=20, return_logits=True)
    for step, (a, b) in enumerate(zip(log_c, log_p)):
        assert_close(a, b, f"generate step {step} (window restarts at 64 tokens, keeping 20)")
    assert np.array_equal(out_c, out_p), "cached and uncached greedy generation should give the same tokens"


@pytest.mark.exercise("11.1")
def test_generate_and_token_probs_reject_bad_arguments(lesson, tiny):
    """A negative temperature, token count: clear errors, not a silent run (or none)."""
    prompt = np.array([3, 1, 4, 1, 5])
    got = lesson.generate(tiny, prompt, 3)
    assert np.array_equal(got, greedy_alone(tiny, prompt, 3)), f"greedy generate: got {got}"
    with pytest.raises(ValueError, match=r"generate: max_new_tokens must be >= 0, got -1"):
        lesson.generate(tiny, prompt, -1)
    with pytest.raises(ValueError, match=r"generate: temperature must be finite and >= 0.*-1\.0"):
        lesson.generate(tiny, prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match=r"token_probs: temperature must be finite and >= 0.*-0\.5"):
        lesson.token_probs(np.zeros(4), -0.5)


# ------------------------------------------------------------------ 11.2 memory and intensity
@pytest.mark.exercise("11.2")
def test_kv_cache_bytes_matches_real_arrays(lesson, tiny):
    rng = np.random.default_rng(5)
    for dtype in (np.float16, np.float32, np.float64):
        for _ in range(3):
            n_layer, batch, kv, t, hd = (int(x) for x in rng.integers(1, 9, 5))
            cache = lesson.KVCache(n_layer, batch, kv, t, hd, dtype)
            got = lesson.kv_cache_bytes(n_layer, kv, hd, t, np.dtype(dtype).itemsize, batch=batch)
            assert got == cache.nbytes, (f"kv_cache_bytes({n_layer} layers, {kv} KV heads, head_dim {hd}, {t} tokens, "
                                         f"{np.dtype(dtype).name}, batch {batch}) = {got}, the arrays hold {cache.nbytes}")
    cache = lesson.KVCache.for_model(tiny)
    assert lesson.kv_cache_bytes(tiny.n_layer, tiny.n_kv_head, tiny.head_dim, tiny.block_size, 8) == cache.nbytes
    per_token = lesson.kv_cache_bytes(32, 32, 128, 1, 2)
    assert per_token == 2 ** 19, f"Llama-2-7B in bf16: 0.5 MiB = 524288 bytes per token, got {per_token}"
    assert lesson.kv_cache_bytes(32, 32, 128, 4096, 2) == 2 * 2 ** 30, "Llama-2-7B at 4096 tokens: 2 GiB"
    assert lesson.kv_cache_bytes(80, 8, 128, 4096, 2, batch=3) == 3 * 1280 * 2 ** 20
    got = lesson.kv_cache_bytes(3, 2, 5, 7, 2)
    assert isinstance(got, (int, np.integer)), f"kv_cache_bytes returns a number of bytes as an int, got {got!r}"


@pytest.mark.exercise("11.2")
@pytest.mark.parametrize("batch,context", [(1, 1), (1, 17), (3, 9)])
def test_decode_flops_match_counted_work(lesson, batch, context):
    """2 x the multiply-adds matmul() counts in one decode step of the model, built from the given
    pieces (queries of `batch` new tokens against `context` keys)."""
    W = small_gqa(lesson, seed=6)
    rng = np.random.default_rng(7)
    n_params = sum(v.size for k, v in W.params.items() if k.endswith(".weight") and v.ndim == 2
                   and not k.startswith("wpe"))   # every Linear, plus wte as the output layer
    with lesson.count_macs() as c:
        x = lesson.embed(W, rng.integers(0, W.vocab_size, (batch, 1)), np.array([context - 1]))
        for i in range(W.n_layer):
            q, _, _ = lesson.layer_qkv(W, i, x)
            keys = rng.standard_normal((batch, W.n_kv_head, context, W.head_dim))
            x = lesson.layer_finish(W, i, x, lesson.attend(q, keys, keys))
        lesson.lm_head(W, x)
    flops, _ = lesson.decode_step_cost(n_params, W.n_layer, W.n_head, W.n_kv_head, W.head_dim, context, batch=batch)
    assert flops == 2 * c.macs, (f"decode step, batch {batch}, context {context}: decode_step_cost gives {flops:,.0f} "
                                 f"FLOPs, the model does 2 x {c.macs:,} = {2 * c.macs:,}")


@pytest.mark.exercise("11.2")
def test_decode_bytes_and_intensity(lesson):
    n = 6_607_343_616  # Llama-2-7B's weights without the input embedding
    flops, nbytes = lesson.decode_step_cost(n, 32, 32, 32, 128, 4096, batch=1)
    assert nbytes == n * 2 + 2 ** 31, f"batch 1, 4096 cached tokens, bf16: weights + 2 GiB of cache; got {nbytes:,.0f}"
    assert 0.9 < flops / nbytes < 1.1, f"a batch-1 decode step in bf16 does about 1 FLOP per byte, got {flops / nbytes:.2f}"
    for batch in (1, 8, 64):
        f0, b0 = lesson.decode_step_cost(n, 32, 32, 32, 128, 0, batch=batch)
        assert b0 == 2 * n and f0 == 2 * n * batch, \
            f"with no context the step reads the weights once ({2 * n:,} bytes) for {batch} tokens; got {b0:,.0f} bytes, {f0:,.0f} FLOPs"
    f8, b8 = lesson.decode_step_cost(n, 32, 32, 8, 128, 1000, batch=5, bytes_per_param=0.5, bytes_per_element=1)
    assert b8 == n * 0.5 + 5 * 2 * 32 * 8 * 128 * 1000, \
        f"int4 weights, 8 KV heads in fp8, batch 5, 1000 tokens: expected {n * 0.5 + 5 * 2 * 32 * 8 * 128 * 1000:,.0f} bytes, got {b8:,.0f}"
    assert f8 == 5 * (2 * n + 4 * 32 * 32 * 128 * 1000), "attention FLOPs use the query heads, not the KV heads"


@pytest.mark.exercise("11.2")
def test_kv_cache_bytes_rejects_negative_and_fractional_counts(lesson):
    assert lesson.kv_cache_bytes(2, 3, 4, 5, 2, batch=2) == 2 * 2 * 3 * 4 * 5 * 2 * 2, "kv_cache_bytes(2, 3, 4, 5, 2, batch=2)"
    with pytest.raises(ValueError, match=r"kv_cache_bytes: n_layer must be >= 0, got -2"):
        lesson.kv_cache_bytes(-2, 3, 4, 5, 2)
    with pytest.raises(TypeError, match=r"kv_cache_bytes: tokens must be an integer >= 0, got 2\.5"):
        lesson.kv_cache_bytes(2, 3, 4, 2.5, 2)
    with pytest.raises(ValueError, match=r"kv_cache_bytes: bytes_per_element must be >= 1, got 0"):
        lesson.kv_cache_bytes(2, 3, 4, 5, 0)


# ------------------------------------------------------------------ 11.3 GQA
def qkv(rng, b, hq, hkv, tq, tk, hd):
    return (rng.standard_normal((b, hq, tq, hd)), rng.standard_normal((b, hkv, tk, hd)),
            rng.standard_normal((b, hkv, tk, hd)))


@pytest.mark.exercise("11.3")
def test_gqa_with_all_heads_equals_multi_head(lesson):
    from minitorch.attention import attention_np, causal_mask, padding_mask

    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 2, 5, 5, 7, 11, 6)
    for mask in (None, causal_mask(7, 11), padding_mask(np.array([4, 11]), 11)):
        got = lesson.grouped_attention(q, k, v, mask)
        want = attention_np(q, k, v, mask)
        assert got.shape == want.shape, f"expected shape {want.shape}, got {got.shape}"
        err = np.abs(got - want).max()
        assert err < 1e-12, f"with as many KV heads as query heads GQA is multi-head attention; max |diff| {err:.2e}"


@pytest.mark.exercise("11.3")
@pytest.mark.parametrize("hkv", [1, 2, 3])
def test_gqa_matches_repeated_heads(lesson, hkv):
    rng = np.random.default_rng(9 + hkv)
    q, k, v = qkv(rng, 2, 6, hkv, 5, 9, 4)
    mask = causal(5, 9) & (rng.random((2, 1, 5, 9)) < 0.8)
    mask[0, 0, 2] = False                                  # a query that sees no key: zeros
    got = lesson.grouped_attention(q, k, v, mask)
    want = dense_attention(q, k, v, mask)
    assert got.shape == want.shape, f"expected shape {want.shape}, got {got.shape}"
    err = np.abs(got - want).max()
    assert err < 1e-12, (f"6 query heads over {hkv} KV heads (query head h uses KV head h // {6 // hkv}): max |diff| "
                         f"{err:.2e} from repeating the KV heads")


@pytest.mark.exercise("11.3")
@pytest.mark.parametrize("hkv", [1, 2, 3, 6])
def test_gqa_per_head_mask_dtype_and_work(lesson, hkv):
    """A different mask for every query head (broadcastable to (B, Hq, Tq, Tk) includes it), the
    dtype of q kept, and the two products done through matmul()."""
    rng = np.random.default_rng(40 + hkv)
    b, hq, tq, tk, hd = 3, 6, 4, 7, 5
    q, k, v = qkv(rng, b, hq, hkv, tq, tk, hd)
    mask = rng.random((b, hq, tq, tk)) < 0.6
    mask[1, 4, 2] = False                                  # one query of one head sees nothing: zeros
    mask[2, :, 0] = False
    want = dense_attention(q, k, v, mask)
    with lesson.count_macs() as c:
        got = lesson.grouped_attention(q, k, v, mask)
    assert got.shape == want.shape, f"expected shape {want.shape}, got {got.shape}"
    err = np.abs(got - want).max()
    assert err < 1e-12, (f"{hq} query heads over {hkv} KV heads with a (B, Hq, Tq, Tk) mask, one per query head: "
                         f"max |diff| {err:.2e} (query head h must use mask[:, h], whatever its group)")
    macs = 2 * b * hq * tq * tk * hd
    assert c.macs == macs, (f"q k^T and p v for {b} x {hq} heads x {tq} queries x {tk} keys x {hd}: expected "
                            f"{macs:,} multiply-adds through matmul(), counted {c.macs:,}")
    got32 = lesson.grouped_attention(*(a.astype(np.float32) for a in (q, k, v)), mask)
    assert got32.dtype == np.float32, f"float32 q, k, v must give a float32 result, got {got32.dtype}"
    assert np.abs(got32 - want).max() < 1e-4, "float32 result far from the float64 one"


@pytest.mark.exercise("11.3")
def test_gqa_does_not_copy_kv_per_query_head(lesson):
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 16, 1, 32))
    k, v = rng.standard_normal((1, 1, 2048, 32)), rng.standard_normal((1, 1, 2048, 32))
    lesson.grouped_attention(q[:, :, :, :], k[:, :, :8], v[:, :, :8])   # warm up
    tracemalloc.start()
    try:
        out = lesson.grouped_attention(q, k, v)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    repeated = 16 * k.nbytes
    assert np.abs(out - dense_attention(q, k, v)).max() < 1e-12
    assert peak < repeated / 4, (f"one query per head over an MQA cache: peak memory {peak / 2**20:.1f} MiB, but K "
                                 f"repeated for 16 heads alone is {repeated / 2**20:.1f} MiB: reshape the queries into "
                                 f"groups instead of repeating K and V")


@pytest.mark.exercise("11.3")
def test_gqa_shape_errors(lesson):
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, 1, 6, 4, 3, 5, 4)
    with pytest.raises(ValueError, match="6"):
        lesson.grouped_attention(q, k, v)
    q, k, v = qkv(rng, 1, 4, 2, 3, 5, 4)
    with pytest.raises(ValueError):
        lesson.grouped_attention(q, k[..., :3], v[..., :3])
    # the shapes are checked before the student's code (given); so is that code run on shapes that fit
    from minitorch.attention import attention_np

    want = attention_np(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1))
    assert np.abs(lesson.grouped_attention(q, k, v) - want).max() < 1e-12, "grouped_attention, Hq = 4, Hkv = 2"


@pytest.mark.exercise("11.3")
@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_pool_kv_heads(lesson, tiny, n_kv):
    original = {k: v.copy() for k, v in tiny.params.items()}
    Wp = lesson.pool_kv_heads(tiny, n_kv)
    assert Wp.n_kv_head == n_kv and Wp.n_head == tiny.n_head, f"expected {n_kv} KV heads, {tiny.n_head} query heads"
    g, hd = tiny.n_head // n_kv, tiny.head_dim
    for name, arr in tiny.params.items():
        assert np.array_equal(arr, original[name]), f"pool_kv_heads changed the input's {name}: return a copy"
        got = Wp.params[name]
        if ".attn.k." in name or ".attn.v." in name:
            lead = arr.shape[:-1]
            want = arr.reshape(*lead, n_kv, g, hd).mean(axis=-2).reshape(*lead, n_kv * hd)
            assert got.shape == want.shape, f"{name}: expected shape {want.shape}, got {got.shape}"
            assert np.allclose(got, want, rtol=0, atol=1e-15), \
                f"{name}: each KV head must be the mean of the {g} consecutive heads of its group"
        else:
            assert np.array_equal(got, arr), f"{name} must not change"
    # the pooled model runs, through grouped attention, as the oracle says
    x = np.random.default_rng(14).integers(0, tiny.vocab_size, (2, 13))
    assert_close(lesson.gpt_forward(Wp, x, lesson.grouped_attention), oracle_forward(Wp, x), f"{n_kv}-KV-head model")


@pytest.mark.exercise("11.3")
def test_pool_kv_heads_errors_and_composition(lesson, tiny):
    for bad in (3, 8, 0):
        with pytest.raises(ValueError, match=rf"(?s)(?=.*\b{bad}\b)(?=.*\b4\b)"):   # names both counts
            lesson.pool_kv_heads(tiny, bad)              # the tiny GPT has 4 KV heads: 3, 8 and 0 do not divide them
    twice = lesson.pool_kv_heads(lesson.pool_kv_heads(tiny, 2), 1)
    once = lesson.pool_kv_heads(tiny, 1)
    for name in once.params:
        assert np.allclose(twice.params[name], once.params[name], rtol=0, atol=1e-15), \
            f"pooling 4 -> 2 -> 1 heads should equal 4 -> 1 ({name})"


@pytest.mark.exercise("11.3")
def test_gqa_and_attend_reject_integer_masks_and_take_no_keys(lesson):
    """Integer masks were accepted (lesson 09's attention rejects them), a mask of the wrong shape gave
    a broadcast error, and Tk = 0 a zero-size reduction error; with no keys the output is 0 (as
    PyTorch's SDPA gives)."""
    from minitorch.attention import attention_np

    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, 2, 4, 2, 3, 5, 6)
    mask = causal(3, 5)
    want = attention_np(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), mask)
    got = lesson.grouped_attention(q, k, v, mask)
    assert np.abs(got - want).max() < 1e-12, "grouped_attention with a causal mask"
    for fn, name in ((lesson.grouped_attention, "grouped_attention"), (lesson.attend, "attend")):
        with pytest.raises(TypeError, match=rf"{name}: the mask must be boolean.*int64"):
            fn(q, k, v, mask.astype(np.int64))
        with pytest.raises(ValueError, match=rf"{name}: mask of shape \(4, 5\) does not broadcast to the scores' shape \(2, 4, 3, 5\)"):
            fn(q, k, v, np.ones((4, 5), bool))
        out = fn(q, k[:, :, :0], v[:, :, :0])
        assert out.shape == q.shape and np.array_equal(out, np.zeros_like(q)), (
            f"{name} over no keys (Tk = 0): expected zeros of shape {q.shape}, got {np.shape(out)}")


# ------------------------------------------------------------------ reference allocator / paged cache
class RefAllocator:
    """A reference block allocator (free set, counts)."""

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks

    num_free = property(lambda self: self.refs.count(0))
    num_used = property(lambda self: self.num_blocks - self.refs.count(0))

    def refcount(self, b):
        return self.refs[b]

    def allocate(self):
        for b in range(self.num_blocks):     # lowest free id: a different order from the lesson's
            if self.refs[b] == 0:
                self.refs[b] = 1
                return b
        raise RuntimeError("RefAllocator: out of blocks")

    def share(self, b):
        assert self.refs[b] > 0, f"share of free block {b}"
        self.refs[b] += 1

    def release(self, b):
        assert self.refs[b] > 0, f"release of free block {b}"
        self.refs[b] -= 1
        return self.refs[b] == 0


class RefPagedCache:
    """A reference paged cache with the lesson's interface (stands in for exercise 11.6)."""

    def __init__(self, n_layer, n_kv_head, head_dim, block_size, num_blocks, dtype=np.float64, fill=0.0):
        self.block_size = block_size
        shape = (n_layer, num_blocks, n_kv_head, block_size, head_dim)
        self.k, self.v = np.full(shape, fill, dtype), np.full(shape, fill, dtype)
        self.allocator = RefAllocator(num_blocks)
        self.tables, self.lengths = {}, {}

    @classmethod
    def for_model(cls, W, block_size, num_blocks):
        return cls(W.n_layer, W.n_kv_head, W.head_dim, block_size, num_blocks, W.dtype)

    num_blocks = property(lambda self: self.k.shape[1])
    num_free = property(lambda self: self.allocator.num_free)

    def add(self, s):
        assert s not in self.tables
        self.tables[s], self.lengths[s] = [], 0

    def blocks_needed(self, s, n):
        t, length, bs = self.tables[s], self.lengths[s], self.block_size
        if n <= 0:
            return 0
        cow = length % bs != 0 and self.allocator.refs[t[-1]] > 1
        return max(0, -(-(length + n) // bs) - len(t)) + cow

    def append(self, s, n):
        if self.blocks_needed(s, n) > self.num_free:
            raise MemoryError("RefPagedCache: out of blocks")
        t, length, bs = self.tables[s], self.lengths[s], self.block_size
        if n and length % bs and self.allocator.refs[t[-1]] > 1:
            new = self.allocator.allocate()
            self.k[:, new], self.v[:, new] = self.k[:, t[-1]], self.v[:, t[-1]]
            self.allocator.release(t[-1])
            t[-1] = new
        while len(t) * bs < length + n:
            t.append(self.allocator.allocate())
        pos = np.arange(length, length + n)
        self.lengths[s] = length + n
        return np.array(t, dtype=np.int64)[pos // bs] * bs + pos % bs

    def write(self, layer, slots, k, v):
        b, o = np.divmod(np.asarray(slots), self.block_size)
        self.k[layer, b, :, o] = np.swapaxes(k, 0, 1)
        self.v[layer, b, :, o] = np.swapaxes(v, 0, 1)

    def fork(self, parent, child):
        for b in self.tables[parent]:
            self.allocator.share(b)
        self.tables[child], self.lengths[child] = list(self.tables[parent]), self.lengths[parent]

    def free(self, s):
        for b in self.tables.pop(s):
            self.allocator.release(b)
        del self.lengths[s]

    def block_table(self, seqs):
        out = np.full((len(seqs), max([len(self.tables[s]) for s in seqs] + [1])), -1, np.int64)
        for i, s in enumerate(seqs):
            out[i, :len(self.tables[s])] = self.tables[s]
        return out

    def gather(self, s, layer):
        t, n = self.tables[s], self.lengths[s]
        _, _, hkv, bs, hd = self.k.shape
        return tuple(a[layer, t].transpose(1, 0, 2, 3).reshape(hkv, -1, hd)[:, :n] for a in (self.k, self.v))


def ref_paged_attention(q, k_pool, v_pool, block_table, lengths):
    b, hq, t, hd = q.shape
    bs = k_pool.shape[2]
    out = np.zeros(q.shape)
    for s in range(b):
        n = int(lengths[s])
        blocks = block_table[s, :-(-n // bs)]
        k = k_pool[blocks].transpose(1, 0, 2, 3).reshape(k_pool.shape[1], -1, hd)[:, :n]
        v = v_pool[blocks].transpose(1, 0, 2, 3).reshape(k_pool.shape[1], -1, hd)[:, :n]
        out[s] = dense_attention(q[s:s + 1], k[None], v[None], causal(t, n))[0]
    return out


# ------------------------------------------------------------------ 11.4 block allocator
def should_raise(exc, match, call, fn, *args):
    """fn(*args) must raise exc (whose message contains `match`); else a failure naming `call`."""
    try:
        got = fn(*args)
    except exc as e:
        assert match is None or match in str(e), \
            f"{call}: raised {type(e).__name__} as it should, but its message should name {match}: {e}"
        return
    pytest.fail(f"{call} should raise {exc.__name__}, it returned {got!r}")


@pytest.mark.exercise("11.4")
def test_allocator_random_operations(lesson):
    """Hypothesis stateful test: random allocate / share / release against a model of the counts."""

    class AllocatorMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.n = 6
            self.alloc = lesson.BlockAllocator(self.n)
            self.refs = {}                   # block -> count, blocks in use only

        @rule()
        def allocate(self):
            if len(self.refs) == self.n:
                should_raise(lesson.OutOfBlocks, None, f"allocate() with all {self.n} blocks in use "
                             f"(reference counts {self.refs})", self.alloc.allocate)
                return
            b = self.alloc.allocate()
            assert isinstance(b, (int, np.integer)) and 0 <= b < self.n, f"allocate() returned {b!r}, not a block id in [0, {self.n})"
            assert b not in self.refs, f"allocate() returned block {b}, which is in use (count {self.refs.get(b)})"
            self.refs[b] = 1

        @precondition(lambda self: self.refs)
        @rule(data=st.data())
        def share(self, data):
            b = data.draw(st.sampled_from(sorted(self.refs)))
            self.alloc.share(b)
            self.refs[b] += 1

        @precondition(lambda self: self.refs)
        @rule(data=st.data())
        def release(self, data):
            b = data.draw(st.sampled_from(sorted(self.refs)))
            freed = self.alloc.release(b)
            self.refs[b] -= 1
            assert freed == (self.refs[b] == 0), f"release({b}) returned {freed!r} with {self.refs[b]} references left"
            if self.refs[b] == 0:
                del self.refs[b]

        @invariant()
        def counts(self):
            assert self.alloc.num_free + self.alloc.num_used == self.n, \
                f"num_free {self.alloc.num_free} + num_used {self.alloc.num_used} != {self.n} blocks"
            assert self.alloc.num_used == len(self.refs), \
                f"num_used is {self.alloc.num_used}, but {len(self.refs)} blocks are in use ({sorted(self.refs)})"
            for b in range(self.n):
                assert self.alloc.refcount(b) == self.refs.get(b, 0), \
                    f"refcount({b}) is {self.alloc.refcount(b)}, expected {self.refs.get(b, 0)}"

    run_state_machine_as_test(AllocatorMachine, settings=settings(max_examples=40, stateful_step_count=30))


@pytest.mark.exercise("11.4")
def test_allocator_exhaustion_reuse_and_errors(lesson):
    alloc = lesson.BlockAllocator(5)
    got = [alloc.allocate() for _ in range(5)]
    assert sorted(got) == list(range(5)), f"5 allocations from 5 blocks should give each block once, got {got}"
    should_raise(lesson.OutOfBlocks, "5", "a 6th allocate() from 5 blocks, all in use (the message names the 5)",
                 alloc.allocate)
    alloc.share(got[2])
    assert alloc.release(got[2]) is False, "release of a block with 2 references must not free it"
    assert alloc.release(got[2]) is True and alloc.num_free == 1
    assert alloc.allocate() == got[2], "the only free block is the one just released"
    assert alloc.release(got[0]) is True
    should_raise(ValueError, str(got[0]), f"release({got[0]}) of a block already freed (double free; the message "
                 "names the block)", alloc.release, got[0])
    should_raise(ValueError, str(got[0]), f"share({got[0]}) of a free block (the message names the block)",
                 alloc.share, got[0])
    should_raise(ValueError, None, "refcount(5) on an allocator of blocks 0..4", alloc.refcount, 5)
    should_raise(ValueError, None, "BlockAllocator(0): no blocks", lesson.BlockAllocator, 0)
    assert issubclass(lesson.OutOfBlocks, Exception)


# ------------------------------------------------------------------ 11.5 paged attention
def random_pool(seed, block_size, hkv=2, hd=4, n_layer=1, num_blocks=24, ops=30):
    """A pool filled by random add / append / fork / free on the reference paged cache, NaN where
    nothing was written; returns (cache, {seq: contiguous k, v of layer 0})."""
    rng = np.random.default_rng(seed)
    cache = RefPagedCache(n_layer, hkv, hd, block_size, num_blocks, fill=np.nan)
    shadow = {}
    nxt = 0
    for _ in range(ops):
        op = rng.integers(0, 4) if shadow else 0
        if op == 0:
            cache.add(nxt)
            shadow[nxt] = (np.zeros((hkv, 0, hd)), np.zeros((hkv, 0, hd)))
            nxt += 1
        elif op in (1, 2):
            s = int(rng.choice(list(shadow)))
            n = int(rng.integers(1, 2 * block_size + 2))
            if cache.blocks_needed(s, n) > cache.num_free:
                continue
            k, v = rng.standard_normal((2, hkv, n, hd))
            cache.write(0, cache.append(s, n), k, v)
            shadow[s] = (np.concatenate([shadow[s][0], k], 1), np.concatenate([shadow[s][1], v], 1))
        elif op == 3 and rng.random() < 0.5:
            s = int(rng.choice(list(shadow)))
            cache.fork(s, nxt)
            shadow[nxt] = shadow[s]
            nxt += 1
        else:
            s = int(rng.choice(list(shadow)))
            cache.free(s)
            del shadow[s]
    return cache, {s: kv for s, kv in shadow.items() if kv[0].shape[1] > 0}


@pytest.mark.exercise("11.5")
@pytest.mark.parametrize("block_size,t", [(4, 1), (3, 2), (1, 1), (16, 1)])
def test_paged_attention_equals_dense(lesson, block_size, t):
    for seed in range(3):
        cache, shadow = random_pool(seed * 10 + block_size, block_size)
        seqs = [s for s, (k, _) in shadow.items() if k.shape[1] >= t]
        assert seqs
        rng = np.random.default_rng(seed)
        q = rng.standard_normal((len(seqs), 4, t, 4))
        table = cache.block_table(seqs)
        lengths = np.array([cache.lengths[s] for s in seqs])
        got = lesson.paged_attention(q, cache.k[0], cache.v[0], table, lengths)
        assert got.shape == q.shape, f"expected shape {q.shape}, got {got.shape}"
        assert not np.isnan(got).any(), ("NaN in the output: the pool holds NaN outside the sequences' tokens; read "
                                         "only each sequence's blocks and, in its last block, only the filled slots")
        for j, s in enumerate(seqs):
            k, v = shadow[s]
            want = dense_attention(q[j:j + 1], k[None], v[None], causal(t, k.shape[1]))
            err = np.abs(got[j:j + 1] - want).max()
            assert err < 1e-12, (f"block_size {block_size}, sequence {s} of {k.shape[1]} tokens in blocks "
                                 f"{cache.tables[s]}: max |diff| from dense attention {err:.2e}")


@pytest.mark.exercise("11.5")
def test_paged_attention_shared_blocks_and_table_errors(lesson):
    rng = np.random.default_rng(20)
    pool_k, pool_v = np.full((2, 6, 1, 4, 3), np.nan)
    # two sequences share block 5 (their first 4 tokens), then diverge into blocks 0 and 3
    k = rng.standard_normal((3, 1, 4, 3))
    v = rng.standard_normal((3, 1, 4, 3))
    pool_k[5], pool_v[5] = k[0], v[0]
    pool_k[0, :, :2], pool_v[0, :, :2] = k[1, :, :2], v[1, :, :2]
    pool_k[3, :, :3], pool_v[3, :, :3] = k[2, :, :3], v[2, :, :3]
    table = np.array([[5, 0], [5, 3]])
    q = rng.standard_normal((2, 2, 1, 3))
    got = lesson.paged_attention(q, pool_k, pool_v, table, [6, 7])
    for j, (blk, n) in enumerate(((1, 2), (2, 3))):
        kk = np.concatenate([k[0], k[blk][:, :n]], axis=1)
        vv = np.concatenate([v[0], v[blk][:, :n]], axis=1)
        want = dense_attention(q[j:j + 1], kk[None], vv[None])
        assert np.abs(got[j:j + 1] - want).max() < 1e-12, f"sequence {j} (blocks {table[j].tolist()})"
    with pytest.raises(ValueError):
        lesson.paged_attention(q, pool_k, pool_v, np.array([[5, -1], [5, 3]]), [6, 7])   # table too short


@pytest.mark.exercise("11.5")
def test_paged_attention_names_bad_shapes_and_block_ids(lesson):
    """3-D q gave 'not enough values to unpack', a block id outside the pool 'not covered'."""
    rng = np.random.default_rng(21)
    k_pool, v_pool = rng.standard_normal((2, 3, 1, 4, 2))
    q = rng.standard_normal((1, 1, 2, 2))
    got = lesson.paged_attention(q, k_pool, v_pool, np.array([[2, 0]]), [6])
    kk, vv = (np.concatenate([p[2], p[0][:, :2]], axis=1)[None] for p in (k_pool, v_pool))
    want = dense_attention(q, kk, vv, causal(2, 6))
    assert np.abs(got - want).max() < 1e-12, "paged attention over blocks [2, 0]"
    with pytest.raises(ValueError, match=r"paged_attention: expected q \(b, Hq, t, hd\).*got q \(1, 2, 2\)"):
        lesson.paged_attention(q[0], k_pool, v_pool, np.array([[2, 0]]), [6])
    with pytest.raises(ValueError, match=r"paged_attention: block_table holds block id\(s\) \[7\] outside the pool of 3 blocks"):
        lesson.paged_attention(q, k_pool, v_pool, np.array([[2, 7]]), [6])


# ------------------------------------------------------------------ 11.6 paged cache
@pytest.fixture
def ref_allocator(lesson, monkeypatch):
    """The paged cache's tests use the reference allocator (so they grade 11.6 alone)."""
    # the module's globals (inspect.unwrap: not those of a checking wrapper)
    monkeypatch.setitem(inspect.unwrap(lesson.PagedKVCache.__init__).__globals__, "BlockAllocator", RefAllocator)


def snapshot(cache):
    return (cache.k.copy(), cache.v.copy(), {s: list(t) for s, t in cache.tables.items()}, dict(cache.lengths),
            list(cache.allocator.refs))


@pytest.mark.exercise("11.6")
def test_paged_cache_random_operations(lesson, ref_allocator):
    """Hypothesis stateful test against a contiguous reference: add / append + write / fork / free."""
    L, HKV, HD = 2, 2, 3

    class PagedMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.cache = lesson.PagedKVCache(L, HKV, HD, block_size=3, num_blocks=10)
            self.ref = {}                      # seq -> (k, v) (L, HKV, n, HD)
            self.next_id = 0
            self.rng = np.random.default_rng(0)

        @rule()
        def add(self):
            self.cache.add(self.next_id)
            self.ref[self.next_id] = np.zeros((2, L, HKV, 0, HD))
            self.next_id += 1

        @precondition(lambda self: self.ref)
        @rule(data=st.data(), n=st.integers(0, 7))
        def append(self, data, n):
            s = data.draw(st.sampled_from(sorted(self.ref)))
            before = snapshot(self.cache)
            length = self.ref[s].shape[3]
            table = self.cache.tables[s]
            new = max(0, -(-(length + n) // 3) - len(table))
            cow = n > 0 and length % 3 != 0 and self.cache.allocator.refs[table[-1]] > 1
            got = self.cache.blocks_needed(s, n)
            assert got == new + cow, (f"blocks_needed({s}, {n}) with {length} tokens in {len(table)} blocks "
                                      f"(last shared: {cow}): expected {new + cow}, got {got}")
            if new + cow > self.cache.num_free:
                with pytest.raises(lesson.OutOfBlocks, match=str(s)):
                    self.cache.append(s, n)
                after = snapshot(self.cache)
                for a, b, what in zip(after, before, ("k", "v", "tables", "lengths", "refcounts")):
                    same = np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                    assert same, f"a refused append must leave the cache unchanged, but {what} changed"
                return
            slots = self.cache.append(s, n)
            assert len(slots) == n, f"append({s}, {n}) returned {len(slots)} slots"
            kv = self.rng.standard_normal((2, L, HKV, n, HD))
            for layer in range(L):
                self.cache.write(layer, slots, kv[0, layer], kv[1, layer])
            self.ref[s] = np.concatenate([self.ref[s], kv], axis=3)

        @precondition(lambda self: self.ref)
        @rule(data=st.data())
        def append_too_much(self, data):
            s = data.draw(st.sampled_from(sorted(self.ref)))
            n = (self.cache.num_free + 1) * 3
            before = snapshot(self.cache)
            with pytest.raises(lesson.OutOfBlocks, match=str(s)):
                self.cache.append(s, n)
            after = snapshot(self.cache)
            for a, b, what in zip(after, before, ("k", "v", "tables", "lengths", "refcounts")):
                same = np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                assert same, f"append({s}, {n}) with {self.cache.num_free} free blocks must be refused and leave the cache unchanged, but {what} changed"

        @precondition(lambda self: self.ref)
        @rule(data=st.data())
        def fork(self, data):
            s = data.draw(st.sampled_from(sorted(self.ref)))
            self.cache.fork(s, self.next_id)
            self.ref[self.next_id] = self.ref[s]
            self.next_id += 1

        @precondition(lambda self: self.ref)
        @rule(data=st.data())
        def free(self, data):
            s = data.draw(st.sampled_from(sorted(self.ref)))
            self.cache.free(s)
            del self.ref[s]

        @invariant()
        def reads_back_and_counts(self):
            cache = self.cache
            assert set(cache.tables) == set(self.ref), f"sequences {sorted(cache.tables)}, expected {sorted(self.ref)}"
            count = {}
            for s, t in cache.tables.items():
                n = self.ref[s].shape[3]
                assert cache.lengths[s] == n, f"lengths[{s}] is {cache.lengths[s]}, expected {n}"
                assert len(t) == -(-n // 3), f"sequence {s} of {n} tokens holds {len(t)} blocks {t}; expected {-(-n // 3)}"
                for b in t:
                    count[b] = count.get(b, 0) + 1
                for layer in range(L):
                    k, v = cache.gather(s, layer)
                    assert k.shape == (HKV, n, HD), f"gather({s}, {layer}) keys: expected {(HKV, n, HD)}, got {k.shape}"
                    assert np.array_equal(k, self.ref[s][0, layer]) and np.array_equal(v, self.ref[s][1, layer]), \
                        f"sequence {s}, layer {layer}: gather does not read back what was written (blocks {t})"
            refs = cache.allocator.refs
            for b in range(10):
                assert refs[b] == count.get(b, 0), \
                    f"block {b} is in {count.get(b, 0)} block tables but its reference count is {refs[b]}"
            assert cache.allocator.num_free + len(count) == 10, "free + used blocks must be all 10: a block leaked"

        def teardown(self):
            for s in list(self.ref):
                self.cache.free(s)
            assert self.cache.allocator.num_free == 10, "after freeing every sequence all blocks must be free"

    run_state_machine_as_test(PagedMachine, settings=settings(max_examples=30, stateful_step_count=25))


@pytest.mark.exercise("11.6")
def test_copy_on_write_of_a_shared_last_block(lesson, ref_allocator):
    cache = lesson.PagedKVCache(1, 1, 2, block_size=4, num_blocks=8)
    cache.add("a")
    rng = np.random.default_rng(21)
    ka = rng.standard_normal((1, 6, 2))
    cache.write(0, cache.append("a", 6), ka, ka)
    cache.fork("a", "b")
    assert cache.tables["b"] == cache.tables["a"] and cache.allocator.num_used == 2, \
        "fork shares every block: no new block, no copy"
    assert cache.blocks_needed("b", 1) == 1, "the shared last block is partly filled: appending needs a copy"
    assert cache.blocks_needed("b", 0) == 0 and len(cache.append("b", 0)) == 0, "append(b, 0) reserves nothing"
    assert cache.tables["b"] == cache.tables["a"] and cache.allocator.num_used == 2, \
        "append(b, 0) writes nothing, so it must not copy the shared block (nor take any block)"
    kb = rng.standard_normal((1, 1, 2))
    cache.write(0, cache.append("b", 1), kb, kb)
    ta, tb = cache.tables["a"], cache.tables["b"]
    assert ta[0] == tb[0] and ta[1] != tb[1], f"after b's first write b must own a copy of the last block: a {ta}, b {tb}"
    assert cache.allocator.refs[ta[1]] == 1 and cache.allocator.refs[tb[1]] == 1 and cache.allocator.refs[ta[0]] == 2
    assert np.array_equal(cache.gather("a", 0)[0], ka), "a's keys changed when b wrote: the write was not copied"
    assert np.array_equal(cache.gather("b", 0)[0], np.concatenate([ka, kb], 1)), "b must see a's 6 keys and its own"
    assert cache.blocks_needed("a", 1) == 0, "a's last block is no longer shared: a writes in place"
    cache.free("a")
    cache.free("b")
    assert cache.allocator.num_free == 8
    with pytest.raises(KeyError):
        cache.free("a")


@pytest.mark.exercise("11.6")
def test_append_that_does_not_fit_is_refused(lesson, ref_allocator):
    cache = lesson.PagedKVCache(1, 1, 2, block_size=4, num_blocks=3)
    cache.add(7)
    cache.append(7, 9)                          # 3 blocks
    cache.add(8)
    before = snapshot(cache)
    with pytest.raises(lesson.OutOfBlocks, match="8"):
        cache.append(8, 1)
    assert snapshot(cache)[2:] == before[2:], "the refused append changed the tables, lengths or counts"
    with pytest.raises(ValueError):
        cache.fork(7, 8)                        # 8 exists


# ------------------------------------------------------------------ 11.7 scheduler
@pytest.fixture
def ref_paging(lesson, monkeypatch):
    """The scheduler's tests use the reference paged cache and paged attention (11.7 alone)."""
    names = inspect.unwrap(lesson.Scheduler.__init__).__globals__  # the module's, not a checking wrapper's
    monkeypatch.setitem(names, "PagedKVCache", RefPagedCache)
    monkeypatch.setitem(names, "paged_attention", ref_paged_attention)
    monkeypatch.setitem(names, "OutOfBlocks", MemoryError)


def make_requests(lesson, seed, W, n, max_total):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        p = int(rng.integers(1, 12))
        new = int(rng.integers(1, min(10, max_total - p) + 1))
        reqs.append(lesson.Request(i, rng.integers(0, W.vocab_size, p), new, arrival=int(rng.integers(0, 6))))
    return reqs


def check_policy(history, reqs):
    """Replays the records: preempted = most recently admitted; first come, first served."""
    running, queue_order, admitted = [], [], []
    arrival = {r.id: (r.arrival, r.id) for r in reqs}
    for step, h in enumerate(history):
        for rid in h["preempted"]:
            assert running and running[-1] == rid, (f"step {step}: preempted {rid}, but the most recently admitted "
                                                    f"running request is {running[-1] if running else None} (running {running})")
            running.pop()
            queue_order.insert(0, rid)
        assert sorted(h["decode"]) == sorted(running), f"step {step}: decoded {h['decode']}, running were {running}"
        for rid in h["prefill"]:
            if rid in queue_order:
                assert queue_order[0] == rid, f"step {step}: admitted {rid} before {queue_order[0]}, which was preempted first"
                queue_order.pop(0)
            else:
                assert not queue_order, (f"step {step}: {rid} was admitted while {queue_order[0]}, preempted "
                                         f"earlier, still waited at the front of the queue")
                admitted.append(rid)
            running.append(rid)
        for rid in h["finished"]:
            running.remove(rid)
    assert admitted == sorted(admitted, key=arrival.get), \
        f"requests were first admitted in the order {admitted}: first come, first served means by arrival"


@pytest.mark.exercise("11.7")
@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])  # the patch holds for all
@given(seed=st.integers(0, 10_000))
@example(seed=0)
def test_each_request_equals_generating_it_alone(lesson, ref_paging, seed):
    W = small_gqa(lesson, seed=seed % 3)
    reqs = make_requests(lesson, seed, W, 7, max_total=20)
    sched = lesson.Scheduler(W, num_blocks=6, block_size=4, max_running=5)
    out = sched.run(reqs)
    for r in reqs:
        want = greedy_alone(W, r.prompt, r.max_new_tokens)
        assert np.array_equal(out[r.id], want), (f"request {r.id} (prompt {len(r.prompt)} tokens, {r.max_new_tokens} new, "
                                                 f"preempted {r.preemptions} times): {out[r.id].tolist()}, alone it "
                                                 f"gives {want.tolist()}")
    check_policy(sched.history, reqs)
    assert sched.cache.num_free == 6 and not sched.cache.tables, "every block must be free at the end"
    assert not sched.running and not sched.waiting and len(sched.finished) == len(reqs)


@pytest.mark.exercise("11.7")
def test_scheduler_mixes_steps_and_preempts(lesson, ref_paging):
    """A fixed workload where preemption must happen, and steps mix prefills and decodes."""
    W = small_gqa(lesson, seed=1)
    rng = np.random.default_rng(22)
    reqs = [lesson.Request(i, rng.integers(0, W.vocab_size, p), n, arrival=a)
            for i, (p, n, a) in enumerate([(7, 10, 0), (3, 12, 0), (5, 6, 2), (2, 9, 3), (9, 4, 4), (1, 8, 9)])]
    sched = lesson.Scheduler(W, num_blocks=7, block_size=4)
    out = sched.run(reqs)
    preempted = sum(len(h["preempted"]) for h in sched.history)
    mixed = sum(1 for h in sched.history if h["prefill"] and h["decode"])
    assert preempted >= 1, "a pool of 7 blocks of 4 cannot hold these requests at once: something must be preempted"
    assert mixed >= 1, "some step should run a prefill and decodes together"
    assert sum(r.preemptions for r in reqs) == preempted, "count each preemption on its request (Request.preemptions)"
    for r in reqs:
        assert np.array_equal(out[r.id], greedy_alone(W, r.prompt, r.max_new_tokens)), \
            f"request {r.id} (preempted {r.preemptions} times): output differs from generating it alone"
    check_policy(sched.history, reqs)
    assert len(sched.history) < sum(r.max_new_tokens for r in reqs), "batching should need fewer steps than tokens"


def policy_step(sched, by_id):
    """What one step must do, from the state before it (exercise 11.7, points 1 and 2):
    (preempted ids in order, ids that decode, ids admitted in order)."""
    cache = sched.cache
    running = [r.id for r in sched.running]
    need = {rid: cache.blocks_needed(rid, 1) for rid in running}
    free, preempted = cache.num_free, []
    while running and sum(need[rid] for rid in running) > free:
        victim = running.pop()                              # the most recently admitted
        free += len(cache.tables[victim])                   # no block is shared: freeing returns them all
        preempted.append(victim)
    budget = free - sum(need[rid] for rid in running)
    admitted = []
    for rid in list(reversed(preempted)) + [r.id for r in sched.waiting]:
        blocks = -(-len(by_id[rid].tokens) // cache.block_size)
        if len(running) + len(admitted) >= sched.max_running or blocks > budget:
            break
        budget -= blocks
        admitted.append(rid)
    return preempted, running, admitted


def sampled_alone(lesson, W, r, temperature):
    """Request r generated alone by full recomputation, sampling with its own seed as the scheduler must."""
    rng, tokens = np.random.default_rng(r.seed), [int(t) for t in r.prompt]
    for _ in range(r.max_new_tokens):
        tokens.append(lesson.sample_token(oracle_forward(W, np.array([tokens]))[0, -1], temperature, rng))
    return np.array(tokens[len(r.prompt):])


def run_checking_policy(lesson, sched, reqs, temperature):
    """Drives sched step by step (arrivals as in Scheduler.run) and checks every step against the
    policy; then each output against the request generated alone. Returns the step records."""
    by_id = {r.id: r for r in reqs}
    pending = sorted(reqs, key=lambda r: (r.arrival, r.id))
    records, clock = [], 0
    while pending or sched.waiting or sched.running:
        while pending and pending[0].arrival <= clock:
            sched.add(pending.pop(0))
        clock += 1
        assert clock < 500, "the scheduler does not finish the requests"
        if not sched.waiting and not sched.running:
            continue
        preempted, decode, admitted = policy_step(sched, by_id)
        done = [rid for rid in decode + admitted if len(by_id[rid].output) + 1 >= by_id[rid].max_new_tokens]
        before = {rid: len(r.output) for rid, r in by_id.items()}
        state = (f"running {[r.id for r in sched.running]}, waiting {[r.id for r in sched.waiting]}, "
                 f"{sched.cache.num_free} free blocks, needs {[sched.cache.blocks_needed(r.id, 1) for r in sched.running]}")
        rec = sched.step()
        records.append(rec)
        assert rec["preempted"] == preempted, (f"step {len(records) - 1} ({state}): preempted {rec['preempted']}, the "
                                               f"policy preempts {preempted} (most recently admitted first, only "
                                               f"while the decodes' blocks do not fit)")
        assert sorted(rec["decode"]) == sorted(decode), \
            f"step {len(records) - 1} ({state}): decoded {rec['decode']}, expected {decode}"
        assert rec["prefill"] == admitted, (f"step {len(records) - 1} ({state}): admitted {rec['prefill']}, the policy "
                                            f"admits {admitted} (in queue order, while they fit beside the decodes "
                                            f"and fewer than max_running={sched.max_running} run)")
        assert sorted(rec["finished"]) == sorted(done), \
            f"step {len(records) - 1}: finished {rec['finished']}, expected {done}"
        grew = {rid: len(r.output) - before[rid] for rid, r in by_id.items() if len(r.output) != before[rid]}
        assert grew == {rid: 1 for rid in decode + admitted}, (
            f"step {len(records) - 1}: each request in the step gains one token and keeps the ones it had (a "
            f"preempted request keeps its output); output lengths changed by {grew}")
        running = [rid for rid in decode + admitted if rid not in done]
        assert [r.id for r in sched.running] == running, \
            f"step {len(records) - 1}: running is {[r.id for r in sched.running]}, expected {running} (admission order)"
        for rid in running:
            assert sched.cache.lengths[rid] == len(by_id[rid].tokens) - 1, \
                f"request {rid} after a step: the cache must hold all its tokens but the newest"
        assert set(sched.cache.tables) == set(running), \
            f"sequences in the cache {sorted(sched.cache.tables)}, running {running}: free finished and preempted ones"
    for r in reqs:
        want = sampled_alone(lesson, sched.W, r, temperature) if temperature else greedy_alone(sched.W, r.prompt, r.max_new_tokens)
        assert np.array_equal(by_id[r.id].output, want), (
            f"request {r.id} (prompt {len(r.prompt)}, {r.max_new_tokens} new, seed {r.seed}, preempted {r.preemptions} "
            f"times, temperature {temperature}): {list(by_id[r.id].output)}, alone it gives {want.tolist()}")
    assert sum(len(h["prefill"]) + len(h["decode"]) for h in records) == sum(r.max_new_tokens for r in reqs)
    return records


@pytest.mark.exercise("11.7")
def test_scheduler_follows_the_policy_step_by_step(lesson, ref_paging):
    """Every step against the policy computed from the state before it: preemption only while
    needed and as many as needed, re-queued at the front, admission in order up to max_running;
    sampled outputs (each request's own rng) equal generating alone, so a preempted request keeps
    its output and its sampler's state."""
    W = small_gqa(lesson, seed=2)
    rng = np.random.default_rng(26)
    # two short requests admitted after a long one reach a block boundary with it, the pool full:
    # both must be preempted in one step
    trio = [lesson.Request(i, rng.integers(0, W.vocab_size, p), n, seed=i) for i, (p, n) in enumerate([(15, 6), (3, 8), (3, 7)])]
    records = run_checking_policy(lesson, lesson.Scheduler(W, num_blocks=6, block_size=4), trio, 0.0)
    assert any(len(h["preempted"]) >= 2 for h in records), "this workload needs two preemptions in one step"
    preemptions = 0
    for seed, num_blocks, max_running in ((0, 8, 4), (29, 8, 4), (3, 12, 2)):   # random workloads, blocks of 3
        rng = np.random.default_rng(seed)
        reqs = []
        for i in range(8):
            p = int(rng.integers(1, 12))
            reqs.append(lesson.Request(i, rng.integers(0, W.vocab_size, p), int(rng.integers(1, min(10, 24 - p) + 1)),
                                       arrival=int(rng.integers(0, 6)), seed=100 * seed + i))
        sched = lesson.Scheduler(W, num_blocks=num_blocks, block_size=3, max_running=max_running, temperature=1.0)
        records = run_checking_policy(lesson, sched, reqs, 1.0)
        preemptions += sum(len(h["preempted"]) for h in records)
    assert preemptions >= 2, "these workloads should preempt"


# ------------------------------------------------------------------ 11.8 speculative decoding
class TableLM:
    """A Markov language model over a small vocabulary: next-token distribution P[last token]."""

    def __init__(self, P):
        self.logp = np.log(np.asarray(P, dtype=np.float64))
        self.fed, self.appends, self.total_fed = [], 0, 0

    def append(self, tokens):
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        assert tokens, "append() of no tokens"
        self.appends += 1
        self.total_fed += len(tokens)
        self.fed += tokens
        return self.logp[tokens]

    def truncate(self, n):
        assert 0 <= n <= len(self.fed), f"truncate({n}) with {len(self.fed)} tokens fed"
        del self.fed[n:]

    def __len__(self):
        return len(self.fed)


def chi2_critical(df, z=3.09):
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.exercise("11.8")
def test_rule_gives_the_target_distribution_exactly(lesson):
    """By enumeration: draft x ~ q, keep it with accept[x], else draw from residual: the output is p."""
    rng = np.random.default_rng(23)
    cases = []
    for _ in range(20):
        p, q = rng.dirichlet(np.ones(5) * 0.7), rng.dirichlet(np.ones(5) * 0.7)
        cases.append((p, q))
    p = np.array([0.5, 0.5, 0, 0, 0.0])
    q = np.array([0.0, 0.2, 0.3, 0.5, 0.0])
    cases += [(p, q), (q, p), (p, p.copy()), (np.eye(5)[2], np.eye(5)[4]), (np.eye(5)[1], np.eye(5)[1])]
    for p, q in cases:
        accept, residual = lesson.speculative_rule(p, q)
        assert accept.shape == p.shape and residual.shape == p.shape
        assert np.all((accept >= 0) & (accept <= 1)), f"acceptance probabilities must lie in [0, 1], got {accept}"
        assert np.all(residual >= 0) and abs(residual.sum() - 1) < 1e-12, f"the residual must be a distribution, got {residual}"
        out = np.zeros(5)
        for x in range(5):
            out += q[x] * (accept[x] * np.eye(5)[x] + (1 - accept[x]) * residual)
        assert np.abs(out - p).max() < 1e-12, (f"p = {p.round(3)}, q = {q.round(3)}: drafting from q and applying the "
                                               f"rule gives {out.round(4)}, not p")


@pytest.mark.exercise("11.8")
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculative_equals_target_greedy(lesson, tiny, k):
    rng = np.random.default_rng(30 + k)
    prompt = rng.integers(0, tiny.vocab_size, 9)
    want = greedy_alone(tiny, prompt, 30)
    noise = TableLM(rng.dirichlet(np.ones(tiny.vocab_size), size=tiny.vocab_size))
    for name, draft in (("first layer", lesson.RecomputeLM(lesson.truncate_layers(tiny, 1))), ("random", noise),
                        ("the target itself", lesson.RecomputeLM(tiny))):
        target = lesson.RecomputeLM(tiny)
        got, stats = lesson.speculative_generate(target, draft, prompt, 30, k=k, temperature=0.0,
                                                 rng=np.random.default_rng(0))
        assert np.array_equal(got, want), (f"k={k}, draft {name}: greedy speculative output {got.tolist()} differs from "
                                           f"the target's greedy output {want.tolist()}")
        assert stats["target_calls"] == target.calls - 1 == stats["steps"], \
            f"one target call per step (after the prompt): {stats}, target called {target.calls} times"
        assert sum(1 for _ in got) == 30 and stats["accepted"] + stats["steps"] == 30, \
            f"each step yields accepted drafts + 1 tokens: {stats}"
        if name == "the target itself":
            assert stats["rejected"] == 0 and stats["steps"] == math.ceil(30 / (k + 1)), \
                f"a draft equal to the target is always accepted: {math.ceil(30 / (k + 1))} steps of {k + 1}, got {stats}"


@pytest.mark.exercise("11.8")
def test_sampled_output_follows_the_target(lesson):
    """Chi-square test (fixed seed) of the joint distribution of 3 sampled tokens, V = 3."""
    P = np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.34, 0.33, 0.33]])
    Q = np.array([[0.1, 0.3, 0.6], [0.5, 0.4, 0.1], [0.8, 0.1, 0.1]])
    rng = np.random.default_rng(24)
    n = 3000
    counts = np.zeros((3, 3, 3))
    appends = 0
    for _ in range(n):
        target, draft = TableLM(P), TableLM(Q)
        out, stats = lesson.speculative_generate(target, draft, [0, 2], 3, k=2, temperature=1.0, rng=rng)
        counts[tuple(out)] += 1
        appends += target.appends - 1
        committed = [0, 2] + out.tolist()
        assert target.fed == committed[:len(target.fed)], \
            "the target's fed tokens must stay a prefix of the committed tokens (truncate after a rejection)"
        assert len(target.fed) == len(committed) - 1, (
            f"after the last step the target should hold every committed token but the newest ({len(committed) - 1}), "
            f"it holds {len(target.fed)}: truncate to the fed tokens that are still a prefix, no fewer")
        assert target.total_fed == 1 + stats["steps"] + stats["drafted"], (
            f"the target is fed the prompt but its last token, then in each step the one committed token it has not "
            f"seen and the step's drafts: {1 + stats['steps'] + stats['drafted']} tokens for {stats}, it was fed "
            f"{target.total_fed}")
    expected = np.einsum("a,ab,bc->abc", P[2], P, P) * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < chi2_critical(26), (f"the 3-token outputs do not follow the target's distribution: chi-square "
                                      f"{chi2:.1f} > {chi2_critical(26):.1f} (26 degrees of freedom, p = 0.001)")


@pytest.mark.exercise("11.8")
def test_acceptance_rate_and_tokens_per_call(lesson):
    """Context-free models: every draft is accepted with probability a = sum(min(p, q))."""
    p = np.array([0.4, 0.3, 0.2, 0.1])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    a = np.minimum(p, q).sum()
    k = 3
    target, draft = TableLM(np.tile(p, (4, 1))), TableLM(np.tile(q, (4, 1)))
    out, stats = lesson.speculative_generate(target, draft, [1], 4000, k=k, temperature=1.0,
                                             rng=np.random.default_rng(25))
    tried = stats["accepted"] + stats["rejected"]
    rate = stats["accepted"] / tried
    sigma = math.sqrt(a * (1 - a) / tried)
    assert abs(rate - a) < 4 * sigma, (f"acceptance rate {rate:.3f} over {tried} drafts checked; expected "
                                       f"sum(min(p, q)) = {a:.3f} +- {4 * sigma:.3f}")
    per_call = len(out) / stats["target_calls"]
    predicted = (1 - a ** (k + 1)) / (1 - a)
    assert abs(per_call - predicted) < 0.06, f"tokens per target call {per_call:.3f}, expected (1 - a^(k+1)) / (1 - a) = {predicted:.3f}"
    freq = np.bincount(out, minlength=4) / len(out)
    assert np.abs(freq - p).max() < 0.03, f"token frequencies {freq.round(3)}, the target's distribution is {p}"


@pytest.mark.exercise("11.6")
def test_gather_names_a_layer_outside_the_cache(lesson, ref_allocator):
    cache = lesson.PagedKVCache(2, 1, 3, block_size=4, num_blocks=4)
    cache.add("a")
    slots = cache.append("a", 5)
    k = np.arange(15.0).reshape(1, 5, 3)
    cache.write(1, slots, k, -k)
    gk, gv = cache.gather("a", 1)
    assert np.array_equal(gk, k) and np.array_equal(gv, -k), (
        f"gather('a', 1) must return the 5 keys and values written, (1, 5, 3); got {np.shape(gk)}")
    with pytest.raises(ValueError, match=r"PagedKVCache.gather: layer must be < 2 \(the cache's layers\), got 5"):
        cache.gather("a", 5)
