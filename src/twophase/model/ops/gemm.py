"""A second way through the panel-kernel projections for many rows: torch's GEMM on a copy of the weight in another
dtype (bfloat16, ``--gemm-dtype``), which the C++ ``LinearOp`` takes from ``GEMM_MIN_ROWS`` rows on. On a CPU with
AMX / AVX512-BF16 it runs prefill chunks and wide decode steps many times faster than the float32 kernels, while
fewer rows (batch-1 decode) keep the kernels and their exact reads of the GGUF blocks."""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from twophase.model.ops.huge_pages import arena
from twophase.model.ops.linear import PanelLinear

# Rows from which a projection with a GEMM weight (``use_gemm_weights``) takes torch's bfloat16 GEMM instead of its
# panel kernel. SmolLM2's gate/up shape (3072 x 576) on 2 AMX Xeon cores: float32 panels 162 / 217 / 391 / 791 us at
# 8 / 16 / 32 / 64 rows, the bfloat16 GEMM 216 / 186 / 194 / 339 us (5.6 ms against 1.2 ms at 512). Block panels
# fold up to 7 rows without widening (``block_rows_folded``), reading the Q4_1 blocks once where the GEMM reads
# 2 bytes a weight: decode of the whole model on the same CPU, folded against the GEMM, 2 / 4 requests 282-304 against
# 284-304 and 368-400 against 246-255 tok/s, 8 requests 378-406 against 370-376, 12 requests 457 against 559-589.
GEMM_MIN_ROWS = 8
# The same threshold where the GEMM is our AVX512-BF16 dot-product kernel (a CPU without AMX, ``dot_products``): the
# folded block panels' step time jumps from 4 to 5 rows (their second pass of rows), the dot products' does not.
# Decode steps of the default model on 2 Zen 4 cores, two engines alternating in one process, medians of 3 rounds of
# ~22 steps (ms), dot products from 8 rows against from 5: 4 rows 11.8 / 11.7, 5 rows 17.9 / 14.0, 6 rows 22.7 /
# 16.9, 7 rows 24.0 / 16.3, 8 rows 16.3 / 15.9. From 2 rows: 2 rows 9.2 against 12.0, 3 rows 10.4 / 12.7, 4 rows
# 12.6 / 13.6 (session 27).
DOT_MIN_ROWS = 5
# Rows below which the GEMM runs on a copy oneDNN reordered once (``prepack_for_onednn``) instead of reordering the
# weight on every call: same shapes, 2 threads, bfloat16, packed for 32 rows: 3072 x 576 at 16 / 32 / 64 rows
# 96 / 126 / 223 us against 156 / 189 / 273, the same bits; at 544 rows 1,070 against 1,143 us, but 576 x 1536
# 820 against 668 us (and other bits), so prefill chunks keep at::linear.
PREPACKED_MAX_ROWS = 128
# The dot-product GEMM (``use_dot_weight``) runs every row count from its threshold on, prefill chunks included. It
# used to leave 128 rows and more to oneDNN except on weights with 4x as many outputs as inputs (gate/up), where it
# was faster: with x's rows read in place instead of packed, SmolLM2's shapes at 2,048 rows on 2 Zen 4 cores took
# qkv 5.8-6.1 / o 3.4-3.7 / gate/up 18.1-18.7 / down 8.5-9.1 ms on the dot products against oneDNN's 5.9-6.9 /
# 3.7-3.7 / 19.2-19.5 / 9.0-9.2 (with the conversions to and from bfloat16 it needs), and 2,048-token prefill steps,
# two engines alternating in one process, 1,198.6 against 1,238.4 ms (medians of 24) and 1,159.0 against 1,187.4.


# How many times the dot-product instruction's FLOP rate the float32 FMA's must reach before ``bf16_gemm`` sums on
# FMAs (``fma_tile``): it spends two integer operations a panel pair widening the weights that the dot products do not.
FMA_OVER_DOT = 1.25


@functools.lru_cache(maxsize=None)
def dot_sums_on_fma() -> bool:
    """Whether ``bf16_gemm`` should run its products as float32 FMAs on the weights widened in registers instead of
    AVX512-BF16 dot products: where this CPU's FMA instruction outruns its ``vdpbf16ps`` (measured once a process,
    ~20 ms; ``TWOPHASE_BF16_GEMM=dot`` or ``fma`` decides instead). 2 Zen 4 cores: vdpbf16ps 466 GFLOP/s, the FMA
    half that. 2 Emerald Rapids Xeon cores without AMX: vdpbf16ps 209 GFLOP/s, the FMA ~440."""
    choice = os.environ.get("TWOPHASE_BF16_GEMM", "auto")
    if choice in ("dot", "fma"):
        return choice == "fma"
    dot_rate, fma_rate = instruction_rate("bfloat16", 0.01), instruction_rate("float32", 0.01)
    if dot_rate is None or fma_rate is None:  # no kernels, or a build without one of the instructions
        return False
    return fma_rate > FMA_OVER_DOT * dot_rate


def instruction_rate(name: str, seconds: float, tries: int = 3) -> float | None:
    """FLOP/s of the kernels' matmul instruction for dtype ``name`` ("bfloat16": ``vdpbf16ps``, "float32": the widest
    FMA) on every torch thread at once, the best of ``tries`` runs of ``seconds``: a rate is what the instruction can
    do, and a run the host slowed says nothing about it (one comparison on 2 Zen 4 cores measured 370 GFLOP/s where
    the runs around it measured 461-466). ``dot_sums_on_fma`` decides on it, ``roofline.instruction_peak`` takes it as
    the compute floor. None where the kernels are not built or lack the instruction."""
    from twophase.model.ops.extension import load_kernels

    kernels = load_kernels()
    try:
        return max(kernels.instruction_peak(name, seconds) for _ in range(max(1, tries)))
    except (AttributeError, RuntimeError):  # no kernels (None), or a build without the instruction
        return None


def prepack_for_onednn(weight: torch.Tensor, rows: int = 32) -> torch.Tensor | None:
    """``weight`` [out, in] reordered into oneDNN's blocked layout for about ``rows`` rows
    (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing uses); None where torch has no oneDNN."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except (AttributeError, RuntimeError):
        return None


def use_gemm_weights(model: nn.Module, dtype: torch.dtype, min_rows: int | None = None,
                     dot_products: bool = False) -> int:
    """Give every panel-kernel projection of ``model`` a ``dtype`` copy of its weight [out, in] that torch's GEMM
    runs from ``min_rows`` rows on (``LinearOp.set_gemm_weight``: prefill chunks and wide decode steps, on AMX /
    AVX512-BF16 many times the float32 kernels' rate; rows rounded to ``dtype``, results float32). With
    ``dot_products`` (a CPU with AVX512-BF16 and no AMX, where oneDNN's small-M GEMM leaves much of the dot-product
    rate unused) on our AVX512-BF16 kernel at every row count (``use_dot_weight``), else below
    ``PREPACKED_MAX_ROWS`` rows on oneDNN's reordered copy and from there on the weight. Fewer rows keep the panels (batch-1 decode reads the blocks); ``min_rows`` defaults to
    ``DOT_MIN_ROWS`` where the dot products run, else ``GEMM_MIN_ROWS``. Returns how many projections took one."""
    dot_min_rows = DOT_MIN_ROWS if min_rows is None else min_rows
    gemm_min_rows = GEMM_MIN_ROWS if min_rows is None else min_rows
    count = 0
    gate_ups = {id(m.gate_up_proj) for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), PanelLinear)}
    for module in model.modules():
        if isinstance(module, PanelLinear):
            weight = module.unpacked_weight().to(dtype).contiguous()  # [out, in]
            gate_up = id(module) in gate_ups
            if dot_products and use_dot_weight(module.op, weight, dot_min_rows, dot_sums_on_fma(), gate_up):
                module.gemm_packed = None  # the dot-product panels are the only copy
            else:  # opaque: kept alive, not state
                module.register_buffer("gemm_weight", weight)
                module.gemm_packed = set_gemm_weight(module.op, weight, gemm_min_rows)
            count += 1
    return count


def gate_up_by_16(weight: torch.Tensor) -> torch.Tensor | None:
    """A gate / up weight [gate; up] ([2F, in]) with its rows by 16s: gate rows 16j .. 16j + 15, then up rows F + 16j ..
    F + 16j + 15, for j in order, so that each of ``bf16_gemm``'s 32-output panels holds 16 gate outputs and their up
    outputs, and its store applies SiLU-and-mul (``GEMM_STORE_SILU_MUL``); None where F is not a multiple of 16."""
    out, k = weight.shape
    if out % 32:
        return None
    return weight.view(2, out // 32, 16, k).transpose(0, 1).reshape(out, k)  # [F / 16, (gate, up), 16, in]


def use_dot_weight(op, weight: torch.Tensor, min_rows: int, fma: bool = False, gate_up: bool = False) -> bool:
    """``op`` takes ``weight`` (bfloat16 [out, in]) from ``min_rows`` rows on, at every row count from there, on the
    kernels' AVX512-BF16 dot-product GEMM (``bf16_gemm``: one panel of 32 outputs at a time, k in pairs; with ``fma``
    the same products summed on float32 FMAs, ``dot_sums_on_fma``); False
    (nothing set) where the kernels lack it or the shape does not suit it. On 2 Zen 4
    cores, SmolLM2's four layer shapes at 32 rows took 1.19-1.40x less time than oneDNN's reordered copy, at 8-16
    rows 1.5-2.5x less (``docs/runs/compare-cpu/README.md``, session 24). ``gate_up``: ``weight`` is a gate / up
    projection's, packed by 16s (``gate_up_by_16``) where its shape allows, so that SiLU-and-mul runs as the GEMM
    stores (``LinearOp.gated_unwidened``). Tried and dropped for GGUF block weights:
    widening each Q4_1 panel to bfloat16 in the thread's scratch instead of reading this 2-byte copy, 3.2x fewer bytes
    but ~5 ms of widening over the model's 120 matrices, 1.07-1.13x slower at 8-100 rows (session 27).
    The copy lies in the huge-page arena, as the panel kernels' weights do: a batched decode step streams it whole.
    32 rows over the 120 matrices, 2 Zen 4 cores, alternating in one process: 17.67 -> 17.17 ms (the head alone 4.57
    -> 4.47); 2,048 rows unchanged (1,054 / 1,056 ms)."""
    from twophase.model.ops.extension import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.bf16_gemm_available() or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        return False
    out, k = weight.shape
    cols = kernels.DOT_COLS
    by_16 = gate_up_by_16(weight) if gate_up else None
    packed = arena().empty((-(-out // cols), k // 2, cols, 2), torch.bfloat16)  # streamed: 2 MiB pages
    kernels.pack_bf16_gemm(weight if by_16 is None else by_16, packed)
    op.set_dot_weight(packed, min_rows, fma, by_16 is not None)  # [panels, in / 2, 32, 2]
    return True


def set_gemm_weight(op, weight: torch.Tensor, min_rows: int) -> torch.Tensor | None:
    """``op.set_gemm_weight`` with oneDNN's reordered copy where one call on it runs (a torch whose
    ``_linear_pointwise`` takes other arguments keeps ``at::linear`` at every row count); returns that copy or None."""
    packed = prepack_for_onednn(weight)
    if packed is not None and min_rows < PREPACKED_MAX_ROWS:
        op.set_gemm_weight(weight, min_rows, packed, PREPACKED_MAX_ROWS)
        try:
            op(torch.zeros(min_rows, weight.shape[1]))  # [min_rows, in]: the prepacked path
            return packed
        except RuntimeError:
            pass
    op.set_gemm_weight(weight, min_rows, None, 0)
    return None
