"""The workload estimator: how long a stage takes on a device and a cut takes across a link.

Everything here is a pure function of the profiles, so the lead can calibrate ``DeviceProfile``
against measured torch timings without touching the planner. Units: seconds, bytes, bytes/s,
FLOP/s. A node's costs are for the batch its graph was traced with; ``scale`` multiplies the
batch-proportional parts (FLOPs, activations) for another batch size; parameters do not scale.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fusionllm.common.errors import ConfigError
from fusionllm.compression.wire_sizes import target_ratio, topk_wire_bytes
from fusionllm.dag.graph import OpNode

BYTES_PER_MBIT = 1e6 / 8


def mbps(megabits_per_s: float) -> float:
    """Megabits per second (how links are advertised) -> bytes per second (what we compute in)."""
    return megabits_per_s * BYTES_PER_MBIT


def _check_positive(owner: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{owner}: {name} must be finite and {bound}, got {value}")


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """What a device can do: achievable (not peak) FLOP/s, memory bandwidth and capacity."""

    name: str = "device"
    flops: float  # FLOP/s achieved on training kernels (calibrate: measured, not datasheet)
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    # Fixed cost of dispatching one operator in one pass (framework + kernel launch), seconds.
    # It dominates small models: GPT-2 tiny on a CPU ran 2.6x its roofline estimate without it.
    op_overhead: float = 0.0
    # CPU seconds one tensor frame costs one side of a link (pack or decode, seal or open,
    # the lane's write or read): measured by the node (node/control/frame_cost.py), paid per
    # frame a stage sends or receives, besides its operators (issue 25, topology C).
    frame_overhead: float = 0.0
    # A top-k frame's CPU, one side: a constant plus a rate per byte of the dense tensor it
    # packs (its selection scans every element); both 0: not measured, and the planner falls
    # back to PlanConfig.topk_frame_factor x frame_overhead.
    topk_frame_overhead: float = 0.0
    topk_byte_cost: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(self.name, "flops", self.flops)
        _check_positive(self.name, "memory_bandwidth", self.memory_bandwidth)
        _check_positive(self.name, "memory_bytes", self.memory_bytes)
        _check_positive(self.name, "op_overhead", self.op_overhead, allow_zero=True)
        _check_positive(self.name, "frame_overhead", self.frame_overhead, allow_zero=True)
        _check_positive(self.name, "topk_frame_overhead", self.topk_frame_overhead, allow_zero=True)
        _check_positive(self.name, "topk_byte_cost", self.topk_byte_cost, allow_zero=True)


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """One direction of a link: sustained bandwidth (bytes/s) and round-trip time (s)."""

    bandwidth: float
    rtt: float

    def __post_init__(self) -> None:
        # inf is allowed: a "link" inside one device (a fence of one peer) costs nothing.
        if not self.bandwidth > 0:
            raise ConfigError(f"link: bandwidth must be > 0, got {self.bandwidth}")
        _check_positive("link", "rtt", self.rtt, allow_zero=True)


@dataclass(frozen=True, kw_only=True)
class StageTime:
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def node_time(node: OpNode, device: DeviceProfile, *, scale: float = 1.0) -> StageTime:
    """Roofline time of one operator: the slower of its FLOPs and its memory traffic.

    Forward reads the parameters and writes the output; backward reads both again and writes
    their gradients, hence twice the traffic. Small element-wise ops are memory-bound, matmuls
    compute-bound; the max covers both without a per-op table. Each pass also pays the
    device's fixed per-operator overhead.
    """
    traffic = node.param_bytes + scale * node.output_bytes
    forward = max(scale * node.forward_flops / device.flops, traffic / device.memory_bandwidth)
    backward = max(
        scale * node.backward_flops / device.flops, 2 * traffic / device.memory_bandwidth
    )
    return StageTime(forward=forward + device.op_overhead, backward=backward + device.op_overhead)


def estimate_stage_time(
    nodes: Iterable[OpNode], device: DeviceProfile, *, scale: float = 1.0
) -> StageTime:
    """Forward and backward time of a sequence of operators run back to back on one device."""
    forward = backward = 0.0
    for node in nodes:
        t = node_time(node, device, scale=scale)
        forward += t.forward
        backward += t.backward
    return StageTime(forward=forward, backward=backward)


def stage_frames(stage: int, stages: int) -> int:
    """Frames stage ``stage`` of ``stages`` sends or receives per micro-batch and pass: forward
    it receives an activation (not the first) and sends one (not the last); backward the same
    in gradients, the other way."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage}")
    return int(stage > 0) + int(stage < stages - 1)


def frame_time(stage: int, stages: int, device: DeviceProfile) -> float:
    """The CPU seconds stage ``stage`` pays per micro-batch and pass for its frames."""
    return stage_frames(stage, stages) * device.frame_overhead


def topk_charge(
    frames: int,
    dense_bytes: float,
    *,
    dense_s: np.ndarray,
    per_frame: np.ndarray,
    per_byte: np.ndarray,
    factor: float,
) -> np.ndarray:
    """CPU seconds one end pays for ``frames`` top-k frames packing ``dense_bytes`` in all,
    beyond the dense frames' ``dense_s`` each it is already charged, per device (arrays alike).
    Where a device measured top-k frames: per_frame + per_byte x bytes each; else the older
    fixed ``factor`` x its dense frame (a peer that published no top-k figures)."""
    measured = (per_frame > 0) | (per_byte > 0)
    fitted = np.maximum(frames * (per_frame - dense_s) + per_byte * dense_bytes, 0.0)
    return np.where(measured, fitted, frames * dense_s * (factor - 1.0))


def transfer_time(nbytes: float, link: LinkProfile) -> float:
    """Time until ``nbytes`` sent now have arrived: serialisation plus half a round trip."""
    return nbytes / link.bandwidth + link.rtt / 2


@dataclass(frozen=True, kw_only=True)
class WireChoice:
    """What AdaTopK sends for one tensor: codec name, kept ratio and bytes on the wire."""

    codec: str  # "dense", "fp16" or "topk"
    ratio: float
    wire_bytes: int


def compressed_wire(
    dense_bytes: int,
    bandwidth: float,
    time_budget_s: float,
    *,
    min_ratio: float,
    element_size: int = 4,
    allow_fp16: bool = True,
) -> WireChoice:
    """The AdaTopK choice for a tensor of ``dense_bytes`` on a link, via compression.adaptive.

    ``target_ratio`` is the rule; here we only turn its ratio into bytes on the wire.
    """
    ratio = target_ratio(
        bandwidth,
        dense_bytes,
        time_budget_s,
        min_ratio=min_ratio,
        element_size=element_size,
        allow_fp16=allow_fp16,
    )
    if ratio < 1.0:
        numel = max(1, dense_bytes // element_size)
        return WireChoice(codec="topk", ratio=ratio, wire_bytes=topk_wire_bytes(numel, ratio))
    fits_dense = dense_bytes == 0 or bandwidth * time_budget_s >= dense_bytes
    if fits_dense or not allow_fp16 or element_size <= 2:
        return WireChoice(codec="dense", ratio=1.0, wire_bytes=int(dense_bytes))
    return WireChoice(codec="fp16", ratio=1.0, wire_bytes=int(dense_bytes) * 2 // element_size)


def min_wire_bytes(dense_bytes: int, *, min_ratio: float, element_size: int = 4) -> int:
    """The fewest bytes AdaTopK may put on the wire for this tensor (top-k at ``min_ratio``)."""
    if dense_bytes == 0:
        return 0
    numel = max(1, dense_bytes // element_size)
    return min(int(dense_bytes), topk_wire_bytes(numel, min_ratio))


def estimate_cut_time(
    dense_bytes: int,
    link: LinkProfile,
    *,
    time_budget_s: float | None = None,
    min_ratio: float = 0.01,
    element_size: int = 4,
    allow_fp16: bool = True,
) -> float:
    """Time to move one cut's tensor across a link; compressed by AdaTopK when given a budget."""
    if time_budget_s is None:
        return transfer_time(dense_bytes, link)
    choice = compressed_wire(
        dense_bytes,
        link.bandwidth,
        time_budget_s,
        min_ratio=min_ratio,
        element_size=element_size,
        allow_fp16=allow_fp16,
    )
    return transfer_time(choice.wire_bytes, link)


def allreduce_time(grad_bytes: float, replicas: int, link: LinkProfile) -> float:
    """Gradient averaging among ``replicas`` peers whose slowest used link is ``link``.

    Bandwidth term of a ring all-reduce (each peer sends and receives 2(R-1)/R of the
    gradient), latency term of a tree (2 log2 R hops): the better of the two well-known
    algorithms in each regime, which is what NCCL/gloo pick between.
    """
    if replicas <= 1 or grad_bytes <= 0:
        return 0.0
    bandwidth_term = 2 * (replicas - 1) / replicas * grad_bytes / link.bandwidth
    latency_term = 2 * math.ceil(math.log2(replicas)) * link.rtt / 2
    return bandwidth_term + latency_term
