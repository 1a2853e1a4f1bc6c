"""What ``fusionllm node`` prints of its events: whole lines even when threads emit at once."""

import argparse
import io
import json
import subprocess
import sys

from fusionllm.node.cli.node_cmd import _printer

THREADS, EACH = 3, 3000


_CHILD = """
import argparse, sys, threading
from fusionllm.node.cli.node_cmd import _printer

on_event = _printer(argparse.Namespace(events=True), "x")
THREADS, EACH = {threads}, {each}


def emitter(name):
    for i in range(EACH):
        # Sizes up to a few KB, as epoch events get.
        pad = "x" * (50 + (i * 37) % 3000)
        on_event({{"event": "step", "step": i, "loss": 1.0, "thread": name, "pad": pad}})


threads = [threading.Thread(target=emitter, args=(n,)) for n in range(THREADS)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


def test_events_from_several_threads_come_out_as_whole_json_lines():
    """A child's stdout read through a pipe, as the launcher and the tests read a node's
    ``--events``. Two threads' ``print`` calls used to interleave text and newline: 14% of
    such lines came out torn, and a CI run lost one step's loss that way."""
    code = _CHILD.format(threads=THREADS, each=EACH)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    torn = [line[:60] for line in lines if not _parses(line)]
    assert not torn, f"{len(torn)} torn lines of {len(lines)}, e.g. {torn[:3]}"
    events = [json.loads(line) for line in lines]
    assert len(events) == THREADS * EACH
    assert {(e["thread"], e["step"]) for e in events} == {
        (t, i) for t in range(THREADS) for i in range(EACH)
    }


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def test_without_events_only_the_human_lines_are_printed(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    on_event = _printer(argparse.Namespace(events=False), "demo")
    on_event({"event": "step", "step": 10, "loss": 2.5, "tokens_per_s": 1234.0})
    on_event({"event": "step", "step": 11, "loss": 2.4, "tokens_per_s": 1234.0})
    on_event({"event": "step", "step": 12, "loss": 2.4, "tokens_per_s": 99.0, "eval_loss": 2.6})
    on_event({"event": "ready", "peer_id": "12D3", "dht_addrs": ["/ip4/127.0.0.1/tcp/1"]})
    on_event({"event": "heartbeat"})
    on_event({"event": "metrics", "url": "http://127.0.0.1:9100/metrics"})
    assert out.getvalue().splitlines() == [
        "step    10  loss 2.5000  1,234 tokens/s",
        "step    12  loss 2.4000  99 tokens/s  validation loss 2.6000",
        "node 12D3 joined swarm demo",
        "  others can bootstrap from: /ip4/127.0.0.1/tcp/1",
        "metrics at http://127.0.0.1:9100/metrics",
    ]
