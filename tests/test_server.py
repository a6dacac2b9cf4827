"""The OpenAI-compatible server against the real ``openai`` client: a real `twophase serve` process, tiny model."""

from __future__ import annotations

import asyncio
import time

import httpx

from twophase.metrics.records import SCHEMA
from twophase.report.report import records_from_json
import openai
import pytest

from server_harness import MODEL_NAME, ServerProcess, scrape, wait_idle, write_server_model

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(write_server_model(tmp_path_factory.mktemp("serve-model")), "--max-num-seqs", "64")
    yield proc
    assert proc.stop() == 0, proc.logs()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


def test_models_health_ready(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/ready").status_code == 200


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, chunks = _stream_text(stream)
    assert text == full.choices[0].text and full.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    timings = usage_chunk.model_extra["timings"]
    assert timings["predicted_n"] == 12 and timings["ttft_ms"] > 0 and timings["tpot_ms"] > 0
    assert full.model_extra["timings"]["prompt_n"] == full.usage.prompt_tokens


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert "timings" in chunks[-1].model_extra  # no include_usage: timings ride on the last chunk
    assert full.usage.completion_tokens == 10


def test_n_choices_and_seeds(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11)
    first = client.completions.create(n=3, **kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == len(_tokens(client, PROMPT))
    again = client.completions.create(n=3, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in first.choices]  # seed + index: reproducible
    assert len({c.text for c in first.choices}) > 1  # ... and each choice samples differently
    streamed = client.completions.create(n=3, stream=True, **kwargs)
    texts = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in first.choices]


def test_seed_reproducible_single(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=16,
                  temperature=1.2, top_p=0.95, seed=1234)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    c = client.chat.completions.create(**{**kwargs, "seed": 4321}).choices[0].message.content
    assert a == b and a != c


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and token_lp <= 0 and token in top
        assert token_lp >= max(top.values()) - 1e-5  # greedy: the sampled token is the best


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)


def test_stop_strings(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 6
    stop = base[4:6]
    cut = base[: base.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                        stream=stream, extra_body={"ignore_eos": True})
        if stream:
            text, chunks = _stream_text(out)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (cut, "stop")


def test_32_concurrent_streams_equal_alone(server, client):
    prompts = [f"{PROMPT} number {i} jumps over {i * 7} lazy dogs" for i in range(32)]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

        async def one(prompt: str) -> str:
            stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                      stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(run_all()) == alone
    steps = httpx.get(f"{server.base_url}/v1/records", params={"limit": 200}).json()["steps"]
    assert max(s["num_requests"] for s in steps) > 1  # they really were batched together


def test_disconnect_mid_stream_frees_kv(server):
    before = wait_idle(server.base_url)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data:")) >= 3
            assert scrape(server.base_url)[("vllm:kv_cache_usage_perc", ())] > 0
    after = wait_idle(server.base_url, before[("vllm:kv_cache_usage_perc", ())], timeout=5)
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    assert after[key] == before[key] + 1


def test_disconnect_non_streaming_aborts(server):
    before = wait_idle(server.base_url)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.3)
    after = wait_idle(server.base_url, before[("vllm:kv_cache_usage_perc", ())], timeout=5)
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    assert after[key] == before[key] + 2


def test_metrics_agree_with_requests(server, client):
    before = wait_idle(server.base_url)
    outs = [client.completions.create(model=MODEL_NAME, prompt=f"{PROMPT} {i}", max_tokens=5 + i, temperature=0,
                                      extra_body={"ignore_eos": True}) for i in range(3)]
    after = wait_idle(server.base_url)

    def delta(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before[(name, labels)]

    assert delta("vllm:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert delta("vllm:generation_tokens_total") == sum(o.usage.completion_tokens for o in outs) == 5 + 6 + 7
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 3
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_prompt_tokens_count"):
        assert delta(name) == 3, name
    assert delta("vllm:inter_token_latency_seconds_count") == 4 + 5 + 6
    assert delta("vllm:prefix_cache_queries_total") >= sum(o.usage.prompt_tokens for o in outs) - 3
    assert ("twophase:step_duration_seconds_count", (("phase", "decode"),)) in after
    assert ("vllm:num_preemptions_total", ()) in after and ("vllm:prefix_cache_hits_total", ()) in after


def test_cache_salt_separates_tenants(client):
    prompt = " ".join(["prefill computes the prompt and decode produces tokens"] * 6)
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**kwargs, extra_body={"cache_salt": "tenant-a"})
    same = client.completions.create(**kwargs, extra_body={"cache_salt": "tenant-a"})
    other = client.completions.create(**kwargs, extra_body={"cache_salt": "tenant-b"})
    assert first.usage.prompt_tokens > 32
    assert same.usage.prompt_tokens_details.cached_tokens >= 16
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.model_extra["timings"]["cached_n"] == same.usage.prompt_tokens_details.cached_tokens


def _tokens(client, text: str) -> list[int]:
    return httpx.post(f"{client.base_url.scheme}://{client.base_url.host}:{client.base_url.port}/tokenize",
                      json={"prompt": text}).json()["tokens"]


def test_tokenize_detokenize_records_dashboard(server, client):
    ids = _tokens(client, PROMPT)
    assert ids and httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 3
    records = httpx.get(f"{server.base_url}/v1/records").json()
    assert records["steps"] and records["requests"]
    row = records["requests"][-1]
    assert {"ttft", "tpot", "queue_time"} <= set(row["metrics"]) and "arrival_time" in row and row["scheduled"]
    assert records["schema"] == SCHEMA
    loaded = records_from_json(records)  # the report tool reads the endpoint as it is
    assert loaded.has_timelines and loaded.steps and loaded.latencies()["ttft"]
    since = records["steps"][-1]["step_id"]
    assert httpx.get(f"{server.base_url}/v1/records", params={"since_step": since}).json()["steps"] == []
    page = httpx.get(f"{server.base_url}/dashboard")
    assert page.status_code == 200 and "<canvas" in page.text and "/v1/records" in page.text


def test_ready_reflects_loop(server):
    body = httpx.get(f"{server.base_url}/ready").json()
    assert body["status"] == "ready" and body["last_loop_age_s"] < 5
    time.sleep(0.2)
    assert httpx.get(f"{server.base_url}/ready").status_code == 200


def test_cors_off_by_default(server):
    response = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": "http://elsewhere.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_served_on_uvloop_and_httptools():
    """The server's uvicorn config (loop and HTTP left on "auto", as ``run_server`` leaves them) resolves to uvloop
    and httptools, dependencies of the package: on asyncio's loop with h11 the chunks of each decode step kept the
    GIL from the step thread for ~2 ms a step."""
    import uvicorn

    from twophase.server.main import serving_stack

    config = uvicorn.Config(app=lambda scope, receive, send: None, lifespan="off")
    assert serving_stack(config) == "uvloop, httptools"
    assert serving_stack(uvicorn.Config(app=lambda scope, receive, send: None, lifespan="off", loop="asyncio",
                                        http="h11")) == "asyncio, h11"
