# %% [markdown]
# # Lesson 18: sparsity: pruning and sparse kernels
#
# A weight that is zero is a multiply-add nobody has to do and a number nobody has to store.
# Trained networks tolerate losing many of their weights: Han et al. (2015, 2016) removed 89-92%
# of the weights of AlexNet and VGG-16 and retrained the rest without losing accuracy, and the
# lottery ticket hypothesis (Frankle and Carbin 2019) found sparse subnetworks that train as well
# as the whole. But a zero saves time only if the format that stores the matrix and the kernel
# that multiplies it can skip it, and that is where most sparsity is lost. This lesson does both
# halves on lesson 09's tiny GPT and on this machine:
#
# 1. **Magnitude pruning** (18.1): drop the smallest weights, per layer or with one threshold for
#    the whole model, and keep them dropped while fine-tuning (the mask on the weights *and* the
#    gradients, and again after every optimizer step).
# 2. **Structured pruning** (18.2): drop whole attention heads and MLP channels. The model gets
#    smaller and stays dense, so every dense kernel runs it faster.
# 3. **Pruning a language model in one shot** (18.3): Wanda (Sun et al. 2024) weighs each weight by
#    the size of the inputs it multiplies, compared within each output; against plain magnitude,
#    loss against sparsity, and iterative pruning with fine-tuning.
# 4. **CSR and a sparse-dense matmul** (18.4) in Numba, against dense BLAS, with the density below
#    which sparsity pays measured on this machine.
# 5. **2:4 semi-structured sparsity** (18.5): two of every four weights, stored as values plus
#    2-bit positions, the format the sparse tensor cores of NVIDIA's Ampere and later GPUs read
#    (Mishra et al. 2021); a Numba kernel that reads the compressed form, its bytes and speed.
# 6. **The arithmetic on a GPU**: why unstructured sparsity rarely pays there, and 2:4 does.
#
# The course's reference version of this lesson is `minitorch/sparse.py`. Background: the
# hardware side in [sparsity](../hardware_notes/sparsity.md), tensor cores in
# [gpu](../hardware_notes/gpu.md#tensor-cores), the roofline in
# [roofline](../hardware_notes/roofline.md). MIT 6.5940 (Han) teaches pruning and sparsity in labs
# on GPUs with PyTorch; here every mask, format and kernel is your own, on a laptop. Lesson 19
# goes on to the other way of making a big model cheap: adapting it with a few trained weights.
#
# Conventions: a Linear's weight is (in, out), as in lesson 03, and a mask is a boolean array of
# its shape, True where the weight is kept. A sparse matrix A (M, K) multiplies a dense B (K, N);
# for a layer, A is the weight transposed (one row per output) and B the activations transposed
# (one column per token).

# %%
import copy
import os
import time

import matplotlib.pyplot as plt
import numpy as np

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %%
#| default_exp sparse
#| export
"""minitorch.sparse: pruning (magnitude per layer and global, structured heads and MLP channels,
Wanda), masked fine-tuning, the CSR and 2:4 formats with their Numba sparse-dense matmul kernels,
timings against dense BLAS, and a model of sparse matrix products on a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any, Callable, NamedTuple

import numpy as np
from numba import njit

from minitorch.checks import check_int, check_number
from minitorch.gpt import get_batch
from minitorch.nn import Module
from minitorch.optim import Adam
from minitorch.kv_cache import GPTWeights


def _check_sparsity(what: str, sparsity: Any) -> float:
    """`sparsity` as a float in [0, 1], or the error naming it."""
    return check_number(what, "sparsity", sparsity, 0.0, 1.0)


def _n_pruned(sparsity: float, n: int) -> int:
    """How many of n weights a sparsity prunes: round(sparsity * n), Python's round (halves to
    even); 0.3 of 10 is 3 although 0.3 * 10 is 3.0000000000000004 in floating point."""
    return int(round(sparsity * n))

# %% [markdown]
# ## 1. Magnitude pruning
#
# The oldest rule is still the baseline: a small weight contributes little, so drop the weights
# of smallest absolute value (LeCun et al. 1990 used second derivatives; Han et al. 2015 showed
# plain magnitude works if you retrain afterwards). At **sparsity** s a matrix of n weights loses
# `round(s n)` of them. Two choices:
#
# - **per layer**: every matrix loses the same fraction;
# - **global**: one threshold for all the matrices together, so a layer whose weights are small
#   loses more of them than one whose weights are large (Han et al. prune per layer with a
#   sensitivity analysis; Frankle and Carbin use global pruning for their larger networks).
#
# A pruned weight must stay zero while the rest fine-tune. Masking the forward pass is not enough
# to keep the weight array honest, and masking the gradient is not enough either: Adam's momentum
# keeps moving a weight whose gradient is now zero, by the momentum it built up before the
# pruning. So the mask goes on the weights and on their gradients, and again on the weights after
# every optimizer step (`finetune` below calls it at both points). Ties (equal |w|, as in a
# quantized or freshly initialised matrix) are broken by the flat index in C order: the lower
# index is pruned first, which is what a stable sort of |w| gives.
#
# **Exercise 18.1.** Write `magnitude_mask` (one array), `global_magnitude_masks` (one threshold
# for a dict of arrays: ties across arrays go to the array earlier in the dict, then the lower
# index; magnitudes are compared in float64 so float32 and float64 arrays mix) and `apply_masks_`
# (in place on a model's parameters and on their gradients when they have one; a KeyError naming
# a mask's name that is not a parameter, a ValueError naming both shapes when they differ).

# %%
#| export
#| exercise 18.1
def magnitude_mask(w: np.ndarray, sparsity: float) -> np.ndarray:
    """The mask (bool, w's shape, True = kept) that prunes the round(sparsity * w.size) entries of
    smallest |w|; among equal |w| the lower flat (C-order) index is pruned first. w: a float array
    of any shape (size 0 gives an empty mask); sparsity in [0, 1]."""
    ### BEGIN SOLUTION
    w = np.asarray(w)
    sparsity = _check_sparsity("magnitude_mask", sparsity)
    keep = np.ones(w.size, bool)
    order = np.argsort(np.abs(w), axis=None, kind="stable")
    keep[order[:_n_pruned(sparsity, w.size)]] = False
    return keep.reshape(w.shape)
    ### END SOLUTION


def global_magnitude_masks(weights: dict[str, np.ndarray], sparsity: float) -> dict[str, np.ndarray]:
    """One threshold for all: {name: mask} pruning the round(sparsity * total size) entries of
    smallest |w| over every array of `weights` together (compared in float64). Ties: the array
    earlier in the dict first, then the lower flat index. The masks keep the dict's order."""
    ### BEGIN SOLUTION
    sparsity = _check_sparsity("global_magnitude_masks", sparsity)
    names = list(weights)
    arrays = [np.asarray(weights[n]) for n in names]
    flat = np.concatenate([np.abs(a.astype(np.float64)).ravel() for a in arrays]) if arrays else np.zeros(0)
    keep = np.ones(flat.size, bool)
    keep[np.argsort(flat, kind="stable")[:_n_pruned(sparsity, flat.size)]] = False
    out, start = {}, 0
    for name, a in zip(names, arrays):
        out[name] = keep[start:start + a.size].reshape(a.shape)
        start += a.size
    return out
    ### END SOLUTION


def apply_masks_(model: Module, masks: dict[str, np.ndarray]) -> None:
    """Prune in place: for every name in masks, the parameter of that name (model.named_parameters())
    is multiplied by its mask, and so is its gradient if it has one (.grad not None). KeyError naming
    a name that is no parameter; ValueError naming both shapes when a mask's shape is not its
    parameter's. The parameters keep their dtype."""
    ### BEGIN SOLUTION
    params = dict(model.named_parameters())
    for name, mask in masks.items():
        if name not in params:
            raise KeyError(f"apply_masks_: the model has no parameter {name!r}")
        p, mask = params[name], np.asarray(mask)
        if mask.shape != tuple(p.shape):
            raise ValueError(f"apply_masks_: mask {name!r} has shape {mask.shape}, the parameter {tuple(p.shape)}")
        p.data *= mask
        if p.grad is not None:
            p.grad.data *= mask
    ### END SOLUTION

# %% tags=["check"]
check("18.1")

# %% [markdown]
# The machinery around the exercise (given): `prunable_weights` lists what pruning acts on, the
# matrices of the attention and MLP Linears (not the embeddings, whose rows are looked up one per
# character, nor the LayerNorms: the usual choice, Wanda's and SparseGPT's included), and
# `finetune` is lesson 09's training loop with two hooks, `on_grads` after the backward pass and
# `on_step` after the optimizer's step.

# %%
#| export
#| given
def prunable_weights(model: Module) -> dict[str, np.ndarray]:
    """{name: array} of the 2-D parameters inside model.blocks (a GPT's attention and MLP weights),
    in named_parameters() order. The arrays are the parameters' own, not copies."""
    return {name: p.data for name, p in model.named_parameters() if name.startswith("blocks.") and p.ndim == 2}


def mask_sparsity(masks: dict[str, np.ndarray]) -> float:
    """The fraction of entries the masks prune, over all of them (0.0 for no entries)."""
    total = sum(int(np.size(m)) for m in masks.values())
    kept = sum(int(np.count_nonzero(m)) for m in masks.values())
    return (total - kept) / total if total else 0.0


def lm_step_loss(model: Module, x: np.ndarray, y: np.ndarray) -> Any:
    """The language-model loss of a GPT on a batch (what finetune minimises by default)."""
    return model(x, y)[1]


def finetune(model: Module, train_ids: np.ndarray, steps: int, params: list | None = None, batch_size: int = 16,
             lr: float = 1e-3, seed: int = 0, on_grads: Callable | None = None, on_step: Callable | None = None,
             loss_fn: Callable | None = None) -> list[float]:
    """Train `model` in place with Adam over `params` (default: all its parameters) for `steps` steps
    on random windows of train_ids (get_batch with np.random.default_rng(seed)). Each step: forward,
    loss_fn(model, x, y) (default lm_step_loss), zero_grad, backward, on_grads(), optimizer step,
    on_step(). Returns the loss of each step."""
    vocab = model.config.vocab_size
    if train_ids.size and (train_ids.min() < 0 or train_ids.max() >= vocab):
        raise ValueError(f"finetune: train_ids must hold ids in [0, vocab_size={vocab}), got values "
                         f"{train_ids.min()}..{train_ids.max()}")
    rng = np.random.default_rng(seed)
    params = list(model.parameters()) if params is None else list(params)
    optimizer = Adam(params, lr=lr)
    loss_fn = lm_step_loss if loss_fn is None else loss_fn
    losses = []
    model.train()
    for _ in range(steps):
        x, y = get_batch(train_ids, batch_size, model.config.block_size, rng)
        loss = loss_fn(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        if on_grads is not None:
            on_grads()
        optimizer.step()
        if on_step is not None:
            on_step()
        losses.append(loss.item())
    model.eval()
    return losses

# %% [markdown]
# The shipped tiny GPT, pruned in one shot at 50%, per layer and globally. The global threshold
# takes more from the layers whose weights are small: the cell prints each matrix's share. Then
# the loss on the first windows of the validation text (`EVAL` windows of 64 characters; the cell
# prints how many), before any fine-tuning.

# %% tags=["demo"]
from minitorch.gpt import evaluate_loss, load_corpus, load_tiny_gpt, split_ids

tiny, tok = load_tiny_gpt()
train_ids, val_ids = split_ids(tok.encode(load_corpus()))
EVAL = 8 if SMALL else 64


def pruned_copy(model, masks):
    clone = copy.deepcopy(model)
    apply_masks_(clone, masks)
    return clone


base_loss = evaluate_loss(tiny, val_ids, EVAL)
weights = prunable_weights(tiny)
per_layer = {name: magnitude_mask(w, 0.5) for name, w in weights.items()}
global_ = global_magnitude_masks(weights, 0.5)
print(f"unpruned: val loss {base_loss:.3f} on {EVAL} windows; {sum(w.size for w in weights.values()):,} prunable "
      f"weights of {tiny.num_parameters():,}")
print(f"50% per layer: val loss {evaluate_loss(pruned_copy(tiny, per_layer), val_ids, EVAL):.3f}")
print(f"50% global:    val loss {evaluate_loss(pruned_copy(tiny, global_), val_ids, EVAL):.3f}")
print("global threshold, share pruned per matrix:")
for name, m in global_.items():
    print(f"  {name:<24} {1 - m.mean():.2f}   (mean |w| {np.abs(weights[name]).mean():.4f})")

# %% [markdown]
# ## 2. Structured pruning: heads and MLP channels
#
# Unstructured zeros leave the matrix its shape: a dense kernel multiplies them anyway. Remove a
# whole **MLP channel** (hidden unit j: column j of the first weight, entry j of its bias, row j
# of the second weight) or a whole **attention head** (its columns of q, k and v, their biases,
# and its rows of the output projection) and the model is simply smaller and still dense: every
# dense kernel, BLAS included, runs it faster by the fraction removed. The price is coarser
# choices: a channel goes with all its weights, good and bad (Michel et al. 2019 found many
# heads can go after training; Ma et al. 2023, LLM-Pruner, prunes channels and heads of LLMs).
#
# Which to remove? The simplest score of a structure is the size of what writes it times the
# size of what reads it:
#
# - channel j: `||W_fc[:, j]|| * ||W_proj[j, :]||` (L2 norms);
# - head h: `||W_v[:, head h]||_F * ||W_proj[head h, :]||_F`. The values and the output projection
#   set how much a head adds to the residual stream; q and k only decide where it looks.
#
# Each layer keeps its `n_keep` best (ties: the lower index), in their original order, and every
# layer keeps the same number of heads (`n_head` stays one number per model). This works on
# lesson 11's NumPy weights (`GPTWeights`, whose `gpt_forward` reads the widths from the arrays),
# not on the autograd model: the pruned model is for inference.
#
# **Exercise 18.2.** Write `channel_scores`, `head_scores`, `prune_mlp` and `prune_heads`. Each
# returns new `GPTWeights` (`dataclasses.replace` of the old with a new params dict) and leaves
# the old one unchanged; `prune_heads` sets `n_head` and `n_kv_head` to `n_keep` and needs a model
# without grouped K/V heads (`n_kv_head == n_head`). A ValueError names `n_keep` outside
# [1, what there is]. Scores are float64; the weights keep their dtype.

# %%
#| export
#| exercise 18.2
def channel_scores(w_in: np.ndarray, w_out: np.ndarray) -> np.ndarray:
    """Importance of the H hidden channels between w_in (C, H) and w_out (H, C): float64 (H,),
    score_j = ||w_in[:, j]||_2 * ||w_out[j, :]||_2."""
    ### BEGIN SOLUTION
    w_in, w_out = np.asarray(w_in, np.float64), np.asarray(w_out, np.float64)
    if w_in.ndim != 2 or w_out.ndim != 2 or w_in.shape[1] != w_out.shape[0]:
        raise ValueError(f"channel_scores: need w_in (C, H) and w_out (H, C), got {w_in.shape} and {w_out.shape}")
    return np.sqrt((w_in * w_in).sum(axis=0)) * np.sqrt((w_out * w_out).sum(axis=1))
    ### END SOLUTION


def head_scores(w_v: np.ndarray, w_o: np.ndarray, n_head: int) -> np.ndarray:
    """Importance of n_head heads from the value weight w_v (C, n_head * hd) and the output
    projection w_o (n_head * hd, C): float64 (n_head,), score_h = ||w_v[:, h hd:(h+1) hd]||_F *
    ||w_o[h hd:(h+1) hd, :]||_F."""
    ### BEGIN SOLUTION
    w_v, w_o = np.asarray(w_v, np.float64), np.asarray(w_o, np.float64)
    n_head = check_int("head_scores", "n_head", n_head, 1)
    if w_v.ndim != 2 or w_o.ndim != 2 or w_v.shape[1] != w_o.shape[0] or w_v.shape[1] % n_head:
        raise ValueError(f"head_scores: need w_v (C, n_head * hd) and w_o (n_head * hd, C) with n_head={n_head}, got "
                         f"{w_v.shape} and {w_o.shape}")
    hd = w_v.shape[1] // n_head
    v = w_v.reshape(w_v.shape[0], n_head, hd)
    o = w_o.reshape(n_head, hd, w_o.shape[1])
    return np.sqrt((v * v).sum(axis=(0, 2))) * np.sqrt((o * o).sum(axis=(1, 2)))
    ### END SOLUTION


def prune_mlp(W: GPTWeights, n_keep: int) -> GPTWeights:
    """W with every layer's MLP cut to its n_keep best channels by channel_scores(fc.weight,
    proj.weight) (ties: the lower index), in increasing index order: fc.weight's columns, fc.bias's
    entries and proj.weight's rows. A new GPTWeights; W is not modified."""
    ### BEGIN SOLUTION
    params = dict(W.params)
    for i in range(W.n_layer):
        pre = f"blocks.{i}.mlp."
        fc, proj = params[pre + "fc.weight"], params[pre + "proj.weight"]
        n_keep = check_int("prune_mlp", "n_keep", n_keep, 1, fc.shape[1])
        keep = np.sort(np.argsort(-channel_scores(fc, proj), kind="stable")[:n_keep])
        params[pre + "fc.weight"] = fc[:, keep]
        params[pre + "fc.bias"] = params[pre + "fc.bias"][keep]
        params[pre + "proj.weight"] = proj[keep]
    return replace(W, params=params)
    ### END SOLUTION


def prune_heads(W: GPTWeights, n_keep: int) -> GPTWeights:
    """W with every layer cut to its n_keep best heads by head_scores(attn.v.weight, attn.proj.weight,
    n_head) (ties: the lower index), in increasing order: those heads' columns of attn.q, attn.k and
    attn.v (weights and biases) and rows of attn.proj.weight; n_head = n_kv_head = n_keep. W must have
    n_kv_head == n_head (ValueError otherwise). A new GPTWeights; W is not modified."""
    ### BEGIN SOLUTION
    if W.n_kv_head != W.n_head:
        raise ValueError(f"prune_heads: needs n_kv_head == n_head, got n_head={W.n_head}, n_kv_head={W.n_kv_head}")
    n_keep = check_int("prune_heads", "n_keep", n_keep, 1, W.n_head)
    params = dict(W.params)
    for i in range(W.n_layer):
        pre = f"blocks.{i}.attn."
        hd = params[pre + "v.weight"].shape[1] // W.n_head
        scores = head_scores(params[pre + "v.weight"], params[pre + "proj.weight"], W.n_head)
        heads = np.sort(np.argsort(-scores, kind="stable")[:n_keep])
        cols = (heads[:, None] * hd + np.arange(hd)).ravel()
        for name in ("q", "k", "v"):
            params[pre + name + ".weight"] = params[pre + name + ".weight"][:, cols]
            params[pre + name + ".bias"] = params[pre + name + ".bias"][cols]
        params[pre + "proj.weight"] = params[pre + "proj.weight"][cols]
    return replace(W, params=params, n_head=n_keep, n_kv_head=n_keep)
    ### END SOLUTION

# %% tags=["check"]
check("18.2")

# %% [markdown]
# What structure costs and what it buys: the shipped model with its MLPs cut from 256 channels
# and its attention from 4 heads, the loss on the validation windows and the time of one forward
# pass over a batch of them, in float32 (lesson 11's `gpt_forward`; the cell prints the
# threads and the machine's load). The smaller model is faster with no special kernel, though
# less than in proportion to the weights removed (the embeddings, the output layer, attention
# itself and Python's overhead per layer stay), and the loss pays at once: norms are a crude
# guide to what a channel does, and no fine-tuning follows here.

# %% tags=["demo"]
from minitorch.bench import load_report
from minitorch.gpt import eval_windows
from minitorch.kv_cache import gpt_forward, gpt_weights, lm_loss

W32 = gpt_weights(tiny, np.float32)
vx, vy = eval_windows(val_ids, 64, EVAL)
n_linear = sum(v.size for k, v in W32.params.items() if k.startswith("blocks.") and v.ndim == 2)


def best_forward(W, reps=5 if SMALL else 20):
    """Best time of one forward pass over 8 windows (best of reps: the least disturbed run)."""
    gpt_forward(W, vx[:8])
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        gpt_forward(W, vx[:8])
        best = min(best, time.perf_counter() - t0)
    return best


print(load_report())
variants = [("full model", W32),
            *[(f"MLP {n} of 256 channels", prune_mlp(W32, n)) for n in (192, 128, 64)],
            *[(f"{n} of 4 heads", prune_heads(W32, n)) for n in (3, 2)],
            ("2 heads, MLP 128", prune_mlp(prune_heads(W32, 2), 128))]
times = {label: best_forward(Wp) for label, Wp in variants}
for label, Wp in variants:
    size = sum(v.size for k, v in Wp.params.items() if k.startswith("blocks.") and v.ndim == 2)
    print(f"{label:>24}: {size / n_linear:5.1%} of the block weights, val loss {lm_loss(Wp, vx, vy):.3f}, "
          f"forward of 8 x 64 characters {times[label] * 1e3:5.2f} ms "
          f"({times['full model'] / times[label]:.2f}x the full model's speed)")

# %% [markdown]
# ## 3. Pruning a language model in one shot: Wanda against magnitude
#
# Magnitude ignores what a weight multiplies. In a language model a few input features are much
# larger than the rest (the outliers of lesson 10's LLM.int8), and a small weight on such a
# feature can matter more than a large one on a quiet feature. **Wanda** ("pruning by weights and
# activations", Sun et al. 2024) scores weight (i, j) of a layer y = x W by
#
# $$S_{ij} = |W_{ij}| \cdot \lVert X_{:, i} \rVert_2,$$
#
# the L2 norm of input feature i over a few calibration tokens X (T, in), and compares the scores
# **within each output** j: every output keeps the same number of inputs. No retraining, no second
# derivatives (SparseGPT, Frantar and Alistarh 2023, reconstructs each layer with them, at more
# cost); a forward pass over calibration text is all it needs.
#
# **Exercise 18.3.** Write `input_norms` (float64; T = 0 gives zeros) and `wanda_mask`: prune
# round(sparsity x in) weights of every output column, the smallest scores first, ties to the
# lower input index.

# %%
#| export
#| exercise 18.3
def input_norms(x: np.ndarray) -> np.ndarray:
    """The L2 norm of each input feature over the calibration tokens: x (T, in) -> float64 (in,),
    norms[i] = sqrt(sum_t x[t, i]^2) (zeros when T = 0)."""
    ### BEGIN SOLUTION
    x = np.asarray(x, np.float64)
    if x.ndim != 2:
        raise ValueError(f"input_norms: x must be (T, in), got shape {x.shape}")
    return np.sqrt((x * x).sum(axis=0))
    ### END SOLUTION


def wanda_mask(w: np.ndarray, norms: np.ndarray, sparsity: float) -> np.ndarray:
    """Wanda's mask for a layer y = x @ w, w (in, out): scores |w[i, j]| * norms[i] (norms (in,),
    from input_norms), and in every output column j the round(sparsity * in) smallest scores are
    pruned (ties: the lower i first). bool (in, out), True = kept."""
    ### BEGIN SOLUTION
    w, norms = np.asarray(w), np.asarray(norms, np.float64)
    sparsity = _check_sparsity("wanda_mask", sparsity)
    if w.ndim != 2 or norms.shape != (w.shape[0],):
        raise ValueError(f"wanda_mask: need w (in, out) and norms (in,), got {w.shape} and {norms.shape}")
    scores = np.abs(w.astype(np.float64)) * norms[:, None]
    keep = np.ones(w.shape, bool)
    order = np.argsort(scores, axis=0, kind="stable")[:_n_pruned(sparsity, w.shape[0])]
    np.put_along_axis(keep, order, False, axis=0)
    return keep
    ### END SOLUTION

# %% tags=["check"]
check("18.3")

# %% [markdown]
# Calibration: the inputs of every Linear while the model reads a few training windows (lesson
# 10's `capture_inputs`). Then loss against sparsity for three one-shot rules, no fine-tuning:
# magnitude per layer, magnitude compared within each output (Wanda's grouping without the
# activations) and Wanda. The cell prints the calibration size and each point.

# %% tags=["demo"]
from minitorch.quant import capture_inputs

CALIB = 8 if SMALL else 32
cx, _ = eval_windows(train_ids, 64, CALIB)
inputs = capture_inputs(tiny, lambda m: m(cx))
norms = {name + ".weight": input_norms(x) for name, x in inputs.items()}
print(f"calibration: {CALIB} windows = {CALIB * 64} tokens; input norms of {len(norms)} Linears")
ratio = {name: n.max() / np.median(n) for name, n in norms.items() if name in weights}
print("largest / median input norm per layer:", {k.replace("blocks.", "").replace(".weight", ""): round(float(v), 1)
                                               for k, v in ratio.items()})

rules = {
    "magnitude, per layer": lambda name, w, s: magnitude_mask(w, s),
    "magnitude, per output": lambda name, w, s: wanda_mask(w, np.ones(w.shape[0]), s),
    "Wanda": lambda name, w, s: wanda_mask(w, norms[name], s),
}
SPARSITIES = [0.0, 0.3, 0.5, 0.7, 0.9] if SMALL else [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
curves = {label: [] for label in rules}
for s in SPARSITIES:
    for label, rule in rules.items():
        masks = {name: rule(name, w, s) for name, w in weights.items()}
        curves[label].append(evaluate_loss(pruned_copy(tiny, masks), val_ids, EVAL))
print("sparsity  " + "  ".join(f"{label:>22}" for label in rules))
for i, s in enumerate(SPARSITIES):
    print(f"{s:8.1f}  " + "  ".join(f"{curves[label][i]:22.3f}" for label in rules))

# %% [markdown]
# Read the table down a column: up to 30% the loss barely moves, past 50% it climbs steeply. Wanda
# is ahead of magnitude at moderate sparsity, by a little, and not at the extremes. The large gap
# Sun et al. report on LLaMA comes from what this model lacks: language models of billions of
# parameters have a few input features far larger than the rest (Dettmers et al. 2022, lesson 10's
# LLM.int8), so a weight's size alone misjudges what it contributes. The tiny GPT's largest input
# norm is only a few times the median (the cell prints the ratio per layer), so weighting by it
# changes little.

# %% [markdown]
# ### Iterative pruning with fine-tuning
#
# One shot is the cheap end. Han et al. and the lottery-ticket experiments prune **iteratively**:
# remove a little, fine-tune with the mask held, remove more. Here the shipped model goes up a
# schedule of sparsities by magnitude (per layer), with `STEPS` steps of fine-tuning on the
# training text after each cut, the masks applied by your `apply_masks_` through `finetune`'s
# hooks. The cell prints the schedule, the steps and the loss after each round; the plot puts it
# beside the one-shot curves. (With `MINITORCH_SMALL=1` it takes a few steps only: the loop
# working, not the recovery.)

# %% tags=["demo"]
STEPS = 4 if SMALL else 150
SCHEDULE = [0.5, 0.7, 0.9] if SMALL else [0.3, 0.5, 0.6, 0.7, 0.8, 0.9]
model_it = copy.deepcopy(tiny)
iterative = []
t0 = time.perf_counter()
for s in SCHEDULE:
    masks = {name: magnitude_mask(w, s) for name, w in prunable_weights(model_it).items()}
    apply_masks_(model_it, masks)
    finetune(model_it, train_ids, STEPS, batch_size=8 if SMALL else 16, lr=1e-3, seed=len(iterative),
             on_grads=lambda: apply_masks_(model_it, masks), on_step=lambda: apply_masks_(model_it, masks))
    actual = mask_sparsity({n: w != 0 for n, w in prunable_weights(model_it).items()})
    iterative.append(evaluate_loss(model_it, val_ids, EVAL))
    print(f"sparsity {s:.1f} (zeros held: {actual:.3f}), {STEPS} fine-tuning steps: val loss {iterative[-1]:.3f}")
print(f"{len(SCHEDULE)} rounds in {time.perf_counter() - t0:.0f} s")

fig, ax = plt.subplots(figsize=(7.5, 3.8))
for label, ys in curves.items():
    ax.plot(SPARSITIES, ys, "o-", ms=3, label=f"{label} (one shot)")
ax.plot(SCHEDULE, iterative, "s-", ms=4, color="k", label=f"magnitude, iterative, {STEPS} steps per round")
ax.axhline(base_loss, color="gray", ls=":", lw=1)
ax.set(xlabel="sparsity of the attention and MLP weights", ylabel=f"val loss (nats/char, {EVAL} windows)",
       ylim=(base_loss - 0.1, max(base_loss + 2.5, 1.0)))
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Held masks and a little training recover most of what one shot loses: compare the black squares
# with the one-shot curves at the same sparsity (at full size, 150 steps of 16 windows per round;
# the cell prints how long the rounds took). This is the classic recipe's point: what a pruned
# weight did, the others learn to do.

# %% [markdown]
# ## 4. CSR and a sparse-dense matmul
#
# To skip zeros the matrix has to be stored without them. **Compressed sparse row** (CSR) keeps,
# for a matrix A (M, K) with nnz nonzeros:
#
# - `data` (nnz,): the nonzero values, row after row, left to right;
# - `indices` (nnz,) int32: the column of each;
# - `indptr` (M + 1,) int64: row i's entries are `data[indptr[i]:indptr[i + 1]]`.
#
# A sparse-dense product C = A B (B dense (K, N)) walks each row's nonzeros and adds `a_ij` times
# row j of B to row i of C: `2 nnz N` flops instead of `2 M K N`, and the innermost loop runs
# along a row of B, contiguous, so it vectorises. What it cannot do is what makes BLAS fast: keep
# a tile of A in registers and reuse it (lesson 06). Each nonzero is loaded with its index and
# used for one row of B, and which rows of B are needed is known only at run time. So a sparse
# kernel does fewer flops at a lower rate, and pays only below some density.
#
# **Exercise 18.4.** Write `to_csr` (an entry is stored when it is not == 0, so -0.0 is not;
# `data` keeps A's dtype) and the Numba kernel `csr_matmul_kernel`, which adds A B into `out` (the
# wrapper `csr_matmul` below, given, checks the shapes and passes zeros). The kernel must read B
# only at the rows its nonzeros name: the tests trace its reads.

# %%
#| export
class CSR(NamedTuple):
    """A (M, K) in compressed sparse row form: indptr (M + 1,) int64, indices (nnz,) int32 (the
    columns, increasing within a row), data (nnz,) the values, shape (M, K)."""
    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    shape: tuple[int, int]

    @property
    def nnz(self) -> int:
        return int(self.data.shape[0])

    def nbytes(self) -> int:
        """Bytes stored: data, indices and indptr."""
        return int(self.data.nbytes + self.indices.nbytes + self.indptr.nbytes)

# %%
#| export
#| exercise 18.4
def to_csr(a: np.ndarray) -> CSR:
    """The CSR form of a 2-D array a (M, K): every entry that is not == 0, row by row, columns
    increasing; data in a's dtype, indices int32, indptr int64."""
    ### BEGIN SOLUTION
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"to_csr: a must be 2-D (M, K), got shape {a.shape}")
    rows, cols = np.nonzero(a)
    indptr = np.zeros(a.shape[0] + 1, np.int64)
    indptr[1:] = np.cumsum(np.bincount(rows, minlength=a.shape[0]))
    return CSR(indptr, cols.astype(np.int32), a[rows, cols], (int(a.shape[0]), int(a.shape[1])))
    ### END SOLUTION


@njit(cache=False)
def csr_matmul_kernel(indptr, indices, data, b, out):
    """out (M, N) += A @ b for A in CSR form (indptr, indices, data) and b (K, N): for each row i,
    for each of its nonzeros (j, a_ij), out[i, :] += a_ij * b[j, :]. Reads b only at the rows j
    that row i's nonzeros name."""
    ### BEGIN SOLUTION
    n = b.shape[1]
    for i in range(indptr.shape[0] - 1):
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            v = data[p]
            for col in range(n):
                out[i, col] += v * b[j, col]
    ### END SOLUTION


def csr_matmul(a: CSR, b: np.ndarray) -> np.ndarray:
    """A @ b for A in CSR form and a dense b (K, N): (M, N) in np.result_type(a.data, b), through
    csr_matmul_kernel (given: checks the shapes, passes zeros to accumulate into)."""
    m, k = a.shape
    b = np.asarray(b)
    if b.ndim != 2 or b.shape[0] != k:
        raise ValueError(f"csr_matmul: A is {a.shape}, so b must be ({k}, N), got shape {b.shape}")
    if a.indptr.shape != (m + 1,) or a.indices.shape != a.data.shape:
        raise ValueError(f"csr_matmul: indptr {a.indptr.shape}, indices {a.indices.shape} and data {a.data.shape} "
                         f"do not describe a CSR matrix of shape {a.shape}")
    out = np.zeros((m, b.shape[1]), np.result_type(a.data, b))
    csr_matmul_kernel(a.indptr, a.indices, a.data, np.ascontiguousarray(b), out)
    return out

# %% tags=["check"]
check("18.4")

# %% [markdown]
# Where it pays, measured: A (1024, 1024) at densities from 0.5% to 60% (random positions)
# times B (1024, 64), your kernel's algorithm against NumPy's dense product, one thread each.
# The timing runs in a **separate process** (`sparse_timings`, given): it runs the course's
# kernels (`minitorch.sparse`, the same algorithm as yours) with one Numba thread, and NumPy's
# OpenBLAS with one thread and with `OPENBLAS_CORETYPE` and `OPENBLAS_L2_SIZE` removed from its
# environment (some machines set them and they hold OpenBLAS back; a BLAS reads them only when it
# loads). Each kernel takes turns with the others, best of several runs. The cell prints the
# break-even density: below it the sparse kernel is faster.

# %%
#| export
#| given
BLAS_HANDICAPS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # unset in the timing process


def sparse_timings(m: int = 1024, k: int = 1024, n: int = 64, densities: tuple = (0.01, 0.05, 0.1, 0.2, 0.5),
                   rounds: int = 3, seed: int = 0, timeout: float = 300.0) -> dict[str, Any]:
    """Best seconds of C = A @ B, A (m, k) float32, B (k, n) float32, one thread each, measured in a
    child process (so that BLAS_HANDICAPS are unset before NumPy loads OpenBLAS, and BLAS and Numba
    get one thread): {"dense": NumPy's dense product, "csr": {density: csr_matmul at that density,
    random positions}, "sparse24": sparse24_matmul of A pruned 2:4, "csr24": csr_matmul of the same
    2:4 matrix, "env": what was unset, "load": the load average before}. k must be a multiple of 4."""
    if k % 4:
        raise ValueError(f"sparse_timings: k must be a multiple of 4 (2:4 groups), got {k}")
    env = {key: v for key, v in os.environ.items() if key not in BLAS_HANDICAPS}
    env.update(OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    args = json.dumps(dict(m=m, k=k, n=n, densities=list(densities), rounds=rounds, seed=seed))
    code = f"import json, minitorch.sparse as s; print(json.dumps(s._timing_child(**json.loads({args!r}))))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"sparse_timings: the timing process failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["csr"] = {float(d): t for d, t in out["csr"].items()}
    out["env"] = {key: os.environ.get(key, "(not set)") for key in BLAS_HANDICAPS}
    return out


def _timing_child(m: int, k: int, n: int, densities: list, rounds: int, seed: int) -> dict[str, Any]:
    import time

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    values, meta = compress_2_4(a)
    a24 = to_csr(decompress_2_4(values, meta))
    runs: dict[str, Callable] = {"dense": lambda: a @ b, "sparse24": lambda: sparse24_matmul(values, meta, b),
                                 "csr24": lambda: csr_matmul(a24, b)}
    for d in densities:
        sparse = to_csr(np.where(rng.random((m, k)) < d, a, np.float32(0)))
        runs[f"csr {d}"] = (lambda s_: lambda: csr_matmul(s_, b))(sparse)
    best = {name: float("inf") for name in runs}
    for fn in runs.values():
        fn()  # compile, warm up
    for _ in range(rounds):
        for name, fn in runs.items():
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    return {"dense": best["dense"], "sparse24": best["sparse24"], "csr24": best["csr24"],
            "csr": {str(d): best[f"csr {d}"] for d in densities}, "load": load,
            "shape": [m, k, n]}


def break_even(densities: list, sparse_times: list, dense_time: float) -> float | None:
    """The density at which the sparse time crosses the dense time, interpolated linearly between the
    measured points (sorted by density); None if it never does within them."""
    d = np.asarray(densities, np.float64)
    t = np.asarray(sparse_times, np.float64)
    order = np.argsort(d)
    d, t = d[order], t[order]
    for i in range(len(d) - 1):
        if (t[i] - dense_time) * (t[i + 1] - dense_time) <= 0 and t[i] != t[i + 1]:
            return float(d[i] + (dense_time - t[i]) * (d[i + 1] - d[i]) / (t[i + 1] - t[i]))
    return None

# %% tags=["demo"]
DENS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6)
shape = (512, 512, 64) if SMALL else (1024, 1024, 64)
timings = sparse_timings(*shape, densities=DENS, rounds=2 if SMALL else 4)
m_, k_, n_ = shape
print(f"A ({m_}, {k_}) float32 @ B ({k_}, {n_}); one thread each; load average {timings['load']:.2f} before "
      f"(2 CPUs here are shared with other jobs when it is above ~1); unset in the timing process: {timings['env']}")
print(f"dense NumPy BLAS: {timings['dense'] * 1e3:.3f} ms ({2 * m_ * k_ * n_ / timings['dense'] / 1e9:.1f} GFLOP/s)")
for d, t in timings["csr"].items():
    print(f"  CSR at density {d:6.3f}: {t * 1e3:7.3f} ms, {timings['dense'] / t:5.2f}x dense "
          f"({2 * d * m_ * k_ * n_ / t / 1e9:5.1f} useful GFLOP/s)")
be = break_even(list(timings["csr"]), list(timings["csr"].values()), timings["dense"])
print(f"break-even density on this machine: {be:.3f}" if be is not None else "no break-even in the measured range")
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.loglog(list(timings["csr"]), [t * 1e3 for t in timings["csr"].values()], "o-", label="CSR kernel (Numba)")
ax.axhline(timings["dense"] * 1e3, color="k", ls="--", label="dense (NumPy BLAS)")
if be is not None:
    ax.axvline(be, color="gray", ls=":", label=f"break-even {be:.2f}")
ax.set(xlabel="density (fraction of A nonzero)", ylabel="ms", title=f"A ({m_}x{k_}) @ B ({k_}x{n_}), one thread")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. 2:4 semi-structured sparsity
#
# NVIDIA's Ampere GPUs (A100) and their successors make one sparsity pattern fast: in every group
# of four consecutive weights along the reduction dimension (the K of A (M, K), the inputs of a
# layer), at most two are nonzero. The matrix is stored **compressed**: the two kept values of
# each group (A becomes (M, K/2)), and for each kept value its position in the group, 0 to 3,
# in **2 bits** of metadata. The sparse tensor cores read both and pick the matching two of every
# four rows of B: half the multiplications of the dense product, in half the time. That is the
# doubled throughput the datasheets print "with sparsity" (Mishra et al. 2021; the H100's
# 989 dense bf16 TFLOP/s are 1,979 with 2:4, [gpu](../hardware_notes/gpu.md#h100-variants-sxm-pcie-nvl-and-what-dense-and-sparse-mean)).
# Fifty percent is a modest sparsity, but it is regular: every row has exactly K/2 values, every
# group exactly two, so there are no row pointers and no load imbalance, and the indices cost 2
# bits where CSR spends 32.
#
# Our layout: `values` (M, K/2) in A's dtype, each group's two kept values in increasing
# position; `meta` (M, ceil(K/8)) uint8 holding the positions four to a byte, low bits first:
# value slot s of a row (group s // 2) has its position in bits `2 (s mod 4)` and
# `2 (s mod 4) + 1` of byte `s // 4`. The kept two of each group are those of largest |a|, ties
# to the lower position (a group of zeros keeps positions 0 and 1). K must be a multiple of 4.
#
# **Exercise 18.5.** Write `compress_2_4` and the Numba kernel `sparse24_kernel`, which adds A B
# into `out` reading only `values` and `meta` (and the rows of B they name): the tests trace its
# reads of B and check that it never builds a dense copy of A.

# %%
#| export
#| exercise 18.5
def compress_2_4(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prune a (M, K), K a multiple of 4, to 2:4 along K and compress it: (values, meta). values
    (M, K/2) in a's dtype: the 2 entries of largest |a| of each group of 4 (ties: the lower
    position), in increasing position; meta (M, ceil(K/8)) uint8: the positions (0..3), 2 bits
    each, slot s of a row in bits 2*(s % 4) and 2*(s % 4)+1 of byte s // 4 (unused bits 0)."""
    ### BEGIN SOLUTION
    a = np.asarray(a)
    if a.ndim != 2 or a.shape[1] % 4:
        raise ValueError(f"compress_2_4: a must be (M, K) with K a multiple of 4, got shape {a.shape}")
    m, k = a.shape
    groups = a.reshape(m, k // 4, 4)
    pos = np.sort(np.argsort(-np.abs(groups), axis=2, kind="stable")[:, :, :2], axis=2)
    values = np.take_along_axis(groups, pos, axis=2).reshape(m, k // 2)
    slots = np.zeros((m, -(-k // 8) * 4), np.uint8)
    slots[:, :k // 2] = pos.reshape(m, k // 2)
    meta = slots[:, 0::4] | (slots[:, 1::4] << 2) | (slots[:, 2::4] << 4) | (slots[:, 3::4] << 6)
    return values, meta.astype(np.uint8)
    ### END SOLUTION


@njit(cache=False)
def sparse24_kernel(values, meta, b, out):
    """out (M, N) += A @ b for A in 2:4 form: values (M, K/2), meta (M, ceil(K/8)) uint8 as
    compress_2_4 makes them, b (K, N). Value slot s of row i multiplies row 4 * (s // 2) + (its
    2-bit position) of b. Reads values, meta and those rows of b; builds no dense copy of A."""
    ### BEGIN SOLUTION
    m, half = values.shape
    n = b.shape[1]
    for i in range(m):
        for s in range(half):
            j = (s >> 1) * 4 + ((meta[i, s >> 2] >> ((s & 3) * 2)) & 3)
            v = values[i, s]
            for col in range(n):
                out[i, col] += v * b[j, col]
    ### END SOLUTION


def sparse24_matmul(values: np.ndarray, meta: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A @ b for A in 2:4 form (values (M, K/2), meta (M, ceil(K/8)) uint8) and b (K, N) with
    K = 2 * values.shape[1]: (M, N) in np.result_type(values, b), through sparse24_kernel (given:
    checks the shapes, passes zeros to accumulate into)."""
    values, meta, b = np.asarray(values), np.asarray(meta), np.asarray(b)
    if values.ndim != 2 or meta.ndim != 2 or b.ndim != 2:
        raise ValueError(f"sparse24_matmul: values, meta and b must be 2-D, got {values.shape}, {meta.shape}, {b.shape}")
    m, half = values.shape
    if half % 2 or b.shape[0] != 2 * half or meta.shape != (m, -(-half // 4)) or meta.dtype != np.uint8:
        raise ValueError(f"sparse24_matmul: values {values.shape} need meta ({m}, {-(-half // 4)}) uint8 and b "
                         f"({2 * half}, N), got meta {meta.shape} {meta.dtype} and b {b.shape}")
    out = np.zeros((m, b.shape[1]), np.result_type(values, b))
    sparse24_kernel(values, meta, np.ascontiguousarray(b), out)
    return out

# %% tags=["check"]
check("18.5")

# %%
#| export
#| given
def decompress_2_4(values: np.ndarray, meta: np.ndarray) -> np.ndarray:
    """The dense (M, K) matrix, K = 2 * values.shape[1], that values (M, K/2) and meta (M, ceil(K/8))
    uint8 (compress_2_4's layout) describe: zeros except at the positions meta names."""
    values, meta = np.asarray(values), np.asarray(meta)
    m, half = values.shape
    if half % 2 or meta.shape != (m, -(-half // 4)):
        raise ValueError(f"decompress_2_4: values {values.shape} need meta of shape ({m}, {-(-half // 4)}), "
                         f"got {meta.shape}")
    s = np.arange(half)
    pos = (meta[:, s // 4] >> (2 * (s % 4)).astype(np.uint8)) & 3
    dense = np.zeros((m, 2 * half), values.dtype)
    np.put_along_axis(dense, (s // 2) * 4 + pos.astype(np.int64), values, axis=1)
    return dense


def sparse24_nbytes(m: int, k: int, itemsize: int) -> int:
    """Bytes of a 2:4 matrix (M, K) compressed: M K/2 values of `itemsize` bytes plus M ceil(K/8)
    bytes of metadata."""
    return m * (k // 2) * itemsize + m * -(-k // 8)


def mask_2_4(scores: np.ndarray) -> np.ndarray:
    """The 2:4 mask of a layer weight from its scores (in, out) (|w| for magnitude, Wanda's scores):
    in each group of 4 consecutive inputs of every output, the 2 of highest score kept (ties: the
    lower input), as compress_2_4 chooses them. bool (in, out), in a multiple of 4."""
    scores = np.asarray(scores, np.float64)
    if scores.ndim != 2 or scores.shape[0] % 4:
        raise ValueError(f"mask_2_4: scores must be (in, out) with in a multiple of 4, got shape {scores.shape}")
    groups = scores.T.reshape(scores.shape[1], -1, 4)
    pos = np.argsort(-groups, axis=2, kind="stable")[:, :, :2]
    keep = np.zeros(groups.shape, bool)
    np.put_along_axis(keep, pos, True, axis=2)
    return keep.reshape(scores.shape[1], -1).T

# %% [markdown]
# What 2:4 costs the model and what it buys the kernel. First the model: 2:4 masks of every
# attention and MLP weight (groups of four inputs of each output), chosen by magnitude and by
# Wanda, against the unstructured 50% of section 3: the pattern constrains which half may go, and
# the loss says how much that costs. Then the kernel, on the matrix of the timing above pruned 2:4:
# bytes (float32 values and the 2-bit positions, against CSR's values and int32 column indices at
# the same 50%) and time, from the same child process, so every ratio is measured in one run.

# %% tags=["demo"]
for label, score in [("magnitude", lambda name, w: np.abs(w)), ("Wanda", lambda name, w: np.abs(w) * norms[name][:, None])]:
    masks = {name: mask_2_4(score(name, w)) for name, w in weights.items()}
    print(f"2:4 by {label:<9}: sparsity {mask_sparsity(masks):.2f}, val loss "
          f"{evaluate_loss(pruned_copy(tiny, masks), val_ids, EVAL):.3f} "
          f"(unstructured 50%: {curves['magnitude, per layer' if label == 'magnitude' else 'Wanda'][SPARSITIES.index(0.5)]:.3f})")

a_demo = np.random.default_rng(0).standard_normal((m_, k_)).astype(np.float32)
values, meta = compress_2_4(a_demo)
csr24 = to_csr(decompress_2_4(values, meta))
dense_bytes = a_demo.nbytes
print(f"\nA ({m_}, {k_}) float32: dense {dense_bytes / 1e6:.2f} MB; 2:4 {sparse24_nbytes(m_, k_, 4) / 1e6:.2f} MB "
      f"({sparse24_nbytes(m_, k_, 4) / dense_bytes:.3f} of dense); CSR of the same 50% {csr24.nbytes() / 1e6:.2f} MB "
      f"({csr24.nbytes() / dense_bytes:.3f}); in bf16 the 2:4 form would be {sparse24_nbytes(m_, k_, 2) / (m_ * k_ * 2):.4f} of dense")
print(f"time, one thread, same child process as above: dense BLAS {timings['dense'] * 1e3:.3f} ms, "
      f"2:4 kernel {timings['sparse24'] * 1e3:.3f} ms ({timings['dense'] / timings['sparse24']:.2f}x dense), "
      f"CSR kernel on the same 2:4 matrix {timings['csr24'] * 1e3:.3f} ms "
      f"(2:4 is {timings['csr24'] / timings['sparse24']:.2f}x CSR)")

# %% [markdown]
# On a CPU the 2:4 kernel does half the multiply-adds of a dense product, with a format cheaper
# than CSR, and still loses to BLAS: BLAS runs near the core's peak by reusing tiles in registers,
# and a kernel that gathers rows of B by index does not. The speed-up of 2:4 comes from hardware
# that skips the zeros *inside* the matrix unit, which is the next section's arithmetic.

# %% [markdown]
# ## 6. The arithmetic on a GPU: why unstructured sparsity rarely pays, and 2:4 does
#
# A GPU runs a dense matrix product on its tensor cores, 989 bf16 TFLOP/s on an H100 SXM, against
# 67 TFLOP/s for its ordinary fp32 lanes ([gpu](../hardware_notes/gpu.md#tensor-cores)). An
# unstructured sparse kernel cannot feed tensor cores a regular tile, so it runs on the lanes,
# and at a fraction of their peak (the gathers, the index loads and the uneven rows: Gale et al.
# 2020's kernels, built for deep learning's sparsity, reached 27% of a V100's fp32 peak). So with N
# tokens (B (K, N)), when the product is compute-bound (prefill, large batches), CSR beats dense
# only when
#
# $$\text{density} < \frac{67 \times \text{efficiency}}{989} \approx 2\% \text{ at 30\% efficiency},$$
#
# far sparser than a language model survives without retraining. When the product is
# memory-bound (decoding one token: N = 1), time is bytes: CSR moves `nnz (2 + 4)` bytes (a bf16
# value and an int32 index) against `2 M K`, so it pays below a density of 1/3, and a kernel that
# loads the weights sparse and multiplies them dense on the tensor cores (Flash-LLM, Xia et al.
# 2023) gets that saving at any N where bytes dominate. 2:4 needs neither condition: the sparse
# tensor cores do the product at twice the dense rate, and the matrix is 0.5625 of its dense bytes
# in bf16, whether the product is compute- or memory-bound.
#
# `gpu_matmul_time` (given) is that model: time = max(flops / rate, bytes / bandwidth) for each
# way of running A (M, K) @ B (K, N), with an H100 SXM's datasheet rates
# ([sparsity](../hardware_notes/sparsity.md) has the arithmetic). Drag the density and the number
# of tokens (as a power of two); `efficiency` is the fraction of the fp32 lanes' peak a CSR kernel
# reaches.

# %%
#| export
#| given
GPU_SPECS = {  # datasheet figures (hardware_notes/gpu.md): rates in FLOP/s, bandwidth in bytes/s
    "H100 SXM": {"tensor": 989e12, "tensor_2_4": 1979e12, "fp32": 67e12, "bandwidth": 3.35e12},
    "A100 SXM 80GB": {"tensor": 312e12, "tensor_2_4": 624e12, "fp32": 19.5e12, "bandwidth": 2.039e12},
}
GPU_KINDS = ("dense", "2:4", "csr", "sparse load, dense compute")


def gpu_matmul_time(m: int, k: int, n: int, density: float, kind: str, gpu: str = "H100 SXM",
                    efficiency: float = 0.3) -> float:
    """Modelled seconds of A (m, k) @ B (k, n) in bf16 on `gpu` (a GPU_SPECS key): max(flops / rate,
    bytes / bandwidth). kind: "dense" (tensor cores, 2mkn flops), "2:4" (sparse tensor cores: the same
    2mkn at twice the rate; A as 2:4 values plus 2-bit positions; density is 0.5 by construction),
    "csr" (fp32 lanes at `efficiency` of their peak, 2 nnz n flops; A as bf16 values, int32 indices
    and row pointers), "sparse load, dense compute" (Flash-LLM: CSR's bytes, dense flops on the tensor
    cores). B and C are dense bf16 in every case."""
    if kind not in GPU_KINDS:
        raise ValueError(f"gpu_matmul_time: kind must be one of {GPU_KINDS}, got {kind!r}")
    return float(_model_time(m, k, n, np.float64(density), kind, GPU_SPECS[gpu], efficiency))


def _model_time(m: int, k: int, n: int, density: Any, kind: str, spec: dict, efficiency: float) -> Any:
    """gpu_matmul_time for an array of densities at once (what the live figure draws)."""
    nnz = density * m * k
    other = 2.0 * (k * n + m * n)
    csr_bytes = nnz * 6.0 + 4.0 * (m + 1)
    flops, rate, a_bytes = {
        "dense": (2.0 * m * k * n, spec["tensor"], 2.0 * m * k),
        "2:4": (2.0 * m * k * n, spec["tensor_2_4"], float(sparse24_nbytes(m, k, 2))),
        "csr": (2.0 * nnz * n, spec["fp32"] * efficiency, csr_bytes),
        "sparse load, dense compute": (2.0 * m * k * n, spec["tensor"], csr_bytes),
    }[kind]
    return np.maximum(flops / rate, (a_bytes + other) / spec["bandwidth"])

# %% tags=["demo"]
from course.live import live
from minitorch.sparse import _model_time

DENSITY_GRID = np.geomspace(0.005, 1.0, 60)
M_GPU = K_GPU = 8192  # a large layer, e.g. one of Llama-2 70B's attention projections


def draw_gpu(density: float = 0.5, tokens_log2: int = 0, efficiency: float = 0.3):
    n = 2 ** tokens_log2
    dense = gpu_matmul_time(M_GPU, K_GPU, n, 1.0, "dense", efficiency=efficiency)
    fig, ax = plt.subplots(figsize=(8.5, 3.6), gridspec_kw=dict(left=0.09, right=0.70, bottom=0.15, top=0.86))
    for kind, color in zip(GPU_KINDS[2:], ("C3", "C2")):
        times = _model_time(M_GPU, K_GPU, n, DENSITY_GRID, kind, GPU_SPECS["H100 SXM"], efficiency)
        ax.loglog(DENSITY_GRID, dense / times, color=color, label=kind)
    speed_24 = dense / gpu_matmul_time(M_GPU, K_GPU, n, 0.5, "2:4", efficiency=efficiency)
    ax.plot([0.5], [speed_24], "o", color="C1", ms=8, label=f"2:4 (density 0.5): {speed_24:.2f}x")
    ax.axhline(1.0, color="k", lw=1, ls="--", label="dense (tensor cores)")
    ax.axvline(density, color="gray", lw=1, ls=":")
    csr_here = dense / gpu_matmul_time(M_GPU, K_GPU, n, density, "csr", efficiency=efficiency)
    ax.set(xlabel="density of A", ylabel="speed-up over dense", ylim=(0.01, 200))
    ax.set_title(f"A {M_GPU}x{K_GPU} @ B {K_GPU}x{n} (N = {n} tokens), H100 SXM model\n"
                 f"CSR at density {density:.2f}: {csr_here:.2f}x dense", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


live(draw_gpu, density=(0.01, 1.0, 0.01), tokens_log2=(0, 12), efficiency=(0.1, 1.0, 0.05))

# %% [markdown]
# The break-even densities of the model for a decode step (N = 1) and a prefill of 4096 tokens,
# printed from it, and the 2:4 speed-up in each:

# %% tags=["demo"]
for n in (1, 4096):
    dense = gpu_matmul_time(M_GPU, K_GPU, n, 1.0, "dense")
    grid = np.linspace(0.001, 1.0, 2000)
    faster = [d for d in grid if gpu_matmul_time(M_GPU, K_GPU, n, d, "csr") < dense]
    print(f"N = {n:4d}: CSR (30% of the fp32 peak) beats dense below density "
          f"{max(faster) if faster else 0:.3f}; 2:4 runs at {dense / gpu_matmul_time(M_GPU, K_GPU, n, 0.5, '2:4'):.2f}x dense")

# %% [markdown]
# ## Where to go from here
#
# - **Training 2:4 models.** NVIDIA's recipe (Mishra et al. 2021): train dense, prune 2:4 by
#   magnitude, retrain with the mask fixed. SparseGPT and Wanda prune LLMs to 2:4 in one shot,
#   with a visible loss; PyTorch has `to_sparse_semi_structured` for 2:4 on GPUs, and cuSPARSELt is
#   NVIDIA's library for it.
# - **Block sparsity.** Zeros in whole blocks (say 16 x 16 or 32 x 32) keep tensor-core tiles
#   dense: OpenAI's block-sparse kernels (Gray et al. 2017), and MoE's grouped GEMM in lesson 16 is
#   block-sparse in effect. Lesson 16's experts are sparsity in the activations rather than the
#   weights.
# - **Sparsity and quantization together.** Deep compression (Han et al. 2016) pruned, then
#   quantized (lesson 10) and Huffman-coded; 2:4 with int8 or fp8 values doubles again.
# - **Activation sparsity.** ReLU networks have many zero activations; Deja Vu (Liu et al. 2023)
#   predicts which heads and MLP channels a token needs and skips the rest, a structured sparsity
#   decided per token.
#
# Sources: LeCun, Denker and Solla 1990, "Optimal brain damage"; Han, Pool, Tran and Dally 2015,
# "Learning both weights and connections for efficient neural networks"; Han, Mao and Dally 2016,
# "Deep compression"; Frankle and Carbin 2019, "The lottery ticket hypothesis"; Michel, Levy and
# Neubig 2019, "Are sixteen heads really better than one?"; Ma, Fang and Wang 2023, "LLM-Pruner";
# Sun, Liu, Bair and Kolter 2024, "A simple and effective pruning approach for large language
# models" (Wanda); Frantar and Alistarh 2023, "SparseGPT"; Mishra et al. 2021, "Accelerating
# sparse deep neural networks" (NVIDIA, 2:4 and the sparse tensor cores); Gale, Zaharia, Young and
# Elsen 2020, "Sparse GPU kernels for deep learning"; Xia et al. 2023, "Flash-LLM"; Gray, Radford
# and Kingma 2017, "GPU kernels for block-sparse weights"; Liu et al. 2023, "Deja Vu"; MIT 6.5940
# (Han), lectures and labs on pruning and sparsity.

# %%
#| export
#| given
from minitorch.checks import Array, Attrs, Choice, Count, Fraction, Instance, Number, Positive, Size, validate_public  # noqa: E402, I001

_FLOATS = Array(dtypes=("float32", "float64"))
_MATRIX = Array(ndim=2, dtypes=("float32", "float64"))
validate_public(globals(), {
    "magnitude_mask": {"w": _FLOATS, "sparsity": Fraction},
    "global_magnitude_masks": {"weights": Instance(dict, must="a dict {name: float array}"), "sparsity": Fraction},
    "apply_masks_": {"model": Instance(Module, must="a minitorch Module"),
                     "masks": Instance(dict, must="a dict {parameter name: bool array}")},
    "channel_scores": {"w_in": _MATRIX, "w_out": _MATRIX},
    "head_scores": {"w_v": _MATRIX, "w_o": _MATRIX, "n_head": Size},
    "prune_mlp": {"W": Instance(GPTWeights), "n_keep": Size},
    "prune_heads": {"W": Instance(GPTWeights), "n_keep": Size},
    "input_norms": {"x": _MATRIX},
    "wanda_mask": {"w": _MATRIX, "norms": Array(ndim=1, dtypes="real"), "sparsity": Fraction},
    "to_csr": {"a": Array(ndim=2, dtypes="real")},
    "csr_matmul": {"a": Instance(CSR), "b": _MATRIX},
    "compress_2_4": {"a": _MATRIX},
    "sparse24_matmul": {"values": _MATRIX, "meta": Array(ndim=2, dtypes="uint8"), "b": _MATRIX},
    "decompress_2_4": {"values": _MATRIX, "meta": Array(ndim=2, dtypes="uint8")},
    "sparse24_nbytes": {"m": Count, "k": Size, "itemsize": Size},
    "mask_2_4": {"scores": _MATRIX},
    "prunable_weights": {"model": Instance(Module, must="a minitorch Module")},
    "mask_sparsity": {"masks": Instance(dict, must="a dict {name: bool array}")},
    "finetune": {"model": Attrs("config", "parameters", "train"), "train_ids": Array(ndim=1, dtypes="int"),
                 "steps": Size, "batch_size": Size, "lr": Positive},
    "sparse_timings": {"m": Size, "k": Size, "n": Size, "rounds": Size, "timeout": Positive},
    "break_even": {"dense_time": Positive},
    "gpu_matmul_time": {"m": Size, "k": Size, "n": Size, "density": Fraction, "kind": Choice(*GPU_KINDS),
                        "gpu": Choice(*GPU_SPECS), "efficiency": Number(0, 1, lo_open=True)},
})
