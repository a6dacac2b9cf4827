"""A bounded ring of recent StepRecords and finished requests' timelines (served at ``/v1/records``)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Any

from twophase.metrics.timeline import request_metrics
from twophase.outputs import EngineStats, RequestOutput, StepRecord


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
            "steps": [{**dataclasses.asdict(s), "phase": s.phase} for s in steps],
            "requests": requests,
            "stats": {**dataclasses.asdict(stats), "kv_cache_usage": stats.kv_cache_usage} if stats else None,
        }


def _request_row(seq: int, output: RequestOutput) -> dict[str, Any]:
    metrics = dataclasses.asdict(request_metrics(output.timeline))
    return {
        "seq": seq,
        "request_id": output.request_id,
        "finish_reason": output.finish_reason,
        "num_prompt_tokens": len(output.prompt_token_ids),
        "num_cached_tokens": output.num_cached_tokens,
        "num_output_tokens": len(output.token_ids),
        "metrics": metrics,
        "timeline": dataclasses.asdict(output.timeline),
    }
