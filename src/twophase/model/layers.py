"""Building blocks of a Llama-family decoder: RMSNorm and rotary position embeddings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from twophase.config import ConfigError, ModelConfig


class DirectCallModule(nn.Module):
    """A module on the per-token hot path: calling it runs ``forward`` directly, without ``nn.Module.__call__``'s
    hook and tracing machinery (~3 µs a call; a decode step makes ~200 such calls). These modules take no hooks."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF Llama does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        """Normalise each row (the eager reference; the model calls it through ``LayerOps``)."""
        return rms_norm_reference(x, self.weight, self.eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x) [T, H], statistics in float32 (float64 kept), as HF Llama."""
    dtype = x.dtype
    x32 = x.to(torch.float32) if dtype != torch.float64 else x
    normed = torch.nn.functional.rms_norm(x32, (x32.shape[-1],), eps=eps)  # one fused op
    return weight * normed.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for the config's rope type (default, linear, llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling_dict
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ConfigError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary embedding (HF's rotate-half layout) with precomputed float32 cos / signed-sin tables."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, config.head_dim), persistent=False)
        self.build_tables()

    def build_tables(self) -> None:
        """(Re)compute the tables in float32 on the buffers' device (after a meta-device build).

        ``sin`` holds the signed sine ``[-sin, sin]`` so that rotate_half(x)·sin == roll(x, D/2)·signed_sin."""
        if self.cos.device.type == "meta":
            return
        inv_freq = rope_inv_freq(self.config).to(torch.float32)  # [head_dim/2]
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1).to(self.cos.device)  # [max_positions, head_dim]
        half = self.config.head_dim // 2
        self.cos = emb.cos()
        self.sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [T, 1, D] of positions [T], in ``dtype`` — built once per step for all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] (q and k heads together): x·cos + rotate_half(x)·sin, written as
    x·cos + roll(x, D/2)·signed_sin (rotate_half(x) = [-x2, x1] = roll(x)·[-1, 1]; identical in IEEE arithmetic)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
