"""A whole pipeline run in one process: the real ``PipelineRunner``s, one thread each, in memory.

``ThreadSwarm(config, dataset)`` builds the layout once and, per role of the run, what
``stage_main`` builds per process: a transport (here a ``MemoryTransport`` on one
``MemoryNetwork``, with the role's ``Expectations.expect`` hook) and a ``PipelineRunner`` over
it. ``run(steps)`` starts one thread per role, each calling ``run_step`` for every step. A
thread whose step raises keeps the error (and when it raised), then closes its transport and
runner and ends, as a stage process that exits does; its peers find out only through the
network. ``run`` returns once every thread has ended; a thread still running after
``join_timeout_s`` is a hang, reported as an AssertionError naming it (never waited out).
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Self

import torch

from fusionllm.common.logs import get_logger
from fusionllm.node.pipeline.compute import Compute
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.expectations import Expectations, roles_of
from fusionllm.node.pipeline.layout import PipelineLayout
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.runner import PipelineRunner, StepReport
from fusionllm.node.pipeline.train_config import TrainConfig, build_layout, build_model
from tests.support.memory_transport import (
    MemoryNetwork,
    MemoryTransport,
    MemoryTransportConfig,
)

logger = get_logger(__name__)


def peer_id_of(role: Role) -> str:
    return f"peer-{role.stage}.{role.replica}"


@dataclass
class RoleRun:
    """What one role's thread did."""

    reports: list[StepReport] = field(default_factory=list)
    error: BaseException | None = None
    failed_at: float | None = None  # time.monotonic() when run_step raised


class ThreadSwarm:
    """Every role of ``config`` as a ``PipelineRunner`` on its own thread; close it after use."""

    def __init__(
        self,
        config: TrainConfig,
        dataset: TokenDataset,
        *,
        timeout_s: float = 30.0,
        network: MemoryNetwork | None = None,
        layout: PipelineLayout | None = None,
        transport_config: MemoryTransportConfig | None = None,
        compute: Compute | None = None,
    ) -> None:
        self.config = config
        # On meta, as a stage process builds it: each runner makes only its own stage real.
        if layout is None:
            layout = build_layout(config, build_model(config, meta=True))
        self.layout = layout
        self.network = MemoryNetwork() if network is None else network
        self.roles = roles_of(config)
        self.peer_of = {role: peer_id_of(role) for role in self.roles}
        self.transports: dict[Role, MemoryTransport] = {}
        self.runners: dict[Role, PipelineRunner] = {}
        if transport_config is None and compute is not None and compute.is_cuda:
            # As a CUDA node's transport: frames land in pinned memory, one copy to the device.
            transport_config = MemoryTransportConfig(pin_decoded=True)
        for role in self.roles:
            expectations = Expectations(config, self.layout, role)
            transport = self.network.transport(
                self.peer_of[role], expect=expectations.expect, config=transport_config
            )
            self.transports[role] = transport
            self.runners[role] = PipelineRunner(
                config=config,
                layout=self.layout,
                role=role,
                dataset=dataset,
                transport=transport,  # type: ignore[arg-type]  # the same surface, in memory
                peers={r: p for r, p in self.peer_of.items() if r != role},
                timeout_s=timeout_s,
                compute=compute,
            )
        self.results: dict[Role, RoleRun] = {role: RoleRun() for role in self.roles}
        self._started = False

    @classmethod
    def trained(cls, config: TrainConfig, dataset: TokenDataset, **kwargs) -> Self:
        """A swarm that ran ``config.steps`` steps and is closed again."""
        swarm = cls(config, dataset, **kwargs)
        try:
            swarm.run()
        finally:
            swarm.close()
        return swarm

    # ----- running --------------------------------------------------------------------------------

    def run(self, steps: int | None = None, *, join_timeout_s: float = 60.0) -> dict[Role, RoleRun]:
        """Steps 0 .. steps - 1 (default ``config.steps``) on every role; see the module doc."""
        if self._started:
            raise RuntimeError("a ThreadSwarm runs once")
        self._started = True
        steps = self.config.steps if steps is None else steps
        threads = [
            threading.Thread(
                target=self._drive, args=(role, steps), name=f"runner-{role}", daemon=True
            )
            for role in self.roles
        ]
        for runner in self.runners.values():
            runner.start()
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + join_timeout_s
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        hung = [thread.name for thread in threads if thread.is_alive()]
        if hung:
            self.close()  # wakes them: every wait for a frame ends once the transports close
            raise AssertionError(f"still running after {join_timeout_s}s: {hung}")
        return self.results

    def _drive(self, role: Role, steps: int) -> None:
        result = self.results[role]
        try:
            for step in range(steps):
                result.reports.append(self.runners[role].run_step(step))
        except BaseException as exc:  # kept for the test to inspect, like a process's exit
            result.failed_at = time.monotonic()
            result.error = exc
            logger.debug("%s failed", role, exc_info=True)
            self.transports[role].close()
            self.runners[role].close()

    def close(self) -> None:
        # Transports first: a closed transport ends its runner's receive thread at once.
        self.network.close()
        for runner in self.runners.values():
            runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- results --------------------------------------------------------------------------------

    def errors(self) -> dict[Role, BaseException]:
        return {role: r.error for role, r in self.results.items() if r.error is not None}

    def losses(self) -> list[float]:
        """Per-step losses as the last stage's first replica saw them (every role agrees)."""
        last = Role(len(self.config.stage_replicas) - 1, 0)
        return [report.loss for report in self.results[last].reports]

    def parameters(self) -> dict[str, torch.Tensor]:
        """Canonical parameters of the run; every copy of one (tied, replicas) bit-identical."""
        params: dict[str, torch.Tensor] = {}
        for role in self.roles:
            for name, value in self.runners[role].worker.state_dict().items():
                if name in params:
                    torch.testing.assert_close(value, params[name], atol=0, rtol=0, msg=name)
                else:
                    params[name] = value
        return params
