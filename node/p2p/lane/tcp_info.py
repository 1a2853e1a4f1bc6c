"""What the kernel knows about a TCP connection: ``struct tcp_info`` (linux/tcp.h), parsed.

The kernel times every ACK itself, so its delivery rate does not depend on the measuring
process getting the CPU: a probe paced by Python (noise, yamux) on a host whose share is
taken by training reads a 1 Gbit/s link at 2-35 MB/s of 125 (issue 25), while the lane that
carries the training frames is timed by the kernel at the rate the wire took them.

Only the fields up to ``tcpi_sndbuf_limited`` (Linux 4.10+) are read; a shorter answer (an old
kernel, another OS) is refused with ``TcpInfoError``, never guessed at.
"""

import socket
import struct
from dataclasses import dataclass

from fusionllm.common.errors import FusionError

# u8 x 8 | u32 x 24 (rto .. total_retrans) | u64 x 4 (pacing_rate .. bytes_received) |
# u32 x 6 (segs_out .. data_segs_out) | u64 x 4 (delivery_rate, busy, rwnd_limited,
# sndbuf_limited): 192 bytes, the layout of linux/tcp.h, native byte order.
_LAYOUT = struct.Struct("=8B24I4Q6I4Q")
TCP_INFO_BYTES = _LAYOUT.size
# Newer kernels append fields; asking for more than we parse costs nothing.
_ASK_BYTES = 256
_APP_LIMITED_BIT = 0x01  # byte 7: tcpi_delivery_rate_app_limited:1, fastopen_client_fail:2
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
INFINITE_SSTHRESH = 0x7FFFFFFF  # TCP_INFINITE_SSTHRESH: no loss or HyStart exit yet


class TcpInfoError(FusionError):
    """The kernel's answer is not a ``struct tcp_info`` we can read."""


@dataclass(frozen=True, kw_only=True)
class TcpInfo:
    state: int
    rtt_s: float  # smoothed, queueing included
    min_rtt_s: float  # the kernel's windowed minimum: the path's own latency
    snd_cwnd: int  # segments
    snd_mss: int  # bytes
    bytes_acked: int
    delivery_rate: float  # bytes/s, the kernel's last rate sample
    # The last rate sample ran while the sender had nothing queued: it says what we sent,
    # not what the link can carry (a lower bound only).
    app_limited: bool
    busy_s: float  # time with data in flight
    rwnd_limited_s: float  # time the receiver's window held the sender back
    sndbuf_limited_s: float  # time our send buffer held it back
    bytes_received: int = 0  # every byte the kernel took off the wire, read by us or not
    total_retrans: int = 0  # segments sent again, over the connection's life
    # Slow start's threshold, segments (INFINITE_SSTHRESH until a loss or HyStart ends it):
    # while snd_cwnd is under it the window still doubles each round trip.
    snd_ssthresh: int = 0

    @property
    def slow_start(self) -> bool:
        """The window still doubling: a rate sample now reads TCP's ramp, not the path."""
        return self.snd_cwnd < self.snd_ssthresh


def parse_tcp_info(data: bytes) -> TcpInfo:
    """``data`` as returned by getsockopt(IPPROTO_TCP, TCP_INFO); TcpInfoError if too short."""
    if not isinstance(data, bytes | bytearray):
        raise TcpInfoError(f"tcp_info must be bytes, got {type(data).__name__}")
    if len(data) < TCP_INFO_BYTES:
        raise TcpInfoError(f"tcp_info of {len(data)} bytes, need {TCP_INFO_BYTES} (Linux 4.10+)")
    fields = _LAYOUT.unpack_from(data)
    u8, u32, u64a, u32b, u64b = (
        fields[:8], fields[8:32], fields[32:36], fields[36:42], fields[42:46]
    )  # fmt: skip
    return TcpInfo(
        state=u8[0],
        rtt_s=u32[15] / 1e6,  # tcpi_rtt, microseconds
        min_rtt_s=u32b[3] / 1e6,  # tcpi_min_rtt, microseconds
        snd_cwnd=u32[18],
        snd_mss=u32[2],
        bytes_acked=u64a[2],
        delivery_rate=float(u64b[0]),
        app_limited=bool(u8[7] & _APP_LIMITED_BIT),
        busy_s=u64b[1] / 1e6,  # tcpi_busy_time and the two below: microseconds
        rwnd_limited_s=u64b[2] / 1e6,
        sndbuf_limited_s=u64b[3] / 1e6,
        bytes_received=u64a[3],
        total_retrans=u32[23],
        snd_ssthresh=u32[17],
    )


def read_tcp_info(sock: socket.socket) -> TcpInfo:
    """The kernel's view of ``sock`` now (one system call, no wait); TcpInfoError where the
    platform has no TCP_INFO or the socket is closed."""
    try:
        data = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _ASK_BYTES)
    except OSError as exc:
        raise TcpInfoError(f"TCP_INFO is not readable: {exc}") from exc
    return parse_tcp_info(data)
