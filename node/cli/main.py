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
    config = TrainConfig(
        model=args.model,
        stages=args.stages,
        replicas=tuple(args.replicas) if args.replicas else None,
        micro_batches=args.micro_batches,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        data_path=args.data,
        data_dtype=args.data_dtype,
        vocab_size=args.vocab_size,
        activation_ratios=ratio if args.topk_activations else (),
        gradient_ratios=ratio,
        gradient_codec=args.gradient_codec,
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


def _cmd_node(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    from fusionllm.dht.records import DeviceInfo
    from fusionllm.node.control.daemon import NodeConfig, NodeDaemon
    from fusionllm.node.control.swarm_settings import SwarmSettings

    settings = SwarmSettings(
        swarm=args.swarm,
        model=args.model,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        max_stages=args.max_stages,
        max_replicas=args.max_replicas,
        heartbeat_s=args.heartbeat,
        ttl_s=args.ttl,
        epoch_s=args.epoch,
    )
    device = None
    if args.device_json:
        try:
            device = DeviceInfo(**json.loads(Path(args.device_json).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise FusionError(f"--device-json {args.device_json}: {exc}") from exc
    config = NodeConfig(
        settings=settings,
        key_path=Path(args.key).expanduser(),
        bootstrap=tuple(args.bootstrap or ()),
        listen_host=args.host,
        dht_port=args.dht_port,
        control_port=args.port,
        probe_interval_s=args.probe_interval,
        probe_fanout=args.probe_fanout,
        probe_bytes=int(args.probe_kib * 1024),
        device=device,
        uplink=args.uplink_mbps * 125_000 if args.uplink_mbps else None,
        downlink=args.downlink_mbps * 125_000 if args.downlink_mbps else None,
    )

    def on_event(event: dict) -> None:
        if args.events:
            print(json.dumps(event), flush=True)
        elif event["event"] == "ready":
            print(f"node {event['peer_id']} joined swarm {settings.swarm}", flush=True)
            print(f"  others can bootstrap from: {' '.join(event['dht_addrs'])}", flush=True)
        elif event["event"] == "epoch" and event["changed"]:
            print(
                f"epoch {event['epoch']}: plan {event['digest'][:12]} with "
                f"{len(event['stages'])} stages, {len(event['backup'])} in backup, "
                f"{len(event['members'])} members; this node: {event['state']}",
                flush=True,
            )

    daemon = NodeDaemon(config, on_event=on_event)
    # SIGTERM (docker stop, kill) leaves the swarm politely, like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
    daemon.start()
    try:
        daemon.run(duration_s=args.duration)
    except KeyboardInterrupt:
        pass
    finally:
        daemon.leave()
        daemon.close()
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
        help="train GPT-2 in a local swarm of stage processes on 127.0.0.1",
        description="Starts one process per pipeline stage (and replica) on this machine, "
        "connected over the real transport, and trains a byte-level GPT-2 on the Python "
        "standard library's source (or your token file). Ctrl-C stops every process.",
    )
    train.add_argument(
        "--model",
        default="tiny",
        help="GPT-2 preset: tiny, small, medium, large, xl (default: %(default)s)",
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
    train.add_argument(
        "--steps", type=int, default=200, help="optimizer steps (default: %(default)s)"
    )
    train.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="micro-batches per step, scheduled 1F1B (default: %(default)s)",
    )
    train.add_argument(
        "--batch-size", type=int, default=4, help="per micro-batch (default: %(default)s)"
    )
    train.add_argument(
        "--seq-len", type=int, default=64, help="tokens per sequence (default: %(default)s)"
    )
    train.add_argument(
        "--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)"
    )
    train.add_argument(
        "--seed", type=int, default=0, help="model init and data order (default: %(default)s)"
    )
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
        "--gradient-codec",
        choices=["topk", "ternary"],
        default="topk",
        help="gradient code on compressed links, with error feedback (default: %(default)s)",
    )
    train.add_argument(
        "--every", type=int, default=10, help="print every N steps (default: %(default)s)"
    )
    train.add_argument("--json", action="store_true", help="one JSON line per step")
    train.set_defaults(handler=_cmd_train)

    node = commands.add_parser(
        "node",
        help="run a node: join a swarm over the DHT, measure links, agree on plans",
        description="Joins (or starts, without --bootstrap) a swarm: publishes this node's "
        "signed record on the DHT, measures bandwidth to a sample of peers and gossips it, and "
        "every epoch proposes and adopts the swarm's plan with the other nodes (no "
        "coordinator). Nodes not in the plan wait in the backup pool. Every node of a swarm "
        "must use the same model/batch/timing options. Ctrl-C or SIGTERM leaves politely.",
    )
    _add_swarm_options(node)
    node.add_argument(
        "--bootstrap",
        nargs="+",
        metavar="MADDR",
        help="DHT multiaddr(s) of any node in the swarm (printed by that node); omit to "
        "start a new swarm",
    )
    node.add_argument(
        "--key",
        default="~/.fusionllm/identity.key",
        help="identity key file, created (mode 0600) if missing (default: %(default)s)",
    )
    node.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    node.add_argument("--port", type=int, default=0, help="control/data port (default: free)")
    node.add_argument("--dht-port", type=int, default=0, help="DHT port (default: free)")
    node.add_argument("--model", default="tiny", help="GPT-2 preset (default: %(default)s)")
    node.add_argument("--seq-len", type=int, default=64, help="(default: %(default)s)")
    node.add_argument("--batch-size", type=int, default=8, help="per step (default: %(default)s)")
    node.add_argument("--micro-batches", type=int, default=4, help="(default: %(default)s)")
    node.add_argument("--max-stages", type=int, default=8, help="(default: %(default)s)")
    node.add_argument(
        "--max-replicas",
        type=int,
        default=64,
        help="data-parallel replicas per stage at most (default: %(default)s)",
    )
    node.add_argument(
        "--heartbeat", type=float, default=5.0, help="record refresh, s (default: %(default)s)"
    )
    node.add_argument(
        "--ttl",
        type=float,
        default=15.0,
        help="record lifetime after the last heartbeat, s; a node that missed 3 heartbeats "
        "is already treated as gone (default: %(default)s)",
    )
    node.add_argument(
        "--epoch", type=float, default=10.0, help="plan epoch, s (default: %(default)s)"
    )
    node.add_argument(
        "--probe-interval",
        type=float,
        default=10.0,
        help="s between probe rounds (default: %(default)s)",
    )
    node.add_argument(
        "--probe-fanout", type=int, default=3, help="peers probed per round (default: %(default)s)"
    )
    node.add_argument(
        "--probe-kib", type=float, default=1024, help="bytes per probe, KiB (default: %(default)s)"
    )
    node.add_argument(
        "--uplink-mbps", type=float, help="advertise this uplink instead of measuring"
    )
    node.add_argument("--downlink-mbps", type=float, help="advertise this downlink")
    node.add_argument(
        "--device-json",
        help="advertise this device (JSON of fusionllm.dht.records.DeviceInfo fields) instead "
        "of measuring it",
    )
    node.add_argument("--duration", type=float, help="leave after this many seconds")
    node.add_argument("--events", action="store_true", help="print events as JSON lines")
    node.set_defaults(handler=_cmd_node)

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
