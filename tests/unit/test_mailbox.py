"""What a pipeline process accepts from its peers: shapes by header, senders by role, steps."""

import pytest
import torch

from fusionllm.node.errors import PipelineError
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import Received
from fusionllm.node.pipeline.expectations import (
    SUMMARY_LEN,
    TAG_DP,
    TAG_SUMMARY,
    TAG_TIED,
    Expectations,
    roles_of,
)
from fusionllm.node.pipeline.mailbox import Mailbox, Role
from fusionllm.node.pipeline.train_config import TrainConfig, build_layout, build_model

CONFIG = TrainConfig(stages=3, replicas=(1, 2, 1), micro_batches=4, batch_size=2, seq_len=16)
PEERS = {role: f"peer-{i}" for i, role in enumerate(roles_of(CONFIG))}


@pytest.fixture(scope="module")
def layout():
    return build_layout(CONFIG, build_model(CONFIG))


def _header(kind, step=0, tag=0, stage=0) -> FrameHeader:
    return FrameHeader(step=step, micro_batch=tag, kind=kind, stage=stage)


def test_roles_are_stage_major() -> None:
    assert roles_of(CONFIG) == [Role(0, 0), Role(1, 0), Role(1, 1), Role(2, 0)]


def test_expected_shapes_by_header(layout) -> None:
    middle = Expectations(CONFIG, layout, Role(1, 1))
    activation = middle.expect(_header(FrameKind.ACTIVATION, tag=1, stage=0))
    assert activation.shape == (layout.links[0].numel,)
    gradient = middle.expect(_header(FrameKind.GRADIENT, tag=1, stage=2))
    assert gradient.shape == (layout.links[1].numel,)
    summary = middle.expect(_header(FrameKind.CONTROL, tag=TAG_SUMMARY, stage=2))
    # norm, loss sum, loss count, vote, fp16 overflow, validation loss sum and count, compute,
    # activation and gradient waits
    assert summary.shape == (SUMMARY_LEN,) == (10,)
    dp = middle.expect(_header(FrameKind.CONTROL, tag=TAG_DP, stage=1))
    assert dp.shape[0] > 0
    # Anything else matches no tensor: the transport refuses the frame.
    for header in (
        _header(FrameKind.ACTIVATION, stage=2),
        _header(FrameKind.GRADIENT, stage=0),
        _header(FrameKind.CONTROL, tag=TAG_DP, stage=0),
        _header(FrameKind.CONTROL, tag=TAG_TIED, stage=0),  # stage 1 holds no tied weight
        _header(FrameKind.CONTROL, tag=99, stage=0),
    ):
        assert middle.expect(header).shape == (-1,), header
    first = Expectations(CONFIG, layout, Role(0, 0))
    tied = first.expect(_header(FrameKind.CONTROL, tag=TAG_TIED, stage=2))
    assert tied.shape == (256, 64)


def test_admission_by_sender_role(layout) -> None:
    middle = Expectations(CONFIG, layout, Role(1, 1))  # owns the odd micro-batches
    rank = {role: i for i, role in enumerate(roles_of(CONFIG))}
    ok = _header(FrameKind.ACTIVATION, tag=1, stage=0)
    assert middle.admit(rank[Role(0, 0)], ok) is None
    not_ours = _header(FrameKind.ACTIVATION, tag=2)
    assert middle.admit(rank[Role(0, 0)], not_ours) == "micro-batch 2 is not ours"
    assert middle.admit(rank[Role(2, 0)], ok) == "header says stage 0, the sender is stage 2"
    backwards = _header(FrameKind.ACTIVATION, tag=1, stage=2)
    assert middle.admit(rank[Role(2, 0)], backwards) == "activation from stage 2 to stage 1"
    dp = _header(FrameKind.CONTROL, tag=TAG_DP, stage=1)
    assert middle.admit(rank[Role(1, 0)], dp) is None
    assert (
        middle.admit(rank[Role(0, 0)], _header(FrameKind.CONTROL, tag=TAG_DP))
        == "gradients from another stage's replica"
    )
    tied = _header(FrameKind.CONTROL, tag=TAG_TIED, stage=0)  # stage 1 holds no tied weight
    assert middle.admit(rank[Role(0, 0)], tied) == f"unexpected control tag {TAG_TIED}"
    first = Expectations(CONFIG, layout, Role(0, 0))
    odd = _header(FrameKind.GRADIENT, tag=1, stage=1)  # replica 1 of stage 1 owns it
    assert first.admit(rank[Role(1, 0)], odd) == "micro-batch 1 is not the sender's"
    assert first.admit(rank[Role(1, 1)], odd) is None


MIDDLE = Role(1, 1)


def _mailbox(layout, role=MIDDLE, max_frames=8) -> Mailbox:
    expectations = Expectations(CONFIG, layout, role)
    ranks = {PEERS[r]: i for i, r in enumerate(roles_of(CONFIG)) if r != role}
    return Mailbox(ranks=ranks, admit=expectations.admit, max_frames=max_frames)


def _received(role: Role, header: FrameHeader) -> Received:
    return Received(peer=PEERS[role], header=header, tensor=torch.zeros(3))


def test_mailbox_files_and_refuses(layout) -> None:
    box = _mailbox(layout)
    good = _header(FrameKind.ACTIVATION, step=0, tag=1, stage=0)
    box.put(_received(Role(0, 0), good))
    box.put(_received(Role(0, 0), good))  # a duplicate
    box.put(Received(peer="stranger", header=good, tensor=torch.zeros(3)))
    box.put(_received(Role(0, 0), _header(FrameKind.ACTIVATION, step=2, tag=3, stage=0)))
    box.put(_received(Role(0, 0), _header(FrameKind.ACTIVATION, step=1, tag=3, stage=0)))
    assert box.refused == 3
    assert box.pending() == [("activation", 0, 1, 0), ("activation", 1, 3, 0)]
    assert box.take(("activation", 0, 1, 0), timeout=1.0).shape == (3,)
    box.advance(1)
    box.put(_received(Role(0, 0), good))  # step 0 is over
    assert box.refused == 4
    with pytest.raises(PipelineError, match="did not arrive"):
        box.take(("activation", 1, 1, 0), timeout=0.05)
    box.advance(2)  # step 1's activation was never asked for: dropped, not kept forever
    assert box.pending() == []
    assert box.refused == 5


def test_mailbox_is_bounded_and_closes(layout) -> None:
    box = _mailbox(layout, role=Role(0, 0), max_frames=5)
    for step in (0, 1):
        for role in roles_of(CONFIG):
            if role != Role(0, 0):
                header = _header(FrameKind.CONTROL, step=step, tag=TAG_SUMMARY, stage=role.stage)
                box.put(_received(role, header))
    assert len(box.pending()) == 5
    assert box.refused == 1
    box.close(RuntimeError("transport closed"))
    with pytest.raises(PipelineError, match="no more frames"):
        box.take(("control", 0, 99, 1), timeout=1.0)
