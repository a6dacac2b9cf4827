"""One transport interface — request/response of a JSON header plus a byte payload — and its TCP
implementation over pyzmq (ROUTER server, one REQ socket per exchange so a lost reply never wedges a socket).

The connector gives the messages their meaning (hello, read, release); a transport only moves them, within a
timeout on every exchange.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
from typing import Any, Callable

import zmq

from twophase.kv_transfer.spec import KVTransferError

log = logging.getLogger(__name__)
Handler = Callable[[dict[str, Any]], tuple[dict[str, Any], bytes]]
POLL_MS = 100


class KVTransport(abc.ABC):
    """Serves exchanges to a handler, and makes exchanges with a remote transport."""

    @abc.abstractmethod
    def listen(self, host: str, port: int, handler: Handler) -> int:
        """Answer exchanges on (host, port) with ``handler`` on a background thread; returns the bound port
        (``port`` 0 picks a free one)."""

    @abc.abstractmethod
    def request(self, host: str, port: int, header: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], bytes]:
        """One exchange; raises KVTransferError (cause 'timeout' or 'transport') when no answer comes in time."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listening and drop every socket."""


class ZmqTransport(KVTransport):
    """TCP over pyzmq: works on CPU and across hosts."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def listen(self, host: str, port: int, handler: Handler) -> int:
        """See KVTransport.listen."""
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{host}"
        bound = socket.bind_to_random_port(address) if port == 0 else (socket.bind(f"{address}:{port}"), port)[1]
        self._thread = threading.Thread(target=self._serve, args=(socket, handler), name="twophase-kv-transport",
                                        daemon=True)
        self._thread.start()
        return bound

    def _serve(self, socket: zmq.Socket, handler: Handler) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(POLL_MS):
                    continue
                identity, empty, raw = socket.recv_multipart()[:3]
                try:
                    reply, payload = handler(json.loads(raw))
                except Exception as exc:  # noqa: BLE001 — every failure is answered, never dropped
                    log.exception("kv transport handler failed")
                    reply, payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "cause": "remote"}, b""
                socket.send_multipart([identity, empty, json.dumps(reply).encode(), payload])
        finally:
            socket.close(0)

    def request(self, host: str, port: int, header: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], bytes]:
        """See KVTransport.request."""
        socket = self.context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
        socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        try:
            socket.connect(f"tcp://{host}:{port}")
            socket.send(json.dumps(header).encode())
            raw, payload = socket.recv_multipart()
        except zmq.Again as exc:
            raise KVTransferError(f"no answer from KV transfer peer {host}:{port} in {timeout_s:g}s", "timeout") from exc
        except zmq.ZMQError as exc:
            raise KVTransferError(f"KV transfer to {host}:{port} failed: {exc}", "transport") from exc
        finally:
            socket.close(0)
        return json.loads(raw), payload

    def close(self) -> None:
        """See KVTransport.close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * POLL_MS / 1000 + 1)
        self.context.destroy(linger=0)
