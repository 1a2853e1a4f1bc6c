"""The node daemon: join a swarm, keep its record alive, measure links, agree on plans.

One ``NodeDaemon`` per node, four activities:

- epochs (main loop): the plan epochs (agreement.py): propose at an epoch's start, adopt the
  best valid proposal ``settle_fraction`` into it.
- heartbeat (thread): refresh our NodeInfo on the DHT every ``heartbeat_s`` (it expires
  ``ttl_s`` after the last refresh).
- probes (thread): every ``probe_interval_s``, connect to peers we know from the DHT and
  measure throughput/RTT to a bounded sample of them, then gossip what we measured.
- gossip (thread): take peers' bandwidth reports into our BandwidthBook.
- the DHT worker (process) and the control host (thread) underneath.

Events (``ready``, ``epoch``, ``left``) go to an ``on_event`` callback; the CLI prints them as
JSON lines with ``--events`` (tests and benchmarks read those), and logs a summary otherwise.
"""

import contextlib
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import STDLIB_VOCAB
from fusionllm.dag.models import gpt2
from fusionllm.dag.plan_wire import plan_to_json
from fusionllm.dag.planner import InfeasiblePlanError, Plan, plan
from fusionllm.dag.swarm import Swarm
from fusionllm.dag.trace import trace
from fusionllm.dht.client import DhtClient, DhtConfig, DhtError, start_client
from fusionllm.dht.directory import SwarmDirectory
from fusionllm.dht.records import (
    MAX_LINKS,
    NodeInfo,
    NodeState,
    PlanProposal,
    RecordError,
    TrainingProgress,
)
from fusionllm.node.control.agreement import (
    Candidate,
    backup_pool,
    check_plan,
    check_proposal,
    choose,
    epoch_at,
    epoch_start,
    keep_incumbent,
)
from fusionllm.node.control.bandwidth import (
    BandwidthBook,
    BandwidthReport,
)
from fusionllm.node.control.links import LinkMonitor, gossip_validator
from fusionllm.node.control.node_config import NodeConfig, local_device, software_version
from fusionllm.node.p2p.control_host import ControlHost
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of
from fusionllm.node.p2p.peer_host import PeerHost

logger = get_logger(__name__)

_DEFAULT_LINK_BYTES_PER_S = 12.5e6  # 100 Mbit/s until we have measured anything


class NodeDaemon:
    def __init__(self, config: NodeConfig, *, on_event: Callable[[dict], None] | None = None):
        self.config = config
        self.settings = config.settings
        self._on_event = on_event or (lambda event: None)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._threads: list[threading.Thread] = []
        self.control: ControlHost | None = None
        self.dht: DhtClient | None = None
        self.directory: SwarmDirectory | None = None
        self.book = BandwidthBook(max_age_s=max(6 * config.probe_interval_s, 60.0))
        self.members: dict[str, NodeInfo] = {}
        self.adopted: Candidate | None = None
        self.adopted_epoch: int | None = None
        self.state = NodeState.JOINING
        self._last_plan: tuple[bytes, Plan] | None = None
        self.progress: TrainingProgress | None = None  # what our trainer last reported
        self.run_finished = False  # some member's record says the run reached its end
        self._last_plan_failure = ""
        self.links: LinkMonitor | None = None
        self.host: PeerHost | None = None  # the node's one py-libp2p host, from start()
        self.counters = {"invalid_proposals": 0, "plans_failed": 0}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "NodeDaemon":
        cfg, settings = self.config, self.settings
        key_pair = load_or_create_identity(cfg.key_path)
        self.peer_id = peer_id_of(key_pair)
        self.device = cfg.device or local_device(cfg.device_cache)
        with torch.device("meta"):  # only shapes are needed: allocate nothing, even for xl
            model = gpt2(settings.run.model, vocab_size=STDLIB_VOCAB)
        graph = trace(model, (torch.zeros(1, settings.run.seq_len, dtype=torch.long),))
        self.costs = graph.costs()
        self.node_ids = tuple(graph.node_ids)
        self.plan_config = settings.plan_config()
        self.topic = f"fusionllm/{settings.swarm}/bandwidth"
        self._start_network()
        if self.dht.peer_id != self.peer_id:
            logger.warning("DHT peer id %s differs from ours %s", self.dht.peer_id, self.peer_id)
        self.directory = SwarmDirectory(
            self.dht, swarm=settings.swarm, peer_id=self.peer_id, sign=key_pair.private_key.sign
        )
        self.links = self._link_monitor()
        self._heartbeat()
        loops = (
            ("heartbeat", self._heartbeat_loop),
            ("probes", self.links.probe_loop),
            ("gossip", self.links.gossip_loop),
        )
        for name, target in loops:
            thread = threading.Thread(target=target, name=f"node-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._emit(
            "ready",
            addrs=self.host.addrs,
            dht_addrs=self.dht.maddrs,
            device=self.device.to_wire(),
        )
        return self

    def _start_network(self) -> None:
        """The node's one py-libp2p host with the control plane on it, and the DHT worker; a
        Transport can attach to the host later (``Transport(..., host=daemon.host)``)."""
        cfg, settings = self.config, self.settings
        try:
            self.host = PeerHost(cfg.host_config()).start()
            self.control = ControlHost(
                cfg.control_config(),
                validate=gossip_validator(self.topic, settings.swarm),
                host=self.host,
            ).start()
            self.control.subscribe(self.topic)
            self.dht = start_client(
                DhtConfig(
                    swarm=settings.swarm,
                    initial_peers=cfg.bootstrap,
                    listen_host=cfg.listen_host,
                    listen_port=cfg.dht_port,
                    identity_path=cfg.key_path,
                    max_ttl_s=max(4 * settings.ttl_s, 8 * settings.epoch_s),
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
        )

    def run(self, *, duration_s: float | None = None) -> None:
        """Heartbeats and epochs until ``stop()`` (or ``duration_s``)."""
        settings = self.settings
        end = time.time() + duration_s if duration_s is not None else float("inf")
        now = time.time()
        epoch = epoch_at(now, settings.epoch_s)
        # A newcomer follows the plan the swarm settled on last epoch until it can vote.
        self._adopt(epoch - 1)
        proposed = (
            epoch
            if now - epoch_start(epoch, settings.epoch_s) > 0.25 * settings.epoch_s
            else epoch - 1
        )
        adopted_for = epoch - 1

        def settle_of(e: int) -> float:
            return epoch_start(e, settings.epoch_s) + settings.settle_fraction * settings.epoch_s

        while not self._stop.is_set() and time.time() < end:
            now = time.time()
            epoch = epoch_at(now, settings.epoch_s)
            try:
                # Finish the epoch we proposed in before proposing in the next, even when a
                # slow step made us late: skipping its adoption would stall us a whole epoch.
                if adopted_for < proposed and now >= settle_of(proposed):
                    adopted_for = proposed
                    self._timed("adopt", self._adopt, proposed)
                elif proposed < epoch:
                    proposed = epoch
                    self._timed("propose", self._propose, epoch)
            except (DhtError, RecordError) as exc:
                logger.warning("control plane step failed (will retry): %s", exc)
            now = time.time()
            if adopted_for < proposed:
                wake = settle_of(proposed)
            elif proposed < epoch_at(now, settings.epoch_s):
                wake = now
            else:
                wake = epoch_start(proposed + 1, settings.epoch_s)
            self._stop.wait(max(0.01, min(wake, end) - now))

    def _timed(self, what: str, step: Callable[..., None], *args: Any) -> None:
        started = time.monotonic()
        step(*args)
        took = time.monotonic() - started
        if took > self.settings.heartbeat_s / 2:
            # A slow DHT delays the epoch (or our record's refresh): worth knowing.
            logger.info("%s took %.2fs", what, took)

    def stop(self) -> None:
        self._stop.set()

    def leave(self) -> None:
        """Tell the swarm we go (so the next epoch re-plans without waiting for our TTL)."""
        self.state = NodeState.LEAVING
        # A finished run's last word stays a whole TTL: backups and late readers learn the end.
        finished = self.progress is not None and self.progress.finished
        ttl_s = self.settings.ttl_s if finished else self.settings.heartbeat_s
        with contextlib.suppress(FusionError):
            if self.directory is not None and self.control is not None:
                self.directory.announce(self._info(), ttl_s=ttl_s)
        self._emit("left")

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        if self.control is not None:
            self.control.close()
        # After the control plane detached; whatever else is attached to it ends with it.
        host = self.host
        if host is not None:
            host.close()
        if self.dht is not None:
            self.dht.close()

    # ------------------------------------------------------------------ records and plans

    def _info(self) -> NodeInfo:
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
            addrs=tuple(self.control.listen_addrs[:8]),
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
        )

    def _uplink(self, report: BandwidthReport) -> float:
        if self.config.uplink is not None:
            return self.config.uplink
        return max((link.bandwidth for link in report.links), default=_DEFAULT_LINK_BYTES_PER_S)

    def _downlink(self, now: float) -> float:
        if self.config.downlink is not None:
            return self.config.downlink
        return max(self.book.towards(self.peer_id, now), default=_DEFAULT_LINK_BYTES_PER_S)

    def _heartbeat_loop(self) -> None:
        # Its own thread: a slow epoch (DHT gets waiting on a dead peer) must not let our
        # record expire, or every other node would drop us and re-plan.
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                self._timed("heartbeat", self._heartbeat)
            except (DhtError, RecordError) as exc:
                logger.warning("heartbeat failed (will retry): %s", exc)

    def _heartbeat(self) -> None:
        if not self.directory.announce(self._info(), ttl_s=self.settings.ttl_s):
            # hivemind reports the last replica's answer: one peer holding a newer (forged)
            # entry under our subkey says no even when the honest replicas stored ours.
            logger.info("a DHT replica did not store our record (or none is reachable)")

    def _snapshot(self) -> dict[str, NodeInfo]:
        """Live members that run our settings (and ourselves, even before our record shows)."""
        everyone = self.directory.members(include_leaving=True)
        found = {p: i for p, i in everyone.items() if i.state is not NodeState.LEAVING}
        digest = self.settings.digest()
        # A node that missed several heartbeats is treated as gone before its record expires:
        # a crash then re-plans after suspect_after_s, not after the whole TTL.
        fresh_since = time.time() - self.settings.suspect_after_s
        members = {
            pid: info
            for pid, info in found.items()
            if info.config_digest == digest and info.time >= fresh_since
        }
        if len(members) < len(found):
            logger.debug("%d records are stale or run other settings", len(found) - len(members))
        members[self.peer_id] = self._info()
        # Members that finished the run leave: their last records tell a backup it is over.
        if any(
            i.training and i.training.finished
            for i in everyone.values()
            if i.config_digest == digest
        ):
            self.run_finished = True
        with self._lock:
            self.members = members
        return members

    def _propose(self, epoch: int) -> None:
        members = self._snapshot()
        swarm = self.book.swarm(sorted(members.values(), key=lambda m: m.peer_id), now=time.time())
        try:
            fresh = self._plan(swarm)
        except InfeasiblePlanError as exc:
            self.counters["plans_failed"] += 1
            # Said once per reason: a node waiting for peers would repeat it every epoch.
            level = logging.DEBUG if str(exc) == self._last_plan_failure else logging.WARNING
            self._last_plan_failure = str(exc)
            logger.log(
                level, "epoch %d: no feasible plan for %d members: %s", epoch, len(members), exc
            )
            return
        plan_bytes, estimate = plan_to_json(fresh), fresh.estimated_step_time
        incumbent = self.adopted
        if incumbent is not None:
            try:
                check_plan(
                    incumbent.plan,
                    members=members,
                    node_ids=self.node_ids,
                    memory_fraction=self.plan_config.memory_fraction,
                )
                if keep_incumbent(incumbent.estimate, estimate, self.settings.switch_margin):
                    plan_bytes, estimate = incumbent.proposal.plan, incumbent.estimate
            except RecordError as exc:
                logger.info("epoch %d: the current plan is no longer valid: %s", epoch, exc)
        proposal = PlanProposal(
            swarm=self.settings.swarm,
            epoch=epoch,
            proposer=self.peer_id,
            estimate=estimate,
            plan=plan_bytes,
        )
        self.directory.propose(proposal, ttl_s=4 * self.settings.epoch_s)

    def _plan(self, swarm: Swarm) -> Plan:
        """The planner's plan for ``swarm``, memoized: snapshots are quantized, so most epochs
        see the same inputs, and planning is the costliest part of an epoch."""
        key = hashlib.sha256(
            repr([(p.peer_id, p.device, p.uplink, p.downlink, p.rtt) for p in swarm.peers]).encode()
            + b"".join(a.tobytes() for a in (swarm.src, swarm.dst, swarm.bandwidth, swarm.rtt))
        ).digest()
        if self._last_plan is not None and self._last_plan[0] == key:
            return self._last_plan[1]
        fresh = plan(self.costs, swarm, self.plan_config)
        self._last_plan = (key, fresh)
        return fresh

    def _adopt(self, epoch: int) -> None:
        if epoch < 0:
            return
        members = self._snapshot()
        candidates = []
        proposals = self.directory.proposals(epoch)
        for proposal in proposals:
            try:
                candidates.append(
                    check_proposal(
                        proposal,
                        swarm=self.settings.swarm,
                        epoch=epoch,
                        members=members,
                        node_ids=self.node_ids,
                        memory_fraction=self.plan_config.memory_fraction,
                    )
                )
            except RecordError as exc:
                self.counters["invalid_proposals"] += 1
                logger.info("epoch %d: refused a proposal: %s", epoch, exc)
        best = choose(candidates)
        if best is None:
            return
        changed = self.adopted is None or best.digest != self.adopted.digest
        self.adopted, self.adopted_epoch = best, epoch
        self.state = (
            NodeState.SERVING
            if any(self.peer_id in s.peers for s in best.plan.stages)
            else NodeState.BACKUP
        )
        if changed:
            logger.info(
                "epoch %d: adopted plan %s (%d stages, est %.4gs), backup %d",
                epoch, best.digest[:12], len(best.plan.stages), best.estimate,
                len(backup_pool(best.plan, members)),
            )  # fmt: skip
        self._emit(
            "epoch",
            epoch=epoch,
            digest=best.digest,
            changed=changed,
            estimate=best.estimate,
            stages=[list(s.peers) for s in best.plan.stages],
            backup=backup_pool(best.plan, members),
            members=sorted(members),
            proposals=len(proposals),
            valid=len(candidates),
            state=str(self.state),
            counters=self.health(),
        )

    def health(self) -> dict[str, int]:
        """What this node refused or lost so far: bad peers show up here, not as crashes."""
        stats = asdict(self.control.stats()) if self.control is not None else {}
        return {
            **self.counters,
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
        with self._lock:
            return dict(self.members)

    def _emit(self, event: str, **fields: Any) -> None:
        self._on_event({"event": event, "peer_id": self.peer_id, "t": time.time(), **fields})
