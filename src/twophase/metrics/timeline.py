"""The one place where request timelines become latency metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from twophase.request import RequestTimeline


@dataclass
class RequestMetrics:
    """Per-request phase times in seconds (None where the request never reached that point)."""

    queue_time: float | None  # arrival → first scheduled (or → start of its remote KV transfer)
    prefill_time: float | None  # first scheduled → first token
    decode_time: float | None  # first token → last token
    ttft: float | None  # arrival → first token
    tpot: float | None  # (e2e − ttft) / (n − 1), n > 1
    e2e: float | None  # arrival → last token (or finish)
    # gaps between consecutive token arrivals: the tokens one step produces (speculative decoding) arrive together
    # and count once, as vLLM's per-iteration ITL does
    itl: list[float] = field(default_factory=list)
    runnable_waiting_time: float | None = None  # admitted but not in a step (interference, preemption)
    num_output_tokens: int = 0
    num_preemptions: int = 0
    acceptance_rate: float | None = None  # speculative decoding: accepted / proposed tokens
    mean_accepted_length: float | None = None  # tokens per verifying step (1 + accepted per draft)
    remote_prefill_time: float | None = None  # P/D: the prefill leg on a remote worker (before this arrival)
    kv_transfer_time: float | None = None  # P/D: reading the prompt's blocks from the remote worker


def request_metrics(timeline: RequestTimeline) -> RequestMetrics:
    """Compute every per-request metric from a timeline."""
    tokens = timeline.token_times
    first_sched = timeline.first_scheduled_time
    first_tok = tokens[0] if tokens else None
    last = tokens[-1] if tokens else timeline.finish_time
    e2e = last - timeline.arrival_time if last is not None else None
    ttft = first_tok - timeline.arrival_time if first_tok is not None else None
    tpot = (e2e - ttft) / (len(tokens) - 1) if len(tokens) > 1 and e2e is not None and ttft is not None else None
    queue_end = timeline.kv_transfer_start if timeline.kv_transfer_start is not None else first_sched
    transfer = (timeline.kv_transfer_end - timeline.kv_transfer_start
                if timeline.kv_transfer_end is not None and timeline.kv_transfer_start is not None else None)
    return RequestMetrics(
        queue_time=queue_end - timeline.arrival_time if queue_end is not None else None,
        prefill_time=first_tok - first_sched if first_tok is not None and first_sched is not None else None,
        decode_time=tokens[-1] - tokens[0] if tokens else None,
        ttft=ttft,
        tpot=tpot,
        e2e=e2e,
        itl=_arrival_gaps(tokens),
        runnable_waiting_time=_runnable_waiting(timeline, last),
        num_output_tokens=len(tokens),
        num_preemptions=timeline.num_preemptions,
        acceptance_rate=timeline.num_accepted_tokens / timeline.num_draft_tokens if timeline.num_draft_tokens else None,
        mean_accepted_length=1.0 + timeline.num_accepted_tokens / timeline.num_drafts if timeline.num_drafts else None,
        remote_prefill_time=timeline.remote_prefill_time,
        kv_transfer_time=transfer,
    )


def _arrival_gaps(token_times: list[float]) -> list[float]:
    """Gaps between the distinct times tokens arrived (several tokens of one step share a time)."""
    arrivals = [t for i, t in enumerate(token_times) if i == 0 or t != token_times[i - 1]]
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def _runnable_waiting(timeline: RequestTimeline, end: float | None) -> float | None:
    first = timeline.first_scheduled_time
    if first is None or end is None:
        return None
    busy = sum((e.end_time or e.time) - e.time for e in timeline.scheduled)
    return max(0.0, (end - first) - busy)
