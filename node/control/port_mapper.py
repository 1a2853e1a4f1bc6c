"""The ports this node holds on its home router (UPnP-IGD), from asking to giving back.

``ReachCheck`` calls ``open`` when members found the node ``private`` (never when it is
public, nor behind ``--announce-addr``, nor with ``--no-upnp``), then asks the members again:
their dial-back at the mapped ports is what makes the verdict ``mapped``; the router's word
alone never does. ``renew`` runs at each turn of the reachability loop and re-maps a port at
half its lease; ``close`` (the node leaving, SIGTERM included) removes every mapping.
A router that fails a check (port_map.py) is a ``GatewayError``: logged once, mappings made
so far removed, the node goes on through relays; another try comes ``retry_s`` later.
"""

import threading
import time
from collections.abc import Callable, Sequence

from fusionllm.common.logs import get_logger
from fusionllm.node.p2p.port_map import GatewayError, PortMapConfig, PortMapping, due
from fusionllm.node.p2p.upnp import UpnpGateway

logger = get_logger(__name__)

RETRY_S = 300.0  # after a failed or useless try: a home router's settings rarely change


class PortMapper:
    def __init__(
        self,
        config: PortMapConfig,
        *,
        find_gateway: Callable[[PortMapConfig, Callable[[], float]], UpnpGateway] = (
            UpnpGateway.discover
        ),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._find = find_gateway
        self._clock = clock
        self._lock = threading.Lock()
        self._gateway: UpnpGateway | None = None
        self.mappings: dict[int, PortMapping] = {}
        self._next_try = float("-inf")

    @property
    def mapped(self) -> bool:
        return bool(self.mappings)

    def worth_trying(self) -> bool:
        return self._config.enabled and not self.mappings and self._clock() >= self._next_try

    def open(self, ports: Sequence[int], *, observed_ips: Sequence[str]) -> bool:
        """Map ``ports`` on the LAN's router; whether all were mapped. ``observed_ips``: where
        members saw us come from; a router naming another external address is not the one
        between us and them (or lies), and gets no mapping kept."""
        with self._lock:
            self._next_try = self._clock() + RETRY_S
            started = time.monotonic()
            try:
                gateway = self._gateway = self._find(self._config, self._clock)
                if observed_ips and gateway.external_ip not in observed_ips:
                    raise GatewayError(
                        f"the router says its address is {gateway.external_ip}, members see "
                        f"this node at {', '.join(observed_ips)}: not the router they reach"
                    )
                for port in dict.fromkeys(ports):
                    self.mappings[port] = gateway.map(port)
            except GatewayError as exc:
                logger.info("no UPnP port mapping (%s): peers reach this node through relays",
                            exc)  # fmt: skip
                self._remove_all()
                return False
        took = time.monotonic() - started
        logger.info("UPnP: the router at %s forwards ports %s to this node (%.1f s)",
                    gateway.external_ip, sorted(self.mappings), took)  # fmt: skip
        return True

    def renew(self) -> None:
        """Re-map the ports due (half their lease gone); a port the router will not renew
        is dropped, and all go if one does (a partial mapping is a broken node)."""
        with self._lock:
            gateway = self._gateway
            if gateway is None:
                return
            try:
                for port in due(self.mappings, self._clock(), self._config.renew_fraction):
                    self.mappings[port] = gateway.map(port)
                    logger.debug("UPnP lease of port %d renewed", port)
            except GatewayError as exc:
                logger.warning("UPnP lease renewal failed (%s): mappings dropped", exc)
                self._remove_all()

    def drop(self, why: str) -> None:
        """Remove our mappings (they do not make us reachable: ``why``); the next try comes
        ``RETRY_S`` after the last."""
        with self._lock:
            if self.mappings:
                logger.info("UPnP mappings removed: %s", why)
            self._remove_all()

    def close(self) -> None:
        self.drop("the node leaves")

    def _remove_all(self) -> None:
        gateway, ports = self._gateway, sorted(self.mappings)
        self.mappings.clear()
        if gateway is None:
            return
        for port in ports:
            try:
                gateway.unmap(port)
            except GatewayError as exc:  # it expires with its lease anyway
                logger.info("could not remove the mapping of port %d: %s", port, exc)
