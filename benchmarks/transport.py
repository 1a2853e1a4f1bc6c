"""One-way throughput of the tensor transport vs raw TCP, between two processes on loopback.

    python benchmarks/transport.py [--rounds 5] [--sizes-mb 1 8 64] [--json PATH]

The receiver is a separate node process (``tests.support.transport_main --mode ack``): it
reads each frame, decodes and validates the tensor, and answers with a one-element control
frame. Two times per frame, medians over the rounds:

- write: until ``send`` returns (all bytes handed to yamux/noise; the muxer window means the
  receiver holds all but the last <=16 MB by then);
- ack:   until the receiver's answer is back (the frame crossed, was decoded and validated).

Raw TCP is plain sockets with the same sizes in the same run (8-byte length, payload, 1-byte
ack), the ceiling for this machine. Then a breakdown of where the time of one frame goes,
each part timed alone in this process.
"""

import argparse
import json
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

from fusionllm.compression import pack_tensor, unpack_tensor
from fusionllm.node.children import JsonChild
from fusionllm.node.p2p.framing import FrameHeader, encode_head, read_exactly, read_head
from fusionllm.node.p2p.transport import _WRITE_CHUNK_BYTES, Transport, TransportConfig

_MB = 1 << 20
_START_S = 30.0


def _raw_server() -> None:
    """Child process: accept one connection, read length-prefixed payloads, ack each."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    while True:
        prefix = _recv_exactly(conn, 8)
        if prefix is None:
            return
        (size,) = struct.unpack(">Q", prefix)
        if _recv_exactly(conn, size) is None:
            return
        conn.sendall(b"k")


def _recv_exactly(conn: socket.socket, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = conn.recv_into(view[got:], min(size - got, 4 * _MB))
        if n == 0:
            return None
        got += n
    return buffer


def bench_raw_tcp(sizes_mb: list[int], rounds: int) -> dict[int, dict[str, float]]:
    with JsonChild([sys.executable, __file__, "--raw-server"]) as child:
        port = int(child.next_event(_START_S))
        conn = socket.create_connection(("127.0.0.1", port), timeout=_START_S)
        results = {}
        for size_mb in sizes_mb:
            payload = bytes(size_mb * _MB)
            times = []
            for _ in range(rounds):
                started = time.perf_counter()
                conn.sendall(struct.pack(">Q", len(payload)))
                conn.sendall(payload)
                if conn.recv(1) != b"k":
                    raise RuntimeError("raw TCP receiver went away")
                times.append(time.perf_counter() - started)
            results[size_mb] = {"ack_s": statistics.median(times)}
        conn.close()
        return results


def bench_transport(sizes_mb: list[int], rounds: int, workdir: Path) -> dict[int, dict[str, float]]:
    max_frame = max(sizes_mb) * _MB + _MB
    child = JsonChild(
        [
            sys.executable,
            "-m",
            "tests.support.transport_main",
            "--key",
            str(workdir / "receiver.key"),
            "--mode",
            "ack",
            "--max-frame-bytes",
            str(max_frame),
        ],
        stdin=True,
        cwd=Path(__file__).resolve().parents[1],  # the repo root: tests.support imports
    )
    try:
        ready = child.next_event(_START_S)
        config = TransportConfig(key_path=workdir / "sender.key", max_frame_bytes=max_frame)
        results = {}
        with Transport(config) as transport:
            peer = transport.connect(ready["addrs"][0])
            for size_mb in sizes_mb:
                body = pack_tensor(torch.randn(size_mb * _MB // 4))  # fp32, IdentityCodec
                writes, acks = [], []
                for step in range(rounds + 1):  # the first round warms the stream's window
                    header = FrameHeader(step=step, micro_batch=0, kind="activation", stage=0)
                    started = time.perf_counter()
                    transport.send(peer, header, body, timeout=120)
                    written = time.perf_counter()
                    transport.recv(timeout=120)
                    if step:
                        writes.append(written - started)
                        acks.append(time.perf_counter() - started)
                results[size_mb] = {
                    "write_s": statistics.median(writes),
                    "ack_s": statistics.median(acks),
                    "frame_bytes": len(body),
                }
        return results
    finally:
        child.finish(timeout=10)  # the node exits when its stdin closes


def _best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


class _ChunkStream:
    """Serves a buffer in muxer-sized chunks, like py-libp2p's read() does."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.view = memoryview(data)
        self.pos = 0
        self.chunk = chunk

    async def read(self, n: int) -> bytes:
        take = min(n, self.chunk, len(self.view) - self.pos)
        out = bytes(self.view[self.pos : self.pos + take])
        self.pos += take
        return out


def breakdown(size_mb: int) -> dict[str, float]:
    """Seconds per frame of ``size_mb`` for each piece of the path, timed alone."""
    import trio
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    tensor = torch.randn(size_mb * _MB // 4)
    body = pack_tensor(tensor)
    header = FrameHeader(step=0, micro_batch=0, kind="activation", stage=0)
    frame = encode_head(header, len(body)) + body
    yamux_payload = _WRITE_CHUNK_BYTES  # what the transport hands yamux per write
    noise_max = 65535 - 16  # largest Noise plaintext; one yamux frame fits exactly

    def noise_encrypt() -> None:
        cipher = ChaCha20Poly1305(bytes(32))
        nonce = bytes(12)
        view = memoryview(frame)
        for start in range(0, len(view), yamux_payload):
            chunk = struct.pack(">BBHII", 0, 0, 0, 1, 0) + view[start : start + yamux_payload]
            for piece in range(0, len(chunk), noise_max):
                cipher.encrypt(nonce, chunk[piece : piece + noise_max], None)

    scratch = bytearray(len(body))

    def read_loop() -> None:
        async def main() -> None:
            stream = _ChunkStream(frame, yamux_payload)
            _, body_len = await read_head(stream, max_body_bytes=len(body), stall_timeout_s=10)
            await read_exactly(stream, body_len, stall_timeout_s=10, into=scratch)

        trio.run(main)

    return {
        "pack_tensor (sender, before the clock starts)": _best_of(lambda: pack_tensor(tensor)),
        "noise encrypt (sender); decrypt costs the same": _best_of(noise_encrypt),
        "framing read loop, 64 KiB reads, warm buffer": _best_of(read_loop),
        "unpack_tensor (receiver: one copy + validate)": _best_of(lambda: unpack_tensor(body)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_server:
        _raw_server()
        return 0

    with tempfile.TemporaryDirectory() as workdir:
        p2p = bench_transport(args.sizes_mb, args.rounds, Path(workdir))
    raw = bench_raw_tcp(args.sizes_mb, args.rounds)
    rows = []
    print(f"one-way MB/s (MB = 1e6 bytes), medians of {args.rounds} rounds, 127.0.0.1\n")
    print(f"{'size':>6} {'libp2p write':>13} {'libp2p ack':>11} {'raw TCP':>9} {'ack/raw':>8}")
    for size_mb in args.sizes_mb:
        nbytes = p2p[size_mb]["frame_bytes"]
        row = {
            "size_mb": size_mb,
            "frame_bytes": nbytes,
            "libp2p_write_mb_s": nbytes / p2p[size_mb]["write_s"] / 1e6,
            "libp2p_ack_mb_s": nbytes / p2p[size_mb]["ack_s"] / 1e6,
            "raw_tcp_mb_s": size_mb * _MB / raw[size_mb]["ack_s"] / 1e6,
        }
        rows.append(row)
        print(
            f"{size_mb:>4}MB {row['libp2p_write_mb_s']:>13.0f} {row['libp2p_ack_mb_s']:>11.0f} "
            f"{row['raw_tcp_mb_s']:>9.0f} {row['libp2p_ack_mb_s'] / row['raw_tcp_mb_s']:>8.2f}"
        )
    size_mb = max(args.sizes_mb)
    parts = breakdown(size_mb)
    print(f"\nwhere the time of one {size_mb} MB frame goes (each part alone, best of 3):")
    for name, seconds in parts.items():
        print(f"  {name:<48} {seconds * 1e3:8.1f} ms")
    ack_s = p2p[size_mb]["ack_s"]
    in_path = sum(v for k, v in parts.items() if not k.startswith("pack_tensor"))
    in_path += parts["noise encrypt (sender); decrypt costs the same"]  # the receiver decrypts
    parts["rest: py-libp2p yamux/noise framing, trio, sockets"] = ack_s - in_path
    print(f"  {'rest: py-libp2p yamux/noise, trio, sockets':<48} {(ack_s - in_path) * 1e3:8.1f} ms")
    print(f"  {'= libp2p ack time (whole path, median)':<48} {ack_s * 1e3:8.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "breakdown_s": parts}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
