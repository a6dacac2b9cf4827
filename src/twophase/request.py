"""A request inside the engine: its tokens, its one progress counter, its status and its timeline."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from twophase.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle of a request; FINISHED_* states are terminal."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated; K/V arriving from a prefill worker
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """True for the terminal states."""
        return self.value in ("stop", "length", "abort")


@dataclass
class ScheduledEvent:
    """One step in which the request had tokens computed."""

    time: float  # monotonic seconds at step start
    num_tokens: int
    is_prompt: bool  # True: prompt tokens (prefill chunk); False: a generated token fed back (decode)
    end_time: float | None = None  # when the step's results were applied
    num_output_tokens: int = 0  # tokens the step produced for the request (several with speculation)


@dataclass
class RequestTimeline:
    """Monotonic timestamps from which every per-request metric is computed (see metrics.timeline)."""

    arrival_time: float
    scheduled: list[ScheduledEvent] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # time each output token was produced
    finish_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_drafts: int = 0  # steps that verified proposals (speculative decoding)
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals accepted
    remote_prefill_time: float | None = None  # seconds the prefill leg took on a remote worker (P/D disaggregation)
    kv_transfer_start: float | None = None  # when this engine started reading the prompt's blocks from a remote
    kv_transfer_end: float | None = None  # when they were written into its cache
    kv_transfer_bytes: int = 0

    @property
    def first_scheduled_time(self) -> float | None:
        """When the request first got compute."""
        return self.scheduled[0].time if self.scheduled else None

    @property
    def first_token_time(self) -> float | None:
        """When the first output token was produced."""
        return self.token_times[0] if self.token_times else None


class Request:
    """One sequence being generated. ``num_computed_tokens`` is the only progress counter."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.max_output_tokens: int | None = sampling_params.max_tokens  # filled in at admission when None
        self.spec_token_ids: list[int] = []  # proposals for the next step (speculative decoding)
        self.grammar: object | None = None  # compiled at admission when sampling_params.structured is set
        self.timeline = RequestTimeline(arrival_time if arrival_time is not None else time.monotonic())
        self.kv_transfer_params: dict | None = None  # as sent by the client (P/D disaggregation, see kv_transfer)
        self.remote_handle = None  # kv_transfer.spec.RemoteHandle: where to read the prompt's blocks from

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold: prompt + max_tokens."""
        return self.num_prompt_tokens + (self.max_output_tokens or 0)

    @property
    def finished(self) -> bool:
        """True once in a terminal state."""
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
