"""CPU shares of hosts: cgroup v1 CPU quotas (``/sys/fs/cgroup/cpu/NAME``)."""

import contextlib
import os
import signal
import time
from pathlib import Path

from fusionllm.common.logs import get_logger
from fusionllm.testbed.errors import TestbedError

logger = get_logger(__name__)

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
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
