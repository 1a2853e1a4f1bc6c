"""Training survives churn, with real `fusionllm node` processes (GPT-2 tiny, --dense).

One swarm of four daemons (two serve a 2-stage plan, two wait in backup) goes through a polite
leave (SIGTERM: no step lost), a crash (SIGKILL: back to the last checkpoint, no further) and
the crashed node's restart (it rejoins and is placed), and still ends where an uninterrupted
run ends. Data-parallel replicas lose nothing when one dies. A node killed while writing a
checkpoint keeps its previous one, and resumes from it when restarted.
"""

import random
import signal
import time

import numpy as np
import pytest

from fusionllm.common.run_spec import RunSpec
from fusionllm.node.local_swarm import LocalSwarm, wait_for
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.train_config import TrainConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

EVERY = 10
BASE = {
    "seq-len": 64,
    "micro-batch-size": 2,
    "micro-batches": 4,
    "lr": 3e-3,
    "threads": 1,
    "dense": True,
    "step-timeout": 60,
    "checkpoint-every": EVERY,
}


def _steps(node) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in node.snapshot() if e["event"] == "step"}


def _last_step(nodes) -> int:
    """The newest step any node reported finishing (-1: none)."""
    return max((s for n in nodes for s in _steps(n)), default=-1)


def _plans(node) -> list[dict]:
    return [e for e in node.snapshot() if e["event"] == "train_plan"]


def _serving(nodes) -> list:
    """Alive nodes whose newest plan is still running."""
    found = []
    for node in nodes:
        events = node.snapshot()
        kinds = [e["event"] for e in events if e["event"] in ("train_plan", "plan_end")]
        if node.alive() and kinds and kinds[-1] == "train_plan":
            found.append(node)
    return found


def _rollbacks(nodes, since: float) -> list[int]:
    """For every plan a node started after ``since`` (wall clock): how many finished steps
    it went back over (the newest step finished anywhere before it, minus its start)."""
    finished = [(e["t"], e["step"]) for n in nodes for e in n.snapshot() if e["event"] == "step"]
    lost = []
    for node in nodes:
        for plan in _plans(node):
            if plan["t"] > since:
                done = max((s + 1 for t, s in finished if t < plan["t"]), default=0)
                lost.append(done - plan["start_step"])
    return lost


def _reference(steps: int) -> list[float]:
    run = RunSpec(seq_len=64, micro_batch_size=2, micro_batches=4, steps=steps, lr=3e-3)
    return train_local(TrainConfig.for_run(run, cuts=(), replicas=(1,))).losses


def test_a_swarm_survives_a_leave_a_crash_and_a_restart(tmp_path):
    steps = 300  # long enough to restart the crashed node while the others still train
    swarm = LocalSwarm(
        tmp_path, extra={**BASE, "steps": steps, "min-stages": 2, "max-stages": 2,
                         "max-replicas": 1}
    )  # fmt: skip
    try:
        first = swarm.start("a")
        wait_for(lambda: first.last("ready"), 60, "the first node")
        nodes = [first, *(swarm.start(n, bootstrap=first.dht_addr) for n in "bcd")]
        wait_for(lambda: _last_step(nodes) >= 12, 240, "12 trained steps")

        # A polite leave: the leaver finishes its step and hands its stage over.
        leaver = _serving(nodes)[0]
        left_at = time.time()
        leaver.kill(signal.SIGTERM)
        assert leaver.process.returncode == 0, swarm.logs()
        assert leaver.last("plan_end")["outcome"] == "parted", leaver.last("plan_end")
        alive = [n for n in nodes if n.alive()]
        wait_for(lambda: _rollbacks(alive, left_at), 120, "a plan without the leaver")
        target = _last_step(alive) + random.randint(5, 15)
        wait_for(lambda: _last_step(alive) >= target, 120, f"step {target}")
        assert max(_rollbacks(alive, left_at)) == 0, "a polite leave cost steps"

        # A crash at a random step: back to the last checkpoint, and no further.
        victim = _serving(alive)[0]
        crashed_at = time.time()
        victim.kill(signal.SIGKILL)
        survivors = [n for n in alive if n is not victim]
        wait_for(lambda: _rollbacks(survivors, crashed_at), 120, "a takeover")
        lost = max(_rollbacks(survivors, crashed_at))
        assert 0 <= lost <= EVERY, lost

        # The crashed node comes back with its key and work dir: it rejoins and is placed.
        back = swarm.start(victim.name, bootstrap=next(n for n in survivors if n.alive()).dht_addr)
        wait_for(lambda: back.last("epoch"), 120, "the restarted node to follow a plan")
        assert back.peer_id == victim.peer_id
        assert back.last("epoch")["state"] in ("backup", "serving")

        everyone = [*survivors, back]
        wait_for(lambda: all(not n.alive() for n in everyone), 300, "every node to finish")
        merged: dict[int, float] = {}
        for node in everyone:
            assert node.process.returncode == 0, swarm.logs()
        for node in swarm.nodes:  # the leaver's and the crashed node's steps too
            merged.update(_steps(node))
        assert sorted(merged) == list(range(steps))
        reference = _reference(steps)
        final, expected = (
            np.mean([merged[s] for s in range(steps - 5, steps)]),
            np.mean(reference[-5:]),
        )
        assert abs(final - expected) <= 0.05 * expected, (final, expected)
    finally:
        swarm.close()
