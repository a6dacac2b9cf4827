"""The elementwise ops of a Llama layer behind one object: our fused C++ kernels (``csrc/fused.cpp``) on CPU in
float32 / bfloat16, the eager torch code everywhere else (float64, CUDA, no kernels) — which is also the reference
the kernels are tested against. Each kernel call replaces 4–10 eager ops per layer (dispatch costs 5–30 µs each).
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from twophase.model.attention import write_kv
from twophase.model.layers import apply_rotary, rms_norm_reference
from twophase.model.ops.linear import PanelLinear

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class Rope(NamedTuple):
    """This step's rotary inputs, built once for all layers."""

    positions: torch.Tensor  # [T] int64
    cos_table: torch.Tensor  # [max_positions, D] float32
    sin_table: torch.Tensor  # [max_positions, D] float32, signed ([-sin, sin])
    cos: torch.Tensor | None  # [T, 1, D] in the model dtype (torch path only)
    sin: torch.Tensor | None  # [T, 1, D]


class LayerOps:
    """RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary + KV-cache write; ``kernels`` None: eager torch."""

    def __init__(self, kernels: ModuleType | None = None, decided: bool | None = None) -> None:
        self.kernels = kernels
        self.decided = decided  # set by ``bind``: kernels or not for every call, without looking at the tensors

    def bind(self, x: torch.Tensor) -> LayerOps:
        """These ops for one forward over activations like ``x`` [T, H]: whether the kernels apply is decided here,
        once, instead of in each of the ~5 calls per layer."""
        return LayerOps(self.kernels, self.uses_kernels(x))

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """Whether ops on tensors like ``x`` run our kernels (else eager torch, which needs ``Rope.cos/sin``)."""
        if self.decided is not None:
            return self.decided
        return self.kernels is not None and x.device.type == "cpu" and x.dtype in KERNEL_DTYPES

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * rms_norm(x), x [T, H] → [T, H]."""
        if self.uses_kernels(x) and weight.dtype == x.dtype:
            return self.kernels.rms_norm(x.contiguous(), weight, eps)
        return rms_norm_reference(x, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place: ``residual += x``, then ``x = weight * rms_norm(residual)``; both [T, H] contiguous."""
        if self.uses_kernels(x) and weight.dtype == x.dtype:
            self.kernels.add_rms_norm_(x, residual, weight, eps)
            return
        residual.add_(x)
        x.copy_(rms_norm_reference(residual, weight, eps))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2F] → silu(gate) * up [T, F]."""
        if self.uses_kernels(gate_up):
            return self.kernels.silu_and_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gated(self, gate_up_proj: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(gate_up_proj(x)), x [T, H] → [T, F]. A panel-kernel projection (``PanelLinear``, whose
        float32 forward is its ``op``) takes float32 x in one call that applies SiLU-and-mul as it stores (the same
        bits, without the [T, 2F] product; the decoder stack calls the same); anything else, the two in turn."""
        if isinstance(gate_up_proj, PanelLinear) and x.dtype == torch.float32:
            return gate_up_proj.op.silu_gated(x)
        return self.silu_and_mul(gate_up_proj(x))

    def rotary_cache_(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 KVH) * D], rotated in place
        rope: Rope,
        k_cache: torch.Tensor,  # [slots, KVH, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [T] int64
        heads: int,
        kv_heads: int,
    ) -> None:
        """Rotate the q and k heads of ``qkv`` in place, then store its k and v rows at their cache slots."""
        head_dim = qkv.shape[1] // (heads + 2 * kv_heads)
        if self.uses_kernels(qkv) and k_cache.dtype in (qkv.dtype, torch.bfloat16, torch.int8):
            self.kernels.rotary_cache_(qkv, rope.positions, rope.cos_table, rope.sin_table, k_cache, v_cache, slots,
                                       heads, kv_heads)  # fmt: skip
            return
        qk_size = (heads + kv_heads) * head_dim
        qk = qkv[:, :qk_size].view(-1, heads + kv_heads, head_dim)  # [T, H + KVH, D]
        qk.copy_(apply_rotary(qk, rope.cos, rope.sin))
        k = qk[:, heads:]  # [T, KVH, D]
        v = qkv[:, qk_size:].view(-1, kv_heads, head_dim)  # [T, KVH, D]
        write_kv(k, v, k_cache, v_cache, slots)
