"""A members-only relay (node/p2p/member_relay.py) between testbed hosts, bare PeerHosts.

    python -m tests.support.relay_main relay KEY ADDR MEMBER_ID...   # {"event": "ready"},
                                                      # its counts when its stdin closes;
                                                      # dials members back (dialback.py)
    python -m tests.support.relay_main listener KEY ADDR RELAY       # {"event": "reserved"}
    python -m tests.support.relay_main dialer KEY ADDR RELAY LISTENER_ID  # one line, exits

The listener reserves a slot on the relay and answers an echo; the dialer opens a circuit
to it through the relay and says what came back, over which kind of connection.
"""

import json
import sys
from pathlib import Path

from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from fusionllm.node.p2p.dialback import DIALBACK_PROTOCOL, DialBackConfig, DialBackServer
from fusionllm.node.p2p.member_relay import MemberRelay, MemberRelayConfig
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from fusionllm.node.p2p.relay_addrs import relayed_addr
from fusionllm.node.p2p.relay_client import RelayClient

ECHO = TProtocol("/fusionllm/test-echo/1.0.0")


def _say(**event) -> None:
    print(json.dumps(event), flush=True)


async def _echo(stream) -> None:
    await stream.write(await stream.read(64))
    await stream.close()


async def _ask(libp2p, peer: ID) -> dict:
    stream = await libp2p.new_stream(peer, [ECHO])
    await stream.write(b"hello")
    answer = await stream.read(64)
    await stream.close()
    return {"answer": answer.decode(), "kind": stream.muxed_conn.get_connection_type().value}


def main(argv: list[str]) -> int:
    role, key, addr, *rest = argv
    host = PeerHost(HostConfig(key_path=Path(key), listen_host=addr, dial_timeout_s=10.0))
    host.start()
    if role == "relay":
        relay = MemberRelay(host, MemberRelayConfig(), is_member=set(rest).__contains__)
        relay.start()
        dialback = DialBackServer(DialBackConfig(), allow=set(rest).__contains__)
        host.set_stream_handler(DIALBACK_PROTOCOL, dialback.serve)  # members learn their reach
        _say(event="ready", addr=host.addrs[0])
        sys.stdin.read()
        _say(event="counts", **relay.counts)  # once the parent closed our stdin
        host.close()
        return 0
    client = RelayClient(host).start()
    relay_id = host.connect(rest[0])
    if role == "listener":
        host.set_stream_handler(ECHO, _echo)
        _say(event="reserved", ok=client.reserve(relay_id))
        sys.stdin.read()
    else:
        listener = ID.from_base58(rest[1])
        try:
            host.connect(relayed_addr(rest[0], rest[1]), timeout=20.0)
            _say(event="echo", **host.call(_ask, host.libp2p, listener))
        except Exception as exc:  # the stranger's dial fails: say how
            _say(event="echo", error=type(exc).__name__)
    host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
