"""A run stopped or re-planned mid-way resumes its state whole: fp16's loss scale (the same on
every member), error-feedback residuals (same plan), and stages loaded without initialising.

Real SwarmTrainers over the in-memory data plane, as in test_swarm_trainer.py (its harness).
"""

import functools
from dataclasses import replace

import numpy as np
import pytest

import fusionllm.node.pipeline.loss_scale as loss_scale_module
from fusionllm.dag.models.materialise import SeededInit
from fusionllm.node.pipeline.loss_scale import LossScaleConfig
from fusionllm.node.training.assignment import assign
from tests.unit.test_swarm_trainer import RUN, Cluster, _plan, _reference, cluster_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")
__all__ = ["cluster_of"]  # the fixture, shared with the harness's module


def _scales_by_step(cluster, peers) -> dict[int, set[tuple[float, bool]]]:
    """Every (loss scale, skipped) each step was computed with, by any of ``peers``."""
    seen: dict[int, set[tuple[float, bool]]] = {}
    for peer in peers:
        for e in list(cluster.events[peer]):
            if e["event"] == "step":
                seen.setdefault(e["step"], set()).add((e["loss_scale"], e["skipped"]))
    return seen


@pytest.mark.parametrize("how", ["killed", "left"])
def test_an_fp16_run_keeps_its_loss_scale_across_a_plan_change(cluster_of, monkeypatch, how):
    """The scale grows every 2 steps here. A stage taken over from its checkpoint copy (killed)
    or handed over (a polite leave) resumes at that step's scale on every member, not at the
    initial 2**16: each step runs at one scale everywhere, also where a rollback recomputes
    it, and the scales follow LossScale's rule from step 0 to the end. The resumed stages are
    loaded from their state only: no parameter is initialised after the first plan's start."""
    grows_fast = functools.partial(LossScaleConfig, growth_interval=2)
    monkeypatch.setattr(loss_scale_module, "LossScaleConfig", grows_fast)
    inits: list[str] = []
    seeded = SeededInit.tensors
    monkeypatch.setattr(
        SeededInit, "tensors", lambda self, shapes: inits.extend(shapes) or seeded(self, shapes)
    )
    run = replace(RUN, precision="fp16")
    peers = ["peer-a", "peer-b", "peer-c", "peer-d"]
    three = _plan(peers[:3], 3)
    cluster = cluster_of(peers, checkpoint_every=4, run=run)
    cluster.start(three)
    cluster.wait(lambda: len(cluster.losses("peer-a")) >= 6, "6 steps")
    initialised = len(inits)
    assert initialised, "the first plan's stages were never initialised"
    gone = "peer-c" if how == "killed" else "peer-b"
    if how == "killed":
        cluster.kill(gone)
    else:
        cluster.trainers[gone].stop()
        assert cluster.trainers[gone].wait_gone(60.0)
        for view in cluster.views.values():
            view.alive.discard(gone)
    survivors = [p for p in peers if p != gone]
    cluster.adopt(_plan(survivors, 3), peers=survivors)
    cluster.wait_finished(survivors)
    resumed = cluster.starts("peer-d")[0]["start_step"]
    seen = _scales_by_step(cluster, peers)
    assert sorted(seen) == list(range(run.steps))
    assert all(len(pairs) == 1 for pairs in seen.values()), seen
    expected = loss_scale_module.LossScale()
    for step in range(run.steps):
        ((scale, skipped),) = seen[step]
        assert scale == expected.scale, (step, seen)
        expected.update(skipped)
    assert next(iter(seen[resumed]))[0] > 2.0**16, "the scale never moved before the resume"
    assert len(inits) == initialised, inits[initialised:]
    merged = {**cluster.losses("peer-a"), **cluster.losses("peer-d")}
    reference = _reference(three, run)
    np.testing.assert_allclose([merged[s] for s in range(run.steps)], reference, atol=2e-3)


def test_a_restarted_run_resumes_its_error_feedback_residuals(cluster_of, tmp_path):
    """Slow links: top-k with error feedback on the gradients. Every node stops after some
    steps and comes back on the same work dir and plan: each resumes from its own checkpoint,
    residuals included (same plan: same links and receivers), so the steps after the
    checkpoint repeat an uninterrupted run's losses exactly; without them they would not."""
    peers = ["peer-a", "peer-b"]
    slow = _plan(peers, 2, bandwidth=1e5)
    assert assign(RUN, slow, slow.digest(), "peer-b").config.gradient_ratios[0] < 1.0
    whole = Cluster(peers, tmp_path / "uninterrupted")
    try:
        whole.start(slow)
        whole.wait_finished(peers)
        reference = whole.losses("peer-a")
    finally:
        whole.close()
    first = cluster_of(peers, checkpoint_every=4)
    first.start(slow)
    first.wait(lambda: len(first.losses("peer-a")) >= 6, "6 steps")
    for trainer in first.trainers.values():
        trainer.stop()
    first.close()
    second = cluster_of(peers, checkpoint_every=4)
    second.start(slow)
    second.wait_finished(peers)
    resumed = second.starts("peer-b")[0]["start_step"]
    assert resumed in (4, 8)
    losses = second.losses("peer-a")
    assert sorted(losses) == list(range(resumed, RUN.steps))
    np.testing.assert_allclose(
        [losses[s] for s in losses], [reference[s] for s in losses], atol=1e-6
    )
