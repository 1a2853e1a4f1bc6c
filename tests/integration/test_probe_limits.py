"""Concurrent probes served, on real hosts over 127.0.0.1: a stranger holding a probe open gets
no second one, and honest peers are still measured meanwhile; a finished or dropped probe
frees its slot."""

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from libp2p.peer.id import ID

from fusionllm.node.errors import ProbeRefusedError
from fusionllm.node.p2p.control_host import PROBE_PROTOCOL, ControlConfig, ControlHost
from fusionllm.node.p2p.probes import PROBE_HEADER, PROBE_MAGIC

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


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {_WAIT_S}s"
        time.sleep(0.02)


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
