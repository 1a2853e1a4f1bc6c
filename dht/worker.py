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
from typing import Any, BinaryIO

from fusionllm.common.logs import configure_logging, get_logger
from fusionllm.dht.wire import PipeClosedError, read_message, write_message

logger = get_logger(__name__)

_MAX_CONCURRENT = 8


def _serve(dht: Any, message: dict[str, Any]) -> dict[str, Any]:
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
        items = []
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                items.append([subkey, item.value, item.expiration_time])
        return {"items": items}
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
        _serve_requests(dht, channel_in, channel_out)
    finally:
        dht.shutdown()


def _serve_requests(dht: Any, channel_in: BinaryIO, channel_out: BinaryIO) -> None:
    """Answer requests until stdin closes or a "stop" arrives."""
    write_lock = threading.Lock()
    slots = threading.BoundedSemaphore(_MAX_CONCURRENT)

    def handle(message: dict[str, Any]) -> None:
        try:
            reply = {"id": message.get("id"), "ok": True, **_serve(dht, message)}
        except Exception as exc:
            logger.debug("DHT request failed", exc_info=True)
            error = f"{type(exc).__name__}: {exc}"
            reply = {"id": message.get("id"), "ok": False, "error": error}
        finally:
            slots.release()
        with write_lock, contextlib.suppress(OSError, ValueError):
            write_message(channel_out, reply)

    # Requests run concurrently (hivemind's DHT handle is thread-safe): a heartbeat
    # store must not wait behind a get that is waiting on a dead peer.
    while True:
        try:
            message = read_message(channel_in)
        except PipeClosedError:
            return
        if message.get("op") == "stop":
            return
        slots.acquire()
        threading.Thread(target=handle, args=(message,), daemon=True).start()


if __name__ == "__main__":
    main()
