"""Tools that run inside a testbed host to measure a path, with plain sockets.

    python -m fusionllm.testbed.netcheck echo --bind ADDR --port P        # TCP echo server
    python -m fusionllm.testbed.netcheck rtt --to ADDR --port P --count N # round trips
    python -m fusionllm.testbed.netcheck sink --bind ADDR --port P        # counts one stream
    python -m fusionllm.testbed.netcheck source --to ADDR --port P --seconds S
    python -m fusionllm.testbed.netcheck whoami --bind ADDR --port P     # says who called
    python -m fusionllm.testbed.netcheck mapping --to ADDR:P --to ADDR:P [--local-port L]
    python -m fusionllm.testbed.netcheck dial --to ADDR --port P --timeout S
    python -m fusionllm.testbed.netcheck punch --local-port L --to ADDR --port P --timeout S

``mapping`` dials every ``--to`` (each a ``whoami``) from one local port, as a hole puncher
does (SO_REUSEPORT), and prints the address and port each one saw: what a NAT made of it.
``dial`` prints whether a connection opened (it never fails: refusals are results).
``punch`` is one side of a TCP hole punch: it dials from port L while the other side dials
it back (a simultaneous open through both NATs), and prints whether a connection opened.

Each prints JSON lines: servers ``{"event": "listening"}`` once bound, clients and the sink
one result line. The sink samples its byte count every 50 ms so a result can leave TCP's
slow start out (``steady_mbps``: from ``--warmup`` seconds after the first byte).
"""

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable

from fusionllm.node.p2p.lane.tcp_info import TcpInfo, read_tcp_info

_CHUNK = 1 << 16
_SAMPLE_S = 0.05
_ECHO_BYTES = 64


def _say(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _listen(addr: str, port: int) -> socket.socket:
    server = socket.create_server((addr, port), reuse_port=False)
    _say({"event": "listening", "port": server.getsockname()[1]})
    return server


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("closed mid-message")
        data += part
    return data


def echo(args: argparse.Namespace) -> None:
    server = _listen(args.bind, args.port)
    while True:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(_CHUNK):
                conn.sendall(data)


def rtt(args: argparse.Namespace) -> None:
    with socket.create_connection((args.to, args.port), timeout=args.timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        message = b"x" * _ECHO_BYTES
        rtts = []
        for _ in range(args.count):
            start = time.monotonic()
            sock.sendall(message)
            _recv_exactly(sock, _ECHO_BYTES)
            rtts.append((time.monotonic() - start) * 1000)
            time.sleep(args.gap)
    _say({"event": "rtt", "rtt_ms": rtts})


def sink(args: argparse.Namespace) -> None:
    server = _listen(args.bind, args.port)
    conn, _ = server.accept()
    samples: list[tuple[float, int]] = []  # (seconds since the first byte, bytes so far)
    total = 0
    first = last_sample = None
    buffer = bytearray(_CHUNK)
    with conn:
        while n := conn.recv_into(buffer):
            now = time.monotonic()
            if first is None:
                first = last_sample = now
            total += n
            if now - last_sample >= _SAMPLE_S:
                samples.append((now - first, total))
                last_sample = now
        end = time.monotonic()
    seconds = end - first if first is not None else 0.0
    samples.append((seconds, total))
    steady = [(t, b) for t, b in samples if t >= args.warmup]
    steady_mbps = None
    if len(steady) >= 2 and steady[-1][0] > steady[0][0]:
        steady_mbps = (steady[-1][1] - steady[0][1]) * 8e-6 / (steady[-1][0] - steady[0][0])
    _say({
        "event": "sink", "bytes": total, "seconds": seconds,
        "mbps": total * 8e-6 / seconds if seconds else 0.0, "steady_mbps": steady_mbps,
    })  # fmt: skip


def source(args: argparse.Namespace) -> None:
    data = b"\0" * _CHUNK
    sent = 0
    with socket.create_connection((args.to, args.port), timeout=args.timeout) as sock:
        sock.settimeout(None)
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            sent += sock.send(data)
        # Wait for the sink to close: then every byte is acked and the kernel's counts are whole.
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(args.timeout)
        sock.recv(1)
        info = read_tcp_info(sock)
    _say({"event": "source", "bytes": sent, **_sender_view(info)})


def _sender_view(info: TcpInfo) -> dict:
    """What the sending kernel saw: how long it had data in flight and what held it back
    (a starved endpoint shows as time not busy, or limited by a window, not as a slow link)."""
    return {
        "bytes_acked": info.bytes_acked, "retransmits": info.total_retrans,
        "busy_s": info.busy_s, "rwnd_limited_s": info.rwnd_limited_s,
        "sndbuf_limited_s": info.sndbuf_limited_s, "min_rtt_ms": info.min_rtt_s * 1000,
        "rtt_ms": info.rtt_s * 1000,
    }  # fmt: skip


def whoami(args: argparse.Namespace) -> None:
    server = _listen(args.bind, args.port)
    while True:
        conn, (addr, port) = server.accept()
        with conn:
            conn.sendall(json.dumps({"addr": addr, "port": port}).encode() + b"\n")


def _reusing(local_port: int) -> socket.socket:
    """A TCP socket bound to ``local_port`` that other sockets may bind too (a hole puncher's;
    also past a last connection's socket lingering in TIME_WAIT)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("0.0.0.0", local_port))
    return sock


def _ask(local_port: int, target: str, timeout: float) -> dict:
    host, _, port = target.rpartition(":")
    with _reusing(local_port) as sock:
        sock.settimeout(timeout)
        sock.connect((host, int(port)))
        answer = b""
        while not answer.endswith(b"\n"):
            part = sock.recv(256)
            if not part:
                break
            answer += part
        return {"to": target, **json.loads(answer)}


def mapping(args: argparse.Namespace) -> None:
    local_port = args.local_port or _free_port()
    seen = [_ask(local_port, target, args.timeout) for target in args.to]
    _say({"event": "mapping", "local_port": local_port, "seen": seen})


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        return sock.getsockname()[1]


def _outcome(event: str, connect: Callable[[], object]) -> None:
    """Say whether ``connect`` opened a connection (and why not, and how long it took)."""
    start = time.monotonic()
    error = None
    try:
        connect()
    except OSError as exc:
        error = type(exc).__name__ if exc.strerror is None else exc.strerror
    _say({
        "event": event, "connected": error is None, "error": error,
        "seconds": time.monotonic() - start,
    })  # fmt: skip


def dial(args: argparse.Namespace) -> None:
    def connect() -> None:
        socket.create_connection((args.to, args.port), timeout=args.timeout).close()

    _outcome("dial", connect)


def punch(args: argparse.Namespace) -> None:
    with _reusing(args.local_port) as sock:
        # one connect: the kernel resends the SYN (1 s, 2 s, ...) until the other side's SYN
        # has opened its own router for ours
        sock.settimeout(args.timeout)
        _outcome("punch", lambda: sock.connect((args.to, args.port)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusionllm.testbed.netcheck")
    tools = parser.add_subparsers(dest="tool", required=True)
    for name, run in (("echo", echo), ("sink", sink), ("whoami", whoami)):
        tool = tools.add_parser(name)
        tool.add_argument("--bind", required=True)
        tool.add_argument("--port", type=int, default=0)
        tool.set_defaults(run=run)
        if name == "sink":
            tool.add_argument("--warmup", type=float, default=1.0, help="s left out of steady")
    for name, run in (("rtt", rtt), ("source", source), ("dial", dial)):
        tool = tools.add_parser(name)
        tool.add_argument("--to", required=True)
        tool.add_argument("--port", type=int, required=True)
        tool.add_argument("--timeout", type=float, default=10.0, help="connect timeout, s")
        tool.set_defaults(run=run)
        if name == "rtt":
            tool.add_argument("--count", type=int, default=20)
            tool.add_argument("--gap", type=float, default=0.01, help="s between round trips")
        else:
            tool.add_argument("--seconds", type=float, default=5.0)
    tool = tools.add_parser("punch")
    tool.add_argument("--local-port", type=int, required=True)
    tool.add_argument("--to", required=True)
    tool.add_argument("--port", type=int, required=True)
    tool.add_argument("--timeout", type=float, default=10.0, help="s to keep trying")
    tool.set_defaults(run=punch)
    tool = tools.add_parser("mapping")
    tool.add_argument("--to", action="append", required=True, help="ADDR:PORT of a whoami")
    tool.add_argument("--local-port", type=int, default=0, help="(default: a free one)")
    tool.add_argument("--timeout", type=float, default=10.0, help="connect timeout, s")
    tool.set_defaults(run=mapping)
    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
