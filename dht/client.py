"""``DhtClient``: a node's handle on its DHT worker process (dht/worker.py), with deadlines.

Requests go over the worker's stdin (dht/process.py matches replies to them), so a request
that outlives its deadline raises ``DhtError`` and its late reply is dropped. What one reply
may carry is bounded (``max_entries_per_key``, ``max_reply_bytes``): the worker trims a get to
fit and the client refuses a reply over the limit, failing only that request. A worker whose
pipe ends (it died, or its reader stopped) is restarted in the background, with backoff;
requests meanwhile fail fast with ``DhtError``.
"""

import itertools
import re
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.common.swarm_key import RecordTags
from fusionllm.dht.keys import check_swarm_name
from fusionllm.dht.process import DhtError, WorkerProcess
from fusionllm.dht.wire import MAX_MESSAGE_BYTES

__all__ = ["DhtClient", "DhtConfig", "DhtError", "start_client"]

logger = get_logger(__name__)

_MAX_RESTART_BACKOFF_S = 60.0
# hivemind stores each record on its key's 5 nearest nodes (num_replicas): a narrower search
# could miss replicas; a wider one than its bucket (20) gains nothing.
SEARCH_BEAM_MIN, SEARCH_BEAM_MAX = 5, 20
_TCP_PORT = re.compile(r"/tcp/(\d+)(/|$)")


@dataclass(frozen=True, kw_only=True)
class DhtConfig:
    swarm: str
    initial_peers: tuple[str, ...] = ()  # hivemind multiaddrs (.../p2p/<id>) of any swarm node
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    # What peers should dial instead (hivemind's announce_maddrs): "/ip4/IP/tcp/PORT", PORT > 0.
    announce_maddrs: tuple[str, ...] = ()
    # A private swarm's record tag key (common/swarm_key.py, 64 hex digits; never the swarm's
    # secret): the worker's validator refuses records without its tag. "": an open swarm.
    record_tag_key: str = field(default="", repr=False)
    identity_path: Path | None = None  # the node's key: the DHT peer id equals the data plane's
    client_mode: bool = False  # a client reads and writes but stores nothing for others
    # p2pd maps its own port on a UPnP router (go-libp2p's NAT manager) unless told not to:
    # off with the node's --no-upnp and behind --announce-addr (the user's forward).
    nat_port_map: bool = True
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
    # What one get may return: the freshest entries that fit both caps (peers choose how many
    # subkeys a key holds; this node chooses how much of it to hold in memory).
    max_entries_per_key: int = 1024
    max_reply_bytes: int = 16 << 20
    restart_backoff_s: float = 1.0  # first wait before restarting a dead worker; doubles
    # Nodes a store or get keeps in its search (hivemind's beam_size). hivemind's default is its
    # bucket size (20), so in a swarm of up to ~20 nodes every op asked every node: ~40 ms of
    # CPU per op at 16 nodes, the largest idle cost. Records live on the 5 nodes nearest their
    # key (hivemind's num_replicas), so a search needs a few more than 5, not all.
    search_beam: int = 8

    def __post_init__(self) -> None:
        check_swarm_name(self.swarm)
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        object.__setattr__(self, "announce_maddrs", tuple(self.announce_maddrs))
        if self.record_tag_key:
            RecordTags.from_hex(self.record_tag_key)  # SwarmKeyError (a ConfigError) if bad
        for maddr in self.announce_maddrs:
            match = _TCP_PORT.search(maddr) if isinstance(maddr, str) else None
            if match is None or not maddr.startswith(("/ip4/", "/ip6/")) or match[1] == "0":
                raise ConfigError(f"announce_maddrs: expected /ip4|ip6/IP/tcp/PORT, got {maddr!r}")
        if self.identity_path is not None:
            object.__setattr__(self, "identity_path", Path(self.identity_path))
        if not 0 <= self.listen_port <= 65535:
            raise ConfigError(f"listen_port must be in [0, 65535], got {self.listen_port}")
        for name in (
            "max_ttl_s",
            "request_timeout_s",
            "start_timeout_s",
            "peer_timeout_s",
            "restart_backoff_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 1 <= self.max_entries_per_key <= 1 << 20:
            raise ConfigError(
                f"max_entries_per_key must be in [1, {1 << 20}], got {self.max_entries_per_key}"
            )
        if not SEARCH_BEAM_MIN <= self.search_beam <= SEARCH_BEAM_MAX:
            raise ConfigError(
                f"search_beam must be in [{SEARCH_BEAM_MIN}, {SEARCH_BEAM_MAX}], "
                f"got {self.search_beam}"
            )
        if not 1 << 16 <= self.max_reply_bytes <= MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"max_reply_bytes must be in [64 KiB, {MAX_MESSAGE_BYTES}], "
                f"got {self.max_reply_bytes}"
            )

    def worker_config(self) -> dict[str, Any]:
        family = "ip6" if ":" in self.listen_host else "ip4"
        return {
            "swarm": self.swarm,
            "initial_peers": list(self.initial_peers),
            "listen": f"/{family}/{self.listen_host}/tcp/{self.listen_port}",
            "announce": list(self.announce_maddrs),
            "record_tag_key": self.record_tag_key,
            "identity_path": str(self.identity_path) if self.identity_path else None,
            "client_mode": self.client_mode,
            "nat_port_map": self.nat_port_map,
            "max_ttl_s": self.max_ttl_s,
            "wait_timeout_s": min(self.request_timeout_s, self.peer_timeout_s),
            "join_timeout_s": self.request_timeout_s,
            "log_level": self.log_level,
            "validate_records": self.validate_records,
            "max_entries_per_key": self.max_entries_per_key,
            "max_reply_bytes": self.max_reply_bytes,
            "search_beam": self.search_beam,
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
    """``start``/``close`` (or a context manager); requests from any thread.

    ``restarts`` counts workers started after the first; ``peer_id`` stays (same key file),
    ``maddrs`` follow the running worker.
    """

    def __init__(self, config: DhtConfig, *, worker_command: tuple[str, ...] | None = None) -> None:
        self.config = config
        self._worker_command = worker_command  # None: dht/worker.py; tests pass a fake
        self._lock = threading.Lock()  # guards _worker and _closed
        self._worker: WorkerProcess | None = None
        self._spawning: WorkerProcess | None = None  # a restart's worker, until it says hello
        self._restarter: threading.Thread | None = None
        self._closed = threading.Event()
        self._started = False
        self.restarts = 0
        self.peer_id = ""
        self.maddrs: list[str] = []

    def start(self) -> Self:
        if self._started:
            raise DhtError("DHT client already started")
        self._started = True
        self._worker = self._spawn(self.config)
        return self

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            worker, self._worker = self._worker, None
            spawning, restarter = self._spawning, self._restarter
        if spawning is not None:
            spawning.kill()  # a restart under way: its start fails at once
        if worker is not None:
            worker.close()
        if restarter is not None and restarter.is_alive():
            restarter.join(timeout=10.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def worker_pid(self) -> int:
        """The running worker's pid; 0 while none runs (not started, restarting, closed)."""
        worker = self._worker
        return worker.pid if worker is not None else 0

    # ------------------------------------------------------------------ requests

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        reply = self._request(
            {"op": "store", "key": key, "subkey": subkey, "value": value, "expiration": expiration}
        )
        return bool(reply.get("stored"))

    def get(self, key: str) -> list[tuple[Any, Any, Any]]:
        """Every (subkey, value, expiration) under ``key`` (at most ``max_entries_per_key``),
        unchecked: callers validate."""
        reply = self._request({"op": "get", "key": key, "latest": True})
        items = reply.get("items")
        if not isinstance(items, list):
            raise DhtError(f"DHT get returned {type(items).__name__} items")
        found = [tuple(item) for item in items if isinstance(item, list) and len(item) == 3]
        return found[: self.config.max_entries_per_key]

    def visible_maddrs(self) -> list[str]:
        maddrs = self._request({"op": "maddrs"}).get("maddrs")
        if not isinstance(maddrs, list):
            raise DhtError("DHT maddrs reply without a list")
        return [str(m) for m in maddrs]

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        worker = self._worker
        if worker is None:
            state = "restarting" if self._started and not self._closed.is_set() else "not running"
            raise DhtError(f"the DHT worker is {state}")
        future = worker.submit(message)
        try:
            reply = future.result(timeout=self.config.request_timeout_s)
        except FutureTimeout:
            worker.forget(future)
            raise DhtError(
                f"DHT {message['op']} took over {self.config.request_timeout_s}s"
            ) from None
        if not reply.get("ok"):
            raise DhtError(f"DHT {message['op']} failed: {reply.get('error')}")
        return reply

    def set_client_mode(self, client_mode: bool) -> bool:
        """Run the worker as a DHT client (or a server again); whether it had to change. A
        node nobody can dial (behind NAT) must not be a DHT server: others put it in their
        routing tables and every store and get that picks it waits out a dial to its LAN
        address (``peer_timeout_s``). The new worker starts beside the old one, which serves
        until it is up (a DHT start took 30-50 s on the loaded testbed), on the same port: p2pd
        binds its listener with SO_REUSEPORT (checked here: a second worker bound a running
        one's port), so peers that hold our address, or bootstrap from it, still reach us."""
        with self._lock:
            worker = self._worker
            if self.config.client_mode == client_mode or self._closed.is_set() or worker is None:
                return False
            self.config = replace(self.config, client_mode=client_mode)
            switcher = self._restarter = threading.Thread(
                target=self._switch, args=(worker,), name="dht-switch", daemon=True
            )
        logger.info("restarting the DHT worker as a %s", "client" if client_mode else "server")
        switcher.start()
        return True

    def _switch(self, old: WorkerProcess) -> None:
        """Start a worker on ``self.config`` at ``old``'s port and hand requests to it, then stop
        ``old``. Where the port cannot be shared, a fixed one is freed first (requests fail with
        DhtError meanwhile, as after a crash); else any free port will do."""
        try:
            new = self._spawn(self._restart_config(1))
        except DhtError as exc:
            if self.config.listen_port:
                logger.warning("the new DHT worker could not share port %d (%s): stopping the "
                               "old one first", self.config.listen_port, exc)  # fmt: skip
                with self._lock:
                    if self._worker is not old:
                        return
                    self._worker = None
                return self._restart(old)
            try:
                new = self._spawn(self.config)
            except DhtError as exc:
                logger.warning("the new DHT worker did not start (%s): the old one goes on", exc)
                return
        if self._install(new, old):
            old.close()
        elif not self._closed.is_set():  # the old one died (a restart took over), or the new one
            logger.warning("the new DHT worker was not installed: the old one, if any, goes on")

    def _install(self, new: WorkerProcess, replacing: WorkerProcess | None) -> bool:
        """Hand requests to ``new`` if ``replacing`` still serves them (None: none does), the
        client is open and ``new`` has not died since its hello (its exit, seen before it was
        installed, started no restart); else kill it. Whether it was installed."""
        with self._lock:
            installed = (
                self._worker is replacing and not self._closed.is_set() and not new.exited.is_set()
            )
            if installed:
                self._worker = new
                self.restarts += 1
        if not installed:
            new.kill()
            return False
        logger.info("DHT worker restarted (pid %d) on %s", new.pid, self.maddrs)
        return True

    # ------------------------------------------------------------------ worker lifecycle

    def _spawn(self, config: DhtConfig) -> WorkerProcess:
        worker = WorkerProcess(
            config.worker_config(),
            max_reply_bytes=config.max_reply_bytes,
            on_exit=self._worker_exited,
            command=self._worker_command,
        )
        with self._lock:
            self._spawning = worker
        try:
            hello = worker.start(config.start_timeout_s)
        finally:
            with self._lock:
                self._spawning = None
        peer_id, maddrs = hello.get("peer_id"), hello.get("maddrs")
        if not isinstance(peer_id, str) or not isinstance(maddrs, list):
            worker.kill()
            raise DhtError("the DHT worker's hello lacks peer_id or maddrs")
        if self.peer_id and peer_id != self.peer_id:
            logger.warning("the restarted DHT worker has peer id %s, was %s", peer_id, self.peer_id)
        self.peer_id, self.maddrs = peer_id, [str(m) for m in maddrs]
        return worker

    def _worker_exited(self, worker: WorkerProcess) -> None:
        """Called by the worker's reader as it ends (not on close): restart in the background."""
        with self._lock:
            if self._closed.is_set() or self._worker is not worker:
                return
            self._worker = None
            restarter = self._restarter = threading.Thread(
                target=self._restart, args=(worker,), name="dht-restart", daemon=True
            )
        logger.warning("the DHT worker (pid %d) is gone; restarting it", worker.pid)
        restarter.start()

    def _restart(self, dead: WorkerProcess) -> None:
        dead.kill()  # a reader that stopped on a live worker leaves it running
        delay = self.config.restart_backoff_s
        for attempt in itertools.count(1):
            if self._closed.wait(delay):
                return
            try:
                worker = self._spawn(self._restart_config(attempt))
            except DhtError as exc:
                logger.warning("DHT worker restart %d failed: %s", attempt, exc)
                delay = min(2 * delay, _MAX_RESTART_BACKOFF_S)
                continue
            if self._install(worker, None) or self._closed.is_set():
                return

    def _restart_config(self, attempt: int) -> DhtConfig:
        """The first try keeps the port the last worker had, so addresses others hold stay
        valid; later tries take the configured one (0: any free port)."""
        if attempt == 1 and self.config.listen_port == 0:
            for maddr in self.maddrs:
                match = _TCP_PORT.search(maddr)
                if match and f"/{self.config.listen_host}/" in maddr:
                    return replace(self.config, listen_port=int(match.group(1)))
        return self.config
