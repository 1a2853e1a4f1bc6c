"""What churn costs a swarm of real daemons: recovery time and steps lost, per scenario.

    python benchmarks/churn.py [--runs 3] [--steps 400] [--checkpoint-every 20] [--json PATH]
                                [--keep DIR]

Scenarios, each on a fresh local swarm of `fusionllm node` processes (GPT-2 tiny, FAST timing):
``crash-stage``: SIGKILL the node of a 2-stage plan's single-replica stage (two backups wait);
``crash-replica``: SIGKILL one of two data-parallel replicas of a 1-stage plan;
``leave``: SIGTERM a serving node of a 2-stage plan.
Per run: ``recovery_s`` = the kill to the first step of a plan started after it; ``steps_lost``
= how far that plan went back behind the newest finished step; ``step_s``: the median step
before the kill, to read recovery in steps; ``checkpoint_s``: the median time a checkpoint
takes on the critical path (packing its copy, writing the file); ``copy_s``: the median time
from a checkpoint to its copy kept on another node; ``copy_wait_s``: the median wait, one step
after a checkpoint, for the copy's frames to have left the node (so that a crash after that step
costs at most one interval).
Medians over runs are printed; ``--json`` writes every run; ``--keep DIR`` keeps the logs.
"""

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fusionllm.node.local_swarm import (
    TEST_DEVICE,
    LocalSwarm,
    first_step_after,
    last_step,
    rollbacks,
    serving,
    wait_for,
)

SCENARIOS = {
    "crash-stage": ({"min-stages": 2, "max-stages": 2, "max-replicas": 1}, 4, signal.SIGKILL),
    "crash-replica": ({"min-stages": 1, "max-stages": 1, "max-replicas": 2}, 3, signal.SIGKILL),
    "leave": ({"min-stages": 2, "max-stages": 2, "max-replicas": 1}, 4, signal.SIGTERM),
}


def _wanted_plan(nodes, scenario: str):
    """The serving nodes once the plan has the scenario's shape and 2 checkpoints are done."""
    now = serving(nodes)
    plans = [n.last("train_plan") for n in now]
    if scenario == "crash-replica":
        shaped = len(now) == 2 and all(len(p["stages"]) == 1 for p in plans)
    else:
        shaped = len(now) == 2 and all(len(p["stages"]) == 2 for p in plans)
    return now if shaped else None


def _copy_latencies(events: list[dict]) -> list[float]:
    """Seconds from a checkpoint to its copy kept on another node: the window in which a crash
    of the checkpointing node still costs the interval before. (The same step and range may be
    kept again later, donated after a crash: the first keep after the checkpoint counts.)"""
    kept: dict[tuple, list[float]] = {}
    for e in events:
        if e["event"] == "kept":
            kept.setdefault((e["step"], tuple(e["range"])), []).append(e["t"])
    latencies = []
    for e in events:
        if e["event"] == "checkpoint" and e.get("keeper"):
            after = [t for t in kept.get((e["step"], tuple(e["range"])), []) if t >= e["t"]]
            if after:
                latencies.append(min(after) - e["t"])
    return latencies


def run_once(scenario: str, args: argparse.Namespace, root: Path) -> dict:
    options, count, sig = SCENARIOS[scenario]
    extra = {"steps": args.steps, "seq-len": 64, "micro-batch-size": 2, "micro-batches": 4,
             "lr": 3e-3, "threads": 1, "dense": True, "step-timeout": 60,
             "checkpoint-every": args.checkpoint_every, **options}  # fmt: skip
    # Replicas pay off in the planner's eyes only if compute dominates: advertise a slow device.
    device = {**TEST_DEVICE, "flops": TEST_DEVICE["flops"] / 100} if "replica" in scenario else None
    swarm = LocalSwarm(root, extra=extra, device=device)
    try:
        first = swarm.start("n0")
        wait_for(lambda: first.last("ready"), 120, "the first node")
        nodes = [first, *(swarm.start(f"n{i}", bootstrap=first.dht_addr) for i in range(1, count))]
        # Kill between checkpoints, at a step that is not one: the worst case is a full interval.
        wait_for(lambda: _wanted_plan(nodes, scenario), 300, f"a {scenario} plan")
        every = args.checkpoint_every
        target = last_step(nodes) + every + every // 2
        wait_for(lambda: last_step(nodes) >= target and _wanted_plan(nodes, scenario), 300,
                 f"step {target}")  # fmt: skip
        victim = _wanted_plan(nodes, scenario)[0]
        before = [e["seconds"] for e in victim.snapshot() if e["event"] == "step"][-20:]
        killed_at = time.time()
        victim.kill(sig)
        others = [n for n in nodes if n is not victim]
        resumed = wait_for(lambda: first_step_after(others, killed_at), 180, "recovery")
        events = [e for n in nodes for e in n.snapshot()]
        writes = [e["seconds"] for e in events if e["event"] == "checkpoint"]
        copies = _copy_latencies(events)
        waits = [e["waited"] for e in events if e["event"] == "copy_sent"]
        return {
            "scenario": scenario,
            "recovery_s": resumed - killed_at,
            "steps_lost": max(rollbacks(others, killed_at)),
            "step_s": statistics.median(before),
            "checkpoint_s": statistics.median(writes) if writes else None,
            "copy_s": statistics.median(copies) if copies else None,
            "copy_wait_s": statistics.median(waits) if waits else None,
        }
    finally:
        swarm.close()


def _ms(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]
    return 1000 * statistics.median(known) if known else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="run length (the run is cut short)")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--json", help="write every run here")
    parser.add_argument("--keep", help="keep each run's node logs and work dirs under this dir")
    args = parser.parse_args(argv)
    results = []
    for scenario in args.scenarios:
        for run in range(args.runs):
            if args.keep:
                root = Path(args.keep) / f"{scenario}-{run}"
                root.mkdir(parents=True, exist_ok=True)
                result = run_once(scenario, args, root)
            else:
                with tempfile.TemporaryDirectory(prefix="churn-") as tmp:
                    result = run_once(scenario, args, Path(tmp))
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    head = ["scenario", "recovery s", "steps lost", "step s", "ckpt ms", "copy ms", "wait ms"]
    print(f"{head[0]:<14}", *(f"{h:>10}" for h in head[1:]),
          f"  (medians of {args.runs}; checkpoint every {args.checkpoint_every})")  # fmt: skip
    for scenario in args.scenarios:
        runs = [r for r in results if r["scenario"] == scenario]
        print(
            f"{scenario:<14} {statistics.median(r['recovery_s'] for r in runs):>10.2f} "
            f"{statistics.median(r['steps_lost'] for r in runs):>10} "
            f"{statistics.median(r['step_s'] for r in runs):>10.3f} "
            f"{_ms([r['checkpoint_s'] for r in runs]):>10.1f} "
            f"{_ms([r['copy_s'] for r in runs]):>10.1f} "
            f"{_ms([r['copy_wait_s'] for r in runs]):>10.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
