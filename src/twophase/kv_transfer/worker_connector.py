"""The worker's half of KV transfer: copy a request's blocks out of, or into, the paged KV cache.

The cache is one ``(K, V)`` pair per layer, each ``[num_blocks * block_size, num_kv_heads, head_dim]``. On the
wire a run of blocks is one contiguous buffer ``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]``
in the cache's dtype, raw bytes.
"""

from __future__ import annotations

import torch

from twophase.kv_transfer.spec import KVSpec, KVTransferError

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def _slots(block_ids: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)  # [n]
    offsets = torch.arange(block_size, dtype=torch.long, device=device)  # [bs]
    return (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)  # [n * bs]


class WorkerConnector:
    """Reads and writes whole blocks of one engine's KV cache tensors."""

    def __init__(self, kv_caches: KVCaches, spec: KVSpec) -> None:
        self.kv_caches = kv_caches
        self.spec = spec

    @torch.inference_mode()
    def copy_out(self, block_ids: list[int]) -> bytes:
        """The blocks' K/V as one buffer (see the module docstring for the layout)."""
        device = self.kv_caches[0][0].device
        slots = _slots(block_ids, self.spec.block_size, device)
        stacked = torch.stack([torch.stack((k[slots], v[slots])) for k, v in self.kv_caches])  # [L, 2, n*bs, H, D]
        return stacked.contiguous().cpu().view(torch.uint8).numpy().tobytes()

    @torch.inference_mode()
    def copy_in(self, block_ids: list[int], data: bytes) -> None:
        """Write a buffer produced by ``copy_out`` (on an engine with an equal spec) into these blocks."""
        expected = len(block_ids) * self.spec.bytes_per_block
        if len(data) != expected:
            raise KVTransferError(f"received {len(data)} bytes for {len(block_ids)} blocks, expected {expected}",
                                  "size_mismatch")
        k0 = self.kv_caches[0][0]
        shape = (self.spec.num_layers, 2, len(block_ids) * self.spec.block_size, self.spec.num_kv_heads,
                 self.spec.head_dim)
        values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(k0.dtype).reshape(shape).to(k0.device)
        slots = _slots(block_ids, self.spec.block_size, k0.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, slots, values[layer, 0])
            v.index_copy_(0, slots, values[layer, 1])
