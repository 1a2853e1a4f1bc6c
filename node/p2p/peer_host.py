"""One py-libp2p host per node: its identity, its trio thread and the one bridge to it.

py-libp2p is trio-native and the rest of the node is plain threads, so ``PeerHost`` runs
``trio.run`` in one daemon thread with one host (Noise + Yamux over TCP, host.py) and everything
that talks to peers attaches to it instead of starting a host of its own: the control plane
(control_host.py: gossipsub, probes) and the data plane (transport.py: tensor frames) register
their protocols with ``set_stream_handler`` and run their background work as *services*.
Other threads reach the trio thread only through this class:

- ``call(async_fn, *args)``: run ``async_fn`` in the trio thread and wait for its result;
- ``call_sync(fn, *args)``: the same for a quick, non-blocking plain function;
- ``run_sync_soon(fn, *args)``: queue a plain function, do not wait (it must not raise);
- ``start_service(factory, *args)``: enter the async context manager ``factory(*args)`` in
  the host's nursery (set up, e.g. ``background_trio_service(pubsub)``), wait until it is
  entered, and keep it open until ``HostService.stop()`` or the host closes (tear down).

All of them raise TransportClosedError once the host is closed (or before it started).
Removing a stream handler also ends the streams it is still serving, so a service that
detaches leaves nothing of its own running on a host that lives on.
"""

import contextlib
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.peerinfo import info_from_p2p_addr

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.common.swarm_key import SwarmKey
from fusionllm.node.errors import DeadlineError, TransportClosedError, TransportError
from fusionllm.node.p2p.announce import AnnounceAddr, announced_multiaddrs
from fusionllm.node.p2p.checks import check_port_free, int_in, ip_address, positive_seconds
from fusionllm.node.p2p.host import new_secure_host
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of
from fusionllm.node.p2p.relay_addrs import is_relayed

logger = get_logger(__name__)

# Errors py-libp2p and trio raise when a stream or connection breaks under us.
NETWORK_ERRORS = (
    BaseLibp2pError,
    OSError,
    EOFError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)

StreamHandler = Callable[[INetStream], Awaitable[None]]


@dataclass(frozen=True, kw_only=True)
class HostConfig:
    """Where a node listens and how long it waits; all deadlines in seconds."""

    key_path: Path  # the node's identity (identity.py): one key, one peer id everywhere
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: a free port
    dial_timeout_s: float = 5.0  # connect + security + muxer negotiation
    close_timeout_s: float = 5.0
    # What ``addrs`` says instead of the listen address (a port forward, a public IP).
    announce: tuple[AnnounceAddr, ...] = ()
    # A private swarm's key: connections only with hosts that hold it (host.py).
    swarm_key: SwarmKey | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_path", Path(self.key_path))
        object.__setattr__(self, "announce", tuple(self.announce))
        if not all(isinstance(a, AnnounceAddr) for a in self.announce):
            raise ConfigError(f"announce must hold AnnounceAddr values, got {self.announce!r}")
        if self.swarm_key is not None and not isinstance(self.swarm_key, SwarmKey):
            raise ConfigError(f"swarm_key must be a SwarmKey, got {type(self.swarm_key).__name__}")
        ip_address("listen_host", self.listen_host)
        int_in("listen_port", self.listen_port, 0, 65535)
        positive_seconds("dial_timeout_s", self.dial_timeout_s)
        positive_seconds("close_timeout_s", self.close_timeout_s)

    @property
    def listen_multiaddr(self) -> multiaddr.Multiaddr:
        family = "ip6" if ip_address("listen_host", self.listen_host).version == 6 else "ip4"
        return multiaddr.Multiaddr(f"/{family}/{self.listen_host}/tcp/{self.listen_port}")


def host_config_of(config) -> HostConfig:
    """The host a component's own config asks for (its key, address and timeouts), for a
    component that runs standalone; raises ConfigError for bad fields."""
    return HostConfig(
        key_path=config.key_path,
        listen_host=config.listen_host,
        listen_port=config.listen_port,
        dial_timeout_s=config.dial_timeout_s,
        close_timeout_s=config.close_timeout_s,
    )


class HostService:
    """A service running in a PeerHost's nursery (``PeerHost.start_service``)."""

    def __init__(self, host: "PeerHost", name: str) -> None:
        self.name = name
        self.value: Any = None  # what the service's context manager yielded
        self._host = host
        self._scope = trio.CancelScope()  # cancelled only in the trio thread
        # A threading.Event: stop() waits on it from any thread, even if the loop is wedged.
        self._finished = threading.Event()

    @property
    def running(self) -> bool:
        return not self._finished.is_set()

    def stop(self) -> None:
        """Leave the service's context and wait until it has (at most close_timeout_s).

        Idempotent, from any thread; a no-op once the host is closed (the service ended with
        it). From the host's own thread it only asks, without waiting.
        """
        if self._finished.is_set():
            return
        if self._host._on_trio_thread():
            self._scope.cancel()
            return
        try:
            self._host.run_sync_soon(self._scope.cancel)
        except TransportClosedError:
            return
        if not self._finished.wait(self._host.config.close_timeout_s):
            logger.warning("service %s still stopping after close_timeout_s", self.name)


def _stopping(exc: Exception) -> bool:
    """py-libp2p's services (pubsub) start a task per message in their own nursery; one that
    arrives as the service stops raises this, which is the service ending, not a fault."""
    return isinstance(exc, RuntimeError) and "closed to new arrivals" in str(exc)


class _Handler:
    """A registered stream handler and the cancel scopes of the streams it serves."""

    def __init__(self, handler: StreamHandler) -> None:
        self.handler = handler
        self.scopes: set[trio.CancelScope] = set()
        self.removed = False

    async def serve(self, stream: INetStream) -> None:
        failed = False
        with trio.CancelScope() as scope:
            if self.removed:
                scope.cancel()  # negotiated just before the handler went away
            self.scopes.add(scope)
            try:
                await self.handler(stream)
            except Exception as exc:
                # An error out of a handler would end the host's trio thread, every peer's
                # streams with it (a dial-back handler once did): only this stream ends.
                if _stopping(exc):
                    logger.info("stream handler %s ended: its service is stopping", self.handler)
                else:
                    logger.error("stream handler %s failed", self.handler, exc_info=True)
                failed = True
            finally:
                self.scopes.discard(scope)
        if scope.cancelled_caught or failed:
            await reset_quietly(stream)

    def remove(self) -> None:
        self.removed = True
        for scope in self.scopes:
            scope.cancel()


class PeerHost:
    """A node's one py-libp2p host; use as a context manager or call ``start``/``close``."""

    def __init__(self, config: HostConfig, *, thread_name: str = "fusionllm-host") -> None:
        self.config = config
        self._thread_name = thread_name
        self._key_pair = load_or_create_identity(config.key_path)
        self.peer_id = peer_id_of(self._key_pair)
        self._addrs: list[str] = []  # what peers are told to dial (announced, else bound)
        self._bound: list[str] = []
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        # Owned by the trio thread from here on.
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._host: IHost | None = None
        self._handlers: dict[TProtocol, _Handler] = {}
        # Dials ``.../p2p-circuit/p2p/<peer>`` addresses (node/p2p/relay_client.py), if set.
        self.circuit_dialer: Callable[[str], Awaitable[None]] | None = None

    @property
    def key_pair(self) -> KeyPair:
        return self._key_pair

    @property
    def addrs(self) -> list[str]:
        """Full multiaddrs, ``/ip4/.../tcp/.../p2p/<peer id>``; empty until started."""
        return list(self._addrs)

    @property
    def bound_addrs(self) -> list[str]:
        """Where the host listens, which ``addrs`` names unless addresses are announced."""
        return list(self._bound)

    @property
    def running(self) -> bool:
        return self._token is not None and not self._closed

    def require_key(self, key_path: Path | str) -> None:
        """ConfigError unless ``key_path`` is this host's key file: a service attached to the
        host speaks with the host's identity, so a config naming another key is a mistake."""
        if Path(key_path).resolve() != self.config.key_path.resolve():
            raise ConfigError(
                f"key_path {key_path} is not the key of the host it attaches to "
                f"({self.config.key_path})"
            )

    @property
    def libp2p(self) -> IHost:
        """The py-libp2p host itself, for services: use it in the trio thread only."""
        if self._host is None or self._closed:
            raise TransportClosedError("the host is not running")
        return self._host

    # ----- lifecycle (any thread) -------------------------------------------------------------

    def start(self) -> Self:
        """Start the trio thread and wait until the host listens; raises if it cannot."""
        if self._thread is not None:
            raise TransportError("host already started")
        if self.config.listen_port:
            check_port_free(self.config.listen_host, self.config.listen_port)
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()
        if not self._started.wait(self.config.dial_timeout_s + self.config.close_timeout_s):
            self.close()
            raise DeadlineError("the host did not start listening in time")
        if self._start_error is not None or self._token is None:
            self.close()
            raise TransportError(f"the host failed to start: {self._start_error!r}")
        logger.info(
            "host %s listening on %s, announcing %s", self.peer_id, self._bound, self._addrs
        )
        return self

    def close(self) -> None:
        """Stop every service and the trio thread (bounded by close_timeout_s); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._token is not None and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._stop.set)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.config.close_timeout_s)
            if self._thread.is_alive():
                # A daemon thread: it cannot keep the process alive, so say so and move on.
                logger.warning(
                    "host thread still running %ss after close", self.config.close_timeout_s
                )

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- the bridge (any thread) ------------------------------------------------------------

    def call(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``async_fn(*args)`` in the trio thread and return its result (or raise)."""
        token = self._require_token()
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled) as exc:
            # Cancelled: the trio run shut down while the call was in flight.
            raise TransportClosedError("host closed") from exc

    def call_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a quick plain ``fn(*args)`` in the trio thread (directly if already there)."""
        token = self._require_token()
        if self._on_trio_thread():
            return fn(*args)
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError as exc:
            raise TransportClosedError("host closed") from exc

    def run_sync_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` for the trio thread; it must not raise (that ends the run)."""
        token = self._require_token()
        try:
            token.run_sync_soon(fn, *args)
        except trio.RunFinishedError as exc:
            raise TransportClosedError("host closed") from exc

    def start_service(
        self,
        factory: Callable[..., AbstractAsyncContextManager[Any]],
        *args: Any,
        name: str = "service",
    ) -> HostService:
        """Enter ``factory(*args)`` in the host's nursery and keep it open until
        ``HostService.stop()`` or the host closes; a failure while entering is raised here."""
        return self.call(self._start_service, factory, args, name)

    def connect(self, addr: str, timeout: float | None = None) -> str:
        """Dial a ``/ip4/.../tcp/.../p2p/<peer id>`` address, or a relayed one (through a
        relay, ``.../p2p-circuit/p2p/<peer id>``) with a circuit dialer; returns the peer id."""
        timeout = self.config.dial_timeout_s if timeout is None else timeout
        positive_seconds("timeout", timeout)
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:  # multiaddr raises assorted types for bad text
            raise TransportError(f"not a peer address: {addr!r}: {exc}") from exc
        self.call(self._connect, info, timeout, addr if is_relayed(addr) else "")
        return info.peer_id.to_base58()

    def connected_peers(self) -> list[str]:
        return self.call_sync(
            lambda: sorted(peer.to_base58() for peer in self.libp2p.get_connected_peers())
        )

    def set_stream_handler(self, protocol: TProtocol, handler: StreamHandler) -> None:
        """Serve ``protocol`` with ``handler``; TransportError if it already has one here."""
        self.call_sync(self._set_handler, protocol, handler)

    def remove_stream_handler(self, protocol: TProtocol) -> None:
        """Stop serving ``protocol`` and end (reset) the streams its handler still serves."""
        with contextlib.suppress(TransportClosedError):
            self.call_sync(self._remove_handler, protocol)

    # ----- helpers ----------------------------------------------------------------------------

    def _require_token(self) -> trio.lowlevel.TrioToken:
        if self._closed or self._token is None:
            raise TransportClosedError("the host is not running")
        return self._token

    def _on_trio_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def _set_handler(self, protocol: TProtocol, handler: StreamHandler) -> None:
        host = self.libp2p
        if protocol in self._handlers:
            # Two services on one protocol would silently steal each other's streams.
            raise TransportError(f"{protocol} already has a handler on this host")
        entry = self._handlers[protocol] = _Handler(handler)
        host.set_stream_handler(protocol, entry.serve)

    def _remove_handler(self, protocol: TProtocol) -> None:
        entry = self._handlers.pop(protocol, None)
        if entry is not None:
            self.libp2p.remove_stream_handler(protocol)
            entry.remove()

    # ----- the trio thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to start() or logged, never lost
            if not self._started.is_set():
                self._start_error = exc
            else:
                logger.error("host thread failed", exc_info=True)
        finally:
            self._host = None
            self._closed = True  # a run that died on its own is closed as well
            self._started.set()

    async def _main(self) -> None:
        config = self.config
        self._stop = trio.Event()
        psk = config.swarm_key.pnet_psk if config.swarm_key is not None else None
        host = new_secure_host(self._key_pair, negotiate_timeout_s=config.dial_timeout_s, psk=psk)
        with trio.CancelScope() as outer:
            async with host.run(listen_addrs=[config.listen_multiaddr]):
                # py-libp2p re-dials peers from its peer store to keep ~150 connections: any
                # stranger that connected once (and named, via identify, any address it liked)
                # would have us dial it, or a victim, again and again. We dial whom we choose.
                await host.get_network().auto_connector.stop()
                async with trio.open_nursery() as nursery:
                    self._host, self._nursery = host, nursery
                    self._bound = [str(addr) for addr in host.get_addrs()]
                    self._addrs = self._advertised(self._bound)
                    self._token = trio.lowlevel.current_trio_token()
                    self._started.set()
                    await self._stop.wait()
                    # Services leave their contexts here (cancelled), before the host stops.
                    nursery.cancel_scope.cancel()
                self._nursery = None
                # py-libp2p's own shutdown gets half the close budget, then is cut.
                outer.deadline = trio.current_time() + config.close_timeout_s / 2

    def _advertised(self, bound: list[str]) -> list[str]:
        """The announced addresses (with the bound port where they name none), else ``bound``."""
        if not self.config.announce or not bound:
            return bound
        port = int(multiaddr.Multiaddr(bound[0]).value_for_protocol("tcp"))
        suffix = f"/p2p/{self.peer_id}"
        return [m + suffix for m in announced_multiaddrs(self.config.announce, port)]

    async def _connect(self, info: Any, timeout: float, circuit: str) -> None:
        try:
            with trio.fail_after(timeout):
                if not circuit or self.libp2p.get_network().get_connections(info.peer_id):
                    await self.libp2p.connect(info)
                elif self.circuit_dialer is None:
                    raise TransportError(f"no relay client here to dial {circuit}")
                else:
                    await self.circuit_dialer(circuit)
        except trio.TooSlowError:
            raise DeadlineError(f"dial to {info.peer_id} timed out after {timeout}s") from None
        except NETWORK_ERRORS as exc:
            logger.debug("dial to %s failed", info.peer_id, exc_info=True)
            raise TransportError(f"dial to {info.peer_id} failed: {exc}") from exc

    async def _start_service(
        self,
        factory: Callable[..., AbstractAsyncContextManager[Any]],
        args: tuple[Any, ...],
        name: str,
    ) -> HostService:
        if self._nursery is None or self._closed:
            raise TransportClosedError("the host is not running")
        service = HostService(self, name)
        service.value = await self._nursery.start(self._run_service, service, factory, args)
        return service

    async def _run_service(
        self,
        service: HostService,
        factory: Callable[..., AbstractAsyncContextManager[Any]],
        args: tuple[Any, ...],
        *,
        task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        entered = False
        try:
            with service._scope:
                async with factory(*args) as value:
                    entered = True
                    task_status.started(value)
                    await trio.sleep_forever()
        except Exception as exc:
            if not entered:  # to start_service's caller, as itself if it is one error alone
                leaf = _leaf(exc)
                if leaf is exc:
                    raise
                raise leaf from exc
            # A service that fails later must not take the host and the other services along.
            logger.error("service %s failed", service.name, exc_info=True)
        finally:
            service._finished.set()


def _leaf(exc: Exception) -> Exception:
    """The one error inside nested one-error groups (a service's own nursery wraps them)."""
    while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def reset_quietly(stream: INetStream | None) -> None:
    """Reset a stream we give up on; bounded, shielded, and never raises a network error."""
    if stream is None:
        return
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.reset()
        except NETWORK_ERRORS:
            logger.debug("reset of a broken stream failed", exc_info=True)


async def close_quietly(stream: INetStream | None) -> None:
    """Close a stream we are done with; bounded, shielded, never raises a network error."""
    if stream is None:
        return
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.close()
        except NETWORK_ERRORS:
            logger.debug("close of a stream failed", exc_info=True)
