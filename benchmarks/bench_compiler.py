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
"""

from __future__ import annotations

import os
from pathlib import Path

from minitorch.compiler import block_speed, print_speed_table

SMALL = os.environ.get("MINITORCH_SMALL") == "1"


def main(out_dir: Path | None = None) -> None:
    shapes = [(2, 64, 64), (2, 64, 256)] if SMALL else [(8, 64, 64), (8, 64, 256)]
    results = [block_speed(*shape) for shape in shapes]
    print_speed_table(results)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "compiler.tsv", "w") as fh:
            fh.write("shape\teager_s\tnumpy_s\tcompiled_s\tmatmul_s\teager_bytes\tfused_bytes\tcompile_s\n")
            for r in results:
                fh.write(f"{r['shape']}\t{r['eager']}\t{r['numpy']}\t{r['compiled']}\t{r['matmul']}\t"
                         f"{r['eager_bytes']}\t{r['fused_bytes']}\t{r['compile']}\n")


if __name__ == "__main__":
    main(Path("build/bench"))
