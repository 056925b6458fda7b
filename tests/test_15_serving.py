"""Lesson 15: the served tiny GPT: prefix caching, the engine's step, SSE streaming, metrics, load.

Oracles written here, independent of the lesson: lesson 11's reference `generate` (a dense KV
cache, one request alone) for every served output, greedy and seeded; lesson 11's reference
`gpt_forward` (full recomputation) for logits computed on shared prefix blocks; lesson 11's
`paged_forward` for the logits and cache writes of the engine's fused decode step; the chained hash
written out from its definition; NumPy for percentiles and histogram counts; a strict parser of
server-sent events. Servers run on 127.0.0.1 on a free port, in a thread, and are spoken to with
httpx; after every test the KV pool is checked empty. Where an exercise's tests need another
exercise's code (the HTTP tests of 15.3 and 15.4 need an engine), the course's reference
(minitorch.server) stands in for it, so each exercise is graded on its own.
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
from minitorch.serve import PagedKVCache, generate, gpt_forward, load_tiny_weights, paged_forward
from minitorch.server_kit import ServerThread

pytestmark = pytest.mark.lesson15

W64 = load_tiny_weights(np.float64)
TOK = load_tiny_gpt()[1]


def ref():
    """The course's reference server module: the stand-in for other exercises' code."""
    return importlib.import_module("minitorch.server")


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
            in_thread(lambda: asyncio.run(lesson.sse_stream(None, None, None)))
    elif exercise == "15.4":
        lesson.Histogram("probe", "probe", [1.0]).render()


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
def test_engine_shares_prefix_blocks_across_requests(lesson):
    R = ref()
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
            assert all(i in in_cache for i in ids), f"step {len(records)} preempted {rec['preempted']} and still admitted"
            assert rec["preempted"] == in_cache[len(in_cache) - len(rec["preempted"]):][::-1], \
                f"preempt the newest running requests first: running were {in_cache}, preempted {rec['preempted']}"
        if len(records) > 5000:
            raise AssertionError("the engine did not finish in 5000 steps")
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
    from minitorch.serve import random_gpt_weights

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
def test_engine_invariants(lesson, seed, num_blocks, budget, max_running, bs):
    if num_blocks * bs < W64.block_size:
        num_blocks = -(-W64.block_size // bs)
    eng = lesson.Engine(W64, num_blocks=num_blocks, block_size=bs, max_running=max_running,
                        max_num_batched_tokens=budget, prefix_caching=ref().PrefixCache)
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


def stream_events(url, payload, path="/v1/completions"):
    with httpx.stream("POST", url + path, json=payload, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return parse_sse(r.read())


@pytest.mark.exercise("15.3")
def test_stream_one_event_per_token_then_done(lesson):
    eng = ref().Engine(W64, num_blocks=32, block_size=8)
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
        assert "".join(d.get("content", "") for d in deltas) == TOK.decode(alone(TOK.encode("x = 1\n\n"), 5))
        assert chat[-1] == "[DONE]"


@pytest.mark.exercise("15.3")
def test_stream_sends_tokens_as_they_are_generated(lesson):
    eng = ref().Engine(W64, num_blocks=32, block_size=8, step_interval=0.03)
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
    eng = ref().Engine(W64, num_blocks=32, block_size=8, step_interval=0.03)
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
def test_metrics_endpoint(lesson):
    eng = ref().Engine(W64, num_blocks=32, block_size=8)
    with serving(lesson, eng, "15.4") as srv:
        post_all(srv.url, [body(p, 4) for p in prompts_for(5, seed=21)])
        r = httpx.get(srv.url + "/metrics", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples, types = parse_prometheus(r.text)
        assert samples["minitorch_num_requests_running"] == 0 and samples["minitorch_kv_blocks_used"] == 0
        assert samples["minitorch_kv_blocks_total"] == 32 and samples["minitorch_generation_tokens_total"] == 20
        for name in ("minitorch_time_to_first_token_seconds", "minitorch_time_per_output_token_seconds"):
            assert types[name] == "histogram" and samples[name + "_count"] == 5, f"{name}: 5 requests observed"
            assert samples[name + '_bucket{le="+Inf"}'] == 5


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
        {"start": 2.0, "token_times": [2.1, 2.3], "status": 200},  # tpot 0.2: good (at the bound)
        {"start": 2.0, "token_times": [], "status": 200},          # no token: failed
        {"start": 2.0, "token_times": [2.05, 2.1], "status": 429}, # rejected
    ]
    got = lesson.goodput(recs, 4.0, ttft_slo=0.5, tpot_slo=0.2)
    assert math.isclose(got, 3 / 4.0), f"3 requests met both SLOs in 4 s: goodput 0.75 requests/s, got {got}"
    assert math.isclose(lesson.goodput(recs, 2.0, ttft_slo=10, tpot_slo=10), 5 / 2.0)
    assert lesson.goodput([], 1.0, 1.0, 1.0) == 0


# ====================================================================== the page, in a browser
@pytest.mark.exercise("15.3")
@pytest.mark.timeout(90)
def test_page_streams_tokens_and_shows_the_batch(lesson):
    from course.browser import drive_serving_page, missing

    why = missing()
    if why:
        pytest.skip(f"no browser check: {why}")
    eng = ref().Engine(W64, num_blocks=32, block_size=8, step_interval=0.05)
    prompt = "def main():"
    want = TOK.decode(alone(TOK.encode(prompt), 40))

    with serving(lesson, eng, "15.3") as srv:
        seen = in_thread(lambda: drive_serving_page(srv.url, prompt, 40, len(want)))
    assert 0 < len(seen["partial"]) < len(want), \
        f"the page should show tokens as they stream: first saw {seen['partial']!r} of {want!r}"
    assert seen["final"] == want, f"the page shows {seen['final']!r}, the model generates {want!r}"
    assert seen["blocks"] > 0 and seen["total"] == 32, f"the panel showed {seen['blocks']} of {seen['total']} KV blocks"
