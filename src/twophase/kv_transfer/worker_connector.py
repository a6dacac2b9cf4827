"""The worker's half of KV transfer: copy a request's blocks out of, or into, the paged KV cache.

The cache is one ``(K, V)`` pair per layer, each ``[num_blocks * block_size, num_kv_heads, head_dim]``. A run of
blocks travels as one contiguous tensor ``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]`` in
the cache's dtype (``payload`` gives it its wire form: raw bytes, or a CUDA IPC handle).
"""

from __future__ import annotations

import torch

from twophase.kv_transfer.spec import KVSpec

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

    @property
    def device(self) -> torch.device:
        """Where the cache lives."""
        return self.kv_caches[0][0].device

    @property
    def dtype(self) -> torch.dtype:
        """The cache's dtype."""
        return self.kv_caches[0][0].dtype

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of the tensor holding ``num_blocks`` blocks: [L, 2, n*bs, H, D] (D + 4 in an int8 cache: its rows'
        scales travel with them)."""
        s = self.spec
        return (s.num_layers, 2, num_blocks * s.block_size, s.num_kv_heads, self.kv_caches[0][0].shape[-1])

    @torch.no_grad()
    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' K/V copied into one new contiguous tensor [L, 2, n*bs, H, D] on the cache's device (a
        plain tensor, not an inference tensor, so torch can share it over CUDA IPC)."""
        slots = _slots(block_ids, self.spec.block_size, self.device)
        return torch.stack([torch.stack((k[slots], v[slots])) for k, v in self.kv_caches])  # [L, 2, n*bs, H, D]

    @torch.inference_mode()
    def scatter(self, block_ids: list[int], values: torch.Tensor) -> None:
        """Write ``values`` [L, 2, n*bs, H, D] (from ``gather`` on an engine with an equal spec, on any device)
        into these blocks, and wait until the copy is done: the source may be another process's memory that is
        released right after."""
        values = values.to(self.device)  # [L, 2, n*bs, H, D]
        slots = _slots(block_ids, self.spec.block_size, self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, slots, values[layer, 0])
            v.index_copy_(0, slots, values[layer, 1])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
