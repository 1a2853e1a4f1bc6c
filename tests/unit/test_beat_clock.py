"""The heartbeat's period counts from its wake, so a slow store cannot age a record past the
readers' bound (beat_clock.py; topology C's balanced stall)."""

import pytest

from fusionllm.node.control.beat_clock import next_wake
from fusionllm.node.control.swarm_settings import SwarmSettings


def oldest_visible_age(store_s: float, heartbeat_s: float, beats: int = 20) -> float:
    """The oldest a reader finds our newest record, for stores of ``store_s`` each: the
    loop's cadence played on a simulated clock (a record is dated at its store's start and
    shows once the store ends)."""
    now = woke = 0.0
    dated: list[float] = []
    shown: list[float] = []
    for _ in range(beats):
        now = next_wake(woke, now, heartbeat_s)
        woke = now
        dated.append(now)
        now += store_s
        shown.append(now)
    # Just before record i+1 shows, the newest one a reader has is record i.
    return max(shown[i + 1] - dated[i] for i in range(beats - 1))


def test_a_slow_store_keeps_the_record_fresh_for_readers():
    settings = SwarmSettings(heartbeat_s=2.0, ttl_s=10.0)  # the testbed's timing
    # 2.27 s: a 0.4-core host's store under training (session 6, topology C, h3's log).
    for store_s in (0.05, 1.0, 2.0, 2.27, 2.9):
        age = oldest_visible_age(store_s, settings.heartbeat_s)
        assert age < settings.suspect_after_s, (store_s, age)
    # Waiting a whole period after each store let the 2.27 s case read 6.54 s old.
    assert oldest_visible_age(2.27, 2.0) == pytest.approx(4.54)


def test_next_wake_is_a_period_after_the_wake_or_now():
    assert next_wake(10.0, 10.5, 2.0) == 12.0  # a quick store: the rest of the period
    assert next_wake(10.0, 12.3, 2.0) == 12.3  # a store longer than the period: at once
    assert next_wake(10.0, 17.0, 2.0) == 17.0  # overran ticks are not fired in a burst
    with pytest.raises(ValueError, match="heartbeat_s must be > 0"):
        next_wake(0.0, 1.0, 0.0)
