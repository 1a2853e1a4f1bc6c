"""Shared pytest setup: no test may leave a process behind."""

import contextlib
import os

import psutil
import pytest
import torch
from hypothesis import settings

from fusionllm.common.logs import get_logger

logger = get_logger("tests.conftest")

_GRACE_S = 3.0

# The same examples every run, so a property test that passed in CI passes again; a change
# of code changes the examples, which is where new cases get explored.
settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.load_profile("deterministic")


def kill_process_tree(root: psutil.Process, *, include_root: bool = False) -> list[int]:
    """Terminate, then kill, every descendant of ``root``; returns the pids found."""
    try:
        victims = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    if include_root:
        victims.append(root)
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _gone, alive = psutil.wait_procs(victims, timeout=_GRACE_S)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=_GRACE_S)
    return [proc.pid for proc in victims]


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many tiny ops, or that run a reference next to stage processes: a second
    intra-op thread only adds barrier waits, and on a busy host made a 4 s run take minutes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _no_leftover_processes():
    """Kill whatever child processes the test session started and did not reap."""
    yield
    leftovers = kill_process_tree(psutil.Process(os.getpid()))
    if leftovers:
        logger.warning("killed %d leftover child processes: %s", len(leftovers), leftovers)
