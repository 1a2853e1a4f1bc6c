"""The emulator's FIFOs and loss, pure: rates, drop-tail limits, per-packet loss."""

import random

import pytest

from fusionllm.testbed.shaping import Fifo, survives


def test_a_capped_fifo_sends_back_to_back_at_its_rate():
    fifo = Fifo(rate=1000.0, limit_bytes=10_000)  # 1000 B/s
    assert fifo.offer(0.0, 500) == pytest.approx(0.5)
    assert fifo.offer(0.1, 500) == pytest.approx(1.0)  # waits behind the first
    assert fifo.backlog(0.5) == pytest.approx(500)
    assert fifo.offer(5.0, 100) == pytest.approx(5.1)  # idle link: leaves at its own pace


def test_a_full_fifo_drops_the_newcomer_and_not_what_it_holds():
    fifo = Fifo(rate=1000.0, limit_bytes=1500)
    assert fifo.offer(0.0, 1000) is not None
    assert fifo.offer(0.0, 1000) is None  # 1000 queued + 1000 > 1500
    assert fifo.offer(0.6, 1000) == pytest.approx(2.0)  # 400 left at 0.6: fits
    assert (fifo.stats.packets, fifo.stats.dropped, fifo.stats.bytes) == (2, 1, 2000)


def test_an_uncapped_fifo_passes_at_once_and_counts():
    fifo = Fifo(rate=None, limit_bytes=1)
    assert fifo.offer(3.0, 10**6) == 3.0
    assert fifo.stats.bytes == 10**6


@pytest.mark.parametrize(("rate", "limit"), [(0.0, 10), (float("inf"), 10), (1.0, 0)])
def test_a_fifo_refuses_a_rate_or_limit_that_cannot_be(rate, limit):
    with pytest.raises(ValueError, match="must be positive"):
        Fifo(rate=rate, limit_bytes=limit)


def test_loss_drops_its_share_of_packets_and_bursts_as_often_as_their_packets_would():
    rng = random.Random(7)
    n = 20_000
    assert sum(survives(0.05, 1, rng) for _ in range(n)) / n == pytest.approx(0.95, abs=0.01)
    burst = sum(survives(0.05, 4, rng) for _ in range(n)) / n
    assert burst == pytest.approx(0.95**4, abs=0.01)
    assert all(survives(0.0, 40, rng) for _ in range(100))
