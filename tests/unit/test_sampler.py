"""The sample order: a bijection per epoch, disjoint replicas, a resumable cursor."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.data.manifest import DataError
from fusionllm.data.sampler import Sampler, permute
from fusionllm.node.pipeline.schedule import owner


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63 - 1))
def test_permute_is_a_bijection_of_the_range(n, seed) -> None:
    keys = np.random.SeedSequence(seed).generate_state(4, dtype=np.uint64)
    out = permute(np.arange(n), n, keys)
    assert sorted(out.tolist()) == list(range(n))


def test_the_order_is_shuffled_and_each_epoch_differs() -> None:
    sampler = Sampler(tokens=64 * 1000 + 1, seq_len=64, batch_size=2, micro_batches=4, seed=3)
    n = sampler.train_windows
    assert (sampler.windows, sampler.held_out, n) == (1000, 10, 990)
    first, second = sampler.order(np.arange(n)), sampler.order(np.arange(n, 2 * n))
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(n))
    assert first.tolist() != list(range(n))
    assert first.tolist() != second.tolist()
    other = Sampler(tokens=64 * 1000 + 1, seq_len=64, batch_size=2, micro_batches=4, seed=4)
    assert other.order(np.arange(n)).tolist() != first.tolist()


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_replicas_read_disjoint_windows_and_steps_cover_an_epoch(replicas) -> None:
    """Each replica reads the micro-batches it owns (schedule.owner); over an epoch's steps the
    replicas together read every training window once."""
    sampler = Sampler(tokens=16 * 1212 + 1, seq_len=16, batch_size=3, micro_batches=4, seed=1)
    steps = sampler.train_windows // sampler.global_batch
    assert steps * sampler.global_batch == sampler.train_windows == 1212 - 12
    read: dict[int, list[int]] = {r: [] for r in range(replicas)}
    for step in range(steps):
        for mb in range(4):
            read[owner(mb, replicas)].extend(sampler.micro_batch(step, mb).tolist())
    everything = [w for r in read for w in read[r]]
    assert sorted(everything) == list(range(sampler.train_windows))
    for r in read:
        for other in read:
            if r != other:
                assert not set(read[r]) & set(read[other])


def test_a_resumed_run_reads_on_from_its_cursor() -> None:
    """A run stopped after step k and resumed (a fresh sampler, as on a restarted node) reads
    exactly what one uninterrupted run reads: nothing repeated, nothing skipped."""
    spec = dict(tokens=8 * 300 + 1, seq_len=8, batch_size=2, micro_batches=3, seed=9)
    whole = Sampler(**spec)
    straight = [w for s in range(120) for mb in range(3) for w in whole.micro_batch(s, mb)]
    k = 37
    cursor = whole.position(k)
    resumed = Sampler(**spec)
    assert resumed.position(k) == cursor == k * 6
    before = [w for s in range(k) for mb in range(3) for w in whole.micro_batch(s, mb)]
    after = [w for s in range(k, 120) for mb in range(3) for w in resumed.micro_batch(s, mb)]
    assert before + after == straight
    assert straight == whole.order(np.arange(120 * 6)).tolist()
    epoch = whole.train_windows
    assert len(set(straight[:epoch])) == epoch  # no repeat within a pass over the data


def test_too_little_data_is_refused_with_the_numbers() -> None:
    with pytest.raises(DataError, match=r"3 training windows .* fewer than one step's 8"):
        Sampler(tokens=30, seq_len=8, batch_size=2, micro_batches=4)
    sampler = Sampler(tokens=1000, seq_len=8, batch_size=2, micro_batches=4)
    with pytest.raises(DataError, match="hold out 1 for validation"):
        sampler.eval_batch(0)
    with pytest.raises(ValueError, match="micro_batch in"):
        sampler.micro_batch(0, 4)


def test_a_micro_batch_is_its_positions_in_the_order_and_a_fresh_array() -> None:
    sampler = Sampler(tokens=65 * 1000, seq_len=64, batch_size=3, micro_batches=4, seed=7)
    for step in (0, 1, 81, 82, 500):  # 82 steps of 12 cross an epoch of 990 windows
        for mb in range(4):
            first = (step * 4 + mb) * 3
            expected = sampler.order(np.arange(first, first + 3))
            got = sampler.micro_batch(step, mb)
            assert got.tolist() == expected.tolist()
            got[:] = -1  # the caller's own array: the next call reads the order again
            assert sampler.micro_batch(step, mb).tolist() == expected.tolist()
