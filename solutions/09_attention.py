# %% [markdown]
# # Lesson 09: attention, a tiny GPT, and FlashAttention-style kernels
#
# Attention (Vaswani et al., 2017) is the one place in a transformer where positions exchange
# information: every query is compared with every key, so a sequence of N tokens produces an
# N x N matrix of scores per head. This lesson builds attention, trains a small GPT
# with it, and then removes the N x N matrix from memory, as FlashAttention does.
#
# 1. **Scaled dot-product attention** in minitorch (lesson 02's autograd): causal and padding
#    masks, several heads, and what it costs in FLOPs and bytes (lesson 04's counters).
# 2. **A tiny GPT** with the shape of Karpathy's nanoGPT: token and position embeddings,
#    pre-norm blocks with LayerNorm (you write its backward), a GELU MLP, the output layer tied
#    to the token embedding. It trains, in this notebook, on text that ships with Python itself
#    (the `help()` pages of `pydoc_data.topics`, shipped with the course as
#    `data/pydoc_topics.txt.gz`), and is measured against simple baselines.
# 3. **Kernel fusion and the online softmax** (Milakov and Gimelshein, 2018): the softmax
#    statistics in one streaming pass, and an order-independent merge of partial results.
# 4. **FlashAttention on the CPU** (Dao et al., 2022; Dao, 2023): a tiled Numba kernel that never
#    materialises the N x N matrix, skips the tiles a causal mask hides, returns the logsumexp
#    of each row, and computes its backward by recomputation. The GPT trains on it.
# 5. **The same forward in CUDA C**, graded on the CPU emulator of lesson 08 and launched
#    through CuPy where a GPU exists.
#
# Lessons 10 (quantization), 11 (KV cache) and 13 (tensor parallelism) start from the model
# trained here; its weights ship in `data/tiny_gpt.npz`. The course's reference version of this
# lesson is `minitorch/attention.py` (attention and its kernels) and `minitorch/gpt.py` (the model).
#
# Hardware background: why the N x N matrix costs time as well as memory is a question of
# bytes moved per FLOP ([roofline](../hardware_notes/roofline.md)); why attention is
# memory-bound, and FlashAttention's count of HBM accesses, in
# [memory](../hardware_notes/memory.md#why-decode-and-attention-are-memory-bound); the on-chip
# SRAM (shared memory) that its tiles live in, against the GPU's HBM, in
# [the GPU's memory hierarchy](../hardware_notes/gpu.md#the-memory-hierarchy).
#
# Conventions: activations and parameters are float32; the tests compare with float64 NumPy.
# Attention tensors are (..., N, d): batch and head axes first, then positions, then features.

# %%
import math
import os
import tracemalloc

import numpy as np

from course.check import check
from course.gpu import gpu_status, require_gpu

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
HAVE_GPU, GPU_REASON = gpu_status()
rng = np.random.default_rng(0)

# %%
#| default_exp attention
#| export
"""minitorch.attention: scaled dot-product attention (autograd and NumPy), its cost, the online
softmax and the merge of partial results, and FlashAttention-style tiled attention (Numba on the
CPU, CUDA C for the GPU).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numba import njit

from minitorch.autograd import Tensor, softmax
from minitorch.bench import matmul_flops, softmax_flops
from minitorch.checks import describe

# %% [markdown]
# ## 1. Scaled dot-product attention
#
# A query row `q_i` (d numbers) scores every key row `k_j` by a dot product, the scores become
# weights by a softmax along the keys, and the output is the weighted average of the value rows:
#
# $$O = \mathrm{softmax}\!\left(\frac{Q K^\top}{\sqrt d}\right) V, \qquad
#   Q \in \mathbb{R}^{N_q \times d},\; K \in \mathbb{R}^{N_k \times d},\; V \in \mathbb{R}^{N_k \times d_v}.$$
#
# The $1/\sqrt d$ keeps the scores' spread independent of d: with unit-variance entries a dot
# product of d terms has variance d, and without the scale a softmax over large scores is
# nearly one-hot, with vanishing gradients (Vaswani et al., 2017, section 3.2.1).
#
# A **mask** says which keys a query may see. We use a boolean array, True = may attend,
# broadcast against the (..., Nq, Nk) scores:
# - **causal**: a language model predicts token t from tokens up to t, so query i sees keys
#   j <= i. When there are fewer queries than keys (Nq < Nk: decoding with a cache of earlier
#   keys, lesson 11) the queries are the *last* Nq positions, so query i sees
#   j <= i + (Nk - Nq). FlashAttention-2 uses the same bottom-right alignment.
# - **padding**: sequences of different lengths share a batch by padding them at the end; keys
#   at positions >= the sequence's length are not real tokens.
#
# Masked scores are set to -inf before the softmax, so their weight is exactly 0. A row with
# *no* visible key (a padded query, or Nq > Nk under a causal mask) would then be softmax of all
# -inf = 0/0. We define its output as zeros, with zero gradient, as FlashAttention does; the
# kernels later in this lesson must agree.
#
# **Exercise 9.1.** Write `causal_mask(nq, nk)`, `padding_mask(lengths, nk)` and
# `attention(q, k, v, mask)` from lesson 02's differentiable operations (`@`, `*`, `+`,
# `transpose`, `softmax`), so that backward works through it. For rows with no visible key, make
# the softmax input finite (add 0 instead of -inf on such rows) and multiply its output by 0.

# %%
#| export
def _swap_last(t: Tensor) -> Tensor:
    """t with its last two axes swapped (a differentiable view)."""
    return t.transpose(tuple(range(t.ndim - 2)) + (t.ndim - 1, t.ndim - 2))


def _as_tensor(x: Any) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(np.asarray(x))


def check_size(what: str, name: str, value: Any, minimum: int = 0) -> int:
    """`value` as an int, if it is an integer >= minimum; otherwise a TypeError (not an integer: a
    float, a bool) or a ValueError (below the bound) naming the function, the argument and the value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{what}: {name} must be >= {minimum}, got {value}")
    return int(value)


def check_same_shapes(what: str, **arrays: Any) -> None:
    """ValueError naming every array's shape unless all the named arrays have one shape."""
    shapes = {name: tuple(np.shape(a)) for name, a in arrays.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{what}: {', '.join(shapes)} must have one shape, got {listed}")


KERNEL_DTYPES = (np.float32, np.float64)  # what the Numba kernels compile for (Numba has no float16)


def check_qkv(q: Any, k: Any, v: Any, what: str = "attention", dtypes: tuple | None = None) -> None:
    """ValueError/TypeError naming the shapes and dtypes unless q (..., Nq, d), k (..., Nk, d),
    v (..., Nk, dv) have matching features and positions, broadcastable batch axes and one float
    dtype (one of `dtypes`, if given)."""
    shapes = tuple(tuple(x.shape) for x in (q, k, v))
    if any(len(s) < 2 for s in shapes):
        raise ValueError(f"{what}: q, k, v need shape (..., N, d), got {shapes[0]}, {shapes[1]}, {shapes[2]}")
    (sq, sk, sv) = shapes
    if sq[-1] != sk[-1]:
        raise ValueError(f"{what}: q {sq} and k {sk} must have the same feature size d (last axis)")
    if sk[-2] != sv[-2]:
        raise ValueError(f"{what}: k {sk} and v {sv} must have the same number of positions (axis -2)")
    try:
        np.broadcast_shapes(sq[:-2], sk[:-2], sv[:-2])
    except ValueError:
        raise ValueError(f"{what}: batch axes of q {sq}, k {sk}, v {sv} do not broadcast") from None
    found = {np.dtype(x.dtype) for x in (q, k, v)}
    if len(found) != 1 or next(iter(found)).kind != "f":
        raise TypeError(f"{what}: q, k, v must share one floating dtype, got "
                        f"{np.dtype(q.dtype)}, {np.dtype(k.dtype)}, {np.dtype(v.dtype)}")
    if dtypes is not None and np.dtype(q.dtype) not in [np.dtype(t) for t in dtypes]:
        raise TypeError(f"{what}: q, k, v must be {' or '.join(np.dtype(t).name for t in dtypes)} here, "
                        f"got {np.dtype(q.dtype)}")


def check_mask(mask: Any, scores_shape: tuple[int, ...], what: str = "attention") -> np.ndarray:
    """`mask` as a boolean array broadcast to `scores_shape` (..., Nq, Nk); errors naming `what`
    (the function checking), the mask and its shape or value otherwise."""
    arr = None if isinstance(mask, (str, bytes)) or mask is None else np.asarray(
        mask.numpy() if isinstance(mask, Tensor) else mask)
    if arr is None or arr.dtype != np.bool_:
        raise TypeError(f"{what}: the mask must be boolean (True = may attend), got {describe(mask)}")
    try:
        return np.broadcast_to(arr, scores_shape)
    except ValueError:
        raise ValueError(f"{what}: mask of shape {arr.shape} does not broadcast to the scores' "
                         f"shape {tuple(scores_shape)} (..., Nq, Nk)") from None


def no_keys(q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
    """Attention over no keys at all (Nk = 0): every row sees nothing, so the output is zeros
    (..., Nq, dv) with zero gradients, as for a fully masked row (PyTorch's SDPA also returns 0).
    Computed as (q k^T) v, whose inner size is 0, so autograd and batch broadcasting work as usual."""
    if mask is not None:
        check_mask(mask, np.broadcast_shapes(q.shape[:-2], k.shape[:-2]) + (q.shape[-2], 0))
    return (q @ _swap_last(k)) @ v

# %%
#| export
#| exercise 9.1
def causal_mask(nq: int, nk: int) -> np.ndarray:
    """Boolean (nq, nk): True where query i may attend to key j, i.e. j <= i + (nk - nq).

    The queries are the last nq of nk positions (bottom-right aligned): for nq == nk the lower
    triangle with its diagonal. With nq > nk the first nq - nk rows see no key at all."""
    nq, nk = check_size("causal_mask", "nq", nq), check_size("causal_mask", "nk", nk)
    ### BEGIN SOLUTION
    return np.tri(nq, nk, k=nk - nq, dtype=bool)
    ### END SOLUTION


def padding_mask(lengths: Any, nk: int) -> np.ndarray:
    """Boolean (B, 1, 1, nk): True for key positions j < lengths[b], the real tokens of sequence b
    (padding sits at the end). Broadcasts against scores of shape (B, H, Nq, nk)."""
    nk = check_size("padding_mask", "nk", nk, 0)
    given = lengths
    lengths = np.asarray(lengths) if not isinstance(lengths, (str, bytes)) else np.asarray(0.0)
    if lengths.dtype.kind not in "iu" or lengths.ndim != 1:
        raise (TypeError if lengths.dtype.kind not in "iu" else ValueError)(
            f"padding_mask: lengths must be a 1-D integer array, got {describe(given)}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > nk):
        raise ValueError(f"padding_mask: lengths must lie in [0, nk={nk}], got {lengths.tolist()}")
    ### BEGIN SOLUTION
    return (np.arange(nk)[None, :] < lengths[:, None])[:, None, None, :]
    ### END SOLUTION


def attention(q: Any, k: Any, v: Any, mask: Any = None) -> Tensor:
    """Scaled dot-product attention softmax(q k^T / sqrt(d), masked) v, differentiable.

    q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv): autograd Tensors (arrays are wrapped) of one
    float dtype, batch axes broadcast. mask: None or a boolean array broadcastable to
    (..., Nq, Nk), True = may attend. Returns a Tensor (..., Nq, dv) of q's dtype; a row with no
    visible key is all zeros and passes no gradient (so is every row when Nk = 0, handled here)."""
    q, k, v = _as_tensor(q), _as_tensor(k), _as_tensor(v)
    check_qkv(q, k, v)
    if k.shape[-2] == 0:
        return no_keys(q, k, v, mask)
    ### BEGIN SOLUTION
    scores = (q @ _swap_last(k)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is None:
        return softmax(scores, axis=-1) @ v
    allowed = check_mask(mask, scores.shape)
    live = allowed.any(axis=-1, keepdims=True)  # rows with at least one visible key
    bias = np.where(allowed | ~live, 0.0, -np.inf).astype(scores.dtype)
    weights = softmax(scores + bias, axis=-1) * live.astype(scores.dtype)
    return weights @ v
    ### END SOLUTION

# %% tags=["check"]
check("9.1")

# %% [markdown]
# The same computation in plain NumPy, with the same conventions, is the oracle for everything
# that follows and what lesson 11 recomputes when it checks a KV cache. It also returns the
# **logsumexp** of each row of (masked) scores, $\mathrm{lse}_i = \log \sum_j e^{s_{ij}}$
# (-inf for a row with no visible key): with it, the softmax weights can be recomputed from the
# scores alone, $p_{ij} = e^{s_{ij} - \mathrm{lse}_i}$, which is how FlashAttention's backward
# avoids storing them.

# %%
#| export
def attention_np(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any = None,
                 return_lse: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """NumPy attention with attention()'s conventions, in the inputs' dtype (use float64 for an
    oracle). q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv); mask as in attention().
    Returns o (..., Nq, dv), and with return_lse also lse (..., Nq): the logsumexp of each row of
    scaled, masked scores (-inf where nothing is visible; o is 0 there)."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    check_qkv(q, k, v, "attention_np")
    s = (q @ np.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = np.where(check_mask(mask, s.shape, "attention_np"), s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # initial: Nk = 0 gives -inf, not an error
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    o = (e / np.where(total > 0, total, 1.0)) @ v
    if not return_lse:
        return o
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]
    return o, lse.astype(o.dtype)

# %% [markdown]
# A causal model cannot peek: changing a later token must leave every earlier output unchanged,
# bit for bit (the masked weights are exactly zero). And padding must not leak: a padded batch
# gives, on its real positions, what each sequence gives alone.

# %% tags=["demo"]
q, k, v = (Tensor(rng.standard_normal((1, 6, 4)).astype(np.float32)) for _ in range(3))
out = attention(q, k, v, causal_mask(6, 6)).numpy()
k2, v2 = k.numpy().copy(), v.numpy().copy()
k2[:, 4:], v2[:, 4:] = 100.0, -100.0  # change the last two positions
out2 = attention(q, Tensor(k2), Tensor(v2), causal_mask(6, 6)).numpy()
print("rows 0-3 unchanged bit for bit:", np.array_equal(out[:, :4], out2[:, :4]),
      "| rows 4-5 changed:", not np.allclose(out[:, 4:], out2[:, 4:]))
print(causal_mask(3, 5).astype(int), "  <- 3 queries, 5 keys: the queries are positions 2, 3, 4")

# %% [markdown]
# Live: the attention weights of 8 random queries and keys. Dividing the scores by a temperature
# below 1 sharpens each row toward its largest score (argmax), above 1 flattens it toward the
# uniform average; the causal mask zeroes everything right of the diagonal, and each row still
# sums to 1 over what it may see.

# %% tags=["demo"]
import matplotlib.pyplot as plt

from course.live import live

_q, _k = (np.random.default_rng(7).standard_normal((8, 16)) for _ in range(2))


def draw_attention_weights(temperature: float, causal: bool):
    scores = _q @ _k.T / math.sqrt(_q.shape[-1]) / temperature
    if causal:
        scores = np.where(causal_mask(8, 8), scores, -np.inf)
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    fig, ax = plt.subplots(figsize=(4.5, 4))
    im = ax.imshow(w, vmin=0, vmax=1, cmap="viridis")
    fig.colorbar(im, ax=ax)
    ax.set(xlabel="key", ylabel="query", title=f"T = {temperature:.2f}: largest weight per row "
           f"{w.max(axis=-1).mean():.2f} on average")
    return fig


live(draw_attention_weights, temperature=(0.1, 5.0), causal=True)

# %% [markdown]
# ## 2. Many heads, and what attention costs
#
# **Multi-head attention** runs h attentions side by side on slices of the model width C: head
# h gets channels [h*C/h, (h+1)*C/h) of the projected queries, keys and values, so each head can
# attend to different positions for different reasons, at the cost of one attention of width C
# (Vaswani et al., 2017, section 3.2.2). In code it is a reshape and a transpose: (B, T, C) ->
# (B, T, H, C/H) -> (B, H, T, C/H), after which the head axis is just another batch axis of
# `attention`; merging is the inverse.
#
# **Cost.** Per sequence and head, attention does two matrix products, S = Q K^T
# (Nq x d times d x Nk) and O = P V (Nq x Nk times Nk x dv), plus a softmax over the Nq x Nk
# scores. In lesson 04's units (`matmul_flops` counts 2 FLOPs per multiply-add; `softmax_flops`
# counts 5 per element: max, subtract, exp, sum, divide) that is
#
# $$\mathrm{FLOPs} = 2 N_q N_k d + 5 N_q N_k + 2 N_q N_k d_v .$$
#
# The score matrix itself is Nq x Nk numbers per head, which naive attention writes to memory,
# reads back for the softmax, writes again as probabilities, and, to train, keeps for the
# backward. Its FLOPs grow like N^2 d but its bytes like N^2 alone: at d = dv = 64 the two
# products do 4d = 256 FLOPs per score, while the softmax moves at least 8 bytes (float32 in and
# out) per score for its 5 FLOPs, far left on the roofline. For GPT-2 small's context (N = 1024,
# 12 heads) one layer's float32 scores are 1024 * 1024 * 12 * 4 bytes = 48 MiB per sequence.
#
# Lesson 04's `transformer_flops_per_token` charges 2 n_ctx d_model FLOPs per layer and token for
# attention (Kaplan et al., 2020); the formula above gives 4 Nk d per query, twice as much: the
# two agree when a query sees Nk/2 keys on average, as under a causal mask.
#
# **Exercise 9.2.** Write `split_heads`, `merge_heads` (differentiable: `reshape` and
# `transpose`), `attention_flops` and `attention_score_bytes`, using lesson 04's `matmul_flops`
# and `softmax_flops`. The tests count the FLOPs attention really performs with a backend that
# counts every matmul.

# %%
#| export
#| exercise 9.2
def split_heads(x: Tensor, n_head: int) -> Tensor:
    """(B, T, C) -> (B, n_head, T, C // n_head): head h holds channels [h*hd, (h+1)*hd), hd = C // n_head."""
    if x.ndim != 3 or n_head < 1 or x.shape[-1] % n_head:
        raise ValueError(f"split_heads: need x of shape (B, T, C) with C divisible by n_head, "
                         f"got shape {tuple(x.shape)} and n_head={n_head}")
    ### BEGIN SOLUTION
    b, t, c = x.shape
    return x.reshape(b, t, n_head, c // n_head).transpose(0, 2, 1, 3)
    ### END SOLUTION


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, hd) -> (B, T, H * hd): the inverse of split_heads."""
    if x.ndim != 4:
        raise ValueError(f"merge_heads: need x of shape (B, H, T, hd), got {tuple(x.shape)}")
    ### BEGIN SOLUTION
    b, h, t, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * hd)
    ### END SOLUTION


def attention_flops(b: int, h: int, nq: int, nk: int, d: int, dv: int | None = None) -> int:
    """FLOPs of attention for b sequences of h heads (no mask skipped): per head
    matmul_flops(nq, nk, d) for Q K^T, softmax_flops(nq, nk), matmul_flops(nq, dv, nk) for P V.
    dv defaults to d."""
    dv = d if dv is None else dv
    ### BEGIN SOLUTION
    return b * h * (matmul_flops(nq, nk, d) + softmax_flops(nq, nk) + matmul_flops(nq, dv, nk))
    ### END SOLUTION


def attention_score_bytes(b: int, h: int, nq: int, nk: int, itemsize: int) -> int:
    """Bytes of one score matrix (b, h, nq, nk) of `itemsize`-byte numbers: what naive attention
    materialises, and keeps for the backward, per layer."""
    ### BEGIN SOLUTION
    return b * h * nq * nk * itemsize
    ### END SOLUTION

# %% tags=["check"]
check("9.2")

# %% [markdown]
# Measured, not assumed: a backend that counts the FLOPs of every matmul it runs (lesson 01's
# `Backend` hook), and `tracemalloc`, which sees every NumPy allocation, around one forward pass.
# The FLOPs match the formula (the softmax part is counted by the formula's convention, not
# measured), and the peak memory grows 4x per doubling of N: it is the N x N matrices.

# %% tags=["demo"]
from minitorch.tensor import Backend, use_backend


class CountingBackend(Backend):
    """NumPy, plus a running count of matmul FLOPs (lesson 04's matmul_flops per 2-D product)."""

    def __init__(self):
        super().__init__("counting", np)
        self.flops = 0

    def matmul(self, a, b):
        out = np.matmul(a, b)
        batch = int(np.prod(out.shape[:-2], dtype=np.int64))
        self.flops += batch * matmul_flops(a.shape[-2], b.shape[-1], a.shape[-1])
        return out


b_, h_, d_ = 2, 4, 16
print(f"{'N':>5} {'counted matmul FLOPs':>21} {'formula - softmax':>18} {'peak MiB':>9} "
      f"{'score MiB':>10} {'peak ratio':>10}")
last = None
for n_ in (128, 256, 512) if SMALL else (128, 256, 512, 1024):
    q, k, v = (Tensor(rng.standard_normal((b_, h_, n_, d_)).astype(np.float32)) for _ in range(3))
    with use_backend("cpu", CountingBackend()) as counter:
        attention(q, k, v, causal_mask(n_, n_))
    tracemalloc.start()
    attention(q, k, v, causal_mask(n_, n_))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    expected = attention_flops(b_, h_, n_, n_, d_) - b_ * h_ * softmax_flops(n_, n_)
    ratio = f"{peak / last:.2f}" if last else ""
    print(f"{n_:>5} {counter.flops:>21,} {expected:>18,} {peak / 2**20:>9.1f} "
          f"{attention_score_bytes(b_, h_, n_, n_, 4) / 2**20:>10.1f} {ratio:>10}")
    last = peak

# %% [markdown]
# ## 3. A tiny GPT
#
# ### The text
#
# Every Python installation carries the text of its interactive help: `help("with")` prints a
# page of the language reference, and all of those pages are one dict in the standard library
# module `pydoc_data.topics`. Concatenated in sorted key order they make about 465,000
# characters of English prose and Python code with 103 distinct characters: enough to train a
# character-level model, with nothing to download.
#
# Each Python release regenerates that text (3.10, 3.12 and 3.13 each give a different one), so
# the course ships the text the model was trained on: Python 3.11.7's pages, concatenated as
# above, in `data/pydoc_topics.txt.gz` (134 KB; the Python documentation's licence, the PSF
# License Version 2, and where the text comes from are in `data/pydoc_topics.NOTICE.md`).
# `load_corpus()` reads that file on every Python and checks its SHA-256 against the one
# recorded with the shipped model, so the losses recorded for the model hold everywhere; a
# file with another hash raises `CorpusMismatch` rather than silently train on, or evaluate the
# shipped model against, different text. `pydoc_corpus()` builds the same concatenation from
# the running Python's own `pydoc_data`, to compare.
#
# The model reads characters as integers: the vocabulary is the sorted set of characters of the
# text, and a character's id is its position. The split is fixed: the first 90% of the text
# trains, the last 10% (other help pages than those trained on) validates. A training batch is
# B random windows of T + 1 consecutive characters: the model reads the first T and predicts
# the next character at each of the T positions.

# %%
#| export gpt
"""minitorch.gpt: a character-level GPT (the shape of nanoGPT) trained on Python's own help
text; its corpus, tokenizer, layers, training loop, evaluation and the shipped checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import minitorch
from minitorch.autograd import Tensor, no_grad
from minitorch.checks import check_int, check_number, describe
from minitorch.nn import Linear, Module, Parameter, cross_entropy
from minitorch.optim import Adam

if __name__ == "minitorch.gpt":
    # The package takes attention from minitorch.attention. In the lesson notebook this import
    # is skipped, so the model runs the attention functions written above it.
    from minitorch.attention import attention, causal_mask, check_size, flash_attention, merge_heads, split_heads

# %%
#| export gpt
CORPUS_SHA256 = "37d06970fc926e60c16dff401e441b84752446a36b6b64516c229fdec77e992c"  # Python 3.11.7's pages


def _data_dir() -> Path:
    """Where the shipped data lives: $MINITORCH_DATA if set; else data/ beside the minitorch package
    (a checkout of the course); else minitorch/_data (where a wheel of the course installs it)."""
    if os.environ.get("MINITORCH_DATA"):
        return Path(os.environ["MINITORCH_DATA"])
    here = Path(minitorch.__file__).resolve().parent
    for folder in (here.parent / "data", here / "_data"):
        if (folder / "tiny_gpt.json").exists():
            return folder
    return here.parent / "data"


DATA_DIR = _data_dir()
CORPUS = DATA_DIR / "pydoc_topics.txt.gz"  # the text, its licence in pydoc_topics.NOTICE.md


class CorpusMismatch(RuntimeError):
    """The corpus read is not the text the shipped model was trained on."""


def corpus_sha256(text: str) -> str:
    """SHA-256 (hex) of the UTF-8 bytes of `text`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def pydoc_corpus() -> str:
    """This Python's own help pages: every value of `pydoc_data.topics.topics` in sorted key order,
    concatenated. Python 3.11.7's is the shipped corpus; other releases give other text."""
    from pydoc_data import topics

    return "".join(topics.topics[key] for key in sorted(topics.topics))


def load_corpus(check: bool = True) -> str:
    """The training text: Python 3.11.7's help pages (`pydoc_corpus()` on that Python), read from
    data/pydoc_topics.txt.gz on every Python. About 465k characters; nothing is downloaded.

    With check=True raises CorpusMismatch if its SHA-256 is not CORPUS_SHA256 (the shipped
    checkpoint's recorded losses hold only for that text)."""
    import gzip

    if not CORPUS.exists():
        raise FileNotFoundError(f"no corpus file {CORPUS} (set MINITORCH_DATA to the folder holding "
                                "pydoc_topics.txt.gz, tiny_gpt.npz and tiny_gpt.json)")
    text = gzip.decompress(CORPUS.read_bytes()).decode("utf-8")
    digest = corpus_sha256(text)
    if check and digest != CORPUS_SHA256:
        raise CorpusMismatch(
            f"{CORPUS} has SHA-256 {digest[:16]}..., not the {CORPUS_SHA256[:16]}... of the text the shipped "
            "model was trained and evaluated on (Python 3.11.7's help pages). Restore the file, or "
            "load_corpus(check=False) to use this text (recorded losses will differ).")
    return text


class CharTokenizer:
    """Characters <-> integer ids. `vocab` is a string of distinct characters; a character's id is
    its index in `vocab`. CharTokenizer.from_text(text) uses the sorted distinct characters of text."""

    def __init__(self, vocab: str):
        if len(set(vocab)) != len(vocab):
            raise ValueError("CharTokenizer: the vocabulary has repeated characters")
        self.vocab = vocab
        self.stoi = {c: i for i, c in enumerate(vocab)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """int64 array (len(text),) of ids. ValueError naming the first unknown character."""
        try:
            return np.fromiter((self.stoi[c] for c in text), dtype=np.int64, count=len(text))
        except KeyError as exc:
            pos = next(i for i, c in enumerate(text) if c not in self.stoi)
            raise ValueError(f"encode: character {exc.args[0]!r} at position {pos} is not in the "
                             f"vocabulary of {self.vocab_size} characters") from None

    def decode(self, ids: Any) -> str:
        """The string of the ids in a 1-D integer array or list (an empty one gives "")."""
        arr = np.asarray(ids) if isinstance(ids, (list, tuple, range, np.ndarray)) else None
        if arr is None or (arr.size and arr.dtype.kind not in "iu") or arr.ndim != 1:
            raise (TypeError if arr is None or arr.ndim == 1 else ValueError)(
                f"decode: ids must be a 1-D array or list of integer ids, got {describe(ids)}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"decode: ids must lie in [0, {self.vocab_size}), got values {arr.min()}..{arr.max()}")
        return "".join(self.vocab[i] for i in arr.tolist())

    def __repr__(self) -> str:
        return f"CharTokenizer({self.vocab_size} characters)"


def _check_vocab_ids(what: str, name: str, ids: np.ndarray, vocab_size: int) -> None:
    """ValueError naming `what`, `name` and the values unless every id lies in [0, vocab_size)."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{what}: {name} must hold ids in [0, vocab_size={vocab_size}), got values "
                         f"{ids.min()}..{ids.max()}")


VAL_FRACTION = 0.1


def split_ids(ids: np.ndarray, val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """The fixed split: (first 1 - val_fraction of the ids, the rest). Views, no copy.
    ids: a 1-D integer array; val_fraction in [0, 1]."""
    n_train = int(len(ids) * (1.0 - val_fraction))
    return ids[:n_train], ids[n_train:]


def get_batch(ids: np.ndarray, batch_size: int, block_size: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """B random windows: x (B, T) int64 = ids[s : s + T], y (B, T) = ids[s + 1 : s + T + 1], for B
    start offsets s drawn from `rng`. y[b, t] is the character that follows x[b, :t + 1].
    ids: a 1-D integer array; batch_size (B) and block_size (T) >= 1."""
    if len(ids) <= block_size:
        raise ValueError(f"get_batch: need more than block_size={block_size} ids, got {len(ids)}")
    starts = rng.integers(0, len(ids) - block_size, size=batch_size)
    offsets = starts[:, None] + np.arange(block_size)[None, :]
    return ids[offsets].astype(np.int64), ids[offsets + 1].astype(np.int64)


def eval_windows(ids: np.ndarray, block_size: int, n_windows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive non-overlapping windows from the start of `ids`: x (W, T) = ids[wT : wT + T],
    y = ids[wT + 1 : wT + T + 1]; all that fit, or the first n_windows. Deterministic."""
    block_size = check_size("eval_windows", "block_size", block_size, 1)
    if n_windows is not None:
        n_windows = check_size("eval_windows", "n_windows", n_windows, 1)
    available = (len(ids) - 1) // block_size
    w = available if n_windows is None else min(int(n_windows), available)
    starts = np.arange(w) * block_size
    offsets = starts[:, None] + np.arange(block_size)[None, :]
    return ids[offsets].astype(np.int64), ids[offsets + 1].astype(np.int64)


def bigram_loss(train_ids: np.ndarray, eval_ids: np.ndarray, vocab_size: int, alpha: float = 0.1) -> float:
    """Mean cross-entropy (nats/char) on eval_ids of a bigram model p(next | current) estimated by
    counting pairs in train_ids, with add-alpha smoothing (alpha > 0). Ids lie in [0, vocab_size);
    eval_ids holds at least 2."""
    for name, ids in (("train_ids", train_ids), ("eval_ids", eval_ids)):
        _check_vocab_ids("bigram_loss", name, ids, vocab_size)
    if len(eval_ids) < 2:
        raise ValueError(f"bigram_loss: eval_ids must hold at least 2 ids (one pair), got {len(eval_ids)}")
    counts = np.full((vocab_size, vocab_size), alpha)
    np.add.at(counts, (train_ids[:-1], train_ids[1:]), 1.0)
    logp = np.log(counts / counts.sum(axis=1, keepdims=True))
    return float(-logp[eval_ids[:-1], eval_ids[1:]].mean())

# %% [markdown]
# What must a model beat? Guessing uniformly costs ln V nats per character. Counting how often
# each character follows each other one (a bigram model, 103 x 103 numbers) does much better.
# Our GPT sees up to 64 characters of context.

# %% tags=["demo"]
text = load_corpus()
tokenizer = CharTokenizer.from_text(text)
ids = tokenizer.encode(text)
train_ids, val_ids = split_ids(ids)

# %% tags=["demo"]
print(f"{len(text):,} characters, {tokenizer.vocab_size} distinct, SHA-256 {corpus_sha256(text)[:16]}...")
print(f"train {len(train_ids):,} / val {len(val_ids):,} characters")
print(repr(text[20000:20250]))
uniform_loss = math.log(tokenizer.vocab_size)
bigram_val = bigram_loss(train_ids, val_ids, tokenizer.vocab_size)
print(f"baselines on val: uniform {uniform_loss:.3f} nats/char, bigram {bigram_val:.3f} nats/char")

# %% [markdown]
# ### LayerNorm and its backward
#
# Each block normalises its input before attention and before the MLP (Ba, Kiros and Hinton,
# 2016): per position, over the C channels,
#
# $$\hat x = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}}, \qquad y = \hat x \odot w + b,$$
#
# with $\mu$ the mean and $\sigma^2$ the (biased) variance of the C values, as PyTorch's
# `LayerNorm`. Built from lesson 02's operations this would be about ten graph nodes, each
# storing a (B, T, C) array for its backward. Written as one node it stores two: $\hat x$ and
# $r = 1/\sqrt{\sigma^2+\epsilon}$ (one number per position). With $g = \partial L/\partial y$
# and $\hat g = g \odot w$, the chain rule through the mean and the variance gives
#
# $$\frac{\partial L}{\partial x} = r \left( \hat g - \mathrm{mean}(\hat g) - \hat x \,
#   \mathrm{mean}(\hat g \odot \hat x) \right), \qquad
#   \frac{\partial L}{\partial w} = \sum g \odot \hat x, \qquad \frac{\partial L}{\partial b} = \sum g,$$
#
# means over the C channels, sums over every other axis (all positions share w and b). The two
# mean terms are what the normalisation adds: x's gradient is projected so that it cannot
# change the normalised output's mean or scale.
#
# **Exercise 9.3.** Write `layer_norm_forward` (returning y and what the backward needs) and
# `layer_norm_backward`, in NumPy, in the input's dtype. `layer_norm` in the next cell makes them
# one differentiable node (with GELU, the other element-wise layer of the model).

# %%
#| export gpt
def _check_layer_norm_arrays(x: Any, weight: Any, bias: Any, eps: Any, what: str) -> None:
    """The NumPy LayerNorm's arguments: floating arrays x (..., C), weight and bias (C,), eps > 0.
    Called on the inference models' inner loop (lesson 11): the common case costs a few attribute reads."""
    for name, a in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
            raise TypeError(f"{what}: {name} must be a floating NumPy array, got {describe(a)} ({np.ndim(a)} axes)")
    if eps.__class__ is not float or not 0.0 < eps < math.inf:
        check_number(what, "eps", eps)
        if not eps > 0:
            raise ValueError(f"{what}: eps must be a finite number > 0, got {eps}")
    c = x.shape[-1] if x.ndim else None
    if c is None or weight.shape != (c,) or bias.shape != (c,):
        raise ValueError(f"{what}: x {x.shape} needs weight and bias of shape ({c},), got {weight.shape} and "
                         f"{bias.shape}")


def _check_layer_norm(x: Any, weight: Any, bias: Any, what: str = "layer_norm") -> None:
    shape = tuple(np.shape(x))
    c = shape[-1] if shape else None
    if not shape or tuple(np.shape(weight)) != (c,) or tuple(np.shape(bias)) != (c,):
        raise ValueError(f"{what}: x {shape} needs weight and bias of shape ({c},), got "
                         f"{tuple(np.shape(weight))} and {tuple(np.shape(bias))}")


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last axis as one differentiable node; it saves xhat and rstd only.
    x (..., C) autograd Tensor; weight, bias (C,). Returns a Tensor (..., C) of x's dtype."""
    _check_layer_norm(x, weight, bias)
    y, xhat, rstd = layer_norm_forward(x.data, weight.data, bias.data, eps)
    out = x._new(y.astype(x.dtype, copy=False))
    return x._record(out, (x, weight, bias), lambda g: layer_norm_backward(g, xhat, rstd, weight.data),
                     "layer_norm")


def layer_norm_np(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """LayerNorm in plain NumPy (what the model computes), in x's dtype. Its arguments are checked
    by layer_norm_forward (floating arrays x (..., C), weight and bias (C,), eps > 0)."""
    return layer_norm_forward(x, weight, bias, eps)[0]


GELU_C = math.sqrt(2.0 / math.pi)


def gelu_np(x: np.ndarray) -> np.ndarray:
    """GELU, tanh form (Hendrycks and Gimpel, 2016; GPT-2's): 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * x ** 3)))


def gelu(x: Tensor) -> Tensor:
    """gelu_np as one differentiable node (saves x and the tanh). x: a floating Tensor."""
    a = x.data
    if a.dtype.kind != "f":
        raise TypeError(f"gelu: x must be a floating Tensor, got {a.dtype} (convert it with .astype first)")
    t = np.tanh(GELU_C * (a + 0.044715 * a ** 3))
    out = x._new((0.5 * a * (1.0 + t)).astype(a.dtype, copy=False))

    def vjp(g: np.ndarray) -> tuple[np.ndarray]:
        dt = (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * a * a)
        return (g * (0.5 * (1.0 + t) + 0.5 * a * dt),)

    return x._record(out, (x,), vjp, "gelu")

# %%
#| export gpt
#| exercise 9.3
def layer_norm_forward(x: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                       eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LayerNorm over the last axis: y = (x - mean) / sqrt(var + eps) * weight + bias (biased var).

    x (..., C); weight, bias (C,). Returns (y (..., C), xhat (..., C) the normalised x,
    rstd (..., 1) = 1 / sqrt(var + eps)), all in x's dtype."""
    _check_layer_norm_arrays(x, weight, bias, eps, "layer_norm_forward")
    ### BEGIN SOLUTION
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(axis=-1, keepdims=True)
    rstd = (1.0 / np.sqrt(var + eps)).astype(x.dtype, copy=False)
    xhat = centered * rstd
    return xhat * weight + bias, xhat, rstd
    ### END SOLUTION


def layer_norm_backward(g: np.ndarray, xhat: np.ndarray, rstd: np.ndarray,
                        weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of LayerNorm from the upstream gradient g (..., C) and the forward's saved xhat
    (..., C) and rstd (..., 1). Returns (dx (..., C), dweight (C,), dbias (C,))."""
    shapes = tuple(np.shape(a) for a in (g, xhat, rstd, weight))
    if (len(shapes[0]) == 0 or shapes[1] != shapes[0] or shapes[2] != shapes[0][:-1] + (1,)
            or shapes[3] != shapes[0][-1:]):
        raise ValueError(f"layer_norm_backward: g, xhat, rstd, weight must be (..., C), (..., C), (..., 1), (C,); "
                         f"got g {shapes[0]}, xhat {shapes[1]}, rstd {shapes[2]}, weight {shapes[3]}")
    ### BEGIN SOLUTION
    lead = tuple(range(g.ndim - 1))
    dweight = (g * xhat).sum(axis=lead)
    dbias = g.sum(axis=lead)
    gw = g * weight
    dx = rstd * (gw - gw.mean(axis=-1, keepdims=True) - xhat * (gw * xhat).mean(axis=-1, keepdims=True))
    return dx, dweight, dbias
    ### END SOLUTION

# %% tags=["check"]
check("9.3")

# %% [markdown]
# ### The model
#
# The GPT (Radford et al., 2018, 2019) in the form of Karpathy's nanoGPT, small:
#
# ```
# idx (B, T) ids -> wte[idx] + wpe[0:T]                 token + position embeddings   (B, T, C)
#   n_layer x  x = x + attn(ln1(x))                     causal multi-head attention
#              x = x + mlp(ln2(x))                      Linear(C, 4C) -> GELU -> Linear(4C, C)
# ln_f(x) @ wte^T -> logits (B, T, V)                   the output layer reuses wte
# ```
#
# *Pre-norm* (the normalisation inside the residual branch, GPT-2's order) leaves an
# un-normalised path from the embeddings to the output; Xiong et al. (2020) show that it trains
# without the learning-rate warm-up the original post-norm order needs. *Weight tying* (Press
# and Wolf, 2017) uses the token embedding matrix as the output layer too, which saves V x C
# parameters. At
# initialisation every weight is N(0, 0.02^2) (the output projections of each residual branch
# N(0, (0.02/sqrt(2 n_layer))^2), so the residual stream's variance does not grow with depth),
# the logits are all near 0, and the loss is close to ln V: the model starts as the uniform
# guess.
#
# Parameter names follow nanoGPT's structure, and every projection is lesson 03's `Linear`
# (weight (in, out)), so later lessons can replace one by a quantized layer (lesson 10) or
# split one across ranks (lesson 13):
#
# | name | shape |
# |---|---|
# | `wte.weight`, `wpe.weight` | (V, C), (block_size, C) |
# | `blocks.{i}.ln1.weight`, `.bias` (also `ln2`) | (C,) |
# | `blocks.{i}.attn.q.weight`, `.bias` (also `k`, `v`, `proj`) | (C, C), (C,) |
# | `blocks.{i}.mlp.fc.weight`, `.bias` | (C, 4C), (4C,) |
# | `blocks.{i}.mlp.proj.weight`, `.bias` | (4C, C), (C,) |
# | `ln_f.weight`, `ln_f.bias` | (C,) |

# %%
#| export gpt
ATTENTION_IMPLS = ("reference", "flash")


@dataclass
class GPTConfig:
    """The model's shape. block_size: the longest context (positions 0..block_size-1); the MLP is
    4 * n_embd wide; n_embd must be divisible by n_head. attention: "reference" (attention(),
    exercise 9.1) or "flash" (flash_attention, exercise 9.7): the same function, computed differently."""

    vocab_size: int = 103
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    ln_eps: float = 1e-5
    attention: str = "reference"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            setattr(self, name, check_int("GPTConfig", name, getattr(self, name), 1))
        self.ln_eps = check_number("GPTConfig", "ln_eps", self.ln_eps, 0.0)
        if self.ln_eps <= 0:
            raise ValueError(f"GPTConfig: ln_eps must be > 0, got {self.ln_eps}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"GPTConfig: attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class Embedding(Module):
    """A table of num x dim learned vectors; weight ~ N(0, 0.02^2), float32.
    forward(idx) with idx an integer array (...) returns weight[idx], a Tensor (..., dim)."""

    def __init__(self, num: int, dim: int, rng: np.random.Generator):
        self.weight = Parameter((rng.standard_normal((num, dim)) * 0.02).astype(np.float32))

    def forward(self, idx: Any) -> Tensor:
        given, idx = idx, np.asarray(idx) if not isinstance(idx, (str, bytes)) else np.asarray(0.5)
        n = self.weight.shape[0]
        if idx.dtype.kind not in "iu":
            raise TypeError(f"Embedding({n}, {self.weight.shape[1]}): idx must be integer ids in [0, {n}), got "
                            f"{describe(given)}")
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError(f"Embedding({n}, {self.weight.shape[1]}): idx must be integer ids in [0, {n}), got "
                             f"dtype {idx.dtype}, values {idx.min()}..{idx.max()}")
        return self.weight[idx]


class LayerNorm(Module):
    """layer_norm with a learned weight (ones) and bias (zeros) of shape (dim,), float32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        self.weight = Parameter(np.ones(dim, np.float32))
        self.bias = Parameter(np.zeros(dim, np.float32))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class MLP(Module):
    """x (..., C) -> proj(gelu(fc(x))): fc Linear(C, 4C), proj Linear(4C, C)."""

    def __init__(self, config: GPTConfig, rng: np.random.Generator):
        c = config.n_embd
        self.fc = Linear(c, 4 * c, rng=rng, init=0.02)
        self.proj = Linear(4 * c, c, rng=rng, init=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(gelu(self.fc(x)))

# %% [markdown]
# ### The shipped checkpoint, and evaluation
#
# The model trained later in this section ships in `data/tiny_gpt.npz` (the state dict: parameter
# name -> float32 array) and `data/tiny_gpt.json` (its config, the corpus SHA-256, the
# vocabulary, how it was trained and the losses it reached). Validation is deterministic: the
# mean loss over consecutive non-overlapping windows of the validation text (all 726 windows of
# 64 characters, or the first `EVAL_WINDOWS` for a quick check; both are recorded). The check of
# exercise 9.4 loads those weights into your model and must reach the recorded loss.

# %%
#| export gpt
EVAL_WINDOWS = 64  # the fixed validation subset the tests use: the first 64 windows (4096 characters)


def evaluate_loss(model: Module, ids: np.ndarray, n_windows: int | None = None, batch_size: int = 64,
                  progress: bool = False) -> float:
    """Mean cross-entropy (nats per character) of `model` predicting ids over eval_windows(ids,
    block_size, n_windows), in eval mode without gradients. Deterministic. progress=True shows a
    progress bar over the batches (all 726 validation windows take tens of seconds)."""
    from tqdm.auto import tqdm

    _check_vocab_ids("evaluate_loss", "ids", ids, model.config.vocab_size)
    x, y = eval_windows(ids, model.config.block_size, n_windows)
    if len(x) == 0:
        raise ValueError(f"evaluate_loss: need more than block_size={model.config.block_size} ids, got {len(ids)}")
    was_training = model.training
    model.eval()
    total = 0.0
    with no_grad():
        for start in tqdm(range(0, len(x), batch_size), disable=not progress, desc="evaluating", unit="batch"):
            _, loss = model(x[start:start + batch_size], y[start:start + batch_size])
            total += loss.item() * len(x[start:start + batch_size])
    model.train(was_training)
    return total / len(x)


TINY_GPT = DATA_DIR / "tiny_gpt"  # tiny_gpt.npz (weights) + tiny_gpt.json (config, corpus hash, losses)


def save_checkpoint(model: "GPT", path: str | Path, **meta: Any) -> None:
    """Write path.npz (the state dict: name -> float32 array) and path.json ({"config": ..., **meta})."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path.with_suffix(".npz"), **model.state_dict())
    info = {"config": asdict(model.config), **meta}
    path.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")


def load_checkpoint(path: str | Path, attention: str = "reference") -> tuple["GPT", dict[str, Any]]:
    """(model in eval mode, meta dict) from path.npz and path.json written by save_checkpoint."""
    path = Path(path)
    for suffix in (".npz", ".json"):
        if not path.with_suffix(suffix).exists():
            raise FileNotFoundError(f"no checkpoint file {path.with_suffix(suffix)} (set MINITORCH_DATA to the "
                                    "folder holding tiny_gpt.npz and tiny_gpt.json)")
    meta = json.loads(path.with_suffix(".json").read_text())
    config = GPTConfig(**{**meta["config"], "attention": attention})
    model = GPT(config)
    with np.load(path.with_suffix(".npz")) as arrays:
        model.load_state_dict({name: arrays[name] for name in arrays.files})
    model.eval()
    return model, meta


def load_tiny_gpt(attention: str = "reference") -> tuple["GPT", CharTokenizer]:
    """The shipped model (data/tiny_gpt.*) in eval mode and its tokenizer. Its json (tiny_gpt_meta())
    records the config, the corpus SHA-256, the vocabulary and the losses it reached."""
    model, meta = load_checkpoint(TINY_GPT, attention)
    return model, CharTokenizer(meta["vocab"])


def tiny_gpt_meta() -> dict[str, Any]:
    """The shipped checkpoint's json: config, corpus_sha256, vocab, val_loss (all windows),
    val_loss_subset (first eval_windows windows), steps, batch_size, lr, train_cpu_seconds, ..."""
    return json.loads(TINY_GPT.with_suffix(".json").read_text())

# %% [markdown]
# **Exercise 9.4.** Write the three `forward` methods: the attention sub-layer (project to q, k
# and v, split into heads, `self.attend`, merge, project), the pre-norm block, and the GPT (the
# embeddings, the blocks, the final norm, the tied output layer; and with targets, the mean
# cross-entropy of lesson 03 over all B x T positions).

# %%
#| export gpt
#| exercise 9.4
class CausalSelfAttention(Module):
    """Multi-head causal self-attention: x (B, T, C) -> (B, T, C). Each of q, k, v, proj is
    Linear(C, C); heads as split_heads; the attention is config.attention's implementation."""

    def __init__(self, config: GPTConfig, rng: np.random.Generator):
        c = config.n_embd
        self.n_head = config.n_head
        self.impl = config.attention
        self.q = Linear(c, c, rng=rng, init=0.02)
        self.k = Linear(c, c, rng=rng, init=0.02)
        self.v = Linear(c, c, rng=rng, init=0.02)
        self.proj = Linear(c, c, rng=rng, init=0.02 / math.sqrt(2 * config.n_layer))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of q (B, H, Tq, hd) over k, v (B, H, Tk, hd) -> (B, H, Tq, hd)."""
        if self.impl == "flash":
            return flash_attention(q, k, v, causal=True)
        return attention(q, k, v, mask=causal_mask(q.shape[-2], k.shape[-2]))

    def forward(self, x: Tensor) -> Tensor:
        ### BEGIN SOLUTION
        q, k, v = (split_heads(lin(x), self.n_head) for lin in (self.q, self.k, self.v))
        return self.proj(merge_heads(self.attend(q, k, v)))
        ### END SOLUTION


class Block(Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)). (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig, rng: np.random.Generator):
        self.ln1 = LayerNorm(config.n_embd, config.ln_eps)
        self.attn = CausalSelfAttention(config, rng)
        self.ln2 = LayerNorm(config.n_embd, config.ln_eps)
        self.mlp = MLP(config, rng)

    def forward(self, x: Tensor) -> Tensor:
        ### BEGIN SOLUTION
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
        ### END SOLUTION


class GPT(Module):
    """A decoder-only transformer over token ids. GPT(config, seed=0) draws its initial weights
    from np.random.default_rng(seed). Parameters: see the table in lesson 09 (wte, wpe, blocks.i.*,
    ln_f; the output layer is wte.weight transposed)."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd, rng)
        self.wpe = Embedding(config.block_size, config.n_embd, rng)
        self.blocks = [Block(config, rng) for _ in range(config.n_layer)]
        self.ln_f = LayerNorm(config.n_embd, config.ln_eps)

    def forward(self, idx: Any, targets: Any = None) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) integer ids, T <= block_size. Returns (logits (B, T, V) float32 Tensor, loss):
        loss is None without targets, else the mean cross-entropy (nats) of targets (B, T)."""
        idx = np.asarray(idx)
        if idx.ndim != 2 or not 1 <= idx.shape[1] <= self.config.block_size:
            raise ValueError(f"GPT: idx must have shape (B, T) with 1 <= T <= block_size={self.config.block_size}, "
                             f"got {idx.shape}")
        if targets is not None:
            targets = np.asarray(targets)
            if targets.shape != idx.shape:
                raise ValueError(f"GPT: targets shape {targets.shape} != idx shape {idx.shape}")
        ### BEGIN SOLUTION
        b, t = idx.shape
        x = self.wte(idx) + self.wpe.weight[:t]
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        loss = None
        if targets is not None:
            loss = cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))
        return logits, loss
        ### END SOLUTION

# %% tags=["check"]
check("9.4")

# %% [markdown]
# ### Training and sampling
#
# The loop is lesson 03's with Adam, a short linear warm-up of the learning rate and a cosine
# decay to a tenth of it, validating every 100 steps on the first `EVAL_WINDOWS` windows.

# %%
#| export gpt
def lr_schedule(step: int, steps: int, lr: float, warmup: int = 50, min_ratio: float = 0.1) -> float:
    """Learning rate at `step` (0-based) of `steps`: linear warm-up over `warmup` steps, then a
    cosine from lr down to min_ratio * lr at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def train_gpt(model: "GPT", train_ids: np.ndarray, steps: int, batch_size: int = 32, lr: float = 3e-3,
              warmup: int = 50, seed: int = 0, val_ids: np.ndarray | None = None, eval_every: int = 100,
              eval_windows: int | None = EVAL_WINDOWS, progress: bool = True, desc: str = "training") -> dict[str, Any]:
    """Train `model` in place with Adam on random batches (get_batch, np.random.default_rng(seed))
    for `steps` steps, learning rate lr_schedule(step, steps, lr, warmup).

    Returns {"loss": [training loss of each step], "val_step": [...], "val_loss": [...] (every
    eval_every steps and at the end, on the first eval_windows windows of val_ids, if given),
    "seconds": wall time, "cpu_seconds": CPU time of this process}; both times add up the steps
    and evaluations alone, not the progress bar (progress=True, labelled desc) between them."""
    from tqdm.auto import tqdm

    _check_vocab_ids("train_gpt", "train_ids", train_ids, model.config.vocab_size)
    if val_ids is not None:
        _check_vocab_ids("train_gpt", "val_ids", val_ids, model.config.vocab_size)
    rng = np.random.default_rng(seed)
    optimizer = Adam(model.parameters(), lr=lr)
    history: dict[str, Any] = {"loss": [], "val_step": [], "val_loss": []}
    seconds = cpu_seconds = 0.0
    bar = tqdm(range(steps), disable=not progress, desc=desc, unit="step")
    for step in bar:
        t0, c0 = time.perf_counter(), time.process_time()
        optimizer.lr = lr_schedule(step, steps, lr, warmup)
        x, y = get_batch(train_ids, batch_size, model.config.block_size, rng)
        model.train()
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history["loss"].append(loss.item())
        evaluated = val_ids is not None and ((step + 1) % eval_every == 0 or step == steps - 1)
        if evaluated:
            history["val_step"].append(step + 1)
            history["val_loss"].append(evaluate_loss(model, val_ids, eval_windows))
        seconds += time.perf_counter() - t0
        cpu_seconds += time.process_time() - c0
        if evaluated:
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", val=f"{history['val_loss'][-1]:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}")
    history["seconds"] = seconds
    history["cpu_seconds"] = cpu_seconds
    return history


def check_sampling(what: str, max_new_tokens: int | None = None, temperature: float = 0.0,
                   top_k: int | None = None) -> None:
    """Errors naming the argument and its value unless max_new_tokens is an integer >= 0, temperature
    a finite number >= 0 and top_k None or an integer >= 1 (what generate and its kin accept).
    `what` names the function checking (a str)."""
    if what.__class__ is not str:
        raise TypeError(f"check_sampling: what must be a str (the function checking), got {describe(what)}")
    if max_new_tokens is not None:
        check_size(what, "max_new_tokens", max_new_tokens, 0)
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what}: temperature must be a number >= 0, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{what}: temperature must be finite and >= 0 (0 = the most likely id), got {temperature}")
    if top_k is not None:
        check_size(what, "top_k", top_k, 1)


def generate(model: "GPT", idx: Any, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             rng: np.random.Generator | None = None, progress: bool = False) -> np.ndarray:
    """Sample max_new_tokens ids after idx ((B, t) ids, or 1-D for one sequence); returns idx with
    them appended (same number of dimensions). Each step runs the model on the last block_size ids
    (no cache: lesson 11 adds one) and samples from softmax(logits / temperature), restricted to
    the top_k most likely ids if given; temperature 0 takes the most likely id. max_new_tokens >= 0,
    temperature >= 0, top_k None or >= 1 (check_sampling). progress=True shows a progress bar over
    the new tokens."""
    from tqdm.auto import tqdm

    check_sampling("generate", max_new_tokens, temperature, top_k)
    idx = np.asarray(idx, dtype=np.int64)
    single = idx.ndim == 1
    idx = idx[None, :] if single else idx
    rng = rng if rng is not None else np.random.default_rng(0)
    was_training = model.training
    model.eval()
    with no_grad():
        for _ in tqdm(range(max_new_tokens), disable=not progress, desc="generating", unit="token"):
            logits, _ = model(idx[:, -model.config.block_size:])
            last = logits.numpy()[:, -1, :].astype(np.float64)
            if temperature == 0:
                nxt = last.argmax(axis=-1)
            else:
                last = last / temperature
                if top_k is not None and top_k < last.shape[-1]:
                    kth = np.sort(last, axis=-1)[:, -top_k][:, None]
                    last = np.where(last < kth, -np.inf, last)
                p = np.exp(last - last.max(axis=-1, keepdims=True))
                p /= p.sum(axis=-1, keepdims=True)
                nxt = np.array([rng.choice(p.shape[-1], p=row) for row in p])
            idx = np.concatenate([idx, nxt[:, None].astype(np.int64)], axis=1)
    model.train(was_training)
    return idx[0] if single else idx

# %% [markdown]
# At initialisation the loss should be ln V (the uniform guess), and the model is small: lesson
# 04's parameter formula counts the weight matrices (biases and norms aside).

# %% tags=["demo"]
from minitorch.bench import training_flops, transformer_params

config = GPTConfig(vocab_size=tokenizer.vocab_size)
model = GPT(config, seed=0)
_, loss0 = model(*get_batch(train_ids, 32, config.block_size, np.random.default_rng(1)))
print(f"{model.num_parameters():,} parameters (lesson 04's formula: "
      f"{transformer_params(config.n_layer, config.n_embd, config.vocab_size, n_ctx=config.block_size):,} "
      f"without biases and norms); loss at initialisation {loss0.item():.3f}, ln V = {math.log(config.vocab_size):.3f}")

# %% [markdown]
# Training, or loading the shipped model. `TRAIN` at the top of the next cell chooses:
#
# - `TRAIN = False` (the default): the cell loads the shipped checkpoint, `data/tiny_gpt.npz`
#   and `.json`, in well under a second.
# - `TRAIN = True`: the cell trains the shipped model's recipe from scratch, 2000 steps of 32
#   windows of 64 characters with a progress bar, and writes `build/tiny_gpt.npz` and `.json`
#   (the shipped files in `data/` are left alone: lessons 10 and 11 record figures measured on
#   them; to replace them, copy the new pair into `data/`, or point `MINITORCH_DATA` at
#   `build/`). That takes minutes: on this course's 2-core machine the shipped run took 333 s
#   of CPU (21 minutes of wall time, as the machine was shared). A lecturer can train without
#   editing the cell: `MINITORCH_TRAIN=1 make demo L=09`.
#
# Either way the cell first times 10 training steps of a fresh model (a few seconds) and prints
# what all 2000 would take on your machine as loaded now, and ends by printing which it did and
# how long the cell took. With `MINITORCH_SMALL=1` it times 20 steps (the loop working), then
# loads or trains 20 steps, and writes nothing. The shipped model reached a validation loss of
# 1.30 nats/char over all 726 windows (1.47 on the first 64), against 2.32 for the bigram model
# and 4.63 for the uniform guess. Its json records the run.

# %% tags=["demo"]
TRAIN = False  # True: train from scratch (minutes: the cell prints how many first); False: load the shipped model (seconds)
TRAIN = TRAIN or os.environ.get("MINITORCH_TRAIN") == "1"  # the lecturer's `MINITORCH_TRAIN=1 make demo L=09`

import sys
import time

STEPS = 20 if SMALL else 2000
RECIPE = dict(batch_size=32, lr=3e-3, warmup=50, seed=0)
PROBE = 20 if SMALL else 10  # steps timed on a fresh model to project the cost of STEPS
t_cell = time.perf_counter()
history = train_gpt(GPT(config, seed=0), train_ids, PROBE, progress=False, **RECIPE)
per_step = history["seconds"] / PROBE
print(f"{PROBE} training steps timed here: {per_step * 1e3:.0f} ms per step of "
      f"{RECIPE['batch_size'] * config.block_size} characters, so {STEPS} steps take about "
      f"{per_step * STEPS / 60:.1f} min on this machine as loaded now")
if TRAIN:
    history = train_gpt(model, train_ids, STEPS, val_ids=val_ids, eval_every=10 if SMALL else 100, **RECIPE)
    print(f"trained {STEPS} steps in {history['seconds']:.0f} s, {history['cpu_seconds']:.0f} s of CPU "
          f"({history['cpu_seconds'] / STEPS * 1e3:.0f} ms per step); last training loss {history['loss'][-1]:.3f}")
    if not SMALL:
        from course.source import ROOT

        loss_curve = np.asarray(history["loss"])
        retrained = ROOT / "build" / "tiny_gpt"
        retrained.parent.mkdir(exist_ok=True)
        save_checkpoint(
            model, retrained, corpus_sha256=corpus_sha256(text), vocab=tokenizer.vocab,
            python=sys.version.split()[0], numpy=np.__version__, steps=STEPS, **RECIPE,
            train_seconds=round(history["seconds"], 1), train_cpu_seconds=round(history["cpu_seconds"], 1), n_params=model.num_parameters(),
            val_loss=evaluate_loss(model, val_ids, progress=True), eval_windows=EVAL_WINDOWS,
            val_loss_subset=evaluate_loss(model, val_ids, EVAL_WINDOWS),
            baselines={"uniform": math.log(tokenizer.vocab_size), "bigram": bigram_loss(train_ids, val_ids, tokenizer.vocab_size)},
            history={"loss_every_20": loss_curve[: len(loss_curve) // 20 * 20].reshape(-1, 20).mean(axis=1).round(4).tolist(),
                     "val_step": history["val_step"], "val_loss": [round(v, 4) for v in history["val_loss"]]})
        print(f"wrote {retrained}.npz and .json (the shipped model is {TINY_GPT}.npz)")
else:
    t0 = time.perf_counter()
    model, _ = load_tiny_gpt()
    print(f"loaded the shipped model {TINY_GPT}.npz ({tiny_gpt_meta()['steps']} steps) in {time.perf_counter() - t0:.1f} s")
print(f"TRAIN = {TRAIN}: {'trained' if TRAIN else 'loaded'}; this cell took {time.perf_counter() - t_cell:.0f} s")

# %% [markdown]
# The shipped model, evaluated here on the fixed validation split against the baselines. All 726
# windows go through the model, with a progress bar: about 4 s of CPU, so a few seconds on an
# idle 2-core laptop and half a minute when other programs share its cores (the cell prints
# the time it took).

# %% tags=["demo"]
import matplotlib.pyplot as plt

tiny, tiny_tok = load_tiny_gpt()
meta = tiny_gpt_meta()
t0 = time.perf_counter()
val_all = evaluate_loss(tiny, val_ids, progress=True)  # all 726 windows
t_eval = time.perf_counter() - t0
print(f"shipped model: {meta['n_params']:,} parameters, {meta['steps']} steps of batch {meta['batch_size']} x "
      f"{meta['config']['block_size']} in {meta['train_cpu_seconds']:.0f} s of CPU (Python {meta['python']})")
print(f"val loss {val_all:.4f} nats/char (recorded {meta['val_loss']:.4f}; evaluated in {t_eval:.0f} s); "
      f"bigram {meta['baselines']['bigram']:.3f}; uniform {meta['baselines']['uniform']:.3f}")
print(f"training cost by lesson 04's 6ND: {training_flops(meta['n_params'], meta['steps'] * meta['batch_size'] * meta['config']['block_size']) / 1e12:.2f} TFLOP")

fig, ax = plt.subplots(figsize=(8, 3.6))
hist_full = meta["history"]
ax.plot(np.arange(1, len(hist_full["loss_every_20"]) + 1) * 20, hist_full["loss_every_20"], label="train (mean of 20 steps)")
ax.plot(hist_full["val_step"], hist_full["val_loss"], "o-", ms=3, label=f"val (first {meta['eval_windows']} windows)")
if SMALL or TRAIN:
    ax.plot(np.arange(1, len(history["loss"]) + 1), history["loss"], label="this run")
for name, value in meta["baselines"].items():
    ax.axhline(value, ls="--", lw=1, color="gray")
    ax.text(5, value + 0.05, name, color="gray")
ax.set_xlabel("step")
ax.set_ylabel("nats per character")
ax.set_ylim(1.0, 5.0)
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# A sample after a prompt (temperature 0.8). It has learnt the help pages'
# vocabulary, their reStructuredText-like layout and some Python, not their meaning. Without a
# cache each new character runs the model over the whole window again (lesson 11 fixes that):
# 300 characters take a few seconds on an idle 2-core laptop, half a minute on a busy one, with
# a progress bar; the cell prints the time.

# %% tags=["demo"]
prompt = "The with statement"
t0 = time.perf_counter()
out_ids = generate(tiny, tiny_tok.encode(prompt), 100 if SMALL else 300, temperature=0.8, rng=np.random.default_rng(7),
                   progress=True)
print(f"({len(out_ids) - len(prompt)} characters generated in {time.perf_counter() - t0:.0f} s)")
print(tiny_tok.decode(out_ids))

# %% [markdown]
# ## 4. Kernel fusion and the online softmax
#
# NumPy evaluates `e = np.exp(x - x.max(1, keepdims=True)); e / e.sum(1, keepdims=True)` one
# operator at a time, each a full pass over an array as large as x: the max reads x, the
# subtraction reads x and writes a temporary, the exp reads and writes, the sum reads, the
# division reads and writes. That is 5 reads and 3 writes of x's size, where the result needs 1
# and 1. Each operator does one or two FLOPs per 4-byte element, so on a large matrix all of
# them wait on memory (lesson 04's roofline): eight passes cost about eight times one.
#
# **Fusion** does all of it in one kernel, one row at a time, so the row stays in cache (or, on a
# GPU, in registers and shared memory) between the steps. The *safe* softmax still needs the
# row's max before it can sum, and the sum before it can write: three passes over the row. The
# **online softmax** (Milakov and Gimelshein, 2018) computes the max and the sum together, in one
# pass, by rescaling the running sum whenever the running max grows:
#
# $$m_j = \max(m_{j-1}, x_j), \qquad l_j = l_{j-1}\, e^{m_{j-1} - m_j} + e^{x_j - m_j},
#   \qquad m_0 = -\infty,\; l_0 = 0,$$
#
# and at the end $\mathrm{softmax}(x)_j = e^{x_j - m}/l$. The same rule combines the statistics
# of two *parts* of a row, computed separately:
#
# $$(m_1, l_1) \oplus (m_2, l_2) = \left(m,\; l_1 e^{m_1 - m} + l_2 e^{m_2 - m}\right), \qquad m = \max(m_1, m_2).$$
#
# This merge is commutative and associative (up to rounding), so the parts can be processed in
# any order, in parallel, and combined in any tree. Note $\log l + m$ is the logsumexp of
# the part: the statistics are the logsumexp, kept in a form that does not overflow. An empty or
# fully masked part is $(-\infty, 0)$, the identity of the merge; merging two of them must not
# produce $e^{-\infty - (-\infty)}$ = NaN.
#
# **Exercise 9.5, first part.** Write `softmax_merge` and `online_softmax_stats`: the row
# statistics of x from a *stream* of column blocks of x, each seen once. Like data read from disk
# into a buffer, a block is only valid until you ask for the next one (the tests reuse one
# buffer), so keep the running statistics, not the blocks. A block may have zero columns; entries
# may be -inf.

# %%
#| export
def column_blocks(x: np.ndarray, width: int) -> Iterable[np.ndarray]:
    """Yield x's columns in blocks of `width` (the last may be narrower) through one reused buffer:
    each block is overwritten by the next, like a read buffer."""
    width = check_size("column_blocks", "width", width, 1)
    buffer = np.empty((x.shape[0], width), dtype=x.dtype)
    for start in range(0, x.shape[1], width):
        w = min(width, x.shape[1] - start)
        view = buffer[:, :w]
        view[...] = x[:, start:start + w]
        yield view
    if x.shape[1] == 0:
        yield buffer[:, :0]


def online_softmax(x: np.ndarray, block: int = 256) -> np.ndarray:
    """Row softmax of 2-D x: the statistics in one streaming pass over column blocks
    (online_softmax_stats), then one pass writing exp(x - m) / l. A row of -inf gives zeros."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"online_softmax: expected a 2-D array, got shape {x.shape}")
    block = check_size("online_softmax", "block", block, 1)
    m, l = online_softmax_stats(column_blocks(x, block))
    shift = np.where(np.isfinite(m), m, 0.0)[:, None]
    return np.exp(x - shift) / np.where(l > 0, l, 1.0)[:, None]

# %% [markdown]
# ### Merging partial attention results
#
# The same algebra works for attention outputs. If keys are split into parts, attention over each
# part gives an output $o_p$ (normalised within the part) and the part's logsumexp $\mathrm{lse}_p$.
# The attention over all keys is their weighted average, with the weights the softmax of the
# logsumexps:
#
# $$\mathrm{lse} = \log\left(e^{\mathrm{lse}_1} + e^{\mathrm{lse}_2}\right), \qquad
#   o = e^{\mathrm{lse}_1 - \mathrm{lse}}\, o_1 + e^{\mathrm{lse}_2 - \mathrm{lse}}\, o_2 .$$
#
# FlashAttention applies this per tile; split-K decoding (Flash-Decoding, Dao et al. 2023) splits a
# long KV cache across GPU blocks and merges (lesson 11); ring attention passes key blocks between
# devices and merges (lesson 13). A part with no visible key has lse = -inf and o = 0 and must
# drop out; two such parts merge to lse = -inf, o = 0.
#
# **Exercise 9.5, second part.** Write `merge_attention`, in the same cell.

# %%
#| export
#| exercise 9.5
def softmax_merge(m1: np.ndarray, l1: np.ndarray, m2: np.ndarray, l2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge the softmax statistics (max m, sum l of exp(x - m)) of two disjoint parts of the same
    rows. Arrays of one shape (rows,); an empty part is (-inf, 0). Returns (m, l) of the union."""
    check_same_shapes("softmax_merge", m1=m1, l1=l1, m2=m2, l2=l2)
    ### BEGIN SOLUTION
    m = np.maximum(m1, m2)
    shift = np.where(np.isfinite(m), m, 0.0)  # both parts empty: keep (-inf, 0), avoid -inf - -inf
    return m, l1 * np.exp(m1 - shift) + l2 * np.exp(m2 - shift)
    ### END SOLUTION


def online_softmax_stats(blocks: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Row statistics (m, l) of x = concatenate(blocks, axis=1), in one pass over the stream:
    m (rows,) = max of each row, l (rows,) = sum of exp(x - m) (0 for a row of -inf). Each block
    (rows, w_i), w_i >= 0, is valid only until the next one is requested. At least one block."""
    ### BEGIN SOLUTION
    m = l = None
    for block in blocks:
        if block.shape[1] == 0:
            bm = np.full(block.shape[0], -np.inf, dtype=block.dtype)
        else:
            bm = block.max(axis=1)
        shift = np.where(np.isfinite(bm), bm, 0.0)
        bl = np.exp(block - shift[:, None]).sum(axis=1)
        m, l = (bm, bl) if m is None else softmax_merge(m, l, bm, bl)
    if m is None:
        raise ValueError("online_softmax_stats: the stream has no blocks")
    return m, l
    ### END SOLUTION


def merge_attention(o1: np.ndarray, lse1: np.ndarray, o2: np.ndarray,
                    lse2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Combine attention over two disjoint sets of keys. o1, o2 (..., dv): outputs normalised within
    each set; lse1, lse2 (...): logsumexp of each set's scores (-inf: no visible key, o = 0).
    Returns (o, lse) of attention over the union, in the inputs' dtype; (0, -inf) if both are empty."""
    check_same_shapes("merge_attention", o1=o1, o2=o2)
    check_same_shapes("merge_attention", lse1=lse1, lse2=lse2)
    if np.ndim(o1) < 1 or np.shape(o1)[:-1] != np.shape(lse1):
        raise ValueError(f"merge_attention: o1 {np.shape(o1)} must be (..., dv) with lse1 {np.shape(lse1)} (...)")
    ### BEGIN SOLUTION
    m = np.maximum(lse1, lse2)
    shift = np.where(np.isfinite(m), m, 0.0)
    w1, w2 = np.exp(lse1 - shift), np.exp(lse2 - shift)
    total = w1 + w2
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    safe = np.where(total > 0, total, 1.0)
    o = (w1 / safe)[..., None] * o1 + (w2 / safe)[..., None] * o2
    return o.astype(o1.dtype, copy=False), lse.astype(lse1.dtype, copy=False)
    ### END SOLUTION

# %% tags=["check"]
check("9.5")

# %% [markdown]
# What fusion buys on this CPU, for a 4096 x 4096 float32 matrix (64 MiB, far larger than the
# caches): NumPy's unfused expression; the same NumPy expression applied to blocks of 32 rows
# (512 KiB, which stay in the L2 cache between the operators: fused through the cache); and a
# Numba kernel that makes the online pass and the output pass row by row.

# %% tags=["demo"]
from numba import njit as _njit


@_njit(cache=False, fastmath={"reassoc", "contract", "nsz", "arcp"})
def softmax_rows_online(x, out):
    rows, cols = x.shape
    for r in range(rows):
        m, l = -np.inf, 0.0
        for j in range(cols):
            v = x[r, j]
            if v > m:
                l = l * math.exp(m - v) + 1.0
                m = v
            else:
                l += math.exp(v - m)
        for j in range(cols):
            out[r, j] = math.exp(x[r, j] - m) / l


def softmax_unfused(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def softmax_row_blocks(x, out, rows=32):
    for r in range(0, x.shape[0], rows):
        out[r:r + rows] = softmax_unfused(x[r:r + rows])


from minitorch.bench import benchmark, load_report

print(load_report())
n_rows = 1024 if SMALL else 4096
xs = rng.standard_normal((n_rows, 4096)).astype(np.float32)
out = np.empty_like(xs)
softmax_rows_online(xs, out)
assert np.allclose(out, softmax_unfused(xs), rtol=1e-5, atol=1e-8) and np.allclose(online_softmax(xs), out, rtol=1e-5, atol=1e-8)
t_unfused = benchmark(softmax_unfused, xs, repeat=3).min
t_blocks = benchmark(softmax_row_blocks, xs, out, repeat=3).min
t_online = benchmark(softmax_rows_online, xs, out, repeat=3).min
for name, t in (("NumPy, unfused", t_unfused), ("NumPy, blocks of 32 rows", t_blocks), ("Numba, online, one row at a time", t_online)):
    print(f"{name:<34} {t * 1e3:7.1f} ms  ({2 * xs.nbytes / t / 1e9:5.1f} GB/s of compulsory traffic)")

# %% [markdown]
# The cell prints the load and the threads first; the times depend on both, and on the caches.
# On the machine this lesson was written on (one core of a shared AMD EPYC, float32, 4096 x
# 4096, a quiet moment) it printed 47 ms unfused, 25 ms in blocks of 32 rows (1.9x faster: the
# same arithmetic, about a quarter of the DRAM traffic) and 155 ms for the Numba kernel. The
# blocks' gain depends on the caches being the cell's own: other runs gave 1.1x, and two runs
# on the course's 2-core machine at a load of 1.9 (one and two BLAS threads) 0.6x, *slower*
# (48 to 50 ms unfused, 76 to 82 ms in blocks). The Numba kernel moves the least memory and was
# about 3x *slower* in every run: NumPy's `exp` is vectorised (several exponentials per
# instruction) while Numba calls the scalar `exp` of the C library once per element, so after
# fusion the exponentials, not the bytes, set the time. Fusion removes memory
# traffic; what is left then decides. On a GPU the exponential is a hardware instruction and
# lesson 08's fused softmax kernel wins outright.
#
# And the merge of partial attention results: keys split in three parts, merged in another order
# than they come, give attention over all the keys.

# %% tags=["demo"]
q, k, v = (rng.standard_normal((5, n, 8)) for n in (3, 40, 40))
o_full, lse_full = attention_np(q, k, v, return_lse=True)
parts = [attention_np(q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in ((0, 7), (7, 31), (31, 40))]
o_m, lse_m = merge_attention(*parts[2], *merge_attention(*parts[0], *parts[1]))
print("three parts merged in another order == attention over all 40 keys:",
      np.allclose(o_m, o_full, atol=1e-12), np.allclose(lse_m, lse_full, atol=1e-12))

# %% [markdown]
# ## 5. FlashAttention on the CPU
#
# Naive attention writes the N x N scores to memory, reads them for the softmax, writes the
# probabilities, and reads them again for P V: O(N^2) bytes moved and O(N^2) bytes held, for an
# output of only N x d numbers. **FlashAttention** (Dao et al., 2022) never forms the matrix. It
# cuts Q into tiles of `block_q` rows and K, V into tiles of `block_k` rows; for one query tile it
# streams through the key tiles, computes that tile's scores in fast memory, and folds them into
# running statistics with the online softmax:
#
# ```
# for each query tile Qi:                      (independent of each other: parallel)
#     m = -inf, l = 0, acc = 0                 (block_q rows each: lives in registers / L1)
#     for each key tile Kj, Vj:                (skip it if the causal mask hides all of it)
#         S = Qi Kj^T * scale                  (block_q x block_k, masked)
#         m_new = max(m, rowmax(S))
#         P = exp(S - m_new)
#         l   = l   * exp(m - m_new) + rowsum(P)
#         acc = acc * exp(m - m_new) + P Vj
#         m = m_new
#     Oi = acc / l,  lse_i = m + log(l)        (written once)
# ```
#
# This is FlashAttention-2's loop order (Dao, 2023): query tiles outside, key tiles inside, so each
# output tile is finished in fast memory and written once, and different query tiles share
# nothing, which is what makes them the unit of parallel work (GPU thread blocks there, CPU
# threads here). The first FlashAttention had the loops the other way round and rewrote the
# output tiles once per key tile. Memory beyond the inputs and outputs: O(block_q x (d + 2)),
# instead of O(N^2).
#
# With a causal mask, query row i sees keys j <= i + (Nk - Nq). A key tile that starts after the
# last key the tile's *last* row can see is hidden from the whole query tile: skip it, and about
# half of all the work disappears. Tiles on the diagonal are partly visible: there, mask per row.
#
# On a CPU the "fast memory" is the L1 and L2 cache: a key tile of 64 rows of 64 float32 numbers
# is 16 KiB. Numba compiles the loops; each call processes one query tile, and
# `flash_attention_forward` runs the (head, query tile) pairs on a thread pool (Numba releases the
# GIL with `nogil=True`).
#
# **Exercise 9.6.** Write `flash_forward_tile`: query rows [i0, i1) of one head against all key
# tiles in order, with the running max, sum and accumulator, skipping key tiles no row of the tile
# can see, masking per row inside partly visible tiles, writing `o[i0:i1]` and `lse[i0:i1]` once
# at the end (0 and -inf for a row that sees no key). Return the number of scores computed
# (query-key dot products): the tests use it to see the skipping. Loops over scalars are what
# Numba compiles well; there is no need for array expressions inside the kernel.

# %%
#| export
# Fast-math flags that allow reordering sums (so dot products vectorise) but keep inf and NaN
# semantics, which the masks and the empty rows (-inf) rely on.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# %%
#| export
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="flash")
    return _POOL


def _run(fn: Callable[[Any], Any], items: list, threads: int | None) -> list:
    """fn over items, on the shared thread pool (threads=None) or serially (threads=1)."""
    if threads == 1 or len(items) <= 1:
        return [fn(item) for item in items]
    return list(_pool().map(fn, items))


def _as_heads(x: Any, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"{what}: expected (G, N, d) arrays (G = batch x heads), got shape {x.shape}")
    return np.ascontiguousarray(x)


def flash_attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False,
                            block_q: int = 64, block_k: int = 64,
                            threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tiled attention of q (G, Nq, d) over k (G, Nk, d), v (G, Nk, dv), float32 or float64:
    flash_forward_tile for every (head, query tile), on a thread pool (threads=1: serially).
    Returns (o (G, Nq, dv), lse (G, Nq)) in the inputs' dtype, equal to attention_np(...,
    causal_mask(Nq, Nk) if causal, return_lse=True). Never allocates an Nq x Nk array."""
    q, k, v = _as_heads(q, "flash_attention_forward q"), _as_heads(k, "k"), _as_heads(v, "v")
    check_qkv(q, k, v, "flash_attention_forward", KERNEL_DTYPES)
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(f"flash_attention_forward: q {q.shape}, k {k.shape}, v {v.shape} need the same G")
    block_q = check_size("flash_attention_forward", "block_q", block_q, 1)
    block_k = check_size("flash_attention_forward", "block_k", block_k, 1)
    g, nq, d = q.shape
    o = np.empty((g, nq, v.shape[2]), dtype=q.dtype)
    lse = np.empty((g, nq), dtype=q.dtype)
    scale = 1.0 / math.sqrt(d)
    items = [(h, i0) for h in range(g) for i0 in range(0, nq, block_q)]

    def one_tile(item: tuple[int, int]) -> int:
        h, i0 = item
        return flash_forward_tile(q[h], k[h], v[h], scale, bool(causal), i0, min(i0 + block_q, nq),
                                  block_k, o[h], lse[h])

    _run(one_tile, items, threads)
    return o, lse

# %%
#| export
#| exercise 9.6
@njit(cache=False, nogil=True, fastmath=FASTMATH)
def flash_forward_tile(q, k, v, scale, causal, i0, i1, block_k, o, lse):
    """Attention for query rows [i0, i1) of one head, streaming over key tiles of block_k rows.

    q (Nq, d), k (Nk, d), v (Nk, dv), o (Nq, dv), lse (Nq,): C-contiguous, one float dtype. Writes
    o[i0:i1] and lse[i0:i1] (logsumexp of the row's scaled, masked scores). causal: row i sees
    keys j <= i + Nk - Nq; a row that sees none gets o = 0, lse = -inf. Returns the number of
    scores computed."""
    nq, d = q.shape
    nk, dv = v.shape
    rows = i1 - i0
    offset = nk - nq
    ### BEGIN SOLUTION
    m = np.full(rows, -np.inf, dtype=q.dtype)
    l = np.zeros(rows, dtype=q.dtype)
    acc = np.zeros((rows, dv), dtype=q.dtype)
    s = np.empty(block_k, dtype=q.dtype)
    j_end = min(nk, i1 + offset) if causal else nk  # keys after j_end are hidden from every row
    n_scores = 0
    for j0 in range(0, j_end, block_k):
        j1 = min(j0 + block_k, nk)
        for r in range(rows):
            i = i0 + r
            stop = min(j1, i + offset + 1) if causal else j1
            if stop <= j0:
                continue  # this row sees nothing of this tile
            m_new = m[r]
            for j in range(j0, stop):
                dot = q.dtype.type(0)  # the inputs' dtype: a 0.0 would sum float32 in float64, half the SIMD lanes
                for p in range(d):
                    dot += q[i, p] * k[j, p]
                s[j - j0] = dot * scale
                m_new = max(m_new, s[j - j0])
            n_scores += stop - j0
            correction = math.exp(m[r] - m_new)  # exp(-inf) = 0 on the first visible tile
            l_new = l[r] * correction
            for c in range(dv):
                acc[r, c] *= correction
            for j in range(j0, stop):
                p_j = math.exp(s[j - j0] - m_new)
                l_new += p_j
                for c in range(dv):
                    acc[r, c] += p_j * v[j, c]
            m[r] = m_new
            l[r] = l_new
    for r in range(rows):
        i = i0 + r
        if l[r] == 0.0:
            for c in range(dv):
                o[i, c] = 0.0
            lse[i] = -np.inf
        else:
            for c in range(dv):
                o[i, c] = acc[r, c] / l[r]
            lse[i] = m[r] + math.log(l[r])
    return n_scores
    ### END SOLUTION

# %% tags=["check"]
check("9.6")

# %% [markdown]
# Memory, measured: `tracemalloc` sees NumPy's allocations (not the few block-sized arrays inside
# the compiled kernel, which are O(block) anyway). Per doubling of N, naive attention's peak grows
# about 4x and the tiled forward's about 2x (its output).

# %% tags=["demo"]
def peak_bytes(fn, *args):
    tracemalloc.start()
    fn(*args)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def naive_causal(q, k, v):
    return attention_np(q, k, v, causal_mask(q.shape[-2], k.shape[-2]))


flash_attention_forward(*(np.zeros((1, 8, 64), np.float32) for _ in range(3)), causal=True)  # compile
print(f"{'N':>5} {'naive peak':>11} {'tiled peak':>11} {'ratio':>7}")
for n_ in (256, 512, 1024) if SMALL else (512, 1024, 2048, 4096):
    q, k, v = (rng.standard_normal((1, n_, 64)).astype(np.float32) for _ in range(3))
    p_naive, p_flash = peak_bytes(naive_causal, q, k, v), peak_bytes(flash_attention_forward, q, k, v, True)
    print(f"{n_:>5} {p_naive / 2**20:>8.1f} MiB {p_flash / 2**20:>8.2f} MiB {p_naive / p_flash:>6.0f}x")

# %% [markdown]
# Time, on one head with d = 64 and a causal mask, float32. The tiled kernel does half of the
# naive FLOPs (it skips the hidden tiles) but one dot product at a time, with scalar
# exponentials; naive attention does all of them with BLAS and vectorised NumPy but moves N^2
# floats several times. Naive attention loses least where N^2 floats still fit in the caches
# (N = 256: 256 KiB of scores). On the course's development machine (an Intel Xeon with AVX-512,
# 2 threads; other jobs running, load average 6.8, the run given priority over them) one run of
# `make bench L=attention`, naive attention on OpenBLAS 0.3.31's AVX-512 "SkylakeX" kernel as a
# student's machine runs it, found the tiled kernel faster at every N from 256 to 4096 all the
# same: 1.17x (N = 1024) to 3.07x (N = 4096). The cell prints the load, the BLAS kernel and the
# threads, then the ratio for each N: it depends on all three (where the environment holds
# OpenBLAS to an older kernel, the cell says so and times the comparison again without it). The two take turns after a pause (`best_apart`, lesson 06): naive
# attention's BLAS threads keep spinning for about 0.1 s after a call and would slow a kernel
# started at once. One detail decides a
# factor of about 1.5: the kernel's sums start from `q.dtype.type(0)`, not `0.0`, because Numba
# types `0.0` as float64 and would then widen every float32 product to float64, half as many
# per SIMD instruction.

# %% tags=["demo"]
from minitorch.bench import blas_forced, blas_line, run_native
from minitorch.simd_matmul import best_apart

print(load_report())
print(blas_line())  # naive attention's two products run on this BLAS kernel
sizes_ = (256, 1024) if SMALL else (256, 512, 1024, 2048, 4096)
for n_ in sizes_:
    q, k, v = (rng.standard_normal((1, n_, 64)).astype(np.float32) for _ in range(3))
    err = float(np.abs(flash_attention_forward(q, k, v, True)[0] - naive_causal(q, k, v)).max())
    assert err < 1e-4, f"tiled and naive attention differ by {err} at N = {n_}"
    best = best_apart({"naive": lambda: naive_causal(q, k, v), "tiled": lambda: flash_attention_forward(q, k, v, True)},
                      rounds=2)
    t_naive, t_flash = best["naive"], best["tiled"]
    print(f"N = {n_:>4}: naive {t_naive * 1e3:7.1f} ms, tiled {t_flash * 1e3:7.1f} ms, naive / tiled = {t_naive / t_flash:4.1f}"
          f"   (max |tiled - naive| = {err:.1e})")
if blas_forced():  # this process's BLAS is held back: the same comparison as a student's machine runs it
    print(f"timed again in a child process without {', '.join(blas_forced())} (`make bench L=attention`'s table: "
          "naive attention on the BLAS kernel a student's machine runs, the course's tiled kernel):")
    rows = run_native("benchmarks.bench_attention:cpu_table", sizes=list(sizes_))
    for r in rows:
        print(f"N = {r['n']:>4}: naive {r['t_naive'] * 1e3:7.1f} ms, tiled {r['t_tiled'] * 1e3:7.1f} ms, "
              f"naive / tiled = {r['t_naive'] / r['t_tiled']:4.1f}")

# %% [markdown]
# ### The backward, by recomputation
#
# The gradients of O = softmax(S) V with S = scale * Q K^T, for the rows that see key j, are
# (with P the softmax weights and dO the upstream gradient)
#
# $$dV = P^\top dO, \qquad dP = dO\, V^\top, \qquad dS_{ij} = P_{ij}\,(dP_{ij} - D_i),\quad
#   D_i = \sum_j P_{ij}\, dP_{ij} = dO_i \cdot O_i, \qquad dQ = \mathrm{scale}\; dS\, K, \qquad
#   dK = \mathrm{scale}\; dS^\top Q .$$
#
# They need P, which the forward did not keep. FlashAttention recomputes it, tile by tile, from Q,
# K and the saved logsumexp: $P_{ij} = e^{s_{ij} - \mathrm{lse}_i}$, exact and already
# normalised, with no running max needed. The state saved for the backward is Q, K, V, O and
# lse: O(N d), against the O(N^2) probabilities naive attention keeps. The price is computing
# the scores twice: seven N x N x d matrix products per training step instead of six (two
# forward, four backward, plus S again), 17% more attention FLOPs; the saved memory traffic
# makes it faster anyway on a GPU (Dao et al., 2022, section 3.1). $D_i = dO_i \cdot O_i$ is
# one dot product per row, computed before the tiles (FlashAttention-2's preprocessing step).
#
# FlashAttention-2's backward loop order is the other way round from the forward: key tiles
# outside, query rows inside. A key tile's dK and dV are then finished in fast memory and written
# once, while dQ receives a contribution from every key tile (atomic additions on a GPU; here the
# key tiles of one head run in order, heads in parallel). With a causal mask, the query rows
# i < j0 - (Nk - Nq) see nothing of a key tile starting at j0 and are skipped.
#
# **Exercise 9.7.** Write `flash_backward_tile` (one key tile [j0, j1) of one head: add into dq,
# write dk[j0:j1] and dv[j0:j1]; rows with lse = -inf contribute nothing; return the number of
# scores recomputed), and `flash_attention`, the autograd operation: the forward runs
# `flash_attention_forward` on q, k, v reshaped to (G, N, d) and records a node whose backward calls
# `flash_attention_backward` with the saved arrays.

# %%
#| export
def flash_attention_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray, lse: np.ndarray,
                             do: np.ndarray, causal: bool = False, block_k: int = 64,
                             threads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients (dq, dk, dv) of attention from its inputs q (G, Nq, d), k (G, Nk, d), v (G, Nk, dv),
    its output o (G, Nq, dv) and logsumexp lse (G, Nq), and the upstream gradient do (G, Nq, dv):
    flash_backward_tile over the key tiles of each head in order, heads on a thread pool."""
    q, k, v = _as_heads(q, "flash_attention_backward q"), _as_heads(k, "k"), _as_heads(v, "v")
    o, do = _as_heads(o, "o"), _as_heads(do, "do")
    lse = np.ascontiguousarray(lse)
    check_qkv(q, k, v, "flash_attention_backward", KERNEL_DTYPES)
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(f"flash_attention_backward: q {q.shape}, k {k.shape}, v {v.shape} need the same G")
    if (do.shape != o.shape or o.shape != q.shape[:2] + v.shape[2:] or lse.shape != q.shape[:2]):
        raise ValueError(f"flash_attention_backward: o {o.shape}, do {do.shape}, lse {lse.shape} do not fit "
                         f"q {q.shape} and v {v.shape} (o, do (G, Nq, dv), lse (G, Nq))")
    if {o.dtype, do.dtype, lse.dtype} != {q.dtype}:
        raise TypeError(f"flash_attention_backward: o, do, lse must have q's dtype {q.dtype}, got "
                        f"{o.dtype}, {do.dtype}, {lse.dtype}")
    block_k = check_size("flash_attention_backward", "block_k", block_k, 1)
    g, nq, d = q.shape
    nk = k.shape[1]
    delta = (do * o).sum(axis=-1)  # D_i = do_i . o_i (FlashAttention-2's preprocessing)
    dq = np.zeros_like(q)
    dk, dv = np.empty_like(k), np.empty_like(v)
    scale = 1.0 / math.sqrt(d)

    def one_head(h: int) -> None:
        for j0 in range(0, nk, block_k):
            flash_backward_tile(q[h], k[h], v[h], do[h], lse[h], delta[h], scale, bool(causal), j0,
                                min(j0 + block_k, nk), dq[h], dk[h], dv[h])

    _run(one_head, list(range(g)), threads)
    return dq, dk, dv

# %%
#| export
#| exercise 9.7
@njit(cache=False, nogil=True, fastmath=FASTMATH)
def flash_backward_tile(q, k, v, do, lse, delta, scale, causal, j0, j1, dq, dk, dv):
    """Gradients through key rows [j0, j1) of one head, recomputing the probabilities from lse.

    q, do (Nq, d | dv); k, v (Nk, d | dv); lse, delta (Nq,) with delta_i = do_i . o_i; C-contiguous,
    one float dtype. Adds this tile's contributions into dq (Nq, d); writes dk[j0:j1], dv[j0:j1].
    causal as in flash_forward_tile; rows with lse = -inf are skipped. Returns the number of scores
    recomputed."""
    nq, d = q.shape
    nk, dvd = v.shape
    offset = nk - nq
    ### BEGIN SOLUTION
    width = j1 - j0
    dk_tile = np.zeros((width, d), dtype=q.dtype)
    dv_tile = np.zeros((width, dvd), dtype=q.dtype)
    i_start = max(0, j0 - offset) if causal else 0  # earlier rows see none of these keys
    n_scores = 0
    for i in range(i_start, nq):
        if lse[i] == -np.inf:
            continue
        stop = min(j1, i + offset + 1) if causal else j1
        for j in range(j0, stop):
            dot = q.dtype.type(0)  # sums in the inputs' dtype (a 0.0 would make them float64)
            for c in range(d):
                dot += q[i, c] * k[j, c]
            p = math.exp(dot * scale - lse[i])
            dp = q.dtype.type(0)
            for c in range(dvd):
                dp += do[i, c] * v[j, c]
                dv_tile[j - j0, c] += p * do[i, c]
            ds = p * (dp - delta[i]) * scale
            for c in range(d):
                dq[i, c] += ds * k[j, c]
                dk_tile[j - j0, c] += ds * q[i, c]
        n_scores += max(0, stop - j0)
    for j in range(width):
        for c in range(d):
            dk[j0 + j, c] = dk_tile[j, c]
        for c in range(dvd):
            dv[j0 + j, c] = dv_tile[j, c]
    return n_scores
    ### END SOLUTION


def flash_attention(q: Any, k: Any, v: Any, causal: bool = False, block_q: int = 64, block_k: int = 64) -> Tensor:
    """Attention by the tiled kernels, as one autograd node: forward flash_attention_forward, backward
    flash_attention_backward from the saved q, k, v, o, lse (no Nq x Nk array is ever stored).

    q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv): Tensors with the same batch axes (no
    broadcasting), float32 or float64 (the kernels'). causal: the mask causal_mask(Nq, Nk). Returns (..., Nq, dv),
    equal to attention(q, k, v, causal_mask(Nq, Nk) if causal else None)."""
    q, k, v = _as_tensor(q), _as_tensor(k), _as_tensor(v)
    check_qkv(q, k, v, "flash_attention", KERNEL_DTYPES)
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(f"flash_attention: q {q.shape}, k {k.shape}, v {v.shape} need the same batch axes")
    check_size("flash_attention", "block_q", block_q, 1), check_size("flash_attention", "block_k", block_k, 1)
    if k.shape[-2] == 0 or 0 in q.shape[:-1]:
        return no_keys(q, k, v)  # nothing to tile: zeros (Nk = 0: no row sees a key) or an empty output
    ### BEGIN SOLUTION
    lead, nq, nk = q.shape[:-2], q.shape[-2], k.shape[-2]
    q3 = q.data.reshape(-1, nq, q.shape[-1])
    k3 = k.data.reshape(-1, nk, k.shape[-1])
    v3 = v.data.reshape(-1, nk, v.shape[-1])
    o3, lse = flash_attention_forward(q3, k3, v3, causal, block_q, block_k)
    out = q._new(o3.reshape(*lead, nq, v.shape[-1]))

    def vjp(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dq, dk, dv = flash_attention_backward(q3, k3, v3, o3, lse, g.reshape(o3.shape), causal, block_k)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

    return q._record(out, (q, k, v), vjp, "flash_attention")
    ### END SOLUTION

# %% tags=["check"]
check("9.7")

# %% [markdown]
# Now the GPT trains on it: the same model from the same initial weights, with
# `GPTConfig(attention="flash")`, follows the reference run to float32 rounding. (At T = 64 there
# is no memory to save, and the first flash run includes Numba's compilation; the point here is
# that the model cannot tell the difference.) The cell trains 30 steps with each attention, a
# progress bar each, and prints the time of each run: some 10 s in all on an idle 2-core laptop,
# minutes when other programs share its cores.

# %% tags=["demo"]
losses = {}
for impl in ("reference", "flash"):
    m_ = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, attention=impl), seed=0)
    h_ = train_gpt(m_, train_ids, 5 if SMALL else 30, seed=0, desc=f"{impl} attention")
    losses[impl] = (h_["loss"], h_["seconds"])
diff = np.max(np.abs(np.subtract(losses["reference"][0], losses["flash"][0])))
print(f"reference: {losses['reference'][1]:.1f} s, flash: {losses['flash'][1]:.1f} s; "
      f"largest difference between the two loss curves: {diff:.1e}")

# %% [markdown]
# ## 6. The same forward in CUDA C
#
# On a GPU the fast memory is explicit. Each thread block gets a query tile of `BLOCK_Q` rows, one
# row per thread, held in registers (`q` row, accumulator, running max and sum). For each key
# tile the block's threads together copy `BLOCK_K` rows of K and V from global memory (HBM) into
# `__shared__` arrays (on-chip SRAM), wait at a barrier, and every thread then reads the whole
# tile from shared memory: each K and V element is read from HBM once per query tile instead of
# once per query row. A second barrier keeps the next copy from overwriting a tile that slower
# threads are still reading. Grid: (query tiles, heads).
#
# The sizes are compile-time constants, prepended by the wrapper as `#define`s: `HEAD_DIM` (d),
# `BLOCK_Q` = 64 threads, `BLOCK_K` = 32, so that the loops over HEAD_DIM can be unrolled and the
# per-thread arrays `float q_row[HEAD_DIM], acc[HEAD_DIM]` stay in registers (a register cannot
# be indexed by a run-time value; the tile's scores `float s[BLOCK_K]`, indexed in a loop left
# rolled to keep compilation fast, go to per-thread local memory, cached in L1). The two tiles
# take 2 x 32 x 64 x 4 = 16 KiB of shared memory at d = 64. Threads whose row is past the end
# (the last tile is ragged) still help load and still reach every barrier; they just write nothing.
# Key rows past the end are loaded as zeros and never used. -inf is `__int_as_float(0xff800000)`
# (NVRTC has no `INFINITY`).
#
# **Exercise 9.8.** Write `flash_forward` in CUDA C: float32 q, k (G, nk, HEAD_DIM), v, o, lse
# as in `flash_attention_forward` with dv = d, `causal` 0 or 1 (skip the key tiles no row of the
# block can see), `scale` = 1/sqrt(d). It is graded without a GPU: NVRTC compiles it and its PTX
# must show the shared-memory tiles and barriers; the emulator of lesson 08 runs it on ragged sizes,
# several heads and tiles, with and without the mask. The shape of it:
#
# ```
# extern "C" __global__ void flash_forward(const float* q, const float* k, const float* v, float* o,
#                                          float* lse, int nq, int nk, int causal, float scale) {
#     __shared__ float k_tile[BLOCK_K][HEAD_DIM], v_tile[BLOCK_K][HEAD_DIM];
#     // this thread's row: blockIdx.x * BLOCK_Q + threadIdx.x of head blockIdx.y; load q * scale
#     // into registers; m = -inf, l = 0, acc = 0
#     for (key tiles any row of this block can see) {
#         // all threads copy the tile (zeros past nk); __syncthreads();
#         // scores of the visible keys, tile max, rescale l and acc, accumulate p * v
#         // __syncthreads();
#     }
#     // active rows write o = acc / l and lse = m + log(l) (0 and -inf if l == 0)
# }
# ```

# %%
#| export
FLASH_BLOCK_Q = 64  # threads per block = query rows per tile
FLASH_BLOCK_K = 32  # key rows per shared-memory tile


def flash_cuda_program(head_dim: int) -> str:
    """flash_cuda_source() with HEAD_DIM, BLOCK_Q and BLOCK_K defined in front."""
    return (f"#define HEAD_DIM {int(head_dim)}\n#define BLOCK_Q {FLASH_BLOCK_Q}\n#define BLOCK_K {FLASH_BLOCK_K}\n"
            + flash_cuda_source())


def flash_cuda_launch(g: int, nq: int) -> tuple[tuple[int, int], tuple[int]]:
    """(grid, block) of flash_forward: one block of FLASH_BLOCK_Q threads per (query tile, head)."""
    return ((nq + FLASH_BLOCK_Q - 1) // FLASH_BLOCK_Q, g), (FLASH_BLOCK_Q,)

# %%
#| export
def _cupy() -> Any:
    import cupy

    return cupy


_CUDA_KERNELS: dict[Any, Any] = {}


def _flash_cuda_operands(q: Any, k: Any, v: Any, xp: Any) -> tuple[Any, Any, Any]:
    check_qkv(q, k, v, "flash_attention_cuda")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"flash_attention_cuda: expected q (G, Nq, d), k (G, Nk, d), v (G, Nk, d), got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if v.shape[2] != q.shape[2]:
        raise ValueError(f"flash_attention_cuda: the kernel needs dv == d, got v {v.shape} and q {q.shape}")
    if np.dtype(q.dtype) != np.float32:
        raise TypeError(f"flash_attention_cuda: the kernel is float32, got {q.dtype}")
    return xp.ascontiguousarray(q), xp.ascontiguousarray(k), xp.ascontiguousarray(v)


def _flash_cuda_args(q: Any, k: Any, v: Any, o: Any, lse: Any, causal: bool) -> tuple:
    return (q, k, v, o, lse, np.int32(q.shape[1]), np.int32(k.shape[1]), np.int32(bool(causal)),
            np.float32(1.0 / math.sqrt(q.shape[2])))


def flash_attention_emulated(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                             causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(o, lse) of flash_forward run on the CPU emulator (course.cuda_c). q (G, Nq, d), k, v (G, Nk, d) float32."""
    from course.cuda_c import emulate  # the CPU emulator of CUDA C is course machinery (course/cuda_c.py)

    q, k, v = _flash_cuda_operands(np.asarray(q), np.asarray(k), np.asarray(v), np)
    o = np.zeros_like(q)
    lse = np.zeros(q.shape[:2], np.float32)
    if q.size:
        emulate(flash_cuda_program(q.shape[2]), "flash_forward", *flash_cuda_launch(q.shape[0], q.shape[1]),
                list(_flash_cuda_args(q, k, v, o, lse, causal)))
    return o, lse


def flash_attention_cuda(q: Any, k: Any, v: Any, causal: bool = False) -> tuple[Any, Any]:
    """(o, lse) of flash_forward on the GPU: CuPy float32 arrays q (G, Nq, d), k, v (G, Nk, d)."""
    cp = _cupy()
    q, k, v = _flash_cuda_operands(q, k, v, cp)
    o = cp.zeros_like(q)
    lse = cp.zeros(q.shape[:2], cp.float32)
    if q.size:
        source = flash_cuda_program(q.shape[2])
        if source not in _CUDA_KERNELS:
            _CUDA_KERNELS[source] = cp.RawKernel(source, "flash_forward", options=("-std=c++17",))
        _CUDA_KERNELS[source](*flash_cuda_launch(q.shape[0], q.shape[1]), _flash_cuda_args(q, k, v, o, lse, causal))
    return o, lse


def attention_cupy_unfused(q: Any, k: Any, v: Any, causal: bool = False) -> Any:
    """Naive attention as CuPy expressions (cuBLAS matmuls, a materialised (G, Nq, Nk) matrix)."""
    cp = _cupy()
    s = cp.matmul(q, k.transpose(0, 2, 1)) * np.float32(1.0 / math.sqrt(q.shape[2]))
    if causal:
        s = cp.where(cp.asarray(causal_mask(q.shape[1], k.shape[1])), s, np.float32(-np.inf))
    s = cp.exp(s - s.max(axis=-1, keepdims=True))
    return cp.matmul(s / s.sum(axis=-1, keepdims=True), v)


def torch_sdpa_available() -> bool:
    """Whether PyTorch with CUDA is installed here (attention_torch_sdpa runs)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def attention_torch_sdpa(q: Any, k: Any, v: Any, causal: bool = False) -> Any:
    """PyTorch's scaled_dot_product_attention (its fused kernels; float32 here) on CuPy arrays q (G, Nq, d),
    k, v (G, Nk, d), shared with PyTorch through DLPack (no copy); the G groups are its heads. The
    reference the course's tiled CUDA kernel is measured against. Needs PyTorch with CUDA."""
    if not torch_sdpa_available():
        raise RuntimeError("attention_torch_sdpa: needs PyTorch with CUDA (torch.cuda.is_available() is False here, "
                           "or torch is not installed)")
    import torch
    import torch.nn.functional as F

    cp = _cupy()
    check_qkv(q, k, v, "attention_torch_sdpa")
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        raise ValueError(f"attention_torch_sdpa: expected q (G, Nq, d), k (G, Nk, d), v (G, Nk, dv), got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    qt, kt, vt = (torch.from_dlpack(cp.ascontiguousarray(a))[None] for a in (q, k, v))
    return cp.from_dlpack(F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)[0])

# %%
#| export
#| exercise 9.8
def flash_cuda_source() -> str:
    """CUDA C of `flash_forward(q, k, v, o, lse, nq, nk, causal, scale)`: tiled attention forward, one
    block of BLOCK_Q threads per (query tile blockIdx.x, head blockIdx.y), K and V tiles of BLOCK_K
    rows in shared memory. q, o (G, nq, HEAD_DIM), k, v (G, nk, HEAD_DIM), lse (G, nq), float32
    row-major; HEAD_DIM, BLOCK_Q, BLOCK_K are #defined by flash_cuda_program."""
    ### BEGIN SOLUTION
    return r"""
extern "C" __global__ void flash_forward(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, float* __restrict__ o,
                                         float* __restrict__ lse, int nq, int nk, int causal, float scale) {
    __shared__ float k_tile[BLOCK_K][HEAD_DIM];
    __shared__ float v_tile[BLOCK_K][HEAD_DIM];
    const float NEG_INF = __int_as_float(0xff800000);
    const int head = blockIdx.y;
    const int row = blockIdx.x * BLOCK_Q + threadIdx.x;    // this thread's query row
    const bool active = row < nq;
    const int offset = nk - nq;
    const float* qh = q + (size_t)head * nq * HEAD_DIM;
    const float* kh = k + (size_t)head * nk * HEAD_DIM;
    const float* vh = v + (size_t)head * nk * HEAD_DIM;

    float q_row[HEAD_DIM], acc[HEAD_DIM];
#pragma unroll
    for (int c = 0; c < HEAD_DIM; ++c) {
        q_row[c] = active ? qh[(size_t)row * HEAD_DIM + c] * scale : 0.0f;
        acc[c] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    const int row_end = causal ? min(nk, row + offset + 1) : nk;            // keys this row sees
    const int last_row = min(nq, (int)(blockIdx.x + 1) * BLOCK_Q) - 1;
    const int block_end = causal ? min(nk, last_row + offset + 1) : nk;     // keys any row sees

    for (int j0 = 0; j0 < block_end; j0 += BLOCK_K) {
        for (int t = threadIdx.x; t < BLOCK_K * HEAD_DIM; t += BLOCK_Q) {  // coalesced copy
            const int r = t / HEAD_DIM, c = t % HEAD_DIM, j = j0 + r;
            k_tile[r][c] = j < nk ? kh[(size_t)j * HEAD_DIM + c] : 0.0f;
            v_tile[r][c] = j < nk ? vh[(size_t)j * HEAD_DIM + c] : 0.0f;
        }
        __syncthreads();
        const int n = active ? min(BLOCK_K, row_end - j0) : 0;              // visible keys of the tile
        if (n > 0) {
            float s[BLOCK_K];
            float m_new = m;
            for (int jj = 0; jj < BLOCK_K; ++jj) {
                float dot = 0.0f;
#pragma unroll
                for (int c = 0; c < HEAD_DIM; ++c) dot += q_row[c] * k_tile[jj][c];
                s[jj] = jj < n ? dot : NEG_INF;
                m_new = fmaxf(m_new, s[jj]);
            }
            const float correction = expf(m - m_new);                       // 0 on the first tile
            l *= correction;
#pragma unroll
            for (int c = 0; c < HEAD_DIM; ++c) acc[c] *= correction;
            for (int jj = 0; jj < BLOCK_K; ++jj) {
                const float p = expf(s[jj] - m_new);                        // 0 for masked keys
                l += p;
#pragma unroll
                for (int c = 0; c < HEAD_DIM; ++c) acc[c] += p * v_tile[jj][c];
            }
            m = m_new;
        }
        __syncthreads();                                                    // before the next copy
    }
    if (active) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* orow = o + ((size_t)head * nq + row) * HEAD_DIM;
#pragma unroll
        for (int c = 0; c < HEAD_DIM; ++c) orow[c] = acc[c] * inv;
        lse[(size_t)head * nq + row] = l > 0.0f ? m + logf(l) : NEG_INF;
    }
}
"""
    ### END SOLUTION

# %% tags=["check"]
check("9.8")

# %% [markdown]
# The PTX shows the structure: loads from shared memory, two barriers, 16 KiB of shared memory at
# d = 64. Then the emulator runs the kernel on ragged sizes (70 queries in tiles of 64, 77 keys in
# tiles of 32, three heads).

# %% tags=["demo"]
from course.cuda_c import compile_ptx, ptx_stats

print(ptx_stats(compile_ptx(flash_cuda_program(64))))  # skips, saying why, where NVRTC cannot run (macOS)

# %% tags=["demo"]
q, k, v = (rng.standard_normal((3, n, 16)).astype(np.float32) for n in (70, 77, 77))
o_emu, lse_emu = flash_attention_emulated(q, k, v, causal=True)
o_ref, lse_ref = attention_np(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                              causal_mask(70, 77), return_lse=True)
print(f"emulated kernel vs float64 NumPy: max |o error| {np.abs(o_emu - o_ref).max():.1e}, "
      f"max |lse error| {np.abs(lse_emu - lse_ref).max():.1e}")

# %% [markdown]
# On a GPU: the kernel against unfused CuPy attention (cuBLAS for the two products, a
# materialised score matrix), float32, d = 64, causal, 16 heads.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
import cupy as cp
from minitorch.cupy_kernels import cuda_time_ms

sdpa = torch_sdpa_available()
print("PyTorch's scaled_dot_product_attention (float32, the same arrays through DLPack): "
      + ("beside" if sdpa else "not installed with CUDA here, no column"))
for n_ in (512, 1024, 2048, 4096):
    qg, kg, vg = (cp.random.standard_normal((16, n_, 64), dtype=cp.float32) for _ in range(3))
    o_gpu, _ = flash_attention_cuda(qg, kg, vg, causal=True)
    assert cp.allclose(o_gpu, attention_cupy_unfused(qg, kg, vg, causal=True), rtol=1e-3, atol=1e-4)
    t_f = cuda_time_ms(lambda: flash_attention_cuda(qg, kg, vg, causal=True))
    t_u = cuda_time_ms(lambda: attention_cupy_unfused(qg, kg, vg, causal=True))
    line = f"N = {n_:>4}: tiled kernel {t_f:7.3f} ms, unfused CuPy {t_u:7.3f} ms, unfused / tiled = {t_u / t_f:4.2f}"
    if sdpa:
        assert cp.allclose(attention_torch_sdpa(qg, kg, vg, causal=True), o_gpu, rtol=1e-3, atol=1e-4)
        t_s = cuda_time_ms(lambda: attention_torch_sdpa(qg, kg, vg, causal=True))
        line += f", SDPA {t_s:7.3f} ms, tiled / SDPA = {t_f / t_s:4.2f}"
    print(line)

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0) this cell
# printed: tiled kernel 0.298, 0.558, 1.346 and 3.200 ms at N = 512, 1024, 2048 and 4096 (16
# heads, d = 64, causal), unfused CuPy 0.348, 0.853, 2.854 and 9.868 ms: 1.17x, 1.53x, 2.12x and
# 3.08x. The gap grows with N because the unfused version writes and reads the score matrix: 16 x
# 4096² float32 is 1 GiB per pass at N = 4096. The SDPA column (PyTorch's fused attention on the
# same arrays, where PyTorch is installed) is the bar set by production kernels: FlashAttention-2
# reaches 50-73% of an A100's peak FLOP/s (Dao, 2023) with tensor cores, tiles in registers and warps
# splitting the queries, none of which this kernel has yet.

# %% [markdown]
# ## Summary and sources
#
# Attention's cost is two matrix products and a softmax over an N x N matrix; materialised, that
# matrix dominates memory and memory traffic. The online softmax turns the softmax's statistics
# into something that can be computed in one pass and merged in any order, which lets
# FlashAttention stream over key tiles in fast memory, keep only O(N) state, and recompute
# rather than store what its backward needs. The tiny GPT trained here on Python's help pages,
# with the reference attention or the tiled one, is the model lessons 10, 11 and 13 quantize,
# serve and split.
#
# What those lessons use, all documented in the modules (shapes, dtypes):
# - `minitorch.gpt`: `load_tiny_gpt(attention="reference") -> (GPT, CharTokenizer)`,
#   `tiny_gpt_meta()`, `load_corpus()`, `pydoc_corpus()`, `CORPUS_SHA256`, `split_ids`, `get_batch`,
#   `eval_windows`, `evaluate_loss(model, ids, n_windows=None)`, `EVAL_WINDOWS`, `GPTConfig`, `GPT` (and its
#   parts `Block`, `CausalSelfAttention` with `attend(q, k, v)`, `MLP`, `LayerNorm`, `Embedding`),
#   `state_dict()` / `load_state_dict()` (lesson 03), `save_checkpoint`, `load_checkpoint`,
#   `generate`, `train_gpt`, `layer_norm` / `layer_norm_np`, `gelu` / `gelu_np`.
# - `minitorch.attention`: `attention` (autograd) and `attention_np` (NumPy, optionally with the
#   logsumexp), `causal_mask`, `padding_mask`, `split_heads`, `merge_heads`, `merge_attention`,
#   `flash_attention` (autograd), `flash_attention_forward`, `flash_attention_backward`, and the
#   CUDA C kernel's `flash_attention_cuda` / `flash_attention_emulated`.
#
# - A. Vaswani et al., *Attention Is All You Need*, NeurIPS 2017.
# - A. Radford et al., *Improving Language Understanding by Generative Pre-Training*, 2018, and
#   *Language Models are Unsupervised Multitask Learners*, 2019 (GPT, GPT-2).
# - A. Karpathy, *nanoGPT* (github.com/karpathy/nanoGPT), the model's shape and naming.
# - J. L. Ba, J. R. Kiros, G. E. Hinton, *Layer Normalization*, 2016; R. Xiong et al., *On Layer
#   Normalization in the Transformer Architecture*, ICML 2020 (pre-norm).
# - D. Hendrycks, K. Gimpel, *Gaussian Error Linear Units (GELUs)*, 2016.
# - O. Press, L. Wolf, *Using the Output Embedding to Improve Language Models*, EACL 2017.
# - J. Kaplan et al., *Scaling Laws for Neural Language Models*, 2020 (FLOPs per token).
# - M. Milakov, N. Gimelshein, *Online normalizer calculation for softmax*, 2018.
# - T. Dao, D. Y. Fu, S. Ermon, A. Rudra, C. Re, *FlashAttention: Fast and Memory-Efficient Exact
#   Attention with IO-Awareness*, NeurIPS 2022.
# - T. Dao, *FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning*, 2023;
#   T. Dao, D. Haziza, F. Massa, G. Sizov, *Flash-Decoding for long-context inference*, 2023.


# %%
#| export
#| given
from minitorch.checks import (Array, Attrs, Count, Instance, Optional, Size, TensorLike,  # noqa: E402
                              validate_public)

_KERNEL_IO = Array(ndim=3, dtypes=KERNEL_DTYPES, axes="(G, N, d)")
_CUDA_IO = Array(ndim=3, dtypes=np.float32, axes="(G, N, d)")
_ATTENTION_RULES = {
    "check_qkv": {name: Attrs("shape", "dtype") for name in "qkv"},
    "no_keys": {name: Instance(Tensor, must="a minitorch Tensor") for name in "qkv"},
    "attention": {name: TensorLike(dtypes="float") for name in "qkv"},
    "attention_np": {name: Array(dtypes="float") for name in "qkv"},
    "attention_flops": {**{name: Count for name in ("b", "h", "nq", "nk", "d")}, "dv": Optional(Count)},
    "attention_score_bytes": {**{name: Count for name in ("b", "h", "nq", "nk")}, "itemsize": Size},
    "column_blocks": {"x": Array(ndim=2), "width": Size},
    "online_softmax": {"x": Array(ndim=2)},
    "online_softmax_stats": {"blocks": Instance(Iterable, must="an iterable of (rows, w) arrays")},
    "flash_attention_forward": {**{name: _KERNEL_IO for name in "qkv"}, "threads": Optional(Size)},
    "flash_attention_backward": {**{name: _KERNEL_IO for name in ("q", "k", "v", "o", "do")},
                                 "lse": Array(ndim=2, dtypes=KERNEL_DTYPES, axes="(G, Nq)"), "threads": Optional(Size)},
    "flash_attention": {name: TensorLike(dtypes=KERNEL_DTYPES) for name in "qkv"},
    "flash_cuda_program": {"head_dim": Size},
    "flash_cuda_launch": {"g": Size, "nq": Size},
    "flash_attention_emulated": {name: _CUDA_IO for name in "qkv"},
    "flash_attention_cuda": {name: _CUDA_IO for name in "qkv"},
    "attention_cupy_unfused": {name: _CUDA_IO for name in "qkv"},
    "attention_torch_sdpa": {name: _CUDA_IO for name in "qkv"},
}
# In the lesson's notebook one namespace holds both modules, and validate_public wraps a function once:
# there the gpt cell below applies both modules' rules.
if __name__ == "minitorch.attention":
    validate_public(globals(), _ATTENTION_RULES)


# %%
#| export gpt
#| given
from minitorch.checks import (Array, Attrs, Choice, Count, Fraction, Instance, Optional, Positive, Size,  # noqa: E402
                              Unchecked, validate_public)

_IDS = Array(ndim=1, dtypes="int")
_FLOATS = Array(dtypes="float")
_TENSOR = Instance(Tensor, must="a minitorch Tensor")
_WINDOWS = Array(ndim=2, dtypes="int", axes="(B, T)")
validate_public(globals(), {**globals().get("_ATTENTION_RULES", {}), **{
    "split_ids": {"ids": _IDS, "val_fraction": Fraction},
    "get_batch": {"ids": _IDS, "batch_size": Size, "block_size": Size},
    "eval_windows": {"ids": _IDS},
    "bigram_loss": {"train_ids": _IDS, "eval_ids": _IDS, "vocab_size": Size, "alpha": Positive},
    "layer_norm": {"x": _TENSOR, "weight": _TENSOR, "bias": _TENSOR, "eps": Positive},
    # the NumPy LayerNorm runs on lesson 11's inner loop: layer_norm_forward checks in its body
    "layer_norm_np": {"x": Unchecked(), "weight": Unchecked(), "bias": Unchecked(), "eps": Unchecked()},
    "gelu": {"x": _TENSOR},
    "layer_norm_forward": {"x": Unchecked(), "weight": Unchecked(), "bias": Unchecked(), "eps": Unchecked()},
    "check_sampling": {n: Unchecked() for n in ("what", "max_new_tokens", "temperature", "top_k")},  # its job
    "layer_norm_backward": {"g": _FLOATS, "xhat": _FLOATS, "rstd": _FLOATS, "weight": _FLOATS},
    "Embedding": {"num": Size, "dim": Size},
    "LayerNorm": {"dim": Size, "eps": Positive},
    "LayerNorm.forward": {"x": _TENSOR},
    "evaluate_loss": {"model": Attrs("config", "eval", "train"), "ids": _IDS, "n_windows": Optional(Size),
                      "batch_size": Size},
    "load_checkpoint": {"attention": Choice(*ATTENTION_IMPLS)},
    "load_tiny_gpt": {"attention": Choice(*ATTENTION_IMPLS)},
    "GPT": {"seed": Count},
    "GPT.forward": {"idx": _WINDOWS, "targets": Optional(_WINDOWS)},
    "lr_schedule": {"step": Count, "steps": Size, "lr": Positive, "warmup": Count, "min_ratio": Fraction},
    "train_gpt": {"train_ids": _IDS, "steps": Size, "batch_size": Size, "lr": Positive, "warmup": Count, "seed": Count,
                  "val_ids": Optional(_IDS), "eval_every": Size, "eval_windows": Optional(Size)},
    "generate": {"idx": Array(ndim=(1, 2), dtypes="int", axes="(B, t) or (t,)")},
}})
