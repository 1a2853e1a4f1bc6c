"""The exchanges after a step's schedule (runner.py's steps 2 and 3), over the run's transport.

- ``all_reduce_replicas``: a data-parallel stage's replicas sum their gradients;
- ``sum_tied``: the stages holding a tied parameter (GPT-2's wte / lm_head) sum its gradients.

Frames leave and arrive through the runner's staging buffers, so gradients on a GPU travel
as host tensors; sums run on the stage's device, in a fixed order on every process.
"""

from fusionllm.compression import pack_tensor
from fusionllm.node.p2p.framing import FrameKind
from fusionllm.node.pipeline.expectations import TAG_DP, TAG_TIED
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.steps import Sends


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
