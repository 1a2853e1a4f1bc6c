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
