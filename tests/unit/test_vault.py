"""A node's sources of the run's state (``vault.py``): which copies it keeps for others
(``keep_copy``), and what it announces (``holdings``): live state first, then its own
checkpoints, then custody copies, step 0 left out, at most MAX_HOLDINGS.

Real parts throughout: the run's model cut in two stages, a StageWorker for stage 1, and
CheckpointStores in a temporary directory.
"""

import threading

import pytest
import torch

from fusionllm.common.run_spec import RunSpec
from fusionllm.node.pipeline.layout import PipelineLayout, balanced_cuts
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.stage import StageWorker
from fusionllm.node.pipeline.train_config import TrainConfig, weight_source
from fusionllm.node.swarm_training import build_workload
from fusionllm.node.training.assignment import Assignment
from fusionllm.node.training.board import Copy
from fusionllm.node.training.checkpoints import CheckpointError, CheckpointStore, StageState
from fusionllm.node.training.copies import digest48, stage_state
from fusionllm.node.training.holdings import MAX_HOLDINGS, Holding
from fusionllm.node.training.session_terms import Held
from fusionllm.node.training.vault import Vault

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RUN = RunSpec(seq_len=16, micro_batch_size=2, micro_batches=4, steps=10)
STAGE_1 = Role(1, 0)


class Model:
    """The run's graph in two stages, and a worker serving stage 1."""

    def __init__(self) -> None:
        self.graph, _ = build_workload(RUN)
        (cut,) = balanced_cuts(self.graph, 2)
        self.config = TrainConfig.for_run(RUN, cuts=(cut,), replicas=(1, 1))
        self.layout = PipelineLayout(self.graph, self.config.cuts)
        self.ranges = ((0, cut), (cut, len(self.graph.node_ids)))
        self.worker = StageWorker(
            self.layout,
            1,
            optimizer=self.config.optimizer,
            micro_batches=RUN.micro_batches,
            weights=weight_source(self.config),  # the workload's graph is on meta
        )

    def params_of(self, start: int, stop: int) -> frozenset[str]:
        """As the trainer computes it: the canonical parameters graph nodes [start, stop) use."""
        canonical = self.graph.canonical_parameter_names()
        module = self.graph.stage_module(self.graph.node_ids[start:stop])
        return frozenset(canonical[n] for n, _ in module.named_parameters())

    def held(self, next_step: int, role: Role | None = STAGE_1) -> Held:
        assignment = Assignment(
            digest="ab" * 32,
            config=self.config,
            peers={Role(0, 0): "peer-0", Role(1, 0): "peer-1"},
            role=role,
            ranges=self.ranges,
        )
        return Held(assignment, self.layout, self.worker, next_step)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model()


@pytest.fixture
def vault(tmp_path, model) -> Vault:
    return Vault(
        own=CheckpointStore(tmp_path / "own"),
        custody=CheckpointStore(tmp_path / "custody"),
        params_of=model.params_of,
    )


def _copy_of(stage: StageState, peer: str = "peer-1") -> Copy:
    return Copy(peer, stage.holding, dict(stage.state), digest48(stage.digest()))


def _small(step: int, start: int, stop: int) -> StageState:
    """A file for listings: the vault lists holdings by name and loads only what it serves."""
    return StageState(Holding(step, start, stop), {"x": torch.zeros(4)})


# ----- keep_copy ------------------------------------------------------------------------------


def test_the_worker_holds_the_parameters_params_of_names_for_its_range(model) -> None:
    # keep_copy checks a copy against params_of: the tests below rely on this.
    assert set(model.worker.parameters) == model.params_of(*model.ranges[1])
    assert model.params_of(*model.ranges[0]) != model.params_of(*model.ranges[1])


def test_a_good_copy_lands_in_custody_and_is_announced(vault, model) -> None:
    holding = Holding(6, *model.ranges[1])
    stage = stage_state(model.worker, holding)
    assert vault.keep_copy(_copy_of(stage)) is True
    assert vault.custody.holdings() == [holding]
    assert vault.own.holdings() == []
    kept = vault.custody.load(holding)
    assert kept.digest() == stage.digest()
    for name, tensor in stage.state.items():
        assert torch.equal(kept.state[name], tensor)
    assert vault.holdings() == [holding]
    name = sorted(stage.state)[0]
    assert torch.equal(vault.export(holding, name), stage.state[name])


def test_a_copy_failing_its_digest_is_dropped(vault, model) -> None:
    stage = stage_state(model.worker, Holding(6, *model.ranges[1]))
    right = _copy_of(stage)
    wrong = Copy(right.peer, right.holding, right.state, right.digest48 ^ 1)
    assert vault.keep_copy(wrong) is False
    # Values changed after the digest was taken (a part damaged on the way).
    good = _copy_of(stage)
    name = sorted(good.state)[0]
    good.state[name] = good.state[name].clone()
    good.state[name][0] += 1.0
    assert vault.keep_copy(good) is False
    assert vault.custody.holdings() == []
    assert vault.holdings() == []


def test_a_copy_with_the_wrong_parameters_is_dropped(vault, model) -> None:
    stage = stage_state(model.worker, Holding(6, *model.ranges[1]))
    missing = dict(stage.state)
    missing.pop(sorted(missing)[0])
    extra = {**stage.state, "transformer.not_a_parameter": torch.zeros(7)}
    for state in (missing, extra):
        partial = StageState(stage.holding, state)
        assert vault.keep_copy(_copy_of(partial)) is False
    # The right state under the other stage's node range.
    elsewhere = StageState(Holding(6, *model.ranges[0]), dict(stage.state))
    assert vault.keep_copy(_copy_of(elsewhere)) is False
    assert vault.custody.holdings() == []


def test_a_copy_with_non_finite_values_is_dropped(vault, model) -> None:
    stage = stage_state(model.worker, Holding(6, *model.ranges[1]))
    name = sorted(stage.state)[0]
    stage.state[name] = stage.state[name].clone()
    stage.state[name][1] = float("nan")
    assert vault.keep_copy(_copy_of(stage)) is False  # its digest matches: the values do not
    assert vault.custody.holdings() == []


# ----- holdings -------------------------------------------------------------------------------


def test_holdings_are_live_then_own_then_custody_without_step_zero(vault, model) -> None:
    first, second = model.ranges
    vault.set_live(model.held(next_step=9))
    for step in (0, 7):
        vault.own.save(_small(step, *second))
    for step in (5, 8, 0):  # custody newer than our own checkpoint still comes after it
        vault.custody.save(_small(step, *first))
    assert vault.own.holdings() == [Holding(7, *second), Holding(0, *second)]
    assert vault.custody.holdings() == [Holding(8, *first), Holding(5, *first)]  # 0: pruned
    assert vault.holdings() == [
        Holding(9, *second),  # live: the state before the worker's next step
        Holding(7, *second),
        Holding(8, *first),
        Holding(5, *first),
    ]


def test_holdings_list_each_once_and_at_most_max_holdings(vault, model) -> None:
    assert MAX_HOLDINGS == 8
    vault.set_live(model.held(next_step=9))
    for step in (0, 6):
        for start in (0, 10, 20):
            vault.own.save(_small(step, start, start + 10))
    for step, start in [(5, 30), (5, 40), (5, 50), (6, 30), (6, 40), (6, 0)]:
        vault.custody.save(_small(step, start, start + 10))  # (6, 0, 10) is also our own
    assert len(vault.own.holdings()) + len(vault.custody.holdings()) == 12
    assert vault.holdings() == [
        Holding(9, *model.ranges[1]),
        Holding(6, 0, 10),
        Holding(6, 10, 20),
        Holding(6, 20, 30),  # our step-0 files are left out before the list is cut
        Holding(6, 30, 40),  # custody's (6, 0, 10) is not repeated
        Holding(6, 40, 50),
        Holding(5, 30, 40),
        Holding(5, 40, 50),  # (5, 50, 60) would be the ninth
    ]


def test_live_state_is_announced_only_past_step_zero_and_with_a_role(vault, model) -> None:
    assert vault.live_holding() is None
    vault.set_live(model.held(next_step=0))
    assert vault.live_holding() == Holding(0, *model.ranges[1])
    assert vault.holdings() == []  # everyone builds step 0 itself
    vault.set_live(model.held(next_step=3, role=None))  # a backup: no stage of its own
    assert vault.live_holding() is None
    assert vault.holdings() == []
    vault.set_live(model.held(next_step=3))
    assert vault.holdings() == [Holding(3, *model.ranges[1])]
    vault.set_live(None)
    assert vault.holdings() == []


def test_live_state_is_exported_from_the_worker(vault, model) -> None:
    vault.set_live(model.held(next_step=3))
    holding = Holding(3, *model.ranges[1])
    for name in model.worker.parameters:
        assert torch.equal(vault.export(holding, name), model.worker.export_state(name))
    with pytest.raises(CheckpointError, match="no state"):
        vault.export(Holding(2, *model.ranges[1]), name)


def _bump(model: Model) -> None:
    """What a step's optimizer update does: every parameter changes in place."""
    with torch.no_grad():
        for parameter in model.worker.module.parameters():
            parameter.add_(1.0)


def test_a_copy_of_the_live_stage_waits_for_the_step_in_progress(vault, model) -> None:
    """A donor's copy asked mid-step (after the update, before set_live names the next step)
    is the state after the step under the next step's name, never under the old one."""
    vault.set_live(model.held(next_step=3))
    before = vault.live_stage(timeout=1.0)
    assert before.holding == Holding(3, *model.ranges[1])
    vault.begin_step()
    _bump(model)  # the update of step 3 is in; set_live(4) has not come yet
    result: list[StageState | None] = []
    asking = threading.Thread(target=lambda: result.append(vault.live_stage(timeout=10.0)))
    asking.start()
    asking.join(0.3)
    assert asking.is_alive(), "a copy was taken mid-step"
    vault.set_live(model.held(next_step=4))
    asking.join(10.0)
    (after,) = result
    assert after.holding == Holding(4, *model.ranges[1])
    for name, tensor in after.state.items():
        assert torch.equal(tensor, model.worker.export_state(name))
        assert not torch.equal(tensor, before.state[name])


def test_a_step_that_does_not_end_gives_no_copy_and_a_copy_holds_back_the_next_step(
    vault, model
) -> None:
    vault.set_live(model.held(next_step=3))
    vault.begin_step()
    assert vault.live_stage(timeout=0.2) is None  # still mid-step at the deadline
    vault.set_live(model.held(next_step=4))
    export = model.worker.export_state
    copying, release = threading.Event(), threading.Event()

    def slow_export(name):
        copying.set()
        release.wait(10.0)
        return export(name)

    model.worker.export_state = slow_export
    asking = threading.Thread(target=vault.live_stage, args=(1.0,))
    asking.start()
    assert copying.wait(10.0)
    stepping = threading.Thread(target=vault.begin_step)
    stepping.start()
    stepping.join(0.3)
    assert stepping.is_alive(), "a step began while its stage was being copied"
    release.set()
    asking.join(10.0)
    stepping.join(10.0)
    assert not stepping.is_alive()


def test_discard_after_drops_files_of_later_steps_from_both_stores(vault, model) -> None:
    vault.own.save(_small(4, 0, 10))
    vault.own.save(_small(7, 0, 10))
    vault.custody.save(_small(6, 10, 20))
    vault.custody.save(_small(5, 10, 20))
    vault.discard_after(5)
    assert vault.own.holdings() == [Holding(4, 0, 10)]
    assert vault.custody.holdings() == [Holding(5, 10, 20)]


def test_each_source_says_the_loss_scale_of_its_step(vault, model) -> None:
    """What READY announces per holding: the live stage's scale, a checkpoint's, a copy's."""
    live_scale, own_scale, kept_scale = (ScaleState(2.0**k, k) for k in (20, 19, 18))
    held = model.held(9)
    held.scale = live_scale
    vault.set_live(held)
    own = _small(8, 0, 3)
    own.scale = own_scale
    vault.checkpoint(own)
    stage = stage_state(model.worker, Holding(6, *model.ranges[1]), scale=kept_scale)
    copy = _copy_of(stage)
    assert vault.keep_copy(Copy(copy.peer, copy.holding, copy.state, copy.digest48, kept_scale))
    assert vault.scale_of(Holding(9, *model.ranges[1])) == live_scale
    assert vault.scale_of(own.holding) == own_scale
    assert vault.scale_of(stage.holding) == kept_scale
    assert vault.scale_of(Holding(3, 0, 3)) is None  # held nowhere
    rewritten = _small(8, 0, 3)  # the same step written again (after a rollback): re-read
    rewritten.scale = ScaleState(2.0**10, 0)
    vault.checkpoint(rewritten)
    assert vault.scale_of(own.holding) == ScaleState(2.0**10, 0)
