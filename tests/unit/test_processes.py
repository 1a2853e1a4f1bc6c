"""The per-test leftover-process check (tests/conftest.py) finds, names and kills children."""

import subprocess
import sys

from tests.support.processes import child_pids, reap_new_children


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


def test_a_child_left_running_is_found_named_and_killed() -> None:
    before = child_pids()
    stuck = _child("import sys; sys.stdin.read()")  # runs until killed (stdin never closes)
    try:
        assert stuck.pid in child_pids()
        leftovers = reap_new_children(before, settle_s=0.05)
        assert len(leftovers) == 1
        assert leftovers[0].startswith(f"{stuck.pid} (")
        assert "sys.stdin.read()" in leftovers[0]
        assert stuck.pid not in child_pids()
    finally:
        stuck.kill()
        stuck.wait(10)


def test_children_from_before_and_children_that_exit_do_not_count() -> None:
    earlier = _child("import sys; sys.stdin.read()")
    try:
        before = child_pids()
        quick = _child("pass")
        assert reap_new_children(before, settle_s=30) == []  # waits for `quick` only
        assert earlier.poll() is None  # not the test's: left alone
        assert quick.pid not in child_pids()
        quick.wait(10)
    finally:
        earlier.kill()
        earlier.wait(10)
