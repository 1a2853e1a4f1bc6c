"""What the plan agreement (epochs.py) needs of the swarm's DHT directory: a protocol, so that
the agreement runs on ``dht.directory.SwarmDirectory`` and on the tests' in-memory directory."""

from typing import Protocol

from fusionllm.dht.records import NodeInfo, PlanProposal


class Directory(Protocol):
    def members(self, *, include_leaving: bool = False) -> dict[str, NodeInfo]: ...
    def proposals(self, epoch: int) -> list[PlanProposal]: ...
    def propose(self, proposal: PlanProposal, *, ttl_s: float) -> bool: ...
