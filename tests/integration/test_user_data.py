"""The user's data in a real swarm: `fusionllm prepare` output as --data, real node processes.

- Nodes whose data differ are never members of one run (their settings digests differ), while
  a node on the same data joins at once (the control that the first two could have met).
- Kill a replica of a data-parallel run and restart it: over the run that counts (steps
  redone after a rollback replace the abandoned ones), every step read exactly the windows
  the sample order names for it, no window twice and none missing, and the restarted node
  read its share again.
"""

import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

from fusionllm.data.corpus import load_prepared, stdlib_source_files
from fusionllm.data.prepare import PrepareConfig, prepare
from fusionllm.data.sampler import Sampler
from fusionllm.node.local_swarm import TEST_DEVICE, LocalSwarm, serving, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SEQ, MICRO, BATCH = 64, 4, 2
SLOW_DEVICE = {**TEST_DEVICE, "flops": TEST_DEVICE["flops"] / 100}  # see test_churn.py


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """~1 MB of stdlib source, prepared byte-level: ~2,000 steps of windows per pass."""
    root = tmp_path_factory.mktemp("data")
    files, size = [], 0
    for path in stdlib_source_files():
        files.append(path)
        size += path.stat().st_size
        if size > 1 << 20:
            break
    prepare(PrepareConfig(inputs=tuple(files), out=root / "prepared", shard_tokens=1 << 18))
    return root / "prepared"


def test_nodes_on_other_data_are_never_planned_together(tmp_path, prepared):
    other = tmp_path / "other.bin"
    tokens = load_prepared(prepared).store.read(0, 50_000).astype("<u2")
    tokens[:10] = 0  # the same vocabulary and dtype: only the digest differs
    tokens.tofile(other)
    swarm = LocalSwarm(tmp_path, extra={"control-only": True, "min-stages": 1})
    try:
        first = swarm.start("a", extra={"data": str(prepared)})
        wait_for(lambda: first.last("ready"), 60, "the first node")
        stranger = swarm.start(
            "b", bootstrap=first.dht_addr, extra={"data": str(other), "vocab-size": 256}
        )
        # Side by side (one start-up less): b is still ready before the 6 s below start,
        # three epochs in which a and c could plan with it if digests were not compared.
        same = swarm.start("c", bootstrap=first.dht_addr, extra={"data": str(prepared)})
        wait_for(lambda: stranger.last("ready"), 60, "the node on other data")

        def met() -> bool:
            views = [n.last("epoch") for n in (first, same)]
            return all(v and {first.peer_id, same.peer_id} <= set(v["members"]) for v in views)

        wait_for(met, 120, "a and c, on the same data, members of each other's view")
        started = time.time()
        # Let b see the swarm for a few more epochs (2 s each) after a and c met.
        wait_for(lambda: time.time() - started > 6, 10, "three epochs")
        for node in (first, same):
            epochs = [e for e in node.snapshot() if e["event"] == "epoch"]
            assert epochs
            assert all(stranger.peer_id not in e["members"] for e in epochs)
        epochs = [e for e in stranger.snapshot() if e["event"] == "epoch"]
        assert epochs, "b followed no epoch"
        assert all(set(e["members"]) <= {stranger.peer_id} for e in epochs), epochs[-1]
    finally:
        swarm.close()


def _trajectory(nodes) -> dict[int, Counter]:
    """step -> the windows the run that counts read at it, as a multiset. Plan runs (a plan
    digest and its start step) in the order they started; one that starts at step s replaces
    whatever earlier runs did from s on (they were rolled back)."""
    runs: dict[tuple[str, int], dict] = {}
    for node in nodes:
        current = None
        for event in node.snapshot():
            if event["event"] == "train_plan":
                current = (event["digest"], event["start_step"])
                run = runs.setdefault(current, {"t": event["t"], "steps": {}})
                run["t"] = min(run["t"], event["t"])
            elif event["event"] == "step" and current is not None:
                step = runs[current]["steps"].setdefault(event["step"], Counter())
                step.update(event["samples"])
    read: dict[int, Counter] = {}
    for (_, start), run in sorted(runs.items(), key=lambda kv: kv[1]["t"]):
        read = {s: c for s, c in read.items() if s < start}
        read.update(run["steps"])
    return read


@pytest.mark.slow
def test_a_killed_and_restarted_replica_repeats_and_skips_no_sample(tmp_path, prepared):
    options = {"seq-len": SEQ, "micro-batch-size": BATCH, "micro-batches": MICRO, "steps": 0,
               "threads": 1, "dense": True, "checkpoint-every": 10, "min-stages": 1,
               "max-stages": 1, "max-replicas": 2, "data": str(prepared)}  # fmt: skip
    swarm = LocalSwarm(tmp_path, extra=options, device=SLOW_DEVICE)

    def replicated(nodes, since: float = 0.0):
        """Both serve one 2-replica plan started after ``since``, 10 steps into it."""
        plans = [n.last("train_plan") for n in nodes]
        if len(serving(nodes)) < 2 or any(p is None or p["t"] < since for p in plans):
            return False
        if any(len(p["stages"][0]) != 2 for p in plans) or len({p["digest"] for p in plans}) > 1:
            return False
        steps = [e["step"] for n in nodes for e in n.snapshot() if e["event"] == "step"]
        return max(steps, default=-1) >= plans[0]["start_step"] + 10

    try:
        a = swarm.start("a")
        wait_for(lambda: a.last("ready"), 60, "the first node")
        b = swarm.start("b", bootstrap=a.dht_addr)
        wait_for(lambda: replicated([a, b]), 240, "two replicas, 10 steps into their plan")
        killed_at = time.time()
        b.kill(signal.SIGKILL)
        wait_for(lambda: any(p["t"] > killed_at for p in _plans(a)), 120, "a plan without b")
        back = swarm.start("b", bootstrap=a.dht_addr)  # same key and work dir
        wait_for(lambda: replicated([a, back], killed_at), 240, "b back as a replica")
        for node in (a, back):  # both vote to leave at the same step: both report it
            node.process.send_signal(signal.SIGTERM)
        wait_for(lambda: not a.alive() and not back.alive(), 120, "both to leave")
    finally:
        swarm.close()

    read = _trajectory([a, b, back])
    sampler = Sampler(tokens=len(load_prepared(prepared)), seq_len=SEQ, batch_size=BATCH,
                      micro_batches=MICRO)  # fmt: skip
    assert sorted(read) == list(range(len(read))), "a step is missing from the run"
    assert len(read) > 20
    short = []
    for step, windows in read.items():
        expected = Counter(np.concatenate([sampler.micro_batch(step, m) for m in range(MICRO)]))
        if windows != expected:
            short.append(step)
            # b may die after finishing a step but before printing it: a's share is then all
            # that was reported, and it must be exactly a's half, nothing else.
            assert not windows - expected, f"step {step} read windows not its own"
            assert sum(windows.values()) == sampler.global_batch // 2, f"step {step}: {windows}"
    assert len(short) <= 1, f"steps missing samples: {short}"
    assert any(e["event"] == "step" and e["samples"] for e in back.snapshot())


def _plans(node) -> list[dict]:
    return [e for e in node.snapshot() if e["event"] == "train_plan"]


def test_a_swarm_on_data_it_cannot_read_is_a_clear_error(tmp_path):
    """(The user's path, `fusionllm prepare` then `fusionllm swarm --data` on it, is
    test_swarm_trains.py's main job.)"""
    cli = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING"]
    missing = tmp_path / "missing"
    refused = subprocess.run([*cli, "swarm", "--nodes", "2", "--steps", "2", "--data",
                              str(missing)], capture_output=True, text=True, timeout=60,
                             check=False)  # fmt: skip
    assert refused.returncode == 1
    assert "cannot read token file" in refused.stderr
