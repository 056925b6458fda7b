# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.serving_kit: the machinery around lesson 15's server that the student reads but does
not write: the lecture page, uvicorn in a thread or a process, the front door (limits, API key,
CORS, Host), and the load generator's HTTP plumbing (vLLM's benchmark_serving client). The
engine's fused decode step is minitorch.fused_decode."""
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
    """`minitorch.api_server.serve(port=..., **serve_kw)` in a child process (its own interpreter, so
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
        code = f"from minitorch.api_server import serve; serve(host={self.host!r}, port={self.port}{args})"
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


from minitorch.checks import Attrs, Func, Int, Optional, Positive, Seq, Size, Str, validate_public  # noqa: E402

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
})
