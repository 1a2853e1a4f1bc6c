"""A quiet swarm: how seldom an idle, stable swarm needs to act at all.

An epoch costs the swarm its members' DHT reads and proposal stores, and every heartbeat a
DHT store per node: at 16 nodes on 2 cores that is ~5% of a core per node for a swarm in which
nothing happens. When a node sees the same members follow the same plan (or none) epoch after
epoch and no member is training, it acts only every ``stride`` epochs (doubling up to the
settings' ``quiet_max_stride``), on epochs divisible by the stride, so every quiet node acts in
the same epochs as every other; in the epochs between it keeps following its plan without
reading. Its record says how much less often it refreshes (``NodeInfo.beat``, at most
``MAX_BEAT``): readers suspect it only after that many times the usual silence.

A change wakes a node back to acting every epoch:
- one it reads (members or the plan they follow differ; a member trains);
- a stranger connecting to it (a newcomer probes the members it read) or a member's connection
  dropping (links.py);
- a member's gossip saying it woke because it saw a change (a woken node tells the swarm).

A training swarm never goes quiet: a crash there must be seen within the usual silence.
``QuietCadence`` is pure bookkeeping over epoch numbers; ``QuietNode`` wraps it for the epoch
loop, with the doors other threads knock on (a wake, a suspect).
"""

import threading
from collections.abc import Callable, Collection, Hashable, Mapping

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dht.records import NodeInfo

logger = get_logger(__name__)

# How many times longer than ``heartbeat_s`` a quiet node's record may go unrefreshed (it
# lives as many TTLs: daemon.py lets the DHT keep it). A crash in a quiet swarm that drops no
# connection (a host gone silent) is seen this many times later; one that does is seen at once
# (links.py).
MAX_BEAT = 8
MAX_STRIDE = 64
# How many times further apart a quiet node's probe rounds may be (links.py); link figures
# then live as many times longer (HeldAge), or a quiet swarm's plan would age out of its book.
MAX_PROBE_STRETCH = 8
# Under the DHT's max_ttl_s (DhtConfig: 600 s), past which the validators refuse a record.
MAX_PROPOSAL_TTL_S = 480.0


def check_stride(value: object, name: str = "quiet_max_stride") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if not 1 <= value <= MAX_STRIDE or value & (value - 1):
        raise ConfigError(f"{name} must be a power of two in [1, {MAX_STRIDE}], got {value}")
    return value


def quiet_view(
    members: Mapping[str, NodeInfo], followed: str | None, *, own: str
) -> Hashable | None:
    """What must stay the same for a node to go quiet: who the members are and the plan all of
    them follow (None: no plan is feasible). None when the swarm is not idle and stable from
    here: a member trains, or some member follows another plan than ours."""
    for peer, info in members.items():
        if info.training is not None and not info.training.finished:
            return None
        if peer != own and (info.adopted[1] if info.adopted is not None else None) != followed:
            return None
    return frozenset(members), followed


class QuietCadence:
    """Which epochs a node acts in: all of them, or one in ``stride`` once quiet."""

    def __init__(self, max_stride: int) -> None:
        self.max_stride = check_stride(max_stride, "max_stride")
        self.stride = 1
        self._view: Hashable | None = None
        self._alert = False  # woken by a hint while quiet; see wake

    def acts(self, epoch: int) -> bool:
        return epoch % self.stride == 0

    def proposal_ttl_s(self, epoch_s: float) -> float:
        """How long a plan proposal stored now must live: past our next acting epoch (the
        stride may double before it), when it is stored again. At 4 epochs whatever the
        stride, a quiet swarm had no live proposal for most of each stride, and a status
        call then found the plan every member follows but no proposal to describe it."""
        return min((2 * self.stride + 3) * epoch_s, MAX_PROPOSAL_TTL_S)

    @property
    def beat(self) -> int:
        """How many heartbeats a record written now may skip (NodeInfo.beat)."""
        return min(self.stride, MAX_BEAT)

    def observed(self, view: Hashable | None) -> bool:
        """Note what an epoch we acted in saw (``quiet_view``); the stride doubles when it
        matches the last one and falls to 1 when it does not. True when the others should
        hear of it: a change seen by a node that was quiet, or woken to look for one."""
        changed = view is None or view != self._view
        tell = changed and (self.stride > 1 or self._alert)
        self.stride = 1 if changed else min(2 * self.stride, self.max_stride)
        self._view, self._alert = view, False
        return tell

    def wake(self, *, alert: bool) -> None:
        """Act every epoch again. ``alert``: we were woken by a hint of a change (a stranger,
        a lost member) rather than by a member who saw one: if the next epoch shows one,
        ``observed`` says to tell the swarm. The view is kept: an epoch that finds nothing
        changed lets the node go quiet again at once."""
        self._alert = self._alert or (alert and self.stride > 1)
        self.stride = 1


class HeldAge:
    """How old a link figure may be while the swarm is quiet: ``base_s`` times the probe
    stretch, and after a wake still the stretched age for ``base_s``, the time every node's
    resumed probe rounds take to bring fresh figures (a wake for nothing must not empty the
    book, or the plan fails its audit on default figures and the swarm re-plans). Pure."""

    def __init__(self, base_s: float) -> None:
        self.base_s = base_s
        self._factor, self._since = 1, 0.0

    def max_age(self, stretch: int, now: float) -> float:
        if stretch >= self._factor:
            self._factor, self._since = stretch, now
        elif now - self._since > self.base_s:
            self._factor = stretch
        return self.base_s * self._factor


class ConnectionWatch:
    """Hints of a change that a quiet node sees before its next read: a stranger connected
    to us (a newcomer connects to the members it read, to probe them) or a member we were
    connected to is not any more (it may have crashed). Pure: fed what the host reports."""

    def __init__(self) -> None:
        # Strangers connected at the last call: one who leaves and comes back is news again,
        # and the set is never larger than our connections.
        self._strangers: frozenset[str] = frozenset()
        self._members_connected: frozenset[str] = frozenset()

    def hint(
        self, connected: Collection[str], members: Collection[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """(strangers new since the last call, members whose connection dropped since), given
        who we are connected to now and the members (ourselves included)."""
        now, known = frozenset(connected), frozenset(members)
        strangers = now - known
        new, lost = strangers - self._strangers, (self._members_connected & known) - now
        self._strangers, self._members_connected = strangers, now & known
        return new, lost


class QuietNode:
    """A node's quiet state: the epoch loop asks it which epochs to sit out and tells it what
    each epoch it acted in saw; the gossip and probe threads wake it and name suspects."""

    def __init__(self, max_stride: int, *, own: str, tell_swarm: Callable[[], None]) -> None:
        self.cadence = QuietCadence(max_stride)  # the epoch loop's thread only
        self._own, self._tell_swarm = own, tell_swarm
        self._lock = threading.Lock()
        self._wake: bool | None = None  # a wake asked for by another thread: its alert
        self._suspects: dict[str, float] = {}  # quiet members gone from our connections

    def wake(self, *, alert: bool) -> None:
        """Act every epoch again from the next one (any thread; see QuietCadence.wake)."""
        with self._lock:
            self._wake = alert or self._wake is True

    def suspect(self, peer: str, since: float) -> None:
        """Count ``peer`` gone until a record of it written after ``since`` shows (any
        thread): a quiet member whose connection dropped and who cannot be reached."""
        with self._lock:
            self._suspects[peer] = since

    def drop_suspects(self, members: dict[str, NodeInfo]) -> None:
        """Remove the suspects from ``members``, forgetting those that wrote since."""
        with self._lock:
            for peer, since in list(self._suspects.items()):
                info = members.get(peer)
                if info is not None and info.time <= since:
                    del members[peer]
                else:  # it wrote since (it lives), or its record is gone anyway
                    del self._suspects[peer]

    def sits_out(self, epoch: int) -> bool:
        with self._lock:
            wake, self._wake = self._wake, None
        if wake is not None:
            self.cadence.wake(alert=wake)
        return not self.cadence.acts(epoch)

    def observe(
        self, members: Mapping[str, NodeInfo], followed: str | None, *, busy: bool = False
    ) -> None:
        """What an epoch we acted in saw; tells the swarm when it woke us for a change.
        ``busy``: we are about to plan, waiting only for links to be measured (link_wait.py),
        which wakes nobody: quiet, we would act once in up to ``max_stride`` epochs and the
        first plan would come that much later (topology B: 51 s after the last member was
        ready, 28-34 s in the runs that did not go quiet; session 16)."""
        before = self.cadence.stride
        view = None if busy else quiet_view(members, followed, own=self._own)
        if self.cadence.observed(view):
            logger.info("woke from quiet (acting every %d epochs): the swarm changed", before)
            self._tell_swarm()
        elif self.cadence.stride != before:
            logger.debug("acting every %d epochs", self.cadence.stride)
