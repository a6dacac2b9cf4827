"""Paged attention over a flat batch of tokens from many requests.

The backend interface is small: ``forward(q, k, v, k_cache, v_cache, meta) -> out``. It must write the new
K/V into the cache through ``meta.slot_mapping`` before reading, and let each token attend only to its own
request's positions ≤ its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step by the model runner (vectorised)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: list[int]  # [num_reqs + 1]: offsets of each request's tokens in the flat batch
    seq_lens: list[int]  # [num_reqs]: context length of each request after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64 (padded with 0)
    block_size: int
    decode_rows: torch.Tensor | None = None  # indices of requests with exactly one query token
    decode_context_slots: torch.Tensor | None = None  # [num_decode, max_len] slots of their contexts
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_len] True where a key is visible

    @property
    def num_reqs(self) -> int:
        """Requests in the batch."""
        return len(self.seq_lens)


class AttentionBackend(Protocol):
    """What a faster kernel must implement to replace the reference path."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def context_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of positions 0..max_len-1 for each row of ``block_tables`` ([rows, max_len]; pads point at slot of block 0)."""
    max_len = int(seq_lens.max())
    positions = torch.arange(max_len, device=block_tables.device)  # [max_len]
    blocks = block_tables[:, positions // block_size]  # [rows, max_len]
    return blocks * block_size + positions % block_size


class TorchPagedAttention:
    """Reference backend in plain torch (CPU and CUDA): decode rows batched in one SDPA call with a
    padding mask; each prefill chunk in its own causal SDPA call over its gathered context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_groups = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Write new K/V through the slot mapping, then attend per request."""
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        if meta.decode_rows is not None and len(meta.decode_rows):
            self._decode(q, k_cache, v_cache, meta, out)
        decode_set = set(meta.decode_rows.tolist()) if meta.decode_rows is not None else set()
        starts = meta.query_start_loc
        for row in range(meta.num_reqs):
            if row in decode_set:
                continue
            lo, hi = starts[row], starts[row + 1]
            out[lo:hi] = self._prefill_one(q[lo:hi], k_cache, v_cache, meta, row)
        return out

    def _prefill_one(self, q, k_cache, v_cache, meta: AttentionMetadata, row: int) -> torch.Tensor:
        num_q, seq_len = q.shape[0], meta.seq_lens[row]
        positions = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[row, positions // meta.block_size] * meta.block_size + positions % meta.block_size
        keys = k_cache[slots].transpose(0, 1).to(q.dtype)  # [kv_heads, seq_len, head_dim]
        values = v_cache[slots].transpose(0, 1).to(q.dtype)
        # GQA without copying K/V: the query heads of one KV head become extra query rows of that head
        query = q.view(num_q, self.num_kv_heads, self.num_groups, -1).permute(1, 2, 0, 3)  # [kvh, groups, num_q, D]
        query = query.reshape(self.num_kv_heads, self.num_groups * num_q, -1)  # [kvh, groups * num_q, D]
        q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)  # [num_q]
        mask = (positions[None, :] <= q_pos[:, None]).repeat(self.num_groups, 1)  # [groups * num_q, seq_len]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale)
        out = out.view(self.num_kv_heads, self.num_groups, num_q, -1).permute(2, 0, 1, 3)  # [num_q, kvh, groups, D]
        return out.reshape(num_q, self.num_heads, -1)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        token_idx = torch.tensor(meta.query_start_loc, device=q.device)[meta.decode_rows]  # [num_decode]
        num_decode = len(token_idx)
        # [num_decode, kvh, groups, D]: each KV head's query heads act as its query rows
        query = q[token_idx].view(num_decode, self.num_kv_heads, self.num_groups, -1)
        slots = meta.decode_context_slots  # [num_decode, max_len]
        keys = k_cache[slots].permute(0, 2, 1, 3).to(q.dtype)  # [num_decode, kvh, max_len, D]
        values = v_cache[slots].permute(0, 2, 1, 3).to(q.dtype)
        res = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
        out[token_idx] = res.reshape(num_decode, self.num_heads, -1)
