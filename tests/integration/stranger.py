"""A stranger to the swarm: py-libp2p hosts with fresh identities that attack a node's data plane.

    python -m tests.integration.stranger --target ADDR [--member-key PATH ...] [--strangers 64]
        [--floods 1000] [--duration 30] [--max-body BYTES]

It builds its hosts, prints ``{"event": "ready"}``, waits for a line on stdin, attacks for
``--duration`` seconds, prints ``{"event": "done", "counts": {...}}`` and exits. The attacks:

- members (keys the node was told to admit, i.e. peers the plan expects but that lie):
  top-k frames of a few bytes declaring 2**28 elements, garbage, truncated frames, a head and
  then silence, bodies trickled a byte at a time, maximal body announcements, over and over on
  fresh streams;
- ``--strangers`` fresh identities, each announcing a maximal body on a tensor stream and then
  trickling it, reopening a stream whenever the node resets one;
- ``--floods`` raw TCP connection attempts, 64 at a time, as many as ``--duration`` allows:
  garbage, a stalled multistream handshake, or an immediate close (what a scanner does; none
  gets as far as a handshake). Counted as begun, through (``knocks``), refused, and cut by the
  end of the attack.

Written for tests only: it uses py-libp2p's public API, nothing of the node's transport.
"""

import argparse
import json
import os
import random
import struct
import sys
from collections import Counter
from collections.abc import Sequence

import msgpack
import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from fusionllm.node.p2p.identity import load_or_create_identity

TENSOR = TProtocol("/fusionllm/tensor/1.0.0")  # the node's protocol, as a stranger learns it
_FLOOD_CONCURRENCY = 64


def _head(body_len: int, *, step: int = 0, micro_batch: int = 0) -> bytes:
    """The data plane's frame head, written from its wire description (not its code)."""
    header = msgpack.packb(
        {"step": step, "micro_batch": micro_batch, "kind": "activation", "stage": 0},
        use_bin_type=True,
    )
    return struct.pack(">BHI", 1, len(header), body_len) + header


def expanding_body(elements: int = 2**28) -> bytes:
    """A top-k frame of a few dozen bytes whose header declares ``elements`` float32."""
    return msgpack.packb(
        {"v": 1, "c": "topk", "dt": "float32", "sh": [elements], "wd": "float16", "k": 0,
         "ix": "i32", "p": b"", "ixp": b""},
        use_bin_type=True,
    )  # fmt: skip


def _host(key_pair):
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
    )


class Attack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.target = info_from_p2p_addr(multiaddr.Multiaddr(args.target))
        self.tcp = (args.target.split("/")[2], int(args.target.split("/")[4]))
        self.counts: Counter[str] = Counter()
        self.deadline = 0.0
        self.go = trio.Event()

    async def run(self, ready) -> None:
        hosts = [_host(load_or_create_identity(path)) for path in self.args.member_key or []]
        members = len(hosts)
        hosts += [_host(create_new_key_pair()) for _ in range(self.args.strangers)]
        async with trio.open_nursery() as nursery:
            for i, host in enumerate(hosts):
                nursery.start_soon(self._serve, host, i < members)
            ready()
            await trio.to_thread.run_sync(sys.stdin.readline)
            self.deadline = trio.current_time() + self.args.duration
            self.go.set()
            nursery.start_soon(self._flood)
            await trio.sleep(self.args.duration + 1)
            nursery.cancel_scope.cancel()

    async def _serve(self, host, member: bool) -> None:
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            await self.go.wait()
            try:
                with trio.fail_after(10):
                    await host.connect(self.target)
                self.counts["connected"] += 1
            except Exception:
                self.counts["connect_failed"] += 1
                return
            if member:
                async with trio.open_nursery() as nursery:
                    for lane in range(3):
                        nursery.start_soon(self._member_lane, host, lane)
            else:
                await self._trickle_forever(host, "stranger")

    async def _stream(self, host):
        with trio.fail_after(10):
            return await host.new_stream(self.target.peer_id, [TENSOR])

    async def _member_lane(self, host, lane: int) -> None:
        """One member's attacks in turn, each on a fresh stream, until the deadline."""
        attacks = [self._expand, self._garbage, self._truncate, self._stall, self._announce_max]
        turn = lane
        while trio.current_time() < self.deadline:
            attack = attacks[turn % len(attacks)] if lane else self._trickle_once
            turn += 1
            try:
                stream = await self._stream(host)
                await attack(stream)
            except Exception as exc:  # the node resets us: that is the point
                self.counts[f"{attack.__name__.strip('_')}:{type(exc).__name__}"] += 1
            else:
                self.counts[attack.__name__.strip("_")] += 1
            await trio.sleep(0.05)

    async def _wait_for_end(self, stream, seconds: float = 15.0) -> None:
        with trio.move_on_after(seconds):
            await stream.read(1)

    async def _expand(self, stream) -> None:
        for step in range(8):  # a whole burst on one stream, if the node lets it
            body = expanding_body()
            await stream.write(_head(len(body), step=step) + body)
        await self._wait_for_end(stream)

    async def _garbage(self, stream) -> None:
        await stream.write(os.urandom(4096))
        await self._wait_for_end(stream)

    async def _truncate(self, stream) -> None:
        await stream.write(_head(4000) + bytes(100))
        await stream.close()

    async def _stall(self, stream) -> None:
        await stream.write(_head(4000) + bytes(10))
        await self._wait_for_end(stream, 20.0)

    async def _announce_max(self, stream) -> None:
        await stream.write(_head(self.args.max_body))
        await self._trickle(stream, 1 << 20)

    async def _trickle_once(self, stream) -> None:
        """A body no longer than the expected frame, a byte at a time: the rate floor's case."""
        await stream.write(_head(4000))
        await self._trickle(stream, 4000)

    async def _trickle(self, stream, size: int) -> None:
        for _ in range(size):
            if trio.current_time() > self.deadline:
                return
            await stream.write(b"\0")
            await trio.sleep(0.5)

    async def _trickle_forever(self, host, who: str) -> None:
        while trio.current_time() < self.deadline:
            try:
                stream = await self._stream(host)
                await self._announce_max(stream)
            except Exception as exc:
                self.counts[f"{who}:{type(exc).__name__}"] += 1
            await trio.sleep(0.5)

    async def _flood(self) -> None:
        slots = trio.Semaphore(_FLOOD_CONCURRENCY)
        async with trio.open_nursery() as nursery:
            for i in range(self.args.floods):
                await slots.acquire()
                nursery.start_soon(self._knock, i, slots)

    async def _knock(self, i: int, slots: trio.Semaphore) -> None:
        self.counts["knocks_begun"] += 1
        try:
            with trio.move_on_after(5):
                sock = await trio.open_tcp_stream(*self.tcp)
                async with sock:
                    kind = i % 3
                    if kind == 0:
                        await sock.send_all(os.urandom(random.randint(1, 512)))
                    elif kind == 1:
                        await sock.send_all(b"\x13/multistream/1.0.0\n")
                        await trio.sleep(2)
            self.counts["knocks"] += 1
        except OSError:
            self.counts["knocks_refused"] += 1
        except BaseException as exc:
            # In flight when the attack's time was up: Cancelled, or (cut inside
            # open_tcp_stream's own nursery) a group of Cancelled only.
            cut = isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None
            cut = cut or isinstance(exc, trio.Cancelled)
            self.counts["knocks_cut" if cut else f"knock:{type(exc).__name__}"] += 1
            raise
        finally:
            slots.release()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="the node's /ip4/.../tcp/.../p2p/... addr")
    parser.add_argument("--member-key", action="append", help="a key the node admits")
    parser.add_argument("--strangers", type=int, default=64)
    parser.add_argument("--floods", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--max-body", type=int, default=256 << 20)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    attack = Attack(args)

    def say(event: dict) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    try:
        trio.run(attack.run, lambda: say({"event": "ready"}))
    finally:
        say({"event": "done", "counts": dict(attack.counts)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
