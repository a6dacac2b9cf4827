"""A bounded ring of recent StepRecords and finished requests' timelines (served at ``/v1/records``)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Any, Iterable

from twophase.metrics.timeline import request_metrics
from twophase.outputs import EngineStats, RequestOutput, StepRecord
from twophase.request import RequestTimeline, ScheduledEvent

SCHEMA = "twophase.records.v1"


class RecordRing:
    """An AsyncLLM stat logger keeping the last ``max_steps`` steps and ``max_requests`` finished requests."""

    def __init__(self, max_steps: int = 4096, max_requests: int = 1024) -> None:
        self._steps: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)
        self._requests: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_requests)
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._stats: EngineStats | None = None

    def record(self, step: StepRecord | None, finished: list[RequestOutput], stats: EngineStats) -> None:
        """Append a step and finished requests (loop thread)."""
        rows = [_request_row(next(self._seq), o) for o in finished]
        with self._lock:
            if step is not None:
                self._steps.append(step)
            self._requests.extend(rows)
            self._stats = stats

    def snapshot(self, since_step: int = -1, since_request: int = -1, limit: int | None = None) -> dict[str, Any]:
        """JSON-ready steps with ``step_id > since_step`` and requests with ``seq > since_request``."""
        with self._lock:
            steps = [s for s in self._steps if s.step_id > since_step]
            requests = [r for r in self._requests if r["seq"] > since_request]
            stats = self._stats
        if limit is not None:
            steps, requests = steps[-limit:], requests[-limit:]
        return {
            "schema": SCHEMA,
            "steps": [step_to_json(s) for s in steps],
            "requests": requests,
            "stats": {**dataclasses.asdict(stats), "kv_cache_usage": stats.kv_cache_usage} if stats else None,
        }


def _request_row(seq: int, output: RequestOutput) -> dict[str, Any]:
    row = request_to_json(output.request_id, output.timeline, len(output.prompt_token_ids), output.num_cached_tokens)
    row.update(seq=seq, num_output_tokens=len(output.token_ids), finish_reason=output.finish_reason)
    row["metrics"] = dataclasses.asdict(request_metrics(output.timeline))
    return row


def step_to_json(step: StepRecord) -> dict[str, Any]:
    """One step in the records schema (its phase label included)."""
    return {**dataclasses.asdict(step), "phase": step.phase}


def request_to_json(request_id: str, timeline: RequestTimeline, num_prompt_tokens: int, num_cached_tokens: int) -> dict:
    """One request in the records schema."""
    return {
        "request_id": request_id,
        "arrival_time": timeline.arrival_time,
        "scheduled": [dataclasses.asdict(e) for e in timeline.scheduled],
        "token_times": list(timeline.token_times),
        "finish_time": timeline.finish_time,
        "finish_reason": timeline.finish_reason,
        "num_prompt_tokens": num_prompt_tokens,
        "num_cached_tokens": num_cached_tokens,
        "num_preemptions": timeline.num_preemptions,
        "num_drafts": timeline.num_drafts,
        "num_draft_tokens": timeline.num_draft_tokens,
        "num_accepted_tokens": timeline.num_accepted_tokens,
        "remote_prefill_time": timeline.remote_prefill_time,
        "kv_transfer_start": timeline.kv_transfer_start,
        "kv_transfer_end": timeline.kv_transfer_end,
        "kv_transfer_bytes": timeline.kv_transfer_bytes,
    }


def records_to_json(step_records: Iterable[StepRecord], requests_or_outputs: Iterable[Any]) -> dict:
    """The records dict from StepRecords and Requests or RequestOutputs (anything with a ``timeline``)."""
    requests = []
    for r in requests_or_outputs:
        num_prompt = getattr(r, "num_prompt_tokens", None)
        if num_prompt is None:
            num_prompt = len(r.prompt_token_ids)
        requests.append(request_to_json(r.request_id, r.timeline, num_prompt, getattr(r, "num_cached_tokens", 0)))
    return {"schema": SCHEMA, "steps": [step_to_json(s) for s in step_records], "requests": requests}


def timeline_from_json(d: dict) -> RequestTimeline:
    """A RequestTimeline from its records-schema dict."""
    return RequestTimeline(
        arrival_time=float(d["arrival_time"]),
        scheduled=[ScheduledEvent(e["time"], e["num_tokens"], e["is_prompt"], e.get("end_time"), e.get("num_output_tokens", 0))
                   for e in d["scheduled"]],
        token_times=[float(t) for t in d.get("token_times", [])],
        finish_time=d.get("finish_time"),
        finish_reason=d.get("finish_reason"),
        num_preemptions=int(d.get("num_preemptions", 0)),
        num_drafts=int(d.get("num_drafts", 0)),
        num_draft_tokens=int(d.get("num_draft_tokens", 0)),
        num_accepted_tokens=int(d.get("num_accepted_tokens", 0)),
        remote_prefill_time=d.get("remote_prefill_time"),
        kv_transfer_start=d.get("kv_transfer_start"),
        kv_transfer_end=d.get("kv_transfer_end"),
        kv_transfer_bytes=int(d.get("kv_transfer_bytes") or 0),
    )

