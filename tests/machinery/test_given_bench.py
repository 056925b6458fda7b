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


def test_blas_line_names_the_kernel_and_the_isa(monkeypatch):
    for k in bench.BLAS_HANDICAPS:
        monkeypatch.delenv(k, raising=False)
    assert bench.blas_forced() == {}
    line = bench.blas_line()
    assert line.startswith("NumPy's BLAS: ") and "kernel" in line and "CPU vector ISA: " in line and "NOTE" not in line
    isa = bench.vector_isa()
    assert isa["name"] in line and isa["registers"] in (16, 32) and isa["widths"]["scalar"] == 1
    assert set(isa["widths"].values()) <= {1, 4, 8, 16} and isinstance(bench.cpu_features(), set)
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert bench.blas_forced() == {"OPENBLAS_CORETYPE": "Haswell"}
    assert "NOTE: OPENBLAS_CORETYPE=Haswell" in bench.blas_line()
    env = bench.native_env()
    assert "OPENBLAS_CORETYPE" not in env and env["PYTHONPATH"]


def test_blas_matmul_gflops_here_and_in_a_child(monkeypatch):
    for k in bench.BLAS_HANDICAPS:
        monkeypatch.delenv(k, raising=False)
    here = bench.blas_matmul_gflops([16, 33], threads=1, repeat=1, rounds=1, pause=0.0)
    assert here["where"] == "this process" and set(here["gflops"]) == {16, 33} and here["error"] < 1e-5
    assert all(g > 0 for g in here["gflops"].values())
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")  # held back: the timing moves to a child without it
    child = bench.blas_matmul_gflops([16], threads=1, repeat=1, rounds=1, pause=0.0)
    assert child["where"].startswith("a child process without OPENBLAS_CORETYPE") and child["gflops"][16] > 0
    assert bench.run_native("minitorch.bench:blas_forced") == {}, "the child's environment keeps the handicaps"
    for call, error, message in (
            (lambda: bench.run_native("minitorch.bench"), ValueError, "run_native: target must be 'package.module:function'"),
            (lambda: bench.run_native(3), TypeError, "run_native: target must be a str, got 3"),
            (lambda: bench.blas_matmul_gflops([]), ValueError, r"blas_matmul_gflops: sizes must be a sequence of at least 1"),
            (lambda: bench.blas_matmul_gflops([0]), ValueError, r"blas_matmul_gflops: sizes\[0\] must be an integer >= 1"),
            (lambda: bench.blas_matmul_gflops([8], pause=-1.0), ValueError, "blas_matmul_gflops: pause must be")):
        with pytest.raises(error, match=message):
            call()


def test_the_fma_loop_and_the_compute_roof():
    ir = bench.fma_loop_ir(4, 3)
    assert ir.count("@llvm.fmuladd.v4f32(") == 4 and "%a2 = phi <4 x float>" in ir  # a declaration and 3 calls
    fn, asm = bench.fma_loop(4, 3)
    assert fn(10, 1.0, 0.5) == 5.0 * 3 and isinstance(asm, str)  # one lane of the three sums of 10 x 0.5
    assert bench.fma_loop(1, 2)[0](7, 2.0, 0.25) == 3.5 * 2
    r1 = bench.measure_fma(4, 1, seconds=0.002, repeat=2)
    r8 = bench.measure_fma(4, 8, threads=1, seconds=0.002, repeat=2)
    assert 1e8 < r1 < 1e13 and 1e8 < r8 < 1e13, (r1, r8)
    assert bench.fma_accumulators() in (12, 16)
    peaks = bench.fma_peaks(1, seconds=0.002, repeat=1)
    assert list(peaks) == list(bench.vector_isa()["widths"]) and all(p > 0 for p in peaks.values())
    assert bench.fma_roof(1, seconds=0.002, repeat=1) > 0
    for call, error, message in (
            (lambda: bench.fma_loop_ir(0, 3), ValueError, "fma_loop_ir: lanes must be an integer in \\[1, 64\\], got 0"),
            (lambda: bench.measure_fma(4, 65), ValueError, "measure_fma: accumulators must be an integer in \\[1, 64\\]"),
            (lambda: bench.fma_roof(threads=0), ValueError, "fma_roof: threads must be an integer >= 1, got 0"),
            (lambda: bench.fma_peaks(seconds=0.0), ValueError, "fma_peaks: seconds must be a finite number > 0")):
        with pytest.raises(error, match=message):
            call()


def test_a_benchmark_times_the_blas_in_a_child_without_the_handicaps(tmp_path, monkeypatch):
    """benchmarks/native_blas.ran_natively: with a handicap set, the bench file's _main runs in a child
    whose environment lacks it; without one, nothing runs and the caller times in its own process."""
    from benchmarks.native_blas import ran_natively

    bench_file = tmp_path / "bench_probe.py"
    bench_file.write_text("import os, pathlib\n\ndef _main(out):\n"
                          "    pathlib.Path(out, 'seen.txt').write_text(os.environ.get('OPENBLAS_CORETYPE', 'unset'))\n")
    for k in bench.BLAS_HANDICAPS:
        monkeypatch.delenv(k, raising=False)
    assert not ran_natively(str(bench_file), tmp_path) and not (tmp_path / "seen.txt").exists()
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert ran_natively(str(bench_file), tmp_path)
    assert (tmp_path / "seen.txt").read_text() == "unset"
