"""The engine's KV connector: ties the scheduler half, the worker half and a transport to one ``LLMEngine``.

Threads. The engine's loop thread alone mutates the scheduler, the block manager and the cache tensors; the
transport thread (prefill side) and the fetch pool (decode side) reach them only by posting a function to the
loop (``attach(post)``, e.g. ``AsyncLLM.call_in_loop``) and, for reads, waiting on its result.

Messages (JSON header + bytes): ``hello`` {spec} → {ok, spec}; ``read`` {request_id, first_block,
num_blocks, digest, spec} → {ok} + blocks (the lease is released as the copy completes: a read is
"read done"); ``release`` {request_id} → {ok}.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from twophase.config import KVTransferConfig
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
    return KVSpec(model_digest(mc), str(engine.dtype).removeprefix("torch."), engine.config.cache.block_size,
                  mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers)


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
        self.transport = transport or ZmqTransport()
        self.port: int | None = None
        self._post: Post | None = None
        self._done: queue.SimpleQueue[tuple[str, bytes | KVTransferError]] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="twophase-kv-fetch")
        self._verified: set[tuple[str, int]] = set()
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

    # ---- prefill side: answering the transport (transport thread) --------------------------------
    def _handle(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        kind = header.get("kind")
        if kind == "release":
            released = self.call(lambda: self.scheduler_side.release(str(header["request_id"]))).result(60)
            return {"ok": True, "released": released}, b""
        mismatch = self.spec.mismatch(KVSpec.from_json(header.get("spec") or {}))
        if mismatch is not None:
            return {"ok": False, "cause": "handshake", "error": f"KV handshake refused: {mismatch}"}, b""
        if kind == "hello":
            return {"ok": True, "spec": self.spec.to_json()}, b""
        if kind != "read":
            return {"ok": False, "cause": "protocol", "error": f"unknown message kind {kind!r}"}, b""
        self._inject_fault()
        try:
            data = self.call(lambda: self._read(header)).result(timeout=self.config.transfer_timeout_s)
        except LookupError as exc:
            return {"ok": False, "cause": "lease", "error": str(exc)}, b""
        return {"ok": True}, data

    def _read(self, header: dict[str, Any]) -> bytes:
        """Loop thread: copy the leased blocks out and free them (read done)."""
        request_id = str(header["request_id"])
        block_ids = self.scheduler_side.lease_for_read(request_id, int(header["first_block"]),
                                                       int(header["num_blocks"]), str(header["digest"]))
        data = self.worker.copy_out(block_ids)
        self.scheduler_side.release(request_id)
        self.scheduler_side.counters.num_transfers += 1
        self.scheduler_side.counters.num_bytes += len(data)
        return data

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
            result: bytes | KVTransferError = self._read_remote(load)
        except KVTransferError as exc:
            result = exc
            self.release_remote(load.handle)
        except Exception as exc:  # noqa: BLE001 — any failure fails the request, never the loop
            result = KVTransferError(f"KV transfer failed: {exc!r}", "error")
            self.release_remote(load.handle)
        self._done.put((request_id, result))
        if self._post is not None:
            self._post(lambda _engine: None)  # wake the loop

    def _read_remote(self, load: RemoteLoad) -> bytes:
        handle, timeout = load.handle, self.config.transfer_timeout_s
        self._handshake(handle.host, handle.port)
        header = {"kind": "read", "request_id": handle.request_id, "first_block": load.first_block,
                  "num_blocks": len(load.block_ids), "digest": load.token_digest, "spec": self.spec.to_json()}
        reply, data = self.transport.request(handle.host, handle.port, header, timeout)
        if not reply.get("ok"):
            raise KVTransferError(f"prefill worker refused the read: {reply.get('error')}", reply.get("cause", "remote"))
        return data

    def _handshake(self, host: str, port: int) -> None:
        if (host, port) in self._verified:
            return
        reply, _ = self.transport.request(host, port, {"kind": "hello", "spec": self.spec.to_json()},
                                          self.config.transfer_timeout_s)
        if not reply.get("ok"):
            raise KVTransferError(str(reply.get("error")), reply.get("cause", "handshake"))
        mismatch = self.spec.mismatch(KVSpec.from_json(reply.get("spec") or {}))
        if mismatch is not None:
            raise KVTransferError(f"KV handshake refused: {mismatch}", "handshake")
        self._verified.add((host, port))

    def release_remote(self, handle: RemoteHandle) -> None:
        """Best effort: tell a prefill worker this engine will not read a lease (it expires anyway)."""
        try:
            self.transport.request(handle.host, handle.port, {"kind": "release", "request_id": handle.request_id},
                                   min(2.0, self.config.transfer_timeout_s))
        except KVTransferError as exc:
            log.info("release of %s not delivered: %s", handle.request_id, exc)

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
            if load is None:
                continue  # aborted while the transfer ran; its blocks are already free
            if isinstance(result, bytes):
                try:
                    self.worker.copy_in(load.block_ids, result)
                except KVTransferError as exc:
                    result = exc
            if isinstance(result, bytes):
                engine.scheduler.resume(self.scheduler_side.finish_load(request_id, len(result)))
            else:
                outputs.append(self._fail(engine, request_id, result))
        return outputs

    def _fail(self, engine: "LLMEngine", request_id: str, exc: KVTransferError) -> RequestOutput:
        log.warning("KV transfer for %s failed (%s): %s", request_id, exc.cause, exc)
        self.scheduler_side.count_failure(exc.cause)
        request = engine.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        output = engine.output_processor.abort(request)
        output.error = str(exc)
        return output
