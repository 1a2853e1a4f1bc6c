"""Settings every node of a swarm must share (model, batch, timing), and their digest.

Nodes publish the digest in their record and plan only with peers that run the same settings,
so a node started with a different model or epoch length is visible but never planned for.
"""

import hashlib
import json
from dataclasses import asdict, dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.dag.planner import PlanConfig
from fusionllm.dht.keys import check_swarm_name

MODELS = ("tiny", "small", "medium", "large", "xl")


@dataclass(frozen=True, kw_only=True)
class SwarmSettings:
    swarm: str = "default"
    model: str = "tiny"  # GPT-2 preset the swarm trains
    seq_len: int = 64
    batch_size: int = 8  # sequences per step, all micro-batches together
    micro_batches: int = 4
    max_stages: int = 8
    max_replicas: int = 64  # data-parallel width per stage; the rest wait in backup
    heartbeat_s: float = 5.0  # a node refreshes its record this often
    ttl_s: float = 15.0  # ... and its record expires this long after the last refresh
    epoch_s: float = 10.0  # plan epochs: propose at the start, adopt at settle_fraction
    settle_fraction: float = 0.5
    switch_margin: float = 0.1  # keep the current plan unless a new one is this much faster

    def __post_init__(self) -> None:
        check_swarm_name(self.swarm)
        if self.model not in MODELS:
            raise ConfigError(f"model must be one of {MODELS}, got {self.model!r}")
        for name in ("seq_len", "batch_size", "micro_batches", "max_stages", "max_replicas"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size < self.micro_batches:
            raise ConfigError(
                f"batch_size {self.batch_size} must be >= micro_batches {self.micro_batches}"
            )
        if not 0 < self.heartbeat_s <= self.ttl_s / 2:
            raise ConfigError(
                f"heartbeat_s {self.heartbeat_s} must be > 0 and at most ttl_s / 2 "
                f"({self.ttl_s / 2}): a record must survive one lost heartbeat"
            )
        if not self.epoch_s >= 0.5:
            raise ConfigError(f"epoch_s must be >= 0.5, got {self.epoch_s}")
        if not 0.1 <= self.settle_fraction <= 0.9:
            raise ConfigError(f"settle_fraction must be in [0.1, 0.9], got {self.settle_fraction}")
        if not 0 <= self.switch_margin < 1:
            raise ConfigError(f"switch_margin must be in [0, 1), got {self.switch_margin}")

    @property
    def suspect_after_s(self) -> float:
        """A record not refreshed for this long counts as a crashed node (3 missed beats)."""
        return min(self.ttl_s, 3 * self.heartbeat_s)

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def plan_config(self) -> PlanConfig:
        return PlanConfig(
            micro_batches=self.micro_batches,
            batch_size=self.batch_size,
            graph_batch_size=1,
            max_stages=self.max_stages,
            max_replicas=self.max_replicas,
        )
