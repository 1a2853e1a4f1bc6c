"""``fusionllm health``: does the node on this machine answer? (the image's HEALTHCHECK)

It asks the node itself, not a file it wrote: a libp2p listener opens every connection with
the multistream-select header (``/multistream/1.0.0``) before it reads a byte, so a port that
sends it within the timeout is served by a live event loop; a port that accepts and stays
silent is a hung node (the kernel accepts for it). The DHT port is hivemind's daemon and is
checked the same way. Nothing here imports torch or libp2p: a check costs a fraction of a s.
"""

import argparse
import socket
import time

from fusionllm.common.errors import FusionError

# What a libp2p listener writes first: a varint length, then the protocol id and a newline.
MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"


class HealthError(FusionError):
    """The node does not answer on a port it should serve."""


def add_parser(commands) -> None:
    health = commands.add_parser(
        "health",
        help="check that a node on this machine answers on its ports (exit 0) or not (exit 1)",
        description="Connects to a running node's control port (and its DHT port, if given) "
        "and waits for the libp2p greeting each sends first. Exit status 0: the node answers; "
        "1: it does not (the reason goes to stderr). Docker's HEALTHCHECK runs it.",
    )
    health.add_argument("--host", default="127.0.0.1", help="the node's address (%(default)s)")
    health.add_argument("--port", type=int, required=True, help="the node's control port")
    health.add_argument("--dht-port", type=int, help="the node's DHT port (not checked if unset)")
    health.add_argument(
        "--timeout", type=float, default=5.0, help="s to wait per port (default: %(default)s)"
    )
    health.set_defaults(handler=run)


def check_libp2p_port(host: str, port: int, *, timeout_s: float) -> float:
    """Seconds until the listener at ``host:port`` greeted us; HealthError if it did not."""
    if not 0 < port < 65536:
        raise HealthError(f"port {port} is not a TCP port")
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            received = b""
            # The header may come in pieces; it is 20 bytes, so this loop is short.
            while len(received) < len(MULTISTREAM_HEADER):
                left = timeout_s - (time.monotonic() - started)
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                chunk = sock.recv(len(MULTISTREAM_HEADER) - len(received))
                if not chunk:
                    raise HealthError(f"{host}:{port} closed the connection without a greeting")
                received += chunk
    except TimeoutError as exc:
        raise HealthError(f"{host}:{port} sent no libp2p greeting in {timeout_s:g} s") from exc
    except OSError as exc:
        raise HealthError(f"{host}:{port} cannot be reached: {exc}") from exc
    if received != MULTISTREAM_HEADER:
        raise HealthError(f"{host}:{port} answered {received[:40]!r}, not libp2p's greeting")
    return time.monotonic() - started


def run(args: argparse.Namespace) -> int:
    ports = {"control": args.port} | ({"DHT": args.dht_port} if args.dht_port else {})
    for name, port in ports.items():
        took = check_libp2p_port(args.host, port, timeout_s=args.timeout)
        print(f"{name} {args.host}:{port} answers ({took * 1000:.0f} ms)")
    return 0
