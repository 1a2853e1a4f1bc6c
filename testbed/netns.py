"""Network namespaces, through iproute2 (``ip netns``)."""

import contextlib
import os
import signal
import subprocess

from fusionllm.common.logs import get_logger
from fusionllm.testbed.errors import TestbedError

logger = get_logger(__name__)

_IP_TIMEOUT_S = 20.0
NETNS_DIR = "/run/netns"


def ip(*args: str, stdin: str | None = None) -> str:
    """Run ``ip ARGS`` (``stdin`` its input); its stdout, or TestbedError with its stderr."""
    try:
        done = subprocess.run(
            ["ip", *args], input=stdin, capture_output=True, text=True,
            timeout=_IP_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"ip {' '.join(args)}: {exc}") from exc
    if done.returncode != 0:
        raise TestbedError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def in_netns(ns: str, *argv: str, stdin: str | None = None) -> str:
    """Run a command inside namespace ``ns``; its stdout."""
    return ip("netns", "exec", ns, *argv, stdin=stdin)


def names() -> list[str]:
    """Every named network namespace on the machine."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(os.listdir(NETNS_DIR))
    return []


def pids(ns: str) -> list[int]:
    """Processes inside ``ns`` (whoever started them)."""
    try:
        return [int(p) for p in ip("netns", "pids", ns).split()]
    except TestbedError:
        return []


def kill_all(ns: str) -> list[int]:
    """SIGKILL every process inside ``ns``; returns their pids."""
    found = pids(ns)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def delete(ns: str) -> None:
    if ns in names():
        ip("netns", "delete", ns)
