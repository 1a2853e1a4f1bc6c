"""The lane port's bound on connections that have not shown a token: past it, one more is
refused and closed at once, whether accepted on the port or handed over by a hole punch."""

import trio
import trio.testing

from fusionllm.node.p2p.lane.listener import (
    _MAX_UNREDEEMED,
    LANE_BAD_TOKEN,
    LANE_CROWDED,
    LaneListener,
)
from fusionllm.node.p2p.lane.offer import Tickets


async def _never_served(peer, conn, key):
    raise AssertionError("no connection showed a token")


def test_one_connection_past_the_bound_is_refused_and_the_count_comes_back():
    refusals: list[str] = []
    listener = LaneListener(
        serve=_never_served, admit=lambda peer: True,
        refuse=lambda reason, who: refusals.append(reason),
        tickets=Tickets(per_peer=2, total=8, ttl_s=3.0), timeout_s=30.0,
    )  # fmt: skip

    async def main() -> None:
        pairs = [trio.socket.socketpair() for _ in range(_MAX_UNREDEEMED + 1)]
        async with trio.open_nursery() as nursery:
            for conn, _ in pairs[:-1]:
                nursery.start_soon(listener.redeem, conn)
            await trio.testing.wait_all_tasks_blocked()  # each waits for its token
            assert listener._unredeemed == _MAX_UNREDEEMED
            crowded, peer = pairs[-1]
            await listener.redeem(crowded)
            assert refusals == [LANE_CROWDED]
            assert await peer.recv(1) == b""  # closed by us: the peer sees the end
            for _, other in pairs[:-1]:
                other.close()  # they end without a token
        assert listener._unredeemed == 0
        assert refusals == [LANE_CROWDED] + [LANE_BAD_TOKEN] * _MAX_UNREDEEMED
        for _, other in pairs[-1:]:
            other.close()

    trio.run(main)
