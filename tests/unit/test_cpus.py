"""Core placement for local processes (pure) and pinning a process (in a child process)."""

import os
import subprocess
import sys
import textwrap

import pytest

from fusionllm.common.cpus import available_cores, parse_cores, spread
from fusionllm.common.errors import ConfigError


def test_one_core_each_while_there_are_enough():
    assert spread(2, 1, [0, 1]) == [(0,), (1,)]
    assert spread(3, 1, [4, 5, 6, 7]) == [(4,), (5,), (6,)]


def test_more_processes_than_cores_share_them_round_robin():
    assert spread(4, 1, [0, 1]) == [(0,), (1,), (0,), (1,)]


def test_several_threads_get_a_block_each_and_blocks_are_shared_whole():
    assert spread(2, 2, [0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert spread(3, 2, [0, 1, 2, 3, 4]) == [(0, 1), (2, 3), (0, 1)]
    # More threads than cores: every process gets all of them.
    assert spread(2, 8, [0, 1]) == [(0, 1), (0, 1)]


def test_cores_are_taken_in_order_whatever_order_they_come_in():
    assert spread(2, 1, [3, 1, 1]) == [(1,), (3,)]


@pytest.mark.parametrize("args", [(0, 1, [0]), (1, 0, [0]), (1, 1, [])])
def test_nonsense_placements_are_refused(args):
    with pytest.raises(ConfigError):
        spread(*args)


def test_core_lists_parse_and_bad_ones_are_refused():
    assert parse_cores("2,0,2") == (0, 2)
    assert parse_cores("1") == (1,)
    for bad in ("", "a", "1,,2", "-1", "1.5"):
        with pytest.raises(ConfigError):
            parse_cores(bad)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity on this OS")
def test_pin_holds_for_threads_there_are_and_threads_started_later():
    core = available_cores()[-1]
    code = textwrap.dedent(
        f"""
        import os, threading
        from fusionllm.common.cpus import pin
        started = threading.Event(); stop = threading.Event()
        def early():
            started.set(); stop.wait(10)
        before = threading.Thread(target=early); before.start(); started.wait(10)
        assert pin([{core}])
        seen = []
        after = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        after.start(); after.join()
        masks = set()
        for t in os.listdir("/proc/self/task"):
            try:
                masks.add(frozenset(os.sched_getaffinity(int(t))))
            except ProcessLookupError:
                pass  # a thread that ended after the listing (the joined one may linger)
        stop.set(); before.join()
        print(sorted(map(sorted, masks)), sorted(seen[0]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip() == f"[[{core}]] [{core}]"


def test_a_thread_that_ends_while_pinning_does_not_unpin_the_process():
    core = available_cores()[0]
    code = textwrap.dedent(
        f"""
        import os
        from fusionllm.common import cpus
        listing = os.listdir("/proc/self/task")
        gone = str(2**22 + 7)  # above pid_max's ceiling: a thread that ended after the listing
        cpus.os.listdir = lambda path: [gone, *listing]
        print(cpus.pin([{core}]), sorted(os.sched_getaffinity(0)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip() == f"True [{core}]"
