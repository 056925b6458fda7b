"""The course's GPU checks in one command, for a machine with a CUDA GPU:

    python3 -m course.gpu_report                  # everything; or: make gpucheck PY=python3
    python3 -m course.gpu_report --steps tests    # some steps: env,tests,cells,bench,sanitize
    python3 -m course.gpu_report --steps cells --lessons 07 --budget 600   # one lesson's cells, 10 minutes

It runs with the machine's own Python (no virtual environment needed) and needs NumPy, Numba (with
numba-cuda), CuPy for the machine's CUDA, pytest and hypothesis; jupytext and nbformat are not
needed (course.percent reads the lesson sources). Lesson 17 also needs Triton and PyTorch's CUDA build (GPU
images have both: Triton comes with PyTorch); without them its gpu cells and tests skip, saying why.
Steps, each in its own process with a time limit:

  env       the GPU, driver, CUDA and package versions
  tests     lesson 07 on the GPU (no simulator), lesson 08 (GPU tests, plus the NVRTC and emulator
            tests), the emulator's machinery tests, and the GPU tests of lessons 09, 10, 14 and 17
            (Triton kernels compiled and compared with Triton's interpreter), on the reference
            implementation
  cells     every code cell of lessons 07 and 08 (solutions/), in order, except the check cells;
            for lessons 09, 10, 14 and 17 the cells a lesson loads with, then its gpu cells: the gpu
            cells print the GPU figures the lessons quote
  bench     benchmarks/bench_gpu.py (every SGEMM kernel as a fraction of cuBLAS, softmax against the
            memory, fused vs unfused), the GPU parts of bench_quant (dp4a GEMMs) and bench_attention
            (tiled attention against PyTorch's SDPA)
  sanitize  compute-sanitizer memcheck, racecheck and synccheck on every solution kernel of lessons
            07 and 08, lesson 09's attention kernel and lesson 10's dp4a GEMMs

Results are merged into build/gpu_report.json (so steps can run in separate sessions) and written
as build/gpu_report.md. Exit status 0 if every step that ran passed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("env", "tests", "cells", "bench", "sanitize")
LIMITS = {"env": 120, "tests": 900, "cells": 1200, "bench": 1200, "sanitize": 1500}
LESSONS = ("07_cuda_model", "08_cupy_kernels")  # every cell runs
GPU_CELL_LESSONS = ("09_attention", "10_quantization", "14_compiler", "17_triton")  # loaded, then their gpu cells
GPU_TEST_FILES = [f"tests/test_{stem}.py" for stem in GPU_CELL_LESSONS]  # their tests marked gpu


_IMPORTABLE = False


def _setup_imports() -> None:
    """Make the course importable by the machine's own Python (the checkout first on sys.path); no
    Jupyter package is needed (course.percent reads the lesson sources)."""
    global _IMPORTABLE
    if not _IMPORTABLE:
        sys.path.insert(0, str(ROOT))
        _IMPORTABLE = True


# ---------------------------------------------------------------------------------------------
# Steps (each runs in a child process: python -m course.gpu_report --step NAME --json OUT)

def step_env() -> dict:
    info: dict = {"python": sys.version.split()[0], "platform": platform.platform()}
    for pkg in ("numpy", "numba", "numba_cuda", "cupy", "pytest", "hypothesis", "torch", "triton", "jupytext", "nbformat"):
        try:
            mod = __import__(pkg)
            info[pkg] = getattr(mod, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - report whatever is missing or broken
            info[pkg] = f"missing ({type(exc).__name__})"
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        info["nvidia-smi"] = out.stdout.strip() or out.stderr.strip()
    from course.gpu import gpu_status

    ok, reason = gpu_status()
    info["gpu"] = reason if ok else f"NOT USABLE: {reason}"
    try:
        import cupy

        info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        from cupy_backends.cuda.libs import nvrtc

        info["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    except Exception as exc:  # noqa: BLE001
        info["cuda_runtime"] = f"? ({exc})"
    from course.cuda_c import compiler, cuda_include_dirs

    info["cuda_include_dirs"] = list(cuda_include_dirs())
    info["g++ (CPU emulator)"] = compiler() or "missing"
    info["compute-sanitizer"] = _sanitizer() or "missing"
    return {"ok": ok, "info": info}


def step_tests() -> dict:
    results = Path(tempfile.mkdtemp()) / "results.jsonl"
    env = dict(os.environ, MT_RESULTS=str(results))
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # lesson 07 runs compiled on the GPU
    runs = [["tests/test_07_cuda_model.py", "tests/test_08_cupy_kernels.py", "tests/machinery/test_cuda_c.py"],
            [*GPU_TEST_FILES, "-m", "gpu"]]
    t0 = time.time()
    tails, codes = [], []
    for args in runs:
        cmd = [sys.executable, "-c", "import sys; from course.gpu_report import _setup_imports; _setup_imports(); "
               "import pytest; sys.exit(pytest.main(sys.argv[1:]))", *args, "--impl=reference", "-q", "-rfEs",
               "-p", "no:cacheprovider"]
        left = LIMITS["tests"] - 30 - (time.time() - t0)
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(left, 60))
        codes.append(out.returncode)
        tails.append(out.stdout[-3000:] + out.stderr[-2000:])
    records = [json.loads(ln) for ln in results.read_text().splitlines()] if results.exists() else []
    done = [r for r in records if r.get("event") == "end"]
    done += [dict(r, outcome="collect error") for r in records if r.get("event") == "collect_error"]
    summary = {}
    for r in done:
        summary[r["outcome"]] = summary.get(r["outcome"], 0) + 1
    failed = [r for r in done if r["outcome"] not in ("passed", "skipped")]
    return {"ok": all(c == 0 for c in codes) and not failed, "seconds": round(time.time() - t0, 1), "summary": summary,
            "failed": [{"test": r.get("nodeid", r.get("test")), "message": r.get("message", "")} for r in failed],
            "skipped": sorted({r.get("message", "") for r in done if r["outcome"] == "skipped"}),
            "tail": "\n".join(tails)}


def step_cells(small: bool) -> dict:
    """Execute each lesson's solution cells in order (not the check cells), capturing output."""
    from course.percent import read

    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    if small:
        os.environ["MINITORCH_SMALL"] = "1"
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        pass
    lessons = {}
    ok = True
    wanted = os.environ.get("MT_GPU_LESSONS", "")  # --lessons 07,09: only these lessons' cells
    for stem in LESSONS + GPU_CELL_LESSONS:
        if wanted and stem[:2] not in wanted.split(","):
            continue
        nb = read(ROOT / "solutions" / f"{stem}.py")
        module = type(sys)(f"lesson_{stem}")
        module.__file__ = str(ROOT / "solutions" / f"{stem}.py")
        sys.modules[module.__name__] = module
        cells = []
        for i, cell in enumerate(nb.cells):
            tags = set(cell.metadata.get("tags", []))
            if cell.cell_type != "code" or "check" in tags:
                continue
            if stem in GPU_CELL_LESSONS and tags & {"demo"}:  # what the gpu cells need is in loaded cells
                continue
            buf = io.StringIO()
            t0 = time.time()
            error = None
            try:
                with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                    exec(compile(cell.source, f"{stem}.py cell {i}", "exec"), module.__dict__)
            except Exception:  # noqa: BLE001 - report the cell and go on
                error = traceback.format_exc(limit=4)[-2500:]
                ok = False
            out = buf.getvalue()
            if "gpu" in tags or error or (out.strip() and "demo" in tags):
                cells.append({"cell": i, "tags": sorted(tags), "seconds": round(time.time() - t0, 2),
                              "output": out[-4000:], "error": error, "first_line": cell.source.splitlines()[0][:100]})
        lessons[stem] = cells
    return {"ok": ok, "lessons": lessons}


def step_bench() -> dict:
    """benchmarks/bench_gpu.py whole, then the GPU parts of bench_quant (the dp4a GEMMs against lesson 08's
    float32 kernels) and bench_attention (the tiled CUDA kernel against unfused CuPy and PyTorch's SDPA)."""
    import importlib.util

    out_dir = ROOT / "build" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    errors = []
    quant: dict = {}
    parts = (("bench_gpu", lambda mod: mod.main(out_dir)), ("bench_quant", lambda mod: mod.gpu(quant)),
             ("bench_attention", lambda mod: mod.gpu_table([512, 1024, 2048, 4096])))
    with contextlib.redirect_stdout(buf):
        for stem, run in parts:
            print(f"== {stem}", flush=True)
            try:
                spec = importlib.util.spec_from_file_location(stem, ROOT / "benchmarks" / f"{stem}.py")
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                run(mod)
            except Exception:  # noqa: BLE001 - report the part and go on
                errors.append(f"{stem}: {traceback.format_exc(limit=4)}")
    data = json.loads((out_dir / "gpu.json").read_text()) if (out_dir / "gpu.json").exists() else None
    if data is not None and quant.get("gpu"):
        data["quant"] = quant["gpu"]
    return {"ok": not errors and data is not None, "output": buf.getvalue()[-12000:],
            "error": "\n".join(errors) or None, "data": data}


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        for sub in ("bin", "compute-sanitizer"):
            if base and (Path(base) / sub / "compute-sanitizer").exists():
                return str(Path(base) / sub / "compute-sanitizer")
    return None


def launch_all_kernels() -> None:
    """Launch every solution kernel of lessons 07 and 08, lesson 09's attention kernel and lesson
    10's dp4a GEMMs once, on small odd shapes (the process compute-sanitizer watches)."""
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    import numpy as np
    import cupy as cp

    import minitorch.cupy_kernels as k8
    import minitorch.cuda_kernels as k7

    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x = cp.asarray(f32(37, 45))
    k8.bias_gelu(x, cp.asarray(f32(45)))
    k8.l2norm(x, axis=1)
    a, b = cp.asarray(f32(37, 29)), cp.asarray(f32(29, 45))
    for name in k8.SGEMM_KERNELS:
        k8.sgemm(a, b, name)
        print("launched sgemm", name, flush=True)
    k8.hgemm(a.astype(cp.float16), b.astype(cp.float16))
    k8.hgemm_pipe(a.astype(cp.float16), b.astype(cp.float16))
    k8.hgemm_pipe(*(cp.asarray(f32(*s)).astype(cp.float16) for s in ((144, 80), (80, 136))))
    k8.softmax(cp.asarray(f32(5, 1000)))
    for cols in (36, 1000, 4100):  # one warp with idle threads; a block's partial last warp; three warps
        k8.softmax_v4(cp.asarray(f32(3, cols)))
    cp.cuda.Device().synchronize()
    print("launched lesson 08 kernels", flush=True)
    k7.vector_add(f32(1000), f32(1000))
    k7.bias_relu(f32(37, 45), f32(45))
    k7.gpu_sum(f32(1000))
    k7.gpu_sum_coarse(f32(3000))
    k7.gpu_cumsum(f32(300))
    k7.gpu_cumsum_blelloch(f32(300))
    k7.matmul_naive(f32(21, 17), f32(17, 40))
    k7.matmul_tiled(f32(21, 17), f32(17, 40))
    k7.transpose(f32(45, 70))
    print("launched lesson 07 kernels", flush=True)
    from minitorch.attention import flash_attention_cuda
    from minitorch.quant import int8_gemm_dp4a, int8_gemm_dp4a_regtile

    q, kk, v = (cp.asarray(f32(2, 37, 64)) for _ in range(3))
    for is_causal in (False, True):
        flash_attention_cuda(q, kk, v, causal=is_causal)
    a8, b8 = (cp.asarray(rng.integers(-128, 128, s).astype(np.int8)) for s in ((37, 45), (45, 29)))
    int8_gemm_dp4a(a8, b8)
    int8_gemm_dp4a_regtile(a8, b8)
    int8_gemm_dp4a_regtile(*(cp.asarray(rng.integers(-128, 128, s).astype(np.int8)) for s in ((130, 70), (70, 131))))
    cp.cuda.Device().synchronize()
    print("launched lesson 09 and 10 kernels", flush=True)


def step_sanitize() -> dict:
    tool = _sanitizer()
    if tool is None:
        return {"ok": False, "error": "compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda/bin)"}
    runs = {}
    ok = True
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    # memcheck's API-error reports are left out: numba-cuda probes the driver with calls that fail by
    # design (cuGetProcAddress for entry points this driver lacks), 34 reports on an H100, none a kernel's
    for name, extra in [("memcheck", ["--report-api-errors", "no"]), ("racecheck", ["--racecheck-report", "all"]), ("synccheck", [])]:
        cmd = [tool, "--tool", name, *extra, "--error-exitcode", "86", "--print-limit", "30",
               sys.executable, "-m", "course.gpu_report", "--launch-kernels"]
        t0 = time.time()
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMITS["sanitize"] // 3)
            text, code = out.stdout + out.stderr, out.returncode
        except subprocess.TimeoutExpired as exc:
            text, code = f"timed out after {exc.timeout} s", -1
        summary = re.findall(r"(?:ERROR SUMMARY|RACECHECK SUMMARY)[^\n]*", text)
        clean = code == 0 and "launched lesson 09 and 10 kernels" in text
        ok &= clean
        runs[name] = {"clean": clean, "exit": code, "seconds": round(time.time() - t0, 1), "summary": summary,
                      "head": text[:6000], "tail": text[-4000:]}  # the first errors, and how it ended
    return {"ok": ok, "runs": runs}


# ---------------------------------------------------------------------------------------------
# Driver and report

def run_step(step: str, small: bool, limit: float | None = None) -> dict:
    limit = LIMITS[step] if limit is None else min(limit, LIMITS[step])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        cmd = [sys.executable, "-m", "course.gpu_report", "--step", step, "--json", str(out)] + (["--small"] if small else [])
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"step {step} ran past its {limit:.0f} s limit"}
        if not out.exists():
            return {"ok": False, "error": f"step {step} died (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}"}
        data = json.loads(out.read_text())
        data["step_seconds"] = round(time.time() - t0, 1)
        return data


def render(report: dict) -> str:
    lines = ["# GPU report", ""]
    env = report.get("env", {})
    if env:
        lines += ["## Environment", ""] + [f"- {k}: {v}" for k, v in env.get("info", {}).items()] + [""]
    tests = report.get("tests")
    if tests:
        lines += ["## Tests (reference implementation, on the GPU)", "",
                  f"{'PASS' if tests.get('ok') else 'FAIL'}: {tests.get('summary', tests.get('error'))} "
                  f"in {tests.get('seconds', '?')} s", ""]
        for f in tests.get("failed", []):
            lines += [f"- FAILED {f['test']}: {f['message']}"]
        if tests.get("skipped"):
            lines += ["", "Skip reasons: " + "; ".join(tests["skipped"])]
        lines += [""]
    cells = report.get("cells")
    if cells:
        lines += ["## Lesson cells (gpu cells and outputs)", ""]
        for stem, cs in cells.get("lessons", {}).items():
            lines += [f"### {stem}", ""]
            for c in cs:
                lines += [f"cell {c['cell']} {c['tags']} ({c['seconds']} s): `{c['first_line']}`", "", "```",
                          (c["output"] or "").rstrip(), "```", ""]
                if c.get("error"):
                    lines += ["ERROR:", "```", c["error"].rstrip(), "```", ""]
        if cells.get("error"):
            lines += [cells["error"], ""]
    bench = report.get("bench")
    if bench:
        lines += ["## Benchmarks (bench_gpu; the GPU parts of bench_quant and bench_attention)", "", "```",
                  (bench.get("output") or "").rstrip(), "```", ""]
        if bench.get("error"):
            lines += ["```", bench["error"].rstrip(), "```", ""]
    san = report.get("sanitize")
    if san:
        lines += ["## compute-sanitizer", ""]
        if san.get("error"):
            lines += [san["error"], ""]
        for name, r in san.get("runs", {}).items():
            lines += [f"- {name}: {'clean' if r['clean'] else 'NOT CLEAN'} (exit {r['exit']}, {r['seconds']} s) "
                      f"{' / '.join(r['summary'])}"]
            if not r["clean"]:
                lines += ["", "```", r.get("head", "").rstrip(), "...", r["tail"].rstrip(), "```", ""]
        lines += [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--out", default=str(ROOT / "build" / "gpu_report.md"))
    p.add_argument("--small", action="store_true", help="MINITORCH_SMALL=1 for the lesson cells")
    p.add_argument("--fresh", action="store_true", help="forget results of earlier runs")
    p.add_argument("--lessons", help="the cells step runs only these lessons (two digits, comma-separated)")
    p.add_argument("--budget", type=float, help="seconds for all steps together (a leased GPU's time): each step "
                   "gets what is left, and steps after it is spent are reported as not run")
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--launch-kernels", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lessons:
        os.environ["MT_GPU_LESSONS"] = args.lessons  # read by the cells step's child process
    _setup_imports()
    if args.launch_kernels:
        launch_all_kernels()
        return 0
    if args.step:
        fn = {"env": step_env, "tests": step_tests, "cells": lambda: step_cells(args.small), "bench": step_bench,
              "sanitize": step_sanitize}[args.step]
        try:
            data = fn()
        except Exception:  # noqa: BLE001 - a broken step is reported, not fatal
            data = {"ok": False, "error": traceback.format_exc(limit=6)}
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
        return 0
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        p.error(f"unknown steps {unknown}; steps are {', '.join(STEPS)}")
    out_md = Path(args.out)
    out_json = out_md.with_suffix(".json")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    report = {} if args.fresh or not out_json.exists() else json.loads(out_json.read_text())
    status = 0
    start = time.time()
    for step in steps:
        print(f"== {step}", flush=True)
        left = None if args.budget is None else args.budget - (time.time() - start)
        if left is not None and left < 10:
            report[step] = {"ok": False, "error": f"not run: the {args.budget:.0f} s budget was spent"}
        else:
            report[step] = run_step(step, args.small, left)
        print(f"   {'ok' if report[step].get('ok') else 'FAILED'} ({report[step].get('step_seconds', '?')} s)"
              + (f": {report[step]['error'][:300]}" if report[step].get("error") else ""), flush=True)
        status |= 0 if report[step].get("ok") else 1
        out_json.write_text(json.dumps(report, indent=1, default=str))
        out_md.write_text(render(report))
    print(f"report: {out_md} (and {out_json.name})")
    return status


if __name__ == "__main__":
    sys.exit(main())
