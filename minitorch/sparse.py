# Generated from solutions/18_sparsity.py by `make build`. Do not edit.
"""minitorch.sparse: pruning (magnitude per layer and global, structured heads and MLP channels,
Wanda), masked fine-tuning, the CSR and 2:4 formats with their Numba sparse-dense matmul kernels,
timings against dense BLAS, and a model of sparse matrix products on a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any, Callable, NamedTuple

import numpy as np
from numba import njit

from minitorch.checks import check_int, check_number
from minitorch.gpt import get_batch
from minitorch.nn import Module
from minitorch.optim import Adam
from minitorch.kv_cache import GPTWeights


def _check_sparsity(what: str, sparsity: Any) -> float:
    """`sparsity` as a float in [0, 1], or the error naming it."""
    return check_number(what, "sparsity", sparsity, 0.0, 1.0)


def _n_pruned(sparsity: float, n: int) -> int:
    """How many of n weights a sparsity prunes: round(sparsity * n), Python's round (halves to
    even); 0.3 of 10 is 3 although 0.3 * 10 is 3.0000000000000004 in floating point."""
    return int(round(sparsity * n))


def magnitude_mask(w: np.ndarray, sparsity: float) -> np.ndarray:
    """The mask (bool, w's shape, True = kept) that prunes the round(sparsity * w.size) entries of
    smallest |w|; among equal |w| the lower flat (C-order) index is pruned first. w: a float array
    of any shape (size 0 gives an empty mask); sparsity in [0, 1]."""
    w = np.asarray(w)
    sparsity = _check_sparsity("magnitude_mask", sparsity)
    keep = np.ones(w.size, bool)
    order = np.argsort(np.abs(w), axis=None, kind="stable")
    keep[order[:_n_pruned(sparsity, w.size)]] = False
    return keep.reshape(w.shape)


def global_magnitude_masks(weights: dict[str, np.ndarray], sparsity: float) -> dict[str, np.ndarray]:
    """One threshold for all: {name: mask} pruning the round(sparsity * total size) entries of
    smallest |w| over every array of `weights` together (compared in float64). Ties: the array
    earlier in the dict first, then the lower flat index. The masks keep the dict's order."""
    sparsity = _check_sparsity("global_magnitude_masks", sparsity)
    names = list(weights)
    arrays = [np.asarray(weights[n]) for n in names]
    flat = np.concatenate([np.abs(a.astype(np.float64)).ravel() for a in arrays]) if arrays else np.zeros(0)
    keep = np.ones(flat.size, bool)
    keep[np.argsort(flat, kind="stable")[:_n_pruned(sparsity, flat.size)]] = False
    out, start = {}, 0
    for name, a in zip(names, arrays):
        out[name] = keep[start:start + a.size].reshape(a.shape)
        start += a.size
    return out


def apply_masks_(model: Module, masks: dict[str, np.ndarray]) -> None:
    """Prune in place: for every name in masks, the parameter of that name (model.named_parameters())
    is multiplied by its mask, and so is its gradient if it has one (.grad not None). KeyError naming
    a name that is no parameter; ValueError naming both shapes when a mask's shape is not its
    parameter's. The parameters keep their dtype."""
    params = dict(model.named_parameters())
    for name, mask in masks.items():
        if name not in params:
            raise KeyError(f"apply_masks_: the model has no parameter {name!r}")
        p, mask = params[name], np.asarray(mask)
        if mask.shape != tuple(p.shape):
            raise ValueError(f"apply_masks_: mask {name!r} has shape {mask.shape}, the parameter {tuple(p.shape)}")
        p.data *= mask
        if p.grad is not None:
            p.grad.data *= mask


def prunable_weights(model: Module) -> dict[str, np.ndarray]:
    """{name: array} of the 2-D parameters inside model.blocks (a GPT's attention and MLP weights),
    in named_parameters() order. The arrays are the parameters' own, not copies."""
    return {name: p.data for name, p in model.named_parameters() if name.startswith("blocks.") and p.ndim == 2}


def mask_sparsity(masks: dict[str, np.ndarray]) -> float:
    """The fraction of entries the masks prune, over all of them (0.0 for no entries)."""
    total = sum(int(np.size(m)) for m in masks.values())
    kept = sum(int(np.count_nonzero(m)) for m in masks.values())
    return (total - kept) / total if total else 0.0


def lm_step_loss(model: Module, x: np.ndarray, y: np.ndarray) -> Any:
    """The language-model loss of a GPT on a batch (what finetune minimises by default)."""
    return model(x, y)[1]


def finetune(model: Module, train_ids: np.ndarray, steps: int, params: list | None = None, batch_size: int = 16,
             lr: float = 1e-3, seed: int = 0, on_grads: Callable | None = None, on_step: Callable | None = None,
             loss_fn: Callable | None = None) -> list[float]:
    """Train `model` in place with Adam over `params` (default: all its parameters) for `steps` steps
    on random windows of train_ids (get_batch with np.random.default_rng(seed)). Each step: forward,
    loss_fn(model, x, y) (default lm_step_loss), zero_grad, backward, on_grads(), optimizer step,
    on_step(). Returns the loss of each step."""
    vocab = model.config.vocab_size
    if train_ids.size and (train_ids.min() < 0 or train_ids.max() >= vocab):
        raise ValueError(f"finetune: train_ids must hold ids in [0, vocab_size={vocab}), got values "
                         f"{train_ids.min()}..{train_ids.max()}")
    rng = np.random.default_rng(seed)
    params = list(model.parameters()) if params is None else list(params)
    optimizer = Adam(params, lr=lr)
    loss_fn = lm_step_loss if loss_fn is None else loss_fn
    losses = []
    model.train()
    for _ in range(steps):
        x, y = get_batch(train_ids, batch_size, model.config.block_size, rng)
        loss = loss_fn(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        if on_grads is not None:
            on_grads()
        optimizer.step()
        if on_step is not None:
            on_step()
        losses.append(loss.item())
    model.eval()
    return losses


def channel_scores(w_in: np.ndarray, w_out: np.ndarray) -> np.ndarray:
    """Importance of the H hidden channels between w_in (C, H) and w_out (H, C): float64 (H,),
    score_j = ||w_in[:, j]||_2 * ||w_out[j, :]||_2."""
    w_in, w_out = np.asarray(w_in, np.float64), np.asarray(w_out, np.float64)
    if w_in.ndim != 2 or w_out.ndim != 2 or w_in.shape[1] != w_out.shape[0]:
        raise ValueError(f"channel_scores: need w_in (C, H) and w_out (H, C), got {w_in.shape} and {w_out.shape}")
    return np.sqrt((w_in * w_in).sum(axis=0)) * np.sqrt((w_out * w_out).sum(axis=1))


def head_scores(w_v: np.ndarray, w_o: np.ndarray, n_head: int) -> np.ndarray:
    """Importance of n_head heads from the value weight w_v (C, n_head * hd) and the output
    projection w_o (n_head * hd, C): float64 (n_head,), score_h = ||w_v[:, h hd:(h+1) hd]||_F *
    ||w_o[h hd:(h+1) hd, :]||_F."""
    w_v, w_o = np.asarray(w_v, np.float64), np.asarray(w_o, np.float64)
    n_head = check_int("head_scores", "n_head", n_head, 1)
    if w_v.ndim != 2 or w_o.ndim != 2 or w_v.shape[1] != w_o.shape[0] or w_v.shape[1] % n_head:
        raise ValueError(f"head_scores: need w_v (C, n_head * hd) and w_o (n_head * hd, C) with n_head={n_head}, got "
                         f"{w_v.shape} and {w_o.shape}")
    hd = w_v.shape[1] // n_head
    v = w_v.reshape(w_v.shape[0], n_head, hd)
    o = w_o.reshape(n_head, hd, w_o.shape[1])
    return np.sqrt((v * v).sum(axis=(0, 2))) * np.sqrt((o * o).sum(axis=(1, 2)))


def prune_mlp(W: GPTWeights, n_keep: int) -> GPTWeights:
    """W with every layer's MLP cut to its n_keep best channels by channel_scores(fc.weight,
    proj.weight) (ties: the lower index), in increasing index order: fc.weight's columns, fc.bias's
    entries and proj.weight's rows. A new GPTWeights; W is not modified."""
    params = dict(W.params)
    for i in range(W.n_layer):
        pre = f"blocks.{i}.mlp."
        fc, proj = params[pre + "fc.weight"], params[pre + "proj.weight"]
        n_keep = check_int("prune_mlp", "n_keep", n_keep, 1, fc.shape[1])
        keep = np.sort(np.argsort(-channel_scores(fc, proj), kind="stable")[:n_keep])
        params[pre + "fc.weight"] = fc[:, keep]
        params[pre + "fc.bias"] = params[pre + "fc.bias"][keep]
        params[pre + "proj.weight"] = proj[keep]
    return replace(W, params=params)


def prune_heads(W: GPTWeights, n_keep: int) -> GPTWeights:
    """W with every layer cut to its n_keep best heads by head_scores(attn.v.weight, attn.proj.weight,
    n_head) (ties: the lower index), in increasing order: those heads' columns of attn.q, attn.k and
    attn.v (weights and biases) and rows of attn.proj.weight; n_head = n_kv_head = n_keep. W must have
    n_kv_head == n_head (ValueError otherwise). A new GPTWeights; W is not modified."""
    if W.n_kv_head != W.n_head:
        raise ValueError(f"prune_heads: needs n_kv_head == n_head, got n_head={W.n_head}, n_kv_head={W.n_kv_head}")
    n_keep = check_int("prune_heads", "n_keep", n_keep, 1, W.n_head)
    params = dict(W.params)
    for i in range(W.n_layer):
        pre = f"blocks.{i}.attn."
        hd = params[pre + "v.weight"].shape[1] // W.n_head
        scores = head_scores(params[pre + "v.weight"], params[pre + "proj.weight"], W.n_head)
        heads = np.sort(np.argsort(-scores, kind="stable")[:n_keep])
        cols = (heads[:, None] * hd + np.arange(hd)).ravel()
        for name in ("q", "k", "v"):
            params[pre + name + ".weight"] = params[pre + name + ".weight"][:, cols]
            params[pre + name + ".bias"] = params[pre + name + ".bias"][cols]
        params[pre + "proj.weight"] = params[pre + "proj.weight"][cols]
    return replace(W, params=params, n_head=n_keep, n_kv_head=n_keep)


def input_norms(x: np.ndarray) -> np.ndarray:
    """The L2 norm of each input feature over the calibration tokens: x (T, in) -> float64 (in,),
    norms[i] = sqrt(sum_t x[t, i]^2) (zeros when T = 0)."""
    x = np.asarray(x, np.float64)
    if x.ndim != 2:
        raise ValueError(f"input_norms: x must be (T, in), got shape {x.shape}")
    return np.sqrt((x * x).sum(axis=0))


def wanda_mask(w: np.ndarray, norms: np.ndarray, sparsity: float) -> np.ndarray:
    """Wanda's mask for a layer y = x @ w, w (in, out): scores |w[i, j]| * norms[i] (norms (in,),
    from input_norms), and in every output column j the round(sparsity * in) smallest scores are
    pruned (ties: the lower i first). bool (in, out), True = kept."""
    w, norms = np.asarray(w), np.asarray(norms, np.float64)
    sparsity = _check_sparsity("wanda_mask", sparsity)
    if w.ndim != 2 or norms.shape != (w.shape[0],):
        raise ValueError(f"wanda_mask: need w (in, out) and norms (in,), got {w.shape} and {norms.shape}")
    scores = np.abs(w.astype(np.float64)) * norms[:, None]
    keep = np.ones(w.shape, bool)
    order = np.argsort(scores, axis=0, kind="stable")[:_n_pruned(sparsity, w.shape[0])]
    np.put_along_axis(keep, order, False, axis=0)
    return keep


class CSR(NamedTuple):
    """A (M, K) in compressed sparse row form: indptr (M + 1,) int64, indices (nnz,) int32 (the
    columns, increasing within a row), data (nnz,) the values, shape (M, K)."""
    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    shape: tuple[int, int]

    @property
    def nnz(self) -> int:
        return int(self.data.shape[0])

    def nbytes(self) -> int:
        """Bytes stored: data, indices and indptr."""
        return int(self.data.nbytes + self.indices.nbytes + self.indptr.nbytes)


def to_csr(a: np.ndarray) -> CSR:
    """The CSR form of a 2-D array a (M, K): every entry that is not == 0, row by row, columns
    increasing; data in a's dtype, indices int32, indptr int64."""
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"to_csr: a must be 2-D (M, K), got shape {a.shape}")
    rows, cols = np.nonzero(a)
    indptr = np.zeros(a.shape[0] + 1, np.int64)
    indptr[1:] = np.cumsum(np.bincount(rows, minlength=a.shape[0]))
    return CSR(indptr, cols.astype(np.int32), a[rows, cols], (int(a.shape[0]), int(a.shape[1])))


@njit(cache=False)
def csr_matmul_kernel(indptr, indices, data, b, out):
    """out (M, N) += A @ b for A in CSR form (indptr, indices, data) and b (K, N): for each row i,
    for each of its nonzeros (j, a_ij), out[i, :] += a_ij * b[j, :]. Reads b only at the rows j
    that row i's nonzeros name."""
    n = b.shape[1]
    for i in range(indptr.shape[0] - 1):
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            v = data[p]
            for col in range(n):
                out[i, col] += v * b[j, col]


def csr_matmul(a: CSR, b: np.ndarray) -> np.ndarray:
    """A @ b for A in CSR form and a dense b (K, N): (M, N) in np.result_type(a.data, b), through
    csr_matmul_kernel (given: checks the shapes, passes zeros to accumulate into)."""
    m, k = a.shape
    b = np.asarray(b)
    if b.ndim != 2 or b.shape[0] != k:
        raise ValueError(f"csr_matmul: A is {a.shape}, so b must be ({k}, N), got shape {b.shape}")
    if a.indptr.shape != (m + 1,) or a.indices.shape != a.data.shape:
        raise ValueError(f"csr_matmul: indptr {a.indptr.shape}, indices {a.indices.shape} and data {a.data.shape} "
                         f"do not describe a CSR matrix of shape {a.shape}")
    out = np.zeros((m, b.shape[1]), np.result_type(a.data, b))
    csr_matmul_kernel(a.indptr, a.indices, a.data, np.ascontiguousarray(b), out)
    return out


BLAS_HANDICAPS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # unset in the timing process


def sparse_timings(m: int = 1024, k: int = 1024, n: int = 64, densities: tuple = (0.01, 0.05, 0.1, 0.2, 0.5),
                   rounds: int = 3, seed: int = 0, timeout: float = 300.0) -> dict[str, Any]:
    """Best seconds of C = A @ B, A (m, k) float32, B (k, n) float32, one thread each, measured in a
    child process (so that BLAS_HANDICAPS are unset before NumPy loads OpenBLAS, and BLAS and Numba
    get one thread): {"dense": NumPy's dense product, "csr": {density: csr_matmul at that density,
    random positions}, "sparse24": sparse24_matmul of A pruned 2:4, "csr24": csr_matmul of the same
    2:4 matrix, "env": what was unset, "load": the load average before}. k must be a multiple of 4."""
    if k % 4:
        raise ValueError(f"sparse_timings: k must be a multiple of 4 (2:4 groups), got {k}")
    env = {key: v for key, v in os.environ.items() if key not in BLAS_HANDICAPS}
    env.update(OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    args = json.dumps(dict(m=m, k=k, n=n, densities=list(densities), rounds=rounds, seed=seed))
    code = f"import json, minitorch.sparse as s; print(json.dumps(s._timing_child(**json.loads({args!r}))))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"sparse_timings: the timing process failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["csr"] = {float(d): t for d, t in out["csr"].items()}
    out["env"] = {key: os.environ.get(key, "(not set)") for key in BLAS_HANDICAPS}
    return out


def _timing_child(m: int, k: int, n: int, densities: list, rounds: int, seed: int) -> dict[str, Any]:
    import time

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    values, meta = compress_2_4(a)
    a24 = to_csr(decompress_2_4(values, meta))
    runs: dict[str, Callable] = {"dense": lambda: a @ b, "sparse24": lambda: sparse24_matmul(values, meta, b),
                                 "csr24": lambda: csr_matmul(a24, b)}
    for d in densities:
        sparse = to_csr(np.where(rng.random((m, k)) < d, a, np.float32(0)))
        runs[f"csr {d}"] = (lambda s_: lambda: csr_matmul(s_, b))(sparse)
    best = {name: float("inf") for name in runs}
    for fn in runs.values():
        fn()  # compile, warm up
    for _ in range(rounds):
        for name, fn in runs.items():
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    return {"dense": best["dense"], "sparse24": best["sparse24"], "csr24": best["csr24"],
            "csr": {str(d): best[f"csr {d}"] for d in densities}, "load": load,
            "shape": [m, k, n]}


def break_even(densities: list, sparse_times: list, dense_time: float) -> float | None:
    """The density at which the sparse time crosses the dense time, interpolated linearly between the
    measured points (sorted by density); None if it never does within them."""
    d = np.asarray(densities, np.float64)
    t = np.asarray(sparse_times, np.float64)
    order = np.argsort(d)
    d, t = d[order], t[order]
    for i in range(len(d) - 1):
        if (t[i] - dense_time) * (t[i + 1] - dense_time) <= 0 and t[i] != t[i + 1]:
            return float(d[i] + (dense_time - t[i]) * (d[i + 1] - d[i]) / (t[i + 1] - t[i]))
    return None


def compress_2_4(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prune a (M, K), K a multiple of 4, to 2:4 along K and compress it: (values, meta). values
    (M, K/2) in a's dtype: the 2 entries of largest |a| of each group of 4 (ties: the lower
    position), in increasing position; meta (M, ceil(K/8)) uint8: the positions (0..3), 2 bits
    each, slot s of a row in bits 2*(s % 4) and 2*(s % 4)+1 of byte s // 4 (unused bits 0)."""
    a = np.asarray(a)
    if a.ndim != 2 or a.shape[1] % 4:
        raise ValueError(f"compress_2_4: a must be (M, K) with K a multiple of 4, got shape {a.shape}")
    m, k = a.shape
    groups = a.reshape(m, k // 4, 4)
    pos = np.sort(np.argsort(-np.abs(groups), axis=2, kind="stable")[:, :, :2], axis=2)
    values = np.take_along_axis(groups, pos, axis=2).reshape(m, k // 2)
    slots = np.zeros((m, -(-k // 8) * 4), np.uint8)
    slots[:, :k // 2] = pos.reshape(m, k // 2)
    meta = slots[:, 0::4] | (slots[:, 1::4] << 2) | (slots[:, 2::4] << 4) | (slots[:, 3::4] << 6)
    return values, meta.astype(np.uint8)


@njit(cache=False)
def sparse24_kernel(values, meta, b, out):
    """out (M, N) += A @ b for A in 2:4 form: values (M, K/2), meta (M, ceil(K/8)) uint8 as
    compress_2_4 makes them, b (K, N). Value slot s of row i multiplies row 4 * (s // 2) + (its
    2-bit position) of b. Reads values, meta and those rows of b; builds no dense copy of A."""
    m, half = values.shape
    n = b.shape[1]
    for i in range(m):
        for s in range(half):
            j = (s >> 1) * 4 + ((meta[i, s >> 2] >> ((s & 3) * 2)) & 3)
            v = values[i, s]
            for col in range(n):
                out[i, col] += v * b[j, col]


def sparse24_matmul(values: np.ndarray, meta: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A @ b for A in 2:4 form (values (M, K/2), meta (M, ceil(K/8)) uint8) and b (K, N) with
    K = 2 * values.shape[1]: (M, N) in np.result_type(values, b), through sparse24_kernel (given:
    checks the shapes, passes zeros to accumulate into)."""
    values, meta, b = np.asarray(values), np.asarray(meta), np.asarray(b)
    if values.ndim != 2 or meta.ndim != 2 or b.ndim != 2:
        raise ValueError(f"sparse24_matmul: values, meta and b must be 2-D, got {values.shape}, {meta.shape}, {b.shape}")
    m, half = values.shape
    if half % 2 or b.shape[0] != 2 * half or meta.shape != (m, -(-half // 4)) or meta.dtype != np.uint8:
        raise ValueError(f"sparse24_matmul: values {values.shape} need meta ({m}, {-(-half // 4)}) uint8 and b "
                         f"({2 * half}, N), got meta {meta.shape} {meta.dtype} and b {b.shape}")
    out = np.zeros((m, b.shape[1]), np.result_type(values, b))
    sparse24_kernel(values, meta, np.ascontiguousarray(b), out)
    return out


def decompress_2_4(values: np.ndarray, meta: np.ndarray) -> np.ndarray:
    """The dense (M, K) matrix, K = 2 * values.shape[1], that values (M, K/2) and meta (M, ceil(K/8))
    uint8 (compress_2_4's layout) describe: zeros except at the positions meta names."""
    values, meta = np.asarray(values), np.asarray(meta)
    m, half = values.shape
    if half % 2 or meta.shape != (m, -(-half // 4)):
        raise ValueError(f"decompress_2_4: values {values.shape} need meta of shape ({m}, {-(-half // 4)}), "
                         f"got {meta.shape}")
    s = np.arange(half)
    pos = (meta[:, s // 4] >> (2 * (s % 4)).astype(np.uint8)) & 3
    dense = np.zeros((m, 2 * half), values.dtype)
    np.put_along_axis(dense, (s // 2) * 4 + pos.astype(np.int64), values, axis=1)
    return dense


def sparse24_nbytes(m: int, k: int, itemsize: int) -> int:
    """Bytes of a 2:4 matrix (M, K) compressed: M K/2 values of `itemsize` bytes plus M ceil(K/8)
    bytes of metadata."""
    return m * (k // 2) * itemsize + m * -(-k // 8)


def mask_2_4(scores: np.ndarray) -> np.ndarray:
    """The 2:4 mask of a layer weight from its scores (in, out) (|w| for magnitude, Wanda's scores):
    in each group of 4 consecutive inputs of every output, the 2 of highest score kept (ties: the
    lower input), as compress_2_4 chooses them. bool (in, out), in a multiple of 4."""
    scores = np.asarray(scores, np.float64)
    if scores.ndim != 2 or scores.shape[0] % 4:
        raise ValueError(f"mask_2_4: scores must be (in, out) with in a multiple of 4, got shape {scores.shape}")
    groups = scores.T.reshape(scores.shape[1], -1, 4)
    pos = np.argsort(-groups, axis=2, kind="stable")[:, :, :2]
    keep = np.zeros(groups.shape, bool)
    np.put_along_axis(keep, pos, True, axis=2)
    return keep.reshape(scores.shape[1], -1).T


GPU_SPECS = {  # datasheet figures (hardware_notes/gpu.md): rates in FLOP/s, bandwidth in bytes/s
    "H100 SXM": {"tensor": 989e12, "tensor_2_4": 1979e12, "fp32": 67e12, "bandwidth": 3.35e12},
    "A100 SXM 80GB": {"tensor": 312e12, "tensor_2_4": 624e12, "fp32": 19.5e12, "bandwidth": 2.039e12},
}
GPU_KINDS = ("dense", "2:4", "csr", "sparse load, dense compute")


def gpu_matmul_time(m: int, k: int, n: int, density: float, kind: str, gpu: str = "H100 SXM",
                    efficiency: float = 0.3) -> float:
    """Modelled seconds of A (m, k) @ B (k, n) in bf16 on `gpu` (a GPU_SPECS key): max(flops / rate,
    bytes / bandwidth). kind: "dense" (tensor cores, 2mkn flops), "2:4" (sparse tensor cores: the same
    2mkn at twice the rate; A as 2:4 values plus 2-bit positions; density is 0.5 by construction),
    "csr" (fp32 lanes at `efficiency` of their peak, 2 nnz n flops; A as bf16 values, int32 indices
    and row pointers), "sparse load, dense compute" (Flash-LLM: CSR's bytes, dense flops on the tensor
    cores). B and C are dense bf16 in every case."""
    if kind not in GPU_KINDS:
        raise ValueError(f"gpu_matmul_time: kind must be one of {GPU_KINDS}, got {kind!r}")
    return float(_model_time(m, k, n, np.float64(density), kind, GPU_SPECS[gpu], efficiency))


def _model_time(m: int, k: int, n: int, density: Any, kind: str, spec: dict, efficiency: float) -> Any:
    """gpu_matmul_time for an array of densities at once (what the live figure draws)."""
    nnz = density * m * k
    other = 2.0 * (k * n + m * n)
    csr_bytes = nnz * 6.0 + 4.0 * (m + 1)
    flops, rate, a_bytes = {
        "dense": (2.0 * m * k * n, spec["tensor"], 2.0 * m * k),
        "2:4": (2.0 * m * k * n, spec["tensor_2_4"], float(sparse24_nbytes(m, k, 2))),
        "csr": (2.0 * nnz * n, spec["fp32"] * efficiency, csr_bytes),
        "sparse load, dense compute": (2.0 * m * k * n, spec["tensor"], csr_bytes),
    }[kind]
    return np.maximum(flops / rate, (a_bytes + other) / spec["bandwidth"])


from minitorch.checks import Array, Attrs, Choice, Count, Fraction, Instance, Number, Positive, Size, validate_public  # noqa: E402, I001

_FLOATS = Array(dtypes=("float32", "float64"))
_MATRIX = Array(ndim=2, dtypes=("float32", "float64"))
validate_public(globals(), {
    "magnitude_mask": {"w": _FLOATS, "sparsity": Fraction},
    "global_magnitude_masks": {"weights": Instance(dict, must="a dict {name: float array}"), "sparsity": Fraction},
    "apply_masks_": {"model": Instance(Module, must="a minitorch Module"),
                     "masks": Instance(dict, must="a dict {parameter name: bool array}")},
    "channel_scores": {"w_in": _MATRIX, "w_out": _MATRIX},
    "head_scores": {"w_v": _MATRIX, "w_o": _MATRIX, "n_head": Size},
    "prune_mlp": {"W": Instance(GPTWeights), "n_keep": Size},
    "prune_heads": {"W": Instance(GPTWeights), "n_keep": Size},
    "input_norms": {"x": _MATRIX},
    "wanda_mask": {"w": _MATRIX, "norms": Array(ndim=1, dtypes="real"), "sparsity": Fraction},
    "to_csr": {"a": Array(ndim=2, dtypes="real")},
    "csr_matmul": {"a": Instance(CSR), "b": _MATRIX},
    "compress_2_4": {"a": _MATRIX},
    "sparse24_matmul": {"values": _MATRIX, "meta": Array(ndim=2, dtypes="uint8"), "b": _MATRIX},
    "decompress_2_4": {"values": _MATRIX, "meta": Array(ndim=2, dtypes="uint8")},
    "sparse24_nbytes": {"m": Count, "k": Size, "itemsize": Size},
    "mask_2_4": {"scores": _MATRIX},
    "prunable_weights": {"model": Instance(Module, must="a minitorch Module")},
    "mask_sparsity": {"masks": Instance(dict, must="a dict {name: bool array}")},
    "finetune": {"model": Attrs("config", "parameters", "train"), "train_ids": Array(ndim=1, dtypes="int"),
                 "steps": Size, "batch_size": Size, "lr": Positive},
    "sparse_timings": {"m": Size, "k": Size, "n": Size, "rounds": Size, "timeout": Positive},
    "break_even": {"dense_time": Positive},
    "gpu_matmul_time": {"m": Size, "k": Size, "n": Size, "density": Fraction, "kind": Choice(*GPU_KINDS),
                        "gpu": Choice(*GPU_SPECS), "efficiency": Number(0, 1, lo_open=True)},
})
