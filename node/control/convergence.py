"""When nodes adopted different plans for the same epoch: follow the one most members follow.

Agreement (agreement.py) gives every node the same plan when their views agree. Views can
differ (a bandwidth sample one node has and another has not yet, a proposal one DHT replica
served and another missed), and then a node may rank a plan others refused, or refuse one they
took. Every node's record says which (epoch, digest) it adopted, so after an epoch each node
can count what the fresh members follow and, if it is in the minority, switch to the plurality
plan, provided it can run that plan itself (the caller passes the digests it accepts).

A node that was out-voted would otherwise re-adopt its own favourite at the next epoch and be
out-voted again, flapping every epoch; ``Outvoted`` keeps such digests out of its choice for a
few epochs. Every function here is pure: the same records give the same answer everywhere.
"""

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import NodeInfo


def tally(members: Iterable[NodeInfo], epoch: int) -> Counter[str]:
    """digest -> how many of ``members`` report having adopted it for ``epoch``."""
    return Counter(
        info.adopted[1] for info in members if info.adopted is not None and info.adopted[0] == epoch
    )


def most_followed(members: Collection[NodeInfo], *, since_epoch: int) -> str | None:
    """The digest more than half of ``members`` report following (adopted in ``since_epoch``
    or later); None if no digest has such a majority. A plurality is not enough: in a swarm of
    two, one liar's record would be half of it."""
    votes = Counter(
        info.adopted[1]
        for info in members
        if info.adopted is not None and info.adopted[0] >= since_epoch
    )
    best = min(votes, key=lambda d: (-votes[d], d), default=None)
    return best if best is not None and 2 * votes[best] > len(members) else None


def converge(own: str, votes: Mapping[str, int], acceptable: Collection[str]) -> str | None:
    """The digest to follow instead of ``own``, or None to keep ``own``.

    The most reported digest we can accept (ties: the lowest digest, as every node breaks
    them), and only if strictly more members report it than ``own``: two equal camps stay put
    rather than swap places.
    """
    best = min(
        (d for d in votes if d in acceptable and votes[d] > 0),
        key=lambda d: (-votes[d], d),
        default=None,
    )
    if best is None or best == own or votes[best] <= votes.get(own, 0):
        return None
    return best


@dataclass
class Outvoted:
    """Digests this node left for the majority's plan, kept out of its choice for a while."""

    hold_epochs: int = 4
    _since: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hold_epochs < 1:
            raise ConfigError(f"hold_epochs must be >= 1, got {self.hold_epochs}")

    def add(self, digest: str, epoch: int) -> None:
        self._since[digest] = epoch

    def holds(self, digest: str, epoch: int) -> bool:
        """Whether ``digest`` is still kept out at ``epoch``."""
        since = self._since.get(digest)
        return since is not None and epoch - since <= self.hold_epochs

    def prune(self, epoch: int) -> None:
        for digest in [d for d in self._since if not self.holds(d, epoch)]:
            del self._since[digest]
