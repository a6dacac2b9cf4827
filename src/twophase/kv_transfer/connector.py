"""The engine's KV connector: ties the scheduler half, the worker half and a transport to one ``LLMEngine``.

Threads. The engine's loop thread alone mutates the scheduler, the block manager and the cache tensors; the
transport thread (prefill side) and the fetch pool (decode side) reach them only by posting a function to the
loop (``attach(post)``, e.g. ``AsyncLLM.call_in_loop``) and, for reads, waiting on its result.

Messages (JSON header + one frame): ``hello`` {spec, transport, placement} → {ok, spec, transport, placement,
via}; ``read`` {request_id, first_block, num_blocks, digest, spec, transport, placement, via} → {ok, via, nbytes,
...} + payload (``payload``: over tcp the blocks' bytes, and the lease is released as the copy completes; over
cuda-ipc a CUDA IPC handle in the header, and the lease — with the staging tensor — lasts until ``read_done``);
``read_done`` / ``release`` {request_id} → {ok, released}.

Transport choice (``--kv-transport``, see ``placement``): both sides run ``choose_transport`` on both settings
and placements, the prefill side in its answer to hello and again on each read, the decode side on the hello
answer; a pair that cannot agree is refused at the handshake.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from twophase.config import KVTransferConfig
from twophase.kv_transfer.payload import CODECS, PayloadCodec, gpu_uuid, visible_gpus
from twophase.kv_transfer.placement import Placement, Side, check_local, choose_transport
from twophase.kv_transfer.scheduler_connector import RemoteLoad, SchedulerConnector
from twophase.kv_transfer.spec import KVSpec, KVTransferError, RemoteHandle, model_digest
from twophase.kv_transfer.transport import KVTransport, ZmqTransport
from twophase.kv_transfer.worker_connector import WorkerConnector
from twophase.outputs import RequestOutput
from twophase.request import RequestStatus

if TYPE_CHECKING:
    from twophase.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
FAULT_ENV = "TWOPHASE_KV_FAULT"  # test-only fault injection on the prefill side: exit_on_read | delay_read:<s>
Post = Callable[[Callable[["LLMEngine"], None]], None]


def engine_spec(engine: "LLMEngine") -> KVSpec:
    """The handshake spec of an engine's KV cache."""
    mc = engine.model_config
    cache_dtype = engine.model_runner.cache_dtype
    return KVSpec(model_digest(mc), str(cache_dtype).removeprefix("torch."), engine.config.cache.block_size,
                  mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers)


def local_placement(device: torch.device) -> Placement:
    """This process's placement for a KV cache on ``device`` (with its GPU's UUID on CUDA)."""
    if device.type != "cuda":
        return Placement.local(device.type)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return Placement.local("cuda", gpu_uuid(index), visible_gpus())


@dataclass
class Arrival:
    """A read's payload on the decode side, waiting for the loop thread to write it into the cache."""

    handle: RemoteHandle
    values: torch.Tensor | None  # [L, 2, n*bs, H, D]; cuda-ipc: the prefill worker's memory, dropped after the copy
    num_bytes: int
    via: str  # tcp | cuda-ipc


class KVConnector:
    """One engine's side of P/D disaggregation: serves reads of leased blocks (prefill role) and fetches remote
    blocks for waiting requests (decode role)."""

    def __init__(self, config: KVTransferConfig, engine: "LLMEngine", transport: KVTransport | None = None) -> None:
        self.config = config
        self.role = config.role
        self.spec = engine_spec(engine)
        self.scheduler_side = SchedulerConnector(engine.scheduler.block_manager, config.lease_timeout_s,
                                                 clock=engine.scheduler.clock)
        self.worker = WorkerConnector(engine.model_runner.kv_caches, self.spec)
        self.placement = local_placement(self.worker.device)
        check_local(config.transport, self.placement.device)
        self.codecs: dict[str, PayloadCodec] = {name: codec() for name, codec in CODECS.items()}
        self.transport = transport or ZmqTransport()
        self.port: int | None = None
        self._post: Post | None = None
        self._done: queue.SimpleQueue[tuple[str, Arrival | KVTransferError]] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="twophase-kv-fetch")
        self.peers: dict[tuple[str, int], str] = {}  # decode side: prefill workers that passed the handshake → via
        self._stop = threading.Event()

    # ---- lifecycle -------------------------------------------------------------------------------
    def attach(self, post: Post) -> None:
        """Start serving: ``post(fn)`` must run ``fn(engine)`` on the engine's loop thread and wake it."""
        self._post = post
        if self.role == "prefill":
            self.port = self.transport.listen(self.config.host, self.config.port, self._handle)
            threading.Thread(target=self._sweep_leases, name="twophase-kv-lease", daemon=True).start()
            log.info("KV transfer: serving leased blocks on %s:%d", self.config.host, self.port)

    def close(self) -> None:
        """Stop the transport, the sweeper and the fetch pool."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()

    def _sweep_leases(self) -> None:
        while not self._stop.wait(0.05):
            deadline = self.scheduler_side.next_deadline
            if deadline is not None and self.scheduler_side.clock() >= deadline and self._post is not None:
                try:
                    self.call(self.scheduler_side.expire).result(timeout=60)
                except Exception:  # noqa: BLE001 — a dead or stuck loop must not end the sweeper
                    log.exception("lease sweep failed")

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the loop thread; its result (or exception) arrives on the returned future."""
        future: Future = Future()

        def run(_engine: "LLMEngine") -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 — delivered to the waiting thread
                future.set_exception(exc)

        assert self._post is not None, "attach() first"
        self._post(run)
        return future

    # ---- both sides: the transport choice -----------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What a message tells the peer for the transport choice: this worker's setting and placement."""
        return {"transport": self.config.transport, "placement": self.placement.to_json()}

    def negotiate(self, peer: dict[str, Any]) -> str:
        """The transport (tcp | cuda-ipc) for the peer that sent ``peer`` (a message carrying ``identity()``;
        an older peer without it counts as tcp-only). KVTransferError (cause handshake) when none fits."""
        other = "decode" if self.role == "prefill" else "prefill"
        me = Side(f"the {self.role} worker", self.config.transport, self.placement)
        them = Side(f"the {other} worker", str(peer.get("transport") or "auto"),
                    Placement.from_json(peer.get("placement")))
        try:
            return choose_transport(me, them)
        except ValueError as exc:
            raise KVTransferError(f"KV handshake refused: {exc}", "handshake") from exc

    # ---- prefill side: answering the transport (transport thread) --------------------------------
    def _handle(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        kind = header.get("kind")
        if kind in ("release", "read_done"):
            released = self.call(lambda: self.scheduler_side.release(str(header["request_id"]))).result(60)
            return {"ok": True, "released": released}, b""
        mismatch = self.spec.mismatch(KVSpec.from_json(header.get("spec") or {}))
        if mismatch is not None:
            return {"ok": False, "cause": "handshake", "error": f"KV handshake refused: {mismatch}"}, b""
        if kind == "hello":
            return self._hello(header), b""
        if kind != "read":
            return {"ok": False, "cause": "protocol", "error": f"unknown message kind {kind!r}"}, b""
        self._inject_fault()
        try:
            via = self.negotiate(header)
            if header.get("via", "tcp") != via:
                raise KVTransferError(f"KV handshake refused: a {header.get('via')} read, but this pair uses {via}",
                                      "handshake")
            return self.call(lambda: self._read(header, via)).result(timeout=self.config.transfer_timeout_s)
        except LookupError as exc:
            return {"ok": False, "cause": "lease", "error": str(exc)}, b""
        except KVTransferError as exc:
            return {"ok": False, "cause": exc.cause, "error": str(exc)}, b""

    def _hello(self, header: dict[str, Any]) -> dict[str, Any]:
        reply = {"ok": True, "spec": self.spec.to_json(), **self.identity()}
        try:
            reply["via"] = self.negotiate(header)
        except KVTransferError as exc:
            reply.update(ok=False, cause=exc.cause, error=str(exc))
        return reply

    def _read(self, header: dict[str, Any], via: str) -> tuple[dict[str, Any], bytes]:
        """Loop thread: copy the leased blocks out in ``via``'s payload form; over tcp free them now (read
        done), over cuda-ipc keep them and the staging copy under the lease until the reader's read_done."""
        request_id = str(header["request_id"])
        block_ids = self.scheduler_side.lease_for_read(request_id, int(header["first_block"]),
                                                       int(header["num_blocks"]), str(header["digest"]))
        codec = self.codecs[via]
        values = self.worker.gather(block_ids)  # [L, 2, n*bs, H, D] on the cache's device
        fields, frame = codec.encode(values)
        if codec.holds_source:
            self.scheduler_side.hold(request_id, values)
        else:
            self.scheduler_side.release(request_id)
        self.scheduler_side.count_transfer(int(fields["nbytes"]), via)
        return {"ok": True, "via": via, **fields}, frame

    def _inject_fault(self) -> None:
        fault = os.environ.get(FAULT_ENV, "")
        if fault == "exit_on_read":
            log.error("fault injection: prefill server exits mid-transfer")
            os._exit(1)
        if fault.startswith("delay_read:"):
            time.sleep(float(fault.split(":", 1)[1]))

    def handle_for(self, request_id: str, num_prompt_tokens: int) -> dict[str, Any]:
        """The ``kv_transfer_params`` a prefill response carries: where a decode engine reads the blocks."""
        return {"remote_host": self.config.advertised_host, "remote_port": self.port,
                "remote_request_id": request_id, "num_prompt_tokens": num_prompt_tokens,
                "lease_timeout_s": self.config.lease_timeout_s}

    # ---- decode side: fetching (loop thread starts, pool threads fetch) --------------------------
    def start_loads(self) -> None:
        """Hand this step's new loads and releases to the fetch pool (loop thread, after ``schedule``)."""
        for load in self.scheduler_side.pending_loads():
            self._pool.submit(self._fetch, load)
        while self.scheduler_side.releases:
            self._pool.submit(self.release_remote, self.scheduler_side.releases.pop())

    def _fetch(self, load: RemoteLoad) -> None:
        request_id = load.request.request_id
        try:
            result: Arrival | KVTransferError = self._read_remote(load)
        except KVTransferError as exc:
            result = exc
            self.release_remote(load.handle)
        except Exception as exc:  # noqa: BLE001 — any failure fails the request, never the loop
            result = KVTransferError(f"KV transfer failed: {exc!r}", "error")
            self.release_remote(load.handle)
        self._done.put((request_id, result))
        if self._post is not None:
            self._post(lambda _engine: None)  # wake the loop

    def _read_remote(self, load: RemoteLoad) -> Arrival:
        handle, timeout = load.handle, self.config.transfer_timeout_s
        via = self._handshake(handle.host, handle.port)
        header = {"kind": "read", "request_id": handle.request_id, "first_block": load.first_block,
                  "num_blocks": len(load.block_ids), "digest": load.token_digest, "spec": self.spec.to_json(),
                  "via": via, **self.identity()}
        reply, frame = self.transport.request(handle.host, handle.port, header, timeout)
        if not reply.get("ok"):
            raise KVTransferError(f"prefill worker refused the read: {reply.get('error')}",
                                  reply.get("cause", "remote"))
        if reply.get("via", "tcp") != via:
            raise KVTransferError(f"asked for a {via} payload, got {reply.get('via')!r}", "protocol")
        shape = self.worker.payload_shape(len(load.block_ids))  # [L, 2, n*bs, H, D]
        values = self.codecs[via].decode(reply, frame, shape, self.worker.dtype)
        return Arrival(handle, values, values.numel() * values.element_size(), via)

    def _handshake(self, host: str, port: int) -> str:
        """Check a prefill worker once (spec and transport); returns the transport this pair uses."""
        if (host, port) in self.peers:
            return self.peers[(host, port)]
        hello = {"kind": "hello", "spec": self.spec.to_json(), **self.identity()}
        reply, _ = self.transport.request(host, port, hello, self.config.transfer_timeout_s)
        if reply.get("spec") is None:  # refused before it described itself (a spec mismatch)
            raise KVTransferError(str(reply.get("error")), reply.get("cause", "handshake"))
        mismatch = self.spec.mismatch(KVSpec.from_json(reply["spec"]))
        if mismatch is not None:
            raise KVTransferError(f"KV handshake refused: {mismatch}", "handshake")
        via = self.negotiate(reply)  # refuses in this worker's words when the pair cannot agree
        if not reply.get("ok"):
            raise KVTransferError(str(reply.get("error")), reply.get("cause", "handshake"))
        if reply.get("via", "tcp") != via:
            raise KVTransferError(f"KV handshake refused: the prefill worker chose {reply.get('via')!r}, this worker "
                                  f"{via!r}", "handshake")
        self.peers[(host, port)] = via
        return via

    def release_remote(self, handle: RemoteHandle, kind: str = "release") -> None:
        """Best effort: tell a prefill worker this engine will not read a lease, or (``kind`` read_done) has
        finished copying a cuda-ipc payload; the lease expires anyway."""
        try:
            self.transport.request(handle.host, handle.port, {"kind": kind, "request_id": handle.request_id},
                                   min(2.0, self.config.transfer_timeout_s))
        except KVTransferError as exc:
            log.info("%s of %s not delivered: %s", kind, handle.request_id, exc)

    def apply_finished(self, engine: "LLMEngine") -> list[RequestOutput]:
        """Loop thread, before ``schedule``: write arrived blocks and resume their requests; fail the requests
        whose transfer failed (their outputs carry ``error``)."""
        outputs = []
        while True:
            try:
                request_id, result = self._done.get_nowait()
            except queue.Empty:
                return outputs
            load = self.scheduler_side.loading.get(request_id)
            if isinstance(result, Arrival):
                result = self._write(load, result)
            if load is None:
                continue  # aborted while the transfer ran; its blocks are already free
            if isinstance(result, Arrival):
                engine.scheduler.resume(self.scheduler_side.finish_load(request_id, result.num_bytes, result.via))
            else:
                outputs.append(self._fail(engine, request_id, result))

    def _write(self, load: RemoteLoad | None, arrival: Arrival) -> Arrival | KVTransferError:
        """Copy an arrival into its blocks (none when the request is gone), drop the payload, and send
        read_done when the prefill worker holds its source for us."""
        try:
            if load is not None:
                self.worker.scatter(load.block_ids, arrival.values)
            return arrival
        except Exception as exc:  # noqa: BLE001 — a failed copy fails this request only
            return KVTransferError(f"writing the received KV blocks failed: {exc!r}", "error")
        finally:
            arrival.values = None  # unmaps a cuda-ipc payload before its owner may free it
            if self.codecs[arrival.via].holds_source and not self._stop.is_set():
                self._pool.submit(self.release_remote, arrival.handle, "read_done")

    def _fail(self, engine: "LLMEngine", request_id: str, exc: KVTransferError) -> RequestOutput:
        log.warning("KV transfer for %s failed (%s): %s", request_id, exc.cause, exc)
        self.scheduler_side.count_failure(exc.cause)
        request = engine.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        output = engine.output_processor.abort(request)
        output.error = str(exc)
        return output
