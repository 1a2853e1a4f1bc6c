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
from fusionllm.node.cli import node_cmd, swarm_cmd
from fusionllm.node.cli.options import add_run_options, run_spec_from

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


def _cmd_train(args: argparse.Namespace) -> int:
    from fusionllm.node.pipeline.launcher import run_swarm
    from fusionllm.node.pipeline.train_config import TrainConfig

    links = args.stages - 1
    ratio = (args.topk_ratio,) * links if args.topk_ratio < 1.0 and links else ()
    run = run_spec_from(args)
    config = TrainConfig(
        model=run.model,
        stages=args.stages,
        replicas=tuple(args.replicas) if args.replicas else None,
        micro_batches=run.micro_batches,
        batch_size=run.micro_batch_size,
        seq_len=run.seq_len,
        steps=run.steps,
        lr=run.lr,
        seed=run.seed,
        data_path=args.data,
        data_dtype=args.data_dtype,
        vocab_size=args.vocab_size,
        activation_ratios=ratio if args.topk_activations else (),
        gradient_ratios=ratio,
        gradient_codec=run.gradient_codec,
    )
    processes = sum(config.stage_replicas)
    if not args.json:
        print(
            f"training GPT-2 {config.model} in {config.stages} stages ({processes} processes on "
            f"127.0.0.1), {config.micro_batches} micro-batches x {config.batch_size} x "
            f"{config.seq_len} tokens per step, data: {config.data_path or 'stdlib source'}",
            flush=True,
        )

    def on_step(event: dict) -> None:
        tokens_per_s = config.tokens_per_step / max(event["seconds"], 1e-9)
        if args.json:
            print(json.dumps({"step": event["step"], "loss": event["loss"],
                              "tokens_per_s": tokens_per_s}), flush=True)  # fmt: skip
        elif event["step"] % args.every == 0 or event["step"] == config.steps - 1:
            print(
                f"step {event['step']:>5}  loss {event['loss']:.4f}  "
                f"grad norm {event['grad_norm']:.3f}  {tokens_per_s:,.0f} tokens/s",
                flush=True,
            )

    # The stages log to this terminal too: only warnings, unless debugging.
    stage_log_level = "DEBUG" if args.log_level == "DEBUG" else "WARNING"
    result = run_swarm(config, on_step=on_step, log_level=stage_log_level)
    if not args.json:
        print(
            f"done: {config.steps} steps in {result.seconds:.1f}s, "
            f"final loss {result.losses[-1]:.4f}"
        )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from fusionllm.node.control.status import format_status, gather

    status = gather(args.bootstrap, args.swarm, timeout_s=args.timeout)
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def _add_swarm_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swarm", default="default", help="swarm name (default: %(default)s)")


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

    train = commands.add_parser(
        "train",
        help="reference run: a launcher starts one stage process each on 127.0.0.1 (no daemons)",
        description="Starts one process per pipeline stage (and replica) on this machine, "
        "connected over the real transport, and trains a byte-level GPT-2 on the Python "
        "standard library's source (or your token file). Ctrl-C stops every process.",
    )
    train.add_argument(
        "--stages",
        type=int,
        default=2,
        help="pipeline stages, a process each (default: %(default)s)",
    )
    train.add_argument(
        "--replicas", type=int, nargs="+", help="data-parallel replicas per stage, e.g. 1 2"
    )
    add_run_options(train)
    train.add_argument("--data", help="uint16/uint32 token file (default: stdlib source bytes)")
    train.add_argument(
        "--data-dtype",
        default="uint16",
        choices=["uint16", "uint32"],
        help="element type of --data (default: %(default)s)",
    )
    train.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="model vocabulary; --data token ids must be below it (default: %(default)s, bytes)",
    )
    train.add_argument(
        "--topk-ratio",
        type=float,
        default=1.0,
        help="top-k ratio on every link's gradients, with error feedback (default: dense)",
    )
    train.add_argument(
        "--topk-activations",
        action="store_true",
        help="compress activations too, within --topk-ratio's bytes (a ternary code of every "
        "element while it fits, else top-k)",
    )
    train.add_argument(
        "--every", type=int, default=10, help="print every N steps (default: %(default)s)"
    )
    train.add_argument("--json", action="store_true", help="one JSON line per step")
    train.set_defaults(handler=_cmd_train)

    node_cmd.add_parser(commands)
    swarm_cmd.add_parser(commands)

    status = commands.add_parser(
        "status",
        help="show a swarm: peers, devices, measured links, fences, stages, backups",
        description="Reads the swarm's records from the DHT as a client (it joins nothing "
        "and stores nothing) and prints what the nodes published and the plan most of them "
        "follow.",
    )
    _add_swarm_options(status)
    status.add_argument(
        "--bootstrap",
        nargs="+",
        required=True,
        metavar="MADDR",
        help="DHT multiaddr(s) of any node in the swarm",
    )
    status.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="give up after this many s (default: %(default)s)",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(handler=_cmd_status)
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
