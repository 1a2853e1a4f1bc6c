"""Strangers attack a training swarm's daemon, as real processes: the swarm trains on.

Two `fusionllm node` daemons train GPT-2 tiny in two stages. The attacker
(``tests.integration.stranger``, fresh identities, no member key) goes for one daemon's data
plane: 64 identities each announcing a maximal body and trickling it, 1,000 raw connection
attempts. The node's own admission (the plan's peers and the swarm's members only) must turn
every stranger away at stream open; the daemon must stay within base + 512 MiB of RSS (with
its DHT worker), never die, keep training, and leave cleanly afterwards.
(test_hostile_peers.py attacks a bare transport process with a lying member's key too, and
bounds the honest neighbour's latency.)
"""

import re
import signal
import sys
import time
from pathlib import Path

import pytest

from fusionllm.node.children import JsonChild
from fusionllm.node.local_swarm import LocalSwarm, trained_steps, wait_for
from tests.integration.test_hostile_peers import RSS_MARGIN, RssWatch, _rss

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
ATTACK_S = 20.0
RUN = {
    "steps": 100_000,  # the test ends the run itself (SIGTERM), after the attack
    "seq-len": 32,
    "micro-batch-size": 2,
    "micro-batches": 4,
    "min-stages": 2,
    "max-stages": 2,
    "threads": 1,
    "dense": True,
    "step-timeout": 60,
}
_REFUSED = re.compile(r"refused stream_not_admitted from \S+ \((\d+) so far\)")


def _steps_between(node, start: float, end: float) -> int:
    return sum(1 for e in node.snapshot() if e["event"] == "step" and start <= e["t"] < end)


def _refused_so_far(log: Path) -> int:
    return max((int(m) for m in _REFUSED.findall(log.read_text())), default=0)


def test_a_training_daemon_turns_strangers_away_and_trains_on(tmp_path):
    swarm = LocalSwarm(tmp_path, extra=RUN)
    stranger = None
    try:
        target = swarm.start("a")
        wait_for(lambda: target.last("ready"), 60, "the first node to be ready")
        other = swarm.start("b", bootstrap=target.dht_addr)
        nodes = [target, other]
        wait_for(lambda: all(len(trained_steps(n)) >= 20 for n in nodes), 240, "20 steps each")
        stranger = JsonChild(
            [sys.executable, "-m", "tests.integration.stranger",
             "--target", target.last("ready")["addrs"][0],
             "--strangers", "64", "--floods", "1000", "--duration", str(ATTACK_S)],
            stdin=True, cwd=ROOT, stderr=tmp_path / "stranger.log",
        )  # fmt: skip
        assert stranger.wait_for(lambda e: e.get("event") == "ready", 60)
        quiet_from = time.time()
        time.sleep(5.0)
        quiet_steps = _steps_between(target, quiet_from, time.time())
        base = _rss(target.process.pid)
        with RssWatch(target.process.pid) as rss:
            attack_from = time.time()
            stranger.send({"go": True})
            done = stranger.wait_for(lambda e: e.get("event") == "done", ATTACK_S + 30)
            attack_to = time.time()
        attacked_steps = _steps_between(target, attack_from, attack_to)
        last_quarter = _steps_between(target, attack_to - (attack_to - attack_from) / 4, attack_to)
        assert target.alive()
        assert other.alive()
        for node in nodes:
            node.kill(signal.SIGTERM)
    except BaseException:
        print(swarm.logs())
        raise
    finally:
        if stranger is not None:
            stranger.kill()
        swarm.close()

    refused = _refused_so_far(target.log_path)
    print(
        f"\nsteps/s quiet {quiet_steps / 5.0:.1f}, under attack "
        f"{attacked_steps / (attack_to - attack_from):.1f}; RSS base {base / 2**20:.0f} MiB, "
        f"peak {rss.peak / 2**20:.0f} MiB; streams refused {refused}; attacker {done['counts']}"
    )
    assert done["counts"].get("connected", 0) == 64  # every stranger reached the node
    assert refused >= 64, "strangers were not turned away at stream open"
    assert rss.peak <= base + RSS_MARGIN
    assert quiet_steps > 0
    assert last_quarter > 0, "training stalled under the attack"
    for node in nodes:
        assert node.process.returncode == 0, node.log_path.read_text()[-3000:]
