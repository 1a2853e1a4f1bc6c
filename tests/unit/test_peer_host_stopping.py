"""A stream handler whose service (py-libp2p's pubsub) stops under it: the error trio raises
then is told apart from a handler's fault by its text, so this pins that text to trio's."""

import trio

from fusionllm.node.p2p.peer_host import _stopping


def _closed_nursery_error() -> RuntimeError:
    caught: list[RuntimeError] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            pass
        try:
            nursery.start_soon(trio.sleep, 0)
        except RuntimeError as exc:
            caught.append(exc)

    trio.run(main)
    assert caught, "trio started a task in a closed nursery"
    return caught[0]


def test_a_task_started_in_a_stopped_service_reads_as_stopping():
    assert _stopping(_closed_nursery_error())


def test_other_errors_of_a_handler_are_faults():
    assert not _stopping(RuntimeError("something else broke"))
    assert not _stopping(ValueError("Nursery is closed to new arrivals"))
