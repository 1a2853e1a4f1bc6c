"""Real daemons on an emulated WAN: what a swarm does off loopback, in figures.

    sudo python benchmarks/testbed_swarm.py [--topology B] [--seconds 90] [--timing calm]
                                            [--json PATH]

Every host of the topology (fusionllm.testbed) runs ``fusionllm node`` bound to its own
address, the first as bootstrap, all with the same endless run (GPT-2 tiny, 2 stages at
least, 1 torch thread); after every node is ready they run --seconds more, then
``fusionllm status`` reads the swarm from inside the first host. Printed: start-up (every
node ready, first step), every plan adopted (when, by how many nodes, its hosts per stage,
its estimated step time), each node's steps and tokens/s, and every link's measured
bandwidth and RTT beside the configured cap and round trip, and how long status took.
--timing: ``fast`` (the tests' 1 s heartbeats, 64 KiB probes), ``calm`` (local_swarm.CALM
with 1 MiB probes), ``default`` (a user's).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fusionllm.node.local_swarm import CALM, FAST, LocalSwarm, wait_for
from fusionllm.testbed.bed import Testbed, unavailable
from fusionllm.testbed.topology import load_topology

RUN = {"steps": 0, "seq-len": 32, "micro-batch-size": 2, "micro-batches": 4, "min-stages": 2,
       "threads": 1}  # fmt: skip
TIMINGS = {"fast": FAST, "calm": {**FAST, **CALM, "probe-kib": 1024}, "default": {}}


def _start_all(swarm: LocalSwarm, bed: Testbed) -> tuple[list, float]:
    def start(name: str, bootstrap: str | None = None):
        extra = {"host": bed.address(name)}
        return swarm.start(name, bootstrap=bootstrap, extra=extra, prefix=bed.command(name, []))

    first = start(bed.hosts[0])
    wait_for(lambda: first.last("ready"), 120, "the first node to be ready")
    nodes = [first, *(start(h, first.dht_addr) for h in bed.hosts[1:])]
    wait_for(lambda: all(n.last("ready") for n in nodes), 180, "every node to be ready")
    return nodes, time.time()


def _status(bed: Testbed, bootstrap: str) -> dict:
    argv = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING", "status",
            "--bootstrap", bootstrap, "--json", "--timeout", "90"]  # fmt: skip
    done = bed.run(bed.hosts[0], argv, timeout=120)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}


def _plans(nodes, hosts: dict[str, str], ready_at: float) -> list[dict]:
    """Every plan any node adopted, first adoption first."""
    seen: dict[str, dict] = {}
    for node in nodes:
        for e in node.snapshot():
            if e["event"] != "epoch" or not e["changed"]:
                continue
            plan = seen.setdefault(e["digest"], {
                "digest": e["digest"][:8], "t": e["t"] - ready_at, "adopters": 0,
                "estimate_s": e["estimate"],
                "stages": [[hosts.get(p, p[:8]) for p in s] for s in e["stages"]],
            })  # fmt: skip
            plan["t"] = min(plan["t"], e["t"] - ready_at)
            plan["adopters"] += 1
    return sorted(seen.values(), key=lambda p: p["t"])


def _links(status: dict, hosts: dict[str, str], topology) -> list[dict]:
    rows = []
    for link in status.get("links", []):
        src, dst = hosts.get(link["src"]), hosts.get(link["dst"])
        if src is None or dst is None:
            continue
        cap = topology.path_rate_mbps(src, dst)
        rows.append({
            "src": src, "dst": dst, "cap_mb_s": cap / 8 if cap else None,
            "measured_mb_s": link["mb_s"], "rtt_ms": topology.rtt_ms(src, dst),
            "measured_rtt_ms": link["rtt_ms"],
        })  # fmt: skip
    return sorted(rows, key=lambda r: (r["src"], r["dst"]))


def run(topology_name: str, seconds: float, timing: str) -> dict:
    topology = load_topology(topology_name)
    with tempfile.TemporaryDirectory() as root, Testbed(topology) as bed:
        swarm = LocalSwarm(Path(root), extra={**TIMINGS[timing], **RUN})
        launched = time.time()
        try:
            nodes, ready_at = _start_all(swarm, bed)
            time.sleep(seconds)
            hosts = {n.peer_id: n.name for n in nodes}
            asked = time.monotonic()
            status = _status(bed, nodes[0].dht_addr)
            status_s = time.monotonic() - asked
            steps = {n.name: [e for e in n.snapshot() if e["event"] == "step"] for n in nodes}
        finally:
            swarm.close()
    first_step = min((s[0]["t"] for s in steps.values() if s), default=None)
    return {
        "topology": topology.name, "timing": timing, "seconds": seconds,
        "ready_s": ready_at - launched, "status_s": status_s,
        "first_step_s": None if first_step is None else first_step - ready_at,
        "plans": _plans(nodes, hosts, ready_at),
        "nodes": [{"host": name, "steps": len(s),
                   "tokens_per_s": statistics.median(e["tokens_per_s"] for e in s) if s else 0}
                  for name, s in steps.items()],
        "links": _links(status, hosts, topology),
    }  # fmt: skip


def _print(result: dict) -> None:
    print(f"topology {result['topology']}, timing {result['timing']}: every node ready after "
          f"{result['ready_s']:.1f} s, first step {result['first_step_s']} s after; "
          f"`fusionllm status` took {result['status_s']:.1f} s")  # fmt: skip
    print("plans adopted (s after all ready, adopters, hosts per stage, estimated step s):")
    for p in result["plans"]:
        print(f"  {p['t']:7.1f}  {p['digest']}  {p['adopters']}  {p['stages']}  "
              f"{p['estimate_s']:.4f}")  # fmt: skip
    for n in result["nodes"]:
        print(f"  node {n['host']:6} {n['steps']:6d} steps, median {n['tokens_per_s']:.0f} tok/s")
    print(f"{'link':14} {'cap MB/s':>9} {'measured':>9} {'rtt ms':>7} {'measured':>9}")
    for r in result["links"]:
        cap = f"{r['cap_mb_s']:.2f}" if r["cap_mb_s"] else "-"
        print(f"{r['src'] + '->' + r['dst']:14} {cap:>9} {r['measured_mb_s']:9.2f} "
              f"{r['rtt_ms']:7.1f} {r['measured_rtt_ms']:9.1f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="B", help="A, B, C, mini or a file (B)")
    parser.add_argument("--seconds", type=float, default=90.0, help="after all ready (90)")
    parser.add_argument("--timing", choices=sorted(TIMINGS), default="calm")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"testbed unavailable: {reason}", file=sys.stderr)
        return 1
    result = run(args.topology, args.seconds, args.timing)
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
