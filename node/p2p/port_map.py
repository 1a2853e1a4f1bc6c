"""Port mappings a home router grants on request (UPnP-IGD): settings, checks and the lease
schedule. Pure; the talking is upnp.py's.

A router's answers are untrusted like a peer's: its external address must be a public unicast
IPv4 (a private or shared one means a second NAT above it: a mapping there reaches nobody
outside), a mapping must lead to this host's LAN address and port, and a lease must be what
was asked or a sane part of it. Anything else is a ``GatewayError``, and the node goes on as
if there were no router to ask (relays). What members can dial is still checked by dial-back
(reachability.py): the router's word never reaches a record.
"""

import ipaddress
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.node.p2p.checks import boolean, int_in

MIN_LEASE_S = 60  # a router granting less would have us renew all the time
MAX_LEASE_S = 7 * 86400
PROTOCOL = "TCP"


class GatewayError(FusionError):
    """No usable router (none answered, it refused, or its answer failed a check)."""


@dataclass(frozen=True, kw_only=True)
class PortMapConfig:
    enabled: bool = True  # --no-upnp: False
    discover_s: float = 2.0  # SSDP wait; a home without UPnP waits this + 1 s (upnp.py)
    lease_s: int = 3600  # what we ask for; renewed at ``renew_fraction`` of what we got
    renew_fraction: float = 0.5
    description: str = "fusionllm"

    def __post_init__(self) -> None:
        boolean("enabled", self.enabled)
        if not (isinstance(self.discover_s, int | float) and 0.1 <= self.discover_s <= 10):
            raise ConfigError(f"discover_s must be in [0.1, 10] s, got {self.discover_s!r}")
        int_in("lease_s", self.lease_s, MIN_LEASE_S, MAX_LEASE_S)
        if not 0.1 <= self.renew_fraction <= 0.9:
            raise ConfigError(f"renew_fraction must be in [0.1, 0.9], got {self.renew_fraction}")
        if not (self.description.isascii() and 0 < len(self.description) <= 64):
            raise ConfigError(f"description {self.description!r}: 1-64 ASCII characters")


@dataclass(frozen=True, kw_only=True)
class PortMapping:
    """One port the router forwards to us: external ``port`` of ``external_ip`` -> our
    ``internal_ip``:``port`` (we ask for the same port on both sides)."""

    port: int
    external_ip: str
    internal_ip: str
    lease_s: int  # granted
    granted_at: float  # monotonic seconds

    def renew_at(self, fraction: float) -> float:
        return renew_at(self.granted_at, self.lease_s, fraction)


def check_port(port: object) -> int:
    if not (isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535):
        raise GatewayError(f"port {port!r} out of range [1, 65535]")
    return port


def check_external_ip(text: object) -> str:
    """The router's external address, if it is one peers on the internet could dial."""
    if not isinstance(text, str) or len(text) > 45:
        raise GatewayError(f"external address {text!r} is not an address")
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        raise GatewayError(f"external address {text!r} is not an address") from None
    if ip.version != 4 or not ip.is_global or ip.is_multicast:
        raise GatewayError(
            f"external address {text} is not a public IPv4 address (a second NAT above the "
            "router, or a router that does not know): a mapping there reaches nobody outside"
        )
    return str(ip)


def check_internal_ip(text: object) -> str:
    """Our LAN address as the router sees it: a private unicast IPv4."""
    try:
        ip = ipaddress.ip_address(text) if isinstance(text, str) else None
    except ValueError:
        ip = None
    if ip is None or ip.version != 4 or not ip.is_private or ip.is_loopback or ip.is_unspecified:
        raise GatewayError(f"LAN address {text!r} is not a private IPv4 address")
    return str(ip)


def check_entry(entry: object, *, port: int, internal_ip: str, asked_s: int) -> int:
    """The router's record of our mapping of ``port`` (miniupnpc's getspecificportmapping:
    (client, port, description, enabled, lease s) or None); the lease it granted."""
    if entry is None:
        raise GatewayError(f"the router says it maps {port} yet lists no such mapping")
    if not (isinstance(entry, tuple) and len(entry) == 5):
        raise GatewayError(f"the router's mapping entry {entry!r} is malformed")
    client, internal_port, _desc, enabled, lease = entry
    if client != internal_ip or internal_port != port or enabled is not True:
        raise GatewayError(
            f"the router maps {port} to {client}:{internal_port} (enabled {enabled}), "
            f"not to {internal_ip}:{port}"
        )
    return check_lease(lease, asked_s)


def check_lease(lease: object, asked_s: int) -> int:
    """A granted lease: 0 (the router's "for ever", which we still renew as if it were the
    lease asked) or MIN_LEASE_S..asked_s."""
    if not (isinstance(lease, int) and not isinstance(lease, bool)):
        raise GatewayError(f"lease {lease!r} is not a number of seconds")
    if lease == 0:
        return asked_s
    if not MIN_LEASE_S <= lease <= asked_s:
        raise GatewayError(f"lease {lease} s outside [{MIN_LEASE_S}, {asked_s}] s")
    return lease


def renew_at(granted_at: float, lease_s: int, fraction: float) -> float:
    """When a lease granted at ``granted_at`` is renewed: ``fraction`` of it later, so that a
    renewal that fails has the rest of the lease to be tried again."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction {fraction} not in (0, 1)")
    return granted_at + lease_s * fraction


def due(mappings: dict[int, PortMapping], now: float, fraction: float) -> list[int]:
    """The ports whose lease is due for renewal at ``now``, in order."""
    return sorted(p for p, m in mappings.items() if m.renew_at(fraction) <= now)
