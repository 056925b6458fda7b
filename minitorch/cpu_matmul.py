# Generated from solutions/05_cpu_matmul.py by `make build`. Do not edit.
"""minitorch.cpu_matmul: matrix multiplication on the CPU, from Python loops to cache tiling."""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from numba import njit

from minitorch.checks import describe


FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def check_matmul_args(a: np.ndarray, b: np.ndarray, what: str = "matmul") -> np.dtype:
    """Validate `a` (m, k) @ `b` (k, n) for the function named `what`; return the result dtype.

    Raises TypeError for an operand that is not a NumPy array or not float32/float64, and
    ValueError for a wrong number of dimensions or mismatched inner dimensions; each message
    names `what`, the operand and its shape or dtype.
    """
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{what}: {name} must be a NumPy array, got {describe(x)}")
        if x.ndim != 2:
            raise ValueError(f"{what}: {name} must be a 2-D matrix, got shape {x.shape} ({x.ndim}-D)")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{what}: {name} must be float32 or float64, got dtype {x.dtype}; "
                            f"convert it with {name}.astype(np.float64)")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: shape mismatch: a {a.shape} @ b {b.shape}: "
                         f"a has {a.shape[1]} columns but b has {b.shape[0]} rows")
    return np.result_type(a.dtype, b.dtype)


def as_operands(a: np.ndarray, b: np.ndarray, what: str = "matmul") -> tuple[np.ndarray, np.ndarray]:
    """Validated (`check_matmul_args(a, b, what)`), C-contiguous copies (or the inputs themselves)
    of `a` and `b` in the result dtype."""
    dtype = check_matmul_args(a, b, what)
    return np.ascontiguousarray(a, dtype=dtype), np.ascontiguousarray(b, dtype=dtype)


def matmul_python(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C = a @ b with plain Python loops. a (m, k), b (k, n) float32/float64 -> C (m, n).

    For tiny matrices only: about 10^7 multiply-adds per second at best.
    """
    dtype = check_matmul_args(a, b, "matmul_python")
    m, k = a.shape
    n = b.shape[1]
    A, B = a.tolist(), b.tolist()
    C = [[0.0] * n for _ in range(m)]
    for i in range(m):
        Ai, Ci = A[i], C[i]
        for j in range(n):
            acc = 0.0
            for p in range(k):
                acc += Ai[p] * B[p][j]
            Ci[j] = acc
    return np.array(C, dtype=dtype).reshape(m, n)


@njit(cache=False)
def ijk_kernel(a, b, c):
    """c[i, j] = sum_p a[i, p] * b[p, j] with loops i, j, p (p innermost).

    a (m, k), b (k, n), c (m, n): C-contiguous arrays of one float dtype; c is overwritten.
    """
    m, k = a.shape
    n = b.shape[1]
    for i in range(m):
        for j in range(n):
            acc = 0.0
            for p in range(k):
                acc += a[i, p] * b[p, j]
            c[i, j] = acc


def matmul_ijk(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C = a @ b with the i-j-k loop nest compiled by Numba. a (m, k), b (k, n) -> C (m, n)."""
    a, b = as_operands(a, b, "matmul_ijk")
    c = np.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    ijk_kernel(a, b, c)
    return c


@njit(cache=False)
def ikj_kernel(a, b, c):
    """c[i, :] += a[i, p] * b[p, :] with loops i, p, j (j innermost).

    a (m, k), b (k, n), c (m, n): C-contiguous arrays of one float dtype. Accumulates into c
    (c += a @ b); matmul_ikj passes zeros.
    """
    m, k = a.shape
    n = b.shape[1]
    for i in range(m):
        for p in range(k):
            aip = a[i, p]
            for j in range(n):
                c[i, j] += aip * b[p, j]


def matmul_ikj(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C = a @ b with the cache-friendly i-k-j loop nest. a (m, k), b (k, n) -> C (m, n)."""
    a, b = as_operands(a, b, "matmul_ikj")
    c = np.zeros((a.shape[0], b.shape[1]), dtype=a.dtype)
    ikj_kernel(a, b, c)
    return c


SYSFS_CACHE = "/sys/devices/system/cpu/cpu0/cache"


def cache_sizes(root: str | Path = SYSFS_CACHE) -> dict[str, int]:
    """Cache sizes in bytes from a Linux sysfs cache directory: {'L1d': 32768, 'L1i': ..., 'L2': ..., 'L3': ...}.

    Reads `root`/index*/{level,type,size}; directories missing one of them are skipped.
    Returns {} when `root` does not exist.
    """
    root = Path(root)
    if not root.is_dir():
        return {}
    suffix = {"Data": "d", "Instruction": "i", "Unified": ""}
    found: dict[str, int] = {}
    for d in sorted(root.glob("index*")):
        try:
            level = (d / "level").read_text().strip()
            kind = (d / "type").read_text().strip()
            size = (d / "size").read_text()
        except OSError:
            continue
        found[f"L{level}{suffix.get(kind, '')}"] = parse_size(size)
    return found


def parse_size(text: str) -> int:
    """'32K' -> 32768, '8M' -> 8388608, '1G' -> 1073741824, '512' -> 512 (binary multiples)."""
    s = text.strip().upper()
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(s[-1:], 1)
    digits = s[:-1] if s[-1:] in "KMG" and s else s
    if not digits.isdigit():
        raise ValueError(f"parse_size: text must be digits with an optional K, M or G suffix, got {text!r}")
    return int(digits) * scale


FALLBACK_CACHES = {"L1d": 32 * 1024, "L2": 512 * 1024, "L3": 8 * 1024**2}


def machine_cache_sizes() -> dict[str, int]:
    """This machine's cache sizes in bytes: sysfs, else getconf/sysctl, else FALLBACK_CACHES."""
    found = cache_sizes()
    if found:
        return found
    queries = {"L1d": ("getconf", "LEVEL1_DCACHE_SIZE"), "L2": ("getconf", "LEVEL2_CACHE_SIZE"),
               "L3": ("getconf", "LEVEL3_CACHE_SIZE")}
    if sys.platform == "darwin":
        queries = {"L1d": ("sysctl", "-n", "hw.l1dcachesize"), "L2": ("sysctl", "-n", "hw.l2cachesize"),
                   "L3": ("sysctl", "-n", "hw.l3cachesize")}
    for name, cmd in queries.items():
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.strip()
            if out.isdigit() and int(out) > 0:
                found[name] = int(out)
        except (OSError, subprocess.SubprocessError):
            pass
    if "L1d" not in found or "L2" not in found:
        print(f"minitorch: could not read cache sizes; assuming {FALLBACK_CACHES}", file=sys.stderr)
        found = {**FALLBACK_CACHES, **found}
    return found


def choose_tile(cache_bytes: int, itemsize: int, n_tiles: int = 3, multiple: int = 8) -> int:
    """Largest tile T (a multiple of `multiple` when possible) with n_tiles * T*T * itemsize <= cache_bytes."""
    for name, v in (("cache_bytes", cache_bytes), ("itemsize", itemsize), ("n_tiles", n_tiles),
                    ("multiple", multiple)):
        if int(v) != v or v <= 0:
            raise ValueError(f"choose_tile: {name} must be a positive integer, got {v!r}")
    t = math.isqrt(int(cache_bytes) // (int(n_tiles) * int(itemsize)))
    rounded = t - t % multiple
    return rounded if rounded > 0 else max(t, 1)


@njit(cache=False)
def tiled_kernel(a, b, c, tile):
    """C += A @ B computed in tile x tile blocks (tile loops i0, p0, j0; i-k-j inside a block).

    a (m, k), b (k, n), c (m, n): C-contiguous arrays of one float dtype. Accumulates into c
    (c += a @ b); matmul_tiled passes zeros. Sizes need not be multiples of `tile`.
    """
    m, k = a.shape
    n = b.shape[1]
    for i0 in range(0, m, tile):
        i1 = min(i0 + tile, m)
        for p0 in range(0, k, tile):
            p1 = min(p0 + tile, k)
            for j0 in range(0, n, tile):
                j1 = min(j0 + tile, n)
                width = j1 - j0
                for i in range(i0, i1):
                    crow = c[i, j0:j1]
                    for p in range(p0, p1):
                        aip = a[i, p]
                        brow = b[p, j0:j1]
                        for j in range(width):
                            crow[j] += aip * brow[j]


@functools.lru_cache(maxsize=None)
def _default_tile(itemsize: int) -> int:
    return choose_tile(machine_cache_sizes().get("L2", FALLBACK_CACHES["L2"]), itemsize)


def default_tile(itemsize: int) -> int:
    """Tile size for `tiled_kernel`: three tiles in this machine's L2 cache (computed once per itemsize)."""
    return _default_tile(int(itemsize))


def matmul_tiled(a: np.ndarray, b: np.ndarray, tile: int | None = None) -> np.ndarray:
    """C = a @ b with cache blocking. a (m, k), b (k, n) -> C (m, n); tile None -> default_tile."""
    a, b = as_operands(a, b, "matmul_tiled")
    if tile is None:
        tile = default_tile(a.itemsize)
    if isinstance(tile, (bool, np.bool_)) or not isinstance(tile, (int, np.integer, float, np.floating)):
        raise TypeError(f"matmul_tiled: tile must be a positive integer or None, got {describe(tile)}")
    if not isinstance(tile, (int, np.integer)) or tile < 1:  # 2.5 is a number, but no tile size
        raise ValueError(f"matmul_tiled: tile must be a positive integer or None, got {tile!r}")
    c = np.zeros((a.shape[0], b.shape[1]), dtype=a.dtype)
    tiled_kernel(a, b, c, int(tile))
    return c


from minitorch.checks import Instance, Size, Unchecked, validate_public  # noqa: E402

validate_public(globals(), {
    "cache_sizes": {"root": Instance(str, os.PathLike, must="a path (a str or os.PathLike)")},
    "choose_tile": {"cache_bytes": Size, "itemsize": Size, "n_tiles": Size, "multiple": Size},
    "default_tile": {"itemsize": Size},
    "matmul_tiled": {"tile": Unchecked()},  # checked in its body: a float tile is a ValueError there
})
