"""`make serve` (minitorch.api_server.serve in its own process) under Ctrl-C, as a lecturer stops it:
the first SIGINT lets the request in flight finish, a second stops at once, aborting it. Python
3.12 changed asyncio's Server.wait_closed() to wait for open connections, so uvicorn's force-exit
alone would wait for the last token (serving_kit.uvicorn_server aborts the engine as well)."""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minitorch.serving_kit import ServerProcess  # noqa: E402

STEP = 0.2  # s per engine step: 50 tokens take 10 s (the tiny GPT's context is 64 tokens)


def start_request(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def client() -> None:
        try:
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": "tiny-gpt", "prompt": "def f(x):", "max_tokens": max_tokens, "temperature": 0})
            out["text"] = r.json()["choices"][0]["text"] if r.status_code == 200 else None
            out["finish"] = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.status_code
        except httpx.HTTPError as exc:
            out["error"] = exc

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 20
    while httpx.get(url + "/stats", timeout=5).json()["running"] < 1:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.02)
    return t, out


@contextmanager
def server_process():
    """A started `serve` process (serving_kit.ServerProcess) and its URL; killed if a test leaves it running."""
    server = ServerProcess(step_interval=STEP)
    url = server.__enter__()
    try:
        yield server.proc, url
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


@pytest.mark.timeout(120)
def test_first_ctrl_c_finishes_the_request_in_flight():
    with server_process() as (proc, url):
        t, out = start_request(url, 15)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) is not None
        t.join(10)
        assert out.get("finish") == "length", f"a graceful stop must finish the request in flight: {out}"


@pytest.mark.timeout(120)
def test_second_ctrl_c_stops_at_once():
    with server_process() as (proc, url):
        t, out = start_request(url, 50)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        took = time.monotonic() - t0
        t.join(10)
        assert took < 50 * STEP / 2, f"a second Ctrl-C took {took:.1f} s to stop the server (the request had ~10 s left)"
        assert "error" in out or out.get("finish") != "length", f"the request in flight must be cut off: {out}"
