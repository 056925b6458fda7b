"""What the validation walk (course.validation_walk) does not try, each with its reason.

EXEMPT maps (callable, parameter, bad value) patterns (fnmatch, `*` for any) to the reason. Keep it
short: an entry is a decision that a value the walk calls bad is valid here, or that a callable
cannot be called twice (it starts a server, waits for a client), never a way to silence a finding.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

# Every module of the package, from its index (minitorch/__init__.py lists each with its lesson).
_INDEX = (Path(__file__).resolve().parent.parent / "minitorch" / "__init__.py")
ALL_MODULES: list[str] = re.findall(r"minitorch\.(\w+)\s+lesson", _INDEX.read_text()) if _INDEX.exists() else []

EXEMPT: dict[tuple[str, str, str], str] = {
    ("checks.*", "*", "*"): "the validation helpers: they raise on behalf of their caller, naming its parameter",
    ("tensor.Backend.*", "*", "*"): "a backend adapter: its arrays are the backend's own (NumPy's, CuPy's); Tensor "
                                     "checks what it passes",
    ("tensor.register_backend", "device", "not one of the options"): "registering a backend under a new device name "
                                                                      "is what it is for",
    ("tensor.use_backend", "device", "not one of the options"): "registering a backend under a new device name is "
                                                                 "what it is for",
    ("tensor.gather", "storage", "complex array"): "gather copies storage of any dtype, complex included (its test "
                                                   "checks complex64)",
    # -- lessons 02-04 (autograd, nn, optim, data, bench)
    ("nn.fit", "epochs", "zero size"): "0 epochs is a valid request (no training, an empty history), as fit's "
                                       "docstring and its own check (epochs >= 0) say",
    ("bench.benchmark", "warmup", "zero size"): "warmup=0 times the first call too (the lesson's demo of a JIT's "
                                                "compile time; its tests grade it)",
    **{(f"bench.{counter}", "*", "zero size"): "a FLOP, byte, parameter or memory counter: an empty dimension (a "
                                               "0 x n matmul, no layers, no learned positions: n_ctx=0 by default) "
                                               "counts 0, and lesson 04's tests grade size 0"
       for counter in ("matmul_*", "elementwise_*", "softmax_*", "transformer_*", "training_memory_*")},
    # -- lessons 05-08 (cpu_matmul, simd_matmul, simd, cuda_kernels, cuda_trace, cupy_kernels)
    ("cuda_kernels.blocks_for", "n", "zero size"): "n counts elements: 0 elements need 0 blocks (n < 0 is refused)",
    ("cuda_trace.TracedArray", "data", "complex array"): "a tracer records the accesses to any NumPy array; Numba "
                                                         "CUDA kernels take complex arrays too",
    ("cupy_kernels.cuda_time_ms", "warmup", "zero size"): "no warm-up call is a valid choice (warmup < 0 is refused)",
    # Lesson 08's CuPy functions launch kernels: where no GPU runs them no call succeeds, so no test calls them
    # and the walk has no call to replay (their rules refuse bad arguments before CuPy is touched; the machinery
    # test test_given_cupy_kernels checks that on any machine). Where a GPU runs kernels they are walked.
    **({(f"cupy_kernels.{name}", "*", "*"): "launches CuPy kernels, and no CUDA GPU runs them here"
        for name in ("bias_gelu", "gelu_unfused", "l2norm", "sgemm", "softmax", "softmax_unfused", "hgemm",
                     "cuda_time_ms", "enable_cuda", "softmax_v4", "hgemm_pipe", "tune_sgemm")}
       if not __import__("course.gpu", fromlist=["gpu_status"]).gpu_status()[0] else {}),
    # -- lessons 09 and 11 (attention, gpt, kv_cache)
    ("attention.check_size", "value", "*"): "a helper that raises on behalf of its caller: the message names the "
                                            "caller's parameter (its `name` argument) and the value",
    ("attention.check_size", "minimum", "negative"): "any integer is a valid lower bound",
    ("attention.flash_attention_cuda", "*", "*"): "needs a CUDA GPU (CuPy arrays); its rules are the emulated "
                                                  "kernel's (flash_attention_emulated, walked), run by make gpucheck",
    ("attention.attention_cupy_unfused", "*", "*"): "needs a CUDA GPU (CuPy arrays): the GPU demo's baseline",
    ("attention.attention_torch_sdpa", "*", "*"): "needs a CUDA GPU and PyTorch (CuPy arrays): the GPU demo's reference",
    ("gpt.*", "ids", "an id of *"): "a data helper slices the id sequence and knows no vocabulary; the model "
                                    "(Embedding) and evaluate_loss refuse ids outside it",
    ("gpt.*", "warmup", "zero size"): "no warm-up is a valid schedule (the full rate from step 0)",
    ("gpt.*", "max_new_tokens", "zero size"): "generating no token is valid: the prompt comes back",
    ("kv_cache.*generate", "max_new_tokens", "zero size"): "generating no token is valid: an empty result",
    ("gpt.bigram_loss", "alpha", "fraction above 1"): "add-alpha smoothing takes any alpha > 0 (add-one is the classic)",
    ("kv_cache.BigramLM", "alpha", "fraction above 1"): "add-alpha smoothing takes any alpha > 0 (add-one is the classic)",
    ("kv_cache.kv_cache_bytes", "*", "zero size"): "the formula's counts may be 0 (no tokens, no layers: 0 bytes), as its "
                                                "docstring and lesson 11's tests say",
    ("kv_cache.PagedKVCache.add", "seq", "*"): "a new sequence id is any hashable but a bool (None, -1, 2.5, '3' are ids)",
    ("kv_cache.PagedKVCache.fork", "child", "*"): "a new sequence id is any hashable but a bool (None, -1, 2.5, '3' are ids)",
    ("kv_cache.PagedKVCache.*", "n", "zero size"): "0 more tokens is valid: no slot, no block (lesson 11's tests check it)",
    ("kv_cache.*.truncate", "n", "zero size"): "truncating a language model to 0 tokens (forgetting everything) is valid",
    ("kv_cache.speculative_generate", "k", "zero size"): "k = 0 drafts nothing: one target token per call (plain decoding)",
    ("kv_cache.BlockAllocator.*", "block", "zero size"): "a block id, not a size: block 0 is the first block",
    # -- lessons 10, 12, 13 (quant, parallel, comm, model_parallel)
    **({(f"quant.{name}", "*", "*"): "launches a CuPy kernel, and no CUDA GPU runs it here (its rules refuse bad "
                                     "operands before CuPy is touched; the emulated kernel, "
                                     f"{name}_emulated, is walked)"
        for name in ("int8_gemm_dp4a", "int8_gemm_dp4a_regtile")}
       if not __import__("course.gpu", fromlist=["gpu_status"]).gpu_status()[0] else {}),
    **{("comm.*", param, label): "a message may carry any numeric dtype, floats and complex included: both engines "
                                 "move its bytes (test_mpi_engine sends complex128)"
       for param in ("array", "out") for label in ("complex array", "float array where integers")},
    **{(f"parallel.{name}", param, "float array where integers"): "a collective sums any real dtype, integers and "
                                                                   "floats alike (lesson 12's tests run int16 and "
                                                                   "int64 through it)"
       for name, param in (("naive_allreduce", "x"), ("ring_reduce_scatter", "x"), ("ring_allgather", "chunk"),
                           ("ring_allreduce", "x"))},
    ("comm.Request", "out", "*"): "what the request carries (the array an isend sends from, or an irecv receives "
                                  "into), checked by the engine's isend or irecv that makes the request",
    ("comm.Request", "req", "*"): "the engine's own handle (an mpi4py request; True for the simulator)",
    **{(f"comm.Communicator.{m}", "*", "*"): "abstract: each engine implements it (SimComm's and SubComm's are walked, "
                                             "MPIComm's are checked by test_given_comm on MPI)"
       for m in ("send", "recv", "isend", "irecv", "waitall", "launch")},
    ("comm.MPIComm*", "*", "*"): "exists only inside the processes of an MPI run, which the walk does not see: "
                                 "tests/machinery/test_given_comm.py makes the bad calls of the simulator's table "
                                 "on MPI too",
    **{(f"parallel.{name}", "*", "*"): "runs only inside the processes of an MPI run (mpi4py's COMM_WORLD), which "
                                       "the walk does not see: tests/machinery/test_given_parallel.py calls it there"
       for name in ("mpi4py_ring_allreduce", "mpi_best_seconds", "allreduce_timings")},
    ("comm.*.compute", "kind", "not one of the options"): "kind labels a timeline interval: any name a program "
                                                           "chooses (lessons 12 and 16 charge 'F' and 'B')",
    ("comm.RunResult.events", "kind", "not one of the options"): "kind selects intervals by their label, which "
                                                                  "compute(kind=...) chooses freely: none may have it",
    ("comm.Work", "result", "*"): "the launched function's return value: anything it returns",
    ("comm.chunk_bounds", "n", "zero size"): "n counts elements: 0 elements split into empty chunks (n < 0 is refused)",
    **{(name, "alpha", "fraction above 1"): "alpha is the alpha-beta model's latency in seconds per message, not a "
                                            "fraction: any alpha >= 0 (a negative one is refused)"
       for name in ("comm.run", "parallel.collective_cost", "model_parallel.ring_allreduce_time",
                    "model_parallel.ClusterSpec")},
    ("parallel.*", "y", "an id of 10**9"): "a label >= the number of classes is refused by cross_entropy on the rank "
                                           "whose rows hold it (the run then raises it, naming the rank); nothing "
                                           "before the forward pass knows the number of classes (labels < 0 are "
                                           "refused on every rank before anything is sent)",
    **{(f"parallel.ZeroAdam.{m}", "*", "*"): "takes no argument and communicates through self.comm: a call kept "
                                             "from a run cannot be replayed once the run has ended"
       for m in ("reduce_gradients", "step")},
    **{(f"model_parallel.{cls}.forward", "*", "*"): "communicates through self.comm (the layer's ranks): a call kept "
                                                    "from a run cannot be replayed once the run has ended (its x "
                                                    "is checked by the rule, and the ops it calls are walked)"
       for cls in ("RingSelfAttention", "TensorParallelBlock")},
    ("model_parallel.simulate_schedule", "t_*", "float where an integer"): "a time is any real number >= 0: ints and "
                                                                           "Fractions give exact timelines, floats "
                                                                           "are fine",
    **{("model_parallel.ClusterSpec", name, "inf"): "an infinite memory (no limit) or flop rate (instant compute) is a "
                                                    "valid what-if: lesson 13's tests plan with flop_rate=inf"
       for name in ("memory", "flop_rate")},
    ("model_parallel.split_layers", "rank", "zero size"): "rank 0 is the first stage (a rank >= p is refused)",
    # -- lessons 14-16 (compiler; scheduler, engine, api_server, metrics, serving_kit; moe)
    **{(f"compiler.{fn}", param, value): "the generated kernels' scalar math: inf and nan are values it must "
                                         "compute as NumPy does (test_given_compiler checks vexp(nan) is nan, "
                                         "vtanh(-inf) is -1); a non-number is refused by name"
       for fn, params in (("vexp", ("x",)), ("vtanh", ("x",)), ("vrelu", ("x",)), ("vmax", ("a", "b")))
       for param in params for value in ("nan", "inf")},
    ("scheduler.PrefixCache.admit", "seq", "*"): "a new sequence id is any hashable but a bool (None, -1, 2.5, '3' are "
                                              "ids), as lesson 11's PagedKVCache.add takes",
    **{(name, "tokens", "an id of 10**9"): "the prefix cache hashes token ids and knows no vocabulary: the engine "
                                           "refuses ids outside it when a request comes in (add_request); negative "
                                           "ids are refused here"
       for name in ("scheduler.block_hashes", "scheduler.PrefixCache.*")},
    ("scheduler.PrefixCache.evict", "n", "zero size"): "evicting 0 blocks is valid (the engine asks for what it is short "
                                                    "of; lesson 15's tests check evict(0))",
    **{(name, "n", "zero size"): "n = 0 is an empty schedule or workload, as the docstring says (lesson 15's tests "
                                 "check poisson_arrivals(rate, 0))"
       for name in ("metrics.poisson_arrivals", "serving_kit.sample_workload")},
    ("scheduler.SamplingParams", "top_k", "zero size"): "top_k = 0 turns top-k sampling off (vLLM's 0 or -1)",
    **{(f"api_server.{cls}*", "*", "*"): "lives in one asyncio event loop (its futures and mailbox): no copy of a call can "
                                     "be made to replay it; it checks its arguments inline (once per token) and "
                                     "test_serving_given calls it with bad ones"
       for cls in ("TokenStream", "LoopMailbox", "TextStream")},
    **{(name, "*", "*"): "starts (or is the main of) an engine process: a replay would start another; "
                         "test_engine_process checks, by name, the settings it refuses before any process starts"
       for name in ("engine.EngineProcess*", "engine.engine_process_main")},
    **{(f"api_server.{name}", "*", "*"): "serves until Ctrl-C (make serve): test_serve_signals runs it in a process"
       for name in ("serve", "main")},
    ("api_server.RequestLog.record", "*", "*"): "the server calls it for every finished request, whose on_token "
                                            "callback lives in the event loop (no copy to replay), so the walk "
                                            "stops trying before a test's own call; test_serving_given checks its "
                                            "refusals",
    **{(f"serving_kit.ServerThread.{name}", "*", "*"): "starts or stops the server's thread, which runs once: a copy "
                                                      "of the call cannot run it again"
       for name in ("start", "stop")},
    **{(f"moe.{name}", "*", "*"): "runs only inside the processes of an MPI run (mpi4py's COMM_WORLD), which the "
                                  "walk does not see: tests/machinery/test_given_moe.py calls it there"
       for name in ("mpi4py_all_to_all", "alltoall_timings")},
    ("moe.check_int", "*", "*"): "the module's validation helper, named as minitorch.checks' check_int (which "
                                 "validate_public never wraps): it raises on behalf of its caller, naming the caller's "
                                 "parameter and value; its bounds and names are the callers' constants",
    **{(f"moe.{helper}", param, "*"): "a helper that raises on behalf of its caller: the message names the caller's "
                                      "parameter (its `name` argument, or the one it checks) and the value"
       for helper, param in (("check_rows", "x"), ("check_counts", "counts"), ("check_experts", "experts"))},
    ("moe.expert_capacity", "n_tokens", "zero size"): "no tokens need no rows: capacity 0 (n_tokens < 0 is refused)",
    ("moe.update_bias", "load", "float array where integers"): "a load may be a share of the tokens (a float) as well "
                                                               "as a count",
    ("compiler.Autotuner.tune", "key", "*"): "the cache key of a tuning problem: any hashable value (a kernel's "
                                             "source and shape, a str, None); an unhashable one is refused",
}


def exemption(exempt: dict[tuple[str, str, str], str], qualname: str, param: str, label: str) -> str | None:
    """The reason (callable, parameter, bad value) is not tried, or None. Asked with param "*", only
    entries for the whole callable ((name, "*", "*")) answer."""
    for (q, p, lab), reason in exempt.items():
        if not fnmatch.fnmatchcase(qualname, q):
            continue
        if param == "*":
            if p == "*" and lab == "*":
                return reason
        elif fnmatch.fnmatchcase(param, p) and fnmatch.fnmatchcase(label, lab):
            return reason
    return None
