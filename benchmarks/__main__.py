"""`make bench`: run every benchmarks/bench_*.py (or those whose name contains L).

Each file defines `main(out_dir: pathlib.Path) -> None`, prints its table and saves its plots
into build/bench/. Speed lives here, never in the tests.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "build" / "bench"


def machine_line() -> str:
    """What the figures below were measured on: the CPU as Linux names it, its logical CPUs, the
    load average, and NumPy's BLAS with the kernel it chose (OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE,
    where set, change that choice and with it the BLAS's speed)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        load = f"load average {os.getloadavg()[0]:.2f}"
    except (OSError, AttributeError):
        load = "no load average"
    try:
        import numpy  # noqa: F401 - threadpoolctl sees only loaded libraries
        from threadpoolctl import threadpool_info

        blas = ", ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')} kernel)"
                         for i in threadpool_info() if i.get("user_api") == "blas") or "no BLAS found"
    except ImportError:
        blas = "BLAS unknown"
    env = ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"))
    return f"machine: {cpu}, {os.cpu_count()} logical CPUs, {load}; NumPy's BLAS: {blas}; {env}"


def main(argv: list[str]) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    print(machine_line(), flush=True)
    files = sorted(HERE.glob("bench_*.py"))
    if argv:
        files = [f for f in files if any(a in f.stem for a in argv)]
    failed = []
    for path in files:
        print(f"\n=== {path.stem}", flush=True)
        t0 = time.perf_counter()
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            module.main(OUT)
        except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others
            traceback.print_exc()
            failed.append(path.stem)
        print(f"({path.stem}: {time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\nplots and tables in {OUT.relative_to(HERE.parent)}/")
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
