"""What a node does about relays, given its reachability verdict (reach_check.py).

- Others can dial it ("public", "mapped", "announced"): it relays for members
  (node/p2p/member_relay.py), never for strangers.
- Nobody can ("private"): it holds a slot on up to ``relays`` members that relay, renewed at
  each check (a reservation lasts ``MemberRelayConfig.reservation_s``, an hour), and its
  record names the relayed addresses first (``addrs``), so that peers dial it through them.
- Not judged yet ("unknown"): neither.

Every node runs the client side (node/p2p/relay_client.py): it dials relayed addresses and, when
private, accepts the circuits that come through its relays.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dht.records import NodeInfo
from fusionllm.node.p2p.member_relay import MemberRelay, MemberRelayConfig
from fusionllm.node.p2p.peer_host import PeerHost
from fusionllm.node.p2p.reachability import REACHABLE
from fusionllm.node.p2p.relay_addrs import is_relayed, relay_of, relayed_addr
from fusionllm.node.p2p.relay_client import RelayClient

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class RelayUseConfig:
    relays: int = 2  # slots a private node holds (one relay may leave)
    connect_timeout_s: float = 10.0
    relay: MemberRelayConfig = field(default_factory=MemberRelayConfig)

    def __post_init__(self) -> None:
        if not (isinstance(self.relays, int) and 1 <= self.relays <= 4):
            raise ConfigError(f"relays must be an int in [1, 4], got {self.relays!r}")
        value = self.connect_timeout_s
        if not (isinstance(value, int | float) and 0 < value <= 120):
            raise ConfigError(f"connect_timeout_s must be in (0, 120] s, got {value!r}")


def dht_client_mode(verdict: str) -> bool | None:
    """Whether the node's DHT worker should be a client (stores nothing for others): while
    nobody can dial it, yes; once others can (a forward made since it was private), no, or
    the swarm's DHT loses a server for good; not judged yet: None, as it is. ``mapped`` is a
    client too: UPnP maps the host's and lanes' ports, not the DHT's (port_mapper.py). A change
    restarts the worker (dht/client.py): only a new verdict does. Pure."""
    if verdict in ("private", "mapped"):
        return True
    return False if verdict in REACHABLE else None


def direct_addrs(info: NodeInfo) -> list[str]:
    return [a for a in info.addrs if not is_relayed(a)]


def pick_relays(members: Mapping[str, NodeInfo], me: str, count: int) -> list[NodeInfo]:
    """Up to ``count`` members others can dial, with an address to dial, by peer id. Pure."""
    usable = [m for m in members.values()
              if m.peer_id != me and m.reach in REACHABLE and direct_addrs(m)]  # fmt: skip
    return sorted(usable, key=lambda m: m.peer_id)[:count]


class RelayUse:
    """Follows the verdict: relays for members, or holds slots on members' relays."""

    def __init__(
        self,
        *,
        host: PeerHost,
        config: RelayUseConfig,
        members: Callable[[], Mapping[str, NodeInfo]],
        client: RelayClient,
        start_relay: Callable[[], MemberRelay],
    ) -> None:
        self._host = host
        self._config = config
        self._members = members
        self._client = client
        self._start_relay = start_relay
        self._relay: MemberRelay | None = None
        self._private = False  # the last verdict
        self.addrs: tuple[str, ...] = ()  # relayed addresses that hold a slot now

    @classmethod
    def on(
        cls,
        host: PeerHost,
        *,
        members: Callable[[], Mapping[str, NodeInfo]],
        is_member: Callable[[str], bool],
        config: RelayUseConfig | None = None,
    ) -> "RelayUse":
        """Relay use on a node's host: its relay client starts now, its relay when needed."""
        config = config or RelayUseConfig()
        return cls(host=host, config=config, members=members, client=RelayClient(host).start(),
                   start_relay=lambda: MemberRelay(host, config.relay,
                                                   is_member=is_member).start())  # fmt: skip

    @property
    def relaying(self) -> bool:
        return self._relay is not None

    @property
    def wanting(self) -> bool:
        """Private and reachable through no relay yet: worth checking again soon (a member
        that relays may not have judged itself yet when we first looked)."""
        return self._private and not self.addrs

    def follow(self, verdict: str) -> None:
        """Act on a fresh verdict (at every check: slots are renewed then)."""
        self._private = verdict == "private"
        if verdict in REACHABLE:
            self.addrs = ()
            if self._relay is None:
                self._relay = self._start_relay()
                logger.info("relaying for members behind NAT")
        elif verdict == "private":
            self.addrs = tuple(self._reserve(pick_relays(self._members(), self._host.peer_id,
                                                         self._config.relays)))  # fmt: skip

    def prune(self) -> bool:
        """Drop the relayed addresses whose relay went: no connection to it left (a slot
        lives on it), or no fresh record of it that says others can dial it. Whether any
        went (then the caller checks again at once, and reserves elsewhere)."""
        if not self.addrs:
            return False
        members, connected = self._members(), set(self._host.connected_peers())
        kept = tuple(a for a in self.addrs if (relay := relay_of(a)) in connected
                     and relay in members and members[relay].reach in REACHABLE)  # fmt: skip
        if kept == self.addrs:
            return False
        logger.info(
            "relays gone: %s",
            sorted({relay_of(a) for a in self.addrs} - {relay_of(a) for a in kept}),
        )
        self.addrs = kept
        return True

    def _reserve(self, relays: list[NodeInfo]) -> list[str]:
        held = []
        for relay in relays:
            addr = direct_addrs(relay)[0]
            try:
                self._host.connect(addr, timeout=self._config.connect_timeout_s)
                granted = self._client.reserve(relay.peer_id)
            except FusionError as exc:
                logger.debug("no slot on %s: %s", relay.peer_id, exc)
                continue
            if granted:
                held.append(relayed_addr(addr, self._host.peer_id))
        if held != list(self.addrs):
            logger.info("reachable through relays at %s", held or "none")
        return held
