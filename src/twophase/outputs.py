"""Plain dataclasses crossing the boundaries: scheduler → runner → scheduler → caller."""

from __future__ import annotations

from dataclasses import dataclass, field

from twophase.request import RequestTimeline
from twophase.sampling_params import SamplingParams
from twophase.spec_decode.stats import SpecDecodeStats


def step_phase(num_prompt_tokens: int, num_decode_tokens: int) -> str:
    """Label a step by its token mix: 'prefill', 'decode', 'mixed' or 'idle'."""
    if num_prompt_tokens and num_decode_tokens:
        return "mixed"
    return "prefill" if num_prompt_tokens else ("decode" if num_decode_tokens else "idle")


@dataclass
class ScheduledRequest:
    """The work given to one request in one step."""

    request_id: str
    token_ids: list[int]  # the new tokens whose K/V this step computes
    start_position: int  # == the request's num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table after allocation
    sample: bool  # True when this chunk reaches the last known token: the step yields a new token
    is_prompt: bool  # True when the tokens are prompt tokens (prefill / chunked prefill)
    spec_token_ids: list[int] = field(default_factory=list)  # proposals: the last len(...) of token_ids


@dataclass
class NewRequestData:
    """What the model runner keeps about a request for its whole life, sent once, at its first step."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    grammar: object | None = None  # compiled structured-output grammar (xgrammar), None when unconstrained


@dataclass
class SchedulerOutput:
    """One step's flat batch, in order: decode tokens of running requests, then prompt chunks.

    Everything the runner learns arrives here: requests scheduled for the first time (``new_requests``, whose
    state the runner then keeps) and requests that ended since the previous step (``finished_request_ids``,
    whose state it drops).
    """

    step_id: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    num_blocks_in_use: int = 0
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    token_budget: int = 0  # the step's token budget (from the scheduler's budget policy)
    predicted_duration: float | None = None  # the policy's prediction for this batch (None without a model)

    @property
    def num_tokens(self) -> int:
        """Total tokens in the batch."""
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of prompts (prefill work)."""
        return sum(len(s.token_ids) for s in self.scheduled if s.is_prompt)

    @property
    def num_decode_tokens(self) -> int:
        """Generated tokens fed back (decode work)."""
        return sum(len(s.token_ids) for s in self.scheduled if not s.is_prompt)

    @property
    def phase(self) -> str:
        """'prefill', 'decode', 'mixed' or 'idle': a fact about the step, not a code path."""
        return step_phase(self.num_prompt_tokens, self.num_decode_tokens)


@dataclass
class TokenLogprobs:
    """Logprob of a sampled token and the top-n alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class ModelRunnerOutput:
    """Sampled tokens for the requests whose ``sample`` flag was set."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # rows with proposals (speculative decoding): every emitted token, accepted proposals first
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)

    def tokens_of(self, request_id: str) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The tokens a request gained this step (none, one, or several after verification) and their logprobs."""
        if request_id in self.verified_token_ids:
            return self.verified_token_ids[request_id], self.verified_logprobs[request_id]
        if request_id in self.sampled_token_ids:
            return [self.sampled_token_ids[request_id]], [self.logprobs.get(request_id)]
        return [], []


@dataclass
class RequestOutput:
    """What a caller sees after each step for one request (cumulative fields + the delta).

    While the request runs, ``token_ids`` and ``logprobs`` are live views of the engine's lists (they grow with
    later steps; copy them to keep a snapshot); a finished output owns its lists."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated token ids so far
    text: str  # all generated text so far (stop string excluded)
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort'
    num_cached_tokens: int
    timeline: RequestTimeline
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # for all generated tokens so far
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # for this step's new tokens
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # set when the request failed (e.g. its KV transfer); the caller reports an error


@dataclass
class StepRecord:
    """One engine step, as every plot, trace and benchmark reads it."""

    step_id: int
    start_time: float  # monotonic seconds
    duration: float
    num_prompt_tokens: int
    num_decode_tokens: int
    num_requests: int
    num_blocks_in_use: int
    num_blocks_total: int
    num_waiting: int = 0
    num_preempted: int = 0
    num_output_tokens: int = 0  # tokens the step produced (more than its sampled rows with speculation)
    num_draft_tokens: int = 0  # proposals verified in the step
    num_accepted_tokens: int = 0  # proposals accepted
    # the step's mix beyond the token counts (steptime.features): any records dump is calibration data
    prefill_rows: int = 0
    prefill_attention_pairs: int = 0
    decode_rows: int = 0
    decode_context_tokens: int = 0
    sampled_rows: int = 0
    token_budget: int = 0  # the budget the scheduler's policy gave this step
    predicted_duration: float | None = None  # the budget policy's step-time prediction, when it has a model

    @property
    def phase(self) -> str:
        """'prefill', 'decode', 'mixed' or 'idle': a fact about the step, not a code path."""
        return step_phase(self.num_prompt_tokens, self.num_decode_tokens)


@dataclass
class EngineStats:
    """A snapshot of the engine's gauges and counters (read by metrics exporters)."""

    num_running: int
    num_waiting: int
    num_blocks_in_use: int
    num_blocks_total: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found cached
    num_preemptions: int
    spec_decode: SpecDecodeStats | None = None  # cumulative; None when speculation is off

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (0..1)."""
        return self.num_blocks_in_use / self.num_blocks_total if self.num_blocks_total else 0.0
