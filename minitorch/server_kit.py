# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.server_kit: the machinery around lesson 15's server that the student reads but does
not write: the lecture page, uvicorn in a thread, the load generator's HTTP plumbing, and the
engine's fused decode step (one Numba function for a whole decode step of the tiny GPT)."""
from __future__ import annotations

import asyncio
import http
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numba import njit

PAGE_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>minitorch server</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 60em; }
textarea { width: 100%; font-family: monospace; }
#out { white-space: pre-wrap; font-family: monospace; border: 1px solid #ccc; padding: .5em; min-height: 4em; }
#panel span { display: inline-block; min-width: 9em; }
.bar { height: 1em; background: #4a8; }
</style></head>
<body>
<h1>minitorch: the tiny GPT, served</h1>
<textarea id="prompt" rows="3">The for statement</textarea>
<p>max tokens <input id="max" type="number" min="1" max="63" placeholder="the rest of the context" size="22">
temperature <input id="temp" type="number" value="0" min="0" max="2" step="0.1">
<button id="go">Generate</button>
<input id="key" type="password" placeholder="API key, if the server has one" size="26"></p>
<div id="out"></div>
<h2>The batch</h2>
<div id="panel">
<span>running: <b id="running">0</b></span><span>waiting: <b id="waiting">0</b></span>
<span>KV blocks: <b id="blocks">0</b> / <b id="total">0</b></span>
<span>tokens/s: <b id="tps">0</b></span><span>prefix hits: <b id="hits">0</b></span>
<span>steps: <b id="steps">0</b></span>
<div style="border:1px solid #ccc; width: 30em"><div class="bar" id="bar" style="width:0%"></div></div>
</div>
<script>
async function poll() {
  try {
    const s = await (await fetch("/stats")).json();
    for (const k of ["running", "waiting", "steps"]) document.getElementById(k).textContent = s[k];
    document.getElementById("blocks").textContent = s.kv_blocks_used;
    document.getElementById("total").textContent = s.kv_blocks_total;
    document.getElementById("tps").textContent = s.tokens_per_s.toFixed(0);
    document.getElementById("hits").textContent = (100 * s.prefix_hit_rate).toFixed(0) + "%";
    document.getElementById("bar").style.width = (100 * s.kv_blocks_used / s.kv_blocks_total) + "%";
  } catch (e) {}
}
setInterval(poll, 250);
poll();
document.getElementById("go").onclick = async () => {
  const out = document.getElementById("out");
  out.textContent = "";
  const body = {model: MODEL, prompt: document.getElementById("prompt").value, stream: true,
                temperature: +document.getElementById("temp").value};
  const max = document.getElementById("max").value, key = document.getElementById("key").value;
  if (max) body.max_tokens = +max;
  const headers = {"Content-Type": "application/json"};
  if (key) headers.Authorization = "Bearer " + key;
  const r = await fetch("/v1/completions", {method: "POST", headers: headers, body: JSON.stringify(body)});
  if (!r.ok) { out.textContent = (await r.json()).error.message; return; }
  const reader = r.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += dec.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\\n\\n")) >= 0) {
      const ev = buf.slice(0, i); buf = buf.slice(i + 2);
      const data = ev.split("\\n").filter(l => l.startsWith("data: ")).map(l => l.slice(6)).join("\\n");
      if (data === "[DONE]") return;
      out.textContent += JSON.parse(data).choices[0].text;
    }
  }
};
</script></body></html>
"""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def abort_engine(app: Any) -> None:
    """A forced stop: end every request the app's engine holds (finish_reason "abort") so that the
    responses in flight return and their connections close. uvicorn's force-exit alone is not
    enough: since Python 3.12, asyncio's `Server.wait_closed()` waits for every open connection,
    so the server would still wait for the last token of every request in flight."""
    engine = getattr(getattr(app, "state", None), "engine", None)
    if engine is not None:  # in a thread: this may run in a signal handler
        threading.Thread(target=engine.stop, kwargs={"drain": False}, name="force-stop", daemon=True).start()


def uvicorn_server(app: Any, header_timeout: float = 10.0, max_connections: int | None = None,
                   max_header_bytes: int = 16384, **config: Any) -> Any:
    """A uvicorn.Server for `app` (keyword arguments: uvicorn.Config's) whose second Ctrl-C also
    aborts the app's engine (abort_engine), so that it stops at once on every Python. Its HTTP
    protocol is guarded (guarded_protocol: header_timeout, max_connections, max_header_bytes);
    uvicorn's limit_concurrency defaults to max_connections and timeout_keep_alive to 5 s."""
    import uvicorn

    limit = max_connections or default_max_connections()
    config.setdefault("http", guarded_protocol(header_timeout, limit, max_header_bytes))
    config.setdefault("limit_concurrency", limit)
    config.setdefault("timeout_keep_alive", 5)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if self.force_exit:
                abort_engine(app)

    return Server(uvicorn.Config(app, **config))


class ServerThread:
    """uvicorn serving `app` on host:port from a background thread (port 0: a free one).

    start() returns once the server accepts connections; stop() shuts it down gracefully (no new
    connections; in-flight requests finish, then the app's shutdown runs); stop(force=True)
    stops at once, like a second Ctrl-C. limits: uvicorn_server's and uvicorn.Config's
    (header_timeout, max_connections, max_header_bytes, timeout_keep_alive, ...)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, graceful_timeout: float = 30.0,
                 **limits: Any):
        self.app, self.host, self.port = app, host, port or free_port(host)
        self.server = uvicorn_server(app, host=self.host, port=self.port, log_level="warning",
                                     timeout_graceful_shutdown=graceful_timeout, lifespan="on", **limits)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn:{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"ServerThread: uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, force: bool = False, timeout: float = 30.0) -> None:
        """Graceful: no new connections, in-flight requests finish, then the app shuts down (its
        engine drains). force=True (a second Ctrl-C): connections are dropped at once and the
        app's engine, if it has one (app.state.engine), aborts what it was serving."""
        self.server.should_exit = True
        if force:
            self.server.force_exit = True
            abort_engine(self.app)
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError(f"ServerThread: the server on {self.url} did not stop in {timeout} s")
        engine = getattr(getattr(self.app, "state", None), "engine", None)
        if force and engine is not None:
            engine.stop(drain=False)  # joins the engine's thread (abort_engine's may not have yet)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ServerProcess:
    """`minitorch.server.serve(port=..., **serve_kw)` in a child process (its own interpreter, so
    a load generator in this one does not share its lock). `with ServerProcess(...) as url:`
    waits for /health, and on leaving sends SIGINT (a graceful stop) and waits for the exit."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **serve_kw: Any):
        self.host, self.port, self.serve_kw = host, port or free_port(host), serve_kw
        self.proc: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        import os
        import subprocess
        import sys

        import httpx

        args = "".join(f", {k}={v!r}" for k, v in self.serve_kw.items())
        code = f"from minitorch.server import serve; serve(host={self.host!r}, port={self.port}{args})"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"ServerProcess: the server did not start on {self.url}")
            time.sleep(0.1)

    def __exit__(self, *exc: Any) -> None:
        import signal

        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()


def process_threads(pid: int) -> int | None:
    """Threads of process pid and of its children (a server and its engine process), to print
    beside a timing; None where psutil is missing (it comes with IPython) or the process is gone."""
    try:
        import psutil

        root = psutil.Process(pid)
        return sum(p.num_threads() for p in [root, *root.children(recursive=True)])
    except Exception:  # noqa: BLE001 - ImportError, or psutil.Error: a process that ended meanwhile
        return None


OPENAI_ERROR = '{{"error": {{"message": {message}, "type": "{type}", "param": null, "code": "{code}"}}}}'
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _error_response(status: int, message: str, type: str, code: str,
                    headers: Sequence[tuple[bytes, bytes]] = ()) -> tuple[dict, dict]:
    """The two ASGI messages of an OpenAI-style JSON error (Connection: close: the rest of the
    request, unread, is not worth reading)."""
    body = OPENAI_ERROR.format(message=json.dumps(message), type=type, code=code).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close"), *headers]}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


def host_name(header: str) -> str:
    """The host of a Host header, without its port: "localhost:8000" -> "localhost",
    "[::1]:8000" -> "::1"."""
    if not isinstance(header, str):
        raise TypeError(f"host_name: header must be a str, got {header!r}")
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class FrontDoor:
    """ASGI middleware: what a server that a browser can reach checks before its app sees a request.

    - Host: the Host header must name one of allowed_hosts (["*"]: any). A web page on another
      site cannot read a server on 127.0.0.1 (the browser's same-origin rule), unless its domain
      is made to resolve to 127.0.0.1 (DNS rebinding): then the browser sends that domain as Host,
      and this check refuses it (400).
    - An API key (vLLM's --api-key): requests whose path starts with one of `protected` need
      `Authorization: Bearer <api_key>` (401 otherwise; compared in constant time).
    - A POST to /v1/ must be `Content-Type: application/json` (415 otherwise): a web page cannot
      send that to another origin without a CORS preflight, which the server refuses unless CORS
      allows the page's origin (a "simple" text/plain POST would still make the engine work).
    - The body: a Content-Length over max_body_bytes is answered 413 before a byte of the body is
      read, and so is a body without one (chunked) the moment it passes the limit; a body not read
      whole within body_timeout seconds of the request's head gets 408. The app then reads the
      body from memory, and its later receive() calls go to the client's connection (a disconnect)."""

    def __init__(self, app: Any, allowed_hosts: Sequence[str] | None = None, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, body_timeout: float = 30.0,
                 protected: Sequence[str] = ("/v1/", "/reset_prefix_cache")):
        hosts = LOOPBACK_HOSTS if allowed_hosts is None else allowed_hosts
        if isinstance(hosts, str) or not all(isinstance(h, str) and h for h in hosts):
            raise ValueError(f"FrontDoor: allowed_hosts must be a list of host names, got {hosts!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("FrontDoor: api_key must be None or a non-empty str")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"FrontDoor: max_body_bytes must be an integer >= 1, got {max_body_bytes!r}")
        if isinstance(body_timeout, bool) or not isinstance(body_timeout, (int, float)) or not 0 < body_timeout < math.inf:
            raise ValueError(f"FrontDoor: body_timeout must be a finite number of seconds > 0, got {body_timeout!r}")
        self.app, self.api_key = app, api_key
        self.any_host = "*" in hosts
        self.hosts = {h.lower().strip("[]") for h in hosts}
        self.max_body_bytes, self.body_timeout, self.protected = max_body_bytes, float(body_timeout), tuple(protected)
        self.json_only = ("/v1/",)
        self.refused = {"host": 0, "api_key": 0, "content_type": 0, "too_large": 0, "timeout": 0}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = None
        host = host_name(headers.get(b"host", b"").decode("latin-1")).lower()
        if not self.any_host and host not in self.hosts:
            refusal = ("host", 400, f"the Host header {host!r} is not one this server answers to (allowed: "
                                    f"{sorted(self.hosts)}; serve(allowed_hosts=...) adds names)", "invalid_request_error",
                       "invalid_host", ())
        elif self.api_key is not None and scope["path"].startswith(self.protected) and scope["method"] != "OPTIONS":
            import secrets

            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, b"Bearer " + self.api_key.encode()):
                refusal = ("api_key", 401, "a valid API key is required: Authorization: Bearer <key>",
                           "authentication_error", "invalid_api_key", ((b"www-authenticate", b"Bearer"),))
        if refusal is None and scope["method"] == "POST" and scope["path"].startswith(self.json_only) and \
                headers.get(b"content-type", b"").split(b";")[0].strip().lower() != b"application/json":
            refusal = ("content_type", 415, "a POST to /v1 must send Content-Type: application/json (a web page "
                                            "can send that only after a CORS preflight)", "invalid_request_error",
                       "unsupported_media_type", ())
        if refusal is None:
            length = headers.get(b"content-length", b"0")
            if not length.isdigit() or int(length) > self.max_body_bytes:
                refusal = ("too_large", 413, f"the request body is larger than this server's limit of "
                                             f"{self.max_body_bytes} bytes", "invalid_request_error",
                           "request_too_large", ())
        if refusal is not None:
            what, status, message, kind, code, extra = refusal
            self.refused[what] += 1
            for message_ in _error_response(status, message, kind, code, extra):
                await send(message_)
            return
        body, more, deadline = bytearray(), True, time.monotonic() + self.body_timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                self.refused["timeout"] += 1
                for message_ in _error_response(408, f"the request body was not received within {self.body_timeout:g} "
                                                     "s", "invalid_request_error", "request_timeout"):
                    await send(message_)
                return
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                self.refused["too_large"] += 1
                for message_ in _error_response(413, f"the request body is larger than this server's limit of "
                                                     f"{self.max_body_bytes} bytes", "invalid_request_error",
                                                "request_too_large"):
                    await send(message_)
                return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def add_front_door(app: Any, api_key: str | None = None, allowed_origins: Sequence[str] | None = None,
                   allowed_hosts: Sequence[str] | None = None, max_body_bytes: int = 1 << 20,
                   body_timeout: float = 30.0) -> None:
    """Wrap a FastAPI app in FrontDoor (Host, API key, body limits) and, only where allowed_origins
    are given, Starlette's CORSMiddleware for them (outermost, so that a browser's preflight
    OPTIONS request is answered before the key is asked for). app.state.front_door: its counters."""
    from starlette.middleware.cors import CORSMiddleware

    FrontDoor(None, allowed_hosts, api_key, max_body_bytes, body_timeout)      # refuse bad settings now
    app.add_middleware(FrontDoor, allowed_hosts=allowed_hosts, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout=body_timeout)
    if allowed_origins:
        if isinstance(allowed_origins, str) or not all(isinstance(o, str) for o in allowed_origins):
            raise ValueError(f"add_front_door: allowed_origins must be a list of origins, got {allowed_origins!r}")
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])


def default_max_connections() -> int:
    """Connections a server keeps open at once: 1,000, or fewer where the process may open fewer
    files (RLIMIT_NOFILE, less 64 for its own), at least 16."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1000
    return max(16, min(1000, soft - 64)) if soft != getattr(resource, "RLIM_INFINITY", -1) else 1000


def guarded_protocol(header_timeout: float = 10.0, max_connections: int | None = None,
                     max_header_bytes: int = 16384) -> type:
    """uvicorn's HTTP protocol (httptools' parser), guarded against slow and idle clients:
    - a request's head (request line and headers) must arrive within header_timeout seconds of its
      first byte (or of the connection's opening: an idle socket is closed too), else 408 and the
      connection closes (slowloris: many connections each sending a header byte now and then);
    - a head over max_header_bytes gets 431 and the connection closes;
    - beyond max_connections open connections (default_max_connections()), a new one is closed at
      once, before it costs more than its file descriptor for a moment; uvicorn's own
      limit_concurrency answers 503 to requests from the max_connections-th on.
    uvicorn's timeout_keep_alive closes a connection idle between requests. Without httptools
    (uvicorn[standard] installs it) uvicorn's h11 protocol, unguarded, is returned."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is pinned
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol
    limit = max_connections or default_max_connections()

    class GuardedProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._guard, self._head_bytes, self._in_head, self._tail = None, 0, True, b""
            if len(self.connections) > limit:
                transport.abort()                                 # too many at once: this one goes now
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._guard = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._guard is not None:
                self._guard.cancel()
                self._guard = None

        def _expire(self) -> None:
            self._guard = None
            if not self.transport.is_closing():
                if self._head_bytes:
                    self._reply(408, "the request's head did not arrive in time")
                self.transport.close()

        def _reply(self, status: int, message: str) -> None:
            start, body = _error_response(status, message, "invalid_request_error", "request_timeout"
                                          if status == 408 else "headers_too_large")
            head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()]
            head += [name + b": " + value + b"\r\n" for name, value in start["headers"]]
            self.transport.write(b"".join(head) + b"\r\n" + body["body"])

        def data_received(self, data: bytes) -> None:
            if self._in_head and not self.transport.is_closing():
                if self._guard is None:
                    self._arm()                                   # the first byte of a new request
                end = (self._tail + data).find(b"\r\n\r\n")     # where the head ends, if in this data
                if self._head_bytes + (len(data) if end < 0 else end + 4 - len(self._tail)) > max_header_bytes:
                    self._disarm()
                    self._reply(431, f"the request's head is larger than {max_header_bytes} bytes")
                    self.transport.close()
                    return
                self._head_bytes += len(data)
                self._tail = (self._tail + data)[-3:]
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._disarm()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes, self._tail = True, 0, b""   # the next request's head comes next

        def connection_lost(self, exc: Exception | None) -> None:
            if getattr(self, "_guard", None) is not None:
                self._disarm()
            super().connection_lost(exc)

    GuardedProtocol.__qualname__ = GuardedProtocol.__name__ = f"GuardedProtocol_{limit}"
    return GuardedProtocol


def sample_workload(n: int, rng: Any = 0, prompt_len: tuple[int, int] = (8, 32),
                    output_len: tuple[int, int] = (8, 24)) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs: prompts are slices of the tiny GPT's corpus with lengths
    uniform in prompt_len (inclusive), max_tokens uniform in output_len (inclusive). rng: a seed
    (an integer >= 0) or a np.random.Generator."""
    from minitorch.gpt import load_corpus

    if not (isinstance(rng, np.random.Generator) or isinstance(rng, (int, np.integer)) and
            not isinstance(rng, (bool, np.bool_)) and rng >= 0):
        raise ValueError(f"sample_workload: rng must be a seed (an integer >= 0) or a np.random.Generator, got {rng!r}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if lo > hi:
            raise ValueError(f"sample_workload: {name} must be (low, high) with low <= high, got {(lo, hi)}")
    rng = np.random.default_rng(rng)
    text = load_corpus()
    out = []
    for _ in range(n):
        length = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        start = int(rng.integers(0, len(text) - length))
        out.append((text[start:start + length], int(rng.integers(output_len[0], output_len[1] + 1))))
    return out


class _Connections:
    """Keep-alive HTTP/1.1 connections to one host:port on asyncio streams (the load generator's
    client: a few lines of parsing per event instead of a general client's layers, because the
    load generator shares the machine's cores with the server it measures)."""

    def __init__(self, host: str, port: int):
        self.host, self.port, self.idle = host, port, []

    async def get(self, fresh: bool = False) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """(reader, writer, reused): an idle connection unless `fresh` or none is idle."""
        if self.idle and not fresh:
            return (*self.idle.pop(), True)
        return (*await asyncio.open_connection(self.host, self.port), False)

    def put(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.idle.append(conn)

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def _post_stream(conns: _Connections, path: str, body: bytes, on_event: Callable[[bytes], None]) -> int:
    """POST `body` (JSON) to `path`; on_event(data) for each server-sent event's data (bytes) of a
    200 response as it arrives. Returns the status; the connection goes back to the pool when the
    response was read to its end. A kept-alive connection that the server has closed meanwhile
    (uvicorn closes idle ones after 5 s) is replaced by a new one."""
    fresh = False
    while True:
        reader, writer, reused = await conns.get(fresh)
        try:
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (path.encode(), conns.host.encode(), conns.port, len(body),
                                                              body))
            status_line = await reader.readline()
        except (ConnectionError, OSError):
            status_line = b""
        except BaseException:
            writer.close()
            raise
        if status_line or not reused:
            break
        writer.close()                                           # closed by the server while idle: anew
        fresh = True
    try:
        if not status_line:
            raise ConnectionError(f"the server at {conns.host}:{conns.port} closed the connection without an answer")
        status = int(status_line.split(b" ", 2)[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if headers.get(b"transfer-encoding") != b"chunked":
            await reader.readexactly(int(headers.get(b"content-length", b"0")))
        else:
            buf = b""
            while size := int((await reader.readline()).split(b";")[0], 16):
                buf += (await reader.readexactly(size + 2))[:-2]
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    if event.startswith(b"data: ") and status == 200:
                        on_event(event[6:])
            await reader.readline()                              # the blank line after the last chunk
        if headers.get(b"connection") == b"close":
            writer.close()
        else:
            conns.put((reader, writer))
        return status
    except BaseException:
        writer.close()
        raise


async def _one_request(conns: _Connections, model: str, prompt: str, max_tokens: int, send_at: float,
                       sem: asyncio.Semaphore | None, timeout: float) -> dict[str, Any]:
    delay = send_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if sem is not None:
        await sem.acquire()
    start, times, text, status = time.perf_counter(), [], [], 0

    def on_event(data: bytes) -> None:
        if data != b"[DONE]":
            piece = json.loads(data)["choices"][0]["text"]
            if piece:
                times.append(time.perf_counter())
                text.append(piece)

    try:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                           "temperature": 0.0}).encode()
        status = await asyncio.wait_for(_post_stream(conns, "/v1/completions", body, on_event), timeout)
    except Exception as exc:  # a refused or broken connection is a failed request, not a crash
        status = -1
        text.append(repr(exc))
    finally:
        if sem is not None:
            sem.release()
    return {"start": start, "token_times": times, "status": status, "text": "".join(text),
            "max_tokens": max_tokens}


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's event loop where it is installed (Linux and macOS: the loop uvicorn picks too),
    else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_load(url: str, workload: list[tuple[str, int]], arrivals: Any, model: str = "tiny-gpt",
             max_concurrency: int | None = None, timeout: float = 120.0) -> tuple[list[dict[str, Any]], float]:
    """Send workload[i] (prompt, max_tokens) to url/v1/completions, streamed, at arrivals[i]
    seconds after the start (open loop: a request is sent on time whatever the others do), at
    most max_concurrency at once (None: no limit); each request fails (status -1) after
    `timeout` seconds. Returns (one dict per request: start, token_times, status, text,
    max_tokens; the wall time from the first send to the last answer). Runs its own event loop
    in a thread, so it works inside a notebook."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"run_load: expected a URL http://host:port, got {url!r}")
    result: dict[str, Any] = {}

    async def main() -> None:
        conns = _Connections(parts.hostname, parts.port or 80)
        try:
            sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
            t0 = time.perf_counter()
            tasks = [_one_request(conns, model, p, m, t0 + float(a), sem, timeout)
                     for (p, m), a in zip(workload, arrivals)]
            result["records"] = await asyncio.gather(*tasks)
            result["duration"] = time.perf_counter() - t0
        finally:
            conns.close()

    def target() -> None:
        try:
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                runner.run(main())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="load-generator")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["records"], result["duration"]


from minitorch.attention import FASTMATH  # noqa: E402 - lesson 09's flags: the dot products vectorise, -inf stays -inf


@njit(cache=False, nogil=True, fastmath=FASTMATH)
def _layer_norm_rows(x, w, b, eps, out):
    """out[r] = (x[r] - mean) / sqrt(var + eps) * w + b for each row of x (B, C) (biased variance)."""
    nb, c = x.shape
    for r in range(nb):
        mean = 0.0
        for i in range(c):
            mean += x[r, i]
        mean /= c
        var = 0.0
        for i in range(c):
            d = x[r, i] - mean
            var += d * d
        rstd = 1.0 / math.sqrt(var / c + eps)
        for i in range(c):
            out[r, i] = (x[r, i] - mean) * rstd * w[i] + b[i]


@njit(cache=False, nogil=True, fastmath=FASTMATH)
def _linear_rows(x, w, b, out):
    """out (B, n_out) = x (B, n_in) @ w (n_in, n_out) + b (n_out,); the inner loop runs along a row
    of w (contiguous), so it vectorises."""
    nb, n_in = x.shape
    n_out = w.shape[1]
    for r in range(nb):
        for j in range(n_out):
            out[r, j] = b[j]
        for i in range(n_in):
            xi = x[r, i]
            for j in range(n_out):
                out[r, j] += xi * w[i, j]


@njit(cache=False, nogil=True, fastmath=FASTMATH)
def fused_decode_kernel(tokens, positions, tables, wte, wpe, ln, wqkv, bqkv, wo, bo, wfc, bfc, wp2, bp2, lnf,
                        k_pool, v_pool, n_head, eps, out_rows, logits):
    """One step of lesson 09's GPT over B new tokens (rows) of sequences in a paged KV cache: one
    token each for decodes, several consecutive ones for a prefill chunk.

    tokens, positions (B,) int64: each row's token and its position in its sequence; the rows of
    one sequence come in increasing position (each attends to the keys the rows before it wrote in
    the same layer). tables (B, max_blocks) int64: each row's sequence's block table, covering
    its position. Weights, all in one float dtype (FusedDecoder.pack): wte (V, C), wpe (T, C);
    ln (L, 4, C) = LayerNorm 1 weight, bias, LayerNorm 2 weight, bias; wqkv (L, C, (Hq + 2 Hkv) hd)
    and bqkv (L, (Hq + 2 Hkv) hd), q then k then v; wo (L, C, C), bo (L, C); wfc (L, C, 4C),
    bfc (L, 4C); wp2 (L, 4C, C), bp2 (L, C); lnf (2, C). k_pool, v_pool (L, num_blocks, Hkv,
    block_size, hd): the pool; this step writes each sequence's new key and value at its
    position's slot. out_rows (B_out,) int64: the rows whose logits to write, in logits (B_out, V).
    """
    nb = tokens.shape[0]
    n_layer, c = wqkv.shape[0], wte.shape[1]
    n_kv_head, bs, hd = k_pool.shape[2], k_pool.shape[3], k_pool.shape[4]
    group = n_head // n_kv_head
    k_at, v_at = n_head * hd, (n_head + n_kv_head) * hd      # where k and v start in a row of qkv
    dt = wte.dtype
    x, h = np.empty((nb, c), dt), np.empty((nb, c), dt)        # the residual stream, a LayerNorm's output
    qkv = np.empty((nb, wqkv.shape[2]), dt)
    att, res = np.empty((nb, c), dt), np.empty((nb, c), dt)   # merged heads, a sublayer's output
    hid = np.empty((nb, wfc.shape[2]), dt)
    scores = np.empty(tables.shape[1] * bs, dt)
    scale = 1.0 / math.sqrt(hd)
    for r in range(nb):
        for i in range(c):
            x[r, i] = wte[tokens[r], i] + wpe[positions[r], i]
    for layer in range(n_layer):
        _layer_norm_rows(x, ln[layer, 0], ln[layer, 1], eps, h)
        _linear_rows(h, wqkv[layer], bqkv[layer], qkv)
        for r in range(nb):
            pos = positions[r]
            block, slot = tables[r, pos // bs], pos % bs
            for g in range(n_kv_head):
                for d in range(hd):
                    k_pool[layer, block, g, slot, d] = qkv[r, k_at + g * hd + d]
                    v_pool[layer, block, g, slot, d] = qkv[r, v_at + g * hd + d]
            n_keys = pos + 1                                     # keys 0 .. pos: the causal bound
            for head in range(n_head):
                g, q0 = head // group, head * hd                 # its K/V head; its columns in q and att
                q, o = qkv[r, q0:q0 + hd], att[r, q0:q0 + hd]
                for b0 in range(0, n_keys, bs):                  # scores, a block of the table at a time
                    k_block = k_pool[layer, tables[r, b0 // bs], g]            # (block_size, hd)
                    for j in range(min(bs, n_keys - b0)):
                        s = dt.type(0)
                        for d in range(hd):
                            s += q[d] * k_block[j, d]
                        scores[b0 + j] = s * scale
                m = scores[0]
                for j in range(1, n_keys):
                    m = max(m, scores[j])
                total = dt.type(0)
                for j in range(n_keys):                          # softmax, unnormalised
                    scores[j] = math.exp(scores[j] - m)
                    total += scores[j]
                o[:] = 0.0
                for b0 in range(0, n_keys, bs):                  # the weighted sum of the values
                    v_block = v_pool[layer, tables[r, b0 // bs], g]
                    for j in range(min(bs, n_keys - b0)):
                        p = scores[b0 + j]
                        for d in range(hd):
                            o[d] += p * v_block[j, d]
                for d in range(hd):
                    o[d] /= total
        _linear_rows(att, wo[layer], bo[layer], res)
        for r in range(nb):
            for i in range(c):
                x[r, i] += res[r, i]
        _layer_norm_rows(x, ln[layer, 2], ln[layer, 3], eps, h)
        _linear_rows(h, wfc[layer], bfc[layer], hid)
        for r in range(nb):
            for i in range(hid.shape[1]):                        # GELU, tanh form (lesson 09)
                u = hid[r, i]
                hid[r, i] = 0.5 * u * (1.0 + math.tanh(0.7978845608028654 * (u + 0.044715 * (u * u * u))))
        _linear_rows(hid, wp2[layer], bp2[layer], res)
        for r in range(nb):
            for i in range(c):
                x[r, i] += res[r, i]
    _layer_norm_rows(x, lnf[0], lnf[1], eps, h)
    for o in range(out_rows.shape[0]):
        r = out_rows[o]
        for t in range(wte.shape[0]):                            # the output layer, tied to wte
            s = dt.type(0)
            for i in range(c):
                s += h[r, i] * wte[t, i]
            logits[o, t] = s


def _shown_ids(tokens: Any) -> str:
    """Token ids as an error message shows them: the values and, for an array, its dtype."""
    if isinstance(tokens, np.ndarray):
        return f"{tokens.tolist()!r} (an array of dtype {tokens.dtype})"
    return repr(tokens) if len(repr(tokens)) <= 80 else repr(tokens)[:77] + "..."


class FusedDecoder:
    """The engine's fused decode step for the GPTWeights W: __call__(cache, seqs, tokens) appends
    one token to each sequence of a PagedKVCache and returns the logits (len(seqs), vocab) in W's
    dtype, equal to paged_forward(W, cache, seqs, [[t] for t in tokens]) up to rounding. The
    weights are packed once, here; Numba compiles the kernel at the first call for each dtype."""

    def __init__(self, W: Any):
        self.W = W
        self.packed = self.pack(W)

    @staticmethod
    def pack(W: Any) -> tuple[np.ndarray, ...]:
        """W's parameters as fused_decode_kernel takes them: wte, wpe, ln, wqkv, bqkv, wo, bo, wfc,
        bfc, wp2, bp2, lnf, each C-contiguous in W's dtype, per-layer arrays stacked on axis 0."""
        p, layers = W.params, range(W.n_layer)

        def stack(name: str) -> np.ndarray:
            return np.ascontiguousarray(np.stack([p[f"blocks.{i}.{name}"] for i in layers]), dtype=W.dtype)

        wqkv = np.stack([np.concatenate([p[f"blocks.{i}.attn.{n}.weight"] for n in "qkv"], axis=1) for i in layers])
        bqkv = np.stack([np.concatenate([p[f"blocks.{i}.attn.{n}.bias"] for n in "qkv"]) for i in layers])
        ln = np.stack([[p[f"blocks.{i}.{n}"] for n in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")]
                       for i in layers])
        arrays = (p["wte.weight"], p["wpe.weight"], ln, wqkv, bqkv, stack("attn.proj.weight"), stack("attn.proj.bias"),
                  stack("mlp.fc.weight"), stack("mlp.fc.bias"), stack("mlp.proj.weight"), stack("mlp.proj.bias"),
                  np.stack([p["ln_f.weight"], p["ln_f.bias"]]))
        return tuple(np.ascontiguousarray(a, dtype=W.dtype) for a in arrays)

    def warm_up(self) -> None:
        """Compile the kernel for W's dtype now (one step on a scratch cache of one block), not at the
        first request."""
        from minitorch.serve import PagedKVCache

        W = self.W
        scratch = PagedKVCache(W.n_layer, W.n_kv_head, W.head_dim, 1, 1, W.dtype)
        scratch.add(0)
        self(scratch, [0], [0])

    def __call__(self, cache: Any, seqs: Sequence[Any], tokens: Any) -> np.ndarray:
        """Append one token to each sequence: the logits (len(seqs), vocab)."""
        W = self.W
        ids = np.asarray(tokens) if isinstance(tokens, (list, tuple, np.ndarray)) else np.asarray([tokens])
        if ids.ndim != 1 or len(ids) != len(seqs) or ids.dtype.kind not in "iu" or \
                not all(0 <= t < W.vocab_size for t in ids.tolist()):
            raise ValueError(f"FusedDecoder: tokens must be one token id in [0, {W.vocab_size}) for each of the "
                             f"{len(seqs)} seqs, got {_shown_ids(tokens)}")
        return self.forward(cache, seqs, ids[:, None])

    def forward(self, cache: Any, seqs: Sequence[Any], chunks: Any) -> np.ndarray:
        """paged_forward's step in one kernel call: chunks[i] (t_i >= 1,) new tokens of sequence
        seqs[i] (distinct), appended to the cache; returns the logits (len(seqs), vocab) of each
        chunk's last token, in W's dtype. Each token is a row of the kernel."""
        W = self.W
        if not isinstance(chunks, (list, tuple, np.ndarray)):
            raise TypeError(f"FusedDecoder.forward: chunks must be a list of token-id chunks, one per seq, got "
                            f"{_shown_ids(chunks)}")
        if not isinstance(seqs, (list, tuple)):
            raise TypeError(f"FusedDecoder.forward: seqs must be a list of sequence ids, got {_shown_ids(seqs)}")
        if not (hasattr(cache, "k") and hasattr(cache, "lengths") and hasattr(cache, "blocks_needed")):
            raise TypeError(f"FusedDecoder.forward: cache must be a PagedKVCache, got {type(cache).__name__}")
        chunks = [np.asarray(c).reshape(-1) for c in chunks]
        if len(chunks) != len(seqs) or len(set(seqs)) != len(seqs) or any(
                len(c) == 0 or c.dtype.kind not in "iu" or c.min() < 0 or c.max() >= W.vocab_size for c in chunks):
            raise ValueError(f"FusedDecoder.forward: chunks must be a non-empty chunk of token ids in [0, {W.vocab_size}) "
                             f"for each of the {len(seqs)} seqs (distinct), got {len(chunks)} chunks "
                             f"{[c.tolist() for c in chunks]} of dtypes {sorted({c.dtype.name for c in chunks})}")
        if cache.k.dtype != W.dtype or cache.k.shape[2:] != (W.n_kv_head, cache.block_size, W.head_dim):
            raise ValueError(f"FusedDecoder: the cache {cache.k.shape} {cache.k.dtype} does not fit the model "
                             f"({W.n_kv_head} KV heads of {W.head_dim}, {W.dtype})")
        sizes = [len(c) for c in chunks]
        starts = [cache.lengths[s] for s in seqs]
        if seqs and max(a + n for a, n in zip(starts, sizes)) > W.block_size:
            raise ValueError(f"FusedDecoder: position {max(a + n for a, n in zip(starts, sizes)) - 1} is past the "
                             f"context of {W.block_size}")
        need = sum(cache.blocks_needed(s, n) for s, n in zip(seqs, sizes))
        if need > cache.num_free:
            raise RuntimeError(f"FusedDecoder: the step needs {need} blocks, {cache.num_free} are free")
        for s, n in zip(seqs, sizes):
            cache.append(s, n)
        logits = np.empty((len(seqs), W.vocab_size), W.dtype)
        if not seqs:
            return logits
        if max(sizes) == 1:                                      # decodes only: one row per sequence
            tokens = np.concatenate(chunks).astype(np.int64)
            positions, tables = np.array(starts, dtype=np.int64), cache.block_table(seqs)
        else:
            rows = np.repeat(np.arange(len(seqs)), sizes)
            tokens = np.concatenate(chunks).astype(np.int64)
            positions = np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in zip(starts, sizes)])
            tables = cache.block_table(seqs)[rows]
        out_rows = np.cumsum(sizes, dtype=np.int64) - 1          # each chunk's last token
        fused_decode_kernel(tokens, positions, tables, *self.packed, cache.k, cache.v, W.n_head, W.ln_eps,
                            out_rows, logits)
        return logits


def decode_speeds(W: Any, n_tokens: int, engine: Callable[..., Any], prompt_len: int = 16, repeats: int = 3,
                  no_cache_repeats: int = 1, seed: int = 0, progress: bool = False) -> dict[str, np.ndarray]:
    """Seconds of each of n_tokens greedy steps of one sequence after a random prompt_len-token
    prompt (step 0 is the prompt's prefill), four ways: "no cache" (lesson 11's gpt_forward on
    every token each step), "lesson 11" (its dense-cache step, forward_cached), and the engine's
    step (`engine`, the Engine class, one request) with decode="reference" and "fused". All on one
    thread (NumPy's BLAS limited to one, like the fused step). Per step the fastest of `repeats`
    interleaved runs (no_cache_repeats for the slow one). prompt_len + n_tokens must fit
    W.block_size. progress: a progress bar (tqdm.auto), one step per run."""
    from tqdm.auto import tqdm

    from minitorch.bench import blas_limit
    from minitorch.serve import decode_latencies

    prompt = np.random.default_rng(seed).integers(0, W.vocab_size, prompt_len)

    def engine_run(decode: str) -> np.ndarray:
        eng = engine(W, num_blocks=-(-W.block_size // 8), block_size=8, max_running=1,
                     max_num_batched_tokens=prompt_len, prefix_caching=False, decode=decode)
        eng.add_request(prompt, n_tokens)
        out = np.empty(n_tokens)
        for i in range(n_tokens):
            t0 = time.perf_counter()
            eng.step()
            out[i] = time.perf_counter() - t0
        return out

    runs = {k: np.full(n_tokens, np.inf) for k in ("no cache", "lesson 11", "engine reference", "engine fused")}
    with blas_limit(1), tqdm(total=1 + no_cache_repeats + 3 * repeats, desc="decode runs", unit="run",
                             disable=not progress) as bar:
        engine_run("fused")                                      # compile the kernel
        bar.update()
        for i in range(max(repeats, no_cache_repeats)):
            if i < no_cache_repeats:
                runs["no cache"] = np.minimum(runs["no cache"], decode_latencies(W, prompt, n_tokens, use_cache=False))
                bar.update()
            if i < repeats:
                runs["lesson 11"] = np.minimum(runs["lesson 11"], decode_latencies(W, prompt, n_tokens))
                runs["engine reference"] = np.minimum(runs["engine reference"], engine_run("reference"))
                runs["engine fused"] = np.minimum(runs["engine fused"], engine_run("fused"))
                bar.update(3)
    return runs


def print_decode_speeds(runs: dict[str, np.ndarray], W: Any, prompt_len: int = 16) -> None:
    """The table of decode_speeds: tokens/s after N tokens (N / the time of the first N steps)."""
    n_max = len(runs["lesson 11"])
    print(f"decode of one sequence, greedy, {np.dtype(W.dtype).name}, {W.n_layer} layers, d = {W.n_embd}, "
          f"{W.n_head} heads, {W.block_size}-token context, {prompt_len}-token prompt; tokens/s after N tokens")
    print(f"{'N':>5} {'no cache':>9} {'lesson 11':>10} {'engine ref':>11} {'engine fused':>13} {'fused / L11':>12} "
          f"{'cache / no cache: L11':>22} {'fused':>6}")
    for n in (64, 128, 256, 512, 1024):
        if n > n_max:
            break
        rate = {k: n / v[:n].sum() for k, v in runs.items()}
        print(f"{n:>5} {rate['no cache']:>9,.0f} {rate['lesson 11']:>10,.0f} {rate['engine reference']:>11,.0f} "
              f"{rate['engine fused']:>13,.0f} {rate['engine fused'] / rate['lesson 11']:>11.2f}x "
              f"{rate['lesson 11'] / rate['no cache']:>21.1f}x {rate['engine fused'] / rate['no cache']:>5.1f}x")


from minitorch.checks import (Attrs, Func, Instance, Int, Optional, Positive, Seq, Size, Str, Unchecked,  # noqa: E402
                              validate_public)

validate_public(globals(), {
    "uvicorn_server": {"app": Func(), "header_timeout": Positive, "max_connections": Optional(Size),
                       "max_header_bytes": Size},
    "ServerThread": {"app": Func(), "port": Int(0, 65535), "graceful_timeout": Positive},
    "ServerThread.start": {"timeout": Positive},
    "ServerThread.stop": {"timeout": Positive},
    "ServerProcess": {"port": Int(0, 65535)},
    "process_threads": {"pid": Int(0)},
    "sample_workload": {"n": Int(0), "prompt_len": Seq(Int(1), min_len=2), "output_len": Seq(Int(1), min_len=2)},
    "run_load": {"workload": Seq(), "max_concurrency": Optional(Size), "timeout": Positive},
    "FrontDoor": {"protected": Seq(Str())},
    "add_front_door": {"app": Attrs("add_middleware"), "allowed_origins": Optional(Seq(Str())),
                       "allowed_hosts": Optional(Seq(Str())), "max_body_bytes": Size, "body_timeout": Positive},
    "guarded_protocol": {"header_timeout": Positive, "max_connections": Optional(Size), "max_header_bytes": Size},
    "FusedDecoder": {"W": Attrs("params", "n_layer", "n_head", "vocab_size", "block_size", "dtype")},
    "FusedDecoder.__call__": {"cache": Attrs("k", "v", "lengths", "block_size"), "seqs": Seq()},
    "FusedDecoder.forward": {"cache": Unchecked(), "seqs": Unchecked(),   # once per step: its own checks
                             "chunks": Unchecked()},
    "decode_speeds": {"W": Attrs("params", "vocab_size", "block_size"), "n_tokens": Size, "engine": Func(),
                      "prompt_len": Size, "repeats": Size, "no_cache_repeats": Size},
    "print_decode_speeds": {"runs": Instance(dict, must="decode_speeds' dict of timings"),
                            "W": Attrs("dtype", "n_layer", "n_embd", "n_head", "block_size"), "prompt_len": Size},
})
