# %% [markdown]
# # Lesson 10: quantization
#
# A float32 weight costs 4 bytes, and at batch size 1 a language model reads every weight once
# per generated token: decoding is bound by memory bandwidth, not arithmetic
# ([memory](../hardware_notes/memory.md#why-decode-and-attention-are-memory-bound)). Fewer
# bits per weight means fewer bytes per token, and narrow integer or float arithmetic runs
# several times faster per instruction. This lesson builds the pieces, bit by bit:
#
# 1. **Number formats by hand.** fp16, bf16 and the two OCP fp8 formats (E4M3, E5M2): decode
#    and encode with integer operations on the float32 bits, round-to-nearest-even,
#    subnormals, overflow; bit-exact against NumPy and `ml_dtypes`.
# 2. **Mixed precision.** Why fp16 training needs loss scaling and bf16 does not: lesson 03's
#    MLP trained with fp16-emulated activations and gradients, with and without a dynamic
#    loss scaler (Micikevicius et al. 2018).
# 3. **Integer quantization.** Symmetric (absmax) and asymmetric (zero-point) int8, per
#    tensor, per channel and per group; int4 packed two per byte.
# 4. **An int8 GEMM** in Numba with int32 accumulation, read in the machine code, then with
#    explicit int16 pairs (`vpmaddwd`) and VNNI's u8 x s8 dot products (`vpdpbusd`) in lesson
#    06's packed loops, timed against float32 and NumPy's BLAS; a cycle-by-cycle systolic
#    array doing the same product the way a TPU does.
# 5. **A quantized Linear** (W8A8 and weight-only W4/W8) and the outlier fixes: LLM.int8
#    (Dettmers et al. 2022), SmoothQuant (Xiao et al. 2023), AWQ (Lin et al. 2024).
# 6. **The result on lesson 09's tiny GPT**: bytes of weights against validation loss.
#
# The course's reference version of this lesson is `minitorch/quant.py`. Background:
# [number formats](../hardware_notes/number_formats.md) (fp8, MX formats, int4, which
# hardware runs what),
# [systolic arrays](../hardware_notes/accelerators.md#weight-stationary-precisely) and
# [memory](../hardware_notes/memory.md). A good overview of the whole field is Nagel et al.,
# "A White Paper on Neural Network Quantization" (2021); Gholami et al., "A Survey of
# Quantization Methods for Efficient Neural Network Inference" (2021).

# %%
#| default_exp quant
#| export
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

# %%
import os
import time

from course.check import check
from course.gpu import require_gpu

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Number formats by hand
#
# A binary floating-point format with E exponent bits and M mantissa bits stores a sign s, a
# biased exponent e and a mantissa field m. With bias B:
#
# | exponent field e | value |
# |---|---|
# | 1 .. 2^E - 2 (normal) | (-1)^s x (1 + m / 2^M) x 2^(e - B) |
# | 0 (subnormal, or zero) | (-1)^s x (m / 2^M) x 2^(1 - B) |
# | 2^E - 1 (IEEE formats) | infinity if m = 0, NaN otherwise |
#
# The formats of this lesson (IEEE 754-2019; the OCP 8-bit floating point specification, OFP8
# rev. 1.0, 2023, from Micikevicius et al., "FP8 Formats for Deep Learning", 2022):
#
# | name | E | M | bias | special values | largest finite |
# |---|---|---|---|---|---|
# | fp16 (IEEE binary16) | 5 | 10 | 15 | IEEE inf and NaN | 65504 |
# | bf16 (bfloat16) | 8 | 7 | 127 | IEEE inf and NaN | 3.39e38 |
# | fp8 E4M3 (`float8_e4m3fn`) | 4 | 3 | 7 | **no infinity**; NaN only S.1111.111 | 448 |
# | fp8 E5M2 | 5 | 2 | 15 | IEEE inf and NaN | 57344 |
#
# E4M3 gives up infinity to gain range: in an IEEE-style layout the top exponent would be
# reserved and the largest value would be 240; OCP keeps the top exponent for numbers and uses
# only the all-ones mantissa there for NaN, so 1.110b x 2^8 = 448 is finite (`fn` in the
# `ml_dtypes` name: finite, NaN-only). E5M2 is a truncated fp16: same exponent, 2 mantissa bits.
# Micikevicius et al. (2022) recommend E4M3 for weights and activations (precision) and E5M2
# for gradients (range).
#
# The `FloatFormat` below holds a format's shape; `FORMATS` names the four.

# %%
#| export
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

# %% [markdown]
# **Exercise 10.1.** Write `decode_bits(bits, fmt)`: the float32 value of each code. `bits` is
# an integer array (any shape) of codes in `[0, 2^bits)`; anything else (a float array, a
# negative code, a code too wide for the format) raises a ValueError or TypeError that names
# the problem. Extract the three fields with shifts and masks, then build the value from the
# table above. Every value of these formats is exactly representable in float32, so
# `np.ldexp(significand, exponent)` on float32 is exact; the subnormals of bf16 are float32
# subnormals. Return float32 NaN for NaN codes and +-inf for infinity codes.
#
# The test decodes every code of every format (2^16 + 2^16 + 2^8 + 2^8) and compares with
# `np.float16` and `ml_dtypes`: bit for bit, including -0.

# %%
#| export
#| exercise 10.1
def decode_bits(bits: np.ndarray, fmt: str | FloatFormat) -> np.ndarray:
    """The float32 values of `bits`, an integer array of codes of format `fmt` (same shape)."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("10.1")

# %% [markdown]
# ### Encoding: rounding by hand
#
# Going the other way rounds. A float32 is s | 8-bit exponent | 23-bit mantissa. Write the
# float32 significand as an integer `sig` (the 23 mantissa bits, plus the hidden 1 at bit 23
# for a normal number) and its unbiased exponent `e`. The target keeps M mantissa bits, so for
# a value that is normal in the target, `shift = 23 - M` low bits of `sig` must go; where the
# value falls below the target's smallest normal exponent `1 - B`, it becomes a subnormal and
# `1 - B - e` more bits go. Then:
#
# - `q = sig >> shift` is the truncated significand, `rem = sig & (2^shift - 1)` what was cut,
#   `half = 2^(shift - 1)`. **Round to nearest, ties to even**: add 1 to q if `rem > half`,
#   or if `rem == half` and q is odd (IEEE 754's default rounding; it has no bias on average,
#   unlike rounding ties away from zero).
# - The code is `((max(e + B, 1) - 1) << M) + q`. For a normal result q carries the hidden
#   bit at position M, which adds the 1 back to the exponent field; if rounding carried q up
#   to 2^(M+1), the addition moves to the next binade by itself, and a subnormal that rounds
#   up to 2^M becomes the smallest normal the same way. No special case for either.
# - **Overflow**: a code above `max_code` is out of range: infinity for the IEEE formats, NaN
#   for E4M3 (it has no infinity: what `ml_dtypes` and PyTorch do), or, with `saturate=True`,
#   the largest finite value. OCP lets an implementation choose; saturation is common for
#   fp8 casts in training libraries because a NaN would poison the whole tensor.
# - Infinity becomes infinity (E4M3: NaN; saturating: the largest finite), NaN a NaN.
#
# The sign bit is copied, so -1e-30 rounds to -0, as in NumPy.

# %% [markdown]
# **Exercise 10.2.** Write `encode_bits(x, fmt, saturate=False)`: float32 array (any shape) ->
# codes of format `fmt` in its unsigned dtype (`FloatFormat.uint`), computed with integer
# operations on `x.view(np.uint32)` as above: no `astype(np.float16)`, no float arithmetic.
# A float64 input raises a TypeError: rounding float64 to fp16 through float32 rounds twice,
# which can differ from rounding once, so the caller must decide. NaN inputs give a NaN code
# (any; `nan_code` is the canonical one), with the sign bit copied.
#
# The test compares with `np.float16` and `ml_dtypes` on 2^21 random float32 bit patterns per
# format, plus every midpoint between neighbouring codes (the ties), the float32 neighbours
# of every code and midpoint, the overflow thresholds, infinities, NaNs, zeros and float32
# subnormals.

# %%
#| export
#| exercise 10.2
def encode_bits(x: np.ndarray, fmt: str | FloatFormat, saturate: bool = False) -> np.ndarray:
    """Round float32 `x` (any shape) to format `fmt`, nearest-even; return its codes (fmt's uint dtype).

    Out-of-range values become +-inf (IEEE formats) or NaN (E4M3); with saturate=True, +-max finite."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def round_to_format(x: np.ndarray, fmt: str | FloatFormat, saturate: bool = False) -> np.ndarray:
    """`x` rounded to `fmt` and returned as float32: decode_bits(encode_bits(x)). x has any shape and
    any real dtype (float16, float64 and integers are converted to float32 first)."""
    return decode_bits(encode_bits(np.asarray(x, dtype=np.float32), fmt, saturate), fmt)

# %% tags=["check"]
check("10.2")

# %% [markdown]
# ### Range and spacing
#
# Decoding every positive finite code gives each format's whole number line: the largest
# value, the smallest normal and subnormal, and the gap between neighbours (the *spacing*, or
# ulp). Within a binade the spacing is constant; it doubles at each power of two, so the
# *relative* spacing is about 2^-M everywhere in the normal range: that is precision. The
# exponent bits set how many binades there are: that is range.

# %% tags=["demo"]
def format_table(fmt: str) -> dict[str, float]:
    f = get_format(fmt)
    codes = np.arange(f.max_code + 1)
    v = decode_bits(codes, f).astype(np.float64)
    one = int(np.searchsorted(v, 1.0))
    return {"max": v[-1], "min normal": v[1 << f.man_bits], "min subnormal": v[1],
            "eps (1 to next)": v[one + 1] - v[one], "binades": math.floor(math.log2(v[-1] / v[1 << f.man_bits])) + 1}


print(f"{'format':<10}{'max':>12}{'min normal':>13}{'min subnormal':>15}{'eps':>11}{'normal binades':>16}")
for name in FORMATS:
    t = format_table(name)
    print(f"{name:<10}{t['max']:>12.6g}{t['min normal']:>13.4g}{t['min subnormal']:>15.4g}"
          f"{t['eps (1 to next)']:>11.4g}{t['binades']:>16d}")

import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 4))
for name in FORMATS:
    f = get_format(name)
    v = decode_bits(np.arange(1, f.max_code + 1), f).astype(np.float64)
    ax.loglog(v[:-1], np.diff(v) / v[:-1], label=name, lw=1)
ax.set(xlabel="value", ylabel="relative spacing (gap to next / value)",
       title="Relative spacing of each format: flat = normal range, rising = subnormals")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# The table above (computed by your `decode_bits`) says it all: bf16 has float32's range (254
# binades of normals, max 3.4e38) with 3 significant digits; fp16 has 30 binades, max 65504,
# and subnormals down to 6e-8; fp8 E4M3 spans 448 down to 2^-9 with a relative spacing of
# 1/8; E5M2 trades one more mantissa bit for fp16's exponent range. The plot's flat parts are
# the normal ranges (spacing 2^-M relative), the rising left ends are the subnormals, where
# precision drains away one bit per binade.

# %% [markdown]
# ## 2. Mixed precision and loss scaling
#
# Mixed-precision training (Micikevicius et al., "Mixed Precision Training", ICLR 2018) keeps
# a float32 *master* copy of the weights, runs the forward and backward passes in fp16
# (tensor cores, half the bytes), accumulates matmuls in float32, and applies the update in
# float32. The danger is the backward pass: gradients are often tiny, and fp16 rounds
# anything below half its smallest subnormal, 2^-25 = 3e-8, to zero (values between 2^-25 and
# 2^-24 = 6e-8 round up to 2^-24; 2^-25 itself ties to even, 0), and keeps fewer digits below
# 2^-14 = 6.1e-5. The fix:
# multiply the loss by a scale S before backward (every gradient is then S times larger, by
# the chain rule, and shifted into fp16's range), divide the float32 gradients by S before the
# update. If some gradient overflowed to inf or NaN, skip that step and lower S; after a run
# of good steps raise S again. That is *dynamic* loss scaling. bf16 has float32's exponent
# range, so its gradients do not underflow and it trains without a scaler (Kalamkar et al.
# 2019); it pays with 3 fewer mantissa bits than fp16.
#
# **Exercise 10.3.** Write `DynamicLossScaler` (the rule of PyTorch's `GradScaler`):
#
# - `unscale_(params)`: divide every parameter's `.grad` (skip those with `grad is None`) by
#   `scale`, in place; return True if any gradient holds an inf or a NaN (`found_inf`).
# - `update(found_inf)`: on an overflow multiply `scale` by `backoff_factor` and reset the
#   count of good steps; otherwise count the step, and after `growth_interval` good steps in
#   a row multiply `scale` by `growth_factor` and reset the count.
# - `step(optimizer, params)`: unscale, call `optimizer.step()` only if no gradient overflowed,
#   update; return whether the optimizer stepped.

# %%
#| export
#| exercise 10.3
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
        ### BEGIN SOLUTION
        found_inf = False
        for p in params:
            if p.grad is None:
                continue
            g = p.grad.data
            g /= g.dtype.type(self.scale)
            found_inf = found_inf or not bool(np.all(np.isfinite(g)))
        return found_inf
        ### END SOLUTION

    def update(self, found_inf: bool) -> None:
        """Back off on an overflow; grow after growth_interval good steps in a row."""
        ### BEGIN SOLUTION
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        ### END SOLUTION

    def step(self, optimizer: Any, params: Iterable[Tensor]) -> bool:
        """Unscale, step the optimizer unless a gradient overflowed, update; True if it stepped."""
        ### BEGIN SOLUTION
        found_inf = self.unscale_(params)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf
        ### END SOLUTION

# %% tags=["check"]
check("10.3")

# %% [markdown]
# To train in an emulated format we need one more autograd op: `cast(x, fmt)` rounds the
# values to `fmt` in the forward pass, and rounds the incoming gradient to `fmt` in the
# backward pass, which is what happens when the backward pass runs in that format. It uses
# your `round_to_format`. A Linear layer in mixed precision is then
# `cast(cast(x) @ cast(W) + cast(b))`: fp16 operands, a float32-accumulated product (as on a
# tensor core), an fp16 result; the master `W` stays float32.

# %%
#| export
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

# %% [markdown]
# The experiment: lesson 03's MLP on `make_digits`, trained with Adam. To get the gradient
# magnitudes of a large batch, the loss is divided by 2^16, what gradient accumulation over
# 2^16 micro-batches would do, or a mean over ~10^5 tokens per micro-batch entry. Adam
# divides each gradient by its own running RMS, so this changes nothing in float32 (we set its
# `eps` to 1e-12 so that it stays negligible): any difference between the runs below comes
# from the number format alone.

# %% tags=["demo"]
from minitorch.data import make_digits
from minitorch.nn import MLP, cross_entropy, evaluate
from minitorch.optim import Adam

LOSS_DIVISOR = 2.0 ** 16
Xd, yd = make_digits(1536, rng=np.random.default_rng(0))
Xd_tr, yd_tr, Xd_val, yd_val = Xd[:1024], yd[:1024], Xd[1024:], yd[1024:]


def train_mixed(fmt: str | None, scaler: DynamicLossScaler | None, steps: int, seed: int = 1) -> dict:
    model = MLP([64, 64, 64, 10], activation="tanh", rng=np.random.default_rng(seed))
    opt = Adam(model.parameters(), lr=2e-3, eps=1e-12)
    order = np.random.default_rng(seed + 1)
    hist = {"loss": [], "zero_grad": [], "scale": [], "skipped": 0}
    for _ in range(steps):
        idx = order.integers(0, len(Xd_tr), 64)
        loss = cross_entropy(mixed_forward(model, Xd_tr[idx], fmt), yd_tr[idx]) * (1 / LOSS_DIVISOR)
        opt.zero_grad()
        (loss * scaler.scale if scaler else loss).backward()
        w_first = model.layers[0].weight
        if scaler:
            hist["skipped"] += not scaler.step(opt, model.parameters())
            hist["scale"].append(scaler.scale)
        else:
            opt.step()
        hist["zero_grad"].append(float(np.mean(w_first.grad.data == 0)))
        hist["loss"].append(loss.item() * LOSS_DIVISOR)
    hist["val_loss"] = evaluate(model, Xd_val, yd_val)[0]
    return hist


steps = 150 if SMALL else 600
runs = {
    "float32": train_mixed(None, None, steps),
    "fp16, no scaling": train_mixed("fp16", None, steps),
    "fp16, dynamic scaling": train_mixed("fp16", DynamicLossScaler(2.0 ** 24, growth_interval=50), steps),
    "bf16, no scaling": train_mixed("bf16", None, steps),
}
for name, h in runs.items():
    extra = f", final scale 2^{math.log2(h['scale'][-1]):.0f}, {h['skipped']} steps skipped" if h["scale"] else ""
    print(f"{name:<24} train loss {np.mean(h['loss'][-20:]):.3f}  val loss {h['val_loss']:.3f}  "
          f"first-layer weight grads exactly 0: {np.mean(h['zero_grad']):6.1%}{extra}")
fig, ax = plt.subplots(figsize=(7, 3.5))
for name, h in runs.items():
    ax.plot(np.convolve(h["loss"], np.ones(10) / 10, mode="valid"), label=name)
ax.set(xlabel="step", ylabel="training loss (x 2^16)", title="Emulated mixed precision on lesson 03's MLP")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# Measured at full size (600 steps, 6 s on the course's 2-core machine, 2 BLAS threads; the
# runs are seeded): float32 reaches a validation loss of 0.296; fp16 without scaling stalls at
# 0.685, with 46 % of the first layer's weight gradients exactly zero, because the gradients of
# the logits, (softmax - onehot) / 64 / 2^16, are at most 2^-22, and those below 2^-25, half
# fp16's smallest subnormal, round to zero (all of them where |softmax - onehot| < 1/8) before
# they reach any weight. With the dynamic scaler (starting at 2^24; it grew to 2^36 with no
# step skipped) fp16 matches float32 to three decimals, and bf16 does with no scaler at all, as
# its range predicts. (`MINITORCH_SMALL=1` runs 150 steps: 0.515 for float32, 1.525 and 41 %
# for unscaled fp16, a final scale of 2^27.) Micikevicius et al. found the same on real
# networks: a large share of activation gradients below fp16's smallest subnormal, and loss
# scaling recovering float32 accuracy.

# %% [markdown]
# ## 3. Integer quantization
#
# Integer quantization maps a real tensor x to integers q with a **scale** s (and, for the
# asymmetric scheme, a **zero point** z) so that `x ~ s * (q - z)` (Jacob et al., "Quantization
# and Training of Neural Networks for Efficient Integer-Arithmetic-Only Inference", 2018):
#
# - **Symmetric (absmax).** z = 0, s = max|x| / qmax with qmax = 2^(b-1) - 1 = 127 for int8;
#   q = clip(round(x / s), -qmax, qmax). The range is symmetric, so -128 goes unused: the price
#   of a zero point that is 0, which keeps the integer matmul simple.
# - **Asymmetric (zero point).** The range [lo, hi] = [min(x.min(), 0), max(x.max(), 0)] is
#   mapped onto all 2^b levels [qmin, qmax] = [-128, 127]: s = (hi - lo) / 255,
#   z = round(qmin - lo / s) (an integer in [qmin, qmax]), q = clip(round(x / s) + z, qmin,
#   qmax). Useful when x is one-sided (after a ReLU or GELU). Including 0 in the range makes
#   **zero exact**: x = 0 gives q = z and dequantizes to exactly 0, so zero padding and ReLU
#   zeros stay zero.
# - **Error.** Inside the range, |x - s(q - z)| <= s/2: rounding to the nearest level. Outside
#   it (when the scale came from calibration data and a new value is larger) q **saturates** at
#   qmin or qmax.
#
# **Granularity**: one (s, z) for the whole tensor (*per-tensor*), one per output channel
# (*per-channel*: a column of lesson 03's `W` of shape (in, out)), one per row of activations
# (*per-token*), or one per *group* of g consecutive input weights in each column (*per-group*,
# g = 128 is common for 4-bit weights; the MX formats use blocks of 32). One idea covers
# them all: a **block shape**. The tensor is cut into blocks of that shape and each block gets
# its own (s, z). For `W` of shape (K, N): per-tensor is block (K, N), per-channel (K, 1),
# per-group (g, 1); for activations X (T, K), per-token is (1, K). -1 in a block means the whole
# axis. A block shape that does not divide the tensor's shape is an error, never a silent
# remainder.

# %%
#| export
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

# %% [markdown]
# **Exercise 10.4.** Write `quantize_with(x, scale, zero_point, bits, symmetric)` (apply given
# per-block parameters, saturating) and `quantize(x, bits=8, symmetric=True, block=None)`
# (compute the parameters, one per block, then call `quantize_with`). Rules:
#
# - `x` float32 or float64, any shape; `block` as above, checked with `check_block`. Reshape x
#   to `(n0/b0, b0, n1/b1, b1, ...)` and reduce over the odd axes to get one statistic per block.
# - Symmetric: s = absmax / qmax; asymmetric: the range including 0, z as above. Compute in
#   float64; store `scale` as float32 and `zero_point` as int32.
# - A block that is all zeros, or constant, must not give a NaN or an inf: where s would be 0,
#   use s = 1 (the block then quantizes to q = z exactly and dequantizes to 0).
# - Round with `np.round` (ties to even), clip to `qrange(bits, symmetric)`, return int8 q.
#
# The tests check the error bound |x - dequantize| <= s/2 as a property (hypothesis draws the
# arrays and blocks), exact zeros, saturation, constant blocks, and the errors.

# %%
#| export
#| exercise 10.4
def quantize_with(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, bits: int = 8,
                  symmetric: bool = True) -> np.ndarray:
    """int8 q = clip(round(x / scale) + zero_point, qmin, qmax); scale and zero_point per block
    (one entry per block; expand_blocks makes them full size). Values out of range saturate.
    x must be finite and the scales finite and > 0 (checked here: ValueError)."""
    check_finite_float("quantize_with", x)
    check_qparams("quantize_with", np.shape(x), scale, zero_point)
    ### BEGIN SOLUTION
    x = np.asarray(x, dtype=np.float64)
    qmin, qmax = qrange(bits, symmetric)
    s = expand_blocks(np.asarray(scale, dtype=np.float64), x.shape)
    z = expand_blocks(np.asarray(zero_point, dtype=np.int64), x.shape)
    return np.clip(np.round(x / s) + z, qmin, qmax).astype(np.int8)
    ### END SOLUTION


def quantize(x: np.ndarray, bits: int = 8, symmetric: bool = True, block: tuple[int, ...] | None = None) -> QTensor:
    """Quantize a float array x of any shape blockwise: symmetric absmax or asymmetric with a zero point.

    block: the block shape (None = one block, -1 = the whole axis); each block gets a float32
    scale and an int32 zero point. Returns a QTensor. x must be non-empty and finite (checked here)."""
    x = check_finite_float("quantize", x)
    if x.size == 0:
        raise ValueError(f"quantize: x is empty (shape {x.shape}): there is no range to quantize")
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("10.4")

# %% [markdown]
# The error on a weight matrix of lesson 03's shape with a few large columns (real layers
# have them) and on one-sided, post-ReLU activations:

# %% tags=["demo"]
W_demo = rng.standard_normal((256, 128)).astype(np.float32) * 0.05
W_demo[:, :4] *= 20  # four output channels with 20x larger weights
A_demo = np.maximum(rng.standard_normal((64, 256)), 0).astype(np.float32)


def rel_err(x, qt):
    return float(np.linalg.norm(qt.dequantize() - x) / np.linalg.norm(x))


for label, x, kw in [
    ("W per-tensor, symmetric", W_demo, dict(block=None)),
    ("W per-channel (256, 1)", W_demo, dict(block=(-1, 1))),
    ("W per-group (32, 1)", W_demo, dict(block=(32, 1))),
    ("W int4 per-group (32, 1)", W_demo, dict(bits=4, block=(32, 1))),
    ("W int4 per-channel", W_demo, dict(bits=4, block=(-1, 1))),
    ("A per-token, symmetric", A_demo, dict(block=(1, -1))),
    ("A per-token, asymmetric", A_demo, dict(block=(1, -1), symmetric=False)),
]:
    print(f"{label:<28} relative error {rel_err(x, quantize(x, **kw)):.4f}")

# %% [markdown]
# Per-channel scales remove most of the per-tensor error: the four large columns no longer
# set the step size of the other 124. Groups help further at 4 bits. For one-sided
# activations, the symmetric scheme wastes the negative half of its levels; the zero point
# buys that bit back.

# %% [markdown]
# Live: the bits and the scale's granularity against the error, on the same weight matrix. Each
# bit halves the step (the error falls about 2x per bit) until the large columns set the step
# of everything sharing their scale.

# %% tags=["demo"]
from course.live import live

GRANULARITY = {"per-tensor": None, "per-channel": (-1, 1), "per-group (32, 1)": (32, 1)}


def draw_quant_error(bits: int, scales: str):
    qt = quantize(W_demo, bits=bits, block=GRANULARITY[scales])
    err = qt.dequantize() - W_demo
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    ax.hist(W_demo[:, 4:].ravel(), bins=80, color="0.7", label="weights")
    ax.hist(qt.dequantize()[:, 4:].ravel(), bins=80, histtype="step", color="C3", label="quantized")
    ax.set(xlabel="weight (columns 4..127)", title=f"int{bits}, {scales}")
    ax.legend(fontsize=8)
    curve = [rel_err(W_demo, quantize(W_demo, bits=b, block=GRANULARITY[scales])) for b in range(2, 9)]
    ax2.semilogy(range(2, 9), curve, "o-")
    ax2.semilogy([bits], [np.linalg.norm(err) / np.linalg.norm(W_demo)], "o", color="C3", ms=10)
    ax2.set(xlabel="bits", ylabel="relative error", ylim=(1e-3, 2))
    fig.tight_layout()
    return fig


live(draw_quant_error, bits=(2, 8), scales=list(GRANULARITY))

# %% [markdown]
# ## 4. int4: two values per byte
#
# NumPy has no 4-bit type, so 4-bit weights are stored two per byte: element 2i in the low
# nibble (bits 0-3), element 2i+1 in the high nibble (bits 4-7), each as a 4-bit two's
# complement number (-8..7). An odd count leaves the last high nibble 0. Unpacking must
# *sign-extend*: nibble 0b1110 is -2, not 14. Arithmetic shifts do it for free: put the nibble
# in the top of an int8 (`<< 4`) and shift it back down (`>> 4`) with the sign.
#
# **Exercise 10.5.** Write `pack_int4(q)` (int8 array, any shape, values in [-8, 7]; flattened
# in C order -> uint8 array of length ceil(n/2)) and `unpack_int4(packed, shape)` (-> int8
# array of `shape`). Values outside [-8, 7], a non-integer dtype, and a `shape` that needs more
# (or fewer) nibbles than `packed` holds raise a ValueError/TypeError that says so.

# %%
#| export
#| exercise 10.5
def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack int values in [-8, 7] (any shape, C order) two per byte: element 2i in the low nibble.
    Returns uint8 of length ceil(q.size / 2); an odd count leaves the last high nibble 0."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def unpack_int4(packed: np.ndarray, shape: tuple[int, ...] | int) -> np.ndarray:
    """The int8 array of `shape` packed by pack_int4 (sign-extended nibbles, low nibble first)."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("10.5")

# %% [markdown]
# ## 5. An int8 GEMM with int32 accumulation
#
# The product of two int8 values lies in [-16256, 16384]; K of them sum to at most K x 2^14 in
# magnitude. An int16 accumulator overflows after two worst-case terms, so int8 matmuls
# accumulate in **int32** (safe for K < 2^17 = 131072), on every chip: the TPU v1's 8-bit MACs
# feed 32-bit accumulators (Jouppi et al. 2017), NVIDIA's `dp4a` and int8 tensor cores
# accumulate in int32. NumPy does not: `int8 @ int8` returns int8 and wraps around, silently.

# %% tags=["demo"]
a8 = np.full((1, 1000), -128, np.int8)
b8 = np.full((1000, 1), -128, np.int8)
print("NumPy int8 @ int8:", (a8 @ b8).item(), (a8 @ b8).dtype, "   exact:", (a8.astype(np.int64) @ b8.astype(np.int64)).item())

# %% [markdown]
# On the CPU there is no int8 FMA, but there are *widening multiply-adds*: AVX2's `vpmaddwd`
# multiplies 16 pairs of int16 and adds adjacent products into 8 int32 (and `vpmaddubsw` does
# uint8 x int8 -> int16 pairs); AVX-512 VNNI fuses the add into the accumulator
# (`vpdpwssd` for int16 pairs, `vpdpbusd` for four uint8 x int8 products per int32 lane).
# Arm has `smull`/`smlal` (widening multiply, and multiply-accumulate) on every 64-bit core, and
# `sdot` (four int8 products into an int32 lane) on cores with Armv8.2's optional dot-product
# extension (Apple M1 on, Neoverse N1 on); LLVM emits `sdot` only when the target CPU it is given
# has it (Numba gives it the host's). LLVM recognises a dot product written the plain way, with
# int8 loads widened and an int32 sum, and emits these instructions.
#
# **Exercise 10.6.** Write the Numba kernel `int8_dot(x, y)`: the dot product of two 1-D int8
# arrays of equal length, accumulated and returned as an int32 (`np.int32(0)` to start, and
# keep the sum int32: Numba promotes int32 + int32 to int64, so wrap the update in
# `np.int32(...)`). The test checks it against NumPy in int64, with all -128 inputs and K up to
# 100,000 (where an int16 sum would have wrapped long ago), and reads the machine code for the
# widening multiply-adds this CPU supports.
#
# The GEMM around it (`matmul_int8`, given) is lesson 06's idea without the micro-kernel:
# pack B transposed so each output is a dot product of two contiguous rows, block the columns
# so that a block of B's rows stays in the L2 cache while a row of A streams past, and run the
# row blocks on all cores with `prange`.

# %%
#| export
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

# %%
#| export
#| exercise 10.6
@njit(cache=False)
def int8_dot(x, y):
    """sum_i int32(x[i]) * int32(y[i]) for 1-D int8 arrays of equal length, as an int32."""
    check_int8_vectors(x, y)  # given: a TypeError/ValueError for other dtypes or lengths
    ### BEGIN SOLUTION
    acc = np.int32(0)
    for i in range(x.shape[0]):
        acc = np.int32(acc + np.int32(x[i]) * np.int32(y[i]))
    return acc
    ### END SOLUTION

# %%
#| export
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

# %% tags=["check"]
check("10.6")

# %% tags=["demo"]
import numba

x8 = rng.integers(-128, 128, 4096).astype(np.int8)
sig = (numba.typeof(x8), numba.typeof(x8))
int8_dot(x8, x8)
print("int8_dot machine code:", find_int8_madd(int8_dot.inspect_asm(sig)))
A8 = rng.integers(-128, 128, (64, 200)).astype(np.int8)
B8 = rng.integers(-128, 128, (200, 48)).astype(np.int8)
assert np.array_equal(matmul_int8(A8, B8), A8.astype(np.int64) @ B8.astype(np.int64))
gsig = gemm_int8_kernel.signatures[0]
print("GEMM kernel machine code:", find_int8_madd(gemm_int8_kernel.inspect_asm(gsig)))

# %% [markdown]
# The cell above prints the widening multiply-adds LLVM chose. On an AVX-512 CPU with VNNI it emits
# `vpmovsxbw` (sign-extend 32 int8 to int16) and `vpmaddwd` (multiply int16 pairs, add adjacent
# products into int32) followed by `vpaddd` in `int8_dot`, and, inlined into the GEMM kernel,
# `vpmaddwd` and sometimes VNNI's fused `vpdpwssd`; never `vpdpbusd`. `vpdpbusd` needs one operand
# unsigned, so a signed x signed int8 product cannot use it directly; the last part of this section
# shows how libraries such as oneDNN get around that. `make bench` (benchmarks/bench_quant.py) times
# these GEMMs at n = 1024 against NumPy's float32 BLAS and lesson 06's float32 kernels; the cell
# below does the same once, with NumPy's BLAS timed as a student's machine runs it
# (`blas_matmul_gflops`, lesson 04).

# %% tags=["demo"]
from minitorch.bench import benchmark, blas_line, blas_matmul_gflops
from minitorch.simd_matmul import matmul_simd

n = 512 if SMALL else 1024
A8 = rng.integers(-128, 128, (n, n)).astype(np.int8)
B8 = rng.integers(-128, 128, (n, n)).astype(np.int8)
Af, Bf = A8.astype(np.float32), B8.astype(np.float32)
assert np.array_equal(matmul_int8(A8, B8), A8.astype(np.int64) @ B8.astype(np.int64))
print(blas_line())
for label, fn, args in [("int8 GEMM (this lesson)", matmul_int8, (A8, B8)),
                        ("float32 lesson 06 kernel", matmul_simd, (Af, Bf))]:
    t = benchmark(fn, *args, repeat=3)
    print(f"{label:<26} n={n}: {2 * n**3 / t.min / 1e9:7.1f} GOPS")
blas_run = blas_matmul_gflops([n], rounds=1)
print(f"{'float32 NumPy BLAS':<26} n={n}: {blas_run['gflops'][n]:7.1f} GOPS ({blas_run['blas']}, timed in "
      f"{blas_run['where']})")

# %% [markdown]
# `matmul_int8` above reaches about the speed of lesson 06's inner-product float32 kernel, not
# more (the cell prints it): each output is one dot product that reloads and re-widens both of
# its rows, while a fast kernel keeps a block of outputs in registers and reuses every load.
# Blocking the int8 loop the same way (4 rows of A by 2 rows of B^T, eight int32 sums per pass
# over k) loses the instruction: LLVM then multiplies in 32 bits (`vpmulld`: 16 multiplies per
# 512-bit instruction and a separate `vpaddd`, against `vpmaddwd`'s 32 multiplies and 16 adds). The reason is in LLVM's x86 back end (its
# `X86PartialReduction` pass): it turns widened multiplies feeding a sum into `vpmaddwd` only if
# each widened operand is used once, and in a blocked loop every loaded row feeds several sums.
# Writing the pairs out (B packed as int16 pairs `(b[2k, j], b[2k+1, j])` side by side, each
# multiplied by the matching pair of A and added, in a loop over columns) does not help either:
# LLVM vectorises that loop with `vpmulld` too (we tried), because the A side is a pair of
# broadcast scalars, not the even and odd lanes of one vector.
#
# ### Explicit pairs: an int8 kernel that runs everywhere
#
# Libraries do not leave these kernels to a compiler's pattern matching: FBGEMM writes them with
# intrinsics, oneDNN generates them at run time (a JIT assembler, Xbyak). Lesson 06's
# `minitorch.simd` is our equivalent: `vmadd_pairs(acc, w, p, i)` is one `vpmaddwd` on AVX-512
# (two on AVX2), and VNNI's `vpdpwssd` once LLVM fuses the add, where the CPU has it, and portable
# LLVM IR elsewhere (Arm included). Its A operand is a 32-bit word `w`
# holding a pair of int16 (`a[r, 2k]`, `a[r, 2k+1]`), broadcast to every lane; its B operand is
# 16 such pairs (`b[2k, j]`, `b[2k+1, j]` for 16 columns j) loaded from a packed panel. Each
# int32 lane j gets `a[r, 2k] * b[2k, j] + a[r, 2k+1] * b[2k+1, j]`: 32 multiply-adds per
# instruction. That is lesson 06's outer-product kernel with a pair of k in place of one k:
#
# - `pack_a_pairs`: MC rows of A as 6-row panels of pair words, k-pair-major (int8 widened to
#   int16 while packing, two to a word; an odd K gets a zero);
# - `pack_b_pairs`: a block of B as 16-column panels of int16 pairs, k-pair-major;
# - `int8_pairs_kernel`: six `i32x16` accumulators (the 6 x 16 block of C), one panel load of
#   B and six `vmadd_pairs` per pair of k, six `vstore_add_i32` at the end;
# - blocked loops like lesson 06's first `gemm_blis` (KC counts pairs of k here; a pair word and a
#   B pair take 4 bytes, as a float32 does), threads over the row blocks of A.
#
# The operands stay 8-bit until packing, so the matrices in memory (and the weights a model
# loads) keep their 4x saving; the packed panels are int16, half of float32, and are built once
# per block, as lesson 06's are. Results are exact: a pair sum is at most 2 x 128 x 128 = 32768
# and the int32 sums are safe up to K = 131071 (`MAX_K_INT32`). (Intel's *Software Developer's
# Manual*, vol. 2: PMADDWD and VPDPWSSD; Numba's "High-level extension API" for `@intrinsic`.)
# This is the portable path; the next one uses the instruction made for int8 where the CPU has it.

# %%
#| export
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

# %% [markdown]
# ### VNNI: four int8 products per lane, and the zero-point shift it needs
#
# AVX-512 VNNI (Intel's Cascade Lake, 2019, and later; AMD's Zen 4) and AVX-VNNI (the same
# instructions on 256-bit `ymm` registers, in Intel's Alder Lake and AMD's Zen 5) have `vpdpbusd`:
# in every int32 lane, four products of an *unsigned* byte of one operand and a *signed* byte of
# the other, added into the lane. That is 64 multiply-adds per 512-bit instruction: twice
# `vpdpwssd`'s 32 and four times a float32 FMA's 16 (Intel, *Software Developer's Manual*, vol. 2,
# VPDPBUSD). One operand must be unsigned, and our A is signed int8. Shift it: a + 128 lies in
# [0, 255], a uint8, and
#
# $$\sum_k (a_{ik} + 128)\, b_{kj} = \sum_k a_{ik} b_{kj} + 128 \sum_k b_{kj},$$
#
# so C = (A + 128) B - 128 colsum(B): the product of the shifted A, minus a correction that depends
# on B alone, one int32 per column, computed once (for a weight matrix B, once per model). This is a
# zero point: A + 128 is A quantized with zero point 128 (section 3's asymmetric scheme), and the
# correction is the zero-point term of a quantized product (Jacob et al. 2018, section 2.3); oneDNN's
# int8 GEMMs apply the same compensation to signed inputs. The result is exact: the instruction adds
# modulo 2^32, so even where the shifted products' sum passes int32's range (K x 255 x 128 can), the
# correction brings it back, and whenever the true result fits int32 (K <= 131071) the computed one
# is it.
#
# The GEMM around it is lesson 06's with words of four k in place of float32s: an A micro-panel holds
# words of four uint8 (four consecutive k of one row of A + 128), a B micro-panel words of four int8
# (four consecutive k of one column), and `vdot_u8s8(acc, w, p, i)` (given, `minitorch.simd`) is one
# `vpdpbusd` on AVX-512 VNNI, two on AVX-VNNI, portable LLVM IR elsewhere. The kernel has the shape
# lesson 06's rule picks for this machine (an `i32x16` takes the registers of an `f32x16`), its
# source generated as in exercise 6.6 with `vdot_u8s8` for `vfma_bcast`, and the blocking is lesson
# 06's, a word of four int8 taking the 4 bytes of a float32.
#
# **Exercise 10.13.** Write the two halves of the shift: `shift_to_u8(a)`, an int8 array to the
# uint8 array a + 128 (same shape), and `zero_point_correction(b)`, the int32 vector
# 128 x (sum over k of b[k, j]) of an int8 matrix b (K, N), shape (N,). `matmul_int8_vnni` (given)
# multiplies the shifted A by B with the VNNI kernel into a C that starts at minus the correction.
# The tests check both halves, the whole product exactly against NumPy in int64 (every input -128,
# and 127 against -128, with K up to 131071), and, where the CPU has VNNI, `vpdpbusd` in its machine
# code.

# %%
#| export
#| exercise 10.13
def shift_to_u8(a: np.ndarray) -> np.ndarray:
    """a + 128 as uint8, same shape, for an int8 array `a`: the unsigned operand of vpdpbusd."""
    ### BEGIN SOLUTION
    return a.view(np.uint8) ^ np.uint8(0x80)
    ### END SOLUTION


def zero_point_correction(b: np.ndarray) -> np.ndarray:
    """128 * sum_k b[k, j] for j < N, an int32 vector (N,), for an int8 matrix b (K, N): what the shift
    adds to each column of the product, (a + 128) @ b - a @ b."""
    ### BEGIN SOLUTION
    return np.int32(128) * b.sum(axis=0, dtype=np.int32)
    ### END SOLUTION

# %%
#| export
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

# %% tags=["check"]
check("10.13")

# %% [markdown]
# Both int8 GEMMs exact on odd shapes and at the extremes, the instructions in their machine code,
# then GOPS at n = 1024 against lesson 06's two float32 kernels and NumPy's float32 BLAS, on all
# threads, in one run (our kernels take turns, `best_apart` from lesson 06; NumPy's BLAS timed as a
# student's machine runs it, `blas_matmul_gflops`, beside the line naming its kernel and the CPU's
# ISA), and the same against n with the int8 kernels' own peaks (from L1, every thread) drawn.
#
# `make bench L=quant` measures the same at n = 1024 (benchmarks/bench_quant.py, the same
# kernels, each result checked first). One run on the course's development machine (an Intel Xeon
# with AVX-512 VNNI under KVM, 2 vCPUs, nearly idle: load average 1.0; OpenBLAS 0.3.31 on its
# AVX-512 "SkylakeX" kernel, as a student's machine runs it) printed, on 2 threads: the VNNI kernel
# 867 GOPS, the int16-pairs kernel 357, exercise 10.6's dot products 69, lesson 06's float32 BLIS
# kernel 265 and NumPy's float32 BLAS 350. So the VNNI kernel ran at 2.48x the float32 BLAS, 3.27x
# our own float32 kernel and 2.43x the pairs kernel; the pairs kernel at 1.02x the BLAS. On 1
# thread: 478 GOPS against 170 for the BLAS (2.80x). (An earlier run with other jobs on the
# machine, load average 6.6: 2.30x on 2 threads.)

# %% tags=["demo"]
import matplotlib.pyplot as plt
import numba

from minitorch.bench import blas_line, blas_matmul_gflops, fma_roof, load_report
from minitorch.simd import madd_flavour, u8s8_flavour
from minitorch.simd_matmul import (aligned_empty, best_apart, kernel_calls, machine_shape, matmul_blis, matmul_simd,
                                   peak_rate)

for (m, k, n) in [(1, 1, 1), (7, 3, 5), (37, 1031, 53), (130, 17, 7), (64, 4096, 48)]:
    A8 = rng.integers(-128, 128, (m, k)).astype(np.int8)
    B8 = rng.integers(-128, 128, (k, n)).astype(np.int8)
    want = A8.astype(np.int64) @ B8.astype(np.int64)
    assert np.array_equal(matmul_int8_pairs(A8, B8), want) and np.array_equal(matmul_int8_vnni(A8, B8), want)
A8 = np.full((6, 131071), -128, np.int8)
want = A8.astype(np.int64) @ A8.T.astype(np.int64)
assert np.array_equal(matmul_int8_pairs(A8, A8.T.copy()), want) and np.array_equal(matmul_int8_vnni(A8, A8.T.copy()), want)
print("matmul_int8_pairs and matmul_int8_vnni are exact on odd shapes and at K = 131071 with every input -128")
mr_, nv_ = machine_shape()
print(f"vmadd_pairs compiled as: {madd_flavour()}; pairs GEMM machine code:",
      find_int8_madd(gemm_int8_pairs.inspect_asm(gemm_int8_pairs.signatures[0])))
print(f"vdot_u8s8 compiled as: {u8s8_flavour()}; VNNI GEMM ({mr_} x {16 * nv_} kernel) machine code:",
      find_int8_madd(gemm_int8_vnni.inspect_asm(gemm_int8_vnni.signatures[0])))

threads = numba.get_num_threads()
n = 512 if SMALL else 1024
A8 = rng.integers(-128, 128, (n, n)).astype(np.int8)
B8 = rng.integers(-128, 128, (n, n)).astype(np.int8)
Af, Bf = A8.astype(np.float32), B8.astype(np.float32)
int8_kernels = {"int8 VNNI (exercise 10.13)": lambda: matmul_int8_vnni(A8, B8),
                "int8 pairs (portable)": lambda: matmul_int8_pairs(A8, B8),
                "int8 dot products (10.6)": lambda: matmul_int8(A8, B8),
                "float32 lesson 06 BLIS kernel": lambda: matmul_blis(Af, Bf),
                "float32 lesson 06 simd kernel": lambda: matmul_simd(Af, Bf)}
gops = {name: 2 * n**3 / t / 1e9 for name, t in best_apart(int8_kernels, rounds=2 if SMALL else 3).items()}
blas_run = blas_matmul_gflops([n], threads=threads, rounds=2 if SMALL else 3)
gops["float32 NumPy BLAS"] = blas_run["gflops"][n]
print(load_report())
print(blas_line(), f"(NumPy's BLAS timed in {blas_run['where']})")
vnni = gops["int8 VNNI (exercise 10.13)"]
for name, g in gops.items():
    print(f"{name:<30} n={n}, {threads} threads: {g:7.1f} GOPS   int8 VNNI / this = {vnni / g:5.2f}")

# %% tags=["demo"]
def int8_peak(kernel, mr, nr, words, threads_used, kc=256, calls=300 if SMALL else 3000):
    """GOPS of an int8 kernel (pairs: words = 2 k per word; VNNI: 4) with its panels in L1 on `threads_used`
    threads (lesson 06's peak_rate)."""
    ap = rng.integers(-2**31, 2**31, (threads_used, mr * kc)).astype(np.int32)
    per_k, dtype, top = (2 * nr, np.int16, 2**15) if words == 2 else (nr, np.int32, 2**31)
    bp = aligned_empty(threads_used * per_k * kc, dtype).reshape(threads_used, per_k * kc)  # as the GEMMs pack B
    bp[:] = rng.integers(-top, top, bp.shape)
    c = np.zeros((threads_used, mr * nr + 1024), np.int32)
    return peak_rate(kernel, ap, bp, c, nr, calls, 2 * mr * nr * words * kc) / 1e9


sizes = (128, 256, 512) if SMALL else (256, 512, 1024, 2048)
curves = {}
for n_ in sizes:
    A8 = rng.integers(-128, 128, (n_, n_)).astype(np.int8)
    Af = A8.astype(np.float32)
    t = best_apart({"int8 VNNI": lambda: matmul_int8_vnni(A8, A8), "int8 pairs": lambda: matmul_int8_pairs(A8, A8),
                    "float32 BLIS (06)": lambda: matmul_blis(Af, Af)}, rounds=2)
    curves[n_] = {name: 2 * n_**3 / s / 1e9 for name, s in t.items()}
blas_curve = blas_matmul_gflops(sizes, threads=threads, rounds=2)
for n_ in sizes:
    curves[n_]["float32 NumPy BLAS"] = blas_curve["gflops"][n_]
peaks = {"int8 VNNI": int8_peak(make_int8_vnni_kernel(mr_, nv_), mr_, 16 * nv_, 4, threads),
         "int8 pairs": int8_peak(int8_pairs_kernel, PAIRS_MR, PAIRS_NR, 2, threads)}
roof = fma_roof(threads) / 1e9
fig, ax = plt.subplots(figsize=(7, 4))
for name in curves[sizes[0]]:
    ax.plot(sizes, [curves[n_][name] for n_ in sizes], marker="o", label=f"{name}, {threads} threads")
for (name, p), style in zip(peaks.items(), ("--", ":")):
    ax.axhline(p, color="k", ls=style, lw=1, label=f"peak: {name} kernel from L1, all threads")
ax.axhline(roof, color="0.5", ls="-.", lw=1, label="float32 FMA roof (lesson 04), all threads")
ax.set(xscale="log", xlabel="n (square)", ylabel="GOPS (2 per multiply-add)", title="int8 GEMMs against n")
ax.set_xticks(sizes, [str(x) for x in sizes])
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
plt.show()
for n_, g in curves.items():
    print(f"n={n_:5d}: " + "  ".join(f"{k} {v:6.1f}" for k, v in g.items()) + " GOPS")
print("peaks from L1, " + f"{threads} threads: " + ", ".join(f"{k} {v:.0f} GOPS" for k, v in peaks.items())
      + f"; float32 FMA roof {roof:.0f} GFLOP/s")

# %% [markdown]
# What to read here: the int8 kernels win by their instruction, not by their loops, which are
# lesson 06's. `vpdpbusd` does 64 multiply-adds per instruction where a float32 FMA does 16 and
# `vpdpwssd` 32, so at the same instruction rate the VNNI kernel does 4x the work of a float32 FMA
# kernel and the pairs kernel 2x. The whole products keep a smaller share of that than the float32
# kernel does of its own: packing (and the zero-point correction) cost about as much time as for
# float32, against a quarter of the arithmetic time. Without VNNI
# (`u8s8_flavour()` says `generic`: AVX2 without AVX-VNNI, Arm) the portable IR widens to
# 32-bit multiplies, and the pairs kernel is the one to use there.

# %% [markdown]
# ### The same GEMM on a GPU: `__dp4a`
#
# NVIDIA GPUs since Pascal (compute capability 6.1) have `__dp4a(a, b, c)`: a and b are 32-bit
# words each holding four int8 values; it returns `c + a0*b0 + a1*b1 + a2*b2 + a3*b3` in
# int32, one instruction (`dp4a.s32.s32` in PTX) for four multiply-adds (CUDA C Programming
# Guide, "Integer Intrinsics"). Tensor cores do much more (an H100 SXM lists 1,979 dense int8
# TOPS, against 67 TFLOP/s of FP32 on its CUDA cores; see the
# [number formats note](../hardware_notes/number_formats.md#which-hardware-runs-which-format)),
# but `__dp4a` is the int8 counterpart of lesson 08's FMA loop and needs nothing but CUDA C.
#
# **Exercise 10.7.** Write `int8_gemm_dp4a_source()`: CUDA C for
# `extern "C" __global__ void int8_gemm_dp4a(const int* A4, const int* B4t, int* C, int M, int N, int K4)`,
# lesson 08's shared-memory tiled SGEMM (16 x 16 tiles, one thread per output) on packed
# operands: `A4` is A (M, 4*K4) int8 viewed as int32 words (four consecutive k per word), `B4t`
# is B transposed (N, 4*K4) viewed the same way, so the inner loop is
# `acc = __dp4a(a_word, b_word, acc)` on an `int` accumulator. Load zeros outside the matrices;
# `C` is (M, N) int32. The host side (`int8_gemm_dp4a`, given) pads K to a multiple of 4 and
# packs. The test compiles it with NVRTC and reads the PTX for `dp4a.s32.s32`, shared-memory
# loads and barriers, and runs it on the CPU emulator against NumPy (exact int32 results).

# %%
#| export
#| exercise 10.7
def int8_gemm_dp4a_source() -> str:
    """CUDA C source of int8_gemm_dp4a(A4, B4t, C, M, N, K4): C (M, N) int32 = A @ B for int8 A, B
    packed four per int32 word along K (B transposed); 16x16 shared-memory tiles, __dp4a inner loop."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


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

# %% tags=["check"]
check("10.7")

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
import cupy as cp

a8g = cp.random.randint(-128, 128, (333, 517), dtype=cp.int8)
b8g = cp.random.randint(-128, 128, (517, 250), dtype=cp.int8)
assert bool((int8_gemm_dp4a(a8g, b8g) == a8g.astype(cp.int32) @ b8g.astype(cp.int32)).all())
from minitorch.cupy_kernels import cuda_time_ms, sgemm

for n in [1024, 2048, 4096]:
    a8g = cp.random.randint(-128, 128, (n, n), dtype=cp.int8)
    b8g = cp.random.randint(-128, 128, (n, n), dtype=cp.int8)
    af, bf = a8g.astype(cp.float32), b8g.astype(cp.float32)
    t8, t32 = cuda_time_ms(lambda: int8_gemm_dp4a(a8g, b8g)), cuda_time_ms(lambda: sgemm(af, bf, "regtile"))
    print(f"n={n}: dp4a {2 * n**3 / t8 / 1e9:.1f} TOPS, lesson 08 regtile fp32 {2 * n**3 / t32 / 1e9:.1f} TFLOP/s")

# %% [markdown]
# On an NVIDIA H100 80GB HBM3 (`make gpucheck`, 2026-11-26; CUDA 13.0, CuPy 14.2.0) this cell
# printed: dp4a 13.6, 22.3 and 24.4 TOPS at n = 1024, 2048 and 4096, against lesson 08's `regtile`
# float32 at 7.2, 24.6 and 29.3 TFLOP/s. The dp4a kernel is lesson 08's *tiled* kernel (one output
# per thread, two shared loads per inner step), whose float32 twin ran at 8.1 TFLOP/s at n = 4096:
# four multiply-adds per shared load instead of one bought 3.0x. Beating `regtile` takes its
# register tiling too (exercise 10.14, next); the tensor cores' int8 path (1,979 TOPS listed) is the
# real int8 engine.

# %% [markdown]
# ### Register tiles for `__dp4a`
#
# The kernel of exercise 10.7 does one `__dp4a` per two shared-memory loads, as lesson 08's tiled
# SGEMM did one FMA per two: the loads, not the multiply-adds, set its speed. Lesson 08's
# `regtile` and `vec4` kernels fixed that for float32 with register tiles, and the same tiling
# serves int8: a block computes a 128 x 128 tile of C, each of its 256 threads an 8 x 8 block of
# outputs in 64 `int` accumulators; per word of k (four int8 values) a thread reads 8 words of A
# and 8 of B from shared memory, as four 16-byte `int4` loads, and issues 64 `__dp4a`: a
# sixteenth of a shared load per instruction, 256 int8 multiply-adds per 4 loads.
#
# **Exercise 10.14.** Write `int8_gemm_dp4a_regtile_source()`: CUDA C for
# `extern "C" __global__ void int8_gemm_dp4a_regtile(const int* A4, const int* B4t, int* C, int M, int N, int K4)`,
# the operands packed as in 10.7 (A4 (M, K4), B4t (N, K4): four consecutive k per word), launched
# by `dp4a_regtile_launch` (256 threads, one block per 128 x 128 tile of C). Per step of BK4 = 8
# words of k:
#
# 1. the block stores its tile of A transposed, `As[kk][m]` (`BM + 4` columns, `__align__(16)`:
#    the padding spreads a warp's transposed stores over the banks), and its tile of B likewise,
#    `Bs[kk][n]`: each thread loads 4 words of each, consecutive threads reading consecutive
#    words of a row of A4 or B4t; zeros outside the matrices;
# 2. thread (ty, tx) = (tid / 16, tid % 16) owns rows `4 ty` to `+3` and `64 + 4 ty` to `+3` of the
#    tile and columns `4 tx` to `+3` and `64 + 4 tx` to `+3` (lesson 08's `vec4` layout): per `kk`,
#    two `int4` loads from `As[kk]` and two from `Bs[kk]` feed 64 `__dp4a`;
# 3. the 64 results are stored to C, each guarded by its row and column (N is any size).
#
# The tests read the PTX (at least 64 `dp4a` per word of k, 16-byte shared loads, no local memory)
# and, on the emulator, check exact results on odd shapes and that each thread writes its 8 x 8
# outputs; whether the tile loads are coalesced and the padding spreads the banks shows only in the
# timings. On a GPU the cell below times it against 10.7's kernel and lesson 08's best float32
# kernels.

# %%
#| export
#| exercise 10.14
def int8_gemm_dp4a_regtile_source() -> str:
    """CUDA C source of int8_gemm_dp4a_regtile(A4, B4t, C, M, N, K4): C (M, N) int32 = A @ B for int8 A, B
    packed four per int32 word along K (B transposed); 128x128 tiles of C per block of 256 threads, 8x8
    outputs per thread in registers, __dp4a fed by int4 loads from shared memory."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


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

# %% tags=["check"]
check("10.14")

# %% tags=["gpu"]
require_gpu()  # skips this cell, saying why, where no CUDA GPU runs kernels
import cupy as cp

from minitorch.cupy_kernels import cuda_time_ms, sgemm

a8g = cp.random.randint(-128, 128, (333, 517), dtype=cp.int8)
b8g = cp.random.randint(-128, 128, (517, 250), dtype=cp.int8)
assert bool((int8_gemm_dp4a_regtile(a8g, b8g) == a8g.astype(cp.int32) @ b8g.astype(cp.int32)).all())
for n in [1024, 2048, 4096]:
    a8g = cp.random.randint(-128, 128, (n, n), dtype=cp.int8)
    b8g = cp.random.randint(-128, 128, (n, n), dtype=cp.int8)
    af, bf = a8g.astype(cp.float32), b8g.astype(cp.float32)
    rates = {name: 2 * n**3 / cuda_time_ms(fn) / 1e9 for name, fn in (
        ("int8 dp4a regtile (10.14)", lambda: int8_gemm_dp4a_regtile(a8g, b8g)),
        ("int8 dp4a tiled (10.7)", lambda: int8_gemm_dp4a(a8g, b8g)),
        ("float32 regtile (8.5)", lambda: sgemm(af, bf, "regtile")),
        ("float32 dbuf (8.10)", lambda: sgemm(af, bf, "dbuf")))}
    best32 = max(rates["float32 regtile (8.5)"], rates["float32 dbuf (8.10)"])
    print(f"n = {n}: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
          + f" T(FL)OP/s; dp4a regtile / best float32 = {rates['int8 dp4a regtile (10.14)'] / best32:.2f}")

# %% [markdown]
# ## 6. The same product on a systolic array
#
# A TPU does this int8 x int8 -> int32 product in hardware with a *weight-stationary systolic
# array*: a grid of R x C multiply-accumulate cells (PEs), each holding one weight, with
# activations flowing right and partial sums flowing down, one PE per clock cycle (Kung 1982;
# Jouppi et al. 2017). The conventions are written out in
# [accelerators: weight-stationary, precisely](../hardware_notes/accelerators.md#weight-stationary-precisely),
# with a worked 4 x 4 example; this exercise follows them exactly:
#
# - PE(r, c) holds `W[r, c]` (array row r = reduction index k, array column c = output column).
# - `X[m, r]` enters array row r from the left at cycle `m + r` (the skew); each cycle every
#   activation moves one PE to the right.
# - Each cycle PE(r, c) takes the partial sum from PE(r-1, c) (0 for row 0), adds
#   `x * W[r, c]` and holds the result, which moves down at the next cycle. So at cycle t,
#   PE(r, c) works on output row `m = t - r - c` and holds `sum_{k <= r} X[m, k] W[k, c]`.
# - `Y[m, c]` leaves the bottom of column c at the end of cycle `m + R - 1 + c`; one tile takes
#   `M + R + C - 2` cycles.
# - A (M, K) @ (K, N) product is cut into `ceil(K/R) * ceil(N/C)` weight tiles (zero-padded at
#   the edges), run one after another; tiles with the same output columns are summed outside
#   the array (int32).
#
# **Exercise 10.8.** Write `systolic_tile(x, w, on_cycle=None)` and
# `systolic_matmul(x, w, rows=4, cols=4)`. `systolic_tile` simulates one tile cycle by cycle
# with three (R, C) registers: `act` (the activation in each PE, int32), `row` (which row m of
# X it belongs to, -1 for a bubble) and `psum` (the partial sum, int32). Each cycle: shift
# `act`/`row` one column right and feed column 0 from the skewed input; compute the new
# `psum` from the one above; call `on_cycle(t, row, act, psum)` if given (copies are fine);
# collect the outputs leaving the bottom row. Return `(y, done, cycles)`: y (M, C) int32,
# done (M, C) the cycle at whose end `Y[m, c]` left, and the cycle count.
# `systolic_matmul` pads, tiles, sums the tiles and returns `(y int32 (M, N), total cycles)`.
#
# The tests grade the dataflow, not only the product: they watch `on_cycle` and check, at every
# cycle, which output row each PE works on, its activation and its partial sum, against the
# note's formulas and its worked 4 x 4 table.

# %%
#| export
#| exercise 10.8
def systolic_tile(x: np.ndarray, w: np.ndarray,
                  on_cycle: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    """One weight-stationary tile, cycle by cycle: x (M, R) int8 streams through an R x C array
    holding w (R, C) int8. Returns (y (M, C) int32 = x @ w, done (M, C) int64 cycle at whose end
    Y[m, c] left the array, cycles = M + R + C - 2). on_cycle(t, row, act, psum) sees the PE
    registers after cycle t: row (R, C) the output row each PE worked on (-1 idle), act the
    activation it holds, psum its partial sum."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def systolic_matmul(x: np.ndarray, w: np.ndarray, rows: int = 4, cols: int = 4) -> tuple[np.ndarray, int]:
    """x (M, K) int8 @ w (K, N) int8 on a rows x cols weight-stationary array, tile by tile.
    Returns (y (M, N) int32, cycles = ceil(K/rows) * ceil(N/cols) * (M + rows + cols - 2))."""
    rows, cols = check_size("systolic_matmul", "rows", rows, 1), check_size("systolic_matmul", "cols", cols, 1)
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("10.8")

# %% [markdown]
# The worked example of the note, replayed: the partial sums of column 0 at each cycle, and
# the cycle at which each output leaves.

# %% tags=["demo"]
X_note = np.array([[1, 2, 3, 2], [3, 0, 1, 2], [-2, 1, 4, 0], [0, -1, 2, 3]], np.int8)
W_note = np.array([[1, 0, 2, -1], [0, 1, -1, 2], [2, -1, 0, 1], [1, 1, 1, 0]], np.int8)
col0 = []
y_note, done_note, cyc = systolic_tile(X_note, W_note, lambda t, row, act, psum: col0.append(psum[:, 0].tolist()))
print("Y =", y_note.tolist(), " cycles:", cyc)
print("Y[m, c] leaves at the end of cycle:\n", done_note)
print("column 0 partial sums, cycle by cycle (rows 0..3):", col0)
Xb = rng.integers(-128, 128, (37, 29)).astype(np.int8)
Wb = rng.integers(-128, 128, (29, 23)).astype(np.int8)
yb, cb = systolic_matmul(Xb, Wb, 8, 8)
print(f"37x29 @ 29x23 on an 8x8 array: exact {np.array_equal(yb, Xb.astype(np.int64) @ Wb.astype(np.int64))}, "
      f"{cb} cycles, utilisation {37 * 29 * 23 / (cb * 64):.0%}")

# %% [markdown]
# Utilisation is low here because M = 37 rows barely cover the fill and drain of each tile
# (M + R + C - 2 = 51 cycles for 37 rows of work) and the edges are zero-padded; the note
# discusses why at M = 1 (decoding one token) a weight-stationary array spends almost all its
# time loading weights.

# %% [markdown]
# ## 7. A quantized Linear
#
# With x ~ s_x (q_x - z_x) per token (row t) and W ~ s_w q_w per output channel (column n,
# symmetric, so z_w = 0):
#
#     y[t, n] = sum_k x[t, k] W[k, n]
#             ~ s_x[t] s_w[n] sum_k (q_x[t, k] - z_x[t]) q_w[k, n]
#             = s_x[t] s_w[n] (acc[t, n] - z_x[t] colsum[n]),   acc = q_x @ q_w (int8 GEMM, int32),
#
# with `colsum[n] = sum_k q_w[k, n]` computed once when the layer is built. The scales come out
# of the sum only because each is constant along k: a per-token activation scale and a
# per-output-channel weight scale factor out, a per-input-channel scale does not (SmoothQuant
# is the trick that moves one into the other). The zero point costs one multiply-add per
# output (Jacob et al. 2018). This is **W8A8**: int8 weights, int8 activations, an integer
# GEMM. **Weight-only** quantization (W8, W4) stores the weights in 8 or 4 bits and
# dequantizes them to float before a float matmul: it saves the bytes (what matters when
# decoding is memory-bound) but not the arithmetic. Production kernels dequantize in
# registers, inside the GEMM; here we dequantize the whole matrix, which gives the same
# numbers.
#
# `QuantLinear` (inference only, no gradients) replaces lesson 03's `Linear`, whose weight has
# shape (in, out):
#
# | mode | weights | activations | granularity |
# |---|---|---|---|
# | `w8a8` | int8 symmetric | int8 asymmetric (dynamic: computed per call) | `channel`: weights per output channel, activations per token; `tensor`: one scale each |
# | `w8` | int8 symmetric | float | `channel`, or `group` (groups of g input rows per column) |
# | `w4` | int4 asymmetric (zero point) | float | `group` (default g = 128, or the largest divisor of `in` below it), or `channel` |
#
# **Exercise 10.9.** Write `QuantLinear.forward(x)`. For `w8a8`: quantize x (reshaped to
# (T, in)) with `self._quantize(x2, bits=8, symmetric=False, block=...)`, per token (block
# (1, in)) for granularity "channel" and one block for "tensor"; `acc =
# self._matmul_int8(qx.q, self.wq.q)`; then the formula above with `self.w_colsum` (compute it
# in int64 and float64: `z_x * colsum` can exceed int32). For `w8`/`w4`: `x2 @
# self.wq.dequantize()`. Add the bias, restore the leading shape, return a float32 Tensor.
# Wrong input widths raise a ValueError naming both shapes. `gemm` and `quantize_fn` default
# to your `matmul_int8` and `quantize`; the tests pass their own (NumPy) versions, so that
# this exercise is graded on its own.

# %%
#| export
#| exercise 10.9
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
        ### BEGIN SOLUTION
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
        ### END SOLUTION


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

# %% tags=["check"]
check("10.9")

# %% [markdown]
# ## 8. Outliers
#
# Transformers grow a few activation channels whose magnitude is far above the rest (about 100x
# in large OPT models, Xiao et al. 2023), in the same channels for every token (Dettmers et al.
# 2022; Bondarenko et al. 2021). With one scale per token, those channels set the step size,
# and the ordinary channels round to a handful of levels. Weights are well-behaved. Three ways out:
#
# - **LLM.int8()** (Dettmers et al., "LLM.int8(): 8-bit Matrix Multiplication for
#   Transformers at Scale", 2022): find the input columns where any |x| reaches a threshold
#   (6.0 in the paper), compute those columns in floating point (fp16 there, float32 here),
#   the rest as W8A8 (symmetric, per token x per channel); add the two products. Exact where
#   it matters, int8 elsewhere; the cost is the gather and a second, small, float matmul.
# - **SmoothQuant** (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training
#   Quantization for Large Language Models", 2023): `X W = (X diag(s)^-1)(diag(s) W)` for any
#   positive s. Choose `s_k = max|X_k|^alpha / max|W_k|^(1-alpha)` per input channel k (alpha
#   = 0.5 balances them): the outlier channels of X shrink, the matching rows of W grow, and
#   both quantize well. The division folds into the preceding LayerNorm's weight and bias, so
#   it is free at inference.
# - **AWQ** (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
#   Acceleration", MLSys 2024): for weight-only 4-bit, the weights that meet large
#   activations matter most. Scale those input rows of W up before quantizing (their relative
#   rounding error shrinks) and the activations down: `s = mean|X_k|^alpha`, with alpha
#   chosen by a grid search that minimises the output error on calibration data.

# %%
#| export
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

# %% [markdown]
# **Exercise 10.10.** Write `llm_int8_matmul(x, w, threshold=6.0, int8_matmul=None)`: the
# columns k of x (T, K) where `max_t |x[t, k]| >= threshold` are the outliers; return
# `(y, outlier_columns)`, with y (T, N) float32 = the float32 product of the outlier columns
# of x with the matching rows of w, plus `int8_matmul` (default `w8a8_matmul`) of the rest.
# Do not call `int8_matmul` when no column is left for it. So threshold = inf is exactly the
# pure int8 path, and threshold = 0 is exactly the float product.

# %%
#| export
#| exercise 10.10
def llm_int8_matmul(x: np.ndarray, w: np.ndarray, threshold: float = 6.0,
                    int8_matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """LLM.int8 mixed decomposition of x (T, K) @ w (K, N): outlier columns (max |x| >= threshold)
    in float32, the rest through int8_matmul (default w8a8_matmul). Returns (y (T, N) float32,
    the outlier column indices)."""
    ### BEGIN SOLUTION
    x, w = np.asarray(x, dtype=np.float32), np.asarray(w, dtype=np.float32)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"llm_int8_matmul: shape mismatch {x.shape} @ {w.shape} (need (T, K) @ (K, N))")
    int8_matmul = int8_matmul or w8a8_matmul
    outlier = np.abs(x).max(axis=0, initial=0.0) >= threshold
    y = x[:, outlier] @ w[outlier]
    if not outlier.all():
        y = y + int8_matmul(x[:, ~outlier], w[~outlier])
    return y.astype(np.float32), np.flatnonzero(outlier)
    ### END SOLUTION

# %% tags=["check"]
check("10.10")

# %% [markdown]
# **Exercise 10.11.** Write `smoothquant_scales(x_absmax, w, alpha=0.5)`: per input channel k,
# `s_k = x_absmax[k]^alpha / max_n |w[k, n]|^(1 - alpha)` (float64, shape (K,)), with s_k = 1
# where either maximum is 0 (a dead channel: nothing to balance, and no division by zero).
# `smooth(x, w, s)` (given) applies it.

# %%
#| export
#| exercise 10.11
def smoothquant_scales(x_absmax: np.ndarray, w: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """SmoothQuant's per-input-channel scales s (K,) float64 for activations with per-channel
    max |x| = x_absmax (K,) and weight w (K, N); 1 where either maximum is 0."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION


def smooth(x: np.ndarray, w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x / s, s[:, None] * w): the same product x @ w, with the difficulty moved from x to w.
    x (T, K), w (K, N), s (K,) finite and > 0."""
    if x.shape[1] != w.shape[0] or s.shape != (w.shape[0],):
        raise ValueError(f"smooth: x (T, K), w (K, N) and s (K,) must agree, got x {x.shape}, w {w.shape}, s {s.shape}")
    if not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(f"smooth: s must be finite and > 0, got {s[~(np.isfinite(s) & (s > 0))][:4].tolist()}")
    return x / s, w * s[:, None]

# %% tags=["check"]
check("10.11")

# %% [markdown]
# **Exercise 10.12.** Write `awq_search(x, w, n_grid=20, quantize_w=None)`: with
# `m_k = mean_t |x[t, k]|` (float64), for alpha in `0, 1/n_grid, ..., (n_grid-1)/n_grid`:
# `s = max(m, 1e-4)^alpha`, normalised by `sqrt(max(s) min(s))`; the candidate weight is
# `quantize_w(s[:, None] * w) / s[:, None]` (quantize the scaled weight, fold the scale back:
# at inference x / s would meet the scaled weight, the same product); its error is
# `mean((x @ candidate - x @ w)^2)` in float64. Return `(s, alpha, errors)` of the alpha with
# the smallest error (the first one on ties), errors being the list for every alpha in order.
# `quantize_w` (float32 (K, N) -> dequantized float32) defaults to int4 asymmetric with groups
# of `group_size_for(K)` input rows.

# %%
#| export
def quantize_w4_group(w: np.ndarray, group_size: int | None = None) -> np.ndarray:
    """w (K, N) float -> dequantized int4 asymmetric, groups of group_size (default group_size_for(K)) rows."""
    g = group_size or group_size_for(w.shape[0])
    return quantize(np.asarray(w, dtype=np.float32), bits=4, symmetric=False, block=(g, 1)).dequantize()

# %%
#| export
#| exercise 10.12
def awq_search(x: np.ndarray, w: np.ndarray, n_grid: int = 20,
               quantize_w: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[np.ndarray, float, list[float]]:
    """AWQ's per-input-channel scale search on calibration activations x (T, K) for weight w (K, N).
    Returns (s (K,) float64, alpha, [error for each alpha on the grid]). n_grid >= 1. The grid is
    alpha = i / n_grid for i = 0..n_grid-1; exact ties go to the first (smallest) alpha."""
    n_grid = check_size("awq_search", "n_grid", n_grid, 1)
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("10.12")

# %% [markdown]
# All three on a synthetic layer with 4 outlier channels out of 256, activations 20-60x larger
# than the rest (the pattern Dettmers et al. measured), relative output error against the
# float64 product:

# %% tags=["demo"]
T_o, K_o, N_o = 128, 256, 192
X_o = rng.standard_normal((T_o, K_o)).astype(np.float32)
outl = rng.choice(K_o, 4, replace=False)
X_o[:, outl] *= rng.uniform(20, 60, 4).astype(np.float32)
W_o = (rng.standard_normal((K_o, N_o)) * 0.05).astype(np.float32)
ref_o = X_o.astype(np.float64) @ W_o


def out_err(y):
    return float(np.linalg.norm(y - ref_o) / np.linalg.norm(ref_o))


y_llm, cols = llm_int8_matmul(X_o, W_o, 6.0)
s_sq = smoothquant_scales(np.abs(X_o).max(axis=0), W_o, 0.5)
x_s, w_s = smooth(X_o, W_o, s_sq)
s_awq, alpha_awq, _ = awq_search(X_o, W_o)
print(f"W8A8 symmetric (per token x per channel): {out_err(w8a8_matmul(X_o, W_o)):.4f}")
print(f"LLM.int8, threshold 6 ({len(cols)} float columns): {out_err(y_llm):.4f}")
print(f"SmoothQuant alpha 0.5, then W8A8:            {out_err(w8a8_matmul(x_s, w_s)):.4f}")
print(f"W4 group-{group_size_for(K_o)} round-to-nearest:          {out_err(X_o @ quantize_w4_group(W_o)):.4f}")
print(f"W4 with AWQ scales (alpha {alpha_awq:.2f}):          "
      f"{out_err((X_o / s_awq) @ quantize_w4_group((W_o * s_awq[:, None]).astype(np.float32))):.4f}")

# %% [markdown]
# ## 9. The tiny GPT, quantized
#
# Lesson 09's tiny GPT (2 layers, d = 64, a character-level model of Python's documentation)
# ships trained under `data/`. Every matrix in its blocks is a lesson-03 `Linear` of shape
# (in, out): `attn.q`, `attn.k`, `attn.v`, `attn.proj` (64 x 64), `mlp.fc` (64 x 256),
# `mlp.proj` (256 x 64). The token embedding (also the output layer, tied) stays float32 in every
# variant below; the table counts the bytes of the Linear weights (values, scales and zero
# points; biases excluded) and measures the validation loss on lesson 09's fixed split.
#
# The helpers below (given) wrap the model's Linears: `capture_inputs` records what flows into
# each one on calibration text (the training split, never the validation split), `FormatLinear`
# emulates a float format (bf16, or fp8 E4M3 with a per-tensor scale) for weights and
# activations, and `InputScaledLinear` applies a per-input-channel division before a quantized
# layer (what SmoothQuant folds into the LayerNorm and AWQ into the previous layer; the same
# numbers).

# %%
#| export
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

# %% tags=["demo"]
try:
    from minitorch.gpt import EVAL_WINDOWS, evaluate_loss, load_corpus, load_tiny_gpt, split_ids
    gpt_model, gpt_tok = load_tiny_gpt()
    gpt_train_ids, gpt_val_ids = split_ids(gpt_tok.encode(load_corpus()))
    HAVE_GPT = True
except (ImportError, FileNotFoundError) as exc:  # lesson 09 (the model and its checkpoint) missing
    HAVE_GPT, GPT_MISSING = False, f"{type(exc).__name__}: {exc}"

# %% [markdown]
# First, the outliers. The inputs of each Linear on 32 calibration windows of the training
# split: per input channel, the largest |x|, and how far the largest channel stands above the
# median one.

# %% tags=["demo"]
if not HAVE_GPT:
    print("lesson 09's tiny GPT is not available:", GPT_MISSING)
else:
    from minitorch.gpt import eval_windows

    calib_x, _ = eval_windows(gpt_train_ids, gpt_model.config.block_size, 16 if SMALL else 32)
    calib = capture_inputs(gpt_model, lambda m: m(calib_x))
    for name, xs in calib.items():
        amax = np.abs(xs).max(axis=0)
        top = np.argsort(amax)[-3:][::-1]
        print(f"{name:<22} max|x| {amax.max():6.2f}, median channel {np.median(amax):5.2f}, "
              f"ratio {amax.max() / np.median(amax):5.1f}; largest channels {top.tolist()}")

# %% [markdown]
# Now every variant, measured on the same validation windows. SmoothQuant's scales come from
# the calibration maxima (alpha = 0.5; q, k and v share one input, so they share the scale,
# computed from their weights stacked side by side), AWQ's from a search per layer on the
# calibration inputs.

# %% tags=["demo"]
def gpt_variants(model: Module, calib: dict[str, np.ndarray]) -> dict[str, Module]:
    k_of = {name: x.shape[1] for name, x in calib.items()}
    lins = {}
    replace_linears(model, lambda name, lin: lins.setdefault(name, lin) and None)

    def smoothquant(name: str, lin: Linear) -> Module:
        group = [n for n in lins if n.rsplit(".", 1)[0] == name.rsplit(".", 1)[0] and n.split(".")[-1] in "qkv"] \
            if name.split(".")[-1] in ("q", "k", "v") else [name]
        w_stack = np.concatenate([lins[n].weight.numpy() for n in group], axis=1)
        s = smoothquant_scales(np.abs(calib[name]).max(axis=0), w_stack, 0.5)
        w = lin.weight.numpy() * s[:, None].astype(np.float32)
        return InputScaledLinear(QuantLinear(w, None if lin.bias is None else lin.bias.numpy(), "w8a8"), s)

    def awq(name: str, lin: Linear) -> Module:
        s, _, _ = awq_search(calib[name], lin.weight.numpy(), n_grid=10 if SMALL else 20)
        w = lin.weight.numpy() * s[:, None].astype(np.float32)
        return InputScaledLinear(QuantLinear(w, None if lin.bias is None else lin.bias.numpy(), "w4", "group",
                                             group_size_for(k_of[name])), s)

    return {
        "fp32": model,
        "bf16 (W and A)": replace_linears(model, lambda n, lin: FormatLinear(lin, "bf16")),
        "fp8 E4M3 (W and A, per-tensor scale)": replace_linears(model, lambda n, lin: FormatLinear(lin, "fp8_e4m3", True)),
        "W8A8 per-tensor": quantize_model(model, mode="w8a8", granularity="tensor"),
        "W8A8 per-channel": quantize_model(model, mode="w8a8", granularity="channel"),
        "W4 group (zero point)": quantize_model(model, mode="w4", granularity="group"),
        "LLM.int8 (threshold 6)": replace_linears(model, lambda n, lin: LLMInt8Linear(lin, 6.0)),
        "SmoothQuant + W8A8 per-channel": replace_linears(model, smoothquant),
        "AWQ + W4 group": replace_linears(model, awq),
    }


if HAVE_GPT:
    n_val = 16 if SMALL else EVAL_WINDOWS
    rows = []
    for label, variant in gpt_variants(gpt_model, calib).items():
        t0 = time.perf_counter()
        loss = evaluate_loss(variant, gpt_val_ids, n_val)
        rows.append((label, linear_weight_bytes(variant), loss))
        print(f"{label:<38} {rows[-1][1]:>8,d} bytes of Linear weights   val loss {loss:.4f}   "
              f"({rows[-1][1] / rows[0][1]:.3f} of fp32, {time.perf_counter() - t0:.1f} s)")
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, b, loss in rows:
        ax.scatter(b / 1024, loss)
        ax.annotate(label, (b / 1024, loss), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set(xscale="log", xlabel="KiB of Linear weights", ylabel=f"val loss (nats/char, {n_val} windows)",
           title="Tiny GPT: bytes of weights vs validation loss")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# Measured on the shipped checkpoint (the first 64 validation windows, `EVAL_WINDOWS`, of lesson 09's split, `make
# demo`; 393,216 bytes of float32 Linear weights):
#
# | variant | bytes of Linear weights | of fp32 | val loss (nats/char) |
# |---|---|---|---|
# | fp32 | 393,216 | 1.000 | 1.4718 |
# | bf16 (weights and activations) | 196,608 | 0.500 | 1.4721 |
# | fp8 E4M3 (weights and activations, per-tensor scale) | 98,352 | 0.250 | 1.4984 |
# | W8A8 per-tensor | 98,352 | 0.250 | 1.4736 |
# | W8A8 per-channel (weights) x per-token (activations) | 102,912 | 0.262 | 1.4711 |
# | W4 groups of 64 and 128 (zero point) | 55,552 | 0.141 | 1.5666 |
# | LLM.int8 (threshold 6) | 102,912 | 0.262 | 1.4720 |
# | SmoothQuant (alpha 0.5) + W8A8 per-channel | 102,912 | 0.262 | 1.4719 |
# | AWQ-style scales + W4 groups of 64 and 128 | 55,552 | 0.141 | 1.5321 |
#
# What it says:
#
# - **8 bits are free here.** Every int8 variant stays within 0.002 nats of fp32 (the
#   per-channel one lands 0.0007 *below* it: noise of that size goes either way). bf16 is
#   indistinguishable from fp32. fp8 E4M3 costs 0.027: 3 mantissa bits are a coarser grid than
#   int8's 255 levels once a scale has placed the tensor's range.
# - **The tiny GPT has no real outliers.** The largest input channel of any layer is 1.4-2.5x
#   the median one, and no activation reaches 6, so LLM.int8 finds no outlier column and is
#   exactly the symmetric W8A8 path, and SmoothQuant has little to fix. Dettmers et al. saw
#   the outlier features emerge only around 6.7B parameters; a 110k-parameter model does not
#   have them. The synthetic layer of section 8 shows what the methods do when they exist.
# - **4 bits is where the methods matter.** Round-to-nearest W4 with `group_size_for`'s
#   groups (128 where the input width allows it: the MLP's second layer, 256 wide; 64 for the
#   64-wide inputs, where group-128 is not possible) loses 0.095 nats; AWQ's scale search, with nothing but calibration
#   activations, recovers 0.035 of it at the same byte count.
#
# The W8A8 per-channel row is graded (exercise 10.9's tests): within 0.005 nats of fp32 on 16
# validation windows (measured difference 0.0018). A forgotten zero-point correction costs
# +7.7 nats there; a scale on the wrong axis does not even broadcast.


# %%
#| export
#| given
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
