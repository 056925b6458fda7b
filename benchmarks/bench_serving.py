"""Lesson 15: the served tiny GPT under load.

1. Decode tokens/s for one sequence at 512 tokens, four ways in one run (minitorch.fused_decode.
   decode_speeds, the table the lesson prints): no cache (lesson 11's gpt_forward on every token),
   lesson 11's dense-cache step (forward_cached), and the engine's step for one request with
   decode="reference" (lesson 11's paged_forward) and decode="fused" (the default: one Numba
   function per step). Greedy from a 16-token prompt on a GPT of the tiny GPT's shape with a
   528-token context and random weights, float32, one thread; tokens/s after N tokens = N / the
   time of the first N steps (as bench_kvcache), per step the fastest of 3 interleaved runs (2 for
   no cache). Targets: fused >= 2x lesson 11's step, cache vs no cache >= 20x, at 512 tokens.
   Then the median step for batches of 1 and 16: lesson 11's dense step at b = 1, the engine's
   reference and fused steps, on the tiny GPT (context about 40) and at 512 tokens.
2. int8 against float32: the engine's reference decode step (paged_forward) with every Linear
   layer run as W8A8 (lesson 10's per-channel int8 weights, per-token int8 activations,
   matmul_int8 with int32 accumulation) against float32 (NumPy's BLAS), batch 1 and 16, on the
   tiny GPT and on a wider GPT of random weights (d = 512, 4 layers: 12.6 M parameters, 50 MB in
   float32, 13 MB in int8, larger than the CPU's caches). One thread for both (BLAS and Numba:
   see one_thread for why matmul_int8's parallel kernel measured the OS scheduler before). The
   benchmark swaps minitorch.kv_cache.linear for the run; nothing in the lessons changes; the fused
   step does not call it. What it shows: on the tiny GPT int8 runs at about 0.4-0.5x float32
   (its weights sit in the cache, so the bytes saved buy nothing, and quantizing each
   activation costs NumPy calls). On the wider model at batch 1, where a step reads every
   weight once and is bound by memory, int8 reads 4x fewer weight bytes: 1.33x and 1.34x
   float32 in two runs at load 3-4, but 0.59x in a third, so on a shared machine read it as
   "about even to a third faster"; at batch 16 float32's BLAS GEMM reuses each weight 16 times
   while lesson 10's int8 kernel computes one int8 dot product per output: about even
   (0.89-1.06x). Int8 is a memory saving here (4x smaller weights), a speed-up only where the
   weight bytes bound the step.
3. Throughput: the server (minitorch.api_server.serve, float32, fused decode, 64 blocks of 8, max_running 32) in its
   own process, its engine in a third (EngineProcess, serve()'s default) and then, for
   comparison, in a thread of the server's process; 128 requests of sample_workload (prompts of
   8-32 characters, 8-24 new tokens, greedy, streamed) sent one at a time, and by 16 concurrent
   clients (each sends its next request when the last one is answered), 3 interleaved runs of
   each, the fastest kept (the machine is shared). Output tokens/s and the ratio (target >= 3x,
   for the default). The load generator (run_load) shares the machine's cores with the server:
   the CPU seconds per output token of the server (its engine process included) and of the load
   generator are printed beside each run.
4. Latency at half the saturating rate: the saturating rate is the request rate the server
   reaches with every request sent at once; then Poisson arrivals at half that rate: TTFT, TPOT
   and ITL percentiles, goodput under TTFT <= 250 ms and TPOT <= 50 ms.

Wall times (perf_counter), medians of repeated steps, on a machine that may be shared: read the
ratios. The load generator and the server run in separate processes so that they do not share
one interpreter lock. `make bench L=serving`.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import numba
import numpy as np

import minitorch.kv_cache as kv_cache_mod
from minitorch.quant import matmul_int8, quantize
from minitorch.bench import blas_limit, load_report
from minitorch.kv_cache import KVCache, forward_cached, load_tiny_weights, random_gpt_weights
from minitorch.engine import Engine
from minitorch.metrics import goodput, latency_stats, poisson_arrivals
from minitorch.fused_decode import decode_speeds, print_decode_speeds
from minitorch.serving_kit import ServerProcess, process_threads, run_load, sample_workload

SMALL = os.environ.get("MINITORCH_SMALL") == "1"
REPEATS = 1 if SMALL else 3                        # interleaved throughput runs (section 3)
ROOT = Path(__file__).resolve().parent.parent


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) that process pid and its children have used so far, all their
    threads (Linux's /proc; nan elsewhere): the server's HTTP process and its engine process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + sum(process_cpu(int(c)) for c in children)


def tokens_per_s(records, duration):
    assert all(r["status"] == 200 for r in records), "a request failed"
    return sum(len(r["token_times"]) for r in records) / duration


def load_section() -> None:
    n = 24 if SMALL else 128
    work = sample_workload(n, 1)
    print(f"\n3. throughput, {n} requests, the server in its own process and its engine in a third (serve()'s "
          f"default) or in a thread of the server's; the fastest of {REPEATS} interleaved runs")
    print(f"{'engine':>8} {'clients':>8} {'tokens/s':>9} {'requests/s':>11} {'ratio':>6}   "
          "CPU ms per output token: server (with its engine process), load generator; load average and the "
          "server's threads after the run")
    for engine_process in (True, False):
        server = ServerProcess(num_blocks=64, block_size=8, max_running=32, step_interval=0.0,
                               engine_process=engine_process)
        with server as url:
            run_load(url, sample_workload(8, 99), [0] * 8)                       # warm up
            best: dict[int, tuple] = {}
            for _ in range(REPEATS):               # interleaved; the fastest run of each kept
                for clients in (1, 16):
                    s0, c0 = process_cpu(server.proc.pid), time.process_time()
                    records, duration = run_load(url, work, [0] * n, max_concurrency=clients)
                    tokens = sum(len(r["token_times"]) for r in records)
                    cpu = (1e3 * (process_cpu(server.proc.pid) - s0) / tokens,
                           1e3 * (time.process_time() - c0) / tokens,
                           os.getloadavg()[0], process_threads(server.proc.pid))
                    if clients not in best or duration < best[clients][1]:
                        best[clients] = (records, duration, cpu)
            if engine_process:
                burst, dsat = run_load(url, sample_workload(n, 2), [0] * n)
                sat = n / dsat
                half, dhalf = run_load(url, sample_workload(n, 3), poisson_arrivals(sat / 2, n, 4))
        (one, d1, cpu1), (many, d16, cpu16) = best[1], best[16]
        t1, t16 = tokens_per_s(one, d1), tokens_per_s(many, d16)
        kind = "process" if engine_process else "thread"
        print(f"{kind:>8} {1:>8} {t1:>9.0f} {n / d1:>11.1f} {1.0:>5.1f}x   {cpu1[0]:.3f}, {cpu1[1]:.3f}; "
              f"load {cpu1[2]:.1f}, {cpu1[3] or '?'} threads")
        print(f"{kind:>8} {16:>8} {t16:>9.0f} {n / d16:>11.1f} {t16 / t1:>5.1f}x   {cpu16[0]:.3f}, {cpu16[1]:.3f}; "
              f"load {cpu16[2]:.1f}, {cpu16[3] or '?'} threads" + ("  (target >= 3x)" if engine_process else ""))
        if engine_process:
            print(f"{kind:>8} {'all':>8} {tokens_per_s(burst, dsat):>9.0f} {sat:>11.1f} "
                  f"{tokens_per_s(burst, dsat) / t1:>5.1f}x  (saturating rate)")
    s = latency_stats(half)
    print(f"\n4. Poisson arrivals at half the saturating rate ({sat / 2:.1f} requests/s)")
    for k in ("ttft", "tpot", "itl"):
        print(f"   {k.upper():>4}: p50 {1e3 * s[k]['p50']:7.2f} ms   p90 {1e3 * s[k]['p90']:7.2f} ms   "
              f"p99 {1e3 * s[k]['p99']:7.2f} ms")
    print(f"   goodput (TTFT <= 250 ms, TPOT <= 50 ms): {goodput(half, dhalf, 0.25, 0.05):.1f} of "
          f"{n / dhalf:.1f} requests/s")


def engine_decode_time(W, batch: int, prompt_len: int, steps: int, decode: str = "fused") -> float:
    """Median seconds of one decode step of `batch` sequences after prompts of prompt_len."""
    eng = Engine(W, num_blocks=batch * (-(-W.block_size // 8)), block_size=8, max_running=batch,
                 max_num_batched_tokens=batch * prompt_len, prefix_caching=False, decode=decode)
    rng = np.random.default_rng(batch)
    for _ in range(batch):
        eng.add_request(rng.integers(0, W.vocab_size, prompt_len), steps + 2)
    eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def dense_decode_time(W, prompt_len: int, steps: int) -> float:
    cache = KVCache.for_model(W)
    rng = np.random.default_rng(0)
    forward_cached(W, cache, rng.integers(0, W.vocab_size, (1, prompt_len)))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        forward_cached(W, cache, rng.integers(0, W.vocab_size, (1, 1)))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def decode_section() -> None:
    n = 128 if SMALL else 512
    W = random_gpt_weights(block_size=16 + n, dtype=np.float32)
    print("\n1. decode, one sequence")
    runs = decode_speeds(W, n, Engine, repeats=3, no_cache_repeats=1 if SMALL else 2)
    print_decode_speeds(runs, W)
    rate = {k: n / v.sum() for k, v in runs.items()}
    print(f"at {n} tokens: the fused step {rate['engine fused'] / rate['lesson 11']:.2f}x lesson 11's step "
          f"(target >= 2x); cache vs no cache {rate['engine fused'] / rate['no cache']:.1f}x with the fused step, "
          f"{rate['lesson 11'] / rate['no cache']:.1f}x with lesson 11's (target >= 20x)")

    tiny = load_tiny_weights(np.float32)
    long_ctx = random_gpt_weights(block_size=528, dtype=np.float32)
    steps = 8 if SMALL else 24
    print("\n   median decode step, tokens/s, float32, one thread")
    print(f"{'model':>18} {'context':>8} {'L11 dense b=1':>14} {'engine ref b=1':>15} {'fused b=1':>10} "
          f"{'fused / L11':>12} {'ref b=16':>9} {'fused b=16':>11} {'fused b=16 / b=1':>17}")
    with blas_limit(1):
        for name, Wm, ctx in (("tiny GPT", tiny, 32), ("tiny shape, 528", long_ctx, 512 - steps)):
            dense = dense_decode_time(Wm, ctx, steps)
            ref1 = engine_decode_time(Wm, 1, ctx, steps, "reference")
            e1 = engine_decode_time(Wm, 1, ctx, steps)
            ref16 = engine_decode_time(Wm, 16, ctx, steps, "reference")
            e16 = engine_decode_time(Wm, 16, ctx, steps)
            print(f"{name:>18} {ctx + steps // 2:>8} {1 / dense:>14.0f} {1 / ref1:>15.0f} {1 / e1:>10.0f} "
                  f"{dense / e1:>11.2f}x {16 / ref16:>9.0f} {16 / e16:>11.0f} {(16 / e16) / (1 / e1):>16.1f}x")


@contextmanager
def int8_linears(W):
    """Run every Linear of W as W8A8 (per-channel int8 weights, per-token int8 activations)."""
    qw = {}
    for name, w in W.params.items():
        if name.startswith("blocks.") and name.endswith(".weight") and w.ndim == 2:
            q = quantize(w.astype(np.float32), bits=8, symmetric=True, block=(w.shape[0], 1))
            # (K, N) as the transpose of a C-contiguous (N, K): matmul_int8 wants b.T contiguous, so it
            # then copies nothing per call
            qw[name[:-len(".weight")]] = (np.ascontiguousarray(q.q.T).T, q.scale)
    original = kv_cache_mod.linear

    def linear8(x, params, name):
        q = qw.get(name)
        if q is None:
            return original(x, params, name)
        k = x.shape[-1]
        x2 = np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32)
        qx = quantize(x2, bits=8, symmetric=True, block=(1, k))
        out = matmul_int8(qx.q, q[0]).astype(np.float32) * qx.scale * q[1]
        return out.reshape(*x.shape[:-1], -1) + params[name + ".bias"]

    kv_cache_mod.linear = linear8
    try:
        yield
    finally:
        kv_cache_mod.linear = original


@contextmanager
def one_thread():
    """NumPy's BLAS and Numba's parallel loops on one thread (numba.set_num_threads is per calling
    thread). matmul_int8's kernel is `parallel=True`: on 2 cores shared with other work, each call
    then waits at the parallel region's barrier for a worker thread the OS has not scheduled yet
    (OpenMP threading layer): a median of 40 ms for a (16, 64) @ (64, 256) product, against 80 us
    on one thread. A decode step makes 8 such calls, so the int8 rows measured the scheduler."""
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with blas_limit(1):
            yield
    finally:
        numba.set_num_threads(before)


def int8_section() -> None:
    steps = 8 if SMALL else 24
    print("\n2. int8 (W8A8, matmul_int8) against float32, the engine's reference decode step, one thread, "
          "context 32")
    print(f"{'model':>22} {'batch':>6} {'float32 tok/s':>14} {'int8 tok/s':>11} {'int8 / f32':>11}")
    models = (("tiny GPT (d 64)", load_tiny_weights(np.float32)),
              ("d 512, 4 layers", random_gpt_weights(n_layer=4, n_embd=512, n_head=8, dtype=np.float32)))
    with one_thread():
        for name, W in models:
            for b in (1, 16):
                f32 = engine_decode_time(W, b, 32, steps, "reference")
                with int8_linears(W):
                    engine_decode_time(W, b, 32, 2, "reference")              # compile the kernel
                    i8 = engine_decode_time(W, b, 32, steps, "reference")
                print(f"{name:>22} {b:>6} {b / f32:>14.0f} {b / i8:>11.0f} {f32 / i8:>10.2f}x")


def main(out_dir: Path) -> None:
    print(load_report())
    decode_section()
    int8_section()
    load_section()


if __name__ == "__main__":
    main(ROOT / "build" / "bench")
