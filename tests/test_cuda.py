"""The same parity and consistency checks on CUDA (marked gpu: skipped by default and without CUDA)."""

from __future__ import annotations

import pytest
import torch

from twophase import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2], [200, 201, 202], [7] * 20, [42]]


def test_cuda_greedy_equals_cpu_in_float32(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(str(tiny_llama_dir), dtype="float32", progress=False, block_size=4, num_blocks=64).generate(PROMPTS, params)
    gpu = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", progress=False, block_size=4, num_blocks=64)
    assert [o.token_ids for o in gpu.generate(PROMPTS, params)] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("budget,num_blocks", [(4, 64), (7, 10), (2048, 10)])
def test_cuda_consistency_under_chunking_and_preemption(tiny_llama_dir, budget, num_blocks):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", progress=False, block_size=4, num_blocks=256)
    expected = [reference.generate([p], params)[0].token_ids for p in PROMPTS]
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", progress=False, block_size=4,
              num_blocks=num_blocks, max_num_batched_tokens=budget)  # fmt: skip
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected


def test_cuda_bfloat16_smollm2_answers(default_model):
    llm = LLM(str(default_model), dtype="bfloat16", device="cuda", progress=False)
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                   SamplingParams(temperature=0, max_tokens=16))  # a wide margin (test_server_real_model)
    assert "Paris" in out[0].text
