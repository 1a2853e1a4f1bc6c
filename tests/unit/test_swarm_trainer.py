"""Real SwarmTrainers (one thread each) over the in-memory data plane, the plan set by the test.

What the daemons decide (the adopted plan) is a fake here; everything below it is real: the
assignment, the READY barrier, the 1F1B runner, plan votes in the step summaries, state moved
between members on a plan change.
"""

import functools
import time
from dataclasses import replace

import numpy as np
import pytest

import fusionllm.node.training.board as board_module
import fusionllm.node.training.parting as parting_module
import fusionllm.node.training.session as session_module
from fusionllm.common.run_spec import RunSpec
from fusionllm.dag.cost import DeviceProfile, LinkProfile
from fusionllm.dag.planner import Plan, PlanConfig, plan
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.train_config import TrainConfig
from fusionllm.node.swarm_training import build_workload, parameter_shapes
from fusionllm.node.training.assignment import plan_vote
from fusionllm.node.training.trainer import SwarmTrainer, TrainerConfig
from fusionllm.node.training.transfer import TransferWait
from tests.support.memory_transport import MemoryNetwork

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RUN = RunSpec(seq_len=16, micro_batch_size=2, micro_batches=4, steps=10, lr=3e-3)
TIMEOUT_S = 60.0


class FakeView:
    """The control plane as the trainer sees it; the test decides the adopted plan."""

    def __init__(self, members: list[str]) -> None:
        self.alive = set(members)
        self.reached = lambda: 0  # what the members' records would say
        self.current: tuple[str, Plan] | None = None
        self.published: list[tuple] = []
        self.finished = False
        self.suspected: list[tuple[str, str]] = []
        self.met: set[str] = set()
        self.computed: list[float] = []
        self.bytes_per_s = 1e9  # every link, as measured
        self.timings: list[tuple] = []  # (ranks, timings) of every step's summaries
        self.stepped_in: list[str] = []  # the plan digest of every measured step

    def adopted(self):
        return self.current

    def addrs(self, peer: str) -> list[str]:
        return []

    def is_member(self, peer: str) -> bool:
        return peer in self.alive

    def publish(self, replica, step, loss, finished, evaluation=None) -> None:
        self.published.append((replica, step, loss, finished))
        self.finished = self.finished or finished

    def run_finished(self) -> bool:
        return self.finished

    def members(self) -> list[str]:
        return sorted(self.alive)

    def progress(self) -> int:
        return self.reached()

    def measured(self, digest: str, compute_s: float, own_s: float) -> None:
        self.computed.append(compute_s)
        self.stepped_in.append(digest)

    def witnessed(self, digest: str, ranks, timings) -> None:
        self.timings.append((ranks, timings))

    def suspect(self, peer: str, reason: str) -> None:
        self.suspected.append((peer, reason))

    def cleared(self, peer: str) -> None:
        self.met.add(peer)

    def link_bytes_per_s(self, peer: str) -> float:
        return self.bytes_per_s

    def send_bytes_per_s(self, peer: str) -> float:
        return self.bytes_per_s


@functools.cache
def _costs():
    # Traced once, before any trainer runs: torch.fx patches torch.nn.Module globally while it
    # traces, so a trace in the test thread would break a trainer's forward pass mid-step.
    graph, _ = build_workload(RUN)
    return graph.costs()


def _plan(peers: list[str], stages: int, bandwidth: float = 1e9) -> Plan:
    """The planner's plan for equal peers on links of ``bandwidth`` bytes/s (fast: dense;
    slow: compressed, with error feedback on the gradients), exactly ``stages`` stages."""
    device = DeviceProfile(flops=1e11, memory_bandwidth=5e9, memory_bytes=4 << 30)
    swarm = Swarm.from_links(
        [Peer(peer_id=p, device=device, uplink=bandwidth, downlink=bandwidth) for p in peers],
        {
            (a, b): LinkProfile(bandwidth=bandwidth, rtt=1e-4)
            for a in peers
            for b in peers
            if a != b
        },
    )
    config = PlanConfig(
        micro_batches=RUN.micro_batches,
        batch_size=RUN.global_batch,
        min_stages=stages,
        max_stages=stages,
        max_replicas=1,
    )
    return plan(_costs(), swarm, config)


class Cluster:
    def __init__(
        self,
        peers: list[str],
        tmp_path,
        checkpoint_every: int = 0,
        run: RunSpec = RUN,
        barrier_grace_s: float = 30.0,
        step_timeout_s: float = TIMEOUT_S,
        stalls: dict[str, int] | None = None,  # peer -> steps of a plan before it stalls
    ) -> None:
        self.network = MemoryNetwork()
        self.views = {p: FakeView(peers) for p in peers}
        self.events: dict[str, list[dict]] = {p: [] for p in peers}
        self.trainers: dict[str, SwarmTrainer] = {}
        for peer in peers:
            holder: dict = {}
            transport = self.network.transport(peer, expect=lambda h, x=holder: x["t"].expect(h))
            trainer = SwarmTrainer(
                TrainerConfig(
                    run=run,
                    work_dir=tmp_path / peer,
                    step_timeout_s=step_timeout_s,
                    checkpoint_every=checkpoint_every,
                    barrier_grace_s=barrier_grace_s,
                    fault_stall_after=(stalls or {}).get(peer, 0),
                ),
                peer_id=peer,
                transport=transport,
                workload=lambda: build_workload(run),
                shapes=parameter_shapes(run),
                view=self.views[peer],
                on_event=self.events[peer].append,
            )
            holder["t"] = trainer
            self.trainers[peer] = trainer
        # torch.fx patches torch.nn.Module globally while it traces: a lazy build in one
        # trainer thread would break another's forward pass (one trainer per process in a real
        # node never meets this), so every trainer builds before any trains.
        for trainer in self.trainers.values():
            trainer.graph  # noqa: B018
        for view in self.views.values():  # each node publishes its step in its record
            view.reached = lambda: max(t.step for t in self.trainers.values())

    def adopt(self, plan_: Plan, peers=None) -> None:
        for peer in peers or self.views:
            self.views[peer].current = (plan_.digest(), plan_)

    def start(self, plan_: Plan) -> None:
        """Every node adopts ``plan_`` and starts training."""
        self.adopt(plan_)
        for trainer in self.trainers.values():
            trainer.start()

    def wait_finished(self, peers) -> None:
        self.wait(lambda: all(self.trainers[p].finished.is_set() for p in peers), "the end")

    def losses(self, peer: str) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in list(self.events[peer]) if e["event"] == "step"}

    def wait(self, predicate, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            crashed = [
                p for p, ev in self.events.items() if any(e["event"] == "train_error" for e in ev)
            ]
            assert not crashed, f"training crashed on {crashed} (see the log)"
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {self.events}")
            time.sleep(0.05)

    def kill(self, peer: str) -> None:
        """As SIGKILL would: its frames stop, it does nothing more, the others drop it."""
        self.network.kill(peer)
        self.trainers[peer]._stop.set()
        session = self.trainers[peer]._session
        if session is not None:  # a killed process waits for nothing
            session.runner.abort(PipelineError("killed"))
        for view in self.views.values():
            view.alive.discard(peer)

    def starts(self, peer: str) -> list[dict]:
        return [e for e in list(self.events[peer]) if e["event"] == "train_plan"]

    def close(self) -> None:
        for trainer in self.trainers.values():
            trainer.stop()
        for trainer in self.trainers.values():
            trainer.close()
        self.network.close()


@pytest.fixture
def cluster_of(tmp_path):
    made = []

    def make(peers, **kwargs):
        made.append(Cluster(peers, tmp_path, **kwargs))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


def _reference(plan_: Plan, run: RunSpec = RUN) -> list[float]:
    config = TrainConfig.for_run(
        run, cuts=tuple(s.start for s in plan_.stages[1:]), replicas=(1,) * len(plan_.stages)
    )
    return train_local(config).losses


def test_a_fixed_plan_trains_exactly_like_one_process(cluster_of, tmp_path):
    peers = ["peer-a", "peer-b", "peer-c"]
    fixed = _plan(peers, 3)
    cluster = cluster_of(peers)
    cluster.start(fixed)
    cluster.wait_finished(cluster.trainers)
    reference = _reference(fixed)
    for peer in peers:
        losses = cluster.losses(peer)
        assert sorted(losses) == list(range(RUN.steps))
        np.testing.assert_allclose([losses[s] for s in range(RUN.steps)], reference, atol=1e-5)
        assert (tmp_path / peer / "final-params.pt").exists()
    assert all(v.finished for v in cluster.views.values())
    # Every step, every node hears every rank's timings from the summaries, the same on all.
    stages = {p: k for k, s in enumerate(fixed.stages) for p in s.peers}
    for peer in peers:
        seen = cluster.views[peer].timings
        assert len(seen) == RUN.steps
        ranks, timings = seen[-1]
        assert ranks == sorted(stages.items(), key=lambda kv: kv[1])
        assert all(busy > 0 and min(waits) >= 0 for busy, *waits in timings), timings
    assert cluster.views[peers[0]].timings[-1] == cluster.views[peers[2]].timings[-1]
    # Each step is named by the plan it ran in (the daemon may have adopted another by then).
    assert all(set(v.stepped_in) == {v.current[0]} for v in cluster.views.values())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_nodes_train_in_the_runs_precision(cluster_of, precision):
    """RunSpec.precision reaches every node's stage: the run follows one process in that
    precision, not fp32's (fp16 with the pipeline's loss scale, and no step skipped)."""
    run = replace(RUN, precision=precision)
    peers = ["peer-a", "peer-b"]
    fixed = _plan(peers, 2)
    cluster = cluster_of(peers, run=run)
    cluster.start(fixed)
    cluster.wait_finished(cluster.trainers)
    reference, fp32 = _reference(fixed, run), _reference(fixed)
    for peer in peers:
        losses = cluster.losses(peer)
        losses = [losses[s] for s in range(run.steps)]
        gap = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        assert gap < 2e-3, (losses, reference)
        assert max(abs(a - b) for a, b in zip(losses, fp32, strict=True)) > gap
        steps = [e for e in cluster.events[peer] if e["event"] == "step"]
        expected_scale = 2.0**16 if precision == "fp16" else 1.0
        assert {(e["skipped"], e["loss_scale"]) for e in steps} == {(False, expected_scale)}


@pytest.mark.parametrize("wan", [False, True])
def test_a_plan_change_moves_state_and_the_loss_continues(cluster_of, wan):
    """``wan``: every link 100 ms round trip and 8 Mbit/s (the slowest the product must hold),
    as measured: the barrier, the moves at the switch and the steps still hold."""
    peers = ["peer-a", "peer-b", "peer-c"]
    two = _plan(peers[:2], 2)
    three = _plan(peers, 3)
    cluster = cluster_of(peers)
    if wan:
        for i, a in enumerate(peers):
            for b in peers[i + 1 :]:
                cluster.network.shape_link(a, b, delay_s=0.05, rate=1e6)
        for view in cluster.views.values():
            view.bytes_per_s = 1e6
    cluster.start(two)
    cluster.wait(lambda: len(cluster.losses("peer-a")) >= 4, "4 steps on the first plan")
    cluster.adopt(three)  # peer-c joins; every member votes for the new plan at a step's end
    cluster.wait_finished(cluster.trainers)
    losses = cluster.losses("peer-c")
    assert losses, "the joiner never trained"
    first = min(losses)
    assert first >= 4
    merged = {**cluster.losses("peer-a"), **losses}
    assert sorted(merged) == list(range(RUN.steps))
    # No jump at the switch: the run equals one process (parameters and AdamW state moved).
    np.testing.assert_allclose([merged[s] for s in range(RUN.steps)], _reference(two), atol=1e-5)
    starts = [e for e in cluster.events["peer-c"] if e["event"] == "train_plan"]
    assert starts[0]["start_step"] == first
    assert starts[0]["received"] > 0


def test_a_node_outside_the_plan_waits_and_sees_the_end(cluster_of):
    peers = ["peer-a", "peer-b", "peer-c"]
    two = _plan(peers[:2], 2)
    cluster = cluster_of(peers)
    cluster.start(two)
    cluster.wait(lambda: cluster.trainers["peer-a"].finished.is_set(), "the end")
    cluster.views["peer-c"].finished = True  # as the daemon learns from the members' records
    cluster.wait(lambda: cluster.trainers["peer-c"].finished.is_set(), "the backup to stop")
    assert not cluster.losses("peer-c")
    assert cluster.views["peer-c"].published[0] == (None, 0, None, False)


def test_a_trainer_stopped_by_a_bug_says_so_and_is_marked_failed(cluster_of):
    """Its node leaves, then exits 1 on ``failed``: exiting 0 read as a finished run."""
    peers = ["peer-a", "peer-b"]
    cluster = cluster_of(peers, step_timeout_s=2.0)  # peer-b's wait for peer-a's frames ends

    def broken(digest, ranks, timings) -> None:
        raise IndexError("a bug in the daemon's bookkeeping")

    cluster.views["peer-a"].witnessed = broken
    cluster.start(_plan(peers, 2))
    trainer = cluster.trainers["peer-a"]
    deadline = time.monotonic() + 60
    while not trainer.finished.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert trainer.failed
    assert [e for e in cluster.events["peer-a"] if e["event"] == "train_error"]
    assert not cluster.trainers["peer-b"].failed


def test_a_node_whose_plan_never_meets_sees_the_end_of_the_run_it_missed(cluster_of):
    """Views differed: b and c adopted a plan of their own and trained it to the end, while a
    adopted one with c, which c never came to meet. Once the members' records say the run is
    over, a stops waiting at the READY barrier and ends, as a backup does."""
    peers = ["peer-a", "peer-b", "peer-c"]
    cluster = cluster_of(peers)
    cluster.adopt(_plan(["peer-b", "peer-c"], 2), ["peer-b", "peer-c"])
    cluster.adopt(_plan(["peer-a", "peer-c"], 2), ["peer-a"])
    for trainer in cluster.trainers.values():
        trainer.start()
    cluster.wait_finished(["peer-b", "peer-c"])
    assert not cluster.trainers["peer-a"].finished.is_set()  # still waiting for c to meet
    cluster.views["peer-a"].finished = True  # as the daemon learns from b's and c's records
    cluster.wait(lambda: cluster.trainers["peer-a"].finished.is_set(), "a to see the end")
    assert not cluster.losses("peer-a")
    assert sorted(cluster.losses("peer-b")) == list(range(RUN.steps))


def test_a_member_that_never_comes_to_the_barrier_is_suspected_and_planned_around(cluster_of):
    """c is named by the plan and never trains (an observer that did not say so): a and b
    suspect it once their barrier wait ends, not before, and train on once the plan drops it."""
    peers = ["peer-a", "peer-b", "peer-c"]
    cluster = cluster_of(peers, barrier_grace_s=1.0)
    cluster.adopt(_plan(peers, 3))
    for peer in ("peer-a", "peer-b"):
        cluster.trainers[peer].start()
    began = time.monotonic()
    views = [cluster.views[p] for p in ("peer-a", "peer-b")]
    cluster.wait(lambda: all(v.suspected for v in views), "a and b to suspect c", timeout=60.0)
    assert time.monotonic() - began >= 1.0
    assert all(v.suspected == [("peer-c", "barrier")] for v in views)
    assert views[0].met == set()  # nobody met at a barrier that never completed
    cluster.adopt(_plan(peers[:2], 2), peers[:2])  # what the daemons then agree on
    cluster.wait_finished(peers[:2])
    assert views[0].met == {"peer-b"}
    assert sorted(cluster.losses("peer-a")) == list(range(RUN.steps))
    # once, though its barrier went on (a tiny grace may also catch a or b building slowly)
    assert all(v.suspected.count(("peer-c", "barrier")) == 1 for v in views)


def test_a_leave_at_a_barrier_whose_members_are_all_gone_does_not_wait_out_the_grace(
    cluster_of,
):
    """A stops as it reaches the barrier of a plan whose other member left the swarm (CI met
    it: the last of two nodes, SIGTERMed after its partner left, sat out the 30 s grace and was
    killed): nobody waits for its stage, so it leaves at once, well within the grace."""
    peers = ["peer-a", "peer-b"]
    cluster = cluster_of(peers)  # a barrier grace of 30 s
    leaver = cluster.trainers["peer-a"]
    cluster.views["peer-a"].alive.discard("peer-b")
    connect = leaver._connect

    def connect_then_sigterm(plan_of) -> None:
        connect(plan_of)
        leaver.stop()  # at the barrier, before anyone met

    leaver._connect = connect_then_sigterm
    cluster.adopt(_plan(peers, 2))
    began = time.monotonic()
    leaver.start()
    assert leaver.wait_gone(20.0)
    assert time.monotonic() - began < 15.0
    ends = [e["outcome"] for e in cluster.events["peer-a"] if e["event"] == "plan_end"]
    assert ends, "no plan_end"
    assert set(ends) == {"abandoned"}, ends  # nobody met: no step, no hand-over


def test_a_member_that_stalls_mid_run_is_blamed_not_the_neighbour_waiting_on_it(cluster_of):
    """The last stage stops after 5 steps, its heartbeat up (it stays a member): the middle
    stage times out waiting for its gradient, the first for the middle's; both suspect the
    last (the end of the wait chain), nobody the middle, well within the step timeout's cap."""
    peers = ["peer-a", "peer-b", "peer-c"]
    three = _plan(peers, 3)
    first, middle, last = (s.peers[0] for s in three.stages)
    cluster = cluster_of(peers, step_timeout_s=6.0, stalls={last: 5})
    cluster.start(three)
    views = [cluster.views[first], cluster.views[middle]]
    cluster.wait(lambda: all(v.suspected for v in views), "the stall to be blamed", 60.0)
    stalled = next(e for e in cluster.events[last] if e["event"] == "fault_stall")
    assert stalled["step"] == 5
    assert all(v.suspected == [(last, "stalled")] for v in views), [v.suspected for v in views]
    for peer in (first, middle):
        stall = next(e for e in cluster.events[peer] if e["event"] == "stall")
        assert stall["blamed"] == last, stall
        assert stall["step"] == 5, stall
        # the last stage never sent those frames: none was thrown away here
        assert (stall["refused"], stall["early_dropped"], stall["unrouted"]) == (0, 0, 0), stall
        assert stall["t"] - stalled["t"] < 6.0 + 5.0  # one frame's wait, then the notes
    waited = {e["waited_on"] for p in (first, middle) for e in cluster.events[p]
              if e["event"] == "stall"}  # fmt: skip
    assert middle in waited  # the first stage waited on the middle one, which is not blamed
    cluster.kill(last)
    cluster.adopt(_plan([first, middle], 2), [first, middle])  # what the daemons agree on next
    cluster.wait_finished([first, middle])
    assert sorted(cluster.losses(first)) == list(range(RUN.steps))


def test_a_killed_stage_is_taken_over_from_its_checkpoint_copy(cluster_of, tmp_path):
    peers = ["peer-a", "peer-b", "peer-c", "peer-d"]
    three = _plan(peers[:3], 3)
    cluster = cluster_of(peers, checkpoint_every=4)
    cluster.start(three)
    cluster.wait(lambda: len(cluster.losses("peer-a")) >= 6, "6 steps")
    cluster.kill("peer-c")
    cluster.adopt(_plan(["peer-a", "peer-b", "peer-d"], 3), peers=["peer-a", "peer-b", "peer-d"])
    survivors = ["peer-a", "peer-b", "peer-d"]
    cluster.wait_finished(survivors)
    taken_over = cluster.starts("peer-d")[0]
    # The last stage's only copy of step 4 (or 8) lived with stage 0's node: the backup took
    # the stage from it and every stage went back to that same step.
    assert taken_over["start_step"] in (4, 8)
    assert taken_over["received"] > 0
    restarts = [cluster.starts(p)[-1]["start_step"] for p in survivors]
    assert restarts == [taken_over["start_step"]] * 3
    # Rolled back exactly: the steps after the checkpoint are recomputed to the same losses.
    merged = {**cluster.losses("peer-a"), **cluster.losses("peer-d")}
    assert sorted(merged) == list(range(RUN.steps))
    np.testing.assert_allclose([merged[s] for s in range(RUN.steps)], _reference(three), atol=1e-5)
    kept = [e for e in cluster.events["peer-a"] if e["event"] == "kept"]
    assert kept, "stage 0's node never kept the last stage's checkpoint copy"
    # One step after each checkpoint its copy had left the node that took it.
    for peer in peers:
        events = list(cluster.events[peer])
        copied = {e["step"] for e in events if e["event"] == "checkpoint" and e["keeper"]}
        sent = [e for e in events if e["event"] == "copy_sent"]
        assert {e["step"] for e in sent} <= copied
        assert all(e["delivered"] for e in sent)
    assert any(e["event"] == "copy_sent" for e in cluster.events["peer-c"])


def _b_leaves_politely(cluster: Cluster, three: Plan) -> tuple[int, list[str]]:
    """a, b, c train ``three``; b leaves after 5 steps and a, c, d train on to the end: the
    step b left at, and the survivors."""
    cluster.start(three)
    cluster.wait(lambda: len(cluster.losses("peer-a")) >= 5, "5 steps")
    cluster.trainers["peer-b"].stop()
    assert cluster.trainers["peer-b"].wait_gone(60.0)
    left_at = max(cluster.losses("peer-b")) + 1
    for view in cluster.views.values():
        view.alive.discard("peer-b")
    survivors = ["peer-a", "peer-c", "peer-d"]
    cluster.adopt(_plan(survivors, 3), peers=survivors)
    cluster.wait_finished(survivors)
    return left_at, survivors


@pytest.mark.parametrize("filing_delay_s", [0.0, 0.02])
def test_a_polite_leave_hands_the_stage_over_without_rollback(
    cluster_of, monkeypatch, filing_delay_s
):
    # 0.02 s: each frame of the handed-over copy is filed late, after the leaver is gone and
    # out of every member list (as on a loaded machine); the keeper must still take it.
    if filing_delay_s:
        put = board_module.Board.put

        def late_put(board, item):
            if board_module.custody_index(item.header) is not None:
                time.sleep(filing_delay_s)
            return put(board, item)

        monkeypatch.setattr(board_module.Board, "put", late_put)
    peers = ["peer-a", "peer-b", "peer-c", "peer-d"]
    three = _plan(peers[:3], 3)
    cluster = cluster_of(peers, checkpoint_every=4)
    left_at, survivors = _b_leaves_politely(cluster, three)
    assert [cluster.starts(p)[-1]["start_step"] for p in survivors] == [left_at] * 3
    merged = {**cluster.losses("peer-a"), **cluster.losses("peer-d")}
    np.testing.assert_allclose([merged[s] for s in range(RUN.steps)], _reference(three), atol=1e-5)


def test_a_plan_that_begins_mid_run_checkpoints_after_its_first_step(cluster_of):
    """The stage a leaver hands over may sit on one node only, beside the only copy of its
    last checkpoint: a CI run lost 239 steps when that node crashed before the next interval.
    So every member of a plan begun mid-run checkpoints after its first step, and the copies
    leave at once; a plan begun at step 0 waits for the interval."""
    peers = ["peer-a", "peer-b", "peer-c", "peer-d"]
    cluster = cluster_of(peers, checkpoint_every=50)  # no interval's checkpoint in the run
    left_at, survivors = _b_leaves_politely(cluster, _plan(peers[:3], 3))
    for peer in survivors:
        events = list(cluster.events[peer])
        taken = [e for e in events if e["event"] == "checkpoint"]
        assert [e["step"] for e in taken] == [left_at + 1], (peer, taken)
        assert taken[0]["keeper"] in survivors
        sent = [e for e in events if e["event"] == "copy_sent"]
        assert [(e["step"], e["delivered"]) for e in sent] == [(left_at + 1, True)], peer
    kept = {e["step"] for p in survivors for e in cluster.events[p] if e["event"] == "kept"}
    assert left_at + 1 in kept


def test_a_hand_over_over_a_slow_link_waits_for_the_bytes_at_the_measured_rate(
    cluster_of, monkeypatch
):
    """The leaver's links carry 600 kB/s (its stage's state takes about a second), as
    measured; the fixed wait (here 0.125 s) would give the hand-over up and the next plan would
    roll back to the last checkpoint: the wait is the state's bytes at the measured rate.
    (150 kB/s and 0.5 s tested the same ratio of bytes' time to fixed wait in 4x the time.)"""
    monkeypatch.setattr(parting_module, "HAND_OVER", TransferWait(floor_s=0.125))
    peers = ["peer-a", "peer-b", "peer-c", "peer-d"]
    three = _plan(peers[:3], 3)
    cluster = cluster_of(peers, checkpoint_every=4)
    for other in ("peer-a", "peer-c", "peer-d"):
        cluster.network.shape_link("peer-b", other, rate=600e3)
    for view in cluster.views.values():
        view.bytes_per_s = 600e3
    left_at, survivors = _b_leaves_politely(cluster, three)
    assert left_at % 4, "left at a checkpoint: a rollback would not show"
    assert [cluster.starts(p)[-1]["start_step"] for p in survivors] == [left_at] * 3
    handover = [e for e in cluster.events["peer-b"] if e["event"] == "handover"]
    assert handover
    assert all(e["delivered"] for e in handover)


def _sigterm_after_the_switch_vote(leaver: SwarmTrainer, moved: Plan) -> None:
    """After the leaver's vote of a step went out (so it counts only from the next summary),
    in a step the members end with a switch to ``moved``: the stop lands as the leaver reads
    that step's unanimous votes. (Stopping as the leaver cast its switch vote raced: under
    load a member could cast that step's vote before it adopted ``moved``, the step then
    ended without a switch and the leaver parted from the old plan.)"""
    switch_vote, next_plan = plan_vote(moved.digest()), leaver._next_plan

    def switch_then_sigterm(vote: float):
        if vote == switch_vote:
            leaver.stop()  # the members switch at this step's end, then we leave
        return next_plan(vote)

    leaver._next_plan = switch_then_sigterm


def _sigterm_at_the_new_barrier(leaver: SwarmTrainer, moved: Plan) -> None:
    """After the switch's step ended, while the leaver waits at ``moved``'s barrier (the
    docker test met it: the leave used to end the barrier "abandoned", no hand-over)."""
    connect = leaver._connect

    def connect_then_sigterm(plan_of) -> None:
        connect(plan_of)
        if plan_of.digest == moved.digest():
            leaver.stop()  # at the new plan's barrier, before the members met

    leaver._connect = connect_then_sigterm


@pytest.mark.parametrize("sigterm", [_sigterm_after_the_switch_vote, _sigterm_at_the_new_barrier])
def test_a_leave_that_meets_a_switch_serves_the_new_plan_to_its_first_step(cluster_of, sigterm):
    """A leave that meets a switch to a plan the leaver is in: the members count on its stage
    there (the only copy: no checkpoints here, a lost stage could only start over). It serves
    that plan's first step, leaves by its vote and hands its stage over: the plan without it
    resumes where the leaver parted, no rollback."""
    peers = ["peer-a", "peer-b", "peer-c", "peer-d"]
    three, moved = _plan(peers[:3], 3), _plan(["peer-a", "peer-b", "peer-d"], 3)
    cluster = cluster_of(peers)
    leaver = cluster.trainers["peer-b"]
    sigterm(leaver, moved)
    cluster.start(three)
    cluster.wait(lambda: len(cluster.losses("peer-a")) >= 3, "3 steps")
    cluster.adopt(moved)
    assert leaver.wait_gone(60.0)
    ends = [e for e in cluster.events["peer-b"] if e["event"] == "plan_end"]
    assert [e["outcome"] for e in ends] == ["switch", "parted"], ends
    assert ends[-1]["digest"] == moved.digest()
    left_at = ends[-1]["next_step"]
    assert left_at == ends[0]["next_step"] + 1, "the leaver did not part at the first step"
    handed = [e for e in cluster.events["peer-b"] if e["event"] == "handover"]
    assert handed, "the leaver handed nothing over"
    assert all(e["delivered"] for e in handed), handed
    for view in cluster.views.values():
        view.alive.discard("peer-b")
    survivors = ["peer-a", "peer-c", "peer-d"]
    cluster.adopt(_plan(survivors, 3), peers=survivors)
    cluster.wait_finished(survivors)
    assert [cluster.starts(p)[-1]["start_step"] for p in survivors] == [left_at] * 3
    merged = {**cluster.losses("peer-a"), **cluster.losses("peer-d")}
    np.testing.assert_allclose([merged[s] for s in range(RUN.steps)], _reference(three), atol=1e-5)


def test_an_all_new_plan_fetches_the_state_from_nodes_outside_it(cluster_of):
    peers = ["peer-a", "peer-b", "peer-c", "peer-d"]
    first = _plan(peers[:2], 2)
    cluster = cluster_of(peers)
    cluster.start(first)
    cluster.wait(lambda: len(cluster.losses("peer-a")) >= 5, "5 steps")
    cluster.adopt(_plan(peers[2:], 2))  # nobody stays: a and b go to the backup pool
    cluster.wait_finished(peers[2:])
    start = cluster.starts("peer-c")[0]["start_step"]
    assert start >= 5, "the new members started over instead of fetching the swarm's state"
    donated = [e for p in peers[:2] for e in cluster.events[p] if e["event"] == "donated"]
    assert donated
    assert all(e["delivered"] for e in donated)
    # One answer per donor and plan, naming the plan and counting the copies it delivered.
    answered = [e for p in peers[:2] for e in cluster.events[p] if e["event"] == "answered"]
    assert 1 <= len(answered) <= 2, answered
    assert len({e["plan"] for e in answered}) == 1, answered  # the all-new plan's
    assert all(isinstance(e["plan"], str) and e["plan"] for e in answered), answered
    assert sum(e["sent"] for e in answered) == len(donated), (answered, donated)
    merged = {**cluster.losses("peer-a"), **cluster.losses("peer-c")}
    assert sorted(merged) == list(range(RUN.steps))
    np.testing.assert_allclose([merged[s] for s in range(RUN.steps)], _reference(first), atol=1e-5)


def test_nodes_outside_the_plan_answer_a_want_even_with_nothing_newer(cluster_of, monkeypatch):
    """After a crash the members hold an older checkpoint than the swarm reached and ask the
    backup pool; a backup holding nothing newer says so (DONE) instead of letting the members
    wait out the donor deadline (made far longer than the test's own wait here)."""
    monkeypatch.setattr(session_module, "DONORS", TransferWait(floor_s=600.0))
    peers = ["peer-a", "peer-b", "peer-c", "peer-d", "peer-e"]
    three = _plan(peers[:3], 3)
    cluster = cluster_of(peers, checkpoint_every=4)
    cluster.start(three)
    cluster.wait(lambda: len(cluster.losses("peer-a")) >= 6, "6 steps")
    cluster.kill("peer-c")
    survivors = ["peer-a", "peer-b", "peer-d", "peer-e"]
    cluster.adopt(_plan(["peer-a", "peer-b", "peer-d"], 3), peers=survivors)
    serving = ["peer-a", "peer-b", "peer-d"]
    cluster.wait_finished(serving)
    start = cluster.starts("peer-d")[0]["start_step"]
    assert start in (4, 8)
    assert start < max(cluster.losses("peer-a")), "the members held all the swarm reached"
    assert not [e for e in cluster.events["peer-e"] if e["event"] == "donated"]


def test_after_a_crash_an_all_new_plan_gets_the_newest_whole_step_from_a_survivor(cluster_of):
    """The survivor outside the new plan holds its live stage at the crash step (half the
    model) and the last checkpoint of both stages (its own, and the copy it kept for the dead
    node): it must give all of it, so the new members resume at that checkpoint, not step 0."""
    peers = ["peer-a", "peer-b", "peer-c", "peer-d"]
    first = _plan(peers[:2], 2)
    cluster = cluster_of(peers, checkpoint_every=4)
    cluster.start(first)
    cluster.wait(lambda: len(cluster.losses("peer-a")) >= 6, "6 steps")
    cluster.kill("peer-a")
    survivors = ["peer-b", "peer-c", "peer-d"]
    cluster.adopt(_plan(["peer-c", "peer-d"], 2), peers=survivors)
    cluster.wait_finished(peers[2:])
    start = cluster.starts("peer-c")[0]["start_step"]
    assert start >= 4, "the new members restarted below the checkpoint the survivor held"
    assert start % 4 == 0
    donated = {e["step"] for e in cluster.events["peer-b"] if e["event"] == "donated"}
    assert start in donated
    merged = {**cluster.losses("peer-b"), **cluster.losses("peer-c")}
    assert sorted(merged) == list(range(RUN.steps))
    np.testing.assert_allclose([merged[s] for s in range(RUN.steps)], _reference(first), atol=1e-5)


def test_a_member_that_adopts_late_still_hears_the_others_ready(cluster_of, monkeypatch):
    """Topology B's stall at step 0: b adopted the plan after a's READY reached it (refused:
    a was no member in b's view yet); b's READY then reached a, which had now heard everyone
    and stopped resending, so b waited at the barrier for a READY that never came, and a for
    b's frames. A member that hears a READY of a round it announced answers it."""
    monkeypatch.setattr(session_module, "_READY_RESEND_S", 120.0)  # a's resends cannot help
    peers = ["peer-a", "peer-b"]
    two = _plan(peers, 2)
    cluster = cluster_of(peers)
    cluster.network.shape_link("peer-a", "peer-b", delay_s=0.05)  # a WAN round trip
    cluster.views["peer-b"].alive = {"peer-b"}  # b has not seen a's record yet
    cluster.adopt(two, ["peer-a"])
    for trainer in cluster.trainers.values():
        trainer.start()
    board_b = cluster.trainers["peer-b"].board
    cluster.wait(lambda: board_b.refused >= 1, "b to refuse a's READY", timeout=30.0)
    cluster.views["peer-b"].alive = set(peers)
    cluster.adopt(two, ["peer-b"])
    cluster.wait(lambda: all(cluster.trainers[p].finished.is_set() for p in peers),
                 "both to train to the end", timeout=45.0)  # fmt: skip
    for peer in peers:
        assert sorted(cluster.losses(peer)) == list(range(RUN.steps))
