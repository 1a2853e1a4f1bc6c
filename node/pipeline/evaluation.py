"""Validation through the pipeline: forward-only micro-batches of the held-out split.

At the start of every ``eval_every``-th step (step 0 included), before the step's own
schedule, each process runs the validation micro-batches it owns (``schedule.owner``, as for
training): stage 0 reads ``TokenDataset.eval_batch`` (the same held-out windows every time,
so evaluations compare), every stage runs them forward without autograd and sends the link's
values on as activation frames tagged ``EVAL_TAG + micro-batch``, and the last stage sums the
losses. The sums ride in the step's summary (runner.py), so every process ends the step
knowing the validation loss of the parameters the step started from, with no extra exchange.
"""

from fusionllm.node.p2p.framing import FrameKind
from fusionllm.node.pipeline.expectations import EVAL_TAG
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.schedule import owner
from fusionllm.node.pipeline.train_config import TrainConfig


def is_eval_step(config: TrainConfig, step: int) -> bool:
    return config.eval_every > 0 and step % config.eval_every == 0


def eval_pass(runner, step: int, sends) -> tuple[float, int]:
    """(loss sum, loss count) of this process's validation micro-batches at ``step``: both
    0 off an evaluation step or off the last stage. ``runner``: a PipelineRunner."""
    config, worker, layout = runner.config, runner.worker, runner.layout
    if not is_eval_step(config, step):
        return 0.0, 0
    s, replicas = runner.role.stage, runner.replicas
    total, count = 0.0, 0
    for mb in range(config.micro_batches):
        if owner(mb, replicas[s]) != runner.role.replica:
            continue
        idx, targets = runner.dataset.eval_batch(config.batch, mb)  # (B, T) each
        if worker.is_first:
            inputs = {"idx": idx}
        else:
            sender = Role(s - 1, owner(mb, replicas[s - 1]))
            flat = runner.take(FrameKind.ACTIVATION, step, EVAL_TAG + mb, sender, sends)
            inputs = layout.links[s - 1].unpack(flat)
        out = worker.evaluate(inputs, targets if worker.is_last else None)
        if worker.is_last:
            total, count = total + out, count + 1
            continue
        flat = runner.staging.to_host(("eval", s), layout.links[s].pack(out))
        body = runner.activation_body(s, flat)
        target = Role(s + 1, owner(mb, replicas[s + 1]))
        sends.futures.append(runner.send(target, FrameKind.ACTIVATION, step, EVAL_TAG + mb, body))
    return total, count
