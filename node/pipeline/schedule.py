"""The order in which a stage runs its forwards and backwards: 1F1B (PipeDream-flush).

Pure functions. A stage replicated on R peers of its fence splits the step's micro-batches
round-robin (micro-batch i goes to replica i mod R); its neighbours send each micro-batch to
the replica that owns it. A replica runs the stage's 1F1B order restricted to its own
micro-batches, not 1F1B over its share: its warm-up must follow its neighbours' (counted in
all micro-batches), or a replica would wait for a forward its upstream only sends after the
backward the replica holds back. Restricting an order removes waits and adds none, so the
replicated pipeline is deadlock-free whenever the plain one is.
"""

from fusionllm.common.errors import ConfigError

Op = tuple[str, int]  # ("F", micro-batch) or ("B", micro-batch)


def one_f_one_b(stage: int, stages: int, micro_batches: int, *, slack: int = 0) -> list[Op]:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards.

    Stage s keeps at most ``stages - s`` micro-batches in flight (``slack`` more on every
    stage but the last), so activation memory is bounded by the pipeline depth, not by the
    number of micro-batches. ``slack`` lets a stage's forwards run ahead of the gradients
    coming back, hiding each link's latency; any warm-up that never grows from one stage to
    the next is deadlock-free (stage s reaches B(k) after F(k + warm-up of s), which covers
    the forwards stage s + 1 needs before its own B(k)).
    """
    if not 0 <= stage < stages:
        raise ConfigError(f"stage must be in [0, {stages}), got {stage}")
    if micro_batches < 1:
        raise ConfigError("a schedule needs at least one micro-batch")
    ids = list(range(micro_batches))
    if slack < 0:
        raise ConfigError(f"slack must be >= 0, got {slack}")
    # The last stage has no downstream to wait for; every other stage may run ``slack`` more
    # forwards ahead, so its warm-up still shrinks stage by stage (no deadlock, see module doc).
    depth = stages - stage - 1 + (slack if stage < stages - 1 else 0)
    warmup = min(depth, len(ids))
    order: list[Op] = [("F", i) for i in ids[:warmup]]
    for k in range(len(ids) - warmup):
        order.append(("F", ids[warmup + k]))
        order.append(("B", ids[k]))
    order += [("B", i) for i in ids[len(ids) - warmup :]]
    return order


def replica_micro_batches(micro_batches: int, replicas: int, replica: int) -> list[int]:
    """The micro-batches one replica of a stage processes (round-robin)."""
    if not 0 <= replica < replicas:
        raise ConfigError(f"replica must be in [0, {replicas}), got {replica}")
    if micro_batches < replicas:
        raise ConfigError(f"{micro_batches} micro-batches cannot feed {replicas} replicas")
    return list(range(replica, micro_batches, replicas))


def replica_schedule(
    stage: int, stages: int, micro_batches: int, replicas: int, replica: int, *, slack: int = 0
) -> list[Op]:
    """One replica's order: the stage's 1F1B order, keeping its own micro-batches."""
    mine = set(replica_micro_batches(micro_batches, replicas, replica))
    return [op for op in one_f_one_b(stage, stages, micro_batches, slack=slack) if op[1] in mine]


def owner(micro_batch: int, replicas: int) -> int:
    """The replica that processes a micro-batch."""
    return micro_batch % replicas


def ideal_bubble(compute_s: list[float], micro_batches: int) -> float:
    """The share of a 1F1B step its stages spend idle when links cost nothing, given each
    stage's compute for the whole step (forwards and backwards). The first micro-batch crosses
    every stage, the others follow at the slowest stage's pace; equal stages give the
    textbook (S - 1) / (M + S - 1), unequal ones more: that excess is the cut's imbalance."""
    if micro_batches < 1 or not compute_s or min(compute_s) < 0:
        raise ConfigError("an ideal bubble needs micro-batches and stages' compute times >= 0")
    per_micro_batch = [seconds / micro_batches for seconds in compute_s]
    step = (micro_batches - 1) * max(per_micro_batch) + sum(per_micro_batch)
    return 1.0 - sum(compute_s) / (len(compute_s) * step) if step > 0 else 0.0
