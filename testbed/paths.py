"""Measure a testbed path from outside: round trips and one TCP stream's throughput, with the
``netcheck`` tools started inside the hosts (tests and benchmarks share these)."""

import json
import select
import subprocess
import sys

from fusionllm.testbed.bed import Testbed
from fusionllm.testbed.errors import TestbedError

_NETCHECK = [sys.executable, "-m", "fusionllm.testbed.netcheck"]
_START_S = 20.0


def _json_line(process: subprocess.Popen, timeout: float) -> dict:
    """The next JSON line a netcheck tool prints (TestbedError if it ends or says nothing)."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else ""
    try:
        return json.loads(line)
    except ValueError:
        raise TestbedError(
            f"netcheck said {line[:200]!r} in {timeout}s (exit code {process.poll()})"
        ) from None


def _server(bed: Testbed, host: str, tool: str, extra: list[str]) -> tuple[subprocess.Popen, int]:
    process = bed.popen(
        host,
        [*_NETCHECK, tool, "--bind", bed.address(host), *extra],
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    event = _json_line(process, _START_S)
    if event.get("event") != "listening":
        raise TestbedError(f"{tool} on {host} did not listen: {event}")
    return process, int(event["port"])


def _client(bed: Testbed, src: str, dst: str, port: int, tool: list[str], timeout: float) -> str:
    """Run netcheck ``tool`` in ``src`` against ``dst``'s server on ``port``; its last line."""
    argv = [*_NETCHECK, tool[0], "--to", bed.address(dst), "--port", str(port), *tool[1:]]
    done = bed.run(src, argv, timeout=timeout)
    if done.returncode != 0:
        raise TestbedError(f"{tool[0]} {src}->{dst} failed: {done.stderr[-1000:]}")
    return done.stdout.splitlines()[-1]


def round_trips(bed: Testbed, src: str, dst: str, *, count: int = 20) -> list[float]:
    """``count`` TCP round trips of 64 bytes from ``src`` to ``dst``, ms each."""
    server, port = _server(bed, dst, "echo", [])
    try:
        tool = ["rtt", "--count", str(count)]
        return json.loads(_client(bed, src, dst, port, tool, _START_S + count * 2))["rtt_ms"]
    finally:
        server.kill()
        server.wait()


def stream(bed: Testbed, src: str, dst: str, *, seconds: float, warmup: float = 1.0) -> dict:
    """One TCP stream from ``src`` to ``dst`` for ``seconds``: the sink's result
    (``bytes``, ``seconds``, ``mbps`` overall, ``steady_mbps`` after ``warmup``) and, under
    ``sender``, the sending kernel's view (netcheck's ``source``: busy and limited times)."""
    sink, port = _server(bed, dst, "sink", ["--warmup", str(warmup)])
    try:
        tool = ["source", "--seconds", str(seconds)]
        sender = json.loads(_client(bed, src, dst, port, tool, _START_S + seconds * 3))
        return {**_json_line(sink, _START_S + seconds * 2), "sender": sender}
    finally:
        sink.kill()
        sink.wait()


def link_bound_mbps(result: dict) -> float:
    """A ``stream`` result's rate while the sending kernel had data to send and neither window
    held it back: the link's share. An endpoint starved of CPU (a loaded test runner) shows as
    time outside it; a slow or late link does not. Mbit/s."""
    sender = result["sender"]
    seconds = sender["busy_s"] - sender["rwnd_limited_s"] - sender["sndbuf_limited_s"]
    if seconds <= 0:
        raise TestbedError(f"the sender was never link-bound: {sender}")
    return sender["bytes_acked"] * 8e-6 / seconds


def mappings(bed: Testbed, src: str, dsts: list[str], *, local_port: int = 0) -> dict:
    """Dial every host of ``dsts`` (at its public address) from one local port of ``src``:
    ``{"local_port": L, "seen": [{"to", "addr", "port"}, ...]}``, what each one saw."""
    servers = [_server(bed, dst, "whoami", []) for dst in dsts]
    try:
        argv = [*_NETCHECK, "mapping", "--local-port", str(local_port)]
        for dst, (_, port) in zip(dsts, servers, strict=True):
            argv += ["--to", f"{bed.wan_address(dst)}:{port}"]
        done = bed.run(src, argv, timeout=_START_S + 10 * len(dsts))
        if done.returncode != 0:
            raise TestbedError(f"mapping from {src} failed: {done.stderr[-1000:]}")
        return json.loads(done.stdout.splitlines()[-1])
    finally:
        for server, _ in servers:
            server.kill()
            server.wait()


def dial(bed: Testbed, src: str, addr: str, port: int, *, timeout: float) -> dict:
    """Whether a TCP connection from ``src`` to ``addr:port`` opens within ``timeout``:
    ``{"connected": bool, "error": why not, "seconds": how long it took}``."""
    argv = [*_NETCHECK, "dial", "--to", addr, "--port", str(port), "--timeout", str(timeout)]
    done = bed.run(src, argv, timeout=_START_S + timeout)
    if done.returncode != 0:
        raise TestbedError(f"dial from {src} failed: {done.stderr[-1000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def listen(bed: Testbed, host: str) -> tuple[subprocess.Popen, int]:
    """An echo server on ``host``'s own address (killed by the caller or the bed); its port."""
    return _server(bed, host, "echo", [])


def punch(bed: Testbed, a: str, b: str, *, ports: tuple[int, int], timeout: float) -> list[dict]:
    """A TCP hole punch between ``a`` and ``b`` (each dials the other's public address at the
    other's local port, at the same time, as DCUtR does): each side's ``punch`` result."""
    processes = []
    for src, mine, dst, theirs in [(a, ports[0], b, ports[1]), (b, ports[1], a, ports[0])]:
        argv = [*_NETCHECK, "punch", "--local-port", str(mine), "--to", bed.wan_address(dst),
                "--port", str(theirs), "--timeout", str(timeout)]  # fmt: skip
        processes.append(bed.popen(src, argv, stdout=subprocess.PIPE, text=True))
    return [_json_line(p, _START_S + timeout) for p in processes]
