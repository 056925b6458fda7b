"""Lesson 11: decoding with and without a KV cache, continuous batching, speculative decoding.

1. Decode tokens/s with and without the KV cache after 128, 256, 512 and 1,024 generated tokens
   (greedy, one sequence, float32), on a GPT of the tiny GPT's shape (2 layers, d = 64, 4 heads)
   with a 1,040-token context and random weights: the trained model's context is 64 positions,
   and speed does not depend on the weights. Tokens/s after N tokens = N / (time of the first N
   steps of a 1,024-token run); per step, the fastest of three runs with the cache and two without,
   interleaved. Saves kvcache_latency.png:
   the time of each step against its position. The same up to 512 tokens for a 4x wider model
   (d = 256, 8 heads), where the cached step's time is mostly arithmetic rather than NumPy's
   per-call overhead.
2. Continuous batching (minitorch.kv_cache.Scheduler, paged cache, blocks of 8) against serving the
   same 48 requests one at a time with the dense cache (generate), on the trained tiny GPT in
   float32: prompts of 4-40 characters of the validation text, 8-24 new tokens, all waiting at
   the start. Tokens/s of generated tokens, and model steps.
3. Speculative decoding on the tiny GPT (float32, k = 4, prompts of 16 characters, 48 new tokens)
   with a bigram draft and with the model's own first layer as the draft, greedy and at
   temperature 1, against plain decoding through the same loop (k = 0): tokens/s, tokens per
   target call, acceptance rate.

Times are wall time (perf_counter), best of several runs (as each section says), on a machine that may be shared: read the
ratios. `make bench L=kvcache`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from minitorch.gpt import CharTokenizer, load_corpus, split_ids, tiny_gpt_meta
from minitorch.kv_cache import (BigramLM, CachedLM, Request, Scheduler, decode_latencies, generate, load_tiny_weights,
                                random_gpt_weights, speculative_generate, truncate_layers)

SMALL = os.environ.get("MINITORCH_SMALL") == "1"


def decode_table(out_dir: Path | None, n_embd: int = 64, n_head: int = 4, n_max: int = 1024,
                 passes: tuple[bool, ...] = (True, False, True, False, True)) -> None:
    """Tokens/s with and without the cache up to n_max tokens; the latency plot if out_dir."""
    n_max = min(n_max, 256) if SMALL else n_max
    prompt_len = 16
    W = random_gpt_weights(block_size=n_max + prompt_len, n_embd=n_embd, n_head=n_head, dtype=np.float32, seed=0)
    prompt = np.random.default_rng(0).integers(0, W.vocab_size, prompt_len)
    runs = {True: np.full(n_max, np.inf), False: np.full(n_max, np.inf)}
    for use in passes:                                    # interleaved; per step, the fastest run
        runs[use] = np.minimum(runs[use], decode_latencies(W, prompt, n_max, use))
    print(f"\ndecode, one sequence, greedy, float32, {W.n_layer} layers, d = {W.n_embd}, {W.n_head} heads, "
          f"{prompt_len}-token prompt")
    print(f"{'tokens':>7} {'cache tok/s':>12} {'no cache tok/s':>15} {'ratio':>7} {'cache ms/token':>15} "
          f"{'no-cache ms at last':>20}")
    for n in (128, 256, 512, 1024):
        if n > n_max:
            break
        t_c, t_n = runs[True][:n].sum(), runs[False][:n].sum()
        print(f"{n:>7} {n / t_c:>12,.0f} {n / t_n:>15,.1f} {t_n / t_c:>6.1f}x {1e3 * np.median(runs[True][1:n]):>15.3f} "
              f"{1e3 * runs[False][n - 1]:>20.2f}")
    c = runs[True][1:]
    quarter = len(c) // 4
    print(f"with the cache, median ms per token in the first and last quarter of positions: "
          f"{1e3 * np.median(c[:quarter]):.3f}, {1e3 * np.median(c[-quarter:]):.3f}")
    if out_dir is None:
        return

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = prompt_len + np.arange(n_max)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.semilogy(pos[1:], 1e3 * runs[False][1:], lw=1, label="no cache (recompute the prefix)")
    ax.semilogy(pos[1:], 1e3 * runs[True][1:], lw=1, label="KV cache")
    ax.set_xlabel("position of the new token")
    ax.set_ylabel("ms per token")
    ax.set_title(f"decode latency per token, d = {W.n_embd}, {W.n_layer} layers, float32")
    ax.legend()
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    fig.savefig(out_dir / "kvcache_latency.png", dpi=120)
    plt.close(fig)


def tiny_data() -> tuple[CharTokenizer, np.ndarray, np.ndarray]:
    tok = CharTokenizer(tiny_gpt_meta()["vocab"])
    train_ids, val_ids = split_ids(tok.encode(load_corpus()))
    return tok, train_ids, val_ids


def request_set(n: int, seed: int, ids: np.ndarray) -> list[Request]:
    r = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p_len = int(r.integers(4, 41))
        new = int(r.integers(8, 25))
        s = int(r.integers(0, len(ids) - p_len))
        out.append(Request(i, ids[s:s + p_len], new))
    return out


def batching_table(val_ids: np.ndarray) -> None:
    W = load_tiny_weights(np.float32)
    reqs = request_set(16 if SMALL else 48, 1, val_ids)
    n_tokens = sum(r.max_new_tokens for r in reqs)
    best = {}
    for _ in range(2):
        t0 = time.perf_counter()
        for r in reqs:
            generate(W, r.prompt, r.max_new_tokens)
        best["alone"] = min(best.get("alone", 1e9), time.perf_counter() - t0)
        for blocks in (64, 400):
            sched = Scheduler(W, num_blocks=blocks, block_size=8)
            t0 = time.perf_counter()
            sched.run([Request(r.id, r.prompt, r.max_new_tokens) for r in reqs])
            best[blocks] = min(best.get(blocks, 1e9), time.perf_counter() - t0)
            best[f"steps{blocks}"] = len(sched.history)
            best[f"pre{blocks}"] = sum(len(h["preempted"]) for h in sched.history)
    print(f"\ncontinuous batching, {len(reqs)} requests, {n_tokens} generated tokens, tiny GPT float32")
    print(f"{'':<34} {'tokens/s':>9} {'ratio':>6} {'model steps':>12} {'preemptions':>12}")
    print(f"{'one at a time (dense cache)':<34} {n_tokens / best['alone']:>9,.0f} {1:>5.1f}x {n_tokens:>12} {0:>12}")
    for blocks in (64, 400):
        print(f"{f'continuous, {blocks} blocks of 8':<34} {n_tokens / best[blocks]:>9,.0f} "
              f"{best['alone'] / best[blocks]:>5.1f}x {best[f'steps{blocks}']:>12} {best[f'pre{blocks}']:>12}")


def speculative_table(train_ids: np.ndarray, val_ids: np.ndarray) -> None:
    W = load_tiny_weights(np.float32)
    starts = np.random.default_rng(5).integers(0, len(val_ids) - 16, 4 if SMALL else 16)
    prompts = [val_ids[s:s + 16] for s in starts]
    drafts = {"none (k = 0)": None, "bigram": lambda: BigramLM(train_ids, W.vocab_size),
              "first layer": lambda: CachedLM(truncate_layers(W, 1))}
    print(f"\nspeculative decoding, tiny GPT float32 (target with a KV cache), {len(prompts)} prompts x 48 tokens")
    print(f"{'draft':<14} {'T':>4} {'k':>2} {'tokens/s':>9} {'speed-up':>9} {'tokens/call':>12} {'accept rate':>12}")
    for temperature in (0.0, 1.0):
        base = None
        for name, factory in drafts.items():
            k = 0 if factory is None else 4
            seconds = []
            for _ in range(2):                    # best of two runs (the same work each time)
                totals = {"accepted": 0, "rejected": 0, "target_calls": 0}
                produced, t0 = 0, time.perf_counter()
                for j, prompt in enumerate(prompts):
                    draft = factory() if factory else BigramLM(train_ids[:2], W.vocab_size)
                    out, st = speculative_generate(CachedLM(W), draft, prompt, 48, k, temperature,
                                                   np.random.default_rng(j))
                    produced += len(out)
                    for key in totals:
                        totals[key] += st[key]
                seconds.append(time.perf_counter() - t0)
            rate = produced / min(seconds)
            base = rate if base is None else base
            tried = totals["accepted"] + totals["rejected"]
            acc = f"{totals['accepted'] / tried:.3f}" if tried else "-"
            print(f"{name:<14} {temperature:>4} {k:>2} {rate:>9,.0f} {rate / base:>8.2f}x "
                  f"{produced / totals['target_calls']:>12.2f} {acc:>12}")


def main(out_dir: Path) -> None:
    decode_table(out_dir)
    # A 4x wider model: here the cached step is mostly arithmetic rather than NumPy's per-call
    # overhead (which dominates the 64-wide step), as in a real model. 512 tokens: the uncached
    # run alone takes about 25 s.
    decode_table(None, n_embd=256, n_head=8, n_max=512, passes=(True, False, True))
    _, train_ids, val_ids = tiny_data()
    batching_table(val_ids)
    speculative_table(train_ids, val_ids)


if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "build" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    main(out)
