# Generated from solutions/01_tensors.py by `make build`. Do not edit.
"""minitorch.tensor: storage, strides, broadcasting and the Tensor class."""
from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from minitorch.checks import check_int


def strides_for(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major (C-order) strides, in elements, for `shape`.

    strides_for((2, 3, 4)) == (12, 4, 1); strides_for(()) == ().
    """
    strides = []
    step = 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def index_to_offset(index: Sequence[int], strides: Sequence[int], offset: int = 0) -> int:
    """Storage position of the element at multi-index `index` (non-negative ints).

    Returns offset + sum(index[i] * strides[i]). Raises ValueError if `index` and `strides`
    have different lengths (naming both).
    """
    index, strides = tuple(index), tuple(strides)
    if len(index) != len(strides):
        raise ValueError(f"index {index} has {len(index)} entries but strides {strides} has {len(strides)}")
    position = offset
    for i, s in zip(index, strides):
        position += i * s
    return position


def gather(storage: np.ndarray, shape: Sequence[int], strides: Sequence[int], offset: int = 0) -> np.ndarray:
    """Materialise the strided view (shape, strides, offset) of a 1-D `storage` array.

    Returns a new C-contiguous array of `shape` and storage's dtype with
    out[idx] = storage[offset + sum(idx[i] * strides[i])]. Strides are in elements and may be
    zero or negative. Raises ValueError if shape and strides differ in length or `storage`
    is not 1-D, and IndexError (naming the offending position and the storage size) if the
    layout reaches outside the storage.
    """
    shape, strides = tuple(shape), tuple(strides)
    if storage.ndim != 1:
        raise ValueError(f"storage must be 1-D, got shape {storage.shape}")
    if len(shape) != len(strides):
        raise ValueError(f"shape {shape} and strides {strides} have different lengths")
    out = np.empty(shape, dtype=storage.dtype)
    if out.size == 0:
        return out
    lo = offset + sum(min(0, s * (n - 1)) for n, s in zip(shape, strides))
    hi = offset + sum(max(0, s * (n - 1)) for n, s in zip(shape, strides))
    if lo < 0 or hi >= storage.size:
        bad = lo if lo < 0 else hi
        raise IndexError(f"layout shape={shape} strides={strides} offset={offset} reaches storage "
                         f"position {bad}, outside a storage of {storage.size} elements")
    for idx in itertools.product(*(range(n) for n in shape)):
        position = offset
        for i, s in zip(idx, strides):
            position += i * s
        out[idx] = storage[position]
    return out


def transpose_layout(shape: Sequence[int], strides: Sequence[int],
                     axes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) of the transpose with axis order `axes` (a permutation of range(ndim)).

    Raises ValueError naming `axes` and ndim if `axes` is not such a permutation.
    """
    shape, strides, axes = tuple(shape), tuple(strides), tuple(axes)
    if sorted(axes) != list(range(len(shape))):
        raise ValueError(f"axes {axes} are not a permutation of the {len(shape)} axes of shape {shape}")
    return tuple(shape[a] for a in axes), tuple(strides[a] for a in axes)


def slice_layout(shape: Sequence[int], strides: Sequence[int], offset: int,
                 key: Sequence[int | slice]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(shape, strides, offset) of the view x[key], where x has layout (shape, strides, offset).

    `key` holds one int or slice per leading axis (fewer entries than axes: the rest are
    taken whole). An int selects one position (negative counts from the end) and removes the
    axis; a slice keeps it. Raises IndexError naming the index, axis and size for an int out of
    range, and for more entries than axes.
    """
    shape, strides, key = tuple(shape), tuple(strides), tuple(key)
    if len(key) > len(shape):
        raise IndexError(f"too many indices: {len(key)} for a tensor of shape {shape}")
    new_shape, new_strides = [], []
    for axis, (n, s) in enumerate(zip(shape, strides)):
        k = key[axis] if axis < len(key) else slice(None)
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            length = len(range(start, stop, step))
            if length > 0:
                offset += start * s
            new_shape.append(length)
            new_strides.append(s * step)
        else:
            i = int(k)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of range for axis {axis} of size {n}")
            offset += (i % n) * s
    return tuple(new_shape), tuple(new_strides), offset


def is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True if (shape, strides) is C-contiguous: strides == strides_for(shape) on every axis
    of size > 1. Arrays with a zero-size axis are contiguous."""
    shape, strides = tuple(shape), tuple(strides)
    if 0 in shape:
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if s != expected:
            return False
        expected *= n
    return True


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """The shape that `shapes` broadcast to under NumPy's rule.

    broadcast_shape((8, 1, 6), (7, 1)) == (8, 7, 6); broadcast_shape() == ().
    Raises ValueError naming all the shapes and the first incompatible axis.
    """
    shapes = tuple(tuple(s) for s in shapes)
    ndim = max((len(s) for s in shapes), default=0)
    result = []
    for axis in range(-ndim, 0):
        size = 1
        for s in shapes:
            n = s[axis] if -axis <= len(s) else 1
            if n == 1:
                continue
            if size != 1 and n != size:
                listed = " and ".join(str(s) for s in shapes)
                raise ValueError(f"shapes {listed} cannot be broadcast: axis {axis} has sizes {size} and {n}")
            size = n
        result.append(size)
    return tuple(result)


def broadcast_strides(shape: Sequence[int], strides: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    """Strides (elements) that view an array of (shape, strides) as broadcast to `target`.

    Raises ValueError naming `shape` and `target` if `shape` does not broadcast to `target`
    (broadcasting here is one-way: the result must have exactly the target shape).
    """
    shape, strides, target = tuple(shape), tuple(strides), tuple(target)
    if len(shape) > len(target):
        raise ValueError(f"shape {shape} cannot be broadcast to {target}: it has more axes")
    lead = len(target) - len(shape)
    out = [0] * lead
    for n, s, t in zip(shape, strides, target[lead:]):
        if n == t:
            out.append(s)
        elif n == 1:
            out.append(0)
        else:
            raise ValueError(f"shape {shape} cannot be broadcast to {target}: size {n} vs {t}")
    return tuple(out)


def normalize_axis(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Sorted tuple of non-negative axes for an `axis` argument over `ndim` dimensions.

    None -> all axes (0, ..., ndim-1); an int, or a tuple or list of ints, each in [-ndim, ndim).
    Raises ValueError naming the axis and ndim when out of range, ValueError for a repeated
    axis, TypeError naming the value when `axis` (or an entry) is not an int (1.0, True, "0").
    """
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool):
        axes = (axis,)
    elif isinstance(axis, (tuple, list)):
        axes = tuple(axis)
    else:
        raise TypeError(f"axis must be None, an int or a tuple of ints, got {axis!r} ({type(axis).__name__})")
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"axis must be an int or a tuple of ints, got {a!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a tensor with {ndim} dimensions "
                             f"(valid axes: {-ndim}..{ndim - 1})")
        a = int(a) % ndim
        if a in out:
            raise ValueError(f"axis {a} is repeated in {axis!r}")
        out.append(a)
    return tuple(sorted(out))


class Backend:
    """A device's array implementation: an array module `xp` plus conversions and matmul.

    The default is NumPy. Lesson 06 subclasses it to replace `matmul` with a Numba kernel;
    lesson 08 provides one whose `xp` is CuPy.
    """

    def __init__(self, name: str = "numpy", xp: Any = np):
        self.name = name
        self.xp = xp

    def asarray(self, x: Any, dtype: Any = None) -> Any:
        """`x` as an array of this backend (no copy when it already is one)."""
        return self.xp.asarray(x, dtype=dtype)

    def to_numpy(self, a: Any) -> np.ndarray:
        """A NumPy array with the contents of backend array `a` (host memory)."""
        return np.asarray(a)

    def matmul(self, a: Any, b: Any) -> Any:
        """a @ b with NumPy's matmul semantics (batch dimensions broadcast)."""
        return self.xp.matmul(a, b)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


_BACKENDS: dict[str, Backend] = {"cpu": Backend("numpy", np)}


def register_backend(device: str, backend: Backend) -> None:
    """Make `backend` the implementation of `device` (e.g. "cuda")."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend expects a Backend, got {type(backend).__name__}")
    _BACKENDS[device] = backend


def get_backend(device: str) -> Backend:
    """The backend registered for `device`; a ValueError naming the device and the known ones otherwise
    (a TypeError for a device that is not a str). Checked here rather than by a contract: every op calls it."""
    try:
        return _BACKENDS[device]
    except (KeyError, TypeError):
        if not isinstance(device, str):
            raise TypeError(f"get_backend: device must be a str, got {device!r}") from None
        raise ValueError(f"get_backend: no backend registered for device {device!r}; known devices: "
                         f"{sorted(_BACKENDS)}") from None


@contextlib.contextmanager
def use_backend(device: str, backend: Backend) -> Iterator[Backend]:
    """Temporarily make `backend` the implementation of `device`; restores the previous one."""
    previous = _BACKENDS.get(device)
    register_backend(device, backend)
    try:
        yield backend
    finally:
        if previous is None:
            _BACKENDS.pop(device, None)
        else:
            _BACKENDS[device] = previous


_OK_KINDS = "biuf"  # bool, signed int, unsigned int, float


class Tensor:
    """An n-dimensional array on a device, backed by an array of that device's backend.

    Tensor(data, dtype=None, device="cpu"): `data` is a Tensor, an array, a (nested) list or a
    scalar; no copy is made when it already is a backend array of the right dtype.
    Attributes: .data (backend array), .shape, .dtype, .ndim, .size, .device.
    """

    __array_ufunc__ = None  # NumPy operators defer to ours: np.ones(3) - x is x.__rsub__(...)

    def __init__(self, data: Any, dtype: Any = None, device: str = "cpu"):
        backend = get_backend(device)
        if isinstance(data, Tensor):
            data = data.data if data.device == device else data.backend.to_numpy(data.data)
        arr = backend.asarray(data, dtype=dtype)
        if arr.dtype.kind not in _OK_KINDS:
            raise TypeError(f"Tensor supports bool, integer and floating-point data: data must be one of them, "
                            f"got {data!r:.60} (dtype {arr.dtype})")
        self.data = arr
        self.device = device

    # -- construction hook used by every op (subclasses get their own type back) --
    def _new(self, data: Any) -> Tensor:
        out = type(self).__new__(type(self))
        out.data = self.backend.asarray(data)  # reductions may return a NumPy scalar
        out.device = self.device
        return out

    # -- properties --
    @property
    def backend(self) -> Backend:
        return get_backend(self.device)

    @property
    def xp(self) -> Any:
        return self.backend.xp

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def T(self) -> Tensor:
        return self.transpose()

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", prefix="Tensor(")
        dev = "" if self.device == "cpu" else f", device={self.device!r}"
        return f"Tensor({body}, dtype={self.dtype}{dev})"

    # -- conversion --
    def numpy(self) -> np.ndarray:
        """The contents as a NumPy array (shares memory on the CPU backend)."""
        return self.backend.to_numpy(self.data)

    def item(self) -> float | int | bool:
        """The single element of a size-1 tensor as a Python number."""
        if self.size != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {self.shape}")
        return self.numpy().reshape(()).item()

    def to(self, device: str) -> Tensor:
        """A copy of this tensor on `device` (self when already there)."""
        if device == self.device:
            return self
        target = get_backend(device)
        out = type(self).__new__(type(self))
        out.data = target.asarray(self.backend.to_numpy(self.data))
        out.device = device
        return out

    # -- elementwise binary ops: the exercise --
    def _binary(self, other: Any, name: str, reverse: bool = False) -> Tensor:
        """Elementwise `self <name> other` (or `other <name> self` if reverse) with broadcasting.

        `name` is a ufunc of the backend's array module: "add", "subtract", "multiply",
        "divide", "power". `other` is a Tensor, a Python scalar, a NumPy scalar (used as the
        Python number other.item(), so it does not promote float32) or an array. Raises
        ValueError naming both shapes if they do not broadcast, ValueError naming both devices
        if the tensors live on different devices. Returns a tensor of type(self) on self.device.
        """
        if isinstance(other, Tensor):
            if other.device != self.device:
                raise ValueError(f"{name}: tensors are on different devices: {self.device!r} and {other.device!r}; "
                                 f"move one with .to()")
            b = other.data
        elif isinstance(other, np.generic):
            b = other.item()
        elif isinstance(other, (bool, int, float)):
            b = other
        else:
            b = Tensor(other, device=self.device).data
        a = self.data
        b_shape = tuple(getattr(b, "shape", ()))
        try:
            np.broadcast_shapes(self.shape, b_shape)
        except ValueError:
            first, second = (b_shape, self.shape) if reverse else (self.shape, b_shape)
            raise ValueError(f"{name}: shapes {first} and {second} cannot be broadcast together") from None
        fn = getattr(self.xp, name)
        return self._new(fn(b, a) if reverse else fn(a, b))

    def __add__(self, other: Any) -> Tensor:
        return self._binary(other, "add")

    def __radd__(self, other: Any) -> Tensor:
        return self._binary(other, "add", reverse=True)

    def __sub__(self, other: Any) -> Tensor:
        return self._binary(other, "subtract")

    def __rsub__(self, other: Any) -> Tensor:
        return self._binary(other, "subtract", reverse=True)

    def __mul__(self, other: Any) -> Tensor:
        return self._binary(other, "multiply")

    def __rmul__(self, other: Any) -> Tensor:
        return self._binary(other, "multiply", reverse=True)

    def __truediv__(self, other: Any) -> Tensor:
        return self._binary(other, "divide")

    def __rtruediv__(self, other: Any) -> Tensor:
        return self._binary(other, "divide", reverse=True)

    def __pow__(self, other: Any) -> Tensor:
        return self._binary(other, "power")

    def __rpow__(self, other: Any) -> Tensor:
        return self._binary(other, "power", reverse=True)

    def __neg__(self) -> Tensor:
        return self._new(self.xp.negative(self.data))

    # -- elementwise unary ops --
    def exp(self) -> Tensor:
        return self._new(self.xp.exp(self.data))

    def log(self) -> Tensor:
        return self._new(self.xp.log(self.data))

    def tanh(self) -> Tensor:
        return self._new(self.xp.tanh(self.data))

    def relu(self) -> Tensor:
        return self._new(self.xp.maximum(self.data, 0))

    def sigmoid(self) -> Tensor:
        """1 / (1 + exp(-x)), stable for any x: with e = exp(-|x|) in (0, 1], it is 1 / (1 + e)
        for x >= 0 and e / (1 + e) for x < 0, so no exp overflows and tiny values keep their
        relative precision."""
        xp = self.xp
        e = xp.exp(-xp.abs(self.data))
        return self._new(xp.where(self.data >= 0, 1, e) / (1 + e))

    # -- reductions (axis handling: normalize_axis) --
    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = normalize_axis(axis, self.ndim)
        return self._new(self.xp.sum(self.data, axis=axes, keepdims=keepdims))

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = normalize_axis(axis, self.ndim)
        if any(self.shape[a] == 0 for a in axes):
            raise ValueError(f"mean over an empty axis: shape {self.shape}, axis {axis}")
        return self._new(self.xp.mean(self.data, axis=axes, keepdims=keepdims))

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = normalize_axis(axis, self.ndim)
        if any(self.shape[a] == 0 for a in axes):
            raise ValueError(f"max over an empty axis: shape {self.shape}, axis {axis}")
        return self._new(self.xp.max(self.data, axis=axes, keepdims=keepdims))

    # -- matmul --
    def matmul(self, other: Tensor) -> Tensor:
        """Matrix product with NumPy semantics: (..., m, k) @ (..., k, n) -> (..., m, n);
        batch dimensions broadcast; a 1-D operand is a vector. Uses backend.matmul."""
        if not isinstance(other, Tensor):
            other = Tensor(other, device=self.device)
        if other.device != self.device:
            raise ValueError(f"matmul: tensors are on different devices: {self.device!r} and {other.device!r}")
        sa, sb = self.shape, other.shape
        if len(sa) == 0 or len(sb) == 0:
            raise ValueError(f"matmul: operands must have at least 1 dimension, got shapes {sa} and {sb}")
        k_a = sa[-1]
        k_b = sb[-2] if len(sb) >= 2 else sb[0]
        if k_a != k_b:
            raise ValueError(f"matmul: shapes {sa} and {sb} are not aligned: {k_a} (last axis of the first) "
                             f"!= {k_b} ({'second-to-last' if len(sb) >= 2 else 'only'} axis of the second)")
        try:
            np.broadcast_shapes(sa[:-2], sb[:-2])
        except ValueError:
            raise ValueError(f"matmul: batch dimensions of shapes {sa} and {sb} cannot be broadcast") from None
        return self._new(self.backend.matmul(self.data, other.data))

    def __matmul__(self, other: Tensor) -> Tensor:
        return self.matmul(other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return self._new(Tensor(other, device=self.device).data).matmul(self)

    # -- views --
    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        """View (or, for non-contiguous data, copy) with a new shape; one entry may be -1."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        shape = tuple(check_int("reshape", f"shape[{i}]", n) for i, n in enumerate(shape))
        known = math.prod(n for n in shape if n != -1)
        if shape.count(-1) > 1 or any(n < -1 for n in shape):
            raise ValueError(f"reshape: invalid shape {shape}")
        if shape.count(-1) == 1:
            if known == 0 or self.size % known:
                raise ValueError(f"reshape: cannot reshape {self.shape} ({self.size} elements) into {shape}")
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"reshape: cannot reshape {self.shape} ({self.size} elements) into {shape}")
        return self._new(self.data.reshape(shape))

    def transpose(self, *axes: int | Sequence[int]) -> Tensor:
        """Permute axes (default: reverse them). A view: no data moves."""
        if len(axes) == 1 and not isinstance(axes[0], (int, np.integer)):
            axes = tuple(axes[0])
        if not axes:
            axes = tuple(reversed(range(self.ndim)))
        axes = tuple(check_int("transpose", f"axes[{i}]", a) for i, a in enumerate(axes))
        if sorted(int(a) % max(self.ndim, 1) for a in axes) != list(range(self.ndim)) or \
                any(not -self.ndim <= a < self.ndim for a in axes):
            raise ValueError(f"transpose: axes {tuple(axes)} are not a permutation of the {self.ndim} axes "
                             f"of shape {self.shape}")
        return self._new(self.xp.transpose(self.data, tuple(int(a) for a in axes)))

    def __getitem__(self, key: Any) -> Tensor:
        """NumPy indexing: ints and slices give views, integer/bool arrays (or Tensors) copy."""
        return self._new(self.data[_backend_key(key)])


def _backend_key(key: Any) -> Any:
    """An indexing key with Tensors replaced by their arrays."""
    if isinstance(key, tuple):
        return tuple(_backend_key(k) for k in key)
    return key.data if isinstance(key, Tensor) else key


from minitorch.checks import Array, Count, Unchecked, validate_public  # noqa: E402

validate_public(globals(), {
    "gather": {"storage": Array(ndim=1, dtypes="any")},
    "normalize_axis": {"ndim": Count},
    "get_backend": {"device": Unchecked()},
})
