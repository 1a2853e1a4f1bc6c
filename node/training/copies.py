"""Sending stage state between members: moved parameters (STATE) and copies to keep (CUSTODY).

A copy is one CUSTODY frame per parameter, then a MANIFEST naming the holding, the number of
parts and 48 bits of the state's digest; the keeper files the parts only if both match.
"""

from concurrent.futures import Future

import torch

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.compression import pack_tensor
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.pipeline.stage import StageWorker
from fusionllm.node.training.assignment import VOTE_HEX_DIGITS
from fusionllm.node.training.board import TAG_CUSTODY, TAG_DONE, TAG_MANIFEST, TAG_STATE
from fusionllm.node.training.checkpoints import StageState, state_digest
from fusionllm.node.training.holdings import Holding

logger = get_logger(__name__)


def digest48(digest: str) -> int:
    """The first 48 bits of a hex digest: exact in a float64 frame slot (as plan votes are)."""
    return int(digest[:VOTE_HEX_DIGITS], 16)


def stage_state(
    worker: StageWorker, holding: Holding, plan: str = "", scale: ScaleState | None = None
) -> StageState:
    """A snapshot of a worker's parameters and optimizer state (copies, safe to keep), with
    fp16's loss scale of the same step."""
    state = {name: worker.export_state(name) for name in worker.parameters}
    return StageState(holding, state, plan, rng=torch.get_rng_state(), scale=scale)


def send_state(transport, dst: str, step: int, index: int, flat: torch.Tensor, timeout: float):
    header = FrameHeader(step=step, micro_batch=TAG_STATE + index, kind=FrameKind.CONTROL, stage=0)
    return transport.send_async(dst, header, pack_tensor(flat), timeout=timeout)


def send_copy(
    transport, dst: str, stage: StageState, names: list[str], timeout: float
) -> list[Future]:
    """Send ``stage`` to ``dst`` to keep; ``names``: the board's sorted canonical names."""
    h = stage.holding
    index = {name: i for i, name in enumerate(names)}
    futures = []
    try:
        for name in sorted(stage.state):
            header = FrameHeader(
                step=h.step, micro_batch=TAG_CUSTODY + index[name], kind=FrameKind.CONTROL, stage=0
            )
            body = pack_tensor(stage.state[name])
            futures.append(transport.send_async(dst, header, body, timeout=timeout))
        digest = digest48(state_digest(stage.state))
        manifest = torch.tensor(
            [h.step, h.start, h.stop, len(stage.state), digest, *(stage.scale or (0.0, 0.0))],
            dtype=torch.float64,
        )  # (MANIFEST_LEN,)
        header = FrameHeader(step=h.step, micro_batch=TAG_MANIFEST, kind=FrameKind.CONTROL, stage=0)
        futures.append(transport.send_async(dst, header, pack_tensor(manifest), timeout=timeout))
    except FusionError as exc:
        logger.warning("a copy of %s to %s was not sent: %s", h, dst[:16], exc)
    return futures


def send_done(transport, dst: str, floor: int, sent: int) -> None:
    """Answer a WANT: ``sent`` copies of state newer than ``floor`` went before this."""
    header = FrameHeader(step=0, micro_batch=TAG_DONE, kind=FrameKind.CONTROL, stage=0)
    body = torch.tensor([float(floor), float(sent)], dtype=torch.float64)  # (2,)
    try:
        transport.send_async(dst, header, pack_tensor(body), timeout=10.0)
    except FusionError as exc:
        logger.debug("DONE to %s not sent: %s", dst[:16], exc)


def delivered(futures: list[Future], timeout: float) -> bool:
    """Wait for every send; True if all were acknowledged."""
    ok = True
    for future in futures:
        try:
            future.result(timeout)
        except Exception as exc:  # a failed send's error, or the wait's TimeoutError
            logger.warning("a state frame was not delivered: %s", exc)
            ok = False
    return ok
