"""Serving-benchmark metrics: pure functions on per-request records, defined as vLLM's `bench serve` defines them.

Every time here is in seconds unless a name ends in ``_ms``. Definitions (per request, client side):

- TTFT: send → first streamed chunk carrying content.
- ITL: gaps between consecutive content chunks; pooled over all requests (not averaged per request).
- E2EL: send → last chunk carrying a choice.
- TPOT: (E2EL − TTFT) / (n − 1) for requests with n > 1 output tokens (the first token is excluded).
- Percentiles: ``numpy.percentile`` with linear interpolation; an empty list reports 0 (as vLLM does).
- Goodput: completed requests meeting every SLO, per second of benchmark duration (TPOT of a request with
  n ≤ 1 counts as 0, as in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request (the vLLM ``RequestFuncOutput`` plus server timings)."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0  # generated tokens: usage.completion_tokens, else the number of content chunks
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    start_time: float = 0.0  # perf_counter at send
    generated_text: str = ""
    error: str = ""
    timings: dict[str, float] | None = None  # twophase's per-request server timings, when the server sends them


def record_from_chunks(start: float, content_times: list[float], last_choice_time: float | None,
                       *, prompt_len: int, output_len: int | None = None, text: str = "") -> RequestRecord:
    """A successful record from the send time and the arrival times of the content chunks."""
    if not content_times:
        return RequestRecord(success=False, prompt_len=prompt_len, start_time=start,
                             error="Never received a chunk with content to compute TTFT")
    end = max(last_choice_time or content_times[-1], content_times[-1])
    return RequestRecord(
        success=True, prompt_len=prompt_len,
        output_len=output_len if output_len is not None else len(content_times),
        ttft=content_times[0] - start, itl=list(np.diff(content_times).tolist()), latency=end - start,
        start_time=start, generated_text=text,
    )  # fmt: skip


def request_tpot(record: RequestRecord) -> float | None:
    """(E2EL − TTFT) / (n − 1), or None when the request produced at most one token."""
    if record.output_len <= 1:
        return None
    return (record.latency - record.ttft) / (record.output_len - 1)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation (numpy's default); 0 for an empty list."""
    return float(np.percentile(values or [0.0], p))


def summarize_ms(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean / median / std / p<P> of seconds, reported in milliseconds (keys without the metric name)."""
    data = values or [0.0]
    out = {"mean": float(np.mean(data)) * 1000, "median": float(np.median(data)) * 1000,
           "std": float(np.std(data)) * 1000}  # fmt: skip
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = percentile(values, p) * 1000
    return out


def percentile_word(p: float) -> str:
    """vLLM's percentile label: 99 → '99', 99.9 → '99.9'."""
    return str(int(p)) if int(p) == p else str(p)


def slo_values(record: RequestRecord) -> dict[str, float]:
    """The per-request values goodput compares against the SLOs (seconds; TPOT 0 when n ≤ 1)."""
    return {"ttft": record.ttft, "tpot": request_tpot(record) or 0.0, "e2el": record.latency}


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True when a successful request meets every SLO (``slos_ms``: name → limit in ms, inclusive)."""
    values = slo_values(record)
    return record.success and all(values[name] <= limit / 1000 for name, limit in slos_ms.items())


def goodput(records: list[RequestRecord], slos_ms: dict[str, float], duration: float) -> float:
    """Requests meeting every SLO per second."""
    return sum(meets_slos(r, slos_ms) for r in records) / duration if duration > 0 else 0.0


def attainment(records: list[RequestRecord], slos_ms: dict[str, float]) -> dict[str, float]:
    """Fraction of all requests (failures count as misses) meeting each SLO and all of them ('all')."""
    if not records:
        return {"all": 0.0, **{name: 0.0 for name in slos_ms}}
    n = len(records)
    out = {name: sum(r.success and slo_values(r)[name] <= lim / 1000 for r in records) / n
           for name, lim in slos_ms.items()}  # fmt: skip
    out["all"] = sum(meets_slos(r, slos_ms) for r in records) / n
    return out


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] → {'ttft': 200.0, 'tpot': 50.0}; names and values validated like vLLM's."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        try:
            name, value = pair.split(":")
            slos[name] = float(value)
        except ValueError as exc:
            raise ValueError(f"invalid SLO {pair!r}: use KEY:VALUE with the value in milliseconds") from exc
        if name not in SLO_NAMES:
            raise ValueError(f"invalid SLO name {name!r}: use one of {list(SLO_NAMES)}")
        if slos[name] < 0:
            raise ValueError(f"invalid SLO value {pair!r}: must be non-negative")
    return slos


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Gaps between n request sends: 0 for rate inf, else gamma(shape=b, scale=1/(rate·b)); b = 1 is Poisson.

    The gaps have mean 1/rate and coefficient of variation 1/√b; b = inf gives constant gaps.
    """
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if rate == float("inf"):
        return np.zeros(n)
    if burstiness == float("inf"):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def send_offsets(gaps: np.ndarray, rate: float) -> np.ndarray:
    """Cumulative send times, rescaled (as vLLM does) so the last request goes out at n / rate."""
    offsets = np.cumsum(gaps)
    if len(offsets) and offsets[-1] > 0 and rate != float("inf"):
        offsets = offsets * (len(offsets) / rate) / offsets[-1]
    return offsets


def peak_output(records: list[RequestRecord]) -> tuple[float, int]:
    """vLLM's peak output tokens per one-second bucket and the most requests active in a bucket."""
    done = [r for r in records if r.success]
    if not done:
        return 0.0, 0
    t0 = min(r.start_time for r in done)
    num_buckets = int(np.ceil(max(r.start_time + r.latency for r in done) - t0)) + 1
    tokens = np.zeros(num_buckets)
    active = np.zeros(num_buckets)
    for r in done:
        times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        buckets = (times - t0).astype(int)
        np.add.at(tokens, buckets[(buckets >= 0) & (buckets < num_buckets)], 1)
        active[int(r.start_time - t0): int(r.start_time + r.latency - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


def calculate_metrics(records: list[RequestRecord], duration: float, percentiles: list[float],
                      slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """The aggregate metrics under vLLM's JSON key names (plus SLO attainment when SLOs are given)."""
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for t in (request_tpot(r) for r in done) if t is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    peak_tokens, peak_requests = peak_output(records)
    out: dict[str, Any] = {
        "duration": duration, "completed": len(done), "failed": len(records) - len(done),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": goodput(records, slos_ms, duration) if slos_ms else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_requests,
    }  # fmt: skip
    for name, values in series.items():
        for stat, value in summarize_ms(values, percentiles).items():
            out[f"{stat}_{name}_ms"] = value
    if slos_ms:
        out["slo_attainment"] = attainment(records, slos_ms)
    return out


def server_split(records: list[RequestRecord], percentiles: list[float]) -> dict[str, dict[str, float]] | None:
    """Server-side TTFT split from twophase's per-request timings: summaries of queue_ms, prefill_ms, ttft_ms."""
    timed = [r.timings for r in records if r.success and r.timings]
    if not timed:
        return None
    out = {}
    for key in ("queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "tpot_ms"):
        values = [float(t[key]) / 1000 for t in timed if t.get(key) is not None]
        if values:
            out[key.removesuffix("_ms")] = summarize_ms(values, percentiles)
    cached = [float(t.get("cached_n", 0)) for t in timed]
    prompt = [float(t.get("prompt_n", 0)) for t in timed]
    out["cached_prompt_fraction"] = {"mean": sum(cached) / sum(prompt) if sum(prompt) else 0.0}
    return out


def best_passing_point(points: list[dict[str, Any]], key: str, min_attainment: float = 0.9) -> dict[str, Any] | None:
    """The sweep point with the highest ``key`` (request rate or concurrency) whose 'all' attainment ≥ the floor."""
    passing = [p for p in points if p.get("slo_attainment", {}).get("all", 0.0) >= min_attainment]
    return max(passing, key=lambda p: float(p[key]), default=None)
