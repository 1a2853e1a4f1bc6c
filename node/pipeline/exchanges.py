"""The exchanges after a step's schedule (runner.py's steps 2 and 3), over the run's transport.

- ``all_reduce_replicas``: a data-parallel stage's replicas sum their gradients;
- ``sum_tied``: the stages holding a tied parameter (GPT-2's wte / lm_head) sum its gradients;
- ``send_summary`` and ``gather_summary``: step 4's all-gather of every process's summary.

Frames leave and arrive through the runner's staging buffers, so gradients on a GPU travel
as host tensors; sums run on the stage's device, in a fixed order on every process.
"""

from dataclasses import replace

from fusionllm.compression import pack_tensor
from fusionllm.node.errors import PipelineError
from fusionllm.node.p2p.framing import FrameKind
from fusionllm.node.pipeline.evaluation import is_eval_step
from fusionllm.node.pipeline.expectations import TAG_DP, TAG_SUMMARY, TAG_TIED
from fusionllm.node.pipeline.layout import PipelineLayout
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.steps import Sends
from fusionllm.node.pipeline.summary import StepTotals, Summary, combine


def all_reduce_replicas(runner, step: int, sends: Sends) -> None:
    """Step 2: the replicas of our stage sum their flat gradients in replica order (the same
    bits on every replica). ``runner``: a PipelineRunner."""
    s, count = runner.role.stage, runner.replicas[runner.role.stage]
    if count == 1:
        return
    mine = runner.worker.flat_grads()
    body = pack_tensor(runner.staging.to_host(("dp", s), mine))
    for r in range(count):
        if r != runner.role.replica:
            sends.futures.append(runner.send(Role(s, r), FrameKind.CONTROL, step, TAG_DP, body))
    total = None
    for r in range(count):  # the same order on every replica: the same bits
        part = (
            mine
            if r == runner.role.replica
            else runner.staging.to_device(
                ("dp", r), runner.take(FrameKind.CONTROL, step, TAG_DP, Role(s, r), sends)
            )
        )
        total = part.clone() if total is None else total + part
    runner.worker.set_flat_grads(total)


def sum_tied(runner, step: int, sends: Sends) -> None:
    """Step 3: every holder of a tied parameter sums its copies' gradients in stage order."""
    s, r = runner.role.stage, runner.role.replica
    for name in runner.tied_names:
        tag = TAG_TIED + runner.tied_index[name]
        holders = runner.layout.tied[name]
        mine = runner.worker.grad(name)
        body = pack_tensor(runner.staging.to_host(("tied", name), mine))
        # Replica r of a holder stage hears from replica r mod R of every other holder.
        for other in holders:
            if other == s:
                continue
            for rr in range(runner.replicas[other]):
                if rr % runner.replicas[s] == r:
                    sends.futures.append(
                        runner.send(Role(other, rr), FrameKind.CONTROL, step, tag, body)
                    )
        total = None
        for other in holders:  # stage order on every holder
            if other == s:
                part = mine
            else:
                sender = Role(other, r % runner.replicas[other])
                part = runner.staging.to_device(
                    ("tied", name, other),
                    runner.take(FrameKind.CONTROL, step, tag, sender, sends),
                )
            total = part.clone() if total is None else total + part
        runner.worker.set_grad(name, total)


def summary_first(role: Role, tied_names: list[str], layout: PipelineLayout) -> bool:
    """Whether this process's share of the norm does not wait on the tied sums, so it sends
    its summary before them: the last stage's is then at stage 0 when stage 0's last backward
    ends, and the step ends one link latency after that, not two (the tied frame, then the
    summary). Replicas but the first send a norm of 0, and a stage whose tied copies another
    stage counts leaves them out of its share."""
    return role.replica != 0 or set(tied_names) <= layout.counted_elsewhere(role.stage)


def send_summary(runner, step: int, sends: Sends, losses: Summary) -> Summary:
    """Step 4, out: our summary (summary.py: ``losses`` with our norm share and vote), sent to
    every other process. ``runner``: a PipelineRunner."""
    sq = 0.0
    if runner.role.replica == 0:  # replicas hold the same averaged gradients: count once
        sq = runner.worker.local_grad_sq_norm(runner.layout.counted_elsewhere(runner.role.stage))
    mine = replace(losses, sq=sq, vote=float(runner._vote()))
    body = pack_tensor(mine.to_tensor())
    for other in runner.roles:
        if other != runner.role:
            sends.futures.append(runner.send(other, FrameKind.CONTROL, step, TAG_SUMMARY, body))
    return mine


def gather_summary(runner, step: int, sends: Sends, mine: Summary) -> StepTotals:
    """Step 4, in: the all-gather's totals, in rank order (summary.combine); a step whose
    losses do not count every micro-batch (and every validation one, on an evaluation step)
    is refused."""
    parts = [
        mine
        if other == runner.role
        else Summary.from_tensor(
            runner.take(FrameKind.CONTROL, step, TAG_SUMMARY, other, sends),
            step=step,
            sender=other,
        )
        for other in runner.roles
    ]
    totals = combine(parts)
    m = runner.config.micro_batches
    evals = m if is_eval_step(runner.config, step) else 0
    if totals.loss_count != m or totals.eval_count != evals:
        raise PipelineError(
            f"step {step}: {totals.loss_count} losses and {totals.eval_count} "
            f"validation losses for {m} micro-batches"
        )
    return totals
