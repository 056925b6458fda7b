# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.server_kit: the machinery around lesson 15's server that the student reads but does
not write: the lecture page, uvicorn in a thread, and the load generator's HTTP plumbing."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
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
<p>max tokens <input id="max" type="number" value="40" min="1" max="63">
temperature <input id="temp" type="number" value="0" min="0" step="0.1">
<button id="go">Generate</button></p>
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
                max_tokens: +document.getElementById("max").value,
                temperature: +document.getElementById("temp").value};
  const r = await fetch("/v1/completions", {method: "POST", headers: {"Content-Type": "application/json"},
                                            body: JSON.stringify(body)});
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


def uvicorn_server(app: Any, **config: Any) -> Any:
    """A uvicorn.Server for `app` (keyword arguments: uvicorn.Config's) whose second Ctrl-C also
    aborts the app's engine (abort_engine), so that it stops at once on every Python."""
    import uvicorn

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
    stops at once, like a second Ctrl-C."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, graceful_timeout: float = 30.0):
        self.app, self.host, self.port = app, host, port or free_port(host)
        self.server = uvicorn_server(app, host=self.host, port=self.port, log_level="warning",
                                     timeout_graceful_shutdown=graceful_timeout, lifespan="on")
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
        import signal  # noqa: F401 - used in __exit__
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


def sample_workload(n: int, rng: Any = 0, prompt_len: tuple[int, int] = (8, 32),
                    output_len: tuple[int, int] = (8, 24)) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs: prompts are slices of the tiny GPT's corpus with lengths
    uniform in prompt_len (inclusive), max_tokens uniform in output_len (inclusive)."""
    from minitorch.gpt import load_corpus

    rng = np.random.default_rng(rng)
    text = load_corpus()
    out = []
    for _ in range(n):
        length = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        start = int(rng.integers(0, len(text) - length))
        out.append((text[start:start + length], int(rng.integers(output_len[0], output_len[1] + 1))))
    return out


async def _one_request(client: Any, url: str, model: str, prompt: str, max_tokens: int, send_at: float,
                       sem: asyncio.Semaphore | None) -> dict[str, Any]:
    delay = send_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if sem is not None:
        await sem.acquire()
    start, times, text, status = time.perf_counter(), [], [], 0
    try:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            status = r.status_code
            if status == 200:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        piece = json.loads(line[6:])["choices"][0]["text"]
                        if piece:
                            times.append(time.perf_counter())
                            text.append(piece)
    except Exception as exc:  # a refused or broken connection is a failed request, not a crash
        status = -1
        text.append(repr(exc))
    finally:
        if sem is not None:
            sem.release()
    return {"start": start, "token_times": times, "status": status, "text": "".join(text),
            "max_tokens": max_tokens}


def run_load(url: str, workload: list[tuple[str, int]], arrivals: Any, model: str = "tiny-gpt",
             max_concurrency: int | None = None, timeout: float = 120.0) -> tuple[list[dict[str, Any]], float]:
    """Send workload[i] (prompt, max_tokens) to url/v1/completions, streamed, at arrivals[i]
    seconds after the start (open loop: a request is sent on time whatever the others do), at
    most max_concurrency at once (None: no limit). Returns (one dict per request: start,
    token_times, status, text, max_tokens; the wall time from the first send to the last
    answer). Runs its own event loop in a thread, so it works inside a notebook."""
    import httpx

    result: dict[str, Any] = {}

    async def main() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
            t0 = time.perf_counter()
            tasks = [_one_request(client, url, model, p, m, t0 + float(a), sem)
                     for (p, m), a in zip(workload, arrivals)]
            result["records"] = await asyncio.gather(*tasks)
            result["duration"] = time.perf_counter() - t0

    def target() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="load-generator")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["records"], result["duration"]
