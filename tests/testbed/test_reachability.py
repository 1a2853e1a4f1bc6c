"""Reachability on the testbed: members dial a node back (node/p2p/dialback.py) and the
verdict says public for a public host and private behind a cone or a symmetric NAT; and
py-libp2p 0.8.1's own AutoNAT v1, asked the same, answers OK behind NAT (why we dial back
ourselves: its server reuses the connection the request came on).

Bare PeerHost processes (real py-libp2p over the emulated links and real home routers).
"""

import pytest

from fusionllm.testbed.bed import Testbed
from fusionllm.testbed.topology import parse_topology
from tests.support.dialback_main import reachability
from tests.support.routers import needs_routers

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(240), needs_routers]

AUTONAT_OK = 0
TOPOLOGY = {
    "name": "reach",
    "defaults": {"delay_ms": 5},
    "hosts": [
        {"name": "m1"},
        {"name": "m2"},
        {"name": "pub"},
        {"name": "cone", "nat": "cone"},
        {"name": "sym", "nat": "symmetric"},
    ],
}


def test_members_dial_back_public_and_home_nodes_and_the_verdicts_say_which(tmp_path):
    with Testbed(parse_topology(TOPOLOGY)) as bed:
        verdicts = reachability(bed, ["m1", "m2"], ["pub", "cone", "sym"], tmp_path)
        print(verdicts)
        pub = verdicts["pub"]
        assert pub["verdict"] == "public", pub
        assert pub["addrs"] == [f"{bed.address('pub')}:{pub['port']}"]
        for home in ("cone", "sym"):
            seen = verdicts[home]
            assert seen["verdict"] == "private", seen
            assert seen["answers"] == [False, False]
            assert seen["observed_ips"] == [bed.wan_address(home)]  # its router's address
            # upstream AutoNAT v1 calls the unreachable node reachable
            assert seen["autonat_status"] == AUTONAT_OK, seen
        assert pub["autonat_status"] == AUTONAT_OK
