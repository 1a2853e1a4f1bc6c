"""The per-frame cost the planner charges (issue 25): CPU seconds one side pays per tensor frame.

    python -m benchmarks.frame_cost [--rounds 5] [--json PATH]

Topology C's estimate was 0.58x of the measured step, about 0.18 s a step of work the
estimator did not model. A frame costs its sender pack + seal + write and its receiver read +
open + check + decode; ``node/control/frame_cost.py`` times frames of tiny's activation, (8, 64,
64) fp32, through a lane over a socket pair in one thread and halves the round. Here that
measure runs ``--rounds`` times, alternating dense frames (what a node caches and advertises)
and top-k frames (AdaTopK at the ratio C's plans used, ~0.6), one torch thread, and the
table sets the medians against the 0.18 s: how much of it frames on a 2-stage, 4-micro-batch
plan (8 frames a stage touches per step) explain at a 0.4-core host's pace (x2.5).
A third row is what the node now advertises: a dense frame's CPU beside compute, over loopback
TCP and a reader thread (``node/control/frame_beside.py``, session 19).
"""

import argparse
import json
import statistics
import sys

import torch

from fusionllm.node.control.frame_beside import measure_frame_beside_compute
from fusionllm.node.control.frame_cost import FrameProbeConfig, measure_frame_overhead

GAP_S = 0.18  # per step, topology C (docs/results.md)
FRAMES_PER_STEP = 8  # a stage of a 2-stage plan, 4 micro-batches: 4 activations + 4 gradients
PACE = 2.5  # a 0.4-core host


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = {
        "dense": lambda: measure_frame_overhead(FrameProbeConfig()),
        "topk 0.6": lambda: measure_frame_overhead(FrameProbeConfig(topk_ratio=0.6)),
        "dense beside compute": measure_frame_beside_compute,
    }
    figures: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.rounds):  # alternating, so the machine's load falls on all alike
        for name, measure in kinds.items():
            figures[name].append(measure())
    print(
        "| frame | per side, ms (median; min-max) | per step at 0.4 core, s | of the 0.18 s gap |"
    )
    print("|---|---|---|---|")
    rows = {}
    for name, values in figures.items():
        median = statistics.median(values)
        per_step = median * FRAMES_PER_STEP * PACE
        rows[name] = {"per_side_s": values, "median_s": median, "per_step_s": per_step}
        print(f"| {name} | {median * 1e3:.2f} ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})"
              f" | {per_step:.3f} | {per_step / GAP_S:.0%} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rounds": args.rounds, "gap_s": GAP_S, "frames": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
