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
class PrefillChunk:
    """One request with several query tokens in this step (a prompt chunk or a recompute)."""

    token_start: int  # offset of its tokens in the flat batch
    token_end: int
    context_slots: torch.Tensor  # [seq_len] cache slots of positions 0..seq_len-1
    mask: torch.Tensor  # [num_q, seq_len] True where a key is visible (causal, offset by the start position)


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step by the model runner and read by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    prefill_chunks: list[PrefillChunk]
    decode_token_indices: torch.Tensor | None = None  # [num_decode] flat-batch rows of single-token requests
    decode_context_slots: torch.Tensor | None = None  # [num_decode, max_len] slots of their contexts
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_len] True where a key is visible


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


class TorchPagedAttention:
    """Reference backend in plain torch (CPU and CUDA): decode rows batched in one SDPA call with a
    padding mask; each prefill chunk in its own causal SDPA call over its gathered context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_groups = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Write new K/V through the slot mapping, then attend: decode rows together, prefill chunks each."""
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        if meta.decode_token_indices is not None:
            self._decode(q, k_cache, v_cache, meta, out)
        for chunk in meta.prefill_chunks:
            lo, hi = chunk.token_start, chunk.token_end
            out[lo:hi] = self._prefill_chunk(q[lo:hi], k_cache, v_cache, chunk)
        return out

    def _prefill_chunk(self, q, k_cache, v_cache, chunk: PrefillChunk) -> torch.Tensor:
        num_q, seq_len = q.shape[0], chunk.mask.shape[1]
        kv_shape = (self.num_kv_heads, self.num_groups, seq_len, q.shape[-1])
        # GQA without copying K/V: each KV head is viewed once per query head of its group
        keys = k_cache[chunk.context_slots].transpose(0, 1)[:, None].expand(kv_shape)  # [kvh, groups, seq_len, D]
        values = v_cache[chunk.context_slots].transpose(0, 1)[:, None].expand(kv_shape)
        query = q.view(num_q, self.num_kv_heads, self.num_groups, -1).permute(1, 2, 0, 3)  # [kvh, groups, num_q, D]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(num_q, self.num_heads, -1)  # [num_q, heads, D]

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        token_idx = meta.decode_token_indices  # [num_decode]
        num_decode = len(token_idx)
        # [num_decode, kvh, groups, D]: each KV head's query heads act as its query rows
        query = q[token_idx].view(num_decode, self.num_kv_heads, self.num_groups, -1)
        slots = meta.decode_context_slots  # [num_decode, max_len]
        keys = k_cache[slots].permute(0, 2, 1, 3)  # [num_decode, kvh, max_len, D]
        values = v_cache[slots].permute(0, 2, 1, 3)
        res = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
        out[token_idx] = res.reshape(num_decode, self.num_heads, -1)
