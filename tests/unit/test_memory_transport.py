"""The in-memory transport the runner tests stand on: it refuses what the real one refuses.

Each check here mirrors one of ``Transport``'s: the same exceptions from ``send_async`` and
``recv``, the same counters, malformed frames counted against their sender and never delivered.
"""

import threading

import pytest
import torch

from fusionllm.compression import FrameLimits, pack_tensor, unpack_tensor
from fusionllm.node.errors import DeadlineError, TransportClosedError, TransportError
from fusionllm.node.p2p.framing import FrameHeader, FrameKind, encode_head
from fusionllm.node.p2p.transport import TensorSpec
from tests.support.memory_transport import FrameMatch, MemoryNetwork, MemoryTransportConfig

SPEC = TensorSpec(torch.float32, (4,))
HEADER = FrameHeader(step=0, micro_batch=1, kind=FrameKind.ACTIVATION, stage=0)


def _body(value: float = 1.0) -> bytes:
    return pack_tensor(torch.full((4,), value))


@pytest.fixture
def net():
    with MemoryNetwork() as network:
        yield network


def test_a_frame_arrives_whole_and_is_counted_both_ways(net) -> None:
    a, b = net.transport("a"), net.transport("b", expect=lambda header: SPEC)
    body = _body(2.0)
    assert a.send_async("b", HEADER, body, timeout=1.0).result(0) is None  # delivered already
    got = b.recv(timeout=0)
    assert (got.peer, got.header) == ("a", HEADER)
    assert torch.equal(got.tensor, torch.full((4,), 2.0))
    wire = len(encode_head(HEADER, len(body))) + len(body)
    assert (a.stats()["b"].frames_out, a.stats()["b"].bytes_out) == (1, wire)
    assert (b.stats()["a"].frames_in, b.stats()["a"].bytes_in) == (1, len(body))
    assert b.stats()["a"].errors == {}
    with pytest.raises(DeadlineError, match="no frame"):
        b.recv(timeout=0.01)


@pytest.mark.parametrize(
    ("body", "config"),
    [
        (pack_tensor(torch.zeros(5)), None),  # not the shape the receiver expects
        (pack_tensor(torch.zeros(4, dtype=torch.float64)), None),  # nor the dtype
        (_body()[:-3], None),  # cut short
        (b"\x93not a frame", None),
        (pack_tensor(torch.tensor([0.0, float("nan"), 0.0, 0.0])), None),  # FrameLimits default
        (pack_tensor(torch.zeros(64)), MemoryTransportConfig(max_frame_bytes=64)),  # too long
        (_body(), MemoryTransportConfig(limits=FrameLimits(max_elements=3))),
    ],
    ids=["shape", "dtype", "truncated", "garbage", "nan", "too-long", "too-many-elements"],
)
def test_malformed_frames_are_refused_and_counted_against_the_sender(net, body, config) -> None:
    a = net.transport("a")
    # The limit cases have no spec: only the limit can refuse them.
    expect = (lambda header: SPEC) if config is None else None
    b = net.transport("b", expect=expect, config=config)
    a.send_async("b", HEADER, body).result(0)  # the sender only learns its stream ended
    assert b.stats()["a"].errors == {"FrameError": 1}
    assert b.stats()["a"].frames_in == 0
    assert a.stats()["b"].streams_ended_by_peer == 1
    with pytest.raises(DeadlineError):
        b.recv(timeout=0)


def test_send_refuses_what_the_real_transport_refuses_before_sending(net) -> None:
    a = net.transport("a", config=MemoryTransportConfig(max_frame_bytes=64))
    with pytest.raises(ValueError, match="max_frame_bytes"):
        a.send_async("b", HEADER, b"x" * 65)
    with pytest.raises(ValueError, match="body length"):
        a.send_async("b", HEADER, b"")
    with pytest.raises(ValueError, match="peer id"):
        a.send_async("", HEADER, _body()[:60])
    with pytest.raises(TransportError, match="no such peer"):
        a.send_async("nobody", HEADER, _body()[:60]).result(0)


def test_close_wakes_every_receiver_and_fails_every_later_send(net) -> None:
    a, b = net.transport("a"), net.transport("b")
    woke: list[BaseException] = []
    started = threading.Event()

    def wait() -> None:
        started.set()
        try:
            b.recv(timeout=30)
        except TransportClosedError as exc:
            woke.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    started.wait(5)
    b.close()
    waiter.join(5)
    assert len(woke) == 1
    with pytest.raises(TransportClosedError):
        b.recv(timeout=0)  # and again: the next waiter wakes too
    with pytest.raises(TransportClosedError):
        b.send_async("a", HEADER, _body())
    future = a.send_async("b", HEADER, _body())
    assert isinstance(future.exception(0), TransportError)
    assert "gone" in str(future.exception(0))


def test_kill_on_a_frame_kills_the_peer_as_it_sends(net) -> None:
    a, b = net.transport("a"), net.transport("b")
    fault = net.kill_on(FrameMatch(src="a", step=1), "a")
    a.send_async("b", HEADER, _body()).result(0)
    later = FrameHeader(step=1, micro_batch=0, kind=FrameKind.GRADIENT, stage=0)
    failed = a.send_async("b", later, _body())
    assert isinstance(failed.exception(0), TransportClosedError)
    assert fault.fired.is_set()
    assert (fault.hits, fault.fired_at is not None) == (1, True)
    assert (a.closed, b.closed) == (True, False)
    with pytest.raises(TransportClosedError):
        a.recv(timeout=0)
    assert b.recv(timeout=0).header == HEADER  # what it sent before dying still arrived


def test_drop_and_corrupt_hit_only_the_matching_frames(net) -> None:
    a, b = net.transport("a"), net.transport("b", expect=lambda header: SPEC)
    dropped = net.drop(FrameMatch(kind=FrameKind.CONTROL), times=2)
    corrupted = net.corrupt(FrameMatch(tag=7), lambda body: body[:-1])
    control = FrameHeader(step=0, micro_batch=0, kind=FrameKind.CONTROL, stage=0)
    for _ in range(3):
        a.send_async("b", control, _body()).result(0)
    a.send_async("b", FrameHeader(step=0, micro_batch=7, kind=FrameKind.GRADIENT, stage=0), _body())
    assert (dropped.hits, corrupted.hits) == (2, 1)
    assert b.recv(timeout=0).header == control  # the third control frame
    with pytest.raises(DeadlineError):
        b.recv(timeout=0)  # the corrupted one was refused
    assert b.stats()["a"].errors == {"FrameError": 1}
    assert a.stats()["b"].frames_out == 4  # a lost frame still left the sender


def test_a_stalled_peer_holds_its_frames_until_resumed_or_timed_out(net) -> None:
    a, b = net.transport("a"), net.transport("b")
    net.stall("a")
    late = a.send_async("b", HEADER, _body(1.0), timeout=30)
    expired = a.send_async("b", HEADER, _body(2.0), timeout=0.01)
    assert isinstance(expired.exception(5), DeadlineError)
    assert not late.done()
    with pytest.raises(DeadlineError):
        b.recv(timeout=0)
    assert b.send_async("a", HEADER, _body()).result(0) is None  # it still receives
    net.resume("a")
    assert late.result(0) is None
    assert torch.equal(b.recv(timeout=0).tensor, torch.full((4,), 1.0))
    with pytest.raises(DeadlineError):
        b.recv(timeout=0)  # the expired frame never arrives
    stalled = a.send_async("b", HEADER, _body())
    assert stalled.done()


def test_closing_the_network_fails_frames_still_held(net) -> None:
    a, _ = net.transport("a"), net.transport("b")
    net.stall_on(FrameMatch(src="a"), "a")
    held = a.send_async("b", HEADER, _body(), timeout=30)
    assert not held.done()
    net.close()
    assert isinstance(held.exception(0), TransportClosedError)


def test_corrupt_can_rewrite_a_valid_frame(net) -> None:
    """What the runner tests use for a bad summary: a frame that decodes, with other values."""
    a, b = net.transport("a"), net.transport("b")

    def negate(body: bytes) -> bytes:
        return pack_tensor(-unpack_tensor(body))

    net.corrupt(FrameMatch(src="a"), negate)
    a.send_async("b", HEADER, _body(3.0)).result(0)
    assert torch.equal(b.recv(timeout=0).tensor, torch.full((4,), -3.0))
