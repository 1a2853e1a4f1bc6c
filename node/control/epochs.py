"""One node's side of the plan epochs: snapshot, propose, adopt, converge (agreement.py's rules).

``PlanAgreement`` sees the world through three narrow things, so that tests can hand it fakes
and a fake clock: a ``Directory`` (the swarm's records and proposals on the DHT), the node's
``BandwidthBook`` and a callable giving the node's own current record. agreement.next_step is
the epoch loop's schedule as a pure function of the clock; seating.py says whom plans may seat.

    epoch e:  [start] propose(e) ...... [settle] adopt(e) ......  [start of e+1] converge, propose
"""

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.methods import InfeasiblePlanError
from fusionllm.dag.plan_check import Retimer
from fusionllm.dag.plan_wire import plan_to_json
from fusionllm.dag.swarm import Swarm
from fusionllm.dag.switch_cost import SwitchPolicy
from fusionllm.dht.records import (
    NodeInfo,
    NodeState,
    PlanProposal,
    RecordError,
)
from fusionllm.node.control.agreement import (
    Candidate,
    EpochView,
    backup_pool,
    check_proposal,
    choose,
    epoch_at,
    epoch_start,
    next_step,
    serving_peers,
)
from fusionllm.node.control.audit import AuditLimits
from fusionllm.node.control.backoff import BackoffConfig, ReplanBackoff
from fusionllm.node.control.bandwidth import BandwidthBook
from fusionllm.node.control.convergence import Outvoted, converge, most_followed, tally
from fusionllm.node.control.directory_view import Directory
from fusionllm.node.control.judging import judge
from fusionllm.node.control.link_wait import LinkWait
from fusionllm.node.control.member_snapshot import MemberSnapshot
from fusionllm.node.control.plan_memo import PlanMemo
from fusionllm.node.control.planners import planners
from fusionllm.node.control.probe_slots import cycle_seconds
from fusionllm.node.control.quiet import QuietNode
from fusionllm.node.control.seating import seatable
from fusionllm.node.control.stretch import swarm_slowdown
from fusionllm.node.control.swarm_settings import SwarmSettings
from fusionllm.node.control.switching import SwitchStreak, after_a_loss, judge_switch

logger = logging.getLogger(__name__)


class PlanAgreement:
    def __init__(
        self,
        *,
        settings: SwarmSettings,
        costs: GraphCosts,
        node_ids: tuple[str, ...],
        peer_id: str,
        directory: Directory,
        book: BandwidthBook,
        own_info: Callable[[], NodeInfo],
        emit: Callable[..., None] = lambda event, **fields: None,
        clock: Callable[[], float] = time.time,
        limits: AuditLimits | None = None,
        backoff: BackoffConfig | None = None,
        tell_swarm: Callable[[], None] = lambda: None,
        switch_policy: SwitchPolicy | None = None,
        link_wait_s: float = 0.0,
        probe_slot_s: float = 0.0,
    ) -> None:
        self.settings, self.costs, self.node_ids = settings, costs, node_ids
        self.plan_config = settings.plan_config()
        self.peer_id = peer_id
        self.directory, self.book = directory, book
        self._emit, self.clock = emit, clock
        self.limits = limits or AuditLimits()
        self.backoff = ReplanBackoff(backoff)  # when a stable swarm plans afresh
        self.switch_policy = switch_policy or SwitchPolicy()  # what moving state costs
        self.streak = SwitchStreak()  # a fresh plan that wins on figures alone wins twice
        # No plan over links nobody measured, for a while: longer where probes wait for slots.
        self.link_wait = LinkWait(
            link_wait_s, sweep_s=lambda members: 2 * cycle_seconds(members, probe_slot_s)
        )
        self._turn = 0  # epochs we proposed in (the replan gap counts these)
        # Which epochs we act in; other threads wake us and suspect members through it.
        self.quiet = QuietNode(settings.quiet_max_stride, own=peer_id, tell_swarm=tell_swarm)
        self.roster = MemberSnapshot(
            settings=settings, peer_id=peer_id, directory=directory, own_info=own_info,
            quiet=self.quiet, min_peers=self.plan_config.min_peers, clock=clock,
        )  # fmt: skip
        self.adopted: Candidate | None = None
        self.adopted_epoch: int | None = None
        self.state = NodeState.JOINING
        self.outvoted = Outvoted()
        self._plan = PlanMemo(costs, self.plan_config)  # the planner, memoized
        self._last_plan_failure = ""
        # Our last adopt found no plan we believe: plan ourselves, planner or not (planners.py).
        self._unanswered = False
        self._deferred: int | None = None  # the turn we first left a change to the planners
        # Our last propose held planning back for unmeasured links: we must not go quiet then.
        self.waiting_for_links = False
        self.counters = {
            "invalid_proposals": 0,
            "proposals_not_members": 0,  # of which: from keys that are not fresh members
            "proposals_overclaimed": 0,  # of which: figures below ours beyond the tolerance
            "plans_failed": 0,
            "converged": 0,
            "waited_for_links": 0,  # epochs we did not plan: candidates' links unmeasured
        }

    # ------------------------------------------------------------------ the loop

    def run(
        self,
        stop: threading.Event,
        *,
        end: float = float("inf"),
        timed: Callable[..., None] = lambda what, step, *args: step(*args),
        errors: tuple[type[BaseException], ...] = (RecordError,),
    ) -> None:
        """Epochs until ``stop`` is set or the clock passes ``end``."""
        now = self.clock()
        epoch = epoch_at(now, self.settings.epoch_s)
        # A newcomer follows the plan the swarm settled on last epoch until it can vote.
        self.adopt(epoch - 1)
        late = now - epoch_start(epoch, self.settings.epoch_s) > 0.25 * self.settings.epoch_s
        proposed, adopted_for = (epoch if late else epoch - 1), epoch - 1
        while not stop.is_set() and self.clock() < end:
            action, at, _ = self._next(proposed, adopted_for)
            try:
                if action == "adopt":
                    adopted_for = at
                    timed("adopt", self.adopt, at)
                elif action == "propose":
                    proposed = at
                    if self._quiet_in(at):
                        adopted_for = at
                    else:
                        timed("propose", self.propose, at)
            except errors as exc:
                logger.warning("control plane step failed (will retry): %s", exc)
            now = self.clock()
            _, _, wake = self._next(proposed, adopted_for)
            stop.wait(max(0.01, min(wake, end) - now))

    def _quiet_in(self, epoch: int) -> bool:
        """Whether a quiet node sits ``epoch`` out: it goes on following its plan, reading
        and storing nothing (quiet.py)."""
        if not self.quiet.sits_out(epoch):
            return False
        if self.adopted is not None:
            self.adopted_epoch = epoch
        return True

    def _next(self, proposed: int, adopted_for: int) -> tuple[str | None, int, float]:
        s = self.settings
        return next_step(
            self.clock(),
            proposed=proposed,
            adopted_for=adopted_for,
            epoch_s=s.epoch_s,
            settle_fraction=s.settle_fraction,
        )

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> dict[str, NodeInfo]:
        return self.roster.read()

    @property
    def members(self) -> dict[str, NodeInfo]:
        return self.roster.members

    @property
    def excluded(self) -> dict[str, list]:
        return self.roster.excluded

    @property
    def run_finished(self) -> bool:
        return self.roster.run_finished

    def members_now(self) -> dict[str, NodeInfo]:
        return self.roster.members_now()

    def is_member(self, peer: str) -> bool:
        return self.roster.is_member(peer)

    def _view(self, epoch: int, members: Mapping[str, NodeInfo], swarm: Swarm) -> EpochView:
        return EpochView(
            swarm=self.settings.swarm,
            epoch=epoch,
            members=members,
            node_ids=self.node_ids,
            config=self.plan_config,
            retimer=Retimer(
                self.costs, swarm, self.plan_config, unmeasured_trust=self.limits.unmeasured_trust
            ),
            limits=self.limits,
            seatable=self._seatable(members),
        )

    def _seatable(self, members: Mapping[str, NodeInfo]) -> frozenset[str]:
        return frozenset(seatable(members, now=self.clock(), min_peers=self.plan_config.min_peers))

    def _swarm(self, members: Mapping[str, NodeInfo]) -> Swarm:
        ordered = sorted(members.values(), key=lambda m: m.peer_id)
        return self.book.swarm(ordered, now=self.clock())

    # ------------------------------------------------------------------ propose

    def propose(self, epoch: int) -> None:
        members = self.snapshot()
        swarm = self._swarm(members)
        self._converge(epoch, members, swarm)
        incumbent = self._incumbent(epoch, members, swarm)
        # A newcomer is priced on default (slow) figures until its links are measured: that
        # moment, not only its arrival, is worth planning afresh for, or a faster newcomer
        # waits out the doubled gap (up to max_gap epochs) before it is seated.
        measured = self.book.linked(members, now=self.clock())
        seat = self._seatable(members)
        if self._waits_for_links(epoch, seat, len(members), incumbent):
            return
        ids = frozenset((peer, peer in measured, peer in seat) for peer in members)
        # The gap counts the epochs we act in: a quiet node re-checks as seldom as it acts.
        self._turn += 1
        why = self._replan_reason(epoch, ids, members, incumbent_ok=incumbent is not None)
        if why is None:
            self._repropose(epoch, incumbent, members)
            return
        logger.debug("epoch %d: planning afresh: %s", epoch, why)
        try:
            if not seat:  # observers (or suspects) only: an empty swarm is no plan, not a crash
                raise InfeasiblePlanError("no member may be seated: waiting for a node that trains")
            seated = self._swarm({p: members[p] for p in seat})
            fresh = self._plan(seated)
        except InfeasiblePlanError as exc:
            self.backoff.planned(self._turn, ids, None)
            self.counters["plans_failed"] += 1
            # Said once per reason: a node waiting for peers would repeat it every epoch.
            level = logging.DEBUG if str(exc) == self._last_plan_failure else logging.WARNING
            self._last_plan_failure = str(exc)
            logger.log(
                level, "epoch %d: no feasible plan for %d members: %s", epoch, len(members), exc
            )
            return
        if incumbent is None and self.adopted is not None:  # it broke: keep what we can of it
            fresh = self._survivors_plan(fresh, members, seated)
        plan_bytes, estimate = plan_to_json(fresh), fresh.estimated_step_time
        if incumbent is not None:
            retimer = Retimer(self.costs, swarm, self.plan_config)  # the fresh plan's snapshot
            judged = judge_switch(incumbent, fresh, retimer=retimer, costs=self.costs,
                                  switch_margin=self.settings.switch_margin,
                                  policy=self.switch_policy)  # fmt: skip
            logger.debug("epoch %d: fresh plan on %d peers: %s",
                         epoch, len(serving_peers(fresh)), judged)  # fmt: skip
            routine = self.backoff.only_the_gap(self._turn, ids, incumbent_ok=True)
            if not self.streak.settled(incumbent.digest, fresh, wins=not judged.keep,
                                       figures_only=routine):  # fmt: skip
                plan_bytes, estimate = incumbent.proposal.plan, incumbent.estimate
        # Stable means: planning again changed nothing we propose (a fresh plan within the
        # switch margin of the one we follow is as good as no plan at all).
        self.backoff.planned(self._turn, ids, hashlib.sha256(plan_bytes).hexdigest())
        self._publish(epoch, plan_bytes, estimate)

    def _waits_for_links(
        self, epoch: int, seat: frozenset[str], members: int, incumbent: Candidate | None
    ) -> bool:
        """Whether to hold planning back for links not yet measured (link_wait.py), re-proposing
        the plan we follow meanwhile. A plan that broke is replaced at once (a crash)."""
        pairs = self.book.measured_pairs(seat, now=self.clock())
        waiting = self.link_wait.waiting(seat, pairs, now=self.clock(), members=members)
        self.waiting_for_links = waiting and not (incumbent is None and self.adopted is not None)
        if self.waiting_for_links:
            self.counters["waited_for_links"] += 1
            if incumbent is not None:
                self._publish(epoch, incumbent.proposal.plan, incumbent.estimate)
        return self.waiting_for_links

    def _survivors_plan(self, fresh, members: Mapping[str, NodeInfo], seated: Swarm):
        """``after_a_loss`` among the members we may seat: a suspect or an observer that still
        holds its stage is no survivor (kept, it made a plan our own audit refused)."""
        return after_a_loss(self.adopted.plan, fresh, lambda peers: self._plan(self._swarm(
            {p: members[p] for p in peers})), swarm=seated, costs=self.costs,
            config=self.plan_config, switch_margin=self.settings.switch_margin,
            policy=self.switch_policy)  # fmt: skip

    def _replan_reason(
        self,
        epoch: int,
        ids: frozenset[Hashable],
        members: Mapping[str, NodeInfo],
        *,
        incumbent_ok: bool,
    ) -> str | None:
        """Why to plan afresh in ``epoch`` (backoff.py); None: re-propose the plan we follow,
        if any. Planning falls to the epoch's few planners (planners.py). A change (more than
        a routine re-check) we plan for ourselves when our last epoch brought us no plan we
        believe, or once it has waited ``max_gap`` turns: planners that re-propose an old
        plan and never plan (members lying about their CPU) hold a change back that long."""
        turn = self._turn
        why = self.backoff.due(turn, ids, incumbent_ok=incumbent_ok)
        if why is None or self._planner(epoch, members):
            self._deferred = None
            return why
        if self.backoff.only_the_gap(turn, ids, incumbent_ok=incumbent_ok):
            return None
        self._deferred = turn if self._deferred is None else self._deferred
        if self._unanswered or turn - self._deferred >= self.backoff.config.max_gap:
            self._deferred = None
            return why
        logger.debug("epoch %d: %s; planning is left to the epoch's planners", epoch, why)
        return None

    def _repropose(
        self, epoch: int, incumbent: Candidate | None, members: Mapping[str, NodeInfo]
    ) -> None:
        """A stable swarm, or planning left to the epoch's planners: the plan we follow,
        again, without planning (backoff.py). In a quiet swarm only the planners store it:
        adopt needs one copy."""
        if incumbent is not None and (
            self.quiet.cadence.stride == 1 or self._planner(epoch, members)
        ):
            self._publish(epoch, incumbent.proposal.plan, incumbent.estimate)

    def _planner(self, epoch: int, members: Mapping[str, NodeInfo]) -> bool:
        return self.peer_id in planners(epoch, members, self.backoff.config.planners)

    def _publish(self, epoch: int, plan_bytes: bytes, estimate: float) -> None:
        proposal = PlanProposal(
            swarm=self.settings.swarm,
            epoch=epoch,
            proposer=self.peer_id,
            estimate=estimate,
            plan=plan_bytes,
        )
        self.directory.propose(
            proposal, ttl_s=self.quiet.cadence.proposal_ttl_s(self.settings.epoch_s)
        )

    def _incumbent(
        self, epoch: int, members: Mapping[str, NodeInfo], swarm: Swarm
    ) -> Candidate | None:
        """The plan we follow, if it still runs here and its own figures hold (audit.py)."""
        adopted = self.adopted
        if adopted is None:
            return None
        again = PlanProposal(
            swarm=self.settings.swarm,
            epoch=epoch,
            proposer=self.peer_id,
            estimate=adopted.estimate,
            plan=adopted.proposal.plan,
        )
        try:
            candidate = check_proposal(again, self._view(epoch, members, swarm))
        except RecordError as exc:
            logger.info("epoch %d: the current plan is no longer valid: %s", epoch, exc)
            return None
        if not candidate.consistent(self.limits):
            logger.info("epoch %d: the current plan's figures do not hold: %s",
                        epoch, candidate.audit.own)  # fmt: skip
            return None
        return candidate

    # ------------------------------------------------------------------ adopt

    def adopt(self, epoch: int) -> None:
        if epoch < 0:
            return
        members, reused = self.roster.recent(epoch)
        proposals = self.directory.proposals(epoch)
        believed, refused = self._believed(epoch, members, proposals)
        # A proposal refused for its peers may name a member we have not seen yet (or one that
        # went since): read again. Overclaimed figures stay overclaimed on newer records.
        if reused and any(why != "overclaimed" for why in refused):
            members = self.snapshot()
            believed, refused = self._believed(epoch, members, proposals)
        self._count_refused(refused)
        self.outvoted.prune(epoch)
        # A plan the majority out-voted here stays out a while, unless nothing else is left.
        fresh = [c for c in believed if not self.outvoted.holds(c.digest, epoch)]
        best = choose(fresh) or choose(believed)
        self._unanswered = best is None
        if best is not None:
            self._follow(best, epoch, members, proposals=len(proposals), valid=len(believed))
        followed = self.adopted.digest if self.adopted is not None else None
        self.quiet.observe(members, followed, busy=self.waiting_for_links)

    def _believed(
        self, epoch: int, members: Mapping[str, NodeInfo], proposals: list[PlanProposal]
    ) -> tuple[list[Candidate], list[str]]:
        """adopt's judgement of ``proposals`` on ``members``: (believed, refusal reasons)."""
        view = self._view(epoch, members, self._swarm(members))
        followed = self._followed(epoch, members)
        believed, _, refused = judge(view, proposals, followed=followed, limits=self.limits)
        return believed, refused

    def _followed(self, epoch: int, members: Mapping[str, NodeInfo]) -> set[str]:
        """The plans the swarm follows now: ours, and the one a majority of fresh members
        report for the last epochs (a newcomer's, too, before it has adopted anything)."""
        followed = {self.adopted.digest} if self.adopted is not None else set()
        most = most_followed(list(members.values()), since_epoch=epoch - 2)
        return followed | ({most} if most else set())

    def _count_refused(self, refused: list[str]) -> None:
        self.counters["invalid_proposals"] += len(refused)
        for why in filter(None, refused):
            self.counters[f"proposals_{why}"] += 1

    def _converge(self, epoch: int, members: Mapping[str, NodeInfo], swarm: Swarm) -> None:
        """Follow the plan most fresh members adopted for our last epoch, if not ours."""
        adopted, last = self.adopted, self.adopted_epoch
        if adopted is None or last is None:
            return
        votes = tally(members.values(), last)
        if converge(adopted.digest, votes, acceptable=votes.keys()) is None:
            return  # no plan has more followers than ours
        # Judged again, now: we may never have seen the majority's proposal (a replica that
        # missed it), or a member in it may have gone since.
        view = self._view(last, members, swarm)
        proposals = self.directory.proposals(last)
        _, acceptable, _ = judge(view, proposals, followed=set(), limits=self.limits)
        target = converge(adopted.digest, votes, acceptable.keys())
        if target is None:
            logger.info("epoch %d: most members follow plan %s, which we cannot accept",
                        last, max(votes, key=votes.__getitem__)[:12])  # fmt: skip
            return
        self.outvoted.add(adopted.digest, epoch)
        self.counters["converged"] += 1
        logger.info("epoch %d: most members follow plan %s, not ours %s: switching",
                    last, target[:12], adopted.digest[:12])  # fmt: skip
        self._follow(acceptable[target], last, members, converged=True)

    def _follow(
        self, best: Candidate, epoch: int, members: Mapping[str, NodeInfo], **fields: Any
    ) -> None:
        changed = self.adopted is None or best.digest != self.adopted.digest
        self.adopted, self.adopted_epoch = best, epoch
        serving = any(self.peer_id in s.peers for s in best.plan.stages)
        if self.state is not NodeState.LEAVING:
            self.state = NodeState.SERVING if serving else NodeState.BACKUP
        backup = backup_pool(best.plan, members)
        if changed:
            logger.info(
                "epoch %d: adopted plan %s (%d stages, est %.4gs), backup %d",
                epoch, best.digest[:12], len(best.plan.stages), best.estimate, len(backup),
            )  # fmt: skip
        self._emit(
            "epoch",
            epoch=epoch,
            digest=best.digest,
            changed=changed,
            estimate=best.estimate,  # as proposed; retimed: in our view of the swarm now
            retimed=best.retimed_estimate,
            stages=[list(s.peers) for s in best.plan.stages],
            ranges=[[s.start, s.stop] for s in best.plan.stages],  # with stages: its layout
            backup=backup,
            members=sorted(members),
            excluded=sorted(self.excluded),
            paced={p: i.pace for p, i in members.items() if i.pace != 1.0},
            stretch=max((i.stretch for i in members.values()), default=1.0),  # the swarm's
            slowdown=swarm_slowdown(members),  # what every member is planned at, at least
            state=str(self.state),
            stride=self.quiet.cadence.stride,
            **fields,
        )
