"""``fusionllm node``'s signal handler: SIGINT and SIGTERM ask for the polite leave once; a
second Ctrl-C quits at once (the end to end check: tests/integration/test_node_config.py)."""

import signal
import threading

import pytest

from fusionllm.node.cli.node_cmd import _Leave


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_either_signal_asks_for_the_polite_leave_and_a_second_ctrl_c_quits(first):
    stop = threading.Event()
    leave = _Leave(stop)
    leave(first, None)
    assert stop.is_set()
    leave(signal.SIGTERM, None)  # asked already: nothing more
    with pytest.raises(KeyboardInterrupt):
        leave(signal.SIGINT, None)
