# %% [markdown]
# # Lesson 11: serving a language model: KV cache, paged memory, batching, speculative decoding
#
# Training processes a whole sequence at once. Generation cannot: token t + 1 depends on token
# t, so a model that writes 500 tokens runs 500 times. This lesson makes those runs cheap, on
# lesson 09's tiny GPT, and measures what each step buys:
#
# 1. **Prefill and decode with a KV cache.** Without a cache every new token recomputes the
#    keys and values of the whole prefix: O(T) work per token for the layers, O(T^2) for
#    attention. With one, a token's keys and values are computed once and kept. You count the
#    multiply-adds of both (work, not time), and prove the cached model computes the same
#    numbers as the uncached one, to 1e-10 in float64.
# 2. **What the cache costs and why decode is memory-bound**: the cache's size,
#    2 x layers x kv_heads x head_dim x tokens x bytes, against the real arrays, and a decode
#    step's FLOPs per byte placed on lesson 04's roofline (Pope et al. 2022; Chen, "Transformer
#    Inference Arithmetic", kipply's blog, 2022).
# 3. **Fewer key/value heads**: multi-query (Shazeer 2019) and grouped-query attention (Ainslie
#    et al. 2023), and what converting the tiny GPT to them costs in loss.
# 4. **A paged KV cache** (Kwon et al. 2023, vLLM): fixed-size blocks, a block table per
#    sequence, an allocator with a free list and reference counts, shared prefixes with
#    copy-on-write, and attention that reads through the block table.
# 5. **Continuous batching** (Yu et al. 2022, Orca): a scheduler that admits requests while
#    blocks are free, runs prefills and decodes of different lengths in one step, retires
#    finished sequences and preempts when memory runs out.
# 6. **Speculative decoding** (Leviathan et al. 2023; Chen et al. 2023): a cheap draft model
#    proposes k tokens, the model checks them in one pass, and a rejection rule keeps the
#    output distribution exactly the model's.
#
# The course's reference version of this lesson is `minitorch/kv_cache.py`. Background: the
# hardware side of inference
# (bandwidth per token, batch size against arithmetic intensity, cache sizes of real models) in
# [inference](../hardware_notes/inference.md); the roofline in
# [roofline](../hardware_notes/roofline.md); parameter and FLOP counts in
# [transformer arithmetic](../hardware_notes/transformer_arithmetic.md); why memory bandwidth
# lags arithmetic in [memory](../hardware_notes/memory.md#why-decode-and-attention-are-memory-bound).
#
# Conventions: the model runs here in NumPy (lesson 09's weights, no autograd: inference needs
# none), float64 where exactness is checked and float32 where speed is measured. Token ids are
# int64; attention tensors are (batch, heads, positions, head_dim) as in lesson 09.

# %%
import os
import time

import numpy as np

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %%
#| default_exp kv_cache
#| export
"""minitorch.kv_cache: generation with a KV cache, grouped-query attention, a paged KV cache with a
block allocator, continuous batching and speculative decoding, on lesson 09's tiny GPT in NumPy.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from minitorch.attention import causal_mask, check_size
from minitorch.checks import check_array, check_instance, check_int, describe
from minitorch.gpt import GELU_C, GPT, check_sampling, layer_norm_np, load_tiny_gpt

# %% [markdown]
# ## 1. The tiny GPT in NumPy, with its work counted
#
# Lesson 09's model, rewritten as plain functions over its weights: `gpt_forward` is the same
# arithmetic as `GPT.forward` (the check below compares them), in whatever dtype the weights
# have. Why a copy rather than `GPT.forward` itself: generation needs no gradients, so nothing
# should record an autograd tape per token, and the cached, paged and (lesson 15) fused forwards
# below all read one flat layout of the weights (`GPTWeights.params`: lesson 09's names, Linear
# weights (in, out)). Each of them is lesson 09's model with one thing changed, and
# `tests/machinery/test_one_transformer.py` holds each to `GPT.forward`'s logits. Every matrix product goes through `matmul`, which counts multiply-adds while a
# `count_macs()` block is open: the tests grade the cache by the work it saves, not by a clock.
#
# The pieces you will reuse: `embed(W, idx, pos)` (token plus position embeddings, for any
# positions), `layer_qkv(W, i, x)` (LayerNorm, then the q, k, v projections of layer i, split
# into heads), `layer_finish(W, i, x, o)` (the output projection of the attention result o, the
# residual, the MLP) and `lm_head(W, x)` (final LayerNorm and the tied output layer).
# `attend(q, k, v, mask)` is attention for any number of key/value heads that divides the
# number of query heads (section 4 explains why one would have fewer).

# %%
#| export
class MacCounter:
    """Multiply-adds done by `matmul` while it is open (count_macs())."""

    def __init__(self) -> None:
        self.macs = 0
        self.calls = 0


_COUNTERS: list[MacCounter] = []


@contextmanager
def count_macs() -> Iterator[MacCounter]:
    """with count_macs() as c: ... ; c.macs is the multiply-adds of every matmul() inside."""
    counter = MacCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b (NumPy broadcasting rules), counting prod(out.shape) * a.shape[-1] multiply-adds."""
    # the model's inner loop: the common case of the check is a few attribute reads, inline
    if not (a.__class__ is np.ndarray and b.__class__ is np.ndarray and a.dtype.kind in "fiu"
            and b.dtype.kind in "fiu"):
        check_array("matmul", "a", a, dtypes="real"), check_array("matmul", "b", b, dtypes="real")
    out = a @ b
    if _COUNTERS:
        macs = int(np.prod(out.shape, dtype=np.int64)) * a.shape[-1]
        for counter in _COUNTERS:
            counter.macs += macs
            counter.calls += 1
    return out


@dataclass
class GPTWeights:
    """Lesson 09's GPT as NumPy arrays of one dtype, plus its shape.

    params: lesson 09's parameter names -> arrays (Linear weights are (in, out)). The key and
    value projections blocks.i.attn.{k,v} are (n_embd, n_kv_head * head_dim); n_kv_head ==
    n_head for the trained model."""

    params: dict[str, np.ndarray]
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    ln_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def dtype(self) -> np.dtype:
        return self.params["wte.weight"].dtype

    def astype(self, dtype: Any) -> "GPTWeights":
        return replace(self, params={k: v.astype(dtype) for k, v in self.params.items()})


def gpt_weights(model: GPT, dtype: Any = np.float64) -> GPTWeights:
    """The weights of a lesson 09 GPT, converted to `dtype`.

    Serving (this lesson and lesson 15) runs this NumPy copy and never GPT.forward: a forward pass
    with no autograd tape to record, in any dtype, and one flat layout (name -> array, Linear
    weights (in, out)) that the paged cache's forward and lesson 15's fused step read as they are.
    The arithmetic is GPT.forward's (tests/machinery/test_one_transformer.py compares them)."""
    c = model.config
    return GPTWeights({k: np.asarray(v).astype(dtype) for k, v in model.state_dict().items()},
                      c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_head, c.n_embd, c.ln_eps)


def load_tiny_weights(dtype: Any = np.float64) -> GPTWeights:
    """Lesson 09's shipped tiny GPT (data/tiny_gpt.*) as GPTWeights of `dtype`."""
    return gpt_weights(load_tiny_gpt()[0], dtype)


def random_gpt_weights(vocab_size: int = 103, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                       n_embd: int = 64, n_kv_head: int | None = None, seed: int = 0,
                       dtype: Any = np.float64) -> GPTWeights:
    """A GPT of the given shape with random weights (N(0, 0.02^2) matrices, LayerNorm 1 and 0,
    small random biases): for tests and for timing at contexts the trained model does not have."""
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    if n_embd % n_head or n_head % n_kv_head:
        raise ValueError(f"random_gpt_weights: n_embd={n_embd} must be a multiple of n_head={n_head}, and n_head of "
                         f"n_kv_head={n_kv_head}")
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head
    shapes = {"wte.weight": (vocab_size, n_embd), "wpe.weight": (block_size, n_embd),
              "ln_f.weight": (n_embd,), "ln_f.bias": (n_embd,)}
    for i in range(n_layer):
        for name, (a, b) in {"attn.q": (n_embd, n_embd), "attn.k": (n_embd, n_kv_head * hd),
                             "attn.v": (n_embd, n_kv_head * hd), "attn.proj": (n_embd, n_embd),
                             "mlp.fc": (n_embd, 4 * n_embd), "mlp.proj": (4 * n_embd, n_embd)}.items():
            shapes[f"blocks.{i}.{name}.weight"], shapes[f"blocks.{i}.{name}.bias"] = (a, b), (b,)
        for ln in ("ln1", "ln2"):
            shapes[f"blocks.{i}.{ln}.weight"], shapes[f"blocks.{i}.{ln}.bias"] = (n_embd,), (n_embd,)
    params = {}
    for name, shape in shapes.items():
        if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "ln_f.weight":
            params[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            params[name] = 0.02 * rng.standard_normal(shape)
        else:
            params[name] = (0.3 if name.startswith(("wte", "wpe")) else 0.02 * 4) * rng.standard_normal(shape)
    return GPTWeights({k: v.astype(dtype) for k, v in params.items()}, vocab_size, block_size, n_layer,
                      n_head, n_kv_head, n_embd)


def linear(x: np.ndarray, params: dict[str, np.ndarray], name: str) -> np.ndarray:
    """x (..., in) @ params[name.weight] (in, out) + params[name.bias] -> (..., out)."""
    if not (x.__class__ is np.ndarray and x.dtype.kind in "fiu" and params.__class__ is dict and name.__class__ is str):
        check_array("linear", "x", x, dtypes="real"), check_instance("linear", "params", params, dict)
        check_instance("linear", "name", name, str)
    if name + ".weight" not in params:
        raise ValueError(f"linear: name {name!r} is not a layer of params (no {name + '.weight'!r})")
    return matmul(x, params[name + ".weight"]) + params[name + ".bias"]


def _check_attention_inputs(what: str, q: Any, k: Any, v: Any, mask: Any = None) -> np.ndarray | None:
    """ValueError naming the shapes unless q (B, Hq, Tq, hd) and k, v (B, Hkv, Tk, hd) fit, Hq a
    multiple of Hkv >= 1; TypeError unless q, k, v are float arrays and mask is None or boolean,
    ValueError unless it broadcasts to (B, Hq, Tq, Tk). Returns the mask broadcast to that shape (or None)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
            raise TypeError(f"{what}: {name} must be a floating NumPy array (B, H, T, hd), got {describe(a)}")
    shapes = (q.shape, k.shape, v.shape)
    (sq, sk, sv) = shapes
    if (len(sq) != 4 or len(sk) != 4 or sk != sv or sq[0] != sk[0] or sq[-1] != sk[-1] or sk[1] == 0
            or sq[1] % sk[1]):
        raise ValueError(f"{what}: expected q (B, Hq, Tq, hd) and k, v (B, Hkv, Tk, hd) with Hq a multiple of "
                         f"Hkv, got q {sq}, k {sk}, v {sv}")
    if mask is None:
        return None
    given, mask = mask, np.asarray(mask) if not isinstance(mask, (str, bytes)) else None
    if mask is None or mask.dtype != np.bool_:
        raise TypeError(f"{what}: the mask must be boolean (True = may attend), got {describe(given)}")
    scores = (sq[0], sq[1], sq[2], sk[2])
    try:
        return np.broadcast_to(mask, scores)
    except ValueError:
        raise ValueError(f"{what}: mask of shape {mask.shape} does not broadcast to the scores' shape {scores} "
                         "(B, Hq, Tq, Tk)") from None


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Attention of q (B, Hq, Tq, hd) over k, v (B, Hkv, Tk, hd), Hq a multiple of Hkv: query head
    h uses key/value head h // (Hq // Hkv) (the K/V heads are repeated). mask: boolean,
    broadcastable to (B, Hq, Tq, Tk), True where a query may see a key. Returns (B, Hq, Tq, hd)
    in q's dtype; a query that sees no key (every query when Tk = 0) gets zeros."""
    mask = _check_attention_inputs("attend", q, k, v, mask)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = matmul(q, np.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # initial: Tk = 0 gives -inf, not an error
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    return matmul(e / np.where(total > 0, total, 1.0), v)


def gelu(x: np.ndarray) -> np.ndarray:
    """Lesson 09's gelu_np (tanh form) with x * x * x for x ** 3: NumPy computes a float32 x ** 3
    through powf, about 100x slower than two multiplies here. Same value to rounding, in x's dtype
    (any float, float16 included)."""
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * (x * x * x))))


def embed(W: GPTWeights, idx: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Token plus position embeddings: idx (B, T) ids at positions pos ((T,) or (B, T)) -> (B, T, C).
    Ids lie in [0, vocab_size), positions in [0, block_size)."""
    idx, pos = np.asarray(idx), np.asarray(pos)
    for name, a, n in (("idx", idx, W.vocab_size), ("pos", pos, W.block_size)):
        if a.size and (a.min() < 0 or a.max() >= n):
            raise ValueError(f"embed: {name} must lie in [0, {n}), got values {a.min()}..{a.max()}")
    return W.params["wte.weight"][idx] + W.params["wpe.weight"][pos]


def _layer_index(W: GPTWeights, i: Any, what: str) -> int:
    """i as an int if it is a layer index of W (0 <= i < n_layer); TypeError or ValueError naming it otherwise."""
    if i.__class__ is int and 0 <= i < W.n_layer:
        return i
    return check_int(what, "i", i, 0, W.n_layer - 1)


def layer_qkv(W: GPTWeights, i: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer i's LayerNorm 1 and q, k, v projections of the residual stream x (B, T, C):
    q (B, n_head, T, hd), k and v (B, n_kv_head, T, hd)."""
    p, pre = W.params, f"blocks.{_layer_index(W, i, 'layer_qkv')}."
    h = layer_norm_np(x, p[pre + "ln1.weight"], p[pre + "ln1.bias"], W.ln_eps)
    b, t, _ = x.shape
    q = linear(h, p, pre + "attn.q").reshape(b, t, W.n_head, -1).transpose(0, 2, 1, 3)
    k = linear(h, p, pre + "attn.k").reshape(b, t, W.n_kv_head, -1).transpose(0, 2, 1, 3)
    v = linear(h, p, pre + "attn.v").reshape(b, t, W.n_kv_head, -1).transpose(0, 2, 1, 3)
    return q, k, v


def layer_finish(W: GPTWeights, i: int, x: np.ndarray, o: np.ndarray) -> np.ndarray:
    """The rest of layer i: x + proj(merged heads of o (B, H, T, hd)), then + MLP(LayerNorm 2).
    Returns the new residual stream (B, T, C)."""
    p, pre = W.params, f"blocks.{_layer_index(W, i, 'layer_finish')}."
    b, _, t, _ = o.shape
    x = x + linear(o.transpose(0, 2, 1, 3).reshape(b, t, -1), p, pre + "attn.proj")
    h = layer_norm_np(x, p[pre + "ln2.weight"], p[pre + "ln2.bias"], W.ln_eps)
    return x + linear(gelu(linear(h, p, pre + "mlp.fc")), p, pre + "mlp.proj")


def lm_head(W: GPTWeights, x: np.ndarray) -> np.ndarray:
    """Final LayerNorm and the output layer (tied to the token embedding): (..., C) -> (..., vocab)."""
    h = layer_norm_np(x, W.params["ln_f.weight"], W.params["ln_f.bias"], W.ln_eps)
    return matmul(h, W.params["wte.weight"].T)


def check_ids(W: GPTWeights, idx: Any, what: str, name: str = "idx") -> np.ndarray:
    """idx as a (B, T) int64 array of ids in [0, vocab_size), T >= 1; ValueError naming `what`, `name`
    and the value otherwise."""
    given, idx = idx, np.asarray(idx) if not isinstance(idx, (str, bytes)) else np.asarray(0.5)
    if idx.ndim != 2 or idx.shape[1] < 1 or idx.dtype.kind not in "iu" or \
            (idx.size and (idx.min() < 0 or idx.max() >= W.vocab_size)):
        values = f", values {idx.min()}..{idx.max()}" if idx.size and idx.dtype.kind in "iuf" else ""
        raise ValueError(f"{what}: {name} must be a (B, T) integer array of token ids in [0, {W.vocab_size}) with "
                         f"T >= 1, got {describe(given)}{values}")
    return idx.astype(np.int64, copy=False)


def _token_ids(W: GPTWeights, ids: Any, what: str, name: str) -> np.ndarray:
    """ids (a 1-D array or list of token ids, at least one) as a 1-D int64 array; TypeError or ValueError
    naming `what`, `name` and the value unless they are integers in [0, vocab_size)."""
    arr = np.asarray(ids) if isinstance(ids, (list, tuple, range, np.ndarray, np.integer)) else None
    if arr is None or arr.dtype.kind not in "iu":
        raise TypeError(f"{what}: {name} must be a 1-D array or list of integer token ids, got {describe(ids)}")
    if arr.ndim != 1 or arr.size < 1 or arr.min() < 0 or arr.max() >= W.vocab_size:
        values = f", values {arr.min()}..{arr.max()}" if arr.size else ""
        raise ValueError(f"{what}: {name} must be a 1-D array of at least one token id in [0, {W.vocab_size}), "
                         f"got {describe(ids)} ({arr.ndim} axes{values})")
    return arr.astype(np.int64, copy=False)


def gpt_forward(W: GPTWeights, idx: Any, attend_fn: Any = None,
                return_kv: bool = False) -> np.ndarray | tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The whole model on idx (B, T), T <= block_size, positions 0..T-1, causal: logits (B, T,
    vocab) in the weights' dtype. No cache: everything is computed from the tokens. A variant of
    lesson 09's GPT.forward that changes only where the numbers live (NumPy arrays, no tape). attend_fn
    replaces attend (section 4). With return_kv, also [(k, v) of each layer], each (B, n_kv_head,
    T, hd): what a cache would hold."""
    idx = check_ids(W, idx, "gpt_forward")
    t = idx.shape[1]
    if t > W.block_size:
        raise ValueError(f"gpt_forward: {t} tokens do not fit the context of block_size={W.block_size}")
    attend_fn = attend if attend_fn is None else attend_fn
    x = embed(W, idx, np.arange(t))
    mask = causal_mask(t, t)
    kv = []
    for i in range(W.n_layer):
        q, k, v = layer_qkv(W, i, x)
        x = layer_finish(W, i, x, attend_fn(q, k, v, mask))
        kv.append((k, v))
    logits = lm_head(W, x)
    return (logits, kv) if return_kv else logits


def lm_loss(W: GPTWeights, x: np.ndarray, y: np.ndarray, attend_fn: Any = None, batch_size: int = 64) -> float:
    """Mean cross-entropy (nats per token) of the model predicting y (B, T) from x (B, T) (token ids)."""
    if np.shape(x) != np.shape(y):
        raise ValueError(f"lm_loss: x and y must have one shape (B, T), got x {np.shape(x)} and y {np.shape(y)}")
    check_ids(W, x, "lm_loss", "x"), check_ids(W, y, "lm_loss", "y")
    total = 0.0
    for s in range(0, len(x), batch_size):
        logits = gpt_forward(W, x[s:s + batch_size], attend_fn).astype(np.float64)
        m = logits.max(axis=-1, keepdims=True)
        logp = logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
        total += -np.take_along_axis(logp, y[s:s + batch_size, :, None], axis=-1).sum()
    return total / y.size

# %% [markdown]
# The shipped model, and a check that this NumPy forward is lesson 09's: in float32 the two
# agree to float32 rounding.

# %%
from minitorch.gpt import CharTokenizer, EVAL_WINDOWS, eval_windows, load_corpus, load_tiny_gpt, split_ids

gpt_model, tok = load_tiny_gpt()
W64 = gpt_weights(gpt_model, np.float64)
train_ids, val_ids = split_ids(tok.encode(load_corpus()))
probe = val_ids[None, :48]
diff = np.abs(gpt_forward(gpt_weights(gpt_model, np.float32), probe) - gpt_model(probe)[0].numpy()).max()
print(f"tiny GPT: {W64.n_layer} layers, {W64.n_head} heads of {W64.head_dim}, d = {W64.n_embd}, "
      f"context {W64.block_size}; NumPy forward vs lesson 09's, float32: max |difference| {diff:.1e}")

# %% [markdown]
# ## 2. Prefill and decode
#
# Generating from a prompt of P tokens has two phases:
#
# - **Prefill**: run the P prompt tokens through the model at once (a matrix of P rows in every
#   layer), which gives the first new token.
# - **Decode**: one token at a time: feed the token just produced, get the next.
#
# Without a cache each decode step is a prefill of everything so far: at length T it computes
# the keys and values of all T tokens again, in every layer, although only the newest token's
# are new (the model is causal: token j's keys and values depend only on tokens 0..j). A **KV
# cache** keeps each layer's keys and values of the tokens seen so far; a step then computes
# q, k and v for the new tokens only, writes their k and v into the cache, and attends over
# the cached keys. The work per token drops from O(T) matrix rows (plus O(T^2) attention) to
# one row (plus O(T) attention).
#
# The positions are where this goes wrong. A step that feeds t new tokens to a sequence holding
# n must embed them at positions n .. n + t - 1 (not 0 .. t - 1), write their keys and values at
# those slots, attend over keys 0 .. n + t - 1, and let new token i (position n + i) see key j
# iff j <= n + i: lesson 09's bottom-right-aligned `causal_mask(t, n + t)` for one sequence.
# A prefill is such a step with n = 0; a chunked prefill (a long prompt fed in pieces, as
# servers do to bound a step's latency) is several; a decode step has t = 1.
#
# The cache below holds a batch of sequences, each row with its own length; a step may feed
# some of the rows (`rows`), each continuing at its own position.

# %%
#| export
class KVCache:
    """A dense KV cache for `batch` sequences of up to `max_len` tokens.

    k, v: (n_layer, batch, n_kv_head, max_len, head_dim) arrays of `dtype`, zeros at first;
    lengths: (batch,) int64, how many positions of each row hold real keys and values (the row's
    tokens so far). Positions at or past a row's length hold nothing meaningful."""

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype: Any = np.float64):
        for name, value in (("n_layer", n_layer), ("batch", batch), ("n_kv_head", n_kv_head),
                            ("max_len", max_len), ("head_dim", head_dim)):
            check_int("KVCache", name, value, 1)
        shape = (n_layer, batch, n_kv_head, max_len, head_dim)
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)
        self.lengths = np.zeros(batch, np.int64)

    @classmethod
    def for_model(cls, W: GPTWeights, batch: int = 1, max_len: int | None = None) -> "KVCache":
        """A cache shaped for W, in W's dtype; max_len defaults to W.block_size."""
        return cls(W.n_layer, batch, W.n_kv_head, W.block_size if max_len is None else max_len, W.head_dim, W.dtype)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of the two arrays (all max_len positions, filled or not)."""
        return self.k.nbytes + self.v.nbytes

    def reset(self, rows: Any = None) -> None:
        """Forget the rows (default all; else row indices in [0, batch)): their lengths become 0."""
        if rows is not None and np.size(rows) and (np.min(rows) < 0 or np.max(rows) >= self.batch):
            raise ValueError(f"KVCache.reset: rows must be row indices in [0, {self.batch}), got {describe(rows)}")
        self.lengths[slice(None) if rows is None else np.asarray(rows, dtype=np.int64)] = 0

# %% [markdown]
# ### Exercise 11.1: a forward step that reads and writes the cache
#
# Write `forward_cached(W, cache, idx, rows=None)`: the model on t new tokens for each of the
# cache rows `rows`, as described above. Use the given pieces (`embed`, `layer_qkv`, `attend`,
# `layer_finish`, `lm_head`): they do their products through `matmul`, so the work is counted.
# The tests check the logits against `gpt_forward` on the whole sequence at every step, to
# 1e-10 in float64, for prompts of several lengths, chunked prefills and rows of different
# lengths decoding together; they read the cache's contents; and they count the multiply-adds
# of a decode step, which must be those of one token: attend over the `n + t` filled positions
# only, not over the whole `max_len` buffer.
#
# Check everything before writing anything: a step that would pass the end of a row (the
# cache's `max_len` or the model's `block_size`, whichever is smaller) raises a ValueError that
# names the row, and leaves the cache as it was.

# %%
#| export
#| exercise 11.1
def forward_cached(W: GPTWeights, cache: KVCache, idx: Any, rows: Any = None) -> np.ndarray:
    """One step of the model with a KV cache: gpt_forward's layers (layer_qkv, attend, layer_finish,
    lm_head) on the new tokens only, their keys and values kept and the earlier ones read back.

    idx (b, t) int: t new tokens for each of b cache rows `rows` (distinct row indices; default:
    all rows, b = cache.batch). Row r's tokens take positions cache.lengths[r] ...
    cache.lengths[r] + t - 1. Writes their keys and values into cache.k and cache.v at those
    positions in every layer, attends causally over the row's keys 0 .. lengths[r] + t - 1,
    advances cache.lengths[rows] by t and returns the logits (b, t, vocab) in W's dtype.

    Raises ValueError (the cache unchanged) if idx is not (b, t) token ids matching rows, or a row
    would pass min(cache.max_len, W.block_size) positions."""
    ### BEGIN SOLUTION
    idx = check_ids(W, idx, "forward_cached")
    rows = np.arange(cache.batch) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    b, t = idx.shape
    if len(rows) != b or len(set(rows.tolist())) != b or (b and (rows.min() < 0 or rows.max() >= cache.batch)):
        raise ValueError(f"forward_cached: idx has {b} rows but rows is {rows.tolist()} (need {b} distinct "
                         f"indices in [0, {cache.batch}))")
    start = cache.lengths[rows]                          # (b,) tokens each row already holds
    limit = min(cache.max_len, W.block_size)
    for r, n in zip(rows.tolist(), start.tolist()):
        if n + t > limit:
            raise ValueError(f"forward_cached: row {r} holds {n} tokens; {t} more pass the {limit} positions "
                             f"(cache max_len {cache.max_len}, model block_size {W.block_size})")
    pos = start[:, None] + np.arange(t)                  # (b, t) absolute positions of the new tokens
    n_keys = int(pos.max()) + 1                          # keys anyone in this step may see
    mask = (np.arange(n_keys)[None, :] <= pos[:, :, None])[:, None]   # (b, 1, t, n_keys)
    x = embed(W, idx, pos)
    for i in range(W.n_layer):
        q, k, v = layer_qkv(W, i, x)
        for j, r in enumerate(rows.tolist()):
            cache.k[i, r, :, start[j]:start[j] + t] = k[j]
            cache.v[i, r, :, start[j]:start[j] + t] = v[j]
        keys, values = cache.k[i, rows, :, :n_keys], cache.v[i, rows, :, :n_keys]
        x = layer_finish(W, i, x, attend(q, keys, values, mask))
    cache.lengths[rows] += t
    return lm_head(W, x)
    ### END SOLUTION

# %% [markdown]
# Generation on top of it. The context is 64 positions (the position table has 64 rows), so a
# sequence cannot simply grow past 64 tokens. The choice here: when the context is full, keep
# its last `keep` tokens (default 32) and start again from them at positions 0 .. keep - 1. With
# learned absolute positions a cached key cannot be moved to another position (it was computed
# from the old position's embedding, in every layer), so the cached path re-prefills those
# `keep` tokens, once per 64 - 32 = 32 new tokens; the uncached path sees the same window.
# Both paths follow the same rule, so they compute the same numbers at every step, across the
# window boundary too (the tests check it). (A sliding window that moves by one token every
# step would need a full recompute per token with this model; models with rotary position
# embeddings can instead rotate or keep their cached keys.)

# %%
#| export
def _vector(what: str, name: str, a: Any, kinds: str = "fiu") -> None:
    """TypeError or ValueError naming `what`, `name` and the value unless a is a 1-D NumPy array of
    the dtype kinds (real numbers by default). The sampling loop's check: its common case is a few
    attribute reads, cheaper than a checking wrapper."""
    if a.__class__ is np.ndarray and a.ndim == 1 and a.dtype.kind in kinds:
        return
    ok = isinstance(a, np.ndarray) and a.dtype.kind in kinds
    raise (ValueError if ok else TypeError)(
        f"{what}: {name} must be a 1-D NumPy array of {'real numbers' if kinds == 'fiu' else 'floats'}, got "
        f"{describe(a)} ({np.ndim(a)} axes)")


def token_probs(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Next-token probabilities, in float64 along the last axis, from logits of any real dtype (float16
    too): softmax(logits / temperature); temperature 0 puts all the mass on the most likely token
    (greedy); temperature >= 0."""
    if not (logits.__class__ is np.ndarray and logits.dtype.kind in "fiu"):  # the sampling loop: checks inline
        check_array("token_probs", "logits", logits, dtypes="real")
    check_sampling("token_probs", None, temperature)
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return (np.arange(logits.shape[-1]) == logits.argmax(axis=-1)[..., None]).astype(np.float64)
    z = logits / temperature
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn from the distribution p (1-D, sums to 1) with one uniform number (inverse
    CDF; the same law as rng.choice(len(p), p=p), several times faster for small p)."""
    _vector("draw", "p", p, "f")
    if rng.__class__ is not np.random.Generator:
        check_instance("draw", "rng", rng, np.random.Generator)
    cdf = np.cumsum(p)
    if not 0 < cdf[-1] < math.inf or p.min() < 0:
        raise ValueError(f"draw: p must be a distribution (finite, >= 0, a positive sum), got {describe(p)} "
                         f"with values {p.min()}..{p.max()}")
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))


def sample_token(logits: np.ndarray, temperature: float, rng: np.random.Generator | None) -> int:
    """One token id from logits (vocab,): argmax for temperature 0, else draw(token_probs(...)), which
    needs rng (a np.random.Generator)."""
    _vector("sample_token", "logits", logits)
    if not (temperature.__class__ in (float, int) and 0 <= temperature < math.inf):
        check_sampling("sample_token", None, temperature)
    if rng is None and temperature != 0 or rng is not None and rng.__class__ is not np.random.Generator:
        raise TypeError(f"sample_token: rng must be a np.random.Generator (None only at temperature 0), got "
                        f"{describe(rng)}")
    if temperature == 0:
        return int(np.argmax(logits))
    return draw(token_probs(logits, temperature), rng)


def generate(W: GPTWeights, prompt: Any, max_new_tokens: int, use_cache: bool = True, temperature: float = 0.0,
             rng: np.random.Generator | None = None, keep: int | None = None,
             return_logits: bool = False) -> np.ndarray | tuple[np.ndarray, list[np.ndarray]]:
    """max_new_tokens ids after the 1-D prompt (int64 array); temperature 0 is greedy.

    The context window: when the tokens since the window's start would exceed W.block_size, the
    window restarts at the last `keep` tokens (default block_size // 2), positions 0 .. keep - 1.
    use_cache=True runs forward_cached (a prefill at each window start, then one token per step);
    use_cache=False runs gpt_forward on the whole window every step. With return_logits, also the
    logits (vocab,) each step sampled from. max_new_tokens >= 0, temperature >= 0."""
    check_sampling("generate", max_new_tokens, temperature)
    prompt = _token_ids(W, prompt, "generate", "prompt")
    keep = W.block_size // 2 if keep is None else int(keep)
    if not 1 <= keep <= W.block_size:
        raise ValueError(f"generate: keep must lie in [1, {W.block_size}], got {keep}")
    rng = np.random.default_rng(0) if rng is None else rng
    tokens = [int(t) for t in prompt]
    start, cache, seen = 0, None, []
    for _ in range(max_new_tokens):
        if len(tokens) - start > W.block_size:           # the window is full: restart it
            start, cache = len(tokens) - keep, None
        if not use_cache:
            logits = gpt_forward(W, np.array([tokens[start:]]))[0, -1]
        elif cache is None:                               # prefill the window
            cache = KVCache.for_model(W)
            logits = forward_cached(W, cache, np.array([tokens[start:]]))[0, -1]
        else:                                             # decode: the newest token only
            logits = forward_cached(W, cache, np.array([tokens[-1:]]))[0, -1]
        seen.append(logits)
        tokens.append(sample_token(logits, temperature, rng))
    out = np.array(tokens[len(prompt):], dtype=np.int64)
    return (out, seen) if return_logits else out

# %%
#| export
def decode_latencies(W: GPTWeights, prompt: Any, n_new: int, use_cache: bool = True) -> np.ndarray:
    """Seconds (perf_counter) of each of n_new greedy steps after the 1-D prompt, with the cache
    (step 0 is the prompt's prefill) or without (every step runs gpt_forward on all tokens).
    len(prompt) + n_new must fit W.block_size."""
    import time

    tokens = [int(t) for t in _token_ids(W, prompt, "decode_latencies", "prompt")]
    if len(tokens) + n_new > W.block_size:
        raise ValueError(f"decode_latencies: {len(tokens)} + {n_new} tokens do not fit block_size={W.block_size}")
    cache, out = KVCache.for_model(W), np.empty(n_new)
    for step in range(n_new):
        t0 = time.perf_counter()
        if not use_cache:
            logits = gpt_forward(W, np.array([tokens]))[0, -1]
        else:
            logits = forward_cached(W, cache, np.array([tokens[-1:] if step else tokens]))[0, -1]
        tokens.append(int(np.argmax(logits)))
        out[step] = time.perf_counter() - t0
    return out

# %% tags=["check"]
check("11.1")

# %% [markdown]
# The tiny GPT continuing a line of Python's documentation, with and without the cache
# (greedy, float64, 100 tokens: past the 64-token context, so the window restarts twice):

# %%
prompt_text = "The for statement is used to "
prompt_ids = tok.encode(prompt_text)
with_cache, cached_logits = generate(W64, prompt_ids, 100, use_cache=True, return_logits=True)
without_cache, plain_logits = generate(W64, prompt_ids, 100, use_cache=False, return_logits=True)
print(repr(prompt_text + tok.decode(with_cache)))
print("same tokens:", np.array_equal(with_cache, without_cache),
      f"; largest logit difference over the 100 steps: {max(np.abs(a - b).max() for a, b in zip(cached_logits, plain_logits)):.1e}")

# %% [markdown]
# The work per generated token, counted by `matmul` (`count_macs`), for one sequence growing
# from 1 to 64 tokens:

# %%
def macs_per_step(W: GPTWeights, n_tokens: int, use_cache: bool) -> list[int]:
    """Multiply-adds of each step of generating n_tokens from a 1-token prompt (no window restart)."""
    ids = np.arange(n_tokens) % W.vocab_size
    cache, out = KVCache.for_model(W), []
    for n in range(1, n_tokens + 1):
        with count_macs() as c:
            if use_cache:
                forward_cached(W, cache, ids[None, n - 1:n])
            else:
                gpt_forward(W, ids[None, :n])
        out.append(c.macs)
    return out


cached_macs, plain_macs = macs_per_step(W64, 64, True), macs_per_step(W64, 64, False)
print(f"{'position':>8} {'with cache':>11} {'without':>11} {'ratio':>6}")
for n in (1, 8, 16, 32, 64):
    print(f"{n - 1:>8} {cached_macs[n - 1]:>11,} {plain_macs[n - 1]:>11,} {plain_macs[n - 1] / cached_macs[n - 1]:6.1f}")
print(f"64 tokens in all: {sum(cached_macs):,} multiply-adds with the cache, {sum(plain_macs):,} without "
      f"({sum(plain_macs) / sum(cached_macs):.1f}x)")

# %% [markdown]
# With the cache the count grows by a constant per position (the attention over one more key:
# 2 x heads x head_dim x layers = 2 x 4 x 16 x 2 = 256 multiply-adds); without it, each step repeats the whole
# prefix.
#
# Time follows work once the products dominate. The trained model's context is 64 positions, too
# short to show it, so the timing below uses a model of the same shape with a longer context and
# random weights (speed does not depend on the weights), float32: the time of each greedy step
# against its position, with and without the cache.

# %% tags=["demo"]
import matplotlib.pyplot as plt

n_steps = 128 if SMALL else 512
W_long = random_gpt_weights(block_size=16 + n_steps, dtype=np.float32)
long_prompt = np.arange(16) % W_long.vocab_size
lat = {use: np.minimum(decode_latencies(W_long, long_prompt, n_steps, use),
                       decode_latencies(W_long, long_prompt, n_steps, use)) for use in (True, False)}
print(f"{n_steps} tokens: {n_steps / lat[True].sum():,.0f} tokens/s with the cache, "
      f"{n_steps / lat[False].sum():,.0f} without ({lat[False].sum() / lat[True].sum():.1f}x); "
      f"ms per token with the cache: {1e3 * np.median(lat[True][1:n_steps // 4]):.2f} early, "
      f"{1e3 * np.median(lat[True][-n_steps // 4:]):.2f} late")
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.semilogy(16 + np.arange(1, n_steps), 1e3 * lat[False][1:], lw=1, label="no cache")
ax.semilogy(16 + np.arange(1, n_steps), 1e3 * lat[True][1:], lw=1, label="KV cache")
ax.set_xlabel("position of the new token")
ax.set_ylabel("ms per token")
ax.legend()
ax.grid(True, which="both", alpha=0.2)
fig.tight_layout()
plt.show()

# %% [markdown]
# On the course's 2-core development machine (x86-64, NumPy, float32) this printed 3,963 tokens/s
# with the cache and 121 without over 512 tokens (32.6x), and 0.21 ms per token with the cache
# early in the run against 0.24 ms late: flat, while the uncached step grows with the position.
# The ratio keeps growing with the length (the counted work above grows as T^2 against T):
# `make bench L=kvcache` measured 4.4x, 8.9x, 20.5x and 87x after 128, 256, 512 and 1,024
# tokens in one run (17x to 21x at 512 over runs). A 64-wide model's cached step is mostly
# NumPy's per-call overhead, about 0.2 ms whatever it computes; for a 4x wider model (d = 256),
# whose cached step is arithmetic, the same bench gave 29x at 512 tokens.

# %% [markdown]
# ## 3. What the cache costs, and why decode is memory-bound
#
# The cache holds, for every layer and every token, one key and one value vector per KV head:
#
# $$\text{KV bytes} = 2 \times \text{layers} \times \text{kv\_heads} \times \text{head\_dim}
#   \times \text{tokens} \times \text{bytes per element} \;(\times\ \text{batch}).$$
#
# For Llama-2-7B (Touvron et al. 2023: 32 layers, 32 heads of 128, no GQA) in bf16 that is
# 2 x 32 x 32 x 128 x 2 = 524,288 bytes, **0.5 MiB per token**, 2 GiB for one 4,096-token
# sequence: about 6 such sequences take as much memory as the 13.5 GB of weights, and 32 of them
# (69 GB) five times as much.
#
# **Arithmetic intensity of a decode step.** A batch of B sequences, each producing one token
# with `context` tokens cached, does for each sequence 2 FLOPs per weight (a multiply-add; N
# weights are multiplied, embeddings excluded, the output layer included) and, per layer and
# query head, 2 x head_dim FLOPs for each cached key (q . k) and as many for each value
# (p v): `2 B N + 4 B L H hd context`. It reads every weight once (shared by the batch) and
# each sequence's own cache once: `N bytes_w + B KV(context)`. At B = 1 in bf16 that is about
# 1 FLOP per byte; an H100's ridge is about 295 FLOP/byte ([roofline](../hardware_notes/roofline.md)).
# Batching raises the weights' intensity (B FLOPs per weight read) but not the cache's: each
# sequence's keys serve that sequence only (Pope et al. 2022, section 3;
# [inference](../hardware_notes/inference.md)).

# %% [markdown]
# ### Exercise 11.2: the cache's size and a decode step's cost
#
# Write `kv_cache_bytes` (the formula above) and `decode_step_cost` (FLOPs and bytes of one decode
# step, as defined above). The tests compare the first with the `nbytes` of real cache arrays, and
# the FLOPs with the multiply-adds `matmul` counts in a small GPT.

# %%
#| export
#| exercise 11.2
def kv_cache_bytes(n_layer: int, n_kv_head: int, head_dim: int, tokens: int, bytes_per_element: int,
                   batch: int = 1) -> int:
    """Bytes of the keys and values of `tokens` tokens of `batch` sequences: 2 (K and V) x n_layer x
    n_kv_head x head_dim x tokens x bytes_per_element x batch. An int. Every count is an integer >= 0
    (bytes_per_element >= 1), checked here."""
    for name, value in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim), ("tokens", tokens),
                        ("batch", batch)):
        check_size("kv_cache_bytes", name, value, 0)
    check_size("kv_cache_bytes", "bytes_per_element", bytes_per_element, 1)
    ### BEGIN SOLUTION
    return int(2 * n_layer * n_kv_head * head_dim * tokens * bytes_per_element * batch)
    ### END SOLUTION


def decode_step_cost(n_params: int, n_layer: int, n_head: int, n_kv_head: int, head_dim: int, context: int,
                     batch: int = 1, bytes_per_param: float = 2, bytes_per_element: float = 2) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step: `batch` sequences each produce one token, each attending
    to `context` cached keys (its new token's included).

    FLOPs: 2 x n_params per sequence (n_params: the weights a token is multiplied by) plus
    attention, 4 x n_layer x n_head x head_dim x context per sequence (q.k and p.v).
    Bytes: every weight read once (n_params x bytes_per_param) plus each sequence's cache read
    once (kv_cache_bytes for `context` tokens, bytes_per_element each)."""
    ### BEGIN SOLUTION
    flops = batch * (2.0 * n_params + 4.0 * n_layer * n_head * head_dim * context)
    nbytes = n_params * bytes_per_param + kv_cache_bytes(n_layer, n_kv_head, head_dim, context, 1, batch) * bytes_per_element
    return float(flops), float(nbytes)
    ### END SOLUTION

# %% tags=["check"]
check("11.2")

# %% [markdown]
# The tiny GPT's cache is small (64 positions, float32: 64 KiB), a real model's is not.
# Configurations from the models' papers and released configuration files (Llama 2: Touvron et
# al. 2023; Mistral 7B: Jiang et al. 2023; GPT-3: Brown et al. 2020), bf16:

# %%
MODELS = {  # layers, query heads, kv heads, head_dim, parameters multiplied per token
    "tiny GPT (fp32)": (2, 4, 4, 16, 2 * 12 * 64 * 64 + 64 * 103),
    "Llama-2-7B": (32, 32, 32, 128, 6_738_415_616 - 32000 * 4096),
    "Llama-2-70B (GQA 8)": (80, 64, 8, 128, 68_976_648_192 - 32000 * 8192),
    "Mistral-7B (GQA 8)": (32, 32, 8, 128, 7_241_732_096 - 32000 * 4096),
    "GPT-3 175B": (96, 96, 96, 128, 12 * 96 * 12288 ** 2 + 50257 * 12288),
}
print(f"{'model':<22} {'KV per token':>13} {'at 4,096 tokens':>16}")
for name, (layers, heads, kv, hd, _) in MODELS.items():
    per_token = kv_cache_bytes(layers, kv, hd, 1, 4 if "fp32" in name else 2)
    print(f"{name:<22} {per_token / 2**10:>9,.0f} KiB {per_token * 4096 / 2**30:>12.2f} GiB")

# %% [markdown]
# Intensity of a Llama-2-7B decode step (bf16 weights and cache, 4,096-token contexts) as the
# batch grows, placed on lesson 04's roofline of an H100 SXM (989 TFLOP/s bf16 dense, 3.35 TB/s):

# %%
from minitorch.bench import attainable_flops

layers, heads, kv, hd, n7 = MODELS["Llama-2-7B"]
print(f"{'batch':>6} {'FLOP/byte':>10} {'weights only':>13} {'attainable TFLOP/s':>19} {'tokens/s':>9} {'memory GB':>10}")
points = []
for batch in (1, 8, 32, 128, 512):
    flops, nbytes = decode_step_cost(n7, layers, heads, kv, hd, 4096, batch)
    weights_only = decode_step_cost(n7, layers, heads, kv, hd, 0, batch)
    intensity = flops / nbytes
    attain = attainable_flops(intensity, 989e12, 3.35e12)
    points.append((batch, intensity))
    memory = (weights_only[1] + kv_cache_bytes(layers, kv, hd, 4096, 2, batch)) / 1e9   # weights + caches
    print(f"{batch:>6} {intensity:>10.1f} {weights_only[0] / weights_only[1]:>13.1f} {attain / 1e12:>19.1f} "
          f"{batch * attain / flops:>9,.0f} {memory:>10,.0f}" + ("  (more than an 80 GB H100)" if memory > 80 else ""))

# %% tags=["demo"]
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.8))
grid = np.logspace(-1, 3.5, 200)
ax.loglog(grid, attainable_flops(grid, 989e12, 3.35e12) / 1e12, "k-", lw=1, label="H100 SXM bf16 roof")
for batch, intensity in points:
    ax.plot(intensity, attainable_flops(intensity, 989e12, 3.35e12) / 1e12, "o", label=f"decode, batch {batch}")
ax.axvline(989e12 / 3.35e12, color="grey", ls=":", lw=1)
ax.set_xlabel("arithmetic intensity (FLOP/byte)")
ax.set_ylabel("attainable TFLOP/s")
ax.set_title("Llama-2-7B decode, 4,096-token contexts")
ax.legend(fontsize=7)
ax.grid(True, which="both", alpha=0.2)
fig.tight_layout()
plt.show()

# %% [markdown]
# Weights alone would reach the ridge at a batch of about 295; with 4,096-token contexts the
# cache, read once per sequence at 1 FLOP per byte, holds the step at a few FLOP per byte
# however large the batch. Two remedies follow: read fewer cache bytes per query (fewer KV heads,
# next section; a cache in int8 or fp8, lesson 10) and fit more sequences in memory without
# waste (the paged cache, section 5) so that the weights' cost is shared.

# %% [markdown]
# ## 4. Fewer KV heads: multi-query and grouped-query attention
#
# Multi-head attention gives each of the H query heads its own key and value head. Shazeer
# (2019) kept the H query heads but one shared key/value head (**multi-query attention**, MQA):
# the cache shrinks H-fold and decode reads H times fewer bytes per token. Quality dropped a
# little. Ainslie et al. (2023) interpolate: **grouped-query attention** (GQA) with G key/value
# heads, each shared by a group of H / G consecutive query heads; G = H is MHA, G = 1 is MQA.
# They convert a trained multi-head checkpoint by **mean-pooling** the key and value projection
# weights of each group's heads into one, then train it further for about 5% of the original
# steps ("uptraining"); GQA with 8 groups came close to MHA quality at close to MQA speed.
# Llama-2-70B and Mistral 7B use 8 KV heads.
#
# The computation: query head h uses KV head h // (H / G). Repeating the K/V heads to H (as the
# given `attend` does) is correct but copies them; grouped attention reshapes the queries to
# (B, G, H/G, Tq, hd) instead, so each KV head is read once for its whole group: the saving
# in bytes that GQA exists for.

# %% [markdown]
# ### Exercise 11.3: grouped-query attention and converting a model to it
#
# Write `grouped_attention(q, k, v, mask)` without repeating or copying k and v per query head
# (a test measures the peak memory), and `pool_kv_heads(W, n_kv_head)`, which mean-pools the key
# and value projections (weights and biases) of each group of consecutive heads. With as many
# KV heads as query heads, `grouped_attention` must equal ordinary multi-head attention.

# %%
#| export
#| exercise 11.3
def grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Grouped-query attention: q (B, Hq, Tq, hd), k and v (B, Hkv, Tk, hd) with Hq a multiple of
    Hkv; query head h attends with key/value head h // (Hq // Hkv). mask: boolean, broadcastable
    to (B, Hq, Tq, Tk), True where a query may see a key. Returns (B, Hq, Tq, hd) in q's dtype.

    Reads each key/value head once for its whole group: no copy of k or v per query head. Do the
    two products through matmul(). The inputs and mask are checked (and Tk = 0, where every output
    is 0, answered) before your code runs."""
    mask = _check_attention_inputs("grouped_attention", q, k, v, mask)
    if k.shape[2] == 0:
        return np.zeros(q.shape, q.dtype)  # no keys at all: every query sees nothing
    ### BEGIN SOLUTION
    b, hq, tq, hd = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, tq, hd)                    # query head h = kv * g + j
    s = matmul(qg, np.swapaxes(k, -1, -2)[:, :, None]) * (1.0 / math.sqrt(hd))   # (b, hkv, g, tq, tk)
    if mask is not None:
        s = np.where(np.broadcast_to(mask, (b, hq, tq, tk)).reshape(b, hkv, g, tq, tk), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    o = matmul(e / np.where(total > 0, total, 1.0), v[:, :, None])              # (b, hkv, g, tq, hd)
    return o.reshape(b, hq, tq, hd)
    ### END SOLUTION


def pool_kv_heads(W: GPTWeights, n_kv_head: int) -> GPTWeights:
    """A copy of W with n_kv_head key/value heads: the key and value projections (weight columns
    and bias entries of each head) of every group of W.n_kv_head // n_kv_head consecutive heads
    averaged into one (Ainslie et al. 2023). Query and everything else unchanged; blocks.i.attn.k
    and .v weights become (n_embd, n_kv_head * head_dim). ValueError unless n_kv_head divides
    W.n_kv_head."""
    ### BEGIN SOLUTION
    if n_kv_head < 1 or W.n_kv_head % n_kv_head:
        raise ValueError(f"pool_kv_heads: n_kv_head={n_kv_head} must divide the model's {W.n_kv_head} KV heads")
    g, hd = W.n_kv_head // n_kv_head, W.head_dim
    params = dict(W.params)
    for i in range(W.n_layer):
        for name in ("k", "v"):
            w, b = params[f"blocks.{i}.attn.{name}.weight"], params[f"blocks.{i}.attn.{name}.bias"]
            params[f"blocks.{i}.attn.{name}.weight"] = w.reshape(w.shape[0], n_kv_head, g, hd).mean(axis=2).reshape(w.shape[0], -1)
            params[f"blocks.{i}.attn.{name}.bias"] = b.reshape(n_kv_head, g, hd).mean(axis=1).reshape(-1)
    return replace(W, params=params, n_kv_head=n_kv_head)
    ### END SOLUTION

# %% tags=["check"]
check("11.3")

# %% [markdown]
# What the conversion costs the tiny GPT, without uptraining: validation loss on the fixed
# validation windows of lesson 09 (`EVAL_WINDOWS` windows of 64 characters), float64.

# %% tags=["demo"]
vx, vy = eval_windows(val_ids, W64.block_size, EVAL_WINDOWS if SMALL else None)
print(f"validation: {vx.shape[0]} windows of {vx.shape[1]} characters")
print(f"{'KV heads':>8} {'kind':>5} {'KV bytes per token':>19} {'val loss':>9} {'cost':>7}")
gqa_losses = {}
for n_kv in (4, 2, 1):
    Wg = pool_kv_heads(W64, n_kv)
    gqa_losses[n_kv] = lm_loss(Wg, vx, vy, grouped_attention)
    kind = {4: "MHA", 2: "GQA", 1: "MQA"}[n_kv]
    print(f"{n_kv:>8} {kind:>5} {kv_cache_bytes(W64.n_layer, n_kv, W64.head_dim, 1, 4):>19} "
          f"{gqa_losses[n_kv]:>9.4f} {gqa_losses[n_kv] - gqa_losses[4]:>+7.3f}")

# %% [markdown]
# Mean-pooling without further training costs this small model a lot: its heads of 16
# dimensions disagree more than a large model's heads of 128 do, and averaging two of them gives a
# key that matches neither. Ainslie et al. uptrain after pooling. The same here, briefly: the
# pooled model as a lesson 09 `GPT` whose attention repeats its KV heads (an index on the head
# axis, which lesson 02's autograd differentiates by a scatter-add), trained with lesson 09's
# `train_gpt` for 5% of the original 2,000 steps. The cell uptrains twice (2 and 1 KV heads),
# 100 steps each with a progress bar, and evaluates each on all validation windows: about 40 s
# on an idle 2-core laptop. It prints each run's CPU-seconds and the time the cell took.

# %% tags=["demo"]
from minitorch.attention import merge_heads, split_heads
from minitorch.gpt import GPT as MiniGPT, CausalSelfAttention, GPTConfig, train_gpt
from minitorch.nn import Linear


class GroupedSelfAttention(CausalSelfAttention):
    """Lesson 09's attention with n_kv_head key/value heads, repeated to the query heads."""

    def __init__(self, config: GPTConfig, n_kv_head: int, rng: np.random.Generator):
        super().__init__(config, rng)
        self.n_kv_head = n_kv_head
        self.k = Linear(config.n_embd, n_kv_head * config.head_dim, rng=rng, init=0.02)
        self.v = Linear(config.n_embd, n_kv_head * config.head_dim, rng=rng, init=0.02)

    def forward(self, x):
        heads = np.arange(self.n_head) // (self.n_head // self.n_kv_head)
        q = split_heads(self.q(x), self.n_head)
        k, v = (split_heads(lin(x), self.n_kv_head)[:, heads] for lin in (self.k, self.v))
        return self.proj(merge_heads(self.attend(q, k, v)))


def grouped_gpt(Wg: GPTWeights) -> MiniGPT:
    """A trainable lesson 09 GPT holding the (pooled) weights Wg."""
    config = GPTConfig(Wg.vocab_size, Wg.block_size, Wg.n_layer, Wg.n_head, Wg.n_embd, Wg.ln_eps)
    model = MiniGPT(config)
    for block in model.blocks:
        block.attn = GroupedSelfAttention(config, Wg.n_kv_head, np.random.default_rng(0))
    model.load_state_dict({k: v.astype(np.float32) for k, v in Wg.params.items()})
    return model


uptrain_steps = 4 if SMALL else 100
t_cell = time.perf_counter()
for n_kv in (2, 1):
    model_g = grouped_gpt(pool_kv_heads(W64, n_kv))
    hist = train_gpt(model_g, train_ids, uptrain_steps, batch_size=32, lr=1e-3, warmup=min(10, uptrain_steps),
                     desc=f"uptraining, {n_kv} KV head{'s' * (n_kv > 1)}")
    Wu = replace(gpt_weights(model_g), n_kv_head=n_kv)
    loss_u = lm_loss(Wu, vx, vy, grouped_attention)
    print(f"{n_kv} KV heads: pooled {gqa_losses[n_kv]:.4f}, after {uptrain_steps} steps of uptraining "
          f"{loss_u:.4f} (MHA {gqa_losses[4]:.4f}); {hist['cpu_seconds']:.0f} CPU-s of training")
print(f"this cell took {time.perf_counter() - t_cell:.0f} s")

# %% [markdown]
# Measured: pooling to 2 KV heads raised the validation loss from 1.299 to 3.057 nats per
# character (+1.76), and 100 steps of uptraining (36 CPU-seconds) brought it down to 1.470
# (+0.17); to one KV head (MQA), 4.056 (+2.76) and then 1.782 (+0.48). Two KV heads halve the cache and come close after a short
# retraining; one KV head, on a model whose every head has only 16 dimensions, loses more.
# Ainslie et al. report the same ordering on T5-XXL: uptrained GQA-8 close to multi-head quality,
# uptrained MQA somewhat below it, both much faster to decode.

# %% [markdown]
# ## 5. A paged KV cache
#
# A dense cache reserves `max_len` positions for every sequence, because it cannot know how
# long each will grow; most of that memory holds nothing. Kwon et al. (2023) measured that
# existing serving systems used only 20.4% to 38.2% of their KV cache memory for actual token
# states, the rest lost to reservations and fragmentation. Their system, vLLM, manages the cache
# the way an operating system manages virtual memory (**PagedAttention**):
#
# - The cache is a pool of fixed-size **blocks** of `block_size` tokens (every layer's keys and
#   values for those tokens), shared by all sequences.
# - Each sequence has a **block table**: its logical block j (tokens j x block_size ... ) lives in
#   physical block table[j], anywhere in the pool. A sequence takes a new block only when its
#   last one is full, so at most block_size - 1 slots per sequence are unused.
# - An **allocator** keeps a free list and a **reference count** per block. Sequences that
#   share a prefix (several samples from one prompt, beam search, a common system prompt) share
#   its blocks: `fork` copies the block table and increments the counts. Blocks that are full
#   are never written again, so sharing them is safe; the shared **last, partly filled** block is
#   copied on the first write into it (**copy-on-write**), by whichever sequence writes first.
# - A finished sequence's blocks return to the free list when their count reaches zero.
#
# Attention then reads keys and values through the block table instead of from one contiguous
# array: vLLM's kernel walks a sequence's blocks one by one. Here the pool is a NumPy array
# `(n_layer, num_blocks, n_kv_head, block_size, head_dim)` for keys and another for values.

# %% [markdown]
# ### Exercise 11.4: the block allocator
#
# A free list and reference counts. `allocate()` takes a free block (count 1) and raises
# `OutOfBlocks` when there is none; `share(b)` adds a reference to a block in use; `release(b)`
# drops one and returns the block to the free list at zero (True if it was freed). Sharing or
# releasing a block that is free is a bug in the caller: raise a ValueError naming the block.
# So are a block id outside 0 .. num_blocks - 1 and a pool of fewer than one block.
# The tests run random sequences of these operations (hypothesis stateful testing) against a
# model of what the counts must be.

# %%
#| export
#| exercise 11.4
class OutOfBlocks(RuntimeError):
    """The KV cache has not enough free blocks for a request."""


class UnknownSequence(KeyError, ValueError):
    """A sequence id the paged cache does not hold (a KeyError, as a dict's missing key is, and a
    ValueError, as every refused argument of minitorch is)."""


class BlockAllocator:
    """Blocks 0 .. num_blocks - 1 of a KV cache pool: a free list and a reference count per block.

    allocate() -> a free block, its count set to 1 (OutOfBlocks if none is free);
    share(block): one more reference to a block in use; release(block) -> True if that was the
    last reference and the block is free again. refcount(block); num_free + num_used == num_blocks."""

    def __init__(self, num_blocks: int):
        ### BEGIN SOLUTION
        if int(num_blocks) < 1:
            raise ValueError(f"BlockAllocator: num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self._refs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))   # a stack: the last freed is reused first
        ### END SOLUTION

    @property
    def num_free(self) -> int:
        ### BEGIN SOLUTION
        return len(self._free)
        ### END SOLUTION

    @property
    def num_used(self) -> int:
        ### BEGIN SOLUTION
        return self.num_blocks - len(self._free)
        ### END SOLUTION

    def refcount(self, block: int) -> int:
        """References to `block` (0 if it is free)."""
        ### BEGIN SOLUTION
        self._check(block)
        return self._refs[block]
        ### END SOLUTION

    def allocate(self) -> int:
        ### BEGIN SOLUTION
        if not self._free:
            raise OutOfBlocks(f"no free KV cache block: all {self.num_blocks} are in use")
        block = self._free.pop()
        self._refs[block] = 1
        return block
        ### END SOLUTION

    def share(self, block: int) -> None:
        ### BEGIN SOLUTION
        self._check(block, in_use=True)
        self._refs[block] += 1
        ### END SOLUTION

    def release(self, block: int) -> bool:
        ### BEGIN SOLUTION
        self._check(block, in_use=True)
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
            return True
        return False
        ### END SOLUTION

    def _check(self, block: int, in_use: bool = False) -> None:
        ### BEGIN SOLUTION
        if not isinstance(block, (int, np.integer)) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block!r} is not a block id in [0, {self.num_blocks})")
        if in_use and self._refs[block] == 0:
            raise ValueError(f"block {block} is free: it cannot be shared or released")
        ### END SOLUTION

# %% tags=["check"]
check("11.4")

# %% [markdown]
# ### Exercise 11.5: attention through a block table
#
# `paged_attention(q, k_pool, v_pool, block_table, lengths)`: for each sequence s, its queries
# (the last t tokens) attend causally over its keys 0 .. lengths[s] - 1, which sit in the blocks
# `block_table[s]` names. Read only those blocks, and in the last one only the filled slots:
# the rest of the pool holds other sequences' keys and unwritten garbage (the tests put NaN
# there; a NaN that reaches a product, even multiplied by a zero weight, turns the result into
# NaN, so masking the scores is not enough). Gathering the blocks into a contiguous array and
# calling `attend` is fine (for all sequences at once, padded to the longest, is faster); so is
# walking the blocks with lesson 09's online softmax, as vLLM's kernel does.

# %%
#| export
#| exercise 11.5
def paged_attention(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, block_table: np.ndarray,
                    lengths: Any) -> np.ndarray:
    """Causal attention of b sequences whose keys and values live in a block pool.

    q (b, Hq, t, hd): the queries of the last t tokens of each sequence.
    k_pool, v_pool (num_blocks, Hkv, block_size, hd), Hq a multiple of Hkv.
    block_table (b, max_blocks) int: token j of sequence s is in block block_table[s, j //
    block_size], slot j % block_size; entries past a sequence's blocks are -1.
    lengths (b,): tokens of each sequence (>= t): its keys are 0 .. lengths[s] - 1.
    Returns (b, Hq, t, hd) in q's dtype. Nothing in the pool outside each sequence's first
    lengths[s] slots (other sequences' keys, garbage, NaN) may affect the result. ValueError if the
    table does not cover a sequence's length (the shapes and block ids are checked before your code)."""
    if np.ndim(q) != 4 or np.ndim(k_pool) != 4 or np.shape(k_pool) != np.shape(v_pool):
        raise ValueError(f"paged_attention: expected q (b, Hq, t, hd) and k_pool, v_pool (num_blocks, Hkv, "
                         f"block_size, hd), got q {np.shape(q)}, k_pool {np.shape(k_pool)}, v_pool {np.shape(v_pool)}")
    ids = np.asarray(block_table)
    outside = (ids < -1) | (ids >= len(k_pool))
    if outside.any():
        raise ValueError(f"paged_attention: block_table holds block id(s) {np.unique(ids[outside]).tolist()} outside "
                         f"the pool of {len(k_pool)} blocks (valid ids 0 .. {len(k_pool) - 1}, -1 = unused)")
    ### BEGIN SOLUTION
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    block_table = np.asarray(block_table)
    b, hq, t, hd = q.shape
    num_blocks, hkv, bs, _ = k_pool.shape
    if len(lengths) != b or block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"paged_attention: q has {b} sequences, block_table {block_table.shape}, lengths {lengths.shape}")
    n_blocks = -(-lengths // bs)                                  # blocks each sequence uses
    nb = int(n_blocks.max())
    table = block_table[:, :nb]
    used = np.arange(nb)[None, :] < n_blocks[:, None]
    if (lengths < t).any() or nb > block_table.shape[1] or ((table < 0) | (table >= num_blocks))[used].any():
        raise ValueError(f"paged_attention: lengths {lengths.tolist()} ({t} queries each) are not covered by the "
                         f"block table {block_table.tolist()} (a pool of {num_blocks} blocks of {bs})")
    # gather each sequence's blocks, in order: (b, nb, hkv, bs, hd) -> (b, hkv, nb * bs, hd)
    k = k_pool[np.where(used, table, 0)].transpose(0, 2, 1, 3, 4).reshape(b, hkv, nb * bs, hd)
    v = v_pool[np.where(used, table, 0)].transpose(0, 2, 1, 3, 4).reshape(b, hkv, nb * bs, hd)
    filled = np.arange(nb * bs)[None, :] < lengths[:, None]     # (b, keys): slots holding this sequence's tokens
    k = np.where(filled[:, None, :, None], k, 0.0)               # garbage (even NaN) never reaches a product
    v = np.where(filled[:, None, :, None], v, 0.0)
    qpos = lengths[:, None] - t + np.arange(t)                   # (b, t) positions of the queries
    mask = np.arange(nb * bs)[None, None, :] <= qpos[:, :, None]  # (b, t, keys), within `filled`
    return attend(q, k, v, mask[:, None])
    ### END SOLUTION

# %% tags=["check"]
check("11.5")

# %% [markdown]
# ### Exercise 11.6: the paged cache
#
# The pool, the block tables and the lengths are given, with `add` (a new, empty sequence),
# `write` (store keys and values at flat slots `block * block_size + offset`) and
# `block_table`. Write the bookkeeping:
#
# - `blocks_needed(seq, n)`: how many free blocks appending n tokens takes: new blocks, plus one
#   if the last block is partly filled and shared (the copy).
# - `append(seq, n)`: reserve n more slots (copying a shared partial last block first, then
#   taking new blocks as needed), advance the length and return the n flat slots. If the free
#   list cannot serve it, raise `OutOfBlocks` naming the sequence and leave everything as it was.
# - `fork(parent, child)`: the child shares all of the parent's blocks and its length (ValueError
#   if `child` already exists).
# - `free(seq)`: release every block of the sequence and forget it.
# - `gather(seq, layer)`: the sequence's keys and values of one layer, read through its block
#   table: two (n_kv_head, length, head_dim) arrays.
#
# The tests drive the cache with random add / append / write / fork / free sequences against a
# contiguous reference, and check after every operation that each sequence reads back exactly
# what was written to it, that free + used = total, that every block's count is the number of
# tables holding it, and that nothing leaks.

# %%
#| export
#| exercise 11.6
class PagedKVCache:
    """A paged KV cache (Kwon et al. 2023): a pool of blocks of block_size tokens shared by all
    sequences, a block table and a length per sequence, and a BlockAllocator.

    k, v: (n_layer, num_blocks, n_kv_head, block_size, head_dim) arrays of dtype.
    tables[seq]: the sequence's physical blocks in order; lengths[seq]: its tokens.
    A slot is block * block_size + offset."""

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: Any = np.float64):
        for name, value in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim),
                            ("block_size", block_size), ("num_blocks", num_blocks)):
            check_int("PagedKVCache", name, value, 1)
        self.block_size = int(block_size)
        shape = (n_layer, int(num_blocks), n_kv_head, self.block_size, head_dim)
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)
        self.allocator = BlockAllocator(int(num_blocks))
        self.tables: dict[Any, list[int]] = {}
        self.lengths: dict[Any, int] = {}

    @classmethod
    def for_model(cls, W: GPTWeights, block_size: int, num_blocks: int) -> "PagedKVCache":
        return cls(W.n_layer, W.n_kv_head, W.head_dim, block_size, num_blocks, W.dtype)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def _table(self, seq: Any, name: str = "seq") -> list[int]:
        if seq not in self.tables:
            raise UnknownSequence(f"PagedKVCache: {name} {seq!r} is no sequence of the paged cache (it holds "
                                  f"{sorted(self.tables, key=str)})")
        return self.tables[seq]

    def add(self, seq: Any) -> None:
        """Start an empty sequence `seq` (any hashable id)."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} is already in the paged cache")
        self.tables[seq], self.lengths[seq] = [], 0

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v (n_kv_head, n, head_dim) of one layer at the n flat slots."""
        n_layer, n_blocks, hkv, bs, hd = self.k.shape
        check_int("PagedKVCache.write", "layer", layer, 0, n_layer - 1)
        if slots.size and (slots.min() < 0 or slots.max() >= n_blocks * bs):
            raise ValueError(f"PagedKVCache.write: slots must lie in [0, {n_blocks * bs}), got values "
                             f"{slots.min()}..{slots.max()}")
        for name, a in (("k", k), ("v", v)):
            if np.shape(a) != (hkv, len(slots), hd):
                raise ValueError(f"PagedKVCache.write: {name} must be (n_kv_head, n, head_dim) = "
                                 f"{(hkv, len(slots), hd)} for {len(slots)} slots, got {describe(a)}")
        blocks, offsets = np.divmod(np.asarray(slots, dtype=np.int64), self.block_size)
        self.k[layer, blocks, :, offsets] = np.swapaxes(k, 0, 1)
        self.v[layer, blocks, :, offsets] = np.swapaxes(v, 0, 1)

    def block_table(self, seqs: Sequence[Any]) -> np.ndarray:
        """(len(seqs), max blocks) int64: each sequence's blocks, padded with -1."""
        tables = [self._table(s) for s in seqs]
        out = np.full((len(tables), max([len(t) for t in tables] + [1])), -1, np.int64)
        for i, t in enumerate(tables):
            out[i, :len(t)] = t
        return out

    def blocks_needed(self, seq: Any, n: int) -> int:
        """Free blocks that append(seq, n) would take (new blocks plus a copy-on-write copy)."""
        ### BEGIN SOLUTION
        table, length = self._table(seq), self.lengths[seq]
        if n <= 0:
            return 0
        new = max(0, -(-(length + n) // self.block_size) - len(table))
        copy = length % self.block_size != 0 and self.allocator.refcount(table[-1]) > 1
        return new + int(copy)
        ### END SOLUTION

    def append(self, seq: Any, n: int) -> np.ndarray:
        """Reserve n more token slots for seq; returns their flat slots (n,) int64, in order.
        OutOfBlocks (nothing changed) if the free list cannot serve it."""
        ### BEGIN SOLUTION
        table, length = self._table(seq), self.lengths[seq]
        if n < 0:
            raise ValueError(f"append: n must be >= 0, got {n}")
        need = self.blocks_needed(seq, n)
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"sequence {seq!r} needs {need} more blocks for {n} tokens, but only "
                              f"{self.allocator.num_free} of {self.num_blocks} are free")
        bs = self.block_size
        if n > 0 and length % bs and self.allocator.refcount(table[-1]) > 1:   # copy on write
            old, new = table[-1], self.allocator.allocate()
            self.k[:, new], self.v[:, new] = self.k[:, old], self.v[:, old]
            self.allocator.release(old)
            table[-1] = new
        while len(table) * bs < length + n:
            table.append(self.allocator.allocate())
        pos = np.arange(length, length + n)
        self.lengths[seq] = length + n
        return np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
        ### END SOLUTION

    def fork(self, parent: Any, child: Any) -> None:
        """A new sequence `child` sharing all of parent's blocks (and its length)."""
        self._table(parent, "parent")
        ### BEGIN SOLUTION
        table = self._table(parent)
        if child in self.tables:
            raise ValueError(f"fork: sequence {child!r} is already in the paged cache")
        for block in table:
            self.allocator.share(block)
        self.tables[child], self.lengths[child] = list(table), self.lengths[parent]
        ### END SOLUTION

    def free(self, seq: Any) -> None:
        """Release all of seq's blocks and forget it."""
        ### BEGIN SOLUTION
        for block in self._table(seq):
            self.allocator.release(block)
        del self.tables[seq], self.lengths[seq]
        ### END SOLUTION

    def gather(self, seq: Any, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """seq's keys and values in layer `layer`, read through its block table: two arrays
        (n_kv_head, length, head_dim)."""
        if check_size("PagedKVCache.gather", "layer", layer, 0) >= len(self.k):
            raise ValueError(f"PagedKVCache.gather: layer must be < {len(self.k)} (the cache's layers), got {layer}")
        ### BEGIN SOLUTION
        table, n = self._table(seq), self.lengths[seq]
        _, _, hkv, bs, hd = self.k.shape
        k = self.k[layer, table].transpose(1, 0, 2, 3).reshape(hkv, len(table) * bs, hd)[:, :n]
        v = self.v[layer, table].transpose(1, 0, 2, 3).reshape(hkv, len(table) * bs, hd)[:, :n]
        return k, v
        ### END SOLUTION

# %% tags=["check"]
check("11.6")

# %% [markdown]
# What paging saves. A dense cache sized for the 64-token context against the paged cache (blocks
# of 8 tokens), for 32 sequences of lengths drawn between 5 and 64 tokens; then 4 samples from
# one 40-token prompt, each continued by 20 tokens, with and without sharing the prompt's blocks.

# %%
len_rng = np.random.default_rng(3)
seq_lengths = len_rng.integers(5, 65, size=32)
paged = PagedKVCache.for_model(W64, block_size=8, num_blocks=32 * 8)
for s, n in enumerate(seq_lengths):
    paged.add(s)
    paged.append(s, int(n))
print(f"32 sequences, {seq_lengths.sum()} tokens: dense cache reserves {32 * 64} slots "
      f"({seq_lengths.sum() / (32 * 64):.0%} used); paged uses {paged.allocator.num_used} blocks = "
      f"{paged.allocator.num_used * 8} slots ({seq_lengths.sum() / (paged.allocator.num_used * 8):.0%} used)")

shared = PagedKVCache.for_model(W64, block_size=8, num_blocks=64)
shared.add("prompt")
shared.append("prompt", 40)
for i in range(4):
    shared.fork("prompt", i)
shared.free("prompt")
for i in range(4):
    shared.append(i, 20)
print(f"4 samples of 40 + 20 tokens: {shared.allocator.num_used} blocks shared, "
      f"{4 * -(-60 // 8)} without sharing")

# %% [markdown]
# Live: the block size against the slots the same 32 sequences waste. A sequence wastes at most
# `block_size - 1` slots in its last block; small blocks waste least but mean longer block
# tables and more, smaller reads (vLLM's default is 16 tokens).

# %% tags=["demo"]
from course.live import live


def draw_block_waste(block_size: int, max_len: int):
    lengths = np.minimum(seq_lengths, max_len)
    blocks = -(-lengths // block_size)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    x = np.arange(len(lengths))
    ax.bar(x, max_len, color="0.9", label=f"dense: {max_len} reserved")
    ax.bar(x, blocks * block_size, color="C1", label="paged: allocated")
    ax.bar(x, lengths, color="C0", label="tokens")
    paged_use, dense_use = lengths.sum() / (blocks.sum() * block_size), lengths.sum() / (len(lengths) * max_len)
    ax.set(xlabel="sequence", ylabel="KV slots", ylim=(0, 130),
           title=f"block size {block_size}: paged {paged_use:.0%} used, dense {dense_use:.0%} used")
    ax.legend(fontsize=8, loc="upper right", ncols=3)
    return fig


live(draw_block_waste, block_size=(1, 64), max_len=(64, 128))

# %% [markdown]
# ## 6. Continuous batching
#
# A server gets requests at random times, with prompts and outputs of different lengths. Batching
# them amortises the weight reads over many sequences (section 3), but a static batch (start B
# requests together, wait for the longest to finish) leaves slots idle as the short ones end.
# Orca (Yu et al. 2022) schedules at the granularity of one model step ("iteration-level
# scheduling"): after every step finished sequences leave, waiting ones join, and one step can
# hold prefills (many tokens of a new request) and decodes (one token of each running one)
# together. The layers that have weights see all the step's tokens as one matrix; only attention
# is per sequence, through the paged cache. vLLM adds the memory policy: admit a request only if
# its blocks are free, and when a decode step needs a block that is not there, **preempt** a
# running sequence: free its blocks and put it back in the queue; when readmitted it
# **recomputes** its cache with one prefill of its prompt plus what it has generated so far.
#
# Given: `Request`, and `paged_forward(W, cache, seqs, chunks)`, one model step over a ragged
# batch (chunk i: the new tokens of sequence seqs[i], a whole prompt or one token), which returns
# the logits of each chunk's last token.

# %%
#| export
@dataclass
class Request:
    """A generation request: prompt (1-D int64 ids), max_new_tokens, the step at which it
    arrives, and a seed for its sampler. output: the tokens generated so far."""

    id: int
    prompt: np.ndarray
    max_new_tokens: int
    arrival: int = 0
    seed: int = 0
    output: list[int] = field(default_factory=list)
    preemptions: int = 0

    def __post_init__(self) -> None:
        check_int("Request", "id", self.id, 0)
        for name, lo in (("max_new_tokens", 1), ("arrival", 0), ("seed", 0), ("preemptions", 0)):
            setattr(self, name, check_int("Request", name, getattr(self, name), lo))
        prompt = np.asarray(self.prompt) if isinstance(self.prompt, (list, tuple, range, np.ndarray)) else None
        if prompt is None or prompt.dtype.kind not in "iu" or prompt.ndim != 1 or len(prompt) < 1 or prompt.min() < 0:
            raise (TypeError if prompt is None or prompt.dtype.kind not in "iu" else ValueError)(
                f"Request {self.id}: prompt must be a 1-D array of at least one token id (>= 0), got "
                f"{describe(self.prompt)}")
        if not isinstance(self.output, list):
            raise TypeError(f"Request {self.id}: output must be a list of the tokens generated, got "
                            f"{describe(self.output)}")
        self.prompt = prompt.astype(np.int64, copy=False)
        self.rng = np.random.default_rng(self.seed)

    @property
    def tokens(self) -> np.ndarray:
        """Prompt and output so far, one int64 array."""
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int64)])

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


def paged_forward(W: GPTWeights, cache: PagedKVCache, seqs: Sequence[Any], chunks: Sequence[np.ndarray]) -> np.ndarray:
    """One model step over a ragged batch: chunks[i] (t_i,) new tokens of sequence seqs[i],
    appended to the paged cache. forward_cached's layers, with the cache in blocks (paged_attention
    reads keys through each sequence's block table) and sequences of different lengths in one step. All the step's tokens go through the layers with weights as one
    (1, sum t_i, C) matrix; attention is per sequence, through its block table. Returns (len(seqs),
    vocab): the logits of each chunk's last token. OutOfBlocks (nothing changed) if the cache
    cannot hold the new tokens."""
    if len(chunks) != len(seqs) or not seqs:
        raise ValueError(f"paged_forward: seqs and chunks must have one length >= 1, got {len(seqs)} and {len(chunks)}")
    chunks = [_token_ids(W, c, "paged_forward", f"chunks[{i}]") for i, c in enumerate(chunks)]
    need = sum(cache.blocks_needed(s, len(c)) for s, c in zip(seqs, chunks))
    if need > cache.num_free:
        raise OutOfBlocks(f"paged_forward: the step needs {need} blocks, {cache.num_free} are free")
    starts = [cache.lengths[s] for s in seqs]
    slots = np.concatenate([cache.append(s, len(c)) for s, c in zip(seqs, chunks)])
    bounds = np.cumsum([0] + [len(c) for c in chunks])
    pos = np.concatenate([n + np.arange(len(c)) for n, c in zip(starts, chunks)])
    if pos.max() >= W.block_size:
        raise ValueError(f"paged_forward: position {pos.max()} is past the context of {W.block_size}")
    x = embed(W, np.concatenate(chunks)[None], pos[None])            # (1, N, C): every new token
    table = cache.block_table(seqs)
    lengths = np.array([cache.lengths[s] for s in seqs])
    single = [j for j, c in enumerate(chunks) if len(c) == 1]         # decodes: attend in one call
    multi = [j for j, c in enumerate(chunks) if len(c) > 1]           # prefills: one call each
    for i in range(W.n_layer):
        q, k, v = layer_qkv(W, i, x)                                  # (1, H, N, hd)
        cache.write(i, slots, k[0], v[0])
        o = np.empty_like(q)
        if single:
            at = bounds[single]
            q1 = q[0][:, at].transpose(1, 0, 2)[:, :, None]           # (n_decode, H, 1, hd)
            o[0][:, at] = paged_attention(q1, cache.k[i], cache.v[i], table[single], lengths[single])[:, :, 0].transpose(1, 0, 2)
        for j in multi:
            seg = slice(bounds[j], bounds[j + 1])
            o[:, :, seg] = paged_attention(q[:, :, seg], cache.k[i], cache.v[i], table[j:j + 1], lengths[j:j + 1])
        x = layer_finish(W, i, x, o)
    return lm_head(W, x[0, bounds[1:] - 1])

# %% [markdown]
# ### Exercise 11.7: the scheduler
#
# Write `Scheduler.step()`, one iteration of continuous batching over the paged cache
# `self.cache` (ids of sequences in the cache: the request ids):
#
# 1. **Room for the decodes.** Every running request will append one token. While the free
#    blocks cannot cover that (`cache.blocks_needed(id, 1)` summed), preempt the most recently
#    admitted running request: free its blocks, count `preemptions`, and put it back at the
#    **front** of the waiting queue (it keeps its output; it will recompute).
# 2. **Admit.** While the waiting queue is not empty and fewer than `max_running` requests run,
#    take the first waiting request if the blocks for its prefill (all of `request.tokens`) fit in
#    what the decodes leave free; stop at the first that does not fit (first come, first served:
#    nobody overtakes it). `cache.add` it.
# 3. **Run** one `paged_forward` over the admitted requests (chunk: all their tokens) and the
#    running ones (chunk: their last token), and append to each request's output the token
#    `sample_token(logits, self.temperature, request.rng)`.
# 4. **Retire** the requests that reached `max_new_tokens`: free their blocks and move them to
#    `self.finished`. `self.running` keeps the others in admission order (admitted ones last).
#
# Return `{"prefill": [ids], "decode": [ids], "preempted": [ids], "finished": [ids]}`. The tests
# check that every request's output equals generating it alone, under random arrival orders and
# a pool small enough to force preemptions; that steps mix prefills and decodes; and that every
# block is free at the end.

# %%
#| export
#| exercise 11.7
class Scheduler:
    """Continuous batching over a paged KV cache of num_blocks blocks of block_size tokens.

    waiting: a deque of Requests not in the cache (FIFO); running: Requests in the cache, in
    admission order; finished: id -> Request. run(requests) serves a list of requests that arrive
    at their `arrival` steps and returns id -> output tokens; history holds each step's record."""

    def __init__(self, W: GPTWeights, num_blocks: int, block_size: int = 8, max_running: int | None = None,
                 temperature: float = 0.0):
        self.W = W
        self.cache = PagedKVCache.for_model(W, block_size, num_blocks)
        self.max_running = num_blocks if max_running is None else int(max_running)
        self.temperature = temperature
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self.history: list[dict[str, list[int]]] = []
        self.steps = 0

    def add(self, request: Request) -> None:
        """Queue a request. ValueError if it can never fit the context or the pool."""
        longest = len(request.prompt) + request.max_new_tokens - 1   # tokens ever in the cache
        if longest > self.W.block_size or -(-longest // self.cache.block_size) > self.cache.num_blocks:
            raise ValueError(f"Request {request.id}: {len(request.prompt)} + {request.max_new_tokens} tokens do "
                             f"not fit the context ({self.W.block_size}) or the pool ({self.cache.num_blocks} "
                             f"blocks of {self.cache.block_size})")
        self.waiting.append(request)

    def step(self) -> dict[str, list[int]]:
        """One iteration: preempt if the decodes need it, admit, run one model step, retire."""
        ### BEGIN SOLUTION
        cache, record = self.cache, {"prefill": [], "decode": [], "preempted": [], "finished": []}
        while self.running and sum(cache.blocks_needed(r.id, 1) for r in self.running) > cache.num_free:
            victim = self.running.pop()                 # the most recently admitted
            cache.free(victim.id)
            victim.preemptions += 1
            self.waiting.appendleft(victim)
            record["preempted"].append(victim.id)
        decode = list(self.running)
        budget = cache.num_free - sum(cache.blocks_needed(r.id, 1) for r in decode)
        prefill = []
        while self.waiting and len(decode) + len(prefill) < self.max_running:
            need = -(-len(self.waiting[0].tokens) // cache.block_size)
            if need > budget:
                break
            request = self.waiting.popleft()
            cache.add(request.id)
            budget -= need
            prefill.append(request)
        batch = decode + prefill
        if not batch:
            return record
        chunks = [r.tokens[-1:] for r in decode] + [r.tokens for r in prefill]
        logits = paged_forward(self.W, cache, [r.id for r in batch], chunks)
        for request, row in zip(batch, logits):
            request.output.append(sample_token(row, self.temperature, request.rng))
        self.running = []
        for request in batch:
            if request.done:
                cache.free(request.id)
                self.finished[request.id] = request
                record["finished"].append(request.id)
            else:
                self.running.append(request)
        record["decode"] = [r.id for r in decode]
        record["prefill"] = [r.id for r in prefill]
        return record
        ### END SOLUTION

    def run(self, requests: Sequence[Request], max_steps: int = 100_000) -> dict[int, np.ndarray]:
        """Serve `requests` (each enters the queue at its arrival step); id -> output tokens."""
        pending = sorted(requests, key=lambda r: (r.arrival, r.id))
        i = 0
        while i < len(pending) or self.waiting or self.running:
            while i < len(pending) and pending[i].arrival <= self.steps:
                self.add(pending[i])
                i += 1
            if not self.waiting and not self.running:
                self.steps = pending[i].arrival              # idle until the next arrival
                continue
            before = sum(len(r.output) for r in pending)
            self.history.append(self.step())
            self.steps += 1
            if sum(len(r.output) for r in pending) == before and not self.history[-1]["preempted"]:
                raise RuntimeError(f"Scheduler: step {self.steps} produced no token and preempted nobody "
                                   f"({len(self.waiting)} waiting, {len(self.running)} running)")
            if self.steps > max_steps:
                raise RuntimeError(f"Scheduler: more than {max_steps} steps")
        return {r.id: np.array(r.output, dtype=np.int64) for r in pending}

# %% tags=["check"]
check("11.7")

# %% [markdown]
# A run on 16 requests (prompts of 4 to 40 characters of the validation text, 8 to 24 new tokens,
# arriving over the first 20 steps) with a pool of 16 blocks of 8 tokens: 128 slots, less than the
# requests would hold at once.

# %%
def request_set(n: int, seed: int, ids: np.ndarray = val_ids, spread: int = 20, max_total: int = 64) -> list[Request]:
    r = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p_len = int(r.integers(4, 41))
        new = int(r.integers(8, min(25, max_total - p_len + 1)))
        s = int(r.integers(0, len(ids) - p_len))
        out.append(Request(i, ids[s:s + p_len], new, arrival=int(r.integers(0, spread)), seed=i))
    return out


sched = Scheduler(W64, num_blocks=16, block_size=8)
served = sched.run(request_set(16, seed=0))
mixed = sum(1 for h in sched.history if h["prefill"] and h["decode"])
print(f"{sched.steps} steps, {len(sched.history)} model steps; {mixed} of them mix prefills and decodes; "
      f"{sum(len(h['preempted']) for h in sched.history)} preemptions; free blocks at the end: "
      f"{sched.cache.num_free} of {sched.cache.num_blocks}")
print("request 3 alone gives the same tokens:",
      np.array_equal(served[3], generate(W64, sched.finished[3].prompt, sched.finished[3].max_new_tokens)))

# %% [markdown]
# Throughput against serving the same requests one at a time with the dense cache (float32, all
# requests waiting at step 0; a larger pool, 48 blocks):

# %% tags=["demo"]
W32 = W64.astype(np.float32)
reqs = request_set(16 if SMALL else 48, seed=1, spread=1)
n_tokens = sum(r.max_new_tokens for r in reqs)
t0 = time.perf_counter()
for r in reqs:
    generate(W32, r.prompt, r.max_new_tokens)
t_alone = time.perf_counter() - t0
t0 = time.perf_counter()
batched = Scheduler(W32, num_blocks=48, block_size=8)
batched.run([Request(r.id, r.prompt, r.max_new_tokens) for r in reqs])
t_batch = time.perf_counter() - t0
print(f"{len(reqs)} requests, {n_tokens} tokens: one at a time {n_tokens / t_alone:,.0f} tokens/s, "
      f"continuous batching {n_tokens / t_batch:,.0f} tokens/s ({t_alone / t_batch:.1f}x); "
      f"{len(batched.history)} model steps instead of {n_tokens}, "
      f"{sum(len(h['preempted']) for h in batched.history)} preemptions")

# %% [markdown]
# Measured here: 3,920 tokens/s one at a time, 8,600 with continuous batching (2.2x), in 80 model
# steps instead of 754, with 18 preemptions (recomputation included). In NumPy a step's cost is
# mostly the Python overhead of its operations, paid once per step instead of once per sequence;
# on a GPU the same effect comes from reading the weights once per step for the whole batch
# (section 3). `make bench L=kvcache` repeats the comparison on a fixed set of 48 requests.

# %% [markdown]
# ## 7. Speculative decoding
#
# A decode step of a large model is bound by reading its weights (section 3): feeding it k + 1
# tokens costs about as much time as feeding it one. Speculative decoding (Leviathan et al.
# 2023; Chen et al. 2023) exploits that. A small **draft** model q proposes k tokens x1..xk one
# by one (cheap); the **target** model p scores all of them in one forward pass (the cached
# prefix plus k + 1 new positions), which gives its distributions p_0 .. p_k after each prefix.
# Then, for i = 1..k:
#
# - accept x_i with probability min(1, p(x_i) / q(x_i));
# - on the first rejection, draw the replacement from the **residual** norm(max(0, p - q))
#   and stop;
# - if all k are accepted, draw one more token from p_k (a bonus).
#
# Every step yields between 1 and k + 1 tokens, and the tokens are distributed **exactly** as if
# sampled from p (Leviathan et al., Appendix A.1): P(x accepted) = q(x) min(1, p(x)/q(x)) =
# min(p(x), q(x)), and the residual supplies the rest, p(x) - min(p(x), q(x)). The chance of
# accepting a draft is a = sum_x min(p(x), q(x)); if it were the same at every position, a step
# would give (1 - a^(k+1)) / (1 - a) tokens on average. With temperature 0 (greedy), p and q put
# all their mass on one token: a draft is accepted iff it is the target's argmax, and the output
# is the target's greedy output.
#
# The models speak through a small interface: `lm.append(tokens)` feeds tokens and returns their
# logits (t, vocab); `lm.truncate(n)` forgets everything after the first n tokens (what a
# rejection needs: the target's cache then holds drafts that were not accepted); `len(lm)` is
# the number fed. `CachedLM` runs the tiny GPT with a KV cache (exercise 11.1), `RecomputeLM`
# without one, `BigramLM` is lesson 09's bigram baseline as a draft. `truncate_layers(W, 1)`
# keeps the first layer of the model: a draft that shares the target's embeddings.

# %%
#| export
class CachedLM:
    """The model W behind the speculative-decoding interface, with a KV cache (forward_cached)."""

    def __init__(self, W: GPTWeights):
        self.W, self.cache, self.calls = W, KVCache.for_model(W), 0

    def append(self, tokens: Any) -> np.ndarray:
        """Feed tokens (1-D ids): their logits (t, vocab) in float64."""
        tokens = _token_ids(self.W, tokens, "CachedLM.append", "tokens")
        self.calls += 1
        return forward_cached(self.W, self.cache, tokens.reshape(1, -1))[0].astype(np.float64)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= len(self):
            raise ValueError(f"truncate: n must lie in [0, {len(self)}], got {n}")
        self.cache.lengths[0] = n

    def __len__(self) -> int:
        return int(self.cache.lengths[0])


class RecomputeLM:
    """The model W behind the same interface, without a cache: every call runs gpt_forward on all
    the tokens fed so far."""

    def __init__(self, W: GPTWeights):
        self.W, self.tokens, self.calls = W, [], 0

    def append(self, tokens: Any) -> np.ndarray:
        """Feed tokens (1-D ids): their logits (t, vocab) in float64."""
        new = [int(t) for t in _token_ids(self.W, tokens, "RecomputeLM.append", "tokens")]
        self.calls += 1
        self.tokens += new
        return gpt_forward(self.W, np.array([self.tokens]))[0, -len(new):].astype(np.float64)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= len(self):
            raise ValueError(f"truncate: n must lie in [0, {len(self)}], got {n}")
        del self.tokens[n:]

    def __len__(self) -> int:
        return len(self.tokens)


class BigramLM:
    """Next-token log-probabilities from counts of pairs in train_ids (add-alpha smoothing)."""

    def __init__(self, train_ids: np.ndarray, vocab_size: int, alpha: float = 0.1):
        if train_ids.size and (train_ids.min() < 0 or train_ids.max() >= vocab_size):
            raise ValueError(f"BigramLM: train_ids must lie in [0, vocab_size={vocab_size}), got values "
                             f"{train_ids.min()}..{train_ids.max()}")
        self.vocab_size = vocab_size
        counts = np.full((vocab_size, vocab_size), alpha)
        np.add.at(counts, (train_ids[:-1], train_ids[1:]), 1.0)
        self.logp = np.log(counts / counts.sum(axis=1, keepdims=True))
        self.n, self.calls = 0, 0

    def append(self, tokens: Any) -> np.ndarray:
        """Feed tokens (1-D ids): log-probabilities of the next token after each (t, vocab)."""
        arr = np.asarray(tokens) if isinstance(tokens, (list, tuple, range, np.ndarray)) else None
        if arr is None or arr.dtype.kind not in "iu" or arr.ndim != 1 or not arr.size or arr.min() < 0 \
                or arr.max() >= self.vocab_size:
            raise (TypeError if arr is None or arr.dtype.kind not in "iu" else ValueError)(
                f"BigramLM.append: tokens must be a 1-D array of at least one id in [0, {self.vocab_size}), got "
                f"{describe(tokens)}" + (f", values {arr.min()}..{arr.max()}" if arr is not None and arr.size
                                         and arr.dtype.kind in "iu" else ""))
        self.calls += 1
        tokens = arr.astype(np.int64, copy=False)
        self.n += len(tokens)
        return self.logp[tokens]

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.n:
            raise ValueError(f"truncate: n must lie in [0, {self.n}], got {n}")
        self.n = n

    def __len__(self) -> int:
        return self.n


def truncate_layers(W: GPTWeights, n_layer: int) -> GPTWeights:
    """The model's first n_layer layers (1 <= n_layer <= W.n_layer) with its embeddings, final LayerNorm
    and output layer."""
    n_layer = check_int("truncate_layers", "n_layer", n_layer, 1, W.n_layer)
    keep = {k: v for k, v in W.params.items() if not k.startswith("blocks.") or int(k.split(".")[1]) < n_layer}
    return replace(W, params=keep, n_layer=n_layer)

# %% [markdown]
# ### Exercise 11.8: speculative decoding
#
# Write `speculative_rule(p, q)`, the acceptance probabilities min(1, p / q) (1 where q is 0:
# such a token is never drafted) and the residual distribution norm(max(0, p - q)) (p itself if
# p == q, when no rejection can happen), and `speculative_generate(target, draft, prompt, ...)`.
#
# Keep each model's fed tokens a prefix of the committed tokens: before a step, feed each model
# what it has not seen yet (at least the last committed token, never fed); the draft proposes
# kk = min(k, tokens still wanted - 1) tokens; the target gets its unseen tokens plus the kk
# drafts in **one** `append`, whose last kk + 1 rows give p_0 .. p_kk. After the step, truncate
# each model to what it fed that is still a prefix of the committed tokens. Probabilities come
# from `token_probs(logits, temperature)`; draw tokens with `draw(p, rng)`.
#
# Return the new tokens and statistics: `target_calls` (appends to the target after the prompt),
# `drafted` (drafts proposed), `accepted`, `rejected` (drafts rejected: at most one per step),
# `steps`. The tests check that greedy output equals the target's greedy output, that sampled
# output follows the target's distribution (exactly, by enumeration for the rule; with a
# chi-square test for the whole loop), and that the acceptance rate approaches sum(min(p, q)).

# %%
#| export
#| exercise 11.8
def speculative_rule(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For target and draft distributions p, q (vocab,) float64: (accept, residual), accept[x] =
    min(1, p[x] / q[x]) (1 where q[x] == 0), residual = max(0, p - q) normalised to sum 1 (p itself
    when p - q has no positive part)."""
    ### BEGIN SOLUTION
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.shape != q.shape or p.ndim != 1:
        raise ValueError(f"speculative_rule: p and q must be 1-D of the same size, got {p.shape} and {q.shape}")
    accept = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 1.0)
    extra = np.maximum(p - q, 0.0)
    total = extra.sum()
    return accept, (extra / total if total > 0 else p.copy())
    ### END SOLUTION


def speculative_generate(target: Any, draft: Any, prompt: Any, max_new_tokens: int, k: int = 4,
                         temperature: float = 1.0,
                         rng: np.random.Generator | None = None) -> tuple[np.ndarray, dict[str, int]]:
    """max_new_tokens tokens after the 1-D prompt, distributed as target's samples at
    `temperature` (0: greedy), with draft proposing up to k tokens per target call.

    target, draft: fresh language models (append / truncate / len, nothing fed yet).
    Returns (tokens (max_new_tokens,) int64, {"target_calls", "drafted", "accepted", "rejected",
    "steps"})."""
    ### BEGIN SOLUTION
    prompt = [int(t) for t in np.asarray(prompt).reshape(-1)]
    if not prompt or k < 0 or max_new_tokens < 0:
        raise ValueError(f"speculative_generate: need a non-empty prompt, k >= 0, max_new_tokens >= 0; got "
                         f"{len(prompt)} tokens, k={k}, max_new_tokens={max_new_tokens}")
    rng = np.random.default_rng(0) if rng is None else rng
    tokens = list(prompt)
    stats = {"target_calls": 0, "drafted": 0, "accepted": 0, "rejected": 0, "steps": 0}
    if len(prompt) > 1:
        target.append(prompt[:-1])
        draft.append(prompt[:-1])
    while len(tokens) - len(prompt) < max_new_tokens:
        kk = min(k, max_new_tokens - (len(tokens) - len(prompt)) - 1)
        drafts, qs = [], []
        if kk > 0:
            feed = tokens[len(draft):]
            for _ in range(kk):
                qs.append(token_probs(draft.append(feed)[-1], temperature))
                drafts.append(draw(qs[-1], rng))
                feed = drafts[-1:]
        logits = target.append(tokens[len(target):] + drafts)
        stats["target_calls"] += 1
        ps = token_probs(logits[-(kk + 1):], temperature)
        new = []
        for i, x in enumerate(drafts):
            accept, residual = speculative_rule(ps[i], qs[i])
            if rng.random() < accept[x]:
                new.append(x)
                continue
            new.append(draw(residual, rng))
            stats["rejected"] += 1
            break
        else:
            new.append(draw(ps[kk], rng))
        stats["accepted"] += len(new) - 1
        stats["drafted"] += kk
        stats["steps"] += 1
        tokens += new
        for lm in (target, draft):
            lm.truncate(min(len(lm), len(tokens) - 1))
    return np.array(tokens[len(prompt):], dtype=np.int64), stats
    ### END SOLUTION

# %% tags=["check"]
check("11.8")

# %% [markdown]
# On the tiny GPT (float64, k = 4), with the bigram model and the model's own first layer as
# drafts: the measured acceptance rate against the mean of sum(min(p, q)) over the positions
# checked, and tokens per target call against (1 - a^(k+1)) / (1 - a).

# %% tags=["demo"]
def acceptance_profile(target_W: GPTWeights, draft_lm_factory, prompts: list[np.ndarray], k: int, temperature: float,
                       n_new: int) -> dict[str, float]:
    """Run speculative decoding on each prompt; also the mean sum(min(p, q)) on the generated text."""
    totals = {"target_calls": 0, "drafted": 0, "accepted": 0, "rejected": 0, "steps": 0}
    overlap, produced = [], 0
    for j, prompt in enumerate(prompts):
        out, st = speculative_generate(CachedLM(target_W), draft_lm_factory(), prompt, n_new, k, temperature,
                                       np.random.default_rng(j))
        for key in totals:
            totals[key] += st[key]
        produced += len(out)
        text = np.concatenate([prompt, out])
        p = token_probs(gpt_forward(target_W, text[None])[0, len(prompt) - 1:-1], temperature)
        q = token_probs(draft_lm_factory().append(text)[len(prompt) - 1:-1], temperature)
        overlap.append(np.minimum(p, q).sum(axis=-1).mean())
    a = totals["accepted"] / max(1, totals["accepted"] + totals["rejected"])
    return dict(a=a, overlap=float(np.mean(overlap)), per_call=produced / totals["target_calls"],
                per_call_pred=(1 - a ** (k + 1)) / (1 - a))


spec_prompts = [val_ids[s:s + 16] for s in np.random.default_rng(5).integers(0, len(val_ids) - 16, 4 if SMALL else 16)]
drafts = {"bigram": lambda: BigramLM(train_ids, W64.vocab_size), "first layer": lambda: CachedLM(truncate_layers(W64, 1))}
print(f"{'draft':<12} {'T':>4} {'accept rate a':>14} {'mean sum min(p,q)':>18} {'tokens/call':>12} "
      f"{'(1-a^5)/(1-a)':>14}")
for name, factory in drafts.items():
    for temperature in (1.0, 0.0):
        r = acceptance_profile(W64, factory, spec_prompts, 4, temperature, 48)
        print(f"{name:<12} {temperature:>4} {r['a']:>14.3f} {r['overlap']:>18.3f} {r['per_call']:>12.2f} "
              f"{r['per_call_pred']:>14.2f}")

# %% [markdown]
# The measured acceptance rate follows the mean of sum(min(p, q)) (0.50 against 0.48 for the
# bigram draft at temperature 1, 0.65 against 0.65 for the first layer), and a stronger draft is
# accepted more: the model's own first layer, greedy, gives 3.0 tokens per call of the target.
# Tokens per call fall a little short of (1 - a^5) / (1 - a): the formula assumes each draft is
# accepted independently with the same probability, while hard positions come in runs, and the
# last step of each request drafts fewer than k tokens.
#
# Tokens per call are not speed. `make bench L=kvcache` times the same loop: on this machine
# speculative decoding ran at 0.64x to 0.84x the tokens per second of plain decoding, although it
# called the target 2 to 3 times less often. Here the target is tiny and its cost is NumPy's
# per-operation overhead, so a 5-token pass costs more than a 1-token one, and the draft is not
# much cheaper than the target. The method pays where section 3's argument holds: a target whose
# decode step is bound by reading its weights (then k + 1 tokens cost about one), and a draft
# tens of times smaller. Leviathan et al. measured 2x to 3x on T5-XXL (11B) with a small T5 as the
# draft; Chen et al. 2x to 2.5x on Chinchilla 70B.
#
# ## Summary
#
# - A KV cache turns the work per generated token from the whole prefix into one token (here
#   121,280 against 7,761,920 multiply-adds at position 63) and computes the same numbers
#   (exactly, in float64). Its price is memory: 2 x layers x kv_heads x head_dim x bytes per token,
#   0.5 MiB per token for Llama-2-7B in bf16.
# - Decode reads every weight and the whole cache for a few FLOPs per byte: memory-bound at any
#   batch. Batching shares the weights; nothing shares the cache, so GQA, MQA and a quantized
#   cache shrink the bytes, at a cost in quality that retraining recovers in part.
# - Paging removes the reservation waste of a dense cache (50% to 90% of slots used here) and lets
#   sequences share a prefix; continuous batching keeps the batch full as requests come and go
#   and preempts when memory runs out, with outputs identical to serving each request alone.
# - Speculative decoding keeps the model's output distribution exactly and trades cheap draft
#   work for fewer target passes; it speeds up only when a target pass of k + 1 tokens costs
#   about as much as one.
#
# **In minitorch.** `minitorch.kv_cache` (`minitorch.serve` before the rename; that name still
# imports): the NumPy model (`gpt_weights`, `load_tiny_weights`, `random_gpt_weights`,
# `gpt_forward`, `lm_loss`, `count_macs`), the cache (`KVCache`,
# `forward_cached`, `generate`, `decode_latencies`), the costs (`kv_cache_bytes`,
# `decode_step_cost`), GQA (`grouped_attention`, `pool_kv_heads`), paging (`BlockAllocator`,
# `OutOfBlocks`, `PagedKVCache`, `paged_attention`, `paged_forward`), batching (`Request`,
# `Scheduler`) and speculative decoding (`CachedLM`, `RecomputeLM`, `BigramLM`,
# `truncate_layers`, `speculative_rule`, `speculative_generate`, `token_probs`, `draw`,
# `sample_token`). Lesson 12 leaves serving for training at scale: many processes, one model.
#
# **Sources.**
# - R. Pope et al., *Efficiently Scaling Transformer Inference*, MLSys 2023 (arXiv:2211.05102, 2022).
# - C. Chen, *Transformer Inference Arithmetic*, kipp.ly blog, 2022.
# - N. Shazeer, *Fast Transformer Decoding: One Write-Head is All You Need*, arXiv:1911.02150, 2019.
# - J. Ainslie et al., *GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
#   Checkpoints*, EMNLP 2023.
# - W. Kwon et al., *Efficient Memory Management for Large Language Model Serving with
#   PagedAttention*, SOSP 2023 (vLLM).
# - G.-I. Yu et al., *Orca: A Distributed Serving System for Transformer-Based Generative
#   Models*, OSDI 2022.
# - Y. Leviathan, M. Kalman, Y. Matias, *Fast Inference from Transformers via Speculative
#   Decoding*, ICML 2023.
# - C. Chen et al., *Accelerating Large Language Model Decoding with Speculative Sampling*,
#   arXiv:2302.01318, 2023.
# - H. Touvron et al., *Llama 2: Open Foundation and Fine-Tuned Chat Models*, 2023; A. Q. Jiang
#   et al., *Mistral 7B*, 2023; T. Brown et al., *Language Models are Few-Shot Learners*,
#   NeurIPS 2020 (model configurations).


# %%
#| export
#| given
from minitorch.checks import (Array, Attrs, Count, Func, Instance, NonNegative, Optional, Positive, Rule,  # noqa: E402
                              Seq, Size, Unchecked, validate_public)


class _FloatDType(Rule):
    """A floating dtype: what np.dtype reads as one (np.float32, "float64", np.dtype("float16"))."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        try:
            ok = value is not None and np.dtype(value).kind == "f"
        except TypeError:
            ok = False
        if not ok:
            raise TypeError(f"{what}: {name} must be a floating dtype (np.float32, np.float64, ...), got "
                            f"{describe(value)}")


class _SeqId(Rule):
    """A sequence id of the paged cache: anything hashable but a bool (True would be the id 1)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        try:
            ok = hash(value) is not None and value.__class__ not in (bool, np.bool_)
        except TypeError:  # unhashable: a list, a dict, an array
            ok = False
        if not ok:
            raise TypeError(f"{what}: {name} must be a hashable sequence id (not a bool), got {describe(value)}")


class _Axes(Array):
    """Array's rule; a refusal for the number of axes also says how many the value has (a NumPy
    scalar has none, and its repr shows no shape)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        try:
            Array.__call__(self, what, name, value)
        except ValueError as exc:
            raise ValueError(f"{exc} ({np.ndim(value)} axes)") from None


_DTYPE, _SEQ = _FloatDType(), _SeqId()
_IDS, _FLOATS = _Axes(ndim=1, dtypes="int"), Array(dtypes="float")
_HEADS = Array(ndim=4, dtypes="float", axes="(B, H, T, hd)")
_ROWS = Optional(Array(ndim=(0, 1), dtypes="int"))
_MODEL = Attrs("append", "truncate", "__len__")
validate_public(globals(), {
    "GPTWeights.astype": {"dtype": _DTYPE},
    "gpt_weights": {"dtype": _DTYPE},
    "load_tiny_weights": {"dtype": _DTYPE},
    "random_gpt_weights": {**{n: Size for n in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")},
                           "n_kv_head": Optional(Size), "seed": Count, "dtype": _DTYPE},
    # the model's inner loop checks in its bodies, at the cost of a few attribute reads per array
    "matmul": {"a": Unchecked(), "b": Unchecked()},
    "linear": {"x": Unchecked(), "params": Unchecked(), "name": Unchecked()},
    "attend": {"q": Unchecked(), "k": Unchecked(), "v": Unchecked(), "mask": Unchecked()},
    "embed": {"idx": Array(ndim=2, dtypes="int", axes="(B, T)"), "pos": Array(ndim=(1, 2), dtypes="int")},
    "layer_qkv": {"x": Array(ndim=3, dtypes="float", axes="(B, T, C)")},
    "layer_finish": {"x": Array(ndim=3, dtypes="float", axes="(B, T, C)"), "o": _HEADS},
    "lm_head": {"x": _FLOATS},
    "gpt_forward": {"attend_fn": Optional(Func())},
    "lm_loss": {"x": Array(ndim=2, dtypes="int", axes="(B, T)"), "y": Array(ndim=2, dtypes="int", axes="(B, T)"),
                "attend_fn": Optional(Func()), "batch_size": Size},
    "KVCache": {**{n: Size for n in ("n_layer", "batch", "n_kv_head", "max_len", "head_dim")}, "dtype": _DTYPE},
    "KVCache.for_model": {"batch": Size, "max_len": Optional(Size)},
    "KVCache.reset": {"rows": _ROWS},
    "forward_cached": {"rows": _ROWS},
    # the sampling loop checks in its bodies (a few attribute reads in the common case)
    "token_probs": {"logits": Unchecked(), "temperature": Unchecked()},
    "draw": {"p": Unchecked(), "rng": Unchecked()},
    "sample_token": {"logits": Unchecked(), "temperature": Unchecked(), "rng": Unchecked()},
    "decode_latencies": {"n_new": Size},
    "kv_cache_bytes": {n: Unchecked() for n in ("n_layer", "n_kv_head", "head_dim", "tokens", "bytes_per_element",
                                               "batch")},
    "decode_step_cost": {**{n: Size for n in ("n_params", "n_layer", "n_head", "n_kv_head", "head_dim", "batch")},
                         "context": Count, "bytes_per_param": Positive, "bytes_per_element": Positive},
    "grouped_attention": {"q": Unchecked(), "k": Unchecked(), "v": Unchecked(), "mask": Unchecked()},
    "BlockAllocator": {"num_blocks": Size},
    "paged_attention": {"q": _FLOATS, "k_pool": _FLOATS, "v_pool": _FLOATS,
                        "block_table": Array(ndim=2, dtypes="int", axes="(b, max_blocks)"),
                        "lengths": _Axes(ndim=1, dtypes="int", axes="(b,)")},
    "PagedKVCache": {**{n: Size for n in ("n_layer", "n_kv_head", "head_dim", "block_size", "num_blocks")},
                     "dtype": _DTYPE},
    "PagedKVCache.for_model": {"block_size": Size, "num_blocks": Size},
    "PagedKVCache.add": {"seq": _SEQ},
    "PagedKVCache.write": {"slots": _IDS, "k": _FLOATS, "v": _FLOATS},
    "PagedKVCache.block_table": {"seqs": Seq(_SEQ)},
    "PagedKVCache.blocks_needed": {"seq": _SEQ, "n": Count},
    "PagedKVCache.append": {"seq": _SEQ, "n": Count},
    "PagedKVCache.fork": {"parent": _SEQ, "child": _SEQ},
    "PagedKVCache.free": {"seq": _SEQ},
    "PagedKVCache.gather": {"seq": _SEQ},
    "paged_forward": {"cache": Attrs("blocks_needed", "append", "write"), "seqs": Seq(_SEQ)},
    "Scheduler": {"num_blocks": Size, "block_size": Size, "max_running": Optional(Size), "temperature": NonNegative},
    "Scheduler.run": {"requests": Seq(Instance(Request)), "max_steps": Size},
    "BigramLM": {"train_ids": _IDS, "vocab_size": Size, "alpha": Positive},
    "speculative_rule": {"p": _Axes(ndim=1, dtypes=(np.float32, np.float64)),
                         "q": _Axes(ndim=1, dtypes=(np.float32, np.float64))},
    "speculative_generate": {"target": _MODEL, "draft": _MODEL, "prompt": _IDS, "max_new_tokens": Count, "k": Count,
                             "temperature": NonNegative},
})

# %%
#| export serve
#| given
"""minitorch.serve: the old name of lesson 11's module, now minitorch.kv_cache (the KV cache, paged
attention, continuous batching, speculative decoding). Kept so that a notebook saved before the
rename, `from minitorch.serve import ...`, still runs: it holds the very objects of
minitorch.kv_cache. Import from minitorch.kv_cache in new code."""
if __name__ == "minitorch.serve":  # the module, not this notebook (whose names are its own)
    import minitorch.kv_cache as _kv_cache

    globals().update({k: v for k, v in vars(_kv_cache).items() if not k.startswith("__")})
