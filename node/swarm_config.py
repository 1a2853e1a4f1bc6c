"""What a node that trains is configured with: the control plane's ``NodeConfig`` and the runtime's
settings. Its own module so that ``swarm_node`` (which builds the node) and ``swarm_training``
(which builds the trainer, with torch) both read it without importing each other.
"""

from dataclasses import dataclass
from pathlib import Path

from fusionllm.common.errors import ConfigError
from fusionllm.common.run_spec import RunSpec
from fusionllm.node.control.node_config import NodeConfig


@dataclass(frozen=True, kw_only=True)
class SwarmNodeConfig:
    node: NodeConfig
    work_dir: Path
    step_timeout_s: float = 60.0
    barrier_grace_s: float = 30.0  # the READY barrier's wait for a member (training/session.py)
    checkpoint_pause_s: float = 0.0  # fault injection: sleep between a write and its rename
    fault_stall_after: int = 0  # fault injection: stop sending after this many steps of a plan
    fault_abandon_after: int = 0  # fault injection: abandon a step after this many of a plan, once
    fault_under_report: float = 1.0  # fault injection: report this many times less compute
    fault_late_barrier_s: float = 0.0  # fault injection: come late to the first plan's barrier
    train: bool = True  # False: the control plane alone (tests and benchmarks of it)
    pin_cores: bool = False  # while serving a plan, compute on cores picked by our rank in it
    # This node's copy of the data (RunSpec names it by digest); None: the stdlib source.
    data_path: Path | None = None
    data_dtype: str | None = None  # a token file's element type (default uint16)
    device: str = "cpu"  # where the stages this node serves compute (--device)
    metrics: tuple[str, int] | None = None  # (host, port) of Prometheus metrics (--metrics)
    # "serve": a StageServer (node/serve/) instead of a trainer; needs a model folder.
    task: str = "train"
    serve_limits: object | None = None  # node.serve.sessions.ServeLimits; None: its defaults

    def __post_init__(self) -> None:
        if self.task not in ("train", "serve"):
            raise ConfigError(f"task must be train or serve, got {self.task!r}")
        if self.task == "serve" and not self.run.model_dir:
            raise ConfigError("--task serve needs --model-dir (a Hugging Face folder)")

    @property
    def run(self) -> RunSpec:
        return self.node.settings.run
