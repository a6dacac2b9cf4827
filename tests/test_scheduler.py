"""Scheduler driven by hand-made runner outputs: budget, chunk boundaries, preemption, abort, admission."""

import pytest

from twophase.config import SchedulerConfig
from twophase.engine.scheduler import QueueFullError, Scheduler
from twophase.kv_cache.block_manager import BlockManager
from twophase.outputs import ModelRunnerOutput
from twophase.request import Request, RequestStatus
from twophase.sampling_params import InvalidRequestError, SamplingParams


def make_scheduler(num_blocks=16, block_size=4, budget=8, max_seqs=4, max_len=64, prefix=True, **kw) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len, **kw)
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix))


def make_request(rid: str, num_prompt: int, max_tokens: int = 4, first: int = 0, **kw) -> Request:
    return Request(rid, list(range(first, first + num_prompt)), SamplingParams(max_tokens=max_tokens, **kw))


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {s.request_id: token for s in out.scheduled if s.sample}
    updates = sched.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
    sched.check_invariants()
    return out, updates


def test_chunked_prefill_respects_budget_and_chunk_boundaries():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 20))
    chunks = []
    for _ in range(3):
        out, _ = run_step(sched)
        s = out.scheduled[0]
        chunks.append((s.start_position, len(s.token_ids), s.sample, s.is_prompt))
        assert out.num_tokens <= 8
    assert chunks == [(0, 8, False, True), (8, 8, False, True), (16, 4, True, True)]
    assert sched.requests["a"].output_token_ids == [7]
    out, _ = run_step(sched)
    assert [(s.start_position, s.token_ids, s.is_prompt) for s in out.scheduled] == [(20, [7], False)]
    assert out.phase == "decode"


def test_decode_first_then_prefill_share_a_step():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 4))
    run_step(sched)  # a prefilled, has 1 output
    sched.add_request(make_request("b", 12, first=100))
    out, _ = run_step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.phase == "mixed"
    assert out.num_decode_tokens == 1 and out.num_prompt_tokens == 7


def test_unchunked_waits_for_budget():
    sched = make_scheduler(budget=8, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 8, first=50))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]  # b (8 tokens) does not fit the 4 left
    out, _ = run_step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1)]  # b needs 8 > 7 left
    # with unchunked prefill b waits until a finishes
    while "a" in sched.requests:
        run_step(sched)
    out, _ = run_step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("b", 8)]


def test_unchunked_prompt_over_budget_runs_whole_in_a_step_of_its_own():
    sched = make_scheduler(budget=8, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("long", 20, first=50))  # 20 > budget 8, < max_model_len 64
    sched.add_request(make_request("c", 2, first=90))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]  # long waits: not first in the step
    while "a" in sched.requests:
        run_step(sched)
    out, _ = run_step(sched)
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled] == [("long", 20, True)]
    out, _ = run_step(sched)  # the budget is spent by long's decode + c's whole prompt
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("long", 1), ("c", 2)]
    while sched.has_unfinished:
        run_step(sched)
    sched.check_invariants()


def test_max_num_seqs_limits_running():
    sched = make_scheduler(budget=64, max_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, first=10 * i))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 1


def test_preemption_frees_blocks_and_keeps_front_of_queue():
    # 4 blocks of 4 tokens; two requests of 7 tokens need 2 blocks each, and grow past 8 → 3 blocks
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, prefix=False)
    sched.add_request(make_request("a", 7, max_tokens=6))
    sched.add_request(make_request("b", 7, max_tokens=6, first=50))
    sched.add_request(make_request("c", 3, max_tokens=1, first=90))
    out, _ = run_step(sched)  # a, b prefilled: 2 blocks each; c cannot fit
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert sched.block_manager.block_ids("a") == [0, 1] and sched.block_manager.block_ids("b") == [2, 3]
    out, _ = run_step(sched)  # both decode to position 8: still 2 blocks
    out, _ = run_step(sched)  # a needs a 3rd block → b (most recently admitted) is preempted
    assert out.preempted_request_ids == ["b"]
    assert [s.request_id for s in out.scheduled] == ["a"]
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting)[:2] == [b, sched.requests["c"]]  # b ahead of c
    assert sched.block_manager.block_ids("b") == []
    assert b.timeline.num_preemptions == 1 and sched.num_preemptions == 1
    # run to completion: b resumes by recomputing prompt + its generated tokens, then everything finishes
    for _ in range(40):
        if not sched.has_unfinished:
            break
        run_step(sched)
    assert not sched.has_unfinished
    assert sched.block_manager.num_blocks_in_use == 0
    assert len(b.output_token_ids) == 6


def test_abort_frees_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("w", 6, first=40))
    run_step(sched)
    assert sched.block_manager.num_blocks_in_use > 0
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("w", RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert sched.block_manager.num_blocks_in_use == 0
    assert not sched.has_unfinished
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is None  # idempotent


def test_infeasible_requests_rejected_at_admission():
    sched = make_scheduler(num_blocks=4, block_size=4, max_len=64)
    with pytest.raises(InvalidRequestError, match="context length"):
        sched.add_request(make_request("long", 60, max_tokens=10))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        sched.add_request(make_request("big", 16, max_tokens=8))  # 24 tokens = 6 blocks > 4
    with pytest.raises(InvalidRequestError, match="empty"):
        sched.add_request(Request("e", [], SamplingParams()))
    assert not sched.requests and not sched.waiting


def test_waiting_queue_limit():
    sched = make_scheduler(max_waiting_requests=2)
    sched.add_request(make_request("a", 4))
    sched.check_admission(make_request("b", 4))  # room for one more
    with pytest.raises(QueueFullError):
        sched.check_admission(make_request("b", 4), num_ahead=1)  # one accepted, not yet queued
    sched.add_request(make_request("b", 4))
    with pytest.raises(QueueFullError):
        sched.check_admission(make_request("c", 4))
    assert list(sched.requests) == ["a", "b"]
    run_step(sched)  # both admitted to running: the queue has room again
    sched.check_admission(make_request("c", 4), num_ahead=1)


def test_stop_conditions():
    sched = make_scheduler()
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=5, min_tokens=2), eos_token_ids=(7,))
    sched.add_request(req)
    run_step(sched, token=7)  # eos before min_tokens: ignored
    assert not req.finished
    run_step(sched, token=7)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [7, 7]
    req2 = Request("b", [1, 2, 3], SamplingParams(max_tokens=3), eos_token_ids=(7,))
    sched.add_request(req2)
    for _ in range(3):
        run_step(sched, token=5)
    assert req2.status == RequestStatus.FINISHED_LENGTH
    req3 = Request("c", [1, 2], SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=[5]), eos_token_ids=(7,))
    sched.add_request(req3)
    run_step(sched, token=7)
    assert not req3.finished
    run_step(sched, token=5)
    assert req3.status == RequestStatus.FINISHED_STOPPED


def test_prefix_cache_hit_counts_cached_tokens():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("a", 10, max_tokens=1))
    run_step(sched)
    sched.add_request(make_request("b", 10, max_tokens=1))
    out, _ = run_step(sched)
    assert out.scheduled[0].start_position == 8 and len(out.scheduled[0].token_ids) == 2
    assert sched.block_manager.stats.num_queries == 20 and sched.block_manager.stats.num_hits == 8


def test_token_ids_between_spans_prompt_and_output():
    req = make_request("a", 5)
    req.output_token_ids.extend([50, 51, 52])
    full = req.all_token_ids
    for start in range(len(full)):
        for end in range(start, len(full) + 1):
            assert req.token_ids_between(start, end) == full[start:end]
