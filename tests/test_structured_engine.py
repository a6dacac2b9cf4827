"""Structured outputs inside the engine (no server): constrained greedy decoding equals a step-by-step reference
built from the plain engine path, and grammars survive chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import json

import pytest
import torch

from twophase import LLM, SamplingParams
from twophase.sampling_params import InvalidRequestError
from twophase.structured import StructuredOutputSpec

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"type": "string", "enum": ["a", "bb", "ccc"]},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "kind", "ok"], "additionalProperties": False}  # fmt: skip
SPEC = StructuredOutputSpec.json_schema(SCHEMA, "response_format")
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 8], [200, 201, 202], [7] * 20, [300, 12, 45, 67, 89, 10],
           [5, 17, 3, 88, 41, 9, 60, 2, 1, 1, 1, 1, 1], [42]]  # fmt: skip


def _allowed_ids(matcher, vocab_size: int) -> list[int]:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)]
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return torch.isfinite(logits[0]).nonzero().squeeze(1).tolist()


def test_constrained_greedy_equals_step_by_step_reference(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", progress=False)
    engine = llm.engine
    prompt = PROMPTS[0]
    constrained = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, structured=SPEC))[0]
    matcher = xgr.GrammarMatcher(engine.compile_grammar(SPEC))  # an independent matcher, fed by hand
    reference: list[int] = []
    while len(reference) < 60 and not matcher.is_terminated():
        allowed = _allowed_ids(matcher, engine.model_config.vocab_size)
        step = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed)
        token = llm.generate([prompt + reference], step)[0].token_ids[0]
        assert matcher.accept_token(token)
        reference.append(token)
    assert constrained.token_ids == reference and constrained.finish_reason == "stop"
    json.loads(constrained.text)


def test_grammars_survive_chunking_prefix_cache_and_preemption(tiny_llama_dir):
    roomy = LLM(str(tiny_llama_dir), dtype="float32", progress=False, block_size=4, num_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=60, structured=SPEC)
    alone = [roomy.generate([p], greedy)[0].token_ids for p in PROMPTS]
    tight = LLM(str(tiny_llama_dir), dtype="float32", progress=False, block_size=4, num_blocks=24,
                max_num_batched_tokens=16, enable_prefix_caching=True, max_num_seqs=8)  # fmt: skip
    together = tight.generate(PROMPTS, greedy)
    assert [o.token_ids for o in together] == alone
    assert tight.engine.scheduler.num_preemptions > 0
    sampled = tight.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured=SPEC)
                                       for i in range(len(PROMPTS))])
    for output in together + sampled:
        assert output.finish_reason == "stop"
        value = json.loads(output.text)
        assert set(value) == {"id", "kind", "ok"} and value["kind"] in ("a", "bb", "ccc")
    tight.engine.scheduler.check_invariants()


def test_invalid_constraints_are_refused_at_admission(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", progress=False)
    bad = [StructuredOutputSpec("regex", "(a", param="guided_regex"),
           StructuredOutputSpec("grammar", "root ::= ", param="guided_grammar"),
           StructuredOutputSpec("json", '{"type": "nonsense"}', param="guided_json")]
    for spec in bad:
        with pytest.raises(InvalidRequestError) as info:
            llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, structured=spec))
        assert info.value.param == spec.param
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError):
        StructuredOutputSpec.choice([], "guided_choice")
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured=SPEC, ignore_eos=True)
