"""The DHT worker's side of the pipe: requests in from stdin, replies out, capped.

hivemind-free, so unit tests drive it with a fake node. ``serve_requests`` runs on the
worker's event loop, next to the DHT node it serves; two threads do the pipe's blocking I/O
(a read or a write that waits costs no CPU and never stalls the loop):

- the request reader blocks on stdin and hands each request to the loop; it takes one of
  ``MAX_CONCURRENT`` slots first, so a node that floods the pipe waits in its own write;
- the reply writer drains a queue, so a big reply that the node reads slowly never holds up
  the loop that also answers the swarm's peers.
"""

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import msgpack

from fusionllm.common.logs import get_logger
from fusionllm.dht.wire import MessageError, PipeClosedError, read_tagged, write_message

logger = get_logger(__name__)

MAX_CONCURRENT = 8
# How long requests in flight may finish after "stop" (or stdin closing) before they are cut.
DRAIN_S = 2.0
# The reply map around a get's items ("ok", "items", "dropped") and msgpack's array header.
_REPLY_OVERHEAD_BYTES = 1024


class DhtNodeLike(Protocol):
    """What the worker asks of hivemind's ``DHTNode``."""

    async def store(
        self, key: Any, value: Any, expiration_time: float, *, subkey: Any
    ) -> bool: ...  # fmt: skip

    async def get(self, key: Any, *, latest: bool) -> Any: ...

    async def get_visible_maddrs(self, *, latest: bool) -> list[Any]: ...


@dataclass(frozen=True, kw_only=True)
class ReplyLimits:
    """What one reply may carry; the client refuses a reply over ``max_reply_bytes``."""

    max_entries: int
    max_reply_bytes: int

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_reply_bytes <= _REPLY_OVERHEAD_BYTES:
            raise ValueError(f"bad reply limits: {self}")


def cap_entries(entries: list[list[Any]], limits: ReplyLimits) -> tuple[list[list[Any]], int]:
    """The freshest [subkey, value, expiration] entries that fit ``limits``; and how many not.

    Freshest first, since a key's live records are the recently refreshed ones; an entry too
    big to fit is skipped, so one huge value cannot hide the small ones after it.
    """

    def expiration(entry: list[Any]) -> float:
        value = entry[2]
        return float(value) if isinstance(value, int | float) else float("-inf")

    budget = limits.max_reply_bytes - _REPLY_OVERHEAD_BYTES
    kept: list[list[Any]] = []
    for entry in sorted(entries, key=expiration, reverse=True):
        if len(kept) == limits.max_entries:
            break
        try:
            size = len(msgpack.packb(entry, use_bin_type=True))
        except (TypeError, ValueError, OverflowError):
            continue  # hivemind handed us something msgpack cannot carry
        if size <= budget:
            kept.append(entry)
            budget -= size
    return kept, len(entries) - len(kept)


async def serve_one(node: DhtNodeLike, message: dict[str, Any], limits: ReplyLimits) -> dict:
    """The reply to one request (without its ``ok``); raises on a failed or unknown op."""
    op = message.get("op")
    if op == "store":
        key, subkey, value = message["key"], message["subkey"], message["value"]
        ok = await node.store(key, value, float(message["expiration"]), subkey=subkey)
        return {"stored": bool(ok)}
    if op == "get":
        found = await node.get(message["key"], latest=bool(message.get("latest", True)))
        entries = []
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                entries.append([subkey, item.value, item.expiration_time])
        items, dropped = cap_entries(entries, limits)
        if dropped:
            logger.info("get %r: kept %d entries, dropped %d", message["key"], len(items), dropped)
        return {"items": items, "dropped": dropped}
    if op == "maddrs":
        return {"maddrs": [str(m) for m in await node.get_visible_maddrs(latest=True)]}
    raise ValueError(f"unknown op {op!r}")


class ReplyWriter:
    """Writes (tag, reply) pairs to the pipe from its own thread, in order."""

    def __init__(self, channel_out: BinaryIO, max_reply_bytes: int) -> None:
        self._out = channel_out
        self._max_bytes = max_reply_bytes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dht-reply-writer", daemon=True)
        self._thread.start()

    def send(self, tag: int, reply: dict[str, Any]) -> None:
        self._queue.put((tag, reply))

    def close(self, timeout: float) -> None:
        """Write what is queued (up to ``timeout``), then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            tag, reply = item
            # A node that is gone fails every write fast; its closed stdin ends the worker.
            with contextlib.suppress(OSError, ValueError):
                try:
                    write_message(self._out, reply, tag=tag, max_bytes=self._max_bytes)
                except MessageError as exc:  # fails this request, not the pipe
                    error = {"ok": False, "error": f"reply too large: {exc}"}
                    write_message(self._out, error, tag=tag)


def _read_requests(
    channel_in: BinaryIO,
    deliver: Callable[[tuple[int, dict] | None], None],
    replies: ReplyWriter,
    slots: threading.BoundedSemaphore,
) -> None:
    """Hand each request to ``deliver`` until stdin closes or a "stop" arrives; then None."""
    try:
        while True:
            try:
                tag, message = read_tagged(channel_in)
            except MessageError as exc:
                replies.send(exc.tag, {"ok": False, "error": str(exc)})
                continue
            if not isinstance(message, dict):
                replies.send(tag, {"ok": False, "error": "request is not a map"})
                continue
            if message.get("op") == "stop":
                return
            slots.acquire()
            deliver((tag, message))
    except (PipeClosedError, OSError, ValueError):
        return
    finally:
        deliver(None)


async def _handle(
    node: DhtNodeLike,
    request: tuple[int, dict],
    limits: ReplyLimits,
    replies: ReplyWriter,
    slots: threading.BoundedSemaphore,
) -> None:
    tag, message = request
    try:
        reply = {"ok": True, **await serve_one(node, message, limits)}
    except Exception as exc:
        logger.debug("DHT request failed", exc_info=True)
        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        slots.release()
    replies.send(tag, reply)


async def serve_requests(
    node: DhtNodeLike, channel_in: BinaryIO, channel_out: BinaryIO, limits: ReplyLimits
) -> None:
    """Answer requests until stdin closes or a "stop" arrives.

    Requests run concurrently (up to ``MAX_CONCURRENT``): a heartbeat store must not wait
    behind a get that is waiting on a dead peer. Those still running at the end get
    ``DRAIN_S`` to finish, then are cancelled.
    """
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[int, dict] | None] = asyncio.Queue()
    replies = ReplyWriter(channel_out, limits.max_reply_bytes)
    slots = threading.BoundedSemaphore(MAX_CONCURRENT)

    def deliver(request: tuple[int, dict] | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the worker is ending
            loop.call_soon_threadsafe(inbox.put_nowait, request)

    reader = threading.Thread(
        target=_read_requests,
        args=(channel_in, deliver, replies, slots),
        name="dht-request-reader",
        daemon=True,
    )
    reader.start()
    running: set[asyncio.Task] = set()
    try:
        while (request := await inbox.get()) is not None:
            task = asyncio.create_task(_handle(node, request, limits, replies, slots))
            running.add(task)
            task.add_done_callback(running.discard)
    finally:
        if running:
            _done, late = await asyncio.wait(running, timeout=DRAIN_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        replies.close(timeout=DRAIN_S)
