"""--announce-addr on 127.0.0.1: peers dial the announced port forward, not the listen port,
for the host (its addrs) and lanes (their offers), and frames still go over a lane; and a lane
to a peer that dialled us goes where it listens, not to the connection's source address."""

import pytest
import torch

from fusionllm.node.p2p.announce import AnnounceAddr
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.support.forwarder import Forwarder
from tests.support.transport_node import _WAIT_S, HEADER

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_peers_reach_the_host_and_its_lanes_through_announced_forwards(tmp_path):
    with Forwarder() as control_fwd, Forwarder() as lane_fwd:
        key = tmp_path / "receiver.key"
        announced = AnnounceAddr(host="127.0.0.1", port=control_fwd.port)
        host = PeerHost(HostConfig(key_path=key, announce=(announced,))).start()
        config = TransportConfig(key_path=key, lane_announce_port=lane_fwd.port)
        sender_config = TransportConfig(key_path=tmp_path / "sender.key")
        try:
            with Transport(config, host=host) as receiver, Transport(sender_config) as sender:
                assert receiver.addrs == [
                    f"/ip4/127.0.0.1/tcp/{control_fwd.port}/p2p/{host.peer_id}"
                ]
                control_fwd.target = int(host.bound_addrs[0].split("/")[4])
                lane_fwd.target = receiver.lane_port
                assert receiver.lane_port != lane_fwd.port
                sender.connect(receiver.addrs[0], timeout=_WAIT_S)
                tensor = torch.randn(1 << 18)  # 1 MiB
                sender.send_tensor(receiver.peer_id, HEADER, tensor, timeout=_WAIT_S)
                assert torch.equal(receiver.recv(timeout=_WAIT_S).tensor, tensor)
                assert sender.outbound_lanes() == [receiver.peer_id]
        finally:
            host.close()
        assert control_fwd.connections == 1
        assert lane_fwd.connections == 1
        assert lane_fwd.bytes_in > tensor.numel() * 4  # the frame went through the forward


def test_a_lane_to_a_peer_that_dialled_us_goes_where_it_listens(tmp_path):
    # The receiver listens on 127.0.0.2 and dials the sender: the connection comes from
    # 127.0.0.1, where no lane port listens (as a container's gateway address would).
    receiver_config = TransportConfig(key_path=tmp_path / "r.key", listen_host="127.0.0.2")
    with (
        Transport(receiver_config) as receiver,
        Transport(TransportConfig(key_path=tmp_path / "s.key")) as sender,
    ):
        receiver.connect(sender.addrs[0], timeout=_WAIT_S)
        tensor = torch.randn(1 << 16)
        sender.send_tensor(receiver.peer_id, HEADER, tensor, timeout=_WAIT_S)
        assert torch.equal(receiver.recv(timeout=_WAIT_S).tensor, tensor)
        assert sender.outbound_lanes() == [receiver.peer_id]  # a lane, not the stream
