# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.fused_decode: the engine's decode step as one Numba function (FusedDecoder): every
layer of lesson 09's transformer for a batch of new tokens over lesson 11's paged KV cache, in a
compiled loop with no Python between the operations, and the measurement of what that buys
(decode_speeds). A variant of lesson 09's GPT.forward: the same weights (lesson 11's GPTWeights
layout), the same arithmetic, one token per row against the cache."""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numba import njit


from minitorch.attention import FASTMATH  # noqa: E402 - lesson 09's flags: the dot products vectorise, -inf stays -inf

# In the package, Numba keeps these kernels' machine code beside this file (__pycache__), so each
# engine process loads it instead of compiling it (seconds); a notebook cell has no file to keep it
# beside, nor has a read-only install a place, so there they compile. Numba sees a change of this
# file, not of lesson 09's FASTMATH: after changing those flags, delete minitorch/__pycache__/fused_decode.*
CACHE_KERNELS = os.path.isfile(globals().get("__file__") or "") and \
    os.access(os.path.dirname(globals()["__file__"]), os.W_OK)


@njit(cache=CACHE_KERNELS, nogil=True, fastmath=FASTMATH)
def _layer_norm_rows(x, w, b, eps, out):
    """out[r] = (x[r] - mean) / sqrt(var + eps) * w + b for each row of x (B, C) (biased variance)."""
    nb, c = x.shape
    for r in range(nb):
        mean = 0.0
        for i in range(c):
            mean += x[r, i]
        mean /= c
        var = 0.0
        for i in range(c):
            d = x[r, i] - mean
            var += d * d
        rstd = 1.0 / math.sqrt(var / c + eps)
        for i in range(c):
            out[r, i] = (x[r, i] - mean) * rstd * w[i] + b[i]


@njit(cache=CACHE_KERNELS, nogil=True, fastmath=FASTMATH)
def _linear_rows(x, w, b, out):
    """out (B, n_out) = x (B, n_in) @ w (n_in, n_out) + b (n_out,); the inner loop runs along a row
    of w (contiguous), so it vectorises."""
    nb, n_in = x.shape
    n_out = w.shape[1]
    for r in range(nb):
        for j in range(n_out):
            out[r, j] = b[j]
        for i in range(n_in):
            xi = x[r, i]
            for j in range(n_out):
                out[r, j] += xi * w[i, j]


@njit(cache=CACHE_KERNELS, nogil=True, fastmath=FASTMATH)
def fused_decode_kernel(tokens, positions, tables, wte, wpe, ln, wqkv, bqkv, wo, bo, wfc, bfc, wp2, bp2, lnf,
                        k_pool, v_pool, n_head, eps, out_rows, logits):
    """One step of lesson 09's GPT over B new tokens (rows) of sequences in a paged KV cache: one
    token each for decodes, several consecutive ones for a prefill chunk.

    tokens, positions (B,) int64: each row's token and its position in its sequence; the rows of
    one sequence come in increasing position (each attends to the keys the rows before it wrote in
    the same layer). tables (B, max_blocks) int64: each row's sequence's block table, covering
    its position. Weights, all in one float dtype (FusedDecoder.pack): wte (V, C), wpe (T, C);
    ln (L, 4, C) = LayerNorm 1 weight, bias, LayerNorm 2 weight, bias; wqkv (L, C, (Hq + 2 Hkv) hd)
    and bqkv (L, (Hq + 2 Hkv) hd), q then k then v; wo (L, C, C), bo (L, C); wfc (L, C, 4C),
    bfc (L, 4C); wp2 (L, 4C, C), bp2 (L, C); lnf (2, C). k_pool, v_pool (L, num_blocks, Hkv,
    block_size, hd): the pool; this step writes each sequence's new key and value at its
    position's slot. out_rows (B_out,) int64: the rows whose logits to write, in logits (B_out, V).
    """
    nb = tokens.shape[0]
    n_layer, c = wqkv.shape[0], wte.shape[1]
    n_kv_head, bs, hd = k_pool.shape[2], k_pool.shape[3], k_pool.shape[4]
    group = n_head // n_kv_head
    k_at, v_at = n_head * hd, (n_head + n_kv_head) * hd      # where k and v start in a row of qkv
    dt = wte.dtype
    x, h = np.empty((nb, c), dt), np.empty((nb, c), dt)        # the residual stream, a LayerNorm's output
    qkv = np.empty((nb, wqkv.shape[2]), dt)
    att, res = np.empty((nb, c), dt), np.empty((nb, c), dt)   # merged heads, a sublayer's output
    hid = np.empty((nb, wfc.shape[2]), dt)
    scores = np.empty(tables.shape[1] * bs, dt)
    scale = 1.0 / math.sqrt(hd)
    for r in range(nb):
        for i in range(c):
            x[r, i] = wte[tokens[r], i] + wpe[positions[r], i]
    for layer in range(n_layer):
        _layer_norm_rows(x, ln[layer, 0], ln[layer, 1], eps, h)
        _linear_rows(h, wqkv[layer], bqkv[layer], qkv)
        for r in range(nb):
            pos = positions[r]
            block, slot = tables[r, pos // bs], pos % bs
            for g in range(n_kv_head):
                for d in range(hd):
                    k_pool[layer, block, g, slot, d] = qkv[r, k_at + g * hd + d]
                    v_pool[layer, block, g, slot, d] = qkv[r, v_at + g * hd + d]
            n_keys = pos + 1                                     # keys 0 .. pos: the causal bound
            for head in range(n_head):
                g, q0 = head // group, head * hd                 # its K/V head; its columns in q and att
                q, o = qkv[r, q0:q0 + hd], att[r, q0:q0 + hd]
                for b0 in range(0, n_keys, bs):                  # scores, a block of the table at a time
                    k_block = k_pool[layer, tables[r, b0 // bs], g]            # (block_size, hd)
                    for j in range(min(bs, n_keys - b0)):
                        s = dt.type(0)
                        for d in range(hd):
                            s += q[d] * k_block[j, d]
                        scores[b0 + j] = s * scale
                m = scores[0]
                for j in range(1, n_keys):
                    m = max(m, scores[j])
                total = dt.type(0)
                for j in range(n_keys):                          # softmax, unnormalised
                    scores[j] = math.exp(scores[j] - m)
                    total += scores[j]
                o[:] = 0.0
                for b0 in range(0, n_keys, bs):                  # the weighted sum of the values
                    v_block = v_pool[layer, tables[r, b0 // bs], g]
                    for j in range(min(bs, n_keys - b0)):
                        p = scores[b0 + j]
                        for d in range(hd):
                            o[d] += p * v_block[j, d]
                for d in range(hd):
                    o[d] /= total
        _linear_rows(att, wo[layer], bo[layer], res)
        for r in range(nb):
            for i in range(c):
                x[r, i] += res[r, i]
        _layer_norm_rows(x, ln[layer, 2], ln[layer, 3], eps, h)
        _linear_rows(h, wfc[layer], bfc[layer], hid)
        for r in range(nb):
            for i in range(hid.shape[1]):                        # GELU, tanh form (lesson 09)
                u = hid[r, i]
                hid[r, i] = 0.5 * u * (1.0 + math.tanh(0.7978845608028654 * (u + 0.044715 * (u * u * u))))
        _linear_rows(hid, wp2[layer], bp2[layer], res)
        for r in range(nb):
            for i in range(c):
                x[r, i] += res[r, i]
    _layer_norm_rows(x, lnf[0], lnf[1], eps, h)
    for o in range(out_rows.shape[0]):
        r = out_rows[o]
        for t in range(wte.shape[0]):                            # the output layer, tied to wte
            s = dt.type(0)
            for i in range(c):
                s += h[r, i] * wte[t, i]
            logits[o, t] = s


def _shown_ids(tokens: Any) -> str:
    """Token ids as an error message shows them: the values and, for an array, its dtype."""
    if isinstance(tokens, np.ndarray):
        return f"{tokens.tolist()!r} (an array of dtype {tokens.dtype})"
    return repr(tokens) if len(repr(tokens)) <= 80 else repr(tokens)[:77] + "..."


class FusedDecoder:
    """The engine's fused decode step for the GPTWeights W: __call__(cache, seqs, tokens) appends
    one token to each sequence of a PagedKVCache and returns the logits (len(seqs), vocab) in W's
    dtype, equal to paged_forward(W, cache, seqs, [[t] for t in tokens]) up to rounding. The
    weights are packed once, here; Numba compiles the kernel at the first call for each dtype.

    A variant of lesson 09's GPT.forward (through lesson 11's paged_forward): the same layers on the
    same weights, written as loops over rows that Numba compiles into one function per step, so
    nothing of lesson 09's (Tensor operations) or lesson 11's (NumPy calls) can run inside it; it
    reads lesson 11's GPTWeights, packed per layer. tests/machinery/test_one_transformer.py checks
    its logits against GPT.forward."""

    def __init__(self, W: Any):
        self.W = W
        self.packed = self.pack(W)

    @staticmethod
    def pack(W: Any) -> tuple[np.ndarray, ...]:
        """W's parameters as fused_decode_kernel takes them: wte, wpe, ln, wqkv, bqkv, wo, bo, wfc,
        bfc, wp2, bp2, lnf, each C-contiguous in W's dtype, per-layer arrays stacked on axis 0."""
        p, layers = W.params, range(W.n_layer)

        def stack(name: str) -> np.ndarray:
            return np.ascontiguousarray(np.stack([p[f"blocks.{i}.{name}"] for i in layers]), dtype=W.dtype)

        wqkv = np.stack([np.concatenate([p[f"blocks.{i}.attn.{n}.weight"] for n in "qkv"], axis=1) for i in layers])
        bqkv = np.stack([np.concatenate([p[f"blocks.{i}.attn.{n}.bias"] for n in "qkv"]) for i in layers])
        ln = np.stack([[p[f"blocks.{i}.{n}"] for n in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")]
                       for i in layers])
        arrays = (p["wte.weight"], p["wpe.weight"], ln, wqkv, bqkv, stack("attn.proj.weight"), stack("attn.proj.bias"),
                  stack("mlp.fc.weight"), stack("mlp.fc.bias"), stack("mlp.proj.weight"), stack("mlp.proj.bias"),
                  np.stack([p["ln_f.weight"], p["ln_f.bias"]]))
        return tuple(np.ascontiguousarray(a, dtype=W.dtype) for a in arrays)

    def warm_up(self) -> None:
        """Compile the kernel for W's dtype now (one step on a scratch cache of one block), not at the
        first request."""
        from minitorch.kv_cache import PagedKVCache

        W = self.W
        scratch = PagedKVCache(W.n_layer, W.n_kv_head, W.head_dim, 1, 1, W.dtype)
        scratch.add(0)
        self(scratch, [0], [0])

    def __call__(self, cache: Any, seqs: Sequence[Any], tokens: Any) -> np.ndarray:
        """Append one token to each sequence: the logits (len(seqs), vocab)."""
        W = self.W
        ids = np.asarray(tokens) if isinstance(tokens, (list, tuple, np.ndarray)) else np.asarray([tokens])
        if ids.ndim != 1 or len(ids) != len(seqs) or ids.dtype.kind not in "iu" or \
                not all(0 <= t < W.vocab_size for t in ids.tolist()):
            raise ValueError(f"FusedDecoder: tokens must be one token id in [0, {W.vocab_size}) for each of the "
                             f"{len(seqs)} seqs, got {_shown_ids(tokens)}")
        return self.forward(cache, seqs, ids[:, None])

    def forward(self, cache: Any, seqs: Sequence[Any], chunks: Any) -> np.ndarray:
        """paged_forward's step in one kernel call: chunks[i] (t_i >= 1,) new tokens of sequence
        seqs[i] (distinct), appended to the cache; returns the logits (len(seqs), vocab) of each
        chunk's last token, in W's dtype. Each token is a row of the kernel."""
        W = self.W
        if not isinstance(chunks, (list, tuple, np.ndarray)):
            raise TypeError(f"FusedDecoder.forward: chunks must be a list of token-id chunks, one per seq, got "
                            f"{_shown_ids(chunks)}")
        if not isinstance(seqs, (list, tuple)):
            raise TypeError(f"FusedDecoder.forward: seqs must be a list of sequence ids, got {_shown_ids(seqs)}")
        if not (hasattr(cache, "k") and hasattr(cache, "lengths") and hasattr(cache, "blocks_needed")):
            raise TypeError(f"FusedDecoder.forward: cache must be a PagedKVCache, got {type(cache).__name__}")
        chunks = [np.asarray(c).reshape(-1) for c in chunks]
        if len(chunks) != len(seqs) or len(set(seqs)) != len(seqs) or any(
                len(c) == 0 or c.dtype.kind not in "iu" or c.min() < 0 or c.max() >= W.vocab_size for c in chunks):
            raise ValueError(f"FusedDecoder.forward: chunks must be a non-empty chunk of token ids in [0, {W.vocab_size}) "
                             f"for each of the {len(seqs)} seqs (distinct), got {len(chunks)} chunks "
                             f"{[c.tolist() for c in chunks]} of dtypes {sorted({c.dtype.name for c in chunks})}")
        if cache.k.dtype != W.dtype or cache.k.shape[2:] != (W.n_kv_head, cache.block_size, W.head_dim):
            raise ValueError(f"FusedDecoder: the cache {cache.k.shape} {cache.k.dtype} does not fit the model "
                             f"({W.n_kv_head} KV heads of {W.head_dim}, {W.dtype})")
        sizes = [len(c) for c in chunks]
        starts = [cache.lengths[s] for s in seqs]
        if seqs and max(a + n for a, n in zip(starts, sizes)) > W.block_size:
            raise ValueError(f"FusedDecoder: position {max(a + n for a, n in zip(starts, sizes)) - 1} is past the "
                             f"context of {W.block_size}")
        need = sum(cache.blocks_needed(s, n) for s, n in zip(seqs, sizes))
        if need > cache.num_free:
            raise RuntimeError(f"FusedDecoder: the step needs {need} blocks, {cache.num_free} are free")
        for s, n in zip(seqs, sizes):
            cache.append(s, n)
        logits = np.empty((len(seqs), W.vocab_size), W.dtype)
        if not seqs:
            return logits
        if max(sizes) == 1:                                      # decodes only: one row per sequence
            tokens = np.concatenate(chunks).astype(np.int64)
            positions, tables = np.array(starts, dtype=np.int64), cache.block_table(seqs)
        else:
            rows = np.repeat(np.arange(len(seqs)), sizes)
            tokens = np.concatenate(chunks).astype(np.int64)
            positions = np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in zip(starts, sizes)])
            tables = cache.block_table(seqs)[rows]
        out_rows = np.cumsum(sizes, dtype=np.int64) - 1          # each chunk's last token
        fused_decode_kernel(tokens, positions, tables, *self.packed, cache.k, cache.v, W.n_head, W.ln_eps,
                            out_rows, logits)
        return logits


def decode_speeds(W: Any, n_tokens: int, engine: Callable[..., Any], prompt_len: int = 16, repeats: int = 3,
                  no_cache_repeats: int = 1, seed: int = 0, progress: bool = False) -> dict[str, np.ndarray]:
    """Seconds of each of n_tokens greedy steps of one sequence after a random prompt_len-token
    prompt (step 0 is the prompt's prefill), four ways: "no cache" (lesson 11's gpt_forward on
    every token each step), "lesson 11" (its dense-cache step, forward_cached), and the engine's
    step (`engine`, the Engine class, one request) with decode="reference" and "fused". All on one
    thread (NumPy's BLAS limited to one, like the fused step). Per step the fastest of `repeats`
    interleaved runs (no_cache_repeats for the slow one). prompt_len + n_tokens must fit
    W.block_size. progress: a progress bar (tqdm.auto), one step per run."""
    from tqdm.auto import tqdm

    from minitorch.bench import blas_limit
    from minitorch.kv_cache import decode_latencies

    prompt = np.random.default_rng(seed).integers(0, W.vocab_size, prompt_len)

    def engine_run(decode: str) -> np.ndarray:
        eng = engine(W, num_blocks=-(-W.block_size // 8), block_size=8, max_running=1,
                     max_num_batched_tokens=prompt_len, prefix_caching=False, decode=decode)
        eng.add_request(prompt, n_tokens)
        out = np.empty(n_tokens)
        for i in range(n_tokens):
            t0 = time.perf_counter()
            eng.step()
            out[i] = time.perf_counter() - t0
        return out

    runs = {k: np.full(n_tokens, np.inf) for k in ("no cache", "lesson 11", "engine reference", "engine fused")}
    with blas_limit(1), tqdm(total=1 + no_cache_repeats + 3 * repeats, desc="decode runs", unit="run",
                             disable=not progress) as bar:
        engine_run("fused")                                      # compile the kernel
        bar.update()
        for i in range(max(repeats, no_cache_repeats)):
            if i < no_cache_repeats:
                runs["no cache"] = np.minimum(runs["no cache"], decode_latencies(W, prompt, n_tokens, use_cache=False))
                bar.update()
            if i < repeats:
                runs["lesson 11"] = np.minimum(runs["lesson 11"], decode_latencies(W, prompt, n_tokens))
                runs["engine reference"] = np.minimum(runs["engine reference"], engine_run("reference"))
                runs["engine fused"] = np.minimum(runs["engine fused"], engine_run("fused"))
                bar.update(3)
    return runs


def print_decode_speeds(runs: dict[str, np.ndarray], W: Any, prompt_len: int = 16) -> None:
    """The table of decode_speeds: tokens/s after N tokens (N / the time of the first N steps)."""
    n_max = len(runs["lesson 11"])
    print(f"decode of one sequence, greedy, {np.dtype(W.dtype).name}, {W.n_layer} layers, d = {W.n_embd}, "
          f"{W.n_head} heads, {W.block_size}-token context, {prompt_len}-token prompt; tokens/s after N tokens")
    print(f"{'N':>5} {'no cache':>9} {'lesson 11':>10} {'engine ref':>11} {'engine fused':>13} {'fused / L11':>12} "
          f"{'cache / no cache: L11':>22} {'fused':>6}")
    for n in (64, 128, 256, 512, 1024):
        if n > n_max:
            break
        rate = {k: n / v[:n].sum() for k, v in runs.items()}
        print(f"{n:>5} {rate['no cache']:>9,.0f} {rate['lesson 11']:>10,.0f} {rate['engine reference']:>11,.0f} "
              f"{rate['engine fused']:>13,.0f} {rate['engine fused'] / rate['lesson 11']:>11.2f}x "
              f"{rate['lesson 11'] / rate['no cache']:>21.1f}x {rate['engine fused'] / rate['no cache']:>5.1f}x")


from minitorch.checks import Attrs, Func, Instance, Seq, Size, Unchecked, validate_public  # noqa: E402

validate_public(globals(), {
    "FusedDecoder": {"W": Attrs("params", "n_layer", "n_head", "vocab_size", "block_size", "dtype")},
    "FusedDecoder.__call__": {"cache": Attrs("k", "v", "lengths", "block_size"), "seqs": Seq()},
    "FusedDecoder.forward": {"cache": Unchecked(), "seqs": Unchecked(),   # once per step: its own checks
                             "chunks": Unchecked()},
    "decode_speeds": {"W": Attrs("params", "vocab_size", "block_size"), "n_tokens": Size, "engine": Func(),
                      "prompt_len": Size, "repeats": Size, "no_cache_repeats": Size},
    "print_decode_speeds": {"runs": Instance(dict, must="decode_speeds' dict of timings"),
                            "W": Attrs("dtype", "n_layer", "n_embd", "n_head", "block_size"), "prompt_len": Size},
})
