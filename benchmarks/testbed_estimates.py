"""The planner's estimates of the plans a testbed experiment ran, against their measured steps.

Reads a results JSON of ``benchmarks/testbed.py`` (docs/results/C.json), rebuilds each run's
plan on the topology's configured links (path caps, round trips) and the devices the nodes
advertised, and times it with today's cost model: so a change to the model is checked against
step times measured on real daemons, without running the testbed again. Plans are rebuilt from
the hosts per stage the JSON records (the cuts are not recorded): a baseline by its own rule,
OP-Fence by planning again on those hosts with that many stages.

    python -m benchmarks.testbed_estimates docs/results/C.json
"""

import argparse
import dataclasses
import json
from pathlib import Path

from fusionllm.dag.baselines import compute_balanced_plan, naive_plan
from fusionllm.dag.cost import DeviceProfile, LinkProfile, mbps
from fusionllm.dag.planner import Plan, PlanConfig, plan
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.node.control.facts_main import model_costs
from fusionllm.testbed.topology import Topology, load_topology

# The experiment's run (benchmarks/testbed.py RUN): 4 micro-batches of 8 x 64 tokens.
CONFIG = PlanConfig(micro_batches=4, batch_size=32, graph_batch_size=1)
RULES = {"naive": naive_plan, "balanced": compute_balanced_plan}
_FRAME_FIELDS = ("frame_overhead", "topk_frame_overhead", "topk_byte_cost")


def swarm_of(topology: Topology, devices: dict, groups: list[list[str]]) -> Swarm:
    """The plan's hosts, named so that peer-id order is the plan's stage order."""
    hosts = [h for g in groups for h in g]
    name = {h: f"{i}-{h}" for i, h in enumerate(hosts)}
    peers = []
    for h in hosts:
        fields = {k: devices[h][k] for k in ("flops", "memory_bandwidth", "memory_bytes")}
        # Frames as the hosts advertised them (older results may carry none).
        fields |= {k: devices[h][k] for k in _FRAME_FIELDS if k in devices[h]}
        device = DeviceProfile(name=h, op_overhead=devices[h]["op_overhead"], **fields)
        spec = topology.host(h)
        peers.append(Peer(peer_id=name[h], device=device, uplink=mbps(spec.uplink_mbps or 1e4),
                          downlink=mbps(spec.downlink_mbps or 1e4)))  # fmt: skip
    links = {
        (name[a], name[b]): LinkProfile(
            bandwidth=mbps(topology.path_rate_mbps(a, b) or 1e4), rtt=topology.rtt_ms(a, b) / 1e3
        )
        for a in hosts
        for b in hosts
        if a != b
    }
    return Swarm.from_links(peers, links)


def rebuilt(run: dict, topology: Topology, devices: dict, costs) -> Plan:
    groups = run["plan"]
    swarm = swarm_of(topology, devices, groups)
    s = len(groups)
    config = dataclasses.replace(CONFIG, min_stages=s, max_stages=s, max_replicas=1)
    method = run["method"]
    if method in RULES:
        return RULES[method](costs, swarm, config)
    if method == "opfence-dense":
        config = dataclasses.replace(config, compression=False)
    return plan(costs, swarm, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a benchmarks/testbed.py results JSON")
    args = parser.parse_args()
    data = json.loads(args.results.read_text())
    costs = model_costs("tiny", 64, vocab_size=256)
    print("topology method        measured s  recorded est  est now  now/measured  plan")
    for top in data["topologies"]:
        topology = load_topology(top["topology"])
        for run in top["runs"]:
            if "step_s" not in run:
                continue
            p = rebuilt(run, topology, top["devices"], costs)
            hosts = " / ".join(",".join(p.split("-", 1)[1] for p in s.peers) for s in p.stages)
            print(f"{top['topology']:8} {run['method']:14} {run['step_s']:10.3f} "
                  f"{run['estimate_s']:13.3f} {p.estimated_step_time:8.3f} "
                  f"{p.estimated_step_time / run['step_s']:13.2f}  {hosts}")  # fmt: skip


if __name__ == "__main__":
    main()
