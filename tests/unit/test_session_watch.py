"""session.py's step watcher: which blocked steps it abandons (fakes around the real method)."""

import threading
import time
from types import SimpleNamespace

import pytest

from fusionllm.node.training import session as session_module
from fusionllm.node.training.session import PlanSession


class Runner:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.completed_steps: int | None = None

    def abort(self, exc: Exception) -> None:
        self.aborted.append(str(exc))


def watched(followed: str, members=("b",), stepped: bool = False):
    """A session of plan "p" with peer "b", its watcher running on a thread."""
    session = object.__new__(PlanSession)
    session.assignment = SimpleNamespace(digest="p", others=lambda: {"role": "b"})
    state = {"followed": followed, "members": set(members)}
    session.hooks = SimpleNamespace(
        is_member=lambda peer: peer in state["members"], followed=lambda: state["followed"]
    )
    session.runner = Runner()
    if stepped:
        session.runner.completed_steps = 1
    done = threading.Event()
    thread = threading.Thread(target=session._watch_members, args=(done,), daemon=True)
    thread.start()
    return session, state, done, thread


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(session_module, "_WATCH_S", 0.01)
    monkeypatch.setattr(session_module, "_SUPERSEDED_S", 1.0)


def test_a_first_step_of_a_replaced_plan_is_abandoned_after_the_grace():
    session, _, _done, thread = watched(followed="newer")
    started = time.monotonic()
    thread.join(5.0)
    assert session.runner.aborted == ["plan replaced before its first step"]
    assert time.monotonic() - started >= 1.0


def test_a_plan_that_stepped_or_is_still_followed_is_left_to_the_votes():
    for followed, stepped in (("newer", True), ("p", False)):
        session, _, done, thread = watched(followed=followed, stepped=stepped)
        time.sleep(1.3)
        done.set()
        thread.join(5.0)
        assert session.runner.aborted == []


def test_the_grace_restarts_when_the_swarm_comes_back_to_the_plan():
    session, state, _done, thread = watched(followed="newer")
    time.sleep(0.6)
    state["followed"] = "p"
    time.sleep(0.2)
    state["followed"] = "newer"
    time.sleep(0.6)
    assert session.runner.aborted == []  # 1.2 s replaced in all, but never 1 s in a row
    thread.join(5.0)
    assert session.runner.aborted == ["plan replaced before its first step"]


def test_a_member_gone_still_ends_the_step_first():
    session, state, _done, thread = watched(followed="p")
    state["members"].clear()
    thread.join(5.0)
    assert session.runner.aborted == ["member b left the swarm"]
