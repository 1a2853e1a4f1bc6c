"""``fusionllm status --watch`` inside a testbed host, for a reading of the swarm mid-run.

A one-off status call starts its own DHT daemon before it reads (10-70 s on a loaded machine),
and the benchmark's fast runs finished their last 20 steps in 2-6 s: the call then met no
bootstrap node ("failed to connect to bootstrap peers", four attempts) and the run recorded no
links (every A run and B's OP-Fence runs in docs/results.md). The watcher starts once every
node is ready, reads every ``interval_s``, and the run keeps the first reading at or past the
step it wants. It runs in the host's network namespace but outside its CPU quota: an observer
(a user's laptop), not a share of the host's compute taken from its node.
"""

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time

import psutil

from fusionllm.testbed.bed import Testbed

_STOP_WAIT_S = 20.0


class StatusWatch:
    """Started with the swarm's bootstrap address; ``reading(step)``, then ``close()``."""

    def __init__(self, bed: Testbed, host: str, bootstrap: str, *, interval_s: float = 2.0):
        argv = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING",
                "status", "--bootstrap", bootstrap, "--json", "--watch", "--interval",
                f"{interval_s:g}", "--timeout", "120"]  # fmt: skip
        enter = [sys.executable, "-m", "fusionllm.testbed.enter", "--netns", bed.netns(host)]
        self.started = time.monotonic()
        self._process = subprocess.Popen([*enter, "--", *argv], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)  # fmt: skip
        self._readings: list[dict] = []
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_errors, daemon=True)]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def _read(self) -> None:
        for line in self._process.stdout:
            with contextlib.suppress(ValueError):
                status = json.loads(line)
                status["call_s"] = time.monotonic() - self.started  # since the watch started
                with self._lock:
                    self._readings.append(status)

    def _read_errors(self) -> None:
        for line in self._process.stderr:
            with self._lock:
                self._errors = [*self._errors[-20:], line]

    def reading(self, step: int) -> dict:
        """The first reading whose swarm step is ``step`` or later, else the newest one; with
        the error output where there is none."""
        with self._lock:
            readings, errors = list(self._readings), "".join(self._errors)
        later = [r for r in readings if (r.get("step") or -1) >= step]
        if later or readings:
            return {**(later or readings)[0 if later else -1], "readings": len(readings)}
        return {"error": errors[-500:] or "no reading", "readings": 0}

    def close(self) -> None:
        """SIGTERM (the watcher closes its DHT client), then kill what is left."""
        with contextlib.suppress(ProcessLookupError):
            self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(psutil.NoSuchProcess):
                tree = psutil.Process(self._process.pid)
                for proc in [*tree.children(recursive=True), tree]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.kill()
            self._process.wait(_STOP_WAIT_S)
        for thread in self._threads:
            thread.join(timeout=5)
