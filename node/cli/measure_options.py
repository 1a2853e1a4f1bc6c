"""``fusionllm node``'s options about this machine: its compute, its links and its device."""

import argparse
import json
from pathlib import Path

from fusionllm.common.errors import FusionError


def add_compute_options(node: argparse.ArgumentParser) -> None:
    node.add_argument(
        "--threads", type=int, help="torch threads for compute (default: torch's choice)"
    )
    node.add_argument(
        "--pin-cores",
        action="store_true",
        help="while training, compute on cores picked by this node's place in the plan (the "
        "k-th process takes the k-th block of --threads cores): for several nodes on one "
        "machine, which then train on different cores (fusionllm swarm sets it)",
    )


def add_probe_options(node: argparse.ArgumentParser) -> None:
    group = node.add_argument_group("links and device")
    group.add_argument(
        "--probe-interval", type=float, default=10.0, help="s between probe rounds (%(default)s)"
    )
    group.add_argument(
        "--probe-fanout",
        type=int,
        default=3,
        help="peers probed per round at most (%(default)s); probes never take more than a "
        "tenth of the uplink's time, and links that training frames keep busy are not probed",
    )
    group.add_argument(
        "--probe-kib", type=float, default=1024, help="bytes per probe, KiB (%(default)s)"
    )
    group.add_argument("--uplink-mbps", type=float, help="advertise this uplink, not measured")
    group.add_argument("--downlink-mbps", type=float, help="advertise this downlink")
    group.add_argument(
        "--device-json",
        help="advertise this device (JSON of fusionllm.dht.records.DeviceInfo fields) instead "
        "of measuring it",
    )
    group.add_argument(
        "--rehearse-s",
        type=float,
        default=1.5,
        help="at start, time this many seconds of real training steps of the run's first stage "
        "on this machine; the swarm plans this node's own work from them until its steps "
        "measure it (%(default)s; 0: plan on the device's figures alone)",
    )


def device_of(args: argparse.Namespace):
    """The device ``--device-json`` advertises (a DeviceInfo), or None: measure this machine."""
    if not args.device_json:
        return None
    from fusionllm.dht.records import DeviceInfo

    try:
        return DeviceInfo(**json.loads(Path(args.device_json).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise FusionError(f"--device-json {args.device_json}: {exc}") from exc
