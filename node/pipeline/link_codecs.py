"""How a runner's frames go on the wire: each link's codec, and the bytes it sent counted.

Activations go as the plan's code for their link picks (a ternary code of every element while
it fits the top-k ratio's bytes, else top-k; no error feedback: each micro-batch is new data),
or as half floats on a dense "fp16" link. Gradients go dense (float32 or half), or at the
ratio's bytes as the config's ``gradient_codec`` with error feedback (link_feedback.py). Every
frame packed here is added to the step's LinkTraffic (traffic.py).
"""

import torch

from fusionllm.compression import (
    Codec,
    Float16Codec,
    IdentityCodec,
    activation_codec,
    budget_codec,
    pack_tensor,
)
from fusionllm.node.pipeline.compute import Staging
from fusionllm.node.pipeline.link_feedback import GradientFeedback
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.traffic import LinkTraffic
from fusionllm.node.pipeline.train_config import TrainConfig

# A half link's 2-byte floats: float16 with a power-of-two scale per frame (Float16Codec), so
# loss-scaled or unscaled gradients fit its range and keep 11 bits of precision (bfloat16: 8);
# a frame no scale fits goes as bfloat16.
HALF_WIRE = torch.float16


class LinkCodecs:
    """One runner's frame bodies; ``feedback`` and ``traffic`` are the runner's own."""

    def __init__(
        self,
        *,
        config: TrainConfig,
        staging: Staging,
        feedback: GradientFeedback,
        traffic: LinkTraffic,
    ) -> None:
        self.config = config
        self.staging = staging
        self.feedback = feedback
        self.traffic = traffic

    def activation(self, link: int, flat: torch.Tensor) -> bytes:
        """An activation frame of ``link`` from its host values, in the plan's code for it."""
        ratio = self.config.activation_ratio(link)
        if ratio >= 1.0 and self.config.activation_half(link):
            codec: Codec = Float16Codec(HALF_WIRE)
        else:
            codec = activation_codec(flat.numel(), ratio)
        return self._counted(link, "activation", flat, codec, pack_tensor(flat, codec))

    def gradient(self, link: int, target: Role, flat: torch.Tensor) -> bytes:
        """A gradient frame of ``link`` for ``target``; a compressed one keeps its residual."""
        ratio = self.config.gradient_ratio(link)
        flat = self.staging.to_host(("gradient", link), flat)  # codecs run on the host
        if ratio >= 1.0:
            half = self.config.gradient_half(link)
            codec: Codec = Float16Codec(HALF_WIRE) if half else IdentityCodec()
            return self._counted(link, "gradient", flat, codec, pack_tensor(flat, codec))
        ternary = self.config.gradient_codec == "ternary"
        codec = budget_codec(flat.numel(), ratio, ternary=ternary)
        body = self.feedback.pack(link, target, flat, codec)
        return self._counted(link, "gradient", flat, codec, body)

    def _counted(self, link: int, kind: str, flat: torch.Tensor, codec: Codec, body: bytes):
        dense = flat.numel() * flat.element_size()
        self.traffic.add(
            link=link, kind=kind, codec=codec.codec_id, dense_bytes=dense, wire_bytes=len(body)
        )
        return body
