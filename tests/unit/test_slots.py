"""limits.Slots: one semaphore for the trio thread and plain threads."""

import threading
import time

import pytest
import trio

from fusionllm.common.errors import ConfigError
from fusionllm.node.p2p.limits import Slots


def test_threads_take_and_give_back_slots_and_time_out_when_none_is_free():
    slots = Slots(2)
    assert slots.acquire(timeout=0)
    assert slots.acquire(timeout=0)
    assert slots.value == 0
    started = time.monotonic()
    assert not slots.acquire(timeout=0.1)
    assert time.monotonic() - started >= 0.1
    slots.release()
    assert slots.try_acquire()
    assert not slots.try_acquire()


def test_a_thread_waiting_wakes_when_another_thread_releases():
    slots = Slots(1)
    assert slots.try_acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(timeout=5)))
    waiter.start()
    time.sleep(0.05)
    slots.release()
    waiter.join(5)
    assert got == [True]
    assert slots.value == 0


def test_a_trio_task_waits_for_a_slot_a_plain_thread_releases():
    slots = Slots(1)
    assert slots.try_acquire()

    async def main() -> float:
        releaser = threading.Timer(0.1, slots.release)
        releaser.start()
        started = trio.current_time()
        with trio.fail_after(5):
            await slots.acquire_async()
        return trio.current_time() - started

    assert trio.run(main) >= 0.09
    assert slots.value == 0


def test_a_cancelled_trio_wait_takes_no_slot_and_leaves_no_waiter():
    slots = Slots(1)
    assert slots.try_acquire()

    async def main() -> None:
        with trio.move_on_after(0.05):
            await slots.acquire_async()

    trio.run(main)
    slots.release()  # nobody waits any more: the slot stays free
    assert slots.value == 1
    assert slots._trio_waiters == []


def test_no_slots_is_a_config_error():
    with pytest.raises(ConfigError):
        Slots(0)
