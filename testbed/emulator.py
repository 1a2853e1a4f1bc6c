"""The link emulator process: every host's TUN fd, one epoll, one timer heap.

Started by ``Testbed`` with the TUN fds inherited and its configuration (``EmulatorConfig``
as JSON) as the first line of stdin. It answers ``{"event": "ready", ...}`` on stdout, then
forwards frames until its stdin closes (the testbed is done, or died) or SIGTERM. A line
``stats`` on stdin asks for the counters of every FIFO (``{"event": "stats", ...}``).

A frame read from host ``src``'s fd goes to the host owning its IPv4 destination through
``shaping.Path``; each step that must wait is a timer. A step runs at the time it was due
(not the time the timer fired), so late wake-ups shift a packet, never a link's rate.
Runs at real-time priority (SCHED_FIFO) where it may: without, late wake-ups under load
added milliseconds to round trips.
"""

import contextlib
import heapq
import json
import math
import os
import random
import select
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from fusionllm.common.logs import configure_logging, get_logger
from fusionllm.testbed.shaping import Fifo, Path, survives
from fusionllm.testbed.vnet import MAX_FRAME, VNET_HDR_LEN, parse_frame, split_tcp4

logger = get_logger(__name__)

_READS_PER_WAKE = 64  # frames taken from one fd before the others get a turn
_RT_PRIORITY = 10
_UP, _LINK, _DOWN, _WRITE = range(4)


@dataclass(frozen=True, kw_only=True)
class HostWire:
    """A host as the emulator sees it. Rates in bytes/s (None: no cap)."""

    name: str
    fd: int
    addr: str  # dotted IPv4
    up_rate: float | None
    up_limit: int
    down_rate: float | None
    down_limit: int


@dataclass(frozen=True, kw_only=True)
class LinkWire:
    src: str
    dst: str
    rate: float | None  # bytes/s
    limit: int
    delay_s: float
    loss: float


@dataclass(frozen=True, kw_only=True)
class EmulatorConfig:
    hosts: tuple[HostWire, ...]
    links: tuple[LinkWire, ...]
    seed: int = 0
    realtime: bool = True

    def to_json(self) -> str:
        return json.dumps(
            {
                "hosts": [vars(h) for h in self.hosts],
                "links": [vars(link) for link in self.links],
                "seed": self.seed,
                "realtime": self.realtime,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "EmulatorConfig":
        data = json.loads(text)
        return cls(
            hosts=tuple(HostWire(**h) for h in data["hosts"]),
            links=tuple(LinkWire(**link) for link in data["links"]),
            seed=int(data["seed"]),
            realtime=bool(data["realtime"]),
        )


class Emulator:
    """Routes and shapes frames between the hosts' fds (see the module docstring)."""

    def __init__(self, config: EmulatorConfig) -> None:
        self._rng = random.Random(config.seed)
        ups = {h.name: Fifo(rate=h.up_rate, limit_bytes=h.up_limit) for h in config.hosts}
        downs = {h.name: Fifo(rate=h.down_rate, limit_bytes=h.down_limit) for h in config.hosts}
        self._fifos = {f"up:{n}": f for n, f in ups.items()} | {
            f"down:{n}": f for n, f in downs.items()
        }
        by_name = {h.name: h for h in config.hosts}
        # src fd -> IPv4 destination -> (path, destination fd)
        self._routes: dict[int, dict[bytes, tuple[Path, int]]] = {h.fd: {} for h in config.hosts}
        for link in config.links:
            fifo = Fifo(rate=link.rate, limit_bytes=link.limit)
            self._fifos[f"link:{link.src}>{link.dst}"] = fifo
            path = Path(
                up=ups[link.src], link=fifo, delay_s=link.delay_s, loss=link.loss,
                down=downs[link.dst],
            )  # fmt: skip
            dst = by_name[link.dst]
            self._routes[by_name[link.src].fd][bytes(map(int, dst.addr.split(".")))] = (
                path,
                dst.fd,
            )
        self._timers: list[tuple[float, int, int, Path, bytes, int, int, int]] = []
        self._seq = 0
        self.counts = {"frames": 0, "malformed": 0, "unroutable": 0, "write_errors": 0}

    # ----- one frame's way --------------------------------------------------------------------

    def receive(self, now: float, src_fd: int, frame: bytes) -> None:
        self.counts["frames"] += 1
        parsed = parse_frame(frame)
        if parsed is None:
            self.counts["malformed"] += 1
            return
        route = self._routes[src_fd].get(parsed.dst)
        if route is None:
            self.counts["unroutable"] += 1
            return
        path, dst_fd = route
        if path.loss > 0 and parsed.segments > 1:
            # A lossy link loses single packets: shape the burst as the packets it stands for.
            pieces = split_tcp4(frame)
            if pieces is not None:
                for piece in pieces:
                    size = len(piece) - VNET_HDR_LEN
                    self._step(now, _UP, path, piece, dst_fd, size, 1)
                return
        self._step(now, _UP, path, frame, dst_fd, parsed.wire_bytes, parsed.segments)

    def _step(
        self, now: float, stage: int, path: Path, frame: bytes, dst_fd: int, size: int, segs: int
    ) -> None:
        """Run ``stage`` of a frame's way at time ``now``, and the stages after it that need
        no wait; a stage that must wait goes on the heap."""
        while True:
            if stage == _UP:
                due = path.up.offer(now, size)
            elif stage == _LINK:
                if not survives(path.loss, segs, self._rng):
                    path.link.stats.lost += 1
                    return
                due = path.link.offer(now, size)
                due = None if due is None else due + path.delay_s
            elif stage == _DOWN:
                due = path.down.offer(now, size)
            else:
                self._write(dst_fd, frame)
                return
            if due is None:
                return  # dropped
            stage += 1
            if due > now:
                self._seq += 1
                heapq.heappush(
                    self._timers, (due, self._seq, stage, path, frame, dst_fd, size, segs)
                )
                return

    def _write(self, fd: int, frame: bytes) -> None:
        try:
            os.write(fd, frame)
        except OSError:
            self.counts["write_errors"] += 1

    def run_due(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            due, _seq, stage, path, frame, dst_fd, size, segs = heapq.heappop(self._timers)
            self._step(due, stage, path, frame, dst_fd, size, segs)

    def next_due(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def stats(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "fifos": {name: f.stats.as_dict() for name, f in self._fifos.items()},
        }


def _go_realtime() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_RT_PRIORITY))
    except (OSError, AttributeError) as exc:
        logger.warning("no real-time priority (%s): round trips may run late under load", exc)
        return False
    return True


def _say(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _timeout(due: float | None) -> float:
    """epoll's timeout for a timer due at ``due``: whole milliseconds, rounded down (epoll
    rounds up, which made every delayed hop ~0.5 ms late); ``_sleep_until`` does the rest."""
    if due is None:
        return -1.0
    return max(0.0, math.floor((due - time.monotonic()) * 1000) / 1000)


def _sleep_until(due: float | None) -> None:
    """Sleep out the sub-millisecond rest to ``due`` (nanosleep: precise at real-time
    priority); a frame arriving meanwhile is read that much later, well under a millisecond."""
    if due is not None:
        left = due - time.monotonic()
        if 0 < left < 0.002:
            time.sleep(left)


def serve(emulator: Emulator, fds: list[int]) -> None:
    """Forward frames until stdin closes."""
    poller = select.epoll()
    stdin = sys.stdin.fileno()
    poller.register(stdin, select.EPOLLIN)
    for fd in fds:
        poller.register(fd, select.EPOLLIN)
    control = b""
    while True:
        events = poller.poll(_timeout(emulator.next_due()))
        if not events:
            _sleep_until(emulator.next_due())
        for fd, _mask in events:
            if fd == stdin:
                data = os.read(stdin, 4096)
                if not data:
                    return
                control += data
                while b"\n" in control:
                    line, control = control.split(b"\n", 1)
                    if line.strip() == b"stats":
                        _say({"event": "stats", **emulator.stats()})
                continue
            now = time.monotonic()
            for _ in range(_READS_PER_WAKE):
                try:
                    frame = os.read(fd, MAX_FRAME)
                except BlockingIOError:
                    break
                emulator.receive(now, fd, frame)
        emulator.run_due(time.monotonic())


def _read_line(fd: int) -> str:
    """One line from ``fd``, unbuffered: what follows it is read later by ``serve``'s epoll."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line.decode()


def main() -> int:
    configure_logging("WARNING")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the testbed: it closes stdin
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = EmulatorConfig.from_json(_read_line(sys.stdin.fileno()))
    realtime = _go_realtime() if config.realtime else False
    emulator = Emulator(config)
    _say({"event": "ready", "realtime": realtime, "pid": os.getpid()})
    try:
        serve(emulator, [h.fd for h in config.hosts])
    finally:
        with contextlib.suppress(OSError):
            _say({"event": "stats", **emulator.stats()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
