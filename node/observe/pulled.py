"""What a node's metrics read at scrape time: counters kept by the node's parts.

Refusals are counted where they happen (the transport's streams and frames, the trainer's
board, the DHT directory's records, gossip and proposals in the daemon's health); the DHT
rounds are timed by the daemon (control/timings.py). ``Sources`` holds the callables that read
them; until the node's parts run (and for a node without a trainer) the missing ones read
nothing. A source that raises is logged and skipped: a scrape never takes the node down.
"""

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from fusionllm.common.logs import get_logger
from fusionllm.node.control.timings import Timing

logger = get_logger(__name__)

_GOSSIP_DROPS = "gossip_dropped_"
_PROPOSALS = "proposals_"


@dataclass(frozen=True, kw_only=True)
class Sources:
    health: Callable[[], dict[str, int]] | None = None  # NodeDaemon.health
    transport_refusals: Callable[[], dict[str, int]] | None = None  # Transport.refusals
    frames_refused: Callable[[], int] | None = None  # the trainer's board: outside the plan
    timings: Callable[[], dict[str, Timing]] | None = None  # NodeDaemon.timings.snapshot
    members: Callable[[], int] | None = None  # members the daemon sees now
    connected: Callable[[], int] | None = None  # peers the transport has counters for


class PulledCollector(Collector):
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.sources = Sources()
        self._clock = clock
        self._lock = threading.Lock()
        self._checkpoint: tuple[int, float] | None = None  # (step, when)

    def checkpointed(self, *, step: int) -> None:
        with self._lock:
            self._checkpoint = (step, self._clock())

    def describe(self) -> list:
        return []  # the families depend on what the node counted: collect() only

    def collect(self) -> Iterator:
        sources = self.sources
        yield _refused(
            _read(sources.health, {}),
            _read(sources.transport_refusals, {}),
            _read(sources.frames_refused, 0),
        )
        yield _events(_read(sources.health, {}))
        yield _dht(_read(sources.timings, {}))
        peers = GaugeMetricFamily("fusionllm_peers", "peers seen", labels=["seen_by"])
        peers.add_metric(["dht_members"], _read(sources.members, 0))
        peers.add_metric(["transport"], _read(sources.connected, 0))
        yield peers
        with self._lock:
            checkpoint = self._checkpoint
        if checkpoint is not None:
            step, when = checkpoint
            yield GaugeMetricFamily(
                "fusionllm_checkpoint_age_seconds",
                "seconds since this node last checkpointed its stage",
                value=max(0.0, self._clock() - when),
            )
            yield GaugeMetricFamily(
                "fusionllm_checkpoint_step", "the step of the last checkpoint", value=step
            )


def _read(source, default):
    if source is None:
        return default
    try:
        return source()
    except Exception:  # a part that closed under us: skip it this scrape
        logger.debug("metrics: a source failed", exc_info=True)
        return default


def _refused(health: dict[str, int], transport: dict[str, int], board: int):
    family = CounterMetricFamily(
        "fusionllm_refused",
        "what this node refused from peers, by what and why",
        labels=["what", "reason"],
    )
    for reason, count in sorted(transport.items()):
        what = "frame" if reason.startswith("body") else "stream"
        family.add_metric([what, reason], count)
    family.add_metric(["frame", "outside_plan"], board)
    family.add_metric(["record", "malformed"], health.get("skipped_records", 0))
    for key, count in sorted(health.items()):
        if key.startswith(_GOSSIP_DROPS):
            family.add_metric(["gossip", key.removeprefix(_GOSSIP_DROPS)], count)
        elif key.startswith(_PROPOSALS):
            family.add_metric(["proposal", key.removeprefix(_PROPOSALS)], count)
    return family


def _events(health: dict[str, int]):
    """The rest of the daemon's health counters (plans failed, converged, probes, gossip)."""
    family = CounterMetricFamily(
        "fusionllm_node_events", "the daemon's counters (NodeDaemon.health)", labels=["counter"]
    )
    for key, count in sorted(health.items()):
        if not key.startswith((_GOSSIP_DROPS, _PROPOSALS)) and key != "skipped_records":
            family.add_metric([key], count)
    return family


def _dht(timings: dict[str, Timing]):
    family = SummaryMetricFamily(
        "fusionllm_dht_round_seconds",
        "DHT rounds of the daemon: heartbeat (a record store), propose and adopt (reads)",
        labels=["round"],
    )
    for name, timing in sorted(timings.items()):
        family.add_metric([name], count_value=timing.count, sum_value=timing.total_s)
    return family
