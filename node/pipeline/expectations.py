"""What each peer of a pipeline run may send one process, and the run's control-frame tags.

Needs only the run's config and layout, so a transport can be given its ``expect`` hook before
the runner that uses it exists (runner.py).
"""

import math

import torch

from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import TensorSpec
from fusionllm.node.pipeline.layout import WIRE_DTYPE, PipelineLayout
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.schedule import owner
from fusionllm.node.pipeline.summary import SUMMARY_LEN
from fusionllm.node.pipeline.train_config import TrainConfig

# Control-frame tags (the header's micro_batch field).
TAG_SUMMARY = 0  # float64 summary.Summary: [squared norm, loss sum, loss count, vote, overflow,
#                   eval sum, eval count]
TAG_DP = 1  # float32 flat gradients of the whole stage
TAG_TIED = 2  # + index of the tied parameter, float32 gradient of its shape
# float64 [rank]: the sender's step timed out waiting on that rank's frame (training/blame.py)
TAG_STALL = 1 << 23

# Activation tags of validation micro-batches (evaluation.py): EVAL_TAG + micro-batch.
EVAL_TAG = 1 << 24

_NEVER = TensorSpec(dtype=torch.float32, shape=(-1,))  # matches nothing: refuses the frame


def roles_of(config: TrainConfig) -> list[Role]:
    """Every process of the run, in rank order (stage-major)."""
    return [Role(s, r) for s, n in enumerate(config.stage_replicas) for r in range(n)]


class Expectations:
    """What each peer may send one process: the transport's ``expect`` hook and the mailbox's
    admission check. Needs only the run's config and layout, so the transport can use it
    before the runner (which needs the transport) exists.
    """

    def __init__(self, config: TrainConfig, layout: PipelineLayout, role: Role) -> None:
        self.config = config
        self.layout = layout
        self.role = role
        self.roles = roles_of(config)
        self.replicas = config.stage_replicas
        module = layout.stage_module(role.stage)
        canonical = layout.stage_parameter_names(role.stage)
        trained = [(canonical[n], p) for n, p in module.named_parameters() if n in canonical]
        self._shapes = {name: tuple(p.shape) for name, p in trained}
        self._num_parameters = sum(p.numel() for _, p in trained)

    def expect(self, header: FrameHeader) -> TensorSpec | None:
        """The transport's ``expect`` hook: dtype and shape by header, before we keep a frame."""
        s = self.role.stage
        if header.kind is FrameKind.ACTIVATION and header.stage == s - 1:
            return TensorSpec(WIRE_DTYPE, (self.layout.links[s - 1].numel,))
        if (
            header.kind is FrameKind.GRADIENT
            and header.stage == s + 1
            and s + 1 < len(self.replicas)
        ):
            return TensorSpec(WIRE_DTYPE, (self.layout.links[s].numel,))
        if header.kind is FrameKind.CONTROL:
            if header.micro_batch == TAG_SUMMARY:
                return TensorSpec(torch.float64, (SUMMARY_LEN,))
            if header.micro_batch == TAG_STALL:
                return TensorSpec(torch.float64, (1,))
            if header.micro_batch == TAG_DP and header.stage == s:
                return TensorSpec(torch.float32, (self._num_parameters,))
            tied = sorted(self.layout.tied)
            i = header.micro_batch - TAG_TIED
            if 0 <= i < len(tied) and tied[i] in self._shapes:
                return TensorSpec(torch.float32, self._shapes[tied[i]])
        return _NEVER

    def frame_bytes(self, header: FrameHeader) -> int:
        """The most bytes a frame of ``header`` may take (dense, its spec's dtype); 0 for a
        frame we would refuse."""
        spec = self.expect(header)
        if spec is None or any(d < 0 for d in spec.shape):
            return 0
        return math.prod(spec.shape) * spec.dtype.itemsize

    def admit(self, rank: int, header: FrameHeader) -> str | None:
        """Why the process of ``rank`` may not send this frame, or None (the mailbox's check)."""
        sender = self.roles[rank]
        if header.stage != sender.stage:
            return f"header says stage {header.stage}, the sender is stage {sender.stage}"
        s, m = self.role.stage, self.config.micro_batches
        if header.kind in (FrameKind.ACTIVATION, FrameKind.GRADIENT):
            step_dir = -1 if header.kind is FrameKind.ACTIVATION else 1
            if sender.stage != s + step_dir:
                return f"{header.kind.value} from stage {sender.stage} to stage {s}"
            mb = header.micro_batch
            if header.kind is FrameKind.ACTIVATION and mb >= EVAL_TAG:
                every = self.config.eval_every
                if not every or header.step % every:
                    return f"no evaluation at step {header.step}"
                mb -= EVAL_TAG
            if not (mb < m and owner(mb, self.replicas[s]) == self.role.replica):
                return f"micro-batch {mb} is not ours"
            if owner(mb, self.replicas[sender.stage]) != sender.replica:
                return f"micro-batch {mb} is not the sender's"
            return None
        tag = header.micro_batch
        if tag in (TAG_SUMMARY, TAG_STALL):
            return None
        if tag == TAG_DP:
            return None if sender.stage == s else "gradients from another stage's replica"
        tied = sorted(self.layout.tied)
        i = tag - TAG_TIED
        if 0 <= i < len(tied) and {s, sender.stage} <= set(self.layout.tied[tied[i]]):
            return None
        return f"unexpected control tag {tag}"
