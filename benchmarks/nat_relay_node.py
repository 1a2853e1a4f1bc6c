"""One node of benchmarks/nat_relay.py: a py-libp2p circuit relay v2 relay, a listener that
reserves a slot on it, or a dialer that times streams to both (one JSON line each).

    python -m benchmarks.nat_relay_node relay PORT [--data-mib N]
    python -m benchmarks.nat_relay_node listener PORT RELAY_ADDR
    python -m benchmarks.nat_relay_node dialer PORT RELAY_ADDR LISTENER_ID --mib M --rounds R

The hosts are ours (noise + yamux, node/p2p/host.py); the relay, its limits and the
reservation are py-libp2p 0.8.1's (``libp2p.relay.circuit_v2``). A stream carries an 8-byte
length, then the bytes; the sink answers b"ok" once all arrived. The dialer alternates a
direct stream to the relay's host and a relayed one to the listener (same links but one).
"""

import argparse
import json
import time

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.discovery import RelayDiscovery
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID, STOP_PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from fusionllm.node.p2p.host import new_secure_host

SINK = TProtocol("/fusionllm/bench-sink/1.0.0")
_CHUNK = 1 << 16


def _say(**event) -> None:
    print(json.dumps(event), flush=True)


async def _sink(stream) -> None:
    want = int.from_bytes(await stream.read(8), "big")
    got = 0
    while got < want:
        data = await stream.read(_CHUNK)
        if not data:
            break
        got += len(data)
    await stream.write(b"ok")
    await stream.close()


async def _send(host, peer: ID, nbytes: int, timeout: float) -> dict:
    started = time.monotonic()
    try:
        with trio.fail_after(timeout):
            stream = await host.new_stream(peer, [SINK])
            await stream.write(nbytes.to_bytes(8, "big"))
            chunk = bytes(_CHUNK)
            for _ in range(nbytes // _CHUNK):
                await stream.write(chunk)
            if await stream.read(2) != b"ok":
                raise ConnectionError("no ack")
    except Exception as exc:  # a benchmark row records why a transfer failed
        return {"ok": False, "error": type(exc).__name__, "seconds": time.monotonic() - started}
    seconds = time.monotonic() - started
    return {"ok": True, "seconds": seconds, "mb_s": nbytes / seconds / 1e6}


async def run(args: argparse.Namespace) -> None:
    host = new_secure_host(create_new_key_pair(), negotiate_timeout_s=10)
    hop = args.role == "relay"
    limits = RelayLimits(duration=3600, data=args.data_mib << 20, max_circuit_conns=8,
                         max_reservations=8)  # fmt: skip
    roles = RelayRole.STOP | RelayRole.CLIENT | (RelayRole.HOP if hop else RelayRole(0))
    protocol = CircuitV2Protocol(host, limits=limits, allow_hop=hop)
    listen = multiaddr.Multiaddr(f"/ip4/0.0.0.0/tcp/{args.port}")
    async with host.run(listen_addrs=[listen]), background_trio_service(protocol):
        host.set_stream_handler(PROTOCOL_ID, protocol._handle_hop_stream)
        host.set_stream_handler(STOP_PROTOCOL_ID, protocol._handle_stop_stream)
        host.set_stream_handler(SINK, _sink)
        transport = CircuitV2Transport(host, protocol, RelayConfig(roles=roles, limits=limits))
        discovery = RelayDiscovery(host, auto_reserve=True)
        transport.discovery = discovery
        async with background_trio_service(discovery):
            _say(event="ready", peer_id=host.get_id().to_base58())
            if hop:
                await trio.sleep_forever()
            relay = info_from_p2p_addr(multiaddr.Multiaddr(args.relay))
            await host.connect(relay)
            if args.role == "listener":
                # auto_reserve only looks at peers connected when discovery starts, then every
                # 300 s: reserve on the relay we just connected to ourselves
                await discovery.discover_relays()
                _say(event="reserved", ok=await discovery.make_reservation(relay.peer_id))
                await trio.sleep_forever()
            await _dial(host, transport, relay.peer_id, args)


async def _dial(host, transport, relay: ID, args: argparse.Namespace) -> None:
    listener = ID.from_base58(args.listener)
    circuit = multiaddr.Multiaddr(f"{args.relay}/p2p-circuit/p2p/{listener}")
    with trio.fail_after(60):
        await transport.dial(circuit)
    nbytes = args.mib << 20
    for i in range(args.rounds):
        for path, peer in (("direct", relay), ("relayed", listener)):
            _say(event="transfer", path=path, round=i, bytes=nbytes,
                 **await _send(host, peer, nbytes, args.timeout))  # fmt: skip
    _say(event="done")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nat_relay_node")
    parser.add_argument("role", choices=["relay", "listener", "dialer"])
    parser.add_argument("port", type=int)
    parser.add_argument("relay", nargs="?", help="the relay's multiaddr (listener, dialer)")
    parser.add_argument("listener", nargs="?", help="the listener's peer id (dialer)")
    parser.add_argument("--data-mib", type=int, default=1024, help="relay: bytes per circuit")
    parser.add_argument("--mib", type=int, default=8, help="dialer: MiB per transfer")
    parser.add_argument("--rounds", type=int, default=3, help="dialer: direct/relayed pairs")
    parser.add_argument("--timeout", type=float, default=120.0, help="dialer: s per transfer")
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
