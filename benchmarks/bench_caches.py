"""The caches note (hardware_notes/caches.md): this machine's caches, read three ways, and false sharing.

1. The caches of CPU 0 as Linux's sysfs describes them (/sys/devices/system/cpu/cpu0/cache/index*:
   level, type, size, line, ways, sets, the CPUs sharing it; lesson 05's `cache_sizes` reads the
   same files), then what glibc's `getconf` says (on x86 from the CPUID instruction, which a
   hypervisor may pass through from its host), then which cache names CPython's `os.sysconf`
   accepts (`os.sysconf_names`) and the page size it reports.
2. False sharing, the note's experiment: two Numba threads (prange over 2) each add 1.0 to their own
   float64 slot N times, the slot index read from memory on every iteration so that the compiler
   cannot keep it in a register. Slots 0 and 1 share a 64-byte line; slots 0 and 8 are a line
   apart. Beside them the same work on one thread (both loops one after the other, slots a line
   apart): two threads that really run side by side take half of that, so "one thread / two
   threads" near 2 says they did, near 1 that they took turns, and then the effect cannot show
   (a machine shared with other jobs, or a virtual machine whose two vCPUs share a core). The
   fastest and the median of ROUNDS interleaved rounds, and the load average before and after.

Run through `make bench L=caches`.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
N = 2_000_000 if SMALL else 20_000_000  # updates per thread
ROUNDS = 3 if SMALL else 7
SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")


def sysfs_caches() -> list[str]:
    """One line per cache of CPU 0, as the note lists them (empty where there is no sysfs)."""
    rows = []
    for d in sorted(SYSFS.glob("index*")):
        def read(name: str) -> str:
            try:
                return (d / name).read_text().strip()
            except OSError:
                return "?"
        rows.append(f"{d.name}  L{read('level')} {read('type'):<12} {read('size'):>7}  line {read('coherency_line_size')} "
                    f"{read('ways_of_associativity'):>2} ways {read('number_of_sets'):>6} sets  "
                    f"shared by CPUs {read('shared_cpu_list')}")
    return rows


def getconf_caches() -> dict[str, str]:
    """glibc's cache values (getconf -a), where getconf exists."""
    try:
        out = subprocess.run(["getconf", "-a"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and "CACHE_SIZE" in parts[0] and len(parts) == 2:
            found[parts[0]] = parts[1]
    return found


def false_sharing(n: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per run of the two-thread counting loop, per layout, over interleaved rounds."""
    import numba
    from numba import njit, prange

    @njit(parallel=True)
    def count(acc, slot):  # slot: int64 (2, n); thread t adds 1.0 to acc[slot[t, i]]
        for t in prange(2):
            for i in range(slot.shape[1]):
                acc[slot[t, i]] += 1.0

    layouts = {"one line (slots 0 and 1)": (0, 1), "a line apart (slots 0 and 8)": (0, 8),
               "one thread, a line apart": (0, 8)}
    slots = {}
    for name, (a, b) in layouts.items():
        s = np.empty((2, n), np.int64)
        s[0], s[1] = a, b
        slots[name] = s
    acc = np.zeros(16, np.float64)
    count(acc, slots["one line (slots 0 and 1)"][:, :10])  # compile
    threads = min(2, numba.config.NUMBA_NUM_THREADS)
    times: dict[str, list[float]] = {name: [] for name in layouts}
    try:
        for _ in range(rounds):
            for name, s in slots.items():
                numba.set_num_threads(1 if name.startswith("one thread") else threads)
                acc[:] = 0.0
                t0 = time.perf_counter()
                count(acc, s)
                times[name].append(time.perf_counter() - t0)
                a, b = layouts[name]
                assert acc[a] == n and acc[b] == n, f"{name}: counted {acc[a]}, {acc[b]}, wanted {n} each"
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return times


def main(out_dir: Path | None = None) -> None:
    import numba

    print(f"1. the caches of CPU 0 ({platform.machine()}, {os.cpu_count()} logical CPUs)")
    rows = sysfs_caches()
    for row in rows:
        print(f"   {row}")
    if not rows:
        print("   no sysfs cache description here (not Linux?)")
    conf = getconf_caches()
    print("   getconf: " + (", ".join(f"{k} {v}" for k, v in conf.items()) or "not available"))
    names = sorted(n for n in os.sysconf_names if "CACHE" in n)
    print(f"   Python {platform.python_version()}: os.sysconf_names has {len(os.sysconf_names)} names, "
          f"cache names: {names or 'none'}; os.sysconf('SC_PAGE_SIZE') = {os.sysconf('SC_PAGE_SIZE')}")

    before = os.getloadavg()[0]
    times = false_sharing(N, ROUNDS)
    after = os.getloadavg()[0]
    print(f"\n2. false sharing: 2 threads x {N // 1_000_000} M float64 updates, {ROUNDS} interleaved rounds, "
          f"Numba {numba.get_num_threads()} threads, load average {before:.1f} before, {after:.1f} after")
    for name, ts in times.items():
        print(f"   {name:<29} fastest {1e3 * min(ts):7.1f} ms, median {1e3 * float(np.median(ts)):7.1f} ms")
    one, apart, serial = (min(ts) for ts in times.values())
    print(f"   one line / a line apart, fastest runs: {one / apart:.2f}x; one thread / two threads a line apart: "
          f"{serial / apart:.2f}x (2: side by side, 1: taking turns)")


if __name__ == "__main__":
    sys.exit(main())
