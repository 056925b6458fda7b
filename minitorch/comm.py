# Generated from solutions/12_data_parallel.py by `make build`. Do not edit.
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
