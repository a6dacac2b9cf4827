"""Linear layers behind one small interface: a method packs a weight once at load time, then each call maps
``x [T, in] -> [T, out]``.

Methods (``--quantization`` picks the weight format, the C++ kernels make it fast when they build):

- ``dense``: ``F.linear`` on the weight as loaded — the reference every other method is tested against.
- ``kernel``: the same float32/bfloat16 weight packed into column panels (``KernelLinear``) and run by our panel
  kernel at every batch size: at memory bandwidth for one row, at the FMA rate (a BLIS-style 4 x 24 micro-kernel)
  from a few rows on, faster than oneDNN's prepacked GEMM at 1-512 rows on the machine we measured. A float32
  weight loaded from a GGUF file's Q8_0 / Q4_1 blocks stays in those blocks (``BlockPanelLinear``: a quarter of the
  bytes or less to stream) and is widened to float32 panel by panel in the kernel, exactly: the same bits (up to 7
  rows without batch invariance multiply by the blocks' integers instead: within float32 rounding). With
  ``gemm.use_gemm_weights`` (``--gemm-dtype bfloat16``) 8+ rows (5+ on our dot-product GEMM) take a bfloat16 GEMM on
  a copy of the weight.
- ``int8``: weight-only int8 with one float32 scale per output channel (symmetric, round to nearest), in column
  panels through the same kernel (``KernelLinear`` with a scale).
- ``q8_0`` / ``q4_1``: GGUF's block formats (32 weights per block: ``d·q`` / ``d·q + m``), executed without
  dequantising to a full-precision copy. As in llama.cpp, activations are rounded to int8 blocks of 32 first
  (``quant.quantize_activations``), so each block's dot product is integer arithmetic (``maddubs``) — on the
  F.linear fallback too (``rounded_input``), so both paths see the same activations. Where the kernels have
  AVX512-VNNI, 3 rows and more take the int8 GEMM (``QuantizedLinear.use_int8_gemm``, ``csrc/gemm_int8.cpp``) at
  every row count instead: the same quantities, float32 sums in another order.

Batch invariance: each kernel computes an output row with the same instructions in the same order whatever the
other rows of the batch are; not so the quantized formats' F.linear fallback beyond ``MAX_KERNEL_ROWS`` (a GEMM,
blocked by batch size) and the panel kernel's one-row variant (two FMA chains per output). ``--deterministic``
(``batch_invariant``) keeps every batch size on the kernels and one row on the batches' summation order, so
batching and chunked prefill never change a request's logits.

Without the kernels every method still runs (plain torch: dequantise then ``F.linear``), slower but equal.
"""

from __future__ import annotations

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
# --quantization values whose layers run GGUF blocks (gguf: those a GGUF file stores), rounding activations to int8
BLOCK_QUANTIZATIONS = (*BLOCK_FORMATS, "gguf")
# Beyond this many rows F.linear on the dequantised weight takes over from the block formats' kernels (which stream
# each weight row per row tile); measured over SmolLM2-135M's 120 layer matrices on a 2-core Zen 3
# (benchmarks/bench_kernels.py), both kernels still winning at 128 rows, which F.linear pays a dequantisation per
# call for. float32 / bfloat16 / int8 weights have no limit: their column-panel kernel runs at the FMA rate at
# every batch size.
MAX_KERNEL_ROWS = {"q8_0": 128, "q4_1": 128}


# Rows from which the block formats run on the int8 GEMM (``QuantizedLinear.use_int8_gemm``, a CPU with AVX512-VNNI).
# Decode steps of the default model under --quantization gguf on 2 Zen 4 cores, two engines alternating in one
# process, medians of 3 (ms), the kernels below 8 rows against the int8 GEMM from 2 rows: 2 requests 7.69 / 9.22,
# 3 requests 9.80 / 8.14, 4 requests 12.56 / 9.01, 6 requests 22.21 / 9.86, 7 requests 21.82 / 11.16. One row stays
# on the kernels: 157.0 against 128.9 tok/s at batch 1 (their 0.625-1.06 bytes a weight against its 1.375).
INT8_GEMM_MIN_ROWS = 3


def kernel_row_limit(fmt: str, batch_invariant: bool) -> float:
    """Rows up to which a block-format layer (``fmt``: q8_0, q4_1) runs its kernel (beyond: F.linear on the
    dequantised weight); every row when batch-invariant."""
    return math.inf if batch_invariant else MAX_KERNEL_ROWS[fmt]


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


def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def pack_panels(weight: torch.Tensor, kernels: ModuleType, empty=_torch_empty) -> torch.Tensor:
    """``weight`` [N, K] as the panel kernel reads it: column panels [ceil(N / 24), K, 24], k-major
    (``panels[p][k][j] = weight[24p + j][k]``, rows past N zero), in a tensor from ``empty(shape, dtype)``."""
    panels, k, width = kernels.panel_shape(*weight.shape)
    out = empty((panels, k, width), weight.dtype)
    padded = F.pad(weight, (0, 0, 0, panels * width - weight.shape[0]))  # [P * 24, K]
    return out.copy_(padded.view(panels, width, k).transpose(1, 2))


def pack_block_panels(fmt: str, packed: tuple[torch.Tensor, ...], kernels: ModuleType, empty=_torch_empty) -> torch.Tensor:
    """(qs, d[, m]) of a weight [N, K] in ``quant.py``'s layout as block panels, the C++ PQ8_0 / PQ4_1
    (``kernels.block_panel_shape``: uint8 [ceil(N / 24), K/32, bytes]), in a tensor from ``empty(shape, dtype)``: per
    column panel and block of 32 k, d [24] float16, (q4_1: m [24] float16,) then q as [32 k][24 rows], q8_0 one int8
    each, q4_1 one byte per row for each pair of k (even k in the low nibble). Rows past N are zero. Written in one
    parallel C++ pass (the torch version, ``pack_block_panels_reference``, took ~0.4 s of the default model's start)."""
    n, nb = packed[1].shape  # d [N, K/32]
    out = empty(tuple(kernels.block_panel_shape(fmt, n, nb * quant.QK)), torch.uint8)
    kernels.pack_block_panels_(out, fmt, list(packed))
    return out


def pack_block_panels_reference(fmt: str, packed: tuple[torch.Tensor, ...], kernels: ModuleType) -> torch.Tensor:
    """``pack_block_panels`` in torch operations: the reference the C++ packing is tested against."""
    d = packed[1]  # [N, K/32]
    n, nb = d.shape
    shape = kernels.block_panel_shape(fmt, n, nb * quant.QK)
    width = kernels.panel_shape(n, nb * quant.QK)[2]
    panels, pad = shape[0], shape[0] * width - n
    q = packed[0].view(torch.uint8).reshape(n, nb, quant.QK) if fmt == "q8_0" else quant.unpack_nibbles(packed[0])
    q = F.pad(q, (0, 0, 0, 0, 0, pad)).reshape(panels, width, nb, quant.QK).permute(0, 2, 3, 1)  # [P, nb, 32, 24]
    if fmt == "q4_1":
        q = q[:, :, 0::2] | (q[:, :, 1::2] << 4)  # [P, nb, 16, 24]
    scales = [F.pad(s.view(torch.int16), (0, 0, 0, pad)).reshape(panels, width, nb).transpose(1, 2).contiguous()
              for s in packed[1:]]  # [P, nb, 24] float16 bits each
    parts = [s.view(torch.uint8) for s in scales] + [q.reshape(panels, nb, -1)]
    return torch.cat(parts, dim=-1)


class PanelLinear(DirectCallModule):
    """A projection run by the panel kernel (``op``, the C++ ``LinearOp`` the decoder stack calls too), at every batch
    size; subclasses pack the weight and give it back (``unpacked_weight``, the float64 reference path)."""

    op = None
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        """y = x Wᵀ + b (float32 accumulation in the kernel; float64 through F.linear, the reference)."""
        if x.dtype == torch.float32:  # the common case, without no-op conversions (each costs a dispatch)
            return self.op(x)
        if x.dtype == torch.float64:
            return F.linear(x, self.unpacked_weight().double(), None if self.bias is None else self.bias.double())
        return self.op(x.float()).to(x.dtype)

    def unpacked_weight(self) -> torch.Tensor:  # [out, in]
        """The weight as loaded."""
        raise NotImplementedError


class KernelLinear(PanelLinear):
    """A float32 / bfloat16 weight, or weight-only int8 with one scale per output, packed once into column panels of
    24 outputs, k-major (``pack_panels``), and every batch size through the panel kernel
    (``op``, the C++ ``LinearOp`` the decoder stack calls too): at memory bandwidth for one row, at the FMA rate from
    a few rows on. The panels are the only copy of the weight; ``unpacked_weight`` gives it back as loaded (the
    float64 reference path)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: ModuleType,
                 batch_invariant: bool = False, scale: torch.Tensor | None = None) -> None:  # fmt: skip
        """``weight`` [out, in] float32 / bfloat16, or int8 with ``scale`` [out] (w = q · scale)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        panels = pack_panels(weight, kernels, arena().empty)
        self.register_buffer("panels", panels)  # [ceil(out / 24), in, 24], streamed every step: in 2 MiB pages
        self.register_buffer("scale", None if scale is None else scale.float())  # [out] (int8) or None
        self.register_buffer("bias", bias)  # [out] or None
        bias32 = None if bias is None else bias.float()
        kind = "panels" if scale is None else "int8"
        self.op = kernels.LinearOp(kind, [panels] if scale is None else [panels, self.scale], bias32, batch_invariant,
                                   self.out_features)
        self.max_rows = math.inf  # the stack's row limit (``ops/stack.py``): the panels take any batch

    def unpacked_weight(self) -> torch.Tensor:  # [out, in]
        """The weight as loaded (int8: dequantised, q · scale), copied out of the panels."""
        weight = unpanel(self.panels, self.in_features, self.out_features)
        return weight if self.scale is None else weight.float() * self.scale[:, None]


def unpanel(panels: torch.Tensor, in_features: int, out_features: int) -> torch.Tensor:
    """Column panels [P, in, 24] back to the weight [out, in] (a copy)."""
    return panels.permute(0, 2, 1).reshape(-1, in_features)[:out_features]


class BlockPanelLinear(PanelLinear):
    """A float32 weight loaded from GGUF Q8_0 / Q4_1 blocks, kept as those blocks rearranged per column panel
    (``pack_block_panels``): 1.06 / 0.625 bytes a weight instead of 4. The kernel widens each panel to float32 (d · q
    (+ m): exact, one rounding at most, the loader's own) and runs the float32 panels' arithmetic, so every output
    has the bits ``KernelLinear`` gives for the float32 weight; a few rows without batch invariance (up to 7 on
    AVX-512, 3 on AVX2) are multiplied by the blocks' integers and scaled per block, the panel decoded once for all of
    them (C++ ``block_rows_folded``: within float32 rounding of those bits, no widening). Built only through ``exact_block_panels``, which checks
    that the blocks widen to the loaded weight bit for bit."""

    def __init__(self, native: tuple[str, tuple[torch.Tensor, ...]], bias: torch.Tensor | None, kernels: ModuleType,
                 batch_invariant: bool = False) -> None:  # fmt: skip
        """``native``: (q8_0 or q4_1, its tensors as quant.py lays them out) of a weight [out, in]."""
        super().__init__()
        fmt, packed = native
        self.fmt = fmt
        self.out_features, self.in_features = packed[1].shape[0], packed[1].shape[1] * quant.QK
        panels = pack_block_panels(fmt, packed, kernels, arena().empty)
        self.register_buffer("panels", panels)  # [ceil(out / 24), in / 32, bytes], streamed every step
        self.register_buffer("bias", bias)  # [out] or None
        self.kernels = kernels
        bias32 = None if bias is None else bias.float()
        self.op = kernels.LinearOp("block_panels", [panels], bias32, batch_invariant, self.out_features)
        self.max_rows = math.inf

    def unpacked_weight(self) -> torch.Tensor:  # [out, in] float32
        """The float32 weight the blocks stand for."""
        return unpanel(self.kernels.widen_block_panels(self.panels), self.in_features, self.out_features)


def exact_block_panels(weight: torch.Tensor, bias: torch.Tensor | None, native: tuple[str, tuple[torch.Tensor, ...]],
                       kernels: ModuleType, batch_invariant: bool = False) -> BlockPanelLinear | None:  # fmt: skip
    """``weight`` [out, in] float32 as a ``BlockPanelLinear`` of its stored blocks when those widen to exactly its
    values; else None (a file whose float32 values came some other way keeps its float32 panels)."""
    if native[0] not in BLOCK_FORMATS or weight.dtype != torch.float32 or native[1][1].shape[1] * quant.QK != weight.shape[1]:
        return None
    layer = BlockPanelLinear(native, bias, kernels, batch_invariant)
    return layer if kernels.block_panels_equal(layer.panels, weight) else None  # widened in place, no float32 copy


class QuantizedLinear(DirectCallModule):
    """Weight-only quantized linear: GGUF Q8_0 / Q4_1 blocks, whose ``op`` (the C++ ``LinearOp``) runs batches up to
    ``max_rows``; or any quantized format (int8 per channel too) in plain torch when there are no kernels
    (``op`` None). int8 with the kernels is a ``KernelLinear``."""

    def __init__(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None, fmt: str, kernels: ModuleType | None,
        packed: tuple[torch.Tensor, ...] | None = None, batch_invariant: bool = False,
    ) -> None:
        super().__init__()
        self.fmt = fmt
        # tuple of tensors, format-specific (the kernel's argument order): as stored in the file, or quantized here
        packed = packed if packed is not None else quantize(weight, fmt)
        self.packed = tuple(arena().adopt(t) for t in packed)  # streamed every step: 2 MiB pages
        self.bias32 = None if bias is None else bias.float()
        # the block formats' F.linear path (large batches) rounds x and dequantises W on every call: one C++ pass
        # each (the same bits as quant.py's torch reference, which makes several passes over float32 temporaries)
        self.block_kernels = kernels if fmt in BLOCK_FORMATS else None
        self.op = None
        if self.block_kernels is not None:
            self.op = kernels.LinearOp(fmt, list(self.packed), self.bias32, batch_invariant)
        self.max_rows = kernel_row_limit(fmt, batch_invariant) if self.op is not None else 0  # beyond: F.linear
        self.int8_gemm: list[torch.Tensor] | None = None  # int8_gemm's tensors (``use_int8_gemm``)
        if self.op is not None and kernels.int8_gemm_available() and not batch_invariant:
            self.use_int8_gemm(INT8_GEMM_MIN_ROWS)

    def use_int8_gemm(self, min_rows: int) -> None:
        """From ``min_rows`` rows on, run the blocks on the AVX512-VNNI int8 GEMM (``csrc/gemm_int8.cpp``) instead of
        the kernel, at every row count (no F.linear fallback): the blocks as int8 values with their scales (and
        mins) by panel. The same quantities as the kernel (x rounded to int8 blocks, exact integer sums), summed in
        float32 in another order."""
        kernels = self.block_kernels
        if self.fmt == "q8_0":
            qs, d = self.packed  # [N, K] int8, [N, K/32] float16
            tensors = kernels.pack_int8_gemm(qs, d.float())
        else:
            qs, d, m = self.packed  # [N, K/2] nibbles, [N, K/32] float16 each
            values = quant.unpack_nibbles(qs).reshape(qs.shape[0], -1).to(torch.int8)  # [N, K], 0..15
            tensors = kernels.pack_int8_gemm(values, d.float(), m.float())
        self.int8_gemm = [arena().adopt(t) for t in tensors]
        self.op.set_int8_gemm(self.int8_gemm, min_rows)
        self.max_rows = math.inf

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


def builds_from_blocks(fmt: str | None, quantization: str, kernels: ModuleType | None, dtype: torch.dtype,
                       device: torch.device) -> bool:  # fmt: skip
    """Whether ``make_linear`` builds a layer whose weight a GGUF file stores as ``fmt`` blocks (None: not stored as
    blocks our kernels run) from those blocks alone, never reading the float weight: executed as stored
    (``quantization`` gguf or ``fmt``), or, float32 on CPU with the kernels, widened exactly (``BlockPanelLinear``)."""
    if fmt is None:
        return False
    if quantization in ("gguf", fmt):
        return True
    on_cpu = kernels is not None and device.type == "cpu"
    return quantization == "none" and on_cpu and dtype == torch.float32 and fmt in BLOCK_FORMATS


def make_linear(
    weight: torch.Tensor | None, bias: torch.Tensor | None, quantization: str, kernels: ModuleType | None,
    native: tuple[str, tuple[torch.Tensor, ...]] | None = None, batch_invariant: bool = False,
) -> nn.Module:
    """The fastest available layer computing ``x Wᵀ + b`` for ``weight`` [out, in] in the chosen format.

    ``native``: (format, tensors) of the same weight as stored in a GGUF file; used as is when its format is the
    one asked for, or for ``gguf`` (each weight as stored; float where it is stored as float); without quantization,
    a float32 weight those blocks widen to exactly runs from them (``BlockPanelLinear``).
    ``weight`` None: not loaded, because the file's float32 values of it are by definition the blocks widened (the
    loader's dequantisation is the widening's arithmetic), so ``builds_from_blocks`` must hold: the layer is built
    from ``native`` without the check.
    ``batch_invariant``: the kernel at every batch size (each output row is computed by the same instructions in
    the same order whatever the other rows are), never the F.linear fallback."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    fmt = None if native is None else native[0]
    if fmt is not None and quantization in ("gguf", fmt):
        return QuantizedLinear(None, bias, fmt, kernels, packed=native[1], batch_invariant=batch_invariant)
    if weight is None:
        if not builds_from_blocks(fmt, quantization, kernels, torch.float32, torch.device("cpu")):
            raise ValueError("a linear layer without its loaded weight needs stored blocks its kernel widens exactly")
        return BlockPanelLinear(native, bias, kernels, batch_invariant)
    if builds_from_blocks(fmt, quantization, kernels, weight.dtype, weight.device):
        exact = exact_block_panels(weight, bias, native, kernels, batch_invariant)
        if exact is not None:
            return exact
    on_cpu = kernels is not None and weight.device.type == "cpu"
    if quantization == "int8" and on_cpu:
        q, scale = quantize_int8(weight)
        return KernelLinear(q, bias, kernels, batch_invariant, scale=scale)
    if quantization not in ("none", "gguf"):
        return QuantizedLinear(weight, bias, quantization, kernels, batch_invariant=batch_invariant)
    if not on_cpu or weight.dtype not in (torch.float32, torch.bfloat16):
        return DenseLinear(weight, bias)
    return KernelLinear(weight, bias, kernels, batch_invariant)


def pack_linear_layers(model: nn.Module, quantization: str, kernels: ModuleType | None, native_of=None,
                       batch_invariant: bool = False) -> None:  # fmt: skip
    """Replace every ``nn.Linear`` in ``model`` by ``make_linear`` of its loaded weight (in place); a weight left on
    the meta device was not loaded (see ``make_linear``: built from its stored blocks, whose shape must match).
    ``native_of(qualified module name)``: its weight as stored in the file, (format, tensors) or None."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                qualified = f"{parent_name}.{name}".lstrip(".")
                native = native_of(qualified) if native_of else None
                bias = None if child.bias is None else child.bias.data
                weight = None if child.weight.is_meta else child.weight.data
                if weight is None and native is not None:
                    check_stored_shape(native, child.weight.shape, qualified)
                setattr(parent, name, make_linear(weight, bias, quantization, kernels, native, batch_invariant))


def check_stored_shape(native: tuple[str, tuple[torch.Tensor, ...]], shape: torch.Size, name: str) -> None:
    """Raise ValueError when blocks stored for ``name`` (format, tensors) hold another shape than the model's
    ``shape`` [out, in] (what loading its float32 values would have caught)."""
    scales = native[1][1]  # [out, in / 32]: one scale a block, in every block format
    stored = (scales.shape[0], scales.shape[1] * quant.QK)
    if stored != tuple(shape):
        raise ValueError(f"{name}: the file stores a {stored[0]} x {stored[1]} weight, the model needs {shape[0]} x {shape[1]}")
