"""Home routers: what a host behind NAT looks like, as pure plans (addresses, nftables rules).

A topology host with ``nat = "cone"`` or ``nat = "symmetric"`` is a home: the emulated host
(its TUN, public address, shaped uplink, downlink and links) is the home *router*, and the
host's processes run in a namespace behind it, on a veth LAN with a private address. The
router forwards, masquerades what leaves on its WAN side and, like a home router, drops what
arrives unasked (new connections to it or to the LAN).

- ``cone``: plain masquerade, which keeps the source port when it is free: a socket keeps one
  public port whatever it dials (endpoint-independent mapping), so a peer that learns the
  port can punch a hole to it. Filtering is by connection (port-restricted cone).
- ``symmetric``: masquerade ``fully-random``: every connection gets a random public port, so
  the port a peer saw is useless to a third one and hole punching fails (relay only).
"""

from dataclasses import dataclass

NAT_KINDS = ("cone", "symmetric")
WAN_DEVICE = "wan0"  # the router's TUN, as in every testbed host
LAN_DEVICE = "lan0"  # the router's side of the veth
HOME_TABLE = "fltb_home"  # the router's nftables table (igd.py adds to its forward chain)
HOME_DEVICE = "eth0"  # the home namespace's side
_MASQUERADE = {"cone": "masquerade", "symmetric": "masquerade fully-random"}


@dataclass(frozen=True, kw_only=True)
class HomeLan:
    """The veth LAN between a home router and its node: a /24 of its own per home."""

    router: str  # dotted IPv4, the node's gateway
    node: str
    prefix_len: int = 24

    @property
    def network(self) -> str:
        return self.router.rsplit(".", 1)[0] + ".0"


def home_lan(lan_prefix: str, index: int) -> HomeLan:
    """The LAN of the ``index``-th host of a topology (0-based): ``<prefix>.<index+1>.0/24``,
    router ``.1``, node ``.2``. Distinct per home so logs name one host per address."""
    parts = lan_prefix.split(".")
    if len(parts) != 2 or not all(p.isdigit() and int(p) < 256 for p in parts):
        raise ValueError(f"lan_prefix {lan_prefix!r}: want two octets, e.g. '192.168'")
    if not 0 <= index < 255:
        raise ValueError(f"host index {index} not in [0, 255)")
    base = f"{lan_prefix}.{index + 1}"
    return HomeLan(router=f"{base}.1", node=f"{base}.2")


def ruleset(kind: str, lan: HomeLan) -> str:
    """The router's nftables ruleset (``nft -f`` input) for a NAT of ``kind``."""
    if kind not in NAT_KINDS:
        raise ValueError(f"nat {kind!r}: one of {NAT_KINDS}")
    lan_net = f"{lan.network}/{lan.prefix_len}"
    return f"""\
table ip {HOME_TABLE} {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{WAN_DEVICE}" ip saddr {lan_net} {_MASQUERADE[kind]}
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "{LAN_DEVICE}" oifname "{WAN_DEVICE}" ip saddr {lan_net} accept
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "{WAN_DEVICE}" ct state established,related accept
        iifname "{WAN_DEVICE}" drop
    }}
}}
"""
