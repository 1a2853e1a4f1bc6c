"""A bulk probe on a lane (lane/bulk.py): the pure figure from the kernel's readings, filler
frames over a real loopback lane (dropped by the reader, a tensor after them arrives whole),
a stream refusing filler, and LinkMonitor measuring by lane first, by stream where no lane."""

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import trio

from fusionllm.common.errors import ConfigError, FrameError
from fusionllm.compression import pack_tensor, parse_frame
from fusionllm.node.control.bandwidth import BandwidthBook
from fusionllm.node.control.links import LinkMonitor
from fusionllm.node.errors import TransportError
from fusionllm.node.p2p.framing import (
    MAX_FILLER_BYTES,
    FrameHeader,
    FrameKind,
    encode_head,
)
from fusionllm.node.p2p.inbound import Inbound
from fusionllm.node.p2p.lane.bulk import BulkConfig, run_bulk
from fusionllm.node.p2p.lane.bulk_figure import bulk_figure, past_slow_start, samples_text
from fusionllm.node.p2p.lane.senders import LaneSenders
from fusionllm.node.p2p.lane.serve import LaneFrames
from fusionllm.node.p2p.lane.stream import BlockingLaneReader
from fusionllm.node.p2p.lane.tcp_info import INFINITE_SSTHRESH, TcpInfo
from fusionllm.node.p2p.lane.wire_meter import WireSample
from fusionllm.node.p2p.limits import ByteBudget
from fusionllm.node.p2p.transport_types import PeerCounters, TransportConfig
from tests.support.lanes import KEY, loopback_lane

BUSY = TcpInfo(
    state=1, rtt_s=9e-4, min_rtt_s=5e-4, snd_cwnd=40, snd_mss=1448, bytes_acked=0,
    delivery_rate=120e6, app_limited=False, busy_s=0.0, rwnd_limited_s=0.0,
    sndbuf_limited_s=0.0,
)  # fmt: skip


def reading(acked: int, rate: float, *, at: float = 100.0, **fields) -> tuple[TcpInfo, float]:
    return replace(BUSY, bytes_acked=acked, delivery_rate=rate, **fields), at


def test_the_figure_is_the_best_but_one_busy_sample_each_after_min_bytes_more_acked():
    start = replace(BUSY, bytes_acked=1000)
    readings = [
        reading(1000 + 100, 5e6),  # under min_bytes since the start: not a new sample
        reading(1000 + 300, 40e6, at=1.0),  # slow start on a new lane
        reading(1000 + 350, 1e6),  # the kernel's rate not renewed enough: skipped
        reading(1000 + 600, 118e6, min_rtt_s=4e-4, at=2.0),
        reading(1000 + 900, 121e6, app_limited=True),  # the queue ran dry: says nothing
        reading(1000 + 1200, 60e6, at=3.0),  # a loss's recovery
        reading(1000 + 1500, 135e6, at=4.0),  # ACKs bunched: one sample cannot set it
    ]
    # The median of the four counted samples (40, 118, 60, 135) would read 89 MB/s.
    assert bulk_figure(start, readings, min_bytes=256) == WireSample(118e6, 4e-4, 4.0)
    assert bulk_figure(start, readings[:2], min_bytes=256) == WireSample(40e6, 5e-4, 1.0)


def test_the_figure_keeps_its_counted_samples_in_order_marked_where_in_slow_start():
    # What the log shows of a probe, so a figure over the cap can be told from its samples.
    start = replace(BUSY, bytes_acked=0)
    ramp = {"snd_cwnd": 10, "snd_ssthresh": INFINITE_SSTHRESH}
    readings = [
        reading(300, 2e6, **ramp),
        reading(400, 9e6, **ramp),  # not min_bytes more: not counted, not shown
        reading(700, 8.7e6, **ramp),  # bunched ACKs of whole segments: over a 6.25 cap
        reading(1000, 6.1e6, app_limited=True),  # not trusted: not shown
        reading(1100, 6.2e6),
    ]
    sample = bulk_figure(start, readings, min_bytes=256)
    assert sample.samples == (-2e6, -8.7e6, 6.2e6)
    assert sample.bandwidth == 6.2e6
    assert samples_text(sample.samples) == "2* 8.7* 6.2"


def test_no_trusted_sample_gives_no_figure():
    start = replace(BUSY, bytes_acked=0)
    idle = [reading(1 << 20, 3e6, app_limited=True), reading(2 << 20, 9e6, state=7)]
    assert bulk_figure(start, idle, min_bytes=1) is None
    assert bulk_figure(start, [], min_bytes=1) is None
    with pytest.raises(ValueError, match="min_bytes must be >= 1"):
        bulk_figure(start, [], min_bytes=0)


def test_samples_in_a_losss_recovery_do_not_pull_the_figure_down():
    # h1 -> h5 on topology C (session 15): 4.83 of 5 MB/s in slow start, 1.63-1.91 after.
    start = replace(BUSY, bytes_acked=0)
    ramp = {"snd_ssthresh": INFINITE_SSTHRESH}
    rates = [0.9e6, 2.7e6, 4.6e6, 4.83e6, 4.82e6]
    readings = [reading(100 * (k + 1), r, **ramp) for k, r in enumerate(rates)]
    after = [reading(600 + 100 * k, r, snd_ssthresh=20) for k, r in enumerate([1.9e6, 1.6e6])]
    assert bulk_figure(start, readings + after, min_bytes=100).bandwidth == 4.82e6


def test_a_probe_whose_samples_stopped_climbing_in_slow_start_need_not_go_on():
    # No loss, so the kernel never left slow start, but the rate is flat: the path's.
    start = replace(BUSY, bytes_acked=0)
    ramp = {"snd_ssthresh": INFINITE_SSTHRESH}
    rates = [1.5e6, 6e6, 11.8e6, 11.9e6, 12.0e6, 12.06e6, 11.95e6, 12.02e6]
    readings = [reading(100 * (k + 1), rate, **ramp) for k, rate in enumerate(rates)]
    assert past_slow_start(start, readings, min_bytes=100, settled=2)
    assert not past_slow_start(start, readings[:7], min_bytes=100, settled=2)  # 6 -> 12 climbs
    assert bulk_figure(start, readings, min_bytes=100).bandwidth == 12.02e6


def trace(rates: list[float], *, rtt: float, step: int = 1 << 17, **fields) -> list:
    """Readings a probe's samples make: each ``step`` more acked, at its rate's pace; a rate
    given negative was read in slow start (as the log shows them)."""
    readings, acked, at = [], 0, 100.0
    for rate in rates:
        acked, at = acked + step, at + step / abs(rate)
        ramp = {"snd_ssthresh": INFINITE_SSTHRESH} if rate < 0 else {"snd_ssthresh": 20}
        readings.append(reading(acked, abs(rate), at=at, min_rtt_s=rtt, **ramp, **fields))
    return readings


# Two of 241 probes of a full C run (session 20), h1 -> h3, 12.5 MB/s at 40 ms: flat at 12.1
# in slow start, then a climb into the emulator's queue, then a loss (MB/s; negative: slow
# start).
QUEUE_CLIMB = [-12.1] * 8 + [-12.2, -12.6, -12.8, -13.2, -13.5, -13.8, -14.5, -14.5, -14,
                             -11.2, -2.97, -10.4, -10.7, 11]  # fmt: skip
QUEUE_CLIMB_BACK = [-12.1] * 10 + [-13.4, -13.9, -11.9, -11.9, -12, -12, -12, -12, -12, -12.1,
                                   -12, -12, -12, 7.45]  # fmt: skip


@pytest.mark.parametrize("rates", [QUEUE_CLIMB, QUEUE_CLIMB_BACK])
def test_slow_start_samples_climbing_past_a_plateau_into_a_queue_do_not_count(rates):
    start = replace(BUSY, bytes_acked=0)
    before = sorted(abs(r) for r in rates)[-2] / 12.5  # the best but one of them all
    sample = bulk_figure(start, trace([r * 1e6 for r in rates], rtt=0.040), min_bytes=1 << 17)
    print(f"figure {sample.bandwidth / 12.5e6:.3f} of the cap, {before:.3f} by every sample")
    assert before > 1.07
    assert 0.95 <= sample.bandwidth / 12.5e6 <= 1.05


def test_a_climb_the_probe_settles_at_counts_and_so_does_one_within_a_round_trip():
    start = replace(BUSY, bytes_acked=0)
    # Flat at half the link while a training frame shared it, then the link's own rate.
    shared = [-1, -2] + [-2.5] * 10 + [-4.8] * 8
    figure = bulk_figure(start, trace([r * 1e6 for r in shared], rtt=0.040), min_bytes=1 << 17)
    assert figure.bandwidth == 4.8e6
    # A far, fast path (100 ms): a round's samples read alike in slow start (all it acks of a
    # round at 12 MB/s is nine samples), then the rate doubles.
    rounds = [-6] * 4 + [-12] * 9 + [-24] * 18
    figure = bulk_figure(start, trace([r * 1e6 for r in rounds], rtt=0.100), min_bytes=1 << 17)
    assert figure.bandwidth == 24e6
    # Flat because the receiver's window held it, not the path: what follows counts.
    held = trace([-5e6] * 10, rtt=0.040)
    held = [(replace(info, rwnd_limited_s=0.01 * k), at) for k, (info, at) in enumerate(held)]
    climb = trace([-8e6, -8e6], rtt=0.040, step=1 << 17)
    climb = [(replace(info, bytes_acked=info.bytes_acked + 10 * (1 << 17)), at + 1.0)
             for info, at in climb]  # fmt: skip
    assert bulk_figure(start, held + climb, min_bytes=1 << 17).bandwidth == 8e6


def test_the_config_is_checked():
    with pytest.raises(ConfigError, match="over"):
        BulkConfig(frame_bytes=MAX_FILLER_BYTES + 1)
    with pytest.raises(ConfigError, match="samples must be an int >= 1"):
        BulkConfig(samples=0)
    with pytest.raises(ConfigError, match=r"lock_wait_s must be in \[0, 10\]"):
        BulkConfig(lock_wait_s=-1.0)
    with pytest.raises(ConfigError, match="extend must be an int >= 1"):
        BulkConfig(extend=0)


class LaneInboxFake:
    """What LaneFrames needs of inbound.py, keeping what it delivers."""

    def __init__(self) -> None:
        self.config = TransportConfig(key_path="unused")
        self.thread_decoders = threading.Semaphore(1)
        self.budget = ByteBudget(per_peer=8 << 20, total=16 << 20)
        self.counters = PeerCounters()
        self.delivered_frames: list = []

    def head_limits(self) -> dict[str, float]:
        return {"max_body_bytes": 8 << 20, "stall_timeout_s": 10.0, "idle_timeout_s": 10.0}

    def spec_for(self, header, body_len):
        assert header.kind is not FrameKind.FILLER  # filler never reaches the tensor path
        return None

    def reserve(self, peer: str, body_len: int) -> None:
        if not self.budget.reserve(peer, body_len):
            raise FrameError("over budget")

    def parse(self, body, spec):
        return parse_frame(body, limits=self.config.limits)

    def delivered(self, received) -> bool:
        self.delivered_frames.append(received)
        return True

    def queue_from_thread(self, received, body_len: int) -> None:
        raise AssertionError("every frame is delivered")


@pytest.fixture
def lane_pair():
    writer, peer = loopback_lane()
    yield writer, BlockingLaneReader(peer, KEY)
    peer.close()
    trio.run(writer.close)


def test_a_bulk_probe_is_timed_on_the_lane_and_its_filler_dropped_by_the_reader(lane_pair):
    writer, reader = lane_pair
    inbox = LaneInboxFake()
    frames = LaneFrames(inbox, "a", reader)
    serving = threading.Thread(target=frames.serve, daemon=True)
    serving.start()
    sample, deadline, probes = None, time.monotonic() + 20, 0
    while sample is None and time.monotonic() < deadline:  # a loaded box may mark it idle
        sample = run_bulk(writer, 2 << 20, timeout=10.0, config=BulkConfig(frame_bytes=1 << 19))
        probes += 1
    assert sample is not None, f"no trusted kernel sample in {probes} bulk probes of 2 MiB"
    assert sample.bandwidth > 1e6
    assert 0 < sample.rtt < 1.0
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)  # (2, 3)
    body = pack_tensor(tensor)
    head = FrameHeader(step=3, micro_batch=1, kind=FrameKind.ACTIVATION, stage=0)
    writer.write_frame((encode_head(head, len(body)), body), timeout=10)
    trio.run(writer.close)
    serving.join(timeout=20)
    assert not serving.is_alive()
    # Only the tensor was delivered, whole, after every filler byte was read and counted.
    (received,) = inbox.delivered_frames
    assert received.header == head
    assert torch.equal(received.tensor, tensor)
    assert inbox.counters.snapshot()["a"].bytes_in >= probes * (2 << 20) + len(body)
    assert inbox.budget.used == 0


def test_a_filler_frame_over_its_limit_is_refused_before_its_body(lane_pair):
    writer, reader = lane_pair
    inbox = LaneInboxFake()
    size = MAX_FILLER_BYTES + 1
    head = encode_head(FrameHeader(step=0, micro_batch=0, kind=FrameKind.FILLER, stage=0), size)
    writer.write_frame((head, b"x"), timeout=10)  # the body need not come: refused at its length
    with pytest.raises(FrameError, match="a filler frame of 4194305 bytes, over 4194304"):
        LaneFrames(inbox, "a", reader).serve()
    assert inbox.budget.used == 0


def test_a_stream_refuses_filler_frames():
    inbound = SimpleNamespace(_expect=None)
    header = FrameHeader(step=0, micro_batch=0, kind=FrameKind.FILLER, stage=0)
    with pytest.raises(FrameError, match="a filler frame on a stream"):
        Inbound.spec_for(inbound, header, 1 << 20)


class ProbeOnlyControl:
    """A control host whose stream probe reads what a starved Python-paced probe read."""

    def __init__(self) -> None:
        self.probed: list[str] = []

    def publish(self, topic: str, data: bytes) -> None:
        pass  # our links\' gossip: nobody listens here

    def connected_peers(self) -> list[str]:
        return ["b", "c"]

    def probe(self, peer: str, *, nbytes: int):
        self.probed.append(peer)
        return SimpleNamespace(bandwidth=3e6, rtt=2e-3, bytes=nbytes, seconds=0.3, relayed=False)


def test_links_with_a_lane_are_probed_on_it_the_others_by_stream():
    book, control, asked = BandwidthBook(max_age_s=60.0), ProbeOnlyControl(), []

    def lane_probe(peer: str, nbytes: int) -> WireSample | None:
        asked.append((peer, nbytes))
        return WireSample(118e6, 6e-4, time.time()) if peer == "b" else None  # no lane to c

    members = {"a": object(), "b": object(), "c": object()}
    monitor = LinkMonitor(
        control=control, book=book, peer_id="a", swarm="demo", topic="t",
        probe_interval_s=8.0, probe_fanout=2, probe_bytes=1 << 20, max_connections=8,
        members=lambda: members, neighbours=lambda: ["b", "c"], stop=threading.Event(),
        lane_probe=lane_probe,
    )  # fmt: skip
    monitor._probe_round(members)
    assert sorted(asked) == [("b", 1 << 20), ("c", 1 << 20)]
    assert control.probed == []  # c waits a probe interval for a lane (not training yet)
    monitor._lane_missed_at["c"] -= 8.0
    monitor._probe_round(members)
    assert control.probed == ["c"]  # the stream probe only where no lane carried it
    measured = book.last_measured("a", time.time())
    assert set(measured) == {"b", "c"}
    now = time.time()
    table = {(v.src, v.dst): v for v in book.link_table([_info(p) for p in members], now=now)}
    assert (table["a", "b"].bandwidth, table["a", "b"].rtt) == (118e6, 6e-4)
    assert (table["a", "c"].bandwidth, table["a", "c"].rtt) == (3e6, 2e-3)


def _info(peer: str) -> SimpleNamespace:
    """The fields of a NodeInfo that link_table reads."""
    return SimpleNamespace(peer_id=peer, uplink=1e6, downlink=1e6)


class FakeLane:
    """A lane's writer side as run_bulk uses it: frames 'drain' at once, the kernel's
    readings come from a counter; ``fail_at`` makes that frame's write break the lane; the
    readings after the first ``ramp_frames`` frames are in slow start, their samples climbing
    to 60 MB/s (None: it never ends)."""

    def __init__(self, *, fail_at: int | None = None, ramp_frames: int | None = 0) -> None:
        self.lock = threading.Lock()
        self.punched = False
        self.acked = 0
        self.frames = 0
        self.sizes: list[int] = []
        self.fail_at = fail_at
        self.ramp_frames = ramp_frames
        self.last_reading: tuple[TcpInfo, float] | None = None

    def kernel_info(self) -> TcpInfo:
        if self.ramp_frames is None or self.frames <= self.ramp_frames:
            ramp = 60e6 * min(1.0, (self.frames + 1) / 16)
            return replace(BUSY, bytes_acked=self.acked, delivery_rate=ramp,
                           snd_ssthresh=INFINITE_SSTHRESH)  # fmt: skip
        return replace(BUSY, bytes_acked=self.acked)

    def write_locked(self, parts, deadline: float) -> int:
        if self.frames == self.fail_at:
            raise TransportError("writing to the lane failed: reset by peer")
        sealed = sum(len(p) for p in parts) + 32
        self.sizes.append(len(parts[1]))
        self.acked += sealed
        self.frames += 1
        self.last_reading = (self.kernel_info(), 100.0)  # what LaneWriter._measure files
        return sealed


def _senders(lane: FakeLane) -> tuple[LaneSenders, PeerCounters]:
    counters = PeerCounters()
    senders = LaneSenders(counters)
    senders.add("b", lane)
    return senders, counters


HEAD = len(encode_head(FrameHeader(step=0, micro_batch=0, kind=FrameKind.FILLER, stage=0), 1))


def test_a_bulk_probe_writes_whole_mib_frames_and_counts_them():
    lane = FakeLane()
    senders, counters = _senders(lane)
    sample = senders.bulk_probe("b", 3 << 20)  # three 1 MiB filler frames
    assert sample is not None
    assert sample.bandwidth == BUSY.delivery_rate
    assert lane.sizes == [1 << 20] * 3
    assert counters.snapshot()["b"].bytes_out == 3 * ((1 << 20) + HEAD)
    assert sample.probe_bytes == counters.snapshot()["b"].bytes_out


def test_the_kernel_is_read_between_writes_by_the_poller():
    class SlowLane(FakeLane):
        def write_locked(self, parts, deadline: float) -> int:
            time.sleep(0.1)  # the socket drains for a while: the poller reads meanwhile
            return super().write_locked(parts, deadline)

    lane, reads = SlowLane(), []
    original = lane.kernel_info
    lane.kernel_info = lambda: reads.append(lane.frames) or original()
    senders, _ = _senders(lane)
    assert senders.bulk_probe("b", 2 << 20) is not None
    # Read while the first frame drained (before it was counted), not only after writes.
    assert reads.count(0) > 3


def test_a_probe_still_in_slow_start_goes_on_until_two_samples_past_it():
    lane = FakeLane(ramp_frames=10)  # a far link: 1 MiB ends inside slow start
    senders, _ = _senders(lane)
    sample = senders.bulk_probe("b", 1 << 20)
    assert sample is not None
    # Frames 2-10 (a quarter MiB each) still ramp; 11 and 12 give two samples past slow start.
    assert lane.sizes == [1 << 20] + [256 << 10] * 11
    assert sample.bandwidth == BUSY.delivery_rate  # 120 MB/s, where the ramp read 41 at most
    assert sample.probe_bytes == (1 << 20) + 11 * (256 << 10) + 12 * HEAD


def test_a_probe_that_never_leaves_slow_start_stops_at_extend_times_its_bytes():
    lane = FakeLane(ramp_frames=None)
    senders, _ = _senders(lane)
    sample = senders.bulk_probe("b", 1 << 20)
    assert sum(lane.sizes) == 4 << 20  # BulkConfig.extend
    assert sample is not None
    assert sample.bandwidth == 60e6 * 13 / 16  # the ramp's best but one (after frame 12 of 13)


def test_a_bulk_probe_on_a_busy_lane_counts_nothing_sent():
    lane = FakeLane()
    senders, counters = _senders(lane)
    lane.lock.acquire()  # a training frame holds the lane past the probe's lock wait
    try:
        assert senders.bulk_probe("b", 1 << 20) is None
    finally:
        lane.lock.release()
    assert lane.frames == 0
    assert "b" not in counters.snapshot()


def test_a_bulk_probe_cut_short_counts_only_whole_frames_and_drops_the_lane():
    lane = FakeLane(fail_at=1)  # the second frame's write breaks
    senders, counters = _senders(lane)
    assert senders.bulk_probe("b", 3 << 20) is None
    assert counters.snapshot()["b"].bytes_out == (1 << 20) + HEAD  # the first frame only
    assert senders.bulk_probe("b", 1 << 20) is None  # dropped: no lane to probe on
    assert lane.frames == 1
