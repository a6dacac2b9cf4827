"""Request timeline → metrics on hand-built timelines (exact numbers)."""

import pytest

from twophase.metrics.timeline import request_metrics
from twophase.request import RequestTimeline, ScheduledEvent


def test_metrics_from_a_hand_built_timeline():
    t = RequestTimeline(arrival_time=10.0)
    t.scheduled = [
        ScheduledEvent(10.5, 8, True, end_time=10.7),  # first prefill chunk
        ScheduledEvent(10.9, 4, True, end_time=11.0),  # second chunk → first token
        ScheduledEvent(11.0, 1, False, end_time=11.2),
        ScheduledEvent(11.5, 1, False, end_time=11.6),
    ]
    t.token_times = [11.0, 11.2, 11.6]
    t.finish_time = 11.6
    m = request_metrics(t)
    assert m.queue_time == pytest.approx(0.5)
    assert m.prefill_time == pytest.approx(0.5)
    assert m.ttft == pytest.approx(1.0)
    assert m.decode_time == pytest.approx(0.6)
    assert m.e2e == pytest.approx(1.6)
    assert m.tpot == pytest.approx(0.3)  # (1.6 - 1.0) / (3 - 1): the first token is not counted
    assert m.itl == pytest.approx([0.2, 0.4])
    # busy 0.2 + 0.1 + 0.2 + 0.1 = 0.6 of the 1.1 s between first scheduling and the last token
    assert m.runnable_waiting_time == pytest.approx(0.5)


def test_single_token_has_no_tpot():
    t = RequestTimeline(arrival_time=0.0, token_times=[0.25])
    t.scheduled = [ScheduledEvent(0.1, 5, True, end_time=0.25)]
    m = request_metrics(t)
    assert m.tpot is None and m.itl == [] and m.ttft == pytest.approx(0.25)


def test_never_scheduled():
    m = request_metrics(RequestTimeline(arrival_time=1.0, finish_time=2.0))
    assert m.queue_time is None and m.ttft is None and m.e2e == pytest.approx(1.0)


def test_tokens_of_one_step_count_once_in_itl():
    """Speculative decoding: a step that yields 3 tokens gives one inter-token gap, not two zeros; TPOT still
    spreads the decode time over every token."""
    t = RequestTimeline(arrival_time=0.0, token_times=[1.0, 1.5, 1.5, 1.5, 2.25])
    t.finish_time = 2.25
    m = request_metrics(t)
    assert m.itl == pytest.approx([0.5, 0.75])
    assert m.tpot == pytest.approx(1.25 / 4)
