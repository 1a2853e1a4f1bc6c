"""A whole training run on this machine: one ``stage_main`` process per stage replica.

``run_swarm`` starts the processes (each a ``JsonChild``), hands each the others' addresses,
relays their step events, and always reaps them: on success it tells them to quit, on any
failure (or Ctrl-C) it terminates, then kills, every process it started, by pid.
"""

import contextlib
import queue
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusionllm.common.cpus import available_cores, spread
from fusionllm.common.logs import get_logger
from fusionllm.node.children import JsonChild
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.expectations import roles_of
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.train_config import TrainConfig

logger = get_logger(__name__)

_GRACE_S = 3.0
_EXIT_S = 15.0  # all processes, after quit; a few tear torch down at once on few cores


@dataclass
class SwarmResult:
    losses: list[float]  # per step, as the last stage's first replica saw them
    steps: list[dict[str, Any]]  # every process's step events, by rank then step
    parameters: dict[str, torch.Tensor]  # canonical names, from replica 0 of each stage
    seconds: float  # wall time from the start command to the last "done"
    done: list[dict[str, Any]]


Events = queue.Queue[tuple[int, dict[str, Any] | None]]  # (rank, event or None at exit)


def run_swarm(
    config: TrainConfig,
    *,
    workdir: Path | None = None,
    start_timeout_s: float = 60.0,
    step_timeout_s: float = 60.0,
    threads: int = 1,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    log_level: str = "WARNING",
    pin_cores: bool = True,
    device: str = "cpu",
) -> SwarmResult:
    """Train ``config`` with every stage replica in its own process on 127.0.0.1.

    ``pin_cores``: each process runs on cores of its own (``threads`` of them; processes share
    cores only when there are more than the host has), not wherever the OS moves it.
    ``device``: where every process computes (``compute.resolve_device``; several processes
    may share one GPU)."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fusionllm-")))
        workdir = Path(workdir)
        config_path = workdir / "run.json"
        config_path.write_text(config.to_json())
        roles = roles_of(config)
        last = roles.index(Role(config.stages - 1, 0))
        stages = _Stages(roles)
        stack.callback(stages.stop)  # after quit on success; on any failure or Ctrl-C
        options = ["--threads", str(threads), "--timeout", str(step_timeout_s)]
        options += ["--device", device]
        placement = spread(len(roles), threads, available_cores()) if pin_cores else None
        for rank, role in enumerate(roles):
            cpus = [] if placement is None else ["--cpus", ",".join(map(str, placement[rank]))]
            stages.start(_stage_argv(config_path, workdir, role, options + cpus, log_level))
        peers = stages.wait_ready(start_timeout_s)
        started = time.perf_counter()
        stages.send_all({"cmd": "start", "peers": peers})
        # A first step includes dialing everyone; later ones only wait on frames.
        steps, done = stages.train(start_timeout_s + step_timeout_s, last, on_step)
        seconds = time.perf_counter() - started
        stages.quit()
        parameters: dict[str, torch.Tensor] = {}
        for role in roles:
            if role.replica == 0:
                parameters.update(torch.load(workdir / f"{_name(role)}.pt", weights_only=True))
        return SwarmResult(
            losses=[e["loss"] for e in steps[last]],
            steps=[e for per_rank in steps for e in per_rank],
            parameters=parameters,
            seconds=seconds,
            done=done,
        )


def _name(role: Role) -> str:
    return f"stage{role.stage}_replica{role.replica}"


def _stage_argv(
    config_path: Path, workdir: Path, role: Role, options: list[str], log_level: str
) -> list[str]:
    name = _name(role)
    return [
        sys.executable, "-m", "fusionllm.node.pipeline.stage_main",
        "--config", str(config_path),
        "--stage", str(role.stage), "--replica", str(role.replica),
        "--key", str(workdir / f"{name}.key"),
        "--out", str(workdir / f"{name}.pt"),
        *options,
        "--log-level", log_level,
    ]  # fmt: skip


class _Stages:
    """The stage processes of one run, by rank, and their events merged into one queue."""

    def __init__(self, roles: list[Role]) -> None:
        self.roles = roles
        self.children: list[JsonChild] = []
        self.events: Events = queue.Queue()

    def start(self, argv: list[str]) -> None:
        """Start the process of the next rank."""
        rank = len(self.children)
        child = JsonChild(argv, name=str(self.roles[rank]), stdin=True, on_event=self._relay(rank))
        self.children.append(child)

    def _relay(self, rank: int) -> Callable[[dict[str, Any] | None], None]:
        return lambda event: self.events.put((rank, event))

    def next_event(self, timeout: float) -> tuple[int, dict[str, Any]]:
        """The next event of any process; PipelineError on an error, an exit or silence."""
        try:
            rank, event = self.events.get(timeout=timeout)
        except queue.Empty:
            raise PipelineError(f"no stage process said anything for {timeout}s") from None
        role = self.roles[rank]
        if event is None:
            code = self.children[rank].process.poll()
            raise PipelineError(f"{role} exited early (code {code})")
        if event.get("event") == "error":
            raise PipelineError(f"{role} failed: {event.get('error')}")
        return rank, event

    def wait_ready(self, timeout: float) -> list[dict[str, Any]]:
        """Every process's peer id and address, once all are ready."""
        ready: dict[int, dict[str, Any]] = {}
        while len(ready) < len(self.children):
            rank, event = self.next_event(timeout)
            if event["event"] == "ready":
                ready[rank] = event
        return [
            {"stage": role.stage, "replica": role.replica,
             "peer_id": ready[rank]["peer_id"], "addr": ready[rank]["addrs"][0]}
            for rank, role in enumerate(self.roles)
        ]  # fmt: skip

    def send_all(self, command: dict[str, Any]) -> None:
        for child in self.children:
            child.send(command)

    def train(
        self, timeout: float, last: int, on_step: Callable[[dict[str, Any]], None] | None
    ) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
        """Every process's step events (by rank) and its "done" event, once all are done;
        ``on_step`` sees the steps of rank ``last``."""
        steps: list[list[dict[str, Any]]] = [[] for _ in self.children]
        done: list[dict[str, Any]] = []
        while len(done) < len(self.children):
            rank, event = self.next_event(timeout)
            if event["event"] == "step":
                steps[rank].append(event)
                if rank == last and on_step is not None:
                    on_step(event)
            elif event["event"] == "done":
                done.append(event)
        return steps, done

    def quit(self) -> None:
        self.send_all({"cmd": "quit"})
        # They exit together (transport close, torch teardown): one shared deadline.
        deadline = time.monotonic() + _EXIT_S
        for role, child in zip(self.roles, self.children, strict=True):
            try:
                child.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not exit within %ss of quit", role, _EXIT_S)

    def stop(self) -> None:
        """Terminate, then kill, every process still running; reap them all."""
        for child in self.children:
            child.kill(signal.SIGTERM, timeout=_GRACE_S)
