"""Where a node's memory and CPU go: imports, an idle node's processes, a training node's.

    python benchmarks/footprint.py [--idle-s 20] [--steps 400] [--model tiny] [--json PATH]

1. imports: RSS and CPU seconds of a fresh interpreter after each import, alone (python,
   py-libp2p, torch, hivemind, and the modules `fusionllm node` loads).
2. idle: one `fusionllm node --no-train` (a swarm of one, control plane only): every process
   of its tree (node, DHT worker, hivemind's children) with its RSS and CPU % over --idle-s s.
3. training: three nodes that train (2 stages, 1 replica each, so one waits in backup) with
   the CLI's timing: each node's tree during the run, beside what its stage must hold from
   the model's costs: parameters x4 (weights, gradients, Adam's two moments) and activations
   (the stage's peak activation bytes per sequence x micro-batch size x micro-batches in
   flight under 1F1B).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from control_plane import _cpu_s, _tree  # a sibling script, found through sys.path[0]

from fusionllm.dag.graph import GraphCosts
from fusionllm.node.control.local_facts import learn_local_facts
from fusionllm.node.local_swarm import CALM, LocalSwarm, wait_for

_MIB = 1 << 20
_IMPORTS = {
    "python alone": "pass",
    "py-libp2p + trio": "import libp2p, trio",
    "torch": "import torch",
    "hivemind": "import hivemind",
    "fusionllm node (CLI, daemon)": "import fusionllm.node.cli.main, fusionllm.node.swarm_node",
    "fusionllm training half": "import fusionllm.node.swarm_training",
}
_PROBE = (
    "import resource, psutil\n{stmt}\n"
    "u = resource.getrusage(resource.RUSAGE_SELF)\n"
    "print(psutil.Process().memory_info().rss, u.ru_utime + u.ru_stime)"
)


def bench_imports(repeats: int = 3) -> dict[str, dict[str, float]]:
    rows = {}
    for name, stmt in _IMPORTS.items():
        rss, cpu = [], []
        for _ in range(repeats):
            out = subprocess.run(
                [sys.executable, "-c", _PROBE.format(stmt=stmt)],
                capture_output=True, text=True, check=True, timeout=300,
            )  # fmt: skip
            r, c = out.stdout.split()
            rss.append(int(r) / _MIB)
            cpu.append(float(c))
        rows[name] = {"rss_mib": statistics.median(rss), "cpu_s": statistics.median(cpu)}
    return rows


def tree_usage(pid: int, seconds: float) -> list[dict]:
    """Each process of ``pid``'s tree (control_plane's roles): RSS MiB, CPU % over ``seconds``."""
    tree = _tree(pid)
    time.sleep(seconds)
    rows = []
    for role, process, cpu_before in tree:
        try:
            cpu = (_cpu_s(process) - cpu_before) / seconds * 100
            rows.append({"role": role, "rss_mib": process.memory_info().rss / _MIB, "cpu_pct": cpu})
        except psutil.NoSuchProcess:
            continue
    return rows


def bench_idle(root: Path, idle_s: float) -> list[dict]:
    root.mkdir()
    swarm = LocalSwarm(root, extra={"no-train": True, **CALM})
    try:
        node = swarm.start("idle")
        wait_for(lambda: node.last("epoch"), 120, "the idle node's first epoch")
        return tree_usage(node.process.pid, idle_s)
    finally:
        swarm.close()


def stage_needs(costs: GraphCosts, run: dict, ranges: list[list[int]], stage: int) -> dict:
    """MiB a stage holds by the model's costs: parameters x4, activations in flight."""
    start, stop = ranges[stage]
    nodes = costs.nodes[start:stop]
    in_flight = min(run["micro-batches"], len(ranges) - stage)
    activations = sum(n.peak_activation_bytes for n in nodes) * run["micro-batch-size"]
    return {
        "params_x4_mib": 4 * sum(n.param_bytes for n in nodes) / _MIB,
        "activations_mib": activations * in_flight / _MIB,
    }


def bench_training(root: Path, model: str, steps: int, sample_s: float) -> list[dict]:
    run = {"model": model, "steps": steps, "seq-len": 64, "micro-batch-size": 8, "micro-batches": 8}
    extra = {**run, "min-stages": 2, "max-stages": 2, "max-replicas": 1, "threads": 1, **CALM}
    root.mkdir()
    swarm = LocalSwarm(root, extra=extra)
    try:
        first = swarm.start("t0")
        wait_for(lambda: first.last("ready"), 120, "the first node")
        nodes = [first] + [swarm.start(f"t{i}", bootstrap=first.dht_addr) for i in (1, 2)]

        def steady() -> bool:  # past the first plan's start-up and a checkpoint
            return any((n.last("step") or {}).get("step", 0) >= 25 for n in nodes)

        wait_for(steady, 300, "25 trained steps")
        usage = {n.name: tree_usage(n.process.pid, sample_s) for n in nodes}
        costs = learn_local_facts(model, run["seq-len"], device_cache=None, measure_device=False)
        rows = []
        for node in nodes:
            plan = node.last("train_plan")
            serving = node.last("epoch")["state"] == "serving" and plan is not None
            row = {"node": node.name, "serving": serving, "processes": usage[node.name]}
            if serving:
                row.update(stage_needs(costs.costs, run, plan["ranges"], plan["stage"]))
                row["stage"] = plan["stage"]
            rows.append(row)
        return rows
    finally:
        swarm.close()


def _print_tree(rows: list[dict], indent: str = "  ") -> None:
    for row in rows:
        print(f"{indent}{row['role']:<30} {row['rss_mib']:8.0f} MiB {row['cpu_pct']:7.2f} %")
    total_rss = sum(r["rss_mib"] for r in rows)
    total_cpu = sum(r["cpu_pct"] for r in rows)
    print(f"{indent}{f'= {len(rows)} processes':<30} {total_rss:8.0f} MiB {total_cpu:7.2f} %")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle sample, s (%(default)s)")
    parser.add_argument("--steps", type=int, default=400, help="training run (%(default)s)")
    parser.add_argument("--model", default="tiny", help="GPT-2 size that trains (%(default)s)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    imports = bench_imports()
    print("imports (fresh interpreter each, medians of 3)")
    for name, row in imports.items():
        print(f"  {name:<30} {row['rss_mib']:8.0f} MiB {row['cpu_s']:7.2f} s CPU")
    with tempfile.TemporaryDirectory() as workdir:
        idle = bench_idle(Path(workdir) / "idle", args.idle_s)
        print(f"\nan idle node (--no-train, alone), over {args.idle_s:g} s: RSS, CPU % of a core")
        _print_tree(idle)
        training = bench_training(Path(workdir) / "train", args.model, args.steps, args.idle_s / 2)
    print(f"\nthree training nodes (GPT-2 {args.model}, 2 stages, 8 x 8 x 64 tokens per step)")
    for row in training:
        what = f"stage {row['stage']}" if row["serving"] else "backup"
        print(f"  {row['node']} ({what})")
        _print_tree(row["processes"], indent="    ")
        if row["serving"]:
            print(f"    by the costs: parameters x4 {row['params_x4_mib']:.0f} MiB, "
                  f"activations in flight {row['activations_mib']:.0f} MiB")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"imports": imports, "idle": idle, "training": training}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
