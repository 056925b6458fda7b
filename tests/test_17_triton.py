"""Lesson 17: Triton kernels, graded under Triton's interpreter (and on a GPU where there is one).

Every kernel runs through `minitorch.triton_interp.launch`, which checks each load and store before it
happens (an access outside an argument's elements is a KernelError naming the argument, the element and
the program) and reports races between programs. Values are compared with float64 NumPy oracles written
here, on odd shapes that leave partial blocks at every edge and several programs along each axis. Each
exercise's point is graded from the launch's trace: each element read once, a K loop of tl.dot, the
program order, key blocks streamed and never a full row of scores, the causal blocks never loaded, dQ
accumulated atomically. Each kernel is also compiled for an A100 (compile_for_gpu), without a GPU, so
code the interpreter accepts and the compiler rejects fails here. Tests marked gpu compile and launch
the kernels on PyTorch CUDA tensors and compare with the interpreter.
"""

import inspect
import math
import re

import numpy as np
import pytest

from minitorch.triton_interp import (
    TRITON_MISSING, NumpyTensor, autotuned, compile_for_gpu, launch, to_device, trace,
)

pytestmark = [pytest.mark.lesson17,
              pytest.mark.skipif(TRITON_MISSING is not None, reason=f"Triton cannot run here: {TRITON_MISSING}")]


# ------------------------------------------------------------------ helpers and oracles
def cdiv(a, b):
    return -(-a // b)


def gelu64(v):
    v = np.asarray(v, dtype=np.float64)
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_close(got, want, what, rtol=1e-5, atol=1e-6):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: expected shape {want.shape}, got {got.shape}"
    ok = np.isclose(got.astype(np.float64), want, rtol=rtol, atol=atol)
    if not ok.all():
        bad = np.argwhere(~ok)
        i = tuple(int(v) for v in bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {want.size} elements wrong; first at index {i}: expected "
                             f"{want[i]:.7g}, got {got[i]:.7g}")


def traced(kernel, grid, *args, **meta):
    """Launch (checked) inside trace(); the launch's KernelTrace."""
    with trace() as launches:
        launch(kernel, grid, *args, **meta)
    assert launches, "the launch left no trace"
    return launches[-1]


def numbers(n):
    return ", ".join(str(int(v)) for v in n)


def compiled_counts(kernel, args, what):
    """PTX counts of `kernel` compiled for an A100; the compiler's message as the failure if it cannot."""
    try:
        return compile_for_gpu(kernel, args, arch=80)["counts"]
    except Exception as exc:  # noqa: BLE001 - CompilationError carries the line Triton's compiler rejected
        stub = re.search(r'NotImplementedError\("(Exercise \d+\.\d+: \w+)"\)', inspect.getsource(kernel.fn))
        if stub:  # an exercise not written yet: not attempted, not failed
            raise NotImplementedError(stub.group(1)) from None
        raise AssertionError(f"{what} runs in the interpreter but Triton's compiler rejects it (so it cannot run on a "
                             f"GPU):\n{str(exc)[-1500:]}") from None


def attention64(q, k, v, causal):
    """float64 (o, lse, p) of softmax(q k^T / sqrt(d), causal bottom-right) v."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nq, nk = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    p = e / total
    return p @ v, (m + np.log(total))[..., 0], p


def attention_grads64(q, k, v, do, causal):
    _, _, p = attention64(q, k, v, causal)
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    scale = 1 / math.sqrt(q.shape[-1])
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale
    return ds @ k, np.swapaxes(ds, -1, -2) @ q, dv


# ------------------------------------------------------------------ 17.1 bias + GELU
def run_bias_gelu(lesson, x, bias, bm, bn, y=None):
    xd, bd = to_device(x), to_device(bias)
    m, n = x.shape
    yd = NumpyTensor.empty((m, n), x.dtype) if y is None else y
    tr = traced(lesson.bias_gelu_kernel, (cdiv(m, bm), cdiv(n, bn)), xd, bd, yd, m, n, *xd.stride(), *yd.stride(),
                BLOCK_M=bm, BLOCK_N=bn)
    return yd.numpy(), tr


@pytest.mark.exercise("17.1")
def test_bias_gelu_matches_numpy_on_odd_shapes(lesson):
    rng = np.random.default_rng(0)
    for m, n, bm, bn in [(37, 45, 16, 16), (1, 1, 16, 16), (5, 70, 8, 32), (33, 16, 32, 16)]:
        x, bias = f32(rng, m, n, scale=3), f32(rng, n)
        x.flat[:5] = [-20, -5, 0, 5, 20][:x.size]
        y, _ = run_bias_gelu(lesson, x, bias, bm, bn)
        assert_close(y, gelu64(x.astype(np.float64) + bias), f"gelu(x + bias) for x {x.shape}, {bm} x {bn} blocks")


@pytest.mark.exercise("17.1")
def test_bias_gelu_follows_the_strides(lesson):
    """x a slice of a wider matrix (rows 64 apart, starting at column 3), and a transposed x and y: the offsets
    must come from the strides, not from N."""
    rng = np.random.default_rng(1)
    big = f32(rng, 37, 64)
    x, bias = big[:, 3:48], f32(rng, 45)
    y, _ = run_bias_gelu(lesson, x, bias, 16, 16)
    assert_close(y, gelu64(x.astype(np.float64) + bias), "gelu(x + bias) for x = big[:, 3:48] (row stride 64)")
    xt = np.ascontiguousarray(f32(rng, 45, 37)).T  # shape (37, 45), strides (1, 37)
    yt = NumpyTensor.empty((45, 37), np.float32).T
    y, _ = run_bias_gelu(lesson, xt, bias, 16, 16, y=yt)
    assert_close(y, gelu64(xt.astype(np.float64) + bias), "gelu(x + bias) for a transposed x and y (strides (1, 37))")


@pytest.mark.exercise("17.1")
def test_bias_gelu_reads_each_element_once(lesson):
    rng = np.random.default_rng(2)
    x, bias = f32(rng, 37, 45), f32(rng, 45)
    _, tr = run_bias_gelu(lesson, x, bias, 16, 16)
    assert len(tr.programs) == 9, f"expected 3 x 3 programs on a (3, 3) grid, {len(tr.programs)} ran"
    reads, writes = tr.counts("x_ptr"), tr.counts("y_ptr", "store")
    assert reads.min() == reads.max() == 1, (f"each element of x must be loaded once (fused: one read); loads per "
                                             f"element range from {reads.min()} to {reads.max()}")
    assert writes.min() == writes.max() == 1, f"each element of y must be stored once; got {writes.min()} to {writes.max()}"
    assert tr.stores("y_ptr", (2, 2)) == 5 * 13, (f"the corner program owns rows 32-36 and columns 32-44 of y: 65 "
                                                   f"elements; it stored {tr.stores('y_ptr', (2, 2))}")
    b = tr.counts("bias_ptr")
    assert (b == 3).all(), (f"each program should load its BLOCK_N slice of bias once (3 programs per column of "
                            f"tiles): loads per bias element {numbers(b[:20])}...")
    for p in tr.programs:
        got = tr.elements("y_ptr", p, "store")
        rows, cols = np.unravel_index(got, (37, 45))
        want_rows = set(range(p[0] * 16, min(37, p[0] * 16 + 16)))
        want_cols = set(range(p[1] * 16, min(45, p[1] * 16 + 16)))
        assert set(rows) == want_rows and set(cols) == want_cols and got.size == len(want_rows) * len(want_cols), (
            f"program {p[:2]} should write rows {min(want_rows)}-{max(want_rows)}, columns {min(want_cols)}-"
            f"{max(want_cols)}; it wrote rows {rows.min()}-{rows.max()}, columns {cols.min()}-{cols.max()} "
            f"({got.size} elements)")


@pytest.mark.exercise("17.1")
def test_bias_gelu_float16_and_the_launcher(lesson):
    rng = np.random.default_rng(3)
    x, bias = f32(rng, 21, 50).astype(np.float16), f32(rng, 50).astype(np.float16)
    y = lesson.bias_gelu(x, bias)
    assert y.dtype == np.float16, f"y must have x's dtype float16, got {y.dtype}"
    assert_close(y, gelu64(x.astype(np.float64) + bias.astype(np.float64)), "float16 gelu(x + bias)", rtol=2e-3, atol=2e-3)
    wide = f32(rng, 7, 90)
    assert_close(lesson.bias_gelu(wide[:, ::2], bias[:45].astype(np.float32), 8, 16),
                 gelu64(wide[:, ::2].astype(np.float64) + bias[:45].astype(np.float64)),
                 "bias_gelu on every other column of a matrix (column stride 2)")
    with pytest.raises(ValueError, match="bias"):
        lesson.bias_gelu(wide, f32(rng, 3))


@pytest.mark.exercise("17.1")
def test_bias_gelu_compiles_for_a_gpu(lesson):
    t = lambda *s: to_device(np.zeros(s, np.float32))  # noqa: E731
    counts = compiled_counts(lesson.bias_gelu_kernel, dict(
        x_ptr=t(64, 64), bias_ptr=t(64), y_ptr=t(64, 64), M=64, N=64, stride_xm=64, stride_xn=1, stride_ym=64,
        stride_yn=1, BLOCK_M=32, BLOCK_N=64), "bias_gelu_kernel")
    assert counts["st.global"] > 0, f"the compiled kernel stores nothing: {counts}"


# ------------------------------------------------------------------ 17.2 softmax
def run_softmax(lesson, x):
    xd = to_device(x)
    rows, cols = x.shape
    yd = NumpyTensor.empty((rows, cols), x.dtype)
    block = 1 << (cols - 1).bit_length()
    tr = traced(lesson.softmax_kernel, (rows,), xd, yd, cols, xd.stride()[0], yd.stride()[0], BLOCK=block)
    return yd.numpy(), tr


def softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.exercise("17.2")
def test_softmax_matches_numpy(lesson):
    rng = np.random.default_rng(4)
    for rows, cols, scale in [(37, 100, 30.0), (5, 1, 1.0), (3, 128, 1.0), (7, 129, 5.0)]:
        x = f32(rng, rows, cols, scale=scale)
        y, _ = run_softmax(lesson, x)
        assert_close(y, softmax64(x), f"softmax of a ({rows}, {cols}) matrix (values up to {np.abs(x).max():.0f})",
                     rtol=1e-5, atol=1e-7)


@pytest.mark.exercise("17.2")
def test_softmax_is_stable_and_ignores_the_padding(lesson):
    """Scores of 1e4 overflow exp() unless the row's max is subtracted; rows of negative values show whether the
    masked lanes (loaded as 0 instead of -inf) leak into the max or the sum."""
    rng = np.random.default_rng(5)
    x = np.concatenate([f32(rng, 2, 45) + 1e4, f32(rng, 2, 45) - 50, f32(rng, 2, 45) * 1e3]).astype(np.float32)
    y, _ = run_softmax(lesson, x)
    assert np.isfinite(y).all(), (f"softmax of rows around 1e4 gave {np.count_nonzero(~np.isfinite(y))} non-finite "
                                  f"values: subtract the row's max before exp")
    assert_close(y, softmax64(x), "softmax of rows near 1e4, rows near -50 (45 columns in a block of 64)",
                 rtol=1e-5, atol=1e-7)


@pytest.mark.exercise("17.2")
def test_softmax_one_program_per_row_one_read_one_write(lesson):
    rng = np.random.default_rng(6)
    big = f32(rng, 9, 128)
    x = big[:, :100]  # rows 128 apart
    y, tr = run_softmax(lesson, x)
    assert_close(y, softmax64(x), "softmax of x = big[:, :100] (row stride 128)", rtol=1e-5, atol=1e-7)
    reads, writes = tr.counts("x_ptr"), tr.counts("y_ptr", "store")
    assert reads.min() == reads.max() == 1, (f"each element of x must be loaded once (the row stays in registers); "
                                             f"loads per element range from {reads.min()} to {reads.max()}")
    assert writes.min() == writes.max() == 1, f"each element of y must be stored once; got {writes.min()} to {writes.max()}"
    for p in tr.programs:
        got = tr.elements("x_ptr", p)
        assert np.array_equal(got, np.arange(p[0] * 100, p[0] * 100 + 100)), (
            f"program {p[0]} should read row {p[0]}; it read elements {numbers(got[:6])}...")
        loads = [b for b in tr.blocks("x_ptr", p) if b[0] == "load"]
        assert len(loads) == 1, f"program {p[0]} should load its row in one tl.load of one block; it made {len(loads)}"


@pytest.mark.exercise("17.2")
def test_softmax_float16_and_the_launcher(lesson):
    rng = np.random.default_rng(7)
    x = f32(rng, 6, 77, scale=4).astype(np.float16)
    y = lesson.softmax(x)
    assert y.dtype == np.float16, f"y must have x's dtype float16, got {y.dtype}"
    assert_close(y, softmax64(x), "float16 softmax", rtol=2e-3, atol=1e-4)
    x32 = f32(rng, 11, 300, scale=3)
    assert_close(lesson.softmax(x32), softmax64(x32), "softmax of a (11, 300) float32 matrix", rtol=1e-5, atol=1e-7)


@pytest.mark.exercise("17.2")
def test_softmax_compiles_for_a_gpu(lesson):
    t = to_device(np.zeros((64, 1024), np.float32))
    counts = compiled_counts(lesson.softmax_kernel, dict(x_ptr=t, y_ptr=t, n_cols=1000, stride_x=1024, stride_y=1024,
                                                         BLOCK=1024), "softmax_kernel")
    assert counts["st.global"] > 0, f"the compiled kernel stores nothing: {counts}"


# ------------------------------------------------------------------ 17.3 matmul
def run_matmul(lesson, a, b, bm, bn, bk, group_m, bias=None, activation=""):
    ad, bd = to_device(a), to_device(b)
    (m, k), n = a.shape, b.shape[1]
    cd = NumpyTensor.empty((m, n), a.dtype)
    biasd = to_device(bias) if bias is not None else cd
    tr = traced(lesson.matmul_kernel, (cdiv(m, bm) * cdiv(n, bn),), ad, bd, cd, biasd, m, n, k, *ad.stride(),
                *bd.stride(), *cd.stride(), HAS_BIAS=bias is not None, ACTIVATION=activation, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk, GROUP_M=group_m)
    return cd.numpy(), tr


def grouped_tiles(num_m, num_n, group):
    """(pid_m, pid_n) of each program id, written out: groups of `group` tile rows, column by column inside."""
    out = []
    for first in range(0, num_m, group):
        size = min(group, num_m - first)
        out += [(first + r, c) for c in range(num_n) for r in range(size)]
    return out


@pytest.mark.exercise("17.3")
def test_matmul_matches_numpy_for_many_tile_shapes(lesson):
    rng = np.random.default_rng(8)
    cases = [(37, 45, 29, 16, 16, 16, 2), (33, 17, 40, 32, 16, 16, 3), (16, 16, 16, 16, 16, 16, 1),
             (70, 9, 33, 32, 16, 32, 4), (5, 50, 100, 16, 32, 64, 8)]
    for m, n, k, bm, bn, bk, g in cases:
        a, b = f32(rng, m, k), f32(rng, k, n)
        c, _ = run_matmul(lesson, a, b, bm, bn, bk, g)
        assert_close(c, a.astype(np.float64) @ b, f"({m}, {k}) @ ({k}, {n}) with {bm} x {bn} x {bk} tiles, "
                     f"GROUP_M = {g}", rtol=1e-4, atol=1e-4)


@pytest.mark.exercise("17.3")
def test_matmul_is_correct_for_every_autotuner_config(lesson):
    configs = lesson.matmul_configs()
    assert configs, "matmul_configs() is empty"
    rng = np.random.default_rng(9)
    a, b = f32(rng, 37, 70), f32(rng, 70, 45)
    for cfg in configs:
        kw = cfg.kwargs
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            assert kw[name] >= 16 and kw[name] & (kw[name] - 1) == 0, f"{cfg}: {name} must be a power of two >= 16"
        c, _ = run_matmul(lesson, a, b, kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["GROUP_M"])
        assert_close(c, a.astype(np.float64) @ b, f"(37, 70) @ (70, 45) with the autotuner's config {kw}",
                     rtol=1e-4, atol=1e-4)
    tuned = autotuned(lesson.matmul_kernel, configs, ["M", "N", "K"])
    assert len(tuned.configs) == len(configs)


@pytest.mark.exercise("17.3")
def test_matmul_is_a_k_loop_of_tl_dot(lesson):
    rng = np.random.default_rng(10)
    m, n, k = 37, 45, 40
    a, b = f32(rng, m, k), f32(rng, k, n)
    _, tr = run_matmul(lesson, a, b, 16, 16, 16, 2)
    for p in tr.programs:
        dots = tr.dots(p)
        assert dots == [((16, 16), (16, 16))] * 3, (
            f"program {p[0]}: expected a loop over K of cdiv(40, 16) = 3 tl.dot calls on (16, 16) x (16, 16) tiles; "
            f"got {dots}")
    ca, cb = tr.counts("a_ptr"), tr.counts("b_ptr")
    assert (ca == 3).all() and (cb == 3).all(), (
        f"each element of A is needed by the 3 programs of its row of tiles, each of B by the 3 of its column, once each; "
        f"loads per element of A range {ca.min()}-{ca.max()}, of B {cb.min()}-{cb.max()}")
    assert tr.loads("c_ptr") == 0 and (tr.counts("c_ptr", "store") == 1).all(), (
        f"C should be stored once per element and never read back; {tr.loads('c_ptr')} loads, stores per element "
        f"{tr.counts('c_ptr', 'store').min()}-{tr.counts('c_ptr', 'store').max()}")


@pytest.mark.exercise("17.3")
def test_matmul_programs_run_in_grouped_order(lesson):
    """5 x 3 tiles: GROUP_M = 2 leaves a last group of one row, GROUP_M = 1 is row-major, 8 is one group."""
    rng = np.random.default_rng(11)
    a, b = f32(rng, 80, 24), f32(rng, 24, 48)
    for group in (1, 2, 3, 8):
        c, tr = run_matmul(lesson, a, b, 16, 16, 16, group)
        assert_close(c, a.astype(np.float64) @ b, f"(80, 24) @ (24, 48), GROUP_M = {group}", rtol=1e-4, atol=1e-4)
        got = []
        for p in tr.programs:
            out = tr.elements("c_ptr", p, "store")
            r, col = np.unravel_index(out.min(), (80, 48))
            got.append((int(r // 16), int(col // 16)))
        want = grouped_tiles(5, 3, group)
        assert got == want, (f"GROUP_M = {group}: program p should compute tile {want} (p = 0, 1, ...); the programs "
                             f"computed {got}")
        assert [tuple(t) for t in lesson.program_tiles(5, 3, group).tolist()] == want
        waves = np.array([[len({t[0] for t in got[i:i + 4]}), len({t[1] for t in got[i:i + 4]})]
                          for i in range(0, len(got), 4)])
        assert np.array_equal(waves, lesson.panels_per_wave(5, 3, group, 4))


@pytest.mark.exercise("17.3")
def test_matmul_epilogue_bias_and_gelu(lesson):
    rng = np.random.default_rng(12)
    a, b, bias = f32(rng, 37, 29), f32(rng, 29, 45), f32(rng, 45)
    ref = a.astype(np.float64) @ b
    c, tr = run_matmul(lesson, a, b, 16, 16, 16, 2, bias=bias, activation="gelu")
    assert_close(c, gelu64(ref + bias), "gelu(a @ b + bias), the epilogue", rtol=1e-4, atol=1e-4)
    assert (tr.counts("c_ptr", "store") == 1).all() and tr.loads("c_ptr") == 0, "the epilogue must not read C back"
    c, _ = run_matmul(lesson, a, b, 16, 16, 16, 2, bias=bias)
    assert_close(c, ref + bias, "a @ b + bias (no activation)", rtol=1e-4, atol=1e-4)
    c, tr = run_matmul(lesson, a, b, 16, 16, 16, 2, activation="gelu")
    assert_close(c, gelu64(ref), "gelu(a @ b) without a bias", rtol=1e-4, atol=1e-4)
    assert tr.loads("c_ptr") == 0, ("without HAS_BIAS the kernel must not read bias_ptr (here it points at C): "
                                    f"{tr.loads('c_ptr')} loads")


@pytest.mark.exercise("17.3")
def test_matmul_float16_and_the_launcher(lesson):
    rng = np.random.default_rng(13)
    a, b = f32(rng, 21, 64).astype(np.float16), f32(rng, 64, 33).astype(np.float16)
    c = lesson.matmul(a, b)
    assert c.dtype == np.float16, f"c must have a's dtype float16, got {c.dtype}"
    assert_close(c, a.astype(np.float64) @ b.astype(np.float64), "float16 matmul (float32 accumulation)",
                 rtol=2e-3, atol=2e-2)
    a32, b32, bias = f32(rng, 9, 40), f32(rng, 40, 20), f32(rng, 20)
    assert_close(lesson.matmul(a32, b32.T.copy().T, bias, "gelu", 16, 16, 16, 2), gelu64(a32.astype(np.float64) @ b32 + bias),
                 "matmul(a, b, bias, 'gelu')", rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="multiply"):
        lesson.matmul(a32, a32)


@pytest.mark.exercise("17.3")
def test_matmul_compiles_to_tensor_core_instructions(lesson):
    t = lambda *s: to_device(np.zeros(s, np.float16))  # noqa: E731
    counts = compiled_counts(lesson.matmul_kernel, dict(
        a_ptr=t(256, 256), b_ptr=t(256, 256), c_ptr=t(256, 256), bias_ptr=t(256), M=256, N=256, K=256, stride_am=256,
        stride_ak=1, stride_bk=256, stride_bn=1, stride_cm=256, stride_cn=1, HAS_BIAS=True, ACTIVATION="gelu",
        BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8), "matmul_kernel")
    assert counts["mma.sync"] > 0, (f"compiled for an A100, the kernel uses no tensor-core instruction (mma.sync): "
                                    f"multiply the tiles with tl.dot. PTX counts: {counts}")


# ------------------------------------------------------------------ 17.4 FlashAttention forward
def heads(rng, g, n, d, scale=1.0):
    return f32(rng, g, n, d, scale=scale)


def run_forward(kernel, q, k, v, causal, bm, bn):
    qd, kd, vd = to_device(q), to_device(k), to_device(v)
    g, nq, d = q.shape
    nk = k.shape[1]
    od, lsed = NumpyTensor.empty((g, nq, d), q.dtype), NumpyTensor.empty((g, nq), np.float32)
    tr = traced(kernel, (cdiv(nq, bm), g), qd, kd, vd, od, lsed, nq, nk, *qd.stride()[:2], *kd.stride()[:2],
                *vd.stride()[:2], *od.stride()[:2], 1 / math.sqrt(d), CAUSAL=causal, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn)
    return od.numpy(), lsed.numpy(), tr


def visible_key_rows(i, nq, nk, bm, bn, causal):
    """Key rows of the blocks program i must load: every block without the mask; with it, the blocks starting
    before min(Nk, (i + 1) BLOCK_M + Nk - Nq)."""
    hi = min(nk, (i + 1) * bm + nk - nq) if causal else nk
    return sum(min(bn, nk - j) for j in range(0, hi, bn))


FORWARD_CASES = [(2, 37, 45, 16, 16, 16, False), (2, 37, 45, 16, 16, 16, True), (1, 40, 40, 32, 16, 32, True),
                 (2, 5, 70, 16, 16, 32, True), (1, 1, 1, 16, 16, 16, False), (1, 33, 33, 16, 32, 16, True)]


@pytest.mark.exercise("17.4")
def test_flash_forward_matches_attention(lesson):
    rng = np.random.default_rng(14)
    for g, nq, nk, d, bm, bn, causal in FORWARD_CASES:
        q, k, v = heads(rng, g, nq, d, 2.0), heads(rng, g, nk, d, 2.0), heads(rng, g, nk, d)
        o, lse, _ = run_forward(lesson.flash_fwd_kernel, q, k, v, causal, bm, bn)
        o64, lse64, _ = attention64(q, k, v, causal)
        what = f"G={g}, Nq={nq}, Nk={nk}, d={d}, {bm} x {bn} blocks, causal={causal}"
        assert_close(o, o64, f"o ({what})", rtol=1e-4, atol=1e-5)
        assert_close(lse, lse64, f"lse, the log-sum-exp of each row's scaled scores ({what})", rtol=1e-5, atol=1e-5)


@pytest.mark.exercise("17.4")
def test_flash_forward_rescales_the_accumulator(lesson):
    """Keys whose scores grow block after block: each new block raises the running max, so the sum and the output
    accumulated so far must be rescaled by exp(m_old - m_new) every time."""
    rng = np.random.default_rng(15)
    q = np.abs(heads(rng, 1, 20, 16)) + 0.5
    k = np.abs(heads(rng, 1, 64, 16)) * np.linspace(0.1, 3.0, 64, dtype=np.float32)[None, :, None]
    v = heads(rng, 1, 64, 16)
    o, lse, _ = run_forward(lesson.flash_fwd_kernel, q, k, v, False, 16, 16)
    o64, lse64, _ = attention64(q, k, v, False)
    assert_close(o, o64, "o when every key block raises the row max (4 blocks of 16 keys)", rtol=1e-4, atol=1e-5)
    assert_close(lse, lse64, "lse when every key block raises the row max", rtol=1e-5, atol=1e-5)


@pytest.mark.exercise("17.4")
def test_flash_forward_streams_key_blocks_and_never_holds_a_row(lesson):
    rng = np.random.default_rng(16)
    g, nq, nk, d, bm, bn = 2, 37, 45, 16, 16, 16
    q, k, v = heads(rng, g, nq, d), heads(rng, g, nk, d), heads(rng, g, nk, d)
    _, _, tr = run_forward(lesson.flash_fwd_kernel, q, k, v, False, bm, bn)
    assert (tr.counts("q_ptr") == 1).all(), "each program loads its block of q once (it stays in registers)"
    assert (tr.counts("o_ptr", "store") == 1).all() and (tr.counts("lse_ptr", "store") == 1).all(), \
        "o and lse must be written once per row, at the end"
    for p in tr.programs:
        kblocks = [b for b in tr.blocks("k_ptr", p) if b[0] == "load"]
        shapes = {b[1] for b in kblocks}
        assert len(kblocks) == cdiv(nk, bn) and shapes == {(bn, d)}, (
            f"program {p[:2]}: expected {cdiv(nk, bn)} loads of ({bn}, {d}) blocks of k (one per key block); got "
            f"{[b[1] for b in kblocks]}")
        assert tr.loads("k_ptr", p) == nk * d and tr.loads("v_ptr", p) == nk * d, (
            f"program {p[:2]} should load each of the {nk} rows of k and v once; it loaded {tr.loads('k_ptr', p) // d} "
            f"and {tr.loads('v_ptr', p) // d} rows")
        biggest = max((a[0] * b[1] for a, b in tr.dots(p)), default=0)
        assert 0 < biggest <= bm * bn, (
            f"program {p[:2]}: the largest tl.dot result has {biggest} elements; FlashAttention holds at most a "
            f"BLOCK_M x BLOCK_N = {bm * bn} block of scores, never a full row of {nk}")
        assert len(tr.dots(p)) == 2 * cdiv(nk, bn), (
            f"program {p[:2]}: expected 2 tl.dot per key block (q k^T and p v), {2 * cdiv(nk, bn)} in all; got "
            f"{len(tr.dots(p))}")


@pytest.mark.exercise("17.4")
def test_flash_forward_never_loads_the_blocks_a_causal_mask_hides(lesson):
    rng = np.random.default_rng(17)
    for g, nq, nk, d, bm, bn in [(1, 64, 64, 16, 16, 16), (2, 37, 45, 16, 16, 16), (1, 20, 70, 16, 16, 32)]:
        q, k, v = heads(rng, g, nq, d), heads(rng, g, nk, d), heads(rng, g, nk, d)
        o, _, tr = run_forward(lesson.flash_fwd_kernel, q, k, v, True, bm, bn)
        assert_close(o, attention64(q, k, v, True)[0], f"causal o (Nq={nq}, Nk={nk})", rtol=1e-4, atol=1e-5)
        for p in tr.programs:
            want = visible_key_rows(p[0], nq, nk, bm, bn, True)
            got = tr.loads("k_ptr", p) // d
            assert got == want, (
                f"Nq={nq}, Nk={nk}, {bm} x {bn} blocks: query block {p[0]} can see keys up to "
                f"{min(nk, (p[0] + 1) * bm + nk - nq) - 1}, so it should load the {want} key rows of the blocks up to "
                f"the diagonal; it loaded {got} (blocks above the diagonal must be skipped, not loaded and masked)")
            assert tr.loads("v_ptr", p) // d == want, f"query block {p[0]}: loaded {tr.loads('v_ptr', p) // d} rows of v, want {want}"


@pytest.mark.exercise("17.4")
def test_flash_forward_launcher_and_compiler(lesson):
    rng = np.random.default_rng(18)
    q, k, v = heads(rng, 3, 20, 32), heads(rng, 3, 20, 32), heads(rng, 3, 20, 32)
    o, lse = lesson.flash_forward(q, k, v, causal=True)
    o64, lse64, _ = attention64(q, k, v, True)
    assert_close(o, o64, "flash_forward(q, k, v, causal=True)", rtol=1e-4, atol=1e-5)
    assert_close(lse, lse64, "flash_forward's lse", rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Nq"):
        lesson.flash_forward(heads(rng, 1, 9, 16), heads(rng, 1, 5, 16), heads(rng, 1, 5, 16), causal=True)
    t = lambda *s: to_device(np.zeros(s, np.float16))  # noqa: E731
    counts = compiled_counts(lesson.flash_fwd_kernel, dict(
        q_ptr=t(2, 128, 64), k_ptr=t(2, 128, 64), v_ptr=t(2, 128, 64), o_ptr=t(2, 128, 64),
        lse_ptr=to_device(np.zeros((2, 128), np.float32)), N_Q=128, N_K=128, stride_qg=128 * 64, stride_qm=64,
        stride_kg=128 * 64, stride_kn=64, stride_vg=128 * 64, stride_vn=64, stride_og=128 * 64, stride_om=64,
        scale=0.125, CAUSAL=True, HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64), "flash_fwd_kernel")
    assert counts["mma.sync"] > 0, f"compiled for an A100 the kernel uses no tensor-core instruction: {counts}"


# ------------------------------------------------------------------ 17.5 FlashAttention backward, autograd
def run_backward(kernel, q, k, v, do, causal, bm, bn):
    _, lse64, _ = attention64(q, k, v, causal)
    o64 = attention64(q, k, v, causal)[0]
    delta = (np.asarray(do, np.float64) * o64).sum(axis=-1).astype(np.float32)
    g, nq, d = q.shape
    nk = k.shape[1]
    qd, kd, vd, dod = (to_device(x) for x in (q, k, v, do))
    lsed, deltad = to_device(lse64.astype(np.float32)), to_device(delta)
    dq = NumpyTensor.empty((g, nq, d), np.float32)
    dk, dv = NumpyTensor.empty((g, nk, d), np.float32), NumpyTensor.empty((g, nk, d), np.float32)
    tr = traced(kernel, (cdiv(nk, bn), g), qd, kd, vd, dod, lsed, deltad, dq, dk, dv, nq, nk, *qd.stride()[:2],
                *kd.stride()[:2], *vd.stride()[:2], *dod.stride()[:2], 1 / math.sqrt(d), CAUSAL=causal, HEAD_DIM=d,
                BLOCK_M=bm, BLOCK_N=bn)
    return dq.numpy(), dk.numpy(), dv.numpy(), tr


BACKWARD_CASES = [(2, 37, 45, 16, 16, 16, False), (2, 37, 45, 16, 16, 16, True), (1, 40, 40, 32, 16, 32, True),
                  (1, 20, 70, 16, 32, 16, True)]


@pytest.mark.exercise("17.5")
def test_flash_backward_matches_the_gradients(lesson):
    rng = np.random.default_rng(19)
    for g, nq, nk, d, bm, bn, causal in BACKWARD_CASES:
        q, k, v, do = heads(rng, g, nq, d, 1.5), heads(rng, g, nk, d, 1.5), heads(rng, g, nk, d), heads(rng, g, nq, d)
        dq, dk, dv, _ = run_backward(lesson.flash_bwd_kernel, q, k, v, do, causal, bm, bn)
        want = attention_grads64(q, k, v, do, causal)
        what = f"G={g}, Nq={nq}, Nk={nk}, d={d}, {bm} x {bn} blocks, causal={causal}"
        for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
            assert_close(got, w, f"{name} ({what})", rtol=1e-4, atol=1e-5)


@pytest.mark.exercise("17.5")
def test_flash_backward_owns_key_blocks_and_adds_dq_atomically(lesson):
    rng = np.random.default_rng(20)
    g, nq, nk, d, bm, bn = 2, 37, 45, 16, 16, 16
    q, k, v, do = heads(rng, g, nq, d), heads(rng, g, nk, d), heads(rng, g, nk, d), heads(rng, g, nq, d)
    _, _, _, tr = run_backward(lesson.flash_bwd_kernel, q, k, v, do, False, bm, bn)
    for name in ("k_ptr", "v_ptr"):
        c = tr.counts(name)
        assert (c == 1).all(), (f"each program owns one key block: each element of {name[0]} is loaded once, by its "
                                f"program; loads per element range {c.min()}-{c.max()}")
    for name in ("dk_ptr", "dv_ptr"):
        c = tr.counts(name, "store")
        assert (c == 1).all(), f"{name[:2]} is written once per element, at the end; stores per element {c.min()}-{c.max()}"
    atomics = tr.counts("dq_ptr", "atomic")
    assert (atomics == cdiv(nk, bn)).all() and tr.counts("dq_ptr", "store").max() == 0, (
        f"every key block's program adds its share into each row of dq with tl.atomic_add ({cdiv(nk, bn)} per "
        f"element here); atomic adds per element {atomics.min()}-{atomics.max()}, plain stores "
        f"{tr.counts('dq_ptr', 'store').max()}")
    for p in tr.programs:
        assert tr.loads("q_ptr", p) == nq * d, (f"without a mask program {p[:2]} should load all {nq} query rows once; "
                                                f"it loaded {tr.loads('q_ptr', p) // d}")


@pytest.mark.exercise("17.5")
def test_flash_backward_skips_the_query_blocks_a_causal_mask_hides(lesson):
    rng = np.random.default_rng(21)
    for g, nq, nk, d, bm, bn in [(1, 64, 64, 16, 16, 16), (1, 37, 45, 16, 16, 16)]:
        q, k, v, do = heads(rng, g, nq, d), heads(rng, g, nk, d), heads(rng, g, nk, d), heads(rng, g, nq, d)
        dq, dk, dv, tr = run_backward(lesson.flash_bwd_kernel, q, k, v, do, True, bm, bn)
        for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), attention_grads64(q, k, v, do, True)):
            assert_close(got, w, f"causal {name} (Nq={nq}, Nk={nk})", rtol=1e-4, atol=1e-5)
        for p in tr.programs:
            lo = (max(p[0] * bn - (nk - nq), 0) // bm) * bm
            want = nq - lo
            got = tr.loads("q_ptr", p) // d
            assert got == want, (
                f"Nq={nq}, Nk={nk}, {bm} x {bn} blocks: key block {p[0]} (keys {p[0] * bn}-{p[0] * bn + bn - 1}) is seen "
                f"only from query row {max(p[0] * bn - (nk - nq), 0)} on, so it should load the {want} query rows from "
                f"row {lo}; it loaded {got}")


@pytest.fixture
def with_reference_forward(lesson, monkeypatch, standin):
    """triton_attention with the reference forward kernel (exercise 17.4's), so 17.5 is graded on its own."""
    ref = standin("triton_kernels")
    if ref is not None:
        monkeypatch.setitem(inspect.unwrap(lesson.triton_attention).__globals__, "flash_fwd_kernel", ref.flash_fwd_kernel)
    return lesson


@pytest.mark.exercise("17.5")
def test_triton_attention_equals_lesson_09_attention_with_gradients(with_reference_forward):
    from minitorch.attention import attention, causal_mask
    from minitorch.autograd import Tensor

    lesson = with_reference_forward
    rng = np.random.default_rng(22)
    for causal in (False, True):
        arrays = [f32(rng, 2, 2, 20, 16) for _ in range(3)]
        w = f32(rng, 2, 2, 20, 16)
        outs, grads = [], []
        for impl in ("triton", "reference"):
            q, k, v = (Tensor(a, requires_grad=True) for a in arrays)
            if impl == "triton":
                out = lesson.triton_attention(q, k, v, causal=causal, block_m=16, block_n=16)
            else:
                out = attention(q, k, v, mask=causal_mask(20, 20) if causal else None)
            (out * Tensor(w)).sum().backward()
            outs.append(out.data)
            grads.append([t.grad.data for t in (q, k, v)])
        assert_close(outs[0], outs[1].astype(np.float64), f"triton_attention against lesson 09's attention (causal={causal})",
                     rtol=1e-4, atol=1e-5)
        for name, got, want in zip(("q", "k", "v"), grads[0], grads[1]):
            assert_close(got, want.astype(np.float64), f"the gradient of {name} (causal={causal})", rtol=1e-4, atol=1e-5)


@pytest.mark.exercise("17.5")
def test_the_gpt_trains_on_triton_attention(with_reference_forward):
    from minitorch.gpt import GPT, GPTConfig

    lesson = with_reference_forward
    rng = np.random.default_rng(23)
    config = GPTConfig(vocab_size=50, block_size=24, n_layer=1, n_head=2, n_embd=32)
    idx, targets = rng.integers(0, 50, (2, 24)), rng.integers(0, 50, (2, 24))
    results = []
    for use in (True, False):
        model = GPT(config, seed=0)
        if use:
            assert lesson.use_triton_attention(model, 16, 16) is model
        _, loss = model(idx, targets)
        loss.backward()
        grad = model.blocks[0].attn.q.weight.grad.data
        results.append((float(loss.data), grad))
    assert abs(results[0][0] - results[1][0]) < 1e-5, (
        f"the GPT's loss with Triton attention {results[0][0]:.6f} differs from lesson 09's {results[1][0]:.6f}")
    assert_close(results[0][1], results[1][1].astype(np.float64), "the gradient of the first attention layer's q weight",
                 rtol=1e-3, atol=1e-6)


@pytest.mark.exercise("17.5")
def test_flash_backward_launcher_and_compiler(lesson):
    rng = np.random.default_rng(24)
    q, k, v, do = (heads(rng, 2, 24, 16) for _ in range(4))
    o64, lse64, _ = attention64(q, k, v, True)
    dq, dk, dv = lesson.flash_backward(q, k, v, o64.astype(np.float32), lse64.astype(np.float32), do, causal=True,
                                       block_m=16, block_n=16)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), attention_grads64(q, k, v, do, True)):
        assert_close(got, want, f"flash_backward's {name}", rtol=1e-4, atol=1e-5)
    f16 = lambda *s: to_device(np.zeros(s, np.float16))  # noqa: E731
    f32_ = lambda *s: to_device(np.zeros(s, np.float32))  # noqa: E731
    counts = compiled_counts(lesson.flash_bwd_kernel, dict(
        q_ptr=f16(2, 128, 64), k_ptr=f16(2, 128, 64), v_ptr=f16(2, 128, 64), do_ptr=f16(2, 128, 64),
        lse_ptr=f32_(2, 128), delta_ptr=f32_(2, 128), dq_ptr=f32_(2, 128, 64), dk_ptr=f16(2, 128, 64),
        dv_ptr=f16(2, 128, 64), N_Q=128, N_K=128, stride_qg=128 * 64, stride_qm=64, stride_kg=128 * 64, stride_kn=64,
        stride_vg=128 * 64, stride_vn=64, stride_dog=128 * 64, stride_dom=64, scale=0.125, CAUSAL=True, HEAD_DIM=64,
        BLOCK_M=32, BLOCK_N=32), "flash_bwd_kernel")
    assert counts["atom"] > 0, f"compiled, the kernel has no atomic additions (dq must be added with tl.atomic_add): {counts}"


# ------------------------------------------------------------------ on a GPU: compiled kernels against the interpreter
def cuda(torch, a):
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


@pytest.mark.gpu
@pytest.mark.exercise("17.1")
def test_gpu_bias_gelu_matches_the_interpreter(lesson):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(30)
    x, bias = f32(rng, 300, 457), f32(rng, 457)
    want = lesson.bias_gelu(x, bias)
    got = lesson.bias_gelu(cuda(torch, x), cuda(torch, bias)).cpu().numpy()
    assert_close(got, want.astype(np.float64), "bias_gelu compiled on the GPU against the interpreter", rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.exercise("17.2")
def test_gpu_softmax_matches_the_interpreter(lesson):
    torch = pytest.importorskip("torch")
    x = f32(np.random.default_rng(34), 300, 457, scale=5)
    want = lesson.softmax(x)
    got = lesson.softmax(cuda(torch, x)).cpu().numpy()
    assert_close(got, want.astype(np.float64), "softmax compiled on the GPU against the interpreter", rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.exercise("17.3")
def test_gpu_matmul_matches_the_interpreter(lesson):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(31)
    a, b, bias = f32(rng, 300, 200), f32(rng, 200, 170), f32(rng, 170)
    want = lesson.matmul(a, b, bias, "gelu", 64, 64, 32, 4)
    got = lesson.matmul(cuda(torch, a), cuda(torch, b), cuda(torch, bias), "gelu").cpu().numpy()  # autotuned
    assert_close(got, want.astype(np.float64), "matmul compiled (TF32 tensor cores) against the interpreter",
                 rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.exercise("17.4")
def test_gpu_flash_forward_matches_the_interpreter(lesson):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(32)
    q, k, v = heads(rng, 3, 300, 64), heads(rng, 3, 300, 64), heads(rng, 3, 300, 64)
    o, lse = lesson.flash_forward(q, k, v, True, 64, 64)
    og, lseg = lesson.flash_forward(cuda(torch, q), cuda(torch, k), cuda(torch, v), True, 64, 64)
    assert_close(og.cpu().numpy(), o.astype(np.float64), "flash_forward compiled against the interpreter", rtol=2e-2, atol=5e-3)
    assert_close(lseg.cpu().numpy(), lse.astype(np.float64), "flash_forward's lse compiled", rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.exercise("17.5")
def test_gpu_flash_backward_matches_the_interpreter(lesson):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(33)
    q, k, v, do = (heads(rng, 2, 200, 64) for _ in range(4))
    o, lse = lesson.flash_forward(q, k, v, True, 64, 64)
    want = lesson.flash_backward(q, k, v, o, lse, do, True, 32, 32)
    got = lesson.flash_backward(*(cuda(torch, a) for a in (q, k, v, o, lse, do)), True, 32, 32)
    for name, g_, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g_.cpu().numpy(), w.astype(np.float64), f"{name} compiled (atomic dq) against the interpreter",
                     rtol=3e-2, atol=3e-2)
