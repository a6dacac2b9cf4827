"""`twophase bench serve` against a live `twophase serve` on a tiny model: vLLM's keys, totals = server counters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import ServerProcess, scrape, write_server_model

from twophase.cli import main as twophase_main

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 32, 8
VLLM_KEYS = {
    "date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
    "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """A real `twophase serve` subprocess on the tiny model; yields its base URL."""
    process = ServerProcess(write_server_model(tmp_path_factory.mktemp("bench-serve-model")))
    try:
        yield process.base_url
    finally:
        process.stop()


def token_counters(base_url: str) -> dict[str, float]:
    """The server's prompt and generation token counters."""
    samples = scrape(base_url)
    return {name: samples.get((name, ()), 0.0) for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")}


def test_bench_serve_matches_server_counters(server: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    before = token_counters(server)
    argv = ["bench", "serve", "--base-url", server, "--num-prompts", str(NUM_PROMPTS),
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--max-concurrency", "3",
            "--ready-check-timeout-sec", "0", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(tmp_path), "--result-filename", "result.json", "--goodput", "ttft:60000"]
    assert twophase_main(argv) == 0
    after = token_counters(server)
    result = json.loads((tmp_path / "result.json").read_text())
    assert VLLM_KEYS <= set(result)
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["total_input_tokens"] == after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert result["total_output_tokens"] == generated == NUM_PROMPTS * OUTPUT_LEN  # random ⇒ ignore_eos
    assert all(abs(n - INPUT_LEN) <= 1 for n in result["input_lens"])  # via the server's /tokenize; ±1 for a BOS
    console = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in console
    assert "Goodput & SLO Attainment" in console
