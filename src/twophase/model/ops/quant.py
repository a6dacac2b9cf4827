"""GGUF-style block quantization (Q8_0, Q4_1) in the layouts the C++ kernels read, plus exact dequantization.

Layouts (K must be a multiple of 32; one block = 32 consecutive weights of a row):

- Q8_0: ``qs`` int8 [N, K], ``d`` float16 [N, K/32]; w = d * q.
- Q4_1: ``qs`` uint8 [N, K/2], ``d``, ``m`` float16 [N, K/32]; w = d * q + m, q in 0..15. Byte j of a
  block's 16 bytes holds element j in its low nibble and element j+16 in its high nibble (GGUF order),
  so raw GGUF block data converts by slicing (``from_gguf_q8_0`` / ``from_gguf_q4_1``).

GGUF's Q4_0 (w = d * (q - 8), the nibbles as Q4_1's) runs as Q4_1 blocks with m = -8 d (``from_gguf_q4_0``): the same
float32 weights, so every Q4_1 kernel executes it as stored.

Scales are float16 as in GGUF (the kernels convert them exactly; float32 scales would make a Q4_1 block 24 bytes
instead of 20); quantizers round them to float16 like ggml, so GGUF files round-trip.

Activations may be quantized too (llama.cpp's Q8_1 idea, ``quantize_activations``): blocks of 32 of a row as int8
with one float32 scale, so a block's dot product with Q8_0 / Q4_1 weights is integer arithmetic.
"""

from __future__ import annotations

import torch

QK = 32  # weights per block


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float32 [N, K/32, 32]."""
    n, k = w.shape
    if k % QK:
        raise ValueError(f"K={k} is not a multiple of {QK}")
    return w.float().reshape(n, k // QK, QK)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (qs int8 [N, K], d float16 [N, K/32]), as ggml's reference quantizer."""
    b = _blocks(w)
    d = b.abs().amax(-1) / 127.0  # [N, nb]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None]).clamp(-128, 127).to(torch.int8)
    return q.reshape(w.shape), d.half()


def dequantize_q8_0(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(qs [N, K], d [N, K/32]) -> float32 [N, K]."""
    n, k = qs.shape
    return (qs.float().reshape(n, k // QK, QK) * d.float()[..., None]).reshape(n, k)


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (qs uint8 [N, K/2], d float16 [N, K/32], m float16 [N, K/32]), as ggml."""
    b = _blocks(w)
    lo, hi = b.amin(-1), b.amax(-1)  # [N, nb]
    d = (hi - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor((b - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
    return pack_nibbles(q), d.half(), lo.half()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, nb, 32] -> packed uint8 [N, nb*16] (element j low, j+16 high)."""
    n, nb, _ = q.shape
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(n, nb * 16)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K/2] -> uint8 0..15 [N, K/32, 32]."""
    n, half = qs.shape
    blk = qs.reshape(n, half // 16, 16)
    return torch.cat([blk & 0x0F, blk >> 4], dim=-1)


def dequantize_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(qs [N, K/2], d, m [N, K/32]) -> float32 [N, K]."""
    q = unpack_nibbles(qs).float()
    n, nb, _ = q.shape
    return (q * d.float()[..., None] + m.float()[..., None]).reshape(n, nb * QK)


def from_gguf_q8_0(raw: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF Q8_0 bytes (N*K/32 blocks of fp16 d + 32 int8) -> (qs, d)."""
    blk = raw.reshape(n, k // QK, 34)
    d = blk[..., :2].contiguous().view(torch.float16).reshape(n, k // QK)
    qs = blk[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return qs, d


def from_gguf_q4_1(raw: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw GGUF Q4_1 bytes (N*K/32 blocks of fp16 d, fp16 m, 16 packed bytes) -> (qs, d, m)."""
    blk = raw.reshape(n, k // QK, 20)
    d = blk[..., 0:2].contiguous().view(torch.float16).reshape(n, k // QK)
    m = blk[..., 2:4].contiguous().view(torch.float16).reshape(n, k // QK)
    qs = blk[..., 4:].contiguous().reshape(n, k // 2)
    return qs, d, m


def from_gguf_q4_0(raw: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Raw GGUF Q4_0 bytes (N*K/32 blocks of fp16 d + 16 packed bytes; w = d (q - 8)) -> Q4_1's (qs, d, m) with
    m = -8 d. The same float32 weights as ``gguf.dequantize``'s d (q - 8): d q and 8 d are exact (a float16
    significand times an integer below 16), and so is d q - 8 d, which has no more significant bits (where q = 8 it is
    +0, where gguf's is -0 for a negative d: equal values). None where some -8 d overflows float16 (|d| > 8188, a
    weight past float16's range), which no Q4_1 block can hold."""
    blk = raw.reshape(n, k // QK, 18)
    d = blk[..., 0:2].contiguous().view(torch.float16).reshape(n, k // QK)
    m = (d.float() * -8.0).half()  # exact where finite: a power of two
    if not torch.isfinite(m).all():
        return None
    qs = blk[..., 2:].contiguous().reshape(n, k // 2)
    return qs, d, m


# GGUF tensor types the kernels execute as stored -> (the block format each runs as, its raw bytes -> that format's
# tensors): Q4_0 as Q4_1 blocks with m = -8 d, the same float32 weights
FROM_GGUF = {"Q8_0": ("q8_0", from_gguf_q8_0), "Q4_1": ("q4_1", from_gguf_q4_1), "Q4_0": ("q4_1", from_gguf_q4_0)}


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] -> (q int8 [..., K], d float32 [..., K/block]) with x ≈ d · q: d = max|x| / 127 per block of the
    last dim, q = x · (1 / d) rounded to nearest even (0 where d is 0), in float32. The C++ kernels quantize with the
    same operations (``quantize_block_int8`` in csrc/common.h: the int8 GEMMs' activations, the int8 KV cache's rows),
    so both give the same q and d."""
    b = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    d = b.abs().amax(-1) / 127.0  # [..., nb]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None]).to(torch.int8)
    return q.reshape(x.shape), d


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [T, K] -> (q int8 [T, K], d float32 [T, K/32]): ``quantize_blocks`` in blocks of 32."""
    return quantize_blocks(x, QK)


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """float32 [T, K] -> float32 [T, K]: x rounded to its int8 blocks (what the int8-activation kernels compute with)."""
    q, d = quantize_activations(x)
    t, k = x.shape
    return (q.float().reshape(t, k // QK, QK) * d[..., None]).reshape(t, k)
