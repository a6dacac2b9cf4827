"""Structured outputs (xgrammar) and tool calling through the real ``openai`` client against a real server.

A tiny random model under a grammar still writes valid output; its chat template (a Qwen/hermes-like one, written
as ``chat_template.jinja``) renders tools. The default model (SmolLM2) shows a real model's JSON and that a
template without tools refuses them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest

from server_harness import MODEL_NAME, ServerProcess, write_server_model
from twophase.server.tools import StreamingToolParser, parse_tool_calls, template_messages

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. <tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools> Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hours"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "Who is it?"}]


def validate(value: Any, schema: dict[str, Any]) -> None:
    """Assert ``value`` satisfies the JSON-schema subset used here (type, enum, bounds, required, no extras)."""
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), value
        assert set(schema.get("required", [])) <= set(value), value
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), value
        for key, item in value.items():
            validate(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)), value
        for item in value:
            validate(item, schema["items"])
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), value
    elif kind == "string":
        assert isinstance(value, str), value
    elif kind == "boolean":
        assert isinstance(value, bool), value
    if "enum" in schema:
        assert value in schema["enum"], value


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = write_server_model(tmp_path_factory.mktemp("structured-model"))
    (Path(directory) / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    proc = ServerProcess(directory)
    yield proc
    assert proc.stop() == 0, proc.logs()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def test_json_schema_20_sampled_requests_validate(client):
    choices = [choice for seed in (7, 1007) for choice in client.chat.completions.create(
        model=MODEL_NAME, messages=USER, n=10, seed=seed, temperature=1.0, max_tokens=200,
        response_format=_response_format(PERSON)).choices]  # 20 requests: seeds 7..16 and 1007..1016
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        validate(json.loads(choice.message.content), PERSON)
    assert len({c.message.content for c in choices}) > 1  # sampled, not one forced string


def test_json_schema_streamed_20_sampled_requests_validate(client):
    texts: dict[tuple[int, int], str] = {}
    reasons: dict[tuple[int, int], str] = {}
    for seed in (11, 1011):
        stream = client.completions.create(model=MODEL_NAME, prompt="A person:", n=10, seed=seed, temperature=1.0,
                                           max_tokens=200, stream=True,
                                           extra_body={"structured_outputs": {"json": PERSON}})
        for chunk in stream:
            for choice in chunk.choices:
                key = (seed, choice.index)
                texts[key] = texts.get(key, "") + choice.text
                if choice.finish_reason:
                    reasons[key] = choice.finish_reason
    assert len(texts) == 20 and set(reasons.values()) == {"stop"}
    for text in texts.values():
        validate(json.loads(text), PERSON)


def test_stream_equals_non_stream_under_a_grammar(client):
    kwargs = dict(model=MODEL_NAME, messages=USER, seed=3, temperature=1.0, max_tokens=200,
                  response_format=_response_format(PERSON))
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == full


def test_guided_choice_regex_grammar_and_stop_strings(client):
    choices = ["yes", "no", "maybe so"]
    for seed in range(5):
        out = client.completions.create(model=MODEL_NAME, prompt="Answer:", seed=seed, temperature=1.0, max_tokens=20,
                                        extra_body={"guided_choice": choices})
        assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=MODEL_NAME, prompt="Code:", seed=1, temperature=1.0, max_tokens=20,
                                    extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.choices[0].text)
    out = client.completions.create(model=MODEL_NAME, prompt="Say:", seed=1, temperature=1.0, max_tokens=20,
                                    extra_body={"structured_outputs": {"grammar": 'root ::= "ab" ("c" | "d")+ "!"'}})
    assert re.fullmatch(r"ab[cd]+!", out.choices[0].text) or out.choices[0].finish_reason == "length"
    out = client.completions.create(model=MODEL_NAME, prompt="Code:", seed=1, temperature=1.0, max_tokens=20,
                                    stop=["-"], extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}", out.choices[0].text) and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])  # fmt: skip
def test_bad_structured_output_is_a_400(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4, extra_body=fields)
    assert info.value.status_code == 400 and info.value.param == param, info.value.body


# ---- tool calling -------------------------------------------------------------------------------------------


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    """Reassemble streamed tool-call deltas: (name, arguments) per index, and the finish reason."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    reason = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.type == "function" and delta.index not in names
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
            reason = choice.finish_reason or reason
    return [(names[i], arguments.get(i, "")) for i in sorted(names)], reason


def test_required_tool_call_matches_schema_and_streams_the_same(client):
    kwargs = dict(model=MODEL_NAME, messages=USER, tools=[WEATHER, CLOCK], tool_choice="required", seed=5,
                  temperature=1.0, max_tokens=200)
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].id.startswith("call_")
    [(name, arguments)] = _calls(choice.message)
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[name]["function"]["parameters"]
    validate(json.loads(arguments), schema)
    streamed, reason = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert streamed == [(name, arguments)] and reason == "tool_calls"


def test_named_tool_choice_and_n(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=[WEATHER, CLOCK], n=4, seed=9, temperature=1.0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in response.choices:
        [(name, arguments)] = _calls(choice.message)
        assert name == "get_time"
        validate(json.loads(arguments), CLOCK["function"]["parameters"])


def test_tool_conversation_and_choice_none(client):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "C"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
    ]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER], max_tokens=8,
                                              tool_choice="none", temperature=0)
    assert response.choices[0].message.content is not None and response.choices[0].message.tool_calls is None


def test_bad_tool_requests_are_400(client):
    cases = [
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {}}]), "tools"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4, **fields)
        assert info.value.param == param, (fields, info.value.body)


def test_template_sees_tool_calls_and_tool_messages(server):
    from twophase.tokenizer.tokenizer import tokenizer_from_hf_dir

    directory = Path(server.proc.args[server.proc.args.index("--model") + 1])
    tokenizer = tokenizer_from_hf_dir(directory)
    messages = template_messages(USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "-3"}])
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER])
    assert '"name": "get_weather"' in text and '{"city": "Oslo", "unit": "C"}}' in text
    assert "<tool_response>\n-3\n</tool_response>" in text and '"description": "Weather in a city"' in text


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": "}\\"", "b": [1, {"c": null}]}}\n</tool_call>',
    'Let me look. <tool_call>{"name":"f","arguments":{}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"x": 1}}'
    '</tool_call>',
    "plain text with a <tool_ prefix",
])  # fmt: skip
def test_streaming_parser_reassembles_to_the_whole_parse(text):
    content, calls = parse_tool_calls(text)
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    for step in (1, 2, 5, len(text)):
        parser, streamed_content, names, arguments = StreamingToolParser(), "", {}, {}
        for start in range(0, len(text), step):
            piece, deltas = parser.feed(text[start : start + step], final=start + step >= len(text))
            streamed_content += piece
            for delta in deltas:
                if "id" in delta:
                    names[delta["index"]] = delta["function"]["name"]
                arguments[delta["index"]] = arguments.get(delta["index"], "") + delta["function"]["arguments"]
        assert [(names[i], arguments[i]) for i in sorted(names)] == expected
        assert streamed_content.strip() == (content or "").strip()


# ---- the default model (SmolLM2-135M-Instruct) ----------------------------------------------------------------


def test_default_model_json_object_and_no_tools(default_server):
    client = openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Give a JSON object with the name and age of a person."}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=64,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, tools=[WEATHER])
    assert info.value.param == "tools" and "chat template" in info.value.message
