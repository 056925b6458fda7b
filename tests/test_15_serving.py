"""Lesson 15: the served tiny GPT: prefix caching, the engine's step, SSE streaming, metrics, load.

Oracles written here, independent of the lesson: lesson 11's reference `generate` (a dense KV
cache, one request alone) for every served output, greedy and seeded; lesson 11's reference
`gpt_forward` (full recomputation) for logits computed on shared prefix blocks; lesson 11's
`paged_forward` for the logits and cache writes of the engine's fused decode step; the chained hash
written out from its definition; NumPy for percentiles and histogram counts; a strict parser of
server-sent events. Servers run on 127.0.0.1 on a free port, in a thread, and are spoken to with
httpx; after every test the KV pool is checked empty. Where an exercise's tests need another
exercise's code (the HTTP tests of 15.3 and 15.4 need an engine), the course's reference
(minitorch.scheduler, engine, metrics, api_server) stands in for it, so each exercise is graded on its own.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import threading
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minitorch.gpt import load_tiny_gpt
from minitorch.kv_cache import PagedKVCache, generate, gpt_forward, load_tiny_weights, paged_forward
from minitorch.serving_kit import ServerThread

pytestmark = pytest.mark.lesson15

W64 = load_tiny_weights(np.float64)
TOK = load_tiny_gpt()[1]


SERVER_MODULES = ("scheduler", "engine", "metrics", "api_server")   # lesson 15's modules with exercises


def ref(lesson):
    """The course's reference server (its modules' names in one namespace): the stand-in for other
    exercises' code. A class release withholds it (course/lessons.json lists the modules): there the
    other exercises are the student's own."""
    from types import SimpleNamespace

    from course.source import release_index

    index = release_index()
    if index is not None and set(SERVER_MODULES) & set(index.get("withheld", {})):
        return lesson
    names: dict = {}
    for module in SERVER_MODULES:
        names.update(vars(importlib.import_module("minitorch." + module)))
    return SimpleNamespace(**names)


def alone(prompt, n, temperature=0.0, seed=0):
    """The oracle: prompt generated alone with lesson 11's dense-cache generate."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in generate(W64, np.asarray(prompt, np.int64), n, temperature=temperature, rng=rng)]


def check_pool_empty(engine):
    assert engine.blocks_used() == 0, f"the pool should hold no request's blocks when idle, {engine.blocks_used()} are held"
    if engine.prefix is not None:
        engine.prefix.clear()
    free, total = engine.cache.num_free, engine.cache.num_blocks
    assert free == total, f"after clearing the prefix cache every block should be free: {free} of {total} are"


def probe(lesson, exercise, engine=None):
    """Call the exercise's code once in the test's own thread, so that an unsolved stub is
    reported as not attempted (inside the server it would only show as a failed request)."""
    if exercise == "15.2":
        engine.schedule()
    elif exercise == "15.3":
        lesson.sse_event("[DONE]")
        if not inspect.isasyncgenfunction(lesson.sse_stream):   # the stub: a coroutine that raises
            in_thread(lambda: asyncio.run(lesson.sse_stream(None, None)))
    elif exercise == "15.4":
        lesson.Histogram("probe", "probe", [1.0]).render()
    elif exercise == "15.6":
        lesson.StopStrings(["probe"]).feed("probe")


@contextmanager
def serving(lesson, engine, exercise):
    """The lesson's app over `engine`, served on a free port; the pool checked empty afterwards."""
    probe(lesson, exercise, engine)
    app = lesson.make_app(engine, TOK, "tiny-gpt")
    srv = ServerThread(app).start()
    try:
        yield srv
    finally:
        srv.stop()
    check_pool_empty(engine)


def prompts_for(n, seed, lo=2, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, W64.vocab_size, int(rng.integers(lo, hi + 1))) for _ in range(n)]


def post_all(url, bodies, path="/v1/completions"):
    """POST every body at once (real concurrency: one connection each); [(status, headers, json)]."""
    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            async def one(body):
                r = await client.post(url + path, json=body)
                return r.status_code, r.headers, r.json()
            return await asyncio.gather(*(one(b) for b in bodies))
    return in_thread(lambda: asyncio.run(main()))


def in_thread(fn):
    """fn() in a fresh thread (asyncio.run cannot run inside a notebook's event loop)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def parse_sse(raw: bytes):
    """Strict server-sent events: events end with a blank line, every line is `data: ...`."""
    assert raw.endswith(b"\n\n"), f"an event stream must end with a blank line; it ends {raw[-40:]!r}"
    events = []
    for block in raw[:-2].split(b"\n\n"):
        lines = block.split(b"\n")
        assert all(line.startswith(b"data: ") for line in lines), f"every line of an event must start 'data: ', got {block!r}"
        events.append(b"\n".join(line[6:] for line in lines).decode("utf-8"))
    return events


# ====================================================================== 15.1 prefix caching
def hash_chain(tokens, bs):
    out, prev = [], 0
    for i in range(len(tokens) // bs):
        prev = hash((prev, tuple(int(t) for t in tokens[i * bs:(i + 1) * bs])))
        out.append(prev)
    return out


@pytest.mark.exercise("15.1")
@settings(max_examples=40)
@given(n=st.integers(0, 40), bs=st.integers(1, 9), seed=st.integers(0, 10))
@example(n=0, bs=4, seed=0)
@example(n=3, bs=4, seed=0)
@example(n=4, bs=4, seed=0)
@example(n=1, bs=1, seed=0)
def test_block_hashes_chain(lesson, n, bs, seed):
    tokens = np.random.default_rng(seed).integers(0, 103, n)
    got = lesson.block_hashes(tokens, bs)
    want = hash_chain(tokens, bs)
    assert list(got) == want, f"block_hashes({tokens.tolist()}, {bs}): expected {want}, got {got}"


@pytest.mark.exercise("15.1")
def test_block_hashes_depend_on_the_prefix(lesson):
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = np.array([9, 2, 3, 4, 5, 6, 7, 8, 1])
    ha, hb = lesson.block_hashes(a, 4), lesson.block_hashes(b, 4)
    assert len(ha) == 2, f"9 tokens in blocks of 4 have 2 full blocks, got {len(ha)} hashes"
    assert ha[1] != hb[1], ("block 1 holds the same tokens (5..8) in both, but after different first blocks: its "
                            "keys differ, so its hash must too (chain each hash on the one before)")


def filled(W, bs, num_blocks, seqs):
    """A reference paged cache holding `seqs` {name: tokens}, computed with paged_forward."""
    cache = PagedKVCache.for_model(W, bs, num_blocks)
    for name, tokens in seqs.items():
        cache.add(name)
        paged_forward(W, cache, [name], [np.asarray(tokens)])
    return cache


@pytest.mark.exercise("15.1")
def test_admit_shares_the_longest_cached_prefix(lesson):
    bs, a = 4, np.arange(13) % 50 + 3
    cache = filled(W64, bs, 16, {"a": a})
    pc = lesson.PrefixCache(cache)
    added = pc.register("a", a)
    assert added == 3, f"a's 13 tokens fill 3 blocks of 4: register should add 3, added {added}"
    assert [cache.allocator.refcount(blk) for blk in cache.tables["a"]] == [2, 2, 2, 1], \
        "each registered block gets one more reference (the prefix cache's); the partial block none"
    b = np.concatenate([a[:9], [7, 70, 1]])
    got = pc.admit("b", b)
    assert got == 8, f"b shares a's first 9 tokens: the 2 full blocks (8 tokens) are cached, admit should return 8, got {got}"
    assert cache.tables["b"] == cache.tables["a"][:2] and cache.lengths["b"] == 8, \
        f"b's table should start with a's 2 first blocks {cache.tables['a'][:2]}, got {cache.tables['b']}"
    assert [cache.allocator.refcount(blk) for blk in cache.tables["a"][:2]] == [3, 3], \
        "a shared block has 3 references: a, the prefix cache and b"
    logits = paged_forward(W64, cache, ["b"], [b[8:]])
    want = gpt_forward(W64, b[None])[0, -1]
    np.testing.assert_allclose(logits[0], want, atol=1e-9,
                               err_msg="b's last logits, computed on a's cached blocks, differ from b computed alone")
    c = np.concatenate([[5], a[1:9]])                      # same second block, different first block
    assert pc.admit("c", c) == 0, "c differs from a in block 0: nothing of a may be reused (the chain)"
    for s in ("a", "b", "c"):
        cache.free(s)
    assert pc.evict(100) == 3 and cache.num_free == 16, "with every sequence gone, evict frees the 3 cached blocks"


@pytest.mark.exercise("15.1")
def test_admit_always_leaves_the_last_token(lesson):
    a = np.arange(8) + 1
    cache = filled(W64, 4, 8, {"a": a})
    pc = lesson.PrefixCache(cache)
    pc.register("a", a)
    got = pc.admit("same", a)
    assert got == 4, ("the same 8-token prompt again: only 1 block (4 tokens) may be reused, the last token must be "
                      f"computed to give the first output's logits; admit returned {got}")
    assert pc.admit("short", a[:1]) == 0 and cache.tables["short"] == [], "a 1-token prompt reuses nothing"


@pytest.mark.exercise("15.1")
def test_evict_least_recently_used_and_only_unheld_blocks(lesson):
    seqs = {"a": np.arange(8) + 1, "b": np.arange(8) + 20, "c": np.arange(8) + 40}
    cache = filled(W64, 4, 10, seqs)
    pc = lesson.PrefixCache(cache)
    for s in ("a", "b", "c"):
        assert pc.register(s, seqs[s]) == 2
        assert pc.register(s, seqs[s]) == 0, "registering the same blocks twice must not add them again"
    assert cache.num_free == 4
    blocks = {s: list(cache.tables[s]) for s in seqs}
    cache.free("a")
    cache.free("b")
    pc.admit("a2", np.concatenate([seqs["a"], [1]]))        # a's blocks are used again: now b's are the oldest
    cache.free("a2")
    freed = pc.evict(2)
    assert freed == 2 and cache.num_free == 6, f"evict(2) should free 2 blocks, freed {freed}"
    gone = [blk for blk in blocks["a"] + blocks["b"] if cache.allocator.refcount(blk) == 0]
    assert sorted(gone) == sorted(blocks["b"]), (f"the least recently used blocks are b's {blocks['b']} (a's were "
                                                 f"reused after), but evict freed {gone}")
    assert pc.evict(10) == 2, "only a's 2 blocks are left to evict: c still holds its own"
    assert all(cache.allocator.refcount(blk) == 2 for blk in blocks["c"]), "blocks a sequence holds are never evicted"
    cache.free("c")
    pc.clear()
    assert cache.num_free == 10


@pytest.mark.exercise("15.1")
def test_block_hashes_dtypes_repeats_and_bad_input(lesson):
    ids = [5, 9, 5, 9, 5, 9, 7]                              # the block (5, 9) three times, then a partial one
    want = hash_chain(ids, 2)
    got = lesson.block_hashes(np.array(ids, np.int64), 2)
    assert list(got) == want, f"block_hashes({ids}, 2): expected {want}, got {got}"
    assert len(set(got)) == 3, ("the same two tokens three times in a row are three different blocks (each after a "
                                f"different prefix): expected 3 distinct hashes, got {got}")
    for kind in (np.int32, np.uint8, list):
        other = lesson.block_hashes(kind(ids) if kind is list else np.array(ids, kind), 2)
        assert list(other) == want, f"the same ids as {kind.__name__} must hash the same: expected {want}, got {other}"
    assert list(lesson.block_hashes([], 3)) == [], "no tokens: no blocks"
    assert list(lesson.block_hashes([4], 1)) == hash_chain([4], 1), "one token in blocks of 1: one block"
    assert list(lesson.block_hashes(ids[:6], 6)) == hash_chain(ids[:6], 6), "exactly one block of 6: one hash"
    assert list(lesson.block_hashes(ids[:5], 6)) == [], "5 tokens in blocks of 6: no full block"
    for bad, size in ((np.array([[1, 2], [3, 4]]), 2), (np.array([1.0, 2.0]), 2), (None, 2), (ids, 0), (ids, -2),
                      (ids, 2.5), (ids, True)):       # a 2-D array, float ids, no ids; block sizes 0, -2, 2.5, True
        with pytest.raises((TypeError, ValueError)):
            lesson.block_hashes(bad, size)


@pytest.mark.exercise("15.1")
def test_prefix_cache_at_its_bounds(lesson):
    bs, a = 4, np.array([1, 2, 3, 4, 1, 2, 3, 4, 9, 9, 9, 9])    # block 1 repeats block 0's tokens
    cache = filled(W64, bs, 10, {"a": a})
    pc = lesson.PrefixCache(cache)
    assert pc.register("a", a) == 3, "3 full blocks, two of them with the same tokens: 3 different chained hashes"
    got = pc.admit("nine", a[:9])
    assert got == 8 and cache.tables["nine"] == cache.tables["a"][:2], \
        (f"a 9-token prompt (2 full blocks + 1 token) may reuse both full blocks: admit should return 8 with a's first "
         f"2 blocks, got {got} with {cache.tables['nine']}")
    got = pc.admit("eight", a[:8])
    assert got == 4, f"an 8-token prompt reuses 1 block: its last token must be computed; admit returned {got}"
    for s in ("a", "nine", "eight"):
        cache.free(s)
    free = cache.num_free
    assert pc.evict(0) == 0 and cache.num_free == free, "evict(0) must free nothing"
    assert pc.evict(3) == 3 and cache.num_free == free + 3, "evict(3) with exactly 3 evictable blocks frees all 3"
    assert pc.evict(1) == 0, "nothing is left to evict"
    assert cache.num_free == 10
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="n must be"):
            pc.evict(bad)
    with pytest.raises(ValueError, match="seq"):
        pc.register("gone", a)                               # freed above: not a sequence of the cache
    with pytest.raises(TypeError, match="PagedKVCache"):
        lesson.PrefixCache(None)


@pytest.mark.exercise("15.1")
def test_engine_shares_prefix_blocks_across_requests(lesson):
    R = ref(lesson)
    eng = R.Engine(W64, num_blocks=24, block_size=4, max_running=4, max_num_batched_tokens=64,
                   prefix_caching=lesson.PrefixCache)
    system = np.array(TOK.encode("You are a helpful Python manual. "))   # 33 tokens: 8 full blocks
    first = eng.add_request(np.concatenate([system, TOK.encode("for")]), 6)
    eng.step()                                               # first's prompt is in the cache
    second = eng.add_request(np.concatenate([system, TOK.encode("while")]), 6)
    eng.step()
    shared = set(eng.cache.tables[first.id]) & set(eng.cache.tables[second.id])
    assert second.num_cached == 32 and len(shared) == 8, \
        f"the second request should start on the first's 8 full system-prompt blocks; cached {second.num_cached} tokens, " \
        f"{len(shared)} blocks shared"
    eng.run_until_idle()
    for r in (first, second):
        assert r.output == alone(r.prompt, 6), "a request served on shared blocks must equal it generated alone"
    assert eng.stats()["prefix_hit_rate"] > 0.4
    check_pool_empty(eng)


# ====================================================================== 15.2 the engine
def run_checked(eng, requests, budget):
    """Step eng until idle, checking every step's plan; the records."""
    records = []
    while eng.has_work():
        in_cache = [r.id for r in eng.running]
        rec = eng.step()
        records.append(rec)
        ids = [i for i, _ in rec["chunks"]]
        assert rec["tokens"] == sum(n for _, n in rec["chunks"]) <= budget, \
            f"step {len(records)} feeds {rec['tokens']} tokens, over the budget of {budget}: {rec['chunks']}"
        assert all(n >= 1 for _, n in rec["chunks"]) and len(set(ids)) == len(ids)
        assert len(ids) <= eng.max_running, f"{len(ids)} requests in one step, max_running is {eng.max_running}"
        kept = [i for i in in_cache if i not in rec["preempted"]]
        planned_old = [i for i in ids if i in in_cache]
        assert ids[:len(planned_old)] == planned_old == kept[:len(planned_old)], \
            (f"step {len(records)}: running requests come first, in admission order ({kept}), then admissions; "
             f"the plan was {rec['chunks']}")
        if rec["preempted"]:
            k = len(rec["preempted"])
            assert all(i in in_cache for i in ids), f"step {len(records)} preempted {rec['preempted']} and still admitted"
            assert sorted(rec["preempted"]) == sorted(in_cache[-k:]), \
                f"preempt the newest running requests first: running were {in_cache}, preempted {rec['preempted']}"
            assert [r.id for r in eng.waiting][:k] == in_cache[-k:], \
                (f"preempted requests go back to the head of the queue in admission order ({in_cache[-k:]}): the "
                 f"queue starts {[r.id for r in eng.waiting][:k]}")
        if len(records) > 5000:
            raise AssertionError(f"the engine did not finish in 5000 steps: {len(eng.waiting)} requests wait, "
                                 f"{len(eng.running)} run, {eng.cache.num_free} of {eng.cache.num_blocks} blocks are free "
                                 "(a request whose blocks fit the free ones exactly must be admitted)")
    return records


@pytest.mark.exercise("15.2")
def test_engine_outputs_equal_each_request_alone(lesson):
    eng = lesson.Engine(W64, num_blocks=16, block_size=4, max_running=6, max_num_batched_tokens=13,
                        prefix_caching=False)
    prompts = prompts_for(14, seed=3, lo=1, hi=40)
    reqs = [eng.add_request(p, int(n)) for p, n in zip(prompts, np.random.default_rng(4).integers(1, 12, 14))]
    sampled = eng.add_request(prompts[0], 9, temperature=0.8, seed=123)
    records = run_checked(eng, reqs + [sampled], 13)
    for r in reqs:
        assert r.output == alone(r.prompt, r.max_tokens), \
            f"{r.id} (prompt of {len(r.prompt)} tokens): served {r.output}, alone {alone(r.prompt, r.max_tokens)}"
    assert sampled.output == alone(prompts[0], 9, 0.8, 123), "a seeded sampled request must give what it gives alone"
    assert sum(len(r["preempted"]) for r in records) > 0, "this pool of 16 blocks is too small for 6: expected preemption"
    assert any(len(r["chunks"]) >= 4 for r in records), "continuous batching: several requests per step"
    check_pool_empty(eng)


@pytest.mark.exercise("15.2")
def test_fused_decode_equals_the_reference_step(lesson):
    """The engine's default fused decode step (given) against lesson 11's paged_forward: the same
    tokens through the engine, and the same logits and cache contents step by step, on random
    weights of odd shapes (grouped KV heads, head_dim 12, blocks of 3 tokens)."""
    from minitorch.kv_cache import random_gpt_weights

    W = random_gpt_weights(vocab_size=37, block_size=41, n_layer=3, n_head=4, n_kv_head=2, n_embd=48, seed=5)
    prompts = [np.random.default_rng(i).integers(0, 37, n) for i, n in enumerate((1, 4, 9, 17))]
    served = {}
    for decode in ("fused", "reference"):
        eng = lesson.Engine(W, num_blocks=60, block_size=3, max_running=4, max_num_batched_tokens=20,
                            prefix_caching=False, decode=decode)
        reqs = [eng.add_request(p, 41 - len(p)) for p in prompts]
        eng.run_until_idle()
        served[decode] = [r.output for r in reqs]
        check_pool_empty(eng)
    assert served["fused"] == served["reference"], \
        f"greedy outputs with the fused step {served['fused']} differ from the reference step's {served['reference']}"
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 2e-5)):
        Wd = W.astype(dtype)
        caches = [PagedKVCache.for_model(Wd, 3, 60) for _ in range(2)]
        rng = np.random.default_rng(7)
        for s, p in enumerate(prompts):
            for c in caches:
                c.add(s)
                paged_forward(Wd, c, [s], [p])
        fused = lesson.FusedDecoder(Wd)
        for step in range(41 - 17):
            tokens = rng.integers(0, 37, len(prompts))
            want = paged_forward(Wd, caches[0], list(range(len(prompts))), [[t] for t in tokens])
            got = fused(caches[1], list(range(len(prompts))), tokens)
            assert got.dtype == dtype and got.shape == want.shape
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < tol, f"{np.dtype(dtype).name} step {step}: fused logits differ from paged_forward's by {err:.2e} (relative)"
        for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol, err_msg="the cache the fused step wrote")


@pytest.mark.exercise("15.2")
def test_chunked_prefill_keeps_decodes_going(lesson):
    eng = lesson.Engine(W64, num_blocks=40, block_size=8, max_running=8, max_num_batched_tokens=16,
                        prefix_caching=False)
    short = [eng.add_request(p, 20) for p in prompts_for(3, seed=5, lo=3, hi=6)]
    eng.step()
    eng.step()
    long = eng.add_request(prompts_for(1, seed=6, lo=45, hi=45)[0], 5)
    chunks = []
    while long.num_computed < len(long.prompt):
        rec = eng.step()
        chunks.append(dict(rec["chunks"]).get(long.id))
        assert all(dict(rec["chunks"]).get(r.id) == 1 for r in short), \
            f"while the long prompt is prefilled, the running decodes must each get a token: {rec['chunks']}"
    assert chunks == [13, 13, 13, 6], (f"the 45-token prompt should be fed in chunks that fill the budget of 16 "
                                       f"beside 3 decodes (13, 13, 13, 6), got {chunks}")
    eng.run_until_idle()
    assert long.output == alone(long.prompt, 5) and all(r.output == alone(r.prompt, 20) for r in short)
    check_pool_empty(eng)


@pytest.mark.exercise("15.2")
@settings(max_examples=12)
@given(seed=st.integers(0, 1000), num_blocks=st.integers(8, 30), budget=st.integers(1, 40),
       max_running=st.integers(1, 8), bs=st.sampled_from([3, 4, 8]))
@example(seed=0, num_blocks=8, budget=1, max_running=1, bs=8)
@example(seed=1, num_blocks=22, budget=40, max_running=8, bs=3)
@example(seed=64, num_blocks=8, budget=3, max_running=3, bs=4)      # two preempted in one step
def test_engine_invariants(lesson, seed, num_blocks, budget, max_running, bs):
    if num_blocks * bs < W64.block_size:
        num_blocks = -(-W64.block_size // bs)
    eng = lesson.Engine(W64, num_blocks=num_blocks, block_size=bs, max_running=max_running,
                        max_num_batched_tokens=budget, prefix_caching=ref(lesson).PrefixCache)
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 103, 30)
    reqs = []
    for _ in range(6):
        p = np.concatenate([base[:int(rng.integers(0, 30))], rng.integers(0, 103, int(rng.integers(1, 8)))])
        reqs.append(eng.add_request(p, int(rng.integers(1, 64 - len(p) + 1)) if len(p) < 60 else 1))
    run_checked(eng, reqs, budget)
    for r in reqs:
        assert r.output == alone(r.prompt, r.max_tokens), f"{r.id}: served {r.output} differs from alone"
    check_pool_empty(eng)


@pytest.mark.exercise("15.2")
def test_abort_frees_blocks_at_once(lesson):
    eng = lesson.Engine(W64, num_blocks=32, block_size=4, prefix_caching=False, step_interval=0.01)
    probe(lesson, "15.2", eng)
    eng.start()
    try:
        got = threading.Event()
        r = eng.add_request(prompts_for(1, seed=8, lo=20, hi=20)[0], 40, on_token=lambda t: got.set())
        assert got.wait(10), "no token in 10 s"
        assert eng.blocks_used() > 0
        eng.abort(r)
        assert eng.blocks_used() == 0 and r.finish_reason == "abort" and len(r.output) < 40
    finally:
        eng.stop()
    check_pool_empty(eng)


W32 = W64.astype(np.float32)
# Prompts whose greedy tokens, to the end of the context, each beat the runner-up by > 0.5 in
# float64: float32's rounding (~1e-4 on these logits) cannot change them on any machine.
CLEAR = ["class A:", "while True:", "x = 1"]


@pytest.mark.exercise("15.2")
def test_engine_at_its_bounds(lesson):
    eng = lesson.Engine(W64, num_blocks=8, block_size=8, max_running=3, max_num_batched_tokens=13,
                        prefix_caching=False)                    # exactly one full context in the pool
    rec = eng.step()
    assert rec["chunks"] == [] and rec["tokens"] == 0 and eng.steps == 1, f"an idle step plans nothing: {rec}"
    exact = eng.add_request(prompts_for(1, seed=30, lo=13, hi=13)[0], 51)     # 13 + 51 = the 64-token context
    rec = eng.step()
    assert rec["chunks"] == [(exact.id, 13)], \
        f"a 13-token prompt with a budget of 13 is prefilled in one chunk of 13, got the plan {rec['chunks']}"
    records = run_checked(eng, [exact], 13)
    assert exact.output == alone(exact.prompt, 51), "a request of the whole context, in a pool of exactly its size"
    assert max(r["blocks_used"] for r in records) == 8, "the request fills the pool to its last block"
    twins = [eng.add_request(TOK.encode("for"), 20, temperature=0.8, seed=5) for _ in range(2)]
    fourth = [eng.add_request(TOK.encode(t), 6) for t in ("a", "b")]
    rec = eng.step()
    assert len(rec["chunks"]) == 3, f"max_running = 3: exactly 3 requests run in the first step, got {rec['chunks']}"
    run_checked(eng, twins + fourth, 13)
    want = alone(TOK.encode("for"), 20, 0.8, 5)
    assert twins[0].output == twins[1].output == want, \
        f"the same seeded request twice in one batch: each gives what it gives alone {want}, got " \
        f"{twins[0].output} and {twins[1].output}"
    assert all(r.output == alone(r.prompt, 6) for r in fourth)
    check_pool_empty(eng)
    want = {t: alone(TOK.encode(t), 64 - len(TOK.encode(t))) for t in CLEAR}
    for W, dtype in ((W32, "float32"), (W64, "float64")):
        eng = lesson.Engine(W, num_blocks=24, block_size=8, max_running=3, max_num_batched_tokens=16,
                            prefix_caching=ref(lesson).PrefixCache)
        reqs = [eng.add_request(TOK.encode(t), 64 - len(TOK.encode(t))) for t in CLEAR]
        run_checked(eng, reqs, 16)
        for r, t in zip(reqs, CLEAR):
            assert r.output == want[t], f"{dtype} weights, prompt {t!r}: the tokens differ from the prompt generated alone"
        check_pool_empty(eng)


@pytest.mark.exercise("15.2")
def test_engine_refuses_bad_settings_when_built(lesson):
    ok = dict(num_blocks=8, block_size=8, prefix_caching=False)
    probe(lesson, "15.2", lesson.Engine(W64, **ok))
    bad = [("num_blocks", 0), ("num_blocks", 7), ("num_blocks", 8.0), ("block_size", 0), ("block_size", "8"),
           ("max_running", 0), ("max_running", 2.5), ("max_running", True), ("max_waiting", -1),
           ("max_num_batched_tokens", 0), ("max_num_batched_tokens", None), ("step_interval", -0.01),
           ("step_interval", math.nan), ("step_interval", math.inf), ("step_interval", "0.1"), ("history", 0),
           ("history", -5), ("decode", "fast"), ("decode", None), ("prefix_caching", "yes"), ("prefix_caching", 3)]
    for name, value in bad:
        with pytest.raises((TypeError, ValueError), match=name if name != "num_blocks" or value != 7 else "cannot hold"):
            lesson.Engine(W64, **{**ok, name: value})
    with pytest.raises(ValueError, match="float16"):
        lesson.Engine(W64.astype(np.float16), **ok)
    with pytest.raises(TypeError, match="GPTWeights"):
        lesson.Engine(W64.params, **ok)
    for W in (W32, W64):                                     # the bounds themselves are accepted
        eng = lesson.Engine(W, num_blocks=8, block_size=8, max_running=1, max_waiting=1, max_num_batched_tokens=1,
                            prefix_caching=False, step_interval=0.0, history=1)
        r = eng.add_request(TOK.encode("x = 1"), 3)
        eng.run_until_idle()
        assert r.output == alone(r.prompt, 3) and list(eng.finished) == [r]
    for call, name in ((lambda: eng.run_until_idle(0), "max_steps"), (lambda: eng.run_until_idle(2.5), "max_steps"),
                       (lambda: eng.tokens_per_s(0), "window"), (lambda: eng.tokens_per_s(math.nan), "window"),
                       (lambda: eng.stop(drain="no"), "drain"), (lambda: eng.stop(timeout=-1), "timeout")):
        with pytest.raises((TypeError, ValueError), match=name):
            call()


@pytest.mark.exercise("15.2")
def test_engine_refuses_bad_requests_by_name(lesson):
    eng = lesson.Engine(W64, num_blocks=16, block_size=8, prefix_caching=False)
    edge = [eng.add_request([0], 63), eng.add_request(np.array([W64.vocab_size - 1], np.int32), 1, seed=0),
            eng.add_request(np.arange(60, dtype=np.uint8), 4, temperature=0)]     # every bound, exactly
    eng.run_until_idle()
    for r in edge:
        assert r.output == alone(r.prompt, r.max_tokens)
    bad = [(dict(prompt=[[1, 2], [3, 4]]), "prompt"), (dict(prompt=[[1, 2], [3]]), "prompt"), (dict(prompt=5), "prompt"),
           (dict(prompt="abc"), "prompt"), (dict(prompt=[1.0, 2.0]), "prompt"), (dict(prompt=[True, False]), "prompt"),
           (dict(prompt=[]), "prompt"), (dict(prompt=[W64.vocab_size]), "prompt"), (dict(prompt=[-1]), "prompt"),
           (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"), (dict(max_tokens=math.nan), "max_tokens"),
           (dict(max_tokens=math.inf), "max_tokens"), (dict(max_tokens="3"), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
           (dict(prompt=[1, 2], max_tokens=63), "context"), (dict(temperature=-0.5), "temperature"),
           (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
           (dict(temperature="0.5"), "temperature"), (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
           (dict(seed="7"), "seed"), (dict(on_token=3), "on_token")]
    for kw, name in bad:
        call = {"prompt": [1, 2, 3], "max_tokens": 4, **kw}
        with pytest.raises((TypeError, ValueError), match=name):
            eng.add_request(**call)
    assert not eng.waiting and not eng.running, "a refused request must not be queued"


@pytest.mark.exercise("15.2")
def test_abort_refuses_another_engines_request(lesson):
    a = lesson.Engine(W64, num_blocks=16, block_size=8, prefix_caching=False)
    b = lesson.Engine(W64, num_blocks=16, block_size=8, prefix_caching=False)
    ra, rb = a.add_request(TOK.encode("def f"), 6), b.add_request(TOK.encode("def f"), 6)
    a.step()
    for engine, other in ((b, ra), (a, rb)):
        with pytest.raises(ValueError, match="another engine"):
            engine.abort(other)
    with pytest.raises(ValueError):
        a.abort(ra.id)                                       # an id is not a request
    a.run_until_idle()
    b.run_until_idle()
    assert ra.finish_reason == rb.finish_reason == "length", \
        f"an abort refused must leave the request running: {ra.finish_reason}, {rb.finish_reason}"
    assert ra.output == rb.output == alone(ra.prompt, 6)
    assert a.abort(ra) is False and a.stats()["aborted"] == b.stats()["aborted"] == 0
    check_pool_empty(a)
    check_pool_empty(b)


@pytest.mark.exercise("15.2")
def test_a_raising_callback_ends_only_its_request(lesson):
    """A client's callback runs in the engine's thread: when it raises, that request ends with
    finish_reason "error" and the batch goes on, in step() itself and in the background loop."""
    class ClientBug(Exception):
        pass

    def boom_at(k):
        seen = []

        def on_token(token):
            seen.append(token)
            if len(seen) == k:
                raise ClientBug("a client's bug")
        return on_token

    eng = lesson.Engine(W64, num_blocks=32, block_size=4, max_running=6, max_num_batched_tokens=16,
                        prefix_caching=ref(lesson).PrefixCache)
    prompts = prompts_for(5, seed=40, lo=3, hi=12)
    plain = eng.add_request(prompts[0], 12)
    raises = eng.add_request(prompts[1], 12, on_token=boom_at(3))
    at_end = eng.add_request(prompts[2], 5, on_token=lambda t: (_ for _ in ()).throw(OSError("gone")) if t is None else None)
    holder = {}
    quits = eng.add_request(prompts[3], 12, on_token=lambda t: len(holder["r"].output) == 2 and eng.abort(holder["r"]))
    holder["r"] = quits
    twin = eng.add_request(prompts[0], 12)
    try:
        eng.run_until_idle()
    except (ClientBug, OSError) as exc:
        raise AssertionError(f"an exception in one request's on_token escaped step(): {exc!r}") from None
    assert raises.finish_reason == "error" and len(raises.output) == 3, \
        f"the request whose callback raised at its 3rd token ends there with 'error': {raises.finish_reason}, " \
        f"{len(raises.output)} tokens"
    assert at_end.finish_reason == "length" and at_end.output == alone(prompts[2], 5)
    assert quits.finish_reason == "abort" and len(quits.output) == 2, "a callback may abort its own request"
    for r in (plain, twin):
        assert r.finish_reason == "length" and r.output == alone(prompts[0], 12), \
            f"{r.id} shares the batch with a failing callback: it must finish as if alone"
    check_pool_empty(eng)
    eng.start()
    try:
        bad = eng.add_request(prompts[4], 20, on_token=boom_at(1))
        good = [eng.add_request(p, 10) for p in prompts[:3]]
        deadline = time.monotonic() + 30
        while not all(r.finished for r in good + [bad]) and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        eng.stop()
    assert bad.finish_reason == "error" and [r.finish_reason for r in good] == ["length"] * 3, \
        f"in the background loop too only the failing request ends: {bad.finish_reason}, {[r.finish_reason for r in good]}"
    assert [r.output for r in good] == [alone(p, 10) for p in prompts[:3]]
    check_pool_empty(eng)


def peak_blocks_and_prefill(records):
    return max(r["blocks_used"] for r in records), sum(n for r in records for _, n in r["chunks"] if n > 1)


@pytest.mark.exercise("15.2")
def test_parallel_sampling_shares_the_prompt_blocks(lesson):
    """n samples of one prompt (add_parallel, given): the prompt is computed once, its blocks are
    shared by the n sequences and the partial one copied on write; each sample is what a request
    with its seed gives alone. Measured against 4 requests: blocks held at the peak and prompt
    tokens computed. Then a pool too small for the group (preemption of forked sequences), and
    aborts before and after the fork."""
    prompt = prompts_for(1, seed=50, lo=30, hi=30)[0]
    runs = {}
    for layout in ("group", "requests"):
        eng = lesson.Engine(W64, num_blocks=48, block_size=8, max_running=8, max_num_batched_tokens=64,
                            prefix_caching=False)
        probe(lesson, "15.2", eng)
        if layout == "group":
            reqs = eng.add_parallel(prompt, 4, 20, temperature=0.9, seed=11)
        else:
            reqs = [eng.add_request(prompt, 20, temperature=0.9, seed=11 + i) for i in range(4)]
        records = run_checked(eng, reqs, 64)
        runs[layout] = peak_blocks_and_prefill(records)
        for i, r in enumerate(reqs):
            assert r.output == alone(prompt, 20, 0.9, 11 + i), \
                f"{layout}: sample {i} must be what the prompt gives alone with seed {11 + i}: {r.output}"
        check_pool_empty(eng)
    assert runs["group"] == (3 + 4 * 3, 30) and runs["requests"] == (4 * 6, 4 * 30), \
        (f"a 30-token prompt in blocks of 8 and 4 samples of 20 tokens (at most 48 tokens cached each, 6 blocks): as "
         f"one group the prompt's 3 full blocks are shared and 30 prompt tokens computed (15 blocks at the peak), as 4 "
         f"requests 24 blocks and 120 tokens; got (peak blocks, prompt tokens) {runs}")
    eng = lesson.Engine(W64, num_blocks=10, block_size=8, max_running=8, max_num_batched_tokens=64,
                        prefix_caching=ref(lesson).PrefixCache)
    greedy = eng.add_parallel(prompt, 3, 34, temperature=0.0)
    records = run_checked(eng, greedy, 64)
    assert sum(len(r["preempted"]) for r in records) > 0, "3 samples of 64 tokens in 10 blocks of 8: preemption"
    assert [r.output for r in greedy] == [alone(prompt, 34)] * 3, "greedy samples, preempted and recomputed: the same"
    check_pool_empty(eng)
    eng = lesson.Engine(W64, num_blocks=32, block_size=8, prefix_caching=False)
    early = eng.add_parallel(prompt, 3, 5)
    assert eng.abort(early[0]) and [r.finish_reason for r in early] == ["abort"] * 3, \
        "before the prompt is computed the group is one request: aborting its first aborts all"
    late = eng.add_parallel(prompt, 3, 12, temperature=0.5, seed=3)
    eng.step()                                              # the prompt, and the first token of each sample
    assert all(len(r.output) == 1 for r in late) and eng.abort(late[1])
    eng.run_until_idle()
    assert [r.finish_reason for r in late] == ["length", "abort", "length"]
    assert [late[0].output, late[2].output] == [alone(prompt, 12, 0.5, 3), alone(prompt, 12, 0.5, 5)]
    check_pool_empty(eng)
    for bad, name in ((dict(n=0), "n"), (dict(n=2.0), "n"), (dict(on_tokens=[None]), "on_tokens"),
                      (dict(on_tokens=3), "on_tokens"), (dict(sampling="x"), "sampling")):
        with pytest.raises((TypeError, ValueError), match=name):
            eng.add_parallel(**{"prompt": prompt, "n": 2, "max_tokens": 3, **bad})


def body(prompt_ids, n, **kw):
    return {"model": "tiny-gpt", "prompt": TOK.decode(prompt_ids), "max_tokens": int(n), "temperature": 0, **kw}


@pytest.mark.exercise("15.2")
@pytest.mark.timeout(120)
def test_http_concurrent_requests_each_equal_alone(lesson):
    eng = lesson.Engine(W64, num_blocks=48, block_size=8, max_running=32, max_num_batched_tokens=64,
                        prefix_caching=False)
    prompts = prompts_for(200, seed=11, lo=1, hi=24)
    ns = np.random.default_rng(12).integers(1, 7, len(prompts))
    bodies = [body(p, n) for p, n in zip(prompts, ns)]
    bodies[5] = {**bodies[5], "temperature": 0.9, "seed": 77}
    bodies[6] = {**bodies[5]}
    with serving(lesson, eng, "15.2") as srv:
        results = post_all(srv.url, bodies)
    for i, ((status, _, js), p, n) in enumerate(zip(results, prompts, ns)):
        assert status == 200, f"request {i}: status {status} {js}"
        t, s = (0.9, 77) if i in (5, 6) else (0.0, 0)
        want = TOK.decode(alone(prompts[5] if i == 6 else p, n, t, s))
        assert js["choices"][0]["text"] == want, f"request {i} among 200 at once: got {js['choices'][0]['text']!r}, alone {want!r}"
        assert js["usage"]["completion_tokens"] == n and js["choices"][0]["finish_reason"] == "length"
    assert eng.stats()["finished"] == 200


@pytest.mark.exercise("15.2")
def test_http_overload_answers_429_and_drops_nobody(lesson):
    eng = lesson.Engine(W64, num_blocks=32, block_size=8, max_running=2, max_waiting=4, prefix_caching=False,
                        step_interval=0.01)
    prompts = prompts_for(30, seed=13, lo=3, hi=10)
    with serving(lesson, eng, "15.2") as srv:
        results = post_all(srv.url, [body(p, 8) for p in prompts])
    statuses = [s for s, _, _ in results]
    # At least the queue's 4 are accepted (more when the engine admits some to its 2 running slots
    # between arrivals, which depends on how fast the HTTP side reads the 30 requests).
    assert set(statuses) <= {200, 429} and statuses.count(429) > 0 and statuses.count(200) >= 4, \
        f"30 requests at once into a queue of 4: expected at least 4 200s and some 429s, got {statuses}"
    for (status, headers, js), p in zip(results, prompts):
        if status == 429:
            assert int(headers["retry-after"]) >= 1 and js["error"]["type"] and js["error"]["message"]
        else:
            assert js["choices"][0]["text"] == TOK.decode(alone(p, 8)), "an accepted request must be served in full"


BAD = [
    (b'{"model": "tiny-gpt", "prompt": "ab", "max_tokens": -1}', 400, "max_tokens"),
    (b'{"model": "tiny-gpt", "max_tokens": 3}', 400, "prompt"),
    (b'{"prompt": "ab"}', 400, "model"),
    (b'{"model": "gpt-7", "prompt": "ab"}', 404, "model"),
    (b'{"model": "tiny-gpt", "prompt": "' + b"a" * 70 + b'", "max_tokens": 1}', 400, "max_tokens"),
    (b'{"model": "tiny-gpt", "prompt": "ab", "max_tokens": 63}', 400, "max_tokens"),
    (b'{"model": "tiny-gpt", "prompt": "ab", "max_tokens": "3"}', 400, "max_tokens"),
    (b'{"model": "tiny-gpt", "prompt": "ab", "temperature": -1}', 400, "temperature"),
    (b'{"model": "tiny-gpt", "prompt": "\xe2\x98\x83"}', 400, "prompt"),
    (b'{"model": "tiny-gpt", "prompt": "ab",', 400, None),
    (b'[1, 2]', 400, None),
    (b'', 400, None),
    (b'{"model": "tiny-gpt", "prompt": "\xff\xfe"}', 400, None),
]


@pytest.mark.exercise("15.2")
def test_http_bad_requests_get_openai_errors(lesson):
    eng = lesson.Engine(W64, num_blocks=32, block_size=8, prefix_caching=False)
    with serving(lesson, eng, "15.2") as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for raw, status, param in BAD:
                r = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
                assert r.status_code == status, f"body {raw!r}: expected {status}, got {r.status_code} {r.text}"
                err = r.json()["error"]
                assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
                assert param is None or err["param"] == param, f"body {raw!r}: error param {err['param']}, expected {param}"
            r = c.post("/v1/chat/completions", json={"model": "tiny-gpt", "messages": [{"role": "robot"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            r = c.post("/v1/completions", json=body(TOK.encode("def f"), 5))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == TOK.decode(alone(TOK.encode("def f"), 5)), \
                f"after the bad requests the server must still serve: {r.status_code} {r.text[:300]}"
            assert c.get("/health").json() == {"status": "ok"}
            models = c.get("/v1/models").json()
            assert models["object"] == "list" and models["data"][0]["id"] == "tiny-gpt"
            chat = c.post("/v1/chat/completions", json={"model": "tiny-gpt", "max_tokens": 4, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "hi"}]}).json()
            assert chat["choices"][0]["message"] == {"role": "assistant",
                                                     "content": TOK.decode(alone(TOK.encode("hi\n\n"), 4))}


def chat_body(content, n, **kw):
    return {"model": "tiny-gpt", "messages": [{"role": "user", "content": content}], "max_tokens": int(n),
            "temperature": 0, **kw}


def oracle_logprobs(tokens, k):
    """The log-probability of each of `tokens` (ids: the prompt, then the output) given the ones before
    it under the tiny GPT (float64, lesson 11's gpt_forward), and the k most likely alternatives."""
    logits = gpt_forward(W64, np.asarray(tokens[:-1])[None])[0].astype(np.float64)
    lp = logits - logits.max(axis=1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
    return [(lp[j - 1, t], sorted(range(W64.vocab_size), key=lambda i: (-lp[j - 1, i], i))[:k], lp[j - 1])
            for j, t in enumerate(tokens) if j]


@pytest.mark.exercise("15.2")
def test_http_honours_openai_parameters(lesson):
    """Through the lesson's app (non-streamed): n samples, a default max_tokens filling the context,
    max_completion_tokens, echo, logprobs (completions and chat), user, seeds as signed 64-bit
    integers, ids unique across restarts, /v1/models/{id}. (Stop strings and the sampling
    parameters beyond temperature are exercise 15.6's, section 7.)"""
    eng = lesson.Engine(W64, num_blocks=48, block_size=8, prefix_caching=False)
    prompt = TOK.encode("The for statement")
    greedy = alone(prompt, 40)
    with serving(lesson, eng, "15.2") as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        js = c.post("/v1/completions", json={**body(prompt, 6), "n": 3, "user": "student-7"}).json()
        assert [ch["text"] for ch in js["choices"]] == [TOK.decode(greedy[:6])] * 3 and \
            [ch["index"] for ch in js["choices"]] == [0, 1, 2] and js["usage"]["completion_tokens"] == 18, js
        js = c.post("/v1/completions", json={**body(prompt, 5, temperature=0.75, seed=-3), "n": 2}).json()
        want = [TOK.decode(alone(prompt, 5, 0.75, 2 ** 64 - 3 + i)) for i in range(2)]
        assert [ch["text"] for ch in js["choices"]] == want, \
            f"n = 2, seed -3 (a signed 64-bit seed, taken mod 2**64): each sample as alone with its seed: {js}"
        long = TOK.encode("x" * 50)
        js = c.post("/v1/completions", json={"model": "tiny-gpt", "prompt": "x" * 50, "temperature": 0}).json()
        assert js["choices"][0]["text"] == TOK.decode(alone(long, 14)) and js["usage"]["completion_tokens"] == 14, \
            f"no max_tokens: a 50-token prompt gets the rest of the 64-token context (14 tokens), got {js}"
        js = c.post("/v1/chat/completions", json={**chat_body("hi", 30), "max_tokens": None,
                                                  "max_completion_tokens": 7}).json()
        assert js["usage"]["completion_tokens"] == 7 and js["id"].startswith("chatcmpl-"), js
        js = c.post("/v1/completions", json=body(prompt, 4, echo=True, logprobs=2)).json()
        lp = js["choices"][0]["logprobs"]
        assert js["choices"][0]["text"] == TOK.decode(prompt) + TOK.decode(greedy[:4]), "echo: the prompt first"
        want = oracle_logprobs(list(prompt) + greedy[:4], 2)
        assert lp["tokens"] == [TOK.decode([t]) for t in list(prompt) + greedy[:4]] and lp["token_logprobs"][0] is None
        assert lp["text_offset"] == list(range(len(prompt) + 4))
        np.testing.assert_allclose(lp["token_logprobs"][1:], [w[0] for w in want], rtol=1e-9,
                                   err_msg="each token's log-probability given the ones before it")
        for got, (sampled, top, row), t in zip(lp["top_logprobs"][1:], want, list(prompt[1:]) + greedy[:4]):
            assert set(got) == {TOK.decode([i]) for i in top} | {TOK.decode([t])}, \
                f"top_logprobs: the 2 most likely tokens and the sampled one, got {got}"
        js = c.post("/v1/chat/completions", json=chat_body("x = 1", 3, logprobs=True, top_logprobs=3)).json()
        content = js["choices"][0]["logprobs"]["content"]
        out = alone(TOK.encode("x = 1\n\n"), 3)
        want = oracle_logprobs(list(TOK.encode("x = 1\n\n")) + out, 3)[-3:]
        assert [e["token"] for e in content] == [TOK.decode([t]) for t in out]
        for e, (sampled, top, row) in zip(content, want):
            assert math.isclose(e["logprob"], sampled, rel_tol=1e-9) and e["bytes"] == list(e["token"].encode())
            assert [a["token"] for a in e["top_logprobs"]] == [TOK.decode([i]) for i in top], e
        ids = {c.post("/v1/completions", json=body(prompt, 1)).json()["id"] for _ in range(3)}
        assert c.get("/v1/models/tiny-gpt").json()["id"] == "tiny-gpt"
        assert c.get("/v1/models/gpt-9").status_code == 404
    eng2 = lesson.Engine(W64, num_blocks=16, block_size=8, prefix_caching=False)   # a "restart": a new engine
    with serving(lesson, eng2, "15.2") as srv:
        ids.add(httpx.post(srv.url + "/v1/completions", json=body(prompt, 1), timeout=30).json()["id"])
    assert len(ids) == 4 and all(i.startswith("cmpl-") and len(i) > 20 for i in ids), \
        f"response ids must be unique, across restarts too (a counter from 0 repeats them): {ids}"


REFUSED = [   # (body fields, the field the 400 must name): not honoured, so refused by name
    ({"top_p": 5}, "top_p"), ({"top_p": 0}, "top_p"), ({"temperature": 2.5}, "temperature"), ({"n": 0}, "n"),
    ({"n": 17}, "n"), ({"n": 1.5}, "n"), ({"seed": 2 ** 63}, "seed"), ({"seed": -2 ** 63 - 1}, "seed"),
    ({"seed": "7"}, "seed"), ({"seed": True}, "seed"), ({"max_tokens": 10 ** 40}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"), ({"stream": "yes"}, "stream"), ({"stop": 5}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"), ({"logprobs": 6}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"logit_bias": {"103": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"top_k": -2}, "top_k"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix"), ({"echo": 1}, "echo"), ({"user": 7}, "user"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"min_p": 0.1}, "min_p"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 2, 500]}, "prompt"),
    ({"prompt": [[[1]]]}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": "x" * 63}, "max_tokens"),
    ({"prompt": "x" * 64, "max_tokens": None}, "prompt"),
]
CHAT_REFUSED = [
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"), ({"echo": True}, "echo"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"), ({"store": True}, "store"),
    ({"audio": {"voice": "x"}}, "audio"), ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages"), ({"messages": []}, "messages"),
]
ACCEPTED = [   # values that ask for nothing: a client library may send them
    {"n": 1}, {"best_of": 1}, {"suffix": ""}, {"top_k": -1}, {"top_k": 0}, {"stream": False}, {"logprobs": None},
    {"user": None}, {"seed": 2 ** 63 - 1}, {"seed": -2 ** 63}, {"stop": []}, {"stop": None}, {"prompt": [5, 6, 7]},
    {"prompt": ["ab"]}, {"logit_bias": {}}, {"top_p": 1}, {"temperature": 2}, {"presence_penalty": 0},
]
CHAT_ACCEPTED = [
    {"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}}, {"store": False},
    {"service_tier": "auto"}, {"modalities": ["text"]}, {"parallel_tool_calls": True}, {"logprobs": False},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    {"safety_identifier": "u-1"}, {"prompt_cache_key": "k"}, {"max_completion_tokens": 2},
]


@pytest.mark.exercise("15.2")
def test_http_refuses_what_it_does_not_honour(lesson):
    """Every parameter is honoured or refused with a 400 that names it; hostile bodies (nesting 100,000
    deep, an integer of 5,000 digits, NaN) are 400s, never 500s; a value that asks for nothing is fine."""
    eng = lesson.Engine(W64, num_blocks=32, block_size=8, prefix_caching=False)
    with serving(lesson, eng, "15.2") as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        for path, base, bad, good in (("/v1/completions", body(TOK.encode("ab"), 2), REFUSED, ACCEPTED),
                                      ("/v1/chat/completions", chat_body("ab", 2), CHAT_REFUSED, CHAT_ACCEPTED)):
            for fields, name in bad:
                r = c.post(path, json={**base, **fields})
                err = r.json().get("error", {})
                assert r.status_code == 400 and err.get("param") == name and err.get("message"), \
                    f"{path} with {fields}: expected a 400 naming '{name}', got {r.status_code} {r.text[:200]}"
            for fields in good:
                r = c.post(path, json={**base, **fields})
                assert r.status_code == 200, f"{path} with {fields}: a value that asks for nothing, got {r.status_code} {r.text[:200]}"
        for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"model": "tiny-gpt", "prompt": "ab", "n": ' + b"9" * 5000 + b"}",
                    b'{"model": "tiny-gpt", "prompt": "ab", "temperature": NaN}',
                    b'{"model": "tiny-gpt", "prompt": "ab", "temperature": 1e400}',
                    b'{"model": "tiny-gpt", "prompt": "ab", "max_tokens": 1e400}',
                    b'{"model": "tiny-gpt", "prompt": {"a": ' * 50 + b"1" + b"}" * 50):
            r = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "Traceback" not in r.text, f"{raw[:60]!r}...: expected 400, got {r.status_code} {r.text[:200]}"
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/openapi.json").status_code == 200 and c.get("/docs").status_code == 200, \
            "/openapi.json and /docs must work"


def leave_early(srv, eng, payload):
    """POST `payload` (not streamed) on a raw connection and close it once the engine runs the request."""
    import socket

    data = json.dumps(payload).encode()
    sock = socket.create_connection((srv.host, srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (srv.host.encode(), srv.port, len(data), data))
    deadline = time.monotonic() + 10
    while eng.stats()["running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.stats()["running"] == 1, "the request never started"
    sock.close()


@pytest.mark.exercise("15.2")
def test_http_client_gone_aborts_a_non_streamed_request(lesson):
    """A client waiting for a whole answer closes its connection: the request is aborted at once
    (its blocks freed), not run to its max_tokens."""
    eng = lesson.Engine(W64, num_blocks=32, block_size=8, prefix_caching=False, step_interval=0.03)
    with serving(lesson, eng, "15.2") as srv:
        leave_early(srv, eng, body(TOK.encode("while True:"), 50))
        deadline = time.monotonic() + 5
        while eng.blocks_used() and time.monotonic() < deadline:
            time.sleep(0.01)
        req = eng.finished[-1] if eng.finished else None
        assert req is not None and req.finish_reason == "abort" and len(req.output) < 50 and eng.blocks_used() == 0, \
            (f"a non-streamed request whose client went away must be aborted and its blocks freed: "
             f"{None if req is None else (req.finish_reason, len(req.output))}, {eng.blocks_used()} blocks held")
        assert eng.stats()["aborted"] == 1


@pytest.mark.exercise("15.2")
def test_http_graceful_shutdown_finishes_in_flight_requests(lesson):
    eng = lesson.Engine(W64, num_blocks=32, block_size=8, prefix_caching=False, step_interval=0.02)
    prompts = prompts_for(4, seed=15, lo=3, hi=8)
    probe(lesson, "15.2", eng)
    app = lesson.make_app(eng, TOK, "tiny-gpt")
    srv = ServerThread(app).start()
    out = {}

    def client(i):
        out[i] = httpx.post(srv.url + "/v1/completions", json=body(prompts[i], 25), timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while eng.stats()["running"] + eng.stats()["waiting"] < 4 and len(out) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    srv.stop()                                              # while all four are generating
    for t in threads:
        t.join(30)
    for i in range(4):
        assert out[i].status_code == 200 and out[i].json()["choices"][0]["text"] == TOK.decode(alone(prompts[i], 25)), \
            f"request {i}, in flight at shutdown, must be finished: {out[i].status_code} {out[i].text[:200]}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)
    assert eng._thread is None, "the engine's loop should have stopped with the server"
    check_pool_empty(eng)


@pytest.mark.exercise("15.2")
def test_http_second_stop_is_immediate(lesson):
    eng = lesson.Engine(W64, num_blocks=32, block_size=8, prefix_caching=False, step_interval=0.05)
    probe(lesson, "15.2", eng)
    srv = ServerThread(lesson.make_app(eng, TOK, "tiny-gpt")).start()
    out = {}

    def client():
        try:
            out["r"] = httpx.post(srv.url + "/v1/completions", json=body(TOK.encode("if x:"), 55), timeout=60)
        except httpx.HTTPError as exc:
            out["r"] = exc

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 20
    while eng.stats()["running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    srv.stop(force=True)                                    # a second Ctrl-C: do not wait for the 55 tokens
    t.join(30)
    req = eng.finished[-1]
    assert req.finish_reason == "abort" and len(req.output) < 55, \
        f"a forced stop must abort the request in flight, not finish it: {req.finish_reason}, {len(req.output)} tokens"
    assert isinstance(out["r"], httpx.HTTPError) or out["r"].status_code != 200 or \
        len(out["r"].json()["choices"][0]["text"]) < 55
    assert eng._thread is None
    check_pool_empty(eng)


# ====================================================================== 15.3 streaming
@pytest.mark.exercise("15.3")
def test_sse_event_bytes(lesson):
    assert lesson.sse_event("[DONE]") == b"data: [DONE]\n\n"
    got = lesson.sse_event({"a": "°x", "b": [1, 2]})
    assert got.startswith(b"data: ") and got.endswith(b"\n\n") and got.count(b"\n") == 2, f"one event: got {got!r}"
    assert json.loads(got[6:-2].decode("utf-8")) == {"a": "°x", "b": [1, 2]}
    tricky = {"text": "a\n\ndata: b\r\n", "n": [], "x": None}      # the separators inside a JSON string
    got = lesson.sse_event(tricky)
    assert parse_sse(got) == [got[6:-2].decode("utf-8")] and json.loads(got[6:-2]) == tricky, \
        f"line breaks inside the data are escaped by JSON: one event, one line; got {got!r}"
    assert lesson.sse_event("") == b"data: \n\n" and lesson.sse_event({}) == b"data: {}\n\n"
    with pytest.raises(ValueError):
        lesson.sse_event("[DONE]\n\ndata: x")                 # a str goes as it is: one line only
    for bad in (None, 3, [1]):
        with pytest.raises(TypeError, match="data"):
            lesson.sse_event(bad)


def stream_events(url, payload, path="/v1/completions"):
    with httpx.stream("POST", url + path, json=payload, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return parse_sse(r.read())


@pytest.mark.exercise("15.3")
def test_stream_one_event_per_token_then_done(lesson):
    eng = ref(lesson).Engine(W64, num_blocks=32, block_size=8)
    prompt = TOK.encode("class Foo")
    with serving(lesson, eng, "15.3") as srv:
        events = stream_events(srv.url, body(prompt, 12, stream=True))
        assert events[-1] == "[DONE]", f"the stream must end with the event [DONE], ended with {events[-1]!r}"
        chunks = [json.loads(e) for e in events[:-1]]
        want = alone(prompt, 12)
        assert [c["choices"][0]["text"] for c in chunks[:-1]] == [TOK.decode([t]) for t in want], \
            "one event per token, carrying that token's text"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["text"] == ""
        assert len({c["id"] for c in chunks}) == 1 and chunks[0]["object"] == "text_completion"
        chat = stream_events(srv.url, {"model": "tiny-gpt", "stream": True, "max_tokens": 5, "temperature": 0,
                                       "messages": [{"role": "user", "content": "x = 1"}]}, "/v1/chat/completions")
        deltas = [json.loads(e)["choices"][0]["delta"] for e in chat[:-1]]
        assert deltas[0]["role"] == "assistant", f"the first chat chunk carries the role: {deltas[0]}"
        assert all("role" not in d for d in deltas[1:]), f"only the first chat chunk carries the role: {deltas}"
        assert "".join(d.get("content", "") for d in deltas) == TOK.decode(alone(TOK.encode("x = 1\n\n"), 5))
        assert chat[-1] == "[DONE]"


class FakeStream:
    """What sse_stream reads: `async for piece in stream`, then stream.finish_reason."""

    def __init__(self, pieces, finish_reason):
        self.pieces, self.finish_reason = list(pieces), finish_reason

    async def __aiter__(self):
        for piece in self.pieces:
            await asyncio.sleep(0)
            yield piece


def stream_of(lesson, pieces, reason, chunk):
    """sse_stream's events for FakeStream(pieces, reason), parsed strictly."""
    async def collect():
        return b"".join([e async for e in lesson.sse_stream(FakeStream(pieces, reason), chunk)])
    return parse_sse(in_thread(lambda: asyncio.run(collect())))


@pytest.mark.exercise("15.3")
def test_sse_stream_role_only_in_the_first_chunk(lesson):
    """OpenAI's chat stream: the first delta carries role "assistant", every later one only its
    content; with no piece at all the final chunk is the first, and carries the role. The chunks
    are the given ResponseBuilder's; the final one gets no piece and the stream's finish_reason."""
    probe(lesson, "15.3")
    R = ref(lesson)
    a, b = TOK.encode("ab")

    def events(tokens, reason, chat):
        build = R.ResponseBuilder("cmpl-7", "tiny-gpt", 0, chat, None, TOK.vocab.__getitem__)
        pieces = [R.Piece(TOK.decode([t]), [int(t)]) for t in tokens]
        return stream_of(lesson, pieces, reason, lambda piece, finish_reason, first: build.chunk(0, piece,
                                                                                               finish_reason, first))

    for tokens, reason in (([], "abort"), ([a], "length"), ([a, a], "stop"), ([a, b, a], "length")):
        got = events(tokens, reason, chat=True)
        assert got[-1] == "[DONE]" and len(got) == len(tokens) + 2, \
            f"{len(tokens)} pieces: one event each, the final chunk and [DONE]; got {got}"
        chunks = [json.loads(e)["choices"][0] for e in got[:-1]]
        deltas = [c["delta"] for c in chunks]
        assert deltas[0].get("role") == "assistant", f"{len(tokens)} pieces: the first delta must carry the role: {deltas}"
        assert all("role" not in d for d in deltas[1:]), \
            f"{len(tokens)} pieces: only the first delta carries the role, later ones only content: {deltas}"
        assert [d.get("content", "") for d in deltas[:-1]] == [TOK.decode([t]) for t in tokens]
        assert [c["finish_reason"] for c in chunks] == [None] * len(tokens) + [reason]
        plain = [json.loads(e)["choices"][0] for e in events(tokens, reason, chat=False)[:-1]]
        assert [c["text"] for c in plain] == [TOK.decode([t]) for t in tokens] + [""]
        assert plain[-1]["finish_reason"] == reason


@pytest.mark.exercise("15.3")
def test_sse_stream_sends_each_piece_as_it_comes(lesson):
    """Pieces of several characters (text held back by a stop string comes out later, together), an
    empty piece, pieces that look like JSON or SSE: one event each, in order, as they come."""
    probe(lesson, "15.3")
    seen, calls = [], []

    class Slow(FakeStream):
        async def __aiter__(self):
            for piece in self.pieces:
                await asyncio.sleep(0)
                seen.append(piece)
                yield piece

    def chunk(piece, finish_reason, first):
        calls.append((piece, finish_reason, first, len(seen)))
        return {"text": None if piece is None else piece, "finish_reason": finish_reason}

    pieces = ["de", "", "f\n\ndata: x", '{"a": 1}', "°"]

    async def collect():
        return [e async for e in lesson.sse_stream(Slow(pieces, "stop"), chunk)]
    events = in_thread(lambda: asyncio.run(collect()))
    assert [json.loads(e[6:-2]) for e in events[:-1]] == [{"text": p, "finish_reason": None} for p in pieces] + \
        [{"text": None, "finish_reason": "stop"}], f"one event per piece, then the final one: got {events}"
    assert [c[3] for c in calls] == [1, 2, 3, 4, 5, 5], \
        f"each piece's chunk is made as soon as that piece arrives, not after the stream ends: {calls}"
    assert [c[2] for c in calls] == [True] + [False] * 5 and events[-1] == b"data: [DONE]\n\n"


@pytest.mark.exercise("15.3")
def test_stream_sends_tokens_as_they_are_generated(lesson):
    eng = ref(lesson).Engine(W64, num_blocks=32, block_size=8, step_interval=0.03)
    with serving(lesson, eng, "15.3") as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body(TOK.encode("import"), 30, stream=True),
                          timeout=30) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            running = eng.stats()["running"]
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(first[6:])["choices"][0]["text"], "the first event should carry the first token"
        assert running == 1, ("when the first token reached the client the request should still be generating (30 tokens "
                              "at 30 ms a step): send each token as it comes, do not wait for the end")
        assert rest[-1] == "data: [DONE]" and len(rest) == 31


@pytest.mark.exercise("15.3")
def test_client_disconnect_frees_blocks(lesson):
    eng = ref(lesson).Engine(W64, num_blocks=32, block_size=8, step_interval=0.03)
    with serving(lesson, eng, "15.3") as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body(TOK.encode("while True:"), 50, stream=True),
                          timeout=30) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data: "))
            assert eng.blocks_used() > 0
        deadline = time.monotonic() + 5
        while eng.blocks_used() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.blocks_used() == 0, "a client that went away mid-stream must have its blocks freed at once"
        req = eng.finished[-1]
        assert req.finish_reason == "abort" and len(req.output) < 50, \
            f"the request should be aborted, not run to its 50 tokens: {req.finish_reason}, {len(req.output)} tokens"
        assert eng.stats()["aborted"] == 1
        r = httpx.post(srv.url + "/v1/completions", json=body(TOK.encode("x"), 3), timeout=30)
        assert r.status_code == 200


def sse_chunks(url, payload, path="/v1/completions"):
    """The JSON chunks of a streamed response (the [DONE] checked and dropped)."""
    events = stream_events(url, payload, path)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1], f"one [DONE], at the end: {events[-3:]}"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.exercise("15.3")
def test_stream_of_n_choices_with_usage_and_logprobs(lesson):
    """n = 2, streamed, stream_options.include_usage: each choice's chunks carry its index, the first
    of each chat choice the role, each choice ends with its own final chunk; then one chunk of usage
    (no choices), then [DONE]; every other chunk has "usage": null. The same texts and
    log-probabilities as the response not streamed."""
    eng = ref(lesson).Engine(W64, num_blocks=32, block_size=8)
    with serving(lesson, eng, "15.3") as srv:
        for path, payload in (("/v1/completions", {**body(TOK.encode("for i in"), 6, temperature=0.8, seed=3,
                                                              logprobs=1), "n": 2}),
                              ("/v1/chat/completions", {**chat_body("x", 5, temperature=0.8, seed=3, logprobs=True,
                                                                    top_logprobs=1), "n": 2})):
            chunks = sse_chunks(srv.url, {**payload, "stream": True, "stream_options": {"include_usage": True}}, path)
            whole = httpx.post(srv.url + path, json=payload, timeout=30).json()
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"], \
                f"{path}: the last chunk before [DONE] carries the usage {whole['usage']}: {chunks[-1]}"
            assert all(c["usage"] is None for c in chunks[:-1]), f"{path}: the other chunks have usage: null"
            for index in (0, 1):
                mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
                assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + ["length"]
                if path.endswith("chat/completions"):
                    assert mine[0]["delta"]["role"] == "assistant" and all("role" not in m["delta"] for m in mine[1:])
                    text = "".join(m["delta"].get("content", "") for m in mine)
                    lps = [e for m in mine if m["logprobs"] for e in m["logprobs"]["content"]]
                    assert lps == whole["choices"][index]["logprobs"]["content"]
                    assert text == whole["choices"][index]["message"]["content"]
                else:
                    assert "".join(m["text"] for m in mine) == whole["choices"][index]["text"]
                    streamed = [x for m in mine if m["logprobs"] for x in m["logprobs"]["token_logprobs"]]
                    assert streamed == whole["choices"][index]["logprobs"]["token_logprobs"]


# ====================================================================== 15.4 metrics
def parse_prometheus(text):
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples, types


@pytest.mark.exercise("15.4")
@settings(max_examples=30)
@given(values=st.lists(st.floats(0, 20, allow_nan=False), max_size=40),
       bounds=st.lists(st.floats(0.001, 15, allow_nan=False), min_size=1, max_size=6, unique=True))
@example(values=[], bounds=[1.0])
@example(values=[0.1, 0.1, 1.0, 2.0], bounds=[0.1, 1.0])
def test_histogram_render(lesson, values, bounds):
    bounds = sorted(bounds)
    h = lesson.Histogram("x_seconds", "Some latency.", bounds)
    for v in values:
        h.observe(v)
    text = h.render()
    assert text.endswith("\n") and "# HELP x_seconds Some latency." in text and "# TYPE x_seconds histogram" in text
    samples, _ = parse_prometheus(text)
    v = np.array(values, dtype=np.float64)
    for b in bounds:
        key = next((k for k in samples if k.startswith("x_seconds_bucket{") and float(k.split('"')[1]) == b), None)
        assert key is not None, f"no bucket line for le={b}:\n{text}"
        assert samples[key] == np.sum(v <= b), \
            f"bucket le={b} must count every observation <= {b} (cumulative): {int(np.sum(v <= b))}, got {samples[key]}"
    assert samples['x_seconds_bucket{le="+Inf"}'] == len(values) == samples["x_seconds_count"]
    assert math.isclose(samples["x_seconds_sum"], float(v.sum()), rel_tol=1e-9, abs_tol=1e-12)
    bucket_lines = [line for line in text.splitlines() if line.startswith("x_seconds_bucket")]
    assert bucket_lines[-1].startswith('x_seconds_bucket{le="+Inf"}') and len(bucket_lines) == len(bounds) + 1


def oracle_stats(records):
    ttft, tpot, itl = [], [], []
    for r in records:
        t = np.array(r["token_times"])
        if r.get("status", 200) != 200 or len(t) == 0:
            continue
        ttft.append(t[0] - r["start"])
        if len(t) > 1:
            tpot.append((t[-1] - t[0]) / (len(t) - 1))
            itl += list(np.diff(t))
    return {k: (np.mean(x), *np.percentile(x, [50, 90, 99])) if x else None
            for k, x in (("ttft", ttft), ("tpot", tpot), ("itl", itl))}


@pytest.mark.exercise("15.4")
@settings(max_examples=25)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 12))
@example(seed=0, n=0)
@example(seed=1, n=1)
def test_latency_stats(lesson, seed, n):
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        k = int(rng.integers(0, 7))
        start = float(rng.uniform(0, 5))
        times = start + rng.uniform(0.01, 0.5) + np.cumsum(np.r_[0, rng.exponential(0.05, max(k - 1, 0))])[:k]
        rec = {"start": start, "token_times": times.tolist()}
        if i % 5 == 4:
            rec["status"] = 429
        records.append(rec)
    got = lesson.latency_stats(records)
    want = oracle_stats(records)
    for key in ("ttft", "tpot", "itl"):
        for j, q in enumerate(("mean", "p50", "p90", "p99")):
            g = got[key][q]
            if want[key] is None:
                assert math.isnan(g), f"{key} {q}: no values, expected NaN, got {g}"
            else:
                assert math.isclose(g, want[key][j], rel_tol=1e-9, abs_tol=1e-12), \
                    f"{key} {q}: expected {want[key][j]:.6f}, got {g}"


@pytest.mark.exercise("15.4")
def test_histogram_bounds_float32_and_ties(lesson):
    empty = lesson.Histogram("e_seconds", "Nothing yet.", [0.5])
    samples, _ = parse_prometheus(empty.render())
    assert samples == {'e_seconds_bucket{le="0.5"}': 0, 'e_seconds_bucket{le="+Inf"}': 0, "e_seconds_sum": 0,
                       "e_seconds_count": 0}, f"an empty histogram renders zeros: {samples}"
    h = lesson.Histogram("t_seconds", "Latency.", np.array([0.1, 0.125, 0.25, 1.0], np.float32).astype(np.float64))
    values = [0.125, 0.25, 0.25, np.float32(0.25), np.float32(0.1), np.float64(1.0), 2, np.float32(0.0625)]
    for v in values:
        h.observe(v)
    text = h.render()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    for key, value in lines.items():
        try:
            float(value)
        except ValueError:
            raise AssertionError(f"{key}: {value!r} is not a number in Prometheus's text format "
                                 "(a NumPy scalar's repr? convert observations with float())") from None
    samples, _ = parse_prometheus(text)
    exact = np.array([float(v) for v in values])             # np.float32(0.1) is 0.10000000149... > 0.1
    for b in (0.1, 0.125, 0.25, 1.0):
        key = next(k for k in samples if k.startswith("t_seconds_bucket{") and math.isclose(float(k.split('"')[1]), b,
                                                                                           rel_tol=1e-6))
        assert samples[key] == np.sum(exact <= float(np.float32(b))), \
            (f"bucket le={b}: observations <= the bound count, those exactly at it included: expected "
             f"{int(np.sum(exact <= float(np.float32(b))))}, got {samples[key]}\n{text}")
    assert samples["t_seconds_count"] == len(values) == samples['t_seconds_bucket{le="+Inf"}']
    assert samples["t_seconds_sum"] == float(exact.sum()), \
        f"the sum of the observations, in float64: {float(exact.sum())!r}, got {samples['t_seconds_sum']!r}"
    for bad in (math.nan, True, None, "0.5"):
        with pytest.raises((TypeError, ValueError), match="value"):
            h.observe(bad)
    assert parse_prometheus(h.render())[0]["t_seconds_count"] == len(values), "a refused observation is not counted"
    for args in ((None, "x", [1.0]), ("x", None, [1.0]), ("x", "x", None), ("x", "x", [1.0, math.nan]), ("x", "x", [])):
        with pytest.raises((TypeError, ValueError)):
            lesson.Histogram(*args)


@pytest.mark.exercise("15.4")
def test_latency_stats_tpot_leaves_out_the_first_token(lesson):
    """Exact binary values: a slow start and a fast decode, one token only, two tokens at the
    same instant, no token, a failure; token times as lists and as float32 and float64 arrays."""
    records = [
        {"start": 0.0, "token_times": [0.5, 0.5625, 0.625]},                          # TTFT 0.5, TPOT 1/16
        {"start": 1.0, "token_times": np.array([1.25, 1.375], np.float32)},           # TTFT 0.25, TPOT 1/8
        {"start": 2.0, "token_times": np.array([2.125, 2.125, 2.5], np.float64)},     # a tie: ITL 0, then 3/8
        {"start": 3.0, "token_times": np.array([3.0625])},                            # one token: no TPOT
        {"start": 4.0, "token_times": np.array([], np.float64)},                       # no token: left out
        {"start": 5.0, "token_times": [5.25, 5.5], "status": 500},                    # failed: left out
    ]
    got = lesson.latency_stats(records)
    want = {"ttft": [0.5, 0.25, 0.125, 0.0625], "tpot": [0.0625, 0.125, 0.1875],
            "itl": [0.0625, 0.0625, 0.125, 0.0, 0.375]}
    for key, values in want.items():
        expect = dict(zip(("mean", "p50", "p90", "p99"), [float(np.mean(values)), *np.percentile(values, [50, 90, 99])]))
        for q, w in expect.items():
            assert isinstance(got[key][q], float) and math.isclose(got[key][q], w, rel_tol=1e-12), \
                (f"{key} {q}: expected {w!r} from {values}, got {got[key][q]!r} (TPOT = (last - first) / (n - 1): the "
                 "first token is the TTFT's, not the decode's)")
    with pytest.raises((TypeError, ValueError), match="records"):
        lesson.latency_stats(None)
    one = lesson.latency_stats([records[3]])
    assert one["ttft"]["p99"] == 0.0625 and all(math.isnan(one[k][q]) for k in ("tpot", "itl") for q in expect), \
        f"one record of one token: a TTFT, and no TPOT or ITL (NaN): {one}"


@pytest.mark.exercise("15.4")
def test_metrics_endpoint(lesson):
    eng = ref(lesson).Engine(W64, num_blocks=32, block_size=8, step_interval=0.01)
    names = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
             "request_queue_time_seconds")
    with serving(lesson, eng, "15.4") as srv:
        post_all(srv.url, [body(p, 4) for p in prompts_for(5, seed=21)])
        r = httpx.get(srv.url + "/metrics", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples, types = parse_prometheus(r.text)
        assert samples["minitorch_num_requests_running"] == 0 and samples["minitorch_kv_blocks_used"] == 0
        assert samples["minitorch_kv_blocks_total"] == 32 and samples["minitorch_generation_tokens_total"] == 20
        for name in names:
            name = "minitorch_" + name
            assert types[name] == "histogram" and samples[name + "_count"] == 5, f"{name}: 5 requests observed"
            assert samples[name + '_bucket{le="+Inf"}'] == 5
        # 3 more, and a client that leaves before its answer: counted apart, never in the latencies
        post_all(srv.url, [body(p, 3) for p in prompts_for(3, seed=22)])
        leave_early(srv, eng, body(TOK.encode("while True:"), 50))
        deadline = time.monotonic() + 5
        while eng.stats()["aborted"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        later, _ = parse_prometheus(httpx.get(srv.url + "/metrics", timeout=30).text)
        for name in names:
            name = "minitorch_" + name
            assert later[name + "_count"] == 8 and later[name + "_sum"] >= samples[name + "_sum"], \
                (f"{name}: a histogram is cumulative, counting only finished requests (5, then 3 more; not the "
                 f"aborted one): {samples[name + '_count']} then {later[name + '_count']}")
        assert later["minitorch_request_aborted_total"] == 1
        assert later['minitorch_request_success_total{finished_reason="length"}'] == 8 and \
            later['minitorch_request_success_total{finished_reason="stop"}'] == 0
        again, _ = parse_prometheus(httpx.get(srv.url + "/metrics", timeout=30).text)
        assert all(again[k] == later[k] for k in later if k.endswith(("_count", "_sum")) or "_bucket{" in k), \
            "a scrape with nothing new changes no histogram"


# ====================================================================== 15.5 load generator
@pytest.mark.exercise("15.5")
@pytest.mark.parametrize("rate", [0.5, 4.0, 37.0])
def test_poisson_arrivals(lesson, rate):
    t = np.asarray(lesson.poisson_arrivals(rate, 20_000, 5))
    assert t.shape == (20_000,) and t.dtype == np.float64
    gaps = np.diff(np.r_[0.0, t])
    assert (gaps >= 0).all() and t[0] > 0, "send times increase from the start, the first after one gap"
    assert abs(gaps.mean() * rate - 1) < 0.03, f"the mean gap should be 1 / rate = {1 / rate:.4g} s, got {gaps.mean():.4g}"
    cv = gaps.std() / gaps.mean()
    assert abs(cv - 1) < 0.04, f"exponential gaps have a coefficient of variation of 1, got {cv:.3f}"
    below = np.mean(gaps < math.log(2) / rate)
    assert abs(below - 0.5) < 0.02, f"half the gaps of a Poisson process are below ln 2 / rate, got {below:.3f}"
    np.testing.assert_array_equal(t, lesson.poisson_arrivals(rate, 20_000, 5), err_msg="same seed, same schedule")
    assert not np.array_equal(t[:50], np.asarray(lesson.poisson_arrivals(rate, 50, 6)))


@pytest.mark.exercise("15.5")
def test_poisson_arrivals_edges(lesson):
    assert np.asarray(lesson.poisson_arrivals(3.0, 0, 1)).shape == (0,)
    np.testing.assert_array_equal(lesson.poisson_arrivals(math.inf, 4, 1), np.zeros(4))
    for bad in ((0.0, 3), (-1.0, 3), (2.0, -1)):
        with pytest.raises(ValueError):
            lesson.poisson_arrivals(*bad, 0)


@pytest.mark.exercise("15.5")
def test_goodput(lesson):
    recs = [
        {"start": 0.0, "token_times": [0.1, 0.2, 0.3]},            # ttft 0.1, tpot 0.1: good
        {"start": 0.0, "token_times": [0.6, 0.65]},                # ttft 0.6: too slow to start
        {"start": 1.0, "token_times": [1.2, 1.5, 1.8, 2.1]},       # tpot 0.3: too slow to decode
        {"start": 1.0, "token_times": [1.45]},                     # one token, ttft 0.45: good
        {"start": 2.0, "token_times": [2.1, 2.3], "status": 200},  # tpot 0.2 (to rounding): good
        {"start": 2.0, "token_times": [], "status": 200},          # no token: failed
        {"start": 2.0, "token_times": [2.05, 2.1], "status": 429}, # rejected
    ]
    got = lesson.goodput(recs, 4.0, ttft_slo=0.5, tpot_slo=0.2)
    assert math.isclose(got, 3 / 4.0), f"3 requests met both SLOs in 4 s: goodput 0.75 requests/s, got {got}"
    assert math.isclose(lesson.goodput(recs, 2.0, ttft_slo=10, tpot_slo=10), 5 / 2.0)
    assert lesson.goodput([], 1.0, 1.0, 1.0) == 0


@pytest.mark.exercise("15.5")
def test_poisson_arrivals_sizes_and_bad_input(lesson):
    for n in (0, 1, 2):
        t = np.asarray(lesson.poisson_arrivals(4.0, n, 3))
        assert t.shape == (n,) and t.dtype == np.float64 and (n == 0 or t[0] > 0), \
            f"n = {n}: expected {n} send times (float64, the first after one gap), got {t!r}"
    for n in (0, 3):
        t = np.asarray(lesson.poisson_arrivals(math.inf, n, 3))
        assert t.dtype == np.float64 and t.shape == (n,) and not t.any(), f"rate inf: {n} zeros (float64), got {t!r}"
    np.testing.assert_array_equal(lesson.poisson_arrivals(np.float32(4.0), 5, 3), lesson.poisson_arrivals(4.0, 5, 3),
                                  err_msg="a float32 rate of 4 is the rate 4")
    np.testing.assert_array_equal(lesson.poisson_arrivals(4.0, np.int64(5), 3), lesson.poisson_arrivals(4.0, 5, 3))
    gen = np.random.default_rng(9)
    first, second = lesson.poisson_arrivals(4.0, 5, gen), lesson.poisson_arrivals(4.0, 5, gen)
    assert not np.array_equal(first, second), "a Generator passed twice goes on drawing: two different schedules"
    for rate, n in ((math.nan, 3), (-math.inf, 3), ("2", 3), (True, 3), (2.0, 2.5), (2.0, math.nan), (2.0, math.inf),
                    (2.0, "3"), (2.0, True)):
        with pytest.raises((TypeError, ValueError), match="rate" if n == 3 else "n must"):
            lesson.poisson_arrivals(rate, n, 0)
    for rng in (None, -1, 1.5, True, "7"):
        with pytest.raises(ValueError, match="rng"):
            lesson.poisson_arrivals(2.0, 3, rng)


@pytest.mark.exercise("15.5")
def test_goodput_at_the_slo_bounds(lesson):
    """Values exact in binary, SLOs TTFT <= 0.25 s and TPOT <= 0.125 s; "<=" counts a request
    exactly at a bound; TPOT leaves out the first token (it is the TTFT's)."""
    f32, f64 = np.float32, np.float64
    recs = [
        {"start": 0.0, "token_times": [0.25, 0.375, 0.5]},                   # both exactly at their bound: good
        {"start": 1.0, "token_times": [1.25]},                               # one token at the TTFT bound: good
        {"start": 2.0, "token_times": [2.2578125]},                          # TTFT 0.2578: too slow to start
        {"start": 3.0, "token_times": [3.25, 3.3125]},                       # slow start, fast decode (1/16): good
        {"start": 4.0, "token_times": [4.0625, 4.3125]},                     # TPOT 0.25: too slow to decode
        {"start": 5.0, "token_times": [5.125, 5.25, 5.3828125]},             # TPOT 0.1289: too slow
        {"start": 6.0, "token_times": np.array([6.25, 6.375], f32), "status": 200},   # float32, at both bounds: good
        {"start": 7.0, "token_times": np.array([7.25, 7.375, 7.5], f64)},    # float64 array: good
        {"start": 8.0, "token_times": np.array([], f64)},                     # no token: failed
        {"start": 9.0, "token_times": [9.0625, 9.125], "status": 500},        # failed
        {"start": 0.0, "token_times": [0.25, 0.375, 0.5]},                   # the first one again: good again
    ]
    slo = {"ttft_slo": 0.25, "tpot_slo": 0.125}
    got = lesson.goodput(recs, 8.0, **slo)
    good = [lesson.goodput([r], 8.0, **slo) * 8 for r in recs]
    assert got == 6 / 8.0, (f"6 of these requests meet both SLOs in 8 s (goodput 0.75 requests/s), got {got}; record by "
                            f"record (1 = counted): {good} where [1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1] was expected")
    assert lesson.goodput(recs, 8.0, ttft_slo=f32(0.25), tpot_slo=f64(0.125)) == got, "SLOs as NumPy floats"
    assert lesson.goodput(recs, 8.0, ttft_slo=math.inf, tpot_slo=math.inf) == 9 / 8.0, "inf: no bound"
    assert lesson.goodput(recs, 8.0, ttft_slo=0.0, tpot_slo=0.125) == 0.0
    assert lesson.goodput(recs[:1], 0.5, **slo) == 2.0 and lesson.goodput([], 2.0, **slo) == 0.0
    for bad in (dict(ttft_slo=math.nan), dict(tpot_slo=math.nan), dict(ttft_slo=-0.25), dict(tpot_slo=-1e-9),
                dict(ttft_slo="0.25"), dict(tpot_slo=None)):
        with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
            lesson.goodput(recs, 8.0, **{**slo, **bad})
    for duration in (0.0, -1.0, math.nan, math.inf, True, None, "8"):
        with pytest.raises((TypeError, ValueError), match="duration"):
            lesson.goodput(recs, duration, **slo)
    with pytest.raises((TypeError, ValueError), match="records"):
        lesson.goodput(None, 8.0, **slo)


# ====================================================================== 15.6 sampling and stop strings
def oracle_probs(logits, t, top_p=1.0, top_k=0, bias=None, presence=0.0, frequency=0.0, counts=None):
    """The sampling distribution written out from its definition, token by token."""
    z = np.array(logits, dtype=np.float64)
    for token, b in (bias or {}).items():
        z[token] += b
    if counts is not None:
        z = z - frequency * counts - presence * (counts > 0)
    if t == 0:
        p = np.zeros(len(z))
        p[int(np.argmax(z))] = 1.0
        return p
    z = z / t
    p = np.exp(z - z.max())
    p = p / p.sum()
    if 0 < top_k < len(p):
        kth = sorted(p, reverse=True)[top_k - 1]
        p = np.where(p >= kth, p, 0.0)
        p = p / p.sum()
    if top_p < 1:
        total, cut = 0.0, None
        for i in sorted(range(len(p)), key=lambda i: (-p[i], i)):
            total += p[i]
            if total >= top_p:
                cut = p[i]
                break
        if cut is not None:
            p = np.where(p >= cut, p, 0.0)
            p = p / p.sum()
    return p


@pytest.mark.exercise("15.6")
@settings(max_examples=60)
@given(seed=st.integers(0, 10_000), v=st.integers(1, 40), t=st.sampled_from([0.0, 0.25, 0.7, 1.0, 1.9]),
       top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]), top_k=st.sampled_from([0, 1, 3, 40]),
       dtype=st.sampled_from([np.float32, np.float64]), pen=st.booleans())
@example(seed=0, v=1, t=1.0, top_p=0.5, top_k=1, dtype=np.float64, pen=False)
@example(seed=1, v=7, t=0.0, top_p=1.0, top_k=0, dtype=np.float32, pen=True)
def test_sampling_probs_against_the_definition(lesson, seed, v, t, top_p, top_k, dtype, pen):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(0, 2, v) * 4).round() / 4                   # quarters: ties happen
    logits = logits.astype(dtype)
    bias = {int(i): float(b) for i, b in zip(rng.integers(0, v, 2), rng.choice([-100.0, -1.5, 2.0, 100.0], 2))}
    counts = rng.integers(0, 3, v) if pen else None
    params = ref(lesson).SamplingParams(top_p=top_p, top_k=top_k, logit_bias=bias, presence_penalty=0.5 if pen else 0.0,
                                        frequency_penalty=-0.25 if pen else 0.0)
    before = logits.copy()
    got = np.asarray(lesson.sampling_probs(logits, t, params, counts))
    want = oracle_probs(logits, t, top_p, top_k, bias, params.presence_penalty, params.frequency_penalty, counts)
    assert got.shape == (v,) and got.dtype == np.float64, f"a float64 distribution over {v} tokens, got {got.dtype} {got.shape}"
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=(
        f"temperature {t}, top_p {top_p}, top_k {top_k}, bias {bias}, penalties {pen}: logits {logits.tolist()}"))
    np.testing.assert_array_equal(logits, before, err_msg="sampling_probs must not change the logits")


@pytest.mark.exercise("15.6")
def test_sampling_probs_ties_bounds_and_bad_input(lesson):
    R = ref(lesson)
    P = R.SamplingParams
    logits = np.array([1.0, 1.0, 0.0, 0.0, -1.0])
    got = lesson.sampling_probs(logits, 1.0, P(top_k=1))
    assert got[0] == got[1] == 0.5 and not got[2:].any(), f"top_k 1 with two tokens tied first: both kept, got {got}"
    got = lesson.sampling_probs(logits, 1.0, P(top_k=3))
    assert (got[:4] > 0).all() and got[4] == 0, f"top_k 3: the tie for third place is kept (4 tokens), got {got}"
    assert np.isclose(got[2], got[3])
    for top_p in (0.05, 0.5):
        got = lesson.sampling_probs(logits, 1.0, P(top_p=top_p))
        assert np.allclose(got, [0.5, 0.5, 0, 0, 0]), \
            f"top_p {top_p}: the first token reaches it, and the one tied with it is kept too: got {got}"
    got = lesson.sampling_probs(logits, 1.0, P(top_p=0.75))
    assert (got[:4] > 0).all() and got[4] == 0, f"top_p 0.75: 0.70 after two tokens, so a third, and its tie: {got}"
    flat = np.zeros(4)
    np.testing.assert_array_equal(lesson.sampling_probs(flat, 1.0, P(top_p=0.5)), np.full(4, 0.25),
                                  err_msg="four tokens at exactly 0.25: top_p 0.5 is reached at the second, all tied")
    got = lesson.sampling_probs(logits, 0.0, P(logit_bias={4: 2.5}))
    assert got.tolist() == [0, 0, 0, 0, 1.0], f"greedy after a bias of 2.5 on token 4 (logit 1.5): token 4, got {got}"
    got = lesson.sampling_probs(logits, 0.0, P())
    assert got.tolist() == [1.0, 0, 0, 0, 0], "greedy with a tie: the lower id"
    got = lesson.sampling_probs(logits, 0.0, P(frequency_penalty=2.0, presence_penalty=-2.0), np.array([3, 0, 0, 1, 0]))
    assert got.tolist() == [0, 1.0, 0, 0, 0], \
        (f"penalties at their bounds: logits - 2 * counts + 2 * (counts > 0) = [-3, 1, 0, 0, -1]: greedy picks "
         f"token 1, got {got}")
    got = lesson.sampling_probs(logits, 0.0, P(frequency_penalty=-2.0, presence_penalty=2.0), np.array([0, 0, 0, 2, 0]))
    assert got.tolist() == [0, 0, 0, 1.0, 0], \
        f"negative frequency penalty: logits + 2 * counts - 2 * (counts > 0) = [1, 1, 0, 2, -1]: token 3, got {got}"
    got = lesson.sampling_probs(logits, 1.0, P(logit_bias={0: -100.0, 1: -100.0}))
    assert got[0] < 1e-40 and got[1] < 1e-40 and math.isclose(got[2:].sum(), 1.0), "a bias of -100 all but bans"
    for bad, name in (((logits.tolist(), 1.0, P()), "logits"), ((logits[None], 1.0, P()), "logits"),
                      ((logits, -0.5, P()), "temperature"), ((logits, math.nan, P()), "temperature"),
                      ((logits, 1.0, None), "params"), ((logits, 1.0, P(), np.zeros(4, int)), "counts"),
                      ((logits, 1.0, P(), -np.ones(5, int)), "counts"), ((logits, 1.0, P(logit_bias={5: 1.0})), "logit_bias")):
        with pytest.raises((TypeError, ValueError), match=name):
            lesson.sampling_probs(*bad)


def oracle_sent(text, stops):
    """(what may be sent of `text` so far, whether a stop string has appeared), from the definition."""
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        return text[:min(hits)], True
    keep = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - keep], False


@pytest.mark.exercise("15.6")
@settings(max_examples=80)
@given(text=st.text("ab\n", max_size=24), cuts=st.lists(st.integers(0, 24), max_size=8),
       stops=st.lists(st.text("ab\n", min_size=1, max_size=4), min_size=1, max_size=4))
@example(text="aaab", cuts=[1, 2, 3], stops=["aab"])
@example(text="xa\n\nb", cuts=[2, 3], stops=["\n\n"])
@example(text="ab", cuts=[], stops=["ab", "b"])
def test_stop_strings_hold_back_exactly_what_might_begin_one(lesson, text, cuts, stops):
    """Fed a token at a time (tokens of any length, empty ones too), the text sent so far is, after
    every token, all that is certain: the text before the earliest stop string, or, while none has
    appeared, everything but the longest end that begins one."""
    edges = sorted(set(c for c in cuts if c <= len(text))) + [len(text)]
    tokens = [text[a:b] for a, b in zip([0] + edges, edges)]
    s = lesson.StopStrings(stops)
    sent = ""
    for i, token in enumerate(tokens):
        sent += s.feed(token)
        want, stopped = oracle_sent("".join(tokens[:i + 1]), stops)
        assert (sent, s.stopped) == (want, stopped), \
            (f"stops {stops}, tokens {tokens[:i + 1]}: after token {i} the text sent should be {want!r} (stopped: "
             f"{stopped}), got {sent!r} (stopped: {s.stopped})")
    final, stopped = oracle_sent(text, stops)
    sent += s.flush()
    assert sent == (final if stopped else text), f"at the end, flush sends what was held back: {sent!r}"


@pytest.mark.exercise("15.6")
def test_stop_strings_several_tokens_and_after_the_stop(lesson):
    s = lesson.StopStrings(["END", "\n\n"])
    got = [s.feed(t) for t in ("x = 1\n", "E", "N", "y", "\n", "\n", "more", "END")]
    assert got == ["x = 1", "\n", "", "ENy", "", "", "", ""] and s.stopped, \
        (f"'\\n' is held (it may begin '\\n\\n') until 'E' shows it does not; 'E', 'N' are held (they may begin "
         f"'END') and go out with 'y'; then '\\n\\n' stops: {got}")
    assert s.flush() == "" and s.feed("z") == "", "after a stop string nothing more is sent"
    s = lesson.StopStrings(("ab",))
    assert [s.feed(t) for t in ("xa", "ba", "b")] == ["x", "", ""] and s.stopped, \
        "a stop string across two tokens: nothing of it is sent, nor what follows it in the same token"
    s = lesson.StopStrings(["°C"])
    assert s.feed("20°") == "20" and s.feed("F") == "°F" and s.flush() == "" and not s.stopped
    s = lesson.StopStrings(["abc"])
    assert s.feed("xxab") == "xx" and s.flush() == "ab", "flush: the held text at the end of a request that did not stop"
    for bad in ([], ["a", ""], "stop", [1], None, ["a"] * 5):
        with pytest.raises((TypeError, ValueError), match="stops"):
            lesson.StopStrings(bad)
    with pytest.raises(TypeError, match="text"):
        lesson.StopStrings(["a"]).feed(5)


@pytest.mark.exercise("15.6")
def test_http_stop_strings_end_requests_as_finished(lesson):
    """Through the lesson's app (its make_app makes a StopStrings per choice): the text before the
    earliest stop string of a request, finish_reason "stop", the stop's tokens counted in the usage;
    one whose first character comes earlier in the text; n = 2 greedy choices, each stopped; the
    engine counts them finished (not aborted) and frees their blocks; no stop string met: "length"."""
    eng = ref(lesson).Engine(W64, num_blocks=32, block_size=8, prefix_caching=False)
    prompt = TOK.encode("The for statement")
    text = TOK.decode(alone(prompt, 40))                        # ' the same is a string the same as are ar'
    i = next(i for i in range(3, len(text) - 3) if text[i] in text[:i] and text[i:i + 3] not in text[:i + 2])
    stop = text[i:i + 3]
    with serving(lesson, eng, "15.6") as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        for stops in (["@@", stop], " is", [stop[1:], stop]):   # the last: two that overlap, the earlier wins
            js = c.post("/v1/completions", json=body(prompt, 40, stop=stops)).json()
            ch = js["choices"][0]
            found = sorted((text.find(s), -len(s)) for s in ([stops] if isinstance(stops, str) else stops) if s in text)
            cut, length = found[0][0], -found[0][1]
            assert ch["text"] == text[:cut] and ch["finish_reason"] == "stop", \
                f"stop {stops!r}: the text before the earliest one, {text[:cut]!r}, and 'stop'; got {js}"
            assert js["usage"]["completion_tokens"] == cut + length, \
                f"the usage counts the tokens generated, the stop string's included: {js['usage']}"
        js = c.post("/v1/completions", json={**body(prompt, 40, stop=[" is"]), "n": 2}).json()
        assert [ch["text"] for ch in js["choices"]] == [text[:text.find(" is")]] * 2 and \
            [ch["finish_reason"] for ch in js["choices"]] == ["stop", "stop"]
        js = c.post("/v1/completions", json=body(prompt, 6, stop=["@@"])).json()
        assert js["choices"][0]["text"] == text[:6] and js["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 5
        while eng.blocks_used() and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = eng.stats()
        assert eng.blocks_used() == 0 and stats["stopped"] == 5 and stats["aborted"] == 0, \
            (f"requests ended by a stop string are finished (not aborted) and their blocks freed: "
             f"{eng.blocks_used()} blocks held, stopped {stats['stopped']}, aborted {stats['aborted']}")


# ====================================================================== the page, in a browser
@pytest.mark.exercise("15.3")
@pytest.mark.timeout(90)
def test_page_streams_tokens_and_shows_the_batch(lesson, test_helper):
    page = test_helper("serving_page")  # tests/serving_page.py
    drive_serving_page, missing = page.drive_serving_page, page.missing

    why = missing()
    if why:
        pytest.skip(f"no browser check: {why}")
    eng = ref(lesson).Engine(W64, num_blocks=32, block_size=8, step_interval=0.05)
    prompt = "def main():"
    want = TOK.decode(alone(TOK.encode(prompt), 40))

    with serving(lesson, eng, "15.3") as srv:
        seen = in_thread(lambda: drive_serving_page(srv.url, prompt, 40, len(want)))
    assert 0 < len(seen["partial"]) < len(want), \
        f"the page should show tokens as they stream: first saw {seen['partial']!r} of {want!r}"
    assert seen["final"] == want, f"the page shows {seen['final']!r}, the model generates {want!r}"
    assert seen["blocks"] > 0 and seen["total"] == 32, f"the panel showed {seen['blocks']} of {seen['total']} KV blocks"
