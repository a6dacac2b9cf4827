"""`bench serve` pieces without a server: metric formulas, arrivals, workloads, the client's SSE parsing, output."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from twophase.bench import datasets
from twophase.bench.metrics import (
    RequestRecord, arrival_gaps, attainment, best_passing_point, calculate_metrics, goodput, meets_slos,
    parse_goodput, percentile, record_from_chunks, request_tpot, send_offsets,
)  # fmt: skip
from twophase.bench.serve import LoadConfig, build_result, format_result, result_json, send_request

VLLM_KEYS = {
    "date", "backend", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls",
    "generated_texts", "errors",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl")),
}  # fmt: skip


def hand_records() -> list[RequestRecord]:
    """A: 4 tokens; B: 2 tokens with a trailing finish chunk; C: 1 token; D: failed."""
    a = record_from_chunks(0.0, [0.10, 0.15, 0.25, 0.30], 0.30, prompt_len=10)
    b = record_from_chunks(1.0, [1.2, 1.4], 1.5, prompt_len=20)
    c = record_from_chunks(2.0, [2.05], None, prompt_len=30)
    d = record_from_chunks(3.0, [], None, prompt_len=40)
    return [a, b, c, d]


def test_per_request_ttft_itl_e2el_tpot() -> None:
    a, b, c, d = hand_records()
    assert a.ttft == pytest.approx(0.10) and a.latency == pytest.approx(0.30) and a.output_len == 4
    assert a.itl == pytest.approx([0.05, 0.10, 0.05])
    assert request_tpot(a) == pytest.approx(0.20 / 3)  # (E2E − TTFT)/(n − 1): the first token is excluded
    assert b.latency == pytest.approx(0.5) and request_tpot(b) == pytest.approx(0.3)  # E2E ends at the last chunk
    assert request_tpot(c) is None and not d.success and d.error


def test_aggregates_pool_itl_and_interpolate_percentiles() -> None:
    m = calculate_metrics(hand_records(), duration=2.0, percentiles=[50, 90, 99])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 7)
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(33.5)
    assert m["mean_ttft_ms"] == pytest.approx(350 / 3) and m["median_ttft_ms"] == pytest.approx(100)
    assert m["p99_ttft_ms"] == pytest.approx(198.0)  # sorted [50, 100, 200], index 1.98 → linear
    assert m["mean_tpot_ms"] == pytest.approx((200 / 3 + 300) / 2)  # C (n = 1) has no TPOT
    # ITL pooled over requests: [50, 100, 50, 200] ms, not a mean of per-request means
    assert m["mean_itl_ms"] == pytest.approx(100) and m["median_itl_ms"] == pytest.approx(75)
    assert m["p90_itl_ms"] == pytest.approx(170)
    assert m["std_itl_ms"] == pytest.approx(float(np.std([50, 100, 50, 200])))
    assert m["mean_e2el_ms"] == pytest.approx((300 + 500 + 50) / 3)
    assert percentile([1.0, 2.0, 3.0, 4.0], 25) == pytest.approx(1.75) and percentile([], 99) == 0.0


def test_goodput_and_attainment() -> None:
    records = hand_records()
    slos = parse_goodput(["ttft:150", "tpot:100"])
    assert slos == {"ttft": 150.0, "tpot": 100.0}
    assert [meets_slos(r, slos) for r in records] == [True, False, True, False]  # C: TPOT 0 for n = 1
    assert goodput(records, slos, duration=2.0) == pytest.approx(1.0)
    assert attainment(records, slos) == pytest.approx({"ttft": 0.5, "tpot": 0.5, "all": 0.5})
    m = calculate_metrics(records, 2.0, [99], slos)
    assert m["request_goodput"] == pytest.approx(1.0) and m["slo_attainment"]["all"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])
    points = [{"sweep_value": v, "slo_attainment": {"all": a}} for v, a in ((1, 1.0), (2, 0.95), (4, 0.6))]
    assert best_passing_point(points, "sweep_value", 0.9)["sweep_value"] == 2


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_arrival_gaps_mean_and_burstiness(burstiness: float) -> None:
    gaps = arrival_gaps(200_000, rate=4.0, burstiness=burstiness, rng=np.random.default_rng(0))
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.03)


def test_arrival_edge_cases() -> None:
    rng = np.random.default_rng(0)
    assert not arrival_gaps(5, float("inf"), 1.0, rng).any()
    assert arrival_gaps(3, 2.0, float("inf"), rng) == pytest.approx([0.5, 0.5, 0.5])
    assert send_offsets(arrival_gaps(10, 5.0, 1.0, rng), 5.0)[-1] == pytest.approx(2.0)  # n / rate, as in vLLM
    with pytest.raises(ValueError):
        arrival_gaps(3, 1.0, 0.0, rng)


def test_random_lengths_within_range_ratio() -> None:
    lengths = datasets.sampled_lengths(100, 0.25, 5000, np.random.default_rng(1))
    assert lengths.min() == 75 and lengths.max() == 125
    counter = datasets.WordCounter()
    requests = datasets.random_dataset(counter, 50, 40, 10, 0.5, np.random.default_rng(2))
    assert all(20 <= r.prompt_len <= 60 and 5 <= r.expected_output_len <= 15 for r in requests)
    assert all(len(counter.encode(r.prompt)) == r.prompt_len for r in requests)


def test_prefix_repetition_shares_prefixes() -> None:
    counter = datasets.WordCounter()
    requests = datasets.prefix_repetition_dataset(counter, 12, 16, 8, 3, 7, np.random.default_rng(3))
    prefixes = [" ".join(r.prompt.split()[:16]) for r in requests]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({r.prompt for r in requests}) == 12 and all(r.prompt_len == 24 for r in requests)
    assert {r.expected_output_len for r in requests} == {7}


def test_sharegpt_and_custom_files(tmp_path) -> None:
    conv = [{"conversations": [{"from": "human", "value": "tell me about " + "rivers " * i},
                               {"from": "gpt", "value": "rivers flow " * (i + 2)}]} for i in range(3, 8)]
    conv.append({"conversations": [{"from": "human", "value": "hi"}]})  # one turn: dropped
    (tmp_path / "sg.json").write_text(json.dumps(conv))
    sg = datasets.sharegpt_dataset(str(tmp_path / "sg.json"), datasets.WordCounter(), 3, np.random.default_rng(0))
    assert len(sg) == 3 and all(r.expected_output_len >= 4 for r in sg)
    (tmp_path / "c.jsonl").write_text('{"prompt": "a b c", "output_tokens": 5}\n{"prompt": "d e"}\n')
    custom = datasets.custom_dataset(str(tmp_path / "c.jsonl"), datasets.WordCounter(), 10, 9, np.random.default_rng(0))
    assert [(r.prompt_len, r.expected_output_len) for r in custom] == [(3, 5), (2, 9)]


def _sse_handler(chat: bool):
    """An httpx transport handler streaming 3 content chunks, a finish chunk and a usage + timings chunk."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert ("messages" in body) == chat and body["ignore_eos"] is True
        pieces = [{"delta": {"role": "assistant", "content": ""}}] if chat else []
        pieces += [{"delta": {"content": t}} if chat else {"text": t} for t in ("a", "b", "c")]
        lines = [{"choices": [p]} for p in pieces] + [{"choices": [{"text": "", "finish_reason": "length"}]}]
        lines.append({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3},
                      "timings": {"queue_ms": 2.0, "prefill_ms": 8.0, "ttft_ms": 10.0, "prompt_n": 11,
                                  "cached_n": 0}})  # fmt: skip
        text = "".join(f"data: {json.dumps(x)}\n\n" for x in lines) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return handler


@pytest.mark.parametrize("chat", [False, True])
def test_client_parses_stream(chat: bool) -> None:
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    config = LoadConfig(api_url="http://bench.test" + endpoint, model="m", ignore_eos=True)

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_sse_handler(chat))) as client:
            return await send_request(client, config, datasets.SampleRequest("x y", 2, 3))

    record = asyncio.run(go())
    assert record.success and record.generated_text == "abc"
    assert (record.prompt_len, record.output_len, len(record.itl)) == (11, 3, 2)  # role-only chunk is no content
    assert record.timings["prefill_ms"] == 8.0 and record.latency >= record.ttft > 0


def test_result_has_vllm_keys_and_console_block() -> None:
    config = LoadConfig(api_url="http://x/v1/completions", model="m", max_concurrency=4, goodput={"ttft": 150.0})
    records = hand_records()
    records[0].timings = {"queue_ms": 1.0, "prefill_ms": 3.0, "ttft_ms": 4.0, "prompt_n": 10, "cached_n": 5}
    result = build_result(config, records, 2.0)
    meta = {"backend": "openai", "endpoint_type": "openai", "label": None, "model_id": "m", "tokenizer_id": "m",
            "num_prompts": 4, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 4}
    saved = result_json(meta, result, save_detailed=True)
    assert VLLM_KEYS <= set(saved) and "mean_e2el_ms" not in saved  # e2el only when selected
    assert json.loads(json.dumps(saved))["completed"] == 3
    assert not {"ttfts", "itls", "input_lens"} & set(result_json(meta, result, save_detailed=False))
    text = format_result(result, config)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     3         "
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "Mean TTFT (ms):                          116.67    " in lines
    assert lines.index("=" * 50) < lines.index("Mean server prefill (ms):                3.00      ")
    assert "Cached prompt tokens (%):                50.00     " in lines


def test_sampling_flags_reach_every_request_body() -> None:
    """--temperature / --top-p / --top-k / --min-p travel in each request (vLLM's bench serve flags);
    --extra-body wins where both name a field; without them the body stays greedy."""
    import argparse

    from twophase.bench.cli import add_serve_arguments, load_config
    from twophase.bench.serve import build_payload

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    request = datasets.SampleRequest(prompt="hi", prompt_len=1, expected_output_len=4)
    args = parser.parse_args(["--temperature", "0.8", "--top-p", "0.95", "--top-k", "40", "--min-p", "0.05",
                              "--extra-body", '{"top_k": 20}'])
    body = build_payload(load_config(args, "http://x", "m"), request)
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.8, 0.95, 20, 0.05)
    greedy = build_payload(load_config(parser.parse_args([]), "http://x", "m"), request)
    assert greedy["temperature"] == 0.0 and not {"top_p", "top_k", "min_p"} & set(greedy)
