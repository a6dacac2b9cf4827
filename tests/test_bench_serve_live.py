"""`twophase bench serve` against a live `twophase serve` on a tiny model: vLLM's keys, totals = server counters."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("twophase.server.app", reason="twophase.server is not built yet")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from twophase.cli import main as twophase_main  # noqa: E402

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 32, 8
VLLM_KEYS = {
    "date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
    "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
}  # fmt: skip


def _model_path() -> str:
    """TWOPHASE_DEFAULT_MODEL, else the store's SmolLM2-135M-Instruct; skip when neither is on disk."""
    from twophase.loader import resolve

    path = os.environ.get("TWOPHASE_DEFAULT_MODEL") or str(resolve("smollm2-135m-instruct") or "")
    if not path or not Path(path).exists():
        pytest.skip("no tiny model on disk (set TWOPHASE_DEFAULT_MODEL or run `twophase pull`)")
    return path


def _free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """A `twophase serve` subprocess on a free port; yields its base URL once /health answers."""
    model, port = _model_path(), _free_port()
    command = [sys.executable, "-m", "twophase.cli", "serve", "--model", model, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            output = process.stdout.read() if process.poll() is not None else "(still starting)"
            pytest.fail(f"twophase serve did not become healthy:\n{output[-2000:]}")
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def token_counters(base_url: str) -> dict[str, float]:
    """The server's prompt and generation token counters (summed over label sets)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    totals = {"vllm:prompt_tokens_total": 0.0, "vllm:generation_tokens_total": 0.0}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


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
