"""The scheduler's half of KV transfer (no torch): leases on a finished prefill's blocks and the remote loads a
decode engine waits for. Every method runs on the engine's loop thread; nothing here touches tensors.

Prefill side: a request sent with ``do_remote_decode`` keeps its blocks when it finishes, under a lease that
ends on a tcp read (the blocks are copied out and freed in the same loop-thread call), on the reader's
``read_done`` after a cuda-ipc read (the lease then also holds the staging tensor the reader maps), on an
explicit release, or at its deadline. ``lease_for_read`` checks the deadline itself, so a read after expiry
fails even before the expiry sweep has run, and never sees freed blocks.

Decode side: a request carrying a ``RemoteHandle`` first takes its local prefix-cache hit, then allocates the
remaining *full* prompt blocks (never caching them before their data arrives) and waits in
``WAITING_FOR_REMOTE_KVS``. The tail — at most ``block_size`` tokens, always including the last prompt token —
is computed locally, so the first sampled token has logits from this engine exactly as in a colocated run.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from twophase.kv_cache.block_manager import BlockManager
from twophase.kv_transfer.spec import RemoteHandle, token_digest
from twophase.request import Request, RequestStatus


@dataclass
class Lease:
    """A finished prefill's blocks, held for a decode engine to read until ``deadline`` (monotonic)."""

    request: Request
    block_ids: list[int]
    deadline: float
    staging: Any = None  # cuda-ipc: the copy a reader maps, kept alive until its read_done or the deadline


@dataclass
class RemoteLoad:
    """A decode request's blocks ``[first_block, first_block + len(block_ids))`` to be filled from a remote."""

    request: Request
    handle: RemoteHandle
    first_block: int
    block_ids: list[int]  # local block ids to fill, in order
    token_digest: str  # of the prompt tokens these blocks hold (the remote checks it)
    started: bool = False


@dataclass
class TransferCounters:
    """Transfers by outcome (read by the Prometheus exporter)."""

    num_transfers: int = 0
    num_bytes: int = 0
    by_transport: dict[str, int] = field(default_factory=dict)  # transfers by path: tcp | cuda-ipc
    seconds: collections.deque[float] = field(default_factory=collections.deque)  # durations not yet exported
    failures: dict[str, int] = field(default_factory=dict)  # cause → count
    num_prefix_hits: int = 0  # remote requests served by the local prefix cache, no transfer
    num_expired_leases: int = 0


class SchedulerConnector:
    """Leases (prefill side) and remote loads (decode side) over one BlockManager."""

    def __init__(self, block_manager: BlockManager, lease_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_manager = block_manager
        self.lease_timeout_s = lease_timeout_s
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.loading: dict[str, RemoteLoad] = {}
        self.releases: list[RemoteHandle] = []  # remote leases this engine no longer needs (sent by the worker side)
        self.counters = TransferCounters()

    # ---- prefill side ----------------------------------------------------------------------------
    def on_finish(self, request: Request, status: RequestStatus) -> bool:
        """A request ends: forget a pending load; hold the blocks under a lease when a decode engine will read
        them. Returns True when the blocks are now held here (the scheduler must not free them)."""
        self.loading.pop(request.request_id, None)
        remote_decode = (request.kv_transfer_params or {}).get("do_remote_decode") is True
        if not remote_decode or status == RequestStatus.FINISHED_ABORTED:
            return False
        block_ids = self.block_manager.block_ids(request.request_id)
        self.leases[request.request_id] = Lease(request, block_ids, self.clock() + self.lease_timeout_s)
        return True

    def lease_for_read(self, request_id: str, first_block: int, num_blocks: int, digest: str) -> list[int]:
        """Block ids a reader may copy now (the caller copies, then calls ``release``); raises ``LookupError``
        with the reason when the lease is gone, expired, or does not hold those tokens."""
        lease = self.leases.get(request_id)
        if lease is None:
            raise LookupError(f"no lease for request {request_id!r} (released, read or expired)")
        if self.clock() >= lease.deadline:
            self.release(request_id)
            self.counters.num_expired_leases += 1
            raise LookupError(f"lease for request {request_id!r} expired")
        end = first_block + num_blocks
        bs = self.block_manager.block_size
        if first_block < 0 or num_blocks < 1 or end * bs > lease.request.num_prompt_tokens:
            raise LookupError(f"blocks [{first_block}, {end}) are outside request {request_id!r}")
        if token_digest(lease.request.prompt_token_ids[: end * bs]) != digest:
            raise LookupError(f"request {request_id!r} holds a different prompt")
        if lease.staging is not None:
            raise LookupError(f"request {request_id!r} was already read (waiting for its read_done)")
        return lease.block_ids[first_block:end]

    def hold(self, request_id: str, staging: Any) -> None:
        """Keep ``staging`` (a read's payload, mapped by the reader) under the lease until it ends."""
        self.leases[request_id].staging = staging

    def release(self, request_id: str) -> bool:
        """Free a lease's blocks (idempotent); True when there was one."""
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        self.block_manager.free(lease.request)
        return True

    def expire(self) -> list[str]:
        """Free every lease past its deadline; returns their request ids."""
        now = self.clock()
        expired = [rid for rid, lease in self.leases.items() if now >= lease.deadline]
        for request_id in expired:
            self.release(request_id)
        self.counters.num_expired_leases += len(expired)
        return expired

    @property
    def next_deadline(self) -> float | None:
        """The earliest lease deadline (read from other threads to decide when to sweep)."""
        leases = list(self.leases.values())  # one C-level copy: safe while the loop thread mutates the dict
        return min((lease.deadline for lease in leases), default=None)

    # ---- decode side -----------------------------------------------------------------------------
    def start_load(self, request: Request) -> str:
        """Called for the request at the head of the waiting queue: 'local' (schedule it as usual), 'load'
        (its blocks are allocated and it now waits for remote KV: drop it from the queue) or 'blocked' (no
        room for its blocks yet)."""
        handle = request.remote_handle
        if handle is None or request.status != RequestStatus.WAITING:
            return "local"
        request.remote_handle = None  # one attempt; a preempted request later recomputes locally
        bm, bs = self.block_manager, self.block_manager.block_size
        hit_blocks, num_hit = bm.get_computed_blocks(request)
        num_full = (request.num_prompt_tokens - 1) // bs  # blocks before the one holding the last prompt token
        if num_hit // bs >= num_full:  # nothing to read: a prompt under two blocks, or a local prefix-cache hit
            self.counters.num_prefix_hits += int(num_full > 0)
            self.releases.append(handle)
            return "local"
        request.num_computed_tokens = num_hit
        if not bm.allocate_slots(request, num_full * bs - num_hit, hit_blocks, cache=False):
            request.num_computed_tokens = 0
            request.remote_handle = handle
            return "blocked"
        request.num_cached_tokens = num_hit
        bm.record_lookup(request.num_prompt_tokens, num_hit)
        first = num_hit // bs
        digest = token_digest(request.prompt_token_ids[: num_full * bs])
        self.loading[request.request_id] = RemoteLoad(request, handle, first, bm.block_ids(request.request_id)[first:],
                                                      digest)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.timeline.kv_transfer_start = self.clock()
        return "load"

    def finish_load(self, request_id: str, num_bytes: int, via: str = "tcp") -> Request | None:
        """The blocks arrived and are written: cache them and count the tokens as computed. Returns the request
        to resume (None if it was aborted meanwhile)."""
        load = self.loading.pop(request_id, None)
        if load is None:
            return None
        request = load.request
        request.num_computed_tokens = (load.first_block + len(load.block_ids)) * self.block_manager.block_size
        self.block_manager.cache_blocks(request, request.num_computed_tokens)
        request.timeline.kv_transfer_end = self.clock()
        request.timeline.kv_transfer_bytes = num_bytes
        self.count_transfer(num_bytes, via)
        self.counters.seconds.append(request.timeline.kv_transfer_end - request.timeline.kv_transfer_start)
        return request

    def count_transfer(self, num_bytes: int, via: str) -> None:
        """Count one completed transfer of ``num_bytes`` over ``via`` (tcp | cuda-ipc)."""
        self.counters.num_transfers += 1
        self.counters.num_bytes += num_bytes
        self.counters.by_transport[via] = self.counters.by_transport.get(via, 0) + 1

    def count_failure(self, cause: str) -> None:
        """Count one failed transfer by cause."""
        self.counters.failures[cause] = self.counters.failures.get(cause, 0) + 1

    def pending_loads(self) -> list[RemoteLoad]:
        """Loads not yet handed to the transport (marks them started)."""
        new = [load for load in self.loading.values() if not load.started]
        for load in new:
            load.started = True
        return new

    @property
    def num_loading(self) -> int:
        """Requests waiting for remote KV."""
        return len(self.loading)

    def check_invariants(self) -> None:
        """Leases own exactly their request's blocks; loading requests wait in the right status."""
        for request_id, lease in self.leases.items():
            assert self.block_manager.block_ids(request_id) == lease.block_ids, f"lease {request_id} blocks differ"
            assert lease.request.finished, f"leased request {request_id} is not finished"
        for request_id, load in self.loading.items():
            assert load.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"load {request_id} status"
