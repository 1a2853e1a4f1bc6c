"""Relayed addresses (node/p2p/relay_client.py): made from a relay's address, read back."""

import pytest

from fusionllm.node.p2p.relay_addrs import is_relayed, relay_of, relayed_addr

RELAY = "/ip4/10.0.0.1/tcp/4001/p2p/QmRelay"


def test_a_relayed_address_names_the_relay_and_the_peer():
    addr = relayed_addr(RELAY, "QmHome")
    assert addr == "/ip4/10.0.0.1/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmHome"
    assert is_relayed(addr)
    assert relay_of(addr) == "QmRelay"


def test_a_direct_address_is_no_relayed_one():
    assert not is_relayed(RELAY)
    assert relay_of(RELAY) == ""


@pytest.mark.parametrize("bad", ["/ip4/10.0.0.1/tcp/4001", f"{RELAY}/p2p-circuit/p2p/QmX"])
def test_only_a_relays_direct_peer_address_makes_a_relayed_one(bad):
    with pytest.raises(ValueError, match="not a relay's peer address"):
        relayed_addr(bad, "QmHome")
