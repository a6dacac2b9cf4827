"""Prefill/decode disaggregation end to end: real `twophase serve --kv-role` and `twophase proxy` processes on free
ports, the real openai client, a tiny float32 model.

The colocated reference runs with the prefill server's step budget (32 tokens: the prompts are chunked), so both
compute the same chunks; the decode server reads the prompt's full blocks and recomputes the tail (at most one
block, always the last prompt token).
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import openai
import pytest

from pd_harness import Process, kv_state, wait_clean
from server_harness import MODEL_NAME, scrape, write_server_model

BUDGET = ("--max-num-batched-tokens", "32")
LEASE_S = 3.0
TRANSFER_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """colocated, prefill, decode, a prefill that dies on its first read; proxies in front of (prefill, decode), (dying prefill, decode), and the colocated server as a replica."""
    model = write_server_model(tmp_path_factory.mktemp("pd-model"))
    prefill_args = ("--kv-role", "prefill", "--kv-lease-timeout", str(LEASE_S), *BUDGET)
    procs = {
        "colocated": Process.serve(model, *BUDGET),
        "prefill": Process.serve(model, *prefill_args),
        "decode": Process.serve(model, "--kv-role", "decode", "--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S), *BUDGET),
        "dying": Process.serve(model, *prefill_args, env={"TWOPHASE_KV_FAULT": "exit_on_read"}),
    }
    try:
        for proc in procs.values():
            proc.wait_healthy()
        procs["proxy"] = Process.proxy("--prefill", procs["prefill"].base_url, "--decode", procs["decode"].base_url)
        procs["dying_proxy"] = Process.proxy("--prefill", procs["dying"].base_url, "--decode", procs["decode"].base_url)
        procs["router"] = Process.proxy("--replica", procs["colocated"].base_url)
        for name in ("proxy", "dying_proxy", "router"):
            procs[name].wait_healthy()
        yield procs
    finally:
        for proc in reversed(list(procs.values())):  # proxies first: their keep-alive connections close
            proc.stop()


def _client(proc: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _prompt(length: int, salt: int) -> list[int]:
    """Distinct token-id prompts (ids 3.. avoid the tiny tokenizer's specials)."""
    return [3 + (i * 37 + salt * 101) % 390 for i in range(length)]


def _complete(proc: Process, prompt, **kwargs):
    return _client(proc).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                            logprobs=1, **kwargs)


def _assert_same(reference, candidate) -> None:
    ref, got = reference.choices[0], candidate.choices[0]
    assert got.text == ref.text and got.logprobs.tokens == ref.logprobs.tokens
    assert got.finish_reason == ref.finish_reason
    # The same tokens; logprobs within float32 rounding. The two sides compute a prompt in different pieces (the
    # decode server only the tail; chunks and prefix-cache hits differ), and a piece of one row takes the one-row
    # kernel, whose summation order is its own (not batch-invariant without --deterministic): a full run saw
    # 1.1e-5 on a logprob near -2.2.
    for a, b in zip(ref.logprobs.token_logprobs, got.logprobs.token_logprobs, strict=True):
        assert abs(a - b) <= 1e-4, (ref.logprobs.token_logprobs, got.logprobs.token_logprobs)


def _assert_clean(*procs: Process) -> None:
    for proc in procs:
        wait_clean(proc)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 300])
def test_proxy_output_equals_colocated(servers, length):
    prompt = _prompt(length, salt=length)
    reference = _complete(servers["colocated"], prompt)
    before = kv_state(servers["decode"])
    got = _complete(servers["proxy"], prompt)
    _assert_same(reference, got)
    after = kv_state(servers["decode"])
    assert after["num_transfers"] - before["num_transfers"] == (1 if (length - 1) // 16 else 0)
    timings = got.model_extra["timings"]
    assert timings["remote_prefill_ms"] > 0
    assert (timings.get("kv_transfer_ms") is not None) == (length > 16)
    _assert_clean(servers["prefill"], servers["decode"])


def test_repeated_prompt_served_by_decode_prefix_cache(servers):
    prompt = _prompt(200, salt=7)
    reference = _complete(servers["colocated"], prompt)
    _assert_same(reference, _complete(servers["proxy"], prompt))
    before = kv_state(servers["decode"])
    again = _complete(servers["proxy"], prompt)
    _assert_same(reference, again)
    after = kv_state(servers["decode"])
    assert after["num_transfers"] == before["num_transfers"]  # no transfer: the decode side's prefix cache
    assert after["num_prefix_hits"] == before["num_prefix_hits"] + 1
    assert again.usage.prompt_tokens_details.cached_tokens == 192
    _assert_clean(servers["prefill"], servers["decode"])


def test_stream_and_chat_through_proxy(servers):
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 4}]
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    reference = _client(servers["colocated"]).chat.completions.create(**kwargs)
    full = _client(servers["proxy"]).chat.completions.create(**kwargs)
    assert full.choices[0].message.content == reference.choices[0].message.content
    chunks = list(_client(servers["proxy"]).chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.choices[0].message.content
    _assert_clean(servers["prefill"], servers["decode"])


def test_metrics_and_records_show_the_transfer(servers):
    _complete(servers["proxy"], _prompt(100, salt=11))
    metrics = scrape(servers["decode"].base_url)
    assert metrics[("vllm:kv_num_transfers_total", ())] >= 1
    assert metrics[("vllm:kv_bytes_transferred_total", ())] > 0
    assert metrics[("vllm:kv_xfer_time_seconds_count", ())] >= 1
    records = httpx.get(f"{servers['decode'].base_url}/v1/records").json()["requests"]
    row = [r for r in records if r["kv_transfer_bytes"]][-1]
    assert row["kv_transfer_start"] <= row["kv_transfer_end"] <= row["scheduled"][0]["time"]
    assert row["metrics"]["kv_transfer_time"] > 0 and row["metrics"]["remote_prefill_time"] > 0
    assert scrape(servers["prefill"].base_url)[("vllm:kv_num_transfers_total", ())] >= 1


def test_replica_router(servers):
    prompt = _prompt(40, salt=3)
    _assert_same(_complete(servers["colocated"], prompt), _complete(servers["router"], prompt))


# ---- failures: each leaves both sides clean, and the next request succeeds --------------------------------


def _prefill_leg(proc: Process, prompt: list[int]) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    resp = httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def _decode_leg(decode: Process, prompt: list[int], handle: dict) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "kv_transfer_params": handle}
    return httpx.post(f"{decode.base_url}/v1/completions", json=body, timeout=60)


# Salts for the follow-up requests: one fresh prompt each, never the prefix of a test's own prompt. Salts equal
# modulo 390 make the same prompt, so these stay clear of the fixed salts (< 100, and 300). A time-based salt could
# land on one (3 in 997 a call): test_read_with_other_tokens_is_refused failed once that way, its decode server
# holding the "other" prompt's blocks already and so reading nothing.
_FOLLOW_UP_SALTS = itertools.count(100)


def _next_request_succeeds(servers) -> None:
    prompt = _prompt(50, salt=next(_FOLLOW_UP_SALTS))
    _assert_same(_complete(servers["colocated"], prompt), _complete(servers["proxy"], prompt))
    _assert_clean(servers["prefill"], servers["decode"])


def test_lease_expiry_frees_blocks_and_a_late_read_fails(servers):
    prefill, decode = servers["prefill"], servers["decode"]
    prompt = _prompt(64, salt=21)
    handle = _prefill_leg(prefill, prompt)
    assert kv_state(prefill)["num_leases"] == 1
    time.sleep(LEASE_S + 0.5)
    state = wait_clean(prefill)  # the sweep freed the blocks, unread
    assert state["num_expired_leases"] >= 1
    resp = _decode_leg(decode, prompt, handle)
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["code"] == "kv_transfer_failed" and "no lease" in error["message"]
    _assert_clean(prefill, decode)
    _next_request_succeeds(servers)


def test_read_with_other_tokens_is_refused(servers):
    prefill, decode = servers["prefill"], servers["decode"]
    handle = _prefill_leg(prefill, _prompt(64, salt=22))
    resp = _decode_leg(decode, _prompt(64, salt=23), handle)  # not the prompt the blocks hold
    assert resp.status_code == 502 and "different prompt" in resp.json()["error"]["message"]
    _assert_clean(prefill, decode)  # the failed read's release freed the lease


def test_prefill_death_mid_transfer(servers):
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        _complete(servers["dying_proxy"], _prompt(80, salt=31))
    assert info.value.status_code == 502 and info.value.body["code"] == "kv_transfer_failed"
    assert time.monotonic() - start < TRANSFER_TIMEOUT_S + 10
    servers["dying"].proc.wait(10)
    assert servers["dying"].proc.returncode == 1
    _assert_clean(servers["decode"])
    time.sleep(1.0)  # the proxy's health check notices the dead prefill server
    with pytest.raises(openai.APIStatusError) as info:  # its only prefill server is gone: 503, no leg sent
        _complete(servers["dying_proxy"], _prompt(20, salt=32))
    assert info.value.status_code == 503 and "no healthy prefill server" in info.value.message
    _next_request_succeeds(servers)


def test_decode_rejection_releases_the_lease(servers):
    prompt = _prompt(100, salt=41)
    with pytest.raises(openai.BadRequestError) as info:  # the prefill leg (max_tokens=1) passes; decode refuses
        _client(servers["proxy"]).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5000)
    assert "context length" in info.value.message
    _assert_clean(servers["prefill"], servers["decode"])
    _next_request_succeeds(servers)


def test_client_disconnect_aborts_both_legs(servers):
    prompt = _prompt(120, salt=51)
    stream = _client(servers["proxy"]).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=900,
                                                          temperature=0, stream=True, extra_body={"ignore_eos": True})
    for index, _chunk in enumerate(stream):
        if index == 2:
            break
    stream.close()
    _assert_clean(servers["prefill"], servers["decode"])
    records = httpx.get(f"{servers['decode'].base_url}/v1/records").json()["requests"]
    assert records[-1]["finish_reason"] == "abort" and records[-1]["num_prompt_tokens"] == 120
    _next_request_succeeds(servers)


def test_bad_kv_transfer_params(servers):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"remote_host": "x"}}
    resp = httpx.post(f"{servers['decode'].base_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params"
    body["kv_transfer_params"] = {"do_remote_decode": True}
    resp = httpx.post(f"{servers['colocated'].base_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params"  # colocated: refused
    body["stream"] = True
    resp = httpx.post(f"{servers['prefill'].base_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"
    body.update(stream=False, n=2)
    resp = httpx.post(f"{servers['prefill'].base_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and "n=1" in resp.json()["error"]["message"]
    assert kv_state(servers["prefill"])["num_leases"] == 0  # refused before anything was queued
