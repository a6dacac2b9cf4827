"""OpenAI request and response schemas (pydantic), with OpenAI field names.

Types are checked here (a wrong type, NaN or inf is a 400 naming the field); value ranges are checked once, by
``SamplingParams.validate``, and caps on sizes by ``ServerSettings`` in the routes.

Nothing is silently ignored. Every OpenAI field (and vLLM's extensions, sent through ``extra_body``) is either
implemented, listed in ``UNSUPPORTED_FIELDS`` (it would change the output: refused with a 400 naming it unless it
holds its neutral value), or listed in ``IGNORED_FIELDS`` (accepted; it changes nothing here, for the reason
given). Any other field is accepted and logged by name (``unknown_fields``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

TokenIds = list[StrictInt]
Prompt = Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
Stop = Union[StrictStr, list[StrictStr], None]


class _Request(BaseModel):
    """Common config: unknown fields are ignored (as OpenAI-compatible servers do); NaN/inf are refused."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


Neutral = Callable[[Any], bool]  # True when a field's value asks for nothing we lack


def _unset(value: Any) -> bool:
    return value is None


def _falsy(value: Any) -> bool:
    return value is None or value is False


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _one_of(*neutral: Any) -> Neutral:
    return lambda value: value is None or any(type(value) is type(n) and value == n for n in neutral)


UNSUPPORTED_FIELDS: dict[str, Neutral] = {
    # OpenAI chat completions
    "audio": _unset, "modalities": _one_of(["text"]), "tools": _empty, "tool_choice": _one_of("none", "auto"),
    "functions": _empty, "function_call": _one_of("none", "auto"), "reasoning_effort": _unset, "verbosity": _unset,
    "web_search_options": _unset, "moderation": _unset,
    # OpenAI completions
    "echo": _falsy, "suffix": _one_of(""), "best_of": _one_of(1),
    # vLLM extensions
    "use_beam_search": _falsy, "length_penalty": _one_of(1, 1.0), "prompt_logprobs": _unset,
    "truncate_prompt_tokens": _unset, "continue_final_message": _falsy, "documents": _unset,
    "logits_processors": _empty, "return_tokens_as_token_ids": _falsy, "return_token_ids": _falsy,
    "skip_special_tokens": _one_of(True), "spaces_between_special_tokens": _one_of(True), "priority": _one_of(0),
    "kv_transfer_params": _unset, "vllm_xargs": _unset, "mm_processor_kwargs": _empty,
    "guided_whitespace_pattern": _unset,
}  # fmt: skip
TOOL_FIELDS = ("tools", "tool_choice")  # implemented on chat completions only (server/tools.py)
IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring",
    "metadata": "tags for stored completions, which we do not store",
    "store": "stored completions, which we do not keep",
    "service_tier": "the provider's processing tier; there is one tier",
    "parallel_tool_calls": "every <tool_call> the model writes is returned; required / named choices force one",
    "prediction": "predicted outputs change latency only, never the output",
    "prompt_cache_key": "a routing hint; prefix caching here is automatic",
    "prompt_cache_retention": "prefix-cache blocks live until evicted",
    "prompt_cache_options": "prefix caching here is automatic, block by block",
    "safety_identifier": "an end-user id for the provider's abuse monitoring",
    "guided_decoding_backend": "chooses a grammar engine; there is one (xgrammar)",
    "request_id": "vLLM's client-chosen id; ours are generated",
}


class StreamOptions(_Request):
    """``stream_options``: ask for a final usage chunk."""

    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat. Unknown fields are kept (``model_extra``) so they can be checked."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow")
    unsupported: ClassVar[dict[str, Neutral]] = UNSUPPORTED_FIELDS

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: StrictInt | None = None
    stop: Stop = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = False
    min_tokens: StrictInt | None = 0
    include_stop_str_in_output: StrictBool | None = False
    logit_bias: dict[StrictStr, Any] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[StrictInt] | None = None  # vLLM
    bad_words: list[StrictStr] | None = None  # vLLM
    response_format: dict[str, Any] | None = None  # text | json_object | json_schema (server/structured_fields.py)
    structured_outputs: dict[str, Any] | None = None  # vLLM: json | regex | choice | grammar | json_object
    guided_json: Union[dict[str, Any], StrictStr, None] = None  # vLLM (older names of structured_outputs)
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = Field(
        default=None, description="tenant key: requests with different salts never share prefix-cache blocks")


    def unsupported_field(self) -> str | None:
        """The first field set to a value that would change the output and that twophase does not implement."""
        for name in sorted(self.model_fields_set | set(self.model_extra or {})):
            neutral = self.unsupported.get(name)
            if neutral is not None and not neutral(getattr(self, name, None)):
                return name
        return None

    def unknown_fields(self) -> list[str]:
        """Fields neither implemented nor listed in UNSUPPORTED_FIELDS / IGNORED_FIELDS (to be logged)."""
        return sorted(set(self.model_extra or {}) - set(self.unsupported) - set(IGNORED_FIELDS))


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    unsupported: ClassVar[dict[str, Neutral]] = {**UNSUPPORTED_FIELDS, "add_special_tokens": _one_of(True)}

    prompt: Prompt
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ChatMessage(_Request):
    """One chat message; content is text or a list of text parts (checked by the chat template module)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow")
    role: StrictStr
    content: Union[StrictStr, list[dict[str, Any]], None] = None
    name: StrictStr | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    unsupported: ClassVar[dict[str, Neutral]] = {
        **{k: v for k, v in UNSUPPORTED_FIELDS.items() if k not in TOOL_FIELDS}, "add_special_tokens": _one_of(False)}

    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None  # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: Union[StrictStr, dict[str, Any], None] = None  # none | auto | required | {"type": "function", ...}
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool | None = True


class TokenizeRequest(_Request):
    """``POST /tokenize``: text (or chat messages) → token ids."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = True
    add_generation_prompt: StrictBool | None = True


class DetokenizeRequest(_Request):
    """``POST /detokenize``: token ids → text."""

    model: StrictStr | None = None
    tokens: TokenIds


# ---- responses -----------------------------------------------------------------------------------


class Timings(BaseModel):
    """Where a request's time went (llama.cpp-style ``timings``), milliseconds and token counts."""

    queue_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    prompt_n: int = 0
    cached_n: int = 0
    predicted_n: int = 0
    predicted_per_second: float | None = None
    draft_n: int | None = None  # speculative decoding: proposals verified (absent when off)
    draft_accepted_n: int | None = None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    remote_prefill_ms: float | None = None  # P/D: the prefill leg on the prefill server (client TTFT adds it)
    kv_transfer_ms: float | None = None  # P/D: reading the prompt's KV blocks (inside ttft_ms)


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    """One alternative token in chat logprobs."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    """A sampled token in chat logprobs, with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of chat."""

    content: list[ChatTokenLogprob] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One completion choice (non-streamed, or a stream chunk's delta)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(BaseModel):
    """``text_completion`` object (also each stream chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class DeltaMessage(BaseModel):
    """Streamed chat delta."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # [{index, id?, type?, function: {name?, arguments}}]


class ChatMessageOut(BaseModel):
    """Non-streamed assistant message."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None  # [{id, type: "function", function: {name, arguments}}]


class ChatChoice(BaseModel):
    """One chat choice (``message`` when non-streamed, ``delta`` in chunks)."""

    index: int
    message: ChatMessageOut | None = None
    delta: DeltaMessage | None = None
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    """``chat.completion`` or ``chat.completion.chunk``."""

    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    timings: Timings | None = None


def random_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"
