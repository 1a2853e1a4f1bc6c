"""``status.gather`` tries again only when the bootstrap peers did not answer (a busy node): a
malformed address fails at once instead of four daemon starts later."""

import pytest

import fusionllm.node.control.status as status_module
from fusionllm.dht.client import DhtError


def _failing(monkeypatch, message: str) -> list[int]:
    calls: list[int] = []

    def gather_once(bootstrap, swarm, *, timeout_s, swarm_key):
        calls.append(1)
        raise DhtError(message)

    monkeypatch.setattr(status_module, "_gather_once", gather_once)
    monkeypatch.setattr(status_module, "_RETRY_PAUSE_S", 0.0)
    return calls


def test_a_malformed_bootstrap_address_fails_after_one_try(monkeypatch):
    calls = _failing(monkeypatch, 'failed to start: failed to parse multiaddr "/ip4/1.2.3.4/tcp/"')
    with pytest.raises(DhtError, match="parse multiaddr"):
        status_module.gather(["/ip4/1.2.3.4/tcp/"], "demo", timeout_s=60.0)
    assert len(calls) == 1


def test_bootstrap_peers_that_did_not_answer_are_tried_again(monkeypatch):
    calls = _failing(monkeypatch, "Daemon failed to start: failed to connect to bootstrap peers")
    with pytest.raises(DhtError, match="bootstrap peers"):
        status_module.gather(["/ip4/1.2.3.4/tcp/1/p2p/x"], "demo", timeout_s=60.0)
    assert len(calls) == status_module._ATTEMPTS


class _Clock:
    """The module's ``time``: faked tries and sleeps move it on."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _slow_failing(monkeypatch, message: str, try_s: float) -> list[float]:
    clock, started = _Clock(), []

    def gather_once(bootstrap, swarm, *, timeout_s, swarm_key):
        started.append(clock.now)
        clock.now += try_s
        raise DhtError(message)

    monkeypatch.setattr(status_module, "_gather_once", gather_once)
    monkeypatch.setattr(status_module, "time", clock)
    return started


def test_no_try_is_started_that_cannot_end_before_the_deadline(monkeypatch):
    started = _slow_failing(monkeypatch, "failed to connect to bootstrap peers", try_s=6.0)
    with pytest.raises(
        DhtError, match=r"bootstrap peers \(/ip4/1\.2\.3\.4/tcp/1/p2p/x\) within 13 s"
    ):
        status_module.gather(["/ip4/1.2.3.4/tcp/1/p2p/x"], "demo", timeout_s=13.0)
    # 6 s a try, then a 2 s pause: a second try would end at 14 s, past the deadline
    assert started == [0.0]


def test_a_start_that_ran_out_of_time_names_the_bootstrap_peers(monkeypatch):
    started = _slow_failing(monkeypatch, "the DHT worker did not start: TimeoutError()", try_s=5.0)
    with pytest.raises(DhtError, match=r"bootstrap peers \(/ip4/1\.2\.3\.4/tcp/1/p2p/x\).*Timeout"):
        status_module.gather(["/ip4/1.2.3.4/tcp/1/p2p/x"], "demo", timeout_s=5.0)
    assert started == [0.0]
