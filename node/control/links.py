"""Measured links: probe a sample of members, gossip what we measured, file what others say.

``LinkMonitor`` runs two of the daemon's threads (probes, gossip) over the node's control host
and its BandwidthBook; it sees the daemon only through two callables (the members, and the
plan neighbours whose links deserve full-size probes).
"""

import contextlib
import math
import random
import threading
import time
from collections.abc import Callable, Iterator

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dht.records import NodeInfo, RecordError
from fusionllm.node.control.backoff import ProbeBackoff, max_factor_for
from fusionllm.node.control.bandwidth import (
    BandwidthBook,
    BandwidthReport,
    LinkSample,
    choose_probe_targets,
)
from fusionllm.node.control.probe_budget import ProbeBudget, ProbeBudgetConfig
from fusionllm.node.control.probe_slots import next_slot
from fusionllm.node.control.quiet import MAX_PROBE_STRETCH, ConnectionWatch, HeldAge
from fusionllm.node.errors import TransportClosedError, TransportError
from fusionllm.node.p2p.control_host import ControlHost
from fusionllm.node.p2p.lane.wire_meter import WireSample

logger = get_logger(__name__)


def gossip_validator(
    topic: str, swarm: str, is_member: Callable[[str], bool]
) -> Callable[[str, str, bytes], bool]:
    """The control host's check of every gossip message: a bandwidth report of our swarm by
    a member. What fails is neither filed nor forwarded, so strangers' reports die at the first
    honest hop."""

    def valid(message_topic: str, author: str, data: bytes) -> bool:
        if message_topic != topic or not is_member(author):
            return False
        try:
            report = BandwidthReport.from_bytes(data)
        except RecordError:
            return False
        return report.swarm == swarm

    return valid


class LinkMonitor:
    MEMBER_CHECK_S = 1.0  # how soon a probe round notices a member change while it waits
    # A link's figure is the best of our last this-many probes of it (bandwidth.py): one slow
    # probe on a busy CPU no longer prices the link; a link that really slowed shows once its
    # fast samples leave the window, after this many rounds or the book's max age.
    PROBE_WINDOW = 8

    def __init__(
        self,
        *,
        control: ControlHost,
        book: BandwidthBook,
        peer_id: str,
        swarm: str,
        topic: str,
        probe_interval_s: float,
        probe_fanout: int,
        probe_bytes: int,
        max_connections: int,
        members: Callable[[], dict[str, NodeInfo]],
        neighbours: Callable[[], list[str]],
        stop: threading.Event,
        wake: Callable[[bool], None] = lambda alert: None,
        suspect: Callable[[str, float], None] = lambda peer, since: None,
        quiet: Callable[[], int] = lambda: 1,
        wire: Callable[[], dict[str, WireSample]] = dict,
        lane_probe: Callable[[str, int], WireSample | None] = lambda peer, nbytes: None,
        probe_budget: ProbeBudgetConfig | None = None,
        probe_slot_s: float = 0.0,
    ) -> None:
        self.control = control
        self.book = book
        self.peer_id = peer_id
        self.swarm = swarm
        self.topic = topic
        self.probe_interval_s = probe_interval_s
        self.probe_fanout = probe_fanout
        self.probe_bytes = probe_bytes
        self.max_connections = max_connections
        self._members = members
        self._neighbours = neighbours
        self._stop = stop
        self._wake = wake  # quiet.py: a member woke for a change (False), or a hint (True)
        self._suspect = suspect  # a quiet member that vanished: (peer, since when)
        self._connections = ConnectionWatch()
        self._quiet = quiet  # how many epochs a quiet swarm sits out (quiet.py)
        self._wire = wire  # our lanes' kernel-timed figures, by peer (lane/wire_meter.py)
        self._lane_probe = lane_probe  # a bulk probe on our lane to a peer (lane/bulk.py)
        self._held_age = HeldAge(book.max_age_s)
        self._rng = random.Random()
        self._lock = threading.Lock()
        self._probes_failed = 0
        self._backoff = ProbeBackoff(max_factor_for(probe_interval_s, book.max_age_s))
        self._budget = ProbeBudget(probe_budget, now=time.monotonic())
        # Slots in which each member is in one probe at most (probe_slots.py); 0: none.
        self.probe_slot_s = probe_slot_s
        # How long a link waits for a lane before the stream probe measures it (_probe).
        self.lane_patience_s = probe_interval_s
        # The members connected as the last round chose its targets (None before the first).
        self._probeable: frozenset[str] | None = None
        # The probe thread's own (no lock): our last bulk probe of each peer (monotonic), lane
        # when a lane probe first found no lane (monotonic; until one is found), the peers
        # whose probe waits for a lane this round, the last lane figure we filed (wall clock).
        self._bulk_at: dict[str, float] = {}
        self._lane_missed_at: dict[str, float] = {}
        self._lane_deferred: set[str] = set()
        self._filed_at: dict[str, float] = {}

    @property
    def probes_failed(self) -> int:
        with self._lock:
            return self._probes_failed

    def gossip_loop(self) -> None:
        while not self._stop.is_set():
            try:
                # Blocks until a message comes: an idle node does not poll. Closing the control
                # host (NodeDaemon.close) ends the wait.
                message = self.control.recv(timeout=None)
            except TransportClosedError:
                return
            try:
                report = BandwidthReport.from_bytes(message.data)
            except RecordError:
                continue  # the validator let it through, so this cannot happen; be safe anyway
            # Members again: the validator ran at arrival, membership may have changed since.
            members = self._members()
            if report.wake and message.author in members:
                self._wake(False)
            self.book.record_report(message.author, report, now=time.time(), members=members)

    def probe_loop(self) -> None:
        while not self._stop.wait(self._rng.uniform(0.2, 1.0) if not self._members() else 0):
            members = self._members()
            try:
                self.connect(members)
                self._probe_round(members)
            except TransportClosedError:
                return  # the daemon closes the control host on its way out
            self.file_wire(members)
            self._publish()
            # A swarm that looks as it did last round is probed less often (backoff.py), a
            # quiet one less often still; a wake ends the wait (_wait).
            view = (frozenset(members), tuple(sorted(self._neighbours())))
            factor = self._backoff.next_factor(view) * self._stretch()
            if self._wait(self.probe_interval_s * factor * self._rng.uniform(0.8, 1.2), view[0]):
                return

    def _publish(self) -> None:
        """Gossip our links' figures (what every planner prices our links by)."""
        report = self.book.own_report(self.peer_id, self.swarm, now=time.time())
        if report.links:
            with contextlib.suppress(FusionError, ValueError):
                self.control.publish(self.topic, report.to_bytes())

    def _stretch(self) -> int:
        """How many times further apart probe rounds are now (quiet.py), with the book's
        figures kept alive as many times longer."""
        stretch = min(self._quiet(), MAX_PROBE_STRETCH)
        self.book.max_age_s = self._held_age.max_age(stretch, time.monotonic())
        return stretch

    def _wait(self, seconds: float, members: frozenset[str]) -> bool:
        """Sleep ``seconds`` unless the members change first (a newcomer can be planned in only
        once its links are measured, so it must not wait out a backed-off round); True when
        the node stops."""
        deadline = time.monotonic() + seconds
        stretch = self._stretch()
        while (left := deadline - time.monotonic()) > 0:
            if self._stop.wait(min(left, self.MEMBER_CHECK_S)):
                return True
            current = self._members()
            self.file_wire(current)
            if frozenset(current) != members or self._stretch() < stretch:
                return False
            try:
                connected = self.control.connected_peers()
            except TransportClosedError:
                return True  # the daemon closes the control host on its way out
            self._heed(*self._connections.hint(connected, current), current)
            if self._newly_probeable(connected, current):
                return False
        return self._stop.is_set()

    def _newly_probeable(self, connected: list[str], members: dict[str, NodeInfo]) -> bool:
        """A member we connected to since the last round and never measured, or one whose
        probe waited for a lane last round and may take the stream probe now: its link waits
        for our next round, which a stable swarm backs off for minutes (CI met it: a home
        behind NAT reached over its relay only after the round, its link unmeasured 3 minutes
        on; and two homes' relayed link, deferred once, unmeasured 3 minutes on)."""
        if self._probeable is None:
            return False
        measured = self.book.last_measured(self.peer_id, time.time())
        mono = time.monotonic()
        due = {
            p for p in self._lane_deferred
            if mono - self._lane_missed_at.get(p, mono) >= self.lane_patience_s
        }  # fmt: skip
        return any(
            p in members
            and p != self.peer_id
            and (p not in self._probeable or p in due)
            and p not in measured
            for p in connected
        )

    def _heed(
        self, strangers: frozenset[str], lost: frozenset[str], members: dict[str, NodeInfo]
    ) -> None:
        """Hints of a change (quiet.py): wake the epochs; a quiet member whose connection
        dropped and who does not take a new one is suspected now, not after the long silence
        its record promised."""
        if not strangers and not lost:
            return
        logger.debug("hints of a change: %d new stranger(s), %d member(s) lost",
                     len(strangers), len(lost))  # fmt: skip
        self._wake(True)
        for peer in sorted(lost):
            info = members[peer]
            if info.beat > 1 and not self._reachable(info):
                logger.info("quiet member %s... is unreachable: suspected", peer[:16])
                # Until it writes after this moment: a record written before it died may
                # still be newer than the one we read last (a quiet node reads seldom).
                self._suspect(peer, time.time())

    def file_wire(self, members: dict[str, NodeInfo]) -> int:
        """Put our lanes' kernel-timed figures in the book, in the window our probes share:
        under training load a probe paced by Python reads a fast link 4-40x low (issue 25),
        the kernel's busy-lane rate does not, and the best of the window prices the link.
        One a ``probe_interval_s`` per link at most: filed every second, they pushed a bulk
        probe's figure out of the window within 8 s (topology B, session 14: 1 Gbit/s links
        the plan used read 0.42-0.70 of their cap mid-run). How many were new."""
        now, kept = time.time(), 0
        for peer, wire in self._wire().items():
            if peer == self.peer_id or peer not in members:
                continue
            if now - self._filed_at.get(peer, -math.inf) < self.probe_interval_s:
                continue
            at, punched = wire.measured_at, wire.punched
            sample = LinkSample(wire.bandwidth, wire.rtt, at, punched=punched)
            if self.book.record(self.peer_id, peer, sample, now=now, window=self.PROBE_WINDOW):
                self._filed_at[peer] = now
                kept += 1
        return kept

    def _reachable(self, info: NodeInfo) -> bool:
        for addr in info.addrs[:2]:
            try:
                self.control.connect(addr)
                return True
            except TransportClosedError:
                return True  # we are the one going away: suspect nobody
            except (TransportError, FusionError) as exc:
                logger.debug("could not reconnect to %s at %s: %s", info.peer_id[:16], addr, exc)
        return False

    def _probe_round(self, members: dict[str, NodeInfo]) -> None:
        priority = self._neighbours()
        connected = set(self.control.connected_peers())
        self._probeable = frozenset(connected)
        self._lane_deferred = set()
        self._lane_missed_at = {p: t for p, t in self._lane_missed_at.items() if p in members}
        by_lanes = self._measured_by_lanes()
        candidates = [p for p in members if p in connected and p not in by_lanes]
        measured = self.book.last_measured(self.peer_id, time.time())
        # Every link never measured, this round: a swarm plans on what it measured before
        # training, and at ``probe_fanout`` a round a newcomer's links took 3-4 rounds (the
        # far ones then read by the stream probe or not at all, topology C, session 15).
        unmeasured = sum(p != self.peer_id and p not in measured for p in candidates)
        targets = choose_probe_targets(
            self.peer_id,
            candidates,
            measured,
            count=max(self.probe_fanout, unmeasured),
            priority=priority,
            rng=self._rng,
        )
        for peer in self._in_slots(targets, members):
            if peer is None:
                return
            if not self._budget.allows(time.monotonic()):
                logger.debug("probe budget spent: targets wait for a later round")
                return
            # Links the plan uses get full-size stream probes (a better estimate where it
            # matters); the rest a quarter, enough to rank them. A lane probe is always full
            # size (_probe): it costs the link a few ms, not Python's time.
            full = peer in priority
            nbytes = self.probe_bytes if full else max(16 << 10, self.probe_bytes // 4)
            sample, sent = self._probe(peer, min(nbytes, self.probe_bytes))
            if sample is not None:
                # The uplink's busy time at the rate measured, not the wall time: that may
                # include a lane's opening (up to 4 s, lane/prober.py), which costs no link.
                self._budget.spend(sent / max(sample.bandwidth, 1.0), time.monotonic())
                now = time.time()
                self.book.record(self.peer_id, peer, sample, now=now, window=self.PROBE_WINDOW)
                if peer not in measured:
                    # At once, not as the round ends: a round waits for its slots, a cycle
                    # of them on C, and the others' planners wait for this link meanwhile.
                    self._publish()

    def _in_slots(self, targets: list[str], members: dict[str, NodeInfo]) -> Iterator[str | None]:
        """``targets``, each once its slot into it has come (probe_slots.py), soonest first;
        None where we stop meanwhile (then the round ends)."""
        pending, everyone = list(targets), {*members, self.peer_id}
        while pending:
            if self.probe_slot_s <= 0:
                peer, wait = pending[0], 0.0
            else:
                now = time.time()
                starts = {p: next_slot(now, self.peer_id, p, everyone, self.probe_slot_s)[0]
                          for p in pending}  # fmt: skip
                peer = min(pending, key=starts.__getitem__)
                wait = starts[peer] - now
            pending.remove(peer)
            if self._stop.wait(max(0.0, wait)):
                yield None
                return
            yield peer

    def _measured_by_lanes(self) -> set[str]:
        """Peers whose links our lanes' own frames measure (file_wire), so a probe would only
        take their bandwidth: a punched lane (a probe would cross the relay the libp2p
        connection still goes through), and a lane whose kernel-timed figure is fresh (a
        training link that its frames keep busy: on topology C the plan's links got a 1 MiB
        probe every round besides: 37% of a home's uplink, issue 25), unless our last bulk
        probe of it is older than half the book's max age: frames of 128 KiB on a 1 Gbit/s LAN
        end before the kernel's window opens, and alone they read it at 0.42-0.70 of its cap
        (topology B, session 14)."""
        now, mono, fresh_s = time.time(), time.monotonic(), self.book.max_age_s / 2
        return {
            peer
            for peer, wire in self._wire().items()
            if wire.punched
            or (
                now - wire.measured_at <= fresh_s
                and mono - self._bulk_at.get(peer, -math.inf) <= fresh_s
            )
        }

    def _probe(self, peer: str, nbytes: int) -> tuple[LinkSample | None, int]:
        """One measure of the link to ``peer`` and the bytes it sent: a bulk transfer on our
        lane to it (timed by the kernel, whoever has the CPU; the lane opened for it where none
        was, lane/prober.py), else the stream probe (no lane to be had: lanes off, relayed,
        refused); None if that failed."""
        # Full size on a lane whatever the stream probe's: the link's lane may be new (opened
        # to probe it), and 256 KiB on a new lane ends inside slow start (38-77 MB/s of 125 on
        # the testbed, 1 MiB 114-122: docs/testbed.md).
        lane_bytes = self.probe_bytes
        wire = self._lane_probe(peer, lane_bytes)
        if wire is not None:
            logger.debug("lane probe of %s: %.3g MB/s, rtt %.3g ms, %d bytes",
                         peer[:16], wire.bandwidth / 1e6, wire.rtt * 1e3, lane_bytes)  # fmt: skip
            sample = LinkSample(wire.bandwidth, wire.rtt, time.time(), punched=wire.punched)
            self._bulk_at[peer] = time.monotonic()
            self._lane_missed_at.pop(peer, None)
            # A probe of a far link goes on past slow start (lane/bulk.py): up to 4x the bytes.
            return sample, max(wire.probe_bytes, lane_bytes)
        # A member that has not built its trainer yet refuses lanes; its link waits a probe
        # interval for one rather than take the stream probe's figure (Python-paced: h1 -> h5
        # read 0.77 of 5 MB/s so at start, topology C, session 15). Lanes off or relayed: the
        # stream's, once the wait is over; the round's own wait ends then (_newly_probeable).
        mono = time.monotonic()
        if mono - self._lane_missed_at.setdefault(peer, mono) < self.lane_patience_s:
            self._lane_deferred.add(peer)
            return None, 0
        try:
            result = self.control.probe(peer, nbytes=nbytes)
        except (TransportError, FusionError) as exc:
            with self._lock:
                self._probes_failed += 1
            logger.debug("probe of %s failed: %s", peer[:16], exc)
            return None, 0
        logger.debug(
            "probe of %s: %.3g MB/s, rtt %.3g ms, %d bytes in %.3g ms",
            peer[:16], result.bandwidth / 1e6, result.rtt * 1e3, result.bytes,
            result.seconds * 1e3,
        )  # fmt: skip
        return LinkSample(result.bandwidth, result.rtt, time.time(), result.relayed), result.bytes

    def connect(self, members: dict[str, NodeInfo]) -> None:
        connected = set(self.control.connected_peers())
        missing = [p for p in sorted(members) if p != self.peer_id and p not in connected]
        room = max(0, self.max_connections - len(connected))
        self._rng.shuffle(missing)
        for peer in missing[:room]:
            for addr in members[peer].addrs[:2]:
                try:
                    self.control.connect(addr)
                    break
                except (TransportError, FusionError) as exc:
                    logger.debug("could not connect to %s at %s: %s", peer[:16], addr, exc)
