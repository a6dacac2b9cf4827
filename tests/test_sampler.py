"""Batched sampler: greedy, filters, seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from prerequisites import built_kernels
from twophase.sample import Sampler, SamplingState
from twophase.sampling_params import SamplingParams

VOCAB = 32
EOS = 31


def state(
    sampler: Sampler, output: list[int] | None = None, prompt: list[int] | None = None, **kw: object
) -> SamplingState:
    """A state with max_tokens=100, EOS id ``EOS`` and the given SamplingParams fields."""
    prompt = [1, 2, 3] if prompt is None else prompt
    return sampler.make_state(SamplingParams(max_tokens=100, **kw), prompt, [] if output is None else output, (EOS,))


def sample_many(sampler: Sampler, logits_row: torch.Tensor, num: int, **kw: object) -> set[int]:
    """Draw ``num`` tokens from one logits row in a single batch of ``num`` identical rows."""
    states = [state(sampler, **kw) for _ in range(num)]
    return set(sampler(logits_row.expand(num, -1), states).token_ids)


def test_greedy_is_argmax_and_ignores_seeds() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(-1).tolist()
    for seed in (0, 1, 2):
        sampler = Sampler(VOCAB, seed=seed)
        states = [state(sampler, temperature=0.0, seed=seed + i) for i in range(6)]
        assert sampler(logits, states).token_ids == expected
    half = Sampler(VOCAB)
    assert half(logits.half(), [state(half, temperature=0.0) for _ in range(6)]).token_ids == expected


def test_padded_vocab_columns_are_never_sampled() -> None:
    sampler = Sampler(VOCAB)
    logits = torch.zeros(1, VOCAB + 8)
    logits[0, VOCAB + 3] = 100.0
    assert sampler(logits, [state(sampler, temperature=0.0)]).token_ids[0] < VOCAB


def test_top_k_only_samples_top_k() -> None:
    logits = torch.linspace(0.0, 3.0, VOCAB)  # best ids are the highest
    seen = sample_many(Sampler(VOCAB), logits, 2000, temperature=2.0, top_k=3)
    assert seen == {VOCAB - 1, VOCAB - 2, VOCAB - 3}


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-12).log()
    assert sample_many(Sampler(VOCAB), logits, 2000, top_p=0.75) == {0, 1}
    assert sample_many(Sampler(VOCAB), logits, 2000, top_p=0.85) == {0, 1, 2}
    assert sample_many(Sampler(VOCAB), logits, 500, top_p=0.01) == {0}  # the best is always kept


def test_min_p_drops_tokens_below_ratio() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-12).log()
    assert sample_many(Sampler(VOCAB), logits, 2000, min_p=0.45) == {0, 1, 2}  # 0.1 < 0.45 * 0.4


def test_unfiltered_sampling_follows_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1] + [0.0] * (VOCAB - 3))
    sampler = Sampler(VOCAB, seed=1)
    num = 4000
    states = [state(sampler) for _ in range(num)]
    ids = torch.tensor(sampler(probs.clamp_min(1e-12).log().expand(num, -1), states).token_ids)
    freq = torch.bincount(ids, minlength=VOCAB)[:3].float() / num
    assert torch.allclose(freq, probs[:3], atol=0.03)


@pytest.mark.parametrize("u", [0.0, 0.25, 0.5, 0.75, math.nextafter(1.0, 0.0), 1.0])
def test_draw_picks_by_cumulative_weight_and_never_a_zero_weight_id(u: float, monkeypatch) -> None:
    """Inverse CDF at the extremes of U(0, 1): ids of weight 0 (before, between and after the others) are
    never chosen, and each uniform lands on the id whose share of the running sum holds it (u = 1, outside
    U(0, 1), stands for a product u * total rounded up to the total: the last id of positive weight)."""
    sampler = Sampler(VOCAB)
    probs = torch.zeros(2, VOCAB)
    probs[0, [3, 7]] = torch.tensor([1.0, 3.0])  # unnormalised: 1/4 then 3/4
    probs[1, 30] = 1e-30  # one tiny weight, at the end of the row
    states = [state(sampler, temperature=1.0) for _ in range(2)]
    monkeypatch.setattr(sampler, "_uniforms", lambda states, device: torch.full((2,), u, dtype=torch.float64))
    assert sampler.draw(probs, states).tolist() == [3 if u < 0.25 else 7, 30]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 9.9e-6])
def test_temperature_below_1e_5_is_greedy(temperature: float) -> None:
    """logits / 5e-324 overflow to inf and softmax to NaN: such temperatures take the argmax (vLLM's epsilon)."""
    sampler = Sampler(VOCAB, seed=5)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    states = [state(sampler, temperature=temperature, seed=s) for s in (None, 1, 2)]
    assert sampler(logits, states).token_ids == logits.argmax(dim=-1).tolist()


def test_draw_returns_an_id_for_rows_without_positive_weight() -> None:
    """A row of NaNs or zeros (no distribution) still yields an id inside the vocabulary, never -1 or vocab."""
    sampler = Sampler(VOCAB)
    probs = torch.stack([torch.full((VOCAB,), float("nan")), torch.zeros(VOCAB), torch.eye(VOCAB)[9]])
    ids = sampler.draw(probs, [state(sampler, temperature=1.0) for _ in range(3)]).tolist()
    assert all(0 <= i < VOCAB for i in ids) and ids[2] == 9


def test_running_sums_in_the_kept_buffer_equal_a_fresh_float64_cumsum() -> None:
    """The float64 buffer is reused across batches that grow and shrink; its sums are a fresh cumsum's bits."""
    sampler = Sampler(100)
    gen = torch.Generator().manual_seed(0)
    for rows in (5, 3, 8, 2):
        probs = torch.rand(rows, 100, generator=gen)
        probs[:, ::3] = 0.0
        assert torch.equal(sampler._running_sums(probs), probs.cumsum(-1, dtype=torch.float64))


def run_seeded(seed: int, batch_size: int, row: int, steps: int = 8) -> list[int]:
    """Tokens of a seeded request at ``row`` of a batch, neighbours unseeded or differently seeded."""
    sampler = Sampler(VOCAB, seed=1234 + batch_size)
    gen = torch.Generator().manual_seed(99)
    target = state(sampler, seed=seed, temperature=1.5)
    states = [state(sampler, seed=None if i % 2 else 7 + i, top_k=5) for i in range(batch_size)]
    states[row] = target
    tokens = []
    for _ in range(steps):
        logits = torch.randn(batch_size, VOCAB, generator=gen)
        logits[row] = torch.linspace(-1.0, 1.0, VOCAB)  # the target row sees the same logits each run
        tokens.append(sampler(logits, states).token_ids[row])
    return tokens


def test_seed_is_independent_of_batch_and_row() -> None:
    alone = run_seeded(seed=42, batch_size=1, row=0)
    assert run_seeded(seed=42, batch_size=5, row=3) == alone
    assert run_seeded(seed=42, batch_size=5, row=0) == alone
    assert run_seeded(seed=43, batch_size=1, row=0) != alone


def test_repetition_penalty_exact_values() -> None:
    sampler = Sampler(8)
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0, 0.0, 0.5]])
    st = sampler.make_state(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0, 1], [2, 3, 3], (7,))
    out = sampler._apply_penalties(logits, [st])
    expected = torch.tensor([[1.0, -4.0, 1.0, -4.0, 1.0, 1.0, 0.0, 0.5]])
    assert torch.equal(out, expected)
    assert torch.equal(logits[0, :2], torch.tensor([2.0, -2.0]))  # the input is not modified


def test_frequency_and_presence_penalties_exact_values() -> None:
    sampler = Sampler(8)
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0, 0.0, 0.5]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    st = sampler.make_state(params, [0, 1], [2, 3, 3], (7,))  # prompt tokens are not penalised
    out = sampler._apply_penalties(logits, [st])
    expected = torch.tensor([[2.0, -2.0, 2.0 - 0.5 - 0.25, -2.0 - 1.0 - 0.25, 1.0, 1.0, 0.0, 0.5]])
    assert torch.allclose(out, expected)
    st.output_token_ids.append(4)  # the counts follow the growing output list
    out = sampler._apply_penalties(logits, [st])
    assert out[0, 4].item() == pytest.approx(1.0 - 0.75)


def test_penalties_change_greedy_choice_only_for_their_row() -> None:
    sampler = Sampler(VOCAB)
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    logits[:, 6] = 0.9
    states = [
        state(sampler, output=[5], temperature=0.0, presence_penalty=0.5),
        state(sampler, output=[5], temperature=0.0),
    ]
    assert sampler(logits, states).token_ids == [6, 5]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    sampler = Sampler(VOCAB)
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 3] = 8.0
    output: list[int] = []
    st = state(sampler, output=output, temperature=0.0, min_tokens=2, stop_token_ids=[7])
    assert sampler(logits, [st]).token_ids == [3]
    output += [3, 3]
    assert sampler(logits, [st]).token_ids == [EOS]
    ignoring = state(sampler, temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[7])
    assert sampler(logits, [ignoring]).token_ids == [EOS]  # ignore_eos: EOS is not masked, just not a stop


def test_logprobs_from_raw_distribution() -> None:
    sampler = Sampler(VOCAB)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    states = [
        state(sampler, logprobs=4, temperature=0.7, top_k=3, repetition_penalty=1.5),
        state(sampler),
        state(sampler, logprobs=0, temperature=0.0),
    ]
    out = sampler(logits, states)
    raw = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert first is not None and first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-6)
    assert len(first.top) == 4
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    assert first.top[0][0] == int(raw[0].argmax())
    assert all(math.isclose(lp, raw[0, i].item(), abs_tol=1e-6) for i, lp in first.top)
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third is not None and third.top == [] and third.token_id == int(logits[2].argmax())


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    sampler = Sampler(VOCAB, seed=5)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    states = [state(sampler, temperature=0.0), state(sampler, seed=1), state(sampler, temperature=0.0), state(sampler)]
    ids = sampler(logits, states).token_ids
    assert ids[0] == int(logits[0].argmax()) and ids[2] == int(logits[2].argmax())


def test_row_count_mismatch_raises() -> None:
    sampler = Sampler(VOCAB)
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, VOCAB), [state(sampler)])


def reference_keep(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Naive top-k then top-p over one row [vocab]: full sort, renormalise, exclusive cumsum < p."""
    values, order = logits.sort(descending=True)
    values = values[:k]
    probs = values.softmax(-1)
    keep_sorted = ((probs.cumsum(-1) - probs) < p) | (p >= 1.0)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[order[:k][keep_sorted]] = True
    return keep


@pytest.mark.parametrize("selection", [True, False])  # top-p alone by the kernels' selection, or by windows
@pytest.mark.parametrize("scale", [0.1, 3.0])  # flat: the top-p cut lies outside the topk window
@pytest.mark.parametrize("windows", [4, 16])  # vocab = 16 windows: 3.0 settles in the wide window, 0.1 sorts
def test_top_k_top_p_window_matches_full_sort(scale: float, windows: int, selection: bool) -> None:
    from twophase.sample.top_k_top_p import TOP_P_WINDOW, apply_top_k_top_p_

    kernels = built_kernels() if selection else None
    vocab = windows * TOP_P_WINDOW
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)) * scale
    top_k = [vocab, 10, vocab, 600, vocab, 3]
    top_p = [0.9, 0.5, 1.0, 0.95, 0.37, 1.0]
    out = logits.clone()
    apply_top_k_top_p_(out, top_k, top_p, kernels)
    for i in range(6):
        assert torch.equal(out[i] > float("-inf"), reference_keep(logits[i], top_k[i], top_p[i]))
        kept = out[i] > float("-inf")
        assert torch.equal(out[i][kept], logits[i][kept])



def test_top_p_selection_edges() -> None:
    """The kernels' top-p selection on rows a sort handles without thought: -inf entries (never kept, never
    counted), top_p 0 (the best alone), top_p 1 and rows of NaN or only -inf (left as they are), ties at the cut
    (kept together), and 32 rows of a SmolLM2-sized vocabulary against the full sort, flat to peaked, one of them
    with its mass where the sample that brackets the cut does not look."""
    kernels = built_kernels()
    inf = float("inf")
    rows = torch.tensor([[0.0, -inf, 1.0, 2.0, -inf, 1.0],  # mass above 1.0 is e^2/(e^2+2e+1) < 0.9: both 1.0 kept
                         [0.0, -inf, 1.0, 2.0, -inf, 1.0],
                         [3.0, 1.0, 2.0, 0.0, -1.0, 5.0],
                         [3.0, 1.0, 2.0, 0.0, -1.0, 5.0],
                         [float("nan"), 1.0, 2.0, 0.0, -1.0, 5.0],
                         [-inf] * 6])  # fmt: skip
    top_p = torch.tensor([0.9, 0.5, 0.0, 1.0, 0.5, 0.5], dtype=torch.float64)
    out = rows.clone()
    kernels.top_p_mask_(out, top_p)
    assert torch.equal(out[0], torch.tensor([-inf, -inf, 1.0, 2.0, -inf, 1.0]))
    assert torch.equal(out[1], torch.tensor([-inf, -inf, -inf, 2.0, -inf, -inf]))  # e^2 / total = 0.6 >= 0.5
    assert torch.equal(out[2], torch.tensor([-inf] * 5 + [5.0]))
    assert torch.equal(out[3], rows[3])
    assert torch.equal(out[4].isnan(), rows[4].isnan()) and torch.equal(out[4][1:], rows[4][1:])
    assert torch.equal(out[5], rows[5])
    logits = torch.randn(32, 49152, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.05, 8.0, 32)[:, None]
    p = torch.linspace(0.05, 0.99, 32, dtype=torch.float64)
    # row 31: the evenly spaced sample (every 48th entry) sees 10 entries at 5 over a flat floor and brackets the cut
    # among them, but 1,000 unsampled entries at 2 and the floor hold most of the mass: the bracket fails, all are searched
    logits[31] = logits[31] * 0.01
    logits[31, 0:480:48], logits[31, 1:3001:3], p[31] = 5.0, 2.0, 0.5
    out = logits.clone()
    kernels.top_p_mask_(out, p)
    for i in range(32):
        kept = out[i] > -inf
        assert torch.equal(kept, reference_keep(logits[i], 49152, float(p[i]))), i
        assert torch.equal(out[i][kept], logits[i][kept])


@pytest.mark.parametrize("n", [1, 5, 16, 17, 33, 49152, 49155])
def test_argmax_rows_is_torch_max_indices(n: int) -> None:
    """The kernels' greedy argmax equals torch.max's indices: ties (the first maximum), NaN (the first NaN, wherever
    it lies), rows of -inf, rows shorter than a vector and vector tails, strided rows; n = 0 is refused."""
    kernels = built_kernels()
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n + 3, generator=g)[:, :n]  # rows 3 apart beyond n: strided
    x[0, n // 2] = x[0].max()  # a tie with an earlier maximum
    x[1, -1] = float("nan")
    x[2, :] = float("-inf")
    x[3, n // 3] = float("nan")
    x[3, -1] = float("nan")
    x[4, -1] = x[4].max() + 1  # the maximum in the tail
    assert torch.equal(kernels.argmax_rows(x), x.max(dim=-1).indices)
    wide = torch.randn(32, n, generator=g)
    assert torch.equal(kernels.argmax_rows(wide), wide.max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="at least one column"):
        kernels.argmax_rows(torch.empty(2, 0))


# ---- logit_bias, allowed_token_ids, bad_words ------------------------------------------------------------------


def test_logit_bias_plus_100_forces_and_minus_100_bans() -> None:
    sampler = Sampler(VOCAB, seed=3)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    assert sample_many(sampler, logits, 64, temperature=1.0, logit_bias={"7": 100}) == {7}
    favourite = int(logits.argmax())
    banned = sample_many(sampler, logits, 64, temperature=1.0, logit_bias={favourite: -100})
    assert favourite not in banned and len(banned) > 1
    greedy = sampler(logits.unsqueeze(0), [state(sampler, temperature=0.0, logit_bias={favourite: -100})])
    assert greedy.token_ids[0] == int(logits.clone().index_fill_(0, torch.tensor([favourite]), -1e9).argmax())


def test_logit_bias_leaves_other_rows_and_logprobs_alone() -> None:
    sampler = Sampler(VOCAB)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    states = [state(sampler, temperature=0.0, logit_bias={5: 100}, logprobs=1), state(sampler, temperature=0.0)]
    out = sampler(logits, states)
    assert out.token_ids == [5, int(logits[1].argmax())]
    assert math.isclose(out.logprobs[0].logprob, float(logits[0].log_softmax(-1)[5]), rel_tol=1e-5)


def test_allowed_token_ids_restrict_sampling() -> None:
    sampler = Sampler(VOCAB, seed=5)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(6))
    drawn = sample_many(sampler, logits, 128, temperature=1.0, allowed_token_ids=[3, 9, 20])
    assert drawn == {3, 9, 20}
    assert sample_many(sampler, logits, 4, temperature=0.0, allowed_token_ids=[11]) == {11}


def test_bad_words_ban_single_tokens_and_last_token_after_prefix() -> None:
    sampler = Sampler(VOCAB, seed=7)
    logits = torch.zeros(VOCAB)
    logits[4], logits[6] = 10.0, 9.0  # 4 is the favourite, then 6
    params = SamplingParams(max_tokens=100, temperature=0.0, bad_words=["x", "yz"])
    params.bad_words_token_ids = [[4], [1, 6]]  # as ``resolve`` would give: "x" -> [4], "yz" -> [1, 6]
    fresh = sampler.make_state(params, [0], [], (EOS,))
    after_prefix = sampler.make_state(params, [0], [2, 1], (EOS,))  # output ends with 1: 6 would complete "yz"
    other = sampler.make_state(params, [0], [1, 2], (EOS,))
    out = sampler(logits.expand(3, -1), [fresh, after_prefix, other]).token_ids
    assert out[0] == 6 and out[1] not in (4, 6) and out[2] == 6


def test_resolve_checks_vocabulary_and_tokenizes_bad_words() -> None:
    from twophase.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={"40": 1}).resolve(VOCAB, lambda text: [1])
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(allowed_token_ids=[1, VOCAB]).resolve(VOCAB, lambda text: [1])
    assert info.value.param == "allowed_token_ids"
    for bad in ({"a": 1}, {"1": 100.5}, {"1": float("nan")}, {-1: 1}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(logit_bias=bad)
    spelled = {"hat": [5], " hat": [6], "red hat": [7, 5], " red hat": [8, 5]}
    params = SamplingParams(bad_words=["hat", "red hat"])
    params.resolve(VOCAB, spelled.__getitem__)
    assert params.bad_words_token_ids == [[5], [6], [7, 5], [8, 5]]
