"""When we may probe a member: time slots in which every member is in one probe at most.

Each probe round's targets are chosen at random and a change wakes every node's round at
once, so probes overlapped on topology C (issue 25, session 15): h1 and h2 both probed h5
(5 MB/s downlink) in the same second, h2's samples fell from 4.8 to 1.6 MB/s as h1's came
in, 139 and 426 segments were lost, and the link read 0.65-0.73 of its cap. A probe is also
slowed where its receiver is itself probing someone: our ACKs wait in its uplink's queue
behind its filler (h2 -> h5 read 0.95 of 5 MB/s while h5 sent its own probe).

So wall-clock time is cut into slots of ``slot_s``, and each slot pairs the members off (a
round-robin tournament by the circle method over the members sorted by peer id, one sitting
out where they are odd): a member probes, or is probed by, one partner at most in a slot, and
every ordered pair gets one slot in each cycle of ``2 (m - 1)`` (m the members, rounded up to
even). Members' clocks agree to well under a slot (the DHT's records already assume
MAX_CLOCK_SKEW_S); where they or the members' views do not, probes collide as they did
before. Pure: the caller passes the clock.
"""

import math
from collections.abc import Collection

# A 1 MiB probe's slot: its kernel-timed run and slow start on an 80 ms, 5 MB/s link took
# 0.3-1.5 s (topology C, session 15); smaller probes get a proportionally shorter one.
SLOT_S_PER_MIB = 2.0
MIN_SLOT_S = 0.25


def slot_seconds(probe_bytes: int) -> float:
    """The slot for probes of ``probe_bytes``."""
    if probe_bytes < 1:
        raise ValueError(f"probe_bytes must be >= 1, got {probe_bytes}")
    return max(MIN_SLOT_S, SLOT_S_PER_MIB * probe_bytes / (1 << 20))


def cycle_seconds(members: int, slot_s: float) -> float:
    """How long a cycle of slots lasts among ``members``: each ordered pair's slot comes once
    in it (0 without slots, or with one member)."""
    if members < 0 or slot_s < 0:
        raise ValueError(f"members and slot_s must be >= 0, got {members}, {slot_s}")
    even = members + members % 2
    return 2 * max(0, even - 1) * slot_s if members > 1 else 0.0


def _pair_slot(order: list[str | None], src: str, dst: str) -> int:
    """The slot of a cycle in which ``src`` probes ``dst``: the circle method's round that
    pairs them, in the first half of the cycle where ``src`` comes first in that round's
    pairing, else in the second."""
    m = len(order)
    rotating = order[1:]
    for r in range(m - 1):
        ring = [order[0], *rotating[r:], *rotating[:r]]
        for i in range(m // 2):
            a, b = ring[i], ring[m - 1 - i]
            if {a, b} == {src, dst}:
                return r if a == src else r + m - 1
    raise AssertionError("the circle method pairs every two members once")


def next_slot(
    now: float, src: str, dst: str, members: Collection[str], slot_s: float
) -> tuple[float, float]:
    """The wall-clock (start, end) of ``src``'s next slot to probe ``dst`` among ``members``:
    the current one if we are in its first half, else the next that is ours."""
    if not (math.isfinite(now) and slot_s > 0):
        raise ValueError(f"now and slot_s must be finite and > 0, got {now}, {slot_s}")
    order: list[str | None] = sorted(set(members))
    if src == dst or src not in order or dst not in order:
        raise ValueError(f"{src!r} and {dst!r} must be two of the members")
    if len(order) % 2:
        order.append(None)  # who meets None sits the round out
    cycle = round(cycle_seconds(len(order), 1.0))
    ours = _pair_slot(order, src, dst)
    current = math.floor(now / slot_s)
    k = current + (ours - current) % cycle
    if k == current and now - k * slot_s > slot_s / 2:
        k += cycle  # too little of it left for a probe
    return k * slot_s, (k + 1) * slot_s
