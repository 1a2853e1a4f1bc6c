"""Error feedback on a runner's gradient links: one residual per link and receiver.

The gradients a stage sends back carry fp16's loss scale S (loss_scale.py), so their live
residuals do too. ``rescale`` keeps them in the units of the next step's gradients when S
moves (a power of two: exact), and the residuals a checkpoint or a hand-over takes are in
true gradient units: the runner that loads them multiplies them by its own live scale (the
one every member restored at the plan's start).
"""

import torch

from fusionllm.compression import Codec, ErrorFeedback
from fusionllm.node.pipeline.mailbox import Role


class GradientFeedback:
    def __init__(self) -> None:
        self._feedback = ErrorFeedback()

    def pack(self, link: int, target: Role, flat: torch.Tensor, codec: Codec) -> bytes:
        """The frame of ``flat`` (S-scaled on fp16) plus its carried residual."""
        return self._feedback.pack(("gradient", link, target), flat, codec)

    def rescale(self, old_scale: float, new_scale: float) -> None:
        if new_scale != old_scale:
            self._feedback.scale_(new_scale / old_scale)

    def table(self, scale: float) -> dict[str, torch.Tensor]:
        """Residuals by "gradient/<link>/<stage>.<replica>", divided by the live ``scale``."""
        return {
            f"{kind}/{link}/{target.stage}.{target.replica}": residual / scale
            for (kind, link, target), residual in self._feedback.residuals().items()
        }

    def load(self, table: dict[str, torch.Tensor], scale: float, expected: dict[str, int]) -> None:
        """Take ``table()`` back at this runner's ``scale`` (same plan only: keys name this
        plan's links and peers). ``expected``: every key this runner sends on and its flat
        size; a table (from a file) with another key, shape, dtype or a non-finite value is
        refused whole (ValueError), so a bad file never reaches a step."""
        for key, residual in table.items():
            numel = expected.get(key)
            if numel is None:
                raise ValueError(f"residual {key!r} is not one of this stage's links")
            if residual.dtype != torch.float32 or tuple(residual.shape) != (numel,):
                raise ValueError(
                    f"residual {key!r} is {residual.dtype} {tuple(residual.shape)}, "
                    f"expected float32 ({numel},)"
                )
            if not bool(torch.isfinite(residual).all()):
                raise ValueError(f"residual {key!r} holds non-finite values")
        for key, residual in table.items():
            kind, link, target = key.split("/")
            stage, replica = (int(x) for x in target.split("."))
            self._feedback.load((kind, int(link), Role(stage, replica)), residual * scale)
