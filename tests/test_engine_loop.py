"""Issue 12's hang: with chunked prefill off, a prompt longer than the step budget runs whole (never blocks the
queue), and the async engine's loop sleeps instead of spinning when it has nothing to run."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from twophase import LLM, SamplingParams
from twophase.engine.async_engine import AsyncLLM
from tiny_models import write_tiny_llama

PROMPT_LEN, BUDGET = 800, 512


@pytest.fixture(scope="module")
def unchunked_llm(tmp_path_factory) -> LLM:
    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny-1k"), initializer_range=0.3,
                                 max_position_embeddings=1024)
    return LLM(str(model_dir), progress=False, block_size=16, num_blocks=128, max_model_len=1024,
               max_num_batched_tokens=BUDGET, enable_chunked_prefill=False)


def long_prompt(first: int = 10) -> list[int]:
    return [first + i % 200 for i in range(PROMPT_LEN)]


def test_unchunked_prompt_over_budget_completes(unchunked_llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    start = time.monotonic()
    short, long = unchunked_llm.generate([[5, 6, 7], long_prompt()], params)
    assert time.monotonic() - start < 30
    assert len(short.token_ids) == 4 and len(long.token_ids) == 4
    prompt_steps = [r for r in unchunked_llm.engine.step_records if r.num_prompt_tokens == PROMPT_LEN]
    assert prompt_steps and prompt_steps[-1].num_requests == 1  # the long prompt ran whole, in a step of its own
    assert unchunked_llm.engine.scheduler.block_manager.num_blocks_in_use == 0


def test_async_engine_serves_long_prompt_and_sleeps_when_idle(unchunked_llm):
    engine = unchunked_llm.engine
    calls = {"n": 0}
    has_unfinished = engine.has_unfinished_requests

    def counting() -> bool:
        calls["n"] += 1
        return has_unfinished()

    engine.has_unfinished_requests = counting  # instance attribute: counts loop iterations
    llm = AsyncLLM(engine)
    llm.start()
    try:
        asyncio.run(asyncio.wait_for(_generate_two(llm), timeout=30))
        time.sleep(0.1)
        before = calls["n"]
        time.sleep(0.5)
        assert calls["n"] - before == 0, "the idle loop must sleep, not poll"
        assert engine.model_runner.kv_prefaulter.done  # idle: the KV cache's pages were mapped first
        assert time.monotonic() - llm.last_loop_time < 0.1  # a parked loop is not stale for /ready
    finally:
        llm.shutdown()
        del engine.has_unfinished_requests
    assert not llm._thread.is_alive()


async def _generate_two(llm: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run(prompt, request_id):
        return [o async for o in llm.generate(prompt, params, request_id)][-1]

    outs = await asyncio.gather(run(long_prompt(20), "long"), run([1, 2, 3, 4], "short"))
    assert all(o.finished and len(o.token_ids) == 3 for o in outs)


def test_a_steps_outputs_wake_the_event_loop_once(unchunked_llm):
    """Outputs reach each stream complete and in order, and the step loop hands a step's outputs for all requests to
    the event loop in one call_soon_threadsafe (not one per request, which woke the loop ~30 times a step)."""
    engine = unchunked_llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[3 + i, 40, 50 + i, 60] for i in range(4)]
    expected = [list(o.token_ids) for o in unchunked_llm.generate(prompts, params)]
    llm = AsyncLLM(engine)
    llm.start()

    async def main() -> tuple[list[int], list[list[list[int]]]]:
        loop = asyncio.get_running_loop()
        batch_sizes: list[int] = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if threading.current_thread() is llm._thread:
                batch_sizes.append(len(args[0]))
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # instance attribute: this loop only

        async def run(i: int) -> list[list[int]]:
            # each output's own delta: token_ids is a live view that may have grown by the time a busy loop reads it
            return [list(o.new_token_ids) async for o in llm.generate(prompts[i], params, f"r{i}")]

        return batch_sizes, await asyncio.gather(*(run(i) for i in range(len(prompts))))

    first_step = len(engine.step_records)
    try:
        batch_sizes, streams = asyncio.run(asyncio.wait_for(main(), timeout=30))
    finally:
        llm.shutdown()
    steps = len(engine.step_records) - first_step
    assert [sum(stream, []) for stream in streams] == expected  # the deltas add up to the whole output, in order
    assert all(len(delta) == 1 for stream in streams for delta in stream)  # one output a step, one token each
    assert sum(batch_sizes) == sum(len(stream) for stream in streams)
    assert len(batch_sizes) <= steps and max(batch_sizes) == len(prompts)


def test_build_off_main_thread_returns_and_raises_on_the_caller() -> None:
    """The server builds its engine on a short-lived thread (so that only the step loop keeps an OpenMP team): the
    value comes back, an exception is re-raised on the caller's thread, and the helper thread is gone either way."""
    import threading

    from twophase.engine.async_engine import build_off_main_thread

    names: list[str] = []
    assert build_off_main_thread(lambda: names.append(threading.current_thread().name) or 42) == 42
    assert names == ["twophase-build"]
    with pytest.raises(ValueError, match="bad model"):
        build_off_main_thread(lambda: (_ for _ in ()).throw(ValueError("bad model")))
    assert not any(t.name == "twophase-build" for t in threading.enumerate())


def test_ctrl_c_during_the_build_waits_for_it_then_stops() -> None:
    """Ctrl-C while the engine builds (here SIGINT sent by the build itself) stops the caller only after the
    build has finished: a process that exited under a running build aborted ("terminate called ...")."""
    import os
    import signal
    import threading

    from twophase.engine.async_engine import build_off_main_thread

    steps: list[str] = []

    def build() -> int:
        time.sleep(0.1)  # the caller is waiting by now
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        steps.append("finished")
        return 1

    # Python's own SIGINT handler, whatever the test run inherited (a shell's background job starts with SIGINT
    # ignored, and Python then installs none: the signal above would be dropped)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            build_off_main_thread(build)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert steps == ["finished"]
    assert not any(t.name == "twophase-build" for t in threading.enumerate())
