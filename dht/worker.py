"""The DHT worker process: one hivemind DHT node, driven over stdin/stdout by its node.

    python -m fusionllm.dht.worker      (started by DhtClient; not for humans)

hivemind and py-libp2p both register a protobuf file named crypto.proto with the same
symbols, and protobuf refuses the second in one process; so the node (py-libp2p) never
imports hivemind and talks to this process instead (dht/serve.py is this end of the pipe).

The worker runs hivemind's ``DHTNode`` on its own event loop, not ``hivemind.DHT`` (which
forks one more process to run the same ``DHTNode`` behind an mp pipe): a node's DHT is this
process and hivemind's Go daemon (p2pd), its child. The worker exits when its stdin closes,
so a node that dies (even by SIGKILL) takes its DHT down with it; on the way out it stops
p2pd, and kills any child still left (a daemon whose start was cut short). A worker killed by
SIGKILL cannot do that: its client kills its process group (dht/process.py).
"""

import asyncio
import contextlib
import os
import sys
from typing import Any, BinaryIO

import psutil

from fusionllm.common.logs import configure_logging, get_logger
from fusionllm.dht.serve import ReplyLimits, serve_requests
from fusionllm.dht.wire import MAX_MESSAGE_BYTES, read_message, write_message

logger = get_logger(__name__)

_SHUTDOWN_S = 10.0
_CHILD_EXIT_S = 3.0


async def start_node(config: dict[str, Any]) -> Any:
    """hivemind's DHTNode with this worker's config, its p2pd started, peers joined."""
    # Here, not at the top: the node's processes import serve.py and this module's
    # neighbours, and must never import hivemind (see the module docstring).
    from hivemind.dht.node import DHTNode
    from hivemind.dht.validation import CompositeValidator

    from fusionllm.common.swarm_key import RecordTags
    from fusionllm.dht.sockets import use_prefix
    from fusionllm.dht.validator import SwarmRecordValidator

    if config.get("socket_prefix"):  # our owner removes them whatever becomes of p2pd
        use_prefix(config["socket_prefix"])
    validators = []
    tag_key = config.get("record_tag_key") or ""  # a private swarm's (DhtConfig)
    tags = RecordTags.from_hex(tag_key) if tag_key else None
    if config.get("validate_records", True):
        validators.append(
            SwarmRecordValidator(config["swarm"], max_ttl_s=float(config["max_ttl_s"]), tags=tags)
        )
    # Joining pings the initial peers, and each dials us back (validate) before it answers:
    # two fresh dials through two p2pds within one wait. At the per-peer wait (1 s at a 1 s
    # heartbeat) a loaded machine failed whole starts ("none of the initial_peers responded
    # to a ping"; the docker test lost ~100 s to two restarts of a worker and its p2pd), so
    # the join's pings wait as long as a request; once joined, the per-peer wait holds.
    wait_s = float(config["wait_timeout_s"])
    node = await DHTNode.create(
        initial_peers=config["initial_peers"] or None,
        host_maddrs=[config["listen"]],
        announce_maddrs=config.get("announce") or None,
        identity_path=config["identity_path"],
        check_if_identity_free=False,
        client_mode=bool(config["client_mode"]),
        nat_port_map=bool(config.get("nat_port_map", True)),
        record_validator=CompositeValidator(validators),
        wait_timeout=max(wait_s, float(config.get("join_timeout_s", wait_s))),
        bootstrap_timeout=wait_s,  # for the other initial peers, once one answered
        # Our gets ask for the latest value, so they always search the swarm: refreshing the
        # local cache in the background before an entry expires only adds traffic.
        cache_refresh_before_expiry=0,
    )
    node.protocol.wait_timeout = wait_s
    return node


async def run(config: dict[str, Any], channel_in: BinaryIO, channel_out: BinaryIO) -> None:
    """Start the node, say hello (or why not), serve until stdin closes, stop the node."""
    try:
        node = await start_node(config)
    except Exception as exc:
        logger.debug("the DHT node did not start", exc_info=True)
        write_message(channel_out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    try:
        maddrs = [str(m) for m in await node.get_visible_maddrs()]
        write_message(channel_out, {"ok": True, "peer_id": node.peer_id.to_base58(),
                                    "maddrs": maddrs})  # fmt: skip
        limits = ReplyLimits(
            max_entries=int(config.get("max_entries_per_key", 1024)),
            max_reply_bytes=int(config.get("max_reply_bytes", MAX_MESSAGE_BYTES)),
        )
        beam = int(config["search_beam"])  # DhtConfig.worker_config always sends it
        await serve_requests(NarrowSearch(node, beam), channel_in, channel_out, limits)
    finally:
        try:
            await asyncio.wait_for(node.shutdown(), _SHUTDOWN_S)  # stops p2pd, waits for it
        except Exception:
            logger.warning("the DHT node did not shut down cleanly", exc_info=True)


class NarrowSearch:
    """hivemind's DHTNode, each store and get searching ``beam_size`` nodes (see
    DhtConfig.search_beam); both are documented arguments of DHTNode's searches."""

    def __init__(self, node: Any, beam_size: int) -> None:
        self._node, self._beam_size = node, beam_size

    async def store(self, key: Any, value: Any, expiration_time: float, *, subkey: Any) -> bool:
        return await self._node.store(
            key, value, expiration_time, subkey=subkey, beam_size=self._beam_size
        )

    async def get(self, key: Any, *, latest: bool) -> Any:
        return await self._node.get(key, latest=latest, beam_size=self._beam_size)

    async def get_visible_maddrs(self, *, latest: bool) -> list[Any]:
        return await self._node.get_visible_maddrs(latest=latest)


def kill_children() -> list[int]:
    """Kill whatever this process started that is still running; their pids."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=_CHILD_EXIT_S)
    return [child.pid for child in children]


def main() -> None:
    # stdout is the protocol channel: keep a private copy and point fd 1 at stderr, so that
    # nothing a library prints can corrupt it.
    channel_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    channel_in = sys.stdin.buffer
    config = read_message(channel_in)
    configure_logging(config.get("log_level", "WARNING"))
    # p2pd (Go) inherits this environment. It carries only small DHT RPCs: one scheduler
    # thread serves them, and measured ~20% less idle CPU in a 4-node swarm than one per core.
    os.environ.setdefault("GOMAXPROCS", "1")
    import uvloop  # hivemind's own choice of loop for its DHT (and one of its dependencies)

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(run(config, channel_in, channel_out))
    finally:
        left = kill_children()
        if left:
            logger.warning("killed %d processes the DHT node left running: %s", len(left), left)


if __name__ == "__main__":
    main()
