"""The board between plans (``board.py``): READY bodies encoded and decoded (and malformed ones
refused), and the custody path: CUSTODY parts, then a MANIFEST, make one ``Copy`` only when
they agree; frames from non-members are refused; unfinished copies per peer are bounded.

Frames are built as the router hands them over (``Received``), with no transport.
"""

import pytest
import torch

from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import Received
from fusionllm.node.training.board import (
    _PENDING_COPIES_PER_PEER,
    MANIFEST_LEN,
    READY_LEN,
    TAG_CUSTODY,
    TAG_MANIFEST,
    TAG_READY,
    TAG_STATE,
    Board,
    Copy,
    Ready,
    decode_ready,
    encode_ready,
    is_board_frame,
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
              header_step: int | None = None) -> Received:  # fmt: skip
    body = torch.tensor([step, start, stop, count, digest48], dtype=torch.float64)
    return Received(peer, _header(step if header_step is None else header_step, TAG_MANIFEST), body)


class _Keeper:
    """A board over SHAPES whose members are MEMBERS, and the copies it hands over."""

    def __init__(self) -> None:
        self.copies: list[Copy] = []
        self.board = Board(
            shapes=SHAPES, is_member=MEMBERS.__contains__, on_copy=self.copies.append
        )

    def put(self, *items: Received) -> None:
        for item in items:
            self.board.put(item)


# ----- READY bodies ---------------------------------------------------------------------------


def test_a_ready_body_round_trips() -> None:
    holdings = [Holding(12, 0, 7), Holding(10, 7, 20), Holding(2**40, 3, 2**33)]
    vote = float(0xABCDEF012345)  # 48 bits: exact in float64
    body = encode_ready(vote, holdings)
    assert body.dtype == torch.float64
    assert tuple(body.shape) == (READY_LEN,) == (2 + 3 * MAX_HOLDINGS,)
    assert body[2 + 3 * len(holdings) :].eq(-1).all()  # unused slots
    assert decode_ready(body) == Ready(vote, tuple(holdings))
    assert decode_ready(encode_ready(3.0, [])) == Ready(3.0, ())


def test_a_ready_body_carries_at_most_max_holdings() -> None:
    holdings = [Holding(step, 0, 4) for step in range(MAX_HOLDINGS + 3, 0, -1)]
    ready = decode_ready(encode_ready(1.0, holdings))
    assert ready == Ready(1.0, tuple(holdings[:MAX_HOLDINGS]))


def test_a_full_ready_body_claiming_one_holding_more_is_refused() -> None:
    full = encode_ready(1.0, [Holding(step, 0, 4) for step in range(1, MAX_HOLDINGS + 1)])
    assert len(decode_ready(full).holdings) == MAX_HOLDINGS
    assert decode_ready(_with(full, 1, MAX_HOLDINGS + 1)) is None


def _with(body: torch.Tensor, at: int, value: float) -> torch.Tensor:
    body = body.clone()
    body[at] = value
    return body


# Slots of the good body: 0 vote, 1 count = 2, then (step, start, stop) = (4, 2, 7) in 2-4 and
# (3, 0, 2) in 5-7; the rest -1.
@pytest.mark.parametrize(
    ("at", "value"),
    [
        (1, MAX_HOLDINGS + 1),  # count out of range
        (1, -1),
        (1, 3),  # more holdings than listed: the third slot holds -1s
        (1, 1.5),  # count not an integer
        (1, float("nan")),
        (1, float("inf")),
        (2, 2.5),  # step not an integer
        (2, -4),  # negative step
        (3, -1),  # negative start
        (3, 9),  # start > stop
        (3, 7),  # start == stop
        (4, 2.0**62),  # past what the check accepts
        (4, float("nan")),
        (4, float("inf")),
        (6, 2),  # the second holding: start == stop
    ],
)
def test_a_malformed_ready_body_is_refused(at, value) -> None:
    good = encode_ready(5.0, [Holding(4, 2, 7), Holding(3, 0, 2)])
    assert decode_ready(good) == Ready(5.0, (Holding(4, 2, 7), Holding(3, 0, 2)))
    assert decode_ready(_with(good, at, value)) is None


def test_a_ready_from_a_member_is_filed_by_vote_and_a_malformed_one_is_refused() -> None:
    keeper = _Keeper()
    board = keeper.board
    body = encode_ready(9.0, [Holding(4, 0, 3)])
    keeper.put(Received("m1", _header(0, TAG_READY), body))
    keeper.put(Received("outsider", _header(0, TAG_READY), body))
    keeper.put(Received("m2", _header(0, TAG_READY), _with(body, 1, 1.5)))
    assert board.refused == 2
    assert board.ready_of(["m1", "m2", "outsider"], 9.0) == {"m1": Ready(9.0, (Holding(4, 0, 3),))}
    assert board.ready_of(["m1"], 8.0) == {}  # another plan's vote
    board.forget(9.0)
    assert board.ready_of(["m1"], 9.0) == {}


# ----- expectations ---------------------------------------------------------------------------


def test_the_board_expects_its_frames_shapes_and_nothing_else() -> None:
    board = _Keeper().board
    assert board.expect(_header(0, TAG_READY)).shape == (READY_LEN,)
    assert board.expect(_header(0, TAG_MANIFEST)).shape == (MANIFEST_LEN,)
    for tag in (TAG_STATE, TAG_CUSTODY):
        for index, name in enumerate(NAMES):
            spec = board.expect(_header(3, tag + index))
            assert spec.dtype == torch.float32
            assert spec.shape == tuple(_part_tensor(name, 0.0).shape)
        beyond = board.expect(_header(3, tag + len(NAMES)))
        assert beyond.shape == (-1,)  # no tensor has it: the transport refuses the frame
    assert board.expect(_header(0, 5)) is None
    assert not is_board_frame(_header(0, 5))
    activation = FrameHeader(step=0, micro_batch=TAG_READY, kind=FrameKind.ACTIVATION, stage=0)
    assert board.expect(activation) is None  # a READY tag on a data frame is not the board's


# ----- custody --------------------------------------------------------------------------------


def test_custody_parts_then_a_matching_manifest_make_one_copy() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w", 1.0), _part("m1", 6, "b", 2.0), _part("m1", 6, "g", 3.0))
    assert keeper.copies == []  # nothing before the manifest
    keeper.put(_manifest("m1", 6, 0, 5, count=3, digest48=123456789))
    assert len(keeper.copies) == 1
    copy = keeper.copies[0]
    assert (copy.peer, copy.holding, copy.digest48) == ("m1", Holding(6, 0, 5), 123456789)
    assert sorted(copy.state) == ["b", "g", "w"]
    for name, value in [("w", 1.0), ("b", 2.0), ("g", 3.0)]:
        assert torch.equal(copy.state[name], _part_tensor(name, value))
    # The parts were used up: the same manifest again makes nothing.
    keeper.put(_manifest("m1", 6, 0, 5, count=3, digest48=123456789))
    assert len(keeper.copies) == 1
    assert keeper.board.refused == 0


def test_a_manifest_whose_count_differs_drops_the_copy() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w"), _part("m1", 6, "b"))
    keeper.put(_manifest("m1", 6, 0, 5, count=3))  # a part went missing
    assert keeper.copies == []
    keeper.put(_manifest("m1", 6, 0, 5, count=2))  # the parts went with the failed manifest
    assert keeper.copies == []
    keeper.put(_part("m1", 7, "w"), _part("m1", 7, "b"), _part("m1", 7, "g"))
    keeper.put(_manifest("m1", 7, 0, 5, count=2))  # one part too many
    assert keeper.copies == []


def test_a_manifest_for_another_step_than_its_header_drops_the_copy() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w"))
    keeper.put(_manifest("m1", 6, 0, 5, count=1, header_step=7))
    assert keeper.copies == []


def test_parts_of_one_peer_never_complete_another_peers_copy() -> None:
    keeper = _Keeper()
    keeper.put(_part("m1", 6, "w", 1.0), _part("m2", 6, "b", 2.0))
    keeper.put(_manifest("m1", 6, 0, 5, count=2))
    assert keeper.copies == []
    keeper.put(_manifest("m2", 6, 0, 5, count=1))
    assert [(c.peer, sorted(c.state)) for c in keeper.copies] == [("m2", ["b"])]


@pytest.mark.parametrize(
    "values",
    [
        [6, 5, 5, 1, 77],  # start == stop
        [6, 5, 2, 1, 77],  # start > stop
        [6, -1, 5, 1, 77],  # negative
        [6, 0, 5, 1.5, 77],  # not an integer
        [6, 0, 5, 1, float("nan")],
        [6, 0, 5, float("inf"), 77],
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
    keeper.put(_manifest("m1", 2, 0, 5, count=2))
    assert keeper.copies == []
    keeper.put(_manifest("m1", 4, 0, 5, count=2), _manifest("m1", 6, 0, 5, count=2))
    keeper.put(_manifest("m2", 1, 5, 9, count=1))
    assert [(c.peer, c.holding.step) for c in keeper.copies] == [("m1", 4), ("m1", 6), ("m2", 1)]
    # More parts of a copy already pending do not count as another copy.
    keeper.put(_part("m1", 8, "w"), _part("m1", 10, "w"), _part("m1", 8, "b"))
    keeper.put(_manifest("m1", 8, 0, 5, count=2), _manifest("m1", 10, 0, 5, count=1))
    assert [c.holding.step for c in keeper.copies[3:]] == [8, 10]


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
