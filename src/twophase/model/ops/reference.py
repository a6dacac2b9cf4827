"""Plain-torch references of the C++ kernels: the fallback when they are unavailable, and the test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twophase.model.ops.quant import dequantize_q4_1, dequantize_q8_0


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M,K] @ w[N,K].T + bias, in x's dtype."""
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def linear_int8_ref(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """(x @ wq.T) * scale + bias."""
    y = F.linear(x, wq.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


def linear_q8_0_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ dequant_q8_0(qs, d).T + bias."""
    return linear_ref(x, dequantize_q8_0(qs, d), bias)


def linear_q4_1_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                    bias: torch.Tensor | None = None):
    """x @ dequant_q4_1(qs, d, m).T + bias."""
    return linear_ref(x, dequantize_q4_1(qs, d, m), bias)


def context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..seq_len-1 of one request: [seq_len] int64."""
    pos = torch.arange(seq_len)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def paged_attention_ref(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        block_size: int, scale: float) -> None:
    """Gather + SDPA per request; writes ``out`` [T,H,D].

    Request r owns query rows query_start_loc[r]:query_start_loc[r+1] (q_len rows); its i-th query is at
    position seq_lens[r] - q_len + i and attends cache positions 0..that position (causal). Query head h
    reads kv head h // (H // KVH). Math in ``q``'s dtype (pass float64 tensors for an oracle).
    """
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for r in range(seq_lens.shape[0]):
        t0, t1 = int(query_start_loc[r]), int(query_start_loc[r + 1])
        seq, q_len = int(seq_lens[r]), t1 - t0
        if q_len == 0:
            continue
        slots = context_slots(block_tables[r], seq, block_size)
        k = k_cache[slots].to(q.dtype).transpose(0, 1)  # [KVH, S, D]
        v = v_cache[slots].to(q.dtype).transpose(0, 1)
        qpos = torch.arange(seq - q_len, seq)[:, None]
        mask = torch.arange(seq)[None, :] <= qpos  # [q_len, S]
        o = F.scaled_dot_product_attention(q[t0:t1].transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=heads != kv_heads)  # [H, q_len, D]
        out[t0:t1] = o.transpose(0, 1).to(out.dtype)
