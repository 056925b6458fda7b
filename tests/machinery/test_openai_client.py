"""Lesson 15's server as a user meets it: the official `openai` Python client (pinned with the course's
packages), sync and async, streamed and not, for completions and chat, every parameter the server
honours, and the exceptions the client raises for the server's 400, 401, 404, 413 and 429.

Oracles: lesson 11's gpt_forward (float64) and, for sampling, the distribution written out from the
OpenAI/vLLM definitions (oracle_probs, as tests/test_15_serving.py writes it) drawn with lesson 11's draw and the
request's seed, token by token: the server must give exactly those tokens.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from minitorch.gpt import load_tiny_gpt  # noqa: E402
from minitorch.kv_cache import draw, gpt_forward, load_tiny_weights  # noqa: E402
from minitorch.api_server import make_app  # noqa: E402
from minitorch.engine import Engine  # noqa: E402
from minitorch.serving_kit import ServerThread  # noqa: E402

W64 = load_tiny_weights(np.float64)
TOK = load_tiny_gpt()[1]
MODEL = "tiny-gpt"


def oracle_probs(logits, t, top_p=1.0, top_k=0, bias=None, presence=0.0, frequency=0.0, counts=None):
    """The sampling distribution written out from its definition, token by token."""
    z = np.array(logits, dtype=np.float64)
    for token, b in (bias or {}).items():
        z[token] += b
    if counts is not None:
        z = z - frequency * counts - presence * (counts > 0)
    if t == 0:
        p = np.zeros(len(z))
        p[int(np.argmax(z))] = 1.0
        return p
    z = z / t
    p = np.exp(z - z.max())
    p = p / p.sum()
    if 0 < top_k < len(p):
        kth = sorted(p, reverse=True)[top_k - 1]
        p = np.where(p >= kth, p, 0.0)
        p = p / p.sum()
    if top_p < 1:
        total, cut = 0.0, None
        for i in sorted(range(len(p)), key=lambda i: (-p[i], i)):
            total += p[i]
            if total >= top_p:
                cut = p[i]
                break
        if cut is not None:
            p = np.where(p >= cut, p, 0.0)
            p = p / p.sum()
    return p


def oracle(prompt: str, n: int, temperature: float = 0.0, seed: int = 0, top_p: float = 1.0, top_k: int = 0,
           bias: dict | None = None, presence: float = 0.0, frequency: float = 0.0, stop: list[str] = ()) -> str:
    """The text a request gives, token by token from the definitions: full recomputation (gpt_forward),
    the sampling distribution, one draw per token with the request's generator; cut at a stop string."""
    rng, ids, out = np.random.default_rng(seed), list(TOK.encode(prompt)), []
    for _ in range(n):
        logits = gpt_forward(W64, np.array([ids + out]))[0, -1]
        p = oracle_probs(logits, temperature, top_p, top_k, bias, presence, frequency,
                         np.bincount(np.array(out, dtype=np.int64), minlength=W64.vocab_size) if presence or frequency
                         else None)
        out.append(int(np.argmax(p)) if temperature == 0 else draw(p, rng))
    text = TOK.decode(out)
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


@contextmanager
def serving(api_key: str | None = None, **engine_kw):
    kw = dict(num_blocks=48, block_size=8, max_running=16, prefix_caching=True)
    eng = Engine(W64, **{**kw, **engine_kw})
    with ServerThread(make_app(eng, TOK, MODEL, api_key=api_key)) as srv:
        yield eng, srv


@pytest.fixture(scope="module")
def server():
    with serving() as (eng, srv):
        yield eng, srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1].url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_completions_and_chat_as_the_client_reads_them(client):
    c = client.completions.create(model=MODEL, prompt="The for statement", max_tokens=12, temperature=0, user="u-1")
    assert c.id.startswith("cmpl-") and c.object == "text_completion" and c.model == MODEL
    assert c.choices[0].text == oracle("The for statement", 12) and c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (17, 12, 29)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "x = 1"},
                                                                 {"role": "user", "content": "class A:"}],
                                          max_completion_tokens=6, temperature=0)
    assert chat.id.startswith("chatcmpl-") and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == oracle("x = 1\n\nclass A:\n\n", 6) and chat.usage.completion_tokens == 6
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    full = client.completions.create(model=MODEL, prompt="x" * 50, temperature=0)
    assert full.usage.completion_tokens == 14 and full.choices[0].finish_reason == "length", \
        "no max_tokens: the rest of the 64-token context"


def test_streams_sync(client):
    pieces, usage, finish = [], None, []
    for chunk in client.completions.create(model=MODEL, prompt="import os", max_tokens=15, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish.append(ch.finish_reason)
    assert "".join(pieces) == oracle("import os", 15) and finish[-1] == "length" and usage.completion_tokens == 15
    deltas = []
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, temperature=0, stream=True):
        deltas += [ch.delta for ch in chunk.choices]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == oracle("hi\n\n", 8)


def test_async_client_concurrent_and_streamed(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server[1].url + "/v1", api_key="unused", max_retries=0,
                                      timeout=30) as aclient:
            prompts = ["def f", "class B", "while x", "for i in", "x = ", "The with statement"]
            answers = await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=p, max_tokens=9,
                                                                        temperature=0) for p in prompts))
            stream = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                           max_tokens=5, temperature=0, stream=True)
            text = "".join([ch.delta.content or "" async for chunk in stream for ch in chunk.choices])
            return prompts, answers, text

    prompts, answers, text = asyncio.run(main())
    assert [a.choices[0].text for a in answers] == [oracle(p, 9) for p in prompts]
    assert text == oracle("x\n\n", 5)


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, seed=3),
    dict(temperature=1.0, seed=4, top_p=0.6),
    dict(temperature=1.3, seed=5, extra_body={"top_k": 4}),
    dict(temperature=0.9, seed=6, presence_penalty=1.5, frequency_penalty=0.5),
    dict(temperature=0, logit_bias={str(TOK.encode("z")[0]): 12}),
    dict(temperature=0.7, seed=7, top_p=0.9, logit_bias={str(TOK.encode("e")[0]): -100}, frequency_penalty=-1.0,
         extra_body={"top_k": 20}),
], ids=["temperature", "top_p", "top_k", "penalties", "logit_bias", "all"])
def test_each_sampling_parameter_is_honoured(client, params):
    extra = params.get("extra_body", {})
    want = oracle("The for statement", 20, params.get("temperature", 1.0), params.get("seed", 0),
                  params.get("top_p", 1.0), extra.get("top_k", 0),
                  {int(k): v for k, v in params.get("logit_bias", {}).items()}, params.get("presence_penalty", 0.0),
                  params.get("frequency_penalty", 0.0))
    got = client.completions.create(model=MODEL, prompt="The for statement", max_tokens=20, **params)
    assert got.choices[0].text == want, f"{params}: the server gave {got.choices[0].text!r}, the definition {want!r}"


def test_n_stop_echo_and_logprobs(client):
    many = client.completions.create(model=MODEL, prompt="for i in", max_tokens=6, temperature=0.9, seed=11, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.usage.completion_tokens == 18
    assert [c.text for c in many.choices] == [oracle("for i in", 6, 0.9, 11 + i) for i in range(3)], \
        "n samples: sample i as the request alone with seed + i"
    text = oracle("The for statement", 40)
    stop = [" is", "@@"]
    got = client.completions.create(model=MODEL, prompt="The for statement", max_tokens=40, temperature=0, stop=stop)
    assert got.choices[0].text == oracle("The for statement", 40, stop=stop) == text[:text.find(" is")]
    assert got.choices[0].finish_reason == "stop"
    streamed = [ch.text for chunk in client.completions.create(model=MODEL, prompt="The for statement", max_tokens=40,
                                                               temperature=0, stop=" is", stream=True)
                for ch in chunk.choices]
    assert "".join(streamed) == text[:text.find(" is")] and " i" not in "".join(streamed[-2:])
    echo = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text == "ab" + oracle("ab", 3) and lp.tokens == list("ab" + oracle("ab", 3))
    logits = gpt_forward(W64, np.array([TOK.encode(echo.choices[0].text)[:-1]]))[0]
    ref = logits - logits.max(axis=1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
    ids = TOK.encode(echo.choices[0].text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], [ref[j - 1, ids[j]] for j in range(1, len(ids))], rtol=1e-9)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == list(chat.choices[0].message.content)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    assert all(math.isclose(e.logprob, max(a.logprob for a in e.top_logprobs)) for e in content), "greedy: the top one"


def test_the_clients_exceptions(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="ab", top_p=5)
    assert err.value.status_code == 400 and err.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError, match="tool calling"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="min_p"):
        client.completions.create(model=MODEL, prompt="ab", extra_body={"min_p": 0.2})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="ab")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt="a" * (2 << 20))
    assert err.value.status_code == 413, "a body over 1 MiB: 413 (the client raises APIStatusError)"
    with serving(api_key="sesame") as (eng, srv):
        anonymous = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            anonymous.completions.create(model=MODEL, prompt="ab", max_tokens=2)
        keyed = openai.OpenAI(base_url=srv.url + "/v1", api_key="sesame", max_retries=0, timeout=30)
        assert keyed.completions.create(model=MODEL, prompt="ab", max_tokens=2, temperature=0).choices[0].text


def test_a_full_queue_raises_rate_limit_error():
    with serving(max_running=1, max_waiting=1, step_interval=0.05, prefix_caching=False) as (eng, srv):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        results: list = [None] * 6

        def one(i: int) -> None:
            try:
                results[i] = client.completions.create(model=MODEL, prompt=f"def f{i}", max_tokens=10, temperature=0)
            except openai.APIStatusError as exc:
                results[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.01)
        for t in threads:
            t.join(60)
        limited = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert limited and all(int(r.response.headers["retry-after"]) >= 1 for r in limited), results
        served = [r for r in results if not isinstance(r, Exception)]
        assert len(served) + len(limited) == 6 and len(served) >= 2
