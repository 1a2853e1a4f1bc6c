"""CPU shares of hosts: cgroup v1 CPU quotas (``/sys/fs/cgroup/cpu/NAME``)."""

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from fusionllm.common.logs import get_logger
from fusionllm.testbed.errors import TestbedError

logger = get_logger(__name__)

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
# The quota's enforcement period. A host that spends its quota early in a period is held
# back for the rest of it: at 100 ms (the kernel's default) a 0.2-core host with its CPU taken
# stood frozen up to 80 ms at a time, no thread of it reading its sockets, so its receive
# window closed and a 1 MiB probe into it read 0.47-0.64 of the link (topology C, one busy
# loop a host), where a real slow CPU still runs every thread within milliseconds. At 10 ms
# the holds are at most 8 ms, inside one round trip of every link: 0.69-0.97 (docs/testbed.md).
PERIOD_US = 10_000
_EMPTY_WAIT_S = 5.0


def available() -> str | None:
    """None when cgroup v1 CPU quotas can be set here; else why not."""
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_ROOT} (cpu.cfs_quota_us missing)"
    if not os.access(CPU_ROOT, os.W_OK):
        return f"{CPU_ROOT} is not writable"
    return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise TestbedError(f"write {value!r} to {path}: {exc.strerror}") from exc


def create(relative: str, cores: float | None) -> Path:
    """The cgroup ``CPU_ROOT/relative`` (made here, parents too), limited to ``cores``."""
    path = CPU_ROOT / relative
    try:
        path.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        raise TestbedError(f"cgroup {path}: {exc.strerror}") from exc
    _write(path / "cpu.cfs_period_us", str(PERIOD_US))
    _write(path / "cpu.cfs_quota_us", str(-1 if cores is None else int(cores * PERIOD_US)))
    return path


def join(path: Path, pid: int = 0) -> None:
    """Move ``pid`` (0: the caller) into the cgroup at ``path``."""
    _write(path / "cgroup.procs", str(pid or os.getpid()))


def procs(path: Path) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    return []


@dataclass(frozen=True)
class CpuUsage:
    """What a host's processes took of its CPU share so far: CPU seconds (every thread of
    every process now in the cgroup since each started, and the children they reaped) and
    the quota's enforcement periods (those that ran, those where the quota ran out)."""

    at: float  # time.monotonic() when read
    cpu_s: float
    periods: int
    throttled: int


def usage(path: Path) -> CpuUsage:
    """The cgroup's CpuUsage now; a process that exits meanwhile is left out."""
    cpu_s = 0.0
    for pid in procs(path):
        with contextlib.suppress(psutil.Error):
            # the reaped children count: a DHT worker restarted is in its parent's figure
            user, system, children_user, children_system, *_ = psutil.Process(pid).cpu_times()
            cpu_s += user + system + children_user + children_system
    stat: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError):
        stat = {k: int(v) for k, v in (line.split() for line in
                                      (path / "cpu.stat").read_text().splitlines())}  # fmt: skip
    return CpuUsage(at=time.monotonic(), cpu_s=cpu_s, periods=stat.get("nr_periods", 0),
                    throttled=stat.get("nr_throttled", 0))  # fmt: skip


def remove(path: Path) -> None:
    """Kill what is left inside the cgroup, then remove it (children first)."""
    if not path.exists():
        return
    for child in sorted((p for p in path.iterdir() if p.is_dir()), reverse=True):
        remove(child)
    deadline = time.monotonic() + _EMPTY_WAIT_S
    while left := procs(path):
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise TestbedError(f"cgroup {path} still holds {left} after SIGKILL")
        time.sleep(0.05)
    try:
        path.rmdir()
    except OSError as exc:
        raise TestbedError(f"remove cgroup {path}: {exc.strerror}") from exc
