"""A home router's kernel side: the veth LAN to its home namespace, forwarding, nftables.

The plans (addresses, rules) are ``nat``'s; this module only applies them (needs root).
"""

import shutil

from fusionllm.testbed import netns
from fusionllm.testbed.errors import TestbedError
from fusionllm.testbed.nat import HOME_DEVICE, LAN_DEVICE, HomeLan, ruleset


def unavailable() -> str | None:
    """None when home routers can be set up here; else why not (nftables missing)."""
    if shutil.which("nft") is None:
        return "nftables' `nft` is not installed (apt-get install nftables)"
    return None


def connect_home(router_ns: str, home_ns: str, kind: str, lan: HomeLan) -> None:
    """Join ``home_ns`` to ``router_ns`` on a veth LAN, route the home through the router,
    and make the router a NAT of ``kind`` (forwarding on, nftables rules loaded)."""
    reason = unavailable()
    if reason:
        raise TestbedError(reason)
    # made inside the namespaces: no name in the root namespace can clash with another run's
    netns.ip(
        "-n", router_ns, "link", "add", LAN_DEVICE, "type", "veth",
        "peer", "name", HOME_DEVICE, "netns", home_ns,
    )  # fmt: skip
    netns.ip("-n", router_ns, "addr", "add", f"{lan.router}/{lan.prefix_len}", "dev", LAN_DEVICE)
    netns.ip("-n", router_ns, "link", "set", "dev", LAN_DEVICE, "up")
    netns.ip("-n", home_ns, "addr", "add", f"{lan.node}/{lan.prefix_len}", "dev", HOME_DEVICE)
    netns.ip("-n", home_ns, "link", "set", "dev", HOME_DEVICE, "up")
    netns.ip("-n", home_ns, "route", "add", "default", "via", lan.router)
    netns.in_netns(router_ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
    netns.in_netns(router_ns, "nft", "-f", "-", stdin=ruleset(kind, lan))
