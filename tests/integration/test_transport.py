"""The tensor transport between real node processes on 127.0.0.1.

The tests talk to ``python -m tests.support.transport_main`` (an echo node) through an
in-process ``Transport`` and, for misbehaving peers, through a raw py-libp2p host
that writes whatever bytes the test wants on the tensor protocol. Every bad frame must reset
only its own stream, be counted against the peer, and leave the node serving good frames.
One plain node serves the module (its start was most of each test's time); a test that needs
other flags, or a restart, starts its own.
"""

import math
import socket
import threading
import time
from collections.abc import Iterator

import multiaddr
import pytest
import torch
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.exceptions import SwarmException
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from fusionllm.compression import pack_tensor
from fusionllm.node.errors import DeadlineError, TransportClosedError, TransportError
from fusionllm.node.p2p import transport as transport_module
from fusionllm.node.p2p.framing import PREFIX, FrameHeader, encode_head
from fusionllm.node.p2p.host import TENSOR_PROTOCOL, new_secure_host
from fusionllm.node.p2p.identity import peer_id_of
from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.support.transport_node import (
    _WAIT_S,
    HEADER,
    NodeProcess,
    assert_node_still_echoes,
    echo,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

# py-libp2p reports a peer's RST as a reset or, depending on timing, as EOF.
ENDED = ("reset", "eof")


def wait_for_reset_seen(client: Transport, node: NodeProcess, count: int = 1) -> None:
    """Wait until the client noticed the node reset its stream (frames after would be lost)."""
    deadline = time.monotonic() + _WAIT_S
    while client.stats()[node.peer_id].streams_ended_by_peer < count:
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.02)


def raw_session(addr: str, chunks: list[bytes], *, half_close: bool = False) -> tuple[str, str]:
    """Write ``chunks`` on a fresh tensor stream to ``addr`` from a throwaway peer.

    Returns (our peer id, how the node ended the stream: "reset", "eof" or "open").
    """
    key_pair = create_new_key_pair()

    async def main() -> str:
        host = new_secure_host(key_pair, negotiate_timeout_s=5)
        with trio.fail_after(_WAIT_S + 5):
            async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
                await host.connect(info)
                stream = await host.new_stream(info.peer_id, [TENSOR_PROTOCOL])
                outcome = "open"
                try:
                    for chunk in chunks:
                        await stream.write(chunk)
                    if half_close:
                        await stream.close_write()
                    with trio.move_on_after(_WAIT_S):
                        data = await stream.read(1 << 16)
                        outcome = "eof" if not data else "data"
                except StreamReset:
                    outcome = "reset"
                except StreamEOF:
                    outcome = "eof"
                return outcome

    return peer_id_of(key_pair), trio.run(main)


def test_tensors_cross_both_ways(plain_node, client):
    assert client.connect(plain_node.addr) == plain_node.peer_id
    for tensor in (
        torch.randn(2, 3, 5),
        torch.randn(1000).to(torch.bfloat16),
        torch.arange(-5, 5, dtype=torch.int64),
        torch.zeros(0, 4),
        torch.tensor(True),
    ):
        back = echo(client, plain_node, tensor)
        assert back.dtype == tensor.dtype
        assert torch.equal(back, tensor)
    big = torch.randn(1 << 20)  # 4 MB: many muxer frames, decoded off the trio thread
    assert torch.equal(echo(client, plain_node, big), big)
    stats = client.stats()[plain_node.peer_id]
    assert stats.frames_out == stats.frames_in == 6
    assert stats.errors == {}


def test_frames_around_the_write_chunk_size_arrive_whole(plain_node, client):
    """Bodies go out in pieces of one Noise message each; the edges must not lose a byte."""
    chunk = transport_module._WRITE_CHUNK_BYTES
    wanted = {chunk - 1, chunk, chunk + 1, 2 * chunk + 1}
    # The frame adds a few dozen bytes of msgpack around the tensor's bytes.
    sizes = [
        n
        for body in sorted(wanted)
        for n in range(body - 64, body)
        if len(pack_tensor(torch.zeros(n, dtype=torch.uint8))) == body
    ]
    assert len(sizes) == len(wanted)
    client.connect(plain_node.addr)
    generator = torch.Generator().manual_seed(5)
    for n in sizes:
        tensor = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
        assert torch.equal(echo(client, plain_node, tensor), tensor)


def test_identity_survives_a_restart(start_node):
    first = start_node(key="same.key")
    first.stop()
    assert start_node(key="same.key").peer_id == first.peer_id


def test_garbage_on_the_protocol_resets_the_stream(plain_node, client):
    client.connect(plain_node.addr)
    peer, outcome = raw_session(plain_node.addr, [b"\xde\xad\xbe\xef" * 64])
    assert outcome in ENDED
    assert plain_node.wait_for_error(peer, "FrameError") == {"FrameError": 1}
    assert_node_still_echoes(client, plain_node)


def test_truncated_frame_resets_the_stream(plain_node, client):
    client.connect(plain_node.addr)
    frame = encode_head(HEADER, 1000) + bytes(10)
    peer, outcome = raw_session(plain_node.addr, [frame], half_close=True)
    assert outcome in ENDED
    assert plain_node.wait_for_error(peer, "FrameError")
    assert_node_still_echoes(client, plain_node)


def test_oversize_length_prefix_is_refused_before_the_body(start_node, client):
    node = start_node("--max-frame-bytes", "4096")
    client.connect(node.addr)
    head = encode_head(HEADER, 1 << 30)  # claims 1 GiB, sends none of it
    peer, outcome = raw_session(node.addr, [head])
    assert outcome in ENDED
    assert node.wait_for_error(peer, "FrameError")
    assert_node_still_echoes(client, node)


def test_header_with_unknown_kind_is_refused(plain_node, client):
    client.connect(plain_node.addr)
    import msgpack

    bad = msgpack.packb({"step": 0, "micro_batch": 0, "kind": "weights", "stage": 0})
    peer, outcome = raw_session(plain_node.addr, [PREFIX.pack(1, len(bad), 8) + bad + bytes(8)])
    assert outcome in ENDED
    assert plain_node.wait_for_error(peer, "FrameError")
    assert_node_still_echoes(client, plain_node)


def test_wrong_shape_or_dtype_against_the_spec_is_refused(start_node, client):
    node = start_node("--expect-dtype", "float32", "--expect-shape", "3,4")
    client.connect(node.addr)
    client.send(node.peer_id, HEADER, pack_tensor(torch.zeros(4, 3)), timeout=_WAIT_S)
    assert node.wait_for_error(client.peer_id, "FrameError") == {"FrameError": 1}
    wait_for_reset_seen(client, node, 1)
    client.send(node.peer_id, HEADER, pack_tensor(torch.zeros(3, 4).double()), timeout=_WAIT_S)
    assert node.wait_for_error(client.peer_id, "FrameError", 2) == {"FrameError": 2}
    wait_for_reset_seen(client, node, 2)
    # The node reset our stream each time; the client opens a fresh one and is served.
    assert_node_still_echoes(client, node)


def test_nan_tensor_is_refused(plain_node, client):
    client.connect(plain_node.addr)
    client.send(plain_node.peer_id, HEADER, pack_tensor(torch.tensor([1.0, math.nan])), timeout=5)
    assert plain_node.wait_for_error(client.peer_id, "FrameError")
    wait_for_reset_seen(client, plain_node)
    assert_node_still_echoes(client, plain_node)


def test_a_peer_stalling_mid_frame_is_cut_off_at_the_read_deadline(start_node, client):
    node = start_node("--read-timeout", "1")
    client.connect(node.addr)
    started = time.monotonic()
    peer, outcome = raw_session(node.addr, [encode_head(HEADER, 4096) + bytes(100)])
    assert outcome in ENDED
    assert time.monotonic() - started < 1 + _WAIT_S / 2
    assert node.wait_for_error(peer, "DeadlineError")
    assert_node_still_echoes(client, node)


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """A TCP port that accepts connections and never says a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    fake_peer = peer_id_of(create_new_key_pair())
    yield f"/ip4/127.0.0.1/tcp/{server.getsockname()[1]}/p2p/{fake_peer}"
    stop.set()
    thread.join(2)
    for conn in accepted:
        conn.close()
    server.close()


def test_dial_to_a_silent_listener_fails_within_the_timeout(client, silent_listener):
    started = time.monotonic()
    with pytest.raises(DeadlineError):
        client.connect(silent_listener, timeout=1.5)
    assert time.monotonic() - started < 3.0


def test_sends_block_at_max_in_flight(tmp_path, silent_listener):
    config = TransportConfig(key_path=tmp_path / "k", max_in_flight=1, dial_timeout_s=2.0)
    with Transport(config) as transport:
        peer = silent_listener.rsplit("/", 1)[1]
        with pytest.raises(DeadlineError):
            transport.connect(silent_listener, timeout=0.5)  # leaves the address known
        stuck = transport.send_async(peer, HEADER, pack_tensor(torch.ones(1)), timeout=2.0)
        started = time.monotonic()
        with pytest.raises(DeadlineError, match="in flight"):
            transport.send_async(peer, HEADER, pack_tensor(torch.ones(1)), timeout=0.3)
        assert time.monotonic() - started < 1.0
        with pytest.raises(DeadlineError):
            stuck.result(timeout=5)


def test_receiver_stops_reading_when_its_inbox_slots_are_full(tmp_path):
    slow = TransportConfig(key_path=tmp_path / "slow.key", max_in_flight=2)
    with Transport(slow) as receiver, Transport(TransportConfig(key_path=tmp_path / "f")) as sender:
        sender.connect(receiver.addrs[0])
        for step in range(4):
            header = FrameHeader(step=step, micro_batch=0, kind="gradient", stage=1)
            sender.send(receiver.peer_id, header, pack_tensor(torch.full((8,), step)), timeout=5)
        time.sleep(0.3)  # give the receiver time to (wrongly) read more than its slots
        # Counted means handed over; a lane's reader may hold one more, decoded, until a slot
        # frees (lane/serve.py), a stream's reader none.
        assert receiver.stats()[sender.peer_id].frames_in == 2
        steps = [receiver.recv(timeout=5).header.step for _ in range(4)]
        assert steps == [0, 1, 2, 3]


@pytest.mark.parametrize("lanes", [False, True], ids=["stream", "lane"])
def test_a_receiver_that_pauses_longer_than_yamux_patience_loses_nothing(tmp_path, lanes):
    """py-libp2p's yamux write gives up after 5 s without a window update; a receiver whose
    inbox is full for longer (8 s here) must still get every 1 MB frame, and no send fails.
    On a lane the sender waits on TCP's own backpressure instead; the same must hold."""
    slow = TransportConfig(key_path=tmp_path / "slow.key", max_in_flight=2, lanes=lanes)
    fast = TransportConfig(key_path=tmp_path / "fast.key", max_in_flight=8, lanes=lanes)
    with Transport(slow) as receiver, Transport(fast) as sender:
        sender.connect(receiver.addrs[0])
        sends = []
        for step in range(5):
            header = FrameHeader(step=step, micro_batch=0, kind="gradient", stage=1)
            body = pack_tensor(torch.full((1 << 18,), float(step)))  # 1 MB: over the window
            sends.append(sender.send_async(receiver.peer_id, header, body, timeout=30))
        time.sleep(8)
        frames = [receiver.recv(timeout=10) for _ in range(5)]
        # Concurrent send_async calls promise delivery, not order (the mailbox keys frames).
        assert sorted(f.header.step for f in frames) == [0, 1, 2, 3, 4]
        assert all(bool((f.tensor == f.header.step).all()) for f in frames)
        for send in sends:
            send.result(timeout=10)
        assert sender.outbound_lanes() == ([receiver.peer_id] if lanes else [])


def test_a_plaintext_only_dialer_is_refused(plain_node, client):
    key_pair = create_new_key_pair()

    async def dial_in_plaintext() -> Exception | None:
        host = new_host(
            key_pair=key_pair,
            sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)},
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
            negotiate_timeout=5,
        )
        with trio.fail_after(_WAIT_S + 5):
            async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                try:
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(plain_node.addr)))
                except SwarmException as exc:
                    return exc
        return None

    refusal = trio.run(dial_in_plaintext)
    assert isinstance(refusal, SwarmException), "a plaintext dialer got connected"
    client.connect(plain_node.addr)
    assert_node_still_echoes(client, plain_node)


def test_close_is_bounded_and_later_calls_fail_typed(tmp_path):
    transport = Transport(TransportConfig(key_path=tmp_path / "k", close_timeout_s=2.0)).start()
    started = time.monotonic()
    transport.close()
    assert time.monotonic() - started < 2.5
    with pytest.raises(TransportClosedError):
        transport.send(transport.peer_id, HEADER, pack_tensor(torch.ones(1)))
    with pytest.raises(TransportClosedError):
        transport.recv(timeout=1)
    transport.close()  # idempotent


def test_a_bad_peer_id_is_the_callers_error_and_the_transport_lives_on(client, plain_node):
    for bad in ("", "not-base58!"):
        with pytest.raises(ValueError, match="not a peer id"):
            client.send(bad, HEADER, pack_tensor(torch.ones(1)))
    unknown = peer_id_of(create_new_key_pair())  # valid, but no address known
    with pytest.raises(TransportError):
        client.send(unknown, HEADER, pack_tensor(torch.ones(1)), timeout=3)
    client.connect(plain_node.addr)
    assert_node_still_echoes(client, plain_node)


def test_a_fixed_port_in_use_is_refused(tmp_path, plain_node):
    port = int(plain_node.addr.split("/tcp/")[1].split("/")[0])
    config = TransportConfig(key_path=tmp_path / "k", listen_port=port)
    with pytest.raises(TransportError, match="cannot listen"):
        Transport(config).start()
    assert plain_node.command(cmd="stats")["event"] == "stats"
