# Generated from solutions/16_moe.py by `make build`. Do not edit.
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


class Gate(NamedTuple):
    """The router's decision for T tokens: experts (T, k) int64, best first (ties: lowest index);
    weights (T, k) Tensor, the combine weights; probs (T, E) Tensor, softmax of the logits."""
    experts: np.ndarray
    weights: Tensor
    probs: Tensor


def top_k_gating(logits: Tensor, k: int, bias: np.ndarray | None = None) -> Gate:
    """Top-k softmax gating of logits (T, E) (an autograd Tensor, any float dtype).

    probs = softmax(logits) over experts. experts: for each token the k experts with the largest
    probs + bias (bias (E,) only selects: DeepSeek-V3; None = 0), best first, ties to the lowest
    index. weights: probs of the chosen experts, divided by their sum when k >= 2 (they sum to 1);
    for k = 1 the raw probability (Switch). probs and weights have the logits' dtype.
    ValueErrors: logits not 2-D, k not in [1, E], bias shape, and a non-finite logit:
    "top_k_gating: logits must be finite, got {value} at token {t}, expert {e}" (the first)."""
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


def load_balancing_loss(probs: Tensor, experts: np.ndarray) -> Tensor:
    """Switch's auxiliary loss N * sum_i f_i * P_i (a one-element Tensor): probs (T, E), N = E;
    f_i = (assignments to expert i) / (T * k), counted from experts (T, k) (no gradient);
    P_i = mean over tokens of probs[:, i] (the gradient flows through it); probs' dtype. ValueError
    for T = 0, experts not (T, k), or an expert id outside [0, E)."""
    what = "load_balancing_loss"
    check_rows(what, "probs", probs)
    t, e = probs.shape
    experts = check_experts(what, experts, e)
    if experts.shape[0] != t or t == 0:
        raise ValueError(f"{what}: need T >= 1 tokens and experts (T, k) for probs (T, E), got probs {probs.shape}, "
                         f"experts {experts.shape}")
    f = np.bincount(experts.reshape(-1), minlength=e) / experts.size
    return (probs.mean(axis=0) * f.astype(probs.dtype)).sum() * e


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE's z-loss: mean over tokens of logsumexp(logits_t)^2, logits (T, E), T >= 1 (ValueError
    for T = 0); the logits' dtype."""
    check_rows("router_z_loss", "logits", logits)
    if logits.shape[0] == 0:
        raise ValueError("router_z_loss: need at least one token, got logits of shape (0, E)")
    z = logsumexp(logits, axis=-1)
    return (z * z).mean()


def update_bias(bias: np.ndarray, load: np.ndarray, rate: float) -> np.ndarray:
    """DeepSeek-V3's loss-free balancing step: a new array bias + rate * sign(mean(load) - load)
    (overloaded experts go down, underloaded up, balanced ones stay). bias, load: (E,). The result
    has bias's dtype if it is a float (float32 stays float32), else float64."""
    bias, load = np.asarray(bias), np.asarray(load, dtype=np.float64)
    if bias.ndim != 1 or load.shape != bias.shape:
        raise ValueError(f"update_bias: bias and load must both have shape (E,), got {bias.shape} and {load.shape}")
    dtype = bias.dtype if bias.dtype.kind == "f" else np.float64
    return (bias + rate * np.sign(load.mean() - load)).astype(dtype)


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


def dispatch(experts: np.ndarray, n_experts: int, capacity: int | None = None) -> Dispatch:
    """Sort the assignments experts (T, k) by expert (stable: token order within an expert).

    capacity None: dropless, every assignment kept. Else each expert keeps its first `capacity`
    assignments in token order and the rest are dropped (not routed, counted in `dropped`)."""
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


def grouped_gemm(x: np.ndarray, group_sizes: np.ndarray, w: np.ndarray,
                 matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul) -> np.ndarray:
    """Rows x (R, d_in), in groups of group_sizes (E,) consecutive rows (sum R), times w (E, d_in,
    d_out): row block e @ w[e]. Returns (R, d_out). One matmul(x_block, w[e]) per non-empty group."""
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


def combine(y: np.ndarray, d: Dispatch, weights: np.ndarray, n_tokens: int) -> np.ndarray:
    """The layer's output (n_tokens, d_out): out[t] = sum over t's routed rows r of
    weights[t, slot[r]] * y[r]; y (R, d_out) in d's (expert-sorted) order, weights (T, k).
    Tokens with no routed row get zeros."""
    y, weights = np.asarray(y), np.asarray(weights)
    check_rows("combine", "y", y)
    if y.shape[0] != d.token.size or weights.shape != d.kept.shape or weights.shape[0] != n_tokens:
        raise ValueError(f"combine: y {y.shape} must have one row per routed assignment ({d.token.size}) and weights "
                         f"the shape of the routing {d.kept.shape} with n_tokens={n_tokens} rows, got {weights.shape}")
    out = np.zeros((n_tokens, y.shape[1]), np.result_type(y, weights))
    np.add.at(out, d.token, weights[d.token, d.slot][:, None] * y)
    return out


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


def grouped_matmul(x: Tensor, group_sizes: np.ndarray, w: Tensor) -> Tensor:
    """Autograd grouped GEMM: rows x (R, d_in) in groups of group_sizes (E,) consecutive rows,
    times w (E, d_in, d_out); returns (R, d_out). Backward per group: dx_e = g_e w_e^T,
    dw_e = x_e^T g_e (zeros for empty groups)."""
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


def scatter_rows(src: Tensor, index: np.ndarray, n: int) -> Tensor:
    """out (n, d) with out[index[r]] += src[r] for every row r of src (R, d); index (R,) ints in
    [0, n). Backward: g[index]."""
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


def all_to_all(comm: Communicator, x: np.ndarray, send_counts: Any, recv_counts: Any, tag: int = 0) -> np.ndarray:
    """Rows x (n, ...) split by send_counts (comm.size counts, sum n): block j goes to rank j.
    Returns the blocks received, recv_counts[s] rows from rank s, concatenated in rank order, shape
    (sum(recv_counts), ...), x's dtype. Pairwise order: step s sends to (rank + s) % size and
    receives from (rank - s) % size; every receive is posted (into its rows of the result) before
    the sends; the own block is copied. Blocks are sent even when empty."""
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


def exchange_counts(comm: Communicator, send_counts: Any, tag: int = 0) -> np.ndarray:
    """What every rank will send to this one: recv_counts[s] = rank s's send_counts[rank], as an
    int64 array (size,). send_counts: comm.size integers >= 0 (an all-to-all of one per pair)."""
    counts = np.asarray(check_counts("exchange_counts", "send_counts", send_counts), dtype=np.int64)
    if counts.size != comm.size:
        raise ValueError(f"exchange_counts: rank {comm.rank}: need {comm.size} counts, got {counts.tolist()}")
    ones = [1] * comm.size
    return all_to_all(comm, counts, ones, ones, tag=tag)


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


def ep_dp_groups(comm: Communicator, ep: int) -> tuple[Communicator, Communicator]:
    """(ep_group, dp_group) of this rank, rank = d * ep + e: ep_group = ranks d*ep .. d*ep+ep-1 (one
    replica's experts), dp_group = ranks e, ep + e, ... (the same experts in every replica)."""
    ep = check_int("ep_dp_groups", "ep", ep, 1, comm.size)
    if comm.size % ep:
        raise ValueError(f"ep_dp_groups: ep={ep} does not divide the {comm.size} ranks")
    d, e = divmod(comm.rank, ep)
    return (comm.group([d * ep + j for j in range(ep)]), comm.group([i * ep + e for i in range(comm.size // ep)]))


def all_to_all_op(comm: Communicator, x: Tensor, send_counts: Any, recv_counts: Any,
                  a2a: Callable | None = None) -> Tensor:
    """Autograd all-to-all of the rows of x (n, d): forward a2a(comm, x, send_counts, recv_counts)
    (default: all_to_all), x's dtype; backward a2a(comm, g, recv_counts, send_counts) with g cast to
    x's dtype (a float32 layer sends float32 gradients, whatever the loss was computed in)."""
    check_counts("all_to_all_op", "send_counts", send_counts)  # (before anything is sent, whatever a2a checks)
    check_counts("all_to_all_op", "recv_counts", recv_counts)
    a2a = a2a or all_to_all
    x = x if isinstance(x, Tensor) else Tensor(x)
    out = x._new(a2a(comm, x.data, send_counts, recv_counts))
    return x._record(out, (x,), lambda g: (a2a(comm, np.ascontiguousarray(g, dtype=x.dtype), recv_counts, send_counts),),
                     "all_to_all")


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


def ep_dp_train_step(comm: Communicator, dp_comm: Communicator, model: ExpertParallelMoE, x: np.ndarray,
                     target: np.ndarray, loss_fn: Callable[[Tensor, np.ndarray], Tensor], lr: float,
                     allreduce: Callable = ring_allreduce) -> float:
    """One SGD step (p -= lr * grad) of an EP x DP run: loss_fn(model(x), target) on this rank's
    tokens, backward, expert gradients all-reduced (summed) over dp_comm, the others over comm (all
    ranks). loss_fn must scale by the global batch so that the sums are the full gradient. x is
    cast to the parameters' dtype. Returns this rank's loss."""
    for p in model.parameters():
        p.zero_grad()
    loss = loss_fn(model(Tensor(np.asarray(x, dtype=model.router.dtype))), target)
    loss.backward()
    for group, params in ((dp_comm, model.expert_parameters()), (comm, model.shared_parameters())):
        for p in params:
            g = p.grad.data if p.grad is not None else np.zeros_like(p.data)
            p.data -= lr * allreduce(group, g)
    return loss.item()


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


def estimate_ep(model: MoESpec, cluster: ClusterSpec, ep: int) -> Estimate:
    """Memory per rank (bytes) and step time (seconds) of expert groups of `ep` ranks (dp =
    n_ranks / ep replicas), by the formulas above. ValueError naming the problem unless ep >= 1
    divides cluster.n_ranks and model.n_experts."""
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


def best_ep(model: MoESpec, cluster: ClusterSpec) -> tuple[int, Estimate]:
    """The fastest ep (dividing n_ranks and n_experts) whose memory is <= cluster.memory; exactly
    equal times: the smaller ep. ValueError naming the smallest memory needed, in GB, if none fits."""
    options = [(estimate_ep(model, cluster, ep), ep) for ep in range(1, cluster.n_ranks + 1)
               if cluster.n_ranks % ep == 0 and model.n_experts % ep == 0]
    fits = [(est.time, ep, est) for est, ep in options if est.memory <= cluster.memory]
    if not fits:
        est, ep = min(options, key=lambda o: o[0].memory)
        raise ValueError(f"best_ep: no ep fits {model.name} in {cluster.memory / 1e9:.3g} GB per rank; the smallest, "
                         f"ep={ep}, needs {est.memory / 1e9:.3g} GB")
    _, ep, est = min(fits, key=lambda f: (f[0], f[1]))
    return ep, est


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
