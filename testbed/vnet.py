"""TUN frames with IFF_VNET_HDR: a virtio-net header, then one IP packet, maybe a GSO burst.

With TSO/USO offloads on, the kernel hands a TUN reader one large "super-segment" (up to
64 KiB) that stands for several wire packets of ``gso_size`` payload bytes each, every one
carrying its own copy of the IP and TCP/UDP headers. Rates and queues count what the wire
would carry: the payload plus one header copy per segment.
"""

import struct
from dataclasses import dataclass

VNET_HDR = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_off
VNET_HDR_LEN = VNET_HDR.size  # 10: the default TUNSETVNETHDRSZ
GSO_NONE = 0
GSO_ECN = 0x80
_GSO_TCPV4, _GSO_UDP_L4 = 1, 5
_IPV4_MIN = 20
_TCP, _UDP = 6, 17
MAX_FRAME = VNET_HDR_LEN + 65535 + 64  # an IPv4 packet's total length fits in 16 bits


@dataclass(frozen=True, slots=True)
class Frame:
    """What routing and shaping need of one frame read from a TUN fd."""

    dst: bytes  # IPv4 destination, 4 bytes
    segments: int  # packets on the wire
    wire_bytes: int  # IP bytes on the wire, every segment's headers counted


def _headers_len(packet: bytes | memoryview) -> int:
    """IPv4 header plus the TCP/UDP header, from the packet (not the virtio header's
    ``hdr_len``, which drivers may leave at 0)."""
    ihl = (packet[0] & 0x0F) * 4
    proto = packet[9]
    if proto == _TCP and len(packet) >= ihl + 13:
        return ihl + (packet[ihl + 12] >> 4) * 4
    if proto == _UDP:
        return ihl + 8
    return ihl


def parse_frame(frame: bytes | memoryview) -> Frame | None:
    """The frame's IPv4 destination and wire size; None for what is not a sane IPv4 packet
    (too short, IPv6, a header length or GSO size that cannot be)."""
    if len(frame) < VNET_HDR_LEN + _IPV4_MIN:
        return None
    _flags, gso_type, _hdr_len, gso_size, _start, _off = VNET_HDR.unpack_from(frame)
    packet = memoryview(frame)[VNET_HDR_LEN:]
    if packet[0] >> 4 != 4 or (packet[0] & 0x0F) < 5:
        return None
    total = len(packet)
    headers = _headers_len(packet)
    if headers > total:
        return None
    segments = 1
    if gso_type & ~GSO_ECN != GSO_NONE:
        payload = total - headers
        if gso_size <= 0:
            return None
        segments = max(1, -(-payload // gso_size))
    return Frame(
        dst=bytes(packet[16:20]),
        segments=segments,
        wire_bytes=total + (segments - 1) * headers,
    )


def _checksum(data: bytes | memoryview, start: int = 0) -> int:
    """The folded (not complemented) 16-bit one's-complement sum of ``data``."""
    if len(data) % 2:
        data = bytes(data) + b"\0"
    total = start + sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _pseudo_sum(src: bytes, dst: bytes, proto: int, length: int) -> int:
    return _checksum(src + dst + struct.pack("!BBH", 0, proto, length))


_NEEDS_CSUM = 1
_TCP_FIN, _TCP_PSH, _TCP_CWR = 0x01, 0x08, 0x80


def split_tcp4(frame: bytes) -> list[bytes] | None:
    """A TCPv4 GSO frame as the wire packets it stands for, each its own frame (no GSO,
    checksum left to the receiving kernel as the sender's was); None when ``frame`` is not
    a TCPv4 GSO frame. A lossy link drops these one at a time, as the wire would."""
    flags, gso_type, _hdr_len, gso_size, _start, _off = VNET_HDR.unpack_from(frame)
    if gso_type & ~GSO_ECN != _GSO_TCPV4 or gso_size <= 0 or not flags & _NEEDS_CSUM:
        return None
    packet = frame[VNET_HDR_LEN:]
    ihl = (packet[0] & 0x0F) * 4
    headers = _headers_len(packet)
    if packet[9] != _TCP or headers <= ihl or headers > len(packet):
        return None
    ip_id = struct.unpack_from("!H", packet, 4)[0]
    seq = struct.unpack_from("!I", packet, ihl + 4)[0]
    tcp_flags = packet[ihl + 13]
    src, dst = packet[12:16], packet[16:20]
    payload = memoryview(packet)[headers:]
    count = -(-len(payload) // gso_size)
    out = []
    for k in range(count):
        body = payload[k * gso_size : (k + 1) * gso_size]
        ip = bytearray(packet[:ihl])
        struct.pack_into("!HH", ip, 2, headers + len(body), (ip_id + k) & 0xFFFF)
        struct.pack_into("!H", ip, 10, 0)
        struct.pack_into("!H", ip, 10, ~_checksum(ip) & 0xFFFF)
        tcp = bytearray(packet[ihl:headers])
        struct.pack_into("!I", tcp, 4, (seq + k * gso_size) & 0xFFFFFFFF)
        keep = tcp_flags
        if k < count - 1:
            keep &= ~(_TCP_FIN | _TCP_PSH)
        if k > 0:
            keep &= ~_TCP_CWR
        tcp[13] = keep
        pseudo = _pseudo_sum(src, dst, _TCP, headers - ihl + len(body))
        struct.pack_into("!H", tcp, 16, pseudo)
        vnet = VNET_HDR.pack(_NEEDS_CSUM, GSO_NONE, 0, 0, ihl, 16)
        out.append(vnet + bytes(ip) + bytes(tcp) + bytes(body))
    return out
