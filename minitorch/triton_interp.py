# Generated from solutions/17_triton.py by `make build`. Do not edit.
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
