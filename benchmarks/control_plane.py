"""The control plane on loopback: agreement time, DHT latency, gossip latency/loss, idle cost.

    python benchmarks/control_plane.py [--sizes 4 8 16] [--heartbeat S --ttl S --epoch S]
                                       [--idle-seconds S] [--settle S] [--json P]

For each swarm size N, starts N real ``fusionllm node`` processes (every node is 3 processes:
the node, its DHT worker, which runs hivemind's DHT node on its own event loop, and the
worker's child, hivemind's Go daemon p2pd), bootstrapped from the first, and measures:

- agree: seconds from launching nodes 2..N (the first already up) until all N adopted the
  same plan with N members; "after ready" counts from the moment the last node was ready
  (process start-up, torch import and DHT join excluded). Below the row: the CPU seconds
  all nodes' processes spent from that launch until agreement was seen, by role (the first
  node's start-up taken out), their share of all cores' time over that span (near 100%:
  agreement waits for CPU, not for the protocol), and one node's start-up alone (the first
  node's whole tree when it was ready);
- DHT store/get: a client DHT worker of this process against the swarm, medians of 20
  (the pipe to the worker included, as a node sees it);
- gossip: a publisher and a receiver host connected only to swarm nodes (never to each
  other), 40 signed bandwidth reports at 4/s on the swarm's topic: delivery latency
  (median, p90) and loss (the publisher joins as a member first: nodes forward only members'
  gossip); "rate/full/inv": messages the nodes' own checks dropped so far (per-author rate
  limit / a full inbox / refused, e.g. not a member), summed over nodes;
- idle: after ``--settle`` s (a stable swarm backs off: node/control/backoff.py; an idle one
  goes quiet: node/control/quiet.py), over
  ``--idle-seconds``, each node's whole process tree as it is then (found by walking its
  children, so a process the design did not expect is counted too): processes, CPU % (CPU
  time over wall time) and RSS, summed per node, medians over nodes; and the same per role
  (node, dht-worker, p2pd, any other by name) on a line below;
- replan: SIGKILL a serving node; seconds until every survivor adopted one plan without it
  (the record expiry, the TTL, dominates).
"""

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from fusionllm.common.cpus import available_cores
from fusionllm.common.errors import FusionError
from fusionllm.dht.client import DhtClient, DhtConfig
from fusionllm.dht.directory import SwarmDirectory
from fusionllm.dht.records import LinkReport, NodeState
from fusionllm.node.control.bandwidth import BandwidthReport
from fusionllm.node.errors import DeadlineError
from fusionllm.node.local_swarm import FAST, LocalSwarm, same_plan, wait_for
from fusionllm.node.p2p.control_host import ControlConfig, ControlHost
from fusionllm.node.p2p.identity import load_or_create_identity

SWARM = "default"


def _agreement(swarm: LocalSwarm, n: int) -> dict:
    first = swarm.start("n0")
    wait_for(lambda: first.last("ready"), 180, "the first node")
    # One node's start-up alone, its whole tree at "ready": what each of the others costs.
    alone = _cpu_by_role([first])
    launched = time.time()
    for i in range(1, n):
        swarm.start(f"n{i}", bootstrap=first.dht_addr)
    nodes = list(swarm.nodes)
    latest = wait_for(lambda: same_plan(nodes, members=n), 120 + 20 * n, f"{n} nodes to agree")
    seen_at = time.time()
    join = _cpu_by_role(nodes)
    for role, cpu in alone.items():
        join[role] -= cpu
    agreed_at = max(
        min(e["t"] for e in node.snapshot() if e["event"] == "epoch" and len(e["members"]) == n
            and e["digest"] == latest["digest"])
        for node in nodes
    )  # fmt: skip
    ready_at = max(node.last("ready")["t"] for node in nodes)
    return {
        "agree_s": agreed_at - launched,
        "agree_after_ready_s": agreed_at - ready_at,
        "stages": len(latest["stages"]),
        "backup": len(latest["backup"]),
        "start_cpu_s": sum(alone.values()),
        "join_cpu_by_role": join,
        "join_cores_busy": sum(join.values()) / ((seen_at - launched) * len(available_cores())),
    }


def _cpu_by_role(nodes) -> dict[str, float]:
    """CPU seconds so far of the nodes' process trees, summed by role (see ``_role``)."""
    total: dict[str, float] = {}
    for node in nodes:
        with contextlib.suppress(psutil.Error):  # a node that just exited has no tree
            for role, _proc, cpu in _tree(node.process.pid):
                total[role] = total.get(role, 0.0) + cpu
    return total


def _dht_latency(bootstrap: str, rounds: int = 20) -> dict:
    config = DhtConfig(swarm=SWARM, initial_peers=(bootstrap,), client_mode=True)
    stores, gets = [], []
    with DhtClient(config) as client:
        for i in range(rounds):
            key = f"bench/{i}"
            started = time.perf_counter()
            # Not a swarm record: every node's validator refuses it, after a full round trip.
            client.store(key, "s", b"x", time.time() + 5)
            stores.append(time.perf_counter() - started)
            started = time.perf_counter()
            client.get(f"fusionllm/{SWARM}/nodes")
            gets.append(time.perf_counter() - started)
    return {"store_ms": statistics.median(stores) * 1e3, "get_ms": statistics.median(gets) * 1e3}


def _gossip(nodes, root: Path, messages: int = 40, rate: float = 4.0) -> dict:
    topic = f"fusionllm/{SWARM}/bandwidth"
    hosts = []
    for name in ("pub", "sub"):
        config = ControlConfig(key_path=root / f"{name}.key", max_messages_per_peer_per_s=100)
        hosts.append(ControlHost(config).start())
    publisher, receiver = hosts
    latencies: dict[float, float] = {}
    stop = threading.Event()
    # Nodes forward gossip only from members (links.gossip_validator): the publisher joins.
    member = _Member(publisher, root / "pub.key", nodes, stop)

    def receive() -> None:
        while not stop.is_set():
            try:
                message = receiver.recv(timeout=0.2)
            except DeadlineError:
                continue
            if message.author == publisher.peer_id:
                sent = BandwidthReport.from_bytes(message.data).time
                latencies.setdefault(sent, time.time() - sent)

    try:
        for host in hosts:
            host.subscribe(topic)
        # Each side connects to different nodes, so every message crosses the swarm.
        half = max(1, len(nodes) // 2)
        for node in nodes[:half]:
            publisher.connect(node.last("ready")["addrs"][0])
        for node in nodes[half:] or nodes[:1]:
            receiver.connect(node.last("ready")["addrs"][0])
        wait_for(lambda: publisher.mesh_peers(topic) and receiver.mesh_peers(topic), 30, "meshes")
        member.start()
        wait_for(member.known_to_all, 60, "the publisher to be a member everywhere")
        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        sent = []
        for i in range(messages):
            now = time.time()
            link = LinkReport(peer=nodes[0].peer_id, bandwidth=1e8, rtt=1e-3, age=float(i))
            publisher.publish(
                topic, BandwidthReport(swarm=SWARM, time=now, links=(link,)).to_bytes()
            )
            sent.append(now)
            time.sleep(1.0 / rate)
        time.sleep(5.0)
        stop.set()
        thread.join(timeout=5)
    finally:
        stop.set()
        member.close()
        for host in hosts:
            host.close()
    got = sorted(latencies[t] for t in sent if t in latencies)
    return {
        **_gossip_drops(nodes),
        "gossip_median_ms": statistics.median(got) * 1e3 if got else float("nan"),
        "gossip_p90_ms": got[int(0.9 * (len(got) - 1))] * 1e3 if got else float("nan"),
        "gossip_loss": 1.0 - len(got) / len(sent),
    }


class _Member:
    """The gossip publisher as a swarm member: a record on the DHT like a node's (the swarm's
    settings, copied from the first node's record), refreshed every second, with a device far
    too slow to be planned (it waits in the backup pool)."""

    def __init__(self, host: ControlHost, key_path: Path, nodes, stop: threading.Event) -> None:
        self.host, self.nodes, self.stop = host, nodes, stop
        self.key = load_or_create_identity(key_path)
        self.client: DhtClient | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        config = DhtConfig(swarm=SWARM, initial_peers=(self.nodes[0].dht_addr,), client_mode=True)
        self.client = DhtClient(config).start()
        directory = SwarmDirectory(
            self.client, swarm=SWARM, peer_id=self.host.peer_id, sign=self.key.private_key.sign
        )
        template = wait_for(
            lambda: directory.members().get(self.nodes[0].peer_id), 30, "the first node's record"
        )
        device = dataclasses.replace(template.device, flops=template.device.flops / 1000)

        def beat() -> None:
            while True:
                info = dataclasses.replace(
                    template, peer_id=self.host.peer_id, addrs=tuple(self.host.listen_addrs[:1]),
                    device=device, links=(), state=NodeState.BACKUP, stage=None, adopted=None,
                    time=time.time(), training=None,
                )  # fmt: skip
                with contextlib.suppress(FusionError):
                    directory.announce(info, ttl_s=5.0)
                if self.stop.wait(1.0):
                    return

        self.thread = threading.Thread(target=beat, daemon=True)
        self.thread.start()

    def known_to_all(self) -> bool:
        pid = self.host.peer_id
        return all(pid in (n.last("epoch") or {}).get("members", ()) for n in self.nodes)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=10)
        if self.client is not None:
            self.client.close()


def _gossip_drops(nodes) -> dict:
    """What the swarm's nodes refused or lost of gossip so far (their last epoch's counters):
    where a lost message died, if it died in a node's checks."""
    totals = dict.fromkeys(("dropped_rate", "dropped_inbox_full", "dropped_invalid"), 0)
    for node in nodes:
        counters = (node.last("epoch") or {}).get("counters", {})
        for name in totals:
            totals[name] += counters.get(f"gossip_{name}", 0)
    return {f"gossip_{name}": count for name, count in totals.items()}


def _role(proc: psutil.Process, root: psutil.Process) -> str:
    if proc.pid == root.pid:
        return "node"
    if "fusionllm.dht.worker" in proc.cmdline():
        return "dht-worker"
    return proc.name()  # "p2pd", or something unexpected, named as it is


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _tree(pid: int) -> list[tuple[str, psutil.Process, float]]:
    """(role, process, CPU seconds so far) of every process of the node at ``pid``."""
    root = psutil.Process(pid)
    tree = []
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # one that just exited is not the node's
            tree.append((_role(proc, root), proc, _cpu_s(proc)))
    return tree


def _idle(nodes, seconds: float, settle_s: float = 0.0) -> dict:
    """Per node: its process tree's count, CPU % over ``seconds`` after ``settle_s`` (a stable
    swarm backs off) and RSS (see the docstring)."""
    time.sleep(settle_s)
    trees = [_tree(node.process.pid) for node in nodes]
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    per_node: list[dict[str, tuple[float, float]]] = []
    for tree in trees:
        usage: dict[str, tuple[float, float]] = {}
        for role, proc, cpu_before in tree:
            try:
                cpu, rss = 100 * (_cpu_s(proc) - cpu_before) / elapsed, proc.memory_info().rss
            except psutil.Error:  # it exited meanwhile: not part of the idle node
                continue
            was = usage.get(role, (0.0, 0.0))
            usage[role] = (was[0] + cpu, was[1] + rss / 2**20)
        per_node.append(usage)
    roles = sorted({role for usage in per_node for role in usage})
    return {
        "idle_processes": statistics.median(len(tree) for tree in trees),
        "idle_cpu_percent": statistics.median(sum(c for c, _ in u.values()) for u in per_node),
        "idle_rss_mib": statistics.median(sum(r for _, r in u.values()) for u in per_node),
        "idle_by_role": {
            role: {
                "cpu_percent": statistics.median(u.get(role, (0.0, 0.0))[0] for u in per_node),
                "rss_mib": statistics.median(u.get(role, (0.0, 0.0))[1] for u in per_node),
            }
            for role in roles
        },
    }


def _replan_after_crash(nodes) -> dict:
    """SIGKILL a serving node; seconds until every survivor adopted a plan without it."""
    latest = nodes[0].last("epoch")
    serving = {p for stage in latest["stages"] for p in stage}
    victim = next((n for n in nodes[1:] if n.peer_id in serving), nodes[0])
    survivors = [n for n in nodes if n is not victim]
    killed_at = time.time()
    victim.kill()

    def done():
        events = [n.last("epoch") for n in survivors]
        if any(e is None or e["t"] < killed_at or victim.peer_id in e["members"] for e in events):
            return None
        return events if len({e["digest"] for e in events}) == 1 else None

    events = wait_for(done, 120, "survivors to re-plan")
    return {"replan_s": max(e["t"] for e in events) - killed_at}


def run(sizes: list[int], timing: dict, idle_seconds: float, settle_s: float) -> list[dict]:
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            swarm = LocalSwarm(
                root, extra={"max-replicas": 1, "max-stages": 4, "control-only": True, **timing}
            )
            try:
                row = {"nodes": n, **_agreement(swarm, n)}
                nodes = list(swarm.nodes)
                row.update(_dht_latency(nodes[0].dht_addr))
                row.update(_gossip(nodes, root))
                row.update(_idle(nodes, idle_seconds, settle_s))
                row.update(_replan_after_crash(nodes))
            except AssertionError as exc:  # a swarm too big for this machine: say so, go on
                row = {"nodes": n, "failed": str(exc)}
            finally:
                swarm.close()
        rows.append(row)
        if "failed" in row:
            print(f"{n:>5} {row['failed']}", flush=True)
        else:
            print(_format_row(row), _format_roles(row["idle_by_role"]), _format_join(row),
                  sep="\n", flush=True)  # fmt: skip
    return rows


def _format_row(r: dict) -> str:
    drops = (
        f"{r['gossip_dropped_rate']}/{r['gossip_dropped_inbox_full']}/{r['gossip_dropped_invalid']}"
    )
    return (
        f"{r['nodes']:>5} {r['agree_s']:>8.1f} {r['agree_after_ready_s']:>12.1f} "
        f"{r['store_ms']:>9.1f} {r['get_ms']:>7.1f} {r['gossip_median_ms']:>10.1f} "
        f"{r['gossip_p90_ms']:>7.1f} {r['gossip_loss']:>6.0%} {drops:>13} "
        f"{r['idle_cpu_percent']:>9.1f} {r['idle_by_role']['node']['cpu_percent']:>8.2f} "
        f"{r['idle_processes']:>6.0f} {r['idle_rss_mib']:>8.0f} {r['replan_s']:>9.1f}"
    )


def _format_roles(by_role: dict) -> str:
    parts = [f"{role} {v['cpu_percent']:.2f}% {v['rss_mib']:.0f} MiB" for role, v in
             by_role.items()]  # fmt: skip
    return "      idle per node, by process: " + " | ".join(parts)


def _format_join(r: dict) -> str:
    roles = " | ".join(f"{role} {cpu:.1f}" for role, cpu in sorted(r["join_cpu_by_role"].items()))
    return (
        f"      launch to agreement, CPU s of all nodes: {roles} "
        f"({r['join_cores_busy']:.0%} of all cores); one node's start-up alone: "
        f"{r['start_cpu_s']:.1f} CPU s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16])
    # Slower than the tests' timing: 16 nodes are 48 processes on this 2-core machine.
    parser.add_argument("--heartbeat", type=float, default=2.0, help="s (default: %(default)s)")
    parser.add_argument("--ttl", type=float, default=8.0, help="s (default: %(default)s)")
    parser.add_argument("--epoch", type=float, default=4.0, help="s (default: %(default)s)")
    parser.add_argument(
        "--probe-interval", type=float, default=8.0, help="s (default: %(default)s)"
    )
    # Two of a quiet swarm's cycles at the default timing (it acts every 16 epochs of 4 s): a
    # shorter window measures whether it happened to hold an epoch the swarm acted in.
    parser.add_argument(
        "--idle-seconds", type=float, default=128.0, help="s (default: %(default)s)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=70.0,
        help="s to wait before measuring idle cost, so the nodes back off: 1 + 1 + 2 + 4 + 8 "
        "epochs to reach a stride of 16 (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    timing = {
        **FAST,
        "heartbeat": args.heartbeat,
        "ttl": args.ttl,
        "epoch": args.epoch,
        "probe-interval": args.probe_interval,
    }
    print(
        f"control plane on loopback (heartbeat {args.heartbeat} s, TTL {args.ttl} s, "
        f"epoch {args.epoch} s, probes every {args.probe_interval} s)\n"
        f"{'nodes':>5} {'agree s':>8} {'after ready':>12} {'store ms':>9} {'get ms':>7} "
        f"{'gossip ms':>10} {'p90 ms':>7} {'loss':>6} {'rate/full/inv':>13} {'idle CPU%':>9} "
        f"{'main CPU%':>8} {'procs':>6} {'RSS MiB':>8} {'replan s':>9}",
        flush=True,
    )
    rows = run(args.sizes, timing, args.idle_seconds, args.settle)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
