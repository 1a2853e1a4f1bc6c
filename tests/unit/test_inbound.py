"""What an inbound peer may cost: the limits (pure, fake clock) and the stream handler over fakes.

The handler runs under trio's MockClock with in-memory streams, so rate floors, stalls and
budgets are exercised in milliseconds; the real-process attack is
tests/integration/test_hostile_peers.py.
"""

import functools
import queue
import tracemalloc
from types import SimpleNamespace

import pytest
import torch
import trio
import trio.testing
from libp2p.network.stream.exceptions import StreamEOF

from fusionllm.common.errors import ConfigError
from fusionllm.compression import TopKCodec, pack_tensor
from fusionllm.node.errors import DeadlineError, TransportError
from fusionllm.node.p2p import inbound as inbound_module
from fusionllm.node.p2p.framing import FrameHeader, encode_head, read_exactly
from fusionllm.node.p2p.limits import (
    ByteBudget,
    InFlight,
    RateFloor,
    RateFloorConfig,
    Refusals,
)
from fusionllm.node.p2p.transport_types import PeerCounters, TensorSpec, TransportConfig

FLOOR = RateFloorConfig(min_bytes_per_s=1000, window_s=2.0)
HEADER = FrameHeader(step=1, micro_batch=0, kind="activation", stage=0)
SPEC = TensorSpec(torch.float32, (16,))


def run(async_fn, *args):
    """Under a mock clock: deadlines and sleeps pass instantly."""
    return trio.run(async_fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


# ----- RateFloor --------------------------------------------------------------------------------


def test_the_rate_floor_passes_a_sender_at_the_rate():
    floor = RateFloor(FLOOR, total=10_000, now=0.0)
    for second in range(1, 11):
        floor.check(float(second), 1000 * second)


def test_the_rate_floor_cuts_a_trickle_at_the_first_short_window():
    floor = RateFloor(FLOOR, total=10_000, now=0.0)
    floor.check(1.9, 10)  # inside the first window: no verdict yet
    with pytest.raises(DeadlineError, match=r"sent 20 bytes in 2.0s, below the floor of 1000"):
        floor.check(2.0, 20)


def test_the_rate_floor_measures_each_window_afresh():
    floor = RateFloor(FLOOR, total=100_000, now=0.0)
    floor.check(2.0, 50_000)  # a fast first window banks nothing for the next
    with pytest.raises(DeadlineError):
        floor.check(4.0, 51_000)  # 1000 bytes in 2 s: half the floor


def test_the_rate_floor_asks_only_for_what_is_left_of_the_frame():
    floor = RateFloor(FLOOR, total=2500, now=0.0)
    floor.check(2.0, 2000)
    floor.check(4.0, 2500)  # 500 bytes in 2 s is under the rate, but it is all that was left
    short = RateFloor(FLOOR, total=2500, now=0.0)
    short.check(2.0, 2000)
    with pytest.raises(DeadlineError, match="sent 400 bytes"):
        short.check(4.0, 2400)  # the last 500 bytes did not all come within a window


@pytest.mark.parametrize(("rate", "window"), [(0, 1.0), (-1, 1.0), (1, 0), (float("inf"), 1.0)])
def test_rate_floor_config_refuses_bad_values(rate, window):
    with pytest.raises(ConfigError):
        RateFloorConfig(min_bytes_per_s=rate, window_s=window)


class TrickleStream:
    """``size`` bytes, ``chunk`` at a time, one chunk per ``every_s`` of (mock) time."""

    def __init__(self, size: int, chunk: int, every_s: float) -> None:
        self.left, self.chunk, self.every_s = size, chunk, every_s

    async def read(self, n: int) -> bytes:
        await trio.sleep(self.every_s)
        size = min(n, self.chunk, self.left)
        self.left -= size
        return bytes(size)


def test_read_exactly_cuts_a_peer_sending_one_byte_per_read_deadline():
    # 1 byte per 9 s never trips a 10 s stall deadline; the floor cuts it in its first window.
    async def main():
        started = trio.current_time()
        with pytest.raises(DeadlineError, match="below the floor"):
            await read_exactly(
                TrickleStream(1 << 20, 1, 9.0), 1 << 20, stall_timeout_s=10.0, floor=FLOOR
            )
        return trio.current_time() - started

    assert run(main) <= FLOOR.window_s + 10.0


def test_read_exactly_keeps_a_slow_but_steady_sender():
    async def main():
        stream = TrickleStream(8000, 1500, 1.0)  # 1500 bytes/s over a floor of 1000
        return await read_exactly(stream, 8000, stall_timeout_s=10.0, floor=FLOOR)

    assert len(run(main)) == 8000


def test_read_exactly_commits_memory_as_bytes_arrive_not_as_announced():
    async def main():
        with pytest.raises(DeadlineError, match="stalled"):
            await read_exactly(StallAfter(4096), 1 << 30, stall_timeout_s=1.0)

    tracemalloc.start()
    try:
        run(main)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # a 1 GiB announcement, 4 KiB sent


class StallAfter:
    def __init__(self, size: int) -> None:
        self.left = size

    async def read(self, n: int) -> bytes:
        if not self.left:
            await trio.sleep_forever()
        size = min(n, self.left, 1024)
        self.left -= size
        return bytes(size)


# ----- ByteBudget, InFlight, Refusals, PeerCounters ---------------------------------------------


def test_the_byte_budget_bounds_each_peer_and_all_peers():
    budget = ByteBudget(per_peer=100, total=150)
    assert budget.reserve("a", 100)
    assert not budget.reserve("a", 1)  # a's share is used up
    assert budget.reserve("b", 50)
    assert not budget.reserve("c", 1)  # the node's is
    budget.release("a", 100)
    assert budget.reserve("c", 100)
    assert (budget.used, budget.held_by("a"), budget.peers()) == (150, 0, 2)


def test_the_byte_budget_forgets_a_peer_that_holds_nothing_and_refuses_bad_calls():
    budget = ByteBudget(per_peer=10, total=10)
    assert budget.reserve("a", 4)
    budget.release("a", 4)
    assert budget.peers() == 0
    assert not budget.reserve("a", -1)
    with pytest.raises(ValueError, match="holds 0"):
        budget.release("a", 1)
    with pytest.raises(ConfigError):
        ByteBudget(per_peer=11, total=10)


def test_in_flight_bounds_each_peer_and_keeps_no_idle_peer():
    slots = InFlight(2)
    assert slots.acquire("a", 0)
    assert slots.acquire("a", 0)
    assert not slots.acquire("a", 0.01)
    assert slots.acquire("b", 0)  # another peer is not held up by a's
    for peer in ("a", "a", "b"):
        slots.release(peer)
    assert slots.peers() == 0
    with pytest.raises(ValueError, match="no frame in flight"):
        slots.release("a")


def test_refusals_are_counted_by_reason():
    refusals = Refusals()
    for reason in ("x", "x", "y"):
        refusals.add(reason)
    assert refusals.snapshot() == {"x": 2, "y": 1}


def test_counters_of_gone_peers_stay_readable_for_the_last_few_only():
    counters = PeerCounters(keep_gone=2)
    for peer in ("a", "b", "c"):
        counters.received(peer, 10)
        counters.retire(peer)
    assert sorted(counters.snapshot()) == ["b", "c"]
    assert counters.live_peers() == 0
    counters.received("b", 5)  # b is back, with its figures
    assert counters.snapshot()["b"].bytes_in == 15
    assert counters.live_peers() == 1


def test_a_peer_with_an_open_stream_is_not_retired():
    counters = PeerCounters()
    assert counters.open_inbound("a", 1)
    counters.retire("a")
    assert counters.live_peers() == 1
    assert counters.inbound_of("a") == 1


# ----- the stream handler over fake streams ------------------------------------------------------


class FakeNetStream:
    """A peer's stream: ``data`` in ``chunk``-sized reads ``every_s`` apart, then EOF or a stall."""

    def __init__(
        self, peer, data=b"", *, chunk=1 << 16, every_s=0.0, slow_from=0, stall_at_end=False
    ):
        self.muxed_conn = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer))
        self.data, self.pos, self.chunk, self.every_s = data, 0, chunk, every_s
        self.slow_from = slow_from
        self.stall_at_end = stall_at_end
        self.was_reset = self.was_closed = False

    async def read(self, n: int) -> bytes:
        if self.pos >= len(self.data):
            if self.stall_at_end:
                await trio.sleep_forever()
            raise StreamEOF
        slow = self.pos >= self.slow_from
        if slow and self.every_s:
            await trio.sleep(self.every_s)
        await trio.lowlevel.checkpoint()
        chunk = self.data[self.pos : self.pos + min(n, self.chunk if slow else n)]
        self.pos += len(chunk)
        return chunk

    async def reset(self) -> None:
        self.was_reset = True

    async def close(self) -> None:
        self.was_closed = True


def _frame(tensor: torch.Tensor, header: FrameHeader = HEADER, codec=None) -> bytes:
    body = pack_tensor(tensor, codec)
    return encode_head(header, len(body)) + body


def _inbound(tmp_path, *, expect=lambda header: SPEC, admit=None, **overrides):
    fields = {"key_path": tmp_path / "k", "rate_window_s": 2.0, "min_body_rate_bytes_s": 1000}
    config = TransportConfig(**{**fields, **overrides})
    inbox: queue.Queue = queue.Queue()
    refusals = Refusals()
    counters = PeerCounters()

    def make():  # trio objects are made inside the run
        return inbound_module.Inbound(
            config, inbox=inbox, counters=counters, refusals=refusals, expect=expect, admit=admit
        )

    return SimpleNamespace(make=make, inbox=inbox, refusals=refusals, counters=counters)


def test_a_peer_the_plan_does_not_expect_is_refused_at_stream_open(tmp_path):
    side = _inbound(tmp_path, admit=lambda peer: peer == "member")
    stranger = FakeNetStream("stranger", _frame(torch.zeros(16)))
    member = FakeNetStream("member", _frame(torch.ones(16)))

    async def main():
        inbound = side.make()
        await inbound.handle_stream(stranger)
        await inbound.handle_stream(member)
        waiting = inbound.tracked_peers()  # the member's frame waits: its slots stay
        _received, release = side.inbox.queue[0]
        release()
        inbound.forget("member")  # it disconnected
        return waiting, inbound.tracked_peers()

    assert run(main) == (1, 0)
    assert stranger.was_reset
    assert stranger.pos == 0  # not a byte read
    assert side.refusals.snapshot() == {inbound_module.NOT_ADMITTED: 1}
    assert "stranger" not in side.counters.snapshot()  # no table grows per stranger
    received, _release = side.inbox.get_nowait()
    assert received.peer == "member"
    assert torch.equal(received.tensor, torch.ones(16))


def test_a_failing_admission_hook_refuses(tmp_path):
    side = _inbound(tmp_path, admit=lambda peer: 1 / 0)
    stream = FakeNetStream("member", _frame(torch.ones(16)))
    run(side.make().handle_stream, stream)
    assert stream.was_reset
    assert side.inbox.empty()


def test_a_body_longer_than_any_frame_of_the_expected_tensor_is_never_read(tmp_path):
    side = _inbound(tmp_path)
    head = encode_head(HEADER, 200 << 20)  # 200 MiB announced for a 16-element tensor
    stream = FakeNetStream("member", head + bytes(1 << 16))
    run(side.make().handle_stream, stream)
    assert stream.was_reset
    assert stream.pos == len(head)
    assert side.refusals.snapshot() == {inbound_module.BODY_TOO_LONG: 1}
    assert side.counters.snapshot()["member"].errors == {"FrameError": 1}


def test_an_expanding_frame_of_the_wrong_shape_is_refused_before_allocation(tmp_path, monkeypatch):
    side = _inbound(tmp_path)
    from fusionllm.compression import codecs as codecs_module

    def refuse(*args, **kwargs):
        raise AssertionError("allocated")

    claim = pack_tensor(torch.zeros(2**10), TopKCodec(2**-10))  # k = 1 of 1024
    claim = claim.replace(b"\x91\xcd\x04\x00", b"\x91\xce\x10\x00\x00\x00")  # sh: [2**28]
    stream = FakeNetStream("member", encode_head(HEADER, len(claim)) + claim)
    monkeypatch.setattr(codecs_module.torch, "zeros", refuse)
    run(side.make().handle_stream, stream)
    assert stream.was_reset
    assert side.inbox.empty()
    assert side.counters.snapshot()["member"].errors == {"FrameError": 1}


def test_a_frame_expanding_past_max_decoded_bytes_is_refused_without_an_expectation(tmp_path):
    side = _inbound(tmp_path, expect=None, max_decoded_bytes=1 << 20)
    frame = _frame(torch.zeros(1 << 19), codec=TopKCodec(2**-19))  # 2 MiB from a few bytes
    stream = FakeNetStream("member", frame)
    run(side.make().handle_stream, stream)
    assert stream.was_reset
    assert side.inbox.empty()


def test_a_trickling_member_is_cut_by_the_rate_floor_and_holds_no_shared_slot(tmp_path):
    side = _inbound(tmp_path, expect=None, inbox_size=1)
    frame = _frame(torch.zeros(4096))
    body_at = len(frame) - len(pack_tensor(torch.zeros(4096)))
    trickle = FakeNetStream("slow", frame, chunk=1, every_s=0.5, slow_from=body_at)
    honest = FakeNetStream("fast", _frame(torch.ones(16)))

    async def main():
        inbound = side.make()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inbound.handle_stream, trickle)
            await trio.sleep(1.0)  # the trickle is mid-body, holding its budget
            assert inbound.budget.held_by("slow") > 0
            await inbound.handle_stream(honest)  # the one shared slot is free for it
            assert not side.inbox.empty()
        return trio.current_time(), inbound.budget.used

    elapsed, held = run(main)
    assert trickle.was_reset
    assert elapsed <= 2.0 + 10.0 + 1.0  # a window, a read's wait
    assert held == 0  # the cut trickle's reservation is back
    assert side.counters.snapshot()["slow"].errors == {"DeadlineError": 1}


def test_a_frame_head_must_arrive_within_one_stall_deadline(tmp_path):
    side = _inbound(tmp_path)
    # Each byte of the head within the 10 s read deadline, the whole head far beyond it.
    stream = FakeNetStream("member", _frame(torch.ones(16)), chunk=1, every_s=5.0)

    async def main():
        await side.make().handle_stream(stream)
        return trio.current_time()

    assert run(main) <= 10.0 + 5.0 + 1.0
    assert stream.was_reset
    assert side.counters.snapshot()["member"].errors == {"DeadlineError": 1}


def test_bodies_over_a_peers_budget_are_refused(tmp_path):
    side = _inbound(
        tmp_path,
        expect=None,
        max_frame_bytes=1 << 20,
        max_peer_pending_bytes=1 << 20,
        max_pending_bytes=1 << 21,
    )
    head = encode_head(HEADER, 1 << 20)

    async def main():
        inbound = side.make()
        first = FakeNetStream("p", head + bytes(100), stall_at_end=True)
        second = FakeNetStream("p", head)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inbound.handle_stream, first)
            await trio.sleep(0.1)
            await inbound.handle_stream(second)  # p's budget is held by the first body
            nursery.cancel_scope.cancel()
        return second

    second = run(main)
    assert second.was_reset
    assert side.refusals.snapshot() == {inbound_module.OVER_BUDGET: 1}


def test_streams_over_the_total_limit_are_refused(tmp_path):
    side = _inbound(tmp_path, max_inbound_streams=2)

    async def main():
        inbound = side.make()
        streams = [FakeNetStream(f"p{i}", stall_at_end=True) for i in range(3)]
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(inbound.handle_stream, stream)
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return streams

    streams = run(main)
    assert [s.was_reset for s in streams] == [False, False, True]
    assert side.refusals.snapshot() == {inbound_module.TOO_MANY_STREAMS: 1}


def test_unexpected_frames_are_refused_at_their_length(tmp_path):
    never = TensorSpec(torch.float32, (-1,))
    side = _inbound(tmp_path, expect=lambda header: never)
    stream = FakeNetStream("member", _frame(torch.ones(16)))
    run(side.make().handle_stream, stream)
    assert stream.was_reset
    assert side.inbox.empty()
    assert side.refusals.snapshot() == {inbound_module.BODY_TOO_LONG: 1}


def test_new_config_fields_are_validated(tmp_path):
    bad = [
        {"max_inbound_streams": 0},
        {"max_decoded_bytes": 0},
        {"max_peer_pending_bytes": 1 << 10},  # below max_frame_bytes
        {"max_pending_bytes": 1 << 20},  # below max_peer_pending_bytes
        {"min_body_rate_bytes_s": 0},
        {"rate_window_s": -1},
    ]
    for override in bad:
        with pytest.raises(ConfigError):
            TransportConfig(key_path=tmp_path / "k", **override)


def test_reads_reset_by_the_peer_are_transport_errors():
    class Reset:
        async def read(self, n):
            from libp2p.network.stream.exceptions import StreamReset

            raise StreamReset

    from fusionllm.node.p2p.stream_reader import StreamReader

    reader = StreamReader(Reset())
    with pytest.raises(TransportError, match="reset"):
        run(functools.partial(reader.read, 10))


def test_the_host_bounds_connections_in_total_and_per_peer():
    from libp2p.crypto.ed25519 import create_new_key_pair

    from fusionllm.node.p2p.host import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_PEER, new_secure_host

    host = new_secure_host(create_new_key_pair(), negotiate_timeout_s=5)
    config = host.get_network().connection_config
    assert config.max_connections == MAX_CONNECTIONS
    assert config.max_connections_per_peer == MAX_CONNECTIONS_PER_PEER
    assert config.high_watermark <= MAX_CONNECTIONS
