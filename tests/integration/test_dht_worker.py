"""The real DHT worker (hivemind inside): a get is capped to the configured entries, and a
client whose worker is killed restarts it and serves requests again, same peer id."""

import os
import signal
import time

import psutil
import pytest

from fusionllm.dht.client import DhtClient, DhtConfig, DhtError

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]


def _wait(condition, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {deadline_s}s"
        time.sleep(0.1)


def _serves(client: DhtClient) -> bool:
    try:
        return client.store("probe-key", "s", b"v", time.time() + 60)
    except DhtError:
        return False


def test_worker_caps_entries_and_comes_back_after_it_is_killed(tmp_path):
    config = DhtConfig(
        swarm="restart",
        identity_path=tmp_path / "key",
        validate_records=False,  # raw values: this test is about the pipe, not the records
        max_entries_per_key=3,
        restart_backoff_s=0.2,
        request_timeout_s=10.0,
    )
    with DhtClient(config) as client:
        now = time.time()
        for i in range(6):
            assert client.store("many", f"s{i}", b"value", now + 60 + i)
        items = client.get("many")
        assert sorted(subkey for subkey, _value, _expiration in items) == ["s3", "s4", "s5"]

        worker = psutil.Process(client.worker_pid)
        tree = worker.children(recursive=True)  # hivemind's DHT process and its Go daemon
        peer_id = client.peer_id
        os.kill(worker.pid, signal.SIGKILL)
        _wait(lambda: client.restarts == 1, 60, "restart")
        _wait(lambda: _serves(client), 30, "a store on the restarted worker")
        assert client.peer_id == peer_id
        assert client.worker_pid not in (0, worker.pid)
        # What the killed worker had started went down with it (killed by the client).
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert alive == []
    assert client.worker_pid == 0
