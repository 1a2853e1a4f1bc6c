"""Which parameters move between which peers when the swarm switches plans (pure).

Every member of the old plan holds its stage's parameters (replicas hold equal copies). In the
new plan a member needs its new stage's parameters: those it already held stay, each other
one comes from the old plan's first holder (lowest stage, then replica). Every old member
computes the same moves from the same two plans, so senders need no request, and a receiver
only needs to know what it lacks, which it knows without the old plan.
"""

from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.node.pipeline.mailbox import Role


@dataclass(frozen=True, order=True)
class Move:
    name: str  # canonical parameter name
    src: str  # peer id
    dst: str


def state_moves(
    old_peers: dict[Role, str],
    old_params: dict[int, frozenset[str]],  # old stage -> its canonical parameters
    new_peers: dict[Role, str],
    new_params: dict[int, frozenset[str]],
) -> list[Move]:
    """Every parameter copy the new plan needs from another peer, sorted."""
    held: dict[str, set[str]] = {}
    first_holder: dict[str, str] = {}
    for role in sorted(old_peers, key=lambda r: (r.stage, r.replica)):
        peer = old_peers[role]
        for name in sorted(old_params[role.stage]):
            held.setdefault(peer, set()).add(name)
            first_holder.setdefault(name, peer)
    moves = []
    for role, peer in new_peers.items():
        for name in new_params[role.stage]:
            if name in held.get(peer, ()):
                continue
            if name not in first_holder:
                raise ConfigError(f"no member of the old plan holds {name!r}")
            moves.append(Move(name, first_holder[name], peer))
    return sorted(moves)


def lacking(
    new_params: frozenset[str], held: frozenset[str]
) -> list[str]:  # what a new member must receive
    return sorted(new_params - held)
