"""Members witness each other's pace from the step summaries (control/pace.py): the timings
the summaries carry, the neighbours' check of what a member says it computed, the witness's
meters, the records that carry them and the pace every planner then uses."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from fusionllm.dht.records import MAX_WITNESSED, NodeInfo, RecordError, Witnessed
from fusionllm.node.control.pace import (
    PaceWitness,
    checked_compute,
    ranks_fit,
    with_witnessed_paces,
    witnessed_pace,
)
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.summary import Summary, combine
from tests.unit.test_epochs import record

# ----------------------------------------------------------------------------- the summary


def test_the_summary_carries_each_processs_timings_in_rank_order():
    parts = [Summary(1.0, 2.0, 2, 0.5, busy_s=0.3, wait_out_s=0.9),
             Summary(0.0, 3.0, 2, 0.5, busy_s=0.8, wait_in_s=0.4)]  # fmt: skip
    for part in parts:
        assert Summary.from_tensor(part.to_tensor(), step=0, sender="x") == part
    assert combine(parts).timings == ((0.3, 0.0, 0.9), (0.8, 0.4, 0.0))


@pytest.mark.parametrize("index", [7, 8, 9])
@pytest.mark.parametrize("value", [-0.1, float("inf"), 2e6])
def test_a_timing_that_cannot_be_is_refused(index, value):
    bad = Summary(1.0, 2.0, 2, 0.5).to_tensor()
    bad[index] = value
    with pytest.raises(PipelineError, match="bad summary"):
        Summary.from_tensor(bad, step=1, sender="x")


# ----------------------------------------------------------------------------- the check


def _plan(widths: list[int], link_s: float = 0.0):
    """A plan's shape as checked_compute reads it: replicas per stage, and links whose
    frames take ``link_s`` per micro-batch each way (1 MB at 1 MB/s ... and no RTT)."""
    stages = [SimpleNamespace(peers=tuple(f"p{s}.{r}" for r in range(w))) for s, w in
              enumerate(widths)]  # fmt: skip
    one = int(link_s * 1e6)
    links = [SimpleNamespace(src_stage=s, src_peer=f"p{s}.0", dst_peer=f"p{s + 1}.0",
                             forward_wire_bytes=one, forward_bandwidth=1e6,
                             forward_rtt=0.0, backward_wire_bytes=one, backward_bandwidth=1e6,
                             backward_rtt=0.0) for s in range(len(widths) - 1)]  # fmt: skip
    return SimpleNamespace(stages=stages, links=links)


def _as_planned(src: str, dst: str) -> tuple[float, float, bool]:
    """Every link of ``_plan`` measures what the plan says (1 MB/s, no RTT), direct."""
    return (1e6, 0.0, False)


def test_a_step_of_the_plan_before_is_not_read_against_the_one_adopted_since():
    two = _plan([1, 1])
    assert ranks_fit(two, [("p0.0", 0), ("p1.0", 1)])
    # the session still ran three stages when the node adopted a plan of two (a member left):
    # checked_compute would index the third stage of a two-stage plan
    assert not ranks_fit(two, [("p0.0", 0), ("p1.0", 1), ("x", 2)])
    assert not ranks_fit(two, [("p1.0", 0), ("p0.0", 1)])  # other seats


def test_an_honest_report_stands():
    # Two stages, each computing 1 s; each waits a little on the other.
    timings = [(1.0, 0.0, 0.3), (1.0, 0.2, 0.0)]
    assert checked_compute(_plan([1, 1]), [0, 1], timings, 4, _as_planned) == [1.0, 1.0]


def test_a_neighbours_wait_up_to_twice_the_report_leaves_the_word_standing():
    # Stage 0 waited 1.9 s for stage 1's gradients, which said 1 s: frames and per-step costs
    # the cost model leaves out; stage 1's word stands.
    timings = [(1.0, 0.0, 1.9), (1.0, 0.1, 0.0)]
    assert checked_compute(_plan([1, 1]), [0, 1], timings, 4, _as_planned) == [1.0, 1.0]


def test_a_last_stage_that_under_reports_is_checked_by_its_upstream_waits():
    # Stage 1 says 0.5 s; stage 0 waited 4 s for its gradients: it computed ~4 s.
    timings = [(1.0, 0.0, 4.0), (0.5, 0.1, 0.0)]
    assert checked_compute(_plan([1, 1]), [0, 1], timings, 4, _as_planned) == [1.0, 4.0]


def test_a_first_stage_that_under_reports_is_checked_by_its_downstream_waits():
    timings = [(0.5, 0.0, 0.2), (1.0, 3.0, 0.0)]
    assert checked_compute(_plan([1, 1]), [0, 1], timings, 4, _as_planned) == [3.0, 1.0]


def test_the_plans_time_on_the_links_is_not_blamed_on_compute():
    # 4 micro-batches x 0.25 s each way on the link: 2 s of stage 0's 4 s wait.
    timings = [(1.0, 0.0, 4.0), (0.5, 0.1, 0.0)]
    assert checked_compute(_plan([1, 1], 0.25), [0, 1], timings, 4, _as_planned) == [1.0, 2.0]


def test_a_link_slower_now_than_the_plan_said_is_not_blamed_on_compute():
    # The plan priced the link at 0.25 s per micro-batch each way (1 MB/s); a relay under load
    # now carries it at 0.25 MB/s: 4 micro-batches x 2 x 1 s = 8 s of stage 0's 9 s wait for
    # gradients. Stage 1's word (1 s) stands; at the plan's figure it would be charged 7 s, and
    # a pace raised on it shrinks its stage while the waits stay (docs/nat.md).
    timings = [(1.0, 0.0, 9.0), (1.0, 0.1, 0.0)]
    slowed = {("p0.0", "p1.0"): (0.25e6, 0.0, False), ("p1.0", "p0.0"): (0.25e6, 0.0, False)}
    plan = _plan([1, 1], 0.25)
    assert checked_compute(plan, [0, 1], timings, 4, _as_planned) == [1.0, 7.0]
    assert checked_compute(plan, [0, 1], timings, 4, lambda a, b: slowed.get((a, b))) == [1.0, 1.0]
    # One way measured, the other at the plan's figure: 4 x (1 + 0.25) = 5 s of the link.
    one = {("p0.0", "p1.0"): (0.25e6, 0.0, False)}
    assert checked_compute(plan, [0, 1], timings, 4, lambda a, b: one.get((a, b))) == [1.0, 4.0]


def test_a_link_faster_now_leaves_a_slow_member_no_cover():
    # A liar cannot hide behind the plan's figure once the link measures fast: stage 1 said
    # 1 s, stage 0 waited 9 s; the plan's 4 x 2 x 1 s on the link would cover 8 s of it, but
    # the link now costs 4 x 2 x 0.4 s.
    timings = [(1.0, 0.0, 9.0), (1.0, 0.1, 0.0)]
    plan = _plan([1, 1], 1.0)
    assert checked_compute(plan, [0, 1], timings, 4, _as_planned) == [1.0, 1.0]
    fast = {("p0.0", "p1.0"): (2.5e6, 0.0, False), ("p1.0", "p0.0"): (2.5e6, 0.0, False)}
    got = checked_compute(plan, [0, 1], timings, 4, lambda a, b: fast.get((a, b)))
    assert got == [1.0, pytest.approx(5.8)]


def test_a_relayed_link_checks_nobodys_compute():
    # The same waits with the link measured fast but through a relay (either way): a relay's
    # per-frame delay is in the waits and in no figure, so each member's word stands.
    timings = [(1.0, 0.0, 9.0), (1.0, 6.0, 0.0)]
    plan = _plan([1, 1], 0.25)
    assert checked_compute(plan, [0, 1], timings, 4, _as_planned) == [4.0, 7.0]
    for relayed_way in (("p0.0", "p1.0"), ("p1.0", "p0.0")):

        def now(a, b, way=relayed_way):
            return (2.5e6, 0.0, (a, b) == way)

        assert checked_compute(plan, [0, 1], timings, 4, now) == [1.0, 1.0]


def test_a_link_nobody_measured_checks_nobodys_compute():
    # The plan priced it from the ends' records (a guess): its waits tell nothing yet.
    timings = [(1.0, 0.0, 9.0), (1.0, 6.0, 0.0)]
    assert checked_compute(_plan([1, 1]), [0, 1], timings, 4, lambda a, b: None) == [1.0, 1.0]


def test_a_middle_stage_is_charged_only_its_own_part_of_the_wait():
    # Stage 0 waited 5 s on stage 1, which itself waited 3 s on stage 2: stage 1's part is 2 s.
    timings = [(1.0, 0.0, 5.0), (0.5, 0.0, 3.0), (3.0, 0.0, 0.0)]
    assert checked_compute(_plan([1, 1, 1]), [0, 1, 2], timings, 4, _as_planned) == [1.0, 2.0, 3.0]


def test_replicated_stages_are_taken_at_their_word():
    timings = [(1.0, 0.0, 4.0), (0.5, 0.1, 0.0), (0.5, 0.1, 0.0)]
    assert checked_compute(_plan([1, 2]), [0, 1, 1], timings, 4, _as_planned) == [1.0, 0.5, 0.5]


# ----------------------------------------------------------------------------- the witness


def test_the_witness_publishes_a_pace_per_member_after_a_window():
    witness = PaceWitness(window=4)
    for _ in range(3):
        witness.add("plan1", "slow", 4.2, 1.0)
        witness.add("plan1", "fine", 1.1, 1.0)
    assert witness.current() == ()
    witness.add("plan1", "slow", 4.2, 1.0)
    witness.add("plan1", "fine", 1.1, 1.0)
    assert witness.current() == (Witnessed("slow", 4.0),)
    witness.add("plan2", "slow", 1.0, 1.0)  # a new plan: measured afresh, the pace kept
    assert witness.current() == (Witnessed("slow", 4.0),)


def test_the_witness_is_bounded():
    witness = PaceWitness(window=3)
    for i in range(10 * MAX_WITNESSED):
        for _ in range(3):
            witness.add("plan", f"p{i}", 8.0, 1.0)
    assert len(witness._meters) <= 4 * MAX_WITNESSED
    assert len(witness.current()) == MAX_WITNESSED


# ----------------------------------------------------------------------------- records


def test_a_record_carries_what_it_witnessed_and_refuses_nonsense():
    info = record("a", witnessed=(Witnessed("b", 4.0),))
    assert NodeInfo.from_wire(info.to_wire()).witnessed == (Witnessed("b", 4.0),)
    assert "wit" not in record("a").to_wire()  # none: the field stays off the wire
    for bad in ([["b", 0.5]], [["b"]], [[3, 2.0]], [["b", 2.0]] * (MAX_WITNESSED + 1)):
        wire = {**info.to_wire(), "wit": bad}
        with pytest.raises(RecordError):
            NodeInfo.from_wire(wire)


def test_planners_take_the_median_witnessed_pace_where_it_is_slower():
    members = {
        "a": record("a", witnessed=(Witnessed("liar", 4.0),)),
        "b": record("b", witnessed=(Witnessed("liar", 8.0), Witnessed("a", 2.0))),
        "c": record("c", witnessed=(Witnessed("liar", 2.0),)),
        "liar": record("liar", witnessed=(Witnessed("a", 64.0),)),  # lies about a, too
        "w": record("w", observer=True, witnessed=(Witnessed("c", 64.0),)),
    }
    assert witnessed_pace(members, "liar") == 4.0
    assert witnessed_pace(members, "a") == 2.0  # median_low of [2, 64]
    assert witnessed_pace(members, "c") == 1.0  # an observer's word does not count
    paced = with_witnessed_paces(members)
    assert paced["liar"].pace == 4.0
    assert paced["c"] is members["c"]
    # A member's own slower pace stands.
    members["liar"] = dataclasses.replace(members["liar"], pace=16.0)
    assert with_witnessed_paces(members)["liar"].pace == 16.0


def test_a_step_summary_tensor_is_float64_of_ten():
    assert Summary(0.0, 0.0, 0, 0.0).to_tensor().dtype == torch.float64
    assert Summary(0.0, 0.0, 0, 0.0).to_tensor().shape == (10,)
