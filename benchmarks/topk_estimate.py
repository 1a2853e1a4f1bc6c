"""A testbed run's plan re-estimated with top-k frames charged by their size, beside its step.

Issue 25: s8's C OP-Fence + AdaTopK plan (h1 with operators 0-43, then h3+h2 as replicas of
the head, top-k both ways) ran at 0.43-0.50 of its estimate; the planner charged each top-k
frame 8 x the dense frame's CPU, whatever its size. This rebuilds that plan from a results JSON
of ``benchmarks/testbed.py`` (the devices the nodes advertised, the links they measured, the
hosts per stage; the cuts and top-k ratios are not in the JSON: ``--cuts`` and ``--ratios``,
from the run's ``train_plan`` events, claimed as a proposal claims them) and times it twice:
as recorded (the fixed charge) and with each device's top-k figures
(a constant plus a rate per dense byte), measured here with one torch thread and scaled by the
host's CPU share as ``benchmarks/testbed.py`` scales the other figures, or given.

    python -m benchmarks.topk_estimate RESULTS.json [--cuts 0,43,48] [--ratios 0.173,0.270]
        [--topk-ms MS --topk-mb-s R]
"""

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from fusionllm.dag.cost import DeviceProfile, LinkProfile, mbps
from fusionllm.dag.plan_build import build_plan, topk_frames
from fusionllm.dag.plan_check import Retimer
from fusionllm.dag.planner import Plan, PlanConfig
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.node.control.facts_main import model_costs
from fusionllm.node.control.frame_cost import TopkFrameCost, measure_topk_cost
from fusionllm.testbed.topology import load_topology

# The experiment's run (benchmarks/testbed.py RUN): 4 micro-batches of 8 x 64 tokens.
CONFIG = PlanConfig(micro_batches=4, batch_size=32, graph_batch_size=1)


def swarm_of(top: dict, run: dict, topk: TopkFrameCost | None) -> Swarm:
    """The run's hosts as the planner saw them: advertised devices, measured links."""
    topology = load_topology(top["topology"])
    peers = []
    for host in (h for group in run["plan"] for h in group):
        d = top["devices"][host]
        share = min(topology.host(host).cpu or 1.0, 1.0)
        extra = {}
        if topk is not None:
            extra = {"topk_frame_overhead": topk.per_frame / share,
                     "topk_byte_cost": topk.per_byte / share}  # fmt: skip
        device = DeviceProfile(
            name=d["name"], flops=d["flops"], memory_bandwidth=d["memory_bandwidth"],
            memory_bytes=d["memory_bytes"], op_overhead=d["op_overhead"],
            frame_overhead=d.get("frame_overhead", 0.0), **extra,
        )  # fmt: skip
        spec = topology.host(host)
        peers.append(Peer(peer_id=host, device=device, uplink=mbps(spec.uplink_mbps or 1e4),
                          downlink=mbps(spec.downlink_mbps or 1e4)))  # fmt: skip
    ids = {p.peer_id for p in peers}
    links = {
        (x["src"], x["dst"]): LinkProfile(
            bandwidth=x["measured_mb_s"] * 1e6, rtt=x["measured_rtt_ms"] / 1e3
        )
        for x in run["links"]
        if x["src"] in ids and x["dst"] in ids
    }
    return Swarm.from_links(peers, links)


def estimate(swarm: Swarm, groups: list, cuts: list[int], ratios: tuple[float, float]) -> Plan:
    """The plan on these hosts and cuts, its links top-k at ``ratios`` (activation, gradient),
    timed as every node re-times a proposal (Retimer: claimed codecs kept)."""
    costs = model_costs("tiny", 64, vocab_size=256)
    planned = build_plan(costs, swarm, CONFIG, groups, cuts)
    codecs = {"forward_codec": "topk", "forward_ratio": ratios[0]}
    codecs |= {"backward_codec": "topk", "backward_ratio": ratios[1]}
    claimed = tuple(dataclasses.replace(link, **codecs) for link in planned.links)
    return Retimer(costs, swarm, CONFIG).retime(dataclasses.replace(planned, links=claimed)).plan


def _one_thread_topk() -> TopkFrameCost:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_topk_cost()
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a benchmarks/testbed.py results JSON")
    parser.add_argument("--method", default="opfence", help="which run of the JSON")
    parser.add_argument("--cuts", default="0,43,48", help="the plan's stage boundaries")
    parser.add_argument("--ratios", default="0.1727,0.2702", help="top-k: activation,gradient")
    parser.add_argument("--topk-ms", type=float, help="a whole core's top-k ms per frame")
    parser.add_argument("--topk-mb-s", type=float, help="... and MB/s of dense bytes")
    args = parser.parse_args(argv)
    if (args.topk_ms is None) != (args.topk_mb_s is None):
        parser.error("give both --topk-ms and --topk-mb-s, or neither (measured here)")
    if args.topk_ms is None:
        topk = _one_thread_topk()
    else:
        topk = TopkFrameCost(per_frame=args.topk_ms / 1e3, per_byte=1 / (args.topk_mb_s * 1e6))
    data = json.loads(args.results.read_text())
    cuts = [int(c) for c in args.cuts.split(",")]
    fwd, bwd = (float(r) for r in args.ratios.split(","))
    print(f"top-k, one core: {topk.per_frame * 1e3:.2f} ms + {1e-6 / topk.per_byte:.1f} MB/s"
          if topk.per_byte else f"top-k, one core: {topk.per_frame * 1e3:.2f} ms")  # fmt: skip
    print("topology method    measured s  recorded est  fixed 8x  by size  by size/measured")
    for top in data["topologies"]:
        for run in (r for r in top["runs"] if r["method"] == args.method and "step_s" in r):
            fixed, sized = (
                estimate(swarm_of(top, run, t), run["plan"], cuts, (fwd, bwd)) for t in (None, topk)
            )
            print(f"{top['topology']:8} {run['method']:9} {run['step_s']:10.3f} "
                  f"{run['estimate_s']:13.3f} {fixed.estimated_step_time:9.3f} "
                  f"{sized.estimated_step_time:8.3f} "
                  f"{sized.estimated_step_time / run['step_s']:17.2f}")  # fmt: skip
            for link in sized.links:
                f, b = topk_frames(sized.links, len(sized.stages))[link.src_stage]
                print(f"  cut after stage {link.src_stage}: {link.dense_bytes} B dense, "
                      f"{link.forward_codec} {link.forward_ratio:.3f} / {link.backward_codec} "
                      f"{link.backward_ratio:.3f}; top-k frames a micro-batch at its source: "
                      f"{f.frames} forward, {b.frames} backward")  # fmt: skip
            for a, b in zip(fixed.stages, sized.stages, strict=True):
                was, now = a.forward_time + a.backward_time, b.forward_time + b.backward_time
                print(f"  stage {a.index} {','.join(a.peers)}: forward+backward {was:.4f} -> "
                      f"{now:.4f} s a micro-batch")  # fmt: skip


if __name__ == "__main__":
    main()
