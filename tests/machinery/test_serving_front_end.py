"""Lesson 15's front door under hostile and careless clients, measured from outside with raw sockets:
slowloris (heads sent a byte at a time), a 100 MB body, a body that never ends, idle sockets past the
connection limit, kept-alive connections left idle, oversized heads; meanwhile a second client checks
that /health answers within 0.5 s. Then the API key, CORS and the Host check (DNS rebinding), a
client that leaves a non-streamed request, and Prometheus histograms that only grow across 5,000
requests. Small limits (1 s timeouts, 24 connections) keep it to seconds."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minitorch.gpt import load_tiny_gpt  # noqa: E402
from minitorch.kv_cache import load_tiny_weights  # noqa: E402
from minitorch.api_server import make_app  # noqa: E402
from minitorch.engine import Engine  # noqa: E402
from minitorch.serving_kit import ServerThread, run_load  # noqa: E402

W = load_tiny_weights(np.float32)
TOK = load_tiny_gpt()[1]
LIMITS = dict(header_timeout=1.0, max_connections=24, timeout_keep_alive=1)


@contextmanager
def serving(app_kw: dict | None = None, limits: dict | None = None, **engine_kw):
    eng = Engine(W, **{"num_blocks": 48, "block_size": 8, "max_running": 32, **engine_kw})
    if eng.decoder is not None:     # Numba compiles the fused step here, not within a request's timeout
        eng.decoder.warm_up()
    app = make_app(eng, TOK, "tiny-gpt", **{"body_timeout": 1.0, **(app_kw or {})})
    with ServerThread(app, **{**LIMITS, **(limits or {})}) as srv:
        yield eng, srv


class HealthWatch:
    """A second client: GET /health every 50 ms on a fresh connection; the slowest answer, and failures."""

    def __init__(self, url: str):
        self.url, self.worst, self.failures, self.stop = url, 0.0, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
                if status != 200:
                    self.failures.append(status)
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
            self.worst = max(self.worst, time.perf_counter() - t0)
            time.sleep(0.05)

    def __enter__(self) -> "HealthWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def connect(srv) -> socket.socket:
    s = socket.create_connection((srv.host, srv.port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    """What the server sends until it closes the connection (or `timeout` passes)."""
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def head(srv, extra: bytes = b"", path: bytes = b"/v1/completions", method: bytes = b"POST") -> bytes:
    return (method + b" " + path + b" HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            % (srv.host.encode(), srv.port) + extra + b"\r\n")


@pytest.mark.timeout(60)
def test_slowloris_and_a_100mb_body_leave_health_answering():
    with serving() as (eng, srv), HealthWatch(srv.url) as watch:
        time.sleep(0.2)
        slow = [connect(srv) for _ in range(12)]             # heads trickling in, a byte every 0.1 s
        partial = head(srv, b"Content-Length: 2\r\n")
        t0 = time.monotonic()
        for i in range(8):
            for s in slow:
                try:
                    s.send(partial[i:i + 1])
                except OSError:
                    pass
            time.sleep(0.1)
        big = connect(srv)                                    # 100 MB announced: refused after the head
        big.sendall(head(srv, b"Content-Length: 100000000\r\n"))
        sent = 0
        big.settimeout(0.05)
        answer = b""
        try:
            while sent < 100_000_000 and b"\r\n\r\n" not in answer:
                sent += big.send(b"x" * 65536)
                try:
                    answer += big.recv(65536)
                except socket.timeout:
                    pass
        except OSError:
            pass
        answer += read_all(big, 2)
        assert answer.startswith(b"HTTP/1.1 413"), f"a 100 MB body must be refused with 413 before it is read: {answer[:200]!r}"
        assert sent < 20_000_000, f"the server must not read the 100 MB first: {sent} bytes went in before the 413"
        chunked = connect(srv)                                # no Content-Length: refused once past the limit
        chunked.sendall(head(srv, b"Transfer-Encoding: chunked\r\n"))
        try:
            for _ in range(40):
                chunked.sendall(b"10000\r\n" + b"y" * 65536 + b"\r\n")
        except OSError:
            pass
        assert read_all(chunked, 3).startswith(b"HTTP/1.1 413")
        closed = [read_all(s, 3) for s in slow]
        took = time.monotonic() - t0
        assert all(c.startswith(b"HTTP/1.1 408") for c in closed), \
            f"slow heads are answered 408 and closed after the header timeout (1 s): {[c[:20] for c in closed]}"
        stalled = connect(srv)                                # a body that stops coming: 408 after 1 s
        stalled.sendall(head(srv, b"Content-Length: 100\r\n") + b"{")
        assert read_all(stalled, 4).startswith(b"HTTP/1.1 408")
        huge = connect(srv)
        huge.sendall(head(srv, b"X-Padding: " + b"p" * 20_000 + b"\r\n"))
        assert read_all(huge, 3).startswith(b"HTTP/1.1 431"), "a head over 16 KiB: 431"
    assert not watch.failures and watch.worst < 0.5, \
        f"/health must answer within 0.5 s throughout (worst {watch.worst:.3f} s, failures {watch.failures[:3]})"
    assert took < 10


@pytest.mark.timeout(60)
def test_idle_sockets_past_the_limit_are_closed_at_once_and_kept_alive_ones_time_out():
    with serving() as (eng, srv):
        state = srv.server.server_state
        idle = [connect(srv) for _ in range(40)]              # 24 allowed: the rest closed at once
        time.sleep(0.3)
        assert len(state.connections) <= 24, f"at most 24 connections held, got {len(state.connections)}"
        shut = 0
        for s in idle[24:]:
            s.settimeout(0.5)
            try:
                shut += s.recv(1) == b""
            except (ConnectionResetError, socket.timeout):
                shut += 1
        assert shut == 16, f"the 16 sockets past the limit must be closed at once, {shut} were"
        time.sleep(1.3)                                       # the header timeout closes the idle rest
        assert len(state.connections) == 0, f"idle sockets must be closed after the header timeout: {len(state.connections)}"
        for s in idle:
            s.close()
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        s = connect(srv)                                      # keep-alive: one request, then idle
        s.sendall(head(srv, method=b"GET", path=b"/health"))
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert read_all(s, 5) == b"" and 0.8 < time.monotonic() - t0 < 3, "an idle kept-alive connection closes after 1 s"


def test_api_key_cors_and_the_host_check():
    body = {"model": "tiny-gpt", "prompt": "ab", "max_tokens": 2, "temperature": 0}
    with serving(app_kw={"api_key": "sesame"}) as (eng, srv):
        for auth, status in ((None, 401), ("Bearer nope", 401), ("sesame", 401), ("Bearer sesame", 200)):
            r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": auth} if auth else {})
            assert r.status_code == status, f"Authorization {auth!r}: expected {status}, got {r.status_code}"
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.post(srv.url + "/reset_prefix_cache").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/metrics").status_code == 200
        r = httpx.get(srv.url + "/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers, "no CORS unless origins are given"
        import json

        for kind in ("text/plain", "application/x-www-form-urlencoded", None):   # what a page sends unchecked
            r = httpx.post(srv.url + "/v1/completions", content=json.dumps(body),
                           headers={"Authorization": "Bearer sesame", **({"Content-Type": kind} if kind else {})})
            assert r.status_code == 415, f"a POST to /v1 as {kind}: 415 (only JSON, which needs a preflight), got {r.status_code}"
        r = httpx.post(srv.url + "/v1/completions", content=json.dumps(body),
                       headers={"Authorization": "Bearer sesame", "Content-Type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
            r = httpx.get(srv.url + "/health", headers={"Host": host})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", \
                f"Host {host!r} (a DNS-rebinding page's request): 400, got {r.status_code}"
        for host in (f"localhost:{srv.port}", f"127.0.0.1:{srv.port}", f"[::1]:{srv.port}", "LOCALHOST"):
            assert httpx.get(srv.url + "/health", headers={"Host": host}).status_code == 200, host
    with serving(app_kw={"allowed_origins": ["http://lecture.example"], "allowed_hosts": ["*"]}) as (eng, srv):
        pre = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": "http://lecture.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://lecture.example"
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Origin": "http://lecture.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://lecture.example"
        other = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
        assert httpx.get(srv.url + "/health", headers={"Host": "anything.example"}).status_code == 200


def test_a_client_that_leaves_a_non_streamed_request_frees_its_blocks():
    with serving(step_interval=0.03, prefix_caching=False) as (eng, srv):
        import json

        payload = json.dumps({"model": "tiny-gpt", "prompt": "class A:", "max_tokens": 50, "temperature": 0}).encode()
        s = connect(srv)
        s.sendall(head(srv, b"Content-Length: %d\r\n" % len(payload)) + payload)
        deadline = time.monotonic() + 10
        while eng.stats()["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.close()
        t0 = time.monotonic()
        while eng.blocks_used() and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert eng.blocks_used() == 0 and eng.finished[-1].finish_reason == "abort" and len(eng.finished[-1].output) < 50
        assert time.monotonic() - t0 < 1, "aborted at once, not at the end of its 50 tokens (1.5 s)"


@pytest.mark.timeout(120)
def test_histograms_only_grow_across_5000_requests():
    """Prometheus reads a histogram's increase between two scrapes: its counts and sum must never fall
    (the old /metrics rebuilt them from the last 4,096 requests, so they stopped and fell)."""
    def scrape(url: str) -> dict:
        out = {}
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("minitorch_") and ("_seconds_" in line):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    with serving(limits={"max_connections": 256}, max_waiting=100_000, max_num_batched_tokens=256) as (eng, srv):
        seen, total = [], 0
        for rnd in range(10):
            work = [(f"x{rnd}", 1)] * 500
            records, _ = run_load(srv.url, work, [0] * 500, max_concurrency=64)
            assert all(r["status"] == 200 for r in records)
            total += 500
            seen.append(scrape(srv.url))
        last = seen[-1]
        assert last["minitorch_time_to_first_token_seconds_count"] == 5000 == \
            last['minitorch_e2e_request_latency_seconds_bucket{le="+Inf"}']
        for before, after in zip(seen, seen[1:]):
            for key, value in before.items():
                assert after[key] >= value, f"{key} fell from {value} to {after[key]} between two scrapes"
        assert [s["minitorch_request_queue_time_seconds_count"] for s in seen] == list(range(500, 5001, 500))
