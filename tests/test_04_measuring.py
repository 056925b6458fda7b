"""Lesson 04: measuring. Graded against hand-computed values; no timing assertions."""

import math

import numpy as np
import pytest

pytestmark = pytest.mark.lesson04


# ---------------------------------------------------------------- 4.1 benchmark


class FakeDevice:
    """A fake clock plus an 'asynchronous' function: each call queues work that only reaches
    the clock when sync() drains it. The first call is slow (a JIT compile)."""

    def __init__(self, first=100.0, per_call=1.0, launch=0.01, sync_cost=0.0, async_=True):
        self.now = 0.0
        self.calls = 0
        self.syncs = 0
        self.pending = 0.0
        self.first, self.per_call, self.launch = first, per_call, launch
        self.sync_cost, self.async_ = sync_cost, async_

    def clock(self):
        return self.now

    def fn(self, *args):
        self.calls += 1
        work = self.first if self.calls == 1 else self.per_call
        self.now += self.launch
        if self.async_:
            self.pending += work
        else:
            self.now += work

    def sync(self):
        self.syncs += 1
        self.now += self.pending + self.sync_cost
        self.pending = 0.0


@pytest.mark.exercise("4.1")
@pytest.mark.parametrize("warmup,repeat,number", [(1, 5, 1), (3, 7, 4), (0, 3, 2), (2, 1, 13)])
def test_benchmark_call_counts(lesson, warmup, repeat, number):
    dev = FakeDevice(async_=False)
    t = lesson.benchmark(dev.fn, warmup=warmup, repeat=repeat, number=number, timer=dev.clock)
    assert dev.calls == warmup + repeat * number, (
        f"expected warmup + repeat*number = {warmup + repeat * number} calls of fn, got {dev.calls}")
    assert len(t.times) == repeat, f"expected one entry in times per repeat ({repeat}), got {len(t.times)}"


@pytest.mark.exercise("4.1")
def test_benchmark_excludes_warmup_and_divides_by_number(lesson):
    dev = FakeDevice(first=100.0, per_call=1.0, launch=0.0, async_=False)
    t = lesson.benchmark(dev.fn, warmup=1, repeat=4, number=3, timer=dev.clock)
    assert np.allclose(t.times, [1.0] * 4), (
        f"each call costs 1.0 s on the fake clock after a 100 s first call; with warmup=1 and number=3 "
        f"every entry of times should be 1.0 (seconds per call), got {t.times}")


@pytest.mark.exercise("4.1")
def test_benchmark_without_warmup_times_first_call(lesson):
    dev = FakeDevice(first=100.0, per_call=1.0, launch=0.0, async_=False)
    t = lesson.benchmark(dev.fn, warmup=0, repeat=3, number=1, timer=dev.clock)
    assert np.allclose(t.times, [100.0, 1.0, 1.0]), f"with warmup=0 the first run includes the slow call; got {t.times}"


@pytest.mark.exercise("4.1")
def test_benchmark_passes_args(lesson):
    seen = []
    lesson.benchmark(lambda a, b: seen.append((a, b)), 3, "x", warmup=1, repeat=2, number=2)
    assert seen == [(3, "x")] * 5, f"fn must be called as fn(*args); calls were {seen}"


@pytest.mark.exercise("4.1")
def test_benchmark_sync_inside_timed_region_and_after_warmup(lesson):
    dev = FakeDevice(first=100.0, per_call=1.0, launch=0.01, sync_cost=0.5, async_=True)
    t = lesson.benchmark(dev.fn, warmup=2, repeat=3, number=4, sync=dev.sync, timer=dev.clock)
    expected = (4 * 0.01 + 4 * 1.0 + 0.5) / 4
    assert np.allclose(t.times, [expected] * 3), (
        f"with an asynchronous fn, sync() must run once after the warm-up (so its queued work is not "
        f"timed) and inside every timed run before the clock stops; expected {expected} s per call "
        f"for each run, got {t.times}")
    assert dev.syncs == 1 + 3, f"expected 1 sync after warm-up + 1 per repeat = 4, got {dev.syncs}"


@pytest.mark.exercise("4.1")
def test_benchmark_statistics_consistent(lesson):
    costs = iter([5.0, 2.0, 9.0, 4.0, 3.0, 2.5, 7.0])
    now = [0.0]

    def fn():
        now[0] += next(costs)

    t = lesson.benchmark(fn, warmup=0, repeat=7, timer=lambda: now[0])
    times = np.array(t.times)
    assert np.allclose(times, [5.0, 2.0, 9.0, 4.0, 3.0, 2.5, 7.0]), f"times should be the per-run costs, got {t.times}"
    assert t.min == pytest.approx(times.min())
    assert t.median == pytest.approx(np.median(times))
    assert t.mean == pytest.approx(times.mean())
    assert t.std == pytest.approx(times.std(ddof=1))


@pytest.mark.exercise("4.1")
def test_benchmark_real_clock(lesson):
    calls = []
    t = lesson.benchmark(lambda: calls.append(1), warmup=2, repeat=3)
    assert len(calls) == 5 and len(t.times) == 3
    assert all(x >= 0 for x in t.times), f"times must be non-negative seconds, got {t.times}"
    assert t.min <= t.median


@pytest.mark.exercise("4.1")
@pytest.mark.parametrize("kwargs,name", [({"repeat": 0}, "repeat"), ({"number": 0}, "number"), ({"warmup": -1}, "warmup")])
def test_benchmark_rejects_bad_counts(lesson, kwargs, name):
    with pytest.raises(ValueError, match=name):
        lesson.benchmark(lambda: None, **kwargs)


# ---------------------------------------------------------------- 4.2 counters


@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("m,n,k", [(3, 5, 7), (1, 1, 1), (17, 1, 129), (4096, 4096, 4096), (0, 5, 3)])
def test_matmul_flops_and_macs(lesson, m, n, k):
    # hand count: m*n outputs, each a length-k dot product = k MACs = 2k FLOPs
    macs = m * n * k
    assert lesson.matmul_macs(m, n, k) == macs, f"matmul_macs({m},{n},{k}) should be {macs}"
    assert lesson.matmul_flops(m, n, k) == 2 * macs, f"matmul_flops({m},{n},{k}) should be {2 * macs}"
    assert isinstance(lesson.matmul_flops(m, n, k), int)


@pytest.mark.exercise("4.2")
def test_matmul_flops_hand_values(lesson):
    assert lesson.matmul_flops(3, 5, 7) == 210
    assert lesson.matmul_flops(2, 3, 4) == 48
    assert lesson.matmul_flops(10**5, 10**5, 10**5) == 2 * 10**15


@pytest.mark.exercise("4.2")
def test_matmul_bytes_hand_values(lesson):
    # A (3,7)=21, B (7,5)=35, C (3,5)=15 elements: 71 elements
    assert lesson.matmul_bytes(3, 5, 7, 4) == 284, "(3x7 + 7x5 + 3x5) * 4 bytes = 284"
    assert lesson.matmul_bytes(3, 5, 7, 8) == 568
    assert lesson.matmul_bytes(1024, 1024, 1024, 2) == 3 * 1024 * 1024 * 2
    # matrix-vector: A (1000, 1) ... (m=1, n=1000, k=513)
    assert lesson.matmul_bytes(1, 1000, 513, 4) == (513 + 513 * 1000 + 1000) * 4


@pytest.mark.exercise("4.2")
def test_matmul_bytes_matches_numpy_nbytes(lesson):
    rng = np.random.default_rng(4)
    for _ in range(5):
        m, n, k = (int(v) for v in rng.integers(1, 300, size=3))
        for dt in (np.float16, np.float32, np.float64):
            a, b = np.zeros((m, k), dt), np.zeros((k, n), dt)
            want = a.nbytes + b.nbytes + (a @ b).nbytes
            got = lesson.matmul_bytes(m, n, k, np.dtype(dt).itemsize)
            assert got == want, f"matmul_bytes({m},{n},{k},{np.dtype(dt).itemsize}) = {got}, A+B+C nbytes = {want}"


@pytest.mark.exercise("4.2")
def test_counters_reject_negative(lesson):
    with pytest.raises(ValueError):
        lesson.matmul_flops(-1, 2, 3)
    with pytest.raises(ValueError):
        lesson.matmul_bytes(2, 3, -4, 4)


# ---------------------------------------------------------------- 4.3 roofline

P, B = 100e9, 20e9  # 100 GFLOP/s, 20 GB/s: ridge at 5 FLOP/byte


@pytest.mark.exercise("4.3")
@pytest.mark.parametrize("intensity,want", [(0.0, 0.0), (1 / 12, 20e9 / 12), (0.625, 12.5e9), (1.0, 20e9),
                                            (5.0, 100e9), (4.999, 99.98e9), (171.0, 100e9), (1e6, 100e9)])
def test_attainable_hand_values(lesson, intensity, want):
    got = lesson.attainable_flops(intensity, P, B)
    assert got == pytest.approx(want, rel=1e-12), (
        f"attainable_flops({intensity}, 100e9, 20e9) should be min(100e9, {intensity} * 20e9) = {want}, got {got}")
    assert isinstance(got, float), f"a scalar intensity should give a float, got {type(got).__name__}"


@pytest.mark.exercise("4.3")
def test_attainable_array(lesson):
    i = np.geomspace(1e-3, 1e3, 37)
    got = lesson.attainable_flops(i, 7.3e12, 0.9e12)
    assert isinstance(got, np.ndarray) and got.shape == i.shape, "an array of intensities should give an array"
    np.testing.assert_allclose(got, np.minimum(7.3e12, i * 0.9e12), rtol=1e-12)


@pytest.mark.exercise("4.3")
def test_attainable_ridge_and_monotone(lesson):
    ridge = 3.3e12 / 2.0e12
    assert lesson.attainable_flops(ridge, 3.3e12, 2.0e12) == pytest.approx(3.3e12)
    vals = [lesson.attainable_flops(x, 3.3e12, 2.0e12) for x in (0.1, 0.5, 1.0, ridge, 2.0, 10.0)]
    assert all(a <= b for a, b in zip(vals, vals[1:])), f"the roofline never decreases with intensity: {vals}"


@pytest.mark.exercise("4.3")
def test_attainable_rejects_bad_input(lesson):
    with pytest.raises(ValueError):
        lesson.attainable_flops(-0.5, P, B)
    with pytest.raises(ValueError):
        lesson.attainable_flops(1.0, 0.0, B)
    with pytest.raises(ValueError):
        lesson.attainable_flops(1.0, P, -1.0)


# ---------------------------------------------------------------- 4.4 transformer params / FLOPs

GPT2 = dict(n_layers=12, d_model=768, vocab=50257, n_ctx=1024)


@pytest.mark.exercise("4.4")
def test_params_gpt2_small(lesson):
    # non-embedding: 12 * 12 * 768^2 = 84,934,656
    assert lesson.transformer_params(**GPT2, embeddings=False) == 84_934_656
    # + tokens 50257*768 = 38,597,376 + positions 1024*768 = 786,432
    assert lesson.transformer_params(**GPT2) == 124_318_464
    # untied output head: + another 50257*768
    assert lesson.transformer_params(**GPT2, tied=False) == 124_318_464 + 38_597_376


@pytest.mark.exercise("4.4")
def test_params_custom_d_ff(lesson):
    # 3 layers, d=10, d_ff=7: per layer 4*100 + 2*10*7 = 540
    assert lesson.transformer_params(3, 10, vocab=11, d_ff=7, embeddings=False) == 1620
    # + 11*10 tokens, no positions (n_ctx=0 default)
    assert lesson.transformer_params(3, 10, vocab=11, d_ff=7) == 1730
    assert lesson.transformer_params(3, 10, vocab=11, d_ff=7, n_ctx=5) == 1780
    # default d_ff = 4 d: per layer 12 d^2
    assert lesson.transformer_params(5, 13, vocab=1, embeddings=False) == 5 * 12 * 169


@pytest.mark.exercise("4.4")
def test_flops_per_token_kaplan(lesson):
    # Kaplan et al. 2020: C_forward = 2N + 2 n_layer n_ctx d_model (vocab term excluded)
    n = 84_934_656
    assert lesson.transformer_flops_per_token(12, 768, 1024) == 2 * n + 2 * 12 * 1024 * 768
    assert lesson.transformer_flops_per_token(12, 768, 1024) == 188_743_680
    # with the de-embedding matmul onto a 50257-word vocabulary: + 2 * 768 * 50257
    assert lesson.transformer_flops_per_token(12, 768, 1024, vocab=50257) == 188_743_680 + 77_194_752


@pytest.mark.exercise("4.4")
def test_flops_per_token_small_hand(lesson):
    # 2 layers, d=6, d_ff=5, n_ctx=9, vocab=7: N = 2*(144 + 60) = 408
    # 2N = 816; attention 2*2*9*6 = 216; de-embed 2*6*7 = 84
    assert lesson.transformer_flops_per_token(2, 6, 9, d_ff=5, vocab=7) == 816 + 216 + 84
    assert lesson.transformer_flops_per_token(2, 6, 0, d_ff=5) == 816


# ---------------------------------------------------------------- 4.5 training FLOPs / memory


@pytest.mark.exercise("4.5")
def test_training_flops(lesson):
    assert lesson.training_flops(1e9, 2e10) == pytest.approx(1.2e20)
    # Chinchilla: 70e9 params, 1.4e12 tokens -> 5.88e23 FLOPs
    assert lesson.training_flops(70e9, 1.4e12) == pytest.approx(5.88e23)
    assert lesson.training_flops(124_439_808, 0) == 0


@pytest.mark.exercise("4.5")
@pytest.mark.parametrize("optimizer,precision,want", [
    ("adam", "mixed", {"weights": 2, "gradients": 2, "optimizer": 12}),
    ("adam", "fp32", {"weights": 4, "gradients": 4, "optimizer": 8}),
    ("momentum", "fp32", {"weights": 4, "gradients": 4, "optimizer": 4}),
    ("momentum", "mixed", {"weights": 2, "gradients": 2, "optimizer": 8}),
    ("sgd", "fp32", {"weights": 4, "gradients": 4, "optimizer": 0}),
    ("sgd", "mixed", {"weights": 2, "gradients": 2, "optimizer": 4}),
])
def test_training_memory_breakdown(lesson, optimizer, precision, want):
    n = 7_000_003
    got = lesson.training_memory_breakdown(n, optimizer=optimizer, precision=precision)
    assert got == {k: v * n for k, v in want.items()}, (
        f"{optimizer}/{precision}: expected bytes per parameter {want}, got "
        f"{ {k: v / n for k, v in got.items()} }")


@pytest.mark.exercise("4.5")
def test_training_memory_zero_16_bytes(lesson):
    # ZeRO (Rajbhandari et al. 2019): mixed-precision Adam needs 16 bytes/param; 7.5B -> 120 GB
    got = lesson.training_memory_breakdown(7_500_000_000, "adam", "mixed")
    assert sum(got.values()) == 120_000_000_000


@pytest.mark.exercise("4.5")
def test_training_memory_rejects_unknown(lesson):
    with pytest.raises(ValueError, match="adamw"):
        lesson.training_memory_breakdown(10, optimizer="adamw")
    with pytest.raises(ValueError, match="fp8"):
        lesson.training_memory_breakdown(10, precision="fp8")


# ---------------------------------------------------------------- 4.6 Chinchilla


@pytest.mark.exercise("4.6")
def test_chinchilla_hand_values(lesson):
    # C = 6 N D, D = 20 N  ->  C = 120 N^2; C = 1.2e20 -> N = 1e9, D = 2e10
    n, d = lesson.chinchilla_optimal(1.2e20)
    assert n == pytest.approx(1e9, rel=1e-12) and d == pytest.approx(2e10, rel=1e-12), f"got N={n:.4g}, D={d:.4g}"
    # Chinchilla itself: 5.88e23 FLOPs -> 70B params, 1.4T tokens
    n, d = lesson.chinchilla_optimal(5.88e23)
    assert n == pytest.approx(70e9, rel=1e-9) and d == pytest.approx(1.4e12, rel=1e-9), f"got N={n:.4g}, D={d:.4g}"


@pytest.mark.exercise("4.6")
def test_chinchilla_other_ratio_and_consistency(lesson):
    n, d = lesson.chinchilla_optimal(6e18, tokens_per_param=10.0)
    # 6 * N * 10 N = 6e18 -> N^2 = 1e17
    assert n == pytest.approx(math.sqrt(1e17)) and d == pytest.approx(10 * math.sqrt(1e17))
    for c in (3.7e15, 1e21, 2.5e24):
        n, d = lesson.chinchilla_optimal(c)
        assert 6 * n * d == pytest.approx(c) and d / n == pytest.approx(20.0)


@pytest.mark.exercise("4.6")
def test_chinchilla_rejects_bad_budget(lesson):
    with pytest.raises(ValueError):
        lesson.chinchilla_optimal(0.0)
    with pytest.raises(ValueError):
        lesson.chinchilla_optimal(-1e20)
