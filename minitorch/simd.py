# Generated from solutions/06_simd_threads.py by `make build`. Do not edit.
"""minitorch.simd: explicit SIMD vectors for Numba kernels, the way C code uses intrinsics.

Given in lesson 06 (not an exercise); lesson 10 builds on it.

Numba has no vector type: whether a loop uses SIMD registers is the auto-vectoriser's choice.
This module adds two, each a value Numba keeps in registers (an LLVM `<16 x float>` or
`<16 x i32>`): a zmm register on AVX-512, two ymm on AVX2, four q registers on Arm NEON.

    f32x16: vzero_f32(), vload_f32(x, i), vfma_bcast(acc, b, s), vstore_add_f32(acc, y, i)
    i32x16: vzero_i32(), vmadd_pairs(acc, w, p, i), vdot_u8s8(acc, w, p, i), vstore_add_i32(acc, y, i)

Arrays are 1-D, C-contiguous, of the stated dtype; `i` is an element index, checked against the
array's size (an IndexError with the index, the lanes and the size, never a read or write outside
the array; LLVM drops the checks it can prove, as in a loop over a panel). Each operation is a
few LLVM instructions: a splat and `llvm.fma` for the float multiply-add; a load, an add and a
store for `vstore_add_*`; for `vmadd_pairs`, `vpmaddwd` on x86 (one on AVX-512BW, two on AVX2,
chosen from this CPU's features; LLVM fuses it with the add into VNNI's `vpdpwssd` where the CPU
has it), else portable LLVM IR (sign-extend, multiply, add the pairs), which is correct on every
CPU and fast where LLVM matches it. `vdot_u8s8` is VNNI's `vpdpbusd` (four uint8 x int8 products
per int32 lane, added into the lane) on AVX-512 VNNI, two 256-bit `vpdpbusd` on AVX-VNNI, else
portable IR (widen, multiply, add the fours).
MINITORCH_SIMD=avx512|avx2|generic forces vmadd_pairs's flavour, MINITORCH_U8S8=avx512vnni|avxvnni|generic
vdot_u8s8's (the tests run each). `vector_target()` describes the vector registers of the CPU Numba
compiles for: how many there are and how many one f32x16 takes (lesson 06 shapes its micro-kernel
with it).
"""
import os

import llvmlite.binding as llvm_binding
import numba
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.core.extending import intrinsic, models, register_model

LANES = 16
# Numba 0.62 (Intel Macs' last wheels) reports a raised exception's run-time arguments wrongly in
# these functions; there the IndexError names the operation only.
VALUES_IN_ERRORS = tuple(int(v) for v in numba.__version__.split(".")[:2]) >= (0, 68)


class F32x16(types.Type):
    """16 float32 lanes in registers."""

    def __init__(self):
        super().__init__(name="f32x16")


class I32x16(types.Type):
    """16 int32 lanes in registers."""

    def __init__(self):
        super().__init__(name="i32x16")


f32x16, i32x16 = F32x16(), I32x16()
_I32, _I16, _F32 = ir.IntType(32), ir.IntType(16), ir.FloatType()
_VF32, _VI32, _VI16 = ir.VectorType(_F32, LANES), ir.VectorType(_I32, LANES), ir.VectorType(_I16, 2 * LANES)


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF32)


@register_model(I32x16)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI32)


def madd_flavour() -> str:
    """How vmadd_pairs is compiled here: 'avx512', 'avx2' or 'generic' (MINITORCH_SIMD overrides)."""
    forced = os.environ.get("MINITORCH_SIMD", "")
    if forced:
        if forced not in ("avx512", "avx2", "generic"):
            raise ValueError(f"MINITORCH_SIMD must be avx512, avx2 or generic, got {forced!r}")
        return forced
    if numba.config.CPU_NAME:  # Numba compiles for another CPU: no host-only instructions
        return "generic"
    features = llvm_binding.get_host_cpu_features()
    if features.get("avx512bw", False):
        return "avx512"
    return "avx2" if features.get("avx2", False) else "generic"


def _need_array(what: str, ary, dtype) -> None:
    if not (isinstance(ary, types.Array) and ary.ndim == 1 and ary.layout == "C" and ary.dtype == dtype):
        raise TypingError(f"{what}: needs a 1-D C-contiguous {dtype} array, got {ary}")


def _need_int(what: str, name: str, value) -> None:
    if not isinstance(value, types.Integer):
        raise TypingError(f"{what}: {name} must be an integer, got {value}")


def _address(context, builder, aryty, ary, index, vector):
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [index]), vector.as_pointer())


def _splat(builder, value, vector):
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, vector.count), [0] * vector.count))


@intrinsic
def vzero_f32(typingctx):
    """f32x16 of zeros."""
    return f32x16(), lambda context, builder, sig, args: ir.Constant(_VF32, [0.0] * LANES)


@intrinsic
def vzero_i32(typingctx):
    """i32x16 of zeros."""
    return i32x16(), lambda context, builder, sig, args: ir.Constant(_VI32, [0] * LANES)


@intrinsic
def _vload_f32(typingctx, x, i):
    _need_array("vload_f32", x, types.float32)
    _need_int("vload_f32", "i", i)

    def codegen(context, builder, sig, args):
        return builder.load(_address(context, builder, sig.args[0], args[0], args[1], _VF32), align=4)
    return f32x16(x, i), codegen


@intrinsic
def vfma_bcast(typingctx, acc, b, s):
    """acc + b * s, lane by lane, with one rounding (a fused multiply-add); s a float scalar (a float64
    is rounded to float32 first)."""
    if acc != f32x16 or b != f32x16 or not isinstance(s, types.Float):
        raise TypingError(f"vfma_bcast(acc, b, s): acc and b f32x16, s a float, got {acc}, {b}, {s}")

    def codegen(context, builder, sig, args):
        acc_v, b_v, s_v = args
        s_v = context.cast(builder, s_v, sig.args[2], types.float32)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF32, [_VF32] * 3), "llvm.fma.v16f32")
        return builder.call(fma, [b_v, _splat(builder, s_v, _VF32), acc_v])
    return f32x16(acc, b, s), codegen


@intrinsic
def _vstore_add_f32(typingctx, acc, y, i):
    _need_array("vstore_add_f32", y, types.float32)
    _need_int("vstore_add_f32", "i", i)

    def codegen(context, builder, sig, args):
        p = _address(context, builder, sig.args[1], args[1], args[2], _VF32)
        builder.store(builder.fadd(builder.load(p, align=4), args[0]), p, align=4)
        return context.get_dummy_value()
    return types.none(acc, y, i), codegen


def _pair_products(builder, a16, b16):
    """<16 x i32>: a16[2l]*b16[2l] + a16[2l+1]*b16[2l+1] for <32 x i16> a16, b16 (int32 sums)."""
    flavour = madd_flavour()
    if flavour == "avx512":
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI32, [_VI16, _VI16]),
                                           "llvm.x86.avx512.pmaddw.d.512")
        return builder.call(f, [a16, b16])
    if flavour == "avx2":
        half16, half32 = ir.VectorType(_I16, LANES), ir.VectorType(_I32, LANES // 2)
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(half32, [half16, half16]),
                                           "llvm.x86.avx2.pmadd.wd")
        lo, hi = ir.Constant(ir.VectorType(_I32, LANES), list(range(LANES))), \
            ir.Constant(ir.VectorType(_I32, LANES), list(range(LANES, 2 * LANES)))
        parts = [builder.call(f, [builder.shuffle_vector(a16, a16, ix), builder.shuffle_vector(b16, b16, ix)])
                 for ix in (lo, hi)]
        return builder.shuffle_vector(parts[0], parts[1], ir.Constant(_VI32, list(range(LANES))))
    even = ir.Constant(_VI32, list(range(0, 2 * LANES, 2)))
    odd = ir.Constant(_VI32, list(range(1, 2 * LANES, 2)))
    ext = [builder.sext(builder.shuffle_vector(v, v, ix), _VI32) for v in (a16, b16) for ix in (even, odd)]
    return builder.add(builder.mul(ext[0], ext[2]), builder.mul(ext[1], ext[3]))


@intrinsic
def _vmadd_pairs(typingctx, acc, w, p, i):
    _need_array("vmadd_pairs", p, types.int16)
    _need_int("vmadd_pairs", "i", i)
    if acc != i32x16 or not isinstance(w, types.Integer):
        raise TypingError(f"vmadd_pairs(acc, w, p, i): acc an i32x16, w an int32 word, got {acc}, {w}")

    def codegen(context, builder, sig, args):
        acc_v, w_v, p_v, i_v = args
        if w_v.type.width > 32:
            w_v = builder.trunc(w_v, _I32)
        elif w_v.type.width < 32:
            w_v = builder.sext(w_v, _I32)
        a16 = builder.bitcast(_splat(builder, w_v, _VI32), _VI16)  # the pair (lo, hi) in every lane
        b16 = builder.load(_address(context, builder, sig.args[2], p_v, i_v, _VI16), align=2)
        return builder.add(acc_v, _pair_products(builder, a16, b16))
    return i32x16(acc, w, p, i), codegen


def target_features() -> set[str]:
    """The CPU features Numba compiles for (NUMBA_CPU_FEATURES where set, else this CPU's), as LLVM names
    them: 'avx2', 'fma', 'avx512f', 'avx512vnni', 'neon', ..."""
    flat = numba.config.CPU_FEATURES if numba.config.CPU_FEATURES is not None else \
        llvm_binding.get_host_cpu_features().flatten()
    return {f[1:] for f in flat.split(",") if f.startswith("+")}


def vector_target() -> dict:
    """The vector registers of the CPU Numba compiles for, as a micro-kernel sees them: {'isa': 'avx512' |
    'avx2' | 'avx' | 'sse' | 'neon', 'registers': how many, 'per_vector': registers one f32x16 takes,
    'broadcast_registers': registers an FMA needs for the broadcast scalars of A beside its operands}."""
    key = (numba.config.CPU_NAME, numba.config.CPU_FEATURES)
    if key not in _TARGETS:
        _TARGETS[key] = _vector_target()
    return dict(_TARGETS[key])


_TARGETS: dict = {}


def _vector_target() -> dict:
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):  # 32 q registers; A's scalars come in a q register
        return {"isa": "neon", "registers": 32, "per_vector": 4, "broadcast_registers": 2}
    feats = target_features()
    if "avx512f" in feats:  # 32 zmm; vbroadcastss into a register when a scalar feeds two FMAs
        return {"isa": "avx512", "registers": 32, "per_vector": 1, "broadcast_registers": 1}
    if "avx" in feats:  # 16 ymm; vbroadcastss into a register
        return {"isa": "avx2" if {"avx2", "fma"} <= feats else "avx", "registers": 16, "per_vector": 2,
                "broadcast_registers": 1}
    return {"isa": "sse", "registers": 16, "per_vector": 4, "broadcast_registers": 1}


def u8s8_flavour() -> str:
    """How vdot_u8s8 is compiled here: 'avx512vnni', 'avxvnni' or 'generic' (MINITORCH_U8S8 overrides)."""
    forced = os.environ.get("MINITORCH_U8S8", "")
    if forced:
        if forced not in ("avx512vnni", "avxvnni", "generic"):
            raise ValueError(f"MINITORCH_U8S8 must be avx512vnni, avxvnni or generic, got {forced!r}")
        return forced
    if numba.config.CPU_NAME:  # Numba compiles for another CPU: no host-only instructions
        return "generic"
    features = llvm_binding.get_host_cpu_features()
    if features.get("avx512vnni", False) and features.get("avx512f", False):
        return "avx512vnni"
    return "avxvnni" if features.get("avxvnni", False) else "generic"


_VI8 = ir.VectorType(ir.IntType(8), 4 * LANES)


def _u8s8_dot(builder, a32, b32):
    """<16 x i32>: sum over t < 4 of u8(byte t of a32[l]) * s8(byte t of b32[l]), for <16 x i32> a32, b32."""
    flavour = u8s8_flavour()
    if flavour == "avx512vnni":
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI32, [_VI32] * 3),
                                           "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(f, [ir.Constant(_VI32, [0] * LANES), a32, b32])
    if flavour == "avxvnni":
        half = ir.VectorType(_I32, LANES // 2)
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(half, [half] * 3),
                                           "llvm.x86.avx512.vpdpbusd.256")
        parts = []
        for ix in (list(range(LANES // 2)), list(range(LANES // 2, LANES))):
            pick = ir.Constant(ir.VectorType(_I32, LANES // 2), ix)
            parts.append(builder.call(f, [ir.Constant(half, [0] * (LANES // 2)),
                                          builder.shuffle_vector(a32, a32, pick), builder.shuffle_vector(b32, b32, pick)]))
        return builder.shuffle_vector(parts[0], parts[1], ir.Constant(_VI32, list(range(LANES))))
    wide = ir.VectorType(_I32, 4 * LANES)
    prod = builder.mul(builder.zext(builder.bitcast(a32, _VI8), wide), builder.sext(builder.bitcast(b32, _VI8), wide))
    quarters = [builder.shuffle_vector(prod, prod, ir.Constant(_VI32, [4 * l + t for l in range(LANES)])) for t in range(4)]
    return builder.add(builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3]))


@intrinsic
def _vdot_u8s8(typingctx, acc, w, p, i):
    _need_array("vdot_u8s8", p, types.int32)
    _need_int("vdot_u8s8", "i", i)
    if acc != i32x16 or not isinstance(w, types.Integer):
        raise TypingError(f"vdot_u8s8(acc, w, p, i): acc an i32x16, w an int32 word, got {acc}, {w}")

    def codegen(context, builder, sig, args):
        acc_v, w_v, p_v, i_v = args
        if w_v.type.width > 32:
            w_v = builder.trunc(w_v, _I32)
        elif w_v.type.width < 32:
            w_v = builder.zext(w_v, _I32)
        a32 = _splat(builder, w_v, _VI32)  # the four uint8 of A in every lane
        b32 = builder.load(_address(context, builder, sig.args[2], p_v, i_v, _VI32), align=4)
        if u8s8_flavour() == "avx512vnni":  # the add is the instruction's own: acc as its first operand
            f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI32, [_VI32] * 3),
                                               "llvm.x86.avx512.vpdpbusd.512")
            return builder.call(f, [acc_v, a32, b32])
        return builder.add(acc_v, _u8s8_dot(builder, a32, b32))
    return i32x16(acc, w, p, i), codegen


@intrinsic
def _vstore_add_i32(typingctx, acc, y, i):
    _need_array("vstore_add_i32", y, types.int32)
    _need_int("vstore_add_i32", "i", i)

    def codegen(context, builder, sig, args):
        p = _address(context, builder, sig.args[1], args[1], args[2], _VI32)
        builder.store(builder.add(builder.load(p, align=4), args[0]), p, align=4)
        return context.get_dummy_value()
    return types.none(acc, y, i), codegen


@njit
def vload_f32(x, i):
    """f32x16 of x[i:i+16] (x 1-D C-contiguous float32)."""
    if i < 0 or i > x.size - LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vload_f32: vector lanes outside the array (first index, lanes, array size):", i,
                             LANES, x.size)
        raise IndexError("vload_f32: vector lanes outside the array")
    return _vload_f32(x, i)


@njit
def vstore_add_f32(acc, y, i):
    """y[i:i+16] += acc (y 1-D C-contiguous float32)."""
    if i < 0 or i > y.size - LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vstore_add_f32: vector lanes outside the array (first index, lanes, array size):", i,
                             LANES, y.size)
        raise IndexError("vstore_add_f32: vector lanes outside the array")
    _vstore_add_f32(acc, y, i)


@njit
def vmadd_pairs(acc, w, p, i):
    """acc[l] + a0*p[i+2l] + a1*p[i+2l+1] for l < 16, in int32: w is an int32 word holding two int16
    (a0 in its low half, a1 in its high half: int16 array [a0, a1] viewed as int32), p a 1-D
    C-contiguous int16 array holding 16 pairs from index i. One `vpmaddwd` on AVX-512, two on AVX2."""
    if i < 0 or i > p.size - 2 * LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vmadd_pairs: vector lanes outside the array (first index, lanes, array size):", i,
                             2 * LANES, p.size)
        raise IndexError("vmadd_pairs: vector lanes outside the array")
    return _vmadd_pairs(acc, w, p, i)


@njit
def vdot_u8s8(acc, w, p, i):
    """acc[l] + sum over t < 4 of u8(byte t of w) * s8(byte t of p[i + l]) for l < 16, in int32 (wrapping
    modulo 2**32, as the instruction does): w an int32 word holding four uint8 of A (little-endian: byte t
    is the t-th), broadcast to every lane; p a 1-D C-contiguous int32 array whose words each hold four
    int8 of B, 16 words from index i. One `vpdpbusd` on AVX-512 VNNI, two on AVX-VNNI."""
    if i < 0 or i > p.size - LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vdot_u8s8: vector lanes outside the array (first index, lanes, array size):", i,
                             LANES, p.size)
        raise IndexError("vdot_u8s8: vector lanes outside the array")
    return _vdot_u8s8(acc, w, p, i)


@njit
def vstore_add_i32(acc, y, i):
    """y[i:i+16] += acc (y 1-D C-contiguous int32)."""
    if i < 0 or i > y.size - LANES:
        if VALUES_IN_ERRORS:
            raise IndexError("vstore_add_i32: vector lanes outside the array (first index, lanes, array size):", i,
                             LANES, y.size)
        raise IndexError("vstore_add_i32: vector lanes outside the array")
    _vstore_add_i32(acc, y, i)


from minitorch.checks import validate_public  # noqa: E402

validate_public(globals(), {
})
