"""Parity with HF transformers: fp32 logits of packed prompts, greedy tokens, and the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from prerequisites import import_or_missing
from twophase import LLM, SamplingParams
from twophase.outputs import ScheduledRequest, SchedulerOutput

transformers = import_or_missing("transformers", module_level=True)

PROMPTS = [[5, 17, 3, 88, 41], [60, 2, 33, 71, 14, 8, 8, 9, 100, 250, 7, 7, 31], [9], [300, 301, 302, 303, 304, 305, 306, 307]]


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def packed_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every token of several prompts run together in one flat batch."""
    runner = llm.engine.model_runner
    scheduled, next_block = [], 0
    for i, ids in enumerate(prompts):
        num_blocks = -(-len(ids) // runner.block_size)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        scheduled.append(ScheduledRequest(f"p{i}", ids, 0, blocks, sample=True, is_prompt=True))
    logits = runner.forward_logits(SchedulerOutput(0, scheduled))
    return list(logits.split([len(p) for p in prompts]))


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Reference greedy decoding by full recompute (no EOS stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_untied_dir"])
def test_packed_logits_and_greedy_match_hf(fixture, request):
    path = request.getfixturevalue(fixture)
    llm = LLM(str(path), dtype="float32", progress=False, block_size=4, num_blocks=64)
    reference = hf_model(path)
    for ours, ids in zip(packed_logits(llm, PROMPTS), PROMPTS):
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for out, ids in zip(outputs, PROMPTS):
        assert out.token_ids == hf_greedy(reference, ids, 12)


def test_gguf_copy_generates_like_safetensors(tiny_llama_dir, tiny_llama_gguf):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a = LLM(str(tiny_llama_dir), progress=False).generate(PROMPTS, params)
    b = LLM(str(tiny_llama_gguf), progress=False).generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers.",
]


def test_smollm2_greedy_matches_hf(default_model):
    import_or_missing("accelerate")  # transformers needs it to read GGUF
    ours = LLM(str(default_model), dtype="float32", progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        default_model.parent, gguf_file=default_model.name, dtype=torch.float32
    ).eval()
    conversations = [[{"role": "user", "content": q}] for q in CHAT_PROMPTS]
    num_tokens = 40
    params = SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens)
    outputs = ours.chat(conversations, params)
    for conversation, out in zip(conversations, outputs):
        prompt = ours.render_chat(conversation)
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False
            )
        assert out.token_ids == generated[0, len(prompt):].tolist(), conversation
    assert "Paris" in outputs[0].text
