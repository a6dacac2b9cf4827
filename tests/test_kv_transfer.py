"""KV transfer below HTTP: the scheduler-side connector with hand-made requests (no torch, exact block ids, a
fake clock), then prefill and decode engines in this process joined by the real TCP transport."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import weakref

import pytest
import torch

from twophase.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from twophase.kv_cache.block_manager import BlockManager
from twophase.kv_transfer.payload import PayloadCodec
from twophase.kv_transfer.scheduler_connector import SchedulerConnector
from twophase.kv_transfer.spec import KVTransferError, RemoteHandle, token_digest
from twophase.request import Request, RequestStatus
from twophase.sampling_params import SamplingParams

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _request(request_id: str, num_tokens: int, **kv) -> Request:
    request = Request(request_id, list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=4))
    request.kv_transfer_params = kv or None
    return request


def _connector(num_blocks: int = 16) -> tuple[SchedulerConnector, BlockManager, Clock]:
    clock = Clock()
    bm = BlockManager(num_blocks, BS)
    return SchedulerConnector(bm, lease_timeout_s=5.0, clock=clock), bm, clock


def test_lease_holds_blocks_until_read_then_frees():
    conn, bm, _ = _connector()
    request = _request("a", 10, do_remote_decode=True)
    assert bm.allocate_slots(request, 10)
    assert conn.on_finish(request, RequestStatus.FINISHED_LENGTH)
    assert conn.leases["a"].block_ids == [0, 1, 2] and bm.num_blocks_in_use == 3
    bm.check_invariants(live_request_ids={"a"})
    digest = token_digest(request.prompt_token_ids[:8])
    assert conn.lease_for_read("a", 0, 2, digest) == [0, 1]
    with pytest.raises(LookupError, match="different prompt"):
        conn.lease_for_read("a", 0, 2, token_digest([1] * 8))
    with pytest.raises(LookupError, match="outside"):
        conn.lease_for_read("a", 0, 3, digest)  # block 2 is not full: never read
    assert conn.release("a") and not conn.release("a")  # idempotent
    assert bm.num_blocks_in_use == 0
    bm.check_invariants(live_request_ids=set())


def test_lease_expiry_frees_and_a_late_read_fails_before_the_sweep():
    conn, bm, clock = _connector()
    request = _request("a", 9, do_remote_decode=True)
    bm.allocate_slots(request, 9)
    conn.on_finish(request, RequestStatus.FINISHED_STOPPED)
    clock.now += 5.0  # deadline reached; no sweep ran yet
    with pytest.raises(LookupError, match="expired"):
        conn.lease_for_read("a", 0, 2, token_digest(request.prompt_token_ids[:8]))
    assert not conn.leases and bm.num_blocks_in_use == 0  # the refused read freed the blocks
    other = _request("b", 9, do_remote_decode=True)
    bm.allocate_slots(other, 9)
    conn.on_finish(other, RequestStatus.FINISHED_LENGTH)
    assert conn.expire() == [] and conn.next_deadline == clock.now + 5.0
    clock.now += 6.0
    assert conn.expire() == ["b"] and bm.num_blocks_in_use == 0 and conn.counters.num_expired_leases == 2


def test_abort_and_plain_requests_are_never_leased():
    conn, bm, _ = _connector()
    aborted = _request("a", 9, do_remote_decode=True)
    plain = _request("b", 9)
    assert not conn.on_finish(aborted, RequestStatus.FINISHED_ABORTED)
    assert not conn.on_finish(plain, RequestStatus.FINISHED_LENGTH)
    assert not conn.leases


def test_start_load_allocates_full_blocks_uncached_then_caches_them():
    conn, bm, clock = _connector()
    request = _request("d", 11)
    request.remote_handle = RemoteHandle("127.0.0.1", 1, "p-0", 11)
    assert conn.start_load(request) == "load"
    load = conn.loading["d"]
    assert (load.first_block, load.block_ids) == (0, [0, 1])  # (11 - 1) // 4 = 2 full blocks; the tail is local
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not bm.pool.cached_blocks  # no prefix hit on blocks whose K/V have not arrived
    assert conn.pending_loads() == [load] and conn.pending_loads() == []
    clock.now += 0.25
    assert conn.finish_load("d", 1234) is request
    assert request.num_computed_tokens == 8 and len(bm.pool.cached_blocks) == 2
    assert request.timeline.kv_transfer_end - request.timeline.kv_transfer_start == 0.25
    # the same prompt again: the local prefix cache covers every full block, so no transfer
    again = _request("e", 11)
    again.remote_handle = RemoteHandle("127.0.0.1", 1, "p-1", 11)
    assert conn.start_load(again) == "local" and conn.counters.num_prefix_hits == 1
    assert [h.request_id for h in conn.releases] == ["p-1"]  # the unread lease is released at once


def test_start_load_blocked_when_the_pool_is_short():
    conn, bm, _ = _connector(num_blocks=1)
    request = _request("d", 11)
    request.remote_handle = RemoteHandle("127.0.0.1", 1, "p-0", 11)
    assert conn.start_load(request) == "blocked"
    assert request.remote_handle is not None and request.num_computed_tokens == 0 and bm.num_blocks_in_use == 0


# ---- engines in this process, real TCP transport ----------------------------------------------------------


def _engine_config(model_dir, role: str, transport: str = "auto", **cache) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), dtype="float32", linear_backend="torch", attention_backend="torch", num_threads=1,
        cache=CacheConfig(block_size=cache.get("block_size", 16), num_blocks=256, cache_dtype=cache.get("cache_dtype", "auto")),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_model_len=1024),
        kv_transfer=KVTransferConfig(role=role, lease_timeout_s=30.0, transfer_timeout_s=5.0, transport=transport),
    )


def _start_engines(model_dir, names_roles, prepare=None) -> dict:
    """AsyncLLMs by name; ``prepare(name, connector)`` may adjust a connector before it starts serving."""
    from twophase.engine.async_engine import AsyncLLM
    from twophase.engine.llm_engine import LLMEngine

    llms = {}
    for name, role, cache in names_roles:
        llm = AsyncLLM(LLMEngine(_engine_config(model_dir, role, **cache), progress=False))
        if llm.engine.kv_connector is not None and prepare is not None:
            prepare(name, llm.engine.kv_connector)
        if llm.engine.kv_connector is not None:
            llm.engine.kv_connector.attach(llm.call_in_loop)
        llm.start()
        llms[name] = llm
    return llms


def _stop_engines(llms: dict) -> None:
    for llm in llms.values():
        llm.shutdown()
        if llm.engine.kv_connector is not None:
            llm.engine.kv_connector.close()


TRIO = (("colocated", "both", {}), ("prefill", "prefill", {}), ("decode", "decode", {}))


@pytest.fixture(scope="module")
def server_model(tmp_path_factory):
    from server_harness import write_server_model

    return write_server_model(tmp_path_factory.mktemp("kvx-model"))


@pytest.fixture(scope="module")
def engines(server_model):
    llms = _start_engines(server_model, (*TRIO, ("decode32", "decode", {"block_size": 32})))
    yield llms
    _stop_engines(llms)


@pytest.fixture(scope="module")
def int8_engines(server_model):
    llms = _start_engines(server_model, tuple((name, role, {"cache_dtype": "int8"}) for name, role, _ in TRIO))
    yield llms
    _stop_engines(llms)


@pytest.fixture(scope="module")
def default_engines(default_model):
    llms = _start_engines(default_model, TRIO)
    yield llms
    _stop_engines(llms)


async def _run(llm, prompt, params, request_id, kv_params=None, handle=None):
    request = llm.make_request(prompt, params, request_id)
    request.kv_transfer_params = kv_params
    request.remote_handle = handle
    outputs = [o async for o in llm.stream_outputs(request_id, llm.submit(request, detokenize=False))]
    return outputs[-1]


async def _disaggregated(engines, prompt, params, request_id, decode="decode"):
    prefill = engines["prefill"]
    first = await _run(prefill, prompt, dataclasses.replace(params, max_tokens=1), f"{request_id}-p",
                       {"do_remote_decode": True})
    assert first.error is None
    params_out = prefill.engine.kv_connector.handle_for(f"{request_id}-p", len(prompt))
    return await _run(engines[decode], prompt, params, request_id, handle=RemoteHandle.from_params(params_out))


def _invariants(llm) -> None:
    async def check():
        future = llm.engine.kv_connector.call(llm.engine.scheduler.check_invariants)
        await asyncio.wrap_future(future)
    asyncio.run(check())


def _wait_no_leases(llm, timeout: float = 5.0) -> None:
    """A decode side's release / read_done reaches the prefill side asynchronously."""
    deadline = time.monotonic() + timeout
    while llm.engine.kv_connector.scheduler_side.leases and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not llm.engine.kv_connector.scheduler_side.leases


def _check_parity(engines, length: int, max_token_id: int) -> None:
    prompt = [3 + (i * 53 + length * 7) % (max_token_id - 3) for i in range(length)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    reference = asyncio.run(_run(engines["colocated"], prompt, params, f"c{length}"))
    got = asyncio.run(_disaggregated(engines, prompt, params, f"d{length}"))
    assert got.error is None and got.token_ids == reference.token_ids
    for a, b in zip(reference.logprobs, got.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) <= 1e-5 and [t for t, _ in a.top] == [t for t, _ in b.top]
    assert (got.timeline.kv_transfer_bytes > 0) == (length > 16)
    _wait_no_leases(engines["prefill"])
    for name in ("prefill", "decode"):
        _invariants(engines[name])
        assert not engines[name].engine.kv_connector.scheduler_side.leases
        assert engines[name].engine.scheduler.block_manager.num_blocks_in_use == 0


@pytest.mark.parametrize("length", [1, 15, 16, 17, 300])
def test_disaggregated_engines_equal_colocated(engines, length):
    _check_parity(engines, length, 390)


@pytest.mark.parametrize("length", [17, 300])
def test_disaggregated_int8_cache_equals_colocated(int8_engines, length):
    """An int8 KV cache's blocks travel with their rows' scales (``[.., D + 4]`` rows): the same tokens and logprobs."""
    assert int8_engines["decode"].engine.model_runner.kv_caches[0][0].dtype == torch.int8
    _check_parity(int8_engines, length, 390)


@pytest.mark.slow
@pytest.mark.parametrize("length", [1, 15, 16, 17, 300])
def test_disaggregated_default_model_equals_colocated(default_engines, length):
    _check_parity(default_engines, length, 40000)


def test_mismatched_block_size_refused_at_handshake(engines):
    prompt = [3 + i % 300 for i in range(70)]
    params = SamplingParams(temperature=0, max_tokens=3)
    got = asyncio.run(_disaggregated(engines, prompt, params, "mm", decode="decode32"))
    assert got.finished and got.error is not None
    assert "handshake refused" in got.error and "block_size" in got.error
    side = engines["decode32"].engine.kv_connector.scheduler_side
    assert side.counters.failures == {"handshake": 1}
    _invariants(engines["decode32"])
    assert engines["decode32"].engine.scheduler.block_manager.num_blocks_in_use == 0
    for _ in range(100):  # the decode side's release reaches the prefill side
        if not engines["prefill"].engine.kv_connector.scheduler_side.leases:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not engines["prefill"].engine.kv_connector.scheduler_side.leases
    _invariants(engines["prefill"])


def test_gantt_segments_show_remote_prefill_and_transfer():
    from twophase.report.plots import request_segments
    from twophase.report.report import RequestRecord
    from twophase.request import RequestTimeline, ScheduledEvent

    tl = RequestTimeline(arrival_time=10.0, token_times=[10.5, 10.6], finish_time=10.6, remote_prefill_time=0.5,
                         kv_transfer_start=10.1, kv_transfer_end=10.3)
    tl.scheduled = [ScheduledEvent(10.4, 5, True, 10.5), ScheduledEvent(10.5, 1, False, 10.6)]
    segs = request_segments(RequestRecord("r", tl), t0=9.0)
    rounded = {k: [(round(a, 6), round(b, 6)) for a, b in v] for k, v in segs.items()}
    assert rounded == {"remote_prefill": [(0.5, 0.5)], "queue": [(1.0, 0.1)], "transfer": [(1.1, 0.2)],
                       "waiting": [(1.3, 0.1)], "prefill": [(1.4, 0.1)], "decode": [(1.5, 0.1)]}


# ---- the cuda-ipc flow on CPU: a stand-in codec shares tensors inside this process --------------------------

SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # "IPC handle" → the prefill side's tensor


class InProcessIpcCodec(PayloadCodec):
    """CudaIpcCodec's stand-in on CPU: the handle names the prefill side's staging tensor and the reader gets
    that very tensor, as CUDA IPC maps the producer's memory. Only weak references here: a reader that comes
    after the prefill side dropped the staging tensor finds nothing."""

    holds_source = True

    def __init__(self) -> None:
        self.fail_next = False

    def encode(self, values: torch.Tensor) -> tuple[dict, bytes]:
        SHARED[str(id(values))] = values
        return {"nbytes": values.numel() * values.element_size(), "ipc": {"key": str(id(values))}}, b""

    def decode(self, header: dict, frame: bytes, shape, dtype: torch.dtype) -> torch.Tensor:
        values = SHARED.get(header["ipc"]["key"])
        if self.fail_next or values is None:
            self.fail_next = False
            raise KVTransferError("could not open the CUDA IPC handle: stand-in failure", "ipc")
        assert tuple(values.shape) == tuple(shape) and values.dtype == dtype and frame == b""
        return values


def _recording(handle, messages: list):
    def wrapped(header: dict):
        reply, frame = handle(header)
        messages.append((header["kind"], reply))
        return reply, frame
    return wrapped


@pytest.fixture(scope="module")
def ipc_engines(engines, server_model):
    """prefill and decode engines (CPU) that take their caches for CUDA on one host and share payloads with
    InProcessIpcCodec; "strict" is a decode engine set to --kv-transport cuda-ipc. The prefill side records
    every message it answers in ``messages``."""
    messages: list = []

    def prepare(name: str, connector) -> None:
        connector.placement = dataclasses.replace(connector.placement, device="cuda", gpu="gpu-0",
                                                  visible_gpus=("gpu-0",))
        connector.codecs["cuda-ipc"] = InProcessIpcCodec()
        if name == "strict":
            connector.config = dataclasses.replace(connector.config, transport="cuda-ipc")
        if name == "prefill":
            connector._handle = _recording(connector._handle, messages)

    own = _start_engines(server_model, (("prefill", "prefill", {}), ("decode", "decode", {}),
                                        ("strict", "decode", {})), prepare)
    yield {**own, "colocated": engines["colocated"], "cpu_prefill": engines["prefill"], "messages": messages}
    _stop_engines(own)


def _clean(*llms) -> None:
    for llm in llms:
        _invariants(llm)
        assert llm.engine.scheduler.block_manager.num_blocks_in_use == 0


def test_cuda_ipc_flow_holds_the_staging_until_read_done(ipc_engines):
    messages = ipc_engines["messages"]
    messages.clear()
    _check_parity(ipc_engines, 40, 390)  # auto on both sides, both "on CUDA on one host": cuda-ipc
    deadline = time.monotonic() + 5
    while len(messages) < 3 and time.monotonic() < deadline:  # the read_done answer is recorded after it frees
        time.sleep(0.02)
    assert [kind for kind, _ in messages] == ["hello", "read", "read_done"]
    hello, read, done = (reply for _, reply in messages)
    assert hello["via"] == read["via"] == "cuda-ipc" and "ipc" in read and read["nbytes"] > 0
    assert done == {"ok": True, "released": True}  # the lease, and its staging tensor, lasted until read_done
    for name in ("prefill", "decode"):
        counters = ipc_engines[name].engine.kv_connector.scheduler_side.counters
        assert counters.by_transport == {"cuda-ipc": 1} and counters.num_bytes == read["nbytes"]
    assert not SHARED  # nobody holds the staging tensor any more


def test_cuda_ipc_open_failure_fails_the_request_and_frees_the_lease(ipc_engines):
    ipc_engines["decode"].engine.kv_connector.codecs["cuda-ipc"].fail_next = True
    prompt = [3 + (i * 31) % 380 for i in range(50)]
    got = asyncio.run(_disaggregated(ipc_engines, prompt, SamplingParams(temperature=0, max_tokens=3), "ipcfail"))
    assert got.finished and "could not open the CUDA IPC handle" in got.error
    assert ipc_engines["decode"].engine.kv_connector.scheduler_side.counters.failures == {"ipc": 1}
    _wait_no_leases(ipc_engines["prefill"])
    _clean(ipc_engines["prefill"], ipc_engines["decode"])


def test_cuda_ipc_refused_at_handshake_when_the_prefill_side_is_on_cpu(ipc_engines):
    pair = {"prefill": ipc_engines["cpu_prefill"], "strict": ipc_engines["strict"]}
    prompt = [3 + (i * 29) % 380 for i in range(50)]
    got = asyncio.run(_disaggregated(pair, prompt, SamplingParams(temperature=0, max_tokens=3), "strict",
                                     decode="strict"))
    assert got.finished and got.error.startswith("KV handshake refused: --kv-transport cuda-ipc needs both KV "
                                                 "caches on CUDA on one host")
    assert "the prefill worker's KV cache is on cpu, not CUDA" in got.error
    assert ipc_engines["strict"].engine.kv_connector.scheduler_side.counters.failures == {"handshake": 1}
    _wait_no_leases(pair["prefill"])
    _clean(pair["prefill"], pair["strict"])


def test_prefill_side_refuses_cuda_ipc_off_host_or_off_cuda(ipc_engines):
    gpu = ipc_engines["prefill"].engine.kv_connector
    elsewhere = dataclasses.replace(gpu.placement, hostname=gpu.placement.hostname + "-other").to_json()
    hello = {"kind": "hello", "spec": gpu.spec.to_json(), "transport": "cuda-ipc", "placement": elsewhere}
    reply, _ = gpu._handle(hello)
    assert not reply["ok"] and reply["cause"] == "handshake" and "are not on one host (host names" in reply["error"]
    reply, _ = gpu._handle({**hello, "transport": "auto"})
    assert reply["ok"] and reply["via"] == "tcp"  # auto falls back to tcp across hosts
    cpu = ipc_engines["cpu_prefill"].engine.kv_connector
    read = {"kind": "read", "request_id": "none", "first_block": 0, "num_blocks": 1, "digest": "0",
            "spec": cpu.spec.to_json(), "via": "cuda-ipc", "transport": "cuda-ipc",
            "placement": gpu.placement.to_json()}
    reply, frame = cpu._handle(read)
    assert not reply["ok"] and "the prefill worker's KV cache is on cpu, not CUDA" in reply["error"] and frame == b""


def test_cuda_ipc_setting_refused_at_start_up_on_cpu(server_model):
    from twophase.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="--kv-transport cuda-ipc needs the KV cache on CUDA"):
        LLMEngine(_engine_config(server_model, "decode", transport="cuda-ipc"), progress=False)
