"""Lesson 04's given code in minitorch.bench (the counters and converters beside the exercises,
the load report, BLAS limits, the bandwidth and peak measurements, the roofline plot) and the
contracts of the whole module: a bad argument is refused by name, never a raw error or a silent
wrong count. Measurements run tiny (a few thousand elements, one thread): what is checked is the
result's shape and sanity, not the machine's speed."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch import bench


def test_counters_and_converters():
    assert bench.elementwise_flops(7) == 7 and bench.elementwise_flops(0) == 0
    assert bench.elementwise_bytes(7, 4) == 84 and bench.elementwise_bytes(7, 8, n_inputs=1) == 112
    assert bench.softmax_flops(3, 5) == 75 and bench.softmax_bytes(3, 5, 2) == 60
    assert bench.gflops(3e9, 1.5) == 2.0 and bench.arithmetic_intensity(12.0, 48) == 0.25
    assert bench.training_memory_bytes(10) == 160 and bench.training_memory_bytes(10, "sgd", "fp32") == 80
    assert [bench.format_seconds(s) for s in (2.31, 1.52e-3, 8.12e-4, 3e-9)] == ["2.31 s", "1.52 ms", "812 us", "3 ns"]
    for call, error, message in (
            (lambda: bench.elementwise_bytes(7, 0), ValueError,
             "elementwise_bytes: itemsize must be an integer >= 1, got 0"),
            (lambda: bench.softmax_flops(3, -1), ValueError, "softmax_flops: cols must be an integer >= 0, got -1"),
            (lambda: bench.softmax_bytes(3.5, 2, 4), TypeError, "softmax_bytes: rows must be an integer >= 0, got 3.5"),
            (lambda: bench.gflops(1e9, 0.0), ValueError, "gflops: seconds must be a finite number > 0, got 0.0"),
            (lambda: bench.gflops(float("nan"), 1.0), ValueError, "gflops: flops must be .*nan"),
            (lambda: bench.arithmetic_intensity(1.0, -2), ValueError,
             "arithmetic_intensity: bytes must be .* > 0, got -2"),
            (lambda: bench.format_seconds("1 s"), TypeError, "format_seconds: s must be a finite number, got '1 s'"),
            (lambda: bench.training_memory_bytes(10, "lion"), ValueError,
             "training_memory_bytes: optimizer must be one of 'sgd', 'momentum', 'adam', got 'lion'"),
            (lambda: bench.transformer_params(2, 8, 10, d_ff=-1), ValueError,
             "transformer_params: d_ff must be an integer >= 0, got -1"),
            (lambda: bench.attainable_flops(np.array([1.0, np.nan]), 1e9, 1e9), ValueError,
             "attainable_flops: intensity must hold numbers >= 0 .*nan"),
            (lambda: bench.attainable_flops([0.5, 1.0], 1e9, 1e9), TypeError,
             r"attainable_flops: intensity must be a number >= 0 or an ndarray of them, got \[0.5, 1.0\]")):
        with pytest.raises(error, match=message):
            call()
    assert bench.attainable_flops(np.array([0.5, 2.0]), 1e9, 1e9).tolist() == [5e8, 1e9]


def test_benchmark_refuses_bad_counts_and_callables():
    for kwargs, error, message in (({"repeat": 0}, ValueError, "benchmark: repeat must be an integer >= 1, got 0"),
                                   ({"number": 1.5}, TypeError, "benchmark: number must be an integer >= 1, got 1.5"),
                                   ({"warmup": -1}, ValueError, "benchmark: warmup must be an integer >= 0, got -1"),
                                   ({"sync": 3}, TypeError, "benchmark: sync must be callable, got 3"),
                                   ({"timer": None}, TypeError, "benchmark: timer must be callable, got None")):
        with pytest.raises(error, match=message):
            bench.benchmark(lambda: None, **kwargs)
    with pytest.raises(TypeError, match="benchmark: fn must be callable, got 'f'"):
        bench.benchmark("f")


def test_load_report_and_blas_limit():
    line = bench.load_report(busy_per_core=0.75)
    assert "CPUs" in line and ("quiet enough" in line or line.startswith("WARNING") or "not available" in line)
    assert bench.load_report(busy_per_core=1e9).endswith("quiet enough to time") or "not available" in line
    with bench.blas_limit(1):
        assert all(n == 1 for n in bench.blas_threads().values())
    with bench.blas_limit(None):
        pass
    for bad, error in ((0, ValueError), (1.5, TypeError), ("1", TypeError)):
        with pytest.raises(error, match=f"blas_limit: threads must be an integer >= 1, got {bad!r}"):
            bench.blas_limit(bad)
    with pytest.raises(ValueError, match="load_report: busy_per_core must be a finite number > 0, got 0"):
        bench.load_report(0)


def test_measurements_tiny():
    bw = bench.measure_bandwidth(n=4096, repeat=2, dtype=np.float32, threads=1)
    peak = bench.measure_peak_matmul(n=48, dtype=np.float32, repeat=2, threads=1)
    assert 1e6 < bw < 1e14 and 1e6 < peak < 1e15, f"bandwidth {bw:.3g} B/s, peak {peak:.3g} FLOP/s"
    for call, error, message in (
            (lambda: bench.measure_bandwidth(n=0), ValueError, "measure_bandwidth: n must be an integer >= 1, got 0"),
            (lambda: bench.measure_bandwidth(n=16, dtype="int8"), TypeError,
             "measure_bandwidth: dtype must be a floating dtype .*'int8'"),
            (lambda: bench.measure_bandwidth(n=16, threads=0), ValueError,
             "measure_bandwidth: threads must be an integer >= 1, got 0"),
            (lambda: bench.measure_peak_matmul(n=8, dtype=None), TypeError,
             "measure_peak_matmul: dtype must be a floating dtype .*None"),
            (lambda: bench.measure_peak_matmul(n=8, repeat=2.0), TypeError,
             "measure_peak_matmul: repeat must be an integer >= 1, got 2.0")):
        with pytest.raises(error, match=message):
            call()


def test_roofline_plot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = bench.roofline_plot(1e11, 2e10, {"matmul": (20.0, 8e10), "add": (1 / 12, 2e10 / 12)}, title="t")
    try:
        labels = [t.get_text() for t in ax.texts]
        assert ax.get_title() == "t" and any(t.startswith("matmul (80%)") for t in labels)
        assert any(t.startswith("add (100%: sets the roof)") for t in labels), labels
        for kwargs, error, message in (
                ({"points": {"x": (0.0, 1e9)}}, ValueError,
                 r"roofline_plot: points\['x'\]\[0\] must be .* > 0, got 0.0"),
                ({"points": {"x": 5.0}}, TypeError, r"roofline_plot: points\['x'\] must be a pair"),
                ({"points": [(1.0, 1e9)]}, TypeError, "roofline_plot: points must be a dict"),
                ({"bandwidth": -1.0}, ValueError, "roofline_plot: bandwidth must be a finite number > 0, got -1.0"),
                ({"ax": "axes"}, TypeError, "roofline_plot: ax must be an object with `loglog`.*'axes'")):
            with pytest.raises(error, match=message):
                bench.roofline_plot(**{"peak_flops": 1e11, "bandwidth": 2e10, **kwargs})
    finally:
        plt.close("all")
