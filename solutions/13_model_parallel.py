# %% [markdown]
# # Lesson 13: pipeline, tensor and sequence parallelism
#
# Data parallelism (lesson 12) gives every rank the whole model. When the model's weights,
# gradients, optimizer state and activations do not fit on one chip, or one chip is too slow for
# even one sequence, the model itself has to be split. There are three ways to cut it, and large
# runs use all three at once:
#
# 1. **By layers: pipeline parallelism.** Rank s holds a consecutive group of layers (a
#    *stage*); activations flow forward from stage to stage and gradients flow back. A batch is
#    cut into *micro-batches* so that the stages work at the same time, and the *schedule* (which
#    stage runs which micro-batch's forward or backward when) decides how much time is lost to
#    idle stages (the *bubble*) and how many activations each stage must keep. You build GPipe
#    (Huang et al. 2019), 1F1B (PipeDream-Flush: Narayanan et al. 2021a) and Megatron's
#    interleaved 1F1B (Narayanan et al. 2021b) as plain data, simulate them, and then execute
#    them for real on lesson 12's communicator.
# 2. **Within layers: tensor parallelism.** Every weight matrix is cut into column or row blocks,
#    one per rank; Megatron-LM (Shoeybi et al. 2019) arranges the cuts so that a transformer's MLP
#    and attention each need exactly one all-reduce in the forward pass and one in the backward.
# 3. **Along the sequence: ring attention** (Liu et al. 2023). Each rank holds a block of the
#    positions; keys and values travel around a ring, and lesson 09's online-softmax merge
#    combines the partial results, so that no rank ever sees the whole sequence.
#
# Then a **planner**: given a model and a cluster, estimate the memory per rank and the step time
# of every combination of data, tensor and pipeline parallelism, pick the best, and check the
# estimates against the simulator. Last (section 10), the placement rule measured on a cluster
# emulated on this machine (Linux, root; elsewhere the simulator's two levels stand in): the same
# tensor-parallel and pipeline steps with their ranks inside one node and across two.
#
# Everything runs on lesson 12's communicator (`minitorch.comm`): the simulated engine, where the
# tests count messages and bytes and read the timeline, and real MPI processes. The course's
# reference version of this lesson is `minitorch/model_parallel.py`. The model that gets split
# is lesson 09's tiny GPT.
#
# Hardware background: how the GPUs of one node and of many nodes are connected, and why tensor
# parallelism stays inside a node ([how a DGX H100 is wired](../hardware_notes/interconnects.md#how-a-dgx-h100-is-wired),
# [rail-optimised clusters](../hardware_notes/interconnects.md#rail-optimised-clusters)); the
# alpha and beta of real links, which the planner uses
# ([alpha and beta for lessons 12-13](../hardware_notes/interconnects.md#alpha-and-beta-for-lessons-12-13));
# TPU pods, whose torus links suit the same ring algorithms ([Google TPUs](../hardware_notes/accelerators.md#google-tpus));
# the parameter, FLOP and activation counts of a transformer
# ([transformer arithmetic](../hardware_notes/transformer_arithmetic.md)); and HBM capacity,
# the memory every plan must fit into ([memory](../hardware_notes/memory.md)).
#
# Conventions: as in lesson 12, everything that is compared with an unpartitioned model runs in
# float64, where "equal" means equal to 1e-10.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %%
#| default_exp model_parallel
#| export
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

# %% [markdown]
# ## 1. Pipeline schedules as data
#
# Cut a model of L layers into p stages of consecutive layers, stage s on rank s. One batch
# through the pipeline, done naively, keeps one rank busy at a time: stage 1 waits for stage 0's
# forward, stage 0 waits for stage 1's backward. GPipe's remedy is to cut the batch into m
# **micro-batches** and stream them through, accumulating the gradients of all m before the
# optimizer step, so that the result is exactly that of the whole batch.
#
# A **schedule** says, for every stage, in which order it runs its 2m steps: the forward `F` and
# the backward `B` of every micro-batch. We write it as data, a list per stage of `Step`s:
#
# ```
# Step(kind="F", mb=3)        # forward of micro-batch 3 on this stage
# schedule[s] == [Step("F", 0), Step("F", 1), ..., Step("B", 0), ...]
# ```
#
# A step can run once the step it depends on has finished: `F` of micro-batch i on stage s needs
# `F` of i on stage s-1 (its input activation), `B` of i on stage s needs `B` of i on stage s+1
# (the gradient of its output) and, on the last stage, its own `F`. Two schedules:
#
# - **GPipe** (Huang et al. 2019): every stage runs all m forwards, then all m backwards (in the
#   same micro-batch order; the order of backwards does not change the bubble in unit time).
#   Simple, but each stage holds the activations of all m micro-batches at the turn.
# - **1F1B** (PipeDream-Flush: Narayanan et al. 2021a, the schedule of Megatron-LM; Narayanan et
#   al. 2021b): stage s first runs `w = min(p - s - 1, m)` *warm-up* forwards, then alternates one
#   forward and one backward (`F w, B 0, F w+1, B 1, ...`) until the forwards run out, then runs
#   the remaining backwards. A backward runs as soon as possible, which frees that micro-batch's
#   activations: stage s never holds more than `p - s` of them, however large m is.
#
# For p = 3 stages and m = 4 micro-batches, in unit time (a forward costs 1, a backward 2):
#
# ```
# GPipe  stage 0: F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3
#        stage 1: .  F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .
#        stage 2: .  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .
# 1F1B   stage 0: F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 .  B2 B2 .  B3 B3
#        stage 1: .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3 .  .
#        stage 2: .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .  .  .
# ```
#
# Both take 18 time units, of which each stage is busy 12: a third of the machine idles. GPipe's
# stages each hold 4 micro-batches' activations at the turn; 1F1B's hold 3, 2 and 1.
#
# **Exercise 13.1.** Write `gpipe_schedule(p, m)` and `one_f_one_b_schedule(p, m)`. Both must
# work for m < p, m = p and m > p, and reject p < 1 or m < 1 with a ValueError.

# %%
#| export
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

# %%
#| export
#| exercise 13.1
def gpipe_schedule(p: int, m: int) -> Schedule:
    """GPipe: on every one of the p stages, F of micro-batches 0..m-1, then B of 0..m-1.
    Returns a list of p lists of Steps. ValueError unless p >= 1 and m >= 1."""
    ### BEGIN SOLUTION
    _check_pm(p, m, "gpipe_schedule")
    return [[Step("F", i) for i in range(m)] + [Step("B", i) for i in range(m)] for _ in range(p)]
    ### END SOLUTION


def one_f_one_b_schedule(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): stage s runs w = min(p - s - 1, m) forwards (warm-up), then
    alternates F(w + i), B(i) for i = 0..m-w-1 (steady state), then the remaining backwards
    B(m-w)..B(m-1) (cool-down). ValueError unless p >= 1 and m >= 1."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("13.1")

# %% [markdown]
# ## 2. Simulating a schedule: bubble and memory
#
# A schedule fixes only the *order* of each stage's steps; the times follow from the costs. With
# a forward costing `t_f`, a backward `t_b`, and passing an activation or a gradient to the
# neighbouring stage `t_comm`, every step starts as soon as both its stage is free and its
# dependency has finished (plus `t_comm` when the dependency ran on another stage):
#
# ```
# start(F, s, i) = max(free(s), end(F, s-1, i) + t_comm)
# start(B, s, i) = max(free(s), end(B, s+1, i) + t_comm, end(F, s, i))
# ```
#
# The **makespan** is when the last step ends; each stage is busy `m (t_f + t_b)` of it. The
# **bubble fraction** is the idle share of all stage-time, `idle / (p * makespan)` with
# `idle = p * makespan - busy`. For GPipe in unit time (`t_comm = 0`) the first backward cannot
# start before every stage has done its forwards, and the picture above is two parallelograms:
# makespan `(m + p - 1)(t_f + t_b)`, bubble exactly `(p - 1) / (m + p - 1)`. 1F1B has the same
# makespan; what it saves is memory. The **micro-batches in flight** on a stage after a step are
# the forwards it has run whose backward it has not: the activations it must keep.
#
# A schedule can also be *impossible*: if stage 0 runs `F0 B0 F1 B1` while stage 1 runs
# `F0 F1 B0 B1`, stage 0 waits for stage 1's `B0`, which waits for `F1`, which stage 0 will only
# run after `B0`: a cycle, i.e. a deadlock in a real run. The simulator must say so.
#
# **Exercise 13.2.** Write `simulate_schedule`. Check the schedule first: every stage must run the
# F and the B of every (micro-batch, chunk) pair exactly once, with the same pairs on every stage,
# the F before the B (ValueError naming the stage and the step otherwise). Then compute the start
# and end of every step by the rules above (virtual stages, for section 3: chunk c of stage s is
# virtual stage `c * p + s`; the rules apply to virtual stages, and `t_comm` is paid between
# different ranks only, i.e. between every pair of consecutive virtual stages when p > 1). If no
# stage can make progress, raise `DeadlockError` (from `minitorch.comm`) naming the step each
# stuck stage waits on. The times may be ints or Fractions: keep them exact (no `float()`).

# %%
#| export
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

# %%
#| export
#| exercise 13.2
def simulate_schedule(schedule: Schedule, t_f: Any = 1, t_b: Any = 2, t_comm: Any = 0) -> PipelineTimeline:
    """Run `schedule` (p lists of Steps) with forward cost t_f, backward cost t_b (per step) and
    t_comm per activation or gradient passed between consecutive virtual stages (c * p + s) on
    different ranks. Returns a PipelineTimeline. ValueError for a malformed schedule (a pair
    missing, repeated, or B before F on a stage); DeadlockError when no stage can progress."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("13.2")

# %% [markdown]
# The Gantt chart (given): one row per stage, forwards blue, backwards orange, each labelled
# with its micro-batch (and chunk, in section 3).

# %%
#| export
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

# %% tags=["demo"]
p, m = 4, 8
fig, axes = plt.subplots(2, 1, figsize=(11, 5), sharex=True)
for ax, (name, fn) in zip(axes, [("GPipe", gpipe_schedule), ("1F1B", one_f_one_b_schedule)]):
    tl = simulate_schedule(fn(p, m))
    tl.plot(ax=ax, title=f"{name}, p={p}, m={m}: makespan {tl.makespan}, bubble {float(tl.bubble):.3f}, "
            f"in flight per stage {tl.peak_in_flight}")
fig.tight_layout()
plt.show()

# %% [markdown]
# Live: drag the stages and the micro-batches (the simulator redraws the timeline; the bubble is
# the white space, `(p - 1) / (m + p - 1)` for both schedules).

# %% tags=["demo"]
from course.live import live


def draw_pipeline(stages: int, micro_batches: int, schedule: str):
    fn = gpipe_schedule if schedule == "GPipe" else one_f_one_b_schedule
    tl = simulate_schedule(fn(stages, micro_batches))
    fig, ax = plt.subplots(figsize=(10, 3))
    for (kind, color) in (("F", "#4c72b0"), ("B", "#dd8452")):  # one bar set per stage and kind: quick to draw
        for s in range(stages):
            bars = [(float(iv.start), float(iv.end - iv.start)) for iv in tl.intervals
                    if iv.stage == s and iv.step.kind == kind]
            ax.broken_barh(bars, (s - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.5)
    ax.set(yticks=range(stages), yticklabels=[f"stage {s}" for s in range(stages)], ylim=(stages - 0.5, -0.5),
           xlim=(0, float(tl.makespan)), xlabel="time units (forwards blue, backwards orange)",
           title=f"{schedule}, p={stages}, m={micro_batches}: bubble {float(tl.bubble):.3f}, "
                 f"stage 0 holds {tl.peak_in_flight[0]} micro-batches")
    fig.tight_layout()
    return fig


live(draw_pipeline, stages=(2, 8), micro_batches=(1, 32), schedule=["1F1B", "GPipe"])

# %% [markdown]
# Over m, for p = 4 (unit time, `t_b = 2 t_f`): the bubble falls like `(p-1)/(m+p-1)` for
# both schedules, while the activations held by stage 0 grow like m for GPipe and stay at p
# for 1F1B. That is why every large-scale trainer runs 1F1B or a variant of it, with m several
# times p.

# %% tags=["demo"]
print(f"{'m':>4} {'bubble':>8} {'(p-1)/(m+p-1)':>14} {'GPipe stage 0 holds':>20} {'1F1B stage 0 holds':>19}")
for m in [1, 2, 4, 8, 16, 32]:
    g, o = simulate_schedule(gpipe_schedule(4, m)), simulate_schedule(one_f_one_b_schedule(4, m))
    assert g.makespan == o.makespan
    print(f"{m:>4} {float(g.bubble):>8.3f} {3 / (m + 3):>14.3f} {g.peak_in_flight[0]:>20} {o.peak_in_flight[0]:>19}")

# %% [markdown]
# And the impossible schedule from above:

# %% tags=["demo"]
bad = [[Step("F", 0), Step("B", 0), Step("F", 1), Step("B", 1)],
       [Step("F", 0), Step("F", 1), Step("B", 0), Step("B", 1)]]
try:
    simulate_schedule(bad)
except DeadlockError as exc:
    print("DeadlockError:", exc)

# %% [markdown]
# ## 3. Interleaved 1F1B: virtual stages
#
# The bubble is `p - 1` stage-steps at each end of the pipeline, whatever m is. Narayanan et al.
# (2021b) shrink the steps instead: give each rank v smaller *chunks* of the model, not one
# consecutive block. Rank s holds chunks s, s + p, s + 2p, ... of the p v equal chunks (*virtual
# stages*), so a micro-batch visits every rank v times. A forward or backward of one chunk costs
# 1/v of a stage's, and the ramp up and down of the pipeline is made of these shorter steps:
#
# `bubble = (p - 1) / (v m + p - 1)` in unit time,
#
# v times smaller for large m, at the price of v times more point-to-point messages and some
# more activation memory. Megatron-LM's order (`forward_backward_pipelining_with_interleaving`):
# number the `m v` forward steps of a rank `k = 0, 1, ...`; step k runs
#
# - micro-batch `(k // (p v)) * p + k % p`, chunk `(k % (p v)) // p` for a forward,
# - the same micro-batch and chunk `v - 1 - (k % (p v)) // p` for the k-th backward,
#
# i.e. micro-batches go through in groups of p, each group through chunk 0, then chunk 1, ...
# Rank s first runs `w = min((p - s - 1) * 2 + (v - 1) * p, m v)` warm-up forwards, then
# alternates forward `w + i` and backward `i`, then runs the remaining backwards. Megatron
# requires m to be a multiple of p (and, when m = p, runs all forwards first; the simulator shows
# that this is not needed: the same bubble, less memory). Note the factor 2: with v = 1 this is
# 1F1B with twice its warm-up. In unit time the extra forwards change nothing; when messages
# cost time they are slack that hides the latency (measured below).
#
# **Exercise 13.3.** Write `interleaved_schedule(p, m, v)`. ValueError unless p, m, v >= 1 and
# p divides m.

# %%
#| export
#| exercise 13.3
def interleaved_schedule(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B with v chunks per stage (virtual stage c * p + s on stage s).
    The k-th forward of stage s is Step("F", (k // (p*v)) * p + k % p, (k % (p*v)) // p); its k-th
    backward has the same mb and chunk v - 1 - (k % (p*v)) // p. Warm-up: min((p-s-1)*2 + (v-1)*p,
    m*v) forwards; then F(w+i), B(i) pairs; then the remaining B.
    ValueError unless p, m, v >= 1 and m % p == 0."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("13.3")

# %% [markdown]
# With v chunks a step costs 1/v as much: `simulate_schedule(s, Fraction(1, v), Fraction(2, v))`
# keeps the times exact. p = 4, m = 8, plain 1F1B against v = 2:

# %% tags=["demo"]
from fractions import Fraction

p, m = 4, 8
fig, axes = plt.subplots(2, 1, figsize=(11, 5), sharex=True)
for ax, (name, sched, v) in zip(axes, [("1F1B", one_f_one_b_schedule(p, m), 1),
                                       ("interleaved, v=2", interleaved_schedule(p, m, 2), 2)]):
    tl = simulate_schedule(sched, Fraction(1, v), Fraction(2, v))
    tl.plot(ax=ax, title=f"{name}: makespan {float(tl.makespan):g}, bubble {float(tl.bubble):.3f} "
            f"(formula {(p - 1) / (v * m + p - 1):.3f}), chunk-activations held per stage {tl.peak_in_flight}")
fig.tight_layout()
plt.show()

# %% [markdown]
# Each chunk holds 1/v of a stage's layers, so `peak_in_flight / v` is in units of one
# micro-batch's activations for the whole stage. Stage 0 holds 11 chunk-activations for v = 2,
# i.e. 5.5 micro-batches' worth against 4 for plain 1F1B: `p (1 + (p-1)/(p v))`, the factor
# Korthikanti et al. (2022) give for the interleaved schedule's first stage.
#
# Now let every message cost `t_comm = 0.2` (a fifth of a forward). GPipe streams its forwards
# and hides most of it; 1F1B alternates a forward and a backward, each waiting for a neighbour,
# so every micro-batch pays two hops on the critical path and its bubble no longer vanishes as m
# grows. Megatron's doubled warm-up (the `* 2`; "v = 1" below is Megatron's order with one chunk)
# is the slack that absorbs it:

# %% tags=["demo"]
t_comm = Fraction(1, 5)
print(f"{'m':>4} {'GPipe':>7} {'1F1B':>7} {'Megatron v=1':>13} {'v=2':>7}    bubble with t_comm = {float(t_comm)}")
for m in [4, 8, 16, 32, 64]:
    b = [simulate_schedule(gpipe_schedule(4, m), 1, 2, t_comm).bubble,
         simulate_schedule(one_f_one_b_schedule(4, m), 1, 2, t_comm).bubble,
         simulate_schedule(interleaved_schedule(4, m, 1), 1, 2, t_comm).bubble,
         simulate_schedule(interleaved_schedule(4, m, 2), Fraction(1, 2), 1, t_comm).bubble]
    print(f"{m:>4} " + " ".join(f"{float(x):>7.3f}" if i != 2 else f"{float(x):>13.3f}" for i, x in enumerate(b)))

# %% [markdown]
# At m = 32: GPipe 0.096, 1F1B 0.168, Megatron's order with v = 1 0.096 while holding at most
# `2p - 1 = 7` micro-batches on stage 0 (GPipe: 32), and v = 2 0.071. In the steady state of
# 1F1B a stage's period is `t_f + t_b + 2 t_comm`, so its bubble tends to
# `2 t_comm / (t_f + t_b + 2 t_comm) = 0.118`, not to 0.

# %% [markdown]
# ## 4. Running a pipeline for real
#
# Now the stages are real: rank r of a communicator holds its chunks of the model (modules),
# receives activations from rank r-1, sends its outputs to rank r+1, and in the backward pass
# receives the gradient of its outputs from r+1 and sends the gradient of its inputs to r-1. The
# schedule says in which order. What the executor of one rank does:
#
# - **F of micro-batch i on virtual stage k.** The input is micro-batch i itself (k = 0), or an
#   activation received from the previous rank, wrapped as a leaf Tensor that requires grad (its
#   `.grad` is what goes back). Run the chunk; on the last virtual stage, also the loss. Keep
#   (input, output) for the backward; send the output's array to the next rank.
# - **B of micro-batch i on virtual stage k.** Take the kept pair; on the last stage,
#   backpropagate the loss; elsewhere receive the gradient of the output from the next rank and
#   backpropagate it (`out.backward(grad)`). Send the input's `.grad` to the previous rank
#   (k > 0), and drop the pair: that is the memory 1F1B frees early.
# - **Gradient accumulation.** Never zero the gradients between micro-batches: lesson 02's
#   backward *adds* into `.grad`, so after all m backwards every parameter holds the sum over
#   micro-batches. Scale each micro-batch's loss so that these add up to the batch's loss (here
#   the caller's `loss_fn` does it: `b_i / B` times the micro-batch's mean); then the gradients
#   equal those of the whole batch on one process, which the tests check to 1e-10.
#
# **Why it cannot deadlock.** `send` never blocks (lesson 12: buffered), so a rank only ever
# waits in `recv`, for a message that the step it depends on sends. If the schedule is valid (the
# simulator of section 2 finds no cycle), every awaited step eventually runs, and so every
# `recv` is eventually matched. Two details make it true in practice: a rank sends a step's
# output as soon as the step is done, before it waits for anything else, and every message
# carries a tag naming its micro-batch, virtual stage and direction, so a receive can never take
# the wrong message when several are in flight between the same pair of ranks (a stage may use
# micro-batches in another order than its neighbour produced them, and in the interleaved
# schedule a rank receives activations for two chunks from the same neighbour). With sends that
# wait for the matching receive (`MPI_Ssend`, or `MPI_Send` of a large message under MPI's
# rendezvous protocol), 1F1B's steady state has neighbours sending to each other at the same
# moment, each waiting for the other; Megatron issues such pairs as one batched isend/irecv (its
# `send_forward_recv_backward`).
#
# Given: `stage_forward` and `stage_backward` run a chunk's forward and backward and put them on
# the rank's timeline, as an "F" or "B" interval labelled with the micro-batch (on the simulator
# they charge the graph's FLOPs, lesson 12's `op_flops`, to the clock; under MPI they record the
# wall-clock interval). `split_layers` deals a list of layers out to the virtual stages.

# %%
#| export
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

# %% [markdown]
# **Exercise 13.4.** Write `pipeline_step`, the executor of one rank. Let m be the number of
# micro-batches and v the number of chunks; rank r's chunk c is virtual stage `k = c * p + r`,
# whose input comes from rank `(r - 1) % p` and output goes to rank `(r + 1) % p`. Send arrays
# (`tensor.data`), not Tensors. Give each message a tag that identifies it (a function of
# direction, micro-batch and virtual stage, below 2**20).

# %%
#| export
#| exercise 13.4
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
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% [markdown]
# **The tiny GPT as a pipeline.** Its layers are the embedding (token plus position), the blocks,
# and the head (final layer norm and the output layer). The output layer is *tied* to the token
# embedding: one matrix, used at both ends of the model. Cut into stages, the first and the last
# stage each hold a copy, and each copy gets only its own part of the gradient; Megatron-LM keeps
# the copies equal by all-reducing their gradients between the first and the last pipeline rank
# after the backward pass (its "embedding group"). Given: the layer list and that all-reduce.

# %%
#| export
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

# %% tags=["check"]
check("13.4")

# %% [markdown]
# Given: reading a pipeline's F/B intervals back from a run's timeline (simulated or measured),
# and the bubble they show.

# %%
#| export
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

# %% [markdown]
# A 12-layer MLP (width 64, tanh) on 4 simulated ranks, 3 layers each, batch 96 in m = 8
# micro-batches of 12, 1F1B. Each rank builds its own copy of the model from the same seed (as
# separate processes would), keeps its chunk, and the gradients are compared with one process
# training on the whole batch. The timeline is the simulator's clock (FLOPs at `flop_rate`, each
# message `alpha + n beta`); compare it with the schedule simulator's picture of section 2.

# %%
#| export
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

# %% tags=["demo"]
BATCH, M = 96, 8
data_rng = np.random.default_rng(1)
X_pipe, y_pipe = data_rng.standard_normal((BATCH, 64)), data_rng.integers(0, 5, BATCH)


def micro_batches(m):
    bounds = chunk_bounds(BATCH, m)
    return [Tensor(X_pipe[a:b]) for a, b in bounds], [y_pipe[a:b] for a, b in bounds]


def batch_loss(out, y):  # micro-batch mean, scaled by its share of the batch
    return cross_entropy(out, y) * (len(y) / BATCH)


def pipeline_job(comm, schedule_fn, m, v=1):
    layers = mlp_layers()
    chunks = split_layers(layers, comm.size, comm.rank, v)
    inputs, targets = micro_batches(m)
    steps = schedule_fn(comm.size, m)[comm.rank] if v == 1 else schedule_fn(comm.size, m, v)[comm.rank]
    loss = pipeline_step(comm, chunks, steps, inputs, targets, batch_loss)
    return loss, [[prm.grad.data for prm in c.parameters()] for c in chunks]


one = run(pipeline_job, 1, one_f_one_b_schedule, 1)
four = run(pipeline_job, 4, one_f_one_b_schedule, M, alpha=2e-6, beta=1e-9, flop_rate=1e9)
grads_one = [g for chunk in one.results[0][1] for g in chunk]
grads_four = [g for r in four.results for chunk in r[1] for g in chunk]
print(f"loss: one process {one.results[0][0]:.12f}, pipeline {sum(r[0] for r in four.results):.12f}; "
      f"max |gradient difference| {max(abs(a - b).max() for a, b in zip(grads_one, grads_four)):.1e}")
print(f"bytes sent per rank: {four.bytes_sent()}")
ivs = pipeline_intervals(four)
plot_pipeline(ivs, 4, unit="simulated seconds",
              title=f"1F1B on the communicator's simulator: bubble {measured_bubble(ivs, 4):.3f} "
              f"(unit-time formula {3 / (M + 3):.3f})")
plt.show()

# %% [markdown]
# The gradients equal one process's to 4e-17, and each rank sends 8 activations or gradients of
# 12 x 64 float64 numbers per direction (49,152 bytes; the middle ranks send both ways). The
# simulated bubble is 0.300 against the unit-time 0.273: the last stage is lighter than the
# others (its output layer has 5 columns, not 64) and waits, which counts as bubble (0.289
# with free messages), and every message adds `alpha + n beta` on the critical path. Pipeline
# stages must be balanced, which is why Megatron-LM puts the same number of transformer layers
# on every stage. The same function runs on MPI (section 9 measures it).

# %% [markdown]
# The shipped tiny GPT (2 blocks, so 4 layers), in float64, as a 4-stage 1F1B pipeline over 8
# micro-batches of one 64-character window each, against one process on the whole batch:

# %% tags=["demo"]
from minitorch.gpt import eval_windows, load_corpus, load_tiny_gpt, split_ids

tiny, tokenizer = load_tiny_gpt()
_, val_ids = split_ids(tokenizer.encode(load_corpus()))
xb, yb = eval_windows(val_ids, tiny.config.block_size, 8)


def gpt_pipeline_job(comm, m):
    model = float64_model(load_tiny_gpt()[0])
    chunks = split_layers(gpt_layers(model), comm.size, comm.rank)
    bounds = chunk_bounds(len(xb), m)
    loss = pipeline_step(comm, chunks, one_f_one_b_schedule(comm.size, m)[comm.rank],
                         [xb[a:b] for a, b in bounds], [yb[a:b] for a, b in bounds], gpt_loss(len(xb)))
    allreduce_tied_embedding(comm, model)
    return loss, {name: prm.grad.data for name, prm in model.named_parameters() if prm.grad is not None}


whole = run(gpt_pipeline_job, 1, 1).results[0]
piped = run(gpt_pipeline_job, 4, 8)
grads = {}
for _, g in piped.results:
    grads.update(g)
print(f"loss: one process {whole[0]:.12f}, 4 stages {sum(r[0] for r in piped.results):.12f}; "
      f"largest gradient difference {max(abs(grads[k] - whole[1][k]).max() for k in whole[1]):.1e} "
      f"over {len(grads)} parameters (the tied embedding included)")

# %% [markdown]
# ## 5. Tensor parallelism: the MLP with one all-reduce each way
#
# Pipelining splits the model between layers; tensor parallelism (Shoeybi et al. 2019) splits
# every layer. Take the transformer MLP, `Y = act(X A + a) B + b`, with A of shape (C, H) and B
# of shape (H, C), on N ranks:
#
# - Cut A **by columns**: rank r holds `A_r = A[:, cols_r]` and `a_r`, H/N columns each. Then
#   `act(X A_r + a_r)` is exactly the block `cols_r` of `act(X A + a)`: the nonlinearity works
#   elementwise, so no communication is needed (cutting A by rows instead would need an
#   all-reduce *before* the nonlinearity).
# - Cut B **by rows**, the same `cols_r`: `Z_r = act(X A_r + a_r) B_r` is rank r's share of a sum,
#   `X A B = sum_r Z_r`. One **all-reduce** gives every rank the full output. Add the bias b
#   *after* it: added before, it would be summed N times.
#
# Forward: one all-reduce (`g` in the paper). Backward, by the chain rule: the gradient of Y is
# the same on every rank, so the gradients of `B_r`, `A_r`, `a_r` are local; but X fed all N
# shards, and its gradient is the **sum** of the N ranks' contributions: a second all-reduce
# (`f`). Megatron writes these as two conjugate autograd operators:
#
# | operator | forward | backward |
# |---|---|---|
# | `f` (`copy_to_tp`) | identity | all-reduce the gradient |
# | `g` (`reduce_from_tp`) | all-reduce | identity |
#
# and the MLP as `g(act(f(X) A_r + a_r) B_r) + b`. Per layer and micro-batch that is one
# all-reduce of the activations (B x T x C numbers) each way, and a rank holds 1/N of the
# weights and 1/N of the hidden activations. All ranks need the same input X: tensor-parallel
# ranks see the same micro-batch, unlike data-parallel ranks.
#
# A width that N does not divide cannot be cut evenly: reject it with a clear error (Megatron
# does), or pad it. Megatron pads the *vocabulary* (the output layer's width) up to a multiple of
# 128 times N with unused rows, e.g. GPT-2's 50,257 to 50,304 on one rank (`make-vocab-size-
# divisible-by`); the tiny GPT's 103 characters are a prime number, so only padding could cut
# its output layer.
#
# **Exercise 13.5.** Write `copy_to_tp` and `reduce_from_tp` as autograd operations
# (`x._record(out, (x,), vjp, name)`, as lesson 02's ops do) calling the all-reduce you are
# given (`allreduce(comm, array)`: lesson 12's `ring_allreduce` by default; the tests pass their
# own and count the calls), and `TensorParallelMLP`: its constructor takes the two full Linear
# layers and keeps this rank's shards as new Parameters (copies); ValueError naming the width and
# the number of ranks unless N divides the hidden width. (Its check comes with the second part,
# in section 6.)

# %%
#| export
#| exercise 13.5
def copy_to_tp(comm: Communicator, x: Tensor, allreduce: Callable = ring_allreduce) -> Tensor:
    """Megatron's f: forward the identity (a new node), backward all-reduce (sum) the gradient
    over comm's ranks with allreduce(comm, array)."""
    ### BEGIN SOLUTION
    return x._record(Tensor(x.data), (x,), lambda g: (allreduce(comm, g),), "tp_copy")
    ### END SOLUTION


def reduce_from_tp(comm: Communicator, x: Tensor, allreduce: Callable = ring_allreduce) -> Tensor:
    """Megatron's g: forward all-reduce (sum) x over comm's ranks, backward the identity."""
    ### BEGIN SOLUTION
    return x._record(Tensor(allreduce(comm, x.data)), (x,), lambda g: (g,), "tp_reduce")
    ### END SOLUTION


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
        ### BEGIN SOLUTION
        hidden, n = fc.weight.shape[1], comm.size
        if hidden % n:
            raise ValueError(f"tensor parallelism: the hidden width {hidden} is not divisible by the "
                             f"{n} ranks (pad it, or use a rank count that divides it)")
        lo, hi = chunk_bounds(hidden, n)[comm.rank]
        self.fc_weight = Parameter(fc.weight.data[:, lo:hi])
        self.fc_bias = Parameter(fc.bias.data[lo:hi])
        self.proj_weight = Parameter(proj.weight.data[lo:hi, :])
        self.proj_bias = Parameter(proj.bias.data)
        ### END SOLUTION

    def forward(self, x: Tensor) -> Tensor:
        ### BEGIN SOLUTION
        h = self.activation(copy_to_tp(self.comm, x, self.allreduce) @ self.fc_weight + self.fc_bias)
        return reduce_from_tp(self.comm, h @ self.proj_weight, self.allreduce) + self.proj_bias
        ### END SOLUTION

# %% [markdown]
# The same MLP (width 64, hidden 256, tanh, float64, a batch of 24) on 1 process and on 4
# simulated ranks, with an all-reduce that counts its calls: one in the forward, one in the
# backward, and each rank sends `2 (N-1)/N S` bytes per ring all-reduce of S bytes (lesson 12).

# %% tags=["demo"]
def counting(log):
    def allreduce(comm, x):
        log.append(x.nbytes)
        return ring_allreduce(comm, x)
    return allreduce


def tp_mlp_job(comm):
    rng = np.random.default_rng(0)
    fc, proj = Linear(64, 256, rng=rng), Linear(256, 64, rng=rng)
    for prm in fc.parameters() + proj.parameters():
        prm.data = prm.data.astype(np.float64)
    fc.bias.data, proj.bias.data = rng.standard_normal(256) * 0.1, rng.standard_normal(64) * 0.1
    x = Tensor(np.random.default_rng(1).standard_normal((24, 64)), requires_grad=True)
    log = []
    mlp = TensorParallelMLP(comm, fc, proj, lambda h: h.tanh(), counting(log))
    y = mlp(x)
    forward_calls = len(log)
    (y * y).sum().backward()
    return y.data, x.grad.data, forward_calls, len(log) - forward_calls, comm.stats["bytes_sent"]


ref = run(tp_mlp_job, 1).results[0]
res = run(tp_mlp_job, 4)
y4, gx4, n_fwd, n_bwd, sent = res.results[0]
S = 24 * 64 * 8
print(f"output differs by {abs(y4 - ref[0]).max():.1e}, input gradient by {abs(gx4 - ref[1]).max():.1e}")
print(f"all-reduces: {n_fwd} in the forward, {n_bwd} in the backward; bytes sent per rank {res.bytes_sent()} "
      f"= 2 x 2(N-1)/N x {S} = {2 * 2 * 3 / 4 * S:.0f}")

# %% [markdown]
# ## 6. Tensor-parallel attention, and the GPT's blocks
#
# Attention splits just as naturally, **by heads**: heads are independent until the output
# projection mixes them. Rank r keeps heads `chunk_bounds(n_head, N)[r]`, i.e. the columns
# `[h0 hd, h1 hd)` of the q, k and v projections (a column cut, as A in the MLP) and the same rows
# of the output projection (a row cut, as B). Each rank runs ordinary multi-head attention on its
# heads; the partial outputs of the projection are summed by one all-reduce (g) and the
# projection's bias is added once after it; one f in front of the three projections gives the
# one all-reduce of the backward pass. A transformer block (lesson 09's pre-norm block) is then
#
# ```
# x = x + g(attention_r(f(ln1(x)))) + b_proj        one all-reduce forward, one backward
# x = x + g(gelu(f(ln2(x)) A_r + a_r) B_r) + b      one all-reduce forward, one backward
# ```
#
# The layer norms and the residual additions are computed redundantly on every rank, on the full
# activations: that is the part Korthikanti et al. (2022) later split along the sequence
# ("sequence parallelism"), turning each all-reduce into a reduce-scatter plus an all-gather of
# the same total traffic. The number of heads must be divisible by N: the tiny GPT's 4 heads
# split over 1, 2 or 4 ranks, not 3.
#
# **Exercise 13.5, second part.** Write `TensorParallelAttention` (from a lesson-09
# `CausalSelfAttention`; use its `attend(q, k, v)`, lesson 09's `split_heads` and `merge_heads`
# on the local heads) and `TensorParallelBlock` (from a lesson-09 `Block`: its own layer norms,
# your tensor-parallel attention and `TensorParallelMLP` with lesson 09's `gelu`). ValueError
# naming the heads and the ranks unless N divides n_head. The check below grades both parts.

# %%
#| export
#| exercise 13.5
class TensorParallelAttention(Module):
    """Rank comm.rank's heads h0..h1-1 (chunk_bounds(n_head, N)[rank]) of a lesson-09
    CausalSelfAttention `attn` (C = n_embd, hd = C // n_head): q_weight, k_weight, v_weight
    (C, (h1-h0) hd) and their biases: columns [h0 hd, h1 hd); proj_weight ((h1-h0) hd, C): the
    same rows; proj_bias (C,): all of it. New Parameters (copies).
    forward(x (B, T, C)) -> (B, T, C): f(x) projected to local q, k, v, split into the local heads,
    attn.attend, merged, projected, g, plus proj_bias. ValueError unless N divides n_head."""

    def __init__(self, comm: Communicator, attn: Any, allreduce: Callable = ring_allreduce):
        self.comm, self.allreduce, self.attend = comm, allreduce, attn.attend
        ### BEGIN SOLUTION
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
        ### END SOLUTION

    def forward(self, x: Tensor) -> Tensor:
        ### BEGIN SOLUTION
        xf = copy_to_tp(self.comm, x, self.allreduce)
        q, k, v = (split_heads(xf @ w + b, self.n_head) for w, b in
                   ((self.q_weight, self.q_bias), (self.k_weight, self.k_bias), (self.v_weight, self.v_bias)))
        y = merge_heads(self.attend(q, k, v)) @ self.proj_weight
        return reduce_from_tp(self.comm, y, self.allreduce) + self.proj_bias
        ### END SOLUTION


class TensorParallelBlock(Module):
    """A lesson-09 pre-norm Block on rank comm.rank of comm.size: its own ln1 and ln2 (replicated),
    TensorParallelAttention(comm, block.attn) and TensorParallelMLP(comm, block.mlp.fc,
    block.mlp.proj, gelu). forward(x (B, T, C)): x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, comm: Communicator, block: Any, allreduce: Callable = ring_allreduce):
        ### BEGIN SOLUTION
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attn = TensorParallelAttention(comm, block.attn, allreduce)
        self.mlp = TensorParallelMLP(comm, block.mlp.fc, block.mlp.proj, gelu, allreduce)
        ### END SOLUTION

    def forward(self, x: Tensor) -> Tensor:
        ### BEGIN SOLUTION
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
        ### END SOLUTION

# %% [markdown]
# Given: `tensor_parallel_gpt` swaps a GPT's blocks for tensor-parallel ones in place (the
# embeddings, the final norm and the tied output layer stay replicated). On the shipped tiny GPT
# (float64 copies of its weights), 2 and 4 simulated ranks reproduce the model's loss on a batch
# of the validation text, and each rank holds a quarter or a half of the blocks' weights.

# %%
#| export
def tensor_parallel_gpt(comm: Communicator, model: Any, allreduce: Callable = ring_allreduce) -> Any:
    """Replace model.blocks by TensorParallelBlocks for comm's ranks (in place); returns model."""
    model.blocks = [TensorParallelBlock(comm, block, allreduce) for block in model.blocks]
    return model

# %% tags=["check"]
check("13.5")

# %% tags=["demo"]
def tp_gpt_job(comm):
    model = float64_model(load_tiny_gpt()[0])
    n_all = sum(prm.size for b in model.blocks for prm in b.parameters())
    tensor_parallel_gpt(comm, model)
    _, loss = model(xb, yb)
    return loss.item(), sum(prm.size for b in model.blocks for prm in b.parameters()) / n_all


for n in (1, 2, 4):
    res = run(tp_gpt_job, n)
    print(f"{n} rank(s): loss {res.results[0][0]:.12f} on every rank: "
          f"{len({r[0] for r in res.results}) == 1}; share of the blocks' weights per rank {res.results[0][1]:.3f}; "
          f"bytes sent per rank {res.stats[0]['bytes_sent']}")

# %% [markdown]
# A rank keeps a little more than 1/N of the blocks' weights (0.504 and 0.256): the layer norms
# and the output biases are replicated. Each of the 2 blocks all-reduces its attention and its
# MLP output, 8 windows x 64 positions x 64 channels x 8 bytes = 256 KiB each: 4 ring
# all-reduces per forward, `4 x 2 (N-1)/N x 256 KiB` = 1 MiB sent per rank on 2 ranks, 1.5 MiB
# on 4.
#
# ## 7. Sequence parallelism: ring attention
#
# Tensor and pipeline parallelism split the weights; with long sequences the *activations*
# dominate, and the attention scores grow with the square of the length. **Ring attention**
# (Liu, Zaharia and Abbeel 2023) splits the sequence: rank r holds the queries, keys and values
# of positions `[r n, (r+1) n)`. Everything in a transformer except attention works position by
# position, so only attention needs other ranks' data, and it needs only their keys and values.
# They travel around a ring: at step s, rank r holds the K/V block of rank `(r - s) mod N`, computes
# its queries' attention over that block, passes the block to the right and receives the next one
# from the left. After N - 1 passes every query has seen every key.
#
# The partial results are merged exactly as FlashAttention merges tiles: attention over a block
# gives an output normalised *within the block* and the block's logsumexp; two such partials over
# disjoint key sets combine with lesson 09's `merge_attention` (the online softmax of Milakov and
# Gimelshein 2018) into the attention over their union. A rank holds one `n x n` block of scores
# per head at a time, never the `N n x N n` matrix.
#
# **Causal.** With a causal mask, block j is entirely in the future of rank r's queries when
# j > r (skip it, but pass it on), entirely visible when j < r, and the diagonal block j = r needs
# the usual triangle. Rank N-1 then computes N blocks and rank 0 one: a load imbalance that
# striped attention (Brandon et al. 2023) removes by dealing positions out round-robin.
#
# **Backward.** The gradients follow the same ring, as in FlashAttention's backward (Dao et al.
# 2022): with `D = rowsum(dO * O)` and the saved logsumexp, a block's probabilities are
# recomputed as `P = exp(S - lse)`, and then `dV_j += P^T dO`, `dS = P * (dO V_j^T - D)`,
# `dQ += dS K_j / sqrt(d)`, `dK_j += dS^T Q / sqrt(d)`. The accumulators dK_j and dV_j travel
# around the ring *with* K_j and V_j, collecting every rank's contribution; after the N-th pass
# they are back home.
#
# **Exercise 13.6.** Write `ring_attention` and `ring_attention_backward` on NumPy arrays. Every
# rank holds n positions (the same n on every rank). Send one message per pass: in the forward,
# K and V concatenated on the last axis (N - 1 messages); in the backward, K, V, dK and dV
# concatenated (N - 1 messages), then dK and dV alone (one more: the way home). Use lesson 09's
# `attention_np(q, k, v, mask, return_lse=True)` and `merge_attention` for the forward.

# %%
#| export
#| exercise 13.6
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
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def ring_attention_backward(comm: Communicator, q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray,
                            lse: np.ndarray, do: np.ndarray, causal: bool = False
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients (dq, dk, dv) of this rank's blocks, given the forward's o, lse and the gradient
    do of o (shapes as ring_attention). K, V, dK, dV travel the ring together (N-1 messages,
    concatenated on the last axis), then dK, dV make one more hop home (N messages in all when
    N > 1; on one rank nothing travels: 0 messages)."""
    check_ring_blocks("ring_attention_backward", q, k, v, o, lse, do)  # given: before anything is sent
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% [markdown]
# Given: the ring as an autograd operation, and sequence-parallel self-attention for the GPT: the
# q, k, v and output projections act on each rank's positions alone; only the attention in
# between goes around the ring.

# %%
#| export
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

# %% tags=["check"]
check("13.6")

# %% [markdown]
# The tiny GPT's first attention layer (float64), sequence-parallel over 4 simulated ranks: each
# holds 16 of a window's 64 positions. The output and the gradients of the layer's input match
# the unpartitioned layer, and a rank's scores are 16 x 16 per head instead of 64 x 64.

# %% tags=["demo"]
def ring_layer_job(comm):
    attn = float64_model(load_tiny_gpt()[0]).blocks[0].attn
    x_all = float64_model(load_tiny_gpt()[0]).wte.weight.data[xb[:2]]  # 2 windows, embedded
    n = x_all.shape[1] // comm.size
    x = Tensor(x_all[:, comm.rank * n:(comm.rank + 1) * n], requires_grad=True)
    y = RingSelfAttention(comm, attn)(x)
    (y * y).sum().backward()
    return y.data, x.grad.data


ref_y, ref_g = run(ring_layer_job, 1).results[0]
ring4 = run(ring_layer_job, 4)
print(f"output differs by {abs(np.concatenate([r[0] for r in ring4.results], axis=1) - ref_y).max():.1e}, "
      f"input gradient by {abs(np.concatenate([r[1] for r in ring4.results], axis=1) - ref_g).max():.1e}; "
      f"messages per rank {[st_['msgs_sent'] for st_ in ring4.stats]}, bytes {ring4.bytes_sent()}")

# %% [markdown]
# Per rank: 3 passes of K and V in the forward (3 x 32 KiB: 2 windows x 4 heads x 16 positions
# x 16 channels x 8 bytes, for K and for V), 3 of K, V, dK and dV and 1 of dK and dV in the
# backward: 7 messages, 320 KiB. For a sequence of T = N n positions the forward traffic per rank,
# `2 (N-1) n d` numbers per head, stays near `2 T d` however many ranks share the work, while the
# compute per rank, `T n d`, shrinks as 1/N: ring attention hides its communication behind the
# computation only while each block is large enough (Liu et al. 2023 overlap the transfer of the
# next block with the computation on the current one).

# %% [markdown]
# ## 8. A planner: which combination, on which cluster?
#
# On N ranks a plan chooses data parallelism `dp`, tensor parallelism `tp` and pipeline
# parallelism `pp` with `dp * tp * pp = N`, and the number m of micro-batches per step. Every
# choice trades something:
#
# - **tp** divides each layer's weights and FLOPs by tp, but costs 4 all-reduces of the
#   activations per layer and micro-batch (2 forward, 2 backward), on the critical path. Over
#   NVLink inside a node that is cheap; over the network between nodes, ruinous. Narayanan et al.
#   (2021b) keep tp within a node (tp <= 8 on DGX machines:
#   [how a DGX H100 is wired](../hardware_notes/interconnects.md#how-a-dgx-h100-is-wired)).
# - **pp** divides the layers, with only one activation per micro-batch crossing each stage
#   boundary (point to point, fine across nodes), but adds the bubble `(pp-1)/(m+pp-1)`, which
#   wants m large, i.e. small micro-batches, which compute less efficiently on a real GPU.
# - **dp** divides the batch, costs one all-reduce of the gradients per step (which lesson 12
#   overlaps with the backward pass; we do not, here), and divides nothing of the model's memory
#   (unless ZeRO, lesson 12).
#
# **The model.** A GPT of L layers, width d, h heads, sequence s, global batch B sequences,
# 16-bit activations and gradients, mixed-precision Adam (16 bytes of state per parameter:
# [transformer arithmetic](../hardware_notes/transformer_arithmetic.md#memory)). Per layer it has
# `12 d^2 + 13 d` parameters and its forward costs `24 b s d^2 + 4 b s^2 d` FLOPs for b sequences
# (Narayanan et al. 2021b; the backward twice that); the embeddings and the output layer are
# left out. Per rank, with `b = B / (dp m)` sequences per micro-batch and `Ls = L / pp` layers:
#
# ```
# AR(n, S)  = 2 (n-1) (alpha + S/n beta)          ring all-reduce of S bytes on n ranks (0 if n = 1)
# a         = 2 b s d                             bytes of one micro-batch's activations
# t_F       = Ls (F(b) / (tp R) + 2 AR_tp(tp, a))  forward of one micro-batch on one stage (R: FLOP/s)
# t_B       = Ls (2 F(b) / (tp R) + 2 AR_tp(tp, a))
# c         = alpha_pp + a beta_pp  (0 if pp = 1)  one point-to-point message
# P         = Ls (12 d^2 + 13 d) / tp             parameters per rank
# time      = (m + pp - 1)(t_F + t_B + 2c) + AR_dp(dp, 2 P)
# memory    = 16 P + Ls min(pp, m) s b d (10 + 24/tp + 5 h s / (d tp))
# ```
#
# The time is 1F1B's `(m + p - 1)` slots of one forward and one backward each, every slot paying
# its two messages (an upper bound: the first and last stages send one), then the gradient
# all-reduce. The memory is the model states plus the activations stage 0 keeps: `min(pp, m)`
# micro-batches in flight (section 2), each `s b d (10 + 24/tp + 5 h s/(d tp))` bytes per layer,
# Korthikanti et al.'s (2022) count for 16-bit tensor-parallel training without recomputation
# (the `5 h s^2 b` term is the attention scores, which FlashAttention does not keep).
#
# Which links? A group whose ranks all sit in one node talks over the node's link (NVLink), any
# other over the network. Ranks are numbered Megatron's way, tp fastest, then pp, then dp:
# `rank = (d * pp + s) * tp + t`, so a tp group spans tp consecutive ranks, a pipeline tp * pp,
# and a dp group all N. `link_for(cluster, span)` (given) returns the (alpha, beta) of a group
# spanning `span` consecutive ranks.
#
# **Checked against the simulator.** `simulate_plan` (given) runs the plan as a skeleton on the
# communicator's simulator: N ranks that charge the FLOPs to their clocks, run the ring
# all-reduces of lesson 12 in their tp and dp groups (`comm.group`) and pass activations and
# gradients along the pipeline, following a schedule you give it, without computing anything.
# Its clock is the real critical path of the plan under the alpha-beta model. With
# `alpha = beta = 0` your estimate must equal it; with communication, it must stay within 5%.
#
# **Exercise 13.7.** Write `estimate_plan` (the formulas above; ValueError naming the problem
# when `dp * tp * pp != N`, tp does not divide the heads, pp does not divide the layers, or
# `dp * m` does not divide the batch) and `best_plan`: every valid plan (every factorisation
# of N and every m), each estimated with `estimate_plan`, the fastest whose memory fits
# (`memory <= cluster.memory`); exact ties in time go to the smaller memory, then the smaller tp,
# then the smaller pp, then the smaller m (the tests check each key of that order on its own,
# standing in for `estimate_plan` with designed estimates). ValueError if none fits.

# %%
#| export
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

# %%
#| export
#| exercise 13.7
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
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def best_plan(model: ModelSpec, cluster: ClusterSpec) -> tuple[Plan, Estimate]:
    """The fastest valid plan whose memory is <= cluster.memory, over every (dp, tp, pp) with
    dp * tp * pp = n_ranks and every m, each estimated with estimate_plan. Ties: smaller memory,
    then smaller tp, then smaller pp, then smaller m. ValueError if no plan fits."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("13.7")

# %% [markdown]
# The estimate against the simulator on a small case (4 ranks, a 4-layer model of width 64,
# `alpha` = 20 us, `beta` = 10 ns/byte: a slow network, so that communication matters), every
# valid plan:

# %% tags=["demo"]
small_model = ModelSpec(n_layer=4, d_model=64, n_head=4, seq_len=32, batch=8)
small_cluster = ClusterSpec(n_ranks=4, memory=1e12, flop_rate=1e10, alpha=2e-5, beta=1e-8)


def valid_plans(model, cluster):
    """Every plan estimate_plan accepts, with its estimate."""
    n = cluster.n_ranks
    for tp_, pp_ in product(range(1, n + 1), repeat=2):
        if n % (tp_ * pp_):
            continue
        dp_ = n // (tp_ * pp_)
        for m_ in range(1, model.batch + 1):
            plan = Plan(dp_, tp_, pp_, m_)
            try:
                yield plan, estimate_plan(model, cluster, plan)
            except ValueError:
                pass


rows = [(plan, est, simulate_plan(small_model, small_cluster, plan, one_f_one_b_schedule).time)
        for plan, est in valid_plans(small_model, small_cluster)]
print(f"{'(dp, tp, pp, m)':<16} {'memory KB':>10} {'estimate ms':>12} {'simulated ms':>13} {'ratio':>6}")
for plan, est, simulated in sorted(rows, key=lambda r: r[2]):
    print(f"{str((plan.dp, plan.tp, plan.pp, plan.m)):<16} {est.memory / 1e3:>10.0f} {est.time * 1e3:>12.3f} "
          f"{simulated * 1e3:>13.3f} {est.time / simulated:>6.3f}")
pick, _ = best_plan(small_model, small_cluster)
print(f"best_plan picks (dp, tp, pp, m) = {(pick.dp, pick.tp, pick.pp, pick.m)}")

# %% [markdown]
# The estimate is exact without pipelining (pp = 1) and at most 3.5% high with it: the first and
# the last stage send one message per micro-batch, not two. On this slow network the pick is a
# 4-stage pipeline with 8 micro-batches (12.4 ms simulated), and the simulator agrees; pure
# tensor parallelism (tp = 4) takes 18 to 31 ms: 4 all-reduces per layer and micro-batch.
#
# Real clusters have two networks, and the planner can say what that means. A GPT with 40 layers
# of width 8192 (64 heads, 32B parameters without the embeddings), sequences of 2048, 512 per
# step, on 64 H100s in 8 DGX nodes: NVLink inside a node (450 GB/s, alpha 3.4 us: the NCCL figure of
# [the notes](../hardware_notes/interconnects.md#alpha-and-beta-for-lessons-12-13)), one 400 Gb/s
# InfiniBand NIC per GPU between nodes (50 GB/s, alpha 14 us), 80 GB each, and 400 TFLOP/s
# *achieved* per GPU (an assumption: about 40% of the bf16 dense peak).

# %% tags=["demo"]
big_model = ModelSpec(n_layer=40, d_model=8192, n_head=64, seq_len=2048, batch=512)
h100s = ClusterSpec(n_ranks=64, memory=80e9, flop_rate=400e12, alpha=14e-6, beta=1 / 50e9,
                    node_size=8, alpha_node=3.4e-6, beta_node=1 / 450e9)
print(f"parameters: {big_model.n_layer * big_model.params_per_layer / 1e9:.1f} B (without embeddings); "
      f"model states alone: {16 * big_model.n_layer * big_model.params_per_layer / 1e9:.0f} GB")
plans = list(valid_plans(big_model, h100s))
print(f"{len(plans)} valid plans, {sum(e.memory <= h100s.memory for _, e in plans)} fit in 80 GB. "
      "The fastest for each tp:")
print(f"{'tp':>3}  {'fastest (dp, tp, pp, m)':<24} {'GB':>6} {'step s':>7}   {'fastest that fits':<20} {'GB':>5} {'step s':>7}")
for tp_ in sorted({plan.tp for plan, _ in plans}):
    mine = [(e.time, plan, e) for plan, e in plans if plan.tp == tp_]
    fit = [r for r in mine if r[2].memory <= h100s.memory]
    a = min(mine, key=lambda r: r[0])
    line = f"{tp_:>3}  {str((a[1].dp, a[1].tp, a[1].pp, a[1].m)):<24} {a[2].memory / 1e9:>6.0f} {a[0]:>7.2f}"
    if fit:
        b = min(fit, key=lambda r: r[0])
        line += f"   {str((b[1].dp, b[1].tp, b[1].pp, b[1].m)):<20} {b[2].memory / 1e9:>5.0f} {b[0]:>7.2f}"
    print(line)
pick, est = best_plan(big_model, h100s)
print(f"best_plan: {pick}, {est.memory / 1e9:.1f} GB, {est.time:.2f} s per step")

# %% [markdown]
# The model states alone (515 GB) rule out data parallelism on its own, and 33 of the 168 valid
# plans fit. Inside a node, tensor parallelism is cheap enough that the planner uses it (tp = 2 to
# 8 all within 12% of each other); a tensor-parallel group of 16 spans two nodes and puts its
# all-reduces on the 9x slower network: 36 s per step instead of 9. Pipelining crosses nodes
# with one small message per micro-batch and stage, and fills its bubble with many
# micro-batches. That is the configuration rule of Narayanan et al. (2021b): tensor parallelism
# up to the size of a node, pipeline parallelism across nodes, data parallelism for the rest.
# The pick itself, tp = 2 with m = 128 micro-batches of one sequence, shows what the model leaves
# out: a GPU runs a micro-batch of one sequence far less efficiently than a large one (the FLOP
# rate is not a constant), which is why real configurations use larger micro-batches and tp = 8. Also left out: activation recomputation, overlapping the
# data-parallel all-reduce with the backward pass (lesson 12), ZeRO, and the embeddings.
#
# ## 9. The same code on MPI
#
# Every function above takes a communicator, so the pipeline, the tensor-parallel layers and the
# ring run on real processes unchanged; the tests check that MPI's results equal the simulator's
# bit for bit. What the simulator cannot show is real time. The cell below runs the 12-layer MLP
# of section 4, widened to 512 (float64, 8 micro-batches), with a 512-wide last layer too (the
# loss reads its first 5 outputs) so that the two stages do the same work, at two batch sizes:
# 1024 and 2048 rows (micro-batches of 128 and 256 rows), each in its own MPI launch. It times 2
# MPI processes (2 stages, 1F1B) against 1 process running the whole batch at once and 1 process
# running the 8 micro-batches one after the other, on this machine (the cell prints its cores and
# load), and prints the step times (best of 3) and the bubble in the measured timeline
# (`stage_forward` and `stage_backward` record wall-clock intervals under MPI).

# %%
#| export
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

# %% tags=["demo"]
if mpi_status()[0]:
    from minitorch.bench import load_report
    width, batches, reps = (512, (1024, 2048), 3) if not SMALL else (64, (64,), 1)
    print(load_report())
    for batch in batches:  # m = 8 micro-batches of batch / 8 rows
        res = run(pipeline_timings, 2, width, batch, 8, reps, engine="mpi", timeout=300)
        (t1, t1m), t2, start = res.results[0][0], max(r[1][0] for r in res.results), max(r[1][1] for r in res.results)
        ivs = pipeline_intervals(res, since=start, until=start + t2)
        print(f"batch {batch} ({batch // 8}-row micro-batches): one process, whole batch {t1 * 1e3:.1f} ms, the 8 "
              f"micro-batches one after the other {t1m * 1e3:.1f} ms; 2 stages, m = 8: {t2 * 1e3:.1f} ms")
        print(f"  speed-up over the same 8 micro-batches on one process {t1m / t2:.2f}x (at best 2 m/(m+1) = "
              f"{2 * 8 / 9:.2f}x); over the faster one-process run {min(t1, t1m) / t2:.2f}x")
        print(f"  measured bubble {measured_bubble(ivs, 2):.3f}, unit-time formula (p-1)/(m+p-1) = {1 / 9:.3f}")
    plot_pipeline(ivs, 2, unit="seconds (wall clock, MPI)", title=f"1F1B on 2 MPI processes, batch {batch}")
    plt.show()
else:
    print("MPI cannot start here:", mpi_status()[1])

# %% [markdown]
# The cell prints the load and the threads first: compare your figures with those conditions.
# The pipeline runs the same 8 micro-batches as the second one-process run, so that run is the
# baseline of the bound `2 m/(m+1)` = 1.78x; the whole-batch run is another program (larger
# matrices, fewer Python calls), and dividing by it can fall below the bound or, on a machine
# where large arrays are slow to allocate, exceed it. What keeps the pipeline from the bound:
#
# - **Unequal stages.** The slower stage sets the pace of every step. With a 512 x 5 output layer
#   (as section 4's MLP ends in a 64 x 5 one) the second stage would hold five layers' work
#   against the first's six: it would wait for the first at every step, and the measured bubble
#   would exceed the unit-time `(p-1)/(m+p-1)` = 0.11. PipeDream partitions layers by profiled
#   cost, GPipe by estimated cost, for this reason.
# - **A backward is not exactly twice a forward**, and every message costs wall time: `make
#   bench` prints what the MPI engine adds per message (compare it with the step time printed
#   above) and how the two cores scale when both run (`core_scaling`).
# - **Both cores at once.** Any other load lands on the critical path: a rank waiting in `recv`
#   gives its core away, but the stage it waits for still has to get one.
# - **Micro-batches too small.** Some work is paid once per micro-batch, whatever its size:
#   every layer adds its weight gradient (512 x 512 float64, 2 MiB) into `.grad` once per
#   micro-batch, and its weight-gradient GEMM has only the micro-batch's rows as its inner
#   dimension. Compare the two one-process times of each batch: where that work costs, the
#   micro-batches take longer than the whole batch, and the speed-up over the faster one-process
#   run falls short of the bound by as much. (On the 2-core development machine a profile put
#   the difference at 128 rows in those adds and GEMMs, and there was none at 256 rows.) The
#   remedy is larger micro-batches; more of them (a larger m) shrinks the bubble but, for the same
#   batch, makes each one smaller. Megatron-LM cuts the cost of the adds by fusing them into the
#   weight-gradient GEMM (`--gradient-accumulation-fusion`: a GEMM that adds into its output,
#   BLAS's beta = 1; from NumPy, SciPy's `scipy.linalg.blas.dgemm(1.0, a, b, beta=1.0, c=grad,
#   overwrite_c=True)` on a Fortran-ordered `grad`). Zero-bubble schedules pull a different
#   lever: they split each backward into its input-gradient and weight-gradient halves and run
#   the weight-gradient GEMMs in the bubble (Qi et al. 2024).

# %% [markdown]
# ## 10. Placement across nodes, measured
#
# Section 8's planner put tensor parallelism inside a node because its all-reduces sit on the
# critical path, four per layer and micro-batch, while a pipeline sends one activation per
# micro-batch and stage boundary. Lesson 12 built a cluster to test such claims
# ([emulating a cluster](../hardware_notes/interconnects.md#emulating-a-cluster-on-one-machine)):
# here 2 nodes of 2 ranks, each rank's NIC capped at 2 Gbit/s. Two launches of 2 ranks run the same
# job, first both ranks on one node, then one rank on each node (`run(..., engine="mpi", nodes=1)`
# and `nodes=2`): a tensor-parallel MLP step (tp = 2: section 5's MLP, width 128, hidden 64, 4096
# rows, float64, forward and backward) and a 2-stage pipeline step (section 4's 12-layer MLP at width
# 128, 4096 rows in 8 micro-batches, 1F1B). Both placements do the same arithmetic and send the same
# bytes; only the link differs. (The MLP's hidden layer is narrow so that its arithmetic, which this
# CPU does a thousand times slower than a GPU, does not hide the link: on a GPU the matmuls shrink and
# the all-reduces stay.) (Two ranks on this machine's two cores: with more ranks than cores,
# one rank's wait on the network would be hidden behind another's arithmetic.) The cell times each
# step (the best of a few trials, taking turns: lesson 12's `best_times`), reads the bytes each NIC
# sent, measures the link (lesson 12's `link_sweep` and `fit_link`), and predicts what crossing nodes
# adds: for tensor parallelism, the two ring all-reduces of the 4096 x 128 activations in each step,
# `2 (AR_network - AR_node)`; for the pipeline, the estimate's `(m + pp - 1) 2 c` with `c = alpha + a
# beta` on each link. Where no cluster can be made, the simulator's two-level topology runs the same
# job (lesson 12's links: 5 us and 10 GB/s inside a node, 10 us and 1 GB/s between nodes).

# %% tags=["demo"]
from course.cluster import EmulatedCluster, cluster_status, read_nic_bytes
from minitorch.parallel import best_times, fit_link, link_sweep


def placement_job(comm, width, hidden, rows, m, reps, trials, nics=None):
    """On 2 ranks: (tp step seconds, pipeline step seconds, the bytes each NIC sent in one tp step and
    in one pipeline step (None without nics), the link's one-way times, their sizes), on rank 0."""
    rng = np.random.default_rng(0)
    fc, proj = Linear(width, hidden, rng=rng), Linear(hidden, width, rng=rng)
    for prm in fc.parameters() + proj.parameters():
        prm.data = prm.data.astype(np.float64)
    X = np.random.default_rng(1).standard_normal((rows, width))
    y = np.random.default_rng(2).integers(0, 5, rows)
    bounds = chunk_bounds(rows, m)
    inputs, targets = [Tensor(X[a:b]) for a, b in bounds], [y[a:b] for a, b in bounds]
    mlp = TensorParallelMLP(comm, fc, proj, lambda h: h.tanh())
    chunks = split_layers(mlp_layers(12, width, width, seed=0), 2, comm.rank)
    steps = one_f_one_b_schedule(2, m)[comm.rank]

    def tp_step():
        out = mlp(Tensor(X, requires_grad=True))
        (out * out).sum().backward()

    def pp_step():
        for c in chunks:
            c.zero_grad()
        pipeline_step(comm, chunks, steps, inputs, targets, lambda o, t: cross_entropy(o[:, :5], t) * (len(t) / rows))

    times = best_times(comm, [tp_step, pp_step], reps, trials)
    sent = []
    for op in (tp_step, pp_step):
        comm.barrier()
        before = read_nic_bytes(nics) if nics and comm.rank == 0 else None
        comm.barrier()
        op()
        comm.barrier()
        sent.append([a[0] - b[0] for a, b in zip(read_nic_bytes(nics), before)] if before else None)
    sizes = [8, 4096, rows * width * 8 // m, rows * width * 8 // 2, rows * width * 8]
    sweep = link_sweep(comm, sizes, 5)  # (every rank joins its barriers)
    return (*times, *sent, sweep, sizes) if comm.rank == 0 else None


width, hidden, rows, m_mb = (128, 64, 4096, 8) if not SMALL else (32, 16, 256, 4)
reps, trials = (3, 3) if not SMALL else (1, 1)
ok, why = cluster_status()
placed = {}
if ok:
    from minitorch.bench import load_report

    print(load_report())
    with EmulatedCluster(nodes=2, ppn=2, link="2gbit") as cluster:
        print(cluster.describe())
        for placement, nodes in (("inside a node", 1), ("across nodes", 2)):
            nics = [cluster.nics()[0], cluster.nics()[1 if nodes == 1 else 2]]
            placed[placement] = run(placement_job, 2, width, hidden, rows, m_mb, reps, trials, nics, engine="mpi",
                                    nodes=nodes, timeout=600).results[0]
    where = "measured on the emulated cluster"
else:
    print(f"no emulated cluster here ({why}): the simulator's two-level topology runs the job")
    for placement, nodes in (("inside a node", 1), ("across nodes", 2)):
        placed[placement] = run(placement_job, 2, width, hidden, rows, m_mb, reps, trials, nodes=nodes, alpha=5e-6,
                                beta=1e-10, alpha_inter=1e-5, beta_inter=1e-9, flop_rate=1e10).results[0]
    where = "simulated"
(t_in, p_in, _, _, sweep_in, sizes_), (t_out, p_out, nic_tp, nic_pp, sweep_out, _) = placed.values()
(a_in, b_in), (a_x, b_x) = fit_link(sizes_, sweep_in), fit_link(sizes_, sweep_out)
print(f"links: inside a node alpha {a_in * 1e6:.1f} us, {1 / b_in / 1e9:.2f} GB/s; between nodes alpha "
      f"{a_x * 1e6:.1f} us, {1 / b_x / 1e9:.2f} GB/s ({where})")
S, a_mb = rows * width * 8, rows // m_mb * width * 8
pred_tp = 2 * (ring_allreduce_time(2, S, a_x, b_x) - ring_allreduce_time(2, S, a_in, b_in))
pred_pp = (m_mb + 1) * 2 * ((a_x + a_mb * b_x) - (a_in + a_mb * b_in))
print(f"{'':>15} {'tp = 2 step':>12} {'pipeline step':>14}")
for placement, (t_tp, t_pp, *_) in placed.items():
    print(f"{placement:>15} {t_tp * 1e3:>10.2f}ms {t_pp * 1e3:>12.2f}ms")
if nic_tp is not None:
    print(f"bytes each NIC sent in one step across nodes: tp {nic_tp}, pipeline {nic_pp} (activations of {S} bytes; "
          f"micro-batches of {a_mb})")
print(f"crossing nodes adds {(t_out - t_in) * 1e3:.2f} ms to the tp step ({t_out / t_in:.2f}x; model "
      f"{pred_tp * 1e3:.2f} ms) and {(p_out - p_in) * 1e3:.2f} ms to the pipeline step ({p_out / p_in:.2f}x; model "
      f"at most {pred_pp * 1e3:.2f} ms)")

# %% [markdown]
# What to read above (the numbers move with the machine's load; the pattern does not): crossing
# nodes adds to the tensor-parallel step about what the model predicts, and to the pipeline step
# less than its bound, though its step is the longer one. The NIC counters say why the two differ:
# the one MLP of the tensor-parallel step sends two all-reduces of its activations through each NIC
# (each rank sending half and receiving half), the whole pipeline only each micro-batch's
# activation forward and its gradient back, once, at the one stage boundary. Per layer the
# tensor-parallel traffic is over twenty times the pipeline's, all of it on the critical path (the
# next layer needs the all-reduce's sum), while a pipeline's transfers can hide behind other
# micro-batches' work: split a 12-layer model by tensor parallelism across these nodes and every
# step pays twelve times the tensor-parallel figure printed above.
# This is Megatron-LM's rule (Narayanan et al. 2021b): tensor parallelism within a node, at most the
# node's size, and pipeline and data parallelism across nodes.
#
# **The planner, given the two levels.** `simulate_plan` now runs a cluster whose nodes have their own
# link on lesson 12's two-level topology, so section 8's estimates can be checked against it on a
# cluster like the one above: 4 ranks in nodes of 2 with the links just measured, the small GPT of
# section 8, a FLOP rate of 1 GFLOP/s per rank (an assumption, the order of NumPy's float64
# matmuls on one core here), and memory for three quarters of what pure data parallelism needs, so
# that the model must be split.

# %% tags=["demo"]
two_level = ClusterSpec(n_ranks=4, memory=1e12, flop_rate=1e9, alpha=a_x, beta=b_x, node_size=2, alpha_node=a_in,
                        beta_node=b_in)
two_level = ClusterSpec(**{**two_level.__dict__, "memory": 0.75 * estimate_plan(small_model, two_level, Plan(4, 1, 1, 1)).memory})
rows_ = [(plan, est, simulate_plan(small_model, two_level, plan, one_f_one_b_schedule).time)
         for plan, est in valid_plans(small_model, two_level) if plan.m <= 4]
print(f"{'(dp, tp, pp, m)':<16} {'memory KB':>10} {'estimate ms':>12} {'simulated ms':>13} {'ratio':>6}   tp group")
for plan, est, simulated in sorted(rows_, key=lambda r: r[2]):
    span = "-" if plan.tp == 1 else "inside a node" if plan.tp <= 2 else "across nodes"
    fits = "" if est.memory <= two_level.memory else "   does not fit"
    print(f"{str((plan.dp, plan.tp, plan.pp, plan.m)):<16} {est.memory / 1e3:>10.0f} {est.time * 1e3:>12.3f} "
          f"{simulated * 1e3:>13.3f} {est.time / simulated:>6.3f}   {span}{fits}")
pick, est = best_plan(small_model, two_level)
print(f"best_plan picks (dp, tp, pp, m) = {(pick.dp, pick.tp, pick.pp, pick.m)}, {est.time * 1e3:.3f} ms, "
      f"{est.memory / 1e3:.0f} KB of {two_level.memory / 1e3:.0f} KB")

# %% [markdown]
# The estimate equals the two-level simulator to the last digit for every plan without pipelining
# and stays within 0.3% with it (the test file checks both on several clusters). The planner picks
# (dp, tp, pp, m) = (2, 2, 1, 1): tensor parallelism of 2 inside each node and data parallelism of 2
# across the nodes, 82.8 ms. The same tensor parallelism stretched over both nodes, (1, 4, 1, 1),
# needs less memory but pays the network on every all-reduce (86.3 ms); pure data parallelism (84.3
# ms) does not fit the memory, and every plan with pipelining is slower here, where a step has only
# four micro-batches at most to fill the bubble. The margins are small because this small GPT's
# activations are small next to its arithmetic at 1 GFLOP/s; make the network slower
# (`alpha=..., beta=...` of the ClusterSpec) or the FLOP rate higher and the gap between keeping
# tensor parallelism inside the node and not grows.

# %% [markdown]
# ## Summary
#
# - Placement, measured on an emulated cluster of 2 nodes: the same tensor-parallel MLP step took
#   1.9x as long with its two ranks on two nodes as on one (32 ms more, the model's 32 ms), a
#   12-layer pipeline step 1.25x; per layer, tensor parallelism sent 24x the pipeline's bytes
#   through each NIC. Tensor parallelism stays inside the node.
# - A pipeline schedule is data: per stage, an order of forwards and backwards. Simulated with
#   unit costs, GPipe and 1F1B both lose `(p-1)/(m+p-1)` of the time to the bubble; 1F1B keeps at
#   most p micro-batches' activations instead of m. Interleaving v chunks per rank divides the
#   bubble by about v for more messages and somewhat more memory, and Megatron's longer warm-up
#   hides communication latency.
# - Executing a schedule needs only send and recv: tags that name micro-batch, chunk and
#   direction, buffered sends, and a valid order, and it cannot deadlock. Gradients accumulate
#   over micro-batches; the result equals one process to rounding, the tied embedding included.
# - Tensor parallelism cuts the MLP's first matrix by columns and the second by rows, attention
#   by heads: one all-reduce forward and one backward per sub-layer (f and g), the bias added
#   once, the widths divisible by the rank count.
# - Ring attention passes K and V around a ring and merges partial attentions with the online
#   softmax; its backward sends the K/V gradients around with them. Memory per rank falls from
#   `(N n)^2` to `n^2` scores.
# - A planner built from these counts (FLOPs, bytes, alpha-beta) matches the simulator within a
#   few per cent, and rediscovers the rule: tensor parallelism inside a node, pipelines across
#   nodes, data parallelism for the rest.
#
# **Sources.** Y. Huang et al., *GPipe: efficient training of giant neural networks using
# pipeline parallelism*, NeurIPS 2019. D. Narayanan et al., *PipeDream: generalized pipeline
# parallelism for DNN training*, SOSP 2019. D. Narayanan, A. Phanishayee, K. Shi, X. Chen,
# M. Zaharia, *Memory-efficient pipeline-parallel DNN training*, ICML 2021 (2021a: PipeDream-2BW
# and PipeDream-Flush, i.e. 1F1B). D. Narayanan et al., *Efficient large-scale language model
# training on GPU clusters using Megatron-LM*, SC 2021 (2021b: the interleaved schedule, the
# FLOP count, and how to combine tensor, pipeline and data parallelism). M. Shoeybi et al.,
# *Megatron-LM: training multi-billion parameter language models using model parallelism*,
# arXiv:1909.08053, 2019. V. Korthikanti et al., *Reducing activation recomputation in large
# transformer models*, MLSys 2023 (arXiv 2022; activation memory, sequence parallelism).
# H. Liu, M. Zaharia, P. Abbeel, *Ring attention with blockwise transformers for near-infinite
# context*, arXiv:2310.01889, 2023 (ICLR 2024). W. Brandon et al., *Striped attention: faster ring
# attention for causal transformers*, arXiv:2311.09431, 2023. T. Dao et al., *FlashAttention*,
# NeurIPS 2022. P. Qi, X. Wan, G. Huang, M. Lin, *Zero bubble (almost) pipeline parallelism*,
# ICLR 2024 (arXiv:2401.10241). M. Milakov, N. Gimelshein, *Online normalizer calculation for softmax*,
# arXiv:1805.02867, 2018. N. Tazi et al., *The ultra-scale playbook: training LLMs on GPU
# clusters*, Hugging Face, 2025 (and its companion code, picotron and nanotron). Hugging Face
# Transformers documentation, *Model parallelism*.


# %%
#| export
#| given
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
