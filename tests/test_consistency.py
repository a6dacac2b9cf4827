"""The consistency matrix in fp32: identical greedy tokens across token budgets × prefix cache on/off
(including a second run that hits the cache) × forced preemption × one request alone vs 8 at once."""

from __future__ import annotations

import itertools

import pytest

from tiny_models import MIXED_PROMPTS as PROMPTS
from twophase import LLM, SamplingParams

NUM_TOKENS = 16
BUDGETS = {"4": 4, "7": 7, "64": 64, "unchunked": None}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    """Each prompt alone, unchunked, no prefix cache, a roomy KV pool."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", progress=False, block_size=4, num_blocks=256,
              enable_prefix_caching=False, enable_chunked_prefill=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [llm.generate([p], params)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize(
    "budget,prefix_caching,preemption", list(itertools.product(BUDGETS, [True, False], [False, True]))
)
def test_consistency_matrix(tiny_llama_dir, reference, budget, prefix_caching, preemption):
    # 9 blocks hold any single request (≤ 36 tokens); 8 at once need far more, so preemption is forced
    num_blocks = 10 if preemption else 256
    chunked = BUDGETS[budget] is not None
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", progress=False, block_size=4, num_blocks=num_blocks,
        enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked,
        max_num_batched_tokens=BUDGETS[budget] or 2048, max_num_seqs=8,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    together = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == reference
    scheduler = llm.engine.scheduler
    if preemption:
        assert scheduler.num_preemptions > 0
    else:
        assert scheduler.num_preemptions == 0
    alone = [llm.generate([p], params)[0] for p in PROMPTS]  # a second run: hits the cache when enabled
    assert [o.token_ids for o in alone] == reference
    if prefix_caching:
        assert sum(o.num_cached_tokens for o in alone) > 0
        assert scheduler.block_manager.stats.num_hits > 0
    else:
        assert all(o.num_cached_tokens == 0 for o in alone)
    scheduler.check_invariants()
    assert scheduler.block_manager.num_blocks_in_use == 0
