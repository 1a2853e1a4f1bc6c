"""What a plan's start carries on besides the parameters: fp16's loss scale and, on the same
plan only, the error-feedback residuals of a member's links.

Both run once the READY barrier chose the start (holdings.choose_start) and the stage's state
is gathered, before the first step; every member restores the same scale, so the loss-scaled
gradients they exchange agree.
"""

from fusionllm.common.logs import get_logger
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.pipeline.runner import PipelineRunner
from fusionllm.node.training.assignment import Assignment
from fusionllm.node.training.checkpoints import CheckpointError
from fusionllm.node.training.holdings import SEED_STEP, Holding, Start, start_scale

logger = get_logger(__name__)


def restore_scale(
    runner: PipelineRunner,
    *,
    step: int,
    members: tuple[str, ...],
    ready: dict,  # peer -> its Ready (board.Ready) of the round that chose the start
    me: str,
    mine: tuple[tuple[Holding, ScaleState | None], ...],
) -> None:
    """Every member continues from the same fp16 loss scale: that of the step they resume
    at, as the first member holding it announced (holdings.start_scale)."""
    announced = {peer: tuple(zip(r.holdings, r.scales, strict=False)) for peer, r in ready.items()}
    announced[me] = mine
    scale = start_scale(step, members, announced)
    if scale is not None:
        runner.restore_scale(scale)


def restore_residuals(
    runner: PipelineRunner,
    *,
    vault: object,  # vault.Vault (not imported: it imports session.py, which imports this)
    assignment: Assignment,
    me: str,
    start: Start,
) -> None:
    """Our own checkpoint of the start step, written under this very plan, holds the
    error-feedback residuals of our links: carry them on. Under another plan the links,
    codecs and receivers may differ: they start from zero."""
    holding = Holding(start.step, *assignment.ranges[runner.role.stage])
    local = start.local.get(me, ())
    if start.step == SEED_STEP or holding not in local or holding not in vault.own.holdings():
        return
    try:
        saved = vault.stored_stage(holding)
        if saved.plan == assignment.digest and saved.residuals:
            runner.load_residuals(saved.residuals)
            logger.info("resumed %d error-feedback residuals", len(saved.residuals))
    except (CheckpointError, ValueError) as exc:  # a damaged or foreign file
        logger.warning("no error-feedback residuals from %s: %s", holding, exc)
