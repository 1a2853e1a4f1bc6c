"""``fusionllm status``: what a swarm looks like from its DHT, without joining it."""

import argparse
import json

from fusionllm.node.cli.options import add_swarm_address


def add_parser(commands) -> None:
    status = commands.add_parser(
        "status",
        help="show a swarm: peers, devices, measured links, fences, stages, backups",
        description="Reads the swarm's records from the DHT as a client (it joins nothing "
        "and stores nothing) and prints what the nodes published and the plan most of them "
        "follow.",
    )
    add_swarm_address(status, joining=False)
    status.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="give up after this many s (default: %(default)s)",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from fusionllm.node.control.status import format_status, gather

    status = gather(args.bootstrap, args.swarm, timeout_s=args.timeout)
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0
