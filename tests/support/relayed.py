"""Hosts on 127.0.0.1 that meet through a member's relay (node/p2p/member_relay.py)."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from fusionllm.node.p2p.member_relay import MemberRelay, MemberRelayConfig
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from fusionllm.node.p2p.relay_client import RelayClient
from fusionllm.node.p2p.transport import Transport
from tests.support.transport_node import _WAIT_S, HEADER


@contextlib.contextmanager
def relayed_hosts(
    tmp_path: Path, more: tuple[str, ...] = ()
) -> Iterator[tuple[dict[str, PeerHost], dict[str, RelayClient]]]:
    """A member's relay ("relay"), and members with relay clients ("home", "other", and any
    of ``more``), all connected to the relay; nobody holds a slot yet. Keys:
    ``tmp_path/<name>.key``."""
    names = ("home", "other", *more)
    hosts = {n: PeerHost(HostConfig(key_path=tmp_path / f"{n}.key")).start()
             for n in ("relay", *names)}  # fmt: skip
    try:
        members = {h.peer_id for h in hosts.values()}
        MemberRelay(hosts["relay"], MemberRelayConfig(), is_member=members.__contains__).start()
        clients = {n: RelayClient(hosts[n]).start() for n in names}
        for name in names:
            hosts[name].connect(hosts["relay"].addrs[0])
        yield hosts, clients
    finally:
        for host in hosts.values():
            host.close()


def exchange_both_ways(at_home: Transport, away: Transport, rounds: int) -> None:
    """Tensors both ways, each checked whole and in order (none lost on the way)."""
    for i in range(rounds):
        tensor = torch.arange(1000.0) + i
        away.send_tensor(at_home.peer_id, HEADER, tensor, timeout=_WAIT_S)
        got = at_home.recv(timeout=_WAIT_S)
        assert (got.peer, got.tensor.tolist()) == (away.peer_id, tensor.tolist())
        at_home.send_tensor(away.peer_id, HEADER, -tensor, timeout=_WAIT_S)
        assert torch.equal(away.recv(timeout=_WAIT_S).tensor, -tensor)
