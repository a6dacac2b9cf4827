"""RequestOutputs → OpenAI response objects: choices, logprobs, usage and per-request timings."""

from __future__ import annotations

from typing import Callable

from twophase.metrics.timeline import request_metrics
from twophase.outputs import RequestOutput, TokenLogprobs
from twophase.server.protocol import (
    ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptTokensDetails, Timings, TopLogprob, Usage,
)  # fmt: skip

TokenText = Callable[[int], str]


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000.0, 3) if seconds is not None else None


def timings_of(outputs: list[RequestOutput], usage: Usage) -> Timings:
    """Timings of a response: phase times of the choice that finished last, token counts of the whole response."""
    last = max(outputs, key=lambda o: o.timeline.finish_time or 0.0)
    m = request_metrics(last.timeline)
    rate = (m.num_output_tokens - 1) / m.decode_time if m.decode_time else None
    drafted = sum(o.timeline.num_draft_tokens for o in outputs)
    accepted = sum(o.timeline.num_accepted_tokens for o in outputs)
    num_drafts = sum(o.timeline.num_drafts for o in outputs)
    spec = {} if not num_drafts else dict(
        draft_n=drafted, draft_accepted_n=accepted, acceptance_rate=round(accepted / drafted, 4),
        mean_accepted_length=round(1.0 + accepted / num_drafts, 4),
    )  # fmt: skip
    return Timings(**spec,
        queue_ms=_ms(m.queue_time), prefill_ms=_ms(m.prefill_time), decode_ms=_ms(m.decode_time),
        ttft_ms=_ms(m.ttft), tpot_ms=_ms(m.tpot), e2e_ms=_ms(m.e2e), prompt_n=usage.prompt_tokens,
        cached_n=usage.prompt_tokens_details.cached_tokens, predicted_n=usage.completion_tokens,
        predicted_per_second=round(rate, 3) if rate else None,
        remote_prefill_ms=_ms(m.remote_prefill_time), kv_transfer_ms=_ms(m.kv_transfer_time),
    )  # fmt: skip


def usage_of(outputs: dict[int, RequestOutput], n: int) -> Usage:
    """Prompt tokens count once per prompt (choice p*n); completion tokens sum over every choice."""
    firsts = [o for index, o in outputs.items() if index % n == 0]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.token_ids) for o in outputs.values())
    cached = sum(o.num_cached_tokens for o in firsts)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def completion_logprobs(entries: list[TokenLogprobs], token_text: TokenText, offset: int = 0) -> CompletionLogprobs:
    """Legacy completions logprobs; ``offset`` is the text offset of the first token."""
    result = CompletionLogprobs()
    for entry in entries:
        text = token_text(entry.token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append({token_text(t): lp for t, lp in entry.top})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(entries: list[TokenLogprobs], token_text: TokenText, num_top: int) -> ChatLogprobs:
    """Chat logprobs with ``num_top`` alternatives per token."""
    content = []
    for entry in entries:
        text = token_text(entry.token_id)
        top = [TopLogprob(token=token_text(t), logprob=lp, bytes=list(token_text(t).encode()))
               for t, lp in entry.top[:num_top]]
        content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=list(text.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def finish_reason(output: RequestOutput) -> str | None:
    """OpenAI finish reason of a finished output."""
    return output.finish_reason if output.finished else None
