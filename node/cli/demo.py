"""Compression demo: what each codec does to a gradient-like tensor, end to end through a frame."""

import math
import time
from dataclasses import dataclass

import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.compression import (
    Codec,
    ErrorFeedback,
    Float16Codec,
    IdentityCodec,
    TopKCodec,
    pack_tensor,
    unpack_tensor,
)

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    numel: int = 1 << 22
    ratios: tuple[float, ...] = (0.1, 0.01, 0.001)
    feedback_steps: int = 20
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.numel <= 1 << 28:
            raise ConfigError(f"numel must be in [1, 2**28], got {self.numel}")
        if not self.ratios or not all(0.0 < r <= 1.0 for r in self.ratios):
            raise ConfigError(f"ratios must be in (0, 1], got {self.ratios}")
        if not 0 <= self.feedback_steps <= 10_000:
            raise ConfigError(f"feedback_steps must be in [0, 10000], got {self.feedback_steps}")


@dataclass(frozen=True)
class CodecReport:
    codec: str
    wire_bytes: int
    dense_bytes: int
    relative_error: float
    encode_mb_s: float
    decode_mb_s: float


def gradient_like(numel: int, generator: torch.Generator, device: str) -> torch.Tensor:
    """Heavy-tailed values (Student-t, 3 dof), like real gradients: a few large, most small."""
    normal = torch.randn(numel, generator=generator)  # (N,)
    chi2 = torch.randn(3, numel, generator=generator).pow(2).sum(0)  # (N,)
    return (normal / torch.sqrt(chi2 / 3)).mul_(1e-3).to(device)


def measure_codec(tensor: torch.Tensor, codec: Codec) -> CodecReport:
    dense_mb = tensor.numel() * tensor.element_size() / 1e6
    start = time.perf_counter()
    frame = pack_tensor(tensor, codec)
    encoded = time.perf_counter()
    decoded = unpack_tensor(frame, device=tensor.device)
    finished = time.perf_counter()
    error = float(torch.linalg.vector_norm(decoded - tensor) / torch.linalg.vector_norm(tensor))
    return CodecReport(
        codec=repr(codec),
        wire_bytes=len(frame),
        dense_bytes=tensor.numel() * tensor.element_size(),
        relative_error=error,
        encode_mb_s=dense_mb / max(encoded - start, 1e-9),
        decode_mb_s=dense_mb / max(finished - encoded, 1e-9),
    )


def feedback_drift(config: DemoConfig, ratio: float, generator: torch.Generator) -> float:
    """Relative gap between the sums of sent and received tensors after N steps of feedback."""
    feedback = ErrorFeedback()
    codec = TopKCodec(ratio)
    numel = min(config.numel, 1 << 18)
    sent_sum = torch.zeros(numel, device=config.device)
    received_sum = torch.zeros(numel, device=config.device)
    for _ in range(config.feedback_steps):
        gradient = gradient_like(numel, generator, config.device)
        received_sum += unpack_tensor(feedback.pack("grad", gradient, codec), device=config.device)
        sent_sum += gradient
    gap = torch.linalg.vector_norm(sent_sum - received_sum)
    return float(gap / torch.linalg.vector_norm(sent_sum))


def run_demo(config: DemoConfig) -> list[CodecReport]:
    generator = torch.Generator().manual_seed(config.seed)
    tensor = gradient_like(config.numel, generator, config.device)
    codecs: list[Codec] = [IdentityCodec(), Float16Codec(), Float16Codec(torch.bfloat16)]
    codecs += [TopKCodec(ratio) for ratio in config.ratios]
    reports = []
    for codec in codecs:
        logger.info("encoding %d elements with %r", config.numel, codec)
        reports.append(measure_codec(tensor, codec))
    return reports


def format_reports(reports: list[CodecReport]) -> str:
    header = f"{'codec':<52} {'wire bytes':>12} {'x smaller':>9} {'rel err':>8} "
    header += f"{'enc MB/s':>9} {'dec MB/s':>9}"
    lines = [header, "-" * len(header)]
    for r in reports:
        shrink = r.dense_bytes / r.wire_bytes if r.wire_bytes else math.inf
        lines.append(
            f"{r.codec:<52} {r.wire_bytes:>12,} {shrink:>9.1f} {r.relative_error:>8.4f} "
            f"{r.encode_mb_s:>9.0f} {r.decode_mb_s:>9.0f}"
        )
    return "\n".join(lines)
