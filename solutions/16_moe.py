# %% [markdown]
# # Lesson 16: mixture of experts and expert parallelism
#
# A dense transformer runs every token through every weight. A *mixture of experts* (MoE) layer
# replaces the MLP with E expert MLPs and a small *router* that sends each token to k of them
# (Shazeer et al. 2017): the parameters grow E-fold, the work per token only k-fold. Switch
# Transformer (Fedus et al. 2022) routes each token to k = 1 expert, GShard (Lepikhin et al.
# 2021) and Mixtral 8x7B (Jiang et al. 2024) to k = 2 of 8, DeepSeek-V3 (DeepSeek-AI 2024) to 8
# of 256. Most of the largest open models are MoEs now.
#
# Sparse routing brings three systems problems, and this lesson builds the answer to each:
#
# 1. **Balance.** A router left alone sends most tokens to a few experts. The *load-balancing
#    loss* (Switch) and the *router z-loss* (ST-MoE, Zoph et al. 2022) push it back; DeepSeek-V3
#    balances with a per-expert bias instead of a loss.
# 2. **Irregular work.** Every expert gets a different number of tokens. Either cap each expert
#    at a *capacity* and drop the overflow (Switch, GShard: fixed shapes), or sort the tokens by
#    expert and run one matrix multiply per expert group, a *grouped GEMM* (MegaBlocks, Gale et
#    al. 2023: "dropless" MoE), whose work is proportional to the tokens routed.
# 3. **Expert parallelism.** When the experts do not fit on one device, each rank holds E/N of
#    them, and tokens travel to the rank that holds their expert and back: two *all-to-all*
#    exchanges per layer in the forward pass and two in the backward. You build the all-to-all
#    from `isend`/`irecv` on lesson 12's communicator, run it simulated and under `mpiexec`, and
#    combine expert parallelism with data parallelism.
#
# Exercises: 16.1 the router and its losses; 16.2 dispatch, capacity and the grouped GEMM in
# NumPy; 16.3 the MoE layer with autograd (an MoE tiny GPT is trained in a demo); 16.4 the
# all-to-all; 16.5 expert parallelism and EP x DP training; 16.6 expert parallelism in lesson
# 13's planner, for Mixtral 8x7B on 64 H100s.
#
# The course's reference version of this lesson is `minitorch/moe.py`. Background: why EP needs
# bandwidth, and all-to-all on NVLink vs across nodes:
# [interconnects](../hardware_notes/interconnects.md#all-to-all-and-expert-parallelism). The
# Ultra-Scale Playbook (Tazi et al. 2025, "Expert parallelism") walks through the same pieces.
#
# Conventions: tokens are rows. Everything compared with a dense reference runs in float64, where
# "equal" means equal to 1e-12.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %%
#| default_exp moe
#| export
"""minitorch.moe: top-k routing and balancing losses, capacity and dropless dispatch with a grouped
GEMM, an MoE MLP layer with autograd, all-to-all from isend/irecv, expert parallelism (EP and EP x
DP) on lesson 12's communicator, and EP in the planner.

Runs on any `minitorch.comm` communicator (simulated or MPI).
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, NamedTuple

import numpy as np

from minitorch.autograd import Tensor, logsumexp, softmax
from minitorch.checks import Attrs, check_array, describe
from minitorch.comm import Communicator, RunResult, mpi_status, run
from minitorch.gpt import GPT, GPTConfig, gelu, gelu_np
from minitorch.nn import Module, Parameter
from minitorch.parallel import ring_allreduce


def check_int(what: str, name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi], or an error naming the function, the argument, the bound and
    the value (the one validation helper of this module)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{what}: {name} must be {bound}, got {value}")
    return int(value)


def check_counts(what: str, name: str, counts: Any) -> list[int]:
    """`counts` (a 1-D array or sequence of integers >= 0) as a list of Python ints, or an error
    naming the first that is not one (check_int's). One pass in Python for the common case: an
    all-to-all of small blocks is bound by its bookkeeping."""
    if not (type(what) is str and type(name) is str):  # noqa: E721
        raise TypeError(f"check_counts: what and name must be str, got {describe(what)} and {describe(name)}")
    try:
        if isinstance(counts, np.ndarray) and counts.ndim != 1:
            raise TypeError
        values = counts.tolist() if isinstance(counts, np.ndarray) else list(counts)
    except TypeError:
        raise ValueError(f"{what}: {name} must be a 1-D sequence of counts, got {describe(counts)}") from None
    if all([type(c) is int and c >= 0 for c in values]):  # noqa: E721 - a bool is not a count
        return values
    return [check_int(what, f"{name}[{i}]", c, 0) for i, c in enumerate(values)]


def check_experts(what: str, experts: Any, n_experts: int) -> np.ndarray:
    """`experts` as a 2-D int64 array (tokens, k) of ids in [0, n_experts), or a ValueError naming
    its shape, dtype and range."""
    n_experts = check_int(what, "n_experts", n_experts, 1)
    e = np.asarray(experts) if experts is not None and not isinstance(experts, (str, bytes)) else None
    if e is None or e.ndim != 2 or e.dtype.kind not in "iu":
        raise ValueError(f"{what}: experts must be a 2-D integer array (tokens, k), got {describe(experts)}")
    if e.size and (e.min() < 0 or e.max() >= n_experts):
        raise ValueError(f"{what}: experts must hold expert ids in [0, {n_experts}), got ids from {e.min()} to "
                         f"{e.max()}")
    return e.astype(np.int64)


def check_a2a_args(what: str, comm: Any, x: Any, tag: Any) -> np.ndarray:
    """x as an array, after checking the arguments of an all-to-all off its fast path: a communicator,
    rows x (n, ...) of a real dtype, a tag in [0, 2**20); errors naming `what`, the argument and the
    value."""
    Attrs("rank", "size", "isend", "irecv", "waitall")(what, "comm", comm)
    x = check_array(what, "x", x, dtypes="number")
    if x.ndim < 1:
        raise ValueError(f"{what}: x must be rows (n, ...), got {describe(x)}")
    check_int(what, "tag", tag, 0, 2**20 - 1)
    return x


def check_rows(what: str, name: str, x: Any, ndim: int = 2) -> Any:
    """x (a Tensor or array) with `ndim` dimensions, or a ValueError naming its shape."""
    shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
    if len(shape) != ndim:
        raise ValueError(f"{what}: {name} must have {ndim} dimensions, got shape {shape}")
    return x

# %% [markdown]
# ## 1. The router
#
# The router is one linear map: token x (a row of C numbers) gets a logit per expert,
# `logits = x @ W_gate` (E numbers), and `p = softmax(logits)`. The token goes to the k experts
# with the largest p, and the layer's output is the weighted sum of their outputs, with the
# chosen probabilities **renormalised** to sum to 1 (Mixtral, and GShard for k = 2):
#
# `y = sum_j w_j FFN_{e_j}(x)`, `w_j = p_{e_j} / sum_{i in top-k} p_{e_i}`.
#
# For k = 1 we keep Switch's rule, `w = p_{e_1}` unrenormalised: renormalised, a top-1 weight
# would always be 1 and the router would get no gradient through it. The gradient reaches the
# router through the weights: an expert whose output lowered the loss gets a larger probability
# next time.
#
# **Ties** (equal probabilities, e.g. a zero router at initialisation) are broken by the
# **lowest expert index**, and the chosen experts are listed best first. A stable sort of `-p`
# does exactly this.
#
# **Balance.** Left alone, a router collapses onto a few experts: they get better because they
# get the tokens, and get the tokens because they are better. Switch adds the auxiliary loss
#
# `L_aux = N * sum_i f_i * P_i`
#
# with N the number of experts, `f_i` the fraction of the T*k assignments that went to expert i
# (counted: no gradient) and `P_i` the mean router probability of expert i over the tokens
# (differentiable). It is 1 when both are uniform, and N when every token goes to one expert
# with probability 1. Its gradient with respect to `P_i` is `N f_i`: it lowers the probability
# of the experts that got many tokens most, and so moves tokens towards the idle ones. (Hugging
# Face's Mixtral counts f over tokens rather than assignments, which makes it k times ours.)
# ST-MoE's **z-loss** `mean_t (logsumexp(logits_t))^2` keeps the logits small: large logits make
# `exp` round off badly in low precision, and Zoph et al. found that penalising them stabilises
# training without costing quality.
#
# **Loss-free balancing** (DeepSeek-V3, after Wang et al. 2024): add a per-expert bias b to the
# scores for *choosing* the experts only, not for the weights, and after each step move it
# against the load: `b_i += rate * sign(mean load - load_i)`. Overloaded experts become less
# attractive without a loss term that competes with the language-model loss.
#
# **Exercise 16.1.** Write `top_k_gating` (with the optional selection bias), `load_balancing_loss`,
# `router_z_loss` and `update_bias`. Use autograd ops (`softmax`, indexing, `sum`) so that the
# gradient flows to the logits, and keep the logits' dtype: float32 logits give float32 probs,
# weights and losses (`update_bias` keeps the bias's float dtype).
#
# A logit of `+inf` has no softmax (`inf - inf` is NaN): every probability of its token would be
# NaN and the top-k of NaNs is arbitrary. A router that produces one has diverged, so
# `top_k_gating` refuses every non-finite logit (NaN, `+inf`, `-inf`) before it computes
# anything, with a ValueError naming the first in row-major order, worded as
# `top_k_gating: logits must be finite, got inf at token 1, expert 2`. The other errors, each a
# ValueError whose message names what is wrong: logits that are not 2-D (their shape), k outside
# [1, E] (`k`), a bias that is not of shape (E,) (`bias`), and in `load_balancing_loss` an id
# outside [0, E) (`expert`).

# %%
#| export
class Gate(NamedTuple):
    """The router's decision for T tokens: experts (T, k) int64, best first (ties: lowest index);
    weights (T, k) Tensor, the combine weights; probs (T, E) Tensor, softmax of the logits."""
    experts: np.ndarray
    weights: Tensor
    probs: Tensor

# %%
#| export
#| exercise 16.1
def top_k_gating(logits: Tensor, k: int, bias: np.ndarray | None = None) -> Gate:
    """Top-k softmax gating of logits (T, E) (an autograd Tensor, any float dtype).

    probs = softmax(logits) over experts. experts: for each token the k experts with the largest
    probs + bias (bias (E,) only selects: DeepSeek-V3; None = 0), best first, ties to the lowest
    index. weights: probs of the chosen experts, divided by their sum when k >= 2 (they sum to 1);
    for k = 1 the raw probability (Switch). probs and weights have the logits' dtype.
    ValueErrors: logits not 2-D, k not in [1, E], bias shape, and a non-finite logit:
    "top_k_gating: logits must be finite, got {value} at token {t}, expert {e}" (the first)."""
    ### BEGIN SOLUTION
    what = "top_k_gating"
    logits = logits if isinstance(logits, Tensor) else Tensor(logits)
    check_rows(what, "logits", logits)
    t, e = logits.shape
    k = check_int(what, "k", k, 1, e)
    bad = np.argwhere(~np.isfinite(logits.numpy()))
    if bad.size:
        i, j = bad[0]
        raise ValueError(f"{what}: logits must be finite, got {float(logits.numpy()[i, j])} at token {i}, expert {j}")
    probs = softmax(logits, axis=-1)
    scores = probs.numpy().astype(np.float64)
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
        if bias.shape != (e,):
            raise ValueError(f"{what}: bias must have shape ({e},), got {bias.shape}")
        scores = scores + bias
    experts = np.argsort(-scores, axis=-1, kind="stable")[:, :k].astype(np.int64)
    chosen = probs[np.arange(t)[:, None], experts]
    weights = chosen / chosen.sum(axis=-1, keepdims=True) if k > 1 else chosen
    return Gate(experts, weights, probs)
    ### END SOLUTION


def load_balancing_loss(probs: Tensor, experts: np.ndarray) -> Tensor:
    """Switch's auxiliary loss N * sum_i f_i * P_i (a one-element Tensor): probs (T, E), N = E;
    f_i = (assignments to expert i) / (T * k), counted from experts (T, k) (no gradient);
    P_i = mean over tokens of probs[:, i] (the gradient flows through it); probs' dtype. ValueError
    for T = 0, experts not (T, k), or an expert id outside [0, E)."""
    ### BEGIN SOLUTION
    what = "load_balancing_loss"
    check_rows(what, "probs", probs)
    t, e = probs.shape
    experts = check_experts(what, experts, e)
    if experts.shape[0] != t or t == 0:
        raise ValueError(f"{what}: need T >= 1 tokens and experts (T, k) for probs (T, E), got probs {probs.shape}, "
                         f"experts {experts.shape}")
    f = np.bincount(experts.reshape(-1), minlength=e) / experts.size
    return (probs.mean(axis=0) * f.astype(probs.dtype)).sum() * e
    ### END SOLUTION


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE's z-loss: mean over tokens of logsumexp(logits_t)^2, logits (T, E), T >= 1 (ValueError
    for T = 0); the logits' dtype."""
    ### BEGIN SOLUTION
    check_rows("router_z_loss", "logits", logits)
    if logits.shape[0] == 0:
        raise ValueError("router_z_loss: need at least one token, got logits of shape (0, E)")
    z = logsumexp(logits, axis=-1)
    return (z * z).mean()
    ### END SOLUTION


def update_bias(bias: np.ndarray, load: np.ndarray, rate: float) -> np.ndarray:
    """DeepSeek-V3's loss-free balancing step: a new array bias + rate * sign(mean(load) - load)
    (overloaded experts go down, underloaded up, balanced ones stay). bias, load: (E,). The result
    has bias's dtype if it is a float (float32 stays float32), else float64."""
    ### BEGIN SOLUTION
    bias, load = np.asarray(bias), np.asarray(load, dtype=np.float64)
    if bias.ndim != 1 or load.shape != bias.shape:
        raise ValueError(f"update_bias: bias and load must both have shape (E,), got {bias.shape} and {load.shape}")
    dtype = bias.dtype if bias.dtype.kind == "f" else np.float64
    return (bias + rate * np.sign(load.mean() - load)).astype(dtype)
    ### END SOLUTION

# %% tags=["check"]
check("16.1")

# %% [markdown]
# Three routers and their balance on 4096 random tokens, 8 experts, k = 2: a random one, one whose
# weights favour expert 0 (a larger auxiliary loss), and a zero router, all of whose logits tie:
# the tie rule sends every token to experts 0 and 1, yet its auxiliary loss is exactly 1, the
# balanced value. With uniform probabilities `P_i = 1/N` the loss is `sum_i f_i = 1` whatever
# the counts: it sees the load only through the probabilities it can move (and a random
# initialisation breaks such ties at once).

# %% tags=["demo"]
rng = np.random.default_rng(0)
tokens, width, n_exp = 4096 if not SMALL else 512, 16, 8
x_demo = rng.standard_normal((tokens, width))
for name, w_gate in [("random router", rng.standard_normal((width, n_exp)) * 0.5),
                     ("router favouring expert 0", rng.standard_normal((width, n_exp)) * 0.5 + np.eye(width, n_exp)[0] * 3),
                     ("zero router (all ties)", np.zeros((width, n_exp)))]:
    logits = Tensor(x_demo @ w_gate)
    g = top_k_gating(logits, 2)
    load = np.bincount(g.experts.ravel(), minlength=n_exp)
    print(f"{name:>26}: load {load}, aux loss {load_balancing_loss(g.probs, g.experts).item():.3f}, "
          f"z-loss {router_z_loss(logits).item():.3f}")

# %% [markdown]
# Loss-free balancing at work: the skewed router, never trained, only its selection bias updated
# after each batch of 512 tokens (rate 0.005). The load moves towards balance while the combine
# weights stay those of the unbiased softmax. The cell prints the largest expert's share times E
# (1 = perfect balance) at the first step and over the last ten.

# %% tags=["demo"]
w_skew = rng.standard_normal((width, n_exp)) * 0.5 + np.eye(width, n_exp)[0] * 3
bias = np.zeros(n_exp)
history = []
for step in range(200 if not SMALL else 20):
    xb = rng.standard_normal((512, width))
    g = top_k_gating(Tensor(xb @ w_skew), 2, bias=bias)
    load = np.bincount(g.experts.ravel(), minlength=n_exp)
    history.append(load / load.sum())
    bias = update_bias(bias, load, 0.005)
plt.figure(figsize=(7, 3))
plt.plot(np.array(history))
plt.xlabel("step")
plt.ylabel("share of assignments")
plt.title("DeepSeek-V3 bias balancing: one line per expert")
plt.show()
last = np.mean(history[-10:], axis=0)
print(f"first step: shares {np.round(history[0], 3)}, largest x E = {history[0].max() * n_exp:.2f}")
print(f"last 10 steps: shares {np.round(last, 3)}, largest x E = {last.max() * n_exp:.2f}")
print("final bias:", np.round(bias, 3))

# %% [markdown]
# ## 2. Dispatch and combine on one process
#
# With the routing decided, each expert must see its tokens. Two ways:
#
# **Capacity and dropping** (Switch, GShard). Each expert gets a fixed buffer of
# `capacity = ceil(capacity_factor * T * k / E)` rows: fixed shapes suit TPUs and static graphs.
# An expert that is chosen more often than that keeps the first `capacity` assignments **in
# token order** and drops the rest; a dropped assignment contributes nothing to its token's output
# (the token still travels on the residual connection around the layer, so a token whose every
# assignment was dropped leaves the layer unchanged). The other experts' weights are not
# renormalised. Capacity factors of 1.0 to 1.25 are typical in training; every dropped token is
# a small loss of quality, so count them.
#
# **Dropless** (MegaBlocks). Sort the assignments by expert (stably, so token order is kept within
# each expert), run expert e on its contiguous group of rows, un-sort. The multiply-adds are
# `R * d_in * d_out` for R routed rows, the same as with a capacity, but no row is ever padded
# and none dropped. The alternative with fixed shapes is a padded batched matmul of E x
# (largest group) rows, which does more work by the ratio of the largest group to the mean
# (`make bench` measures both at a router's imbalance).
#
# A **dispatch** records the sorted assignments: for each routed row its token and its slot j
# (which of the token's k choices), the group sizes per expert, which assignments were kept and
# how many dropped. `grouped_gemm` runs one matmul per non-empty group; `combine` puts
# `w_j * y_row` back onto the rows' tokens, summing a token's k contributions.
#
# **Exercise 16.2.** Write `dispatch`, `grouped_gemm` and `combine`. `grouped_gemm` must do its
# multiplications through its `matmul` argument (the tests count the multiply-adds through it),
# one call per non-empty group. `expert_capacity` is given. An expert keeps an assignment while
# it holds fewer than `capacity` rows: a load of exactly `capacity` drops nothing, capacity 0
# drops everything. A token may name the same expert twice (its two rows both go to that
# expert, in slot order). The results keep their inputs' dtype (float32 rows and weights give
# float32 out: `np.result_type`, not a default float64 buffer). Errors, each a ValueError whose
# message names what is wrong: in `dispatch` experts that are not a 2-D integer array (their
# shape), an id outside [0, E) (`expert`), a negative `capacity`; in `grouped_gemm` group sizes
# that are not E counts >= 0 summing to the rows of x (`group_sizes`), or x's width not w's d_in.

# %%
#| export
class Dispatch(NamedTuple):
    """Sorted assignments. token, slot: (R,) int64, the token and the choice j of each routed row,
    rows sorted by expert and, within an expert, by token; group_sizes: (E,) int64 rows per expert
    (sum R); kept: (T, k) bool, which assignments were routed; dropped: assignments dropped."""
    token: np.ndarray
    slot: np.ndarray
    group_sizes: np.ndarray
    kept: np.ndarray
    dropped: int

    @property
    def dropped_tokens(self) -> int:
        """Tokens none of whose assignments was kept (they leave the layer on the residual only)."""
        return int((~self.kept).all(axis=1).sum()) if self.kept.shape[1] else 0


def expert_capacity(n_tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Rows per expert: ceil(capacity_factor * n_tokens * k / n_experts) (at least 0)."""
    check_int("expert_capacity", "n_tokens", n_tokens, 0)
    check_int("expert_capacity", "n_experts", n_experts, 1)
    check_int("expert_capacity", "k", k, 1)
    if isinstance(capacity_factor, (bool, np.bool_)) or not isinstance(capacity_factor, (int, float, np.number)) \
            or not 0 < capacity_factor < math.inf:
        raise (ValueError if isinstance(capacity_factor, (int, float, np.number)) else TypeError)(
            f"expert_capacity: capacity_factor must be a finite number > 0, got {describe(capacity_factor)}")
    return int(math.ceil(round(capacity_factor * n_tokens * k / n_experts, 9)))


def expert_ffn_np(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """One expert's MLP on rows x (n, C): gelu(x @ w1) @ w2, w1 (C, H), w2 (H, C) (lesson 09's GELU)."""
    if x.shape[1] != w1.shape[0] or w2.shape != (w1.shape[1], w1.shape[0]):
        raise ValueError(f"expert_ffn_np: need x (n, C), w1 (C, H), w2 (H, C), got x {x.shape}, w1 {w1.shape}, "
                         f"w2 {w2.shape}")
    return gelu_np(x @ w1) @ w2

# %%
#| export
#| exercise 16.2
def dispatch(experts: np.ndarray, n_experts: int, capacity: int | None = None) -> Dispatch:
    """Sort the assignments experts (T, k) by expert (stable: token order within an expert).

    capacity None: dropless, every assignment kept. Else each expert keeps its first `capacity`
    assignments in token order and the rest are dropped (not routed, counted in `dropped`)."""
    ### BEGIN SOLUTION
    what = "dispatch"
    experts = check_experts(what, experts, n_experts)
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=n_experts).astype(np.int64)
    if capacity is not None:
        capacity = check_int(what, "capacity", capacity, 0)
        starts = np.cumsum(counts) - counts
        position = np.arange(order.size) - starts[flat[order]]
        order = order[position < capacity]
        counts = np.minimum(counts, capacity)
    kept = np.zeros(t * k, bool)
    kept[order] = True
    return Dispatch(order // k, order % k, counts, kept.reshape(t, k), int(t * k - order.size))
    ### END SOLUTION


def grouped_gemm(x: np.ndarray, group_sizes: np.ndarray, w: np.ndarray,
                 matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul) -> np.ndarray:
    """Rows x (R, d_in), in groups of group_sizes (E,) consecutive rows (sum R), times w (E, d_in,
    d_out): row block e @ w[e]. Returns (R, d_out). One matmul(x_block, w[e]) per non-empty group."""
    ### BEGIN SOLUTION
    what = "grouped_gemm"
    x, w = np.asarray(x), np.asarray(w)
    sizes = np.asarray(group_sizes)
    check_rows(what, "x", x)
    check_rows(what, "w", w, 3)
    if sizes.shape != (w.shape[0],) or sizes.sum() != x.shape[0] or (sizes < 0).any():
        raise ValueError(f"{what}: group_sizes must be {w.shape[0]} counts >= 0 summing to the {x.shape[0]} rows of x, "
                         f"got {sizes.tolist()}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{what}: x has {x.shape[1]} columns but w is {w.shape} (E, d_in, d_out)")
    out = np.empty((x.shape[0], w.shape[2]), np.result_type(x, w))
    lo = 0
    for e, n in enumerate(sizes.tolist()):
        if n:
            out[lo:lo + n] = matmul(x[lo:lo + n], w[e])
        lo += n
    return out
    ### END SOLUTION


def combine(y: np.ndarray, d: Dispatch, weights: np.ndarray, n_tokens: int) -> np.ndarray:
    """The layer's output (n_tokens, d_out): out[t] = sum over t's routed rows r of
    weights[t, slot[r]] * y[r]; y (R, d_out) in d's (expert-sorted) order, weights (T, k).
    Tokens with no routed row get zeros."""
    ### BEGIN SOLUTION
    y, weights = np.asarray(y), np.asarray(weights)
    check_rows("combine", "y", y)
    if y.shape[0] != d.token.size or weights.shape != d.kept.shape or weights.shape[0] != n_tokens:
        raise ValueError(f"combine: y {y.shape} must have one row per routed assignment ({d.token.size}) and weights "
                         f"the shape of the routing {d.kept.shape} with n_tokens={n_tokens} rows, got {weights.shape}")
    out = np.zeros((n_tokens, y.shape[1]), np.result_type(y, weights))
    np.add.at(out, d.token, weights[d.token, d.slot][:, None] * y)
    return out
    ### END SOLUTION

# %% tags=["check"]
check("16.2")

# %% [markdown]
# The two ways side by side on one batch: 2048 tokens, 8 experts, k = 2, a router skewed as real
# routers are early in training. With capacity factor 1.0 the popular experts overflow and drop
# tokens; 1.25 drops fewer; dropless drops none. The grouped GEMM does exactly the routed work
# (fewer multiply-adds when rows are dropped); a padded batched matmul (every expert padded to
# the largest group) does more, the more so the more skewed the router.

# %% tags=["demo"]
T, C, H, E, k = (2048 if not SMALL else 256), 32, 64, 8, 2
rng = np.random.default_rng(1)
x = rng.standard_normal((T, C))
w_gate = rng.standard_normal((C, E)) * 0.3 + np.linspace(1, 0, E) * 0.6
w1, w2 = rng.standard_normal((E, C, H)) / np.sqrt(C), rng.standard_normal((E, H, C)) / np.sqrt(H)
g = top_k_gating(Tensor(x @ w_gate), k)
weights = g.weights.numpy()
for cf in [1.0, 1.25, 2.0, None]:
    cap = None if cf is None else expert_capacity(T, E, k, cf)
    d = dispatch(g.experts, E, cap)
    macs = []
    h = grouped_gemm(x[d.token], d.group_sizes, w1, matmul=lambda a, b: macs.append(a.shape[0] * a.shape[1] * b.shape[1]) or a @ b)
    y = combine(grouped_gemm(gelu_np(h), d.group_sizes, w2), d, weights, T)
    padded = E * d.group_sizes.max() * C * H
    label = "dropless" if cf is None else f"capacity factor {cf} (capacity {cap})"
    print(f"{label:>34}: dropped {d.dropped:4d} assignments, {d.dropped_tokens:3d} whole tokens; first GEMM "
          f"{sum(macs) / 1e6:.2f} M MACs, padded to the largest group {padded / 1e6:.2f} M MACs")
print("rows per expert (dropless):", d.group_sizes)

# %% [markdown]
# Live: the same tokens through routers of E experts, top-k, with the skew of the cell above
# scaled (0: a random router). The bars are each expert's assignments, the dashed line its
# capacity: what is above it (red) is dropped. A capacity factor of 1 drops tokens as soon as the
# router is uneven; raising it buys fewer drops with more padding, and more experts with the
# same skew drop more.

# %% tags=["demo"]
import ipywidgets as widgets

from course.live import live

rng_live = np.random.default_rng(2)
x_live = rng_live.standard_normal((T, C))
w_live = {e: rng_live.standard_normal((C, e)) * 0.3 for e in (4, 8, 16, 32)}


def draw_capacity(capacity_factor: float, experts: int, k: int, skew: float):
    k = min(k, experts)
    g = top_k_gating(Tensor(x_live @ (w_live[experts] + np.linspace(1, 0, experts) * skew)), k)
    cap = expert_capacity(T, experts, k, capacity_factor)
    d = dispatch(g.experts, experts, cap)
    load = np.bincount(g.experts.ravel(), minlength=experts)
    fig, ax = plt.subplots(figsize=(9, 3.4), gridspec_kw=dict(left=0.08, right=0.81, bottom=0.14, top=0.84))  # no tight_layout: quicker
    ax.bar(range(experts), np.minimum(load, cap), color="C0", label="routed")
    ax.bar(range(experts), np.maximum(load - cap, 0), bottom=np.minimum(load, cap), color="C3", label="dropped")
    ax.axhline(cap, color="k", ls="--", lw=1, label=f"capacity {cap}")
    ax.axhline(T * k / experts, color="0.5", ls=":", lw=1, label="balanced load")
    ax.set(xlabel="expert", ylabel="assignments", ylim=(0, max(load.max(), cap) * 1.15),
           xticks=range(0, experts, max(1, experts // 16)))
    ax.set_title(f"T={T}, E={experts}, k={k}, capacity factor {capacity_factor:.2f}\n{d.dropped} of {T * k} "
                 f"assignments dropped ({d.dropped / (T * k):.1%}), {d.dropped_tokens} tokens lose every expert",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: it hides no bar
    return fig


live(draw_capacity, capacity_factor=(0.5, 2.0, 0.05), experts=widgets.Dropdown(options=[4, 8, 16, 32], value=8),
     k=(1, 4), skew=(0.0, 3.0))

# %% [markdown]
# ## 3. The MoE layer, with autograd
#
# To train, the layer must be differentiable: the gradient flows to the expert weights, to the
# tokens, and through the combine weights to the router. Two new ops do it, each with its
# backward next to its forward:
#
# - `grouped_matmul(x, group_sizes, w)`: exercise 16.2's grouped GEMM as an autograd op. Its
#   backward is again grouped: `dx_e = g_e @ w_e^T` and `dw_e = x_e^T @ g_e` per group (zero for
#   an expert with no rows).
# - `scatter_rows(src, index, n)`: `out[index[r]] += src[r]`, an (n, d) result; its backward is the
#   gather `g[index]`.
#
# The gather `x[d.token]` and the weights `gate.weights[d.token, d.slot]` are plain indexing,
# whose backward lesson 02 wrote (with `np.add.at`, so repeated tokens accumulate). The layer:
#
# ```
# logits = x @ W_gate; gate = top_k_gating(logits, k); d = dispatch(gate.experts, E, capacity)
# h = gelu(grouped_matmul(x[d.token], sizes, W1)); y_rows = grouped_matmul(h, sizes, W2)
# out = scatter_rows(y_rows * gate.weights[d.token, d.slot][:, None], d.token, T)
# ```
#
# The layer takes its router and dispatch through `ops` (a `MoEOps`: gate, dispatch,
# grouped_matmul, scatter_rows), defaulting to this lesson's functions; the tests pass their own
# router and dispatch so that this exercise is graded on its own. It keeps what it decided in
# `self.last` (logits, gate, dispatch) for the balancing losses and the load plots.
#
# **Exercise 16.3.** Write `grouped_matmul`, `scatter_rows` and `MoEMLP.forward`. In `forward`,
# take the pieces from `ops = self.ops or default_ops()`, flatten x to (T, C) rows and give the
# result x's shape, compute the capacity with `expert_capacity` (given) when `capacity_factor` is
# set, from **every** token of the call (for x of shape (B, T, C) that is B * T tokens, not T),
# and store `self.last = LayerRecord(logits, gate, dispatch)`. Keep everything a layer needs for
# its backward in the graph, not in `self`: a layer applied twice (`layer(layer(x))`) must get
# both gradients right. A float32 layer given float32 x returns float32, and so do both ops for
# float32 inputs. Errors, each a ValueError: `grouped_matmul` with group sizes that are not E
# counts >= 0 summing to the rows of x (the message names `group_sizes`), `scatter_rows` with an
# index that is not one integer in [0, n) per row of src (it names `index`), and `forward` with
# an x whose last dimension is not `n_embd` (it names `n_embd` and x's shape).

# %%
#| export
class MoEOps(NamedTuple):
    """The pieces an MoE layer is made of (replaceable, e.g. by a test's own versions)."""
    gate: Callable
    dispatch: Callable
    grouped_matmul: Callable
    scatter_rows: Callable


def default_ops() -> MoEOps:
    """This module's top_k_gating, dispatch, grouped_matmul, scatter_rows (looked up when called)."""
    return MoEOps(top_k_gating, dispatch, grouped_matmul, scatter_rows)


class LayerRecord(NamedTuple):
    """What an MoE layer decided in its last forward pass."""
    logits: Tensor
    gate: Gate
    dispatch: Dispatch

# %%
#| export
#| exercise 16.3
def grouped_matmul(x: Tensor, group_sizes: np.ndarray, w: Tensor) -> Tensor:
    """Autograd grouped GEMM: rows x (R, d_in) in groups of group_sizes (E,) consecutive rows,
    times w (E, d_in, d_out); returns (R, d_out). Backward per group: dx_e = g_e w_e^T,
    dw_e = x_e^T g_e (zeros for empty groups)."""
    ### BEGIN SOLUTION
    what = "grouped_matmul"
    x = x if isinstance(x, Tensor) else Tensor(x)
    w = w if isinstance(w, Tensor) else Tensor(w)
    check_rows(what, "x", x)
    check_rows(what, "w", w, 3)
    sizes = np.asarray(group_sizes, dtype=np.int64)
    if sizes.shape != (w.shape[0],) or sizes.sum() != x.shape[0] or (sizes < 0).any() or w.shape[1] != x.shape[1]:
        raise ValueError(f"{what}: need group_sizes of {w.shape[0]} counts >= 0 summing to the rows of x {x.shape} "
                         f"and w (E, {x.shape[1]}, d_out); got group_sizes {sizes.tolist()}, w {w.shape}")
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    xd, wd = x.data, w.data
    out = np.zeros((x.shape[0], w.shape[2]), np.result_type(xd, wd))
    for e in range(sizes.size):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = xd[lo:hi] @ wd[e]

    def vjp(g: np.ndarray) -> tuple:
        gx, gw = np.zeros_like(xd), np.zeros_like(wd)
        for e in range(sizes.size):
            lo, hi = bounds[e], bounds[e + 1]
            if hi > lo:
                gx[lo:hi] = g[lo:hi] @ wd[e].T
                gw[e] = xd[lo:hi].T @ g[lo:hi]
        return gx, gw

    return x._record(x._new(out), (x, w), vjp, "grouped_matmul")
    ### END SOLUTION


def scatter_rows(src: Tensor, index: np.ndarray, n: int) -> Tensor:
    """out (n, d) with out[index[r]] += src[r] for every row r of src (R, d); index (R,) ints in
    [0, n). Backward: g[index]."""
    ### BEGIN SOLUTION
    what = "scatter_rows"
    src = src if isinstance(src, Tensor) else Tensor(src)
    check_rows(what, "src", src)
    index = np.asarray(index)
    n = check_int(what, "n", n, 0)
    if index.shape != (src.shape[0],) or index.dtype.kind not in "iu" or (index.size and (index.min() < 0 or index.max() >= n)):
        raise ValueError(f"{what}: index must hold {src.shape[0]} integers in [0, {n}), got shape {index.shape}, "
                         f"dtype {index.dtype}" + (f", values {index.min()}..{index.max()}" if index.size else ""))
    out = np.zeros((n, src.shape[1]), src.dtype)
    np.add.at(out, index, src.data)
    return src._record(src._new(out), (src,), lambda g: (g[index],), "scatter_rows")
    ### END SOLUTION


class MoEMLP(Module):
    """A mixture-of-experts MLP: x (..., C) -> (..., C). Router W_gate (C, E) (the `router`
    Parameter), experts w1 (E, C, H) and w2 (E, H, C): expert e is gelu(x @ w1[e]) @ w2[e].
    Each token goes to its top-k experts (ops.gate); capacity_factor None = dropless, else each
    expert keeps expert_capacity(T, E, k, capacity_factor) rows (ops.dispatch). dtype float32 by
    default (float64 for checks). self.last: LayerRecord of the last forward."""

    def __init__(self, n_embd: int, n_experts: int, k: int, hidden: int, rng: np.random.Generator | None = None,
                 capacity_factor: float | None = None, dtype: Any = np.float32, ops: MoEOps | None = None,
                 init: float = 0.02, proj_init: float = 0.02):
        what = "MoEMLP"
        check_int(what, "n_embd", n_embd, 1)
        check_int(what, "n_experts", n_experts, 1)
        check_int(what, "k", k, 1, n_experts)
        check_int(what, "hidden", hidden, 1)
        rng = rng if rng is not None else np.random.default_rng(0)
        self.n_experts, self.k, self.capacity_factor = n_experts, k, capacity_factor
        self.router = Parameter((rng.standard_normal((n_embd, n_experts)) * init).astype(dtype))
        self.w1 = Parameter((rng.standard_normal((n_experts, n_embd, hidden)) * init).astype(dtype))
        self.w2 = Parameter((rng.standard_normal((n_experts, hidden, n_embd)) * proj_init).astype(dtype))
        self.ops = ops
        self.last: LayerRecord | None = None

    def forward(self, x: Tensor) -> Tensor:
        ### BEGIN SOLUTION
        ops = self.ops or default_ops()
        x = x if isinstance(x, Tensor) else Tensor(x)
        shape, c = x.shape, self.router.shape[0]
        if len(shape) == 0 or shape[-1] != c:
            raise ValueError(f"MoEMLP: x must end in n_embd={c}, got shape {shape}")
        flat = x.reshape(-1, c)
        t = flat.shape[0]
        logits = flat @ self.router
        gate = ops.gate(logits, self.k)
        cap = None if self.capacity_factor is None else expert_capacity(t, self.n_experts, self.k, self.capacity_factor)
        d = ops.dispatch(gate.experts, self.n_experts, cap)
        h = gelu(ops.grouped_matmul(flat[d.token], d.group_sizes, self.w1))
        rows = ops.grouped_matmul(h, d.group_sizes, self.w2)
        out = ops.scatter_rows(rows * gate.weights[d.token, d.slot].reshape(-1, 1), d.token, t)
        self.last = LayerRecord(logits, gate, d)
        return out.reshape(*shape)
        ### END SOLUTION

# %% tags=["check"]
check("16.3")

# %% [markdown]
# ### An MoE tiny GPT
#
# Lesson 09's GPT with every block's MLP replaced by an `MoEMLP` (`MoEGPT`, given): in training
# mode it adds `aux_coef * L_aux + z_coef * L_z` of every layer to the language-model loss and
# records each layer's load. Three models, trained the same way on the same batches:
#
# - **dense**: the MLP of width H (the baseline),
# - **MoE**: E experts of width H, top-1: the *active* parameters per token match the dense
#   model's (plus a router), the total parameters are E times the MLP's,
# - **dense, wide**: one MLP of width E * H: the *total* parameters match the MoE's, and so does
#   the memory, but every token pays for all of them.
#
# The MoE's promise is the wide model's quality at the narrow model's cost per token (Switch
# reports it at scale). At this tiny scale and a few hundred steps the three losses lie close
# together and their order can change with the seed and the step count; read the other columns:
# the MoE stores about as many bytes as the wide model and computes about as much per token as
# the narrow one. FLOPs per token are the forward MLP multiply-adds times 2 (the router
# included); bytes are all float32 parameters, embeddings and attention included.

# %%
#| export
class DenseMLP(Module):
    """x (..., C) -> proj(gelu(fc(x))) with fc (C, hidden), proj (hidden, C), biases; lesson 09's
    MLP at any width."""

    def __init__(self, n_embd: int, hidden: int, rng: np.random.Generator, proj_init: float = 0.02):
        from minitorch.nn import Linear

        self.fc = Linear(n_embd, hidden, rng=rng, init=0.02)
        self.proj = Linear(hidden, n_embd, rng=rng, init=proj_init)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(gelu(self.fc(x)))


def dense_gpt(config: GPTConfig, hidden: int, seed: int = 0) -> GPT:
    """Lesson 09's GPT with MLPs of width `hidden` (4 * n_embd is lesson 09's own)."""
    model = GPT(config, seed)
    rng = np.random.default_rng(seed + 1)
    for block in model.blocks:
        block.mlp = DenseMLP(config.n_embd, hidden, rng, 0.02 / math.sqrt(2 * config.n_layer))
    return model


class MoEGPT(GPT):
    """Lesson 09's GPT with an MoEMLP(n_embd, n_experts, k, hidden) in every block. In training
    mode forward adds aux_coef * load_balancing_loss + z_coef * router_z_loss of every layer to the
    loss and appends each layer's rows per expert to load_history ((n_layer, E) per step)."""

    def __init__(self, config: GPTConfig, n_experts: int, k: int, hidden: int, capacity_factor: float | None = None,
                 aux_coef: float = 0.01, z_coef: float = 1e-3, seed: int = 0):
        super().__init__(config, seed)
        rng = np.random.default_rng(seed + 1)
        for block in self.blocks:
            block.mlp = MoEMLP(config.n_embd, n_experts, k, hidden, rng, capacity_factor,
                               proj_init=0.02 / math.sqrt(2 * config.n_layer))
        self.aux_coef, self.z_coef = aux_coef, z_coef
        self.load_history: list[np.ndarray] = []

    def forward(self, idx: Any, targets: Any = None) -> tuple[Tensor, Tensor | None]:
        logits, loss = super().forward(idx, targets)
        if self.training:
            recs = [block.mlp.last for block in self.blocks]
            self.load_history.append(np.stack([r.dispatch.group_sizes for r in recs]))
            if loss is not None:
                for r in recs:
                    loss = loss + load_balancing_loss(r.gate.probs, r.gate.experts) * self.aux_coef
                    loss = loss + router_z_loss(r.logits) * self.z_coef
        return logits, loss


def mlp_costs(model: GPT) -> dict[str, float]:
    """Parameters of the model's MLPs (total, and active per token: k of E experts plus the
    router), forward MLP FLOPs per token (2 per multiply-add), and float32 bytes of all parameters."""
    total = active = 0
    for block in model.blocks:
        mlp = block.mlp
        n = sum(p.size for p in mlp.parameters())
        total += n
        if isinstance(mlp, MoEMLP):
            expert = (mlp.w1.size + mlp.w2.size) // mlp.n_experts
            n -= (mlp.n_experts - mlp.k) * expert
        active += n
    return {"mlp_params": total, "active_mlp_params": active, "mlp_flops_per_token": 2.0 * active,
            "param_bytes": 4.0 * sum(p.size for p in model.parameters())}

# %% tags=["demo"]
from minitorch.gpt import CharTokenizer, evaluate_loss, load_corpus, split_ids, train_gpt

text = load_corpus()
tok = CharTokenizer.from_text(text)
train_ids, val_ids = split_ids(tok.encode(text))
cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=32)
H_MLP, N_EXP = 4 * cfg.n_embd, 4
STEPS = 10 if SMALL else 400
models = {"dense (width H)": dense_gpt(cfg, H_MLP), f"MoE ({N_EXP} x H, top-1)": MoEGPT(cfg, N_EXP, 1, H_MLP),
          f"dense, wide ({N_EXP}H)": dense_gpt(cfg, N_EXP * H_MLP)}
results = {}
for name, model in models.items():
    hist = train_gpt(model, train_ids, STEPS, batch_size=16, lr=3e-3, warmup=min(50, STEPS // 4), seed=0,
                     progress=False)
    results[name] = (evaluate_loss(model, val_ids, 16 if SMALL else 64), hist["seconds"], mlp_costs(model))
print(f"{'model':>24} {'val loss':>9} {'MLP params':>11} {'active':>9} {'MLP FLOPs/token':>16} {'param bytes':>12} {'train s':>8}")
for name, (loss, secs, c) in results.items():
    print(f"{name:>24} {loss:9.3f} {c['mlp_params']:>11,} {c['active_mlp_params']:>9,} {c['mlp_flops_per_token']:>16,.0f} "
          f"{c['param_bytes']:>12,.0f} {secs:8.1f}")

# %% [markdown]
# The load of each expert over training (share of the tokens of a batch, first layer): with the
# auxiliary loss the shares stay near 1/E; try `aux_coef=0` in `MoEGPT` and watch a collapse.

# %% tags=["demo"]
moe = models[f"MoE ({N_EXP} x H, top-1)"]
loads = np.array([h[0] / h[0].sum() for h in moe.load_history])
plt.figure(figsize=(7, 3))
plt.stackplot(np.arange(len(loads)), loads.T, labels=[f"expert {e}" for e in range(N_EXP)])
plt.xlabel("training step")
plt.ylabel("share of tokens, layer 0")
plt.legend(fontsize=7, loc="upper right")
plt.title("expert load over training")
plt.show()
print("last step's shares, layer 0:", np.round(loads[-1], 3))

# %% [markdown]
# ## 4. All-to-all
#
# With expert parallelism every rank sends a different number of token rows to every other rank:
# an **all-to-all with uneven splits** (MPI's `Alltoallv`, `torch.distributed.all_to_all_single`
# with split sizes). Rank r holds rows x, of which the first `send_counts[0]` go to rank 0, the
# next `send_counts[1]` to rank 1, and so on; it receives `recv_counts[s]` rows from each rank s
# and returns them concatenated in rank order. Its own block stays local.
#
# Build it from lesson 12's non-blocking calls, `comm.irecv(out, src, tag)` and
# `comm.isend(array, dst, tag)` (pass `all_to_all`'s `tag` on), finished by one
# `comm.waitall(requests)`: post everything, then wait for everything, as MPICH's `Alltoallv`
# does (in batches of up to 32 pairs), NCCL's all-to-all (a group of `ncclSend`/`ncclRecv`) and
# PyTorch's `batch_isend_irecv`.
#
# 1. Allocate the result, `(sum(recv_counts), ...)`, once: every block received lands in its own
#    rows of it, so nothing is copied or concatenated afterwards.
# 2. **Post every receive first**, into its rows: `comm.irecv(out[lo:hi], src)`. A message that
#    arrives for a posted receive goes straight into place; one that arrives before its receive
#    is posted is buffered and copied once more (MPI's "unexpected message" queue).
# 3. Post every send, `comm.isend(x[lo:hi], dst)`: from where the block is, without a copy (the
#    block must not change until `waitall` returns).
# 4. Copy the own block into place (it stays local: `send_counts[r]` must equal
#    `recv_counts[r]`), then `comm.waitall` on all the requests.
#
# Check the counts before posting anything, each a ValueError: `comm.size` send and receive counts,
# the send counts summing to x's rows (the message names `send_counts`), and the own block, whose
# message names the rank and both counts in this order, as in
# `all_to_all: rank 1 sends rank 1 (itself) send_counts[1] = 3 rows but expects recv_counts[1] = 4`
# (the test looks for `rank 1`, `send_counts[1] = 3` and `recv_counts[1] = 4`). The result has x's
# dtype and is a new array even on one rank, or when every count is 0.
#
# Order the messages as a **pairwise exchange**: step s = 1 .. N-1 sends to rank `(r + s) % N`
# and receives from rank `(r - s) % N`. At every step each rank sends to a different rank, so no
# rank is the first target of everyone (with "rank 0 first" every rank sends to rank 0 at once,
# and rank 0's incoming link serialises them); it is the order of MPICH's `Alltoall` for long
# messages (Thakur, Rabenseifner and Gropp 2005).
#
# In the alpha-beta model of lesson 12, with m bytes per block, that is
#
# `T = (N - 1) (alpha + m beta)`, and each rank sends `(N - 1) m` bytes,
#
# against a ring all-reduce's `2(N-1)/N S` for the same S = N m bytes: half of it. But every rank
# sends to every other rank, so an all-to-all needs the network's bisection bandwidth, not just
# links to neighbours, and it sits on the critical path twice per MoE layer (dispatch, then
# combine), forward and backward. That is why expert parallelism wants the fastest links there
# are (NVLink inside a node; DeepSeek-V3 limits each token to 4 nodes).
#
# `recv_counts` must be known in advance (the receiver allocates its buffer), so the counts go
# first: `exchange_counts` is an all-to-all of one integer per pair. A block whose size differs
# from what `recv_counts` says is caught by `waitall`, which names both ranks and the sizes.
#
# **Exercise 16.4.** Write `all_to_all` and `exchange_counts`.

# %%
#| export
#| exercise 16.4
def all_to_all(comm: Communicator, x: np.ndarray, send_counts: Any, recv_counts: Any, tag: int = 0) -> np.ndarray:
    """Rows x (n, ...) split by send_counts (comm.size counts, sum n): block j goes to rank j.
    Returns the blocks received, recv_counts[s] rows from rank s, concatenated in rank order, shape
    (sum(recv_counts), ...), x's dtype. Pairwise order: step s sends to (rank + s) % size and
    receives from (rank - s) % size; every receive is posted (into its rows of the result) before
    the sends; the own block is copied. Blocks are sent even when empty."""
    ### BEGIN SOLUTION
    what = "all_to_all"
    if not (type(x) is np.ndarray and x.dtype.kind in "biuf" and x.ndim and type(tag) is int  # noqa: E721
            and 0 <= tag < 2**20 and hasattr(comm, "isend")):  # (the fast path of the checks)
        x = check_a2a_args(what, comm, x, tag)
    n, r = comm.size, comm.rank
    send, recv = check_counts(what, "send_counts", send_counts), check_counts(what, "recv_counts", recv_counts)
    if len(send) != n or len(recv) != n or x.ndim < 1 or sum(send) != x.shape[0]:
        raise ValueError(f"{what}: rank {r}: need {n} send and {n} receive counts, the send counts summing to the "
                         f"{x.shape[0] if x.ndim else 0} rows of x; got send_counts {send}, recv_counts {recv}")
    if send[r] != recv[r]:
        raise ValueError(f"{what}: rank {r} sends rank {r} (itself) send_counts[{r}] = {send[r]} rows but expects "
                         f"recv_counts[{r}] = {recv[r]}")
    so = [0, *itertools.accumulate(send)]  # Python ints: a small all-to-all is bound by its Python
    ro = [0, *itertools.accumulate(recv)]
    out = np.empty((ro[-1], *x.shape[1:]), x.dtype)
    steps = range(1, n)
    requests = [comm.irecv(out[ro[src]:ro[src + 1]], src, tag) for src in [(r - s) % n for s in steps]]
    requests += [comm.isend(x[so[dst]:so[dst + 1]], dst, tag) for dst in [(r + s) % n for s in steps]]
    out[ro[r]:ro[r + 1]] = x[so[r]:so[r + 1]]
    comm.waitall(requests)
    return out
    ### END SOLUTION


def exchange_counts(comm: Communicator, send_counts: Any, tag: int = 0) -> np.ndarray:
    """What every rank will send to this one: recv_counts[s] = rank s's send_counts[rank], as an
    int64 array (size,). send_counts: comm.size integers >= 0 (an all-to-all of one per pair)."""
    ### BEGIN SOLUTION
    counts = np.asarray(check_counts("exchange_counts", "send_counts", send_counts), dtype=np.int64)
    if counts.size != comm.size:
        raise ValueError(f"exchange_counts: rank {comm.rank}: need {comm.size} counts, got {counts.tolist()}")
    ones = [1] * comm.size
    return all_to_all(comm, counts, ones, ones, tag=tag)
    ### END SOLUTION

# %% tags=["check"]
check("16.4")

# %% [markdown]
# Four simulated ranks with uneven splits, and the timeline: three steps, every rank sending and
# receiving at once. Then the same function under `mpiexec -n 4`: the received rows agree bit for
# bit and so do the byte counters.

# %% tags=["demo"]
def a2a_demo(comm, rows):
    rng = np.random.default_rng(comm.rank)
    send = rng.integers(0, rows, comm.size)
    x = np.arange(send.sum() * 4, dtype=np.float64).reshape(-1, 4) + 1000 * comm.rank
    return all_to_all(comm, x, send, exchange_counts(comm, send, tag=1))


a2a_sim = run(a2a_demo, 4, 3000, alpha=5e-6, beta=1e-10)
print("rows received per rank:", [len(r) for r in a2a_sim.results], "bytes sent per rank:", a2a_sim.bytes_sent())
a2a_sim.plot(title="all-to-all with uneven splits, 4 simulated ranks")
plt.show()
if mpi_status()[0]:
    a2a_mpi = run(a2a_demo, 4, 3000, engine="mpi")
    same = all(np.array_equal(a, b) for a, b in zip(a2a_sim.results, a2a_mpi.results))
    print(f"MPI: bit-identical to the simulator: {same}; bytes sent {a2a_mpi.bytes_sent()}")
else:
    print("MPI cannot start here:", mpi_status()[1])

# %% [markdown]
# How close does it come to MPI's own `MPI_Alltoallv` (C, in the same processes)? Two ranks,
# uneven splits, 4 KiB, 64 KiB and 1 MiB per rank, the best of five trials of each, the three
# taking turns. The third is the same exchange in raw mpi4py calls (`Irecv`/`Isend`/`Waitall`
# straight from Python: no checks, no counters, no timeline). The cell prints the machine's load
# and its runnable/total threads before and after the runs: the times mean something only on a
# quiet machine, and the ratios travel better than the times. (`make bench L=moe` runs the same
# comparison on 2 and 4 ranks.)

# %%
#| export
def mpi4py_all_to_all(x: np.ndarray, send_counts: list[int], recv_counts: list[int]) -> np.ndarray:
    """all_to_all's exchange in raw mpi4py calls on MPI_COMM_WORLD (Irecv into the result, Isend,
    Waitall; no checks, no counters, no timeline): the least a Python all-to-all costs. x: (n, d)
    float64 rows, C-contiguous; counts: Python ints. Under MPI only (run(..., engine="mpi"))."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    n, r = world.Get_size(), world.Get_rank()
    so, ro = [0, *itertools.accumulate(send_counts)], [0, *itertools.accumulate(recv_counts)]
    out = np.empty((ro[-1], x.shape[1]))
    reqs = [world.Irecv([out[ro[s]:ro[s + 1]], MPI.DOUBLE], s, 9) for s in [(r - i) % n for i in range(1, n)]]
    reqs += [world.Isend([x[so[d]:so[d + 1]], MPI.DOUBLE], d, 9) for d in [(r + i) % n for i in range(1, n)]]
    out[ro[r]:ro[r + 1]] = x[so[r]:so[r + 1]]
    MPI.Request.Waitall(reqs)
    return out

# %%
#| export
def machine_state() -> str:
    """machine_load() and, where /proc/loadavg exists (Linux), 'r/t threads runnable': what else
    competes for the cores while something is timed."""
    from minitorch.parallel import machine_load

    try:
        with open("/proc/loadavg") as f:
            threads = f.read().split()[3]
        return f"{machine_load()}, {threads} threads runnable"
    except (OSError, IndexError):
        return f"{machine_load()}, threads unknown"


def alltoall_timings(comm: Communicator, sizes: list[int], budget: float = 0.05,
                     a2a: Callable | None = None) -> list[tuple[int, float, float, float]]:
    """On every rank of an MPI run: per size (bytes per rank, float64 rows of 8, uneven splits), the
    seconds per all-to-all of `a2a(comm, ...)` (default: all_to_all), of `MPI.Alltoallv` and of
    `mpi4py_all_to_all`, each the best of 5 trials of about `budget` seconds, interleaved
    (mpi_best_seconds); raises if they disagree."""
    from mpi4py import MPI

    from minitorch.parallel import mpi_best_seconds

    a2a = a2a or all_to_all
    world, n, r, out = MPI.COMM_WORLD, comm.size, comm.rank, []
    for nbytes in sizes:
        rng = np.random.default_rng(100 + r)
        send = np.floor(rng.dirichlet(np.ones(n) * 2) * max(n, nbytes // 64)).astype(np.int64)
        recv = exchange_counts(comm, send)
        x, y = rng.standard_normal((int(send.sum()), 8)), np.empty((int(recv.sum()), 8))
        sc, rc = send * 8, recv * 8
        sd, rd = np.concatenate([[0], np.cumsum(sc)[:-1]]), np.concatenate([[0], np.cumsum(rc)[:-1]])
        send_list, recv_list = send.tolist(), recv.tolist()
        best = mpi_best_seconds([lambda: a2a(comm, x, send, recv),
                                 lambda: world.Alltoallv([x, sc, sd, MPI.DOUBLE], [y, rc, rd, MPI.DOUBLE]),
                                 lambda: mpi4py_all_to_all(x, send_list, recv_list)], budget)
        for name, got in (("all_to_all", a2a(comm, x, send, recv)),
                          ("mpi4py_all_to_all", mpi4py_all_to_all(x, send_list, recv_list))):
            if not np.array_equal(got, y):
                raise AssertionError(f"rank {r}: {name} and Alltoallv disagree at {nbytes} bytes")
        out.append((nbytes, *best))
    return out

# %% tags=["demo"]
if mpi_status()[0]:
    before = machine_state()
    a2a_rows = run(alltoall_timings, 2, [2**12, 2**16, 2**20], engine="mpi").results[0]
    print(f"2 MPI ranks; before: {before}; after: {machine_state()}")
    print(f"{'bytes/rank':>10} {'all_to_all':>11} {'Alltoallv':>10} {'ratio':>6} {'raw mpi4py':>11} {'ratio':>6}")
    for nb, ours, theirs, floor in a2a_rows:
        print(f"{nb:>10} {ours * 1e6:>9.1f}us {theirs * 1e6:>8.1f}us {ours / theirs:>5.2f}x {floor * 1e6:>9.1f}us "
              f"{floor / theirs:>5.2f}x")
else:
    print("MPI cannot start here:", mpi_status()[1])

# %% [markdown]
# What we measured: ranges over six runs of this cell on a 2-core Intel Xeon VM (load average
# 0.6 to 0.8, one to three threads runnable), and over six runs of `make bench L=moe` on a 2-core
# Zen 4 VM (from [interconnects](../hardware_notes/interconnects.md#all-to-all-and-expert-parallelism));
# the ratio is `all_to_all`'s time over `Alltoallv`'s:
#
# | per rank | Xeon: all_to_all | Xeon: raw mpi4py | Zen 4: all_to_all |
# |---|---|---|---|
# | 4 KiB | 2.8-3.0x | 1.6-1.8x | 1.7-2.6x |
# | 64 KiB | 1.5-1.6x | 0.93-1.02x | 0.98-1.12x |
# | 1 MiB | 0.79-0.91x | 0.74-0.85x | 0.55-0.61x |
#
# At 4 KiB a message costs its per-call overhead, not its bytes (alpha, not beta): C's is a few
# microseconds, the same calls from Python already cost more (raw mpi4py), and the
# communicator's checks, counters and timeline more again. At 1 MiB the order turns: `all_to_all`
# is **faster** than `Alltoallv`, and so is the raw mpi4py exchange. The bytes dominate there, and
# MPICH's collective moves them more slowly than point-to-point messages posted the same way (its
# own algorithm, not the pattern: the note has the measurements). So the Python all-to-all loses
# only where the messages are small, where an exchange is short anyway.

# %% [markdown]
# ## 5. Expert parallelism
#
# N ranks, E experts, E/N on each: rank r holds experts `r E/N .. (r+1) E/N - 1` and every rank
# holds the router. Each rank has its own tokens (its share of the batch, as in data
# parallelism). One forward pass of the layer on rank r:
#
# 1. route its tokens and `dispatch` them (dropless): the rows come out sorted by expert, and
#    since experts are numbered rank by rank, the rows for rank 0 come first, then rank 1's, ...;
# 2. tell every rank how many rows of each of its experts are coming (an all-to-all of the
#    per-expert counts, E/N integers per pair), then send the rows (**dispatch all-to-all**);
# 3. the rows received are ordered by source rank, and within a source by local expert: reorder
#    them by local expert (a stable sort), run the local experts (grouped GEMM), put them back in
#    the received order;
# 4. send every row back to the rank it came from (**combine all-to-all**: the same counts, send
#    and receive swapped), and combine with the weights as on one process.
#
# The backward pass runs the same two exchanges in reverse: the gradient of an all-to-all is the
# all-to-all with send and receive counts swapped. `all_to_all_op` is that autograd op. No
# gradient of an expert needs reducing: all tokens that use expert e arrive at e's rank. The
# router's gradient is a sum over every rank's tokens, like a data-parallel gradient.
#
# **EP x DP.** With `ep * dp` ranks, rank `d * ep + e` is EP position e of data-parallel replica
# d: each group of `ep` consecutive ranks is one expert-parallel group holding all experts, and
# the ranks `e, ep + e, 2 ep + e, ...` hold the same experts. After the backward pass, each expert
# gradient is all-reduced over its **DP group** (the ranks with the same experts), each
# non-expert gradient (the router here; attention, embeddings in a full model) over **all**
# ranks. Reducing the expert gradients over the EP group instead adds up different experts'
# gradients: same shapes, no error, wrong model.
#
# **Exercise 16.5.** Write `all_to_all_op`, `ExpertParallelMoE.forward` and `ep_dp_train_step`.
# The all-to-all (and the layer's ops) come in as arguments, so this exercise is graded on its
# own. `ep_dp_groups` is given. Every row that travels has the model's dtype: a float32 layer
# sends float32 rows both ways and float32 gradients back, and `ep_dp_train_step` casts its x to
# the parameters' dtype first (as lesson 12's `dp_train_step` does), so that float64 data does
# not double the bytes of a float32 model's all-to-alls.

# %%
#| export
def ep_dp_groups(comm: Communicator, ep: int) -> tuple[Communicator, Communicator]:
    """(ep_group, dp_group) of this rank, rank = d * ep + e: ep_group = ranks d*ep .. d*ep+ep-1 (one
    replica's experts), dp_group = ranks e, ep + e, ... (the same experts in every replica)."""
    ep = check_int("ep_dp_groups", "ep", ep, 1, comm.size)
    if comm.size % ep:
        raise ValueError(f"ep_dp_groups: ep={ep} does not divide the {comm.size} ranks")
    d, e = divmod(comm.rank, ep)
    return (comm.group([d * ep + j for j in range(ep)]), comm.group([i * ep + e for i in range(comm.size // ep)]))

# %%
#| export
#| exercise 16.5
def all_to_all_op(comm: Communicator, x: Tensor, send_counts: Any, recv_counts: Any,
                  a2a: Callable | None = None) -> Tensor:
    """Autograd all-to-all of the rows of x (n, d): forward a2a(comm, x, send_counts, recv_counts)
    (default: all_to_all), x's dtype; backward a2a(comm, g, recv_counts, send_counts) with g cast to
    x's dtype (a float32 layer sends float32 gradients, whatever the loss was computed in)."""
    ### BEGIN SOLUTION
    check_counts("all_to_all_op", "send_counts", send_counts)  # (before anything is sent, whatever a2a checks)
    check_counts("all_to_all_op", "recv_counts", recv_counts)
    a2a = a2a or all_to_all
    x = x if isinstance(x, Tensor) else Tensor(x)
    out = x._new(a2a(comm, x.data, send_counts, recv_counts))
    return x._record(out, (x,), lambda g: (a2a(comm, np.ascontiguousarray(g, dtype=x.dtype), recv_counts, send_counts),),
                     "all_to_all")
    ### END SOLUTION


class ExpertParallelMoE(Module):
    """An MoEMLP's experts sharded over comm's ranks: rank r keeps experts [r E/N, (r+1) E/N) of
    `layer` (copies of w1, w2) and a copy of its router; dropless. forward(x) takes this rank's
    tokens x (T_r, C) and returns (T_r, C), equal to layer(x) on one process. a2a: the all-to-all
    (default: all_to_all); the layer's ops (or the defaults) route, dispatch and compute."""

    def __init__(self, comm: Communicator, layer: MoEMLP, a2a: Callable | None = None):
        if layer.n_experts % comm.size:
            raise ValueError(f"ExpertParallelMoE: {layer.n_experts} experts cannot be split evenly over {comm.size} ranks")
        self.comm, self.a2a, self.ops = comm, a2a, layer.ops
        self.n_experts, self.k = layer.n_experts, layer.k
        self.n_local = layer.n_experts // comm.size
        lo = comm.rank * self.n_local
        self.router = Parameter(layer.router.data)
        self.w1 = Parameter(layer.w1.data[lo:lo + self.n_local])
        self.w2 = Parameter(layer.w2.data[lo:lo + self.n_local])

    def expert_parameters(self) -> list[Parameter]:
        return [self.w1, self.w2]

    def shared_parameters(self) -> list[Parameter]:
        return [self.router]

    def forward(self, x: Tensor) -> Tensor:
        ### BEGIN SOLUTION
        ops = self.ops or default_ops()
        a2a = self.a2a or all_to_all
        comm, n, el = self.comm, self.comm.size, self.n_local
        x = x if isinstance(x, Tensor) else Tensor(x)
        check_rows("ExpertParallelMoE", "x", x)
        t = x.shape[0]
        gate = ops.gate(x @ self.router, self.k)
        d = ops.dispatch(gate.experts, self.n_experts, None)
        per_rank = d.group_sizes.reshape(n, el)
        send = per_rank.sum(axis=1)
        counts_in = a2a(comm, per_rank, [1] * n, [1] * n)  # (n, el): rows from source s for local expert j
        recv = counts_in.sum(axis=1)
        rows = all_to_all_op(comm, x[d.token], send, recv, a2a)
        label = np.repeat(np.tile(np.arange(el), n), counts_in.reshape(-1))
        perm = np.argsort(label, kind="stable")
        sizes = counts_in.sum(axis=0)
        h = gelu(ops.grouped_matmul(rows[perm], sizes, self.w1))
        y = ops.grouped_matmul(h, sizes, self.w2)[np.argsort(perm)]
        back = all_to_all_op(comm, y, recv, send, a2a)
        return ops.scatter_rows(back * gate.weights[d.token, d.slot].reshape(-1, 1), d.token, t)
        ### END SOLUTION


def ep_dp_train_step(comm: Communicator, dp_comm: Communicator, model: ExpertParallelMoE, x: np.ndarray,
                     target: np.ndarray, loss_fn: Callable[[Tensor, np.ndarray], Tensor], lr: float,
                     allreduce: Callable = ring_allreduce) -> float:
    """One SGD step (p -= lr * grad) of an EP x DP run: loss_fn(model(x), target) on this rank's
    tokens, backward, expert gradients all-reduced (summed) over dp_comm, the others over comm (all
    ranks). loss_fn must scale by the global batch so that the sums are the full gradient. x is
    cast to the parameters' dtype. Returns this rank's loss."""
    ### BEGIN SOLUTION
    for p in model.parameters():
        p.zero_grad()
    loss = loss_fn(model(Tensor(np.asarray(x, dtype=model.router.dtype))), target)
    loss.backward()
    for group, params in ((dp_comm, model.expert_parameters()), (comm, model.shared_parameters())):
        for p in params:
            g = p.grad.data if p.grad is not None else np.zeros_like(p.data)
            p.data -= lr * allreduce(group, g)
    return loss.item()
    ### END SOLUTION

# %% tags=["check"]
check("16.5")

# %% [markdown]
# One EP forward and backward on 4 simulated ranks (8 experts, top-2, 64 tokens per rank) against
# one process, its bytes, and its timeline: in the forward pass the all-to-all of the counts, the
# dispatch all-to-all, the local experts' GEMMs (F, charged at 10 GFLOP/s by a wrapper around
# `grouped_matmul`), the combine all-to-all; then the backward's GEMMs (B) and its two
# all-to-alls.

# %% tags=["demo"]
def charged(comm):
    """grouped_matmul that also charges its FLOPs to the simulated clock, forward and backward."""
    def gm(x, sizes, w):
        y = grouped_matmul(x, sizes, w)
        f = 2.0 * x.shape[0] * w.shape[1] * w.shape[2]
        comm.compute(flops=f, kind="F")

        def vjp(g):
            comm.compute(flops=2 * f, kind="B")
            return (g,)
        return y._record(y._new(y.data), (y,), vjp, "charge")
    return gm


def ep_demo(comm, layer, xs):
    ep = ExpertParallelMoE(comm, layer)
    ep.ops = MoEOps(top_k_gating, dispatch, charged(comm), scatter_rows)
    x = Tensor(xs[comm.rank], requires_grad=True)
    out = ep(x)
    (out * out).sum().backward()
    return out.numpy(), ep.w1.grad.numpy()


rng = np.random.default_rng(3)
ep_layer = MoEMLP(32, 8, 2, 64, rng, dtype=np.float64, init=0.5)
xs_ep = rng.standard_normal((4, 64, 32))
ep_run = run(ep_demo, 4, ep_layer, xs_ep, alpha=5e-6, beta=1e-10, flop_rate=1e10)
single = ep_layer(Tensor(xs_ep.reshape(-1, 32))).numpy()
print("max |EP - one process|:", np.abs(np.concatenate([r[0] for r in ep_run.results]) - single).max())
print("bytes sent per rank:", ep_run.bytes_sent(), f"simulated step {ep_run.time * 1e6:.1f} us")
ep_run.plot(title="expert parallelism: dispatch and combine all-to-alls, forward and backward")
plt.show()

# %% [markdown]
# The ranks whose experts received the most rows compute longest, and the others wait for them
# (grey) in the next all-to-all: in expert parallelism the busiest expert sets the step time,
# which is what the balancing of section 1 is for.

# %% [markdown]
# ## 6. Expert parallelism in the planner
#
# Lesson 13's planner chose data, tensor and pipeline parallelism for a dense GPT. An MoE model
# adds a choice: over how many ranks (`ep`) to spread each layer's experts. More ranks per expert
# group means fewer expert parameters per rank (memory), but more of every token's hidden state
# leaves the rank, over more messages, and beyond one node over slower links (time).
#
# The model (`MoESpec`, given) counts parameters as Mixtral does: per layer, attention with
# grouped KV heads, a router, and E experts of three `d x d_ff` matrices (SwiGLU); embeddings and
# an untied output layer. For Mixtral 8x7B (Jiang et al. 2024) that gives the paper's 46.7 B
# total and 12.9 B active parameters.
#
# The plan: `n` ranks, expert groups of `ep` consecutive ranks (`dp = n / ep` replicas), the
# non-expert part data-parallel over all n ranks, every rank with `b = batch * seq_len / n`
# tokens. With 16-bit weights and gradients and the 12 bytes per parameter of fp32 master
# weights and Adam moments sharded over each parameter's data-parallel group (ZeRO-1, lesson 12):
#
# - memory per rank = `4 P_rank + 12 (P_dense / n + P_experts / (ep * dp))` with
#   `P_rank = P_dense + P_experts / ep` (activations left out: assume full recomputation);
# - compute = `6 * P_active * b / flop_rate` (the 6ND rule of lesson 04);
# - all-to-all: 4 per layer (dispatch and combine, forward and backward), each sending `k * b`
#   rows of `2 d` bytes spread evenly over the ep ranks: `t_a2a = (ep - 1)(alpha + k b 2 d / ep * beta)`
#   on the link `link_for(cluster, ep)` (NVLink when the group fits in a node);
# - gradients: lesson 12's ring all-reduce of the 16-bit expert gradients over the DP group
#   (`2 P_experts / ep` bytes, on the network link unless the whole cluster is one node) and of
#   the dense gradients over all n ranks;
# - time = compute + `4 * n_layer * t_a2a` + both all-reduces (nothing overlapped).
#
# `best_ep` tries every ep that divides both n and E, keeps those whose memory fits (at most
# `cluster.memory`: a plan that needs exactly the memory there is fits), and picks the fastest;
# plans of exactly equal time go to the **smaller ep** (fewer ranks in each all-to-all), not to
# the one with less memory. `simulate_ep` (given) runs the same step as a skeleton on
# the communicator's simulator, messages of the right sizes and FLOPs charged, to check the
# formulas.
#
# **Exercise 16.6.** Write `estimate_ep` and `best_ep`.

# %%
#| export
from dataclasses import dataclass

from minitorch.model_parallel import ClusterSpec, Estimate, link_for, ring_allreduce_time


@dataclass(frozen=True)
class MoESpec:
    """An MoE transformer for planning: n_layer layers of width d_model, n_head query and n_kv_head
    key/value heads, n_experts experts of d_ff (SwiGLU: 3 matrices), top-k routing, vocabulary
    vocab (untied output layer); global batch of `batch` sequences of seq_len tokens."""
    name: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    n_experts: int
    k: int
    vocab: int
    seq_len: int
    batch: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"MoESpec: name must be a str, got {describe(self.name)}")
        for name in ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "n_experts", "k", "vocab", "seq_len", "batch"):
            check_int("MoESpec", name, getattr(self, name), 1)
        check_int("MoESpec", "k", self.k, 1, self.n_experts)
        if self.n_head % self.n_kv_head:
            raise ValueError(f"MoESpec: n_kv_head must divide n_head={self.n_head}, got {self.n_kv_head}")

    @property
    def expert_params(self) -> int:
        """Parameters of all experts of all layers."""
        return self.n_layer * self.n_experts * 3 * self.d_model * self.d_ff

    @property
    def dense_params(self) -> int:
        """Everything else: attention, router and two norms per layer, embeddings, output layer, final norm."""
        d = self.d_model
        attn = 2 * d * d + 2 * d * (d * self.n_kv_head // self.n_head)
        return self.n_layer * (attn + d * self.n_experts + 2 * d) + 2 * self.vocab * d + d

    @property
    def total_params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses: the dense part and k experts per layer."""
        return self.dense_params + self.expert_params * self.k // self.n_experts


MIXTRAL_8X7B = MoESpec("Mixtral 8x7B", n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336, n_experts=8,
                       k=2, vocab=32000, seq_len=4096, batch=512)


def _ep_job(comm: Communicator, model: MoESpec, cluster: ClusterSpec, ep: int, a2a: Callable) -> None:
    """One rank of simulate_ep's skeleton (no arithmetic: FLOPs charged, messages of the right sizes)."""
    n = comm.size
    d_i, e_i = divmod(comm.rank, ep)
    ep_group = comm.group([d_i * ep + j for j in range(ep)])
    dp_group = comm.group([x * ep + e_i for x in range(n // ep)])
    b = model.batch * model.seq_len // n
    rows = model.k * b // ep
    block = np.zeros((ep * rows, 2 * model.d_model), np.uint8)
    counts = [rows] * ep
    per_layer = model.active_params / model.n_layer
    for kind, flops in (("F", 2 * per_layer * b), ("B", 4 * per_layer * b)):
        for _ in range(model.n_layer):
            comm.compute(flops=flops, kind=kind)
            for _ in range(2):
                a2a(ep_group, block, counts, counts)
    ring_allreduce(dp_group, np.zeros(2 * model.expert_params // ep, np.uint8))
    ring_allreduce(comm, np.zeros(2 * model.dense_params, np.uint8))


def simulate_ep(model: MoESpec, cluster: ClusterSpec, ep: int, a2a: Callable | None = None) -> RunResult:
    """Run one EP x DP training step of `model` as a skeleton on the simulator (the cluster's alpha,
    beta, flop_rate): per layer the forward FLOPs then two all-to-alls of the routed rows, the same
    for the backward (twice the FLOPs), then ring all-reduces of the 16-bit expert gradients over the
    DP group and of the dense gradients over all ranks. a2a: the all-to-all (default all_to_all). A
    cluster whose node link differs from its network runs on lesson 12's two-level topology
    (n_ranks / node_size nodes, node_size must divide n_ranks). Small models only: the messages are
    real arrays."""
    two_level = cluster.node_size > 1 and link_for(cluster, 1) != (cluster.alpha, cluster.beta)
    if two_level and cluster.n_ranks % cluster.node_size:
        raise ValueError(f"simulate_ep: node_size={cluster.node_size} must divide the {cluster.n_ranks} ranks (whole "
                         "nodes) to simulate a cluster whose node link differs from its network")
    if cluster.n_ranks % ep or model.n_experts % ep or (model.batch * model.seq_len) % cluster.n_ranks \
            or (model.k * model.batch * model.seq_len // cluster.n_ranks) % ep:
        raise ValueError(f"simulate_ep: ep={ep} must divide the {cluster.n_ranks} ranks, the {model.n_experts} experts "
                         "and the routed rows per rank, and the ranks the batch's tokens")
    links = dict(alpha=cluster.alpha, beta=cluster.beta)
    if two_level:
        a_node, b_node = link_for(cluster, 1)
        links = dict(alpha=a_node, beta=b_node, nodes=cluster.n_ranks // cluster.node_size, alpha_inter=cluster.alpha,
                     beta_inter=cluster.beta)
    return run(_ep_job, cluster.n_ranks, model, cluster, ep, a2a or all_to_all, flop_rate=cluster.flop_rate, **links)

# %%
#| export
#| exercise 16.6
def estimate_ep(model: MoESpec, cluster: ClusterSpec, ep: int) -> Estimate:
    """Memory per rank (bytes) and step time (seconds) of expert groups of `ep` ranks (dp =
    n_ranks / ep replicas), by the formulas above. ValueError naming the problem unless ep >= 1
    divides cluster.n_ranks and model.n_experts."""
    ### BEGIN SOLUTION
    n = cluster.n_ranks
    ep = check_int("estimate_ep", "ep", ep, 1)
    if n % ep or model.n_experts % ep:
        raise ValueError(f"estimate_ep: ep={ep} must divide the {n} ranks and the {model.n_experts} experts")
    dp = n // ep
    p_dense, p_exp = model.dense_params, model.expert_params
    memory = 4 * (p_dense + p_exp / ep) + 12 * (p_dense / n + p_exp / (ep * dp))
    b = model.batch * model.seq_len / n
    compute = 6 * model.active_params * b / cluster.flop_rate
    alpha, beta = link_for(cluster, ep)
    t_a2a = (ep - 1) * (alpha + model.k * b * 2 * model.d_model / ep * beta)
    grads = (ring_allreduce_time(dp, 2 * p_exp / ep, *link_for(cluster, n))
             + ring_allreduce_time(n, 2 * p_dense, *link_for(cluster, n)))
    return Estimate(memory, compute + 4 * model.n_layer * t_a2a + grads)
    ### END SOLUTION


def best_ep(model: MoESpec, cluster: ClusterSpec) -> tuple[int, Estimate]:
    """The fastest ep (dividing n_ranks and n_experts) whose memory is <= cluster.memory; exactly
    equal times: the smaller ep. ValueError naming the smallest memory needed, in GB, if none fits."""
    ### BEGIN SOLUTION
    options = [(estimate_ep(model, cluster, ep), ep) for ep in range(1, cluster.n_ranks + 1)
               if cluster.n_ranks % ep == 0 and model.n_experts % ep == 0]
    fits = [(est.time, ep, est) for est, ep in options if est.memory <= cluster.memory]
    if not fits:
        est, ep = min(options, key=lambda o: o[0].memory)
        raise ValueError(f"best_ep: no ep fits {model.name} in {cluster.memory / 1e9:.3g} GB per rank; the smallest, "
                         f"ep={ep}, needs {est.memory / 1e9:.3g} GB")
    _, ep, est = min(fits, key=lambda f: (f[0], f[1]))
    return ep, est
    ### END SOLUTION

# %% tags=["check"]
check("16.6")

# %% [markdown]
# Mixtral 8x7B (global batch 512 x 4096 tokens) on 64 H100s (80 GB, 400 TFLOP/s of bf16 at a
# realistic utilisation), in nodes of 8 with NVLink inside and one 400 Gb/s NIC per GPU between
# (the links of [interconnects](../hardware_notes/interconnects.md#alpha-and-beta-for-lessons-12-13)),
# and the same GPUs in nodes of 4: with 4-GPU nodes, ep = 8 sends its all-to-alls over the
# network and the planner's pick changes.

# %% tags=["demo"]
m = MIXTRAL_8X7B
print(f"{m.name}: {m.total_params / 1e9:.1f} B parameters, {m.active_params / 1e9:.1f} B active per token")
for node in (8, 4):
    h100s = ClusterSpec(n_ranks=64, memory=80e9, flop_rate=400e12, alpha=14e-6, beta=1 / 50e9, node_size=node,
                        alpha_node=3.4e-6, beta_node=1 / 450e9)
    print(f"\n64 H100s in nodes of {node}:")
    print(f"{'ep':>3} {'memory/rank':>12} {'step':>9} {'all-to-all share':>17}")
    for ep in (1, 2, 4, 8):
        est = estimate_ep(m, h100s, ep)
        alpha, beta = link_for(h100s, ep)
        b = m.batch * m.seq_len / 64
        a2a_time = 4 * m.n_layer * (ep - 1) * (alpha + m.k * b * 2 * m.d_model / ep * beta)
        print(f"{ep:>3} {est.memory / 1e9:>10.1f}GB {est.time:>8.2f}s {a2a_time / est.time:>16.1%}"
              + ("" if est.memory <= h100s.memory else "   does not fit"))
    ep, est = best_ep(m, h100s)
    print(f"planner's pick: ep = {ep} ({est.memory / 1e9:.1f} GB per rank, {est.time:.2f} s per step)")

# %% [markdown]
# And the formulas against the simulator, on a model small enough to run as a skeleton: one kind of
# link, then nodes of 4 ranks whose link is 10x faster per byte than the network (lesson 12's
# two-level topology).

# %% tags=["demo"]
small = MoESpec("small", n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=128, n_experts=8, k=2, vocab=128,
                seq_len=32, batch=16)
for label, cl in [("one link", ClusterSpec(n_ranks=8, memory=1e12, flop_rate=1e11, alpha=5e-6, beta=1e-9)),
                  ("nodes of 4", ClusterSpec(n_ranks=8, memory=1e12, flop_rate=1e11, alpha=5e-6, beta=1e-9, node_size=4,
                                             alpha_node=2e-6, beta_node=1e-10))]:
    for ep in (1, 2, 4, 8):
        sim_t = simulate_ep(small, cl, ep).time
        est_t = estimate_ep(small, cl, ep).time
        print(f"{label}, ep = {ep}: estimate {est_t * 1e3:.4f} ms, simulated {sim_t * 1e3:.4f} ms, "
              f"ratio {sim_t / est_t:.6f}")

# %% [markdown]
# ## 7. All-to-all across nodes
#
# Section 4's pairwise all-to-all sends every rank's block straight to its destination: on M nodes
# of P ranks (N = MP), N - P of each rank's N - 1 messages cross the network. Every one of them pays
# the network's alpha, and with E experts spread over many nodes the blocks get small: a token row
# is a few KiB. The **hierarchical all-to-all** crosses the network once per pair of nodes and
# local rank (DeepEP and NCCL's PXN do the same with NVLink and one NIC per GPU):
#
# 1. **inside the node**, rank (a, i) (node a, local rank i) sends local rank j of its node every
#    row bound for local rank j of any node, node by node (the counts go first, in a tiny all-to-all:
#    the receiver must know how the rows it gets divide up);
# 2. **across nodes**, among the ranks of one local rank (one per node, each on its own NIC), rank
#    (a, j) sends node b's rank j every row that node a holds for it, in one message.
#
# The rows that arrive from node a are already in the order of their source ranks, so the result
# is section 4's, row for row. In lesson 12's two-level model, with m bytes in every block:
#
# `flat = (N-1)(alpha_inter + m beta_inter)`
#
# `hierarchical = (P-1)(2 alpha + M m beta) + (M-1)(alpha_inter + P m beta_inter)` (the first
# alpha: the counts)
#
# The flat exchange's N - 1 messages all take the network's time: a rank sends one message at a
# time and takes in one at a time, whatever the link (the model's port), so its messages from its
# own node queue behind those from other nodes, as the ring's steps waited for the ring's slowest
# link. The same bytes cross the network both ways; `(M-1)(P-1)` messages fewer do in the
# hierarchical exchange, for one more exchange inside the node. On 2 nodes of 2 ranks that is one
# message saved per rank; on 2 nodes of 8 GPUs, seven of the eight that cross the network. It is
# given: `hierarchical_all_to_all` (built on two all-to-alls of section 4 on process groups) and
# `a2a_two_level_cost`.

# %%
#| export
A2A_TWO_LEVEL = ("all_to_all", "hierarchical_all_to_all")


def hierarchical_all_to_all(comm: Communicator, x: np.ndarray, send_counts: Any, recv_counts: Any, ppn: int,
                            a2a: Callable | None = None, tag: int = 0) -> np.ndarray:
    """all_to_all(comm, x, send_counts, recv_counts)'s result (rows received, in rank order) for ranks
    on comm.size / ppn nodes of ppn ranks (rank r on node r // ppn, local rank r % ppn), in two
    exchanges: inside the node, to local rank j every row bound for local rank j of any node (after
    the counts); then across nodes, among the ranks of one local rank, to node b's every row the node
    holds for it. a2a: the all-to-all both use (default all_to_all); it runs with tags tag, tag + 1
    and tag + 2. ValueError unless ppn divides comm.size, or for counts all_to_all refuses."""
    a2a = a2a or all_to_all
    what = "hierarchical_all_to_all"
    x = check_a2a_args(what, comm, x, tag)
    n = comm.size
    if n % ppn:
        raise ValueError(f"{what}: ppn must divide the {n} ranks (the same number on every node), got ppn={ppn}")
    send = np.asarray(check_counts(what, "send_counts", send_counts), dtype=np.int64)
    recv = np.asarray(check_counts(what, "recv_counts", recv_counts), dtype=np.int64)
    if send.size != n or recv.size != n or send.sum() != x.shape[0]:
        raise ValueError(f"{what}: rank {comm.rank}: need {n} send and {n} receive counts, the send counts summing to "
                         f"the {x.shape[0]} rows of x; got send_counts {send.tolist()}, recv_counts {recv.tolist()}")
    m, (node, local) = n // ppn, divmod(comm.rank, ppn)
    inside = comm.group([node * ppn + i for i in range(ppn)])
    across = comm.group(list(range(local, n, ppn)))
    out_counts = send.reshape(m, ppn).T.copy()  # [j, b]: rows for local rank j of node b
    ones = [1] * ppn
    in_counts = a2a(inside, out_counts, ones, ones, tag)  # [i, b]: rows local rank i holds for node b's local-me
    starts = np.concatenate([[0], np.cumsum(send)])
    order = [b * ppn + j for j in range(ppn) for b in range(m)]  # x's blocks by local destination, then node
    x1 = np.concatenate([x[starts[d]:starts[d + 1]] for d in order]) if order else x[:0]
    y1 = a2a(inside, x1, out_counts.sum(1), in_counts.sum(1), tag + 1)  # from local i: its rows for (b, me), by b
    starts1 = np.concatenate([[0], np.cumsum(in_counts.reshape(-1))]).reshape(-1)
    pieces = [(i, b) for b in range(m) for i in range(ppn)]  # regrouped by destination node, then source
    x2 = np.concatenate([y1[starts1[i * m + b]:starts1[i * m + b + 1]] for i, b in pieces])
    return a2a(across, x2, in_counts.sum(0), recv.reshape(m, ppn).sum(1), tag + 2)


def a2a_two_level_cost(name: str, block_bytes: float, nodes: int, ppn: int, alpha_intra: float, beta_intra: float,
                       alpha_inter: float, beta_inter: float) -> float:
    """Seconds of an all-to-all with block_bytes (m) in every block, on `nodes` nodes (M) of `ppn` (P)
    ranks, N = MP, as lesson 12's two-level simulator runs it ((alpha_intra, beta_intra) inside a node,
    (alpha_inter, beta_inter) for each rank's link to the network; a rank sends, and takes in, one
    message at a time, whatever the link):
      "all_to_all" (section 4's pairwise exchange): (N-1)(alpha_x + m beta_x), x the slower of the
        links it uses (the network's when nodes > 1: the messages from the node wait behind it);
      "hierarchical_all_to_all": (P-1)(2 alpha_intra + M m beta_intra) + (M-1)(alpha_inter + P m
        beta_inter) (the counts' messages inside the node are counted by their alpha alone)."""
    if name not in A2A_TWO_LEVEL:
        raise ValueError(f"a2a_two_level_cost: unknown algorithm {name!r}: use one of {A2A_TWO_LEVEL}")
    m_, p, b = nodes, ppn, float(block_bytes)
    if name == "all_to_all":
        step = alpha_intra + b * beta_intra if m_ == 1 else alpha_inter + b * beta_inter
        if m_ > 1 and p > 1:
            step = max(step, alpha_intra + b * beta_intra)
        return (m_ * p - 1) * step
    return (p - 1) * (2 * alpha_intra + m_ * b * beta_intra) + (m_ - 1) * (alpha_inter + p * b * beta_inter)

# %% [markdown]
# On the simulator: uniform blocks of 4 KiB (a few token rows) and of 1 MiB, rank-NICs of 10 us and
# 1 GB/s, NVLink-like links inside a node of 2 us and 100 GB/s: the prediction against the simulated
# time, and the messages each rank sends across.

# %% tags=["demo"]
A2A_LINKS = dict(alpha=2e-6, beta=1e-11, alpha_inter=1e-5, beta_inter=1e-9)


def uniform_a2a(comm, block_rows, ppn, hierarchical):
    counts = [block_rows] * comm.size
    x = np.arange(block_rows * comm.size * 8, dtype=np.float64).reshape(-1, 8) + 1e6 * comm.rank
    if hierarchical:
        return hierarchical_all_to_all(comm, x, counts, counts, ppn)
    return all_to_all(comm, x, counts, counts)


print(f"{'nodes x ppn':>11} {'block':>8} {'flat: model':>12} {'simulated':>10} {'hier.: model':>13} {'simulated':>10} "
      f"{'messages across, flat/hier.':>28}")
for nodes, ppn in [(2, 2), (2, 8), (4, 4)]:
    for rows in ((64, 16384) if not SMALL else (64, 1024)):  # 64 rows of 8 float64: 4 KiB (16384: 1 MiB)
        out = []
        for hier in (False, True):
            res = run(uniform_a2a, nodes * ppn, rows, ppn, hier, nodes=nodes, **A2A_LINKS)
            crossing = sum(res.node_of(e.peer) != res.node_of(0) for e in res.events(rank=0, kind="send"))
            name = A2A_TWO_LEVEL[hier]
            out.append((a2a_two_level_cost(name, rows * 64, nodes, ppn, *A2A_LINKS.values()), res.time, crossing,
                        res.results))
        same = all(np.array_equal(a, b) for a, b in zip(out[0][3], out[1][3]))
        print(f"{f'{nodes} x {ppn}':>11} {rows * 64:>8} {out[0][0] * 1e6:>10.1f}us {out[0][1] * 1e6:>8.1f}us "
              f"{out[1][0] * 1e6:>11.1f}us {out[1][1] * 1e6:>8.1f}us {out[0][2]:>14} / {out[1][2]:<4} "
              f"{'same rows' if same else 'DIFFERENT ROWS'}")

# %% [markdown]
# The prediction and the simulator agree to the last digit, and the rows are the flat exchange's.
# The hierarchical exchange wins everywhere here, most where blocks are small and ranks per node many:
# on 2 x 8 with 4 KiB blocks it takes 71 us against 211 us (3.0x), since each rank sends one message
# across instead of eight; on 2 x 2, 22 us against 42 us. With 1 MiB blocks the gain shrinks (2 x 2:
# 2.1 ms against 3.2 ms; 4 x 4: 12.8 ms against 15.9 ms): the same bytes cross the network either way,
# and what is saved is the network's alpha and the flat exchange's node-local messages queued behind
# the slow ones. That is the regime of expert parallelism at scale: DeepSeek-V3 spreads 256 experts
# over many nodes, and a token row is 14 KiB in bf16 (d = 7168), so the blocks are small.
#
# On the emulated cluster of lesson 12 (2 nodes x 2 ranks, 2 Gbit/s per NIC), the two all-to-alls with
# uneven splits, at three sizes per rank (the best of a few trials, taking turns), the prediction from
# the links measured in the same launch, the bytes each NIC sent in one of each, and the rows against
# the simulator's.

# %% tags=["demo"]
from course.cluster import EmulatedCluster, cluster_status, read_nic_bytes
from minitorch.parallel import best_times, fit_link, link_sweep


def a2a_cluster_job(comm, sizes, ppn, reps, trials, nics):
    """Per size (bytes per rank): (size, flat seconds, hierarchical seconds, rows equal), the NIC bytes of one
    of each at the last size, and the links' one-way times (rank 0)."""
    rows_out, sent = [], []
    for nbytes in sizes:
        rng = np.random.default_rng(100 + comm.rank)
        send = np.floor(rng.dirichlet(np.ones(comm.size) * 2) * max(comm.size, nbytes // 64)).astype(np.int64)
        recv = exchange_counts(comm, send)
        x = rng.standard_normal((int(send.sum()), 8))
        flat, hier = best_times(comm, [lambda: all_to_all(comm, x, send, recv),
                                       lambda: hierarchical_all_to_all(comm, x, send, recv, ppn)], reps, trials)
        rows_out.append((nbytes, flat, hier, bool(np.array_equal(all_to_all(comm, x, send, recv),
                                                                  hierarchical_all_to_all(comm, x, send, recv, ppn)))))
    for op in (lambda: all_to_all(comm, x, send, recv), lambda: hierarchical_all_to_all(comm, x, send, recv, ppn)):
        comm.barrier()
        before = read_nic_bytes(nics) if comm.rank == 0 else None
        comm.barrier()
        op()
        comm.barrier()
        sent.append([a[0] - b[0] for a, b in zip(read_nic_bytes(nics), before)] if comm.rank == 0 else None)
    link = [8, 4096, 65536, 1 << 20]
    inside, across = link_sweep(comm, link, 5, peer=1), link_sweep(comm, link, 5, peer=2)
    return (rows_out, sent, inside, across, link) if comm.rank == 0 else None


ok, why = cluster_status()
if ok:
    from minitorch.bench import load_report

    print(load_report())
    a2a_sizes = [2 ** 12, 2 ** 16, 2 ** 20] if not SMALL else [2 ** 12, 2 ** 16]
    with EmulatedCluster(nodes=2, ppn=2, link="2gbit") as cluster:
        print(cluster.describe())
        rows_out, sent, inside, across, link = run(a2a_cluster_job, 4, a2a_sizes, 2, 5 if not SMALL else 1,
                                                   3 if not SMALL else 1, cluster.nics(), engine="mpi", nodes=2,
                                                   timeout=600).results[0]
    (a_in, b_in), (a_x, b_x) = fit_link(link, inside), fit_link(link, across)
    print(f"links: inside a node alpha {a_in * 1e6:.1f} us, {1 / b_in / 1e9:.2f} GB/s; between nodes alpha "
          f"{a_x * 1e6:.1f} us, {1 / b_x / 1e9:.2f} GB/s")
    print(f"{'bytes/rank':>10} {'flat':>9} {'model':>9} {'hier.':>9} {'model':>9} {'flat/hier.':>10}  rows equal")
    for nbytes, flat, hier, same in rows_out:
        block = nbytes / 4  # the mean block
        p_flat, p_hier = (a2a_two_level_cost(a, block, 2, 2, a_in, b_in, a_x, b_x) for a in A2A_TWO_LEVEL)
        print(f"{nbytes:>10} {flat * 1e3:>7.3f}ms {p_flat * 1e3:>7.3f}ms {hier * 1e3:>7.3f}ms {p_hier * 1e3:>7.3f}ms "
              f"{flat / hier:>9.2f}x  {same}")
    print(f"bytes each NIC sent in one all-to-all of {a2a_sizes[-1]} bytes per rank: flat {sent[0]}, hierarchical "
          f"{sent[1]}")
else:
    print(f"no emulated cluster here: {why}")

# %% [markdown]
# What to read above (the timings move with the machine's load): the rows equal the flat
# exchange's at every size, and the same bytes cross the network through the four NICs in both; but
# on this machine the hierarchical all-to-all is usually **slower**, where the model predicts it
# faster. On 2 nodes of 2 ranks it saves one message across per rank out of two, and pays for two
# more exchanges inside the node (the counts, then the rows). The model prices a message inside the
# node at the ping-pong's alpha and beta; but each exchange is a round in which every rank must run,
# and four ranks on two busy cores wait for one another, so each round costs milliseconds. The NIC
# counters show the hierarchical exchange's other cost: the flat one spreads the uneven splits over
# the four NICs, the hierarchical one piles them on whichever local rank the rows are bound for, and
# the busiest NIC sets the time.
#
# So the measurement says when to use it: many ranks per node (eight GPUs save seven messages of
# eight across), small blocks (the network's alpha dominates), and node-local links that are truly
# cheap (NVLink's, handled by copy engines, not the CPUs that run the ranks). DeepEP's and NCCL's
# PXN-style dispatch is built on exactly those conditions. On 2 x 2 CPU ranks, send directly.

# %% [markdown]
# ## Where to go from here
#
# - **Real kernels.** MegaBlocks (Gale et al. 2023) runs the grouped GEMM as block-sparse
#   matrix products on GPUs; PyTorch now has `torch._grouped_mm`, and vLLM and SGLang fuse
#   routing, permutation and the expert GEMMs into one kernel ("fused MoE").
# - **Faster all-to-all.** DeepEP (DeepSeek 2025) sends each token once per node over InfiniBand
#   and forwards it over NVLink inside the node, and overlaps the exchanges with computation;
#   DeepSeek-V3 limits each token to experts on at most 4 nodes for the same reason.
# - **Shared experts and fine-grained experts** (DeepSeek-MoE): many small experts plus one that
#   every token uses; the planner's formulas carry over with two expert kinds.
#
# Sources: Shazeer et al. 2017, "Outrageously large neural networks: the sparsely-gated
# mixture-of-experts layer"; Lepikhin et al. 2021, "GShard"; Fedus, Zoph and Shazeer 2022,
# "Switch Transformers"; Zoph et al. 2022, "ST-MoE" (router z-loss); Jiang et al. 2024,
# "Mixtral of experts"; DeepSeek-AI 2024, "DeepSeek-V3 technical report" (auxiliary-loss-free
# balancing); Wang et al. 2024, "Auxiliary-loss-free load balancing strategy for mixture-of-
# experts"; Gale et al. 2023, "MegaBlocks: efficient sparse training with mixture-of-experts";
# Tazi et al. 2025, "The Ultra-Scale Playbook" (Hugging Face), section on expert parallelism.


# %%
#| export
#| given
from minitorch.checks import (Array, Choice, Func, Int, NonNegative, Optional, Positive, Rule, Seq, Size,  # noqa: E402
                              Str, TensorLike, Unchecked, validate_public)
from minitorch.comm import _comm_rules  # noqa: E402


class _FloatDtype(Rule):
    """A floating NumPy dtype (np.float32, "float64", np.dtype("float32"))."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        try:
            ok = value is not None and not isinstance(value, (bool, int, float)) and np.dtype(value).kind == "f"
        except TypeError:
            ok = False
        if not ok:
            shown = value.__name__ if isinstance(value, type) else describe(value)  # (a class: not describe's)
            raise TypeError(f"{what}: {name} must be a floating NumPy dtype (np.float32 or np.float64), got {shown}")


_OWN = Unchecked()  # checked in the body (on a fast path where the function runs per step)
_ROWS, _IDS = Array(ndim=2, dtypes="real", axes="(n, d)"), Array(ndim=1, dtypes="int")
_WINDOWS = Array(ndim=2, dtypes="int", axes="(B, T)")
validate_public(globals(), _comm_rules(globals(), {
    # the helpers that raise on behalf of their callers: the value is checked by the helper itself
    "check_counts": {"what": _OWN, "name": _OWN, "counts": _OWN},  # twice per all-to-all: its own fast path
    "check_experts": {"what": Str(), "experts": _OWN},
    "check_a2a_args": {"what": Str(), "comm": _OWN, "x": _OWN, "tag": _OWN},
    "check_rows": {"what": Str(), "name": Str(), "x": _OWN, "ndim": Int(0)},
    "top_k_gating": {"bias": Optional(Array(ndim=1, dtypes="real"))},
    "update_bias": {"bias": Array(ndim=1, dtypes=("float32", "float64", "int")), "load": Array(ndim=1, dtypes="real"),
                    "rate": NonNegative},
    "expert_capacity": {"capacity_factor": _OWN},  # (its own check, kept: the lesson's demo slider calls it)
    "expert_ffn_np": {"x": _ROWS, "w1": Array(ndim=2, dtypes="real"), "w2": Array(ndim=2, dtypes="real")},
    "grouped_gemm": {"x": _ROWS, "group_sizes": _IDS, "w": Array(ndim=3, dtypes="real")},
    "combine": {"y": _ROWS, "d": Attrs("token", "slot", "kept"), "weights": Array(ndim=2, dtypes="real"),
                "n_tokens": Int(0)},
    "grouped_matmul": {"x": TensorLike(ndim=2), "group_sizes": _IDS, "w": TensorLike(ndim=3)},
    "scatter_rows": {"src": TensorLike(ndim=2)},
    "MoEMLP": {"capacity_factor": Optional(Positive), "dtype": _FloatDtype(), "init": NonNegative,
               "proj_init": NonNegative},
    "DenseMLP": {"n_embd": Size, "hidden": Size, "proj_init": NonNegative},
    "dense_gpt": {"hidden": Size, "seed": Int(0)},
    "MoEGPT": {"n_experts": Size, "k": Size, "hidden": Size, "capacity_factor": Optional(Positive),
               "aux_coef": NonNegative, "z_coef": NonNegative, "seed": Int(0)},
    "MoEGPT.forward": {"idx": _WINDOWS, "targets": Optional(_WINDOWS)},
    # once per call, on a fast path in the body (a small all-to-all is bound by its Python)
    "all_to_all": {"comm": _OWN, "x": _OWN, "send_counts": _OWN, "recv_counts": _OWN, "tag": _OWN},
    "exchange_counts": {"send_counts": _OWN, "tag": _OWN},
    "mpi4py_all_to_all": {"x": Array(ndim=2, dtypes="float64"), "send_counts": Seq(Int(0)),
                          "recv_counts": Seq(Int(0))},
    "alltoall_timings": {"sizes": Seq(Int(64), min_len=1), "budget": Positive},
    "all_to_all_op": {"x": TensorLike(ndim=2), "send_counts": _OWN, "recv_counts": _OWN},
    "ExpertParallelMoE.forward": {"x": TensorLike(ndim=2)},
    "ep_dp_train_step": {"x": _ROWS, "target": Array(), "lr": Positive},
    "simulate_ep": {"ep": Size},
    "hierarchical_all_to_all": {"comm": _OWN, "x": _OWN, "send_counts": _OWN, "recv_counts": _OWN, "ppn": Size,
                                "a2a": Optional(Func()), "tag": _OWN},
    "a2a_two_level_cost": {"name": Choice(*A2A_TWO_LEVEL), "block_bytes": NonNegative, "nodes": Size, "ppn": Size,
                           "alpha_intra": NonNegative, "beta_intra": NonNegative, "alpha_inter": NonNegative,
                           "beta_inter": NonNegative},
}))
