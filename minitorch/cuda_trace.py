# Generated from solutions/07_cuda_model.py by `make build`. Do not edit.
# The tracer is its own module (minitorch/cuda_trace.py): given code, apart from the exercises.
from __future__ import annotations

import re
import sys
import threading
from collections import defaultdict
from typing import Callable

import numpy as np


class Trace:
    """Every element access made to traced arrays during one simulated launch.

    An event is (array, kind, block, thread, warp, seq, epoch, offset): `kind` is "r" or "w";
    `block` the blockIdx (x, y, z); `thread` the linear thread id in the block
    (x + y*bx + z*bx*by); `warp` = thread // 32; `seq` = how many accesses of this kind to
    this array the thread made before (a warp's k-th accesses form one request); `epoch` =
    barriers the thread has passed; `offset` = flat element offset in the array.
    """

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.arrays: dict[str, "TracedArray"] = {}

    def _array(self, what: str, name: str) -> "TracedArray":
        if name not in self.arrays:
            raise ValueError(f"Trace.{what}: name must be a traced array, one of {sorted(self.arrays)}, got {name!r}")
        return self.arrays[name]

    def _events(self, what: str, name: str, kind: str | None) -> list[tuple]:
        self._array(what, name)
        return [e for e in self.events if e[0] == name and (kind is None or e[1] == kind)]

    def of(self, name: str, kind: str | None = None) -> list[tuple]:
        """The events of array `name`, of one kind ("r" or "w") or both (None), in order."""
        return self._events("of", name, kind)

    def shared_names(self) -> list[str]:
        """Names of the traced shared-memory arrays, in allocation order."""
        return [n for n in self.arrays if n.startswith("shared@")]

    def counts(self, name: str, kind: str = "r") -> np.ndarray:
        """int64 array shaped like array `name`: times each element was read ("r") or written ("w")."""
        arr = self._array("counts", name)
        c = np.zeros(arr.size, dtype=np.int64)
        for e in self._events("counts", name, kind):
            c[e[7]] += 1
        return c.reshape(arr.shape)

    def requests(self, name: str, kind: str = "r") -> dict[tuple, list[int]]:
        """Warp-wide requests: {(block, warp, seq): [flat offsets, one per active thread]}."""
        return self._requests("requests", name, kind)

    def _requests(self, what: str, name: str, kind: str) -> dict[tuple, list[int]]:
        req: dict[tuple, list[int]] = defaultdict(list)
        for e in self._events(what, name, kind):
            req[(e[2], e[4], e[5])].append(e[7])
        return dict(req)

    def coalescing(self, name: str, kind: str = "r", sector: int = 32) -> float:
        """Bytes the warps asked for / bytes in the `sector`-byte sectors fetched (1.0 = ideal)."""
        item = self._array("coalescing", name).itemsize
        used = fetched = 0
        for offsets in self._requests("coalescing", name, kind).values():
            used += len(set(offsets)) * item
            fetched += len({o * item // sector for o in offsets}) * sector
        return used / fetched if fetched else 1.0

    def bank_conflicts(self, name: str, kind: str | None = None, banks: int = 32) -> int:
        """Worst conflict degree of any warp request to shared array `name`: the most distinct
        4-byte words that one bank must serve (1 = conflict-free; same word = broadcast)."""
        item = self._array("bank_conflicts", name).itemsize
        worst = 1
        for k in ("r", "w") if kind is None else (kind,):
            for offsets in self._requests("bank_conflicts", name, k).values():
                per_bank: dict[int, set] = defaultdict(set)
                for o in offsets:
                    word = o * item // 4
                    per_bank[word % banks].add(word)
                worst = max(worst, max(len(v) for v in per_bank.values()))
        return worst

    def active_warps(self, name: str, kind: str = "w") -> int:
        """Distinct (block, epoch, warp) with an access to `name`: warps doing work, summed
        over the steps between barriers and over blocks."""
        return len({(e[2], e[6], e[4]) for e in self._events("active_warps", name, kind)})

    def per_thread(self, name: str, kind: str = "r") -> dict[tuple, int]:
        """{(block, thread): number of accesses of this kind to `name`}: the work of each thread."""
        out: dict[tuple, int] = defaultdict(int)
        for e in self._events("per_thread", name, kind):
            out[(e[2], e[3])] += 1
        return dict(out)

    def steps(self, name: str) -> int:
        """The most barriers any thread had passed when it accessed `name`, plus one: the number
        of barrier-separated steps in which the array was used."""
        return 1 + max((e[6] for e in self._events("steps", name, None)), default=-1)

    def lane_utilization(self, name: str, kind: str = "w") -> float:
        """Control divergence: the average fraction of a warp's 32 lanes active in its requests to
        `name` (1.0 = every lane of every warp that issued the instruction did work)."""
        req = self._requests("lane_utilization", name, kind)
        return sum(len(v) for v in req.values()) / (32 * len(req)) if req else 1.0


class TracedArray:
    """A NumPy array whose element reads and writes are recorded in a Trace (simulator only).

    Pass it to `simulate` in place of a device array. Indexing: integers only, one per
    dimension; negative indices wrap as in Numba; out-of-bounds raises IndexError.
    """

    def __init__(self, data: np.ndarray, name: str, trace: "Trace") -> None:
        self._data, self._name, self._trace = data, name, trace
        self.shape, self.ndim, self.size, self.dtype = data.shape, data.ndim, data.size, data.dtype
        self.itemsize = data.itemsize
        self._strides = tuple(s // data.itemsize for s in data.strides)
        trace.arrays[name] = self

    def __len__(self) -> int:
        return self.shape[0]

    def _offset(self, idx) -> tuple[tuple, int]:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != self.ndim:
            raise IndexError(f"array {self._name!r} has {self.ndim} dimensions, indexed with {len(idx)}")
        norm, off = [], 0
        for axis, (i, n, s) in enumerate(zip(idx, self.shape, self._strides)):
            if not isinstance(i, (int, np.integer)):
                raise TypeError(f"array {self._name!r}: index {i!r} is not an integer")
            j = int(i) + n if int(i) < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {n} "
                                 f"(array {self._name!r}, shape {self.shape})")
            norm.append(j)
            off += j * s
        return tuple(norm), off

    def _record(self, kind: str, off: int) -> None:
        t = threading.current_thread()
        seqs = t.__dict__.setdefault("_mt_seq", {})
        seq = seqs.get((self._name, kind), 0)
        seqs[(self._name, kind)] = seq + 1
        tid = t.thread_id
        self._trace.events.append((self._name, kind, (t.blockIdx.x, t.blockIdx.y, t.blockIdx.z),
                                   tid, tid // 32, seq, t.__dict__.get("_mt_epoch", 0), off))

    def __getitem__(self, idx):
        norm, off = self._offset(idx)
        self._record("r", off)
        return self._data[norm]

    def __setitem__(self, idx, value) -> None:
        norm, off = self._offset(idx)
        self._record("w", off)
        self._data[norm] = value


_STUB = re.compile(r"(Exercise \d+\.\d+: .*)$")


def simulate(kernel: Callable, grid: int | tuple[int, ...], block: int | tuple[int, ...], *args,
             trace: Trace | None = None) -> Trace:
    """Run `kernel[grid, block](*args)` in Numba's CUDA simulator on the CPU and trace it.

    grid and block: an int or a tuple of 1 to 3 ints, as in a launch (a block has at most 1024
    threads). Works with or without a GPU (the kernel's Python function is run). `TracedArray`
    arguments record their accesses; every `cuda.shared.array` the kernel allocates is a
    TracedArray named "shared@<line>", NaN-filled at the start of each block. Plain NumPy
    arrays may be passed too (not traced). Returns the Trace.
    """
    from numba.core import types
    from numba.cuda.errors import normalize_kernel_dimensions
    from numba.cuda.simulator.kernel import BlockManager
    from numba.cuda.simulator.kernelapi import FakeCUDAModule, swapped_cuda_module
    from numba.np import numpy_support

    trace = trace if trace is not None else Trace()
    fn = getattr(kernel, "py_func", kernel)
    grid_dim, block_dim = normalize_kernel_dimensions(grid, block)

    class TracedShared:
        def __init__(self) -> None:
            self._allocs: dict = {}
            self._lock = threading.Lock()  # threads allocate concurrently: one array per call site

        def array(self, shape, dtype):
            caller = sys._getframe(1)
            key = (caller.f_code.co_filename, caller.f_lineno)
            with self._lock:
                return self._alloc(key, shape, dtype)

        def _alloc(self, key, shape, dtype):
            if key not in self._allocs:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                data = np.empty(shape, dtype)
                if data.dtype.kind == "f":
                    data.fill(np.nan)
                self._allocs[key] = TracedArray(data, f"shared@{key[1]}", trace)
            return self._allocs[key]

    class TracingModule(FakeCUDAModule):
        @property
        def shared(self):
            return self._traced_shared

        def syncthreads(self):
            t = threading.current_thread()
            t._mt_epoch = t.__dict__.get("_mt_epoch", 0) + 1
            super().syncthreads()

    fake = TracingModule(grid_dim, block_dim, 0)
    try:
        with swapped_cuda_module(fn, fake):
            for grid_point in np.ndindex(*grid_dim):
                fake._traced_shared = TracedShared()  # shared memory lives as long as its block
                BlockManager(fn, grid_dim, block_dim, False).run(grid_point, *args)
    except NotImplementedError as exc:  # an unsolved exercise: keep the stub's message
        m = _STUB.search(str(exc))
        raise NotImplementedError(m.group(1) if m else str(exc)) from None
    return trace


from minitorch.checks import Choice, Func, Instance, Optional, Rule, Size, describe, validate_public  # noqa: E402


class _Dims(Rule):
    """A launch dimension: an int >= 1, or a tuple or list of `sizes` of them (x, y, z), with at most
    `max_threads` in all (a block: 1024). Numba's simulator would start as many threads as asked."""

    def __init__(self, sizes: tuple[int, ...] = (1, 2, 3), max_threads: int | None = None):
        self.sizes, self.max_threads = sizes, max_threads
        self.must = (("an int >= 1 or " if 1 in sizes else "") + f"a tuple of {' or '.join(map(str, sizes))} ints >= 1"
                     + (f", {max_threads} threads at most in all" if max_threads else ""))

    def __call__(self, what: str, name: str, value) -> None:
        dims = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if not isinstance(value, (tuple, list)) and 1 not in self.sizes:
            raise TypeError(f"{what}: {name} must be {self.must}, got {describe(value)}")
        for d in dims:
            if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
                raise TypeError(f"{what}: {name} must be {self.must}, got {describe(value)}")
        if len(dims) not in self.sizes or min(dims) < 1 or (self.max_threads and int(np.prod(dims)) > self.max_threads):
            raise ValueError(f"{what}: {name} must be {self.must}, got {describe(value)}")


_KIND = Choice("r", "w")

validate_public(globals(), {
    "Trace.of": {"kind": Optional(_KIND)},
    "Trace.counts": {"kind": _KIND},
    "Trace.requests": {"kind": _KIND},
    "Trace.coalescing": {"kind": _KIND, "sector": Size},
    "Trace.bank_conflicts": {"kind": Optional(_KIND), "banks": Size},
    "Trace.active_warps": {"kind": _KIND},
    "Trace.per_thread": {"kind": _KIND},
    "Trace.lane_utilization": {"kind": _KIND},
    "TracedArray": {"data": Instance(np.ndarray, must="a NumPy array")},
    "simulate": {"kernel": Func(), "grid": _Dims(), "block": _Dims(max_threads=1024)},
})
