"""The KV transport choice (tcp | cuda-ipc) and the payload forms, on CPU: the negotiation and its refusals, the
JSON form of torch's CUDA IPC handle, and the lease that keeps a cuda-ipc staging tensor alive until read_done.
The CUDA IPC data path itself runs in tests/test_pd_cuda.py (marked gpu)."""

from __future__ import annotations

import base64
import dataclasses
import gc
import weakref

import pytest
import torch

from twophase.kv_cache.block_manager import BlockManager
from twophase.kv_transfer.payload import BytesCodec, CudaIpcCodec, ipc_args_from_json, ipc_args_to_json
from twophase.kv_transfer.placement import Placement, Side, check_local, choose_transport
from twophase.kv_transfer.scheduler_connector import SchedulerConnector
from twophase.kv_transfer.spec import KVTransferError, token_digest
from twophase.request import Request, RequestStatus
from twophase.sampling_params import SamplingParams

GPU_HERE = Placement("node-a", "boot-1", "pid:[1]", "cuda", "gpu-0", ("gpu-0", "gpu-1"))
SHAPE = (2, 2, 8, 3, 4)  # [L, 2, n*bs, H, D]


def _side(name: str, setting: str, placement: Placement = GPU_HERE, **changes) -> Side:
    return Side(name, setting, dataclasses.replace(placement, **changes))


# ---- the choice ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mine,theirs,changes,expected", [
    ("auto", "auto", {}, "cuda-ipc"),
    ("auto", "cuda-ipc", {}, "cuda-ipc"),
    ("tcp", "auto", {}, "tcp"),
    ("auto", "auto", {"device": "cpu"}, "tcp"),
    ("auto", "auto", {"hostname": "node-b"}, "tcp"),
    ("auto", "auto", {"boot_id": "boot-2"}, "tcp"),
    ("auto", "auto", {"pid_namespace": "pid:[2]"}, "tcp"),
    ("auto", "auto", {"boot_id": ""}, "tcp"),
    ("auto", "auto", {"gpu": "gpu-1"}, "cuda-ipc"),  # another GPU both processes see
    ("auto", "auto", {"gpu": "gpu-1", "visible_gpus": ("gpu-1",)}, "tcp"),  # pinned with CUDA_VISIBLE_DEVICES
    ("auto", "auto", {"gpu": ""}, "tcp"),
    ("tcp", "tcp", {"device": "cpu"}, "tcp"),
])
def test_choose_transport(mine, theirs, changes, expected):
    a, b = _side("the prefill worker", mine), _side("the decode worker", theirs, **changes)
    assert choose_transport(a, b) == expected == choose_transport(b, a)  # both sides agree


@pytest.mark.parametrize("changes,words", [
    ({"device": "cpu"}, "the decode worker's KV cache is on cpu, not CUDA"),
    ({"hostname": "node-b"}, "are not on one host (host names"),
    ({"boot_id": "boot-2"}, "different boot ids"),
    ({"pid_namespace": "pid:[2]"}, "different PID namespaces"),
    ({"boot_id": ""}, "boot id of one of them is unknown"),
    ({"gpu": "gpu-1", "visible_gpus": ("gpu-1",)}, "GPU is not visible to the decode worker (CUDA_VISIBLE_DEVICES)"),
])
def test_cuda_ipc_refused_off_cuda_or_off_host(changes, words):
    prefill, decode = _side("the prefill worker", "cuda-ipc"), _side("the decode worker", "auto", **changes)
    for a, b in ((prefill, decode), (decode, prefill)):
        with pytest.raises(ValueError, match="cuda-ipc needs both KV caches on CUDA on one host") as info:
            choose_transport(a, b)
        assert words in str(info.value)


def test_conflicting_settings_refused():
    with pytest.raises(ValueError, match="conflicting transports: --kv-transport tcp on the prefill worker, "
                                         "cuda-ipc on the decode worker"):
        choose_transport(_side("the prefill worker", "tcp"), _side("the decode worker", "cuda-ipc"))
    with pytest.raises(ValueError, match="unknown KV transport 'nixl'"):
        choose_transport(_side("a", "nixl"), _side("b", "auto"))


def test_an_older_peer_without_placement_gets_tcp_or_a_refusal():
    unknown = Placement.from_json(None)
    assert unknown == Placement("", "", "", "") == Placement.from_json({"device": None, "visible_gpus": "x"})
    assert Placement.from_json(GPU_HERE.to_json()) == GPU_HERE
    assert choose_transport(_side("a", "auto"), Side("b", "auto", unknown)) == "tcp"
    with pytest.raises(ValueError, match="unknown device"):
        choose_transport(_side("a", "cuda-ipc"), Side("b", "auto", unknown))


def test_local_placement_and_start_up_check():
    here = Placement.local("cpu")
    assert here.hostname and here.device == "cpu"
    assert Placement.from_json(here.to_json()) == here
    assert here.other_host(here) is None or not here.boot_id  # same process: same host wherever /proc exists
    check_local("auto", "cpu")
    check_local("cuda-ipc", "cuda")
    with pytest.raises(ValueError, match="cuda-ipc needs the KV cache on CUDA"):
        check_local("cuda-ipc", "cpu")
    with pytest.raises(ValueError, match="unknown KV transport"):
        check_local("nixl", "cuda")


# ---- payload forms ------------------------------------------------------------------------------------------


def test_bytes_codec_round_trip_and_size_check():
    values = torch.randn(SHAPE)  # [L, 2, n*bs, H, D]
    codec = BytesCodec()
    fields, frame = codec.encode(values)
    assert fields == {"nbytes": values.numel() * 4} and not codec.holds_source
    assert torch.equal(codec.decode(fields, frame, SHAPE, torch.float32), values)
    with pytest.raises(KVTransferError, match="expected") as info:
        codec.decode(fields, frame[:-4], SHAPE, torch.float32)
    assert info.value.cause == "size_mismatch"


def _fake_ipc_args(size=SHAPE, stride=None, dtype=torch.float32, storage_size=None) -> tuple:
    numel = 1
    for dim in size:
        numel *= dim
    stride = stride or torch.empty(size).stride()
    return (torch.Tensor, torch.Size(size), stride, 0, torch.storage.TypedStorage, dtype, 0, b"\x01mem-handle",
            storage_size if storage_size is not None else numel * dtype.itemsize, 512, False, b"/torch_1_2_3", 7,
            b"\x02event", True)


def test_ipc_handle_json_round_trip():
    args = _fake_ipc_args()
    data = ipc_args_to_json(args)
    assert all(not isinstance(v, bytes) for v in data.values())  # JSON-safe: no pickle crosses the wire
    assert ipc_args_from_json(data, SHAPE, torch.float32) == args
    no_event = (*args[:13], None, False)
    assert ipc_args_from_json(ipc_args_to_json(no_event), SHAPE, torch.float32) == no_event


@pytest.mark.parametrize("args,message", [
    (_fake_ipc_args(dtype=torch.float16), "expected torch.float32"),
    (_fake_ipc_args(size=(2, 2, 16, 3, 4)), "expected torch.float32 \\[2, 2, 8, 3, 4\\]"),
    (_fake_ipc_args(stride=(1, 2, 4, 32, 96)), "not a contiguous"),
    (_fake_ipc_args(storage_size=100), "overruns its storage"),
])
def test_ipc_handle_must_describe_the_expected_payload(args, message):
    with pytest.raises(KVTransferError, match=message):
        ipc_args_from_json(ipc_args_to_json(args), SHAPE, torch.float32)


def test_malformed_ipc_handles_are_refused():
    good = ipc_args_to_json(_fake_ipc_args())
    bad_counter = {**good, "ref_counter": base64.b64encode(b"/dev/shm/../etc").decode()}
    for bad in (None, {}, {**good, "handle": "not base64!"}, {**good, "dtype": "complex64"}, {**good, "handle": ""},
                bad_counter, good):  # good, but names no GPU this process sees
        with pytest.raises(KVTransferError) as info:
            CudaIpcCodec().decode({"ipc": bad}, b"", SHAPE, torch.float32)
        assert info.value.cause == "ipc"


def test_cuda_ipc_codec_refuses_a_cpu_tensor():
    with pytest.raises(KVTransferError, match="contiguous CUDA tensor"):
        CudaIpcCodec().encode(torch.zeros(SHAPE))
    assert CudaIpcCodec.holds_source


# ---- the lease holds the staging tensor ---------------------------------------------------------------------


class Staging:
    """Stands for the staging tensor (a weakref tells when the lease let it go)."""


def _leased(num_tokens: int = 9) -> tuple[SchedulerConnector, BlockManager, Request, list]:
    clock = [100.0]
    bm = BlockManager(8, 4)
    conn = SchedulerConnector(bm, lease_timeout_s=5.0, clock=lambda: clock[0])
    request = Request("a", list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=1))
    request.kv_transfer_params = {"do_remote_decode": True}
    bm.allocate_slots(request, num_tokens)
    request.status = RequestStatus.FINISHED_LENGTH
    assert conn.on_finish(request, request.status)
    return conn, bm, request, clock


def test_staging_lives_until_read_done_and_a_second_read_is_refused():
    conn, bm, request, _ = _leased()
    digest = token_digest(request.prompt_token_ids[:8])
    assert conn.lease_for_read("a", 0, 2, digest) == [0, 1]
    staging = Staging()
    conn.hold("a", staging)
    alive = weakref.ref(staging)
    del staging
    gc.collect()
    assert alive() is not None and bm.num_blocks_in_use == 3  # the reader still maps it
    with pytest.raises(LookupError, match="already read"):
        conn.lease_for_read("a", 0, 2, digest)
    conn.check_invariants()
    conn.count_transfer(123, "cuda-ipc")
    assert conn.release("a")  # read_done
    gc.collect()
    assert alive() is None and bm.num_blocks_in_use == 0 and conn.counters.by_transport == {"cuda-ipc": 1}


def test_lease_expiry_drops_the_staging_tensor():
    conn, bm, request, clock = _leased()
    conn.lease_for_read("a", 0, 2, token_digest(request.prompt_token_ids[:8]))
    staging = Staging()
    conn.hold("a", staging)
    alive = weakref.ref(staging)
    del staging
    clock[0] += 5.0
    assert conn.expire() == ["a"]
    gc.collect()
    assert alive() is None and bm.num_blocks_in_use == 0 and conn.counters.num_expired_leases == 1


def test_serve_option_reaches_the_config():
    import argparse

    from twophase.server.cli import kv_transfer_config, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--kv-role", "decode", "--kv-transport", "cuda-ipc"])
    assert kv_transfer_config(args).transport == "cuda-ipc"
    assert kv_transfer_config(parser.parse_args(["serve", "--model", "m", "--kv-role", "prefill"])).transport == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--kv-transport", "nixl"])
