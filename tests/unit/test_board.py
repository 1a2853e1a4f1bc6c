"""The board between plans (``board.py``): READY bodies encoded and decoded (and malformed ones
refused), READYs filed per (peer, round), WANT frames handed on, and the custody path: CUSTODY
parts and a MANIFEST, in any order, make one ``Copy`` only when they agree; frames from
non-members are refused; unfinished copies per peer are bounded.

Frames are built as the router hands them over (``Received``), with no transport.
"""

import logging
import threading

import pytest
import torch

from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import Received, TensorSpec
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.training.board import (
    _PENDING_COPIES_PER_PEER,
    _READY_HEAD,
    MANIFEST_LEN,
    NONCE_LIMIT,
    READY_LEN,
    TAG_ABORT,
    TAG_CUSTODY,
    TAG_DONE,
    TAG_MANIFEST,
    TAG_READY,
    TAG_STATE,
    TAG_WANT,
    Abort,
    Board,
    Copy,
    Ready,
    decode_abort,
    decode_ready,
    encode_abort,
    encode_ready,
    is_board_frame,
    with_echo,
)
from fusionllm.node.training.holdings import MAX_HOLDINGS, Holding

SHAPES = {"w": (2, 3), "b": (4,), "g": (5,)}
NAMES = sorted(SHAPES)  # the board's parameter index: b, g, w
MEMBERS = {"m1", "m2"}


def _header(step: int, tag: int) -> FrameHeader:
    return FrameHeader(step=step, micro_batch=tag, kind=FrameKind.CONTROL, stage=0)


def _part_tensor(name: str, value: float) -> torch.Tensor:
    numel = int(torch.Size(SHAPES[name]).numel())
    return torch.full((3 * numel + 1,), value)


def _part(peer: str, step: int, name: str, value: float = 1.0) -> Received:
    return Received(peer, _header(step, TAG_CUSTODY + NAMES.index(name)), _part_tensor(name, value))


def _manifest(peer: str, step: int, start: int, stop: int, count: int, digest48: int = 77, *,
              header_step: int | None = None, scale=(0.0, 0)) -> Received:  # fmt: skip
    body = torch.tensor([step, start, stop, count, digest48, *scale], dtype=torch.float64)
    return Received(peer, _header(step if header_step is None else header_step, TAG_MANIFEST), body)


def _ready(peer: str, vote: float, holdings: list[Holding], *, round: int = 0, nonce: int = 0,
           echo: int = 0, step: int = 0) -> Received:  # fmt: skip
    body = encode_ready(vote, holdings, round=round, nonce=nonce, echo=echo)
    return Received(peer, _header(step, TAG_READY), body)


def _want(peer: str, hint: float, floor: float = 0.0) -> Received:
    return Received(peer, _header(0, TAG_WANT), torch.tensor([hint, floor], dtype=torch.float64))


def _done(peer: str, floor: float, sent: float) -> Received:
    return Received(peer, _header(0, TAG_DONE), torch.tensor([floor, sent], dtype=torch.float64))


class _Keeper:
    """A board over SHAPES whose members are MEMBERS, and the copies and WANTs it hands over."""

    def __init__(self, meeting=MEMBERS, keeping=MEMBERS) -> None:
        self.copies: list[Copy] = []
        self.wants: list[tuple[str, int, int]] = []
        self.aborts: list[tuple[str, Abort]] = []
        self.board = Board(
            shapes=SHAPES,
            is_member=MEMBERS.__contains__,
            on_copy=self.copies.append,
            on_want=lambda peer, hint, floor: self.wants.append((peer, hint, floor)),
            moves_from=meeting.__contains__,
            copies_from=keeping.__contains__,
            on_abort=lambda peer, abort: self.aborts.append((peer, abort)),
        )

    def put(self, *items: Received) -> None:
        for item in items:
            self.board.put(item)


# ----- READY bodies ---------------------------------------------------------------------------


def test_a_ready_body_round_trips() -> None:
    holdings = [Holding(12, 0, 7), Holding(10, 7, 20), Holding(2**40, 3, 2**33)]
    vote = float(0xABCDEF012345)  # 48 bits: exact in float64
    scales = [ScaleState(2.0**20, 17), None, ScaleState(1.0, 0)]
    nonce, echo = NONCE_LIMIT - 1, 2**47 + 5
    body = encode_ready(
        vote, holdings, round=3, hint=2**40 + 1, scales=scales, nonce=nonce, echo=echo
    )
    assert body.dtype == torch.float64
    assert _READY_HEAD == 4
    assert tuple(body.shape) == (READY_LEN,) == (4 + 5 * MAX_HOLDINGS + 2,)
    assert body[:4].tolist() == [vote, 3, 2**40 + 1, len(holdings)]
    assert body[4 + 5 * len(holdings) : -2].eq(-1).all()  # unused slots
    assert body[-2:].tolist() == [nonce, echo]
    held = (tuple(holdings), tuple(scales))
    assert decode_ready(body) == Ready(vote, 3, 2**40 + 1, *held, nonce=nonce, echo=echo)
    again = decode_ready(with_echo(body, echo=7))  # the same READY answering another meeting
    assert again == Ready(vote, 3, 2**40 + 1, *held, nonce=nonce, echo=7)
    assert decode_ready(encode_ready(3.0, [])) == Ready(3.0, 0, 0, ())  # round and hint default


def test_a_ready_body_carries_at_most_max_holdings() -> None:
    holdings = [Holding(step, 0, 4) for step in range(MAX_HOLDINGS + 3, 0, -1)]
    ready = decode_ready(encode_ready(1.0, holdings, round=1, hint=7))
    assert ready == Ready(1.0, 1, 7, tuple(holdings[:MAX_HOLDINGS]), (None,) * MAX_HOLDINGS)


def test_a_full_ready_body_claiming_one_holding_more_is_refused() -> None:
    full = encode_ready(1.0, [Holding(step, 0, 4) for step in range(1, MAX_HOLDINGS + 1)])
    assert len(decode_ready(full).holdings) == MAX_HOLDINGS
    assert decode_ready(_with(full, 3, MAX_HOLDINGS + 1)) is None


def _with(body: torch.Tensor, at: int, value: float) -> torch.Tensor:
    body = body.clone()
    body[at] = value
    return body


# Slots of the good body: 0 vote, 1 round = 1, 2 hint = 9, 3 count = 2, then
# (step, start, stop, scale, good) = (4, 2, 7, 2**16, 5) in 4-8 and (3, 0, 2, 0, 0) in 9-13
# (no scale); the rest -1.
@pytest.mark.parametrize(
    ("at", "value"),
    [
        (1, -1),  # negative round
        (1, 1.5),  # round not an integer
        (1, float("nan")),
        (1, float("inf")),
        (1, 2.0**62),  # past what the check accepts
        (2, -1),  # negative hint
        (2, 2.5),  # hint not an integer
        (2, float("nan")),
        (2, float("inf")),
        (2, 2.0**62),
        (3, MAX_HOLDINGS + 1),  # count out of range
        (3, -1),
        (3, 3),  # more holdings than listed: the third slot holds -1s
        (3, 1.5),  # count not an integer
        (3, float("nan")),
        (3, float("inf")),
        (4, 2.5),  # step not an integer
        (4, -4),  # negative step
        (5, -1),  # negative start
        (5, 9),  # start > stop
        (5, 7),  # start == stop
        (6, 2.0**62),  # past what the check accepts
        (6, float("nan")),
        (6, float("inf")),
        (10, 2),  # the second holding: start == stop
        (11, -1),  # the second holding: negative stop
        (7, 3.0 * 2**10),  # a loss scale that is not a power of two
        (7, 0.5),  # below 1
        (7, 2.0**121),  # above 2**120
        (7, float("nan")),
        (8, -1),  # negative good steps
        (8, 1.5),
        (13, 4),  # good steps with no scale
        (READY_LEN - 2, -1),  # negative nonce
        (READY_LEN - 2, 0.5),  # nonce not an integer
        (READY_LEN - 2, float(NONCE_LIMIT)),  # past 48 bits
        (READY_LEN - 2, float("nan")),
        (READY_LEN - 1, -3),  # negative echo
        (READY_LEN - 1, 2.5),
        (READY_LEN - 1, float(NONCE_LIMIT)),
        (READY_LEN - 1, float("inf")),
    ],
)
def test_a_malformed_ready_body_is_refused(at, value) -> None:
    holdings, scales = [Holding(4, 2, 7), Holding(3, 0, 2)], [ScaleState(2.0**16, 5), None]
    good = encode_ready(5.0, holdings, round=1, hint=9, scales=scales)
    assert decode_ready(good) == Ready(5.0, 1, 9, tuple(holdings), tuple(scales))
    assert decode_ready(_with(good, at, value)) is None


def test_a_ready_from_a_member_is_filed_by_vote_and_a_malformed_one_is_refused() -> None:
    keeper = _Keeper()
    board = keeper.board
    body = encode_ready(9.0, [Holding(4, 0, 3)], hint=6)
    keeper.put(Received("m1", _header(0, TAG_READY), body))
    keeper.put(Received("outsider", _header(0, TAG_READY), body))
    keeper.put(Received("m2", _header(0, TAG_READY), _with(body, 3, 1.5)))  # count 1.5
    keeper.put(Received("m2", _header(0, TAG_READY), _with(body, 1, -1)))  # round -1
    assert board.refused == 3
    want = {"m1": Ready(9.0, 0, 6, (Holding(4, 0, 3),), (None,))}
    assert board.ready_of(["m1", "m2", "outsider"], 9.0) == want
    assert board.ready_of(["m1"], 8.0) == {}  # another plan's vote
    board.forget(9.0)
    assert board.ready_of(["m1"], 9.0) == {}


def test_readys_are_filed_per_round_and_one_round_never_answers_for_another() -> None:
    keeper = _Keeper()
    board = keeper.board
    first, second = [Holding(4, 0, 3)], [Holding(4, 0, 3), Holding(9, 0, 5)]
    keeper.put(_ready("m1", 9.0, first, round=0), _ready("m2", 9.0, second, round=1))
    assert board.ready_of(["m1", "m2"], 9.0) == {"m1": Ready(9.0, 0, 0, tuple(first), (None,))}
    assert board.ready_of(["m1", "m2"], 9.0, round=0) == board.ready_of(["m1", "m2"], 9.0)
    n2 = (None, None)
    assert board.ready_of(["m1", "m2"], 9.0, round=1) == {"m2": Ready(9.0, 1, 0, tuple(second), n2)}
    # A member's round-1 READY sits beside its round-0 one; neither replaces the other.
    keeper.put(_ready("m1", 9.0, second, round=1))
    assert board.ready_of(["m1"], 9.0, round=0) == {"m1": Ready(9.0, 0, 0, tuple(first), (None,))}
    assert board.ready_of(["m1"], 9.0, round=1) == {"m1": Ready(9.0, 1, 0, tuple(second), n2)}
    assert board.ready_of(["m1", "m2"], 9.0, round=2) == {}
    # Within one round the newest READY wins.
    keeper.put(_ready("m1", 9.0, [Holding(5, 0, 3)], round=0))
    assert board.ready_of(["m1"], 9.0) == {"m1": Ready(9.0, 0, 0, (Holding(5, 0, 3),), (None,))}


def test_forget_drops_every_round_of_its_vote_and_only_of_its_vote() -> None:
    keeper = _Keeper()
    board = keeper.board
    keeper.put(_ready("m1", 9.0, [], round=0), _ready("m1", 9.0, [], round=1))
    keeper.put(_ready("m2", 8.0, [], round=0), _ready("m2", 8.0, [], round=1))
    board.forget(9.0)
    for round in (0, 1):
        assert board.ready_of(["m1", "m2"], 9.0, round=round) == {}
        assert board.ready_of(["m1", "m2"], 8.0, round=round) == {"m2": Ready(8.0, round, 0, ())}


def test_wait_sees_a_ready_only_in_its_round() -> None:
    keeper = _Keeper()
    board = keeper.board
    keeper.put(_ready("m1", 9.0, [], round=1))
    assert not board.wait(lambda: "m1" in board.ready_of(["m1"], 9.0, round=0), 0.05)
    assert board.wait(lambda: "m1" in board.ready_of(["m1"], 9.0, round=1), 0.05)


def test_a_late_resend_from_an_earlier_meeting_never_counts_for_the_next_one() -> None:
    """The plan is served twice: m1's READY of the first meeting (echoing our first nonce 11)
    arrives again after the board forgot that meeting; the second meeting (nonce 22) must not
    take it, or the members would choose the start from different holdings."""
    keeper = _Keeper()
    board = keeper.board
    old = [Holding(4, 0, 3)]
    keeper.put(_ready("m1", 9.0, old, nonce=101, echo=11))
    assert board.ready_of(["m1"], 9.0, echo=11) == {
        "m1": Ready(9.0, 0, 0, (old[0],), (None,), 101, 11)
    }
    board.forget(9.0)
    keeper.put(_ready("m1", 9.0, old, nonce=101, echo=11))  # the late resend
    assert board.ready_of(["m1"], 9.0, echo=22) == {}
    assert board.heard("m1", 9.0) == 101  # what our READY to m1 echoes until it says more
    new = [Holding(6, 0, 3)]
    keeper.put(_ready("m1", 9.0, new, nonce=202, echo=22))
    keeper.put(_ready("m1", 9.0, old, nonce=101, echo=11))  # another late one: replaces nothing
    want = {"m1": Ready(9.0, 0, 0, (new[0],), (None,), 202, 22)}
    assert board.ready_of(["m1"], 9.0, echo=22) == want
    assert board.heard("m1", 9.0) == 101
    assert board.heard("m1", 8.0) == 0


def test_readys_kept_per_peer_and_round_are_bounded_newest_first() -> None:
    keeper = _Keeper()
    board = keeper.board
    for echo in range(1, 20):  # a member naming many meetings: only the newest few are kept
        keeper.put(_ready("m1", 9.0, [], nonce=5, echo=echo))
    kept = [e for e in range(1, 20) if board.ready_of(["m1"], 9.0, echo=e)]
    assert kept == [16, 17, 18, 19]


# ----- ABORT ----------------------------------------------------------------------------------


def test_a_members_abort_is_handed_on_and_a_bad_one_refused() -> None:
    keeper = _Keeper()
    body = encode_abort(float(0xABCDEF012345), 2**47, 12)
    assert tuple(body.shape) == (3,)
    assert body.dtype == torch.float64
    assert keeper.board.expect(_header(12, TAG_ABORT)) == TensorSpec(torch.float64, (3,))
    keeper.put(Received("m1", _header(12, TAG_ABORT), body))
    keeper.put(Received("outsider", _header(12, TAG_ABORT), body))
    keeper.put(Received("m2", _header(12, TAG_ABORT), body.float()))  # the wrong dtype
    keeper.put(Received("m2", _header(12, TAG_ABORT), torch.zeros(4, dtype=torch.float64)))
    assert keeper.aborts == [("m1", Abort(float(0xABCDEF012345), 2**47, 12))]
    assert keeper.board.refused == 3


@pytest.mark.parametrize(
    "values",
    [
        (-1.0, 5, 1),  # a negative vote
        (float("nan"), 5, 1),
        (2.0**53, 5, 1),  # a vote past what float64 holds exactly
        (1.0, 0, 1),  # echo 0: it names no meeting
        (1.0, NONCE_LIMIT, 1),
        (1.0, 2.5, 1),
        (1.0, 5, -1),  # a negative step
        (1.0, 5, float("inf")),
        (1.0, 5, 0.5),
    ],
)
def test_a_malformed_abort_is_refused(values) -> None:
    keeper = _Keeper()
    body = torch.tensor(values, dtype=torch.float64)
    assert decode_abort(body) is None
    keeper.put(Received("m1", _header(0, TAG_ABORT), body))
    assert keeper.aborts == []
    assert keeper.board.refused == 1


# ----- WANT -----------------------------------------------------------------------------------


def test_a_members_want_is_handed_on_with_its_hint_and_floor() -> None:
    keeper = _Keeper()
    keeper.put(_want("m1", 7.0, 3.0), _want("m2", 0.0), _want("m1", float(2**40), 20.0))
    assert keeper.wants == [("m1", 7, 3), ("m2", 0, 0), ("m1", 2**40, 20)]
    assert all(type(hint) is int and type(floor) is int for _, hint, floor in keeper.wants)
    assert keeper.board.refused == 0


def test_a_want_from_a_non_member_is_refused() -> None:
    keeper = _Keeper()
    keeper.put(_want("outsider", 7.0))
    assert keeper.wants == []
    assert keeper.board.refused == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 1.5, 2.0**62])
def test_a_malformed_want_is_refused(bad) -> None:
    keeper = _Keeper()
    keeper.put(_want("m1", bad), _want("m1", 5.0, bad))
    assert keeper.wants == []
    assert keeper.board.refused == 2


@pytest.mark.parametrize("tag", [TAG_WANT, TAG_DONE, TAG_READY, TAG_MANIFEST])
@pytest.mark.parametrize("shape", [(0,), (1,), (3,), (2, 2)])
def test_a_board_frame_of_the_wrong_shape_is_refused_not_raised(tag, shape) -> None:
    """The transport checks shapes against ``expect``; the board does not rely on it."""
    keeper = _Keeper()
    keeper.put(Received("m1", _header(0, tag), torch.zeros(shape, dtype=torch.float64)))
    assert keeper.wants == []
    assert keeper.copies == []
    assert keeper.board.refused == 1


# ----- DONE -----------------------------------------------------------------------------------


def test_done_counts_once_the_copies_it_announces_are_filed() -> None:
    board = _Keeper().board
    board.reset_done(["m1", "m2"])
    board.put(_done("m1", 20.0, 2.0))
    board.put(_done("m2", 20.0, 0.0))
    assert board.done_of(["m1", "m2"], 20) == {"m2"}  # m1's two copies are still on their way
    board.filed("m1")
    assert board.done_of(["m1", "m2"], 20) == {"m2"}
    board.filed("m1")
    assert board.done_of(["m1", "m2"], 20) == {"m1", "m2"}
    assert board.done_of(["m1", "m2"], 19) == set()  # an answer to another WANT


def test_done_answers_are_reset_before_a_new_want_and_after_a_meeting() -> None:
    board = _Keeper().board
    board.reset_done(["m1"])
    board.put(_done("m1", 20.0, 0.0))
    board.reset_done(["m1"])
    assert board.done_of(["m1"], 20) == set()
    board.put(_done("m1", 20.0, 1.0))
    board.filed("m1")
    board.forget(9.0)
    assert board.done_of(["m1"], 20) == set()


def test_a_done_wakes_a_waiter() -> None:
    board = _Keeper().board
    board.reset_done(["m1"])
    timer = threading.Timer(0.05, board.put, [_done("m1", 4.0, 0.0)])
    timer.start()
    assert board.wait(lambda: board.done_of(["m1"], 4) == {"m1"}, 5.0)
    timer.join()


@pytest.mark.parametrize("bad", [(float("nan"), 0.0), (4.0, -1.0), (4.0, 9.0), (-1.0, 0.0)])
def test_a_malformed_or_non_member_done_is_refused(bad) -> None:
    board = _Keeper().board
    board.reset_done(["m1", "outsider"])
    board.put(_done("m1", *bad))
    board.put(_done("outsider", 4.0, 0.0))
    assert board.done_of(["m1", "outsider"], int(bad[0]) if bad[0] == bad[0] else 0) == set()
    assert board.refused == 2


def test_only_the_members_asked_may_answer() -> None:
    board = _Keeper().board
    board.put(_done("m1", 4.0, 0.0))  # asked nothing yet
    board.reset_done(["m2"])
    board.put(_done("m1", 4.0, 0.0))  # a member, not asked
    board.put(_done("m2", 4.0, 0.0))
    assert board.done_of(["m1", "m2"], 4) == {"m2"}
    assert board.refused == 2


# ----- expectations ---------------------------------------------------------------------------


def test_the_board_expects_its_frames_shapes_and_nothing_else() -> None:
    board = _Keeper().board
    assert board.expect(_header(0, TAG_READY)) == TensorSpec(torch.float64, (READY_LEN,))
    assert board.expect(_header(0, TAG_MANIFEST)) == TensorSpec(torch.float64, (MANIFEST_LEN,))
    assert board.expect(_header(0, TAG_WANT)) == TensorSpec(torch.float64, (2,))
    assert board.expect(_header(0, TAG_DONE)) == TensorSpec(torch.float64, (2,))
    assert is_board_frame(_header(0, TAG_WANT))
    assert is_board_frame(_header(0, TAG_DONE))
    for tag in (TAG_STATE, TAG_CUSTODY):
        for index, name in enumerate(NAMES):
            spec = board.expect(_header(3, tag + index))
            assert spec.dtype == torch.float32
            assert spec.shape == tuple(_part_tensor(name, 0.0).shape)
        beyond = board.expect(_header(3, tag + len(NAMES)))
        assert beyond.shape == (-1,)  # no tensor has it: the transport refuses the frame
    assert board.expect(_header(0, 5)) is None
    assert not is_board_frame(_header(0, 5))
    for tag in (TAG_READY, TAG_WANT, TAG_DONE):
        data = FrameHeader(step=0, micro_batch=tag, kind=FrameKind.ACTIVATION, stage=0)
        assert board.expect(data) is None  # a board tag on a data frame is not the board's
        assert not is_board_frame(data)


# ----- custody --------------------------------------------------------------------------------


def _check_copy(copy: Copy, peer: str, holding: Holding, digest48: int, values: dict) -> None:
    assert (copy.peer, copy.holding, copy.digest48) == (peer, holding, digest48)
    assert sorted(copy.state) == sorted(values)
    for name, value in values.items():
        assert torch.equal(copy.state[name], _part_tensor(name, value))


def test_custody_parts_then_a_matching_manifest_make_one_copy() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w", 1.0), _part("m1", 6, "b", 2.0), _part("m1", 6, "g", 3.0))
    assert keeper.copies == []  # nothing before the manifest
    keeper.put(_manifest("m1", 6, 0, 5, count=3, digest48=123456789))
    assert len(keeper.copies) == 1
    _check_copy(keeper.copies[0], "m1", Holding(6, 0, 5), 123456789, {"w": 1, "b": 2, "g": 3})
    # The parts were used up: the same manifest again makes nothing.
    keeper.put(_manifest("m1", 6, 0, 5, count=3, digest48=123456789))
    assert len(keeper.copies) == 1
    assert keeper.board.refused == 0


def test_a_copys_loss_scale_comes_with_it() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w"))
    keeper.put(_manifest("m1", 6, 0, 5, count=1, scale=(2.0**18, 40)))
    assert [c.scale for c in keeper.copies] == [ScaleState(2.0**18, 40)]


def test_a_manifest_first_waits_for_its_parts() -> None:
    keeper = _Keeper()
    keeper.put(_manifest("m1", 6, 0, 5, count=3, digest48=42))
    keeper.put(_part("m1", 6, "g", 3.0), _part("m1", 6, "w", 1.0))
    assert keeper.copies == []  # one part still to come
    keeper.put(_part("m1", 6, "b", 2.0))
    assert len(keeper.copies) == 1
    _check_copy(keeper.copies[0], "m1", Holding(6, 0, 5), 42, {"w": 1, "b": 2, "g": 3})
    # Used up: a late duplicate part only starts a new pending copy, with no manifest.
    keeper.put(_part("m1", 6, "b", 2.0))
    assert len(keeper.copies) == 1
    assert keeper.board.refused == 0


def test_a_manifest_between_its_parts_completes_with_the_last_part() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w", 1.0))
    keeper.put(_manifest("m1", 6, 2, 4, count=2, digest48=5))
    assert keeper.copies == []
    keeper.put(_part("m1", 6, "g", 3.0))
    assert len(keeper.copies) == 1
    _check_copy(keeper.copies[0], "m1", Holding(6, 2, 4), 5, {"w": 1, "g": 3})


def test_copies_come_only_from_the_plan_we_keep_for_or_the_nodes_we_asked() -> None:
    keeper = _Keeper(keeping={"m1"})
    copy = [_part("m2", 10, "w"), _part("m2", 10, "b"), _manifest("m2", 10, 0, 5, count=2)]
    keeper.put(*copy)  # a member, but not of our plan: three frames refused
    assert (keeper.copies, keeper.board.refused) == ([], 3)
    keeper.board.reset_done(["m2"])  # we asked it for state: its answer counts
    keeper.put(*copy)
    assert [(c.peer, c.holding) for c in keeper.copies] == [("m2", Holding(10, 0, 5))]


def test_a_missing_part_holds_the_copy_back_until_it_comes() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w"), _part("m1", 6, "b"))
    keeper.put(_manifest("m1", 6, 0, 5, count=3))  # a part has not come yet
    assert keeper.copies == []
    keeper.put(_part("m1", 6, "g"))
    assert [sorted(c.state) for c in keeper.copies] == [["b", "g", "w"]]


def test_more_parts_than_the_manifest_says_drop_the_copy(caplog) -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 7, "w"), _part("m1", 7, "b"), _part("m1", 7, "g"))
    with caplog.at_level(logging.WARNING, logger="fusionllm"):
        keeper.put(_manifest("m1", 7, 0, 5, count=2))  # one part too many
    assert keeper.copies == []
    assert "manifest says 2" in caplog.text
    assert keeper.board.refused == 0  # dropped, not refused
    # The parts went with it: a manifest of the right count finds none.
    keeper.put(_manifest("m1", 7, 0, 5, count=3))
    assert keeper.copies == []


def test_a_manifest_for_another_step_than_its_header_is_refused_and_the_parts_wait() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w"))
    keeper.put(_manifest("m1", 6, 0, 5, count=1, header_step=7))
    assert keeper.copies == []
    assert keeper.board.refused == 1
    keeper.put(_part("m1", 7, "w"))  # the header's step has no manifest either
    assert keeper.copies == []
    keeper.put(_manifest("m1", 6, 0, 5, count=1))
    assert [c.holding for c in keeper.copies] == [Holding(6, 0, 5)]


def test_a_manifest_counting_more_parts_than_there_are_names_is_refused() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w"), _part("m1", 6, "b"), _part("m1", 6, "g"))
    keeper.put(_manifest("m1", 6, 0, 5, count=len(NAMES) + 1))
    assert keeper.copies == []
    assert keeper.board.refused == 1
    keeper.put(_manifest("m1", 6, 0, 5, count=len(NAMES)))  # the parts still wait
    assert [sorted(c.state) for c in keeper.copies] == [NAMES]
    assert keeper.board.refused == 1


def test_parts_of_one_peer_never_complete_another_peers_copy() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w", 1.0), _part("m2", 6, "b", 2.0))
    keeper.put(_manifest("m1", 6, 0, 5, count=2))
    assert keeper.copies == []
    keeper.put(_manifest("m2", 6, 0, 5, count=1))
    assert [(c.peer, sorted(c.state)) for c in keeper.copies] == [("m2", ["b"])]
    keeper.put(_part("m2", 6, "g"))  # m2's new part is not m1's
    assert len(keeper.copies) == 1
    keeper.put(_part("m1", 6, "g"))
    assert [(c.peer, sorted(c.state)) for c in keeper.copies[1:]] == [("m1", ["g", "w"])]


@pytest.mark.parametrize(
    "values",
    [
        [6, 5, 5, 1, 77, 0, 0],  # start == stop
        [6, 5, 2, 1, 77, 0, 0],  # start > stop
        [6, -1, 5, 1, 77, 0, 0],  # negative
        [6, 0, 5, 1.5, 77, 0, 0],  # not an integer
        [6, 0, 5, 1, float("nan"), 0, 0],
        [6, 0, 5, float("inf"), 77, 0, 0],
        [float("nan"), 0, 5, 1, 77, 0, 0],
        [6, 0, 5, 1, 77, 3.0, 0],  # a loss scale that is not a power of two
        [6, 0, 5, 1, 77, 2.0**16, -1],  # negative good steps
        [6, 0, 5, 1, 77, 0, 7],  # good steps without a scale
    ],
)
def test_a_malformed_manifest_is_refused_and_the_parts_wait_for_a_good_one(values) -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w"))
    keeper.put(Received("m1", _header(6, TAG_MANIFEST), torch.tensor(values, dtype=torch.float64)))
    assert keeper.board.refused == 1
    assert keeper.copies == []
    keeper.put(_manifest("m1", 6, 0, 5, count=1))
    assert [c.holding for c in keeper.copies] == [Holding(6, 0, 5)]


def test_custody_frames_from_non_members_are_refused() -> None:
    keeper = _Keeper()
    keeper.put(_part("outsider", 6, "w"), _part("outsider", 6, "b"))
    keeper.put(_manifest("outsider", 6, 0, 5, count=2))
    assert keeper.board.refused == 3
    assert keeper.copies == []
    # A member's copy of the same step is unaffected.
    keeper.put(_part("m1", 6, "w"))
    keeper.put(_manifest("m1", 6, 0, 5, count=1))
    assert [(c.peer, sorted(c.state)) for c in keeper.copies] == [("m1", ["w"])]


def test_unfinished_copies_are_bounded_per_peer_the_oldest_goes() -> None:
    assert _PENDING_COPIES_PER_PEER == 2
    keeper = _Keeper()
    keeper.put(_part("m2", 1, "g"))  # another peer's unfinished copy
    for step in (2, 4, 6):  # three unfinished copies from m1: step 2's is dropped
        keeper.put(_part("m1", step, "w"), _part("m1", step, "b"))
    keeper.put(_manifest("m1", 4, 0, 5, count=2), _manifest("m1", 6, 0, 5, count=2))
    keeper.put(_manifest("m1", 2, 0, 5, count=2))  # its parts are gone
    keeper.put(_manifest("m2", 1, 5, 9, count=1))
    assert [(c.peer, c.holding.step) for c in keeper.copies] == [("m1", 4), ("m1", 6), ("m2", 1)]
    # More parts of a copy already pending do not count as another copy.
    keeper.put(_part("m1", 8, "w"), _part("m1", 10, "w"), _part("m1", 8, "b"))
    keeper.put(_manifest("m1", 8, 0, 5, count=2), _manifest("m1", 10, 0, 5, count=1))
    assert [c.holding.step for c in keeper.copies[3:]] == [8, 10]


def test_an_early_manifest_goes_with_its_copy_when_the_bound_drops_it() -> None:
    keeper = _Keeper()
    keeper.put(_manifest("m1", 2, 0, 5, count=2), _part("m1", 2, "w"))  # waits for "b"
    keeper.put(_part("m1", 4, "w"), _part("m1", 6, "w"))  # step 2's copy is the oldest: dropped
    keeper.put(_part("m1", 2, "w"), _part("m1", 2, "b"))  # step 2 again, its manifest gone
    assert keeper.copies == []
    keeper.put(_manifest("m1", 6, 0, 5, count=1))
    assert [c.holding.step for c in keeper.copies] == [6]


def test_early_manifests_are_bounded_per_peer_too() -> None:
    keeper = _Keeper()
    for step in range(1, 11):  # ten manifests whose parts never come
        keeper.put(_manifest("m1", step, 0, 5, count=2))
    keeper.put(_part("m1", 11, "w"))
    assert len([k for k in keeper.board._parts if k[0] == "m1"]) == _PENDING_COPIES_PER_PEER
    assert len([k for k in keeper.board._manifests if k[0] == "m1"]) < _PENDING_COPIES_PER_PEER
    # The newest early manifest still waits for its parts; the older ones made room.
    keeper.put(_part("m1", 10, "w"), _part("m1", 10, "b"))
    keeper.put(_part("m1", 1, "w"), _part("m1", 1, "b"))
    assert [c.holding.step for c in keeper.copies] == [10]


# ----- moved state ----------------------------------------------------------------------------


def test_state_frames_are_taken_per_step_once_every_name_is_there() -> None:
    keeper = _Keeper()
    board = keeper.board
    keeper.put(Received("m1", _header(5, TAG_STATE + NAMES.index("w")), _part_tensor("w", 4.0)))
    assert board.missing_state(5, ["w", "b"]) == ["b"]
    assert board.take_state(5, ["w", "b"]) is None
    keeper.put(Received("m2", _header(5, TAG_STATE + NAMES.index("b")), _part_tensor("b", 2.0)))
    keeper.put(Received("outsider", _header(5, TAG_STATE), _part_tensor("b", 9.0)))
    assert board.refused == 1
    taken = board.take_state(5, ["w", "b"])
    assert torch.equal(taken["w"], _part_tensor("w", 4.0))
    assert torch.equal(taken["b"], _part_tensor("b", 2.0))
    assert board.take_state(5, ["w"]) is None  # taken means removed


def test_only_the_plan_we_meet_may_move_state_to_us() -> None:
    keeper = _Keeper(meeting={"m1"})
    keeper.put(Received("m2", _header(5, TAG_STATE), _part_tensor("b", 2.0)))  # a member, not ours
    assert keeper.board.refused == 1
    assert keeper.board.missing_state(5, ["b"]) == ["b"]
    keeper.put(Received("m1", _header(5, TAG_STATE), _part_tensor("b", 2.0)))
    assert keeper.board.missing_state(5, ["b"]) == []


def test_forget_drops_moved_state_before_a_step_only() -> None:
    keeper = _Keeper()
    board = keeper.board
    for step in (3, 5):
        keeper.put(Received("m1", _header(step, TAG_STATE), _part_tensor("b", float(step))))
    board.forget(1.0)  # no step given: the state stays
    assert board.missing_state(3, ["b"]) == board.missing_state(5, ["b"]) == []
    board.forget(1.0, before_step=5)
    assert board.missing_state(3, ["b"]) == ["b"]
    assert board.missing_state(5, ["b"]) == []
