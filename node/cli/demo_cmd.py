"""``fusionllm demo``: every codec on a gradient-like tensor: size, error, speed."""

import argparse
import json
from dataclasses import asdict


def add_parser(commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="compress a gradient-like tensor with every codec and report size, error, speed",
        description="Round-trips a heavy-tailed tensor through each codec's wire frame and "
        "shows what travels and what is lost; also shows error feedback at work.",
    )
    demo.add_argument("--numel", type=int, default=1 << 22, help="elements (default: %(default)s)")
    demo.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=[0.1, 0.01, 0.001],
        help="top-k ratios to try (default: %(default)s)",
    )
    demo.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from fusionllm.node.cli.demo import DemoConfig, feedback_drift, format_reports, run_demo

    config = DemoConfig(
        numel=args.numel, ratios=tuple(args.ratios), device=args.device, seed=args.seed
    )
    reports = run_demo(config)
    generator = torch.Generator().manual_seed(config.seed + 1)
    drifts = {ratio: feedback_drift(config, ratio, generator) for ratio in config.ratios}
    if args.json:
        print(json.dumps({"codecs": [asdict(r) for r in reports], "feedback_drift": drifts}))
        return 0
    print(
        f"{config.numel:,} gradient-like fp32 values ({config.numel * 4 / 1e6:.1f} MB) "
        f"on {config.device}, each codec round-tripped through a wire frame:\n"
    )
    print(format_reports(reports))
    print(
        f"\nerror feedback over {config.feedback_steps} steps "
        "(|sum sent - sum received| / |sum sent|):"
    )
    for ratio, drift in drifts.items():
        print(f"  top-k ratio {ratio:<6g} {drift:.4f}")
    return 0
