"""Bad input never gives a 5xx: a table of bad requests with their documented 4xx, then schema fuzzing."""

from __future__ import annotations

import collections
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_harness import MODEL_NAME, ServerProcess, write_server_model

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
FUZZ_EXAMPLES = 250  # per endpoint; about 20 s for both on two cores


def c(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, **fields}


# (method, path, body: dict | bytes | None, status, param expected in the envelope; ... = don't check)
BAD_INPUTS = [
    ("POST", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("POST", C, b'{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    ("POST", C, c(temperature=-1), 400, "temperature"),
    ("POST", C, c(temperature=1e6), 400, "temperature"),
    ("POST", C, c(top_p=0), 400, "top_p"),
    ("POST", C, c(top_p=1.5), 400, "top_p"),
    ("POST", C, c(top_k=-5), 400, "top_k"),
    ("POST", C, c(min_p=2), 400, "min_p"),
    ("POST", C, c(presence_penalty=5), 400, "presence_penalty"),
    ("POST", C, c(frequency_penalty=-3), 400, "frequency_penalty"),
    ("POST", C, c(repetition_penalty=0), 400, "repetition_penalty"),
    ("POST", C, c(max_tokens=0), 400, "max_tokens"),
    ("POST", C, c(max_tokens=-1), 400, "max_tokens"),
    ("POST", C, c(max_tokens=10**9), 400, "max_tokens"),
    ("POST", C, c(max_tokens="ten"), 400, "max_tokens"),
    ("POST", C, c(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("POST", C, c(n=0), 400, "n"),
    ("POST", C, c(n=1000), 400, "n"),
    ("POST", C, c(logprobs=100), 400, "logprobs"),
    ("POST", C, c(logprobs=-1), 400, "logprobs"),
    ("POST", C, c(prompt=""), 400, "prompt"),
    ("POST", C, c(prompt=[]), 400, "prompt"),
    ("POST", C, c(prompt=[99999]), 400, "prompt"),
    ("POST", C, c(prompt=[-1]), 400, "prompt"),
    ("POST", C, c(prompt=5), 400, "prompt"),
    ("POST", C, {"model": MODEL_NAME}, 400, "prompt"),
    ("POST", C, c(prompt=[5] * 2000), 400, "prompt"),
    ("POST", C, c(prompt=["a"] * 100), 400, "prompt"),
    ("POST", C, c(stop=["s"] * 50), 400, "stop"),
    ("POST", C, c(stop=[""]), 400, "stop"),
    ("POST", C, c(stop="x" * 1000), 400, "stop"),
    ("POST", C, c(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("POST", C, c(seed="abc"), 400, "seed"),
    ("POST", C, c(seed=1.5), 400, "seed"),
    ("POST", C, c(stream="yes"), 400, "stream"),
    ("POST", C, c(echo=True), 400, "echo"),
    ("POST", C, c(model="nope"), 404, "model"),
    ("POST", C, b'{"prompt": "x",', 400, None),
    ("POST", C, b"[1, 2]", 400, ...),
    ("POST", C, b'{"prompt": "\xff\xfe"}', 400, ...),
    ("POST", C, b"", 400, ...),
    ("POST", CHAT, chat(messages=[]), 400, "messages"),
    ("POST", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, ...),
    ("POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, ...),
    ("POST", CHAT, chat(chat_template="{{ messages }}"), 400, "chat_template"),
    ("POST", CHAT, chat(top_logprobs=3), 400, "top_logprobs"),
    ("POST", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("POST", CHAT, chat(max_completion_tokens=0), 400, "max_tokens"),
    ("POST", CHAT, json.dumps(chat(temperature=float("-inf"))).encode(), 400, "temperature"),
    ("POST", CHAT, chat(model="gpt-4"), 404, "model"),
    ("GET", "/v1/nope", None, 404, ...),
    ("GET", C, None, 405, ...),
    ("POST", "/detokenize", {"tokens": [-5]}, 400, "prompt"),
    ("POST", "/tokenize", {}, 400, "prompt"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(write_server_model(tmp_path_factory.mktemp("serve-model")), "--max-n", "4")
    yield proc
    assert proc.stop() == 0, proc.logs()


def _send(http: httpx.Client, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers={"content-type": "application/json"})
    return http.request(method, path, json=body) if body is not None else http.request(method, path)


def _assert_envelope(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_bad_inputs_get_documented_4xx(server):
    assert len(BAD_INPUTS) >= 30
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for method, path, body, status, param in BAD_INPUTS:
            response = _send(http, method, path, body)
            assert response.status_code == status, (path, body, response.text)
            error = _assert_envelope(response)
            if param is not ...:
                assert error["param"] == param, (path, body, error)
        good = http.post(C, json=c(max_tokens=3, temperature=0))
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3


def test_errors_inside_a_stream_are_events(server):
    """A request that passes validation streams; the stream always ends with [DONE]."""
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        text = http.post(C, json=c(stream=True)).text
    assert text.rstrip().endswith("data: [DONE]")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
SMALL_INT = st.integers(min_value=-2, max_value=6)
PROB = st.floats(min_value=-0.5, max_value=2.5)
COMMON = {
    "model": st.sampled_from([MODEL_NAME, "other"]) | JSON,
    "max_tokens": SMALL_INT | JSON, "temperature": PROB | JSON, "top_p": PROB | JSON, "top_k": SMALL_INT | JSON,
    "min_p": PROB | JSON, "presence_penalty": PROB | JSON, "frequency_penalty": PROB | JSON,
    "repetition_penalty": PROB | JSON, "seed": st.integers() | JSON, "stop": st.text(max_size=4) | JSON,
    "stop_token_ids": st.lists(st.integers(-3, 500), max_size=3) | JSON, "n": SMALL_INT | JSON,
    "stream": st.booleans() | JSON, "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "ignore_eos": st.booleans() | JSON, "min_tokens": SMALL_INT | JSON, "user": st.text(max_size=4) | JSON,
    "cache_salt": st.text(max_size=4) | JSON,
}  # fmt: skip
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | JSON,
                                 "content": st.text(max_size=12) | JSON})
COMPLETION_FIELDS = {**COMMON, "prompt": st.text(max_size=12) | st.lists(st.integers(-2, 1100), max_size=4) | JSON,
                     "logprobs": SMALL_INT | JSON, "echo": st.booleans() | JSON}
CHAT_FIELDS = {**COMMON, "messages": st.lists(MESSAGE, max_size=3) | JSON, "logprobs": st.booleans() | JSON,
               "top_logprobs": SMALL_INT | JSON, "max_completion_tokens": SMALL_INT | JSON}


def _bodies(base: dict, fields: dict) -> st.SearchStrategy:
    """A valid base request with up to four fields replaced (often validly, sometimes by any JSON) or dropped."""
    keys = st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=4)
    overrides = keys.flatmap(lambda ks: st.fixed_dictionaries({k: fields[k] for k in ks}))
    drops = st.lists(st.sampled_from(sorted(base)), max_size=1)
    return st.tuples(overrides, drops).map(
        lambda od: {k: v for k, v in {**base, **od[0]}.items() if k not in od[1] or k in od[0]})


def _check_fuzz_response(response: httpx.Response, body: dict) -> None:
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        _assert_envelope(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), (body, response.text)
    else:
        assert response.json()["choices"], body


@pytest.mark.parametrize("path,base,fields", [(C, c(), COMPLETION_FIELDS), (CHAT, chat(), CHAT_FIELDS)],
                         ids=["completions", "chat"])
def test_schema_fuzzing_finds_no_5xx(server, path, base, fields):
    started = time.monotonic()
    statuses: collections.Counter = collections.Counter()
    with httpx.Client(base_url=server.base_url, timeout=60) as http:

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(body=_bodies(base, fields))
        def fuzz(body: dict) -> None:
            raw = json.dumps(body, allow_nan=True).encode()
            response = http.post(path, content=raw, headers={"content-type": "application/json"})
            _check_fuzz_response(response, body)
            statuses[response.status_code] += 1

        fuzz()
        print(dict(statuses))
        assert statuses[200] and statuses[400]  # the fuzzer reached both the engine and the validators
        assert http.post(C, json=c(max_tokens=2)).status_code == 200
    assert time.monotonic() - started < 120
