"""A run's records as JSON (the schema every report source speaks) and the latency lists the plots read.

Records schema (``"schema": "twophase.records.v1"``; all times are monotonic seconds on one clock)::

    {"schema": "twophase.records.v1",
     "steps":    [{"step_id", "start_time", "duration", "num_prompt_tokens", "num_decode_tokens",
                   "num_requests", "num_blocks_in_use", "num_blocks_total", "num_waiting", "num_preempted"}],
     "requests": [{"request_id", "arrival_time",
                   "scheduled": [{"time", "end_time", "num_tokens", "is_prompt"}],
                   "token_times": [...], "finish_time", "finish_reason",
                   "num_prompt_tokens", "num_cached_tokens", "num_preemptions"}]}

Sources: a saved records file, a server's ``GET /v1/records`` URL (same schema), or a ``bench serve`` result
JSON with per-request ``ttfts`` / ``itls`` (seconds; only the latency CDFs can be drawn from it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from twophase.metrics.records import SCHEMA, records_to_json, request_to_json, timeline_from_json
from twophase.metrics.timeline import request_metrics
from twophase.outputs import StepRecord
from twophase.request import RequestTimeline

__all__ = ["SCHEMA", "RunRecords", "RequestRecord", "load_records", "record_engine_run", "records_to_json",
           "request_to_json"]  # fmt: skip

@dataclass
class RequestRecord:
    """One request's timeline plus the counts the report shows."""

    request_id: str
    timeline: RequestTimeline
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class RunRecords:
    """Everything a report reads. ``latencies`` is set directly only for bench-serve results (no timelines)."""

    steps: list[StepRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    source_kind: str = "records"  # 'records' | 'bench-serve'
    bench_latencies: dict[str, list[float]] | None = None

    @property
    def has_timelines(self) -> bool:
        """True when Gantt, step mix and trace can be drawn."""
        return bool(self.steps or self.requests)

    def latencies(self) -> dict[str, list[float]]:
        """Seconds: per-request TTFT and TPOT, and ITL pooled over requests."""
        if self.bench_latencies is not None:
            return self.bench_latencies
        metrics = [request_metrics(r.timeline) for r in self.requests]
        return {
            "ttft": [m.ttft for m in metrics if m.ttft is not None],
            "tpot": [m.tpot for m in metrics if m.tpot is not None],
            "itl": [gap for m in metrics for gap in m.itl],
        }

    def start_time(self) -> float:
        """Earliest timestamp in the run (the origin of every plot and trace)."""
        times = [s.start_time for s in self.steps] + [r.timeline.arrival_time for r in self.requests]
        return min(times, default=0.0)


def record_engine_run(llm, prompts: Sequence[Any], params=None) -> dict:
    """Run the offline engine (``LLM.generate``) and return the records of exactly this run."""
    first_step = len(llm.engine.step_records)
    outputs = llm.generate(prompts, params)
    steps = list(llm.engine.step_records)[first_step:]
    return records_to_json(steps, outputs)


def records_from_json(data: dict) -> RunRecords:
    """RunRecords from a records dict or a bench-serve result dict."""
    if "ttfts" in data and "requests" not in data:
        return _from_bench_serve(data)
    step_fields = {f.name for f in dataclasses.fields(StepRecord)}
    try:
        steps = [StepRecord(**{k: v for k, v in s.items() if k in step_fields}) for s in data.get("steps", [])]
        requests = [
            RequestRecord(r["request_id"], timeline_from_json(r), int(r.get("num_prompt_tokens", 0)),
                          int(r.get("num_cached_tokens", 0)))  # fmt: skip
            for r in data.get("requests", [])
        ]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a twophase records file (schema {SCHEMA}): missing or bad field {exc}") from None
    return RunRecords(steps=steps, requests=requests)


def _from_bench_serve(data: dict) -> RunRecords:
    """vLLM-style per-request details: ``ttfts`` (s) and ``itls`` (list of gap lists, s); failed ones skipped."""
    errors = data.get("errors") or [""] * len(data["ttfts"])
    itls = data.get("itls") or [[] for _ in data["ttfts"]]
    ok = [i for i, e in enumerate(errors) if not e]
    ttfts = [data["ttfts"][i] for i in ok if data["ttfts"][i]]
    tpots = [sum(itls[i]) / len(itls[i]) for i in ok if itls[i]]  # == (e2e − ttft)/(n − 1)
    pooled = [g for i in ok for g in itls[i]]
    return RunRecords(source_kind="bench-serve", bench_latencies={"ttft": ttfts, "tpot": tpots, "itl": pooled})


def fetch_json(source: str | Path, timeout: float = 30.0) -> dict:
    """The JSON at a file path or an ``http(s)://`` URL (e.g. a server's ``/v1/records``)."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        import httpx

        response = httpx.get(text, timeout=timeout)
        response.raise_for_status()
        return response.json()
    return json.loads(Path(text).read_text())


def load_records(source: str | Path, timeout: float = 30.0) -> RunRecords:
    """Records from a file path or a URL, in any of the three source forms."""
    return records_from_json(fetch_json(source, timeout))
