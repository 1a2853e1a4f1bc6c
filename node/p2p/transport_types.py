"""The data plane's configuration and values: what a Transport is given and gives back.

``TransportConfig`` (validated on construction), ``TensorSpec`` (what a receiver expects),
``Received`` (a frame taken from the inbox), ``PeerStats`` and ``PeerCounters`` (per-peer
counters shared by the trio thread and callers, always behind one lock).
"""

import queue
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fusionllm.common.errors import ConfigError, FrameError
from fusionllm.compression import DEFAULT_LIMITS, FrameLimits
from fusionllm.compression.frame import max_encoded_bytes
from fusionllm.node.errors import DeadlineError, TransportClosedError
from fusionllm.node.p2p.checks import boolean, int_in, positive_seconds
from fusionllm.node.p2p.framing import MAX_BODY_BYTES, FrameHeader
from fusionllm.node.p2p.limits import RateFloorConfig
from fusionllm.node.p2p.peer_host import HostConfig, host_config_of


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Everything the data plane needs; all deadlines in seconds.

    ``key_path``, ``listen_*``, ``dial_timeout_s`` and ``close_timeout_s`` are also the host's
    (``host_config()``) when the transport runs a host of its own; attached to a node's
    PeerHost, the host's own config rules where it listens and how it negotiates.
    """

    key_path: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: a free port
    dial_timeout_s: float = 10.0  # connect + security + muxer + protocol negotiation
    read_timeout_s: float = 10.0  # longest silence allowed *inside* a frame
    write_timeout_s: float = 60.0  # one whole frame, including opening the stream
    idle_timeout_s: float = 600.0  # an inbound stream with no frame for this long is closed
    close_timeout_s: float = 5.0
    max_frame_bytes: int = 256 << 20  # the pack_tensor bytes of one frame
    max_in_flight: int = 4  # frames per peer and direction not yet written / not yet taken
    max_streams_per_peer: int = 8
    max_inbound_streams: int = 256  # all peers together
    inbox_size: int = 64  # received frames waiting for recv(), all peers together
    # Frames decoding to more than this are decoded off the trio thread (whatever their size
    # on the wire: a few bytes of top-k may expand to a large tensor).
    decode_in_thread_bytes: int = 4 << 20
    max_decoded_bytes: int = 256 << 20  # a frame nobody expects may expand to this at most
    # Decode into page-locked host memory: a CUDA node's frames then go to the device in one
    # asynchronous copy, with no staging copy (compute.Staging). Needs CUDA.
    pin_decoded: bool = False
    # Bodies announced (length read) but not yet decoded, per peer and all peers together.
    max_peer_pending_bytes: int = 512 << 20
    max_pending_bytes: int = 1 << 30
    # A body must arrive at this rate, measured over windows of rate_window_s.
    min_body_rate_bytes_s: float = 32 << 10  # 256 kbit/s: 1/32 of the slowest paper link
    rate_window_s: float = 10.0
    limits: FrameLimits = DEFAULT_LIMITS
    # Lanes (lane/): frames to a peer go over a TCP connection of their own, sealed with a
    # key exchanged over Noise, instead of through py-libp2p's yamux and noise in Python
    # (~5x the frames per second here). Off, or when a peer offers none or its lane port
    # cannot be reached (NAT, relays), frames use a libp2p tensor stream.
    lanes: bool = True
    lane_port: int = 0  # where this node accepts lanes; 0: a free port
    # The port offers name, where a forward to lane_port listens (0: the bound port).
    lane_announce_port: int = 0
    lane_timeout_s: float = 3.0  # to set a lane up, and for a connection to show its token
    lane_retry_s: float = 60.0  # after a lane to a peer failed, streams only for this long

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_path", Path(self.key_path))
        self.host_config()  # the host's fields are checked in one place: HostConfig
        for name in ("read_timeout_s", "write_timeout_s"):
            positive_seconds(name, getattr(self, name))
        positive_seconds("idle_timeout_s", self.idle_timeout_s, allow_inf=True)
        if not 64 <= self.max_frame_bytes <= MAX_BODY_BYTES:
            raise ConfigError(
                f"max_frame_bytes must be in [64, {MAX_BODY_BYTES}], got {self.max_frame_bytes}"
            )
        for name in ("max_in_flight", "max_streams_per_peer", "max_inbound_streams", "inbox_size"):
            if not 1 <= getattr(self, name) <= 1 << 16:
                raise ConfigError(f"{name} must be in [1, 65536], got {getattr(self, name)}")
        if self.decode_in_thread_bytes < 0:
            raise ConfigError(
                f"decode_in_thread_bytes must be >= 0, got {self.decode_in_thread_bytes}"
            )
        if self.max_decoded_bytes < 1:
            raise ConfigError(f"max_decoded_bytes must be >= 1, got {self.max_decoded_bytes}")
        if not self.max_body_bytes <= self.max_peer_pending_bytes <= self.max_pending_bytes:
            raise ConfigError(
                "need max_frame_bytes <= max_peer_pending_bytes <= max_pending_bytes, got "
                f"{self.max_body_bytes}, {self.max_peer_pending_bytes}, {self.max_pending_bytes}"
            )
        self.rate_floor()  # checks min_body_rate_bytes_s and rate_window_s
        boolean("lanes", self.lanes)
        boolean("pin_decoded", self.pin_decoded)
        int_in("lane_port", self.lane_port, 0, 65535)
        int_in("lane_announce_port", self.lane_announce_port, 0, 65535)
        positive_seconds("lane_timeout_s", self.lane_timeout_s)
        positive_seconds("lane_retry_s", self.lane_retry_s)

    @property
    def max_body_bytes(self) -> int:
        return min(self.max_frame_bytes, self.limits.max_frame_bytes)

    def rate_floor(self) -> RateFloorConfig:
        """The minimum rate of a body (raises ConfigError for bad fields)."""
        return RateFloorConfig(
            min_bytes_per_s=self.min_body_rate_bytes_s, window_s=self.rate_window_s
        )

    def host_config(self) -> HostConfig:
        """The host a standalone transport runs (raises ConfigError for bad fields)."""
        return host_config_of(self)


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects for a frame; anything else is the peer's fault."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def max_body_bytes(self) -> int:
        """The longest body any codec needs for it; 0 for a spec that matches nothing."""
        return max_encoded_bytes(self.dtype, self.shape)

    def check(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise FrameError(
                f"expected {self.dtype} {list(self.shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )


# For each received header: the spec its tensor must match, or None to accept any.
SpecFor = Callable[[FrameHeader], TensorSpec | None]

# Whether a peer may open tensor streams to us at all (asked at stream open, trio thread).
AdmitPeer = Callable[[str], bool]

# Takes a received frame in the host's thread, as soon as it is decoded (``Transport.deliver_to``):
# True if it took it, False to leave it for ``recv``. It must be quick and never block: it
# runs between the reads of every peer's frames.
Deliver = Callable[["Received"], bool]


@dataclass(frozen=True)
class Received:
    peer: str
    header: FrameHeader
    tensor: torch.Tensor


@dataclass(frozen=True)
class PeerStats:
    frames_in: int
    frames_out: int
    bytes_in: int
    bytes_out: int
    errors: dict[str, int]  # error type name -> count, for frames/streams this peer broke
    streams_ended_by_peer: int  # our outbound streams it reset or closed (refusals among them)

    @classmethod
    def of(cls, counters) -> "PeerStats":
        """A snapshot of live counters (any object with these fields; call under their lock)."""
        return cls(
            frames_in=counters.frames_in,
            frames_out=counters.frames_out,
            bytes_in=counters.bytes_in,
            bytes_out=counters.bytes_out,
            errors=dict(counters.errors),
            streams_ended_by_peer=counters.streams_ended_by_peer,
        )


@dataclass
class _Counters:
    frames_in: int = 0
    frames_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: Counter = field(default_factory=Counter)
    streams_ended_by_peer: int = 0
    inbound_streams: int = 0


class PeerCounters:
    """Per-peer counters; the trio thread writes, any thread reads, every access locked.

    ``retire`` moves a peer that went away to a table of the last ``keep_gone`` gone peers,
    so its figures stay readable for a while but a stream of identities cannot grow memory.
    """

    def __init__(self, *, keep_gone: int = 64) -> None:
        self._lock = threading.Lock()
        self._by_peer: dict[str, _Counters] = {}
        self._gone: OrderedDict[str, _Counters] = OrderedDict()
        self._keep_gone = keep_gone

    def sent(self, peer: str, nbytes: int) -> None:
        with self._lock:
            counters = self._of(peer)
            counters.frames_out += 1
            counters.bytes_out += nbytes

    def received(self, peer: str, nbytes: int) -> None:
        with self._lock:
            counters = self._of(peer)
            counters.frames_in += 1
            counters.bytes_in += nbytes

    def error(self, peer: str, exc: BaseException) -> None:
        with self._lock:
            self._of(peer).errors[type(exc).__name__] += 1

    def stream_ended(self, peer: str) -> None:
        with self._lock:
            self._of(peer).streams_ended_by_peer += 1

    def open_inbound(self, peer: str, limit: int) -> bool:
        """Count one more inbound stream from ``peer``; False (not counted) at ``limit``."""
        with self._lock:
            counters = self._of(peer)
            if counters.inbound_streams >= limit:
                return False
            counters.inbound_streams += 1
            return True

    def close_inbound(self, peer: str) -> None:
        with self._lock:
            self._of(peer).inbound_streams -= 1

    def inbound_of(self, peer: str) -> int:
        with self._lock:
            counters = self._by_peer.get(peer)
            return counters.inbound_streams if counters is not None else 0

    def retire(self, peer: str) -> None:
        """``peer`` went away: keep its figures among the last gone peers' only."""
        with self._lock:
            counters = self._by_peer.get(peer)
            if counters is None or counters.inbound_streams:
                return
            del self._by_peer[peer]
            self._gone[peer] = counters
            while len(self._gone) > self._keep_gone:
                self._gone.popitem(last=False)

    def live_peers(self) -> int:
        with self._lock:
            return len(self._by_peer)

    def snapshot(self) -> dict[str, PeerStats]:
        with self._lock:
            every = {**self._gone, **self._by_peer}
            return {peer: PeerStats.of(c) for peer, c in every.items()}

    def _of(self, peer: str) -> _Counters:
        # Called with self._lock held. A peer that comes back takes its old figures along.
        counters = self._by_peer.get(peer)
        if counters is None:
            counters = self._gone.pop(peer, None) or _Counters()
            self._by_peer[peer] = counters
        return counters


CLOSED = object()  # put in an inbox when its transport stops, to wake a blocked recv()


def take_from_inbox(inbox: "queue.Queue", timeout: float | None):
    """The next item of a transport's inbox: DeadlineError if none within ``timeout``,
    TransportClosedError once the transport closed (the marker stays for the next waiter)."""
    try:
        item = inbox.get(timeout=timeout)
    except queue.Empty:
        raise DeadlineError(f"no frame received within {timeout}s") from None
    if item is CLOSED:
        inbox.put(CLOSED)
        raise TransportClosedError("transport closed")
    return item
