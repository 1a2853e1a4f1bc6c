"""The swarm of daemons against the launcher run of the same plan, in one run.

    python benchmarks/swarm.py [--nodes 3] [--steps 30] [--min-stages 2] [--calm] [--reps 3]
                               [--json PATH]

``swarm``: N `fusionllm node` processes on 127.0.0.1 (no launcher): time from launching them to
the first trained step, steady-state step (median after a quarter of the steps) two ways: the
runner's step (``runner_s``: its start to its summary) and the wall interval between steps
(``step_s``: also what the trainer does between them: events, pace checks, checkpoints, votes),
bytes each serving node sent per step. ``launcher``: `run_swarm` (one stage process per stage,
addresses handed out by the launcher) with the cuts, replicas *and link codecs* the swarm's plan
chose (its ``train_plan`` event's ``wire``), same run spec and data. The ratio swarm/launcher is
the cost of running inside the daemons (control plane beside the compute, plan votes, events);
target >= 0.9. Until session 8 the launcher ran every link dense while AdaTopK had the swarm's
plan send top-k gradients on loopback (its compute is tiny, so every link is a bottleneck): the
old ratio charged the codec's work to the daemons. ``--reps``: swarm and launcher alternate,
medians reported (this box is shared: single runs moved 0.6x-1.6x). ``local``: the same run
spec trained in this process (one torch thread, no transport), the baseline of issue 13's
pipeline targets (2 stages >= 1.4x it on a 2-core box).
"""

import argparse
import itertools
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
    steady = steps[len(steps) // 4 :]
    step_s = statistics.median(b["t"] - a["t"] for a, b in itertools.pairwise(steady))
    sent = sum(n.last("step")["bytes_out"] for n in serving)
    return {
        "first_step_s": first_step_s,
        "step_s": step_s,
        "runner_s": statistics.median(e["seconds"] for e in steady),
        "tokens_per_s": run.tokens_per_step / step_s,
        "bytes_per_step": sent / len(steps),
        "ranges": plan["ranges"],
        "replicas": [len(s) for s in plan["stages"]],
        "wire": plan["wire"],
    }


def bench_launcher(args: argparse.Namespace, swarm: dict) -> dict:
    """``run_swarm`` on the swarm's plan: its cuts, replicas and link codecs."""
    wire = {k: tuple(v) for k, v in swarm["wire"].items()}
    cuts = tuple(r[0] for r in swarm["ranges"][1:])
    config = TrainConfig.for_run(_run(args), cuts=cuts, replicas=tuple(swarm["replicas"]), **wire)
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
    parser.add_argument("--reps", type=int, default=1, help="alternating swarm/launcher runs")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    swarms, launchers = [], []
    for _ in range(args.reps):  # alternate: the load moves between runs
        with tempfile.TemporaryDirectory(prefix="fusionllm-bench-") as tmp:
            swarms.append(bench_swarm(args, Path(tmp)))
        launchers.append(bench_launcher(args, swarms[-1]))
    local = bench_local(args)
    pairs = zip(swarms, launchers, strict=True)
    ratios = [s["tokens_per_s"] / la["tokens_per_s"] for s, la in pairs]
    swarm = swarms[-1]
    med = {
        "swarm": statistics.median(s["step_s"] for s in swarms),
        "swarm runner": statistics.median(s["runner_s"] for s in swarms),
        "launcher": statistics.median(la["step_s"] for la in launchers),
        "local": local["step_s"],
    }
    print(f"{args.nodes} daemons, plan ranges {swarm['ranges']}, replicas {swarm['replicas']}, "
          f"wire {swarm['wire']}")  # fmt: skip
    print(f"{'run':<14} {'step s':>8} {'tokens/s':>10}   (medians of {args.reps} alternating runs)")
    for name, step_s in med.items():
        print(f"{name:<14} {step_s:>8.4f} {_run(args).tokens_per_step / step_s:>10,.0f}")
    print(f"swarm / launcher tokens/s: {statistics.median(ratios):.2f} (runs: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; target >= 0.9)")  # fmt: skip
    print(f"swarm / local (one process) tokens/s: {med['local'] / med['swarm']:.2f}")
    print(f"launch -> first trained step: {swarm['first_step_s']:.1f} s")
    print(f"bytes sent per step (all serving nodes): {swarm['bytes_per_step']:,.0f}")
    if args.json:
        result = {"swarm": swarms, "launcher": launchers, "local": local, "ratios": ratios,
                  "medians": med, "args": vars(args)}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
