"""Lesson 10: the int8 GEMM against float32 kernels, and bytes of weights per token per format.

CPU, square n = 1024 (MINITORCH_SMALL=1: 512): GOPS (2 n^3 operations per product, a multiply and
an add each) of lesson 10's int8 GEMM (Numba, int32 accumulation), lesson 06's float32 Numba
kernel (minitorch.simd_matmul.matmul_simd) and NumPy's float32 BLAS, with the ratios measured in
the same run, the kernels taking turns (best of 7 each), on all threads and on one. Target
(issue 11): int8 >= lesson 06's float32 kernel. Also reports which widening
multiply-add instructions the int8 kernel's machine code contains.

Bytes of weights read per generated token (batch 1, every weight read once) for a GPT-2-small
shaped stack of Linear layers (12 layers, d = 768) in each format of the lesson, scales and zero
points included.

On a CUDA GPU: lesson 10's CUDA C int8 GEMM (__dp4a) against lesson 08's register-tiled float32
SGEMM and cuBLAS. Saves quant.json into build/bench/.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

SMALL = os.environ.get("MINITORCH_SMALL") == "1"


def weight_bytes_per_token(n_layer: int = 12, d: int = 768) -> dict[str, int]:
    """Bytes of Linear weights per token for a GPT-2-small-shaped model, per format."""
    from minitorch.quant import QTensor, group_size_for

    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * n_layer
    out = {}
    for name, bits, block, sym in [("fp32", 32, None, True), ("bf16/fp16", 16, None, True), ("fp8 (per-tensor scale)", 8, "tensor", True),
                                   ("int8 per-tensor", 8, "tensor", True), ("int8 per-channel", 8, "channel", True),
                                   ("int4 group-128 (zero point)", 4, "group", False)]:
        total = 0
        for k, n in shapes:
            if bits >= 16:
                total += k * n * bits // 8
                continue
            grid = {"tensor": (1, 1), "channel": (1, n), "group": (k // group_size_for(k), n)}[block]
            qt = QTensor(np.zeros((k, n), np.int8), np.zeros(grid, np.float32), np.zeros(grid, np.int32), bits, sym)
            total += qt.nbytes()
        out[name] = total
    return out


def cpu(results: dict) -> None:
    import numba

    from minitorch.bench import blas_limit
    from minitorch.quant import find_int8_madd, gemm_int8_kernel, matmul_int8
    from minitorch.simd_matmul import matmul_simd

    n = 512 if SMALL else 1024
    rng = np.random.default_rng(0)
    a8 = rng.integers(-128, 128, (n, n)).astype(np.int8)
    b8 = rng.integers(-128, 128, (n, n)).astype(np.int8)
    af, bf = a8.astype(np.float32), b8.astype(np.float32)
    if not np.array_equal(matmul_int8(a8, b8), a8.astype(np.int64) @ b8.astype(np.int64)):
        raise AssertionError("matmul_int8 gives a wrong answer")
    ops = 2 * n**3
    kernels = [("int8 GEMM (lesson 10)", matmul_int8, (a8, b8)),
               ("float32 Numba (lesson 06)", matmul_simd, (af, bf)),
               ("float32 NumPy BLAS", np.matmul, (af, bf))]
    asm = gemm_int8_kernel.inspect_asm(gemm_int8_kernel.signatures[0])
    madd = find_int8_madd(asm)
    results["cpu"] = {"n": n, "madd_instructions": madd}
    before = numba.get_num_threads()
    try:
        for threads in sorted({before, 1}, reverse=True):
            numba.set_num_threads(threads)
            with blas_limit(threads):
                gops = {name: ops / t / 1e9 for name, t in interleaved_best(kernels).items()}
            i8 = gops["int8 GEMM (lesson 10)"]
            print(f"CPU, n = {n}, {threads} thread{'s' * (threads > 1)} (best of 7, runs interleaved):")
            for name, g in gops.items():
                print(f"  {name:<28} {g:8.1f} GOPS   int8 / this = {i8 / g:5.2f}")
            results["cpu"][f"{threads} threads"] = {"gops": gops,
                                                    "int8_vs_lesson06": i8 / gops["float32 Numba (lesson 06)"],
                                                    "int8_vs_blas": i8 / gops["float32 NumPy BLAS"]}
    finally:
        numba.set_num_threads(before)
    print(f"  int8 kernel's widening multiply-adds: {madd or 'none found'}")


def interleaved_best(kernels: list, rounds: int = 7) -> dict[str, float]:
    """The fastest of `rounds` runs of each kernel (after one warm-up), the kernels taking turns
    so that a burst of load elsewhere on the machine slows all of them, not one."""
    best = {}
    for name, fn, args in kernels:
        fn(*args)
        best[name] = float("inf")
    for _ in range(rounds):
        for name, fn, args in kernels:
            t0 = time.perf_counter()
            fn(*args)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def gpu(results: dict) -> None:
    from course.gpu import gpu_status

    ok, reason = gpu_status()
    if not ok:
        print(f"GPU part skipped: needs a CUDA GPU ({reason})")
        return
    import cupy as cp

    from minitorch.cupy_kernels import cuda_time_ms, sgemm
    from minitorch.quant import int8_gemm_dp4a

    results["gpu"] = {"device": reason}
    print(f"GPU ({reason}):")
    for n in ((1024, 2048) if SMALL else (1024, 2048, 4096)):
        a8 = cp.random.randint(-128, 128, (n, n), dtype=cp.int8)
        b8 = cp.random.randint(-128, 128, (n, n), dtype=cp.int8)
        af, bf = a8.astype(cp.float32), b8.astype(cp.float32)
        if not bool((int8_gemm_dp4a(a8, b8) == (af @ bf).astype(cp.int32)).all()):
            raise AssertionError("int8_gemm_dp4a gives a wrong answer")
        row = {"dp4a int8": 2 * n**3 / cuda_time_ms(lambda: int8_gemm_dp4a(a8, b8)) / 1e9,
               "lesson 08 regtile fp32": 2 * n**3 / cuda_time_ms(lambda: sgemm(af, bf, "regtile")) / 1e9,
               "cuBLAS fp32": 2 * n**3 / cuda_time_ms(lambda: af @ bf) / 1e9}
        results["gpu"][n] = row
        print(f"  n={n}: " + "  ".join(f"{k} {v:7.1f} TOPS" for k, v in row.items())
              + f"  dp4a / regtile = {row['dp4a int8'] / row['lesson 08 regtile fp32']:.2f}")


def main(out_dir: Path) -> None:
    results: dict = {}
    cpu(results)
    wb = weight_bytes_per_token()
    print("\nBytes of Linear weights read per token, GPT-2-small shape (12 layers, d = 768, batch 1):")
    for name, b in wb.items():
        print(f"  {name:<30} {b / 2**20:8.1f} MiB   {wb['fp32'] / b:4.1f}x fewer than fp32")
    results["weight_bytes_per_token"] = wb
    gpu(results)
    (out_dir / "quant.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"saved {out_dir / 'quant.json'}")
