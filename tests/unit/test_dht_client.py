"""DhtClient against a stand-in worker (tests/support/fake_dht_worker.py): a bad reply fails
one request, never the pipe; a dead worker or a dead reader gets the worker restarted.
Plus the worker's pure cap on what a get returns and the tagged wire."""

import asyncio
import io
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import psutil
import pytest

from fusionllm.dht.client import DhtClient, DhtConfig, DhtError
from fusionllm.dht.serve import MAX_CONCURRENT, ReplyLimits, cap_entries, serve_requests
from fusionllm.dht.wire import MessageError, read_tagged, write_message

FAKE_WORKER = (sys.executable, str(Path(__file__).parents[1] / "support" / "fake_dht_worker.py"))
LIMIT = 1 << 16


def _client(**overrides) -> DhtClient:
    fields = {
        "request_timeout_s": 5.0,
        "start_timeout_s": 20.0,
        "max_reply_bytes": LIMIT,
        "max_entries_per_key": 4,
        "restart_backoff_s": 0.05,
    }
    config = DhtConfig(swarm="fake", **{**fields, **overrides})
    return DhtClient(config, worker_command=FAKE_WORKER)


def _worker_pid(client: DhtClient) -> int:
    return int(client.visible_maddrs()[0].removeprefix("/pid/"))


def _wait_for_restart(client: DhtClient, restarts: int, deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    while client.restarts < restarts:
        assert time.monotonic() < deadline, "the DHT worker was not restarted"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- the client


def test_oversized_reply_fails_that_request_only():
    with _client() as client:
        pid = _worker_pid(client)
        with pytest.raises(DhtError, match=f"over {LIMIT}"):
            client.get(f"huge:{4 * LIMIT}")
        # The pipe is still in step: the next requests get their own replies, fast.
        started = time.monotonic()
        assert client.get("after") == [("s", b"after", 1.0)]
        assert client.store("k", "s", b"v", 1.0) is True
        assert time.monotonic() - started < 2.0
        assert _worker_pid(client) == pid
        assert client.restarts == 0


@pytest.mark.parametrize("key", ["garbage", "scalar"])
def test_malformed_reply_fails_that_request_only(key):
    with _client() as client:
        with pytest.raises(DhtError, match=r"not msgpack|not a map"):
            client.get(key)
        assert client.get("after") == [("s", b"after", 1.0)]
        assert client.restarts == 0


def test_entries_are_capped_on_the_client_too():
    with _client() as client:
        assert len(client.get("many:9")) == 4


def test_dead_worker_is_restarted():
    with _client() as client:
        pid = _worker_pid(client)
        with pytest.raises(DhtError, match="exited"):
            client.get("die")
        _wait_for_restart(client, 1)
        assert client.get("back") == [("s", b"back", 1.0)]
        assert _worker_pid(client) != pid
        assert client.peer_id == "FakePeer"


@pytest.mark.parametrize("port", [0, 47123])
def test_worker_restarts_as_a_client_once(port):
    with _client(listen_port=port) as client:
        pid = _worker_pid(client)
        served_at = client.maddrs
        assert client.visible_maddrs()[1] == "/server"
        assert client.set_client_mode(True) is True
        assert client.get("meanwhile") == [("s", b"meanwhile", 1.0)]  # served until it is up
        _wait_for_restart(client, 1)
        assert client.visible_maddrs()[1] == "/client"
        # On the port it had (a free one for 0): a peer that bootstraps from it still gets in.
        assert client.maddrs == served_at
        assert _worker_pid(client) != pid
        assert client.config.client_mode is True
        assert client.set_client_mode(True) is False  # already one: nothing restarts
        assert client.get("back") == [("s", b"back", 1.0)]
        assert client.restarts == 1


def test_reader_that_loses_framing_gets_the_worker_killed_and_restarted():
    with _client() as client:
        old = psutil.Process(_worker_pid(client))
        with pytest.raises(DhtError, match="exited"):
            client.get("unframe")
        _wait_for_restart(client, 1)
        assert client.get("back") == [("s", b"back", 1.0)]
        # The old worker was alive (sleeping) with a useless pipe: the restart killed it.
        assert not old.is_running() or old.status() == psutil.STATUS_ZOMBIE


def test_a_new_worker_that_died_before_the_hand_over_is_not_installed():
    """A worker that exits between its hello and the hand-over found itself not installed
    and started no restart: installed, it would fail every request from then on."""
    with _client() as client:
        old, killed = client._worker, []
        dead = SimpleNamespace(exited=threading.Event(), pid=1, kill=lambda: killed.append(1))
        dead.exited.set()
        assert client._install(dead, old) is False
        assert client._worker is old
        assert killed == [1]
        assert client.restarts == 0
        assert client.get("still") == [("s", b"still", 1.0)]


def _child_of_the_worker(client: DhtClient) -> psutil.Process:
    [(_subkey, pid, _expiration)] = client.get("child")
    child = psutil.Process(pid)
    assert child.ppid() == _worker_pid(client)
    return child


def _gone(proc: psutil.Process, deadline_s: float = 10.0) -> bool:
    """Exited (its killer's init reaps it: it is not our child)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.02)
    return False


def test_killed_worker_takes_what_it_started_down_before_the_restart():
    # A worker killed by SIGKILL cannot stop its children (the real one: hivemind's p2pd).
    with _client() as client:
        worker = psutil.Process(_worker_pid(client))
        child = _child_of_the_worker(client)
        worker.kill()
        _wait_for_restart(client, 1)
        assert _gone(child)
        assert client.get("back") == [("s", b"back", 1.0)]


def test_closed_client_leaves_nothing_its_worker_started():
    with _client() as client:
        child = _child_of_the_worker(client)
    # The fake worker exits on "stop" without stopping its child, as a stuck one would.
    assert _gone(child)


# As PID 1 in a container without --init (a child subreaper here, the same to the kernel):
# the worker's orphans are ours to reap.
_AS_INIT = """
import ctypes, logging, sys, time
sys.path.insert(0, sys.argv[1])
from tests.unit.test_dht_client import _client, _child_of_the_worker
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
warnings = []
logging.getLogger("fusionllm.dht.process").addHandler(logging.Handler())
logging.getLogger("fusionllm.dht.process").handlers[-1].emit = warnings.append
with _client() as client:
    _child_of_the_worker(client)
    started = time.monotonic()
print([w.getMessage() for w in warnings], round(time.monotonic() - started, 1))
"""


def test_a_node_that_is_init_reaps_its_workers_orphans_instead_of_waiting_out_the_kill():
    """docker stop took 18-33 s after the node said "left": the DHT worker's processes,
    killed, stayed zombies of the node (PID 1), and the node waited for their group to go."""
    repo = str(Path(__file__).parents[2])
    done = subprocess.run([sys.executable, "-c", _AS_INIT, repo], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    warned, took = done.stdout.strip().rsplit(" ", 1)
    assert warned == "[]", done.stdout  # no "outlived SIGKILL": the group went
    print(f"closed in {took} s")


def test_requests_while_restarting_fail_fast():
    with _client(restart_backoff_s=2.0) as client:
        with pytest.raises(DhtError):
            client.get("die")
        started = time.monotonic()
        with pytest.raises(DhtError, match="restarting"):
            client.get("x")
        assert time.monotonic() - started < 1.0


def test_closed_client_is_not_restarted():
    client = _client().start()
    client.close()
    with pytest.raises(DhtError, match="not running"):
        client.get("x")
    assert client.restarts == 0
    assert client.worker_pid == 0


# ----------------------------------------------------------------------------- the worker's cap


def _entries(sizes: list[int]) -> list[list]:
    return [[f"s{i}", bytes(size), float(i)] for i, size in enumerate(sizes)]


def test_cap_keeps_the_freshest_entries():
    limits = ReplyLimits(max_entries=3, max_reply_bytes=4096)
    kept, dropped = cap_entries(_entries([1] * 10), limits)
    assert [entry[0] for entry in kept] == ["s9", "s8", "s7"]
    assert dropped == 7


def test_cap_fits_the_reply_budget_and_skips_what_does_not_fit():
    limits = ReplyLimits(max_entries=100, max_reply_bytes=1024 + 3000)
    # Newest first: s3 (1000) fits, s2 (5000) does not, s1 and s0 (1000 each) do; 3000 total.
    kept, dropped = cap_entries(_entries([1000, 1000, 5000, 1000]), limits)
    assert [entry[0] for entry in kept] == ["s3", "s1"]
    assert dropped == 2
    reply = msgpack.packb({"ok": True, "items": kept, "dropped": dropped}, use_bin_type=True)
    assert len(reply) <= limits.max_reply_bytes


def test_cap_ranks_a_non_numeric_expiration_last():
    entries = [["odd", b"v", "soon"], ["s", b"v", 5.0]]
    kept, _ = cap_entries(entries, ReplyLimits(max_entries=1, max_reply_bytes=4096))
    assert kept == [["s", b"v", 5.0]]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_entries_per_key", 0),
        ("max_reply_bytes", 1000),
        ("restart_backoff_s", 0),
        ("search_beam", 4),  # fewer than the 5 nodes that hold a record
        ("search_beam", 21),
    ],
)
def test_config_refuses_bad_limits(field, value):
    with pytest.raises(ValueError, match=field):
        DhtConfig(swarm="fake", **{field: value})


# ----------------------------------------------------------------------------- the tagged wire


def test_tag_travels_with_the_message():
    stream = io.BytesIO()
    write_message(stream, {"a": 1}, tag=2**64 - 1)
    write_message(stream, [1], tag=5)
    stream.seek(0)
    assert read_tagged(stream) == (2**64 - 1, {"a": 1})
    assert read_tagged(stream) == (5, [1])


def test_writer_refuses_a_message_over_its_limit_and_writes_nothing():
    stream = io.BytesIO()
    with pytest.raises(MessageError, match="over 100") as refused:
        write_message(stream, bytes(200), tag=3, max_bytes=100)
    assert refused.value.tag == 3
    assert stream.getvalue() == b""


def test_body_that_is_not_msgpack_names_its_tag_and_keeps_the_stream_in_step():
    stream = io.BytesIO()
    stream.write(struct.pack(">IQ", 2, 4) + b"\xc1\xc1")
    write_message(stream, "next", tag=6)
    stream.seek(0)
    with pytest.raises(MessageError, match="not msgpack") as refused:
        read_tagged(stream)
    assert refused.value.tag == 4
    assert read_tagged(stream) == (6, "next")


def test_close_during_a_restart_stops_the_new_worker():
    client = _client(restart_backoff_s=0.01).start()
    with pytest.raises(DhtError):
        client.get("die")
    deadline = time.monotonic() + 10
    while client._spawning is None and client.restarts == 0:  # the restart is under way
        assert time.monotonic() < deadline
        time.sleep(0.001)
    spawning = client._spawning or client._worker
    client.close()
    assert spawning is not None
    assert spawning.exited.is_set() or spawning._process.poll() is not None
    assert client.worker_pid == 0


# ----------------------------------------------------------------------------- the worker's loop


class FakeNode:
    """hivemind's DHTNode as the worker uses it: 50 entries of 1 KB under any key, long
    maddrs."""

    async def get(self, key, *, latest):
        entries = {f"s{i}": SimpleNamespace(value=bytes(1000), expiration_time=float(i))
                   for i in range(50)}  # fmt: skip
        return SimpleNamespace(value=entries)

    async def get_visible_maddrs(self, *, latest):
        return ["/ip4/10.0.0.1/tcp/4001/" + "x" * 100] * 2000  # ~250 KB of addresses

    async def store(self, key, value, expiration_time, *, subkey):
        return True


class SlowNode(FakeNode):
    """Gets that take a while; counts how many run at once."""

    def __init__(self) -> None:
        self.running = self.most = 0

    async def get(self, key, *, latest):
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.1)
        self.running -= 1
        return await super().get(key, latest=latest)


def _serve(
    requests: list[dict], limits: ReplyLimits, node=None, *, stop: bool = True
) -> dict[int, dict]:
    inbound = io.BytesIO()
    for tag, request in enumerate(requests, start=1):
        write_message(inbound, request, tag=tag)
    if stop:
        write_message(inbound, {"op": "stop"})
    inbound.seek(0)
    outbound = io.BytesIO()
    asyncio.run(serve_requests(node or FakeNode(), inbound, outbound, limits))
    # It returns once every reply is written (requests in flight at "stop" may finish).
    replies, stream = {}, io.BytesIO(outbound.getvalue())
    while stream.tell() < len(stream.getvalue()):
        tag, reply = read_tagged(stream)
        replies[tag] = reply
    return replies


def test_worker_caps_a_get_and_fails_only_a_reply_too_large():
    limits = ReplyLimits(max_entries=40, max_reply_bytes=20_000)
    replies = _serve(
        [{"op": "get", "key": "k"}, {"op": "maddrs"}, {"op": "store", "key": "k", "subkey": "s",
          "value": b"v", "expiration": 1.0}, {"op": "nonsense"}],
        limits,
    )  # fmt: skip
    get, maddrs, store, nonsense = (replies[tag] for tag in (1, 2, 3, 4))
    # 18 of 1 KB fit in 20,000 bytes less the reply's overhead; the freshest first.
    assert get["ok"] is True
    assert [item[0] for item in get["items"]] == [f"s{i}" for i in range(49, 31, -1)]
    assert get["dropped"] == 32
    assert maddrs == {"ok": False, "error": maddrs["error"]}
    assert "reply too large" in maddrs["error"]
    assert store == {"ok": True, "stored": True}
    assert nonsense["ok"] is False


def test_worker_runs_requests_concurrently_up_to_its_cap_and_ends_with_its_stdin():
    node, limits = SlowNode(), ReplyLimits(max_entries=1, max_reply_bytes=1 << 20)
    gets = [{"op": "get", "key": f"k{i}"} for i in range(3 * MAX_CONCURRENT)]
    store = {"op": "store", "key": "k", "subkey": "s", "value": b"v", "expiration": 1.0}
    replies = _serve([*gets, store], limits, node, stop=False)  # stdin just ends
    assert len(replies) == len(gets) + 1
    assert all(reply["ok"] for reply in replies.values())
    assert node.most == MAX_CONCURRENT  # concurrent, and never more than the cap
