"""One member cannot stop a training swarm (issue 27), with real ``fusionllm node`` processes.

Two nodes train GPT-2 tiny (``--min-stages 2 --steps 0``), one pair for the whole module; then,
one case per test, each adding its own node to the pair:

- an observer (``--no-train``) advertising an RTX 4090 joins: its record says it observes, so
  no plan ever names it and the steps never pause;
- a member that claims to train and never comes to the READY barrier (the hidden
  ``--control-only`` flag: what ``--no-train`` did before observers said so) joins: the two
  trainers suspect it, re-plan without it and go on within 60 s at the default barrier grace,
  and keep it out for the backoff;
- a seated member stops sending frames mid-run while its heartbeat stays up (the hidden
  ``--fault-stall-after`` hook): the member that waited on it blames it, not anyone else,
  and the others go on within 60 s;
- two members seated in a plan that leaves both trainers out flood them with requests for
  state (WANT): at least one answer, at most one per trainer and plan;
- a member claims 4x the speed it computes at and under-reports its compute 64x (the hidden
  ``--fault-under-report`` hook; its own record then says it is as fast as it claims): its
  neighbours' waits in the step summaries show its real compute, their records witness its
  pace, and the swarm re-plans it with that figure;
- last (it may stop one of the pair): a third node waits in backup and a serving one is
  SIGSTOPped (its connections stay up, it sends nothing): the others go on within 60 s, losing
  at most one checkpoint interval.

Every test ends the node it started (SIGCONT first for a stopped one), the module ends the pair;
steps are read from the nodes' ``step`` events.
"""

import itertools
import signal
import time
from collections import Counter

import pytest
import torch

from fusionllm.common.run_spec import RunSpec
from fusionllm.compression import pack_tensor
from fusionllm.dag.plan_wire import plan_from_json
from fusionllm.dag.planner import Plan, PlanConfig
from fusionllm.dht.client import DhtClient, DhtConfig
from fusionllm.dht.envelope import open_envelope
from fusionllm.dht.keys import nodes_key, plans_key
from fusionllm.dht.records import DeviceInfo, NodeInfo
from fusionllm.node.control.agreement import epoch_at
from fusionllm.node.control.local_facts import learn_local_facts
from fusionllm.node.control.pace import predicted_compute_s
from fusionllm.node.local_swarm import (
    FAST,
    TEST_DEVICE,
    LocalSwarm,
    NodeProcess,
    first_step_after,
    rollbacks,
    serving,
    wait_for,
)
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import Transport, TransportConfig
from fusionllm.node.training.board import TAG_WANT

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

RUN = {
    "steps": 0,
    "seq-len": 64,
    "micro-batch-size": 2,
    "micro-batches": 4,
    "lr": 3e-3,
    "min-stages": 2,
    "max-stages": 2,
    "max-replicas": 1,
    "threads": 1,
    "dense": True,
    "step-timeout": 60,
    "quiet-stride": 1,
    "checkpoint-every": 10,
}
EVERY = 10
# What the newcomer claimed: far faster than the test CPU, so every plan wants it.
RTX_4090 = {
    **TEST_DEVICE,
    "name": "NVIDIA GeForce RTX 4090",
    "kind": "cuda",
    "flops": 8.2e13,
    "memory_bandwidth": 1.0e12,
    "memory_bytes": 24 << 30,
}
# The trainers advertise a device 100x slower than the test CPU: compute then dominates the
# plan's step time, and a fast newcomer is worth a re-plan (as it is on a real swarm).
SLOW_DEVICE = {**TEST_DEVICE, "flops": TEST_DEVICE["flops"] / 100}
RESUME_S = 60.0
ABORT_S = 10.0  # a member told of an abandoned step gives it up well inside patience's 15 s floor
RUN_EPOCH_S = FAST["epoch"]
# Epochs with an observer's links in every record before the test calls it never seated: a
# plan is proposed from one epoch's view and adopted in the next; three leave one to spare.
SEATING_EPOCHS = 3


def _step_times(nodes: list[NodeProcess]) -> list[float]:
    return sorted(e["t"] for n in nodes for e in n.snapshot() if e["event"] == "step")


def _assert_an_abandoned_step_is_given_up_at_once(leaver: NodeProcess, nodes) -> None:
    abandoned = wait_for(lambda: leaver.last("fault_abandon"), 180, "its abandoned step")
    plans = [e for e in leaver.snapshot() if e["event"] == "train_plan"]
    plan = [e for e in plans if e["t"] <= abandoned["t"]][-1]
    members = {p for stage in plan["stages"] for p in stage} - {leaver.peer_id}

    def ended(node: NodeProcess) -> list[dict]:
        return [e for e in node.snapshot() if e["event"] == "plan_end"
                and e["digest"] == plan["digest"] and e["t"] >= plan["t"]]  # fmt: skip

    for node in [n for n in nodes if n.peer_id in members]:
        end = wait_for(lambda n=node: ended(n), 60, "the plan's end")[0]
        took = end["t"] - abandoned["t"]
        # Where each began the plan: CI once saw a member give up at step 1272, after the
        # patience floor (15.4 s), for an abandon of step 1265 (unexplained, session 20).
        began = [(e["start_step"], round(e["t"] - plan["t"], 2)) for e in node.snapshot()
                 if e["event"] == "train_plan" and e["digest"] == plan["digest"]]  # fmt: skip
        print(f"step {abandoned['step']} abandoned: {node.peer_id[:12]} gave up in {took:.1f} s; "
              f"the leaver began the plan at {plan['start_step']}, it at {began}")  # fmt: skip
        assert end["outcome"] == "failed", end
        assert took < ABORT_S, (took, end, plan["start_step"], began)


def _planned(node: NodeProcess, peer: str, since: float) -> list[dict]:
    """``node``'s epoch events after ``since`` whose plan seats ``peer``."""
    return [
        e
        for e in node.snapshot()
        if e["event"] == "epoch" and e["t"] >= since and any(peer in s for s in e["stages"])
    ]


def _longest_pause(times: list[float], since: float, until: float) -> float:
    """The longest stretch in [since, until] without a finished step."""
    marks = [since, *(t for t in times if since < t < until), until]
    return max(b - a for a, b in itertools.pairwise(marks))


def _trainers(tmp_path) -> tuple[LocalSwarm, list[NodeProcess]]:
    swarm = LocalSwarm(tmp_path, extra=RUN, device=SLOW_DEVICE)
    first = swarm.start("a")
    wait_for(lambda: first.last("ready"), 60, "the first node")
    nodes = [first, swarm.start("b", bootstrap=first.dht_addr)]
    wait_for(lambda: len(_step_times(nodes)) >= 10, 240, "10 trained steps")
    return swarm, nodes


def _suspected_by(node: NodeProcess, peer: str, since: float = 0.0) -> list[dict]:
    return [e for e in node.snapshot() if e["event"] == "epoch" and e["t"] >= since
            and peer in e.get("excluded", [])]  # fmt: skip


def _paced(node: NodeProcess, peer: str) -> list[dict]:
    return [e for e in node.snapshot() if e["event"] == "epoch" and e.get("paced", {}).get(peer)]


def _plan_followed(node: NodeProcess, reader: DhtClient, timeout: float) -> tuple[dict, Plan]:
    """(epoch event, plan) of the plan ``node`` follows, read from the proposals on the DHT (a
    followed plan is proposed again every epoch)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reader.get(nodes_key("default"))  # the validator takes plans of known members only
        event = node.last("epoch")
        for epoch in range(epoch_at(time.time(), RUN_EPOCH_S), event["epoch"] - 2, -1):
            for _, value, _ in reader.get(plans_key("default", epoch)):
                proposal = open_envelope(value).record
                if proposal.digest == event["digest"]:
                    return event, plan_from_json(proposal.plan)
        time.sleep(0.5)
    raise AssertionError(f"no proposal of the plan {node.name} follows within {timeout} s")


def _records(reader: DhtClient) -> dict[str, NodeInfo]:
    """Every member's record, as the DHT serves it (a get always searches for the latest)."""
    return {i.peer_id: i for i in (open_envelope(v).record for _, v, _ in
                                  reader.get(nodes_key("default")))}  # fmt: skip


def _linked(reader: DhtClient, peer: str, members: list[NodeProcess]) -> bool:
    """Whether every one of ``members``' records reports a measured link to ``peer``."""
    records = _records(reader)
    found = all(
        any(link.peer == peer for link in getattr(records.get(m.peer_id), "links", ()))
        for m in members
    )
    if not found:
        time.sleep(1.0)
    return found


def _witnessed_records(reader: DhtClient, peer: str) -> dict[str, NodeInfo] | None:
    """Every member's record, once some record other than ``peer``'s witnesses ``peer``."""
    records = _records(reader)
    if peer in records and any(
        w.peer == peer for p, i in records.items() if p != peer for w in i.witnessed
    ):
        return records
    time.sleep(1.0)
    return None


# ----- every test shares two trainers (torn down at the end of the module): each adds a node
# and ends it, and the trainers go on as two after it; the one that stops a serving node is last.


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Two trainers that have trained 10 steps (a fresh pair per test cost ~30 s each)."""
    swarm = None
    try:
        swarm, nodes = _trainers(tmp_path_factory.mktemp("shared"))
        yield swarm, nodes
    finally:
        if swarm is not None:
            swarm.close()


@pytest.fixture(scope="module")
def reader(shared):
    """One DHT reader for the module's reads of records and proposals (a client per read
    started a DHT worker and its p2pd each time, seconds on a loaded host)."""
    config = DhtConfig(swarm="default", initial_peers=(shared[1][0].dht_addr,), client_mode=True)
    with DhtClient(config) as client:
        yield client


def test_a_member_slower_than_it_claims_is_planned_with_its_measured_speed(shared, reader):
    swarm, nodes = shared
    boaster = None
    try:
        # Four times the test CPU on every figure the planner reads: its steps take 4x the
        # claim (more on a loaded machine, as the honest nodes' do too: 2-4x their claims
        # here, so up to ~32x for it). It says it computed 64x less than it did: its own pace
        # stays 1, only its neighbours can tell.
        claim = {**TEST_DEVICE, "flops": 4 * TEST_DEVICE["flops"],
                 "memory_bandwidth": 4 * TEST_DEVICE["memory_bandwidth"],
                 "op_overhead": TEST_DEVICE["op_overhead"] / 4}  # fmt: skip
        boaster = swarm.start("boaster", bootstrap=nodes[0].dht_addr, device=claim,
                              extra={"fault-under-report": 64})  # fmt: skip
        everyone = [*nodes, boaster]
        wait_for(lambda: _planned(nodes[0], boaster.peer_id, 0.0), 120, "it seated")
        wait_for(lambda: all(_paced(n, boaster.peer_id) for n in nodes), 120, "its pace")
        # A witness's record says the pace from the heartbeat after it measured it, and may
        # drop it again once a plan gives the boaster a replica (replicas are witnessed from
        # their own word): read the records until one says it (CI once read none, 1 of 3).
        records = wait_for(lambda: _witnessed_records(reader, boaster.peer_id), 60,
                           "a record witnessing its pace")  # fmt: skip
        witnesses = {p: [w.pace for w in i.witnessed if w.peer == boaster.peer_id]
                     for p, i in records.items()}  # fmt: skip
        print(f"its own pace {records[boaster.peer_id].pace:g}; witnessed {witnesses}")
        assert records[boaster.peer_id].pace == 1.0  # its word: as fast as it claims
        assert any(p > 1.0 for ps in witnesses.values() for p in ps), witnesses
        # Witnesses' records reach the nodes a heartbeat apart: the same pace on every node
        # once they read the same records.
        agreed = lambda: (  # noqa: E731
            len({n.last("epoch").get("paced", {}).get(boaster.peer_id) for n in nodes}) == 1
            and [n.last("epoch") for n in nodes]
        )
        paced = wait_for(agreed, 30, "the same pace on every node")
        paces = paced[0]["paced"]
        pace = paces[boaster.peer_id]
        assert pace >= 2.0, paces
        assert all(pace >= p for p in paces.values()), paces  # the slowest against its claim

        # The plan the swarm then follows times the boaster's stage at its measured speed:
        # about pace x what its claimed device predicts for that stage, for one of the paces
        # the swarm held for it since (witnessed paces move by powers of two as its stage
        # changes size: 4-16x here for a member 4x slower than its claim on a loaded CPU).
        since = max(e["t"] for e in paced)
        wait_for(lambda: _planned(nodes[0], boaster.peer_id, since + 2 * RUN_EPOCH_S), 120,
                 "a plan seating it after its pace")  # fmt: skip
        event, plan = _plan_followed(nodes[0], reader, 60.0)
        # Any member may propose the plan, each from the paces in its own view: the swarm's.
        # Every member is planned at the larger of its pace and the swarm's measured slowdown
        # (control/stretch.py: the median of the members' pace x stretch, one factor for all),
        # which the epoch event gives. Not the largest stretch alone: CI once planned it at
        # 13.2x, an honest node's pace 2 x its stretch 6.7, when the test read 6.7 at most.
        held = {e["paced"][boaster.peer_id] for n in nodes for e in _paced(n, boaster.peer_id)}
        stretches = {e["slowdown"] for n in nodes for e in _paced(n, boaster.peer_id)}
        run = RunSpec(seq_len=64, micro_batch_size=2, micro_batches=4)
        config = PlanConfig(micro_batches=4, batch_size=run.global_batch, graph_batch_size=1)
        costs = learn_local_facts(run.model, 64, device_cache=None, measure_device=False).costs
        stage = next(s for s in plan.stages if boaster.peer_id in s.peers)
        share = stage.shares[stage.peers.index(boaster.peer_id)]
        planned = config.micro_batches * share * (stage.forward_time + stage.backward_time)
        claimed = predicted_compute_s(costs, plan, boaster.peer_id, DeviceInfo(**claim), config)
        print(f"claimed 4x: first paces {paces}; plan {event['digest'][:12]} times its stage at "
              f"{planned / claimed:.2f}x its claim; its paces {sorted(held)}, the swarm's "
              f"slowdowns {sorted(stretches)}")  # fmt: skip
        assert min(held) >= 2.0, held
        assert any(
            0.7 * max(p, s) <= planned / claimed <= 1.4 * max(p, s) for p in held for s in stretches
        ), (planned / claimed, held, stretches)
        steps = len(_step_times(everyone))
        wait_for(lambda: len(_step_times(everyone)) > steps + 10, 120, "training to go on")
    finally:
        if boaster is not None:
            boaster.kill()  # the test's own process; the trainers are the module's


def test_a_member_that_never_comes_to_the_barrier_is_planned_around(shared):
    swarm, nodes = shared
    joined = time.time()
    liar = swarm.start(
        "liar", bootstrap=nodes[0].dht_addr, device=RTX_4090, extra={"control-only": True}
    )
    try:
        seated = wait_for(lambda: _planned(nodes[0], liar.peer_id, joined), 120, "it seated")
        stalled_at = seated[0]["t"]
        wait_for(lambda: all(_suspected_by(n, liar.peer_id) for n in nodes), 90, "suspicion")
        out_at = max(_suspected_by(n, liar.peer_id)[0]["t"] for n in nodes)
        resumed = wait_for(
            lambda: [t for t in _step_times(nodes) if t > out_at], 60, "steps without it"
        )[0]
        print(f"stalled {resumed - stalled_at:.1f} s: seated at +{stalled_at - joined:.1f} s, "
              f"out at +{out_at - joined:.1f} s")  # fmt: skip
        assert resumed - stalled_at < RESUME_S, swarm.logs()
        # The backoff: 15 s out from the first suspicion, whatever the epochs bring meanwhile.
        wait_for(lambda: time.time() > out_at + 12.0, 20, "the backoff to run")
        for node in nodes:
            during = [e for e in _planned(node, liar.peer_id, out_at) if e["t"] < out_at + 12.0]
            assert not during, during
    finally:
        liar.kill()  # the test's own process; the trainers are the module's


def test_a_member_that_stalls_mid_run_with_its_heartbeat_up_is_blamed_and_planned_around(
    shared,
):
    """The newcomer computes honestly at the test CPU's speed (100x the trainers' claim), so
    the swarm seats it. First it abandons a step of its plan (``--fault-abandon-after``, as
    a member whose view briefly dropped a peer does): it tells the plan's members, which stop
    waiting for that step at once, not after their frame wait (15 s at least). Then, after 10
    steps of its next plan, it stops sending frames and stepping, its process and heartbeat
    up (the hidden ``--fault-stall-after`` hook). Its partner's step times out after the
    step's rhythm allows (not the 60 s step timeout), blames it, and the two others train on
    within 60 s; nobody else is suspected."""
    swarm, nodes = shared
    joined = time.time()
    staller = swarm.start("staller", bootstrap=nodes[0].dht_addr, device=TEST_DEVICE,
                          extra={"fault-stall-after": 10, "fault-abandon-after": 3})  # fmt: skip
    try:
        wait_for(lambda: _planned(nodes[0], staller.peer_id, joined), 120, "it seated")
        _assert_an_abandoned_step_is_given_up_at_once(staller, nodes)
        stalled = wait_for(lambda: staller.last("fault_stall"), 180, "its stall")
        stalled_at = stalled["t"]
        resumed = wait_for(lambda: first_step_after(nodes, stalled_at), 120, "steps without it")
        blames = [e for n in nodes for e in n.snapshot() if e["event"] == "stall"
                  and e["t"] >= joined]  # fmt: skip
        right = [(e["step"], e["blamed"] == staller.peer_id) for e in blames]
        print(f"stalled member: steps again after {resumed - stalled_at:.1f} s; blames {right}")
        assert resumed - stalled_at < RESUME_S, swarm.logs()
        assert staller.alive()  # its process stayed up all along
        assert blames, swarm.logs()
        assert all(e["blamed"] == staller.peer_id for e in blames), blames
        wait_for(lambda: all(_suspected_by(n, staller.peer_id) for n in nodes), 30, "suspicion")
        for node in [*nodes, staller]:
            for other in nodes:
                assert not _suspected_by(node, other.peer_id, since=joined), swarm.logs()
    finally:
        staller.kill()  # the test's own process; the trainers are the module's


def test_an_observer_with_a_fast_device_is_never_planned(shared, reader):
    swarm, nodes = shared
    joined = time.time()
    observer = swarm.start(
        "watcher", bootstrap=nodes[0].dht_addr, device=RTX_4090, extra={"no-train": True}
    )
    try:
        wait_for(lambda: observer.last("epoch"), 60, "the observer to follow the plan")
        seen = lambda: all(  # noqa: E731
            observer.peer_id in (n.last("epoch") or {}).get("members", []) for n in nodes
        )
        wait_for(seen, 60, "the trainers to count the observer a member")
        # Once both trainers' records carry a measured link to it, every planner has what it
        # needs to seat it; a plan would then have named it within a few epochs.
        wait_for(lambda: _linked(reader, observer.peer_id, nodes), 60, "links to it measured")
        after = {n.name: n.last("epoch")["epoch"] + SEATING_EPOCHS for n in nodes}
        wait_for(lambda: all(n.last("epoch")["epoch"] >= after[n.name] for n in nodes),
                 (SEATING_EPOCHS + 5) * RUN_EPOCH_S * 3, "epochs with its links known")  # fmt: skip
        now = time.time()
        for node in [*nodes, observer]:
            assert not _planned(node, observer.peer_id, joined), swarm.logs()
        pause = _longest_pause(_step_times(nodes), joined, now)
        print(f"longest pause in steps after the observer joined: {pause:.1f} s")
        assert pause < RESUME_S, swarm.logs()
    finally:
        observer.kill()  # the test's own process; the trainers are the module's


def _asked_for_state(nodes: list[NodeProcess], askers: set[str]) -> str | None:
    """The first member of a plan (the one that may ask for state) if it is one of ``askers``
    and the plan leaves a trainer out (it holds the state it trained: a WANT gets an answer)."""
    for node in nodes:
        stages = (node.last("epoch") or {}).get("stages", [])
        if stages and stages[0][0] in askers and not any(node.peer_id in s for s in stages):
            return stages[0][0]
    return None


def _answers(node: NodeProcess, since: float) -> list[dict]:
    return [e for e in node.snapshot() if e["event"] == "answered" and e["t"] >= since]


def _flood_until_answered(flooders: list[Transport], nodes: list[NodeProcess]) -> float:
    """10 requests for state a second from each flooder to each trainer, until one is
    answered and 5 s more, or 60 s; when it began."""
    header = FrameHeader(step=0, micro_batch=TAG_WANT, kind=FrameKind.CONTROL, stage=0)
    want = pack_tensor(torch.tensor([1e6, 0.0], dtype=torch.float64))  # (2,) hint, floor
    targets = [[f.connect(n.last("ready")["addrs"][0]) for n in nodes] for f in flooders]
    began = time.time()
    end = began + 60.0
    while time.time() < end:
        for flooder, peers in zip(flooders, targets, strict=True):
            for peer in peers:
                flooder.send_async(peer, header, want, timeout=5.0)
        time.sleep(0.1)
        if end > time.time() + 5.0 and any(_answers(n, began) for n in nodes):
            end = time.time() + 5.0  # the flood goes on past the first answer
    return began


def test_a_flood_of_state_requests_gets_at_most_one_answer_per_plan(shared):
    """Two members that claim an RTX 4090 and never come to the barrier are seated, one of them
    first (the member that may ask for state), and both trainers left out with the state they
    trained (what a WANT asks for; a plan seats the fast device last or first, so one such
    member seated beside a trainer may never be first). With both members' keys the test sends
    each trainer 10 WANTs a second from each until one is answered, and 5 s more: at least one
    answer, at most one per trainer and plan."""
    swarm, nodes = shared
    members = [swarm.start(name, bootstrap=nodes[0].dht_addr, device=RTX_4090,
                           extra={"control-only": True}) for name in ("x", "y")]  # fmt: skip
    flooders: list[Transport] = []
    try:
        wait_for(lambda: all(m.last("ready") for m in members), 60, "both members")
        askers = {m.peer_id for m in members}
        wait_for(lambda: _asked_for_state(nodes, askers), 120, "a plan that leaves both out")
        for member in members:
            config = TransportConfig(key_path=swarm.root / f"{member.name}.key",
                                     dial_timeout_s=5.0)  # fmt: skip
            flooders.append(Transport(config))
            flooders[-1].start()
        began = _flood_until_answered(flooders, nodes)
        time.sleep(3.0)  # answers still on their way
        answers = {n.name: _answers(n, began) for n in nodes}
        print(f"answers to the flood: {answers}")
        assert any(answers.values()), swarm.logs()  # the answering path ran
        for node in nodes:
            plans = {e["digest"] for e in node.snapshot() if e["event"] == "epoch"
                     and e["t"] >= began - 2 * RUN_EPOCH_S}  # fmt: skip
            per_plan = Counter(e["plan"] for e in answers[node.name])
            print(f"{node.name}: answers per plan {dict(per_plan)}, {len(plans)} plans")
            assert all(n == 1 for n in per_plan.values()), per_plan
            assert set(per_plan) <= plans, (per_plan, plans)
            assert {e["to"] for e in answers[node.name]} <= askers
        assert all(n.alive() for n in nodes)
        assert len(_step_times(nodes)) > 10
    finally:
        for flooder in flooders:
            flooder.close()
        for member in members:
            member.kill()


def test_a_stopped_member_is_planned_around_within_a_checkpoint_interval(shared):
    """Last in the module: the member it stops may be one of the shared trainers."""
    swarm, trainers = shared
    nodes, stopped = [*trainers, swarm.start("c", bootstrap=trainers[0].dht_addr)], None
    try:
        wait_for(lambda: nodes[2].last("epoch"), 120, "the third node to follow a plan")
        # 30 more step events than when the third node followed a plan (as on a fresh pair's
        # 10): the plan with it has trained past a checkpoint when a member stops.
        trained = len(_step_times(nodes)) + 30
        wait_for(lambda: len(_step_times(nodes)) >= trained, 120, "30 more trained steps")
        stopped = wait_for(lambda: serving(nodes), 60, "a serving node")[0]
        stopped_at = time.time()
        stopped.process.send_signal(signal.SIGSTOP)
        alive = [n for n in nodes if n is not stopped]
        resumed = wait_for(lambda: first_step_after(alive, stopped_at), 120, "a plan without it")
        lost = max(rollbacks(alive, stopped_at))
        print(f"stopped member: steps again after {resumed - stopped_at:.1f} s, {lost} lost")
        assert resumed - stopped_at < RESUME_S, swarm.logs()
        assert 0 <= lost <= EVERY, lost
    finally:
        if stopped is not None:
            stopped.process.send_signal(signal.SIGCONT)
        nodes[2].kill()  # the test's own process; the trainers are the module's
