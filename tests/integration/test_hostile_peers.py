"""A node's data plane under attack by strangers and lying members, as real processes.

The node is ``tests.support.transport_main`` (a Transport as a process) that expects float32
(1024,) frames and admits two peers: the honest neighbour (this test's own Transport) and one
"member" whose key the attacker holds. The attacker is ``tests.integration.stranger``: py-libp2p
hosts with fresh identities (frames declaring 2**28 elements in a few bytes, 64 identities each
announcing a maximal body and trickling, up to 1,000 connection attempts, at least
FLOOD_FLOOR of them through, garbage, truncation and stalls). Meanwhile the neighbour's frames
must keep flowing, the node must stay within base + 512 MiB of RSS and never die.
"""

import contextlib
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from fusionllm.compression import pack_tensor
from fusionllm.node.children import JsonChild
from fusionllm.node.p2p.framing import FrameHeader
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of
from fusionllm.node.p2p.inbound import BODY_TOO_LONG, NOT_ADMITTED
from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.integration.test_transport import NodeProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
ATTACK_S = 30.0
QUIET_S = 5.0
RSS_MARGIN = 512 << 20
HEADER = FrameHeader(step=0, micro_batch=0, kind="activation", stage=0)
# Median round trip under attack over the quiet one (the bound). Measured on the 2-core
# dev box with other agents' work beside it, the attacker's 65 hosts on the same cores: 0.8x to
# 1.9x over 8 runs (medians 6-11 ms quiet); the tail (p90) grows far more, 18 ms to 0.5 s.
LATENCY_FACTOR = 2.0
# Connection attempts (of 1,000) that must be through (or refused) within the attack. A third of
# them hold their connection 2 s, 64 at a time, so an idle box makes all 1,000 in ~11 s; under
# the load of a full suite beside other agents' work 445-624 got through in 30 s.
FLOOD_FLOOR = 300
ONLY_THE_NEIGHBOUR = {"counters": 1, "outbound": 1, "in_flight": 0, "inbound": 1}


def _rss(pid: int) -> int:
    """Resident memory of a process and all its descendants."""
    proc = psutil.Process(pid)
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


class RssWatch:
    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, _rss(self.pid))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(2)


def _round_trips(client: Transport, node: str, seconds: float) -> list[float]:
    """Send a frame the node expects, wait for its ack; the round trips' seconds."""
    body = pack_tensor(torch.randn(1024))
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        client.send(node, HEADER, body, timeout=10.0)
        client.recv(timeout=10.0)
        times.append(time.monotonic() - started)
        time.sleep(0.02)  # a pipeline's pace, not a flood of our own
    return times


def _stats_once_the_attackers_are_gone(node: NodeProcess) -> dict:
    """The node's stats once only the honest neighbour has per-peer state left (the attacker
    exited: every other peer's counters, slots and streams must have been pruned)."""
    deadline = time.monotonic() + 10.0
    while True:
        stats = node.command(cmd="stats")
        if stats["tracked"] == ONLY_THE_NEIGHBOUR or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_a_node_holds_against_strangers_and_lying_members(tmp_path):
    member_key = tmp_path / "member.key"
    member = peer_id_of(load_or_create_identity(member_key))
    client_config = TransportConfig(key_path=tmp_path / "honest.key", dial_timeout_s=5.0)
    honest = peer_id_of(load_or_create_identity(client_config.key_path))
    node = NodeProcess(
        tmp_path / "node.key",
        "--mode", "ack",
        "--expect-dtype", "float32", "--expect-shape", "1024",
        "--admit", honest, "--admit", member,
    )  # fmt: skip
    stranger = None
    try:
        with Transport(client_config) as client:
            client.connect(node.addr)
            _round_trips(client, node.peer_id, 1.0)  # warm: streams open, code paths hot
            stranger = JsonChild(
                [sys.executable, "-m", "tests.integration.stranger", "--target", node.addr,
                 "--member-key", str(member_key), "--strangers", "64", "--floods", "1000",
                 "--duration", str(ATTACK_S)],
                stdin=True, cwd=ROOT, stderr=tmp_path / "stranger.log",
            )  # fmt: skip
            assert stranger.wait_for(lambda e: e.get("event") == "ready", 60)
            quiet = _round_trips(client, node.peer_id, QUIET_S)  # the attacker idles, alive
            base = _rss(node.proc.pid)
            cpu_before = sum(psutil.Process(node.proc.pid).cpu_times()[:2])
            with RssWatch(node.proc.pid) as rss:
                stranger.send({"go": True})
                attacked = _round_trips(client, node.peer_id, ATTACK_S)
                done = stranger.wait_for(lambda e: e.get("event") == "done", 30)
            node_cpu_s = sum(psutil.Process(node.proc.pid).cpu_times()[:2]) - cpu_before
            after = _round_trips(client, node.peer_id, 1.0)
            stats = _stats_once_the_attackers_are_gone(node)
    finally:
        if stranger is not None:
            stranger.kill()
        node.stop()

    quiet_ms = statistics.median(quiet) * 1e3
    attacked_ms = statistics.median(attacked) * 1e3
    refusals = stats["refusals"]
    print(
        f"\nRSS base {base / 2**20:.0f} MiB, peak {rss.peak / 2**20:.0f} MiB during the attack; "
        f"honest round trip median {quiet_ms:.1f} ms quiet, {attacked_ms:.1f} ms attacked "
        f"({len(quiet)} / {len(attacked)} frames, p90 attacked "
        f"{statistics.quantiles(attacked, n=10)[-1] * 1e3:.1f} ms); refusals {refusals}; "
        f"attacker {done['counts']}; tracked {stats['tracked']}; node CPU during the attack "
        f"{node_cpu_s:.1f} s over {ATTACK_S:.0f} s"
    )
    counts = done["counts"]
    assert counts.get("connected", 0) == 1 + 64  # the attack happened: every identity got in
    knocked = counts.get("knocks", 0) + counts.get("knocks_refused", 0)
    assert knocked + counts.get("knocks_cut", 0) == counts["knocks_begun"] <= 1000
    assert knocked >= FLOOD_FLOOR  # the flood happened, beside everything else
    assert node.proc.returncode == 0  # it never died, and quit cleanly
    assert rss.peak <= base + RSS_MARGIN
    assert after  # still serving once the attack is over
    assert attacked_ms <= LATENCY_FACTOR * quiet_ms
    # Every stranger was turned away at stream open, many times over, and counted.
    assert refusals.get(NOT_ADMITTED, 0) >= 64
    assert refusals.get(BODY_TOO_LONG, 0) >= 1  # the member's maximal announcements
    member_errors = stats["peers"][member]["errors"]
    assert member_errors.get("FrameError", 0) >= 3  # expanding, garbage, truncated frames
    assert member_errors.get("DeadlineError", 0) >= 1  # stalls and trickles, cut
    assert stats["peers"][honest]["errors"] == {}
    assert set(stats["peers"]) <= {honest, member}  # strangers never got a table entry
    assert stats["tracked"] == ONLY_THE_NEIGHBOUR  # the member's state went with it
