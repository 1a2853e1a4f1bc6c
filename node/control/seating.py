"""Which members a plan may seat: not observers, not members the swarm suspects.

Pure functions of the members' signed records and the clock, so every node that reads the
same records seats the same peers and the leaderless agreement does not split over it:

- an observer (its record's ``observer``) is never seated;
- nor a member nobody can dial (its ``reach`` is "private") until it names a relayed address
  (node/control/relay_use.py): peers next to it in a plan could not reach it;
- a member is kept out while enough of the members serving a plan with it suspect it (their
  records' ``suspects``, written by suspicion.py): at least half of the others that serve,
  and at least one. One member's word is then not enough to keep a peer out of a swarm where
  others trained with it, and a member left alone with a silent partner still goes on;
- a suspicion counts only from a member that was itself progressing: not from one whose
  record shows fewer steps than the suspect's (it is the one behind), and of two members that
  suspect each other, only from the one further along (at the same step, neither: nobody can
  tell who failed whom). In a plan of two, the member that stalled, crashed at the barrier or
  came late cannot keep its partner out by suspecting it back;
- a swarm that needs ``min_peers`` members (``--min-peers``) seats suspects rather than fall
  below it, the fewest accused first: keeping out a member it cannot train without stops every
  member for the whole backoff and trains nobody, while seating it costs one barrier's wait if
  it is still absent, and is how an honest member caught in a view split (topology C, session
  7: stuck until a host was killed) comes back at all. With ``--min-peers`` 1 (the default)
  this never applies: a member that never trains stays out, and the others train on.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from fusionllm.dht.records import NodeInfo, NodeState
from fusionllm.node.p2p.relay_addrs import relay_of


@dataclass(frozen=True)
class Accusation:
    by: str  # the member whose record suspects the peer
    reason: str
    until: float  # wall clock
    strikes: int


def accusations(members: Mapping[str, NodeInfo], *, now: float) -> dict[str, list[Accusation]]:
    """Suspicions in force now, by suspect, from members that train (observers' do not
    count: they wait for nobody)."""
    live = {
        by: {s.peer: s for s in info.suspects if s.until > now and s.peer != by}
        for by, info in members.items()
        if not info.observer
    }
    found: dict[str, list[Accusation]] = {}
    for by in sorted(live):
        for peer, s in sorted(live[by].items()):
            if peer in members and _counts(members, live, by, peer):
                found.setdefault(peer, []).append(Accusation(by, s.reason, s.until, s.strikes))
    return found


def _progress(info: NodeInfo) -> int:
    return info.training.step if info.training is not None else -1


def _counts(members: Mapping[str, NodeInfo], live: Mapping[str, Mapping], by: str, peer: str):
    """Whether ``by``'s suspicion of ``peer`` counts: ``by`` is not behind ``peer``, and if
    ``peer`` suspects ``by`` back, ``by`` is strictly ahead."""
    mine, theirs = _progress(members[by]), _progress(members[peer])
    mutual = by in live.get(peer, {})
    return mine > theirs or (mine == theirs and not mutual)


def excluded(
    members: Mapping[str, NodeInfo], *, now: float, min_peers: int = 1
) -> dict[str, list[Accusation]]:
    """The members kept out of plans now, with the accusations that keep them out; suspects
    that would leave fewer than ``min_peers`` members to seat are not (the module says why)."""
    out = {}
    for peer, accused in accusations(members, now=now).items():
        serving = [
            p
            for p, i in members.items()
            if p != peer and not i.observer and i.state is NodeState.SERVING
        ]
        if 2 * len(accused) >= max(1, len(serving)):
            out[peer] = accused
    room = sum(1 for p, i in members.items() if p not in out and _may_sit(i))
    # The least accused first, then the one whose suspicions end soonest: the same order on
    # every node, as the records are the same.
    waived = sorted(
        (p for p in out if _may_sit(members[p])),
        key=lambda p: (len(out[p]), max(a.until for a in out[p]), p),
    )[: max(0, min_peers - room)]
    return {p: accused for p, accused in out.items() if p not in waived}


def seatable(
    members: Mapping[str, NodeInfo], *, now: float, min_peers: int = 1
) -> dict[str, NodeInfo]:
    """The members a plan may seat now (``min_peers``: the swarm's, see ``excluded``)."""
    out = excluded(members, now=now, min_peers=min_peers)
    return {p: i for p, i in members.items() if p not in out and _may_sit(i)}


def _may_sit(info: NodeInfo) -> bool:
    """Whether a plan could seat ``info``'s node were nobody suspecting it."""
    return not info.observer and not _unreachable(info)


def _unreachable(info: NodeInfo) -> bool:
    return info.reach == "private" and not any(relay_of(a) for a in info.addrs)
