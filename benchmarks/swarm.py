"""The swarm of daemons against the launcher run of the same layout, in one run.

    python benchmarks/swarm.py [--nodes 3] [--steps 30] [--min-stages 2] [--calm] [--json PATH]

``swarm``: N `fusionllm node` processes on 127.0.0.1 (no launcher): time from launching them to
the first trained step, steady-state tokens/s (median step time after a quarter of the steps),
bytes each serving node sent per step. ``launcher``: `run_swarm` (one stage process per stage,
addresses handed out by the launcher) with the cuts and replicas the swarm's plan chose, same
run spec and data, in the same run. The ratio swarm/launcher is the cost of running inside the
daemons (control plane beside the compute, the READY barrier, plan votes); target >= 0.9.
``local``: the same run spec trained in this process (one torch thread, no transport), the
baseline of issue 13's pipeline targets (2 stages >= 1.4x it on a 2-core box).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fusionllm.common.run_spec import RunSpec
from fusionllm.node.local_swarm import CALM, LocalSwarm, wait_for
from fusionllm.node.pipeline.launcher import run_swarm
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.train_config import TrainConfig


def _run(args: argparse.Namespace) -> RunSpec:
    return RunSpec(
        steps=args.steps, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches, lr=3e-3,
    )  # fmt: skip


def bench_swarm(args: argparse.Namespace, root: Path) -> dict:
    run = _run(args)
    extra = {"steps": run.steps, "seq-len": run.seq_len, "micro-batch-size": run.micro_batch_size,
             "micro-batches": run.micro_batches, "lr": run.lr, "min-stages": args.min_stages,
             "threads": 1, "pin-cores": not args.no_pin,
             **(CALM if args.calm else {})}  # fmt: skip
    swarm = LocalSwarm(root, extra=extra)
    launched = time.monotonic()
    try:
        first = swarm.start("n0")
        wait_for(lambda: first.last("ready"), 120, "the first node")
        for i in range(1, args.nodes):
            swarm.start(f"n{i}", bootstrap=first.dht_addr)
        nodes = swarm.nodes
        wait_for(lambda: any(n.last("step") for n in nodes), 600, "the first step", poll=0.05)
        first_step_s = time.monotonic() - launched
        serving = [n for n in nodes if n.last("train_plan")]
        wait_for(lambda: all(n.last("finished") for n in serving), 1200, "the end")
    finally:
        swarm.close()
    plan = serving[0].last("train_plan")
    steps = [e for e in serving[0].snapshot() if e["event"] == "step"]
    steady = [e["seconds"] for e in steps[len(steps) // 4 :]]
    sent = sum(n.last("step")["bytes_out"] for n in serving)
    return {
        "first_step_s": first_step_s,
        "step_s": statistics.median(steady),
        "tokens_per_s": run.tokens_per_step / statistics.median(steady),
        "bytes_per_step": sent / len(steps),
        "ranges": plan["ranges"],
        "replicas": [len(s) for s in plan["stages"]],
    }


def bench_launcher(args: argparse.Namespace, ranges: list, replicas: list) -> dict:
    config = TrainConfig.for_run(
        _run(args), cuts=tuple(r[0] for r in ranges[1:]), replicas=tuple(replicas)
    )
    result = run_swarm(config, pin_cores=not args.no_pin)
    last = [e for e in result.steps if e.get("step") is not None]
    by_step: dict[int, float] = {}
    for event in last:
        by_step[event["step"]] = max(by_step.get(event["step"], 0.0), event["seconds"])
    steady = [by_step[s] for s in sorted(by_step)[len(by_step) // 4 :]]
    return {"step_s": statistics.median(steady),
            "tokens_per_s": config.tokens_per_step / statistics.median(steady)}  # fmt: skip


def bench_local(args: argparse.Namespace) -> dict:
    config = TrainConfig.for_run(_run(args), cuts=(), replicas=(1,))
    times: list[float] = []
    last = [time.perf_counter()]

    def on_step(_step: int, _loss: float) -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    torch.set_num_threads(1)  # as each daemon runs (threads 1)
    train_local(config, on_step=on_step)
    steady = statistics.median(times[len(times) // 4 :])
    return {"step_s": steady, "tokens_per_s": config.tokens_per_step / steady}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--min-stages", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument(
        "--calm",
        action="store_true",
        help="the control-plane timing `fusionllm swarm` uses (default: the tests' FAST)",
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="let the OS move trainers between cores"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fusionllm-bench-") as tmp:
        swarm = bench_swarm(args, Path(tmp))
    launcher = bench_launcher(args, swarm["ranges"], swarm["replicas"])
    local = bench_local(args)
    ratio = swarm["tokens_per_s"] / launcher["tokens_per_s"]
    print(f"{args.nodes} daemons, plan ranges {swarm['ranges']}, replicas {swarm['replicas']}")
    print(f"{'run':<10} {'step s':>8} {'tokens/s':>10}")
    print(f"{'swarm':<10} {swarm['step_s']:>8.4f} {swarm['tokens_per_s']:>10,.0f}")
    print(f"{'launcher':<10} {launcher['step_s']:>8.4f} {launcher['tokens_per_s']:>10,.0f}")
    print(f"{'local':<10} {local['step_s']:>8.4f} {local['tokens_per_s']:>10,.0f}")
    print(f"swarm / launcher tokens/s: {ratio:.2f} (target >= 0.9)")
    print(
        f"swarm / local (one process) tokens/s: {swarm['tokens_per_s'] / local['tokens_per_s']:.2f}"
    )
    print(f"launch -> first trained step: {swarm['first_step_s']:.1f} s")
    print(f"bytes sent per step (all serving nodes): {swarm['bytes_per_step']:,.0f}")
    if args.json:
        result = {"swarm": swarm, "launcher": launcher, "local": local, "ratio": ratio,
                  "args": vars(args)}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
