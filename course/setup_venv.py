"""`make setup`: create .venv with the pinned packages, saying briefly what happens.

Run by the system's python3 (standard library only): python3 course/setup_venv.py VENV CONSTRAINTS [--cpu].
pip's full output goes to build/setup.log; the terminal gets a progress line, the result, and on
failure pip's error and what to do.

--cpu (`make setup GPU=0`): without the `gpu` extra (CuPy and CUDA's NVRTC, nvcc and runtime wheels,
about 1 GB on Linux; nothing elsewhere). Every lesson still runs; what then skips is CPU_ONLY_SKIPS.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "build" / "setup.log"
SUPPORTED = ((3, 11), (3, 12), (3, 13))
# What a set-up without the `gpu` extra gives up (each skips with its reason; nothing fails for it).
CPU_ONLY_SKIPS = ("the checks that compile CUDA C to PTX with NVRTC (lessons 08, 09, 10 and 14) skip, saying why; "
                  "the CPU emulator still grades every CUDA C kernel; CuPy launches and GPU timings need a GPU "
                  "anyway; lesson 07 (Numba's CUDA simulator) is unaffected")


def install_spec(cpu: bool) -> str:
    """What pip installs: the course, with the `gpu` extra unless cpu."""
    return "." if cpu else ".[gpu]"


def fail(msg: str) -> None:
    print(f"\nmake setup failed: {msg}", file=sys.stderr)
    sys.exit(1)


def check_platform() -> None:
    v = sys.version_info[:2]
    if v < SUPPORTED[0]:
        fail(f"this is Python {platform.python_version()} ({sys.executable}); the course needs 3.11, 3.12 or "
             "3.13. Install one and run `make setup PYTHON=python3.12` (or put it first on PATH).")
    if v > SUPPORTED[-1]:
        print(f"note: Python {v[0]}.{v[1]} is newer than the versions the pins are checked on (3.11-3.13).")
    if sys.platform == "win32":
        fail("native Windows is not supported: use WSL2 (Ubuntu), where the course runs as on Linux.")
    if sys.platform == "darwin" and platform.machine() == "x86_64":
        print("note: macOS on Intel: numba 0.62.1 and NumPy 2.3 (numba's last Intel-Mac wheels; constraints.txt "
              "pins them there), the set .ci/run tests on Linux; the CUDA C checks skip (no NVRTC wheel).")


def run_pip(py: Path, args: list[str], log, what: str) -> None:
    """Run pip, its output into the log; on a terminal, one line of progress."""
    tty = sys.stdout.isatty()
    proc = subprocess.Popen([str(py), "-m", "pip", *args, "--progress-bar", "off"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1"))
    tail: list[str] = []
    n = 0
    for line in proc.stdout:
        log.write(line)
        tail = (tail + [line.rstrip()])[-40:]
        m = re.match(r"\s*(Collecting|Downloading|Installing collected packages)\s*(\S*)", line)
        if m and tty:
            n += m.group(1) == "Collecting"
            status = f"  {what}: {n} packages resolved, {m.group(1).lower()} {m.group(2)}"[:100]
            print("\r" + status.ljust(100), end="", flush=True)
    rc = proc.wait()
    if tty:
        print("\r" + " " * 100 + "\r", end="", flush=True)
    if rc != 0:
        lines = [l for l in tail if not l.startswith(("WARNING: Location", "  Downloading", "Collecting"))]
        first = next((i for i, l in enumerate(lines) if l.startswith("ERROR")), max(len(lines) - 25, 0))
        print("\n".join(lines[first:first + 25]), file=sys.stderr)
        fail(f"pip could not {what} (exit status {rc}); its full output is in {LOG.relative_to(ROOT)}. "
             "A network error: run `make setup` again. Anything else: open an issue with that file.")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    cpu = "--cpu" in sys.argv[1:]
    venv = ROOT / (args[0] if args else ".venv")
    constraints = args[1] if len(args) > 1 else "constraints.txt"
    check_platform()
    print(f"Setting up {venv.name}/ with Python {platform.python_version()} ({sys.executable}) on "
          f"{platform.system()} {platform.machine()}, pinned by {constraints}{', CPU only (GPU=0)' if cpu else ''} "
          "(a few minutes, once).")
    LOG.parent.mkdir(exist_ok=True)
    py = venv / "bin" / "python"
    with open(LOG, "w") as log:
        p = subprocess.run([sys.executable, "-m", "venv", str(venv)], stdout=log, stderr=subprocess.STDOUT)
        if p.returncode != 0 or not py.exists():
            fail(f"`{sys.executable} -m venv` failed (output in {LOG.relative_to(ROOT)}). On Debian and Ubuntu "
                 f"install the venv module first: sudo apt install python{sys.version_info[0]}.{sys.version_info[1]}-venv")
        run_pip(py, ["install", "--upgrade", "pip"], log, "upgrade pip")
        run_pip(py, ["install", "-c", constraints, "-e", install_spec(cpu)], log, "install the course's packages")
    out = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    have = dict(l.split("==", 1) for l in out.splitlines() if "==" in l)
    key = ", ".join(f"{n} {have[n]}" for n in ("numpy", "numba", "mpi4py", "jupyterlab") if n in have)
    gpu = "CuPy and NVRTC for lessons 08-10" if "cupy-cuda12x" in have else \
        f"CPU only (GPU=0, no CuPy/NVRTC): {CPU_ONLY_SKIPS}" if cpu else \
        "no CuPy/NVRTC wheels for this platform: lessons 08-10 grade CUDA C on the CPU emulator only"
    print(f"Done: {len(have)} packages in {venv.name}/ ({key}); {gpu}.")


if __name__ == "__main__":
    main()
