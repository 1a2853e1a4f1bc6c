"""node/control/backoff.py: when a stable swarm plans afresh (pure bookkeeping over epochs)."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.control.backoff import (
    BackoffConfig,
    ProbeBackoff,
    ReplanBackoff,
    max_factor_for,
)

ABC = frozenset("abc")


def fresh_epochs(backoff: ReplanBackoff, epochs: range, members=ABC, digest="same") -> list[int]:
    """The epochs in which the node plans afresh, its plans always coming out ``digest``."""
    planned = []
    for epoch in epochs:
        if backoff.due(epoch, members, incumbent_ok=True):
            backoff.planned(epoch, members, digest)
            planned.append(epoch)
    return planned


def test_a_stable_swarm_plans_at_doubling_gaps_up_to_the_cap():
    backoff = ReplanBackoff(BackoffConfig(max_gap=8))
    assert fresh_epochs(backoff, range(100, 150)) == [100, 101, 103, 107, 115, 123, 131, 139, 147]
    assert backoff.gap == 8


def test_a_plan_that_changes_keeps_planning_every_epoch():
    backoff = ReplanBackoff()
    for epoch in range(10):
        assert backoff.due(epoch, ABC, incumbent_ok=True)
        backoff.planned(epoch, ABC, f"plan{epoch % 2}")
    assert backoff.gap == 1


def test_new_members_a_failed_audit_or_no_plan_start_over():
    backoff = ReplanBackoff(BackoffConfig(max_gap=8))
    fresh_epochs(backoff, range(0, 40))
    assert backoff.gap == 8
    assert not backoff.due(40, ABC, incumbent_ok=True)
    # A member joins (or goes): plan now, and the gap starts over.
    assert backoff.due(40, ABC | {"d"}, incumbent_ok=True)
    backoff.planned(40, ABC | {"d"}, "same")
    assert backoff.gap == 1
    # The plan we follow fails its audit: plan now, whatever the gap.
    fresh_epochs(backoff, range(41, 80), members=ABC | {"d"})
    assert not backoff.due(80, ABC | {"d"}, incumbent_ok=True)
    assert backoff.due(80, ABC | {"d"}, incumbent_ok=False)
    # No feasible plan is never "the same plan again".
    backoff.planned(80, ABC, None)
    backoff.planned(81, ABC, None)
    assert backoff.gap == 1


def test_the_first_epoch_always_plans():
    assert ReplanBackoff().due(0, frozenset(), incumbent_ok=True)


@pytest.mark.parametrize("bad", [0, -1, 1025, 2.0, True])
def test_config_refuses_bad_gaps(bad):
    with pytest.raises(ConfigError, match="max_gap"):
        BackoffConfig(max_gap=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_config_refuses_bad_planner_counts(bad):
    with pytest.raises(ConfigError, match="planners"):
        BackoffConfig(planners=bad)


def test_only_the_gap_is_a_routine_check_and_anything_else_is_not():
    backoff = ReplanBackoff()
    assert not backoff.only_the_gap(0, ABC, incumbent_ok=True)  # the first plan
    backoff.planned(0, ABC, "same")
    assert not backoff.only_the_gap(0, ABC, incumbent_ok=True)  # not due yet
    assert backoff.only_the_gap(1, ABC, incumbent_ok=True)
    assert not backoff.only_the_gap(1, ABC | {"d"}, incumbent_ok=True)  # members changed
    assert not backoff.only_the_gap(1, ABC, incumbent_ok=False)  # the audit failed


def test_probe_rounds_slow_down_while_the_swarm_looks_the_same_and_reset_on_change():
    backoff = ProbeBackoff(max_factor=4)
    stable = (ABC, ("b",))
    assert [backoff.next_factor(stable) for _ in range(5)] == [1, 2, 4, 4, 4]
    assert backoff.next_factor((ABC | {"d"}, ("b",))) == 1  # a member joined
    assert backoff.next_factor((ABC | {"d"}, ("b",))) == 2
    assert backoff.next_factor((ABC | {"d"}, ("c",))) == 1  # the plan gave us new neighbours


@pytest.mark.parametrize(
    ("interval", "max_age", "factor"),
    [(10.0, 60.0, 2), (8.0, 60.0, 3), (2.0, 60.0, 4), (60.0, 60.0, 1), (5.0, 15.0, 1)],
)
def test_probe_backoff_keeps_links_fresher_than_the_book_forgets_them(interval, max_age, factor):
    assert max_factor_for(interval, max_age) == factor
    assert 2 * 1.2 * interval * factor <= max_age or factor == 1


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_probe_backoff_refuses_bad_factors(bad):
    with pytest.raises(ConfigError, match="max_factor"):
        ProbeBackoff(max_factor=bad)
