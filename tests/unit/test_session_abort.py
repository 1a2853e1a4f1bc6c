"""A member that abandons a step tells the plan's other members (ABORT), so they stop at once.

Two real ``PlanSession._steps`` loops and real ``Board``s, joined by a transport fake that
files each frame on the receiver's board; the runners are fakes whose step blocks on a frame
until aborted (as the real mailbox does) or until a step timeout far beyond the test's bound.
"""

import threading
import time
from types import SimpleNamespace

import torch

from fusionllm.compression.frame import unpack_tensor
from fusionllm.node.errors import PipelineError
from fusionllm.node.p2p.transport import Received
from fusionllm.node.training.board import TAG_ABORT, Abort, Board, decode_abort, encode_ready
from fusionllm.node.training.holdings import Holding
from fusionllm.node.training.session import PlanSession
from fusionllm.node.training.session_terms import Outcome

STEP_TIMEOUT_S = 60.0  # what a member would wait for the frame of a peer that gave up
BOUND_S = 10.0  # what this test allows: seconds, not the step timeout
VOTE = 7.0
MEMBERS = ("a", "b", "c")


class Runner:
    """A step that waits for a frame that never comes: it fails when aborted, or times out."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.completed_steps: int | None = None
        self._abort = threading.Event()
        self.worker = SimpleNamespace(
            drop=lambda step: None, optimizer=SimpleNamespace(zero_grad=lambda set_to_none: None)
        )

    def abort(self, exc: Exception) -> None:
        self.aborted.append(str(exc))
        self._abort.set()

    def run_step(self, step: int):
        if self._abort.wait(STEP_TIMEOUT_S):
            raise PipelineError(self.aborted[0])
        raise AssertionError("the step waited out its timeout")

    def scale_state(self):
        return None


class Wire:
    """Frames between the members' boards; each send is filed on the receiver's board."""

    def __init__(self) -> None:
        self.boards: dict[str, Board] = {}
        self.sent: list[tuple[str, str, Received]] = []  # (sender, receiver, frame)

    def transport_of(self, me: str):
        def send_async(peer, header, packed, timeout):
            tensor = unpack_tensor(packed)
            self.sent.append((me, peer, Received(me, header, tensor)))
            if peer in self.boards:
                self.boards[peer].put(Received(me, header, tensor))

        return SimpleNamespace(send_async=send_async)

    def aborts(self) -> list[tuple[str, str, Abort]]:
        return [
            (src, dst, decode_abort(item.tensor))
            for src, dst, item in self.sent
            if item.header.micro_batch == TAG_ABORT
        ]


def member(wire: Wire, me: str, nonce: int, met: dict[str, int]) -> PlanSession:
    """Member ``me`` of plan VOTE, past its meeting (it met ``met``: member -> its nonce)."""
    session = object.__new__(PlanSession)
    board = Board(
        shapes={"w": (2,)},
        is_member=MEMBERS.__contains__,
        on_abort=lambda peer, abort: session.aborted(peer, abort),
        on_ready=lambda peer, ready: session.answer(peer, ready),
        on_answer=lambda peer, ready: session.answered(peer, ready),
    )
    wire.boards[me] = board
    session.__dict__.update(
        assignment=SimpleNamespace(members=MEMBERS, digest="ab" * 32),
        role=SimpleNamespace(stage=0),
        me=me,
        vote=VOTE,
        nonce=nonce,
        _met=dict(met),
        _announced={},
        _answered={},
        _echoed={},
        _told=False,
        runner=Runner(),
        transport=wire.transport_of(me),
        board=board,
        layout=None,
        vault=SimpleNamespace(begin_step=lambda: None, set_live=lambda held: None),
        hooks=SimpleNamespace(fault_stall_after=0, fault_abandon_after=0),
    )
    return session


def stepping(session: PlanSession) -> tuple[threading.Thread, list]:
    ended: list = []

    def steps() -> None:
        ended.append(session._steps(4, last_step=0, stop=threading.Event(), on_step=None))

    thread = threading.Thread(target=steps, daemon=True)
    thread.start()
    return thread, ended


def test_a_member_that_abandons_a_step_stops_the_others_waiting_at_once() -> None:
    wire = Wire()
    nonces = {"a": 11, "b": 22, "c": 33}
    sessions = {
        me: member(wire, me, nonces[me], {p: n for p, n in nonces.items() if p != me})
        for me in MEMBERS
    }
    threads = {me: stepping(s) for me, s in sessions.items()}
    started = time.monotonic()
    # "a"'s view drops a member: its watcher abandons the step (session._watch_members)
    sessions["a"].runner.abort(PipelineError("member c left the swarm"))
    for me, (thread, ended) in threads.items():
        thread.join(BOUND_S)
        assert not thread.is_alive(), f"{me} still waits for the step"
        assert ended[0].outcome is Outcome.FAILED
    assert time.monotonic() - started < BOUND_S
    # "a" told each member, naming that member's own meeting; those told did not tell back
    assert sorted((src, dst, a.echo) for src, dst, a in wire.aborts()) == [
        ("a", "b", 22),
        ("a", "c", 33),
    ]
    assert {a.step for _, _, a in wire.aborts()} == {4}
    assert sessions["b"].runner.aborted == ["member a abandoned step 4"]


def test_an_abort_for_another_meeting_plan_or_from_a_stranger_changes_nothing() -> None:
    wire = Wire()
    session = member(wire, "b", 22, {"a": 11})
    for peer, abort in [
        ("a", Abort(VOTE, 21, 4)),  # a meeting of this plan served before (another nonce)
        ("a", Abort(VOTE + 1, 22, 4)),  # another plan
        ("b", Abort(VOTE, 22, 4)),  # ourselves
        ("d", Abort(VOTE, 22, 4)),  # a node outside the plan
    ]:
        session.aborted(peer, abort)
    assert session.runner.aborted == []
    assert session._told is False
    session.aborted("a", Abort(VOTE, 22, 4))
    assert session.runner.aborted == ["member a abandoned step 4"]


def test_a_step_that_times_out_tells_the_members_too() -> None:
    wire = Wire()
    session = member(wire, "a", 11, {"b": 22, "c": 33})
    session._failed(9, PipelineError("frame wait timed out"))
    assert sorted((dst, a.echo, a.step) for _, dst, a in wire.aborts()) == [
        ("b", 22, 9),
        ("c", 33, 9),
    ]
    sent = [item.tensor for _, _, item in wire.sent]
    assert all(t.dtype == torch.float64 and tuple(t.shape) == (3,) for t in sent)


def test_a_meeting_past_does_not_answer_a_members_new_meeting_with_what_it_held_then() -> None:
    """a abandoned step 4 and meets b again (new nonce) while b's session of that plan, woken
    inside step 4, still runs: b must not answer with its first meeting's READY ("b holds step
    0"), which a's new meeting would count, deciding a start that b never agreed to."""
    wire = Wire()
    b = member(wire, "b", 22, {"a": 11})
    b._announced[0] = encode_ready(VOTE, [Holding(0, 2, 4)], nonce=22)  # b's meeting: step 0
    a_new = member(wire, "a", 12, {})
    held_now = encode_ready(VOTE, [Holding(4, 0, 2)], hint=4, nonce=12)
    a_new._send_ready("b", held_now, 0, echo=22)  # the nonce a last heard from b
    assert a_new.board.ready_of(["b"], VOTE, 0, echo=12) == {}
    # a READY of the meeting b met is still answered (a member that adopted the plan late)
    a_new._send_ready("b", encode_ready(VOTE, [Holding(4, 0, 2)], nonce=11), 0, echo=22)
    answered = a_new.board.ready_of(["b"], VOTE, 0, echo=11)
    assert [(r.nonce, r.holdings) for r in answered.values()] == [(22, (Holding(0, 2, 4),))]
