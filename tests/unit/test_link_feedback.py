"""A runner's error-feedback residuals from a checkpoint: taken back only if they fit its links."""

import pytest
import torch

from fusionllm.compression import TopKCodec
from fusionllm.node.pipeline.link_feedback import GradientFeedback
from fusionllm.node.pipeline.mailbox import Role

KEY = "gradient/0/0.0"


def _saved() -> dict[str, torch.Tensor]:
    feedback = GradientFeedback()
    feedback.pack(0, Role(0, 0), torch.randn(64) * 4.0, TopKCodec(0.1))
    return feedback.table(4.0)  # true units: the live scale was 4


def test_a_saved_table_comes_back_at_the_loading_runners_scale() -> None:
    table = _saved()
    loaded = GradientFeedback()
    loaded.load(table, 8.0, {KEY: 64})
    torch.testing.assert_close(loaded.table(8.0)[KEY], table[KEY], atol=0, rtol=0)
    assert torch.count_nonzero(table[KEY]) > 0


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda t: {"gradient/1/1.0": t[KEY]}, "not one of this stage's links"),
        (lambda t: {KEY: t[KEY][:10]}, r"expected float32 \(64,\)"),
        (lambda t: {KEY: t[KEY].double()}, "expected float32"),
        (lambda t: {KEY: torch.full((64,), float("nan"))}, "non-finite"),
    ],
)
def test_a_table_that_does_not_fit_is_refused_whole(change, why) -> None:
    table = {**change(_saved()), "gradient/0/0.1": torch.zeros(64)}
    loaded = GradientFeedback()
    with pytest.raises(ValueError, match=why):
        loaded.load(table, 1.0, {KEY: 64, "gradient/0/0.1": 64})
    assert loaded.table(1.0) == {}  # nothing half-loaded
