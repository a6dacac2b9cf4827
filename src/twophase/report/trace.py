"""Chrome / Perfetto trace (JSON trace-event format) of a run: an engine track of steps labelled
prefill / decode / mixed, and one track per request with its queue, prefill chunks, decode steps and waits.

Open the file in ``chrome://tracing`` or the Perfetto UI.
"""

from __future__ import annotations

import json
from pathlib import Path

from twophase.report.plots import request_segments
from twophase.report.report import RunRecords

ENGINE_PID, REQUESTS_PID = 1, 2


def _meta(pid: int, tid: int, kind: str, name: str) -> dict:
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def step_events(records: RunRecords, t0: float) -> list[dict]:
    """One complete ('X') event per engine step plus counter ('C') events for tokens and KV usage."""
    events = [_meta(ENGINE_PID, 0, "process_name", "engine"), _meta(ENGINE_PID, 0, "thread_name", "steps")]
    for s in records.steps:
        ts = _us(s.start_time - t0)
        args = {"step_id": s.step_id, "prompt_tokens": s.num_prompt_tokens, "decode_tokens": s.num_decode_tokens,
                "requests": s.num_requests, "kv_blocks_in_use": s.num_blocks_in_use, "waiting": s.num_waiting}  # fmt: skip
        events.append({"ph": "X", "pid": ENGINE_PID, "tid": 0, "ts": ts, "dur": _us(s.duration),
                       "name": s.phase, "cat": "step", "args": args})  # fmt: skip
        events.append({"ph": "C", "pid": ENGINE_PID, "tid": 0, "ts": ts, "name": "tokens", "cat": "step",
                       "args": {"prompt": s.num_prompt_tokens, "decode": s.num_decode_tokens}})  # fmt: skip
        usage = 100 * s.num_blocks_in_use / s.num_blocks_total if s.num_blocks_total else 0
        events.append({"ph": "C", "pid": ENGINE_PID, "tid": 0, "ts": ts, "name": "kv_usage_pct", "cat": "step",
                       "args": {"kv": usage}})  # fmt: skip
    return events


def request_events(records: RunRecords, t0: float) -> list[dict]:
    """Per-request tracks (tid = arrival order + 1): queue, prefill, decode and waiting slices."""
    events = [_meta(REQUESTS_PID, 0, "process_name", "requests")]
    requests = sorted(records.requests, key=lambda r: r.timeline.arrival_time)
    for tid, request in enumerate(requests, start=1):
        events.append(_meta(REQUESTS_PID, tid, "thread_name", request.request_id))
        for phase, segments in request_segments(request, t0).items():
            for start, width in segments:
                events.append({"ph": "X", "pid": REQUESTS_PID, "tid": tid, "ts": _us(start), "dur": _us(width),
                               "name": phase, "cat": "request", "args": {"request_id": request.request_id}})  # fmt: skip
        for i, t in enumerate(request.timeline.token_times):
            events.append({"ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": tid, "ts": _us(t - t0),
                           "name": "first token" if i == 0 else "token", "cat": "token"})  # fmt: skip
    return events


def chrome_trace(records: RunRecords) -> dict:
    """The whole trace as a dict (``{"traceEvents": [...], "displayTimeUnit": "ms"}``)."""
    t0 = records.start_time()
    events = step_events(records, t0) + request_events(records, t0)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"generator": "twophase report"}}


def write_trace(records: RunRecords, path: str | Path) -> Path:
    """Write the trace JSON."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(records)))
    return path
