"""Every source of the run's state a node can serve from: its live stage, its checkpoints, and
the copies other members gave it to keep (custody).

The live stage is the worker of the last plan this node served, valid before ``next_step``.
Checkpoints and custody copies are files (``checkpoints.py``), loaded on demand and cached
while a plan starts (the same file serves several parameters).
"""

import threading

import torch

from fusionllm.common.logs import get_logger
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.training.board import Copy
from fusionllm.node.training.checkpoints import (
    CheckpointError,
    CheckpointStore,
    StageState,
    file_name,
    state_digest,
)
from fusionllm.node.training.copies import digest48
from fusionllm.node.training.holdings import MAX_HOLDINGS, SEED_STEP, Holding, ParamsOf
from fusionllm.node.training.session_terms import Held

logger = get_logger(__name__)


class Vault:
    def __init__(
        self, *, own: CheckpointStore, custody: CheckpointStore, params_of: ParamsOf
    ) -> None:
        self.own = own
        self.custody = custody
        self._params_of = params_of  # needs the model's graph: called only once training runs
        self._lock = threading.Lock()
        # The live stage changes in place during a step (the optimizer's update comes before
        # set_live names the next step): copies of it are taken only between steps, and a
        # step does not begin while one is being taken.
        self._boundary = threading.Condition(self._lock)
        self._stepping = False
        self._copying = 0
        self._live: Held | None = None
        self._cache: dict[tuple[str, Holding], StageState] = {}
        self._scales: dict[tuple[str, Holding], ScaleState | None] = {}  # until a file is written

    # ----- live state ---------------------------------------------------------------------------

    @property
    def live(self) -> Held | None:
        return self._live

    def set_live(self, held: Held | None) -> None:
        """``held`` is the live stage now, at a step boundary (ends ``begin_step``)."""
        with self._boundary:
            self._live = held
            self._stepping = False
            self._cache.clear()
            self._boundary.notify_all()

    def begin_step(self) -> None:
        """The live stage is about to change in place: no copy of it until ``set_live``.
        Waits for a copy being taken to finish (a copy takes milliseconds)."""
        with self._boundary:
            self._boundary.wait_for(lambda: self._copying == 0)
            self._stepping = True

    def live_stage(self, timeout: float) -> StageState | None:
        """A copy of the live stage, labelled with the step it is the state before; taken
        between steps (waiting up to ``timeout`` for one in progress to end). None: no live
        stage, or still mid-step at the deadline."""
        with self._boundary:
            if not self._boundary.wait_for(lambda: not self._stepping, timeout):
                return None
            held, holding = self._live, self.live_holding()
            if held is None or holding is None:
                return None
            self._copying += 1
        try:
            state = {name: held.worker.export_state(name) for name in held.worker.parameters}
            return StageState(holding, state, held.assignment.digest, scale=held.scale)
        finally:
            with self._boundary:
                self._copying -= 1
                self._boundary.notify_all()

    def live_holding(self) -> Holding | None:
        held = self._live
        if held is None or held.assignment.role is None:
            return None
        start, stop = held.assignment.ranges[held.assignment.role.stage]
        return Holding(held.next_step, start, stop)

    # ----- what we announce, and serve ---------------------------------------------------------

    def holdings(self) -> list[Holding]:
        """Live state first, then our checkpoints, then custody copies; newest first in each,
        step 0 left out (anyone can build it), at most MAX_HOLDINGS."""
        live = self.live_holding()
        found = [live] if live else []
        found.extend(h for h in self.stored_holdings() if h not in found)
        return [h for h in found if h.step != SEED_STEP][:MAX_HOLDINGS]

    def stored_holdings(self) -> list[Holding]:
        """Our checkpoints, then custody copies (files: they do not change under a step)."""
        found: list[Holding] = []
        for store in (self.own, self.custody):
            found.extend(h for h in store.holdings() if h not in found)
        return found

    def export(self, holding: Holding, name: str) -> torch.Tensor:
        """One parameter's state (``StageWorker.export_state`` layout) from ``holding``."""
        held = self._live
        if held is not None and holding == self.live_holding():
            return held.worker.export_state(name)
        for store in (self.own, self.custody):
            if holding in store.holdings():
                state = self._load(store, holding).state
                if name in state:
                    return state[name]
        raise CheckpointError(f"no state of {name!r} in {holding}")

    def scale_of(self, holding: Holding) -> ScaleState | None:
        """fp16's loss scale at ``holding``'s step, as its source says (None: none known)."""
        held = self._live
        if held is not None and holding == self.live_holding():
            return held.scale
        for store in (self.own, self.custody):
            if holding in store.holdings():
                key = (str(store.directory), holding)
                if key not in self._scales:
                    self._scales[key] = store.scale_of(holding)
                return self._scales[key]
        return None

    def stored_stage(self, holding: Holding) -> StageState:
        """The whole state of ``holding`` from a file (the live stage: ``live_stage``)."""
        for store in (self.own, self.custody):
            if holding in store.holdings():
                return self._load(store, holding)
        raise CheckpointError(f"nothing holds {holding}")

    def _load(self, store: CheckpointStore, holding: Holding) -> StageState:
        key = (str(store.directory), holding)
        with self._lock:
            cached = self._cache.get(key)
        if cached is None:
            cached = store.load(holding)
            with self._lock:
                self._cache = {key: cached}  # one file at a time: bounded memory
        return cached

    def discard_after(self, step: int) -> None:
        """The swarm went back to ``step``: files of later steps belong to an abandoned future."""
        for store in (self.own, self.custody):
            for holding in store.holdings():
                if holding.step > step:
                    (store.directory / file_name(holding)).unlink(missing_ok=True)
                    logger.info("dropped %s: the swarm resumed from step %d", holding, step)

    # ----- writing --------------------------------------------------------------------------------

    def checkpoint(self, stage: StageState) -> None:
        self.own.save(stage)
        self._scales.clear()  # a file of the same name may have been written again

    def keep_copy(self, copy: Copy) -> bool:
        """Keep a member's stage state once it checks out; False (logged) if it does not."""
        expected = self._params_of(copy.holding.start, copy.holding.stop)
        if set(copy.state) != expected:
            logger.warning(
                "a copy of %s from %s has the wrong parameters: dropped",
                copy.holding, copy.peer[:16],
            )  # fmt: skip
            return False
        if digest48(state_digest(copy.state)) != copy.digest48:
            logger.warning("a copy of %s from %s fails its digest: dropped", copy.holding,
                           copy.peer[:16])  # fmt: skip
            return False
        if not all(bool(torch.isfinite(t).all()) for t in copy.state.values()):
            logger.warning("a copy from %s holds non-finite values: dropped", copy.peer[:16])
            return False
        self.custody.save(StageState(copy.holding, dict(copy.state), scale=copy.scale))
        self._scales.clear()
        logger.debug("keeping %s of %s for %s", copy.holding, len(copy.state), copy.peer[:16])
        return True
