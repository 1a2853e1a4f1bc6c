"""Which CPU cores a process runs on: a plan for a group of local processes, and pinning.

A stage process has one compute thread and a transport thread that wakes for every frame.
Left to the scheduler on a small host, both wander over all cores and hand the GIL back and
forth across them: measured on 2 cores, two unpinned stage processes computed ~22% slower
(forward + backward) and stepped ~25% slower than the same two pinned to a core each. A launcher
that starts several compute processes on one host therefore gives each its own cores.
"""

import os
from collections.abc import Sequence

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger

logger = get_logger(__name__)


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def spread(processes: int, threads: int, cores: Sequence[int]) -> list[tuple[int, ...]]:
    """Cores for each of ``processes`` processes of ``threads`` compute threads: consecutive
    blocks of ``threads`` cores, wrapping around when the processes need more than there are
    (then processes share a block whole, never half of one)."""
    if processes < 1 or threads < 1:
        raise ConfigError(f"need processes >= 1 and threads >= 1, got {processes}, {threads}")
    cores = sorted(set(cores))
    if not cores:
        raise ConfigError("no cores to spread processes over")
    width = min(threads, len(cores))
    blocks = len(cores) // width
    return [tuple(cores[(i % blocks) * width + k] for k in range(width)) for i in range(processes)]


def parse_cores(text: str) -> tuple[int, ...]:
    """``"0,2,3"`` -> (0, 2, 3); ConfigError for anything else."""
    try:
        cores = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError as exc:
        raise ConfigError(f"cores must be comma-separated integers, got {text!r}") from exc
    if not cores or cores[0] < 0:
        raise ConfigError(f"cores must be integers >= 0, got {text!r}")
    return cores


def pin(cores: Sequence[int]) -> bool:
    """Keep every thread of this process, and those it starts later, on ``cores``; False where
    the OS cannot (the process then runs unpinned, which is only slower)."""
    if not hasattr(os, "sched_setaffinity"):
        logger.debug("this OS cannot pin threads to cores; running unpinned")
        return False
    wanted = set(cores)
    try:
        # Linux applies affinity per thread: set it on each thread there is now (new threads
        # inherit it from the one that starts them).
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), wanted)
            except ProcessLookupError:
                continue  # the thread ended after the listing: nothing left to pin
    except (OSError, ValueError) as exc:
        logger.warning("cannot pin this process to cores %s: %s", sorted(wanted), exc)
        return False
    return True
