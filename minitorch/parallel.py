# Generated from solutions/12_data_parallel.py by `make build`. Do not edit.
"""minitorch.parallel: collectives from send/recv, the alpha-beta cost model, data-parallel
training with gradient bucketing, ZeRO sharding and activation checkpointing.

Runs on any `minitorch.comm` communicator (simulated or MPI).
"""
from __future__ import annotations

import math
import os
import time
import tracemalloc
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from minitorch import checks as _checks
from minitorch.autograd import Tensor, no_grad, topo_order, unbroadcast
from minitorch.comm import Communicator, Work, chunk_bounds
from minitorch.nn import Module, Parameter, cross_entropy


def check_received(comm: Communicator, got: np.ndarray, held: np.ndarray, src: int, what: str,
                   same_size: bool = True) -> np.ndarray:
    """`got`, the message this rank just received from rank `src`, after checking it against
    `held`, the piece of its own array it is about to combine it with; or a ValueError naming
    both ranks, sizes and dtypes.

    A collective cannot see the other ranks' arrays without sending more, so the collectives of
    this lesson check on receipt: every message must have the dtype of what the receiver holds
    (and, unless same_size=False as in an all-gather, the same number of elements). Ranks that
    called a collective with different sizes or dtypes fail on the first rank that receives a
    message that does not fit, before anything is added; no extra message, no extra byte.

    It runs once per message of a ring, so its arguments are checked here, not by a wrapper: the
    common case (two arrays, a rank, a name) costs a few type tests."""
    if not (type(got) is np.ndarray and type(held) is np.ndarray and type(src) is int  # noqa: E721
            and type(what) is str and type(same_size) is bool and hasattr(comm, "size")  # noqa: E721
            and 0 <= src < comm.size):
        _check_received_args(comm, got, held, src, what, same_size)
        got, held = np.asarray(got), np.asarray(held)
    if got.dtype != held.dtype or (same_size and got.size != held.size):
        mine = f"{held.size} element(s) of {held.dtype}"
        theirs = f"{got.size} element(s) of {got.dtype}"
        raise ValueError(
            f"{what}: rank {comm.rank} got {theirs} from rank {src}, but the piece held here has {mine}: "
            f"every rank must call the collective with an array of the same size and dtype")
    return got


def _check_received_args(comm: Any, got: Any, held: Any, src: Any, what: Any, same_size: Any) -> None:
    """check_received's arguments, off its fast path: each refused by name."""
    _checks.Attrs("rank", "size", "send", "recv")("check_received", "comm", comm)
    for name, value in (("got", got), ("held", held)):
        _checks.check_array("check_received", name, value)
    _checks.check_int("check_received", "src", src, 0, comm.size - 1)
    _checks.Str()("check_received", "what", what)
    _checks.check_bool("check_received", "same_size", same_size)


def check_batch(what: str, X: np.ndarray, y: np.ndarray) -> None:
    """A ValueError naming `what` unless X (B, d) and y (B,) have one row per label and the labels
    are >= 0 (cross_entropy checks them against the number of classes): checked on every rank
    before a step sends anything."""
    if len(X) != len(y):
        raise ValueError(f"{what}: X and y must have one row per label, got X of shape {np.shape(X)} and y of "
                         f"shape {np.shape(y)}")
    if len(y) and np.min(y) < 0:
        raise ValueError(f"{what}: y must hold class indices >= 0, got {int(np.min(y))} at index {int(np.argmin(y))}")


def naive_allreduce(comm: Communicator, x: np.ndarray) -> np.ndarray:
    """Elementwise sum over ranks of `x`, returned on every rank (a new array, x's shape and dtype).

    Every rank sends x to rank 0; rank 0 adds them in rank order and sends the sum to ranks
    1..N-1. x: any shape, any numeric dtype, the same shape and dtype on every rank (rank 0
    checks each array it receives with check_received); not modified."""
    x = np.asarray(x)
    if comm.rank == 0:
        total = x.copy()
        for src in range(1, comm.size):
            total += check_received(comm, comm.recv(src), x, src, "naive_allreduce").reshape(x.shape)
        for dst in range(1, comm.size):
            comm.send(total, dst)
        return total
    comm.send(x, 0)
    return comm.recv(0)


def ring_reduce_scatter(comm: Communicator, x: np.ndarray) -> np.ndarray:
    """Chunk `comm.rank` of the elementwise sum over ranks of x.ravel(), by the ring.

    x: n elements (any shape), the same n and dtype on every rank: every chunk received is
    checked against the chunk it is added to with check_received. Chunks: chunk_bounds(n, size).
    Returns a new 1-D array of x's dtype and length hi - lo. Sends N-1 messages, all to
    (rank + 1) % size."""
    flat = np.asarray(x).reshape(-1)
    size, rank = comm.size, comm.rank
    parts = [flat[lo:hi] for lo, hi in chunk_bounds(flat.size, size)]  # views of x, never written
    right, left = (rank + 1) % size, (rank - 1) % size
    for s in range(size - 1):
        k = (rank - s - 2) % size
        got = comm.sendrecv(parts[(rank - s - 1) % size], right, left)
        got = check_received(comm, got, parts[k], left, "ring_reduce_scatter")
        parts[k] = np.add(got, parts[k], out=got)  # into the new array sendrecv returned: no copy of x
    return parts[rank] if size > 1 else parts[rank].copy()


def ring_allgather(comm: Communicator, chunk: np.ndarray) -> np.ndarray:
    """Every rank's chunk.ravel(), concatenated in rank order, on every rank, by the ring.

    Chunks may differ in length between ranks but must share a dtype: every chunk received is
    checked with check_received(..., same_size=False). Returns a new 1-D array. Sends N-1
    messages, all to (rank + 1) % size."""
    size, rank = comm.size, comm.rank
    parts: list = [None] * size
    parts[rank] = np.asarray(chunk).reshape(-1)  # only read: concatenate makes the new array
    right, left = (rank + 1) % size, (rank - 1) % size
    for s in range(size - 1):
        got = comm.sendrecv(parts[(rank - s) % size], right, left)
        parts[(rank - s - 1) % size] = check_received(comm, got, parts[rank], left, "ring_allgather", same_size=False)
    return np.concatenate(parts)


def ring_allreduce(comm: Communicator, x: np.ndarray) -> np.ndarray:
    """Elementwise sum over ranks of x (any shape; the same size and dtype on every rank, or a
    ValueError from check_received), on every rank: ring reduce-scatter, then ring all-gather.
    Returns a new array of x's shape and dtype."""
    x = np.asarray(x)
    return ring_allgather(comm, ring_reduce_scatter(comm, x)).reshape(x.shape)


def mpi4py_ring_allreduce(world: Any, x: np.ndarray) -> np.ndarray:
    """The ring all-reduce of `ring_allreduce` on an mpi4py communicator (`MPI.COMM_WORLD`),
    with `Sendrecv` of NumPy chunks: the same steps, chunks and sums, nothing in between."""
    flat = np.asarray(x).reshape(-1)
    size, rank = world.Get_size(), world.Get_rank()
    parts = [flat[lo:hi] for lo, hi in chunk_bounds(flat.size, size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    for s in range(size - 1):
        k = (rank - s - 2) % size
        into = np.empty_like(parts[k])
        world.Sendrecv(parts[(rank - s - 1) % size], right, recvbuf=into, source=left)
        parts[k] = np.add(into, parts[k], out=into)
    for s in range(size - 1):
        k = (rank - s - 1) % size
        into = np.empty_like(parts[k])
        world.Sendrecv(parts[(rank - s) % size], right, recvbuf=into, source=left)
        parts[k] = into
    return np.concatenate(parts).reshape(x.shape)


def mpi_best_seconds(ops: Sequence[Callable[[], Any]], budget: float = 0.05, trials: int = 5) -> list[float]:
    """On every rank of an MPI run: seconds per call of each `op()` (a collective step every rank
    runs), the best of `trials` trials of about `budget` seconds between barriers. The ops' trials
    are interleaved (op 0, op 1, ..., then op 0 again), so each op is timed in the same conditions
    on a machine whose speed drifts; the repetitions are agreed by all ranks (the fewest any rank
    asks for, 1 to 200), after one warm-up call of each op."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    reps = []
    for op in ops:
        op()  # warm up
        world.Barrier()
        t0 = time.perf_counter()
        op()
        reps.append(int(world.allreduce(max(1, min(200, budget / max(time.perf_counter() - t0, 1e-6))), op=MPI.MIN)))
    best = [math.inf] * len(ops)
    for _ in range(trials):
        for i, (op, n) in enumerate(zip(ops, reps)):
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                op()
            world.Barrier()
            best[i] = min(best[i], (time.perf_counter() - t0) / n)
    return best


def allreduce_timings(comm: Communicator, sizes: list[int], budget: float = 0.05,
                      ring: Callable | None = None) -> list[tuple[int, float, float, float]]:
    """On every rank of an MPI run: per size (bytes of float64), the seconds per all-reduce of
    `ring(comm, x)` (default: ring_allreduce), of `mpi4py_ring_allreduce` and of `MPI.Allreduce`,
    each the best of 5 trials of about `budget` seconds, interleaved (mpi_best_seconds)."""
    from mpi4py import MPI

    ring = ring or ring_allreduce
    world = MPI.COMM_WORLD
    out = []
    for nbytes in sizes:
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 8)
        y = np.empty_like(x)
        ops = [lambda: ring(comm, x), lambda: mpi4py_ring_allreduce(world, x), lambda: world.Allreduce(x, y)]
        best = mpi_best_seconds(ops, budget)
        if not (np.array_equal(ring(comm, x), mpi4py_ring_allreduce(world, x)) and np.allclose(ring(comm, x), y)):
            raise AssertionError(f"rank {comm.rank}: the rings or MPI.Allreduce disagree at {nbytes} bytes")
        out.append((nbytes, *best))
    return out


def machine_load() -> str:
    """'N cores, load a/b/c' (1, 5 and 15-minute load averages, where the OS gives them)."""
    try:
        load = "load " + "/".join(f"{v:.1f}" for v in os.getloadavg())
    except (AttributeError, OSError):
        load = "load unknown"
    return f"{os.cpu_count()} cores, {load}"


class Cost(NamedTuple):
    """Predicted seconds, and bytes sent by the busiest rank."""
    time: float
    bytes: float


COLLECTIVES = ("naive_allreduce", "ring_reduce_scatter", "ring_allgather", "ring_allreduce")


def collective_cost(name: str, nbytes: float, nranks: int, alpha: float, beta: float) -> Cost:
    """Alpha-beta prediction for collective `name` (one of COLLECTIVES) on `nranks` ranks.

    nbytes: S, the bytes of the whole array (of the result, for the all-gather); assume nranks
    divides it. alpha: seconds per message, beta: seconds per byte. Raises ValueError for an
    unknown name or nranks < 1."""
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}: use one of {COLLECTIVES}")
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    n, s = nranks, float(nbytes)
    if name == "naive_allreduce":
        return Cost(2 * (n - 1) * (alpha + s * beta), (n - 1) * s)
    steps = (n - 1) if name in ("ring_reduce_scatter", "ring_allgather") else 2 * (n - 1)
    return Cost(steps * (alpha + s / n * beta), steps * s / n)


def dp_train_step(comm: Communicator, model: Module, optimizer: Any, X: np.ndarray, y: np.ndarray,
                  allreduce: Callable) -> float:
    """One data-parallel step on the global batch X (B, d), y (B,) int, the same on every rank.

    First resets every gradient (optimizer.zero_grad(): backward adds to p.grad, and p.grad
    still holds the previous step's sum). This rank trains on rows chunk_bounds(B, size)[rank]
    with the loss
    cross_entropy(model(rows), labels) * rows / B (skipped when it has no rows), sums every
    parameter's gradient over the ranks with allreduce(comm, grad) (each Parameter once; zeros
    where this rank has no gradient), sets p.grad to the sum and calls optimizer.step().
    X (of any real dtype: float16 or float64 too) is cast to the parameters' dtype and the zeros
    have it too: a float32 model all-reduces float32. Returns this rank's scaled loss (they sum to
    the loss of the global batch)."""
    check_batch("dp_train_step", X, y)  # given: before anything is sent
    B = len(X)
    lo, hi = chunk_bounds(B, comm.size)[comm.rank]
    params = model.parameters()
    optimizer.zero_grad()
    local = 0.0
    if hi > lo:
        logits = model(Tensor(np.asarray(X[lo:hi], dtype=params[0].dtype)))
        loss = cross_entropy(logits, y[lo:hi]) * ((hi - lo) / B)
        loss.backward()
        local = loss.item()
    for p in params:
        g = p.grad.data if p.grad is not None else np.zeros_like(p.data)
        p.grad = Tensor(allreduce(comm, g))
    optimizer.step()
    return local


def op_flops(node: Tensor) -> float:
    """Approximate forward flops of the op that produced `node`: 2 * (output size) * k for a
    matmul contracting k, else one per output element. (Cost model for the simulated clock.)"""
    if node._op == "matmul" and node._parents:
        p = node._parents[0]
        if len(node._parents) == 1 and p.ndim >= 2 and p.shape[-1] == node.shape[-1]:
            k = p.shape[-2]  # only the right operand needs a gradient: (k, n)
        else:
            k = p.shape[-1]  # the left operand (..., k)
        return 2.0 * node.size * k
    return float(node.size)


def charge_forward(comm: Communicator, loss: Tensor) -> None:
    """Charge the forward pass that built `loss` to comm's clock, one "F" interval per op."""
    for node in topo_order(loss):
        if node._parents:
            comm.compute(flops=op_flops(node), kind="F", label=node._op)


def backward_with_hooks(loss: Tensor, on_ready: Callable[[Tensor], None] | None = None,
                        comm: Communicator | None = None) -> None:
    """loss.backward() (lesson 02's engine, same order of operations, same gradients), plus:
    on_ready(leaf) is called as soon as a leaf's .grad is final, i.e. right after the backward
    of its last consumer; each node's backward (2x its forward flops) is charged to comm as "B"."""
    if loss.size != 1:
        raise ValueError(f"backward_with_hooks needs a one-element loss, got shape {loss.shape}")
    order = topo_order(loss)
    consumers: dict[int, int] = {}
    for node in order:
        for parent in node._parents:
            consumers[id(parent)] = consumers.get(id(parent), 0) + 1
    grads: dict[int, Any] = {id(loss): loss.xp.ones(loss.shape, dtype=loss.dtype)}

    def finish_leaf(leaf: Tensor) -> None:
        g = leaf.backend.asarray(grads.pop(id(leaf)), dtype=leaf.dtype)
        leaf.grad = Tensor(g.copy() if leaf.grad is None else leaf.grad.data + g, device=leaf.device)
        if on_ready is not None:
            on_ready(leaf)

    for node in reversed(order):
        if node._vjp is None:  # a leaf: finished when its last consumer was
            if node is loss and id(node) in grads:
                finish_leaf(node)
            continue
        g = grads.pop(id(node), None)
        if g is not None:
            if comm is not None:
                comm.compute(flops=2 * op_flops(node), kind="B", label=node._op)
            for parent, pg in zip(node._parents, node._vjp(g)):
                if pg is None:
                    continue
                if tuple(pg.shape) != parent.shape:
                    pg = unbroadcast(pg, parent.shape)
                grads[id(parent)] = pg if id(parent) not in grads else grads[id(parent)] + pg
        for parent in node._parents:
            consumers[id(parent)] -= 1
            if parent._vjp is None and consumers[id(parent)] == 0 and id(parent) in grads:
                finish_leaf(parent)


def make_buckets(params: list, bucket_bytes: int) -> list[list[int]]:
    """Indices into `params`, grouped into buckets in reverse order (last parameter first).

    A bucket is closed as soon as its parameters' data hold >= bucket_bytes bytes; the
    remainder forms the last bucket. Raises ValueError if bucket_bytes <= 0."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        filled += params[i].data.nbytes
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def dp_train_step_overlap(comm: Communicator, model: Module, optimizer: Any, X: np.ndarray, y: np.ndarray,
                          allreduce: Callable, bucket_bytes: int) -> float:
    """dp_train_step with bucketed all-reduces launched during the backward pass.

    Buckets: make_buckets(model.parameters(), bucket_bytes). Forward (charged with
    charge_forward), backward with backward_with_hooks(loss, on_ready, comm); bucket k's
    flattened gradients go to comm.launch(allreduce, flat) once all of them are ready and
    buckets 0..k-1 are launched. Then wait for every bucket, set each p.grad to its summed
    slice, optimizer.step(). Returns this rank's scaled loss."""
    check_batch("dp_train_step_overlap", X, y)  # given: before anything is sent
    params = model.parameters()
    buckets = make_buckets(params, bucket_bytes)
    index = {id(p): i for i, p in enumerate(params)}
    ready: set[int] = set()
    launched: list[tuple[list[int], Work]] = []

    def launch_ready_buckets() -> None:
        while len(launched) < len(buckets) and all(i in ready for i in buckets[len(launched)]):
            bucket = buckets[len(launched)]
            flat = np.concatenate([(params[i].grad.data if params[i].grad is not None
                                    else np.zeros_like(params[i].data)).reshape(-1) for i in bucket])
            launched.append((bucket, comm.launch(allreduce, flat)))

    def on_ready(leaf: Tensor) -> None:
        if id(leaf) in index:
            ready.add(index[id(leaf)])
            launch_ready_buckets()

    B = len(X)
    lo, hi = chunk_bounds(B, comm.size)[comm.rank]
    optimizer.zero_grad()
    local = 0.0
    if hi > lo:
        logits = model(Tensor(np.asarray(X[lo:hi], dtype=params[0].dtype)))
        loss = cross_entropy(logits, y[lo:hi]) * ((hi - lo) / B)
        charge_forward(comm, loss)
        backward_with_hooks(loss, on_ready, comm)
        local = loss.item()
    ready.update(range(len(params)))
    launch_ready_buckets()
    for bucket, work in launched:
        flat, offset = work.wait(), 0
        for i in bucket:
            p = params[i]
            p.grad = Tensor(flat[offset:offset + p.size].reshape(p.shape))
            offset += p.size
    optimizer.step()
    return local


def zero_memory_per_rank(num_params: float, nranks: int, stage: int, K: int = 12) -> float:
    """Bytes of model states per rank under ZeRO `stage` (0 = plain data parallelism, 1, 2, 3)
    with mixed precision: 2 bytes per fp16 weight, 2 per fp16 gradient, K per parameter of
    optimizer state. Raises ValueError for another stage."""
    psi, n = float(num_params), nranks
    if stage == 0:
        return (2 + 2 + K) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + K * psi / n
    if stage == 2:
        return 2 * psi + (2 + K) * psi / n
    if stage == 3:
        return (2 + 2 + K) * psi / n
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")


class ZeroAdam:
    """Adam (minitorch.optim.Adam's update) with ZeRO stage 1, 2 or 3 sharding, for one rank.

    All parameters form one flat vector of `numel` elements; this rank owns lo:hi
    (chunk_bounds(numel, size)[rank]). Arrays it keeps:
      master, m, v   this rank's slice of the weights and Adam's moments (stages 1-3)
      flat_grad      stage 1: the full gradient buffer, the summed slice written at lo:hi
      grad_shard     the summed gradient of this rank's slice (stage 1: a view of flat_grad)
      param_shard    stage 3: this rank's slice of the working weights; the model's own
                     parameter arrays are empty between gather_params and the next release
    A step: gather_params(); forward and backward; reduce_gradients(); step().
    reduce_scatter(comm, flat) and allgather(comm, chunk) are collectives as in section 2."""

    def __init__(self, comm: Communicator, model: Module, stage: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, *,
                 reduce_scatter: Callable, allgather: Callable):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroAdam: stage must be 1, 2 or 3, got {stage!r}")
        self.comm, self.model, self.stage = comm, model, stage
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, 0
        self.reduce_scatter, self.allgather = reduce_scatter, allgather
        self.params = model.parameters()
        self.shapes = [p.shape for p in self.params]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.numel = sum(self.sizes)
        self.lo, self.hi = chunk_bounds(self.numel, comm.size)[comm.rank]
        self.master = self.flat_params()[self.lo:self.hi].copy()
        self.m, self.v = np.zeros_like(self.master), np.zeros_like(self.master)
        self.flat_grad: np.ndarray | None = None
        self.grad_shard: np.ndarray | None = None
        self.param_shard: np.ndarray | None = None
        if stage == 3:
            self.param_shard = self.master.copy()
            self.release_params()

    # -- given helpers
    def flat_params(self) -> np.ndarray:
        return np.concatenate([p.data.reshape(-1) for p in self.params])

    def flat_grads(self) -> np.ndarray:
        """The model's gradients as one new flat array (zeros for a parameter without one)."""
        return np.concatenate([(p.grad.data if p.grad is not None else np.zeros(n, self.master.dtype)).reshape(-1)
                               for p, n in zip(self.params, self.sizes)])

    def set_params(self, flat: np.ndarray) -> None:
        """Make the model's parameters views of the full flat vector `flat` (numel elements)."""
        flat = np.asarray(flat)
        if flat.size != self.numel:
            raise ValueError(f"set_params: expected {self.numel} elements, got {flat.size}")
        offset = 0
        for p, shape, n in zip(self.params, self.shapes, self.sizes):
            p.data = flat[offset:offset + n].reshape(shape)
            offset += n

    def release_params(self) -> None:
        """Drop the model's weights (stage 3 between steps): empty arrays until gather_params."""
        for p in self.params:
            p.data = np.empty(0, self.master.dtype)

    def release_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def memory(self) -> dict[str, int]:
        """Elements held now, by role: params (the model's weights, param_shard), grads (p.grad,
        flat_grad, grad_shard), optimizer (master, m, v), other (any other array attribute).
        An array that is a view of another (same dtype) is counted once."""
        seen: set[int] = set()
        held = {"params": 0, "grads": 0, "optimizer": 0, "other": 0}

        def add(role: str, a: Any) -> None:
            if a is None:
                return
            a = a.data if isinstance(a, Tensor) else a
            while isinstance(a.base, np.ndarray) and a.base.dtype == a.dtype:
                a = a.base
            if id(a) not in seen:
                seen.add(id(a))
                held[role] += a.size

        for p in self.params:
            add("params", p.data)
        add("params", self.param_shard)
        for p in self.params:
            add("grads", p.grad)
        add("grads", self.flat_grad)
        add("grads", self.grad_shard)
        for a in (self.master, self.m, self.v):
            add("optimizer", a)
        for value in vars(self).values():
            if isinstance(value, np.ndarray):
                add("other", value)
        return held

    # -- the exercise
    def gather_params(self) -> None:
        """Before the forward pass. Stage 3: all-gather the param_shard slices and make them the
        model's weights (set_params). Stages 1, 2: nothing (the model holds full weights)."""
        if self.stage == 3:
            self.set_params(self.allgather(self.comm, self.param_shard))

    def reduce_gradients(self) -> None:
        """After the backward pass: reduce-scatter flat_grads() so that grad_shard holds the
        summed gradient of lo:hi, and release the model's p.grad. Stage 1 keeps the full buffer
        (flat_grad, the sum written at lo:hi; grad_shard a view of it); stages 2, 3 keep only
        grad_shard (flat_grad None). Stage 3 also releases the weights (release_params)."""
        flat = self.flat_grads()
        shard = self.reduce_scatter(self.comm, flat)
        self.release_grads()
        if self.stage == 1:
            flat[self.lo:self.hi] = shard
            self.flat_grad, self.grad_shard = flat, flat[self.lo:self.hi]
        else:
            self.flat_grad, self.grad_shard = None, shard
        if self.stage == 3:
            self.release_params()

    def step(self) -> None:
        """Adam on this rank's slice with grad_shard (the same arithmetic as minitorch.optim.Adam,
        t counting steps), then: stages 1, 2: all-gather the updated master slices into the model
        (set_params); stage 3: copy master into param_shard (no communication)."""
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        g = self.grad_shard
        self.m *= b1
        self.m += (1 - b1) * g
        self.v *= b2
        self.v += (1 - b2) * g * g
        self.master -= self.lr * (self.m / c1) / (np.sqrt(self.v / c2) + self.eps)
        if self.stage == 3:
            self.param_shard[...] = self.master
        else:
            self.set_params(self.allgather(self.comm, self.master))


def zero_train_step(comm: Communicator, model: Module, zero: ZeroAdam, X: np.ndarray, y: np.ndarray) -> tuple[float, dict]:
    """gather_params, forward and backward on this rank's rows (loss scaled by rows / B),
    reduce_gradients, step. Returns (this rank's scaled loss, zero.memory() before the step)."""
    check_batch("zero_train_step", X, y)
    zero.gather_params()
    B = len(X)
    lo, hi = chunk_bounds(B, comm.size)[comm.rank]
    local = 0.0
    if hi > lo:
        loss = cross_entropy(model(Tensor(np.asarray(X[lo:hi], dtype=zero.master.dtype))), y[lo:hi]) * ((hi - lo) / B)
        loss.backward()
        local = loss.item()
    zero.reduce_gradients()
    held = zero.memory()
    zero.step()
    return local, held


def stored_activation_bytes(loss: Tensor) -> int:
    """Bytes of the intermediate tensors (graph nodes that are not leaves) kept for the backward."""
    return sum(node.data.nbytes for node in topo_order(loss) if node._parents)


def peak_memory(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), peak bytes allocated above the starting point while fn ran), by tracemalloc."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    try:
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        if not tracing:
            tracemalloc.stop()
    return out, peak - start


def free_graph(root: Tensor) -> None:
    """Forget the graph that produced `root`, as PyTorch's backward does unless retain_graph=True.

    Lesson 02's nodes reach themselves through their VJP closures (a reference cycle), so a
    graph nobody uses any more is freed only when Python's cycle collector happens to run;
    dropping every node's parents and VJP frees it at once."""
    for node in topo_order(root):
        if node._parents:
            node._parents, node._vjp = (), None


class Block(Module):
    """relu(x @ W + b): one layer of a deep MLP (keeps 3 activations for the backward)."""

    def __init__(self, width: int, rng: np.random.Generator):
        self.weight = Parameter(rng.standard_normal((width, width)) * np.sqrt(2.0 / width), dtype=np.float64)
        self.bias = Parameter(np.zeros(width), dtype=np.float64)

    def forward(self, x: Tensor) -> Tensor:
        return (x @ self.weight + self.bias).relu()


def checkpoint(fn: Callable[[Tensor], Tensor], x: Tensor, params: list) -> Tensor:
    """fn(x), without storing fn's intermediate results: fn runs under no_grad, and the returned
    node's backward recomputes fn on a detached copy of x (recording the graph this time) and
    backpropagates the incoming gradient through it. params: the Parameters fn uses; they get
    their gradients from that nested backward. Gradients equal those of fn(x) itself."""
    with no_grad():
        out = fn(x)

    def vjp(g: Any) -> tuple:
        x_again = Tensor(x.data, requires_grad=True)
        y = fn(x_again)
        y.backward(g)
        free_graph(y)  # the recomputed activations go now, not at the next garbage collection
        gx = x_again.grad.data if x_again.grad is not None else None
        return (gx, *([None] * len(params)))

    return x._record(out, (x, *params), vjp, "checkpoint")


def checkpointed_forward(layers: list, x: Tensor, segments: int) -> Tensor:
    """The layers applied in order to x, cut into `segments` consecutive groups
    (chunk_bounds(len(layers), segments)), each run through checkpoint. Raises ValueError
    unless 1 <= segments <= len(layers)."""
    if not 1 <= segments <= len(layers):
        raise ValueError(f"segments must be in 1..{len(layers)} (the number of layers), got {segments}")
    for lo, hi in chunk_bounds(len(layers), segments):
        group = layers[lo:hi]
        params = list({id(p): p for layer in group for p in layer.parameters()}.values())

        def run_group(h: Tensor, group: list = group) -> Tensor:
            for layer in group:
                h = layer(h)
            return h

        x = checkpoint(run_group, x, params)
    return x


def link_sweep(comm: Communicator, sizes: Sequence[int], reps: int = 10, peer: int = 1,
               all_pairs: bool = False) -> list[float] | None:
    """Ping-pong between rank 0 and rank `peer` (every other rank only joins the barriers): for each
    size in bytes, the best of `reps` round trips (after one that warms up), halved: the one-way time
    of a message of that size (comm.time: wall seconds under MPI, simulated on the simulator).
    all_pairs=True: every rank r bounces with rank r XOR peer at the same time (peer a power of two,
    comm.size a multiple of 2 peer), which measures a link as a collective uses it, every rank busy.
    On rank 0 a list, one time per size; None on the other ranks."""
    if not 1 <= peer < comm.size:
        raise ValueError(f"link_sweep: peer must be a rank in [1, {comm.size}) (rank 0 bounces with it), got {peer}")
    if all_pairs and (peer & (peer - 1) or comm.size % (2 * peer)):
        raise ValueError(f"link_sweep: with all_pairs, peer must be a power of two and comm.size ({comm.size}) a "
                         f"multiple of 2 * peer, got peer={peer}")
    partner = comm.rank ^ peer if all_pairs else (peer if comm.rank == 0 else 0 if comm.rank == peer else None)
    best = []
    for n in sizes:
        x = np.zeros(n, np.uint8)
        times = []
        for _ in range(reps + 1):
            comm.barrier()
            t0 = comm.time
            if partner is not None and comm.rank < partner:
                comm.send(x, partner)
                comm.recv(partner)
            elif partner is not None:
                comm.send(comm.recv(partner), partner)
            times.append(comm.time - t0)
        best.append(min(times[1:]) / 2)
    return best if comm.rank == 0 else None


def fit_link(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(alpha, beta) of the line alpha + n * beta through the one-way times `seconds` of messages of
    `sizes` bytes: alpha, the median time of the messages of at most 1 KiB (all latency; the smallest
    message's if none is that small); beta, the least-squares slope of the line through (0, alpha),
    which the largest messages dominate, as a collective's large chunks do (a link's first bytes after
    a pause may pass faster: a token bucket's depth, an eager protocol). Where noise in the small
    messages' times makes that slope 0 or less, beta is the largest message's time per byte."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"fit_link: needs at least 2 sizes and one time per size, got {len(sizes)} sizes and "
                         f"{len(seconds)} times")
    n, t = np.asarray(sizes, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if not (np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ValueError(f"fit_link: seconds must be finite and > 0, got {t.tolist()}")
    if np.all(n == n.min()):
        raise ValueError(f"fit_link: needs at least two different sizes, got {n.tolist()}")
    small = n <= 1024
    alpha = float(np.median(t[small])) if small.any() else float(t[np.argmin(n)])
    beta = float(np.sum(n * (t - alpha)) / np.sum(n * n))
    if beta <= 0:
        beta = float(t[np.argmax(n)] / n.max())
    return alpha, beta


def best_times(comm: Communicator, ops: Sequence[Callable[[], Any]], reps: int = 5, trials: int = 3) -> list[float]:
    """On every rank: seconds per call of each of `ops` (functions of no argument that every rank calls,
    in the same order: a collective), the best of `trials` trials of `reps` calls between barriers.
    The ops take turns (op 0, op 1, ..., then op 0 again), so that each meets the same conditions on a
    machine whose speed drifts; one warm-up call of each first. comm.time: wall seconds under MPI,
    simulated seconds on the simulator (a trial includes one barrier)."""
    for op in ops:
        op()
    best = [math.inf] * len(ops)
    for _ in range(trials):
        for i, op in enumerate(ops):
            comm.barrier()
            t0 = comm.time
            for _ in range(reps):
                op()
            comm.barrier()
            best[i] = min(best[i], (comm.time - t0) / reps)
    return best


TWO_LEVEL = ("ring_allreduce", "hierarchical_allreduce")


def two_level_cost(name: str, nbytes: float, nodes: int, ppn: int, alpha_intra: float, beta_intra: float,
                   alpha_inter: float, beta_inter: float) -> Cost:
    """Alpha-beta prediction of an all-reduce of S = nbytes on `nodes` nodes of `ppn` ranks (N = nodes *
    ppn, rank r on node r // ppn), as the simulator's two-level topology runs it: (alpha_intra,
    beta_intra) inside a node (run's alpha, beta), (alpha_inter, beta_inter) for each rank's link to the
    network. Cost.bytes: the bytes the busiest rank sends to other nodes. Assume N divides S.
      "ring_allreduce" (the flat ring in rank order): 2 (N-1) (alpha_x + S/N beta_x), x the slower link
        the ring uses (the network's when nodes > 1); one rank per node sends 2 (N-1) S/N across.
      "hierarchical_allreduce": 2 (P-1) (alpha_intra + S/P beta_intra) + 2 (M-1) (alpha_inter + S/N
        beta_inter); every rank sends 2 (M-1) S/N across."""
    if name not in TWO_LEVEL:
        raise ValueError(f"two_level_cost: unknown algorithm {name!r}: use one of {TWO_LEVEL}")
    m, p, s = nodes, ppn, float(nbytes)
    n = m * p
    if name == "ring_allreduce":
        step = alpha_inter + s / n * beta_inter if m > 1 else alpha_intra + s / n * beta_intra
        if m > 1 and p > 1:  # the ring's links inside the nodes too: every step waits for the slowest
            step = max(step, alpha_intra + s / n * beta_intra)
        return Cost(2 * (n - 1) * step, 2 * (n - 1) * s / n if m > 1 else 0.0)
    inside = 2 * (p - 1) * (alpha_intra + s / p * beta_intra)
    across = 2 * (m - 1) * (alpha_inter + s / n * beta_inter)
    return Cost(inside + across, 2 * (m - 1) * s / n)


def hierarchical_allreduce(comm: Communicator, x: np.ndarray, ppn: int, reduce_scatter: Callable = ring_reduce_scatter,
                           allreduce: Callable = ring_allreduce, allgather: Callable = ring_allgather) -> np.ndarray:
    """Elementwise sum over ranks of x, on every rank, for ranks on comm.size / ppn nodes of ppn ranks
    each, in order (rank r on node r // ppn, local rank r % ppn):
      1. reduce_scatter(node, x): local rank i gets chunk i (chunk_bounds(n, ppn)[i]) of its node's sum;
      2. allreduce(across, chunk): chunk i of the total, summed across nodes;
      3. allgather(node, chunk): the whole sum, x's shape and dtype (a new array).
    node = comm.group(the ppn ranks of this rank's node, in order), across = comm.group(the ranks with
    this rank's local rank, one per node, in order). x: any shape, the same size and dtype on every
    rank; not modified. ValueError unless ppn divides comm.size."""
    if comm.size % ppn:
        raise ValueError(f"hierarchical_allreduce: ppn must divide the {comm.size} ranks (the same number on every "
                         f"node), got ppn={ppn}")
    x = np.asarray(x)
    node, local = divmod(comm.rank, ppn)
    inside = comm.group([node * ppn + i for i in range(ppn)])
    across = comm.group(list(range(local, comm.size, ppn)))
    chunk = reduce_scatter(inside, x)
    chunk = allreduce(across, chunk)
    return allgather(inside, chunk).reshape(x.shape)


from minitorch.checks import (Array, Attrs, Bool, Choice, Count, Func, Instance, Int, NonNegative,  # noqa: E402
                              Positive, Rule, Seq, Size, Unchecked, validate_public)
from minitorch.comm import _comm_rules  # noqa: E402
from minitorch.optim import _Betas  # noqa: E402

class _Numbers(Rule):
    """Array()'s rule (an array-like of real numbers), with a fast path for an ndarray: the collectives
    run once per gradient of every training step."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if type(value) is not np.ndarray or value.dtype.kind not in "biuf":  # noqa: E721
            _ARRAY(what, name, value)


_TENSOR, _ARRAY, _NUMBERS = Instance(Tensor, must="a minitorch Tensor"), Array(), _Numbers()
_X, _Y = Array(ndim=2, dtypes="real", axes="(B, d)"), Array(ndim=1, dtypes="int", axes="(B,)")
_OPTIMIZER = Attrs("zero_grad", "step")
validate_public(globals(), _comm_rules(globals(), {
    # once per message of a ring: its arguments are checked in its body, on a fast path
    "check_received": {name: Unchecked() for name in ("comm", "got", "held", "src", "what", "same_size")},
    "naive_allreduce": {"x": _NUMBERS},
    "ring_reduce_scatter": {"x": _NUMBERS},
    "ring_allgather": {"chunk": _NUMBERS},
    "ring_allreduce": {"x": _NUMBERS},
    "mpi4py_ring_allreduce": {"world": Attrs("Sendrecv", "Get_size", "Get_rank")},
    "mpi_best_seconds": {"ops": Seq(Func(), min_len=1), "budget": Positive, "trials": Size},
    "allreduce_timings": {"sizes": Seq(Int(8), min_len=1), "budget": Positive},
    "collective_cost": {"name": Choice(*COLLECTIVES), "nbytes": NonNegative, "nranks": Size, "alpha": NonNegative,
                        "beta": NonNegative},
    "check_batch": {"X": _X, "y": _Y},
    "dp_train_step": {"optimizer": _OPTIMIZER, "X": _X, "y": _Y},
    "op_flops": {"node": _TENSOR},
    "charge_forward": {"loss": _TENSOR},
    "backward_with_hooks": {"loss": _TENSOR},
    "make_buckets": {"params": Seq(_TENSOR)},
    "dp_train_step_overlap": {"optimizer": _OPTIMIZER, "X": _X, "y": _Y},
    "zero_memory_per_rank": {"num_params": NonNegative, "nranks": Size, "K": Count},
    "ZeroAdam": {"lr": Positive, "betas": _Betas(), "eps": NonNegative},
    "ZeroAdam.set_params": {"flat": Array(ndim=1, dtypes="real")},
    "zero_train_step": {"X": _X, "y": _Y},
    "stored_activation_bytes": {"loss": _TENSOR},
    "free_graph": {"root": _TENSOR},
    "Block": {"width": Size},
    "checkpoint": {"x": _TENSOR, "params": Seq(_TENSOR)},
    "checkpointed_forward": {"layers": Seq(Func()), "x": _TENSOR},
    "link_sweep": {"sizes": Seq(Int(0), min_len=1), "reps": Size, "peer": Int(1), "all_pairs": Bool()},
    "fit_link": {"sizes": Seq(NonNegative, min_len=2), "seconds": Seq(Positive, min_len=2)},
    "best_times": {"ops": Seq(Func(), min_len=1), "reps": Size, "trials": Size},
    "two_level_cost": {"name": Choice(*TWO_LEVEL), "nbytes": NonNegative, "nodes": Size, "ppn": Size,
                       "alpha_intra": NonNegative, "beta_intra": NonNegative, "alpha_inter": NonNegative,
                       "beta_inter": NonNegative},
    "hierarchical_allreduce": {"x": _NUMBERS, "ppn": Size, "reduce_scatter": Func(), "allreduce": Func(),
                               "allgather": Func()},
}))
