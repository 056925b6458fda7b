"""Is there a CUDA GPU that really runs kernels? Probed once per process, with a real launch."""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import sys

_PROBE = """
import cupy as cp
x = cp.arange(8, dtype=cp.float32)
k = cp.ElementwiseKernel('float32 a', 'float32 b', 'b = a * 2', 'probe_double')
assert float(k(x).sum().get()) == 56.0
print(cp.cuda.runtime.getDeviceProperties(0)['name'].decode())
"""


def driver_present() -> bool:
    """Cheap: an NVIDIA device node or nvidia-smi exists (no CUDA import)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


@functools.lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    """(True, device name) if a CuPy kernel launches and returns the right answer, else
    (False, reason). Set MINITORCH_NO_GPU=1 to force the CPU path."""
    if os.environ.get("MINITORCH_NO_GPU") == "1":
        return False, "MINITORCH_NO_GPU=1 is set"
    if not driver_present():
        return False, "no CUDA GPU on this machine (no NVIDIA driver)"
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "a test kernel launch timed out"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["unknown error"])[-1]
        return False, f"a test kernel launch failed: {last}"
    return True, out.stdout.strip()


def require_gpu() -> str:
    """The first line of every notebook cell tagged `gpu`: returns the device's name where a CUDA
    GPU runs kernels, else skips the rest of the cell with the reason (one printed line in a
    notebook, see course.notebook; a `SkipCell` exception elsewhere)."""
    from course.notebook import SkipCell

    ok, why = gpu_status()
    if not ok:
        raise SkipCell(f"this cell needs a CUDA GPU: {why}")
    return why
