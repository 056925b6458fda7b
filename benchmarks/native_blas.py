"""Timing NumPy's BLAS as a student's machine runs it.

Where OPENBLAS_CORETYPE or OPENBLAS_L2_SIZE is set (the development machines set both: OpenBLAS then
runs an older, slower kernel), a benchmark that compares with the BLAS runs its `_main` in a child
process without them (minitorch.bench.native_env); tests and CI keep the environment as it is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def ran_natively(bench_file: str, out_dir: Path) -> bool:
    """If OpenBLAS is held back here, run `_main(out_dir)` of the benchmark file in a child process
    whose environment lacks the variables, and return True; else False (the caller times here)."""
    from minitorch.bench import blas_forced, native_env

    forced = blas_forced()
    if not forced:
        return False
    print(f"{', '.join(f'{k}={v}' for k, v in forced.items())} set here: timing in a child process without "
          "them, NumPy's BLAS as a student's machine runs it", flush=True)
    code = f"import runpy; runpy.run_path({str(Path(bench_file).resolve())!r})['_main']({str(out_dir)!r})"
    subprocess.run([sys.executable, "-c", code], env=native_env(), check=True)
    return True
