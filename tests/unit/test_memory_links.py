"""Slow links in the in-memory network: a frame leaves at the link's rate, arrives a delay
later, in order; a frame that cannot leave within its timeout fails; closing fails the rest.

Times are lower bounds (a link is never faster than configured) with loose upper bounds: the
timer thread may run late on a loaded machine, never early.
"""

import time

import pytest
import torch

from fusionllm.compression import pack_tensor
from fusionllm.node.errors import DeadlineError, TransportClosedError
from fusionllm.node.p2p.framing import FrameHeader, FrameKind, encode_head
from tests.support.memory_links import LinkShape
from tests.support.memory_transport import MemoryNetwork

ELEMENTS = 25_000  # 100 KB of float32
BODY = pack_tensor(torch.ones(ELEMENTS))
HEADER = FrameHeader(step=0, micro_batch=1, kind=FrameKind.ACTIVATION, stage=0)
WIRE = len(encode_head(HEADER, len(BODY))) + len(BODY)


@pytest.fixture
def net():
    with MemoryNetwork() as network:
        yield network


def test_a_frame_leaves_at_the_links_rate_and_arrives_its_delay_later(net):
    a, b = net.transport("a"), net.transport("b")
    net.shape_link("a", "b", delay_s=0.3, rate=WIRE / 0.1)  # 0.1 s to send one frame
    started = time.monotonic()
    future = a.send_async("b", HEADER, BODY, timeout=5.0)
    future.result(timeout=5.0)
    left = time.monotonic() - started
    with pytest.raises(DeadlineError):  # left, but still on its way
        b.recv(timeout=0)
    got = b.recv(timeout=5.0)
    arrived = time.monotonic() - started
    assert got.peer == "a"
    assert torch.equal(got.tensor, torch.ones(ELEMENTS))
    assert 0.1 <= left < 0.3
    assert 0.4 <= arrived < 2.0


def test_frames_of_one_link_queue_behind_each_other_and_keep_their_order(net):
    a, b = net.transport("a"), net.transport("b")
    net.shape_link("a", "b", delay_s=0.05, rate=WIRE / 0.1)
    started = time.monotonic()
    for i in range(3):
        header = FrameHeader(step=i, micro_batch=1, kind=FrameKind.ACTIVATION, stage=0)
        a.send_async("b", header, BODY, timeout=5.0)
    steps = [b.recv(timeout=5.0).header.step for _ in range(3)]
    assert steps == [0, 1, 2]
    assert time.monotonic() - started >= 3 * 0.1 + 0.05


def test_links_are_shaped_per_direction_when_asked(net):
    a, b = net.transport("a"), net.transport("b")
    net.shape_link("a", "b", delay_s=5.0, both_ways=False)
    assert b.send_async("a", HEADER, BODY, timeout=1.0).done()  # b -> a: instant, as before
    assert a.recv(timeout=0).peer == "b"
    a.send_async("b", HEADER, BODY, timeout=1.0)
    with pytest.raises(DeadlineError):  # a -> b: 5 s on its way
        b.recv(timeout=0.2)


def test_a_frame_that_cannot_leave_in_its_timeout_fails_and_takes_no_link_time(net):
    a, b = net.transport("a"), net.transport("b")
    net.shape_link("a", "b", rate=WIRE / 1.0)  # a second a frame
    first = a.send_async("b", HEADER, BODY, timeout=5.0)
    late = a.send_async("b", HEADER, BODY, timeout=1.5)  # would leave after 2 s
    with pytest.raises(DeadlineError, match=r"could not leave in 1\.5s"):
        late.result(timeout=0)
    first.result(timeout=5.0)
    b.recv(timeout=5.0)
    assert a.stats()["b"].frames_out == 1


def test_closing_the_network_fails_frames_still_leaving():
    net = MemoryNetwork()
    a, _b = net.transport("a"), net.transport("b")
    net.shape_link("a", "b", rate=WIRE / 30.0)  # 30 s to send it
    future = a.send_async("b", HEADER, BODY, timeout=60.0)
    net.close()
    with pytest.raises(TransportClosedError):
        future.result(timeout=5.0)


@pytest.mark.parametrize(
    ("fields", "match"),
    [({"delay_s": -1.0}, "delay_s"), ({"rate": 0.0}, "rate"), ({"rate": float("inf")}, "rate")],
)
def test_a_link_shape_that_cannot_be_is_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        LinkShape(**fields)
