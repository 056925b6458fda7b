"""One transformer: lesson 09's GPT.forward is the reference, and every other place the course
writes the block is a variant of it that must compute the same numbers. Each test runs a variant
on the weights of one lesson 09 GPT of odd sizes (3 layers, 3 heads of 7, vocabulary 37, context
23) in float64 and compares its logits (or its block's output) with GPT.forward's:

- lesson 11's gpt_forward (the model as NumPy functions over a flat copy of the weights),
  forward_cached (a dense KV cache: a prefill, then one token a step) and paged_forward (a paged
  cache, ragged chunks of several sequences in one step);
- lesson 15's FusedDecoder (the engine's step as one Numba function over the paged cache);
- lesson 14's gpt_block (the block as the tracer sees it: eagerly on Tensors, traced and
  interpreted, and gpt_block_numpy), with the attention biases zero (its block has none)."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch.gpt import GPT, GPTConfig
from minitorch.kv_cache import KVCache, PagedKVCache, forward_cached, gpt_forward, gpt_weights, paged_forward
from minitorch.autograd import Tensor

CONFIG = GPTConfig(vocab_size=37, block_size=23, n_layer=3, n_head=3, n_embd=21)
TOL = 1e-10


@pytest.fixture(scope="module")
def model():
    """A lesson 09 GPT in float64, its weights perturbed away from the initial ones (LayerNorm's 1
    and 0, zero biases) so that every parameter matters."""
    m = GPT(CONFIG, seed=1)
    rng = np.random.default_rng(0)
    for p in m.parameters():
        p.data = (p.data + 0.05 * rng.standard_normal(p.data.shape)).astype(np.float64)
    return m


def reference(model, idx):
    """Lesson 09's logits (B, T, vocab), float64."""
    return model(np.asarray(idx))[0].numpy()


def tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, shape)


def close(got, want, what):
    err = np.abs(np.asarray(got) - want).max()
    assert err < TOL, f"{what}: max |difference| from lesson 09's GPT.forward {err:.2e} (want < {TOL})"


def test_gpt_forward_is_gpt(model):
    idx = tokens(1, (2, 19))
    close(gpt_forward(gpt_weights(model, np.float64), idx), reference(model, idx), "gpt_forward")


def test_forward_cached_is_gpt(model):
    W, idx = gpt_weights(model, np.float64), tokens(2, (2, 17))
    cache = KVCache.for_model(W, batch=2)
    got = [forward_cached(W, cache, idx[:, :5])]                  # a prefill of 5, then one token a step
    got += [forward_cached(W, cache, idx[:, t:t + 1]) for t in range(5, 17)]
    close(np.concatenate(got, axis=1), reference(model, idx), "forward_cached")


def paged_steps(step, W, lengths=(11, 1, 6)):
    """Three sequences fed through `step` (paged_forward or a FusedDecoder's forward) over a paged
    cache with blocks of 3: a ragged first step of whole prompts, then one token each per step.
    Returns {seq: [(position, logits row)]} and the sequences' tokens."""
    cache = PagedKVCache.for_model(W, 3, 40)
    seqs = {s: tokens(10 + s, (n + 4,)) for s, n in enumerate(lengths)}
    for s in seqs:
        cache.add(s)
    rows = {s: [] for s in seqs}
    logits = step(W, cache, list(seqs), [seqs[s][:n] for s, n in zip(seqs, lengths)])
    for s, n in zip(seqs, lengths):
        rows[s].append((n - 1, logits[s]))
    for t in range(4):
        logits = step(W, cache, list(seqs), [seqs[s][n + t:n + t + 1] for s, n in zip(seqs, lengths)])
        for s, n in zip(seqs, lengths):
            rows[s].append((n + t, logits[s]))
    return rows, seqs


def check_paged(model, rows, seqs, what):
    for s, ids in seqs.items():
        want = reference(model, ids[None])[0]
        for pos, row in rows[s]:
            close(row, want[pos], f"{what}, sequence {s} at position {pos}")


def test_paged_forward_is_gpt(model):
    rows, seqs = paged_steps(paged_forward, gpt_weights(model, np.float64))
    check_paged(model, rows, seqs, "paged_forward")


def test_fused_decoder_is_gpt(model):
    from minitorch.fused_decode import FusedDecoder

    W = gpt_weights(model, np.float64)
    decoder = FusedDecoder(W)
    rows, seqs = paged_steps(lambda W, cache, s, chunks: decoder.forward(cache, s, chunks), W)
    check_paged(model, rows, seqs, "FusedDecoder")


def test_compiler_gpt_block_is_gpts_block(model):
    from minitorch.compiler import additive_causal_mask, gpt_block, gpt_block_numpy, interpret, trace

    block = model.blocks[1]
    sd = {k: np.asarray(v, dtype=np.float64) for k, v in model.state_dict().items() if k.startswith("blocks.1.")}
    for name in ("q", "k", "v", "proj"):                   # lesson 14's block has no attention biases
        getattr(block.attn, name).bias.data = np.zeros_like(sd[f"blocks.1.attn.{name}.bias"])
    p = {k[len("blocks.1."):]: v for k, v in sd.items()}
    d, h = CONFIG.n_embd // CONFIG.n_head, CONFIG.n_head
    ws = [p["ln1.weight"], p["ln1.bias"]]
    ws += [p[f"attn.{n}.weight"][:, j * d:(j + 1) * d] for j in range(h) for n in ("q", "k", "v")]
    ws += [p["attn.proj.weight"][j * d:(j + 1) * d] for j in range(h)]
    ws += [p["ln2.weight"], p["ln2.bias"], p["mlp.fc.weight"], p["mlp.fc.bias"], p["mlp.proj.weight"],
           p["mlp.proj.bias"]]
    x = np.random.default_rng(3).standard_normal((2, 13, CONFIG.n_embd))
    mask = additive_causal_mask(13, np.float64)
    try:
        want = block(Tensor(x)).numpy()
        close(gpt_block(Tensor(x), Tensor(mask), *map(Tensor, ws)).numpy(), want, "gpt_block on Tensors")
        close(interpret(trace(gpt_block, x, mask, *ws))(x, mask, *ws)[0], want, "gpt_block, traced")
        close(gpt_block_numpy(x, mask, *ws), want, "gpt_block_numpy")
    finally:
        for name in ("q", "k", "v", "proj"):
            getattr(block.attn, name).bias.data = sd[f"blocks.1.attn.{name}.bias"]
