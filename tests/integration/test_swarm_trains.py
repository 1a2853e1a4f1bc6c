"""Three `fusionllm node` processes, started as three users would, train GPT-2 tiny together.

Nobody hands out stages: the daemons find each other on the DHT, agree on a plan, meet on the
data plane and train to --steps; `fusionllm status` shows the step advancing meanwhile.
"""

import json
import subprocess
import sys

import pytest
import torch

from fusionllm.node.local_swarm import LocalSwarm, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 16
RUN = {
    "steps": STEPS,
    "seq-len": 32,
    "micro-batch-size": 2,
    "micro-batches": 4,
    "lr": 3e-3,
    "min-stages": 2,
    "threads": 1,
    "step-timeout": 60,
}


def _status(bootstrap: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING", "status",
         "--bootstrap", bootstrap, "--json", "--timeout", "60"],
        capture_output=True, text=True, timeout=90, check=True,
    )  # fmt: skip
    return json.loads(result.stdout)


def _steps(node) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in node.snapshot() if e["event"] == "step"}


def test_three_daemons_train_to_the_end_without_a_launcher(tmp_path):
    swarm = LocalSwarm(tmp_path, extra=RUN)
    try:
        first = swarm.start("a")
        wait_for(lambda: first.last("ready"), 60, "the first node to be ready")
        others = [swarm.start(name, bootstrap=first.dht_addr) for name in ("b", "c")]
        nodes = [first, *others]
        wait_for(lambda: any(len(_steps(n)) >= 2 for n in nodes), 240, "two trained steps")
        early = _status(first.dht_addr)
        wait_for(lambda: any(len(_steps(n)) >= 8 for n in nodes), 240, "eight trained steps")
        later = _status(first.dht_addr)
        assert early["step"] is not None, early
        assert later["step"] > early["step"], (early, later)
        assert later["loss"] is not None
        serving = [n for n in nodes if n.last("train_plan")]
        assert len(serving) >= 2, "the plan should have at least two stages"
        wait_for(lambda: all(not n.alive() for n in serving), 240, "the serving nodes to exit")
        for node in serving:
            assert node.process.returncode == 0, swarm.logs()
            losses = _steps(node)
            assert sorted(losses) == list(range(STEPS)), (node.name, sorted(losses))
            assert losses[STEPS - 1] < losses[0] - 0.3, losses
            saved = torch.load(tmp_path / node.name / "final-params.pt", weights_only=True)
            assert saved["step"] == STEPS
            assert saved["params"]
        plans = {n.last("train_plan")["digest"] for n in serving}
        assert len(plans) == 1, plans
    except BaseException:
        print(swarm.logs())
        raise
    finally:
        swarm.close()
