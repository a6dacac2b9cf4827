"""Paged attention over a flat batch of tokens from many requests.

The backend interface is small: ``prepare(meta)`` once per step (backend-specific index tensors, built once and
read by every layer), then ``attend(q, k_cache, v_cache, meta) -> out`` per layer, after the model has written this
step's K/V through ``meta.slot_mapping`` (``write_kv``, or fused with the rotary embedding in ``LayerOps``). Each
token attends only to its own request's positions ≤ its own.

- ``TorchPagedAttention``: the plain-torch reference (any device, any dtype, float64 included): gathers each
  request's context and calls SDPA. Every faster backend is tested against it.
- ``KernelPagedAttention``: our C++ kernel (``model/ops``): one call per layer for every row of the batch, decode
  rows and prefill chunks alike, reading K/V in place from the cache blocks (no gather copy, no padding). Under
  bfloat16 GEMMs it hands prefill chunks of ``DENSE_MIN_QUERIES`` or more queries to torch's bfloat16 SDPA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from twophase.model.ops.quant import quantize_blocks


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
    query_start_loc: torch.Tensor  # [num_requests + 1] int32: offsets of each request's rows in the flat batch
    seq_lens: torch.Tensor  # [num_requests] int32: context length of each request after this step
    block_tables: torch.Tensor  # [num_requests, max_blocks] int32 (rows padded with block 0)
    block_size: int
    query_lens_list: list[int] = field(default_factory=list)  # host copies of the per-request lengths
    seq_lens_list: list[int] = field(default_factory=list)
    # reference backend only (TorchPagedAttention.prepare)
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    decode_token_indices: torch.Tensor | None = None  # [num_decode] flat-batch rows of single-token requests
    decode_context_slots: torch.Tensor | None = None  # [num_decode, max_len] slots of their contexts
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_len] True where a key is visible


class AttentionBackend(Protocol):
    """What a faster kernel must implement to replace the reference path."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Add backend-specific per-step tensors to ``meta`` (once per step, before the layers run)."""
        ...

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of q [num_tokens, num_heads, head_dim] over the cache, this step's K/V already in it
        (the model writes them fused with the rotary embedding)."""
        ...


INT8_ROW_EXTRA = 4  # an int8 cache row: D int8 values, then the row's float32 scale (its 4 bytes)


def cache_row_len(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row (a token's kv head): head_dim, and an int8 cache's scale bytes after them."""
    return head_dim + INT8_ROW_EXTRA if dtype == torch.int8 else head_dim


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """int8 cache rows [..., D + 4] of x [..., D]: each row one block of ``quant.quantize_blocks`` (s = max |x| / 127,
    q = x · (1 / s) rounded to nearest even), then s's 4 bytes; the kernels' quantize_int8_row writes the same bytes.
    Per row (a token's kv head), K and V keep 7 bits of their largest value: SmolLM2's teacher-forced top-1 agreement
    with float32 was 0.996 with it and everything else float32."""
    q, scale = quantize_blocks(x, x.shape[-1])  # [..., D], [..., 1]
    return torch.cat([q, scale.view(torch.int8)], dim=-1)  # the scale's float32 bytes as 4 int8


def dequantize_int8_rows(rows: torch.Tensor) -> torch.Tensor:
    """float32 [..., D] of int8 cache rows [..., D + 4] (quantize_int8_rows)."""
    scale = rows[..., -INT8_ROW_EXTRA:].contiguous().view(torch.float32)  # [..., 1]
    return rows[..., :-INT8_ROW_EXTRA].float() * scale


def cache_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The K or V rows [*slots.shape, KVH, D] at ``slots``, as float32 where the cache is int8, else as stored."""
    rows = cache[slots]
    return dequantize_int8_rows(rows) if cache.dtype == torch.int8 else rows


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store this step's K/V [T, KVH, D] into their cache slots [T] (rounded, or quantized: an int8 cache)."""
    for x, cache in ((k, k_cache), (v, v_cache)):
        cache.index_copy_(0, slots, quantize_int8_rows(x) if cache.dtype == torch.int8 else x.to(cache.dtype))


class TorchPagedAttention:
    """Reference backend in plain torch (CPU and CUDA): decode rows batched in one SDPA call with a
    padding mask; each prefill chunk in its own causal SDPA call over its gathered context."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_groups = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def prepare(self, meta: AttentionMetadata) -> None:
        """Gather indices and masks of every request's context, built once for all layers."""
        block_tables = meta.block_tables.long().cpu()
        device = meta.slot_mapping.device
        starts = [0]
        for n in meta.query_lens_list:
            starts.append(starts[-1] + n)
        decode_rows = []
        for row, (num_q, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            if num_q == 0:
                continue
            if num_q == 1:
                decode_rows.append(row)
                continue
            slots = context_slots(block_tables[row : row + 1], torch.tensor([seq_len]), meta.block_size)[0]
            mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - num_q, seq_len)[:, None]  # [num_q, seq_len]
            meta.prefill_chunks.append(PrefillChunk(starts[row], starts[row + 1], slots.to(device), mask.to(device)))
        if decode_rows:
            rows = torch.tensor(decode_rows)
            seq_lens = torch.tensor(meta.seq_lens_list)[rows]  # [num_decode]
            slots = context_slots(block_tables[rows], seq_lens, meta.block_size)  # [num_decode, max_len]
            visible = torch.arange(slots.shape[1])[None, :] < seq_lens[:, None]  # [num_decode, max_len]
            meta.decode_token_indices = torch.tensor([starts[r] for r in decode_rows]).to(device)
            meta.decode_context_slots = slots.to(device)
            meta.decode_mask = visible[:, None, None, :].to(device)  # [num_decode, 1, 1, max_len]

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over K/V already in the cache (math in q's dtype: float64 q makes an oracle)."""
        out = torch.zeros_like(q)  # rows of requests without queries stay 0
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
        keys = cache_rows(k_cache, chunk.context_slots).transpose(0, 1)[:, None].expand(kv_shape)  # [kvh, groups, seq_len, D]
        values = cache_rows(v_cache, chunk.context_slots).transpose(0, 1)[:, None].expand(kv_shape)
        query = q.view(num_q, self.num_kv_heads, self.num_groups, -1).permute(1, 2, 0, 3)  # [kvh, groups, num_q, D]
        out = F.scaled_dot_product_attention(query, keys.to(q.dtype), values.to(q.dtype), attn_mask=chunk.mask, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(num_q, self.num_heads, -1)  # [num_q, heads, D]

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        token_idx = meta.decode_token_indices  # [num_decode]
        num_decode = len(token_idx)
        # [num_decode, kvh, groups, D]: each KV head's query heads act as its query rows
        query = q[token_idx].view(num_decode, self.num_kv_heads, self.num_groups, -1)
        slots = meta.decode_context_slots  # [num_decode, max_len]
        keys = cache_rows(k_cache, slots).permute(0, 2, 1, 3).to(q.dtype)  # [num_decode, kvh, max_len, D]
        values = cache_rows(v_cache, slots).permute(0, 2, 1, 3).to(q.dtype)
        res = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
        out[token_idx] = res.reshape(num_decode, self.num_heads, -1)


def context_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of positions 0..max_len-1 for each row of ``block_tables`` ([rows, max_len]). A row shorter than
    max_len repeats its last position, so padding only ever reads K/V some token wrote (the cache is never
    zeroed: an unwritten slot may hold NaN bits, and a masked NaN key still poisons SDPA)."""
    positions = torch.arange(int(seq_lens.max())).expand(len(seq_lens), -1)  # [rows, max_len]
    positions = torch.minimum(positions, (seq_lens - 1)[:, None])
    return block_tables.long().gather(1, positions // block_size) * block_size + positions % block_size


def reference_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    seq_lens: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    block_size: int,
) -> torch.Tensor:  # [T, H, D] in q's dtype
    """``TorchPagedAttention`` on the kernel's raw arguments: the oracle the C++ kernel is tested against."""
    starts = query_start_loc.tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=block_tables, block_size=block_size,
        query_lens_list=[b - a for a, b in zip(starts, starts[1:])], seq_lens_list=seq_lens.tolist(),
    )  # fmt: skip
    backend = TorchPagedAttention(q.shape[1], k_cache.shape[1], q.shape[2])
    backend.prepare(meta)
    return backend.attend(q, k_cache, v_cache, meta)


# Queries of one request from which a bfloat16 engine on an AMX CPU (``ModelRunner._prefill_products``) attends
# through torch's SDPA (flash attention on AMX) instead of the kernel: measured on 2 Xeon cores over 256 keys, SDPA
# took 0.88x / 0.99x the kernel's time at 16 / 32 queries and 1.8x less from 64 on (2.5x at 512).
DENSE_MIN_QUERIES = 48
DENSE_DISABLE_ENV = "TWOPHASE_NO_DENSE_PREFILL"  # =1: float32 products in the kernel for every request (A/B timing)
# Queries of one request from which a bfloat16 engine on a CPU with AVX512-BF16 and no AMX attends on the kernel's
# bfloat16 dot products (``attend_dot`` in csrc/attention.cpp: flash attention's rounding, on vdpbf16ps). On 2 Zen 4
# cores, 8 requests over 256 keys a layer: 1.7x / 2.0x less time than the float32 products at 8 / 16 queries each
# (1.6x at 5); whole prompts of 256 / 512 tokens 1.7x. Decode rows and short speculative checks stay in float32.
DOT_MIN_QUERIES = 8
PREFILL_PRODUCTS = ("float32", "sdpa", "dot", "dot-fma")  # how prefill chunks multiply (make_attention_backend)


class KernelPagedAttention:
    """Our C++ paged attention: every row of the batch in one call per layer, K/V read in place from the
    cache blocks (each byte once per query head group), causal by position, float32 accumulation.
    ``dense_min_queries`` (0: never): a request with at least that many queries in the step (a prefill chunk) runs
    through torch's SDPA in bfloat16 instead, over its context gathered from the cache — for engines that already
    run their GEMMs in bfloat16 on an AMX CPU (it rounds the queries to bfloat16, and the scores' sums take another
    order). ``dot_min_queries`` (0: never): such a request runs in the kernel on bfloat16 dot products (bfloat16
    cache, head dim 64, AVX512-BF16 builds), the queries and probabilities rounded to bfloat16 as SDPA rounds them;
    ``dot_fma``: those products summed on float32 FMAs (where they outrun the dot-product instruction, as
    ``bf16_gemm``'s, ``gemm.dot_sums_on_fma``)."""

    name = "kernel"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernels, dense_min_queries: int = 0,
                 dot_min_queries: int = 0, dot_fma: bool = False) -> None:  # fmt: skip
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        self.kernels = kernels
        self.dense_min_queries = dense_min_queries
        self.dot_min_queries = dot_min_queries
        self.dot_fma = dot_fma

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing beyond the common metadata."""

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D] over the cache (this step's K/V already written) → [T, H, D]."""
        out = torch.empty(q.shape, dtype=q.dtype)
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # the kernel reads rows in place, heads packed within one
            q = q.contiguous()
        self.kernels.paged_attention(
            out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.block_size, self.scale, self.dense_min_queries, self.dot_min_queries, self.dot_fma,
        )  # fmt: skip
        return out


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def make_attention_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
    prefill_products: str = "float32",
) -> AttentionBackend:
    """'torch' (reference), 'kernel' (C++, CPU, float32/bfloat16), or 'auto': the kernel where it applies and
    builds, else torch. ``prefill_products`` (``ModelRunner._prefill_products``): how the kernel multiplies prefill
    chunks: ``float32`` as every row, ``sdpa`` (bfloat16 GEMM engines on an AMX CPU): chunks of
    ``DENSE_MIN_QUERIES`` or more queries through torch's bfloat16 SDPA, ``dot`` (the same without AMX): chunks of
    ``DOT_MIN_QUERIES`` or more on the kernel's bfloat16 dot products, ``dot-fma``: those products summed on float32
    FMAs."""
    if name not in ("auto", "torch", "kernel"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or kernel")
    if prefill_products not in PREFILL_PRODUCTS:
        raise ValueError(f"unknown prefill products {prefill_products!r}; choose one of {PREFILL_PRODUCTS}")
    if name == "kernel" and dtype not in KERNEL_DTYPES:
        raise ValueError(f"attention backend 'kernel' supports float32 and bfloat16, not {dtype}")
    if name != "torch" and device.type == "cpu" and dtype in KERNEL_DTYPES:
        from twophase.model.ops.extension import load_kernels

        kernels = load_kernels()
        if kernels is not None:
            if os.environ.get(DENSE_DISABLE_ENV, "") not in ("", "0"):
                prefill_products = "float32"
            dense = DENSE_MIN_QUERIES if prefill_products == "sdpa" else 0
            dot = DOT_MIN_QUERIES if prefill_products in ("dot", "dot-fma") else 0
            return KernelPagedAttention(num_heads, num_kv_heads, head_dim, kernels, dense, dot,
                                        prefill_products == "dot-fma")
        if name == "kernel":
            raise RuntimeError("attention backend 'kernel' asked for, but the C++ kernels could not be built")
    elif name == "kernel":
        raise ValueError("attention backend 'kernel' runs on CPU only")
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)
