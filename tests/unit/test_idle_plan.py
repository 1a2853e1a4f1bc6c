"""A plan nobody trains, watched from the backup pool (node/training/idle_plan.py): the pure
watch on a fake clock, then a real SwarmTrainer left out of a plan whose members never come."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.training.idle_plan import IdlePlanWatch, idle_patience_s
from tests.unit.test_swarm_trainer import Cluster, _plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_members_of_a_plan_without_progress_are_suspected_after_the_patience():
    watch = IdlePlanWatch(["y", "x", "x"], progress=7, now=100.0, patience_s=60.0)
    assert watch.check(progress=7, now=159.9) == ()
    assert watch.check(progress=7, now=160.0) == ("x", "y")
    # Once per patience after that: the suspicion book doubles each repeat's backoff.
    assert watch.check(progress=7, now=200.0) == ()
    assert watch.check(progress=7, now=220.0) == ("x", "y")


def test_a_plan_whose_steps_move_on_is_never_suspected():
    watch = IdlePlanWatch(["x", "y"], progress=7, now=0.0, patience_s=60.0)
    for k in range(1, 20):  # a step every 50 s: slow, but the swarm trains
        assert watch.check(progress=7 + k, now=50.0 * k) == ()
    assert watch.check(progress=26, now=50.0 * 19 + 59.0) == ()
    assert watch.check(progress=26, now=50.0 * 19 + 60.0) == ("x", "y")  # then it stopped


def test_the_patience_outlasts_the_plans_own_barrier_and_its_state_moves():
    # Defaults (30 s grace, 60 s step timeout), 100 MB of state over 2.5 MB/s (20 Mbit/s).
    patience = idle_patience_s(barrier_grace_s=30.0, step_timeout_s=60.0,
                               state_bytes=100_000_000, bytes_per_s=2.5e6)  # fmt: skip
    assert patience == pytest.approx(2 * 90.0 + 40.0)
    assert idle_patience_s(barrier_grace_s=1.0, step_timeout_s=1.0, state_bytes=10,
                           bytes_per_s=0.0) == pytest.approx(14.0)  # unmeasured: 1 B/s  # fmt: skip


def test_a_watch_needs_a_patience():
    with pytest.raises(ConfigError, match="patience_s must be > 0"):
        IdlePlanWatch(["x"], progress=0, now=0.0, patience_s=0.0)


def test_a_trainer_left_out_of_a_plan_whose_members_never_come_suspects_them(tmp_path):
    """x and y are seated and never start (no barrier anywhere waits for them); a, left out,
    suspects both once the swarm's steps stood still for its patience (short timeouts here:
    0.2 s and the tiny model's state at 1 GB/s). Without the watch, a waited for ever."""
    cluster = Cluster(["a"], tmp_path, barrier_grace_s=0.05, step_timeout_s=0.05)
    try:
        cluster.adopt(_plan(["x", "y"], 2))
        cluster.trainers["a"].start()
        view = cluster.views["a"]
        cluster.wait(lambda: len(view.suspected) >= 2, "a to suspect them", timeout=30.0)
        assert sorted(view.suspected[:2]) == [("x", "idle"), ("y", "idle")]
    finally:
        cluster.close()
