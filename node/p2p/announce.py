"""What a node tells peers to dial: its announced addresses, not the ones it listens on.

Behind a port forward (``docker run -p A:B``, a home router, a cloud VM's public IP) the
address a node binds is not the one peers can reach. ``--announce-addr HOST[:PORT]`` names
the reachable one; each plane announces it with its own port: the py-libp2p host (records'
``addrs``) with PORT (default: the port it bound), the DHT (hivemind's ``announce_maddrs``)
and lanes (the port a lane offer names) with their own announced ports.
"""

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.node.p2p.checks import int_in, ip_address


@dataclass(frozen=True, kw_only=True)
class AnnounceAddr:
    """A reachable IP and, optionally, the port that reaches this plane's listener."""

    host: str
    port: int | None = None  # None: the port the plane bound

    def __post_init__(self) -> None:
        ip_address("announce address", self.host)
        if self.port is not None:
            int_in("announce port", self.port, 1, 65535)

    @classmethod
    def parse(cls, text: str) -> "AnnounceAddr":
        """``1.2.3.4``, ``1.2.3.4:4001``, ``::1`` or ``[::1]:4001``; ConfigError otherwise."""
        host, port = text.strip(), None
        if host.startswith("["):  # [IPv6]:PORT
            inside, bracket, rest = host[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise ConfigError(f"announce address {text!r}: expected [IPv6]:PORT")
            host, port = inside, rest[1:] or None
        elif host.count(":") == 1:  # IPv4:PORT (a bare IPv6 has several colons)
            host, port = host.split(":")
        try:
            number = None if port is None else int(port)
        except ValueError:
            raise ConfigError(f"announce address {text!r}: port {port!r} is not a number") from None
        return cls(host=host, port=number)

    def multiaddr(self, port: int) -> str:
        """``/ip4/HOST/tcp/PORT``: this address with its own port, else ``port``."""
        family = "ip6" if ipaddress.ip_address(self.host).version == 6 else "ip4"
        return f"/{family}/{self.host}/tcp/{self.port or port}"

    @property
    def public(self) -> bool:
        return ipaddress.ip_address(self.host).is_global


def announced_multiaddrs(addrs: Sequence[AnnounceAddr], port: int) -> tuple[str, ...]:
    """Each address as a multiaddr, with ``port`` where it names none (ConfigError if 0)."""
    if addrs and not all(a.port for a in addrs):
        int_in("announced port", port, 1, 65535)
    return tuple(dict.fromkeys(a.multiaddr(port) for a in addrs))


def bootstrap_is_public(maddrs: Iterable[str]) -> bool:
    """Whether any bootstrap multiaddr names a public IP (``/ip4/8.8.8.8/...``)."""
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            try:
                if ipaddress.ip_address(parts[2]).is_global:
                    return True
            except ValueError:
                continue
    return False


def warn_if_unreachable(
    logger: logging.Logger, advertised: Sequence[str], bootstrap: Iterable[str]
) -> bool:
    """Warn (and say True) when every advertised IP is private but a bootstrap peer is public:
    the swarm's other nodes are out there and cannot dial this one back."""
    ips = [ipaddress.ip_address(host) for host in advertised]
    if any(ip.is_unspecified for ip in ips):  # 0.0.0.0: every interface, maybe a public one
        return False
    if not any(ip.is_global for ip in ips) and bootstrap_is_public(bootstrap):
        logger.warning(
            "this node advertises only private addresses (%s) but its bootstrap peers are "
            "public: peers will not reach it; give --announce-addr with this machine's public "
            "IP (and forward the ports)",
            ", ".join(advertised),
        )
        return True
    return False
