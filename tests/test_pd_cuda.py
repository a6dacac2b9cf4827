"""Prefill/decode disaggregation on CUDA (marked gpu: skipped by default and without CUDA): real `twophase serve
--device cuda --kv-role ...` and `twophase proxy` processes on one host, the real openai client, a tiny float32
model. The prefill and decode servers choose CUDA IPC on their own (``--kv-transport auto``): greedy output
through the proxy equals a colocated CUDA server's, the transfers go over cuda-ipc, and both servers end clean
(the prefill side's staging tensors and leases are freed on read_done). A tcp decode server on CUDA and a
cuda-ipc one facing a CPU prefill server (refused at the handshake) complete the picture.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from pd_harness import Process, kv_state, wait_clean
from server_harness import MODEL_NAME, scrape, write_server_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = ("--device", "cuda")
BUDGET = ("--max-num-batched-tokens", "32")
LOGPROB_TOLERANCE = 1e-4  # float32 on CUDA: the tail is computed in another batch shape than the colocated run


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """colocated (cuda), prefill (cuda, auto), decode (cuda, auto), decode_tcp (cuda, tcp), cpu_prefill (cpu) and
    strict (cuda, cuda-ipc); proxies over (prefill, decode), (prefill, decode_tcp) and (cpu_prefill, strict)."""
    model = write_server_model(tmp_path_factory.mktemp("pd-cuda-model"))
    procs = {
        "colocated": Process.serve(model, *CUDA, *BUDGET),
        "prefill": Process.serve(model, *CUDA, "--kv-role", "prefill", *BUDGET),
        "decode": Process.serve(model, *CUDA, "--kv-role", "decode", *BUDGET),
        "decode_tcp": Process.serve(model, *CUDA, "--kv-role", "decode", "--kv-transport", "tcp", *BUDGET),
        "cpu_prefill": Process.serve(model, "--kv-role", "prefill", *BUDGET),
        "strict": Process.serve(model, *CUDA, "--kv-role", "decode", "--kv-transport", "cuda-ipc", *BUDGET),
    }
    try:
        for proc in procs.values():
            proc.wait_healthy()
        pairs = {"proxy": ("prefill", "decode"), "proxy_tcp": ("prefill", "decode_tcp"),
                 "proxy_refused": ("cpu_prefill", "strict")}
        for name, (prefill, decode) in pairs.items():
            procs[name] = Process.proxy("--prefill", procs[prefill].base_url, "--decode", procs[decode].base_url)
        for name in pairs:
            procs[name].wait_healthy()
        yield procs
    finally:
        for proc in reversed(list(procs.values())):  # proxies first
            proc.stop()


def _complete(proc: Process, prompt: list[int]):
    client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)


def _prompt(length: int, salt: int) -> list[int]:
    return [3 + (i * 37 + salt * 101) % 390 for i in range(length)]


def _assert_same(reference, candidate) -> None:
    ref, got = reference.choices[0], candidate.choices[0]
    assert got.logprobs.tokens == ref.logprobs.tokens and got.text == ref.text
    for a, b in zip(ref.logprobs.token_logprobs, got.logprobs.token_logprobs, strict=True):
        assert abs(a - b) <= LOGPROB_TOLERANCE, (ref.logprobs.token_logprobs, got.logprobs.token_logprobs)


def _transfers(server: Process, via: str) -> int:
    return kv_state(server)["transfers_by_transport"].get(via, 0)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 300])
def test_cuda_ipc_output_equals_colocated(servers, length):
    prompt = _prompt(length, salt=length)
    before = _transfers(servers["decode"], "cuda-ipc")
    _assert_same(_complete(servers["colocated"], prompt), _complete(servers["proxy"], prompt))
    assert _transfers(servers["decode"], "cuda-ipc") - before == (1 if (length - 1) // 16 else 0)
    state = wait_clean(servers["prefill"])  # read_done freed the lease and its staging tensor
    assert "tcp" not in state["transfers_by_transport"]
    decode = wait_clean(servers["decode"])
    assert "tcp" not in decode["transfers_by_transport"]
    if length > 16:
        assert set(decode["peers"].values()) == {"cuda-ipc"}  # auto on both sides chose cuda-ipc


def test_tcp_on_cuda_equals_colocated_and_metrics_count_both_paths(servers):
    prompt = _prompt(300, salt=5)
    _assert_same(_complete(servers["colocated"], prompt), _complete(servers["proxy_tcp"], prompt))
    assert kv_state(servers["decode_tcp"])["transfers_by_transport"] == {"tcp": 1}
    assert list(kv_state(servers["decode_tcp"])["peers"].values()) == ["tcp"]
    for name in ("decode", "decode_tcp"):
        metrics = scrape(servers[name].base_url)
        assert metrics[("vllm:kv_bytes_transferred_total", ())] > 0
        assert metrics[("vllm:kv_xfer_time_seconds_count", ())] >= 1
    assert kv_state(servers["prefill"])["transfers_by_transport"]["tcp"] == 1
    wait_clean(servers["prefill"])
    wait_clean(servers["decode_tcp"])


def test_cuda_ipc_refused_against_a_cpu_prefill_server(servers):
    body = {"model": MODEL_NAME, "prompt": _prompt(64, salt=9), "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{servers['proxy_refused'].base_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["code"] == "kv_transfer_failed" and "KV handshake refused" in error["message"]
    assert "the prefill worker's KV cache is on cpu, not CUDA" in error["message"]
    assert kv_state(servers["strict"])["failures"] == {"handshake": 1}
    wait_clean(servers["cpu_prefill"])
    wait_clean(servers["strict"])
