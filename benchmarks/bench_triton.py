"""Lesson 17 on a GPU: the Triton kernels against PyTorch's (cuBLAS, its softmax, its attention).

- softmax of an 8192 x 8192 float32 matrix: GB/s (8 bytes per element, read and written) of the fused
  Triton kernel, of torch.softmax and of a device-to-device copy (the bandwidth the card reaches);
- matmul, square n = 2048, 4096 (8192 outside SMALL): TFLOP/s of the autotuned Triton kernel against cuBLAS
  (torch.matmul) for float32 (Triton uses TF32 tensor cores; cuBLAS with and without TF32) and float16, and
  the float16 kernel with GROUP_M = 8 against row-major order (GROUP_M = 1) at fixed 128 x 128 x 64 tiles;
- attention, batch x heads = 32, d = 64, float16, causal, N = 1024, 2048, 4096: forward and forward +
  backward of the Triton FlashAttention-2 kernels against torch's scaled_dot_product_attention and against
  attention written as PyTorch operators.

Times are triton.testing.do_bench medians (warm-up, then repeated launches timed with CUDA events). The
device's name is printed and saved with the numbers in build/bench/triton.json. Without a CUDA GPU, or
without PyTorch's CUDA build (the kernels' tensors), this benchmark prints why and does nothing else.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from course.gpu import gpu_status

SMALL = os.environ.get("MINITORCH_SMALL") == "1"


def main(out_dir: Path) -> None:
    ok, reason = gpu_status()
    if not ok:
        print(f"skipped: needs a CUDA GPU ({reason})")
        return
    try:
        import torch
    except ImportError:
        print("skipped: the Triton kernels run on PyTorch CUDA tensors, and PyTorch is not installed")
        return
    import triton

    from minitorch.triton_kernels import autotuned, flash_backward, flash_forward, matmul, matmul_configs, matmul_kernel, softmax

    bench = triton.testing.do_bench
    print(f"device: {reason}; Triton {triton.__version__}, PyTorch {torch.__version__}")
    results: dict = {"device": reason, "triton": triton.__version__, "softmax": {}, "matmul": {}, "attention": {}}

    x = torch.randn(8192, 8192, device="cuda")
    buf = torch.empty_like(x)
    assert torch.allclose(softmax(x), torch.softmax(x, dim=1), atol=1e-6), "Triton softmax gives wrong results"
    gbs = {name: 2 * x.nbytes / bench(fn) / 1e6 for name, fn in
           {"copy": lambda: buf.copy_(x), "triton": lambda: softmax(x), "torch": lambda: torch.softmax(x, dim=1)}.items()}
    results["softmax"] = gbs
    print(f"softmax 8192x8192 float32: copy {gbs['copy']:,.0f} GB/s, Triton {gbs['triton']:,.0f} GB/s "
          f"({gbs['triton'] / gbs['copy']:.0%} of the copy), torch.softmax {gbs['torch']:,.0f} GB/s")

    print(f"\n{'n':>6} {'dtype':>8} {'Triton':>8} {'cuBLAS':>8} {'cuBLAS TF32':>12}   TFLOP/s (Triton / cuBLAS)")
    for n in (2048, 4096) if SMALL else (2048, 4096, 8192):
        for dtype in (torch.float32, torch.float16):
            a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
            ref = a.double() @ b.double()
            err = ((matmul(a, b).double() - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                raise AssertionError(f"Triton matmul {dtype} n={n}: relative error {err:.1e}")
            flops = 2 * n ** 3
            row = {"triton": flops / bench(lambda: matmul(a, b)) / 1e9,
                   "config": str(autotuned(matmul_kernel, matmul_configs(), key=["M", "N", "K"]).best_config)}
            for tf32 in (False, True):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                row["cublas_tf32" if tf32 else "cublas"] = flops / bench(lambda: a @ b) / 1e9
            torch.backends.cuda.matmul.allow_tf32 = False
            results["matmul"][f"{n}-{str(dtype)[6:]}"] = row
            base = row["cublas_tf32"] if dtype == torch.float32 else row["cublas"]
            print(f"{n:>6} {str(dtype)[6:]:>8} {row['triton']:>8.0f} {row['cublas']:>8.0f} {row['cublas_tf32']:>12.0f}"
                  f"   ({row['triton'] / base:.0%} of cuBLAS{' TF32' if dtype == torch.float32 else ''})")
    n = 4096 if SMALL else 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.float16), torch.randn(n, n, device="cuda", dtype=torch.float16)
    order = {g: bench(lambda: matmul(a, b, block_m=128, block_n=128, block_k=64, group_m=g)) for g in (1, 8)}
    results["matmul"]["grouped_order_ms"] = {f"GROUP_M={g}": t for g, t in order.items()}
    print(f"float16 n={n}, 128x128x64 tiles: row-major {order[1]:.2f} ms, GROUP_M=8 {order[8]:.2f} ms "
          f"({order[1] / order[8]:.2f}x)")

    sdpa = torch.nn.functional.scaled_dot_product_attention
    g, d = 32, 64
    print(f"\n{'N':>6} {'Triton fwd':>11} {'SDPA fwd':>9} {'unfused fwd':>12} {'Triton f+b':>11} {'SDPA f+b':>9} "
          f"{'unfused f+b':>12}   ms, float16, causal, {g} heads x d={d}")
    for n in (1024, 2048) if SMALL else (1024, 2048, 4096):
        q, k, v = (torch.randn(g, n, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        do = torch.randn(g, n, d, device="cuda", dtype=torch.float16)
        mask = torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1)

        def unfused(q, k, v):
            s = (q @ k.transpose(-1, -2)).float() / math.sqrt(d)
            return torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1).to(q.dtype) @ v

        def causal_sdpa(q, k, v):
            return sdpa(q, k, v, is_causal=True)

        o, lse = flash_forward(q.detach(), k.detach(), v.detach(), True, 128, 64)
        if (o.float() - causal_sdpa(q, k, v).float()).abs().max().item() > 1e-2:
            raise AssertionError(f"Triton attention differs from SDPA at N={n}")

        def triton_both():
            o, lse = flash_forward(q.detach(), k.detach(), v.detach(), True, 128, 64)
            flash_backward(q.detach(), k.detach(), v.detach(), o, lse, do, True, 64, 64)

        def torch_both(fn):
            return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)

        with torch.no_grad():
            fwd = {"triton": bench(lambda: flash_forward(q, k, v, True, 128, 64)),
                   "sdpa": bench(lambda: causal_sdpa(q, k, v)), "unfused": bench(lambda: unfused(q, k, v))}
        both = {"triton": bench(triton_both), "sdpa": bench(torch_both(causal_sdpa)), "unfused": bench(torch_both(unfused))}
        results["attention"][n] = {"forward_ms": fwd, "forward_backward_ms": both}
        print(f"{n:>6} {fwd['triton']:>11.3f} {fwd['sdpa']:>9.3f} {fwd['unfused']:>12.3f} {both['triton']:>11.3f} "
              f"{both['sdpa']:>9.3f} {both['unfused']:>12.3f}")
    (out_dir / "triton.json").write_text(json.dumps(results, indent=1))
