"""Where a client finds the serving chain: the plan most serving nodes follow, read from the DHT.

The client is not a member: it reads records as ``fusionllm status`` does (a client-mode DHT,
nothing written) and computes the route with ``layout.serving_route``, as the nodes do. A
plan names peer ids; their data-plane addresses come from their signed records. Whether a
peer serves what the route expects (model, span) is checked when a session opens on it.
"""

import collections
from dataclasses import dataclass

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dag.plan_wire import plan_from_json
from fusionllm.dht.client import DhtClient
from fusionllm.dht.directory import SwarmDirectory
from fusionllm.dht.records import NodeInfo
from fusionllm.node.control.status import followed_plan

logger = get_logger(__name__)
_LOOK_BACK = 20  # epochs before the newest adoption searched for the plan's proposal


def _no_signing(data: bytes) -> bytes:
    raise FusionError("a serving client never writes to the DHT")


@dataclass(frozen=True)
class SwarmPlan:
    digest: str
    stage_peers: list[tuple[str, ...]]
    backup: tuple[str, ...]  # the plan's backup pool: serving replicas too (layout.py)
    addrs: dict[str, tuple[str, ...]]  # peer id -> data-plane multiaddrs (alive members only)


def read_plan(client: DhtClient, swarm: str) -> SwarmPlan | None:
    """The most followed plan among the members and their addresses; None if no plan yet."""
    directory = SwarmDirectory(client, swarm=swarm, peer_id="serve-client", sign=_no_signing)
    members: dict[str, NodeInfo] = directory.members()
    votes = collections.Counter(m.adopted for m in members.values() if m.adopted)
    followed = followed_plan(votes)
    if followed is None:
        return None
    digest, epochs = followed
    # A quiet swarm's members follow a plan without storing it every epoch (quiet.py): the
    # last copy a routine planner stored lives 4 epochs, near the newest epoch adopted.
    newest = max(epochs)
    for epoch in sorted(set(epochs) | set(range(newest - _LOOK_BACK, newest + 2)), reverse=True):
        found = [p for p in directory.proposals(epoch) if p.digest == digest]
        if found:
            plan = plan_from_json(found[0].plan)
            return SwarmPlan(
                digest=digest,
                stage_peers=[s.peers for s in plan.stages],
                backup=plan.backup,
                addrs={p: m.addrs for p, m in members.items() if not m.observer},
            )
    logger.debug("plan %s is followed but its proposal is gone", digest[:12])
    return None
