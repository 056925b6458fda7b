# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.server_kit: the machinery around lesson 15's server that the student reads but does
not write: the lecture page, uvicorn in a thread, the load generator's HTTP plumbing, and the
engine's fused decode step (one Numba function for a whole decode step of the tiny GPT)."""
from __future__ import annotations

import asyncio
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
        tokens = np.asarray(tokens).reshape(-1)
        if len(tokens) != len(seqs) or tokens.dtype.kind not in "iu" or \
                not all(0 <= t < W.vocab_size for t in tokens.tolist()):
            raise ValueError(f"FusedDecoder: expected one token id in [0, {W.vocab_size}) for each of {len(seqs)} "
                             f"sequences, got {tokens.tolist()}")
        return self.forward(cache, seqs, tokens[:, None])

    def forward(self, cache: Any, seqs: Sequence[Any], chunks: Sequence[Any]) -> np.ndarray:
        """paged_forward's step in one kernel call: chunks[i] (t_i >= 1,) new tokens of sequence
        seqs[i] (distinct), appended to the cache; returns the logits (len(seqs), vocab) of each
        chunk's last token, in W's dtype. Each token is a row of the kernel."""
        W = self.W
        chunks = [np.asarray(c).reshape(-1) for c in chunks]
        if len(chunks) != len(seqs) or len(set(seqs)) != len(seqs) or any(
                len(c) == 0 or c.dtype.kind not in "iu" or c.min() < 0 or c.max() >= W.vocab_size for c in chunks):
            raise ValueError(f"FusedDecoder: expected a non-empty chunk of token ids in [0, {W.vocab_size}) for each "
                             f"of {len(seqs)} distinct sequences, got {len(chunks)} chunks {[c.tolist() for c in chunks]}")
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
                  no_cache_repeats: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Seconds of each of n_tokens greedy steps of one sequence after a random prompt_len-token
    prompt (step 0 is the prompt's prefill), four ways: "no cache" (lesson 11's gpt_forward on
    every token each step), "lesson 11" (its dense-cache step, forward_cached), and the engine's
    step (`engine`, the Engine class, one request) with decode="reference" and "fused". All on one
    thread (NumPy's BLAS limited to one, like the fused step). Per step the fastest of `repeats`
    interleaved runs (no_cache_repeats for the slow one). prompt_len + n_tokens must fit
    W.block_size."""
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
    with blas_limit(1):
        engine_run("fused")                                      # compile the kernel
        for i in range(max(repeats, no_cache_repeats)):
            if i < no_cache_repeats:
                runs["no cache"] = np.minimum(runs["no cache"], decode_latencies(W, prompt, n_tokens, use_cache=False))
            if i < repeats:
                runs["lesson 11"] = np.minimum(runs["lesson 11"], decode_latencies(W, prompt, n_tokens))
                runs["engine reference"] = np.minimum(runs["engine reference"], engine_run("reference"))
                runs["engine fused"] = np.minimum(runs["engine fused"], engine_run("fused"))
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
