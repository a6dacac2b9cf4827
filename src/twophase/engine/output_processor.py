"""Turns per-step token updates into RequestOutputs: incremental detokenization, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from twophase.engine.scheduler import StepUpdate
from twophase.outputs import RequestOutput, TokenLogprobs
from twophase.request import Request
from twophase.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class OutputProcessor:
    """Keeps one detokenizer per live request; reports requests that hit a stop string."""

    def __init__(self, tokenizer_backend) -> None:
        self.tokenizer_backend = tokenizer_backend
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request: Request, detokenize: bool = True) -> None:
        """Start tracking a request."""
        params = request.sampling_params
        detokenizer = None
        if detokenize and self.tokenizer_backend is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer_backend,
                request.prompt_token_ids,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        self.states[request.request_id] = _RequestState(detokenizer)

    def process(self, update: StepUpdate) -> tuple[RequestOutput, bool]:
        """RequestOutput for one update, and whether a stop string ended a request the scheduler still runs
        (the caller must then finish it)."""
        request = update.request
        state = self.states[request.request_id]
        new_text, stop_hit = "", False
        if state.detokenizer is not None:
            new_text = _add_tokens_until_stop(state.detokenizer, update)
            stop_hit = state.detokenizer.stop_reason is not None
            if update.finished or stop_hit:
                new_text += state.detokenizer.flush()
        state.logprobs.extend(update.new_logprobs)
        finished = update.finished or stop_hit
        output = self._output(request, update.new_token_ids, new_text, finished, "stop" if stop_hit else None)
        output.new_logprobs = list(update.new_logprobs)
        if finished:
            self.states.pop(request.request_id, None)
        return output, stop_hit and not update.finished

    def abort(self, request: Request) -> RequestOutput:
        """Final output of an aborted request."""
        state = self.states.pop(request.request_id, None)
        new_text = state.detokenizer.flush() if state and state.detokenizer else ""
        return self._output(request, [], new_text, True, "abort", state)

    def _output(self, request, new_token_ids, new_text, finished, reason, state=None) -> RequestOutput:
        state = state or self.states.get(request.request_id)
        detok = state.detokenizer if state else None
        finish_reason = (reason or request.status.value) if finished else None
        stop_reason = detok.stop_reason if detok is not None and detok.stop_reason else None
        if stop_reason is None and finished and finish_reason == "stop" and request.output_token_ids:
            last = request.output_token_ids[-1]
            stop_reason = last if last in request.sampling_params.stop_token_ids else None
        # unfinished outputs share the request's growing lists (no O(n) copy per step, O(n²) per request);
        # the final output gets its own copies
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids) if finished else request.output_token_ids,
            text=detok.text if detok is not None else "",
            new_token_ids=list(new_token_ids),
            new_text=new_text,
            finished=finished,
            finish_reason=finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            timeline=request.timeline,
            logprobs=(list(state.logprobs) if finished else state.logprobs) if state else [],
            stop_reason=stop_reason,
        )


def _add_tokens_until_stop(detokenizer: IncrementalDetokenizer, update: StepUpdate) -> str:
    """Feed a step's tokens; several (speculative decoding) go one by one, and those after the token that
    completed a stop string are dropped from the request, exactly as if they had come one step at a time."""
    tokens = update.new_token_ids
    if len(tokens) <= 1:
        return detokenizer.add_tokens(tokens)
    text = ""
    for used, token_id in enumerate(tokens, start=1):
        text += detokenizer.add_tokens([token_id])
        if detokenizer.stop_reason is not None:
            _drop_tail(update, used)
            break
    return text


def _drop_tail(update: StepUpdate, keep: int) -> None:
    """Keep only the first ``keep`` of the update's tokens, in the update and in the request."""
    extra = len(update.new_token_ids) - keep
    if extra <= 0:
        return
    request = update.request
    del request.output_token_ids[-extra:]
    del request.timeline.token_times[-extra:]
    request.timeline.scheduled[-1].num_output_tokens -= extra
    update.new_token_ids = update.new_token_ids[:keep]
    update.new_logprobs = update.new_logprobs[:keep]
