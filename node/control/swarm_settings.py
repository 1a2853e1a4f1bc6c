"""Settings every node of a swarm must share (the run, planning limits, timing), and their digest.

Nodes publish the digest in their record and plan only with peers that run the same settings,
so a node started with a different model or epoch length is visible but never planned for.
"""

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

from fusionllm.common.errors import ConfigError
from fusionllm.common.run_spec import MODELS, RunSpec
from fusionllm.dag.plan_records import PLANNERS
from fusionllm.dag.planner import PlanConfig
from fusionllm.dht.keys import check_swarm_name
from fusionllm.node.control.quiet import check_stride

__all__ = ["MODELS", "SwarmSettings"]


@dataclass(frozen=True, kw_only=True)
class SwarmSettings:
    swarm: str = "default"
    run: RunSpec = field(default_factory=RunSpec)  # what the swarm trains, and how
    min_stages: int = 1  # the planner tries no chain with fewer stages
    max_stages: int = 8
    max_replicas: int = 64  # data-parallel width per stage; the rest wait in backup
    compress: bool = True  # AdaTopK on the slowest links; False: every link dense (exact runs)
    # The planning method (dag/methods.py): "opfence", or a baseline that ignores links and
    # sends dense ("balanced", "naive"), for experiments against OP-Fence on the same swarm.
    planner: str = "opfence"
    min_peers: int = 1  # plan nothing until this many members are present (PlanConfig)
    heartbeat_s: float = 5.0  # a node refreshes its record this often
    ttl_s: float = 15.0  # ... and its record expires this long after the last refresh
    epoch_s: float = 10.0  # plan epochs: propose at the start, adopt at settle_fraction
    settle_fraction: float = 0.5
    switch_margin: float = 0.1  # keep the current plan unless a new one is this much faster
    # Every stage must checkpoint the same steps, or a crash finds no step that every stage
    # saved: part of the digest. 20 steps: see DEFAULT_CHECKPOINT_EVERY in
    # training/trainer_config.py.
    checkpoint_every: int = 20
    # An idle, stable swarm acts only every this many epochs, and refreshes its records less
    # often (node/control/quiet.py); 1: act every epoch always.
    quiet_max_stride: int = 16
    # A private swarm's key digest (common/swarm_key.py; never the key): keyed and open swarms,
    # or two keys, never plan together. "": an open swarm (its digest as before keys existed).
    key_digest: str = ""
    # What the members do with the plan: "train", or "serve" generation (node/serve/); a
    # serving node never plans with trainers. Out of the digest when "train" (as before).
    task: str = "train"

    def __post_init__(self) -> None:
        check_swarm_name(self.swarm)
        if self.task not in ("train", "serve"):
            raise ConfigError(f"task must be train or serve, got {self.task!r}")
        if not isinstance(self.key_digest, str) or not re.fullmatch(
            r"(|[0-9a-f]{16})", self.key_digest
        ):
            raise ConfigError(f"key_digest must be 16 hex digits or empty, got {self.key_digest!r}")
        if not isinstance(self.compress, bool):
            raise ConfigError(f"compress must be a bool, got {self.compress!r}")
        if self.planner not in PLANNERS:
            raise ConfigError(f"planner must be one of {sorted(PLANNERS)}, got {self.planner!r}")
        if not isinstance(self.min_peers, int) or self.min_peers < 1:
            raise ConfigError(f"min_peers must be an integer >= 1, got {self.min_peers!r}")
        if not isinstance(self.run, RunSpec):
            raise ConfigError(f"run must be a RunSpec, got {type(self.run).__name__}")
        for name in ("min_stages", "max_stages", "max_replicas"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_stages > self.max_stages:
            raise ConfigError(
                f"min_stages {self.min_stages} must be <= max_stages {self.max_stages}"
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
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(
                f"checkpoint_every must be an integer >= 0, got {self.checkpoint_every!r}"
            )
        check_stride(self.quiet_max_stride)
        if not 0 <= self.switch_margin < 1:
            raise ConfigError(f"switch_margin must be in [0, 1), got {self.switch_margin}")

    @property
    def suspect_after_s(self) -> float:
        """A record not refreshed for this long counts as a crashed node (3 missed beats)."""
        return min(self.ttl_s, 3 * self.heartbeat_s)

    def digest(self) -> str:
        fields = asdict(self) | {"run": self.run.shared_fields()}  # not where a folder lies
        if not self.key_digest:
            del fields["key_digest"]
        if self.task == "train":
            del fields["task"]
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def plan_config(self) -> PlanConfig:
        run = self.run
        return PlanConfig(
            micro_batches=run.micro_batches,
            batch_size=run.global_batch,
            graph_batch_size=1,
            compression=self.compress,
            planner=self.planner,
            min_peers=self.min_peers,
            min_stages=self.min_stages,
            max_stages=self.max_stages,
            # The runtime gives each replica whole micro-batches: never more replicas than that.
            max_replicas=min(self.max_replicas, run.micro_batches),
        )
