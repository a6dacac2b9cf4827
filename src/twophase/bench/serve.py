"""`twophase bench serve`: drive an OpenAI-compatible server and report vLLM's serving metrics.

The console block and the JSON keys are vLLM's (`vllm bench serve`), so results compare line by line; twophase's
own sections (goodput / SLO attainment, the server-side TTFT split) come after vLLM's closing rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from twophase.bench.datasets import SampleRequest
from twophase.bench.metrics import (
    RequestRecord, arrival_gaps, calculate_metrics, percentile_word, record_from_chunks, send_offsets, server_split,
)  # fmt: skip
from twophase.server.settings import CLIENT_KEEPALIVE_EXPIRY_S

DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "e2els", "timings")
HEADERS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))  # fmt: skip


@dataclass
class LoadConfig:
    """How one benchmark run talks to the server and paces its requests."""

    api_url: str
    model: str
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    ignore_eos: bool = False
    ready_check: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    percentiles: tuple[float, ...] = (99.0,)
    goodput: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    disable_tqdm: bool = False


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer $OPENAI_API_KEY`` when the variable is set (as vLLM's client sends it)."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def build_payload(config: LoadConfig, request: SampleRequest) -> dict[str, Any]:
    """The streaming request body for /v1/completions or /v1/chat/completions (greedy unless overridden)."""
    body: dict[str, Any] = {"model": config.model, "temperature": 0.0, "max_tokens": request.expected_output_len,
                            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if config.api_url.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = request.expected_output_len
    else:
        body["prompt"] = request.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **config.extra_body}


def chunk_content(data: dict[str, Any]) -> str | None:
    """The text a chunk carries (completions ``text`` or chat ``delta.content``); None for a choice-less chunk."""
    choices = data.get("choices")
    if not choices:
        return None
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_request(client: httpx.AsyncClient, config: LoadConfig, request: SampleRequest,
                       pbar: tqdm | None = None) -> RequestRecord:
    """Stream one request; timestamps each SSE data line as it arrives."""
    start = time.perf_counter()
    content_times: list[float] = []
    last_choice: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, float] | None = None
    try:
        async with client.stream("POST", config.api_url, json=build_payload(config, request)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:300]
                return _failed(request, start, f"HTTP {response.status_code}: {body}", pbar)
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                now = time.perf_counter()
                data = json.loads(line[5:])
                text = chunk_content(data)
                if text is not None:
                    last_choice = now
                    if text:
                        content_times.append(now)
                        parts.append(text)
                usage = data.get("usage") or usage
                timings = data.get("timings") or usage.get("timings") or timings
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return _failed(request, start, f"{type(exc).__name__}: {exc}", pbar)
    record = record_from_chunks(start, content_times, last_choice, prompt_len=usage.get("prompt_tokens") or
                                request.prompt_len, output_len=usage.get("completion_tokens"), text="".join(parts))
    record.timings = timings
    if pbar is not None:
        pbar.update(1)
    return record


def _failed(request: SampleRequest, start: float, error: str, pbar: tqdm | None) -> RequestRecord:
    """A failed record (counted in the progress bar)."""
    if pbar is not None:
        pbar.update(1)
    return RequestRecord(success=False, prompt_len=request.prompt_len, start_time=start, error=error)


async def run_load(client: httpx.AsyncClient, config: LoadConfig,
                   requests: list[SampleRequest]) -> tuple[list[RequestRecord], float]:
    """Send every request on its arrival schedule, at most ``max_concurrency`` in flight; (records, duration)."""
    rng = np.random.default_rng(config.seed)
    offsets = send_offsets(arrival_gaps(len(requests), config.request_rate, config.burstiness, rng),
                           config.request_rate)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
    pbar = None if config.disable_tqdm else tqdm(total=len(requests))

    async def limited(request: SampleRequest) -> RequestRecord:
        """One request under the concurrency limit."""
        async with limit:
            return await send_request(client, config, request, pbar)

    t0 = time.perf_counter()
    tasks = []
    for request, offset in zip(requests, offsets):
        delay = t0 + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(request)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    if pbar is not None:
        pbar.close()
    return records, duration


async def benchmark(config: LoadConfig, requests: list[SampleRequest]) -> dict[str, Any]:
    """Ready check, warm-ups, the timed run; returns the result dict (vLLM's keys, detailed lists included)."""
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency,
                          keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)  # fmt: skip
    timeout = httpx.Timeout(6 * 60 * 60, connect=60)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=auth_headers()) as client:
        if config.ready_check:
            print("Starting initial single prompt test run...")
            test = await send_request(client, config, requests[0])
            if not test.success:
                raise ValueError(f"Initial test run failed - check the benchmark arguments. Error: {test.error}")
            print("Initial test run completed.")
        if config.num_warmups > 0:
            print(f"Warming up with {config.num_warmups} requests...")
            warm = dataclasses.replace(config, request_rate=float("inf"), disable_tqdm=True)
            await run_load(client, warm, [requests[0]] * config.num_warmups)
            print("Warmup run completed.")
        print("Starting main benchmark run...")
        distribution = "Poisson process" if config.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {config.request_rate}")
        print(f"Burstiness factor: {config.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {config.max_concurrency}")
        records, duration = await run_load(client, config, requests)
    return build_result(config, records, duration)


def build_result(config: LoadConfig, records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """Aggregate metrics + per-request lists, keyed like vLLM's result JSON."""
    percentiles = list(config.percentiles)
    metrics = calculate_metrics(records, duration, percentiles, config.goodput or None)
    keep = {"ttft", "tpot", "itl", "e2el"} & set(config.percentile_metrics)
    result = {k: v for k, v in metrics.items() if not k.endswith("_ms") or k.split("_")[1] in keep}
    result.update(
        input_lens=[r.prompt_len for r in records], output_lens=[r.output_len if r.success else 0 for r in records],
        ttfts=[r.ttft for r in records], itls=[r.itl for r in records], e2els=[r.latency for r in records],
        generated_texts=[r.generated_text for r in records], errors=[r.error for r in records],
        timings=[r.timings for r in records],
    )  # fmt: skip
    if config.goodput:
        result["goodput_config"] = dict(config.goodput)
    split = server_split(records, percentiles)
    if split:
        result["server_ttft_split"] = split
    return result


def _line(label: str, value: Any, fmt: str = "") -> str:
    """One vLLM console row: label left-aligned in 40 columns, value in 10."""
    return "{:<40} {:<10{}}".format(label, value, fmt)


def format_result(result: dict[str, Any], config: LoadConfig) -> str:
    """vLLM's console block, verbatim layout, followed by twophase's extra sections."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _line("Successful requests:", result["completed"]), _line("Failed requests:", result["failed"])]
    if config.max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", config.max_concurrency))
    if config.request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", config.request_rate, ".2f"))
    lines += [_line("Benchmark duration (s):", result["duration"], ".2f"),
              _line("Total input tokens:", result["total_input_tokens"]),
              _line("Total generated tokens:", result["total_output_tokens"]),
              _line("Request throughput (req/s):", result["request_throughput"], ".2f")]
    if config.goodput:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"], ".2f"))
    lines += [_line("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
              _line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f"),
              _line("Peak concurrent requests:", result["max_concurrent_requests"], ".2f"),
              _line("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")]
    for key, name, header in HEADERS:
        if key not in config.percentile_metrics:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines += [_line(f"Mean {name} (ms):", result[f"mean_{key}_ms"], ".2f"),
                  _line(f"Median {name} (ms):", result[f"median_{key}_ms"], ".2f")]
        lines += [_line(f"P{percentile_word(p)} {name} (ms):", result[f"p{percentile_word(p)}_{key}_ms"], ".2f")
                  for p in config.percentiles]
    lines.append("=" * 50)
    return "\n".join(lines + format_extra_sections(result, config))


def format_extra_sections(result: dict[str, Any], config: LoadConfig) -> list[str]:
    """Goodput & SLO attainment, and the server-side TTFT split (queue vs prefill) when the server reports it."""
    lines: list[str] = []
    if config.goodput:
        lines.append("{s:{c}^{n}}".format(s=" Goodput & SLO Attainment ", n=50, c="-"))
        lines += [_line(f"SLO {name.upper()} (ms):", limit, ".2f") for name, limit in config.goodput.items()]
        lines.append(_line("Request goodput (req/s):", result["request_goodput"], ".2f"))
        attained = result["slo_attainment"]
        lines += [_line(f"{name.upper()} attainment (%):", 100 * attained[name], ".2f") for name in config.goodput]
        lines.append(_line("All-SLO attainment (%):", 100 * attained["all"], ".2f"))
    split = result.get("server_ttft_split")
    if split:
        lines.append("{s:{c}^{n}}".format(s=" Server-side TTFT split ", n=50, c="-"))
        names = [("mean", "Mean"), ("median", "Median"), *[(f"p{percentile_word(p)}", f"P{percentile_word(p)}")
                                                          for p in config.percentiles]]
        for key in ("queue", "prefill"):
            lines += [_line(f"{label} server {key} (ms):", split[key][stat], ".2f")
                      for stat, label in names if key in split and stat in split[key]]
        if "ttft" in split:
            lines.append(_line("Mean server TTFT (ms):", split["ttft"]["mean"], ".2f"))
        lines.append(_line("Cached prompt tokens (%):", 100 * split["cached_prompt_fraction"]["mean"], ".2f"))
    if lines:
        lines.append("=" * 50)
    return lines


def result_json(args_meta: dict[str, Any], result: dict[str, Any], save_detailed: bool) -> dict[str, Any]:
    """vLLM's saved layout: date, backend, model, traffic settings, then the metrics."""
    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), **args_meta, **result}
    if not save_detailed:
        for key in DETAILED_KEYS:
            out.pop(key, None)
    return out


def default_filename(label: str, request_rate: float, max_concurrency: int | None, model: str, date: str) -> str:
    """vLLM's file name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"{label}-{request_rate}qps{concurrency}-{model.split('/')[-1]}-{date}.json"


def save_json(data: dict[str, Any], result_dir: str | None, filename: str) -> Path:
    """Write the JSON under ``result_dir`` (created) or the current directory; returns the path."""
    path = Path(result_dir or ".") / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def plot_results(points: list[dict[str, Any]], path: Path, x_label: str = "request rate") -> Path:
    """Latency–throughput PNG: TTFT and TPOT (median, p99) vs output tok/s per point, and the last run's CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = [p["output_throughput"] for p in points]
    for key, marker in (("ttft", "o"), ("tpot", "s")):
        for stat, style in (("median", "-"), ("p99", "--")):
            ys = [p.get(f"{stat}_{key}_ms", np.nan) for p in points]
            left.plot(x, ys, style, marker=marker, label=f"{stat} {key.upper()}")
    for p, xv in zip(points, x):
        if "sweep_value" in p:
            left.annotate(f"{p['sweep_value']:g}", (xv, p.get("median_ttft_ms", 0)), fontsize=8)
    left.set(xlabel="output throughput (tok/s)", ylabel="latency (ms)", yscale="log",
             title=f"latency vs throughput (points: {x_label})")
    left.legend(fontsize=8)
    last = points[-1]
    tpots = [(e - t) / (n - 1) for e, t, n in zip(last.get("e2els", []), last.get("ttfts", []),
                                                   last.get("output_lens", [])) if n > 1]
    for name, values in (("TTFT", last.get("ttfts", [])), ("TPOT", tpots),
                         ("ITL", [g for gaps in last.get("itls", []) for g in gaps])):
        if values:
            data = np.sort(np.asarray(values) * 1000)
            right.plot(data, np.arange(1, len(data) + 1) / len(data), label=name)
    right.set(xlabel="ms", ylabel="fraction of requests / gaps", xscale="log", title="latency CDFs (last run)")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
