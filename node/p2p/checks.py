"""Value checks shared by the p2p configs and calls: one wording, one set of bounds."""

import functools
import ipaddress
import math
import socket

from libp2p.peer.id import ID

from fusionllm.common.errors import ConfigError
from fusionllm.node.errors import TransportError


def positive_seconds(name: str, value: float, *, allow_inf: bool = False) -> None:
    """A deadline: a positive number, finite unless ``allow_inf`` (bools are refused)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and value > 0 and (allow_inf or math.isfinite(value))):
        raise ConfigError(f"{name} must be a positive finite number of seconds, got {value!r}")


def positive_rate(name: str, value: float) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive finite rate, got {value!r}")


def int_in(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def boolean(name: str, value: bool) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool, got {value!r}")


def ip_address(name: str, value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(value)
    except ValueError as exc:
        raise ConfigError(f"{name} must be an IP address, got {value!r}") from exc


def address_family(name: str, value: str) -> socket.AddressFamily:
    """The socket family of an IP address (ConfigError if ``value`` is not one)."""
    return socket.AF_INET6 if ip_address(name, value).version == 6 else socket.AF_INET


def parse_peer_id(peer: str) -> ID:
    """A base58 peer id from a caller; ValueError (the caller's mistake) if it is not one."""
    if not isinstance(peer, str):
        raise ValueError(f"not a peer id: {peer!r}")
    return _parse_peer_id(peer)


# Every send checks its peer id, and base58 decoding was ~7% of a sender's GIL time.
@functools.lru_cache(maxsize=1024)
def _parse_peer_id(peer: str) -> ID:
    try:
        if not peer:
            raise ValueError("empty")
        return ID.from_base58(peer)
    except Exception as exc:  # base58 and multihash raise assorted types
        raise ValueError(f"not a peer id: {peer!r}") from exc


def check_port_free(host: str, port: int) -> None:
    """Refuse a fixed port another process listens on.

    py-libp2p listens with SO_REUSEPORT, so a second node on the same port starts without
    error and the kernel then splits incoming connections between the two nodes. A plain
    bind (no SO_REUSEPORT) fails while any socket holds the port.
    """
    with socket.socket(address_family("listen_host", host), socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR lets the probe bind over TIME_WAIT leftovers of our own last run (a
        # restart), while on Linux it still fails against a live listener.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise TransportError(f"cannot listen on {host}:{port}: {exc}") from exc
