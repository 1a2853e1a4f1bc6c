"""The planner's records: its settings, the plan it makes, and the plan's pipeline timings.

- ``PlanConfig``: training-step and search settings (validated on construction)
- ``StagePlan``, ``LinkPlan``, ``Plan``: a plan as every peer must agree on it; ``Plan.digest``
  hashes its canonical JSON
- ``pipeline_times``: a plan's stages and links as the simulator's ``PipelineTimes``
- ``InfeasiblePlanError``: no assignment fits in memory
"""

import hashlib
import json
import math
from dataclasses import asdict, dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.dag.simulate import PipelineTimes

# The planning methods a swarm may run (a swarm setting), and the ``Plan.method`` each makes.
PLANNERS = {"opfence": "op-fence", "balanced": "compute-balanced", "naive": "naive"}


class InfeasiblePlanError(ConfigError):
    """No assignment of the graph to the swarm fits in memory; the message gives the numbers."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """Training-step and search settings.

    The global batch (batch_size samples) is fixed: data-parallel replicas split each
    micro-batch, so every plan does the same work per step and step times compare directly.
    The graph's costs are for graph_batch_size samples and are scaled to a micro-batch.
    """

    micro_batches: int = 8
    batch_size: int = 8
    graph_batch_size: int = 1
    compression: bool = True  # AdaTopK on inter-stage links
    min_ratio: float = 0.01  # never keep fewer than 1% of elements (convergence)
    element_size: int = 4  # activations/gradients are fp32 in the graph's byte counts
    allow_fp16: bool = True
    grad_bytes_per_param_byte: float = 1.0  # fp32 grads for fp32 params
    optimizer_bytes_per_param_byte: float = 2.0  # AdamW: two fp32 moments per fp32 param
    memory_fraction: float = 0.9  # leave room for the CUDA context and allocator slack
    max_stages: int = 64
    # At least this many pipeline stages (a swarm that must exercise its pipeline, or whose
    # devices the operator knows better than the probe): fewer-stage chains are not tried.
    min_stages: int = 1
    # Data-parallel width cap per stage (each replica needs whole samples of a micro-batch,
    # and adds gradient averaging); the slowest members beyond it wait in backup.
    max_replicas: int = 64
    min_relative_speed: float = 0.05  # slower than this x the fence's fastest -> backup
    fence_levels: int = 6  # clustering thresholds tried (widest log-bandwidth gaps)
    # How stages are found (PLANNERS): OP-Fence, or a baseline that ignores links (balanced:
    # compute-balanced cuts; naive: even layer split in peer-id order). Baselines send dense.
    planner: str = "opfence"
    # Plan nothing for a swarm of fewer peers: a run that must start on the whole swarm (an
    # experiment) would otherwise train on the first node alone while the others join.
    min_peers: int = 1
    # A top-k frame's CPU per side over a dense one's (the per-frame figure nodes measure):
    # 6.07 ms against 0.76 for tiny's activation (benchmarks/frame_cost.py, session 6).
    topk_frame_factor: float = 8.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.topk_frame_factor) and self.topk_frame_factor >= 1.0):
            raise ConfigError(f"topk_frame_factor must be >= 1, got {self.topk_frame_factor}")
        if not isinstance(self.min_peers, int) or self.min_peers < 1:
            raise ConfigError(f"min_peers must be an integer >= 1, got {self.min_peers!r}")
        if self.planner not in PLANNERS:
            raise ConfigError(f"planner must be one of {sorted(PLANNERS)}, got {self.planner!r}")
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.batch_size < self.micro_batches:
            raise ConfigError(
                f"batch_size {self.batch_size} must be >= micro_batches {self.micro_batches}"
            )
        if self.graph_batch_size < 1:
            raise ConfigError(f"graph_batch_size must be >= 1, got {self.graph_batch_size}")
        if not 0.0 < self.min_ratio <= 1.0:
            raise ConfigError(f"min_ratio must be in (0, 1], got {self.min_ratio}")
        if self.element_size not in (1, 2, 4, 8):
            raise ConfigError(f"element_size must be 1, 2, 4 or 8, got {self.element_size}")
        if self.grad_bytes_per_param_byte < 0 or self.optimizer_bytes_per_param_byte < 0:
            raise ConfigError(
                "bytes per param byte must be >= 0, got grads "
                f"{self.grad_bytes_per_param_byte}, optimizer {self.optimizer_bytes_per_param_byte}"
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 1 <= self.min_stages <= self.max_stages:
            raise ConfigError(
                f"need 1 <= min_stages <= max_stages, got {self.min_stages}, {self.max_stages}"
            )
        if self.max_replicas < 1:
            raise ConfigError(f"max_replicas must be >= 1, got {self.max_replicas}")
        if not 0.0 <= self.min_relative_speed < 1.0:
            raise ConfigError(
                f"min_relative_speed must be in [0, 1), got {self.min_relative_speed}"
            )
        if self.fence_levels < 1:
            raise ConfigError(f"fence_levels must be >= 1, got {self.fence_levels}")

    @property
    def scale(self) -> float:
        """Graph costs -> one micro-batch."""
        return self.batch_size / self.micro_batches / self.graph_batch_size

    @property
    def static_factor(self) -> float:
        """Bytes held per parameter byte: the parameter, its gradient, the optimizer state."""
        return 1.0 + self.grad_bytes_per_param_byte + self.optimizer_bytes_per_param_byte


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    index: int
    start: int  # first node (index into GraphCosts.nodes)
    stop: int  # one past the last node
    node_ids: tuple[str, ...]
    fence: int  # index into Plan.fences
    peers: tuple[str, ...]  # data-parallel replicas
    shares: tuple[float, ...]  # fraction of each micro-batch each replica computes
    memory_bytes: tuple[int, ...]  # peak per replica
    forward_time: float  # per micro-batch, the fence as a whole
    backward_time: float
    allreduce_time: float  # per step


@dataclass(frozen=True, kw_only=True)
class LinkPlan:
    """The cut after stage ``src_stage``: what crosses it each micro-batch, each way."""

    src_stage: int
    src_peer: str  # the pair of peers that carries it (best measured pair)
    dst_peer: str
    dense_bytes: int
    forward_codec: str
    forward_ratio: float
    forward_wire_bytes: int
    forward_bandwidth: float
    forward_rtt: float
    backward_codec: str
    backward_ratio: float
    backward_wire_bytes: int
    backward_bandwidth: float
    backward_rtt: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    method: str
    fences: tuple[tuple[str, ...], ...]
    stages: tuple[StagePlan, ...]
    links: tuple[LinkPlan, ...]
    backup: tuple[str, ...]
    micro_batches: int
    estimated_step_time: float
    bubble_fraction: float

    def pipeline_times(self) -> PipelineTimes:
        return pipeline_times(self.stages, self.links, self.micro_batches)

    def to_dict(self) -> dict:
        return _canonical(asdict(self))

    def digest(self) -> str:
        """sha256 of the canonical JSON: identical on every peer that planned the same inputs."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value):
    """Floats to 12 significant digits so harmless last-bit noise cannot change a digest."""
    if isinstance(value, float):
        return float(f"{value:.12g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def pipeline_times(
    stages: tuple[StagePlan, ...],
    links: tuple[LinkPlan, ...],
    micro_batches: int,
    tails: tuple[float, ...] = (),
) -> PipelineTimes:
    """The simulator's view of a plan; ``tails``: per stage, uplink seconds after its
    schedule besides its all-reduce (tied_exchange.py), none by default."""
    tails = tails or (0.0,) * len(stages)
    return PipelineTimes(
        forward=tuple(s.forward_time for s in stages),
        backward=tuple(s.backward_time for s in stages),
        send_forward=tuple(x.forward_wire_bytes / x.forward_bandwidth for x in links),
        send_backward=tuple(x.backward_wire_bytes / x.backward_bandwidth for x in links),
        latency_forward=tuple(x.forward_rtt / 2 for x in links),
        latency_backward=tuple(x.backward_rtt / 2 for x in links),
        allreduce=tuple(s.allreduce_time + t for s, t in zip(stages, tails, strict=True)),
        micro_batches=micro_batches,
        bytes_forward=tuple(float(x.forward_wire_bytes) for x in links),
        bytes_backward=tuple(float(x.backward_wire_bytes) for x in links),
    )
