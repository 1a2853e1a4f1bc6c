"""The members a node plans with: the swarm's records, read from the DHT and judged (epochs.py).

A member is a fresh record on our settings that is not suspected gone (quiet.py), planned as
every planner plans it (stretch.as_planned), and we count ourselves even before our own record
shows. The snapshot also says whom plans must leave out now (seating.py) and whether some
member reached the run's end. The epoch loop's thread reads; other threads (the trainer) ask
who is a member under a lock.
"""

import threading
import time
from collections.abc import Callable

from fusionllm.common.logs import get_logger
from fusionllm.dht.records import MAX_CLOCK_SKEW_S, NodeInfo
from fusionllm.node.control.agreement import epoch_at, fresh_members
from fusionllm.node.control.directory_view import Directory
from fusionllm.node.control.quiet import QuietNode
from fusionllm.node.control.seating import excluded
from fusionllm.node.control.stretch import as_planned
from fusionllm.node.control.swarm_settings import SwarmSettings

logger = get_logger(__name__)


class MemberSnapshot:
    def __init__(
        self,
        *,
        settings: SwarmSettings,
        peer_id: str,
        directory: Directory,
        own_info: Callable[[], NodeInfo],
        quiet: QuietNode,
        min_peers: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings, self.peer_id, self.directory = settings, peer_id, directory
        self._own_info, self.quiet, self.min_peers, self.clock = own_info, quiet, min_peers, clock
        self._lock = threading.Lock()
        self.members: dict[str, NodeInfo] = {}
        self.excluded: dict[str, list] = {}  # members kept out of plans now (seating.py)
        self.run_finished = False  # some member's record says the run reached its end
        self._read: tuple[int, dict[str, NodeInfo], float] | None = None  # (epoch, records, when)

    def read(self) -> dict[str, NodeInfo]:
        """Fresh members that run our settings (and ourselves, even before our record shows)."""
        read_at, everyone = self.clock(), self.directory.members(include_leaving=True)
        self._read = (epoch_at(self.clock(), self.settings.epoch_s), everyone, read_at)
        return self._judged(everyone, read_at)

    def recent(self, epoch: int) -> tuple[dict[str, NodeInfo], bool]:
        """(members, whether they come from records read earlier in ``epoch``): adopt reuses
        the records propose read at the epoch's start, judged as then (a DHT get costs ~20 ms
        of CPU; a stable swarm's records do not change within an epoch). Its caller reads
        afresh when a proposal is refused."""
        if self._read is not None and self._read[0] == epoch:
            return self._judged(self._read[1], self._read[2]), True
        return self.read(), False

    def _judged(self, everyone: dict[str, NodeInfo], read_at: float) -> dict[str, NodeInfo]:
        """Fresh members, judged at ``read_at`` (when our read began): a slow read is no news of
        a member (topology C, session 7: 5.4 s DHT reads on every node dropped a member)."""
        digest = self.settings.digest()
        members = fresh_members(everyone, digest=digest, now=read_at, max_skew_s=MAX_CLOCK_SKEW_S,
                                suspect_after_s=self.settings.suspect_after_s)  # fmt: skip
        if len(members) < len(everyone):
            logger.debug("%d records are stale, leaving or on other settings",
                         len(everyone) - len(members))  # fmt: skip
        self.quiet.drop_suspects(members)
        members[self.peer_id] = self._own_info()
        members = as_planned(members)  # paces as their plans saw them, stretches measured
        self.excluded = excluded(members, now=self.clock(), min_peers=self.min_peers)
        # Members that finished the run leave: their last records tell a backup it is over.
        if any(
            i.training and i.training.finished
            for i in everyone.values()
            if i.config_digest == digest
        ):
            self.run_finished = True
        with self._lock:
            self.members = members
        return members

    def members_now(self) -> dict[str, NodeInfo]:
        with self._lock:
            return dict(self.members)

    def is_member(self, peer: str) -> bool:
        with self._lock:
            return peer in self.members
