"""Error feedback on gradient links across fp16's loss scale: a sender whose gradients carry a
moving scale S sends, divided by S, exactly what an unscaled sender sends (S is a power of two),
and the residuals it hands to a checkpoint are in true units, whatever S the loader starts at."""

import pytest
import torch

from fusionllm.compression import budget_codec, unpack_tensor
from fusionllm.node.pipeline.link_feedback import GradientFeedback
from fusionllm.node.pipeline.mailbox import Role

N = 4096
TARGET = Role(0, 1)


def _grads(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(N, generator=generator) * 1e-2 for _ in range(steps)]  # (N,)


@pytest.mark.parametrize("ternary", [False, True])
def test_a_scaled_sender_sends_the_unscaled_frames_times_the_scale(ternary) -> None:
    codec = budget_codec(N, 0.05, ternary=ternary)
    scales = [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**10, 2.0**10]  # an overflow, then growth
    plain, scaled = GradientFeedback(), GradientFeedback()
    for step, grad in enumerate(_grads(len(scales))):
        s = scales[step]
        want = unpack_tensor(plain.pack(0, TARGET, grad, codec))
        got = unpack_tensor(scaled.pack(0, TARGET, grad * s, codec))
        torch.testing.assert_close(got / s, want, atol=0, rtol=0)
        if step + 1 < len(scales):
            scaled.rescale(s, scales[step + 1])


def test_residuals_leave_in_true_units_and_load_at_any_scale() -> None:
    codec = budget_codec(N, 0.05, ternary=False)
    plain, scaled = GradientFeedback(), GradientFeedback()
    grads = _grads(4)
    for grad in grads[:2]:
        plain.pack(0, TARGET, grad, codec)
        scaled.pack(0, TARGET, grad * 2.0**9, codec)
    table = scaled.table(2.0**9)
    assert list(table) == ["gradient/0/0.1"]
    torch.testing.assert_close(table["gradient/0/0.1"], plain.table(1.0)["gradient/0/0.1"],
                               atol=0, rtol=0)  # fmt: skip
    resumed = GradientFeedback()  # a runner after a restart: its scale is init_scale again
    resumed.load(table, 2.0**16)
    for grad in grads[2:]:
        want = unpack_tensor(plain.pack(0, TARGET, grad, codec))
        got = unpack_tensor(resumed.pack(0, TARGET, grad * 2.0**16, codec))
        torch.testing.assert_close(got / 2.0**16, want, atol=0, rtol=0)
