"""Run a command inside one testbed host: its network namespace and CPU cgroup.

``python -m fusionllm.testbed.enter --netns NS [--cgroup DIR] -- COMMAND...`` joins both, then
execs COMMAND, which keeps this process's pid (so whoever started it can signal and reap it).
Python 3.11 has no ``os.setns``; libc's does the same.
"""

import argparse
import ctypes
import os
import sys
from pathlib import Path

from fusionllm.testbed import cgroups
from fusionllm.testbed.netns import NETNS_DIR

_CLONE_NEWNET = 0x40000000


def setns(ns: str) -> None:
    """Move this (single-threaded) process into the named network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"{NETNS_DIR}/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusionllm.testbed.enter", description=__doc__)
    parser.add_argument("--netns", required=True, help="network namespace name")
    parser.add_argument("--cgroup", help="cgroup v1 cpu directory to join")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    if args.cgroup:
        cgroups.join(Path(args.cgroup))
    setns(args.netns)
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
