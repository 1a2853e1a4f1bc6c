"""replica_links.py: a cut between replicated stages is timed over every pair it crosses, in
build_plan and in the audit's Retimer alike."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import DeviceProfile, LinkProfile
from fusionllm.dag.plan_build import build_plan
from fusionllm.dag.plan_check import Retimer
from fusionllm.dag.planner import PlanConfig
from fusionllm.dag.replica_links import replica_link
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.dag.synthetic import gpt2_costs

MB = 1e6


def table(links: dict[tuple[int, int], tuple[float, float]]):
    return lambda s, r: LinkProfile(bandwidth=links[(s, r)][0], rtt=links[(s, r)][1])


def test_one_pair_is_that_pairs_link():
    link = replica_link(table({(0, 1): (5 * MB, 0.02)}), [0], [1], 4)
    assert link.bandwidth == pytest.approx(5 * MB)
    assert link.rtt == 0.02


def test_one_sender_to_two_replicas_pays_the_slow_pairs_half():
    # micro-batches 0, 2 -> peer 1 at 5 MB/s; 1, 3 -> peer 2 at 2.5 MB/s; one uplink for all
    link = replica_link(table({(0, 1): (5 * MB, 0.01), (0, 2): (2.5 * MB, 0.04)}), [0], [1, 2], 4)
    assert link.bandwidth == pytest.approx(4 / (2 / (5 * MB) + 2 / (2.5 * MB)))  # 3.33 MB/s
    assert link.rtt == 0.04  # the worst pair's


def test_two_senders_send_in_parallel_and_the_busier_one_paces_the_cut():
    links = table({(1, 0): (5 * MB, 0.01), (2, 0): (2.5 * MB, 0.01)})
    link = replica_link(links, [1, 2], [0], 4)
    assert link.bandwidth == pytest.approx(4 / (2 / (2.5 * MB)))  # 5 MB/s: 2 frames each
    equal = replica_link(table({(1, 0): (MB, 0.0), (2, 0): (MB, 0.0)}), [1, 2], [0], 4)
    assert equal.bandwidth == pytest.approx(2 * MB)  # two uplinks carry twice one's


def test_fewer_micro_batches_than_replicas_time_only_the_pairs_used():
    links = table({(0, 1): (4 * MB, 0.01), (0, 2): (0.1 * MB, 0.5)})
    assert replica_link(links, [0], [1, 2], 1) == LinkProfile(bandwidth=4 * MB, rtt=0.01)


@pytest.mark.parametrize(("senders", "receivers", "m"), [([], [1], 4), ([0], [], 4), ([0], [1], 0)])
def test_an_empty_cut_is_refused(senders, receivers, m):
    with pytest.raises(ConfigError):
        replica_link(table({}), senders, receivers, m)


DEVICE = DeviceProfile(name="cpu", flops=5e10, memory_bandwidth=2e9, memory_bytes=16 << 30)


def _swarm() -> Swarm:
    peers = [Peer(peer_id=p, device=DEVICE, uplink=100 * MB, downlink=100 * MB) for p in "abc"]
    links = {("a", "b"): 5.0, ("b", "a"): 5.0, ("a", "c"): 0.5, ("c", "a"): 0.5,
             ("b", "c"): 50.0, ("c", "b"): 50.0}  # fmt: skip
    return Swarm.from_links(
        peers, {k: LinkProfile(bandwidth=v * MB, rtt=0.02) for k, v in links.items()}
    )


def test_a_plan_over_replicas_is_timed_at_the_slow_pair_and_its_audit_agrees():
    graph, swarm = gpt2_costs("small", batch=1, seq=64), _swarm()
    config = PlanConfig(micro_batches=4, batch_size=4, compression=False)
    cut = len(graph.nodes) // 2
    alone = build_plan(graph, swarm, config, [["a"], ["b"]], [0, cut, len(graph.nodes)])
    wide = build_plan(graph, swarm, config, [["a"], ["b", "c"]], [0, cut, len(graph.nodes)])
    link = wide.links[0]
    assert (link.src_peer, link.dst_peer) == ("a", "b")  # still named by the best pair
    # half the frames cross a -> c at 0.5 MB/s: 4 / (2/5 + 2/0.5) MB/s, not the 5 of a -> b
    assert link.forward_bandwidth == pytest.approx(4 / (2 / 5 + 2 / 0.5) * MB)
    assert link.backward_bandwidth == pytest.approx(4 / (2 / 0.5) * MB)
    assert wide.estimated_step_time > alone.estimated_step_time
    retimed = Retimer(graph, swarm, config).retime(wide).plan
    assert retimed.links[0].forward_bandwidth == pytest.approx(link.forward_bandwidth)
    assert retimed.estimated_step_time == pytest.approx(wide.estimated_step_time)
