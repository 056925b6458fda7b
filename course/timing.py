"""How fast is this machine right now? Time limits in grading scale with the answer.

Every time limit in the course (a test's, a notebook cell's while loading) is set from the cost
measured on the 2-core development machine, with a margin. A slower laptop, or one busy with
other work, needs more: `time_scale()` runs a fixed ~30 ms workload a few times and returns how
many times slower than the development machine it ran (at least 1, at most MAX_SCALE). The
grader measures it once and passes it to its child processes in MT_TIME_SCALE.
"""

from __future__ import annotations

import os
import statistics
import time

NOMINAL_S = 0.026  # the workload's time on the idle 2-core development machine
MAX_SCALE = 4.0


def _workload() -> int:
    import numpy as np

    s = 0
    for i in range(300_000):
        s += i * i % 7
    a = np.arange(200_000, dtype=np.float64)
    for _ in range(20):
        a = np.sqrt(a * a + 1.0)
    return s


def measure_scale(repeat: int = 5) -> float:
    """Median wall time of the workload over NOMINAL_S, clamped to [1, MAX_SCALE]."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        _workload()
        times.append(time.perf_counter() - t0)
    return min(MAX_SCALE, max(1.0, statistics.median(times) / NOMINAL_S))


def time_scale() -> float:
    """MT_TIME_SCALE if set (by the grader, or by hand), else measured now (and remembered)."""
    value = os.environ.get("MT_TIME_SCALE")
    if not value:
        value = f"{measure_scale():.2f}"
        os.environ["MT_TIME_SCALE"] = value
    return max(1.0, float(value))


def load_note() -> str:
    """A sentence about how busy the machine is, for time-limit messages ('' when quiet)."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average (Windows has no os.getloadavg)
        return ""
    scale = float(os.environ.get("MT_TIME_SCALE") or 1)
    if load > cores or scale > 1.5:
        return (f" This machine is slow or busy right now (load average {load:.1f} on {cores} cores, "
                f"{scale:.1f}x slower than the course's reference machine; the limit was already scaled by "
                f"that): the limit may have been hit for that reason rather than because of the code. "
                f"Run it again when the machine is quieter.")
    return ""
