# %% [markdown]
# # Lesson 07: the CUDA programming model, with Numba
#
# A GPU runs one function, the *kernel*, on many thousands of threads at once. This lesson
# teaches the model that makes that manageable: threads grouped into blocks, blocks into a
# grid; a global index per thread and a bounds guard; 2-D launches; shared memory and
# `syncthreads` inside a block; reductions and scans; a shared-memory tiled matmul; and
# memory coalescing. The hardware behind every rule is in [the GPU note](../hardware_notes/gpu.md).
#
# We write the kernels in Python with `numba.cuda`. On a machine without a GPU they run in
# Numba's **CUDA simulator**: each block's threads become Python threads, `syncthreads` is a
# real barrier, an out-of-bounds index raises `IndexError`, and a missing barrier gives wrong
# answers. The same kernels compile to PTX and run unchanged on an NVIDIA GPU, on NumPy arrays
# (copied to the device) or directly on CuPy arrays (Numba accepts any object with
# `__cuda_array_interface__`).
#
# The simulator is slow (measured on the 2-core dev machine: about 0.2 ms per simulated
# thread, more with many barriers), so all sizes here are small. **Timings under the
# simulator mean nothing about a GPU.** What the simulator can do that a GPU cannot is
# *watch every memory access*. We use that to grade structure, not just answers: how often
# each element is read from global memory, whether a warp's loads coalesce, whether shared
# memory accesses hit bank conflicts, how many warps do work in each step of a reduction.

# %% [markdown]
# The next cell must run before anything imports numba: numba reads `NUMBA_ENABLE_CUDASIM`
# once, at its first import. Where no NVIDIA driver is present we turn the simulator on. If you
# imported numba earlier in this kernel, restart the kernel and run this cell first.

# %%
import glob
import os
import shutil

if not (glob.glob("/dev/nvidia[0-9]*") or shutil.which("nvidia-smi")):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np

from course.check import check
from course.gpu import require_gpu

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %%
#| default_exp cuda_kernels
#| export
from __future__ import annotations

import glob
import os
import shutil

# The simulator must be chosen before numba is first imported (see the lesson's first cell).
if not (glob.glob("/dev/nvidia[0-9]*") or shutil.which("nvidia-smi")):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import re
import sys
import threading
from collections import defaultdict
from typing import Callable

import numpy as np
from numba import config, cuda

from minitorch.checks import check_int

SIMULATED: bool = bool(config.ENABLE_CUDASIM)

if SIMULATED:
    # Numba's simulator allocates a block's shared array when the first thread reaches the
    # `cuda.shared.array` line, with an unlocked check-then-create: two threads arriving at once
    # can get different arrays (seen here as rare wrong results). Same logic, under a lock.
    from numba.core import types as _types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared as _FakeShared
    from numba.np import numpy_support as _np_support

    _SHARED_LOCK = threading.Lock()

    def _locked_shared_array(self, shape, dtype):
        if isinstance(dtype, _types.Type):
            dtype = _np_support.as_dtype(dtype)
        if shape == 0:  # dynamic shared memory: one buffer for all
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with _SHARED_LOCK:
            if key not in self._allocations:
                self._allocations[key] = np.empty(shape, dtype)
            return self._allocations[key]

    _FakeShared.array = _locked_shared_array


def blocks_for(n: int, threads: int) -> int:
    """Blocks needed so that `blocks * threads >= n` (ceil division): a 1-D grid size. n >= 0
    elements, threads >= 1 per block."""
    n = check_int("blocks_for", "n", n, 0)
    threads = check_int("blocks_for", "threads", threads, 1)
    return (n + threads - 1) // threads


def _as_f32(what: str, name: str, x, ndim: int) -> np.ndarray:
    """`x` as a C-contiguous float32 array with `ndim` dimensions, or an error naming `what` and `name`."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"{what}: {name} must be a float32 array (these kernels are written for float32), "
                        f"got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{what}: {name} must be a {ndim}-D array, got shape {x.shape}")
    return np.ascontiguousarray(x)

# %% [markdown]
# ## Watching memory: a traced simulator run
#
# `simulate(kernel, grid, block, *args)` runs a kernel's Python function under the simulator's
# block manager (even on a machine with a GPU) and records, for every `TracedArray` argument
# and every `cuda.shared.array` the kernel allocates, each element access: which block, which
# thread, which warp (32 consecutive threads of a block, numbered x fastest), the how-many-th
# access of that thread it is, and how many barriers the thread has passed. Shared memory
# starts filled with NaN, so reading a slot nobody wrote yet shows up in the result. The tracer
# is given, not an exercise: it lives in `minitorch/cuda_trace.py`, imported below.
#
# From that record, `Trace` answers the questions the hardware cares about:
#
# - `counts(name)`: how many times each element was read (or written).
# - `coalescing(name)`: a warp's k-th load is one memory request; the memory system serves it
#   in 32-byte sectors. Efficiency = bytes the warp asked for / bytes in the sectors fetched.
#   Consecutive threads reading consecutive float32s: close to 1. A stride of a whole row: 4/32.
# - `bank_conflicts(name)`: shared memory is 32 banks of 4-byte words; a warp request whose
#   distinct words fall k to a bank takes k passes. 1 means conflict-free.
# - `active_warps(name)`: summed over the steps between barriers, how many warps touched the
#   array. A warp with one active thread costs as much issue time as a full one.
# - `lane_utilization(name)`: control divergence. The lanes of a warp issue each instruction
#   together; lanes whose branch is not taken sit idle. This is the average fraction of the 32
#   lanes that took part in the warp's requests to the array.
# - `per_thread(name)` and `steps(name)`: each thread's number of accesses, and the number of
#   barrier-separated steps: the work and the depth of a parallel algorithm.
#
# These model the hardware rules described in the CUDA C++ Programming Guide (sections on
# device memory accesses and shared memory); they are not a cycle-accurate simulator.

# %%
#| export cuda_trace
#| given
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

# %%
#| export cuda_trace
#| given
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

# %% [markdown]
# ## 1. Threads, blocks, grids, and the guard
#
# A launch `kernel[blocks, threads](args)` starts `blocks` blocks of `threads` threads each.
# Every thread runs the same function; it finds out who it is from `cuda.threadIdx.x` (its
# index in the block), `cuda.blockIdx.x` (its block) and `cuda.blockDim.x` (the block size).
# `cuda.grid(1)` is shorthand for `blockIdx.x * blockDim.x + threadIdx.x`: a unique global
# index, the element this thread owns.
#
# Blocks are the unit of scheduling: each runs entirely on one streaming multiprocessor (SM),
# its threads can share fast on-chip memory and meet at barriers, and different blocks cannot
# synchronise with each other inside a kernel. A block size is a multiple of 32 (the warp
# width) and at most 1024; 128 or 256 are common starting points.
#
# For `n` elements and `t` threads per block you launch `blocks_for(n, t)` = ceil(n / t)
# blocks, so the last block usually has threads with nothing to do. Each thread must test
# its index against the array size: the **bounds guard**. Without it, on a GPU the extra
# threads read and write past the end of the array, silently corrupting other data (or
# faulting); in the simulator you get an `IndexError`.
#
# **Exercise 7.1.** Write `vector_add_kernel`: one thread per element, `out[i] = a[i] + b[i]`,
# guarded.

# %%
#| export
#| exercise 7.1
@cuda.jit
def vector_add_kernel(a, b, out):
    """out[i] = a[i] + b[i] for i < out.shape[0]. 1-D float32 arrays of equal length; 1-D
    launch of at least len(out) threads, one element per thread."""
    ### BEGIN SOLUTION
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] + b[i]
    ### END SOLUTION

# %% [markdown]
# The host side copies inputs to the device, allocates the output there, launches, and copies
# back. (`cuda.to_device` and `copy_to_host` work in the simulator too. On a GPU, the copies
# over PCIe usually cost far more than this kernel: a real program keeps data on the device.)

# %%
#| export
THREADS_1D = 128


def vector_add(a: np.ndarray, b: np.ndarray, threads: int = THREADS_1D) -> np.ndarray:
    """a + b for 1-D float32 arrays of equal shape, computed by `vector_add_kernel`."""
    a, b = _as_f32("vector_add", "a", a, 1), _as_f32("vector_add", "b", b, 1)
    if a.shape != b.shape:
        raise ValueError(f"vector_add: a and b must have the same shape, got {a.shape} and {b.shape}")
    d_out = cuda.device_array(a.shape, np.float32)
    vector_add_kernel[blocks_for(a.shape[0], threads), threads](cuda.to_device(a), cuda.to_device(b), d_out)
    return d_out.copy_to_host()

# %% tags=["check"]
check("7.1")

# %% [markdown]
# What goes wrong without the guard: 1000 elements need 8 blocks of 128 = 1024 threads, and
# threads 1000 to 1023 index past the end. The simulator reports the first offending thread
# (`tid` is threadIdx, `ctaid` is blockIdx).

# %% tags=["demo"]
@cuda.jit
def unguarded_add(a, b, out):
    i = cuda.grid(1)
    out[i] = a[i] + b[i]


if SIMULATED:
    x = np.ones(1000, np.float32)
    try:
        unguarded_add[blocks_for(1000, 128), 128](x, x, np.empty_like(x))
    except IndexError as exc:
        print("IndexError:", exc)
else:
    print("On a real GPU this would write past the end of `out` without any error.")

# %% [markdown]
# Live: the launch for n elements and a block size. Each row is a block, each square a thread
# (in warps of 32); the grid is `blocks_for(n, threads)` blocks, and the threads past n (red) are
# the ones the guard `if i < n` turns away. A block size that is a multiple of 32 wastes at most
# one partial warp per grid; an odd one leaves a partial warp in every block.

# %% tags=["demo"]
import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap

from course.live import live


def draw_grid(n: int, threads: int):
    blocks = blocks_for(n, threads)
    i = np.arange(blocks * threads)
    img = np.where(i < n, (i % threads) // 32 % 2, 2).reshape(blocks, threads)
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.imshow(img, cmap=ListedColormap(["C0", "C9", "C3"]), vmin=0, vmax=2,
              aspect="auto", interpolation="nearest")
    ax.set(xlabel="threadIdx.x (light/dark: warps of 32)", ylabel="blockIdx.x",
           title=f"n={n}, {threads} threads/block: {blocks} blocks, {blocks * threads - n} idle threads "
                 f"({blocks * -(-threads // 32)} warps)")
    return fig


live(draw_grid, n=(1, 1000), threads=(32, 256, 32))

# %% [markdown]
# ## 2. Two-dimensional launches, and which index is x
#
# Grids and blocks can be 2-D (or 3-D): `kernel[(gx, gy), (bx, by)]`, and `cuda.grid(2)`
# returns `(x, y)`. The choice that matters is **which array axis x maps to**. Threads of a
# block are numbered x fastest, and each consecutive group of 32 forms a warp that issues its
# loads together. If x walks along the contiguous last axis (the column of a row-major
# matrix), a warp reads 32 neighbouring floats: 128 bytes, four 32-byte sectors, one
# *coalesced* request. If x walks down a column, each thread's float is a row apart and the
# warp needs 32 sectors for the same 128 useful bytes. So: `col, row = cuda.grid(2)`, with
# `col` from x, and a block like (32, 4) whose x extent is a whole warp.
#
# With 2-D grids the guard has two conditions: both `row` and `col` may run past the end.
#
# **Exercise 7.2.** Write `bias_relu_kernel`: `out[r, c] = max(x[r, c] + bias[c], 0)`, the
# epilogue of a linear layer, one thread per element, coalesced, guarded in both dimensions.
# The tests trace it and require coalescing efficiency >= 0.5 on `x` and `out`.

# %%
#| export
#| exercise 7.2
@cuda.jit
def bias_relu_kernel(x, bias, out):
    """out[r, c] = max(x[r, c] + bias[c], 0). x, out: (rows, cols) float32; bias: (cols,).
    2-D launch covering (cols, rows) in (x, y); x indexes columns, so warps coalesce."""
    ### BEGIN SOLUTION
    col, row = cuda.grid(2)
    if row < out.shape[0] and col < out.shape[1]:
        v = x[row, col] + bias[col]
        out[row, col] = v if v > 0 else np.float32(0.0)
    ### END SOLUTION

# %%
#| export
BLOCK_2D = (32, 4)


def bias_relu(x: np.ndarray, bias: np.ndarray, block: tuple[int, int] = BLOCK_2D) -> np.ndarray:
    """max(x + bias, 0) for x (rows, cols) float32 and bias (cols,) float32."""
    x, bias = _as_f32("bias_relu", "x", x, 2), _as_f32("bias_relu", "bias", bias, 1)
    if bias.shape[0] != x.shape[1]:
        raise ValueError(f"bias_relu: bias must have shape ({x.shape[1]},) for x of shape {x.shape}, got shape {bias.shape}")
    d_out = cuda.device_array(x.shape, np.float32)
    grid = (blocks_for(x.shape[1], block[0]), blocks_for(x.shape[0], block[1]))
    bias_relu_kernel[grid, block](cuda.to_device(x), cuda.to_device(bias), d_out)
    return d_out.copy_to_host()

# %% tags=["check"]
check("7.2")

# %% [markdown]
# The same kernel with x and y swapped (`row, col = cuda.grid(2)`, launched with a grid to
# match) computes the same answer, and the trace shows the cost: expect an efficiency near 1
# for the coalesced version (lower here, about 0.75, because rows of 45 floats do not start on
# sector boundaries and partial warps at the row ends) and 4/32 = 0.125 for the swapped one,
# whose warps walk 32 rows down one column.

# %% tags=["demo"]
@cuda.jit
def bias_relu_swapped(x, bias, out):
    row, col = cuda.grid(2)
    if row < out.shape[0] and col < out.shape[1]:
        v = x[row, col] + bias[col]
        out[row, col] = v if v > 0 else np.float32(0.0)


rng = np.random.default_rng(0)
xs, bs = rng.standard_normal((37, 45)).astype(np.float32), rng.standard_normal(45).astype(np.float32)
for kern, grid, block in [(bias_relu_kernel, (2, 10), (32, 4)), (bias_relu_swapped, (2, 12), (32, 4))]:
    tr = Trace()
    out = np.zeros_like(xs)
    simulate(kern, grid, block, TracedArray(xs, "x", tr), TracedArray(bs, "bias", tr), TracedArray(out, "out", tr), trace=tr)
    assert np.allclose(out, np.maximum(xs + bs, 0))
    print(f"{kern.__name__:18s} x reads: {tr.coalescing('x'):.3f}   out writes: {tr.coalescing('out', 'w'):.3f}")

# %% [markdown]
# ## 3. Shared memory, barriers, and a block reduction
#
# `cuda.shared.array(N, np.float32)` allocates `N` floats of on-chip shared memory per block
# (the size must be a compile-time constant: here a module constant). All threads of the block
# see the same array; it lives as long as the block. Shared memory is roughly as fast as L1
# cache, and it is how threads of a block cooperate.
#
# Cooperation needs ordering. `cuda.syncthreads()` is a barrier: no thread of the block passes
# it until all have reached it, and writes to shared memory before it are visible to every
# thread after it. Forget it and a thread reads a slot another thread has not written yet
# (or has already overwritten). Every thread of the block must reach the same barriers:
# a `syncthreads` inside a branch that only some threads take is undefined behaviour.
#
# A sum of `n` numbers in parallel is a tree: each block loads its elements into shared
# memory, then halves the number of active threads each step, every active thread adding two
# partial sums, with a barrier between steps; thread 0 writes the block's total. A second
# launch sums the block totals, and so on until one number is left (`gpu_sum`).
#
# *How* the tree pairs elements matters (Harris, 2007). The obvious *interleaved* version,
# below, lets thread `tid` work when `tid % (2*s) == 0`: the active threads are spread over
# every warp, so all warps stay busy (each running mostly idle lanes) for several steps.
# *Sequential addressing* instead keeps the active threads contiguous: in the step with
# stride `s`, threads `0..s-1` add `s_data[tid + s]` into `s_data[tid]`. Then whole warps
# retire, and once `s < 32` a single warp does all the work.
#
# **Exercise 7.3.** Write `block_sum_kernel` with sequential addressing. Block size is the
# module constant `REDUCE_THREADS`; the grid may have threads past the end of `x` (load 0
# there). The tests check the sum, that each element of `x` is read once, and the shape of the
# tree from the trace: log2(REDUCE_THREADS) barrier-separated steps, no thread reading more than
# 2 log2(REDUCE_THREADS) + 2 partial sums (thread 0 adding all 128 in a loop reads 128), and
# active warps at most 1.5 times the ideal for sequential addressing (the interleaved version
# uses about 2.25 times).

# %%
#| export
REDUCE_THREADS = 128


@cuda.jit
def interleaved_block_sum_kernel(x, partial):
    """The naive tree: partial[block] = sum of the block's REDUCE_THREADS elements of x,
    pairing neighbours at distance 1, 2, 4, ... (divergent warps)."""
    s_data = cuda.shared.array(REDUCE_THREADS, np.float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    s_data[tid] = x[i] if i < x.shape[0] else np.float32(0.0)
    cuda.syncthreads()
    s = 1
    while s < REDUCE_THREADS:
        if tid % (2 * s) == 0:
            s_data[tid] += s_data[tid + s]
        cuda.syncthreads()
        s *= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s_data[0]

# %%
#| export
#| exercise 7.3
@cuda.jit
def block_sum_kernel(x, partial):
    """partial[b] = sum of x[b*R : (b+1)*R] (R = REDUCE_THREADS; missing elements count 0).
    x: (n,) float32; partial: (blocks,) float32; launch [blocks, REDUCE_THREADS].
    Tree in shared memory with sequential addressing and a barrier after every step."""
    ### BEGIN SOLUTION
    s_data = cuda.shared.array(REDUCE_THREADS, np.float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    s_data[tid] = x[i] if i < x.shape[0] else np.float32(0.0)
    cuda.syncthreads()
    s = REDUCE_THREADS // 2
    while s > 0:
        if tid < s:
            s_data[tid] += s_data[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s_data[0]
    ### END SOLUTION

# %%
#| export
def gpu_sum(x: np.ndarray, kernel: Callable | None = None) -> float:
    """Sum of a 1-D float32 array: block sums, then block sums of those, until one is left.
    kernel: a @cuda.jit kernel with block_sum_kernel's contract (default: block_sum_kernel)."""
    kernel = block_sum_kernel if kernel is None else kernel
    x = _as_f32("gpu_sum", "x", x, 1)
    if x.shape[0] == 0:
        return 0.0
    d, n = cuda.to_device(x), x.shape[0]
    while n > 1:
        blocks = blocks_for(n, REDUCE_THREADS)
        d_partial = cuda.device_array(blocks, np.float32)
        kernel[blocks, REDUCE_THREADS](d, d_partial)
        d, n = d_partial, blocks
    return float(d.copy_to_host()[0])

# %% tags=["check"]
check("7.3")

# %% [markdown]
# Both trees give the same sum; the trace shows how many warps had to issue instructions, and
# how many of their lanes did work when they did (control divergence: a warp issues an `if`'s
# body once for all 32 lanes, and lanes whose condition is false idle through it). For 128
# threads (4 warps) per block, sequential addressing needs 4 warps for the load plus
# 2+1+1+1+1+1+1 for the seven steps, 12 per block; the interleaved tree needs 27, each
# running mostly idle lanes (measured: 30 % of lanes busy per warp request, against 66 %). Then the same kernel with the barrier inside the loop deleted:
# partial sums are read before the threads that own them have added into them, and the sum is
# wrong (on a GPU the error depends on timing, and a run may even come out right by luck).

# %% tags=["demo"]
xs = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
blocks = blocks_for(xs.size, REDUCE_THREADS)
for kern in (interleaved_block_sum_kernel, block_sum_kernel):
    tr, part = Trace(), np.zeros(blocks, np.float32)
    simulate(kern, blocks, REDUCE_THREADS, xs, part, trace=tr)
    sh = tr.shared_names()[0]
    print(f"{kern.__name__:30s} sum {part.sum():9.4f} (numpy {xs.sum():9.4f})  "
          f"active warps per block: {tr.active_warps(sh) / blocks:.0f}, "
          f"lanes busy per warp request: {tr.lane_utilization(sh):.0%}")


@cuda.jit
def block_sum_no_barrier(x, partial):
    s_data = cuda.shared.array(REDUCE_THREADS, np.float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    s_data[tid] = x[i] if i < x.shape[0] else np.float32(0.0)
    cuda.syncthreads()
    s = REDUCE_THREADS // 2
    while s > 0:
        if tid < s:
            s_data[tid] += s_data[tid + s]
        s //= 2  # no cuda.syncthreads() here
    if tid == 0:
        partial[cuda.blockIdx.x] = s_data[0]


part = np.zeros(blocks, np.float32)
simulate(block_sum_no_barrier, blocks, REDUCE_THREADS, xs, part)
print("without the barrier:", part.sum())

# %% [markdown]
# Beyond this: the last 32 steps of a reduction are usually done inside one warp with shuffle
# instructions (`cuda.shfl_down_sync`), which exchange registers without shared memory or
# block barriers; and each thread first sums many elements in a grid-stride loop, so few
# blocks are needed. Numba's simulator does not implement shuffles, so we stop at shared
# memory; the [GPU note](../hardware_notes/gpu.md) explains warps and SIMT.

# %% [markdown]
# ## 4. A prefix scan in a block
#
# An inclusive scan turns `x` into `y[i] = x[0] + ... + x[i]`. It is the parallel primitive
# behind stream compaction, radix sort, and the cumulative sums in samplers. The Hillis-Steele
# scan (Hillis and Steele, 1986) does it in log2(B) steps for a block of B elements: in the step
# with distance `d = 1, 2, 4, ...`, every thread with `tid >= d` adds the value `d` slots to
# its left. It does O(B log B) additions (the work-efficient Blelloch scan does O(B)), but it is
# short and has a subtle point: in each step every thread must *read* its neighbour's old
# value before anyone *writes* a new one. Read into a register, `syncthreads()`, write,
# `syncthreads()`: two barriers per step.
#
# Across blocks, each block scans its own chunk and writes its total to `block_sums`; the
# host scans those totals (few of them) and a second kernel, `add_offsets_kernel`, adds to every
# element the sum of all earlier blocks (Harris, Sengupta and Owens, 2007, describe the same
# three phases).
#
# **Exercise 7.4.** Write `block_scan_kernel`: Hillis-Steele inclusive scan of each block's
# `SCAN_THREADS` elements (treat missing elements as 0, write only in-bounds outputs) and the
# block total into `block_sums[blockIdx.x]`.

# %%
#| export
#| exercise 7.4
SCAN_THREADS = 64


@cuda.jit
def block_scan_kernel(x, out, block_sums):
    """Per block of S = SCAN_THREADS elements: out[b*S + t] = x[b*S] + ... + x[b*S + t]
    (inclusive, restarting at each block), block_sums[b] = the block's total.
    x, out: (n,) float32; block_sums: (blocks,) float32; launch [blocks, SCAN_THREADS]."""
    ### BEGIN SOLUTION
    buf = cuda.shared.array(SCAN_THREADS, np.float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    buf[tid] = x[i] if i < x.shape[0] else np.float32(0.0)
    cuda.syncthreads()
    d = 1
    while d < SCAN_THREADS:
        v = buf[tid - d] if tid >= d else np.float32(0.0)
        cuda.syncthreads()  # everyone has read the old values
        buf[tid] += v
        cuda.syncthreads()  # everyone has written the new ones
        d *= 2
    if i < x.shape[0]:
        out[i] = buf[tid]
    if tid == SCAN_THREADS - 1:
        block_sums[cuda.blockIdx.x] = buf[tid]
    ### END SOLUTION

# %%
#| export
@cuda.jit
def add_offsets_kernel(out, offsets):
    """out[i] += offsets[i // blockDim.x]: add each block's carry-in. Launch like the scan."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] += offsets[cuda.blockIdx.x]


def gpu_cumsum(x: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of a 1-D float32 array: block scans + carried block totals."""
    x = _as_f32("gpu_cumsum", "x", x, 1)
    n = x.shape[0]
    if n == 0:
        return x.copy()
    blocks = blocks_for(n, SCAN_THREADS)
    d_out = cuda.device_array(n, np.float32)
    d_sums = cuda.device_array(blocks, np.float32)
    block_scan_kernel[blocks, SCAN_THREADS](cuda.to_device(x), d_out, d_sums)
    if blocks > 1:
        sums = d_sums.copy_to_host().astype(np.float64)
        offsets = np.concatenate([[0.0], np.cumsum(sums[:-1])]).astype(np.float32)
        add_offsets_kernel[blocks, SCAN_THREADS](d_out, cuda.to_device(offsets))
    return d_out.copy_to_host()

# %% tags=["check"]
check("7.4")

# %% [markdown]
# ## 5. Matrix multiply, the direct way
#
# One thread per output element: thread `(col, row)` walks `k` and accumulates
# `a[row, k] * b[k, col]` in a register. With x on columns, a warp reads 32 consecutive
# elements of a row of `b` (coalesced) and one element of `a` (a broadcast), and writes 32
# consecutive outputs. Every element of `a` is read from global memory once per output column,
# `n` times in all, and every element of `b` `m` times: 2 loads per multiply-add. On an H100,
# whose HBM delivers about 3.35 TB/s and whose cores about 67 TFLOP/s in FP32 (see the
# [GPU note](../hardware_notes/gpu.md)), a kernel needing 8 bytes per 2 flops would reach a few
# percent of peak if every load went to DRAM; caches help, but the fix is to reuse data on chip.
#
# One detail from lesson 06 matters even more here: Numba types the literal `0.0` as float64,
# so `acc = 0.0` makes the accumulator, and every `acc += a[row, k] * b[k, col]`, double
# precision. On a GPU that is a different, slower unit: FP64 runs at half the FP32 rate on an
# H100 and at 1/64 of it on GeForce cards (NVIDIA's H100 and Ada whitepapers). Start float32
# accumulators from `np.float32(0.0)`. (Under the simulator both give float32 results, because
# NumPy 2 keeps `float32 + Python float` in float32; the compiled kernel does not.)
#
# **Exercise 7.5.** Write `matmul_naive_kernel`: guarded, x on columns, accumulating in float32.
# The tests check the result against NumPy, count reads (exactly `n` per element of `a`, `m` per
# element of `b`), and look for accumulators started from a float literal.

# %%
#| export
#| exercise 7.5
@cuda.jit
def matmul_naive_kernel(a, b, out):
    """out = a @ b. a: (m, k), b: (k, n), out: (m, n), all float32. 2-D launch covering
    (n, m) in (x, y); one thread per output element, accumulating in a register."""
    ### BEGIN SOLUTION
    col, row = cuda.grid(2)
    if row < out.shape[0] and col < out.shape[1]:
        acc = np.float32(0.0)  # 0.0 would make acc, and every += below, float64
        for k in range(a.shape[1]):
            acc += a[row, k] * b[k, col]
        out[row, col] = acc
    ### END SOLUTION

# %%
#| export
MATMUL_BLOCK = (32, 4)


def _check_matmul(what: str, a, b) -> tuple[np.ndarray, np.ndarray]:
    a, b = _as_f32(what, "a", a, 2), _as_f32(what, "b", b, 2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: shape mismatch: a {a.shape} @ b {b.shape}: inner dimensions {a.shape[1]} != {b.shape[0]}")
    return a, b


def matmul_naive(a: np.ndarray, b: np.ndarray, block: tuple[int, int] = MATMUL_BLOCK) -> np.ndarray:
    """a @ b for float32 matrices (m, k) and (k, n), by `matmul_naive_kernel`."""
    a, b = _check_matmul("matmul_naive", a, b)
    m, n = a.shape[0], b.shape[1]
    d_out = cuda.device_array((m, n), np.float32)
    grid = (blocks_for(n, block[0]), blocks_for(m, block[1]))
    matmul_naive_kernel[grid, block](cuda.to_device(a), cuda.to_device(b), d_out)
    return d_out.copy_to_host()

# %% tags=["check"]
check("7.5")

# %% [markdown]
# ## 6. Tiled matmul in shared memory
#
# A block computes a TILE x TILE patch of the output. It walks `k` in steps of TILE: in each
# pass, the block's TILE x TILE threads cooperatively load one tile of `a` (rows of the patch,
# columns `t*TILE ...`) and one tile of `b` into shared memory, one element per thread, wait
# at a barrier, and then each thread does TILE multiply-adds reading only shared memory; a
# second barrier keeps the next pass's loads from overwriting a tile that others still read.
# Each element loaded from global memory is now used TILE times, so global traffic drops by a
# factor of TILE: every element of `a` is read once per block *column* of the output,
# ceil(n / TILE) times, instead of n times. This is the kernel in the CUDA C++ Programming
# Guide's shared-memory section, and the start of every fast GEMM (Boehm, 2022, goes from here
# to cuBLAS-level speed).
#
# Edges: when `m`, `n` or `k` is not a multiple of TILE, threads whose element lies outside
# load 0 into the tile instead (so the multiply-adds stay correct), and only threads inside
# `out` write. Every thread, including those outside, must still reach both barriers.
#
# `TILE` is 8 under the simulator (64 Python threads per block) and 16 on a GPU. Loading
# `a_tile[ty, tx]` from `a[row, t*TILE + tx]` and `b_tile[ty, tx]` from `b[t*TILE + ty, col]`
# keeps both loads coalesced (consecutive `tx`, consecutive addresses).
#
# **Exercise 7.6.** Write `matmul_tiled_kernel` for a launch with blocks of (TILE, TILE),
# accumulating in float32. The tests check the result on sizes that are not multiples of TILE,
# and that each element of `a` is read from global memory exactly ceil(n / TILE) times, each
# element of `b` exactly ceil(m / TILE) times, and each element of `out` written once.

# %%
#| export
#| exercise 7.6
TILE = 8 if SIMULATED else 16


@cuda.jit
def matmul_tiled_kernel(a, b, out):
    """out = a @ b with TILE x TILE shared-memory tiles. a: (m, k), b: (k, n), out: (m, n),
    float32. Launch grid (ceil(n/TILE), ceil(m/TILE)), block (TILE, TILE); block (bx, by)
    computes out[by*TILE : (by+1)*TILE, bx*TILE : (bx+1)*TILE]."""
    ### BEGIN SOLUTION
    a_tile = cuda.shared.array((TILE, TILE), np.float32)
    b_tile = cuda.shared.array((TILE, TILE), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col = cuda.blockIdx.x * TILE + tx
    row = cuda.blockIdx.y * TILE + ty
    m, k_dim = a.shape
    n = b.shape[1]
    acc = np.float32(0.0)
    for t in range((k_dim + TILE - 1) // TILE):
        ka = t * TILE + tx
        a_tile[ty, tx] = a[row, ka] if row < m and ka < k_dim else np.float32(0.0)
        kb = t * TILE + ty
        b_tile[ty, tx] = b[kb, col] if kb < k_dim and col < n else np.float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += a_tile[ty, kk] * b_tile[kk, tx]
        cuda.syncthreads()
    if row < m and col < n:
        out[row, col] = acc
    ### END SOLUTION

# %%
#| export
def matmul_tiled(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for float32 matrices (m, k) and (k, n), by `matmul_tiled_kernel`."""
    a, b = _check_matmul("matmul_tiled", a, b)
    m, n = a.shape[0], b.shape[1]
    d_out = cuda.device_array((m, n), np.float32)
    grid = (blocks_for(n, TILE), blocks_for(m, TILE))
    matmul_tiled_kernel[grid, (TILE, TILE)](cuda.to_device(a), cuda.to_device(b), d_out)
    return d_out.copy_to_host()

# %% tags=["check"]
check("7.6")

# %% [markdown]
# Global reads per element, naive against tiled, on the same product (both traced under the
# simulator). Expect naive to read each `a` element n times and tiled ceil(n / TILE) times.

# %% tags=["demo"]
rng = np.random.default_rng(2)
m, k, n = (12, 10, 20) if SMALL else (24, 30, 40)
A, B = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
for name, kern, grid, block in [
    ("naive", matmul_naive_kernel, (blocks_for(n, 32), blocks_for(m, 4)), (32, 4)),
    ("tiled", matmul_tiled_kernel, (blocks_for(n, TILE), blocks_for(m, TILE)), (TILE, TILE)),
]:
    tr, out = Trace(), np.zeros((m, n), np.float32)
    simulate(kern, grid, block, TracedArray(A, "a", tr), TracedArray(B, "b", tr), TracedArray(out, "out", tr), trace=tr)
    assert np.allclose(out, A @ B, atol=1e-4)
    print(f"{name}: reads per a element {tr.counts('a').mean():5.1f}, per b element {tr.counts('b').mean():5.1f}, "
          f"global loads in total {len(tr.of('a', 'r')) + len(tr.of('b', 'r'))}")

# %% [markdown]
# And with the first barrier removed, threads multiply tile slots that their neighbours have
# not loaded yet (NaN in the traced shared memory):

# %% tags=["demo"]
@cuda.jit
def matmul_tiled_no_barrier(a, b, out):
    a_tile = cuda.shared.array((TILE, TILE), np.float32)
    b_tile = cuda.shared.array((TILE, TILE), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col, row = cuda.blockIdx.x * TILE + tx, cuda.blockIdx.y * TILE + ty
    acc = np.float32(0.0)
    for t in range((a.shape[1] + TILE - 1) // TILE):
        ka, kb = t * TILE + tx, t * TILE + ty
        a_tile[ty, tx] = a[row, ka] if row < a.shape[0] and ka < a.shape[1] else np.float32(0.0)
        b_tile[ty, tx] = b[kb, col] if kb < b.shape[0] and col < b.shape[1] else np.float32(0.0)
        for kk in range(TILE):  # no barrier before reading the tiles
            acc += a_tile[ty, kk] * b_tile[kk, tx]
        cuda.syncthreads()
    if row < out.shape[0] and col < out.shape[1]:
        out[row, col] = acc


out = np.zeros((m, n), np.float32)
simulate(matmul_tiled_no_barrier, (blocks_for(n, TILE), blocks_for(m, TILE)), (TILE, TILE), A, B, out)
print("wrong elements without the barrier:", int((~np.isclose(out, A @ B, atol=1e-4)).sum()), "of", out.size)

# %% [markdown]
# ## 7. Coalescing a transpose through shared memory, and bank conflicts
#
# A transpose reads `a[r, c]` and writes `out[c, r]`. Whichever index x follows, one of the two
# accesses is strided by a whole row: uncoalesced. The fix (Harris, 2013) is to stage a
# 32 x 32 tile in shared memory: read it from `a` with x along `a`'s rows (coalesced), barrier,
# then write it to `out` with x along `out`'s rows (coalesced), reading the tile *by column*.
#
# Reading a shared tile by column brings in a second rule. Shared memory has 32 banks, each
# serving one 4-byte word per cycle; word `w` lives in bank `w % 32`. In a `float32[32, 32]`
# tile, a column's 32 words are 32 apart, all in the same bank: a 32-way **bank conflict**,
# served in 32 passes. Padding each row to 33 floats shifts each row by one bank, so a column
# touches all 32 banks once.
#
# Blocks are (32, 8): 256 threads, each copying 4 elements (rows `ty, ty+8, ty+16, ty+24` of
# the tile), which is the layout of Harris's kernel; the block covers a 32 x 32 tile.
#
# **Exercise 7.7.** Write `transpose_kernel` with a padded `(T_TILE, T_PAD)` shared tile, `T_PAD =
# T_TILE + 1` (given: compiled for a GPU, a shared array's shape must be constants Numba can read
# at compile time, and numba-cuda 0.30 types `T_TILE + 1` written in the kernel as a run-time
# integer and refuses it; the simulator does not notice, so a test reads the kernel's source).
# Block (bx, by) reads the tile of `a` at rows `by*32...`, columns `bx*32...`, and writes it to
# `out` at rows `bx*32...`, columns `by*32...`. The tests check the result, coalescing >= 0.5
# for both the reads of `a` and the writes of `out`, and no bank conflicts in the tile.

# %%
#| export
#| exercise 7.7
T_TILE = 32
T_PAD = T_TILE + 1  # the padded row of the shared tile (a constant: see above)
T_ROWS = 8


@cuda.jit
def transpose_kernel(a, out):
    """out = a.T. a: (rows, cols) float32, out: (cols, rows) float32. Launch grid
    (ceil(cols/T_TILE), ceil(rows/T_TILE)), block (T_TILE, T_ROWS); each thread copies
    T_TILE // T_ROWS elements through a padded shared tile."""
    ### BEGIN SOLUTION
    tile = cuda.shared.array((T_TILE, T_PAD), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    rows, cols = a.shape
    col = cuda.blockIdx.x * T_TILE + tx
    row = cuda.blockIdx.y * T_TILE + ty
    for j in range(0, T_TILE, T_ROWS):
        if row + j < rows and col < cols:
            tile[ty + j, tx] = a[row + j, col]
    cuda.syncthreads()
    col = cuda.blockIdx.y * T_TILE + tx  # column of out = row of a
    row = cuda.blockIdx.x * T_TILE + ty  # row of out = column of a
    for j in range(0, T_TILE, T_ROWS):
        if row + j < cols and col < rows:
            out[row + j, col] = tile[tx, ty + j]
    ### END SOLUTION

# %%
#| export
def transpose(a: np.ndarray) -> np.ndarray:
    """a.T (a copy) for a 2-D float32 array, by `transpose_kernel`."""
    a = _as_f32("transpose", "a", a, 2)
    rows, cols = a.shape
    d_out = cuda.device_array((cols, rows), np.float32)
    grid = (blocks_for(cols, T_TILE), blocks_for(rows, T_TILE))
    transpose_kernel[grid, (T_TILE, T_ROWS)](cuda.to_device(a), d_out)
    return d_out.copy_to_host()

# %% tags=["check"]
check("7.7")

# %% [markdown]
# Three transposes, traced: the direct one (x along `a`'s columns: reads coalesce, writes do
# not), the shared-memory one without padding (both coalesce, 32-way bank conflicts on the
# column reads of the tile), and yours. Expect write efficiency near 0.125 for the direct
# kernel, and conflict degree 32 without padding, 1 with it.

# %% tags=["demo"]
@cuda.jit
def transpose_direct(a, out):
    col, row = cuda.grid(2)
    if row < a.shape[0] and col < a.shape[1]:
        out[col, row] = a[row, col]


@cuda.jit
def transpose_unpadded(a, out):
    tile = cuda.shared.array((T_TILE, T_TILE), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col, row = cuda.blockIdx.x * T_TILE + tx, cuda.blockIdx.y * T_TILE + ty
    for j in range(0, T_TILE, T_ROWS):
        if row + j < a.shape[0] and col < a.shape[1]:
            tile[ty + j, tx] = a[row + j, col]
    cuda.syncthreads()
    col, row = cuda.blockIdx.y * T_TILE + tx, cuda.blockIdx.x * T_TILE + ty
    for j in range(0, T_TILE, T_ROWS):
        if row + j < a.shape[1] and col < a.shape[0]:
            out[row + j, col] = tile[tx, ty + j]


X = np.random.default_rng(3).standard_normal((40, 36) if SMALL else (70, 100)).astype(np.float32)
grid = (blocks_for(X.shape[1], T_TILE), blocks_for(X.shape[0], T_TILE))
for kern, g, block in [(transpose_direct, (blocks_for(X.shape[1], 32), blocks_for(X.shape[0], 8)), (32, 8)),
                       (transpose_unpadded, grid, (T_TILE, T_ROWS)), (transpose_kernel, grid, (T_TILE, T_ROWS))]:
    tr, out = Trace(), np.zeros(X.T.shape, np.float32)
    simulate(kern, g, block, TracedArray(X, "a", tr), TracedArray(out, "out", tr), trace=tr)
    assert np.array_equal(out, X.T)
    conflicts = max((tr.bank_conflicts(s) for s in tr.shared_names()), default=0)
    print(f"{kern.__name__:20s} reads {tr.coalescing('a'):.3f}  writes {tr.coalescing('out', 'w'):.3f}  "
          f"worst bank conflict: {conflicts or '-'}")

# %% [markdown]
# ## 8. Work efficiency: a Blelloch scan, and thread coarsening
#
# Two parallel algorithms can have the same depth and very different *work*. The Hillis-Steele
# scan of section 4 takes log2(B) steps, but in each step nearly every thread adds: about
# B log2(B) additions for B elements, against B - 1 for a sequential loop. On a GPU that
# extra work is not free: each addition is a shared-memory read and write that competes for
# the same bandwidth. Blelloch's scan (Blelloch, 1990; Harris, Sengupta and Owens, 2007) is
# *work-efficient*: about 2B additions in 2 log2(B) steps, on a balanced tree.
#
# For B = 2T elements and T threads (each thread owns two elements):
#
# 1. **Up-sweep (reduce).** For stride = 1, 2, 4, ..., B/2: thread t with j = 2 stride (t + 1) - 1 < B
#    adds `buf[j - stride]` into `buf[j]`. Afterwards `buf[B - 1]` holds the total, and the other
#    right-hand nodes hold the sums of their subtrees. Barrier before each step.
# 2. Thread 0 saves the total (the block sum) and sets `buf[B - 1] = 0`.
# 3. **Down-sweep.** For stride = B/2, ..., 2, 1: thread t with the same j swaps and adds:
#    `t = buf[j - stride]; buf[j - stride] = buf[j]; buf[j] += t`. Afterwards `buf` holds the
#    *exclusive* scan (each element the sum of those before it). Barrier before each step.
# 4. The inclusive scan is the exclusive one plus each element's own value: keep the two values
#    each thread loaded in registers, so `x` is read once.
#
# The up-sweep is Brent and Kung's (1982) reduction tree; the down-sweep distributes the partial
# sums back down it. The active threads halve and double from step to step, so most steps run
# few warps: the work goes down while the depth doubles, which is why libraries switch to warp
# shuffles for the last levels.
#
# **Exercise 7.8.** Write `blelloch_scan_kernel(x, out, block_sums)`: the same contract as
# `block_scan_kernel`, but each block of `BSCAN_THREADS` threads scans `BSCAN_N = 2 *
# BSCAN_THREADS` elements (thread t owns elements t and t + BSCAN_THREADS of its block: both
# loads coalesce). The tests check the results and, from the trace, the work: each element of
# `x` read once, about 4 shared-memory writes per element (1 load, 1 up, 2 down; Hillis-Steele
# does log2(B) + 1 = 8 for B = 128).

# %%
#| export
#| exercise 7.8
BSCAN_THREADS = 64
BSCAN_N = 2 * BSCAN_THREADS


@cuda.jit
def blelloch_scan_kernel(x, out, block_sums):
    """Per block of N = BSCAN_N elements (BSCAN_THREADS threads, two elements each):
    out[b*N + i] = x[b*N] + ... + x[b*N + i] (inclusive), block_sums[b] = the block's total.
    Work-efficient: an up-sweep and a down-sweep over a balanced tree in shared memory.
    x, out: (n,) float32; block_sums: (blocks,) float32; launch [blocks, BSCAN_THREADS]."""
    ### BEGIN SOLUTION
    buf = cuda.shared.array(BSCAN_N, np.float32)
    tid = cuda.threadIdx.x
    base = cuda.blockIdx.x * BSCAN_N
    n = x.shape[0]
    i0, i1 = base + tid, base + tid + BSCAN_THREADS
    v0 = x[i0] if i0 < n else np.float32(0.0)
    v1 = x[i1] if i1 < n else np.float32(0.0)
    buf[tid] = v0
    buf[tid + BSCAN_THREADS] = v1
    stride = 1
    while stride < BSCAN_N:  # up-sweep: partial sums up the tree
        cuda.syncthreads()
        j = (tid + 1) * 2 * stride - 1
        if j < BSCAN_N:
            buf[j] += buf[j - stride]
        stride *= 2
    cuda.syncthreads()
    if tid == 0:
        block_sums[cuda.blockIdx.x] = buf[BSCAN_N - 1]
        buf[BSCAN_N - 1] = np.float32(0.0)
    stride = BSCAN_N // 2
    while stride > 0:  # down-sweep: each node passes its prefix left and prefix + left sum right
        cuda.syncthreads()
        j = (tid + 1) * 2 * stride - 1
        if j < BSCAN_N:
            t = buf[j - stride]
            buf[j - stride] = buf[j]
            buf[j] += t
        stride //= 2
    cuda.syncthreads()
    if i0 < n:
        out[i0] = buf[tid] + v0
    if i1 < n:
        out[i1] = buf[tid + BSCAN_THREADS] + v1
    ### END SOLUTION

# %%
#| export
def gpu_cumsum_blelloch(x: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of a 1-D float32 array with `blelloch_scan_kernel` per block and
    the carried block totals added by `add_offsets_kernel` (one thread per element)."""
    x = _as_f32("gpu_cumsum_blelloch", "x", x, 1)
    n = x.shape[0]
    if n == 0:
        return x.copy()
    blocks = blocks_for(n, BSCAN_N)
    d_out = cuda.device_array(n, np.float32)
    d_sums = cuda.device_array(blocks, np.float32)
    blelloch_scan_kernel[blocks, BSCAN_THREADS](cuda.to_device(x), d_out, d_sums)
    if blocks > 1:
        sums = d_sums.copy_to_host().astype(np.float64)
        offsets = np.concatenate([[0.0], np.cumsum(sums[:-1])]).astype(np.float32)
        add_offsets_kernel[blocks, BSCAN_N](d_out, cuda.to_device(offsets))
    return d_out.copy_to_host()

# %% tags=["check"]
check("7.8")

# %% [markdown]
# The two scans, traced on the same 128-element blocks (Hillis-Steele with 128 threads here):
# shared-memory writes and reads per element, barrier-separated steps, and lane utilization.
# Expect about half the writes and well under half the reads for Blelloch, and fewer busy lanes:
# in the narrow levels of its tree most lanes of the active warps have nothing to add.

# %% tags=["demo"]
xs = np.random.default_rng(4).standard_normal(2 * BSCAN_N).astype(np.float32)


@cuda.jit
def hillis_steele_128(x, out, block_sums):
    buf = cuda.shared.array(BSCAN_N, np.float32)
    tid, i = cuda.threadIdx.x, cuda.grid(1)
    buf[tid] = x[i] if i < x.shape[0] else np.float32(0.0)
    cuda.syncthreads()
    d = 1
    while d < BSCAN_N:
        v = buf[tid - d] if tid >= d else np.float32(0.0)
        cuda.syncthreads()
        buf[tid] += v
        cuda.syncthreads()
        d *= 2
    if i < x.shape[0]:
        out[i] = buf[tid]


for name, kern, threads in [("Hillis-Steele", hillis_steele_128, BSCAN_N), ("Blelloch", blelloch_scan_kernel, BSCAN_THREADS)]:
    tr, out = Trace(), np.zeros_like(xs)
    simulate(kern, 2, threads, xs, TracedArray(out, "out", tr), np.zeros(2, np.float32), trace=tr)
    sh = tr.shared_names()[0]
    assert np.allclose(out, np.concatenate([np.cumsum(xs[:BSCAN_N]), np.cumsum(xs[BSCAN_N:])]), atol=1e-4)
    print(f"{name:13s} shared writes/element {len(tr.of(sh, 'w')) / xs.size:4.1f}  reads/element "
          f"{len(tr.of(sh, 'r')) / xs.size:4.1f}  steps {tr.steps(sh):2d}  lanes busy {tr.lane_utilization(sh):.0%}")

# %% [markdown]
# **Thread coarsening.** In `block_sum_kernel` every thread loads one element and then takes
# part in a log2(128)-step tree: 128 shared-memory writes and 7 barriers per 128 elements, and
# as many blocks as elements / 128. If each thread first adds C elements in a register (a
# float32 accumulator, no shared memory, no barriers) and only then enters the tree, the tree's
# cost is spread over C times more elements and the grid needs C times fewer blocks. This is
# *thread coarsening* (Kirk and Hwu, *Programming Massively Parallel Processors*, 4th ed., 2022,
# ch. 6 and 10): trading parallelism the hardware cannot use anyway for less overhead per
# element. Which elements a thread adds matters: thread t of block b takes
# x[b C R + c R + t] for c = 0 .. C - 1 (R = REDUCE_THREADS), so in each of the C loads the
# warp's 32 threads read 32 consecutive floats (coalesced); a contiguous chunk per thread
# (x[(b R + t) C + c]) would put the threads of a warp C floats apart.
#
# **Exercise 7.9.** Write `coarse_sum_kernel(x, partial)`: block b sums
# x[b C R : (b + 1) C R] with C = `COARSEN`, R = `REDUCE_THREADS` threads, each thread first
# adding its C elements (strided by R, guarded) in a float32 register, then the sequential-
# addressing tree of 7.3. The tests check the sums, one read per element, exactly C reads of `x`
# per thread, coalescing >= 0.5, and that the tree writes shared memory about once per thread
# per step (so about C times less per element than 7.3).

# %%
#| export
#| exercise 7.9
COARSEN = 4


@cuda.jit
def coarse_sum_kernel(x, partial):
    """partial[b] = sum of x[b*C*R : (b+1)*C*R] (C = COARSEN, R = REDUCE_THREADS; missing
    elements count 0): each thread adds C elements strided by R in a register, then a
    sequential-addressing tree in shared memory. Launch [ceil(n / (C*R)), REDUCE_THREADS]."""
    ### BEGIN SOLUTION
    s_data = cuda.shared.array(REDUCE_THREADS, np.float32)
    tid = cuda.threadIdx.x
    base = cuda.blockIdx.x * COARSEN * REDUCE_THREADS + tid
    acc = np.float32(0.0)
    for c in range(COARSEN):
        i = base + c * REDUCE_THREADS
        if i < x.shape[0]:
            acc += x[i]
    s_data[tid] = acc
    cuda.syncthreads()
    s = REDUCE_THREADS // 2
    while s > 0:
        if tid < s:
            s_data[tid] += s_data[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s_data[0]
    ### END SOLUTION

# %%
#| export
def gpu_sum_coarse(x: np.ndarray) -> float:
    """Sum of a 1-D float32 array with `coarse_sum_kernel`, pass after pass."""
    x = _as_f32("gpu_sum_coarse", "x", x, 1)
    if x.shape[0] == 0:
        return 0.0
    d, n = cuda.to_device(x), x.shape[0]
    while n > 1:
        blocks = blocks_for(n, COARSEN * REDUCE_THREADS)
        d_partial = cuda.device_array(blocks, np.float32)
        coarse_sum_kernel[blocks, REDUCE_THREADS](d, d_partial)
        d, n = d_partial, blocks
    return float(d.copy_to_host()[0])

# %% tags=["check"]
check("7.9")

# %% [markdown]
# The same 4096 elements summed with and without coarsening: blocks, barrier steps and
# shared-memory writes per input element.

# %% tags=["demo"]
xs = np.random.default_rng(5).standard_normal(1024 if SMALL else 4096).astype(np.float32)
for kern, per_block in [(block_sum_kernel, REDUCE_THREADS), (coarse_sum_kernel, COARSEN * REDUCE_THREADS)]:
    blocks = blocks_for(xs.size, per_block)
    tr, part = Trace(), np.zeros(blocks, np.float32)
    simulate(kern, blocks, REDUCE_THREADS, TracedArray(xs, "x", tr), part, trace=tr)
    sh = tr.shared_names()[0]
    print(f"{kern.__name__:18s} blocks {blocks:3d}  shared writes per element {len(tr.of(sh, 'w')) / xs.size:.2f}  "
          f"sum {part.sum():.4f} (numpy {xs.sum():.4f})")

# %% [markdown]
# ## On a real GPU
#
# With a GPU present (this cell is skipped otherwise) the same kernels run compiled. The timing
# uses CUDA events around launches on data already on the device; the first launch compiles,
# so it is excluded. Expect the tiled matmul to beat the naive one, the padded transpose to
# approach a device-to-device copy, and both matmuls to stay far below cuBLAS (lesson 08).

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
import cupy as cp


def gpu_time(fn, repeat: int = 20) -> float:
    """Median milliseconds of fn() measured with CUDA events."""
    fn()
    cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cuda.event(), cuda.event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop))
    return float(np.median(times))


N = 2048
A = cp.random.standard_normal((N, N), dtype=cp.float32)
B = cp.random.standard_normal((N, N), dtype=cp.float32)
C = cp.empty((N, N), dtype=cp.float32)
g16 = (blocks_for(N, TILE), blocks_for(N, TILE))
runs = {
    "naive matmul": lambda: matmul_naive_kernel[(blocks_for(N, 32), blocks_for(N, 4)), (32, 4)](A, B, C),
    "tiled matmul": lambda: matmul_tiled_kernel[g16, (TILE, TILE)](A, B, C),
    "cupy (cuBLAS)": lambda: cp.matmul(A, B, out=C),
}
for name, fn in runs.items():
    ms = gpu_time(fn)
    print(f"{name:14s} {ms:8.3f} ms  {2 * N**3 / ms / 1e9:8.1f} TFLOP/s")  # FLOP per ms / 1e9
T = cp.empty((N, N), dtype=cp.float32)
gt = (blocks_for(N, T_TILE), blocks_for(N, T_TILE))
for name, fn in {
    "transpose direct": lambda: transpose_direct[(blocks_for(N, 32), blocks_for(N, 8)), (32, 8)](A, T),
    "transpose padded": lambda: transpose_kernel[gt, (T_TILE, T_ROWS)](A, T),
    "copy (cupy)": lambda: T.__setitem__(Ellipsis, A),
}.items():
    ms = gpu_time(fn)
    print(f"{name:17s} {ms:8.3f} ms  {2 * A.nbytes / ms / 1e6:8.1f} GB/s")
X = cp.random.standard_normal(1 << 24, dtype=cp.float32)
for name, kern, per_block in [("block sum", block_sum_kernel, REDUCE_THREADS),
                              (f"coarsened x{COARSEN}", coarse_sum_kernel, COARSEN * REDUCE_THREADS)]:
    nb = blocks_for(X.size, per_block)
    P = cp.empty(nb, dtype=cp.float32)
    ms = gpu_time(lambda: kern[nb, REDUCE_THREADS](X, P))
    print(f"{name:17s} {ms:8.3f} ms  {X.nbytes / ms / 1e6:8.1f} GB/s  ({nb} blocks)")

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0, numba-cuda
# 0.30.4) this cell printed: at N = 2048, naive matmul 12.8 ms (1.3 TFLOP/s), tiled 2.43 ms (7.1
# TFLOP/s), cuBLAS 0.38 ms (45.3 TFLOP/s); transpose direct 194 GB/s, padded 341 GB/s, a CuPy copy
# 1,928 GB/s; over 64 MiB, block sum 400 GB/s and coarsened x4 512 GB/s. Tiling is worth 5.3x and
# cuBLAS is 6.4x further on (lesson 08 climbs that ladder). The padded transpose is 1.8x the
# direct one and still 18 % of a copy: there is more to a transpose at full bandwidth than bank
# conflicts.

# %% [markdown]
# ## What you measured / what to remember
#
# - A kernel is one function run by a grid of blocks of threads; `cuda.grid` gives each thread
#   its element. Launch ceil(n / threads) blocks and **guard** every index: the last block
#   overhangs. The simulator raises `IndexError`; a GPU silently corrupts memory.
# - Map threadIdx.x to the **contiguous** axis. A warp's 32 loads then coalesce into a few
#   32-byte sectors; the trace measured efficiency near 1 versus about 0.125 with x and y
#   swapped (the hardware fetches 8 times the bytes it uses).
# - Shared memory is per block and needs **barriers**: every write another thread reads must be
#   separated from that read by `syncthreads`, and all threads must reach every barrier.
#   Each race in this lesson produced wrong results under the simulator.
# - Reductions and scans are log-depth trees. Keep active threads contiguous (sequential
#   addressing): 12 active warp-steps per 128-thread block instead of 27, and 66 % instead of
#   30 % of the lanes busy in the warps that work (control divergence, as lane utilization).
# - Depth is not work: Hillis-Steele scans in log2(B) steps with B log2(B) additions, Blelloch
#   in 2 log2(B) steps with about 2B (the traces counted 8 and 4 shared writes per element;
#   the price is idle lanes: 55 % busy against 100 %).
#   Coarsening gives each thread several elements in registers before the tree: fewer blocks,
#   fewer barriers and shared writes per element.
# - Accumulate float32 data in float32 (`np.float32(0.0)`): the literal `0.0` is float64 in
#   Numba, and float64 arithmetic is a slower unit on every GPU.
# - Tiling through shared memory divides global reads by the tile width: each element of `a`
#   read ceil(n / TILE) times instead of n. Reuse on chip is what turns a memory-bound kernel
#   into a compute-bound one (lesson 04's roofline).
# - Shared memory has 32 banks; a column walk of a 32-wide float tile is a 32-way conflict,
#   and one padding column removes it.
# - Timings under the simulator (about 0.2 ms per simulated thread, measured on the 2-core dev
#   machine) say nothing about GPU speed; counts of accesses do carry over.
#
# ## Sources
#
# - NVIDIA, *CUDA C++ Programming Guide* (programming model; shared memory; device memory
#   accesses and coalescing), https://docs.nvidia.com/cuda/cuda-c-programming-guide/
# - NVIDIA, *CUDA C++ Best Practices Guide* (coalesced access, shared memory bank conflicts),
#   https://docs.nvidia.com/cuda/cuda-c-best-practices-guide/
# - Numba documentation, *CUDA kernels* and *the CUDA simulator*,
#   https://numba.readthedocs.io/en/stable/cuda/index.html
# - M. Harris, *Optimizing Parallel Reduction in CUDA*, NVIDIA, 2007,
#   https://developer.download.nvidia.com/assets/cuda/files/reduction.pdf
# - M. Harris, S. Sengupta, J. D. Owens, *Parallel Prefix Sum (Scan) with CUDA*, GPU Gems 3,
#   ch. 39, 2007, https://developer.nvidia.com/gpugems/gpugems3/part-vi-gpu-computing/chapter-39-parallel-prefix-sum-scan-cuda
# - W. D. Hillis, G. L. Steele Jr., *Data Parallel Algorithms*, CACM 29(12), 1986,
#   https://doi.org/10.1145/7902.7903
# - G. E. Blelloch, *Prefix Sums and Their Applications*, CMU-CS-90-190, 1990
# - R. P. Brent, H. T. Kung, *A Regular Layout for Parallel Adders*, IEEE Trans. Computers C-31(3), 1982
# - D. B. Kirk, W. W. Hwu, I. El Hajj, *Programming Massively Parallel Processors*, 4th ed., 2022
#   (control divergence, thread coarsening, work-efficient scans)
# - M. Harris, *An Efficient Matrix Transpose in CUDA C/C++*, NVIDIA blog, 2013,
#   https://developer.nvidia.com/blog/efficient-matrix-transpose-cuda-cc/
# - S. Boehm, *How to Optimize a CUDA Matmul Kernel for cuBLAS-like Performance*, 2022,
#   https://siboehm.com/articles/22/CUDA-MMM
# - S. Rush, *GPU Puzzles*, https://github.com/srush/GPU-Puzzles (puzzle-style Numba CUDA exercises)


# %%
#| export
#| given
from minitorch.checks import Instance, Int, Optional, validate_public  # noqa: E402
from minitorch.cuda_trace import _Dims  # noqa: E402

validate_public(globals(), {
    "vector_add": {"threads": Int(1, 1024)},
    "bias_relu": {"block": _Dims(sizes=(2,), max_threads=1024)},
    "gpu_sum": {"kernel": Optional(Instance(type(block_sum_kernel), must="a Numba CUDA kernel (@cuda.jit)"))},
    "matmul_naive": {"block": _Dims(sizes=(2,), max_threads=1024)},
})

