"""A bulk probe's figure from the kernel's readings (pure: tests feed it made-up readings).

Why the best but one, not the median (session 13, topology C): a kernel rate sample spans at
least a round trip of sends and of ACKs, so it reads the path low, never high, unless ACKs
arrive bunched; slow start on a new lane, a loss's recovery in the middle of the probe (a
home uplink's deep queue overflowing) and a peer whose own uplink delays our ACKs all pull
samples down. The median of a 1 MiB probe read 0.58-0.82 of a 2.5-12.5 MB/s cap on the
first probe of far or small links where the probe's best samples read 0.90-0.96 of it; one
bunched sample cannot set the figure.

Why not only the samples past slow start (tried in sessions 14-15, topology C): they came
after a loss, in its recovery, and read 0.33-0.5 of the cap where the same probe's samples
in slow start had read 0.96 of it (h1 -> h5: 4.83 then 1.63-1.91 MB/s of 5; h2 -> h3: 4.8
then 1.65-3.24). Slow start can over-read (bunched ACKs of the emulator's whole GSO segments:
h1 -> h4 read 8.7-9.0 MB/s of 6.25 in session 14, h1 -> h5 6.21 of 5 in session 15), which
the best but one only partly guards against.

Why a slow-start sample above the probe's plateau does not count (session 20, topology C):
the bulk probes' logged samples show the over-read. h1 -> h3 (12.5 MB/s at 40 ms) held 12.1
for 8-10 samples, the kernel still in slow start (no loss yet), then climbed to 13.4-14.5 as
the window grew into the emulator's queue, and its next samples fell to a loss (2.97) and
its recovery: two such samples set the figure at 1.07 and 1.16 of the cap, 2 of 241 probes
of a full C run. A window that held the rate flat without the receiver's window or our send
buffer holding it back has met the path; more window after that buys queue, not rate.
"""

from collections.abc import Iterable

from fusionllm.node.p2p.lane.tcp_info import TcpInfo
from fusionllm.node.p2p.lane.wire_meter import WireSample, trusted

Reading = tuple[TcpInfo, float]  # the kernel's view and the wall clock it was read at
# A probe whose last this-many samples lie within this spread has stopped climbing.
PLATEAU = 6
PLATEAU_SPREAD = 1.05


def counted_samples(
    start: TcpInfo, readings: Iterable[Reading], *, min_bytes: int
) -> list[Reading]:
    """The readings that count as rate samples: trusted, each once ``min_bytes`` more were
    acknowledged than at the last one counted (a rate the kernel did not renew must not count
    twice)."""
    if min_bytes < 1:
        raise ValueError(f"min_bytes must be >= 1, got {min_bytes}")
    acked, counted = start.bytes_acked, []
    for info, at in readings:
        if trusted(info) and info.bytes_acked - acked >= min_bytes:
            acked = info.bytes_acked
            counted.append((info, at))
    return counted


def past_slow_start(
    start: TcpInfo, readings: list[Reading], *, min_bytes: int, settled: int
) -> bool:
    """Whether ``settled`` samples were counted since the kernel last doubled its window (on
    a far link a 1 MiB probe ends inside slow start: h1 -> h5 on topology C, 5 MB/s at 80 ms,
    samples 1.1 -> 3.9 MB/s, still climbing when it ended), or the last ``PLATEAU`` samples
    no longer climb: without a loss the kernel never leaves slow start, and h1 -> h3 (12.5
    MB/s at 40 ms) went on to 4 MiB at 11.8-12.06 MB/s (session 15)."""
    ramping = [i for i, (info, _) in enumerate(readings) if info.slow_start]
    base, after = (
        (readings[ramping[-1]][0], readings[ramping[-1] + 1 :]) if ramping else (start, readings)
    )
    if len(counted_samples(base, after, min_bytes=min_bytes)) >= settled:
        return True
    return _settled(counted_samples(start, readings, min_bytes=min_bytes))


def _settled(counted: list[Reading]) -> bool:
    """Whether the last ``PLATEAU`` samples lie within ``PLATEAU_SPREAD`` of each other."""
    last = [info.delivery_rate for info, _ in counted[-PLATEAU:]]
    return len(last) == PLATEAU and max(last) <= PLATEAU_SPREAD * min(last)


def _limited(first: TcpInfo, last: TcpInfo) -> bool:
    """Whether the receiver's window or our send buffer held the sender back in between."""
    return (
        last.rwnd_limited_s > first.rwnd_limited_s or last.sndbuf_limited_s > first.sndbuf_limited_s
    )


def _plateau(counted: list[Reading]) -> tuple[int, float] | None:
    """Where the first plateau ends, and its highest rate: at least ``PLATEAU`` samples
    within ``PLATEAU_SPREAD`` of each other over two round trips or more, neither window nor
    buffer limited. Two round trips, as slow start doubles its rate each round trip yet the
    samples of one round read alike (a 100 Mbit/s, 100 ms path acks ten of a 1 MiB probe's
    samples in one round)."""
    for end in range(PLATEAU, len(counted) + 1):
        last, until = counted[end - 1]
        low = high = last.delivery_rate
        rtt = last.min_rtt_s
        for first in range(end - 1, -1, -1):
            info, at = counted[first]
            low, high = min(low, info.delivery_rate), max(high, info.delivery_rate)
            rtt = min(rtt, info.min_rtt_s)
            if high > PLATEAU_SPREAD * low:
                break
            if end - first >= PLATEAU and until - at >= 2 * rtt and not _limited(info, last):
                return end, high
    return None


def without_queue_climbs(counted: list[Reading]) -> list[Reading]:
    """``counted`` less the slow-start samples after the first plateau (``_plateau``) above
    its rates by more than the spread: the window grown into a queue past the path (module
    doc). Unless the probe's last ``PLATEAU`` samples settled above it: a plateau the link
    gave the probe while a training frame shared it, its rate once the frame was through."""
    plateau = _plateau(counted)
    if plateau is None:
        return counted
    end, high = plateau
    ceiling = PLATEAU_SPREAD * high
    after = counted[end:]
    if _settled(after) and min(info.delivery_rate for info, _ in after[-PLATEAU:]) > ceiling:
        return counted  # the rate settled higher: the plateau was shared (a frame went by)
    return counted[:end] + [
        (info, at) for info, at in counted[end:]
        if not (info.slow_start and info.delivery_rate > ceiling)
    ]  # fmt: skip


def bulk_figure(
    start: TcpInfo, readings: Iterable[Reading], *, min_bytes: int
) -> WireSample | None:
    """The link's figure from the kernel's readings during a bulk probe that began at
    ``start``: the best but one of the counted samples (``counted_samples``; the only one,
    where one was) that did not climb into a queue (``without_queue_climbs``), with the least
    minimum RTT; None where none counted. The samples it keeps for the log are all counted."""
    counted = counted_samples(start, readings, min_bytes=min_bytes)
    if not counted:
        return None
    rates = sorted(info.delivery_rate for info, _ in without_queue_climbs(counted))
    figure = rates[-2] if len(rates) > 1 else rates[0]
    min_rtt = min(info.min_rtt_s for info, _ in counted)
    trace = tuple(-i.delivery_rate if i.slow_start else i.delivery_rate for i, _ in counted)
    return WireSample(figure, min_rtt, counted[-1][1], samples=trace)


def samples_text(samples: tuple[float, ...]) -> str:
    """A probe's samples as the log shows them: MB/s in order, ``*`` where slow start."""
    return " ".join(f"{abs(r) / 1e6:.3g}{'*' if r < 0 else ''}" for r in samples)
