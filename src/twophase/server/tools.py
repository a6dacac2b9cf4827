"""Tool calling on chat completions: which tools the chat template sees, the grammar that forces a call, and the
hermes-style parser (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as vLLM's ``hermes`` parser and
Qwen-style templates) that turns the model's text into ``tool_calls`` — whole, or as streamed deltas.

``tool_choice``: ``none`` (tools are not shown to the model, nothing is parsed), ``auto`` (the default with tools:
tools shown, calls parsed), ``required`` (exactly one call to some tool, forced by a JSON-schema grammar), or
``{"type": "function", "function": {"name": ...}}`` (exactly one call to that tool).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from twophase.sampling_params import InvalidRequestError
from twophase.server.errors import APIError
from twophase.structured import StructuredOutputSpec

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*(?=\S)')
_CALLS = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.DOTALL)


@dataclass
class ToolPlan:
    """What a chat request's ``tools`` / ``tool_choice`` mean for rendering, decoding and the response."""

    tools: list[dict[str, Any]] | None = None  # passed to the chat template (None: not rendered)
    spec: StructuredOutputSpec | None = None  # the grammar forcing one call (required / named choice)
    parse: bool = False  # parse <tool_call> blocks out of the output


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, template: str | None) -> ToolPlan:
    """Validate ``tools`` and ``tool_choice`` against each other and the chat template (400 naming the field)."""
    functions = [_function(i, tool) for i, tool in enumerate(tools or [])]
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    named = _named_choice(choice, functions)
    if choice == "none":
        return ToolPlan()
    if not functions:
        raise InvalidRequestError(f"tool_choice {json.dumps(choice)} needs a non-empty tools list", "tool_choice")
    if not template or "tools" not in template:
        raise APIError(400, "tools are not supported by this model: its chat template does not render tools "
                       "(use a model with a tool-aware template, or pass one in chat_template)", "tools",
                       "unsupported")
    if choice == "auto":
        return ToolPlan(tools=tools, parse=True)
    forced = [f for f in functions if f["name"] == named] if named else functions
    return ToolPlan(tools=tools, spec=tool_call_spec(forced), parse=True)


def _function(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    parameters = function.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object", "tools")
    return {"name": function["name"], "parameters": parameters}


def _named_choice(choice: Any, functions: list[dict[str, Any]]) -> str | None:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be none, auto, required or a named function; got {choice!r}",
                                      "tool_choice")
        return None
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError("tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in {f["name"] for f in functions}:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return name


def tool_call_spec(functions: list[dict[str, Any]]) -> StructuredOutputSpec:
    """A grammar for one ``<tool_call>`` block calling one of ``functions`` with arguments matching its schema."""
    options = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return StructuredOutputSpec.json_schema(schema, "tool_choice", prefix=TOOL_CALL_START + "\n",
                                            suffix="\n" + TOOL_CALL_END)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them: an assistant's ``tool_calls[].function.arguments`` JSON text becomes a
    dict (as vLLM and transformers pass them)."""
    result = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_decoded_call(call) for call in calls]}
        result.append(message)
    return result


def _decoded_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# ---- parsing ------------------------------------------------------------------------------------------------


def split_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text exactly as written) of one tool-call body, or None when it is not a call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    found = _ARGUMENTS.search(body)
    if found is None or "arguments" not in call:
        return call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)
    try:
        _, end = json.JSONDecoder().raw_decode(body, found.end())
    except json.JSONDecodeError:
        return call["name"], json.dumps(call["arguments"], ensure_ascii=False)
    return call["name"], body[found.end() : end]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Content before the first ``<tool_call>`` and the calls (OpenAI ``tool_calls``); the whole text as content
    and no calls when there is no block or a block is not a valid call."""
    if TOOL_CALL_START not in text:
        return text, []
    calls = [split_call(body) for body in _CALLS.findall(text)]
    if not calls or any(c is None for c in calls):
        return text, []
    content = text[: text.index(TOOL_CALL_START)].strip() or None
    return content, [_call_object(name, arguments) for name, arguments in calls]


def _call_object(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class StreamingToolParser:
    """Incremental ``parse_tool_calls`` for one streamed choice: content deltas, then per call a delta with
    ``index``, ``id``, ``type`` and ``function.name``, then ``function.arguments`` fragments that concatenate to the
    arguments text ``parse_tool_calls`` returns for the same output."""

    text: str = ""
    pos: int = 0  # text before this is emitted (content) or consumed (calls)
    call_start: int | None = None  # where the current call's body starts; None outside a call
    args_start: int | None = None
    args_sent: int = 0
    name_sent: bool = False
    num_calls: int = 0
    deltas: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, new_text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Add generated text; returns (content delta, tool-call deltas). ``final``: the output ended."""
        self.text += new_text
        content, self.deltas = "", []
        while True:
            if self.call_start is None:
                start = self.text.find(TOOL_CALL_START, self.pos)
                if start < 0:
                    end = len(self.text) if final else len(self.text) - _partial_tag(self.text, TOOL_CALL_START)
                    content += self._content(self.pos, max(end, self.pos))
                    self.pos = max(end, self.pos)
                    return content, self.deltas
                content += self._content(self.pos, start)
                self.call_start = self.pos = start + len(TOOL_CALL_START)
            elif not self._advance_call(final):
                return content, self.deltas

    def _content(self, start: int, end: int) -> str:
        """Text outside calls is content until the first call; after it, as ``parse_tool_calls``, it is dropped."""
        return self.text[start:end] if not self.called else ""

    def _advance_call(self, final: bool) -> bool:
        """Emit what the current call allows; True when the call closed (parsing continues after it)."""
        end = self.text.find(TOOL_CALL_END, self.call_start)
        body = self.text[self.call_start : end if end >= 0 else len(self.text)]
        if not self.name_sent and (match := _NAME.match(body)):
            self._header(json.loads(f'"{match.group(1)}"'))
        if self.name_sent and self.args_start is None and (found := _ARGUMENTS.search(body)):
            self.args_start = self.call_start + found.end()
        if end < 0 and not final:
            if self.args_start is not None:
                self._arguments(self.text[self.args_start :])
            return False
        call = split_call(body)
        if call is not None:
            if not self.name_sent:
                self._header(call[0])
            self._arguments(call[1])
        self.pos = end + len(TOOL_CALL_END) if end >= 0 else len(self.text)
        self.num_calls += 1 if self.name_sent else 0
        self.call_start, self.args_start, self.args_sent, self.name_sent = None, None, 0, False
        return end >= 0

    def _header(self, name: str) -> None:
        self.name_sent = True
        self.deltas.append({"index": self.num_calls, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": ""}})

    def _arguments(self, arguments: str) -> None:
        fragment = arguments[self.args_sent :]
        try:  # an incomplete value is all arguments; once complete, stop at its end
            _, end = json.JSONDecoder().raw_decode(arguments)
            fragment = arguments[self.args_sent : end]
        except json.JSONDecodeError:
            pass
        if fragment:
            self.args_sent += len(fragment)
            self.deltas.append({"index": self.num_calls, "function": {"arguments": fragment}})

    @property
    def called(self) -> bool:
        """True once at least one call was emitted."""
        return self.num_calls > 0 or self.name_sent


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: it may become the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
