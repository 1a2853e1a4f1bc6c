"""A donor's copies of its live stage against a step in progress.

The real step loop (``PlanSession._steps``), vault and donate path (``Donor.donate``)
around fakes: a runner whose step changes the stage in place and then holds, as a stage stands
after AdamW's ``clip_and_step`` and before ``set_live`` names the next step, and a transport
that records the copies. Events order every move: no timing decides what a test sees.
"""

import threading
from types import SimpleNamespace

import pytest
import torch

from fusionllm.common.run_spec import RunSpec
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.runner import StepReport
from fusionllm.node.training import donor as donor_module
from fusionllm.node.training.checkpoints import CheckpointStore, StageState
from fusionllm.node.training.donor import Donor as Donations
from fusionllm.node.training.holdings import Holding
from fusionllm.node.training.session import PlanSession
from fusionllm.node.training.session_terms import Held, Outcome
from fusionllm.node.training.vault import Vault

RANGE = (0, 4)  # the stage's node range
STEP = 3  # the step held mid-way


class Worker:
    """A stage with one parameter, ``STEP`` everywhere before step ``STEP``; ``export_state``
    copies, as StageWorker's does."""

    def __init__(self) -> None:
        self.parameters = {"w": torch.nn.Parameter(torch.full((4,), float(STEP)))}  # (4,)

    def export_state(self, name: str) -> torch.Tensor:
        return self.parameters[name].detach().clone()


class Runner:
    """Step ``k`` updates the parameter in place to ``k + 1``, then holds until released."""

    def __init__(self) -> None:
        self.worker = Worker()
        self.roles: list[Role] = []
        self.completed_steps: int | None = None
        self.updated, self.release = threading.Event(), threading.Event()

    def run_step(self, step: int) -> StepReport:
        with torch.no_grad():
            self.worker.parameters["w"].fill_(step + 1.0)
        self.updated.set()
        assert self.release.wait(30.0), "the test never released the step"
        return StepReport(step, loss=1.0, grad_norm=1.0, seconds=0.0, busy_s=0.0, wait_s=0.0)

    def scale_state(self) -> None:  # an fp32 run: no loss scale
        return None


class Donor:
    """One node: a session stepping from ``STEP`` and the trainer's donate path on its vault."""

    def __init__(self, tmp_path, monkeypatch) -> None:
        self.vault = Vault(
            own=CheckpointStore(tmp_path / "own"),
            custody=CheckpointStore(tmp_path / "custody"),
            params_of=lambda start, stop: frozenset({"w"}),
        )
        self.runner = Runner()
        assignment = SimpleNamespace(role=Role(0, 0), ranges=(RANGE,), digest="ab" * 32)
        self.session = object.__new__(PlanSession)
        self.session.__dict__.update(
            vault=self.vault,
            runner=self.runner,
            assignment=assignment,
            layout=None,
            vote=0.5,
            hooks=SimpleNamespace(fault_stall_after=0, fault_abandon_after=0),
        )
        self.session.parting = SimpleNamespace(checkpoint=lambda held, resumed=False: None)
        self.trainer = Donations(
            run=RunSpec(),
            peer_id="peer-a",
            view=SimpleNamespace(send_bytes_per_s=lambda peer: 1e6),
            vault=self.vault,
            board=SimpleNamespace(names=["w"], state_bytes=lambda names: 1 << 20),
            transport=None,
            connect=lambda peer: None,
            emit=lambda event: None,
            keeper=None,
            stop=threading.Event(),
        )
        self.sent: list[tuple[str, StageState]] = []
        self.done: list[tuple[str, int]] = []
        monkeypatch.setattr(donor_module, "send_copy", self._send_copy)
        monkeypatch.setattr(donor_module, "send_done", self._send_done)
        self.vault.set_live(Held(assignment, None, self.runner.worker, STEP))
        self.ending: list = []
        self._thread = threading.Thread(target=self._step_once, daemon=True)

    def _send_copy(self, transport, dst, stage, names, timeout) -> list:
        self.sent.append((dst, stage))
        return []

    def _send_done(self, transport, dst, floor, sent) -> None:
        self.done.append((dst, sent))

    def _step_once(self) -> None:
        stop = threading.Event()
        ending = self.session._steps(STEP, last_step=STEP + 1, stop=stop, on_step=lambda r: None)
        self.ending.append(ending)

    def hold_mid_step(self) -> None:
        """Run step ``STEP`` up to its update, and hold it there."""
        self._thread.start()
        assert self.runner.updated.wait(30.0)

    def finish_step(self) -> None:
        self.runner.release.set()
        self._thread.join(30.0)
        assert not self._thread.is_alive()


@pytest.fixture
def donor(tmp_path, monkeypatch):
    made = Donor(tmp_path, monkeypatch)
    yield made
    made.runner.release.set()  # never leave the step thread behind, whatever failed
    if made._thread.is_alive():
        made._thread.join(30.0)


def _label_matches_content(stage: StageState) -> bool:
    """The state before step k holds ``w == k`` (step k - 1 leaves it at k)."""
    return torch.equal(stage.state["w"], torch.full((4,), float(stage.holding.step)))


def test_a_donor_that_stays_mid_step_gives_no_copy_under_the_old_steps_name(
    donor, monkeypatch
) -> None:
    """Asked while a step holds after its update, the donor refuses the live stage once its
    wait runs out (DONE, nothing sent); before the fix it sent the updated state named STEP,
    and the new members redid that step."""
    monkeypatch.setattr(donor_module, "_LIVE_COPY_WAIT_S", 0.2)
    donor.hold_mid_step()
    donor.trainer.donate("peer-c", 0)  # the step is held all along: it cannot end meanwhile
    wrong = [(s.holding, s.state["w"].tolist()) for _, s in donor.sent if s.holding.step == STEP]
    assert not wrong, f"a copy taken mid-step holds the update under the old name: {wrong}"
    assert donor.sent == []
    assert donor.done == [("peer-c", 0)]
    donor.finish_step()
    assert donor.ending[0].outcome is Outcome.FINISHED
    donor.trainer.donate("peer-d", 0)
    ((to, stage),) = donor.sent
    assert (to, stage.holding) == ("peer-d", Holding(STEP + 1, *RANGE))
    assert _label_matches_content(stage)


def test_a_donor_asked_mid_step_waits_for_the_step_and_names_its_copy_after_it(donor) -> None:
    donor.hold_mid_step()
    asking = threading.Thread(target=donor.trainer.donate, args=("peer-c", 0), daemon=True)
    asking.start()
    donor.finish_step()  # whether the copy waited or came after: the same answer
    asking.join(30.0)
    assert not asking.is_alive()
    ((_, stage),) = donor.sent
    assert stage.holding == Holding(STEP + 1, *RANGE)
    assert _label_matches_content(stage)
    assert donor.done == [("peer-c", 1)]
