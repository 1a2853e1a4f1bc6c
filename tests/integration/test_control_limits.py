"""The control host's limits, on real hosts over 127.0.0.1. Probes served: a stranger holding a
probe open gets no second one, honest peers are still measured meanwhile, and a finished or
dropped probe frees its slot. Forwarding: a relay forwards at most its per-forwarder rate of a
flood it still delivers itself."""

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from libp2p.peer.id import ID

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import ProbeRefusedError
from fusionllm.node.p2p.control_host import (
    PROBE_PROTOCOL,
    ControlConfig,
    ControlHost,
)
from fusionllm.node.p2p.probes import PROBE_HEADER, PROBE_MAGIC
from tests.integration.test_control_host import drain, wait_until

logger = get_logger(__name__)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

_WAIT_S = 8.0


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Callable[..., ControlHost]]:
    with contextlib.ExitStack() as stack:
        count = 0

        def start(**overrides) -> ControlHost:
            nonlocal count
            count += 1
            config = ControlConfig(key_path=tmp_path / f"key{count}", **overrides)
            return stack.enter_context(ControlHost(config))

        yield start


async def _hold_a_probe(host: ControlHost, peer: str) -> int:
    """Ask for a probe, get admitted, then send nothing: the server's slot stays taken until
    its deadline. Returns the status byte; the stream is left open."""
    stream = await host.host.libp2p.new_stream(ID.from_base58(peer), [PROBE_PROTOCOL])
    await stream.write(PROBE_HEADER.pack(PROBE_MAGIC, 1 << 20, os.urandom(16)))
    with trio.fail_after(_WAIT_S):
        return (await stream.read(1))[0]


def test_a_stranger_holds_one_probe_slot_and_honest_peers_are_still_served(hosts):
    server = hosts(max_concurrent_probes_served=2, probe_timeout_s=2.0)
    stranger, honest, other = hosts(), hosts(), hosts()
    for client in (stranger, honest, other):
        client.connect(server.listen_addrs[0])
    assert stranger.host.call(_hold_a_probe, stranger, server.peer_id) == 0
    # Its second probe, while the first holds a slot, is refused: one per peer.
    with pytest.raises(ProbeRefusedError, match="still running"):
        stranger.probe(server.peer_id, nbytes=1000)
    # The other slot serves honest peers, one after the other.
    for client in (honest, other, honest):
        assert client.probe(server.peer_id, nbytes=64 << 10).bandwidth > 0
    stats = server.stats()
    assert (stats.probes_served, stats.probes_refused) == (3, 1)
    # The stalled probe ends at the server's deadline (2 x probe_timeout_s) and its slot is
    # free again: the stranger may probe once more.
    wait_until(lambda: server.stats().probe_errors == 1, "the stalled probe dropped")
    assert stranger.probe(server.peer_id, nbytes=1000).bytes == 1000


def test_all_slots_held_by_distinct_strangers_is_busy_until_one_ends(hosts):
    server = hosts(max_concurrent_probes_served=2, probe_timeout_s=1.0)
    strangers = [hosts() for _ in range(2)]
    honest = hosts()
    for client in (*strangers, honest):
        client.connect(server.listen_addrs[0])
    for stranger in strangers:
        assert stranger.host.call(_hold_a_probe, stranger, server.peer_id) == 0
    with pytest.raises(ProbeRefusedError, match="busy"):
        honest.probe(server.peer_id, nbytes=1000)
    wait_until(lambda: server.stats().probe_errors == 2, "the stalled probes dropped")
    assert honest.probe(server.peer_id, nbytes=1000).bytes == 1000


TOPIC = "fusionllm/limits"
_PUBLISH_GAP_S = 0.01


def test_a_relay_forwards_a_flood_at_its_forward_rate_and_still_delivers_it(hosts):
    # b checks each author at a generous rate, and forwards at most 3 per second per forwarder.
    a = hosts(max_messages_per_peer_per_s=1000.0)
    b = hosts(max_messages_per_peer_per_s=1000.0, max_forwards_per_peer_per_s=3.0)
    c = hosts(max_messages_per_peer_per_s=1000.0)
    assert b.connect(a.listen_addrs[0]) == a.peer_id
    assert c.connect(b.listen_addrs[0]) == b.peer_id
    for host in (a, b, c):
        host.subscribe(TOPIC)
    wait_until(lambda: a.mesh_peers(TOPIC) == [b.peer_id], "a meshed with b")
    wait_until(lambda: c.mesh_peers(TOPIC) == [b.peer_id], "c meshed with b")
    started = time.monotonic()
    for i in range(60):
        a.publish(TOPIC, b"flood %d" % i)
        # Paced so a's own outbound queue to b (py-libp2p keeps 32 RPCs, then drops) is not
        # what limits the flood: on a loaded box an unpaced burst of 60 reached b as 28.
        time.sleep(_PUBLISH_GAP_S)
    at_b = drain(b, quiet_s=1.5)
    elapsed = time.monotonic() - started - 1.5  # the flood reached b within this
    at_c = drain(c, quiet_s=1.5)
    logger.info("flood of 60: b got %d, c got %d, in %.2f s", len(at_b), len(at_c), elapsed)
    # b delivers what it validated (a's send queue drops only if a's sender stalls for
    # a third of a second) ...
    assert len(at_b) >= 45
    assert b.stats().messages_accepted == len(at_b)
    # ... and forwards at most 3 in any second of the flood (sliding 1 s window).
    assert 1 <= len(at_c) <= 3 * (math.ceil(elapsed) + 1)
    assert len(at_c) < len(at_b)
    assert {m.data for m in at_c} <= {m.data for m in at_b}
