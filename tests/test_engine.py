"""The engine end to end on a tiny model: streaming, seeds across batches, stop strings, logprobs, timelines."""

from __future__ import annotations

import math

import pytest

from twophase import LLM, SamplingParams
from twophase.metrics.timeline import request_metrics


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), progress=False, block_size=4, num_blocks=128)


def test_stream_deltas_equal_final_text(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = list(llm.stream("hello world", params))
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert "".join(o.new_text for o in outputs) == outputs[-1].text
    assert outputs[-1].text == llm.tokenizer.decode(outputs[-1].token_ids)
    assert sum(len(o.new_token_ids) for o in outputs) == 20


def test_seed_gives_same_tokens_alone_or_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["the quick brown fox"], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True) for _ in range(4)]
    batch = llm.generate(["a", "b c", "the quick brown fox", "zzz"], [others[0], others[1], seeded, others[2]])
    assert batch[2].token_ids == alone
    different = llm.generate(["the quick brown fox"], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))
    assert different[0].token_ids != alone


def test_stop_string_cuts_text_and_finishes(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["hello"], params)[0]
    stop = full.text[5:8]
    assert stop.strip(), full.text
    cut = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert llm.engine.scheduler.block_manager.num_blocks_in_use == 0


def test_stop_token_ids_and_max_tokens(llm):
    full = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    target = full.token_ids[3]
    stopped = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[target]))[0]
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(target) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target


def test_logprobs_of_greedy_tokens(llm):
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == token_id  # greedy: the sampled token is the best
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


def test_timeline_and_step_records(llm):
    llm.engine.step_records.clear()
    out = llm.generate(["one two three four five six"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    m = request_metrics(out.timeline)
    assert m.num_output_tokens == 6 and len(m.itl) == 5
    assert m.ttft >= m.queue_time >= 0 and m.prefill_time >= 0
    assert math.isclose(m.tpot, (m.e2e - m.ttft) / 5)
    phases = [r.phase for r in llm.engine.step_records]
    assert phases[0] == "prefill" and set(phases[1:]) == {"decode"}
    assert out.timeline.scheduled[0].is_prompt and not out.timeline.scheduled[-1].is_prompt


def test_abort_frees_blocks(llm):
    engine = llm.engine
    request = engine.add_request("abort me please", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.scheduler.block_manager.num_blocks_in_use > 0
    final = engine.abort_request(request.request_id)
    assert final.finished and final.finish_reason == "abort"
    assert engine.scheduler.block_manager.num_blocks_in_use == 0
    assert not engine.has_unfinished_requests()


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_streamed_logprob_deltas_add_up(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    outputs = list(llm.stream("hello", params))
    deltas = [lp for o in outputs for lp in o.new_logprobs]
    assert [lp.token_id for lp in deltas] == outputs[-1].token_ids
    assert deltas == outputs[-1].logprobs
