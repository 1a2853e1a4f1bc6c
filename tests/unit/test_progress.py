"""TrainingProgress on the wire with a validation loss, and `fusionllm status` showing it."""

import pytest

from fusionllm.dht.records import RecordError, TrainingProgress
from fusionllm.node.control.status import _training, format_status


def test_progress_round_trips_with_and_without_a_validation() -> None:
    plain = TrainingProgress(1, 40, 2.5, False)
    assert plain.to_wire() == [1, 40, 2.5, False]  # four fields: older nodes read it
    assert TrainingProgress.from_wire(plain.to_wire()) == plain
    evaluated = TrainingProgress(0, 40, 2.5, True, (40, 2.75))
    assert TrainingProgress.from_wire(evaluated.to_wire()) == evaluated


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        ([0, 4, 2.5, False, [4]], "evaluation must be"),
        ([0, 4, 2.5, False, [4, float("nan")]], "eval loss"),
        ([0, 4, 2.5, False, [-1, 2.0]], "eval step"),
        ([0, 4, 2.5, False, [4, 2.0], 7], "training"),
        ([0, 4, 2.5], "4 or 5 fields"),
    ],
)
def test_a_malformed_validation_is_refused(wire, why) -> None:
    with pytest.raises(RecordError, match=why):
        TrainingProgress.from_wire(wire)


class _Member:
    def __init__(self, training: TrainingProgress) -> None:
        self.training = training


def test_status_shows_the_newest_validation_any_node_reports() -> None:
    members = {
        "a": _Member(TrainingProgress(0, 31, 2.1, False, (30, 2.4))),
        "b": _Member(TrainingProgress(0, 30, 2.2, False, (20, 2.6))),
        "c": _Member(TrainingProgress(None, 12, None, False)),
    }
    summary = _training(members)
    assert summary == {"step": 31, "loss": 2.1, "finished": False, "eval": [30, 2.4]}
    text = format_status(
        {"swarm": "s", "peers": [], "links": [], "plan": None, "skipped_records": 0, **summary}
    )
    assert "validation: loss 2.4000 at step 30 (held-out split)" in text
    assert _training({"c": members["c"]})["eval"] is None
