# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.scheduler: the scheduling half of lesson 15's engine (vLLM's Scheduler and its
KV cache manager): the requests the engine serves (GenRequest, SamplingParams, QueueFull),
prefix caching over lesson 11's paged KV cache (block_hashes, PrefixCache), and Scheduler, the
policy that picks each step's chunks under a token budget (chunked prefill), preempting and
admitting. It runs no model: minitorch.engine's Engine is a Scheduler that does."""
from __future__ import annotations

import math
import numbers
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minitorch.kv_cache import GPTWeights, PagedKVCache

FUSED_CHUNK_MAX = 32   # longer prefill chunks go through paged_forward (BLAS), shorter ones the fused step
MAX_LOGPROBS = 20      # the most alternatives a token's log-probabilities may list (OpenAI's top_logprobs bound)
MAX_STOP = 4           # stop strings per request (OpenAI's bound)


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


def _check_abort(engine: Any, request: Any, reason: Any) -> None:
    """The arguments of an engine's abort (Engine's or EngineProcess's): a request that engine's
    add_request returned, and reason "abort" or "stop"; a ValueError naming the engine otherwise."""
    who = f"{type(engine).__name__}.abort"
    if getattr(request, "owner", None) is not engine:
        raise ValueError(f"{who}: {getattr(request, 'id', request)!r} is not a request of this engine "
                         "(a request object from another engine, or not one its add_request returned)")
    if reason not in ("abort", "stop"):
        raise ValueError(f"{who}: reason must be 'abort' or 'stop', got {_describe(reason)}")


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


class Scheduler:
    """The scheduling policy of the engine (vLLM's Scheduler.schedule): which requests the next
    step feeds, and how many of their tokens. It holds the paged KV cache (lesson 11's
    PagedKVCache) with its prefix cache, the waiting queue (GenRequests, first come first served)
    and the running requests (in admission order), and runs no model: Engine (minitorch.engine)
    is a Scheduler that runs the plan.

    W: the model's weights (the cache's shape, the context); num_blocks blocks of block_size
    tokens; at most max_running requests in the cache; at most max_num_batched_tokens tokens fed
    per step; prefix_caching on or off, or a class to use for it (PrefixCache's interface)."""

    def __init__(self, W: GPTWeights, num_blocks: int = 64, block_size: int = 8, max_running: int = 32,
                 max_num_batched_tokens: int = 48, prefix_caching: Any = True):
        if not (isinstance(prefix_caching, bool) or callable(prefix_caching)):
            raise TypeError(f"Scheduler: prefix_caching must be True, False or a class like PrefixCache, "
                            f"got {prefix_caching!r}")
        self.W = W
        self.cache = PagedKVCache.for_model(W, block_size, num_blocks)
        kind = PrefixCache if prefix_caching is True else prefix_caching
        self.prefix = kind(self.cache) if kind else None
        self.max_running = int(max_running)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.waiting: deque[GenRequest] = deque()
        self.running: list[GenRequest] = []
        self.counters = {"preemptions": 0}   # the engine's counters (Engine adds its own)

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


from minitorch.checks import Size, Unchecked, validate_public  # noqa: E402

_OWN = Unchecked()          # checked in the body (once per token or per step: a fast path of its own)
validate_public(globals(), {
    "block_hashes": {"tokens": _OWN, "block_size": _OWN},      # _check_ids and its own check: per admission
    "PrefixCache": {"cache": _OWN},
    "PrefixCache.match": {"tokens": _OWN},
    "PrefixCache.admit": {"seq": _OWN, "tokens": _OWN},    # seq: any hashable id, as the paged cache takes
    "PrefixCache.register": {"seq": _OWN, "tokens": _OWN},
    "PrefixCache.evict": {"n": _OWN},
    "Scheduler": {"W": _OWN, "num_blocks": Size, "block_size": Size, "max_running": Size,
                  "max_num_batched_tokens": Size, "prefix_caching": _OWN},   # Engine checks them by name first
})
