"""Drive the real ``Scheduler`` and ``BlockManager`` in virtual time.

Each step: the scheduler builds its batch exactly as in the engine; a ``NullRunner`` "samples" one fixed token per
sampling row (requests carry ``ignore_eos`` and ``max_tokens``, so output lengths are scripted); the virtual clock
advances by the predictor's step duration, then by the inter-step gap. Arrivals follow the client's schedule
(offsets, plus a concurrency limit released when a request finishes); a request reaches the scheduler
``admission`` seconds after the client sends it (the serving overhead outside the engine: HTTP, tokenization, the
first chunk's way back), so its client-side TTFT and E2E latency include it; with a ``DeliveryJitter`` the client
receives the later tokens late and in bunches, as a client sharing the CPU does. Nothing here reads the wall clock.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from twophase.bench.metrics import RequestRecord
from twophase.config import SchedulerConfig
from twophase.engine.scheduler import Scheduler
from twophase.kv_cache.block_manager import BlockManager
from twophase.metrics.goodput import timeline_record
from twophase.outputs import ModelRunnerOutput, SchedulerOutput, StepRecord
from twophase.request import Request, RequestStatus, RequestTimeline
from twophase.sampling_params import InvalidRequestError, SamplingParams
from twophase.steptime.budget import BudgetPolicy
from twophase.steptime.features import StepFeatures, make_step_record, step_features
from twophase.steptime.model import StepTimeModel

log = logging.getLogger(__name__)


class VirtualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move forward (never back)."""
        self.now += max(0.0, seconds)

    def advance_to(self, when: float) -> None:
        """Move to ``when`` if it is later."""
        self.now = max(self.now, when)


class Predictor(Protocol):
    """Step duration from its features."""

    def predict(self, features: StepFeatures) -> float: ...


class ModelPredictor:
    """A StepTimeModel, optionally multiplied by a residual ratio drawn from its calibration's steps of the same
    kind (with or without prompt tokens; seeded), with a warning the first time a step leaves the calibrated range
    of a feature."""

    def __init__(self, model: StepTimeModel, noise: bool = False, seed: int = 0) -> None:
        self.model = model
        self.rng = np.random.default_rng(seed) if noise and model.residual_ratios else None
        self.residuals = {kind: model.residuals_of_kind(kind) for kind in (False, True)}
        self.warned: set[str] = set()
        self.num_out_of_range = 0

    def predict(self, features: StepFeatures) -> float:
        """Model seconds × a drawn residual ratio (when noise is on)."""
        outside = self.model.out_of_range(features)
        if outside:
            self.num_out_of_range += 1
            for name in set(outside) - self.warned:
                log.warning("simulated step leaves the calibrated range of %s (%s); the prediction extrapolates",
                            name, features)  # fmt: skip
                self.warned.add(name)
        seconds = self.model.predict(features)
        if self.rng is not None:
            seconds *= float(self.rng.choice(self.residuals[features.prefill_tokens > 0]))
        return seconds


class DeliveryJitter:
    """When a client receives each token after the first, relative to when the engine produced it (beyond the
    first token's own delay, which the admission overhead covers): draws from a served calibration's delays, as
    serially correlated as they were (a Gaussian AR(1) of lag-1 correlation ``corr`` mapped through the delays'
    empirical quantiles). A client sharing the CPU with the server receives tokens late and in bunches: its ITL
    percentiles spread beyond the engine's while their mean stays."""

    def __init__(self, delays_s: Sequence[float], corr: float, seed: int = 0) -> None:
        if not delays_s:
            raise ValueError("delivery jitter needs at least one delay sample")
        self.sorted = np.sort(np.asarray(delays_s, dtype=float))  # [k]
        self.corr = min(max(float(corr), 0.0), 0.99)
        self.rng = np.random.default_rng(seed)

    def draw(self, n: int) -> np.ndarray:
        """``n`` consecutive delays (seconds) of one request's tokens."""
        z = self.rng.standard_normal(n)  # [n]
        g, innovation = np.empty(n), math.sqrt(1.0 - self.corr**2)
        for i in range(n):
            g[i] = z[i] if i == 0 else self.corr * g[i - 1] + innovation * z[i]
        u = np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in g])  # standard normal CDF, [n]
        return self.sorted[np.minimum((u * len(self.sorted)).astype(int), len(self.sorted) - 1)]

    def client_times(self, token_times: Sequence[float]) -> list[float]:
        """The times a client receives the tokens: the first as produced, each later one delayed by a draw but
        never before the one ahead of it."""
        times = list(token_times[:1])
        for produced, delay in zip(token_times[1:], self.draw(len(token_times) - 1)):
            times.append(max(times[-1], produced + float(delay)))
        return times


class NullRunner:
    """Returns one token per sampling row without computing anything."""

    def __init__(self, token_id: int = 0) -> None:
        self.token_id = token_id

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """``token_id`` for every request whose chunk reached its last known token."""
        return ModelRunnerOutput(sampled_token_ids={s.request_id: self.token_id for s in output.scheduled if s.sample})


@dataclass
class SimRequest:
    """One request of the workload: prompt ids, tokens to generate, client send offset (s from the start)."""

    prompt_token_ids: list[int]
    max_tokens: int
    send_offset: float = 0.0
    request_id: str | None = None


@dataclass
class SimResult:
    """What a simulated run produced: client-side records (bench serve's), steps, requests, duration."""

    records: list[RequestRecord]
    duration: float
    steps: list[StepRecord]
    requests: list[Request]
    step_tokens: dict[str, list[int]] = field(default_factory=dict)  # request id → step id of each output token
    num_out_of_range: int = 0


class Simulator:
    """The real scheduler over a virtual clock. ``gap`` is the inter-step gap: seconds, or a function called
    once per step (the oracle replays recorded gaps); ``admission``: seconds from a client's send to the request's
    arrival in the engine (0: it arrives as it is sent), plus ``admission_per_stream`` per request already in
    flight; ``jitter``: when the client receives the tokens after the first (None: as produced)."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, predictor: Predictor,
                 gap: float | Callable[[], float] = 0.0, enable_prefix_caching: bool = True,
                 budget_policy: BudgetPolicy | None = None, start_time: float = 0.0, admission: float = 0.0,
                 jitter: DeliveryJitter | None = None, admission_per_stream: float = 0.0) -> None:
        if admission < 0 or admission_per_stream < 0:
            raise ValueError(f"admission overhead must be >= 0 s, got {admission} + {admission_per_stream} per stream")
        self.clock = VirtualClock(start_time)
        self.admission, self.admission_per_stream = admission, admission_per_stream
        self.jitter = jitter
        self.scheduler = Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching), self.clock,
                                   budget_policy)  # fmt: skip
        self.predictor = predictor
        self.gap = gap if callable(gap) else (lambda: float(gap))
        self.runner = NullRunner()
        self.steps: list[StepRecord] = []
        self.step_tokens: dict[str, list[int]] = {}

    def run(self, workload: Sequence[SimRequest], max_concurrency: int | None = None) -> SimResult:
        """Send every request on its schedule, step until all finish; returns bench serve's records."""
        t0 = self.clock()
        pending = sorted(range(len(workload)), key=lambda i: workload[i].send_offset)
        pending.reverse()  # pop() takes the earliest
        limit = max_concurrency or len(workload) or 1
        sent: list[tuple[Request, float]] = []
        admitting: list[tuple[Request, float]] = []  # sent, not yet in the engine: (request, arrival time)
        in_flight = 0
        slot_freed = -math.inf  # when the concurrency limit last let a request go (a request ended)
        while pending or admitting or self.scheduler.has_unfinished:
            while pending and in_flight < limit and t0 + workload[pending[-1]].send_offset <= self.clock():
                item = workload[pending.pop()]
                # sent on its schedule, or as a slot came free: mostly during the step just simulated, not at its
                # end, so the client's TTFT counts the wait for that step as a served run's does
                send = max(t0 + item.send_offset, slot_freed)
                arrival = send + self.admission + self.admission_per_stream * in_flight
                request = self._request(item, len(sent), arrival)
                sent.append((request, send))
                admitting.append((request, arrival))
                in_flight += 1
            refused = self._admit(admitting)
            slot_freed, in_flight = self._release(slot_freed, in_flight, refused, limit)
            if not self.scheduler.has_unfinished:
                sendable = pending and in_flight < limit
                next_send = t0 + workload[pending[-1]].send_offset if sendable else float("inf")
                self.clock.advance_to(min(next_send, admitting[0][1] if admitting else float("inf")))
                continue
            slot_freed, in_flight = self._release(slot_freed, in_flight, self.step(), limit)
        duration = self.clock() - t0
        records = [timeline_record(self._client_view(r.timeline), r.num_prompt_tokens, send) for r, send in sent]
        return SimResult(records, duration, self.steps, [r for r, _ in sent], self.step_tokens,
                         getattr(self.predictor, "num_out_of_range", 0))  # fmt: skip

    def _release(self, slot_freed: float, in_flight: int, ended: int, limit: int) -> tuple[float, int]:
        """(when a request slot last came free, requests in flight) after ``ended`` of the ``in_flight`` ended now:
        the time moves to now where the limit was holding sends back, else no send waited for the slot."""
        return (self.clock() if ended and in_flight >= limit else slot_freed), in_flight - ended

    def _client_view(self, timeline: RequestTimeline) -> RequestTimeline:
        """The timeline with token times as the client receives them (itself without jitter)."""
        if self.jitter is None or len(timeline.token_times) < 2:
            return timeline
        times = self.jitter.client_times(timeline.token_times)
        return replace(timeline, token_times=times, finish_time=max(timeline.finish_time or times[-1], times[-1]))

    def _request(self, item: SimRequest, index: int, arrival: float) -> Request:
        """The engine's request for one workload item, arriving at ``arrival``."""
        params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
        return Request(item.request_id or f"sim-{index}", item.prompt_token_ids, params, arrival_time=arrival)

    def _admit(self, admitting: list[tuple[Request, float]]) -> int:
        """Queue the requests whose arrival time has come (in send order); one the engine would refuse ends at
        once, failed, as in bench serve. Returns how many were refused."""
        now, refused = self.clock(), 0
        while admitting and admitting[0][1] <= now:
            request, _ = admitting.pop(0)
            try:
                self.scheduler.add_request(request)
            except InvalidRequestError as exc:
                request.status = RequestStatus.FINISHED_ABORTED
                request.timeline.finish_reason = f"refused: {exc}"
                refused += 1
        return refused

    def step(self) -> int:
        """One engine step in virtual time (schedule, predict, advance, update, gap); returns requests finished."""
        start = self.clock()
        output = self.scheduler.schedule()
        busy = bool(output.scheduled or output.preempted_request_ids)  # the engine records exactly these steps
        if not busy:
            raise RuntimeError(f"the scheduler scheduled nothing with {len(self.scheduler.waiting)} requests waiting")
        duration = self.predictor.predict(step_features(output))
        self.clock.advance(duration)
        updates = self.scheduler.update(output, self.runner.execute(output))
        for update in updates:
            self.step_tokens.setdefault(update.request.request_id, []).append(output.step_id)
        self.steps.append(make_step_record(output, self.scheduler, start, duration, updates))
        self.clock.advance(self.gap())
        return sum(u.finished for u in updates)
