"""A fine-tune survives a killed stage as a full run does: the backup takes the stage over from
its checkpoint copy, which holds only the adapters (LoRA-FA: the B's), reads the frozen base
again itself, and the run goes on exactly as one process trains it.

Real SwarmTrainers over the in-memory data plane (test_swarm_trainer.py's harness).
"""

from dataclasses import replace

import numpy as np
import pytest

from fusionllm.node.training.checkpoints import CheckpointStore
from tests.unit.test_swarm_trainer import RUN, _plan, _reference, cluster_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")
__all__ = ["cluster_of"]  # the fixture, shared with the harness's module

FINETUNE = replace(RUN, lora_rank=4, lora_alpha=8.0, lora_fa=True, lr=1e-2)


def test_a_killed_finetune_stage_is_taken_over_with_its_adapters_only(cluster_of, tmp_path):
    peers = ["peer-a", "peer-b", "peer-c", "peer-d"]
    three = _plan(peers[:3], 3)
    cluster = cluster_of(peers, checkpoint_every=4, run=FINETUNE)
    cluster.start(three)
    cluster.wait(lambda: len(cluster.losses("peer-a")) >= 6, "6 steps")
    cluster.kill("peer-c")
    survivors = ["peer-a", "peer-b", "peer-d"]
    cluster.adopt(_plan(survivors, 3), peers=survivors)
    cluster.wait_finished(survivors)
    taken_over = cluster.starts("peer-d")[0]
    assert taken_over["start_step"] in (4, 8)
    assert taken_over["received"] > 0
    merged = {**cluster.losses("peer-a"), **cluster.losses("peer-d")}
    assert sorted(merged) == list(range(FINETUNE.steps))
    reference = _reference(three, FINETUNE)
    assert reference[-1] < reference[0]  # the adapters do learn
    np.testing.assert_allclose([merged[s] for s in range(FINETUNE.steps)], reference, atol=1e-5)
    # Every checkpoint and kept copy holds B's only: the base never travels or is stored.
    stored = [
        name
        for directory in tmp_path.glob("peer-*/*/*")
        for holding in CheckpointStore(directory).holdings()
        for name in CheckpointStore(directory).load(holding).state
    ]
    assert stored
    assert all(name.endswith(".lora_B") for name in stored), sorted(set(stored))[:5]
