# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.engine: the engine core of lesson 15's inference server (vLLM's LLMEngine /
EngineCore): Engine, a Scheduler (minitorch.scheduler) with a model, a step loop in a background
thread, requests coming in and tokens going out; how a token is drawn (sampling_probs, stop
strings); the engine in its own process (EngineProcess).

Lesson 15's modules, the way vLLM lays them out: minitorch.scheduler (requests, prefix caching,
the scheduling policy), minitorch.engine (this), minitorch.fused_decode (the decode step as one
Numba function), minitorch.api_server (the OpenAI-compatible HTTP API), minitorch.metrics
(Prometheus metrics, latency statistics, the load generator's arrivals and goodput) and
minitorch.serving_kit (uvicorn in a thread or a process, the lecture page, the front door, the
load generator's HTTP client). (Before: minitorch.server and minitorch.server_kit, names that
still import.)"""
from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from minitorch.fused_decode import FusedDecoder
from minitorch.gpt import load_tiny_gpt
from minitorch.kv_cache import GPTWeights, draw, gpt_forward, gpt_weights, paged_forward, sample_token
if globals().get("__spec__") is not None:  # a module (not a notebook, whose own cells define these names)
    from minitorch.scheduler import (FUSED_CHUNK_MAX, MAX_STOP, PLAIN, GenRequest, QueueFull, SamplingParams,
                                     Scheduler, _check_abort, _check_callbacks, _check_engine_options, _check_generation,
                                     _describe,
                                     _is_int, _is_number, _token_logprobs)


class Engine(Scheduler):
    """Continuous batching over a paged KV cache, with chunked prefill and prefix caching: a
    Scheduler (its schedule() picks each step's chunks) with a model, requests coming in, a step
    that runs the plan and samples, and a loop in a background thread.

    W: the model's weights; num_blocks blocks of block_size tokens; at most max_running requests
    in the cache and max_waiting in the queue (more: QueueFull); at most max_num_batched_tokens
    tokens fed per step; prefix_caching on or off, or a class to use for it (PrefixCache's
    interface); step_interval: each step of the background loop lasts at least this many seconds
    (slow motion for a lecture or a test); decode: "fused" runs the step's single-token chunks
    through one compiled function (FusedDecoder, section 10) and the longer chunks through
    paged_forward, "reference" runs everything through lesson 11's paged_forward.

    The model runs on lesson 11's NumPy copy of the weights (W, from gpt_weights), never through
    lesson 09's GPT.forward: no autograd tape to build per token, and one flat layout of arrays
    (dtype chosen, Linear weights (in, out)) that paged_forward and the fused step both read."""

    def __init__(self, W: GPTWeights, num_blocks: int = 64, block_size: int = 8, max_running: int = 32,
                 max_waiting: int = 256, max_num_batched_tokens: int = 48, prefix_caching: Any = True,
                 step_interval: float = 0.0, history: int = 4096, decode: str = "fused"):
        if not isinstance(getattr(W, "params", None), dict) or "wte.weight" not in W.params:
            raise TypeError(f"Engine: W must be the model's GPTWeights (minitorch.kv_cache.gpt_weights), got "
                            f"{type(W).__name__}")
        _check_engine_options("Engine", W.block_size, W.dtype, num_blocks, block_size, max_running, max_waiting,
                             max_num_batched_tokens, prefix_caching, step_interval, history, decode)
        super().__init__(W, num_blocks, block_size, max_running, max_num_batched_tokens, prefix_caching)
        self.decoder = FusedDecoder(W) if decode == "fused" else None
        self.max_waiting = int(max_waiting)
        self.step_interval = float(step_interval)
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: Exception | None = None
        self.steps = 0
        self.records: deque[dict[str, Any]] = deque(maxlen=history)
        self.finished: deque[GenRequest] = deque(maxlen=history)
        self.counters = {"generated_tokens": 0, "prompt_tokens": 0, "prefix_query_tokens": 0,
                         "prefix_hit_tokens": 0, "preemptions": 0, "finished": 0, "stopped": 0, "aborted": 0,
                         "failed": 0, "rejected": 0, "peak_running": 0}
        self._recent: deque[tuple[float, int]] = deque()   # (time, tokens) of recent steps, for tokens/s
        self._in_forward = False                           # a step's model call runs (without the lock)
        self._deferred: list[GenRequest] = []              # requests aborted meanwhile: freed after it

    # ---------------------------------------------------------------- requests in and out
    def add_request(self, prompt: Any, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                    on_token: Callable[[int | None], None] | None = None,
                    sampling: SamplingParams | None = None) -> GenRequest:
        """Queue a request; returns it. ValueError if it can never be served (_check_generation: a
        prompt that is not 1-D ids, max_tokens < 1, prompt + max_tokens past the model's context,
        temperature < 0, a bad seed); QueueFull if max_waiting requests wait; RuntimeError if the
        engine is shutting down. sampling: top_p, top_k, penalties, logprobs (default: none)."""
        ids = _check_generation("Engine.add_request", prompt, max_tokens, temperature, self.W.vocab_size,
                                self.W.block_size, seed, on_token, sampling)
        return self._add("Engine.add_request", ids, 1, max_tokens, temperature, seed, [on_token], sampling)[0]

    def add_parallel(self, prompt: Any, n: int, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                     on_tokens: Sequence[Callable[[int | None], None] | None] | None = None,
                     sampling: SamplingParams | None = None) -> list[GenRequest]:
        """Parallel sampling (OpenAI's n, vLLM's parallel sampling): n requests from one prompt, one
        queued; when its prompt is computed the n - 1 others start on its blocks (cache.fork: shared,
        copied on write), each with its own sampler (seeds seed, seed + 1, ...; None: random ones).
        on_tokens: None or n callbacks, one per request. Until the prompt is computed the group is one
        request: aborting the first aborts them all. Otherwise as add_request."""
        ids = _check_generation("Engine.add_parallel", prompt, max_tokens, temperature, self.W.vocab_size,
                                self.W.block_size, seed, None, sampling, n)
        on_tokens = _check_callbacks("Engine.add_parallel", on_tokens, n)
        return self._add("Engine.add_parallel", ids, n, max_tokens, temperature, seed, on_tokens, sampling)

    def _add(self, where: str, ids: np.ndarray, n: int, max_tokens: int, temperature: float, seed: int | None,
             on_tokens: Sequence[Any], sampling: SamplingParams | None) -> list[GenRequest]:
        with self.lock:
            if self._stopping:
                raise RuntimeError(f"{where}: the engine is shutting down")
            if len(self.waiting) >= self.max_waiting:
                self.counters["rejected"] += 1
                raise QueueFull(len(self.waiting), self.retry_after())
            seed = int(np.random.default_rng().integers(2 ** 31)) if seed is None else int(seed)
            group = [GenRequest(f"cmpl-{next(self._ids)}", ids.astype(np.int64), int(max_tokens), float(temperature),
                                seed + i, on_tokens[i], sampling or PLAIN, owner=self) for i in range(n)]
            for request in group:
                request.rng = np.random.default_rng(request.seed)
                request.plain = request.sampling.plain and request.sampling.logprobs is None
            leader = group[0]
            leader.followers = group[1:]
            for follower in leader.followers:
                follower.leader = leader
            self.waiting.append(leader)
            self._wake.notify_all()
        return group

    def abort(self, request: GenRequest, reason: str = "abort") -> bool:
        """Stop a request at once: its blocks go back to the pool now, or, if a step's model call is
        running over them, as soon as it returns. reason "abort" (the client went away) or "stop"
        (the front end found a stop string: it counts as finished). False if it had already
        finished; ValueError for a request this engine did not accept (another engine's)."""
        _check_abort(self, request, reason)
        with self.lock:
            if request.finished:
                if reason == "stop" and request.finish_reason == "length":
                    self._stopped_late(request)
                return False
            if request in self.waiting:
                self.waiting.remove(request)
            elif request in self.running:
                if self._in_forward:
                    self._deferred.append(request)
                else:
                    self.running.remove(request)
                    self.cache.free(request.id)
            elif request.leader is not None and request in request.leader.followers:
                request.leader.followers.remove(request)          # a follower not started yet
            if reason == "abort":
                self.counters["aborted"] += 1
            self._finish(request, reason)
            for follower in list(request.followers):              # a group not started yet: all of it
                self.abort(follower, reason)
            request.followers = []
            return True

    def retry_after(self) -> float:
        """Seconds after which a rejected client may try again: the waiting queue's work over the
        recent token rate, at least 1."""
        rate = max(self.tokens_per_s(), 1.0)
        work = sum(r.max_tokens * (1 + len(r.followers)) for r in self.waiting) + \
            sum(r.max_tokens - len(r.output) for r in self.running)
        return float(max(1, math.ceil(work / rate)))

    # ---------------------------------------------------------------- one step
    def step(self) -> dict[str, Any]:
        """Schedule, run the model once over the plan, sample, retire. Returns the step's record:
        chunks [(id, n)], decode and prefill ids, preempted and finished ids, tokens fed, blocks
        in use after the step."""
        with self.lock:
            before = {r.id: r.preemptions for r in self.running}
            plan = self.schedule()
            preempted = [r.id for r in self.waiting if r.preemptions > before.get(r.id, r.preemptions)]
            record: dict[str, Any] = {"chunks": [(r.id, n) for r, n in plan], "preempted": preempted,
                                      "decode": [r.id for r, n in plan if n == 1 and r.num_computed == r.num_tokens - 1],
                                      "finished": [], "tokens": sum(n for _, n in plan)}
            record["prefill"] = [r.id for r, _ in plan if r.id not in record["decode"]]
            started = time.perf_counter()
            for request, _ in plan:
                if request.id not in before:                  # admitted in this step
                    self.counters["prefix_query_tokens"] += request.num_tokens
                    self.counters["prefix_hit_tokens"] += request.num_cached
                    self.counters["prompt_tokens"] += request.num_tokens
                    if request.scheduled_at is None:
                        request.scheduled_at = started
            self._in_forward = bool(plan)
        # the model runs without the lock (the fused kernel without the interpreter's lock too), so
        # the HTTP thread can queue and abort requests meanwhile; an abort of a request in the plan
        # is deferred until the call returns (abort), since the call appends to its cache entry
        try:
            logits = self._forward(plan) if plan else None
        finally:
            with self.lock:
                self._in_forward = False
                for request in self._deferred:
                    self.running.remove(request)
                    self.cache.free(request.id)
                self._deferred.clear()
        with self.lock:
            if plan:
                now = time.perf_counter()
                new_tokens, bs = 0, self.cache.block_size
                for (request, n), row in zip(plan, logits):
                    if request.finished:                      # aborted during the model call (or a callback)
                        continue
                    request.num_computed += n
                    if self.prefix is not None and (request.num_computed - n) // bs < request.num_computed // bs:
                        # a block filled up in this step: remember the sequence's full blocks
                        self.prefix.register(request.id, request.tokens[:request.num_computed])
                    if request.num_computed < request.num_tokens:   # a prefill chunk before the last
                        continue
                    group = (request,)
                    if not request.output and (request.followers or request.sampling.prompt_logprobs is not None):
                        if request.sampling.prompt_logprobs is not None:   # echo's: once, with the first token
                            request.prompt_logprobs = self._prompt_logprobs(request)
                        # parallel sampling: the prompt is computed; the group's others start on its blocks
                        group = (request, *self._fork(request))
                    for r in group:
                        if r.plain:                           # temperature alone (most requests): inline
                            token = sample_token(row, r.temperature, r.rng)
                            r.output.append(token)
                            r.token_times.append(now)
                        else:
                            token = self._sample(r, row, now)
                        new_tokens += 1
                        if not self._call(r, token):
                            reason = "error"                  # its callback raised: it ends, no other
                        elif r.finished:                      # its callback aborted it
                            record["finished"].append(r.id)
                            continue
                        elif r.done:
                            reason = "length"
                        else:
                            continue
                        self.running.remove(r)
                        self.cache.free(r.id)
                        self._finish(r, reason)
                        record["finished"].append(r.id)
                self.counters["generated_tokens"] += new_tokens
                self.counters["peak_running"] = max(self.counters["peak_running"], len(plan))
                self._recent.append((now, new_tokens))
            self.steps += 1
            record["blocks_used"] = self.blocks_used()
            self.records.append(record)
            return record

    def _forward(self, plan: list[tuple[GenRequest, int]]) -> np.ndarray:
        """Run the model over the plan's chunks: the logits (len(plan), vocab) of each chunk's last
        token. With the fused decoder, the decodes and the prefill chunks of up to FUSED_CHUNK_MAX
        tokens go through it in one call (FusedDecoder.forward: each new token a row of the kernel)
        and longer chunks through paged_forward, whose matrix products (NumPy's BLAS) are faster
        there; each token depends only on its own sequence's cache, so splitting the step changes
        no number. With decode="reference", everything goes through paged_forward."""
        chunks = [[r.prompt[r.num_computed] if r.num_computed < len(r.prompt)    # a decode: the token to feed
                   else r.output[r.num_computed - len(r.prompt)]] if n == 1
                  else r.tokens[r.num_computed:r.num_computed + n] for r, n in plan]
        if self.decoder is None:
            return paged_forward(self.W, self.cache, [r.id for r, _ in plan], chunks)
        short = [j for j, (_, n) in enumerate(plan) if n <= FUSED_CHUNK_MAX]
        if len(short) == len(plan):
            return self.decoder.forward(self.cache, [r.id for r, _ in plan], chunks)
        long = [j for j, (_, n) in enumerate(plan) if n > FUSED_CHUNK_MAX]
        logits = np.empty((len(plan), self.W.vocab_size), self.W.dtype)
        logits[long] = paged_forward(self.W, self.cache, [plan[j][0].id for j in long], [chunks[j] for j in long])
        if short:
            logits[short] = self.decoder.forward(self.cache, [plan[j][0].id for j in short], [chunks[j] for j in short])
        return logits

    def _sample(self, request: GenRequest, row: np.ndarray, now: float) -> int:
        """The request's next token from its logits row, appended to its output (and its log-probability
        to request.logprobs when asked for). Temperature alone: lesson 11's sample_token; otherwise
        sampling_probs (section 7) and lesson 11's draw, with the request's own generator."""
        sampling = request.sampling
        if sampling.plain:
            token = sample_token(row, request.temperature, request.rng)
        else:
            counts = np.bincount(np.asarray(request.output, dtype=np.int64), minlength=len(row)) \
                if sampling.penalised else None
            p = sampling_probs(row, request.temperature, sampling, counts)
            token = int(np.argmax(p)) if request.temperature == 0 else draw(p, request.rng)
        if sampling.logprobs is not None:
            request.logprobs.append(_token_logprobs(row, token, sampling.logprobs))
        request.output.append(token)
        request.token_times.append(now)
        return token

    def _fork(self, leader: GenRequest) -> list[GenRequest]:
        """Parallel sampling: start the leader's followers on its computed prompt, each sharing all of
        its blocks (cache.fork: one more reference each; the partial last block is copied by the first
        append that writes to it). They run from now on, after the running requests."""
        out = []
        for follower in leader.followers:
            self.cache.fork(leader.id, follower.id)
            follower.num_computed = leader.num_computed
            follower.scheduled_at, follower.prompt_logprobs = leader.scheduled_at, leader.prompt_logprobs
            self.running.append(follower)
            out.append(follower)
        leader.followers = []
        return out

    def _prompt_logprobs(self, request: GenRequest) -> list[Any]:
        """The log-probability of each prompt token given the ones before it, with the k most likely
        alternatives (None for the first token, which nothing predicts): a forward pass over the prompt
        (lesson 11's gpt_forward; vLLM keeps the prefill's logits of every position instead)."""
        logits = gpt_forward(self.W, request.prompt[None])[0]
        k = request.sampling.prompt_logprobs
        return [None] + [_token_logprobs(logits[j - 1], int(request.prompt[j]), k) for j in range(1, len(request.prompt))]

    def _call(self, request: GenRequest, token: int | None) -> bool:
        """request.on_token(token) (the caller's code, in the engine's thread); False if it raised:
        the exception goes to self.error and the callback is dropped, so that the caller ends that
        request (finish_reason "error") and no other."""
        if request.on_token is None:
            return True
        try:
            request.on_token(token)
        except Exception as exc:  # noqa: BLE001 - one client's bug must not end the others' requests
            self.error = exc
            request.on_token = None
            return False
        return True

    def _stopped_late(self, request: GenRequest) -> None:
        """The front end found a stop string in a request this engine had already ended by its length
        (an engine running ahead of its front end reaches max_tokens first): the request ended at its
        stop string, and counts as stopped, as the client is told."""
        request.finish_reason = "stop"
        self.counters["stopped"] += 1

    def _finish(self, request: GenRequest, reason: str) -> None:
        request.finish_reason, request.finished_at = reason, time.perf_counter()
        if reason not in ("abort", "error"):
            self.counters["finished"] += 1
            self.counters["stopped"] += reason == "stop"
        self.counters["failed"] += reason == "error"
        self.finished.append(request)
        self._call(request, None)

    # ---------------------------------------------------------------- state
    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.running)

    def blocks_used(self) -> int:
        """Blocks held by requests (blocks that only the prefix cache holds are not counted)."""
        with self.lock:
            cached_only = self.prefix.num_evictable if self.prefix is not None else 0
            return self.cache.allocator.num_used - cached_only

    def tokens_per_s(self, window: float = 5.0) -> float:
        """Output tokens per second over the last `window` seconds."""
        if not _is_number(window) or not 0 < window < math.inf:
            raise ValueError(f"Engine.tokens_per_s: window must be a finite number of seconds > 0, got {_describe(window)}")
        now = time.perf_counter()
        with self.lock:
            while self._recent and self._recent[0][0] < now - window:
                self._recent.popleft()
            if not self._recent:
                return 0.0
            span = max(now - self._recent[0][0], 1e-3)
            return sum(n for _, n in self._recent) / span

    def stats(self) -> dict[str, Any]:
        """What the page and /metrics show: running, waiting, KV blocks, tokens/s, prefix hits."""
        with self.lock:
            q, h = self.counters["prefix_query_tokens"], self.counters["prefix_hit_tokens"]
            return {"running": len(self.running), "waiting": len(self.waiting), "steps": self.steps,
                    "kv_blocks_used": self.blocks_used(), "kv_blocks_total": self.cache.num_blocks,
                    "kv_blocks_cached": self.prefix.num_cached if self.prefix is not None else 0,
                    "tokens_per_s": self.tokens_per_s(), "prefix_hit_rate": h / q if q else 0.0,
                    **self.counters}

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache and the peak-running counter; the number of blocks dropped."""
        with self.lock:
            dropped = self.prefix.num_cached if self.prefix is not None else 0
            if self.prefix is not None:
                self.prefix.clear()
            self.counters["peak_running"] = 0
            return dropped

    def run_until_idle(self, max_steps: int = 100_000) -> list[dict[str, Any]]:
        """Step (in this thread) until no request waits or runs; the records of those steps."""
        if not _is_int(max_steps) or max_steps < 1:
            raise ValueError(f"Engine.run_until_idle: max_steps must be an integer >= 1, got {_describe(max_steps)}")
        out = []
        while self.has_work():
            out.append(self.step())
            if len(out) > max_steps:
                raise RuntimeError(f"Engine: more than {max_steps} steps")
        return out

    # ---------------------------------------------------------------- the background loop
    def start(self) -> "Engine":
        """Run the step loop in a background thread."""
        with self.lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self.waiting or self.running) and not self._stopping:
                    self._wake.wait(0.5)
                if not (self.waiting or self.running) and self._stopping:
                    return
            t0 = time.perf_counter()
            try:
                self.step()
            except Exception as exc:  # a bug in a step: end every request with an error, keep serving
                self._fail_all(exc)
            # sleep(0) at least: hand the interpreter lock to the HTTP thread between steps, so that
            # tokens go out as they are made rather than when the lock's switch interval expires
            time.sleep(max(0.0, self.step_interval - (time.perf_counter() - t0)))

    def _fail_all(self, exc: Exception) -> None:
        """End every request in the engine with finish_reason "error" (self.error says why)."""
        with self.lock:
            self.error = exc
            for request in list(self.waiting) + list(self.running):
                if request.id in self.cache.tables:
                    self.cache.free(request.id)
                for r in [request] + request.followers:
                    self._finish(r, "error")
                request.followers = []
            self.waiting.clear()
            self.running.clear()

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Stop the loop: with drain, after every accepted request has finished; without, abort
        them first. New requests are refused from now on."""
        if not isinstance(drain, (bool, np.bool_)):
            raise TypeError(f"Engine.stop: drain must be True or False, got {_describe(drain)}")
        if not _is_number(timeout) or not timeout > 0:
            raise ValueError(f"Engine.stop: timeout must be a number of seconds > 0 (inf: no limit), got "
                             f"{_describe(timeout)}")
        with self._wake:
            self._stopping = True
            if not drain:
                for request in list(self.waiting) + list(self.running):
                    self.abort(request)
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(None if math.isinf(timeout) else timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"Engine.stop: the step loop did not finish in {timeout} s")
            self._thread = None


def model_engine(model: Any, dtype: Any, **engine_kw: Any) -> Engine:
    """An Engine over `model`'s weights in `dtype` (engine_kw go to Engine), its fused decode step
    compiled (the first request does not wait for Numba)."""
    engine = Engine(gpt_weights(model, dtype), **engine_kw)
    if engine.decoder is not None:
        engine.decoder.warm_up()
    return engine


def sampling_probs(logits: np.ndarray, temperature: float, params: SamplingParams,
                   counts: np.ndarray | None = None) -> np.ndarray:
    """The distribution (vocab,) float64 the next token is drawn from, after OpenAI's sampling
    parameters, in vLLM's order (logits: (vocab,) of any real dtype, float16 to float64 or integers, not
    changed):
    1. params.logit_bias[t] is added to logit t;
    2. penalties: logit t falls by params.frequency_penalty * counts[t] + params.presence_penalty *
       (counts[t] > 0), counts (vocab,): how often each token is in the output so far (None: none);
    3. temperature 0: all the mass on the largest logit (the lowest id among ties), and no more;
    4. p = softmax(logits / temperature), in float64 (the largest subtracted first);
    5. params.top_k > 0: only the tokens whose p is >= the k-th largest p keep it (ties with it are
       kept), the others 0, renormalised;
    6. params.top_p < 1: the tokens by p, most likely first (the lower id first among ties): keep
       them up to and including the first at which the running sum reaches top_p (>=), and every
       token whose p equals that one's; the others 0; renormalised."""
    if not (logits.__class__ is np.ndarray and logits.ndim == 1 and logits.dtype.kind in "fiu" and len(logits)):
        raise ValueError(f"sampling_probs: logits must be a 1-D array of real numbers (vocab,), got {_describe(logits)} "
                         f"({np.ndim(logits)} axes)")
    if not _is_number(temperature) or not 0 <= temperature < math.inf:
        raise ValueError(f"sampling_probs: temperature must be a finite number >= 0, got {_describe(temperature)}")
    if not hasattr(params, "top_p") or not hasattr(params, "logit_bias"):
        raise TypeError(f"sampling_probs: params must be a SamplingParams, got {_describe(params)}")
    if counts is not None and not (isinstance(counts, np.ndarray) and counts.shape == logits.shape and
                                   counts.dtype.kind in "iu" and (not counts.size or counts.min() >= 0)):
        raise ValueError(f"sampling_probs: counts must be None or integer counts >= 0 of the logits' shape "
                         f"{logits.shape}, got {_describe(counts)} ({np.ndim(counts)} axes)")
    if params.logit_bias and max(params.logit_bias) >= len(logits):
        raise ValueError(f"sampling_probs: params.logit_bias names token {max(params.logit_bias)}, outside the "
                         f"{len(logits)} logits")
    z = np.array(logits, dtype=np.float64)
    if params.logit_bias:
        z[list(params.logit_bias)] += list(params.logit_bias.values())
    if counts is not None:
        c = counts.astype(np.float64)
        z -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    if temperature == 0:
        p = np.zeros_like(z)
        p[np.argmax(z)] = 1.0
        return p
    z = z / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if 0 < params.top_k < len(p):
        kth = np.partition(p, len(p) - params.top_k)[len(p) - params.top_k]
        p = np.where(p >= kth, p, 0.0)
        p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        j = int(np.searchsorted(np.cumsum(p[order]), params.top_p))   # the first where the sum reaches top_p
        if j < len(p):
            p = np.where(p >= p[order[j]], p, 0.0)
            p /= p.sum()
    return p


class StopStrings:
    """OpenAI's stop strings over a text that grows a token at a time. feed(text), the next token's
    text, returns the text that may be sent now: what might be the beginning of a stop string is
    held back until later text settles it. When a stop string appears (the earliest, if several),
    `stopped` becomes True and feed returns the text before it, never the stop string nor anything
    after it; every later feed returns "". flush() returns the text still held back (at the end of
    a request that did not stop). stops: 1 to MAX_STOP non-empty strings."""

    def __init__(self, stops: Sequence[str]):
        if not isinstance(stops, (list, tuple)) or not 1 <= len(stops) <= MAX_STOP or \
                not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"StopStrings: stops must be a list of 1 to {MAX_STOP} non-empty strings, got "
                             f"{_describe(stops)}")
        self.stops, self.held, self.stopped = list(stops), "", False

    def feed(self, text: str) -> str:
        """The text that may be sent now, the new token's text `text` included (see the class)."""
        if not isinstance(text, str):
            raise TypeError(f"StopStrings.feed: text must be a str, got {_describe(text)}")
        if self.stopped:
            return ""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buf[:min(hits)]
        keep = 0                       # the longest end of buf that begins a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The text held back (and no more of it): the end of a request that did not stop."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def engine_process_main(fd: int) -> None:
    """The engine process of EngineProcess (`python -c` runs it, with its end of a socket pair):
    read (dtype, engine_kw), build the Engine, then loop: read the commands that wait, step if
    there is work (each step lasting at least step_interval, reading commands meanwhile), and send
    what the step made. Ends on ("stop", drain) once idle, or when the server's end closes."""
    import signal
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the server decides
    conn = Connection(fd)
    try:
        dtype, engine_kw = conn.recv()
        try:
            engine = model_engine(load_tiny_gpt()[0], np.dtype(dtype), **engine_kw)
        except Exception as exc:  # bad settings: the server raises this in its own process
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            return
        _engine_loop(conn, engine)
    except (EOFError, OSError):                    # the server process is gone
        return


LATE_STOPS = 1024  # requests ended by length remembered, for a front end that finds a stop string after


def _remember_late(ended: dict, key: Any, value: Any) -> None:
    """ended[key] = value, keeping the last LATE_STOPS entries (oldest dropped first)."""
    ended[key] = value
    while len(ended) > LATE_STOPS:
        ended.pop(next(iter(ended)))


def _engine_loop(conn: Any, engine: Engine) -> None:
    requests: dict[int, GenRequest] = {}
    queued: set[int] = set()                       # sent to the engine, not yet admitted
    ended: dict[int, GenRequest] = {}              # the last LATE_STOPS requests ended by length
    out: list[tuple[int, int | None, str | None, Any, Any]] = []
    stopping = False

    def on_token(n: int) -> Callable[[int | None], None]:
        """(n, token, finish reason, the token's logprobs, the prompt's logprobs with the first token)"""
        def push(token: int | None) -> None:
            r = requests[n]
            if token is None:
                out.append((n, None, r.finish_reason, None, None))
            else:
                out.append((n, token, None, r.logprobs[-1] if r.sampling.logprobs is not None else None,
                            r.prompt_logprobs if len(r.output) == 1 else None))
        return push

    def read(wait: float) -> None:
        """Handle the commands that arrive within `wait` seconds (all that wait, at least)."""
        nonlocal stopping
        if not conn.poll(wait):
            return
        while conn.poll(0):
            cmd = conn.recv()
            if cmd[0] == "add":
                numbers, prompt, max_tokens, temperature, seed, sampling = cmd[1:]
                group = engine.add_parallel(prompt, len(numbers), max_tokens, temperature, seed,
                                            [on_token(n) for n in numbers], sampling)
                requests.update(zip(numbers, group))
                queued.add(numbers[0])
            elif cmd[0] == "abort" and cmd[1] in requests:
                engine.abort(requests[cmd[1]], cmd[2])
            elif cmd[0] == "abort" and cmd[1] in ended:       # stopped by the front end after its length
                engine.abort(ended.pop(cmd[1]), cmd[2])
            elif cmd[0] == "reset":
                conn.send(("reply", "reset", engine.reset_prefix_cache()))
            elif cmd[0] == "stop":
                stopping = True
                if not cmd[1]:
                    for request in list(engine.waiting) + list(engine.running):
                        engine.abort(request)

    conn.send(("ready", {"block_size": engine.W.block_size, "vocab_size": engine.W.vocab_size}, engine.stats()))
    next_stats = 0.0
    while True:
        read(0.0 if engine.has_work() else 0.2)
        admitted: list[int] = []
        if engine.has_work():
            t0 = time.perf_counter()
            try:
                engine.step()
            except Exception as exc:  # a bug in a step: end its requests with an error, keep serving
                engine._fail_all(exc)
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            waiting = {id(r) for r in engine.waiting}
            admitted = [n for n in queued if id(requests[n]) not in waiting]
            queued.difference_update(admitted)
            while (left := t0 + engine.step_interval - time.perf_counter()) > 0:  # slow motion: read meanwhile
                read(left)
        for n, token, *_ in out:
            if token is None:
                request = requests.pop(n, None)
                queued.discard(n)
                if request is not None and request.finish_reason == "length":
                    _remember_late(ended, n, request)      # the front end may still find a stop string
        now = time.perf_counter()
        if out or admitted or now >= next_stats:
            conn.send(("step", out, admitted, engine.stats()))
            out, next_stats = [], now + 0.1
        if stopping and not engine.has_work():
            conn.send(("stopped", engine.stats()))
            return


class EngineProcess:
    """The engine in a process of its own (vLLM's engine core), behind the interface make_app uses.

    dtype and engine_kw: the Engine's (lesson 09's tiny GPT); max_waiting: requests sent to the
    engine and not yet admitted before add_request raises QueueFull (checked here: the engine's
    own queue is unbounded). The child starts at once; start() is a no-op (make_app calls it),
    stop(drain) ends it. W: block_size and vocab_size of the model. error: the last step's
    failure (its requests end with finish_reason "error"; the engine keeps serving, as Engine
    does) or the engine process's death (then `alive` is False and requests are refused)."""

    def __init__(self, dtype: Any = np.float32, max_waiting: int = 256, start_timeout: float = 300.0,
                 **engine_kw: Any):
        import os
        import socket
        import subprocess
        import sys
        import types
        from multiprocessing.connection import Connection

        import inspect

        from minitorch.gpt import tiny_gpt_meta

        try:  # the engine's settings are checked here, before a process starts: names, types, ranges
            settings = inspect.signature(Engine).bind(None, max_waiting=max_waiting, **engine_kw)
        except TypeError as exc:
            raise TypeError(f"EngineProcess: {exc} (the settings are Engine's)") from None
        settings.apply_defaults()
        _check_engine_options("EngineProcess", tiny_gpt_meta()["config"]["block_size"], dtype,
                             **{k: v for k, v in settings.arguments.items() if k != "W"})
        if not 0 < start_timeout < math.inf:
            raise ValueError(f"EngineProcess: start_timeout must be a finite number of seconds > 0, got {start_timeout!r}")
        # a fresh interpreter (not fork: this process has threads; not multiprocessing's spawn, which
        # would run a script's main module again), a socket pair, multiprocessing's message framing
        ours, theirs = socket.socketpair()
        ours.set_inheritable(False)                # a fork of this process must not keep the engine alive
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from minitorch.engine import engine_process_main; engine_process_main({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        try:
            self.conn.send((np.dtype(dtype).str, {**engine_kw, "max_waiting": 2**62}))
            if not self.conn.poll(start_timeout):
                raise RuntimeError(f"EngineProcess: the engine process did not start in {start_timeout} s")
            try:
                kind, info, *first_stats = self.conn.recv()
            except EOFError:
                raise RuntimeError(f"EngineProcess: the engine process exited (code {self.process.wait()})") from None
            if kind == "failed":
                raise ValueError(f"EngineProcess: {info}")
        except BaseException:  # a failed start (or Ctrl-C meanwhile) leaves no process and no socket behind
            self.process.kill()
            self.process.wait()
            self.conn.close()
            raise
        self.W = types.SimpleNamespace(**info)
        self.max_waiting, self.decoder = int(max_waiting), None
        self.lock = threading.RLock()
        self.finished: deque[GenRequest] = deque(maxlen=4096)
        self.error: Exception | None = None
        self._requests: dict[int, GenRequest] = {}     # in flight, by number
        self._numbers: dict[GenRequest, int] = {}
        self._ended: dict[GenRequest, int] = {}   # the last LATE_STOPS requests ended by length: their numbers
        self._queued: set[int] = set()                 # sent, not yet admitted by the engine
        self._stats: dict[str, Any] = first_stats[0]    # the engine's stats(), as of its last message
        self._rejected, self._ids, self._stopping, self._dead = 0, itertools.count(), False, False
        # _send_lock orders the messages, and makes add_request's check and send one step against
        # stop's; it is taken before self.lock, never inside it. The reader takes only self.lock.
        self._send_lock, self._replies = threading.RLock(), {}
        self._replied = threading.Condition(self.lock)
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def __copy__(self) -> "EngineProcess":
        return self

    def __deepcopy__(self, memo: dict) -> "EngineProcess":
        """The handle of one running process and its socket: a copy is the same engine (a copied
        socket would close the engine's when it is collected)."""
        return self

    def _send(self, message: tuple) -> None:
        """One message to the engine (callers hold _send_lock, or take it here)."""
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):              # the engine process is gone: the reader says so
                pass

    def start(self) -> "EngineProcess":
        return self

    @property
    def alive(self) -> bool:
        """Whether the engine process runs and takes requests (/health answers 503 once not)."""
        return not self._dead and not self._stopping and self.process.poll() is None

    def add_request(self, prompt: Any, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                    on_token: Callable[[int | None], None] | None = None,
                    sampling: SamplingParams | None = None) -> GenRequest:
        """As Engine.add_request: ValueError for a request that can never be served, QueueFull past
        max_waiting, RuntimeError once stopping or if the engine process has died."""
        ids = _check_generation("EngineProcess.add_request", prompt, max_tokens, temperature,
                                self.W.vocab_size, self.W.block_size, seed, on_token, sampling)
        return self._add("EngineProcess.add_request", ids, 1, max_tokens, temperature, seed, [on_token], sampling)[0]

    def add_parallel(self, prompt: Any, n: int, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                     on_tokens: Sequence[Callable[[int | None], None] | None] | None = None,
                     sampling: SamplingParams | None = None) -> list[GenRequest]:
        """As Engine.add_parallel: n samples of one prompt, its blocks shared in the engine process."""
        ids = _check_generation("EngineProcess.add_parallel", prompt, max_tokens, temperature,
                                self.W.vocab_size, self.W.block_size, seed, None, sampling, n)
        on_tokens = _check_callbacks("EngineProcess.add_parallel", on_tokens, n)
        return self._add("EngineProcess.add_parallel", ids, n, max_tokens, temperature, seed, on_tokens, sampling)

    def _add(self, where: str, ids: np.ndarray, n: int, max_tokens: int, temperature: float, seed: int | None,
             on_tokens: Sequence[Any], sampling: SamplingParams | None) -> list[GenRequest]:
        with self._send_lock:
            with self.lock:
                if self._stopping or self._dead:
                    raise RuntimeError(f"{where}: the engine is shutting down" if self._stopping
                                       else f"{where}: the engine process failed: {self.error}")
                if len(self._queued) >= self.max_waiting:
                    self._rejected += 1
                    raise QueueFull(len(self._queued), self.retry_after())
                seed = int(np.random.default_rng().integers(2 ** 31)) if seed is None else int(seed)
                numbers = [next(self._ids) for _ in range(n)]
                group = [GenRequest(f"cmpl-{k}", ids.astype(np.int64), int(max_tokens), float(temperature), seed + i,
                                    on_tokens[i], sampling or PLAIN, owner=self) for i, k in enumerate(numbers)]
                for k, request in zip(numbers, group):
                    self._requests[k], self._numbers[request] = request, k
                group[0].followers = group[1:]
                for follower in group[1:]:
                    follower.leader = group[0]
                self._queued.add(numbers[0])
            # sent without self.lock (a full socket must not stop the reader, which needs it), but
            # under _send_lock: stop cannot slip its message in between the check and this one
            self._send(("add", numbers, group[0].prompt, group[0].max_tokens, group[0].temperature, seed,
                        sampling or PLAIN))
        return group

    def abort(self, request: GenRequest, reason: str = "abort") -> bool:
        """End a request now (its blocks are freed by the engine before its next step); reason as
        Engine.abort's; aborting a group's first request before its first token aborts the group.
        False if it had already finished; ValueError for a request this engine did not accept."""
        _check_abort(self, request, reason)
        with self.lock:
            if request.finished:
                n = self._ended.pop(request, None)
                if reason == "stop" and request.finish_reason == "length":
                    request.finish_reason = "stop"     # the engine counts it when it hears (Engine._stopped_late)
                    if n is not None:
                        self._send(("abort", n, "stop"))
                return False
            group = [request] + ([f for f in request.followers if not f.finished] if not request.output else [])
            numbers = [self._numbers.get(r) for r in group]
            for r in group:
                self._finish(r, reason)
        for n in numbers:
            if n is not None:
                self._send(("abort", n, reason))
        return True

    def _finish(self, request: GenRequest, reason: str) -> None:
        n = self._numbers.pop(request, None)
        if reason == "length" and n is not None:
            _remember_late(self._ended, request, n)
        self._requests.pop(n, None)
        self._queued.discard(n)
        request.finish_reason, request.finished_at = reason, time.perf_counter()
        self.finished.append(request)
        self._call(request, None)

    def _call(self, request: GenRequest, token: int | None) -> None:
        """request.on_token(token); a callback that raises ends its own request ("error"), no other."""
        if request.on_token is None:
            return
        try:
            request.on_token(token)
        except Exception as exc:  # noqa: BLE001 - the caller's code: keep serving the others
            self.error = exc
            if token is not None and not request.finished:
                request.on_token = None
                self._finish(request, "error")

    def _read(self) -> None:
        """The reader thread: the engine's messages, until it stops or dies; then nothing is left
        unfinished (a request that raced with stop ends with "abort", one the engine died with, "error")."""
        reason = "error"
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    break
                kind, now = message[0], time.perf_counter()
                with self.lock:
                    if kind == "step":
                        items, admitted, self._stats = message[1:]
                        self._queued.difference_update(admitted)
                        for n in admitted:                       # a group's first request: the group ran
                            leader = self._requests.get(n)
                            for r in [leader, *leader.followers] if leader is not None else []:
                                r.scheduled_at = r.scheduled_at or now
                        for n, token, finish_reason, logprob, prompt_logprobs in items:
                            request = self._requests.get(n)
                            if request is None:                  # aborted here already
                                continue
                            if token is None:
                                self._finish(request, finish_reason)
                            else:
                                if prompt_logprobs is not None:
                                    request.prompt_logprobs = prompt_logprobs
                                if logprob is not None:
                                    request.logprobs.append(logprob)
                                request.output.append(token)
                                request.token_times.append(now)
                                self._call(request, token)
                    elif kind == "error":
                        self.error = RuntimeError(message[1])
                    elif kind == "reply":
                        self._replies[message[1]] = message[2]
                        self._replied.notify_all()
                    elif kind == "stopped":
                        self._stats, reason = message[1], "abort"
                        break
        except Exception as exc:  # noqa: BLE001 - a broken message: the engine cannot be trusted any more
            self.error = exc
            self.process.kill()
        with self.lock:
            self._dead = True
            if self.error is None and reason == "error":
                self.error = RuntimeError(f"the engine process exited (code {self.process.poll()})")
            for request in list(self._requests.values()):
                self._finish(request, reason)
            self._replied.notify_all()

    def retry_after(self) -> float:
        """Seconds after which a rejected client may try again: the work in flight over the recent
        token rate, at least 1."""
        with self.lock:
            rate = max(float(self._stats.get("tokens_per_s", 0.0)), 1.0)
            work = sum(r.max_tokens - len(r.output) for r in self._requests.values())
        return float(max(1, math.ceil(work / rate)))

    def stats(self) -> dict[str, Any]:
        """The engine's stats() as of its last message (sent after every step that made tokens or
        admitted requests, and every 0.1 s besides; a long step delays it), and the 429s counted here."""
        with self.lock:
            return {**self._stats, "rejected": self._rejected}

    def reset_prefix_cache(self, timeout: float = 30.0) -> int:
        """As Engine.reset_prefix_cache, answered by the engine process; RuntimeError without an answer."""
        with self.lock:
            self._replies.pop("reset", None)
        self._send(("reset",))
        with self.lock:
            self._replied.wait_for(lambda: "reset" in self._replies or self._dead, timeout)
            if "reset" not in self._replies:
                raise RuntimeError(f"EngineProcess.reset_prefix_cache: no answer from the engine process in "
                                   f"{timeout} s" + (" (it has stopped)" if self._dead else ""))
            return int(self._replies.pop("reset"))

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Refuse new requests, then end the engine process: after every accepted request has
        finished (drain), or at once, aborting them. Safe to call twice, and from two threads (a
        second Ctrl-C during a drain). RuntimeError if it did not end in time."""
        import subprocess

        if not isinstance(drain, (bool, np.bool_)):
            raise TypeError(f"EngineProcess.stop: drain must be True or False, got {_describe(drain)}")
        if not _is_number(timeout) or not timeout > 0:
            raise ValueError(f"EngineProcess.stop: timeout must be a number of seconds > 0 (inf: no limit), got "
                             f"{_describe(timeout)}")
        with self._send_lock:
            with self.lock:
                self._stopping = True
            self._send(("stop", drain))
        self._reader.join(None if math.isinf(timeout) else timeout)
        try:
            self.process.wait(5.0 if not self._reader.is_alive() else 0.1)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            if drain:
                raise RuntimeError(f"EngineProcess.stop: the engine did not finish in {timeout} s") from None
        finally:
            self._reader.join(5.0)
            with self._send_lock:
                self.conn.close()


from minitorch.checks import Attrs, FloatDType, Int, Number, Positive, Unchecked, validate_public  # noqa: E402

_OWN = Unchecked()          # checked in the body (once per token or per step: a fast path of its own)
validate_public(globals(), {
    "Engine": {"W": _OWN, "prefix_caching": _OWN},    # _check_engine_options: by name, before anything is built
    "Engine.add_request": {"sampling": _OWN},        # _check_generation: by its fields (a notebook's class too)
    "Engine.add_parallel": {"sampling": _OWN},
    "Engine.abort": {"request": _OWN, "reason": _OWN},   # another engine's request: its own message
    "Engine.tokens_per_s": {"window": Positive},
    "Engine.stop": {"timeout": Number(0, lo_open=True, finite=False)},
    "model_engine": {"model": Attrs("state_dict", "config"), "dtype": FloatDType(np.float32, np.float64)},
    "sampling_probs": {"logits": _OWN, "params": _OWN, "counts": _OWN},   # checked in the body, by duck type
    "engine_process_main": {"fd": Int(0)},
    "EngineProcess": {"dtype": FloatDType(np.float32, np.float64), "start_timeout": Positive},
    "EngineProcess.add_request": {"sampling": _OWN},
    "EngineProcess.add_parallel": {"sampling": _OWN},
    "EngineProcess.abort": {"request": _OWN, "reason": _OWN},
    "EngineProcess.reset_prefix_cache": {"timeout": Positive},
    "EngineProcess.stop": {"timeout": Number(0, lo_open=True, finite=False)},
})
