"""Nothing silently ignored: every request field of the OpenAI client (and vLLM's extensions, sent through
``extra_body``) is implemented, refused with a 400 naming it, or accepted as documented to change nothing;
unknown fields are accepted and logged. Real ``openai`` client against a real server."""

from __future__ import annotations

import inspect
from typing import Any

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, ServerProcess, write_server_model
from twophase.server.protocol import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest

CHAT, COMPLETIONS = "chat", "completions"
TRANSPORT = {"extra_body", "extra_headers", "extra_query", "timeout"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# (endpoint, field, value): would change the output, not implemented -> 400 with param == field
REFUSED: list[tuple[str, str, Any]] = [
    (CHAT, "tools", [TOOL]), (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "function_call", {"name": "f"}), (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]), (CHAT, "reasoning_effort", "high"), (CHAT, "verbosity", "low"),
    (CHAT, "web_search_options", {}), (CHAT, "moderation", {"model": "omni-moderation-latest"}),
    (CHAT, "echo", True), (CHAT, "add_special_tokens", True), (CHAT, "continue_final_message", True),
    (CHAT, "documents", [{"text": "x"}]),
    (COMPLETIONS, "echo", True), (COMPLETIONS, "suffix", "end"), (COMPLETIONS, "best_of", 2),
    (COMPLETIONS, "add_special_tokens", False),
] + [
    (endpoint, field, value) for endpoint in (CHAT, COMPLETIONS) for field, value in [
        ("use_beam_search", True), ("length_penalty", 0.5), ("prompt_logprobs", 1), ("truncate_prompt_tokens", 4),
        ("logits_processors", ["x"]), ("return_tokens_as_token_ids", True), ("return_token_ids", True),
        ("skip_special_tokens", False), ("spaces_between_special_tokens", False), ("priority", 1),
        ("kv_transfer_params", {"do_remote_prefill": True}), ("vllm_xargs", {"a": 1}),
        ("mm_processor_kwargs", {"a": 1}), ("guided_whitespace_pattern", r"\s*"),
    ]
]  # fmt: skip

# (endpoint, field, value): accepted, changes nothing for us -> 200
ACCEPTED: list[tuple[str, str, Any]] = [
    (CHAT, "user", "u1"), (CHAT, "metadata", {"k": "v"}), (CHAT, "store", True), (CHAT, "service_tier", "auto"),
    (CHAT, "parallel_tool_calls", False), (CHAT, "prediction", {"type": "content", "content": "hi"}),
    (CHAT, "prompt_cache_key", "k"), (CHAT, "prompt_cache_retention", "24h"), (CHAT, "safety_identifier", "s"),
    (CHAT, "prompt_cache_options", {"mode": "implicit"}), (CHAT, "tools", []), (CHAT, "tool_choice", "none"),
    (CHAT, "modalities", ["text"]), (CHAT, "response_format", {"type": "text"}), (CHAT, "priority", 0),
    (CHAT, "guided_decoding_backend", "xgrammar"), (CHAT, "request_id", "r1"), (CHAT, "skip_special_tokens", True),
    (COMPLETIONS, "user", "u1"), (COMPLETIONS, "best_of", 1), (COMPLETIONS, "echo", False),
    (COMPLETIONS, "suffix", ""), (COMPLETIONS, "add_special_tokens", True),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(write_server_model(tmp_path_factory.mktemp("fields-model")))
    yield proc
    assert proc.stop() == 0, proc.logs()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _create(client: openai.OpenAI, endpoint: str, **fields: Any):
    """Send one request; fields the installed client does not name travel in ``extra_body`` (vLLM's way)."""
    create = client.chat.completions.create if endpoint == CHAT else client.completions.create
    named = set(inspect.signature(create).parameters)
    kwargs = {k: v for k, v in fields.items() if k in named}
    extra = {k: v for k, v in fields.items() if k not in named}
    base = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == CHAT else {"prompt": "hello"}
    return create(model=MODEL_NAME, max_tokens=2, **base, **kwargs, extra_body=extra or None)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_every_client_field_is_implemented_refused_or_documented(endpoint):
    client = openai.OpenAI(api_key="unused")
    create = client.chat.completions.create if endpoint == CHAT else client.completions.create
    model = ChatCompletionRequest if endpoint == CHAT else CompletionRequest
    known = set(model.model_fields) | set(model.unsupported) | set(IGNORED_FIELDS)
    missing = set(inspect.signature(create).parameters) - TRANSPORT - known
    assert not missing, f"OpenAI {endpoint} fields with no policy: {sorted(missing)}"


def test_refused_fields_are_a_400_naming_the_field(client):
    for endpoint, field, value in REFUSED:
        with pytest.raises(openai.BadRequestError) as info:
            _create(client, endpoint, **{field: value})
        assert info.value.status_code == 400 and info.value.param == field, (endpoint, field, info.value.body)
        assert info.value.code == "unsupported" and field in info.value.message


def test_fields_that_change_nothing_are_accepted(client):
    for endpoint, field, value in ACCEPTED:
        response = _create(client, endpoint, **{field: value})
        assert response.choices, (endpoint, field)


def test_unknown_fields_are_accepted_and_logged(server, client):
    response = _create(client, CHAT, frobnicate_level=3)
    assert response.choices
    log_lines = [line for line in server.logs().splitlines() if "frobnicate_level" in line]
    assert len(log_lines) == 1 and "unknown" in log_lines[0]


# ---- logit_bias, allowed_token_ids, bad_words through the real client ---------------------------------------------


def _token_text(server, token_id: int) -> str:
    return httpx.post(f"{server.base_url}/detokenize", json={"tokens": [token_id]}).json()["prompt"]


def _sampled_tokens(client, **fields: Any) -> list[str]:
    """Token strings of one completion of 8 tokens (from its logprobs)."""
    response = client.completions.create(model=MODEL_NAME, prompt="hello there", max_tokens=8, logprobs=0,
                                         **{k: v for k, v in fields.items() if k != "extra_body"},
                                         extra_body={"ignore_eos": True, **fields.get("extra_body", {})})
    return response.choices[0].logprobs.tokens


def test_logit_bias_forces_and_bans_tokens(server, client):
    forced = 150
    tokens = _sampled_tokens(client, temperature=1.0, seed=1, logit_bias={str(forced): 100})
    assert tokens == [_token_text(server, forced)] * 8
    greedy = _sampled_tokens(client, temperature=0)
    banned_id = httpx.post(f"{server.base_url}/tokenize", json={"prompt": greedy[0]}).json()["tokens"]
    assert len(banned_id) == 1
    unbiased = _sampled_tokens(client, temperature=0, logit_bias={str(banned_id[0]): -100})
    assert greedy[0] not in unbiased


def test_logit_bias_outside_vocabulary_is_a_400(client):
    for bias in ({"99999": 5}, {"x": 5}, {"5": 101}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, logit_bias=bias)
        assert info.value.param == "logit_bias", bias


def test_allowed_token_ids_and_bad_words(server, client):
    allowed = {_token_text(server, t) for t in (150, 151, 152)}
    tokens = _sampled_tokens(client, temperature=1.0, seed=2, extra_body={"allowed_token_ids": [150, 151, 152]})
    assert set(tokens) <= allowed
    greedy = _sampled_tokens(client, temperature=0)
    avoided = _sampled_tokens(client, temperature=0, extra_body={"bad_words": [greedy[0]]})
    assert greedy[0] not in avoided
