"""The C++ CPU kernels against float64 plain-torch references (skipped when they cannot build, unless CI)."""

from __future__ import annotations

import os

import pytest
import torch

from twophase.engine import hardware
from twophase.model.ops import extension
from twophase.model.ops.linear import pack_panels
from twophase.model.ops.quant import (
    dequantize_q4_1,
    dequantize_q8_0,
    fake_quantize_activations,
    from_gguf_q4_1,
    from_gguf_q8_0,
    pack_nibbles,
    quantize_q4_1,
    quantize_q8_0,
)
from twophase.model.attention import INT8_ROW_EXTRA, dequantize_int8_rows, quantize_int8_rows, reference_paged_attention

K = extension.load_kernels()
if K is None:
    if os.environ.get("CI"):
        raise RuntimeError("twophase C++ kernels failed to build (CI requires them)")
    pytest.skip("twophase C++ kernels unavailable", allow_module_level=True)

SHAPES = [(131, 577), (64, 64), (5, 1), (7, 33)]  # (N, K): odd N tails, odd K tails, K < 8


def panels_of(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (float32 / bfloat16 / int8) packed into the panel kernel's column panels."""
    return pack_panels(w, K)


def assert_dot_close(y: torch.Tensor, ref: torch.Tensor, absprod: torch.Tensor) -> None:
    """fp32 dot products vs a float64 oracle: the error of a K-term fp32 sum is bounded by ~K*u*sum|x*w|
    (u = 2**-24); typical error is ~sqrt(K)*u*sum|x*w|. 1e-5*sum|x*w| sits between the two for K <= 600."""
    err = (y.double() - ref).abs()
    bound = 1e-5 * absprod + 1e-6
    assert (err <= bound).all(), f"max err {err.max():.3g}, at bound {bound.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "q8_0", "q4_1"])
def test_batch_invariant_kernels_give_each_row_its_result_alone(fmt: str) -> None:
    """With batch_invariant every row of an M-row call of a projection's ``LinearOp`` (what the layers and the decoder
    stack call) equals that row computed alone, bit for bit, at every tile shape (M = 2, 3, 4, 7, 130)."""
    g = torch.Generator().manual_seed(7)
    n = 67
    k = 605 if fmt in ("fp32", "bf16", "int8") else 576  # dense: not a multiple of 8 (scalar tail); blocks: whole
    w = torch.randn(n, k, generator=g)
    args = {
        "fp32": lambda: (panels_of(w),), "bf16": lambda: (panels_of(w.bfloat16()),), "q8_0": lambda: quantize_q8_0(w),
        "q4_1": lambda: quantize_q4_1(w),
        "int8": lambda: (panels_of(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)),
                         torch.rand(n, generator=g)),
    }[fmt]()
    op = K.LinearOp({"fp32": "panels", "bf16": "panels"}.get(fmt, fmt), list(args), None, True, n)
    for m in (2, 3, 4, 7, 130):
        x = torch.randn(m, k, generator=g)
        together = op(x)
        alone = torch.cat([op(x[i : i + 1]) for i in range(m)])
        assert torch.equal(together, alone), f"{fmt}, M={m}"


needs_bf16_dot = pytest.mark.skipif(not K.bf16_gemm_available(), reason="the kernels were built without AVX512-BF16")


@needs_bf16_dot
# N tails below / above 16 of 32; k of 1 pair to 768 (rows read in place, k pairs apart); 600 x 576: x rounded to
# bfloat16 over the threads (from 256K values)
@pytest.mark.parametrize(("n", "k"), [(960, 576), (67, 1536), (5, 2), (33, 18), (40, 68)])
@pytest.mark.parametrize("m", [1, 8, 13, 32, 127, 600])
@pytest.mark.parametrize("fma", [False, True])
def test_bf16_gemm_against_float64(m: int, n: int, k: int, fma: bool) -> None:
    """bf16_gemm: bfloat16 products (exact in float32), float32 sums, the result rounded once to bfloat16; on the
    dot-product instruction or (fma) on float32 FMAs, whichever CPU runs the test. Against the float64 product of the
    same bfloat16 inputs: within half a bfloat16 step of the result (up to 2**-8 relative) plus the float32 sum's error
    (1e-5 * sum|x*w|, as assert_dot_close); float32 out is the bfloat16 out widened, bit for bit, and float32 x is
    rounded to bfloat16 first. 127 and 600 rows take the panels in groups (from 8 row blocks)."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g)
    packed = K.pack_bf16_gemm(w)  # [ceil(n / 32), k / 2, 32, 2]
    assert packed.shape == (-(-n // 32), k // 2, 32, 2)
    y16, y32 = K.bf16_gemm(x.bfloat16(), packed, n, True, fma), K.bf16_gemm(x, packed, n, False, fma)
    assert y16.dtype == torch.bfloat16 and y32.dtype == torch.float32 and y16.shape == (m, n)
    assert torch.equal(y16.float(), y32)
    xd, wd = x.bfloat16().double(), w.double()
    ref = xd @ wd.T
    bound = 2.0**-8 * ref.abs() + 1e-5 * (xd.abs() @ wd.abs().T) + 1e-6
    err = (y32.double() - ref).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}"


@needs_bf16_dot
@pytest.mark.parametrize("m", [1, 13, 32, 600])
@pytest.mark.parametrize("fma", [False, True])
def test_bf16_gemm_gate_up_by_16(m: int, fma: bool) -> None:
    """A gate / up weight packed by 16s (``gate_up_by_16``) gives, stored as ``GEMM_STORE_GATE_UP``, the unpacked
    weight's result bit for bit (each output is the same chain over k, only its panel moved), and stored as
    ``GEMM_STORE_SILU_MUL`` what ``silu_and_mul_widened`` makes of it, bit for bit. F = 208: 13 panels; 600 rows take
    the panels in groups."""
    from twophase.model.ops.gemm import gate_up_by_16

    g = torch.Generator().manual_seed(m)
    f, k = 208, 96
    w, x = torch.randn(2 * f, k, generator=g).bfloat16(), torch.randn(m, k, generator=g) * 2
    plain, by_16 = K.pack_bf16_gemm(w), K.pack_bf16_gemm(gate_up_by_16(w))
    for bf16_out in (False, True):
        expected = K.bf16_gemm(x, plain, 2 * f, bf16_out, fma)
        assert torch.equal(K.bf16_gemm(x, by_16, 2 * f, bf16_out, fma, K.GEMM_STORE_GATE_UP), expected)
    fused = K.bf16_gemm(x, by_16, 2 * f, True, fma, K.GEMM_STORE_SILU_MUL)
    assert fused.shape == (m, f) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, K.silu_and_mul_widened(K.bf16_gemm(x, plain, 2 * f, True, fma)))
    assert gate_up_by_16(w[:-16]) is None  # F = 207.5 rows a half: not by 16s
    with pytest.raises(RuntimeError, match="multiple of 32"):
        K.bf16_gemm(x, K.pack_bf16_gemm(w[:-16]), 2 * f - 16, False, fma, K.GEMM_STORE_GATE_UP)
    with pytest.raises(RuntimeError, match="bfloat16"):
        K.bf16_gemm(x, by_16, 2 * f, False, fma, K.GEMM_STORE_SILU_MUL)


@needs_bf16_dot
@pytest.mark.parametrize("fma", [False, True])
def test_bf16_gemm_rows_do_not_depend_on_the_batch(fma: bool) -> None:
    """Each output is one chain over k in order (dot products, or FMAs), whatever tile its row falls in and in
    whatever order the panels go: every row of an M-row call equals that row alone, bit for bit (M = 2 .. 2,048
    spreads rows over tiles of 1-12; from 8 row blocks the panels go in groups)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(2000, 576, generator=g).bfloat16()  # 63 panels: groups of 14 and a shorter last one
    packed = K.pack_bf16_gemm(w)
    for m in (2, 7, 12, 13, 32, 127, 2048):
        x = torch.randn(m, 576, generator=g)
        together = K.bf16_gemm(x, packed, 2000, False, fma)
        alone = torch.cat([K.bf16_gemm(x[i : i + 1], packed, 2000, False, fma) for i in range(m)])
        assert torch.equal(together, alone), m


@needs_bf16_dot
def test_bf16_gemm_fma_sums_the_dot_products_products() -> None:
    """The FMA path forms the dot-product path's products (bfloat16 x, bfloat16 w) and differs only in the order
    float32 sums them: where every partial sum is exact (small integers), both give the exact sum rounded once to
    bfloat16, bit for bit."""
    g = torch.Generator().manual_seed(12)
    w = torch.randint(-8, 9, (70, 96), generator=g).bfloat16()
    x = torch.randint(-8, 9, (40, 96), generator=g).float()
    packed = K.pack_bf16_gemm(w)
    exact = x.double() @ w.double().T  # integers up to 96 * 64: every partial sum exact in float32, in any order
    dot, fma = K.bf16_gemm(x, packed, 70, False, False), K.bf16_gemm(x, packed, 70, False, True)
    assert torch.equal(dot, fma)
    assert torch.equal(fma, exact.float().bfloat16().float())


def test_bf16_gemm_packs_into_a_given_tensor() -> None:
    """pack_bf16_gemm(w, out) (the engine's copy in huge-page memory) writes out whatever it held, the last panel's
    columns past N as zeros, the same bytes as the tensor it allocates itself; a wrong shape or dtype is refused."""
    g = torch.Generator().manual_seed(5)
    for n in (64, 67):  # whole panels, and a tail of 3
        w = torch.randn(n, 576, generator=g).bfloat16()
        own = K.pack_bf16_gemm(w)
        given = torch.full(own.shape, float("nan"), dtype=torch.bfloat16)
        assert K.pack_bf16_gemm(w, given) is not None
        assert torch.equal(given.view(torch.int16), own.view(torch.int16)), n
    with pytest.raises(RuntimeError, match="out must be"):
        K.pack_bf16_gemm(w, torch.empty(2, 288, 32, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out must be"):
        K.pack_bf16_gemm(w, torch.empty(own.shape, dtype=torch.float32))


def test_bf16_gemm_checks_its_arguments() -> None:
    """Odd K is refused when packing; a weight of another K or N, or a build without AVX512-BF16, when multiplying."""
    with pytest.raises(RuntimeError, match="even"):
        K.pack_bf16_gemm(torch.zeros(4, 5, dtype=torch.bfloat16))
    packed = K.pack_bf16_gemm(torch.zeros(40, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="AVX512-BF16" if not K.bf16_gemm_available() else "columns"):
        K.bf16_gemm(torch.zeros(3, 10), packed, 40, False)
    if K.bf16_gemm_available():
        with pytest.raises(RuntimeError, match="n does not match"):
            K.bf16_gemm(torch.zeros(3, 8), packed, 70, False)


@pytest.mark.parametrize("m", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_panel_linear(m: int, dtype: torch.dtype, with_bias: bool, batch_invariant: bool) -> None:
    """The column-panel kernel at one row (both orders), every tile height (M % 4) and past a row chunk (300 > 256),
    N a multiple of the panel width or not, against float64."""
    g = torch.Generator().manual_seed(m)
    for n, k in SHAPES + [(48, 40)]:
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g).to(dtype)  # bf16 values are exact in float64
        b = torch.randn(n, generator=g) if with_bias else None
        ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
        y = K.panel_linear(x, panels_of(w), n, b, batch_invariant)
        assert_dot_close(y, ref, x.double().abs() @ w.double().abs().T)


def test_panels_hold_the_weight_and_check_their_arguments() -> None:
    """Packing is a layout change only (unpacking gives the weight back, padding rows are zero), and a panel tensor
    of the wrong shape or a row count that does not fit is refused."""
    w = torch.randn(50, 7)
    panels = panels_of(w)
    assert panels.shape == (3, 7, 24)
    assert torch.equal(panels.permute(0, 2, 1).reshape(-1, 7)[:50], w)
    assert not panels.permute(0, 2, 1).reshape(-1, 7)[50:].any()
    with pytest.raises(RuntimeError, match="size"):
        pack_panels(w, K, lambda shape, dtype: torch.empty(2, 7, 24, dtype=dtype))
    with pytest.raises(RuntimeError, match="does not fit"):
        K.panel_linear(torch.randn(1, 7), panels, 80)
    with pytest.raises(RuntimeError, match="scale goes with int8"):
        K.panel_linear(torch.randn(1, 7), panels, 50, scale=torch.ones(50))


@pytest.mark.parametrize("fmt", ["fp32", "int8", "q8_0", "q4_1"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_gated_projection_gives_silu_and_mul_of_the_projection_bit_for_bit(fmt: str, batch_invariant: bool) -> None:
    """A gate / up projection's ``silu_gated`` (SiLU-and-mul applied as the panel kernels store; what the decoder stack
    and the layers call) equals ``silu_and_mul`` of the projection's output bit for bit: at one row (two chains),
    the folded rows of block panels (2, 3), every tile height and past a row chunk (300 > 256); with whole panels a
    half (N = 96, 144) and without (N = 50: the two ops in turn); with a bias (panels and int8)."""
    g = torch.Generator().manual_seed(11)
    k = 96
    for n in (96, 144, 50):
        w = torch.randn(n, k, generator=g)
        bias = torch.randn(n, generator=g) if fmt in ("fp32", "int8") else None
        if fmt == "fp32":
            op = K.LinearOp("panels", [panels_of(w)], bias, batch_invariant, n)
        elif fmt == "int8":
            q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            op = K.LinearOp("int8", [panels_of(q), torch.rand(n, generator=g) / 32], bias, batch_invariant, n)
        else:
            packed = quantize_q8_0(w) if fmt == "q8_0" else quantize_q4_1(w)
            panels = torch.empty(K.block_panel_shape(fmt, n, k), dtype=torch.uint8)
            K.pack_block_panels_(panels, fmt, list(packed))
            op = K.LinearOp("block_panels", [panels], bias, batch_invariant, n)
        for m in (1, 2, 3, 5, 32, 300):
            x = torch.randn(m, k, generator=g) * 3
            gated = op.silu_gated(x)
            assert gated.shape == (m, n // 2)
            assert torch.equal(gated, K.silu_and_mul(op(x))), (n, m)
    with pytest.raises(RuntimeError, match="whole panels"):  # the kernel itself takes only whole panels a half
        K.panel_linear(torch.randn(2, k), panels_of(torch.randn(50, k)), 50, gated=True)


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_int8(m: int, with_bias: bool) -> None:
    """int8 panels with one scale per output, y = (x @ q.T) * scale + bias."""
    g = torch.Generator().manual_seed(100 + m)
    for n, k in SHAPES:
        x = torch.randn(m, k, generator=g)
        wq = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, generator=g) / 64
        b = torch.randn(n, generator=g) if with_bias else None
        ref = (x.double() @ wq.double().T) * s.double() + (b.double() if with_bias else 0)
        absprod = (x.double().abs() @ wq.double().abs().T) * s.double()
        assert_dot_close(K.panel_linear(x, panels_of(wq), n, b, scale=s), ref, absprod)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 17, 64])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_block_format_kernels(m: int, fmt: str) -> None:
    """The block-format kernels round x to int8 blocks exactly as quant.quantize_activations does (one element
    rounded differently would move the result by ~max|x|/127 · |w|, far above the bound), then dot in integers;
    the oracle is float64 on the dequantised weights and activations."""
    g = torch.Generator().manual_seed(400 + m)
    for n, k in [(131, 576), (7, 32), (64, 1536)]:
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
        x[0, :32] = 0.0  # an all-zero block: scale 0
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g)
        packed = quantize_q8_0(w) if fmt == "q8_0" else quantize_q4_1(w)
        wd = (dequantize_q8_0(*packed) if fmt == "q8_0" else dequantize_q4_1(*packed)).double()
        xd = fake_quantize_activations(x).double()
        ref = xd @ wd.T + b.double()
        y = getattr(K, "linear_" + fmt)(x, *packed, b)
        assert_dot_close(y, ref, xd.abs() @ wd.abs().T)


def test_q8_0_round_trip_exact() -> None:
    g = torch.Generator().manual_seed(1)
    n, k = 6, 96
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g)
    q[..., 0] = 127  # amax = 127 * d, so the quantizer recovers d exactly
    d = 2.0 ** -torch.randint(0, 10, (n, k // 32), generator=g).float()  # powers of two: 1/d exact
    w = (q * d[..., None]).reshape(n, k)
    qs, d2 = quantize_q8_0(w)
    assert torch.equal(qs, q.reshape(n, k).to(torch.int8)) and torch.equal(d2, d.half())
    assert torch.equal(dequantize_q8_0(qs, d2), w)
    raw = torch.cat([d.half().view(n, k // 32, 1).view(torch.uint8), qs.view(n, k // 32, 32).view(torch.uint8)], -1)
    qs3, d3 = from_gguf_q8_0(raw.reshape(-1), n, k)
    assert torch.equal(qs3, qs) and torch.equal(d3, d.half())


def test_q4_1_round_trip_exact() -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 5, 64
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g, dtype=torch.uint8)
    q[..., 0], q[..., 1] = 0, 15  # min and max present: the quantizer recovers m and d exactly
    d = 2.0 ** -torch.randint(0, 8, (n, k // 32), generator=g).float()
    m = torch.randint(-20, 5, (n, k // 32), generator=g).float() * d  # a multiple of d: sums stay exact
    w = (q.float() * d[..., None] + m[..., None]).reshape(n, k)
    qs, d2, m2 = quantize_q4_1(w)
    assert torch.equal(qs, pack_nibbles(q)) and torch.equal(d2, d.half()) and torch.equal(m2, m.half())
    assert torch.equal(dequantize_q4_1(qs, d2, m2), w)
    half = lambda t: t.half().view(n, k // 32, 1).view(torch.uint8)  # noqa: E731
    raw = torch.cat([half(d), half(m), qs.view(n, k // 32, 16)], -1)
    qs3, d3, m3 = from_gguf_q4_1(raw.reshape(-1), n, k)
    assert torch.equal(qs3, qs) and torch.equal(d3, d.half()) and torch.equal(m3, m.half())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_dequantize_kernel_gives_the_torch_reference_bits(fmt: str) -> None:
    """The C++ dequantization, of raw GGUF blocks (load time) and of packed tensors (the F.linear path of large
    batches), equals quant.py's torch reference bit for bit, on random blocks whose scales and mins span
    float16's range (subnormals, negatives, zero); Q4_1's sums round."""
    g = torch.Generator().manual_seed(3)
    n, k = 67, 320
    w = torch.randn(n, k, generator=g) * torch.logspace(-6, 3, n)[:, None]
    w[3] = 0.0  # an all-zero row: d = 0
    packed = quantize_q8_0(w) if fmt == "q8_0" else quantize_q4_1(w)
    halves = [t.view(n, k // 32, 1).view(torch.uint8) for t in packed[1:]]  # d (and m) as 2 bytes each
    qs = packed[0].view(torch.uint8).view(n, k // 32, -1)
    raw = torch.cat([*halves, qs], -1).reshape(-1)  # GGUF block order: d, (m,) quants
    reference = dequantize_q8_0(*from_gguf_q8_0(raw, n, k)) if fmt == "q8_0" else dequantize_q4_1(*from_gguf_q4_1(raw, n, k))
    assert torch.equal(reference, dequantize_q8_0(*packed) if fmt == "q8_0" else dequantize_q4_1(*packed))
    assert torch.equal(K.dequantize_gguf(raw, fmt, n, k), reference)
    assert torch.equal(K.dequantize_blocks(fmt, list(packed)), reference)
    with pytest.raises(RuntimeError, match="contiguous bytes"):
        K.dequantize_gguf(raw[:-1], fmt, n, k)
    with pytest.raises(RuntimeError, match="float16"):
        K.dequantize_blocks(fmt, [packed[0], *(t.float() for t in packed[1:])])


def test_fake_quantize_kernel_gives_the_torch_reference_bits() -> None:
    """The C++ rounding of activations to int8 blocks (the block formats' F.linear path) equals
    quant.fake_quantize_activations bit for bit: values across many magnitudes, ties at .5 after scaling, an
    all-zero block, a non-contiguous input; a K that is not a multiple of 32 is refused."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 192, generator=g) * torch.logspace(-8, 4, 37)[:, None]
    x[2, :32] = 0.0  # d = 0
    x[4, :32] = torch.cat([torch.tensor([127.0]), torch.arange(-15, 16) + 0.5])  # d = 1: x / d ties at .5
    assert torch.equal(K.fake_quantize_activations(x), fake_quantize_activations(x))
    xt = torch.randn(192, 37, generator=g).t()  # non-contiguous
    assert torch.equal(K.fake_quantize_activations(xt), fake_quantize_activations(xt.contiguous()))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        K.fake_quantize_activations(torch.randn(4, 40))


def as_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] as a cache of cache_dtype stores it (int8: quantize_int8_rows' rows of D + 4)."""
    return quantize_int8_rows(x) if cache_dtype == torch.int8 else x.to(cache_dtype)


def _paged_case(cache_dtype: torch.dtype, block_size: int, seed: int, extra_decodes: int = 0, dim: int = 40,
                heads: int = 6, kv_heads: int = 2):
    """Mixed batch: decode rows, prefill chunks starting at 0 and > 0, an idle request, ``extra_decodes`` more
    decode rows (with enough of them the kernel reads each request's slots for all kv heads in one work item);
    shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [1, 37, 100, 16, 53, 9] + torch.randint(1, 150, (extra_decodes,), generator=g).tolist()
    q_lens = [1, 1, 30, 16, 0, 9] + [1] * extra_decodes  # decode, decode, chunk at 70.., full prefill, none, prefill
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1
    n_blocks = len(seq_lens) * max_blocks
    perm = torch.randperm(n_blocks, generator=g).to(torch.int32)
    tables = perm.view(len(seq_lens), max_blocks)
    kv = as_cache(torch.randn(n_blocks * block_size, 2, kv_heads, dim, generator=g), cache_dtype)
    k_cache, v_cache = kv[:, 0], kv[:, 1]  # strided views: slot stride 2*KVH*D
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), heads, dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, dim ** -0.5


def _many_decodes() -> int:
    """Decode rows enough for the kernel's whole-slot work items at this thread count."""
    return 4 * torch.get_num_threads() + 3


def _oracle_cache(cache: torch.Tensor) -> torch.Tensor:
    """A cache as the float64 reference reads it (an int8 cache as stored: the reference dequantizes its rows)."""
    return cache if cache.dtype == torch.int8 else cache.double()


def _atol(cache_dtype: torch.dtype, dim: int) -> float:
    """The kernel's distance from the float64 reference: float32 arithmetic (polynomial exp, ~2 ulp) over <= 150 keys
    of convex combinations of N(0, 1) values, ~1e-6; over an int8 cache at D = 64 with AVX512-VNNI the queries are
    rounded to int8 rows too (q . k in integers, as llama.cpp's q8_0 cache): scores of |q.k| <~ 10 move by <~ 2e-2."""
    return 5e-2 if cache_dtype == torch.int8 and dim == 64 and K.int8_qk_available() else 2e-5


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("dim", [40, 64])  # 64: the AVX2 path (bfloat16 rows widened in registers or per chunk)
def test_paged_attention(cache_dtype: torch.dtype, block_size: int, wide: bool, dim: int) -> None:
    q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(cache_dtype, block_size, seed=block_size,
                                                          extra_decodes=_many_decodes() if wide else 0, dim=dim)
    ref = reference_paged_attention(q.double(), _oracle_cache(kc), _oracle_cache(vc), tables, seq_lens, qsl, block_size)
    out = torch.full_like(q, float("nan"))
    K.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, block_size, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=_atol(cache_dtype, dim))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (10, 2)])
def test_paged_attention_head_groups(cache_dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    """Rows at D = 64 (a query's heads of a kv head scored and accumulated up to three at a time; on AVX-512,
    bfloat16 keys in groups of 16) with 1, 2, 4 and 5 query heads a kv head, and contexts whose last group of keys
    is 1 to 15 keys short, against the float64 reference."""
    q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(cache_dtype, 16, seed=heads + kv_heads,
                                                          extra_decodes=_many_decodes() + 16, dim=64, heads=heads,
                                                          kv_heads=kv_heads)
    ref = reference_paged_attention(q.double(), _oracle_cache(kc), _oracle_cache(vc), tables, seq_lens, qsl, 16)
    out = torch.full_like(q, float("nan"))
    K.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, 16, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=_atol(cache_dtype, 64))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_paged_attention_rows_do_not_depend_on_the_batch(cache_dtype: torch.dtype) -> None:
    """Each decode row of a wide batch (one work item over all kv heads per request) equals the same row attended
    alone (one work item per kv head), bit for bit."""
    q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(cache_dtype, 16, seed=11, extra_decodes=_many_decodes(),
                                                          dim=64)
    together = torch.empty_like(q)
    K.paged_attention(together, q, kc, vc, tables, seq_lens, qsl, 16, scale)
    for r in range(6, len(seq_lens)):
        row = slice(int(qsl[r]), int(qsl[r + 1]))
        alone = torch.empty_like(q[row])
        K.paged_attention(alone, q[row].contiguous(), kc, vc, tables[r : r + 1], seq_lens[r : r + 1],
                          torch.tensor([0, 1], dtype=torch.int32), 16, scale)
        assert torch.equal(alone, together[row]), f"request {r}"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("start", [0, 45])
def test_paged_attention_prefill_rows_equal_decode_rows(cache_dtype: torch.dtype, start: int) -> None:
    """Each query of a prefill chunk (its item's key chunks transposed once for all its rows, on AVX2) equals the same
    query attended as a decode row at its position (keys as rows), bit for bit: 75 queries from position ``start``,
    so that causal limits cut key chunks and groups of 8 keys everywhere."""
    g = torch.Generator().manual_seed(21 + start)
    heads, kv_heads, dim, bs, q_len = 9, 3, 64, 16, 75
    seq = start + q_len
    blocks = -(-seq // bs)
    table = torch.randperm(blocks + 3, generator=g)[:blocks].to(torch.int32).view(1, blocks)
    kc, vc = (as_cache(torch.randn((blocks + 3) * bs, kv_heads, dim, generator=g), cache_dtype) for _ in range(2))
    q = torch.randn(q_len, heads, dim, generator=g)
    chunk = torch.empty_like(q)
    K.paged_attention(chunk, q, kc, vc, table, torch.tensor([seq], dtype=torch.int32),
                      torch.tensor([0, q_len], dtype=torch.int32), bs, dim**-0.5)
    rows = torch.empty_like(q)  # every query as a decode row of its own request, all in one call
    K.paged_attention(rows, q, kc, vc, table.expand(q_len, blocks).contiguous(),
                      torch.arange(start + 1, seq + 1, dtype=torch.int32), torch.arange(q_len + 1, dtype=torch.int32),
                      bs, dim**-0.5)
    assert torch.equal(chunk, rows)


def test_paged_attention_reads_q_rows_in_place() -> None:
    """q as the query part of a fused [T, (H + 2 KVH) * D] projection (rows further apart than H * D) gives the
    contiguous q's output bit for bit; q whose heads are not contiguous within a token is refused."""
    q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(torch.float32, 16, seed=5, extra_decodes=_many_decodes(),
                                                          dim=64)
    T, H, D = q.shape
    fused = torch.randn(T, (H + 4) * D)
    fused[:, : H * D] = q.reshape(T, H * D)
    strided = fused[:, : H * D].view(T, H, D)
    assert not strided.is_contiguous()
    expected, out = torch.empty_like(q), torch.empty_like(q)
    K.paged_attention(expected, q, kc, vc, tables, seq_lens, qsl, 16, scale)
    K.paged_attention(out, strided, kc, vc, tables, seq_lens, qsl, 16, scale)
    assert torch.equal(out, expected)
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        K.paged_attention(out, q.transpose(0, 1).contiguous().transpose(0, 1), kc, vc, tables, seq_lens, qsl, 16,
                          scale)


def test_paged_attention_bf16_q_out() -> None:
    q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(torch.bfloat16, 16, seed=3)
    qb = q.bfloat16()
    ref = reference_paged_attention(qb.double(), kc.double(), vc.double(), tables, seq_lens, qsl, 16)
    out = torch.empty_like(qb)
    K.paged_attention(out, qb, kc, vc, tables, seq_lens, qsl, 16, scale)
    # Output rounded to bf16 (8-bit mantissa): relative error 2**-9 of |out| <= ~3.
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("dot", [False, True, "fma"])
def test_paged_attention_stores_bfloat16_rows_beside_float32_queries(cache_dtype: torch.dtype, dot) -> None:
    """A bfloat16 out beside float32 queries (the decoder stack's input to a projection that rounds it): every row
    the float32 out's value rounded once, decode rows (one work item a request and whole-slot items), prefill chunks,
    on the float32 kernels and on the dot products (bfloat16 and int8 caches); bfloat16 queries take their own dtype
    out."""
    q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(cache_dtype, 16, seed=11, extra_decodes=_many_decodes(),
                                                          dim=64)
    options = {"dot_min_queries": 9, "dot_fma": dot == "fma"} if dot and K.bf16_gemm_available() else {}
    wide, narrow = torch.empty_like(q), torch.empty(q.shape, dtype=torch.bfloat16)
    K.paged_attention(wide, q, kc, vc, tables, seq_lens, qsl, 16, scale, **options)
    K.paged_attention(narrow, q, kc, vc, tables, seq_lens, qsl, 16, scale, **options)
    assert torch.equal(narrow.view(torch.int16), wide.bfloat16().view(torch.int16))
    with pytest.raises(RuntimeError, match="bfloat16 beside float32 queries"):
        K.paged_attention(wide, q.bfloat16(), kc, vc, tables, seq_lens, qsl, 16, scale)


@pytest.mark.parametrize("products", ["sdpa", "dot", "dot-fma"])
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_bfloat16_prefill(products: str, block_size: int, strided: bool, q_dtype: torch.dtype) -> None:
    """Requests with at least 9 queries multiply in bfloat16: through torch's SDPA (``dense_min_queries``, over the
    context gathered from a contiguous cache) or on the kernel's AVX512-BF16 dot products (``dot_min_queries``; the
    cache also as strided views, K and V of a slot side by side), those products summed on float32 FMAs (``dot_fma``). A first chunk, a chunk after 70 cached keys and a
    9-token prompt (odd key counts, a query tile of 9 x 3 rows) against the float64 reference within the rounding of
    queries and probabilities to bfloat16; the other requests' rows are the kernel's float32 ones, bit for bit."""
    if products == "sdpa" and strided:
        pytest.skip("the SDPA path views a contiguous cache as blocks")
    if products.startswith("dot") and not K.bf16_gemm_available():
        pytest.skip("the kernels were built without AVX512-BF16")
    q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(torch.bfloat16, block_size, seed=9,
                                                          extra_decodes=_many_decodes(), dim=64)
    if not strided:
        kc, vc = kc.contiguous(), vc.contiguous()
    q = q.to(q_dtype)
    ref = reference_paged_attention(q.double(), kc.double(), vc.double(), tables, seq_lens, qsl, block_size)
    kernel_only, ours = torch.empty_like(q), torch.full_like(q, float("nan"))
    K.paged_attention(kernel_only, q, kc, vc, tables, seq_lens, qsl, block_size, scale)
    K.paged_attention(ours, q, kc, vc, tables, seq_lens, qsl, block_size, scale,
                      **{"sdpa": {"dense_min_queries": 9}, "dot": {"dot_min_queries": 9},
                         "dot-fma": {"dot_min_queries": 9, "dot_fma": True}}[products])
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    for r, q_len in enumerate(q_lens):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        if q_len >= 9:
            # queries and probabilities rounded to bfloat16 (2**-9 relative): scores of |q.k| <~ 10 move by <~ 0.02;
            # a bfloat16 q gives a bfloat16 output (2**-8 relative more)
            torch.testing.assert_close(ours[rows].double(), ref[rows], rtol=8e-3 if q_dtype == torch.bfloat16 else 0,
                                       atol=2e-2)
            assert not torch.equal(ours[rows], kernel_only[rows])  # it did take the other path
        else:
            assert torch.equal(ours[rows], kernel_only[rows]), f"request {r}"
    assert sum(q_len >= 9 for q_len in q_lens) == 3  # the chunk after 70 keys, the 16- and the 9-token prompts


@pytest.mark.parametrize("heads", [6, 16])  # 3 query heads a kv head (32-query items), 8 (24-query items)
@pytest.mark.parametrize("fma", [False, True])
def test_paged_attention_dot_prefill_long_prompts(heads: int, fma: bool) -> None:
    """attend_dot over prompts of several key chunks and query tiles: a 77-token prompt and a 50-token chunk after
    70 cached keys, whose items' later row blocks skip the chunks none of their rows sees; against the float64
    reference within the rounding of queries and probabilities to bfloat16, as above, on the dot products and on
    FMAs; the two differ only in how float32 sums the same products."""
    if not K.bf16_gemm_available():
        pytest.skip("the kernels were built without AVX512-BF16")
    g = torch.Generator().manual_seed(5)
    seq_lens, q_lens, kv_heads, dim, bs = [77, 120], [77, 50], 2, 64, 16
    tables = torch.randperm(2 * 8, generator=g).to(torch.int32).view(2, 8)
    kc = torch.randn(16 * bs, kv_heads, dim, generator=g).bfloat16()
    vc = torch.randn(16 * bs, kv_heads, dim, generator=g).bfloat16()
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), heads, dim, generator=g)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    ref = reference_paged_attention(q.double(), kc.double(), vc.double(), tables, seq, qsl, bs)
    ours, plain = torch.full_like(q, float("nan")), torch.empty_like(q)
    K.paged_attention(ours, q, kc, vc, tables, seq, qsl, bs, dim ** -0.5, dot_min_queries=9, dot_fma=fma)
    K.paged_attention(plain, q, kc, vc, tables, seq, qsl, bs, dim ** -0.5)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-2)
    assert not torch.equal(ours, plain)  # the dot products ran
    other = torch.empty_like(q)  # the other way of summing them
    K.paged_attention(other, q, kc, vc, tables, seq, qsl, bs, dim ** -0.5, dot_min_queries=9, dot_fma=not fma)
    torch.testing.assert_close(ours, other, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fma", [False, True])
def test_paged_attention_dot_prefill_over_an_int8_cache(fma: bool) -> None:
    """attend_dot over an int8 cache: each chunk's rows widened, scaled and rounded to bfloat16 first, then the
    bfloat16 cache's arithmetic (dot products or FMAs); against the float64 reference on the same int8 rows within
    that rounding."""
    if not K.bf16_gemm_available():
        pytest.skip("the kernels were built without AVX512-BF16")
    q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(torch.int8, 16, seed=9, extra_decodes=_many_decodes(), dim=64)
    ref = reference_paged_attention(q.double(), kc, vc, tables, seq_lens, qsl, 16)
    plain, ours = torch.empty_like(q), torch.full_like(q, float("nan"))
    K.paged_attention(plain, q, kc, vc, tables, seq_lens, qsl, 16, scale)
    K.paged_attention(ours, q, kc, vc, tables, seq_lens, qsl, 16, scale, dot_min_queries=9, dot_fma=fma)
    for r, q_len in enumerate((qsl[1:] - qsl[:-1]).tolist()):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        torch.testing.assert_close(ours[rows].double(), ref[rows], rtol=0, atol=5e-2)
        assert torch.equal(ours[rows], plain[rows]) == (q_len < 9), f"request {r}"


def test_int8_cache_rows_round_like_torch() -> None:
    """The kernels' int8 rows (rotary_cache_'s v rows, copied as they are) are quantize_int8_rows' bytes: ties to
    even, a zero row all zeros with scale 0, and the row's largest value at +-127."""
    heads, kv_heads, d = 1, 1, 64
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(5, d, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 1.0])[:, None]
    rows[4, :] = torch.arange(d) - 31.5  # row 4's largest value is 127, so s = 1 and x · (1 / s) = x: halves go to even
    rows[4, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 127.0, -127.0])
    qkv = torch.zeros(5, (heads + 2 * kv_heads) * d)
    qkv[:, (heads + kv_heads) * d :] = rows
    rotary = RotaryEmbedding(_RopeConfig, 16)
    caches = [torch.zeros(8, kv_heads, d + INT8_ROW_EXTRA, dtype=torch.int8) for _ in range(2)]
    K.rotary_cache_(qkv, torch.zeros(5, dtype=torch.long), rotary.cos, rotary.sin, *caches, torch.arange(5), heads,
                    kv_heads)  # fmt: skip
    want = quantize_int8_rows(rows)
    assert torch.equal(caches[1][:5, 0], want)
    assert want[4, :6].tolist() == [0, 2, 2, 0, -2, -2] and want[3].abs().sum() == 0


def test_paged_attention_dot_prefill_stays_off_where_it_cannot_run() -> None:
    """A float32 cache, or a head dim other than 64, keeps the float32 products whatever dot_min_queries says."""
    for cache_dtype, dim in ((torch.float32, 64), (torch.bfloat16, 40)):
        q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(cache_dtype, 16, seed=2, dim=dim)
        plain, asked = torch.empty_like(q), torch.empty_like(q)
        K.paged_attention(plain, q, kc, vc, tables, seq_lens, qsl, 16, scale)
        K.paged_attention(asked, q, kc, vc, tables, seq_lens, qsl, 16, scale, dot_min_queries=1)
        assert torch.equal(plain, asked), (cache_dtype, dim)


def test_disabled_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(extension.DISABLE_ENV, "1")
    assert extension.load_kernels.__wrapped__() is None


def test_build_dir_under_home(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TWOPHASE_HOME", str(tmp_path))
    d = extension.build_dir()
    assert d.parent == tmp_path / "extensions" and d.name.startswith(extension.NAME + "-")


def test_paged_attention_rejects_out_of_range_block() -> None:
    q, kc, vc, tables, seq_lens, qsl, scale = _paged_case(torch.float32, 16, seed=4)
    tables = tables.clone()
    tables[2, 0] = kc.shape[0] // 16  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        K.paged_attention(torch.empty_like(q), q, kc, vc, tables, seq_lens, qsl, 16, scale)


# ---- fused layer ops (csrc/fused.cpp) against LayerOps' eager torch path --------------------------------------
# float32: the kernels sum in a different order (and may contract a*b+c into one FMA), so results agree to a few
# ulps of the values (|x| <~ 10 here): 1e-5 absolute. bfloat16: every op's result is rounded to bf16 as in eager
# torch, and the float32 intermediates differ by far less than half a bf16 ulp, so the results are bit-identical.
from twophase.model.layers import RotaryEmbedding  # noqa: E402
from twophase.model.ops.fused import LayerOps, Rope  # noqa: E402

EAGER, FUSED = LayerOps(None), LayerOps(K)


def assert_matches(fast: torch.Tensor, ref: torch.Tensor) -> None:
    if ref.dtype == torch.bfloat16:
        assert torch.equal(fast, ref)
    else:
        torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_and_silu(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    assert_matches(FUSED.rms_norm(x, weight, 1e-5), EAGER.rms_norm(x, weight, 1e-5))
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    x_ref, res_ref, x_fast, res_fast = x.clone(), residual.clone(), x.clone(), residual.clone()
    EAGER.add_rms_norm_(x_ref, res_ref, weight, 1e-5)
    FUSED.add_rms_norm_(x_fast, res_fast, weight, 1e-5)
    assert torch.equal(res_fast, res_ref)  # one rounded add either way
    assert_matches(x_fast, x_ref)
    gate_up = (torch.randn(rows, 2 * 200, generator=g) * 4).to(dtype)  # F = 200: an AVX tail too
    assert_matches(FUSED.silu_and_mul(gate_up), EAGER.silu_and_mul(gate_up))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_norms_store_bfloat16_rows_as_a_gemm_rounds_them(rows: int) -> None:
    """The decoder stack asks the norms for bfloat16 rows where the next projection rounds its float32 input to
    bfloat16 anyway: the float32 result rounded once (NaN and a wide range of magnitudes included), the residual as
    the in-place form leaves it, x untouched. H = 600: whole 256-value chunks and a tail."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 600, generator=g) * torch.logspace(-30, 30, rows)[:, None]
    x[0, 5] = float("nan")
    weight = 1 + 0.1 * torch.randn(600, generator=g)
    def same(ours: torch.Tensor, theirs: torch.Tensor) -> None:  # bit for bit but NaN's payload
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)

    same(K.rms_norm(x, weight, 1e-5, bf16_out=True), K.rms_norm(x, weight, 1e-5).bfloat16())
    residual = torch.randn(rows, 600, generator=g)
    x_ref, res_ref, x_ours, res_ours = x.clone(), residual.clone(), x.clone(), residual.clone()
    K.add_rms_norm_(x_ref, res_ref, weight, 1e-5)
    out = torch.empty(rows, 600, dtype=torch.bfloat16)
    K.add_rms_norm_(x_ours, res_ours, weight, 1e-5, out=out)
    same(out, x_ref.bfloat16())
    same(res_ours, res_ref)
    assert torch.equal(x_ours.view(torch.int32), x.view(torch.int32))
    with pytest.raises(RuntimeError, match="bfloat16 tensor of x's shape"):
        K.add_rms_norm_(x_ours, res_ours, weight, 1e-5, out=torch.empty(rows, 600))
    with pytest.raises(RuntimeError, match="float32 x"):
        K.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-5, bf16_out=True)


class _RopeConfig:
    head_dim, rope_theta, rope_scaling_dict = 64, 100000.0, None


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
                                               (torch.bfloat16, torch.int8)])  # fmt: skip
def test_fused_rotary_cache(rows: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Rotary + cache write against eager torch; a bfloat16 cache under float32 qkv (--kv-cache-dtype) gets each
    value rounded to nearest even, as torch's .to(torch.bfloat16) rounds it; an int8 cache's v rows are
    quantize_int8_rows' bytes exactly (k: rotated within 1e-5 first, so within one int8 step)."""
    heads, kv_heads, d = 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    rotary = RotaryEmbedding(_RopeConfig, 4096)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    slots = torch.randperm(256, generator=g)[:rows]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    cos, sin = rotary(positions, dtype)
    ref_qkv, fast_qkv = qkv.clone(), qkv.clone()
    width = d + INT8_ROW_EXTRA if cache_dtype == torch.int8 else d
    caches = [torch.full((256, kv_heads, width), 7, dtype=cache_dtype) for _ in range(4)]
    EAGER.rotary_cache_(ref_qkv, Rope(positions, rotary.cos, rotary.sin, cos, sin), caches[0], caches[1], slots,
                        heads, kv_heads)  # fmt: skip
    FUSED.rotary_cache_(fast_qkv, Rope(positions, rotary.cos, rotary.sin, None, None), caches[2], caches[3], slots,
                        heads, kv_heads)  # fmt: skip
    assert_matches(fast_qkv, ref_qkv)
    if dtype == cache_dtype:
        assert_matches(caches[2], caches[0])
    elif cache_dtype == torch.int8:  # one step of a row's int8 values (a 127th of its largest), scales within 1e-5
        torch.testing.assert_close(dequantize_int8_rows(caches[2]), dequantize_int8_rows(caches[0]), rtol=1e-5,
                                   atol=dequantize_int8_rows(caches[0]).abs().max().item() / 127 * 1.01)
    else:  # k rotated within 1e-5 of eager torch, then rounded: at most one bfloat16 step apart
        torch.testing.assert_close(caches[2].float(), caches[0].float(), rtol=2**-7, atol=1e-5)
    assert torch.equal(caches[3], caches[1])  # v is copied (or rounded), untouched
    untouched = torch.ones(256, dtype=torch.bool)
    untouched[slots] = False
    assert (caches[2][untouched] == 7.0).all()  # only the given slots are written


def test_bfloat16_cache_write_rounds_every_value_as_torch() -> None:
    """The vector float32 -> bfloat16 store (v rows into a bfloat16 cache): ties to even, subnormals kept (not
    flushed, as AVX512-BF16's instruction would), infinities and overflow to inf, NaN kept NaN."""
    heads, kv_heads, d = 1, 1, 64
    special = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1e-40, -1e-40, 2**-130, 3.4e38,
                            float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.00390625, 65504.0, 1e-3, -7.5])  # fmt: skip
    v = torch.cat([special, torch.randn(d - special.numel(), generator=torch.Generator().manual_seed(0)) * 100])
    qkv = torch.zeros(1, (heads + 2 * kv_heads) * d)
    qkv[0, (heads + kv_heads) * d :] = v
    rotary = RotaryEmbedding(_RopeConfig, 16)
    caches = torch.zeros(4, kv_heads, d, dtype=torch.bfloat16), torch.zeros(4, kv_heads, d, dtype=torch.bfloat16)
    FUSED.rotary_cache_(qkv, Rope(torch.tensor([3]), rotary.cos, rotary.sin, None, None), *caches, torch.tensor([2]),
                        heads, kv_heads)  # fmt: skip
    stored, want = caches[1][2, 0], v.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(stored.isnan(), nan)
    assert torch.equal(stored[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_fused_rotary_cache_rejects_bad_slot() -> None:
    qkv = torch.zeros(1, 15 * 64)
    rotary = RotaryEmbedding(_RopeConfig, 16)
    caches = torch.zeros(8, 3, 64), torch.zeros(8, 3, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        K.rotary_cache_(qkv, torch.tensor([0]), rotary.cos, rotary.sin, *caches, torch.tensor([8]), 9, 3)


# ---- the compute floor ----------------------------------------------------------------------------------------------


def test_instruction_peak_measures_the_float32_fma_and_refuses_other_dtypes():
    """A rate of the CPU's FMA on every thread: positive and finite; an unknown dtype or a zero time is an error."""
    if not any(flag in hardware.cpu_flags() for flag in ("fma", "avx512f")):
        pytest.skip("this CPU has no FMA instruction the kernels measure")
    rate = K.instruction_peak("float32", 0.02)  # FLOP/s
    assert 1e8 < rate < 1e15  # a real CPU's team of threads: more than 0.1 GFLOP/s, less than a PFLOP/s
    with pytest.raises(RuntimeError, match="bfloat16' or 'float32"):
        K.instruction_peak("float16", 0.02)
    with pytest.raises(RuntimeError, match="positive"):
        K.instruction_peak("float32", 0.0)


def test_instruction_peak_in_bfloat16_where_the_dot_product_instruction_is_built():
    """vdpbf16ps where the build has it (the same condition as bf16_gemm's), else a clear error."""
    if K.bf16_gemm_available():
        assert 1e8 < K.instruction_peak("bfloat16", 0.02) < 1e15
    else:
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            K.instruction_peak("bfloat16", 0.02)
