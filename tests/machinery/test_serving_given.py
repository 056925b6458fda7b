"""Lesson 15's given code that no exercise test calls directly (minitorch.api_server, engine,
scheduler, metrics, serving_kit, fused_decode): the request log and the metrics it feeds, the
response builder, the front door's pieces (the Host parser, the middleware's settings, the guarded
protocol, uvicorn's server), the server builders,
the load generator's workload and the decode benchmark, each on a small case; and the streams'
inline refusals (the walk cannot replay them: they live in an event loop). Each test checks what
the function promises, and feeds the validation walk a call to replay."""

from __future__ import annotations

import asyncio
import math
import os
import types

import numpy as np
import pytest

pytest.importorskip("uvicorn")

from minitorch.gpt import load_tiny_gpt  # noqa: E402
from minitorch.kv_cache import load_tiny_weights, random_gpt_weights  # noqa: E402
from minitorch.api_server import (Piece, RequestLog, ResponseBuilder, TokenStream, build_server,  # noqa: E402
                                  chat_prompt, check_request, parse_body)
from minitorch.engine import Engine, model_engine  # noqa: E402
from minitorch.fused_decode import decode_speeds, print_decode_speeds  # noqa: E402
from minitorch.metrics import render_metrics  # noqa: E402
from minitorch.scheduler import GenRequest, PrefixCache, SamplingParams  # noqa: E402
from minitorch.serving_kit import (FrontDoor, ServerProcess, ServerThread, abort_engine, add_front_door,  # noqa: E402
                                   default_max_connections, guarded_protocol, host_name, process_threads, run_load,
                                   sample_workload, uvicorn_server)

MODEL, TOK = load_tiny_gpt()
W64 = load_tiny_weights(np.float64)


def finished(request_id: str, reason: str, times: list[float], arrival: float = 10.0, scheduled: float = 10.25,
             end: float | None = None) -> GenRequest:
    r = GenRequest(request_id, np.array([1, 2]), 4, arrival=arrival, finish_reason=reason, scheduled_at=scheduled)
    r.token_times, r.finished_at = list(times), end if end is not None else (times[-1] if times else None)
    return r


def test_request_log_and_cumulative_metrics():
    log = RequestLog()
    log.record(finished("a", "length", [10.5, 10.625, 10.75]))         # TTFT 0.5, TPOT 0.125, e2e 0.75, queue 0.25
    log.record(finished("b", "stop", [11.0], arrival=10.0, scheduled=10.0))
    log.record(finished("c", "abort", [10.5, 10.6]))                    # aborted: not a latency of the server's
    log.record(finished("d", "length", []))                             # no token: nothing to time
    eng = Engine(W64, num_blocks=16, block_size=8, prefix_caching=False)
    text = render_metrics(eng, log)
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["minitorch_time_to_first_token_seconds_count"]) == 2
    assert float(values["minitorch_time_to_first_token_seconds_sum"]) == 1.5
    assert float(values["minitorch_time_per_output_token_seconds_sum"]) == 0.125
    assert float(values["minitorch_e2e_request_latency_seconds_sum"]) == 1.75
    assert float(values["minitorch_request_queue_time_seconds_sum"]) == 0.25
    assert log.drain() == {name: [] for name in RequestLog.NAMES}, "render_metrics drains the log"
    log.record(finished("e", "length", [12.0, 12.5]))
    again = dict(line.rsplit(" ", 1) for line in render_metrics(eng, log).splitlines() if line[:1] != "#")
    assert float(again["minitorch_time_to_first_token_seconds_count"]) == 3, "cumulative across scrapes"
    for bad in (None, "x"):
        with pytest.raises(TypeError, match="request"):
            log.record(bad)
    with pytest.raises(TypeError, match="log"):
        render_metrics(eng, None)


def test_response_builder_and_the_request_helpers():
    build = ResponseBuilder("cmpl-1", "tiny-gpt", 5, False, 1, TOK.vocab.__getitem__, include_usage=True)
    a, b = TOK.encode("ab")
    piece = Piece("ab", [int(a), int(b)], [(-0.5, [(int(a), -0.5)]), (-0.25, [(int(b), -0.25)])])
    chunk = build.chunk(0, piece, None, True)
    assert chunk["choices"][0]["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25],
                                               "top_logprobs": [{"a": -0.5}, {"b": -0.25}], "text_offset": [0, 1]}
    assert chunk["usage"] is None and build.usage_chunk({"prompt_tokens": 1})["choices"] == []
    whole = build.response([([piece], "length")], {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4})
    assert whole["choices"][0]["text"] == "ab" and whole["object"] == "text_completion"
    for bad, name in (((-1, piece, None, True), "index"), ((0, "ab", None, True), "piece"),
                      ((0, piece, 3, True), "finish_reason"), ((0, piece, None, 1), "first")):
        with pytest.raises((TypeError, ValueError), match=name):
            build.chunk(*bad)
    assert chat_prompt([{"role": "user", "content": [{"type": "text", "text": "a"}]}, {"role": "user", "content": "b"}]) \
        == "a\n\nb\n\n"
    with pytest.raises(TypeError, match="messages"):
        chat_prompt(None)
    params = check_request(parse_body(b'{"model": "m", "prompt": "ab", "n": 2, "stop": "x", "seed": -1}'), False, "m",
                           TOK, 64)
    assert (params.n, params.stop, params.seed, params.max_tokens) == (2, ("x",), 2 ** 64 - 1, 62)
    with pytest.raises(TypeError, match="raw"):
        parse_body("{}")
    with pytest.raises(ValueError, match="context"):
        check_request({"model": "m", "prompt": "ab"}, False, "m", TOK, 0)
    pc = PrefixCache(Engine(W64, num_blocks=16, block_size=4, prefix_caching=False).cache)
    assert pc.match(np.arange(9)) == [] and pc.num_cached == 0


def test_the_streams_refuse_bad_tokens_inline():
    async def main():
        stream = TokenStream(asyncio.get_running_loop())
        for bad in ("3", 2.5, [1]):
            with pytest.raises(TypeError, match="token"):
                stream.push(bad)
        with pytest.raises(TypeError, match="token"):
            stream.deliver("x")
        stream.push(7)
        stream.push(None)
        return [t async for t in stream]
    assert asyncio.run(main()) == [7]


def test_front_door_pieces():
    assert [host_name(h) for h in ("localhost:8000", "[::1]:80", "example.org", "::1")] == \
        ["localhost", "::1", "example.org", "::1"]
    with pytest.raises(TypeError, match="header"):
        host_name(None)
    for kw, name in ((dict(allowed_hosts="localhost"), "allowed_hosts"), (dict(api_key=""), "api_key"),
                     (dict(max_body_bytes=0), "max_body_bytes"), (dict(body_timeout=math.inf), "body_timeout")):
        with pytest.raises((TypeError, ValueError), match=name):
            FrontDoor(None, **kw)
    door = FrontDoor(None, allowed_hosts=["example.org"], api_key="k", max_body_bytes=10, body_timeout=2.0)
    assert door.hosts == {"example.org"} and not door.any_host

    from fastapi import FastAPI

    app = FastAPI()
    add_front_door(app, api_key="k", allowed_origins=["http://a.example"])
    assert [m.cls.__name__ for m in app.user_middleware] == ["CORSMiddleware", "FrontDoor"], \
        "CORS outermost: a preflight is answered before the key is asked for"
    with pytest.raises((TypeError, ValueError), match="allowed_origins"):
        add_front_door(FastAPI(), allowed_origins="http://a.example")

    class Stack:
        """Where add_front_door puts its middleware (a FastAPI app's add_middleware)."""

        def __init__(self):
            self.added = []

        def add_middleware(self, cls, **kw):  # noqa: ANN001
            self.added.append((cls.__name__, kw))

    stack = Stack()
    add_front_door(stack, allowed_hosts=["*"], max_body_bytes=100, body_timeout=1.5)
    assert stack.added == [("FrontDoor", {"allowed_hosts": ["*"], "api_key": None, "max_body_bytes": 100,
                                          "body_timeout": 1.5})], "no origins: no CORS middleware"
    protocol = guarded_protocol(1.5, 12, 4096)
    assert protocol.__name__ == "GuardedProtocol_12" and 16 <= default_max_connections() <= 1000

    async def asgi(scope, receive, send):  # noqa: ANN001
        return None
    server = uvicorn_server(asgi, header_timeout=2.0, max_connections=20, host="127.0.0.1", port=1)
    assert server.config.limit_concurrency == 20 and server.config.timeout_keep_alive == 5
    with pytest.raises((TypeError, ValueError), match="header_timeout"):
        uvicorn_server(asgi, header_timeout=0)
    thread = ServerThread(asgi, port=1, header_timeout=2.0)
    assert thread.url == "http://127.0.0.1:1" and not thread.thread.is_alive()
    assert ServerProcess(port=1).url == "http://127.0.0.1:1"
    abort_engine(types.SimpleNamespace(state=types.SimpleNamespace(engine=None)))     # no engine: nothing to do


def test_builders_workload_and_load():
    engine = model_engine(MODEL, np.float32, num_blocks=16, block_size=8)
    assert engine.decoder is not None and engine.W.dtype == np.float32
    engine, app = build_server(np.float32, app_kw={"allowed_hosts": ["*"]}, num_blocks=16, block_size=8)
    assert app.state.engine is engine
    work = sample_workload(3, 5, prompt_len=(4, 6), output_len=(1, 2))
    assert len(work) == 3 and all(4 <= len(p) <= 6 and 1 <= m <= 2 for p, m in work) and sample_workload(0) == []
    for bad, name in ((dict(rng=None), "rng"), (dict(rng=-1), "rng"), (dict(prompt_len=(5, 4)), "prompt_len")):
        with pytest.raises((TypeError, ValueError), match=name):
            sample_workload(2, **bad)
    with ServerThread(app) as srv:
        records, duration = run_load(srv.url, work, [0.0, 0.0, 0.01])
        assert [r["status"] for r in records] == [200] * 3 and duration > 0
        assert [len(r["token_times"]) for r in records] == [m for _, m in work]
    assert process_threads(os.getpid()) >= 1 and process_threads(2 ** 22 + 12345) is None
    eng = Engine(W64, num_blocks=16, block_size=8, prefix_caching=False)
    eng.start()
    abort_engine(types.SimpleNamespace(state=types.SimpleNamespace(engine=eng)))
    eng._thread.join(10) if eng._thread is not None else None
    assert eng._stopping


def test_decode_speeds_on_a_small_model(capsys):
    W = random_gpt_weights(vocab_size=11, block_size=24, n_layer=1, n_head=2, n_embd=8, dtype=np.float32, seed=1)
    runs = decode_speeds(W, 6, Engine, prompt_len=4, repeats=1, no_cache_repeats=1)
    assert set(runs) == {"no cache", "lesson 11", "engine reference", "engine fused"}
    assert all(len(v) == 6 and np.isfinite(v).all() and (v > 0).all() for v in runs.values())
    print_decode_speeds(runs, W, 4)
    assert "tokens/s after N tokens" in capsys.readouterr().out
    with pytest.raises((TypeError, ValueError), match="n_tokens"):
        decode_speeds(W, 0, Engine)
    sampling = SamplingParams(top_k=3, logprobs=1)
    assert not sampling.plain and sampling.logprobs == 1
