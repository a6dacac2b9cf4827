"""Tensor parallelism over gloo, several processes on this machine: the sharded model equals the whole one.

float64 logits within 1e-12 of tp=1 (tp=2, and tp=4 where the 2 KV heads are replicated), greedy tokens through
the engine identical with continuous batching, chunked prefill and the prefix cache (also on the fast paths:
C++ linear / attention kernels in float32, Q8_0 weights), two hosts on loopback, a killed worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from twophase import LLM, SamplingParams
from twophase.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tiny_models import MIXED_PROMPTS
from twophase.distributed.group import TensorParallelError
from twophase.distributed.sharding import check_size, plan_shards, split, valid_sizes
from twophase.engine.llm_engine import LLMEngine
from twophase.outputs import ScheduledRequest, SchedulerOutput

PROMPTS = MIXED_PROMPTS[:6]
NUM_TOKENS = 32
SMOLLM2 = ModelConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64)


def make_engine(model, tp: int, dtype: str = "float64", quantization: str = "none", **parallel) -> LLMEngine:
    """Block size 4, 7-token budget (prompts are chunked), prefix cache on."""
    config = EngineConfig(
        model=str(model), dtype=dtype, quantization=quantization, num_threads=1,
        cache=CacheConfig(block_size=4, num_blocks=96, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=7, max_num_seqs=8),
        parallel=ParallelConfig(tensor_parallel_size=tp, **parallel),
    )  # fmt: skip
    return LLMEngine(config, progress=False)


def staggered_tokens(engine: LLMEngine) -> list[list[int]]:
    """Half the prompts, a few steps, the other half (continuous batching), then all again (prefix hits)."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    finals = {}

    def step() -> None:
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.token_ids

    ids = [engine.add_request(p, params).request_id for p in PROMPTS[:3]]
    for _ in range(5):
        step()
    ids += [engine.add_request(p, params).request_id for p in PROMPTS[3:]]
    while engine.has_unfinished_requests():
        step()
    ids += [engine.add_request(p, params).request_id for p in PROMPTS]
    while engine.has_unfinished_requests():
        step()
    assert engine.scheduler.block_manager.stats.num_hits > 0
    return [finals[i] for i in ids]


def packed_batch() -> SchedulerOutput:
    """Two prompts in one flat batch (tokens across the whole vocabulary)."""
    first = ScheduledRequest("a", [3, 399, 150, 201, 250, 7, 99, 300, 1, 42], 0, [0, 1, 2], True, True)
    second = ScheduledRequest("b", [398, 0, 101, 202, 303], 0, [3, 4], True, True)
    return SchedulerOutput(step_id=0, scheduled=[first, second])


@pytest.fixture(scope="module")
def reference_engine(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, 1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference_logits(reference_engine) -> torch.Tensor:
    """tp=1 float64 logits of ``packed_batch``, computed before any generation fills the prefix cache (the
    hand-made batch writes blocks the scheduler does not know about)."""
    return reference_engine.model_runner.forward_logits_raw(packed_batch())  # [T, vocab]


# tp=4 starts 3 worker processes (about 45 s on a loaded 2-core machine): slow
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["tp2", "tp4-kv-replicated"])
def tp_engine(request, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, request.param)
    yield engine
    engine.close()


# ---- shapes (no processes) -------------------------------------------------------------------------
def test_sizes_of_smollm2_and_refusal_names_them():
    assert valid_sizes(SMOLLM2, limit=64) == [1, 3, 9]
    with pytest.raises(ConfigError, match=r"sizes that work: 1, 3, 9"):
        check_size(SMOLLM2, 2)
    plans = [plan_shards(SMOLLM2, r, 9) for r in range(9)]
    assert [p.kv_heads.start for p in plans] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # each KV head on 3 ranks
    assert sum(p.intermediate.count for p in plans) == 1536
    assert all(p.intermediate.count % 32 == 0 for p in plans)  # quantization blocks never cut
    assert [(s.start, s.count) for s in split(10, 3)] == [(0, 4), (4, 3), (7, 3)]


def test_unsplittable_size_refused_at_start_up(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 .*sizes that work: 1, 2, 4"):
        make_engine(tiny_llama_dir, 3)


# ---- the sharded model equals the whole one --------------------------------------------------------
def test_float64_logits_equal_tp1(reference_logits, tp_engine):
    expected = reference_logits
    got = tp_engine.model_runner.forward_logits_raw(packed_batch())
    assert got.dtype == torch.float64 and got.shape == expected.shape == (15, 400)
    assert (got - expected).abs().max().item() < 1e-12
    assert tp_engine.model_runner.kv_caches[0][0].shape[1] == 1  # this rank holds only its KV head
    assert tp_engine.tp.stats.num_all_reduces > 0


def test_engine_greedy_tokens_equal_tp1(reference_engine, tp_engine):
    assert staggered_tokens(tp_engine) == staggered_tokens(reference_engine)


def test_qwen2_biases_split_with_their_rows(tiny_qwen2_dir):
    reference = make_engine(tiny_qwen2_dir, 1)
    engine = make_engine(tiny_qwen2_dir, 2)
    try:
        diff = engine.model_runner.forward_logits_raw(packed_batch()) - reference.model_runner.forward_logits_raw(packed_batch())
        assert diff.abs().max().item() < 1e-12
    finally:
        engine.close()


@pytest.mark.parametrize("quantization", ["none", "q8_0"])
def test_fast_paths_float32_tokens_equal_tp1(tiny_llama_dir, quantization):
    """C++ linear and attention kernels in float32, and Q8_0 shards packed like the full weights. Q8_0 from 3 rows
    on the int8 GEMM (AVX512-VNNI): each rank's row-parallel half sums its blocks in one float32 chain, then the
    all-reduce adds the halves, another order than one chain over all blocks, so the logits agree within float32
    rounding and the greedy tokens of this random model may part at a near tie; without it, tokens are equal."""
    reference = make_engine(tiny_llama_dir, 1, dtype="float32", quantization=quantization)
    engine = make_engine(tiny_llama_dir, 2, dtype="float32", quantization=quantization)
    try:
        ours = engine.model_runner.forward_logits_raw(packed_batch())
        expected = reference.model_runner.forward_logits_raw(packed_batch())
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        int8_gemm = any(getattr(m, "int8_gemm", None) is not None for m in reference.model_runner.model.modules())
        if not int8_gemm:
            assert staggered_tokens(engine) == staggered_tokens(reference)
        assert "plain torch" not in engine.model_runner.describe() or "plain torch" in reference.model_runner.describe()
    finally:
        engine.close()


# ---- bench phases --tp ----------------------------------------------------------------------------
def _bench_phases(tmp_path, model, *options: str) -> dict:
    from twophase.cli import main

    out = tmp_path / "phases.json"
    argv = ["bench", "phases", "--model", str(model), "--dtype", "float32", "-p", "8", "-n", "4", "-b", "2",
            "-r", "2", "--threads", "1", "--output-json", str(out), *options]  # fmt: skip
    assert main(argv) == 0
    return json.loads(out.read_text())


def _phase_rows(result: dict) -> list[dict]:
    return result["results"] + [b[k] for b in result["batched"] for k in ("prefill", "decode")]


def test_bench_phases_on_two_ranks(tiny_llama_dir, tmp_path, capsys):
    single = _bench_phases(tmp_path, tiny_llama_dir)
    sharded = _bench_phases(tmp_path, tiny_llama_dir, "--tp", "2")
    assert "tensor parallel: 2 ranks (gloo, threads per rank: 1)" in capsys.readouterr().out
    assert (single["tensor_parallel_size"], sharded["tensor_parallel_size"]) == (1, 2)
    assert [r["name"] for r in _phase_rows(sharded)] == ["pp8", "tg4", "pp8 b2", "tg4 b2"]
    for one, two in zip(_phase_rows(single), _phase_rows(sharded), strict=True):
        assert (one["name"], one["flops"], one["bytes"]) == (two["name"], two["flops"], two["bytes"])
        assert one["all_reduces_per_step"] is None and len(two["seconds"]) == 2 and two["tokens_per_s_mean"] > 0
        assert two["all_reduces_per_step"] == 2 * 2 + 1  # o_proj and down_proj in each of 2 layers, the embedding
        step_ms = 1000 * two["seconds_mean"] / (1 if two["kind"] == "prefill" else two["tokens_per_seq"])
        assert 0 < two["all_reduce_ms_per_step"] < step_ms


def test_bench_phases_refuses_an_unsplittable_size(tiny_llama_dir, tmp_path, capsys):
    from twophase.cli import main

    assert main(["bench", "phases", "--model", str(tiny_llama_dir), "-p", "8", "-n", "2", "-b", "1", "--tp", "3"]) == 2
    assert "--tensor-parallel-size 3 does not fit this model" in capsys.readouterr().err
    assert main(["bench", "phases", "--config", "tiny", "-p", "8", "-n", "2", "-b", "1", "--tp", "2"]) == 2
    assert "needs --model" in capsys.readouterr().err


# ---- hosts and failures ----------------------------------------------------------------------------
@pytest.mark.slow  # a second process tree and a server start-up: ~45-60 s on a loaded 2-core machine
def test_two_hosts_on_loopback(tiny_llama_dir, reference_engine):
    from server_harness import free_port

    port = free_port()
    host1 = subprocess.Popen(
        [sys.executable, "-m", "twophase.cli", "generate", "unused", "--model", str(tiny_llama_dir), "--tp", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        engine = make_engine(tiny_llama_dir, 2, nnodes=2, node_rank=0, master_port=port)
        assert engine.tp.processes == []  # rank 1 lives on the other "host"
        tokens = staggered_tokens(engine)
        engine.close()
        assert host1.wait(60) == 0, host1.stdout.read()
    finally:
        if host1.poll() is None:
            host1.kill()
    assert tokens == staggered_tokens(reference_engine)


def test_killed_worker_fails_generate_with_a_clear_message(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", progress=False, tensor_parallel_size=2, timeout_s=20)
    worker = llm.engine.tp.processes[0]
    assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"worker tp-rank-1 \(pid \d+\) exited with code -9"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert time.monotonic() - start < 20
    llm.engine.close()


def test_hung_worker_stops_the_engine_after_the_timeout(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", progress=False, tensor_parallel_size=2, timeout_s=3)
    worker = llm.engine.tp.processes[0]
    os.kill(worker.pid, signal.SIGSTOP)  # alive, but answers nothing
    try:
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"timeout 3s\): a worker died or hung"):
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
        assert time.monotonic() - start < 30
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        llm.engine.close()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.slow  # a second process tree and a server start-up: ~45-60 s on a loaded 2-core machine
def test_killed_worker_makes_server_unhealthy(tiny_llama_dir):
    import httpx
    from server_harness import ServerProcess

    import openai

    server = ServerProcess(tiny_llama_dir, "--tensor-parallel-size", "2", "--tp-timeout", "20", "--threads", "1")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    try:
        served = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        assert served.usage.completion_tokens == 8
        workers = [c for c in _children(server.proc.pid) if "spawn_main" in _cmdline(c)]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "server still healthy 20 s after its worker died"
            time.sleep(0.2)
        response = httpx.get(f"{server.base_url}/health", timeout=5)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        assert failed.value.status_code in (500, 503)
    finally:
        server.stop()


@pytest.mark.slow  # loads SmolLM2-135M four times (tp=1 and three tp=3 ranks)
def test_default_model_tp3_greedy_equals_tp1(default_model):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = LLM(str(default_model), dtype="float32", progress=False, max_model_len=256)
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    llm = LLM(str(default_model), dtype="float32", progress=False, max_model_len=256, tensor_parallel_size=3)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.close()
