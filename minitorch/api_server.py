# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.api_server: lesson 15's OpenAI-compatible HTTP API (vLLM's
entrypoints/openai/api_server): request validation (check_request), the token and text streams
between the engine's thread and the event loop, OpenAI's JSON (ResponseBuilder), server-sent
events (sse_stream), the FastAPI application (make_app) and the server's entry points
(build_server, serve, `python -m minitorch.api_server`)."""
from __future__ import annotations

import asyncio
import functools
import json
import math
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from starlette.requests import Request  # FastAPI reads the handlers' annotations from the module's names

from minitorch.gpt import CharTokenizer, load_tiny_gpt

if globals().get("__spec__") is not None:  # a module (not a notebook, whose own cells define these names)
    from minitorch.engine import Engine, EngineProcess, StopStrings, model_engine
    from minitorch.metrics import render_metrics
    from minitorch.scheduler import MAX_LOGPROBS, MAX_STOP, GenRequest, QueueFull, SamplingParams, _describe, _is_int


MAX_N = 16                  # samples per request (OpenAI allows 128; a server sizes this to its pool)
SEED_RANGE = (-2 ** 63, 2 ** 63 - 1)   # a seed is a signed 64-bit integer (vLLM's bound)


class APIError(Exception):
    """An error answered as OpenAI's JSON error object with HTTP `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _shown(value: Any) -> str:
    """A JSON value as an error message shows it: short, and shallow (a nested list 10,000 deep is not
    walked to print it)."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict = 3, 40, 40, 6, 4
    return r.repr(value)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; APIError 400 for non-UTF-8 bytes, malformed JSON (NaN and
    Infinity are not JSON), nesting deeper than Python's recursion allows, an integer of more digits
    than Python converts (4,300), or a body that is not an object. TypeError if raw is not bytes."""
    if not isinstance(raw, (bytes, bytearray)):
        raise TypeError(f"parse_body: raw must be the body's bytes, got {_describe(raw)}")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None
    try:
        body = json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as exc:                                # NaN, Infinity; an integer of > 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


@dataclass
class CompletionParams:
    """A validated request: prompt ids, max_tokens, temperature, seed (None or >= 0, what the engine
    takes), stream, chat or not; n samples; sampling (top_p, top_k, logit_bias, penalties,
    logprobs); stop strings; echo (the prompt before the completion); include_usage (a usage chunk
    at the end of a stream); logprobs: the alternatives per token to return (None: no
    log-probabilities); user: the end user's id, if the client gave one."""

    prompt: np.ndarray
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    chat: bool
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    echo: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    user: str | None = None


# What the server does with every field of OpenAI's two request bodies (the API reference's lists, as
# the official client sends them). A field is honoured (read below), or accepted only at the value
# that asks for nothing ("no-op" values: a client library may send them), or refused with a 400 that
# names it: a client must never think a parameter was honoured when it was not.
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "top_k"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs", "max_completion_tokens", "safety_identifier",
                               "prompt_cache_key"}
COMPLETION_NO_OP = {"suffix": ((None, ""), "inserting text before a suffix is not supported")}
CHAT_NO_OP = {  # field: (the values that ask for nothing, why any other is refused)
    "response_format": ((None, {"type": "text"}), "structured output (JSON mode, schemas) is not supported"),
    "tools": ((None, []), "tool calling is not supported"),
    "tool_choice": ((None, "none"), "tool calling is not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "parallel_tool_calls": ((None, True, False), "tool calling is not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "the tiny GPT is not a reasoning model"),
    "verbosity": ((None,), "the tiny GPT has no verbosity setting"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "metadata": ((None,), "metadata belongs to stored completions, which are not supported"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier"),
    "moderation": ((None,), "moderation is not supported"),
    "prompt_cache_retention": ((None,), "the prefix cache keeps blocks while the pool has room; no retention setting"),
    "prompt_cache_options": ((None,), "the prefix cache takes no options"),
}


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "an array",
          dict: "an object"}


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None,
           required: bool = False) -> Any:
    """body[name] if it is of one of `kinds` (JSON: bool is not a number), `default` where it is
    missing or null; APIError 400 naming the field otherwise."""
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"missing required field '{name}'", param=name)
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds) or \
            (isinstance(value, float) and not math.isfinite(value)):
        names = " or ".join(_KINDS[k] for k in kinds if not (k is int and float in kinds))
        raise APIError(400, f"'{name}' must be {names}, got {_shown(value)}", param=name)
    return value


def _in_range(name: str, value: Any, lo: float, hi: float) -> Any:
    if not lo <= value <= hi:
        raise APIError(400, f"'{name}' must lie in [{lo}, {hi}], got {_shown(value)}", param=name)
    return value


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The tiny GPT has no chat template: the messages' contents (a string, or text parts) joined by
    blank lines, and one after the last (the model continues from there)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise TypeError(f"chat_prompt: messages must be a list of {{role, content}} objects, got {_shown(messages)}")

    def text(content: Any) -> str:
        return content if isinstance(content, str) else "".join(part["text"] for part in content)
    return "\n\n".join(text(m["content"]) for m in messages) + "\n\n"


def _check_messages(body: dict[str, Any]) -> str:
    messages = _field(body, "messages", (list,), required=True)
    must = ("'messages' must be a non-empty list of {role: system|developer|user|assistant, content: a string or "
            "a list of text parts}")
    if not messages:
        raise APIError(400, must + ", got []", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant") or \
                "content" not in m:
            raise APIError(400, f"{must}; message {i} is {_shown(m)}", param="messages")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise APIError(400, f"message {i}: the field '{extra[0]}' is not supported (tool calls, names, audio: "
                                "only role and content)", param="messages")
        content = m["content"]
        parts_ok = isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and set(p) <= {"type", "text"}
            for p in content)
        if not isinstance(content, str) and not parts_ok:
            raise APIError(400, f"{must}; message {i} has the content {_shown(content)} (only text is supported)",
                           param="messages")
    return chat_prompt(messages)


def _check_prompt(body: dict[str, Any], tokenizer: CharTokenizer) -> tuple[str | None, np.ndarray | None]:
    """(text, None) for a prompt string, (None, ids) for a prompt of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                   # a batch of one prompt
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) < 0 or max(prompt) >= tokenizer.vocab_size:
            raise APIError(400, f"'prompt' holds token ids outside [0, {tokenizer.vocab_size}): "
                                f"{_shown([t for t in prompt if not 0 <= t < tokenizer.vocab_size])}", param="prompt")
        return None, np.asarray(prompt, dtype=np.int64)
    if prompt is None:
        raise APIError(400, "missing required field 'prompt'", param="prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "'prompt': a batch of several prompts is not supported; send one request per prompt",
                       param="prompt")
    raise APIError(400, f"'prompt' must be a string or a non-empty array of token ids, got {_shown(prompt)}",
                   param="prompt")


def check_request(body: dict[str, Any], chat: bool, model_name: str, tokenizer: CharTokenizer,
                  context: int) -> CompletionParams:
    """Validate a completions (chat=False) or chat completions body against OpenAI's API: every
    field honoured (see CompletionParams), accepted only at a value that asks for nothing
    (CHAT_NO_OP, COMPLETION_NO_OP), or refused; APIError 400 naming the field and the value (404 for an unknown
    model). Without max_tokens, the completion may fill the rest of the context."""
    known, no_op = (CHAT_FIELDS, CHAT_NO_OP) if chat else (COMPLETION_FIELDS, COMPLETION_NO_OP)
    for name, value in body.items():
        if name in known:
            continue
        if name in no_op:
            allowed, why = no_op[name]
            if any(value == a and type(value) is type(a) for a in allowed):
                continue
            raise APIError(400, f"'{name}': {why} (got {_shown(value)})", param=name)
        raise APIError(400, f"unknown or unsupported field '{name[:60]}' for {'chat ' if chat else ''}completions "
                            "(this server refuses what it would not honour)", param=name[:60])
    model = _field(body, "model", (str,), required=True)
    if model != model_name:
        raise APIError(404, f"the model '{model[:80]}' does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")
    if chat:
        text, ids = _check_messages(body), None
    else:
        text, ids = _check_prompt(body, tokenizer)
    if text is not None:
        if not text:
            raise APIError(400, "the prompt is empty", param="prompt")
        try:
            ids = tokenizer.encode(text)
        except ValueError as exc:
            raise APIError(400, f"the prompt cannot be tokenized: {exc}", param="messages" if chat else "prompt") from None
    max_tokens = _field(body, "max_tokens", (int,))
    if chat:
        newer = _field(body, "max_completion_tokens", (int,))
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise APIError(400, f"'max_completion_tokens' ({newer}) and 'max_tokens' ({max_tokens}) disagree; "
                                "send one", param="max_completion_tokens")
        name, max_tokens = ("max_completion_tokens", newer) if newer is not None else ("max_tokens", max_tokens)
    else:
        name = "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"'{name}' must be >= 1, got {max_tokens}", param=name)
    if len(ids) >= context or max_tokens is not None and len(ids) + max_tokens > context:
        raise APIError(400, f"this model's context is {context} tokens; the prompt has {len(ids)}"
                       + (f" and {name} is {_shown(max_tokens)}" if max_tokens is not None else
                          ", which leaves no room for a completion"),
                       param=name if max_tokens is not None else ("messages" if chat else "prompt"),
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = context - len(ids)                     # the rest of the context (vLLM's default)
    temperature = _in_range("temperature", _field(body, "temperature", (int, float), 1.0), 0, 2)
    top_p = _field(body, "top_p", (int, float), 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"'top_p' must lie in (0, 1], got {_shown(top_p)}", param="top_p")
    top_k = _field(body, "top_k", (int,), 0)
    if top_k < -1:
        raise APIError(400, f"'top_k' must be -1 or 0 (off) or a number of tokens >= 1, got {_shown(top_k)}",
                       param="top_k")
    penalties = {p: _in_range(p, _field(body, p, (int, float), 0.0), -2, 2)
                 for p in ("presence_penalty", "frequency_penalty")}
    bias = _field(body, "logit_bias", (dict,))
    if bias is not None:
        parsed = {}
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9 and int(key) < tokenizer.vocab_size):
                raise APIError(400, f"'logit_bias' keys must be token ids in [0, {tokenizer.vocab_size}), got "
                                    f"{_shown(key)}", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise APIError(400, f"'logit_bias' values must be numbers in [-100, 100], got {_shown(value)} for "
                                    f"token {key}", param="logit_bias")
            parsed[int(key)] = float(value)
        bias = parsed
    n = _in_range("n", _field(body, "n", (int,), 1), 1, MAX_N)
    if not chat and _field(body, "best_of", (int,), n) != n:
        raise APIError(400, "'best_of' other than n is not supported (vLLM's V1 engine dropped it too)",
                       param="best_of")
    seed = _field(body, "seed", (int,))
    if seed is not None:
        _in_range("seed", seed, *SEED_RANGE)
        seed %= 2 ** 64                                     # the engine's generators take integers >= 0
    stop = _field(body, "stop", (str, list), ())
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them, got "
                            f"{_shown(stop)}", param="stop")
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,))
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError(400, "'stream_options' is only allowed with stream: true", param="stream_options")
        for key, value in options.items():
            if key == "include_usage" and isinstance(value, bool):
                include_usage = value
            elif key == "include_obfuscation" and value is False:   # no padding fields: asks for nothing
                continue
            else:
                raise APIError(400, f"'stream_options': only include_usage (true or false) is supported, got "
                                    f"{_shown({key: value})}", param="stream_options")
    echo = False if chat else _field(body, "echo", (bool,), False)
    if chat:
        wants = _field(body, "logprobs", (bool,), False)
        top = _field(body, "top_logprobs", (int,))
        if top is not None and not wants:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = _in_range("top_logprobs", top if top is not None else 0, 0, MAX_LOGPROBS) if wants else None
        for name in ("safety_identifier", "prompt_cache_key"):
            _field(body, name, (str,))
    else:
        logprobs = _field(body, "logprobs", (int,))
        if logprobs is not None:
            _in_range("logprobs", logprobs, 0, 5)          # the completions API's bound
    user = _field(body, "user", (str,))
    sampling = SamplingParams(top_p, max(top_k, 0), bias, penalties["presence_penalty"], penalties["frequency_penalty"],
                              logprobs, logprobs if echo and logprobs is not None else None)
    return CompletionParams(ids, int(max_tokens), float(temperature), seed, stream, chat, n, sampling, tuple(stop),
                            echo, include_usage, logprobs, user)


def _refuse_token(where: str, stream: Any, token: Any) -> None:
    if not hasattr(stream, "deliver"):
        raise TypeError(f"{where}: stream must be a TokenStream, got {_describe(stream)}")
    raise TypeError(f"{where}: token must be a token id (an int) or None (the end), got {_describe(token)}")


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
        if not (token is None or token.__class__ is int) or not hasattr(stream, "deliver"):  # once per token: inline
            _refuse_token("LoopMailbox.put", stream, token)
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
    None ends the stream); `async for token in stream` yields them in order. buffer: the tokens
    arrived and not yet taken (the end, None, stays in it); wait(): until one is there."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.mailbox = loop, LoopMailbox.for_loop(loop)
        self.buffer: deque[int | None] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def push(self, token: int | None) -> None:
        if not (token is None or token.__class__ is int):             # once per token: checked inline
            _refuse_token("TokenStream.push", self, token)
        self.mailbox.put(self, token)

    def deliver(self, token: int | None) -> None:
        """(In the loop) a token has arrived: buffer it and wake the reader."""
        if not (token is None or token.__class__ is int):
            _refuse_token("TokenStream.deliver", self, token)
        self.buffer.append(token)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        while not self.buffer:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> int:
        await self.wait()
        token = self.buffer[0]
        if token is None:  # the end stays in the buffer: iterating again stops again
            raise StopAsyncIteration
        self.buffer.popleft()
        return token


class Piece(NamedTuple):
    """Text of a response that may be sent, and the tokens it completes: their ids and, where asked
    for, log-probabilities ((logprob, [(id, logprob), ...]) each; None for a prompt's first token)."""

    text: str
    tokens: list[int]
    logprobs: list[Any] | None = None


class TextStream:
    """One choice of a response, as text that may be sent: `async for piece in stream` (Pieces),
    then `finish_reason`. It reads the request's TokenStream, decodes each token (decode_one), and
    applies the stop strings `stops` (None, or a StopStrings of section 7, one per choice): text
    that might begin one is held back until the next tokens settle it; at a stop string the stream
    ends, the text before it sent, and the engine ends the request with finish_reason "stop"
    (engine.abort(request, "stop"), which frees its blocks). echo: the prompt's text comes first.
    num_tokens: the completion's tokens read (the usage's count: a stop string's own tokens
    included). ready: whether the next piece, or the end, would come without waiting."""

    def __init__(self, tokens: TokenStream, request: GenRequest, engine: Any, decode_one: Callable[[int], str],
                 stops: Any = None, echo: bool = False):
        if stops is not None and not (hasattr(stops, "feed") and hasattr(stops, "flush")):
            raise TypeError(f"TextStream: stops must be None or a StopStrings, got {_describe(stops)}")
        self.tokens, self.request, self.engine, self.decode_one = tokens, request, engine, decode_one
        self.stops = stops
        self.echo, self.num_tokens, self.ended, self.stopped = echo, 0, False, False
        self.pieces: deque[Piece] = deque()
        self.pending: list[list[Any]] = []       # [token, its characters not yet sent, logprob]: held back

    @property
    def finish_reason(self) -> str | None:
        return "stop" if self.stopped else self.request.finish_reason

    @property
    def ready(self) -> bool:
        self._pump()
        return bool(self.pieces) or self.ended

    def __aiter__(self) -> "TextStream":
        return self

    async def __anext__(self) -> Piece:
        while True:
            self._pump()
            if self.pieces:
                return self.pieces.popleft()
            if self.ended:
                raise StopAsyncIteration
            await self.tokens.wait()

    def _pump(self) -> None:
        """Turn the tokens that have arrived into pieces (without waiting)."""
        buffer = self.tokens.buffer
        while buffer and not self.ended:
            if self.echo:
                self.echo = False
                r = self.request
                self.pieces.append(Piece("".join(map(self.decode_one, r.prompt.tolist())), r.prompt.tolist(),
                                         r.prompt_logprobs))
            token = buffer[0]
            if token is None:                            # the request ended: send what was held back
                self.ended = True
                if self.stops is not None:
                    self._release(self.stops.flush())
                return
            buffer.popleft()
            logprobs = self.request.logprobs
            lp = logprobs[self.num_tokens] if logprobs and self.num_tokens < len(logprobs) else None
            self.num_tokens += 1
            text = self.decode_one(token)
            if self.stops is None:
                self.pieces.append(Piece(text, [token], None if lp is None else [lp]))
                continue
            self.pending.append([token, len(text), lp])
            self._release(self.stops.feed(text))
            if self.stops.stopped:
                self.ended = self.stopped = True
                self.pending.clear()
                self.engine.abort(self.request, "stop")

    def _release(self, text: str) -> None:
        """Send `text`, the next characters of the held-back tokens: a piece with the tokens it completes."""
        tokens, lps, n = [], [], len(text)
        while self.pending and self.pending[0][1] <= n:
            token, chars, lp = self.pending.pop(0)
            n -= chars
            tokens.append(token)
            lps.append(lp)
        if self.pending and n:
            self.pending[0][1] -= n                       # a token partly sent: the rest stays held
        if text or tokens:
            self.pieces.append(Piece(text, tokens, lps if lps and lps[0] is not None else None))


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


DONE_EVENT = b"data: [DONE]\n\n"


async def merge_events(streams: Sequence[AsyncIterator[bytes]],
                       last: Callable[[], Sequence[bytes]] | None = None) -> AsyncIterator[bytes]:
    """The events of several event streams (one per choice of a response) as they come, each
    stream's closing [DONE] held back; when all have ended, the events last() returns (a usage
    chunk: counted once every choice has ended) and one [DONE]."""
    if len(streams) == 1:                                 # one choice: no tasks, no queue
        async for event in streams[0]:
            if event != DONE_EVENT:
                yield event
    else:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(stream: AsyncIterator[bytes]) -> None:
            try:
                async for event in stream:
                    if event != DONE_EVENT:
                        await queue.put(event)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(s)) for s in streams]
        try:
            left = len(tasks)
            while left:
                event = await queue.get()
                if event is None:
                    left -= 1
                else:
                    yield event
            for task in tasks:
                task.result()                             # a stream that raised raises here
        finally:
            for task in tasks:
                task.cancel()
    for event in last() if last is not None else ():
        yield event
    yield DONE_EVENT


class ResponseBuilder:
    """The JSON of one response, OpenAI's completion or chat completion object or its stream's
    chunks, for `request_id` (cmpl-..., chatcmpl-...). logprobs: None (no log-probabilities), or the
    alternatives per token (completions: a dict {text: logprob} per token, the sampled one
    included; chat: a list of {token, logprob, bytes}). decode_one(id) -> a token's text;
    include_usage: every chunk carries "usage": null, and usage_chunk() the counts."""

    def __init__(self, request_id: str, model: str, created: int, chat: bool, logprobs: int | None,
                 decode_one: Callable[[int], str], include_usage: bool = False):
        self.id, self.model, self.created, self.chat = request_id, model, created, chat
        self.logprobs, self.decode_one, self.include_usage = logprobs, decode_one, include_usage
        self.offsets: dict[int, int] = {}                # completions' text_offset, per choice

    def _logprobs(self, index: int, pieces: Sequence[Piece]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        entries = [(t, lp) for p in pieces for t, lp in zip(p.tokens, p.logprobs or [None] * len(p.tokens))]
        if self.chat:
            def entry(t: int, lp: float) -> dict[str, Any]:
                text = self.decode_one(t)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**entry(t, lp[0]), "top_logprobs": [entry(a, b) for a, b in lp[1]]}
                                for t, lp in entries if lp is not None]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in entries:
            text = self.decode_one(t)
            out["tokens"].append(text)
            out["text_offset"].append(self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(text)
            out["token_logprobs"].append(None if lp is None else lp[0])
            out["top_logprobs"].append(None if lp is None else
                                       {self.decode_one(a): b for a, b in [*lp[1], (t, lp[0])]})
        return out

    def chunk(self, index: int, piece: Piece | None, finish_reason: str | None, first: bool) -> dict[str, Any]:
        """One stream chunk of choice `index`: piece's text (None: the final chunk, with finish_reason);
        a chat chunk's delta carries the role in the choice's first chunk only."""
        if not (index.__class__ is int and index >= 0 and (piece is None or piece.__class__ is Piece) and
                (finish_reason is None or finish_reason.__class__ is str) and first.__class__ is bool):
            self._refuse_chunk(index, piece, finish_reason, first)          # once per token: checked inline
        text = piece.text if piece is not None else ""
        lps = None if piece is None or self.logprobs is None else self._logprobs(index, [piece])
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}
            out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [choice]}
        else:
            out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason}]}
        if self.include_usage:
            out["usage"] = None
        return out

    @staticmethod
    def _refuse_chunk(index: Any, piece: Any, finish_reason: Any, first: Any) -> None:
        for name, value, ok, must in (
                ("index", index, _is_int(index) and index >= 0, "an integer >= 0"),
                ("piece", piece, piece is None or isinstance(piece, Piece), "a Piece or None (the final chunk)"),
                ("finish_reason", finish_reason, finish_reason is None or isinstance(finish_reason, str), "None or a str"),
                ("first", first, isinstance(first, (bool, np.bool_)), "True or False")):
            if not ok:
                raise (ValueError if name == "index" and _is_int(index) else TypeError)(
                    f"ResponseBuilder.chunk: {name} must be {must}, got {_describe(value)}")

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": usage}

    def response(self, choices: Sequence[tuple[Sequence[Piece], str | None]], usage: dict[str, int]) -> dict[str, Any]:
        """The whole (non-streamed) response: for each choice, its pieces and finish reason."""
        out = []
        for index, (pieces, finish_reason) in enumerate(choices):
            text = "".join(p.text for p in pieces)
            choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                      "logprobs": self._logprobs(index, pieces)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": usage}


class RequestLog:
    """The latencies of the requests a server finished ("length" or "stop"), for /metrics: record(r)
    files r's time to first token, time per output token after it, end-to-end latency and queue
    time (from arrival to its first step) under those names; drain() hands over what was filed since
    the last drain (the /metrics handler adds them to its cumulative histograms, section 5)."""

    NAMES = ("ttft", "tpot", "e2e", "queue")

    def __init__(self) -> None:
        from array import array

        self._array = array
        self.pending = {name: array("d") for name in self.NAMES}
        self.histograms: dict[str, Any] | None = None     # made by render_metrics at the first scrape

    def record(self, request: GenRequest) -> None:
        if request.finish_reason not in ("length", "stop") or not request.token_times:
            return
        times, start = request.token_times, request.arrival
        self.pending["ttft"].append(times[0] - start)
        if len(times) >= 2:
            self.pending["tpot"].append((times[-1] - times[0]) / (len(times) - 1))
        if request.finished_at is not None:
            self.pending["e2e"].append(request.finished_at - start)
        if request.scheduled_at is not None:
            self.pending["queue"].append(max(0.0, request.scheduled_at - start))

    def drain(self) -> dict[str, list[float]]:
        out = {name: values.tolist() for name, values in self.pending.items()}
        self.pending = {name: self._array("d") for name in self.NAMES}
        return out


async def until_disconnected(request: Request, work: "asyncio.Future[Any]") -> bool:
    """Await `work` (a task); True, with work cancelled, if the client disconnects first. After the
    body has been read, the next ASGI receive() returns only when the client goes away
    ("http.disconnect"), so a task waiting on it watches the connection."""
    watch = asyncio.ensure_future(request.receive())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not watch.done():
            watch.cancel()
    if work in done:
        return False
    if watch.result().get("type") == "http.disconnect":
        work.cancel()                                   # a cancelled gather holds a CancelledError: read it,
        work.add_done_callback(lambda f: f.cancelled() or f.exception())   # or asyncio logs "never retrieved"
        return True
    return await until_disconnected(request, work)      # a message that is no disconnect: watch on


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: b"data: " + the JSON of `data` on one line (a str such as "[DONE]" as
    it is) + a blank line, UTF-8."""
    if not isinstance(data, (dict, str)):
        raise TypeError(f"sse_event: data must be a dict (sent as JSON) or a str, got {_describe(data)}")
    if isinstance(data, str) and ("\n" in data or "\r" in data):
        raise ValueError(f"sse_event: data, a str, is sent as it is, on one line; {data[:40]!r} holds a line break")
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode("utf-8")


async def sse_stream(stream: Any, chunk: Callable[[Any, str | None, bool], dict[str, Any]]) -> AsyncIterator[bytes]:
    """The event stream of one choice: for each piece from `stream` (`async for`), as it arrives,
    the event of chunk(piece, None, first); when the stream ends, the event of chunk(None,
    stream.finish_reason, first), then the event "[DONE]". first is True for the first chunk of
    the stream only (the chat format's role goes in it): the first piece's, or the final chunk's
    when no piece came."""
    first = True
    async for piece in stream:
        yield sse_event(chunk(piece, None, first))
        first = False
    yield sse_event(chunk(None, stream.finish_reason, first))
    yield sse_event("[DONE]")


def make_app(engine: Engine, tokenizer: CharTokenizer, model_name: str = "tiny-gpt", api_key: str | None = None,
             allowed_origins: Sequence[str] | None = None, allowed_hosts: Sequence[str] | None = None,
             max_body_bytes: int = 1 << 20, body_timeout: float = 30.0) -> Any:
    """The FastAPI application over `engine`: POST /v1/completions and /v1/chat/completions
    (streamed with sse_stream when "stream": true), GET /v1/models and /v1/models/{id}, /health,
    /metrics (Prometheus text), /stats (JSON for the page) and / (the page); POST
    /reset_prefix_cache (empties the prefix cache and the peak-running counter, as vLLM's endpoint
    of that name); /docs and /openapi.json. The engine's loop starts with the app and stops, after
    draining, when the server shuts down. The front door (serving_kit.FrontDoor, section 12): the
    Host header must name one of allowed_hosts (None: this machine's loopback names; ["*"]: any),
    /v1 and /reset_prefix_cache need `Authorization: Bearer <api_key>` when api_key is set, bodies
    over max_bytes get 413 before they are read, a body not read whole within body_timeout
    seconds 408; CORS only for allowed_origins (None: no cross-origin page may call it)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from minitorch.serving_kit import PAGE_HTML, add_front_door

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="minitorch server", description="Lesson 15's tiny GPT behind OpenAI's API",
                  lifespan=lifespan)
    app.state.engine, app.state.log = engine, RequestLog()
    add_front_door(app, api_key=api_key, allowed_origins=allowed_origins, allowed_hosts=allowed_hosts,
                   max_body_bytes=max_body_bytes, body_timeout=body_timeout)

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
    decode_one = pieces.__getitem__                                         # a token's text alone

    async def complete(request: Request, chat: bool) -> Any:
        params = check_request(parse_body(await request.body()), chat, model_name, tokenizer, engine.W.block_size)
        loop = asyncio.get_running_loop()
        streams = [TokenStream(loop) for _ in range(params.n)]
        try:
            reqs = engine.add_parallel(params.prompt, params.n, params.max_tokens, params.temperature, params.seed,
                                       [s.push for s in streams], params.sampling)
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(int(exc.retry_after))}) from None
        except RuntimeError as exc:
            raise APIError(503, str(exc), "server_error", code="shutting_down") from None
        texts = [TextStream(s, r, engine, decode_one, StopStrings(params.stop) if params.stop else None, params.echo)
                 for s, r in zip(streams, reqs)]
        build = ResponseBuilder(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model_name, int(time.time()),
                                chat, params.logprobs, decode_one, params.include_usage)

        def usage() -> dict[str, int]:
            done = sum(t.num_tokens for t in texts)
            return {"prompt_tokens": len(params.prompt), "completion_tokens": done,
                    "total_tokens": len(params.prompt) + done}

        def end() -> None:  # the client went away, or the response is complete: free the blocks now
            for r in reqs:
                engine.abort(r)
                app.state.log.record(r)

        if params.stream:
            async def events() -> AsyncIterator[bytes]:
                try:
                    choices = [sse_stream(t, functools.partial(build.chunk, i)) for i, t in enumerate(texts)]
                    if params.n == 1 and not params.include_usage:
                        stream, ready = choices[0], lambda: texts[0].ready
                    else:
                        stream = merge_events(choices, lambda: [sse_event(build.usage_chunk(usage()))]
                                              if params.include_usage else [])
                        ready = lambda: any(t.ready for t in texts)  # noqa: E731
                    async for event in coalesce(stream, ready):
                        yield event
                finally:
                    end()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": build.id})

        async def collect(text: TextStream) -> list[Piece]:
            return [piece async for piece in text]

        work = asyncio.ensure_future(asyncio.gather(*(collect(t) for t in texts)))
        try:
            gone = await until_disconnected(request, work)
        finally:
            end()
        if gone:                                           # nobody to answer (nginx logs this as 499)
            return JSONResponse(APIError(499, "the client closed the connection").body(), status_code=499)
        choices = work.result()
        if any(r.finish_reason == "error" for r in reqs):
            raise APIError(500, f"the engine failed: {type(engine.error).__name__}: {engine.error}", "server_error")
        return JSONResponse(build.response([(c, t.finish_reason) for c, t in zip(choices, texts)], usage()),
                            headers={"X-Request-Id": build.id})

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "minitorch",
                "max_model_len": engine.W.block_size}

    @app.get("/v1/models", response_model=None)
    async def models() -> Any:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str) -> Any:
        if model_id != model_name:
            raise APIError(404, f"the model '{model_id[:80]}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return model_card()

    @app.get("/health", response_model=None)
    async def health() -> Any:  # 503 once the engine cannot serve (a load balancer's signal)
        if not getattr(engine, "alive", True):
            raise APIError(503, "the engine is not taking requests" + (f": {engine.error}" if engine.error else ""),
                           "server_error", code="engine_down")
        return {"status": "ok"}

    @app.post("/reset_prefix_cache", response_model=None)
    async def reset_prefix_cache() -> Any:
        return {"dropped_blocks": engine.reset_prefix_cache()}

    @app.get("/stats", response_model=None)
    async def stats() -> Any:
        return engine.stats()

    @app.get("/metrics", response_class=PlainTextResponse, response_model=None)
    async def metrics() -> Any:
        return PlainTextResponse(render_metrics(engine, app.state.log), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse, response_model=None)
    async def page() -> Any:
        return HTMLResponse(PAGE_HTML.replace("MODEL", json.dumps(model_name)))

    return app


def build_server(dtype: Any = np.float32, engine_process: bool = False, app_kw: dict[str, Any] | None = None,
                 **engine_kw: Any) -> tuple[Any, Any]:
    """(engine, app) serving lesson 09's shipped tiny GPT in `dtype`; engine_kw go to Engine, app_kw
    to make_app (api_key, allowed_origins, allowed_hosts, max_body_bytes, body_timeout). With
    engine_process, the engine runs in a process of its own (EngineProcess, section 11)."""
    model, tokenizer = load_tiny_gpt()
    engine = EngineProcess(dtype, **engine_kw) if engine_process else model_engine(model, dtype, **engine_kw)
    return engine, make_app(engine, tokenizer, **(app_kw or {}))


def serve(host: str = "127.0.0.1", port: int = 8000, step_interval: float = 0.02, engine_process: bool = True,
          api_key: str | None = None, allowed_origins: Sequence[str] | None = None,
          allowed_hosts: Sequence[str] | None = None, **engine_kw: Any) -> None:
    """Serve the tiny GPT until Ctrl-C (`make serve`): the first Ctrl-C finishes the requests in
    flight, a second aborts them and stops at once (serving_kit.uvicorn_server). step_interval slows
    each step so a lecture can watch the tokens arrive; engine_process: the engine in a process of
    its own (section 11), or in a thread of this one. api_key (default: the environment's
    MINITORCH_API_KEY, as vLLM reads VLLM_API_KEY): the Bearer token /v1 requires; allowed_origins:
    the web pages' origins allowed to call it (CORS); allowed_hosts: the names the Host header may
    give besides the loopback ones and `host` (a server on 0.0.0.0 is reached by other names)."""
    import os

    from minitorch.serving_kit import uvicorn_server

    api_key = api_key if api_key is not None else os.environ.get("MINITORCH_API_KEY") or None
    hosts = list(allowed_hosts or ()) + ([host] if host not in ("0.0.0.0", "::", "") else [])
    _, app = build_server(step_interval=step_interval, engine_process=engine_process,
                          app_kw={"api_key": api_key, "allowed_origins": allowed_origins,
                                  "allowed_hosts": ["127.0.0.1", "localhost", "::1", *hosts]}, **engine_kw)
    print(f"minitorch server: open http://{host}:{port}/ (metrics at /metrics, the API's schema at /docs)"
          + ("; /v1 needs the API key" if api_key else "") + "; Ctrl-C stops it")
    try:
        uvicorn_server(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30).run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down gracefully
        pass
    print("minitorch server: stopped")


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m minitorch.api_server [--host H] [--port P] [--api-key KEY] [--allowed-origins O ...]
    [--allowed-hosts H ...] [--step-interval S] [--thread]`: serve() from the command line, with
    vLLM's names for the options."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m minitorch.api_server", description="Serve lesson 09's tiny GPT.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1 (vLLM's --api-key)")
    ap.add_argument("--allowed-origins", nargs="*", default=None, help="CORS: origins whose pages may call the API")
    ap.add_argument("--allowed-hosts", nargs="*", default=None, help="Host header names besides the loopback ones")
    ap.add_argument("--step-interval", type=float, default=0.02, help="seconds per engine step, at least")
    ap.add_argument("--thread", action="store_true", help="the engine in a thread of the server, not a process")
    a = ap.parse_args(argv)
    serve(a.host, a.port, a.step_interval, not a.thread, a.api_key, a.allowed_origins, a.allowed_hosts)


if __name__ == "__main__" and globals().get("__spec__") is not None:  # python -m minitorch.api_server, not a kernel
    import minitorch.api_server

    minitorch.api_server.main()


from minitorch.checks import Attrs, FloatDType, Instance, Int, Number, Optional, Positive, Seq, Size, Str  # noqa: E402
from minitorch.checks import Unchecked, validate_public  # noqa: E402

_OWN = Unchecked()          # checked in the body (once per token or per step: a fast path of its own)
_ENGINE = Attrs("add_parallel", "abort", "stats", "reset_prefix_cache", "start", "stop", "W")   # Engine, EngineProcess
_REQUEST = Attrs("prompt", "output", "logprobs", "finish_reason", "token_times")   # a GenRequest (a notebook's too)
validate_public(globals(), {
    "parse_body": {"raw": _OWN},
    "check_request": {"body": Instance(dict, must="a JSON object (a dict)"), "context": Size,
                      "tokenizer": Attrs("encode", "decode", "vocab_size")},
    "TokenStream.push": {"token": _OWN}, "TokenStream.deliver": {"token": _OWN},
    "LoopMailbox.put": {"stream": _OWN, "token": _OWN},
    "TextStream": {"request": _REQUEST, "engine": _ENGINE, "stops": Unchecked()},
    "ResponseBuilder": {"created": Int(0), "logprobs": Optional(Int(0, MAX_LOGPROBS))},
    "ResponseBuilder.chunk": {"index": _OWN, "piece": _OWN, "finish_reason": _OWN, "first": _OWN},
    "ResponseBuilder.usage_chunk": {"usage": Instance(dict, must="a dict of token counts")},
    "ResponseBuilder.response": {"usage": Instance(dict, must="a dict of token counts")},
    "RequestLog.record": {"request": _REQUEST},
    "make_app": {"engine": _ENGINE, "allowed_origins": Optional(Seq(Str())), "allowed_hosts": Optional(Seq(Str())),
                 "max_body_bytes": Size, "body_timeout": Positive},
    "build_server": {"dtype": FloatDType(np.float32, np.float64), "app_kw": Optional(Instance(dict))},
    "serve": {"port": Int(0, 65535), "step_interval": Number(0), "allowed_origins": Optional(Seq(Str())),
              "allowed_hosts": Optional(Seq(Str()))},
    "main": {"argv": Optional(Seq(Str()))},
})
