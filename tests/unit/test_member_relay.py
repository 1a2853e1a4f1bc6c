"""A member relay's limits (node/p2p/member_relay.py): sized for training, checked."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.p2p.member_relay import MemberRelayConfig


def test_the_limits_are_py_libp2ps_own_with_training_sized_figures():
    limits = MemberRelayConfig().limits()
    assert limits.data == 1 << 40  # py-libp2p cuts a circuit there (benchmarks/nat_relay.py)
    assert limits.duration == 24 * 3600
    assert (limits.max_circuit_conns, limits.max_reservations) == (16, 16)
    assert limits.reservation_ttl == 3600


@pytest.mark.parametrize(
    ("field", "value"),
    [("circuit_bytes", 1 << 10), ("circuit_s", 10), ("max_circuits", 0), ("max_reservations", 2.5)],
)
def test_a_limit_out_of_range_is_refused(field, value):
    with pytest.raises(ConfigError, match=f"{field} must be an int in"):
        MemberRelayConfig(**{field: value})
