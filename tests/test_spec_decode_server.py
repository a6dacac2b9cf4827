"""Speculative decoding behind the API and the CLI: `twophase serve --speculative-config` with the real openai
client (greedy text equal to the offline engine without speculation, vLLM's spec_decode metrics, timings), and
`twophase generate --speculative-config` (summary line; bad JSON is a one-line error)."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from server_harness import MODEL_NAME, ServerProcess, wait_idle, write_server_model
from tiny_models import TRAINING_TEXT
from twophase import LLM, SamplingParams

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_server_model(tmp_path_factory.mktemp("spec-serve-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess(model_dir, "--speculative-config", SPEC, "--dtype", "float32")
    yield proc
    assert proc.stop() == 0, proc.logs()


def test_served_greedy_text_metrics_and_timings(server, model_dir):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    reference = LLM(str(model_dir), dtype="float32", progress=False, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = wait_idle(server.base_url)
    for prompt in PROMPTS:
        expected = reference.generate([prompt], params)[0].text
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert out.choices[0].text == expected and out.usage.completion_tokens == 24
        timings = out.model_extra["timings"]
        assert timings["draft_n"] > 0 and 0 <= timings["draft_accepted_n"] <= timings["draft_n"]
        stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected
    after = wait_idle(server.base_url)

    def delta(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    drafts, proposed = delta("vllm:spec_decode_num_drafts_total"), delta("vllm:spec_decode_num_draft_tokens_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and proposed >= drafts and 0 <= accepted <= proposed
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))
               for i in range(3) if ("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),)) in after]  # fmt: skip
    assert sum(per_pos) == accepted
    assert delta("vllm:generation_tokens_total") == 4 * 24


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twophase.cli", *args], capture_output=True, text=True, timeout=180)


def test_cli_generate_with_speculation(model_dir):
    base = ["generate", "--model", str(model_dir), "--temperature", "0", "--max-tokens", "12", "--raw",
            "--dtype", "float32", TRAINING_TEXT]  # fmt: skip  (many distinct tokens: ngram proposals happen)
    plain, spec = run_cli(*base), run_cli(*base, "--speculative-config", SPEC)
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout  # the same text
    summary = [line for line in spec.stderr.splitlines() if line.startswith("[prompt")]
    assert len(summary) == 1 and "spec acceptance" in summary[0] and "mean accepted length" in summary[0]
    bad = run_cli(*base, "--speculative-config", '{"method": "ngram"}')
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["twophase: error: num_speculative_tokens must be an integer in [1, 32]"]
