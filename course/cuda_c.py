"""CUDA C on machines without a GPU: compile to PTX with NVRTC, and run kernels on the CPU.

compile_ptx(source)             NVRTC (CuPy's binding) -> PTX text; CudaCompileError with the log.
ptx_stats(ptx)                  instruction counts that show a kernel's structure (FMAs, shared
                                loads, barriers, shared bytes).
kernel_params(source, name)     the parameters of `extern "C" __global__ void name(...)`.
check_args(params, args, name)  clear errors for wrong argument types before a launch.
emulate(source, name, grid, block, args)
                                run the kernel on the CPU: the source is compiled with g++ against
                                course/cuda_prelude.h (each CUDA thread a fiber, blocks one at a
                                time, deterministic order) in a subprocess, so a crash or hang in a
                                student's kernel is reported, not fatal. Pointer arguments are NumPy
                                arrays, written back after the run; out-of-bounds accesses are
                                reported with the argument's name.

The emulator checks semantics (indexing, guards, barriers, shuffles), not speed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

PRELUDE = Path(__file__).with_name("cuda_prelude.h")


class CudaCompileError(RuntimeError):
    """The CUDA C source did not compile; the message holds the compiler's log."""


class KernelError(RuntimeError):
    """An emulated kernel crashed, hung, deadlocked or accessed memory out of bounds."""


# ---------------------------------------------------------------------------------------------
# NVRTC

def compile_ptx(source: str, arch: str = "compute_80", options: Sequence[str] = ()) -> str:
    """PTX for `source` (CUDA C) compiled by NVRTC for virtual architecture `arch`. No GPU needed."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "kernel.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", "-std=c++17", *options])
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
    ld_shared: int      # loads from shared memory
    st_shared: int      # stores to shared memory
    ld_global: int      # loads from global memory
    bar_sync: int       # barriers (__syncthreads)
    shfl: int           # warp shuffles
    shared_bytes: int   # statically allocated shared memory per block


def ptx_stats(ptx: str) -> PtxStats:
    """Count the instructions that reveal a kernel's structure in its PTX."""
    def count(pattern: str) -> int:
        return len(re.findall(pattern, ptx, flags=re.M))
    shared = sum(int(m) for m in re.findall(r"^\s*\.shared\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx, flags=re.M))
    return PtxStats(
        fma_f32=count(r"\bfma\.rn\.f32\b"),
        ld_shared=count(r"\bld\.shared\."),
        st_shared=count(r"\bst\.shared\."),
        ld_global=count(r"\bld\.global\."),
        bar_sync=count(r"\b(?:bar\.sync|barrier\.sync)\b"),
        shfl=count(r"\bshfl\.sync\."),
        shared_bytes=shared,
    )


# ---------------------------------------------------------------------------------------------
# Kernel signatures and argument checks

_CTYPES = {
    "float": np.float32, "double": np.float64, "int": np.int32, "unsigned int": np.uint32,
    "unsigned": np.uint32, "long long": np.int64, "long long int": np.int64, "long": np.int64,
    "unsigned long long": np.uint64, "size_t": np.uint64, "int64_t": np.int64, "int32_t": np.int32,
    "uint32_t": np.uint32, "uint64_t": np.uint64, "short": np.int16, "char": np.int8,
    "signed char": np.int8, "unsigned char": np.uint8, "int8_t": np.int8, "uint8_t": np.uint8,
    "bool": np.bool_,
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "restrict", "__restrict"}


@dataclass
class Param:
    name: str
    ctype: str          # base C type, e.g. "float"
    pointer: bool
    dtype: np.dtype

    def __str__(self) -> str:
        return f"{self.ctype}{'*' if self.pointer else ''} {self.name}"


def _strip_comments(source: str) -> str:
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    return re.sub(r"//[^\n]*", "", source)


def kernel_params(source: str, name: str) -> list[Param]:
    """The parameters of `extern "C" __global__ void name(...)` in `source`.

    ValueError if there is no such kernel or a parameter type is not a plain scalar or pointer."""
    code = _strip_comments(source)
    m = re.search(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
                  r"(?:__launch_bounds__\s*\([^)]*\)\s*)?" + re.escape(name) + r"\s*\(([^)]*)\)", code)
    if not m:
        found = re.findall(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)", code)
        raise ValueError(f"no kernel `__global__ void {name}(...)` in the source; kernels found: {found or 'none'}")
    params = []
    for raw in filter(None, (p.strip() for p in m.group(1).split(","))):
        pointer = "*" in raw
        words = re.findall(r"[A-Za-z_]\w*", raw.replace("*", " "))
        if len(words) < 2:
            raise ValueError(f"kernel {name}: cannot read parameter {raw!r} (type and name needed)")
        pname = words[-1]
        ctype = " ".join(w for w in words[:-1] if w not in _QUALIFIERS)
        if ctype not in _CTYPES:
            raise ValueError(f"kernel {name}: parameter {raw!r} has type {ctype!r}; supported: {sorted(_CTYPES)}")
        if raw.count("*") > 1:
            raise ValueError(f"kernel {name}: parameter {raw!r}: pointers to pointers are not supported")
        params.append(Param(pname, ctype, pointer, np.dtype(_CTYPES[ctype])))
    return params


def check_args(params: Sequence[Param], args: Sequence[Any], kernel: str) -> None:
    """Raise TypeError/ValueError naming the parameter if `args` do not fit `params`.

    A CUDA launch checks nothing: a Python int is passed as 8 bytes to an `int` parameter, a float64
    array is read as float32 garbage, a transposed view is read in the wrong order."""
    if len(args) != len(params):
        raise TypeError(f"kernel {kernel} takes {len(params)} arguments ({', '.join(map(str, params))}), "
                        f"got {len(args)}")
    for p, a in zip(params, args):
        if p.pointer:
            if not hasattr(a, "dtype") or not hasattr(a, "shape") or np.isscalar(a):
                raise TypeError(f"kernel {kernel}: argument {p.name} ({p}) must be an array, got {type(a).__name__}")
            if np.dtype(a.dtype) != p.dtype:
                raise TypeError(f"kernel {kernel}: argument {p.name} ({p}) needs dtype {p.dtype}, got {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError(f"kernel {kernel}: argument {p.name} must be C-contiguous "
                                 f"(got a strided view of shape {a.shape}); pass xp.ascontiguousarray(...)")
        else:
            if not isinstance(a, np.generic) or np.dtype(type(a)) != p.dtype:
                got = f"np.{type(a).__name__}" if isinstance(a, np.generic) else f"Python {type(a).__name__}"
                raise TypeError(f"kernel {kernel}: argument {p.name} ({p}) needs np.{p.dtype}(...), got {got} "
                                f"{a!r} (CUDA would reinterpret its bytes)")


# ---------------------------------------------------------------------------------------------
# The CPU emulator

def compiler() -> str | None:
    """The C++ compiler the emulator uses (CXX or g++), None if there is none."""
    cxx = os.environ.get("CXX", "g++")
    return shutil.which(cxx)


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


def build_emulator(source: str, name: str) -> tuple[Path, list[Param]]:
    """Compile `source` + a main() that launches kernel `name`; cached by content hash."""
    params = kernel_params(source, name)
    if re.search(r"\bextern\s+__shared__", _strip_comments(source)):
        raise ValueError("the CPU emulator does not support dynamic shared memory (extern __shared__); "
                         "use a fixed-size __shared__ array")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the CUDA emulator needs a C++ compiler (g++); none found on PATH")
    reads = []
    for i, p in enumerate(params):
        if p.pointer:
            reads.append(f"    {p.ctype}* a{i} = ({p.ctype}*)mt::read_array(\"{p.name}\");")
        else:
            reads.append(f"    {p.ctype} a{i} = mt::read_scalar<{p.ctype}>();")
    call = ", ".join(f"a{i}" for i in range(len(params)))
    main = "\n".join([
        "int main(int argc, char** argv) {",
        "    if (argc != 3) return 2;",
        "    mt::in = fopen(argv[1], \"rb\");",
        "    dim3 grid = mt::read_dim3(), block = mt::read_dim3();",
        *reads,
        f"    mt::launch(grid, block, [&] {{ {name}({call}); }});",
        "    mt::write_arrays(argv[2]);",
        "    fflush(stdout);",
        "    return 0;",
        "}",
    ])
    prelude = PRELUDE.read_text()
    program = f'{prelude}\n#line 1 "kernel.cu"\n{source}\n#line 1 "emulator_main.cpp"\n{main}\n'
    key = hashlib.sha256((cxx + program).encode()).hexdigest()[:20]
    exe = _cache_dir() / f"{name}-{key}"
    if not exe.exists():
        src = exe.with_suffix(".cpp")
        src.write_text(program)
        tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
        out = subprocess.run([cxx, "-std=c++17", "-O1", "-w", "-o", str(tmp), str(src)],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            log = out.stderr.replace(str(src), "program.cpp")
            raise CudaCompileError(f"the kernel did not compile for the CPU emulator (g++):\n{log.strip()[:4000]}")
        os.replace(tmp, exe)
    return exe, params


def emulate(source: str, name: str, grid: int | Sequence[int], block: int | Sequence[int],
            args: Sequence[Any], timeout: float = 20.0) -> str:
    """Run kernel `name` from CUDA C `source` on the CPU with launch configuration <<<grid, block>>>.

    args: NumPy arrays for pointer parameters (C-contiguous, exact dtype; they are updated in place
    with what the kernel wrote) and NumPy scalars (np.int32(...), np.float32(...)) for the rest.
    Returns what the kernel printed. Raises KernelError on a crash, a hang (timeout, seconds), a
    deadlock at a barrier, or an access outside an argument array."""
    exe, params = build_emulator(source, name)
    check_args(params, args, name)
    g, b = _dim3(grid, "grid"), _dim3(block, "block")
    with tempfile.TemporaryDirectory(prefix="mt-emu-") as tmp:
        fin, fout = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        with open(fin, "wb") as f:
            f.write(np.array(g + b, dtype=np.uint32).tobytes())
            for p, a in zip(params, args):
                if p.pointer:
                    f.write(np.uint64(a.nbytes).tobytes())
                    f.write(np.ascontiguousarray(a).tobytes())
                else:
                    f.write(np.asarray(a, dtype=p.dtype).tobytes())
        try:
            out = subprocess.run([str(exe), str(fin), str(fout)], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KernelError(f"kernel {name} did not finish within {timeout:g} s on the emulator: an endless loop, "
                              "or a loop whose bound never changes?") from None
        if out.returncode != 0:
            msg = [ln.removeprefix("MT-ERROR: ") for ln in out.stderr.splitlines() if ln.startswith("MT-ERROR")]
            if not msg:
                code = out.returncode
                what = f"signal {-code}" if code < 0 else f"exit status {code}"
                msg = [f"the kernel process died ({what}): {out.stderr.strip()[-500:]}"]
            raise KernelError(f"kernel {name}<<<{g}, {b}>>>: " + " ".join(msg))
        if not fout.exists():
            raise KernelError(f"kernel {name}<<<{g}, {b}>>>: the emulator process ended before the launch "
                              "finished (does the kernel call exit()?)")
        data = fout.read_bytes()
        pos = 0
        for p, a in zip(params, args):
            if p.pointer:
                a[...] = np.frombuffer(data, dtype=p.dtype, count=a.size, offset=pos).reshape(a.shape)
                pos += a.nbytes
    return out.stdout
