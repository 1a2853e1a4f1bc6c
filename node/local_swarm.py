"""Real ``fusionllm node`` processes on one machine, for integration tests and benchmarks.

Each node runs with ``--events`` as a ``JsonChild`` (children.py) that collects its JSON event
lines; its log and its events go to files (``NAME.log``, ``NAME.events.jsonl``; a restart's
``NAME.1.log``...), which a later swarm on the same root writes afresh, so the two always tell
of the same process. Waits have deadlines, and ``LocalSwarm.close`` kills every
process (and the DHT worker of a node killed with SIGKILL, which cannot take it down itself).
"""

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fusionllm.node.children import JsonChild
from fusionllm.node.cli.config import ENV_PREFIX

# Fast timing for tests: a record lives 5 s after its last 1 s heartbeat; epochs of 2 s.
FAST = {
    "heartbeat": 1.0,
    "ttl": 5.0,
    "epoch": 2.0,
    "probe-interval": 2.0,
    "probe-kib": 64,
    "probe-fanout": 2,
    # No rehearsal (rehearsal.py): these swarms' nodes share one machine's cores and start
    # together, and most advertise a made-up device (TEST_DEVICE) a rehearsal would belie.
    "rehearse-s": 0,
}

# For a swarm that trains on one small machine: FAST's 2 s epochs and probes cost ~25% of
# the training throughput on 2 cores (benchmarks/swarm.py); this costs ~5%.
CALM = {"heartbeat": 2.0, "ttl": 10.0, "epoch": 5.0, "probe-interval": 10.0}

TEST_DEVICE = {
    "name": "test-cpu",
    "kind": "cpu",
    "memory_bytes": 4 << 30,
    "flops": 1.3e11,
    "memory_bandwidth": 4.9e9,
    "op_overhead": 1.8e-5,
    "cpu_cores": 2,
    "ram_bytes": 24 << 30,
}


class NodeProcess:
    """A ``fusionllm node --events`` process: its events, its log file, its process tree."""

    def __init__(
        self, name: str, args: list[str], log_path: Path, *, prefix: Sequence[str] = ()
    ) -> None:
        self.name = name
        self.log_path = log_path
        # Only the options given here: a FUSIONLLM_* variable or file meant for the command
        # that started this swarm (``fusionllm swarm --config``) is not the node's.
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env["PYTHONUNBUFFERED"] = "1"
        argv = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "INFO", "node"]
        # Its events go next to its log too: what a failed run did, step by step, stays on disk.
        # Rewritten as the log is (JsonChild): appended, a reused root mixed runs' events.
        self._events_file = log_path.with_suffix(".events.jsonl").open("w", encoding="utf-8")
        try:
            self._child = JsonChild([*prefix, *argv, *args], name=name, env=env,
                                    stderr=log_path, on_event=self._keep)  # fmt: skip
        except BaseException:
            self._events_file.close()
            raise
        self.process = self._child.process

    def _keep(self, event: dict | None) -> None:
        if event is None:  # its output ended
            self._events_file.close()
            return
        self._events_file.write(json.dumps(event) + "\n")
        self._events_file.flush()

    @property
    def events(self) -> list[dict]:
        """Every event so far (a copy), oldest first."""
        return self._child.snapshot()

    def snapshot(self) -> list[dict]:
        return self._child.snapshot()

    def last(self, kind: str) -> dict | None:
        return next((e for e in reversed(self.snapshot()) if e["event"] == kind), None)

    @property
    def peer_id(self) -> str:
        ready = self.last("ready")
        return ready["peer_id"] if ready else ""

    @property
    def dht_addr(self) -> str:
        return self.last("ready")["dht_addrs"][0]

    def alive(self) -> bool:
        return self._child.alive()

    def kill(self, sig: int = signal.SIGKILL, *, timeout: float = 20.0) -> None:
        """Stop the node with ``sig`` and reap it with its DHT worker (a SIGKILLed node cannot
        take the worker down itself); SIGKILL if it has not exited ``timeout`` s after."""
        self._child.kill(sig, timeout=timeout)


class LocalSwarm:
    """Node processes of one swarm, all with the same settings."""

    def __init__(
        self, root: Path, *, extra: dict | None = None, device: dict | None = None
    ) -> None:
        self.root = root
        self.options = {**FAST, **(extra or {})}
        self.device_path = root / "device.json"
        self.device_path.write_text(json.dumps(device or TEST_DEVICE))
        self.nodes: list[NodeProcess] = []

    def start(
        self,
        name: str,
        *,
        bootstrap: str | None = None,
        device: dict | None = None,
        extra: dict | None = None,
        prefix: Sequence[str] = (),
    ) -> NodeProcess:
        """Start node ``name`` (its key, work dir and log named after it under ``root``; a
        restart with the same name is the same node); ``device``: advertise this device
        instead of the swarm's; ``extra``: options for this node only; ``prefix``: a command
        the node runs under, which must exec it (a testbed host's
        ``Testbed.command(host, [])``)."""
        device_path = self.device_path
        if device is not None:
            device_path = self.root / f"{name}.device.json"
            device_path.write_text(json.dumps(device))
        args = ["--key", str(self.root / f"{name}.key"), "--device-json", str(device_path)]
        args += ["--events"]
        for option, value in {**self.options, **(extra or {})}.items():
            if value is True:
                args.append(f"--{option}")
            elif value is not None and value is not False:
                args += [f"--{option}", str(value)]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        restarts = sum(1 for n in self.nodes if n.name == name)
        log = self.root / (f"{name}.log" if not restarts else f"{name}.{restarts}.log")
        node = NodeProcess(name, args, log, prefix=prefix)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()

    def logs(self) -> str:
        parts = []
        for node in self.nodes:
            with contextlib.suppress(OSError):
                parts.append(f"--- {node.log_path.name}\n" + node.log_path.read_text()[-3000:])
        return "\n".join(parts)


def wait_for(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.2):
    """Poll ``predicate`` until truthy; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def same_plan(nodes, *, members: int, since: float = 0.0, without: str = "") -> dict | None:
    """The latest epoch event of the nodes if they all adopted the same plan, see ``members``
    peers (``without`` not among them) and wrote it after ``since``; else None."""
    latest = [n.last("epoch") for n in nodes]
    for event in latest:
        if event is None or event["t"] < since or len(event["members"]) != members:
            return None
        if without in event["members"]:
            return None
    return latest[0] if len({e["digest"] for e in latest}) == 1 else None


# ----- reading a churning swarm's events (tests and benchmarks/churn.py) --------------------


def trained_steps(node: NodeProcess) -> dict[int, float]:
    """step -> loss, as the node reported them (a step recomputed after a rollback: the last)."""
    return {e["step"]: e["loss"] for e in node.snapshot() if e["event"] == "step"}


def last_step(nodes: list[NodeProcess]) -> int:
    """The newest step any node reported finishing (-1: none)."""
    return max((s for n in nodes for s in trained_steps(n)), default=-1)


def plans_started(node: NodeProcess) -> list[dict]:
    return [e for e in node.snapshot() if e["event"] == "train_plan"]


def serving(nodes: list[NodeProcess]) -> list[NodeProcess]:
    """Alive nodes whose newest plan is still running."""
    found = []
    for node in nodes:
        kinds = [e["event"] for e in node.snapshot() if e["event"] in ("train_plan", "plan_end")]
        if node.alive() and kinds and kinds[-1] == "train_plan":
            found.append(node)
    return found


def rollbacks(nodes: list[NodeProcess], since: float) -> list[int]:
    """For every plan a node started after ``since`` (wall clock): how many finished steps
    it went back over (the newest step finished anywhere before it, minus its start)."""
    finished = [(e["t"], e["step"]) for n in nodes for e in n.snapshot() if e["event"] == "step"]
    lost = []
    for node in nodes:
        for plan in plans_started(node):
            if plan["t"] > since:
                done = max((s + 1 for t, s in finished if t < plan["t"]), default=0)
                lost.append(done - plan["start_step"])
    return lost


def first_step_after(nodes: list[NodeProcess], since: float) -> float | None:
    """Wall-clock time of the first step finished by a plan started after ``since``."""
    starts = [p["t"] for n in nodes for p in plans_started(n) if p["t"] > since]
    if not starts:
        return None
    begun = min(starts)
    times = [e["t"] for n in nodes for e in n.snapshot() if e["event"] == "step" and e["t"] > begun]
    return min(times, default=None)
