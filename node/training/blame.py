"""Whom to blame when a step stalls: the end of the chain of members waiting on each other.

A member that stops sending mid-run while its process and heartbeat stay up is not caught by
the control plane (its record stays fresh). Its neighbours' steps time out waiting for its
frames, and so do their neighbours', waiting on them: suspecting the member one waited on
would blame an honest stage that was itself waiting. So a member whose step timed out tells
every other member of the plan whom it waited on (a STALL note, control tag ``TAG_STALL``,
float64 ``[rank]``), collects theirs for a grace (patience.py: the others started waiting
within about a step of us), and follows the chain from the member it waited on through the
notes: the first member that sent no note is the one that stopped. A cycle (a frame lost
between two members that both wait) blames nobody.

Notes are untrusted: a note must name another rank of the plan, else it is ignored; a liar can
only point the chain at someone who then sends its own note, or at itself.
"""

import math
import time
from collections.abc import Mapping

import torch

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.compression import pack_tensor
from fusionllm.node.errors import FrameTimeoutError, PipelineError, StepAbortedError
from fusionllm.node.p2p.framing import FrameKind
from fusionllm.node.pipeline.expectations import TAG_STALL
from fusionllm.node.pipeline.runner import PipelineRunner

logger = get_logger(__name__)

_POLL_S = 0.2


def chain_end(waits: Mapping[int, int], first: int) -> int | None:
    """The rank at the end of the wait chain that starts at ``first`` (the one we waited on):
    follow ``waits`` (rank -> the rank it waited on) to a rank with no note; None on a cycle."""
    seen: set[int] = set()
    rank = first
    while rank in waits:
        if rank in seen:
            return None
        seen.add(rank)
        rank = waits[rank]
    return rank


def settled(waits: Mapping[int, int], end: int | None, ranks: int) -> bool:
    """Whether more notes cannot change the answer: every rank but the chain's end noted."""
    return end is None or all(r in waits for r in range(ranks) if r != end)


def read_note(tensor: torch.Tensor, *, sender: int, ranks: int) -> int | None:
    """The rank a note names, or None for a note that names no other rank of the plan."""
    value = float(tensor.reshape(-1)[0]) if tensor.numel() == 1 else math.nan
    if not math.isfinite(value) or value != int(value):
        return None
    rank = int(value)
    return rank if 0 <= rank < ranks and rank != sender else None


def blame_stall(runner: PipelineRunner, timeout: FrameTimeoutError) -> int | None:
    """Tell the plan's other members whom our step waited on, hear theirs, and return the rank
    that stopped (None: nobody to blame, e.g. a cycle)."""
    me, step, ranks = runner.rank, timeout.step, len(runner.roles)
    waits = {me: timeout.rank}
    body = pack_tensor(torch.tensor([float(timeout.rank)], dtype=torch.float64))  # (1,)
    for other in runner.roles:
        if other != runner.role:
            try:
                runner.send(other, FrameKind.CONTROL, step, TAG_STALL, body)
            except FusionError as exc:
                logger.debug("stall note to %s not sent: %s", other, exc)
    deadline = time.monotonic() + runner.patience.grace_s()
    while not settled(waits, chain_end(waits, timeout.rank), ranks):
        if time.monotonic() >= deadline:
            break
        for rank in [r for r in range(ranks) if r not in waits]:
            if not _hear(runner, step, rank, waits, ranks):
                return None  # the step was aborted (a member left): not a stall
    return chain_end(waits, timeout.rank)


def _hear(runner: PipelineRunner, step: int, rank: int, waits: dict[int, int], ranks: int) -> bool:
    """File ``rank``'s note if it came; False once the mailbox is closed."""
    key = (FrameKind.CONTROL.value, step, TAG_STALL, rank)
    try:
        tensor = runner.mailbox.take(key, timeout=_POLL_S / ranks)
    except StepAbortedError:
        return False
    except PipelineError:  # not here yet
        return True
    named = read_note(tensor, sender=rank, ranks=ranks)
    if named is None:
        logger.info("ignored a stall note from rank %d: %s", rank, tensor.tolist())
    else:
        waits[rank] = named
    return True
