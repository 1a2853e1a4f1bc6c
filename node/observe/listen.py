"""``HOST:PORT`` for the servers a node or ``fusionllm status`` opens (--metrics, --serve)."""

import argparse
import ipaddress

from fusionllm.common.errors import ConfigError

_MAX_HOST = 253  # the longest DNS name


def parse_listen(text: str) -> tuple[str, int]:
    """("127.0.0.1", 9100) from "127.0.0.1:9100"; "[::1]:9100" for IPv6; port 0: a free one.

    ConfigError with what is wrong: no port, a port out of range, an empty or odd host.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9100 or [::1]:9100)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{text!r}: {host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise ConfigError(f"{text!r}: write an IPv6 host in brackets, e.g. [::1]:9100")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{text!r}: the port must be a number from 0 to 65535")
    if len(host) > _MAX_HOST or any(c.isspace() or c in "/@?#" for c in host):
        raise ConfigError(f"{text!r}: {host!r} is not a host name or address")
    return host, int(port_text)


def listen_arg(text: str) -> tuple[str, int]:
    """``parse_listen`` as an argparse ``type``: a bad value is a usage error naming why."""
    try:
        return parse_listen(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def url_of(host: str, port: int, path: str = "/") -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"
