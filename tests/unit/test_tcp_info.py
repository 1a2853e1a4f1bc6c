"""tcp_info parsing (fake kernel answers, and one real loopback socket) and the WireMeter's
rules for which kernel figures become a link's figure."""

import socket
import threading

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.p2p.lane.tcp_info import (
    _LAYOUT,
    TCP_INFO_BYTES,
    TcpInfo,
    TcpInfoError,
    parse_tcp_info,
    read_tcp_info,
)
from fusionllm.node.p2p.lane.wire_meter import WireMeter, WireMeterConfig


def fake_tcp_info(
    *, rtt_us=900, min_rtt_us=500, acked=0, rate=125_000_000, app_limited=False, state=1,
    busy_us=0, rwnd_us=0, sndbuf_us=0, received=4, retrans=123, ssthresh=117, extra=b"",
) -> bytes:  # fmt: skip
    u8 = [state, 0, 0, 0, 0, 0, 0x77, 0x04 | (1 if app_limited else 0)]
    u32 = list(range(100, 124))  # every field distinct, so a wrong offset shows
    u32[2], u32[15], u32[17], u32[18], u32[23] = 1448, rtt_us, ssthresh, 10, retrans
    u64a = [1, 2, acked, received]
    u32b = [5, 6, 7, min_rtt_us, 8, 9]
    u64b = [rate, busy_us, rwnd_us, sndbuf_us]
    return _LAYOUT.pack(*u8, *u32, *u64a, *u32b, *u64b) + extra


def test_fields_are_read_at_linux_tcp_h_offsets():
    info = parse_tcp_info(
        fake_tcp_info(
            acked=3 << 30,
            rate=987_654_321,
            busy_us=2_000_000,
            rwnd_us=250_000,
            sndbuf_us=125_000,
            received=5 << 30,
            retrans=7,
            ssthresh=64,
            extra=bytes(40),
        )
    )
    assert info == TcpInfo(
        state=1, rtt_s=900e-6, min_rtt_s=500e-6, snd_cwnd=10, snd_mss=1448,
        bytes_acked=3 << 30, delivery_rate=987_654_321.0, app_limited=False, busy_s=2.0,
        rwnd_limited_s=0.25, sndbuf_limited_s=0.125, bytes_received=5 << 30, total_retrans=7,
        snd_ssthresh=64,
    )  # fmt: skip
    assert parse_tcp_info(fake_tcp_info(app_limited=True)).app_limited
    assert info.slow_start  # a window of 10 segments under a threshold of 64
    assert not parse_tcp_info(fake_tcp_info(ssthresh=7)).slow_start


@pytest.mark.parametrize("data", [b"", bytes(TCP_INFO_BYTES - 1), bytes(104)])
def test_a_short_answer_is_refused(data):
    with pytest.raises(TcpInfoError, match=f"tcp_info of {len(data)} bytes"):
        parse_tcp_info(data)


def test_a_non_bytes_answer_is_refused():
    with pytest.raises(TcpInfoError, match="must be bytes"):
        parse_tcp_info("x" * 300)


def test_a_real_socket_reports_what_it_sent_and_a_delivery_rate():
    server = socket.create_server(("127.0.0.1", 0))
    with server, socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        with peer:
            sent = 4 << 20

            def drain():
                got = 0
                while got < sent and (chunk := peer.recv(1 << 20)):
                    got += len(chunk)

            reader = threading.Thread(target=drain)
            reader.start()
            client.sendall(bytes(sent))
            reader.join(timeout=30)
            info = read_tcp_info(client)
            received = read_tcp_info(peer).bytes_received  # all of it read: all received
    assert info.state == 1
    # The SYN counts as one byte acknowledged; the last ACK may still be on its way.
    assert 0 < info.bytes_acked <= sent + 1
    assert info.delivery_rate > 0
    assert 0 < info.min_rtt_s <= info.rtt_s
    assert info.snd_mss > 0
    assert sent <= received <= sent + 1


def test_a_closed_socket_is_a_typed_error():
    sock = socket.socket()
    sock.close()
    with pytest.raises(TcpInfoError, match="not readable"):
        read_tcp_info(sock)


def meter(**kw) -> WireMeter:
    return WireMeter(WireMeterConfig(min_bytes=1 << 20, min_interval_s=1.0, **kw))


def test_a_busy_sample_becomes_the_links_figure_with_the_minimum_rtt():
    m = meter()
    sample = m.observe(parse_tcp_info(fake_tcp_info(acked=2 << 20, rate=120_000_000)), now=100.0)
    assert sample is not None
    assert (sample.bandwidth, sample.rtt, sample.measured_at) == (120e6, 500e-6, 100.0)
    assert m.latest() == sample


def test_an_app_limited_sample_is_dropped_not_filed_as_a_slow_link():
    m = meter()
    assert m.observe(parse_tcp_info(fake_tcp_info(acked=8 << 20, rate=3_000_000, app_limited=True)),
                     now=100.0) is None  # fmt: skip
    assert m.latest() is None


def test_a_lane_that_idles_does_not_count_the_same_figure_twice():
    m = meter()
    first = m.observe(parse_tcp_info(fake_tcp_info(acked=2 << 20)), now=100.0)
    # Later, but under min_bytes more acknowledged: the kernel's rate is the old one.
    assert m.observe(parse_tcp_info(fake_tcp_info(acked=(2 << 20) + 1000)), now=105.0) is None
    assert m.latest() == first


def test_the_figure_is_the_median_of_an_intervals_samples():
    m = meter()
    rates = [110_000_000, 20_000_000, 140_000_000, 112_000_000, 115_000_000]
    for i, rate in enumerate(rates):
        info = fake_tcp_info(acked=(i + 1) << 21, rate=rate, min_rtt_us=500 - 10 * i)
        figure = m.observe(parse_tcp_info(info), now=100.0 + 0.1 * i)
    # A low sample (its interval spanned a gap) and a high one (bunched ACKs) both lose.
    assert (figure.bandwidth, figure.rtt, figure.measured_at) == (112e6, 460e-6, 100.4)
    assert m.latest() == figure
    # A new interval starts from its own samples.
    later = m.observe(parse_tcp_info(fake_tcp_info(acked=20 << 20, rate=60_000_000)), now=101.0)
    assert later is not None
    assert later.bandwidth == 60e6


@pytest.mark.parametrize(
    "fields",
    [
        {"state": 7},  # TCP_CLOSE
        {"rate": 0},
        {"rate": 200_000_000_000},  # above any link we plan for: a counter gone wrong
        {"min_rtt_us": 0},
    ],
)
def test_implausible_kernel_figures_are_dropped(fields):
    assert meter().observe(parse_tcp_info(fake_tcp_info(acked=8 << 20, **fields)), 1.0) is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"min_bytes": 0}, "min_bytes must be >= 1"),
        ({"min_bytes": True}, "min_bytes must be an int"),
        ({"min_interval_s": float("nan")}, "min_interval_s must be finite"),
        ({"min_interval_s": -1.0}, "min_interval_s must be finite"),
    ],
)
def test_config_is_validated(kw, match):
    with pytest.raises(ConfigError, match=match):
        WireMeterConfig(**kw)
