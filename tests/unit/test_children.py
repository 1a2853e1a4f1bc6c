"""JsonChild: events in order, commands over stdin, deadlines, and no process left behind."""

import signal
import sys
import textwrap
import threading

import psutil
import pytest

from fusionllm.node.children import JsonChild

pytestmark = pytest.mark.timeout(60)

_WAIT_S = 15.0


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


_ECHO = _python(
    """
    import json, sys
    print(json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"event": "echo", "got": json.loads(line)}), flush=True)
    """
)

# A child that starts a grandchild (which would outlive it) and reports both pids.
_TREE = _python(
    """
    import json, os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(json.dumps({"event": "ready", "grandchild": grandchild.pid}), flush=True)
    time.sleep(120)
    """
)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_events_in_order_and_other_lines_dropped():
    code = """
        import json
        print("not json")
        for i in range(3):
            print(json.dumps({"event": "n", "i": i}))
        print(7)
    """
    with JsonChild(_python(code)) as child:
        assert [child.next_event(_WAIT_S)["i"] for _ in range(3)] == [0, 1, 2]
        assert child.next_event(_WAIT_S) == 7  # any JSON value is an event
        with pytest.raises(EOFError):
            child.next_event(_WAIT_S)
        assert child.wait(_WAIT_S) == 0
        assert child.snapshot() == [*({"event": "n", "i": i} for i in range(3)), 7]


def test_send_and_wait_for():
    with JsonChild(_ECHO, stdin=True) as child:
        assert child.wait_for(lambda e: e["event"] == "ready", _WAIT_S)
        assert child.send({"cmd": "hello"})
        echo = child.wait_for(lambda e: e["event"] == "echo", _WAIT_S)
        assert echo["got"] == {"cmd": "hello"}
        assert child.finish(_WAIT_S) == 0
        assert not child.send({"cmd": "late"})


def test_timeouts_say_what_was_missing():
    with JsonChild(_ECHO, stdin=True, name="echo") as child:
        child.next_event(_WAIT_S)
        with pytest.raises(TimeoutError, match="echo said nothing"):
            child.next_event(0.2)
        with pytest.raises(TimeoutError, match="echo sent no matching event"):
            child.wait_for(lambda e: e["event"] == "never", 0.2)


def test_send_needs_stdin():
    with JsonChild(_python("pass")) as child, pytest.raises(RuntimeError):
        child.send({})


def test_on_event_sees_every_event_then_none():
    seen = []
    code = "import json; [print(json.dumps(i)) for i in range(2)]"
    with JsonChild(_python(code), on_event=seen.append) as child:
        with pytest.raises(EOFError):
            child.wait_for(lambda e: False, _WAIT_S)
        assert seen == [0, 1, None]


def test_a_child_seen_gone_has_all_its_events_read():
    """A child may exit with its last lines still in the pipe (the reader starved on a
    loaded machine): whoever saw it gone then reads every event it wrote."""
    code = "import json\nfor i in range(300): print(json.dumps({'event': 'step', 'step': i}))"
    gate = threading.Event()
    # The reader stalls at the first event until well after the child exited.
    with JsonChild(_python(code), on_event=lambda e: e is None or gate.wait(_WAIT_S)) as child:
        child.wait(_WAIT_S)  # 300 short lines fit in the pipe: the child exits meanwhile
        threading.Timer(0.3, gate.set).start()
        assert not child.alive()
        assert [e["step"] for e in child.snapshot()] == list(range(300))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_kill_reaps_the_whole_tree(sig):
    child = JsonChild(_TREE)
    grandchild = child.next_event(_WAIT_S)["grandchild"]
    assert child.alive()
    assert not _gone(grandchild)
    child.kill(sig)
    assert not child.alive()
    assert child.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
    assert _gone(grandchild)
    child.kill()  # again: nothing left to do


def test_leaving_the_block_reaps_the_tree():
    with JsonChild(_TREE) as child:
        grandchild = child.next_event(_WAIT_S)["grandchild"]
    assert not child.alive()
    assert _gone(grandchild)


def test_stderr_to_a_log_file(tmp_path):
    log = tmp_path / "child.log"
    code = "import sys; sys.stderr.write('to the log'); print('{}')"
    with JsonChild(_python(code), stderr=log) as child:
        assert child.next_event(_WAIT_S) == {}
        child.wait(_WAIT_S)
    assert log.read_text() == "to the log"
