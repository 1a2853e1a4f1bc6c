"""What one tensor frame costs the CPU, on one side of a link: the planner's per-frame term.

A stage pays for every frame it sends (pack, seal, write) and receives (read, open, check,
decode) besides its operators: on topology C the planner's estimate was 0.58x of the measured
step, about 0.18 s a step of such work it did not model (issue 25). ``measure_frame_overhead``
times frames of a tiny activation's size, (8, 64, 64) fp32, written on a lane and read back
in this thread over a socket pair (the lane's own code both ways, no event loop), and halves
the round: the CPU a frame costs one side. Like the device's other figures, the fastest of a
few repeats counts (probe.undisturbed_seconds), and the node caches it with them.

A top-k frame's cost grows with the tensor it packs (the selection scans every element: 37-74
MB/s on 32-256 KB, 21-25 MB/s on 12.6 MB at load ~12, issue 25), so ``measure_topk_cost``
times AdaTopK frames at two sizes and fits a per-frame constant plus a per-dense-byte rate.
The round is halved as above: pack and unpack are charged to each end as their mean.
"""

import contextlib
import itertools
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import trio

from fusionllm.common.errors import ConfigError
from fusionllm.compression import ErrorFeedback, decode_frame, pack_tensor, parse_frame
from fusionllm.compression.adaptive import activation_codec
from fusionllm.compression.codecs import TopKCodec
from fusionllm.compression.limits import FrameLimits
from fusionllm.node.p2p.blocking_framing import read_exactly_blocking, read_head_blocking
from fusionllm.node.p2p.framing import FrameHeader, FrameKind, encode_head
from fusionllm.node.p2p.lane.seal import LANE_KEY_BYTES
from fusionllm.node.p2p.lane.stream import BlockingLaneReader, LaneWriter

_TIMEOUT_S = 30.0
# Top-k probe sizes: the tiny model's activation (torch.topk's path, below 64K elements) and
# 16x it (the sampled-threshold path GPT-2's cuts take); ratio under AdaTopK's dense fraction.
_TOPK_SMALL = (8, 64, 64)  # (B, T, C): 128 KiB in fp32
_TOPK_LARGE = (8, 64, 512)  # (B, T, C): 1 MiB in fp32
_TOPK_RATIO = 0.2
_BUFFER_BYTES = 4 << 20  # a whole frame fits in the pair's buffers: write, then read, one thread


@dataclass(frozen=True, kw_only=True)
class FrameProbeConfig:
    shape: tuple[int, ...] = (8, 64, 64)  # tiny's activation: (B, T, C), 128 KiB in fp32
    frames: int = 16  # per repeat
    repeats: int = 5
    topk_ratio: float | None = None  # None: dense fp32 (what a node caches); else AdaTopK's codec
    budget_s: float = 5.0  # no further repeat starts after this long (the first always runs)

    def __post_init__(self) -> None:
        if not 0 < self.budget_s <= 600:
            raise ConfigError(f"budget_s must be in (0, 600], got {self.budget_s}")
        if self.topk_ratio is not None and not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"topk_ratio must be in (0, 1], got {self.topk_ratio}")
        check_probe_shape(self.shape)
        if not 1 <= self.frames <= 10_000 or not 1 <= self.repeats <= 100:
            raise ConfigError(f"frames and repeats must be >= 1, got {self.frames}, {self.repeats}")


def check_probe_shape(shape: tuple[int, ...]) -> None:
    """A probe's tensor: 1-4 dims, each in [1, 4096] (ConfigError otherwise)."""
    if not shape or any(not 1 <= d <= 4096 for d in shape) or len(shape) > 4:
        raise ConfigError(f"shape must be 1-4 dims in [1, 4096], got {shape}")


def read_probe_frame(reader: BlockingLaneReader, *, max_body_bytes: int) -> torch.Tensor | None:
    """One frame off a probe's lane: read, opened, checked and decoded; None where the lane
    ended."""
    head = read_head_blocking(
        reader,
        max_body_bytes=max_body_bytes,
        stall_timeout_s=_TIMEOUT_S,
        idle_timeout_s=_TIMEOUT_S,
    )
    if head is None:
        return None
    body = read_exactly_blocking(reader, head[1], stall_timeout_s=_TIMEOUT_S)
    return decode_frame(parse_frame(body, limits=FrameLimits()))


def per_side(round_s: float, frames: int) -> float:
    """Seconds one side pays per frame, from ``frames`` written and read back in ``round_s``."""
    if not (round_s > 0 and frames >= 1):
        raise ValueError(f"need round_s > 0 and frames >= 1, got {round_s}, {frames}")
    return round_s / frames / 2


@dataclass(frozen=True, kw_only=True)
class TopkFrameCost:
    """One side's CPU for a top-k frame of a dense tensor of n bytes: per_frame + per_byte * n."""

    per_frame: float  # s
    per_byte: float  # s per byte of the dense tensor packed

    def __post_init__(self) -> None:
        for name in ("per_frame", "per_byte"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be finite and >= 0, got {value}")


def linear_cost(small: tuple[int, float], large: tuple[int, float]) -> TopkFrameCost:
    """The line through (bytes, seconds) at two sizes, its slope and intercept clamped to >= 0
    (timing noise can tilt a line from two points either way)."""
    (n1, t1), (n2, t2) = small, large
    if not (0 < n1 < n2 and t1 >= 0 and t2 >= 0):
        raise ValueError(f"need 0 < bytes small < large and times >= 0, got {small}, {large}")
    per_byte = max((t2 - t1) / (n2 - n1), 0.0)
    return TopkFrameCost(per_frame=max(t1 - per_byte * n1, 0.0), per_byte=per_byte)


def measure_topk_cost(rounds: int = 3, budget_s: float = 0.5) -> TopkFrameCost:
    """One side's CPU per AdaTopK frame, fitted from frames at two sizes: activations and
    gradients in turn, coded as their links code them (an activation at ratio <= 0.25 ternary,
    a gradient top-k with error feedback), so the fit is their mean. The sizes are timed in
    alternation and each keeps its fastest round: a load spike then hits one round of both,
    not all of one size (a fit from two points is fragile; measured on 2 loaded cores)."""
    sizes = ((_TOPK_SMALL, 4), (_TOPK_LARGE, 2))
    packers = [_adatopk_packer(shape, _TOPK_RATIO) for shape, _ in sizes]
    best = [math.inf, math.inf]
    deadline = math.inf  # set after the first round: its warm-ups (first calls) take longest
    for r in range(rounds):
        if time.perf_counter() > deadline:
            break
        for i, (shape, frames) in enumerate(sizes):
            config = FrameProbeConfig(shape=shape, frames=frames, repeats=1)
            seconds = _per_frame(packers[i], config, warm_up=2 if r == 0 else 0)
            best[i] = min(best[i], seconds)
        if r == 0:
            deadline = time.perf_counter() + budget_s
    (small, _), (large, _) = sizes
    return linear_cost((math.prod(small) * 4, best[0]), (math.prod(large) * 4, best[1]))


def _adatopk_packer(shape: tuple[int, ...], ratio: float) -> Callable[[], bytes]:
    """Frame bodies of an activation link, then a gradient link, in turn, at top-k ``ratio``."""
    activation, gradient = torch.randn(shape), torch.randn(shape)  # (B, T, C) each
    forward = activation_codec(activation.numel(), ratio)
    backward = TopKCodec(ratio=ratio)
    feedback, turn = ErrorFeedback(), itertools.count()

    def pack() -> bytes:
        if next(turn) % 2 == 0:
            return pack_tensor(activation, forward)
        return feedback.pack("gradient", gradient, backward)

    return pack


def measure_frame_overhead(config: FrameProbeConfig | None = None) -> float:
    """Seconds of CPU a frame costs one side (the fastest repeat's, halved)."""
    config = config or FrameProbeConfig()
    tensor = torch.randn(config.shape)  # (B, T, C)
    codec = None if config.topk_ratio is None else TopKCodec(ratio=config.topk_ratio)
    return _per_frame(lambda: pack_tensor(tensor, codec), config)


def _per_frame(pack: Callable[[], bytes], config: FrameProbeConfig, warm_up: int = 2) -> float:
    """One side's seconds per frame of the bodies ``pack`` makes, sent on a lane and read back,
    after ``warm_up`` untimed frames (allocations, a codec's first call; two: a packer may
    alternate codecs)."""
    header = FrameHeader(step=0, micro_batch=0, kind=FrameKind.ACTIVATION, stage=0)
    left, right = socket.socketpair()
    for sock in (left, right):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
    key = bytes(LANE_KEY_BYTES)
    writer = LaneWriter(trio.socket.from_stdlib_socket(left), key)
    reader = BlockingLaneReader(right, key)
    try:
        one = lambda: _frame_round(writer, reader, pack(), header)  # noqa: E731
        for _ in range(warm_up):
            one()
        times: list[float] = []
        deadline = time.perf_counter() + config.budget_s
        for _ in range(config.repeats):
            if times and time.perf_counter() > deadline:
                break
            started = time.perf_counter()
            for _ in range(config.frames):
                one()
            times.append(time.perf_counter() - started)
    finally:
        reader.close()
        with contextlib.suppress(Exception):
            trio.run(writer.close)
    return per_side(min(times), config.frames)


def _frame_round(
    writer: LaneWriter, reader: BlockingLaneReader, body: bytes, header: FrameHeader
) -> None:
    writer.write_frame((encode_head(header, len(body)), body), timeout=_TIMEOUT_S)
    if read_probe_frame(reader, max_body_bytes=len(body)) is None:
        raise ConfigError("the frame probe's lane ended early")
