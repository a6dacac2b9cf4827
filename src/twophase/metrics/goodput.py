"""Goodput as a live server metric: each finished request's SLO verdicts, counted as Prometheus counters.

A request's record is built from its server timeline the way the simulator builds it (``timeline_record``) and
judged with bench serve's own ``slo_values`` (TTFT, TPOT, E2EL, limits inclusive), so the counters equal the
attainment bench serve's metric code computes from the same run's ``/v1/records``. Aborted requests count as
missed. Also exported: the token budget of each step and each step's actual ÷ predicted duration (when the budget
policy has a step-time model).
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

from twophase.bench.metrics import RequestRecord, slo_values
from twophase.outputs import EngineStats, RequestOutput, StepRecord
from twophase.request import RequestTimeline

BUDGET_BUCKETS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


def timeline_record(timeline: RequestTimeline, num_prompt_tokens: int, send_time: float | None = None) -> RequestRecord:
    """bench serve's RequestRecord from a request timeline: tokens seen when produced, sent at arrival."""
    start = timeline.arrival_time if send_time is None else send_time
    times = timeline.token_times
    if not times or timeline.finish_reason == "abort":
        return RequestRecord(success=False, prompt_len=num_prompt_tokens, start_time=start,
                             error=timeline.finish_reason or "no token produced")  # fmt: skip
    end = max(timeline.finish_time or times[-1], times[-1])
    return RequestRecord(success=True, prompt_len=num_prompt_tokens, output_len=len(times), ttft=times[0] - start,
                         itl=np.diff(times).tolist(), latency=end - start, start_time=start)  # fmt: skip


def verdicts(record: RequestRecord, slos_ms: dict[str, float]) -> dict[str, bool]:
    """Per objective whether the request met it, and 'all'; a failed request meets none."""
    values = slo_values(record)
    out = {name: record.success and values[name] <= limit / 1000 for name, limit in slos_ms.items()}
    out["all"] = all(out.values()) and record.success
    return out


class GoodputStatLogger:
    """An AsyncLLM stat logger adding goodput and step-budget metrics to an existing registry."""

    def __init__(self, model_name: str, slos_ms: dict[str, float], registry: CollectorRegistry) -> None:
        self.model_name, self.slos_ms = model_name, dict(slos_ms)
        labels = ["model_name"]
        self.judged = Counter("twophase:slo_requests", "Finished requests judged against the SLOs", labels,
                              registry=registry)  # fmt: skip
        self.met = Counter("twophase:slo_requests_met", "Finished requests meeting an objective ('all': every one)",
                           labels + ["objective"], registry=registry)  # fmt: skip
        self.good_tokens = Counter("twophase:goodput_output_tokens", "Output tokens of requests meeting every SLO",
                                   labels, registry=registry)  # fmt: skip
        self.budget = Histogram("twophase:step_token_budget", "Token budget the policy gave each step", labels,
                                buckets=BUDGET_BUCKETS, registry=registry)  # fmt: skip
        self.ratio = Histogram("twophase:step_time_actual_over_predicted", "Step duration / its prediction",
                               labels, buckets=RATIO_BUCKETS, registry=registry)  # fmt: skip
        self.judged.labels(model_name)
        self.good_tokens.labels(model_name)
        for objective in [*self.slos_ms, "all"]:
            self.met.labels(model_name, objective)

    def record(self, step: StepRecord | None, finished: list[RequestOutput], stats: EngineStats) -> None:
        """Count the step's budget and prediction ratio, and judge the requests that finished (loop thread)."""
        m = self.model_name
        if step is not None and step.token_budget:
            self.budget.labels(m).observe(step.token_budget)
            if step.predicted_duration:
                self.ratio.labels(m).observe(step.duration / step.predicted_duration)
        if not self.slos_ms:
            return
        for output in finished:
            record = timeline_record(output.timeline, len(output.prompt_token_ids))
            verdict = verdicts(record, self.slos_ms)
            self.judged.labels(m).inc()
            for objective, met in verdict.items():
                if met:
                    self.met.labels(m, objective).inc()
            if verdict["all"]:
                self.good_tokens.labels(m).inc(record.output_len)
