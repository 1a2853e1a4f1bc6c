"""Which members plan afresh in an epoch: a few, those with the most spare CPU, the same on
every node.

Planning is the costliest part of an epoch, and every member's plan of one snapshot is the same
(the planner is deterministic), so a swarm of N members that all plan spends N times the CPU
to learn one answer. Who pays it matters too: on topology C (session 13) one ``propose`` took a
0.2-core home 5.5 s of wall time, longer than the experiment's 4 s epoch, and the quota it ate
held that home's link readings to 0.4-0.8 of the caps while the 0.8-core home planned the same
snapshot in a fraction of that. So the members that plan afresh are the ``count`` fastest by
the one CPU figure every record carries (the seconds its Python spends per operator, at the
pace it measured), equals in turn by a hash of (epoch, peer). A member that serves a stage
counts one class slower: its plan takes CPU from a stage the whole swarm waits for (C, the
same session: each plan on the seated 0.4-core h2 stretched its compute from ~0.02 to
0.10-0.19 s of wall time for a few steps, and those steps lifted the swarm's stretch to 2).

The rest re-propose the plan they follow and adopt what the planners propose. A member plans
for a change itself when its last epoch brought it no plan it could believe, or once the
change has waited ``max_gap`` turns (epochs.py): members that claim the fastest CPU and never
plan delay a broken plan's replacement by an epoch and a better plan by ``max_gap`` epochs,
no more.

Pure functions of the records: tests/unit/test_planners.py.
"""

import hashlib
import math
from collections.abc import Mapping

from fusionllm.dht.records import NodeInfo, NodeState


def cpu_class(info: NodeInfo) -> float:
    """How slow the member's Python is, in whole powers of two of its seconds per operator
    (its device's op overhead at its pace): hosts within ~1.4x of each other are equals.
    inf where the record has no figure (they plan last)."""
    per_op = info.device.op_overhead * info.pace
    return round(math.log2(per_op)) if per_op > 0 else math.inf


def planners(epoch: int, members: Mapping[str, NodeInfo], count: int) -> frozenset[str]:
    """The ``count`` members that plan afresh in ``epoch``: the fastest CPU class first (a
    member serving a stage one class slower), a different few of equals each epoch, the same
    on every node that sees the same records."""

    def rank(peer: str) -> tuple[float, bytes]:
        info = members[peer]
        seated = info.state is NodeState.SERVING
        return cpu_class(info) + seated, hashlib.sha256(f"{epoch}:{peer}".encode()).digest()

    return frozenset(sorted(members, key=rank)[:count])
