"""An idle swarm of real node processes goes quiet, and wakes for a crash and for a newcomer.

Four ``fusionllm node`` processes (no training, FAST timing: 1 s heartbeats; 1 s epochs) agree,
then act only every 8 (then 16) epochs and write records that promise 8x fewer refreshes
(quiet.py). Without the wake-ups a crash would be seen only after the quiet record's silence
(3 beats x 8 = 24 s, plus up to 16 epochs to the next epoch the nodes act in) and a newcomer
only at that next epoch; with them, both are planned for within a few epochs.
"""

import time

import pytest

from fusionllm.node.control.quiet import MAX_BEAT
from fusionllm.node.local_swarm import FAST, LocalSwarm, same_plan, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

NODES = 4
QUIET_SILENCE_S = 3 * FAST["heartbeat"] * MAX_BEAT  # when a quiet record counts as gone


def _quiet(nodes):
    """Every node's last epoch event says it acts in one epoch of 8 or fewer."""
    return all((n.last("epoch") or {}).get("stride", 0) >= 8 for n in nodes) or None


def _log_has(node, text: str, *, after: int = 0) -> bool:
    """Whether ``text`` is in the node's log past its first ``after`` characters."""
    return text in node.log_path.read_text()[after:]


def test_a_quiet_swarm_wakes_for_a_crash_and_a_newcomer(tmp_path) -> None:
    # 1 s epochs (FAST: 2 s): going quiet takes ~8 epochs, twice; the crash is still seen
    # only after QUIET_SILENCE_S (heartbeats, not epochs) without the wake-ups.
    swarm = LocalSwarm(
        tmp_path, extra={"max-replicas": 1, "max-stages": 2, "control-only": True, "epoch": 1.0}
    )
    try:
        first = swarm.start("n0")
        wait_for(lambda: first.last("ready"), 120, "the first node to start")
        for i in range(1, NODES):
            swarm.start(f"n{i}", bootstrap=first.dht_addr)
        nodes = list(swarm.nodes)
        wait_for(lambda: same_plan(nodes, members=NODES), 120, "4 nodes to agree")
        # Unchanged epochs double the stride: 1, 2, 4, 8 takes ~8 epochs of 2 s.
        wait_for(lambda: _quiet(nodes), 90, "the swarm to go quiet")

        victim, survivors = nodes[-1], nodes[:-1]
        killed_at = time.time()
        victim.kill()
        wait_for(
            lambda: same_plan(
                survivors, members=NODES - 1, since=killed_at, without=victim.peer_id
            ),
            60,
            "the survivors to re-plan",
        )
        replan_s = max(n.last("epoch")["t"] for n in survivors) - killed_at
        assert replan_s < QUIET_SILENCE_S, (replan_s, swarm.logs())
        assert all(_log_has(n, "is unreachable: suspected") for n in survivors), swarm.logs()

        wait_for(lambda: _quiet(survivors), 90, "the survivors to go quiet again")
        logged = {n.name: len(n.log_path.read_text()) for n in survivors}
        joined_at = time.time()
        newcomer = swarm.start("n9", bootstrap=first.dht_addr)
        everyone = [*survivors, newcomer]
        wait_for(
            lambda: same_plan(everyone, members=NODES, since=joined_at), 90, "the newcomer's plan"
        )
        # The newcomer's start-up (DHT join, probes) is most of this; what the wake saves is
        # the wait for the next epoch a quiet swarm acts in: some survivor saw it and woke.
        woke = [_log_has(n, "woke from quiet", after=logged[n.name]) for n in survivors]
        assert any(woke), swarm.logs()
    finally:
        swarm.close()
