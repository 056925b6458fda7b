"""Lesson 15's EngineProcess: the engine in a process of its own behind the same HTTP layer
(serve()'s default). What a served model must not do holds across the process boundary too:
lose or mix up requests under concurrency, keep a gone client's blocks, drop a request it
accepted, hang when the engine process dies, or start with settings the engine refuses."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minitorch.gpt import load_tiny_gpt  # noqa: E402
from minitorch.kv_cache import gpt_weights  # noqa: E402
from minitorch.api_server import build_server  # noqa: E402
from minitorch.engine import Engine, EngineProcess  # noqa: E402
from minitorch.serving_kit import ServerThread  # noqa: E402

MODEL, TOK = load_tiny_gpt()
W = gpt_weights(MODEL, np.float32)


def body(prompt: str, max_tokens: int, stream: bool = False, **kw) -> dict:
    return {"model": "tiny-gpt", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **kw}


def alone(prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> str:
    """The text generating this prompt alone gives, on an in-thread Engine."""
    eng = Engine(W, num_blocks=16, block_size=8)
    req = eng.add_request(TOK.encode(prompt), max_tokens, temperature, seed)
    eng.run_until_idle()
    return TOK.decode(req.output)


@contextmanager
def serving(**engine_kw):
    engine, app = build_server(np.float32, engine_process=True, **engine_kw)
    try:
        with ServerThread(app) as srv:
            yield engine, srv.url
    finally:
        if engine.process.poll() is None:
            engine.process.kill()


def stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=10).json()


def wait_until(check, what: str, timeout: float = 10.0) -> None:
    """Wait for check() to hold, up to `timeout` seconds on the reference machine (x course.timing's
    scale, measured here: make check runs this beside the lessons, on a loaded machine)."""
    from course.timing import time_scale

    limit = timeout * max(1.0, time_scale()) * 2
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"{what() if callable(what) else what} (waited {limit:.0f} s)"
        time.sleep(0.02)


def post(url: str, payload: dict) -> tuple[int, dict, dict]:
    r = httpx.post(url + "/v1/completions", json=payload, timeout=120)
    return r.status_code, dict(r.headers), r.json()


def streamed_text(url: str, payload: dict) -> str:
    import json

    text = []
    with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


@pytest.mark.timeout(240)
def test_concurrent_requests_equal_generating_each_alone():
    rng = np.random.default_rng(3)
    words = ["def ", "class ", "The ", "for ", "while ", "import ", "return ", "lambda ", "x = ", "if "]
    prompts = ["".join(rng.choice(words, int(rng.integers(1, 4)))) for _ in range(200)]
    lengths = [int(rng.integers(4, 20)) for _ in prompts]
    with serving(num_blocks=64, block_size=8, max_running=16) as (engine, url):
        with ThreadPoolExecutor(200) as pool:  # 200 at once: 100 plain, 100 streamed
            plain = pool.map(lambda pl: post(url, body(*pl)), zip(prompts[:100], lengths[:100]))
            streamed = pool.map(lambda pl: streamed_text(url, body(*pl, stream=True)), zip(prompts[100:], lengths[100:]))
            plain, streamed = list(plain), list(streamed)
            sampled = list(pool.map(lambda p: post(url, {**body(p, 12), "temperature": 0.8, "seed": 7})[2],
                                    prompts[:6]))
        for (status, _, js), p, n in zip(plain, prompts, lengths):
            assert status == 200 and js["choices"][0]["text"] == alone(p, n), f"prompt {p!r}: mixed up or lost"
        for text, p, n in zip(streamed, prompts[100:], lengths[100:]):
            assert text == alone(p, n), f"streamed prompt {p!r}"
        for js, p in zip(sampled, prompts):
            assert js["choices"][0]["text"] == alone(p, 12, 0.8, 7), "a seeded sampled request is reproducible"
        wait_until(lambda: stats(url)["kv_blocks_used"] == 0 and stats(url)["running"] == 0,
                   "the pool must return to empty when idle")


@pytest.mark.timeout(120)
def test_client_disconnect_frees_blocks_in_the_engine_process():
    with serving(num_blocks=32, block_size=8, step_interval=0.03) as (engine, url):
        with httpx.stream("POST", url + "/v1/completions", json=body("while True:", 50, stream=True),
                          timeout=30) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: stats(url)["kv_blocks_used"] == 0, "a client that went away must have its blocks freed",
                   timeout=5)
        req = engine.finished[-1]
        assert req.finish_reason == "abort" and len(req.output) < 50
        wait_until(lambda: stats(url)["aborted"] == 1, "the engine counts the abort")
        assert post(url, body("x", 3))[0] == 200


@pytest.mark.timeout(120)
def test_overload_answers_429_and_serves_every_accepted_request():
    with serving(num_blocks=32, block_size=8, max_running=2, max_waiting=4, prefix_caching=False,
                 step_interval=0.01) as (engine, url):
        prompts = [f"def f{i}(x):" for i in range(30)]
        with ThreadPoolExecutor(30) as pool:
            results = list(pool.map(lambda p: post(url, body(p, 8)), prompts))
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 429} and statuses.count(429) > 0 and statuses.count(200) >= 4, statuses
        for (status, headers, js), p in zip(results, prompts):
            if status == 429:
                assert int(headers["retry-after"]) >= 1 and js["error"]["type"] == "rate_limit_error"
            else:
                assert js["choices"][0]["text"] == alone(p, 8), "an accepted request must be served in full"
        assert stats(url)["rejected"] == statuses.count(429)


@pytest.mark.timeout(120)
def test_a_dead_engine_process_ends_requests_with_an_error_and_refuses_new_ones():
    with serving(num_blocks=32, block_size=8, step_interval=0.05) as (engine, url):
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, url, body("class A:", 40))
            wait_until(lambda: stats(url)["running"] == 1, "the request starts")
            engine.process.kill()
            status, _, js = pending.result(timeout=20)
        assert status == 500 and "engine" in js["error"]["message"], (status, js)
        status, _, js = post(url, body("x", 3))
        assert status == 503 and js["error"]["code"] == "shutting_down", (status, js)
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_down", health.text


def test_stats_are_there_from_the_start_and_refused_settings_raise_here():
    engine = EngineProcess(num_blocks=16, block_size=8)
    try:  # the page and /metrics may ask before the first step: stats are there from the start
        assert engine.stats()["kv_blocks_total"] == 16 and engine.stats()["running"] == 0
        other = Engine(W, num_blocks=16, block_size=8)          # an abort goes to the request's own engine only
        theirs, mine = other.add_request(TOK.encode("x = 1"), 4), engine.add_request(TOK.encode("x = 1"), 4)
        with pytest.raises(ValueError, match="another engine"):
            engine.abort(theirs)
        with pytest.raises(ValueError, match="another engine"):
            other.abort(mine)
        other.run_until_idle()
        wait_until(lambda: mine.finished, "the request whose foreign abort was refused runs on", timeout=20)
        assert mine.finish_reason == theirs.finish_reason == "length" and mine.output == theirs.output
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="cannot hold one request"):
        EngineProcess(num_blocks=1, block_size=8)
    with pytest.raises(ValueError, match="max_waiting"):
        EngineProcess(max_waiting=0)


@pytest.mark.parametrize("settings, name", [
    (dict(dtype=np.float16), "float16"), (dict(num_blocks=0), "num_blocks"), (dict(num_blocks=1), "cannot hold"),
    (dict(block_size="8"), "block_size"), (dict(max_running=2.5), "max_running"), (dict(max_waiting=True), "max_waiting"),
    (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"), (dict(step_interval=float("nan")), "step_interval"),
    (dict(history=0), "history"), (dict(decode="fast"), "decode"), (dict(prefix_caching="yes"), "prefix_caching"),
    (dict(speed=2), "speed"), (dict(start_timeout=0), "start_timeout")])
def test_refused_settings_raise_before_a_process_starts(monkeypatch, settings, name):
    """The engine's settings are checked in the server's process, by name, before the engine
    process starts (the model's load and the kernel's compilation would come first otherwise)."""
    import subprocess

    def no_process(*args, **kw):
        raise AssertionError(f"an engine process was started for the settings {settings}, which the engine refuses")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises((TypeError, ValueError), match=name):
        EngineProcess(**{"num_blocks": 16, "block_size": 8, **settings})


@pytest.mark.timeout(120)
def test_stop_drains_then_a_forced_stop_aborts():
    engine = EngineProcess(num_blocks=32, block_size=8, step_interval=0.02)
    done = []
    req = engine.add_request(TOK.encode("import os"), 10, on_token=lambda t: done.append(t))
    engine.stop(drain=True, timeout=30)
    assert req.finish_reason == "length" and len(req.output) == 10 and done[-1] is None
    assert engine.process.poll() is not None
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.add_request(TOK.encode("x"), 2)
    engine = EngineProcess(num_blocks=32, block_size=8, step_interval=0.2)
    req = engine.add_request(TOK.encode("import os"), 40)
    t0 = time.monotonic()
    engine.stop(drain=False, timeout=30)
    assert time.monotonic() - t0 < 10 and req.finish_reason == "abort" and len(req.output) < 40


@pytest.mark.timeout(120)
def test_the_page_streams_and_shows_the_batch_of_the_engine_process(test_helper):
    """`make serve`'s layout in headless Chromium, as a lecturer opens it: tokens appear as they
    stream, and the panel (polled from /stats, which the engine process feeds) shows the batch."""
    page = test_helper("serving_page")  # tests/serving_page.py
    drive_serving_page, missing = page.drive_serving_page, page.missing

    why = missing()
    if why:
        pytest.skip(f"no browser check: {why}")
    prompt = "def main():"
    want = alone(prompt, 40)
    with serving(num_blocks=32, block_size=8, step_interval=0.05) as (engine, url):
        with ThreadPoolExecutor(1) as pool:  # Playwright's sync API may not run inside an event loop's thread
            seen = pool.submit(drive_serving_page, url, prompt, 40, len(want)).result(timeout=110)
    assert 0 < len(seen["partial"]) < len(want), f"tokens should appear as they stream: {seen['partial']!r}"
    assert seen["final"] == want and seen["blocks"] > 0 and seen["total"] == 32, seen


FLAKY = '''
from minitorch.scheduler import PrefixCache

class FlakyPrefixCache(PrefixCache):
    """Raises when a prompt starting with token 0 is admitted: a step that fails, on purpose."""
    def admit(self, seq, tokens):
        if int(tokens[0]) == 0:
            raise RuntimeError("a planted bug in a step")
        return super().admit(seq, tokens)
'''


@pytest.mark.timeout(120)
def test_a_step_that_raises_fails_its_requests_and_the_engine_keeps_serving(tmp_path, monkeypatch):
    (tmp_path / "flaky_prefix.py").write_text(FLAKY)
    monkeypatch.syspath_prepend(str(tmp_path))  # the engine process gets this process's sys.path
    from flaky_prefix import FlakyPrefixCache

    engine = EngineProcess(num_blocks=32, block_size=8, prefix_caching=FlakyPrefixCache)
    try:
        bad = engine.add_request(np.array([0, 5, 6]), 5)
        wait_until(lambda: bad.finished, "the request whose step raises ends", timeout=20)
        assert bad.finish_reason == "error" and "planted bug" in str(engine.error)
        assert engine.alive, "one failed step must not take the engine down (the in-thread Engine keeps serving)"
        good = engine.add_request(TOK.encode("import os"), 6)
        wait_until(lambda: good.finished, "the next request ends", timeout=20)
        assert good.finish_reason == "length" and TOK.decode(good.output) == alone("import os", 6)
        assert engine.reset_prefix_cache() >= 0
    finally:
        engine.stop()


@pytest.mark.timeout(120)
def test_slow_motion_holds_under_traffic_and_a_raising_callback_ends_only_its_request():
    """step_interval is a floor on each step even while commands arrive (a lecture's slow motion);
    a callback that raises ends its own request, not the reader thread."""
    engine = EngineProcess(num_blocks=32, block_size=8, step_interval=0.2)
    try:
        def boom(token):
            if token is not None:
                raise ValueError("a callback that raises")

        victim = engine.add_request(TOK.encode("class A:"), 5, on_token=boom)
        steady = engine.add_request(TOK.encode("import os"), 8)
        t0, steps0 = time.monotonic(), engine.stats()["steps"]
        while time.monotonic() - t0 < 1.0:  # a command every 20 ms
            engine.abort(engine.add_request(TOK.encode("x"), 2))
            time.sleep(0.02)
        steps = engine.stats()["steps"] - steps0
        assert steps <= 7, f"{steps} steps in 1 s with step_interval = 0.2 s: commands cut the interval short"
        wait_until(lambda: steady.finished, "the steady request ends", timeout=30)
        assert victim.finish_reason == "error" and steady.finish_reason == "length" and engine.alive
    finally:
        engine.stop()


@pytest.mark.timeout(60)
def test_stop_finishes_every_request_and_can_run_twice():
    """A request the engine never saw (one racing with stop) still ends, with "abort"; two stops
    from two threads (a second Ctrl-C during a drain) both return."""
    from minitorch.scheduler import GenRequest

    engine = EngineProcess(num_blocks=32, block_size=8)
    ended = []
    orphan = GenRequest("cmpl-x", np.array([1, 2]), 3, on_token=ended.append)
    with engine.lock:
        engine._requests[10**6], engine._numbers[orphan] = orphan, 10**6
    with ThreadPoolExecutor(2) as pool:
        stops = [pool.submit(engine.stop, drain) for drain in (True, False)]
        for f in stops:
            f.result(timeout=30)
    assert orphan.finish_reason == "abort" and ended == [None] and not engine.alive
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.add_request(TOK.encode("x"), 2)


@pytest.mark.timeout(120)
def test_the_openai_parameters_cross_the_process_boundary():
    """n samples sharing the prompt's blocks, stop strings (the engine process ends the request as
    finished, not aborted), logprobs and echo's prompt logprobs, sampling parameters, queue times
    and the metrics: the same answers as the engine in a thread."""
    payloads = [
        body("The for statement", 12, n=3, temperature=0.9, seed=4),
        body("The for statement", 40, stop=[" is", "@@"]),
        body("ab", 4, echo=True, logprobs=2),
        body("x = 1", 10, temperature=1.1, seed=9, top_p=0.8, top_k=7, presence_penalty=1.0, frequency_penalty=-0.5,
             logit_bias={"5": 4.0}),
    ]
    answers = {}
    for layout in ("process", "thread"):
        # 20 ms steps (serve()'s default), as served: an engine that reaches max_tokens before the front
        # end finds the stop string relabels the request when it hears (the test after this one)
        engine, app = build_server(np.float32, engine_process=layout == "process", num_blocks=48, block_size=8,
                                   step_interval=0.02)
        try:
            with ServerThread(app) as srv:
                answers[layout] = [httpx.post(srv.url + "/v1/completions", json=p, timeout=60).json() for p in payloads]
                chunks = []
                with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                                  json={**payloads[1], "stream": True}) as r:
                    chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
                answers[layout].append("".join(__import__("json").loads(c[6:])["choices"][0]["text"]
                                               for c in chunks[:-1]))
                wait_until(lambda: stats(srv.url)["stopped"] == 2 and stats(srv.url)["kv_blocks_used"] == 0,
                           lambda: f"the stopped requests are finished and their blocks freed ({layout}): "
                                   f"{ {k: v for k, v in stats(srv.url).items() if isinstance(v, (int, float))} }")
                assert stats(srv.url)["aborted"] == 0
                metrics = httpx.get(srv.url + "/metrics", timeout=30).text
                assert "\nminitorch_request_queue_time_seconds_count 7\n" in metrics, \
                    f"7 sequences finished (3 samples and 4 requests), each with its queue time: {metrics[-300:]}"
        finally:
            if layout == "process" and engine.process.poll() is None:
                engine.process.kill()
    process, thread = answers["process"], answers["thread"]
    for a, b in zip(process[:-1], thread[:-1]):
        for x, y in zip(a["choices"], b["choices"]):
            assert x["text"] == y["text"] and x["finish_reason"] == y["finish_reason"]
            if x["logprobs"]:
                np.testing.assert_allclose([v for v in x["logprobs"]["token_logprobs"] if v is not None],
                                           [v for v in y["logprobs"]["token_logprobs"] if v is not None], rtol=1e-5)
        assert a["usage"] == b["usage"]
    assert process[1]["choices"][0]["finish_reason"] == "stop" and process[-1] == process[1]["choices"][0]["text"]
    assert len({c["text"] for c in process[0]["choices"]}) > 1, "3 samples at temperature 0.9 differ"


@pytest.mark.timeout(120)
def test_a_stop_found_after_the_length_ended_a_request_counts_as_stopped():
    """An engine running ahead of its front end can end a request by max_tokens before the front end
    has read the tokens that hold a stop string; the front end's abort(request, "stop") then relabels
    it: the request, the engine's counters and /metrics say "stop", as the client is told."""
    for engine in (Engine(W, num_blocks=16, block_size=8), EngineProcess(num_blocks=16, block_size=8)):
        try:
            req = engine.add_request(TOK.encode("import os"), 4)
            other = engine.add_request(TOK.encode("def f"), 3)
            if isinstance(engine, Engine):
                while engine.has_work():
                    engine.step()
            wait_until(lambda: req.finished and other.finished, "both requests end by length")
            assert req.finish_reason == other.finish_reason == "length"
            before = engine.stats()
            assert engine.abort(req, "stop") is False, "the request had ended: abort says so"
            assert engine.abort(other, "abort") is False and other.finish_reason == "length", \
                "a client gone after the end changes nothing"
            assert req.finish_reason == "stop"
            wait_until(lambda: engine.stats()["stopped"] == before["stopped"] + 1,
                       lambda: f"the engine should count the late stop: {engine.stats()}")
            after = engine.stats()
            assert after["finished"] == before["finished"] and after["aborted"] == before["aborted"], (before, after)
            assert engine.abort(req, "stop") is False and engine.stats()["stopped"] == after["stopped"], \
                "counted once"
        finally:
            if isinstance(engine, EngineProcess):
                engine.stop(drain=False, timeout=30)
