"""API key, body limit, CORS, overload (503 + Retry-After) and graceful SIGTERM, on one small-limits server."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, ServerProcess, scrape, write_server_model

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://allowed.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(write_server_model(tmp_path_factory.mktemp("serve-model")), "--max-num-seqs", "1",
                         "--max-waiting-requests", "2", "--max-body-bytes", "4096", "--cors-origins", ORIGIN,
                         "--shutdown-timeout", "20", env={"TWOPHASE_API_KEY": KEY})
    yield proc
    proc.stop()


def _body(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 3, "temperature": 0, **fields}


def test_api_key(server):
    url = f"{server.base_url}/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"x-api-key": "nope"}):
        response = httpx.post(url, json=_body(), headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=_body(), headers=AUTH).status_code == 200
    assert httpx.post(url, json=_body(), headers={"x-api-key": KEY}).status_code == 200
    for path in ("/metrics", "/v1/models", "/v1/records", "/ready"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 401, path
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    good = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2).choices[0].message.content is not None
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_body_size_limit(server):
    url = f"{server.base_url}/v1/completions"
    big = _body(prompt="x" * 5000)
    response = httpx.post(url, json=big, headers=AUTH)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(url, content=iter([b'{"prompt": "', b"y" * 5000, b'"}']), headers=AUTH)
    assert chunked.status_code == 413
    assert httpx.post(url, json=_body(), headers=AUTH).status_code == 200


def test_cors(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{server.base_url}/v1/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    denied = httpx.options(f"{server.base_url}/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in denied.headers


def test_overload_gets_503_and_accepted_complete(server):
    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as http:
            body = _body(max_tokens=60, ignore_eos=True)
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(10)))

    started = time.monotonic()
    responses = asyncio.run(fire())
    assert time.monotonic() - started < 60
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses, statuses
    for response in responses:
        if response.status_code == 503:
            assert response.headers["retry-after"].isdigit()
            assert response.json()["error"]["code"] == "queue_full"
        else:
            assert response.json()["usage"]["completion_tokens"] == 60
    assert httpx.post(f"{server.base_url}/v1/completions", json=_body(), headers=AUTH).status_code == 200


def test_choices_beyond_the_waiting_limit_are_refused_whole(server):
    """n choices count against the waiting limit (2): n=3 on an idle server is refused, nothing is queued."""
    before = scrape(server.base_url, AUTH)
    response = httpx.post(f"{server.base_url}/v1/completions", json=_body(n=3), headers=AUTH, timeout=30)
    assert response.status_code == 503 and response.json()["error"]["code"] == "queue_full"
    after = scrape(server.base_url, AUTH)
    key = ("vllm:prompt_tokens_total", ())
    assert after.get(key, 0.0) == before.get(key, 0.0)  # no choice ran
    assert httpx.post(f"{server.base_url}/v1/completions", json=_body(n=2), headers=AUTH, timeout=60).status_code == 200


def test_sigterm_finishes_in_flight_and_exits_zero(server):
    """Last in this module: SIGTERM mid-stream → the stream completes, new connections are refused, exit 0."""
    body = _body(max_tokens=900, ignore_eos=True, stream=True)
    lines = []
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    server.proc.send_signal(signal.SIGTERM)
                    time.sleep(0.3)
                    with pytest.raises(httpx.TransportError):
                        httpx.get(f"{server.base_url}/health", timeout=2)
    assert lines[-2] == "data: [DONE]" or lines[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in line for line in lines)
    assert server.proc.wait(30) == 0
