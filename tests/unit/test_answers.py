"""training/answers.py: which requests for state a node answers, and its per-peer byte budget."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.training.answers import AnswerLimits, Answers

PLAN = "d" * 64
MEMBERS = ("first", "second")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _answers(clock=None, **limits) -> Answers:
    return Answers(AnswerLimits(**limits), full_state_bytes=1000, clock=clock or FakeClock())


def test_the_plans_first_member_gets_one_answer_per_plan():
    answers = _answers()
    assert answers.refusal("first", digest=PLAN, members=MEMBERS, serving=False) is None
    for _ in range(100):  # a flood
        why = answers.refusal("first", digest=PLAN, members=MEMBERS, serving=False)
        assert why == "answered for this plan already"
    assert answers.refused == 100
    other = "e" * 64
    assert answers.refusal("first", digest=other, members=MEMBERS, serving=False) is None


@pytest.mark.parametrize(
    ("peer", "digest", "members", "serving", "why"),
    [
        ("second", PLAN, MEMBERS, False, "only the plan's first member asks"),
        ("stranger", PLAN, MEMBERS, False, "only the plan's first member asks"),
        ("first", PLAN, MEMBERS, True, "we serve the plan"),
        ("first", None, (), False, "we follow no plan"),
    ],
)
def test_asks_from_other_roles_are_refused(peer, digest, members, serving, why):
    answers = _answers()
    assert why in answers.refusal(peer, digest=digest, members=members, serving=serving)
    # ... and a refusal does not use up the plan's one answer
    assert answers.refusal("first", digest=PLAN, members=MEMBERS, serving=False) is None


def test_the_byte_budget_is_per_peer_and_window():
    clock = FakeClock()
    answers = _answers(clock, window_s=60.0, states_per_window=2.0)  # 2000 bytes
    assert answers.spend("a", 1500)
    assert not answers.spend("a", 600)
    assert answers.spend("a", 500)
    assert answers.spend("b", 2000)  # another peer's budget
    clock.now += 59.9
    assert not answers.spend("a", 1)
    clock.now += 0.1
    assert answers.spend("a", 2000)


def test_many_plans_and_peers_stay_bounded():
    clock = FakeClock()
    answers = _answers(clock)
    for i in range(1000):
        answers.refusal("first", digest=f"{i:064x}", members=MEMBERS, serving=False)
        answers.spend(f"peer{i}", 1)
        clock.now += 1.0
    assert len(answers._answered) <= 64
    assert len(answers._spent) <= 65


@pytest.mark.parametrize(
    ("changes", "match"),
    [({"window_s": 0.0}, "window_s"), ({"states_per_window": 0.0}, "states_per_window")],
)
def test_bad_limits_are_refused(changes, match):
    with pytest.raises(ConfigError, match=match):
        AnswerLimits(**changes)
