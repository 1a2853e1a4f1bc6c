"""Pipeline training throughput: 1, 2 and 4 stage processes on loopback beside one process.

    python benchmarks/pipeline.py [--stages 1 2 4] [--steps 30] [--micro-batches 8] [--json PATH]

Each row trains GPT-2 (tiny by default: byte-level, the stdlib's source as text) with the
same seed, data and batch: ``local`` is the whole model in this process (no transport);
``S stages`` is one ``pipeline_main`` process per stage over the real transport (py-libp2p,
noise + yamux) on 127.0.0.1, 1F1B with M micro-batches. Per row: median step time, tokens/s
and the measured bubble fraction = 1 - (sum over processes of forward+backward compute) /
(processes x step time), medians over the steps after the warm-up, beside the ideal 1F1B
bubble (S - 1) / (M + S - 1) for equal stages and free links. The first steps are warm-up.
"CPU ms/step" is the CPU time of all the row's processes per measured step (every thread:
compute, packing, the lanes' reading, the optimizer), and "cores busy" that time over all
cores' time: near 100% the row is bound by CPU, not by waiting, and any work the pipeline
machinery adds per frame comes straight off its throughput. "compute" is the part of that CPU
spent in the stages' forward and backward (their threads' CPU time): what the rows add beyond
the one-process row's CPU, less what compute itself grew by, is the machinery's. "cut ideal"
is the bubble 1F1B would leave with free links and these stages' measured compute
(``schedule.ideal_bubble``): above the 1F1B ideal by the cut's imbalance alone.
The launcher gives each stage process its own core (processes share cores round robin when
there are more of them than cores); ``--no-pin`` leaves placement to the OS, for comparison.

On a small CPU host the processes share the cores, so more stages cannot be faster here;
what the rows show is the cost of the pipeline machinery (frames, control all-gathers,
schedule stalls) for a given model size.
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import psutil
import torch

from fusionllm.common.cpus import available_cores
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.launcher import run_swarm
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.schedule import ideal_bubble
from fusionllm.node.pipeline.train_config import TrainConfig

_WARMUP_STEPS = 3


def _config(args: argparse.Namespace, stages: int) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        stages=stages,
        micro_batches=args.micro_batches,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        seed=0,
        cuts=tuple(args.cuts) if args.cuts and stages == len(args.cuts) + 1 else None,
    )


def bench_local(args: argparse.Namespace, dataset: TokenDataset) -> dict:
    config = _config(args, 1)
    times: list[float] = []
    last = [0.0]
    meter = _CpuMeter(config.steps, cpu_now=time.process_time)

    def on_step(step: int, _loss: float) -> None:
        now = time.perf_counter()
        if step > 0:
            times.append(now - last[0])
        last[0] = now
        meter.on_step({"step": step})

    last[0] = time.perf_counter()
    run = train_local(config, dataset=dataset, on_step=on_step)
    step_s = statistics.median(times[_WARMUP_STEPS - 1 :] or times)
    return {
        "name": "local",
        "stages": 1,
        "processes": 1,
        "step_s": step_s,
        "tokens_per_s": config.tokens_per_step / step_s,
        "bubble": 0.0,
        "ideal_bubble": 0.0,
        "cut_ideal_bubble": 0.0,
        "compute_cpu_s_per_step": math.nan,  # all of the row's CPU is compute and the update
        "final_loss": run.losses[-1],
        "cpu_s_per_step": meter.per_step()[0],
        "cores_busy": math.nan,  # one process on one torch thread: one core at most
    }


def _children_cpu_s() -> float:
    """CPU seconds (user + system, all threads) of this process's children so far."""
    cpu = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # one that just exited
            cpu += sum(child.cpu_times()[:2])
    return cpu


class _CpuMeter:
    """CPU seconds from the end of the warm-up (step ``_WARMUP_STEPS - 1``) to the end of the
    last step: what a row costs, beside the wall time it takes."""

    def __init__(self, steps: int, cpu_now: Callable[[], float] = _children_cpu_s) -> None:
        self.first_step, self.last_step = min(_WARMUP_STEPS - 1, steps - 2), steps - 1
        self._cpu_now = cpu_now
        self.marks: dict[int, tuple[float, float]] = {}  # step: (wall, CPU s)

    def on_step(self, event: dict) -> None:
        if event["step"] in (self.first_step, self.last_step):
            self.marks[event["step"]] = (time.perf_counter(), self._cpu_now())

    def per_step(self) -> tuple[float, float]:
        """(CPU seconds per step, the share of all cores' time they took); NaN if unmeasured."""
        if len(self.marks) < 2:
            return math.nan, math.nan
        (wall0, cpu0), (wall1, cpu1) = self.marks[self.first_step], self.marks[self.last_step]
        steps = self.last_step - self.first_step
        return (cpu1 - cpu0) / steps, (cpu1 - cpu0) / ((wall1 - wall0) * len(available_cores()))


def bench_pipeline(args: argparse.Namespace, stages: int) -> dict:
    config = _config(args, stages)
    meter = _CpuMeter(config.steps)
    result = run_swarm(
        config, threads=args.threads, pin_cores=not args.no_pin, on_step=meter.on_step
    )
    cpu_s, cores_busy = meter.per_step()
    by_step: dict[int, list[dict]] = {}
    for event in result.steps:
        by_step.setdefault(event["step"], []).append(event)
    measured = [s for s in sorted(by_step) if s >= _WARMUP_STEPS] or sorted(by_step)
    step_times, bubbles, cut_bubbles, compute_cpu = [], [], [], []
    m = config.micro_batches
    for step in measured:
        events = by_step[step]
        wall = max(e["seconds"] for e in events)
        step_times.append(wall)
        bubbles.append(1.0 - sum(e["busy_s"] for e in events) / (len(events) * wall))
        cut_bubbles.append(ideal_bubble([e["busy_s"] for e in events], m))
        compute_cpu.append(sum(e["busy_cpu_s"] for e in events))
    step_s = statistics.median(step_times)
    return {
        "name": f"{stages} stages",
        "stages": stages,
        "processes": len(result.done),
        "step_s": step_s,
        "tokens_per_s": config.tokens_per_step / step_s,
        "bubble": statistics.median(bubbles),
        "ideal_bubble": (stages - 1) / (m + stages - 1),
        "cut_ideal_bubble": statistics.median(cut_bubbles),
        "compute_cpu_s_per_step": statistics.median(compute_cpu),
        "final_loss": result.losses[-1],
        "bytes_out_per_step": sum(d["bytes_out"] for d in result.done) / config.steps,
        "cpu_s_per_step": cpu_s,
        "cores_busy": cores_busy,
    }


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def _targets(rows: list[dict]) -> dict:
    """The issue's three ratios: 2 stages vs one process, bubble vs 1F1B ideal, 4 vs 2."""
    by_stages = {row["stages"]: row for row in rows if row["name"] != "local"}
    local = rows[0]["tokens_per_s"]
    out: dict = {"lines": [""]}
    two, four = by_stages.get(2), by_stages.get(4)
    if two is not None:
        out["speedup_2"] = two["tokens_per_s"] / local
        out["bubble_over_ideal_2"] = two["bubble"] / two["ideal_bubble"]
        out["bubble_over_cut_ideal_2"] = two["bubble"] / two["cut_ideal_bubble"]
        out["lines"] += [
            f"2 stages / one process: {out['speedup_2']:.2f}x (target >= 1.4x)",
            f"2 stages bubble / 1F1B ideal: {out['bubble_over_ideal_2']:.2f}x (target <= 1.5x)",
            f"  (the cut's own ideal is {two['cut_ideal_bubble']:.1%}: this cut's stages alone "
            f"leave {two['cut_ideal_bubble'] / two['ideal_bubble']:.2f}x the 1F1B ideal; "
            f"the measured bubble is {out['bubble_over_cut_ideal_2']:.2f}x the cut's)",
        ]
    if two is not None and four is not None:
        out["four_over_two"] = four["tokens_per_s"] / two["tokens_per_s"]
        out["lines"].append(f"4 stages / 2 stages: {out['four_over_two']:.2f}x (target >= 1.0x)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--no-pin", action="store_true", help="let the OS move stage processes between cores"
    )
    parser.add_argument(
        "--cuts", type=int, nargs="+", help="node positions for the row with one more stage"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dataset = TokenDataset.from_stdlib(max_bytes=_config(args, 1).stdlib_bytes)
    rows = [bench_local(args, dataset)]
    for stages in args.stages:
        rows.append(bench_pipeline(args, stages))
    tokens = _config(args, 1).tokens_per_step
    print(
        f"GPT-2 {args.model}, {args.micro_batches} micro-batches x {args.batch_size} x "
        f"{args.seq_len} tokens = {tokens} tokens/step, {args.steps} steps "
        f"(first {_WARMUP_STEPS} are warm-up), {os.cpu_count()} CPU cores, loopback\n"
    )
    print(
        f"{'run':<10} {'step ms':>8} {'tokens/s':>9} {'bubble':>7} {'1F1B ideal':>10} "
        f"{'cut ideal':>9} {'CPU ms/step':>11} {'compute':>7} {'cores busy':>10} {'loss':>6}"
    )
    for row in rows:
        compute_ms = row["compute_cpu_s_per_step"] * 1e3
        compute = "-" if math.isnan(compute_ms) else f"{compute_ms:.1f}"
        print(
            f"{row['name']:<10} {row['step_s'] * 1e3:8.1f} {row['tokens_per_s']:9.0f} "
            f"{row['bubble']:7.1%} {row['ideal_bubble']:10.1%} {row['cut_ideal_bubble']:9.1%} "
            f"{row['cpu_s_per_step'] * 1e3:11.1f} {compute:>7} "
            f"{_share(row['cores_busy']):>10} {row['final_loss']:6.3f}"
        )
    targets = _targets(rows)
    for line in targets["lines"]:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows, "targets": targets}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
