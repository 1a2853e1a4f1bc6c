"""A bare transport node as a process, for integration tests and benchmarks.

    python -m tests.support.transport_main --key node.key [--mode echo|ack|sink] ...

It prints one JSON line ``{"event": "ready", "peer_id": ..., "addrs": [...]}`` on stdout, then
serves JSON-line commands on stdin (``{"cmd": "stats"}``: per-peer counters, refusals and
tracked per-peer state; ``{"cmd": "connect", "addr": ...}``,
``{"cmd": "quit"}``), answering each with one JSON line. It exits when stdin closes, so a
parent that dies takes its nodes with it. Received frames are echoed back (``echo``), answered
with a one-element control frame (``ack``, for timing), or dropped (``sink``).
"""

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import configure_logging, get_logger
from fusionllm.compression.dtypes import WIRE_DTYPES
from fusionllm.node.errors import DeadlineError, TransportClosedError
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import Received, TensorSpec, Transport, TransportConfig

logger = get_logger(__name__)

_POLL_S = 0.2


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key", required=True, help="identity key file (created if missing)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mode", choices=("echo", "ack", "sink"), default="echo")
    parser.add_argument("--dial-timeout", type=float, default=10.0)
    parser.add_argument("--read-timeout", type=float, default=10.0)
    parser.add_argument("--write-timeout", type=float, default=60.0)
    parser.add_argument("--max-frame-bytes", type=int, default=256 << 20)
    parser.add_argument("--max-in-flight", type=int, default=4)
    parser.add_argument("--expect-dtype", help="refuse tensors of another dtype (wire name)")
    parser.add_argument("--expect-shape", help="refuse tensors of another shape, e.g. 4,4")
    parser.add_argument(
        "--admit",
        action="append",
        help="a peer id that may open tensor streams (repeatable; default: anyone may)",
    )
    parser.add_argument("--no-lanes", action="store_true", help="frames over libp2p streams only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (as a stage's)")
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


class _Out:
    """stdout shared by the command thread and the serving loop: one JSON object per line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, obj: dict[str, Any]) -> None:
        with self._lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()


def _commands(transport: Transport, out: _Out, stop: threading.Event) -> None:
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                command = json.loads(line)
                name = command["cmd"]
                if name == "quit":
                    out.write({"event": "bye"})
                    return
                if name == "stats":
                    stats = {peer: asdict(s) for peer, s in transport.stats().items()}
                    out.write(
                        {
                            "event": "stats",
                            "peers": stats,
                            "refusals": transport.refusals(),
                            "tracked": transport.tracked_peers(),
                        }
                    )
                elif name == "connect":
                    peer = transport.connect(command["addr"], timeout=command.get("timeout"))
                    out.write({"event": "connected", "peer_id": peer})
                else:
                    out.write({"event": "error", "error": f"unknown command {name!r}"})
            except (FusionError, KeyError, ValueError) as exc:
                out.write({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
    finally:
        stop.set()


def _answer(transport: Transport, mode: str, item: Received) -> None:
    if mode == "echo":
        transport.send_tensor(item.peer, item.header, item.tensor)
    elif mode == "ack":
        header = FrameHeader(
            step=item.header.step,
            micro_batch=item.header.micro_batch,
            kind=FrameKind.CONTROL,
            stage=item.header.stage,
        )
        transport.send_tensor(item.peer, header, torch.tensor([item.tensor.numel()]))


def _serve(transport: Transport, mode: str, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            item = transport.recv(timeout=_POLL_S)
        except DeadlineError:
            continue
        except TransportClosedError:
            return
        try:
            _answer(transport, mode, item)
        except FusionError:
            # The peer went away or refused the answer; it is counted, the node goes on.
            logger.debug("answering %s failed", item.peer, exc_info=True)


def _spec(args: argparse.Namespace) -> TensorSpec | None:
    if args.expect_dtype is None and args.expect_shape is None:
        return None
    if args.expect_dtype is None or args.expect_shape is None:
        raise SystemExit("--expect-dtype and --expect-shape go together")
    shape = tuple(int(dim) for dim in args.expect_shape.split(",") if dim)
    if args.expect_dtype not in WIRE_DTYPES:
        raise SystemExit(f"--expect-dtype must be one of {sorted(WIRE_DTYPES)}")
    return TensorSpec(dtype=WIRE_DTYPES[args.expect_dtype], shape=shape)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    configure_logging(args.log_level.upper())
    # One torch thread, as pipeline stages run: with two, every decode's finiteness check wakes
    # an OpenMP worker that spins on the core the transport thread needs (8 ms per 1 MB frame
    # on a loaded 2-core box instead of 0.03 ms).
    torch.set_num_threads(args.threads)
    spec = _spec(args)
    config = TransportConfig(
        key_path=args.key,
        listen_host=args.host,
        listen_port=args.port,
        dial_timeout_s=args.dial_timeout,
        read_timeout_s=args.read_timeout,
        write_timeout_s=args.write_timeout,
        max_frame_bytes=args.max_frame_bytes,
        max_in_flight=args.max_in_flight,
        lanes=not args.no_lanes,
    )
    out = _Out()
    admitted = frozenset(args.admit) if args.admit else None
    with Transport(
        config,
        expect=(lambda _header: spec) if spec else None,
        admit=admitted.__contains__ if admitted is not None else None,
    ) as transport:
        out.write(
            {
                "event": "ready",
                "peer_id": transport.peer_id,
                "addrs": transport.addrs,
                "lane_port": transport.lane_port,
            }
        )
        stop = threading.Event()
        threading.Thread(
            target=_commands, args=(transport, out, stop), name="commands", daemon=True
        ).start()
        _serve(transport, args.mode, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
