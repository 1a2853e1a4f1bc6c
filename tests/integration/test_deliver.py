"""Transport.deliver_to: received frames handed over in the host's thread, skipping the inbox."""

import dataclasses
import queue

import torch

from fusionllm.compression import pack_tensor
from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.transport_types import Received
from tests.support.transport_node import HEADER, assert_node_still_echoes

_WAIT_S = 8.0


def test_the_hook_takes_frames_declines_some_to_recv_and_a_broken_hook_costs_one_frame(
    start_node, client
):
    node = start_node()
    client.connect(node.addr)
    taken: queue.Queue[Received] = queue.Queue()

    def deliver(item: Received) -> bool:
        if item.header.step == 1:
            return False  # left for recv
        if item.header.step == 2:
            raise RuntimeError("a broken hook")
        taken.put(item)
        return True

    client.deliver_to(deliver)
    for step in range(4):  # the node echoes each frame back with its header
        header = dataclasses.replace(HEADER, step=step)
        client.send(node.peer_id, header, pack_tensor(torch.full((4,), float(step))))
    got = [taken.get(timeout=_WAIT_S) for _ in range(2)]
    assert [(item.peer, item.header.step) for item in got] == [(node.peer_id, 0), (node.peer_id, 3)]
    assert torch.equal(got[1].tensor, torch.full((4,), 3.0))
    declined = client.recv(timeout=_WAIT_S)
    assert declined.header.step == 1
    assert torch.equal(declined.tensor, torch.full((4,), 1.0))
    try:
        extra = client.recv(timeout=0.5)
    except DeadlineError:
        extra = None
    assert extra is None, "the frame the hook failed on must not reach recv too"
    assert client.stats()[node.peer_id].errors == {}  # the hook's failure is not the peer's
    client.deliver_to(None)
    assert_node_still_echoes(client, node)  # back to recv, on the same stream
    assert taken.empty()
