"""Every fast path against its reference on the tiny models, and bfloat16 / quantized agreement on the real one.

Tolerances:
- float32 kernels vs the float64 reference: the kernels accumulate in float32 in another order than BLAS, so
  logits differ by float32 rounding (~1e-6 relative per op, summed over a few layers): 1e-4 as in the HF parity.
- quantized kernels vs their own dequantised weights in plain torch: the same weights, only the summation order
  differs: 1e-4.
- bfloat16 vs float32, quantized vs dense: errors scale with the logits, so they are bounded as a fraction of
  the largest |logit| (bfloat16 keeps 8 mantissa bits, 2^-9 relative per rounding, compounded over the layers of
  a random model with large weights: within 5%).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from prerequisites import built_kernels
from test_parity_hf import PROMPTS, packed_logits
from twophase.outputs import ScheduledRequest, SchedulerOutput
from twophase import LLM, SamplingParams
from twophase.engine import llm_engine
from twophase.model.attention import INT8_ROW_EXTRA
from twophase.model.ops.linear import (BLOCK_FORMATS, MAX_KERNEL_ROWS, BlockPanelLinear, KernelLinear, check_stored_shape, dequantize,
                                       exact_block_panels, make_linear, pack_block_panels, pack_block_panels_reference,
                                       quantize)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return built_kernels()


def make_llm(path, **options) -> LLM:
    return LLM(str(path), progress=False, block_size=4, num_blocks=64, **options)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_untied_dir"])
def test_fp32_kernels_match_float64_reference(fixture, request):
    path = request.getfixturevalue(fixture)
    fast = make_llm(path, dtype="float32")
    runner = fast.engine.model_runner
    assert runner.backend.name == "kernel" and runner.linear_kernels
    reference = make_llm(path, dtype="float64", attention_backend="torch", linear_backend="torch")
    for ours, theirs in zip(packed_logits(fast, PROMPTS), packed_logits(reference, PROMPTS)):
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-4, atol=1e-4)
    plain = make_llm(path, dtype="float32", attention_backend="torch", linear_backend="torch")
    assert [o.token_ids for o in fast.generate(PROMPTS, GREEDY)] == [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_linear_holds_only_panels_and_runs_every_batch_size(kernels, dtype):
    """A float32 / bfloat16 layer keeps its weight as column panels only (no row-major copy, none made later), gives
    it back unpacked, and agrees with F.linear at every batch size; float64 input takes the F.linear reference."""
    torch.manual_seed(0)
    weight, bias = torch.randn(50, 96).to(dtype), torch.randn(50).to(dtype)
    layer = KernelLinear(weight, bias, kernels)
    assert [name for name, _ in layer.named_buffers()] == ["panels", "bias"] and layer.max_rows == float("inf")
    assert torch.equal(layer.unpacked_weight(), weight)
    for rows in (1, 5, 40, 300):
        x = torch.randn(rows, 96).to(dtype)
        expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
        torch.testing.assert_close(layer(x).double(), expected, **tolerance)
    x64 = torch.randn(3, 96, dtype=torch.float64)
    assert torch.equal(layer(x64), torch.nn.functional.linear(x64, weight.double(), bias.double()))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_block_panels_give_the_float32_panels_bits(kernels, fmt, batch_invariant):
    """A float32 weight that is the exact dequantisation of Q8_0 / Q4_1 blocks runs from those blocks
    (BlockPanelLinear, a quarter of the bytes or less): the outputs are the float32 panels' bits at every batch size,
    one row included under batch invariance; a weight the blocks do not widen to keeps its float32 panels (None).
    A few rows without batch invariance (up to 15; one row always) take the folded kernels (the products with the
    blocks' integers, then the scales): within float32 rounding of the float64 product, also for weights far from
    zero (a large Q4_1 min)."""
    torch.manual_seed(0)
    packed = quantize(torch.randn(50, 96) * 0.1, fmt)  # 50 rows: three panels of 24, the last one padded
    weight, bias = dequantize(packed, fmt), torch.randn(50)
    blocks = exact_block_panels(weight, bias, (fmt, packed), kernels, batch_invariant)
    panels = KernelLinear(weight.clone(), bias, kernels, batch_invariant)
    assert isinstance(blocks, BlockPanelLinear) and torch.equal(blocks.unpacked_weight(), weight)
    assert blocks.panels.numel() <= 0.27 * panels.panels.numel() * 4  # bytes: 1.06 (q8_0) / 0.625 (q4_1) of 4
    for rows in (1, 2, 5, 9, 40, 300):
        x = torch.randn(rows, 96)
        if rows > 15 or batch_invariant:
            assert torch.equal(blocks(x), panels(x)), rows
    x64 = torch.randn(3, 96, dtype=torch.float64)
    assert torch.equal(blocks(x64), panels(x64))
    assert exact_block_panels(weight + 1e-3, bias, (fmt, packed), kernels) is None
    for offset, rows in itertools.product((0.0, 0.3), (1, 2, 3, 4, 7, 15)):  # K = 576 (18 blocks)
        packed = quantize(torch.randn(50, 576) * 0.1 + offset, fmt)
        weight = dequantize(packed, fmt)
        blocks = exact_block_panels(weight, bias, (fmt, packed), kernels, batch_invariant)
        x = torch.randn(rows, 576)
        expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        err = (blocks(x).double() - expected).abs()
        bound = 1e-5 * (x.double().abs() @ weight.double().abs().T + bias.double().abs()) + 1e-6
        assert (err <= bound).all(), f"offset {offset}, {rows} rows: max err {err.max():.3g}"
        one_by_one = torch.cat([blocks(x[i : i + 1]) for i in range(rows)])
        assert not batch_invariant or torch.equal(blocks(x), KernelLinear(weight.clone(), bias, kernels, True)(x))
        assert not batch_invariant or torch.equal(blocks(x), one_by_one)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_block_panels_packed_in_cpp_as_in_torch(kernels, fmt):
    """The C++ packing of Q8_0 / Q4_1 blocks into block panels writes the bytes of the torch reference (every nibble
    and int8 value, rows padded to a whole panel), and block_panels_equal finds one changed weight or a wrong shape."""
    torch.manual_seed(1)
    packed = quantize(torch.randn(53, 128), fmt)  # 53 rows: the third panel holds 5 real rows and 19 zero rows
    if fmt == "q8_0":  # every int8 value, -128 included
        packed = (torch.arange(53 * 128).remainder(256).sub(128).to(torch.int8).view(53, 128), packed[1])
    else:  # every byte, so every pair of nibbles
        packed = (torch.arange(53 * 64).remainder(256).to(torch.uint8).view(53, 64), *packed[1:])
    panels = pack_block_panels(fmt, packed, kernels)
    assert torch.equal(panels, pack_block_panels_reference(fmt, packed, kernels))
    weight = dequantize(packed, fmt)
    assert kernels.block_panels_equal(panels, weight)
    changed = weight.clone()
    changed[52, 127] = torch.nextafter(changed[52, 127], torch.tensor(float("inf")))
    assert not kernels.block_panels_equal(panels, changed)
    assert not kernels.block_panels_equal(panels, weight[:40])
    assert not kernels.block_panels_equal(panels, weight[:, :96])


@pytest.mark.parametrize("stored, runs_as", [("q8_0", "q8_0"), ("q4_0", "q4_1")])
def test_float32_gguf_blocks_run_bit_identical(stored, runs_as, tiny_llama_dir, tmp_path, monkeypatch):
    """A float32 model read from a GGUF file's Q8_0 (or Q4_0, as Q4_1 blocks) blocks runs every projection and the
    head from those blocks, with the logits of the float32 panels bit for bit, and so the same greedy tokens."""
    from tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tiny_llama_dir, tmp_path / f"{stored}.gguf", dtype=stored)
    blocks = make_llm(path, dtype="float32")
    model = blocks.engine.model_runner.model
    assert isinstance(model.logits_head, BlockPanelLinear) and model.logits_head.fmt == runs_as
    assert all(isinstance(m, BlockPanelLinear) for layer in model.layers for m in (layer.self_attn.qkv_proj,
               layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))  # fmt: skip
    monkeypatch.setattr(llm_engine, "wants_native_weights", lambda config, source: False)  # the weights as float32 only
    panels = make_llm(path, dtype="float32")
    assert isinstance(panels.engine.model_runner.model.logits_head, KernelLinear)
    for ours, theirs in zip(packed_logits(blocks, PROMPTS), packed_logits(panels, PROMPTS)):
        assert torch.equal(ours, theirs)
    assert [o.token_ids for o in blocks.generate(PROMPTS, GREEDY)] == [o.token_ids for o in panels.generate(PROMPTS, GREEDY)]


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_untied_dir"])
def test_weights_built_from_blocks_are_never_dequantised(fixture, request, tmp_path, monkeypatch):
    """A float32 model read from GGUF Q8_0 blocks reads as float32 only the embedding and the norms: the
    projections and an untied head run from their blocks and are never dequantised. Its layers hold the panels of
    the checked path (every weight loaded as float32, then compared with the widened blocks) byte for byte."""
    from tiny_models import write_tiny_gguf
    from twophase.config import CacheConfig
    from twophase.engine.model_runner import ModelRunner
    from twophase.loader import gguf_reader, open_model_source

    path = write_tiny_gguf(request.getfixturevalue(fixture), tmp_path / "q8.gguf", dtype="q8_0")
    read: list[str] = []
    dequantize_tensor = gguf_reader.dequantize_tensor
    monkeypatch.setattr(gguf_reader, "dequantize_tensor",
                        lambda tensor, kernels=None: read.append(tensor.name) or dequantize_tensor(tensor, kernels))
    skipping = make_llm(path, dtype="float32").engine.model_runner.model
    assert "token_embd.weight" in read and "output.weight" not in read
    assert all(name == "token_embd.weight" or name.endswith("norm.weight") for name in read), read
    source = open_model_source(str(path))
    checked = ModelRunner(source.config, list(source.iter_weights(progress=False)), CacheConfig(block_size=4, num_blocks=8),
                          64, torch.float32, torch.device("cpu"), native_weights=source.native_quantized_weights()).model
    pairs = [(skipping.logits_head, checked.logits_head)]
    pairs += [(a.get_submodule(n), b.get_submodule(n)) for a, b in zip(skipping.layers, checked.layers) for n in PROJECTIONS]
    for ours, theirs in pairs:
        assert isinstance(ours, BlockPanelLinear) and isinstance(theirs, BlockPanelLinear)
        assert torch.equal(ours.panels, theirs.panels)


def test_stored_blocks_of_another_shape_are_refused(kernels):
    """Blocks that do not hold the model's shape fail loading with the names and shapes; a layer without its loaded
    weight is refused unless its blocks are widened exactly (float32 on the kernels)."""
    native = ("q8_0", quantize(torch.randn(8, 64), "q8_0"))
    with pytest.raises(ValueError, match="layers.0.mlp.down_proj: the file stores a 8 x 64 weight, the model needs 8 x 32"):
        check_stored_shape(native, torch.Size([8, 32]), "layers.0.mlp.down_proj")
    check_stored_shape(native, torch.Size([8, 64]), "layers.0.mlp.down_proj")
    assert isinstance(make_linear(None, None, "none", kernels, native), BlockPanelLinear)
    for quantization, native_or_none, kernels_or_none in (("none", None, kernels), ("int8", native, kernels),
                                                          ("none", native, None)):  # fmt: skip
        with pytest.raises(ValueError, match="without its loaded weight"):
            make_linear(None, None, quantization, kernels_or_none, native_or_none)


def test_long_prompts_stay_in_the_decoder_stack_on_the_panels(tiny_llama_dir):
    """A prompt longer than the old 32-row GEMM switch runs in the C++ decoder stack on the panel kernel, with
    logits within the float64 reference's tolerance."""
    prompt = [[(5 * i) % 60 + 2 for i in range(41)]]
    fast = make_llm(tiny_llama_dir, dtype="float32")
    model = fast.engine.model_runner.model
    assert model.stack_max_rows == float("inf")
    reference = make_llm(tiny_llama_dir, dtype="float64", attention_backend="torch", linear_backend="torch")
    torch.testing.assert_close(packed_logits(fast, prompt)[0], packed_logits(reference, prompt)[0].float(),
                               rtol=1e-4, atol=1e-4)
    assert model.stack  # built and run for 41 rows


@pytest.mark.parametrize("quantization", ["int8", "q8_0", "q4_1"])
def test_quantized_kernels_match_their_dequantised_weights(tiny_qwen2_dir, quantization):
    fast = make_llm(tiny_qwen2_dir, dtype="float32", quantization=quantization)
    plain = make_llm(tiny_qwen2_dir, dtype="float32", quantization=quantization, linear_backend="torch",
                     attention_backend="torch")  # fmt: skip
    for ours, theirs in zip(packed_logits(fast, PROMPTS), packed_logits(plain, PROMPTS)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert [o.token_ids for o in fast.generate(PROMPTS, GREEDY)] == [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def test_gguf_q4_0_runs_as_the_same_q4_1_blocks(tiny_llama_dir, tmp_path):
    """--quantization gguf takes a GGUF file's Q4_0 weights as Q4_1 blocks (m = -8 d) without requantising: each
    projection's blocks give back the loader's float32 weights exactly, and the model runs bit for bit as the file
    of the same blocks stored as Q4_1 (the int8 GEMM from 3 rows where built, the kernels below)."""
    from tiny_models import write_tiny_gguf
    from twophase.loader import open_model_source

    path = write_tiny_gguf(tiny_llama_dir, tmp_path / "q4_0.gguf", dtype="q4_0")
    as_q4_1 = write_tiny_gguf(tiny_llama_dir, tmp_path / "q4_1.gguf", dtype="q4_0_as_q4_1")
    q4_0, q4_1 = make_llm(path, dtype="float32", quantization="gguf"), make_llm(as_q4_1, dtype="float32", quantization="gguf")
    model = q4_0.engine.model_runner.model
    loaded = dict(open_model_source(str(path)).iter_weights(progress=False))
    assert loaded.keys() == dict(open_model_source(str(as_q4_1)).iter_weights(progress=False)).keys()
    down = model.layers[1].mlp.down_proj
    assert down.fmt == "q4_1" and torch.equal(down.dequantized(), loaded["model.layers.1.mlp.down_proj.weight"])
    assert model.logits_head.fmt == "q4_1" and torch.equal(model.logits_head.dequantized(),
                                                            loaded["model.embed_tokens.weight"])  # fmt: skip
    for ours, theirs in zip(packed_logits(q4_0, PROMPTS), packed_logits(q4_1, PROMPTS)):
        assert torch.equal(ours, theirs)
    assert [o.token_ids for o in q4_0.generate(PROMPTS, GREEDY)] == [o.token_ids for o in q4_1.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("quantization", ["none", "int8", "q8_0", "q4_1"])
def test_decoder_stack_is_bit_identical_to_the_python_layer_loop(fixture, quantization, request, kernels):
    """The C++ decoder stack calls the Python loop's kernels in its order: logits and greedy decode equal exactly
    (qwen2 brings the QKV bias), and the loop still runs where the stack does not apply (more rows than it takes).
    Where the block formats take the int8 GEMM from 3 rows on (AVX512-VNNI), a prefill step's last layer in the
    stack runs its sampled rows alone, below 3, on the kernel (the same quantities, float32 sums in another order):
    there the tokens are equal and the logprobs within float32 rounding."""
    path = request.getfixturevalue(fixture)
    stacked = make_llm(path, dtype="float32", quantization=quantization)
    looped = make_llm(path, dtype="float32", quantization=quantization)
    looped.engine.model_runner.model.stack = False  # never built: the Python loop over the same kernels
    for ours, theirs in zip(packed_logits(stacked, PROMPTS), packed_logits(looped, PROMPTS)):
        assert torch.equal(ours, theirs)
    assert stacked.engine.model_runner.model.stack  # it ran
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ours, theirs = stacked.generate(PROMPTS, params), looped.generate(PROMPTS, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    if quantization in BLOCK_FORMATS and kernels.int8_gemm_available():
        for a, b in zip(ours, theirs):
            torch.testing.assert_close([t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs],
                                       rtol=1e-5, atol=1e-5)
    else:
        assert [o.logprobs for o in ours] == [o.logprobs for o in theirs]


def hidden_of_rows(llm: LLM, prompts: list[list[int]], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of one flat batch of ``prompts`` (fresh cache blocks each): every row's, and the model's answer
    for the last ``counts[i]`` rows of prompt i alone (``output_rows``: the sampled rows of a step)."""
    from twophase.engine.input_batch import build_input_batch

    runner = llm.engine.model_runner
    scheduled, next_block = [], 0
    for i, (ids, count) in enumerate(zip(prompts, counts)):
        blocks = list(range(next_block, next_block - (-len(ids) // runner.block_size)))
        next_block += len(blocks)
        drafts = ids[len(ids) - count + 1:] if count > 1 else []  # count rows sampled: 1 + proposals
        scheduled.append(ScheduledRequest(f"p{i}", ids, 0, blocks, sample=count > 0, is_prompt=True,
                                          spec_token_ids=drafts))
    batch = build_input_batch(SchedulerOutput(0, scheduled), runner.block_size, runner.device)
    model = runner.model
    with torch.inference_mode():
        every = model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)  # [T, hidden]
        chosen = model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta,
                       batch.sample_token_indices)  # [N, hidden]
    return every[batch.sample_token_indices], chosen


@pytest.mark.parametrize("gemm_dtype", [None, "bfloat16"])
def test_decoder_stack_runs_the_last_layer_on_the_sampled_rows_alone(tiny_llama_dir, gemm_dtype):
    """``output_rows``: the stack writes every row's K / V, then runs the last layer on the rows asked for (one
    request's last three, another's none, a third's last one). In float32 their hidden states are the full
    forward's bit for bit (the kernels' arithmetic of a row does not depend on the others); under bfloat16 GEMMs
    those rows take the small-batch GEMM instead of the wide one, whose sums round to bfloat16 (2^-9 relative) in
    another order, in each of the last layer's three GEMMs and its SiLU-and-mul: four roundings of up to 2^-8, so
    within 2^-6 of the largest value. A step that samples nothing gets no rows; rows that are not each request's
    last ones are refused."""
    prompts = [[(7 * i) % 60 + 2 for i in range(50)], [(3 * i) % 50 + 1 for i in range(37)], [5] * 20]
    llm = make_llm(tiny_llama_dir, dtype="float32", **({"gemm_dtype": gemm_dtype} if gemm_dtype else {}))
    expected, chosen = hidden_of_rows(llm, prompts, [3, 0, 1])
    assert llm.engine.model_runner.model.stack  # the stack ran
    assert chosen.shape == (4, expected.shape[1])
    if gemm_dtype is None:
        assert torch.equal(chosen, expected)
    else:
        torch.testing.assert_close(chosen, expected, rtol=0, atol=2**-6 * expected.abs().max().item())
    none_expected, none = hidden_of_rows(llm, prompts, [0, 0, 0])
    assert none.shape == none_expected.shape == (0, expected.shape[1])
    runner = llm.engine.model_runner
    from twophase.engine.input_batch import build_input_batch

    batch = build_input_batch(SchedulerOutput(0, [ScheduledRequest("x", prompts[2], 0, [0, 1, 2, 3, 4], sample=True,
                                                                   is_prompt=True)]), runner.block_size, runner.device)
    with pytest.raises(RuntimeError, match="each request's last rows"), torch.inference_mode():
        runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta, torch.tensor([0]))  # a first row


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("cache", ["auto", "int8", "float32"])
def test_decoder_stack_is_bit_identical_to_the_loop_under_bfloat16_gemms(tiny_llama_dir, monkeypatch, amx, cache):
    """With bfloat16 GEMM copies the stack hands gate_up's bfloat16 result to SiLU-and-mul unwidened
    (``silu_and_mul_widened``) where the loop widens it, then rounds the float32 product for down's GEMM; the norms
    and attention store bfloat16 rows for the projections after them, which the loop's GEMMs round themselves: the
    same logits bit for bit, over 75 rows (GEMMs), a 50-token prompt and a 5-token one (attention's float32 kernel),
    over a bfloat16 (auto), an int8 and a float32 cache. As on an AMX CPU: oneDNN's GEMMs and the SDPA prefill;
    without AMX: the AVX512-BF16 dot-product GEMM below 128 rows and prefill attention (where the kernels have
    them)."""
    from twophase.engine import hardware

    monkeypatch.setattr(hardware, "cpu_has_amx", lambda: amx)
    prompts = [[(7 * i) % 60 + 2 for i in range(50)], [3] * 20, [5, 9, 11, 2, 7]]
    stacked = make_llm(tiny_llama_dir, dtype="float32", gemm_dtype="bfloat16", cache_dtype=cache)
    looped = make_llm(tiny_llama_dir, dtype="float32", gemm_dtype="bfloat16", cache_dtype=cache)
    looped.engine.model_runner.model.stack = False
    assert stacked.engine.model_runner.gemm_dtype == torch.bfloat16
    for ours, theirs in zip(packed_logits(stacked, prompts), packed_logits(looped, prompts)):
        assert torch.equal(ours, theirs)
    assert stacked.engine.model_runner.model.stack


@pytest.mark.parametrize("amx", [False, True])
def test_bfloat16_prefill_products_by_cpu(tiny_llama_dir, monkeypatch, kernels, amx):
    """Under bfloat16 GEMMs and cache prefill chunks multiply in bfloat16: through torch's SDPA on a CPU with AMX,
    else on the kernel's AVX512-BF16 dot products where it has them (torch's flash attention multiplies at its
    float32 rate there), summed on FMAs where bf16_gemm's are; never in float32. (The stack-vs-loop test above runs both paths in the engine.)"""
    from twophase.engine import hardware
    from twophase.model.attention import DENSE_MIN_QUERIES, DOT_MIN_QUERIES
    from twophase.model.ops.gemm import dot_sums_on_fma

    monkeypatch.setattr(hardware, "cpu_has_amx", lambda: amx)
    bf16 = make_llm(tiny_llama_dir, dtype="float32", gemm_dtype="bfloat16").engine.model_runner
    fp32 = make_llm(tiny_llama_dir, dtype="float32").engine.model_runner
    dot = not amx and kernels.bf16_gemm_available()
    assert bf16.backend.dense_min_queries == (DENSE_MIN_QUERIES if amx else 0)
    assert bf16.backend.dot_min_queries == (DOT_MIN_QUERIES if dot else 0)
    assert bf16.backend.dot_fma == (dot and dot_sums_on_fma())  # summed as bf16_gemm sums
    assert fp32.backend.dense_min_queries == fp32.backend.dot_min_queries == 0


def test_silu_and_mul_widened_rounds_the_float32_result_once(kernels):
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(33, 2 * 203, generator=g) * 4).bfloat16()  # F = 203: vector rows and a scalar tail
    expected = kernels.silu_and_mul(gate_up.float()).bfloat16()
    assert torch.equal(kernels.silu_and_mul_widened(gate_up), expected)


def test_decoder_stack_stands_aside_where_an_op_has_no_kernel(tiny_llama_dir, kernels, monkeypatch):
    """The torch attention reference, float64 and more rows than the quantized kernels take (without the int8 GEMM,
    which takes every row count) all run the Python loop."""
    monkeypatch.setattr(kernels, "int8_gemm_available", lambda: False)
    reference = make_llm(tiny_llama_dir, dtype="float32", attention_backend="torch")
    packed_logits(reference, PROMPTS)
    assert reference.engine.model_runner.model.stack is False
    wide = make_llm(tiny_llama_dir, dtype="float32", quantization="q8_0")
    limit = wide.engine.model_runner.model.stack_max_rows
    long_prompt = [[(7 * i) % 50 + 3 for i in range(limit + 5)]]
    wide.engine.model_runner.model.stack = None
    logits = packed_logits(wide, long_prompt)[0]  # [tokens, vocab]
    assert wide.engine.model_runner.model.stack is None and logits.shape[0] == limit + 5


@pytest.mark.parametrize("int8_gemm", [False, True])
def test_decoder_stack_takes_as_many_rows_as_every_projection_kernel(tiny_llama_dir, kernels, monkeypatch, int8_gemm):
    """The stack's row limit is the least of its projections' kernel limits: float32 panels take every batch, the
    block formats keep their kernels to 128 rows (every batch where the int8 GEMM takes over from 3 rows),
    --deterministic keeps every batch."""
    if int8_gemm and not kernels.int8_gemm_available():
        pytest.skip("the kernels were built without AVX512-VNNI")
    monkeypatch.setattr(kernels, "int8_gemm_available", lambda: int8_gemm)
    limits = {
        "none": make_llm(tiny_llama_dir, dtype="float32").engine.model_runner.model.stack_max_rows,
        "q8_0": make_llm(tiny_llama_dir, dtype="float32", quantization="q8_0").engine.model_runner.model.stack_max_rows,
        "deterministic": make_llm(tiny_llama_dir, dtype="float32", deterministic=True).engine.model_runner.model.stack_max_rows,
    }
    q8_0 = float("inf") if int8_gemm else MAX_KERNEL_ROWS["q8_0"]
    assert limits == {"none": float("inf"), "q8_0": q8_0, "deterministic": float("inf")}


@pytest.mark.parametrize("quantization", ["none", "q4_1"])
def test_deterministic_logprobs_do_not_depend_on_the_batch(tiny_llama_dir, quantization):
    """``deterministic``: each prompt alone, all together under a 7-token budget (chunked prefill beside decode rows),
    and all together in one step of ~180 rows (beyond the 128 rows where the default mode switches to a GEMM) give
    the same tokens and the same logprobs, bit for bit."""
    prompts = PROMPTS + [[(11 * i) % 390 + 3 for i in range(150)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def make(budget: int) -> LLM:
        return LLM(str(tiny_llama_dir), progress=False, block_size=4, num_blocks=256, dtype="float32",
                   quantization=quantization, deterministic=True, enable_prefix_caching=False,
                   max_num_batched_tokens=budget)  # fmt: skip

    single = make(256)
    alone = [single.generate([p], params)[0] for p in prompts]
    for budget in (7, 256):
        together = make(budget).generate(prompts, params)
        assert [o.token_ids for o in together] == [o.token_ids for o in alone]
        assert [o.logprobs for o in together] == [o.logprobs for o in alone], f"budget {budget}"


def test_deterministic_refuses_what_is_not_batch_invariant(tiny_llama_dir):
    with pytest.raises(ValueError, match="--deterministic needs the kernel attention backend"):
        make_llm(tiny_llama_dir, dtype="float32", deterministic=True, attention_backend="torch")


def test_quantized_weights_change_the_logits_only_a_little(tiny_llama_dir):
    """8-bit formats move logits by a few % of their range, 4-bit (16 levels, random weights) by more. The GGUF
    block formats also round activations to int8 blocks (as llama.cpp does): two 8-bit roundings per product instead
    of one, so q8_0 gets twice int8's bound."""
    dense = torch.cat(packed_logits(make_llm(tiny_llama_dir, dtype="float32"), PROMPTS))  # [tokens, vocab]
    scale = float(dense.abs().max())
    for quantization, limit in (("int8", 0.05), ("q8_0", 0.1), ("q4_1", 0.6)):
        llm = make_llm(tiny_llama_dir, dtype="float32", quantization=quantization)
        error = float((torch.cat(packed_logits(llm, PROMPTS)) - dense).abs().max()) / scale
        assert 0 < error <= limit, f"{quantization}: max error {error:.4f} of the logit range"


def test_bf16_kernels_close_to_fp32(tiny_llama_dir):
    bf16 = make_llm(tiny_llama_dir, dtype="bfloat16")
    assert bf16.engine.model_runner.backend.name == "kernel"
    fp32 = make_llm(tiny_llama_dir, dtype="float32", attention_backend="torch", linear_backend="torch")
    reference = torch.cat(packed_logits(fp32, PROMPTS))  # [tokens, vocab]
    error = (torch.cat(packed_logits(bf16, PROMPTS)) - reference).abs().max() / reference.abs().max()
    assert error < 0.05, f"bfloat16 moved a logit by {error:.3f} of the logit range"


def test_mixed_batch_decode_and_chunks_on_kernels(tiny_llama_dir):
    """Decode rows and prefill chunks in one step (budget 7) give the tokens of each prompt alone."""
    alone = [make_llm(tiny_llama_dir, dtype="float32").generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    together = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_blocks=64, dtype="float32",
                   max_num_batched_tokens=7).generate(PROMPTS, GREEDY)  # fmt: skip
    assert [o.token_ids for o in together] == alone


def test_bf16_kv_cache_under_float32_model(tiny_llama_dir):
    """``cache_dtype="bfloat16"`` (``--kv-cache-dtype``): half the bytes per block; the kernels (rotary + cache
    write, attention) give the logits of the plain-torch path reading the same bfloat16 cache; both stay within
    bfloat16's rounding of K and V (a relative 2^-9 per value) of the float32 cache."""
    fast = make_llm(tiny_llama_dir, dtype="float32", cache_dtype="bfloat16")
    runner = fast.engine.model_runner
    assert runner.backend.name == "kernel" and runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.kv_cache_bytes * 2 == make_llm(tiny_llama_dir, dtype="float32").engine.model_runner.kv_cache_bytes
    plain = make_llm(tiny_llama_dir, dtype="float32", cache_dtype="bfloat16", attention_backend="torch",
                     linear_backend="torch")  # fmt: skip
    ours = torch.cat(packed_logits(fast, PROMPTS))  # [tokens, vocab]
    torch.testing.assert_close(ours, torch.cat(packed_logits(plain, PROMPTS)), rtol=1e-4, atol=1e-4)
    exact = torch.cat(packed_logits(make_llm(tiny_llama_dir, dtype="float32"), PROMPTS))
    error = float((ours - exact).abs().max() / exact.abs().max())
    assert 0 < error < 0.02, f"a bfloat16 cache moved a logit by {error:.4f} of the logit range"


def test_bf16_kv_cache_keeps_batch_invariance(tiny_llama_dir):
    """--deterministic with a bfloat16 cache: each prompt alone and all together under a 7-token budget give the
    same logprobs bit for bit (rounding K and V on write does not depend on the batch)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def make(budget: int) -> LLM:
        return LLM(str(tiny_llama_dir), progress=False, block_size=4, num_blocks=128, dtype="float32",
                   cache_dtype="bfloat16", deterministic=True, enable_prefix_caching=False,
                   max_num_batched_tokens=budget)  # fmt: skip

    alone = [make(256).generate([p], params)[0] for p in PROMPTS]
    together = make(7).generate(PROMPTS, params)
    assert [o.logprobs for o in together] == [o.logprobs for o in alone]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_kv_cache(tiny_llama_dir, dtype):
    """``cache_dtype="int8"`` (``--kv-cache-dtype int8``) under either model dtype: rows of D int8 values and their
    float32 scale, (D + 4) / 4D of a float32 cache's bytes; the kernels (rotary + the quantizing cache write,
    attention) give the logits of the plain-torch path reading the same int8 cache (head dim 16 here: the kernel's
    float32 products), and both stay near the float32 cache's: K and V keep 7 bits of each row's largest value."""
    fast = make_llm(tiny_llama_dir, dtype=dtype, cache_dtype="int8")
    runner = fast.engine.model_runner
    head_dim = runner.kv_caches[0][0].shape[-1] - INT8_ROW_EXTRA
    assert runner.backend.name == "kernel" and runner.kv_caches[0][0].dtype == torch.int8
    float32_bytes = make_llm(tiny_llama_dir, dtype="float32").engine.model_runner.kv_cache_bytes
    assert runner.kv_cache_bytes * 4 * head_dim == float32_bytes * (head_dim + INT8_ROW_EXTRA)
    plain = make_llm(tiny_llama_dir, dtype=dtype, cache_dtype="int8", attention_backend="torch", linear_backend="torch")
    ours = torch.cat(packed_logits(fast, PROMPTS)).float()  # [tokens, vocab]
    exact = torch.cat(packed_logits(make_llm(tiny_llama_dir, dtype="float32"), PROMPTS))
    if dtype == "float32":
        torch.testing.assert_close(ours, torch.cat(packed_logits(plain, PROMPTS)), rtol=1e-4, atol=1e-4)
    error = float((ours - exact).abs().max() / exact.abs().max())
    assert 0 < error < (0.05 if dtype == "float32" else 0.1), f"an int8 cache moved a logit by {error:.4f} of the range"


def test_kv_cache_dtype_refuses_a_wider_cache_than_the_model(tiny_llama_dir):
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 needs a float32 model"):
        make_llm(tiny_llama_dir, dtype="bfloat16", cache_dtype="float32")


def teacher_forced_top1(llm: LLM, reference: LLM, prompts: list[list[int]]) -> float:
    """Fraction of positions where ``llm``'s argmax equals ``reference``'s on the same token sequences."""
    agree = total = 0
    for ours, theirs in zip(packed_logits(llm, prompts), packed_logits(reference, prompts)):
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += ours.shape[0]
    return agree / total


@pytest.mark.parametrize("dtype,quantization,cache_dtype,gemm_dtype,floor", [
    ("bfloat16", "none", "auto", "float32", 0.97), ("float32", "int8", "auto", "float32", 0.95),
    ("float32", "q8_0", "float32", "float32", 0.95), ("float32", "gguf", "auto", "float32", 0.95),
    ("auto", "q8_0", "auto", "auto", 0.93),
    ("float32", "none", "bfloat16", "float32", 0.97), ("float32", "none", "bfloat16", "bfloat16", 0.97),
    ("auto", "none", "int8", "auto", 0.97)])  # fmt: skip
def test_real_model_agreement_with_float32(default_model, dtype, quantization, cache_dtype, gemm_dtype, floor):
    """Teacher-forced top-1 agreement with float32 on real text (the chat prompts plus their greedy answers).
    q8_0 and gguf (SmolLM2's Q4_1 as stored, against the float32 of the same weights) round activations to int8
    blocks as llama.cpp does: measured 0.960 and 0.957 (0.99+ with float32 activations). Under --dtype auto a
    block format keeps float32 activations and a bfloat16 KV cache (resolve_cache_dtype): q8_0 0.938, gguf 0.957.
    A bfloat16 KV cache under float32 weights (--kv-cache-dtype bfloat16) rounds only K and V; with bfloat16 GEMMs
    (what --dtype auto runs on an AMX CPU) prefill's projections round their rows and outputs too. An int8 cache
    over the defaults (--kv-cache-dtype int8; on AVX512-VNNI the decode queries are rounded to int8 rows too):
    0.978 on the Zen 4, against 0.993 for the defaults' bfloat16 cache."""
    from test_parity_hf import CHAT_PROMPTS

    reference = LLM(str(default_model), dtype="float32", progress=False)
    conversations = [[{"role": "user", "content": q}] for q in CHAT_PROMPTS]
    answers = reference.chat(conversations, SamplingParams(temperature=0, max_tokens=48))
    sequences = [reference.render_chat(c) + a.token_ids for c, a in zip(conversations, answers)]
    other = LLM(str(default_model), dtype=dtype, quantization=quantization, cache_dtype=cache_dtype,
                gemm_dtype=gemm_dtype, progress=False)
    agreement = teacher_forced_top1(other, reference, sequences)
    print(f"{dtype}/{quantization}/cache {cache_dtype}/gemm {gemm_dtype}: top-1 agreement with float32 {agreement:.3f}")
    assert agreement >= floor


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_auto_dtype_reads_stored_blocks_in_float32(default_model, tiny_llama_dir, monkeypatch, fast_bf16):
    """--dtype auto: a GGUF whose projections are stored as Q4_1 / Q8_0 runs in float32 on every CPU (the blocks read
    as stored, exact, fewer bytes than bfloat16's), a safetensors model in bfloat16 where the CPU has bfloat16
    arithmetic; int8 keeps the CPU's rule, the block formats (gguf as stored, q8_0, q4_1) run float32 rows into their
    int8-block kernels; a named dtype is always kept."""
    from twophase.config import EngineConfig
    from twophase.engine import hardware
    from twophase.loader import open_model_source

    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: fast_bf16)
    by_cpu = torch.bfloat16 if fast_bf16 else torch.float32
    gguf, dense = open_model_source(str(default_model)), open_model_source(str(tiny_llama_dir))
    assert gguf.stores_native_blocks() and not dense.stores_native_blocks()
    assert llm_engine.engine_dtype(EngineConfig(model=str(default_model)), gguf) == torch.float32
    assert llm_engine.engine_dtype(EngineConfig(model=str(tiny_llama_dir)), dense) == by_cpu
    assert llm_engine.engine_dtype(EngineConfig(model=str(default_model), quantization="int8"), gguf) == by_cpu
    for blocks in ("gguf", "q8_0", "q4_1"):  # int8-block kernels take float32 rows (and the decoder stack runs)
        assert llm_engine.engine_dtype(EngineConfig(model=str(default_model), quantization=blocks), gguf) == torch.float32
    assert llm_engine.engine_dtype(EngineConfig(model=str(tiny_llama_dir), quantization="gguf"), dense) == by_cpu
    assert llm_engine.engine_dtype(EngineConfig(model=str(default_model), dtype="bfloat16"), gguf) == torch.bfloat16
    assert llm_engine.wants_native_weights(EngineConfig(model=str(default_model)), gguf)


def test_gemm_weight_takes_rows_from_its_threshold(kernels, monkeypatch):
    """A projection with a bfloat16 GEMM weight (``use_gemm_weights``) gives the panels' bits below the threshold and
    torch's bfloat16 GEMM (rows rounded to bfloat16, float32 out, then the bias) from it, on oneDNN's prepacked copy
    below PREPACKED_MAX_ROWS (its blocking may round differently: within a bfloat16 step of F.linear's) and on the
    weight itself from there; a batch-invariant one refuses a GEMM weight."""
    from twophase.model.ops.gemm import PREPACKED_MAX_ROWS, use_gemm_weights

    torch.manual_seed(3)
    weight, bias = torch.randn(50, 96), torch.randn(50)
    layer, plain = KernelLinear(weight, bias, kernels), KernelLinear(weight.clone(), bias, kernels)
    assert use_gemm_weights(torch.nn.Sequential(layer), torch.bfloat16, min_rows=4) == 1
    for rows in (1, 3, 4, 17, PREPACKED_MAX_ROWS, 300):
        x = torch.randn(rows, 96)
        if rows < 4:
            assert torch.equal(layer(x), plain(x)), rows
            continue
        expected = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float() + bias
        if rows >= PREPACKED_MAX_ROWS or layer.gemm_packed is None:
            assert torch.equal(layer(x), expected), rows
        else:
            torch.testing.assert_close(layer(x), expected, rtol=1e-2, atol=1e-2)
            assert not torch.allclose(layer(x), plain(x), rtol=1e-4, atol=1e-4)  # the GEMM ran, not the panels
    invariant = KernelLinear(weight, bias, kernels, batch_invariant=True)
    with pytest.raises(RuntimeError, match="batch_invariant"):
        use_gemm_weights(torch.nn.Sequential(invariant), torch.bfloat16)
    from twophase.model.ops import gemm  # a prepacked copy oneDNN refuses: at::linear instead

    monkeypatch.setattr(gemm, "prepack_for_onednn", lambda weight, rows=32: torch.zeros(3))
    refused = KernelLinear(weight, bias, kernels)
    use_gemm_weights(torch.nn.Sequential(refused), torch.bfloat16, min_rows=4)
    x = torch.randn(17, 96)
    assert refused.gemm_packed is None
    assert torch.equal(refused(x), torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float() + bias)


def test_dot_weight_takes_every_row_count_from_its_threshold(kernels):
    """``use_gemm_weights(..., dot_products=True)`` (a CPU with AVX512-BF16 and no AMX): from the threshold
    (``DOT_MIN_ROWS`` by default) on, prefill-sized row counts included, the projection gives the dot-product
    kernel's bits (``bf16_gemm``, widened, then the bias), below it the panels; no oneDNN copy is kept. A build
    without the kernel keeps oneDNN's, from ``GEMM_MIN_ROWS``."""
    from twophase.model.ops.gemm import DOT_MIN_ROWS, GEMM_MIN_ROWS, PREPACKED_MAX_ROWS, dot_sums_on_fma, use_gemm_weights

    torch.manual_seed(4)
    weight, bias = torch.randn(50, 96), torch.randn(50)
    layer, plain = KernelLinear(weight, bias, kernels), KernelLinear(weight.clone(), bias, kernels)
    use_gemm_weights(torch.nn.Sequential(layer), torch.bfloat16, dot_products=True)
    if not kernels.bf16_gemm_available():  # as without dot_products
        other = KernelLinear(weight.clone(), bias, kernels)
        use_gemm_weights(torch.nn.Sequential(other), torch.bfloat16, min_rows=GEMM_MIN_ROWS)
        x = torch.randn(17, 96)
        assert torch.equal(layer(x), other(x))
        return
    assert layer.gemm_packed is None
    packed = kernels.pack_bf16_gemm(weight.bfloat16())
    for rows in (DOT_MIN_ROWS - 1, DOT_MIN_ROWS, 17, PREPACKED_MAX_ROWS - 1, PREPACKED_MAX_ROWS, 300, 2049):
        x = torch.randn(rows, 96)
        expected = plain(x) if rows < DOT_MIN_ROWS else kernels.bf16_gemm(x, packed, 50, False, dot_sums_on_fma()) + bias
        assert torch.equal(layer(x), expected), rows
        if rows >= DOT_MIN_ROWS:  # the bfloat16 GEMM's value, summed in another order
            reference = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float() + bias
            torch.testing.assert_close(layer(x), reference, rtol=1e-2, atol=1e-2)


def test_dot_sums_on_fma_follows_the_instruction_rates(kernels, monkeypatch):
    """``bf16_gemm`` sums on FMAs where this CPU's float32 FMA outruns its dot-product instruction by
    ``FMA_OVER_DOT`` (measured), or as ``TWOPHASE_BF16_GEMM`` says."""
    from twophase.model.ops import gemm

    decide = gemm.dot_sums_on_fma.__wrapped__  # the measurement, not the process's cached answer
    for choice, fma in (("dot", False), ("fma", True)):
        monkeypatch.setenv("TWOPHASE_BF16_GEMM", choice)
        assert decide() is fma
    monkeypatch.delenv("TWOPHASE_BF16_GEMM")
    if not kernels.bf16_gemm_available():
        assert decide() is False
        return
    rates = {"bfloat16": 100.0, "float32": 200.0}
    monkeypatch.setattr(kernels, "instruction_peak", lambda dtype, seconds: rates[dtype], raising=False)
    assert decide() is True
    rates["float32"] = 50.0
    assert decide() is False
    # one run of the dot products slowed by the host (100 of 400) does not turn the GEMMs to FMAs: best of the tries
    samples = {"bfloat16": iter([100.0, 400.0, 400.0]), "float32": iter([200.0] * 3)}
    monkeypatch.setattr(kernels, "instruction_peak", lambda dtype, seconds: next(samples[dtype]), raising=False)
    assert decide() is False


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_gemm_dtype_auto_only_for_block_weights_on_bf16_cpus(default_model, tiny_llama_dir, monkeypatch, fast_bf16):
    """--gemm-dtype auto: bfloat16 GEMMs (and a bfloat16 KV cache) where --dtype auto runs GGUF-block weights in float32
    on a CPU with bfloat16 arithmetic; never for an explicit --dtype, --deterministic or a quantization; an explicit
    bfloat16 where it cannot apply is refused."""
    from twophase.config import EngineConfig
    from twophase.engine import hardware
    from twophase.engine.model_runner import resolve_cache_dtype
    from twophase.loader import open_model_source

    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: fast_bf16)
    gguf, dense = open_model_source(str(default_model)), open_model_source(str(tiny_llama_dir))
    auto = llm_engine.resolve_gemm_dtype(EngineConfig(model=str(default_model)), gguf)
    assert auto == (torch.bfloat16 if fast_bf16 else None)
    assert resolve_cache_dtype("auto", torch.float32, auto) == (torch.bfloat16 if fast_bf16 else torch.float32)
    for options in ({"dtype": "float32"}, {"deterministic": True}, {"quantization": "int8"}):
        assert llm_engine.resolve_gemm_dtype(EngineConfig(model=str(default_model), **options), gguf) is None
    assert llm_engine.resolve_gemm_dtype(EngineConfig(model=str(tiny_llama_dir)), dense) is None or not fast_bf16
    assert llm_engine.resolve_gemm_dtype(EngineConfig(model=str(default_model), gemm_dtype="bfloat16",
                                                      dtype="float32"), gguf) == torch.bfloat16
    with pytest.raises(ValueError, match="not --deterministic"):
        llm_engine.resolve_gemm_dtype(EngineConfig(model=str(default_model), gemm_dtype="bfloat16",
                                                   deterministic=True), gguf)


def test_gguf_weights_run_as_stored(default_model):
    """--quantization gguf keeps SmolLM2's Q4_1 projections and Q8_0 head as stored: dequantising them gives back
    exactly the float32 weights the loader reads (so row order and llama.cpp's q/k permutation are right). The
    float32 default runs from the same blocks (never loaded as float32), which widen to those weights too."""
    dense = LLM(str(default_model), dtype="float32", progress=False, num_blocks=8).engine.model_runner.model
    native = LLM(str(default_model), dtype="float32", quantization="gguf", progress=False, num_blocks=8)
    model = native.engine.model_runner.model
    assert model.logits_head.fmt == "q8_0"
    # float32 itself runs from the same blocks, widened exactly (test_float32_gguf_blocks_run_bit_identical)
    assert isinstance(dense.logits_head, BlockPanelLinear) and dense.logits_head.fmt == "q8_0"
    assert all(isinstance(layer.mlp.down_proj, BlockPanelLinear) and layer.mlp.down_proj.fmt == "q4_1"
               for layer in dense.layers)
    from twophase.loader import open_model_source

    last = len(model.layers) - 1
    loaded = dict(open_model_source(str(default_model)).iter_weights(progress=False))  # the loader's float32
    parts = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "mlp.down_proj": ("mlp.down_proj",)}  # fmt: skip
    for i in (0, last):
        for name in PROJECTIONS:
            layer, reference = model.layers[i].get_submodule(name), dense.layers[i].get_submodule(name)
            expected = torch.cat([loaded[f"model.layers.{i}.{part}.weight"] for part in parts[name]])
            assert layer.fmt == "q4_1"
            assert torch.equal(layer.dequantized(), expected), name
            assert torch.equal(reference.unpacked_weight(), expected), name
    assert torch.equal(model.logits_head.dequantized(), dense.embed_tokens.weight)
    assert torch.equal(dense.embed_tokens.weight, loaded["model.embed_tokens.weight"])
