"""Length-prefixed frames on a byte stream: a fixed prefix, a small msgpack header, a body.

    prefix  (7 bytes, big-endian): version u8 | header length u16 | body length u32
    header  msgpack map {"step": int, "micro_batch": int, "kind": str, "stage": int}
    body    the bytes of one ``pack_tensor`` frame (validated later by ``unpack_tensor``)

The prefix is checked against the limits before the header or the body is read, so a peer
cannot make us allocate or wait for more than ``max_body_bytes``. py-libp2p's ``read(n)``
returns at most one muxer frame (~64 KiB), so every read here loops until it has exactly the
bytes it needs, each read under a stall deadline.
"""

import enum
import math
import struct
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import trio

from fusionllm.common.errors import FrameError
from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.limits import RateFloor, RateFloorConfig

FRAMING_VERSION = 1
PREFIX = struct.Struct(">BHI")
PREFIX_BYTES = PREFIX.size
MAX_HEADER_BYTES = 256
MAX_BODY_BYTES = 2**32 - 1  # what the u32 length can say
MAX_STEP = 2**63 - 1
MAX_MICRO_BATCH = 2**32 - 1
MAX_STAGE = 2**16 - 1
# With batch_s, a read that returned less than this while at least _BATCH_MIN_LEFT_BYTES are
# still to come is followed by a pause (see read_exactly).
_BATCH_CHUNK_BYTES = 512 << 10
_BATCH_MIN_LEFT_BYTES = 1 << 20
_HEADER_KEYS = frozenset({"step", "micro_batch", "kind", "stage"})


class FrameKind(enum.StrEnum):
    ACTIVATION = "activation"
    GRADIENT = "gradient"
    CONTROL = "control"
    # Bytes to be thrown away: a lane's bulk probe (lane/bulk.py) fills the link with them so
    # the kernel can time it. Only a lane's reader takes them (lane/serve.py), and only up to
    # MAX_FILLER_BYTES a frame; a stream refuses them (inbound.py).
    FILLER = "filler"


_KINDS = {kind.value: kind for kind in FrameKind}
MAX_FILLER_BYTES = 4 << 20


@dataclass(frozen=True, kw_only=True)
class FrameHeader:
    """What a frame is about; the tensor itself travels in the body."""

    step: int
    micro_batch: int
    kind: FrameKind
    stage: int

    def __post_init__(self) -> None:
        problem = _header_problem(self.step, self.micro_batch, self.kind, self.stage)
        if problem is not None:
            raise ValueError(problem)
        # Accept the plain string too, but always hold the enum.
        object.__setattr__(self, "kind", _KINDS[self.kind])

    def to_wire(self) -> bytes:
        return msgpack.packb(
            {
                "step": self.step,
                "micro_batch": self.micro_batch,
                "kind": self.kind.value,
                "stage": self.stage,
            },
            use_bin_type=True,
        )

    @classmethod
    def from_wire(cls, data: bytes | bytearray | memoryview) -> "FrameHeader":
        """The header a peer sent; FrameError for anything but the exact expected map."""
        if len(data) > MAX_HEADER_BYTES:
            raise FrameError(f"frame header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            fields = msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=True,
                max_str_len=32,
                max_bin_len=0,
                max_array_len=0,
                max_map_len=len(_HEADER_KEYS),
                max_ext_len=0,
            )
        except Exception as exc:  # msgpack raises many types for bad input; all mean the same
            raise FrameError(f"frame header is not valid msgpack: {exc}") from exc
        if not isinstance(fields, dict) or fields.keys() != _HEADER_KEYS:
            keys = sorted(map(str, fields)) if isinstance(fields, dict) else type(fields).__name__
            raise FrameError(f"frame header must be a map of {sorted(_HEADER_KEYS)}, got {keys}")
        problem = _header_problem(
            fields["step"], fields["micro_batch"], fields["kind"], fields["stage"]
        )
        if problem is not None:
            raise FrameError(f"bad frame header: {problem}")
        return cls(
            step=fields["step"],
            micro_batch=fields["micro_batch"],
            kind=_KINDS[fields["kind"]],
            stage=fields["stage"],
        )


def _is_int(value: Any) -> bool:
    # bool is an int subclass; a peer sending True for a step is malformed, not step 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _header_problem(step: Any, micro_batch: Any, kind: Any, stage: Any) -> str | None:
    for name, value, top in (
        ("step", step, MAX_STEP),
        ("micro_batch", micro_batch, MAX_MICRO_BATCH),
        ("stage", stage, MAX_STAGE),
    ):
        if not _is_int(value) or not 0 <= value <= top:
            return f"{name} must be an integer in [0, {top}], got {value!r}"
    if not isinstance(kind, str) or kind not in _KINDS:
        return f"kind must be one of {sorted(_KINDS)}, got {kind!r}"
    return None


def encode_head(header: FrameHeader, body_len: int) -> bytes:
    """The prefix and header to write before a body of ``body_len`` bytes."""
    if not 1 <= body_len <= MAX_BODY_BYTES:
        raise ValueError(f"body length must be in [1, {MAX_BODY_BYTES}], got {body_len}")
    head = header.to_wire()
    return PREFIX.pack(FRAMING_VERSION, len(head), body_len) + head


def parse_prefix(prefix: bytes | bytearray, *, max_body_bytes: int) -> tuple[int, int]:
    """(header length, body length) from a prefix, checked before either is read."""
    if len(prefix) != PREFIX_BYTES:
        raise FrameError(f"frame prefix must be {PREFIX_BYTES} bytes, got {len(prefix)}")
    version, header_len, body_len = PREFIX.unpack(prefix)
    if version != FRAMING_VERSION:
        raise FrameError(f"framing version {version}; this node speaks {FRAMING_VERSION}")
    if not 1 <= header_len <= MAX_HEADER_BYTES:
        raise FrameError(f"frame header length {header_len} not in [1, {MAX_HEADER_BYTES}]")
    if not 1 <= body_len <= max_body_bytes:
        raise FrameError(f"frame body length {body_len} not in [1, {max_body_bytes}]")
    return header_len, body_len


class Reader(Protocol):
    """A byte stream: ``read(n)`` returns 1..n bytes, or b"" at the end of the stream."""

    async def read(self, n: int) -> bytes: ...


async def read_exactly(
    stream: Reader,
    n: int,
    *,
    stall_timeout_s: float,
    what: str = "frame",
    into: bytearray | None = None,
    batch_s: float = 0.0,
    floor: RateFloorConfig | None = None,
) -> bytearray | memoryview:
    """Exactly ``n`` bytes; FrameError if the stream ends first, DeadlineError if it stalls.

    The deadline is per read, not per frame: a large frame on a slow link is fine as long as
    bytes keep arriving; a peer that stops sending mid-frame is cut off after stall_timeout_s.
    With ``floor``, the bytes must also keep up a minimum rate (``limits.RateFloor``).

    Memory is committed as bytes arrive, never from the announced length alone: with ``into``
    (at least ``n`` bytes, warm from an earlier frame) the bytes land there and a view of them
    is returned (copying 64 MB into fresh memory costs ~60 ms of page faults here, into warm
    memory ~6 ms); otherwise a new buffer grows with what the peer actually sent.

    With ``batch_s``, a short read in the middle of a large frame is followed by a pause of
    that long, so the next read collects what arrived meanwhile. py-libp2p's yamux answers
    every read with a WINDOW_UPDATE frame (encrypted, one send, decrypted by the peer), and
    without the pause a busy receiver reads about once per 64 KiB frame: ~750 updates per
    64 MB. The tail of a frame is never delayed (the pause needs ``_BATCH_MIN_LEFT_BYTES``
    still to come), and the 16 MB yamux window keeps the peer sending meanwhile.
    """
    sink = ByteSink(n, into)
    rate = RateFloor(floor, n, trio.current_time()) if floor is not None else None
    # One cancel scope whose deadline moves with progress: a 64 MB body is ~1000 reads.
    with trio.CancelScope() as scope:
        while sink.got < n:
            scope.deadline = trio.current_time() + stall_timeout_s
            got = sink.add(await stream.read(n - sink.got))
            if not got:
                raise FrameError(f"stream ended after {sink.got} of {n} {what} bytes")
            if rate is not None:
                rate.check(trio.current_time(), sink.got)
            left = n - sink.got
            if batch_s and got < _BATCH_CHUNK_BYTES and left >= _BATCH_MIN_LEFT_BYTES:
                await trio.sleep(batch_s)
    if sink.got < n:
        raise DeadlineError(
            f"peer stalled for {stall_timeout_s}s after {sink.got} of {n} {what} bytes"
        )
    return sink.result()


# A reader keeps its largest body buffer up to this size for the next frame.
MAX_SCRATCH_BYTES = 128 << 20


def keep_warm(body: bytearray | memoryview, scratch: bytearray) -> bytearray:
    """The buffer to read the next body into: ``body`` if read_exactly grew a new one for this
    frame (warm pages for the next, up to MAX_SCRATCH_BYTES), else the old ``scratch``."""
    if isinstance(body, bytearray) and len(body) <= MAX_SCRATCH_BYTES:
        return body
    return scratch


class ByteSink:
    """Where read_exactly puts bytes: a warm buffer's prefix, or a buffer grown by appending
    (bytearray grows geometrically with realloc, so the copies stay amortized O(n))."""

    def __init__(self, n: int, into: bytearray | None) -> None:
        self.n = n
        self.got = 0
        self.view = memoryview(into)[:n] if into is not None and len(into) >= n else None
        self._grown = bytearray()

    def add(self, chunk: bytes) -> int:
        """Append what a read returned; its length (FrameError if more than was asked)."""
        if len(chunk) > self.n - self.got:
            raise FrameError(
                f"stream returned {len(chunk)} bytes where {self.n - self.got} were asked"
            )
        if self.view is not None:
            self.view[self.got : self.got + len(chunk)] = chunk
        else:
            self._grown += chunk
        self.got += len(chunk)
        return len(chunk)

    def free(self) -> memoryview:
        assert self.view is not None
        return self.view[self.got :]

    def advance(self, count: int) -> int:
        """Count what a reader put in ``free()``; its length (FrameError if more than fits)."""
        if count > self.n - self.got:
            raise FrameError(f"a reader filled {count} bytes where {self.n - self.got} were free")
        self.got += count
        return count

    def result(self) -> bytearray | memoryview:
        return self.view if self.view is not None else self._grown


async def read_head(
    stream: Reader,
    *,
    max_body_bytes: int,
    stall_timeout_s: float,
    idle_timeout_s: float = math.inf,
) -> tuple[FrameHeader, int] | None:
    """The next frame's header and body length, or None at a clean end (EOF or idle).

    Waiting for the first byte of a frame is idle time (bounded by ``idle_timeout_s``); once
    it arrives, the rest of the frame is under the stall deadline.
    """
    first = b""
    with trio.move_on_after(idle_timeout_s):
        first = await stream.read(PREFIX_BYTES)
    if not first:
        return None
    if len(first) > PREFIX_BYTES:
        raise FrameError(f"stream returned {len(first)} bytes where {PREFIX_BYTES} were asked")
    # The whole head (at most ~260 bytes) within one stall deadline: a byte per deadline
    # would otherwise hold a stream for the head's length times the deadline.
    with trio.move_on_after(stall_timeout_s):
        rest = b""
        if len(first) < PREFIX_BYTES:
            rest = await read_exactly(
                stream, PREFIX_BYTES - len(first), stall_timeout_s=stall_timeout_s, what="prefix"
            )
        header_len, body_len = parse_prefix(bytes(first) + rest, max_body_bytes=max_body_bytes)
        head = await read_exactly(
            stream, header_len, stall_timeout_s=stall_timeout_s, what="header"
        )
        return FrameHeader.from_wire(head), body_len
    raise DeadlineError(f"a frame head took over {stall_timeout_s}s to arrive")
