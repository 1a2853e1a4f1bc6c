"""The planner's plan for a snapshot, memoized: snapshots are quantized (bandwidth.py), so most
epochs see the same inputs, and planning is the costliest part of an epoch."""

import hashlib

from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.methods import Plan, plan_for
from fusionllm.dag.plan_records import PlanConfig
from fusionllm.dag.swarm import Swarm


class PlanMemo:
    """``plan_for`` over the last ``size`` distinct swarms."""

    def __init__(self, costs: GraphCosts, config: PlanConfig, *, size: int = 4) -> None:
        self.costs, self.config, self.size = costs, config, size
        self._plans: dict[bytes, Plan] = {}

    def __call__(self, swarm: Swarm) -> Plan:
        key = hashlib.sha256(
            repr([(p.peer_id, p.device, p.uplink, p.downlink, p.rtt) for p in swarm.peers]).encode()
            + b"".join(a.tobytes() for a in (swarm.src, swarm.dst, swarm.bandwidth, swarm.rtt))
        ).digest()
        if key in self._plans:
            return self._plans[key]
        fresh = plan_for(self.costs, swarm, self.config)  # InfeasiblePlanError is not kept
        if len(self._plans) >= self.size:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = fresh
        return fresh
