# Generated from solutions/11_kv_cache.py by `make build`. Do not edit.
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


def kv_cache_bytes(n_layer: int, n_kv_head: int, head_dim: int, tokens: int, bytes_per_element: int,
                   batch: int = 1) -> int:
    """Bytes of the keys and values of `tokens` tokens of `batch` sequences: 2 (K and V) x n_layer x
    n_kv_head x head_dim x tokens x bytes_per_element x batch. An int. Every count is an integer >= 0
    (bytes_per_element >= 1), checked here."""
    for name, value in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim), ("tokens", tokens),
                        ("batch", batch)):
        check_size("kv_cache_bytes", name, value, 0)
    check_size("kv_cache_bytes", "bytes_per_element", bytes_per_element, 1)
    return int(2 * n_layer * n_kv_head * head_dim * tokens * bytes_per_element * batch)


def decode_step_cost(n_params: int, n_layer: int, n_head: int, n_kv_head: int, head_dim: int, context: int,
                     batch: int = 1, bytes_per_param: float = 2, bytes_per_element: float = 2) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step: `batch` sequences each produce one token, each attending
    to `context` cached keys (its new token's included).

    FLOPs: 2 x n_params per sequence (n_params: the weights a token is multiplied by) plus
    attention, 4 x n_layer x n_head x head_dim x context per sequence (q.k and p.v).
    Bytes: every weight read once (n_params x bytes_per_param) plus each sequence's cache read
    once (kv_cache_bytes for `context` tokens, bytes_per_element each)."""
    flops = batch * (2.0 * n_params + 4.0 * n_layer * n_head * head_dim * context)
    nbytes = n_params * bytes_per_param + kv_cache_bytes(n_layer, n_kv_head, head_dim, context, 1, batch) * bytes_per_element
    return float(flops), float(nbytes)


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


def pool_kv_heads(W: GPTWeights, n_kv_head: int) -> GPTWeights:
    """A copy of W with n_kv_head key/value heads: the key and value projections (weight columns
    and bias entries of each head) of every group of W.n_kv_head // n_kv_head consecutive heads
    averaged into one (Ainslie et al. 2023). Query and everything else unchanged; blocks.i.attn.k
    and .v weights become (n_embd, n_kv_head * head_dim). ValueError unless n_kv_head divides
    W.n_kv_head."""
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
        if int(num_blocks) < 1:
            raise ValueError(f"BlockAllocator: num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self._refs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))   # a stack: the last freed is reused first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        """References to `block` (0 if it is free)."""
        self._check(block)
        return self._refs[block]

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"no free KV cache block: all {self.num_blocks} are in use")
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self._check(block, in_use=True)
        self._refs[block] += 1

    def release(self, block: int) -> bool:
        self._check(block, in_use=True)
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
            return True
        return False

    def _check(self, block: int, in_use: bool = False) -> None:
        if not isinstance(block, (int, np.integer)) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block!r} is not a block id in [0, {self.num_blocks})")
        if in_use and self._refs[block] == 0:
            raise ValueError(f"block {block} is free: it cannot be shared or released")


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
        table, length = self._table(seq), self.lengths[seq]
        if n <= 0:
            return 0
        new = max(0, -(-(length + n) // self.block_size) - len(table))
        copy = length % self.block_size != 0 and self.allocator.refcount(table[-1]) > 1
        return new + int(copy)

    def append(self, seq: Any, n: int) -> np.ndarray:
        """Reserve n more token slots for seq; returns their flat slots (n,) int64, in order.
        OutOfBlocks (nothing changed) if the free list cannot serve it."""
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

    def fork(self, parent: Any, child: Any) -> None:
        """A new sequence `child` sharing all of parent's blocks (and its length)."""
        self._table(parent, "parent")
        table = self._table(parent)
        if child in self.tables:
            raise ValueError(f"fork: sequence {child!r} is already in the paged cache")
        for block in table:
            self.allocator.share(block)
        self.tables[child], self.lengths[child] = list(table), self.lengths[parent]

    def free(self, seq: Any) -> None:
        """Release all of seq's blocks and forget it."""
        for block in self._table(seq):
            self.allocator.release(block)
        del self.tables[seq], self.lengths[seq]

    def gather(self, seq: Any, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """seq's keys and values in layer `layer`, read through its block table: two arrays
        (n_kv_head, length, head_dim)."""
        if check_size("PagedKVCache.gather", "layer", layer, 0) >= len(self.k):
            raise ValueError(f"PagedKVCache.gather: layer must be < {len(self.k)} (the cache's layers), got {layer}")
        table, n = self._table(seq), self.lengths[seq]
        _, _, hkv, bs, hd = self.k.shape
        k = self.k[layer, table].transpose(1, 0, 2, 3).reshape(hkv, len(table) * bs, hd)[:, :n]
        v = self.v[layer, table].transpose(1, 0, 2, 3).reshape(hkv, len(table) * bs, hd)[:, :n]
        return k, v


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


def speculative_rule(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For target and draft distributions p, q (vocab,) float64: (accept, residual), accept[x] =
    min(1, p[x] / q[x]) (1 where q[x] == 0), residual = max(0, p - q) normalised to sum 1 (p itself
    when p - q has no positive part)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.shape != q.shape or p.ndim != 1:
        raise ValueError(f"speculative_rule: p and q must be 1-D of the same size, got {p.shape} and {q.shape}")
    accept = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 1.0)
    extra = np.maximum(p - q, 0.0)
    total = extra.sum()
    return accept, (extra / total if total > 0 else p.copy())


def speculative_generate(target: Any, draft: Any, prompt: Any, max_new_tokens: int, k: int = 4,
                         temperature: float = 1.0,
                         rng: np.random.Generator | None = None) -> tuple[np.ndarray, dict[str, int]]:
    """max_new_tokens tokens after the 1-D prompt, distributed as target's samples at
    `temperature` (0: greedy), with draft proposing up to k tokens per target call.

    target, draft: fresh language models (append / truncate / len, nothing fed yet).
    Returns (tokens (max_new_tokens,) int64, {"target_calls", "drafted", "accepted", "rejected",
    "steps"})."""
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
