"""Asking the home router for port mappings over UPnP-IGD, with ``miniupnpc`` (the MiniUPnP
project's client, the same C library as Bitcoin Core and Transmission use; wheels on PyPI).

Every call is bounded: miniupnpc blocks (SSDP wait, then HTTP/SOAP to the router with its
own socket timeouts), so each runs on a helper thread we stop waiting for after a deadline;
a router that accepts and never answers costs that deadline, never the node. Every answer
goes through port_map.py's checks before use.
"""

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from fusionllm.common.logs import get_logger
from fusionllm.node.p2p.port_map import (
    PROTOCOL,
    GatewayError,
    PortMapConfig,
    PortMapping,
    check_entry,
    check_external_ip,
    check_internal_ip,
    check_port,
)

logger = get_logger(__name__)

CALL_TIMEOUT_S = 5.0  # one SOAP request to a router on the LAN
# miniupnpc searches for 4 device types in turn, each waiting ``discoverdelay`` (measured: 4.0
# and 8.0 s with no router for 1 and 2 s), and stops at the first that answers: each gets a
# quarter of our wait. miniupnpd answered in 1.06 s to a 1 s delay, i.e. at once.
SEARCHES = 4
T = TypeVar("T")


def bounded(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """``call()``'s result, or GatewayError if it raised or took over ``timeout_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except Exception as exc:  # miniupnpc raises bare Exception with the UPnP error text
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"upnp-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise GatewayError(f"{what}: no answer within {timeout_s:.1f} s")
    if "error" in box:
        raise GatewayError(f"{what}: {box['error']}") from box["error"]
    return box["value"]


class UpnpGateway:
    """The router's IGD, found by ``discover``; maps and unmaps our ports."""

    def __init__(self, client: Any, *, config: PortMapConfig, clock: Callable[[], float]) -> None:
        self._client = client
        self._config = config
        self._clock = clock
        self.internal_ip = check_internal_ip(client.lanaddr)
        self.external_ip = check_external_ip(
            bounded(client.externalipaddress, CALL_TIMEOUT_S, "external address")
        )

    @classmethod
    def discover(cls, config: PortMapConfig, clock: Callable[[], float]) -> "UpnpGateway":
        """The LAN's IGD; GatewayError when none answers within ``config.discover_s``."""
        try:
            import miniupnpc  # a C extension: a platform without its wheel runs without UPnP
        except ImportError as exc:
            raise GatewayError(f"miniupnpc is not installed ({exc})") from exc
        client = miniupnpc.UPnP()
        client.discoverdelay = max(100, int(config.discover_s * 1000 / SEARCHES))
        found = bounded(client.discover, config.discover_s + 1.0, "discovery")
        if not found:
            raise GatewayError(f"no UPnP router answered within {config.discover_s:.1f} s")
        bounded(client.selectigd, CALL_TIMEOUT_S, "the router's description")
        return cls(client, config=config, clock=clock)

    def map(self, port: int) -> PortMapping:
        """Forward the router's ``port`` to ours (the same number on both sides)."""
        check_port(port)
        lease = self._config.lease_s
        bounded(
            lambda: self._client.addportmapping(
                port, PROTOCOL, self.internal_ip, port, self._config.description, "", lease
            ),
            CALL_TIMEOUT_S,
            f"mapping port {port}",
        )
        granted_at = self._clock()
        entry = bounded(
            lambda: self._client.getspecificportmapping(port, PROTOCOL),
            CALL_TIMEOUT_S,
            f"reading back port {port}",
        )
        granted = check_entry(entry, port=port, internal_ip=self.internal_ip, asked_s=lease)
        return PortMapping(
            port=port, external_ip=self.external_ip, internal_ip=self.internal_ip,
            lease_s=granted, granted_at=granted_at,
        )  # fmt: skip

    def unmap(self, port: int) -> None:
        bounded(
            lambda: self._client.deleteportmapping(port, PROTOCOL),
            CALL_TIMEOUT_S,
            f"removing port {port}",
        )
