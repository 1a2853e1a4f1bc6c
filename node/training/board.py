"""Frames between plans: ready announcements and moved state, filed on the ``Board``.

The node's router (router.py) hands READY and STATE frames here (kept across plans, from
members only); everything else goes to the current session's mailbox.

READY (control tag ``TAG_READY``): float64 ``[vote, round, hint, n, (step, start, stop, scale,
good) x MAX_HOLDINGS, nonce, echo]``: the sender built its stage of the plan with that vote and,
in that round of the meeting, holds the n ``Holding``s listed (unused slots are -1), each with
fp16's loss scale state at its step (``ScaleState``; 0, 0 when it has none); ``hint`` is the
newest step the swarm's records show it reached. ``nonce`` names the sender's meeting (each
time it serves a plan, a new one); ``echo`` is the newest nonce it heard from the receiver (0:
none). A meeting counts only READYs that echo its own nonce: a late resend from a meeting
of the same plan served before is filed, but never taken for this one. A READY whose header
step is ``READY_ANSWER`` answers one (a member that already met hears a peer still waiting):
it is filed, never answered.
ABORT (``TAG_ABORT``, float64 ``[vote, echo, step]``): the sender abandoned that step of the
meeting ``echo`` names (the receiver's nonce): stop waiting for it now, not at the step timeout.
WANT (``TAG_WANT``, float64 ``[hint, floor]``): a plan member asks a node outside the plan for
copies of the newest state it holds after step ``floor`` (the newest step the plan's members hold
in full, which is less than the swarm reached).
DONE (``TAG_DONE``, float64 ``[floor, sent]``): the answer to WANT, sent after the ``sent`` copies
it gave; the asker waits for those to be filed, not out a deadline for state nobody has.
STATE (control tag ``TAG_STATE + i``, i the parameter's index in sorted canonical names):
one parameter and its AdamW state (``StageWorker.export_state``), for the step in the header.
CUSTODY (``TAG_CUSTODY + i``, same body) and MANIFEST (``TAG_MANIFEST``, float64 ``[step,
start, stop, count, digest48, scale, good]``): a copy of a peer's stage state to keep (its
checkpoint, or its state as it leaves), with its loss scale state (0, 0: none); the parts are
kept only once the manifest's count and digest match.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusionllm.common.logs import get_logger
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import Received, TensorSpec
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.training.holdings import MAX_HOLDINGS, Holding

logger = get_logger(__name__)

TAG_READY = 1 << 24
TAG_MANIFEST = TAG_READY + 1
TAG_WANT = TAG_READY + 2
TAG_DONE = TAG_READY + 3
TAG_ABORT = TAG_READY + 4
TAG_STATE = 1 << 25  # + parameter index
TAG_CUSTODY = 1 << 26  # + parameter index
READY_ANSWER = 1  # the header step of a READY that answers one
_READY_HEAD = 4
_ENTRY = 5  # step, start, stop, scale, good steps
_NONCE_AT = _READY_HEAD + _ENTRY * MAX_HOLDINGS  # then the echo
READY_LEN = _NONCE_AT + 2
NONCE_LIMIT = 2**48  # nonces are 1..2**48-1 (exact in float64); 0 means "none heard"
_ECHOES_PER_KEY = 4  # READYs kept per (peer, round): one per meeting they echo, newest
MANIFEST_LEN = 7
_PENDING_COPIES_PER_PEER = 2
_NEVER = TensorSpec(dtype=torch.float32, shape=(-1,))  # matches nothing: the frame is refused
_POLL_S = 0.2


@dataclass(frozen=True)
class Ready:
    vote: float
    round: int  # of the meeting: holdings may grow between rounds, never within one
    hint: int  # the newest step the sender's records show the swarm reached
    holdings: tuple[Holding, ...]  # what the sender can supply, in its order of preference
    scales: tuple[ScaleState | None, ...] = ()  # fp16's loss scale at each holding's step
    nonce: int = 0  # the sender's meeting
    echo: int = 0  # the receiver's meeting it answers (0: it heard none yet)


@dataclass(frozen=True)
class Abort:
    vote: float
    echo: int  # the receiver's meeting nonce
    step: int


@dataclass(frozen=True)
class Copy:
    """A peer's stage state handed to us for keeping, verified against its manifest."""

    peer: str
    holding: Holding
    state: dict[str, torch.Tensor]
    digest48: int
    scale: ScaleState | None = None


def encode_ready(
    vote: float,
    holdings: list[Holding],
    *,
    round: int = 0,
    hint: int = 0,
    scales: list[ScaleState | None] | None = None,
    nonce: int = 0,
    echo: int = 0,
):
    """A READY body: float64 (READY_LEN,); ``scales`` per holding (default: none known)."""
    body = torch.full((READY_LEN,), -1.0, dtype=torch.float64)
    listed = holdings[:MAX_HOLDINGS]
    scales = scales if scales is not None else [None] * len(listed)
    body[:_READY_HEAD] = torch.tensor([vote, round, hint, len(listed)], dtype=torch.float64)
    for i, (h, scale) in enumerate(zip(listed, scales, strict=False)):
        at = _READY_HEAD + _ENTRY * i
        entry = [h.step, h.start, h.stop, *(scale or _NO_SCALE)]
        body[at : at + _ENTRY] = torch.tensor(entry, dtype=torch.float64)
    return with_echo(body, nonce=nonce, echo=echo)


def with_echo(body: torch.Tensor, *, echo: int, nonce: int | None = None) -> torch.Tensor:
    """A copy of a READY body that echoes ``echo`` (and carries ``nonce`` if given)."""
    body = body.clone()
    if nonce is not None:
        body[_NONCE_AT] = float(nonce)
    body[_NONCE_AT + 1] = float(echo)
    return body


_NO_SCALE = (0.0, 0.0)


def scale_slots(values: list[float]) -> ScaleState | bool | None:
    """A peer's (scale, good) pair: the state, None for "none", False if malformed."""
    if tuple(values) == _NO_SCALE:
        return None
    try:
        return ScaleState.checked(*values)
    except ValueError:
        return False


def _count(x: float, limit: int = 2**62) -> bool:
    return 0 <= x < limit and x == int(
        x
    )  # the range first: NaN and inf fail it, int() never sees them


def decode_ready(body: torch.Tensor) -> Ready | None:
    """A READY body, or None if it is malformed (the frame is refused)."""
    values = body.tolist()
    vote, round_, hint, count = values[:_READY_HEAD]
    nonce, echo = values[_NONCE_AT:]
    if not (_count(round_) and _count(hint) and _count(count, MAX_HOLDINGS + 1)):
        return None
    if not (_count(nonce, NONCE_LIMIT) and _count(echo, NONCE_LIMIT)):
        return None
    holdings, scales = [], []
    for i in range(int(count)):
        entry = values[_READY_HEAD + _ENTRY * i : _READY_HEAD + _ENTRY * (i + 1)]
        triple, scale = entry[:3], scale_slots(entry[3:])
        if not all(_count(x) for x in triple) or triple[1] >= triple[2] or scale is False:
            return None
        holdings.append(Holding(*(int(x) for x in triple)))
        scales.append(scale)
    return Ready(
        vote, int(round_), int(hint), tuple(holdings), tuple(scales), int(nonce), int(echo)
    )


def encode_abort(vote: float, echo: int, step: int) -> torch.Tensor:
    return torch.tensor([vote, float(echo), float(step)], dtype=torch.float64)  # (3,)


def decode_abort(body: torch.Tensor) -> Abort | None:
    """An ABORT body, or None if it is malformed (the frame is refused)."""
    vote, echo, step = body.tolist()
    if not (_count(vote, 2**53) and _count(echo, NONCE_LIMIT) and echo > 0 and _count(step)):
        return None
    return Abort(vote, int(echo), int(step))


def is_ready(header: FrameHeader) -> bool:
    return header.kind is FrameKind.CONTROL and header.micro_batch == TAG_READY


def is_abort(header: FrameHeader) -> bool:
    return header.kind is FrameKind.CONTROL and header.micro_batch == TAG_ABORT


def is_want(header: FrameHeader) -> bool:
    return header.kind is FrameKind.CONTROL and header.micro_batch == TAG_WANT


def is_done(header: FrameHeader) -> bool:
    return header.kind is FrameKind.CONTROL and header.micro_batch == TAG_DONE


def is_manifest(header: FrameHeader) -> bool:
    return header.kind is FrameKind.CONTROL and header.micro_batch == TAG_MANIFEST


def state_index(header: FrameHeader) -> int | None:
    if header.kind is FrameKind.CONTROL and TAG_STATE <= header.micro_batch < TAG_CUSTODY:
        return header.micro_batch - TAG_STATE
    return None


def custody_index(header: FrameHeader) -> int | None:
    if header.kind is FrameKind.CONTROL and header.micro_batch >= TAG_CUSTODY:
        return header.micro_batch - TAG_CUSTODY
    return None


def is_board_frame(header: FrameHeader) -> bool:
    return (
        is_ready(header)
        or is_abort(header)
        or is_want(header)
        or is_done(header)
        or is_manifest(header)
        or state_index(header) is not None
        or custody_index(header) is not None
    )


class Board:
    """READY, STATE and CUSTODY frames from members, waited on by the trainer."""

    def __init__(
        self,
        *,
        shapes: dict[str, tuple[int, ...]],
        is_member: Callable[[str], bool],
        on_copy: Callable[[Copy], None] = lambda copy: None,
        on_want: Callable[[str, int, int], None] = lambda peer, hint, floor: None,
        on_ready: Callable[[str, Ready], None] = lambda peer, ready: None,
        on_answer: Callable[[str, Ready], None] = lambda peer, ready: None,
        on_abort: Callable[[str, Abort], None] = lambda peer, abort: None,
        moves_from: Callable[[str], bool] = lambda peer: True,
        copies_from: Callable[[str], bool] = lambda peer: True,
    ):
        self.names = sorted(shapes)
        self._numel = {n: int(torch.Size(shapes[n]).numel()) for n in self.names}
        self._is_member = is_member
        self._on_copy = on_copy
        self._on_want = on_want
        self._on_ready = on_ready  # a READY that is not an answer: the sender still waits
        self._on_answer = on_answer  # a READY that answers one of ours
        self._on_abort = on_abort
        self._moves_from = moves_from  # who may send STATE: the plan we meet's members
        self._copies_from = copies_from  # who may send copies to keep, besides those asked
        self._asked: frozenset[str] = frozenset()  # who may answer DONE: the last WANT's
        self._done: dict[str, tuple[int, int]] = {}  # peer -> (floor, copies sent) of its DONE
        self._filed: dict[str, int] = {}  # peer -> its copies filed (kept or refused) since
        self._cond = threading.Condition()
        # (peer, round) -> echo -> the newest READY: a late resend from an earlier meeting
        # (another echo) never replaces the one that answers ours
        self._ready: dict[tuple[str, int], dict[int, Ready]] = {}
        self._heard: dict[str, Ready] = {}  # peer -> its newest READY (its nonce to echo)
        self._state: dict[tuple[int, str], torch.Tensor] = {}  # (step, name) -> flat state
        self._parts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # (peer, step) -> ...
        self._manifests: dict[tuple[str, int], tuple[Holding, int, int, ScaleState | None]] = {}
        self.refused = 0

    def state_bytes(self, names) -> int:
        """Bytes the named parameters' STATE frames hold (a parameter and two AdamW moments)."""
        return sum(4 * (3 * self._numel[n] + 1) for n in names)

    def expect(self, header: FrameHeader) -> TensorSpec | None:
        """dtype and shape of a board frame; None if the header is not one."""
        if is_ready(header):
            return TensorSpec(torch.float64, (READY_LEN,))
        if is_manifest(header):
            return TensorSpec(torch.float64, (MANIFEST_LEN,))
        if is_abort(header):
            return TensorSpec(torch.float64, (3,))
        if is_want(header):
            return TensorSpec(torch.float64, (2,))
        if is_done(header):
            return TensorSpec(torch.float64, (2,))
        index = state_index(header)
        index = custody_index(header) if index is None else index
        if index is None:
            return None
        if index >= len(self.names):
            return _NEVER
        return TensorSpec(torch.float32, (3 * self._numel[self.names[index]] + 1,))

    def put(self, item: Received) -> None:
        if not self._is_member(item.peer):
            return self._refuse(item, "a non-member")
        header = item.header
        spec = self.expect(header)
        tensor = item.tensor
        if spec is None or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            return self._refuse(item, "an unexpected")
        if is_ready(header):
            ready = decode_ready(item.tensor)
            if ready is None:
                return self._refuse(item, "a malformed READY")
            self._file_ready(item.peer, ready)
            if header.step != READY_ANSWER:
                self._on_ready(item.peer, ready)
            else:
                self._on_answer(item.peer, ready)
        elif is_abort(header):
            abort = decode_abort(item.tensor)
            if abort is None:
                return self._refuse(item, "a malformed ABORT")
            self._on_abort(item.peer, abort)
        elif is_want(header):
            hint, floor = item.tensor.tolist()
            if not (_count(hint) and _count(floor)):
                return self._refuse(item, "a malformed WANT")
            self._on_want(item.peer, int(hint), int(floor))
        elif is_done(header):
            floor, sent = item.tensor.tolist()
            if not (_count(floor) and _count(sent, MAX_HOLDINGS + 1)):
                return self._refuse(item, "a malformed DONE")
            if item.peer not in self._asked:
                return self._refuse(item, "an unasked DONE")
            with self._cond:
                self._done[item.peer] = (int(floor), int(sent))
                self._cond.notify_all()
        elif (is_manifest(header) or custody_index(header) is not None) and not (
            self._copies_from(item.peer) or item.peer in self._asked
        ):
            return self._refuse(item, "a copy from outside the plan")
        elif is_manifest(header):
            self._close_copy(item)
        elif (index := custody_index(header)) is not None:
            self._add_part(item.peer, header.step, self.names[index], item.tensor)
        else:
            if not self._moves_from(item.peer):
                return self._refuse(item, "a STATE from outside the plan")
            name = self.names[state_index(header)]  # type: ignore[index]
            with self._cond:
                self._state[(header.step, name)] = item.tensor
                self._cond.notify_all()

    def _file_ready(self, peer: str, ready: Ready) -> None:
        with self._cond:
            echoes = self._ready.setdefault((peer, ready.round), {})
            echoes.pop(ready.echo, None)  # re-inserted as the newest
            echoes[ready.echo] = ready
            while len(echoes) > _ECHOES_PER_KEY:
                del echoes[next(iter(echoes))]
            self._heard[peer] = ready
            self._cond.notify_all()

    def _refuse(self, item: Received, why: str) -> None:
        self.refused += 1
        logger.debug("refused %s frame %s from %s", why, item.header, item.peer[:16])

    def _add_part(self, peer: str, step: int, name: str, tensor: torch.Tensor) -> None:
        with self._cond:
            self._pending(peer, step)[name] = tensor
        self._complete(peer, step)

    def _pending(self, peer: str, step: int) -> dict[str, torch.Tensor]:
        """The parts of a copy being received (caller holds the lock): at most
        _PENDING_COPIES_PER_PEER per peer, an older unfinished one makes room for a new one."""
        if (peer, step) not in self._parts:
            mine = sorted(k for k in self._parts if k[0] == peer)
            if len(mine) >= _PENDING_COPIES_PER_PEER:
                del self._parts[mine[0]]
                self._manifests.pop(mine[0], None)
        return self._parts.setdefault((peer, step), {})

    def _close_copy(self, item: Received) -> None:
        values = item.tensor.tolist()
        scale = scale_slots(values[5:])
        if not all(_count(x) for x in values[:5]) or values[1] >= values[2] or scale is False:
            return self._refuse(item, "a malformed MANIFEST")
        step, start, stop, count, digest48 = (int(x) for x in values[:5])
        if step != item.header.step or count > len(self.names):
            return self._refuse(item, "an inconsistent MANIFEST")
        with self._cond:
            self._pending(item.peer, step)
            self._manifests[(item.peer, step)] = (
                Holding(step, start, stop),
                count,
                digest48,
                scale,
            )
        self._complete(item.peer, step)

    def _complete(self, peer: str, step: int) -> None:
        """Hand a copy on once its manifest and all its parts are here (frames may come in
        any order: the transport sends them concurrently)."""
        with self._cond:
            manifest = self._manifests.get((peer, step))
            parts = self._parts.get((peer, step), {})
            if manifest is None or len(parts) < manifest[1]:
                return
            del self._manifests[(peer, step)]
            del self._parts[(peer, step)]
        holding, count, digest48, scale = manifest
        if len(parts) != count:
            logger.warning("a copy from %s for step %d has %d parts, its manifest says %d",
                           peer[:16], step, len(parts), count)  # fmt: skip
            return
        self._on_copy(Copy(peer, holding, parts, digest48, scale))

    def filed(self, peer: str) -> None:
        """A copy from ``peer`` was checked and kept, or refused: it no longer is on its way."""
        with self._cond:
            self._filed[peer] = self._filed.get(peer, 0) + 1
            self._cond.notify_all()

    def reset_done(self, asked: list[str]) -> None:
        """Before a new WANT to ``asked``: answers to an older one do not count, and only
        those asked may answer."""
        with self._cond:
            self._asked = frozenset(asked)
            self._done.clear()
            self._filed.clear()

    def done_of(self, peers: list[str], floor: int) -> set[str]:
        """Peers that answered a WANT with ``floor`` and whose copies are all filed."""
        with self._cond:
            answered = {p: d[1] for p in peers if (d := self._done.get(p)) and d[0] == floor}
            return {p for p, sent in answered.items() if self._filed.get(p, 0) >= sent}

    def ready_of(
        self, peers: list[str], vote: float, round: int = 0, echo: int = 0
    ) -> dict[str, Ready]:
        """Each peer's READY for ``vote`` in ``round`` that echoes our meeting's nonce."""
        with self._cond:
            found = {p: self._ready.get((p, round), {}).get(echo) for p in peers}
            return {p: r for p, r in found.items() if r is not None and r.vote == vote}

    def heard(self, peer: str, vote: float) -> int:
        """The nonce of ``peer``'s newest READY for ``vote`` (what ours should echo), or 0."""
        with self._cond:
            ready = self._heard.get(peer)
            return ready.nonce if ready is not None and ready.vote == vote else 0

    def wait(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``condition()`` holds (re-checked on every filed frame) or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not condition():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, _POLL_S))
            return True

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def take_state(self, step: int, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Every named parameter's state for ``step`` (removed from the board), or None."""
        with self._cond:
            if any((step, n) not in self._state for n in names):
                return None
            return {n: self._state.pop((step, n)) for n in names}

    def missing_state(self, step: int, names: list[str]) -> list[str]:
        with self._cond:
            return [n for n in names if (step, n) not in self._state]

    def forget(self, vote: float, before_step: int | None = None) -> None:
        """A plan's meeting is over: its READY frames are used up (a later meeting with the same
        vote must hear its members again); moved state of steps before ``before_step`` goes."""
        with self._cond:
            for key, echoes in list(self._ready.items()):
                kept = {e: r for e, r in echoes.items() if r.vote != vote}
                if kept:
                    self._ready[key] = kept
                else:
                    del self._ready[key]
            self._done.clear()
            self._filed.clear()
            if before_step is not None:
                self._state = {k: v for k, v in self._state.items() if k[0] >= before_step}
