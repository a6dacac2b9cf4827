"""Prefill/decode disaggregation: hand a prompt's KV blocks from a prefill engine to a decode engine.

- ``spec``: the handshake fingerprint (model, dtype, block size, KV heads, layers) and the transfer handle.
- ``scheduler_connector``: no torch — leases on a finished prefill's blocks, remote loads a decode waits for.
- ``worker_connector``: torch — copy a request's blocks out of / into the paged KV cache.
- ``transport``: one interface (serve reads, fetch blocks, release) with a TCP implementation over pyzmq.
- ``placement``: no torch — where a cache lives, and the tcp / cuda-ipc choice the handshake makes.
- ``payload``: a read's payload in its wire form: raw bytes (tcp) or a CUDA IPC handle (cuda-ipc).
- ``connector``: the engine-level object tying the halves to ``LLMEngine`` and its loop thread.
"""

from twophase.kv_transfer.spec import KVSpec, KVTransferError

__all__ = ["KVSpec", "KVTransferError"]
