"""Lessons 18 and 19: sparse kernels and many adapters served in one batch, measured.

1. Sparse kernels (lesson 18), in a child process with one thread each (Numba and NumPy's
   OpenBLAS) and OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE removed from its environment (they hold
   OpenBLAS back where they are set): the CSR kernel at densities from 0.5% to 60% against NumPy's
   dense float32 product, with the break-even density, and the 2:4 kernel against dense and against
   the CSR kernel on the same 2:4 matrix, for A (1024, 1024) @ B (1024, N), N = 64 (a prefill
   chunk) and N = 1 (a decode step). Ratios are of times measured in the same process, kernels
   taking turns.
2. Many adapters (lesson 19): 32 requests of 16 greedy tokens over 2, 4 and 8 LoRA adapters (rank
   8 on every Linear) of a random GPT of width 512 and 4 layers (50 MB in float32: wide enough that
   a decode step reads its weights from memory, as real models do; the tiny GPT fits in cache),
   served by one AdapterEngine (one pass of the base weights per step for every request, a gathered
   low-rank product per adapter) against one merged Engine per adapter run in turn (lesson 15's
   engine, the same reference path); the same tokens both ways (checked), the better of two runs of
   each, and the weight bytes.
MINITORCH_SMALL=1: A (512, 512); width 256, 2 layers, 8 requests of 6 tokens.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

SMALL = os.environ.get("MINITORCH_SMALL") == "1"


def sparse_kernels(results: dict) -> None:
    from minitorch.sparse import break_even, sparse_timings

    m = k = 512 if SMALL else 1024
    densities = (0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6)
    results["kernels"] = {}
    for n in (64, 1):
        t = sparse_timings(m, k, n, densities=densities, rounds=2 if SMALL else 4)
        be = break_even(list(t["csr"]), list(t["csr"].values()), t["dense"])
        print(f"A ({m}, {k}) float32 @ B ({k}, {n}), one thread, load average {t['load']:.2f}; unset: {t['env']}")
        print(f"  dense NumPy BLAS {t['dense'] * 1e3:8.3f} ms")
        for d, ts in t["csr"].items():
            print(f"  CSR density {d:5.3f}   {ts * 1e3:8.3f} ms   dense / CSR = {t['dense'] / ts:6.2f}")
        print(f"  break-even density: {be:.3f}" if be is not None else "  no break-even in the range measured")
        print(f"  2:4 kernel {t['sparse24'] * 1e3:8.3f} ms: dense / 2:4 = {t['dense'] / t['sparse24']:.2f}, "
              f"CSR on the same 2:4 matrix / 2:4 = {t['csr24'] / t['sparse24']:.2f}")
        results["kernels"][f"n={n}"] = {**t, "csr": {str(d): v for d, v in t["csr"].items()}, "break_even": be,
                                        "dense_over_24": t["dense"] / t["sparse24"], "csr24_over_24": t["csr24"] / t["sparse24"]}


def many_adapters(results: dict) -> None:
    from minitorch.lora import LORA_TARGETS, AdapterEngine, merge_adapter_weights
    from minitorch.parallel import machine_load
    from minitorch.kv_cache import random_gpt_weights
    from minitorch.engine import Engine

    width, layers = (256, 2) if SMALL else (512, 4)
    W = random_gpt_weights(vocab_size=103, block_size=64, n_layer=layers, n_head=8, n_embd=width, seed=0,
                           dtype=np.float32)
    rng = np.random.default_rng(0)
    targets = [f"blocks.{i}.{t}" for i in range(layers) for t in LORA_TARGETS]
    n_req, new = (8, 6) if SMALL else (32, 16)
    prompts = [rng.integers(0, 103, 8) for _ in range(6)]
    engine_kw = dict(num_blocks=512, block_size=8, max_running=64, max_num_batched_tokens=512)
    w_bytes = sum(v.nbytes for v in W.params.values())
    results["adapters"] = {"width": width, "layers": layers, "requests": n_req, "new_tokens": new}
    print(f"random GPT, width {width}, {layers} layers, {w_bytes / 1e6:.1f} MB float32; {n_req} requests x {new} "
          f"tokens; rank-8 adapters on all {len(targets)} Linears; {machine_load()}")

    def serve(engine, items, tagged):
        t0 = time.perf_counter()
        hs = [engine.add_request(p, new, **({"adapter": a} if tagged else {})) for p, a in items]
        engine.run_until_idle()
        return time.perf_counter() - t0, [list(h.output) for h in hs]

    for n_adapters in (2, 4, 8):
        adapters = {f"a{a}": {name: ((rng.standard_normal((W.params[name + ".weight"].shape[0], 8)) / np.sqrt(width))
                                     .astype(np.float32),
                                     (rng.standard_normal((8, W.params[name + ".weight"].shape[1])) * 0.05).astype(np.float32),
                                     2.0) for name in targets} for a in range(n_adapters)}
        names = list(adapters)
        reqs = [(prompts[i % len(prompts)], names[i % n_adapters]) for i in range(n_req)]
        best_multi = best_merged = float("inf")
        for _ in range(2):  # the better of two runs of each, taking turns
            t_multi, out_multi = serve(AdapterEngine(W, adapters, **engine_kw), reqs, True)
            t_merged, outs = 0.0, {}
            for name in names:
                engine = Engine(merge_adapter_weights(W, adapters[name]), decode="reference", prefix_caching=False,
                                **engine_kw)
                t, o = serve(engine, [r for r in reqs if r[1] == name], False)
                t_merged, outs[name] = t_merged + t, iter(o)
            if not all(o == next(outs[a]) for o, (_, a) in zip(out_multi, reqs)):
                raise AssertionError("the AdapterEngine and the merged engines generated different tokens")
            best_multi, best_merged = min(best_multi, t_multi), min(best_merged, t_merged)
        a_bytes = sum(x.nbytes + y.nbytes for ad in adapters.values() for x, y, _ in ad.values())
        print(f"  {n_adapters} adapters: one AdapterEngine {best_multi:6.3f} s, merged engines in turn {best_merged:6.3f} s, "
              f"merged / one = {best_merged / best_multi:5.2f}; same tokens; weights {(w_bytes + a_bytes) / 1e6:.1f} MB "
              f"against {n_adapters * w_bytes / 1e6:.1f} MB")
        results["adapters"][str(n_adapters)] = {"multi_s": best_multi, "merged_s": best_merged,
                                                "ratio": best_merged / best_multi,
                                                "weight_bytes_multi": w_bytes + a_bytes,
                                                "weight_bytes_merged": n_adapters * w_bytes}


def main(out_dir: Path) -> None:
    results: dict = {}
    sparse_kernels(results)
    many_adapters(results)
    (Path(out_dir) / "sparse.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
