"""A lane (TCP + sealed chunks, the tensor plane's path) between two testbed hosts, and what its
kernel-timed meter read while it carried frames.

    python -m tests.support.lane_main serve KEY_HEX ADDR        # prints {"event": "ready", ...}
    python -m tests.support.lane_main send KEY_HEX ADDR:PORT SECONDS FRAME_BYTES GAP_S
    python -m tests.support.lane_main bulk KEY_HEX ADDR:PORT ROUNDS NBYTES GAP_S

``lane_figures`` runs both in a testbed: the reader in ``dst`` (it drains and unseals, as a
node's lane thread does), the writer in ``src`` writing frames for SECONDS, GAP_S apart (a
stage computes between its frames); it returns the writer's meter samples (``WireSample``
fields) and what the writer put through (``bytes``, ``seconds``), so a test can set the
kernel's figure beside the cap and the sender's own pace. ``bulk_figures`` runs ROUNDS bulk
probes (lane/bulk.py) of NBYTES each, GAP_S apart, and returns each one's figure (None where
it had no trusted sample) with its wall time.
"""

import json
import socket
import sys
import time

from fusionllm.node.children import JsonChild
from fusionllm.testbed.bed import Testbed

_START_S = 60.0


def serve(key_hex: str, addr: str) -> None:
    from fusionllm.node.p2p.lane.stream import BlockingLaneReader

    server = socket.create_server((addr, 0))
    print(json.dumps({"event": "ready", "port": server.getsockname()[1]}), flush=True)
    conn, _ = server.accept()
    reader = BlockingLaneReader(conn, bytes.fromhex(key_hex))
    while reader.read(1 << 20):
        pass
    reader.close()
    server.close()


def send(key_hex: str, target: str, seconds: float, frame_bytes: int, gap_s: float) -> None:
    writer = _writer(key_hex, target)
    body, samples, sent = bytes(frame_bytes), [], 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        writer.write_frame((b"h", body), timeout=30.0)
        sent += 1 + frame_bytes
        time.sleep(gap_s)
        sample = writer.meter.latest()
        if sample is not None and (not samples or samples[-1]["measured_at"] != sample.measured_at):
            samples.append({"bandwidth": sample.bandwidth, "rtt": sample.rtt,
                            "measured_at": sample.measured_at})  # fmt: skip
    print(json.dumps({"event": "lane", "samples": samples, "bytes": sent, "seconds": elapsed}))
    _close(writer)


def bulk(key_hex: str, target: str, rounds: int, nbytes: int, gap_s: float) -> None:
    from fusionllm.node.p2p.lane.bulk import run_bulk

    writer = _writer(key_hex, target)
    figures = []
    for _ in range(rounds):
        started = time.monotonic()
        sample = run_bulk(writer, nbytes, timeout=10.0)
        seconds = time.monotonic() - started
        figures.append(
            None
            if sample is None
            else {"bandwidth": sample.bandwidth, "rtt": sample.rtt, "seconds": seconds}
        )
        time.sleep(gap_s)
    print(json.dumps({"event": "bulk", "figures": figures}))
    _close(writer)


def _writer(key_hex: str, target: str):
    import trio

    from fusionllm.node.p2p.lane.stream import LaneWriter

    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=_START_S)
    return LaneWriter(trio.socket.from_stdlib_socket(sock), bytes.fromhex(key_hex))


def _close(writer) -> None:
    import trio

    trio.run(writer.close)


def lane_figures(
    bed: Testbed,
    src: str,
    dst: str,
    *,
    seconds: float,
    frame_bytes: int = 1 << 20,
    gap_s: float = 0.0,
) -> dict:
    args = [str(seconds), str(frame_bytes), str(gap_s)]
    return _run_writer(bed, src, dst, "send", args, timeout=_START_S + 3 * seconds)


def bulk_figures(
    bed: Testbed, src: str, dst: str, *, rounds: int, nbytes: int, gap_s: float
) -> list[dict | None]:
    args = [str(rounds), str(nbytes), str(gap_s)]
    done = _run_writer(bed, src, dst, "bulk", args, timeout=_START_S + rounds * (10 + gap_s))
    return done["figures"]


def _run_writer(
    bed: Testbed, src: str, dst: str, command: str, args: list[str], *, timeout: float
) -> dict:
    me = [sys.executable, "-m", "tests.support.lane_main"]
    key = bytes(range(32)).hex()
    with JsonChild(
        bed.command(dst, [*me, "serve", key, bed.address(dst)]), name="lane-reader"
    ) as reader:
        port = reader.next_event(_START_S)["port"]
        argv = [*me, command, key, f"{bed.address(dst)}:{port}", *args]
        done = bed.run(src, argv, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the lane writer failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str]) -> int:
    commands = {
        "serve": lambda args: serve(args[0], args[1]),
        "send": lambda args: send(args[0], args[1], float(args[2]), int(args[3]), float(args[4])),
        "bulk": lambda args: bulk(args[0], args[1], int(args[2]), int(args[3]), float(args[4])),
    }
    if len(argv) < 3 or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    commands[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
