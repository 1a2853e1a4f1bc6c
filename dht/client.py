"""``DhtClient``: a node's handle on its DHT worker process (dht/worker.py), with deadlines.

Requests go over the worker's stdin; a reader thread matches replies to futures by id, so a
request that outlives its deadline raises ``DhtError`` and its late reply is dropped.
"""

import contextlib
import itertools
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dht.keys import check_swarm_name
from fusionllm.dht.wire import PipeClosedError, read_message, write_message

logger = get_logger(__name__)


class DhtError(FusionError):
    """The DHT worker failed, timed out or is gone."""


@dataclass(frozen=True, kw_only=True)
class DhtConfig:
    swarm: str
    initial_peers: tuple[str, ...] = ()  # hivemind multiaddrs (.../p2p/<id>) of any swarm node
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    identity_path: Path | None = None  # the node's key: the DHT peer id equals the data plane's
    client_mode: bool = False  # a client reads and writes but stores nothing for others
    max_ttl_s: float = 600.0  # records further in the future than this are refused
    request_timeout_s: float = 15.0
    # How long hivemind waits for one DHT peer's answer: a crashed peer stays in routing
    # tables for a while and every get that asks it pays this, so keep it near a heartbeat.
    peer_timeout_s: float = 3.0
    start_timeout_s: float = 90.0
    log_level: str = "WARNING"
    # Only tests turn this off, to play a peer that stores what honest nodes refuse: such a
    # node harms itself (it keeps junk); everyone else still validates what it sends.
    validate_records: bool = True

    def __post_init__(self) -> None:
        check_swarm_name(self.swarm)
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        if self.identity_path is not None:
            object.__setattr__(self, "identity_path", Path(self.identity_path))
        if not 0 <= self.listen_port <= 65535:
            raise ConfigError(f"listen_port must be in [0, 65535], got {self.listen_port}")
        for name in ("max_ttl_s", "request_timeout_s", "start_timeout_s", "peer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    def worker_config(self) -> dict[str, Any]:
        family = "ip6" if ":" in self.listen_host else "ip4"
        return {
            "swarm": self.swarm,
            "initial_peers": list(self.initial_peers),
            "listen": f"/{family}/{self.listen_host}/tcp/{self.listen_port}",
            "identity_path": str(self.identity_path) if self.identity_path else None,
            "client_mode": self.client_mode,
            "max_ttl_s": self.max_ttl_s,
            "wait_timeout_s": min(self.request_timeout_s, self.peer_timeout_s),
            "log_level": self.log_level,
            "validate_records": self.validate_records,
        }


def start_client(config: DhtConfig, *, attempts: int = 4) -> "DhtClient":
    """A started client; a worker that could not reach its bootstrap peers is tried again.

    A bootstrap node whose machine is busy (training) sometimes misses the new daemon's dial
    deadline; the whole start is cheap to repeat, a node that exits instead is not.
    """
    for attempt in range(1, attempts + 1):
        try:
            return DhtClient(config).start()
        except DhtError as exc:
            if attempt == attempts or not config.initial_peers:
                raise
            logger.warning("DHT start failed (attempt %d of %d): %s", attempt, attempts, exc)
            time.sleep(2.0 * attempt)  # many nodes starting at once: spread the retries
    raise AssertionError("unreachable")


class DhtClient:
    def __init__(self, config: DhtConfig) -> None:
        self.config = config
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._reader: threading.Thread | None = None
        self.peer_id = ""
        self.maddrs: list[str] = []

    def start(self) -> Self:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "fusionllm.dht.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        started: Future = Future()

        def handshake() -> None:
            try:
                started.set_result(read_message(self._process.stdout))
            except Exception as exc:
                started.set_exception(exc)

        try:
            write_message(self._process.stdin, self.config.worker_config())
            threading.Thread(target=handshake, daemon=True).start()
            hello = started.result(timeout=self.config.start_timeout_s)
        except (FutureTimeout, PipeClosedError, OSError) as exc:
            self.close()
            raise DhtError(f"the DHT worker did not start: {exc!r}") from exc
        if not hello.get("ok"):
            self.close()
            raise DhtError(f"the DHT worker failed to start: {hello.get('error')}")
        self.peer_id, self.maddrs = hello["peer_id"], list(hello["maddrs"])
        self._reader = threading.Thread(target=self._read_replies, name="dht-replies", daemon=True)
        self._reader.start()
        return self

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            write_message(process.stdin, {"op": "stop"})
        with contextlib.suppress(OSError, ValueError):
            process.stdin.close()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            logger.warning("DHT worker did not stop in 15 s; killing it")
            process.kill()
            process.wait(timeout=5)
        with contextlib.suppress(OSError, ValueError):
            process.stdout.close()
        self._fail_pending(DhtError("DHT client closed"))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        reply = self._request(
            {"op": "store", "key": key, "subkey": subkey, "value": value, "expiration": expiration}
        )
        return bool(reply["stored"])

    def get(self, key: str) -> list[tuple[Any, Any, Any]]:
        """Every (subkey, value, expiration) under ``key``, unchecked: callers validate."""
        reply = self._request({"op": "get", "key": key, "latest": True})
        items = reply.get("items")
        return [tuple(item) for item in items if isinstance(item, list) and len(item) == 3]

    def visible_maddrs(self) -> list[str]:
        return list(self._request({"op": "maddrs"})["maddrs"])

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        process = self._process
        if process is None or process.poll() is not None:
            raise DhtError("the DHT worker is not running")
        future: Future = Future()
        with self._lock:
            request_id = next(self._ids)
            self._pending[request_id] = future
            try:
                write_message(process.stdin, {**message, "id": request_id})
            except (OSError, ValueError) as exc:
                self._pending.pop(request_id, None)
                raise DhtError(f"the DHT worker is gone: {exc}") from exc
        try:
            reply = future.result(timeout=self.config.request_timeout_s)
        except FutureTimeout:
            raise DhtError(
                f"DHT {message['op']} took over {self.config.request_timeout_s}s"
            ) from None
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
        if not reply.get("ok"):
            raise DhtError(f"DHT {message['op']} failed: {reply.get('error')}")
        return reply

    def _read_replies(self) -> None:
        process = self._process
        try:
            while process is not None:
                reply = read_message(process.stdout)
                with self._lock:
                    future = self._pending.pop(reply.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (PipeClosedError, OSError, ValueError):
            pass
        self._fail_pending(DhtError("the DHT worker exited"))

    def _fail_pending(self, error: Exception) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
