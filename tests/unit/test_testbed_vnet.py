"""TUN frames: wire sizes of GSO bursts, and a TCP burst split into the packets it stands for."""

import struct

import pytest

from fusionllm.testbed.vnet import VNET_HDR, parse_frame, split_tcp4

SRC, DST = bytes([10, 250, 0, 1]), bytes([10, 250, 0, 3])
_FIN, _PSH, _ACK, _CWR = 0x01, 0x08, 0x10, 0x80


def _sum(data: bytes) -> int:
    data = data + b"\0" * (len(data) % 2)
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _tcp_frame(payload: bytes, *, gso_size: int = 0, flags: int = _ACK | _PSH) -> bytes:
    """A frame as a TUN with TSO hands it over: IPv4 + TCP with a 12-byte option."""
    tcp = struct.pack("!HHIIBBHHH", 4000, 5000, 2**32 - 1500, 7, 8 << 4, flags, 512, 0, 0)
    tcp += b"\x01\x01\x08\x0a" + b"\0" * 8  # NOP NOP timestamps
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + len(payload), 9, 0x4000, 64, 6,
                     0, SRC, DST)  # fmt: skip
    gso_type = 1 if gso_size else 0
    vnet = VNET_HDR.pack(1, gso_type, 20 + len(tcp), gso_size, 20, 16)
    return vnet + ip + tcp + payload


def test_a_plain_packet_is_one_segment_of_its_own_size():
    frame = parse_frame(_tcp_frame(b"x" * 100))
    assert (frame.dst, frame.segments, frame.wire_bytes) == (DST, 1, 20 + 32 + 100)


def test_a_gso_burst_counts_every_segment_and_its_headers():
    frame = parse_frame(_tcp_frame(b"x" * 3000, gso_size=1448))
    assert frame.segments == 3
    assert frame.wire_bytes == 3000 + 3 * 52


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\0" * 29,
        VNET_HDR.pack(0, 0, 0, 0, 0, 0) + b"\x60" + b"\0" * 39,  # IPv6
        VNET_HDR.pack(0, 0, 0, 0, 0, 0) + b"\x44" + b"\0" * 39,  # IHL 4
        _tcp_frame(b"x" * 10, gso_size=1)[:10] + b"\x4f" + _tcp_frame(b"")[11:],  # IHL > size
    ],
)
def test_what_is_not_a_sane_ipv4_frame_is_refused(frame):
    assert parse_frame(frame) is None


def test_a_gso_size_of_zero_is_refused():
    frame = bytearray(_tcp_frame(b"x" * 3000, gso_size=1448))
    struct.pack_into("<H", frame, 4, 0)
    assert parse_frame(bytes(frame)) is None


def test_a_tcp_burst_splits_into_valid_packets_that_carry_its_bytes_in_order():
    payload = bytes(range(256)) * 12  # 3072 bytes
    pieces = split_tcp4(_tcp_frame(payload, gso_size=1448, flags=_ACK | _PSH | _FIN | _CWR))
    assert len(pieces) == 3
    seqs, flags, data = [], [], b""
    for piece in pieces:
        flags_v, gso_type, _hl, _gs, start, offset = VNET_HDR.unpack_from(piece)
        assert (flags_v, gso_type, start, offset) == (1, 0, 20, 16)
        ip, tcp = piece[10:30], piece[30:62]
        assert struct.unpack_from("!H", ip, 2)[0] == len(piece) - 10
        assert _sum(ip) == 0xFFFF  # the IP header checksum holds
        # The kernel finishes the TCP checksum from the pseudo-header sum left in the field:
        body = piece[30:]
        pseudo = _sum(SRC + DST + struct.pack("!BBH", 0, 6, len(body)))
        assert struct.unpack_from("!H", tcp, 16)[0] == pseudo
        seqs.append(struct.unpack_from("!I", tcp, 4)[0])
        flags.append(tcp[13])
        data += piece[62:]
    assert data == payload
    assert seqs == [(2**32 - 1500 + k * 1448) % 2**32 for k in range(3)]  # wraps
    assert flags == [_ACK | _CWR, _ACK, _ACK | _PSH | _FIN]
    ids = [struct.unpack_from("!H", p, 14)[0] for p in pieces]
    assert ids == [9, 10, 11]


def test_only_tcp_bursts_are_split():
    assert split_tcp4(_tcp_frame(b"x" * 100)) is None
    udp = bytearray(_tcp_frame(b"x" * 3000, gso_size=1448))
    udp[10 + 9] = 17
    assert split_tcp4(bytes(udp)) is None
