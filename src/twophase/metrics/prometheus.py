"""Prometheus exposition with vLLM's metric names (the only module that imports prometheus_client).

A ``PrometheusStatLogger`` is an ``AsyncLLM`` stat logger: it is called on the engine loop thread after each
step with the step's record, the requests that finished in it and a stats snapshot. Per-request latencies come
from ``metrics.timeline.request_metrics``; nothing here measures time itself.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from twophase.metrics.timeline import request_metrics
from twophase.outputs import EngineStats, RequestOutput, StepRecord

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
STEP_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FINISH_REASONS = ("stop", "length", "abort")


class PrometheusStatLogger:
    """Owns a private CollectorRegistry (never the global one) holding every server metric."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._last_stats: EngineStats | None = None
        labels = ["model_name"]
        self._build_request_metrics(labels)
        self._build_engine_metrics(labels)
        self._kv_transfers: KVTransferMetrics | None = None

    def track_kv_transfers(self, counters) -> None:
        """Also export a P/D server's KV transfer counters (``kv_transfer.scheduler_connector.TransferCounters``)."""
        self._kv_transfers = KVTransferMetrics(self.registry, self.model_name, counters)

    def _histogram(self, name: str, doc: str, buckets, labels: list[str]) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def _build_request_metrics(self, labels: list[str]) -> None:
        h = self._histogram
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS, labels)
        self.itl = h("vllm:inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS, labels)
        self.tpot = h("vllm:request_time_per_output_token_seconds", "Time per output token", ITL_BUCKETS, labels)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS, labels)
        self.queue = h("vllm:request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS, labels)
        self.prefill = h("vllm:request_prefill_time_seconds", "First scheduled to first token", LATENCY_BUCKETS, labels)
        self.decode = h("vllm:request_decode_time_seconds", "First token to last token", LATENCY_BUCKETS, labels)
        self.prompt_len = h("vllm:request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS, labels)
        self.gen_len = h("vllm:request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS, labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=self.registry)
        self.gen_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests", labels,
                                  registry=self.registry)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.success.labels(self.model_name, reason)

    def _build_engine_metrics(self, labels: list[str]) -> None:
        r = self.registry
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     labels, registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                  registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", labels, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)", labels, registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Verified proposals (speculative decoding)",
                                   labels, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified", labels,
                                         registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted", labels,
                                     registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by position", labels + ["position"],
                                             registry=r)
        h = self._histogram
        self.step_prefill = h("twophase:step_prefill_tokens", "Prompt tokens per step", STEP_TOKEN_BUCKETS, labels)
        self.step_decode = h("twophase:step_decode_tokens", "Decode tokens per step", STEP_TOKEN_BUCKETS, labels)
        self.step_duration = h("twophase:step_duration_seconds", "Step duration by phase", STEP_BUCKETS,
                               labels + ["phase"])
        for metric in (self.cache_queries, self.cache_hits, self.preemptions, self.prompt_tokens, self.gen_tokens):
            metric.labels(self.model_name)  # exposed at 0 from the start
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.labels(self.model_name).set(0)

    def record(self, step: StepRecord | None, finished: list[RequestOutput], stats: EngineStats) -> None:
        """Update every metric from one engine step (loop thread)."""
        m = self.model_name
        if step is not None:
            self.step_prefill.labels(m).observe(step.num_prompt_tokens)
            self.step_decode.labels(m).observe(step.num_decode_tokens)
            self.step_duration.labels(m, step.phase).observe(step.duration)
        for output in finished:
            self._record_finished(output)
        self._record_stats(stats)

    def _record_finished(self, output: RequestOutput) -> None:
        m = self.model_name
        metrics = request_metrics(output.timeline)
        self.prompt_tokens.labels(m).inc(len(output.prompt_token_ids))
        self.gen_tokens.labels(m).inc(len(output.token_ids))
        self.success.labels(m, output.finish_reason or "abort").inc()
        self.prompt_len.labels(m).observe(len(output.prompt_token_ids))
        self.gen_len.labels(m).observe(len(output.token_ids))
        pairs = ((self.ttft, metrics.ttft), (self.e2e, metrics.e2e), (self.queue, metrics.queue_time),
                 (self.prefill, metrics.prefill_time), (self.decode, metrics.decode_time), (self.tpot, metrics.tpot))
        for histogram, value in pairs:
            if value is not None:
                histogram.labels(m).observe(value)
        for gap in metrics.itl:
            self.itl.labels(m).observe(gap)

    def _record_stats(self, stats: EngineStats) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        last = self._last_stats
        deltas = ((self.cache_queries, stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0)),
                  (self.cache_hits, stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0)),
                  (self.preemptions, stats.num_preemptions - (last.num_preemptions if last else 0)))
        for counter, delta in deltas:
            if delta > 0:
                counter.labels(m).inc(delta)
        self._record_spec(stats, last)
        self._last_stats = stats

    def _record_spec(self, stats: EngineStats, last: EngineStats | None) -> None:
        spec, before = stats.spec_decode, last.spec_decode if last else None
        if spec is None:
            return
        m = self.model_name
        pairs = ((self.spec_drafts, spec.num_drafts, before.num_drafts if before else 0),
                 (self.spec_draft_tokens, spec.num_draft_tokens, before.num_draft_tokens if before else 0),
                 (self.spec_accepted, spec.num_accepted_tokens, before.num_accepted_tokens if before else 0))
        for counter, now, then in pairs:
            counter.labels(m).inc(now - then)  # also exposes 0 from the first step
        old = before.num_accepted_tokens_per_pos if before else []
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(m, str(pos)).inc(count - (old[pos] if pos < len(old) else 0))

    def exposition(self) -> bytes:
        """The text exposition format of this registry."""
        if self._kv_transfers is not None:
            self._kv_transfers.sync()
        return generate_latest(self.registry)


XFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVTransferMetrics:
    """KV transfers under names following vLLM's KV connector metrics (``vllm:nixl_xfer_time_seconds`` etc.,
    here ``vllm:kv_*``), brought up to date from the connector's counters at each scrape."""

    def __init__(self, registry: CollectorRegistry, model_name: str, counters) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        self.counters = counters
        self.transfers = Counter("vllm:kv_num_transfers", "KV block transfers completed", labels, registry=registry)
        self.bytes = Counter("vllm:kv_bytes_transferred", "KV bytes transferred", labels, registry=registry)
        self.seconds = Histogram("vllm:kv_xfer_time_seconds", "Time of one KV transfer (decode side: start of the "
                                 "read to blocks written)", labels, buckets=XFER_BUCKETS, registry=registry)
        self.failures = Counter("vllm:kv_num_failed_transfers", "Failed KV transfers by cause",
                                labels + ["cause"], registry=registry)
        self.expired = Counter("vllm:kv_num_expired_leases", "Prefill leases freed at their deadline, unread",
                               labels, registry=registry)
        self.prefix_hits = Counter("vllm:kv_num_local_prefix_hits", "Remote-prefilled requests served by the "
                                   "local prefix cache without a transfer", labels, registry=registry)
        for metric in (self.transfers, self.bytes, self.expired, self.prefix_hits):
            metric.labels(model_name)
        self._seen: dict[str, float] = {}

    def _advance(self, key: str, counter: Counter, value: float, *labels: str) -> None:
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            counter.labels(self.model_name, *labels).inc(delta)
            self._seen[key] = value

    def sync(self) -> None:
        """Add what the counters gained since the last scrape."""
        c = self.counters
        self._advance("transfers", self.transfers, c.num_transfers)
        self._advance("bytes", self.bytes, c.num_bytes)
        self._advance("expired", self.expired, c.num_expired_leases)
        self._advance("prefix_hits", self.prefix_hits, c.num_prefix_hits)
        for cause, count in list(c.failures.items()):
            self._advance(f"failure:{cause}", self.failures, count, cause)
        while c.seconds:
            self.seconds.labels(self.model_name).observe(c.seconds.popleft())
