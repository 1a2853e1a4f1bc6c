"""Error feedback: what a lossy codec did not send is added to the next tensor under that key.

With it, the running sum of what the receiver decodes tracks the running sum of the inputs
(the gap is exactly the residual held here), which is what keeps top-k-compressed gradients
converging.
"""

from collections.abc import Hashable

import msgpack
import torch

from fusionllm.compression.codecs import Codec
from fusionllm.compression.frame import frame_header


class ErrorFeedback:
    """Per-key residual state for one sender; keys name tensors (e.g. a cut edge and direction).

    The residual lives on the tensor's device in the tensor's dtype.
    """

    def __init__(self) -> None:
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def pack(self, key: Hashable, tensor: torch.Tensor, codec: Codec) -> bytes:
        """A frame of ``tensor`` plus the carried residual; the new residual is kept."""
        tensor = tensor.detach()
        residual = self._residuals.get(key)
        if residual is not None and (
            residual.shape != tensor.shape
            or residual.dtype != tensor.dtype
            or residual.device != tensor.device
        ):
            raise ValueError(
                f"error-feedback key {key!r} held {tuple(residual.shape)} {residual.dtype} on "
                f"{residual.device}, now got {tuple(tensor.shape)} {tensor.dtype} on "
                f"{tensor.device}; call reset({key!r}) when a tensor changes shape"
            )
        corrected = tensor + residual if residual is not None else tensor.contiguous()
        fields, new_residual = codec.encode_with_residual(corrected)
        self._residuals[key] = new_residual
        frame = frame_header(corrected, codec)
        frame.update(fields)
        return msgpack.packb(frame, use_bin_type=True)

    def residual(self, key: Hashable) -> torch.Tensor | None:
        return self._residuals.get(key)

    def residuals(self) -> dict[Hashable, torch.Tensor]:
        """Every key's residual (copies: a checkpoint keeps them)."""
        return {key: r.detach().clone() for key, r in self._residuals.items()}

    def load(self, key: Hashable, residual: torch.Tensor) -> None:
        self._residuals[key] = residual.detach().clone()

    def scale_(self, factor: float) -> None:
        """Multiply every residual by ``factor`` in place: what a sender whose tensors change
        units (fp16's loss scale moving, a power of two, so exactly) keeps them in step with."""
        for residual in self._residuals.values():
            residual.mul_(factor)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget one key's residual, or all of them."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)
