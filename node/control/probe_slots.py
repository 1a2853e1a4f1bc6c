"""When we may probe a member: time slots per receiver, so two probes never share its downlink.

Each probe round's targets are chosen at random and a plan change wakes every node's round at
once, so probes into the same member overlap: on topology C (issue 25, session 15) h1 and
h2 both probed h5 (5 MB/s downlink) in the same second; h2's samples fell from 4.8 to 1.6 MB/s
as h1's came in, 139 and 426 segments were lost, and the link read 0.65-0.73 of its cap.

Wall-clock time is cut into slots of ``slot_s``; slot ``k`` into member ``dst`` belongs to
the ``(k + offset(dst)) mod n``-th of the other ``n`` members (sorted by peer id; the offset, a
hash of ``dst``, keeps one sender from owning the same slot into everyone). A sender waits for
its slot into a target; members' clocks agree to well under a slot (the DHT's records already
assume MAX_CLOCK_SKEW_S), and where they do not, probes collide as they did before. Pure: the
caller passes the clock.
"""

import hashlib
import math
from collections.abc import Collection

# A 1 MiB probe's slot: its kernel-timed run and slow start on an 80 ms, 5 MB/s link took
# 0.6-2.2 s (topology C); smaller probes get a proportionally shorter one.
SLOT_S_PER_MIB = 2.5
MIN_SLOT_S = 0.25


def slot_seconds(probe_bytes: int) -> float:
    """The slot for probes of ``probe_bytes``."""
    if probe_bytes < 1:
        raise ValueError(f"probe_bytes must be >= 1, got {probe_bytes}")
    return max(MIN_SLOT_S, SLOT_S_PER_MIB * probe_bytes / (1 << 20))


def _offset(dst: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(dst.encode()).digest()[:8], "big") % n


def next_slot(
    now: float, src: str, dst: str, members: Collection[str], slot_s: float
) -> tuple[float, float]:
    """The wall-clock (start, end) of ``src``'s next slot into ``dst`` among ``members``: the
    current one if we are in its first half, else the next that is ours."""
    if not (math.isfinite(now) and slot_s > 0):
        raise ValueError(f"now and slot_s must be finite and > 0, got {now}, {slot_s}")
    others = sorted(m for m in set(members) if m != dst)
    if src not in others:
        raise ValueError(f"{src!r} is not among the members, or is {dst!r} itself")
    n, rank = len(others), others.index(src)
    current = math.floor(now / slot_s)
    # The first slot k >= current whose owner is us: (k + offset) % n == rank.
    k = current + (rank - current - _offset(dst, n)) % n
    if k == current and now - k * slot_s > slot_s / 2:
        k += n  # too little of it left for a probe
    return k * slot_s, (k + 1) * slot_s
