"""Error feedback: what is not sent now is sent later."""

import pytest
import torch

from fusionllm.compression import (
    ErrorFeedback,
    Float16Codec,
    IdentityCodec,
    TopKCodec,
    pack_tensor,
    unpack_tensor,
)


@pytest.mark.parametrize("codec", [TopKCodec(0.01), TopKCodec(0.2), Float16Codec()])
def test_running_sums_differ_by_exactly_the_residual(codec):
    generator = torch.Generator().manual_seed(0)
    feedback = ErrorFeedback()
    sent_sum = torch.zeros(4096, dtype=torch.float64)
    received_sum = torch.zeros(4096, dtype=torch.float64)
    for _ in range(50):
        gradient = torch.randn(64, 64, generator=generator)
        received = unpack_tensor(feedback.pack("w", gradient, codec))
        sent_sum += gradient.reshape(-1).double()
        received_sum += received.reshape(-1).double()
        residual = feedback.residual("w").reshape(-1).double()
        torch.testing.assert_close(sent_sum - received_sum, residual, atol=1e-4, rtol=0)


def test_residual_stays_bounded_and_sums_track():
    # Without feedback the gap after N steps grows like N; with it, it stays near one step's worth.
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(10_000, generator=generator)  # a consistent gradient direction
    feedback = ErrorFeedback()
    codec = TopKCodec(0.01)
    sent_sum = torch.zeros(10_000)
    with_feedback = torch.zeros(10_000)
    without_feedback = torch.zeros(10_000)
    for _ in range(200):
        gradient = bias + 0.1 * torch.randn(10_000, generator=generator)
        sent_sum += gradient
        with_feedback += unpack_tensor(feedback.pack("g", gradient, codec))
        without_feedback += unpack_tensor(pack_tensor(gradient, codec))
    gap_with = torch.linalg.vector_norm(sent_sum - with_feedback) / torch.linalg.vector_norm(
        sent_sum
    )
    gap_without = torch.linalg.vector_norm(sent_sum - without_feedback) / torch.linalg.vector_norm(
        sent_sum
    )
    assert gap_with < 0.5
    assert gap_without > 0.9
    assert gap_with < gap_without / 2


def test_identity_codec_leaves_no_residual():
    feedback = ErrorFeedback()
    tensor = torch.randn(10)
    assert torch.equal(unpack_tensor(feedback.pack(0, tensor, IdentityCodec())), tensor)
    assert not bool(feedback.residual(0).any())


def test_keys_are_independent_and_shape_changes_need_reset():
    feedback = ErrorFeedback()
    feedback.pack("a", torch.randn(8), TopKCodec(0.25))
    feedback.pack("b", torch.randn(3, 3), TopKCodec(0.25))
    assert feedback.residual("a").shape == (8,)
    assert feedback.residual("b").shape == (3, 3)
    with pytest.raises(ValueError, match="reset"):
        feedback.pack("a", torch.randn(9), TopKCodec(0.25))
    feedback.reset("a")
    feedback.pack("a", torch.randn(9), TopKCodec(0.25))
    feedback.reset()
    assert feedback.residual("a") is None
    assert feedback.residual("b") is None
