"""The DHT worker process: one hivemind DHT node, driven over stdin/stdout by its node.

    python -m fusionllm.dht.worker      (started by DhtClient; not for humans)

hivemind and py-libp2p both register a protobuf file named crypto.proto with the same
symbols, and protobuf refuses the second in one process; so the node (py-libp2p) never
imports hivemind and talks to this process instead, one request at a time. The worker exits
when its stdin closes, so a node that dies (even by SIGKILL) takes its DHT down with it.
"""

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgpack

from fusionllm.common.logs import configure_logging, get_logger
from fusionllm.dht.wire import (
    MAX_MESSAGE_BYTES,
    MessageError,
    PipeClosedError,
    read_message,
    read_tagged,
    write_message,
)

logger = get_logger(__name__)

_MAX_CONCURRENT = 8
# The reply map around a get's items ("ok", "items", "dropped") and msgpack's array header.
_REPLY_OVERHEAD_BYTES = 1024


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


def _serve(dht: Any, message: dict[str, Any], limits: ReplyLimits) -> dict[str, Any]:
    op = message.get("op")
    if op == "store":
        ok = dht.store(
            message["key"],
            message["value"],
            float(message["expiration"]),
            subkey=message["subkey"],
        )
        return {"stored": bool(ok)}
    if op == "get":
        found = dht.get(message["key"], latest=bool(message.get("latest", True)))
        entries = []
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                entries.append([subkey, item.value, item.expiration_time])
        items, dropped = cap_entries(entries, limits)
        if dropped:
            logger.info("get %r: kept %d entries, dropped %d", message["key"], len(items), dropped)
        return {"items": items, "dropped": dropped}
    if op == "maddrs":
        return {"maddrs": [str(m) for m in dht.get_visible_maddrs(latest=True)]}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    # stdout is the protocol channel: keep a private copy and point fd 1 at stderr, so that
    # nothing a library prints can corrupt it.
    channel_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    channel_in = sys.stdin.buffer
    config = read_message(channel_in)
    configure_logging(config.get("log_level", "WARNING"))
    import hivemind

    from fusionllm.dht.validator import SwarmRecordValidator

    try:
        dht = hivemind.DHT(
            initial_peers=config["initial_peers"] or None,
            host_maddrs=[config["listen"]],
            identity_path=config["identity_path"],
            check_if_identity_free=False,
            client_mode=bool(config["client_mode"]),
            record_validators=[
                SwarmRecordValidator(config["swarm"], max_ttl_s=float(config["max_ttl_s"]))
            ]
            if config.get("validate_records", True)
            else [],
            wait_timeout=float(config["wait_timeout_s"]),
            start=True,
        )
    except Exception as exc:
        write_message(channel_out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        write_message(channel_out, {"ok": True, "peer_id": dht.peer_id.to_base58(),
                                    "maddrs": maddrs})  # fmt: skip
        limits = ReplyLimits(
            max_entries=int(config.get("max_entries_per_key", 1024)),
            max_reply_bytes=int(config.get("max_reply_bytes", MAX_MESSAGE_BYTES)),
        )
        _serve_requests(dht, channel_in, channel_out, limits)
    finally:
        dht.shutdown()


def _serve_requests(
    dht: Any, channel_in: BinaryIO, channel_out: BinaryIO, limits: ReplyLimits
) -> None:
    """Answer requests until stdin closes or a "stop" arrives."""
    write_lock = threading.Lock()
    slots = threading.BoundedSemaphore(_MAX_CONCURRENT)

    def reply(tag: int, answer: dict[str, Any]) -> None:
        with write_lock, contextlib.suppress(OSError, ValueError):
            try:
                write_message(channel_out, answer, tag=tag, max_bytes=limits.max_reply_bytes)
            except MessageError as exc:  # fails this request, not the pipe
                error = {"ok": False, "error": f"reply too large: {exc}"}
                write_message(channel_out, error, tag=tag)

    def handle(tag: int, message: dict[str, Any]) -> None:
        try:
            answer = {"ok": True, **_serve(dht, message, limits)}
        except Exception as exc:
            logger.debug("DHT request failed", exc_info=True)
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            slots.release()
        reply(tag, answer)

    # Requests run concurrently (hivemind's DHT handle is thread-safe): a heartbeat
    # store must not wait behind a get that is waiting on a dead peer.
    while True:
        try:
            tag, message = read_tagged(channel_in)
        except PipeClosedError:
            return
        except MessageError as exc:
            reply(exc.tag, {"ok": False, "error": str(exc)})
            continue
        if not isinstance(message, dict):
            reply(tag, {"ok": False, "error": "request is not a map"})
            continue
        if message.get("op") == "stop":
            return
        slots.acquire()
        threading.Thread(target=handle, args=(tag, message), daemon=True).start()


if __name__ == "__main__":
    main()
