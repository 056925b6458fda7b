"""Lesson 14's minitorch.compiler where the lesson's tests do not reach it: the transformer block
the benchmark compiles (its weights, mask, NumPy twin), the speed table and the profile, the FLOP
count, the dot drawing, `probe`, `compile`, the kernels' scalar functions; and the contracts of the
given machinery (graphs and nodes, the code generators' names, the runners' options).

The block is compiled in float32 at one small width, so that block_speed, block_profile and the
first test share the generated kernels (KERNEL_CACHE keys them by their source, not their shape)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from minitorch import compiler
from minitorch.autograd import Tensor


def softmax_fn(x):
    e = (x - x.max(axis=-1, keepdims=True)).exp()
    return e / e.sum(axis=-1, keepdims=True)


def softmax_np(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_gpt_block_eager_compiled_and_numpy_agree():
    ws = compiler.gpt_block_weights(8, 2, seed=3)
    assert len(ws) == 8 + 4 * 2 and all(w.dtype == np.float32 for w in ws)
    assert [w.shape for w in ws[2:4]] == [(8, 4), (8, 4)] and ws[-2].shape == (32, 8)
    mask = compiler.causal_mask(4)
    assert mask.dtype == np.float32 and np.isneginf(mask[0, 1]) and np.all(np.tril(mask) == 0)
    assert np.isneginf(mask).sum() == 6  # above the diagonal of a 4 x 4 mask
    x = np.random.default_rng(4).standard_normal((2, 4, 8)).astype(np.float32)
    want = compiler.gpt_block_numpy(x, mask, *ws)
    assert want.shape == (2, 4, 8) and want.dtype == np.float32
    eager = compiler.gpt_block(Tensor(x), Tensor(mask), *map(Tensor, ws)).data
    np.testing.assert_allclose(eager, want, rtol=1e-4, atol=1e-5)
    f = compiler.compile(compiler.gpt_block)
    got = f(Tensor(x), Tensor(mask), *map(Tensor, ws))
    np.testing.assert_allclose(got.data, want, rtol=1e-4, atol=1e-5)
    assert f.compiles == 1 and not f.breaks
    with pytest.raises(ValueError, match="gpt_block_weights: c = 9 is not a multiple of n_head = 2"):
        compiler.gpt_block_weights(9, 2)
    with pytest.raises(ValueError, match=r"gpt_block_numpy: weights must be .* got 15 arrays"):
        compiler.gpt_block_numpy(x, mask, *ws[:-1])
    with pytest.raises(ValueError, match=r"gpt_block_numpy: x must be an array of 3 axes \(B, T, C\)"):
        compiler.gpt_block_numpy(x[0], mask, *ws)
    with pytest.raises(TypeError, match="causal_mask: dtype must be float32 or float64"):
        compiler.causal_mask(4, np.int32)


class Bar:
    def __init__(self):
        self.n = 0

    def update(self):
        self.n += 1


def test_block_speed_and_profile_tables(capsys):
    bar = Bar()
    r = compiler.block_speed(1, 4, 8, n_head=2, rounds=1, progress=bar)
    assert bar.n == 2, "progress: once after compiling, once per round"
    assert r["shape"] == (1, 4, 8) and r["err"] < 1e-4 and len(r["rounds"]["eager"]) == 1
    assert r["fused_kernels"] < r["eager_kernels"] and r["fused_bytes"] < r["eager_bytes"]
    assert all(r[k] > 0 for k in ("eager", "numpy", "compiled", "matmul", "guard"))
    compiler.print_speed_table([r])
    out = capsys.readouterr().out
    assert "(1, 4, 8)" in out and f"{r['eager_kernels']:>4}->{r['fused_kernels']:<4}" in out
    prof = compiler.block_profile(1, 4, 8, n_head=2, repeat=2)
    assert len(prof) == r["fused_kernels"] and all(len(ts) == 2 for ts in prof.values())
    assert sum(label.startswith("library matmul") for _, label in prof) >= 2 * 4  # q, k, v, o per head, at least
    compiler.print_profile((1, 4, 8), prof, top=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("(1, 4, 8): ") and f"in {len(prof)} kernels (2 runs)" in out[0] and len(out) == 3
    with pytest.raises(ValueError, match="block_speed: c = 9 is not a multiple of n_head = 2"):
        compiler.block_speed(1, 4, 9, n_head=2)
    with pytest.raises(ValueError, match="block_profile: repeat must be an integer >= 1, got 0"):
        compiler.block_profile(1, 4, 8, n_head=2, repeat=0)
    with pytest.raises(ValueError, match=r"print_profile: prof holds no kernel's times"):
        compiler.print_profile((1, 4, 8), {})
    with pytest.raises(ValueError, match=r"print_speed_table: results\[0\] must be a dict with .* it has no rounds"):
        compiler.print_speed_table([{k: v for k, v in r.items() if k != "rounds"}])


def test_plan_flops_and_dot():
    g = compiler.optimize(compiler.trace(softmax_fn, np.zeros((3, 5))))
    assert compiler.plan_flops(g) == 5 * 15, "max, sub, exp, sum, div: one FLOP per element each"
    gm = compiler.trace(lambda a, b: (a @ b).relu(), np.zeros((2, 3)), np.zeros((3, 4)))
    assert compiler.plan_flops(gm) == 2 * 2 * 4 * 3 + 8
    plan = compiler.fuse(g)
    dot = g.to_dot(plan)
    assert dot.startswith("digraph G {") and dot.endswith("}")
    assert dot.count("subgraph cluster_") == len(plan) == 1
    assert dot.count(" -> n") == sum(len(n.inputs) for n in g.nodes) and "output 0" in dot
    assert "cluster" not in g.to_dot() and g.to_dot().count("[label=") == len(g.nodes) + 1
    with pytest.raises(TypeError, match=r"Graph.to_dot: plan\[0\] must be a sequence"):
        g.to_dot([g.nodes[1]])


def test_probe_prints_eagerly_and_is_a_node_when_traced(capsys):
    x = np.arange(6.0).reshape(2, 3)
    compiler.probe(Tensor(x), "t")
    compiler.probe(x.astype(np.float32), "a")
    assert capsys.readouterr().out.splitlines() == ["probe t: shape (2, 3), mean 2.5",
                                                    "probe a: shape (2, 3), mean 2.5"]

    def f(x):
        compiler.probe(x, "inside")
        return x * 2.0

    g = compiler.trace(f, x)
    assert g.count("probe") == 1 and g.count() == 4 and capsys.readouterr().out == ""
    np.testing.assert_array_equal(compiler.interpret(g)(x)[0], 2 * x)
    assert capsys.readouterr().out == "probe inside: shape (2, 3), mean 2.5\n"
    with pytest.raises(TypeError, match="probe: x must be "):
        compiler.probe("x")
    with pytest.raises(TypeError, match="probe: label must be a str, got 3"):
        compiler.probe(x, 3)


def test_compile_runs_fused_numba_kernels():
    x = np.random.default_rng(5).standard_normal((6, 9))
    f = compiler.compile(softmax_fn)
    for _ in range(2):
        np.testing.assert_allclose(f(Tensor(x)).data, softmax_np(x), rtol=1e-12)
    assert f.compiles == 1 and len(f.cache) == 1
    with pytest.raises(TypeError, match="compile: fn must be callable, got 3"):
        compiler.compile(3)


def test_scalar_functions_of_the_kernels():
    assert compiler.vexp(0.0) == 1.0 and compiler.vexp(1000.0) == math.inf and math.isnan(compiler.vexp(math.nan))
    assert compiler.vexp(np.float32(1.0)) == pytest.approx(math.e)
    assert compiler.vtanh(0.5) == math.tanh(0.5) and compiler.vtanh(-math.inf) == -1.0
    assert compiler.vmax(2.0, 3) == 3
    assert math.isnan(compiler.vmax(math.nan, 1.0)) and math.isnan(compiler.vmax(1.0, math.nan))
    assert compiler.vrelu(-1.5) == 0.0 and compiler.vrelu(2.5) == 2.5 and math.isnan(compiler.vrelu(math.nan))
    # Numba finds them by identity (their @overload): the module's functions are the kernels' own
    # (the validation walk's harvester, under MT_WALK, wraps every function: unwrap that one)
    for name in ("vexp", "vtanh", "vmax", "vrelu"):
        assert inspect.unwrap(getattr(compiler, name)) is compiler.KERNEL_NAMES[name]
        assert getattr(compiler.KERNEL_NAMES[name], "__contract__", None) is None, f"{name} is wrapped by its checks"
    with pytest.raises(TypeError, match=r"vexp: x must be a real number .*got '1'"):
        compiler.vexp("1")
    with pytest.raises(TypeError, match="vmax: b must be a real number .*got None"):
        compiler.vmax(1.0, None)
    with pytest.raises(TypeError, match="vrelu: x must be a real number .*got True"):
        compiler.vrelu(True)


def test_contracts_of_graphs_and_generators():
    g = compiler.Graph()
    x = g.add_input("x", (2, 3), np.float32)
    with pytest.raises(ValueError, match=r"Graph.add: op must be an op of the IR .*got 'gather'"):
        g.add("gather", [x])
    with pytest.raises(TypeError, match=r"Graph.add: inputs\[0\] must be a Node"):
        g.add("exp", [np.zeros(3)])
    with pytest.raises(TypeError, match=r"dtype must be float32 or float64 \(a dtype\), got <class 'numpy.int64'>"):
        g.add_input("y", (2,), np.int64)
    with pytest.raises(TypeError, match=r"Graph.add_input: dtype must be float32 or float64 \(a dtype\), got None"):
        g.add_input("y", (2,), None)
    with pytest.raises(ValueError, match=r"Graph.add_input: shape\[1\] must be an integer >= 0, got -3"):
        g.add_input("y", (2, -3), np.float64)
    with pytest.raises(ValueError, match="Graph.count: op must be an op of the IR .*got 'mull'"):
        g.count("mull")
    n = compiler.Node("exp", [x], {}, (2, 3), "float32")  # a node made by hand: its fields as Graph.add makes them
    assert (n.op, n.inputs, n.shape, n.dtype, n.nbytes) == ("exp", (x,), (2, 3), np.dtype(np.float32), 24)
    with pytest.raises(ValueError, match=r"Node: op must be an op of the IR .*got 'gather'"):
        compiler.Node("gather", [x], {}, (2, 3), np.float32)
    with pytest.raises(TypeError, match=r"Node: attrs must be a dict, got \['axis'\]"):
        compiler.Node("exp", [x], ["axis"], (2, 3), np.float32)
    c = g.add_const(-math.inf, np.float32)  # a -inf or nan constant is valid (a mask, a mean of nothing)
    assert c.attrs["value"] == -math.inf and g.count("const") == 1
    e = g.add("exp", [x])
    g.outputs = [e]
    with pytest.raises(ValueError, match=r"domain: group must be a sequence of at least 1 items, got \[\]"):
        compiler.domain([])
    with pytest.raises(ValueError, match=r"numba_source: name must be an identifier .*got '1k'"):
        compiler.numba_source(g, [e], "1k")
    with pytest.raises(ValueError, match=r"fits: dom must be a domain \(R, C\)"):
        compiler.fits(e, (2, 3))
    with pytest.raises(ValueError, match=r"row_view: a has shape \(3, 2\), not node_shape \(2, 3\)"):
        compiler.row_view(np.zeros((3, 2)), (2, 3), ((2,), 3), False)
    with pytest.raises(ValueError, match="compile_numba: source is not valid Python"):
        compiler.compile_numba("def k(:\n", "k")
    with pytest.raises(ValueError, match="compile_numba: name 'k2' is not a function the source defines"):
        compiler.compile_numba("def k(x):\n    return x\n", "k2")
    with pytest.raises(ValueError, match="cuda_runner: device must be one of 'emulator', 'gpu', got 'cpu'"):
        compiler.cuda_runner(g, device="cpu")
    with pytest.raises(ValueError, match="cuda_runner: block must be an integer in \\[1, 1024\\], got 2048"):
        compiler.cuda_runner(g, block=2048)
    with pytest.raises(TypeError, match="c_literal: dtype must be float32 or float64"):
        compiler.c_literal(1.0, "int8")
    assert compiler.c_literal(math.nan, np.float32) == "(INFINITY - INFINITY)"
    assert compiler.py_literal(-math.inf, "float64") == "-math.inf"
    with pytest.raises(ValueError, match=r"grad_graph: wrt\[0\] must be an integer >= 0, got -1"):
        compiler.grad_graph(g, wrt=[-1])
    with pytest.raises(TypeError, match="Proxy.sum: axis must be "):
        compiler.trace(lambda x: x.sum(axis=1.5), np.zeros((2, 3)))
    with pytest.raises(TypeError, match="Proxy.max: keepdims must be True or False, got 'yes'"):
        compiler.trace(lambda x: x.max(axis=-1, keepdims="yes"), np.zeros((2, 3)))
    with pytest.raises(TypeError, match=r"compile_grad: options are build_kernels' .*got 'paralel'"):
        compiler.compile_grad(lambda x: x.sum(axis=0), paralel=False)
    with pytest.raises(TypeError, match=r"Autotuner.tune: key must be hashable \(a cache key\), got \(\[1\],\)"):
        compiler.Autotuner().tune(([1],), [0], lambda c: [np.zeros(1)])
    with pytest.raises(compiler.GraphBreak, match="one axis only"):  # a valid axis the IR lacks: eager fallback
        compiler.trace(lambda x: x.sum(axis=(0, 1)), np.zeros((2, 3)))


# --- the kernels' disk cache (compile_numba, as Inductor's code cache) ------------------------------

EXP_KERNEL = ("def k(rows, C, in0, out0):\n    for r in prange(rows):\n        for c in range(C):\n"
              "            out0[r, c] = vexp(in0[r, c]) + vrelu(in0[r, c])\n")
SECOND_PROCESS = """
import sys
from pathlib import Path
import numpy as np
from minitorch import compiler
compiler.KERNEL_DIR = Path(sys.argv[1])
k = compiler.compile_numba(sys.argv[2], "k", parallel=False)
x = np.linspace(-3, 3, 12).reshape(3, 4)
out = np.empty_like(x)
k(3, 4, x, out)
assert np.allclose(out, np.exp(x) + np.maximum(x, 0))
print(k.stats.cache_hits.get(k.signatures[0], 0), k.stats.cache_misses.get(k.signatures[0], 0))
"""


def test_a_kernel_is_compiled_once_per_machine_and_found_again_by_another_process(tmp_path):
    import subprocess
    import sys

    runs = [subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(tmp_path), EXP_KERNEL], capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    (hits0, misses0), (hits1, misses1) = ([int(v) for v in r.stdout.split()] for r in runs)
    assert (hits0, misses0) == (0, 1), "the first process compiles the kernel"
    assert (hits1, misses1) == (1, 0), "the second loads the first one's machine code from the kernel directory"
    assert len(list(tmp_path.glob("k*.py"))) == 1 and list((tmp_path / "__pycache__").glob("*.nbi"))


def test_a_kernels_file_names_all_its_machine_code_is_made_of(monkeypatch):
    """Its source, its flags, the helpers' code (a change there is a new file), and the same in a
    notebook as in the package (so a notebook finds the package's kernels)."""
    from course import loader
    from course.source import find_lesson

    path = compiler._kernel_file(EXP_KERNEL, "k", False)
    assert path.parent == compiler.KERNEL_DIR and path.suffix == ".py"
    assert compiler._kernel_file(EXP_KERNEL, "k", True) != path
    assert compiler._kernel_file(EXP_KERNEL + "\n", "k", False) != path
    text = compiler._helpers_text()
    for name in ("def vexp", "def _vexp_numba", "def _scale32", "def vrelu"):  # the helpers and their Numba code
        assert name in text, name
    monkeypatch.setattr(compiler, "_helpers_text", lambda: text.replace("0.5", "0.25"))
    assert compiler._kernel_file(EXP_KERNEL, "k", False) != path, "a helper's change must name another file"
    monkeypatch.undo()
    monkeypatch.setenv("MT_CELL_TIME_LIMIT", "120")
    solution = loader.load(find_lesson("14"), "solution")  # its given cells run inline, not imported
    assert solution._kernel_file(EXP_KERNEL, "k", False) == path
