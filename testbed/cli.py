"""``fusionllm-testbed`` (or ``python -m fusionllm.testbed``): the emulated WAN by hand."""

import argparse
import contextlib
import faulthandler
import signal
import sys
import time
from collections.abc import Iterator

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import configure_logging


class _Stop:
    """Set by SIGINT or SIGTERM: a plain flag (an Event's lock, taken in a handler while the
    main thread holds it, would deadlock)."""

    def __init__(self) -> None:
        self.asked = False

    def __call__(self, *_: object) -> None:
        self.asked = True


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[_Stop]:
    """A flag that SIGINT and SIGTERM set, for as long as the block runs.

    SIGINT gets a handler of its own: a process started as a background job of a script
    inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it, so Ctrl-C
    (``kill -INT``) was dropped and the testbed stayed up. The handler only sets a flag:
    an exception raised from it could land anywhere in the setup or teardown, e.g. between
    ``Popen.poll``'s lock acquire and its ``try``, which leaves the lock held and every later
    wait on that process running out. A second signal during teardown changes nothing.
    """
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_for_end(processes: list, stop: _Stop, poll_s: float = 0.2) -> None:
    """Until ``stop`` is asked or every process has exited (with none, only ``stop`` ends it)."""
    while not stop.asked:
        if processes and all(p.poll() is not None for p in processes):
            return
        time.sleep(poll_s)


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
    faulthandler.register(signal.SIGUSR1)  # kill -USR1: every thread's stack on stderr
    with _stop_on_signals() as stop, Testbed(load_topology(args.topology)) as bed:
        if stop.asked:  # a Ctrl-C during the setup: nothing to run
            print(f"testbed {bed.tag} interrupted while coming up: tearing down", flush=True)
            return 0
        processes = [
            bed.popen(h, [a.format(host=h, addr=bed.address(h)) for a in command])
            for h in bed.hosts
            if command
        ]
        hosts = " ".join(_where(bed, h) for h in bed.hosts)
        print(f"testbed {bed.tag} up: {hosts}", flush=True)
        print(f"  a shell in a host: ip netns exec {bed.netns(bed.hosts[0])} bash", flush=True)
        print("  Ctrl-C tears it all down", flush=True)
        _wait_for_end(processes, stop)
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
