"""Two members behind home routers exchanging tensors, reached through a member's relay only
(lanes punched where the routers allow: node/p2p/lane/punch.py); the relay is relay_main's.

    python -m tests.support.punch_main home KEY ADDR PUBLIC_IP RELAY
        # reserves a slot on RELAY: {"event": "reserved", "ok": ..., "peer_id": ...}; echoes
        # every tensor back negated; when its stdin closes: {"event": "lanes", ...} (the
        # peers its echoes went to on a lane, and on a punched one)
    python -m tests.support.punch_main away KEY ADDR PUBLIC_IP RELAY HOME_ID ROUNDS NUMEL
        # one line: {"event": "done", "first_s", "mb_s", "outbound", "punched"}, exits

PUBLIC_IP is where members see the host (its router's address): the verdict's observed IP.
"""

import json
import sys
import threading
import time
from pathlib import Path

import torch

from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
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


def main(argv: list[str]) -> int:
    role, key, addr, public_ip, relay, *rest = argv
    host = PeerHost(HostConfig(key_path=Path(key), listen_host=addr, dial_timeout_s=10.0))
    host.start()
    client = RelayClient(host).start()
    relay_id = host.connect(relay)
    transport = Transport(TransportConfig(key_path=Path(key)), host=host,
                          public_ip=lambda: public_ip)  # fmt: skip
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
