# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.server: an inference server for lesson 09's tiny GPT: an engine with a step loop
(admission, chunked prefill, decode, preemption, retirement, prefix caching) over lesson 11's
paged KV cache, an OpenAI-compatible HTTP API with streaming and Prometheus metrics, and the
pieces of a load generator (arrivals, latency statistics, goodput)."""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request  # FastAPI reads the handlers' annotations from the module's names

from minitorch.gpt import CharTokenizer, load_tiny_gpt
from minitorch.serve import GPTWeights, PagedKVCache, gpt_weights, paged_forward, sample_token
from minitorch.server_kit import FusedDecoder


FUSED_CHUNK_MAX = 32   # longer prefill chunks go through paged_forward (BLAS), shorter ones the fused step


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its bound: the caller should retry later (HTTP 429)."""

    def __init__(self, waiting: int, retry_after: float):
        super().__init__(f"the server is busy: {waiting} requests are waiting; retry in {retry_after:.0f} s")
        self.retry_after = retry_after


def check_generation(where: str, prompt: Any, max_tokens: Any, temperature: Any, vocab_size: int,
                     context: int) -> np.ndarray:
    """The prompt as a 1-D array of token ids, after checking a request the engine could never
    serve: ValueError naming the value and the bound (no ids, ids outside [0, vocab_size),
    max_tokens not an integer >= 1, prompt + max_tokens past the context, temperature < 0)."""
    prompt = np.asarray(prompt).reshape(-1)
    if len(prompt) < 1 or prompt.dtype.kind not in "iu" or prompt.min() < 0 or prompt.max() >= vocab_size:
        raise ValueError(f"{where}: the prompt must be >= 1 token ids in [0, {vocab_size}), "
                         f"got {len(prompt)} of dtype {prompt.dtype}")
    if isinstance(max_tokens, bool) or int(max_tokens) != max_tokens or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    if len(prompt) + max_tokens > context:
        raise ValueError(f"{where}: {len(prompt)} prompt tokens + {max_tokens} new tokens pass the "
                         f"model's context of {context} tokens")
    if not temperature >= 0:
        raise ValueError(f"{where}: temperature must be >= 0, got {temperature}")
    return prompt


@dataclass(eq=False)
class GenRequest:
    """One generation request inside the engine. prompt: (P,) int64 token ids; max_tokens >= 1;
    temperature >= 0 (0: greedy); seed for its own sampler. output: the tokens generated;
    num_computed: tokens whose K/V are in the cache; token_times: perf_counter() at each output
    token; arrival: perf_counter() when the engine accepted it."""

    id: str
    prompt: np.ndarray
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    on_token: Callable[[int | None], None] | None = None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.prompt = np.asarray(self.prompt, dtype=np.int64).reshape(-1)
        self.rng = np.random.default_rng(self.seed)

    @property
    def tokens(self) -> np.ndarray:
        """Prompt and output so far, (P + len(output),) int64."""
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int64)])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """The chained hashes of the full blocks of `tokens` (1-D ids): len(tokens) // block_size ints,
    h_0 = hash((0, block 0 as a tuple of ints)), h_i = hash((h_{i-1}, block i as a tuple of ints))."""
    ids = [int(t) for t in np.asarray(tokens).reshape(-1)]
    out, prev = [], 0
    for i in range(len(ids) // block_size):
        prev = hash((prev, tuple(ids[i * block_size:(i + 1) * block_size])))
        out.append(prev)
    return out


class PrefixCache:
    """Full KV blocks of a PagedKVCache, found by the chained hash of the tokens they hold.

    blocks: an OrderedDict hash -> block id, least recently used first; the cache holds one
    reference (allocator.share) to each block in it."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.blocks: OrderedDict[int, int] = OrderedDict()

    @property
    def num_cached(self) -> int:
        """Blocks the prefix cache remembers."""
        return len(self.blocks)

    @property
    def num_evictable(self) -> int:
        """Blocks that only the prefix cache holds (reference count 1)."""
        return sum(self.cache.allocator.refcount(b) == 1 for b in self.blocks.values())

    def match(self, tokens: np.ndarray) -> list[int]:
        """The blocks of the longest chain of cached full blocks at the start of `tokens`, at most
        (len(tokens) - 1) // block_size of them. No side effects."""
        out = []
        for h in block_hashes(tokens, self.cache.block_size)[:(len(tokens) - 1) // self.cache.block_size]:
            if h not in self.blocks:
                break
            out.append(self.blocks[h])
        return out

    def admit(self, seq: Any, tokens: np.ndarray) -> int:
        """Add sequence `seq` to the paged cache holding the longest cached prefix of `tokens`
        (1-D ids): its table is those blocks (each shared: one more reference), its length their
        tokens; they become the most recently used. Returns that length (a multiple of
        block_size, at most len(tokens) - 1)."""
        hashes = block_hashes(tokens, self.cache.block_size)[:(len(tokens) - 1) // self.cache.block_size]
        table = []
        for h in hashes:
            if h not in self.blocks:
                break
            block = self.blocks[h]
            self.cache.allocator.share(block)
            self.blocks.move_to_end(h)
            table.append(block)
        self.cache.add(seq)
        self.cache.tables[seq] = table
        self.cache.lengths[seq] = len(table) * self.cache.block_size
        return self.cache.lengths[seq]

    def register(self, seq: Any, tokens: np.ndarray) -> int:
        """Remember the full blocks of sequence `seq`, whose cached tokens are `tokens` (1-D, the
        sequence's cache.lengths[seq] tokens): block i of its table under the chained hash of
        blocks 0..i, unless that hash is cached already; take one reference to each block added.
        Returns the number of blocks added."""
        table = self.cache.tables[seq]
        added = 0
        for i, h in enumerate(block_hashes(tokens, self.cache.block_size)):
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            self.cache.allocator.share(table[i])
            self.blocks[h] = table[i]
            added += 1
        return added

    def evict(self, n: int) -> int:
        """Free up to n blocks that only the prefix cache holds (reference count 1), least
        recently used first, and forget them. Returns the number freed."""
        freed = 0
        for h, block in list(self.blocks.items()):
            if freed >= n:
                break
            if self.cache.allocator.refcount(block) == 1:
                del self.blocks[h]
                self.cache.allocator.release(block)
                freed += 1
        return freed

    def clear(self) -> None:
        """Drop every cached block (release the cache's references)."""
        for block in self.blocks.values():
            self.cache.allocator.release(block)
        self.blocks.clear()


class Engine:
    """Continuous batching over a paged KV cache, with chunked prefill and prefix caching.

    W: the model's weights; num_blocks blocks of block_size tokens; at most max_running requests
    in the cache and max_waiting in the queue (more: QueueFull); at most max_num_batched_tokens
    tokens fed per step; prefix_caching on or off, or a class to use for it (PrefixCache's
    interface); step_interval: each step of the background loop lasts at least this many seconds
    (slow motion for a lecture or a test); decode: "fused" runs the step's single-token chunks
    through one compiled function (FusedDecoder, section 9) and the longer chunks through
    paged_forward, "reference" runs everything through lesson 11's paged_forward."""

    def __init__(self, W: GPTWeights, num_blocks: int = 64, block_size: int = 8, max_running: int = 32,
                 max_waiting: int = 256, max_num_batched_tokens: int = 48, prefix_caching: Any = True,
                 step_interval: float = 0.0, history: int = 4096, decode: str = "fused"):
        if num_blocks * block_size < W.block_size:
            raise ValueError(f"Engine: {num_blocks} blocks of {block_size} tokens cannot hold one request of the "
                             f"model's context ({W.block_size} tokens)")
        for name, value in (("max_running", max_running), ("max_waiting", max_waiting),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if int(value) < 1:
                raise ValueError(f"Engine: {name} must be >= 1, got {value}")
        if decode not in ("fused", "reference"):
            raise ValueError(f"Engine: decode must be 'fused' or 'reference', got {decode!r}")
        self.W = W
        self.decoder = FusedDecoder(W) if decode == "fused" else None
        self.cache = PagedKVCache.for_model(W, block_size, num_blocks)
        kind = PrefixCache if prefix_caching is True else prefix_caching
        self.prefix = kind(self.cache) if kind else None
        self.max_running, self.max_waiting = int(max_running), int(max_waiting)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.step_interval = float(step_interval)
        self.waiting: deque[GenRequest] = deque()
        self.running: list[GenRequest] = []
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
                         "prefix_hit_tokens": 0, "preemptions": 0, "finished": 0, "aborted": 0, "rejected": 0,
                         "peak_running": 0}
        self._recent: deque[tuple[float, int]] = deque()   # (time, tokens) of recent steps, for tokens/s
        self._in_forward = False                           # a step's model call runs (without the lock)
        self._deferred: list[GenRequest] = []              # requests aborted meanwhile: freed after it

    # ---------------------------------------------------------------- requests in and out
    def add_request(self, prompt: Any, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                    on_token: Callable[[int | None], None] | None = None) -> GenRequest:
        """Queue a request; returns it. ValueError if it can never be served (bad ids, max_tokens <
        1, prompt + max_tokens past the model's context, temperature < 0); QueueFull if max_waiting
        requests wait; RuntimeError if the engine is shutting down."""
        prompt = check_generation("Engine.add_request", prompt, max_tokens, temperature, self.W.vocab_size,
                                  self.W.block_size)
        with self.lock:
            if self._stopping:
                raise RuntimeError("Engine.add_request: the engine is shutting down")
            if len(self.waiting) >= self.max_waiting:
                self.counters["rejected"] += 1
                raise QueueFull(len(self.waiting), self.retry_after())
            seed = int(np.random.default_rng().integers(2 ** 31)) if seed is None else int(seed)
            request = GenRequest(f"cmpl-{next(self._ids)}", prompt.astype(np.int64), int(max_tokens),
                                 float(temperature), seed, on_token)
            self.waiting.append(request)
            self._wake.notify_all()
        return request

    def abort(self, request: GenRequest) -> bool:
        """Stop a request at once (a client went away): its blocks go back to the pool now, or,
        if a step's model call is running over them, as soon as it returns. False if it had
        already finished."""
        with self.lock:
            if request.finished:
                return False
            if request in self.waiting:
                self.waiting.remove(request)
            elif request in self.running:
                if self._in_forward:
                    self._deferred.append(request)
                else:
                    self.running.remove(request)
                    self.cache.free(request.id)
            self.counters["aborted"] += 1
            self._finish(request, "abort")
            return True

    def retry_after(self) -> float:
        """Seconds after which a rejected client may try again: the waiting queue's work over the
        recent token rate, at least 1."""
        rate = max(self.tokens_per_s(), 1.0)
        work = sum(r.max_tokens for r in self.waiting) + sum(r.max_tokens - len(r.output) for r in self.running)
        return float(max(1, math.ceil(work / rate)))

    # ---------------------------------------------------------------- scheduling
    def _fits(self, need: int, promised: int) -> bool:
        """Whether `need` more blocks fit beside `promised` ones, evicting from the prefix cache."""
        short = promised + need - self.cache.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return promised + need <= self.cache.num_free

    def _preempt(self, request: GenRequest) -> None:
        """Free a running request's blocks and put it back at the head of the queue."""
        self.running.remove(request)
        self.cache.free(request.id)
        request.num_computed = 0
        request.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(request)

    def _admit(self, request: GenRequest) -> None:
        """Put a waiting request in the cache: num_computed becomes its cached prefix (0 without
        prefix caching)."""
        if self.prefix is not None:
            request.num_computed = self.prefix.admit(request.id, request.tokens)
        else:
            self.cache.add(request.id)
            request.num_computed = 0
        request.num_cached = request.num_computed

    def _unadmit(self, request: GenRequest) -> None:
        """Undo _admit (the request stays at the head of the queue)."""
        self.cache.free(request.id)
        request.num_computed = 0

    def schedule(self) -> list[tuple[GenRequest, int]]:
        """Plan one step: [(request, n tokens to feed)], running requests first, then admissions;
        moves preempted requests to self.waiting and admitted ones to self.running (in order).
        Every planned chunk fits the budget and the free blocks."""
        plan: list[tuple[GenRequest, int]] = []
        budget, promised, preempted = self.max_num_batched_tokens, 0, False
        for request in list(self.running):
            if budget == 0 or request not in self.running:   # out of budget, or preempted below
                break
            n = min(request.num_tokens - request.num_computed, budget)
            need = self.cache.blocks_needed(request.id, n)
            while not self._fits(need, promised):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request not in self.running:
                break
            plan.append((request, n))
            budget -= n
            promised += need
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            self._admit(request)
            n = min(request.num_tokens - request.num_computed, budget)
            need = self.cache.blocks_needed(request.id, n)
            if not self._fits(need, promised):
                self._unadmit(request)
                break
            self.waiting.popleft()
            self.running.append(request)
            plan.append((request, n))
            budget -= n
            promised += need
        return plan

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
            for request, _ in plan:
                if request.id not in before:                  # admitted in this step
                    self.counters["prefix_query_tokens"] += request.num_tokens
                    self.counters["prefix_hit_tokens"] += request.num_cached
                    self.counters["prompt_tokens"] += request.num_tokens
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
                    if request.finished:                      # aborted during the model call
                        continue
                    request.num_computed += n
                    if request.num_computed == request.num_tokens:
                        token = sample_token(row, request.temperature, request.rng)
                        request.output.append(token)
                        request.token_times.append(now)
                        new_tokens += 1
                        if request.on_token is not None:
                            request.on_token(token)
                    if self.prefix is not None and (request.num_computed - n) // bs < request.num_computed // bs:
                        # a block filled up in this step: remember the sequence's full blocks
                        self.prefix.register(request.id, request.tokens[:request.num_computed])
                    if request.done:
                        self.running.remove(request)
                        self.cache.free(request.id)
                        self._finish(request, "length")
                        record["finished"].append(request.id)
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

    def _finish(self, request: GenRequest, reason: str) -> None:
        request.finish_reason = reason
        if reason != "abort":
            self.counters["finished"] += 1
        self.finished.append(request)
        if request.on_token is not None:
            request.on_token(None)

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
                self._finish(request, "error")
            self.waiting.clear()
            self.running.clear()

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Stop the loop: with drain, after every accepted request has finished; without, abort
        them first. New requests are refused from now on."""
        with self._wake:
            self._stopping = True
            if not drain:
                for request in list(self.waiting) + list(self.running):
                    self.abort(request)
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"Engine.stop: the step loop did not finish in {timeout} s")
            self._thread = None


class APIError(Exception):
    """An error answered as OpenAI's JSON error object with HTTP `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; APIError 400 for non-UTF-8 bytes, malformed JSON or a
    body that is not an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


@dataclass
class CompletionParams:
    """A validated request: prompt ids, max_tokens, temperature, seed, stream, chat or not."""

    prompt: np.ndarray
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    chat: bool


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The tiny GPT has no chat template: the messages' contents joined by blank lines, and one
    after the last (the model continues from there)."""
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def check_request(body: dict[str, Any], chat: bool, model_name: str, tokenizer: CharTokenizer,
                  context: int) -> CompletionParams:
    """Validate a completions (chat=False) or chat completions body; APIError (4xx) naming the
    field and the value otherwise."""
    def field_(name: str, kind: Any, default: Any = None, required: bool = False) -> Any:
        if name not in body or body[name] is None:
            if required:
                raise APIError(400, f"missing required field '{name}'", param=name)
            return default
        value = body[name]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise APIError(400, f"'{name}' must be of type {names}, got {json.dumps(value)[:50]}", param=name)
        return value

    model = field_("model", str, required=True)
    if model != model_name:
        raise APIError(404, f"the model '{model[:80]}' does not exist; this server serves '{model_name}'",
                       type="invalid_request_error", param="model", code="model_not_found")
    if chat:
        messages = field_("messages", list, required=True)
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                   and m.get("role") in ("system", "user", "assistant") for m in messages):
            raise APIError(400, "'messages' must be a non-empty list of {role: system|user|assistant, content: string}",
                           param="messages")
        text = chat_prompt(messages)
    else:
        text = field_("prompt", str, required=True)
    if not text:
        raise APIError(400, "the prompt is empty", param="prompt")
    max_tokens = field_("max_tokens", int, 16)
    if max_tokens < 1:
        raise APIError(400, f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
    temperature = field_("temperature", (int, float), 1.0)
    if not 0 <= temperature <= 2 or not math.isfinite(temperature):
        raise APIError(400, f"'temperature' must lie in [0, 2], got {temperature}", param="temperature")
    seed = field_("seed", int)
    stream = field_("stream", bool, False)
    if field_("n", int, 1) != 1:
        raise APIError(400, "only n = 1 is supported", param="n")
    try:
        ids = tokenizer.encode(text)
    except ValueError as exc:
        raise APIError(400, f"the prompt cannot be tokenized: {exc}", param="messages" if chat else "prompt") from None
    if len(ids) + max_tokens > context:
        raise APIError(400, f"this model's context is {context} tokens; the prompt has {len(ids)} and max_tokens is "
                       f"{max_tokens} ({len(ids) + max_tokens} in all)", param="max_tokens",
                       code="context_length_exceeded")
    return CompletionParams(ids, max_tokens, float(temperature), seed, stream, chat)


class LoopMailbox:
    """Tokens from the engine's thread to one event loop, with one wake-up of the loop per burst:
    put() appends (stream, token) to a list and calls the loop (call_soon_threadsafe, a write to
    the loop's wake-up socket) only when the list was empty, so the tokens of one engine step
    cost one wake-up, not one each. for_loop(loop): the loop's mailbox."""

    _boxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox]" = weakref.WeakKeyDictionary()
    _boxes_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock = loop, [], threading.Lock()

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "LoopMailbox":
        with cls._boxes_lock:
            box = cls._boxes.get(loop)
            if box is None:
                box = cls._boxes[loop] = cls(loop)
            return box

    def put(self, stream: "TokenStream", token: int | None) -> None:
        with self.lock:
            wake = not self.items
            self.items.append((stream, token))
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                with self.lock:
                    self.items.clear()

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for stream, token in items:
            stream.deliver(token)


class TokenStream:
    """A request's tokens, from the engine's thread to an event loop: push(token) (thread-safe;
    None ends the stream); `async for token in stream` yields them in order. request: the
    GenRequest, once the engine has accepted it. ready: whether the next token (or the end) is
    already here, so that the next step of the iteration will not wait."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.mailbox = loop, LoopMailbox.for_loop(loop)
        self.buffer: deque[int | None] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.request: GenRequest | None = None

    def push(self, token: int | None) -> None:
        self.mailbox.put(self, token)

    def deliver(self, token: int | None) -> None:
        """(In the loop) a token has arrived: buffer it and wake the reader."""
        self.buffer.append(token)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    @property
    def ready(self) -> bool:
        return bool(self.buffer)

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> int:
        while not self.buffer:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        token = self.buffer[0]
        if token is None:  # the end stays in the buffer: iterating again stops again
            raise StopAsyncIteration
        self.buffer.popleft()
        return token


async def coalesce(events: AsyncIterator[bytes], ready: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The bytes of `events`, each item joined with the ones after it that are ready already
    (ready(): the next item will come without waiting): the same bytes in fewer writes to the
    socket when the server falls behind the engine."""
    it = events.__aiter__()
    while True:
        try:
            parts = [await it.__anext__()]
        except StopAsyncIteration:
            return
        while ready():
            try:
                parts.append(await it.__anext__())
            except StopAsyncIteration:
                yield b"".join(parts)
                return
        yield b"".join(parts)


def completion_chunk(request_id: str, model: str, created: int, text: str, finish_reason: str | None,
                     chat: bool, first: bool = False) -> dict[str, Any]:
    """One chunk of an OpenAI stream: a text_completion chunk, or a chat.completion.chunk whose
    delta carries the role in the first chunk."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: b"data: " + the JSON of `data` (a str such as "[DONE]" as it is) +
    a blank line, UTF-8."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode("utf-8")


async def sse_stream(stream: TokenStream, chunk: Callable[[str, str | None, bool], dict[str, Any]],
                     decode: Callable[[list[int]], str]) -> AsyncIterator[bytes]:
    """The event stream of one request: for each token from `stream`, as it arrives, the event of
    chunk(decode([token]), None, first) (first: True for the first token only); when the stream
    ends, the event of chunk("", stream.request.finish_reason, False), then the event "[DONE]"."""
    first = True
    async for token in stream:
        yield sse_event(chunk(decode([token]), None, first))
        first = False
    yield sse_event(chunk("", stream.request.finish_reason, False))
    yield sse_event("[DONE]")


def make_app(engine: Engine, tokenizer: CharTokenizer, model_name: str = "tiny-gpt") -> Any:
    """The FastAPI application over `engine`: POST /v1/completions and /v1/chat/completions
    (streamed with sse_stream when "stream": true), GET /v1/models, /health, /metrics
    (Prometheus text), /stats (JSON for the page) and / (the page); POST /reset_prefix_cache
    (empties the prefix cache and the peak-running counter, as vLLM's endpoint of that name). The engine's loop starts
    with the app and stops, after draining, when the server shuts down."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from minitorch.server_kit import PAGE_HTML

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="minitorch server", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:  # a bug: say so, in JSON
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                            status_code=500)

    pieces = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]   # a character tokenizer:

    def decode_one(ids: list[int]) -> str:                                  # a token's text alone
        return pieces[ids[0]] if len(ids) == 1 else tokenizer.decode(ids)

    async def complete(request: Request, chat: bool) -> Any:
        params = check_request(parse_body(await request.body()), chat, model_name, tokenizer, engine.W.block_size)
        stream = TokenStream(asyncio.get_running_loop())
        try:
            req = engine.add_request(params.prompt, params.max_tokens, params.temperature, params.seed, stream.push)
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(int(exc.retry_after))}) from None
        except RuntimeError as exc:
            raise APIError(503, str(exc), "server_error", code="shutting_down") from None
        stream.request, created = req, int(time.time())

        def chunk(text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
            return completion_chunk(req.id, model_name, created, text, finish_reason, chat, first)

        if params.stream:
            async def events() -> AsyncIterator[bytes]:
                try:
                    async for event in coalesce(sse_stream(stream, chunk, decode_one), lambda: stream.ready):
                        yield event
                finally:  # the client went away (or the stream ended): free the blocks now
                    engine.abort(req)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": req.id})
        try:
            tokens = [t async for t in stream]
        finally:
            engine.abort(req)
        if req.finish_reason == "error":
            raise APIError(500, f"the engine failed: {type(engine.error).__name__}: {engine.error}", "server_error")
        text = tokenizer.decode(tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": req.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        usage = {"prompt_tokens": len(req.prompt), "completion_tokens": len(tokens),
                 "total_tokens": len(req.prompt) + len(tokens)}
        return JSONResponse({"id": req.id, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": model_name, "choices": [choice], "usage": usage})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "minitorch", "max_model_len": engine.W.block_size}]}

    @app.get("/health")
    async def health() -> dict[str, str]:  # 503 once the engine cannot serve (a load balancer's signal)
        if not getattr(engine, "alive", True):
            raise APIError(503, "the engine is not taking requests" + (f": {engine.error}" if engine.error else ""),
                           "server_error", code="engine_down")
        return {"status": "ok"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        return {"dropped_blocks": engine.reset_prefix_cache()}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return engine.stats()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE_HTML.replace("MODEL", json.dumps(model_name)))

    return app


def model_engine(model: Any, dtype: Any, **engine_kw: Any) -> Engine:
    """An Engine over `model`'s weights in `dtype` (engine_kw go to Engine), its fused decode step
    compiled (the first request does not wait for Numba)."""
    engine = Engine(gpt_weights(model, dtype), **engine_kw)
    if engine.decoder is not None:
        engine.decoder.warm_up()
    return engine


def build_server(dtype: Any = np.float32, engine_process: bool = False, **engine_kw: Any) -> tuple[Any, Any]:
    """(engine, app) serving lesson 09's shipped tiny GPT in `dtype`; engine_kw go to Engine. With
    engine_process, the engine runs in a process of its own (EngineProcess, section 10)."""
    model, tokenizer = load_tiny_gpt()
    engine = EngineProcess(dtype, **engine_kw) if engine_process else model_engine(model, dtype, **engine_kw)
    return engine, make_app(engine, tokenizer)


def serve(host: str = "127.0.0.1", port: int = 8000, step_interval: float = 0.02, engine_process: bool = True,
          **engine_kw: Any) -> None:
    """Serve the tiny GPT until Ctrl-C (`make serve`): the first Ctrl-C finishes the requests in
    flight, a second aborts them and stops at once (server_kit.uvicorn_server). step_interval slows
    each step so a lecture can watch the tokens arrive; engine_process: the engine in a process of
    its own (section 10), or in a thread of this one."""
    from minitorch.server_kit import uvicorn_server

    _, app = build_server(step_interval=step_interval, engine_process=engine_process, **engine_kw)
    print(f"minitorch server: open http://{host}:{port}/ (metrics at /metrics); Ctrl-C stops it")
    try:
        uvicorn_server(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30).run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down gracefully
        pass
    print("minitorch server: stopped")


class Histogram:
    """A Prometheus histogram: `buckets`, increasing finite upper bounds; counts of observations
    per bucket, their sum and count."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]):
        bounds = [float(b) for b in buckets]
        if not bounds or any(b >= c for b, c in zip(bounds, bounds[1:])) or not all(map(math.isfinite, bounds)):
            raise ValueError(f"Histogram {name}: buckets must be increasing finite numbers, got {list(buckets)}")
        self.name, self.help, self.bounds = name, help, bounds
        self.counts = [0] * (len(bounds) + 1)     # the last: above every bound
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        """Count one observation: in the first bucket whose bound is >= value (or above all)."""
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += float(value)
        self.count += 1

    def render(self) -> str:
        """The text format: "# HELP name help", "# TYPE name histogram", one line
        name_bucket{le="<bound>"} <observations <= bound> per bound (cumulative), then le="+Inf"
        (all of them), then name_sum and name_count; lines end with a newline."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            lines.append(f'{self.name}_bucket{{le="{bound!r}"}} {total}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return "\n".join(lines) + "\n"


def latency_stats(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{"ttft" | "tpot" | "itl": {"mean", "p50", "p90", "p99"}} in seconds from records, each a dict
    with "start" (send time) and "token_times" (arrival of each token, increasing); records with
    a "status" other than 200, or no tokens, are left out."""
    ttft, tpot, itl = [], [], []
    for r in records:
        times = list(r["token_times"])
        if r.get("status", 200) != 200 or not times:
            continue
        ttft.append(times[0] - r["start"])
        if len(times) >= 2:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(np.diff(times).tolist())

    def summary(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
        p = np.percentile(values, [50, 90, 99])
        return {"mean": float(np.mean(values)), "p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}

    return {"ttft": summary(ttft), "tpot": summary(tpot), "itl": summary(itl)}


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def render_metrics(engine: Engine) -> str:
    """The engine's state in Prometheus text format: gauges (requests running and waiting, KV
    blocks used, cached and total, tokens/s, prefix hit rate), counters, and TTFT / TPOT
    histograms of the requests it finished (measured inside the server, from acceptance)."""
    s = engine.stats()
    out = []
    for name, kind, value, help in (
            ("num_requests_running", "gauge", s["running"], "Requests in the KV cache."),
            ("num_requests_waiting", "gauge", s["waiting"], "Requests in the queue."),
            ("kv_blocks_used", "gauge", s["kv_blocks_used"], "KV cache blocks held by requests."),
            ("kv_blocks_cached", "gauge", s["kv_blocks_cached"], "KV cache blocks in the prefix cache."),
            ("kv_blocks_total", "gauge", s["kv_blocks_total"], "KV cache blocks in the pool."),
            ("generation_tokens_per_second", "gauge", s["tokens_per_s"], "Output tokens per second, last 5 s."),
            ("prefix_cache_hit_rate", "gauge", s["prefix_hit_rate"], "Prompt tokens found in the prefix cache."),
            ("generation_tokens_total", "counter", s["generated_tokens"], "Output tokens generated."),
            ("prompt_tokens_total", "counter", s["prompt_tokens"], "Prompt tokens admitted."),
            ("request_success_total", "counter", s["finished"], "Requests finished."),
            ("request_aborted_total", "counter", s["aborted"], "Requests aborted (client gone)."),
            ("request_rejected_total", "counter", s["rejected"], "Requests refused with 429."),
            ("num_preemptions_total", "counter", s["preemptions"], "Preemptions.")):
        out.append(f"# HELP minitorch_{name} {help}\n# TYPE minitorch_{name} {kind}\nminitorch_{name} {float(value)!r}\n")
    ttft = Histogram("minitorch_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
    tpot = Histogram("minitorch_time_per_output_token_seconds", "Time per output token after the first.",
                     LATENCY_BUCKETS)
    with engine.lock:
        done = [r for r in engine.finished if r.token_times]
    for r in done:
        ttft.observe(r.token_times[0] - r.arrival)
        if len(r.token_times) >= 2:
            tpot.observe((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1))
    return "".join(out) + ttft.render() + tpot.render()


def poisson_arrivals(rate: float, n: int, rng: Any = 0) -> np.ndarray:
    """Send times (n,) float64 in seconds from the start of a Poisson process of `rate`
    requests per second: the cumulative sum of n independent exponential gaps of mean 1 / rate,
    drawn from np.random.default_rng(rng); all zeros when rate is inf. rate > 0, n >= 0."""
    if not rate > 0 or int(n) != n or n < 0:
        raise ValueError(f"poisson_arrivals: need rate > 0 and an integer n >= 0, got rate={rate}, n={n}")
    if math.isinf(rate):
        return np.zeros(int(n))
    return np.cumsum(np.random.default_rng(rng).exponential(1.0 / rate, int(n)))


def goodput(records: Sequence[dict[str, Any]], duration: float, ttft_slo: float, tpot_slo: float) -> float:
    """Requests per second over `duration` seconds that succeeded (status 200, or no status, and
    at least one token) with TTFT <= ttft_slo and, if they have two or more tokens, TPOT =
    (last - first) / (n - 1) <= tpot_slo. records as for latency_stats."""
    if not duration > 0:
        raise ValueError(f"goodput: duration must be > 0, got {duration}")
    good = 0
    for r in records:
        times = list(r["token_times"])
        if r.get("status", 200) != 200 or not times or times[0] - r["start"] > ttft_slo:
            continue
        if len(times) >= 2 and (times[-1] - times[0]) / (len(times) - 1) > tpot_slo:
            continue
        good += 1
    return good / duration


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


def _engine_loop(conn: Any, engine: Engine) -> None:
    requests: dict[int, GenRequest] = {}
    queued: set[int] = set()                       # sent to the engine, not yet admitted
    out: list[tuple[int, int | None, str | None]] = []
    stopping = False

    def on_token(n: int) -> Callable[[int | None], None]:
        return lambda token: out.append((n, token, None if token is not None else requests[n].finish_reason))

    def read(wait: float) -> None:
        """Handle the commands that arrive within `wait` seconds (all that wait, at least)."""
        nonlocal stopping
        if not conn.poll(wait):
            return
        while conn.poll(0):
            cmd = conn.recv()
            if cmd[0] == "add":
                n, prompt, max_tokens, temperature, seed = cmd[1:]
                requests[n] = engine.add_request(prompt, max_tokens, temperature, seed, on_token(n))
                queued.add(n)
            elif cmd[0] == "abort" and cmd[1] in requests:
                engine.abort(requests[cmd[1]])
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
        for n, token, _ in out:
            if token is None:
                requests.pop(n, None)
                queued.discard(n)
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

        if isinstance(max_waiting, bool) or int(max_waiting) != max_waiting or max_waiting < 1:
            raise ValueError(f"EngineProcess: max_waiting must be an integer >= 1, got {max_waiting!r}")
        # a fresh interpreter (not fork: this process has threads; not multiprocessing's spawn, which
        # would run a script's main module again), a socket pair, multiprocessing's message framing
        ours, theirs = socket.socketpair()
        ours.set_inheritable(False)                # a fork of this process must not keep the engine alive
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from minitorch.server import engine_process_main; engine_process_main({theirs.fileno()})"],
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
        self._queued: set[int] = set()                 # sent, not yet admitted by the engine
        self._stats: dict[str, Any] = first_stats[0]    # the engine's stats(), as of its last message
        self._rejected, self._ids, self._stopping, self._dead = 0, itertools.count(), False, False
        # _send_lock orders the messages, and makes add_request's check and send one step against
        # stop's; it is taken before self.lock, never inside it. The reader takes only self.lock.
        self._send_lock, self._replies = threading.RLock(), {}
        self._replied = threading.Condition(self.lock)
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

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
                    on_token: Callable[[int | None], None] | None = None) -> GenRequest:
        """As Engine.add_request: ValueError for a request that can never be served, QueueFull past
        max_waiting, RuntimeError once stopping or if the engine process has died."""
        prompt = check_generation("EngineProcess.add_request", prompt, max_tokens, temperature,
                                  self.W.vocab_size, self.W.block_size)
        with self._send_lock:
            with self.lock:
                if self._stopping or self._dead:
                    raise RuntimeError("EngineProcess.add_request: the engine is shutting down" if self._stopping
                                       else f"EngineProcess.add_request: the engine process failed: {self.error}")
                if len(self._queued) >= self.max_waiting:
                    self._rejected += 1
                    raise QueueFull(len(self._queued), self.retry_after())
                seed = int(np.random.default_rng().integers(2 ** 31)) if seed is None else int(seed)
                n = next(self._ids)
                request = GenRequest(f"cmpl-{n}", prompt.astype(np.int64), int(max_tokens), float(temperature), seed,
                                     on_token)
                self._requests[n], self._numbers[request] = request, n
                self._queued.add(n)
            # sent without self.lock (a full socket must not stop the reader, which needs it), but
            # under _send_lock: stop cannot slip its message in between the check and this one
            self._send(("add", n, request.prompt, request.max_tokens, request.temperature, seed))
        return request

    def abort(self, request: GenRequest) -> bool:
        """End a request now (its blocks are freed by the engine before its next step); False if it
        had already finished."""
        with self.lock:
            if request.finished:
                return False
            n = self._numbers.get(request)
            self._finish(request, "abort")
        if n is not None:
            self._send(("abort", n))
        return True

    def _finish(self, request: GenRequest, reason: str) -> None:
        n = self._numbers.pop(request, None)
        self._requests.pop(n, None)
        self._queued.discard(n)
        request.finish_reason = reason
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
                        for n, token, finish_reason in items:
                            request = self._requests.get(n)
                            if request is None:                  # aborted here already
                                continue
                            if token is None:
                                self._finish(request, finish_reason)
                            else:
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

        with self._send_lock:
            with self.lock:
                self._stopping = True
            self._send(("stop", drain))
        self._reader.join(timeout)
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
