"""Lesson 14: the compiled transformer block against eager minitorch and against NumPy.

The block is lesson 14's `gpt_block` (lesson 09's pre-LayerNorm block: causal 4-head attention and
a tanh-GELU MLP, float32) at the tiny GPT's shape (batch 8, 64 positions, width 64) and 4x wider
(width 256). Columns (minitorch.compiler.block_speed):
- eager: minitorch's Tensor ops with autograd recording (what a training forward runs);
- NumPy: the same block written directly in NumPy (`gpt_block_numpy`: heads as a batched axis);
- compiled: `minitorch.compiler.compile(gpt_block)` on a cache hit (guards checked, then the
  generated kernels and the library matmuls);
- matmul: the compiled plan's library GEMMs alone; bound = eager / matmul, the most a compiler
  that keeps BLAS's GEMMs can gain (eager minitorch runs the same GEMMs), Amdahl's law;
- kernels and MB: the eager plan (one kernel per op) and the fused plan, and the bytes each reads
  and writes (plan_bytes);
- compile: the first call (trace, passes, fusion, code generation, Numba compilation; kernels
  already in the process's source cache are not compiled again); guard: what a cache hit adds
  before the kernels run (computing the guard key); max err: compiled vs eager, float32.

Times are wall time (perf_counter), the fastest of 18 runs in six interleaved rounds, on a
machine that may be shared: read the ratios. `make bench L=compiler`.

Then threads for fused kernels (the fusion note's "Threads" point): the compiled 4x-wide block with
lesson 14's threshold (a kernel runs its rows on all cores from PARALLEL_MIN = 2**20 elements, so
every kernel of this block runs on one core), with the threshold at 2**19 (the MLP's GELU kernel,
8 x 64 x 1024 = 524,288 elements, then runs on all cores) and at 0 (every kernel on all cores):
the fastest and the median of the interleaved rounds, and the load average before and after.
"""

from __future__ import annotations

import os
from pathlib import Path

from minitorch.compiler import block_speed, print_speed_table

SMALL = os.environ.get("MINITORCH_SMALL") == "1"


def threads_for_kernels(batch: int = 8, t: int = 64, c: int = 256, rounds: int = 6) -> None:
    """Print the compiled gpt_block at (batch, t, c) with fused kernels on all cores from 2**20
    elements (lesson 14's PARALLEL_MIN), from 2**19 and from 0, timed in interleaved rounds."""
    import numba
    import numpy as np

    import minitorch.compiler as mc
    from minitorch.autograd import Tensor
    from minitorch.bench import benchmark

    ws = mc.gpt_block_weights(c, 4, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((batch, t, c)).astype(np.float32)
    args = [Tensor(x), Tensor(mc.additive_causal_mask(t)), *map(Tensor, ws)]
    default = mc.PARALLEL_MIN
    variants = {f"threads from 2**{default.bit_length() - 1} elements (lesson 14)": default,
                "threads from 2**19 (the GELU kernel too)": 1 << 19, "threads for every kernel": 0}
    compiled = {}
    for name, threshold in variants.items():
        mc.PARALLEL_MIN = threshold  # read when the kernels are built, at the first call
        try:
            compiled[name] = mc.compile(mc.gpt_block)
            compiled[name](*args)
        finally:
            mc.PARALLEL_MIN = default
    want = compiled[next(iter(variants))](*args).data
    for name, f in compiled.items():
        err = float(np.abs(f(*args).data - want).max())
        assert err < 1e-4, f"{name}: differs from the one-core block by {err}"
    load = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, f in compiled.items():
            times[name].append(benchmark(f, *args, repeat=3).min)
    print(f"\nthreads for fused kernels: compiled gpt_block {(batch, t, c)}, float32, Numba {numba.get_num_threads()} "
          f"threads, {rounds} interleaved rounds of 3 runs, load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    for name, ts in times.items():
        print(f"   {name:<46} fastest {1e3 * min(ts):7.2f} ms, median {1e3 * float(np.median(ts)):7.2f} ms")


def main(out_dir: Path | None = None) -> None:
    shapes = [(2, 64, 64), (2, 64, 256)] if SMALL else [(8, 64, 64), (8, 64, 256)]
    results = [block_speed(*shape) for shape in shapes]
    print_speed_table(results)
    threads_for_kernels(*shapes[1], rounds=3 if SMALL else 6)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "compiler.tsv", "w") as fh:
            fh.write("shape\teager_s\tnumpy_s\tcompiled_s\tmatmul_s\teager_bytes\tfused_bytes\tcompile_s\n")
            for r in results:
                fh.write(f"{r['shape']}\t{r['eager']}\t{r['numpy']}\t{r['compiled']}\t{r['matmul']}\t"
                         f"{r['eager_bytes']}\t{r['fused_bytes']}\t{r['compile']}\n")


if __name__ == "__main__":
    main(Path("build/bench"))
