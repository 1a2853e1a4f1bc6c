"""The node's reachability, judged now and then from its members' dial-backs.

``ReachCheck`` serves dial-back (node/p2p/dialback.py) to members, never to strangers, on the
node's host; and asks up to ``ask`` members that others can reach to dial it back: at
first soon after it joined, then every ``interval_s`` (every ``retry_s`` while it found no
member to ask). The verdict (``current``, node/p2p/reachability.py) goes into the node's record
and ``fusionllm status``. A node given ``--announce-addr`` asks nothing: it is "announced".
A node found ``private`` first asks its router to map its ports (port_mapper.py, UPnP) and
its members again: reached at the mapped ports, it is ``mapped`` and names them first.
"""

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from libp2p.peer.id import ID

from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dht.records import NodeInfo
from fusionllm.node.control.port_mapper import PortMapper
from fusionllm.node.control.relay_use import RelayUse
from fusionllm.node.p2p.announce import AnnounceAddr
from fusionllm.node.p2p.dialback import DIALBACK_PROTOCOL, DialBackConfig, DialBackServer, ask
from fusionllm.node.p2p.peer_host import PeerHost
from fusionllm.node.p2p.reachability import REACHABLE, Reachability, Settler, announced, judge

logger = get_logger(__name__)

# Members that have not judged yet ("unknown", or "" from older software) are worth asking
# too, after those whose own verdict says others reach them. Never a "private" one.
_UNJUDGED = ("unknown", "")


@dataclass(frozen=True, kw_only=True)
class ReachConfig:
    first_after_s: float = 5.0  # after start: the first members' records are in by then
    interval_s: float = 300.0
    retry_s: float = 10.0  # while there was no member to ask
    ask: int = 3  # members asked per check
    confirmations: int = 2  # agreeing members for a verdict (fewer if fewer were asked)
    repeats: int = 2  # checks in a row that must agree where fewer members could be asked
    connect_timeout_s: float = 10.0
    dialback: DialBackConfig = field(default_factory=DialBackConfig)

    def __post_init__(self) -> None:
        for name in ("first_after_s", "interval_s", "retry_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 86400):
                raise ConfigError(f"{name} must be in (0, 86400] s, got {value!r}")
        for name in ("ask", "confirmations", "repeats"):
            value = getattr(self, name)
            if not (isinstance(value, int) and 1 <= value <= 16):
                raise ConfigError(f"{name} must be in [1, 16], got {value!r}")


def pick_askers(members: Mapping[str, NodeInfo], me: str, count: int) -> list[NodeInfo]:
    """Up to ``count`` members to ask, reachable ones first, then by peer id. Pure."""
    others = [m for m in members.values() if m.peer_id != me and m.addrs]
    ranked = sorted(others, key=lambda m: (m.reach not in REACHABLE, m.peer_id))
    return [m for m in ranked if m.reach in (*REACHABLE, *_UNJUDGED)][:count]


class ReachCheck:
    """Serves and asks dial-backs on ``host``; ``current`` is the latest verdict."""

    def __init__(
        self,
        *,
        host: PeerHost,
        config: ReachConfig,
        members: Callable[[], Mapping[str, NodeInfo]],
        is_member: Callable[[str], bool],
        listen_ips: Sequence[str],
        announced_addrs: Sequence[str] = (),
        emit: Callable[..., None] = lambda *a, **k: None,
        relays: RelayUse | None = None,
        mapper: PortMapper | None = None,
        mapped_ports: Callable[[], Sequence[int]] = tuple,
    ) -> None:
        self._host = host
        self._config = config
        self._members = members
        self._is_member = is_member
        self._listen_ips = tuple(listen_ips)
        self._emit = emit
        self._announced = tuple(announced_addrs)
        self._relays = relays  # acts on each verdict (relay_use.py)
        self._mapper = mapper  # None: --no-upnp, or nothing to map for
        self._mapped_ports = mapped_ports  # beside the host's: lanes'
        self._asked = False  # whether the last check found members to ask
        self._stop = threading.Event()  # loop()'s, once it runs
        self._settler = Settler(confirmations=config.confirmations, repeats=config.repeats)
        self.current = announced(self._announced) if self._announced else Reachability(
            verdict="unknown"
        )  # fmt: skip

    @property
    def published(self) -> str:
        """The verdict for our record: none while unknown (older readers refuse the field,
        so only nodes with something to say write it)."""
        return "" if self.current.verdict == "unknown" else self.current.verdict

    def attach(self) -> None:
        """Serve dial-back requests of members on the host."""
        server = DialBackServer(self._config.dialback, allow=self._is_member)
        self._host.set_stream_handler(DIALBACK_PROTOCOL, server.serve)

    def advertised(self, listen_addrs: Sequence[str]) -> list[str]:
        """What our record tells peers to dial: the router's addresses members reached us at
        (``mapped``), or relayed addresses while we hold any; then where we listen."""
        reach, mapped = self.current, []
        for addr in reach.addrs if reach.verdict == "mapped" else ():
            ip, port = addr.rsplit(":", 1)  # judged from checked IPs and our own ports
            mapped.append(f"{AnnounceAddr(host=ip).multiaddr(int(port))}/p2p/{self._host.peer_id}")
        return [*mapped, *(self._relays.addrs if self._relays else ()), *listen_addrs]

    def close(self) -> None:
        """Give back what we hold on the router (a node leaving, SIGTERM included)."""
        if self._mapper is not None:
            self._mapper.close()

    def loop(self, stop: threading.Event) -> None:
        """Check now and then until ``stop``; nothing to check behind --announce-addr (we
        relay for members there)."""
        self._stop = stop
        if self._announced:
            if self._relays is not None:
                self._relays.follow(self.current.verdict)
            return
        due = time.monotonic() + self._config.first_after_s
        while not stop.wait(max(0.0, min(due - time.monotonic(), self._config.retry_s))):
            # Between checks, every retry_s: a relay we hold a slot on that went (our
            # connection to it closed, its record expired) leaves our record now, and we
            # look for another, not at the next check, up to interval_s (5 min) away.
            lost = self._relays is not None and self._relays.prune()
            if self._mapper is not None:
                self._mapper.renew()
            if time.monotonic() < due and not lost:
                continue
            judged = self.check_once().verdict != "unknown"
            wanting = self._relays is not None and self._relays.wanting
            settled = self._asked and judged and not wanting and not self._settler.pending
            wait = self._config.interval_s if settled else self._config.retry_s
            due = time.monotonic() + wait

    def check_once(self) -> Reachability:
        askers = pick_askers(self._members(), self._host.peer_id, self._config.ask)
        self._asked = bool(askers)
        ports = sorted({int(a.split("/tcp/")[1].split("/")[0]) for a in self._host.bound_addrs})
        asked_at = time.monotonic()
        verdict, asked = self._judge(askers, ports)
        if verdict.verdict == "private" and self._mapper is not None:
            if self._mapper.mapped:  # the router lost them (a reboot), or closed them
                self._mapper.drop("members no longer reach this node at the mapped ports")
            if self._mapper.worth_trying():
                verdict, asked = self._map_and_judge(askers, ports, (verdict, asked), asked_at)
        if not asked and self.current.verdict != "unknown":
            # Nobody to ask is no news: a public node whose other members all sit behind NAT
            # (they ask it, it may not ask them) would turn "unknown" at its next check, and
            # the homes relaying through it would drop it as a relay.
            verdict = self.current
        verdict = self._settler.settle(self.current, verdict)
        if verdict != self.current:
            logger.info("reachability: %s (%d members answered)", verdict.verdict, verdict.answers)
            upnp = self._mapper is not None and self._mapper.mapped
            self._emit("reachability", verdict=verdict.verdict, addrs=list(verdict.addrs),
                       observed=list(verdict.observed_ips), answers=verdict.answers,
                       upnp=upnp)  # fmt: skip
        self.current = verdict
        if self._relays is not None:
            self._relays.follow(verdict.verdict)
        return verdict

    def _judge(self, askers: list[NodeInfo], ports: list[int]) -> tuple[Reachability, int]:
        """Ask ``askers`` to dial ``ports``: the verdict, and how many we could ask."""
        answers, asked = [], 0
        for member in askers:
            try:
                if not self._reach(member):
                    continue
                asked += 1
                answers.append(self._ask(member, ports))
            except FusionError as exc:
                logger.debug("dial-back by %s failed: %s", member.peer_id, exc)
        # A member we could not even connect to (a home behind NAT that has not judged itself
        # yet) was not asked: its silence must not keep us from a verdict for ever.
        confirmations = min(self._config.confirmations, max(1, asked))
        return judge(answers, listen_ips=self._listen_ips, confirmations=confirmations), asked

    def _map_and_judge(
        self,
        askers: list[NodeInfo],
        ports: list[int],
        private: tuple[Reachability, int],
        asked_at: float,
    ) -> tuple[Reachability, int]:
        """Before settling for relays (``private``: the verdict and how many members we
        asked): the router maps our ports, members dial them."""
        wanted = [*ports, *(p for p in self._mapped_ports() if p not in ports)]
        if not self._mapper.open(wanted, observed_ips=private[0].observed_ips):
            return private
        # A member serves one dial-back per peer per min_interval_s: asked sooner, it refuses.
        again = asked_at + self._config.dialback.min_interval_s * 1.05  # a margin
        if self._stop.wait(max(0.0, again - time.monotonic())):
            return private
        verdict, asked = self._judge(askers, ports)
        if verdict.verdict != "mapped":
            self._mapper.drop(f"members still could not dial this node ({verdict.verdict})")
        return verdict, asked

    def _reach(self, member: NodeInfo) -> bool:
        """Whether we are connected to ``member`` (connecting if need be)."""
        if member.peer_id in self._host.connected_peers():
            return True
        try:
            self._host.connect(member.addrs[0], timeout=self._config.connect_timeout_s)
        except FusionError as exc:
            logger.debug("cannot connect to %s to ask it: %s", member.peer_id, exc)
            return False
        return True

    def _ask(self, member: NodeInfo, ports: list[int]):
        peer = ID.from_base58(member.peer_id)
        return self._host.call(ask, self._host.libp2p, peer, ports, self._config.dialback)
