"""What a frame costs a stage as the runtime pays it: over TCP, through a reader thread, between
two slices of compute.

``frame_cost.measure_frame_overhead`` times a frame alone: written and read back in one thread
over a socket pair, the fastest repeat. On the testbed's B hosts the runtime paid ~1.1 ms of
CPU a frame side where that probe read 0.16 ms, and a cold swarm's first plan, made on the
model alone, read 0.46-0.74 of its steps (docs/testbed.md, session 18). Measured on this
machine's CPU (session 19): over loopback TCP with a reader thread handing the tensor over,
a frame alone costs 0.37-0.49 ms a side; put between slices of compute as a stage's schedule
puts it, compute and frames together take 0.53-0.91 ms a side more CPU than the compute alone,
presumably as the frame's bytes and wake-ups take the compute's cache. Over a socket pair the
same reads about the same (0.30-0.32 ms against TCP's 0.31-0.35, alternating, at a moment the
machine read low); the probe takes loopback TCP as the runtime's lanes do, and a socket pair
where loopback is down.

So ``measure_frame_beside_compute`` alternates rounds of a compute slice alone and rounds of
the same slice followed by a frame sent on a lane over loopback TCP and taken from a reader
thread (the runtime's own lane code both ways, the tensor handed over as the mailbox hands it),
counts the CPU both threads used (per-thread clocks: the daemon's other threads do not count)
and keeps the median of each pair's difference, halved: one side's CPU per frame, beside
compute. CPU time, not wall time, so a core shared with others reads the work, not the wait;
the median of pairs, not the fastest round, as a difference of two fastest rounds can read
anything down to zero. The compute slice is the CPU's (a GPU node's frames are still packed,
sealed and decoded on its CPU).
"""

import contextlib
import math
import queue
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import trio

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.compression import pack_tensor
from fusionllm.node.control.frame_cost import check_probe_shape, read_probe_frame
from fusionllm.node.p2p.framing import FrameHeader, FrameKind, encode_head
from fusionllm.node.p2p.lane.seal import LANE_KEY_BYTES
from fusionllm.node.p2p.lane.stream import BlockingLaneReader, LaneWriter

logger = get_logger(__name__)

_TIMEOUT_S = 30.0
# The compute slice: fwd+bwd of a few linear layers, ~3 ms on one core here; a GPT-2 tiny
# stage computes ~2 ms a micro-batch and pass on the testbed's hosts.
_WIDTH, _ROWS, _LAYERS = 128, 512, 4


@dataclass(frozen=True, kw_only=True)
class BesideConfig:
    shape: tuple[int, ...] = (8, 64, 64)  # tiny's activation: (B, T, C), 128 KiB in fp32
    rounds: int = 5  # pairs of rounds: compute alone, then compute and frames
    iterations: int = 16  # compute slices (and frames) per round
    budget_s: float = 5.0  # no further pair starts after this long (the first always runs)

    def __post_init__(self) -> None:
        check_probe_shape(self.shape)
        if not 1 <= self.rounds <= 100 or not 1 <= self.iterations <= 10_000:
            raise ConfigError(
                f"rounds and iterations must be >= 1, got {self.rounds}, {self.iterations}"
            )
        if not 0 < self.budget_s <= 600:
            raise ConfigError(f"budget_s must be in (0, 600], got {self.budget_s}")


def per_side_beside(alone_s: list[float], with_frames_s: list[float], frames: int) -> float:
    """One side's CPU per frame from paired rounds of ``frames`` compute slices each, alone and
    with a frame after each: the median pair's difference over the frames, halved (a frame is
    paid by its writer and its reader); never below 0 (noise can turn a pair either way)."""
    if not alone_s or len(alone_s) != len(with_frames_s) or frames < 1:
        raise ValueError(f"need equal, non-empty pairs and frames >= 1, got {alone_s}, "
                         f"{with_frames_s}, {frames}")  # fmt: skip
    values = [*alone_s, *with_frames_s]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"need finite CPU seconds >= 0, got {values}")
    differences = [b - a for a, b in zip(alone_s, with_frames_s, strict=True)]
    return max(statistics.median(differences), 0.0) / frames / 2


class _Reader:
    """The lane's reading end in its own thread, as the runtime's lane thread: each frame read,
    opened, checked and decoded, then handed over through a queue."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self._reader = BlockingLaneReader(sock, key)
        self.frames: queue.Queue[torch.Tensor] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="frame-beside", daemon=True)
        self._thread.start()
        self.clock = time.pthread_getcpuclockid(self._thread.ident)

    def _serve(self) -> None:
        with contextlib.suppress(OSError, ConfigError):
            while (tensor := read_probe_frame(self._reader, max_body_bytes=64 << 20)) is not None:
                self.frames.put(tensor)

    def close(self) -> None:
        self._reader.close()
        self._thread.join(timeout=_TIMEOUT_S)


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        left = socket.create_connection(server.getsockname(), timeout=_TIMEOUT_S)
        right, _ = server.accept()
    for sock in (left, right):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
    return left, right


def _compute_slice() -> Callable[[], None]:
    layers = torch.nn.Sequential(*(torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(_LAYERS)))
    x = torch.randn(_ROWS, _WIDTH, requires_grad=True)  # (R, W)
    return lambda: layers(x).sum().backward()


def measure_frame_beside_compute(config: BesideConfig | None = None) -> float:
    """Seconds of CPU a dense frame costs one side beside compute (see the module's doc)."""
    config = config or BesideConfig()
    tensor = torch.randn(config.shape)  # (B, T, C)
    header = FrameHeader(step=0, micro_batch=0, kind=FrameKind.ACTIVATION, stage=0)
    compute = _compute_slice()
    try:
        left, right = _loopback_pair()
    except OSError as exc:  # a namespace whose loopback is down: time what can be timed
        logger.warning("frame probe: no loopback TCP (%s); timing over a socket pair", exc)
        left, right = socket.socketpair()
    key = bytes(LANE_KEY_BYTES)
    writer = LaneWriter(trio.socket.from_stdlib_socket(left), key)
    reader = _Reader(right, key)

    def frame() -> None:
        body = pack_tensor(tensor, None)
        writer.write_frame((encode_head(header, len(body)), body), timeout=_TIMEOUT_S)
        reader.frames.get(timeout=_TIMEOUT_S)

    def cpu() -> float:  # this thread's and the reader's: the daemon's others do not count
        return time.thread_time() + time.clock_gettime(reader.clock)

    def round_s(with_frames: bool) -> float:
        start = cpu()
        for _ in range(config.iterations):
            compute()
            if with_frames:
                frame()
        return cpu() - start

    try:
        for _ in range(2):  # warm-up: allocations, the first calls
            compute()
            frame()
        alone, with_frames = [], []
        deadline = time.perf_counter() + config.budget_s
        for _ in range(config.rounds):
            if alone and time.perf_counter() > deadline:
                break
            alone.append(round_s(False))
            with_frames.append(round_s(True))
    finally:
        with contextlib.suppress(Exception):
            trio.run(writer.close)
        reader.close()
    return per_side_beside(alone, with_frames, config.iterations)
