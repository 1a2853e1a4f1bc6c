"""One-way throughput of the tensor transport vs raw TCP, between two processes on loopback.

    python benchmarks/transport.py [--rounds 5] [--sizes-kb 64 1024 65536] [--json PATH]

The receiver is a separate node process (``tests.support.transport_main --mode ack``): it
reads each frame, decodes and validates the tensor, and answers with a one-element control
frame. Per size, two patterns:

- one at a time: send a frame, wait for its answer (medians over the rounds); ``write`` is
  until ``send`` returns, ``ack`` until the answer is back (crossed, decoded, validated);
- streaming: ``--stream-mb`` worth of frames (4 to 400) sent with ``send_async`` (the
  transport's ``max_in_flight`` window), throughput from the first send to the last answer,
  and the CPU both processes spent per frame (a figure other load on a shared box barely
  moves, unlike the wall-clock ones).

Raw TCP runs both patterns the same way in the same run (8-byte length, payload read into a
buffer, a 1-byte answer per frame; streaming: frames written back to back by one thread while
another reads the answers), the ceiling for this machine. Both sides run one torch thread, as
pipeline stages do. Then a breakdown of one frame, each part timed alone in this process.
"""

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from fusionllm.compression import pack_tensor, unpack_tensor
from fusionllm.node.children import JsonChild
from fusionllm.node.p2p.framing import FrameHeader, encode_head, read_exactly, read_head
from fusionllm.node.p2p.transport import _WRITE_CHUNK_BYTES, Transport, TransportConfig

_MB = 1 << 20
_KB = 1 << 10
_START_S = 30.0
_MAX_STREAM_FRAMES = 400


def _raw_server() -> None:
    """Child process: accept one connection, read length-prefixed payloads, ack each."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


def _stream_frames(size: int, stream_mb: int) -> int:
    return max(4, min(_MAX_STREAM_FRAMES, stream_mb * _MB // size))


class _Cpu:
    """CPU seconds (user + system, all threads) of this process and a child since creation."""

    def __init__(self, child_pid: int) -> None:
        self._procs = [psutil.Process(os.getpid()), psutil.Process(child_pid)]
        self._start = self._now()

    def _now(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self._procs)

    def spent(self) -> float:
        return self._now() - self._start


def bench_raw_tcp(sizes: list[int], rounds: int, stream_mb: int) -> dict[int, dict[str, float]]:
    with JsonChild([sys.executable, __file__, "--raw-server"]) as child:
        port = int(child.next_event(_START_S))
        conn = socket.create_connection(("127.0.0.1", port), timeout=_START_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        results = {}
        for size in sizes:
            payload = bytes(size)
            prefix = struct.pack(">Q", len(payload))
            times = []
            for _ in range(rounds + 1):  # the first round warms the connection
                started = time.perf_counter()
                conn.sendall(prefix)
                conn.sendall(payload)
                if _recv_exactly(conn, 1) != b"k":
                    raise RuntimeError("raw TCP receiver went away")
                times.append(time.perf_counter() - started)
            frames = _stream_frames(size, stream_mb)

            def write_all(n: int = frames, prefix: bytes = prefix, payload: bytes = payload):
                for _ in range(n):
                    conn.sendall(prefix)
                    conn.sendall(payload)

            cpu = _Cpu(child.pid)
            started = time.perf_counter()
            writer = threading.Thread(target=write_all)
            writer.start()
            if _recv_exactly(conn, frames) != b"k" * frames:
                raise RuntimeError("raw TCP receiver went away")
            stream_s = time.perf_counter() - started
            writer.join()
            results[size] = {
                "ack_s": statistics.median(times[1:]),
                "stream_s": stream_s / frames,
                "cpu_s": cpu.spent() / frames,
            }
        conn.close()
        return results


def bench_transport(
    sizes: list[int], rounds: int, stream_mb: int, workdir: Path
) -> dict[int, dict[str, float]]:
    max_frame = max(sizes) + _MB
    argv = [sys.executable, "-m", "tests.support.transport_main"]
    argv += ["--key", str(workdir / "receiver.key"), "--mode", "ack", "--threads", "1"]
    argv += ["--max-frame-bytes", str(max_frame)]
    # cwd: the repo root, where tests.support imports from
    child = JsonChild(argv, stdin=True, cwd=Path(__file__).resolve().parents[1])
    try:
        ready = child.next_event(_START_S)
        config = TransportConfig(key_path=workdir / "sender.key", max_frame_bytes=max_frame)
        results = {}
        with Transport(config) as transport:
            peer = transport.connect(ready["addrs"][0])
            for size in sizes:
                body = pack_tensor(torch.randn(size // 4))  # fp32, IdentityCodec
                results[size] = _one_at_a_time(transport, peer, body, rounds)
                results[size].update(_streaming(transport, peer, body, stream_mb, child.pid))
        return results
    finally:
        child.finish(timeout=10)  # the node exits when its stdin closes


def _one_at_a_time(transport: Transport, peer: str, body: bytes, rounds: int) -> dict:
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
    return {
        "write_s": statistics.median(writes),
        "ack_s": statistics.median(acks),
        "frame_bytes": len(body),
    }


def _streaming(transport: Transport, peer: str, body: bytes, stream_mb: int, child: int) -> dict:
    frames = _stream_frames(len(body), stream_mb)
    answers: list[int] = []

    def collect() -> None:
        for _ in range(frames):
            answers.append(transport.recv(timeout=120).header.micro_batch)

    collector = threading.Thread(target=collect)
    cpu = _Cpu(child)
    started = time.perf_counter()
    collector.start()
    futures = []
    for i in range(frames):
        header = FrameHeader(step=1, micro_batch=i, kind="activation", stage=0)
        futures.append(transport.send_async(peer, header, body, timeout=120))
    for future in futures:
        future.result(120)
    collector.join()
    elapsed = time.perf_counter() - started
    # Every frame answered once. Not in order: send_async frames to one peer may cross in
    # any order (trio starts the tasks that write them in no promised order).
    if sorted(answers) != list(range(frames)):
        raise RuntimeError("frames were lost or answered twice")
    return {"stream_s": elapsed / frames, "cpu_s": cpu.spent() / frames, "frames": frames}


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


def breakdown(size: int) -> dict[str, float]:
    """Seconds per frame of ``size`` bytes for each piece of the path, timed alone."""
    import trio
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    tensor = torch.randn(size // 4)
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


def _label(size: int) -> str:
    return f"{size // _MB}MB" if size >= _MB else f"{size // _KB}KB"


def _rows(p2p: dict, raw: dict, sizes: list[int]) -> list[dict]:
    rows = []
    for size in sizes:
        nbytes = p2p[size]["frame_bytes"]
        row = {
            "size_bytes": size,
            "frame_bytes": nbytes,
            "stream_frames": p2p[size]["frames"],
            "libp2p_write_mb_s": nbytes / p2p[size]["write_s"] / 1e6,
            "libp2p_ack_mb_s": nbytes / p2p[size]["ack_s"] / 1e6,
            "raw_tcp_mb_s": size / raw[size]["ack_s"] / 1e6,
            "libp2p_stream_mb_s": nbytes / p2p[size]["stream_s"] / 1e6,
            "raw_tcp_stream_mb_s": size / raw[size]["stream_s"] / 1e6,
            "libp2p_cpu_ms_per_frame": p2p[size]["cpu_s"] * 1e3,
            "raw_tcp_cpu_ms_per_frame": raw[size]["cpu_s"] * 1e3,
        }
        row["ack_ratio"] = row["libp2p_ack_mb_s"] / row["raw_tcp_mb_s"]
        row["stream_ratio"] = row["libp2p_stream_mb_s"] / row["raw_tcp_stream_mb_s"]
        rows.append(row)
    return rows


def _print_rows(rows: list[dict], rounds: int) -> None:
    print(f"one-way MB/s (MB = 1e6 bytes), 127.0.0.1; one at a time: medians of {rounds}\n")
    print(
        f"{'size':>5} | {'one at a time: write':>20} {'ack':>6} {'raw TCP':>8} {'ratio':>6} "
        f"| {'streaming':>9} {'raw TCP':>8} {'ratio':>6} | {'CPU ms/frame':>12} {'raw':>6}"
    )
    for row in rows:
        print(
            f"{_label(row['size_bytes']):>5} | {row['libp2p_write_mb_s']:>20.0f} "
            f"{row['libp2p_ack_mb_s']:>6.0f} {row['raw_tcp_mb_s']:>8.0f} {row['ack_ratio']:>6.2f} "
            f"| {row['libp2p_stream_mb_s']:>9.0f} {row['raw_tcp_stream_mb_s']:>8.0f} "
            f"{row['stream_ratio']:>6.2f} | {row['libp2p_cpu_ms_per_frame']:>12.2f} "
            f"{row['raw_tcp_cpu_ms_per_frame']:>6.2f}"
        )
    by_size = {row["size_bytes"]: row for row in rows}
    print()
    for size, key, target, what in (
        (_MB, "ack_ratio", 0.25, "1 MB one at a time"),
        (64 * _MB, "stream_ratio", 0.50, "64 MB streaming"),
    ):
        if size in by_size:
            got = by_size[size][key]
            verdict = "met" if got >= target else "NOT met"
            print(f"target: {what} >= {target:.0%} of raw TCP: {got:.1%} ({verdict})")


def _print_breakdown(size: int, ack_s: float) -> dict[str, float]:
    parts = breakdown(size)
    print(f"\nwhere the time of one {_label(size)} frame goes (each part alone, best of 3):")
    for name, seconds in parts.items():
        print(f"  {name:<48} {seconds * 1e3:8.1f} ms")
    noise_s = parts["noise encrypt (sender); decrypt costs the same"]
    in_path = sum(v for k, v in parts.items() if not k.startswith("pack_tensor")) + noise_s
    parts["rest: py-libp2p yamux/noise framing, trio, sockets"] = ack_s - in_path
    print(f"  {'rest: py-libp2p yamux/noise, trio, sockets':<48} {(ack_s - in_path) * 1e3:8.1f} ms")
    print(f"  {'= libp2p ack time (whole path, median)':<48} {ack_s * 1e3:8.1f} ms")
    print(
        f"  noise alone caps one core at {size / noise_s / 1e6:.0f} MB/s each way "
        f"(encrypt, or decrypt); one at a time pays both: {size / (2 * noise_s) / 1e6:.0f} MB/s"
    )
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes-kb", type=int, nargs="+", default=[64, 1024, 65536])
    parser.add_argument("--stream-mb", type=int, default=256, help="MB streamed per size")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_server:
        _raw_server()
        return 0
    torch.set_num_threads(1)
    sizes = [kb * _KB for kb in args.sizes_kb]
    with tempfile.TemporaryDirectory() as workdir:
        p2p = bench_transport(sizes, args.rounds, args.stream_mb, Path(workdir))
    raw = bench_raw_tcp(sizes, args.rounds, args.stream_mb)
    rows = _rows(p2p, raw, sizes)
    _print_rows(rows, args.rounds)
    parts = _print_breakdown(max(sizes), p2p[max(sizes)]["ack_s"])
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "breakdown_s": parts}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
