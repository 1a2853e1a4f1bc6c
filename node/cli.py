"""The ``fusionllm`` command line."""

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata

import torch

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import configure_logging, get_logger

logger = get_logger(__name__)


def _version() -> str:
    try:
        return metadata.version("fusionllm")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _cmd_version(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"fusionllm": _version(), "torch": torch.__version__}))
    else:
        print(
            f"fusionllm {_version()} (torch {torch.__version__}, python {sys.version.split()[0]})"
        )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from fusionllm.node.demo import DemoConfig, feedback_drift, format_reports, run_demo

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusionllm",
        description="Peer-to-peer volunteer-computing node: pool GPUs across the internet and "
        "train models together, with no central coordinator.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="how much to log to stderr (default: %(default)s)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    version = commands.add_parser("version", help="print the installed version")
    version.add_argument("--json", action="store_true", help="machine-readable output")
    version.set_defaults(handler=_cmd_version)

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
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except FusionError as exc:
        print(f"fusionllm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
