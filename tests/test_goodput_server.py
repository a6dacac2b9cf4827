"""Live goodput counters on a real server equal the attainment bench serve's metric code computes from the same
run's /v1/records (aborted requests count as missed)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server_harness import MODEL_NAME, ServerProcess, wait_idle, write_server_model
from twophase.bench.datasets import SampleRequest
from twophase.bench.metrics import attainment, meets_slos
from twophase.bench.serve import LoadConfig, benchmark
from twophase.metrics.goodput import timeline_record
from twophase.metrics.records import timeline_from_json

SLOS = {"ttft": 60.0, "tpot": 8.0, "e2el": 300.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(write_server_model(tmp_path_factory.mktemp("goodput-model")), "--max-num-seqs", "8",
                         "--slo-ttft-ms", "60", "--slo-tpot-ms", "8", "--slo-e2el-ms", "300")  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.logs()


def test_goodput_counters_equal_bench_attainment_from_records(server):
    requests = [SampleRequest("the quick brown fox " * (1 + i % 5), 0, 4 + 3 * i) for i in range(14)]
    config = LoadConfig(api_url=f"{server.base_url}/v1/completions", model=MODEL_NAME, request_rate=40.0,
                        ignore_eos=True, ready_check=False, goodput=SLOS, disable_tqdm=True)  # fmt: skip
    result = asyncio.run(benchmark(config, requests))
    assert result["completed"] == 14
    body = {"model": MODEL_NAME, "prompt": "abort me", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as response:
        next(response.iter_lines())  # one chunk, then hang up: the server aborts the request
    metrics = wait_idle(server.base_url)
    rows = httpx.get(f"{server.base_url}/v1/records").json()["requests"]
    assert len(rows) == 15 and sum(r["finish_reason"] == "abort" for r in rows) == 1
    records = [timeline_record(timeline_from_json(r), r["num_prompt_tokens"]) for r in rows]
    expected = attainment(records, SLOS)
    assert metrics[("twophase:slo_requests_total", ())] == 15
    for objective in [*SLOS, "all"]:
        met = metrics[("twophase:slo_requests_met_total", (("objective", objective),))]
        assert met == round(expected[objective] * 15), objective
    good_tokens = sum(r.output_len for r in records if meets_slos(r, SLOS))
    assert metrics[("twophase:goodput_output_tokens_total", ())] == good_tokens
    assert metrics[("twophase:slo_requests_met_total", (("objective", "all"),))] <= 14  # the aborted one missed
    assert metrics[("twophase:step_token_budget_count", ())] > 0
    assert ("twophase:step_time_actual_over_predicted_count", ()) not in metrics  # fixed budget: no predictions
