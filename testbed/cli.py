"""``fusionllm-testbed`` (or ``python -m fusionllm.testbed``): the emulated WAN by hand."""

import argparse
import signal
import sys
import time

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import configure_logging


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt  # SIGTERM tears down like Ctrl-C


def _check(_args: argparse.Namespace) -> int:
    from fusionllm.testbed.bed import unavailable

    reason = unavailable()
    print(f"testbed unavailable: {reason}" if reason else "testbed available")
    return 1 if reason else 0


def _show(args: argparse.Namespace) -> int:
    from fusionllm.testbed.topology import load_topology

    topo = load_topology(args.topology)
    print(f"topology {topo.name}: {topo.description}")
    for host in topo.hosts:
        print(
            f"  host {host.name:8} site {host.site or '-':6} cpu {host.cpu or 'all'!s:5} "
            f"up {host.uplink_mbps or '-'!s:>6} Mbit/s  down {host.downlink_mbps or '-'!s:>6}"
            + (f"  behind a {host.nat} NAT" if host.nat else "")
        )
    for (src, dst), link in sorted(topo.links.items()):
        print(
            f"  {src:>8} -> {dst:8} delay {link.delay_ms:6.2f} ms  rate "
            f"{link.rate_mbps or '-'!s:>6} Mbit/s  loss {link.loss:.3f}  "
            f"path cap {topo.path_rate_mbps(src, dst) or '-'}"
        )
    return 0


def _up(args: argparse.Namespace) -> int:
    from fusionllm.testbed.bed import Testbed
    from fusionllm.testbed.topology import load_topology

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with Testbed(load_topology(args.topology)) as bed:
            processes = [
                bed.popen(h, [a.format(host=h, addr=bed.address(h)) for a in command])
                for h in bed.hosts
                if command
            ]
            hosts = " ".join(_where(bed, h) for h in bed.hosts)
            print(f"testbed {bed.tag} up: {hosts}", flush=True)
            print(f"  a shell in a host: ip netns exec {bed.netns(bed.hosts[0])} bash", flush=True)
            print("  Ctrl-C tears it all down", flush=True)
            while not processes or any(p.poll() is None for p in processes):
                time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    return 0


def _where(bed, host: str) -> str:
    if not bed.nat(host):
        return f"{host}={bed.address(host)}"
    return f"{host}={bed.address(host)}(behind a {bed.nat(host)} NAT at {bed.wan_address(host)})"


def _clean(_args: argparse.Namespace) -> int:
    from fusionllm.testbed.bed import sweep_stale

    removed = sweep_stale()
    print("\n".join(removed) if removed else "nothing left behind by a dead testbed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fusionllm-testbed",
        description="An emulated WAN on this machine: every host of a topology in its own "
        "network namespace, behind links with delay, rate caps and loss (a userspace emulator "
        "over TUN devices), with its own CPU share. Needs root.",
    )
    parser.add_argument("--log-level", default="WARNING", help="(default: %(default)s)")
    commands = parser.add_subparsers(dest="what", required=True)
    commands.add_parser("check", help="can a testbed run here? (exit 1 and why, if not)")
    show = commands.add_parser("show", help="print a topology's hosts and links")
    up = commands.add_parser(
        "up",
        help="set a topology up, run a command in every host, tear down on Ctrl-C",
        description="Sets the topology up and prints each host's address. With a COMMAND, "
        "runs it in every host ({host} and {addr} in it become the host's name and address; "
        "a host behind NAT binds its LAN address) "
        "and tears down when all have exited; without, waits for Ctrl-C or SIGTERM.",
    )
    for sub in (show, up):
        sub.add_argument("topology", help="A, B, C, mini, or a .toml/.json file")
    up.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    commands.add_parser("clean", help="remove what testbeds killed with SIGKILL left behind")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    handler = {"check": _check, "show": _show, "up": _up, "clean": _clean}[args.what]
    try:
        return handler(args)
    except FusionError as exc:
        print(f"fusionllm-testbed: {exc}", file=sys.stderr)
        return 2
