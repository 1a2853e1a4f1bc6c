"""``WorkerProcess``: one DHT worker process (dht/worker.py), its pipe and its reply reader.

A reader thread matches replies to futures by the tag on the wire (dht/wire.py). A reply the
reader refuses (over ``max_reply_bytes``, or not a msgpack map) fails that one request with
``DhtError`` and the reader goes on; only a pipe that ends or loses its framing stops it, and
then ``on_exit`` tells the owner (DhtClient restarts the worker).

The worker runs in a process group of its own, which its child, hivemind's Go daemon (p2pd),
joins: killing the group kills both, even after the worker died by SIGKILL (which cannot
take p2pd down itself). The group outlives the worker while p2pd runs, so its id cannot be
reused meanwhile. Its own group also keeps a terminal's Ctrl-C away from the worker and
p2pd: the node stops them in order. Once the group is gone, p2pd's unix sockets (named with a
prefix of this worker's own, dht/sockets.py) are removed: hivemind leaves its daemon's socket
behind unless it stopped a p2pd still running.
"""

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dht.sockets import new_prefix, remove_sockets
from fusionllm.dht.wire import (
    MessageError,
    PipeClosedError,
    read_message,
    read_tagged,
    write_message,
)

logger = get_logger(__name__)

_STOP_WAIT_S = 15.0
_KILL_WAIT_S = 5.0


class DhtError(FusionError):
    """The DHT worker failed, timed out, sent a reply we refuse, or is gone."""


class WorkerProcess:
    """Start with ``start``; ``submit`` requests from any thread; ``close`` or ``kill`` once."""

    def __init__(
        self,
        worker_config: dict[str, Any],
        *,
        max_reply_bytes: int,
        on_exit: Callable[["WorkerProcess"], None] = lambda _worker: None,
        command: tuple[str, ...] | None = None,  # None: dht/worker.py
    ) -> None:
        self._worker_config = worker_config
        self._max_reply_bytes = max_reply_bytes
        self._on_exit = on_exit
        self._command = command or (sys.executable, "-m", "fusionllm.dht.worker")
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._tags = itertools.count(1)
        self._stopping = False
        self._group_killed = False
        self.exited = threading.Event()  # the reader has ended: no reply will come any more
        self.pid = 0
        self.socket_prefix = new_prefix()  # p2pd's unix sockets: ours to remove (sockets.py)

    def start(self, timeout_s: float) -> dict[str, Any]:
        """Spawn, send the config, wait for the hello; DhtError (and the worker gone) if not ok."""
        self._process = subprocess.Popen(
            self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
        )
        self.pid = self._process.pid
        started: Future = Future()

        def handshake() -> None:
            try:
                started.set_result(read_message(self._process.stdout))
            except Exception as exc:
                started.set_exception(exc)

        try:
            config = {**self._worker_config, "socket_prefix": self.socket_prefix}
            write_message(self._process.stdin, config)
            threading.Thread(target=handshake, name="dht-hello", daemon=True).start()
            hello = started.result(timeout=timeout_s)
        except (FutureTimeout, PipeClosedError, MessageError, OSError) as exc:
            self.kill()
            raise DhtError(f"the DHT worker did not start: {exc!r}") from exc
        if not isinstance(hello, dict) or not hello.get("ok"):
            self.kill()
            error = hello.get("error") if isinstance(hello, dict) else repr(hello)
            raise DhtError(f"the DHT worker failed to start: {error}")
        threading.Thread(target=self._read_replies, name="dht-replies", daemon=True).start()
        threading.Thread(target=self._watch, name="dht-watch", daemon=True).start()
        return hello

    def submit(self, message: dict[str, Any]) -> Future:
        """Send one request; its future gets the reply map (``ok`` not yet checked)."""
        process = self._process
        if process is None or self.exited.is_set():
            raise DhtError("the DHT worker is not running")
        future: Future = Future()
        with self._lock:
            tag = next(self._tags)
            self._pending[tag] = future
            try:
                write_message(process.stdin, message, tag=tag)
            except (OSError, ValueError, MessageError) as exc:
                self._pending.pop(tag, None)
                raise DhtError(f"could not send to the DHT worker: {exc}") from exc
        return future

    def forget(self, future: Future) -> None:
        """Drop a request nobody waits for any more (its late reply is then ignored)."""
        with self._lock:
            for tag, pending in list(self._pending.items()):
                if pending is future:
                    del self._pending[tag]

    def close(self) -> None:
        """Ask the worker to stop (it shuts hivemind down), then kill whatever is left."""
        process = self._process
        if process is None:
            return
        self._stopping = True
        with contextlib.suppress(OSError, ValueError, MessageError):
            write_message(process.stdin, {"op": "stop"})
        with contextlib.suppress(OSError, ValueError):
            process.stdin.close()
        try:
            process.wait(timeout=_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("DHT worker did not stop in %.0f s; killing it", _STOP_WAIT_S)
        self.kill()

    def kill(self) -> None:
        """Kill the worker and the processes it started (at once; no shutdown)."""
        self._stopping = True
        process = self._process
        if process is None:
            return
        if not self._group_killed:  # once, while the group id is surely still ours
            self._group_killed = True
            with contextlib.suppress(OSError):  # none left: the group is gone
                os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=_KILL_WAIT_S)
        if not _wait_group_gone(self.pid, _KILL_WAIT_S):
            logger.warning("the DHT worker's processes (group %d) outlived SIGKILL", self.pid)
        else:  # nobody listens on its sockets any more
            remove_sockets(self.socket_prefix)
        for stream in (process.stdin, process.stdout):
            with contextlib.suppress(OSError, ValueError):
                stream.close()
        self._fail_pending(DhtError("the DHT worker was stopped"))

    def _read_replies(self) -> None:
        stdout = self._process.stdout
        try:
            while True:
                try:
                    tag, reply = read_tagged(stdout, max_bytes=self._max_reply_bytes)
                except MessageError as exc:
                    logger.warning("refused a DHT worker reply: %s", exc)
                    self._resolve(exc.tag, DhtError(f"DHT reply refused: {exc}"))
                    continue
                if not isinstance(reply, dict):
                    self._resolve(tag, DhtError(f"DHT reply is not a map: {type(reply).__name__}"))
                    continue
                self._resolve(tag, reply)
        except (PipeClosedError, OSError, ValueError) as exc:
            if not self._stopping:
                logger.warning("DHT worker pipe ended: %s", exc)
        except Exception:
            logger.warning("DHT reply reader failed", exc_info=True)
        finally:
            self._finish()

    def _watch(self) -> None:
        """The worker's exit ends it for us even if its pipe stays open: hivemind's DHT
        process, forked from the worker, holds a copy of the pipe's write end."""
        self._process.wait()
        if not self._stopping:
            logger.warning("DHT worker (pid %d) exited with %s", self.pid, self._process.returncode)
            self._finish()

    def _finish(self) -> None:
        """Once, from whichever of the reader and the watcher notices first."""
        with self._lock:
            if self.exited.is_set():
                return
            self.exited.set()
        self._fail_pending(DhtError("the DHT worker exited"))
        if not self._stopping:
            self._on_exit(self)

    def _resolve(self, tag: int, outcome: dict[str, Any] | Exception) -> None:
        with self._lock:
            future = self._pending.pop(tag, None)
        if future is None or future.done():
            return  # its caller gave up (deadline) or the tag is not ours
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def _fail_pending(self, error: Exception) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    """Whether process group ``pgid`` is empty within ``timeout``. Its killed members are
    reaped by init, and that may be us: in a container started without ``--init`` the node
    is PID 1, the worker's orphans (hivemind's DHT process, p2pd) become its children, and a
    zombie still counts in its group, so unreaped it held every stop here to the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        _reap(pgid)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a member we may not signal: not ours to wait for
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _reap(pgid: int) -> None:
    """Reap the exited members of group ``pgid`` that are our children (none: nothing)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-pgid, os.WNOHANG)[0] > 0:
            pass
