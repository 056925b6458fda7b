# Generated from solutions/17_triton.py by `make build`. Do not edit.
"""minitorch.triton_kernels: lesson 17's Triton kernels and their launchers.

A fused bias + GELU, a fused row softmax, a matmul with grouped program order and a fused epilogue,
and FlashAttention-2 forward and backward, wired into minitorch's autograd. Each launcher takes
NumPy arrays (the kernel runs under Triton's interpreter, checked: minitorch.triton_interp) or
PyTorch CUDA tensors (the kernel is compiled and runs on the GPU) and returns the same kind.
"""
import functools
import math
from typing import Any

import numpy as np

from minitorch.autograd import Tensor
from minitorch.checks import check_int
# All of the machinery's names, also those only the notebook's cells use: one copy of it in the notebook.
from minitorch.triton_interp import (  # noqa: F401
    TRITON_MISSING, KernelError, KernelTrace, NumpyTensor, TritonUnavailable, _DeviceArray, autotuned, cdiv,
    compile_for_gpu, empty, launch, need_torch_cuda, need_triton, next_power_of_2, ptx_counts, tl, to_device, to_host,
    trace, triton,
)


@triton.jit
def bias_gelu_kernel(x_ptr, bias_ptr, y_ptr, M, N, stride_xm, stride_xn, stride_ym, stride_yn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = gelu_tanh(x + bias) on the (BLOCK_M, BLOCK_N) tile (pid_m, pid_n) of x, y (M, N); bias (N,)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
    b = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
    v = (x + b[None, :]).to(tl.float32)
    y = v * tl.sigmoid(2.0 * 0.7978845608028654 * (v + 0.044715 * v * v * v))
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty), mask=mask)


def bias_gelu(x: Any, bias: Any, block_m: int = 32, block_n: int = 32) -> Any:
    """gelu_tanh(x + bias) by bias_gelu_kernel. x (M, N), bias (N,): float32 or float16, any strides; NumPy
    arrays (interpreted) or PyTorch CUDA tensors (compiled). Returns y (M, N), contiguous, x's dtype and kind."""
    xd, bd = to_device(x), to_device(bias)
    m, n = xd.shape
    if tuple(bd.shape) != (n,):
        raise ValueError(f"bias_gelu: bias must have shape ({n},) for x of shape {tuple(xd.shape)}, got {tuple(bd.shape)}")
    y = empty((m, n), xd.dtype, like=xd)
    launch(bias_gelu_kernel, (cdiv(m, block_m), cdiv(n, block_n)), xd, bd, y, m, n, *xd.stride(), *y.stride(),
           BLOCK_M=block_m, BLOCK_N=block_n)
    return to_host(y, like=x)


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    """y[row] = softmax(x[row]) for row = tl.program_id(0); BLOCK >= n_cols, a power of two."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def softmax(x: Any) -> Any:
    """Row softmax of x (rows, cols) by softmax_kernel, one program per row. x: float32 or float16, its
    columns contiguous (a NumPy array with other strides is copied); NumPy (interpreted) or a PyTorch CUDA
    tensor (compiled). Returns y (rows, cols), x's dtype and kind."""
    if isinstance(x, np.ndarray) and x.ndim == 2 and x.strides[1] != x.itemsize:
        x = np.ascontiguousarray(x)
    xd = to_device(x)
    rows, cols = xd.shape
    if xd.stride()[1] != 1:
        raise ValueError(f"softmax: x's columns must be contiguous (stride 1), got strides {tuple(xd.stride())}")
    y = empty((rows, cols), xd.dtype, like=xd)
    if rows and cols:
        launch(softmax_kernel, (rows,), xd, y, cols, xd.stride()[0], y.stride()[0], BLOCK=next_power_of_2(cols))
    return to_host(y, like=x)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  stride_cm, stride_cn, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C = act(A @ B + bias) on the tile of program tl.program_id(0), in grouped order. A (M, K), B (K, N),
    C (M, N), bias (N,), strides in elements; float32 accumulation."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "gelu":
        acc = acc * tl.sigmoid(2.0 * 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc))
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


MATMUL_ACTIVATIONS = ("", "gelu")


def matmul_configs() -> list:
    """The configurations the autotuner tries on a GPU: triton.Config({BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M},
    num_warps, num_stages), from the ones Triton's matmul tutorial lists for NVIDIA GPUs."""
    need_triton()
    shapes = [(128, 256, 64, 3, 8), (64, 256, 32, 4, 4), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4),
              (64, 128, 32, 4, 4), (128, 32, 32, 4, 4), (64, 32, 32, 5, 2), (32, 64, 32, 5, 2)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=stages,
                          num_warps=warps) for bm, bn, bk, stages, warps in shapes]


def matmul(a: Any, b: Any, bias: Any = None, activation: str = "", block_m: int | None = None,
           block_n: int | None = None, block_k: int | None = None, group_m: int = 8) -> Any:
    """act(a @ b + bias) by matmul_kernel. a (M, K), b (K, N), bias (N,) or None: float32 or float16, one dtype,
    any strides; activation "" or "gelu". NumPy arrays (interpreted; blocks default to 32) or PyTorch CUDA
    tensors (compiled; autotuned over matmul_configs() unless the three block sizes are given). Returns
    c (M, N) in a's dtype and kind."""
    ad, bd = to_device(a), to_device(b)
    (m, k), (k2, n) = ad.shape, bd.shape
    if k != k2:
        raise ValueError(f"matmul: a {tuple(ad.shape)} and b {tuple(bd.shape)} do not multiply (a's columns != b's rows)")
    if ad.dtype != bd.dtype:
        raise TypeError(f"matmul: a is {ad.dtype} but b is {bd.dtype}")
    sizes = (block_m, block_n, block_k)
    if any(s is not None for s in sizes) and not all(s is not None for s in sizes):
        raise ValueError(f"matmul: give all three of block_m, block_n, block_k or none, got {sizes}")
    c = empty((m, n), ad.dtype, like=ad)
    biasd = to_device(bias) if bias is not None else c  # any valid pointer: not read without HAS_BIAS
    if bias is not None and tuple(biasd.shape) != (n,):
        raise ValueError(f"matmul: bias must have shape ({n},), got {tuple(biasd.shape)}")

    def grid(meta: dict) -> tuple[int]:
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)

    args = (ad, bd, c, biasd, m, n, k, *ad.stride(), *bd.stride(), *c.stride())
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=activation)
    if block_m is None and not isinstance(ad, NumpyTensor):
        launch(autotuned(matmul_kernel, matmul_configs(), key=["M", "N", "K"]), grid, *args, **flags)
    else:
        bm, bn, bk = (32, 32, 32) if block_m is None else sizes
        launch(matmul_kernel, grid, *args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m)
    return to_host(c, like=a)


def program_tiles(num_pid_m: int, num_pid_n: int, group_m: int) -> np.ndarray:
    """The tile (pid_m, pid_n) each program id computes in grouped order (group_m = 1: row-major):
    an int array (num_pid_m * num_pid_n, 2), row p for program p."""
    pid = np.arange(num_pid_m * num_pid_n)
    in_group = group_m * num_pid_n
    first_m = (pid // in_group) * group_m
    size_m = np.minimum(num_pid_m - first_m, group_m)
    return np.stack([first_m + (pid % in_group) % size_m, (pid % in_group) // size_m], axis=1)


def panels_per_wave(num_pid_m: int, num_pid_n: int, group_m: int, wave: int) -> np.ndarray:
    """For programs running `wave` at a time in program-id order: (row panels of A, column panels of B) that
    each wave reads, an int array (waves, 2). Fewer panels per wave: more of its loads can hit the L2 cache."""
    tiles = program_tiles(num_pid_m, num_pid_n, group_m)
    return np.array([[len(set(w[:, 0])), len(set(w[:, 1]))] for w in
                     (tiles[i:i + wave] for i in range(0, len(tiles), wave))], dtype=np.int64)


@triton.jit
def flash_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, N_Q, N_K,
                     stride_qg, stride_qm, stride_kg, stride_kn, stride_vg, stride_vn, stride_og, stride_om,
                     scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """O, lse of query block tl.program_id(0) of head tl.program_id(1): softmax(scale Q K^T (masked)) V,
    streaming over key blocks (online softmax); causal blocks above the diagonal are never loaded."""
    start_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + g * stride_qg + rows[:, None] * stride_qm + dims[None, :], mask=rows[:, None] < N_Q, other=0.0)
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    offset = N_K - N_Q
    hi = N_K
    if CAUSAL:
        hi = tl.minimum(N_K, (start_m + 1) * BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + g * stride_kg + keys[:, None] * stride_kn + dims[None, :], mask=keys[:, None] < N_K,
                    other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = keys[None, :] < N_K
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + offset)
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + g * stride_vg + keys[:, None] * stride_vn + dims[None, :], mask=keys[:, None] < N_K,
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + g * stride_og + rows[:, None] * stride_om + dims[None, :], o.to(o_ptr.dtype.element_ty),
             mask=rows[:, None] < N_Q)
    tl.store(lse_ptr + g * N_Q + rows, m_i + tl.log(l_i), mask=rows < N_Q)


HEAD_DIMS = (16, 32, 64, 128)


def _heads(x: Any, what: str, name: str) -> Any:
    """x as a (G, N, d) tensor on the device, its feature axis contiguous (a NumPy array is copied if not)."""
    if isinstance(x, np.ndarray) and x.ndim == 3 and x.strides[2] != x.itemsize:
        x = np.ascontiguousarray(x)
    xd = to_device(x)
    if xd.stride()[2] != 1:
        raise ValueError(f"{what}: {name}'s last axis must be contiguous (stride 1), got strides {tuple(xd.stride())}")
    return xd


def _check_attention(what: str, q: Any, k: Any, v: Any, causal: bool) -> tuple[int, int, int, int]:
    (g, nq, d), (gk, nk, dk), vshape = q.shape, k.shape, tuple(v.shape)
    if (gk, dk) != (g, d) or vshape != (g, nk, d):
        raise ValueError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {vshape} must be (G, Nq, d), (G, Nk, d), "
                         f"(G, Nk, d)")
    if d not in HEAD_DIMS:
        raise ValueError(f"{what}: the head dimension d must be one of {HEAD_DIMS} (tl.arange needs a power of two), "
                         f"got {d}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError(f"{what}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if nq < 1 or nk < 1:
        raise ValueError(f"{what}: need at least one query and one key, got Nq = {nq}, Nk = {nk}")
    if causal and nq > nk:
        raise ValueError(f"{what}: with causal=True every query must see a key: Nq = {nq} > Nk = {nk}")
    return g, nq, nk, d


def flash_forward(q: Any, k: Any, v: Any, causal: bool = False, block_m: int = 32,
                  block_n: int = 32) -> tuple[Any, Any]:
    """Attention by flash_fwd_kernel. q (G, Nq, d), k, v (G, Nk, d): float32 or float16, d in HEAD_DIMS; NumPy
    (interpreted) or PyTorch CUDA tensors (compiled). causal: query i sees keys j <= i + Nk - Nq (needs Nq <= Nk).
    Returns (o (G, Nq, d) in q's dtype, lse (G, Nq) float32), as lesson 09's attention_np(..., return_lse=True)."""
    qd, kd, vd = _heads(q, "flash_forward", "q"), _heads(k, "flash_forward", "k"), _heads(v, "flash_forward", "v")
    g, nq, nk, d = _check_attention("flash_forward", qd, kd, vd, causal)
    o = empty((g, nq, d), qd.dtype, like=qd)
    lse = empty((g, nq), np.float32, like=qd)
    launch(flash_fwd_kernel, (cdiv(nq, block_m), g), qd, kd, vd, o, lse, nq, nk, *qd.stride()[:2], *kd.stride()[:2],
           *vd.stride()[:2], *o.stride()[:2], 1.0 / math.sqrt(d), CAUSAL=bool(causal), HEAD_DIM=d, BLOCK_M=block_m,
           BLOCK_N=block_n)
    return to_host(o, like=q), to_host(lse, like=q)


@triton.jit
def flash_bwd_preprocess(o_ptr, do_ptr, delta_ptr, N_Q, stride_og, stride_om, stride_dog, stride_dom,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[g, i] = do[g, i] . o[g, i] (float32) for query block tl.program_id(0) of head tl.program_id(1)."""
    start_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    o = tl.load(o_ptr + g * stride_og + rows[:, None] * stride_om + dims[None, :], mask=rows[:, None] < N_Q, other=0.0)
    do = tl.load(do_ptr + g * stride_dog + rows[:, None] * stride_dom + dims[None, :], mask=rows[:, None] < N_Q,
                 other=0.0)
    tl.store(delta_ptr + g * N_Q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=rows < N_Q)


def flash_backward(q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, causal: bool = False, block_m: int = 32,
                   block_n: int = 32) -> tuple[Any, Any, Any]:
    """Gradients (dq, dk, dv) of attention by flash_bwd_preprocess and flash_bwd_kernel, from q (G, Nq, d), k, v
    (G, Nk, d), the forward's o (G, Nq, d) and lse (G, Nq), and the upstream gradient do (G, Nq, d); NumPy
    (interpreted) or PyTorch CUDA tensors (compiled). dq is float32 (atomic additions); dk, dv in k's dtype."""
    qd, kd, vd = (_heads(x, "flash_backward", n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    g, nq, nk, d = _check_attention("flash_backward", qd, kd, vd, causal)
    od, dod = _heads(o, "flash_backward", "o"), _heads(do, "flash_backward", "do")
    lsed = to_device(np.ascontiguousarray(lse) if isinstance(lse, np.ndarray) else lse)
    if tuple(od.shape) != (g, nq, d) or tuple(dod.shape) != (g, nq, d) or tuple(lsed.shape) != (g, nq):
        raise ValueError(f"flash_backward: o {tuple(od.shape)}, do {tuple(dod.shape)}, lse {tuple(lsed.shape)} must be "
                         f"({g}, {nq}, {d}), ({g}, {nq}, {d}), ({g}, {nq})")
    for name, x in (("o", od), ("do", dod)):
        if x.dtype != qd.dtype:
            raise TypeError(f"flash_backward: {name} must have q's dtype {qd.dtype}, got {x.dtype}")
    if tuple(lsed.stride()) != (nq, 1):
        raise ValueError(f"flash_backward: lse must be contiguous, got strides {tuple(lsed.stride())}")
    delta = empty((g, nq), np.float32, like=qd)
    launch(flash_bwd_preprocess, (cdiv(nq, block_m), g), od, dod, delta, nq, *od.stride()[:2], *dod.stride()[:2],
           HEAD_DIM=d, BLOCK_M=block_m)
    dq = empty((g, nq, d), np.float32, like=qd)  # zeros: the programs add into it
    if not isinstance(dq, NumpyTensor):
        dq.zero_()
    if tuple(qd.stride()) != tuple(dq.stride()):
        qd = to_device(np.ascontiguousarray(to_host(qd))) if isinstance(qd, NumpyTensor) else qd.contiguous()
    dk, dv = empty((g, nk, d), kd.dtype, like=kd), empty((g, nk, d), kd.dtype, like=kd)
    launch(flash_bwd_kernel, (cdiv(nk, block_n), g), qd, kd, vd, dod, lsed, delta, dq, dk, dv, nq, nk,
           *qd.stride()[:2], *kd.stride()[:2], *vd.stride()[:2], *dod.stride()[:2], 1.0 / math.sqrt(d),
           CAUSAL=bool(causal), HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n)
    return to_host(dq, like=q), to_host(dk, like=k), to_host(dv, like=v)


@triton.jit
def flash_bwd_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, N_Q, N_K,
                     stride_qg, stride_qm, stride_kg, stride_kn, stride_vg, stride_vn, stride_dog, stride_dom,
                     scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """dK, dV of key block tl.program_id(0) of head tl.program_id(1), and its share of dQ (tl.atomic_add),
    recomputing P = exp(scale Q K^T - lse) block by block over the query blocks that see the keys."""
    start_n = tl.program_id(0)
    g = tl.program_id(1)
    keys = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + g * stride_kg + keys[:, None] * stride_kn + dims[None, :], mask=keys[:, None] < N_K, other=0.0)
    v = tl.load(v_ptr + g * stride_vg + keys[:, None] * stride_vn + dims[None, :], mask=keys[:, None] < N_K, other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    offset = N_K - N_Q
    lo = 0
    if CAUSAL:
        lo = (tl.maximum(start_n * BLOCK_N - offset, 0) // BLOCK_M) * BLOCK_M
    for start_m in range(lo, N_Q, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        live = rows < N_Q
        q = tl.load(q_ptr + g * stride_qg + rows[:, None] * stride_qm + dims[None, :], mask=live[:, None], other=0.0)
        do = tl.load(do_ptr + g * stride_dog + rows[:, None] * stride_dom + dims[None, :], mask=live[:, None],
                     other=0.0)
        lse = tl.load(lse_ptr + g * N_Q + rows, mask=live, other=0.0)
        delta = tl.load(delta_ptr + g * N_Q + rows, mask=live, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = live[:, None] & (keys[None, :] < N_K)
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + offset)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None]) * scale
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)
        tl.atomic_add(dq_ptr + g * stride_qg + rows[:, None] * stride_qm + dims[None, :], tl.dot(ds.to(k.dtype), k),
                      mask=live[:, None])
    tl.store(dk_ptr + g * stride_kg + keys[:, None] * stride_kn + dims[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=keys[:, None] < N_K)
    tl.store(dv_ptr + g * stride_vg + keys[:, None] * stride_vn + dims[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=keys[:, None] < N_K)


def triton_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, block_m: int = 64,
                     block_n: int = 64) -> Tensor:
    """Attention as one autograd node computed by the Triton kernels (interpreted): forward flash_forward, backward
    flash_backward from the saved q, k, v, o and lse. q (..., Nq, d), k, v (..., Nk, d): minitorch Tensors with
    the same batch axes, float32, d in HEAD_DIMS. Returns (..., Nq, d), equal to lesson 09's
    attention(q, k, v, causal_mask(Nq, Nk) if causal else None)."""
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"triton_attention: q {q.shape}, k {k.shape}, v {v.shape} need the same batch axes")
    lead, nq, nk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q3, k3, v3 = (t.data.reshape(-1, n, d) for t, n in ((q, nq), (k, nk), (v, nk)))
    o3, lse = flash_forward(q3, k3, v3, causal, block_m, block_n)
    out = q._new(o3.reshape(*lead, nq, d))

    def vjp(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dq, dk, dv = flash_backward(q3, k3, v3, o3, lse, np.asarray(g, dtype=o3.dtype).reshape(o3.shape), causal,
                                    block_m, block_n)
        return dq.astype(q.dtype).reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

    return q._record(out, (q, k, v), vjp, "triton_attention")


def use_triton_attention(model: Any, block_m: int = 64, block_n: int = 64) -> Any:
    """Make every attention layer of lesson 09's GPT compute causal attention with triton_attention (in place;
    returns the model). The layers keep their weights; only the attention function changes."""
    for block in model.blocks:
        block.attn.attend = functools.partial(triton_attention, causal=True, block_m=block_m, block_n=block_n)
    return model


from minitorch.checks import Choice, Int, Optional, Rule, Size, validate_public  # noqa: E402


class _Block(Rule):
    """A block size: a power of two from 1 to 1024 (tl.arange needs one)."""

    def __call__(self, what: str, name: str, value: Any) -> None:
        check_int(what, name, value, 1, 1024)
        if value & (value - 1):
            raise ValueError(f"{what}: {name} must be a power of two (tl.arange needs one), got {value}")


class _Model(Rule):
    def __call__(self, what: str, name: str, value: Any) -> None:
        blocks = getattr(value, "blocks", None)
        if not isinstance(blocks, (list, tuple)) or not all(hasattr(b, "attn") for b in blocks):
            raise TypeError(f"{what}: {name} must be lesson 09's GPT (its blocks with .attn), got {value!r:.80}")


_F = ("float32", "float16")
_B = _Block()
_DOT = Int(16, 1024)

validate_public(globals(), {
    "bias_gelu": {"x": _DeviceArray(ndim=2, dtypes=_F), "bias": _DeviceArray(ndim=1, dtypes=_F), "block_m": _B,
                  "block_n": _B},
    "softmax": {"x": _DeviceArray(ndim=2, dtypes=_F)},
    "matmul": {"a": _DeviceArray(ndim=2, dtypes=_F), "b": _DeviceArray(ndim=2, dtypes=_F),
               "bias": Optional(_DeviceArray(ndim=1, dtypes=_F)), "activation": Choice(*MATMUL_ACTIVATIONS),
               "block_m": Optional(_B), "block_n": Optional(_B), "block_k": Optional(_B), "group_m": Size},
    "program_tiles": {"num_pid_m": Size, "num_pid_n": Size, "group_m": Size},
    "panels_per_wave": {"num_pid_m": Size, "num_pid_n": Size, "group_m": Size, "wave": Size},
    "flash_forward": {"q": _DeviceArray(ndim=3, dtypes=_F), "k": _DeviceArray(ndim=3, dtypes=_F),
                      "v": _DeviceArray(ndim=3, dtypes=_F), "block_m": _B, "block_n": _B},
    "flash_backward": {"q": _DeviceArray(ndim=3, dtypes=_F), "k": _DeviceArray(ndim=3, dtypes=_F),
                       "v": _DeviceArray(ndim=3, dtypes=_F), "o": _DeviceArray(ndim=3, dtypes=_F),
                       "lse": _DeviceArray(ndim=2, dtypes="float32"), "do": _DeviceArray(ndim=3, dtypes=_F),
                       "block_m": _B, "block_n": _B},
    "triton_attention": {"block_m": _B, "block_n": _B},
    "use_triton_attention": {"model": _Model(), "block_m": _B, "block_n": _B},
})
