"""The AVX512-VNNI int8 GEMM of the GGUF block formats (csrc/gemm_int8.cpp) against its float64 reference: the
activations rounded to int8 blocks as quant.py rounds them (``fake_quantize_activations``) times the dequantised
weight. Each block's products are exact integers in both; what differs is float32 summation over the blocks."""

import pytest
import torch

from prerequisites import built_kernels
from twophase.model.ops import quant
from twophase.model.ops.linear import INT8_GEMM_MIN_ROWS, QuantizedLinear


@pytest.fixture(scope="module")
def kernels():
    module = built_kernels()
    if not module.int8_gemm_available():
        pytest.skip("the kernels were built without AVX512-VNNI (a CPU feature, not a prerequisite)")
    return module


def blocks_of(fmt: str, weight: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(the format's tensors as quant.py packs them, the float32 weight they stand for [N, K])."""
    if fmt == "q8_0":
        packed = quant.quantize_q8_0(weight)
        return packed, quant.dequantize_q8_0(*packed)
    packed = quant.quantize_q4_1(weight)
    return packed, quant.dequantize_q4_1(*packed)


def int8_tensors(kernels, fmt: str, packed: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """pack_int8_gemm of a format's tensors: its int8 values with scales (and mins) per block."""
    if fmt == "q8_0":
        qs, d = packed
        return kernels.pack_int8_gemm(qs, d.float())
    qs, d, m = packed
    values = quant.unpack_nibbles(qs).reshape(qs.shape[0], -1).to(torch.int8)  # [N, K], 0..15
    return kernels.pack_int8_gemm(values, d.float(), m.float())


def run(kernels, x: torch.Tensor, tensors: list[torch.Tensor], n: int) -> torch.Tensor:
    return kernels.int8_gemm(x, *tensors[:3], tensors[3] if len(tensors) > 3 else None, n)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # float64 [M, N]
    return quant.fake_quantize_activations(x).double() @ weight.double().t()


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """[m, k] with a few outlier columns (as the residual stream has), an all-zero block and a single-value one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (1 + 20 * (torch.rand(k, generator=g) > 0.95))
    x[0, :32] = 0
    if m > 1:
        x[1, 32:64] = 0.5
    return x


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (6, 96, 32), (7, 576, 1536), (33, 960, 576), (389, 100, 96)])
def test_int8_gemm_matches_its_float64_reference(kernels, fmt, m, n, k):
    """Shapes that leave partial panels (n % 32), partial row tiles (m % 6), a row chunk and a half (389 rows), one
    block of k and 48. Each output within 2e-6 of its row's largest: 48 float32 block sums of ~2^-24 each."""
    x = activations(m, k, seed=m)
    packed, weight = blocks_of(fmt, torch.randn(n, k, generator=torch.Generator().manual_seed(n)))
    y = run(kernels, x, int8_tensors(kernels, fmt, packed), n)
    expected = reference(x, weight)
    assert y.shape == (m, n) and y.dtype == torch.float32
    error = (y.double() - expected).abs() / expected.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    assert float(error.max()) < 2e-6


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_int8_gemm_rows_do_not_depend_on_the_batch(kernels, fmt):
    """A row's result is the same bits alone, in a batch of 37 and at another place in another batch: the kernel's
    arithmetic of a row never depends on the other rows (which tile, which thread, how many rows)."""
    x = activations(37, 576, seed=3)
    packed, _ = blocks_of(fmt, torch.randn(200, 576, generator=torch.Generator().manual_seed(4)))
    tensors = int8_tensors(kernels, fmt, packed)
    together = run(kernels, x, tensors, 200)
    for i in (0, 5, 36):
        assert torch.equal(run(kernels, x[i:i + 1], tensors, 200), together[i:i + 1])
    shuffled = torch.cat([x[20:], x[:20]])
    assert torch.equal(run(kernels, shuffled, tensors, 200), torch.cat([together[20:], together[:20]]))


def test_int8_gemm_refuses_what_it_cannot_run(kernels):
    qs, d = quant.quantize_q8_0(torch.randn(64, 64))
    tensors = kernels.pack_int8_gemm(qs, d.float())
    with pytest.raises(RuntimeError, match="x must be"):
        run(kernels, torch.randn(3, 32), tensors, 64)
    with pytest.raises(RuntimeError, match="n does not match"):
        run(kernels, torch.randn(3, 64), tensors, 20)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_int8_gemm(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_block_formats_take_the_int8_gemm_from_its_threshold(kernels, fmt):
    """A q8_0 / q4_1 layer runs its kernel below INT8_GEMM_MIN_ROWS rows and the int8 GEMM from there at every row
    count (no F.linear fallback): the same quantities, within float32 summation of each other and of the float64
    reference. --deterministic (batch-invariant) keeps the kernel at every row count."""
    weight = torch.randn(100, 576, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(100, generator=torch.Generator().manual_seed(6))
    layer = QuantizedLinear(weight, bias, fmt, kernels)
    assert layer.int8_gemm is not None and layer.max_rows == float("inf")
    dequantized = layer.dequantized()
    for rows in (1, INT8_GEMM_MIN_ROWS - 1, INT8_GEMM_MIN_ROWS, 300):
        x = activations(rows, 576, seed=rows)
        expected = reference(x, dequantized) + bias.double()
        error = (layer(x).double() - expected).abs() / expected.abs().amax(dim=1, keepdim=True)
        assert float(error.max()) < 2e-6
    invariant = QuantizedLinear(weight, bias, fmt, kernels, batch_invariant=True)
    assert invariant.int8_gemm is None
    with pytest.raises(RuntimeError, match="batch_invariant"):
        invariant.op.set_int8_gemm(layer.int8_gemm, INT8_GEMM_MIN_ROWS)
