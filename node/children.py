"""``JsonChild``: a child process that talks JSON lines and is always reaped, with its tree.

The child writes one JSON value a line on stdout (its events; other lines are logged at debug
and dropped); a reader thread collects them. Started with ``stdin=True`` it also reads JSON
lines the parent ``send``s. ``kill`` (and leaving a ``with`` block) ends the child and every
process it started: a child killed with SIGKILL cannot take its own children down (a node's
DHT worker), and descendants that outlive a politely stopped child are terminated, then
killed. ``finish`` is the polite end for children that exit when their stdin closes.

Used by ``LocalSwarm`` (``fusionllm swarm``), the pipeline launcher (``fusionllm train``),
the integration tests and the benchmarks. It imports nothing of ``fusionllm.node``, so every
layer of the node may use it.
"""

import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from fusionllm.common.logs import get_logger
from fusionllm.dht.sockets import prefixes_in, remove_sockets

logger = get_logger(__name__)

_KILL_WAIT_S = 10.0  # for a child already sent SIGKILL
_REAP_S = 3.0  # descendants that outlive the child: time to exit, then after terminate
_READER_JOIN_S = 1.0
_DRAIN_S = 10.0  # an exited child's last lines: read in milliseconds unless the host is starved


class JsonChild:
    """A running child process, its JSON events and its stdin (when asked for).

    stderr: a path (the child's log, opened here and closed on kill), a file or file
    descriptor, or None to share the parent's. on_event: called in the reader thread with
    every event, then once with None when the child's output ends.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
        stderr: str | Path | int | IO | None = None,
        on_event: Callable[[Any], None] | None = None,
    ) -> None:
        self.name = name or Path(argv[0]).name
        self._events: list[Any] = []
        self._taken = 0  # events handed out by next_event
        self._ended = False
        self._drain_waited = False  # drain() gave up once: it does not wait again
        self._changed = threading.Condition()
        self._on_event = on_event
        self._log = open(stderr, "wb") if isinstance(stderr, str | Path) else None  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if stdin else None,
                stdout=subprocess.PIPE,
                stderr=self._log if self._log is not None else stderr,
                cwd=cwd,
                env=dict(env) if env is not None else None,
                text=True,
                encoding="utf-8",
                errors="replace",
            )
        except BaseException:
            if self._log is not None:
                self._log.close()
            raise
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-out", daemon=True)
        self._reader.start()

    def __enter__(self) -> "JsonChild":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    # ----- what it says -----------------------------------------------------------------------

    def _read(self) -> None:
        assert self.process.stdout is not None
        try:
            for line in self.process.stdout:
                try:
                    event = json.loads(line)
                except ValueError:
                    logger.debug("%s printed %r", self.name, line)
                    continue
                with self._changed:
                    self._events.append(event)
                    self._changed.notify_all()
                if self._on_event is not None:
                    self._on_event(event)
        except (OSError, ValueError):
            logger.debug("%s: its output was closed under the reader", self.name, exc_info=True)
        finally:
            if self._on_event is not None:
                self._on_event(None)
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def snapshot(self) -> list[Any]:
        """Every event so far, oldest first."""
        with self._changed:
            return list(self._events)

    def next_event(self, timeout: float) -> Any:
        """The oldest event not yet returned here. TimeoutError when none comes in ``timeout``
        seconds; EOFError when the child's output ended first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._taken >= len(self._events):
                self._wait(deadline, f"said nothing for {timeout}s")
            event = self._events[self._taken]
            self._taken += 1
            return event

    def wait_for(self, predicate: Callable[[Any], object], timeout: float) -> Any:
        """The first event (so far or to come) that ``predicate`` accepts. TimeoutError after
        ``timeout`` seconds; EOFError when the child's output ended without one."""
        deadline = time.monotonic() + timeout
        checked = 0
        with self._changed:
            while True:
                for event in self._events[checked:]:
                    if predicate(event):
                        return event
                checked = len(self._events)
                self._wait(deadline, f"sent no matching event in {timeout}s")

    def _wait(self, deadline: float, what: str) -> None:
        """One wait for a new event (the condition held); raises when none can come."""
        if self._ended:
            raise EOFError(f"{self.name} ended its output (exit code {self.process.poll()})")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.name} {what}")
        self._changed.wait(left)

    # ----- what it hears ----------------------------------------------------------------------

    def send(self, message: Any) -> bool:
        """Write ``message`` as one JSON line to the child's stdin; False if it is gone."""
        if self.process.stdin is None:
            raise RuntimeError(f"{self.name} was started without stdin")
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except (OSError, ValueError):  # a broken pipe, or stdin already closed
            return False
        return True

    def close_stdin(self) -> None:
        """End the child's input: a child that reads its stdin to the end exits."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()

    # ----- its end ----------------------------------------------------------------------------

    def alive(self) -> bool:
        """Whether the child runs. Once it has exited, False only after the reader took in
        what it wrote last (at most ``_DRAIN_S``): a reader starved on a loaded machine may
        be a pipe (64 KiB) and its buffers behind, ~150 of a node's step events, and whoever
        saw the child gone reads its events next."""
        if self.process.poll() is None:
            return True
        self.drain(_DRAIN_S)
        return False

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the reader to reach the end of the child's output;
        whether it did. Waits once: output some leftover descendant keeps open never ends."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._ended and not self._drain_waited:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._drain_waited = True
                    logger.debug("%s: its output did not end within %ss", self.name, timeout)
                    break
                self._changed.wait(left)
            return self._ended

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; subprocess.TimeoutExpired if it still runs after ``timeout``."""
        return self.process.wait(timeout)

    def finish(self, timeout: float) -> int | None:
        """The polite end: close stdin and give the child ``timeout`` seconds to exit by itself,
        then kill it. Reaps it (and its descendants) either way; returns the exit code."""
        if self.alive():
            self.close_stdin()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        return self.kill()

    def kill(self, sig: int = signal.SIGKILL, *, timeout: float = 20.0) -> int | None:
        """End the child and reap it with every process it started; safe to call again.

        ``sig`` goes to the child (with SIGKILL, to its descendants too: a child killed so
        cannot stop them itself); a child still running ``timeout`` seconds later is killed.
        Descendants that outlive it get a moment to exit, then are terminated, then killed.
        Closes the pipes and the log file. Returns the exit code.
        """
        descendants = _descendants(self.process.pid)
        sockets = prefixes_in([_command_line(p) for p in descendants])  # p2pd's, ours
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.send_signal(sig)
            if sig == signal.SIGKILL:
                for proc in descendants:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.kill()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.debug("%s did not exit within %ss of signal %s", self.name, timeout, sig)
                self.process.kill()
                self.process.wait(_KILL_WAIT_S)
        _reap(descendants)
        if not _running(descendants):  # nobody listens on them: hivemind removes a socket
            for prefix in sockets:  # only when it stops a p2pd still running
                remove_sockets(prefix)
        self._close_streams()
        return self.process.returncode

    def _close_streams(self) -> None:
        self.close_stdin()
        self._reader.join(_READER_JOIN_S)
        # Closing stdout under a reader still blocked in it would block here too: a stream
        # some process still holds stays open (the reader is a daemon thread).
        if not self._reader.is_alive() and self.process.stdout is not None:
            with contextlib.suppress(OSError):
                self.process.stdout.close()
        if self._log is not None:
            self._log.close()


def _command_line(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _descendants(pid: int) -> list[psutil.Process]:
    """Every process below ``pid`` now (once a process has exited, its orphans are not)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _reap(procs: list[psutil.Process]) -> None:
    """Give ``procs`` a moment to exit; terminate, then kill, those that do not."""
    alive = _wait_gone(procs, _REAP_S)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    alive = _wait_gone(alive, _REAP_S)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    _wait_gone(alive, _REAP_S)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` still running after up to ``timeout`` seconds. A zombie counts as
    gone: it is dead, and only its parent (not us: they are not our children) can reap it."""
    deadline = time.monotonic() + timeout
    alive = _running(procs)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = _running(alive)
    return alive


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    running = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
    return running
