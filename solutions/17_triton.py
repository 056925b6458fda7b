# %% [markdown]
# # Lesson 17: Triton, from a fused softmax to FlashAttention-2
#
# Lessons 07 and 08 wrote GPU kernels thread by thread: every thread computed its own index,
# checked it against the edge, staged tiles in shared memory and waited at barriers. Triton
# (Tillet, Kung and Cox, 2019) moves the unit of work up one level. A Triton kernel is the code of
# one **program**, which works on whole blocks of values at once: `tl.arange(0, 128)` is 128
# offsets, `tl.load(ptr + offsets, mask=...)` loads 128 values, `tl.dot(a, b)` multiplies two
# tiles. How the block is spread over threads, which loads are coalesced, what goes through shared
# memory, how loads are pipelined and when tensor cores are used is the compiler's job. Much of
# today's new GPU code is Triton: PyTorch's compiler (TorchInductor) generates it, FlashAttention has
# Triton versions, and Stanford's CS336 has students write FlashAttention-2 in it.
#
# You write five kernels, each graded on any Linux laptop:
#
# 1. **Block programs**: a fused bias + GELU over a strided matrix, masked at every edge.
# 2. **Fused softmax**: one program per row, the row held in registers, one read and one write.
# 3. **Matmul**: tiles multiplied by `tl.dot` in a loop over K, programs ordered in groups so that
#    they share the L2 cache, a fused epilogue (bias, GELU), block sizes autotuned on a GPU.
# 4. **FlashAttention-2, forward**: the online softmax over key blocks, the blocks a causal mask
#    hides never loaded, the log-sum-exp saved.
# 5. **FlashAttention-2, backward**: P recomputed from the log-sum-exp, dK and dV per key block, dQ
#    accumulated atomically; wired into minitorch's autograd, so lesson 09's GPT trains on it.
#
# Then the same operations in lesson 08's CUDA C and lesson 09's Numba are compared: lines of code,
# what the compiler did, and (on a GPU) speed.
#
# **How it is graded without a GPU.** Triton has an interpreter (`TRITON_INTERPRET=1`) that runs a
# kernel on the CPU with NumPy, one program after another. It takes the same tensors as a GPU launch
# (PyTorch's, in Triton's own tests); here a small NumPy-backed class, `NumpyTensor`, stands in for
# them, so PyTorch is not needed. The course adds two things to the interpreter
# (`minitorch/triton_interp.py`): every load and store is checked before it happens, so a missing
# mask or a wrong stride is an error that names the argument, the element and the program instead of
# a silent read of garbage; and every access and `tl.dot` is recorded, so the tests can check each
# kernel's point by counting: each element read once, a K loop of `tl.dot`s, never a full row of
# attention scores, causal blocks never loaded. Triton's compiler also runs without a GPU:
# `compile_for_gpu` shows the PTX it makes for an A100 or an H100.
#
# What the interpreter cannot show is said where it matters (section 7): it runs programs one at a
# time, so two programs that race on one element agree there (the course's checker reports such
# races instead), and it says nothing about speed. Cells tagged `gpu` compile the same kernels for a
# real GPU, check them against the interpreter and time them.
#
# **Platforms.** Triton publishes wheels for Linux (x86-64 and aarch64) only; `make setup` installs
# it there (WSL2 and Colab are Linux). On macOS the kernels cannot run: each cell that launches one
# prints why in one line and the check cells skip, as lesson 08's PTX checks do.
#
# Background: [GPUs](../hardware_notes/gpu.md) (and its section on
# [what Triton's compiler does](../hardware_notes/gpu.md#block-programs-what-tritons-compiler-does)),
# [why fusion pays](../hardware_notes/fusion.md), [the roofline](../hardware_notes/roofline.md).
# The reference version of this lesson is `minitorch/triton_kernels.py`.

# %%
import math
import os
import time

import numpy as np

from course.check import check
from course.gpu import gpu_status, require_gpu

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
HAVE_GPU, GPU_REASON = gpu_status()
rng = np.random.default_rng(0)

# %%
#| export triton_interp
#| given
"""minitorch.triton_interp: Triton kernels on any Linux machine, with or without a GPU (lesson 17).

- `triton`, `tl`: Triton and `triton.language`. Kernels run under Triton's interpreter
  (TRITON_INTERPRET=1, set here before Triton is imported): one program after another, in NumPy, on
  the CPU. Where Triton has no wheel (macOS) they are stand-ins: a kernel can still be defined, and
  launching one raises TritonUnavailable (a notebook cell says why in one line; the tests skip).
- `NumpyTensor`: a NumPy array in "device memory", with the few methods of a PyTorch tensor that
  the interpreter calls (data_ptr, untyped_storage, storage_offset, size, stride, new_empty, set_): PyTorch
  is not needed.
- `launch(kernel, grid, *args, **meta)`: on NumpyTensors, the kernel runs interpreted, and every
  load and store is checked against the arguments' memory before it happens (a KernelError names
  the argument, the element and the program), races between programs are reported, and inside
  `trace()` each program's loads, stores and `tl.dot`s are recorded (a KernelTrace). On PyTorch
  CUDA tensors (a GPU machine) the same kernel is compiled and launched.
- `compile_for_gpu(kernel, args, arch)`: Triton's compiler, without a GPU: the PTX it makes for
  these arguments, and `ptx_counts` of what is in it.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from collections import defaultdict
from typing import Any, Callable, Iterator, Sequence

import numpy as np

# A SkipCell ends a notebook cell with its reason in one line (course.notebook, the notebooks' cell runner).
from course.notebook import SkipCell
from minitorch.checks import Array, describe

# Always the interpreter for kernels defined with @triton.jit (graded the same on every machine);
# on a GPU, launch() compiles the same Python function for real (see _compiled).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton 3.9 warns that its default for fusing a*b+c into one FMA will change; keep today's.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


class TritonUnavailable(SkipCell, RuntimeError):
    """Triton cannot run here (no wheel for this platform, or not installed): a notebook cell that
    launches a kernel says why in one line and Run All goes on; the tests skip with the reason."""


class KernelError(RuntimeError):
    """A kernel did something a GPU would not forgive: an access outside its arguments' elements, or
    two programs racing on one element. The message names the argument, the element and the programs."""


def _why_not() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError as exc:
        if sys.platform == "darwin":
            return ("Triton publishes wheels for Linux only (x86-64 and aarch64), so lesson 17's kernels cannot "
                    "run on macOS: use Linux, WSL2 or Colab")
        return f"Triton is not installed ({exc}); `make setup` installs it on Linux"
    return None


TRITON_MISSING: str | None = _why_not()


class _StandIn:
    """Stands in for `triton` and `triton.language` where Triton cannot be imported: every attribute
    is another stand-in, so kernels can be defined (`@triton.jit`, `BLOCK: tl.constexpr`); calling
    or launching anything raises TritonUnavailable."""

    def __init__(self, path: str):
        self._path = path

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self._path}.{name}")

    def jit(self, fn: Callable | None = None, **kwargs: Any) -> Any:
        return _Unlaunchable(fn) if fn is not None else _Unlaunchable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TritonUnavailable(f"{self._path}: {TRITON_MISSING}")

    def __getitem__(self, grid: Any) -> Any:
        raise TritonUnavailable(f"{self._path}: {TRITON_MISSING}")


class _Unlaunchable:
    """A kernel defined where Triton cannot run: it keeps its Python function, and refuses to launch."""

    def __init__(self, fn: Callable):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: Any) -> Any:
        raise TritonUnavailable(f"{self.fn.__name__}: {TRITON_MISSING}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TritonUnavailable(f"{self.fn.__name__}: {TRITON_MISSING}")


if TRITON_MISSING is None:
    import triton as _triton
    import triton.language as _tl
    from triton.runtime import interpreter as _interp
else:
    _triton, _tl, _interp = _StandIn("triton"), _StandIn("triton.language"), None
# Triton and triton.language, or, where Triton cannot run, their stand-ins:
triton = _triton
tl = _tl


def _scalars_from_blocks(original: Callable) -> Callable:
    """The interpreter converts a scalar (a 1-element block) to a Python int or bool for `range(0, K, BLOCK)`
    and `if`; Triton 3.6 does it with int(array), which NumPy 2.4 refuses for a 1-D array: use .item()."""
    def patched(tensor: Any, *scope: Any) -> None:  # Triton 3.6 on passes a scope that restores the patch
        original(tensor, *scope)
        put = scope[0].set_attr if scope else setattr
        put(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
        put(tensor, "__bool__", lambda self: bool(np.asarray(self.handle.data).reshape(-1)[0])
            if np.asarray(self.handle.data).size == 1 else True)
    return patched


if _interp is not None and hasattr(_interp, "_patch_lang_tensor") and not getattr(
        _interp._patch_lang_tensor, "_minitorch", False):
    _interp._patch_lang_tensor = _scalars_from_blocks(_interp._patch_lang_tensor)
    _interp._patch_lang_tensor._minitorch = True


def need_triton() -> None:
    """Raise TritonUnavailable, saying why, where Triton cannot run kernels."""
    if TRITON_MISSING is not None:
        raise TritonUnavailable(TRITON_MISSING)


def need_torch_cuda() -> Any:
    """PyTorch, where its CUDA build sees a GPU (the `gpu` cells launch the kernels on its tensors); else
    TritonUnavailable (a notebook cell then says why in one line)."""
    need_triton()
    try:
        import torch
    except ImportError:
        raise TritonUnavailable("the gpu cells launch Triton kernels on PyTorch CUDA tensors, and PyTorch is not "
                                "installed here (GPU images, Colab's included, have it)") from None
    if not torch.cuda.is_available():
        raise TritonUnavailable("PyTorch is installed but sees no CUDA GPU")
    return torch


def cdiv(a: int, b: int) -> int:
    """The number of size-b blocks that cover a (triton.cdiv, also where Triton is missing)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (triton.next_power_of_2): `tl.arange` needs one."""
    return 1 << max(0, int(n) - 1).bit_length()


# ------------------------------------------------------------------ device memory without a device
_GUARD = 1 << 16  # bytes of guard memory on each side of a buffer, at least (an overrun lands there)
_ALIGN = 128      # buffers start 128-byte aligned, as cudaMalloc's do (Triton specialises on % 16)


class _Storage:
    """The memory behind NumpyTensors: one NumPy byte buffer, 128-byte aligned, with unused guard
    bytes on both sides so that an access past one buffer never lands in another."""

    def __init__(self, nbytes: int):
        guard = max(_GUARD, nbytes)
        self._raw = np.zeros(nbytes + 2 * guard + _ALIGN, np.uint8)
        start = guard + (-(self._raw.ctypes.data + guard)) % _ALIGN
        self.bytes = self._raw[start:start + nbytes]

    def data_ptr(self) -> int:
        return int(self.bytes.ctypes.data)

    def nbytes(self) -> int:
        return int(self.bytes.size)

    def cpu(self) -> _Storage:
        return self  # already host memory: the interpreter reads and writes it in place

    def copy_(self, other: _Storage) -> _Storage:
        if other is not self:
            self.bytes[...] = other.bytes
        return self


class NumpyTensor:
    """A NumPy array in emulated device memory, which Triton's interpreter takes as it takes a PyTorch tensor.

    `NumpyTensor(a)` copies `a` (real or bool dtype; its strides kept) into a buffer of its own, as a
    copy to a GPU would; `NumpyTensor.empty(shape, dtype)` allocates; `.numpy()` copies back. What a
    launch reads: `shape`, `dtype` (a NumPy dtype), `stride()` (in elements), `data_ptr()`. What the
    interpreter calls to move arguments to the host and back (a no-op here: the memory is the
    host's): `untyped_storage()`, `storage_offset()`, `size()`, `new_empty()`, `set_()`."""

    def __init__(self, a: np.ndarray):
        a = np.asarray(a)
        if a.dtype.kind not in "biuf":
            raise TypeError(f"NumpyTensor: a must be an array of real numbers or bools, got {describe(a)}")
        if any(s < 0 or s % a.itemsize for s in a.strides):
            a = np.ascontiguousarray(a)
        strides = tuple(s // a.itemsize for s in a.strides)
        span = 1 + sum((n - 1) * s for n, s in zip(a.shape, strides)) if a.size else 0
        self._set(_Storage(span * a.itemsize), 0, a.shape, strides, a.dtype)
        self._view()[...] = a

    @classmethod
    def _make(cls, storage: _Storage, offset: int, shape: Sequence[int], strides: Sequence[int],
              dtype: Any) -> NumpyTensor:
        t = cls.__new__(cls)
        t._set(storage, offset, shape, strides, dtype)
        return t

    def _set(self, storage: _Storage, offset: int, shape: Sequence[int], strides: Sequence[int], dtype: Any) -> None:
        self._storage, self._offset = storage, int(offset)
        self.shape = tuple(int(s) for s in shape)
        self._strides = tuple(int(s) for s in strides)
        self.dtype = np.dtype(dtype)

    @staticmethod
    def empty(shape: Sequence[int], dtype: Any) -> NumpyTensor:
        """A new C-contiguous tensor of `shape` and NumPy `dtype` (real or bool), filled with zeros."""
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        return NumpyTensor._make(_Storage(int(np.prod(shape)) * dtype.itemsize), 0, shape, tuple(reversed(strides)),
                                 dtype)

    def _numel(self) -> int:
        return int(np.prod(self.shape))

    def _view(self) -> np.ndarray:
        """The elements as a NumPy view of the buffer (writes go to the tensor)."""
        if not self._numel():
            return np.empty(self.shape, self.dtype)
        flat = self._storage.bytes.view(self.dtype)
        return np.lib.stride_tricks.as_strided(flat[self._offset:], self.shape,
                                               tuple(s * self.dtype.itemsize for s in self._strides))

    def numpy(self) -> np.ndarray:
        """A C-contiguous NumPy copy of the elements."""
        return np.array(self._view(), copy=True, order="C")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def T(self) -> NumpyTensor:  # noqa: N802 - NumPy's and PyTorch's name
        """The transpose, a view: the same memory, the shape and strides reversed."""
        return NumpyTensor._make(self._storage, self._offset, self.shape[::-1], self._strides[::-1], self.dtype)

    # -- what Triton's launcher and interpreter call (PyTorch's names) --
    def data_ptr(self) -> int:
        """The address of the first element."""
        return self._storage.data_ptr() + self._offset * self.dtype.itemsize

    def stride(self) -> tuple[int, ...]:
        """The strides, in elements."""
        return self._strides

    def size(self) -> tuple[int, ...]:
        """The shape (PyTorch's name)."""
        return self.shape

    def storage_offset(self) -> int:
        """Where the first element is in the storage, in elements."""
        return self._offset

    def untyped_storage(self) -> _Storage:
        """The memory this tensor is a view of."""
        return self._storage

    def new_empty(self, *size: Any, **kwargs: Any) -> NumpyTensor:
        """A new tensor of this dtype (the interpreter asks for an empty one, then `set_`s it)."""
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        return NumpyTensor.empty(shape, self.dtype)

    def set_(self, storage: _Storage, offset: int, size: Sequence[int], stride: Sequence[int]) -> NumpyTensor:
        """Make this tensor a view of `storage`: from element `offset`, with shape `size` and strides `stride`."""
        if len(size) != len(stride):
            raise ValueError(f"NumpyTensor.set_: size {tuple(size)} and stride {tuple(stride)} differ in length")
        need = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
        if need * self.dtype.itemsize > storage.nbytes():
            raise ValueError(f"NumpyTensor.set_: size {tuple(size)}, stride {tuple(stride)} from offset {offset} "
                             f"needs {need} elements; the storage holds {storage.nbytes() // self.dtype.itemsize}")
        self._set(storage, offset, size, stride, self.dtype)
        return self

    def __repr__(self) -> str:
        return f"NumpyTensor(shape={self.shape}, dtype={self.dtype}, strides={self._strides})"


def _is_cuda(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and getattr(getattr(x, "device", None), "type", "") == "cuda"


class _DeviceArray(Array):
    """Array's rule, for the arrays a kernel's wrapper takes: a NumPy array (or what NumPy reads as one),
    a NumpyTensor, or a PyTorch CUDA tensor, the last two checked by their shape and dtype (never copied)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if isinstance(value, NumpyTensor) or _is_cuda(value):
            dtype = value.dtype if isinstance(value, NumpyTensor) else str(value.dtype).removeprefix("torch.")
            kind = np.dtype("float32" if dtype == "bfloat16" else dtype).kind if isinstance(dtype, str) else dtype.kind
            ok = self.dtypes is None or self._dtype_ok(np.dtype(dtype) if dtype != "bfloat16" else np.dtype("float32"))
            if kind in "cOSUV" or not ok or (self.ndim is not None and len(value.shape) not in self.ndim):
                raise (ValueError if ok and kind not in "cOSUV" else TypeError)(
                    f"{what}: {name} must be {self.must}, got {describe(value)}")
            return
        super().__call__(what, name, value)


def to_device(a: Any) -> Any:
    """A NumPy array as a NumpyTensor (a copy, its strides kept); a NumpyTensor or a PyTorch CUDA
    tensor as it is."""
    if isinstance(a, NumpyTensor) or _is_cuda(a):
        return a
    return NumpyTensor(a)


def empty(shape: Sequence[int], dtype: Any, like: Any) -> Any:
    """A new contiguous tensor where `like` lives: a NumpyTensor, or a PyTorch CUDA tensor on its device."""
    if _is_cuda(like):
        import torch

        dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, np.dtype(dtype).name)
        return torch.empty(tuple(shape), dtype=dt, device=like.device)
    return NumpyTensor.empty(shape, dtype)


def to_host(t: Any, like: Any = None) -> Any:
    """The result as the caller gave its input: a NumPy array for a NumPy `like` (or none), the
    tensor itself for a CUDA or NumpyTensor `like`."""
    if like is not None and (_is_cuda(like) or isinstance(like, NumpyTensor)):
        return t
    return t.numpy() if isinstance(t, NumpyTensor) else t.detach().cpu().numpy()


# ------------------------------------------------------------------ what one launch did
def _program_key(program: Any) -> tuple[int, int, int]:
    if isinstance(program, (int, np.integer)) and not isinstance(program, bool):
        return (int(program), 0, 0)
    if isinstance(program, (tuple, list)) and 1 <= len(program) <= 3 and all(
            isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in program):
        return tuple(int(p) for p in program) + (0,) * (3 - len(program))
    raise TypeError(f"program must be a program id: an int or a tuple of up to 3 ints, got {program!r}")


class KernelTrace:
    """What one interpreted launch did, program by program (recorded inside `trace()`).

    Arguments are named as in the kernel's signature; element indices are flat indices into that
    argument's shape (row-major), whatever its strides. `programs` lists the program ids (x, y, z)
    in the order they ran."""

    def __init__(self) -> None:
        self.name, self.grid = "", (1, 1, 1)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.itemsize: dict[str, int] = {}
        self.programs: list[tuple[int, int, int]] = []
        self._acc: dict[tuple, list[tuple[str, tuple, np.ndarray]]] = defaultdict(list)  # (prog, arg) -> accesses
        self._dots: dict[tuple, list[tuple[tuple, tuple]]] = defaultdict(list)
        self._seen: set[tuple[int, int, int]] = set()

    def _start(self, name: str, grid: tuple[int, int, int], args: dict[str, NumpyTensor]) -> KernelTrace:
        self.name, self.grid = name, grid
        self.shapes = {n: t.shape for n, t in args.items()}
        self.itemsize = {n: t.dtype.itemsize for n, t in args.items()}
        return self

    def _check(self, name: str, program: Any) -> tuple | None:
        if not isinstance(name, str) or name not in self.shapes:
            raise ValueError(f"KernelTrace: name must be one of {self.name}'s array arguments "
                             f"{sorted(self.shapes)}, got {name!r}")
        if program is None:
            return None
        key = _program_key(program)
        if key not in set(self.programs):
            raise ValueError(f"KernelTrace: program {program!r} did not run in {self.name}'s grid {self.grid}")
        return key

    def _select(self, name: str, program: Any, kinds: tuple[str, ...]) -> list[np.ndarray]:
        key = self._check(name, program)
        progs = self.programs if key is None else [key]
        return [idx for p in progs for kind, _, idx in self._acc.get((p, name), ()) if kind in kinds]

    def loads(self, name: str, program: Any = None) -> int:
        """Elements of argument `name` loaded (masked-off lanes not counted), by one program or all."""
        return int(sum(i.size for i in self._select(name, program, ("load",))))

    def stores(self, name: str, program: Any = None) -> int:
        """Elements of `name` stored (plain stores and atomics), by one program or all."""
        return int(sum(i.size for i in self._select(name, program, ("store", "atomic"))))

    def counts(self, name: str, kind: str = "load") -> np.ndarray:
        """How many times each element of `name` was loaded ("load"), stored ("store") or atomically
        updated ("atomic") during the launch: an integer array of the argument's shape."""
        if kind not in ("load", "store", "atomic"):
            raise ValueError(f"KernelTrace.counts: kind must be 'load', 'store' or 'atomic', got {kind!r}")
        self._check(name, None)
        out = np.zeros(int(np.prod(self.shapes[name])), np.int64)
        for idx in self._select(name, None, (kind,)):
            np.add.at(out, idx, 1)
        return out.reshape(self.shapes[name])

    def elements(self, name: str, program: Any, kind: str = "load") -> np.ndarray:
        """The sorted distinct flat indices of `name` that one program loaded ("load") or stored
        ("store": plain stores and atomics)."""
        if kind not in ("load", "store"):
            raise ValueError(f"KernelTrace.elements: kind must be 'load' or 'store', got {kind!r}")
        parts = self._select(name, program, ("load",) if kind == "load" else ("store", "atomic"))
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def blocks(self, name: str, program: Any = None) -> list[tuple[str, tuple[int, ...], int]]:
        """Each access to `name`, in order: (kind, the shape of the pointer block, elements not masked off)."""
        key = self._check(name, program)
        progs = self.programs if key is None else [key]
        return [(kind, shape, int(idx.size)) for p in progs for kind, shape, idx in self._acc.get((p, name), ())]

    def dots(self, program: Any = None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The operand shapes ((M, K), (K, N)) of each tl.dot, by one program or all, in order."""
        if program is None:
            return [d for p in self.programs for d in self._dots.get(p, ())]
        key = _program_key(program)
        if key not in set(self.programs):
            raise ValueError(f"KernelTrace.dots: program {program!r} did not run in {self.name}'s grid {self.grid}")
        return list(self._dots.get(key, ()))

    def bytes_moved(self) -> int:
        """Bytes loaded and stored by the whole launch (each access counted: what the memory system
        serves if nothing is cached)."""
        return int(sum(idx.size * self.itemsize[n] for (_, n), accs in self._acc.items() for _, _, idx in accs))

    def __repr__(self) -> str:
        return f"<KernelTrace {self.name} grid={self.grid}: {len(self.programs)} programs, {self.bytes_moved()} bytes>"


_TRACES: list[list[KernelTrace]] = []


@contextlib.contextmanager
def trace() -> Iterator[list[KernelTrace]]:
    """`with trace() as launches:` collects a KernelTrace for every interpreted launch inside."""
    launches: list[KernelTrace] = []
    _TRACES.append(launches)
    try:
        yield launches
    finally:
        _TRACES.remove(launches)


class _Memory:
    """The arguments' memory during one interpreted launch: maps each address a kernel touches to
    (argument, element), refuses anything else, records the accesses and finds the races."""

    def __init__(self, kernel_name: str, args: dict[str, NumpyTensor], record: KernelTrace | None):
        self.kernel_name, self.args, self.record = kernel_name, args, record
        self.starts, self.ends, self.owners = [], [], []  # per storage: [start, end), [(name, element map)]
        by_storage: dict[int, list[tuple[str, NumpyTensor]]] = defaultdict(list)
        for n, t in args.items():
            by_storage[id(t._storage)].append((n, t))
        for group in sorted(by_storage.values(), key=lambda g: g[0][1]._storage.data_ptr()):
            st = group[0][1]._storage
            owners = []
            for n, t in group:
                emap = np.full(st.nbytes() // t.dtype.itemsize if st.nbytes() else 0, -1, np.int64)
                if t._numel():
                    np.lib.stride_tricks.as_strided(
                        emap[t._offset:], t.shape, tuple(s * 8 for s in t._strides))[...] = \
                        np.arange(t._numel()).reshape(t.shape)
                owners.append((n, t, emap))
            self.starts.append(st.data_ptr())
            self.ends.append(st.data_ptr() + st.nbytes())
            self.owners.append(owners)
        self.starts_a = np.array(self.starts, np.uint64)
        # race bookkeeping, per argument: which program wrote each element, and who read it
        self.writer = {n: np.full(t._numel(), -1, np.int64) for n, t in args.items()}
        self.many_writers = {n: np.zeros(t._numel(), bool) for n, t in args.items()}
        self.atomic = {n: np.full(t._numel(), -1, np.int64) for n, t in args.items()}
        self.read_lo = {n: np.full(t._numel(), np.iinfo(np.int64).max, np.int64) for n, t in args.items()}
        self.read_hi = {n: np.full(t._numel(), -1, np.int64) for n, t in args.items()}
        self.program_ids: list[tuple[int, int, int]] = []

    def _program(self) -> tuple[tuple[int, int, int], int]:
        p = tuple(int(v) for v in _interp.interpreter_builder.grid_idx)
        if not self.program_ids or self.program_ids[-1] != p:
            self.program_ids.append(p)
        return p, len(self.program_ids) - 1

    def access(self, kind: str, ptrs: Any, mask: Any) -> None:
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        live = np.ones(addr.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask.data, bool), addr.shape)
        prog, pindex = self._program()
        shape = tuple(addr.shape)
        a = addr[live].ravel()
        found: dict[str, list[np.ndarray]] = defaultdict(list)
        if a.size:
            slot = np.searchsorted(self.starts_a, a, side="right").astype(np.int64) - 1
            for s in np.unique(slot):
                sel = a[slot == s]
                if s < 0 or int(sel.max()) >= self.ends[s] or int(sel.min()) < self.starts[s]:
                    bad = sel[(sel >= self.ends[s]) | (sel < self.starts[s])] if s >= 0 else sel
                    raise KernelError(self._outside(kind, prog, int(bad[0]), int(bad.size)))
                name0, t0, _ = self.owners[s][0]
                off = (sel - np.uint64(self.starts[s])).astype(np.int64)
                item = t0.dtype.itemsize
                if np.any(off % item):
                    raise KernelError(f"{self.kernel_name}, program {prog}: a {kind} at byte {int(off[off % item != 0][0])}"
                                      f" of {name0}'s memory is not a whole {t0.dtype} element (a pointer of the "
                                      f"wrong type?)")
                el = off // item
                left = np.ones(el.size, bool)
                for name, t, emap in self.owners[s]:
                    idx = emap[el[left]] if emap.size else np.full(int(left.sum()), -1)
                    ok = idx >= 0
                    if ok.any():
                        found[name].append(idx[ok])
                        sub = np.flatnonzero(left)
                        left[sub[ok]] = False
                if left.any():
                    name, t, _ = self.owners[s][0]
                    e = int(el[left][0])
                    raise KernelError(
                        f"{self.kernel_name}, program {prog}: a {kind} of {int(left.sum())} lane(s) in {name}'s memory "
                        f"but not on its elements (shape {t.shape}, strides {t._strides}): the first lands "
                        f"{e - t._offset} elements after {name}'s first element, between or past its rows. The "
                        f"offsets do not follow the strides, or a mask is missing")
        for name, parts in found.items():
            idx = np.concatenate(parts)
            self._note(kind, name, idx, pindex, prog)
            if self.record is not None:
                self.record._acc[(prog, name)].append((kind, shape, idx))
        if self.record is not None and prog not in self.record._seen:
            self.record._seen.add(prog)
            self.record.programs.append(prog)

    def _note(self, kind: str, name: str, idx: np.ndarray, pindex: int, prog: tuple) -> None:
        if kind == "load":
            np.minimum.at(self.read_lo[name], idx, pindex)
            np.maximum.at(self.read_hi[name], idx, pindex)
        elif kind == "store":
            w = self.writer[name]
            other = (w[idx] >= 0) & (w[idx] != pindex)
            self.many_writers[name][idx[other]] = True
            w[idx] = pindex
        else:
            self.atomic[name][idx] = pindex

    def _outside(self, kind: str, prog: tuple, address: int, n: int) -> str:
        i = int(np.argmin([min(abs(address - s), abs(address - e)) for s, e in zip(self.starts, self.ends)]))
        name, t, _ = self.owners[i][0]
        if address >= self.ends[i]:
            where = f"{(address - self.ends[i]) // t.dtype.itemsize + 1} element(s) past the end of {name}"
        else:
            where = f"{(self.starts[i] - address) // t.dtype.itemsize} element(s) before the start of {name}"
        return (f"{self.kernel_name}, program {prog}: a {kind} of {n} lane(s) outside every argument, the first "
                f"{where} (shape {t.shape}). On a GPU it would touch whatever lies there, or fault: mask the lanes "
                f"past the edge")

    def races(self) -> list[str]:
        out = []
        for name in self.args:
            w, lo, hi, at = self.writer[name], self.read_lo[name], self.read_hi[name], self.atomic[name]
            shape = self.args[name].shape
            checks = [
                (self.many_writers[name], "is stored by more than one program"),
                ((w >= 0) & (hi >= 0) & ((lo != w) | (hi != w)), "is stored by one program and loaded by another"),
                ((at >= 0) & (w >= 0), "is updated atomically and also stored plainly"),
                ((at >= 0) & (hi >= 0), "is updated atomically and also loaded in the same launch"),
            ]
            for bad, what in checks:
                if bad.any():
                    e = int(np.flatnonzero(bad)[0])
                    index = tuple(int(v) for v in np.unravel_index(e, shape)) if shape else ()
                    progs = sorted({self.program_ids[int(p)] for p in (w[e], lo[e], hi[e], at[e]) if 0 <= p < len(self.program_ids)})
                    out.append(f"{self.kernel_name}: {name}{list(index)} {what} ({int(bad.sum())} element(s) so; "
                               f"programs {progs}): on a GPU the programs run at the same time, so the result "
                               f"depends on their timing (the interpreter runs them one after another and cannot "
                               f"show it). Give each element one owner, or use tl.atomic_add")
        return out


@contextlib.contextmanager
def _instrumented(memory: _Memory) -> Iterator[None]:
    b = _interp.interpreter_builder
    orig = {n: getattr(b, n) for n in ("create_masked_load", "create_masked_store", "create_dot",
                                       "create_atomic_rmw", "create_atomic_cas")}
    extra = [n for n in ("create_tensor_pointer_load", "create_tensor_pointer_store", "create_descriptor_load",
                         "create_descriptor_store", "create_descriptor_gather", "create_descriptor_scatter")
             if hasattr(b, n)]

    def load(ptrs, mask, *rest, **kw):
        memory.access("load", ptrs, mask)
        return orig["create_masked_load"](ptrs, mask, *rest, **kw)

    def store(ptrs, value, mask, *rest, **kw):
        memory.access("store", ptrs, mask)
        return orig["create_masked_store"](ptrs, value, mask, *rest, **kw)

    def atomic_rmw(op, ptrs, value, mask, *rest, **kw):
        memory.access("atomic", ptrs, mask)
        return orig["create_atomic_rmw"](op, ptrs, value, mask, *rest, **kw)

    def atomic_cas(ptrs, cmp, value, *rest, **kw):
        memory.access("atomic", ptrs, None)
        return orig["create_atomic_cas"](ptrs, cmp, value, *rest, **kw)

    def dot(a, bb, d, *rest, **kw):
        if memory.record is not None:
            prog, _ = memory._program()
            memory.record._dots[prog].append((tuple(a.data.shape), tuple(bb.data.shape)))
        return orig["create_dot"](a, bb, d, *rest, **kw)

    def unsupported(*args, **kwargs):
        raise KernelError(f"{memory.kernel_name}: block pointers and tensor descriptors are not checked here: "
                          "address memory as a base pointer plus a block of offsets (ptr + offs), with a mask")

    b.create_masked_load, b.create_masked_store, b.create_dot = load, store, dot
    b.create_atomic_rmw, b.create_atomic_cas = atomic_rmw, atomic_cas
    for n in extra:
        setattr(b, n, unsupported)
    try:
        yield
    finally:
        for n in list(orig) + extra:
            with contextlib.suppress(AttributeError):
                delattr(b, n)  # the instance attributes go; the class's methods show through again


def _language_owners() -> list[Any]:
    """triton.language's modules and classes: what the interpreter patches while a kernel runs."""
    import importlib
    import inspect

    mods = [tl, tl.core, tl.math]
    for name in ("triton.language.standard", "triton.language.random", "triton.language.semantic"):
        with contextlib.suppress(ImportError):
            mods.append(importlib.import_module(name))
    classes = {id(c): c for m in mods for c in vars(m).values()
               if inspect.isclass(c) and getattr(c, "__module__", "").startswith("triton.language")}
    return mods + list(classes.values())


@contextlib.contextmanager
def _language_restored() -> Iterator[None]:
    """The interpreter patches triton.language while a kernel runs and restores most of it, but not
    what a call of a library @triton.jit function (tl.sigmoid, tl.max, ...) patched: put all of it back."""
    owners = _language_owners()
    saved = [(o, dict(vars(o))) for o in owners]
    try:
        yield
    finally:
        for owner, before in saved:
            now = vars(owner)
            if isinstance(owner, type):  # a module keeps what was added (the interpreter caches helpers there)
                for name in [n for n in now if n not in before]:
                    with contextlib.suppress(AttributeError, TypeError):
                        delattr(owner, name)
            for name, value in before.items():
                if now.get(name, _MISSING_ATTR) is not value:
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(owner, name, value)


_MISSING_ATTR = object()


def _original_error(exc: BaseException) -> BaseException:
    """The kernel's own exception inside the interpreter's InterpreterError wrapping."""
    seen = exc
    while type(seen).__name__ == "InterpreterError" and seen.__cause__ is not None:
        seen = seen.__cause__
    return seen


# ------------------------------------------------------------------ launching
def launch(kernel: Any, grid: Any, *args: Any, **meta: Any) -> None:
    """kernel[grid](*args, **meta), checked. On NumpyTensor arguments the kernel is interpreted:
    every access is checked before it happens, races between programs are a KernelError after the
    launch, and inside `trace()` the launch is recorded. On PyTorch CUDA tensors it is compiled
    (an autotuned kernel from `autotuned` too) and launched on the GPU. `grid`: a tuple of up to
    three ints, or a function of the launch's meta-parameters returning one."""
    need_triton()
    if any(_is_cuda(a) for a in args):
        from triton.runtime.autotuner import Autotuner

        runner = kernel if isinstance(kernel, Autotuner) else _compiled(kernel)
        with _compiler_mode():
            runner[grid](*args, **meta)
        return
    if not isinstance(kernel, _interp.InterpretedFunction):
        raise TypeError(f"launch: kernel must be a @triton.jit function, got {kernel!r}")
    import inspect

    params = list(inspect.signature(kernel.fn).parameters)
    bound = dict(zip(params, args))
    tensors = {n: v for n, v in {**bound, **meta}.items() if isinstance(v, NumpyTensor)}
    for n, v in {**bound, **meta}.items():
        if isinstance(v, np.ndarray):
            raise TypeError(f"launch: {kernel.fn.__name__}'s argument {n} is a NumPy array: pass NumpyTensors "
                            f"(to_device(a)), which live in the interpreter's device memory")
    if callable(grid):
        grid = grid({**bound, **meta})
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    record = KernelTrace()._start(kernel.fn.__name__, grid, tensors) if _TRACES else None
    memory = _Memory(kernel.fn.__name__, tensors, record)
    try:
        import dataclasses

        builder = _interp.interpreter_builder
        options = builder.options
        # Checking every integer + and * for int32 overflow costs the interpreter about half its time, and
        # a compiled kernel does not check either (unless debug=True): off, as on the GPU.
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
        try:
            with _language_restored(), _instrumented(memory), np.errstate(all="ignore"):  # a GPU does not warn
                kernel[grid](*args, **meta)
        finally:
            builder.options = options
    except Exception as exc:  # the interpreter wraps the kernel's error: raise the kernel's own
        inner = _original_error(exc)
        if inner is exc:
            raise
        if not isinstance(inner, (NotImplementedError, KernelError)):
            prog = getattr(_interp.interpreter_builder, "grid_idx", None)
            inner.add_note(f"(in program {tuple(prog) if prog is not None else '?'} of {kernel.fn.__name__}, "
                           f"launched on a grid of {grid})")
        raise inner.with_traceback(inner.__traceback__) from None
    races = memory.races()
    if races:
        raise KernelError("\n".join(races))
    for launches in _TRACES:
        launches.append(record)


_COMPILED: dict[Any, Any] = {}


def _compiled(kernel: Any) -> Any:
    """The JIT-compiled twin of an interpreted kernel: triton's JITFunction of the same Python
    function, with the @triton.jit helpers it calls compiled too."""
    fn = kernel.fn
    if fn not in _COMPILED:
        from triton.runtime.jit import JITFunction

        names = set(fn.__code__.co_names)
        helpers = {n: fn.__globals__[n] for n in names
                   if isinstance(fn.__globals__.get(n), _interp.InterpretedFunction) and fn.__globals__[n] is not kernel}
        target = fn
        if helpers:
            scope = dict(fn.__globals__)
            scope.update({n: _compiled(v) for n, v in helpers.items()})
            target = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
            target.__annotations__, target.__kwdefaults__ = fn.__annotations__, fn.__kwdefaults__
            target.__module__, target.__qualname__ = fn.__module__, fn.__qualname__
        _COMPILED[fn] = JITFunction(target)
    return _COMPILED[fn]


_TWINS: dict[Any, Any] = {}


def _stdlib_owners() -> list[Any]:
    import importlib

    owners = [tl, tl.core, tl.tensor]
    for name in ("triton.language.standard", "triton.language.random", "triton.language.math"):
        with contextlib.suppress(ImportError):
            owners.append(importlib.import_module(name))
    return owners


@contextlib.contextmanager
def _compiler_mode() -> Iterator[None]:
    """Triton fixes interpreted or compiled when triton.language is imported: under
    TRITON_INTERPRET=1 its library of @triton.jit functions (tl.sigmoid, tl.max, tl.softmax, ...) are
    interpreted functions, which the compiler cannot call. For a compilation, switch the
    interpreter off and put the compiled twins of those functions in their place."""
    from triton.runtime.jit import JITFunction

    saved = []
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        for owner in _stdlib_owners():
            for name, v in list(vars(owner).items()):
                if isinstance(v, _interp.InterpretedFunction):
                    if v.fn not in _TWINS:
                        _TWINS[v.fn] = JITFunction(v.fn)
                    saved.append((owner, name, v))
                    setattr(owner, name, _TWINS[v.fn])
        yield
    finally:
        for owner, name, v in reversed(saved):
            setattr(owner, name, v)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def autotuned(kernel: Any, configs: Sequence[Any], key: Sequence[str]) -> Any:
    """triton.autotune(configs, key) over the compiled kernel (GPU only: the interpreter has nothing
    to time). Each distinct value of the `key` arguments is tuned once, on its first launch."""
    need_triton()
    cache_key = (kernel.fn, tuple(repr(c) for c in configs), tuple(key))
    if cache_key not in _COMPILED:
        _COMPILED[cache_key] = triton.autotune(configs=list(configs), key=list(key))(_compiled(kernel))
    return _COMPILED[cache_key]


# ------------------------------------------------------------------ the compiler, without a GPU
_TYPES = {"float32": "fp32", "float16": "fp16", "float64": "fp64", "bfloat16": "bf16", "int32": "i32",
          "int64": "i64", "int8": "i8", "uint8": "u8", "bool": "i1", "int16": "i16"}


def compile_for_gpu(kernel: Any, args: dict[str, Any], arch: int = 80, num_warps: int = 4,
                    num_stages: int = 3) -> dict[str, Any]:
    """Compile `kernel` for NVIDIA compute capability `arch` (80: A100, 90: H100) without a GPU,
    specialised on `args` ({parameter: a NumpyTensor, an int, or a constexpr's value}) the way
    Triton's JIT specialises a launch: an int equal to 1 becomes a constant, ints divisible by 16
    and 16-byte aligned pointers are marked so. Returns {"ptx", "shared_bytes", "counts"}
    (`counts`: ptx_counts of the PTX)."""
    need_triton()
    import inspect

    from triton.backends.compiler import GPUTarget

    fn = kernel.fn
    params = inspect.signature(fn).parameters
    missing = [p for p in params if p not in args]
    if missing:
        raise ValueError(f"compile_for_gpu: args must give every parameter of {fn.__name__}; missing {missing}")
    jit = _compiled(kernel)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, p) in enumerate(params.items()):
        v = args[name]
        ann = str(p.annotation)
        if "constexpr" in ann:
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, NumpyTensor):
            signature[name] = "*" + _TYPES[v.dtype.name]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, (bool, np.bool_)):
            signature[name] = "i1"
        elif isinstance(v, (int, np.integer)):
            if v == 1:
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, (float, np.floating)):
            signature[name] = "fp32"
        else:
            raise TypeError(f"compile_for_gpu: args[{name!r}] must be a NumpyTensor, an int or a float, got {v!r}")
    with _compiler_mode():
        src = triton.compiler.ASTSource(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", int(arch), 32),
                                  options={"num_warps": int(num_warps), "num_stages": int(num_stages)})
    ptx = compiled.asm["ptx"]
    return {"ptx": ptx, "shared_bytes": int(compiled.metadata.shared), "counts": ptx_counts(ptx)}


_PTX_PATTERNS = {
    "ld.global": r"\bld\.global\b", "ld.global.v4": r"\bld\.global(\.[\w:]+)*\.v4\b",
    "st.global": r"\bst\.global\b", "cp.async": r"\bcp\.async\.c[ag]\b", "cp.async.bulk": r"\bcp\.async\.bulk\b",
    "ld.shared": r"\bld\.shared\b", "st.shared": r"\bst\.shared\b", "ldmatrix": r"\bldmatrix\b",
    "mma.sync": r"\bmma\.sync\b", "wgmma": r"\bwgmma\.mma_async\b", "bar.sync": r"\bbar\.sync\b",
    "shfl.sync": r"\bshfl\.sync\b", "ex2": r"\bex2\.approx\b", "atom": r"\b(atom|red)\.global\b",
}


def ptx_counts(ptx: str) -> dict[str, int]:
    """How many of each instruction that shows what the compiler did a PTX text holds: global loads
    (and 16-byte vector loads among them), async copies to shared memory (cp.async; cp.async.bulk
    is the Hopper TMA), shared-memory loads and stores, ldmatrix, tensor-core mma.sync/wgmma,
    barriers, warp shuffles, exp2, atomics."""
    import re

    return {k: len(re.findall(p, ptx)) for k, p in _PTX_PATTERNS.items()}


# %%
#| export triton_interp
#| given
from minitorch.checks import Count, Instance, Int, Optional, Rule, Seq, Size, Str, Unchecked, validate_public  # noqa: E402


class _Kernel(Rule):
    """A @triton.jit kernel (or, where Triton is missing, its stand-in)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if not (callable(getattr(value, "fn", None)) and hasattr(value, "__getitem__")):
            raise TypeError(f"{what}: {name} must be a @triton.jit kernel, got {describe(value)}")


class _Grid(Rule):
    """A launch grid: 1 to 3 ints >= 1, or a function of the launch's meta-parameters returning one."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if callable(value):
            return
        ok = isinstance(value, (tuple, list)) and 1 <= len(value) <= 3 and all(
            isinstance(g, (int, np.integer)) and not isinstance(g, bool) and g >= 1 for g in value)
        if not ok:
            raise (TypeError if not isinstance(value, (tuple, list)) else ValueError)(
                f"{what}: {name} must be a tuple of 1 to 3 ints >= 1 (or a function returning one), got {describe(value)}")


class _Dtype(Rule):
    """A real or bool NumPy dtype, or what np.dtype() reads as one ('float32', np.float16)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        try:
            dt = np.dtype(value) if value is not None and not isinstance(value, (bool, int, float)) else None
        except TypeError:
            dt = None
        if dt is None or dt.kind not in "biuf":
            raise TypeError(f"{what}: {name} must be a real or bool dtype, got {describe(value)}")


class _Program(Rule):
    def __call__(self, what: str, name: str, value: Any) -> None:
        if value is not None:
            try:
                _program_key(value)
            except TypeError:
                raise TypeError(f"{what}: {name} must be a program id (an int or a tuple of up to 3 ints), "
                                f"got {describe(value)}") from None


_ANY_ARRAY = _DeviceArray()

validate_public(globals(), {
    "cdiv": {"a": Count, "b": Size},
    "next_power_of_2": {"n": Size},
    "NumpyTensor": {"a": Array()},
    "NumpyTensor.empty": {"shape": Seq(Count), "dtype": _Dtype()},
    "NumpyTensor.set_": {"storage": Instance(_Storage), "offset": Count, "size": Seq(Count), "stride": Seq(Count)},
    "to_device": {"a": _DeviceArray()},
    "empty": {"shape": Seq(Count), "dtype": Unchecked(), "like": _ANY_ARRAY},
    "to_host": {"t": _ANY_ARRAY, "like": Optional(_ANY_ARRAY)},
    "KernelTrace.loads": {"name": Str(), "program": _Program()},
    "KernelTrace.stores": {"name": Str(), "program": _Program()},
    "KernelTrace.counts": {"name": Str(), "kind": Str()},
    "KernelTrace.elements": {"name": Str(), "program": _Program(), "kind": Str()},
    "KernelTrace.blocks": {"name": Str(), "program": _Program()},
    "KernelTrace.dots": {"program": _Program()},
    "launch": {"kernel": _Kernel(), "grid": _Grid()},
    "autotuned": {"kernel": _Kernel(), "configs": Seq(min_len=1), "key": Seq(Str())},
    "compile_for_gpu": {"kernel": _Kernel(), "args": Instance(dict, must="a dict {parameter: value}"),
                        "arch": Int(70, 120), "num_warps": Int(1, 32), "num_stages": Size},
    "ptx_counts": {"ptx": Str()},
})

# %% [markdown]
# The cell above is the machinery (in the student notebook, one import). It set `TRITON_INTERPRET=1`
# before importing Triton: Triton decides when `triton.language` is first imported whether kernels
# are interpreted or compiled, for the whole process, so the check cells and the tests, which need
# the interpreter's records, always get it. `launch` compiles the same kernel for real when its
# arguments are PyTorch CUDA tensors (on a GPU machine), and `compile_for_gpu` compiles it to PTX
# on any machine; both switch the interpreter off while they compile.

# %%
print(TRITON_MISSING or f"Triton {triton.__version__}: kernels run under its interpreter on the CPU"
      + (f"; {GPU_REASON} compiles them too" if HAVE_GPU else ""))

# %%
#| default_exp triton_kernels
#| export
"""minitorch.triton_kernels: lesson 17's Triton kernels and their launchers.

A fused bias + GELU, a fused row softmax, a matmul with grouped program order and a fused epilogue,
and FlashAttention-2 forward and backward, wired into minitorch's autograd. Each launcher takes
NumPy arrays (the kernel runs under Triton's interpreter, checked: minitorch.triton_interp) or
PyTorch CUDA tensors (the kernel is compiled and runs on the GPU) and returns the same kind.
"""
import functools
import math
from typing import Any

import numpy as np

from minitorch.autograd import Tensor
from minitorch.checks import check_int
# All of the machinery's names, also those only the notebook's cells use: one copy of it in the notebook.
from minitorch.triton_interp import (  # noqa: F401
    TRITON_MISSING, KernelError, KernelTrace, NumpyTensor, TritonUnavailable, _DeviceArray, autotuned, cdiv,
    compile_for_gpu, empty, launch, need_torch_cuda, need_triton, next_power_of_2, ptx_counts, tl, to_device, to_host,
    trace, triton,
)

# %% [markdown]
# ## 1. Programs, not threads
#
# In lesson 07 a kernel was the code of one thread, and a launch started a grid of blocks of
# threads. In Triton a kernel is the code of one program, and a launch starts a grid of programs:
#
# | | CUDA (lessons 07, 08) | Triton |
# |---|---|---|
# | unit of code | one thread | one program (a block of work) |
# | where am I | `blockIdx.x * blockDim.x + threadIdx.x` | `tl.program_id(0)`, then `pid * BLOCK + tl.arange(0, BLOCK)` |
# | the edge | `if (i < n)` around the body | `mask = offs < n`, given to every `tl.load` and `tl.store` |
# | memory | `p[i]`, one element per thread | `tl.load(p + offs, mask=mask, other=0.0)`, a whole block |
# | shared memory, barriers | written by hand | decided by the compiler |
# | sizes | `#define`, template arguments | `BLOCK: tl.constexpr` parameters |
#
# A kernel's array arguments arrive as **pointers** to their first element, and `p + offs` is a
# block of pointers: `offs` must spell out where each element is, so strides are arguments (element
# (i, j) of a matrix is at `i * stride_0 + j * stride_1`). Block sizes must be known when the kernel
# is compiled (`tl.constexpr`), and `tl.arange` needs a power of two: the last block of a row of 45
# elements has 13 real lanes and 3 masked ones (with 16-wide blocks). A masked-off lane neither
# loads nor stores; a load gives it `other` instead.
#
# The interpreter runs each program as Python over NumPy arrays, so a kernel can be stepped
# through, and printed from (`print` works in it, `tl.device_print` on a GPU). Here is a complete
# kernel, `y = a * x` over a vector, traced: `launch` runs it, and inside `trace()` each program's
# accesses are recorded.

# %% tags=["demo"]
@triton.jit
def scale_kernel(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, a * x, mask=mask)


x_demo = to_device(np.arange(45, dtype=np.float32))
y_demo = empty((45,), np.float32, like=x_demo)
with trace() as launches:
    launch(scale_kernel, (cdiv(45, 16),), x_demo, y_demo, 45, 2.0, BLOCK=16)
tr = launches[0]
for p in tr.programs:
    got = tr.elements("x_ptr", p)
    print(f"program {p[0]}: loads x[{got.min()}..{got.max()}] ({tr.loads('x_ptr', p)} of its 16 lanes)")
print("y[:5] =", y_demo.numpy()[:5], f"; bytes moved: {tr.bytes_moved()} (45 floats read, 45 written)")

# %% [markdown]
# Without the mask, the last program loads 3 elements past the end of `x`. On a GPU that reads
# whatever lies there (or faults); here the access is checked before it happens:

# %% tags=["demo"]
@triton.jit
def scale_kernel_unmasked(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, a * tl.load(x_ptr + offs))


try:
    launch(scale_kernel_unmasked, (cdiv(45, 16),), x_demo, y_demo, 45, 2.0, BLOCK=16)
except KernelError as exc:
    print("KernelError:", exc)

# %% [markdown]
# ### A fused elementwise kernel
#
# Lesson 08 fused `y = gelu(x + bias)` into one CUDA kernel: one read of `x`, one write of `y`,
# instead of a pass over memory per operator. In Triton the same kernel is a 2D grid of programs,
# each owning a BLOCK_M x BLOCK_N tile of the matrix. GELU in its tanh form is
# $\tfrac12 v\,(1 + \tanh(u))$ with $u = \sqrt{2/\pi}\,(v + 0.044715\,v^3)$; since
# $\tfrac12(1 + \tanh u) = \sigma(2u)$, it is `v * tl.sigmoid(2 * u)`: `tl.sigmoid` exists in
# every Triton version, `tanh` only in the device libraries.
#
# **Exercise 17.1.** Write `bias_gelu_kernel`: program (pid_m, pid_n) computes rows
# `pid_m * BLOCK_M + tl.arange(0, BLOCK_M)` and columns `pid_n * BLOCK_N + tl.arange(0, BLOCK_N)` of
# `y = gelu(x + bias)`, for x and y of shape (M, N) with the strides given (in elements), bias of
# shape (N,). Build a 2D block of offsets by broadcasting (`rows[:, None] * stride_xm + cols[None, :]
# * stride_xn`), mask both edges, compute in float32 (`.to(tl.float32)`) and store in y's dtype
# (`y.to(y_ptr.dtype.element_ty)`). Each element of x is read once, each of y written once.

# %%
#| export
#| exercise 17.1
@triton.jit
def bias_gelu_kernel(x_ptr, bias_ptr, y_ptr, M, N, stride_xm, stride_xn, stride_ym, stride_yn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = gelu_tanh(x + bias) on the (BLOCK_M, BLOCK_N) tile (pid_m, pid_n) of x, y (M, N); bias (N,)."""
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
    b = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
    v = (x + b[None, :]).to(tl.float32)
    y = v * tl.sigmoid(2.0 * 0.7978845608028654 * (v + 0.044715 * v * v * v))
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION

# %% [markdown]
# The launcher: move the arrays to the device (a copy into the interpreter's memory here; a PyTorch
# CUDA tensor stays where it is), allocate y, launch a grid of cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N)
# programs, bring y back. Strides come from the arrays themselves, so a transposed or sliced x
# works without a copy.

# %%
#| export
def bias_gelu(x: Any, bias: Any, block_m: int = 32, block_n: int = 32) -> Any:
    """gelu_tanh(x + bias) by bias_gelu_kernel. x (M, N), bias (N,): float32 or float16, any strides; NumPy
    arrays (interpreted) or PyTorch CUDA tensors (compiled). Returns y (M, N), contiguous, x's dtype and kind."""
    xd, bd = to_device(x), to_device(bias)
    m, n = xd.shape
    if tuple(bd.shape) != (n,):
        raise ValueError(f"bias_gelu: bias must have shape ({n},) for x of shape {tuple(xd.shape)}, got {tuple(bd.shape)}")
    y = empty((m, n), xd.dtype, like=xd)
    launch(bias_gelu_kernel, (cdiv(m, block_m), cdiv(n, block_n)), xd, bd, y, m, n, *xd.stride(), *y.stride(),
           BLOCK_M=block_m, BLOCK_N=block_n)
    return to_host(y, like=x)

# %% tags=["check"]
check("17.1")

# %% [markdown]
# What the trace says about the fused kernel on a (37, 45) float32 matrix with 16 x 16 tiles: the
# grid, the lanes the corner program uses, and the bytes moved, against the same formula computed
# one operator at a time (lesson 08 counted ten operators, each a pass that reads at least one
# full-size array and writes one).

# %% tags=["demo"]
xg = rng.standard_normal((37, 45)).astype(np.float32)
bg = rng.standard_normal(45).astype(np.float32)
with trace() as launches:
    yg = bias_gelu(xg, bg, block_m=16, block_n=16)
tr = launches[0]
lanes = 16 * 16
print(f"grid {tr.grid[:2]}: {len(tr.programs)} programs of {lanes} lanes; lanes used by the corner program "
      f"{tr.loads('x_ptr', (2, 2))} of {lanes}")
print(f"x read {int(tr.counts('x_ptr').min())}-{int(tr.counts('x_ptr').max())} time(s) per element, "
      f"y written {int(tr.counts('y_ptr', 'store').max())} time(s)")
ops = 10  # lesson 08 counted ten operators (ten kernels) in the unfused expression
print(f"bytes moved: fused {tr.bytes_moved():,} (x read once, y written once, and the bias); as separate operators "
      f"at least {2 * ops * xg.nbytes:,} (each of the {ops} reads a full-size array and writes one)")

# %% [markdown]
# On a GPU the fused kernel against the same formula as PyTorch operators (each one kernel and one
# pass over memory), as a bandwidth: bytes the fused kernel must move (x read, y written) per second.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
torch = need_torch_cuda()
xt = torch.randn(8192, 8192, device="cuda")
bt = torch.randn(8192, device="cuda")


def gelu_torch(x, b):
    v = x + b
    return 0.5 * v * (1 + torch.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))


assert torch.allclose(bias_gelu(xt, bt, 64, 64), gelu_torch(xt, bt), atol=1e-5, rtol=1e-4)
t_fused = triton.testing.do_bench(lambda: bias_gelu(xt, bt, 64, 64))
t_torch = triton.testing.do_bench(lambda: gelu_torch(xt, bt))
print(f"{GPU_REASON}, bias+GELU 8192x8192 float32: Triton {t_fused:.3f} ms ({2 * xt.nbytes / t_fused / 1e6:,.0f} GB/s), "
      f"PyTorch operators {t_torch:.3f} ms: {t_torch / t_fused:.1f}x")

# %% [markdown]
# ## 2. Fused softmax
#
# A row softmax, $y_j = e^{x_j - m} / \sum_k e^{x_k - m}$ with $m = \max_k x_k$ (subtracting the
# maximum keeps every exponent <= 0, so nothing overflows), is memory-bound: a few FLOPs per element
# against 8 bytes moved (4 read, 4 written, in float32). Written as array operators it reads x for
# the max, reads x and writes x - m, reads that and writes the exponentials, reads them for the sum,
# reads them again and writes y: five passes. Fused, with one program per row and the row held in
# registers, it reads x once and writes y once (Triton's fused-softmax tutorial; lesson 08's CUDA C
# version did the same with a block of threads and shared memory).
#
# One program per row needs the whole row in one block: `BLOCK = next_power_of_2(n_cols)`, the lanes
# past the row masked. The masked lanes must not change the max or the sum: load them as `-inf`
# (`other=-float("inf")`), whose exponential is 0. `tl.max(x, axis=0)` and `tl.sum(e, axis=0)` reduce a
# block; the compiler turns them into warp shuffles (and a round through shared memory when a row
# spans several warps).
#
# **Exercise 17.2.** Write `softmax_kernel`: program `row` reads row `row` of x (its columns are
# contiguous; rows are `stride_x` elements apart), computes the softmax in float32 and writes row
# `row` of y (rows `stride_y` apart), in y's dtype. One load of x, one store of y.

# %%
#| export
#| exercise 17.2
@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    """y[row] = softmax(x[row]) for row = tl.program_id(0); BLOCK >= n_cols, a power of two."""
    ### BEGIN SOLUTION
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION

# %%
#| export
def softmax(x: Any) -> Any:
    """Row softmax of x (rows, cols) by softmax_kernel, one program per row. x: float32 or float16, its
    columns contiguous (a NumPy array with other strides is copied); NumPy (interpreted) or a PyTorch CUDA
    tensor (compiled). Returns y (rows, cols), x's dtype and kind."""
    if isinstance(x, np.ndarray) and x.ndim == 2 and x.strides[1] != x.itemsize:
        x = np.ascontiguousarray(x)
    xd = to_device(x)
    rows, cols = xd.shape
    if xd.stride()[1] != 1:
        raise ValueError(f"softmax: x's columns must be contiguous (stride 1), got strides {tuple(xd.stride())}")
    y = empty((rows, cols), xd.dtype, like=xd)
    if rows and cols:
        launch(softmax_kernel, (rows,), xd, y, cols, xd.stride()[0], y.stride()[0], BLOCK=next_power_of_2(cols))
    return to_host(y, like=x)

# %% tags=["check"]
check("17.2")

# %% [markdown]
# Bytes, counted by the trace on a (64, 1000) float32 matrix, against the five passes of the
# unfused version (a read for the max and for the sum, a read and a write for x - m, for the
# exponential and for the division; the per-row maxima and sums are small):

# %% tags=["demo"]
xs = (rng.standard_normal((64, 1000)) * 5).astype(np.float32)
with trace() as launches:
    ys = softmax(xs)
tr = launches[0]
e = np.exp(xs - xs.max(axis=1, keepdims=True))
print(f"max error against NumPy: {np.abs(ys - e / e.sum(axis=1, keepdims=True)).max():.1e}")
unfused_bytes = (1 + 2 + 2 + 1 + 2) * xs.nbytes  # max: read; x - m: read, write; exp: read, write; sum: read; divide: read, write
print(f"fused: {tr.bytes_moved():,} bytes = {tr.bytes_moved() / xs.nbytes:.0f} x the matrix; "
      f"unfused: about {unfused_bytes // xs.nbytes} x ({unfused_bytes:,} bytes)")
print(f"loads of x per program: {[b[:2] for b in tr.blocks('x_ptr', 0)]} (one load of one block of 1024 lanes)")

# %% [markdown]
# What the compiler made of it, for an A100 (compute capability 8.0), compiled here without a GPU:
# the reductions became warp shuffles (`shfl.sync`) with a small round through shared memory
# between warps, and with 1024 columns (a multiple of 16, so every row starts 16-byte aligned) the
# loads are 16-byte vector loads (`ld.global.v4`), which is what coalescing needs. With 1000 columns
# the compiler cannot prove the alignment and falls back to narrower loads.

# %% tags=["demo"]
for cols in (1024, 1000):
    xs_c = to_device(np.zeros((64, cols), np.float32))
    info = compile_for_gpu(softmax_kernel, dict(x_ptr=xs_c, y_ptr=xs_c, n_cols=cols, stride_x=cols, stride_y=cols,
                                                 BLOCK=1024), arch=80)
    counts = {k: v for k, v in info["counts"].items() if v}
    print(f"n_cols = {cols}: shared memory {info['shared_bytes']} bytes; {counts}")

# %% [markdown]
# On a GPU: the fused kernel's bandwidth (8 bytes per float32 element, read and written) as a share
# of what a device-to-device copy reaches on the same card, against `torch.softmax` and the five
# operators written out.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
torch = need_torch_cuda()
xt = torch.randn(8192, 8192, device="cuda")
assert torch.allclose(softmax(xt), torch.softmax(xt, dim=1), atol=1e-6)
buf = torch.empty_like(xt)
t_copy = triton.testing.do_bench(lambda: buf.copy_(xt))
t_tri = triton.testing.do_bench(lambda: softmax(xt))
t_torch = triton.testing.do_bench(lambda: torch.softmax(xt, dim=1))
t_unfused = triton.testing.do_bench(lambda: (lambda e: e / e.sum(1, keepdim=True))((xt - xt.max(1, keepdim=True)[0]).exp()))
gbs = lambda ms: 2 * xt.nbytes / ms / 1e6  # noqa: E731
print(f"{GPU_REASON}, softmax of 8192x8192 float32: copy {gbs(t_copy):,.0f} GB/s; Triton {gbs(t_tri):,.0f} GB/s "
      f"({t_copy / t_tri:.0%} of the copy); torch.softmax {gbs(t_torch):,.0f} GB/s; unfused {gbs(t_unfused):,.0f} GB/s")

# %% [markdown]
# ## 3. Matmul: tiles, a K loop, and the order of the programs
#
# Lesson 08 climbed a ladder of CUDA C SGEMMs: shared-memory tiles, register tiles, vector loads,
# double buffering, tensor cores. In Triton the program computes one BLOCK_M x BLOCK_N tile of
# C = A B, and the rest is three lines: load a BLOCK_M x BLOCK_K tile of A and a BLOCK_K x BLOCK_N
# tile of B, `acc = tl.dot(a, b, acc)`, step along K (the matmul tutorial of Triton's documentation):
#
# ```
# acc = zeros((BLOCK_M, BLOCK_N), float32)
# for k0 in range(0, K, BLOCK_K):
#     a = A[rows, k0:k0+BLOCK_K]   (masked: rows < M, k < K)
#     b = B[k0:k0+BLOCK_K, cols]   (masked: k < K, cols < N)
#     acc = tl.dot(a, b, acc)      (tensor cores where the types allow)
# C[rows, cols] = acc              (masked)
# ```
#
# The K mask matters: when K is not a multiple of BLOCK_K the last step reads past the end of each
# row of A; loading those lanes as 0 makes them add nothing. Accumulate in float32 whatever the
# input type (float16 products summed in float16 lose digits fast).
#
# **Program order.** The programs of a launch run in waves: a GPU with 132 SMs runs about 132 large
# programs at once, in the order of their program ids. Numbered row by row, one wave computes a few
# rows of tiles of C, which need a few row panels of A but every column panel of B. Numbered in
# *groups* of GROUP_M rows, column by column inside a group, a wave covers a squarer block of C and
# needs fewer panels in all, so more of its loads hit the L2 cache. The tutorial's mapping from the
# program id to the tile:
#
# ```
# num_pid_m, num_pid_n = cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)
# group = pid // (GROUP_M * num_pid_n)              which group of GROUP_M tile rows
# first_m = group * GROUP_M
# size_m = min(num_pid_m - first_m, GROUP_M)        the last group can be smaller
# pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % size_m
# pid_n = (pid % (GROUP_M * num_pid_n)) // size_m
# ```
#
# With GROUP_M = 1 it is row-major order.
#
# **Epilogue.** While the tile is still in registers, add a bias and apply an activation before the
# one store: what would otherwise be a second kernel reading and writing all of C (fusion, again).
# `HAS_BIAS` and `ACTIVATION` are constexprs, so each combination compiles to its own kernel with no
# run-time branch; without a bias, `bias_ptr` is some other valid pointer and must not be read.
#
# **Exercise 17.3.** Write `matmul_kernel`: a 1D grid of cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs in
# the grouped order above; C (M, N) = A (M, K) @ B (K, N), all three with the strides given; the K
# loop with `tl.dot` accumulating in float32; then `+ bias` (shape (N,)) if HAS_BIAS, then GELU
# (tanh form, as in 17.1) if `ACTIVATION == "gelu"`, then one masked store in C's dtype.

# %%
#| export
#| exercise 17.3
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  stride_cm, stride_cn, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C = act(A @ B + bias) on the tile of program tl.program_id(0), in grouped order. A (M, K), B (K, N),
    C (M, N), bias (N,), strides in elements; float32 accumulation."""
    ### BEGIN SOLUTION
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "gelu":
        acc = acc * tl.sigmoid(2.0 * 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc))
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
    ### END SOLUTION

# %% [markdown]
# The launcher. With no block sizes given, on a GPU it hands the kernel to `triton.autotune`: the
# first launch for each (M, N, K) times every configuration in `matmul_configs()` and keeps the
# fastest (block sizes, GROUP_M, and two compiler settings: `num_warps`, the warps that share one
# program, and `num_stages`, how many K steps of loads the compiler keeps in flight in shared memory).
# The interpreter has nothing to time, so there it runs with 32 x 32 x 32 tiles; the tests run every
# configuration through the interpreter instead, so each is known to be correct.

# %%
#| export
MATMUL_ACTIVATIONS = ("", "gelu")


def matmul_configs() -> list:
    """The configurations the autotuner tries on a GPU: triton.Config({BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M},
    num_warps, num_stages), from the ones Triton's matmul tutorial lists for NVIDIA GPUs."""
    need_triton()
    shapes = [(128, 256, 64, 3, 8), (64, 256, 32, 4, 4), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4),
              (64, 128, 32, 4, 4), (128, 32, 32, 4, 4), (64, 32, 32, 5, 2), (32, 64, 32, 5, 2)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=stages,
                          num_warps=warps) for bm, bn, bk, stages, warps in shapes]


def matmul(a: Any, b: Any, bias: Any = None, activation: str = "", block_m: int | None = None,
           block_n: int | None = None, block_k: int | None = None, group_m: int = 8) -> Any:
    """act(a @ b + bias) by matmul_kernel. a (M, K), b (K, N), bias (N,) or None: float32 or float16, one dtype,
    any strides; activation "" or "gelu". NumPy arrays (interpreted; blocks default to 32) or PyTorch CUDA
    tensors (compiled; autotuned over matmul_configs() unless the three block sizes are given). Returns
    c (M, N) in a's dtype and kind."""
    ad, bd = to_device(a), to_device(b)
    (m, k), (k2, n) = ad.shape, bd.shape
    if k != k2:
        raise ValueError(f"matmul: a {tuple(ad.shape)} and b {tuple(bd.shape)} do not multiply (a's columns != b's rows)")
    if ad.dtype != bd.dtype:
        raise TypeError(f"matmul: a is {ad.dtype} but b is {bd.dtype}")
    sizes = (block_m, block_n, block_k)
    if any(s is not None for s in sizes) and not all(s is not None for s in sizes):
        raise ValueError(f"matmul: give all three of block_m, block_n, block_k or none, got {sizes}")
    c = empty((m, n), ad.dtype, like=ad)
    biasd = to_device(bias) if bias is not None else c  # any valid pointer: not read without HAS_BIAS
    if bias is not None and tuple(biasd.shape) != (n,):
        raise ValueError(f"matmul: bias must have shape ({n},), got {tuple(biasd.shape)}")

    def grid(meta: dict) -> tuple[int]:
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)

    args = (ad, bd, c, biasd, m, n, k, *ad.stride(), *bd.stride(), *c.stride())
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=activation)
    if block_m is None and not isinstance(ad, NumpyTensor):
        launch(autotuned(matmul_kernel, matmul_configs(), key=["M", "N", "K"]), grid, *args, **flags)
    else:
        bm, bn, bk = (32, 32, 32) if block_m is None else sizes
        launch(matmul_kernel, grid, *args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m)
    return to_host(c, like=a)


def program_tiles(num_pid_m: int, num_pid_n: int, group_m: int) -> np.ndarray:
    """The tile (pid_m, pid_n) each program id computes in grouped order (group_m = 1: row-major):
    an int array (num_pid_m * num_pid_n, 2), row p for program p."""
    pid = np.arange(num_pid_m * num_pid_n)
    in_group = group_m * num_pid_n
    first_m = (pid // in_group) * group_m
    size_m = np.minimum(num_pid_m - first_m, group_m)
    return np.stack([first_m + (pid % in_group) % size_m, (pid % in_group) // size_m], axis=1)


def panels_per_wave(num_pid_m: int, num_pid_n: int, group_m: int, wave: int) -> np.ndarray:
    """For programs running `wave` at a time in program-id order: (row panels of A, column panels of B) that
    each wave reads, an int array (waves, 2). Fewer panels per wave: more of its loads can hit the L2 cache."""
    tiles = program_tiles(num_pid_m, num_pid_n, group_m)
    return np.array([[len(set(w[:, 0])), len(set(w[:, 1]))] for w in
                     (tiles[i:i + wave] for i in range(0, len(tiles), wave))], dtype=np.int64)

# %% tags=["check"]
check("17.3")

# %% [markdown]
# What the interpreter recorded for a (37, 29) @ (29, 45) product with 16 x 16 x 16 tiles and
# GROUP_M = 2: each program's `tl.dot` calls (the K loop: cdiv(29, 16) = 2 steps) and the tile it
# wrote, in the order the programs ran.

# %% tags=["demo"]
am = rng.standard_normal((37, 29)).astype(np.float32)
bm_ = rng.standard_normal((29, 45)).astype(np.float32)
with trace() as launches:
    cm = matmul(am, bm_, block_m=16, block_n=16, block_k=16, group_m=2)
tr = launches[0]
print(f"max error against NumPy: {np.abs(cm - am @ bm_).max():.1e}")
for p in tr.programs:
    out = tr.elements("c_ptr", p, "store")
    r, c_ = np.unravel_index(out.min(), (37, 45))
    print(f"program {p[0]}: tile ({r // 16}, {c_ // 16}), tl.dot {tr.dots(p)}")

# %% [markdown]
# The order, drawn: C as a grid of tiles (a 2048 x 2048 product in 128 x 128 tiles), each numbered
# with the program that computes it; the first wave of programs is outlined, with the row panels of
# A and column panels of B it reads. Move GROUP_M and the wave size (132 is one program per SM of an
# H100): the title counts the panels a wave reads, on average over all waves.

# %% tags=["demo"]
import matplotlib.pyplot as plt

from course.live import live


def draw_program_order(group_m: int, wave: int, tiles_per_side: int = 16):
    order = program_tiles(tiles_per_side, tiles_per_side, group_m)
    rank = np.empty((tiles_per_side, tiles_per_side), int)
    rank[order[:, 0], order[:, 1]] = np.arange(len(order))
    panels = panels_per_wave(tiles_per_side, tiles_per_side, group_m, wave)
    first = order[:wave]
    fig, ax = plt.subplots(figsize=(6.2, 5.4))
    ax.imshow(rank, cmap="viridis")
    in_wave = np.zeros_like(rank, dtype=float)
    in_wave[first[:, 0], first[:, 1]] = 1
    ax.imshow(np.ma.masked_where(in_wave == 0, in_wave), cmap="autumn", alpha=0.55)
    for r in set(first[:, 0]):
        ax.add_patch(plt.Rectangle((-1.6, r - 0.5), 0.8, 1, color="tab:red", clip_on=False))
    for c in set(first[:, 1]):
        ax.add_patch(plt.Rectangle((c - 0.5, -1.6), 1, 0.8, color="tab:blue", clip_on=False))
    ax.set_xlim(-1.8, tiles_per_side - 0.5)
    ax.set_ylim(tiles_per_side - 0.5, -1.8)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"GROUP_M = {group_m}, {wave} programs at a time: first wave reads {panels[0, 0]} A + "
                 f"{panels[0, 1]} B panels;\nall waves, on average {panels.sum(axis=1).mean():.1f} panels "
                 f"(colour: program id; red/blue: the first wave's A/B panels)", fontsize=9)
    return fig


live(draw_program_order, group_m=(1, 16), wave=(8, 132, 4))

# %% [markdown]
# The model counts panels, not time: whether the saved loads matter depends on how much of the
# wave's panels the L2 holds and how memory-bound the tiles are. The GPU cells below measure it.
#
# What the compiler does with the kernel, compiled here for an A100 (8.0) and an H100 (9.0) with
# float16 inputs and sizes that are multiples of 16 (as Triton's JIT would specialise them): the
# K loop became asynchronous copies into shared memory (`cp.async`, issued ahead into a ring of
# buffers: the double buffering of lesson 08 section 10, `sgemm_dbuf`, with as many buffers as
# `num_stages` asks for), `ldmatrix` loads from shared memory into the tensor cores' register
# layout, and `mma.sync` (Ampere) or `wgmma` (Hopper) tensor-core instructions. None of it is in
# the kernel's source.

# %% tags=["demo"]
f16 = lambda *s: to_device(np.zeros(s, np.float16))  # noqa: E731
mm_args = dict(a_ptr=f16(512, 512), b_ptr=f16(512, 512), c_ptr=f16(512, 512), bias_ptr=f16(512), M=512, N=512, K=512,
               stride_am=512, stride_ak=1, stride_bk=512, stride_bn=1, stride_cm=512, stride_cn=1, HAS_BIAS=True,
               ACTIVATION="gelu", BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8)
for arch in (80,) if SMALL else (80, 90):
    t0 = time.perf_counter()
    info = compile_for_gpu(matmul_kernel, mm_args, arch=arch, num_warps=4, num_stages=3)
    counts = {k: v for k, v in info["counts"].items() if v}
    print(f"sm_{arch}: {info['shared_bytes'] // 1024} KiB of shared memory, {counts} "
          f"(compiled in {time.perf_counter() - t0:.1f} s)")

# %% [markdown]
# On a GPU: TFLOP/s against cuBLAS (through `torch.matmul`) at n = 4096. For float32 inputs `tl.dot`
# uses TF32 tensor cores by default (10 bits of mantissa in the products, float32 sums), so the fair
# cuBLAS comparison is with TF32 allowed; true float32 cuBLAS is printed beside it. Then float16.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
torch = need_torch_cuda()
n = 4096
flops = 2 * n ** 3
for dtype in (torch.float32, torch.float16):
    a_t, b_t = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    got = matmul(a_t, b_t)  # the first launch autotunes
    ref = (a_t.double() @ b_t.double())
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    t_tri = triton.testing.do_bench(lambda: matmul(a_t, b_t))
    best = autotuned(matmul_kernel, matmul_configs(), key=["M", "N", "K"]).best_config
    line = f"{GPU_REASON}, {str(dtype)[6:]} n={n}: Triton {flops / t_tri / 1e9:.0f} TFLOP/s (max rel. error {err:.1e}; {best})"
    for tf32 in ((True, False) if dtype == torch.float32 else (True,)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        t_cub = triton.testing.do_bench(lambda: a_t @ b_t)
        line += f"; cuBLAS{' TF32' if tf32 and dtype == torch.float32 else ''} {flops / t_cub / 1e9:.0f} TFLOP/s ({t_cub / t_tri:.0%})"
    torch.backends.cuda.matmul.allow_tf32 = False
    print(line)

# %% [markdown]
# Grouped order against row-major order, and the fused epilogue against a second kernel, measured:
# the same 128 x 128 x 64 tiles at n = 8192 in float16, GROUP_M = 8 against 1; then
# `matmul(a, b, bias, "gelu")` against `matmul(a, b)` followed by `bias_gelu`.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
torch = need_torch_cuda()
n = 8192
a_t, b_t = torch.randn(n, n, device="cuda", dtype=torch.float16), torch.randn(n, n, device="cuda", dtype=torch.float16)
bias_t = torch.randn(n, device="cuda", dtype=torch.float16)
t_group = {g: triton.testing.do_bench(lambda: matmul(a_t, b_t, block_m=128, block_n=128, block_k=64, group_m=g))
           for g in (1, 8)}
t_fused = triton.testing.do_bench(lambda: matmul(a_t, b_t, bias_t, "gelu", 128, 128, 64, 8))
t_two = triton.testing.do_bench(lambda: bias_gelu(matmul(a_t, b_t, None, "", 128, 128, 64, 8), bias_t, 64, 64))
print(f"{GPU_REASON}, float16 n={n}: row-major {t_group[1]:.2f} ms, GROUP_M=8 {t_group[8]:.2f} ms "
      f"({t_group[1] / t_group[8]:.2f}x); matmul+bias+GELU fused {t_fused:.2f} ms, as two kernels {t_two:.2f} ms")

# %% [markdown]
# ## 4. FlashAttention-2: the forward pass
#
# Lesson 09 built FlashAttention on the CPU: for a tile of queries, stream over tiles of keys and
# values, fold each tile's scores into a running max m, a running sum l and an output accumulator
# with the online softmax (Milakov and Gimelshein, 2018), and never hold the N x N score matrix. In
# Triton the tile of queries is a program, and the loop is FlashAttention-2's (Dao, 2023,
# Algorithm 1):
#
# ```
# q = Q[rows]                                  BLOCK_M x d, loaded once, kept in registers
# m = -inf, l = 0, acc = 0                     per row: float32
# for each key block [j, j + BLOCK_N) the rows can see:
#     s = (q @ K[j:]^T) * scale                BLOCK_M x BLOCK_N scores: all this program holds
#     s = -inf where masked (past Nk; causal: key > query + Nk - Nq)
#     m_new = max(m, rowmax(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
#     l = l * alpha + rowsum(p)
#     acc = acc * alpha + p @ V[j:]            the rescale: earlier blocks were weighted by exp(-m)
#     m = m_new
# O[rows] = acc / l;  lse[rows] = m + log(l)   written once
# ```
#
# The grid is (query blocks, heads): with G = batch x heads, program (i, g) owns query rows
# [i BLOCK_M, (i + 1) BLOCK_M) of head g, and heads never share anything. The division by l happens
# once, at the end (FlashAttention-2's change to the first version, which rescaled the output at every
# step). The log-sum-exp lse = m + log l of each row is what the backward pass needs to recompute P
# exactly, so it is saved: N numbers per head, against the N x N probabilities a plain
# implementation keeps.
#
# With a causal mask (bottom-right aligned as in lesson 09: query i sees keys j <= i + Nk - Nq), the
# last key a block's rows can see is (i + 1) BLOCK_M - 1 + Nk - Nq, so the loop stops at
# `hi = min(Nk, (i + 1) * BLOCK_M + Nk - Nq)`: the blocks above the diagonal are never loaded, about
# half of all the work when Nq = Nk. Blocks on the diagonal are partly visible: there the mask does
# it. (Triton's tutorial splits the loop in two so that the blocks below the diagonal skip the mask
# arithmetic; one loop is enough here.) With a causal mask, Nq <= Nk is required, so that every row
# sees at least one key.
#
# **Exercise 17.4.** Write `flash_fwd_kernel`. Tensors are (G, N, HEAD_DIM) with the feature axis
# contiguous; `stride_qg, stride_qm` are q's strides along G and N (likewise k, v, o); lse is a
# contiguous (G, N_Q) float32 array. Load q once, loop over key blocks up to `hi` (all of them
# without the mask), load each block of k and v once, keep m, l, acc in float32, and write o (in o's
# dtype) and lse. HEAD_DIM is a power of two from 16 to 128 (the launcher refuses other sizes).
# `tl.trans(k)` is k transposed; `tl.where(cond, a, b)` selects; `tl.max(s, axis=1)` and
# `tl.sum(p, axis=1)` reduce rows.

# %%
#| export
#| exercise 17.4
@triton.jit
def flash_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, N_Q, N_K,
                     stride_qg, stride_qm, stride_kg, stride_kn, stride_vg, stride_vn, stride_og, stride_om,
                     scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """O, lse of query block tl.program_id(0) of head tl.program_id(1): softmax(scale Q K^T (masked)) V,
    streaming over key blocks (online softmax); causal blocks above the diagonal are never loaded."""
    ### BEGIN SOLUTION
    start_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + g * stride_qg + rows[:, None] * stride_qm + dims[None, :], mask=rows[:, None] < N_Q, other=0.0)
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    offset = N_K - N_Q
    hi = N_K
    if CAUSAL:
        hi = tl.minimum(N_K, (start_m + 1) * BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + g * stride_kg + keys[:, None] * stride_kn + dims[None, :], mask=keys[:, None] < N_K,
                    other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = keys[None, :] < N_K
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + offset)
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + g * stride_vg + keys[:, None] * stride_vn + dims[None, :], mask=keys[:, None] < N_K,
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + g * stride_og + rows[:, None] * stride_om + dims[None, :], o.to(o_ptr.dtype.element_ty),
             mask=rows[:, None] < N_Q)
    tl.store(lse_ptr + g * N_Q + rows, m_i + tl.log(l_i), mask=rows < N_Q)
    ### END SOLUTION

# %%
#| export
HEAD_DIMS = (16, 32, 64, 128)


def _heads(x: Any, what: str, name: str) -> Any:
    """x as a (G, N, d) tensor on the device, its feature axis contiguous (a NumPy array is copied if not)."""
    if isinstance(x, np.ndarray) and x.ndim == 3 and x.strides[2] != x.itemsize:
        x = np.ascontiguousarray(x)
    xd = to_device(x)
    if xd.stride()[2] != 1:
        raise ValueError(f"{what}: {name}'s last axis must be contiguous (stride 1), got strides {tuple(xd.stride())}")
    return xd


def _check_attention(what: str, q: Any, k: Any, v: Any, causal: bool) -> tuple[int, int, int, int]:
    (g, nq, d), (gk, nk, dk), vshape = q.shape, k.shape, tuple(v.shape)
    if (gk, dk) != (g, d) or vshape != (g, nk, d):
        raise ValueError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {vshape} must be (G, Nq, d), (G, Nk, d), "
                         f"(G, Nk, d)")
    if d not in HEAD_DIMS:
        raise ValueError(f"{what}: the head dimension d must be one of {HEAD_DIMS} (tl.arange needs a power of two), "
                         f"got {d}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError(f"{what}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if nq < 1 or nk < 1:
        raise ValueError(f"{what}: need at least one query and one key, got Nq = {nq}, Nk = {nk}")
    if causal and nq > nk:
        raise ValueError(f"{what}: with causal=True every query must see a key: Nq = {nq} > Nk = {nk}")
    return g, nq, nk, d


def flash_forward(q: Any, k: Any, v: Any, causal: bool = False, block_m: int = 32,
                  block_n: int = 32) -> tuple[Any, Any]:
    """Attention by flash_fwd_kernel. q (G, Nq, d), k, v (G, Nk, d): float32 or float16, d in HEAD_DIMS; NumPy
    (interpreted) or PyTorch CUDA tensors (compiled). causal: query i sees keys j <= i + Nk - Nq (needs Nq <= Nk).
    Returns (o (G, Nq, d) in q's dtype, lse (G, Nq) float32), as lesson 09's attention_np(..., return_lse=True)."""
    qd, kd, vd = _heads(q, "flash_forward", "q"), _heads(k, "flash_forward", "k"), _heads(v, "flash_forward", "v")
    g, nq, nk, d = _check_attention("flash_forward", qd, kd, vd, causal)
    o = empty((g, nq, d), qd.dtype, like=qd)
    lse = empty((g, nq), np.float32, like=qd)
    launch(flash_fwd_kernel, (cdiv(nq, block_m), g), qd, kd, vd, o, lse, nq, nk, *qd.stride()[:2], *kd.stride()[:2],
           *vd.stride()[:2], *o.stride()[:2], 1.0 / math.sqrt(d), CAUSAL=bool(causal), HEAD_DIM=d, BLOCK_M=block_m,
           BLOCK_N=block_n)
    return to_host(o, like=q), to_host(lse, like=q)

# %% tags=["check"]
check("17.4")

# %% [markdown]
# The work of each program, counted by the trace for one head of 100 queries and 100 keys, d = 16,
# 16 x 16 blocks: the key rows it loaded, the `tl.dot` products it ran, and the largest block of
# scores it held (the largest `tl.dot` result). With the causal mask, program i stops at the diagonal.

# %% tags=["demo"]
qa, ka, va = (rng.standard_normal((1, 100, 16)).astype(np.float32) for _ in range(3))
print(f"{'program':>8} {'keys loaded':>12} {'(causal)':>9} {'tl.dot':>7} {'(causal)':>9} {'scores held':>20}")
runs = {}
for causal in (False, True):
    with trace() as launches:
        flash_forward(qa, ka, va, causal=causal, block_m=16, block_n=16)
    runs[causal] = launches[0]
for p in runs[False].programs:
    full, half = runs[False], runs[True]
    biggest = max(a[0] * b[1] for a, b in full.dots(p))
    print(f"{p[0]:>8} {full.loads('k_ptr', p) // 16:>12} {half.loads('k_ptr', p) // 16:>9} {len(full.dots(p)):>7} "
          f"{len(half.dots(p)):>9} {biggest:>20}")
print(f"K rows loaded in all: {runs[False].loads('k_ptr') // 16} without the mask, {runs[True].loads('k_ptr') // 16} with it; "
      f"a full row of scores for a block of 16 queries would be 16 x 100 = 1600 numbers")

# %% [markdown]
# ## 5. The backward pass, and training on it
#
# The gradients of O = PV with P = softmax(S), S = scale QK^T, are lesson 09's:
#
# $$dV = P^\top dO,\quad dP = dO\,V^\top,\quad dS = P \circ (dP - D),\quad D_i = \textstyle\sum_j P_{ij}\,dP_{ij} = dO_i \cdot O_i,
#   \quad dQ = \mathrm{scale}\; dS\,K,\quad dK = \mathrm{scale}\; dS^\top Q.$$
#
# P is recomputed block by block from the saved lse, $P_{ij} = e^{s_{ij} - \mathrm{lse}_i}$: exact,
# already normalised, no running max. FlashAttention-2's backward (Dao, 2023, Algorithm 2) gives each
# program one **key** block: it loads K and V once, loops over the query blocks that can see them,
# and accumulates dK and dV in registers, written once at the end. dQ gets a contribution from every
# key block, that is from every program of the head: the programs run at the same time, so they add
# into dQ with `tl.atomic_add` (the hardware serialises the additions to each element; the order, and
# so the last bits of the sum, vary from run to run). A plain `tl.load` + `tl.store` of dQ would lose
# updates on a GPU and work perfectly in the interpreter, which runs one program at a time; the
# course's checker reports it as a race. D is computed first, by a small kernel (given below).
#
# With a causal mask, query row i sees the block's keys only if i >= j0 - (Nk - Nq): the loop starts
# at the query block holding that row, and the blocks before it are never loaded.
#
# **Exercise 17.5.** Write `flash_bwd_kernel` (program (j, g): key block j of head g; dq is zeros on
# entry, float32, and receives `tl.atomic_add`s; dk and dv are written once; tensors as in 17.4, `do`
# with q's layout and dq with q's strides; `lse` and `delta` (G, N_Q) float32), and `triton_attention`,
# the autograd operation: its forward runs `flash_forward` on q, k, v reshaped to (G, N, d) and
# records a node (`q._record(out, (q, k, v), vjp, "triton_attention")`, as lesson 09's `flash_attention`
# did) whose backward calls `flash_backward`.

# %%
#| export
@triton.jit
def flash_bwd_preprocess(o_ptr, do_ptr, delta_ptr, N_Q, stride_og, stride_om, stride_dog, stride_dom,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[g, i] = do[g, i] . o[g, i] (float32) for query block tl.program_id(0) of head tl.program_id(1)."""
    start_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    o = tl.load(o_ptr + g * stride_og + rows[:, None] * stride_om + dims[None, :], mask=rows[:, None] < N_Q, other=0.0)
    do = tl.load(do_ptr + g * stride_dog + rows[:, None] * stride_dom + dims[None, :], mask=rows[:, None] < N_Q,
                 other=0.0)
    tl.store(delta_ptr + g * N_Q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=rows < N_Q)


def flash_backward(q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, causal: bool = False, block_m: int = 32,
                   block_n: int = 32) -> tuple[Any, Any, Any]:
    """Gradients (dq, dk, dv) of attention by flash_bwd_preprocess and flash_bwd_kernel, from q (G, Nq, d), k, v
    (G, Nk, d), the forward's o (G, Nq, d) and lse (G, Nq), and the upstream gradient do (G, Nq, d); NumPy
    (interpreted) or PyTorch CUDA tensors (compiled). dq is float32 (atomic additions); dk, dv in k's dtype."""
    qd, kd, vd = (_heads(x, "flash_backward", n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    g, nq, nk, d = _check_attention("flash_backward", qd, kd, vd, causal)
    od, dod = _heads(o, "flash_backward", "o"), _heads(do, "flash_backward", "do")
    lsed = to_device(np.ascontiguousarray(lse) if isinstance(lse, np.ndarray) else lse)
    if tuple(od.shape) != (g, nq, d) or tuple(dod.shape) != (g, nq, d) or tuple(lsed.shape) != (g, nq):
        raise ValueError(f"flash_backward: o {tuple(od.shape)}, do {tuple(dod.shape)}, lse {tuple(lsed.shape)} must be "
                         f"({g}, {nq}, {d}), ({g}, {nq}, {d}), ({g}, {nq})")
    for name, x in (("o", od), ("do", dod)):
        if x.dtype != qd.dtype:
            raise TypeError(f"flash_backward: {name} must have q's dtype {qd.dtype}, got {x.dtype}")
    if tuple(lsed.stride()) != (nq, 1):
        raise ValueError(f"flash_backward: lse must be contiguous, got strides {tuple(lsed.stride())}")
    delta = empty((g, nq), np.float32, like=qd)
    launch(flash_bwd_preprocess, (cdiv(nq, block_m), g), od, dod, delta, nq, *od.stride()[:2], *dod.stride()[:2],
           HEAD_DIM=d, BLOCK_M=block_m)
    dq = empty((g, nq, d), np.float32, like=qd)  # zeros: the programs add into it
    if not isinstance(dq, NumpyTensor):
        dq.zero_()
    if tuple(qd.stride()) != tuple(dq.stride()):
        qd = to_device(np.ascontiguousarray(to_host(qd))) if isinstance(qd, NumpyTensor) else qd.contiguous()
    dk, dv = empty((g, nk, d), kd.dtype, like=kd), empty((g, nk, d), kd.dtype, like=kd)
    launch(flash_bwd_kernel, (cdiv(nk, block_n), g), qd, kd, vd, dod, lsed, delta, dq, dk, dv, nq, nk,
           *qd.stride()[:2], *kd.stride()[:2], *vd.stride()[:2], *dod.stride()[:2], 1.0 / math.sqrt(d),
           CAUSAL=bool(causal), HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n)
    return to_host(dq, like=q), to_host(dk, like=k), to_host(dv, like=v)

# %%
#| export
#| exercise 17.5
@triton.jit
def flash_bwd_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, N_Q, N_K,
                     stride_qg, stride_qm, stride_kg, stride_kn, stride_vg, stride_vn, stride_dog, stride_dom,
                     scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """dK, dV of key block tl.program_id(0) of head tl.program_id(1), and its share of dQ (tl.atomic_add),
    recomputing P = exp(scale Q K^T - lse) block by block over the query blocks that see the keys."""
    ### BEGIN SOLUTION
    start_n = tl.program_id(0)
    g = tl.program_id(1)
    keys = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + g * stride_kg + keys[:, None] * stride_kn + dims[None, :], mask=keys[:, None] < N_K, other=0.0)
    v = tl.load(v_ptr + g * stride_vg + keys[:, None] * stride_vn + dims[None, :], mask=keys[:, None] < N_K, other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    offset = N_K - N_Q
    lo = 0
    if CAUSAL:
        lo = (tl.maximum(start_n * BLOCK_N - offset, 0) // BLOCK_M) * BLOCK_M
    for start_m in range(lo, N_Q, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        live = rows < N_Q
        q = tl.load(q_ptr + g * stride_qg + rows[:, None] * stride_qm + dims[None, :], mask=live[:, None], other=0.0)
        do = tl.load(do_ptr + g * stride_dog + rows[:, None] * stride_dom + dims[None, :], mask=live[:, None],
                     other=0.0)
        lse = tl.load(lse_ptr + g * N_Q + rows, mask=live, other=0.0)
        delta = tl.load(delta_ptr + g * N_Q + rows, mask=live, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = live[:, None] & (keys[None, :] < N_K)
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + offset)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None]) * scale
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)
        tl.atomic_add(dq_ptr + g * stride_qg + rows[:, None] * stride_qm + dims[None, :], tl.dot(ds.to(k.dtype), k),
                      mask=live[:, None])
    tl.store(dk_ptr + g * stride_kg + keys[:, None] * stride_kn + dims[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=keys[:, None] < N_K)
    tl.store(dv_ptr + g * stride_vg + keys[:, None] * stride_vn + dims[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=keys[:, None] < N_K)
    ### END SOLUTION


def triton_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, block_m: int = 64,
                     block_n: int = 64) -> Tensor:
    """Attention as one autograd node computed by the Triton kernels (interpreted): forward flash_forward, backward
    flash_backward from the saved q, k, v, o and lse. q (..., Nq, d), k, v (..., Nk, d): minitorch Tensors with
    the same batch axes, float32, d in HEAD_DIMS. Returns (..., Nq, d), equal to lesson 09's
    attention(q, k, v, causal_mask(Nq, Nk) if causal else None)."""
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"triton_attention: q {q.shape}, k {k.shape}, v {v.shape} need the same batch axes")
    ### BEGIN SOLUTION
    lead, nq, nk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q3, k3, v3 = (t.data.reshape(-1, n, d) for t, n in ((q, nq), (k, nk), (v, nk)))
    o3, lse = flash_forward(q3, k3, v3, causal, block_m, block_n)
    out = q._new(o3.reshape(*lead, nq, d))

    def vjp(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dq, dk, dv = flash_backward(q3, k3, v3, o3, lse, np.asarray(g, dtype=o3.dtype).reshape(o3.shape), causal,
                                    block_m, block_n)
        return dq.astype(q.dtype).reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

    return q._record(out, (q, k, v), vjp, "triton_attention")
    ### END SOLUTION

# %%
#| export
def use_triton_attention(model: Any, block_m: int = 64, block_n: int = 64) -> Any:
    """Make every attention layer of lesson 09's GPT compute causal attention with triton_attention (in place;
    returns the model). The layers keep their weights; only the attention function changes."""
    for block in model.blocks:
        block.attn.attend = functools.partial(triton_attention, causal=True, block_m=block_m, block_n=block_n)
    return model

# %% tags=["check"]
check("17.5")

# %% [markdown]
# Now lesson 09's tiny GPT trains on it: the same model from the same initial weights, once with
# lesson 09's reference attention and once with `use_triton_attention`, a few steps each on batches
# of 4 windows of 64 characters. Each attention layer then launches 3 kernels of 16 programs per
# step (16 = 4 windows x 4 heads, one 64-row block each), run one program at a time by the
# interpreter: the cell prints the seconds per step of each, both loss curves, and how far apart the
# two trained models' outputs are (float32 rounding: the kernels sum in a different order).

# %% tags=["demo"]
from minitorch.gpt import GPT, CharTokenizer, GPTConfig, load_corpus, split_ids, train_gpt

corpus = load_corpus()
tokenizer = CharTokenizer.from_text(corpus)
train_ids, _ = split_ids(tokenizer.encode(corpus))
steps = 2 if SMALL else 8
runs_ = {}
for impl in ("reference", "triton"):
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size), seed=0)
    if impl == "triton":
        use_triton_attention(model)
    hist = train_gpt(model, train_ids, steps, batch_size=4, seed=0, desc=f"{impl} attention")
    runs_[impl] = (model, hist["loss"], hist["seconds"] / steps)
window = train_ids[:64][None, :]
logits = {impl: m(window)[0].data for impl, (m, _, _) in runs_.items()}
print(f"{steps} steps: reference {runs_['reference'][2]:.2f} s/step, Triton (interpreted) {runs_['triton'][2]:.2f} s/step")
for impl, (_, losses, _) in runs_.items():
    print(f"{impl:>10} attention, training loss per step: {' '.join(f'{v:.4f}' for v in losses)}")
print(f"after training, the two models' logits on one window differ by at most "
      f"{np.abs(logits['reference'] - logits['triton']).max():.1e}")

# %% [markdown]
# On a GPU: forward and forward + backward at N = 4096, d = 64, 4 x 16 heads, float16, causal,
# against attention written as PyTorch operators (the N x N matrix in memory) and against PyTorch's
# `scaled_dot_product_attention` (which dispatches to its own FlashAttention kernels), after checking
# the outputs agree.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
torch = need_torch_cuda()
B, H, N, D = 4, 16, 4096, 64
qt, kt, vt = (torch.randn(B * H, N, D, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
dot_ = torch.randn(B * H, N, D, device="cuda", dtype=torch.float16)
sdpa = torch.nn.functional.scaled_dot_product_attention


def unfused(q, k, v):
    s = (q @ k.transpose(-1, -2)).float() / math.sqrt(D)
    s = s.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, dim=-1).to(q.dtype)) @ v


o_tri, lse_tri = flash_forward(qt.detach(), kt.detach(), vt.detach(), causal=True, block_m=128, block_n=64)
o_ref = sdpa(qt, kt, vt, is_causal=True)
print(f"max |Triton - SDPA| = {(o_tri.float() - o_ref.float()).abs().max().item():.1e}")


def tri_fwd_bwd():
    o, lse = flash_forward(qt.detach(), kt.detach(), vt.detach(), True, 128, 64)
    return flash_backward(qt.detach(), kt.detach(), vt.detach(), o, lse, dot_, True, 64, 64)


def torch_fwd_bwd(fn):
    def run():
        out = fn(qt, kt, vt)
        torch.autograd.grad(out, (qt, kt, vt), dot_)
    return run


fwd_flops = 4 * B * H * N * N * D / 2  # two N x N x d products, half of them under the causal mask
timings = {"Triton": (lambda: flash_forward(qt.detach(), kt.detach(), vt.detach(), True, 128, 64), tri_fwd_bwd),
        "SDPA": (lambda: sdpa(qt, kt, vt, is_causal=True), torch_fwd_bwd(lambda q, k, v: sdpa(q, k, v, is_causal=True))),
        "unfused": (lambda: unfused(qt, kt, vt), torch_fwd_bwd(unfused))}
for name, (fwd, both) in timings.items():
    with torch.no_grad():
        t_f = triton.testing.do_bench(fwd)
    t_b = triton.testing.do_bench(both)
    print(f"{GPU_REASON}, {name:>8}: forward {t_f:.2f} ms ({fwd_flops / t_f / 1e9:.0f} TFLOP/s), "
          f"forward + backward {t_b:.2f} ms")

# %% [markdown]
# ## 6. The same kernels three ways
#
# The course has now written the same operations in three languages: lesson 08's CUDA C (softmax,
# tiled SGEMM), lesson 09's Numba for the CPU and CUDA C for the GPU (FlashAttention's forward), and
# Triton here. The cell counts the lines of each kernel (code only: no blank lines, comments or
# docstrings) and, where NVRTC is installed, compiles the CUDA C to PTX beside the Triton kernel, for
# the instructions that show what each one does.

# %% tags=["demo"]
import inspect
import io
import re
import tokenize

from course.cuda_c import NvrtcUnavailable, compile_ptx, ptx_stats
from minitorch.attention import flash_cuda_program, flash_cuda_source, flash_forward_tile
from minitorch.cupy_kernels import sgemm_regtile_source, sgemm_tiled_source, softmax_source


def code_lines(text: str, language: str) -> int:
    """Lines with code: blank lines, comments and docstrings left out."""
    if language == "python":
        keep = set()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.STRING, tokenize.ENDMARKER):
                keep.update(range(tok.start[0], tok.end[0] + 1))
        return len(keep)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return sum(1 for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("//"))


kernels = [("softmax", "CUDA C (lesson 08)", code_lines(softmax_source(), "c")),
        ("softmax", "Triton", code_lines(inspect.getsource(softmax_kernel.fn), "python")),
        ("matmul", "CUDA C, shared-memory tiles (lesson 08)", code_lines(sgemm_tiled_source(), "c")),
        ("matmul", "CUDA C, register tiles (lesson 08)", code_lines(sgemm_regtile_source(), "c")),
        ("matmul", "Triton (grouped order, epilogue)", code_lines(inspect.getsource(matmul_kernel.fn), "python")),
        ("attention forward", "Numba, CPU (lesson 09)", code_lines(inspect.getsource(flash_forward_tile.py_func), "python")),
        ("attention forward", "CUDA C (lesson 09)", code_lines(flash_cuda_source(), "c")),
        ("attention forward", "Triton", code_lines(inspect.getsource(flash_fwd_kernel.fn), "python"))]
for op, how, n_lines in kernels:
    print(f"{op:>18}  {how:<42} {n_lines:>4} lines")

f32 = lambda *s: to_device(np.zeros(s, np.float32))  # noqa: E731
info = compile_for_gpu(flash_fwd_kernel, dict(
    q_ptr=f32(4, 256, 64), k_ptr=f32(4, 256, 64), v_ptr=f32(4, 256, 64), o_ptr=f32(4, 256, 64), lse_ptr=f32(4, 256),
    N_Q=256, N_K=256, stride_qg=256 * 64, stride_qm=64, stride_kg=256 * 64, stride_kn=64, stride_vg=256 * 64,
    stride_vn=64, stride_og=256 * 64, stride_om=64, scale=0.125, CAUSAL=True, HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64),
    arch=80)
columns = {"Triton (float32 in, 64 x 64 blocks)": (info["counts"], info["shared_bytes"])}
try:
    ptx = compile_ptx(flash_cuda_program(64))
    columns["CUDA C (lesson 09)"] = (ptx_counts(ptx), ptx_stats(ptx).shared_bytes)
except NvrtcUnavailable as exc:
    print(f"(lesson 09's CUDA C not compiled: {exc})")
print(f"\nthe attention forward compiled for sm_80, instructions in the PTX:\n{'':>14}" +
      "".join(f"{name:>38}" for name in columns))
for key in ["ld.global", "ld.global.v4", "cp.async", "ld.shared", "ldmatrix", "mma.sync", "bar.sync", "shfl.sync", "ex2"]:
    print(f"{key:>14}" + "".join(f"{c[key]:>38}" for c, _ in columns.values()))
print(f"{'shared KiB':>14}" + "".join(f"{b / 1024:>38.0f}" for _, b in columns.values()))

# %% [markdown]
# What the compiler did that lessons 07-09 did by hand, read from the PTX above and from section 3:
#
# - **Coalescing and vector loads.** A block's offsets are spread over threads so that neighbouring
#   threads load neighbouring elements, 16 bytes each (`ld.global.v4`) where the compiler can prove
#   alignment (sizes and strides divisible by 16, which the JIT detects at launch and specialises on).
# - **Shared memory.** Tiles that several warps read (the K and V blocks, the tiles of A and B) are
#   staged in shared memory, with the barriers that lesson 07 placed by hand; `tl.dot` operands go
#   through `ldmatrix`. The CUDA C flash kernel of lesson 09 has one query row per thread and no
#   tensor cores; the Triton one multiplies tiles with `mma.sync` (and `wgmma` on Hopper).
# - **Pipelining.** Loads inside the loops become `cp.async` copies issued iterations ahead (up to
#   `num_stages - 1`; on Hopper also the bulk copy engine, TMA, where the kernel uses tensor
#   descriptors): the double buffering of lesson 08's `sgemm_dbuf`, with more buffers.
# - **Reductions.** `tl.max` and `tl.sum` over a row become warp shuffles and a round through shared
#   memory.
#
# What the programmer still decides: the block sizes (autotuned), the grid and the order of the
# programs, what is fused, and what is recomputed. And what Triton does not express: per-thread
# control (warp specialisation, a thread-level algorithm such as lesson 07's scan), which is why the
# fastest attention kernels on Hopper (FlashAttention-3) are written in CUDA C++ with CUTLASS.
#
# On a GPU, the speeds side by side: the softmax of section 2 against lesson 08's CUDA C softmax, and
# the attention forward against lesson 09's CUDA C kernel (float32, d = 64, causal), both launched
# through CuPy on the same data.

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
torch = need_torch_cuda()
import cupy as cp

from minitorch.attention import flash_attention_cuda
from minitorch.cupy_kernels import cuda_time_ms
from minitorch.cupy_kernels import softmax as softmax_cuda_c

xt = torch.randn(8192, 8192, device="cuda")
xc = cp.from_dlpack(xt)
assert cp.allclose(softmax_cuda_c(xc), cp.from_dlpack(softmax(xt)), atol=1e-6)
t_c = cuda_time_ms(lambda: softmax_cuda_c(xc))
t_t = triton.testing.do_bench(lambda: softmax(xt))
print(f"{GPU_REASON}, softmax 8192x8192 float32: CUDA C (lesson 08) {t_c:.3f} ms, Triton {t_t:.3f} ms")
qf, kf, vf = (torch.randn(16, 4096, 64, device="cuda") for _ in range(3))
o_c, _ = flash_attention_cuda(*(cp.from_dlpack(t) for t in (qf, kf, vf)), causal=True)
o_t, _ = flash_forward(qf, kf, vf, causal=True, block_m=64, block_n=64)
print(f"max |CUDA C - Triton| = {float(cp.abs(o_c - cp.from_dlpack(o_t)).max()):.1e}")
t_c = cuda_time_ms(lambda: flash_attention_cuda(*(cp.from_dlpack(t) for t in (qf, kf, vf)), causal=True), repeat=5)
t_t = triton.testing.do_bench(lambda: flash_forward(qf, kf, vf, True, 64, 64))
print(f"{GPU_REASON}, attention forward 16 heads x 4096 x 64 float32 causal: CUDA C (lesson 09) {t_c:.2f} ms, "
      f"Triton {t_t:.2f} ms ({t_c / t_t:.1f}x)")

# %% [markdown]
# ## 7. What the interpreter cannot show
#
# The interpreter runs the kernel's Python with NumPy, one program after another, and the course's
# checks watch every access. That grades what a kernel computes and how it touches memory. It cannot
# show:
#
# - **Races.** Programs that run at once on a GPU run in sequence here, so a read-modify-write of a
#   shared element (dQ without atomics) gives the right answer. The checker reports every element
#   that two programs write, or that one writes and another reads, as a race; the GPU run is where
#   it would actually go wrong, sometimes.
# - **Speed.** Nothing here is timed: the interpreter's cost is Python's, per operation on a block,
#   and has nothing to do with a GPU's. Occupancy, bank conflicts, register spills, the L2 and the
#   autotuner's choices only exist on the GPU (the `gpu` cells, `make bench`).
# - **Numerics of the real hardware.** `tl.dot` runs as a float32 NumPy product here; on a GPU,
#   float32 inputs go through TF32 tensor cores by default (`input_precision="ieee"` asks for full
#   float32), and `tl.exp` may be an approximation (`ex2.approx` in the PTX).
# - **What the compiler rejects.** Some code runs in the interpreter, which is Python, and not in
#   the compiler: a call to an ordinary Python function (not `@triton.jit`) inside a kernel, for
#   one. The tests compile each kernel with `compile_for_gpu`, which catches it on any Linux machine.
# - **Limits of a real GPU.** Shared memory per block (the attention forward of section 6 takes
#   80 KiB at 64 x 64 blocks; an A100 allows at most 163 KiB per block, an H100 227 KiB),
#   registers per thread, int32 offsets that overflow past 2^31 elements (the interpreter's own
#   overflow check is switched off here, as on a GPU).
#
# What a GPU run adds (`make gpucheck` on a GPU machine runs this lesson's `gpu` cells and tests): each
# kernel compiled and checked against the interpreter's results, the bandwidth and TFLOP/s printed
# above, and the autotuner's choice.

# %% [markdown]
# ## Sources
#
# - P. Tillet, H. T. Kung, D. Cox, *Triton: an intermediate language and compiler for tiled neural
#   network computations*, MAPL 2019.
# - Triton's tutorials (triton-lang.org): *Fused Softmax*, *Matrix Multiplication* (grouped ordering,
#   autotuning), *Fused Attention* (FlashAttention-2 forward and backward).
# - T. Dao, *FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning*, 2023,
#   https://arxiv.org/abs/2307.08691 (Algorithms 1 and 2); T. Dao et al., *FlashAttention*, NeurIPS 2022.
# - Stanford CS336 (Language Modeling from Scratch), Assignment 2 (systems): FlashAttention-2 in
#   Triton, forward and backward, benchmarked against PyTorch.
# - S. Rush, *Triton-Puzzles* (github.com/srush/Triton-Puzzles): puzzles run under Triton's
#   interpreter on a CPU.
# - M. Milakov, N. Gimelshein, *Online normalizer calculation for softmax*, 2018,
#   https://arxiv.org/abs/1805.02867.
# - J. Shah et al., *FlashAttention-3*, 2024, https://arxiv.org/abs/2407.08608 (Hopper, CUDA C++).

# %%
#| export
#| given
from minitorch.checks import Choice, Int, Optional, Rule, Size, validate_public  # noqa: E402


class _Block(Rule):
    """A block size: a power of two from 1 to 1024 (tl.arange needs one)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        check_int(what, name, value, 1, 1024)
        if value & (value - 1):
            raise ValueError(f"{what}: {name} must be a power of two (tl.arange needs one), got {value}")


class _Model(Rule):
    def __call__(self, what: str, name: str, value: Any) -> None:
        blocks = getattr(value, "blocks", None)
        if not isinstance(blocks, (list, tuple)) or not all(hasattr(b, "attn") for b in blocks):
            raise TypeError(f"{what}: {name} must be lesson 09's GPT (its blocks with .attn), got {value!r:.80}")


_F = ("float32", "float16")
_B = _Block()
_DOT = Int(16, 1024)

validate_public(globals(), {
    "bias_gelu": {"x": _DeviceArray(ndim=2, dtypes=_F), "bias": _DeviceArray(ndim=1, dtypes=_F), "block_m": _B,
                  "block_n": _B},
    "softmax": {"x": _DeviceArray(ndim=2, dtypes=_F)},
    "matmul": {"a": _DeviceArray(ndim=2, dtypes=_F), "b": _DeviceArray(ndim=2, dtypes=_F),
               "bias": Optional(_DeviceArray(ndim=1, dtypes=_F)), "activation": Choice(*MATMUL_ACTIVATIONS),
               "block_m": Optional(_B), "block_n": Optional(_B), "block_k": Optional(_B), "group_m": Size},
    "program_tiles": {"num_pid_m": Size, "num_pid_n": Size, "group_m": Size},
    "panels_per_wave": {"num_pid_m": Size, "num_pid_n": Size, "group_m": Size, "wave": Size},
    "flash_forward": {"q": _DeviceArray(ndim=3, dtypes=_F), "k": _DeviceArray(ndim=3, dtypes=_F),
                      "v": _DeviceArray(ndim=3, dtypes=_F), "block_m": _B, "block_n": _B},
    "flash_backward": {"q": _DeviceArray(ndim=3, dtypes=_F), "k": _DeviceArray(ndim=3, dtypes=_F),
                       "v": _DeviceArray(ndim=3, dtypes=_F), "o": _DeviceArray(ndim=3, dtypes=_F),
                       "lse": _DeviceArray(ndim=2, dtypes="float32"), "do": _DeviceArray(ndim=3, dtypes=_F),
                       "block_m": _B, "block_n": _B},
    "triton_attention": {"block_m": _B, "block_n": _B},
    "use_triton_attention": {"model": _Model(), "block_m": _B, "block_n": _B},
})
