"""What a node knows about the links of its swarm: its own probes and its peers' gossip.

Each node probes a bounded sample of peers and gossips what it measured (``BandwidthReport``,
one small message per period). ``BandwidthBook`` keeps the newest samples of every directed
link with their times, forgets samples older than ``max_age_s``, and turns a membership snapshot
into the planner's ``Swarm``: measured links as measured, every other pair estimated by the
Swarm from the two ends' uplink/downlink (and marked estimated in ``link_table``).

Only members' word counts: a report is filed only if its author is a member, and only its
links towards members (``record_report``); a node's downlink is read only from what members
measured towards it (``towards``). A stranger can neither add links to the planner's Swarm nor
raise a member's advertised downlink.

A link's figure is the best of its recent samples (highest bandwidth, lowest RTT; BBR's
windowed filters): contention for the CPU or the wire only ever slows a probe, so the fastest
recent one is the closest to what the link carries. Measured on a loaded 2-core box, single
probes of the same loopback link ranged 0.6-40 MB/s, enough to keep a faster newcomer out of
every plan. Our own probes keep a window (``record(window=...)``); a member's gossip is already
its filtered figure, so it replaces (window 1) and every node sees that link as its author does.

Bandwidths and RTTs are rounded to a quarter-octave grid before planning: two nodes whose
books differ by measurement noise then build the same Swarm, hence the same plan and digest.
"""

import math
import random
import threading
from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from fusionllm.common.errors import ConfigError, peer_repr
from fusionllm.dag.cost import DeviceProfile, LinkProfile
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.dht.records import (
    MAX_CLOCK_SKEW_S,
    MAX_NAME_CHARS,
    LinkReport,
    NodeInfo,
    RecordError,
)

REPORT_VERSION = 1
MAX_REPORT_LINKS = 64
MAX_REPORT_BYTES = 16 << 10


@dataclass(frozen=True, kw_only=True)
class BandwidthReport:
    """One gossip message: links its author measured (author -> peer)."""

    swarm: str
    time: float
    links: tuple[LinkReport, ...]
    # Its author woke from quiet because the swarm changed: the members should look too
    # (node/control/quiet.py).
    wake: bool = False

    def to_bytes(self) -> bytes:
        wire = {
            "v": REPORT_VERSION,
            "swarm": self.swarm,
            "t": self.time,
            "links": [link.to_wire() for link in self.links],
            **({"wake": True} if self.wake else {}),
        }
        return msgpack.packb(wire, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "BandwidthReport":
        if len(data) > MAX_REPORT_BYTES:
            raise RecordError(f"bandwidth report of {len(data)} bytes, over {MAX_REPORT_BYTES}")
        try:
            wire = msgpack.unpackb(
                data, raw=False, strict_map_key=True, max_str_len=256, max_bin_len=0,
                max_array_len=MAX_REPORT_LINKS, max_map_len=8, max_ext_len=0,
            )  # fmt: skip
        except Exception as exc:  # msgpack raises assorted types
            raise RecordError(f"bandwidth report is not msgpack: {exc}") from exc
        if not isinstance(wire, dict) or set(wire) - {"wake"} != {"v", "swarm", "t", "links"}:
            raise RecordError("bandwidth report has the wrong fields")
        if wire.get("wake", True) is not True:
            raise RecordError("bandwidth report wake must be true when present")
        if type(wire["v"]) is not int or wire["v"] != REPORT_VERSION:  # True == 1 == 1.0
            raise RecordError(f"bandwidth report version {peer_repr(wire['v'])} is not supported")
        swarm, when, links = wire["swarm"], wire["t"], wire["links"]
        if not isinstance(swarm, str) or not 0 < len(swarm) <= MAX_NAME_CHARS:
            raise RecordError("bandwidth report swarm must be a short string")
        if isinstance(when, bool) or not isinstance(when, int | float) or not math.isfinite(when):
            raise RecordError("bandwidth report time must be a finite number")
        if not isinstance(links, list):
            raise RecordError("bandwidth report links must be a list")
        return cls(
            swarm=swarm,
            time=float(when),
            links=tuple(LinkReport.from_wire(x) for x in links),
            wake="wake" in wire,
        )


@dataclass(frozen=True)
class LinkSample:
    bandwidth: float  # bytes/s
    rtt: float  # s
    measured_at: float  # wall clock
    relayed: bool = False  # through a relay (node/p2p/relay_client.py)
    punched: bool = False  # on a lane punched through NATs (node/p2p/lane/punch.py)


@dataclass(frozen=True)
class LinkView:
    """One directed link as the status command shows it."""

    src: str
    dst: str
    bandwidth: float
    rtt: float
    measured: bool  # False: estimated from the ends' uplink/downlink
    age: float | None


def quantize(value: float, steps_per_octave: int = 4) -> float:
    """``value`` rounded to the nearest point of a log2 grid (0 stays 0)."""
    if value <= 0 or not math.isfinite(value):
        return value
    return 2.0 ** (round(math.log2(value) * steps_per_octave) / steps_per_octave)


class BandwidthBook:
    """Newest samples per directed link; thread-safe (probe and gossip threads both write)."""

    def __init__(self, *, max_age_s: float) -> None:
        if not max_age_s > 0:
            raise ConfigError(f"max_age_s must be > 0, got {max_age_s}")
        self.max_age_s = max_age_s
        self._links: dict[tuple[str, str], tuple[LinkSample, ...]] = {}  # oldest first
        self._lock = threading.Lock()

    def record(
        self, src: str, dst: str, sample: LinkSample, *, now: float, window: int = 1
    ) -> bool:
        """Keep ``sample`` if it is newer than what we have and not stale or from the future,
        with at most ``window - 1`` earlier samples of the link beside it."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if src == dst or not (now - self.max_age_s <= sample.measured_at <= now + MAX_CLOCK_SKEW_S):
            return False
        with self._lock:
            kept = self._links.get((src, dst), ())
            if kept and kept[-1].measured_at >= sample.measured_at:
                return False
            self._links[(src, dst)] = (*kept, sample)[-window:]
        return True

    def record_report(
        self, author: str, report: BandwidthReport, *, now: float, members: Container[str]
    ) -> int:
        """The links in a gossiped report, attributed to its (signature-verified) author: none
        unless the author is one of ``members``, and only its links towards members."""
        if author not in members:
            return 0
        kept = 0
        for link in report.links:
            if link.peer not in members:
                continue
            at = report.time - link.age
            kept += self.record(
                author,
                link.peer,
                LinkSample(link.bandwidth, link.rtt, at, link.relayed, link.punched),
                now=now,
            )
        return kept

    def own_report(self, me: str, swarm: str, *, now: float) -> BandwidthReport:
        """What this node measured itself, newest first, for gossip and its DHT record."""
        mine = sorted(
            ((dst, s) for (src, dst), s in self._fresh(now).items() if src == me),
            key=lambda item: (-item[1].measured_at, item[0]),
        )[:MAX_REPORT_LINKS]
        links = tuple(
            LinkReport(
                peer=dst,
                bandwidth=s.bandwidth,
                rtt=s.rtt,
                age=max(0.0, now - s.measured_at),
                relayed=s.relayed,
                punched=s.punched,
            )
            for dst, s in mine
        )
        return BandwidthReport(swarm=swarm, time=now, links=links)

    def linked(self, peers: Collection[str], *, now: float) -> set[str]:
        """Those of ``peers`` with a fresh measured link to or from another of them."""
        links = [key for key in self._fresh(now) if key[0] in peers and key[1] in peers]
        return {peer for link in links for peer in link}

    def measured_pairs(self, peers: Collection[str], *, now: float) -> set[tuple[str, str]]:
        """The directed links among ``peers`` with a fresh measurement."""
        return {key for key in self._fresh(now) if key[0] in peers and key[1] in peers}

    def towards(self, dst: str, now: float, *, sources: Container[str]) -> list[float]:
        """Fresh bandwidths ``sources`` measured towards ``dst`` (its downlink, seen from
        outside; only members' samples, or a stranger could set it)."""
        return [
            s.bandwidth for (src, d), s in self._fresh(now).items() if d == dst and src in sources
        ]

    def last_measured(self, src: str, now: float) -> dict[str, float]:
        """dst -> time of src's newest fresh sample towards it."""
        return {d: s.measured_at for (a, d), s in self._fresh(now).items() if a == src}

    def newest(self, src: str, dst: str, *, now: float) -> LinkSample | None:
        """The link's newest fresh sample (not the best of its window, as plans take it):
        what it costs now, for a witness that must not blame a slowed link on compute."""
        with self._lock:
            samples = self._links.get((src, dst), ())
        return samples[-1] if samples and now - samples[-1].measured_at <= self.max_age_s else None

    def swarm(self, members: Sequence[NodeInfo], *, now: float) -> Swarm:
        """The planner's view of ``members``: fresh measured links, quantized."""
        peers = [peer_of(info) for info in members]
        ids = {p.peer_id for p in peers}
        links = {
            (src, dst): LinkProfile(
                bandwidth=quantize(sample.bandwidth), rtt=quantize(max(sample.rtt, 1e-4), 2)
            )
            for (src, dst), sample in self._fresh(now).items()
            if src in ids and dst in ids
        }
        return Swarm.from_links(peers, links)

    def link_table(self, members: Sequence[NodeInfo], *, now: float) -> list[LinkView]:
        """Every directed pair of ``members``: measured where we have it, else estimated."""
        fresh = self._fresh(now)
        by_id = {m.peer_id: m for m in members}
        table = []
        for src in sorted(by_id):
            for dst in sorted(by_id):
                if src == dst:
                    continue
                sample = fresh.get((src, dst))
                if sample is not None:
                    table.append(LinkView(src, dst, sample.bandwidth, sample.rtt, True,
                                          now - sample.measured_at))  # fmt: skip
                else:
                    bw = min(by_id[src].uplink, by_id[dst].downlink)
                    table.append(LinkView(src, dst, bw, 0.05, False, None))
        return table

    def _fresh(self, now: float) -> dict[tuple[str, str], LinkSample]:
        """Every link with a fresh sample: its best recent figures, dated by its newest."""
        with self._lock:
            for key, samples in list(self._links.items()):
                young = tuple(s for s in samples if now - s.measured_at <= self.max_age_s)
                if young:
                    self._links[key] = young
                else:
                    del self._links[key]
            return {key: _best_of(samples) for key, samples in self._links.items()}


def _best_of(samples: tuple[LinkSample, ...]) -> LinkSample:
    return LinkSample(
        bandwidth=max(s.bandwidth for s in samples),
        rtt=min(s.rtt for s in samples),
        measured_at=samples[-1].measured_at,
        relayed=samples[-1].relayed,
        punched=samples[-1].punched,
    )


def peer_of(info: NodeInfo) -> Peer:
    """The planner's Peer for a node record (device numbers quantized, see module doc), its
    compute as slow as the node measured itself (``NodeInfo.pace``, pace.py) and its own work
    as much longer than modelled as it measured (``NodeInfo.stretch``, stretch.py)."""
    device, pace = info.device, info.pace * max(info.stretch, 1.0)
    profile = DeviceProfile(
        name=device.name,
        flops=quantize(device.flops / pace),
        memory_bandwidth=quantize(device.memory_bandwidth / pace),
        memory_bytes=device.memory_bytes,
        op_overhead=quantize(device.op_overhead * pace) if device.op_overhead > 0 else 0.0,
        frame_overhead=quantize(device.frame_overhead * pace),
        topk_frame_overhead=quantize(device.topk_frame_overhead * pace),
        topk_byte_cost=quantize(device.topk_byte_cost * pace),
    )
    rtts = [link.rtt for link in info.links]
    rtt = quantize(max(sorted(rtts)[len(rtts) // 2], 1e-4), 2) if rtts else 0.05
    return Peer(
        peer_id=info.peer_id,
        device=profile,
        uplink=quantize(info.uplink),
        downlink=quantize(info.downlink),
        rtt=rtt,
    )


def choose_probe_targets(
    me: str,
    candidates: Iterable[str],
    last_measured: dict[str, float],
    *,
    count: int,
    priority: Iterable[str] = (),
    rng: random.Random,
) -> list[str]:
    """Whom to probe this period: plan neighbours first, then the least recently measured
    (never-measured first, random among equals), at most ``count``."""
    others = sorted(set(candidates) - {me})
    first = [p for p in sorted(set(priority)) if p in others]
    rest = [p for p in others if p not in first]
    rng.shuffle(rest)
    rest.sort(key=lambda p: last_measured.get(p, -math.inf))
    first.sort(key=lambda p: last_measured.get(p, -math.inf))
    return (first + rest)[:count]


def describe(view: LinkView) -> dict[str, Any]:
    return {
        "src": view.src,
        "dst": view.dst,
        "mb_per_s": round(view.bandwidth / 1e6, 3),
        "rtt_ms": round(view.rtt * 1e3, 3),
        "measured": view.measured,
        "age_s": None if view.age is None else round(view.age, 1),
    }
