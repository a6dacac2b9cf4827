"""Linear layers behind one small interface: a method packs a weight once at load time, then each call maps
``x [T, in] -> [T, out]``.

Methods (``--quantization`` picks the weight format, the C++ kernels make it fast when they build):

- ``dense``: ``F.linear`` on the weight as loaded — the reference every other method is tested against.
- ``kernel``: the same float32/bfloat16 weight through our small-M kernel (each weight row streamed once for all
  rows of the batch, at memory bandwidth); rows beyond ``MAX_KERNEL_ROWS`` go to a GEMM: for float32 weights
  oneDNN's, on a copy of the weight packed into its blocked layout on the first such batch (``PrepackedGemm``,
  what inductor's ``freezing`` uses), else ``F.linear``.
- ``int8``: weight-only int8 with one float32 scale per output channel (symmetric, round to nearest).
- ``q8_0`` / ``q4_1``: GGUF's block formats (32 weights per block: ``d·q`` / ``d·q + m``), executed without
  dequantising to a full-precision copy. As in llama.cpp, activations are rounded to int8 blocks of 32 first
  (``quant.quantize_activations``), so each block's dot product is integer arithmetic (``maddubs``) — on the
  F.linear fallback too (``rounded_input``), so both paths see the same activations.

Batch invariance: each kernel computes an output row with the same instructions in the same order whatever the
other rows of the batch are; only the F.linear fallback beyond ``MAX_KERNEL_ROWS`` (a GEMM, blocked by batch size)
is not. ``--deterministic`` (``batch_invariant``) keeps every batch size on the kernels, so batching and chunked
prefill never change a request's logits.

Without the kernels every method still runs (plain torch: dequantise then ``F.linear``), slower but equal.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from twophase.model.layers import DirectCallModule
from twophase.model.ops import quant
from twophase.model.ops.huge_pages import arena

QUANTIZATIONS = ("none", "int8", "q8_0", "q4_1", "gguf")  # gguf: each weight in the block format it is stored in
BLOCK_FORMATS = ("q8_0", "q4_1")  # GGUF blocks of 32: executed with int8 activation blocks
# Beyond this many rows a GEMM beats streaming the weight per row tile. Measured over SmolLM2-135M's 120 layer
# matrices on a 2-core Zen 3: float32 against oneDNN's prepacked GEMM (benchmarks/bench_kernels.py --gemm, two
# runs), our time over its 0.88-0.90x at 16 rows, 0.97-1.01x at 32, 0.97-1.19x at 48, 1.03-1.11x at 64, 1.14-1.39x
# at 128; the other formats against F.linear on the dequantised weight (which also pays a dequantisation per
# call), every kernel still winning at 128 rows.
MAX_KERNEL_ROWS = {"none": 32, "int8": 128, "q8_0": 128, "q4_1": 128}
# A float32 matrix this large (an LM head) switches to the prepacked GEMM sooner: one matrix at a time, caches
# flushed between calls, medians of 15-30 (/ = our time over the GEMM's): 49152x576 (SmolLM2's head) 0.97 at 16
# rows, 1.11 at 24, 1.20 at 32; 12288x576 0.98 / 1.09 / 1.08; the layer matrices 3072x576 0.91 / 0.99 / 0.91 and
# 576x1536 0.69 / 0.85 / 0.85.
LARGE_MATRIX_WEIGHTS = 4 << 20
LARGE_MATRIX_KERNEL_ROWS = 16


def kernel_row_limit(fmt: str, batch_invariant: bool, gemm_weights: int = 0) -> float:
    """Rows up to which a layer of format ``fmt`` runs its kernel (beyond: a GEMM); every row when batch-invariant.
    ``gemm_weights``: the weight count of a float32 matrix that has the prepacked GEMM (0: none), whose limit is
    lower when the matrix is head-sized."""
    if batch_invariant:
        return math.inf
    if gemm_weights >= LARGE_MATRIX_WEIGHTS:
        return min(MAX_KERNEL_ROWS[fmt], LARGE_MATRIX_KERNEL_ROWS)
    return MAX_KERNEL_ROWS[fmt]


class DenseLinear(DirectCallModule):
    """``F.linear`` on the weight as loaded (reference)."""

    op = None  # no C++ ``LinearOp``: the decoder stack (``ops/stack.py``) does not apply

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # [out, in]
        self.register_buffer("bias", bias)  # [out] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        """y = x Wᵀ + b."""
        return F.linear(x, self.weight, self.bias)


# The batch size oneDNN packs for: a hint, any batch runs. Packed for 32 or 512 rows, 128- and 512-row batches ran
# alike; packed for 1 row, up to 12% slower.
GEMM_PACK_ROWS = 32


class PrepackedGemm:
    """oneDNN's float32 GEMM on a copy of the weight reordered into its blocked layout
    (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what inductor's ``freezing`` compiles
    to). Made on first use, so that start-up and batch-1 decode never pay for the copy (one more float32 weight in
    memory, ~0.45 s to pack SmolLM2-135M's 120 layer matrices). 17-35% less time than ``F.linear`` over those
    matrices at 64-512 rows on a 2-core Zen 3 (``benchmarks/bench_kernels.py --gemm``, two runs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias  # [out, in] float32, [out] float32 or None
        self.packed: torch.Tensor | None = None  # opaque oneDNN tensor, [out, in] logically

    @staticmethod
    def available(weight: torch.Tensor) -> bool:
        """Whether the prepacked GEMM runs ``weight`` here (float32 on a CPU this torch build can reorder for)."""
        return weight.dtype == torch.float32 and weight.device.type == "cpu" and _can_reorder()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] float32 -> [T, out]
        """y = x Wᵀ + b."""
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, GEMM_PACK_ROWS)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@functools.cache
def _can_reorder() -> bool:
    """Whether this torch build has oneDNN's reorder and it runs on this CPU (tried once on a small weight)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8), GEMM_PACK_ROWS)
    except RuntimeError:  # an op registered for a CPU it does not support
        return False
    return True


class KernelLinear(DenseLinear):
    """float32 / bfloat16 weight, small batches through the streaming kernel (``op``, the C++ ``LinearOp`` the
    decoder stack calls too), large ones through a GEMM (``PrepackedGemm`` for float32 weights, else F.linear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: ModuleType,
                 batch_invariant: bool = False) -> None:  # fmt: skip
        super().__init__(arena().adopt(weight).contiguous(), bias)  # streamed every step: 2 MiB pages
        bias32 = None if bias is None else bias.float()
        self.op = kernels.LinearOp("dense", [self.weight], bias32, batch_invariant)
        usable = not batch_invariant and PrepackedGemm.available(self.weight)
        self.gemm = PrepackedGemm(self.weight, bias32) if usable else None
        self.max_rows = kernel_row_limit("none", batch_invariant, self.weight.numel() if self.gemm else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        """y = x Wᵀ + b (float32 accumulation in the kernel)."""
        if x.shape[0] > self.max_rows or x.dtype == torch.float64:
            return self.large(x)
        if x.dtype == torch.float32:  # the common case, without no-op conversions (each costs a dispatch)
            return self.op(x)
        return self.op(x.float()).to(x.dtype)


    def large(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        """y = x Wᵀ + b as a GEMM: the prepacked one for float32, else F.linear (also the float64 reference)."""
        if self.gemm is not None and x.dtype == torch.float32:
            return self.gemm(x)
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class QuantizedLinear(DirectCallModule):
    """Weight-only quantized linear: int8 per channel, or GGUF Q8_0 / Q4_1 blocks; ``op`` (the C++ ``LinearOp``,
    None without the kernels) runs batches up to ``max_rows``."""

    def __init__(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None, fmt: str, kernels: ModuleType | None,
        packed: tuple[torch.Tensor, ...] | None = None, batch_invariant: bool = False,
    ) -> None:
        super().__init__()
        self.fmt = fmt
        self.max_rows = kernel_row_limit(fmt, batch_invariant)  # beyond: F.linear on dequant(W)
        # tuple of tensors, format-specific (the kernel's argument order): as stored in the file, or quantized here
        packed = packed if packed is not None else quantize(weight, fmt)
        self.packed = tuple(arena().adopt(t) for t in packed)  # streamed every step: 2 MiB pages
        self.bias32 = None if bias is None else bias.float()
        self.op = None if kernels is None else kernels.LinearOp(fmt, list(self.packed), self.bias32, batch_invariant)
        # the block formats' F.linear path (large batches) rounds x and dequantises W on every call: one C++ pass
        # each (the same bits as quant.py's torch reference, which makes several passes over float32 temporaries)
        self.block_kernels = kernels if fmt in BLOCK_FORMATS else None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the quantized one stands for."""
        if self.block_kernels is not None:
            return self.block_kernels.dequantize_blocks(self.fmt, list(self.packed))
        return dequantize(self.packed, self.fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        """y = x dequant(W)ᵀ + b, without materialising dequant(W) for small batches when the kernels exist."""
        x32 = x if x.dtype == torch.float32 else x.float()
        if self.op is None or x.shape[0] > self.max_rows:
            y = F.linear(self.rounded_input(x32), self.dequantized(), self.bias32)
        else:
            y = self.op(x32)  # the kernel makes x contiguous if it is not
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def rounded_input(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] float32
        """``x`` as this layer's kernel sees it: rounded to int8 blocks for the block formats, else unchanged."""
        if self.block_kernels is not None:
            return self.block_kernels.fake_quantize_activations(x)
        return quant.fake_quantize_activations(x) if self.fmt in BLOCK_FORMATS else x


def deferred_gemm_bytes(model: nn.Module) -> int:
    """Bytes the ``PrepackedGemm`` copies of ``model``'s layers will take once large batches have packed them (the
    KV cache is sized leaving this much free)."""
    return sum(m.weight.nbytes for m in model.modules() if isinstance(m, KernelLinear) and m.gemm is not None)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [out, in] int8, scale [out] float32) with w ≈ q · scale."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-30) / 127.0  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, ...]:
    """``weight`` [out, in] in format ``fmt`` (int8, q8_0, q4_1) as the tensors its kernel takes."""
    if fmt == "int8":
        return quantize_int8(weight)
    if weight.shape[1] % quant.QK:
        raise ValueError(f"{fmt} needs the input size to be a multiple of {quant.QK}, got {weight.shape[1]}")
    return quant.quantize_q8_0(weight) if fmt == "q8_0" else quant.quantize_q4_1(weight)


def dequantize(packed: tuple[torch.Tensor, ...], fmt: str) -> torch.Tensor:
    """The float32 weight [out, in] that ``quantize`` packed (the plain-torch reference of every kernel)."""
    if fmt == "int8":
        q, scale = packed
        return q.float() * scale[:, None]
    return quant.dequantize_q8_0(*packed) if fmt == "q8_0" else quant.dequantize_q4_1(*packed)


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, kernels: ModuleType | None,
    native: tuple[str, tuple[torch.Tensor, ...]] | None = None, batch_invariant: bool = False,
) -> nn.Module:
    """The fastest available layer computing ``x Wᵀ + b`` for ``weight`` [out, in] in the chosen format.

    ``native``: (format, tensors) of the same weight as stored in a GGUF file; used as is when its format is the
    one asked for, or for ``gguf`` (each weight as stored; float where it is stored as float).
    ``batch_invariant``: the kernel at every batch size (each output row is computed by the same instructions in
    the same order whatever the other rows are), never the F.linear fallback."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if native is not None and quantization in ("gguf", native[0]):
        return QuantizedLinear(None, bias, native[0], kernels, packed=native[1], batch_invariant=batch_invariant)
    if quantization not in ("none", "gguf"):
        return QuantizedLinear(weight, bias, quantization, kernels, batch_invariant=batch_invariant)
    usable = kernels is not None and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
    if not usable:
        return DenseLinear(weight, bias)
    return KernelLinear(weight, bias, kernels, batch_invariant)


def pack_linear_layers(model: nn.Module, quantization: str, kernels: ModuleType | None, native_of=None,
                       batch_invariant: bool = False) -> None:  # fmt: skip
    """Replace every ``nn.Linear`` in ``model`` by ``make_linear`` of its loaded weight (in place).
    ``native_of(qualified module name)``: its weight as stored in the file, (format, tensors) or None."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                native = native_of(f"{parent_name}.{name}".lstrip(".")) if native_of else None
                bias = None if child.bias is None else child.bias.data
                setattr(parent, name, make_linear(child.weight.data, bias, quantization, kernels, native, batch_invariant))
