"""compare.py's wait for quiet CPUs before S1's rounds (benchmarks/peers/common.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from peers.common import busy_share, cpu_times, wait_until_quiet  # noqa: E402


def test_busy_share_is_the_busy_part_of_the_time_between_readings():
    assert busy_share((100, 1000), (130, 1100)) == 0.3
    assert busy_share((100, 1000), (100, 1000)) == 0.0  # no time passed


def test_cpu_times_reads_busy_within_total():
    times = cpu_times()
    if times is None:  # no /proc/stat (not Linux): wait_until_quiet returns at once
        assert wait_until_quiet(max_wait_s=5.0) < 1.0
        return
    busy, total = times
    assert 0 <= busy <= total and total > 0


def test_wait_until_quiet_stops_at_its_limit_on_a_busy_machine():
    # every window counts as busy (the share is never under 0): the wait ends at max_wait_s
    waited = wait_until_quiet(max_wait_s=0.3, busy_below=0.0, window_s=0.1)
    assert 0.3 <= waited < 1.5


def test_wait_until_quiet_returns_after_one_window_when_anything_counts_as_quiet():
    waited = wait_until_quiet(max_wait_s=10.0, busy_below=1.01, window_s=0.1)
    assert waited < 1.0
