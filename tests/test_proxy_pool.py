"""The proxy's choice of upstream servers (no processes): least loaded healthy server per role, clear refusals."""

from __future__ import annotations

import pytest

from twophase.server.proxy import BackendPool


def test_pick_fewest_in_flight_among_healthy():
    pool = BackendPool(["http://p1", "http://p2/"], ["http://d1"], [])
    p1, p2, d1 = pool.backends
    assert pool.disaggregated and p2.url == "http://p2"
    p1.num_in_flight = 3
    assert pool.pick("prefill") is p2
    p2.num_in_flight = 5
    assert pool.pick("prefill") is p1
    p1.healthy = False
    assert pool.pick("prefill") is p2
    p2.healthy = False
    assert pool.pick("prefill") is None and pool.pick("decode") is d1


def test_replica_mode_and_bad_combinations():
    pool = BackendPool([], [], ["http://r1", "http://r2"])
    assert not pool.disaggregated and pool.pick("replica").url == "http://r1"
    with pytest.raises(ValueError, match="either --replica"):
        BackendPool(["http://p"], ["http://d"], ["http://r"])
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        BackendPool(["http://p"], [], [])
