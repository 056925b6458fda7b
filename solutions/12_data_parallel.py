# %% [markdown]
# # Lesson 12: data parallelism
#
# Training a large model on one chip takes too long, and its weights, gradients and optimizer
# state may not even fit in the chip's memory. *Data parallelism* answers the first problem and
# is still the backbone of every large run: each of N workers (*ranks*) holds the model, takes
# 1/N of the batch and computes its gradient, and the ranks sum their gradients before every
# step. The arithmetic is that of one big batch; what is new is *communication*, and this
# lesson is about doing it well and measuring it. Sharding the model states over the ranks
# (ZeRO) and recomputing activations (checkpointing) then attack the second problem.
#
# You build, on top of two primitives (`send` and `recv`):
#
# 1. **Collectives.** All-reduce the naive way (everyone sends to rank 0, which sends the sum
#    back) and the ring way (reduce-scatter, then all-gather), whose per-rank traffic does not
#    grow with the number of ranks (Patarasuk and Yuan 2009; NCCL's ring, Horovod's ring).
# 2. **A cost model.** The alpha-beta model (Hockney 1994): a message of n bytes costs
#    `alpha + n * beta`. Predict each collective's time and bytes, check the predictions against
#    the simulator's clock and counters, and see where latency and where bandwidth dominate.
# 3. **Data-parallel training** of lesson 03's MLP, equal to single-process training to 1e-12.
# 4. **Gradient bucketing and overlap**: start all-reducing the last layers' gradients while the
#    backward pass is still computing the first layers', as PyTorch's DistributedDataParallel
#    does (Li et al. 2020), and see it on the timeline.
# 5. **ZeRO** (Rajbhandari et al. 2020): shard the optimizer state, then the gradients, then the
#    parameters over the ranks, and measure the memory per rank against the paper's formulas.
# 6. **Activation checkpointing** (Chen et al. 2016): keep only a few activations, recompute the
#    rest in the backward pass; measure peak memory with and without.
# 7. **Beyond one node** (section 8): two links, measured on a cluster emulated on this machine
#    (Linux, root; elsewhere the simulator's two-level topology), and the hierarchical all-reduce
#    that uses every NIC at once on an Nth of the data (NCCL's and Horovod's scheme).
#
# **Two engines, one code.** Everything you write takes a communicator `comm` and runs
# unchanged on two engines:
#
# - `engine="sim"`: all ranks are threads of this Python process, and time is *simulated* with
#   the alpha-beta model. Every message is counted, every rank has a clock, the run produces a
#   timeline you can plot, and a deadlock is reported (who waits for whom) instead of hanging.
#   This is where you develop and where the tests look at structure.
# - `engine="mpi"`: N real processes started by `mpiexec` (MPICH, installed from PyPI by
#   `make setup`) talking through MPI with mpi4py (Dalcin et al. 2011), the way HPC codes and
#   the MPI backend of `torch.distributed` run. The tests run your collectives and training
#   here too and check that the two engines agree bit for bit.
#
# The communicator, both engines and the runner are given: they are `minitorch/comm.py`,
# imported right below (read it once). The course's reference version of what you write is
# `minitorch/parallel.py`; lesson 13
# (pipeline and tensor parallelism) builds on both. Real interconnects, and what alpha and beta
# are on each: [interconnects](../hardware_notes/interconnects.md). The memory an optimizer
# costs: [optimizer memory](../hardware_notes/optimizer_memory.md).
#
# Conventions: messages are NumPy arrays. Training runs in float64 so that "equal to
# single-process training" can be checked to 1e-12; the collectives take any numeric dtype.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %%
#| default_exp parallel
#| export
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

# %% [markdown]
# ## 0. The communicator
#
# A *rank* is one worker; `comm.rank` is its number, `comm.size` the number of ranks. The whole
# interface is:
#
# | call | does |
# |---|---|
# | `comm.send(array, dst, tag=0)` | send a copy of `array` to rank `dst`; returns at once (the copy is buffered) |
# | `comm.recv(src, tag=0)` | wait for the oldest message from rank `src` with this tag; returns the array |
# | `comm.sendrecv(array, dst, src)` | `send` then `recv`, and may wait until `dst` has the message: one step of a ring |
# | `comm.isend(array, dst, tag=0)`, `comm.irecv(out, src, tag=0)` | start a send from `array` itself, a receive into `out` (you allocate it: the message's dtype and size); each returns a request. An isend is received by an irecv only, a send by a recv only (lesson 16's all-to-all) |
# | `comm.waitall(requests)` | wait until every request in the list has completed (`request.wait()` for one); only then may `array` change and `out` be read. The simulator completes an isend once its receiver has posted the irecv: post your receives before you wait for your sends |
# | `comm.barrier()` | wait until every rank gets here |
# | `comm.compute(seconds=..., flops=..., kind="F")` | account for local work (simulator: advances this rank's clock) |
# | `comm.launch(fn, *args)` | run `fn(comm, *args)` on the communication stream; `.wait()` gives its result (section 5) |
# | `comm.time` | this rank's clock |
# | `comm.stats` | this rank's counters so far: `bytes_sent`, `bytes_recv`, `msgs_sent`, `msgs_recv`, `sent_to`, `recv_from` |
# | `comm.group(ranks)` | those ranks as a communicator of their own (lesson 13's process groups) |
#
# and `run(fn, nranks, *args, engine="sim" | "mpi", alpha=..., beta=...)` runs `fn(comm, *args)`
# on every rank and returns a `RunResult`: `results[r]` is what rank r returned, `stats[r]` its
# counters (`bytes_sent`, `bytes_recv`, `msgs_sent`, per-peer `sent_to`, ...), `timeline` every
# event, `time` when the last rank finished, and `.plot()` draws the timeline.
#
# Two choices make the code below simple and the runs reproducible:
#
# - **Sends never block.** `send` copies the array and returns (MPI's *buffered* mode; the MPI
#   engine uses `MPI_Isend` on a private copy). So "everyone sends to the right, then receives
#   from the left" cannot deadlock; only a `recv` that no `send` will ever match can. `sendrecv`
#   is the exception, as `MPI_Sendrecv` is: it may wait until `dst` has received its message (the
#   simulator always waits; the MPI engine does for a large array, which it sends without copying
#   it). In a ring step the right neighbour receives it in its own `sendrecv`: no wait.
# - **Messages are matched by (source, tag), oldest first** (MPI's non-overtaking rule), and
#   there is no "receive from anyone". Every run of the simulator is therefore deterministic,
#   whatever the thread scheduling: the same results, counters and clock, every time.
#
# **The simulated clock.** Each rank has a clock; `compute` advances it. A message of n bytes
# occupies the sender's outgoing port, then the receiver's incoming port, for
# `alpha + n * beta` seconds each (full duplex: a rank can send and receive at the same time,
# one message at a time in each direction). `alpha` is the latency (software overhead, switch
# hops, the speed of light), `beta` the inverse bandwidth. A send starts when the sender's port
# is free; a receive completes when the data has arrived and the receiver's port has taken it
# in, serving receives in the order the rank posts them. Time a rank spends waiting is recorded
# as `idle`. This is the model used to analyse MPI's collectives (Thakur, Rabenseifner and Gropp
# 2005), without their per-byte reduction cost.
#
# **Deadlocks.** When every rank still running waits for a message that nobody can send (or for
# a rank that has already returned), the simulator raises `DeadlockError` listing what each
# rank waits for and the messages that were sent but not received (usually: a wrong peer or
# tag). Messages left unreceived when the run ends raise `UnreceivedMessageError`. A rank that
# never returns (a `while` loop whose condition never changes) is stopped at the run's time
# limit, 10 s on the simulator (more on a slow machine; the tests' runs take well under a
# second), and `RunTimeoutError` names each rank still running and the line it was at.
# Under MPI the launcher watches the ranks: when every rank still running waits and no message
# is in flight to any of them (or a rank waits for one that has returned), it kills the job and
# raises the same `DeadlockError`, naming each rank, what it waits for and the line of your code;
# a rank that never returns is killed at the launch's time limit (120 s unless you pass
# `timeout=`), and one Ctrl-C stops the whole job.

# %%
#| export comm
#| given
"""minitorch.comm: one Communicator interface, two engines, one runner.

Given in lesson 12 (not an exercise); lesson 13 builds on it.

    result = run(fn, nranks, *args, engine="sim" | "mpi", alpha=..., beta=..., flop_rate=...)

runs `fn(comm, *args)` once per rank and returns a `RunResult`: the per-rank return values, the
per-rank counters (bytes and messages sent and received, per peer) and the timeline (one `Event`
per send, recv, idle wait, barrier and compute interval), which `RunResult.plot()` draws as a
Gantt chart.

The communicator (`Communicator`, what `fn` receives):
    comm.rank, comm.size
    comm.send(array, dst, tag=0)        buffered: copies `array` and returns at once
    comm.recv(src, tag=0) -> ndarray    blocks until the oldest message from src with this tag
    comm.sendrecv(array, dst, src, tag=0, recvtag=None) -> ndarray
    comm.isend(array, dst, tag=0) -> Request    sends from `array` itself (leave it alone until done)
    comm.irecv(out, src, tag=0) -> Request      receives into `out` (same dtype and size as the message)
    comm.waitall(requests)              completes isend/irecv requests (request.wait(): one of them)
    comm.barrier()
    comm.compute(seconds=None, *, flops=None, kind="compute", label="")
                                        simulated: advance this rank's clock; MPI: nothing
    comm.launch(fn, *args) -> Work      run fn(comm, *args) on the communication stream;
                                        Work.wait() returns its result (overlap, lesson 12.5)
    comm.time                           this rank's clock (simulated seconds or wall seconds)
    comm.stats                          this rank's counters so far (bytes_sent, msgs_sent, sent_to...)
    comm.group(ranks) -> SubComm        the ranks `ranks` as a communicator of their own

Messages are matched by (source, tag) in the order they were sent (MPI's non-overtaking rule);
there is no wildcard source, so every run is deterministic. isend/irecv messages carry no header
(the receiver names dtype and size, as in MPI and NCCL): they travel apart from send/recv's, so an
isend is received by an irecv only, a send by a recv only. Every request must be completed before
the rank returns.

Engine "sim": every rank is a thread of this process. Time is simulated with the alpha-beta
(Hockney) model: a message of n bytes occupies the sender's and the receiver's port for
alpha + n * beta seconds; a send starts when the sender's port is free; a receive completes when
the message has arrived and the receiver's port has had time to take it in, receives being served
in the order the receiver posts them. Compute advances a rank's clock by seconds, or flops /
flop_rate. A deadlock (every running rank waits for a message nobody will send, or for a rank
that has finished) raises DeadlockError naming who waits for whom; messages never received
raise UnreceivedMessageError when the run ends. A run that outlives its time limit (an infinite
loop in a rank) raises RunTimeoutError naming the ranks still running and the line each was at.
However a run ends (its result, a rank's exception, a deadlock, the time limit, or an exception
such as KeyboardInterrupt in the thread that called `run`), every rank's thread has been stopped
before `run` returns or raises: ranks waiting in the simulator are woken, ranks running Python
code get an exception raised in them.

Engine "mpi": `mpiexec -n N` (the mpich wheel's launcher in this virtual environment) starts N
Python processes running mpi4py; `fn` and its arguments travel by cloudpickle, so functions
written in a notebook run there too. A send/recv message is a 64-byte header (dtype, shape) and
the array's bytes: one MPI message up to 64 KiB, else the header then the data, received straight
into the returned array. isend/irecv are MPI_Isend/MPI_Irecv of the arrays' bytes on tags
tag + 2**20 (a receive checks the size it got; MPI carries no dtype, so only the simulator checks
that). Waiting ranks yield their core. The launcher reads the ranks' status files: a
deadlock (every running rank waits, nothing in flight to them; or a wait for a rank that has
returned) kills the job and raises DeadlockError naming each rank's wait and line. Every launch
has a time limit, after which mpiexec and every process under it are killed, and RunTimeoutError
names the ranks that had not returned and where they were. Any exception in the process that
called `run` (Ctrl-C) kills them too, and the ranks exit by themselves if that process dies.
"""
from __future__ import annotations

import ctypes
import linecache
import math
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from minitorch import checks as _checks
from minitorch.checks import describe

DEFAULT_ALPHA = 5e-6       # seconds per message (latency)
DEFAULT_BETA = 1e-10       # seconds per byte (1 / bandwidth): 10 GB/s
DEFAULT_FLOP_RATE = 1e11   # flop/s of one simulated rank
# Default time limits of a run, in seconds. The simulator's is scaled by the machine's measured
# slowness (course.timing.time_scale()). On the course's 2-core machine the slowest simulated run
# in lessons 12 and 13's tests takes 0.1 s, the slowest in their demos (100 MB per rank, a GPT
# pipeline) 2 to 3 s: a run still going after 10 s is stuck (and a hung rank costs a check cell
# about 10 s, against about 2 s for the passing exercise 12.2).
SIM_TIME_LIMIT = 10.0
MPI_TIME_LIMIT = 120.0
_TYPED = 2**20  # isend/irecv messages travel on tags tag + _TYPED: apart from send/recv's (tags < 2**20)


def _ranks(n: int) -> str:
    """'1 rank', '4 ranks': a run's size in a message."""
    return f"{n} rank{'s' * (n != 1)}"


class DeadlockError(RuntimeError):
    """Every rank still running waits for something that no rank will ever do."""


class UnreceivedMessageError(RuntimeError):
    """A run ended with messages that were sent but never received."""


class RunTimeoutError(TimeoutError):
    """A run did not finish within its time limit. `time_limit`: the limit in seconds (the
    course's grader treats any exception with this attribute as a test that ran past its time
    limit); `ranks`: the ranks that had not finished."""

    def __init__(self, message: str, time_limit: float | None = None, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.time_limit, self.ranks = time_limit, list(ranks)


@dataclass
class Event:
    """One interval on a rank's timeline.

    kind: "F" / "B" (forward / backward compute), "compute", "send", "recv", "idle" (waiting),
    "barrier". stream: "main", or "comm" for work started with `comm.launch`. peer, nbytes, tag
    describe a message."""
    rank: int
    kind: str
    start: float
    end: float
    stream: str = "main"
    peer: int | None = None
    nbytes: int = 0
    tag: int | None = None
    label: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Split range(n) into `parts` contiguous (lo, hi) pieces, the first n % parts of them one
    longer (np.array_split's rule). chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)].
    (Every collective calls it: its arguments are checked here, on a fast path, not by a wrapper.)"""
    if not (type(n) is int and type(parts) is int):  # noqa: E721
        n, parts = _checks.check_int("chunk_bounds", "n", n), _checks.check_int("chunk_bounds", "parts", parts)
    if parts < 1 or n < 0:
        raise ValueError(f"chunk_bounds needs n >= 0 and parts >= 1, got n={n}, parts={parts}")
    q, extra = divmod(n, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + q + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _new_stats() -> dict:
    return {"bytes_sent": 0, "bytes_recv": 0, "msgs_sent": 0, "msgs_recv": 0,
            "sent_to": defaultdict(int), "recv_from": defaultdict(int), "busy": defaultdict(float)}


def _message_array(array: Any, rank: int, copy: bool = True) -> np.ndarray:
    """`array` as a C-contiguous array (a private copy unless copy=False), or a clear TypeError."""
    if type(array) is np.ndarray and not copy and array.flags.c_contiguous and array.dtype.kind in "biufc":  # noqa: E721
        return array  # the fast path of the MPI engine's send
    if hasattr(array, "numpy") and not isinstance(array, np.ndarray):
        raise TypeError(f"rank {rank}: send() takes a NumPy array, got a {type(array).__name__}; "
                        "send t.numpy() for a Tensor")
    a = np.asarray(array) if array is not None and not isinstance(array, (str, bytes)) else None
    if a is None or a.dtype.kind not in "biufc":
        raise TypeError(f"rank {rank}: send()'s array must be a numeric NumPy array, got {describe(array)}")
    return np.array(a, copy=True, order="C") if copy else np.asarray(a, order="C")


class Work:
    """Handle of `comm.launch(...)`: `wait()` returns the launched function's result, and (in the
    simulator) makes the main stream wait until the communication stream has finished it."""

    def __init__(self, comm: Communicator, result: Any, done: float):
        self._comm, self.result, self.done = comm, result, done

    def wait(self) -> Any:
        self._comm._join_stream(self.done)
        return self.result


class Request:
    """Handle of `comm.isend(...)` / `comm.irecv(...)`. `wait()` completes it (as
    `comm.waitall([request])`); `done` says whether it has. An irecv's data is in `out` once done.
    kind: "isend" or "irecv"; peer: the other rank (of the engine's communicator); tag: the tag."""

    __slots__ = ("comm", "kind", "peer", "tag", "out", "_req", "_t", "_msg")

    def __init__(self, comm: Communicator, kind: str, peer: int, tag: int, out: Any, req: Any = True, t: float = 0.0):
        self.comm, self.kind, self.peer, self.tag, self.out, self._req, self._t = comm, kind, peer, tag, out, req, t

    @property
    def done(self) -> bool:
        return self._req is None

    def wait(self) -> None:
        """Until this request completes."""
        self.comm.waitall([self])

    def __repr__(self) -> str:
        what = "dst" if self.kind == "isend" else "src"
        return f"<Request {self.kind}({what}={self.peer}, tag={self.tag}){' done' if self.done else ''}>"


_new_request = object.__new__
_ndarray = np.ndarray
_clock = time.perf_counter


def _irecv_buffer(out: Any, rank: int) -> np.ndarray:
    """`out` if it can take an irecv's data (a writable C-contiguous numeric ndarray), else a clear
    TypeError or ValueError naming what it is."""
    if isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable and out.dtype.kind in "biufc":
        return out
    if not isinstance(out, np.ndarray):
        raise TypeError(f"rank {rank}: irecv() receives into out, a NumPy array (allocate it with np.empty), "
                        f"got {describe(out)}")
    if out.dtype.kind not in "biufc":
        raise TypeError(f"rank {rank}: irecv() receives into out, a numeric array, got dtype {out.dtype}")
    if not out.flags.writeable:
        raise ValueError(f"rank {rank}: irecv() needs a writable array, got a read-only one of shape {out.shape}")
    raise ValueError(f"rank {rank}: irecv() receives into a C-contiguous array (a block of rows, a[i:j]), got a "
                     f"non-contiguous one of shape {out.shape}, strides {out.strides}")


def _requests(comm: Communicator, requests: Any) -> list[Request]:
    """`requests` as a list of this engine's Requests, or a clear TypeError / ValueError."""
    if isinstance(requests, Request):
        raise TypeError(f"rank {comm.rank}: waitall() takes a list of requests; for one, call request.wait()")
    try:
        reqs = list(requests)
    except TypeError:
        raise TypeError(f"rank {comm.rank}: waitall() takes a list of requests (from isend/irecv), got a "
                        f"{type(requests).__name__}") from None
    for q in reqs:
        if type(q) is not Request:  # noqa: E721
            raise TypeError(f"rank {comm.rank}: waitall() takes requests returned by isend/irecv, got {q!r:.80} "
                            f"(of type {type(q).__name__})")
        if q.comm is not comm:
            raise ValueError(f"rank {comm.rank}: {q!r} belongs to another rank's communicator")
    return reqs


def _irecv_mismatch(rank: int, src: int, tag: int, out: np.ndarray, sent: str,
                    rule: str = "the size must agree") -> ValueError:
    """The error for an isend message that does not fit its irecv's array `out`; sent: what came."""
    return ValueError(f"rank {rank}: irecv(src={src}, tag={tag}) into shape {out.shape}, dtype {out.dtype} "
                      f"({out.nbytes} bytes), but rank {src} sent {sent} with isend: {rule}")


def _tag_label(tag: int) -> str:
    """How reports name a message's (engine) tag: isend's tags are tag + _TYPED."""
    return f"tag {tag - _TYPED} (isend: receive it with irecv)" if tag >= _TYPED else f"tag {tag}"


def _open_requests_error(rank: int, n: int) -> RuntimeError:
    return RuntimeError(f"rank {rank} returned with {n} isend/irecv request(s) not completed: pass every "
                        "request to comm.waitall (or call request.wait()) before returning")


class Communicator:
    """The interface every engine implements. See the module docstring for the contract."""

    rank: int
    size: int
    engine: str = "?"

    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> None:
        """Send a copy of `array` to rank `dst`; returns at once (the copy is buffered)."""
        raise NotImplementedError

    def recv(self, src: int, tag: int = 0) -> np.ndarray:
        """The oldest not yet received message from rank `src` with `tag` (blocks until it arrives)."""
        raise NotImplementedError

    def sendrecv(self, array: np.ndarray, dst: int, src: int, tag: int = 0, recvtag: int | None = None) -> np.ndarray:
        """send(array, dst, tag), then recv(src, recvtag or tag): one step of a ring or a shift. May
        return only once rank dst has received the message (the simulator always waits for that)."""
        self._check_rank(src, "src")  # the receive's rank and tag, before anything is sent
        self._check_tag(tag if recvtag is None else recvtag)
        self.send(array, dst, tag)
        return self.recv(src, tag if recvtag is None else recvtag)

    def isend(self, array: np.ndarray, dst: int, tag: int = 0) -> Request:
        """Start sending `array` (any shape, numeric) to rank `dst`, from where it is: leave `array`
        unchanged until the request completes. Received by an irecv only."""
        raise NotImplementedError

    def irecv(self, out: np.ndarray, src: int, tag: int = 0) -> Request:
        """Start receiving the next isend message from rank `src` with `tag` into `out` (a writable
        C-contiguous array of the message's dtype and size; its shape may differ)."""
        raise NotImplementedError

    def waitall(self, requests: list[Request]) -> None:
        """Until every request in `requests` (a list, in any order) has completed."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def compute(self, seconds: float | None = None, *, flops: float | None = None, kind: str = "compute",
                label: str = "") -> None:
        """Account for local work (simulated engine: advances this rank's clock)."""

    def launch(self, fn: Callable, *args: Any, **kwargs: Any) -> Work:
        """Run fn(self, *args, **kwargs) on the communication stream; returns a Work."""
        raise NotImplementedError

    @property
    def time(self) -> float:
        raise NotImplementedError

    def _join_stream(self, done: float) -> None:
        pass

    def _check_rank(self, peer: Any, what: str) -> int:
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: {what}={peer!r} is not a rank of this communicator "
                             f"(ranks are 0..{self.size - 1})")
        return int(peer)

    def _check_tag(self, tag: Any) -> int:
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < 2**20:
            raise ValueError(f"rank {self.rank}: tag must be an int in [0, 2**20), got {tag!r}")
        return int(tag)

    def group(self, ranks: list[int]) -> SubComm:
        """The ranks `ranks` (of this communicator) as a communicator of their own, numbered
        0..len(ranks)-1 in the order given (a process group: tensor-parallel ranks, a pipeline
        stage's neighbours...). Call it on the member ranks only."""
        return SubComm(self, ranks)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"


class SubComm(Communicator):
    """A group of a parent communicator's ranks: rank i of the group is parent rank ranks[i].

    Messages travel through the parent with the same tags, so two groups that share a pair of
    ranks and are used at the same time must use different tags. Clock, timeline, streams and
    counters are the parent's (counters keep the parent's rank numbers)."""

    def __init__(self, parent: Communicator, ranks: list[int]):
        ranks = [parent._check_rank(r, "group member") for r in ranks]
        if len(set(ranks)) != len(ranks) or parent.rank not in ranks:
            raise ValueError(f"rank {parent.rank}: group({ranks}) needs distinct ranks including this one")
        self.parent, self.ranks = parent, ranks
        self.rank, self.size, self.engine = ranks.index(parent.rank), len(ranks), parent.engine

    @property
    def stats(self) -> dict:
        return self.parent.stats

    @property
    def time(self) -> float:
        return self.parent.time

    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> None:
        self.parent.send(array, self.ranks[self._check_rank(dst, "dst")], tag)

    def recv(self, src: int, tag: int = 0) -> np.ndarray:
        return self.parent.recv(self.ranks[self._check_rank(src, "src")], tag)

    def sendrecv(self, array: np.ndarray, dst: int, src: int, tag: int = 0, recvtag: int | None = None) -> np.ndarray:
        return self.parent.sendrecv(array, self.ranks[self._check_rank(dst, "dst")],
                                    self.ranks[self._check_rank(src, "src")], tag, recvtag)

    def isend(self, array: np.ndarray, dst: int, tag: int = 0) -> Request:
        return self.parent.isend(array, self.ranks[self._check_rank(dst, "dst")], tag)

    def irecv(self, out: np.ndarray, src: int, tag: int = 0) -> Request:
        return self.parent.irecv(out, self.ranks[self._check_rank(src, "src")], tag)

    def waitall(self, requests: list[Request]) -> None:
        self.parent.waitall(requests)

    def barrier(self) -> None:
        """Every member sends an empty message to member 0, which answers each of them."""
        token = np.zeros(0, np.uint8)
        if self.rank == 0:
            for r in range(1, self.size):
                self.recv(r, tag=2**20 - 1)
            for r in range(1, self.size):
                self.send(token, r, tag=2**20 - 1)
        else:
            self.send(token, 0, tag=2**20 - 1)
            self.recv(0, tag=2**20 - 1)

    def compute(self, seconds: float | None = None, *, flops: float | None = None, kind: str = "compute",
                label: str = "") -> None:
        self.parent.compute(seconds, flops=flops, kind=kind, label=label)

    def launch(self, fn: Callable, *args: Any, **kwargs: Any) -> Work:
        work = self.parent.launch(lambda _parent: fn(self, *args, **kwargs))
        return Work(self, work.result, work.done)

    def _join_stream(self, done: float) -> None:
        self.parent._join_stream(done)

# %%
#| export comm
#| given
@dataclass
class _Message:
    data: np.ndarray
    ready: float      # simulated time at which the sender finished pushing it onto the wire
    src: int
    tag: int
    taken: bool = False  # received (a sendrecv waits for it)
    seq: int = 0         # its place among the messages src sent dst with this tag (irecv matching)


class _Aborted(BaseException):
    """Raised in a rank's thread when another rank failed or the run was stopped: unwinds it
    quietly (a BaseException, so that `except Exception` in a rank does not swallow it)."""


class _SimWorld:
    """State shared by the ranks of one simulated run; every access holds `cond`. With nodes > 1 the
    ranks sit on `nodes` nodes of size / nodes ranks each, in order (rank r on node r // ppn), and a
    message between nodes costs alpha_inter + n * beta_inter instead of alpha + n * beta."""

    def __init__(self, size: int, alpha: float, beta: float, flop_rate: float, nodes: int = 1,
                 alpha_inter: float | None = None, beta_inter: float | None = None):
        self.size, self.alpha, self.beta, self.flop_rate = size, alpha, beta, flop_rate
        self.nodes, self.ppn = nodes, size // nodes
        self.alpha_inter = alpha if alpha_inter is None else alpha_inter
        self.beta_inter = beta if beta_inter is None else beta_inter
        self.cond = threading.Condition()
        self.mail: dict[tuple[int, int, int], deque[_Message]] = defaultdict(deque)  # (src, dst, tag)
        self.sent: dict[tuple[int, int, int], int] = defaultdict(int)    # messages ever sent, per (src, dst, tag)
        self.posted: dict[tuple[int, int, int], int] = defaultdict(int)  # irecvs ever posted, per (src, dst, tag)
        self.waiting: dict[int, tuple[str, Callable[[], bool], Callable[[], set[int]]]] = {}
        self.finished: set[int] = set()
        self.failure: tuple[int, BaseException] | None = None
        self.stopped = False  # set by the runner when the run ends: every rank must unwind
        self.barrier_arrived: dict[int, float] = {}
        self.barrier_done: list[float] = []

    def pending_report(self) -> list[str]:
        lines = []
        for (src, dst, tag), q in sorted(self.mail.items()):
            if q:
                nbytes = sum(m.data.nbytes for m in q)
                lines.append(f"rank {src} -> rank {dst}, {_tag_label(tag)}: {len(q)} message(s), {nbytes} bytes")
        return lines


class SimComm(Communicator):
    """A rank of a simulated run (see the module docstring for the clock model)."""

    engine = "sim"

    def __init__(self, rank: int, world: _SimWorld):
        if not 0 <= rank < world.size:
            raise ValueError(f"SimComm: rank must be in [0, {world.size}) (the world's size), got {rank}")
        self.rank, self.size, self._w = rank, world.size, world
        self.alpha, self.beta, self.flop_rate = world.alpha, world.beta, world.flop_rate
        node = rank // world.ppn  # (alpha, beta) of the link to each peer: the node's, or the network's
        self._links = [(world.alpha, world.beta) if peer // world.ppn == node else (world.alpha_inter, world.beta_inter)
                       for peer in range(world.size)]
        self._clock = {"main": 0.0, "comm": 0.0}
        self._stream = "main"
        self._out_free = 0.0   # when this rank's outgoing port is free again
        self._in_free = 0.0    # when its incoming port is free again
        self.stats = _new_stats()
        self.events: list[Event] = []
        self._posted: dict[tuple[int, int], deque[Request]] = defaultdict(deque)  # irecvs not done, per (src, tag)
        self._open = 0   # isend/irecv requests not completed
        self._posts = 0  # irecvs posted so far

    # -- clock and timeline
    @property
    def time(self) -> float:
        return self._clock[self._stream]

    def _event(self, kind: str, start: float, end: float, **info: Any) -> None:
        self.events.append(Event(self.rank, kind, start, end, self._stream, **info))
        self.stats["busy"][kind] += end - start

    def _advance(self, t: float, kind: str = "idle", **info: Any) -> None:
        now = self._clock[self._stream]
        if t > now:
            self._event(kind, now, t, **info)
            self._clock[self._stream] = t

    def compute(self, seconds: float | None = None, *, flops: float | None = None, kind: str = "compute",
                label: str = "") -> None:
        if (seconds is None) == (flops is None):
            raise ValueError(f"rank {self.rank}: compute() takes seconds or flops (one of them), "
                             f"got seconds={seconds}, flops={flops}")
        dt = float(seconds) if seconds is not None else float(flops) / self.flop_rate
        if not dt >= 0:
            raise ValueError(f"rank {self.rank}: compute time must be >= 0, got {dt}")
        self._check_abort()
        now = self._clock[self._stream]
        self._event(kind, now, now + dt, label=label)
        self._clock[self._stream] = now + dt

    # -- point to point
    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> None:
        self._post(array, dst, tag)

    def _post(self, array: np.ndarray, dst: int, tag: int, typed: bool = False) -> _Message:
        """send's work (isend's: typed=True); returns the message, so that sendrecv can wait until it is
        received."""
        dst, tag = self._check_rank(dst, "dst"), self._check_tag(tag)
        data = _message_array(array, self.rank)
        alpha, beta = self._links[dst]
        cost = alpha + data.nbytes * beta
        start = max(self._clock[self._stream], self._out_free)
        self._advance(start, "idle", label="send port busy")
        self._event("send", start, start + cost, peer=dst, nbytes=data.nbytes, tag=tag)
        self._clock[self._stream] = self._out_free = start + cost
        st = self.stats
        st["bytes_sent"] += data.nbytes
        st["msgs_sent"] += 1
        st["sent_to"][dst] += data.nbytes
        w = self._w
        key = (self.rank, dst, tag + _TYPED if typed else tag)
        with w.cond:
            self._check_abort()
            msg = _Message(data, start + cost, self.rank, tag, seq=w.sent[key])
            w.sent[key] += 1
            w.mail[key].append(msg)
            w.cond.notify_all()
        return msg

    def sendrecv(self, array: np.ndarray, dst: int, src: int, tag: int = 0, recvtag: int | None = None) -> np.ndarray:
        """send then recv, returning only once rank dst has received this rank's message. MPI's
        sendrecv may wait for its receiver (the MPI engine does for an array over its inline limit,
        which it sends without a copy), so the simulator always waits: a program that relies on
        sendrecv returning first fails here, at every size, with a deadlock report."""
        self._check_rank(src, "src")  # the receive's rank and tag, before anything is sent
        self._check_tag(tag if recvtag is None else recvtag)
        msg = self._post(array, dst, tag)
        got = self.recv(src, tag if recvtag is None else recvtag)
        self._block(f"sendrecv(dst={dst}, tag={tag}) until rank {dst} receives its message", lambda: msg.taken,
                    lambda: {dst})
        return got

    def recv(self, src: int, tag: int = 0) -> np.ndarray:
        src, tag = self._check_rank(src, "src"), self._check_tag(tag)
        return self._arrive(self._take((src, self.rank, tag), f"recv(src={src}, tag={tag})"), src, tag)

    def _take(self, key: tuple[int, int, int], what: str) -> _Message:
        """The oldest message in mailbox `key` (src, dst, tag), once there is one; marks it taken."""
        w = self._w
        with w.cond:
            box = w.mail[key]
        self._block(what, lambda: bool(box), lambda: {key[0]})
        with w.cond:
            msg = box.popleft()
            msg.taken = True
            w.cond.notify_all()  # a sendrecv or an isend's wait may wait for this
        return msg

    def _arrive(self, msg: _Message, src: int, tag: int) -> np.ndarray:
        """Receive `msg` on the clock (the port model), record it; returns its data."""
        n = msg.data.nbytes
        alpha, beta = self._links[src]
        cost = alpha + n * beta
        arrived = max(msg.ready, self._in_free + cost)  # the receiving port serves one message at a time
        self._in_free = arrived
        now = self._clock[self._stream]
        start = max(now, arrived - cost)
        self._advance(start, "idle", peer=src, label="waiting for data")
        self._event("recv", start, max(start, arrived), peer=src, nbytes=n, tag=tag)
        self._clock[self._stream] = max(start, arrived)
        st = self.stats
        st["bytes_recv"] += n
        st["msgs_recv"] += 1
        st["recv_from"][src] += n
        return msg.data

    def isend(self, array: np.ndarray, dst: int, tag: int = 0) -> Request:
        """As send (the simulator copies the array and charges the sender's port at once); the request
        completes when rank dst has posted the irecv that matches it."""
        msg = self._post(array, dst, tag, typed=True)
        req = Request(self, "isend", int(dst), int(tag), array)  # (array: checked unchanged at completion)
        req._msg = msg  # (its _req: True until it completes, then None)
        self._open += 1
        return req

    def irecv(self, out: np.ndarray, src: int, tag: int = 0) -> Request:
        src, tag = self._check_rank(src, "src"), self._check_tag(tag)
        out = _irecv_buffer(out, self.rank)
        for other in (q for queue in self._posted.values() for q in queue):
            if np.may_share_memory(out, other.out):
                raise ValueError(f"rank {self.rank}: irecv(src={src}, tag={tag}) into shape {out.shape} overlaps the "
                                 f"array of {other!r}, which has not completed: give every irecv rows of its own")
        self._posts += 1
        req = Request(self, "irecv", src, tag, out, t=self._posts)  # (_t: its posting number)
        self._posted[(src, tag)].append(req)
        self._open += 1
        w = self._w
        with w.cond:
            w.posted[(src, self.rank, tag + _TYPED)] += 1
            w.cond.notify_all()  # an isend's wait may wait for this
        return req

    def waitall(self, requests: list[Request]) -> None:
        """Receives first, then sends. Every irecv to complete (those listed, and the ones posted before
        them on the same source and tag: messages match receives in the order both were posted) takes
        its message; then they are received on the clock in the order the messages arrive (ready time,
        then posting order), whatever the order of the list. An isend completes once its receiver has
        posted the matching irecv; the array must be as it was when isend was called (under MPI the
        message may be read from it until then)."""
        reqs = _requests(self, requests)
        taken: list[tuple[_Message, int, Request]] = []
        try:
            for req in reqs:
                if req.kind == "irecv" and req._req is not None:
                    self._take_irecvs(req, taken)
        finally:  # (also when a message does not fit its irecv: those taken are still received)
            for msg, _, head in sorted(taken, key=lambda m: (m[0].ready, m[1])):
                head.out.reshape(-1)[:] = self._arrive(msg, head.peer, head.tag).reshape(-1)
        w = self._w
        for req in reqs:
            if req.kind == "isend" and req._req is not None:
                msg, dst, key = req._msg, req.peer, (self.rank, req.peer, req.tag + _TYPED)
                self._block(f"waitall: isend(dst={dst}, tag={req.tag}) until rank {dst} posts its irecv",
                            lambda: msg.taken or w.posted[key] > msg.seq, lambda: {dst})
                req._req = req._msg = None
                self._open -= 1
                array, req.out = req.out, None
                if np.asarray(array).tobytes() != msg.data.tobytes():
                    raise ValueError(f"rank {self.rank}: the array of isend(dst={dst}, tag={req.tag}) changed before "
                                     "the request completed: leave it alone until waitall returns (under MPI the "
                                     "message may be read from it until then)")

    def _take_irecvs(self, req: Request, taken: list) -> None:
        """Take the messages of the irecvs posted on req's (source, tag), oldest first, up to req, and
        append (message, posting number, request) to `taken`; each request is then complete."""
        src, tag = req.peer, req.tag
        posted = self._posted[(src, tag)]
        while req._req is not None:
            head = posted.popleft()
            head._req = None
            self._open -= 1
            msg = self._take((src, self.rank, tag + _TYPED), f"waitall: irecv(src={src}, tag={tag})")
            data, out = msg.data, head.out
            if data.dtype != out.dtype or data.nbytes != out.nbytes:
                raise _irecv_mismatch(self.rank, src, tag, out, f"shape {data.shape}, dtype {data.dtype} "
                                      f"({data.nbytes} bytes)", "the dtype and size must agree")
            taken.append((msg, head._t, head))

    def barrier(self) -> None:
        """All ranks leave at the latest arrival plus a dissemination barrier's ceil(log2 N) latencies."""
        w = self._w
        with w.cond:
            self._check_abort()
            generation = len(w.barrier_done)
            w.barrier_arrived[self.rank] = self._clock[self._stream]
            if len(w.barrier_arrived) == self.size:
                w.barrier_done.append(max(w.barrier_arrived.values())
                                      + math.ceil(math.log2(self.size)) * max(w.alpha, w.alpha_inter))
                w.barrier_arrived = {}
                w.cond.notify_all()
        self._block("barrier()", lambda: len(w.barrier_done) > generation,
                    lambda: set(range(self.size)) - set(w.barrier_arrived) - {self.rank})
        self._advance(w.barrier_done[generation], "barrier")

    # -- streams
    def launch(self, fn: Callable, *args: Any, **kwargs: Any) -> Work:
        if self._stream == "comm":
            return Work(self, fn(self, *args, **kwargs), self._clock["comm"])
        self._clock["comm"] = max(self._clock["comm"], self._clock["main"])
        self._stream = "comm"
        try:
            result = fn(self, *args, **kwargs)
        finally:
            self._stream = "main"
        return Work(self, result, self._clock["comm"])

    def _join_stream(self, done: float) -> None:
        if self._stream == "main":
            self._advance(done, "idle", label="waiting for communication")

    # -- blocking, deadlock detection, abort
    def _check_abort(self) -> None:
        if self._w.failure is not None or self._w.stopped:
            raise _Aborted()

    def _block(self, what: str, ready: Callable[[], bool], blockers: Callable[[], set[int]]) -> None:
        """Wait (holding nothing) until ready(); raise DeadlockError if that can never happen."""
        w = self._w
        with w.cond:
            try:
                while True:
                    self._check_abort()
                    if ready():
                        return
                    gone = blockers() & w.finished
                    if gone:
                        err = DeadlockError(
                            f"rank {self.rank} waits in {what}, but rank {min(gone)} has already finished: "
                            "what it waits for (a message, a receive, a barrier) will never happen"
                            + _pending_hint(w))
                        w.failure = w.failure or (self.rank, err)
                        w.cond.notify_all()
                        raise err
                    w.waiting[self.rank] = (what, ready, blockers)
                    running = [r for r in range(w.size) if r not in w.finished]
                    if all(r in w.waiting for r in running) and not any(w.waiting[r][1]() for r in running):
                        lines = [f"  rank {r} waits in {w.waiting[r][0]}" for r in running]
                        lines += [f"  rank {r} has finished" for r in sorted(w.finished)]
                        err = DeadlockError("deadlock: every running rank is blocked\n" + "\n".join(lines)
                                            + _cycle_hint(w, running) + _pending_hint(w))
                        w.failure = w.failure or (self.rank, err)
                        w.cond.notify_all()
                        raise err
                    w.cond.wait(timeout=0.5)
            finally:
                w.waiting.pop(self.rank, None)


def _cycle_hint(w: _SimWorld, running: list[int]) -> str:
    """'rank 0 waits for rank 1, which waits for rank 0' when the waits form a cycle."""
    nxt = {r: min(w.waiting[r][2]()) for r in running if w.waiting[r][2]()}
    for start in running:
        path, r = [start], start
        while r in nxt and nxt[r] not in path:
            r = nxt[r]
            path.append(r)
        if r in nxt and nxt[r] == start and len(path) > 1:
            return "\n  cycle: " + " -> ".join(f"rank {p}" for p in path + [start])
    return ""


def _pending_hint(w: _SimWorld) -> str:
    pending = w.pending_report()
    return ("\n  sent but not received (wrong peer or tag?):\n    " + "\n    ".join(pending)) if pending else ""

# %%
#| export comm
#| given
@dataclass
class RunResult:
    """What `run` returns. results[r]: fn's return value on rank r; stats[r]: rank r's counters
    (bytes_sent, bytes_recv, msgs_sent, msgs_recv, sent_to {peer: bytes}, recv_from {peer: bytes},
    busy {kind: seconds}, time: its final clock); timeline: every Event, ordered by start time;
    time: when the last rank finished (simulated seconds, or wall seconds under MPI); nodes: the
    nodes the ranks ran on, nranks / nodes each, in rank order (1: one machine, or one node)."""
    engine: str
    nranks: int
    results: list
    stats: list[dict]
    timeline: list[Event]
    time: float
    output: str = ""
    nodes: int = 1

    def bytes_sent(self) -> list[int]:
        return [s["bytes_sent"] for s in self.stats]

    def node_of(self, r: int) -> int:
        """The node rank r ran on (ranks fill the nodes in order: nranks / nodes per node)."""
        if not 0 <= r < self.nranks:
            raise ValueError(f"RunResult.node_of: r must be a rank in [0, {self.nranks}) (the run's ranks), got {r}")
        return r // (self.nranks // self.nodes)

    def bytes_between_nodes(self) -> list[int]:
        """Per rank, the bytes it sent to ranks on other nodes (what crossed the network; 0 on one node)."""
        return [sum(n for peer, n in s["sent_to"].items() if self.node_of(peer) != self.node_of(r))
                for r, s in enumerate(self.stats)]

    def events(self, rank: int | None = None, kind: str | None = None, stream: str | None = None) -> list[Event]:
        """The events of the timeline on rank `rank` (0..nranks-1), of `kind` (any kind a rank's
        compute(kind=...) named too) and of `stream` ("main" or "comm"); None: any."""
        if rank is not None and not 0 <= rank < self.nranks:
            raise ValueError(f"RunResult.events: rank must be in [0, {self.nranks}) (the run's ranks), got {rank}")
        return [e for e in self.timeline if (rank is None or e.rank == rank) and (kind is None or e.kind == kind)
                and (stream is None or e.stream == stream)]

    def plot(self, ax: Any = None, title: str | None = None) -> Any:
        return plot_timeline(self, ax=ax, title=title)


KIND_COLORS = {"F": "#4c72b0", "B": "#dd8452", "compute": "#8c8c8c", "send": "#55a868", "recv": "#8172b3",
               "idle": "#eeeeee", "barrier": "#c44e52"}


def plot_timeline(result: RunResult, ax: Any = None, title: str | None = None) -> Any:
    """Gantt chart: one row per rank and stream, one bar per event, coloured by kind."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sorted({(e.rank, e.stream) for e in result.timeline}, key=lambda rs: (rs[0], rs[1] != "main"))
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * max(len(rows), 2) + 1))
    scale, unit = _time_unit(result.time)
    for y, (rank, stream) in enumerate(rows):
        for kind in KIND_COLORS:
            bars = [((e.start) * scale, max(e.duration * scale, 0.0)) for e in result.timeline
                    if e.rank == rank and e.stream == stream and e.kind == kind]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=KIND_COLORS[kind],
                               edgecolors="white" if kind != "idle" else "#cccccc", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"rank {r}" + ("" if s == "main" else f" {s}") for r, s in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit}, {'simulated' if result.engine == 'sim' else 'wall clock'})")
    used = {e.kind for e in result.timeline}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items() if k in used],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title or f"{result.engine}: {_ranks(result.nranks)}")
    return ax


def _time_unit(t: float) -> tuple[float, str]:
    if t >= 1:
        return 1.0, "s"
    if t >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


# ------------------------------------------------------------------------------------ runner
def run(fn: Callable, nranks: int, *args: Any, engine: str = "sim", alpha: float = DEFAULT_ALPHA,
        beta: float = DEFAULT_BETA, flop_rate: float = DEFAULT_FLOP_RATE, timeout: float | None = None,
        nodes: int | None = None, alpha_inter: float | None = None, beta_inter: float | None = None,
        **kwargs: Any) -> RunResult:
    """Run fn(comm, *args, **kwargs) on `nranks` ranks; return a RunResult.

    engine="sim": threads of this process, simulated alpha-beta clock (alpha s/message, beta
    s/byte, flop_rate flop/s for comm.compute(flops=...)). engine="mpi": `mpiexec -n nranks`
    with mpi4py; alpha, beta, flop_rate are ignored (time is real). A rank's exception is
    re-raised here, with a note naming the rank. `timeout` seconds (wall clock) bound the whole
    run (default: SIM_TIME_LIMIT times the machine's slowness, or MPI_TIME_LIMIT); past it,
    RunTimeoutError names the ranks still running.

    nodes: the ranks sit on `nodes` nodes, nranks / nodes each, in rank order (node 0 holds ranks
    0 .. nranks/nodes - 1). On the simulator a message between two nodes costs alpha_inter + n *
    beta_inter (default: alpha, beta) and one inside a node alpha + n * beta; every rank has a link
    of its own to the network (one NIC per rank, as GPU servers have one per GPU). Under MPI the
    ranks are launched on the first `nodes` nodes of a cluster: the one the file $MINITORCH_CLUSTER
    describes, or the emulated cluster running on this machine (`course.cluster`, `make cluster`).
    None: one machine (MPI: every rank on this one)."""
    if isinstance(nranks, bool) or not isinstance(nranks, (int, np.integer)) or nranks < 1:
        raise ValueError(f"run: nranks must be a positive int, got {nranks!r}")
    if nodes is not None and nranks % nodes:
        raise ValueError(f"run: nodes must divide nranks (the same number of ranks on every node), got nodes={nodes} "
                         f"for nranks={nranks}")
    if (alpha_inter is not None or beta_inter is not None) and engine == "sim" and nodes is None:
        raise ValueError(f"run: alpha_inter and beta_inter are the links between nodes: give nodes too (got "
                         f"alpha_inter={alpha_inter}, beta_inter={beta_inter}, nodes=None)")
    if engine == "sim":
        if not (alpha >= 0 and beta >= 0 and flop_rate > 0):
            raise ValueError(f"run: need alpha >= 0, beta >= 0, flop_rate > 0; got {alpha}, {beta}, {flop_rate}")
        if timeout is None:
            timeout = round(SIM_TIME_LIMIT * _time_scale(), 1)
        return _run_sim(fn, int(nranks), args, kwargs, alpha, beta, flop_rate, timeout, nodes or 1, alpha_inter,
                        beta_inter)
    if engine == "mpi":
        return _run_mpi(fn, int(nranks), args, kwargs, MPI_TIME_LIMIT if timeout is None else timeout, nodes)
    raise ValueError(f"run: engine must be 'sim' or 'mpi', got {engine!r}")


def _time_scale() -> float:
    """How many times slower than the course's reference machine this one runs (course.timing)."""
    try:
        from course.timing import time_scale  # the grader's measure of this machine (MT_TIME_SCALE)
    except ImportError:  # minitorch without the course: no scaling
        return 1.0
    return time_scale()


def _run_sim(fn, nranks, args, kwargs, alpha, beta, flop_rate, timeout, nodes=1, alpha_inter=None,
             beta_inter=None) -> RunResult:
    world = _SimWorld(nranks, alpha, beta, flop_rate, nodes, alpha_inter, beta_inter)
    comms = [SimComm(r, world) for r in range(nranks)]
    results: list = [None] * nranks

    def body(r: int) -> None:
        try:
            try:
                results[r] = fn(comms[r], *args, **kwargs)
                if comms[r]._open:
                    raise _open_requests_error(r, comms[r]._open)
            except _Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - a rank's error is re-raised by the runner
                with world.cond:
                    world.failure = world.failure or (r, exc)
            finally:
                with world.cond:
                    world.finished.add(r)
                    world.cond.notify_all()
        except _Aborted:  # a stop request that arrived as the rank was finishing anyway
            pass

    threads = [threading.Thread(target=body, args=(r,), name=f"sim-rank-{r}", daemon=True) for r in range(nranks)]
    late: tuple[str, list[int], list[int]] | None = None  # (report, ranks not finished, those not waiting)
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        with world.cond:
            while len(world.finished) < nranks and world.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:  # note where the ranks are before they are stopped
                    alive = [r for r in range(nranks) if r not in world.finished]
                    late = (_still_running(world, threads), alive, [r for r in alive if r not in world.waiting])
                    break
                world.cond.wait(left)
    finally:  # whatever happened (even an exception in this thread): no rank thread survives the run
        stuck = _stop_ranks(world, threads)
    if late is not None:
        report, alive, busy = late
        busy = busy or alive
        who = f"rank {busy[0]}" if len(busy) == 1 else "ranks " + ", ".join(map(str, busy))
        raise RunTimeoutError(f"{who} of a simulated run with {_ranks(nranks)} did not finish within {timeout:g} s "
                              f"(an infinite loop?):\n{report}" + _stuck_note(stuck), timeout, alive)
    if world.failure is not None:
        rank, exc = world.failure
        if not isinstance(exc, DeadlockError):
            exc.add_note(f"(raised on rank {rank} of a simulated run with {_ranks(nranks)})" + _stuck_note(stuck))
        raise exc
    pending = world.pending_report()
    if pending:
        raise UnreceivedMessageError("messages sent but never received (wrong peer or tag?):\n  "
                                     + "\n  ".join(pending))
    stats = []
    for c in comms:
        s = _plain_stats(c.stats)
        s["time"] = max(c._clock.values())
        stats.append(s)
    timeline = sorted((e for c in comms for e in c.events), key=lambda e: (e.start, e.rank))
    return RunResult("sim", nranks, results, stats, timeline, max(s["time"] for s in stats), nodes=nodes)


def _stop_ranks(world: _SimWorld, threads: list[threading.Thread], patience: float = 5.0) -> list[int]:
    """End every rank thread of a run; return the ranks that could not be stopped.

    Ranks waiting in the simulator (recv, barrier) wake up and unwind (`_check_abort`). A rank
    running Python code (a `while True` loop) gets `_Aborted` raised in it asynchronously,
    again and again until its thread exits, for at most `patience` seconds: a thread inside
    compiled code only sees it when that code returns."""
    if world.cond.acquire(timeout=1.0):
        try:
            world.stopped = True
            world.cond.notify_all()
        finally:
            world.cond.release()
    else:  # the lock is stuck (a rank was stopped while it held it): the waits poll anyway
        world.stopped = True
    end = time.monotonic() + patience
    grace = time.monotonic() + 0.2  # ranks waking up from a wait need no push
    for t in threads:
        if t.ident is not None:  # started
            t.join(max(grace - time.monotonic(), 0))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    while alive and time.monotonic() < end:
        for r in alive:
            if r not in world.waiting and threads[r].ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threads[r].ident),
                                                           ctypes.py_object(_Aborted))
        for r in alive:
            threads[r].join(0.02)
        alive = [r for r in alive if threads[r].is_alive()]
    return alive


def _stuck_note(stuck: list[int]) -> str:
    if not stuck:
        return ""
    return (f"\n  rank(s) {', '.join(map(str, stuck))} could not be stopped (busy in compiled code?): "
            "their threads still run in this process; restart it if they keep the CPU busy")


def _still_running(world: _SimWorld, threads: list[threading.Thread]) -> str:
    """One line per rank that has not finished: what it waits for, or the line it is running."""
    frames = sys._current_frames()
    lines = []
    for r, t in enumerate(threads):
        if r in world.finished:
            continue
        where = _user_frame(frames.get(t.ident))
        if r in world.waiting:
            lines.append(f"  rank {r} waits in {world.waiting[r][0]}" + (f", at {where}" if where else ""))
        else:
            lines.append(f"  rank {r} is still running" + (f" at {where}" if where else ""))
    done = sorted(world.finished)
    if done:
        lines.append(f"  rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} finished")
    return "\n".join(lines)


def _engine_code() -> set:
    codes = set()
    for cls in (Communicator, SubComm, SimComm, Work, _SimWorld):
        for f in vars(cls).values():
            f = getattr(f, "fget", f)
            if hasattr(f, "__code__"):
                codes.add(f.__code__)
    return codes


_CHECKS = _checks.__file__  # the argument checks' wrappers (minitorch.checks): not the user's code


def _user_frame(frame: Any) -> str:
    """'<file>, line N in <function>: `<source line>`' for the innermost frame of `frame`'s stack
    that is not the simulator's own code or the threading module's."""
    engine = _engine_code()
    while frame is not None and (frame.f_code in engine or frame.f_code.co_filename in (threading.__file__, _CHECKS)
                                 or getattr(frame.f_code, "co_qualname", "").startswith("SubComm.")):
        frame = frame.f_back
    if frame is None or getattr(frame.f_code, "co_qualname", "") == "_run_sim.<locals>.body":
        return ""
    code = frame.f_code
    return f"{_file_label(code.co_filename)}, line {frame.f_lineno} in {code.co_name}" + (
        f": `{text}`" if (text := linecache.getline(code.co_filename, frame.f_lineno).strip()) else "")


def _file_label(filename: str) -> str:
    """A notebook cell as IPython names it in tracebacks ('Cell In[14]'), else the file name."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    try:
        name = shell.compile.format_code_name(filename) if shell is not None else None
    except Exception:  # noqa: BLE001 - only a nicer label
        name = None
    return " ".join(name) if name else filename


def _plain_stats(st: dict) -> dict:
    out = dict(st)
    for key in ("sent_to", "recv_from", "busy"):
        out[key] = dict(sorted(st[key].items()))
    return out

# %% [markdown]
# The MPI engine. `run(..., engine="mpi")` pickles `fn` and its arguments with cloudpickle (by
# value for functions defined in a notebook or a test file, which a fresh process could not
# import), starts `mpiexec -n N python -c "...minitorch.comm._mpi_worker..."` in a new session,
# and collects one result file per rank. Every rank wraps `MPI_COMM_WORLD` in an `MPIComm`,
# which costs little more than mpi4py itself:
#
# - **Typed buffers, one copy.** A message is a 64-byte header (dtype and shape) followed by the
#   array's bytes. An array up to 64 KiB travels in the same message as its header, copied once
#   (one message pays one latency, two pay two); a larger one is a second message sent straight
#   from the private copy that buffered sends need, or from the array itself in a `sendrecv`
#   (`MPI_Isend`), and received straight into the array `recv` returns (`MPI_Irecv`), so neither
#   side packs or unpacks anything. The receiver knows the header's size in advance, so it needs
#   no `MPI_Probe`. Completed sends are reaped while the rank waits (or when many are pending),
#   and their buffers reused.
# - **Waits that yield.** A rank waiting in `recv` or `barrier` tests its request in a loop that
#   gives the core away (`sched_yield`) between tests, and after 20 ms of waiting naps for half a
#   millisecond at a time. (A blocking `MPI_Probe`, which the engine's first version used, polled
#   without yielding here: with 4 ranks on 2 cores each rank spun through a whole scheduler time
#   slice before the rank with the message could run.) With more ranks than cores a rank
#   yields at its first failed test (the rank it waits for may be the one it keeps off the core);
#   otherwise it tests 20 times first, which saves a system call when the message is close.
# - **Ranks pinned to cores.** `mpiexec -bind-to core` puts rank r on core r % cores for the whole
#   run (where Hydra can bind; `mpi_status` checks). Unpinned, the scheduler moved ranks between
#   cores and sometimes put ring neighbours on one core, so the same all-reduce timed differently
#   from one launch to the next.
# - **Deadlocks found by the launcher.** A rank that has waited 0.1 s writes, to a status file of
#   the job, what it waits for (`recv(src, tag)` or `barrier()`), the line of your code it is at,
#   and how many messages it has sent to and received from each rank. The launcher reads these
#   files while it waits. When every rank still running waits, and no message is in flight on any
#   edge of the wait (the counters agree), or a rank waits for one that has returned, nothing can
#   ever move: it kills the job and raises `DeadlockError` naming every rank and what it waits
#   for, as the simulator does. A job that just runs too long is killed at its time limit, and
#   `RunTimeoutError` names the ranks that had not returned and the line each was at (a thread in
#   each rank notes it every half second; `faulthandler` dumps the stack of a rank stuck in compiled
#   code shortly before the limit).
# - **One Ctrl-C stops everything.** An interrupt (or any exception) in the process that called
#   `run` kills `mpiexec` and every process under it (hydra puts each rank in a session of its
#   own, so killing the process group would leave the ranks running); a rank whose launcher has
#   died another way (a kernel restart) notices within half a second and exits.
#
# A rank that raises aborts the job (so the others do not wait forever) and its exception is
# re-raised in the caller, with the rank's traceback attached. The launcher sets, in the ranks'
# environment only, one BLAS thread per rank, hydra's `fork` launcher (no ssh, no network) and
# glibc's malloc told to keep freed memory (`MPI_ENV`, section 2); MPICH runs more ranks than
# cores without any flag.

# %%
#| export comm
#| given
_HEADER = 64      # bytes: int64 ndim, dtype (its str, 8 bytes), 6 int64 dimensions
_INLINE = 65536   # arrays up to this many bytes travel in their header's message
_SPINS = 20       # tests of a request before a wait starts yielding the core (none when oversubscribed)
_YIELD_FOR = 0.02     # seconds of yielding before naps
_NAP = 0.0005         # seconds per nap
_STATUS_AFTER = 0.1   # seconds a rank waits before it writes a status file for the launcher
_HEADERS: dict[Any, bytes] = {}   # (dtype, shape) -> header, for the shapes a run sends
_LAYOUTS: dict[bytes, tuple] = {}  # header -> (dtype, shape, nbytes, elements)


def _header(a: np.ndarray) -> bytes:
    """The 64-byte header of `a`: int64 ndim, its dtype's str (8 bytes), 6 dimensions."""
    key = (a.dtype, a.shape)
    head = _HEADERS.get(key)
    if head is None:
        if a.ndim > 6:
            raise ValueError(f"send(): arrays of at most 6 dimensions, got shape {a.shape}")
        head = struct.pack("<q8s6q", a.ndim, a.dtype.str.encode(), *a.shape, *([0] * (6 - a.ndim)))
        if len(_HEADERS) < 4096:
            _HEADERS[key] = head
    return head


def _layout(head: bytes) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, nbytes, elements) of the array a header describes."""
    got = _LAYOUTS.get(head)
    if got is None:
        ndim, dtype, *shape = struct.unpack("<q8s6q", head)
        dtype = np.dtype(dtype.rstrip(b"\0").decode())
        shape = tuple(shape[:ndim])
        got = (dtype, shape, math.prod(shape) * dtype.itemsize, math.prod(shape))
        if len(_LAYOUTS) < 4096:
            _LAYOUTS[head] = got
    return got


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _LiveStats(Mapping):
    """An MPI rank's counters as the simulator's stats dict shows them, read from the rank's
    per-peer lists whenever a key is read (so a reference to `comm.stats` stays current)."""

    _KEYS = ("bytes_sent", "bytes_recv", "msgs_sent", "msgs_recv", "sent_to", "recv_from", "busy")

    def __init__(self, comm: MPIComm):
        self._comm = comm

    def __getitem__(self, key: str) -> Any:
        c = self._comm
        c._fold()
        if key == "bytes_sent":
            return sum(c._bytes_to)
        if key == "bytes_recv":
            return sum(c._bytes_from)
        if key == "msgs_sent":
            return sum(c._msgs_to)
        if key == "msgs_recv":
            return sum(c._msgs_from)
        if key == "sent_to":
            return {p: b for p, (b, k) in enumerate(zip(c._bytes_to, c._msgs_to)) if k}
        if key == "recv_from":
            return {p: b for p, (b, k) in enumerate(zip(c._bytes_from, c._msgs_from)) if k}
        if key == "busy":
            return {}
        raise KeyError(key)

    def __iter__(self) -> Any:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)

    def copy(self) -> dict:
        return dict(self)

    def __repr__(self) -> str:
        return repr(dict(self))


class MPIComm(Communicator):
    """A rank of a real run: mpi4py on MPI_COMM_WORLD. A send is MPI_Isend of a private copy
    (so it never blocks, as in the simulator): header and data in one message up to _INLINE
    bytes, else a header then the data. A receive posts MPI_Irecv for the header, then for the
    data straight into the array it returns, and waits without holding the core (see `_wait`).
    What each message costs in Python is kept small (the ring's small messages are bound by it):
    persistent receive requests per (source, tag), the header cached per (dtype, shape), the
    timeline recorded as tuples and turned into Events when read."""

    engine = "mpi"

    def __init__(self, mpi_comm: Any, job: Path | None = None):
        from mpi4py import MPI

        self._MPI, self._c, self._job, self._BYTE = MPI, mpi_comm, job, MPI.BYTE
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self._events: list[Event] = []
        self._raw: list[tuple] = []      # messages' intervals as plain tuples: Events when read (events)
        self._pending: deque = deque()   # (request, buffer) of sends not known to be complete
        self._spare: dict[int, list[np.ndarray]] = {}  # buffers of completed large sends, by size
        self._head = np.empty(_HEADER + _INLINE, np.uint8)  # where every header lands
        self._head_view = memoryview(self._head)[:_HEADER]  # bytes() of it: the header, a dict key
        self._recvs: dict[tuple[int, int], Any] = {}  # persistent receives into _head, by (source, tag)
        # per-peer counters, brought up to date from the timeline by _fold when read (not per message)
        self._msgs_to, self._bytes_to = [0] * self.size, [0] * self.size
        self._msgs_from, self._bytes_from = [0] * self.size, [0] * self.size
        self._folded = 0  # entries of _raw counted so far
        self._episode = 0    # waits that wrote a status file
        self._open = 0       # isend/irecv requests not completed
        self._statuses: list = []  # MPI.Status objects for waitall, reused
        # More ranks on this machine than cores: a waiting rank yields at once, since the rank it
        # waits for may be the one it keeps off the core (testing 20 times first made small
        # all-reduces slower there); otherwise a few tests first save a system call.
        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)  # (an emulated cluster's nodes share this machine's cores)
        on_machine = max(node.Get_size(), int(os.environ.get("MINITORCH_MACHINE_RANKS", "0") or 0))
        self._spins = 0 if on_machine > _cores() else _SPINS
        node.Free()
        mpi_comm.Barrier()
        self._t0 = time.perf_counter()

    @property
    def time(self) -> float:
        return time.perf_counter() - self._t0

    @property
    def events(self) -> list[Event]:
        """This rank's timeline so far (the same list each time: code may append to it). A message
        is recorded as a tuple, a tenth of an Event's cost, and becomes an Event here."""
        if self._raw:
            self._fold()
            rank = self.rank
            self._events.extend(Event(rank, *r) for r in self._raw)
            self._raw.clear()
            self._folded = 0
        return self._events

    def _fold(self) -> None:
        """Count the messages recorded in _raw since the last fold into the per-peer counters."""
        raw, i = self._raw, self._folded
        if i < len(raw):
            bytes_to, msgs_to, bytes_from, msgs_from = self._bytes_to, self._msgs_to, self._bytes_from, self._msgs_from
            for kind, _, _, _, peer, n, _ in raw[i:]:
                if kind == "send":
                    bytes_to[peer] += n
                    msgs_to[peer] += 1
                else:
                    bytes_from[peer] += n
                    msgs_from[peer] += 1
            self._folded = len(raw)

    @property
    def stats(self) -> _LiveStats:
        """This rank's counters so far: a live view of the per-peer counts (no cost per message)."""
        return _LiveStats(self)

    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> None:
        self._send(array, dst, tag, False)

    def _send(self, array: np.ndarray, dst: int, tag: int, borrow: bool) -> Any:
        """send's work. borrow=True (sendrecv): the caller leaves `array` alone until the returned
        request completes, so an array over _INLINE bytes goes out from where it is, without the
        private copy (the request is returned, not kept with the pending ones); else None."""
        if not (type(dst) is int and 0 <= dst < self.size):  # noqa: E721 - the fast path of the checks
            dst = self._check_rank(dst, "dst")
        if not (type(tag) is int and 0 <= tag < 2**20):  # noqa: E721
            tag = self._check_tag(tag)
        clock, t0 = time.perf_counter, self._t0
        t = clock() - t0
        if type(array) is np.ndarray and array.flags.c_contiguous and array.dtype.kind in "biufc":  # noqa: E721
            data = array  # the common case, without a call
        else:
            data = _message_array(array, self.rank, copy=False)
        head, n = _HEADERS.get((data.dtype, data.shape)) or _header(data), data.nbytes
        out = None
        if n <= _INLINE:  # one message: the header and a copy of the data
            buf = head + (memoryview(data).cast("B") if n else b"")  # one copy: header and data, new bytes
            self._pending.append((self._c.Isend(buf, dst, tag), buf))
        elif borrow:  # the header, then the data from where it is
            self._pending.append((self._c.Isend([head, self._BYTE], dst, tag), head))
            out = self._c.Isend([data.reshape(-1).view(np.uint8), self._BYTE], dst, tag)
        else:  # the header, then the data from a private copy (the caller may change `array` at once)
            spare = self._spare.get(n)
            if not spare and self._pending:  # a completed send's buffer: its pages are mapped already
                self._reap()  # (a new buffer page-faults on every 4 KiB it is copied into)
                spare = self._spare.get(n)
            buf = spare.pop() if spare else np.empty(n, np.uint8)
            np.copyto(buf, data.reshape(-1).view(np.uint8))
            self._pending.append((self._c.Isend([head, self._BYTE], dst, tag), head))
            self._pending.append((self._c.Isend([buf, self._BYTE], dst, tag), buf))
        if len(self._pending) > 16:
            self._reap()
        self._raw.append(("send", t, clock() - t0, "main", dst, n, tag))  # (counted by _fold)
        return out

    def sendrecv(self, array: np.ndarray, dst: int, src: int, tag: int = 0, recvtag: int | None = None) -> np.ndarray:
        """send then recv, with MPI_Sendrecv's contract: `array` is the caller's again only when the
        call returns, so an array over _INLINE bytes goes out from where it is, without the private
        copy `send` makes (a ring step moves its chunk once, not twice); the call returns when the
        message has been received and this rank's own has left."""
        recvtag = tag if recvtag is None else recvtag
        if not (type(src) is int and 0 <= src < self.size and type(recvtag) is int  # noqa: E721 - checked
                and 0 <= recvtag < 2**20):  # before anything is sent (the fast path of the checks)
            src, recvtag = self._check_rank(src, "src"), self._check_tag(recvtag)
        out = self._send(array, dst, tag, True)  # checks dst and tag
        got = self.recv(src, recvtag)
        if out is not None:  # until the send completes: then the caller may change `array`
            self._wait(out.Test, ("send", int(dst), int(tag)))
        return got

    def isend(self, array: np.ndarray, dst: int, tag: int = 0) -> Request:
        """MPI_Isend of the array's bytes, from where it is (a non-contiguous array: from a C-ordered
        copy), on tag + _TYPED."""
        # (the fast path of the checks, then the slow one naming what is wrong; a small all-to-all is
        # bound by what each message costs in Python)
        if not (type(dst) is int and type(tag) is int and 0 <= dst < self.size and 0 <= tag < _TYPED):  # noqa: E721
            dst, tag = self._check_rank(dst, "dst"), self._check_tag(tag)
        if not (type(array) is _ndarray and array.flags.c_contiguous and array.dtype.kind in "biufc"):
            array = _message_array(array, self.rank, copy=False)
        t = _clock() - self._t0
        req = _new_request(Request)  # the fields set one by one: half the cost of a call to __init__
        req.comm = self
        req.kind = "isend"
        req.peer = dst
        req.tag = tag
        req.out = array
        req._req = self._c.Isend([array, self._BYTE], dst, tag + _TYPED)
        self._raw.append(("send", t, t, "main", dst, array.nbytes, tag))
        self._open += 1
        return req

    def irecv(self, out: np.ndarray, src: int, tag: int = 0) -> Request:
        """MPI_Irecv into `out`'s bytes, on tag + _TYPED; waitall checks the size that came."""
        if not (type(src) is int and type(tag) is int and 0 <= src < self.size and 0 <= tag < _TYPED):  # noqa: E721
            src, tag = self._check_rank(src, "src"), self._check_tag(tag)
        if not (type(out) is _ndarray and out.flags.c_contiguous and out.flags.writeable and out.dtype.kind in "biufc"):
            out = _irecv_buffer(out, self.rank)
        req = _new_request(Request)
        req.comm = self
        req.kind = "irecv"
        req.peer = src
        req.tag = tag
        req.out = out
        req._req = self._c.Irecv([out, self._BYTE], src, tag + _TYPED)
        req._t = _clock() - self._t0
        self._open += 1
        return req

    def waitall(self, requests: list[Request]) -> None:
        """MPI_Testall over the requests, waiting as `_wait` does; then every receive's byte count is
        checked against its array, and receives are recorded on the timeline (from when each was
        posted, or this call began, to when the last completed)."""
        t = _clock() - self._t0
        fast = False
        if type(requests) is list:  # noqa: E721 - the fast path of the checks: a list of our requests, none
            try:                     # complete, none twice
                reqs, mpi_reqs = requests, [q._req for q in requests]
                fast = mpi_reqs.count(None) == 0 and len({*map(id, requests)}) == len(requests)
            except AttributeError:
                pass
        if not fast:  # a clear error for anything that is not a list of requests; drop completed ones and repeats
            reqs = list({id(q): q for q in _requests(self, requests) if q._req is not None}.values())
            mpi_reqs = [q._req for q in reqs]
            if not reqs:
                return
        statuses = self._statuses
        while len(statuses) < len(mpi_reqs):
            statuses.append(self._MPI.Status())
        testall = self._MPI.Request.Testall
        try:
            if not testall(mpi_reqs, statuses):
                self._wait(lambda: testall(mpi_reqs, statuses), lambda: self._waiting_for(reqs))
        except self._MPI.Exception as exc:  # a message longer than its irecv's array
            raise self._truncated(reqs, statuses, exc) from None
        end = _clock() - self._t0
        raw, byte = self._raw, self._BYTE
        self._open -= len(reqs)
        for q in reqs:
            q._req = None
        for q, st in zip(reqs, statuses):
            if q.kind == "irecv":
                n = q.out.nbytes
                if st.Get_count(byte) != n:
                    raise _irecv_mismatch(self.rank, q.peer, q.tag, q.out, f"{st.Get_count(byte)} bytes",
                                          "the size must agree (MPI carries no dtype: the simulator checks that "
                                          "as well)")
                raw.append(("recv", q._t if q._t > t else t, end, "main", q.peer, n, q.tag))
            else:
                q.out = None  # the array is the caller's again

    def _waiting_for(self, reqs: list[Request]) -> tuple[str, int, int, str]:
        """(op, peer, tag, call) of the first request of `reqs` not complete, for the status file:
        a receive's, else a send's (which waits for its receiver, as a sendrecv's send does)."""
        left = [q for q in reqs if not q._req.Get_status()] or reqs
        q = next((q for q in left if q.kind == "irecv"), left[0])
        return ("recv" if q.kind == "irecv" else "send", q.peer, q.tag, "waitall")

    def _truncated(self, reqs: list[Request], statuses: list, exc: Exception) -> Exception:
        """The error for a waitall that MPI failed: a message longer than its array (MPI_ERR_TRUNCATE)."""
        for q, st in zip(reqs, statuses):
            if q.kind == "irecv" and st.Get_error() and self._MPI.Get_error_class(st.Get_error()) == self._MPI.ERR_TRUNCATE:
                return _irecv_mismatch(self.rank, q.peer, q.tag, q.out, f"more than {q.out.nbytes} bytes")
        return exc

    def _reap(self) -> None:
        """Forget completed sends, keeping large buffers for reuse: one MPI_Testsome over all the
        pending sends (a Test per request, from Python, costs several times the test itself)."""
        pending = self._pending
        done = self._MPI.Request.Testsome([req for req, _ in pending])
        if not done:
            return
        if len(done) == len(pending):  # the usual case: every send has left
            for _, buf in pending:
                self._keep(buf)
            pending.clear()
            return
        done = set(done)
        still = deque()
        for i, item in enumerate(pending):
            if i in done:
                self._keep(item[1])
            else:
                still.append(item)
        self._pending = still

    def _keep(self, buf: Any) -> None:
        if type(buf) is np.ndarray and buf.nbytes > _INLINE:  # noqa: E721
            spare = self._spare.setdefault(buf.nbytes, [])
            if len(spare) < 4 and buf.nbytes <= 2**27:
                spare.append(buf)

    def recv(self, src: int, tag: int = 0) -> np.ndarray:
        if not (type(src) is int and 0 <= src < self.size):  # noqa: E721 - the fast path of the checks
            src = self._check_rank(src, "src")
        if not (type(tag) is int and 0 <= tag < 2**20):  # noqa: E721
            tag = self._check_tag(tag)
        clock, t0 = time.perf_counter, self._t0
        t = clock() - t0
        head = self._head
        req = self._recvs.get((src, tag))  # a persistent receive into head per (source, tag): no new request
        if req is None:
            req = self._c.Recv_init([head, self._BYTE], src, tag)
            if len(self._recvs) < 1024:
                self._recvs[src, tag] = req
        req.Start()
        if not req.Test():
            self._wait(req.Test, ("recv", src, tag))
        key = bytes(self._head_view)
        dtype, shape, n, count = _LAYOUTS.get(key) or _layout(key)
        if n <= _INLINE:
            data = np.frombuffer(head, dtype, count, _HEADER).copy()
            if len(shape) != 1:
                data = data.reshape(shape)
        else:
            data = np.empty(shape, dtype)
            # the data follows its header at once: no naps while it streams in
            self._wait(self._c.Irecv([data.reshape(-1).view(np.uint8), self._BYTE], src, tag).Test, ("recv", src, tag),
                       False)
        self._raw.append(("recv", t, clock() - t0, "main", src, n, tag))
        return data

    def barrier(self) -> None:
        t = self.time
        self._wait(self._c.Ibarrier().Test, ("barrier", -1, -1))
        self.events.append(Event(self.rank, "barrier", t, self.time))

    def launch(self, fn: Callable, *args: Any, **kwargs: Any) -> Work:
        return Work(self, fn(self, *args, **kwargs), self.time)

    def _wait(self, test: Callable[[], bool], what: tuple | Callable[[], tuple], nap: bool = True) -> None:
        """Until test() (a request's Test) is true, yielding the core between tests (other ranks may
        need it: more ranks than cores), then napping once the wait is long. A wait for a message
        (nap=True; not for the data that follows a header) longer than _STATUS_AFTER writes this
        rank's status file for the launcher's deadlock check, saying what it waits for: `what`,
        (op, peer, tag) or (op, peer, tag, call), or a function returning that."""
        for _ in range(self._spins):
            if test():
                return
        start = time.perf_counter()
        report = start + _STATUS_AFTER
        yield_, sleep, clock = os.sched_yield, time.sleep, time.perf_counter
        written = False
        if self._pending:
            self._reap()  # sends completed meanwhile: free their buffers
        try:
            while not test():
                now = clock()
                if not nap or now - start < _YIELD_FOR:
                    yield_()
                else:
                    sleep(_NAP)
                if now > report and nap and self._job is not None:  # (data streaming in is progress)
                    self._status(*(what() if callable(what) else what))
                    written, report = True, math.inf
        finally:
            if written:
                try:
                    os.unlink(self._job / f"status{self.rank}.json")
                except OSError:
                    pass

    def _status(self, op: str, src: int, tag: int, call: str = "") -> None:
        """Write what this rank waits for (op, peer, tag; call: the communicator call, when it is not
        op's own), where, and its message counts (atomically)."""
        import json

        self._episode += 1
        self._fold()
        where = _user_line(sys._getframe(2))
        status = {"op": op, "src": src, "tag": tag, "call": call, "episode": self._episode, "where": where,
                  "sent": self._msgs_to, "received": self._msgs_from}
        path = self._job / f"status{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        os.replace(tmp, path)

    def _finish(self) -> str:
        """After fn returned on every rank: find (and drain) messages nobody received. Collective."""
        MPI = self._MPI
        self._fold()
        sent = np.array(self._msgs_to, np.int64)
        expected = np.empty_like(sent)
        self._c.Alltoall(sent, expected)
        lines = []
        for src in range(self.size):
            for _ in range(int(expected[src]) - self._msgs_from[src]):
                status = MPI.Status()
                self._c.Probe(src, MPI.ANY_TAG, status)
                tag = status.Get_tag()
                if tag >= _TYPED:  # an isend's: the bytes alone
                    n = status.Get_count(MPI.BYTE)
                    self._c.Recv([np.empty(n, np.uint8), MPI.BYTE], src, tag)
                else:
                    self._c.Recv([self._head, MPI.BYTE], src, tag)
                    n = _layout(self._head[:_HEADER].tobytes())[2]
                    if n > _INLINE:
                        self._c.Recv([np.empty(n, np.uint8), MPI.BYTE], src, tag)
                lines.append(f"rank {src} -> rank {self.rank}, {_tag_label(tag)}: 1 message(s), {n} bytes")
        MPI.Request.Waitall([r for r, _ in self._pending])
        self._pending.clear()
        everyone = self._c.allgather(lines)
        return "\n  ".join(sorted(line for part in everyone for line in part))


def mpiexec_path() -> str | None:
    """The mpiexec next to this Python (the mpich wheel installs it in the venv), else on PATH."""
    import shutil

    here = Path(sys.executable).with_name("mpiexec")
    return str(here) if here.exists() else shutil.which("mpiexec")


# Environment for every MPI launch. One BLAS/OpenMP thread per rank: ranks may outnumber cores.
# Hydra starts ranks by fork on this host (no ssh, no network needed). glibc's malloc keeps what a
# rank frees mapped (arrays up to 64 MiB from the heap, up to 256 MiB of free memory kept): by
# default it may give freed multi-MiB blocks back to the kernel (it unmaps blocks above its mmap
# threshold and trims the top of the heap once enough is free), and the next array page-faults on
# every 4 KiB page as it is written (getrusage's minor faults count them; `make bench` showed the
# rings' large all-reduces paying for it; other platforms ignore these names).
MPI_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HYDRA_LAUNCHER": "fork", "PYTHONDONTWRITEBYTECODE": "1",
           "MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}

_WORKER = "import sys; from minitorch.comm import _mpi_worker; _mpi_worker(sys.argv[1])"
_MPI_STATUS: tuple[bool, str] | None = None
# Hydra's options that pin rank r to core r % cores, where mpi_status found that they work here.
# Unpinned, the scheduler moves ranks between cores mid-step and sometimes puts ring neighbours on
# one core, so that with more ranks than cores the same all-reduce timed differently from one
# launch to the next; pinned, every launch sees the same placement.
_MPI_BIND: list[str] = []


def mpi_status() -> tuple[bool, str]:
    """(True, version) if `mpiexec -n 1` can start an mpi4py process here, else (False, why).
    Tries with ranks pinned to cores first (_MPI_BIND), then without."""
    global _MPI_STATUS, _MPI_BIND
    if _MPI_STATUS is None:
        exe = mpiexec_path()
        if exe is None:
            _MPI_STATUS = (False, "no mpiexec found (run `make setup`: it installs the mpich wheel)")
        else:
            code = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); print(MPI.Get_library_version().splitlines()[0])"
            for bind in (["-bind-to", "core"], []):
                try:
                    rc, out = _launch([exe, *bind, "-n", "1", sys.executable, "-c", code], 60)
                    _MPI_STATUS = (True, out.strip()) if rc == 0 else \
                        (False, f"mpiexec failed ({rc}): {out.strip()[-300:]}")
                except (OSError, TimeoutError) as exc:
                    _MPI_STATUS = (False, f"mpiexec could not start: {exc}")
                if _MPI_STATUS[0]:
                    _MPI_BIND = bind
                    break
    return _MPI_STATUS


class _Stop(Exception):
    """Raised by a launch's watch function to end the launch (the job is killed first)."""


def _launch(cmd: list[str], timeout: float, watch: Callable[[], None] | None = None,
            env: dict | None = None) -> tuple[int, str]:
    """Run cmd in a session of its own and return (exit code, output). While it runs, call
    watch() every 20-200 ms (it may raise to end the run). Past `timeout`, or on any exception in
    this process (KeyboardInterrupt included), mpiexec and every process under it are killed
    first; a timeout raises TimeoutError. env: the launch's environment (default: this process's
    with MPI_ENV)."""
    env = {**os.environ, **MPI_ENV} if env is None else env
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                text=True, start_new_session=True)
        try:
            deadline, pause = time.monotonic() + timeout, 0.02
            while True:
                try:
                    proc.wait(timeout=max(min(pause, deadline - time.monotonic()), 0))
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"`{' '.join(cmd[:3])} ...` ran past {timeout:g} s; it was killed with all "
                                       "its processes")
                if watch is not None:
                    watch()
                pause = min(pause * 1.5, 0.2)
        finally:
            while proc.poll() is None:  # a second Ctrl-C must not leave the job running
                try:
                    _kill_group(proc)
                    proc.wait()
                except KeyboardInterrupt:
                    pass
        out.seek(0)
        return proc.returncode, out.read()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process below mpiexec, deepest first, then mpiexec (after it has had a
    moment to reap its children). Hydra starts its proxy and the ranks each in a session of
    their own, so killing the process group is not enough: walk the parent links."""
    for pid in reversed(_process_tree(proc.pid)[1:]):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _process_tree(root: int) -> list[int]:
    """root and its descendants: from /proc on Linux, from `ps` where there is no /proc (macOS);
    just root if neither works."""
    children: dict[int, list[int]] = defaultdict(list)
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        entries = []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children[ppid].append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    if not entries:
        try:
            out = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return [root]
        for line in out.splitlines():
            pid, _, ppid = line.strip().partition(" ")
            if pid.isdigit() and ppid.strip().isdigit():
                children[int(ppid)].append(int(pid))
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    return tree


def _by_value_modules() -> list:
    """Modules a fresh `python` could not import by name: notebooks' and tests' modules, lessons
    loaded by the grader. cloudpickle must ship their functions by value."""
    import sysconfig

    import minitorch

    root = Path(minitorch.__file__).resolve().parent.parent
    keep = (root / "minitorch", root / "course")
    # Installed packages import by name, wherever the environment is (.venv, build/venv-3.12). From a
    # wheel, root is site-packages itself, and the tests are course/_tree/tests, loaded by path.
    site = {Path(sysconfig.get_path(k)).resolve() for k in ("purelib", "platlib")}
    found = []
    for name, mod in list(sys.modules.items()):
        if name == "__main__" or mod is None:
            continue
        file = getattr(mod, "__file__", None) or ""
        if file.startswith("<") and getattr(mod, "__spec__", None) is None:
            found.append(mod)
        elif file and not file.startswith("<"):
            path = Path(file).resolve()
            if path.is_relative_to(root / "course" / "_tree"):
                found.append(mod)
            elif path.is_relative_to(root) and not any(path.is_relative_to(k) for k in keep) \
                    and not any(path.is_relative_to(s) for s in site):
                found.append(mod)
    return found


def _dumps(obj: Any) -> bytes:
    import cloudpickle

    mods = _by_value_modules()
    for m in mods:
        cloudpickle.register_pickle_by_value(m)
    try:
        return cloudpickle.dumps(obj)
    finally:
        for m in mods:
            cloudpickle.unregister_pickle_by_value(m)


# Clusters. `run(..., engine="mpi", nodes=k)` launches on a cluster described by a JSON file: the one
# $MINITORCH_CLUSTER names, else the emulated cluster running on this machine (course.cluster writes
# its file into CLUSTER_DIR and removes it when it stops). The file says what mpiexec needs:
#   hosts          one name (or address) per node, as the launcher reaches it
#   ppn            ranks (NICs) per node at most
#   launcher       hydra's launcher: "ssh" (also for the emulation, through launcher_exec), "slurm", ...
#   launcher_exec  optional: the program hydra runs instead of ssh (the emulation's enters a node's namespaces)
#   localhost      optional: the address the nodes reach this machine at (hydra's -localhost)
#   env            optional: environment for the ranks (which network MPI uses: UCX_TLS, UCX_NET_DEVICES...)
#   rank_netns     optional: "/run/netns/...{node}...{local}": the network namespace each rank enters
#                  before MPI starts (the emulation gives each rank its own NIC)
#   shared_machine optional: true when every node runs on this machine's cores (the emulation)
#   jobdir         optional: where job files go (a directory every node sees; default: the temp dir)
#   owner          optional: the process that keeps the cluster up (a file whose owner died is stale)
CLUSTER_DIR = Path("/run/minitorch-cluster")
_CLUSTER_KEYS = {"hosts", "ppn", "launcher", "launcher_exec", "localhost", "env", "rank_netns", "shared_machine",
                 "jobdir", "owner", "name", "description", "nodes", "link", "index", "created"}


def _cluster_file() -> Path:
    """The cluster file run(..., nodes=...) uses, or a RuntimeError saying there is none (or several)."""
    named = os.environ.get("MINITORCH_CLUSTER")
    if named:
        if not Path(named).is_file():
            raise RuntimeError(f"MINITORCH_CLUSTER names {named}, which is not a file (has its cluster stopped?)")
        return Path(named)
    live = []
    for path in sorted(CLUSTER_DIR.glob("*.json")) if CLUSTER_DIR.is_dir() else []:
        try:
            import json

            owner = int(json.loads(path.read_text()).get("owner", 0))
        except (OSError, ValueError, AttributeError, TypeError):
            continue
        if owner > 0 and _alive(owner):
            live.append(path)
    if len(live) == 1:
        return live[0]
    if not live:
        raise RuntimeError("run(..., engine='mpi', nodes=...) needs a cluster, and none is running here: start the "
                           "emulated one (`make cluster`, or `with EmulatedCluster(...)` from course.cluster), or set "
                           "MINITORCH_CLUSTER to a cluster file (docs/mpi.md, \"Across nodes\")")
    raise RuntimeError(f"{len(live)} emulated clusters are running here ({', '.join(p.stem for p in live)}): set "
                       "MINITORCH_CLUSTER to the file of the one to use")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cluster_launch(nranks: int, nodes: int) -> tuple[list[str], dict, dict]:
    """(mpiexec's options before -n, the launch's environment, the cluster's description) for nranks
    ranks on `nodes` nodes of the cluster, or a clear RuntimeError / ValueError."""
    import json

    path = _cluster_file()
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"cluster file {path}: {exc}") from None
    unknown = set(spec) - _CLUSTER_KEYS
    if unknown or not isinstance(spec.get("hosts"), list) or not spec["hosts"]:
        raise RuntimeError(f"cluster file {path}: needs a list of hosts" + (f"; unknown keys {sorted(unknown)}"
                                                                           if unknown else ""))
    hosts, per_node = spec["hosts"], nranks // nodes
    ppn = int(spec.get("ppn", per_node))
    if nodes > len(hosts) or per_node > ppn:
        raise ValueError(f"run: {nranks} ranks on {nodes} nodes ({per_node} per node) do not fit the cluster of "
                         f"{len(hosts)} nodes x {ppn} ranks ({path})")
    args = ["-launcher", str(spec.get("launcher", "ssh"))]
    if spec.get("launcher_exec"):
        args += ["-launcher-exec", str(spec["launcher_exec"])]
    if spec.get("localhost"):
        args += ["-localhost", str(spec["localhost"])]
    args += ["-hosts", ",".join(f"{h}:{per_node}" for h in hosts[:nodes])]  # per_node ranks on each, in order
    env = {**os.environ, **{k: v for k, v in MPI_ENV.items() if k != "HYDRA_LAUNCHER"},
           **{str(k): str(v) for k, v in (spec.get("env") or {}).items()}}
    env.pop("HYDRA_LAUNCHER", None)
    if spec.get("rank_netns"):
        env["MINITORCH_RANK_NETNS"] = str(spec["rank_netns"])
    if spec.get("shared_machine"):
        env["MINITORCH_MACHINE_RANKS"] = str(nranks)  # every rank on this machine's cores
    return args, env, spec


def _enter_rank_netns() -> None:
    """In a rank of an emulated cluster, before MPI starts: enter the rank's own network namespace
    (its NIC), named by MINITORCH_RANK_NETNS from the node (MINITORCH_NODE, set by the cluster's
    launcher) and the rank's place on it (MPI_LOCALRANKID, set by hydra). Nothing elsewhere."""
    spec = os.environ.get("MINITORCH_RANK_NETNS")
    if not spec:
        return
    path = spec.format(node=int(os.environ.get("MINITORCH_NODE", "0")), local=int(os.environ.get("MPI_LOCALRANKID", "0")))
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter the network namespace {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _run_mpi(fn, nranks, args, kwargs, timeout, nodes=None) -> RunResult:
    exe = mpiexec_path()
    if exe is None or not mpi_status()[0]:
        raise RuntimeError(f"MPI cannot start here: {mpi_status()[1]}")
    options, env, cluster = (list(_MPI_BIND), None, {}) if nodes is None else _cluster_launch(nranks, nodes)
    with tempfile.TemporaryDirectory(prefix="minitorch-mpi-", dir=cluster.get("jobdir")) as tmp:
        job = Path(tmp)
        (job / "job.pkl").write_bytes(_dumps((fn, args, kwargs)))
        (job / "limit").write_text(repr(float(timeout)))
        (job / "launcher").write_text(str(os.getpid()))
        t0 = time.perf_counter()
        watch = _DeadlockWatch(job, nranks)
        try:
            rc, out = _launch([exe, *options, "-n", str(nranks), sys.executable, "-c", _WORKER, str(job)], timeout,
                              watch, env)
        except _Stop:
            raise DeadlockError(watch.report) from None
        except TimeoutError as exc:
            late = [r for r in range(nranks) if not (job / f"returned{r}").exists()]
            statuses = watch.read()
            lines = []
            for r in late:
                st = statuses.get(r)
                if st is not None and st["op"] != "returned":
                    lines.append(f"  rank {r} waits in {_what(st)}" + (f", at {w}" if (w := _where(st)) else ""))
                else:
                    try:
                        file, line, name = (job / f"where{r}").read_text().split("\t")
                        where = _where({"where": (file, int(line), name)})
                    except (OSError, ValueError):
                        where = _mpi_where(job / f"stack{r}.txt")
                    lines.append(f"  rank {r} had not returned" + (f"; near the limit it was at {where}" if where else ""))
            who = f"rank {late[0]}" if len(late) == 1 else "ranks " + ", ".join(map(str, late))
            raise RunTimeoutError(f"{who} of an MPI run with {_ranks(nranks)} did not finish within {timeout:g} s "
                                  "(an infinite loop?):\n" + "\n".join(lines) + f"\n{exc}", timeout, late) from None
        wall = time.perf_counter() - t0
        records = {}
        for r in range(nranks):
            path = job / f"rank{r}.pkl"
            if path.exists():
                import pickle

                records[r] = pickle.loads(path.read_bytes())
    failed = [r for r in sorted(records) if records[r]["error"] is not None]
    if failed:
        rank = failed[0]
        exc = records[rank]["error"]
        exc.add_note(f"(raised on rank {rank} of an MPI run with {_ranks(nranks)})\n"
                     f"rank {rank}'s traceback:\n{records[rank]['traceback']}")
        raise exc
    if rc != 0 or len(records) != nranks:
        ok, why = mpi_status()
        raise RuntimeError(f"mpiexec -n {nranks} failed (exit code {rc}, {len(records)} of {nranks} ranks "
                           f"reported) after {wall:.1f} s" + ("" if ok else f"; MPI cannot start here: {why}")
                           + f". Output:\n{out[-3000:]}")
    stats = [records[r]["stats"] for r in range(nranks)]
    timeline = sorted((e for r in range(nranks) for e in records[r]["events"]), key=lambda e: (e.start, e.rank))
    return RunResult("mpi", nranks, [records[r]["result"] for r in range(nranks)], stats, timeline,
                     max(s["time"] for s in stats), out, nodes=nodes or 1)


class _DeadlockWatch:
    """The launcher's deadlock check, called while mpiexec runs. Reads the ranks' status files
    (MPIComm._status: a rank waiting for 0.1 s or more) and returned files (final counts). A
    deadlock: every rank that has not returned waits, each waits in recv for a rank that waits
    too or has returned, or in a barrier that a returned or receiving rank will never reach; and
    nothing is in flight on the edges waited on (the sender's count of messages to the waiting
    rank equals the waiting rank's count from it). The statuses must read the same twice, 0.2 s
    apart (2 s when messages are in flight: those must have been of other tags)."""

    def __init__(self, job: Path, nranks: int):
        self.job, self.nranks, self.report = job, nranks, ""
        self.seen: tuple | None = None
        self.since = 0.0

    def read(self) -> dict[int, dict]:
        import json

        out = {}
        for r in range(self.nranks):
            for name in (f"returned{r}", f"status{r}.json"):
                try:
                    text = (self.job / name).read_text()
                except OSError:
                    continue
                try:
                    out[r] = json.loads(text)
                except ValueError:
                    continue
                break
        return out

    def __call__(self) -> None:
        st = self.read()
        key = tuple(sorted((r, repr(s)) for r, s in st.items()))
        now = time.monotonic()
        if key != self.seen:
            self.seen, self.since = key, now
        verdict = self.verdict(st)
        if verdict is None:
            return
        report, in_flight = verdict
        if now - self.since >= (2.0 if in_flight else 0.2):
            self.report = report
            raise _Stop()

    def verdict(self, st: dict[int, dict]) -> tuple[str, bool] | None:
        """(report, whether messages are in flight on waited edges) if every rank that has not
        returned waits and none of them can move, else None."""
        n = self.nranks
        # r waits for rank waits[r]: to send it a message (recv), or to receive r's (a sendrecv's send)
        waits = {r: s["src"] for r, s in st.items() if s["op"] in ("recv", "send")}
        recv = {r: src for r, src in waits.items() if st[r]["op"] == "recv"}
        orphans = [r for r, peer in waits.items() if st.get(peer, {}).get("op") == "returned"
                   and (st[r]["op"] == "send" or st[peer]["sent"][r] == st[r]["received"][peer])]
        in_flight: set[int] = set()
        if not orphans:  # nobody waits for a rank that has returned, owing it nothing
            if len(st) < n or all(s["op"] == "returned" for s in st.values()):
                return None  # a rank is running (or all have returned)
            if all(s["op"] == "barrier" for s in st.values()):
                return None  # the barrier completes
            # messages src sent r that r has not received; a sendrecv's own message, blocked in src
            # with another tag than r waits for, cannot be the one r waits for
            in_flight = {r for r, src in recv.items() if st[src]["sent"][r] - st[r]["received"][src]
                         > (st[src]["op"] == "send" and st[src]["src"] == r and st[src]["tag"] != st[r]["tag"])}
            movable, grew = set(in_flight), True  # a message in flight may be the one awaited
            while grew:
                more = {r for r, peer in waits.items() if peer in movable} - movable
                movable |= more
                grew = bool(more)
            if movable - in_flight:
                return None  # ranks wait for ranks that may still receive and go on
        lines = []
        for r in range(n):
            s = st.get(r)
            if s is None:
                lines.append(f"  rank {r} is running")
            elif s["op"] == "returned":
                lines.append(f"  rank {r} has returned")
            else:
                never = "be received" if s["op"] == "send" else "come"
                lines.append(f"  rank {r} waits in {_what(s)}" + (f", at {w}" if (w := _where(s)) else "")
                             + (f", but rank {s['src']} has returned: that message will never {never}"
                                if r in orphans else ""))
        nxt = waits
        cycle = ""
        for start in sorted(nxt):
            path, r = [start], start
            while r in nxt and nxt[r] not in path:
                r = nxt[r]
                path.append(r)
            if r in nxt and nxt[r] == start and len(path) > 1:
                cycle = "\n  cycle: " + " -> ".join(f"rank {p}" for p in path + [start])
                break
        pending = [f"    rank {src} -> rank {dst}: {k} message(s)" for dst, s in sorted(st.items())
                   if s["op"] != "returned" for src in sorted(st)
                   if (k := st[src]["sent"][dst] - s["received"][src]) > 0]
        hint = ("\n  sent but not received (wrong peer or tag?):\n" + "\n".join(pending)) if pending else ""
        what = "a rank waits for a rank that has returned" if orphans else "every running rank is blocked"
        return (f"deadlock in an MPI run with {_ranks(n)}: {what} (seen by the launcher in the ranks' status "
                "files; the job was killed)\n" + "\n".join(lines) + cycle + hint, bool(in_flight))


def _what(status: dict) -> str:
    if status.get("call") == "waitall":
        if status["op"] == "recv":
            return f"waitall: irecv(src={status['src']}, tag={status['tag']})"
        return f"waitall: isend(dst={status['src']}, tag={status['tag']}) until rank {status['src']} receives it"
    if status["op"] == "recv":
        return f"recv(src={status['src']}, tag={status['tag']})"
    if status["op"] == "send":  # a sendrecv, after its receive: its message must reach rank src
        return f"sendrecv(dst={status['src']}, tag={status['tag']}) until rank {status['src']} receives its message"
    return f"{status['op']}()"


def _where(status: dict) -> str:
    if not status.get("where"):
        return ""
    file, lineno, name = status["where"]
    return f"{_file_label(file)}, line {lineno} in {name}" + (
        f": `{src}`" if (src := linecache.getline(file, lineno).strip()) else "")


def _mpi_where(stack_file: Path) -> str:
    """The innermost frame outside minitorch.comm and mpi4py in a rank's faulthandler dump."""
    try:
        text = stack_file.read_text()
    except OSError:
        return ""
    for line in text.splitlines():  # most recent call first; the main thread's stack comes last
        m = re.match(r'\s*File "(.*)", line (\d+) in (\S+)', line)
        if m and not m.group(1).endswith(("minitorch/comm.py", "minitorch\\comm.py", "minitorch/checks.py",
                                          "minitorch\\checks.py", "threading.py")) and "mpi4py" not in m.group(1) \
                and m.group(3) not in ("_mpi_worker", "<module>"):
            file, lineno, name = m.group(1), int(m.group(2)), m.group(3)
            return f"{_file_label(file)}, line {lineno} in {name}" + (
                f": `{src}`" if (src := linecache.getline(file, lineno).strip()) else "")
    return ""


def _watch_launcher(pid: int, job: Path, rank: int, main: int) -> None:
    """A thread in each rank. Every half second: exit at once if the process that called `run`
    has gone (killed, restarted) or this rank's parent (hydra's proxy) has; and once the rank has
    run for a second, write the line of the user's code its main thread is at (for a time
    limit's report; faulthandler's dump shortly before the limit covers a rank stuck in C)."""
    parent, start, last = os.getppid(), time.monotonic(), None
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass
        if os.getppid() != parent:
            os._exit(3)
        if time.monotonic() - start > 1.0:
            where = _user_line(sys._current_frames().get(main))
            if where != last and where is not None:
                tmp = job / f".where{rank}"
                tmp.write_text("\t".join(map(str, where)))
                os.replace(tmp, job / f"where{rank}")
                last = where


def _user_line(frame: Any) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame outside this module, minitorch.checks, mpi4py and
    threading."""
    while frame is not None and (frame.f_code.co_filename in (__file__, threading.__file__, _CHECKS)
                                 or "mpi4py" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None or frame.f_code.co_name in ("_mpi_worker", "<module>"):
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _mpi_worker(job_dir: str) -> None:
    """Entry point of each rank under mpiexec (see _run_mpi)."""
    import json
    import pickle

    import cloudpickle

    _enter_rank_netns()  # (an emulated cluster's rank: its own NIC, before MPI starts)
    from mpi4py import MPI

    job = Path(job_dir)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    record: dict[str, Any] = {"result": None, "error": None, "traceback": ""}
    comm = None
    try:
        threading.Thread(target=_watch_launcher, daemon=True,
                         args=(int((job / "launcher").read_text()), job, rank, threading.get_ident())).start()
        fn, args, kwargs = pickle.loads((job / "job.pkl").read_bytes())
        # Shortly before the parent's time limit, write where this rank is (for its error message).
        import faulthandler

        stack = open(job / f"stack{rank}.txt", "w")
        limit = float((job / "limit").read_text())
        faulthandler.dump_traceback_later(max(limit - 2.0, 0.7 * limit), file=stack)
        comm = MPIComm(world, job)
        record["result"] = fn(comm, *args, **kwargs)
        record["time"] = comm.time  # when fn returned (before the end-of-run checks)
        if comm._open:
            raise _open_requests_error(rank, comm._open)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then the run is aborted
        record["error"], record["traceback"] = exc, traceback.format_exc()
    finally:
        returned = job / f"returned{rank}"
        if comm is not None:
            comm._fold()
        counts = {"op": "returned", "sent": comm._msgs_to if comm is not None else [0] * world.Get_size()}
        returned.with_suffix(".tmp").write_text(json.dumps(counts))
        os.replace(returned.with_suffix(".tmp"), returned)
    if record["error"] is None:
        unreceived = comm._finish()
        if unreceived:
            record["error"] = UnreceivedMessageError(
                "messages sent but never received (wrong peer or tag?):\n  " + unreceived)
    if comm is not None:
        record["stats"] = _plain_stats(comm.stats)
        record["stats"]["time"] = record.get("time", comm.time)
        record["events"] = comm.events
    try:
        blob = cloudpickle.dumps(record)
    except Exception:  # noqa: BLE001 - an unpicklable result or exception: send its text
        err = record["error"]
        record["error"] = RuntimeError(f"{type(err).__name__}: {err}") if err is not None else None
        record["result"] = None if record["error"] else repr(record["result"])
        blob = cloudpickle.dumps(record)
    tmp = job / f".rank{rank}.pkl"
    tmp.write_bytes(blob)
    tmp.rename(job / f"rank{rank}.pkl")
    if record["error"] is not None and not isinstance(record["error"], UnreceivedMessageError):
        sys.stdout.flush()
        world.Abort(1)

# %% [markdown]
# The same function on both engines. `ping_pong` bounces a message between ranks 0 and 1 and
# returns what came back; on the simulator the round trip costs exactly `2 * (alpha + n * beta)`.

# %% tags=["demo"]
def ping_pong(comm, x):
    if comm.rank == 0:
        comm.send(x, 1)
        return comm.recv(1)
    if comm.rank == 1:
        y = comm.recv(0)
        comm.send(y * 2, 0)
    return None


x = np.arange(1000, dtype=np.float64)
sim = run(ping_pong, 2, x, alpha=5e-6, beta=1e-10)
print(f"sim: rank 0 got back {sim.results[0][:3]}..., simulated time {sim.time * 1e6:.2f} us "
      f"(2 * (alpha + 8000 B * beta) = {2 * (5e-6 + 8000 * 1e-10) * 1e6:.2f} us), bytes sent {sim.bytes_sent()}")
ok, why = mpi_status()
if ok:
    real = run(ping_pong, 2, x, engine="mpi")
    print(f"mpi: rank 0 got back {real.results[0][:3]}..., wall time {real.time * 1e6:.0f} us, "
          f"bytes sent {real.bytes_sent()}; same result: {np.array_equal(sim.results[0], real.results[0])}")
else:
    print("MPI cannot start here:", why)


# %% [markdown]
# The MPI figure above is one cold round trip: it includes the first use of the connection and
# is far above this machine's latency. To measure alpha and beta of the MPI engine here (mpi4py,
# MPICH's shared-memory transport between two processes, and this course's packing of each
# message), bounce messages from 1 byte to 4 MiB many times, keep the best round trip of each
# size, halve it, and fit `alpha + n * beta` (a fit in relative error, so that the small
# messages count as much as the large ones). The cell prints the load, the measured times and
# the fitted line beside them: compare them with the simulator's defaults (5 us, 0.1 ns/byte)
# and with the links of [interconnects](../hardware_notes/interconnects.md). MPICH changes
# protocol with the message size, so the points do not lie on one line; on the course's 2-core
# machine (load 1.4 to 1.8), four sweeps gave alpha of 7.9 to 8.6 us and beta of 0.28 to 0.47
# ns/byte (2.1 to 3.6 GB/s), with single sizes up to 2x off the line.

# %% tags=["demo"]
def ping_pong_sweep(comm, sizes, reps):
    """Rank 0: the best round-trip time (comm.time: wall seconds under MPI) for each size in bytes."""
    best = []
    for n in sizes:
        x = np.zeros(n, np.uint8)
        times = []
        for rep in range(reps + 1):  # the first round trip warms up
            comm.barrier()
            t0 = comm.time
            if comm.rank == 0:
                comm.send(x, 1)
                comm.recv(1)
            elif comm.rank == 1:
                comm.send(comm.recv(0), 0)
            times.append(comm.time - t0)
        best.append(min(times[1:]))
    return best if comm.rank == 0 else None


if mpi_status()[0]:
    from minitorch.bench import load_report

    print(load_report())
    sweep_sizes = [4 ** k for k in range(0, 12 if not SMALL else 6)]
    one_way = np.array(run(ping_pong_sweep, 2, sweep_sizes, 20 if not SMALL else 3, engine="mpi").results[0]) / 2
    beta_mpi, alpha_mpi = np.polyfit(sweep_sizes, one_way, 1, w=1 / one_way)
    for n_bytes, t in zip(sweep_sizes, one_way):
        print(f"{n_bytes:>9} bytes: one way {t * 1e6:8.1f} us, fit {(alpha_mpi + n_bytes * beta_mpi) * 1e6:8.1f} us")
    print(f"MPI here: alpha = {alpha_mpi * 1e6:.1f} us, beta = {beta_mpi * 1e9:.3f} ns/byte "
          f"({1 / beta_mpi / 1e9:.2f} GB/s)")
else:
    print("MPI cannot start here:", mpi_status()[1])


# %% [markdown]
# A classic bug: every rank first waits for its left neighbour. Nobody sends, so nobody ever
# receives. The simulator says so at once, and names the cycle:

# %% tags=["demo"]
def everyone_waits(comm):
    left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    got = comm.recv(left)
    comm.send(got, right)


try:
    run(everyone_waits, 3)
except DeadlockError as exc:
    print(f"DeadlockError: {exc}")

# %% [markdown]
# ## 1. All-reduce, the naive way
#
# *All-reduce* leaves on every rank the elementwise sum of every rank's array. It is the one
# collective data parallelism needs: after it, every rank holds the same summed gradient.
#
# The obvious algorithm: every rank sends its array to rank 0; rank 0 adds them up and sends
# the sum back to everyone. It is correct and it is what you would write first, and it has a
# bottleneck you can see in the counters: rank 0 receives N-1 arrays and sends N-1 arrays, so
# its traffic grows with N while every other rank sends one array.
#
# **Exercise 12.1.** Write `naive_allreduce`. Rank 0 adds the arrays in rank order,
# `((x0 + x1) + x2) + ...`, so the result is exactly reproducible. Keep the dtype, and do not
# modify the caller's `x` (the sum needs its own array). A rank cannot see the other ranks'
# arrays, only the messages it receives: pass each one through
# `check_received(comm, got, x, src, "naive_allreduce")`, given above, so that ranks called with
# different sizes or dtypes get an error naming both instead of a broadcast error or a silent
# upcast.

# %%
#| export
#| exercise 12.1
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
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("12.1")

# %% [markdown]
# ## 2. The ring
#
# Arrange the ranks in a ring, each sending only to its right neighbour `(r + 1) % N` and
# receiving only from its left one. Cut every array into N chunks (`chunk_bounds(n, N)`: sizes
# differ by at most one when N does not divide n). Then:
#
# - **Reduce-scatter**, N-1 steps. At step s, rank r sends its running sum of chunk
#   `(r - s - 1) % N` to the right, and receives from the left the running sum of chunk
#   `(r - s - 2) % N`, to which it adds its own piece. Each chunk's partial sum travels once
#   around the ring, collecting one contribution per hop; after N-1 steps rank r holds the
#   complete sum of chunk r.
# - **All-gather**, N-1 steps. At step s, rank r sends the finished chunk `(r - s) % N` to the
#   right and receives chunk `(r - s - 1) % N` from the left. After N-1 steps every rank has
#   every chunk.
#
# Ring all-reduce is reduce-scatter followed by all-gather. Every rank sends `2(N-1)` messages
# of about `S/N` bytes, `2(N-1)/N * S` in total, which is below `2S` for every N: the traffic per
# rank does not grow with N, and every link of the ring is busy at every step. That is optimal
# in bandwidth for an all-reduce (Patarasuk and Yuan 2009); it is how Baidu brought all-reduce
# to deep learning (Gibiansky 2017), how Horovod works (Sergeev and Del Balso 2018) and one of
# NCCL's algorithms.
#
# Here is the reduce-scatter for N = 3 ranks holding `a`, `b`, `c` (chunk k of rank r is `a_k`,
# `b_k`, `c_k`); each column is what a rank sends at that step:
#
# | step | rank 0 sends | rank 1 sends | rank 2 sends |
# |---|---|---|---|
# | 0 | `a_2` | `b_0` | `c_1` |
# | 1 | `a_1 + c_1` | `b_2 + a_2` | `c_0 + b_0` |
# | end | holds `a_0 + b_0 + c_0` | holds `b_1 + c_1 + a_1` | holds `c_2 + a_2 + b_2` |
#
# **Exercise 12.2.** Write `ring_reduce_scatter`, `ring_allgather` and `ring_allreduce` (the
# last in two lines from the first two). Inputs of any shape are flattened; the all-reduce
# gives its result the input's shape. Send only to the right neighbour. A rank may hold an
# empty chunk (n < N): send it anyway, the schedule must not depend on sizes. As in 12.1, check
# every chunk you receive against the one you combine it with (`check_received`; in the
# all-gather with `same_size=False`, chunks may differ in length but not in dtype).

# %%
#| export
#| exercise 12.2
def ring_reduce_scatter(comm: Communicator, x: np.ndarray) -> np.ndarray:
    """Chunk `comm.rank` of the elementwise sum over ranks of x.ravel(), by the ring.

    x: n elements (any shape), the same n and dtype on every rank: every chunk received is
    checked against the chunk it is added to with check_received. Chunks: chunk_bounds(n, size).
    Returns a new 1-D array of x's dtype and length hi - lo. Sends N-1 messages, all to
    (rank + 1) % size."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def ring_allgather(comm: Communicator, chunk: np.ndarray) -> np.ndarray:
    """Every rank's chunk.ravel(), concatenated in rank order, on every rank, by the ring.

    Chunks may differ in length between ranks but must share a dtype: every chunk received is
    checked with check_received(..., same_size=False). Returns a new 1-D array. Sends N-1
    messages, all to (rank + 1) % size."""
    ### BEGIN SOLUTION
    size, rank = comm.size, comm.rank
    parts: list = [None] * size
    parts[rank] = np.asarray(chunk).reshape(-1)  # only read: concatenate makes the new array
    right, left = (rank + 1) % size, (rank - 1) % size
    for s in range(size - 1):
        got = comm.sendrecv(parts[(rank - s) % size], right, left)
        parts[(rank - s - 1) % size] = check_received(comm, got, parts[rank], left, "ring_allgather", same_size=False)
    return np.concatenate(parts)
    ### END SOLUTION


def ring_allreduce(comm: Communicator, x: np.ndarray) -> np.ndarray:
    """Elementwise sum over ranks of x (any shape; the same size and dtype on every rank, or a
    ValueError from check_received), on every rank: ring reduce-scatter, then ring all-gather.
    Returns a new array of x's shape and dtype."""
    ### BEGIN SOLUTION
    x = np.asarray(x)
    return ring_allgather(comm, ring_reduce_scatter(comm, x)).reshape(x.shape)
    ### END SOLUTION

# %% tags=["check"]
check("12.2")

# %% [markdown]
# Both algorithms on 4 simulated ranks and 1 MiB of float64 each (`alpha` = 5 us, `beta` =
# 0.1 ns/byte, i.e. 10 GB/s): the counters show rank 0's load in the naive algorithm and the
# even `2(N-1)/N * S` of the ring, and the clocks follow.

# %% tags=["demo"]
N, n = 4, 131_072
xs = np.random.default_rng(0).standard_normal((N, n))


def allreduce_job(comm, fn):
    return fn(comm, xs[comm.rank])


for name, fn in [("naive", naive_allreduce), ("ring", ring_allreduce)]:
    res = run(allreduce_job, N, fn, alpha=5e-6, beta=1e-10)
    err = max(abs(r - xs.sum(0)).max() for r in res.results)
    print(f"{name:>5}: time {res.time * 1e3:.3f} ms, bytes sent per rank {res.bytes_sent()}, max error {err:.1e}")
ring = res
ring.plot(title="ring all-reduce, 4 ranks, 1 MiB: reduce-scatter then all-gather")
plt.show()

# %% [markdown]
# Measured: in the naive algorithm rank 0 sends 3 MiB (the sum, to 3 ranks) and the others 1 MiB
# each; in the ring every rank sends 1.5 MiB (`2(N-1)/N * S`), and the all-reduce takes
# 0.187 ms instead of 0.659 ms, as the cost model of section 3 predicts. On the timeline every
# rank sends (green) back to back, in lockstep with the others, and never waits (no idle bars):
# each step's receive returns at once, its chunk having arrived while the rank was sending its
# own, so its bar is too short to see. Every link is busy at every step. Now the same ring on 4
# MPI processes. The sums are computed in the
# same order on both engines, so the results agree to the last bit, and the byte counters are
# identical; only the clock differs (wall time on this machine, not a model).

# %% tags=["demo"]
if mpi_status()[0]:
    real = run(allreduce_job, N, ring_allreduce, engine="mpi")
    same = all(np.array_equal(a, b) for a, b in zip(ring.results, real.results))
    print(f"mpi: bit-identical to the simulator: {same}; bytes sent {real.bytes_sent()} "
          f"(simulator {ring.bytes_sent()}); wall time {real.time * 1e3:.1f} ms")
    real.plot(title="the same ring on MPI (wall clock, 4 processes on 2 cores)")
    plt.show()
else:
    print("MPI cannot start here:", mpi_status()[1])

# %% [markdown]
# How fast is your ring on real processes? The cell below times it in one `mpiexec` launch
# against two references on the same processes: `MPI.Allreduce` (MPICH's own all-reduce, in C)
# and the same ring written with plain mpi4py (`mpi4py_ring_allreduce`: `Sendrecv` of NumPy
# chunks straight between the ranks' arrays, no communicator in between). The first ratio is
# the cost of the communicator (a header per message and the private copy that buffered sends
# need); the second, what MPI does better than a ring.

# %%
#| export
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

# %% tags=["demo"]
if mpi_status()[0]:
    sizes = [2**10, 2**16, 2**19, 2**22] if SMALL else [2**10, 2**13, 2**16, 2**19, 2**22, 2**25]
    for nranks in (2, 4):
        before = machine_load()
        rows = run(allreduce_timings, nranks, sizes, 0.02 if SMALL else 0.05, engine="mpi", timeout=600).results[0]
        print(f"{nranks} ranks on {before} (before the launch):")
        print(f"{'bytes':>9} {'your ring':>11} {'mpi4py ring':>12} {'Allreduce':>11} {'ring/mpi4py':>12} {'ring/Allreduce':>15}")
        for nbytes, t_ring, t_plain, t_mpi in rows:
            print(f"{nbytes:>9} {t_ring * 1e6:>9.0f}us {t_plain * 1e6:>10.0f}us {t_mpi * 1e6:>9.0f}us "
                  f"{t_ring / t_plain:>11.2f}x {t_ring / t_mpi:>14.2f}x")
else:
    print("MPI cannot start here:", mpi_status()[1])

# %% [markdown]
# What to expect, and why. Read the ratios, not the times: each row is the best of five trials
# per all-reduce, the three all-reduces' trials interleaved so that they share the machine's
# conditions, and the load printed above each table says what else ran. Times on a shared
# machine drift from run to run; the ratios move much less.
#
# - **Your ring against the mpi4py ring** is the communicator's cost: Python per message (the
#   header, the counters, a timeline event; `make bench` prints it per message), which matters
#   for small messages, where a step is short anyway. Above 64 KiB a `send` also copies the array
#   (so that it can return at once; `MPI_Bsend` makes the same copy); `sendrecv` does not (as
#   MPI_Sendrecv, it may wait until `dst` has the message, so the array is yours again when it
#   returns), which is why the reference ring steps with `sendrecv`, and adds into the array
#   `sendrecv` returned rather than into a copy of `x`: a copy of a large chunk costs about as
#   much as sending it.
# - **The rings against `MPI.Allreduce`** is algorithm and implementation. MPI libraries pick an
#   algorithm by message size (Thakur, Rabenseifner and Gropp 2005 describe MPICH's): for short
#   vectors recursive doubling, log2 N exchanges of the whole vector where a ring needs 2(N-1)
#   steps, each paying the latency; for long ones Rabenseifner's algorithm, a reduce-scatter by
#   recursive halving then an all-gather by recursive doubling, the ring's bytes in 2 log2 N
#   steps. And it runs in C over shared memory with fewer copies: no Python between steps, the
#   sums in place, no fresh arrays to allocate. A fresh array costs more than its copy when the
#   memory is new to the process: the kernel maps it page by page, a fault per 4 KiB, as it is
#   first written (`resource.getrusage(...).ru_minflt` counts them). By default glibc may give
#   freed multi-MiB blocks back to the kernel (it unmaps blocks above its mmap threshold and trims
#   the top of the heap once enough is free); `run` fixes both thresholds in the ranks
#   (`MPI_ENV`), as a long-running training process would.
# - **With more ranks than cores** every step also waits for the scheduler: a rank whose message
#   has not arrived gives its core away (`sched_yield`), and the rank that sends the message must
#   get a core first. Both rings pay this; other load on the machine makes it worse, and less
#   predictable.

# %% [markdown]
# ## 3. The alpha-beta cost model
#
# Count steps and bytes and the cost of an algorithm follows. With S the bytes of the full
# array and N ranks:
#
# | collective | steps | bytes per step | time | bytes sent by the busiest rank |
# |---|---|---|---|---|
# | naive all-reduce | 2(N-1) on rank 0 | S | 2(N-1)(alpha + S beta) | (N-1) S |
# | ring reduce-scatter | N-1 | S/N | (N-1)(alpha + S/N beta) | (N-1)/N S |
# | ring all-gather (S = output) | N-1 | S/N | (N-1)(alpha + S/N beta) | (N-1)/N S |
# | ring all-reduce | 2(N-1) | S/N | 2(N-1)(alpha + S/N beta) | 2(N-1)/N S |
#
# The naive algorithm's time is set by rank 0's port, which receives N-1 full arrays one after
# another and then sends N-1: its bandwidth term grows with N, the ring's does not. Both have
# 2(N-1) latency terms: for small messages the ring is no faster. Algorithms with log2(N)
# steps fix that (recursive doubling, binomial trees; MPICH switches between them by message
# size, Thakur et al. 2005); NCCL uses trees across nodes for the same reason.
#
# **Exercise 12.3.** Write `collective_cost` from the table (assume N divides S). The tests run
# each algorithm on the simulator and compare its clock and byte counters with your formulas.

# %%
#| export
class Cost(NamedTuple):
    """Predicted seconds, and bytes sent by the busiest rank."""
    time: float
    bytes: float


COLLECTIVES = ("naive_allreduce", "ring_reduce_scatter", "ring_allgather", "ring_allreduce")

# %%
#| export
#| exercise 12.3
def collective_cost(name: str, nbytes: float, nranks: int, alpha: float, beta: float) -> Cost:
    """Alpha-beta prediction for collective `name` (one of COLLECTIVES) on `nranks` ranks.

    nbytes: S, the bytes of the whole array (of the result, for the all-gather); assume nranks
    divides it. alpha: seconds per message, beta: seconds per byte. Raises ValueError for an
    unknown name or nranks < 1."""
    ### BEGIN SOLUTION
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}: use one of {COLLECTIVES}")
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    n, s = nranks, float(nbytes)
    if name == "naive_allreduce":
        return Cost(2 * (n - 1) * (alpha + s * beta), (n - 1) * s)
    steps = (n - 1) if name in ("ring_reduce_scatter", "ring_allgather") else 2 * (n - 1)
    return Cost(steps * (alpha + s / n * beta), steps * s / n)
    ### END SOLUTION

# %% tags=["check"]
check("12.3")

# %% [markdown]
# Predicted lines and simulated points, 8 ranks, `alpha` = 5 us and `beta` = 0.1 ns/byte. Below
# about `N alpha / beta` (here 400 KB) the ring's time is flat: it is all latency, and for
# small messages the naive algorithm is as fast. Above, time grows linearly with S and the ring
# is N times faster than rank 0's bottleneck. The dotted line is a recursive-doubling
# all-reduce, log2(N) steps of a full-size exchange, `log2(N) (alpha + S beta)`: best for
# small messages, worst for large ones.

# %% tags=["demo"]
N, alpha, beta = 8, 5e-6, 1e-10
sizes = np.logspace(1, 8, 29 if not SMALL else 8)
fig, ax = plt.subplots(figsize=(7, 4.5))
for name, color in [("naive_allreduce", "C3"), ("ring_allreduce", "C0")]:
    ax.loglog(sizes, [collective_cost(name, s, N, alpha, beta).time for s in sizes], color=color, label=f"{name} (model)")
    points = sizes[::4] if not SMALL else sizes[::3]
    fn = naive_allreduce if name == "naive_allreduce" else ring_allreduce
    measured = []
    for s in points:
        vec = np.zeros(max(int(s) // 8 // N, 1) * N)
        measured.append((vec.nbytes, run(lambda comm, f=fn, v=vec: f(comm, v), N, alpha=alpha, beta=beta).time))
    ax.loglog(*zip(*measured), "o", color=color, label=f"{name} (simulated)")
ax.loglog(sizes, np.log2(N) * (alpha + sizes * beta), ":", color="gray", label="recursive doubling (model)")
ax.axvline(N * alpha / beta, color="k", lw=0.5)
ax.text(N * alpha / beta * 1.1, ax.get_ylim()[0] * 2, "S = N alpha / beta", fontsize=8)
ax.set(xlabel="message size S (bytes)", ylabel="time (s)", title=f"all-reduce on {N} ranks: alpha-beta model")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Live: the model for any ranks, latency and bandwidth (a 100 MB gradient marked): the naive
# line climbs with N, the ring's bandwidth term does not, and the crossover `N alpha / beta` moves.

# %% tags=["demo"]
from course.live import live


def draw_allreduce(ranks: int, alpha_us: float, gbytes_per_s: float):
    a, b = alpha_us * 1e-6, 1 / (gbytes_per_s * 1e9)
    sizes = np.logspace(1, 9, 60)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in [("naive_allreduce", "C3"), ("ring_allreduce", "C0")]:
        ax.loglog(sizes, [collective_cost(name, s, ranks, a, b).time for s in sizes], color=color, label=name)
    ax.loglog(sizes, np.log2(ranks) * (a + sizes * b), ":", color="gray", label="recursive doubling")
    ax.axvline(ranks * a / b, color="k", lw=0.5)
    ring = collective_cost("ring_allreduce", 1e8, ranks, a, b).time
    naive = collective_cost("naive_allreduce", 1e8, ranks, a, b).time
    ax.set(xlabel="message size S (bytes)", ylabel="time (s)", ylim=(1e-7, 1e3),
           title=f"N={ranks}: 100 MB takes {ring * 1e3:.1f} ms (ring), {naive * 1e3:.1f} ms (naive)")
    ax.legend(fontsize=8)
    return fig


live(draw_allreduce, ranks=(2, 64), alpha_us=(1.0, 50.0), gbytes_per_s=(1.0, 100.0))

# %% [markdown]
# ## 4. Data-parallel training
#
# Every rank builds the same model (the same seed, or rank 0's weights broadcast once, as
# PyTorch's DDP does at construction) and sees the same global batch of B examples. Rank r
# takes its rows, `chunk_bounds(B, N)[r]`, runs forward and backward on them, and then the
# ranks all-reduce every gradient and take the same optimizer step. Identical parameters,
# identical gradients, identical updates: the replicas never drift apart.
#
# The loss of the global batch is the mean over B examples. Rank r holds `b_r` of them; if it
# computes the mean over its own rows and scales it by `b_r / B`, the ranks' losses add up to
# the global loss, and so do their gradients. A sum all-reduce then gives every rank exactly
# the gradient of single-process training; when N divides B this is the familiar "average the
# gradients" (scale by 1/N). Averaging unscaled means instead is wrong whenever the shards
# differ in size. Goyal et al. (2017) is the classic account of what large-batch data
# parallelism needs to match small-batch training.
#
# Two traps. A parameter used twice in the model (a shared layer, tied embeddings) has one
# gradient, summed over its uses by the backward pass: reduce it once, or it is summed N times
# too many (`model.parameters()` lists each Parameter once). And a rank whose shard is empty
# (B < N) must still join every all-reduce, with zeros, or the others wait for it forever.
#
# **Exercise 12.4.** Write `dp_train_step`. `allreduce` is a function `allreduce(comm, array)`,
# for example your `ring_allreduce`; the tests pass their own.

# %%
#| export
#| exercise 12.4
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
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("12.4")

# %% [markdown]
# Training on lesson 03's three spirals: single-process training, 4 simulated ranks, and 4 MPI
# processes, from the same initial weights on the same batches (SGD with momentum, float64). The
# three loss curves lie on top of each other (from 1.04 to 0.11 in 150 steps); the largest
# parameter difference between one process and 4 ranks after 150 steps is 7e-16, because a sum
# of per-shard matmuls is rounded differently from one matmul over the whole batch. Between
# the two engines there is no difference at all: same code, same order of additions.
#
# At full size the cell trains 150 steps three times (the MPI run starts 4 processes on this
# machine's cores) and prints a line with the time of each run as it ends: 38 s of CPU in all
# measured here, so well under a minute on an idle 2-core laptop.

# %% tags=["demo"]
import time

from minitorch.data import make_spirals
from minitorch.nn import MLP
from minitorch.optim import SGD

X_spiral, y_spiral = make_spirals(600, 0.1, np.random.default_rng(0))
STEPS, BATCH = (20 if SMALL else 150), 90


def new_mlp(sizes=(2, 64, 64, 3), seed=0):
    model = MLP(list(sizes), rng=np.random.default_rng(seed))
    for p in model.parameters():
        p.data = p.data.astype(np.float64)
    return model


def train_spirals(comm, steps, allreduce):
    """Train on every rank; returns (per-step scaled losses of this rank, final parameters)."""
    model = new_mlp()
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(1)  # the same batches on every rank
    losses = []
    for _ in range(steps):
        idx = rng.choice(len(X_spiral), BATCH, replace=False)
        losses.append(dp_train_step(comm, model, opt, X_spiral[idx], y_spiral[idx], allreduce))
    return losses, [p.data for p in model.parameters()]


t0 = time.perf_counter()  # a line as each of the three runs ends: the progress
single = run(train_spirals, 1, STEPS, ring_allreduce)
print(f"1 process: {STEPS} steps in {time.perf_counter() - t0:.1f} s")
t0 = time.perf_counter()
sim4 = run(train_spirals, 4, STEPS, ring_allreduce)
print(f"4 simulated ranks: {STEPS} steps in {time.perf_counter() - t0:.1f} s")
curves = {"1 process": np.array(single.results[0][0]),
          "4 ranks (sim)": np.sum([r[0] for r in sim4.results], axis=0)}
diff = max(abs(a - b).max() for a, b in zip(single.results[0][1], sim4.results[0][1]))
print(f"{STEPS} steps: max |parameter difference| single vs 4 simulated ranks: {diff:.1e}")
if mpi_status()[0]:
    t0 = time.perf_counter()
    mpi4 = run(train_spirals, 4, STEPS, ring_allreduce, engine="mpi", timeout=300)
    print(f"4 MPI processes: {STEPS} steps in {time.perf_counter() - t0:.1f} s, start-up included")
    curves["4 ranks (mpi)"] = np.sum([r[0] for r in mpi4.results], axis=0)
    same = all(np.array_equal(a, b) for a, b in zip(sim4.results[0][1], mpi4.results[0][1]))
    print(f"MPI parameters bit-identical to the simulator's: {same}")
fig, ax = plt.subplots(figsize=(6, 3.5))
for (label, curve), style in zip(curves.items(), ["-", "--", ":"]):
    ax.plot(curve, style, label=label, lw=2)
ax.set(xlabel="step", ylabel="training loss", yscale="log", title="spirals, batch 90, SGD + momentum")
ax.legend()
plt.show()

# %% [markdown]
# ## 5. Gradient bucketing and overlap
#
# Section 4 computes all gradients, then communicates, then steps: the network sits idle during
# the backward pass and the processors sit idle during the all-reduce. But gradients become
# final one layer at a time, last layer first, while the backward pass walks back through the
# model. PyTorch's DistributedDataParallel (Li et al. 2020) exploits that:
#
# - Parameters are grouped into **buckets** of about `bucket_bytes` (25 MB by default), in
#   *reverse* order of `model.parameters()`, which is roughly the order their gradients
#   become ready. One all-reduce per bucket instead of per parameter: fewer messages, fewer
#   `alpha`s.
# - An autograd hook marks each gradient ready as soon as it is final. When every gradient of
#   the next bucket is ready, that bucket's all-reduce is **launched asynchronously** (on a
#   separate CUDA stream, with NCCL) and the backward pass continues. Buckets are launched in
#   the same order on every rank, or the collectives would mismatch.
# - Before the optimizer step, wait for all of them.
#
# Two given pieces make this possible here. `backward_with_hooks(loss, on_ready, comm)` is
# lesson 02's backward pass with two additions: it calls `on_ready(p)` as soon as leaf `p`'s
# gradient is final, right after the backward of the last op that uses `p` (lesson 02's
# engine reaches a weight late: its depth-first order lists the last layer's weight after the
# whole network below it), and it charges each node's backward to `comm.compute(flops=..., kind="B")`, so the
# simulated clock sees the backward pass layer by layer (`charge_forward` does the same for the
# forward). And `comm.launch(allreduce, flat)` runs the all-reduce on the rank's
# *communication stream*: a second clock that starts at the main clock's current time and runs
# independently of it, the way a CUDA stream does; `work.wait()` makes the main clock wait for
# it. (Under MPI, `launch` simply runs the collective; the overlap is modelled, not real.)

# %%
#| export
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

# %% [markdown]
# **Exercise 12.5.** Write `make_buckets` (DDP's rule: walk the parameters from last to first,
# add each to the current bucket, close the bucket as soon as it holds at least `bucket_bytes`
# bytes; a parameter is never split) and `dp_train_step_overlap`: section 4's step, with each
# bucket's gradients flattened into one array and all-reduced through `comm.launch` as soon as
# the bucket is complete and every earlier bucket has been launched. Parameters that got no
# gradient (or a rank with no rows) count as ready with zeros after the backward pass. The
# tests check the gradients, the order and sizes of the all-reduces, and that communication
# overlaps the backward pass on the simulated timeline.

# %%
#| export
#| exercise 12.5
def make_buckets(params: list, bucket_bytes: int) -> list[list[int]]:
    """Indices into `params`, grouped into buckets in reverse order (last parameter first).

    A bucket is closed as soon as its parameters' data hold >= bucket_bytes bytes; the
    remainder forms the last bucket. Raises ValueError if bucket_bytes <= 0."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def dp_train_step_overlap(comm: Communicator, model: Module, optimizer: Any, X: np.ndarray, y: np.ndarray,
                          allreduce: Callable, bucket_bytes: int) -> float:
    """dp_train_step with bucketed all-reduces launched during the backward pass.

    Buckets: make_buckets(model.parameters(), bucket_bytes). Forward (charged with
    charge_forward), backward with backward_with_hooks(loss, on_ready, comm); bucket k's
    flattened gradients go to comm.launch(allreduce, flat) once all of them are ready and
    buckets 0..k-1 are launched. Then wait for every bucket, set each p.grad to its summed
    slice, optimizer.step(). Returns this rank's scaled loss."""
    check_batch("dp_train_step_overlap", X, y)  # given: before anything is sent
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("12.5")

# %% [markdown]
# One training step of a 4-layer MLP (about 150 thousand parameters, 1.2 MB of float64
# gradients) on 4 simulated ranks, with one bucket (no overlap: the all-reduce starts after the
# backward pass) and with 256 KB buckets. The main row of each rank shows forward (blue) and
# backward (orange); the `comm` row below it shows the bucket all-reduces.

# %% tags=["demo"]
X_big = np.random.default_rng(0).standard_normal((128, 64))
y_big = np.random.default_rng(1).integers(0, 10, 128)


def one_step(comm, bucket_bytes):
    model = new_mlp((64, 256, 256, 256, 10))
    opt = SGD(model.parameters(), lr=0.01)
    dp_train_step_overlap(comm, model, opt, X_big, y_big, ring_allreduce, bucket_bytes)
    return [p.data for p in model.parameters()]


fig, axes = plt.subplots(2, 1, figsize=(10, 7))
timed = {}
for ax, (label, size) in zip(axes, [("one bucket", 1 << 40), ("256 KB buckets", 256 << 10)]):
    res = run(one_step, 4, size, alpha=5e-6, beta=1e-10, flop_rate=5e10)
    timed[label] = res
    res.plot(ax=ax, title=f"{label}: step {res.time * 1e3:.3f} ms (simulated)")
plt.tight_layout()
plt.show()
a, b = timed["one bucket"], timed["256 KB buckets"]
print(f"step time {a.time * 1e3:.3f} ms -> {b.time * 1e3:.3f} ms ({a.time / b.time:.2f}x); "
      f"max |parameter difference| {max(abs(p - q).max() for p, q in zip(a.results[0], b.results[0])):.1e}")

# %% [markdown]
# The 256 KB cap makes three buckets: the last two layers, the second layer, the first layer
# (each 256 x 256 weight is 512 KB, so it fills a bucket alone). With one bucket the step takes
# 0.790 ms, of which 0.211 ms is communication after the backward pass; with three, the first
# bucket's all-reduce starts 0.175 ms into the backward pass, the step takes 0.695 ms (1.14x),
# and only the first layer's bucket and what was queued behind the second remain after the
# backward pass. The parameters agree to rounding: an element's sum over the ranks is taken in the ring order of
# the chunk it falls in, and chunk boundaries move with the bucketing. Bucket size trades
# latency for overlap: tiny buckets pay `alpha` many times, one huge bucket cannot overlap.

# %% [markdown]
# ## 6. ZeRO: shard the model states
#
# Data parallelism replicates everything on every rank. With mixed-precision Adam that is, per
# parameter: 2 bytes of fp16 weights, 2 bytes of fp16 gradient, and K = 12 bytes of optimizer
# state (an fp32 master copy of the weight, Adam's fp32 momentum and variance): 16 bytes. A
# 7.5-billion-parameter model needs 120 GB per rank before a single activation is stored, more
# than any GPU had in 2020. ZeRO (Rajbhandari et al. 2020) removes the redundancy in three
# stages, with Ψ parameters and N ranks:
#
# | stage | sharded | memory per rank | 7.5B params, N = 64 |
# |---|---|---|---|
# | plain DP | nothing | (2 + 2 + K) Ψ | 120 GB |
# | 1 (P_os) | optimizer state | 2Ψ + 2Ψ + KΨ/N | 31.4 GB |
# | 2 (P_os+g) | + gradients | 2Ψ + (2 + K)Ψ/N | 16.6 GB |
# | 3 (P_os+g+p) | + parameters | (2 + 2 + K)Ψ/N | 1.9 GB |
#
# View all parameters as one flat vector and give rank r the slice `chunk_bounds(Ψ, N)[r]`. Rank
# r keeps Adam's state for its slice only and updates only its slice. For that it needs only
# its slice of the summed gradient: a **reduce-scatter** instead of an all-reduce. After the
# update every rank needs everyone's new weights: an **all-gather**. Reduce-scatter plus
# all-gather is exactly a ring all-reduce, so stages 1 and 2 communicate as much as plain DP,
# `2(N-1)/N Ψ` elements per rank and step. Stage 1 keeps the full gradient buffer (the
# reduce-scatter writes the summed slice into it); stage 2 releases it and keeps only its
# slice. Stage 3 also keeps only a slice of the weights: it all-gathers them before the forward
# pass and releases them after the backward pass, and needs no all-gather after the update.
# (DeepSpeed's stage 3 releases each layer's weights right after the layer's forward and
# gathers them again for its backward, so activations and weights never coexist in full: 3Ψ of
# traffic, 1.5x plain DP. We keep the gathered weights through the backward pass, which costs 2Ψ
# of traffic but holds the full weights during the step.)
#
# We compute in float64 (to compare with plain DP to 1e-12) and account bytes the way the paper
# does: 2 per working weight (`params`), 2 per gradient (`grads`), 4 per element of master
# weights, momentum and variance (`optimizer`). `ZeroAdam.memory()` (given) counts the
# elements of every array the rank holds, by role, counting a view once.
#
# **Exercise 12.6.** Write `zero_memory_per_rank` (the table's formulas) and the three
# methods of `ZeroAdam` that do the work: `gather_params`, `reduce_gradients` and `step`.

# %%
#| export
#| exercise 12.6
def zero_memory_per_rank(num_params: float, nranks: int, stage: int, K: int = 12) -> float:
    """Bytes of model states per rank under ZeRO `stage` (0 = plain data parallelism, 1, 2, 3)
    with mixed precision: 2 bytes per fp16 weight, 2 per fp16 gradient, K per parameter of
    optimizer state. Raises ValueError for another stage."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


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
        ### BEGIN SOLUTION
        if self.stage == 3:
            self.set_params(self.allgather(self.comm, self.param_shard))
        ### END SOLUTION

    def reduce_gradients(self) -> None:
        """After the backward pass: reduce-scatter flat_grads() so that grad_shard holds the
        summed gradient of lo:hi, and release the model's p.grad. Stage 1 keeps the full buffer
        (flat_grad, the sum written at lo:hi; grad_shard a view of it); stages 2, 3 keep only
        grad_shard (flat_grad None). Stage 3 also releases the weights (release_params)."""
        ### BEGIN SOLUTION
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
        ### END SOLUTION

    def step(self) -> None:
        """Adam on this rank's slice with grad_shard (the same arithmetic as minitorch.optim.Adam,
        t counting steps), then: stages 1, 2: all-gather the updated master slices into the model
        (set_params); stage 3: copy master into param_shard (no communication)."""
        ### BEGIN SOLUTION
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
        ### END SOLUTION

# %% tags=["check"]
check("12.6")

# %% [markdown]
# A training step with ZeRO is section 4's step with the three calls around it (given):

# %%
#| export
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

# %% [markdown]
# Three Adam steps of the spirals MLP on 4 simulated ranks, per stage: the parameters match
# plain data parallelism, the measured memory matches the formula (with this rank's slice size
# for Ψ/N), and the bytes sent per rank are those of one ring all-reduce. Then the paper's
# example, from your formula.

# %% tags=["demo"]
from minitorch.optim import Adam


def zero_run(comm, stage, steps=3):
    """(final flat parameters, memory held before the last update, bytes sent per step)."""
    model = new_mlp()
    if stage == 0:
        opt = Adam(model.parameters(), lr=1e-2)
        for _ in range(steps):
            dp_train_step(comm, model, opt, X_spiral[:90], y_spiral[:90], ring_allreduce)
        return np.concatenate([p.data.ravel() for p in model.parameters()]), None, comm.stats["bytes_sent"] / steps
    zero = ZeroAdam(comm, model, stage, lr=1e-2, reduce_scatter=ring_reduce_scatter, allgather=ring_allgather)
    for _ in range(steps):
        _, held = zero_train_step(comm, model, zero, X_spiral[:90], y_spiral[:90])
    sent = comm.stats["bytes_sent"] / steps
    zero.gather_params()
    return zero.flat_params(), held, sent


psi = new_mlp().num_parameters()
base = run(zero_run, 4, 0)
print(f"psi = {psi} parameters, 4 ranks. Paper units: 2 B/weight, 2 B/gradient, 12 B/parameter of Adam state")
print(f"{'stage':>6} {'max |dW| vs DP':>15} {'params':>8} {'grads':>8} {'optim':>8} {'bytes (rank 0)':>15} {'formula':>10} {'sent/step':>10}")
for stage in (1, 2, 3):
    res = run(zero_run, 4, stage)
    dw = abs(res.results[0][0] - base.results[0][0]).max()
    _, held, sent = res.results[0]
    measured = 2 * held["params"] + 2 * held["grads"] + 4 * held["optimizer"]
    shard = chunk_bounds(psi, 4)[0][1]
    formula = {1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}[stage]
    print(f"{stage:>6} {dw:>15.1e} {held['params']:>8} {held['grads']:>8} {held['optimizer']:>8} "
          f"{measured:>15} {formula:>10} {sent:>10.0f}")
print(f"plain DP (ring all-reduce) sends {base.results[0][2]:.0f} bytes per rank and step")
print("\nThe paper's example, 7.5e9 parameters on 64 GPUs:")
for stage in range(4):
    print(f"  stage {stage}: {zero_memory_per_rank(7.5e9, 64, stage) / 1e9:6.1f} GB per GPU")

# %% [markdown]
# ## 7. Activation checkpointing
#
# The backward pass needs the forward pass's intermediate results: every op keeps its inputs
# (lesson 02's VJP closures), so a network of L layers stores O(L) activations, which for
# large batches and long sequences outgrow the weights. Chen et al. (2016) trade compute for
# memory: cut the network into k segments, keep only each segment's *input*, run the segment's
# forward without recording the graph, and in the backward pass run the segment's forward
# again (now recording), then backpropagate through it. Memory: k kept inputs plus one
# segment's activations at a time, O(k + L/k), smallest at k = sqrt(L); cost: one extra
# forward pass. Large transformers are routinely trained this way (`torch.utils.checkpoint`).
#
# In minitorch a custom op is `x._record(out, parents, vjp, name)` (lesson 02's `logsumexp` is
# one): `out` becomes a graph node whose backward calls `vjp(g)`, which returns one gradient
# per parent (None for a parent that needs none). A checkpointed segment is such a node: its
# parents are its input and its parameters, and its `vjp` recomputes the segment and runs a
# nested `backward(g)`, which deposits the parameters' gradients directly in their `.grad`.
#
# One more thing matters for memory: lesson 02's graph nodes refer to themselves through their
# VJP closures, a reference cycle, so a graph that is no longer needed is freed only when
# Python's cycle collector runs, at some later allocation. PyTorch frees a graph during its
# backward pass. `free_graph(y)` (given) drops the graph below `y` at once; call it when the
# nested backward is done, or the recomputed activations of every segment pile up.
#
# **Exercise 12.7.** Write `checkpoint` and `checkpointed_forward`. Measuring (given):
# `stored_activation_bytes(loss)` adds up the graph's intermediate tensors;
# `peak_memory(fn)` runs `fn()` under `tracemalloc` (NumPy reports every array allocation
# to it) and returns the peak.

# %%
#| export
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

# %%
#| export
#| exercise 12.7
def checkpoint(fn: Callable[[Tensor], Tensor], x: Tensor, params: list) -> Tensor:
    """fn(x), without storing fn's intermediate results: fn runs under no_grad, and the returned
    node's backward recomputes fn on a detached copy of x (recording the graph this time) and
    backpropagates the incoming gradient through it. params: the Parameters fn uses; they get
    their gradients from that nested backward. Gradients equal those of fn(x) itself."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def checkpointed_forward(layers: list, x: Tensor, segments: int) -> Tensor:
    """The layers applied in order to x, cut into `segments` consecutive groups
    (chunk_bounds(len(layers), segments)), each run through checkpoint. Raises ValueError
    unless 1 <= segments <= len(layers)."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("12.7")

# %% [markdown]
# A 16-layer MLP (width 256, batch 256, float64; each activation is 512 KB, each layer keeps
# three: the matmul's output, the bias add's, the ReLU's): the activations stored after the
# forward pass and the peak memory of forward plus backward, for every number of segments k.

# %% tags=["demo"]
L, width, batch = (16, 256, 256) if not SMALL else (16, 64, 64)
rng = np.random.default_rng(0)
blocks = [Block(width, rng) for _ in range(L)]
xb = Tensor(rng.standard_normal((batch, width)))


def train_pass(segments):
    for b in blocks:
        b.zero_grad()
    h = xb
    if segments:
        h = checkpointed_forward(blocks, xb, segments)
    else:
        for b in blocks:
            h = b(h)
    loss = (h * h).mean()
    stored = stored_activation_bytes(loss)
    loss.backward()
    return stored


rows = []
for k in [0, 1, 2, 4, 8, 16]:
    stored, peak = peak_memory(lambda: train_pass(k))
    rows.append((k, stored, peak))
    print(f"{'no checkpointing' if k == 0 else f'{k:2d} segments':>16}: stored activations {stored / 1e6:6.2f} MB, "
          f"peak {peak / 1e6:6.2f} MB")
fig, ax = plt.subplots(figsize=(6, 3.5))
ks = [k for k, _, _ in rows[1:]]
ax.plot(ks, [p / 1e6 for _, _, p in rows[1:]], "o-", label="peak (forward + backward)")
ax.plot(ks, [s / 1e6 for _, s, _ in rows[1:]], "s-", label="stored after forward")
ax.axhline(rows[0][2] / 1e6, color="C0", ls=":", label="peak without checkpointing")
ax.axvline(np.sqrt(3 * L), color="gray", lw=0.5)
ax.text(np.sqrt(3 * L) * 1.05, ax.get_ylim()[1] * 0.9, "k = sqrt(3L)", fontsize=8)
ax.set(xscale="log", xticks=ks, xticklabels=ks, xlabel="segments k", ylabel="MB",
       title=f"{L}-layer MLP, activation checkpointing")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Measured at full size: without checkpointing the graph keeps 25.7 MB of activations and the
# pass peaks at 35.2 MB (the 8.4 MB of weight gradients are the rest). With k segments it keeps
# only k segment inputs (1.0 MB for k = 1 up to 8.9 MB for k = 16), and the peak is 24.7,
# 19.5, 18.4 and 20.5 MB for k = 2, 4, 8, 16: the backward pass adds one segment's recomputed
# activations, `3L/k` of them, to the `k` kept ones. `k + 3L/k` is smallest at
# `k = sqrt(3L)`, about 7 here; Chen et al.'s `sqrt(L)` counts one stored tensor per layer. One
# segment saves nothing (37.3 MB: the whole network is recomputed at once, on top of the
# gradients in flight). The price is one more forward pass: every layer runs twice.

# %% [markdown]
# ## 8. Beyond one node
#
# Everything so far ran on one machine, where MPI moves bytes between processes through shared
# memory. A cluster is nodes joined by a network that is many times slower than the links inside a
# node: on a DGX H100 every GPU reaches the seven others of its node over NVLink at 450 GB/s, and
# the rest of the cluster through its own 400 Gb/s NIC at 50 GB/s
# ([how a DGX H100 is wired](../hardware_notes/interconnects.md#how-a-dgx-h100-is-wired)). Two
# links, two pairs of alpha and beta.
#
# **The simulator's two-level topology.** `run(fn, N, nodes=M, alpha=..., beta=..., alpha_inter=...,
# beta_inter=...)` puts the N ranks on M nodes of P = N / M ranks each, in rank order (node 0 holds
# ranks 0 .. P-1), and charges a message between two nodes `alpha_inter + n beta_inter`, one inside a
# node `alpha + n beta`. Every rank has a link of its own to the network (a NIC per rank, as on GPU
# servers). `RunResult.bytes_between_nodes()` says what each rank sent across.
#
# **An emulated cluster.** On Linux, as root, the course makes a real one on this machine
# (`course.cluster.EmulatedCluster`, given; [emulating a cluster](../hardware_notes/interconnects.md#emulating-a-cluster-on-one-machine)):
# every rank gets a network namespace with one end of a veth pair, its NIC, plugged into a bridge,
# its switch; `tc`'s token bucket (tbf) caps each NIC at the link's rate; each node gets its own
# hostname and `/dev/shm`, so that MPI uses shared memory inside a node and TCP between nodes; and
# hydra's `mpiexec` starts one proxy per node through its ssh launcher, pointed at a script that
# enters the node's namespaces instead of logging in. Then `run(fn, 4, engine="mpi", nodes=2)`
# runs `fn` on 2 nodes of 2 ranks, and every byte between nodes crosses a veth and its counters.
# `make cluster NODES=2 PPN=2 LINK=2gbit` keeps one up (until Ctrl-C) for your own experiments;
# everything is removed afterwards, also after a Ctrl-C or a crash. Where this is not allowed (no
# root: most laptops), the cells below say why and the simulator stands in. Running the same code
# on a real cluster (a hostfile, Slurm): [MPI across nodes](../docs/mpi.md#across-nodes).
#
# Three given helpers measure either engine: `link_sweep` bounces messages between rank 0 and one
# peer (section 0's sweep, for any pair), `fit_link` fits `alpha + n beta` to the one-way times
# (alpha from the smallest message, beta from the large ones, which collectives send), and
# `best_times` times collectives (the best of a few trials, taking turns).

# %%
#| export
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

# %% [markdown]
# ### Measuring the two links
#
# Ranks 0 and 1 share a node, ranks 0 and 2 do not: one launch of 4 ranks on 2 nodes sweeps both
# pairs, from 1 byte to 4 MiB, and fits each. The cell prints the link's settings and the load.

# %% tags=["demo"]
from course.cluster import EmulatedCluster, cluster_status, read_nic_bytes

LINK = "2gbit"  # each NIC's rate on the emulated cluster


def both_links(comm, sizes, reps):
    """One-way times inside a node (rank 0 with 1) and between nodes (rank 0 with 2), on rank 0."""
    return link_sweep(comm, sizes, reps, peer=1), link_sweep(comm, sizes, reps, peer=2)


link_sizes = [4 ** k for k in range(0, 12 if not SMALL else 10, 1 if not SMALL else 3)]
cluster_ok, cluster_why = cluster_status()
links = None  # (alpha, beta) inside a node, (alpha, beta) between nodes, as measured
if cluster_ok:
    from minitorch.bench import load_report

    print(load_report())
    with EmulatedCluster(nodes=2, ppn=2, link=LINK) as cluster:
        print(cluster.describe())
        inside, across = run(both_links, 4, link_sizes, 10 if not SMALL else 3, engine="mpi", nodes=2).results[0]
    links = fit_link(link_sizes, inside), fit_link(link_sizes, across)
    print(f"{'bytes':>9} {'inside a node':>14} {'fit':>9} {'between nodes':>14} {'fit':>9}")
    for n_bytes, a, b in zip(link_sizes, inside, across):
        print(f"{n_bytes:>9} {a * 1e6:>12.1f}us {(links[0][0] + n_bytes * links[0][1]) * 1e6:>7.1f}us "
              f"{b * 1e6:>12.1f}us {(links[1][0] + n_bytes * links[1][1]) * 1e6:>7.1f}us")
    for name, (a, b) in zip(("inside a node", "between nodes"), links):
        print(f"{name}: alpha = {a * 1e6:.1f} us, beta = {b * 1e9:.3f} ns/byte ({1 / b / 1e9:.2f} GB/s)")
    print(f"the link between nodes is {links[1][1] / links[0][1]:.1f}x slower per byte than the one inside a node")
else:
    print(f"no emulated cluster here: {cluster_why}")
# %% [markdown]
# Measured here (the 2-vCPU Xeon VM, load average 8 from other jobs): inside a node 4.5 to 5.0 GB/s,
# between nodes 0.22 to 0.23 GB/s, 20 to 22x slower per byte, close to the 250 MB/s the token bucket
# allows. The two alphas came out alike, 14 to 22 us between nodes and 22 us inside a node (176 us in
# one run, when another job held the cores): the veth adds no latency (nothing here emulates a cable
# or a switch), so the inter-node alpha is software, TCP and UCX on both sides, and on two busy cores
# a small message's time is mostly the wait for the rank to be scheduled, on either link. On a real
# cluster the network's alpha is larger too (2.7 us per ring step for InfiniBand against 0.6 us for
# NVLink in NCCL's model, [interconnects](../hardware_notes/interconnects.md#alpha-and-beta-for-lessons-12-13)).
# Below a few hundred KiB the points leave the line: tbf lets a bucket's worth (the cell printed its
# size) through at full speed after a pause, and MPI changes protocol with the size: the fit is made
# for the large chunks collectives send.
#
# ### All-reduce across nodes
#
# Section 2's ring in rank order on M nodes of P ranks (N = MP) crosses the network at M of its N
# links: rank P-1 sends to rank P, 2P-1 to 2P, and so on. Every step moves S/N bytes over every link
# of the ring at once, and waits for the slowest, so on two levels the ring costs
# `2(N-1)(alpha_inter + S/N beta_inter)`: the network's price for all 2(N-1) steps, while the fast
# links inside the nodes wait. Only one rank per node uses its NIC.
#
# The **hierarchical all-reduce** (Horovod's hierarchical all-reduce; NCCL builds its trees and rings
# with the same awareness of nodes) works in three steps:
#
# 1. **reduce-scatter inside each node**: local rank i ends with chunk i of its node's sum, S/P bytes;
# 2. **all-reduce across nodes** among the ranks with the same local rank, one per node: local rank i
#    of every node all-reduces chunk i, so that it holds chunk i of the total. The P all-reduces run at
#    the same time, each on its own NIC, each moving S/P bytes instead of S;
# 3. **all-gather inside each node**: every rank gets the P finished chunks.
#
# `T = 2(P-1)(alpha + S/P beta) + 2(M-1)(alpha_inter + S/N beta_inter)`, and every rank sends
# `2(M-1) S/N` bytes across, against the ring's `2(N-1) S/N` from one rank per node. With a network
# 10x slower per byte than the node's links, on 2 nodes of 2 ranks and in the bandwidth term alone, the
# ring takes `1.5 S beta_inter` and the hierarchical all-reduce `0.1 S beta_inter + 0.5 S beta_inter`:
# 2.5x faster. `two_level_cost` (given) has both formulas.
#
# **Exercise 12.8.** Write `hierarchical_allreduce`. The three collectives come in as arguments
# (your ring's by default) and run on process groups (`comm.group`): `node`, the ranks of this rank's
# node, and `across`, the ranks with this rank's local rank, one per node. Chunks follow
# `chunk_bounds(n, ppn)` (the reduce-scatter's), so the all-gather puts them back in order.

# %%
#| export
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

# %%
#| export
#| exercise 12.8
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
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("12.8")
# %% [markdown]
# On the simulator first, where the model is exact: 2 nodes of 2 ranks and 4 nodes of 2, links
# inside a node of 5 us and 10 GB/s (`beta` = 0.1 ns/byte), a network of 10 us and 1 GB/s (10x
# slower per byte), 8 MiB of float64 per rank. The cell prints the prediction, the simulated time and
# the bytes that crossed, then draws the hierarchical all-reduce's timeline.

# %% tags=["demo"]
SIM_LINKS = dict(alpha=5e-6, beta=1e-10, alpha_inter=1e-5, beta_inter=1e-9)
vec = np.random.default_rng(0).standard_normal(2 ** 20)


def flat_and_hierarchical(comm, ppn, x):
    return ring_allreduce(comm, x), hierarchical_allreduce(comm, x, ppn)


print(f"{'nodes x ppn':>11} {'algorithm':>23} {'predicted ms':>13} {'simulated ms':>13} {'bytes across (busiest)':>23}")
for nodes, ppn in [(2, 2), (4, 2)]:
    for name, fn in [("ring_allreduce", ring_allreduce), ("hierarchical_allreduce", hierarchical_allreduce)]:
        job = (lambda comm, f=fn, p=ppn: f(comm, vec)) if fn is ring_allreduce else \
            (lambda comm, f=fn, p=ppn: f(comm, vec, p))
        res = run(job, nodes * ppn, nodes=nodes, **SIM_LINKS)
        pred = two_level_cost(name, vec.nbytes, nodes, ppn, *SIM_LINKS.values())
        print(f"{f'{nodes} x {ppn}':>11} {name:>23} {pred.time * 1e3:>13.3f} {res.time * 1e3:>13.3f} "
              f"{max(res.bytes_between_nodes()):>23}")
    if (nodes, ppn) == (2, 2):
        shown = res
shown.plot(title="hierarchical all-reduce, 2 nodes x 2 ranks: reduce-scatter in the node, all-reduce across, "
                 "all-gather in the node")
plt.show()

# %% [markdown]
# The prediction and the simulator agree to the last digit for the hierarchical all-reduce and for
# the ring: on 2 x 2 the hierarchical all-reduce is 2.5x faster (12.6 ms against 5.1 ms), on 4 x 2
# 2.1x (14.8 ms against 7.2 ms), and every rank sends a third (2 x 2) or 3/7 (4 x 2) of what the ring's
# busiest ranks send across. On the timeline the four ranks' reduce-scatter, the all-reduces across
# nodes and the all-gather follow each other; the network phase dominates.
#
# ### On the emulated cluster
#
# Now real processes on the emulated cluster: both all-reduces at six sizes (the best of three
# trials, taking turns), the prediction from the two links just measured, and the bytes each rank's
# NIC sent, read from the veth counters around one all-reduce, against the simulator's count (plus
# the communicator's 64-byte header per message). Last, a data-parallel step of section 4 across the
# cluster with your hierarchical all-reduce, against the simulator bit for bit.

# %% tags=["demo"]
def cluster_timings(comm, sizes, ppn, reps, trials):
    """Per size (bytes of float64): (bytes, ring seconds, hierarchical seconds), on every rank."""
    rows = []
    for nbytes in sizes:
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 8)
        t_ring, t_hier = best_times(comm, [lambda: ring_allreduce(comm, x), lambda: hierarchical_allreduce(comm, x, ppn)],
                                    reps, trials)
        rows.append((nbytes, t_ring, t_hier))
    return rows


def nic_bytes(comm, nics, nbytes, ppn):
    """On rank 0: per algorithm, the bytes each rank's NIC sent during one all-reduce (veth counters,
    read between barriers: the barriers' few bytes are in them)."""
    x = np.random.default_rng(comm.rank).standard_normal(nbytes // 8)
    out = []
    for op in (lambda: ring_allreduce(comm, x), lambda: hierarchical_allreduce(comm, x, ppn)):
        comm.barrier()
        before = read_nic_bytes(nics) if comm.rank == 0 else None
        comm.barrier()
        op()
        comm.barrier()
        if comm.rank == 0:
            out.append([after[0] - b[0] for after, b in zip(read_nic_bytes(nics), before)])
    return out if comm.rank == 0 else None


def across_count(res):
    """Per rank of a simulated run: (bytes, messages) it sent to other nodes."""
    msgs = [sum(res.node_of(e.peer) != res.node_of(r) for e in res.events(rank=r, kind="send")) for r in range(res.nranks)]
    return res.bytes_between_nodes(), msgs


sizes = [2 ** 16, 2 ** 20] if SMALL else [2 ** 14, 2 ** 16, 2 ** 18, 2 ** 20, 2 ** 22, 2 ** 24]
x_count = np.zeros(2 ** 17)  # 1 MiB
if cluster_ok:
    from minitorch.bench import load_report

    print(load_report())
    with EmulatedCluster(nodes=2, ppn=2, link=LINK) as cluster:
        print(cluster.describe())
        rows = run(cluster_timings, 4, sizes, 2, 3 if not SMALL else 1, 2 if not SMALL else 1, engine="mpi",
                   nodes=2, timeout=600).results[0]
        counted = run(nic_bytes, 4, cluster.nics(), x_count.nbytes, 2, engine="mpi", nodes=2).results[0]
        dp_mpi = run(train_spirals, 4, 5, lambda c, g: hierarchical_allreduce(c, g, 2), engine="mpi", nodes=2)
    (a_in, b_in), (a_x, b_x) = links
    print(f"{'bytes':>9} {'ring ms':>9} {'model':>8} {'hier. ms':>9} {'model':>8} {'speed-up':>9} {'model':>6}")
    for nbytes, t_ring, t_hier in rows:
        p_ring, p_hier = (two_level_cost(a, nbytes, 2, 2, a_in, b_in, a_x, b_x).time for a in TWO_LEVEL)
        print(f"{nbytes:>9} {t_ring * 1e3:>9.2f} {p_ring * 1e3:>8.2f} {t_hier * 1e3:>9.2f} {p_hier * 1e3:>8.2f} "
              f"{t_ring / t_hier:>8.2f}x {p_ring / p_hier:>5.2f}x")
    print(f"one all-reduce of {x_count.nbytes} bytes: what each rank's NIC sent (veth counters) against what the "
          "algorithm sends to other nodes on the simulator, plus the communicator's 64-byte header per message:")
    for name, nic, fn in (("ring", counted[0], ring_allreduce),
                          ("hierarchical", counted[1], lambda c, x: hierarchical_allreduce(c, x, 2))):
        algo, msgs = across_count(run(lambda comm, f=fn: f(comm, x_count), 4, nodes=2))
        want = [b + 64 * m for b, m in zip(algo, msgs)]
        print(f"  {name:>12}: NICs {nic}, algorithm {want}, NIC / algorithm "
              f"{' '.join(f'{a / b:.3f}' if b else '-' for a, b in zip(nic, want))}")
    dp_sim = run(train_spirals, 4, 5, lambda c, g: hierarchical_allreduce(c, g, 2), nodes=2)
    same = all(np.array_equal(a, b) for a, b in zip(dp_sim.results[0][1], dp_mpi.results[0][1]))
    print(f"5 data-parallel steps across the cluster with the hierarchical all-reduce: parameters bit-identical to "
          f"the simulator's: {same}")
else:
    print(f"no emulated cluster here: {cluster_why}")
# %% [markdown]
# What to read in the output above (your numbers will differ with the machine and its load; the
# pattern should not):
#
# - **The bytes are the algorithm's.** The ring's NICs on ranks 1 and 3 carry the algorithm's
#   `2(N-1)/N * S` bytes plus TCP/IP headers (the ratio printed is a few tenths of a percent above
#   1), ranks 0 and 2 only the barriers' few kilobytes; the hierarchical all-reduce's four NICs each
#   carry a third of the ring's busiest, as its formula says. The data-parallel steps across the
#   cluster give parameters bit-identical to the simulator's.
# - **The time is not quite the model's.** The model charges the steps inside a node at the
#   ping-pong's bandwidth, but a reduce-scatter also adds and copies, and here four ranks share two
#   cores: the node's all-reduce reaches a fraction of the ping-pong's rate, so with a 2 Gbit/s
#   network the node is only a few times faster than the link, not twenty, and the hierarchical
#   all-reduce wins by less than the model promises, and only from about 1 MiB up. `make bench`
#   (`benchmarks/bench_cluster.py`) measures the node's bus bandwidth first and sets the link to a
#   tenth of it; the recorded run in
#   [emulating a cluster](../hardware_notes/interconnects.md#emulating-a-cluster-on-one-machine)
#   shows the ring within a few percent of its model and the hierarchical all-reduce over 2x faster
#   from 256 KiB up. Below that the latencies dominate, and on busy cores they are noise.
#
# On GPUs the gap is what the model assumes: NVLink at 450 GB/s against 50 GB/s per NIC, and the
# additions run on the GPU at its memory bandwidth. That is why NCCL builds its rings and trees
# node by node and Horovod offers the hierarchical all-reduce
# (`HOROVOD_HIERARCHICAL_ALLREDUCE=1`): the slow link carries each byte once per node-local rank, and
# all NICs work at once.

# %% [markdown]
# Live: the model for any cluster. The network `slower` times slower per byte than the links inside a
# node (which run at 10 GB/s, alpha 5 us; the network's alpha 10 us): the hierarchical all-reduce's
# advantage grows with the ranks per node, which share its network traffic, and with the gap.

# %% tags=["demo"]
def draw_two_level(nodes: int, ppn: int, slower: float):
    a, b = 5e-6, 1e-10
    sizes = np.logspace(3, 9, 50)
    fig, ax = plt.subplots(figsize=(7, 4))
    times = {}
    for name, style in zip(TWO_LEVEL, ["C0-", "C2-"]):
        times[name] = [two_level_cost(name, s, nodes, ppn, a, b, 2 * a, slower * b).time for s in sizes]
        ax.loglog(sizes, times[name], style, label=name)
    big = two_level_cost("ring_allreduce", 1e8, nodes, ppn, a, b, 2 * a, slower * b).time / \
        two_level_cost("hierarchical_allreduce", 1e8, nodes, ppn, a, b, 2 * a, slower * b).time
    ax.set(xlabel="bytes per rank S", ylabel="time (s)", ylim=(1e-6, 1e2),
           title=f"{nodes} nodes x {ppn} ranks, network {slower:g}x slower per byte: 100 MB {big:.2f}x faster "
                 "hierarchically")
    ax.legend(fontsize=8)
    return fig


live(draw_two_level, nodes=(2, 16), ppn=(1, 8), slower=(1.0, 50.0))

# %% [markdown]
# ## Summary
#
# - Two primitives, `send` and `recv`, build every collective. The ring all-reduce moves
#   `2(N-1)/N * S` bytes per rank however many ranks there are; the naive one moves `(N-1) * S`
#   through rank 0.
# - The alpha-beta model predicts the simulator to the last digit, and tells which regime a
#   message is in: below `N alpha / beta` bytes, latency; above, bandwidth.
# - Data parallelism is single-process training with the batch split and the gradients
#   summed: equal to it to rounding, and, given the order of additions, bit for bit between a
#   simulator and real MPI processes.
# - Overlap hides communication behind the backward pass; buckets trade latency for overlap.
# - ZeRO shards the 16 bytes per parameter of mixed-precision Adam: 120 GB per GPU becomes
#   1.9 GB for a 7.5B-parameter model on 64 GPUs, for the same traffic as data parallelism
#   (stages 1, 2) or 1.5x (stage 3, as published).
# - Checkpointing stores O(sqrt(L)) activations instead of O(L) for one extra forward pass:
#   here a 35.2 MB peak became 18.4 MB.
# - Across nodes the network is the slow link (here 20x slower per byte than shared memory; on a
#   DGX H100, 9x slower than NVLink). The hierarchical all-reduce (reduce-scatter inside the node,
#   all-reduce across, all-gather inside) sends a third of the ring's bytes from the busiest NIC on
#   2 x 2, as the emulated cluster's veth counters confirmed; its speed-up depends on how much faster
#   the node really is than the network, the ranks' own arithmetic included.
#
# Lesson 13 splits the model itself over ranks (pipeline and tensor parallelism) with the same
# communicator.
#
# **Sources.** R. Hockney, *The communication challenge for MPP: Intel Paragon and Meiko CS-2*,
# Parallel Computing 20(3), 1994 (the alpha-beta model). R. Thakur, R. Rabenseifner, W. Gropp,
# *Optimization of collective communication operations in MPICH*, IJHPCA 19(1), 2005.
# P. Patarasuk, X. Yuan, *Bandwidth optimal all-reduce algorithms for clusters of
# workstations*, JPDC 69(2), 2009. A. Gibiansky, *Bringing HPC techniques to deep learning*,
# Baidu Research, 2017. A. Sergeev, M. Del Balso, *Horovod: fast and easy distributed deep
# learning in TensorFlow*, arXiv:1802.05799, 2018 (its hierarchical all-reduce: Horovod's
# documentation, `HOROVOD_HIERARCHICAL_ALLREDUCE`). NVIDIA NCCL, `src/graph/` (rings and trees built
# node by node). Linux `ip-netns(8)`, `tc-tbf(8)`; MPICH's Hydra (the emulated cluster).
# P. Goyal et al., *Accurate, large minibatch
# SGD: training ImageNet in 1 hour*, arXiv:1706.02677, 2017. S. Li et al., *PyTorch
# Distributed: experiences on accelerating data parallel training*, VLDB 13(12), 2020.
# S. Rajbhandari, J. Rasley, O. Ruwase, Y. He, *ZeRO: memory optimizations toward training
# trillion parameter models*, SC 2020. T. Chen, B. Xu, C. Zhang, C. Guestrin, *Training deep
# nets with sublinear memory cost*, arXiv:1604.06174, 2016. L. Dalcin, R. Paz, P. Kler,
# A. Cosimo, *Parallel distributed computing using Python*, Advances in Water Resources 34(9),
# 2011 (mpi4py).


# %%
#| export comm
#| given
from minitorch.checks import (Attrs, Choice, Func, Instance, Int, NonNegative, Optional, Positive,  # noqa: E402
                              Seq, Size, Str, Unchecked, validate_public)

# What a message costs in Python is what a small all-to-all or ring costs (see MPIComm), so the
# point-to-point methods check their arguments themselves, on a fast path: a rank or tag is
# refused by _check_rank / _check_tag, an array by _message_array / _irecv_buffer, a list of
# requests by _requests, each naming the argument and the value, before anything is sent.
_COMM = Attrs("rank", "size", "send", "recv")


def _comm_rules(namespace: dict, rules: dict) -> dict:
    """`rules` plus a duck-typed rule (an object with `rank`, `size`, `send`, `recv`) for every parameter
    hinted `Communicator` of the public functions and methods `namespace` (a module's globals)
    defines: a communicator is accepted from whichever copy of this module made it (the package's
    in an MPI rank, a lesson script's own classes when the lesson is loaded as a script)."""
    import inspect

    out = {key: dict(value) for key, value in rules.items()}
    module = namespace.get("__name__")

    def add(key: str, fn: Callable) -> None:
        for pname, param in inspect.signature(fn).parameters.items():
            hint = param.annotation if isinstance(param.annotation, str) else getattr(param.annotation, "__name__", "")
            if hint.replace(" ", "") in ("Communicator", "Communicator|None"):
                out.setdefault(key, {}).setdefault(pname, Optional(_COMM) if "None" in hint else _COMM)

    for name, obj in list(namespace.items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module:
            continue
        if inspect.isfunction(obj):
            add(name, obj)
        elif inspect.isclass(obj):
            for mname, member in vars(obj).items():
                raw = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                if (not mname.startswith("_") or mname == "__init__") and inspect.isfunction(raw) \
                        and raw.__code__.co_filename != "<string>":
                    add(name if mname == "__init__" else f"{name}.{mname}", raw)
    return out


_OWN = Unchecked()
_P2P = {"send": ("array", "dst", "tag"), "recv": ("src", "tag"), "sendrecv": ("array", "dst", "src", "tag", "recvtag"),
        "isend": ("array", "dst", "tag"), "irecv": ("out", "src", "tag"), "waitall": ("requests",)}
_ENGINES = (Communicator, SimComm, SubComm, MPIComm)
_COMPUTE = {"seconds": Optional(NonNegative), "flops": Optional(NonNegative), "kind": Str(), "label": Str()}
_LAUNCH = {"fn": Func()}
validate_public(globals(), _comm_rules(globals(), {
    **{f"{cls.__name__}.{method}": {name: _OWN for name in names}
       for cls in _ENGINES for method, names in _P2P.items() if method in vars(cls)},
    **{f"{cls.__name__}.compute": _COMPUTE for cls in _ENGINES if "compute" in vars(cls)},
    **{f"{cls.__name__}.launch": _LAUNCH for cls in _ENGINES if "launch" in vars(cls)},
    "chunk_bounds": {"n": _OWN, "parts": _OWN},  # every collective calls it: it checks its arguments itself
    "Work": {"result": _OWN, "done": NonNegative},
    "Request": {"kind": Choice("isend", "irecv"), "peer": Int(0), "tag": Int(0), "out": _OWN, "req": _OWN,
                "t": NonNegative},
    "Communicator.group": {"ranks": Seq(Int(), min_len=1)},
    "SubComm": {"ranks": Seq(Int(), min_len=1)},
    "SimComm": {"rank": Int(0)},
    "MPIComm": {"mpi_comm": Attrs("Get_rank", "Get_size", "Split_type", "Isend", "Irecv")},
    "RunResult.events": {"rank": Optional(Int()), "kind": Optional(Str()), "stream": Optional(Choice("main", "comm"))},
    "RunResult.plot": {"ax": Optional(Attrs("broken_barh", "set_yticks")), "title": Optional(Str())},
    "plot_timeline": {"result": Instance(RunResult), "ax": Optional(Attrs("broken_barh", "set_yticks")),
                      "title": Optional(Str())},
    "run": {"fn": Func(), "nranks": Size, "engine": Choice("sim", "mpi"), "alpha": NonNegative,
            "beta": NonNegative, "flop_rate": Positive, "timeout": Optional(Positive), "nodes": Optional(Size),
            "alpha_inter": Optional(NonNegative), "beta_inter": Optional(NonNegative)},
    "RunResult.node_of": {"r": Int(0)},
}))


# %%
#| export
#| given
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
