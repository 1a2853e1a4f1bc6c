"""When a node's next heartbeat is due: a period after the last one began, not after it ended.

Readers count a member as gone once its newest record is ``suspect_after_s`` old (3 beats,
swarm_settings.py). Had the heartbeat thread waited a whole ``heartbeat_s`` *after* each
store, records would be dated ``heartbeat_s + store time`` apart, and a reader would see the
newest one as old as ``heartbeat_s + 2 x store time``: on topology C a 0.4-core host's store
took 2.27 s under training (2 s beats), its record read 6.5 s old, past the 6 s bound, and
four nodes dropped a member that was training (the balanced run's stall at step 4, session
6). Counting the period from the wake keeps records ``max(heartbeat_s, store time)`` apart.
"""


def next_wake(last_wake: float, now: float, heartbeat_s: float) -> float:
    """When (``now``'s clock) the heartbeat thread wakes next: ``heartbeat_s`` after it last
    woke (``last_wake``), or at once when the work done since has used the whole period (a
    store slower than a period skips the ticks it overran rather than firing them in a burst)."""
    if heartbeat_s <= 0:
        raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
    return max(last_wake + heartbeat_s, now)
