# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.server: an inference server for lesson 09's tiny GPT: an engine with a step loop
(admission, chunked prefill, decode, preemption, retirement, prefix caching) over lesson 11's
paged KV cache, an OpenAI-compatible HTTP API with streaming and Prometheus metrics, and the
pieces of a load generator (arrivals, latency statistics, goodput)."""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import numbers
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from starlette.requests import Request  # FastAPI reads the handlers' annotations from the module's names

from minitorch.gpt import CharTokenizer, load_tiny_gpt
from minitorch.serve import GPTWeights, PagedKVCache, draw, gpt_forward, gpt_weights, paged_forward, sample_token
from minitorch.server_kit import FusedDecoder


FUSED_CHUNK_MAX = 32   # longer prefill chunks go through paged_forward (BLAS), shorter ones the fused step
MAX_LOGPROBS = 20      # the most alternatives a token's log-probabilities may list (OpenAI's top_logprobs bound)


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its bound: the caller should retry later (HTTP 429)."""

    def __init__(self, waiting: int, retry_after: float):
        super().__init__(f"the server is busy: {waiting} requests are waiting; retry in {retry_after:.0f} s")
        self.retry_after = retry_after


def _is_int(value: Any) -> bool:
    """An integer (Python's or NumPy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    """A real number (Python's or NumPy's), not a bool; NaN and inf included."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _describe(value: Any) -> str:
    """A value as an error message names it: an array by its shape and dtype, else a short repr."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_ids(where: str, tokens: Any) -> None:
    """ValueError naming `where`, tokens and the value unless tokens is a 1-D list, tuple or array of
    integer token ids >= 0 (the prefix cache hashes ids and knows no vocabulary: the engine checks
    them against it when a request comes in)."""
    array = np.asarray(tokens) if isinstance(tokens, (list, tuple, np.ndarray)) else np.empty(())
    if array.ndim != 1 or (array.size or isinstance(tokens, np.ndarray)) and array.dtype.kind not in "iu" or \
            array.size and array.min() < 0:
        values = f" with values {array.min()}..{array.max()}" if array.size and array.dtype.kind in "iuf" else ""
        raise ValueError(f"{where}: tokens must be 1-D integer token ids >= 0, got {_describe(tokens)}{values}")


@dataclass
class SamplingParams:
    """How a request samples beyond its temperature and seed: OpenAI's sampling parameters, as vLLM's
    SamplingParams holds them. top_p in (0, 1]: nucleus sampling (1: off); top_k >= 0: only the k
    most likely tokens (0: off); logit_bias {token id: bias in [-100, 100]}, added to the logits;
    presence_penalty and frequency_penalty in [-2, 2], subtracted from the logit of every token
    already in the output, once (presence) and per occurrence (frequency); logprobs: None, or the
    number (0 .. MAX_LOGPROBS) of most likely alternatives whose log-probabilities come back with
    each sampled token (with the token's own); prompt_logprobs: the same for the prompt's tokens.
    ValueError or TypeError naming the field and the value otherwise."""

    top_p: float = 1.0
    top_k: int = 0
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p must be a number in (0, 1], got {_describe(self.top_p)}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k must be an integer >= 0 (0: off), got {_describe(self.top_k)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"SamplingParams: {name} must be a number in [-2, 2], got {_describe(value)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"SamplingParams: {name} must be None or an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {_describe(value)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"SamplingParams: logit_bias must be None or a dict {{token id: bias}}, got "
                                f"{_describe(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0 or not _is_number(bias) or not -100 <= bias <= 100:
                    raise ValueError(f"SamplingParams: logit_bias must map token ids >= 0 to biases in [-100, 100], "
                                     f"got {_describe(token)}: {_describe(bias)}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        self.top_p, self.top_k = float(self.top_p), int(self.top_k)
        self.presence_penalty, self.frequency_penalty = float(self.presence_penalty), float(self.frequency_penalty)

    @property
    def plain(self) -> bool:
        """Whether sampling is temperature alone (lesson 11's sample_token: the engine's fast path)."""
        return (self.top_p == 1.0 and self.top_k == 0 and not self.logit_bias and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0)

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


PLAIN = SamplingParams()


def _check_generation(where: str, prompt: Any, max_tokens: Any, temperature: Any, vocab_size: int,
                      context: int, seed: Any = None, on_token: Any = None, sampling: Any = None,
                      n: Any = 1) -> np.ndarray:
    """The prompt as a 1-D array of token ids, after checking a request the engine could never
    serve: ValueError naming the value and the bound (a prompt that is not a 1-D sequence of >= 1
    integer ids in [0, vocab_size), such as a nested list; max_tokens not an integer >= 1; prompt +
    max_tokens past the context; temperature not a finite number >= 0; a seed not None or an
    integer >= 0; n not an integer >= 1; a logit_bias for a token outside the vocabulary); TypeError
    for an on_token that is neither None nor callable, or a sampling that is not a SamplingParams."""
    try:
        ids = np.asarray(prompt)
    except ValueError:                                    # a ragged nested list
        ids = np.asarray(prompt, dtype=object)
    if ids.ndim != 1:
        raise ValueError(f"{where}: the prompt must be a 1-D sequence of token ids, got {type(prompt).__name__} "
                         f"of shape {ids.shape}" + (" (a nested list is not flattened)" if ids.ndim > 1 else ""))
    if len(ids) < 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{where}: the prompt must be >= 1 token ids in [0, {vocab_size}), "
                         f"got {len(ids)} of dtype {ids.dtype}")
    if isinstance(max_tokens, (bool, np.bool_)) or not isinstance(max_tokens, numbers.Real) or \
            not math.isfinite(max_tokens) or int(max_tokens) != max_tokens or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    if len(ids) + max_tokens > context:
        raise ValueError(f"{where}: {len(ids)} prompt tokens + {max_tokens} new tokens pass the "
                         f"model's context of {context} tokens")
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, numbers.Real) or \
            not 0 <= temperature < math.inf:
        raise ValueError(f"{where}: temperature must be a finite number >= 0, got {temperature!r}")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise ValueError(f"{where}: seed must be None or an integer >= 0, got {seed!r}")
    if on_token is not None and not callable(on_token):
        raise TypeError(f"{where}: on_token must be None or a function of one token, got {type(on_token).__name__}")
    if sampling is not None and not all(hasattr(sampling, f) for f in ("top_p", "top_k", "logit_bias", "plain",
                                                                        "penalised", "logprobs", "prompt_logprobs")):
        raise TypeError(f"{where}: sampling must be None or a SamplingParams, got {_describe(sampling)}")
    if sampling is not None and sampling.logit_bias and max(sampling.logit_bias) >= vocab_size:
        raise ValueError(f"{where}: sampling's logit_bias names token {max(sampling.logit_bias)}, outside the "
                         f"vocabulary of {vocab_size}")
    if not _is_int(n) or n < 1:
        raise ValueError(f"{where}: n must be an integer >= 1, got {_describe(n)}")
    return ids


def _check_callbacks(where: str, on_tokens: Any, n: int) -> list[Any]:
    """on_tokens as a list of n callbacks (None: n Nones); TypeError or ValueError naming it otherwise."""
    if on_tokens is None:
        return [None] * n
    if not isinstance(on_tokens, (list, tuple)) or len(on_tokens) != n or \
            not all(f is None or callable(f) for f in on_tokens):
        raise (ValueError if isinstance(on_tokens, (list, tuple)) else TypeError)(
            f"{where}: on_tokens must be None or a list of {n} callbacks (or None), one per request, got "
            f"{_describe(on_tokens)}")
    return list(on_tokens)


def _check_engine_options(where: str, context: int, dtype: Any, num_blocks: Any, block_size: Any, max_running: Any,
                          max_waiting: Any, max_num_batched_tokens: Any, prefix_caching: Any, step_interval: Any,
                          history: Any, decode: Any) -> None:
    """Refuse an engine's settings before anything starts (Engine and EngineProcess): ValueError or
    TypeError naming the setting, its value and what it must be. The weights' dtype must be
    float32 or float64 (the fused step and paged_forward compute in it; float16 is refused here,
    not at the first step); the pool must hold one request of the model's whole context."""
    if np.dtype(dtype) not in (np.float32, np.float64):
        raise ValueError(f"{where}: the weights must be float32 or float64, got {np.dtype(dtype).name} "
                         f"(convert them with W.astype(np.float32))")
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_running", max_running),
                        ("max_waiting", max_waiting), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("history", history)):
        if not _is_int(value) or value < 1:
            raise (ValueError if _is_int(value) else TypeError)(f"{where}: {name} must be an integer >= 1, got {value!r}")
    if num_blocks * block_size < context:
        raise ValueError(f"{where}: {num_blocks} blocks of {block_size} tokens cannot hold one request of the "
                         f"model's context ({context} tokens)")
    if isinstance(step_interval, (bool, np.bool_)) or not isinstance(step_interval, numbers.Real) or \
            not 0 <= step_interval < math.inf:
        raise ValueError(f"{where}: step_interval must be a finite number of seconds >= 0, got {step_interval!r}")
    if not isinstance(decode, str) or decode not in ("fused", "reference"):
        raise ValueError(f"{where}: decode must be 'fused' or 'reference', got {decode!r}")
    if not (isinstance(prefix_caching, bool) or callable(prefix_caching)):
        raise TypeError(f"{where}: prefix_caching must be True, False or a class like PrefixCache, "
                        f"got {prefix_caching!r}")


@dataclass(eq=False)
class GenRequest:
    """One generation request inside the engine, made by Engine.add_request (which checks what its
    caller passed). prompt: (P,) int64 token ids; max_tokens >= 1; temperature >= 0 (0: greedy);
    seed for its own sampler (rng: np.random.default_rng(seed), made by the engine); sampling: the
    rest of how it samples. output: the tokens generated; logprobs: with sampling.logprobs, one
    (logprob of the token, [(id, logprob) of the most likely]) per output token; prompt_logprobs:
    with sampling.prompt_logprobs, the same for each prompt token (None for the first).
    num_computed: tokens whose K/V are in the cache; token_times: perf_counter() at each output
    token; arrival: perf_counter() when the engine accepted it, scheduled_at when it first ran,
    finished_at when it ended; owner: the engine that accepted it (only it may abort it). With
    parallel sampling, followers: the group's other requests, which start from this one's prompt
    when it is computed (leader: the request they follow)."""

    id: str
    prompt: np.ndarray
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    on_token: Callable[[int | None], None] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    owner: Any = field(default=None, repr=False)
    rng: Any = field(default=None, repr=False)
    logprobs: list[Any] = field(default_factory=list, repr=False)
    prompt_logprobs: list[Any] | None = field(default=None, repr=False)
    followers: list[Any] = field(default_factory=list, repr=False)
    leader: Any = field(default=None, repr=False)
    scheduled_at: float | None = None
    finished_at: float | None = None
    plain: bool = True             # sampling by temperature alone, no logprobs: the step's fast path

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


def _token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` under logits (vocab,) (the model's own distribution, before
    temperature, penalties or top-p: vLLM's raw logprobs), and the k most likely tokens with theirs,
    most likely first (the lower id first among ties). float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    lp = z - math.log(float(np.exp(z).sum()))
    top = np.argsort(-lp, kind="stable")[:k]
    return float(lp[token]), [(int(t), float(lp[t])) for t in top]


def block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """The chained hashes of the full blocks of `tokens` (1-D ids): len(tokens) // block_size ints,
    h_0 = hash((0, block 0 as a tuple of ints)), h_i = hash((h_{i-1}, block i as a tuple of ints))."""
    _check_ids("block_hashes", tokens)
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_hashes: block_size must be an integer >= 1, got {block_size!r}")
    ids = [int(t) for t in np.asarray(tokens)]
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
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"PrefixCache: cache must be a PagedKVCache, got {_describe(cache)}")
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
        _check_ids("PrefixCache.match", tokens)
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
        _check_ids("PrefixCache.admit", tokens)
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
        if seq not in self.cache.tables:
            raise ValueError(f"PrefixCache.register: seq {_describe(seq)} is not a sequence of the cache")
        _check_ids("PrefixCache.register", tokens)
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
        if not _is_int(n) or n < 0:
            raise ValueError(f"PrefixCache.evict: n must be an integer >= 0, got {_describe(n)}")
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
    through one compiled function (FusedDecoder, section 10) and the longer chunks through
    paged_forward, "reference" runs everything through lesson 11's paged_forward."""

    def __init__(self, W: GPTWeights, num_blocks: int = 64, block_size: int = 8, max_running: int = 32,
                 max_waiting: int = 256, max_num_batched_tokens: int = 48, prefix_caching: Any = True,
                 step_interval: float = 0.0, history: int = 4096, decode: str = "fused"):
        if not isinstance(getattr(W, "params", None), dict) or "wte.weight" not in W.params:
            raise TypeError(f"Engine: W must be the model's GPTWeights (minitorch.serve.gpt_weights), got "
                            f"{type(W).__name__}")
        _check_engine_options("Engine", W.block_size, W.dtype, num_blocks, block_size, max_running, max_waiting,
                             max_num_batched_tokens, prefix_caching, step_interval, history, decode)
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
        if getattr(request, "owner", None) is not self:
            raise ValueError(f"Engine.abort: {getattr(request, 'id', request)!r} is not a request of this engine "
                             "(a request object from another engine, or not one its add_request returned)")
        if reason not in ("abort", "stop"):
            raise ValueError(f"Engine.abort: reason must be 'abort' or 'stop', got {_describe(reason)}")
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


MAX_N = 16                  # samples per request (OpenAI allows 128; a server sizes this to its pool)
MAX_STOP = 4                # stop strings per request (OpenAI's bound)
SEED_RANGE = (-2 ** 63, 2 ** 63 - 1)   # a seed is a signed 64-bit integer (vLLM's bound)


class APIError(Exception):
    """An error answered as OpenAI's JSON error object with HTTP `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _shown(value: Any) -> str:
    """A JSON value as an error message shows it: short, and shallow (a nested list 10,000 deep is not
    walked to print it)."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict = 3, 40, 40, 6, 4
    return r.repr(value)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; APIError 400 for non-UTF-8 bytes, malformed JSON (NaN and
    Infinity are not JSON), nesting deeper than Python's recursion allows, an integer of more digits
    than Python converts (4,300), or a body that is not an object. TypeError if raw is not bytes."""
    if not isinstance(raw, (bytes, bytearray)):
        raise TypeError(f"parse_body: raw must be the body's bytes, got {_describe(raw)}")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None
    try:
        body = json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as exc:                                # NaN, Infinity; an integer of > 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


@dataclass
class CompletionParams:
    """A validated request: prompt ids, max_tokens, temperature, seed (None or >= 0, what the engine
    takes), stream, chat or not; n samples; sampling (top_p, top_k, logit_bias, penalties,
    logprobs); stop strings; echo (the prompt before the completion); include_usage (a usage chunk
    at the end of a stream); logprobs: the alternatives per token to return (None: no
    log-probabilities); user: the end user's id, if the client gave one."""

    prompt: np.ndarray
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    chat: bool
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    echo: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    user: str | None = None


# What the server does with every field of OpenAI's two request bodies (the API reference's lists, as
# the official client sends them). A field is honoured (read below), or accepted only at the value
# that asks for nothing ("no-op" values: a client library may send them), or refused with a 400 that
# names it: a client must never think a parameter was honoured when it was not.
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "top_k"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs", "max_completion_tokens", "safety_identifier",
                               "prompt_cache_key"}
COMPLETION_NO_OP = {"suffix": ((None, ""), "inserting text before a suffix is not supported")}
CHAT_NO_OP = {  # field: (the values that ask for nothing, why any other is refused)
    "response_format": ((None, {"type": "text"}), "structured output (JSON mode, schemas) is not supported"),
    "tools": ((None, []), "tool calling is not supported"),
    "tool_choice": ((None, "none"), "tool calling is not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "parallel_tool_calls": ((None, True, False), "tool calling is not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "the tiny GPT is not a reasoning model"),
    "verbosity": ((None,), "the tiny GPT has no verbosity setting"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "metadata": ((None,), "metadata belongs to stored completions, which are not supported"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier"),
    "moderation": ((None,), "moderation is not supported"),
    "prompt_cache_retention": ((None,), "the prefix cache keeps blocks while the pool has room; no retention setting"),
    "prompt_cache_options": ((None,), "the prefix cache takes no options"),
}


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "an array",
          dict: "an object"}


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None,
           required: bool = False) -> Any:
    """body[name] if it is of one of `kinds` (JSON: bool is not a number), `default` where it is
    missing or null; APIError 400 naming the field otherwise."""
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"missing required field '{name}'", param=name)
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds) or \
            (isinstance(value, float) and not math.isfinite(value)):
        names = " or ".join(_KINDS[k] for k in kinds if not (k is int and float in kinds))
        raise APIError(400, f"'{name}' must be {names}, got {_shown(value)}", param=name)
    return value


def _in_range(name: str, value: Any, lo: float, hi: float) -> Any:
    if not lo <= value <= hi:
        raise APIError(400, f"'{name}' must lie in [{lo}, {hi}], got {_shown(value)}", param=name)
    return value


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The tiny GPT has no chat template: the messages' contents (a string, or text parts) joined by
    blank lines, and one after the last (the model continues from there)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise TypeError(f"chat_prompt: messages must be a list of {{role, content}} objects, got {_shown(messages)}")

    def text(content: Any) -> str:
        return content if isinstance(content, str) else "".join(part["text"] for part in content)
    return "\n\n".join(text(m["content"]) for m in messages) + "\n\n"


def _check_messages(body: dict[str, Any]) -> str:
    messages = _field(body, "messages", (list,), required=True)
    must = ("'messages' must be a non-empty list of {role: system|developer|user|assistant, content: a string or "
            "a list of text parts}")
    if not messages:
        raise APIError(400, must + ", got []", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant") or \
                "content" not in m:
            raise APIError(400, f"{must}; message {i} is {_shown(m)}", param="messages")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise APIError(400, f"message {i}: the field '{extra[0]}' is not supported (tool calls, names, audio: "
                                "only role and content)", param="messages")
        content = m["content"]
        parts_ok = isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and set(p) <= {"type", "text"}
            for p in content)
        if not isinstance(content, str) and not parts_ok:
            raise APIError(400, f"{must}; message {i} has the content {_shown(content)} (only text is supported)",
                           param="messages")
    return chat_prompt(messages)


def _check_prompt(body: dict[str, Any], tokenizer: CharTokenizer) -> tuple[str | None, np.ndarray | None]:
    """(text, None) for a prompt string, (None, ids) for a prompt of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                   # a batch of one prompt
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) < 0 or max(prompt) >= tokenizer.vocab_size:
            raise APIError(400, f"'prompt' holds token ids outside [0, {tokenizer.vocab_size}): "
                                f"{_shown([t for t in prompt if not 0 <= t < tokenizer.vocab_size])}", param="prompt")
        return None, np.asarray(prompt, dtype=np.int64)
    if prompt is None:
        raise APIError(400, "missing required field 'prompt'", param="prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "'prompt': a batch of several prompts is not supported; send one request per prompt",
                       param="prompt")
    raise APIError(400, f"'prompt' must be a string or a non-empty array of token ids, got {_shown(prompt)}",
                   param="prompt")


def check_request(body: dict[str, Any], chat: bool, model_name: str, tokenizer: CharTokenizer,
                  context: int) -> CompletionParams:
    """Validate a completions (chat=False) or chat completions body against OpenAI's API: every
    field honoured (see CompletionParams), accepted only at a value that asks for nothing
    (CHAT_NO_OP, COMPLETION_NO_OP), or refused; APIError 400 naming the field and the value (404 for an unknown
    model). Without max_tokens, the completion may fill the rest of the context."""
    known, no_op = (CHAT_FIELDS, CHAT_NO_OP) if chat else (COMPLETION_FIELDS, COMPLETION_NO_OP)
    for name, value in body.items():
        if name in known:
            continue
        if name in no_op:
            allowed, why = no_op[name]
            if any(value == a and type(value) is type(a) for a in allowed):
                continue
            raise APIError(400, f"'{name}': {why} (got {_shown(value)})", param=name)
        raise APIError(400, f"unknown or unsupported field '{name[:60]}' for {'chat ' if chat else ''}completions "
                            "(this server refuses what it would not honour)", param=name[:60])
    model = _field(body, "model", (str,), required=True)
    if model != model_name:
        raise APIError(404, f"the model '{model[:80]}' does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")
    if chat:
        text, ids = _check_messages(body), None
    else:
        text, ids = _check_prompt(body, tokenizer)
    if text is not None:
        if not text:
            raise APIError(400, "the prompt is empty", param="prompt")
        try:
            ids = tokenizer.encode(text)
        except ValueError as exc:
            raise APIError(400, f"the prompt cannot be tokenized: {exc}", param="messages" if chat else "prompt") from None
    max_tokens = _field(body, "max_tokens", (int,))
    if chat:
        newer = _field(body, "max_completion_tokens", (int,))
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise APIError(400, f"'max_completion_tokens' ({newer}) and 'max_tokens' ({max_tokens}) disagree; "
                                "send one", param="max_completion_tokens")
        name, max_tokens = ("max_completion_tokens", newer) if newer is not None else ("max_tokens", max_tokens)
    else:
        name = "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"'{name}' must be >= 1, got {max_tokens}", param=name)
    if len(ids) >= context or max_tokens is not None and len(ids) + max_tokens > context:
        raise APIError(400, f"this model's context is {context} tokens; the prompt has {len(ids)}"
                       + (f" and {name} is {_shown(max_tokens)}" if max_tokens is not None else
                          ", which leaves no room for a completion"),
                       param=name if max_tokens is not None else ("messages" if chat else "prompt"),
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = context - len(ids)                     # the rest of the context (vLLM's default)
    temperature = _in_range("temperature", _field(body, "temperature", (int, float), 1.0), 0, 2)
    top_p = _field(body, "top_p", (int, float), 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"'top_p' must lie in (0, 1], got {_shown(top_p)}", param="top_p")
    top_k = _field(body, "top_k", (int,), 0)
    if top_k < -1:
        raise APIError(400, f"'top_k' must be -1 or 0 (off) or a number of tokens >= 1, got {_shown(top_k)}",
                       param="top_k")
    penalties = {p: _in_range(p, _field(body, p, (int, float), 0.0), -2, 2)
                 for p in ("presence_penalty", "frequency_penalty")}
    bias = _field(body, "logit_bias", (dict,))
    if bias is not None:
        parsed = {}
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9 and int(key) < tokenizer.vocab_size):
                raise APIError(400, f"'logit_bias' keys must be token ids in [0, {tokenizer.vocab_size}), got "
                                    f"{_shown(key)}", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise APIError(400, f"'logit_bias' values must be numbers in [-100, 100], got {_shown(value)} for "
                                    f"token {key}", param="logit_bias")
            parsed[int(key)] = float(value)
        bias = parsed
    n = _in_range("n", _field(body, "n", (int,), 1), 1, MAX_N)
    if not chat and _field(body, "best_of", (int,), n) != n:
        raise APIError(400, "'best_of' other than n is not supported (vLLM's V1 engine dropped it too)",
                       param="best_of")
    seed = _field(body, "seed", (int,))
    if seed is not None:
        _in_range("seed", seed, *SEED_RANGE)
        seed %= 2 ** 64                                     # the engine's generators take integers >= 0
    stop = _field(body, "stop", (str, list), ())
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them, got "
                            f"{_shown(stop)}", param="stop")
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,))
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError(400, "'stream_options' is only allowed with stream: true", param="stream_options")
        for key, value in options.items():
            if key == "include_usage" and isinstance(value, bool):
                include_usage = value
            elif key == "include_obfuscation" and value is False:   # no padding fields: asks for nothing
                continue
            else:
                raise APIError(400, f"'stream_options': only include_usage (true or false) is supported, got "
                                    f"{_shown({key: value})}", param="stream_options")
    echo = False if chat else _field(body, "echo", (bool,), False)
    if chat:
        wants = _field(body, "logprobs", (bool,), False)
        top = _field(body, "top_logprobs", (int,))
        if top is not None and not wants:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = _in_range("top_logprobs", top if top is not None else 0, 0, MAX_LOGPROBS) if wants else None
        for name in ("safety_identifier", "prompt_cache_key"):
            _field(body, name, (str,))
    else:
        logprobs = _field(body, "logprobs", (int,))
        if logprobs is not None:
            _in_range("logprobs", logprobs, 0, 5)          # the completions API's bound
    user = _field(body, "user", (str,))
    sampling = SamplingParams(top_p, max(top_k, 0), bias, penalties["presence_penalty"], penalties["frequency_penalty"],
                              logprobs, logprobs if echo and logprobs is not None else None)
    return CompletionParams(ids, int(max_tokens), float(temperature), seed, stream, chat, n, sampling, tuple(stop),
                            echo, include_usage, logprobs, user)


def _refuse_token(where: str, stream: Any, token: Any) -> None:
    if not hasattr(stream, "deliver"):
        raise TypeError(f"{where}: stream must be a TokenStream, got {_describe(stream)}")
    raise TypeError(f"{where}: token must be a token id (an int) or None (the end), got {_describe(token)}")


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
        if not (token is None or token.__class__ is int) or not hasattr(stream, "deliver"):  # once per token: inline
            _refuse_token("LoopMailbox.put", stream, token)
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
    None ends the stream); `async for token in stream` yields them in order. buffer: the tokens
    arrived and not yet taken (the end, None, stays in it); wait(): until one is there."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.mailbox = loop, LoopMailbox.for_loop(loop)
        self.buffer: deque[int | None] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def push(self, token: int | None) -> None:
        if not (token is None or token.__class__ is int):             # once per token: checked inline
            _refuse_token("TokenStream.push", self, token)
        self.mailbox.put(self, token)

    def deliver(self, token: int | None) -> None:
        """(In the loop) a token has arrived: buffer it and wake the reader."""
        if not (token is None or token.__class__ is int):
            _refuse_token("TokenStream.deliver", self, token)
        self.buffer.append(token)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        while not self.buffer:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> int:
        await self.wait()
        token = self.buffer[0]
        if token is None:  # the end stays in the buffer: iterating again stops again
            raise StopAsyncIteration
        self.buffer.popleft()
        return token


class Piece(NamedTuple):
    """Text of a response that may be sent, and the tokens it completes: their ids and, where asked
    for, log-probabilities ((logprob, [(id, logprob), ...]) each; None for a prompt's first token)."""

    text: str
    tokens: list[int]
    logprobs: list[Any] | None = None


class TextStream:
    """One choice of a response, as text that may be sent: `async for piece in stream` (Pieces),
    then `finish_reason`. It reads the request's TokenStream, decodes each token (decode_one), and
    applies the stop strings `stops` (None, or a StopStrings of section 7, one per choice): text
    that might begin one is held back until the next tokens settle it; at a stop string the stream
    ends, the text before it sent, and the engine ends the request with finish_reason "stop"
    (engine.abort(request, "stop"), which frees its blocks). echo: the prompt's text comes first.
    num_tokens: the completion's tokens read (the usage's count: a stop string's own tokens
    included). ready: whether the next piece, or the end, would come without waiting."""

    def __init__(self, tokens: TokenStream, request: GenRequest, engine: Any, decode_one: Callable[[int], str],
                 stops: Any = None, echo: bool = False):
        if stops is not None and not (hasattr(stops, "feed") and hasattr(stops, "flush")):
            raise TypeError(f"TextStream: stops must be None or a StopStrings, got {_describe(stops)}")
        self.tokens, self.request, self.engine, self.decode_one = tokens, request, engine, decode_one
        self.stops = stops
        self.echo, self.num_tokens, self.ended, self.stopped = echo, 0, False, False
        self.pieces: deque[Piece] = deque()
        self.pending: list[list[Any]] = []       # [token, its characters not yet sent, logprob]: held back

    @property
    def finish_reason(self) -> str | None:
        return "stop" if self.stopped else self.request.finish_reason

    @property
    def ready(self) -> bool:
        self._pump()
        return bool(self.pieces) or self.ended

    def __aiter__(self) -> "TextStream":
        return self

    async def __anext__(self) -> Piece:
        while True:
            self._pump()
            if self.pieces:
                return self.pieces.popleft()
            if self.ended:
                raise StopAsyncIteration
            await self.tokens.wait()

    def _pump(self) -> None:
        """Turn the tokens that have arrived into pieces (without waiting)."""
        buffer = self.tokens.buffer
        while buffer and not self.ended:
            if self.echo:
                self.echo = False
                r = self.request
                self.pieces.append(Piece("".join(map(self.decode_one, r.prompt.tolist())), r.prompt.tolist(),
                                         r.prompt_logprobs))
            token = buffer[0]
            if token is None:                            # the request ended: send what was held back
                self.ended = True
                if self.stops is not None:
                    self._release(self.stops.flush())
                return
            buffer.popleft()
            logprobs = self.request.logprobs
            lp = logprobs[self.num_tokens] if logprobs and self.num_tokens < len(logprobs) else None
            self.num_tokens += 1
            text = self.decode_one(token)
            if self.stops is None:
                self.pieces.append(Piece(text, [token], None if lp is None else [lp]))
                continue
            self.pending.append([token, len(text), lp])
            self._release(self.stops.feed(text))
            if self.stops.stopped:
                self.ended = self.stopped = True
                self.pending.clear()
                self.engine.abort(self.request, "stop")

    def _release(self, text: str) -> None:
        """Send `text`, the next characters of the held-back tokens: a piece with the tokens it completes."""
        tokens, lps, n = [], [], len(text)
        while self.pending and self.pending[0][1] <= n:
            token, chars, lp = self.pending.pop(0)
            n -= chars
            tokens.append(token)
            lps.append(lp)
        if self.pending and n:
            self.pending[0][1] -= n                       # a token partly sent: the rest stays held
        if text or tokens:
            self.pieces.append(Piece(text, tokens, lps if lps and lps[0] is not None else None))


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


DONE_EVENT = b"data: [DONE]\n\n"


async def merge_events(streams: Sequence[AsyncIterator[bytes]],
                       last: Callable[[], Sequence[bytes]] | None = None) -> AsyncIterator[bytes]:
    """The events of several event streams (one per choice of a response) as they come, each
    stream's closing [DONE] held back; when all have ended, the events last() returns (a usage
    chunk: counted once every choice has ended) and one [DONE]."""
    if len(streams) == 1:                                 # one choice: no tasks, no queue
        async for event in streams[0]:
            if event != DONE_EVENT:
                yield event
    else:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(stream: AsyncIterator[bytes]) -> None:
            try:
                async for event in stream:
                    if event != DONE_EVENT:
                        await queue.put(event)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(s)) for s in streams]
        try:
            left = len(tasks)
            while left:
                event = await queue.get()
                if event is None:
                    left -= 1
                else:
                    yield event
            for task in tasks:
                task.result()                             # a stream that raised raises here
        finally:
            for task in tasks:
                task.cancel()
    for event in last() if last is not None else ():
        yield event
    yield DONE_EVENT


class ResponseBuilder:
    """The JSON of one response, OpenAI's completion or chat completion object or its stream's
    chunks, for `request_id` (cmpl-..., chatcmpl-...). logprobs: None (no log-probabilities), or the
    alternatives per token (completions: a dict {text: logprob} per token, the sampled one
    included; chat: a list of {token, logprob, bytes}). decode_one(id) -> a token's text;
    include_usage: every chunk carries "usage": null, and usage_chunk() the counts."""

    def __init__(self, request_id: str, model: str, created: int, chat: bool, logprobs: int | None,
                 decode_one: Callable[[int], str], include_usage: bool = False):
        self.id, self.model, self.created, self.chat = request_id, model, created, chat
        self.logprobs, self.decode_one, self.include_usage = logprobs, decode_one, include_usage
        self.offsets: dict[int, int] = {}                # completions' text_offset, per choice

    def _logprobs(self, index: int, pieces: Sequence[Piece]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        entries = [(t, lp) for p in pieces for t, lp in zip(p.tokens, p.logprobs or [None] * len(p.tokens))]
        if self.chat:
            def entry(t: int, lp: float) -> dict[str, Any]:
                text = self.decode_one(t)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**entry(t, lp[0]), "top_logprobs": [entry(a, b) for a, b in lp[1]]}
                                for t, lp in entries if lp is not None]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in entries:
            text = self.decode_one(t)
            out["tokens"].append(text)
            out["text_offset"].append(self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(text)
            out["token_logprobs"].append(None if lp is None else lp[0])
            out["top_logprobs"].append(None if lp is None else
                                       {self.decode_one(a): b for a, b in [*lp[1], (t, lp[0])]})
        return out

    def chunk(self, index: int, piece: Piece | None, finish_reason: str | None, first: bool) -> dict[str, Any]:
        """One stream chunk of choice `index`: piece's text (None: the final chunk, with finish_reason);
        a chat chunk's delta carries the role in the choice's first chunk only."""
        if not (index.__class__ is int and index >= 0 and (piece is None or piece.__class__ is Piece) and
                (finish_reason is None or finish_reason.__class__ is str) and first.__class__ is bool):
            self._refuse_chunk(index, piece, finish_reason, first)          # once per token: checked inline
        text = piece.text if piece is not None else ""
        lps = None if piece is None or self.logprobs is None else self._logprobs(index, [piece])
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}
            out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [choice]}
        else:
            out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason}]}
        if self.include_usage:
            out["usage"] = None
        return out

    @staticmethod
    def _refuse_chunk(index: Any, piece: Any, finish_reason: Any, first: Any) -> None:
        for name, value, ok, must in (
                ("index", index, _is_int(index) and index >= 0, "an integer >= 0"),
                ("piece", piece, piece is None or isinstance(piece, Piece), "a Piece or None (the final chunk)"),
                ("finish_reason", finish_reason, finish_reason is None or isinstance(finish_reason, str), "None or a str"),
                ("first", first, isinstance(first, (bool, np.bool_)), "True or False")):
            if not ok:
                raise (ValueError if name == "index" and _is_int(index) else TypeError)(
                    f"ResponseBuilder.chunk: {name} must be {must}, got {_describe(value)}")

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": usage}

    def response(self, choices: Sequence[tuple[Sequence[Piece], str | None]], usage: dict[str, int]) -> dict[str, Any]:
        """The whole (non-streamed) response: for each choice, its pieces and finish reason."""
        out = []
        for index, (pieces, finish_reason) in enumerate(choices):
            text = "".join(p.text for p in pieces)
            choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                      "logprobs": self._logprobs(index, pieces)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": usage}


class RequestLog:
    """The latencies of the requests a server finished ("length" or "stop"), for /metrics: record(r)
    files r's time to first token, time per output token after it, end-to-end latency and queue
    time (from arrival to its first step) under those names; drain() hands over what was filed since
    the last drain (the /metrics handler adds them to its cumulative histograms, section 5)."""

    NAMES = ("ttft", "tpot", "e2e", "queue")

    def __init__(self) -> None:
        from array import array

        self._array = array
        self.pending = {name: array("d") for name in self.NAMES}
        self.histograms: dict[str, Any] | None = None     # made by render_metrics at the first scrape

    def record(self, request: GenRequest) -> None:
        if request.finish_reason not in ("length", "stop") or not request.token_times:
            return
        times, start = request.token_times, request.arrival
        self.pending["ttft"].append(times[0] - start)
        if len(times) >= 2:
            self.pending["tpot"].append((times[-1] - times[0]) / (len(times) - 1))
        if request.finished_at is not None:
            self.pending["e2e"].append(request.finished_at - start)
        if request.scheduled_at is not None:
            self.pending["queue"].append(max(0.0, request.scheduled_at - start))

    def drain(self) -> dict[str, list[float]]:
        out = {name: values.tolist() for name, values in self.pending.items()}
        self.pending = {name: self._array("d") for name in self.NAMES}
        return out


async def until_disconnected(request: Request, work: "asyncio.Future[Any]") -> bool:
    """Await `work` (a task); True, with work cancelled, if the client disconnects first. After the
    body has been read, the next ASGI receive() returns only when the client goes away
    ("http.disconnect"), so a task waiting on it watches the connection."""
    watch = asyncio.ensure_future(request.receive())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not watch.done():
            watch.cancel()
    if work in done:
        return False
    if watch.result().get("type") == "http.disconnect":
        work.cancel()                                   # a cancelled gather holds a CancelledError: read it,
        work.add_done_callback(lambda f: f.cancelled() or f.exception())   # or asyncio logs "never retrieved"
        return True
    return await until_disconnected(request, work)      # a message that is no disconnect: watch on


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: b"data: " + the JSON of `data` on one line (a str such as "[DONE]" as
    it is) + a blank line, UTF-8."""
    if not isinstance(data, (dict, str)):
        raise TypeError(f"sse_event: data must be a dict (sent as JSON) or a str, got {_describe(data)}")
    if isinstance(data, str) and ("\n" in data or "\r" in data):
        raise ValueError(f"sse_event: data, a str, is sent as it is, on one line; {data[:40]!r} holds a line break")
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode("utf-8")


async def sse_stream(stream: Any, chunk: Callable[[Any, str | None, bool], dict[str, Any]]) -> AsyncIterator[bytes]:
    """The event stream of one choice: for each piece from `stream` (`async for`), as it arrives,
    the event of chunk(piece, None, first); when the stream ends, the event of chunk(None,
    stream.finish_reason, first), then the event "[DONE]". first is True for the first chunk of
    the stream only (the chat format's role goes in it): the first piece's, or the final chunk's
    when no piece came."""
    first = True
    async for piece in stream:
        yield sse_event(chunk(piece, None, first))
        first = False
    yield sse_event(chunk(None, stream.finish_reason, first))
    yield sse_event("[DONE]")


def make_app(engine: Engine, tokenizer: CharTokenizer, model_name: str = "tiny-gpt", api_key: str | None = None,
             allowed_origins: Sequence[str] | None = None, allowed_hosts: Sequence[str] | None = None,
             max_body_bytes: int = 1 << 20, body_timeout: float = 30.0) -> Any:
    """The FastAPI application over `engine`: POST /v1/completions and /v1/chat/completions
    (streamed with sse_stream when "stream": true), GET /v1/models and /v1/models/{id}, /health,
    /metrics (Prometheus text), /stats (JSON for the page) and / (the page); POST
    /reset_prefix_cache (empties the prefix cache and the peak-running counter, as vLLM's endpoint
    of that name); /docs and /openapi.json. The engine's loop starts with the app and stops, after
    draining, when the server shuts down. The front door (server_kit.FrontDoor, section 12): the
    Host header must name one of allowed_hosts (None: this machine's loopback names; ["*"]: any),
    /v1 and /reset_prefix_cache need `Authorization: Bearer <api_key>` when api_key is set, bodies
    over max_bytes get 413 before they are read, a body not read whole within body_timeout
    seconds 408; CORS only for allowed_origins (None: no cross-origin page may call it)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from minitorch.server_kit import PAGE_HTML, add_front_door

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="minitorch server", description="Lesson 15's tiny GPT behind OpenAI's API",
                  lifespan=lifespan)
    app.state.engine, app.state.log = engine, RequestLog()
    add_front_door(app, api_key=api_key, allowed_origins=allowed_origins, allowed_hosts=allowed_hosts,
                   max_body_bytes=max_body_bytes, body_timeout=body_timeout)

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
    decode_one = pieces.__getitem__                                         # a token's text alone

    async def complete(request: Request, chat: bool) -> Any:
        params = check_request(parse_body(await request.body()), chat, model_name, tokenizer, engine.W.block_size)
        loop = asyncio.get_running_loop()
        streams = [TokenStream(loop) for _ in range(params.n)]
        try:
            reqs = engine.add_parallel(params.prompt, params.n, params.max_tokens, params.temperature, params.seed,
                                       [s.push for s in streams], params.sampling)
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(int(exc.retry_after))}) from None
        except RuntimeError as exc:
            raise APIError(503, str(exc), "server_error", code="shutting_down") from None
        texts = [TextStream(s, r, engine, decode_one, StopStrings(params.stop) if params.stop else None, params.echo)
                 for s, r in zip(streams, reqs)]
        build = ResponseBuilder(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model_name, int(time.time()),
                                chat, params.logprobs, decode_one, params.include_usage)

        def usage() -> dict[str, int]:
            done = sum(t.num_tokens for t in texts)
            return {"prompt_tokens": len(params.prompt), "completion_tokens": done,
                    "total_tokens": len(params.prompt) + done}

        def end() -> None:  # the client went away, or the response is complete: free the blocks now
            for r in reqs:
                engine.abort(r)
                app.state.log.record(r)

        if params.stream:
            async def events() -> AsyncIterator[bytes]:
                try:
                    choices = [sse_stream(t, functools.partial(build.chunk, i)) for i, t in enumerate(texts)]
                    if params.n == 1 and not params.include_usage:
                        stream, ready = choices[0], lambda: texts[0].ready
                    else:
                        stream = merge_events(choices, lambda: [sse_event(build.usage_chunk(usage()))]
                                              if params.include_usage else [])
                        ready = lambda: any(t.ready for t in texts)  # noqa: E731
                    async for event in coalesce(stream, ready):
                        yield event
                finally:
                    end()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": build.id})

        async def collect(text: TextStream) -> list[Piece]:
            return [piece async for piece in text]

        work = asyncio.ensure_future(asyncio.gather(*(collect(t) for t in texts)))
        try:
            gone = await until_disconnected(request, work)
        finally:
            end()
        if gone:                                           # nobody to answer (nginx logs this as 499)
            return JSONResponse(APIError(499, "the client closed the connection").body(), status_code=499)
        choices = work.result()
        if any(r.finish_reason == "error" for r in reqs):
            raise APIError(500, f"the engine failed: {type(engine.error).__name__}: {engine.error}", "server_error")
        return JSONResponse(build.response([(c, t.finish_reason) for c, t in zip(choices, texts)], usage()),
                            headers={"X-Request-Id": build.id})

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "minitorch",
                "max_model_len": engine.W.block_size}

    @app.get("/v1/models", response_model=None)
    async def models() -> Any:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str) -> Any:
        if model_id != model_name:
            raise APIError(404, f"the model '{model_id[:80]}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return model_card()

    @app.get("/health", response_model=None)
    async def health() -> Any:  # 503 once the engine cannot serve (a load balancer's signal)
        if not getattr(engine, "alive", True):
            raise APIError(503, "the engine is not taking requests" + (f": {engine.error}" if engine.error else ""),
                           "server_error", code="engine_down")
        return {"status": "ok"}

    @app.post("/reset_prefix_cache", response_model=None)
    async def reset_prefix_cache() -> Any:
        return {"dropped_blocks": engine.reset_prefix_cache()}

    @app.get("/stats", response_model=None)
    async def stats() -> Any:
        return engine.stats()

    @app.get("/metrics", response_class=PlainTextResponse, response_model=None)
    async def metrics() -> Any:
        return PlainTextResponse(render_metrics(engine, app.state.log), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse, response_model=None)
    async def page() -> Any:
        return HTMLResponse(PAGE_HTML.replace("MODEL", json.dumps(model_name)))

    return app


def model_engine(model: Any, dtype: Any, **engine_kw: Any) -> Engine:
    """An Engine over `model`'s weights in `dtype` (engine_kw go to Engine), its fused decode step
    compiled (the first request does not wait for Numba)."""
    engine = Engine(gpt_weights(model, dtype), **engine_kw)
    if engine.decoder is not None:
        engine.decoder.warm_up()
    return engine


def build_server(dtype: Any = np.float32, engine_process: bool = False, app_kw: dict[str, Any] | None = None,
                 **engine_kw: Any) -> tuple[Any, Any]:
    """(engine, app) serving lesson 09's shipped tiny GPT in `dtype`; engine_kw go to Engine, app_kw
    to make_app (api_key, allowed_origins, allowed_hosts, max_body_bytes, body_timeout). With
    engine_process, the engine runs in a process of its own (EngineProcess, section 11)."""
    model, tokenizer = load_tiny_gpt()
    engine = EngineProcess(dtype, **engine_kw) if engine_process else model_engine(model, dtype, **engine_kw)
    return engine, make_app(engine, tokenizer, **(app_kw or {}))


def serve(host: str = "127.0.0.1", port: int = 8000, step_interval: float = 0.02, engine_process: bool = True,
          api_key: str | None = None, allowed_origins: Sequence[str] | None = None,
          allowed_hosts: Sequence[str] | None = None, **engine_kw: Any) -> None:
    """Serve the tiny GPT until Ctrl-C (`make serve`): the first Ctrl-C finishes the requests in
    flight, a second aborts them and stops at once (server_kit.uvicorn_server). step_interval slows
    each step so a lecture can watch the tokens arrive; engine_process: the engine in a process of
    its own (section 11), or in a thread of this one. api_key (default: the environment's
    MINITORCH_API_KEY, as vLLM reads VLLM_API_KEY): the Bearer token /v1 requires; allowed_origins:
    the web pages' origins allowed to call it (CORS); allowed_hosts: the names the Host header may
    give besides the loopback ones and `host` (a server on 0.0.0.0 is reached by other names)."""
    import os

    from minitorch.server_kit import uvicorn_server

    api_key = api_key if api_key is not None else os.environ.get("MINITORCH_API_KEY") or None
    hosts = list(allowed_hosts or ()) + ([host] if host not in ("0.0.0.0", "::", "") else [])
    _, app = build_server(step_interval=step_interval, engine_process=engine_process,
                          app_kw={"api_key": api_key, "allowed_origins": allowed_origins,
                                  "allowed_hosts": ["127.0.0.1", "localhost", "::1", *hosts]}, **engine_kw)
    print(f"minitorch server: open http://{host}:{port}/ (metrics at /metrics, the API's schema at /docs)"
          + ("; /v1 needs the API key" if api_key else "") + "; Ctrl-C stops it")
    try:
        uvicorn_server(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30).run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down gracefully
        pass
    print("minitorch server: stopped")


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m minitorch.server [--host H] [--port P] [--api-key KEY] [--allowed-origins O ...]
    [--allowed-hosts H ...] [--step-interval S] [--thread]`: serve() from the command line, with
    vLLM's names for the options."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m minitorch.server", description="Serve lesson 09's tiny GPT.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1 (vLLM's --api-key)")
    ap.add_argument("--allowed-origins", nargs="*", default=None, help="CORS: origins whose pages may call the API")
    ap.add_argument("--allowed-hosts", nargs="*", default=None, help="Host header names besides the loopback ones")
    ap.add_argument("--step-interval", type=float, default=0.02, help="seconds per engine step, at least")
    ap.add_argument("--thread", action="store_true", help="the engine in a thread of the server, not a process")
    a = ap.parse_args(argv)
    serve(a.host, a.port, a.step_interval, not a.thread, a.api_key, a.allowed_origins, a.allowed_hosts)


if __name__ == "__main__" and globals().get("__spec__") is not None:  # python -m minitorch.server, not a kernel
    import minitorch.server

    minitorch.server.main()


class Histogram:
    """A Prometheus histogram: `buckets`, increasing finite upper bounds; counts of observations
    per bucket, their sum and count."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]):
        for what, text in (("name", name), ("help", help)):
            if not isinstance(text, str) or (what == "name" and not text.replace("_", "a").isalnum()):
                raise ValueError(f"Histogram: {what} must be a str (name: letters, digits and _), got {_describe(text)}")
        if not isinstance(buckets, (list, tuple, np.ndarray)) or not all(_is_number(b) for b in buckets):
            raise ValueError(f"Histogram {name}: buckets must be a sequence of numbers, got {_describe(buckets)}")
        bounds = [float(b) for b in buckets]
        if not bounds or any(b >= c for b, c in zip(bounds, bounds[1:])) or not all(map(math.isfinite, bounds)):
            raise ValueError(f"Histogram {name}: buckets must be increasing finite numbers, got {list(buckets)}")
        self.name, self.help, self.bounds = name, help, bounds
        self.counts = [0] * (len(bounds) + 1)     # the last: above every bound
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        """Count one observation: in the first bucket whose bound is >= value (or above all)."""
        if not _is_number(value) or math.isnan(value):
            raise ValueError(f"Histogram {self.name}: value must be a number, not NaN, got {_describe(value)}")
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


def _check_records(where: str, records: Any) -> None:
    """records must be a list or tuple of dicts with "start" and "token_times" (run_load's)."""
    if not isinstance(records, (list, tuple)) or not all(
            isinstance(r, dict) and "start" in r and "token_times" in r for r in records):
        raise ValueError(f"{where}: records must be a list of dicts with 'start' and 'token_times' (run_load's), "
                         f"got {_describe(records)}")


def latency_stats(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{"ttft" | "tpot" | "itl": {"mean", "p50", "p90", "p99"}} in seconds from records, each a dict
    with "start" (send time) and "token_times" (arrival of each token, increasing); records with
    a "status" other than 200, or no tokens, are left out."""
    _check_records("latency_stats", records)
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
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
HISTOGRAMS = (  # RequestLog's name, the metric's (vLLM's names), help, buckets
    ("ttft", "time_to_first_token_seconds", "Time to first token, from arrival.", LATENCY_BUCKETS),
    ("tpot", "time_per_output_token_seconds", "Time per output token after the first.", LATENCY_BUCKETS),
    ("e2e", "e2e_request_latency_seconds", "From arrival to the last token.", REQUEST_BUCKETS),
    ("queue", "request_queue_time_seconds", "From arrival to the first step that ran it.", REQUEST_BUCKETS))


def render_metrics(engine: Engine, log: RequestLog) -> str:
    """The engine's state in Prometheus text format: gauges (requests running and waiting, KV
    blocks used, cached and total, tokens/s, prefix hit rate), counters (finished requests by
    finish reason; aborted, failed and rejected ones apart), and histograms of the latencies of the
    requests the server finished (HISTOGRAMS, measured inside the server from acceptance). The
    histograms are cumulative over the server's life, as Prometheus requires (a counter that falls
    reads as a restart): each call adds what `log` filed since the last call to the same
    Histograms, kept in log.histograms."""
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
            ("request_aborted_total", "counter", s["aborted"], "Requests aborted (client gone), not counted as success."),
            ("request_failed_total", "counter", s.get("failed", 0), "Requests ended by an error."),
            ("request_rejected_total", "counter", s["rejected"], "Requests refused with 429."),
            ("num_preemptions_total", "counter", s["preemptions"], "Preemptions.")):
        out.append(f"# HELP minitorch_{name} {help}\n# TYPE minitorch_{name} {kind}\nminitorch_{name} {float(value)!r}\n")
    stopped = s.get("stopped", 0)
    out.append("# HELP minitorch_request_success_total Requests finished, by finish reason.\n"
               "# TYPE minitorch_request_success_total counter\n"
               f'minitorch_request_success_total{{finished_reason="length"}} {float(s["finished"] - stopped)!r}\n'
               f'minitorch_request_success_total{{finished_reason="stop"}} {float(stopped)!r}\n')
    if log.histograms is None:
        log.histograms = {key: Histogram(f"minitorch_{name}", help, buckets) for key, name, help, buckets in HISTOGRAMS}
    for key, values in log.drain().items():
        for value in values:
            log.histograms[key].observe(value)
    return "".join(out) + "".join(h.render() for h in log.histograms.values())


def poisson_arrivals(rate: float, n: int, rng: Any = 0) -> np.ndarray:
    """Send times (n,) float64 in seconds from the start of a Poisson process of `rate`
    requests per second: the cumulative sum of n independent exponential gaps of mean 1 / rate,
    drawn from np.random.default_rng(rng); all zeros when rate is inf. rate > 0, n >= 0."""
    if not _is_number(rate) or not rate > 0:
        raise ValueError(f"poisson_arrivals: rate must be a number > 0 (requests per second; inf: all at once), "
                         f"got {_describe(rate)}")
    if not _is_number(n) or not math.isfinite(n) or int(n) != n or n < 0:
        raise ValueError(f"poisson_arrivals: n must be an integer >= 0, got {_describe(n)}")
    if not (_is_int(rng) and rng >= 0 or isinstance(rng, (np.random.Generator, np.random.SeedSequence))):
        raise ValueError(f"poisson_arrivals: rng must be a seed (an integer >= 0) or a np.random.Generator, "
                         f"got {_describe(rng)}")
    if math.isinf(rate):
        return np.zeros(int(n))
    return np.cumsum(np.random.default_rng(rng).exponential(1.0 / rate, int(n)))


def goodput(records: Sequence[dict[str, Any]], duration: float, ttft_slo: float, tpot_slo: float) -> float:
    """Requests per second over `duration` seconds that succeeded (status 200, or no status, and
    at least one token) with TTFT <= ttft_slo and, if they have two or more tokens, TPOT =
    (last - first) / (n - 1) <= tpot_slo (the first token is not counted: it is the TTFT's).
    records as for latency_stats. duration: finite, > 0; an SLO: >= 0 (inf: no bound)."""
    _check_records("goodput", records)
    if not _is_number(duration) or not 0 < duration < math.inf:
        raise ValueError(f"goodput: duration must be a finite number of seconds > 0, got {_describe(duration)}")
    for name, slo in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
        if not _is_number(slo) or not slo >= 0:
            raise ValueError(f"goodput: {name} must be a number of seconds >= 0 (inf: no bound), got {_describe(slo)}")
    good = 0
    for r in records:
        times = list(r["token_times"])
        if r.get("status", 200) != 200 or not times or times[0] - r["start"] > ttft_slo:
            continue
        if len(times) >= 2 and (times[-1] - times[0]) / (len(times) - 1) > tpot_slo:
            continue
        good += 1
    return good / duration


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


def _engine_loop(conn: Any, engine: Engine) -> None:
    requests: dict[int, GenRequest] = {}
    queued: set[int] = set()                       # sent to the engine, not yet admitted
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
        if getattr(request, "owner", None) is not self:
            raise ValueError(f"EngineProcess.abort: {getattr(request, 'id', request)!r} is not a request of this "
                             "engine (a request object from another engine, or not one its add_request returned)")
        if reason not in ("abort", "stop"):
            raise ValueError(f"EngineProcess.abort: reason must be 'abort' or 'stop', got {_describe(reason)}")
        with self.lock:
            if request.finished:
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


from minitorch.checks import (Attrs, Bool, FloatDType, Instance, Int, Number, Optional, Positive, Seq,  # noqa: E402
                              Size, Str, Unchecked, validate_public)

_OWN = Unchecked()          # checked in the body (once per token or per step: a fast path of its own)
_ENGINE = Attrs("add_parallel", "abort", "stats", "reset_prefix_cache", "start", "stop", "W")   # Engine, EngineProcess
_REQUEST = Attrs("prompt", "output", "logprobs", "finish_reason", "token_times")   # a GenRequest (a notebook's too)
validate_public(globals(), {
    "block_hashes": {"tokens": _OWN, "block_size": _OWN},      # _check_ids and its own check: per admission
    "PrefixCache": {"cache": _OWN},
    "PrefixCache.match": {"tokens": _OWN},
    "PrefixCache.admit": {"seq": _OWN, "tokens": _OWN},    # seq: any hashable id, as the paged cache takes
    "PrefixCache.register": {"seq": _OWN, "tokens": _OWN},
    "PrefixCache.evict": {"n": _OWN},
    "Engine": {"W": _OWN, "prefix_caching": _OWN},    # _check_engine_options: by name, before anything is built
    "Engine.add_request": {"sampling": _OWN},        # _check_generation: by its fields (a notebook's class too)
    "Engine.add_parallel": {"sampling": _OWN},
    "Engine.abort": {"request": _OWN, "reason": _OWN},   # another engine's request: its own message
    "Engine.tokens_per_s": {"window": Positive},
    "Engine.stop": {"timeout": Number(0, lo_open=True, finite=False)},
    "parse_body": {"raw": _OWN},
    "check_request": {"body": Instance(dict, must="a JSON object (a dict)"), "context": Size,
                      "tokenizer": Attrs("encode", "decode", "vocab_size")},
    "TokenStream.push": {"token": _OWN}, "TokenStream.deliver": {"token": _OWN},
    "LoopMailbox.put": {"stream": _OWN, "token": _OWN},
    "TextStream": {"request": _REQUEST, "engine": _ENGINE, "stops": Unchecked()},
    "ResponseBuilder": {"created": Int(0), "logprobs": Optional(Int(0, MAX_LOGPROBS))},
    "ResponseBuilder.chunk": {"index": _OWN, "piece": _OWN, "finish_reason": _OWN, "first": _OWN},
    "ResponseBuilder.usage_chunk": {"usage": Instance(dict, must="a dict of token counts")},
    "ResponseBuilder.response": {"usage": Instance(dict, must="a dict of token counts")},
    "RequestLog.record": {"request": _REQUEST},
    "make_app": {"engine": _ENGINE, "allowed_origins": Optional(Seq(Str())), "allowed_hosts": Optional(Seq(Str())),
                 "max_body_bytes": Size, "body_timeout": Positive},
    "model_engine": {"model": Attrs("state_dict", "config"), "dtype": FloatDType(np.float32, np.float64)},
    "build_server": {"dtype": FloatDType(np.float32, np.float64), "app_kw": Optional(Instance(dict))},
    "serve": {"port": Int(0, 65535), "step_interval": Number(0), "allowed_origins": Optional(Seq(Str())),
              "allowed_hosts": Optional(Seq(Str()))},
    "main": {"argv": Optional(Seq(Str()))},
    "Histogram.observe": {"value": Number(finite=False)},      # inf is a (slow) observation: the +Inf bucket
    "render_metrics": {"engine": Attrs("stats"), "log": Attrs("drain", "histograms")},
    "poisson_arrivals": {"rate": Number(0, lo_open=True, finite=False), "rng": _OWN},   # inf: all at once
    "goodput": {"ttft_slo": Number(0, finite=False), "tpot_slo": Number(0, finite=False)},   # inf: no bound
    "sampling_probs": {"logits": _OWN, "params": _OWN, "counts": _OWN},   # checked in the body, by duck type
    "engine_process_main": {"fd": Int(0)},
    "EngineProcess": {"dtype": FloatDType(np.float32, np.float64), "start_timeout": Positive},
    "EngineProcess.add_request": {"sampling": _OWN},
    "EngineProcess.add_parallel": {"sampling": _OWN},
    "EngineProcess.abort": {"request": _OWN, "reason": _OWN},
    "EngineProcess.reset_prefix_cache": {"timeout": Positive},
    "EngineProcess.stop": {"timeout": Number(0, lo_open=True, finite=False)},
})
