# %% [markdown]
# # Lesson 15 (capstone): serve the tiny GPT over HTTP, under load
#
# Lessons 09-11 built a model, made it smaller and made generating from it cheap: a paged KV
# cache, a block allocator with shared prefixes, continuous batching. This lesson puts all of it
# behind a real HTTP server, split the way vLLM splits it (Kwon et al. 2023; vLLM's
# `LLMEngine`, scheduler and `KVCacheManager`):
#
# - an **engine**: a step loop in a background thread. Each step admits waiting requests,
#   schedules prefill chunks and decodes against a per-step token budget (chunked prefill,
#   Agrawal et al. 2024, "Sarathi-Serve"), runs one batched model step (prefills through lesson
#   11's `paged_forward`, decodes through a fused decode step compiled with Numba), samples,
#   retires finished requests, and preempts when the cache runs out;
# - **prefix caching**: full KV blocks are named by a hash chained over the tokens they hold, so
#   a new request whose prompt starts like an earlier one reuses its blocks (vLLM's automatic
#   prefix caching; SGLang's RadixAttention, Zheng et al. 2024);
# - an **HTTP layer** in the form clients already speak: OpenAI's `/v1/completions` and
#   `/v1/chat/completions`, streamed as server-sent events, with `/v1/models`, `/health` and
#   Prometheus `/metrics`, on FastAPI and uvicorn;
# - a **load generator** in the style of vLLM's `benchmark_serving.py`: Poisson arrivals at a
#   given rate, TTFT / TPOT / inter-token latency percentiles, throughput and *goodput* (requests
#   per second that meet a latency SLO, Zhong et al. 2024, "DistServe").
#
# You write five pieces: 15.1 prefix caching, 15.2 the engine's scheduling step, 15.3 token
# streaming as server-sent events, 15.4 the metrics (Prometheus histograms, latency
# percentiles), 15.5 the load generator's arrival schedule and goodput. The server around them,
# the page, the load generator's HTTP plumbing and the fused decode step are given
# (`minitorch/server_kit.py`).
# The course's reference version is `minitorch/server.py`. Background: why decode is
# memory-bound and what batching buys, in [inference](../hardware_notes/inference.md#serving);
# the roofline in [roofline](../hardware_notes/roofline.md).
#
# Conventions: token ids are int64 arrays; times are `time.perf_counter()` seconds; the model
# runs in float64 where outputs are compared token for token, float32 where speed is measured.
# `make serve` starts the server for a lecture; open the address it prints.

# %%
import os
import time

import numpy as np

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %%
#| default_exp server
#| export
"""minitorch.server: an inference server for lesson 09's tiny GPT: an engine with a step loop
(admission, chunked prefill, decode, preemption, retirement, prefix caching) over lesson 11's
paged KV cache, an OpenAI-compatible HTTP API with streaming and Prometheus metrics, and the
pieces of a load generator (arrivals, latency statistics, goodput)."""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request  # FastAPI reads the handlers' annotations from the module's names

from minitorch.gpt import CharTokenizer, load_tiny_gpt
from minitorch.serve import GPTWeights, PagedKVCache, gpt_weights, paged_forward, sample_token
from minitorch.server_kit import FusedDecoder

# %%
#| export server_kit
#| given
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


# %% [markdown]
# ## 1. Requests, and the engine's state
#
# A request carries its prompt, how many tokens to generate, how to sample (temperature and a
# seed: each request owns its random generator, so a seeded request gives the same tokens
# whatever else is in the batch), and the engine's bookkeeping: `num_computed`, how many of its
# tokens (prompt and output so far) have their keys and values in the cache. A request needs
# the next token when `num_computed == len(tokens)`: the logits of its last token are then
# fresh. A *prefill* is any chunk of more than one token; a *decode* feeds exactly the last
# sampled token. Preempting a request frees its blocks and sets `num_computed` to 0: it keeps
# its output and recomputes (vLLM's default recompute preemption).
#
# The engine calls `on_token(token)` from its thread for every token, and `on_token(None)` once
# when the request ends (`finish_reason`: `"length"` or `"abort"`).

# %%
#| export
FUSED_CHUNK_MAX = 32   # longer prefill chunks go through paged_forward (BLAS), shorter ones the fused step


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its bound: the caller should retry later (HTTP 429)."""

    def __init__(self, waiting: int, retry_after: float):
        super().__init__(f"the server is busy: {waiting} requests are waiting; retry in {retry_after:.0f} s")
        self.retry_after = retry_after


def check_generation(where: str, prompt: Any, max_tokens: Any, temperature: Any, vocab_size: int,
                     context: int) -> np.ndarray:
    """The prompt as a 1-D array of token ids, after checking a request the engine could never
    serve: ValueError naming the value and the bound (no ids, ids outside [0, vocab_size),
    max_tokens not an integer >= 1, prompt + max_tokens past the context, temperature < 0)."""
    prompt = np.asarray(prompt).reshape(-1)
    if len(prompt) < 1 or prompt.dtype.kind not in "iu" or prompt.min() < 0 or prompt.max() >= vocab_size:
        raise ValueError(f"{where}: the prompt must be >= 1 token ids in [0, {vocab_size}), "
                         f"got {len(prompt)} of dtype {prompt.dtype}")
    if isinstance(max_tokens, bool) or int(max_tokens) != max_tokens or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    if len(prompt) + max_tokens > context:
        raise ValueError(f"{where}: {len(prompt)} prompt tokens + {max_tokens} new tokens pass the "
                         f"model's context of {context} tokens")
    if not temperature >= 0:
        raise ValueError(f"{where}: temperature must be >= 0, got {temperature}")
    return prompt


@dataclass(eq=False)
class GenRequest:
    """One generation request inside the engine. prompt: (P,) int64 token ids; max_tokens >= 1;
    temperature >= 0 (0: greedy); seed for its own sampler. output: the tokens generated;
    num_computed: tokens whose K/V are in the cache; token_times: perf_counter() at each output
    token; arrival: perf_counter() when the engine accepted it."""

    id: str
    prompt: np.ndarray
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    on_token: Callable[[int | None], None] | None = None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.prompt = np.asarray(self.prompt, dtype=np.int64).reshape(-1)
        self.rng = np.random.default_rng(self.seed)

    @property
    def tokens(self) -> np.ndarray:
        """Prompt and output so far, (P + len(output),) int64."""
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int64)])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

# %% [markdown]
# ## 2. Prefix caching
#
# Many requests share a beginning: a system prompt, a few-shot preamble, the conversation so far.
# Their keys and values at those positions are the same numbers, so they can live in the same
# blocks. The question is how to find a block for a prefix. vLLM names every *full* block by a
# hash of its tokens *and of the hash of the block before it*:
#
#     h_0 = hash((0, tokens[0:B])),   h_i = hash((h_{i-1}, tokens[i*B:(i+1)*B]))
#
# Chained, because a key at position j depends on every token before j: two blocks with the same
# tokens after different prefixes hold different keys and must not be shared. A dictionary from
# hash to block then finds the longest cached prefix of a new prompt block by block.
#
# The cache holds one reference to each block it remembers (lesson 11's `BlockAllocator.share`),
# so a block outlives the request that filled it. A block that only the cache holds
# (reference count 1) is *evictable*: when the pool runs short the engine evicts the least
# recently used ones. Partial blocks are never cached, so a new request never writes into a
# shared block (no copy-on-write needed). At least the prompt's last token is always computed:
# its logits give the first output token.
#
# **Exercise 15.1.** Write `block_hashes` (the chain, one hash per full block) and, in
# `PrefixCache`, `admit` (start a sequence on the longest chain of cached blocks, sharing them),
# `register` (remember a sequence's full blocks) and `evict` (free least recently used blocks
# that only the cache holds). Use Python's `hash` of a tuple `(previous hash, tuple of ints)`.

# %%
#| export
#| exercise 15.1
def block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """The chained hashes of the full blocks of `tokens` (1-D ids): len(tokens) // block_size ints,
    h_0 = hash((0, block 0 as a tuple of ints)), h_i = hash((h_{i-1}, block i as a tuple of ints))."""
    ### BEGIN SOLUTION
    ids = [int(t) for t in np.asarray(tokens).reshape(-1)]
    out, prev = [], 0
    for i in range(len(ids) // block_size):
        prev = hash((prev, tuple(ids[i * block_size:(i + 1) * block_size])))
        out.append(prev)
    return out
    ### END SOLUTION


class PrefixCache:
    """Full KV blocks of a PagedKVCache, found by the chained hash of the tokens they hold.

    blocks: an OrderedDict hash -> block id, least recently used first; the cache holds one
    reference (allocator.share) to each block in it."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.blocks: OrderedDict[int, int] = OrderedDict()

    @property
    def num_cached(self) -> int:
        """Blocks the prefix cache remembers."""
        return len(self.blocks)

    @property
    def num_evictable(self) -> int:
        """Blocks that only the prefix cache holds (reference count 1)."""
        return sum(self.cache.allocator.refcount(b) == 1 for b in self.blocks.values())

    def match(self, tokens: np.ndarray) -> list[int]:
        """The blocks of the longest chain of cached full blocks at the start of `tokens`, at most
        (len(tokens) - 1) // block_size of them. No side effects."""
        out = []
        for h in block_hashes(tokens, self.cache.block_size)[:(len(tokens) - 1) // self.cache.block_size]:
            if h not in self.blocks:
                break
            out.append(self.blocks[h])
        return out

    def admit(self, seq: Any, tokens: np.ndarray) -> int:
        """Add sequence `seq` to the paged cache holding the longest cached prefix of `tokens`
        (1-D ids): its table is those blocks (each shared: one more reference), its length their
        tokens; they become the most recently used. Returns that length (a multiple of
        block_size, at most len(tokens) - 1)."""
        ### BEGIN SOLUTION
        hashes = block_hashes(tokens, self.cache.block_size)[:(len(tokens) - 1) // self.cache.block_size]
        table = []
        for h in hashes:
            if h not in self.blocks:
                break
            block = self.blocks[h]
            self.cache.allocator.share(block)
            self.blocks.move_to_end(h)
            table.append(block)
        self.cache.add(seq)
        self.cache.tables[seq] = table
        self.cache.lengths[seq] = len(table) * self.cache.block_size
        return self.cache.lengths[seq]
        ### END SOLUTION

    def register(self, seq: Any, tokens: np.ndarray) -> int:
        """Remember the full blocks of sequence `seq`, whose cached tokens are `tokens` (1-D, the
        sequence's cache.lengths[seq] tokens): block i of its table under the chained hash of
        blocks 0..i, unless that hash is cached already; take one reference to each block added.
        Returns the number of blocks added."""
        ### BEGIN SOLUTION
        table = self.cache.tables[seq]
        added = 0
        for i, h in enumerate(block_hashes(tokens, self.cache.block_size)):
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            self.cache.allocator.share(table[i])
            self.blocks[h] = table[i]
            added += 1
        return added
        ### END SOLUTION

    def evict(self, n: int) -> int:
        """Free up to n blocks that only the prefix cache holds (reference count 1), least
        recently used first, and forget them. Returns the number freed."""
        ### BEGIN SOLUTION
        freed = 0
        for h, block in list(self.blocks.items()):
            if freed >= n:
                break
            if self.cache.allocator.refcount(block) == 1:
                del self.blocks[h]
                self.cache.allocator.release(block)
                freed += 1
        return freed
        ### END SOLUTION

    def clear(self) -> None:
        """Drop every cached block (release the cache's references)."""
        for block in self.blocks.values():
            self.cache.allocator.release(block)
        self.blocks.clear()

# %% [markdown]
# Two prompts that share their first 9 tokens, blocks of 4: the second reuses 2 blocks (8
# tokens); the ninth token is in a partial block and is computed again.

# %%
from minitorch.serve import load_tiny_weights

W64 = load_tiny_weights(np.float64)
try:
    pc_cache = PagedKVCache.for_model(W64, block_size=4, num_blocks=12)
    pc = PrefixCache(pc_cache)
    a = np.arange(13) % 50
    pc_cache.add("a")
    paged_forward(W64, pc_cache, ["a"], [a])
    print("blocks of a:", pc_cache.tables["a"], "registered:", pc.register("a", a))
    b = np.concatenate([a[:9], [7, 7, 7]])
    print("b starts with", pc.admit("b", b), "cached tokens; its table:", pc_cache.tables["b"])
except NotImplementedError as exc:
    print("not attempted:", exc)

# %% tags=["check"]
check("15.1")

# %% [markdown]
# ## 3. The engine
#
# One call of `step()` is one iteration of the model over a batch, as in lesson 11's
# `Scheduler`, with three things added: a **token budget** per step
# (`max_num_batched_tokens`), **chunked prefill** (a long prompt is fed over several steps, a
# chunk at a time, so that a long prefill does not stall every running decode: Agrawal et al.
# 2024), and **prefix caching** at admission.
#
# `schedule()` decides the step and returns the plan: a list of `(request, n)`, feed `n` tokens
# of that request, starting at its `num_computed`. The policy (vLLM's V1 scheduler, simplified):
#
# 1. Running requests first, in admission order. Each gets `min(tokens it still has to feed,
#    budget left)` (1 for a decode). If the blocks that needs (`cache.blocks_needed`) do not fit
#    the free blocks, less those already promised to this step, after evicting from the prefix
#    cache (`self._fits`), preempt the *newest* running request (`self._preempt`) until it fits;
#    if the newest is this request itself, it is preempted and the loop ends.
# 2. Then, only if nobody was preempted in this step, waiting requests in arrival order while
#    the budget lasts and fewer than `max_running` run: admit (`self._admit`: with the prefix
#    cache when enabled), take `min(tokens to feed, budget)` and stop at the first one whose
#    blocks do not fit (undo its admission with `self._unadmit`).
#
# `step()` (given) runs the plan through the model (`paged_forward`; single-token chunks through
# the fused decode step of section 9), samples where a request's last token was fed, retires
# requests that are done (their blocks go back, full ones to the prefix cache first), and
# records the step. The tests check the plan's structure: the budget respected,
# decodes first, every request served exactly as if alone, the pool empty when idle.
#
# **Exercise 15.2.** Write `Engine.schedule`.

# %%
#| export
#| exercise 15.2
class Engine:
    """Continuous batching over a paged KV cache, with chunked prefill and prefix caching.

    W: the model's weights; num_blocks blocks of block_size tokens; at most max_running requests
    in the cache and max_waiting in the queue (more: QueueFull); at most max_num_batched_tokens
    tokens fed per step; prefix_caching on or off, or a class to use for it (PrefixCache's
    interface); step_interval: each step of the background loop lasts at least this many seconds
    (slow motion for a lecture or a test); decode: "fused" runs the step's single-token chunks
    through one compiled function (FusedDecoder, section 9) and the longer chunks through
    paged_forward, "reference" runs everything through lesson 11's paged_forward."""

    def __init__(self, W: GPTWeights, num_blocks: int = 64, block_size: int = 8, max_running: int = 32,
                 max_waiting: int = 256, max_num_batched_tokens: int = 48, prefix_caching: Any = True,
                 step_interval: float = 0.0, history: int = 4096, decode: str = "fused"):
        if num_blocks * block_size < W.block_size:
            raise ValueError(f"Engine: {num_blocks} blocks of {block_size} tokens cannot hold one request of the "
                             f"model's context ({W.block_size} tokens)")
        for name, value in (("max_running", max_running), ("max_waiting", max_waiting),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if int(value) < 1:
                raise ValueError(f"Engine: {name} must be >= 1, got {value}")
        if decode not in ("fused", "reference"):
            raise ValueError(f"Engine: decode must be 'fused' or 'reference', got {decode!r}")
        self.W = W
        self.decoder = FusedDecoder(W) if decode == "fused" else None
        self.cache = PagedKVCache.for_model(W, block_size, num_blocks)
        kind = PrefixCache if prefix_caching is True else prefix_caching
        self.prefix = kind(self.cache) if kind else None
        self.max_running, self.max_waiting = int(max_running), int(max_waiting)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.step_interval = float(step_interval)
        self.waiting: deque[GenRequest] = deque()
        self.running: list[GenRequest] = []
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: Exception | None = None
        self.steps = 0
        self.records: deque[dict[str, Any]] = deque(maxlen=history)
        self.finished: deque[GenRequest] = deque(maxlen=history)
        self.counters = {"generated_tokens": 0, "prompt_tokens": 0, "prefix_query_tokens": 0,
                         "prefix_hit_tokens": 0, "preemptions": 0, "finished": 0, "aborted": 0, "rejected": 0,
                         "peak_running": 0}
        self._recent: deque[tuple[float, int]] = deque()   # (time, tokens) of recent steps, for tokens/s
        self._in_forward = False                           # a step's model call runs (without the lock)
        self._deferred: list[GenRequest] = []              # requests aborted meanwhile: freed after it

    # ---------------------------------------------------------------- requests in and out
    def add_request(self, prompt: Any, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                    on_token: Callable[[int | None], None] | None = None) -> GenRequest:
        """Queue a request; returns it. ValueError if it can never be served (bad ids, max_tokens <
        1, prompt + max_tokens past the model's context, temperature < 0); QueueFull if max_waiting
        requests wait; RuntimeError if the engine is shutting down."""
        prompt = check_generation("Engine.add_request", prompt, max_tokens, temperature, self.W.vocab_size,
                                  self.W.block_size)
        with self.lock:
            if self._stopping:
                raise RuntimeError("Engine.add_request: the engine is shutting down")
            if len(self.waiting) >= self.max_waiting:
                self.counters["rejected"] += 1
                raise QueueFull(len(self.waiting), self.retry_after())
            seed = int(np.random.default_rng().integers(2 ** 31)) if seed is None else int(seed)
            request = GenRequest(f"cmpl-{next(self._ids)}", prompt.astype(np.int64), int(max_tokens),
                                 float(temperature), seed, on_token)
            self.waiting.append(request)
            self._wake.notify_all()
        return request

    def abort(self, request: GenRequest) -> bool:
        """Stop a request at once (a client went away): its blocks go back to the pool now, or,
        if a step's model call is running over them, as soon as it returns. False if it had
        already finished."""
        with self.lock:
            if request.finished:
                return False
            if request in self.waiting:
                self.waiting.remove(request)
            elif request in self.running:
                if self._in_forward:
                    self._deferred.append(request)
                else:
                    self.running.remove(request)
                    self.cache.free(request.id)
            self.counters["aborted"] += 1
            self._finish(request, "abort")
            return True

    def retry_after(self) -> float:
        """Seconds after which a rejected client may try again: the waiting queue's work over the
        recent token rate, at least 1."""
        rate = max(self.tokens_per_s(), 1.0)
        work = sum(r.max_tokens for r in self.waiting) + sum(r.max_tokens - len(r.output) for r in self.running)
        return float(max(1, math.ceil(work / rate)))

    # ---------------------------------------------------------------- scheduling
    def _fits(self, need: int, promised: int) -> bool:
        """Whether `need` more blocks fit beside `promised` ones, evicting from the prefix cache."""
        short = promised + need - self.cache.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return promised + need <= self.cache.num_free

    def _preempt(self, request: GenRequest) -> None:
        """Free a running request's blocks and put it back at the head of the queue."""
        self.running.remove(request)
        self.cache.free(request.id)
        request.num_computed = 0
        request.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(request)

    def _admit(self, request: GenRequest) -> None:
        """Put a waiting request in the cache: num_computed becomes its cached prefix (0 without
        prefix caching)."""
        if self.prefix is not None:
            request.num_computed = self.prefix.admit(request.id, request.tokens)
        else:
            self.cache.add(request.id)
            request.num_computed = 0
        request.num_cached = request.num_computed

    def _unadmit(self, request: GenRequest) -> None:
        """Undo _admit (the request stays at the head of the queue)."""
        self.cache.free(request.id)
        request.num_computed = 0

    def schedule(self) -> list[tuple[GenRequest, int]]:
        """Plan one step: [(request, n tokens to feed)], running requests first, then admissions;
        moves preempted requests to self.waiting and admitted ones to self.running (in order).
        Every planned chunk fits the budget and the free blocks."""
        ### BEGIN SOLUTION
        plan: list[tuple[GenRequest, int]] = []
        budget, promised, preempted = self.max_num_batched_tokens, 0, False
        for request in list(self.running):
            if budget == 0 or request not in self.running:   # out of budget, or preempted below
                break
            n = min(request.num_tokens - request.num_computed, budget)
            need = self.cache.blocks_needed(request.id, n)
            while not self._fits(need, promised):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request not in self.running:
                break
            plan.append((request, n))
            budget -= n
            promised += need
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            self._admit(request)
            n = min(request.num_tokens - request.num_computed, budget)
            need = self.cache.blocks_needed(request.id, n)
            if not self._fits(need, promised):
                self._unadmit(request)
                break
            self.waiting.popleft()
            self.running.append(request)
            plan.append((request, n))
            budget -= n
            promised += need
        return plan
        ### END SOLUTION

    # ---------------------------------------------------------------- one step
    def step(self) -> dict[str, Any]:
        """Schedule, run the model once over the plan, sample, retire. Returns the step's record:
        chunks [(id, n)], decode and prefill ids, preempted and finished ids, tokens fed, blocks
        in use after the step."""
        with self.lock:
            before = {r.id: r.preemptions for r in self.running}
            plan = self.schedule()
            preempted = [r.id for r in self.waiting if r.preemptions > before.get(r.id, r.preemptions)]
            record: dict[str, Any] = {"chunks": [(r.id, n) for r, n in plan], "preempted": preempted,
                                      "decode": [r.id for r, n in plan if n == 1 and r.num_computed == r.num_tokens - 1],
                                      "finished": [], "tokens": sum(n for _, n in plan)}
            record["prefill"] = [r.id for r, _ in plan if r.id not in record["decode"]]
            for request, _ in plan:
                if request.id not in before:                  # admitted in this step
                    self.counters["prefix_query_tokens"] += request.num_tokens
                    self.counters["prefix_hit_tokens"] += request.num_cached
                    self.counters["prompt_tokens"] += request.num_tokens
            self._in_forward = bool(plan)
        # the model runs without the lock (the fused kernel without the interpreter's lock too), so
        # the HTTP thread can queue and abort requests meanwhile; an abort of a request in the plan
        # is deferred until the call returns (abort), since the call appends to its cache entry
        try:
            logits = self._forward(plan) if plan else None
        finally:
            with self.lock:
                self._in_forward = False
                for request in self._deferred:
                    self.running.remove(request)
                    self.cache.free(request.id)
                self._deferred.clear()
        with self.lock:
            if plan:
                now = time.perf_counter()
                new_tokens, bs = 0, self.cache.block_size
                for (request, n), row in zip(plan, logits):
                    if request.finished:                      # aborted during the model call
                        continue
                    request.num_computed += n
                    if request.num_computed == request.num_tokens:
                        token = sample_token(row, request.temperature, request.rng)
                        request.output.append(token)
                        request.token_times.append(now)
                        new_tokens += 1
                        if request.on_token is not None:
                            request.on_token(token)
                    if self.prefix is not None and (request.num_computed - n) // bs < request.num_computed // bs:
                        # a block filled up in this step: remember the sequence's full blocks
                        self.prefix.register(request.id, request.tokens[:request.num_computed])
                    if request.done:
                        self.running.remove(request)
                        self.cache.free(request.id)
                        self._finish(request, "length")
                        record["finished"].append(request.id)
                self.counters["generated_tokens"] += new_tokens
                self.counters["peak_running"] = max(self.counters["peak_running"], len(plan))
                self._recent.append((now, new_tokens))
            self.steps += 1
            record["blocks_used"] = self.blocks_used()
            self.records.append(record)
            return record

    def _forward(self, plan: list[tuple[GenRequest, int]]) -> np.ndarray:
        """Run the model over the plan's chunks: the logits (len(plan), vocab) of each chunk's last
        token. With the fused decoder, the decodes and the prefill chunks of up to FUSED_CHUNK_MAX
        tokens go through it in one call (FusedDecoder.forward: each new token a row of the kernel)
        and longer chunks through paged_forward, whose matrix products (NumPy's BLAS) are faster
        there; each token depends only on its own sequence's cache, so splitting the step changes
        no number. With decode="reference", everything goes through paged_forward."""
        chunks = [[r.prompt[r.num_computed] if r.num_computed < len(r.prompt)    # a decode: the token to feed
                   else r.output[r.num_computed - len(r.prompt)]] if n == 1
                  else r.tokens[r.num_computed:r.num_computed + n] for r, n in plan]
        if self.decoder is None:
            return paged_forward(self.W, self.cache, [r.id for r, _ in plan], chunks)
        short = [j for j, (_, n) in enumerate(plan) if n <= FUSED_CHUNK_MAX]
        if len(short) == len(plan):
            return self.decoder.forward(self.cache, [r.id for r, _ in plan], chunks)
        long = [j for j, (_, n) in enumerate(plan) if n > FUSED_CHUNK_MAX]
        logits = np.empty((len(plan), self.W.vocab_size), self.W.dtype)
        logits[long] = paged_forward(self.W, self.cache, [plan[j][0].id for j in long], [chunks[j] for j in long])
        if short:
            logits[short] = self.decoder.forward(self.cache, [plan[j][0].id for j in short], [chunks[j] for j in short])
        return logits

    def _finish(self, request: GenRequest, reason: str) -> None:
        request.finish_reason = reason
        if reason != "abort":
            self.counters["finished"] += 1
        self.finished.append(request)
        if request.on_token is not None:
            request.on_token(None)

    # ---------------------------------------------------------------- state
    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.running)

    def blocks_used(self) -> int:
        """Blocks held by requests (blocks that only the prefix cache holds are not counted)."""
        with self.lock:
            cached_only = self.prefix.num_evictable if self.prefix is not None else 0
            return self.cache.allocator.num_used - cached_only

    def tokens_per_s(self, window: float = 5.0) -> float:
        """Output tokens per second over the last `window` seconds."""
        now = time.perf_counter()
        with self.lock:
            while self._recent and self._recent[0][0] < now - window:
                self._recent.popleft()
            if not self._recent:
                return 0.0
            span = max(now - self._recent[0][0], 1e-3)
            return sum(n for _, n in self._recent) / span

    def stats(self) -> dict[str, Any]:
        """What the page and /metrics show: running, waiting, KV blocks, tokens/s, prefix hits."""
        with self.lock:
            q, h = self.counters["prefix_query_tokens"], self.counters["prefix_hit_tokens"]
            return {"running": len(self.running), "waiting": len(self.waiting), "steps": self.steps,
                    "kv_blocks_used": self.blocks_used(), "kv_blocks_total": self.cache.num_blocks,
                    "kv_blocks_cached": self.prefix.num_cached if self.prefix is not None else 0,
                    "tokens_per_s": self.tokens_per_s(), "prefix_hit_rate": h / q if q else 0.0,
                    **self.counters}

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache and the peak-running counter; the number of blocks dropped."""
        with self.lock:
            dropped = self.prefix.num_cached if self.prefix is not None else 0
            if self.prefix is not None:
                self.prefix.clear()
            self.counters["peak_running"] = 0
            return dropped

    def run_until_idle(self, max_steps: int = 100_000) -> list[dict[str, Any]]:
        """Step (in this thread) until no request waits or runs; the records of those steps."""
        out = []
        while self.has_work():
            out.append(self.step())
            if len(out) > max_steps:
                raise RuntimeError(f"Engine: more than {max_steps} steps")
        return out

    # ---------------------------------------------------------------- the background loop
    def start(self) -> "Engine":
        """Run the step loop in a background thread."""
        with self.lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self.waiting or self.running) and not self._stopping:
                    self._wake.wait(0.5)
                if not (self.waiting or self.running) and self._stopping:
                    return
            t0 = time.perf_counter()
            try:
                self.step()
            except Exception as exc:  # a bug in a step: end every request with an error, keep serving
                self._fail_all(exc)
            # sleep(0) at least: hand the interpreter lock to the HTTP thread between steps, so that
            # tokens go out as they are made rather than when the lock's switch interval expires
            time.sleep(max(0.0, self.step_interval - (time.perf_counter() - t0)))

    def _fail_all(self, exc: Exception) -> None:
        """End every request in the engine with finish_reason "error" (self.error says why)."""
        with self.lock:
            self.error = exc
            for request in list(self.waiting) + list(self.running):
                if request.id in self.cache.tables:
                    self.cache.free(request.id)
                self._finish(request, "error")
            self.waiting.clear()
            self.running.clear()

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Stop the loop: with drain, after every accepted request has finished; without, abort
        them first. New requests are refused from now on."""
        with self._wake:
            self._stopping = True
            if not drain:
                for request in list(self.waiting) + list(self.running):
                    self.abort(request)
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"Engine.stop: the step loop did not finish in {timeout} s")
            self._thread = None

# %% [markdown]
# The engine on its own, no HTTP yet: twelve requests, prompts of 5 to 40 tokens, a budget of
# 24 tokens per step. Long prompts are fed in chunks over several steps while the others decode.

# %%
def engine_demo() -> None:
    eng = Engine(W64, num_blocks=40, block_size=4, max_running=8, max_num_batched_tokens=24)
    rng = np.random.default_rng(0)
    reqs = [eng.add_request(rng.integers(0, 100, int(rng.integers(5, 41))), 8) for _ in range(12)]
    records = eng.run_until_idle()
    print(f"{len(records)} steps; tokens fed per step: {[r['tokens'] for r in records]}")
    print(f"most requests in one step: {max(len(r['chunks']) for r in records)}; "
          f"blocks used when idle: {eng.blocks_used()}; outputs complete: {all(r.done for r in reqs)}")


try:
    engine_demo()
except NotImplementedError as exc:
    print("not attempted:", exc)

# %% [markdown]
# Exercise 15.2's check cell comes after the HTTP layer below: its tests also serve requests
# over HTTP (200 at once, each equal to that prompt generated alone; a full queue answered with
# 429; bad requests; a graceful shutdown).

# %% [markdown]
# ## 4. The HTTP API
#
# Clients of LLM servers speak OpenAI's API: vLLM, SGLang, llama.cpp's server and TGI all serve
# it, so every client library and benchmark works against them unchanged. A completion is a POST
# of JSON (`model`, `prompt`, `max_tokens`, `temperature`, `seed`, `stream`); the chat form takes
# `messages` (role and content) instead of a prompt. With `stream: true` the answer is a stream
# of **server-sent events** (the WHATWG HTML standard, section 9.2): `Content-Type:
# text/event-stream`, each event one or more `data: ...` lines ended by a blank line. OpenAI's
# stream sends one JSON *chunk* per event, each carrying the new text (`choices[0].text`, or
# `choices[0].delta.content` for chat), a last chunk with `finish_reason`, and then the event
# `data: [DONE]`.
#
# Errors are JSON too, `{"error": {"message", "type", "param", "code"}}`, with a 4xx status for
# the client's mistakes: a served model must answer a bad request with a clear message and go on
# serving, never with a 500 and a traceback. `check_request` is the one place that validates a
# body; `APIError` carries the status. When the waiting queue is full the server answers 429
# with a `Retry-After` header rather than queueing without bound (back-pressure: an unbounded
# queue only turns overload into timeouts).
#
# The engine runs in its own thread; FastAPI's handlers run on uvicorn's event loop. A
# `TokenStream` carries a request's tokens across: the engine calls `push(token)` from its
# thread, which hands the token to the loop (`call_soon_threadsafe`, through a mailbox that
# wakes the loop once for all the tokens of a step, not once per token); the handler iterates
# `async for token in stream`. When a streaming client disconnects, Starlette cancels the
# response's generator and the `finally` of the handler aborts the request: its blocks go back
# at once, not when its `max_tokens` would have run out.
#
# **Exercise 15.3.** Write `sse_event` (one event's bytes) and `sse_stream`, the async generator
# that turns a request's tokens into the event stream: one chunk per token, as soon as it is
# generated, then the final chunk, then `[DONE]`.

# %%
#| export
class APIError(Exception):
    """An error answered as OpenAI's JSON error object with HTTP `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; APIError 400 for non-UTF-8 bytes, malformed JSON or a
    body that is not an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


@dataclass
class CompletionParams:
    """A validated request: prompt ids, max_tokens, temperature, seed, stream, chat or not."""

    prompt: np.ndarray
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    chat: bool


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The tiny GPT has no chat template: the messages' contents joined by blank lines, and one
    after the last (the model continues from there)."""
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def check_request(body: dict[str, Any], chat: bool, model_name: str, tokenizer: CharTokenizer,
                  context: int) -> CompletionParams:
    """Validate a completions (chat=False) or chat completions body; APIError (4xx) naming the
    field and the value otherwise."""
    def field_(name: str, kind: Any, default: Any = None, required: bool = False) -> Any:
        if name not in body or body[name] is None:
            if required:
                raise APIError(400, f"missing required field '{name}'", param=name)
            return default
        value = body[name]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise APIError(400, f"'{name}' must be of type {names}, got {json.dumps(value)[:50]}", param=name)
        return value

    model = field_("model", str, required=True)
    if model != model_name:
        raise APIError(404, f"the model '{model[:80]}' does not exist; this server serves '{model_name}'",
                       type="invalid_request_error", param="model", code="model_not_found")
    if chat:
        messages = field_("messages", list, required=True)
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                   and m.get("role") in ("system", "user", "assistant") for m in messages):
            raise APIError(400, "'messages' must be a non-empty list of {role: system|user|assistant, content: string}",
                           param="messages")
        text = chat_prompt(messages)
    else:
        text = field_("prompt", str, required=True)
    if not text:
        raise APIError(400, "the prompt is empty", param="prompt")
    max_tokens = field_("max_tokens", int, 16)
    if max_tokens < 1:
        raise APIError(400, f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
    temperature = field_("temperature", (int, float), 1.0)
    if not 0 <= temperature <= 2 or not math.isfinite(temperature):
        raise APIError(400, f"'temperature' must lie in [0, 2], got {temperature}", param="temperature")
    seed = field_("seed", int)
    stream = field_("stream", bool, False)
    if field_("n", int, 1) != 1:
        raise APIError(400, "only n = 1 is supported", param="n")
    try:
        ids = tokenizer.encode(text)
    except ValueError as exc:
        raise APIError(400, f"the prompt cannot be tokenized: {exc}", param="messages" if chat else "prompt") from None
    if len(ids) + max_tokens > context:
        raise APIError(400, f"this model's context is {context} tokens; the prompt has {len(ids)} and max_tokens is "
                       f"{max_tokens} ({len(ids) + max_tokens} in all)", param="max_tokens",
                       code="context_length_exceeded")
    return CompletionParams(ids, max_tokens, float(temperature), seed, stream, chat)


class LoopMailbox:
    """Tokens from the engine's thread to one event loop, with one wake-up of the loop per burst:
    put() appends (stream, token) to a list and calls the loop (call_soon_threadsafe, a write to
    the loop's wake-up socket) only when the list was empty, so the tokens of one engine step
    cost one wake-up, not one each. for_loop(loop): the loop's mailbox."""

    _boxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox]" = weakref.WeakKeyDictionary()
    _boxes_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock = loop, [], threading.Lock()

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "LoopMailbox":
        with cls._boxes_lock:
            box = cls._boxes.get(loop)
            if box is None:
                box = cls._boxes[loop] = cls(loop)
            return box

    def put(self, stream: "TokenStream", token: int | None) -> None:
        with self.lock:
            wake = not self.items
            self.items.append((stream, token))
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                with self.lock:
                    self.items.clear()

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for stream, token in items:
            stream.deliver(token)


class TokenStream:
    """A request's tokens, from the engine's thread to an event loop: push(token) (thread-safe;
    None ends the stream); `async for token in stream` yields them in order. request: the
    GenRequest, once the engine has accepted it. ready: whether the next token (or the end) is
    already here, so that the next step of the iteration will not wait."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.mailbox = loop, LoopMailbox.for_loop(loop)
        self.buffer: deque[int | None] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.request: GenRequest | None = None

    def push(self, token: int | None) -> None:
        self.mailbox.put(self, token)

    def deliver(self, token: int | None) -> None:
        """(In the loop) a token has arrived: buffer it and wake the reader."""
        self.buffer.append(token)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    @property
    def ready(self) -> bool:
        return bool(self.buffer)

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> int:
        while not self.buffer:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        token = self.buffer[0]
        if token is None:  # the end stays in the buffer: iterating again stops again
            raise StopAsyncIteration
        self.buffer.popleft()
        return token


async def coalesce(events: AsyncIterator[bytes], ready: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The bytes of `events`, each item joined with the ones after it that are ready already
    (ready(): the next item will come without waiting): the same bytes in fewer writes to the
    socket when the server falls behind the engine."""
    it = events.__aiter__()
    while True:
        try:
            parts = [await it.__anext__()]
        except StopAsyncIteration:
            return
        while ready():
            try:
                parts.append(await it.__anext__())
            except StopAsyncIteration:
                yield b"".join(parts)
                return
        yield b"".join(parts)


def completion_chunk(request_id: str, model: str, created: int, text: str, finish_reason: str | None,
                     chat: bool, first: bool = False) -> dict[str, Any]:
    """One chunk of an OpenAI stream: a text_completion chunk, or a chat.completion.chunk whose
    delta carries the role in the first chunk."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

# %%
#| export
#| exercise 15.3
def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: b"data: " + the JSON of `data` (a str such as "[DONE]" as it is) +
    a blank line, UTF-8."""
    ### BEGIN SOLUTION
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode("utf-8")
    ### END SOLUTION


async def sse_stream(stream: TokenStream, chunk: Callable[[str, str | None, bool], dict[str, Any]],
                     decode: Callable[[list[int]], str]) -> AsyncIterator[bytes]:
    """The event stream of one request: for each token from `stream`, as it arrives, the event of
    chunk(decode([token]), None, first) (first: True for the first token only); when the stream
    ends, the event of chunk("", stream.request.finish_reason, False), then the event "[DONE]"."""
    ### BEGIN SOLUTION
    first = True
    async for token in stream:
        yield sse_event(chunk(decode([token]), None, first))
        first = False
    yield sse_event(chunk("", stream.request.finish_reason, False))
    yield sse_event("[DONE]")
    ### END SOLUTION


# %%
#| export
def make_app(engine: Engine, tokenizer: CharTokenizer, model_name: str = "tiny-gpt") -> Any:
    """The FastAPI application over `engine`: POST /v1/completions and /v1/chat/completions
    (streamed with sse_stream when "stream": true), GET /v1/models, /health, /metrics
    (Prometheus text), /stats (JSON for the page) and / (the page); POST /reset_prefix_cache
    (empties the prefix cache and the peak-running counter, as vLLM's endpoint of that name). The engine's loop starts
    with the app and stops, after draining, when the server shuts down."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from minitorch.server_kit import PAGE_HTML

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="minitorch server", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:  # a bug: say so, in JSON
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                            status_code=500)

    pieces = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]   # a character tokenizer:

    def decode_one(ids: list[int]) -> str:                                  # a token's text alone
        return pieces[ids[0]] if len(ids) == 1 else tokenizer.decode(ids)

    async def complete(request: Request, chat: bool) -> Any:
        params = check_request(parse_body(await request.body()), chat, model_name, tokenizer, engine.W.block_size)
        stream = TokenStream(asyncio.get_running_loop())
        try:
            req = engine.add_request(params.prompt, params.max_tokens, params.temperature, params.seed, stream.push)
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(int(exc.retry_after))}) from None
        except RuntimeError as exc:
            raise APIError(503, str(exc), "server_error", code="shutting_down") from None
        stream.request, created = req, int(time.time())

        def chunk(text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
            return completion_chunk(req.id, model_name, created, text, finish_reason, chat, first)

        if params.stream:
            async def events() -> AsyncIterator[bytes]:
                try:
                    async for event in coalesce(sse_stream(stream, chunk, decode_one), lambda: stream.ready):
                        yield event
                finally:  # the client went away (or the stream ended): free the blocks now
                    engine.abort(req)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": req.id})
        try:
            tokens = [t async for t in stream]
        finally:
            engine.abort(req)
        if req.finish_reason == "error":
            raise APIError(500, f"the engine failed: {type(engine.error).__name__}: {engine.error}", "server_error")
        text = tokenizer.decode(tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": req.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        usage = {"prompt_tokens": len(req.prompt), "completion_tokens": len(tokens),
                 "total_tokens": len(req.prompt) + len(tokens)}
        return JSONResponse({"id": req.id, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": model_name, "choices": [choice], "usage": usage})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "minitorch", "max_model_len": engine.W.block_size}]}

    @app.get("/health")
    async def health() -> dict[str, str]:  # 503 once the engine cannot serve (a load balancer's signal)
        if not getattr(engine, "alive", True):
            raise APIError(503, "the engine is not taking requests" + (f": {engine.error}" if engine.error else ""),
                           "server_error", code="engine_down")
        return {"status": "ok"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        return {"dropped_blocks": engine.reset_prefix_cache()}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return engine.stats()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE_HTML.replace("MODEL", json.dumps(model_name)))

    return app


def model_engine(model: Any, dtype: Any, **engine_kw: Any) -> Engine:
    """An Engine over `model`'s weights in `dtype` (engine_kw go to Engine), its fused decode step
    compiled (the first request does not wait for Numba)."""
    engine = Engine(gpt_weights(model, dtype), **engine_kw)
    if engine.decoder is not None:
        engine.decoder.warm_up()
    return engine


def build_server(dtype: Any = np.float32, engine_process: bool = False, **engine_kw: Any) -> tuple[Any, Any]:
    """(engine, app) serving lesson 09's shipped tiny GPT in `dtype`; engine_kw go to Engine. With
    engine_process, the engine runs in a process of its own (EngineProcess, section 10)."""
    model, tokenizer = load_tiny_gpt()
    engine = EngineProcess(dtype, **engine_kw) if engine_process else model_engine(model, dtype, **engine_kw)
    return engine, make_app(engine, tokenizer)


def serve(host: str = "127.0.0.1", port: int = 8000, step_interval: float = 0.02, engine_process: bool = True,
          **engine_kw: Any) -> None:
    """Serve the tiny GPT until Ctrl-C (`make serve`): the first Ctrl-C finishes the requests in
    flight, a second aborts them and stops at once (server_kit.uvicorn_server). step_interval slows
    each step so a lecture can watch the tokens arrive; engine_process: the engine in a process of
    its own (section 10), or in a thread of this one."""
    from minitorch.server_kit import uvicorn_server

    _, app = build_server(step_interval=step_interval, engine_process=engine_process, **engine_kw)
    print(f"minitorch server: open http://{host}:{port}/ (metrics at /metrics); Ctrl-C stops it")
    try:
        uvicorn_server(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30).run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down gracefully
        pass
    print("minitorch server: stopped")

# %% tags=["check"]
check("15.2")

# %% [markdown]
# Try it: a server on a free port, three requests (a completion, the same streamed, a chat), a
# bad one, and shut down. `ServerThread` (given) runs uvicorn in a thread of this kernel.

# %% tags=["demo"]
import httpx

from minitorch.server_kit import ServerThread

try:
    sse_event("probe"), Engine(W64).schedule()          # say "not attempted" before starting a server
    demo_engine, demo_app = build_server(np.float32, num_blocks=64, block_size=8)
    with ServerThread(demo_app) as srv:
        body = {"model": "tiny-gpt", "prompt": "The for statement", "max_tokens": 40, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body)
        print(r.status_code, repr(r.json()["choices"][0]["text"]))
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        print(f"streamed: {len(events)} events, the first {events[0][:90]}..., the last {events[-1]}")
        chat = {"model": "tiny-gpt", "messages": [{"role": "user", "content": "What is a class?"}], "max_tokens": 30}
        print("chat:", repr(httpx.post(srv.url + "/v1/chat/completions", json=chat).json()["choices"][0]["message"]))
        bad = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": -3})
        print("bad request:", bad.status_code, bad.json())
    print("stopped; engine thread alive:", demo_engine._thread is not None)
except NotImplementedError as exc:
    print("not attempted:", exc)

# %% tags=["check"]
check("15.3")

# %% [markdown]
# ## 5. Metrics
#
# A server is run by its metrics. The latencies a user feels are the **time to first token**
# (TTFT: queueing plus prefill), the **time per output token** after the first (TPOT: the decode
# step, and how many others share it) and the **inter-token latency** (ITL: the gaps one by one;
# a prefill of another request that lands between two tokens shows up here). vLLM's benchmark
# reports each as mean and p50/p90/p99: tails matter, since a user waits for the slow ones.
#
# `/metrics` speaks Prometheus's text exposition format, which every monitoring stack scrapes.
# A latency is exported as a *histogram*: for each upper bound `le` the number of observations
# at or below it (cumulative, ending with `le="+Inf"` = the count), plus `_sum` and `_count`.
# Percentiles are then estimated from buckets by the monitoring side (`histogram_quantile`).
#
# **Exercise 15.4.** Write `Histogram.observe` and `Histogram.render`, and `latency_stats`:
# from each request's send time and token arrival times, TTFT per request, TPOT per request
# with two or more tokens ((last - first) / (n - 1)), ITL the gaps between consecutive tokens of
# every request pooled, each summarised by mean, p50, p90 and p99 (`np.percentile`'s linear
# interpolation); NaN where there is no value.

# %%
#| export
#| exercise 15.4
class Histogram:
    """A Prometheus histogram: `buckets`, increasing finite upper bounds; counts of observations
    per bucket, their sum and count."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]):
        bounds = [float(b) for b in buckets]
        if not bounds or any(b >= c for b, c in zip(bounds, bounds[1:])) or not all(map(math.isfinite, bounds)):
            raise ValueError(f"Histogram {name}: buckets must be increasing finite numbers, got {list(buckets)}")
        self.name, self.help, self.bounds = name, help, bounds
        self.counts = [0] * (len(bounds) + 1)     # the last: above every bound
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        """Count one observation: in the first bucket whose bound is >= value (or above all)."""
        ### BEGIN SOLUTION
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += float(value)
        self.count += 1
        ### END SOLUTION

    def render(self) -> str:
        """The text format: "# HELP name help", "# TYPE name histogram", one line
        name_bucket{le="<bound>"} <observations <= bound> per bound (cumulative), then le="+Inf"
        (all of them), then name_sum and name_count; lines end with a newline."""
        ### BEGIN SOLUTION
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            lines.append(f'{self.name}_bucket{{le="{bound!r}"}} {total}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return "\n".join(lines) + "\n"
        ### END SOLUTION


def latency_stats(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{"ttft" | "tpot" | "itl": {"mean", "p50", "p90", "p99"}} in seconds from records, each a dict
    with "start" (send time) and "token_times" (arrival of each token, increasing); records with
    a "status" other than 200, or no tokens, are left out."""
    ### BEGIN SOLUTION
    ttft, tpot, itl = [], [], []
    for r in records:
        times = list(r["token_times"])
        if r.get("status", 200) != 200 or not times:
            continue
        ttft.append(times[0] - r["start"])
        if len(times) >= 2:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(np.diff(times).tolist())

    def summary(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
        p = np.percentile(values, [50, 90, 99])
        return {"mean": float(np.mean(values)), "p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}

    return {"ttft": summary(ttft), "tpot": summary(tpot), "itl": summary(itl)}
    ### END SOLUTION

# %%
#| export
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def render_metrics(engine: Engine) -> str:
    """The engine's state in Prometheus text format: gauges (requests running and waiting, KV
    blocks used, cached and total, tokens/s, prefix hit rate), counters, and TTFT / TPOT
    histograms of the requests it finished (measured inside the server, from acceptance)."""
    s = engine.stats()
    out = []
    for name, kind, value, help in (
            ("num_requests_running", "gauge", s["running"], "Requests in the KV cache."),
            ("num_requests_waiting", "gauge", s["waiting"], "Requests in the queue."),
            ("kv_blocks_used", "gauge", s["kv_blocks_used"], "KV cache blocks held by requests."),
            ("kv_blocks_cached", "gauge", s["kv_blocks_cached"], "KV cache blocks in the prefix cache."),
            ("kv_blocks_total", "gauge", s["kv_blocks_total"], "KV cache blocks in the pool."),
            ("generation_tokens_per_second", "gauge", s["tokens_per_s"], "Output tokens per second, last 5 s."),
            ("prefix_cache_hit_rate", "gauge", s["prefix_hit_rate"], "Prompt tokens found in the prefix cache."),
            ("generation_tokens_total", "counter", s["generated_tokens"], "Output tokens generated."),
            ("prompt_tokens_total", "counter", s["prompt_tokens"], "Prompt tokens admitted."),
            ("request_success_total", "counter", s["finished"], "Requests finished."),
            ("request_aborted_total", "counter", s["aborted"], "Requests aborted (client gone)."),
            ("request_rejected_total", "counter", s["rejected"], "Requests refused with 429."),
            ("num_preemptions_total", "counter", s["preemptions"], "Preemptions.")):
        out.append(f"# HELP minitorch_{name} {help}\n# TYPE minitorch_{name} {kind}\nminitorch_{name} {float(value)!r}\n")
    ttft = Histogram("minitorch_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
    tpot = Histogram("minitorch_time_per_output_token_seconds", "Time per output token after the first.",
                     LATENCY_BUCKETS)
    with engine.lock:
        done = [r for r in engine.finished if r.token_times]
    for r in done:
        ttft.observe(r.token_times[0] - r.arrival)
        if len(r.token_times) >= 2:
            tpot.observe((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1))
    return "".join(out) + ttft.render() + tpot.render()

# %%
try:
    h = Histogram("demo_latency_seconds", "A demo.", (0.01, 0.1, 1.0))
    for v in (0.005, 0.02, 0.02, 0.5, 3.0):
        h.observe(v)
    print(h.render())
    fake = [{"start": 0.0, "token_times": [0.12, 0.15, 0.19, 0.22]}, {"start": 1.0, "token_times": [1.05, 1.30]}]
    print({k: {q: round(x, 4) for q, x in v.items()} for k, v in latency_stats(fake).items()})
except NotImplementedError as exc:
    print("not attempted:", exc)

# %% tags=["check"]
check("15.4")

# %% [markdown]
# ## 6. The load generator
#
# How fast is a server? It depends on how hard it is pushed. vLLM's `benchmark_serving.py`
# sends requests **open loop**: arrival times are drawn in advance from a Poisson process at a
# chosen rate (independent exponential gaps of mean 1/rate), and each request goes out at its
# time whether or not earlier ones have been answered, as independent users would. A closed loop
# (each client waits for its answer before sending again) slows down with the server and hides
# queueing. At a low rate every request finds the server idle; as the rate nears what the server
# can do, queues grow and TTFT climbs steeply (queueing theory: the wait grows like 1 / (1 -
# utilisation)). `rate = inf` sends everything at once.
#
# Throughput alone rewards a server that answers everyone, slowly. **Goodput** (Zhong et al.
# 2024) counts only the requests that met the service-level objective: requests per second
# whose TTFT and TPOT are both within their bounds (a request with one token has no TPOT and
# only needs the TTFT bound); failed requests never count.
#
# **Exercise 15.5.** Write `poisson_arrivals` and `goodput`.

# %%
#| export
#| exercise 15.5
def poisson_arrivals(rate: float, n: int, rng: Any = 0) -> np.ndarray:
    """Send times (n,) float64 in seconds from the start of a Poisson process of `rate`
    requests per second: the cumulative sum of n independent exponential gaps of mean 1 / rate,
    drawn from np.random.default_rng(rng); all zeros when rate is inf. rate > 0, n >= 0."""
    if not rate > 0 or int(n) != n or n < 0:
        raise ValueError(f"poisson_arrivals: need rate > 0 and an integer n >= 0, got rate={rate}, n={n}")
    ### BEGIN SOLUTION
    if math.isinf(rate):
        return np.zeros(int(n))
    return np.cumsum(np.random.default_rng(rng).exponential(1.0 / rate, int(n)))
    ### END SOLUTION


def goodput(records: Sequence[dict[str, Any]], duration: float, ttft_slo: float, tpot_slo: float) -> float:
    """Requests per second over `duration` seconds that succeeded (status 200, or no status, and
    at least one token) with TTFT <= ttft_slo and, if they have two or more tokens, TPOT =
    (last - first) / (n - 1) <= tpot_slo. records as for latency_stats."""
    if not duration > 0:
        raise ValueError(f"goodput: duration must be > 0, got {duration}")
    ### BEGIN SOLUTION
    good = 0
    for r in records:
        times = list(r["token_times"])
        if r.get("status", 200) != 200 or not times or times[0] - r["start"] > ttft_slo:
            continue
        if len(times) >= 2 and (times[-1] - times[0]) / (len(times) - 1) > tpot_slo:
            continue
        good += 1
    return good / duration
    ### END SOLUTION

# %%
try:
    gaps = np.diff(poisson_arrivals(10.0, 10_001, rng=1))
    print(f"10 requests/s: mean gap {gaps.mean():.4f} s, coefficient of variation {gaps.std() / gaps.mean():.3f} "
          "(1 for exponential gaps)")
except NotImplementedError as exc:
    print("not attempted:", exc)

# %% tags=["check"]
check("15.5")

# %% [markdown]
# ## 7. Under load: the latency-throughput curve
#
# Now the whole stack under a load generator, as vLLM's `benchmark_serving.py` does it: the
# server in its own process (`ServerProcess`, given: in this kernel it would share Python's
# interpreter lock with the load generator), float32 weights, a workload of corpus prompts (8-32
# characters) and output lengths (8-24 tokens) drawn at random (`sample_workload`, given), and
# `run_load` (given) sending each request at its Poisson time and recording when every token
# arrives. First the baseline, one request at a time (what a server without batching does);
# then rates up to `inf` (everything at once). The SLO for goodput: TTFT <= 250 ms and TPOT <=
# 50 ms. Each rate starts from an empty prefix cache (`POST /reset_prefix_cache`), so the rates
# compare batching alone.

# %% tags=["demo"]
import matplotlib.pyplot as plt

from minitorch.server_kit import ServerProcess, run_load, sample_workload

SLO = {"ttft_slo": 0.25, "tpot_slo": 0.05}


def load_point(url: str, workload: list, rate: float, seed: int, max_concurrency: int | None = None) -> dict:
    """One run of the load generator, from an empty prefix cache; throughput, latencies, goodput."""
    httpx.post(url + "/reset_prefix_cache")
    records, duration = run_load(url, workload, poisson_arrivals(rate, len(workload), seed),
                                 max_concurrency=max_concurrency)
    assert all(r["status"] == 200 for r in records), [r for r in records if r["status"] != 200][:1]
    tokens = sum(len(r["token_times"]) for r in records)
    stats = latency_stats(records)
    return {"rate": rate, "duration": duration, "tokens_per_s": tokens / duration,
            "requests_per_s": len(records) / duration, "goodput": goodput(records, duration, **SLO),
            "ttft_p50": stats["ttft"]["p50"], "ttft_p99": stats["ttft"]["p99"],
            "tpot_p50": stats["tpot"]["p50"], "itl_p99": stats["itl"]["p99"]}


n_requests = 16 if SMALL else 128
rates = [10.0, math.inf] if SMALL else [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 240.0, 320.0, 480.0, math.inf]
points, baseline, peak_running = [], None, 0
try:
    sse_event("probe"), Engine(W64).schedule(), poisson_arrivals(1.0, 1), goodput([], 1.0, 1.0, 1.0)
    with ServerProcess(num_blocks=48, block_size=8, max_running=32, step_interval=0.0) as url:
        run_load(url, sample_workload(4, 99), [0, 0, 0, 0])                     # warm up
        baseline = load_point(url, sample_workload(n_requests, 1), math.inf, 0, max_concurrency=1)
        for i, rate in enumerate(rates):
            points.append(load_point(url, sample_workload(n_requests, 2 + i), rate, i))
        peak_running = httpx.get(url + "/stats").json()["peak_running"]
    print(f"{'rate (req/s)':>12} {'tokens/s':>9} {'req/s':>6} {'goodput':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'ITL p99':>8}")
    for p in [dict(baseline, rate="1 at a time")] + points:
        rate = p["rate"] if isinstance(p["rate"], str) else f"{p['rate']:g}"
        print(f"{rate:>12} {p['tokens_per_s']:>9.0f} {p['requests_per_s']:>6.1f} {p['goodput']:>8.1f} "
              f"{1e3 * p['ttft_p50']:>7.1f}ms {1e3 * p['ttft_p99']:>7.1f}ms {1e3 * p['tpot_p50']:>7.1f}ms "
              f"{1e3 * p['itl_p99']:>6.1f}ms")
    print(f"batching: {points[-1]['tokens_per_s'] / baseline['tokens_per_s']:.1f}x the tokens/s of one at a time; "
          f"most requests in one step: {peak_running}")
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    shown = [p for p in points if math.isfinite(p["rate"])]
    tps = [p["tokens_per_s"] for p in shown]
    ax[0].plot(tps, [1e3 * p["ttft_p99"] for p in shown], "o-", label="p99 TTFT")
    ax[0].plot(tps, [1e3 * p["ttft_p50"] for p in shown], "s--", label="p50 TTFT")
    ax[0].plot(points[-1]["tokens_per_s"], 1e3 * points[-1]["ttft_p99"], "kx", label="p99, all at once")
    ax[0].axvline(baseline["tokens_per_s"], color="grey", ls=":", label="one at a time")
    ax[0].set_xlabel("throughput (output tokens/s)")
    ax[0].set_ylabel("time to first token (ms)")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=8)
    ax[0].set_title("latency against throughput")
    ax[1].plot([p["rate"] for p in shown], [p["requests_per_s"] for p in shown], "o-", label="throughput")
    ax[1].plot([p["rate"] for p in shown], [p["goodput"] for p in shown], "s--", label="goodput (SLO met)")
    ax[1].plot([0, max(rates[:-1] or [1])], [0, max(rates[:-1] or [1])], "k:", lw=0.8, label="offered load")
    ax[1].set_xlabel("offered load (requests/s)")
    ax[1].set_ylabel("requests/s")
    ax[1].legend(fontsize=8)
    ax[1].set_title("throughput and goodput")
    fig.tight_layout()
    plt.show()
except NotImplementedError as exc:
    print("not attempted:", exc)

# %% [markdown]
# Read the curve from left to right. At low rates the server is mostly idle: TTFT is one
# prefill, throughput equals the offered load. As the rate grows the batch grows, and each step
# serves more requests for little more time (next section), so throughput climbs far above the
# one-at-a-time baseline. Then the engine is saturated: requests queue, TTFT's tail shoots up,
# throughput flattens, and goodput *falls* while throughput stays high: the server is busy
# answering requests too late to count. A production server is run below that knee, and the SLO
# decides where (DistServe's point: maximise goodput, not throughput).

# %% [markdown]
# ## 8. The arithmetic: why batching pays, and where it stops
#
# A decode step reads every weight once whatever the batch, and each sequence's KV cache once.
# For a batch of b sequences at context c, lesson 11's `decode_step_cost` gives FLOPs ~ b (2N
# + attention) and bytes ~ N x bytes per weight + b x KV bytes: the arithmetic intensity grows
# with b until the KV reads dominate. On a GPU, where decode is memory-bound, a step of 16
# sequences of Llama-2-7B at 1,024 tokens costs about 1.6x a step of one, for 10x the tokens
# (Pope et al. 2022; the table in [inference](../hardware_notes/inference.md#serving)). Here
# the tiny GPT's weights (110,784 parameters, 0.4 MB in float32) sit in the CPU's cache, and a
# step of one sequence is mostly fixed cost: NumPy calls and Python per layer, which do not
# grow with the batch. Either way the step time grows far slower than the batch, so tokens per
# second grow with it, until the per-sequence work (the caches' reads on a GPU, the arithmetic
# and attention calls here) catches up. Measured below: decode steps of b sequences at a
# context of about 40 tokens through lesson 11's step (`decode="reference"`; section 9 removes
# its fixed cost), FLOP/byte from `decode_step_cost`, float32.

# %% tags=["demo"]
from minitorch.serve import decode_step_cost, kv_cache_bytes

W32 = W64.astype(np.float32)
batches = [1, 4, 16] if SMALL else [1, 2, 4, 8, 16, 32, 64]
n_params = sum(v.size for k, v in W32.params.items() if k.startswith("blocks.")) + W32.params["wte.weight"].size
print(f"{'batch':>5} {'ms/step':>8} {'tokens/s':>9} {'FLOP/byte':>9}")
step_ms = {}
try:
    Engine(W64).schedule()
    for b in batches:
        eng = Engine(W32, num_blocks=8 * b, block_size=8, max_running=b, max_num_batched_tokens=64 * b,
                     prefix_caching=False, decode="reference")
        rng = np.random.default_rng(b)
        for _ in range(b):
            eng.add_request(rng.integers(0, 103, 32), 24)
        eng.step()                                                 # the prefills
        times = []
        for _ in range(12 if SMALL else 20):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        step_ms[b] = 1e3 * float(np.median(times))
        flops, nbytes = decode_step_cost(n_params, W32.n_layer, W32.n_head, W32.n_kv_head, W32.head_dim, 40, b, 4, 4)
        print(f"{b:>5} {step_ms[b]:>8.2f} {1e3 * b / step_ms[b]:>9.0f} {flops / nbytes:>9.2f}")
    big = batches[-1]
    print(f"a step of {big} costs {step_ms[big] / step_ms[1]:.1f}x a step of 1: "
          f"{big * step_ms[1] / step_ms[big]:.1f}x the tokens per second")
except NotImplementedError as exc:
    print("not attempted:", exc)

# %% [markdown]
# Live: continuous batching simulated with the step times just measured (a step of b sequences
# costs the measured time for b, interpolated between the measured batches; a new request's
# prefill rides in its first step, which yields its first token). 200 requests of 8-24 output
# tokens arrive at the chosen Poisson rate (`poisson_arrivals`) and the engine runs at most
# `max_batch` at once; TTFT and goodput come from the section 5 metrics on the simulated token
# times. Left, the latency-throughput curve for that batch limit, precomputed over rates, with
# the chosen rate marked; right, the batch and the queue over time. One at a time
# (`max_batch` 1) the queue explodes at a rate the batched engine serves with room to spare.

# %% tags=["demo"]
from course.live import live

Engine(W64).schedule()  # the step times above need the engine (exercise 15.2)
out_lens = np.random.default_rng(7).integers(8, 25, 200)
log_b, log_ms = np.log(list(step_ms)), np.log(list(step_ms.values()))


def simulate_batching(rate: float, max_batch: int) -> tuple[list[dict], float, np.ndarray]:
    """Continuous batching of out_lens' requests at `rate` req/s with the measured step times:
    (records as run_load writes them, duration s, rows of (time, running, waiting)). Steps with
    the same batch run as one stretch: up to the next finish, or the next arrival with room."""
    cost = [0.0] + [math.exp(np.interp(math.log(b), log_b, log_ms)) / 1e3 for b in range(1, max_batch + 1)]
    arrivals = poisson_arrivals(rate, len(out_lens), 3)
    n_req = len(out_lens)
    times: list[list[np.ndarray]] = [[] for _ in range(n_req)]
    left, admitted, finished = out_lens.copy(), np.zeros(n_req), np.zeros(n_req)
    t, nxt, running = 0.0, 0, []
    while nxt < n_req or running:
        if not running and arrivals[nxt] > t:
            t = float(arrivals[nxt])
        while nxt < n_req and arrivals[nxt] <= t and len(running) < max_batch:
            running.append(nxt)
            admitted[nxt] = t
            nxt += 1
        c = cost[len(running)]
        steps = min(left[i] for i in running)
        if nxt < n_req and len(running) < max_batch:  # stop at the first step boundary after the next arrival
            steps = min(steps, max(1, math.ceil((arrivals[nxt] - t) / c)))
        stretch = t + c * np.arange(1, steps + 1)
        for i in running:
            times[i].append(stretch)
            left[i] -= steps
            finished[i] = stretch[-1]
        t = float(stretch[-1])
        running = [i for i in running if left[i] > 0]
    records = [{"start": float(a), "token_times": np.concatenate(ts).tolist(), "status": 200}
               for a, ts in zip(arrivals, times)]
    at = np.sort(np.concatenate([arrivals, admitted, finished]))
    count = lambda when: np.searchsorted(np.sort(when), at, side="right")  # noqa: E731
    return records, t, np.stack([at, count(admitted) - count(finished), count(arrivals) - count(admitted)], axis=1)


curve_rates = np.geomspace(5, 1000, 10)
curves = {}
for b in batches:
    for r in curve_rates:
        recs, dur, _ = simulate_batching(r, b)
        curves.setdefault(b, []).append((out_lens.sum() / dur, latency_stats(recs)["ttft"]["p99"]))


def draw_batching(rate: float, max_batch: int):
    recs, dur, timeline = simulate_batching(rate, max_batch)
    ttft = latency_stats(recs)["ttft"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw=dict(left=0.07, right=0.98, bottom=0.14, wspace=0.22))
    tps, p99 = np.array(curves[max_batch]).T
    ax[0].plot(tps, 1e3 * p99, "o-", color="C0", label=f"rates {curve_rates[0]:g} to {curve_rates[-1]:g} req/s")
    ax[0].plot(out_lens.sum() / dur, 1e3 * ttft["p99"], "o", color="C3", ms=10, label=f"{rate:g} req/s")
    ax[0].set(xlabel="throughput (output tokens/s)", ylabel="p99 time to first token (ms)", yscale="log",
              title=f"max batch {max_batch}: latency against throughput")
    ax[0].minorticks_off()  # (and no tight_layout): a quicker redraw
    ax[0].legend(fontsize=8)
    ax[1].step(timeline[:, 0], timeline[:, 1], where="post", label="running")
    ax[1].step(timeline[:, 0], timeline[:, 2], where="post", label="waiting")
    ax[1].set(xlabel="time (s)", ylabel="requests")
    ax[1].set_title(f"{rate:g} req/s offered: {out_lens.sum() / dur:.0f} tokens/s, goodput "
                    f"{goodput(recs, dur, **SLO):.0f} req/s, p99 TTFT {1e3 * ttft['p99']:.0f} ms", fontsize=10)
    ax[1].legend(fontsize=8)
    return fig


live(draw_batching, rate=(5.0, 500.0, 5.0), max_batch=batches)

# %% [markdown]
# **What the pool holds.** Lesson 11's formula: a token's keys and values take 2 x layers x KV
# heads x head_dim x bytes. A pool of `num_blocks` blocks of `block_size` tokens holds
# num_blocks x block_size tokens, and a sequence of L tokens takes ceil(L / block_size) blocks,
# so at most num_blocks // ceil(L / block_size) sequences of that length fit at once, whatever
# `max_running` says. The load run above used 48 blocks of 8: compare with the most requests it
# ran in one step. On a real model the same arithmetic sets the batch: Llama-2-7B in float16
# needs 0.5 MB of KV per token, so a 40 GB pool holds about 80,000 tokens, 20 sequences of
# 4,096 (lesson 11; vLLM's `gpu_memory_utilization` sizes this pool).

# %%
per_token = kv_cache_bytes(W64.n_layer, W64.n_kv_head, W64.head_dim, 1, 4)
pool_blocks, block = 48, 8
for length in (24, 40, 64):
    fit = pool_blocks // -(-length // block)
    print(f"sequences of {length:>2} tokens: {fit:>2} fit in {pool_blocks} blocks of {block} "
          f"({pool_blocks * block * per_token / 1024:.0f} KiB of float32 KV, {per_token} bytes per token)")

# %% tags=["demo"]
if points:
    workload_len = np.mean([len(p) + m for p, m in sample_workload(n_requests, 2 + len(rates) - 1)])
    predicted = pool_blocks // math.ceil(workload_len / block)
    print(f"the load run at rate inf: sequences average {workload_len:.0f} tokens at the end, so about "
          f"{predicted} fit the pool by the formula (more while they are short); the engine ran at most "
          f"{peak_running} at once, max_running 32")

# %% [markdown]
# ## 9. Removing the overhead: a fused decode step
#
# Section 8 found a step of one sequence to be mostly fixed cost. Count it: a decode step
# multiplies the new token by each weight once and, in each layer and head, its query by every
# cached key and the softmax by every cached value: 2N + 4 x layers x heads x head_dim x context
# FLOPs (lesson 11's `decode_step_cost`), under a megaflop for the tiny GPT at 512 tokens of
# context (printed below, with the rate each step achieves). Lesson 11's step spreads it over
# dozens of NumPy calls per layer (LayerNorm, four Linear layers, reshapes, the block table's
# gather, the mask, the softmax), each costing microseconds of interpreter and dispatch whatever
# the size of its arrays: the step is bound by neither arithmetic nor memory but by the
# interpreter. GPU servers meet the same wall at small batches,
# where a decode step is hundreds of tiny kernel launches: vLLM captures the step in CUDA graphs
# and replays it in one launch; llama.cpp runs the forward pass as a graph of C kernels with no
# interpreter between them.
#
# The engine's default, `decode="fused"`, does what llama.cpp does. `fused_decode_kernel` (given,
# in `minitorch/server_kit.py`; read it there) is one Numba function for one decode step of b
# sequences, one token each: the embeddings; per layer LayerNorm, q, k and v as one matrix
# product (the three weight matrices concatenated, `FusedDecoder` repacks them once), the new key
# and value written to the sequence's slot in the paged pool, each head's attention over keys 0
# .. pos read through the block table (scores and their maximum, then exponentials, their sum
# and the weighted values: the causal bound is the loop's end), the output projection, LayerNorm,
# the MLP with GELU, the residuals; then the tied output layer. The loops run in the weights'
# dtype, their innermost loop along contiguous memory so that it vectorises, and without the
# interpreter lock (`nogil`), so the HTTP thread keeps streaming while a step computes. The
# kernel's rows need not be one per sequence: a prefill chunk is several rows of one sequence
# at consecutive positions, each writing its key and value before it attends, so a whole step,
# decodes and short prefill chunks (up to `FUSED_CHUNK_MAX` = 32 tokens) together, is one call.
# Longer chunks go through `paged_forward`: there the matrices are big enough for NumPy's BLAS
# to be the faster tool. Splitting a step this way changes nothing but rounding, since each
# token depends only on its own sequence's cache: the tests check that the tokens are the same
# and the logits equal to 1e-12 (float64).
#
# A fast step moves the bottleneck to the HTTP side, as in every serving stack: at 16 clients
# the server then spent more time per token streaming it than computing it. What the server does
# about it: the engine wakes the event loop once per step for all its tokens (`LoopMailbox`), not
# once per token; events of one request that are ready together go out in one write (`coalesce`;
# the client still sees one event per token); and uvicorn runs on its fast stack, uvloop's event
# loop and httptools' parser (C, where asyncio's loop and h11 are Python), which it picks by
# itself when they are installed (`uvicorn[standard]` installs them; the course pins them). The
# load generator has the same problem on the client side and shares the machine's cores with the
# server, so `run_load` reads the event stream with a few lines of its own on asyncio's streams
# rather than a general HTTP client (vLLM's benchmark uses aiohttp's C parser for the same reason).
#
# Why not lesson 14's compiler? It traces a function at fixed shapes and guards on them; the
# decode step's key count grows by one every step, so every step would be a new graph and a new
# compilation, and it leaves matrix products to NumPy, one call each. What costs here is the
# number of calls, not the bytes between them (its fusion's target); the cure is one call per
# step, and for that a hand-fused step is the short road (PyTorch's answer, `torch.compile` with
# dynamic shapes and CUDA graphs, is the long one).

# %%
#| export server_kit
#| given
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

# %% [markdown]
# Measured: one sequence decoding greedily from a 16-token prompt, on a GPT of the tiny GPT's
# shape with random weights and a 528-token context (the trained model's context is 64 tokens;
# speed does not depend on the weights), as lesson 11 measured the cache against no cache. Four
# ways: no cache, lesson 11's dense-cache step, and the engine's step (scheduling, sampling and
# bookkeeping included) with the reference and the fused decode. `make bench L=serving` prints the
# same table.

# %% tags=["demo"]
from minitorch.serve import decode_step_cost, random_gpt_weights

n_decode = 128 if SMALL else 512
W_long = random_gpt_weights(block_size=16 + n_decode, dtype=np.float32)
try:
    Engine(W64).schedule()
    speeds = decode_speeds(W_long, n_decode, Engine, repeats=1 if SMALL else 3, no_cache_repeats=1 if SMALL else 2)
    print_decode_speeds(speeds, W_long)
    n_params = sum(v.size for k, v in W_long.params.items() if k.startswith("blocks.")) + W_long.params["wte.weight"].size
    context = 16 + n_decode - 4                                   # the middle of the last 8 steps
    flops, _ = decode_step_cost(n_params, W_long.n_layer, W_long.n_head, W_long.n_kv_head, W_long.head_dim, context)
    for name in ("lesson 11", "engine fused"):
        step = np.median(speeds[name][-8:])
        print(f"{name}: a step at {context} tokens of context, {flops / 1e6:.2f} MFLOP, takes {1e6 * step:.0f} us: "
              f"{flops / step / 1e9:.2f} GFLOP/s")
except NotImplementedError as exc:
    print("not attempted:", exc)

# %% [markdown]
# On the course's 2-core development machine, busy (load average 5, `make bench L=serving`), the
# 512-token run printed 14,291 tokens/s with the fused step against 4,318 for lesson 11's step
# (3.3x; 3.4x and 2.9x in runs at load 7 and 10) and 2,124 for the engine's reference step (its
# paged attention gathers the blocks again in every layer), and 146 without a cache: 98x for the
# fused step, 30x for lesson 11's (at load 7: 272x and 81x). The uncached figure suffers most
# from a busy machine (each layer's scores are 4 x 512 x 512 floats, 4 MB, written and read
# several times; lesson 11 measured 20x on the idle machine), so read the fused step against
# lesson 11's. The fused step's time still grows with the context (compare its tokens/s after 64
# and after 512 tokens): attention, which grows with the context while the rest does not, is now
# a large part of a step.

# %% [markdown]
# ## 10. The engine in its own process
#
# With the step fused, what is left at 16 clients is Python on both sides of one lock: the fused
# kernel runs without the interpreter lock, but the engine's Python around it (scheduling,
# sampling, the cache's bookkeeping) and the HTTP thread's (one event per token through uvicorn
# and Starlette) take turns on it, so the server's process uses about one core, however many the
# machine has. A sampling profiler (py-spy, both threads) shows the engine thread waiting for the
# lock between steps; `make bench L=serving` prints the server's CPU time per output token beside
# its throughput.
#
# vLLM's answer (its V1 engine, 2025) is to split the server: the API server, which speaks HTTP
# and detokenises, and the *engine core*, a busy loop that schedules and runs the model, in two
# processes, each with its own interpreter, talking through sockets (ZeroMQ, messages packed with
# msgpack). `EngineProcess` (given) is that split. It has the interface `make_app` uses
# (`add_request`, `abort`, `stats`, `reset_prefix_cache`, `start`, `stop`, `alive`, `W`, `lock`,
# `finished`, `error`), so the HTTP layer does not change, and runs the same `Engine` in a child
# process: a fresh interpreter (`python -c`, not a fork of a process that has threads), joined
# to the server by a socket pair carrying pickled tuples (multiprocessing's `Connection` frames
# them) both ways:
#
# - server to engine: `("add", n, prompt, max_tokens, temperature, seed)`, `("abort", n)`,
#   `("reset",)`, `("stop", drain)`; the engine reads every command waiting before each step;
# - engine to server: one message per step that made tokens or admitted requests (every token,
#   each finished request's reason, the requests admitted, its `stats()`), and the stats every
#   0.1 s besides; the server's reader thread hands the tokens to the streams (through
#   `LoopMailbox`, as the engine thread did) and keeps the latest stats for `/stats` and
#   `/metrics`.
#
# Admission stays on the server's side, where the answer is needed at once: the server counts the
# requests it has sent that the engine has not yet admitted, and answers 429 beyond `max_waiting`;
# the engine's own queue is unbounded, so a request the server accepted is never refused later.
# An abort ends the request on the server's side at once (the client is gone) and the engine frees
# its blocks before its next step. A step that raises ends its requests with finish_reason
# "error" and the engine keeps serving, as the thread does; if the engine process dies, every
# request in flight ends with "error", new ones get 503, and so does `/health`. `serve()` (and
# `make serve`) use the split by default; the tests run both.

# %%
#| export
#| given
def engine_process_main(fd: int) -> None:
    """The engine process of EngineProcess (`python -c` runs it, with its end of a socket pair):
    read (dtype, engine_kw), build the Engine, then loop: read the commands that wait, step if
    there is work (each step lasting at least step_interval, reading commands meanwhile), and send
    what the step made. Ends on ("stop", drain) once idle, or when the server's end closes."""
    import signal
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the server decides
    conn = Connection(fd)
    try:
        dtype, engine_kw = conn.recv()
        try:
            engine = model_engine(load_tiny_gpt()[0], np.dtype(dtype), **engine_kw)
        except Exception as exc:  # bad settings: the server raises this in its own process
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            return
        _engine_loop(conn, engine)
    except (EOFError, OSError):                    # the server process is gone
        return


def _engine_loop(conn: Any, engine: Engine) -> None:
    requests: dict[int, GenRequest] = {}
    queued: set[int] = set()                       # sent to the engine, not yet admitted
    out: list[tuple[int, int | None, str | None]] = []
    stopping = False

    def on_token(n: int) -> Callable[[int | None], None]:
        return lambda token: out.append((n, token, None if token is not None else requests[n].finish_reason))

    def read(wait: float) -> None:
        """Handle the commands that arrive within `wait` seconds (all that wait, at least)."""
        nonlocal stopping
        if not conn.poll(wait):
            return
        while conn.poll(0):
            cmd = conn.recv()
            if cmd[0] == "add":
                n, prompt, max_tokens, temperature, seed = cmd[1:]
                requests[n] = engine.add_request(prompt, max_tokens, temperature, seed, on_token(n))
                queued.add(n)
            elif cmd[0] == "abort" and cmd[1] in requests:
                engine.abort(requests[cmd[1]])
            elif cmd[0] == "reset":
                conn.send(("reply", "reset", engine.reset_prefix_cache()))
            elif cmd[0] == "stop":
                stopping = True
                if not cmd[1]:
                    for request in list(engine.waiting) + list(engine.running):
                        engine.abort(request)

    conn.send(("ready", {"block_size": engine.W.block_size, "vocab_size": engine.W.vocab_size}, engine.stats()))
    next_stats = 0.0
    while True:
        read(0.0 if engine.has_work() else 0.2)
        admitted: list[int] = []
        if engine.has_work():
            t0 = time.perf_counter()
            try:
                engine.step()
            except Exception as exc:  # a bug in a step: end its requests with an error, keep serving
                engine._fail_all(exc)
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            waiting = {id(r) for r in engine.waiting}
            admitted = [n for n in queued if id(requests[n]) not in waiting]
            queued.difference_update(admitted)
            while (left := t0 + engine.step_interval - time.perf_counter()) > 0:  # slow motion: read meanwhile
                read(left)
        for n, token, _ in out:
            if token is None:
                requests.pop(n, None)
                queued.discard(n)
        now = time.perf_counter()
        if out or admitted or now >= next_stats:
            conn.send(("step", out, admitted, engine.stats()))
            out, next_stats = [], now + 0.1
        if stopping and not engine.has_work():
            conn.send(("stopped", engine.stats()))
            return


class EngineProcess:
    """The engine in a process of its own (vLLM's engine core), behind the interface make_app uses.

    dtype and engine_kw: the Engine's (lesson 09's tiny GPT); max_waiting: requests sent to the
    engine and not yet admitted before add_request raises QueueFull (checked here: the engine's
    own queue is unbounded). The child starts at once; start() is a no-op (make_app calls it),
    stop(drain) ends it. W: block_size and vocab_size of the model. error: the last step's
    failure (its requests end with finish_reason "error"; the engine keeps serving, as Engine
    does) or the engine process's death (then `alive` is False and requests are refused)."""

    def __init__(self, dtype: Any = np.float32, max_waiting: int = 256, start_timeout: float = 300.0,
                 **engine_kw: Any):
        import os
        import socket
        import subprocess
        import sys
        import types
        from multiprocessing.connection import Connection

        if isinstance(max_waiting, bool) or int(max_waiting) != max_waiting or max_waiting < 1:
            raise ValueError(f"EngineProcess: max_waiting must be an integer >= 1, got {max_waiting!r}")
        # a fresh interpreter (not fork: this process has threads; not multiprocessing's spawn, which
        # would run a script's main module again), a socket pair, multiprocessing's message framing
        ours, theirs = socket.socketpair()
        ours.set_inheritable(False)                # a fork of this process must not keep the engine alive
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from minitorch.server import engine_process_main; engine_process_main({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        try:
            self.conn.send((np.dtype(dtype).str, {**engine_kw, "max_waiting": 2**62}))
            if not self.conn.poll(start_timeout):
                raise RuntimeError(f"EngineProcess: the engine process did not start in {start_timeout} s")
            try:
                kind, info, *first_stats = self.conn.recv()
            except EOFError:
                raise RuntimeError(f"EngineProcess: the engine process exited (code {self.process.wait()})") from None
            if kind == "failed":
                raise ValueError(f"EngineProcess: {info}")
        except BaseException:  # a failed start (or Ctrl-C meanwhile) leaves no process and no socket behind
            self.process.kill()
            self.process.wait()
            self.conn.close()
            raise
        self.W = types.SimpleNamespace(**info)
        self.max_waiting, self.decoder = int(max_waiting), None
        self.lock = threading.RLock()
        self.finished: deque[GenRequest] = deque(maxlen=4096)
        self.error: Exception | None = None
        self._requests: dict[int, GenRequest] = {}     # in flight, by number
        self._numbers: dict[GenRequest, int] = {}
        self._queued: set[int] = set()                 # sent, not yet admitted by the engine
        self._stats: dict[str, Any] = first_stats[0]    # the engine's stats(), as of its last message
        self._rejected, self._ids, self._stopping, self._dead = 0, itertools.count(), False, False
        # _send_lock orders the messages, and makes add_request's check and send one step against
        # stop's; it is taken before self.lock, never inside it. The reader takes only self.lock.
        self._send_lock, self._replies = threading.RLock(), {}
        self._replied = threading.Condition(self.lock)
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def _send(self, message: tuple) -> None:
        """One message to the engine (callers hold _send_lock, or take it here)."""
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):              # the engine process is gone: the reader says so
                pass

    def start(self) -> "EngineProcess":
        return self

    @property
    def alive(self) -> bool:
        """Whether the engine process runs and takes requests (/health answers 503 once not)."""
        return not self._dead and not self._stopping and self.process.poll() is None

    def add_request(self, prompt: Any, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                    on_token: Callable[[int | None], None] | None = None) -> GenRequest:
        """As Engine.add_request: ValueError for a request that can never be served, QueueFull past
        max_waiting, RuntimeError once stopping or if the engine process has died."""
        prompt = check_generation("EngineProcess.add_request", prompt, max_tokens, temperature,
                                  self.W.vocab_size, self.W.block_size)
        with self._send_lock:
            with self.lock:
                if self._stopping or self._dead:
                    raise RuntimeError("EngineProcess.add_request: the engine is shutting down" if self._stopping
                                       else f"EngineProcess.add_request: the engine process failed: {self.error}")
                if len(self._queued) >= self.max_waiting:
                    self._rejected += 1
                    raise QueueFull(len(self._queued), self.retry_after())
                seed = int(np.random.default_rng().integers(2 ** 31)) if seed is None else int(seed)
                n = next(self._ids)
                request = GenRequest(f"cmpl-{n}", prompt.astype(np.int64), int(max_tokens), float(temperature), seed,
                                     on_token)
                self._requests[n], self._numbers[request] = request, n
                self._queued.add(n)
            # sent without self.lock (a full socket must not stop the reader, which needs it), but
            # under _send_lock: stop cannot slip its message in between the check and this one
            self._send(("add", n, request.prompt, request.max_tokens, request.temperature, seed))
        return request

    def abort(self, request: GenRequest) -> bool:
        """End a request now (its blocks are freed by the engine before its next step); False if it
        had already finished."""
        with self.lock:
            if request.finished:
                return False
            n = self._numbers.get(request)
            self._finish(request, "abort")
        if n is not None:
            self._send(("abort", n))
        return True

    def _finish(self, request: GenRequest, reason: str) -> None:
        n = self._numbers.pop(request, None)
        self._requests.pop(n, None)
        self._queued.discard(n)
        request.finish_reason = reason
        self.finished.append(request)
        self._call(request, None)

    def _call(self, request: GenRequest, token: int | None) -> None:
        """request.on_token(token); a callback that raises ends its own request ("error"), no other."""
        if request.on_token is None:
            return
        try:
            request.on_token(token)
        except Exception as exc:  # noqa: BLE001 - the caller's code: keep serving the others
            self.error = exc
            if token is not None and not request.finished:
                request.on_token = None
                self._finish(request, "error")

    def _read(self) -> None:
        """The reader thread: the engine's messages, until it stops or dies; then nothing is left
        unfinished (a request that raced with stop ends with "abort", one the engine died with, "error")."""
        reason = "error"
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    break
                kind, now = message[0], time.perf_counter()
                with self.lock:
                    if kind == "step":
                        items, admitted, self._stats = message[1:]
                        self._queued.difference_update(admitted)
                        for n, token, finish_reason in items:
                            request = self._requests.get(n)
                            if request is None:                  # aborted here already
                                continue
                            if token is None:
                                self._finish(request, finish_reason)
                            else:
                                request.output.append(token)
                                request.token_times.append(now)
                                self._call(request, token)
                    elif kind == "error":
                        self.error = RuntimeError(message[1])
                    elif kind == "reply":
                        self._replies[message[1]] = message[2]
                        self._replied.notify_all()
                    elif kind == "stopped":
                        self._stats, reason = message[1], "abort"
                        break
        except Exception as exc:  # noqa: BLE001 - a broken message: the engine cannot be trusted any more
            self.error = exc
            self.process.kill()
        with self.lock:
            self._dead = True
            if self.error is None and reason == "error":
                self.error = RuntimeError(f"the engine process exited (code {self.process.poll()})")
            for request in list(self._requests.values()):
                self._finish(request, reason)
            self._replied.notify_all()

    def retry_after(self) -> float:
        """Seconds after which a rejected client may try again: the work in flight over the recent
        token rate, at least 1."""
        with self.lock:
            rate = max(float(self._stats.get("tokens_per_s", 0.0)), 1.0)
            work = sum(r.max_tokens - len(r.output) for r in self._requests.values())
        return float(max(1, math.ceil(work / rate)))

    def stats(self) -> dict[str, Any]:
        """The engine's stats() as of its last message (sent after every step that made tokens or
        admitted requests, and every 0.1 s besides; a long step delays it), and the 429s counted here."""
        with self.lock:
            return {**self._stats, "rejected": self._rejected}

    def reset_prefix_cache(self, timeout: float = 30.0) -> int:
        """As Engine.reset_prefix_cache, answered by the engine process; RuntimeError without an answer."""
        with self.lock:
            self._replies.pop("reset", None)
        self._send(("reset",))
        with self.lock:
            self._replied.wait_for(lambda: "reset" in self._replies or self._dead, timeout)
            if "reset" not in self._replies:
                raise RuntimeError(f"EngineProcess.reset_prefix_cache: no answer from the engine process in "
                                   f"{timeout} s" + (" (it has stopped)" if self._dead else ""))
            return int(self._replies.pop("reset"))

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Refuse new requests, then end the engine process: after every accepted request has
        finished (drain), or at once, aborting them. Safe to call twice, and from two threads (a
        second Ctrl-C during a drain). RuntimeError if it did not end in time."""
        import subprocess

        with self._send_lock:
            with self.lock:
                self._stopping = True
            self._send(("stop", drain))
        self._reader.join(timeout)
        try:
            self.process.wait(5.0 if not self._reader.is_alive() else 0.1)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            if drain:
                raise RuntimeError(f"EngineProcess.stop: the engine did not finish in {timeout} s") from None
        finally:
            self._reader.join(5.0)
            with self._send_lock:
                self.conn.close()


# %% [markdown]
# The two layouts side by side, each in its own server process with the load generator in this
# one: output tokens per second one request at a time and with 16 concurrent clients (the same
# 64 requests of `sample_workload`), on this machine now. `make bench L=serving` runs the same
# comparison with 128 requests, the fastest of three runs, and the CPU time of each process.

# %% tags=["demo"]
def layout_throughput(engine_process: bool, n: int) -> dict[int, float]:
    """Output tokens/s at 1 and 16 clients, the engine in its own process or in the server's."""
    with ServerProcess(num_blocks=64, block_size=8, max_running=32, step_interval=0.0,
                       engine_process=engine_process) as url:
        run_load(url, sample_workload(8, 99), [0] * 8)                          # warm up
        out = {}
        for clients in (1, 16):
            records, duration = run_load(url, sample_workload(n, 1), [0] * n, max_concurrency=clients)
            assert all(r["status"] == 200 for r in records)
            out[clients] = sum(len(r["token_times"]) for r in records) / duration
        return out


try:
    Engine(W64).schedule()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    for engine_process in (False, True):
        tps = layout_throughput(engine_process, 16 if SMALL else 64)
        print(f"engine in {'its own process' if engine_process else 'a thread of the server':<24}: "
              f"{tps[1]:6.0f} tokens/s one at a time, {tps[16]:6.0f} with 16 clients ({tps[16] / tps[1]:.1f}x)")
except NotImplementedError as exc:
    print("not attempted:", exc)

# %% [markdown]
# ## 11. Serve it for a lecture
#
# `make serve` runs `serve()`: the tiny GPT on http://127.0.0.1:8000/ with a page to type a
# prompt into and watch the tokens stream, and a live panel of the batch (requests running and
# waiting, KV blocks in use, tokens per second, prefix hits) that the page polls from `/stats`.
# Steps are slowed to 20 ms so the audience sees the tokens arrive; open several tabs, or run
# the load generator against it from a notebook, and watch the panel fill. Point any OpenAI
# client at it (`base_url="http://127.0.0.1:8000/v1"`, model `"tiny-gpt"`), or
# `curl -N localhost:8000/v1/completions -H 'Content-Type: application/json'
# -d '{"model": "tiny-gpt", "prompt": "The with statement", "max_tokens": 40, "stream": true}'`.
#
# ## What to take away
#
# - A server is an engine plus a protocol: the engine decides, every step, who runs and how many
#   tokens each feeds; the HTTP layer only translates. Everything hard (memory, fairness,
#   latency) is in the step.
# - Batching is free throughput while a step is bound by something other than the batch
#   (memory bandwidth on a GPU, fixed overhead here), and costs latency once it is not. The
#   latency-throughput curve shows the knee; goodput under an SLO says where to run.
# - The KV pool, not `max_running`, bounds the batch; prefix caching stretches it by sharing.
# - A small step is bound by per-call overhead, not by arithmetic or memory: one call per step
#   (a hand-fused Numba step here, CUDA graphs on a GPU) removes it.
# - One Python process runs its Python on one core at a time: the engine and the HTTP server in
#   separate processes (vLLM's engine core) let both run, with one message per step between them.
# - Reliability is structural: per-request sampling state, abort on disconnect, a bounded queue
#   with 429, validation answering 4xx, draining on shutdown.
#
# Sources: Kwon et al. 2023 (vLLM, PagedAttention); the vLLM team's V1 architecture post (2025, the engine core process); Yu et al. 2022 (Orca, iteration-level
# scheduling); Agrawal et al. 2024 (Sarathi-Serve, chunked prefill); Zheng et al. 2024
# (SGLang, RadixAttention prefix sharing); Zhong et al. 2024 (DistServe, goodput); Pope et al.
# 2022 (Efficiently Scaling Transformer Inference); vLLM's `benchmarks/benchmark_serving.py`, its
# OpenAI-compatible server and its CUDA-graph capture of decode steps; llama.cpp (ggml); OpenAI's API reference (completions, chat, streaming); the WHATWG
# HTML standard, server-sent events; Prometheus's text exposition format.
