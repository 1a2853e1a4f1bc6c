"""One member cannot stop a training swarm (issue 27), with real ``fusionllm node`` processes.

Two nodes train GPT-2 tiny (``--min-stages 2 --steps 0``); then, one case per test:

- an observer (``--no-train``) advertising an RTX 4090 joins: its record says it observes, so
  no plan ever names it and the steps never pause;
- a member that claims to train and never comes to the READY barrier (the hidden
  ``--control-only`` flag: what ``--no-train`` did before observers said so) joins: the two
  trainers suspect it, re-plan without it and go on within 60 s, and keep it out for a backoff.

Every test ends its processes; steps are read from the nodes' ``step`` events.
"""

import itertools
import time

import pytest

from fusionllm.node.local_swarm import TEST_DEVICE, LocalSwarm, NodeProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

RUN = {
    "steps": 0,
    "seq-len": 64,
    "micro-batch-size": 2,
    "micro-batches": 4,
    "lr": 3e-3,
    "min-stages": 2,
    "max-stages": 2,
    "max-replicas": 1,
    "threads": 1,
    "dense": True,
    "step-timeout": 60,
    "quiet-stride": 1,
}
# What the newcomer claimed: far faster than the test CPU, so every plan wants it.
RTX_4090 = {
    **TEST_DEVICE,
    "name": "NVIDIA GeForce RTX 4090",
    "kind": "cuda",
    "flops": 8.2e13,
    "memory_bandwidth": 1.0e12,
    "memory_bytes": 24 << 30,
}
# The trainers advertise a device 100x slower than the test CPU: compute then dominates the
# plan's step time, and a fast newcomer is worth a re-plan (as it is on a real swarm).
SLOW_DEVICE = {**TEST_DEVICE, "flops": TEST_DEVICE["flops"] / 100}
RESUME_S = 60.0


def _step_times(nodes: list[NodeProcess]) -> list[float]:
    return sorted(e["t"] for n in nodes for e in n.snapshot() if e["event"] == "step")


def _planned(node: NodeProcess, peer: str, since: float) -> list[dict]:
    """``node``'s epoch events after ``since`` whose plan seats ``peer``."""
    return [
        e
        for e in node.snapshot()
        if e["event"] == "epoch" and e["t"] >= since and any(peer in s for s in e["stages"])
    ]


def _longest_pause(times: list[float], since: float, until: float) -> float:
    """The longest stretch in [since, until] without a finished step."""
    marks = [since, *(t for t in times if since < t < until), until]
    return max(b - a for a, b in itertools.pairwise(marks))


def _trainers(tmp_path) -> tuple[LocalSwarm, list[NodeProcess]]:
    swarm = LocalSwarm(tmp_path, extra=RUN, device=SLOW_DEVICE)
    first = swarm.start("a")
    wait_for(lambda: first.last("ready"), 60, "the first node")
    nodes = [first, swarm.start("b", bootstrap=first.dht_addr)]
    wait_for(lambda: len(_step_times(nodes)) >= 10, 240, "10 trained steps")
    return swarm, nodes


def test_an_observer_with_a_fast_device_is_never_planned(tmp_path):
    swarm, nodes = None, []
    try:
        swarm, nodes = _trainers(tmp_path)
        joined = time.time()
        observer = swarm.start(
            "watcher", bootstrap=nodes[0].dht_addr, device=RTX_4090, extra={"no-train": True}
        )
        wait_for(lambda: observer.last("epoch"), 60, "the observer to follow the plan")
        seen = lambda: all(  # noqa: E731
            observer.peer_id in (n.last("epoch") or {}).get("members", []) for n in nodes
        )
        wait_for(seen, 60, "the trainers to count the observer a member")
        time.sleep(30.0)  # many epochs with its links measured: a plan would have seated it
        now = time.time()
        for node in [*nodes, observer]:
            assert not _planned(node, observer.peer_id, joined), swarm.logs()
        pause = _longest_pause(_step_times(nodes), joined, now)
        print(f"longest pause in steps after the observer joined: {pause:.1f} s")
        assert pause < RESUME_S, swarm.logs()
    finally:
        if swarm is not None:
            swarm.close()
