"""From a parsed request to engine requests and back: sampling params, caps, one engine request per choice.

A request with P prompts and ``n`` choices becomes P*n engine requests ``{id}-{index}`` (index = p*n + i; seed
+ index when a seed is given). All are validated before any is queued, so a bad choice or a full queue leaves
nothing behind; their outputs are merged into one stream of ``(index, RequestOutput)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request as HTTPRequest

from twophase.engine.async_engine import AsyncLLM
from twophase.outputs import RequestOutput
from twophase.request import Request
from twophase.sampling_params import InvalidRequestError, SamplingParams
from twophase.server.disconnect import until_disconnect
from twophase.server.errors import APIError
from twophase.server.protocol import _SamplingFields
from twophase.server.settings import ServerSettings

logger = logging.getLogger("twophase.server")
MAX_LOGGED_FIELDS = 20


@dataclass
class Choice:
    """One engine request serving one output choice."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


def check_fields(req: _SamplingFields, endpoint: str) -> None:
    """400 naming a field we would have to ignore to answer; log (one line) fields we do not know at all."""
    name = req.unsupported_field()
    if name is not None:
        raise APIError(400, f"{name} is not supported by this server (it would change the output)", name,
                       "unsupported")
    unknown = req.unknown_fields()
    if unknown:
        shown = ", ".join(repr(n[:64]) for n in unknown[:MAX_LOGGED_FIELDS])
        logger.warning("%s: ignoring %d unknown request field(s): %s", endpoint, len(unknown), shown)


def check_caps(req: _SamplingFields, settings: ServerSettings, num_top_logprobs: int | None,
               logprobs_param: str = "logprobs") -> None:
    """Enforce the server's caps on n, stop strings and logprobs (400 naming the field)."""
    n = req.n if req.n is not None else 1
    if not 1 <= n <= settings.max_n:
        raise APIError(400, f"n must be in [1, {settings.max_n}], got {n}", "n", "invalid_value")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > settings.max_stop_strings:
        raise APIError(400, f"at most {settings.max_stop_strings} stop strings", "stop", "invalid_value")
    if any(len(s) > settings.max_stop_string_chars for s in stops):
        raise APIError(400, f"stop strings are limited to {settings.max_stop_string_chars} characters", "stop",
                       "invalid_value")
    if num_top_logprobs is not None and not 0 <= num_top_logprobs <= settings.max_top_logprobs:
        raise APIError(400, f"{logprobs_param} must be in [0, {settings.max_top_logprobs}]", logprobs_param,
                       "invalid_value")


def sampling_params(llm: AsyncLLM, req: _SamplingFields, max_tokens: int | None,
                    num_top_logprobs: int | None) -> SamplingParams:
    """SamplingParams from the OpenAI fields (OpenAI defaults where a field is absent); validated, token ids checked
    against the vocabulary and bad words tokenized."""
    fields = dict(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
    )  # fmt: skip
    given = {k: v for k, v in fields.items() if v is not None}
    params = SamplingParams(**given, max_tokens=max_tokens, logprobs=num_top_logprobs)
    params.validate()
    return params


def make_choices(request_id: str, prompts: list[list[int]], params: SamplingParams, n: int) -> list[Choice]:
    """P*n choices; choice ``index`` gets seed + index when a seed is set."""
    choices = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            seed = params.seed + index if params.seed is not None else None
            choice_params = dataclasses.replace(params, seed=seed, n=1)
            choices.append(Choice(index, p, f"{request_id}-{index}", ids, choice_params))
    return choices


def submit_all(llm: AsyncLLM, choices: list[Choice], cache_salt: str | None,
               setup: Callable[[Request], None] | None = None) -> list[asyncio.Queue]:
    """Validate every choice (InvalidRequestError / QueueFullError raise here, nothing queued), then queue all.
    ``setup`` is applied to each engine request before it is queued (e.g. its KV transfer parameters)."""
    requests = [llm.make_request(c.prompt_ids, c.params, c.request_id, cache_salt, num_ahead=i)
                for i, c in enumerate(choices)]  # fmt: skip
    if setup is not None:
        for request in requests:
            setup(request)
    return [llm.submit(r) for r in requests]


async def merge_outputs(llm: AsyncLLM, choices: list[Choice], queues: list[asyncio.Queue]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(choice index, output)`` as each choice's outputs arrive; leaving early aborts the unfinished.
    One choice (the usual request) is read from its own queue, without a forwarding task: one task switch and two
    queue operations less a streamed token."""
    if len(choices) == 1:
        choice = choices[0]
        outputs = llm.stream_outputs(choice.request_id, queues[0])
        try:
            async for output in outputs:
                _check_transfer(output)
                yield choice.index, output
        finally:
            await outputs.aclose()  # aborts the request if it has not finished
        return
    merged: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(llm, c, q, merged)) for c, q in zip(choices, queues)]
    remaining = len(choices)
    try:
        while remaining:
            index, item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(llm: AsyncLLM, choice: Choice, source: asyncio.Queue, sink: asyncio.Queue) -> None:
    """Forward one choice's outputs (or its error) into the merged queue."""
    try:
        async for output in llm.stream_outputs(choice.request_id, source):
            _check_transfer(output)
            sink.put_nowait((choice.index, output))
    except Exception as exc:  # noqa: BLE001 — delivered to the merged stream's reader
        sink.put_nowait((choice.index, exc))


def _check_transfer(output: RequestOutput) -> None:
    """An output carrying an error (e.g. its KV transfer failed) is an error, not an empty answer."""
    if output.error is not None:
        raise APIError(502, output.error, None, "kv_transfer_failed")


async def collect_finals(http_request: HTTPRequest, stream: AsyncIterator[tuple[int, RequestOutput]],
                         poll_s: float) -> dict[int, RequestOutput] | None:
    """Run a merged stream to its end; None (and everything aborted) if the client disconnects first."""

    async def drain() -> dict[int, RequestOutput]:
        finals = {}
        async for index, output in stream:
            if output.finished:
                finals[index] = output
        return finals

    finals = await until_disconnect(http_request, drain(), poll_s)
    if finals is None:
        await stream.aclose()
    return finals



def prompt_list(prompt: object, max_prompts: int) -> list[str | list[int]]:
    """Normalise OpenAI's prompt forms (string, strings, token ids, lists of token ids) to a list of prompts."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt) if isinstance(prompt, list) else []
    if not prompts:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if len(prompts) > max_prompts:
        raise InvalidRequestError(f"at most {max_prompts} prompts per request", "prompt")
    return prompts
