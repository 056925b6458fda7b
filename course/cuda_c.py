"""CUDA C on machines without a GPU: compile to PTX with NVRTC, and run kernels on the CPU.

compile_ptx(source)             NVRTC (CuPy's binding) -> PTX text; CudaCompileError with the log.
                                The include path has CUDA's headers (cuda_fp16.h, cooperative_groups,
                                mma.h) and a pre-included header giving FLT_MAX, INFINITY, uint.
ptx_stats(ptx)                  instruction counts that show a kernel's structure (FMAs, shared and
                                vector loads, barriers, shuffles, tensor-core MMAs, shared bytes).
kernel_params(source, name)     the parameters of `__global__ void name(...)` (`name<args>` for a
                                template kernel).
check_args(params, args, name)  clear errors for wrong argument types before a launch.
emulate(source, name, grid, block, args, shared_bytes=0)
                                run the kernel on the CPU and return what it printed. The source is
                                compiled with g++ against course/cuda_prelude.h, instrumented so that
                                every load and store is checked: any byte outside an argument array,
                                a misaligned vector access, an out-of-bounds shared-memory index, and
                                a shared-memory race (two threads, one writing, same barrier interval,
                                nothing ordering them) are reported with the thread and the kernel.cu
                                line. The kernel runs under two schedules (warps, lanes and blocks
                                forward, then in reverse); different results are reported as a race.
run_kernel(...)                 the same, returning an EmulatorRun (output, access counts, notes,
                                optional per-thread profile).
raw_module(source, names)       on a GPU: cupy.RawModule compiled with the same include path and
                                pre-included header as compile_ptx.

The emulator checks semantics (indexing, guards, barriers, races, warp operations), not speed.
Constructs it cannot run (inline PTX, grid-wide sync, textures, async copies) raise
EmulatorUnsupported: such a kernel can only be graded on a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from course.notebook import SkipCell

HERE = Path(__file__).resolve().parent
PRELUDE = HERE / "cuda_prelude.h"
RUNTIME = HERE / "cuda_emu_runtime.cpp"
EMU_INCLUDE = HERE / "cuda_include" / "emu"
NVRTC_INCLUDE = HERE / "cuda_include" / "nvrtc"
NVRTC_PRELUDE = NVRTC_INCLUDE / "mt_nvrtc.h"

SCHEDULES = ("forward", "reverse", "shuffle")
DEFAULT_SCHEDULES = ("forward", "reverse")


class CudaCompileError(RuntimeError):
    """The CUDA C source did not compile; the message holds the compiler's log."""


class KernelError(RuntimeError):
    """An emulated kernel crashed, hung, deadlocked, raced or accessed memory out of bounds."""


class EmulatorUnsupported(KernelError):
    """The kernel uses something the CPU emulator cannot run; it can only be graded on a GPU."""


class NvrtcUnavailable(SkipCell, RuntimeError):
    """NVRTC cannot compile here (no CuPy, or no NVRTC wheel for this platform, e.g. macOS): the PTX
    checks cannot run. Tests that meet it are skipped with its message (tests/conftest.py), a
    notebook cell that meets it skips saying why (a SkipCell); the CPU emulator still runs the kernels."""


# ---------------------------------------------------------------------------------------------
# NVRTC

def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locs = list(spec.submodule_search_locations or [])
    return Path(locs[0]) if locs else (Path(spec.origin).parent if spec.origin else None)


def nvrtc_unavailable() -> str | None:
    """Why NVRTC cannot compile CUDA C here, or None if it can. MT_NO_NVRTC=1 acts as if it were
    missing (how the fallback is tested on a machine that has it)."""
    if os.environ.get("MT_NO_NVRTC") == "1":
        return "NVRTC is switched off (MT_NO_NVRTC=1): the PTX checks skip; the CPU emulator still grades the kernels"
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # no CuPy, or CuPy without the NVRTC library
        what = "CuPy is not installed" if isinstance(exc, ImportError) else f"{type(exc).__name__}: {str(exc).strip()[:200]}"
        return (f"NVRTC cannot compile here ({what}); its wheels (CuPy, nvidia-cuda-nvrtc-cu12: the `gpu` extra) "
                "exist for Linux only: the PTX checks skip; the CPU emulator still grades the kernels")
    return None


def _nvrtc_major() -> int | None:
    try:
        from cupy_backends.cuda.libs import nvrtc

        return int(nvrtc.getVersion()[0])
    except Exception:  # no CuPy or no NVRTC library
        return None


def _header_major(include: Path) -> int | None:
    """The CUDA major version of a header directory (from its cuda.h), None if it does not say."""
    try:
        m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", (include / "cuda.h").read_text(errors="replace"))
    except OSError:
        return None
    return int(m.group(1)) // 1000 if m else None


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories with CUDA's device headers for NVRTC, of the same CUDA major version as NVRTC,
    best first: a CUDA toolkit (CUDA_PATH, CUDA_HOME, /usr/local/cuda), the NVIDIA pip wheels
    (nvidia-cuda-runtime-cu12 for cuda_fp16.h and cooperative_groups, nvidia-cuda-nvcc-cu12 for
    mma.h's crt/ headers; CUDA 13's nvidia/cu13), and CuPy's libcudacxx (<nv/target>, needed by
    cooperative_groups). Headers of another major version than NVRTC's do not compile with it."""
    major = _nvrtc_major()
    found: list[tuple[Path, int | None]] = []
    toolkits = [Path(os.environ[env]) / "include" for env in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(env)]
    for inc in [*toolkits, Path("/usr/local/cuda/include")]:
        ver = _header_major(inc)
        found += [(inc, ver), (inc / "cccl", ver)]  # CUDA 13 keeps libcu++ (<nv/target>) in include/cccl
    nvidia = _package_dir("nvidia")
    if nvidia is not None:
        rt12 = _header_major(nvidia / "cuda_runtime" / "include") or 12
        for sub, ver in (("cu13/include", 13), ("cu13/include/cccl", 13), ("cuda_runtime/include", rt12),
                         ("cuda_nvcc/include", rt12), ("cuda_cccl/include", rt12)):
            found.append((nvidia / sub, ver))
    cupy = _package_dir("cupy")
    if cupy is not None:
        found.append((cupy / "_core" / "include" / "cupy" / "_cccl" / "libcudacxx", None))
    out: list[str] = []
    for d, ver in found:
        if d.is_dir() and str(d) not in out and (ver is None or major is None or ver == major):
            out.append(str(d))
    return tuple(out)


def nvrtc_options(arch: str | None = None) -> tuple[str, ...]:
    """The NVRTC options every course kernel is compiled with (compile_ptx and the GPU path):
    C++17, CUDA's header directories, and the pre-included mt_nvrtc.h (FLT_MAX, INFINITY, uint)."""
    opts = ["-std=c++17", *(f"-I{d}" for d in cuda_include_dirs()), f"-I{NVRTC_INCLUDE}",
            f"--pre-include={NVRTC_PRELUDE}"]
    if arch:
        opts.insert(0, f"-arch={arch}")
    return tuple(opts)


def compile_ptx(source: str, arch: str = "compute_80", options: Sequence[str] = (),
                name_expressions: Sequence[str] = ()) -> str:
    """PTX for `source` (CUDA C) compiled by NVRTC for virtual architecture `arch`. No GPU needed.

    name_expressions: template kernels to instantiate, e.g. ["sgemm<128, 8>"] (a template has no
    code until it is instantiated). Raises NvrtcUnavailable where NVRTC is not installed."""
    why = nvrtc_unavailable()
    if why is not None:
        raise NvrtcUnavailable(why)
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "kernel.cu", [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, [*nvrtc_options(arch), *options])
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            raise CudaCompileError(f"CUDA C did not compile (NVRTC):\n{log.strip()}") from None
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@dataclass
class PtxStats:
    fma_f32: int        # fma.rn.f32 instructions (static count in the code, not executed)
    ld_shared: int      # loads from shared memory (any width)
    st_shared: int      # stores to shared memory
    ld_global: int      # loads from global memory (any width)
    bar_sync: int       # barriers (__syncthreads)
    shfl: int           # warp shuffles
    shared_bytes: int   # statically allocated shared memory per block
    ld_global_v4: int = 0   # 16-byte vector loads from global memory (float4, int4; ld.global(.nc).v4)
    ld_global_v2: int = 0   # 8-byte vector loads from global memory
    st_global_v4: int = 0   # 16-byte vector stores to global memory
    ld_shared_v4: int = 0   # 16-byte vector loads from shared memory
    mma: int = 0            # tensor-core instructions (wmma.mma / mma.sync)
    wmma_load: int = 0      # wmma.load (tensor-core fragment loads)
    cp_async: int = 0       # asynchronous global->shared copies (cp.async)
    vote: int = 0           # warp votes (vote.sync: __ballot/__any/__all)
    redux: int = 0          # warp reductions (redux.sync: __reduce_*_sync)
    dp4a: int = 0           # 4-way int8 dot products (dp4a)
    atom: int = 0           # atomics (atom., red.)
    shared_arrays: int = 0  # number of statically declared __shared__ arrays
    local_bytes: int = 0    # per-thread local memory (arrays the compiler could not keep in registers)


def ptx_stats(ptx: str) -> PtxStats:
    """Count the instructions that reveal a kernel's structure in its PTX."""
    def count(pattern: str) -> int:
        return len(re.findall(pattern, ptx, flags=re.M))
    shared = [int(m) for m in re.findall(r"^\s*\.shared\s+\.align\s+\d+\s+\.b8\s+[\w$]+\[(\d+)\]", ptx, flags=re.M)]
    local = sum(int(m) for m in re.findall(r"^\s*\.local\s+\.align\s+\d+\s+\.b8\s+[\w$]+\[(\d+)\]", ptx, flags=re.M))
    return PtxStats(
        fma_f32=count(r"\bfma\.rn\.f32\b"),
        ld_shared=count(r"\bld\.shared\."),
        st_shared=count(r"\bst\.shared\."),
        ld_global=count(r"\bld\.global\."),
        bar_sync=count(r"\b(?:bar\.sync|barrier\.sync)\b"),
        shfl=count(r"\bshfl\.sync\."),
        shared_bytes=sum(shared),
        ld_global_v4=count(r"\bld\.global(?:\.\w+)*?\.v4\."),
        ld_global_v2=count(r"\bld\.global(?:\.\w+)*?\.v2\."),
        st_global_v4=count(r"\bst\.global(?:\.\w+)*?\.v4\."),
        ld_shared_v4=count(r"\bld\.shared(?:\.\w+)*?\.v4\."),
        mma=count(r"\b(?:wmma\.mma|mma)\.sync\b"),
        wmma_load=count(r"\bwmma\.load\."),
        cp_async=count(r"\bcp\.async\.(?:ca|cg)\b"),
        vote=count(r"\bvote\.sync\."),
        redux=count(r"\bredux\.sync\."),
        dp4a=count(r"\bdp4a\."),
        atom=count(r"\b(?:atom|red)\.(?:global|shared|add|min|max|cas|exch|and|or|xor|inc|dec)"),
        shared_arrays=len(shared),
        local_bytes=local,
    )


# ---------------------------------------------------------------------------------------------
# Kernel signatures and argument checks

_CTYPES = {
    "float": np.float32, "double": np.float64, "int": np.int32, "unsigned int": np.uint32,
    "unsigned": np.uint32, "uint": np.uint32, "long long": np.int64, "long long int": np.int64, "long": np.int64,
    "unsigned long long": np.uint64, "unsigned long long int": np.uint64, "unsigned long": np.uint64,
    "size_t": np.uint64, "int64_t": np.int64, "int32_t": np.int32, "uint32_t": np.uint32, "uint64_t": np.uint64,
    "short": np.int16, "unsigned short": np.uint16, "int16_t": np.int16, "uint16_t": np.uint16,
    "char": np.int8, "signed char": np.int8, "unsigned char": np.uint8, "int8_t": np.int8, "uint8_t": np.uint8,
    "bool": np.bool_, "__half": np.float16, "half": np.float16,
}
# Vector types, usable as pointer parameters: an array of the component dtype, a multiple of the width.
_VECTORS = {f"{base}{n}": (comp, n) for base, comp in [
    ("float", np.float32), ("double", np.float64), ("int", np.int32), ("uint", np.uint32), ("char", np.int8),
    ("uchar", np.uint8), ("short", np.int16), ("ushort", np.uint16), ("longlong", np.int64),
    ("ulonglong", np.uint64)] for n in (1, 2, 3, 4)}
_VECTORS.update({"__half2": (np.float16, 2), "half2": (np.float16, 2)})
_QUALIFIERS = {"const", "volatile", "__restrict__", "restrict", "__restrict", "__grid_constant__"}


@dataclass
class Param:
    name: str
    ctype: str          # base C type, e.g. "float" (template parameters substituted)
    pointer: bool
    dtype: np.dtype
    vec: int = 1        # components per element for vector pointer types (float4* -> 4)
    default: str | None = None  # the default value, if the parameter has one

    def __str__(self) -> str:
        return f"{self.ctype}{'*' if self.pointer else ''} {self.name}"


def _strip_comments(source: str) -> str:
    """`source` with comments replaced by spaces (newlines kept, so offsets and lines still match)."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"', lambda m: m.group(0) if m.group(0).startswith('"')
                  else blank(m), source, flags=re.S)


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside (), [], {} and <>."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _split_name(name: str) -> tuple[str, list[str]]:
    """'sgemm<128, float>' -> ('sgemm', ['128', 'float'])."""
    m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*(?:<(.*)>)?\s*", name)
    if not m:
        raise ValueError(f"kernel name {name!r}: expected `name` or `name<template arguments>`")
    return m.group(1), [a.strip() for a in _split_top(m.group(2))] if m.group(2) else []


_KERNEL_RE = (r"(?:template\s*<(?P<tp>[^{};]*?)>\s*)?(?:extern\s+\"C\"\s+)?(?:static\s+)?__global__\s+"
              r"(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?")


def kernel_params(source: str, name: str) -> list[Param]:
    """The parameters of `__global__ void name(...)` in `source`. For a template kernel, `name`
    carries the template arguments (`"sgemm<128, float>"`), which are substituted into the types.

    ValueError if there is no such kernel or a parameter type is not a scalar or a pointer."""
    code = _strip_comments(source)
    base, targs = _split_name(name)
    m = re.search(_KERNEL_RE + re.escape(base) + r"\s*\(", code)
    if not m:
        found = re.findall(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
                           r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)", code)
        raise ValueError(f"no kernel `__global__ void {base}(...)` in the source; kernels found: {found or 'none'}")
    depth, i = 1, m.end()
    while i < len(code) and depth:
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        i += 1
    raw_params = code[m.end():i - 1]
    subst: dict[str, str] = {}
    if m.group("tp") is not None:
        tparams = [p.strip() for p in _split_top(m.group("tp")) if p.strip()]
        if len(targs) > len(tparams):
            raise ValueError(f"kernel {base} has {len(tparams)} template parameters, {name!r} gives {len(targs)}")
        for k, tp in enumerate(tparams):
            decl, _, default = tp.partition("=")
            pname = re.findall(r"[A-Za-z_]\w*", decl)[-1]
            value = targs[k] if k < len(targs) else default.strip()
            if not value:
                names = ", ".join(re.findall(r"[A-Za-z_]\w*", tp2.partition("=")[0])[-1] for tp2 in tparams)
                raise ValueError(f"kernel {base} is a template: name it with its template arguments, "
                                 f"e.g. {base}<{names}> with values for {names}")
            subst[pname] = value
    elif targs:
        raise ValueError(f"kernel {base} is not a template, but the name {name!r} gives template arguments")
    params = []
    for raw in filter(None, (p.strip() for p in _split_top(raw_params))):
        decl, eq, default = raw.partition("=")
        for k, v in subst.items():
            decl = re.sub(rf"\b{re.escape(k)}\b", v, decl)
        pointer = "*" in decl
        words = re.findall(r"[A-Za-z_]\w*", decl.replace("*", " "))
        if len(words) < 2:
            raise ValueError(f"kernel {base}: cannot read parameter {raw!r} (type and name needed)")
        pname = words[-1]
        ctype = " ".join(w for w in words[:-1] if w not in _QUALIFIERS)
        if decl.count("*") > 1 or "&" in decl:
            raise ValueError(f"kernel {base}: parameter {raw!r}: only scalars and pointers to them are supported")
        if pointer and ctype in _VECTORS:
            comp, n = _VECTORS[ctype]
            params.append(Param(pname, ctype, True, np.dtype(comp), n, default.strip() if eq else None))
            continue
        if ctype not in _CTYPES:
            raise ValueError(f"kernel {base}: parameter {raw!r} has type {ctype!r}; supported: scalars "
                             f"{sorted(_CTYPES)}, and pointers to those or to vector types (float4*, ...)")
        params.append(Param(pname, ctype, pointer, np.dtype(_CTYPES[ctype]), 1, default.strip() if eq else None))
    return params


def check_args(params: Sequence[Param], args: Sequence[Any], kernel: str) -> None:
    """Raise TypeError/ValueError naming the parameter if `args` do not fit `params`.

    A CUDA launch checks nothing: a Python int is passed as 8 bytes to an `int` parameter, a float64
    array is read as float32 garbage, a transposed view is read in the wrong order. Trailing
    parameters with default values may be left out; None passes a null pointer."""
    required = len(params)
    while required and params[required - 1].default is not None:
        required -= 1
    if not required <= len(args) <= len(params):
        n = f"{len(params)}" if required == len(params) else f"{required} to {len(params)}"
        raise TypeError(f"kernel {kernel} takes {n} arguments ({', '.join(map(str, params))}), got {len(args)}")
    for p, a in zip(params, args):
        if p.pointer:
            if a is None:
                continue
            if not hasattr(a, "dtype") or not hasattr(a, "shape") or np.isscalar(a):
                raise TypeError(f"kernel {kernel}: argument {p.name} ({p}) must be an array, got {type(a).__name__}")
            if np.dtype(a.dtype) != p.dtype:
                raise TypeError(f"kernel {kernel}: argument {p.name} ({p}) needs dtype {p.dtype}, got {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError(f"kernel {kernel}: argument {p.name} must be C-contiguous "
                                 f"(got a strided view of shape {a.shape}); pass xp.ascontiguousarray(...)")
            if p.vec > 1 and a.size % p.vec:
                raise ValueError(f"kernel {kernel}: argument {p.name} ({p}) reads {p.vec} {p.dtype} per element; "
                                 f"an array of {a.size} values is not a whole number of {p.ctype}")
        else:
            if not isinstance(a, np.generic) or np.dtype(type(a)) != p.dtype:
                got = f"np.{type(a).__name__}" if isinstance(a, np.generic) else f"Python {type(a).__name__}"
                raise TypeError(f"kernel {kernel}: argument {p.name} ({p}) needs np.{p.dtype}(...), got {got} "
                                f"{a!r} (CUDA would reinterpret its bytes)")


# ---------------------------------------------------------------------------------------------
# Source preparation for the emulator: unsupported constructs, __shared__ and vector-pointer rewrites

_UNSUPPORTED = [
    (r"\basm\s*(?:volatile\s*)?\(|\b__asm__\b|\b__asm\b", "inline PTX (asm(...))"),
    (r"\bthis_grid\s*\(|\bgrid_group\b|\bthis_multi_grid\s*\(", "grid-wide cooperative groups (this_grid)"),
    (r"\btex[123]D\w*\s*\(|\bcudaTextureObject_t\b|\bsurf[123]D\w*\s*\(", "textures and surfaces"),
    (r"(?<!__pipeline_)\bmemcpy_async\s*\(|\bcuda::pipeline\b|\bcuda::barrier\b",
     "the C++ asynchronous-copy API (cuda::memcpy_async, cuda::pipeline; the __pipeline_* primitives are emulated)"),
    (r"<<<", "launching kernels from a kernel (dynamic parallelism)"),
    (r"#\s*include\s*<cuda/", "libcu++ headers (<cuda/...>)"),
    (r"\b__nv_bfloat16\b|cuda_bf16\.h|\b__nv_fp8", "bfloat16 and fp8 types"),
]

_VEC_TYPES = ("float2|float4|double2|double4|int2|int4|uint2|uint4|longlong2|ulonglong2|longlong4|ulonglong4|"
              "short2|short4|ushort2|ushort4|char2|char4|uchar2|uchar4|__half2|half2")


def unsupported_by_emulator(source: str) -> str | None:
    """What in `source` the CPU emulator cannot run, or None."""
    code = _strip_comments(source)
    for pattern, what in _UNSUPPORTED:
        if re.search(pattern, code):
            return what
    return None


def _rewrite_vector_casts(code: str) -> str:
    quals = r"((?:(?:const|volatile)\s+)*)"
    code = re.sub(rf"\b(?:reinterpret_cast|static_cast)\s*<\s*{quals}({_VEC_TYPES})((?:\s+(?:const|volatile))*)\s*\*\s*>",
                  lambda m: f"mt::vec_cast<{m.group(1)}{m.group(2)}{m.group(3)}>", code)
    return re.sub(rf"\(\s*{quals}({_VEC_TYPES})((?:\s+(?:const|volatile))*)\s*\*\s*\)(?=\s*[\w&(*])",
                  lambda m: f"(mt::vec_ptr<{m.group(1)}{m.group(2)}{m.group(3)}>)", code)


def _rewrite_shared(code: str) -> str:
    """Rewrite each `__shared__ T name[dims];` into a reference to memory from the emulator's shared
    arena (named, bounds-checked, race-checked), and `extern __shared__ T name[];` into a pointer to
    the dynamic shared memory. Line numbers are kept. Forms it cannot read are left to the
    prelude's fallback macro."""
    out, pos = [], 0
    for m in re.finditer(r"\b__shared__\b", code):
        if m.start() < pos:
            continue
        prefix = re.search(r"((?:\b(?:extern|static|volatile)\b|__align__\s*\(\s*\d+\s*\)|\s)*)$", code[pos:m.start()])
        start = pos + prefix.start(1)
        end = code.find(";", m.end())
        if end < 0:
            continue
        quals = code[start:m.start()]
        body = code[m.end():end]
        if "=" in body or "(" in re.sub(r"__align__\s*\(\s*\d+\s*\)|__attribute__\s*\(\(.*?\)\)", "", body) or "{" in body:
            continue
        align = 16
        for a in re.findall(r"__align__\s*\(\s*(\d+)\s*\)|aligned\s*\(\s*(\d+)\s*\)", quals + body):
            align = max(align, int(a[0] or a[1]))
        body = re.sub(r"__align__\s*\(\s*\d+\s*\)|__attribute__\s*\(\(.*?\)\)", " ", body)
        volatile = "volatile " if re.search(r"\bvolatile\b", quals) else ""
        parts = _split_top(body)
        first = re.fullmatch(r"\s*(.*?[\s*&>])\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)", parts[0], flags=re.S)
        if not first or not first.group(1).strip():
            continue
        ctype = volatile + " ".join(first.group(1).split())
        decls = [(first.group(2), first.group(3))]
        ok = True
        for extra in parts[1:]:
            d = re.fullmatch(r"\s*(\**)\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)", extra)
            if not d or d.group(1):
                ok = False
                break
            decls.append((d.group(2), d.group(3)))
        if not ok:
            continue
        extern = re.search(r"\bextern\b", quals) is not None
        repl = []
        for name, dims in decls:
            dims = "".join(dims.split())
            if extern:
                if dims != "[]":
                    ok = False
                    break
                repl.append(f"static {ctype}* const {name} = reinterpret_cast<{ctype}*>(MT_DYN_BASE);")
            else:
                t = f"mt_id<{ctype}{dims}>"
                decl = f"{ctype} {name}{dims}".replace("\\", "").replace('"', "")
                repl.append(f"static {t}& {name} = *reinterpret_cast<{t}*>(mt::shared_alloc_t<{t}>(\"{name}\", "
                            f"\"{decl}\", {align}));")
        if not ok:
            continue
        out.append(code[pos:start])
        out.append(" ".join(repl) + "\n" * code[start:end + 1].count("\n"))
        pos = end + 1
    out.append(code[pos:])
    return "".join(out)


def prepare_source(source: str) -> str:
    """The kernel source as the emulator compiles it (same lines; see _rewrite_shared/_vector_casts)."""
    what = unsupported_by_emulator(source)
    if what:
        raise EmulatorUnsupported(f"not supported by the CPU emulator: {what}. This kernel can only be run and "
                                  "graded on a GPU.")
    return _rewrite_vector_casts(_rewrite_shared(_strip_comments(source)))


# ---------------------------------------------------------------------------------------------
# Building the emulator

def compiler() -> str | None:
    """The C++ compiler the emulator uses: $CXX, else g++, else clang++; None if there is none.
    g++ and clang++ both work on Linux (.ci/run runs the emulator's tests with each)."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("g++") or shutil.which("clang++")


def emulator_unavailable() -> str | None:
    """Why the CPU emulator cannot run here, or None if it can."""
    if os.uname().sysname == "Darwin":
        return ("the CUDA C emulator runs on Linux only for now (it relies on ELF section symbols, addr2line and "
                "non-PIE executables); on a Mac use Linux (a VM or container, or Colab) for lessons 08-10's CUDA C")
    if compiler() is None:
        return "the CUDA emulator needs a C++ compiler (g++ or clang++), and none is installed"
    return None


def _dim3(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(t) <= 3 or not all(isinstance(x, (int, np.integer)) for x in t):
        raise TypeError(f"{what} must be an int or a tuple of 1-3 ints, got {v!r}")
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    if min(t) < 1:
        raise ValueError(f"{what} {v!r}: every dimension must be >= 1")
    return t  # type: ignore[return-value]


def _cache_dir() -> Path:
    d = Path(tempfile.gettempdir()) / f"minitorch-cuda-emu-{os.getuid()}"
    d.mkdir(exist_ok=True)
    return d


def _run_cxx(cmd: list[str], what: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        log = re.sub(r"\S*/(program|runtime)[\w.-]*\.cpp", r"\1.cpp", out.stderr)
        raise CudaCompileError(f"{what} did not compile for the CPU emulator ({Path(cmd[0]).name}):\n{log.strip()[:4000]}")


@functools.lru_cache(maxsize=None)
def _toolchain(cxx: str) -> tuple[tuple[str, ...], bool, str]:
    """(compile flags for kernels, whether access checks are compiled in, runtime object path)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    clang = "clang" in version
    base = ["-std=c++17", "-O1", "-gdwarf-4", "-w", "-fno-threadsafe-statics", f"-I{HERE}"]
    if clang:  # clang deletes a side-effect-free spin loop (C++ forward progress); a kernel that spins must hang
        base.append("-fno-finite-loops")
    probe_dir = _cache_dir()
    tsan = ["-fsanitize=thread"] + ([] if clang else ["--param=tsan-instrument-func-entry-exit=0"])
    probe = probe_dir / "probe.cpp"
    probe.write_text("int f(int* p) { return *p; }\n")
    ok = subprocess.run([cxx, *tsan, "-c", str(probe), "-o", str(probe.with_suffix(".o"))],
                        capture_output=True).returncode == 0
    key = hashlib.sha256((version + RUNTIME.read_text() + PRELUDE.read_text() + " ".join(base)).encode()).hexdigest()[:16]
    rt = probe_dir / f"runtime-{key}.o"
    if not rt.exists():
        tmp = rt.with_name(rt.name + f".tmp{os.getpid()}")
        _run_cxx([cxx, *base, "-c", str(RUNTIME), "-o", str(tmp)], "the emulator runtime")
        os.replace(tmp, rt)
    return tuple(base + (tsan if ok else [])), ok, str(rt)


def _include_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(EMU_INCLUDE.rglob("*.h")):
        h.update(p.read_bytes())
    return h.hexdigest()


def build_emulator(source: str, name: str) -> tuple[Path, list[Param]]:
    """Compile `source` with a launcher for kernel `name` into an emulator executable; cached by
    content hash. Returns (executable, parameters)."""
    params = kernel_params(source, name)
    prepared = prepare_source(source)
    why = emulator_unavailable()
    if why is not None:
        raise RuntimeError(why)
    cxx = compiler()
    flags, _, runtime = _toolchain(cxx)
    base, targs = _split_name(name)
    call = f"{base}<{', '.join(targs)}>" if targs else base
    args = [f"*({p.ctype}{'*' if p.pointer else ''}*)a[{i}]" for i, p in enumerate(params)]
    launcher = "\n".join([
        'extern "C" int mt_nargs;',
        'extern "C" void mt_launch_kernel(void** a) {',
        "    switch (mt_nargs) {",
        *(f"    case {k}: {call}({', '.join(args[:k])}); break;"
          for k in range(len(params) + 1) if all(p.default is not None for p in params[k:])),
        "    }",
        "}",
    ])
    program = (f'#include "cuda_prelude.h"\n#line 1 "kernel.cu"\n{prepared}\n'
               f'#line 1 "emulator_main.cpp"\n{launcher}\n')
    key = hashlib.sha256((cxx + " ".join(flags) + runtime + _include_hash() + program).encode()).hexdigest()[:20]
    exe = _cache_dir() / f"{re.sub(r'[^A-Za-z0-9_]', '_', base)}-{key}"
    if not exe.exists():
        src = exe.with_name(exe.name + "-program.cpp")
        src.write_text(program)
        obj = exe.with_name(exe.name + f".o{os.getpid()}")
        tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
        try:
            _run_cxx([cxx, *flags, f"-I{EMU_INCLUDE}", "-c", str(src), "-o", str(obj)], "the kernel")
            _run_cxx([cxx, "-no-pie", str(obj), runtime, "-o", str(tmp)], "the kernel (linking)")
            os.replace(tmp, exe)
        finally:
            for p in (obj, tmp):
                p.unlink(missing_ok=True)
    return exe, params


# ---------------------------------------------------------------------------------------------
# Running

@dataclass
class EmulatorRun:
    """What an emulated launch did (first schedule), besides updating the argument arrays."""
    stdout: str
    schedules: tuple[str, ...]
    reads: dict[str, int]           # global-memory loads per pointer argument (element accesses)
    writes: dict[str, int]          # global-memory stores (and atomics) per pointer argument
    shared_reads: int
    shared_writes: int
    barriers: int                   # __syncthreads() passed, summed over blocks
    warp_ops: int                   # warp collectives completed (shuffles, votes, __syncwarp), over warps
    notes: list[str] = field(default_factory=list)
    # profile=True: per-thread counts, arrays of shape (blocks, threads per block):
    # {"x": {"reads": ..., "writes": ..., "writer": ...}, ..., "shared": {"reads": ..., "writes": ...}},
    # where "writer" (shaped like the argument) is the thread that last wrote each element, as a global
    # thread id block * threads_per_block + thread (blocks numbered x fastest), -1 if none did.
    profile: dict[str, dict[str, np.ndarray]] | None = None


def _resolve_sites(text: str, exe: Path) -> str:
    pcs = sorted(set(re.findall(r"@pc:([0-9a-f]+)@", text)))
    if not pcs:
        return text
    where: dict[str, str] = {}
    tool = shutil.which("addr2line")
    if tool:
        out = subprocess.run([tool, "-e", str(exe), "-i", "-a", *(f"0x{p}" for p in pcs)],
                             capture_output=True, text=True, timeout=60).stdout
        cur, frames = None, {}
        for ln in out.splitlines():
            if ln.startswith("0x"):
                cur = f"{int(ln, 16):x}"
                frames[cur] = []
            elif cur is not None:
                frames[cur].append(ln.strip())
        for pc, fs in frames.items():
            hits = [f for f in fs if f.split(":")[0].endswith("kernel.cu")]
            best = (hits or fs or ["?"])[0]
            where[pc] = re.sub(r"^.*/", "", re.sub(r"\s*\(discriminator \d+\)", "", best))
    return re.sub(r"@pc:([0-9a-f]+)@", lambda m: where.get(m.group(1), "an unknown line"), text)


def _index(shape: tuple[int, ...], flat: int) -> str:
    return str(tuple(int(i) for i in np.unravel_index(flat, shape))) if len(shape) > 1 else f"[{flat}]"


def _compare(name: str, shape: tuple, a: np.ndarray, b: np.ndarray, loose: bool) -> tuple[str, str, int] | None:
    """Where two schedules' results for one argument differ, described; None if they agree."""
    if a.dtype.kind == "f":
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        if loose:  # float atomics: the order of additions changes the rounding
            scale = max(1.0, float(np.nanmax(np.abs(a))) if a.size else 1.0)
            same |= np.abs(a.astype(np.float64) - b) <= 1e-5 * scale
    else:
        same = a == b
    if same.all():
        return None
    i = int(np.flatnonzero(~same.ravel())[0])
    n = int((~same).sum())
    return f"{name}{_index(shape, i)} is {a.ravel()[i].item()!r}", f"{b.ravel()[i].item()!r}", n


def run_kernel(source: str, name: str, grid: int | Sequence[int], block: int | Sequence[int],
               args: Sequence[Any], *, timeout: float = 20.0, shared_bytes: int = 0,
               schedules: Sequence[str] = DEFAULT_SCHEDULES, racecheck: bool = True,
               profile: bool = False) -> EmulatorRun:
    """Run kernel `name` (`"name<args>"` for a template) on the CPU with <<<grid, block, shared_bytes>>>.

    args: NumPy arrays for pointer parameters (C-contiguous, exact dtype; updated in place with what
    the kernel wrote), None for a null pointer, NumPy scalars (np.int32(...), np.float32(...)) for
    the rest; trailing parameters with defaults may be left out.
    schedules: the orders to run warps, lanes and blocks in ("forward", "reverse", "shuffle"); the
    results of all must agree, else KernelError (a race). racecheck: the shared-memory race check.
    profile: count global and shared accesses per thread (EmulatorRun.profile).
    Raises KernelError on a crash, hang (timeout, seconds), deadlock, race, or bad memory access."""
    exe, params = build_emulator(source, name)
    check_args(params, args, name)
    g, b = _dim3(grid, "grid"), _dim3(block, "block")
    scheds = tuple(schedules)
    if not scheds or any(s not in SCHEDULES for s in scheds):
        raise ValueError(f"schedules must be a non-empty sequence of {SCHEDULES}, got {schedules!r}")
    if not isinstance(shared_bytes, (int, np.integer)) or shared_bytes < 0:
        raise ValueError(f"shared_bytes must be a non-negative int, got {shared_bytes!r}")
    label = f"kernel {name}<<<{g}, {b}{f', {shared_bytes}' if shared_bytes else ''}>>>"
    arrays = [(p, a) for p, a in zip(params, args) if p.pointer and a is not None]
    with tempfile.TemporaryDirectory(prefix="mt-emu-") as tmp:
        fin, fout, fstats, fprof = (Path(tmp) / n for n in ("in.bin", "out.bin", "stats.txt", "prof.bin"))
        with open(fin, "wb") as f:
            f.write(np.array([0x3145544D, *g, *b, int(shared_bytes), int(racecheck) | (2 * int(profile)), len(scheds),
                              *(SCHEDULES.index(s) for s in scheds), 12345, len(args)], dtype=np.uint32).tobytes())
            for p, a in zip(params, args):
                kind = 2 if (p.pointer and a is None) else (1 if p.pointer else 0)
                f.write(np.uint32(kind).tobytes())
                for s in (p.name, p.ctype):
                    f.write(np.uint32(len(s.encode())).tobytes() + s.encode())
                if kind == 1:
                    data = np.ascontiguousarray(a).tobytes()
                    f.write(np.uint64(len(data)).tobytes() + np.uint32(p.dtype.itemsize * p.vec).tobytes() + data)
                elif kind == 0:
                    data = np.asarray(a, dtype=p.dtype).tobytes()
                    f.write(np.uint64(len(data)).tobytes() + np.uint32(p.dtype.itemsize).tobytes() + data)
                else:
                    f.write(np.uint64(0).tobytes() + np.uint32(p.dtype.itemsize * p.vec).tobytes())
        try:
            out = subprocess.run([str(exe), str(fin), str(fout), str(fstats), str(fprof)],
                                 capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KernelError(f"{label} did not finish within {timeout:g} s on the emulator: an endless loop, or a "
                              "loop whose bound never changes? (or a spin-wait on another thread, which the "
                              "emulator runs one at a time)") from None
        if out.returncode != 0:
            msg = [ln.removeprefix("MT-ERROR: ") for ln in out.stderr.splitlines() if ln.startswith("MT-ERROR")]
            if not msg:
                code = out.returncode
                what = f"signal {-code}" if code < 0 else f"exit status {code}"
                msg = [f"the kernel process died ({what}): {out.stderr.strip()[-500:]}"]
            raise KernelError(_resolve_sites(f"{label}: " + " ".join(msg), exe))
        if not fout.exists() or not fstats.exists():
            raise KernelError(f"{label}: the emulator process ended before the launch finished (does the kernel "
                              "call exit()?)")
        data = fout.read_bytes()
        stats = fstats.read_text().splitlines()
        per_sched = sum(np.asarray(a).nbytes for _, a in arrays)
        if len(data) != per_sched * len(scheds):
            raise KernelError(f"{label}: the emulator process ended before the launch finished (does the kernel "
                              "call exit()?)")
        loose = [bool(int(ln.split()[7])) for ln in stats if ln.startswith("array ")][:len(arrays)]
        results = []
        for s in range(len(scheds)):
            pos, res = s * per_sched, []
            for p, a in arrays:
                res.append(np.frombuffer(data, dtype=a.dtype, count=a.size, offset=pos).reshape(a.shape))
                pos += a.nbytes
            results.append(res)
        for s in range(1, len(scheds)):
            for k, (p, a) in enumerate(arrays):
                diff = _compare(p.name, a.shape, results[0][k], results[s][k], loose[k] if k < len(loose) else False)
                if diff:
                    first, second, n = diff
                    raise KernelError(
                        f"{label} gives different results when its threads run in a different order: {first} when "
                        f"warps, lanes and blocks run {scheds[0]} but {second} when they run {scheds[s]} ({n} "
                        f"element{'s' if n != 1 else ''} of {p.name} differ). That is a race: a thread reads a value "
                        f"another thread writes, with no barrier between them (a global-memory race, or one between "
                        f"blocks, if no shared-memory race was reported), or the result depends on which thread "
                        f"writes last.")
        for (p, a), r in zip(arrays, results[0]):
            a[...] = r
        run = _parse_stats(stats, arrays, scheds, out.stdout)
        if profile and fprof.exists():
            run.profile = _read_profile(fprof.read_bytes(), arrays, g, b)
        run.notes = [_resolve_sites(n, exe) for n in run.notes]
    return run


def _parse_stats(lines: list[str], arrays: list, scheds: tuple[str, ...], stdout: str) -> EmulatorRun:
    reads, writes, notes = {}, {}, []
    sh = [0, 0, 0, 0]
    seen_schedule = 0
    for ln in lines:
        w = ln.split()
        if w[0] == "schedule":
            seen_schedule += 1
        elif seen_schedule == 1 and w[0] == "array":
            name = arrays[int(w[1])][0].name
            reads[name], writes[name] = int(w[3]), int(w[5])
        elif seen_schedule == 1 and w[0] == "shared":
            sh = [int(w[2]), int(w[4]), int(w[6]), int(w[8])]
        elif w[0] == "note":
            notes.append(ln[5:])
    return EmulatorRun(stdout, scheds, reads, writes, sh[0], sh[1], sh[2], sh[3], notes)


def _read_profile(data: bytes, arrays: list, g: tuple, b: tuple) -> dict[str, dict[str, np.ndarray]]:
    blocks, threads = g[0] * g[1] * g[2], b[0] * b[1] * b[2]
    n = blocks * threads
    v = np.frombuffer(data, dtype=np.uint32)
    out, pos = {}, 0
    for p, _ in arrays:
        out[p.name] = {"reads": v[pos:pos + n].reshape(blocks, threads).astype(np.int64),
                       "writes": v[pos + n:pos + 2 * n].reshape(blocks, threads).astype(np.int64)}
        pos += 2 * n
    out["shared"] = {"reads": v[pos:pos + n].reshape(blocks, threads).astype(np.int64),
                     "writes": v[pos + n:pos + 2 * n].reshape(blocks, threads).astype(np.int64)}
    pos += 2 * n
    w = v.view(np.int32)
    for p, a in arrays:
        count = a.size // p.vec
        writer = w[pos:pos + count].astype(np.int64)
        out[p.name]["writer"] = writer.reshape(a.shape) if p.vec == 1 else writer
        pos += count
    return out


def emulate(source: str, name: str, grid: int | Sequence[int], block: int | Sequence[int],
            args: Sequence[Any], timeout: float = 20.0, *, shared_bytes: int = 0,
            schedules: Sequence[str] = DEFAULT_SCHEDULES, racecheck: bool = True) -> str:
    """Run kernel `name` from CUDA C `source` on the CPU with launch configuration
    <<<grid, block, shared_bytes>>> and return what it printed. See run_kernel for the arguments.

    Raises KernelError on a crash, a hang (timeout, seconds), a deadlock at a barrier or warp
    operation, an access outside an argument array or a shared array, a misaligned vector access,
    a shared-memory race, or results that depend on the order threads run in."""
    return run_kernel(source, name, grid, block, args, timeout=timeout, shared_bytes=shared_bytes,
                      schedules=schedules, racecheck=racecheck).stdout


# ---------------------------------------------------------------------------------------------
# On a GPU

def raw_module(source: str, name_expressions: Sequence[str] = (), options: Sequence[str] = ()) -> Any:
    """cupy.RawModule for `source`, compiled by NVRTC with the same options as compile_ptx (include
    path, pre-included mt_nvrtc.h). get_function(name) gives a kernel (name with template args)."""
    import cupy

    return cupy.RawModule(code=source, options=(*nvrtc_options(), *options),
                          name_expressions=tuple(name_expressions) or None)


def raw_kernel(source: str, name: str, options: Sequence[str] = ()) -> Any:
    """The kernel `name` (`"name<args>"` for a template) of `source` as a CuPy kernel object."""
    templ = "<" in name
    return raw_module(source, (name,) if templ else (), options).get_function(name)
