# Generated from solutions/13_model_parallel.py by `make build`. Do not edit.
"""minitorch.model_parallel: pipeline schedules and their simulator, pipeline execution on a
communicator, Megatron-style tensor parallelism, ring attention, and a parallelism planner.

Runs on any `minitorch.comm` communicator (simulated or MPI).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Callable, NamedTuple

import numpy as np

from minitorch.attention import attention_np, causal_mask, check_qkv, merge_attention, merge_heads, split_heads
from minitorch.autograd import Tensor, topo_order
from minitorch.checks import check_int as _check_int
from minitorch.checks import check_number as _check_number
from minitorch.comm import Communicator, DeadlockError, Event, RunResult, chunk_bounds, mpi_status, run
from minitorch.gpt import gelu
from minitorch.nn import Linear, Module, Parameter, cross_entropy
from minitorch.parallel import free_graph, op_flops, ring_allreduce


class Step(NamedTuple):
    """One step of a pipeline schedule: kind "F" (forward) or "B" (backward) of micro-batch `mb`
    on model chunk `chunk` of this stage (0 unless the schedule is interleaved, section 3)."""
    kind: str
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


Schedule = list  # list[list[Step]]: schedule[s] is stage s's steps, in the order it runs them


def _check_pm(p: int, m: int, what: str = "schedule") -> None:
    for name, value in (("p (stages)", p), ("m (micro-batches)", m)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{what}: {name} must be a positive int, got {value!r}")


def gpipe_schedule(p: int, m: int) -> Schedule:
    """GPipe: on every one of the p stages, F of micro-batches 0..m-1, then B of 0..m-1.
    Returns a list of p lists of Steps. ValueError unless p >= 1 and m >= 1."""
    _check_pm(p, m, "gpipe_schedule")
    return [[Step("F", i) for i in range(m)] + [Step("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b_schedule(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): stage s runs w = min(p - s - 1, m) forwards (warm-up), then
    alternates F(w + i), B(i) for i = 0..m-w-1 (steady state), then the remaining backwards
    B(m-w)..B(m-1) (cool-down). ValueError unless p >= 1 and m >= 1."""
    _check_pm(p, m, "one_f_one_b_schedule")
    schedule = []
    for s in range(p):
        w = min(p - s - 1, m)
        steps = [Step("F", i) for i in range(w)]
        for i in range(m - w):
            steps += [Step("F", w + i), Step("B", i)]
        steps += [Step("B", i) for i in range(m - w, m)]
        schedule.append(steps)
    return schedule


class Interval(NamedTuple):
    """One step of a simulated or measured pipeline: `stage` ran `step` from `start` to `end`."""
    stage: int
    step: Step
    start: float
    end: float


@dataclass
class PipelineTimeline:
    """What simulate_schedule returns. intervals: every step's Interval, stage by stage in the
    order each stage ran them; makespan: when the last step ends; bubble: idle / (p * makespan);
    peak_in_flight[s]: the most forwards stage s has run whose backward it has not yet run
    (counting (micro-batch, chunk) pairs)."""
    p: int
    m: int
    v: int
    intervals: list
    makespan: Any
    bubble: Any
    peak_in_flight: list

    def plot(self, ax: Any = None, title: str | None = None) -> Any:
        return plot_pipeline(self.intervals, self.p, ax=ax, title=title, unit="time units")


def schedule_shape(schedule: Schedule) -> tuple[int, int, int]:
    """(p, m, v) of a schedule: stages, micro-batches, chunks per stage (from the largest mb and chunk)."""
    p = len(schedule)
    steps = [st for row in schedule for st in row]
    if p == 0 or not steps:
        raise ValueError("a schedule needs at least one stage and one step")
    return p, 1 + max(st.mb for st in steps), 1 + max(st.chunk for st in steps)


def simulate_schedule(schedule: Schedule, t_f: Any = 1, t_b: Any = 2, t_comm: Any = 0) -> PipelineTimeline:
    """Run `schedule` (p lists of Steps) with forward cost t_f, backward cost t_b (per step) and
    t_comm per activation or gradient passed between consecutive virtual stages (c * p + s) on
    different ranks. Returns a PipelineTimeline. ValueError for a malformed schedule (a pair
    missing, repeated, or B before F on a stage); DeadlockError when no stage can progress."""
    p, m, v = schedule_shape(schedule)
    pairs = {(i, c) for i in range(m) for c in range(v)}
    for s, row in enumerate(schedule):
        seen = {"F": set(), "B": set()}
        for st in row:
            if st.kind not in seen:
                raise ValueError(f"stage {s}: step {st!r} has kind {st.kind!r}, not 'F' or 'B'")
            key = (st.mb, st.chunk)
            if key not in pairs:
                raise ValueError(f"stage {s}: step {st!r} is outside micro-batches 0..{m - 1}, chunks 0..{v - 1}")
            if key in seen[st.kind]:
                raise ValueError(f"stage {s}: step {st!r} appears twice")
            if st.kind == "B" and key not in seen["F"]:
                raise ValueError(f"stage {s}: {st!r} comes before its forward")
            seen[st.kind].add(key)
        for kind in "FB":
            if seen[kind] != pairs:
                missing = sorted(pairs - seen[kind])[0]
                raise ValueError(f"stage {s}: no {Step(kind, *missing)!r}: every stage must run the F and the B "
                                 f"of every micro-batch 0..{m - 1} (and chunk 0..{v - 1})")
    last = p * v - 1
    comm = t_comm if p > 1 else 0
    end: dict[tuple[str, int, int], Any] = {}  # (kind, virtual stage, mb) -> end time
    free = [0] * p
    pos = [0] * p
    done: list[list[Interval]] = [[] for _ in range(p)]
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        progress = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                st = schedule[s][pos[s]]
                vs = st.chunk * p + s
                if st.kind == "F":
                    deps = [(("F", vs - 1, st.mb), comm)] if vs > 0 else []
                else:
                    deps = [(("F", vs, st.mb), 0)] + ([(("B", vs + 1, st.mb), comm)] if vs < last else [])
                if any(d not in end for d, _ in deps):
                    break
                start = max([free[s]] + [end[d] + c for d, c in deps])
                stop = start + (t_f if st.kind == "F" else t_b)
                end[(st.kind, vs, st.mb)] = free[s] = stop
                done[s].append(Interval(s, st, start, stop))
                pos[s] += 1
                progress = True
        if not progress:
            stuck = [f"stage {s} waits to run {schedule[s][pos[s]]!r}" for s in range(p) if pos[s] < len(schedule[s])]
            raise DeadlockError("the schedule deadlocks: no stage can run its next step\n  " + "\n  ".join(stuck))
    makespan = max(free)
    busy = sum(iv.end - iv.start for row in done for iv in row)
    total = p * makespan
    bubble = (total - busy) / total if total else 0
    peaks = []
    for row in schedule:
        held = peak = 0
        for st in row:
            held += 1 if st.kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return PipelineTimeline(p, m, v, [iv for row in done for iv in row], makespan, bubble, peaks)


def plot_pipeline(intervals: list, p: int, ax: Any = None, title: str | None = None, unit: str = "s") -> Any:
    """Gantt chart of Intervals: one row per stage, F blue and B orange (lighter for odd chunks),
    each bar labelled with its micro-batch (and .chunk)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 * max(p, 2) + 1))
    end = max((iv.end for iv in intervals), default=1)
    colors = {("F", 0): "#4c72b0", ("F", 1): "#8fb0de", ("B", 0): "#dd8452", ("B", 1): "#f0b58f"}
    for iv in intervals:
        start, width = float(iv.start), float(iv.end - iv.start)
        ax.broken_barh([(start, width)], (iv.stage - 0.4, 0.8),
                       facecolors=colors[(iv.step.kind, iv.step.chunk % 2)], edgecolors="white", linewidth=0.5)
        if width > float(end) / 60:
            ax.text(start + width / 2, iv.stage, repr(iv.step)[1:], ha="center", va="center", fontsize=7,
                    color="white" if iv.step.chunk % 2 == 0 else "black")
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, float(end))
    ax.set_xlabel(unit)
    if title:
        ax.set_title(title)
    return ax


def interleaved_schedule(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B with v chunks per stage (virtual stage c * p + s on stage s).
    The k-th forward of stage s is Step("F", (k // (p*v)) * p + k % p, (k % (p*v)) // p); its k-th
    backward has the same mb and chunk v - 1 - (k % (p*v)) // p. Warm-up: min((p-s-1)*2 + (v-1)*p,
    m*v) forwards; then F(w+i), B(i) pairs; then the remaining B.
    ValueError unless p, m, v >= 1 and m % p == 0."""
    _check_pm(p, m, "interleaved_schedule")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"interleaved_schedule: v (chunks per stage) must be a positive int, got {v!r}")
    if m % p:
        raise ValueError(f"interleaved_schedule: m must be a multiple of p, got m={m}, p={p}")
    total = m * v

    def step(kind: str, k: int) -> Step:
        chunk = (k % (p * v)) // p
        return Step(kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

    schedule = []
    for s in range(p):
        w = min((p - s - 1) * 2 + (v - 1) * p, total)
        steps = [step("F", k) for k in range(w)]
        for i in range(total - w):
            steps += [step("F", w + i), step("B", i)]
        steps += [step("B", k) for k in range(total - w, total)]
        schedule.append(steps)
    return schedule


def graph_flops(out: Tensor) -> float:
    """Forward FLOPs of the graph that produced `out` (lesson 12's op_flops, summed over its ops)."""
    return float(sum(op_flops(node) for node in topo_order(out) if node._parents))


def _root(comm: Communicator) -> Communicator:
    while hasattr(comm, "parent"):
        comm = comm.parent
    return comm


def _record(comm: Communicator, kind: str, t0: float, flops: float, label: str) -> None:
    """Put one F/B interval on the timeline: charged by FLOPs on the simulator, measured under MPI."""
    if comm.engine == "sim":
        comm.compute(flops=flops, kind=kind, label=label)
    else:
        root = _root(comm)
        root.events.append(Event(root.rank, kind, t0, comm.time, label=label))


def stage_forward(comm: Communicator, fn: Callable[[Any], Tensor], x: Any, label: str = "") -> Tensor:
    """fn(x), recorded on comm's timeline as one "F" interval labelled `label`."""
    t0 = comm.time
    out = fn(x)
    _record(comm, "F", t0, graph_flops(out) if isinstance(out, Tensor) else 0.0, label)
    return out


def stage_backward(comm: Communicator, out: Tensor, grad: Any = None, label: str = "") -> None:
    """out.backward(grad) (grad None: out is a one-element loss), then forget out's graph;
    recorded as one "B" interval (twice the forward FLOPs)."""
    t0 = comm.time
    flops = 2 * graph_flops(out)
    out.backward(grad)
    free_graph(out)
    _record(comm, "B", t0, flops, label)


class Stack(Module):
    """Layers applied in order: one pipeline chunk."""

    def __init__(self, layers: list):
        self.layers = list(layers)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def split_layers(layers: list, p: int, rank: int, v: int = 1) -> list[Stack]:
    """The chunks of `rank` when `layers` are cut into p * v consecutive groups
    (chunk_bounds(len(layers), p * v)): chunk c is virtual stage c * p + rank."""
    if rank >= p:
        raise ValueError(f"split_layers: rank must be in [0, {p}) (one of the p stages), got {rank}")
    if len(layers) < p * v:
        raise ValueError(f"cannot cut {len(layers)} layers into {p} x {v} = {p * v} pipeline chunks")
    bounds = chunk_bounds(len(layers), p * v)
    return [Stack(layers[slice(*bounds[c * p + rank])]) for c in range(v)]


def check_pipeline_data(steps: list, inputs: list, targets: list) -> None:
    """ValueError (naming pipeline_step) unless there is one target per input and every step's
    micro-batch is one of the inputs."""
    if len(targets) != len(inputs):
        raise ValueError(f"pipeline_step: inputs and targets must hold one entry per micro-batch, got "
                         f"{len(inputs)} inputs and {len(targets)} targets")
    bad = [st for st in steps if not 0 <= st.mb < len(inputs)]
    if bad:
        raise ValueError(f"pipeline_step: steps must use micro-batches 0..{len(inputs) - 1} (one per input), got "
                         f"{bad[0]!r}")


def pipeline_step(comm: Communicator, chunks: list, steps: list, inputs: list, targets: list,
                  loss_fn: Callable[[Tensor, Any], Tensor]) -> float:
    """Run this rank's `steps` (one stage of a schedule) of a pipeline over comm's p ranks.

    chunks[c]: a callable (Module) for virtual stage c * p + rank. inputs[i], targets[i]:
    micro-batch i (read by the first and the last virtual stage); m = len(inputs).
    loss_fn(output, targets[i]) -> one-element Tensor: micro-batch i's share of the batch loss.
    Forwards and backwards run through stage_forward / stage_backward, labelled with the
    micro-batch i alone for chunk 0 and f"{i}.{c}" for chunk c >= 1 (v > 1: "3" and "3.1").
    Gradients accumulate in the parameters' .grad over the micro-batches (never zeroed here).
    Returns the sum of the loss values computed on this rank (0.0 if it holds no last stage).
    ValueError if the steps use a chunk this rank does not have."""
    check_pipeline_data(steps, inputs, targets)  # given: before anything is sent
    p, r, v, m = comm.size, comm.rank, len(chunks), len(inputs)
    last = p * v - 1
    if any(st.chunk >= v for st in steps):
        raise ValueError(f"rank {r}: the steps use chunk {max(st.chunk for st in steps)}, but it holds {v} chunk(s)")
    prev, nxt = (r - 1) % p, (r + 1) % p

    def tag(kind: str, mb: int, k: int) -> int:  # k: the virtual stage that receives
        return 2 * (k * m + mb) + (kind == "B")

    kept: dict[tuple[int, int], tuple[Any, Tensor]] = {}
    total = 0.0
    for st in steps:
        k = st.chunk * p + r
        label = repr(st)[1:]
        chunk = chunks[st.chunk]
        if st.kind == "F":
            x = inputs[st.mb] if k == 0 else Tensor(comm.recv(prev, tag("F", st.mb, k)), requires_grad=True)
            if k == last:
                out = stage_forward(comm, lambda h, c=chunk, y=targets[st.mb]: loss_fn(c(h), y), x, label)
                total += out.item()
            else:
                out = stage_forward(comm, chunk, x, label)
                comm.send(out.data, nxt, tag("F", st.mb, k + 1))
            kept[(st.mb, st.chunk)] = (x, out)
        else:
            x, out = kept.pop((st.mb, st.chunk))
            grad = None if k == last else comm.recv(nxt, tag("B", st.mb, k))
            stage_backward(comm, out, grad, label)
            if k > 0:
                comm.send(x.grad.data, prev, tag("B", st.mb, k - 1))
    return total


class GPTEmbedding(Module):
    """The first pipeline layer of a lesson-09 GPT: idx (B, T) ids -> wte[idx] + wpe[:T] (B, T, C)."""

    def __init__(self, model: Any):
        self.wte, self.wpe = model.wte, model.wpe

    def forward(self, idx: Any) -> Tensor:
        return self.wte(idx) + self.wpe.weight[:np.asarray(idx).shape[1]]


class GPTHead(Module):
    """The last pipeline layer: ln_f, then the output layer tied to the token embedding (B, T, V)."""

    def __init__(self, model: Any):
        self.ln_f, self.wte = model.ln_f, model.wte

    def forward(self, x: Tensor) -> Tensor:
        return self.ln_f(x) @ self.wte.weight.T


def gpt_layers(model: Any) -> list:
    """[embedding, block 0, ..., block L-1, head]: L + 2 layers to deal out with split_layers."""
    return [GPTEmbedding(model), *model.blocks, GPTHead(model)]


def gpt_loss(batch_size: int) -> Callable[[Tensor, Any], Tensor]:
    """loss_fn for pipeline_step: a micro-batch's mean cross-entropy times its share of the batch."""
    def loss_fn(logits: Tensor, targets: Any) -> Tensor:
        b, t, v = logits.shape
        return cross_entropy(logits.reshape(b * t, v), np.asarray(targets).reshape(-1)) * (b / batch_size)
    return loss_fn


def allreduce_tied_embedding(comm: Communicator, model: Any) -> None:
    """Sum the token embedding's gradient between the first and the last pipeline rank (both hold a
    copy: the input embedding and the tied output layer). Other ranks do nothing."""
    first, last = 0, comm.size - 1
    if first == last or comm.rank not in (first, last):
        return
    w = model.wte.weight
    mine = w.grad.data if w.grad is not None else np.zeros_like(w.data)
    other = last if comm.rank == first else first
    comm.send(mine, other, tag=2**19)
    w.grad = Tensor(mine + comm.recv(other, tag=2**19))


def float64_model(model: Module) -> Module:
    """Cast every parameter of `model` to float64 in place (for comparisons to 1e-10); returns it."""
    for prm in model.parameters():
        prm.data = prm.data.astype(np.float64)
    return model


def pipeline_intervals(result: RunResult, since: float = -math.inf, until: float = math.inf) -> list[Interval]:
    """The F and B intervals of a run of pipeline_step that start in [since, until), as Intervals
    (stage = rank), with time counted from the first of them."""
    events = [e for e in result.timeline if e.kind in ("F", "B") and e.stream == "main" and since <= e.start < until]
    t0 = min((e.start for e in events), default=0.0)
    out = []
    for e in events:
        mb, _, chunk = e.label.partition(".")
        out.append(Interval(e.rank, Step(e.kind, int(mb), int(chunk or 0)), e.start - t0, e.end - t0))
    return out


def measured_bubble(intervals: list[Interval], p: int) -> float:
    """1 - (time spent in F and B) / (p * span), span from the first start to the last end."""
    span = max(iv.end for iv in intervals) - min(iv.start for iv in intervals)
    return 1.0 - sum(iv.end - iv.start for iv in intervals) / (p * span)


class Dense(Module):
    """tanh(x @ W + b), or just x @ W + b for the output layer; float64."""

    def __init__(self, n_in: int, n_out: int, rng: np.random.Generator, act: bool = True):
        self.lin = Linear(n_in, n_out, rng=rng, init="glorot")
        for prm in self.lin.parameters():
            prm.data = prm.data.astype(np.float64)
        self.act = act

    def forward(self, x):
        y = self.lin(x)
        return y.tanh() if self.act else y


def mlp_layers(n_layers: int = 12, width: int = 64, classes: int = 5, seed: int = 0) -> list[Dense]:
    """The test MLP: n_layers Dense layers, width -> ... -> classes, float64, seeded."""
    rng = np.random.default_rng(seed)
    return [Dense(width, width if i < n_layers - 1 else classes, rng, act=i < n_layers - 1) for i in range(n_layers)]


def copy_to_tp(comm: Communicator, x: Tensor, allreduce: Callable = ring_allreduce) -> Tensor:
    """Megatron's f: forward the identity (a new node), backward all-reduce (sum) the gradient
    over comm's ranks with allreduce(comm, array)."""
    return x._record(Tensor(x.data), (x,), lambda g: (allreduce(comm, g),), "tp_copy")


def reduce_from_tp(comm: Communicator, x: Tensor, allreduce: Callable = ring_allreduce) -> Tensor:
    """Megatron's g: forward all-reduce (sum) x over comm's ranks, backward the identity."""
    return x._record(Tensor(allreduce(comm, x.data)), (x,), lambda g: (g,), "tp_reduce")


class TensorParallelMLP(Module):
    """Rank comm.rank's share of y = act(x @ A + a) @ B + b, Megatron-style.

    fc (Linear C -> H: A, a) and proj (Linear H -> C: B, b) are the full layers; this rank keeps
    the columns cols = chunk_bounds(H, N)[rank] of A and a (fc_weight (C, H/N), fc_bias (H/N,)),
    the same rows of B (proj_weight (H/N, C)) and all of b (proj_bias (C,)), as new Parameters.
    forward(x (..., C)) -> (..., C): g(act(f(x) @ fc_weight + fc_bias) @ proj_weight) + proj_bias.
    ValueError naming H and N unless N divides H."""

    def __init__(self, comm: Communicator, fc: Any, proj: Any, activation: Callable[[Tensor], Tensor],
                 allreduce: Callable = ring_allreduce):
        self.comm, self.activation, self.allreduce = comm, activation, allreduce
        hidden, n = fc.weight.shape[1], comm.size
        if hidden % n:
            raise ValueError(f"tensor parallelism: the hidden width {hidden} is not divisible by the "
                             f"{n} ranks (pad it, or use a rank count that divides it)")
        lo, hi = chunk_bounds(hidden, n)[comm.rank]
        self.fc_weight = Parameter(fc.weight.data[:, lo:hi])
        self.fc_bias = Parameter(fc.bias.data[lo:hi])
        self.proj_weight = Parameter(proj.weight.data[lo:hi, :])
        self.proj_bias = Parameter(proj.bias.data)

    def forward(self, x: Tensor) -> Tensor:
        h = self.activation(copy_to_tp(self.comm, x, self.allreduce) @ self.fc_weight + self.fc_bias)
        return reduce_from_tp(self.comm, h @ self.proj_weight, self.allreduce) + self.proj_bias


class TensorParallelAttention(Module):
    """Rank comm.rank's heads h0..h1-1 (chunk_bounds(n_head, N)[rank]) of a lesson-09
    CausalSelfAttention `attn` (C = n_embd, hd = C // n_head): q_weight, k_weight, v_weight
    (C, (h1-h0) hd) and their biases: columns [h0 hd, h1 hd); proj_weight ((h1-h0) hd, C): the
    same rows; proj_bias (C,): all of it. New Parameters (copies).
    forward(x (B, T, C)) -> (B, T, C): f(x) projected to local q, k, v, split into the local heads,
    attn.attend, merged, projected, g, plus proj_bias. ValueError unless N divides n_head."""

    def __init__(self, comm: Communicator, attn: Any, allreduce: Callable = ring_allreduce):
        self.comm, self.allreduce, self.attend = comm, allreduce, attn.attend
        n_head, n = attn.n_head, comm.size
        if n_head % n:
            raise ValueError(f"tensor parallelism: {n_head} heads cannot be split evenly over {n} ranks")
        hd = attn.q.weight.shape[0] // n_head
        h0, h1 = chunk_bounds(n_head, n)[comm.rank]
        cols = slice(h0 * hd, h1 * hd)
        self.n_head = h1 - h0
        for name in ("q", "k", "v"):
            lin = getattr(attn, name)
            setattr(self, f"{name}_weight", Parameter(lin.weight.data[:, cols]))
            setattr(self, f"{name}_bias", Parameter(lin.bias.data[cols]))
        self.proj_weight = Parameter(attn.proj.weight.data[cols, :])
        self.proj_bias = Parameter(attn.proj.bias.data)

    def forward(self, x: Tensor) -> Tensor:
        xf = copy_to_tp(self.comm, x, self.allreduce)
        q, k, v = (split_heads(xf @ w + b, self.n_head) for w, b in
                   ((self.q_weight, self.q_bias), (self.k_weight, self.k_bias), (self.v_weight, self.v_bias)))
        y = merge_heads(self.attend(q, k, v)) @ self.proj_weight
        return reduce_from_tp(self.comm, y, self.allreduce) + self.proj_bias


class TensorParallelBlock(Module):
    """A lesson-09 pre-norm Block on rank comm.rank of comm.size: its own ln1 and ln2 (replicated),
    TensorParallelAttention(comm, block.attn) and TensorParallelMLP(comm, block.mlp.fc,
    block.mlp.proj, gelu). forward(x (B, T, C)): x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, comm: Communicator, block: Any, allreduce: Callable = ring_allreduce):
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attn = TensorParallelAttention(comm, block.attn, allreduce)
        self.mlp = TensorParallelMLP(comm, block.mlp.fc, block.mlp.proj, gelu, allreduce)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def tensor_parallel_gpt(comm: Communicator, model: Any, allreduce: Callable = ring_allreduce) -> Any:
    """Replace model.blocks by TensorParallelBlocks for comm's ranks (in place); returns model."""
    model.blocks = [TensorParallelBlock(comm, block, allreduce) for block in model.blocks]
    return model


def check_ring_blocks(what: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray | None = None,
                      lse: np.ndarray | None = None, do: np.ndarray | None = None) -> None:
    """ValueError/TypeError naming `what` and the shapes unless this rank's blocks agree: q, k (..., n, d)
    and v (..., n, dv) of one float dtype, as many positions n in q as in k (a rank holds the same
    positions of each); and for the backward o and do (..., n, dv), lse (..., n)."""
    check_qkv(q, k, v, what)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"{what}: q {q.shape} and k {k.shape} must hold the same positions of this rank (axis -2)")
    want = {"o": q.shape[:-1] + v.shape[-1:], "lse": q.shape[:-1], "do": q.shape[:-1] + v.shape[-1:]}
    for name, a in (("o", o), ("lse", lse), ("do", do)):
        if a is not None and tuple(a.shape) != want[name]:
            raise ValueError(f"{what}: {name} must have shape {want[name]} for q {q.shape} and v {v.shape}, "
                             f"got {tuple(a.shape)}")


def ring_attention(comm: Communicator, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Attention of this rank's queries over the keys and values of all ranks, by the ring.

    q, k (..., n, d), v (..., n, dv): positions [rank n, (rank+1) n) of the sequence, the same n on
    every rank. causal: query i sees keys j <= i (global positions). Returns (o (..., n, dv),
    lse (..., n)) as attention_np(..., return_lse=True) over the whole sequence would give for
    these rows. Sends N-1 messages, each K and V concatenated on the last axis, to (rank+1) % N."""
    check_ring_blocks("ring_attention", q, k, v)  # given: before anything is sent
    n_ranks, r = comm.size, comm.rank
    right, left = (r + 1) % n_ranks, (r - 1) % n_ranks
    d = k.shape[-1]
    kv = np.concatenate([k, v], axis=-1)
    o = lse = None
    for s in range(n_ranks):
        j = (r - s) % n_ranks
        if s > 0:
            kv = comm.recv(left)
        if s < n_ranks - 1:
            comm.send(kv, right)
        if causal and j > r:
            continue
        mask = causal_mask(q.shape[-2], kv.shape[-2]) if causal and j == r else None
        ob, lb = attention_np(q, kv[..., :d], kv[..., d:], mask, return_lse=True)
        o, lse = (ob, lb) if o is None else merge_attention(o, lse, ob, lb)
    return o, lse


def ring_attention_backward(comm: Communicator, q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray,
                            lse: np.ndarray, do: np.ndarray, causal: bool = False
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients (dq, dk, dv) of this rank's blocks, given the forward's o, lse and the gradient
    do of o (shapes as ring_attention). K, V, dK, dV travel the ring together (N-1 messages,
    concatenated on the last axis), then dK, dV make one more hop home (N messages in all when
    N > 1; on one rank nothing travels: 0 messages)."""
    check_ring_blocks("ring_attention_backward", q, k, v, o, lse, do)  # given: before anything is sent
    n_ranks, r = comm.size, comm.rank
    right, left = (r + 1) % n_ranks, (r - 1) % n_ranks
    d, dv_ = k.shape[-1], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    D = (do * o).sum(axis=-1)
    finite = np.isfinite(lse)
    safe_lse = np.where(finite, lse, 0.0)
    dq = np.zeros_like(q)
    blk = np.concatenate([k, v, np.zeros_like(k), np.zeros_like(v)], axis=-1)
    for s in range(n_ranks):
        j = (r - s) % n_ranks
        if s > 0:
            blk = comm.recv(left)
        kb, vb = blk[..., :d], blk[..., d:d + dv_]
        if not (causal and j > r):
            scores = (q @ np.swapaxes(kb, -1, -2)) * scale
            p = np.exp(scores - safe_lse[..., None]) * finite[..., None]
            if causal and j == r:
                p = p * causal_mask(q.shape[-2], kb.shape[-2])
            blk = blk.copy()
            blk[..., d + dv_ + d:] += np.swapaxes(p, -1, -2) @ do
            ds = p * (do @ np.swapaxes(vb, -1, -2) - D[..., None])
            dq += ds @ kb * scale
            blk[..., d + dv_:d + dv_ + d] += np.swapaxes(ds, -1, -2) @ q * scale
        if s < n_ranks - 1:
            comm.send(blk, right)
    if n_ranks > 1:
        comm.send(blk[..., d + dv_:], right)
        blk = comm.recv(left)
        return dq, blk[..., :d], blk[..., d:]
    return dq, blk[..., d + dv_:d + dv_ + d], blk[..., d + dv_ + d:]


def ring_attention_op(comm: Communicator, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """ring_attention as an autograd op: forward (o), backward by ring_attention_backward."""
    o, lse = ring_attention(comm, q.data, k.data, v.data, causal)

    def vjp(g: Any) -> tuple:
        return ring_attention_backward(comm, q.data, k.data, v.data, o, lse, g, causal)

    return q._record(Tensor(o), (q, k, v), vjp, "ring_attention")


class RingSelfAttention(Module):
    """A lesson-09 CausalSelfAttention run sequence-parallel: forward(x (B, n, C)) on this rank's
    n positions; the projections are the module's own (shared, not copied)."""

    def __init__(self, comm: Communicator, attn: Any):
        self.comm, self.attn = comm, attn

    def forward(self, x: Tensor) -> Tensor:
        a = self.attn
        q, k, v = (split_heads(lin(x), a.n_head) for lin in (a.q, a.k, a.v))
        return a.proj(merge_heads(ring_attention_op(self.comm, q, k, v, causal=True)))


@dataclass(frozen=True)
class ModelSpec:
    """A GPT for planning: n_layer layers of width d_model with n_head heads, sequences of seq_len
    tokens, a global batch of `batch` sequences; 16-bit activations, 16 bytes of state per parameter."""
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    batch: int

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "seq_len", "batch"):
            _check_int("ModelSpec", name, getattr(self, name), 1)

    @property
    def params_per_layer(self) -> int:
        return 12 * self.d_model ** 2 + 13 * self.d_model

    def layer_flops(self, b: int) -> float:
        """Forward FLOPs of one layer on b sequences: 24 b s d^2 + 4 b s^2 d."""
        s, d = self.seq_len, self.d_model
        return 24.0 * b * s * d * d + 4.0 * b * s * s * d


@dataclass(frozen=True)
class ClusterSpec:
    """n_ranks accelerators of `memory` bytes and `flop_rate` FLOP/s each. alpha, beta: the network
    between nodes; node_size ranks per node, linked by (alpha_node, beta_node) (default: the network's)."""
    n_ranks: int
    memory: float
    flop_rate: float
    alpha: float
    beta: float
    node_size: int = 1
    alpha_node: float | None = None
    beta_node: float | None = None

    def __post_init__(self) -> None:
        _check_int("ClusterSpec", "n_ranks", self.n_ranks, 1)
        _check_int("ClusterSpec", "node_size", self.node_size, 1)
        for name in ("memory", "flop_rate"):  # (inf: no memory limit, instant compute)
            if _check_number("ClusterSpec", name, getattr(self, name), 0, finite=False) == 0:
                raise ValueError(f"ClusterSpec: {name} must be > 0, got {getattr(self, name)}")
        for name in ("alpha", "beta", "alpha_node", "beta_node"):
            if getattr(self, name) is not None or name in ("alpha", "beta"):
                _check_number("ClusterSpec", name, getattr(self, name), 0)


@dataclass(frozen=True)
class Plan:
    """dp * tp * pp ranks; m micro-batches per step (per data-parallel replica)."""
    dp: int
    tp: int
    pp: int
    m: int

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "m"):
            _check_int("Plan", name, getattr(self, name), 1)


class Estimate(NamedTuple):
    memory: float  # bytes per rank (the most loaded: pipeline stage 0)
    time: float    # seconds per training step


def link_for(cluster: ClusterSpec, span: int) -> tuple[float, float]:
    """(alpha, beta) of a group spanning `span` consecutive ranks (aligned): the node's link when
    those ranks all sit in one node (span divides node_size), else the network's."""
    if span <= cluster.node_size and cluster.node_size % span == 0:
        return (cluster.alpha if cluster.alpha_node is None else cluster.alpha_node,
                cluster.beta if cluster.beta_node is None else cluster.beta_node)
    return cluster.alpha, cluster.beta


def ring_allreduce_time(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Lesson 12's ring all-reduce: 2 (n-1) (alpha + nbytes/n beta); 0 on one rank."""
    return 2 * (n - 1) * (alpha + nbytes / n * beta) if n > 1 else 0.0


def _plan_job(comm: Communicator, model: ModelSpec, plan: Plan, steps_by_stage: list) -> None:
    """One rank of simulate_plan's skeleton: FLOPs charged, messages of the right sizes, no arithmetic."""
    dp, tp, pp, m = plan.dp, plan.tp, plan.pp, plan.m
    r = comm.rank
    d_i, rest = divmod(r, pp * tp)
    s_i, t_i = divmod(rest, tp)
    tp_group = comm.group([(d_i * pp + s_i) * tp + t for t in range(tp)]) if tp > 1 else None
    dp_group = comm.group([(x * pp + s_i) * tp + t_i for x in range(dp)]) if dp > 1 else None
    b, ls = model.batch // (dp * m), model.n_layer // pp
    activation = np.zeros(2 * b * model.seq_len * model.d_model, np.uint8)
    flops = model.layer_flops(b) / tp
    for st in steps_by_stage[s_i]:
        forward = st.kind == "F"
        if forward and s_i > 0:
            comm.recv(r - tp, tag=2 * st.mb)
        if not forward and s_i < pp - 1:
            comm.recv(r + tp, tag=2 * st.mb + 1)
        for _ in range(ls):
            comm.compute(flops=flops if forward else 2 * flops, kind=st.kind, label=repr(st)[1:])
            if tp_group is not None:
                ring_allreduce(tp_group, activation)
                ring_allreduce(tp_group, activation)
        if forward and s_i < pp - 1:
            comm.send(activation, r + tp, tag=2 * st.mb)
        if not forward and s_i > 0:
            comm.send(activation, r - tp, tag=2 * st.mb + 1)
    if dp_group is not None:
        ring_allreduce(dp_group, np.zeros(round(2 * ls * model.params_per_layer / tp), np.uint8))


def simulate_plan(model: ModelSpec, cluster: ClusterSpec, plan: Plan,
                  schedule_fn: Callable[[int, int], Schedule]) -> RunResult:
    """Run `plan` as a skeleton on the communicator's simulator (alpha, beta, flop_rate of the
    cluster): every rank follows schedule_fn(pp, m)'s steps for its stage, charges each layer's
    FLOPs / tp to its clock, runs two ring all-reduces of the activations per layer in its tp group,
    passes activations and gradients to the neighbouring stages, then ring all-reduces its 16-bit
    gradients in its dp group. Nothing is computed. `.time` is the simulated step time. A cluster
    whose node link differs from its network runs on the simulator's two-level topology (lesson 12):
    n_ranks / node_size nodes of node_size ranks, in rank order, (alpha_node, beta_node) inside a
    node and (alpha, beta) between nodes; node_size must then divide n_ranks."""
    a_node, b_node = link_for(cluster, 1)
    two_level = cluster.node_size > 1 and (a_node, b_node) != (cluster.alpha, cluster.beta)
    if two_level and cluster.n_ranks % cluster.node_size:
        raise ValueError(f"simulate_plan: node_size={cluster.node_size} must divide the {cluster.n_ranks} ranks (whole "
                         "nodes) to simulate a cluster whose node link differs from its network")
    estimate_checks = (plan.dp * plan.tp * plan.pp == cluster.n_ranks, model.n_head % plan.tp == 0,
                       model.n_layer % plan.pp == 0, model.batch % (plan.dp * plan.m) == 0)
    if not all(estimate_checks):
        raise ValueError(f"{plan} is not a valid plan for {model} on {cluster.n_ranks} ranks")
    steps = schedule_fn(plan.pp, plan.m)
    if two_level:
        return run(_plan_job, cluster.n_ranks, model, plan, steps, alpha=a_node, beta=b_node, flop_rate=cluster.flop_rate,
                   nodes=cluster.n_ranks // cluster.node_size, alpha_inter=cluster.alpha, beta_inter=cluster.beta)
    return run(_plan_job, cluster.n_ranks, model, plan, steps, alpha=cluster.alpha, beta=cluster.beta,
               flop_rate=cluster.flop_rate)


def estimate_plan(model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> Estimate:
    """Memory per rank (bytes) and step time (seconds) of `plan`, by the formulas of section 8:
    b = batch / (dp m), Ls = n_layer / pp, a = 2 b s d, F = model.layer_flops(b), R = flop_rate,
    links from link_for (tp group: span tp; pipeline: tp * pp; dp group: n_ranks),
    t_F = Ls (F / (tp R) + 2 AR(tp, a)), t_B = Ls (2 F / (tp R) + 2 AR(tp, a)),
    c = alpha_pp + a beta_pp (0 if pp == 1), P = Ls * params_per_layer / tp,
    time = (m + pp - 1)(t_F + t_B + 2 c) + AR(dp, 2 P),
    memory = 16 P + Ls min(pp, m) s b d (10 + 24/tp + 5 h s / (d tp)).
    ValueError naming the problem if a degree or m is < 1 (the message says ">= 1"),
    dp*tp*pp != n_ranks, n_head % tp, n_layer % pp or batch % (dp*m)."""
    dp, tp, pp, m = plan.dp, plan.tp, plan.pp, plan.m
    if min(dp, tp, pp, m) < 1:
        raise ValueError(f"{plan}: every degree and m must be >= 1")
    if dp * tp * pp != cluster.n_ranks:
        raise ValueError(f"{plan}: dp * tp * pp = {dp * tp * pp}, but the cluster has {cluster.n_ranks} ranks")
    if model.n_head % tp:
        raise ValueError(f"{plan}: tp={tp} does not divide the {model.n_head} heads")
    if model.n_layer % pp:
        raise ValueError(f"{plan}: pp={pp} does not divide the {model.n_layer} layers")
    if model.batch % (dp * m):
        raise ValueError(f"{plan}: dp * m = {dp * m} does not divide the batch of {model.batch} sequences")
    s, d, h = model.seq_len, model.d_model, model.n_head
    b, ls = model.batch // (dp * m), model.n_layer // pp
    a = 2.0 * b * s * d
    flops = model.layer_flops(b)
    rate = cluster.flop_rate
    tp_ar = ring_allreduce_time(tp, a, *link_for(cluster, tp))
    t_f = ls * (flops / (tp * rate) + 2 * tp_ar)
    t_b = ls * (2 * flops / (tp * rate) + 2 * tp_ar)
    alpha_pp, beta_pp = link_for(cluster, tp * pp)
    c = alpha_pp + a * beta_pp if pp > 1 else 0.0
    params = ls * model.params_per_layer / tp
    time = (m + pp - 1) * (t_f + t_b + 2 * c) + ring_allreduce_time(dp, 2 * params, *link_for(cluster, cluster.n_ranks))
    memory = 16 * params + ls * min(pp, m) * s * b * d * (10 + 24 / tp + 5 * h * s / (d * tp))
    return Estimate(memory, time)


def best_plan(model: ModelSpec, cluster: ClusterSpec) -> tuple[Plan, Estimate]:
    """The fastest valid plan whose memory is <= cluster.memory, over every (dp, tp, pp) with
    dp * tp * pp = n_ranks and every m, each estimated with estimate_plan. Ties: smaller memory,
    then smaller tp, then smaller pp, then smaller m. ValueError if no plan fits."""
    n = cluster.n_ranks
    best, smallest = None, None
    for tp, pp in product(range(1, n + 1), repeat=2):
        if n % (tp * pp) or model.n_head % tp or model.n_layer % pp:
            continue
        dp = n // (tp * pp)
        if model.batch % dp:
            continue
        for m in range(1, model.batch // dp + 1):
            if (model.batch // dp) % m:
                continue
            plan = Plan(dp, tp, pp, m)
            est = estimate_plan(model, cluster, plan)
            if smallest is None or est.memory < smallest[1].memory:
                smallest = (plan, est)
            if est.memory > cluster.memory:
                continue
            key = (est.time, est.memory, tp, pp, m)
            if best is None or key < best[0]:
                best = (key, plan, est)
    if best is None:
        raise ValueError(f"no plan fits in {cluster.memory / 1e9:.3g} GB per rank"
                         + (f": the smallest, {smallest[0]}, needs {smallest[1].memory / 1e9:.3g} GB" if smallest else
                            " (no valid plan at all: check the batch, heads and layers against the rank count)"))
    return best[1], best[2]


def timed_pipeline(comm: Communicator, width: int, batch: int, m: int, reps: int) -> tuple[float, float]:
    """(best step time, start of that step) of a 1F1B pipeline of the 12-layer MLP (`mlp_layers`,
    the given width, float64) split over comm's ranks, on a batch of `batch` rows in m micro-batches;
    the best of `reps` steps after a warm-up. Times are comm.time (wall clock under MPI). Every
    layer is width x width (the loss reads the first 5 outputs as the classes' scores), so that
    equal numbers of layers are equal work: with a width x 5 last layer the second of 2 stages
    would hold five layers plus a width x 5 one (5/width of a layer) against the first's six, and
    the slower stage sets the pace."""
    layers = mlp_layers(12, width, width, seed=0)
    chunks = split_layers(layers, comm.size, comm.rank)
    data = np.random.default_rng(1)
    X, y = data.standard_normal((batch, width)), data.integers(0, 5, batch)
    bounds = chunk_bounds(batch, m)
    inputs, targets = [Tensor(X[a:b]) for a, b in bounds], [y[a:b] for a, b in bounds]
    steps = one_f_one_b_schedule(comm.size, m)[comm.rank]
    best = (math.inf, 0.0)
    for rep in range(reps + 1):  # the first one warms up
        for c in chunks:
            c.zero_grad()
        comm.barrier()
        t0 = comm.time
        pipeline_step(comm, chunks, steps, inputs, targets,
                      lambda out, t: cross_entropy(out[:, :5], t) * (len(t) / batch))
        comm.barrier()
        if rep:
            best = min(best, (comm.time - t0, t0))
    return best


def pipeline_timings(comm: Communicator, width: int, batch: int, m: int,
                     reps: int) -> tuple[tuple[float, float] | None, tuple[float, float]]:
    """On 2 ranks, one launch: rank 0 alone (a group of one) times the whole batch and the m
    micro-batches (None on rank 1), then both ranks time the 2-stage pipeline (timed_pipeline)."""
    alone = None
    if comm.rank == 0:
        solo = comm.group([0])
        alone = (timed_pipeline(solo, width, batch, 1, reps)[0], timed_pipeline(solo, width, batch, m, reps)[0])
    comm.barrier()
    return alone, timed_pipeline(comm, width, batch, m, reps)


import numbers  # noqa: E402

from minitorch.checks import (AnyOf, Array, Attrs, Count, Func, Instance, Int, NonNegative, Number,  # noqa: E402
                              Optional, Rule, Seq, Size, Str, Unchecked, describe, validate_public)
from minitorch.comm import _comm_rules  # noqa: E402


class _Duration(Rule):
    """A time: a finite real number >= 0 of any numeric type (an int, a float, a Fraction for exact
    arithmetic), not a bool."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{what}: {name} must be a real number >= 0 (an int, float or Fraction), got "
                            f"{describe(value)}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{what}: {name} must be a finite number >= 0, got {describe(value)}")


_TENSOR = Instance(Tensor, must="a minitorch Tensor")
_AX = Optional(Attrs("broken_barh", "set_yticks"))
_LAYERS = Seq(Func())
_BLOCK = Array(dtypes="float")
_TIME = _Duration()
# p, m and v of the schedules: the exercises' own checks (lesson 13's tests want a ValueError for 2.0 and True)
_OWN = Unchecked()
validate_public(globals(), _comm_rules(globals(), {
    "gpipe_schedule": {"p": _OWN, "m": _OWN},
    "one_f_one_b_schedule": {"p": _OWN, "m": _OWN},
    "interleaved_schedule": {"p": _OWN, "m": _OWN, "v": _OWN},
    "PipelineTimeline.plot": {"ax": _AX, "title": Optional(Str())},
    "schedule_shape": {"schedule": Seq(Seq(Instance(Step)))},
    "simulate_schedule": {"schedule": Seq(Seq(Instance(Step))), "t_f": _TIME, "t_b": _TIME, "t_comm": _TIME},
    "plot_pipeline": {"intervals": Seq(Instance(Interval)), "p": Size, "ax": _AX},
    "graph_flops": {"out": _TENSOR},
    "stage_forward": {"x": _OWN},  # whatever fn takes (ids, a Tensor)
    "stage_backward": {"out": _TENSOR, "grad": Optional(AnyOf(Array(dtypes="float"), _TENSOR))},
    "Stack": {"layers": _LAYERS},
    "Stack.forward": {"x": _OWN},  # whatever its first layer takes
    "split_layers": {"layers": _LAYERS, "p": Size, "rank": Count, "v": Size},
    "check_pipeline_data": {"steps": Seq(Instance(Step)), "inputs": Seq(), "targets": Seq()},
    "pipeline_step": {"chunks": Seq(Func(), min_len=1), "steps": Seq(Instance(Step)), "inputs": Seq(min_len=1),
                      "targets": Seq(min_len=1)},
    "GPTEmbedding": {"model": Attrs("wte", "wpe")},
    "GPTEmbedding.forward": {"idx": Array(ndim=2, dtypes="int", axes="(B, T)")},
    "GPTHead": {"model": Attrs("ln_f", "wte")},
    "GPTHead.forward": {"x": _TENSOR},
    "gpt_layers": {"model": Attrs("wte", "wpe", "blocks", "ln_f")},
    "gpt_loss": {"batch_size": Size},
    "allreduce_tied_embedding": {"model": Attrs("wte")},
    "pipeline_intervals": {"since": Number(finite=False), "until": Number(finite=False)},
    "measured_bubble": {"intervals": Seq(Instance(Interval), min_len=1), "p": Size},
    "Dense": {"n_in": Size, "n_out": Size},
    "Dense.forward": {"x": _TENSOR},
    "mlp_layers": {"n_layers": Size, "width": Size, "classes": Size, "seed": Count},
    "copy_to_tp": {"x": _TENSOR},
    "reduce_from_tp": {"x": _TENSOR},
    "TensorParallelMLP": {"fc": Attrs("weight", "bias"), "proj": Attrs("weight", "bias")},
    "TensorParallelMLP.forward": {"x": _TENSOR},
    "TensorParallelAttention": {"attn": Attrs("attend", "n_head", "q", "k", "v", "proj")},
    "TensorParallelAttention.forward": {"x": _TENSOR},
    "TensorParallelBlock": {"block": Attrs("ln1", "ln2", "attn", "mlp")},
    "TensorParallelBlock.forward": {"x": _TENSOR},
    "tensor_parallel_gpt": {"model": Attrs("blocks")},
    "check_ring_blocks": {"q": _BLOCK, "k": _BLOCK, "v": _BLOCK, "o": Optional(_BLOCK), "lse": Optional(_BLOCK),
                          "do": Optional(_BLOCK)},
    "ring_attention": {"q": _BLOCK, "k": _BLOCK, "v": _BLOCK},
    "ring_attention_backward": {"q": _BLOCK, "k": _BLOCK, "v": _BLOCK, "o": _BLOCK, "lse": _BLOCK, "do": _BLOCK},
    "ring_attention_op": {"q": _TENSOR, "k": _TENSOR, "v": _TENSOR},
    "RingSelfAttention": {"attn": Attrs("q", "k", "v", "proj", "n_head")},
    "RingSelfAttention.forward": {"x": _TENSOR},
    "ModelSpec.layer_flops": {"b": Count},
    "link_for": {"span": Size},
    "ring_allreduce_time": {"n": Size, "nbytes": NonNegative, "alpha": NonNegative, "beta": NonNegative},
    "timed_pipeline": {"width": Int(5), "batch": Size, "m": Size, "reps": Size},
    "pipeline_timings": {"width": Int(5), "batch": Size, "m": Size, "reps": Size},
}))
