"""OpenAI request and response schemas (pydantic), with OpenAI field names.

Types are checked here (a wrong type, NaN or inf is a 400 naming the field); value ranges are checked once, by
``SamplingParams.validate``, and caps on sizes by ``ServerSettings`` in the routes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

TokenIds = list[StrictInt]
Prompt = Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
Stop = Union[StrictStr, list[StrictStr], None]


class _Request(BaseModel):
    """Common config: unknown fields are ignored (as OpenAI-compatible servers do); NaN/inf are refused."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class StreamOptions(_Request):
    """``stream_options``: ask for a final usage chunk."""

    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat."""

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
    user: StrictStr | None = None
    cache_salt: StrictStr | None = Field(
        default=None, description="tenant key: requests with different salts never share prefix-cache blocks")


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

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

    messages: list[ChatMessage]
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


class ChatMessageOut(BaseModel):
    """Non-streamed assistant message."""

    role: Literal["assistant"] = "assistant"
    content: str


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
