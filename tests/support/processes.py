"""Child processes of the test session: list them cheaply, kill what a test left behind."""

import contextlib
import os

import psutil

_GRACE_S = 3.0


def child_pids() -> set[int]:
    """Pids of this process's children, started from any of its threads (zombies included).

    Reads /proc/self/task/*/children (tens of microseconds), since this runs around every test;
    psutil's ppid scan of every process on the machine takes milliseconds.
    """
    try:
        pids: set[int] = set()
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as children:
                pids.update(int(pid) for pid in children.read().split())
        return pids
    except OSError:  # not Linux, no CONFIG_PROC_CHILDREN, or a thread ended meanwhile
        return {proc.pid for proc in psutil.Process().children()}


def kill_process_tree(root: psutil.Process, *, include_root: bool = False) -> list[int]:
    """Terminate, then kill, every descendant of ``root``; returns the pids found."""
    try:
        victims = root.children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    if include_root:
        victims.append(root)
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _gone, alive = psutil.wait_procs(victims, timeout=_GRACE_S)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=_GRACE_S)
    return [proc.pid for proc in victims]


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} ({' '.join(proc.cmdline())[:160] or proc.name()})"
    except psutil.Error:
        return f"{proc.pid} (gone)"


def reap_new_children(before: set[int], *, settle_s: float) -> list[str]:
    """Kill the children not in ``before`` that outlive ``settle_s``; returns what was killed.

    Children that exit within ``settle_s`` (a test that returned while its process was still
    shutting down) are reaped and do not count.
    """
    new = []
    for pid in sorted(child_pids() - before):
        with contextlib.suppress(psutil.NoSuchProcess):
            new.append(psutil.Process(pid))
    if not new:
        return []
    _gone, alive = psutil.wait_procs(new, timeout=settle_s)
    leftovers = [describe(proc) for proc in alive]
    for proc in alive:
        kill_process_tree(proc, include_root=True)
    return leftovers
