import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dag.simulate import PipelineTimes, simulate


def test_one_stage_is_its_compute_time() -> None:
    result = simulate(PipelineTimes(forward=(0.1,), backward=(0.2,), micro_batches=8))
    assert result.step_time == pytest.approx(8 * 0.3)
    assert result.bubble_fraction == pytest.approx(0.0)


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_bubble_fraction_of_equal_stages(stages: int, micro_batches: int) -> None:
    times = PipelineTimes(
        forward=(1.0,) * stages, backward=(2.0,) * stages, micro_batches=micro_batches
    )
    result = simulate(times)
    assert result.step_time == pytest.approx((micro_batches + stages - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx((stages - 1) / (micro_batches + stages - 1))


def test_slow_link_becomes_the_bottleneck() -> None:
    times = PipelineTimes(
        forward=(0.1, 0.1),
        backward=(0.1, 0.1),
        send_forward=(1.0,),
        send_backward=(0.0,),
        micro_batches=10,
    )
    # The link serialises 10 activations of 1 s each.
    assert simulate(times).step_time >= 10.0


def test_allreduce_and_latency_add_time() -> None:
    base = PipelineTimes(forward=(1.0, 1.0), backward=(1.0, 1.0), micro_batches=1)
    slow = PipelineTimes(
        forward=(1.0, 1.0),
        backward=(1.0, 1.0),
        latency_forward=(0.5,),
        latency_backward=(0.5,),
        allreduce=(2.0, 0.0),
        micro_batches=1,
    )
    assert simulate(base).step_time == pytest.approx(4.0)
    assert simulate(slow).step_time == pytest.approx(4.0 + 1.0 + 2.0)


def test_rejects_inconsistent_lengths() -> None:
    with pytest.raises(ConfigError, match="send_forward"):
        PipelineTimes(forward=(1.0, 1.0), backward=(1.0, 1.0), send_forward=(1.0, 2.0))


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_a_step_pays_the_fill_and_drain_latencies(stages: int) -> None:
    """One micro-batch through S stages: every forward hop and every backward hop waits one
    one-way latency, 2(S-1) in all, on top of the compute."""
    hops = stages - 1
    times = PipelineTimes(
        forward=(0.1,) * stages,
        backward=(0.2,) * stages,
        latency_forward=(0.04,) * hops,
        latency_backward=(0.04,) * hops,
        micro_batches=1,
    )
    assert simulate(times).step_time == pytest.approx(stages * 0.3 + 2 * hops * 0.04)


def test_a_middle_stages_forward_and_backward_sends_share_its_uplink() -> None:
    """Stage 1 sends each activation on (1 s) and each gradient back (1 s) through one uplink:
    8 micro-batches put 16 s on it, where two independent links would take about 8."""
    times = PipelineTimes(
        forward=(0.01,) * 3,
        backward=(0.01,) * 3,
        send_forward=(0.0, 1.0),
        send_backward=(1.0, 0.0),
        micro_batches=8,
    )
    assert simulate(times).step_time >= 16.0
    apart = PipelineTimes(
        forward=(0.01,) * 3,
        backward=(0.01,) * 3,
        send_forward=(0.0, 1.0),
        send_backward=(0.0, 1.0),  # the gradient leaves from stage 2, not stage 1
        micro_batches=8,
    )
    assert simulate(apart).step_time < 10.0
