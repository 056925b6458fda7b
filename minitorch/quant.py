# Generated from solutions/10_quantization.py by `make build`. Do not edit.
"""minitorch.quant: number formats by hand, loss scaling, int8/int4 quantization, an int8 GEMM,
a systolic array, quantized Linear layers and the outlier methods (LLM.int8, SmoothQuant, AWQ).
"""
from __future__ import annotations

import copy
import math
import platform
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from minitorch.attention import check_size
from minitorch.autograd import Tensor
from minitorch.checks import check_array, describe
from minitorch.nn import Linear, Module


@dataclass(frozen=True)
class FloatFormat:
    """A binary float format: 1 sign bit, `exp_bits` exponent bits (bias `bias`), `man_bits`
    mantissa bits. ieee=True: the top exponent is infinity (m = 0) or NaN; ieee=False (OCP E4M3):
    no infinity, only the all-ones pattern S.1111.111 is NaN."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    ieee: bool = True

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def uint(self) -> type:
        """The unsigned integer dtype that holds one code."""
        return np.uint8 if self.bits <= 8 else np.uint16

    @property
    def max_code(self) -> int:
        """The code (sign bit clear) of the largest finite value."""
        top = (1 << self.exp_bits) - 1
        return (top << self.man_bits) - 1 if self.ieee else (top << self.man_bits) | ((1 << self.man_bits) - 2)

    @property
    def inf_code(self) -> int | None:
        return ((1 << self.exp_bits) - 1) << self.man_bits if self.ieee else None

    @property
    def nan_code(self) -> int:
        """The canonical (quiet) NaN, sign bit clear."""
        top = ((1 << self.exp_bits) - 1) << self.man_bits
        return top | (1 << (self.man_bits - 1)) if self.ieee else top | ((1 << self.man_bits) - 1)


FORMATS: dict[str, FloatFormat] = {
    "fp16": FloatFormat("fp16", 5, 10, 15),
    "bf16": FloatFormat("bf16", 8, 7, 127),
    "fp8_e4m3": FloatFormat("fp8_e4m3", 4, 3, 7, ieee=False),
    "fp8_e5m2": FloatFormat("fp8_e5m2", 5, 2, 15),
}


def get_format(fmt: str | FloatFormat) -> FloatFormat:
    """FORMATS[fmt] for a name, fmt itself for a FloatFormat; ValueError naming the known ones."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise (ValueError if isinstance(fmt, str) else TypeError)(
            f"get_format: fmt must be a FloatFormat or one of {', '.join(map(repr, FORMATS))}, got {describe(fmt)}")
    return FORMATS[fmt]


def decode_bits(bits: np.ndarray, fmt: str | FloatFormat) -> np.ndarray:
    """The float32 values of `bits`, an integer array of codes of format `fmt` (same shape)."""
    f = get_format(fmt)
    bits = np.asarray(bits)
    if bits.dtype.kind not in "iu":
        raise TypeError(f"decode_bits: codes must be an integer array, got dtype {bits.dtype}")
    b = bits.astype(np.int64)
    if b.size and (b.min() < 0 or b.max() >= 1 << f.bits):
        raise ValueError(f"decode_bits: {f.name} codes lie in [0, {1 << f.bits}), got values from "
                         f"{b.min()} to {b.max()}")
    E, M = f.exp_bits, f.man_bits
    sign = (b >> (E + M)) & 1
    e = (b >> M) & ((1 << E) - 1)
    m = b & ((1 << M) - 1)
    significand = np.where(e > 0, m + (1 << M), m).astype(np.float32)
    exponent = (np.maximum(e, 1) - f.bias - M).astype(np.int32)
    top = e == (1 << E) - 1
    special = top if f.ieee else top & (m == (1 << M) - 1)  # E4M3: only S.1111.111 is special (NaN)
    value = np.ldexp(significand, np.where(special, 0, exponent)).astype(np.float32)
    if f.ieee:
        value = np.where(special, np.where(m == 0, np.float32(np.inf), np.float32(np.nan)), value)
    else:
        value = np.where(special, np.float32(np.nan), value)
    return np.where(sign == 1, -value, value).astype(np.float32)


def encode_bits(x: np.ndarray, fmt: str | FloatFormat, saturate: bool = False) -> np.ndarray:
    """Round float32 `x` (any shape) to format `fmt`, nearest-even; return its codes (fmt's uint dtype).

    Out-of-range values become +-inf (IEEE formats) or NaN (E4M3); with saturate=True, +-max finite."""
    f = get_format(fmt)
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"encode_bits: x must be float32, got dtype {x.dtype}: convert first (x.astype(np.float32)); "
                        "float64 -> float32 -> narrow rounds twice, which can differ from rounding once")
    u = x.view(np.uint32).astype(np.int64)
    E, M = f.exp_bits, f.man_bits
    sign = u >> 31
    exp = (u >> 23) & 0xFF
    man = u & 0x7FFFFF
    is_nan = (exp == 0xFF) & (man != 0)
    is_inf = (exp == 0xFF) & (man == 0)
    sig = np.where(exp > 0, man | (1 << 23), man)
    e = np.maximum(exp, 1) - 127
    shift = np.minimum((23 - M) + np.maximum((1 - f.bias) - e, 0), 30)
    q = sig >> shift
    rem = sig & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    code = ((np.maximum(e + f.bias, 1) - 1) << M) + q
    overflow = (code > f.max_code) | is_inf
    if saturate:
        code = np.where(overflow, f.max_code, code)
    else:
        code = np.where(overflow, f.inf_code if f.ieee else f.nan_code, code)
    code = np.where(is_nan, f.nan_code, code)
    return ((sign << (E + M)) | code).astype(f.uint)


def round_to_format(x: np.ndarray, fmt: str | FloatFormat, saturate: bool = False) -> np.ndarray:
    """`x` rounded to `fmt` and returned as float32: decode_bits(encode_bits(x)). x has any shape and
    any real dtype (float16, float64 and integers are converted to float32 first)."""
    return decode_bits(encode_bits(np.asarray(x, dtype=np.float32), fmt, saturate), fmt)


class DynamicLossScaler:
    """Dynamic loss scaling: multiply the loss by `scale` before backward, then `step()`.

    scale halves (backoff_factor) on any inf/NaN gradient, and that step is skipped; it doubles
    (growth_factor) after `growth_interval` good steps in a row."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if init_scale <= 0 or growth_factor < 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(f"DynamicLossScaler: need init_scale > 0, growth_factor >= 1, 0 < backoff_factor < 1, "
                             f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.good_steps = 0

    def unscale_(self, params: Iterable[Tensor]) -> bool:
        """grad /= scale for every param with a grad; True if any grad holds inf or NaN."""
        found_inf = False
        for p in params:
            if p.grad is None:
                continue
            g = p.grad.data
            g /= g.dtype.type(self.scale)
            found_inf = found_inf or not bool(np.all(np.isfinite(g)))
        return found_inf

    def update(self, found_inf: bool) -> None:
        """Back off on an overflow; grow after growth_interval good steps in a row."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def step(self, optimizer: Any, params: Iterable[Tensor]) -> bool:
        """Unscale, step the optimizer unless a gradient overflowed, update; True if it stepped."""
        found_inf = self.unscale_(params)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf


def cast(x: Tensor, fmt: str | FloatFormat, saturate: bool = False) -> Tensor:
    """x rounded to `fmt` (values stay float32); the backward pass rounds the gradient to `fmt` too."""
    out = x._new(round_to_format(x.data.astype(np.float32, copy=False), fmt, saturate))

    def vjp(g: Any) -> tuple[Any]:
        return (round_to_format(np.asarray(g, dtype=np.float32), fmt, saturate),)

    return x._record(out, (x,), vjp, f"cast_{get_format(fmt).name}")


def mixed_forward(model: Module, x: np.ndarray, fmt: str | None) -> Tensor:
    """Lesson 03's MLP (a Sequential of Linear and activations) run with every operand and result
    rounded to `fmt`; fmt=None runs it in float32. `x` has any real dtype (float16 and float64 are
    converted to float32 first)."""
    h = Tensor(np.asarray(x, dtype=np.float32))
    if fmt is None:
        return model(h)
    h = cast(h, fmt)
    for layer in model.layers:
        if isinstance(layer, Linear):
            h = h @ cast(layer.weight, fmt)
            h = cast(h + cast(layer.bias, fmt), fmt) if layer.bias is not None else cast(h, fmt)
        else:
            h = cast(layer(h), fmt)
    return h


def check_block(shape: tuple[int, ...], block: tuple[int, ...] | None, what: str = "quantize") -> tuple[int, ...]:
    """The block shape with -1 (and None: the whole tensor) resolved; ValueError (naming `what`, the
    block and x's shape) unless block has one size per axis of x, each -1 or >= 1 dividing x's size."""
    shape = tuple(int(n) for n in shape)
    if block is None:
        return shape
    block = tuple(int(b) for b in block)
    if len(block) != len(shape):
        raise ValueError(f"{what}: block {block} has {len(block)} axes but x has {len(shape)} (shape {shape})")
    block = tuple(n if b == -1 else b for b, n in zip(block, shape))
    bad = [i for i, (b, n) in enumerate(zip(block, shape)) if b < 1 or n % b]
    if bad:
        i = bad[0]
        raise ValueError(f"{what}: block {block} does not divide x's shape {shape}: axis {i} has size {shape[i]}, "
                         f"block size {block[i]}" + (" (choose a group size that divides it)" if block[i] > 0 else ""))
    return block


def check_finite_float(what: str, x: Any, name: str = "x") -> np.ndarray:
    """x as a NumPy array; TypeError unless it is floating, ValueError (how many, the first one and
    where) if it holds a NaN or an inf: no scale can represent them."""
    arr = np.asarray(x) if not isinstance(x, (str, bytes)) and x is not None else None
    if arr is None or arr.dtype.kind != "f":
        raise TypeError(f"{what}: {name} must be a float array (float32 or float64), got {describe(x)}")
    x = arr
    bad = ~np.isfinite(x)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise ValueError(f"{what}: {name} holds {int(bad.sum())} NaN or inf value(s), the first {x[i]} at index {i}: "
                         "only finite values can be quantized")
    return x


def check_qparams(what: str, shape: tuple[int, ...], scale: Any, zero_point: Any) -> None:
    """ValueError naming the shapes unless scale and zero_point have one entry per block of a tensor
    of `shape` (as many axes, each dividing the tensor's), and the scales are finite and > 0;
    TypeError unless scale is a real and zero_point an integer array."""
    scale = check_array(what, "scale", scale, dtypes="real")
    zero_point = check_array(what, "zero_point", zero_point, dtypes="int")
    shape = tuple(shape)
    if (scale.shape != zero_point.shape or scale.ndim != len(shape)
            or any(ns < 1 or n % ns for n, ns in zip(shape, scale.shape))):
        raise ValueError(f"{what}: scale {scale.shape} and zero_point {zero_point.shape} must have one entry per "
                         f"block of the tensor's shape {shape} (as many axes, each size dividing the tensor's)")
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        raise ValueError(f"{what}: scales must be finite and > 0, got {scale[bad][:4].tolist()} (at {int(bad.sum())} "
                         "block(s))")


def check_matmul_shapes(what: str, x: np.ndarray, w: np.ndarray) -> None:
    """ValueError naming both shapes unless x (T, K) @ w (K, N) fits."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"{what}: shape mismatch {x.shape} @ {w.shape} (need x (T, K) @ w (K, N), got x of "
                         f"{x.ndim} axes {x.shape} and w of {w.ndim} axes {w.shape})")


def expand_blocks(s: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A per-block array s (one entry per block) repeated to the full `shape` (an axis of one block
    stays of size 1: it broadcasts); ValueError unless s has one axis per entry of shape, each of a
    size that divides shape's."""
    s = np.asarray(s)
    if s.ndim != len(shape) or any(ns < 1 or n % ns for ns, n in zip(s.shape, shape)):
        raise ValueError(f"expand_blocks: s must have one entry per block of shape {tuple(shape)} (as many axes, each "
                         f"size dividing shape's), got s of shape {s.shape}")
    for axis, (ns, n) in enumerate(zip(s.shape, shape)):
        if ns != n and ns != 1:
            s = np.repeat(s, n // ns, axis=axis)
    return s


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """(qmin, qmax) for `bits`-bit signed integers: symmetric (-(2^(b-1)-1), 2^(b-1)-1), else the full range."""
    if not 2 <= bits <= 8:
        raise ValueError(f"qrange: bits must be between 2 and 8, got {bits}")
    qmax = (1 << (bits - 1)) - 1
    return (-qmax if symmetric else -qmax - 1), qmax


@dataclass
class QTensor:
    """A quantized tensor: x ~ scale * (q - zero_point), blockwise.

    q: int8 array, the tensor's shape, values in qrange(bits, symmetric). scale: float32 and
    zero_point: int32, one entry per block (shape = tensor shape / block shape)."""

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    bits: int = 8
    symmetric: bool = True

    def dequantize(self) -> np.ndarray:
        """float32 array of the tensor's shape: scale * (q - zero_point), block by block."""
        check_qparams("QTensor.dequantize", np.shape(self.q), self.scale, self.zero_point)
        s = expand_blocks(self.scale, self.q.shape)
        z = expand_blocks(self.zero_point, self.q.shape)
        return ((self.q.astype(np.int32) - z) * s).astype(np.float32)

    @property
    def block(self) -> tuple[int, ...]:
        return tuple(n // ns for n, ns in zip(self.q.shape, self.scale.shape))

    def nbytes(self) -> int:
        """Bytes to store it: bits per value (packed), float32 scales, and zero points where
        asymmetric (stored as one byte each)."""
        return (self.q.size * self.bits + 7) // 8 + 4 * self.scale.size + (0 if self.symmetric else self.zero_point.size)


def quantize_with(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, bits: int = 8,
                  symmetric: bool = True) -> np.ndarray:
    """int8 q = clip(round(x / scale) + zero_point, qmin, qmax); scale and zero_point per block
    (one entry per block; expand_blocks makes them full size). Values out of range saturate.
    x must be finite and the scales finite and > 0 (checked here: ValueError)."""
    check_finite_float("quantize_with", x)
    check_qparams("quantize_with", np.shape(x), scale, zero_point)
    x = np.asarray(x, dtype=np.float64)
    qmin, qmax = qrange(bits, symmetric)
    s = expand_blocks(np.asarray(scale, dtype=np.float64), x.shape)
    z = expand_blocks(np.asarray(zero_point, dtype=np.int64), x.shape)
    return np.clip(np.round(x / s) + z, qmin, qmax).astype(np.int8)


def quantize(x: np.ndarray, bits: int = 8, symmetric: bool = True, block: tuple[int, ...] | None = None) -> QTensor:
    """Quantize a float array x of any shape blockwise: symmetric absmax or asymmetric with a zero point.

    block: the block shape (None = one block, -1 = the whole axis); each block gets a float32
    scale and an int32 zero point. Returns a QTensor. x must be non-empty and finite (checked here)."""
    x = check_finite_float("quantize", x)
    if x.size == 0:
        raise ValueError(f"quantize: x is empty (shape {x.shape}): there is no range to quantize")
    x = np.asarray(x)
    block = check_block(x.shape, block)
    qmin, qmax = qrange(bits, symmetric)
    grid = tuple(n // b for n, b in zip(x.shape, block))
    split = x.astype(np.float64).reshape(tuple(v for g, b in zip(grid, block) for v in (g, b)))
    axes = tuple(range(1, 2 * x.ndim, 2))
    if symmetric:
        s = np.abs(split).max(axis=axes, initial=0.0) / qmax
        z = np.zeros(grid, np.int32)
    else:
        lo = np.minimum(split.min(axis=axes, initial=np.inf), 0.0)
        hi = np.maximum(split.max(axis=axes, initial=-np.inf), 0.0)
        s = (hi - lo) / (qmax - qmin)
        s_safe = np.where(s > 0, s, 1.0)
        z = np.clip(np.round(qmin - lo / s_safe), qmin, qmax).astype(np.int32)
    s = s.astype(np.float32)
    s = np.where(s > 0, s, np.float32(1)).reshape(grid)
    z = z.reshape(grid)
    return QTensor(quantize_with(x, s, z, bits, symmetric), s, z, bits, symmetric)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack int values in [-8, 7] (any shape, C order) two per byte: element 2i in the low nibble.
    Returns uint8 of length ceil(q.size / 2); an odd count leaves the last high nibble 0."""
    q = np.asarray(q)
    if q.dtype.kind not in "iu":
        raise TypeError(f"pack_int4 expects integers, got dtype {q.dtype}")
    flat = q.reshape(-1).astype(np.int16)
    if flat.size and (flat.min() < -8 or flat.max() > 7):
        raise ValueError(f"pack_int4: values must lie in [-8, 7], got values from {flat.min()} to {flat.max()}")
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int16)])
    nib = (flat & 0xF).astype(np.uint8)
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, shape: tuple[int, ...] | int) -> np.ndarray:
    """The int8 array of `shape` packed by pack_int4 (sign-extended nibbles, low nibble first)."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"unpack_int4 expects uint8 bytes, got dtype {packed.dtype}")
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    n = math.prod(shape)
    if packed.ndim != 1 or (n + 1) // 2 != packed.size:
        raise ValueError(f"unpack_int4: shape {shape} needs {(n + 1) // 2} bytes, got an array of shape {packed.shape}")
    b = packed.view(np.int8)
    low = (b << 4) >> 4
    high = b >> 4
    out = np.empty(2 * packed.size, np.int8)
    out[0::2], out[1::2] = low, high
    return out[:n].reshape(shape)


def check_int8_vectors(x: Any, y: Any) -> None:
    """TypeError unless x and y are 1-D int8 arrays, ValueError unless they have one length. Callable
    from Python and from Numba kernels (where the overload below types it)."""
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != np.int8 or y.dtype != np.int8 or x.ndim != 1 or y.ndim != 1:
        raise TypeError(f"int8_dot: x and y must be 1-D int8 arrays, got {x.dtype} {x.shape} and {y.dtype} {y.shape}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"int8_dot: x and y must have the same length, got {x.shape[0]} and {y.shape[0]}")


@overload(check_int8_vectors)
def _check_int8_vectors_in_numba(x, y):
    if not all(isinstance(a, types.Array) and a.dtype == types.int8 and a.ndim == 1 for a in (x, y)):
        message = f"int8_dot: x and y must be 1-D int8 arrays, got {x} and {y}"  # known when compiling

        def wrong_types(x, y):
            raise TypeError(message)
        return wrong_types

    def lengths(x, y):
        if x.shape[0] != y.shape[0]:
            raise ValueError("int8_dot: x and y must have the same length, got " + str(x.shape[0]) + " and "
                             + str(y.shape[0]))
    return lengths


@njit(cache=False)
def int8_dot(x, y):
    """sum_i int32(x[i]) * int32(y[i]) for 1-D int8 arrays of equal length, as an int32."""
    check_int8_vectors(x, y)  # given: a TypeError/ValueError for other dtypes or lengths
    acc = np.int32(0)
    for i in range(x.shape[0]):
        acc = np.int32(acc + np.int32(x[i]) * np.int32(y[i]))
    return acc


GEMM_ROWS, GEMM_COLS = 16, 64  # rows of A per thread task, rows of B^T kept hot per block
MAX_K_INT32 = 131071  # K * 128 * 128 < 2^31: no int32 overflow for any int8 inputs


@njit(parallel=True, cache=False)
def gemm_int8_kernel(a, bt, c):
    """c[i, j] = int8_dot(a[i], bt[j]): a (M, K), bt (N, K) int8 C-contiguous; c (M, N) int32."""
    m = a.shape[0]
    n = bt.shape[0]
    for ib in prange((m + GEMM_ROWS - 1) // GEMM_ROWS):
        i1 = min(ib * GEMM_ROWS + GEMM_ROWS, m)
        for j0 in range(0, n, GEMM_COLS):
            j1 = min(j0 + GEMM_COLS, n)
            for i in range(ib * GEMM_ROWS, i1):
                ai = a[i]
                for j in range(j0, j1):
                    c[i, j] = int8_dot(ai, bt[j])


def check_int8_operands(a: np.ndarray, b: np.ndarray, what: str = "matmul_int8",
                        names: tuple[str, str] = ("a", "b")) -> tuple[np.ndarray, np.ndarray]:
    """a (M, K), b (K, N) int8 NumPy arrays; TypeError/ValueError naming `what` (the caller), the
    operand (`names`: the caller's parameters), its dtype and shape."""
    for name, v, axes in ((names[0], a, "(M, K)"), (names[1], b, "(K, N)")):
        if not isinstance(v, np.ndarray) or v.dtype != np.int8 or v.ndim != 2:
            bad = TypeError if not isinstance(v, np.ndarray) or v.dtype != np.int8 else ValueError
            raise bad(f"{what}: {name} must be an int8 NumPy array of 2 axes {axes}, got {describe(v)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: shape mismatch: {names[0]} {a.shape} @ {names[1]} {b.shape} (need (M, K) @ (K, N))")
    if a.shape[1] > MAX_K_INT32:
        raise ValueError(f"{what}: K = {a.shape[1]} > {MAX_K_INT32} could overflow the int32 accumulator")
    return a, b


def matmul_int8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32, exact (int32 accumulation, K <= 131071)."""
    a, b = check_int8_operands(a, b)
    c = np.zeros((a.shape[0], b.shape[1]), np.int32)
    if c.size and a.shape[1]:
        a, bt = np.ascontiguousarray(a), np.ascontiguousarray(b.T)
        int8_dot(a[0], bt[0])  # once from Python: an unfinished kernel's error shows here, not as a typing error
        gemm_int8_kernel(a, bt, c)
    return c


def isa() -> str:
    """This machine's instruction set family: 'x86_64', 'aarch64', or platform.machine()."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


INT8_MADD = {
    "x86_64": r"\b(vpmaddwd|vpmaddubsw|vpdpwssds?|vpdpbusds?|vpdpbssds?)\b",
    "aarch64": r"\b(sdot|smlal2?|smull2?|sadalp)\b",
}


def find_int8_madd(asm: str, arch: str | None = None) -> dict[str, int]:
    """{mnemonic: count} of the widening integer multiply-add instructions in `asm`."""
    pattern = re.compile(INT8_MADD.get(arch or isa(), r"$^"))
    found: dict[str, int] = {}
    for line in asm.splitlines():
        m = pattern.search(line)
        if m:
            found[m.group(1)] = found.get(m.group(1), 0) + 1
    return found


from minitorch.cpu_matmul import FALLBACK_CACHES, machine_cache_sizes  # noqa: E402
from minitorch.simd import vdot_u8s8, vmadd_pairs, vstore_add_i32, vzero_i32  # noqa: E402
from minitorch.simd_matmul import (aligned_empty, block_rows, even_block, machine_blocking, machine_shape,  # noqa: E402
                                   macro_kernel)

PAIRS_MR, PAIRS_NR = 6, 16  # the pairs kernel's block of C: 6 rows of one i32x16


def pairs_blocking(l2_bytes: int, mc: int = 48) -> tuple[int, int]:
    """(MC, KC2) of the pairs GEMM: MC rows of A per thread task, and the longest KC2 (pairs of k, a power
    of two, 64..1024) for which the A block and one B panel, (MC + 16) x KC2 words, fill at most half of
    an L2 cache of `l2_bytes`."""
    kc2 = 1024
    while kc2 > 64 and (mc + PAIRS_NR) * kc2 * 4 > l2_bytes // 2:
        kc2 //= 2
    return mc, kc2


PAIRS_MC, PAIRS_KC2 = pairs_blocking(machine_cache_sizes().get("L2", FALLBACK_CACHES["L2"]))


@njit(cache=False, inline="always")
def int8_pairs_kernel(ap, bp, c, co, ldc):
    """c[co + r*ldc + j] += sum over pairs k2 of a[r, 2k2] b[2k2, j] + a[r, 2k2+1] b[2k2+1, j], r < 6, j < 16.

    ap (6 K2,) int32 pair words (ap[6 k2 + r] holds a[r, 2k2], a[r, 2k2+1] as int16); bp (32 K2,) int16
    (bp[32 k2 + 2j + t] = b[2k2 + t, j]); c 1-D int32, the block at co with rows ldc apart.
    """
    if ap.size != 6 * (bp.size // 32):  # ap's scalar reads are not bounds-checked: check the panel once
        raise ValueError("int8_pairs_kernel: ap must hold 6 pair words per 32 int16 of bp")
    c0, c1, c2 = vzero_i32(), vzero_i32(), vzero_i32()
    c3, c4, c5 = vzero_i32(), vzero_i32(), vzero_i32()
    for k2 in range(bp.size // 32):
        o, a = 32 * k2, 6 * k2
        c0 = vmadd_pairs(c0, ap[a], bp, o)
        c1 = vmadd_pairs(c1, ap[a + 1], bp, o)
        c2 = vmadd_pairs(c2, ap[a + 2], bp, o)
        c3 = vmadd_pairs(c3, ap[a + 3], bp, o)
        c4 = vmadd_pairs(c4, ap[a + 4], bp, o)
        c5 = vmadd_pairs(c5, ap[a + 5], bp, o)
    vstore_add_i32(c0, c, co)
    vstore_add_i32(c1, c, co + ldc)
    vstore_add_i32(c2, c, co + 2 * ldc)
    vstore_add_i32(c3, c, co + 3 * ldc)
    vstore_add_i32(c4, c, co + 4 * ldc)
    vstore_add_i32(c5, c, co + 5 * ldc)


@njit(cache=False)
def pack_a_pairs(a, i0, mc, p2, kc2, ap):
    """Rows i0..i0+mc of int8 a (M, K), k-pairs p2..p2+kc2, as 6-row panels of pair words (int32 ap):
    ap[(ir * kc2 + k2) * 6 + r] = a[i, q] & 0xFFFF | a[i, q + 1] << 16, with i = i0 + 6 ir + r and
    q = 2 (p2 + k2); zero past M and past K."""
    m, k = a.shape
    for ir in range((mc + PAIRS_MR - 1) // PAIRS_MR):
        base = ir * kc2 * PAIRS_MR
        for r in range(PAIRS_MR):
            i = i0 + ir * PAIRS_MR + r
            for k2 in range(kc2):
                q = 2 * (p2 + k2)
                lo = np.int32(a[i, q]) if i < m else np.int32(0)
                hi = np.int32(a[i, q + 1]) if i < m and q + 1 < k else np.int32(0)
                ap[base + k2 * PAIRS_MR + r] = (lo & np.int32(0xFFFF)) | (hi << np.int32(16))


@njit(parallel=True, cache=False)
def pack_b_pairs(b, p2, kc2, bp):
    """k-pairs p2..p2+kc2 of int8 b (K, N) as 16-column panels of int16 pairs, on all threads:
    bp[(jp * kc2 + k2) * 32 + 2j + t] = b[2(p2 + k2) + t, 16 jp + j]; zero past K and past N."""
    k, n = b.shape
    for jp in prange((n + PAIRS_NR - 1) // PAIRS_NR):
        base = jp * kc2 * 2 * PAIRS_NR
        for k2 in range(kc2):
            for j in range(PAIRS_NR):
                col = jp * PAIRS_NR + j
                for t in range(2):
                    row = 2 * (p2 + k2) + t
                    bp[base + k2 * 2 * PAIRS_NR + 2 * j + t] = b[row, col] if row < k and col < n else np.int16(0)


@njit(cache=False)
def int8_macro_kernel(ap, bp, cf, i0, mc, kc2, ldc):
    """One thread's work for one A block: every B panel against every 6-row panel of A.

    ap (6 ceil(mc/6) kc2,) int32: pack_a_pairs's panels of rows i0..i0+mc; bp (2 N' kc2,) int16:
    pack_b_pairs's panels; cf: C (M', N') flattened, int32, ldc = N'.
    """
    for jp in range(bp.size // (kc2 * 2 * PAIRS_NR)):
        bo = jp * kc2 * 2 * PAIRS_NR
        for ir in range((mc + PAIRS_MR - 1) // PAIRS_MR):
            ao = ir * kc2 * PAIRS_MR
            int8_pairs_kernel(ap[ao:ao + kc2 * PAIRS_MR], bp[bo:bo + kc2 * 2 * PAIRS_NR], cf,
                              (i0 + ir * PAIRS_MR) * ldc + jp * PAIRS_NR, ldc)


@njit(parallel=True, cache=False)
def gemm_int8_pairs(a, b, c, mc, kc2):
    """c += a @ b in int32. a (M, K), b (K, N) int8, any strides; c (M', N') int32 C-contiguous with
    M' >= 6 ceil(M/6) and N' = 16 ceil(N/16). mc: rows of A per thread task, a positive multiple of 6;
    kc2: pairs of k per block, >= 1."""
    m, k = a.shape
    ldc = c.shape[1]
    if mc <= 0 or mc % PAIRS_MR or kc2 <= 0:
        raise ValueError("gemm_int8_pairs: mc must be a positive multiple of 6 and kc2 positive")
    if b.shape[0] != k or c.shape[0] < -(-m // PAIRS_MR) * PAIRS_MR or ldc != -(-b.shape[1] // PAIRS_NR) * PAIRS_NR:
        raise ValueError("gemm_int8_pairs: need a (M, K), b (K, N), c (M', N') with M' >= 6 ceil(M/6), N' = 16 ceil(N/16)")
    k2 = (k + 1) // 2
    cf = c.reshape(-1)
    bp = aligned_empty(ldc * 2 * min(kc2, k2), np.int16)  # whole cache lines for its vector loads
    for p2 in range(0, k2, kc2):
        kcur = min(kc2, k2 - p2)
        pack_b_pairs(b, p2, kcur, bp[:ldc * 2 * kcur])
        for ic in prange((m + mc - 1) // mc):
            i0 = ic * mc
            mcur = min(mc, m - i0)
            ap = np.empty(((mcur + PAIRS_MR - 1) // PAIRS_MR) * PAIRS_MR * kcur, np.int32)
            pack_a_pairs(a, i0, mcur, p2, kcur, ap)
            int8_macro_kernel(ap, bp[:ldc * 2 * kcur], cf, i0, mcur, kcur, ldc)


def matmul_int8_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32, exact: the explicit-pairs kernel (`vpmaddwd`)
    in lesson 06's packed, blocked loops on all Numba threads. K <= MAX_K_INT32."""
    a, b = check_int8_operands(a, b, "matmul_int8_pairs")
    m, n = a.shape[0], b.shape[1]
    c = np.zeros((-(-m // PAIRS_MR) * PAIRS_MR, -(-n // PAIRS_NR) * PAIRS_NR), np.int32)
    if m and n and a.shape[1]:
        gemm_int8_pairs(a, b, c, PAIRS_MC, PAIRS_KC2)
    return c if c.shape == (m, n) else np.ascontiguousarray(c[:m, :n])


def shift_to_u8(a: np.ndarray) -> np.ndarray:
    """a + 128 as uint8, same shape, for an int8 array `a`: the unsigned operand of vpdpbusd."""
    return a.view(np.uint8) ^ np.uint8(0x80)


def zero_point_correction(b: np.ndarray) -> np.ndarray:
    """128 * sum_k b[k, j] for j < N, an int32 vector (N,), for an int8 matrix b (K, N): what the shift
    adds to each column of the product, (a + 128) @ b - a @ b."""
    return np.int32(128) * b.sum(axis=0, dtype=np.int32)


_VNNI_KERNELS: dict[tuple[int, int], Callable] = {}


def int8_vnni_kernel_source(mr: int, nv: int) -> str:
    """Source of `int8_vnni_kernel_{mr}x{nv}(ap, bp, c, co, ldc)`: lesson 06's outer-product kernel on words
    of four k: c[co + r*ldc + j] += sum over k4 of the 4-byte dot product of A word ap[mr*k4 + r] (uint8) and
    B word bp[16*nv*k4 + j] (int8), with mr * nv i32x16 accumulators."""
    nr = 16 * nv
    lines = [f"def int8_vnni_kernel_{mr}x{nv}(ap, bp, c, co, ldc):"]
    lines += [f"    c{r}_{v} = vzero_i32()" for r in range(mr) for v in range(nv)]
    lines.append(f"    for k4 in range(bp.size // {nr}):")
    for r in range(mr):
        lines.append(f"        a = ap[{mr} * k4 + {r}]")
        lines += [f"        c{r}_{v} = vdot_u8s8(c{r}_{v}, a, bp, {nr} * k4 + {16 * v})" for v in range(nv)]
    lines += [f"    vstore_add_i32(c{r}_{v}, c, co + {r} * ldc + {16 * v})" for r in range(mr) for v in range(nv)]
    return "\n".join(lines) + "\n"


def make_int8_vnni_kernel(mr: int, nv: int) -> Callable:
    """int8_vnni_kernel_source(mr, nv) compiled by Numba (once per shape)."""
    if (mr, nv) not in _VNNI_KERNELS:
        namespace = {"vzero_i32": vzero_i32, "vdot_u8s8": vdot_u8s8, "vstore_add_i32": vstore_add_i32}
        exec(compile(int8_vnni_kernel_source(mr, nv), f"<int8_vnni_kernel_{mr}x{nv}>", "exec"), namespace)
        _VNNI_KERNELS[(mr, nv)] = njit(cache=False, inline="always")(namespace[f"int8_vnni_kernel_{mr}x{nv}"])
    return _VNNI_KERNELS[(mr, nv)]


@njit(cache=False)
def pack_a_words(aw, i0, mc, p4, kc4, ap, mr):
    """Rows i0..i0+mc of aw (M, K4) int32 (A + 128, four uint8 per word), words p4..p4+kc4, as mr-row panels,
    k-major, into ap: ap[(ir * kc4 + k4) * mr + r] = aw[i0 + mr ir + r, p4 + k4]; rows past M are zeros."""
    m = aw.shape[0]
    for ir in range((mc + mr - 1) // mr):
        base = ir * kc4 * mr
        for r in range(mr):
            i = i0 + ir * mr + r
            if i < m:
                row = aw[i, p4:p4 + kc4]
                for k4 in range(kc4):
                    ap[base + k4 * mr + r] = row[k4]
            else:
                for k4 in range(kc4):
                    ap[base + k4 * mr + r] = np.int32(0)


@njit(parallel=True, cache=False)
def pack_b_words(b, p4, kc4, jc, nc, bp, nr):
    """Rows 4 p4 .. 4 (p4 + kc4) and columns jc..jc+nc of int8 b (K, N) as nr-column panels of words of four
    k, on all threads: byte t of bp[(jp * kc4 + k4) * nr + j] is b[4 (p4 + k4) + t, jc + nr jp + j]; zero past
    K and past N."""
    k, n = b.shape
    for jp in prange((nc + nr - 1) // nr):
        base = jp * kc4 * nr
        j0 = jc + jp * nr
        for k4 in range(kc4):
            row0 = 4 * (p4 + k4)
            dst = bp[base + k4 * nr:base + k4 * nr + nr]
            if row0 + 4 <= k and j0 + nr <= n:
                r0, r1, r2, r3 = b[row0, j0:j0 + nr], b[row0 + 1, j0:j0 + nr], b[row0 + 2, j0:j0 + nr], b[row0 + 3, j0:j0 + nr]
                for j in range(nr):
                    dst[j] = ((np.int32(r0[j]) & 0xFF) | ((np.int32(r1[j]) & 0xFF) << 8) |
                              ((np.int32(r2[j]) & 0xFF) << 16) | (np.int32(r3[j]) << 24))
            else:
                for j in range(nr):
                    w = np.int32(0)
                    if j0 + j < n:
                        for t in range(4):
                            if row0 + t < k:
                                w |= (np.int32(b[row0 + t, j0 + j]) & 0xFF) << (8 * t)
                    dst[j] = w


@njit(parallel=True, cache=False)
def gemm_int8_vnni(aw, b, c, kernel, mr, nr, mc, kc4, nc):
    """c += (A + 128) @ b in int32 (modulo 2^32): aw (M, K4) int32 holds A + 128 four uint8 to a word
    (A's K padded to 4 K4), b (K, N) int8 (K <= 4 K4), c (M, N) int32 C-contiguous. kernel: an
    int8_vnni kernel of mr x nr; mc, kc4 (words of k per block) and nc: lesson 06's blocking."""
    m, k4 = aw.shape
    k, n = b.shape
    if mr <= 0 or nr <= 0 or nr % 16 or mc <= 0 or mc % mr or kc4 <= 0 or nc <= 0 or nc % nr:
        raise ValueError("gemm_int8_vnni: need mr >= 1, nr a positive multiple of 16, mc and nc positive multiples "
                         "of mr and nr, and kc4 >= 1")
    if k > 4 * k4 or c.shape[0] != m or c.shape[1] != n:
        raise ValueError("gemm_int8_vnni: need aw (M, K4), b (K, N) with K <= 4 K4, and c (M, N)")
    tasks = (m + mc - 1) // mc
    ap = np.empty((tasks, ((min(mc, m) + mr - 1) // mr) * mr * min(kc4, k4)), np.int32)  # A's words, packed
    bp = aligned_empty(min(nc, (n + nr - 1) // nr * nr) * min(kc4, k4), np.int32)  # whole cache lines
    for p4 in range(0, k4, kc4):  # lesson 06's order: A packed once per KC, every NC block of B served from it
        kcur = min(kc4, k4 - p4)
        for ic in prange(tasks):
            i0 = ic * mc
            mcur = min(mc, m - i0)
            pack_a_words(aw, i0, mcur, p4, kcur, ap[ic, :((mcur + mr - 1) // mr) * mr * kcur], mr)
        for jc in range(0, n, nc):
            ncur = min(nc, n - jc)
            bblock = bp[:(ncur + nr - 1) // nr * nr * kcur]
            pack_b_words(b, p4, kcur, jc, ncur, bblock, nr)
            for ic in prange(tasks):
                i0 = ic * mc
                mcur = min(mc, m - i0)
                macro_kernel(kernel, ap[ic, :((mcur + mr - 1) // mr) * mr * kcur], bblock, c, i0, mcur, jc, ncur,
                             kcur, mr, nr, np.empty(mr * nr, np.int32))


def matmul_int8_vnni(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32, exact (K <= MAX_K_INT32): (a + 128) @ b with VNNI's
    u8 x s8 dot products (vpdpbusd where the CPU has it) in lesson 06's packed, blocked loops on all Numba
    threads, minus the zero-point correction 128 colsum(b)."""
    a, b = check_int8_operands(a, b, "matmul_int8_vnni")
    m, k = a.shape
    n = b.shape[1]
    c = np.empty((m, n), np.int32)
    c[:] = -zero_point_correction(b)[None, :]
    if m and n and k:
        k4 = -(-k // 4)
        au = shift_to_u8(a)
        if k % 4 or not au.flags.c_contiguous:
            padded = np.zeros((m, 4 * k4), np.uint8)  # any value pads A: B's padded rows are zero
            padded[:, :k] = au
            au = padded
        mr, nv = machine_shape()
        nr = 16 * nv
        mc_max, kc4, nc = machine_blocking(mr, nr)
        gemm_int8_vnni(au.view(np.int32), b, c, make_int8_vnni_kernel(mr, nv), mr, nr,
                       block_rows(m, mr, mc_max, numba.get_num_threads()), even_block(k4, kc4), even_block(n, nc, nr))
    return c


def int8_gemm_dp4a_source() -> str:
    """CUDA C source of int8_gemm_dp4a(A4, B4t, C, M, N, K4): C (M, N) int32 = A @ B for int8 A, B
    packed four per int32 word along K (B transposed); 16x16 shared-memory tiles, __dp4a inner loop."""
    return r"""
#define TILE 16
extern "C" __global__ void int8_gemm_dp4a(const int* __restrict__ A4, const int* __restrict__ B4t,
                                          int* __restrict__ C, int M, int N, int K4) {
    __shared__ int As[TILE][TILE + 1];
    __shared__ int Bs[TILE][TILE + 1];
    int tx = threadIdx.x, ty = threadIdx.y;
    int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    int bcol = blockIdx.x * TILE + ty;  // the row of B4t (column of C) this thread loads
    int acc = 0;
    for (int k0 = 0; k0 < K4; k0 += TILE) {
        int k = k0 + tx;
        As[ty][tx] = (row < M && k < K4) ? A4[row * K4 + k] : 0;
        Bs[ty][tx] = (bcol < N && k < K4) ? B4t[bcol * K4 + k] : 0;
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk)
            acc = __dp4a(As[ty][kk], Bs[tx][kk], acc);
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc;
}
"""


def pack_k4(a: np.ndarray, xp: Any = np) -> Any:
    """a (R, K) int8 -> (R, ceil(K/4)) int32: four consecutive k per word (zero-padded), little-endian.
    xp: the array module of a (NumPy, or CuPy for arrays on the GPU)."""
    r, k = a.shape
    k4 = -(-k // 4)
    padded = xp.zeros((r, 4 * k4), dtype=xp.int8)
    padded[:, :k] = a
    return xp.ascontiguousarray(padded).view(xp.int32)


def dp4a_launch(m: int, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) for int8_gemm_dp4a: one 16x16 block per 16x16 tile of C."""
    return (-(-n // 16), -(-m // 16)), (16, 16)


def int8_gemm_dp4a(a: Any, b: Any) -> Any:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32 on the GPU (CuPy arrays) with int8_gemm_dp4a."""
    return _dp4a_gemm(a, b, "int8_gemm_dp4a", int8_gemm_dp4a_source, "int8_gemm_dp4a", dp4a_launch, on_gpu=True)


def int8_gemm_dp4a_emulated(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The same kernel on the CPU emulator (course.cuda_c.emulate); NumPy in and out."""
    return _dp4a_gemm(a, b, "int8_gemm_dp4a_emulated", int8_gemm_dp4a_source, "int8_gemm_dp4a", dp4a_launch,
                      on_gpu=False)


_DP4A_KERNELS: dict[str, Any] = {}  # source -> compiled RawKernel


def _dp4a_gemm(a: Any, b: Any, what: str, source_fn: Callable[[], str], name: str, launch: Callable,
               on_gpu: bool) -> Any:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32 by the packed-operand kernel `name` of source_fn(): A and
    B transposed packed four k per word (pack_k4), launched by launch(M, N) on the GPU (CuPy arrays) or
    on the CPU emulator (NumPy; course.cuda_c.emulate, course machinery)."""
    if on_gpu:
        import cupy as xp

        if a.dtype != xp.int8 or b.dtype != xp.int8 or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"{what}: need int8 (M, K) @ (K, N), got {a.dtype} {a.shape} @ {b.dtype} {b.shape}")
    else:
        xp = np
        a, b = check_int8_operands(a, b, what)
    m, n = a.shape[0], b.shape[1]
    a4, b4t = pack_k4(a, xp), pack_k4(xp.ascontiguousarray(b.T), xp)
    c = xp.zeros((m, n), dtype=xp.int32)
    if m and n:
        args = (a4, b4t, c, np.int32(m), np.int32(n), np.int32(a4.shape[1]))
        source = source_fn()
        if on_gpu:
            if source not in _DP4A_KERNELS:
                _DP4A_KERNELS[source] = xp.RawKernel(source, name, options=("-std=c++17",))
            _DP4A_KERNELS[source](*launch(m, n), args)
        else:
            from course.cuda_c import emulate

            emulate(source, name, *launch(m, n), list(args))
    return c


def int8_gemm_dp4a_regtile_source() -> str:
    """CUDA C source of int8_gemm_dp4a_regtile(A4, B4t, C, M, N, K4): C (M, N) int32 = A @ B for int8 A, B
    packed four per int32 word along K (B transposed); 128x128 tiles of C per block of 256 threads, 8x8
    outputs per thread in registers, __dp4a fed by int4 loads from shared memory."""
    return r"""
#define BM 128
#define BN 128
#define BK4 8      // words of k per step: 32 int8 values
#define NT 256

extern "C" __global__ void __launch_bounds__(NT)
int8_gemm_dp4a_regtile(const int* __restrict__ A4, const int* __restrict__ B4t, int* __restrict__ C,
                       int M, int N, int K4) {
    __shared__ __align__(16) int As[BK4][BM + 4];
    __shared__ __align__(16) int Bs[BK4][BN + 4];
    const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    int acc[8][8];
    #pragma unroll
    for (int i = 0; i < 8; ++i)
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0;

    for (int k0 = 0; k0 < K4; k0 += BK4) {
        #pragma unroll
        for (int l = 0; l < 4; ++l) {             // 1024 words of each tile, 4 per thread
            const int idx = tid + l * NT, r = idx / BK4, kk = idx % BK4, k = k0 + kk;
            As[kk][r] = (row0 + r < M && k < K4) ? A4[(size_t)(row0 + r) * K4 + k] : 0;
            Bs[kk][r] = (col0 + r < N && k < K4) ? B4t[(size_t)(col0 + r) * K4 + k] : 0;
        }
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < BK4; ++kk) {
            const int4 a0 = *reinterpret_cast<const int4*>(&As[kk][4 * ty]);
            const int4 a1 = *reinterpret_cast<const int4*>(&As[kk][64 + 4 * ty]);
            const int4 b0 = *reinterpret_cast<const int4*>(&Bs[kk][4 * tx]);
            const int4 b1 = *reinterpret_cast<const int4*>(&Bs[kk][64 + 4 * tx]);
            const int a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const int b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            #pragma unroll
            for (int i = 0; i < 8; ++i)
                #pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = __dp4a(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = row0 + (i / 4) * 64 + 4 * ty + i % 4;
        if (r >= M) continue;
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int c = col0 + (j / 4) * 64 + 4 * tx + j % 4;
            if (c < N) C[(size_t)r * N + c] = acc[i][j];
        }
    }
}
"""


def dp4a_regtile_launch(m: int, n: int) -> tuple[tuple[int, int], tuple[int]]:
    """(grid, block) for int8_gemm_dp4a_regtile: one block of 256 threads per 128x128 tile of C."""
    return (-(-n // 128), -(-m // 128)), (256,)


def int8_gemm_dp4a_regtile(a: Any, b: Any) -> Any:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32 on the GPU (CuPy arrays) with int8_gemm_dp4a_regtile."""
    return _dp4a_gemm(a, b, "int8_gemm_dp4a_regtile", int8_gemm_dp4a_regtile_source, "int8_gemm_dp4a_regtile",
                      dp4a_regtile_launch, on_gpu=True)


def int8_gemm_dp4a_regtile_emulated(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int8_gemm_dp4a_regtile on the CPU emulator (course.cuda_c.emulate); NumPy in and out."""
    return _dp4a_gemm(a, b, "int8_gemm_dp4a_regtile_emulated", int8_gemm_dp4a_regtile_source,
                      "int8_gemm_dp4a_regtile", dp4a_regtile_launch, on_gpu=False)


def systolic_tile(x: np.ndarray, w: np.ndarray,
                  on_cycle: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    """One weight-stationary tile, cycle by cycle: x (M, R) int8 streams through an R x C array
    holding w (R, C) int8. Returns (y (M, C) int32 = x @ w, done (M, C) int64 cycle at whose end
    Y[m, c] left the array, cycles = M + R + C - 2). on_cycle(t, row, act, psum) sees the PE
    registers after cycle t: row (R, C) the output row each PE worked on (-1 idle), act the
    activation it holds, psum its partial sum."""
    x, w = np.asarray(x), np.asarray(w)
    M, R = x.shape
    if w.shape[0] != R:
        raise ValueError(f"systolic_tile: x has {R} columns but w has {w.shape[0]} rows ({x.shape} @ {w.shape})")
    C = w.shape[1]
    W = w.astype(np.int32)
    act = np.zeros((R, C), np.int32)
    row = np.full((R, C), -1, np.int64)
    psum = np.zeros((R, C), np.int32)
    y = np.zeros((M, C), np.int32)
    done = np.full((M, C), -1, np.int64)
    rs, cs = np.arange(R), np.arange(C)
    cycles = M + R + C - 2
    for t in range(cycles):
        act[:, 1:], row[:, 1:] = act[:, :-1].copy(), row[:, :-1].copy()
        m = t - rs
        fed = (m >= 0) & (m < M)
        act[:, 0] = np.where(fed, x[np.clip(m, 0, M - 1), rs], 0)
        row[:, 0] = np.where(fed, m, -1)
        above = np.vstack([np.zeros((1, C), np.int32), psum[:-1]])
        psum = (above + act * W).astype(np.int32)
        if on_cycle is not None:
            on_cycle(t, row.copy(), act.copy(), psum.copy())
        mb = t - (R - 1) - cs
        out = (mb >= 0) & (mb < M)
        y[mb[out], cs[out]] = psum[R - 1, out]
        done[mb[out], cs[out]] = t
    return y, done, cycles


def systolic_matmul(x: np.ndarray, w: np.ndarray, rows: int = 4, cols: int = 4) -> tuple[np.ndarray, int]:
    """x (M, K) int8 @ w (K, N) int8 on a rows x cols weight-stationary array, tile by tile.
    Returns (y (M, N) int32, cycles = ceil(K/rows) * ceil(N/cols) * (M + rows + cols - 2))."""
    rows, cols = check_size("systolic_matmul", "rows", rows, 1), check_size("systolic_matmul", "cols", cols, 1)
    x, w = check_int8_operands(x, w, "systolic_matmul", ("x", "w"))
    M, K = x.shape
    N = w.shape[1]
    kt, nt = -(-K // rows), -(-N // cols)
    xp = np.zeros((M, kt * rows), np.int8)
    xp[:, :K] = x
    wp = np.zeros((kt * rows, nt * cols), np.int8)
    wp[:K, :N] = w
    y = np.zeros((M, nt * cols), np.int32)
    cycles = 0
    for j in range(nt):
        for i in range(kt):
            ty, _, tc = systolic_tile(xp[:, i * rows:(i + 1) * rows], wp[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols])
            y[:, j * cols:(j + 1) * cols] += ty
            cycles += tc
    return y[:, :N], cycles


MODES = ("w8a8", "w8", "w4")


def group_size_for(k: int, target: int = 128) -> int:
    """The largest group size <= target that divides k (128 for k = 768; 64 for k = 64); k, target >= 1."""
    k, target = check_size("group_size_for", "k", k, 1), check_size("group_size_for", "target", target, 1)
    return max(g for g in range(1, min(k, target) + 1) if k % g == 0)


class QuantLinear(Module):
    """An inference-only, quantized replacement for lesson 03's Linear (weight (in, out)).

    mode: "w8a8" | "w8" | "w4"; granularity: "channel" | "tensor" | "group" (see the table in
    the lesson). gemm(qa int8 (T, K), qb int8 (K, N)) -> int32 and quantize_fn (quantize's
    signature) default to this lesson's matmul_int8 and quantize."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None, mode: str = "w8a8",
                 granularity: str = "channel", group_size: int | None = None,
                 gemm: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                 quantize_fn: Callable[..., QTensor] | None = None):
        weight = np.asarray(weight, dtype=np.float32)
        if weight.ndim != 2:
            raise ValueError(f"QuantLinear: weight must be 2-D (in, out), got shape {weight.shape}")
        if mode not in MODES:
            raise ValueError(f"QuantLinear: mode must be one of {MODES}, got {mode!r}")
        allowed = {"w8a8": ("channel", "tensor"), "w8": ("channel", "group", "tensor"), "w4": ("group", "channel", "tensor")}
        if granularity not in allowed[mode]:
            raise ValueError(f"QuantLinear: mode {mode!r} takes granularity in {allowed[mode]}, got {granularity!r}")
        self.in_features, self.out_features = weight.shape
        self.mode, self.granularity = mode, granularity
        self.gemm, self.quantize_fn = gemm, quantize_fn
        k = self.in_features
        self.group_size = group_size or group_size_for(k)
        block = {"channel": (k, 1), "tensor": (k, self.out_features), "group": (self.group_size, 1)}[granularity]
        bits, symmetric = (4, False) if mode == "w4" else (8, True)
        self.wq = self._quantize(weight, bits=bits, symmetric=symmetric, block=block)
        self.w_colsum = self.wq.q.astype(np.int64).sum(axis=0, keepdims=True)  # (1, out), for the zero point
        self.bias = None if bias is None else np.asarray(bias, dtype=np.float32).copy()
        if self.bias is not None and self.bias.shape != (self.out_features,):
            raise ValueError(f"QuantLinear: bias must have shape ({self.out_features},) for weight {weight.shape}, "
                             f"got {self.bias.shape}")
        self.training = False

    def _quantize(self, x: np.ndarray, **kw: Any) -> QTensor:
        return (self.quantize_fn or quantize)(x, **kw)

    def _matmul_int8(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (self.gemm or matmul_int8)(a, b)

    @classmethod
    def from_linear(cls, linear: Linear, **kw: Any) -> "QuantLinear":
        """The QuantLinear of a lesson-03 Linear (its weight and bias copied and quantized)."""
        bias = None if linear.bias is None else linear.bias.numpy()
        return cls(linear.weight.numpy(), bias, **kw)

    def weight_bytes(self) -> int:
        """Bytes of the stored weight: packed values, scales, zero points (not the bias)."""
        return self.wq.nbytes()

    def __repr__(self) -> str:
        return (f"QuantLinear({self.in_features}, {self.out_features}, mode={self.mode!r}, "
                f"granularity={self.granularity!r}" + (f", group_size={self.group_size}" if self.granularity == "group" else "") + ")")

    def forward(self, x: Tensor | np.ndarray) -> Tensor:
        """x (..., in) -> Tensor (..., out) float32, no gradient. w8a8: quantize x (int8, asymmetric,
        per token for "channel", one scale for "tensor"), int8 GEMM, rescale with the zero-point
        correction, add the bias; w8/w4: x @ dequantized weight + bias."""
        arr = x.numpy() if isinstance(x, Tensor) else np.asarray(x, dtype=np.float32)
        k, n = self.in_features, self.out_features
        if arr.ndim == 0 or arr.shape[-1] != k:
            raise ValueError(f"QuantLinear({k}, {n}) expects input shape (..., {k}), got {tuple(arr.shape)}")
        x2 = arr.reshape(-1, k).astype(np.float32)
        if self.mode == "w8a8":
            block = (1, k) if self.granularity == "channel" else (x2.shape[0], k)
            qx = self._quantize(x2, bits=8, symmetric=False, block=block)
            acc = self._matmul_int8(qx.q, self.wq.q).astype(np.int64)
            corrected = acc - qx.zero_point.astype(np.int64) * self.w_colsum
            y = corrected * (qx.scale.astype(np.float64) * self.wq.scale.astype(np.float64))
        else:
            y = x2 @ self.wq.dequantize()
        if self.bias is not None:
            y = y + self.bias
        return Tensor(np.asarray(y, dtype=np.float32).reshape(arr.shape[:-1] + (n,)))


def replace_linears(model: Module, make: Callable[[str, Linear], Module | None]) -> Module:
    """A deep copy of `model` in which every Linear (found as an attribute or in a list/tuple/dict
    attribute of any submodule) is replaced by make(name, linear), unless that returns None."""
    model = copy.deepcopy(model)

    def visit(module: Module, prefix: str) -> None:
        for attr, value in list(vars(module).items()):
            name = f"{prefix}{attr}"
            if isinstance(value, Linear):
                new = make(name, value)
                if new is not None:
                    setattr(module, attr, new)
            elif isinstance(value, Module):
                visit(value, name + ".")
            elif isinstance(value, (list, tuple)):
                items = list(value)
                for i, v in enumerate(items):
                    if isinstance(v, Linear):
                        new = make(f"{name}.{i}", v)
                        items[i] = v if new is None else new
                    elif isinstance(v, Module):
                        visit(v, f"{name}.{i}.")
                setattr(module, attr, type(value)(items) if isinstance(value, tuple) else items)
            elif isinstance(value, dict):
                for key, v in value.items():
                    if isinstance(v, Linear):
                        new = make(f"{name}.{key}", v)
                        value[key] = v if new is None else new
                    elif isinstance(v, Module):
                        visit(v, f"{name}.{key}.")

    visit(model, "")
    return model


def quantize_model(model: Module, skip: Iterable[str] = (), **kw: Any) -> Module:
    """A copy of `model` with every Linear (except those whose name is in `skip`) replaced by
    QuantLinear.from_linear(linear, **kw)."""
    skip = set(skip)
    return replace_linears(model, lambda name, lin: None if name in skip else QuantLinear.from_linear(lin, **kw))


def w8a8_matmul(x: np.ndarray, w: np.ndarray, gemm: Callable | None = None,
                quantize_fn: Callable[..., QTensor] | None = None) -> np.ndarray:
    """x (T, K) @ w (K, N) as symmetric W8A8: int8 x per token, int8 w per output channel,
    int8 GEMM, rescale. float32 (T, N); K = 0 gives zeros."""
    x, w = np.asarray(x, dtype=np.float32), np.asarray(w, dtype=np.float32)
    check_matmul_shapes("w8a8_matmul", x, w)
    t, k = x.shape
    if k == 0:
        return np.zeros((t, w.shape[1]), np.float32)
    qf, gemm = quantize_fn or quantize, gemm or matmul_int8
    qx = qf(x, bits=8, symmetric=True, block=(1, k))
    qw = qf(w, bits=8, symmetric=True, block=(k, 1))
    acc = gemm(qx.q, qw.q).astype(np.float64)
    return (acc * qx.scale.astype(np.float64) * qw.scale.astype(np.float64)).astype(np.float32)


def llm_int8_matmul(x: np.ndarray, w: np.ndarray, threshold: float = 6.0,
                    int8_matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """LLM.int8 mixed decomposition of x (T, K) @ w (K, N): outlier columns (max |x| >= threshold)
    in float32, the rest through int8_matmul (default w8a8_matmul). Returns (y (T, N) float32,
    the outlier column indices)."""
    x, w = np.asarray(x, dtype=np.float32), np.asarray(w, dtype=np.float32)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"llm_int8_matmul: shape mismatch {x.shape} @ {w.shape} (need (T, K) @ (K, N))")
    int8_matmul = int8_matmul or w8a8_matmul
    outlier = np.abs(x).max(axis=0, initial=0.0) >= threshold
    y = x[:, outlier] @ w[outlier]
    if not outlier.all():
        y = y + int8_matmul(x[:, ~outlier], w[~outlier])
    return y.astype(np.float32), np.flatnonzero(outlier)


def smoothquant_scales(x_absmax: np.ndarray, w: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """SmoothQuant's per-input-channel scales s (K,) float64 for activations with per-channel
    max |x| = x_absmax (K,) and weight w (K, N); 1 where either maximum is 0."""
    xa = np.abs(np.asarray(x_absmax, dtype=np.float64))
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or xa.shape != (w.shape[0],):
        raise ValueError(f"smoothquant_scales: x_absmax shape {xa.shape} does not match weight shape {w.shape} "
                         "(need (K,) and (K, N))")
    wa = np.abs(w).max(axis=1, initial=0.0)
    ok = (xa > 0) & (wa > 0)
    s = np.ones_like(xa)
    s[ok] = xa[ok] ** alpha / wa[ok] ** (1 - alpha)
    return s


def smooth(x: np.ndarray, w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x / s, s[:, None] * w): the same product x @ w, with the difficulty moved from x to w.
    x (T, K), w (K, N), s (K,) finite and > 0."""
    if x.shape[1] != w.shape[0] or s.shape != (w.shape[0],):
        raise ValueError(f"smooth: x (T, K), w (K, N) and s (K,) must agree, got x {x.shape}, w {w.shape}, s {s.shape}")
    if not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(f"smooth: s must be finite and > 0, got {s[~(np.isfinite(s) & (s > 0))][:4].tolist()}")
    return x / s, w * s[:, None]


def quantize_w4_group(w: np.ndarray, group_size: int | None = None) -> np.ndarray:
    """w (K, N) float -> dequantized int4 asymmetric, groups of group_size (default group_size_for(K)) rows."""
    g = group_size or group_size_for(w.shape[0])
    return quantize(np.asarray(w, dtype=np.float32), bits=4, symmetric=False, block=(g, 1)).dequantize()


def awq_search(x: np.ndarray, w: np.ndarray, n_grid: int = 20,
               quantize_w: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[np.ndarray, float, list[float]]:
    """AWQ's per-input-channel scale search on calibration activations x (T, K) for weight w (K, N).
    Returns (s (K,) float64, alpha, [error for each alpha on the grid]). n_grid >= 1. The grid is
    alpha = i / n_grid for i = 0..n_grid-1; exact ties go to the first (smallest) alpha."""
    n_grid = check_size("awq_search", "n_grid", n_grid, 1)
    x64, w64 = np.asarray(x, dtype=np.float64), np.asarray(w, dtype=np.float64)
    if x64.ndim != 2 or w64.ndim != 2 or x64.shape[1] != w64.shape[0]:
        raise ValueError(f"awq_search: shape mismatch {x64.shape} @ {w64.shape} (need (T, K) @ (K, N))")
    quantize_w = quantize_w or quantize_w4_group
    mean_abs = np.abs(x64).mean(axis=0)
    ref = x64 @ w64
    best, errors = None, []
    for i in range(n_grid):
        alpha = i / n_grid
        s = np.maximum(mean_abs, 1e-4) ** alpha
        s = s / np.sqrt(s.max() * s.min())
        cand = np.asarray(quantize_w((w64 * s[:, None]).astype(np.float32)), dtype=np.float64) / s[:, None]
        err = float(np.mean((x64 @ cand - ref) ** 2))
        errors.append(err)
        if best is None or err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2], errors


class RecordingLinear(Module):
    """A Linear that appends every input (flattened to (T, in), float32) to `self.seen`."""

    def __init__(self, linear: Linear):
        self.linear, self.seen = linear, []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(np.asarray(x.numpy() if isinstance(x, Tensor) else x, np.float32).reshape(-1, self.linear.in_features))
        return self.linear(x)


def capture_inputs(model: Module, run: Callable[[Module], Any]) -> dict[str, np.ndarray]:
    """{linear name: its inputs (T, in) float32} while run(recording copy of model) executes."""
    recorders: dict[str, RecordingLinear] = {}

    def make(name: str, lin: Linear) -> RecordingLinear:
        recorders[name] = RecordingLinear(lin)
        return recorders[name]

    run(replace_linears(model, make))
    return {name: np.concatenate(r.seen) for name, r in recorders.items()}


class FormatLinear(Module):
    """Weights and activations rounded to a float format (round_to_format), float32 matmul.
    scaled=True: one scale per tensor maps its absmax to the format's largest value (fp8 practice)."""

    def __init__(self, linear: Linear, fmt: str, scaled: bool = False):
        self.fmt, self.scaled = get_format(fmt), scaled
        top = float(decode_bits(np.array([self.fmt.max_code]), self.fmt)[0])
        self.top = top
        self.weight, self.w_scale = self._round(linear.weight.numpy())
        self.bias = None if linear.bias is None else linear.bias.numpy().copy()
        self.training = False

    def _round(self, a: np.ndarray) -> tuple[np.ndarray, float]:
        s = float(np.abs(a).max()) / self.top if self.scaled and np.abs(a).max() > 0 else 1.0
        return round_to_format((a / s).astype(np.float32), self.fmt, saturate=True), s

    def weight_bytes(self) -> int:
        return self.weight.size * self.fmt.bits // 8 + (4 if self.scaled else 0)

    def forward(self, x: Tensor) -> Tensor:
        a = x.numpy() if isinstance(x, Tensor) else np.asarray(x, np.float32)
        xr, xs = self._round(a)
        y = (xr @ self.weight) * np.float32(xs * self.w_scale)
        return Tensor((y + self.bias if self.bias is not None else y).astype(np.float32))


class InputScaledLinear(Module):
    """y = inner(x / s): a quantized layer built from diag(s) W, fed x / s."""

    def __init__(self, inner: Module, s: np.ndarray):
        self.inner, self.s = inner, np.asarray(s, np.float32)
        self.training = False

    def weight_bytes(self) -> int:
        return self.inner.weight_bytes()

    def forward(self, x: Tensor) -> Tensor:
        a = x.numpy() if isinstance(x, Tensor) else np.asarray(x, np.float32)
        return self.inner(Tensor(a / self.s))


class LLMInt8Linear(Module):
    """A Linear computed with llm_int8_matmul (outlier columns in float32). Weight bytes: int8
    per-channel (scales included); the float rows actually used vary with the input."""

    def __init__(self, linear: Linear, threshold: float = 6.0):
        self.w = linear.weight.numpy().copy()
        self.bias = None if linear.bias is None else linear.bias.numpy().copy()
        self.threshold, self.outlier_counts = threshold, []
        self.training = False

    def weight_bytes(self) -> int:
        return self.w.size + 4 * self.w.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        a = x.numpy() if isinstance(x, Tensor) else np.asarray(x, np.float32)
        y, cols = llm_int8_matmul(a.reshape(-1, self.w.shape[0]), self.w, self.threshold)
        self.outlier_counts.append(len(cols))
        y = y + self.bias if self.bias is not None else y
        return Tensor(y.reshape(a.shape[:-1] + (self.w.shape[1],)).astype(np.float32))


def linear_weight_bytes(model: Module) -> int:
    """Bytes of the Linear-like layers' weights (weight_bytes(), or 4 per float32 element)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Linear):
            total += 4 * m.weight.size
        elif hasattr(m, "weight_bytes") and not isinstance(m, InputScaledLinear):
            total += m.weight_bytes()
    return total


from minitorch.checks import (AnyOf, Array, Attrs, Choice, Count, Fraction, Instance, Int, Number,  # noqa: E402
                              Optional, Rule, Seq, Size, validate_public)
from minitorch.optim import _Params  # noqa: E402


class _Names(Rule):
    """Names of layers: an iterable of str (a list, tuple or set), not one str."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
            return
        raise TypeError(f"{what}: {name} must be a list, tuple or set of layer names (str), got {describe(value)}")


class _Shape(Rule):
    """A shape: a sequence of sizes >= 0, or one size."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        (Seq(Count) if isinstance(value, (list, tuple, np.ndarray)) else Count)(what, name, value)


_FMT = AnyOf(Choice(*FORMATS), Instance(FloatFormat))
_FLOATS = Array(dtypes=("float32", "float64"))
_MATRIX = Array(ndim=2, dtypes=("float32", "float64"))
_INT8_MATRIX = Array(ndim=2, dtypes="int8")
_BITS = Int(2, 8)
_THRESHOLD = Number(0, finite=False)  # inf: no outlier column (the pure int8 path); 0: every column
validate_public(globals(), {
    "get_format": {"fmt": _FMT},
    "decode_bits": {"bits": Array(dtypes="int"), "fmt": _FMT},
    "encode_bits": {"x": Array(dtypes="float32"), "fmt": _FMT},
    "round_to_format": {"x": Array(dtypes="real"), "fmt": _FMT},
    "DynamicLossScaler": {"init_scale": Number(0, lo_open=True), "growth_factor": Number(1),
                          "backoff_factor": Number(0, 1, lo_open=True, hi_open=True), "growth_interval": Size},
    "DynamicLossScaler.unscale_": {"params": _Params()},
    "DynamicLossScaler.step": {"optimizer": Attrs("step"), "params": _Params()},
    "cast": {"x": Instance(Tensor, must="a minitorch Tensor"), "fmt": _FMT},
    "mixed_forward": {"model": Attrs("layers"), "x": Array(dtypes="real"), "fmt": Optional(_FMT)},
    "check_block": {"shape": Seq(Count), "block": Optional(Seq(Int(-1)))},
    "check_qparams": {"shape": Seq(Count)},
    "expand_blocks": {"s": Array(), "shape": Seq(Count)},
    "qrange": {"bits": _BITS},
    "quantize_with": {"x": _FLOATS, "scale": Array(dtypes="real"), "zero_point": Array(dtypes="int"), "bits": _BITS},
    "quantize": {"x": _FLOATS, "bits": _BITS, "block": Optional(Seq(Int(-1)))},
    "pack_int4": {"q": Array(dtypes="int")},
    "unpack_int4": {"packed": Array(ndim=1, dtypes="uint8"), "shape": _Shape()},
    "matmul_int8": {"a": _INT8_MATRIX, "b": _INT8_MATRIX},
    "matmul_int8_pairs": {"a": _INT8_MATRIX, "b": _INT8_MATRIX},
    "pairs_blocking": {"l2_bytes": Size, "mc": Size},
    "shift_to_u8": {"a": Array(dtypes="int8")},
    "zero_point_correction": {"b": _INT8_MATRIX},
    "int8_vnni_kernel_source": {"mr": Size, "nv": Size},
    "make_int8_vnni_kernel": {"mr": Size, "nv": Size},
    "matmul_int8_vnni": {"a": _INT8_MATRIX, "b": _INT8_MATRIX},
    "pack_k4": {"a": _INT8_MATRIX, "xp": Attrs("zeros", "ascontiguousarray", "int8", "int32")},
    "dp4a_launch": {"m": Size, "n": Size},
    "int8_gemm_dp4a": {"a": _INT8_MATRIX, "b": _INT8_MATRIX},
    "int8_gemm_dp4a_emulated": {"a": _INT8_MATRIX, "b": _INT8_MATRIX},
    "dp4a_regtile_launch": {"m": Size, "n": Size},
    "int8_gemm_dp4a_regtile": {"a": _INT8_MATRIX, "b": _INT8_MATRIX},
    "int8_gemm_dp4a_regtile_emulated": {"a": _INT8_MATRIX, "b": _INT8_MATRIX},
    "systolic_tile": {"x": _INT8_MATRIX, "w": _INT8_MATRIX},
    "systolic_matmul": {"x": _INT8_MATRIX, "w": _INT8_MATRIX},
    "QuantLinear": {"weight": _MATRIX, "bias": Optional(Array(ndim=1, dtypes=("float32", "float64"))),
                    "mode": Choice(*MODES), "granularity": Choice("channel", "tensor", "group"),
                    "group_size": Optional(Size)},
    "quantize_model": {"skip": _Names()},
    "w8a8_matmul": {"x": _MATRIX, "w": _MATRIX},
    "llm_int8_matmul": {"x": _MATRIX, "w": _MATRIX, "threshold": _THRESHOLD},
    "smoothquant_scales": {"x_absmax": Array(ndim=1, dtypes=("float32", "float64")), "w": _MATRIX,
                           "alpha": Fraction},
    "smooth": {"x": _MATRIX, "w": _MATRIX, "s": Array(ndim=1, dtypes=("float32", "float64"))},
    "quantize_w4_group": {"w": _MATRIX, "group_size": Optional(Size)},
    "awq_search": {"x": _MATRIX, "w": _MATRIX},
    "FormatLinear": {"fmt": _FMT},
    "InputScaledLinear": {"inner": Attrs("weight_bytes", "__call__"), "s": Array(ndim=1, dtypes="real")},
    "LLMInt8Linear": {"threshold": _THRESHOLD},
})
