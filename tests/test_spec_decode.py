"""Speculative decoding is exact: greedy tokens identical to no speculation (ngram and a test proposer that
knows part of the answer) under chunked prefill, prefix caching and forced preemption, with check_invariants()
after every step; rejection sampling matches the target distribution (chi-square); stops, logprobs, config."""

from __future__ import annotations

import itertools

import pytest
import torch

from twophase import LLM, SamplingParams
from twophase.config import ConfigError
from twophase.sample import Sampler
from twophase.spec_decode import NgramProposer, SpeculativeConfig
from twophase.spec_decode.ngram import can_speculate, max_proposal_len

PROMPTS = [
    [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 8, 5, 17, 3, 88, 41, 9],  # repeats itself: ngram proposals hit the prompt
    [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 8, 100, 101, 102, 103, 104],  # shares blocks with the first
    [200, 201, 202],
    [7] * 20,
    [300, 12, 45, 67, 89, 10, 11, 300, 12, 45],
    [42],
]
NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def ngram(k: int) -> dict:
    """The vLLM-spelled config used throughout."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def make_llm(model_dir, spec: dict | None = None, **kw) -> LLM:
    """A float32 LLM on the tiny model with small blocks (so proposals cross block boundaries)."""
    options = dict(block_size=4, num_blocks=256, max_num_seqs=8) | kw
    return LLM(str(model_dir), dtype="float32", progress=False, speculative_config=spec, **options)


def run(llm: LLM, prompts, params: SamplingParams, proposer=None) -> list:
    """Generate all prompts together, checking the scheduler's books after every step."""
    engine = llm.engine
    if proposer is not None:
        engine.proposer = proposer
    ids = [engine.add_request(p, params).request_id for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.scheduler.check_invariants()
    return [finals[i] for i in ids]


class KnowsTheAnswer:
    """A test proposer: proposes the reference continuation, with every ``wrong_every``-th proposal's last token
    wrong — so full acceptance, partial acceptance and rejection all happen."""

    def __init__(self, k: int, reference: dict[tuple[int, ...], list[int]], wrong_every: int = 3) -> None:
        self.k, self.reference, self.wrong_every, self.calls = k, reference, wrong_every, 0

    def propose_all(self, requests) -> dict[str, list[int]]:
        return {r.request_id: self.propose_for(r) for r in requests}

    def propose_for(self, request) -> list[int]:
        k = max_proposal_len(request, self.k)
        if k == 0 or not can_speculate(request.sampling_params, request.num_output_tokens):
            return []
        answer = self.reference[tuple(request.prompt_token_ids)]
        proposal = answer[request.num_output_tokens : request.num_output_tokens + k]
        self.calls += 1
        if proposal and self.wrong_every and self.calls % self.wrong_every == 0:
            proposal[-1] = (proposal[-1] + 1) % 300
        return proposal


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    """Each prompt alone, no speculation."""
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


# (token budget or None: chunked prefill off, prefix caching, forced preemption); the first two run by default
CONFIGS = [(7, True, True), (None, False, False), (64, True, False), (5, False, True)]
MATRIX = [
    pytest.param(k, proposer, *config, marks=[pytest.mark.slow] if i >= 2 else [])
    for k, proposer in itertools.product((1, 3, 5), ("ngram", "oracle")) for i, config in enumerate(CONFIGS)
]  # fmt: skip


@pytest.mark.parametrize("k,proposer,budget,prefix_caching,preemption", MATRIX)
def test_greedy_identical_to_no_speculation(tiny_llama_dir, reference, k, proposer, budget, prefix_caching,
                                            preemption):
    # 10 blocks of 4 hold any single request; 6 at once do not, so preemption is forced
    llm = make_llm(
        tiny_llama_dir, ngram(k), num_blocks=10 if preemption else 256, enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=budget is not None, max_num_batched_tokens=budget or 2048,
    )  # fmt: skip
    oracle = KnowsTheAnswer(k, {tuple(p): r for p, r in zip(PROMPTS, reference)}) if proposer == "oracle" else None
    together = run(llm, PROMPTS, GREEDY, oracle)
    assert [o.token_ids for o in together] == reference
    scheduler = llm.engine.scheduler
    assert (scheduler.num_preemptions > 0) == preemption
    stats = scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    assert max(len(stats.num_accepted_tokens_per_pos), 1) <= k
    if proposer == "oracle":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected both happened
    alone = [run(llm, [p], GREEDY)[0] for p in PROMPTS]  # a second run hits the prefix cache when enabled
    assert [o.token_ids for o in alone] == reference
    assert scheduler.block_manager.num_blocks_in_use == 0
    records = list(llm.engine.step_records)
    assert sum(r.num_output_tokens for r in records) == 2 * len(PROMPTS) * NUM_TOKENS
    assert sum(r.num_draft_tokens for r in records) == stats.num_draft_tokens
    assert sum(r.num_accepted_tokens for r in records) == stats.num_accepted_tokens


def test_a_perfect_proposer_is_always_accepted(tiny_llama_dir, reference):
    llm = make_llm(tiny_llama_dir, ngram(4))
    oracle = KnowsTheAnswer(4, {tuple(p): r for p, r in zip(PROMPTS, reference)}, wrong_every=0)
    outputs = run(llm, PROMPTS, GREEDY, oracle)
    assert [o.token_ids for o in outputs] == reference
    stats = llm.engine.scheduler.spec_stats
    assert stats.acceptance_rate == 1.0
    assert stats.mean_accepted_length > 3.0  # 5 tokens per step but where max_tokens leaves less room
    for output in outputs:  # the timeline records tokens per step: several in one step, all accounted for
        events = output.timeline.scheduled
        assert sum(e.num_output_tokens for e in events) == NUM_TOKENS
        assert max(e.num_output_tokens for e in events) == 5
        assert len(output.timeline.token_times) == NUM_TOKENS
        assert output.timeline.num_accepted_tokens == output.timeline.num_draft_tokens > 0


def test_stops_and_logprobs_exact_when_a_step_yields_several_tokens(tiny_llama_dir, reference):
    ref_llm = make_llm(tiny_llama_dir)
    stop_token = reference[0][5]  # the 6th token of prompt 0's answer
    text_llm_ref = ref_llm.generate([PROMPTS[0]], GREEDY)[0].text
    stop_text = text_llm_ref[len(text_llm_ref) // 2 : len(text_llm_ref) // 2 + 2]
    cases = [
        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stop_text],
                       include_stop_str_in_output=True),
    ]  # fmt: skip
    for params in cases:
        expected = ref_llm.generate(PROMPTS, params)
        llm = make_llm(tiny_llama_dir, ngram(5))
        oracle = KnowsTheAnswer(5, {tuple(p): r for p, r in zip(PROMPTS, reference)}, wrong_every=0)
        got = run(llm, PROMPTS, params, oracle)
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
        for e, g in zip(expected, got):
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (e.token_ids, e.text, e.finish_reason,
                                                                               e.stop_reason)  # fmt: skip
            assert len(g.logprobs) == len(e.logprobs) == (len(e.token_ids) if params.logprobs else 0)
            for a, b in zip(g.logprobs, e.logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert len(g.timeline.token_times) == len(g.token_ids)
        assert llm.engine.scheduler.block_manager.num_blocks_in_use == 0


def test_requests_that_cannot_be_verified_exactly_run_without_speculation(tiny_llama_dir, reference):
    llm = make_llm(tiny_llama_dir, ngram(3))
    oracle = KnowsTheAnswer(3, {tuple(p): r for p, r in zip(PROMPTS, reference)})
    penalised = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    expected = make_llm(tiny_llama_dir).generate(PROMPTS, penalised)
    got = run(llm, PROMPTS, penalised, oracle)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert oracle.calls == 0 and llm.engine.scheduler.spec_stats.num_drafts == 0
    assert not can_speculate(SamplingParams(n=2), 5)
    assert not can_speculate(SamplingParams(min_tokens=4, max_tokens=8), 3)
    assert can_speculate(SamplingParams(min_tokens=4, max_tokens=8), 4)


@pytest.fixture(scope="module")
def default_llm_and_reference(default_model):
    """One load of the real model with ngram speculation; the reference is the same engine with its proposer off."""
    passage = "The quick brown fox jumps over the lazy dog. It was a sunny day and the fox was happy."
    llm = LLM(str(default_model), dtype="float32", progress=False, num_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 4})  # fmt: skip
    assert isinstance(llm.engine.proposer, NgramProposer) and llm.engine.proposer.k == 3
    prompt = llm.render_chat([{"role": "user", "content": f"Repeat this passage exactly: {passage}"}])
    proposer, llm.engine.proposer = llm.engine.proposer, None
    expected = run(llm, [prompt], DEFAULT_MODEL_PARAMS)[0]
    llm.engine.proposer = proposer
    return llm, prompt, expected


DEFAULT_MODEL_PARAMS = SamplingParams(temperature=0, max_tokens=16)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(5, marks=pytest.mark.slow)])
def test_default_model_repeat_the_passage(default_llm_and_reference, k):
    llm, prompt, expected = default_llm_and_reference
    llm.engine.proposer = NgramProposer(k, 2, 4)
    got = run(llm, [prompt], DEFAULT_MODEL_PARAMS)[0]
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert got.timeline.num_accepted_tokens > 0  # the answer repeats the prompt: proposals hit


# ---- draft model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory):
    """Another random tiny Llama (one layer, other weights) with the same tokenizer."""
    from tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), initializer_range=0.3, seed=5, num_hidden_layers=1)


def draft(model_dir, k: int) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def test_a_draft_identical_to_the_target_accepts_every_proposal(tiny_llama_dir, reference):
    llm = make_llm(tiny_llama_dir, draft(tiny_llama_dir, 3))
    outputs = run(llm, PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(5, marks=pytest.mark.slow)])
def test_a_random_draft_still_gives_identical_greedy_output(tiny_llama_dir, random_draft_dir, reference, k):
    llm = make_llm(tiny_llama_dir, draft(random_draft_dir, k), num_blocks=10, max_num_batched_tokens=7)
    outputs = run(llm, PROMPTS, GREEDY)  # chunked prefill, prefix caching and forced preemption in the mix
    assert [o.token_ids for o in outputs] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    again = [run(llm, [p], GREEDY)[0] for p in PROMPTS[:2]]  # prefix-cache hits; the draft recomputes
    assert [o.token_ids for o in again] == reference[:2]
    proposer = llm.engine.proposer
    proposer.propose_all([])  # nothing runs: the draft frees every request's blocks
    assert proposer.block_manager.num_blocks_in_use == 0 and not proposer.states


# ---- rejection sampling ----------------------------------------------------------------------------------------
# chi-square critical values at significance 0.001 (the test fails by chance once in a thousand seeds)
CHI2_CRITICAL_0_001 = {3: 16.266, 4: 18.467, 5: 20.515}


def chi_square(counts: list[int], probs: list[float]) -> float:
    """Pearson's statistic of observed counts against expected probabilities (cells with p > 0)."""
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.9)])
def test_rejection_sampling_matches_the_target_distribution(options):
    vocab, trials = 6, 6000
    sampler = Sampler(vocab, seed=1234)
    gen = torch.Generator().manual_seed(99)
    logits = torch.randn(3, vocab, generator=gen) * 1.5  # rows: after the last token, after d0, after d0 d1
    drafts = logits[:2].argmax(-1).tolist()  # likely proposals: every branch (accept, reject, bonus) is taken
    states = [sampler.make_state(SamplingParams(max_tokens=100, **options), [1], [], ()) for _ in range(trials)]
    tokens, _ = sampler.verify(logits.repeat(trials, 1), states, [list(drafts) for _ in range(trials)])
    target = sampler.probabilities(sampler.process_logits(logits, states[:3]), states[:3])  # [3, vocab]
    target = (target / target.sum(-1, keepdim=True)).tolist()
    first = [t[0] for t in tokens]
    second = [t[1] for t in tokens if t[0] == drafts[0]]  # given the first proposal was emitted: p1
    assert all(len(t) <= 3 for t in tokens) and any(len(t) > 1 for t in tokens)
    for observed, probs in ((first, target[0]), (second, target[1])):
        support = sum(1 for p in probs if p > 0)
        counts = [observed.count(v) for v in range(vocab)]
        assert all(c == 0 for c, p in zip(counts, probs) if p == 0)  # never outside the filtered support
        assert chi_square(counts, probs) < CHI2_CRITICAL_0_001[support - 1], (counts, probs)
    assert len(second) > 300


def test_sampled_generation_with_speculation_has_the_target_distribution(tiny_llama_dir):
    """End to end: 5 allowed tokens, a prompt cycling through them (ngram proposals hit); the 2nd and 3rd output
    tokens of many seeded requests, with and without speculation, pass a two-sample chi-square test (0.001)."""
    allowed = [20, 53, 136, 202, 250]
    prompt = allowed * 4
    num = 400

    def sample(spec: dict | None, seed0: int) -> list[list[int]]:
        llm = make_llm(tiny_llama_dir, spec, max_num_seqs=64, num_blocks=1024)
        params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, allowed_token_ids=allowed,
                                 seed=seed0 + i) for i in range(num)]  # fmt: skip
        engine = llm.engine
        ids = [engine.add_request(prompt, p).request_id for p in params]
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            engine.scheduler.check_invariants()
        if spec is not None:
            assert engine.scheduler.spec_stats.num_accepted_tokens > 0
        return [finals[i] for i in ids]

    plain, spec = sample(None, 0), sample(ngram(2), 10_000)
    for position in (1, 2):
        a = [sum(1 for t in plain if t[position] == v) for v in allowed]
        b = [sum(1 for t in spec if t[position] == v) for v in allowed]
        total = [x + y for x, y in zip(a, b)]
        cells = [(x, t / 2) for x, t in zip(a + b, total + total) if t > 0]
        statistic = sum((observed - expected) ** 2 / expected for observed, expected in cells)
        assert statistic < CHI2_CRITICAL_0_001[sum(1 for t in total if t > 0) - 1], (position, a, b)


def test_greedy_verification_and_seeded_reproducibility():
    sampler = Sampler(8)
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 1, 6, 2]):
        logits[row, best] = 5.0
    greedy = sampler.make_state(SamplingParams(temperature=0), [1], [], ())
    assert sampler.verify(logits, [greedy], [[3, 1, 6]])[0] == [[3, 1, 6, 2]]  # all accepted + bonus
    assert sampler.verify(logits, [greedy], [[3, 0, 6]])[0] == [[3, 1]]  # first mismatch replaced
    seeded = [sampler.make_state(SamplingParams(seed=7), [1], [], ()) for _ in range(2)]
    assert sampler.verify(logits, seeded[:1], [[3, 1, 6]])[0] == sampler.verify(logits, seeded[1:], [[3, 1, 6]])[0]


# ---- configuration ---------------------------------------------------------------------------------------------
def test_speculative_config_parsing():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert SpeculativeConfig.parse(None) is None
    for bad, message in (("{nope", "not valid JSON"), ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
                         ('{"method": "ngram"}', "num_speculative_tokens"),
                         ('{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}', "bogus"),
                         ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
                          '"prompt_lookup_max": 2}', "prompt_lookup_min"),
                         ('{"method": "draft_model", "num_speculative_tokens": 2}', "model")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.parse(bad)


def test_ngram_proposals():
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]  # the 3-gram [1, 2, 3] seen before
    assert proposer.propose([1, 2, 3, 9, 9, 2, 3, 7, 2, 3]) == [7, 2, 3]  # the latest match of [2, 3]
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3], k=1) == [4]
    assert proposer.propose([5, 6, 7]) == [] and proposer.propose([1]) == []
    assert NgramProposer(3, 2, 3).propose([4, 1, 9, 1]) == []  # only a 1-gram matches: below prompt_lookup_min
