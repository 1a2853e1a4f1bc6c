"""Workload estimator vs measurement: forward+backward time of GPT-2 stages on this machine.

    python benchmarks/estimator.py [--models tiny small] [--stages 4] [--repeats 3] [--json PATH]

The device profile comes from the node's own probe (a matmul, element-wise and tiny layers, as
a node measures itself when it joins); every stage is then run for real (forward, then backward
from ones) and timed, and the estimate is compared with the median measurement.
"""

import argparse
import itertools
import json
import statistics
import sys
import time

import torch

from fusionllm.dag import trace
from fusionllm.dag.cost import DeviceProfile, estimate_stage_time
from fusionllm.dag.models import gpt2
from fusionllm.node.control.probe import ProbeConfig, measure_device

SHAPES = {"tiny": (8, 64), "small": (1, 128), "medium": (1, 64)}


def even_stages(node_ids: tuple[str, ...], count: int) -> list[tuple[str, ...]]:
    bounds = [round(i * len(node_ids) / count) for i in range(count + 1)]
    return [node_ids[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def time_stage(module, inputs: dict, repeats: int) -> float:
    leaves = {name: t.detach().requires_grad_(t.is_floating_point()) for name, t in inputs.items()}

    def step() -> None:
        outputs = [v for v in module(leaves).values() if v.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(v) for v in outputs])

    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_model(name: str, stage_count: int, device: DeviceProfile, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    model = gpt2(name)
    batch, seq = SHAPES[name]
    idx = torch.randint(0, model.config.vocab_size, (batch, seq))  # (B, T)
    graph = trace(model, (idx,))
    rows = []
    for count in sorted({1, stage_count}):
        env = {graph.input_names[0]: idx}
        for position, ids in enumerate(even_stages(graph.node_ids, count)):
            module = graph.stage_module(ids)
            inputs = {n: env[n] for n in graph.stage_inputs(ids)}
            measured = time_stage(module, inputs, repeats)
            with torch.no_grad():
                env.update(module(inputs))
            estimate = estimate_stage_time([graph.node(i) for i in ids], device).total
            rows.append(
                {
                    "model": name,
                    "batch": [batch, seq],
                    "stages": count,
                    "stage": position,
                    "nodes": len(ids),
                    "estimated_s": estimate,
                    "measured_s": measured,
                    "error": estimate / measured - 1,
                }
            )
            print(f"{name} {count} stages: stage {position} done", file=sys.stderr)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], choices=list(SHAPES))
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    measurement = measure_device("cpu", ProbeConfig(matmul_size=1024, repeats=7))
    device = DeviceProfile(
        name=measurement.device_name,
        flops=measurement.flops,
        memory_bandwidth=measurement.memory_bandwidth,
        memory_bytes=measurement.memory_bytes,
        op_overhead=measurement.op_overhead,
    )
    rows = [r for m in args.models for r in measure_model(m, args.stages, device, args.repeats)]
    print(
        f"device {device.name}: {device.flops / 1e9:.1f} GFLOP/s (fp32 matmul), "
        f"{device.memory_bandwidth / 1e9:.1f} GB/s element-wise, "
        f"{device.op_overhead * 1e6:.1f} us per op and pass, {torch.get_num_threads()} threads\n"
    )
    print(
        f"{'model':<7} {'B x T':>8} {'stages':>6} {'stage':>5} {'nodes':>5} "
        f"{'est ms':>9} {'meas ms':>9} {'error':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:<7} {r['batch'][0]:>3} x {r['batch'][1]:<4} {r['stages']:>6} "
            f"{r['stage']:>5} {r['nodes']:>5} {1e3 * r['estimated_s']:>9.2f} "
            f"{1e3 * r['measured_s']:>9.2f} {100 * r['error']:>+6.1f}%"
        )
    median_error = statistics.median(abs(r["error"]) for r in rows)
    print(f"\nmedian |error| over {len(rows)} stages: {100 * median_error:.1f}% (target <= 25%)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"device": vars(measurement), "rows": rows, "median_abs_error": median_error},
                out,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
