"""Continuous batching: one flat batch per step under a token budget, with chunked prefill,
prefix caching and preemption by recompute. No torch here."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from twophase.config import SchedulerConfig
from twophase.kv_cache.block_manager import BlockManager
from twophase.outputs import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput, TokenLogprobs
from twophase.request import Request, RequestStatus, ScheduledEvent
from twophase.sampling_params import InvalidRequestError
from twophase.spec_decode.stats import SpecDecodeStats
from twophase.steptime.budget import BudgetPolicy, make_budget_policy

Clock = Callable[[], float]  # seconds; the wall clock by default, a virtual one in the simulator


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later."""


@dataclass
class StepUpdate:
    """What one step did to one request: the tokens it gained and whether it finished."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    num_draft_tokens: int = 0  # proposals verified for the request this step (speculative decoding)
    num_accepted_tokens: int = 0  # of which accepted


class Scheduler:
    """Owns the waiting queue, the running list and the block manager. Every time it reads comes from ``clock``,
    so the simulator runs this class unchanged in virtual time."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, clock: Clock = time.monotonic,
                 budget_policy: BudgetPolicy | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.budget_policy = budget_policy or make_budget_policy(config)
        self._step_start = 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()  # acceptance of proposals (speculative decoding)
        self._step_id = 0
        self._finished_request_ids: list[str] = []  # ended since the last step; the runner drops their state
        self.kv_connector = None  # kv_transfer.SchedulerConnector when this engine sends or receives KV blocks

    # ---- admission -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue an admitted request (see ``check_admission``); raises, changing nothing, if it can never run."""
        self.check_feasible(request)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}", "request_id")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_admission(self, request: Request, num_ahead: int = 0) -> None:
        """Raise (reading state only) unless the request can run and the waiting queue has room for it behind
        ``num_ahead`` requests already accepted but not yet queued."""
        self.check_feasible(request)
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.waiting) + num_ahead >= limit:
            raise QueueFullError(f"waiting queue full ({limit} requests)")

    def check_feasible(self, request: Request) -> None:
        """Reject a request that could never fit the model length or the KV pool. A prompt longer than the step
        budget is feasible either way: chunked, or (chunking off) whole in a step of its own."""
        max_len = self.config.max_model_len
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if request.num_prompt_tokens >= max_len:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens; the context length is {max_len}", "prompt"
            )
        if request.max_output_tokens is None:
            request.max_output_tokens = max_len - request.num_prompt_tokens
        total = request.num_prompt_tokens + request.max_output_tokens
        if total > max_len:
            raise InvalidRequestError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_output_tokens}) "
                f"exceeds the context length {max_len}",
                "max_tokens",
            )
        num_blocks = self.block_manager.num_blocks_for(total)
        if num_blocks > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"request needs {num_blocks} KV blocks; the cache has {self.block_manager.num_blocks}", "max_tokens"
            )

    # ---- scheduling ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Build this step's batch: running requests first, then waiting ones (FCFS)."""
        now = self._step_start = self.clock()
        output = SchedulerOutput(step_id=self._step_id, finished_request_ids=self._finished_request_ids)
        self._finished_request_ids = []
        self._step_id += 1
        output.token_budget = self.budget_policy.step_budget(self.running, self.waiting)
        budget = self._schedule_running(output, output.token_budget, now)
        if not output.preempted_request_ids:
            self._schedule_waiting(output, budget, now)
        output.num_blocks_in_use = self.block_manager.num_blocks_in_use
        output.predicted_duration = self.budget_policy.predict(output)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int, now: float) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._fit_proposals(request, budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim, output)
                if victim is request:
                    break
            else:
                self._add_scheduled(output, request, num_new, now)
                budget -= num_new
                index += 1
        return budget

    def _fit_proposals(self, request: Request, budget: int) -> int:
        """Tokens to schedule for a running request: its uncomputed tokens and its proposals, which are trimmed to
        the budget and dropped when blocks are short (no request is preempted to make room for proposals)."""
        num_base = request.num_tokens - request.num_computed_tokens
        proposals = request.spec_token_ids
        if proposals:
            del proposals[max(0, budget - num_base) :]
            if proposals and not self.block_manager.allocate_slots(request, num_base + len(proposals)):
                proposals.clear()
        return min(num_base + len(proposals), budget)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, now: float) -> None:
        """Admit waiting requests FCFS while budget, sequence slots and blocks last. With chunked prefill off a
        prompt is scheduled whole: one longer than the budget (up to ``max_model_len``, see ``check_feasible``)
        runs alone as the first thing of a step, else it waits for the next step (as vLLM does)."""
        while self.waiting and budget > 0 and len(self.running) + self._num_loading < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.kv_connector is not None:  # P/D: a request whose prompt K/V come from a remote worker
                action = self.kv_connector.start_load(request)
                if action == "blocked":
                    break
                if action == "load":
                    self.waiting.popleft()
                    continue
            hit_blocks, num_hit_tokens = self.block_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if self.config.enable_chunked_prefill:
                num_new = min(num_new, budget)
            elif num_new > budget and output.scheduled:
                break
            request.num_computed_tokens = num_hit_tokens
            if not self.block_manager.allocate_slots(request, num_new, hit_blocks):
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
                self.block_manager.record_lookup(request.num_prompt_tokens, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(output, request, num_new, now)
            budget -= num_new

    @property
    def _num_loading(self) -> int:
        return self.kv_connector.num_loading if self.kv_connector is not None else 0

    def resume(self, request: Request) -> None:
        """A request whose remote K/V arrived joins the running list (its tail is computed next step)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _add_scheduled(self, output: SchedulerOutput, request: Request, num_new: int, now: float) -> None:
        start = request.num_computed_tokens
        is_decode = request.num_output_tokens > 0 and start == request.num_tokens - 1
        proposals = list(request.spec_token_ids)  # scheduled after the request's last known token
        token_ids = request.token_ids_between(start, start + num_new - len(proposals)) + proposals
        if not request.timeline.scheduled:  # first step ever (a preempted request keeps its runner state)
            output.new_requests.append(
                NewRequestData(request.request_id, request.prompt_token_ids, request.sampling_params,
                               request.eos_token_ids, request.grammar)
            )
        output.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=token_ids,
                start_position=start,
                block_ids=self.block_manager.block_ids(request.request_id),
                sample=start + num_new - len(proposals) == request.num_tokens,
                is_prompt=not is_decode,
                spec_token_ids=proposals,
            )
        )
        request.timeline.scheduled.append(ScheduledEvent(now, num_new, not is_decode))

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.timeline.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        output.preempted_request_ids.append(request.request_id)

    # ---- results ---------------------------------------------------------------------------------
    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[StepUpdate]:
        """Advance counters by the computed tokens, append sampled tokens, finish stopped requests."""
        now = self.clock()
        if scheduler_output.scheduled:
            self.budget_policy.observe(scheduler_output.predicted_duration, now - self._step_start)
        updates = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.finished or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted during the step
            request.timeline.scheduled[-1].end_time = now
            request.spec_token_ids = []
            tokens, logprobs = runner_output.tokens_of(scheduled.request_id)
            num_drafted = len(scheduled.spec_token_ids)
            num_accepted = len(tokens) - 1 if num_drafted and tokens else 0
            # the KV of rejected proposals is rolled back by the counter: those slots are rewritten later
            request.num_computed_tokens += len(scheduled.token_ids) - (num_drafted - num_accepted)
            if num_drafted:
                self._observe_proposals(request, num_drafted, num_accepted)
            if not scheduled.sample or not tokens:
                continue
            update = self._append_tokens(request, tokens, logprobs, now)
            update.num_draft_tokens, update.num_accepted_tokens = num_drafted, num_accepted
            updates.append(update)
        return updates

    def _append_tokens(self, request: Request, tokens: list[int], logprobs: list, now: float) -> StepUpdate:
        """Append a step's tokens one by one, stopping at the first that ends the request."""
        new_tokens, new_logprobs, status = [], [], None
        for token_id, token_logprobs in zip(tokens, logprobs):
            request.output_token_ids.append(token_id)
            request.timeline.token_times.append(now)
            new_tokens.append(token_id)
            if token_logprobs:
                new_logprobs.append(token_logprobs)
            status = self._stop_status(request, token_id)
            if status is not None:
                break
        request.timeline.scheduled[-1].num_output_tokens = len(new_tokens)
        if status is not None:
            self.finish_request(request.request_id, status)
        return StepUpdate(request, new_tokens, new_logprobs, status is not None)

    def _observe_proposals(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Count a verified proposal and free blocks that only held rejected proposals."""
        self.spec_stats.observe(num_drafted, num_accepted)
        timeline = request.timeline
        timeline.num_drafts += 1
        timeline.num_draft_tokens += num_drafted
        timeline.num_accepted_tokens += num_accepted
        self.block_manager.trim(request, request.num_computed_tokens + 1)

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stop, length or abort): leave the queues, free its blocks. Idempotent."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.kv_connector is None or not self.kv_connector.on_finish(request, status):
            self.block_manager.free(request)  # else leased for a remote reader
        if request.timeline.scheduled:  # the runner holds its state
            self._finished_request_ids.append(request_id)
        request.status = status
        request.timeline.finish_time = self.clock()
        request.timeline.finish_reason = status.value
        return request

    # ---- views -----------------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running or self._num_loading)

    def check_invariants(self) -> None:
        """Assert the scheduler's and the block manager's books agree."""
        leased = set(self.kv_connector.leases) if self.kv_connector is not None else set()
        self.block_manager.check_invariants(live_request_ids=set(self.requests) | leased)
        if self.kv_connector is not None:
            self.kv_connector.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
            assert len(self.block_manager.block_ids(request.request_id)) >= self.block_manager.num_blocks_for(
                request.num_computed_tokens
            )
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.block_manager.block_ids(request.request_id), "waiting request holds blocks"
