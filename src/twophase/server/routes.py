"""``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming and not."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from twophase.engine.async_engine import AsyncLLM
from twophase.outputs import RequestOutput
from twophase.server import responses as R
from twophase.server.errors import APIError, error_body, to_api_error
from twophase.server.generate import (
    Choice, check_caps, check_fields, collect_finals, make_choices, merge_outputs, prompt_list, sampling_params,
    submit_all,
)  # fmt: skip
from twophase.server.protocol import (
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessageOut, CompletionChoice, CompletionRequest,
    CompletionResponse, DeltaMessage, random_id,
)  # fmt: skip
from twophase.server.kv_routes import request_setup, response_params, take_kv_params
from twophase.server.settings import ServerSettings
from twophase.server.sse import DONE, HEADERS, MEDIA_TYPE, sse_event
from twophase.server.structured_fields import structured_spec
from twophase.server.tools import StreamingToolParser, parse_tool_calls, plan_tools, template_messages
from twophase.sampling_params import InvalidRequestError, SamplingParams
from twophase.structured import StructuredOutputSpec

router = APIRouter()
RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "chat_template"}


@dataclass
class Job:
    """One HTTP generate request after validation: its choices and how to format them."""

    chat: bool
    response_id: str
    model: str
    n: int
    choices: list[Choice]
    num_top_logprobs: int | None
    include_usage: bool
    kv_params: dict | None = None  # kv_transfer_params of a P/D leg (see server/kv_routes.py)
    created: int = field(default_factory=lambda: int(time.time()))
    parse_tools: bool = False  # chat with tools: <tool_call> blocks become tool_calls (server/tools.py)


def check_model(model: str | None, settings: ServerSettings) -> None:
    """404 for a model this server does not serve (absent means the served one)."""
    if model is not None and model != settings.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {settings.model_name!r}", "model",
                       "model_not_found")


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, raw: Request) -> Response:
    """OpenAI text completions."""
    llm, settings = raw.app.state.llm, raw.app.state.settings
    check_model(body.model, settings)
    kv_params = take_kv_params(body, raw.app)
    check_fields(body, "completions")
    check_caps(body, settings, body.logprobs)
    prompts = prompt_list(body.prompt, settings.max_prompts)
    prompt_ids = [llm.engine.tokenize_prompt(p) for p in prompts]
    params = sampling_params(llm, body, body.max_tokens if body.max_tokens is not None else 16, body.logprobs)
    await compile_structured(llm, params, structured_spec(body))
    response_id = random_id("cmpl")
    choices = make_choices(response_id, prompt_ids, params, body.n or 1)
    return await _run(raw, body, Job(False, response_id, settings.model_name, body.n or 1, choices, body.logprobs,
                                     _include_usage(body), kv_params))


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
    """OpenAI chat completions (the model's chat template, rendered in a sandbox)."""
    llm, settings = raw.app.state.llm, raw.app.state.settings
    check_model(body.model, settings)
    kv_params = take_kv_params(body, raw.app)
    check_fields(body, "chat.completions")
    if body.chat_template is not None and not settings.allow_request_chat_template:
        raise APIError(400, "chat_template in a request is disabled on this server "
                       "(start it with --allow-request-chat-template)", "chat_template", "not_allowed")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", "top_logprobs", "invalid_value")
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    check_caps(body, settings, num_top, "top_logprobs")
    plan = plan_tools(body.tools, body.tool_choice, body.chat_template or llm.engine.tokenizer.chat_template)
    spec = structured_spec(body)
    if plan.spec is not None and spec is not None:
        raise InvalidRequestError(f"{spec.param} cannot be combined with a required or named tool_choice", spec.param)
    ids = render_chat_ids(llm, body, plan.tools)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(llm, body, max_tokens, num_top)
    await compile_structured(llm, params, plan.spec or spec)
    response_id = random_id("chatcmpl")
    choices = make_choices(response_id, [ids], params, body.n or 1)
    return await _run(raw, body, Job(True, response_id, settings.model_name, body.n or 1, choices, num_top,
                                     _include_usage(body), kv_params, parse_tools=plan.parse))


async def compile_structured(llm: AsyncLLM, params: SamplingParams, spec: StructuredOutputSpec | None) -> None:
    """Attach a structured-output spec to ``params`` and compile its grammar in a worker thread (cached), so
    admission finds it ready and neither the event loop nor the engine step waits on compilation."""
    if spec is None:
        return
    params.structured = spec
    params.validate()
    await asyncio.to_thread(llm.engine.compile_grammar, spec)


def render_chat_ids(llm: AsyncLLM, body: ChatCompletionRequest, tools: list | None = None) -> list[int]:
    """Token ids of the conversation with the generation prompt (``tools`` rendered by the template)."""
    messages = template_messages([m.model_dump(exclude_none=True) for m in body.messages])
    kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
    if tools:
        kwargs["tools"] = tools
    tokenizer = llm.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt is not False,
                                         chat_template=body.chat_template, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _run(raw: Request, body, job: Job) -> Response:
    llm: AsyncLLM = raw.app.state.llm
    setup = request_setup(job.kv_params, len(job.choices))
    queues = submit_all(llm, job.choices, body.cache_salt, setup)  # raises (nothing queued) on bad input / full queue
    stream = merge_outputs(llm, job.choices, queues)
    token_text = _token_text(llm)
    if body.stream:
        return StreamingResponse(_sse(stream, job, token_text), media_type=MEDIA_TYPE, headers=HEADERS)
    finals = await collect_finals(raw, stream, raw.app.state.settings.disconnect_poll_s)
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    payload = _full_response(job, finals, token_text).model_dump(exclude_none=True)
    handle = response_params(raw.app, job.choices[0].request_id, len(job.choices[0].prompt_ids)) \
        if job.kv_params is not None else None
    if handle is not None:
        payload["kv_transfer_params"] = handle
    return JSONResponse(payload)


def _token_text(llm: AsyncLLM):
    tokenizer = llm.engine.tokenizer
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


# ---- non-streamed -----------------------------------------------------------------------------------


def _full_response(job: Job, finals: dict[int, RequestOutput],
                   token_text) -> CompletionResponse | ChatCompletionResponse:
    usage = R.usage_of(finals, job.n)
    timings = R.timings_of(list(finals.values()), usage)
    ordered = [finals[i] for i in sorted(finals)]
    if job.chat:
        choices = [ChatChoice(index=i, message=_message(job, o), finish_reason=_chat_finish_reason(job, o),
                              stop_reason=o.stop_reason,
                              logprobs=R.chat_logprobs(o.logprobs, token_text, job.num_top_logprobs)
                              if job.num_top_logprobs is not None else None)
                   for i, o in zip(sorted(finals), ordered)]  # fmt: skip
        return ChatCompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                                      usage=usage, timings=timings)
    choices = [CompletionChoice(index=i, text=o.text, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                logprobs=R.completion_logprobs(o.logprobs, token_text)
                                if job.num_top_logprobs is not None else None)
               for i, o in zip(sorted(finals), ordered)]  # fmt: skip
    return CompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                              usage=usage, timings=timings)


def _message(job: Job, output: RequestOutput) -> ChatMessageOut:
    if not job.parse_tools:
        return ChatMessageOut(content=output.text)
    content, calls = parse_tool_calls(output.text)
    return ChatMessageOut(content=content, tool_calls=calls or None)


def _chat_finish_reason(job: Job, output: RequestOutput) -> str | None:
    """``tool_calls`` when a call ended the turn (as OpenAI); else the engine's reason."""
    if job.parse_tools and output.finish_reason == "stop" and parse_tool_calls(output.text)[1]:
        return "tool_calls"
    return output.finish_reason


# ---- streamed ---------------------------------------------------------------------------------------


async def _sse(stream: AsyncIterator[tuple[int, RequestOutput]], job: Job, token_text) -> AsyncIterator[str]:
    """One chunk per step per choice; timings on the last chunk; usage chunk if asked; errors as an event."""
    finals: dict[int, RequestOutput] = {}
    offsets: dict[int, int] = {}
    parsers: dict[int, StreamingToolParser] = {}
    try:
        async for index, output in stream:
            if job.chat and index not in offsets:
                yield sse_event(_chat_chunk(job, index, DeltaMessage(role="assistant", content="")))
            if output.finished:
                finals[index] = output
            if job.parse_tools:
                parser = parsers.setdefault(index, StreamingToolParser())
                chunk = _tool_delta_chunk(job, index, output, token_text, parser)
            else:
                chunk = _delta_chunk(job, index, output, token_text, offsets)
            offsets.setdefault(index, 0)
            if len(finals) == len(job.choices) and not job.include_usage:
                chunk.timings = R.timings_of(list(finals.values()), R.usage_of(finals, job.n))
            if chunk.choices or chunk.timings:
                yield sse_event(chunk)
        if job.include_usage:
            usage = R.usage_of(finals, job.n)
            model = ChatCompletionResponse if job.chat else CompletionResponse
            extra = {"object": "chat.completion.chunk"} if job.chat else {}
            yield sse_event(model(id=job.response_id, created=job.created, model=job.model, choices=[], usage=usage,
                                  timings=R.timings_of(list(finals.values()), usage), **extra))
    except Exception as exc:  # noqa: BLE001 — after the 200 went out, errors travel as an event
        error = to_api_error(exc)
        yield sse_event(error_body(error.status, error.message, error.param, error.code))
    finally:
        await stream.aclose()
    yield DONE


def _chat_chunk(job: Job, index: int, delta: DeltaMessage, **fields) -> ChatCompletionResponse:
    return ChatCompletionResponse(id=job.response_id, object="chat.completion.chunk", created=job.created,
                                  model=job.model, choices=[ChatChoice(index=index, delta=delta, **fields)])


def _delta_chunk(job: Job, index: int, output: RequestOutput, token_text, offsets: dict[int, int]):
    entries = output.new_logprobs if job.num_top_logprobs is not None else []
    reason = R.finish_reason(output)
    offset = offsets.get(index, 0)
    offsets[index] = offset + len(output.new_text)
    if not output.new_text and not entries and not output.finished:
        choices: list = []
    elif job.chat:
        logprobs = R.chat_logprobs(entries, token_text, job.num_top_logprobs) if entries else None
        return _chat_chunk(job, index, DeltaMessage(content=output.new_text), logprobs=logprobs,
                           finish_reason=reason, stop_reason=output.stop_reason)
    else:
        logprobs = R.completion_logprobs(entries, token_text, offset) if entries else None
        choices = [CompletionChoice(index=index, text=output.new_text, logprobs=logprobs, finish_reason=reason,
                                    stop_reason=output.stop_reason)]
    if job.chat:
        return ChatCompletionResponse(id=job.response_id, object="chat.completion.chunk", created=job.created,
                                      model=job.model, choices=choices)
    return CompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices)


def _tool_delta_chunk(job: Job, index: int, output: RequestOutput, token_text, parser: StreamingToolParser):
    """A chat chunk whose text went through the tool-call parser: content and/or ``tool_calls`` deltas."""
    content, calls = parser.feed(output.new_text, final=output.finished)
    entries = output.new_logprobs if job.num_top_logprobs is not None else []
    if not content and not calls and not entries and not output.finished:
        return ChatCompletionResponse(id=job.response_id, object="chat.completion.chunk", created=job.created,
                                      model=job.model, choices=[])
    reason = R.finish_reason(output)
    if reason == "stop" and parser.called:
        reason = "tool_calls"
    logprobs = R.chat_logprobs(entries, token_text, job.num_top_logprobs) if entries else None
    delta = DeltaMessage(content=content or None, tool_calls=calls or None)
    return _chat_chunk(job, index, delta, logprobs=logprobs, finish_reason=reason, stop_reason=output.stop_reason)
