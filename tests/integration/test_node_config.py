"""A ``fusionllm node`` started with no flag at all: a TOML file and FUSIONLLM_* variables
give every setting, and the node runs with them (its key, swarm, timing, announced addresses).
Started as a script's background job starts it (SIGINT ignored), it still leaves on SIGINT."""

import json
import os
import signal
import sys
import time

import pytest

from fusionllm.node.children import JsonChild
from fusionllm.node.local_swarm import TEST_DEVICE
from tests.support.forwarder import Forwarder

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# What a shell does for a script's `cmd &`: SIGINT ignored, then exec (which keeps that).
AS_A_BACKGROUND_JOB = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def test_a_node_runs_with_the_settings_of_its_file_and_environment(tmp_path):
    device = tmp_path / "device.json"
    device.write_text(json.dumps(TEST_DEVICE))
    key = tmp_path / "keys" / "configured.key"
    with Forwarder() as control_fwd, Forwarder() as dht_fwd:
        config = tmp_path / "node.toml"
        config.write_text(
            f'swarm = "configured"\nkey = "{key}"\nno-train = true\n'
            f'announce-addr = ["127.0.0.1:{control_fwd.port}"]\n'
            f"announce-dht-port = {dht_fwd.port}\nheartbeat = 9.0\nepoch = 3.0\n"
        )
        env = {
            **os.environ,
            "FUSIONLLM_CONFIG": str(config),
            "FUSIONLLM_EVENTS": "1",
            "FUSIONLLM_DEVICE_JSON": str(device),
            "FUSIONLLM_HEARTBEAT": "1.5",  # over the file's 9.0
            "FUSIONLLM_TTL": "6",
        }
        log = tmp_path / "node.log"
        argv = [sys.executable, "-c", AS_A_BACKGROUND_JOB, "-m", "fusionllm.node.cli.main", "node"]
        with JsonChild(argv, name="configured", env=env, stderr=log) as node:
            try:
                ready = node.wait_for(lambda e: e["event"] == "ready", 120)
                # no-train = true: an observer alone plans nothing, and says why each epoch.
                _wait_for_line(log, "no member may be seated", 30)
                # Python ignores a SIGINT that was ignored when it started: the node's own
                # handler must take it, and leave as on SIGTERM.
                node.process.send_signal(signal.SIGINT)
                assert node.wait(60) == 0
                node.drain(5)
                assert any(e["event"] == "stopping" for e in node.snapshot())
            except BaseException:
                print(log.read_text()[-4000:])
                raise
    peer = ready["peer_id"]
    assert key.exists()  # the file's key path
    assert ready["addrs"] == [f"/ip4/127.0.0.1/tcp/{control_fwd.port}/p2p/{peer}"]
    assert f"/ip4/127.0.0.1/tcp/{dht_fwd.port}/p2p/{peer}" in ready["dht_addrs"]
    text = log.read_text()
    assert f"swarm = 'configured' (file {config})" in text
    assert "heartbeat = 1.5 (env FUSIONLLM_HEARTBEAT)" in text
    assert "epoch = 3.0 (file" in text
    assert "port = 0 (default)" in text


def _wait_for_line(log, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if time.monotonic() > deadline:
            raise AssertionError(f"the node never logged {text!r} in {timeout} s")
        time.sleep(0.2)
