"""Two members behind home routers exchanging tensors, reached through a member's relay only
(lanes punched where the routers allow: node/p2p/lane/punch.py); the relay is relay_main's.

    python -m tests.support.punch_main home KEY ADDR PUBLIC_IP RELAY
        # reserves a slot on RELAY: {"event": "reserved", "ok": ..., "peer_id": ...}; echoes
        # every tensor back negated; when its stdin closes: {"event": "lanes", ...} (the
        # peers its echoes went to on a lane, and on a punched one)
    python -m tests.support.punch_main away KEY ADDR PUBLIC_IP RELAY HOME_ID ROUNDS NUMEL
        # one line: {"event": "done", "first_s", "mb_s", "outbound", "punched"}, exits

PUBLIC_IP is where members see the host (its router's address), or "verdict": then the host
asks RELAY's host to dial it back first, as a node's reachability check does, and punches
from the verdict's observed IP (``punch_ip``); its first line says the verdict and the time.
"""

import json
import sys
import threading
import time
from pathlib import Path

import torch
from libp2p.peer.id import ID

from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.dialback import DialBackConfig, ask
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from fusionllm.node.p2p.reachability import judge, punch_ip
from fusionllm.node.p2p.relay_addrs import relayed_addr
from fusionllm.node.p2p.relay_client import RelayClient
from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.support.transport_node import HEADER

_WAIT_S = 30.0


def _say(**event) -> None:
    print(json.dumps(event), flush=True)


def _home(transport: Transport) -> None:
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    outbound: set[str] = set()  # peers our echoes went to over a lane, while they were here
    punched: set[str] = set()
    while not closed.is_set():
        try:
            got = transport.recv(timeout=0.2)
        except DeadlineError:
            continue
        transport.send_tensor(got.peer, HEADER, -got.tensor, timeout=_WAIT_S)
        outbound.update(transport.outbound_lanes())
        punched.update(transport.punched_lanes())
    _say(event="lanes", outbound=sorted(outbound), punched=sorted(punched))


def _round_trip(transport: Transport, peer: str, tensor: torch.Tensor) -> None:
    transport.send_tensor(peer, HEADER, tensor, timeout=_WAIT_S)
    back = transport.recv(timeout=_WAIT_S).tensor
    if not torch.equal(back, -tensor):
        raise AssertionError("the echo came back altered")


def _away(transport: Transport, relay: str, home: str, rounds: int, numel: int) -> None:
    start = time.monotonic()
    transport.connect(relayed_addr(relay, home), timeout=20.0)
    _round_trip(transport, home, torch.arange(16.0))  # the lane (or stream) opens here
    first_s = time.monotonic() - start
    tensor = torch.randn(numel)  # (numel,) fp32, an activation's worth of bytes
    start = time.monotonic()
    for _ in range(rounds):
        _round_trip(transport, home, tensor)
    seconds = time.monotonic() - start
    _say(event="done", first_s=round(first_s, 3),
         mb_s=round(2 * rounds * tensor.numel() * 4 / seconds / 1e6, 3),
         outbound=transport.outbound_lanes(), punched=transport.punched_lanes())  # fmt: skip


def _verdict(host: PeerHost, relay_id: str) -> str | None:
    """Ask the relay's host to dial us back; the verdict's punch IP (None: not private)."""
    start = time.monotonic()
    ports = sorted({int(a.split("/tcp/")[1].split("/")[0]) for a in host.bound_addrs})
    answer = host.call(ask, host.libp2p, ID.from_base58(relay_id), ports, DialBackConfig())
    reach = judge([answer], listen_ips=[host.config.listen_host], confirmations=1)
    _say(event="verdict", verdict=reach.verdict, observed=list(reach.observed_ips),
         verdict_s=round(time.monotonic() - start, 3))  # fmt: skip
    return punch_ip(reach)


def main(argv: list[str]) -> int:
    role, key, addr, public_ip, relay, *rest = argv
    host = PeerHost(HostConfig(key_path=Path(key), listen_host=addr, dial_timeout_s=10.0))
    host.start()
    client = RelayClient(host).start()
    relay_id = host.connect(relay)
    ip = _verdict(host, relay_id) if public_ip == "verdict" else public_ip
    transport = Transport(TransportConfig(key_path=Path(key)), host=host, public_ip=lambda: ip)
    transport.start()
    try:
        if role == "home":
            _say(event="reserved", ok=client.reserve(relay_id), peer_id=host.peer_id)
            _home(transport)
        else:
            _away(transport, relay, rest[0], int(rest[1]), int(rest[2]))
    finally:
        transport.close()
        host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
