"""The node daemon: join a swarm, keep its record alive, measure links, agree on plans.

One ``NodeDaemon`` per node, four activities:

- epochs (main loop): the plan epochs, run by ``epochs.PlanAgreement`` with agreement.py's
  rules: propose at an epoch's start, adopt the best valid proposal ``settle_fraction`` into
  it, follow the majority where views split.
- heartbeat (thread, heartbeat.py): refresh our NodeInfo on the DHT every ``heartbeat_s`` (it
  expires ``ttl_s`` after the last refresh).
- probes (thread): every ``probe_interval_s``, connect to peers we know from the DHT and
  measure throughput/RTT to a bounded sample of them, then gossip what we measured.
- gossip (thread): take peers' bandwidth reports into our BandwidthBook.
- the DHT worker (process) and the control host (thread) underneath.

Events (``ready``, ``epoch``, ``left``) go to an ``on_event`` callback; the CLI prints them as
JSON lines with ``--events`` (tests and benchmarks read those), and logs a summary otherwise.
"""

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dag.graph import GraphCosts
from fusionllm.dht.client import DhtClient, DhtConfig, DhtError, start_client
from fusionllm.dht.directory import SwarmDirectory
from fusionllm.dht.records import MAX_LINKS, NodeInfo, NodeState, RecordError, TrainingProgress
from fusionllm.node.control.agreement import Candidate
from fusionllm.node.control.bandwidth import BandwidthBook, BandwidthReport
from fusionllm.node.control.epochs import PlanAgreement
from fusionllm.node.control.heartbeat import Heartbeat
from fusionllm.node.control.links import LinkMonitor, gossip_validator
from fusionllm.node.control.local_facts import RehearsalAsk, learn_local_facts
from fusionllm.node.control.node_config import NodeConfig, software_version
from fusionllm.node.control.pace import Timing
from fusionllm.node.control.pacing import StepPacing
from fusionllm.node.control.port_mapper import PortMapper
from fusionllm.node.control.probe_slots import slot_seconds
from fusionllm.node.control.quiet import MAX_BEAT
from fusionllm.node.control.reach_check import ReachCheck, ReachConfig
from fusionllm.node.control.relay_use import RelayUse, dht_client_mode
from fusionllm.node.control.suspicion import SuspicionBook
from fusionllm.node.control.timings import Timings
from fusionllm.node.p2p.announce import warn_if_unreachable
from fusionllm.node.p2p.control_host import ControlHost
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of
from fusionllm.node.p2p.lane.wire_meter import WireSample
from fusionllm.node.p2p.peer_host import PeerHost
from fusionllm.node.p2p.port_map import PortMapConfig

logger = get_logger(__name__)

_DEFAULT_LINK_BYTES_PER_S = 12.5e6  # 100 Mbit/s until we have measured anything


class NodeDaemon:
    def __init__(self, config: NodeConfig, *, on_event: Callable[[dict], None] | None = None):
        self.config = config
        self.settings = config.settings
        self._on_event = on_event or (lambda event: None)
        self.peer_id = ""  # ours once start() has read the key
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.control: ControlHost | None = None
        self.dht: DhtClient | None = None
        self.directory: SwarmDirectory | None = None
        self.book = BandwidthBook(max_age_s=max(6 * config.probe_interval_s, 60.0))
        # Our lanes' kernel-timed link figures; the tensor plane sets it once it runs.
        self.wire_samples: Callable[[], dict[str, WireSample]] = dict
        # A bulk probe on a lane to a peer, opened for it if need be (lane/prober.py): (peer,
        # bytes) -> its figure, or None where no lane can (the stream probe measures then).
        self.lane_probe: Callable[[str, int], WireSample | None] = lambda peer, nbytes: None
        self.lane_port: Callable[[], int] = lambda: 0  # mapped on the router beside the host's
        self.agreement: PlanAgreement | None = None  # the plan epochs, from start()
        self._state = NodeState.JOINING
        self.progress: TrainingProgress | None = None  # what our trainer last reported
        self.links: LinkMonitor | None = None
        self.reach: ReachCheck | None = None  # may peers dial us? (reach_check.py)
        self.host: PeerHost | None = None  # the node's one py-libp2p host, from start()
        self.suspicions = SuspicionBook()  # members our trainer waited for in vain
        self.heartbeat = Heartbeat(
            period_s=self.settings.heartbeat_s,
            ttl_s=self.settings.ttl_s,
            stop=self._stop,
            record=self._info,
            announce=lambda info, ttl_s: self.directory.announce(info, ttl_s=ttl_s),
            cadence=lambda: self.agreement.quiet.cadence.beat,
            timed=self._timed,
        )
        self.pacing = StepPacing()  # our pace and the others' we witnessed (pacing.py)
        self.timings = Timings()  # our DHT rounds' durations (the node's metrics read them)

    # What the agreement decided (read by the trainer, the status command and our record).

    @property
    def members(self) -> dict[str, NodeInfo]:
        return self.agreement.members if self.agreement is not None else {}

    @property
    def adopted(self) -> Candidate | None:
        return self.agreement.adopted if self.agreement is not None else None

    @property
    def adopted_epoch(self) -> int | None:
        return self.agreement.adopted_epoch if self.agreement is not None else None

    @property
    def run_finished(self) -> bool:
        return self.agreement is not None and self.agreement.run_finished

    @property
    def state(self) -> NodeState:
        return self.agreement.state if self.agreement is not None else self._state

    @state.setter
    def state(self, value: NodeState) -> None:
        self._state = value
        if self.agreement is not None:
            self.agreement.state = value

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "NodeDaemon":
        cfg, settings = self.config, self.settings
        key_pair = load_or_create_identity(cfg.key_path)
        self.peer_id = peer_id_of(key_pair)
        facts = learn_local_facts(
            settings.run.model_key,
            settings.run.seq_len,
            model_dir=settings.run.model_dir,
            device_cache=cfg.device_cache,
            measure_device=cfg.device is None,
            device=cfg.compute_device,
            precision=settings.run.precision,
            vocab_size=settings.run.vocab_size,
            rehearse=RehearsalAsk.for_node(
                cfg.observer, cfg.rehearse_s, cfg.compute_threads, settings.run
            ),
        )
        self.device = cfg.device or facts.device
        costs, node_ids = facts.costs, facts.costs.node_ids
        self.costs = costs
        rehearsed = self.pacing.rehearsed(
            facts.rehearsal, costs, self.device, settings.plan_config()
        )
        self.topic = f"fusionllm/{settings.swarm}/bandwidth"
        self._start_network()
        if self.dht.peer_id != self.peer_id:
            logger.warning("DHT peer id %s differs from ours %s", self.dht.peer_id, self.peer_id)
        self.directory = SwarmDirectory(
            self.dht,
            swarm=settings.swarm,
            peer_id=self.peer_id,
            sign=key_pair.private_key.sign,
            auth=self.config.swarm_key,
        )
        self.reach = self._reach_check()  # first: our record names the addresses it holds
        self.agreement = self._plan_agreement(costs, node_ids)
        self.links = self._link_monitor()
        self.heartbeat.beat()
        self._start_loops()
        self._emit(
            "ready",
            addrs=self.host.addrs,
            dht_addrs=self.dht.maddrs,
            device=self.device.to_wire(),
            rehearsed=rehearsed,
        )
        return self

    def _plan_agreement(self, costs: GraphCosts, node_ids: tuple[str, ...]) -> PlanAgreement:
        return PlanAgreement(
            settings=self.settings,
            costs=costs,
            node_ids=node_ids,
            peer_id=self.peer_id,
            directory=self.directory,
            book=self.book,
            own_info=self._info,
            emit=self._emit_epoch,
            tell_swarm=self._tell_swarm,
            # Probes reach every member within a few intervals (fanout 3, both ends probe).
            link_wait_s=3 * self.config.probe_interval_s,
            probe_slot_s=slot_seconds(self.config.probe_bytes),
        )

    def _start_loops(self) -> None:
        """The heartbeat, the link probes and the bandwidth gossip, each on a daemon thread."""
        loops = (
            ("heartbeat", self.heartbeat.loop),
            ("probes", self.links.probe_loop),
            ("gossip", self.links.gossip_loop),
            ("reachability", lambda: self.reach.loop(self._stop)),
        )
        for name, target in loops:
            thread = threading.Thread(
                target=_logged(name, target), name=f"node-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _start_network(self) -> None:
        """The node's one py-libp2p host with the control plane on it, and the DHT worker; a
        Transport can attach to the host later (``Transport(..., host=daemon.host)``)."""
        cfg, settings = self.config, self.settings
        warn_if_unreachable(logger, [a.host for a in cfg.announce] or [cfg.listen_host],
                            cfg.bootstrap)  # fmt: skip
        try:
            self.host = PeerHost(cfg.host_config()).start()
            self.control = ControlHost(
                cfg.control_config(),
                validate=gossip_validator(self.topic, settings.swarm, self._is_member),
                host=self.host,
            ).start()
            self.control.subscribe(self.topic)
            self.dht = start_client(
                DhtConfig(
                    swarm=settings.swarm,
                    initial_peers=cfg.bootstrap,
                    listen_host=cfg.listen_host,
                    listen_port=cfg.dht_port,
                    announce_maddrs=cfg.dht_announce_maddrs(),
                    nat_port_map=cfg.maps_ports,
                    record_tag_key=cfg.swarm_key.records.key_hex if cfg.swarm_key else "",
                    identity_path=cfg.key_path,
                    max_ttl_s=max(MAX_BEAT * settings.ttl_s, 8 * settings.epoch_s),
                    peer_timeout_s=min(3.0, max(0.5, settings.heartbeat_s)),
                    log_level=cfg.dht_log_level,
                )
            )
        except BaseException:
            self.close()
            raise

    def _link_monitor(self) -> LinkMonitor:
        cfg = self.config
        return LinkMonitor(
            control=self.control,
            book=self.book,
            peer_id=self.peer_id,
            swarm=self.settings.swarm,
            topic=self.topic,
            probe_interval_s=cfg.probe_interval_s,
            probe_fanout=cfg.probe_fanout,
            probe_bytes=cfg.probe_bytes,
            max_connections=cfg.max_connections,
            members=self._members_now,
            neighbours=self._plan_neighbours,
            stop=self._stop,
            wake=lambda alert: self.agreement.quiet.wake(alert=alert),
            suspect=lambda peer, since: self.agreement.quiet.suspect(peer, since),
            quiet=lambda: self.agreement.quiet.cadence.stride,
            wire=lambda: self.wire_samples(),
            lane_probe=lambda peer, nbytes: self.lane_probe(peer, nbytes),
            probe_slot_s=slot_seconds(cfg.probe_bytes),
        )

    def _reach_check(self) -> ReachCheck:
        """Dial-backs for members, and ours; none asked behind --announce-addr."""
        upnp = self.config.maps_ports
        check = ReachCheck(
            host=self.host,
            config=ReachConfig(),
            members=self._members_now,
            is_member=self._is_member,
            listen_ips=[self.config.listen_host],
            announced_addrs=self.host.addrs if self.config.announce else (),
            emit=self._emit_reach,
            relays=RelayUse.on(self.host, members=self._members_now, is_member=self._is_member),
            mapper=PortMapper(PortMapConfig()) if upnp else None,
            mapped_ports=lambda: [p for p in (self.lane_port(),) if p],
        )
        check.attach()
        return check

    def run(self, *, duration_s: float | None = None) -> None:
        """Heartbeats and epochs until ``stop()`` (or ``duration_s``)."""
        end = time.time() + duration_s if duration_s is not None else float("inf")
        self.agreement.run(self._stop, end=end, timed=self._timed, errors=(DhtError, RecordError))

    def _timed(self, what: str, step: Callable[..., None], *args: Any) -> None:
        started = time.monotonic()
        step(*args)
        took = time.monotonic() - started
        self.timings.add(what, took)
        if took > self.settings.heartbeat_s / 2:
            # A slow DHT delays the epoch (or our record's refresh): worth knowing.
            logger.info("%s took %.2fs", what, took)

    def stop(self) -> None:
        self._stop.set()
        self.heartbeat.wake()  # the heartbeat thread waits on it

    def leave(self) -> None:
        """Tell the swarm we go (so the next epoch re-plans without waiting for our TTL)."""
        if not self.peer_id:  # start() failed before it read our key: nobody knows us
            return
        self.state = NodeState.LEAVING
        # A finished run's last word stays a whole TTL: backups and late readers learn the end.
        finished = self.progress is not None and self.progress.finished
        ttl_s = self.settings.ttl_s if finished else self.settings.heartbeat_s
        with contextlib.suppress(FusionError):
            if self.directory is not None and self.control is not None:
                self.directory.announce(self._info(), ttl_s=ttl_s)
        self._tell_swarm()
        self._emit("left")

    def close(self) -> None:
        self.stop()
        if self.control is not None:
            self.control.close()  # first: it wakes the gossip thread, blocked in recv()
        for thread in self._threads:
            thread.join(timeout=10)
        if self.reach is not None:
            self.reach.close()  # our router's mappings go before we do
        # After the control plane detached; whatever else is attached to it ends with it.
        host = self.host
        if host is not None:
            host.close()
        if self.dht is not None:
            self.dht.close()

    # ------------------------------------------------------------------ records and plans

    def _info(self, beat: int = 1) -> NodeInfo:
        now = time.time()
        report = self.book.own_report(self.peer_id, self.settings.swarm, now=now)
        stage = None
        if self.adopted is not None:
            for s in self.adopted.plan.stages:
                if self.peer_id in s.peers:
                    stage = s.index
        return NodeInfo(
            peer_id=self.peer_id,
            swarm=self.settings.swarm,
            addrs=tuple(self._advertised()[:8]),
            dht_addrs=tuple(self.dht.maddrs[:8]),
            device=self.device,
            uplink=self._uplink(report),
            downlink=self._downlink(now),
            links=report.links[:MAX_LINKS],
            software=software_version()[:128],
            config_digest=self.settings.digest(),
            state=self.state,
            stage=stage if self.state is NodeState.SERVING else None,
            adopted=(self.adopted_epoch, self.adopted.digest) if self.adopted else None,
            time=now,
            training=self.progress,
            beat=beat,
            observer=self.config.observer,
            suspects=self.suspicions.current(),
            pace=self.pacing.meter.published,
            witnessed=self.pacing.witness.current(),
            stretch=self.pacing.stretch.published,
            reach=self.reach.published if self.reach is not None else "",
        )

    def _advertised(self) -> list[str]:
        listen = self.control.listen_addrs
        return self.reach.advertised(listen) if self.reach is not None else listen

    def _uplink(self, report: BandwidthReport) -> float:
        if self.config.uplink is not None:
            return self.config.uplink
        return max((link.bandwidth for link in report.links), default=_DEFAULT_LINK_BYTES_PER_S)

    def _downlink(self, now: float) -> float:
        if self.config.downlink is not None:
            return self.config.downlink
        measured = self.book.towards(self.peer_id, now, sources=self._members_now())
        return max(measured, default=_DEFAULT_LINK_BYTES_PER_S)

    def _tell_swarm(self) -> None:
        """Gossip that we woke from quiet for a change (or leave): quiet members look at once
        rather than at their next stride (quiet.py)."""
        if self.control is None:
            return
        report = self.book.own_report(self.peer_id, self.settings.swarm, now=time.time())
        with contextlib.suppress(FusionError, ValueError):
            self.control.publish(self.topic, dataclasses.replace(report, wake=True).to_bytes())

    def suspect(self, peer: str, reason: str) -> None:
        """Our trainer waited for ``peer`` in vain: keep it out of plans (suspicion.py) and say
        so at once, in our record, so that every node seats the same peers."""
        before = self.suspicions.current()
        self.suspicions.suspect(peer, reason)
        if self.suspicions.current() != before:
            self.heartbeat.wake()

    def cleared(self, peer: str) -> None:
        """``peer`` met our trainer at a barrier: a suspicion of it in force ends, and our
        record says so at once (seating.py reads every member's record alike)."""
        if self.suspicions.cleared(peer):
            self.heartbeat.wake()

    def measured(self, digest: str, compute_s: float, own_s: float) -> None:
        """One step's compute of our stage and our own work in it (the trainer's report); a new
        pace or stretch goes out at once."""
        config = self.settings.plan_config()
        if self.pacing.measured(
            self.adopted, digest, compute_s, own_s,
            costs=self.costs, peer_id=self.peer_id, device=self.device, config=config,
        ):  # fmt: skip
            self.heartbeat.wake()

    def witnessed(self, digest: str, ranks: list[tuple[str, int]], timings: list[Timing]) -> None:
        """One step's summaries of the plan we follow: every rank's (peer, stage) and timings;
        a pace newly witnessed goes out at once (pacing.py)."""
        if self.pacing.witnessed(
            self.adopted, digest, ranks, timings, members=self._members_now(),
            costs=self.costs, peer_id=self.peer_id, config=self.settings.plan_config(),
            measured=self._link_now,
        ):  # fmt: skip
            self.heartbeat.wake()

    def _link_now(self, src: str, dst: str) -> tuple[float, float, bool] | None:
        sample = self.book.newest(src, dst, now=time.time())
        return None if sample is None else (sample.bandwidth, sample.rtt, sample.relayed)

    def health(self) -> dict[str, int]:
        """What this node refused or lost so far: bad peers show up here, not as crashes."""
        stats = asdict(self.control.stats()) if self.control is not None else {}
        return {
            **(self.agreement.counters if self.agreement is not None else {}),
            "probes_failed": self.links.probes_failed if self.links else 0,
            "skipped_records": self.directory.skipped if self.directory else 0,
            **{f"gossip_{k}": v for k, v in stats.items()},
        }

    def _plan_neighbours(self) -> list[str]:
        adopted = self.adopted
        if adopted is None:
            return []
        stages = adopted.plan.stages
        for k, stage in enumerate(stages):
            if self.peer_id in stage.peers:
                near = [
                    p for j in (k - 1, k, k + 1) if 0 <= j < len(stages) for p in stages[j].peers
                ]
                return [p for p in near if p != self.peer_id]
        return []

    def _members_now(self) -> dict[str, NodeInfo]:
        return self.agreement.members_now() if self.agreement is not None else {}

    def _is_member(self, peer: str) -> bool:
        # Runs in the trio thread for every gossip message: a dict lookup under a lock.
        return self.agreement is not None and self.agreement.is_member(peer)

    def _emit_epoch(self, event: str, **fields: Any) -> None:
        self._emit(event, **fields, counters=self.health())

    def _emit_reach(self, event: str, **fields: Any) -> None:
        self._emit(event, **fields)
        client = dht_client_mode(str(fields.get("verdict")))
        if client is not None and self.dht is not None:
            # Nobody can dial us: as a DHT server we would only make every member's store and
            # get that picks us wait out a dial to our LAN address (docs/nat.md); dialable
            # again, we serve again.
            self.dht.set_client_mode(client)
        self.heartbeat.wake()  # a new verdict goes into our record now, not next heartbeat

    def _emit(self, event: str, **fields: Any) -> None:
        self._on_event({"event": event, "peer_id": self.peer_id, "t": time.time(), **fields})


def _logged(name: str, loop: Callable[[], None]) -> Callable[[], None]:
    """``loop``, telling the log if it ends on an unexpected exception (a thread would
    otherwise stop in silence and the node go on half-deaf)."""

    def run() -> None:
        try:
            loop()
        except Exception:
            logger.exception("the %s loop stopped on an unexpected error", name)
            raise

    return run
