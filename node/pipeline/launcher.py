"""A whole training run on this machine: one ``pipeline_main`` process per stage replica.

``LocalSwarm`` starts the processes, hands each the others' addresses, relays their step
events, and always reaps them: on success it tells them to quit, on any failure (or Ctrl-C)
it terminates, then kills, every process it started, by pid.
"""

import contextlib
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.runner import roles_of
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


class _Process:
    def __init__(self, rank: int, role: Role, argv: list[str], events: Events) -> None:
        self.rank = rank
        self.role = role
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._events = events
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._events.put((self.rank, json.loads(line)))
            except ValueError:
                logger.debug("stage %s printed %r", self.role, line)
        self._events.put((self.rank, None))

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(_GRACE_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()


def run_swarm(
    config: TrainConfig,
    *,
    workdir: Path | None = None,
    start_timeout_s: float = 60.0,
    step_timeout_s: float = 60.0,
    threads: int = 1,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    log_level: str = "WARNING",
) -> SwarmResult:
    """Train ``config`` with every stage replica in its own process on 127.0.0.1."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fusionllm-")))
        workdir = Path(workdir)
        config_path = workdir / "run.json"
        config_path.write_text(config.to_json())
        roles = roles_of(config)
        last = roles.index(Role(config.stages - 1, 0))
        processes: list[_Process] = []
        events: Events = queue.Queue()

        def next_event(timeout: float) -> tuple[int, dict[str, Any]]:
            """The next event of any process; PipelineError on an error, an exit or silence."""
            try:
                rank, event = events.get(timeout=timeout)
            except queue.Empty:
                raise PipelineError(f"no stage process said anything for {timeout}s") from None
            role = roles[rank]
            if event is None:
                code = processes[rank].proc.poll()
                raise PipelineError(f"{role} exited early (code {code})")
            if event.get("event") == "error":
                raise PipelineError(f"{role} failed: {event.get('error')}")
            return rank, event

        try:
            for role in roles:
                name = f"stage{role.stage}_replica{role.replica}"
                argv = [
                    sys.executable, "-m", "fusionllm.node.pipeline.stage_main",
                    "--config", str(config_path),
                    "--stage", str(role.stage), "--replica", str(role.replica),
                    "--key", str(workdir / f"{name}.key"),
                    "--out", str(workdir / f"{name}.pt"),
                    "--threads", str(threads),
                    "--timeout", str(step_timeout_s),
                    "--log-level", log_level,
                ]  # fmt: skip
                processes.append(_Process(len(processes), role, argv, events))
            ready: dict[int, dict[str, Any]] = {}
            while len(ready) < len(processes):
                rank, event = next_event(start_timeout_s)
                if event["event"] == "ready":
                    ready[rank] = event
            peers = [
                {"stage": p.role.stage, "replica": p.role.replica,
                 "peer_id": ready[p.rank]["peer_id"], "addr": ready[p.rank]["addrs"][0]}
                for p in processes
            ]  # fmt: skip
            started = time.perf_counter()
            for p in processes:
                p.send({"cmd": "start", "peers": peers})
            steps: list[list[dict[str, Any]]] = [[] for _ in processes]
            done: list[dict[str, Any]] = []
            while len(done) < len(processes):
                # A first step includes dialing everyone; later ones only wait on frames.
                rank, event = next_event(start_timeout_s + step_timeout_s)
                if event["event"] == "step":
                    steps[rank].append(event)
                    if rank == last and on_step is not None:
                        on_step(event)
                elif event["event"] == "done":
                    done.append(event)
            seconds = time.perf_counter() - started
            for p in processes:
                p.send({"cmd": "quit"})
            # They exit together (transport close, torch teardown): one shared deadline.
            deadline = time.monotonic() + _EXIT_S
            for p in processes:
                try:
                    p.proc.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not exit within %ss of quit", p.role, _EXIT_S)
            parameters: dict[str, torch.Tensor] = {}
            for role in roles:
                if role.replica == 0:
                    name = f"stage{role.stage}_replica{role.replica}.pt"
                    parameters.update(torch.load(workdir / name, weights_only=True))
            return SwarmResult(
                losses=[e["loss"] for e in steps[last]],
                steps=[e for per_rank in steps for e in per_rank],
                parameters=parameters,
                seconds=seconds,
                done=done,
            )
        finally:
            for p in processes:
                p.stop()
